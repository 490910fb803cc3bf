//! One resource of the node as the kubelet's device plugin serves it: `nvidia.com/gpu` (whole GPUs),
//! `nvidia.com/gpu-mem` (memory units of one GPU) or, when the kubelet counts memory per node,
//! `gpumem.io/gpu-share` (a container's share of one GPU, its size read from the pod, [`super::share`]). The agent's side of [`DeviceSource`]: every
//! decision is the node state's; this file hands the kubelet what a container needs to use its GPU
//! (which GPUs it sees, its memory limit, the shim's mounts).

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::watch;

use super::apiserver::ApiServer;
use super::config::DeviceListStrategy;
use super::enforcement::Enforcement;
use super::metrics::AgentMetrics;
use super::restart::Fence;
use super::share::{self, Admitting};
use super::state::NodeState;
use crate::plugin::podresources::Refresh;
use crate::plugin::proto::v1beta1::{CdiDevice, ContainerAllocateResponse, Device};
use crate::plugin::server::{DeviceSource, RequestError};

/// Which of the two resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResourceKind {
    /// `nvidia.com/gpu`: whole GPUs.
    Whole,
    /// `nvidia.com/gpu-mem`: memory units of one GPU.
    Memory,
    /// `gpumem.io/gpu-share`: one container's share of one GPU (`memCounting: shares`).
    Share,
}

/// Environment variable telling the container runtime (and CUDA) which GPUs the container sees.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";
/// Environment variable carrying a gpu-mem container's limit to libgpumem_cuda.so.
pub const LIMIT_ENV: &str = "GPUMEM_LIMIT_MIB";
/// CDI vendor/class of NVIDIA GPUs, as nvidia-ctk names them.
const CDI_KIND: &str = "nvidia.com/gpu";

pub struct NodeResource {
    pub kind: ResourceKind,
    pub state: Arc<NodeState>,
    /// Makes the node state current before a decision (the PodResources poller).
    pub refresher: Arc<dyn Refresh>,
    pub strategy: DeviceListStrategy,
    /// Present when gpu-mem containers get libgpumem_cuda.so.
    pub enforcement: Option<Arc<Enforcement>>,
    /// Present when the agent talks to the API server (to honour the scorer's GPU choice).
    pub api_server: Option<Arc<ApiServer>>,
    pub metrics: Arc<AgentMetrics>,
    /// Told of each device list sent (see [`super::restart`]).
    pub fence: Arc<Fence>,
}

impl NodeResource {
    /// The container the kubelet is giving a share now, and how much memory it asks.
    async fn admitting(&self) -> Result<Admitting, RequestError> {
        let Some(api_server) = &self.api_server else {
            return Err(RequestError::Unavailable(format!(
                "{}: the size of a share is in its pod's spec, and this agent has no API server",
                self.resource()
            )));
        };
        let list = self.refresher.list().await.map_err(|e| {
            RequestError::Unavailable(format!("cannot tell which container a share is for: {e:#}"))
        })?;
        let pods = api_server.pods_on_node().await.map_err(|e| {
            RequestError::Unavailable(format!("cannot tell which container a share is for: {e:#}"))
        })?;
        let shares = self.state.shares.as_ref().map_or("", |s| s.resource.as_str());
        share::admitting(
            &list,
            &pods,
            &self.state.pending_shares(),
            shares,
            &self.state.mem_resource,
        )
        .map_err(RequestError::Unavailable)
    }

    /// A container's environment and mounts for memory on GPU position `gpu`: which GPU it sees, its
    /// limit, and the shim's accounting named `allocation`.
    fn expose_memory(
        &self,
        response: &mut ContainerAllocateResponse,
        gpu: usize,
        limit_mib: u64,
        allocation: &str,
    ) -> Result<String, RequestError> {
        let uuid = self.state.inventory.gpus[gpu].uuid.clone();
        self.expose(response, std::slice::from_ref(&uuid));
        response.envs.insert(LIMIT_ENV.into(), limit_mib.to_string());
        if let Some(enforcement) = &self.enforcement {
            let (mounts, envs) = enforcement
                .container(allocation)
                .map_err(|e| RequestError::Unavailable(format!("cannot set up the memory limit: {e:#}")))?;
            response.mounts.extend(mounts);
            response.envs.extend(envs);
        }
        Ok(uuid)
    }

    /// Tells the container which GPUs it has, the way the configured strategy says.
    fn expose(&self, response: &mut ContainerAllocateResponse, uuids: &[String]) {
        match self.strategy {
            DeviceListStrategy::Envvar => {
                response.envs.insert(VISIBLE_DEVICES_ENV.into(), uuids.join(","));
            }
            DeviceListStrategy::CdiCri => {
                response.cdi_devices = uuids
                    .iter()
                    .map(|u| CdiDevice {
                        name: format!("{CDI_KIND}={u}"),
                    })
                    .collect();
            }
            DeviceListStrategy::CdiAnnotations => {
                let names: Vec<String> = uuids.iter().map(|u| format!("{CDI_KIND}={u}")).collect();
                response
                    .annotations
                    .insert("cdi.k8s.io/gpumem".into(), names.join(","));
            }
        }
    }
}

#[tonic::async_trait]
impl DeviceSource for NodeResource {
    fn resource(&self) -> &str {
        match self.kind {
            ResourceKind::Whole => &self.state.gpu_resource,
            ResourceKind::Memory => &self.state.mem_resource,
            ResourceKind::Share => self.state.shares.as_ref().map_or("", |s| s.resource.as_str()),
        }
    }

    fn devices(&self) -> Vec<Device> {
        match self.kind {
            ResourceKind::Whole => self.state.gpu_devices(),
            ResourceKind::Memory => self.state.mem_devices(),
            ResourceKind::Share => self.state.share_devices(),
        }
    }

    /// Per GPU (or unit), offered or not: comparing this instead of the list itself keeps 131,072
    /// devices out of memory between changes.
    fn fingerprint(&self) -> Vec<bool> {
        match self.kind {
            ResourceKind::Whole => self.state.gpus_offered(),
            ResourceKind::Memory | ResourceKind::Share => self.state.units_offered(),
        }
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.state.subscribe()
    }

    async fn preferred(
        &self,
        available: &[String],
        must: &[String],
        size: usize,
    ) -> Result<Vec<String>, RequestError> {
        self.refresher.refresh().await;
        match self.kind {
            ResourceKind::Whole => self.state.prefer_whole(available, must, size),
            ResourceKind::Memory => {
                let scorer_choice = match &self.api_server {
                    Some(api_server) => {
                        api_server
                            .assigned_gpu(&self.state.mem_resource, size as u64, &self.state)
                            .await
                    }
                    None => None,
                };
                self.state
                    .prefer_mem(available, must, size, scorer_choice.as_deref())
            }
            ResourceKind::Share => {
                let admitting = self.admitting().await?;
                self.state.prefer_share(
                    available,
                    must,
                    size,
                    admitting.units,
                    admitting.scorer_gpu.as_deref(),
                )
            }
        }
    }

    async fn allocate(&self, ids: &[String]) -> Result<ContainerAllocateResponse, RequestError> {
        self.refresher.refresh().await;
        let mut response = ContainerAllocateResponse {
            envs: HashMap::new(),
            ..Default::default()
        };
        match self.kind {
            ResourceKind::Whole => {
                let gpus = self.state.allocate_whole(ids)?;
                let uuids: Vec<String> = gpus
                    .iter()
                    .map(|&a| self.state.inventory.gpus[a].uuid.clone())
                    .collect();
                tracing::info!(resource = self.resource(), gpus = ?uuids, "allocated whole GPUs");
                self.expose(&mut response, &uuids);
            }
            ResourceKind::Memory => {
                let (gpu, units) = self.state.allocate_mem(ids)?;
                let limit_mib = units.len() as u64 * self.state.unit_mib;
                let name = Enforcement::allocation_name(self.state.inventory.gpus[gpu].index, &units);
                let uuid = self.expose_memory(&mut response, gpu, limit_mib, &name)?;
                tracing::info!(resource = self.resource(), gpu = %uuid, limit_mib, "allocated GPU memory");
            }
            ResourceKind::Share => {
                let admitting = self.admitting().await?;
                let (gpu, slot) = self.state.allocate_share(
                    ids,
                    &admitting.owner,
                    &admitting.container,
                    admitting.units,
                )?;
                let limit_mib = admitting.units * self.state.unit_mib;
                let name = Enforcement::share_allocation_name(self.state.inventory.gpus[gpu].index, slot);
                let uuid = self.expose_memory(&mut response, gpu, limit_mib, &name)?;
                tracing::info!(
                    resource = self.resource(),
                    pod = %admitting.owner,
                    container = %admitting.container,
                    gpu = %uuid,
                    limit_mib,
                    "allocated a share of GPU memory"
                );
            }
        }
        Ok(response)
    }

    fn served(&self, method: &'static str, seconds: f64) {
        self.metrics.observe_request(self.resource(), method, seconds);
    }

    fn refused(&self, error: &RequestError) {
        self.metrics.refused(self.resource(), error.kind());
    }

    fn registered(&self, yes: bool) {
        self.metrics.set_registered(self.resource(), yes);
    }

    fn listed(&self, healthy: usize) {
        self.fence.listed(self.resource(), healthy);
    }
}
