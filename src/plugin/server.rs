//! The Device Plugin gRPC service, one instance per resource. Thin: every decision is the node
//! state's; this file translates between it and the kubelet's messages.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::proto::KUBELET_MAX_RECV_BYTES;
use super::proto::v1beta1::device_plugin_server::DevicePlugin;
use super::proto::v1beta1::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, Device, DevicePluginOptions, Empty, ListAndWatchResponse,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use crate::agent::cluster::Cluster;
use crate::agent::config::DeviceListStrategy;
use crate::agent::enforcement::Enforcement;
use crate::agent::liveness::Liveness;
use crate::agent::metrics::AgentMetrics;
use crate::agent::state::{NodeState, RequestError};

/// Which of the two resources a plugin instance serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResourceKind {
    /// `nvidia.com/gpu`: whole GPUs.
    Whole,
    /// `nvidia.com/gpu-mem`: memory units of one GPU.
    Memory,
}

/// Something that makes the node state current before a decision (the PodResources poller).
#[tonic::async_trait]
pub trait Refresh: Send + Sync + 'static {
    async fn refresh(&self);
}

#[derive(Clone)]
pub struct Plugin {
    pub kind: ResourceKind,
    pub state: Arc<NodeState>,
    pub refresher: Arc<dyn Refresh>,
    pub strategy: DeviceListStrategy,
    /// Present when gpu-mem containers get libgpumem_cuda.so.
    pub enforcement: Option<Arc<Enforcement>>,
    /// Present when the agent talks to the API server (to honour the scorer's GPU choice).
    pub cluster: Option<Arc<Cluster>>,
    pub metrics: Arc<AgentMetrics>,
    /// Where the registration loop and each ListAndWatch stream report progress (`/healthz`).
    pub liveness: Arc<Liveness>,
}

/// An idle ListAndWatch stream makes progress this often; one silent for three ticks is stuck
/// (sending into a stream the kubelet does not read).
const LIST_AND_WATCH_TICK: Duration = Duration::from_secs(10);

/// Environment variable telling the container runtime (and CUDA) which GPUs the container sees.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";
/// Environment variable carrying a gpu-mem container's limit to libgpumem_cuda.so.
pub const LIMIT_ENV: &str = "GPUMEM_LIMIT_MIB";
/// CDI vendor/class of NVIDIA GPUs, as nvidia-ctk names them.
const CDI_KIND: &str = "nvidia.com/gpu";

impl Plugin {
    fn resource(&self) -> &str {
        match self.kind {
            ResourceKind::Whole => &self.state.gpu_resource,
            ResourceKind::Memory => &self.state.mem_resource,
        }
    }

    fn devices(&self) -> Vec<Device> {
        match self.kind {
            ResourceKind::Whole => self.state.gpu_devices(),
            ResourceKind::Memory => self.state.mem_devices(),
        }
    }

    /// What the device list is a function of: per GPU, offered or not. Comparing this instead of
    /// the list itself keeps 131,072 devices out of memory between changes.
    fn offered(&self) -> Vec<bool> {
        match self.kind {
            ResourceKind::Whole => self.state.gpus_offered(),
            ResourceKind::Memory => self.state.units_offered(),
        }
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

    fn allocate_one(&self, ids: &[String]) -> Result<ContainerAllocateResponse, RequestError> {
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
                let uuid = self.state.inventory.gpus[gpu].uuid.clone();
                let limit_mib = units.len() as u64 * self.state.unit_mib;
                self.expose(&mut response, std::slice::from_ref(&uuid));
                response.envs.insert(LIMIT_ENV.into(), limit_mib.to_string());
                if let Some(enforcement) = &self.enforcement {
                    let name = Enforcement::allocation_name(self.state.inventory.gpus[gpu].index, &units);
                    let (mounts, envs) = enforcement.container(&name).map_err(|e| {
                        RequestError::Unavailable(format!("cannot set up the memory limit: {e:#}"))
                    })?;
                    response.mounts.extend(mounts);
                    response.envs.extend(envs);
                }
                tracing::info!(resource = self.resource(), gpu = %uuid, limit_mib, "allocated GPU memory");
            }
        }
        Ok(response)
    }
}

impl Plugin {
    /// Records a refused request and turns it into the gRPC status the kubelet shows the user.
    fn refuse(&self, err: RequestError) -> Status {
        let reason = match err {
            RequestError::Invalid(_) => "invalid",
            RequestError::Unavailable(_) => "unavailable",
        };
        self.metrics.refused(self.resource(), reason);
        status(err)
    }
}

fn status(err: RequestError) -> Status {
    match err {
        RequestError::Invalid(message) => Status::invalid_argument(message),
        RequestError::Unavailable(message) => Status::resource_exhausted(message),
    }
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<ListStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let plugin = self.clone();
        let mut changes = self.state.subscribe();
        let heartbeat = self.liveness.transient(
            format!("ListAndWatch {}", self.resource()),
            LIST_AND_WATCH_TICK.saturating_mul(3),
        );
        tokio::spawn(async move {
            let mut last_sent: Option<Vec<bool>> = None;
            loop {
                heartbeat.beat();
                let offered = plugin.offered();
                if last_sent.as_ref() != Some(&offered) {
                    let response = ListAndWatchResponse {
                        devices: plugin.devices(),
                    };
                    let bytes = response.encoded_len();
                    if bytes > KUBELET_MAX_RECV_BYTES {
                        // The kubelet would drop the stream; the agent checked the unit at start, so
                        // this only guards against a bug.
                        tracing::error!(
                            resource = plugin.resource(),
                            bytes,
                            "device list exceeds the kubelet's limit; not sent"
                        );
                    } else {
                        if tx.send(Ok(response)).await.is_err() {
                            return;
                        }
                        tracing::debug!(resource = plugin.resource(), bytes, "sent device list");
                    }
                    last_sent = Some(offered);
                }
                loop {
                    tokio::select! {
                        changed = changes.changed() => if changed.is_err() { return } else { break },
                        () = tx.closed() => return,
                        () = tokio::time::sleep(LIST_AND_WATCH_TICK) => heartbeat.beat(),
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let started = std::time::Instant::now();
        self.refresher.refresh().await;
        let mut container_responses = Vec::new();
        for req in request.into_inner().container_requests {
            let size = usize::try_from(req.allocation_size).map_err(|_| {
                Status::invalid_argument(format!("allocation size {} is negative", req.allocation_size))
            })?;
            let ids = match self.kind {
                ResourceKind::Whole => {
                    self.state
                        .prefer_whole(&req.available_device_i_ds, &req.must_include_device_i_ds, size)
                }
                ResourceKind::Memory => {
                    let scorer_choice = match &self.cluster {
                        Some(cluster) => {
                            cluster
                                .assigned_gpu(&self.state.mem_resource, size as u64, &self.state)
                                .await
                        }
                        None => None,
                    };
                    let (available, must) = (&req.available_device_i_ds, &req.must_include_device_i_ds);
                    self.state
                        .prefer_mem(available, must, size, scorer_choice.as_deref())
                }
            }
            .map_err(|e| self.refuse(e))?;
            container_responses.push(ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        let seconds = started.elapsed().as_secs_f64();
        self.metrics
            .observe_request(self.resource(), "GetPreferredAllocation", seconds);
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let started = std::time::Instant::now();
        self.refresher.refresh().await;
        let mut container_responses = Vec::new();
        for req in request.into_inner().container_requests {
            let response = self.allocate_one(&req.devices_ids).map_err(|e| {
                tracing::warn!(resource = self.resource(), error = %e, "Allocate refused");
                self.refuse(e)
            })?;
            container_responses.push(response);
        }
        self.metrics
            .observe_request(self.resource(), "Allocate", started.elapsed().as_secs_f64());
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}
