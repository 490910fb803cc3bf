//! `gpumem agent`: the DaemonSet on every GPU node. Two device plugins (whole GPUs and GPU memory)
//! in one process, sharing one picture of the node: discovery, health, and what the kubelet has
//! handed out.

pub mod apiserver;
pub mod cdi;
pub mod config;
pub mod dra;
pub mod enforcement;
mod health;
pub mod metrics;
pub mod resource;
pub mod restart;
pub mod share;
pub mod slice;
pub mod state;

use std::sync::Arc;

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::gpu::{GpuInventory, NvmlSource};
use crate::liveness::Liveness;
use crate::plugin::devices;
use crate::plugin::podresources::PodResources;
use crate::plugin::proto::KUBELET_MAX_RECV_BYTES;
use crate::plugin::registration;
use crate::plugin::server::Plugin;
use apiserver::ApiServer;
pub use config::{AgentArgs, AgentConfig, MemCounting, MemoryLimits, Mode};
use enforcement::Enforcement;
use resource::{NodeResource, ResourceKind};
use state::{HealthPolicy, NodeState, ShareSlots};

/// How often prepared DRA claims are checked against the cluster's (adopted, or forgotten).
const STALE_CLAIMS_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// Socket file names in the device-plugin directory.
pub const GPU_SOCKET: &str = "gpumem-gpu.sock";
pub const MEM_SOCKET: &str = "gpumem-gpu-mem.sock";
pub const SHARE_SOCKET: &str = "gpumem-gpu-share.sock";

pub fn run(args: &AgentArgs) -> anyhow::Result<()> {
    let config = AgentConfig::load(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(serve(config))
}

async fn serve(config: AgentConfig) -> anyhow::Result<()> {
    let (inventory, nvml) = match &config.profile {
        Some(name) => {
            let profile = gpumem_profile::Profile::load(name)?;
            tracing::warn!(profile = %profile.name, "serving a SIMULATED node: no real GPU behind these devices");
            (GpuInventory::discover(&profile)?, None)
        }
        None => {
            let nvml = NvmlSource::open(config.nvml_lib.as_deref())?;
            (GpuInventory::discover(&nvml)?, Some(Arc::new(nvml)))
        }
    };
    tracing::info!(
        gpus = inventory.gpus.len(),
        driver = %inventory.driver_version,
        mem_unit_mib = config.mem_unit_mib,
        "GPUs discovered"
    );
    for warning in gpus_below_one_unit(&inventory, config.mem_unit_mib, &config.mem_resource)? {
        tracing::warn!(mem_unit_mib = config.mem_unit_mib, "{warning}");
    }
    let mut state = NodeState::new(
        inventory,
        config.mem_unit_mib,
        config.gpu_resource.clone(),
        config.mem_resource.clone(),
        HealthPolicy {
            ignored_xids: config.ignored_xids.clone(),
            quiet_period: config.health_quiet_period,
        },
    );
    if config.mem_counting == MemCounting::Shares {
        state = state.with_shares(ShareSlots {
            resource: config.share_resource.clone(),
            per_gpu: config.shares_per_gpu,
        });
    }
    let state = Arc::new(state);

    // The first picture of what is in use comes before the first device list: after a restart the
    // agent must not offer what running pods hold.
    let pod_resources = Arc::new(PodResources::new(
        config.pod_resources_socket.clone(),
        Arc::clone(&state) as Arc<dyn crate::plugin::podresources::Allocations>,
    ));
    if let Err(err) = pod_resources.refresh_now().await {
        tracing::warn!(error = %err, "starting without the kubelet's allocations; will keep asking");
    }
    tokio::spawn(Arc::clone(&pod_resources).poll(config.pod_resources_poll));
    let metrics = Arc::new(metrics::AgentMetrics::new());
    let liveness = Arc::new(Liveness::default());
    if let Some(nvml) = &nvml {
        health::spawn(
            Arc::clone(nvml),
            Arc::clone(&state),
            Arc::clone(&metrics),
            &liveness,
            config.health_probe_interval,
        )?;
    }

    let enforcement = match config.memory_limits {
        MemoryLimits::Enforce => {
            let enforcement = Arc::new(Enforcement::prepare(&config.state_dir, &config.shim_path)?);
            let every = config.pod_resources_poll;
            tokio::spawn(forget_gone_containers(
                Arc::clone(&enforcement),
                Arc::clone(&state),
                every,
            ));
            Some(enforcement)
        }
        MemoryLimits::Off => {
            tracing::warn!("memory limits are OFF: gpu-mem pods can use more GPU memory than they asked for");
            None
        }
    };

    let api_server = match &config.node_name {
        Some(node) => match ApiServer::connect(node.clone()).await {
            Ok(api_server) => Some(Arc::new(api_server)),
            Err(err) => {
                tracing::warn!(error = %err, "no API server: not publishing the Node's GPU picture");
                None
            }
        },
        None => {
            tracing::info!("no --node-name (NODE_NAME): not publishing the Node's GPU picture");
            None
        }
    };

    let node = match &api_server {
        Some(api_server) => api_server.node().await,
        None => None,
    };
    let meta = node.as_ref().map(|n| &n.metadata);
    let annotations = meta.as_ref().and_then(|m| m.annotations.as_ref());
    let labels = meta.as_ref().and_then(|m| m.labels.as_ref());
    let mode = match &api_server {
        Some(api_server) => node_mode(config.mode, labels.and_then(|l| l.get(MODE_LABEL)), api_server).await,
        None => config.mode,
    };
    // A mark the previous agent left on SIGTERM stays until the kubelet counts this one's devices.
    let inherited = annotations
        .and_then(|a| a.get(crate::node::AGENT_RESTARTING_ANNOTATION))
        .and_then(|v| v.parse().ok());
    let fence = Arc::new(restart::Fence::new(inherited));
    tracing::info!(?mode, "serving the GPUs");

    // The metrics server carries the liveness probe: an agent without it (its port taken) exits, and
    // the DaemonSet's restart shows the error, rather than running unprobed.
    let mut metrics_server = config.metrics_listen.map(|addr| {
        let scrape = metrics::Scrape {
            metrics: Arc::clone(&metrics),
            state: Arc::clone(&state),
            nvml: nvml.clone(),
            enforcement: enforcement.clone(),
            liveness: Arc::clone(&liveness),
        };
        tokio::spawn(metrics::serve(addr, Arc::new(scrape)))
    });

    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let mut plugins = JoinSet::new();
    match mode {
        Mode::Dra => {
            let (Some(api_server), Some(node)) = (&api_server, &config.node_name) else {
                anyhow::bail!(
                    "mode dra needs the API server (the claims' allocations are there) and --node-name \
                     (NODE_NAME): neither may be missing"
                );
            };
            api_server.remove_capacity(&config.mem_resource).await;
            let client = api_server.client();
            let driver = Arc::new(dra::DraDriver::start(
                &config.dra,
                node.clone(),
                Arc::clone(&state),
                Arc::new(client.clone()),
                enforcement.clone(),
                config.device_list_strategy,
                Arc::clone(&metrics),
                &config.state_dir,
            )?);
            tokio::spawn({
                let driver = Arc::clone(&driver);
                async move {
                    let mut adopt = true;
                    loop {
                        adopt = !driver.reconcile(adopt).await;
                        tokio::time::sleep(STALE_CLAIMS_EVERY).await;
                    }
                }
            });
            let sysfs = nvml.is_some().then(|| std::path::Path::new("/sys"));
            let roots = crate::gpu::pcie_roots(&state.inventory, sysfs);
            tokio::spawn(slice::publish(
                client,
                Arc::clone(&state),
                config.dra.driver_name.clone(),
                node.clone(),
                roots,
            ));
            // The kubelet retries a claim's preparation: nothing to fence.
            fence.lift();
            plugins.spawn(crate::plugin::dra::run(
                driver,
                crate::plugin::dra::DraSockets::new(
                    &config.dra.driver_name,
                    config.dra.endpoint(),
                    &config.dra.registry_dir,
                ),
                Arc::clone(&liveness),
                shutdown_rx.clone(),
            ));
        }
        Mode::DevicePlugin => {
            if config.mem_counting == MemCounting::Shares {
                let Some(api_server) = &api_server else {
                    anyhow::bail!(
                        "memCounting shares needs the API server and --node-name (NODE_NAME): the agent \
                         writes the node's {} and reads each share's size from its pod",
                        config.mem_resource
                    );
                };
                tokio::spawn(Arc::clone(api_server).publish_capacity(Arc::clone(&state)));
                tokio::spawn(
                    Arc::clone(api_server).watch_shares(Arc::clone(&state), config.pod_resources_poll),
                );
            }
            if let (Some(api_server), Some(node)) = (&api_server, &config.node_name) {
                // A slice left by the DRA path would offer the same GPUs twice.
                if let Err(err) = slice::delete(api_server.client(), &config.dra.driver_name, node).await {
                    tracing::debug!(error = %format!("{err:#}"), "no ResourceSlice of the DRA path removed");
                }
            }
            let served = serve_device_plugins(
                &config,
                &state,
                &pod_resources,
                &enforcement,
                &api_server,
                &metrics,
                &liveness,
                &fence,
                &mut plugins,
                &shutdown_rx,
            )
            .await;
            fence.expect(served.iter().map(String::as_str));
            if fence.mark().is_some() {
                tokio::spawn(restart::lift_when_counted(
                    Arc::clone(&fence),
                    Arc::clone(&pod_resources),
                ));
            }
        }
    }

    if let Some(api_server) = &api_server {
        let kubelet = node.as_ref().and_then(|n| n.status.as_ref()?.node_info.as_ref());
        let kubelet = kubelet.map_or("", |info| info.kubelet_version.as_str());
        report_listed_units(api_server, &state, mode, config.mem_counting, kubelet).await;
        // Published once the picture is whole: on the DRA path, after the prepared claims are back.
        tokio::spawn(Arc::clone(api_server).publish(Arc::clone(&state), Arc::clone(&fence)));
        if let Some(enforcement) = &enforcement
            && !config.used_report_interval.is_zero()
        {
            tokio::spawn(Arc::clone(api_server).publish_used(
                Arc::clone(&state),
                Arc::clone(enforcement),
                config.used_report_interval,
            ));
        }
    }

    let mut terminate = signal(SignalKind::terminate())?;
    let outcome = tokio::select! {
        _ = terminate.recv() => {
            if mode == Mode::DevicePlugin && api_server.is_some() {
                drain(&fence).await;
            }
            tracing::info!("SIGTERM: stopping");
            Ok(())
        }
        _ = tokio::signal::ctrl_c() => { tracing::info!("interrupted: stopping"); Ok(()) }
        Some(ended) = plugins.join_next() => match ended {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => Err(err),
            Err(err) => Err(anyhow::anyhow!("device plugin task failed: {err}")),
        },
        Some(ended) = async { Some(metrics_server.as_mut()?.await) } => match ended {
            Ok(Err(err)) => Err(err),
            Ok(Ok(())) => Err(anyhow::anyhow!("the metrics server stopped")),
            Err(err) => Err(anyhow::anyhow!("metrics server task failed: {err}")),
        },
    };
    let _ = shutdown_tx.send(true);
    while plugins.join_next().await.is_some() {}
    outcome
}

/// A stopping agent's last service: its Node marked as restarting, it keeps serving the kubelet for
/// [`restart::DRAIN`] (see [`restart`]). Without the mark on the Node (the API server away) it stops at once.
async fn drain(fence: &restart::Fence) {
    let mark = fence.stopping();
    if fence.wait_written(mark, restart::MARK_TIMEOUT).await {
        tracing::info!(drain = ?restart::DRAIN, "SIGTERM: the Node is marked as restarting; serving the pods bound before the mark");
        tokio::time::sleep(restart::DRAIN).await;
    } else {
        tracing::warn!(
            "SIGTERM: the Node could not be marked as restarting; pods admitted before the next agent registers may fail"
        );
    }
}

/// The Node's label that chooses the path for this node, over the configured `mode`.
pub const MODE_LABEL: &str = "gpumem.io/mode";

/// The mode for this node: its [`MODE_LABEL`] when it has one (`device-plugin` or `dra`), else the
/// configured one. A label with another value is reported on the Node and ignored.
async fn node_mode(configured: Mode, value: Option<&String>, api_server: &ApiServer) -> Mode {
    let Some(value) = value else {
        return configured;
    };
    match <Mode as clap::ValueEnum>::from_str(value, false) {
        Ok(mode) => {
            if mode != configured {
                tracing::info!(label = MODE_LABEL, %value, "the Node's label chooses the mode");
            }
            mode
        }
        Err(_) => {
            let note = format!(
                "label {MODE_LABEL}={value:?} is neither device-plugin nor dra; serving as configured ({configured:?})"
            );
            tracing::warn!("{note}");
            api_server.warn("BadModeLabel", note).await;
            configured
        }
    }
}

/// The Node condition that says whether the kubelet lists every memory unit in pod status.
pub const LISTED_UNITS_CONDITION: &str = "GpuMemUnitsInPodStatus";

/// Tells on the Node (a condition, and a warning event when it is True) whether this kubelet lists
/// every `nvidia.com/gpu-mem` unit a pod holds in the pod's status (`ResourceHealthStatus`, on by
/// default from 1.36), and what that costs at this unit: pod objects of megabytes, and a kubelet that
/// stalls after its restart, one lookup per unit against every unit held (docs/operate.md).
async fn report_listed_units(
    api_server: &ApiServer,
    state: &NodeState,
    mode: Mode,
    counting: MemCounting,
    kubelet: &str,
) {
    let cost = devices::listed_units_cost(&state.inventory, state.unit_mib, kubelet);
    let (status, reason, message) = match (mode, cost) {
        (Mode::Dra, _) => (
            false,
            "DraPath",
            "the node serves DRA: no device lists".to_string(),
        ),
        (_, _) if counting == MemCounting::Shares => (
            false,
            "SharesCounted",
            format!(
                "the kubelet counts {} per node and lists one {} device per container",
                state.mem_resource,
                state.shares.as_ref().map_or("", |s| s.resource.as_str())
            ),
        ),
        (_, None) => (
            false,
            "Unknown",
            format!("kubelet version {kubelet:?} or an empty inventory"),
        ),
        (_, Some(cost)) if !cost.listed => (
            false,
            "KubeletDoesNotList",
            format!("kubelet {kubelet} does not list devices in pod status by default"),
        ),
        (_, Some(cost)) if !cost.too_costly() => (
            false,
            "UnitCoarseEnough",
            format!(
                "kubelet {kubelet} lists each unit in pod status; at memUnitMiB {} a pod holding a whole GPU \
                 adds {} bytes",
                state.unit_mib, cost.whole_gpu_pod_bytes
            ),
        ),
        (_, Some(cost)) => (
            true,
            "KubeletListsEveryUnit",
            format!(
                "kubelet {kubelet} (ResourceHealthStatus) lists every {} unit a pod holds in its status: at \
                 memUnitMiB {} a pod holding a whole GPU carries ~{} KiB of it, and after a kubelet restart \
                 the node stalls for one lookup per unit against every unit held (minutes at 1 MiB). Use \
                 memUnitMiB {} or more, the DRA path, or the kubelet's --feature-gates=ResourceHealthStatus=false \
                 (docs/operate.md)",
                state.mem_resource,
                state.unit_mib,
                cost.whole_gpu_pod_bytes / 1024,
                cost.fitting_unit_mib
            ),
        ),
    };
    if status {
        tracing::warn!(kubelet, unit_mib = state.unit_mib, "{message}");
        api_server.warn(reason, message.clone()).await;
    }
    api_server
        .set_condition(LISTED_UNITS_CONDITION, status, reason, message)
        .await;
}

/// The two device plugins (`nvidia.com/gpu`, `nvidia.com/gpu-mem`), each registered with the kubelet.
#[allow(clippy::too_many_arguments)]
async fn serve_device_plugins(
    config: &AgentConfig,
    state: &Arc<NodeState>,
    pod_resources: &Arc<PodResources>,
    enforcement: &Option<Arc<Enforcement>>,
    api_server: &Option<Arc<ApiServer>>,
    metrics: &Arc<metrics::AgentMetrics>,
    liveness: &Arc<Liveness>,
    fence: &Arc<restart::Fence>,
    plugins: &mut JoinSet<anyhow::Result<()>>,
    shutdown_rx: &watch::Receiver<bool>,
) -> Vec<String> {
    let plugin = |kind| Plugin {
        source: Arc::new(NodeResource {
            kind,
            state: Arc::clone(state),
            refresher: pod_resources.clone(),
            strategy: config.device_list_strategy,
            enforcement: enforcement.clone(),
            api_server: api_server.clone(),
            metrics: Arc::clone(metrics),
            fence: Arc::clone(fence),
        }),
        liveness: Arc::clone(liveness),
    };
    // Each resource its own plugin on its own socket, registered (again after a kubelet restart)
    // until shutdown.
    let mut register = |kind: ResourceKind, socket: &str| {
        plugins.spawn(registration::run(
            plugin(kind),
            config.device_plugin_dir.clone(),
            socket.into(),
            shutdown_rx.clone(),
        ));
    };
    let mut served = vec![config.gpu_resource.clone()];
    register(ResourceKind::Whole, GPU_SOCKET);
    if config.mem_counting == MemCounting::Shares {
        register(ResourceKind::Share, SHARE_SOCKET);
        served.push(config.share_resource.clone());
        return served;
    }
    let mem_bytes = devices::mem_list_bytes(&state.inventory, config.mem_unit_mib);
    if mem_bytes > KUBELET_MAX_RECV_BYTES {
        let fits = devices::smallest_fitting_unit(&state.inventory).map_or_else(
            || "no unit fits".to_string(),
            |u| format!("use memUnitMiB: {u} (--mem-unit-mib {u}) or larger"),
        );
        tracing::error!(
            resource = %config.mem_resource,
            mem_unit_mib = config.mem_unit_mib,
            bytes = mem_bytes,
            limit = KUBELET_MAX_RECV_BYTES,
            "the device list at this unit exceeds the kubelet's message limit, so this resource is NOT advertised; {fits}"
        );
        if let Some(api_server) = &api_server {
            let note = format!(
                "{} is not advertised: at memUnitMiB {} one device list is {mem_bytes} bytes, over the \
                 kubelet's {KUBELET_MAX_RECV_BYTES}-byte limit; {fits}",
                config.mem_resource, config.mem_unit_mib
            );
            api_server.warn("GpuMemUnitTooSmall", note).await;
        }
    } else {
        register(ResourceKind::Memory, MEM_SOCKET);
        served.push(config.mem_resource.clone());
    }
    served
}

/// One warning per GPU whose memory is smaller than one unit (it offers no memory device); an error
/// when that is every GPU: the agent would register a memory resource with nothing in it, and every
/// pod asking for it would wait forever.
fn gpus_below_one_unit(
    inventory: &GpuInventory,
    unit_mib: u64,
    resource: &str,
) -> anyhow::Result<Vec<String>> {
    let below: Vec<_> = inventory
        .gpus
        .iter()
        .filter(|g| g.memory_mib < unit_mib)
        .collect();
    if !below.is_empty() && below.len() == inventory.gpus.len() {
        let largest = inventory.gpus.iter().map(|g| g.memory_mib).max().unwrap_or(0);
        anyhow::bail!(
            "memUnitMiB {unit_mib} is larger than every GPU on this node (the largest has {largest} MiB), \
             so no GPU would offer a single {resource} unit; use a memUnitMiB of at most {largest}"
        );
    }
    Ok(below
        .iter()
        .map(|g| {
            format!(
                "GPU {} ({}, {} MiB) is smaller than memUnitMiB {unit_mib}: it offers no {resource} unit \
                 (only the whole GPU)",
                g.index, g.product, g.memory_mib
            )
        })
        .collect())
}

/// Removes the accounting of containers the kubelet no longer lists, as often as it is asked.
async fn forget_gone_containers(
    enforcement: Arc<Enforcement>,
    state: Arc<NodeState>,
    every: std::time::Duration,
) {
    loop {
        tokio::time::sleep(every).await;
        let live = state.live_allocations().into_keys().collect();
        enforcement.forget_all_but(&live);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_smaller_than_a_unit_are_named_and_a_unit_larger_than_all_is_refused() {
        let mixed = GpuInventory::discover(&gpumem_profile::Profile::load("mixed").unwrap()).unwrap();
        assert_eq!(
            gpus_below_one_unit(&mixed, 15360, "x.io/mem").unwrap(),
            Vec::<String>::new()
        );
        let warnings = gpus_below_one_unit(&mixed, 20000, "x.io/mem").unwrap();
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(
            warnings[0].starts_with("GPU 2 (Tesla T4, 15360 MiB) is smaller than memUnitMiB 20000"),
            "{warnings:?}"
        );
        assert!(warnings[1].starts_with("GPU 3 "), "{warnings:?}");
        let err = gpus_below_one_unit(&mixed, 32769, "x.io/mem")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("larger than every GPU")
                && err.contains("at most 32768")
                && err.contains("x.io/mem"),
            "{err}"
        );
    }
}
