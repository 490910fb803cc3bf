//! A kubelet double for the DRA path: its plugin watcher and its DRA manager, over real unix sockets.
//!
//! - [`DraKubelet::register`] does what the kubelet's plugin watcher (`pkg/kubelet/pluginmanager`)
//!   does with a socket that appears in its registry directory: dials it, asks `GetInfo`, checks the
//!   answer as the DRA plugin handler does (type `DRAPlugin`, a driver name, `v1.DRAPlugin` among the
//!   supported versions, an endpoint that is a socket) and answers `NotifyRegistrationStatus`:
//!   registered, or refused with the reason.
//! - [`DraPlugin`] then calls the driver's endpoint as the kubelet's DRA manager does:
//!   `NodePrepareResources` and `NodeUnprepareResources`, one or more claims at a time.
//!
//! Every call sends the socket's path as HTTP/2 `:authority`, as the kubelet's grpc-go clients do
//! (see tests/support/kubelet.rs): the connection goes through an in-process relay that rewrites the
//! client's header blocks.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io;
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpumem::plugin::authority::AuthorityRewrite;
use gpumem::plugin::proto::dra::dra_plugin_client::DraPluginClient;
use gpumem::plugin::proto::dra::{
    Claim, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest,
};
use gpumem::plugin::proto::pluginregistration::registration_client::RegistrationClient;
use gpumem::plugin::proto::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::Status;
use tonic::transport::{Channel, Endpoint, Uri};

/// `PluginInfo.type` of a DRA driver.
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";
/// The DRA service version this kubelet speaks.
pub const DRA_SERVICE_V1: &str = "v1.DRAPlugin";
/// How long one call may take, as the kubelet's DRA manager allows (45 s there; tests are quicker).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The kubelet's plugin registry directory.
pub struct DraKubelet {
    registry: PathBuf,
}

/// A driver the double registered: what it said of itself, and a client of its endpoint.
pub struct DraPlugin {
    pub info: PluginInfo,
    /// The registration socket it was found by.
    pub registration_socket: PathBuf,
    client: DraPluginClient<Channel>,
}

/// Dials the unix socket at `path`, sending the path as `:authority` on every call.
pub async fn dial(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let mut stream = UnixStream::connect(&path).await?;
                let (client, ours) = tokio::io::duplex(64 * 1024);
                let mut ours =
                    AuthorityRewrite::with_authority(ours, path.as_os_str().as_encoded_bytes().to_vec());
                tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut ours, &mut stream).await;
                });
                Ok::<_, io::Error>(TokioIo::new(client))
            }
        }))
        .await
}

/// The sockets in `dir` the plugin watcher would look at: not hidden, a socket.
fn sockets_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

/// What the DRA plugin handler refuses in a `PluginInfo` (`pkg/kubelet/cm/dra/plugin`).
fn refusal(info: &PluginInfo) -> Option<String> {
    if info.r#type != DRA_PLUGIN_TYPE {
        return Some(format!(
            "plugin type {:?} is not {DRA_PLUGIN_TYPE:?}",
            info.r#type
        ));
    }
    if let Err(why) = gpumem::names::check_subdomain(&info.name) {
        return Some(format!("driver name {:?}: {why}", info.name));
    }
    if !info.supported_versions.iter().any(|v| v == DRA_SERVICE_V1) {
        return Some(format!(
            "none of the versions supported {:?} is {DRA_SERVICE_V1:?}",
            info.supported_versions
        ));
    }
    if !Path::new(&info.endpoint).is_absolute() {
        return Some(format!("endpoint {:?} is not an absolute path", info.endpoint));
    }
    None
}

impl DraKubelet {
    pub fn new(registry: &Path) -> DraKubelet {
        DraKubelet {
            registry: registry.to_path_buf(),
        }
    }

    pub fn registry(&self) -> &Path {
        &self.registry
    }

    /// Registers the first driver whose registration socket in the registry answers within
    /// `timeout` (a socket left by a process that died answers nothing: it is retried until a new
    /// one listens there), then dials its endpoint. Panics if none did; Err with the reason when the
    /// double refused the driver (and told it so).
    pub async fn register(&self, timeout: Duration) -> Result<DraPlugin, String> {
        let deadline = Instant::now() + timeout;
        loop {
            for socket in sockets_in(&self.registry) {
                if let Some(outcome) = self.try_register(&socket).await {
                    return outcome;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no DRA driver registered in {} within {timeout:?} (sockets: {:?})",
                self.registry.display(),
                sockets_in(&self.registry)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// None when nothing answers on `socket`.
    async fn try_register(&self, socket: &Path) -> Option<Result<DraPlugin, String>> {
        let channel = dial(socket).await.ok()?;
        let mut registration = RegistrationClient::new(channel);
        let info = tokio::time::timeout(CALL_TIMEOUT, registration.get_info(InfoRequest {}))
            .await
            .ok()?
            .ok()?
            .into_inner();
        let refused = match refusal(&info) {
            Some(why) => Some(why),
            None => match dial(Path::new(&info.endpoint)).await {
                Ok(channel) => {
                    let status = RegistrationStatus {
                        plugin_registered: true,
                        error: String::new(),
                    };
                    if let Err(err) = registration.notify_registration_status(status).await {
                        return Some(Err(format!("NotifyRegistrationStatus failed: {err}")));
                    }
                    return Some(Ok(DraPlugin {
                        info,
                        registration_socket: socket.to_path_buf(),
                        client: DraPluginClient::new(channel),
                    }));
                }
                Err(err) => Some(format!("cannot dial the endpoint {}: {err}", info.endpoint)),
            },
        };
        let error = refused.unwrap_or_default();
        let status = RegistrationStatus {
            plugin_registered: false,
            error: error.clone(),
        };
        let _ = registration.notify_registration_status(status).await;
        Some(Err(error))
    }
}

/// A claim as the kubelet names it.
pub fn claim(namespace: &str, name: &str, uid: &str) -> Claim {
    Claim {
        namespace: namespace.into(),
        uid: uid.into(),
        name: name.into(),
    }
}

impl DraPlugin {
    /// `NodePrepareResources` for `claims`: the answer per claim UID.
    pub async fn prepare(
        &self,
        claims: &[Claim],
    ) -> Result<HashMap<String, NodePrepareResourceResponse>, Status> {
        let request = NodePrepareResourcesRequest {
            claims: claims.to_vec(),
        };
        let mut client = self.client.clone();
        let answer = tokio::time::timeout(CALL_TIMEOUT, client.node_prepare_resources(request))
            .await
            .map_err(|_| Status::deadline_exceeded("NodePrepareResources"))??;
        Ok(answer.into_inner().claims)
    }

    /// `NodePrepareResources` for one claim; panics unless the answer has exactly that claim.
    pub async fn prepare_one(&self, claim: &Claim) -> NodePrepareResourceResponse {
        let mut answers = self
            .prepare(std::slice::from_ref(claim))
            .await
            .unwrap_or_else(|e| panic!("NodePrepareResources failed as a call: {e}"));
        assert_eq!(answers.len(), 1, "one answer per claim: {answers:?}");
        answers
            .remove(&claim.uid)
            .unwrap_or_else(|| panic!("no answer for claim {}: {answers:?}", claim.uid))
    }

    /// `NodeUnprepareResources` for `claims`: the error per claim UID ("" when it went well).
    pub async fn unprepare(&self, claims: &[Claim]) -> Result<HashMap<String, String>, Status> {
        let request = NodeUnprepareResourcesRequest {
            claims: claims.to_vec(),
        };
        let mut client = self.client.clone();
        let answer = tokio::time::timeout(CALL_TIMEOUT, client.node_unprepare_resources(request))
            .await
            .map_err(|_| Status::deadline_exceeded("NodeUnprepareResources"))??;
        Ok(answer
            .into_inner()
            .claims
            .into_iter()
            .map(|(uid, r)| (uid, r.error))
            .collect())
    }

    /// `NodeUnprepareResources` for one claim: its error ("" when it went well).
    pub async fn unprepare_one(&self, claim: &Claim) -> String {
        let mut answers = self
            .unprepare(std::slice::from_ref(claim))
            .await
            .unwrap_or_else(|e| panic!("NodeUnprepareResources failed as a call: {e}"));
        assert_eq!(answers.len(), 1, "one answer per claim: {answers:?}");
        answers
            .remove(&claim.uid)
            .unwrap_or_else(|| panic!("no answer for claim {}: {answers:?}", claim.uid))
    }
}
