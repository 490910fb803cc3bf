//! The agent's Prometheus metrics, served on `--metrics-listen` at `/metrics`, and `/healthz`: whether
//! the agent's own loops are alive ([`Liveness`]; no NVML call, so a hung GPU cannot fail it).
//!
//! Per GPU: memory total, allocated through the two resources, and used (as NVML sees it, and as
//! the shim counts it in the containers); utilization, temperature, power; health, XIDs, pods.
//! Per resource: registered with the kubelet, request latency, refused allocations.
//! Per reason: container accounting files the agent refused to read.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::enforcement::Enforcement;
use super::state::NodeState;
use crate::gpu::NvmlSource;
use crate::http::Limits;
use crate::liveness::Liveness;
use crate::node::GpuMode;

/// Every metric name the agent exports (the deploy tests hold dashboards and alerts to these).
pub const EXPORTED: &[&str] = &[
    "gpumem_gpu_memory_total_bytes",
    "gpumem_gpu_memory_allocated_bytes",
    "gpumem_gpu_memory_used_bytes",
    "gpumem_gpu_utilization_ratio",
    "gpumem_gpu_temperature_celsius",
    "gpumem_gpu_power_watts",
    "gpumem_gpu_healthy",
    "gpumem_gpu_xid_errors_total",
    "gpumem_gpu_pods",
    "gpumem_plugin_registered",
    "gpumem_plugin_request_duration_seconds",
    "gpumem_plugin_allocation_failures_total",
    "gpumem_accounting_rejected_total",
];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Gpu {
    gpu: String,
    uuid: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuModel {
    gpu: String,
    uuid: String,
    model: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuSource {
    gpu: String,
    uuid: String,
    source: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuIndex {
    gpu: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuXid {
    gpu: String,
    xid: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Resource {
    resource: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceMethod {
    resource: String,
    method: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceReason {
    resource: String,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RejectionReason {
    reason: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;

fn latency_histogram() -> Histogram {
    // 10 µs .. ~0.3 s.
    Histogram::new(exponential_buckets(0.000_01, 2.0, 16))
}

pub struct AgentMetrics {
    registry: Registry,
    memory_total: Family<GpuModel, Gauge>,
    memory_allocated: Family<Gpu, Gauge>,
    memory_used: Family<GpuSource, Gauge>,
    utilization: Family<GpuIndex, FloatGauge>,
    temperature: Family<GpuIndex, Gauge>,
    power: Family<GpuIndex, FloatGauge>,
    healthy: Family<Gpu, Gauge>,
    xids: Family<GpuXid, Counter>,
    pods: Family<GpuIndex, Gauge>,
    registered: Family<Resource, Gauge>,
    request_duration: Family<ResourceMethod, Histogram, fn() -> Histogram>,
    failures: Family<ResourceReason, Counter>,
    accounting_rejected: Family<RejectionReason, Counter>,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl AgentMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gpumem");
        let metrics = Self {
            registry: Registry::default(),
            memory_total: Family::default(),
            memory_allocated: Family::default(),
            memory_used: Family::default(),
            utilization: Family::default(),
            temperature: Family::default(),
            power: Family::default(),
            healthy: Family::default(),
            xids: Family::default(),
            pods: Family::default(),
            registered: Family::default(),
            request_duration: Family::new_with_constructor(latency_histogram),
            failures: Family::default(),
            accounting_rejected: Family::default(),
        };
        let m = &metrics;
        registry.register("gpu_memory_total_bytes", "GPU memory", m.memory_total.clone());
        registry.register(
            "gpu_memory_allocated_bytes",
            "GPU memory handed out (whole GPUs count in full)",
            m.memory_allocated.clone(),
        );
        registry.register(
            "gpu_memory_used_bytes",
            "GPU memory in use: source=nvml for every process, source=shim for gpumem's containers",
            m.memory_used.clone(),
        );
        registry.register(
            "gpu_utilization_ratio",
            "GPU busy time, 0..1",
            m.utilization.clone(),
        );
        registry.register(
            "gpu_temperature_celsius",
            "GPU temperature",
            m.temperature.clone(),
        );
        registry.register("gpu_power_watts", "GPU power draw", m.power.clone());
        registry.register(
            "gpu_healthy",
            "1 if the GPU is offered, 0 if unhealthy",
            m.healthy.clone(),
        );
        registry.register(
            "gpu_xid_errors",
            "XID errors seen, ignored ones included",
            m.xids.clone(),
        );
        registry.register("gpu_pods", "Pods with an allocation on the GPU", m.pods.clone());
        registry.register(
            "plugin_registered",
            "1 while registered with the kubelet",
            m.registered.clone(),
        );
        registry.register(
            "plugin_request_duration_seconds",
            "Time to answer the kubelet, by method",
            m.request_duration.clone(),
        );
        registry.register(
            "plugin_allocation_failures",
            "Requests the agent refused, by reason",
            m.failures.clone(),
        );
        registry.register(
            "accounting_rejected",
            "Reads of a container's accounting file refused (not counted in source=shim), by reason",
            m.accounting_rejected.clone(),
        );
        Self { registry, ..metrics }
    }

    pub fn observe_request(&self, resource: &str, method: &'static str, seconds: f64) {
        let labels = ResourceMethod {
            resource: resource.into(),
            method,
        };
        self.request_duration.get_or_create(&labels).observe(seconds);
    }

    pub fn refused(&self, resource: &str, reason: &'static str) {
        self.failures
            .get_or_create(&ResourceReason {
                resource: resource.into(),
                reason,
            })
            .inc();
    }

    fn rejected_accounting(&self, reason: gpumem_accounting::Reason) {
        self.accounting_rejected
            .get_or_create(&RejectionReason {
                reason: reason.as_str(),
            })
            .inc();
    }

    pub fn xid(&self, gpu: u32, xid: u64) {
        self.xids
            .get_or_create(&GpuXid {
                gpu: gpu.to_string(),
                xid: xid.to_string(),
            })
            .inc();
    }

    pub fn set_registered(&self, resource: &str, registered: bool) {
        self.registered
            .get_or_create(&Resource {
                resource: resource.into(),
            })
            .set(i64::from(registered));
    }

    /// Reads the current picture into the gauges (NVML calls block: run off the async runtime).
    pub fn refresh(&self, state: &NodeState, nvml: Option<&NvmlSource>, enforcement: Option<&Enforcement>) {
        let usage = state.usage();
        let held = enforcement
            .map(|e| e.held(&state.live_allocations()))
            .unwrap_or_default();
        for &reason in &held.refused {
            self.rejected_accounting(reason);
        }
        for (a, gpu) in state.inventory.gpus.iter().enumerate() {
            let (index, uuid) = (gpu.index.to_string(), gpu.uuid.clone());
            let labels = Gpu {
                gpu: index.clone(),
                uuid: uuid.clone(),
            };
            let bytes = |mib: u64| i64::try_from(mib.saturating_mul(1 << 20)).unwrap_or(i64::MAX);
            self.memory_total
                .get_or_create(&GpuModel {
                    gpu: index.clone(),
                    uuid: uuid.clone(),
                    model: gpu.product.clone(),
                })
                .set(bytes(gpu.memory_mib));
            let row = usage.gpus.get(a);
            self.memory_allocated
                .get_or_create(&labels)
                .set(bytes(row.map_or(0, |u| u.allocated_mib)));
            let pods = row
                .filter(|u| u.mode != GpuMode::Free)
                .map_or(0, |u| u.pods.len());
            self.pods
                .get_or_create(&GpuIndex { gpu: index.clone() })
                .set(pods as i64);
            self.healthy
                .get_or_create(&labels)
                .set(i64::from(state.is_healthy(a)));
            let shim = GpuSource {
                gpu: index.clone(),
                uuid: uuid.clone(),
                source: "shim",
            };
            self.memory_used
                .get_or_create(&shim)
                .set(i64::try_from(held.on_gpu(gpu.index)).unwrap_or(i64::MAX));
            if let Some(reading) = nvml.and_then(|n| n.telemetry(gpu.index).ok()) {
                let nvml_used = GpuSource {
                    gpu: index.clone(),
                    uuid,
                    source: "nvml",
                };
                self.memory_used
                    .get_or_create(&nvml_used)
                    .set(i64::try_from(reading.memory_used_bytes).unwrap_or(i64::MAX));
                let idx = GpuIndex { gpu: index };
                if let Some(v) = reading.utilization_ratio {
                    self.utilization.get_or_create(&idx).set(v);
                }
                if let Some(v) = reading.temperature_celsius {
                    self.temperature.get_or_create(&idx).set(i64::from(v));
                }
                if let Some(v) = reading.power_watts {
                    self.power.get_or_create(&idx).set(v);
                }
            }
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// Everything a scrape needs.
pub struct Scrape {
    pub metrics: Arc<AgentMetrics>,
    pub state: Arc<NodeState>,
    pub nvml: Option<Arc<NvmlSource>>,
    pub enforcement: Option<Arc<Enforcement>>,
    pub liveness: Arc<Liveness>,
}

/// Serves `/metrics` and `/healthz` on `addr` until the process ends.
pub async fn serve(addr: SocketAddr, scrape: Arc<Scrape>) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen for metrics on {addr}: {e}"))?;
    tracing::info!(%addr, "serving /metrics and /healthz");
    let handler = move |req: Request<crate::http::Body>| {
        let scrape = Arc::clone(&scrape);
        async move { answer(req.uri().path(), scrape).await }
    };
    crate::http::serve(listener, Limits::default(), None, handler, std::future::pending()).await;
    Ok(())
}

async fn answer(path: &str, scrape: Arc<Scrape>) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match path {
        "/metrics" => {
            let text = tokio::task::spawn_blocking(move || {
                scrape.metrics.refresh(
                    &scrape.state,
                    scrape.nvml.as_deref(),
                    scrape.enforcement.as_deref(),
                );
                scrape.metrics.encode()
            })
            .await
            .unwrap_or_default();
            (
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                text,
            )
        }
        "/healthz" => {
            let verdict = scrape.liveness.check();
            let status = if verdict.alive {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, "text/plain; charset=utf-8", verdict.report)
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /metrics or /healthz\n".to_string(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response.headers_mut().insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::state::HealthPolicy;
    use crate::gpu::GpuInventory;
    use gpumem_profile::Profile;

    #[test]
    fn every_exported_name_is_encoded_and_nothing_else() {
        let inventory = GpuInventory::discover(&Profile::load("t4x4").unwrap()).unwrap();
        let state = NodeState::new(
            inventory,
            1024,
            "nvidia.com/gpu".into(),
            "nvidia.com/gpu-mem".into(),
            HealthPolicy {
                ignored_xids: vec![],
                quiet_period: std::time::Duration::ZERO,
            },
        );
        state
            .allocate_mem(&["1-0".to_string(), "1-1".to_string()])
            .unwrap();
        let metrics = AgentMetrics::new();
        metrics.observe_request("nvidia.com/gpu-mem", "Allocate", 0.0002);
        metrics.refused("nvidia.com/gpu", "unavailable");
        metrics.xid(1, 79);
        metrics.rejected_accounting(gpumem_accounting::Reason::Size);
        metrics.set_registered("nvidia.com/gpu", true);
        // Telemetry-only gauges need NVML; give them one value so the encoding shows them.
        metrics
            .utilization
            .get_or_create(&GpuIndex { gpu: "0".into() })
            .set(0.5);
        metrics
            .temperature
            .get_or_create(&GpuIndex { gpu: "0".into() })
            .set(40);
        metrics
            .power
            .get_or_create(&GpuIndex { gpu: "0".into() })
            .set(70.0);
        metrics.refresh(&state, None, None);
        let text = metrics.encode();
        let mut seen: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        seen.sort_unstable();
        let mut expected: Vec<&str> = EXPORTED
            .iter()
            .map(|n| n.strip_suffix("_total").unwrap_or(n))
            .collect();
        expected.sort_unstable();
        assert_eq!(seen, expected);
        assert!(
            text.contains(r#"gpumem_gpu_memory_allocated_bytes{gpu="1""#),
            "{text}"
        );
        assert!(
            text.contains("gpumem_gpu_xid_errors_total{gpu=\"1\",xid=\"79\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("gpumem_accounting_rejected_total{reason=\"size\"} 1"),
            "{text}"
        );
        let allocated = text
            .lines()
            .find(|l| l.starts_with("gpumem_gpu_memory_allocated_bytes{gpu=\"1\""))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap();
        assert_eq!(allocated, (2u64 * 1024 * 1024 * 1024).to_string());
    }
}
