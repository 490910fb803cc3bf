//! A kubelet before 1.26 (grpc-go dialing a unix socket) sends the socket's path as `:authority`.
//! These tests speak HTTP/2 as such a kubelet does, byte for byte, to the agent's real plugin
//! server (`registration::run`, which serves through `plugin::authority`), and show that plain
//! tonic resets the same request with PROTOCOL_ERROR.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpumem::agent::GPU_SOCKET;
use gpumem::agent::config::DeviceListStrategy;
use gpumem::agent::metrics::AgentMetrics;
use gpumem::agent::resource::{NodeResource, ResourceKind};
use gpumem::agent::restart::Fence;
use gpumem::agent::state::{HealthPolicy, NodeState};
use gpumem::gpu::GpuInventory;
use gpumem::liveness::Liveness;
use gpumem::plugin::devices;
use gpumem::plugin::podresources::Refresh;
use gpumem::plugin::proto::v1beta1::DevicePluginOptions;
use gpumem::plugin::proto::v1beta1::device_plugin_server::DevicePluginServer;
use gpumem::plugin::registration;
use gpumem::plugin::server::Plugin;
use gpumem_profile::Profile;
use loona_hpack::encoder::encode_integer;
use prost::Message as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;

const WAIT: Duration = Duration::from_secs(5);
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PROTOCOL_ERROR: u32 = 0x1;

struct NoRefresh;

#[tonic::async_trait]
impl Refresh for NoRefresh {
    async fn refresh(&self) {}
}

fn plugin() -> Plugin {
    let inventory = GpuInventory::discover(&Profile::load("dgx-a100").expect("built-in")).expect("profile");
    let state = NodeState::new(
        inventory,
        1024,
        devices::GPU_RESOURCE.into(),
        devices::MEM_RESOURCE.into(),
        HealthPolicy {
            ignored_xids: Vec::new(),
            quiet_period: Duration::from_secs(300),
        },
    );
    Plugin {
        source: Arc::new(NodeResource {
            kind: ResourceKind::Whole,
            state: Arc::new(state),
            refresher: Arc::new(NoRefresh),
            strategy: DeviceListStrategy::Envvar,
            enforcement: None,
            api_server: None,
            metrics: Arc::new(AgentMetrics::new()),
            fence: Arc::new(Fence::new(None)),
        }),
        liveness: Arc::new(Liveness::default()),
    }
}

/// A short directory under /tmp (unix socket paths are limited to 107 bytes).
fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("pa")
        .tempdir_in("/tmp")
        .expect("cannot create a temporary directory")
}

async fn wait_for(socket: &Path) {
    let start = Instant::now();
    while !socket.exists() {
        assert!(start.elapsed() < WAIT, "{} never appeared", socket.display());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    v.extend_from_slice(&[kind, flags]);
    v.extend_from_slice(&stream.to_be_bytes());
    v.extend_from_slice(payload);
    v
}

fn string(text: &[u8]) -> Vec<u8> {
    let mut v = encode_integer(text.len(), 7);
    v.extend_from_slice(text);
    v
}

/// Literal with incremental indexing (RFC 7541 §6.2.1), name by static index (0: literal name).
fn incremental(index: usize, name: &[u8], value: &[u8]) -> Vec<u8> {
    let mut v = encode_integer(index, 6);
    v[0] |= 0x40;
    if index == 0 {
        v.extend(string(name));
    }
    v.extend(string(value));
    v
}

/// The header block grpc-go writes for its first call on a connection: every header not fully in
/// the static table is added to the dynamic table, the socket path as `:authority` included.
fn first_call(authority: &[u8]) -> Vec<u8> {
    let mut block = vec![0x80 | 3, 0x80 | 6]; // :method POST, :scheme http
    block.extend(incremental(
        4,
        b":path",
        b"/v1beta1.DevicePlugin/GetDevicePluginOptions",
    ));
    block.extend(incremental(1, b":authority", authority));
    block.extend(incremental(31, b"content-type", b"application/grpc"));
    block.extend(incremental(58, b"user-agent", b"grpc-go/1.49.0"));
    block.extend(incremental(0, b"te", b"trailers"));
    block
}

/// The same call again: all of it indexed. The dynamic table holds, newest first, te (62),
/// user-agent (63), content-type (64), :authority (65), :path (66).
fn second_call() -> Vec<u8> {
    vec![
        0x80 | 3,
        0x80 | 6,
        0x80 | 66,
        0x80 | 65,
        0x80 | 64,
        0x80 | 63,
        0x80 | 62,
    ]
}

/// What came back for one call.
#[derive(Debug)]
enum Outcome {
    Reset(u32),
    Answered {
        headers: Vec<(String, String)>,
        message: Vec<u8>,
        trailers: Vec<(String, String)>,
    },
}

/// A kubelet before 1.26, reduced to what it writes for unary calls.
struct OldKubelet {
    conn: UnixStream,
    /// Mirrors the server's encoder: every block it sends must be decoded, in order.
    decoder: loona_hpack::Decoder<'static>,
}

impl OldKubelet {
    async fn connect(socket: &Path) -> Self {
        let mut conn = UnixStream::connect(socket).await.expect("connect");
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        conn.write_all(&hello).await.expect("write preface");
        Self {
            conn,
            decoder: loona_hpack::Decoder::new(),
        }
    }

    async fn read_frame(&mut self) -> (u8, u8, u32, Vec<u8>) {
        let mut head = [0; 9];
        tokio::time::timeout(WAIT, self.conn.read_exact(&mut head))
            .await
            .expect("no frame from the server in time")
            .expect("read frame header");
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0; len];
        self.conn
            .read_exact(&mut payload)
            .await
            .expect("read frame payload");
        (head[3], head[4], stream, payload)
    }

    fn decode(&mut self, flags: u8, block: &[u8]) -> Vec<(String, String)> {
        assert!(flags & END_HEADERS != 0, "the server's headers fit one frame");
        self.decoder
            .decode(block)
            .expect("server headers decode")
            .into_iter()
            .map(|(n, v)| {
                (
                    String::from_utf8_lossy(&n).into(),
                    String::from_utf8_lossy(&v).into(),
                )
            })
            .collect()
    }

    /// One unary call with an empty message, as a HEADERS frame with `block` and a DATA frame.
    async fn call(&mut self, stream: u32, block: &[u8]) -> Outcome {
        let mut request = frame(HEADERS, END_HEADERS, stream, block);
        request.extend(frame(DATA, END_STREAM, stream, &[0, 0, 0, 0, 0]));
        self.conn.write_all(&request).await.expect("write request");
        let mut headers = None;
        let mut body = Vec::new();
        loop {
            let (kind, flags, on, payload) = self.read_frame().await;
            match kind {
                SETTINGS if flags & ACK == 0 => {
                    self.conn
                        .write_all(&frame(SETTINGS, ACK, 0, &[]))
                        .await
                        .expect("ack settings");
                }
                PING if flags & ACK == 0 => {
                    self.conn
                        .write_all(&frame(PING, ACK, 0, &payload))
                        .await
                        .expect("answer ping");
                }
                GOAWAY => panic!("GOAWAY from the server: {payload:?}"),
                RST_STREAM if on == stream => {
                    return Outcome::Reset(u32::from_be_bytes(payload[..4].try_into().expect("4 bytes")));
                }
                HEADERS => {
                    let decoded = self.decode(flags, &payload);
                    assert_eq!(on, stream, "headers on a stream we did not open");
                    match headers.take() {
                        None if flags & END_STREAM == 0 => headers = Some(decoded),
                        None => panic!("trailers-only answer: {decoded:?}"),
                        Some(headers) => {
                            assert!(flags & END_STREAM != 0, "trailers end the stream");
                            let message = grpc_message(&body);
                            return Outcome::Answered {
                                headers,
                                message,
                                trailers: decoded,
                            };
                        }
                    }
                }
                DATA if on == stream => body.extend(payload),
                _ => {}
            }
        }
    }
}

/// The one message of a gRPC body: 1 flag byte, 4 length bytes, the message.
fn grpc_message(body: &[u8]) -> Vec<u8> {
    assert!(body.len() >= 5, "no gRPC message in {body:?}");
    assert_eq!(body[0], 0, "uncompressed");
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    assert_eq!(body.len(), 5 + len, "exactly one message");
    body[5..].to_vec()
}

fn value<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

fn assert_options(outcome: Outcome) {
    let Outcome::Answered {
        headers,
        message,
        trailers,
    } = outcome
    else {
        panic!("the call was not answered: {outcome:?}");
    };
    assert_eq!(value(&headers, ":status"), Some("200"), "{headers:?}");
    assert_eq!(value(&trailers, "grpc-status"), Some("0"), "{trailers:?}");
    let options = DevicePluginOptions::decode(message.as_slice()).expect("DevicePluginOptions");
    assert_eq!(
        options,
        DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }
    );
}

#[tokio::test]
async fn a_kubelet_before_1_26_gets_answers_from_the_agent_plugin_server() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let dir = tempdir();
    let (shutdown, shutdown_rx) = watch::channel(false);
    // The agent's own serve path; no kubelet to register with, which it keeps retrying.
    let server = tokio::spawn(registration::run(
        plugin(),
        dir.path().to_path_buf(),
        GPU_SOCKET.into(),
        shutdown_rx,
    ));
    let socket = dir.path().join(GPU_SOCKET);
    wait_for(&socket).await;

    let path = socket.to_str().expect("utf-8 path").as_bytes().to_vec();
    let mut kubelet = OldKubelet::connect(&socket).await;
    assert_options(kubelet.call(1, &first_call(&path)).await);
    // The second call refers to the socket path by its dynamic-table index.
    assert_options(kubelet.call(3, &second_call()).await);

    shutdown.send(true).expect("server listening");
    tokio::time::timeout(WAIT, server)
        .await
        .expect("plugin stops")
        .expect("joins")
        .expect("runs cleanly");
}

#[tokio::test]
async fn plain_tonic_resets_the_same_request() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let dir = tempdir();
    let socket = dir.path().join("plain.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(plugin()))
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );

    // The client itself is sound: with a valid authority plain tonic answers it.
    let mut kubelet = OldKubelet::connect(&socket).await;
    assert_options(kubelet.call(1, &first_call(b"localhost")).await);

    let path = socket.to_str().expect("utf-8 path").as_bytes().to_vec();
    let mut kubelet = OldKubelet::connect(&socket).await;
    match kubelet.call(1, &first_call(&path)).await {
        Outcome::Reset(code) => assert_eq!(code, PROTOCOL_ERROR, "reset with PROTOCOL_ERROR"),
        answered => panic!("plain tonic answered a socket-path :authority: {answered:?}"),
    }
    server.abort();
}
