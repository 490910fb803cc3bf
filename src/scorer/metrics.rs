//! Prometheus metrics of the scorer, under the names the deployed dashboard and alerts query
//! (`deploy/helm/gpumem/dashboards/gpumem.json`, `templates/prometheusrule.yaml`):
//!
//! - `gpumem_scorer_request_duration_seconds{verb}`: time to answer one extender call (histogram);
//! - `gpumem_scorer_filter_rejections_total{reason}`: nodes `filter` rejected, by reason;
//! - `gpumem_cluster_fragmentation_ratio`, `gpumem_node_fragmentation_ratio{node}`: the share of idle GPU
//!   memory the typical task mix cannot use (the placement policy's measure);
//! - `gpumem_cluster_gpu_memory_allocated_ratio`: allocated GPU memory over total, healthy GPUs;
//!
//! and, beyond what the dashboards use, `gpumem_scorer_errors_total{verb}`,
//! `gpumem_scorer_verb_requests_total{protocol}` (extender calls by HTTP version: kube-scheduler
//! should speak HTTP/2, see [`crate::http`]),
//! `gpumem_scorer_bind_failures_total{kind}` (see [`super::bind::BindError::kind`]),
//! `gpumem_scorer_ledger_reservations`, `gpumem_scorer_holds` and
//! `gpumem_scorer_binds_past_holds_total` (see [`super::holds`]), `gpumem_scorer_binds_total{hold}` (binds
//! by where kube-scheduler sent the pod against where `prioritize` held room for it), and `gpumem_scorer_mix_pods_seen` /
//! `gpumem_scorer_mix_generation` (the pods the typical mix was learned from, and how often it moved:
//! generation 0 is the configured `typicalMix`), `gpumem_scorer_dra_claims_placed_total` and
//! `gpumem_scorer_dra_leading`, `gpumem_scorer_dra_preempted_total` (placement on the DRA path: the placer, `src/placer/`). The three cluster gauges are computed when scraped (see
//! [`super::Scorer::refresh_gauges`]), at most once per [`GAUGE_PERIOD`].

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The cluster gauges are recomputed at most this often.
pub const GAUGE_PERIOD: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabel {
    pub verb: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

/// Where a bind went against the pod's hold: `on_hold` (the node `prioritize` ranked first),
/// `elsewhere` (kube-scheduler's own scores chose another node), `none` (no hold: kube-scheduler skips
/// `prioritize` when one node passes `filter`, or the hold had ended).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HoldLabel {
    pub hold: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProtocolLabel {
    pub protocol: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabel {
    pub node: String,
}

/// A gauge holding a float.
pub type Ratio = Gauge<f64, AtomicU64>;

fn latency_histogram() -> Histogram {
    // 50 µs .. ~1.6 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

pub struct Metrics {
    registry: Registry,
    pub latency: Family<VerbLabel, Histogram, fn() -> Histogram>,
    pub rejections: Family<ReasonLabel, Counter>,
    pub errors: Family<VerbLabel, Counter>,
    pub protocols: Family<ProtocolLabel, Counter>,
    pub bind_failures: Family<KindLabel, Counter>,
    pub booking_conflicts: Counter,
    pub ledger: Gauge,
    pub holds: Gauge,
    pub binds_past_holds: Counter,
    pub binds: Family<HoldLabel, Counter>,
    pub cluster_fragmentation: Ratio,
    pub node_fragmentation: Family<NodeLabel, Ratio>,
    pub cluster_allocated: Ratio,
    pub mix_pods_seen: Gauge,
    pub mix_generation: Gauge,
    pub dra_placed: Counter,
    pub dra_leading: Gauge,
    /// Pods the placer left to kube-scheduler unplaced, by why (a short kind).
    pub dra_released: Family<KindLabel, Counter>,
    /// Claims the placer gave back because kube-scheduler could not schedule their pod there.
    pub dra_given_back: Counter,
    /// Pods the DRA placer evicted to make room for a gated pod of higher priority.
    pub dra_preempted: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let latency =
            Family::<VerbLabel, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        let rejections = Family::<ReasonLabel, Counter>::default();
        let errors = Family::<VerbLabel, Counter>::default();
        let protocols = Family::<ProtocolLabel, Counter>::default();
        let bind_failures = Family::<KindLabel, Counter>::default();
        let booking_conflicts = Counter::default();
        let ledger = Gauge::default();
        let holds = Gauge::default();
        let binds_past_holds = Counter::default();
        let binds = Family::<HoldLabel, Counter>::default();
        let cluster_fragmentation = Ratio::default();
        let node_fragmentation = Family::<NodeLabel, Ratio>::default();
        let cluster_allocated = Ratio::default();
        let mix_pods_seen = Gauge::default();
        let mix_generation = Gauge::default();
        let dra_placed = Counter::default();
        let dra_leading = Gauge::default();
        let dra_released = Family::<KindLabel, Counter>::default();
        let dra_given_back = Counter::default();
        let dra_preempted = Counter::default();
        registry.register(
            "gpumem_scorer_dra_released",
            "Pods with claims of gpumem's classes the placer left to kube-scheduler unplaced, by kind of reason",
            dra_released.clone(),
        );
        registry.register(
            "gpumem_scorer_dra_given_back",
            "Claims the placer gave back to kube-scheduler after it found their pod unschedulable there for 30 s",
            dra_given_back.clone(),
        );
        registry.register(
            "gpumem_scorer_dra_preempted",
            "Pods the placer evicted to make GPU room for a gated pod of higher priority",
            dra_preempted.clone(),
        );
        registry.register(
            "gpumem_scorer_dra_claims_placed",
            "ResourceClaims this replica allocated on the DRA path (dra in the configuration)",
            dra_placed.clone(),
        );
        registry.register(
            "gpumem_scorer_dra_leading",
            "1 while this replica holds the DRA placement Lease and places claims",
            dra_leading.clone(),
        );
        registry.register(
            "gpumem_scorer_mix_pods_seen",
            "GPU pods the scorer ranked and learned its typical mix from (since it started)",
            mix_pods_seen.clone(),
        );
        registry.register(
            "gpumem_scorer_mix_generation",
            "How often the learned typical mix moved; 0: still the configured typicalMix",
            mix_generation.clone(),
        );
        registry.register(
            "gpumem_scorer_request_duration_seconds",
            "Time to answer one extender call, by verb",
            latency.clone(),
        );
        // Counters get `_total` appended.
        registry.register(
            "gpumem_scorer_filter_rejections",
            "Nodes rejected by filter, by reason",
            rejections.clone(),
        );
        registry.register(
            "gpumem_scorer_errors",
            "Extender calls answered with an error, by verb",
            errors.clone(),
        );
        registry.register(
            "gpumem_scorer_verb_requests",
            "Extender calls received, by HTTP version",
            protocols.clone(),
        );
        registry.register(
            "gpumem_scorer_bind_failures",
            "Binds refused, by kind (bad_request, not_bindable, does_not_fit, forbidden, not_found, conflict, ...)",
            bind_failures.clone(),
        );
        registry.register(
            "gpumem_scorer_booking_conflicts",
            "Binds whose booking another replica's booking on the same node beat (each chose again)",
            booking_conflicts.clone(),
        );
        registry.register(
            "gpumem_scorer_ledger_reservations",
            "Binds made whose GPUs the node annotations do not show yet",
            ledger.clone(),
        );
        registry.register(
            "gpumem_scorer_holds",
            "GPUs held for pods ranked by prioritize whose bind has not arrived yet",
            holds.clone(),
        );
        registry.register(
            "gpumem_scorer_binds_past_holds",
            "Binds that found room only under other pods' holds and took it (a hold guessed another node)",
            binds_past_holds.clone(),
        );
        registry.register(
            "gpumem_scorer_binds",
            "Binds received, by where kube-scheduler sent the pod against its hold (on_hold, elsewhere, none)",
            binds.clone(),
        );
        registry.register(
            "gpumem_cluster_fragmentation_ratio",
            "Share of the idle GPU memory (healthy GPUs) the typical task mix cannot use, over the nodes the scorer knows",
            cluster_fragmentation.clone(),
        );
        registry.register(
            "gpumem_node_fragmentation_ratio",
            "Share of the node's idle GPU memory (healthy GPUs) the typical task mix cannot use",
            node_fragmentation.clone(),
        );
        registry.register(
            "gpumem_cluster_gpu_memory_allocated_ratio",
            "Allocated GPU memory over total, healthy GPUs of the nodes the scorer knows",
            cluster_allocated.clone(),
        );
        Metrics {
            registry,
            latency,
            rejections,
            errors,
            protocols,
            bind_failures,
            booking_conflicts,
            holds,
            binds_past_holds,
            binds,
            ledger,
            cluster_fragmentation,
            node_fragmentation,
            cluster_allocated,
            mix_pods_seen,
            mix_generation,
            dra_placed,
            dra_leading,
            dra_released,
            dra_given_back,
            dra_preempted,
        }
    }

    /// Sets the cluster gauges.
    pub fn set_fragmentation(&self, f: &super::decide::Fragmentation) {
        self.cluster_fragmentation.set(f.cluster);
        self.cluster_allocated.set(f.allocated);
        self.node_fragmentation.clear();
        for (node, ratio) in &f.nodes {
            self.node_fragmentation
                .get_or_create(&NodeLabel { node: node.clone() })
                .set(*ratio);
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
