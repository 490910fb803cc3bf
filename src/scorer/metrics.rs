//! Prometheus metrics of the scorer: decision latency per verb, rejections by reason, errors per verb,
//! and the ledger's size.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabel {
    pub verb: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

fn latency_histogram() -> Histogram {
    // 50 µs .. ~1.6 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

pub struct Metrics {
    registry: Registry,
    pub latency: Family<VerbLabel, Histogram, fn() -> Histogram>,
    pub rejections: Family<ReasonLabel, Counter>,
    pub errors: Family<VerbLabel, Counter>,
    pub ledger: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("gpumem_scorer");
        let latency =
            Family::<VerbLabel, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        let rejections = Family::<ReasonLabel, Counter>::default();
        let errors = Family::<VerbLabel, Counter>::default();
        let ledger = Gauge::default();
        registry.register(
            "decision_seconds",
            "Time to answer one extender call, by verb",
            latency.clone(),
        );
        registry.register(
            "rejections",
            "Nodes rejected by filter, by reason",
            rejections.clone(),
        );
        registry.register(
            "errors",
            "Extender calls answered with an error, by verb",
            errors.clone(),
        );
        registry.register(
            "ledger_reservations",
            "Binds made whose GPUs the node annotations do not show yet",
            ledger.clone(),
        );
        Metrics {
            registry,
            latency,
            rejections,
            errors,
            ledger,
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
