//! A kubelet double for integration tests: real gRPC over real unix sockets, behaving like the
//! kubelet's device manager (`pkg/kubelet/cm/devicemanager`) and its PodResources server
//! (`pkg/kubelet/apis/podresources`).
//!
//! - [`FakeKubelet`] serves `Registration` on `<dir>/kubelet.sock`. On `Register` it checks the
//!   request like the kubelet, dials the plugin back on `<dir>/<endpoint>` (gRPC's default 4 MiB
//!   receive limit, as the kubelet's client has), calls `GetDevicePluginOptions`, starts
//!   `ListAndWatch` in the background and records what arrives. [`FakeKubelet::restart`] does
//!   what a kubelet restart does to the directory: every socket in it disappears.
//! - [`FakePodResources`] serves `PodResourcesLister` on a socket of its own.
//!
//! Which kubelet it imitates: by default one before 1.26, like the stock 1.24 kubelet of the
//! end-to-end suite. Its grpc-go client sends the plugin socket's *path* as the HTTP/2
//! `:authority` of every call (kubernetes/kubernetes#112597), which plain h2 servers reset with
//! PROTOCOL_ERROR; the agent answers only through `gpumem::plugin::authority`. A tonic client
//! cannot put a path in a `Uri`, so every connection to a plugin goes through an in-process relay
//! that rewrites the client's header blocks with `AuthorityRewrite::with_authority` (the path
//! enters grpc-go's HPACK dynamic table on the first call and is referred to by index after, as
//! grpc-go does), and copies bytes both ways, closes included. [`Authority::Localhost`] imitates
//! kubelets since 1.26 instead (`grpc.WithAuthority("localhost")`), through the same relay.
//!
//! Where the double differs from the kubelet on purpose:
//! - `Register` is answered only once the plugin's first `ListAndWatch` message has arrived (or
//!   the stream has ended, or [`FIRST_LIST_WAIT`] has passed), so that a test sees the devices as
//!   soon as the plugin's `Register` call returns. The kubelet answers right after
//!   `GetDevicePluginOptions` and reads the stream in a goroutine; the answer is `OK` in both.
//! - `preferred`, `allocate` and `pre_start` are driven by the test. Like the kubelet, they go to
//!   the newest registration of the resource, and `preferred` / `pre_start` are refused
//!   (`FailedPrecondition`) when the plugin's options say the kubelet would never call them.
//!
//! Everything stops when dropped: connections are cut, tasks aborted, and the socket the double
//! created is removed (if it is still the same file).

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt::Write as _;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use gpumem::plugin::authority::AuthorityRewrite;
use gpumem::plugin::proto::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpumem::plugin::proto::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices, ContainerResources,
    GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse,
    PodResources,
};
use gpumem::plugin::proto::v1beta1::device_plugin_client::DevicePluginClient;
use gpumem::plugin::proto::v1beta1::registration_server::{Registration, RegistrationServer};
use gpumem::plugin::proto::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, Device, DevicePluginOptions, Empty, PreStartContainerRequest,
    PreferredAllocationRequest, RegisterRequest,
};
use gpumem::plugin::proto::{HEALTHY, KUBELET_MAX_RECV_BYTES, KUBELET_SOCKET, VERSION};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic::{Request, Response, Status};

/// How long `Register` waits for the plugin's first `ListAndWatch` message before answering.
pub const FIRST_LIST_WAIT: Duration = Duration::from_secs(5);

/// How long the kubelet keeps trying to dial a plugin that registered (its `dial` uses a blocking
/// gRPC dial with a 10 s deadline).
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// Pause between two dial attempts while [`DIAL_TIMEOUT`] has not passed.
const DIAL_RETRY: Duration = Duration::from_millis(100);

/// Capacity of the in-process pipe between the double's gRPC client and its relay (each way).
const RELAY_BUFFER: usize = 64 * 1024;

/// What the double sends as HTTP/2 `:authority` when it calls a plugin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Authority {
    /// The plugin socket's path, e.g. `/var/lib/kubelet/device-plugins/gpumem-gpu-mem.sock`: what
    /// kubelets before 1.26 send.
    #[default]
    SocketPath,
    /// `localhost`: what kubelets since 1.26 send.
    Localhost,
}

/// Device lists are all kept until they hold this many devices in all; then the oldest go.
pub const LIST_HISTORY_DEVICES: usize = 1 << 20;

/// The device manager's checkpoint file, which lives in the device-plugin directory and survives
/// the directory cleanup at kubelet start.
pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";

/// PodResources rate limit of the kubelet (`podresources/grpc/ratelimit.go`): 100 requests a
/// second, bursts of 10; requests over it fail with `ResourceExhausted`.
pub const POD_RESOURCES_QPS: f64 = 100.0;
/// Burst size that goes with [`POD_RESOURCES_QPS`].
pub const POD_RESOURCES_BURST: u32 = 10;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `"Code: message"` for a status, then the transport errors under it (such as h2's reason for a
/// reset stream), as recorded in [`FakeKubelet::stream_errors`].
fn describe(status: &Status) -> String {
    let mut text = format!("{:?}: {}", status.code(), status.message());
    let mut source = std::error::Error::source(status);
    while let Some(inner) = source {
        let _ = write!(text, ": {inner}");
        source = inner.source();
    }
    text
}

/// An error and its sources, joined by `": "`.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        let _ = write!(text, ": {inner}");
        source = inner.source();
    }
    text
}

// ---------------------------------------------------------------------------------------------
// Connections that can be cut from outside, like the kernel does when a process dies.
// ---------------------------------------------------------------------------------------------

/// The open connections of one server or client; [`ConnSet::kill_all`] shuts every one of them
/// down (both directions), so the peer sees the connection drop as if the process had died.
#[derive(Default)]
struct ConnSet {
    inner: Mutex<ConnSetInner>,
}

#[derive(Default)]
struct ConnSetInner {
    next: u64,
    killed: bool,
    /// A duplicate of each open connection's descriptor, to shut it down with.
    open: HashMap<u64, std::os::unix::net::UnixStream>,
}

impl ConnSet {
    fn track(self: &Arc<Self>, io: UnixStream) -> io::Result<Tracked> {
        let dup = std::os::unix::net::UnixStream::from(io.as_fd().try_clone_to_owned()?);
        let mut inner = lock(&self.inner);
        if inner.killed {
            let _ = dup.shutdown(std::net::Shutdown::Both);
        }
        let id = inner.next;
        inner.next += 1;
        inner.open.insert(id, dup);
        Ok(Tracked {
            io,
            id,
            set: Arc::clone(self),
        })
    }

    fn kill_all(&self) {
        let mut inner = lock(&self.inner);
        inner.killed = true;
        for stream in inner.open.values() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A unix stream registered in a [`ConnSet`] for as long as it lives.
struct Tracked {
    io: UnixStream,
    id: u64,
    set: Arc<ConnSet>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        lock(&self.set.inner).open.remove(&self.id);
    }
}

impl AsyncRead for Tracked {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Tracked {
    type ConnectInfo = <UnixStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Binds a listener at `path` (removing a stale file first) and returns it with the socket
/// file's identity, so that only that file is removed later.
fn bind(path: &Path) -> (UnixListener, (u64, u64)) {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).unwrap_or_else(|e| panic!("cannot create {}: {e}", parent.display()));
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => panic!("cannot remove stale socket {}: {e}", path.display()),
    }
    let listener =
        UnixListener::bind(path).unwrap_or_else(|e| panic!("cannot listen on {}: {e}", path.display()));
    let meta =
        std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("cannot stat {}: {e}", path.display()));
    (listener, (meta.dev(), meta.ino()))
}

/// Removes `path` if it is still the file identified by `id`.
fn remove_if_same(path: &Path, id: (u64, u64)) {
    if let Ok(meta) = std::fs::symlink_metadata(path)
        && (meta.dev(), meta.ino()) == id
    {
        let _ = std::fs::remove_file(path);
    }
}

/// Serves `router` on `listener`, every connection tracked in `conns`.
fn serve(
    router: tonic::transport::server::Router,
    listener: UnixListener,
    conns: Arc<ConnSet>,
) -> JoinHandle<()> {
    let incoming =
        UnixListenerStream::new(listener).map(move |accepted| accepted.and_then(|io| conns.track(io)));
    tokio::spawn(async move {
        if let Err(e) = router.serve_with_incoming(incoming).await {
            eprintln!("kubelet double: server stopped: {}", error_chain(&e));
        }
    })
}

/// Dials the unix socket at `path` the way the kubelet dials a plugin: retrying until
/// [`DIAL_TIMEOUT`] has passed, each connection through [`relay`].
async fn dial(path: &Path, conns: &Arc<ConnSet>, authority: Authority) -> Result<Channel, String> {
    let deadline = Instant::now() + DIAL_TIMEOUT;
    loop {
        let path_for_connector = path.to_path_buf();
        let conns_for_connector = Arc::clone(conns);
        let connector = tower::service_fn(move |_: Uri| {
            let path = path_for_connector.clone();
            let conns = Arc::clone(&conns_for_connector);
            async move {
                let stream = conns.track(UnixStream::connect(&path).await?)?;
                Ok::<_, io::Error>(TokioIo::new(relay(stream, &path, authority)))
            }
        });
        match Endpoint::from_static("http://localhost")
            .connect_with_connector(connector)
            .await
        {
            Ok(channel) => return Ok(channel),
            Err(e) if Instant::now() + DIAL_RETRY >= deadline => {
                return Err(format!("context deadline exceeded ({})", error_chain(&e)));
            }
            Err(_) => tokio::time::sleep(DIAL_RETRY).await,
        }
    }
}

/// The client's end of a pipe whose other end is copied to and from `stream`, the client's
/// header blocks rewritten to carry `authority` (see the module doc). An end of file on either
/// side is passed on as a shutdown of the other; an error, or the client dropping its end, ends
/// the relay and closes both.
fn relay(mut stream: Tracked, path: &Path, authority: Authority) -> DuplexStream {
    let value = match authority {
        Authority::SocketPath => path.as_os_str().as_encoded_bytes().to_vec(),
        Authority::Localhost => b"localhost".to_vec(),
    };
    let (client, ours) = tokio::io::duplex(RELAY_BUFFER);
    let mut ours = AuthorityRewrite::with_authority(ours, value);
    let path = path.to_path_buf();
    tokio::spawn(async move {
        if let Err(e) = tokio::io::copy_bidirectional(&mut ours, &mut stream).await
            && e.kind() == io::ErrorKind::InvalidData
        {
            // The client's HTTP/2 could not be followed: a bug to see, not a connection cut.
            eprintln!(
                "kubelet double: relay to {} closed: {}",
                path.display(),
                error_chain(&e)
            );
        }
    });
    client
}

// ---------------------------------------------------------------------------------------------
// The device manager.
// ---------------------------------------------------------------------------------------------

/// What the double knows of one resource name.
#[derive(Default)]
struct Resource {
    /// Accepted registrations, oldest first.
    registrations: Vec<RegisterRequest>,
    /// The answer to `GetDevicePluginOptions` of the newest registration.
    options: Option<DevicePluginOptions>,
    /// Plugin connections whose `ListAndWatch` is still running, oldest first.
    clients: Vec<PluginClient>,
    /// Id of the newest registration's client (the kubelet's endpoint for the resource).
    current: Option<u64>,
    /// The `ListAndWatch` messages received (from any client of the resource), oldest first;
    /// the oldest are dropped once they hold more than [`LIST_HISTORY_DEVICES`] devices in all.
    lists: VecDeque<Arc<Vec<Device>>>,
    /// How many messages were dropped from the front of `lists`.
    lists_dropped: usize,
    /// Devices held in `lists`.
    lists_devices: usize,
    /// The kubelet's view of health: set from each list; on a disconnect every healthy device
    /// becomes unhealthy.
    healthy: BTreeSet<String>,
    unhealthy: BTreeSet<String>,
    /// How each `ListAndWatch` stream ended (errors, and `EOF` when the plugin closed it).
    stream_errors: Vec<String>,
}

struct PluginClient {
    id: u64,
    endpoint: PathBuf,
    api: DevicePluginClient<Channel>,
    conns: Arc<ConnSet>,
    task: Option<JoinHandle<()>>,
}

impl PluginClient {
    fn stop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        self.conns.kill_all();
    }
}

#[derive(Default)]
struct KubeletState {
    stopped: bool,
    next_client: u64,
    resources: BTreeMap<String, Resource>,
    rejected: Vec<(RegisterRequest, String)>,
}

struct Shared {
    dir: PathBuf,
    authority: Authority,
    state: Mutex<KubeletState>,
    /// Bumped on every change of `state`, for the `wait_*` methods.
    version: watch::Sender<u64>,
    /// Set once the double stops, to end `Register` calls in flight.
    stopping: watch::Sender<bool>,
}

impl Shared {
    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Writes the checkpoint file: the healthy devices of each resource, like the kubelet does
    /// after each update (the pod entries are left empty and the checksum is not computed).
    fn write_checkpoint(&self, state: &KubeletState) {
        let registered: BTreeMap<&str, Vec<&str>> = state
            .resources
            .iter()
            .map(|(name, r)| (name.as_str(), r.healthy.iter().map(String::as_str).collect()))
            .collect();
        let data = serde_json::json!({
            "Data": { "PodDeviceEntries": null, "RegisteredDevices": registered },
            "Checksum": 0,
        });
        let path = self.dir.join(CHECKPOINT_FILE);
        let temp = self.dir.join(format!(".{CHECKPOINT_FILE}.tmp"));
        if std::fs::write(&temp, data.to_string()).is_ok() {
            let _ = std::fs::rename(&temp, &path);
        }
    }

    fn record_list(&self, resource: &str, devices: Vec<Device>) {
        let mut state = lock(&self.state);
        if state.stopped {
            return;
        }
        let r = state.resources.entry(resource.to_string()).or_default();
        r.healthy = devices
            .iter()
            .filter(|d| d.health == HEALTHY)
            .map(|d| d.id.clone())
            .collect();
        r.unhealthy = devices
            .iter()
            .filter(|d| d.health != HEALTHY)
            .map(|d| d.id.clone())
            .collect();
        r.lists_devices += devices.len();
        r.lists.push_back(Arc::new(devices));
        while r.lists_devices > LIST_HISTORY_DEVICES && r.lists.len() > 1 {
            let dropped = r.lists.pop_front().expect("more than one list");
            r.lists_devices -= dropped.len();
            r.lists_dropped += 1;
        }
        self.write_checkpoint(&state);
        drop(state);
        self.bump();
    }

    /// The kubelet's `runClient` epilogue: the stream of client `id` ended with `outcome`; the
    /// client is disconnected and the whole resource is marked unhealthy.
    fn disconnect(&self, resource: &str, id: u64, outcome: String) {
        let mut state = lock(&self.state);
        if state.stopped {
            return;
        }
        let Some(r) = state.resources.get_mut(resource) else {
            return;
        };
        let Some(pos) = r.clients.iter().position(|c| c.id == id) else {
            return;
        };
        let mut client = r.clients.remove(pos);
        client.task = None; // this is the task itself, ending now
        client.conns.kill_all();
        r.stream_errors.push(outcome);
        let healthy = std::mem::take(&mut r.healthy);
        r.unhealthy.extend(healthy);
        self.write_checkpoint(&state);
        drop(state);
        self.bump();
    }
}

/// Runs one plugin's `ListAndWatch` until it ends, like the kubelet's `client.Run`.
async fn run_client(
    shared: Arc<Shared>,
    resource: String,
    id: u64,
    mut api: DevicePluginClient<Channel>,
    first: oneshot::Sender<()>,
) {
    let mut first = Some(first);
    let outcome = match api.list_and_watch(Empty {}).await {
        Err(status) => describe(&status),
        Ok(response) => {
            let mut stream = response.into_inner();
            loop {
                match stream.message().await {
                    Ok(Some(message)) => {
                        shared.record_list(&resource, message.devices);
                        if let Some(first) = first.take() {
                            let _ = first.send(());
                        }
                    }
                    Ok(None) => break "EOF: the plugin ended the ListAndWatch stream".to_string(),
                    Err(status) => break describe(&status),
                }
            }
        }
    };
    shared.disconnect(&resource, id, outcome);
}

/// The kubelet's `IsExtendedResourceName`: a prefixed name, not in the `kubernetes.io/` namespace,
/// not starting with `requests.`, and a qualified name once `requests.` is put in front.
pub fn is_extended_resource_name(name: &str) -> bool {
    if !name.contains('/') || name.contains("kubernetes.io/") || name.starts_with("requests.") {
        return false;
    }
    let quota_name = format!("requests.{name}");
    let Some((prefix, local)) = quota_name.split_once('/') else {
        return false;
    };
    let alnum_lower = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    let dns_label = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && label.chars().all(|c| alnum_lower(c) || c == '-')
            && label.starts_with(alnum_lower)
            && label.ends_with(alnum_lower)
    };
    let prefix_ok = !prefix.is_empty() && prefix.len() <= 253 && prefix.split('.').all(dns_label);
    let local_ok = !local.is_empty()
        && local.len() <= 63
        && local
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && local.starts_with(|c: char| c.is_ascii_alphanumeric())
        && local.ends_with(|c: char| c.is_ascii_alphanumeric());
    prefix_ok && local_ok
}

struct RegistrationService {
    shared: Arc<Shared>,
}

impl RegistrationService {
    fn reject(&self, request: RegisterRequest, message: String) -> Status {
        lock(&self.shared.state).rejected.push((request, message.clone()));
        self.shared.bump();
        // The kubelet returns plain Go errors, which gRPC sends as code Unknown.
        Status::unknown(message)
    }

    async fn handle(&self, request: RegisterRequest) -> Result<(), Status> {
        if request.version != VERSION {
            let message = format!(
                "requested API version {:?} is not supported by kubelet. Supported version is [{VERSION:?}]",
                request.version
            );
            return Err(self.reject(request, message));
        }
        if !is_extended_resource_name(&request.resource_name) {
            let message = format!("the ResourceName {:?} is invalid", request.resource_name);
            return Err(self.reject(request, message));
        }

        let resource = request.resource_name.clone();
        // Go's filepath.Join(dir, endpoint): the endpoint stays inside the directory.
        let endpoint = self.shared.dir.join(request.endpoint.trim_start_matches('/'));
        let conns = Arc::new(ConnSet::default());
        let channel = match dial(&endpoint, &conns, self.shared.authority).await {
            Ok(channel) => channel,
            Err(e) => return Err(self.reject(request, format!("failed to dial device plugin: {e}"))),
        };
        let mut api = DevicePluginClient::new(channel).max_decoding_message_size(KUBELET_MAX_RECV_BYTES);
        let options = match api.get_device_plugin_options(Empty {}).await {
            Ok(options) => options.into_inner(),
            Err(status) => {
                conns.kill_all();
                let message = format!("failed to get device plugin options: {}", describe(&status));
                return Err(self.reject(request, message));
            }
        };

        let (first_tx, first_rx) = oneshot::channel();
        {
            let mut state = lock(&self.shared.state);
            if state.stopped {
                conns.kill_all();
                return Err(Status::unavailable("the kubelet is stopping"));
            }
            let id = state.next_client;
            state.next_client += 1;
            let r = state.resources.entry(resource.clone()).or_default();
            r.options = Some(options);
            r.current = Some(id);
            let task = tokio::spawn(run_client(
                Arc::clone(&self.shared),
                resource,
                id,
                api.clone(),
                first_tx,
            ));
            r.clients.push(PluginClient {
                id,
                endpoint,
                api,
                conns,
                task: Some(task),
            });
        }
        self.shared.bump();

        // Not what the kubelet does (it answers now); see the module documentation.
        let _ = tokio::time::timeout(FIRST_LIST_WAIT, first_rx).await;

        let mut state = lock(&self.shared.state);
        if state.stopped {
            return Err(Status::unavailable("the kubelet is stopping"));
        }
        let name = request.resource_name.clone();
        state
            .resources
            .entry(name)
            .or_default()
            .registrations
            .push(request);
        drop(state);
        self.shared.bump();
        Ok(())
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let mut stopping = self.shared.stopping.subscribe();
        tokio::select! {
            result = self.handle(request.into_inner()) => result.map(|()| Response::new(Empty {})),
            _ = stopping.wait_for(|stopping| *stopping) => Err(Status::unavailable("the kubelet is stopping")),
        }
    }
}

/// The kubelet's `CleanupPluginDirectory`: removes every socket in `dir` (following symlinks to
/// tell), except the checkpoint file; directories and other files stay. Returns the names removed.
fn cleanup_plugin_dir(dir: &Path) -> Vec<String> {
    let mut removed = Vec::new();
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == CHECKPOINT_FILE {
            continue;
        }
        let path = entry.path();
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if meta.is_dir() || !meta.file_type().is_socket() {
            continue;
        }
        if std::fs::remove_file(&path).is_ok() {
            removed.push(name);
        }
    }
    removed.sort();
    removed
}

/// A kubelet device manager serving `Registration` on `<dir>/kubelet.sock`.
pub struct FakeKubelet {
    shared: Arc<Shared>,
    conns: Arc<ConnSet>,
    server: Option<JoinHandle<()>>,
    socket: PathBuf,
    socket_id: (u64, u64),
    removed_at_start: Vec<String>,
}

impl FakeKubelet {
    /// Starts like the kubelet: creates `dir`, removes every socket in it (see
    /// [`FakeKubelet::removed_at_start`]), writes the checkpoint file and listens on
    /// `<dir>/kubelet.sock`. Calls plugins with the socket path as `:authority`, like a kubelet
    /// before 1.26.
    pub async fn start(dir: &Path) -> FakeKubelet {
        FakeKubelet::start_with(dir, Authority::default()).await
    }

    /// [`FakeKubelet::start`], calling plugins with `authority`.
    pub async fn start_with(dir: &Path, authority: Authority) -> FakeKubelet {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        let removed_at_start = cleanup_plugin_dir(dir);
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            authority,
            state: Mutex::new(KubeletState::default()),
            version: watch::channel(0).0,
            stopping: watch::channel(false).0,
        });
        shared.write_checkpoint(&lock(&shared.state));
        let socket = dir.join(KUBELET_SOCKET);
        let (listener, socket_id) = bind(&socket);
        let conns = Arc::new(ConnSet::default());
        let router = Server::builder().add_service(RegistrationServer::new(RegistrationService {
            shared: Arc::clone(&shared),
        }));
        let server = serve(router, listener, Arc::clone(&conns));
        FakeKubelet {
            shared,
            conns,
            server: Some(server),
            socket,
            socket_id,
            removed_at_start,
        }
    }

    /// The device-plugin directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// `<dir>/kubelet.sock`.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Names of the sockets this start removed from the directory.
    pub fn removed_at_start(&self) -> Vec<String> {
        self.removed_at_start.clone()
    }

    /// A kubelet restart: the process dies (registration server and plugin connections cut,
    /// `Register` calls in flight fail), then a new one starts on the same directory, removing
    /// every socket there (the plugins' and the stale `kubelet.sock`) before listening again.
    /// Nothing carries over but the [`Authority`]: registrations, lists and errors start empty.
    pub async fn restart(mut self) -> FakeKubelet {
        self.stop();
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
        let (dir, authority) = (self.shared.dir.clone(), self.shared.authority);
        // The dead process's socket file stays until the new one cleans up.
        self.socket_id = (u64::MAX, u64::MAX);
        drop(self);
        FakeKubelet::start_with(&dir, authority).await
    }

    /// Every accepted registration of `resource`, oldest first.
    pub fn registrations(&self, resource: &str) -> Vec<RegisterRequest> {
        self.with(resource, |r| r.registrations.clone())
    }

    /// Every rejected `Register` call (any resource) with the error returned.
    pub fn rejected(&self) -> Vec<(RegisterRequest, String)> {
        lock(&self.shared.state).rejected.clone()
    }

    /// Waits until `resource` has a registration (its first list is in by then, unless the stream
    /// failed or [`FIRST_LIST_WAIT`] passed) and returns the newest. Panics after `timeout`.
    pub async fn wait_registered(&self, resource: &str, timeout: Duration) -> RegisterRequest {
        let found = self
            .wait_until(timeout, |state| {
                state
                    .resources
                    .get(resource)
                    .and_then(|r| r.registrations.last().cloned())
            })
            .await;
        found.unwrap_or_else(|| {
            panic!(
                "no registration of {resource} within {timeout:?}; rejected registrations: {:?}",
                self.rejected()
            )
        })
    }

    /// The latest device list received for `resource` (empty before the first one).
    pub fn devices(&self, resource: &str) -> Vec<Device> {
        self.with(resource, |r| {
            r.lists.back().map(|l| l.to_vec()).unwrap_or_default()
        })
    }

    /// The device lists received for `resource`, oldest first: all of them, unless they hold
    /// more than [`LIST_HISTORY_DEVICES`] devices in all, in which case the oldest are left out.
    pub fn lists(&self, resource: &str) -> Vec<Vec<Device>> {
        self.with(resource, |r| r.lists.iter().map(|l| l.to_vec()).collect())
    }

    /// How many `ListAndWatch` messages have been received for `resource` (all of them).
    pub fn list_count(&self, resource: &str) -> usize {
        self.with(resource, |r| r.lists_dropped + r.lists.len())
    }

    /// Waits for a device list of `resource` satisfying `predicate` (the latest one at the time of
    /// the call, then every later one in order) and returns it. Panics after `timeout`, showing
    /// the last list.
    pub async fn wait_devices(
        &self,
        resource: &str,
        timeout: Duration,
        predicate: impl Fn(&[Device]) -> bool,
    ) -> Vec<Device> {
        let mut next = self.list_count(resource).saturating_sub(1);
        let found = self
            .wait_until(timeout, |state| {
                let r = state.resources.get(resource)?;
                let first = next.saturating_sub(r.lists_dropped);
                let hit = r
                    .lists
                    .iter()
                    .skip(first)
                    .find(|list| predicate(list))
                    .map(|l| l.to_vec());
                next = r.lists_dropped + r.lists.len();
                hit
            })
            .await;
        found.unwrap_or_else(|| {
            panic!(
                "no device list of {resource} satisfied the predicate within {timeout:?}: {} lists received, \
                 last: {}; stream errors: {:?}",
                self.list_count(resource),
                summarize(&self.devices(resource)),
                self.stream_errors(resource)
            )
        })
    }

    /// How each `ListAndWatch` stream of `resource` ended (`"Code: message"`, or `EOF: ...` when
    /// the plugin ended it), oldest first. A message over 4 MiB shows up here.
    pub fn stream_errors(&self, resource: &str) -> Vec<String> {
        self.with(resource, |r| r.stream_errors.clone())
    }

    /// Whether the newest registration of `resource` still has its `ListAndWatch` running.
    pub fn connected(&self, resource: &str) -> bool {
        self.with(resource, |r| {
            r.current.is_some_and(|id| r.clients.iter().any(|c| c.id == id))
        })
    }

    /// The plugin's answer to `GetDevicePluginOptions` at its newest registration. Panics if
    /// `resource` never registered.
    pub fn options(&self, resource: &str) -> DevicePluginOptions {
        self.with(resource, |r| r.options)
            .unwrap_or_else(|| panic!("{resource} has not registered, so it has no options"))
    }

    /// IDs the kubelet counts as allocatable: healthy in the latest list, and none at all after
    /// a stream ended until the next list arrives (the kubelet marks the resource unhealthy).
    pub fn healthy_ids(&self, resource: &str) -> Vec<String> {
        self.with(resource, |r| r.healthy.iter().cloned().collect())
    }

    /// IDs the kubelet counts as unhealthy (see [`FakeKubelet::healthy_ids`]).
    pub fn unhealthy_ids(&self, resource: &str) -> Vec<String> {
        self.with(resource, |r| r.unhealthy.iter().cloned().collect())
    }

    /// `GetPreferredAllocation` for one container, as the kubelet sends it. Refused with
    /// `FailedPrecondition` when the plugin's options do not offer it (the kubelet would not
    /// call it), `Unavailable` when the resource has no live plugin.
    pub async fn preferred(
        &self,
        resource: &str,
        available: &[&str],
        must_include: &[&str],
        size: i32,
    ) -> Result<Vec<String>, Status> {
        let (mut api, options) = self.client(resource)?;
        if !options.get_preferred_allocation_available {
            return Err(Status::failed_precondition(format!(
                "{resource}: the plugin's options do not set get_preferred_allocation_available, so the \
                 kubelet never calls GetPreferredAllocation"
            )));
        }
        let request = PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: strings(available),
                must_include_device_i_ds: strings(must_include),
                allocation_size: size,
            }],
        };
        let response = api.get_preferred_allocation(request).await?.into_inner();
        // The kubelet reads the first container's answer, and takes no answer as no preference.
        Ok(response
            .container_responses
            .into_iter()
            .next()
            .map(|c| c.device_i_ds)
            .unwrap_or_default())
    }

    /// `Allocate` for one container with exactly `ids`, as the kubelet sends it; returns the
    /// first container response (an answer without any fails, as in the kubelet).
    pub async fn allocate(&self, resource: &str, ids: &[&str]) -> Result<ContainerAllocateResponse, Status> {
        let (mut api, _) = self.client(resource)?;
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: strings(ids),
            }],
        };
        let response = api.allocate(request).await?.into_inner();
        response.container_responses.into_iter().next().ok_or_else(|| {
            Status::unknown(format!(
                "no containers return in allocation response for {resource} {ids:?}"
            ))
        })
    }

    /// `PreStartContainer` with `ids`; refused with `FailedPrecondition` unless the plugin's
    /// options set `pre_start_required` (the kubelet calls it only then).
    pub async fn pre_start(&self, resource: &str, ids: &[&str]) -> Result<(), Status> {
        let (mut api, options) = self.client(resource)?;
        if !options.pre_start_required {
            return Err(Status::failed_precondition(format!(
                "{resource}: the plugin's options do not set pre_start_required, so the kubelet never \
                 calls PreStartContainer"
            )));
        }
        api.pre_start_container(PreStartContainerRequest {
            devices_ids: strings(ids),
        })
        .await?;
        Ok(())
    }

    fn with<T>(&self, resource: &str, f: impl FnOnce(&Resource) -> T) -> T {
        let state = lock(&self.shared.state);
        match state.resources.get(resource) {
            Some(r) => f(r),
            None => f(&Resource::default()),
        }
    }

    /// The newest registration's client, as the kubelet's endpoint for `resource`.
    fn client(&self, resource: &str) -> Result<(DevicePluginClient<Channel>, DevicePluginOptions), Status> {
        let state = lock(&self.shared.state);
        let r = state
            .resources
            .get(resource)
            .ok_or_else(|| Status::unavailable(format!("{resource}: no device plugin registered")))?;
        let client = r
            .current
            .and_then(|id| r.clients.iter().find(|c| c.id == id))
            .ok_or_else(|| {
                Status::unavailable(format!("{resource}: the device plugin endpoint is stopped"))
            })?;
        Ok((client.api.clone(), r.options.unwrap_or_default()))
    }

    async fn wait_until<T>(
        &self,
        timeout: Duration,
        mut f: impl FnMut(&KubeletState) -> Option<T>,
    ) -> Option<T> {
        let mut changes = self.shared.version.subscribe();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(found) = f(&lock(&self.shared.state)) {
                return Some(found);
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                _ => return None,
            }
        }
    }

    /// Stops serving and cuts every connection; idempotent.
    fn stop(&mut self) {
        let clients: Vec<PluginClient> = {
            let mut state = lock(&self.shared.state);
            state.stopped = true;
            state
                .resources
                .values_mut()
                .flat_map(|r| r.clients.drain(..))
                .collect()
        };
        self.shared.stopping.send_replace(true);
        if let Some(server) = &self.server {
            server.abort();
        }
        self.conns.kill_all();
        for mut client in clients {
            client.stop();
        }
    }
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        self.stop();
        remove_if_same(&self.socket, self.socket_id);
    }
}

fn strings(ids: &[&str]) -> Vec<String> {
    ids.iter().map(|s| s.to_string()).collect()
}

/// `"N devices (H healthy): id1=Healthy, id2=Unhealthy, ..."`, at most 8 listed.
pub fn summarize(devices: &[Device]) -> String {
    let healthy = devices.iter().filter(|d| d.health == HEALTHY).count();
    let mut text = format!("{} devices ({healthy} healthy)", devices.len());
    for (i, d) in devices.iter().take(8).enumerate() {
        let _ = write!(text, "{}{}={}", if i == 0 { ": " } else { ", " }, d.id, d.health);
    }
    if devices.len() > 8 {
        text.push_str(", ...");
    }
    text
}

// ---------------------------------------------------------------------------------------------
// PodResources.
// ---------------------------------------------------------------------------------------------

struct TokenBucket {
    qps: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    fn new(qps: f64, burst: u32) -> Self {
        TokenBucket {
            qps,
            burst: f64::from(burst),
            tokens: f64::from(burst),
            last: Instant::now(),
        }
    }

    fn allow(&mut self) -> bool {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.last).as_secs_f64() * self.qps).min(self.burst);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

struct PodResourcesState {
    pods: Vec<PodResources>,
    allocatable: AllocatableResourcesResponse,
    get_enabled: bool,
    limiter: Option<TokenBucket>,
    list_calls: usize,
    get_calls: usize,
    allocatable_calls: usize,
    rate_limited: usize,
}

struct PodResourcesService {
    state: Arc<Mutex<PodResourcesState>>,
}

impl PodResourcesService {
    /// The kubelet's rate-limit interceptor, then `f` on the state.
    fn call<T>(
        &self,
        f: impl FnOnce(&mut PodResourcesState) -> Result<T, Status>,
    ) -> Result<Response<T>, Status> {
        let mut state = lock(&self.state);
        if let Some(limiter) = &mut state.limiter
            && !limiter.allow()
        {
            state.rate_limited += 1;
            return Err(Status::resource_exhausted("rejected by rate limit"));
        }
        f(&mut state).map(Response::new)
    }
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _request: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        self.call(|state| {
            state.list_calls += 1;
            Ok(ListPodResourcesResponse {
                pod_resources: state.pods.clone(),
            })
        })
    }

    async fn get_allocatable_resources(
        &self,
        _request: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        self.call(|state| {
            state.allocatable_calls += 1;
            Ok(state.allocatable.clone())
        })
    }

    async fn get(
        &self,
        request: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        let request = request.into_inner();
        self.call(|state| {
            state.get_calls += 1;
            if !state.get_enabled {
                return Err(Status::unknown("PodResources API Get method disabled"));
            }
            let pod = state
                .pods
                .iter()
                .find(|p| p.name == request.pod_name && p.namespace == request.pod_namespace)
                .cloned();
            match pod {
                Some(pod) => Ok(GetPodResourcesResponse {
                    pod_resources: Some(pod),
                }),
                // A plain Go error in the kubelet, hence code Unknown (not NotFound).
                None => Err(Status::unknown(format!(
                    "pod {} in namespace {} not found",
                    request.pod_name, request.pod_namespace
                ))),
            }
        })
    }
}

/// The kubelet's PodResources server (`List`, `GetAllocatableResources`, `Get`) on a socket.
pub struct FakePodResources {
    state: Arc<Mutex<PodResourcesState>>,
    conns: Arc<ConnSet>,
    server: JoinHandle<()>,
    socket: PathBuf,
    socket_id: (u64, u64),
}

impl FakePodResources {
    /// Listens on `socket` (creating its directory, replacing a stale file) with no pods, `Get`
    /// enabled and the kubelet's rate limit on.
    pub async fn start(socket: &Path) -> FakePodResources {
        let state = Arc::new(Mutex::new(PodResourcesState {
            pods: Vec::new(),
            allocatable: AllocatableResourcesResponse::default(),
            get_enabled: true,
            limiter: Some(TokenBucket::new(POD_RESOURCES_QPS, POD_RESOURCES_BURST)),
            list_calls: 0,
            get_calls: 0,
            allocatable_calls: 0,
            rate_limited: 0,
        }));
        let (listener, socket_id) = bind(socket);
        let conns = Arc::new(ConnSet::default());
        let router = Server::builder().add_service(PodResourcesListerServer::new(PodResourcesService {
            state: Arc::clone(&state),
        }));
        let server = serve(router, listener, Arc::clone(&conns));
        FakePodResources {
            state,
            conns,
            server,
            socket: socket.to_path_buf(),
            socket_id,
        }
    }

    /// The socket served on.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Replaces the pods `List` and `Get` answer with.
    pub fn set_pods(&self, pods: Vec<PodResources>) {
        lock(&self.state).pods = pods;
    }

    /// The pods served now.
    pub fn pods(&self) -> Vec<PodResources> {
        lock(&self.state).pods.clone()
    }

    /// Adds `device_ids` of `resource` to container `container` of pod `namespace/pod`, creating
    /// the pod, the container and the resource entry as needed.
    pub fn add_container(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        resource: &str,
        device_ids: &[&str],
    ) {
        let mut state = lock(&self.state);
        let pods = &mut state.pods;
        let p = match pods
            .iter()
            .position(|p| p.namespace == namespace && p.name == pod)
        {
            Some(i) => &mut pods[i],
            None => {
                pods.push(PodResources {
                    name: pod.to_string(),
                    namespace: namespace.to_string(),
                    containers: Vec::new(),
                });
                pods.last_mut().expect("just pushed")
            }
        };
        let c = match p.containers.iter().position(|c| c.name == container) {
            Some(i) => &mut p.containers[i],
            None => {
                p.containers.push(ContainerResources {
                    name: container.to_string(),
                    ..Default::default()
                });
                p.containers.last_mut().expect("just pushed")
            }
        };
        match c.devices.iter_mut().find(|d| d.resource_name == resource) {
            Some(d) => d.device_ids.extend(strings(device_ids)),
            None => c.devices.push(ContainerDevices {
                resource_name: resource.to_string(),
                device_ids: strings(device_ids),
                topology: None,
            }),
        }
    }

    /// Removes pod `namespace/pod`; whether it was there.
    pub fn remove_pod(&self, namespace: &str, pod: &str) -> bool {
        let mut state = lock(&self.state);
        let before = state.pods.len();
        state
            .pods
            .retain(|p| !(p.namespace == namespace && p.name == pod));
        state.pods.len() != before
    }

    /// Replaces the devices `GetAllocatableResources` returns.
    pub fn set_allocatable(&self, devices: Vec<ContainerDevices>) {
        lock(&self.state).allocatable.devices = devices;
    }

    /// Turns `Get` on or off (the kubelet's `KubeletPodResourcesGet` feature gate; when off, `Get`
    /// fails with code Unknown).
    pub fn set_get_enabled(&self, enabled: bool) {
        lock(&self.state).get_enabled = enabled;
    }

    /// Sets the rate limit (requests a second, burst), or turns it off with `None`.
    pub fn set_rate_limit(&self, limit: Option<(f64, u32)>) {
        lock(&self.state).limiter = limit.map(|(qps, burst)| TokenBucket::new(qps, burst));
    }

    /// `List` calls served.
    pub fn list_calls(&self) -> usize {
        lock(&self.state).list_calls
    }

    /// `Get` calls served (including those that failed).
    pub fn get_calls(&self) -> usize {
        lock(&self.state).get_calls
    }

    /// `GetAllocatableResources` calls served.
    pub fn allocatable_calls(&self) -> usize {
        lock(&self.state).allocatable_calls
    }

    /// Calls refused by the rate limit.
    pub fn rate_limited(&self) -> usize {
        lock(&self.state).rate_limited
    }
}

impl Drop for FakePodResources {
    fn drop(&mut self) {
        self.server.abort();
        self.conns.kill_all();
        remove_if_same(&self.socket, self.socket_id);
    }
}
