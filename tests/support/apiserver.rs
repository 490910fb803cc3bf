//! A fake Kubernetes API server on 127.0.0.1 for the agent's tests: records what the agent writes
//! (server-side apply of its Node, events) and serves the pods it lists. Real HTTP, real JSON, the
//! paths and verbs kube-rs uses; only what the agent calls is implemented. Like a real one it
//! authorizes each request against the agent's shipped RBAC role (403 otherwise) and returns pods as
//! it would have stored them ([`k8s`]).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Shared with the scorer's fake (tests/scorer_support.rs).
#[path = "k8s.rs"]
pub mod k8s;

use self::k8s::{Access, Authorizer, pod_matches_fields, request_info, stored_pod};

/// One request the agent made.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub query: String,
    pub content_type: String,
    pub body: Value,
    /// What the authorizer decided on.
    pub access: Access,
}

struct State {
    requests: Vec<Recorded>,
    pods: Vec<Value>,
    /// Answer this many of the next writes with 503, as an API server that is away.
    failures: usize,
    authorizer: Authorizer,
}

pub struct FakeApiServer {
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
    kubeconfig: PathBuf,
}

impl FakeApiServer {
    /// Serves on an ephemeral loopback port and writes a kubeconfig for it into `dir`.
    pub async fn start(dir: &Path) -> FakeApiServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(Mutex::new(State {
            requests: Vec::new(),
            pods: Vec::new(),
            failures: 0,
            authorizer: Authorizer::new("agent"),
        }));
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let state = Arc::clone(&shared);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| handle(Arc::clone(&state), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        let kubeconfig = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{addr}\n\
             users:\n- name: fake\n  user:\n    token: test\ncontexts:\n- name: fake\n  context:\n    \
             cluster: fake\n    user: fake\n    namespace: default\ncurrent-context: fake\n"
        );
        std::fs::write(&kubeconfig, text).expect("write kubeconfig");
        FakeApiServer {
            state,
            task,
            kubeconfig,
        }
    }

    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pods `GET /api/v1/pods` returns (filtered by the list's field selector), stored as the
    /// API server stores them: `"5000"` comes back as `"5k"`.
    pub fn set_pods(&self, pods: Vec<Value>) {
        self.lock().pods = pods.iter().map(stored_pod).collect();
    }

    /// The pods as stored.
    pub fn pods(&self) -> Vec<Value> {
        self.lock().pods.clone()
    }

    /// Panics if the agent made a request its shipped role does not allow.
    pub fn assert_all_granted(&self) {
        self.lock().authorizer.assert_all_granted();
    }

    /// Panics unless the agent used every grant of its shipped role, and nothing else.
    pub fn assert_role_is_exactly_what_was_used(&self) {
        self.lock().authorizer.assert_role_is_exactly_what_was_used();
    }

    pub fn fail_next_writes(&self, n: usize) {
        self.lock().failures = n;
    }

    /// How many of the refused writes asked for are still to come.
    pub fn failures_left(&self) -> usize {
        self.lock().failures
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.lock().requests.clone()
    }

    /// The server-side apply patches of Node `name`, oldest first.
    pub fn node_applies(&self, name: &str) -> Vec<Recorded> {
        let path = format!("/api/v1/nodes/{name}");
        self.requests()
            .into_iter()
            .filter(|r| r.method == "PATCH" && r.path == path)
            .collect()
    }

    pub fn events(&self) -> Vec<Value> {
        self.requests()
            .into_iter()
            .filter(|r| r.method == "POST" && r.path.ends_with("/events"))
            .map(|r| r.body)
            .collect()
    }

    /// Waits until `probe` returns Some, polling every 20 ms; panics with `what` after `timeout`.
    pub async fn wait_for<T>(&self, what: &str, timeout: Duration, probe: impl Fn(&Self) -> Option<T>) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(found) = probe(self) {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "{what} did not happen within {timeout:?}; requests: {:#?}",
                {
                    self.requests()
                        .iter()
                        .map(|r| format!("{} {}", r.method, r.path))
                        .collect::<Vec<_>>()
                }
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn respond(status: StatusCode, body: Value) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert("content-type", "application/json".parse().expect("valid header"));
    Ok(response)
}

fn status(code: StatusCode, reason: &str, message: &str) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    respond(code, body)
}

async fn handle(
    state: Arc<Mutex<State>>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let recorded = Recorded {
        access: request_info(&method, &path, &query).access,
        method: method.clone(),
        path: path.clone(),
        query: query.clone(),
        content_type,
        body,
    };

    let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
    state.requests.push(recorded.clone());
    let write = method != "GET";
    if write && state.failures > 0 {
        state.failures -= 1;
        return status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the server is currently unavailable",
        );
    }
    if let Err(refusal) = state.authorizer.authorize(&method, &path, &query) {
        return respond(StatusCode::FORBIDDEN, refusal);
    }
    match (method.as_str(), path.as_str()) {
        ("PATCH", p) if p.starts_with("/api/v1/nodes/") => {
            let mut node = recorded.body.clone();
            node["metadata"]["resourceVersion"] = json!(state.requests.len().to_string());
            node["metadata"]["uid"] = json!("node-uid");
            respond(StatusCode::OK, node)
        }
        ("GET", "/api/v1/pods") => {
            let mut items = Vec::new();
            for pod in &state.pods {
                match pod_matches_fields(pod, &query) {
                    Ok(true) => items.push(pod.clone()),
                    Ok(false) => {}
                    Err(message) => return status(StatusCode::BAD_REQUEST, "BadRequest", &message),
                }
            }
            respond(
                StatusCode::OK,
                json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": items}),
            )
        }
        ("POST", p) if p.ends_with("/events") => {
            let mut event = recorded.body.clone();
            if event["metadata"]["name"].is_null() {
                event["metadata"]["name"] = json!(format!("event-{}", state.requests.len()));
            }
            respond(StatusCode::CREATED, event)
        }
        ("PATCH", p) if p.contains("/events/") => respond(StatusCode::OK, recorded.body.clone()),
        _ => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{method} {path} is not served by this fake"),
        ),
    }
}

/// A pod bound to `node` with the scorer's choice annotated and one container asking for `units`
/// of `resource`.
pub fn pod_with_choice(
    name: &str,
    node: &str,
    resource: &str,
    units: u64,
    gpu_uuid: &str,
    at: &str,
) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": "team", "uid": format!("uid-{name}"),
            "annotations": {"gpumem.io/assigned-gpus": gpu_uuid, "gpumem.io/assigned-at": at},
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "image": "x", "resources": {"limits": {resource: units.to_string()}}}],
        },
    })
}

/// Label and annotation maps of an apply patch.
pub fn metadata_maps(applied: &Recorded) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let map = |key: &str| serde_json::from_value(applied.body["metadata"][key].clone()).unwrap_or_default();
    (map("labels"), map("annotations"))
}
