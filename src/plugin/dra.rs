//! The kubelet's DRA plugin API v1 and the plugin-registry handshake that announces it. Like the
//! device-plugin server, it speaks the protocol and nothing else: what preparing a claim means is
//! the [`ClaimPreparer`]'s (the agent implements it).
//!
//! Two sockets: the driver's own (`<pluginDir>/<driver>/dra.sock`, serving `v1.DRAPlugin` and
//! `v1alpha1.DRAResourceHealth`) and a
//! registration socket in the kubelet's plugin registry (`<driver>-reg.sock`), which the kubelet's
//! plugin watcher finds, asks `GetInfo`, and answers with `NotifyRegistrationStatus`. A kubelet
//! restart keeps both (its watcher walks the registry again); a socket that disappears (the
//! directory wiped) is made again.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use super::authority::AuthorityRewrite;
use super::proto::dra::dra_plugin_server::{DraPlugin, DraPluginServer};
use super::proto::dra::{
    Claim, Device, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
};
use super::proto::drahealth::dra_resource_health_server::{DraResourceHealth, DraResourceHealthServer};
use super::proto::drahealth::{DeviceHealth, NodeWatchResourcesRequest, NodeWatchResourcesResponse};
use super::proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use super::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use super::proto::{DRA_HEALTH_SERVICE, DRA_PLUGIN_TYPE, DRA_SERVICE_V1};
use crate::liveness::Liveness;

/// How often the sockets are checked for having been removed.
const WATCH_INTERVAL: Duration = Duration::from_millis(500);
/// The watch loop beats on every tick: this long without a beat, it is stuck.
pub const DRA_MAX_SILENCE: Duration = Duration::from_secs(10);

/// What a DRA driver does for the kubelet, claim by claim.
#[tonic::async_trait]
pub trait ClaimPreparer: Send + Sync + 'static {
    /// Prepares one claim: the devices of this driver in its allocation, each with the CDI devices
    /// a container using it gets. Preparing a prepared claim answers as the first time did.
    async fn prepare(&self, claim: &Claim) -> Result<Vec<Device>, String>;
    /// Undoes [`Self::prepare`]; a claim not prepared (or already unprepared) is no error.
    async fn unprepare(&self, claim: &Claim) -> Result<(), String>;
    /// A served call (`NodePrepareResources`, `NodeUnprepareResources`), its claims, and how long it took.
    fn served(&self, method: &'static str, claims: usize, failed: usize, seconds: f64);
    /// The kubelet accepted the registration, or refused it, or its socket is gone.
    fn registered(&self, yes: bool);
    /// Every device of the driver with its health, for the kubelet's health stream.
    fn device_health(&self) -> Vec<DeviceHealth>;
    /// Ticks whenever a device's health may have changed.
    fn health_changes(&self) -> watch::Receiver<u64>;
}

/// How long one health report holds for the kubelet; reports are sent again well before.
const HEALTH_REPORT_HOLDS: Duration = Duration::from_secs(60);
/// Health is sent again this often even when nothing changed.
const HEALTH_RESEND: Duration = Duration::from_secs(15);

/// The `v1alpha1.DRAResourceHealth` service: the kubelet shows a sick GPU in the status of the pods
/// that use it.
#[derive(Clone)]
pub struct HealthService {
    pub preparer: Arc<dyn ClaimPreparer>,
}

impl HealthService {
    fn report(&self) -> NodeWatchResourcesResponse {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        let mut devices = self.preparer.device_health();
        for d in &mut devices {
            d.last_updated_time = now;
            d.health_check_timeout_seconds = HEALTH_REPORT_HOLDS.as_secs() as i64;
        }
        NodeWatchResourcesResponse { devices }
    }
}

#[tonic::async_trait]
impl DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<NodeWatchResourcesResponse, Status>> + Send>,
    >;

    async fn node_watch_resources(
        &self,
        _: Request<NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let service = self.clone();
        tokio::spawn(async move {
            let mut changes = service.preparer.health_changes();
            loop {
                changes.mark_unchanged();
                if tx.send(Ok(service.report())).await.is_err() {
                    return; // the kubelet went away
                }
                tokio::select! {
                    _ = changes.changed() => {}
                    () = tokio::time::sleep(HEALTH_RESEND) => {}
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// The `v1.DRAPlugin` service.
#[derive(Clone)]
pub struct DraService {
    pub preparer: Arc<dyn ClaimPreparer>,
}

/// Claims are checked before anything is done with them: a UID is the key of the answer, and the
/// namespace and name go into an API path.
fn check_claim(claim: &Claim) -> Result<(), String> {
    if claim.uid.is_empty() || claim.uid.len() > 128 {
        return Err(format!(
            "claim {}/{}: bad UID {:?}",
            claim.namespace, claim.name, claim.uid
        ));
    }
    crate::names::check_label(&claim.namespace).map_err(|e| format!("claim namespace: {e}"))?;
    crate::names::check_subdomain(&claim.name).map_err(|e| format!("claim name: {e}"))?;
    Ok(())
}

/// The two calls on claims.
#[derive(Clone, Copy, Debug)]
enum ClaimCall {
    Prepare,
    Unprepare,
}

impl ClaimCall {
    fn method(self) -> &'static str {
        match self {
            ClaimCall::Prepare => "NodePrepareResources",
            ClaimCall::Unprepare => "NodeUnprepareResources",
        }
    }
}

impl DraService {
    /// One call: each claim checked, then prepared (its devices) or unprepared (none); one result
    /// per claim UID, the failures logged and counted.
    async fn each_claim(
        &self,
        call: ClaimCall,
        claims: &[Claim],
    ) -> HashMap<String, Result<Vec<Device>, String>> {
        let started = Instant::now();
        let mut results = HashMap::with_capacity(claims.len());
        let mut failed = 0;
        for claim in claims {
            let result = match (check_claim(claim), call) {
                (Err(err), _) => Err(err),
                (Ok(()), ClaimCall::Prepare) => self.preparer.prepare(claim).await,
                (Ok(()), ClaimCall::Unprepare) => self.preparer.unprepare(claim).await.map(|()| Vec::new()),
            };
            if let Err(error) = &result {
                failed += 1;
                tracing::warn!(method = call.method(), claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, %error, "claim refused");
            }
            results.insert(claim.uid.clone(), result);
        }
        self.preparer.served(
            call.method(),
            claims.len(),
            failed,
            started.elapsed().as_secs_f64(),
        );
        results
    }
}

#[tonic::async_trait]
impl DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let results = self
            .each_claim(ClaimCall::Prepare, &request.into_inner().claims)
            .await;
        let claims = results
            .into_iter()
            .map(|(uid, result)| {
                let answer = match result {
                    Ok(devices) => NodePrepareResourceResponse {
                        devices,
                        error: String::new(),
                    },
                    Err(error) => NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    },
                };
                (uid, answer)
            })
            .collect();
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let results = self
            .each_claim(ClaimCall::Unprepare, &request.into_inner().claims)
            .await;
        let claims = results
            .into_iter()
            .map(|(uid, result)| {
                let error = result.err().unwrap_or_default();
                (uid, NodeUnprepareResourceResponse { error })
            })
            .collect();
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}

/// The registration service the kubelet's plugin watcher calls.
#[derive(Clone)]
pub struct RegistrationService {
    pub driver: String,
    pub endpoint: PathBuf,
    pub preparer: Arc<dyn ClaimPreparer>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: DRA_PLUGIN_TYPE.into(),
            name: self.driver.clone(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: vec![DRA_SERVICE_V1.into(), DRA_HEALTH_SERVICE.into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.driver, "registered with the kubelet as a DRA driver");
        } else {
            tracing::error!(driver = %self.driver, error = %status.error, "the kubelet refused the DRA driver's registration");
        }
        self.preparer.registered(status.plugin_registered);
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

fn inode(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.ino())
}

fn listen(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
    }
    // A socket left by a previous run would make bind fail.
    let _ = std::fs::remove_file(path);
    UnixListener::bind(path).map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", path.display()))
}

/// The connections to a socket, each through the `:authority` adapter: the kubelet's gRPC clients
/// (the plugin watcher's among them, 1.36 included) send the socket's path as `:authority`, which h2
/// would reject.
fn incoming(
    path: &Path,
) -> anyhow::Result<
    impl tokio_stream::Stream<Item = std::io::Result<AuthorityRewrite<tokio::net::UnixStream>>> + use<>,
> {
    Ok(UnixListenerStream::new(listen(path)?).map(|conn| conn.map(AuthorityRewrite::new)))
}

/// Where the two sockets go.
#[derive(Debug, Clone)]
pub struct DraSockets {
    pub driver: String,
    /// The DRA service (`<pluginDir>/<driver>/dra.sock`).
    pub endpoint: PathBuf,
    /// The registration socket (`<registryDir>/<driver>-reg.sock`).
    pub registration: PathBuf,
}

impl DraSockets {
    pub fn new(driver: &str, endpoint: PathBuf, registry_dir: &Path) -> Self {
        Self {
            driver: driver.to_string(),
            endpoint,
            registration: registry_dir.join(format!("{driver}-reg.sock")),
        }
    }
}

/// Serves the DRA service and the registration socket until `shutdown` turns true, then removes both
/// sockets: the kubelet's watcher sees the registration socket go and unregisters the driver.
pub async fn run(
    preparer: Arc<dyn ClaimPreparer>,
    sockets: DraSockets,
    liveness: Arc<Liveness>,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let heartbeat = liveness.lasting("dra plugin", DRA_MAX_SILENCE);
    loop {
        let service = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DraPluginServer::new(DraService {
                    preparer: Arc::clone(&preparer),
                }))
                .add_service(DraResourceHealthServer::new(HealthService {
                    preparer: Arc::clone(&preparer),
                }))
                .serve_with_incoming(incoming(&sockets.endpoint)?),
        );
        let endpoint_inode = inode(&sockets.endpoint);
        // The registration socket comes second: when the kubelet dials the endpoint it is there.
        let registration = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(RegistrationService {
                    driver: sockets.driver.clone(),
                    endpoint: sockets.endpoint.clone(),
                    preparer: Arc::clone(&preparer),
                }))
                .serve_with_incoming(incoming(&sockets.registration)?),
        );
        let registration_inode = inode(&sockets.registration);
        tracing::info!(
            driver = %sockets.driver,
            endpoint = %sockets.endpoint.display(),
            registration = %sockets.registration.display(),
            "serving the DRA driver"
        );
        loop {
            heartbeat.beat();
            tokio::select! {
                () = tokio::time::sleep(WATCH_INTERVAL) => {}
                _ = shutdown.changed() => {}
            }
            if *shutdown.borrow() {
                break;
            }
            if inode(&sockets.endpoint) != endpoint_inode
                || inode(&sockets.registration) != registration_inode
            {
                tracing::info!(driver = %sockets.driver, "a DRA socket was removed: serving and registering again");
                break;
            }
        }
        preparer.registered(false);
        registration.abort();
        service.abort();
        let _ = registration.await;
        let _ = service.await;
        if *shutdown.borrow() {
            for (path, ours) in [
                (&sockets.registration, registration_inode),
                (&sockets.endpoint, endpoint_inode),
            ] {
                if inode(path) == ours {
                    let _ = std::fs::remove_file(path);
                }
            }
            tracing::info!(driver = %sockets.driver, "DRA driver stopped");
            return Ok(());
        }
    }
}
