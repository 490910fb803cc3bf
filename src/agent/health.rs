//! GPU health: critical XID events from NVML, and a periodic probe that notices a GPU that stopped
//! answering and, after a quiet period, one that is fine again.

use std::sync::Arc;
use std::time::Duration;

use crate::gpu::{EVENT_RETRY_MAX, GpuEvent, NvmlSource};

use super::metrics::AgentMetrics;
use super::state::NodeState;
use crate::liveness::Liveness;

/// The XID watch is not alive once NVML has failed it for this long: three tries in a row at the
/// longest pause between tries. A running watch makes progress every 200 ms.
pub const XID_WATCH_MAX_SILENCE: Duration = EVENT_RETRY_MAX.saturating_mul(3);

/// Starts the XID watch and the probe, each on its own thread (NVML calls block). The XID watch
/// reports to `liveness`; the probe does not (a hung GPU blocks it, and must not cost the agent).
pub fn spawn(
    nvml: Arc<NvmlSource>,
    state: Arc<NodeState>,
    metrics: Arc<AgentMetrics>,
    liveness: &Arc<Liveness>,
    probe_interval: Duration,
) -> anyhow::Result<()> {
    let heartbeat = liveness.lasting("XID watch", XID_WATCH_MAX_SILENCE);
    let events = nvml.health_events(move || heartbeat.beat())?;
    let position = {
        let state = Arc::clone(&state);
        move |index: u32| state.inventory.gpus.iter().position(|g| g.index == index)
    };
    let watcher_state = Arc::clone(&state);
    std::thread::Builder::new()
        .name("xid-watch".into())
        .spawn(move || {
            loop {
                match events.next(Duration::from_secs(1)) {
                    Ok(Some(GpuEvent::Xid { index, xid, .. })) => {
                        metrics.xid(index, xid);
                        match position(index) {
                            Some(a) => watcher_state.record_xid(a, xid),
                            None => tracing::warn!(index, xid, "XID on a GPU this agent does not serve"),
                        }
                    }
                    Ok(Some(GpuEvent::Lost { index: Some(index) })) => {
                        if let Some(a) = position(index) {
                            watcher_state.record_lost(a);
                        }
                    }
                    // NVML could not say which GPU: the next probe finds it.
                    Ok(Some(GpuEvent::Lost { index: None })) | Ok(None) => {}
                    Err(err) => {
                        tracing::error!(error = %err, "XID watch thread ended; lost-GPU probes go on");
                        return;
                    }
                }
            }
        })?;
    std::thread::Builder::new()
        .name("gpu-probe".into())
        .spawn(move || {
            loop {
                for (a, gpu) in state.inventory.gpus.iter().enumerate() {
                    match nvml.memory_used_mib(gpu.index) {
                        Ok(_) => state.record_answered(a),
                        Err(err) => {
                            if state.is_healthy(a) {
                                tracing::warn!(gpu = gpu.index, error = %err, "GPU probe failed");
                            }
                            state.record_lost(a);
                        }
                    }
                }
                std::thread::sleep(probe_interval);
            }
        })?;
    Ok(())
}
