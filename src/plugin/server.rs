//! The Device Plugin gRPC service, one instance per resource. It speaks the kubelet's protocol and
//! nothing else: what the devices are and how a request is answered is the [`DeviceSource`]'s (the
//! agent implements it), so this module depends on nothing above it.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use tokio::sync::watch;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use super::proto::v1beta1::device_plugin_server::DevicePlugin;
use super::proto::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, ContainerPreferredAllocationResponse,
    Device, DevicePluginOptions, Empty, ListAndWatchResponse, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
};
use super::proto::{HEALTHY, KUBELET_MAX_RECV_BYTES};
use crate::liveness::Liveness;

/// Why a request cannot be served; the text reaches the user through the kubelet's pod event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The request names devices this plugin never offered, or is malformed.
    #[error("{0}")]
    Invalid(String),
    /// The devices exist but cannot be had now.
    #[error("{0}")]
    Unavailable(String),
}

impl RequestError {
    /// The label of its kind in metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            RequestError::Invalid(_) => "invalid",
            RequestError::Unavailable(_) => "unavailable",
        }
    }
}

/// What one device plugin serves: one extended resource of the node.
#[tonic::async_trait]
pub trait DeviceSource: Send + Sync + 'static {
    /// The extended resource name (`nvidia.com/gpu`).
    fn resource(&self) -> &str;
    /// The device list as ListAndWatch sends it.
    fn devices(&self) -> Vec<Device>;
    /// What the device list is a function of, cheap to compare: a new list is sent when it changes.
    fn fingerprint(&self) -> Vec<bool>;
    /// Ticks whenever the device list may have changed.
    fn changes(&self) -> watch::Receiver<u64>;
    /// The devices to prefer for one container, among `available`, including `must`.
    async fn preferred(
        &self,
        available: &[String],
        must: &[String],
        size: usize,
    ) -> Result<Vec<String>, RequestError>;
    /// The container's share of an Allocate: its devices, environment and mounts.
    async fn allocate(&self, device_ids: &[String]) -> Result<ContainerAllocateResponse, RequestError>;
    /// A served call (`Allocate`, `GetPreferredAllocation`) and how long it took.
    fn served(&self, method: &'static str, seconds: f64);
    /// A refused request.
    fn refused(&self, error: &RequestError);
    /// Registered with the kubelet, or no longer.
    fn registered(&self, yes: bool);
    /// The kubelet has been sent a device list, `healthy` of its devices healthy.
    fn listed(&self, healthy: usize);
}

/// The gRPC service of one resource.
#[derive(Clone)]
pub struct Plugin {
    pub source: Arc<dyn DeviceSource>,
    /// Where the registration loop and each ListAndWatch stream report progress (`/healthz`).
    pub liveness: Arc<Liveness>,
}

/// An idle ListAndWatch stream makes progress this often; one silent for three ticks is stuck
/// (sending into a stream the kubelet does not read).
const LIST_AND_WATCH_TICK: Duration = Duration::from_secs(10);

impl Plugin {
    /// A span for one kubelet call: the call and the resource. (The kubelet names no pod in the
    /// Device Plugin API; the agent's own logs inside it say which GPU and limit it handed out.)
    fn span(&self, call: &'static str) -> tracing::Span {
        tracing::info_span!("kubelet", call, resource = %self.source.resource())
    }

    /// Records a refused request and turns it into the gRPC status the kubelet shows the user.
    fn refuse(&self, err: RequestError) -> Status {
        self.source.refused(&err);
        match err {
            RequestError::Invalid(message) => Status::invalid_argument(message),
            RequestError::Unavailable(message) => Status::resource_exhausted(message),
        }
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
        let source = Arc::clone(&self.source);
        let mut changes = source.changes();
        let heartbeat = self.liveness.transient(
            format!("ListAndWatch {}", source.resource()),
            LIST_AND_WATCH_TICK.saturating_mul(3),
        );
        tokio::spawn(async move {
            let mut last_sent: Option<Vec<bool>> = None;
            loop {
                heartbeat.beat();
                let offered = source.fingerprint();
                if last_sent.as_ref() != Some(&offered) {
                    let response = ListAndWatchResponse {
                        devices: source.devices(),
                    };
                    let healthy = response.devices.iter().filter(|d| d.health == HEALTHY).count();
                    let bytes = response.encoded_len();
                    if bytes > KUBELET_MAX_RECV_BYTES {
                        // The kubelet would drop the stream; the agent checked the unit at start, so
                        // this only guards against a bug.
                        tracing::error!(
                            resource = source.resource(),
                            bytes,
                            "device list exceeds the kubelet's limit; not sent"
                        );
                    } else {
                        if tx.send(Ok(response)).await.is_err() {
                            return;
                        }
                        tracing::debug!(resource = source.resource(), bytes, "sent device list");
                        source.listed(healthy);
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
        let span = self.span("GetPreferredAllocation");
        let started = std::time::Instant::now();
        let mut container_responses = Vec::new();
        for req in request.into_inner().container_requests {
            let size = usize::try_from(req.allocation_size).map_err(|_| {
                Status::invalid_argument(format!("allocation size {} is negative", req.allocation_size))
            })?;
            let ids = self
                .source
                .preferred(&req.available_device_i_ds, &req.must_include_device_i_ds, size)
                .instrument(span.clone())
                .await
                .map_err(|e| span.in_scope(|| self.refuse(e)))?;
            container_responses.push(ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        self.source
            .served("GetPreferredAllocation", started.elapsed().as_secs_f64());
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let span = self.span("Allocate");
        let started = std::time::Instant::now();
        let mut container_responses = Vec::new();
        for req in request.into_inner().container_requests {
            let response = self
                .source
                .allocate(&req.devices_ids)
                .instrument(span.clone())
                .await
                .map_err(|e| {
                    span.in_scope(|| {
                        tracing::warn!(error = %e, devices = req.devices_ids.len(), "Allocate refused");
                        self.refuse(e)
                    })
                })?;
            container_responses.push(response);
        }
        self.source.served("Allocate", started.elapsed().as_secs_f64());
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}
