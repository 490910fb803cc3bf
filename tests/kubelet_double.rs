//! Tests of the kubelet double (`support::kubelet`) against a minimal device plugin written here:
//! registration, device lists, the 4 MiB receive limit, a kubelet restart, clean shutdown, and
//! the PodResources server.

mod support;

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpumem::plugin::authority::AuthorityRewrite;
use gpumem::plugin::proto::podresources::pod_resources_lister_client::PodResourcesListerClient;
use gpumem::plugin::proto::podresources::{
    AllocatableResourcesRequest, ContainerDevices, GetPodResourcesRequest, ListPodResourcesRequest,
};
use gpumem::plugin::proto::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use gpumem::plugin::proto::v1beta1::registration_client::RegistrationClient;
use gpumem::plugin::proto::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, ContainerPreferredAllocationResponse,
    Device, DevicePluginOptions, Empty, ListAndWatchResponse, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest,
};
use gpumem::plugin::proto::{HEALTHY, KUBELET_MAX_RECV_BYTES, KUBELET_SOCKET, UNHEALTHY, VERSION};
use gpumem::plugin::uds;
use prost::Message as _;
use support::kubelet::{
    Authority, CHECKPOINT_FILE, FakeKubelet, FakePodResources, is_extended_resource_name,
};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::transport::Server;
use tonic::{Code, Request, Response, Status};

const RESOURCE: &str = "example.com/gpu";
const ENDPOINT: &str = "example-gpu.sock";
const WAIT: Duration = Duration::from_secs(5);
/// The plugin here is plain tonic, without `plugin::authority`: only kubelets since 1.26 can call it.
const KUBELET: Authority = Authority::Localhost;

/// A short directory under /tmp (unix socket paths are limited to 107 bytes).
fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kd")
        .tempdir_in("/tmp")
        .expect("cannot create a temporary directory")
}

fn device(id: &str, health: &str) -> Device {
    Device {
        id: id.to_string(),
        health: health.to_string(),
        topology: None,
    }
}

fn ids(devices: &[Device]) -> Vec<&str> {
    devices.iter().map(|d| d.id.as_str()).collect()
}

// ---------------------------------------------------------------------------------------------
// A minimal device plugin.
// ---------------------------------------------------------------------------------------------

/// What the test plugin serves and what it has seen.
struct PluginState {
    options: DevicePluginOptions,
    /// The device list; every open `ListAndWatch` stream sends it again when it changes.
    devices: watch::Sender<Vec<Device>>,
    /// How long a new `ListAndWatch` stream waits before its first message.
    first_delay: Duration,
    /// Set to end every open stream (and new ones at once) with OK, i.e. EOF for the kubelet.
    end_streams: watch::Sender<bool>,
    /// Streams that stopped because the kubelet went away (the receiving side was dropped).
    streams_cut: watch::Sender<usize>,
    options_calls: AtomicUsize,
    list_calls: AtomicUsize,
    allocations: Mutex<Vec<Vec<String>>>,
}

impl PluginState {
    fn new(devices: Vec<Device>, first_delay: Duration) -> Arc<Self> {
        Arc::new(PluginState {
            options: DevicePluginOptions {
                pre_start_required: false,
                get_preferred_allocation_available: true,
            },
            devices: watch::channel(devices).0,
            first_delay,
            end_streams: watch::channel(false).0,
            streams_cut: watch::channel(0).0,
            options_calls: AtomicUsize::new(0),
            list_calls: AtomicUsize::new(0),
            allocations: Mutex::new(Vec::new()),
        })
    }

    async fn wait_streams_cut(&self, at_least: usize) {
        let mut cut = self.streams_cut.subscribe();
        tokio::time::timeout(WAIT, cut.wait_for(|n| *n >= at_least))
            .await
            .unwrap_or_else(|_| {
                panic!("the kubelet did not cut the plugin's ListAndWatch stream within {WAIT:?}")
            })
            .expect("the sender lives in the state");
    }
}

struct TestPlugin(Arc<PluginState>);

#[tonic::async_trait]
impl DevicePlugin for TestPlugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        self.0.options_calls.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(self.0.options))
    }

    type ListAndWatchStream = ReceiverStream<Result<ListAndWatchResponse, Status>>;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        self.0.list_calls.fetch_add(1, Ordering::SeqCst);
        let state = Arc::clone(&self.0);
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            tokio::time::sleep(state.first_delay).await;
            let mut devices = state.devices.subscribe();
            let mut end = state.end_streams.subscribe();
            loop {
                let list = devices.borrow_and_update().clone();
                if tx.send(Ok(ListAndWatchResponse { devices: list })).await.is_err() {
                    break;
                }
                tokio::select! {
                    _ = devices.changed() => {}
                    _ = end.wait_for(|end| *end) => return,
                    _ = tx.closed() => break,
                }
            }
            state.streams_cut.send_modify(|n| *n += 1);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    /// Must-include devices first, then the available ones in order, up to the size.
    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| {
                let mut chosen = c.must_include_device_i_ds.clone();
                for id in c.available_device_i_ds {
                    if chosen.len() >= c.allocation_size as usize {
                        break;
                    }
                    if !chosen.contains(&id) {
                        chosen.push(id);
                    }
                }
                ContainerPreferredAllocationResponse { device_i_ds: chosen }
            })
            .collect();
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    /// Answers `EXAMPLE_DEVICES=<ids joined by commas>` per container.
    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in request.into_inner().container_requests {
            self.0.allocations.lock().unwrap().push(c.devices_ids.clone());
            let mut response = ContainerAllocateResponse::default();
            response
                .envs
                .insert("EXAMPLE_DEVICES".to_string(), c.devices_ids.join(","));
            container_responses.push(response);
        }
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// Serves the test plugin on `socket` (replacing a stale file).
fn serve_plugin(socket: &Path, state: &Arc<PluginState>) -> JoinHandle<()> {
    let _ = std::fs::remove_file(socket);
    let listener =
        UnixListener::bind(socket).unwrap_or_else(|e| panic!("cannot listen on {}: {e}", socket.display()));
    let service = DevicePluginServer::new(TestPlugin(Arc::clone(state)));
    tokio::spawn(async move {
        Server::builder()
            .add_service(service)
            .serve_with_incoming(UnixListenerStream::new(listener))
            .await
            .expect("the test plugin's server failed");
    })
}

/// Like [`serve_plugin`], with every connection through the agent's `:authority` adapter.
fn serve_plugin_with_adapter(socket: &Path, state: &Arc<PluginState>) -> JoinHandle<()> {
    use tokio_stream::StreamExt as _;
    let _ = std::fs::remove_file(socket);
    let listener =
        UnixListener::bind(socket).unwrap_or_else(|e| panic!("cannot listen on {}: {e}", socket.display()));
    let service = DevicePluginServer::new(TestPlugin(Arc::clone(state)));
    let incoming = UnixListenerStream::new(listener).map(|conn| conn.map(AuthorityRewrite::new));
    tokio::spawn(async move {
        Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming)
            .await
            .expect("the test plugin's server failed");
    })
}

/// Calls `Register` on `<dir>/kubelet.sock` as a plugin does.
async fn register(dir: &Path, version: &str, endpoint: &str, resource: &str) -> Result<(), Status> {
    let channel = uds::connect(&dir.join(KUBELET_SOCKET))
        .await
        .map_err(|e| Status::unavailable(format!("cannot connect to the kubelet: {e}")))?;
    let request = RegisterRequest {
        version: version.to_string(),
        endpoint: endpoint.to_string(),
        resource_name: resource.to_string(),
        options: Some(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }),
    };
    RegistrationClient::new(channel)
        .register(request)
        .await
        .map(|_| ())
}

/// Waits until `condition` holds, checking every 10 ms; panics after [`WAIT`] with `what`.
async fn eventually(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !condition() {
        assert!(
            Instant::now() < deadline,
            "timed out after {WAIT:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Device manager.
// ---------------------------------------------------------------------------------------------

/// The double's default is a stock 1.24 kubelet: its calls carry the socket path as `:authority`, which
/// a plain tonic plugin resets (as a real 1.24 kubelet sees it), and which the agent's adapter repairs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_the_double_calls_plugins_as_a_1_24_kubelet_does() {
    let dir = tempdir();
    let _kubelet = FakeKubelet::start(dir.path()).await;
    let plugin = PluginState::new(vec![device("dev0", HEALTHY)], Duration::ZERO);
    let server = serve_plugin(&dir.path().join(ENDPOINT), &plugin);
    let refused = register(dir.path(), VERSION, ENDPOINT, RESOURCE)
        .await
        .expect_err("a plain tonic plugin cannot answer a 1.24 kubelet");
    assert!(refused.message().contains("protocol error"), "{refused:?}");
    assert_eq!(plugin.options_calls.load(Ordering::SeqCst), 0);
    server.abort();

    let _server = serve_plugin_with_adapter(&dir.path().join(ENDPOINT), &plugin);
    register(dir.path(), VERSION, ENDPOINT, RESOURCE)
        .await
        .expect("with the adapter the same kubelet registers the plugin");
    assert_eq!(plugin.options_calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_round_trip() {
    let dir = tempdir();
    let kubelet = FakeKubelet::start_with(dir.path(), KUBELET).await;
    let first_delay = Duration::from_millis(300);
    let plugin = PluginState::new(
        vec![
            device("dev0", HEALTHY),
            device("dev1", HEALTHY),
            device("dev2", UNHEALTHY),
        ],
        first_delay,
    );
    let _server = serve_plugin(&dir.path().join(ENDPOINT), &plugin);

    let started = Instant::now();
    register(dir.path(), VERSION, ENDPOINT, RESOURCE)
        .await
        .expect("Register failed");
    // Register is answered only after the first list arrived: everything is there at once.
    assert!(
        started.elapsed() >= first_delay,
        "Register answered before the first ListAndWatch message"
    );
    assert_eq!(
        plugin.options_calls.load(Ordering::SeqCst),
        1,
        "GetDevicePluginOptions calls"
    );
    assert_eq!(plugin.list_calls.load(Ordering::SeqCst), 1, "ListAndWatch calls");
    assert_eq!(kubelet.list_count(RESOURCE), 1);
    assert_eq!(ids(&kubelet.devices(RESOURCE)), ["dev0", "dev1", "dev2"]);
    assert_eq!(kubelet.options(RESOURCE), plugin.options);
    let registrations = kubelet.registrations(RESOURCE);
    assert_eq!(registrations.len(), 1);
    assert_eq!(registrations[0].endpoint, ENDPOINT);
    assert_eq!(kubelet.wait_registered(RESOURCE, WAIT).await, registrations[0]);
    assert_eq!(kubelet.healthy_ids(RESOURCE), ["dev0", "dev1"]);
    assert_eq!(kubelet.unhealthy_ids(RESOURCE), ["dev2"]);
    assert!(kubelet.connected(RESOURCE));
    assert!(kubelet.stream_errors(RESOURCE).is_empty());
    assert!(kubelet.registrations("example.com/other").is_empty());
    let checkpoint = std::fs::read_to_string(dir.path().join(CHECKPOINT_FILE)).expect("no checkpoint file");
    assert!(
        checkpoint.contains("dev1") && !checkpoint.contains("dev2"),
        "checkpoint: {checkpoint}"
    );

    // A device turns unhealthy: the next list carries it.
    plugin.devices.send_replace(vec![
        device("dev0", UNHEALTHY),
        device("dev1", HEALTHY),
        device("dev2", UNHEALTHY),
    ]);
    let list = kubelet
        .wait_devices(RESOURCE, WAIT, |devices| {
            devices.iter().any(|d| d.id == "dev0" && d.health == UNHEALTHY)
        })
        .await;
    assert_eq!(ids(&list), ["dev0", "dev1", "dev2"]);
    assert_eq!(kubelet.list_count(RESOURCE), 2);
    assert_eq!(kubelet.lists(RESOURCE).len(), 2);
    assert_eq!(kubelet.healthy_ids(RESOURCE), ["dev1"]);

    // The drive API reaches the plugin.
    let allocated = kubelet
        .allocate(RESOURCE, &["dev1"])
        .await
        .expect("Allocate failed");
    assert_eq!(
        allocated.envs.get("EXAMPLE_DEVICES").map(String::as_str),
        Some("dev1")
    );
    assert_eq!(*plugin.allocations.lock().unwrap(), [vec!["dev1".to_string()]]);
    let preferred = kubelet
        .preferred(RESOURCE, &["dev0", "dev1", "dev2"], &["dev2"], 2)
        .await;
    assert_eq!(
        preferred.expect("GetPreferredAllocation failed"),
        ["dev2", "dev0"]
    );
    let pre_start = kubelet
        .pre_start(RESOURCE, &["dev1"])
        .await
        .expect_err("pre_start_required is false");
    assert_eq!(pre_start.code(), Code::FailedPrecondition);
    let unknown = kubelet
        .allocate("example.com/other", &["x"])
        .await
        .expect_err("no such resource");
    assert_eq!(unknown.code(), Code::Unavailable);

    // The plugin ends its stream: the kubelet disconnects it and counts nothing as allocatable.
    plugin.end_streams.send_replace(true);
    eventually("the kubelet sees the stream end", || !kubelet.connected(RESOURCE)).await;
    let errors = kubelet.stream_errors(RESOURCE);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].starts_with("EOF"), "{errors:?}");
    assert!(kubelet.healthy_ids(RESOURCE).is_empty());
    assert_eq!(kubelet.unhealthy_ids(RESOURCE), ["dev0", "dev1", "dev2"]);
    let stopped = kubelet
        .allocate(RESOURCE, &["dev1"])
        .await
        .expect_err("the endpoint is stopped");
    assert_eq!(stopped.code(), Code::Unavailable);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_rejects_what_the_kubelet_rejects() {
    let dir = tempdir();
    let kubelet = FakeKubelet::start_with(dir.path(), KUBELET).await;
    let plugin = PluginState::new(vec![device("dev0", HEALTHY)], Duration::ZERO);
    let _server = serve_plugin(&dir.path().join(ENDPOINT), &plugin);

    let bad_version = register(dir.path(), "v1alpha", ENDPOINT, RESOURCE)
        .await
        .expect_err("bad version");
    assert_eq!(bad_version.code(), Code::Unknown);
    assert!(bad_version.message().contains("not supported"), "{bad_version:?}");
    for name in [
        "gpu",
        "kubernetes.io/gpu",
        "requests.example.com/gpu",
        "Example.com/gpu",
        "example.com/-gpu",
    ] {
        let invalid = register(dir.path(), VERSION, ENDPOINT, name)
            .await
            .expect_err(name);
        assert_eq!(invalid.code(), Code::Unknown);
        assert!(invalid.message().contains("is invalid"), "{invalid:?}");
    }
    assert_eq!(kubelet.rejected().len(), 6);
    assert_eq!(
        plugin.options_calls.load(Ordering::SeqCst),
        0,
        "a rejected plugin must not be dialled"
    );
    assert!(kubelet.registrations(RESOURCE).is_empty());

    for name in ["nvidia.com/gpu", "nvidia.com/gpu-mem", "example.com/gpu_2.x"] {
        assert!(is_extended_resource_name(name), "{name}");
    }
    register(dir.path(), VERSION, ENDPOINT, "nvidia.com/gpu-mem")
        .await
        .expect("a valid name is accepted");
    assert_eq!(kubelet.registrations("nvidia.com/gpu-mem").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_removes_sockets_and_sees_reregistration() {
    let dir = tempdir();
    let kubelet = FakeKubelet::start_with(dir.path(), KUBELET).await;
    let plugin = PluginState::new(vec![device("dev0", HEALTHY)], Duration::ZERO);
    let plugin_socket = dir.path().join(ENDPOINT);
    let server = serve_plugin(&plugin_socket, &plugin);
    register(dir.path(), VERSION, ENDPOINT, RESOURCE)
        .await
        .expect("Register failed");
    assert_eq!(kubelet.registrations(RESOURCE).len(), 1);

    // Other things in the directory: another socket, a regular file, a directory.
    let other_socket = dir.path().join("other.sock");
    drop(std::os::unix::net::UnixListener::bind(&other_socket).expect("cannot bind other.sock"));
    std::fs::write(dir.path().join("notes.txt"), "not a socket").unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();

    let kubelet = kubelet.restart().await;

    let exists = |name: &str| dir.path().join(name).exists();
    assert!(
        !plugin_socket.exists(),
        "the plugin's socket survived the restart"
    );
    assert!(!exists("other.sock"), "another socket survived the restart");
    assert!(
        exists("notes.txt") && exists("sub") && exists(CHECKPOINT_FILE),
        "non-sockets must stay"
    );
    assert!(exists(KUBELET_SOCKET));
    let mut removed = kubelet.removed_at_start();
    removed.sort();
    assert_eq!(removed, [ENDPOINT, KUBELET_SOCKET, "other.sock"]);
    assert!(
        kubelet.registrations(RESOURCE).is_empty(),
        "registrations must start empty"
    );
    assert_eq!(kubelet.list_count(RESOURCE), 0);
    // The kubelet's death cut the plugin's ListAndWatch stream.
    plugin.wait_streams_cut(1).await;

    // The plugin notices its socket is gone, serves again and re-registers.
    server.abort();
    let _server = serve_plugin(&plugin_socket, &plugin);
    register(dir.path(), VERSION, ENDPOINT, RESOURCE)
        .await
        .expect("Register after the restart failed");
    let registration = kubelet.wait_registered(RESOURCE, WAIT).await;
    assert_eq!(registration.endpoint, ENDPOINT);
    assert_eq!(kubelet.registrations(RESOURCE).len(), 1);
    assert_eq!(ids(&kubelet.devices(RESOURCE)), ["dev0"]);
    assert_eq!(plugin.list_calls.load(Ordering::SeqCst), 2);
    assert!(kubelet.connected(RESOURCE));
}

/// A list of `Device`s whose `ListAndWatchResponse` encodes to about `target` bytes.
fn list_of_about(target: usize) -> ListAndWatchResponse {
    let one = |i: usize| {
        device(
            &format!("GPU-5c8a1e2f-0b7d-4c39-9e61-2a4f8d3b7c10-m{i:07}"),
            HEALTHY,
        )
    };
    let per_device = ListAndWatchResponse {
        devices: vec![one(0)],
    }
    .encoded_len();
    ListAndWatchResponse {
        devices: (0..target / per_device).map(one).collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_over_4_mib_is_a_stream_error() {
    let dir = tempdir();
    let kubelet = FakeKubelet::start_with(dir.path(), KUBELET).await;

    // Just under the limit: accepted.
    let under = list_of_about(KUBELET_MAX_RECV_BYTES - 1000);
    assert!(under.encoded_len() <= KUBELET_MAX_RECV_BYTES);
    let small = PluginState::new(under.devices.clone(), Duration::ZERO);
    let _small_server = serve_plugin(&dir.path().join("small.sock"), &small);
    register(dir.path(), VERSION, "small.sock", "example.com/small")
        .await
        .expect("Register failed");
    assert_eq!(kubelet.devices("example.com/small").len(), under.devices.len());
    assert!(kubelet.stream_errors("example.com/small").is_empty());

    // Just over: the kubelet's stream fails, nothing is accepted.
    let over = list_of_about(KUBELET_MAX_RECV_BYTES + 1000);
    assert!(over.encoded_len() > KUBELET_MAX_RECV_BYTES);
    let big = PluginState::new(over.devices, Duration::ZERO);
    let _big_server = serve_plugin(&dir.path().join("big.sock"), &big);
    register(dir.path(), VERSION, "big.sock", RESOURCE)
        .await
        .expect("Register is answered OK regardless");
    eventually("the stream error is recorded", || {
        !kubelet.stream_errors(RESOURCE).is_empty()
    })
    .await;
    let errors = kubelet.stream_errors(RESOURCE);
    assert!(
        errors[0].contains(&KUBELET_MAX_RECV_BYTES.to_string()),
        "{errors:?}"
    );
    assert!(kubelet.devices(RESOURCE).is_empty());
    assert_eq!(kubelet.list_count(RESOURCE), 0);
    assert!(!kubelet.connected(RESOURCE));
}

/// An HTTP/2 connection to `socket`, opened by hand and known to be served (the server's first
/// frame has been read), with a read timeout of [`WAIT`].
fn open_raw_h2(socket: &Path) -> std::os::unix::net::UnixStream {
    let mut stream = std::os::unix::net::UnixStream::connect(socket).expect("cannot connect");
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .unwrap();
    let mut frame_header = [0u8; 9];
    stream
        .read_exact(&mut frame_header)
        .expect("the server did not answer the HTTP/2 preface");
    stream
}

/// Reads until end of file or an error: whether the peer closed the connection within [`WAIT`]
/// (a read timeout is not a close).
async fn closed_by_peer(mut stream: std::os::unix::net::UnixStream) -> bool {
    tokio::task::spawn_blocking(move || {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) => {
                    return !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    );
                }
            }
        }
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_cuts_connections_and_removes_the_socket() {
    let dir = tempdir();
    let kubelet = FakeKubelet::start_with(dir.path(), KUBELET).await;
    let plugin = PluginState::new(vec![device("dev0", HEALTHY)], Duration::ZERO);
    let _server = serve_plugin(&dir.path().join(ENDPOINT), &plugin);
    register(dir.path(), VERSION, ENDPOINT, RESOURCE)
        .await
        .expect("Register failed");
    let socket: PathBuf = kubelet.socket().to_path_buf();
    assert!(socket.exists());
    // A client connection to kubelet.sock left open, as a plugin might keep one.
    let raw = open_raw_h2(&socket);
    // A Register in flight: the kubelet waits for this plugin's first list.
    let slow = PluginState::new(vec![device("dev0", HEALTHY)], Duration::from_secs(30));
    let _slow_server = serve_plugin(&dir.path().join("slow.sock"), &slow);
    let slow_dir = dir.path().to_path_buf();
    let in_flight =
        tokio::spawn(async move { register(&slow_dir, VERSION, "slow.sock", "example.com/slow").await });
    eventually("the slow plugin's ListAndWatch is called", || {
        slow.list_calls.load(Ordering::SeqCst) == 1
    })
    .await;

    drop(kubelet);
    assert!(!socket.exists(), "kubelet.sock survived the drop");
    plugin.wait_streams_cut(1).await;
    assert!(
        closed_by_peer(raw).await,
        "an open connection to kubelet.sock survived the drop"
    );
    let answer = tokio::time::timeout(WAIT, in_flight)
        .await
        .expect("a Register in flight hung")
        .unwrap();
    assert!(
        answer.is_err(),
        "a Register in flight succeeded on a dropped kubelet"
    );
    assert!(
        uds::connect(&socket).await.is_err(),
        "something still listens on kubelet.sock"
    );
}

// ---------------------------------------------------------------------------------------------
// PodResources.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_resources_round_trip() {
    let dir = tempdir();
    let socket = dir.path().join("pod-resources").join(KUBELET_SOCKET);
    let pod_resources = FakePodResources::start(&socket).await;
    pod_resources.add_container("default", "p1", "c1", RESOURCE, &["dev0", "dev1"]);
    pod_resources.add_container("default", "p1", "c2", RESOURCE, &["dev2"]);
    pod_resources.add_container("default", "p1", "c2", RESOURCE, &["dev3"]);
    pod_resources.add_container("other", "p2", "c1", "example.com/other", &["x"]);
    pod_resources.set_allocatable(vec![ContainerDevices {
        resource_name: RESOURCE.to_string(),
        device_ids: vec!["dev0".into(), "dev1".into(), "dev2".into(), "dev3".into()],
        topology: None,
    }]);

    let mut client = PodResourcesListerClient::new(uds::connect(&socket).await.expect("cannot connect"));
    let listed = client
        .list(ListPodResourcesRequest {})
        .await
        .expect("List failed")
        .into_inner();
    assert_eq!(listed.pod_resources, pod_resources.pods());
    assert_eq!(listed.pod_resources.len(), 2);
    let p1 = &listed.pod_resources[0];
    assert_eq!((p1.namespace.as_str(), p1.name.as_str()), ("default", "p1"));
    assert_eq!(p1.containers.len(), 2);
    assert_eq!(p1.containers[1].devices[0].device_ids, ["dev2", "dev3"]);

    let got = client
        .get(GetPodResourcesRequest {
            pod_name: "p1".into(),
            pod_namespace: "default".into(),
        })
        .await
        .expect("Get failed")
        .into_inner();
    assert_eq!(got.pod_resources.as_ref(), Some(p1));
    let missing = client
        .get(GetPodResourcesRequest {
            pod_name: "p1".into(),
            pod_namespace: "other".into(),
        })
        .await
        .expect_err("Get of an unknown pod");
    assert_eq!(missing.code(), Code::Unknown, "the kubelet answers a plain error");
    assert!(missing.message().contains("not found"), "{missing:?}");

    let allocatable = client
        .get_allocatable_resources(AllocatableResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(allocatable.devices[0].device_ids.len(), 4);

    assert!(pod_resources.remove_pod("default", "p1"));
    assert!(!pod_resources.remove_pod("default", "p1"));
    let listed = client
        .list(ListPodResourcesRequest {})
        .await
        .expect("List failed")
        .into_inner();
    assert_eq!(listed.pod_resources.len(), 1);
    assert_eq!(listed.pod_resources[0].name, "p2");
    assert_eq!(pod_resources.list_calls(), 2);
    assert_eq!(pod_resources.get_calls(), 2);
    assert_eq!(pod_resources.allocatable_calls(), 1);

    pod_resources.set_get_enabled(false);
    let disabled = client
        .get(GetPodResourcesRequest {
            pod_name: "p2".into(),
            pod_namespace: "other".into(),
        })
        .await
        .expect_err("Get is disabled");
    assert!(disabled.message().contains("disabled"), "{disabled:?}");

    // The kubelet's rate limit, made small here: two requests pass, the third is refused.
    pod_resources.set_rate_limit(Some((0.5, 2)));
    client
        .list(ListPodResourcesRequest {})
        .await
        .expect("first List within the burst");
    client
        .list(ListPodResourcesRequest {})
        .await
        .expect("second List within the burst");
    let limited = client
        .list(ListPodResourcesRequest {})
        .await
        .expect_err("over the rate limit");
    assert_eq!(limited.code(), Code::ResourceExhausted);
    assert_eq!(pod_resources.rate_limited(), 1);

    pod_resources.set_rate_limit(None);
    client
        .list(ListPodResourcesRequest {})
        .await
        .expect("List without a rate limit");

    drop(pod_resources);
    assert!(!socket.exists(), "the pod-resources socket survived the drop");
    assert!(
        client.list(ListPodResourcesRequest {}).await.is_err(),
        "the connection survived the drop"
    );
}
