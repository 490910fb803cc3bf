//! A fake Kubernetes API server on 127.0.0.1 for the agent's tests: records what the agent writes
//! (server-side apply of its Node and of its ResourceSlice, events), serves the pods it lists, the
//! Node and the ResourceClaims the test sets (get, list), and ResourceSlices with a real watch. Real HTTP, real
//! JSON, the paths and verbs kube-rs uses; only what the agent calls is implemented. Like a real one it
//! authorizes each request against the agent's shipped RBAC roles (403 otherwise), answers an unknown
//! object with the real 404 Status, and stores objects as it would ([`k8s`]): a resourceVersion from
//! one counter for every change, a UID and a generation for what it creates, quantities in stored form.
//!
//! ResourceSlices are served as `resource.k8s.io/v1`: server-side apply (`PATCH` with
//! `application/apply-patch+yaml`; one that creates the slice is authorized as `create` too, as the
//! real patch handler does; an apply that changes nothing changes no resourceVersion), `GET`,
//! `DELETE`, and lists and watches filtered by field selector. A watch is a streaming response of
//! newline-delimited JSON events, from the list's resourceVersion on (every change is kept, so a
//! watch never misses one), until its `timeoutSeconds`.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// Shared with the scorer's fake (tests/scorer_support.rs).
#[path = "k8s.rs"]
pub mod k8s;

use self::k8s::{
    Access, Authorizer, RequestInfo, claim_matches_fields, pod_matches_fields, query_param, request_info,
    slice_matches_fields, stored_pod, stored_slice,
};

/// The API group and version of ResourceSlices and ResourceClaims served.
pub const RESOURCE_API: &str = "resource.k8s.io/v1";
/// A ResourceSlice may have at most this many devices (`ResourceSliceMaxDevices`).
const MAX_DEVICES: usize = 128;
/// A device may have at most this many attributes and capacities together.
const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;

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

/// An open watch of ResourceSlices.
struct Watch {
    id: u64,
    /// Its query, for the field selector.
    query: String,
    events: mpsc::UnboundedSender<Bytes>,
}

struct State {
    requests: Vec<Recorded>,
    pods: Vec<Value>,
    /// Answer this many of the next writes with 503, as an API server that is away.
    failures: usize,
    authorizer: Authorizer,
    /// The newest resourceVersion: every change of a stored object takes the next one.
    revision: u64,
    nodes: BTreeMap<String, Value>,
    /// What each field manager's last apply to a Node set: (node, manager) to `labels/key` and
    /// `annotations/key`. As the API server does, an apply removes what the same manager set before and
    /// now omits, unless another manager also set it.
    node_fields: BTreeMap<(String, String), BTreeSet<String>>,
    slices: BTreeMap<String, Value>,
    /// By (namespace, name).
    claims: BTreeMap<(String, String), Value>,
    /// Every change of a ResourceSlice, oldest first: (resourceVersion, the watch event's line).
    slice_events: Vec<(u64, Value)>,
    watches: Vec<Watch>,
    next_watch: u64,
}

impl State {
    fn next_revision(&mut self) -> String {
        self.revision += 1;
        self.revision.to_string()
    }

    /// Records a change of a ResourceSlice and sends it to every watch whose selector it passes.
    fn slice_changed(&mut self, kind: &str, object: &Value) {
        let event = json!({"type": kind, "object": object});
        let line = Bytes::from(format!("{event}\n"));
        self.slice_events.push((self.revision, event));
        self.watches.retain(|w| {
            !slice_matches_fields(object, &w.query).unwrap_or(false) || w.events.send(line.clone()).is_ok()
        });
    }
}

pub struct FakeApiServer {
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
    kubeconfig: PathBuf,
}

impl FakeApiServer {
    /// Serves on an ephemeral loopback port and writes a kubeconfig for it into `dir`; authorizes
    /// against ClusterRole gpumem-agent (the device-plugin path's).
    pub async fn start(dir: &Path) -> FakeApiServer {
        FakeApiServer::start_with(dir, Authorizer::new("agent")).await
    }

    /// [`FakeApiServer::start`] for an agent on the DRA path: its ServiceAccount has both
    /// ClusterRoles, gpumem-agent and gpumem-agent-dra.
    pub async fn start_dra(dir: &Path) -> FakeApiServer {
        FakeApiServer::start_with(dir, Authorizer::bound("agent", &["agent", "agent-dra"])).await
    }

    /// [`FakeApiServer::start`], authorizing with `authorizer`.
    pub async fn start_with(dir: &Path, authorizer: Authorizer) -> FakeApiServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(Mutex::new(State {
            requests: Vec::new(),
            pods: Vec::new(),
            failures: 0,
            authorizer,
            revision: 1,
            nodes: BTreeMap::new(),
            node_fields: BTreeMap::new(),
            slices: BTreeMap::new(),
            claims: BTreeMap::new(),
            slice_events: Vec::new(),
            watches: Vec::new(),
            next_watch: 0,
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

    /// Stores Node `name` with these labels (replacing one stored before); its UID, which the API
    /// server gives it.
    pub fn set_node(&self, name: &str, labels: &[(&str, &str)]) -> String {
        let mut state = self.lock();
        let uid = format!("uid-node-{name}-{}", state.revision + 1);
        let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
        let node = json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": name, "uid": uid, "resourceVersion": state.next_revision(),
                "creationTimestamp": "2026-01-01T00:00:00Z", "labels": labels,
            },
            "spec": {},
            "status": {"nodeInfo": {"kubeletVersion": "v1.34.0"}},
        });
        state.nodes.insert(name.to_string(), node);
        uid
    }

    /// Sets the kubelet version Node `name` reports (`status.nodeInfo.kubeletVersion`).
    pub fn set_kubelet_version(&self, name: &str, version: &str) {
        if let Some(node) = self.lock().nodes.get_mut(name) {
            node["status"]["nodeInfo"]["kubeletVersion"] = json!(version);
        }
    }

    /// Node `name` as stored (with what server-side apply merged into it).
    pub fn node(&self, name: &str) -> Option<Value> {
        self.lock().nodes.get(name).cloned()
    }

    /// Stores a ResourceClaim (`resource.k8s.io/v1`, as a test writes it: metadata with namespace,
    /// name and uid, spec, status), replacing one of the same namespace and name.
    pub fn set_claim(&self, claim: Value) {
        let mut state = self.lock();
        let key = |field: &str| {
            claim["metadata"][field]
                .as_str()
                .unwrap_or_else(|| panic!("a ResourceClaim needs metadata.{field}: {claim}"))
                .to_string()
        };
        let key = (key("namespace"), key("name"));
        let mut claim = claim.clone();
        claim["metadata"]["resourceVersion"] = json!(state.next_revision());
        state.claims.insert(key, claim);
    }

    /// Removes a ResourceClaim; whether there was one.
    pub fn remove_claim(&self, namespace: &str, name: &str) -> bool {
        self.lock()
            .claims
            .remove(&(namespace.to_string(), name.to_string()))
            .is_some()
    }

    /// ResourceSlice `name` as stored.
    pub fn slice(&self, name: &str) -> Option<Value> {
        self.lock().slices.get(name).cloned()
    }

    /// Stores a ResourceSlice as another client's create would (watches see it added).
    pub fn put_slice(&self, slice: Value) {
        let mut state = self.lock();
        let name = slice["metadata"]["name"]
            .as_str()
            .expect("a ResourceSlice needs metadata.name")
            .to_string();
        let mut slice = stored_slice(&slice);
        slice["metadata"]["uid"] = json!(format!("uid-slice-{}", state.revision + 1));
        slice["metadata"]["generation"] = json!(1);
        slice["metadata"]["resourceVersion"] = json!(state.next_revision());
        let kind = if state.slices.contains_key(&name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        state.slices.insert(name, slice.clone());
        state.slice_changed(kind, &slice);
    }

    /// Deletes ResourceSlice `name` as another client would (the kubelet does at its start): watches
    /// see it deleted. What was deleted.
    pub fn delete_slice(&self, name: &str) -> Option<Value> {
        let mut state = self.lock();
        let mut slice = state.slices.remove(name)?;
        slice["metadata"]["resourceVersion"] = json!(state.next_revision());
        state.slice_changed("DELETED", &slice);
        Some(slice)
    }

    /// How many watches of ResourceSlices are open.
    pub fn slice_watches(&self) -> usize {
        let mut state = self.lock();
        state.watches.retain(|w| !w.events.is_closed());
        state.watches.len()
    }

    /// The server-side apply patches of ResourceSlice `name`, oldest first.
    pub fn slice_applies(&self, name: &str) -> Vec<Recorded> {
        let path = format!("/apis/{RESOURCE_API}/resourceslices/{name}");
        self.requests()
            .into_iter()
            .filter(|r| r.method == "PATCH" && r.path == path)
            .collect()
    }

    /// Panics if the agent made a request its shipped role does not allow.
    pub fn assert_all_granted(&self) {
        self.lock().authorizer.assert_all_granted();
    }

    /// Panics unless the agent used every grant of its shipped role, and nothing else.
    pub fn assert_role_is_exactly_what_was_used(&self) {
        self.lock().authorizer.assert_role_is_exactly_what_was_used();
    }

    /// The grants of the shipped roles no request used so far (`resource.k8s.io/resourceslices:get`).
    pub fn unused_grants(&self) -> Vec<String> {
        self.lock().authorizer.unused()
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

    /// The agent's server-side apply patches of Node `name` (labels and the GPU picture), oldest first.
    pub fn node_applies(&self, name: &str) -> Vec<Recorded> {
        self.node_applies_by(name, "gpumem-agent")
    }

    /// The server-side apply patches of Node `name` by field manager `manager`, oldest first.
    pub fn node_applies_by(&self, name: &str, manager: &str) -> Vec<Recorded> {
        let path = format!("/api/v1/nodes/{name}");
        let field_manager = format!("fieldManager={manager}");
        self.requests()
            .into_iter()
            .filter(|r| r.method == "PATCH" && r.path == path)
            .filter(|r| r.query.split('&').any(|p| p == field_manager))
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
        // Open watches end: their connections finish.
        self.lock().watches.clear();
    }
}

type Body = UnsyncBoxBody<Bytes, Infallible>;
type Answer = Result<Response<Body>, Infallible>;

/// RFC 7386: objects merge key by key, `null` removes, anything else replaces.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(patch) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let map = target.as_object_mut().expect("made an object above");
    for (key, value) in patch {
        if value.is_null() {
            map.remove(key);
        } else {
            merge_patch(map.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

fn respond(status: StatusCode, body: Value) -> Answer {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())).boxed_unsync());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert("content-type", "application/json".parse().expect("valid header"));
    Ok(response)
}

fn status(code: StatusCode, reason: &str, message: &str) -> Answer {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    respond(code, body)
}

/// The API server's 404 for an object that does not exist (`nodes "node-a" not found`).
fn not_found(request: &RequestInfo) -> Answer {
    let Access { group, resource, .. } = &request.access;
    let name = request.name.clone().unwrap_or_default();
    let qualified = if group.is_empty() {
        resource.clone()
    } else {
        format!("{resource}.{group}")
    };
    let mut details = json!({"name": name, "kind": resource});
    if !group.is_empty() {
        details["group"] = json!(group);
    }
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("{qualified} {name:?} not found"), "reason": "NotFound",
        "details": details, "code": 404,
    });
    respond(StatusCode::NOT_FOUND, body)
}

/// The API server's 422 for an object that fails validation.
fn invalid(kind: &str, name: &str, causes: &[String]) -> Answer {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("{kind}.resource.k8s.io {name:?} is invalid: {}", causes.join(", ")),
        "reason": "Invalid", "details": {"name": name, "group": "resource.k8s.io", "kind": kind},
        "code": 422,
    });
    respond(StatusCode::UNPROCESSABLE_ENTITY, body)
}

async fn handle(state: Arc<Mutex<State>>, req: Request<Incoming>) -> Answer {
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
    let info = request_info(&method, &path, &query);
    let recorded = Recorded {
        access: info.access.clone(),
        method: method.clone(),
        path: path.clone(),
        query: query.clone(),
        content_type,
        body,
    };

    let shared = Arc::clone(&state);
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
    let resource_api = path.starts_with(&format!("/apis/{RESOURCE_API}/"));
    let name = info.name.clone().unwrap_or_default();
    let Access {
        group,
        resource,
        verb,
    } = &info.access;
    match (group.as_str(), resource.as_str(), verb.as_str()) {
        ("", "nodes", "patch") => {
            let revision = state.next_revision();
            match state.nodes.get_mut(&name) {
                // Server-side apply of labels and annotations: merged into the stored Node, less what
                // this manager set before and no longer does (forced: what it sets now is its alone).
                Some(node) => {
                    let manager = query_param(&recorded.query, "fieldManager").unwrap_or_default();
                    let mut fields = BTreeSet::new();
                    for key in ["labels", "annotations"] {
                        let applied = recorded.body["metadata"][key].as_object().cloned();
                        let stored = &mut node["metadata"][key];
                        if !stored.is_object() {
                            *stored = json!({});
                        }
                        if let (Some(applied), Some(stored)) = (applied, stored.as_object_mut()) {
                            fields.extend(applied.keys().map(|k| format!("{key}/{k}")));
                            stored.extend(applied);
                        }
                    }
                    let owner = (name.clone(), manager.to_string());
                    let before = state
                        .node_fields
                        .insert(owner.clone(), fields.clone())
                        .unwrap_or_default();
                    for (other, set) in state.node_fields.iter_mut() {
                        if other.0 == name && *other != owner {
                            set.retain(|f| !fields.contains(f));
                        }
                    }
                    let dropped: Vec<&String> = before
                        .iter()
                        .filter(|f| !fields.contains(*f))
                        .filter(|f| {
                            !state
                                .node_fields
                                .iter()
                                .any(|(o, set)| o.0 == name && set.contains(*f))
                        })
                        .collect();
                    let node = state.nodes.get_mut(&name).expect("matched above");
                    for field in dropped {
                        if let Some((key, k)) = field.split_once('/')
                            && let Some(map) = node["metadata"][key].as_object_mut()
                        {
                            map.remove(k);
                        }
                    }
                    node["metadata"]["resourceVersion"] = json!(revision);
                    respond(StatusCode::OK, node.clone())
                }
                None => {
                    let mut node = recorded.body.clone();
                    node["metadata"]["resourceVersion"] = json!(revision);
                    node["metadata"]["uid"] = json!("node-uid");
                    respond(StatusCode::OK, node)
                }
            }
        }
        // A JSON merge patch of the status (RFC 7386): the agent's node-level memory resource.
        ("", "nodes/status", "patch") if recorded.content_type == "application/merge-patch+json" => {
            let revision = state.next_revision();
            let Some(node) = state.nodes.get_mut(&name) else {
                return not_found(&info);
            };
            merge_patch(&mut node["status"], &recorded.body["status"]);
            node["metadata"]["resourceVersion"] = json!(revision);
            respond(StatusCode::OK, node.clone())
        }
        // A strategic merge of status conditions, as the real server merges them: by `type`.
        ("", "nodes/status", "patch") => {
            if recorded.content_type != "application/strategic-merge-patch+json" {
                return status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    &recorded.content_type,
                );
            }
            let revision = state.next_revision();
            let Some(node) = state.nodes.get_mut(&name) else {
                return not_found(&info);
            };
            let patched = recorded.body["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let conditions = &mut node["status"]["conditions"];
            if !conditions.is_array() {
                *conditions = json!([]);
            }
            let list = conditions.as_array_mut().expect("made an array above");
            for condition in patched {
                match list.iter_mut().find(|c| c["type"] == condition["type"]) {
                    Some(stored) => {
                        if let (Some(stored), Some(new)) = (stored.as_object_mut(), condition.as_object()) {
                            stored.extend(new.clone());
                        }
                    }
                    None => list.push(condition),
                }
            }
            node["metadata"]["resourceVersion"] = json!(revision);
            respond(StatusCode::OK, node.clone())
        }
        ("", "nodes", "get") => match state.nodes.get(&name) {
            Some(node) => respond(StatusCode::OK, node.clone()),
            None => not_found(&info),
        },
        ("", "pods", "list") if path == "/api/v1/pods" => {
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
        ("events.k8s.io", "events", "create") => {
            let mut event = recorded.body.clone();
            if event["metadata"]["name"].is_null() {
                event["metadata"]["name"] = json!(format!("event-{}", state.requests.len()));
            }
            respond(StatusCode::CREATED, event)
        }
        ("events.k8s.io", "events", "patch") => respond(StatusCode::OK, recorded.body.clone()),
        ("resource.k8s.io", "resourceslices", "patch") if resource_api => {
            apply_slice(&mut state, &info, &recorded)
        }
        ("resource.k8s.io", "resourceslices", "get") if resource_api => match state.slices.get(&name) {
            Some(slice) => respond(StatusCode::OK, slice.clone()),
            None => not_found(&info),
        },
        ("resource.k8s.io", "resourceslices", "delete") if resource_api => {
            let revision = state.next_revision();
            match state.slices.remove(&name) {
                Some(mut slice) => {
                    slice["metadata"]["resourceVersion"] = json!(revision);
                    state.slice_changed("DELETED", &slice);
                    respond(StatusCode::OK, slice)
                }
                None => not_found(&info),
            }
        }
        ("resource.k8s.io", "resourceslices", "list") if resource_api => {
            let mut items = Vec::new();
            for slice in state.slices.values() {
                match slice_matches_fields(slice, &query) {
                    Ok(true) => {
                        // List items carry no kind or apiVersion; the list does.
                        let mut item = slice.clone();
                        if let Some(item) = item.as_object_mut() {
                            item.remove("apiVersion");
                            item.remove("kind");
                        }
                        items.push(item);
                    }
                    Ok(false) => {}
                    Err(message) => return status(StatusCode::BAD_REQUEST, "BadRequest", &message),
                }
            }
            respond(
                StatusCode::OK,
                json!({
                    "apiVersion": RESOURCE_API, "kind": "ResourceSliceList",
                    "metadata": {"resourceVersion": state.revision.to_string()}, "items": items,
                }),
            )
        }
        ("resource.k8s.io", "resourceslices", "watch") if resource_api => {
            watch_slices(&mut state, shared, &query)
        }
        ("resource.k8s.io", "resourceclaims", "list") if resource_api => {
            let mut items = Vec::new();
            for ((namespace, _), claim) in &state.claims {
                if info.namespace.as_ref().is_some_and(|ns| ns != namespace) {
                    continue;
                }
                match claim_matches_fields(claim, &query) {
                    Ok(true) => {
                        let mut item = claim.clone();
                        if let Some(item) = item.as_object_mut() {
                            item.remove("apiVersion");
                            item.remove("kind");
                        }
                        items.push(item);
                    }
                    Ok(false) => {}
                    Err(message) => return status(StatusCode::BAD_REQUEST, "BadRequest", &message),
                }
            }
            respond(
                StatusCode::OK,
                json!({
                    "apiVersion": RESOURCE_API, "kind": "ResourceClaimList",
                    "metadata": {"resourceVersion": state.revision.to_string()}, "items": items,
                }),
            )
        }
        ("resource.k8s.io", "resourceclaims", "get") if resource_api => {
            let key = (info.namespace.clone().unwrap_or_default(), name);
            match state.claims.get(&key) {
                Some(claim) => respond(StatusCode::OK, claim.clone()),
                None => not_found(&info),
            }
        }
        _ => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{method} {path} is not served by this fake"),
        ),
    }
}

/// Server-side apply of a ResourceSlice, as the API server stores it.
fn apply_slice(state: &mut State, info: &RequestInfo, recorded: &Recorded) -> Answer {
    let name = info.name.clone().unwrap_or_default();
    if recorded.content_type != "application/apply-patch+yaml" {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            &format!(
                "this fake serves ResourceSlices by server-side apply only, not {:?}",
                recorded.content_type
            ),
        );
    }
    if query_param(&recorded.query, "fieldManager").is_none_or(|m| m.is_empty()) {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
        );
    }
    let body = &recorded.body;
    if body["apiVersion"] != RESOURCE_API || body["kind"] != "ResourceSlice" {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &format!(
                "apply of {}/{} to a ResourceSlice of {RESOURCE_API}",
                body["apiVersion"], body["kind"]
            ),
        );
    }
    if body["metadata"]["name"] != name.as_str() {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &format!(
                "the name of the object ({}) does not match the name on the URL ({name})",
                body["metadata"]["name"]
            ),
        );
    }
    let causes = slice_problems(body);
    if !causes.is_empty() {
        return invalid("ResourceSlice", &name, &causes);
    }
    let old = state.slices.get(&name).cloned();
    if old.is_none() {
        // An apply that creates its object is authorized as a create as well.
        let create = RequestInfo {
            access: Access::new("resource.k8s.io", "resourceslices", "create"),
            ..info.clone()
        };
        if let Err(refusal) = state.authorizer.authorize_request(create) {
            return respond(StatusCode::FORBIDDEN, refusal);
        }
    }
    let mut slice = stored_slice(body);
    let meta = |s: &Value, key: &str| s["metadata"][key].clone();
    let (uid, created, generation) = match &old {
        Some(old) => {
            let changed = old["spec"] != slice["spec"];
            let generation = old["metadata"]["generation"].as_i64().unwrap_or(1) + i64::from(changed);
            (
                meta(old, "uid"),
                meta(old, "creationTimestamp"),
                json!(generation),
            )
        }
        None => (
            json!(format!("uid-slice-{}", state.revision + 1)),
            json!("2026-01-01T00:00:00Z"),
            json!(1),
        ),
    };
    slice["metadata"]["uid"] = uid;
    slice["metadata"]["creationTimestamp"] = created;
    slice["metadata"]["generation"] = generation;
    if let Some(old) = &old {
        let mut same = old.clone();
        same["metadata"]["resourceVersion"] = Value::Null;
        slice["metadata"]["resourceVersion"] = Value::Null;
        if same == slice {
            // Nothing changed: nothing written, no new resourceVersion, no event.
            return respond(StatusCode::OK, old.clone());
        }
    }
    slice["metadata"]["resourceVersion"] = json!(state.next_revision());
    state.slices.insert(name, slice.clone());
    let (code, kind) = match old {
        Some(_) => (StatusCode::OK, "MODIFIED"),
        None => (StatusCode::CREATED, "ADDED"),
    };
    state.slice_changed(kind, &slice);
    respond(code, slice)
}

/// What the API server's validation of a ResourceSlice (resource.k8s.io/v1) would refuse, of what a
/// driver could get wrong.
fn slice_problems(slice: &Value) -> Vec<String> {
    let mut causes = Vec::new();
    let spec = &slice["spec"];
    for (field, pointer) in [("spec.driver", "/driver"), ("spec.pool.name", "/pool/name")] {
        if spec
            .pointer(pointer)
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            causes.push(format!("{field}: Required value"));
        }
    }
    if spec["pool"]["resourceSliceCount"].as_i64().is_none_or(|n| n < 1) {
        causes.push("spec.pool.resourceSliceCount: Invalid value: must be greater than zero".into());
    }
    if spec["pool"]["generation"].as_i64().is_some_and(|n| n < 0) {
        causes.push("spec.pool.generation: Invalid value: must be greater than or equal to 0".into());
    }
    let node_selection = ["nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection"]
        .iter()
        .filter(|f| !spec[**f].is_null() && spec[**f] != json!(false))
        .count();
    if node_selection != 1 {
        causes.push(
            "spec: Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, \
             `perDeviceNodeSelection` is required"
                .into(),
        );
    }
    let devices = spec["devices"].as_array().cloned().unwrap_or_default();
    if devices.len() > MAX_DEVICES {
        causes.push(format!(
            "spec.devices: Too many: {}: must have at most {MAX_DEVICES} items",
            devices.len()
        ));
    }
    let mut names = std::collections::BTreeSet::new();
    for (i, device) in devices.iter().enumerate() {
        let name = device["name"].as_str().unwrap_or("");
        if gpumem::names::check_label(name).is_err() {
            causes.push(format!("spec.devices[{i}].name: Invalid value: {name:?}"));
        }
        if !names.insert(name.to_string()) {
            causes.push(format!("spec.devices[{i}].name: Duplicate value: {name:?}"));
        }
        let count = |key: &str| device[key].as_object().map_or(0, serde_json::Map::len);
        if count("attributes") + count("capacity") > MAX_ATTRIBUTES_AND_CAPACITIES {
            causes.push(format!(
                "spec.devices[{i}]: Too many: attributes and capacities: must have at most \
                 {MAX_ATTRIBUTES_AND_CAPACITIES}"
            ));
        }
    }
    causes
}

/// A watch of ResourceSlices: the changes after the query's resourceVersion (or, from none or "0",
/// every matching slice as added), then each change as it happens, until `timeoutSeconds`.
fn watch_slices(state: &mut State, shared: Arc<Mutex<State>>, query: &str) -> Answer {
    if let Err(message) = slice_matches_fields(&json!({}), query) {
        return status(StatusCode::BAD_REQUEST, "BadRequest", &message);
    }
    let (events, receiver) = mpsc::unbounded_channel::<Bytes>();
    let line = |event: &Value| Bytes::from(format!("{event}\n"));
    match query_param(query, "resourceVersion").as_deref() {
        None | Some("" | "0") => {
            for slice in state.slices.values() {
                if slice_matches_fields(slice, query).unwrap_or(false) {
                    let _ = events.send(line(&json!({"type": "ADDED", "object": slice})));
                }
            }
        }
        Some(text) => {
            let Ok(from) = text.parse::<u64>() else {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    &format!("invalid resource version: {text:?}"),
                );
            };
            for (revision, event) in &state.slice_events {
                if *revision > from && slice_matches_fields(&event["object"], query).unwrap_or(false) {
                    let _ = events.send(line(event));
                }
            }
        }
    }
    let id = state.next_watch;
    state.next_watch += 1;
    state.watches.push(Watch {
        id,
        query: query.to_string(),
        events,
    });
    let timeout = query_param(query, "timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(1800);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(timeout)).await;
        let mut state = shared.lock().unwrap_or_else(|e| e.into_inner());
        state.watches.retain(|w| w.id != id);
    });
    let stream = UnboundedReceiverStream::new(receiver).map(|line| Ok::<_, Infallible>(Frame::data(line)));
    let mut response = Response::new(BodyExt::boxed_unsync(StreamBody::new(stream)));
    response
        .headers_mut()
        .insert("content-type", "application/json".parse().expect("valid header"));
    Ok(response)
}

/// A ResourceClaim (`resource.k8s.io/v1`) allocated by kube-scheduler and reserved for pod
/// `<namespace>/<pod>`: one result per (pool, device, consumed memory), each of driver `gpumem.io`
/// and request `gpu` (None: the device's whole memory, the policy's default).
pub fn allocated_claim(
    namespace: &str,
    name: &str,
    uid: &str,
    pod: &str,
    results: &[(&str, &str, Option<&str>)],
) -> Value {
    let results: Vec<Value> = results
        .iter()
        .map(|(pool, device, memory)| {
            // Every allocation of a device that allows several gets a share ID.
            let mut result = json!({
                "request": "gpu", "driver": "gpumem.io", "pool": pool, "device": device,
                "shareID": share_id(uid, device),
            });
            if let Some(memory) = memory {
                result["consumedCapacity"] = json!({"memory": memory});
            }
            result
        })
        .collect();
    let mut claim = unallocated_claim(namespace, name, uid);
    claim["status"] = json!({
        "allocation": {"devices": {"results": results}},
        "reservedFor": [{"resource": "pods", "name": pod, "uid": format!("uid-{pod}")}],
    });
    claim
}

/// The share ID kube-scheduler would give the allocation of `device` to claim `uid` (a UUID; here
/// derived from both, so a test can name it).
pub fn share_id(uid: &str, device: &str) -> String {
    // FNV-1a, 64 bits.
    let hash = format!("{uid}/{device}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        hash >> 32,
        (hash >> 16) & 0xffff,
        (hash >> 4) & 0xfff,
        hash & 0xfff,
        hash & 0xffff_ffff_ffff
    )
}

/// A ResourceClaim asking for one GPU of class `gpumem.io`, not allocated yet.
pub fn unallocated_claim(namespace: &str, name: &str, uid: &str) -> Value {
    json!({
        "apiVersion": RESOURCE_API, "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpumem.io"}}]}},
    })
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
