//! Shared by the scorer tests: a raw HTTP/1.1 client (no HTTP library between the test and the
//! server), node and pod builders in the shape kube-scheduler sends, and a fake Kubernetes API server.
#![allow(dead_code)]

/// What the fake API servers copy of a real one (shared with the agent's, tests/support/apiserver.rs).
#[path = "support/k8s.rs"]
pub mod k8s;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpumem::scorer::config::ScorerConfig;
use gpumem::scorer::{Scorer, server};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use self::k8s::{Access, Authorizer, pod_matches_fields, request_info, stored_node, stored_pod};

pub fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/scorer/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

pub fn fixture_json(name: &str) -> Value {
    serde_json::from_str(&fixture(name)).expect("fixture is JSON")
}

/// Starts a scorer on 127.0.0.1:0.
pub async fn start(scorer: Scorer) -> (SocketAddr, Arc<Scorer>) {
    let scorer = Arc::new(scorer);
    let (addr, _task) = server::spawn(scorer.clone(), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind loopback");
    (addr, scorer)
}

pub async fn start_default() -> SocketAddr {
    start(Scorer::new(ScorerConfig::default(), None, None, None))
        .await
        .0
}

/// One keep-alive HTTP/1.1 connection.
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    pub async fn open(addr: SocketAddr) -> Conn {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        Conn {
            stream,
            buf: Vec::new(),
        }
    }

    /// Sends a request; returns status and body.
    pub async fn request(&mut self, method: &str, path: &str, body: &[u8]) -> (u16, String) {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        self.stream.write_all(head.as_bytes()).await.expect("write head");
        // The server may answer (413) and stop reading before the body is all sent.
        let _ = self.stream.write_all(body).await;
        self.read_response().await
    }

    /// Sends a chunked body (no Content-Length).
    pub async fn request_chunked(&mut self, path: &str, body: &[u8]) -> (u16, String) {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        );
        self.stream.write_all(head.as_bytes()).await.expect("write head");
        for chunk in body.chunks(16 * 1024) {
            let mut msg = format!("{:x}\r\n", chunk.len()).into_bytes();
            msg.extend_from_slice(chunk);
            msg.extend_from_slice(b"\r\n");
            if self.stream.write_all(&msg).await.is_err() {
                break;
            }
        }
        let _ = self.stream.write_all(b"0\r\n\r\n").await;
        self.read_response().await
    }

    async fn read_response(&mut self) -> (u16, String) {
        let header_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i;
            }
            self.fill().await;
        };
        let head = String::from_utf8_lossy(&self.buf[..header_end]).to_string();
        let status: u16 = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("status line");
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .expect("content-length");
        let start = header_end + 4;
        while self.buf.len() < start + length {
            self.fill().await;
        }
        let body = String::from_utf8_lossy(&self.buf[start..start + length]).to_string();
        self.buf.drain(..start + length);
        (status, body)
    }

    /// Sends `bytes` as they are (part of a request, say).
    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    /// Whether the server closes this connection within `wait`.
    pub async fn closed_within(&mut self, wait: Duration) -> bool {
        closed_within(&mut self.stream, wait).await
    }

    async fn fill(&mut self) {
        let mut chunk = [0u8; 64 * 1024];
        let n = self.stream.read(&mut chunk).await.expect("read");
        assert!(
            n > 0,
            "connection closed early; have {:?}",
            String::from_utf8_lossy(&self.buf)
        );
        self.buf.extend_from_slice(&chunk[..n]);
    }
}

/// Whether the server closes `stream` (end of stream or reset) within `wait`; what it sends before
/// is read and dropped.
pub async fn closed_within(stream: &mut TcpStream, wait: Duration) -> bool {
    let mut chunk = [0u8; 4096];
    let closed = async {
        while let Ok(n) = stream.read(&mut chunk).await
            && n > 0
        {}
    };
    tokio::time::timeout(wait, closed).await.is_ok()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

pub async fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    Conn::open(addr)
        .await
        .request("POST", path, body.as_bytes())
        .await
}

pub async fn post_json(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = post(addr, path, &body.to_string()).await;
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{status} {text}: {e}"));
    (status, value)
}

/// One GPU of a test node.
#[derive(Clone, Debug)]
pub struct G {
    pub memory: u64,
    pub allocated: u64,
    pub model: &'static str,
    pub numa: u32,
    pub switch: Option<u32>,
    pub nvlink: Vec<(u32, u32)>,
    pub pods: Vec<String>,
    pub whole: bool,
}

pub fn g(memory: u64, allocated: u64) -> G {
    G {
        memory,
        allocated,
        model: "NVIDIA A100-SXM4-80GB",
        numa: 0,
        switch: None,
        nvlink: Vec::new(),
        pods: if allocated > 0 {
            vec!["other/pod".into()]
        } else {
            Vec::new()
        },
        whole: false,
    }
}

pub fn uuid(node: &str, i: usize) -> String {
    format!("GPU-{node}-{i}")
}

/// A Node as kube-scheduler sends it (labels, the agent's annotations, allocatable, status noise), as
/// the API server stored it.
pub fn node_json(name: &str, gpus: &[G]) -> Value {
    let topology = json!({"version": 1, "memUnitMiB": 1, "gpus": gpus.iter().enumerate().map(|(i, g)| json!({
        "index": i, "uuid": uuid(name, i), "model": g.model, "memoryMiB": g.memory, "numaNode": g.numa,
        "pcieSwitch": g.switch, "nvlinkPeers": g.nvlink.iter().map(|(p, l)| json!({"index": p, "links": l})).collect::<Vec<_>>(),
        "health": "Healthy"})).collect::<Vec<_>>()});
    let usage = json!({"version": 1, "gpus": gpus.iter().enumerate().map(|(i, g)| json!({
        "index": i, "allocatedMiB": if g.whole { g.memory } else { g.allocated },
        "mode": if g.whole { "whole" } else if g.allocated == 0 { "free" } else { "shared" },
        "pods": g.pods})).collect::<Vec<_>>()});
    stored_node(&json!({
        "metadata": {"name": name, "uid": format!("uid-{name}"), "resourceVersion": "1",
            "labels": {"kubernetes.io/hostname": name, "gpumem.io/mem-unit-mib": "1"},
            "annotations": {"gpumem.io/gpu-topology": topology.to_string(), "gpumem.io/gpu-usage": usage.to_string()}},
        "spec": {"podCIDR": "10.244.0.0/24"},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"},
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}]}
    }))
}

/// A pending pod asking for `gpu_mem` MiB (or `whole` GPUs), as the API server stored it (`5000`
/// is `5k`).
pub fn pod_json(name: &str, gpu_mem: u64, whole: u64, annotations: Value, labels: Value) -> Value {
    let mut limits = serde_json::Map::new();
    if gpu_mem > 0 {
        limits.insert("nvidia.com/gpu-mem".into(), json!(gpu_mem.to_string()));
    }
    if whole > 0 {
        limits.insert("nvidia.com/gpu".into(), json!(whole.to_string()));
    }
    stored_pod(&json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "team-a", "uid": format!("uid-{name}"),
            "annotations": annotations, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": limits,
            "requests": {"cpu": "1", "memory": "1Gi"}}}], "schedulerName": "default-scheduler", "priority": 0},
        "status": {"phase": "Pending"}
    }))
}

/// `ExtenderArgs` in the Nodes form.
pub fn args_nodes(pod: &Value, nodes: &[Value]) -> Value {
    json!({"Pod": pod, "Nodes": {"metadata": {}, "items": nodes}, "NodeNames": null})
}

/// What the fake API server saw.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: String,
    pub body: Value,
    /// What the authorizer decided on.
    pub access: Access,
}

type Body = BoxBody<Bytes, std::convert::Infallible>;

/// A fake Kubernetes API server: nodes and pods to get, list and watch (a watch stays open and quiet),
/// POST of bindings, PodDisruptionBudget lists; it records every request. Like a
/// real one it authorizes each request against the scorer's shipped RBAC role (403 otherwise) and
/// stores objects as the API server would ([`k8s`]).
pub struct FakeApi {
    pods: Mutex<BTreeMap<String, Value>>,
    nodes: Mutex<BTreeMap<String, Value>>,
    pub pdbs: Mutex<Vec<Value>>,
    pub seen: Mutex<Vec<Seen>>,
    /// Delay before answering a binding POST (to make binds overlap).
    pub binding_delay: Mutex<Duration>,
    /// Delay before answering a GET of one pod.
    pub pod_get_delay: Mutex<Duration>,
    /// Pods whose binding POST fails with 409.
    pub refuse_binding: Mutex<Vec<String>>,
    /// Delay before answering a write of a Lease (a bind holding its node's turn for a while).
    pub lease_write_delay: Mutex<Duration>,
    /// Leases by `namespace/name`, and the last resourceVersion given out.
    leases: Mutex<(BTreeMap<String, Value>, u64)>,
    /// The first this many GETs of a Lease are each answered with the Lease as it was when it arrived,
    /// once all of them have arrived (5 s at most): their bookings overlap however slowly they come.
    pub lease_gets_together: Mutex<usize>,
    lease_gets_arrived: tokio::sync::watch::Sender<usize>,
    /// While true, lists wait (an API server slow to answer a starting scorer).
    pub hold_lists: tokio::sync::watch::Sender<bool>,
    authorizer: Authorizer,
}

impl Default for FakeApi {
    fn default() -> FakeApi {
        FakeApi {
            pods: Mutex::default(),
            nodes: Mutex::default(),
            pdbs: Mutex::default(),
            seen: Mutex::default(),
            binding_delay: Mutex::default(),
            pod_get_delay: Mutex::default(),
            refuse_binding: Mutex::default(),
            lease_write_delay: Mutex::default(),
            leases: Mutex::default(),
            lease_gets_together: Mutex::default(),
            lease_gets_arrived: tokio::sync::watch::Sender::new(0),
            hold_lists: tokio::sync::watch::Sender::new(false),
            authorizer: Authorizer::new("scorer"),
        }
    }
}

impl FakeApi {
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    /// Stores a pod as the API server would (`"5000"` becomes `"5k"`).
    pub fn add_pod(&self, pod: &Value) {
        let key = format!(
            "{}/{}",
            pod["metadata"]["namespace"].as_str().expect("namespace"),
            pod["metadata"]["name"].as_str().expect("name")
        );
        self.pods.lock().expect("lock").insert(key, stored_pod(pod));
    }

    /// Pod `namespace/name` as stored.
    pub fn pod(&self, key: &str) -> Option<Value> {
        self.pods.lock().expect("lock").get(key).cloned()
    }

    /// Lease `namespace/name` as stored.
    pub fn lease(&self, key: &str) -> Option<Value> {
        self.leases.lock().expect("lock").0.get(key).cloned()
    }

    /// Stores `lease` (with a resourceVersion) as if some replica had written it.
    pub fn add_lease(&self, lease: &Value) {
        let key = format!(
            "{}/{}",
            lease["metadata"]["namespace"].as_str().expect("namespace"),
            lease["metadata"]["name"].as_str().expect("name")
        );
        let mut leases = self.leases.lock().expect("lock");
        leases.1 += 1;
        let mut lease = lease.clone();
        lease["metadata"]["resourceVersion"] = json!(leases.1.to_string());
        leases.0.insert(key, lease);
    }

    pub fn add_node(&self, node: &Value) {
        let name = node["metadata"]["name"].as_str().expect("name").to_string();
        self.nodes.lock().expect("lock").insert(name, stored_node(node));
    }

    /// Panics if the scorer made a request its shipped role does not allow.
    pub fn assert_all_granted(&self) {
        self.authorizer.assert_all_granted();
    }

    /// Panics unless the scorer used every grant of its shipped role, and nothing else.
    pub fn assert_role_is_exactly_what_was_used(&self) {
        self.authorizer.assert_role_is_exactly_what_was_used();
    }

    async fn answer(&self, req: Request<Incoming>) -> Response<Body> {
        let method = req.method().to_string();
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or("").to_string();
        let bytes = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        self.seen.lock().expect("lock").push(Seen {
            method: method.clone(),
            path: path.clone(),
            query: query.clone(),
            body: body.clone(),
            access: request_info(&method, &path, &query).access,
        });
        let reply = |status: u16, v: Value| {
            let mut r = Response::new(Full::new(Bytes::from(v.to_string())).boxed());
            *r.status_mut() = StatusCode::from_u16(status).expect("status");
            r.headers_mut()
                .insert("content-type", "application/json".parse().expect("header"));
            r
        };
        let request = match self.authorizer.authorize(&method, &path, &query) {
            Ok(request) => request,
            Err(refusal) => return reply(403, refusal),
        };
        if request.access.verb == "watch" {
            // Open and quiet: the reflectors wait on it; the test ends first.
            let quiet =
                tokio_stream::pending::<Result<hyper::body::Frame<Bytes>, std::convert::Infallible>>();
            return Response::new(StreamBody::new(quiet).boxed());
        }
        let not_found = || {
            reply(
                404,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "NotFound", "code": 404, "message": format!("{path} not found")}),
            )
        };
        if method == "GET" && matches!(request.access.verb.as_str(), "list") {
            let _ = self.hold_lists.subscribe().wait_for(|held| !*held).await;
        }
        let list = |kind: &str, items: Vec<Value>| json!({"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items});
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (method.as_str(), parts.as_slice()) {
            ("GET", ["api", "v1", "nodes"]) => {
                let nodes = self.nodes.lock().expect("lock").values().cloned().collect();
                reply(200, list("NodeList", nodes))
            }
            ("GET", ["api", "v1", "pods"]) => {
                let mut items = Vec::new();
                for pod in self.pods.lock().expect("lock").values() {
                    match pod_matches_fields(pod, &query) {
                        Ok(true) => items.push(pod.clone()),
                        Ok(false) => {}
                        Err(message) => {
                            return reply(
                                400,
                                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                "reason": "BadRequest", "code": 400, "message": message}),
                            );
                        }
                    }
                }
                reply(200, list("PodList", items))
            }
            ("GET", ["api", "v1", "nodes", name]) => match self.nodes.lock().expect("lock").get(*name) {
                Some(n) => reply(200, n.clone()),
                None => not_found(),
            },
            ("GET", ["api", "v1", "namespaces", ns, "pods", name]) => {
                let delay = *self.pod_get_delay.lock().expect("lock");
                tokio::time::sleep(delay).await;
                match self.pods.lock().expect("lock").get(&format!("{ns}/{name}")) {
                    Some(p) => reply(200, p.clone()),
                    None => not_found(),
                }
            }
            // As the real one (BindingREST): the pod must exist, not be bound or being deleted; the
            // Binding's annotations are merged onto the pod in the update that sets its node.
            ("POST", ["api", "v1", "namespaces", ns, "pods", name, "binding"]) => {
                let delay = *self.binding_delay.lock().expect("lock");
                tokio::time::sleep(delay).await;
                let conflict = |message: String| {
                    reply(
                        409,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "Conflict", "code": 409, "message": message}),
                    )
                };
                if self
                    .refuse_binding
                    .lock()
                    .expect("lock")
                    .iter()
                    .any(|p| p == name)
                {
                    // As the real one refuses a Binding whose pod is another incarnation.
                    return conflict(format!(
                        "Operation cannot be fulfilled on pods/binding {name:?}: Precondition failed: UID in precondition: uid-{name}, UID in object meta: uid-other"
                    ));
                }
                let mut pods = self.pods.lock().expect("lock");
                let Some(pod) = pods.get_mut(&format!("{ns}/{name}")) else {
                    return not_found();
                };
                let bound = pod
                    .pointer("/spec/nodeName")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                if !bound.is_empty() {
                    return conflict(format!("pod {name} is already assigned to node {bound:?}"));
                }
                if let Some(ann) = body.pointer("/metadata/annotations").and_then(Value::as_object) {
                    for (k, v) in ann {
                        pod["metadata"]["annotations"][k] = v.clone();
                    }
                }
                pod["spec"]["nodeName"] = body["target"]["name"].clone();
                reply(
                    201,
                    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
                )
            }
            (
                "GET",
                [
                    "apis",
                    "coordination.k8s.io",
                    "v1",
                    "namespaces",
                    ns,
                    "leases",
                    name,
                ],
            ) => {
                let stored = self
                    .leases
                    .lock()
                    .expect("lock")
                    .0
                    .get(&format!("{ns}/{name}"))
                    .cloned();
                let together = *self.lease_gets_together.lock().expect("lock");
                let mut arrived = self.lease_gets_arrived.subscribe();
                let mut mine = 0;
                self.lease_gets_arrived.send_modify(|n| {
                    *n += 1;
                    mine = *n;
                });
                if mine <= together {
                    let all = arrived.wait_for(|n| *n >= together);
                    let _ = tokio::time::timeout(Duration::from_secs(5), all).await;
                }
                match stored {
                    Some(l) => reply(200, l),
                    None => not_found(),
                }
            }
            // As the real one: a create of an existing name is AlreadyExists (409), an update must carry
            // the stored resourceVersion (else Conflict, 409); each write gives out a new one.
            ("POST", ["apis", "coordination.k8s.io", "v1", "namespaces", ns, "leases"]) => {
                let delay = *self.lease_write_delay.lock().expect("lock");
                tokio::time::sleep(delay).await;
                let name = body["metadata"]["name"].as_str().unwrap_or("").to_string();
                let mut leases = self.leases.lock().expect("lock");
                let key = format!("{ns}/{name}");
                if name.is_empty() || leases.0.contains_key(&key) {
                    return reply(
                        409,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "AlreadyExists",
                        "code": 409, "message": format!("leases.coordination.k8s.io {name:?} already exists")}),
                    );
                }
                leases.1 += 1;
                let mut lease = body.clone();
                lease["metadata"]["namespace"] = json!(ns);
                lease["metadata"]["resourceVersion"] = json!(leases.1.to_string());
                leases.0.insert(key, lease.clone());
                reply(201, lease)
            }
            (
                "PUT",
                [
                    "apis",
                    "coordination.k8s.io",
                    "v1",
                    "namespaces",
                    ns,
                    "leases",
                    name,
                ],
            ) => {
                let delay = *self.lease_write_delay.lock().expect("lock");
                tokio::time::sleep(delay).await;
                let mut leases = self.leases.lock().expect("lock");
                let key = format!("{ns}/{name}");
                let Some(stored) = leases.0.get(&key) else {
                    return not_found();
                };
                if stored["metadata"]["resourceVersion"] != body["metadata"]["resourceVersion"] {
                    return reply(
                        409,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict",
                        "code": 409, "message": format!("Operation cannot be fulfilled on leases.coordination.k8s.io {name:?}: the object has been modified; please apply your changes to the latest version and try again")}),
                    );
                }
                leases.1 += 1;
                let mut lease = body.clone();
                lease["metadata"]["resourceVersion"] = json!(leases.1.to_string());
                leases.0.insert(key, lease.clone());
                reply(200, lease)
            }
            ("GET", ["apis", "policy", "v1", "namespaces", ns, "poddisruptionbudgets"]) => {
                let items: Vec<Value> = self
                    .pdbs
                    .lock()
                    .expect("lock")
                    .iter()
                    .filter(|p| p["metadata"]["namespace"] == *ns)
                    .cloned()
                    .collect();
                reply(
                    200,
                    json!({"kind": "PodDisruptionBudgetList", "apiVersion": "policy/v1",
                    "metadata": {"resourceVersion": "1"}, "items": items}),
                )
            }
            _ => not_found(),
        }
    }
}

/// Starts the fake API on 127.0.0.1:0 and returns a kube client for it.
pub async fn fake_api(api: Arc<FakeApi>) -> kube::Client {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let api = api.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let api = api.clone();
                    async move { Ok::<_, std::convert::Infallible>(api.answer(req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    let url = format!("http://{addr}").parse().expect("url");
    kube::Client::try_from(kube::Config::new(url)).expect("client")
}
