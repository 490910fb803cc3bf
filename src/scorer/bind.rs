//! The `bind` verb: re-checks the node in the kept view and creates the Binding, which carries the
//! chosen GPUs onto the pod, holding a ledger reservation until the agent reports the allocation.

use super::bookings::{self, Booking, WriteError};
use super::extender::{ExtenderBindingArgs, ExtenderBindingResult};
use super::ledger::Reservation;
use super::metrics::{HoldLabel, KindLabel};
use super::state::{NodeSnapshot, PodDemand};
use super::{Scorer, decide, ledger, state};
use crate::node::{ASSIGNED_AT_ANNOTATION, ASSIGNED_GPUS_ANNOTATION};
use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{GetParams, PostParams};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument as _;

/// Why a bind failed. Its text is the extender's `Error` (kube-scheduler puts it in the pod's
/// events); its [`BindError::kind`] labels `gpumem_scorer_bind_failures_total`.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// kube-scheduler's arguments are not what it sends (a missing field, an invalid name).
    #[error("{0}")]
    BadRequest(String),
    #[error("this scorer has no Kubernetes client")]
    NoClient,
    /// The API server refused or failed a request.
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// The pod is not one kube-scheduler would ask this scorer to bind (recreated, bound, being
    /// deleted, another scheduler's).
    #[error("{0}")]
    NotBindable(String),
    /// The pod is bound already (by an earlier bind of it that kube-scheduler stopped waiting for).
    #[error("{0}")]
    AlreadyBound(String),
    /// The pod's GPU request cannot be read.
    #[error("{0}")]
    BadPod(String),
    /// The node cannot host the pod any more (another bind took the room).
    #[error("{0}")]
    DoesNotFit(String),
    /// Other replicas' bookings on the node won every attempt (kube-scheduler tries the pod again).
    #[error("{0}")]
    Contended(String),
    /// The node's agent is restarting: the kubelet would fail the pod.
    #[error("{0}")]
    AgentRestarting(String),
}

impl BindError {
    /// A short label: the error's kind, and for the API server's refusals its HTTP status by name.
    pub fn kind(&self) -> &'static str {
        match self {
            BindError::BadRequest(_) => "bad_request",
            BindError::NoClient => "no_client",
            BindError::NotBindable(_) | BindError::AlreadyBound(_) => "not_bindable",
            BindError::BadPod(_) => "bad_pod",
            BindError::DoesNotFit(_) => "does_not_fit",
            BindError::Contended(_) => "contended",
            BindError::AgentRestarting(_) => "agent_restarting",
            BindError::Api { source, .. } => match source {
                kube::Error::Api(status) => match status.code {
                    403 => "forbidden",
                    404 => "not_found",
                    409 => "conflict",
                    422 => "invalid",
                    429 => "throttled",
                    500.. => "server_error",
                    _ => "api_error",
                },
                _ => "unreachable",
            },
        }
    }

    fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> BindError {
        let what = what.into();
        move |source| BindError::Api { what, source }
    }
}

impl Scorer {
    /// The GPU state of one node: from the cache, else from the API server.
    pub(super) async fn node_state(&self, name: &str) -> Result<NodeSnapshot, BindError> {
        if let Some(s) = self.nodes.as_ref().and_then(|c| c.get(name)) {
            return Ok((*s).clone());
        }
        let client = self.client.clone().ok_or(BindError::NoClient)?;
        let node = Api::<Node>::all(client)
            .get(name)
            .await
            .map_err(BindError::api(format!("reading node {name}")))?;
        Ok(NodeSnapshot::from_node(&node))
    }

    /// `bind`: choose the GPU(s), reserve them in the ledger, record them on the pod, create the Binding.
    pub async fn bind(&self, args: ExtenderBindingArgs) -> ExtenderBindingResult {
        let start = Instant::now();
        let span = tracing::info_span!(
            "bind",
            namespace = %args.pod_namespace,
            pod = %args.pod_name,
            node = %args.node
        );
        let result = self.bind_inner(&args).instrument(span.clone()).await;
        self.metrics.ledger.set(self.ledger.len() as i64);
        self.metrics.holds.set(self.holds.len() as i64);
        self.observe("bind", start);
        match result {
            Ok(()) => ExtenderBindingResult::default(),
            Err(e) => {
                self.error("bind");
                self.metrics
                    .bind_failures
                    .get_or_create(&KindLabel { kind: e.kind() })
                    .inc();
                span.in_scope(|| tracing::warn!(kind = e.kind(), "bind refused: {e}"));
                ExtenderBindingResult { error: e.to_string() }
            }
        }
    }

    /// Binds other replicas made to `node` that its usage annotation does not show yet: pods the pod
    /// cache sees bound there, carrying `gpumem.io/assigned-gpus` from within the ledger's TTL, that
    /// this replica's ledger does not hold. Replicas share no state; this is how one sees the others'
    /// recent binds before the agent reports them.
    pub(super) fn other_replicas_binds(&self, node: &NodeSnapshot) -> Vec<Reservation> {
        let Some(pods) = &self.pods else { return Vec::new() };
        let ttl = self.config.ledger_ttl_seconds;
        let now = k8s_openapi::jiff::Timestamp::now();
        pods.with_node(&node.name, |on_node| {
            on_node
                .iter()
                .filter_map(|pod| {
                    // Cheapest first: most pods on a node were bound long ago.
                    let age = now.duration_since(pod.assigned_at?).as_secs();
                    if age < 0 || age as u64 >= ttl || pod.assigned_gpus.is_empty() {
                        return None;
                    }
                    pod.demand?;
                    if node.shows(&pod.key) || self.ledger.holds(&node.name, &pod.key) {
                        return None;
                    }
                    let gpus: Vec<(usize, String)> = pod
                        .assigned_gpus
                        .iter()
                        .filter_map(|u| node.position_of(u).map(|p| (p, u.to_string())))
                        .collect();
                    Some(Reservation {
                        pod: pod.key.to_string(),
                        gpus,
                        mib: pod.memory_mib(node.unit_mib),
                        at: std::time::Instant::now(),
                    })
                })
                .collect()
        })
    }

    /// Refuses to bind what kube-scheduler would never ask this scorer to bind: another incarnation of
    /// the pod, a pod already bound or being deleted, a pod of a scheduler this scorer does not serve.
    fn check_bindable(
        &self,
        pod: &Pod,
        args: &ExtenderBindingArgs,
        namespace: &str,
    ) -> Result<(), BindError> {
        let name = format!("{namespace}/{}", args.pod_name);
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        if uid != args.pod_uid {
            return Err(BindError::NotBindable(format!(
                "pod {name} has UID {uid}, not {} (recreated?)",
                args.pod_uid
            )));
        }
        if pod.metadata.deletion_timestamp.is_some() {
            return Err(BindError::NotBindable(format!("pod {name} is being deleted")));
        }
        let spec = pod.spec.as_ref();
        if let Some(bound) = spec
            .and_then(|s| s.node_name.as_deref())
            .filter(|n| !n.is_empty())
        {
            return Err(BindError::AlreadyBound(format!(
                "pod {name} is already bound to {bound}"
            )));
        }
        self.check_scheduler(&name, &scheduler_of(pod))
    }

    /// The pod is one of the schedulers this scorer binds for (`schedulerNames`).
    fn check_scheduler(&self, name: &str, scheduler: &str) -> Result<(), BindError> {
        if !self.config.scheduler_names.iter().any(|s| s == scheduler) {
            return Err(BindError::NotBindable(format!(
                "pod {name} belongs to scheduler {scheduler:?}, not one of {:?} (schedulerNames)",
                self.config.scheduler_names
            )));
        }
        Ok(())
    }

    /// Chooses `d`'s GPU(s) on `node_name` as `prioritize` scored them and reserves them in the ledger;
    /// with shared bookings, books them in the node's Lease too, choosing again while another replica's
    /// booking beats this one ([`super::bookings`]).
    async fn reserve(&self, d: &PodDemand, node_name: &str) -> Result<Reservation, BindError> {
        let Some(board) = &self.board else {
            return self.reserve_with(d, node_name, &[]).await;
        };
        let mut turn = board.turn(node_name).await;
        for attempt in 1..=bookings::ATTEMPTS {
            let read = board
                .current(node_name, &mut turn)
                .await
                .map_err(BindError::api(format!(
                    "reading the bookings of node {node_name}"
                )))?;
            // Only live bookings count, in the choice as in what is written back: one whose pod has
            // gone (a pod deleted within the TTL) must not hold room.
            let mut keep = self.live_bookings(node_name, &read.bookings, &d.key);
            let r = match self.reserve_with(d, node_name, &keep).await {
                Ok(r) => r,
                Err(e) => {
                    // Nothing written: the next bind to this node starts from the Lease as read.
                    *turn = Some(read);
                    return Err(e);
                }
            };
            keep.push(Booking {
                pod: r.pod.clone(),
                uid: Some(d.uid.clone()).filter(|u| !u.is_empty()),
                gpus: r.gpus.iter().map(|(_, u)| u.clone()).collect(),
                mib: r.mib,
                at: Timestamp::now(),
            });
            match board.write(node_name, read, &keep).await {
                Ok(written) => {
                    *turn = Some(written);
                    return Ok(r);
                }
                Err(e) => {
                    self.ledger.release(node_name, &r.pod);
                    match e {
                        WriteError::Conflict => {
                            self.metrics.booking_conflicts.inc();
                            tracing::debug!(
                                attempt,
                                "another replica booked on this node first: choosing again"
                            );
                        }
                        WriteError::Api(source) => {
                            return Err(BindError::Api {
                                what: format!("booking on node {node_name}"),
                                source,
                            });
                        }
                    }
                }
            }
        }
        Err(BindError::Contended(format!(
            "node {node_name}: other replicas' binds booked first {} times in a row",
            bookings::ATTEMPTS
        )))
    }

    /// What of `read` (a node's bookings) still holds room, less `pod`'s own ([`bookings::kept`]).
    fn live_bookings(&self, node_name: &str, read: &[Booking], pod: &str) -> Vec<Booking> {
        // Counted by the annotation, or its pod deleted (a short-lived pod must not hold its room
        // for the whole settling time).
        let settled = |b: &Booking| {
            self.node_shows(node_name, &b.pod)
                || b.uid
                    .as_deref()
                    .zip(self.pods.as_ref())
                    .is_some_and(|(uid, pods)| pods.departed(uid))
        };
        // Without a pod cache, or while its watch is failing (it may lack the pod's bind: an API
        // server that restarted), nothing is known: bookings then last until the TTL.
        let bound: Option<Vec<Box<str>>> = self
            .pods
            .as_ref()
            .filter(|p| p.following())
            .map(|p| p.with_node(node_name, |on| on.iter().map(|r| r.key.clone()).collect()));
        let known = |b: &Booking| {
            bound
                .as_ref()
                .is_none_or(|keys| keys.iter().any(|k| **k == *b.pod))
        };
        bookings::kept(
            read,
            pod,
            Timestamp::now(),
            Duration::from_secs(self.config.ledger_ttl_seconds),
            settled,
            known,
        )
    }

    /// Takes `pod`'s booking out of `node`'s Lease after its Binding failed, so that no replica counts
    /// the room as taken while kube-scheduler tries the pod again. Best effort: a booking left behind
    /// ends by itself ([`bookings::SETTLE`], or the TTL without a pod cache).
    async fn unbook(&self, node: &str, pod: &str) {
        let Some(board) = &self.board else { return };
        let mut turn = board.turn(node).await;
        for _ in 0..bookings::ATTEMPTS {
            let read = match board.current(node, &mut turn).await {
                Ok(read) => read,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the node's bookings to drop this pod's");
                    return;
                }
            };
            if !read.bookings.iter().any(|b| b.pod == pod) {
                *turn = Some(read);
                return;
            }
            let keep: Vec<Booking> = read.bookings.iter().filter(|b| b.pod != pod).cloned().collect();
            match board.write(node, read, &keep).await {
                Ok(written) => {
                    *turn = Some(written);
                    return;
                }
                Err(WriteError::Conflict) => continue,
                Err(WriteError::Api(e)) => {
                    tracing::warn!(error = %e, "cannot drop this pod's booking; it ends by itself");
                    return;
                }
            }
        }
    }

    /// Whether `node`'s usage annotation, as cached, lists `pod`.
    fn node_shows(&self, node: &str, pod: &str) -> bool {
        self.nodes
            .as_ref()
            .and_then(|c| c.get(node))
            .is_some_and(|n| n.shows(pod))
    }

    /// [`Scorer::reserve`] against the node less what other replicas hold: binds the pod cache shows,
    /// and `booked` (the node's shared bookings) where neither that, the node's annotation nor this
    /// replica's ledger counts them already.
    async fn reserve_with(
        &self,
        d: &PodDemand,
        node_name: &str,
        booked: &[Booking],
    ) -> Result<Reservation, BindError> {
        let mut node = self.node_state(node_name).await?;
        if let Some(reason) = node.restarting(Timestamp::now()) {
            return Err(BindError::AgentRestarting(format!("node {node_name}: {reason}")));
        }
        let seen = self.other_replicas_binds(&node);
        for r in &seen {
            ledger::subtract(&mut node, r);
        }
        let ttl = Duration::from_secs(self.config.ledger_ttl_seconds);
        let now = Timestamp::now();
        for b in booked {
            let counted = b.pod == d.key
                || seen.iter().any(|r| r.pod == b.pod)
                || self.ledger.holds(node_name, &b.pod)
                || node.shows(&b.pod)
                || Duration::try_from(now.duration_since(b.at)).is_ok_and(|age| age >= ttl);
            if counted {
                continue;
            }
            let gpus = b
                .gpus
                .iter()
                .filter_map(|u| node.position_of(u).map(|p| (p, u.clone())))
                .collect();
            let r = Reservation {
                pod: b.pod.clone(),
                gpus,
                mib: b.mib,
                at: Instant::now(),
            };
            ledger::subtract(&mut node, &r);
        }
        let (config, cache) = (&self.config, &self.policy_cache);
        let mix = self.workload.current();
        let choose = |n: &NodeSnapshot| {
            decide::check(n, d)
                .map_err(|r| BindError::DoesNotFit(format!("node {}: {}", n.name, r.reason)))?;
            // The view prioritize used: the GPU(s) its score was for.
            let scored = decide::prioritize(&[Arc::new(n.clone())], d, config, cache, &mix);
            let gpus = scored
                .into_iter()
                .flatten()
                .next()
                .map(|s| s.gpus)
                .unwrap_or_default();
            if gpus.is_empty() {
                return Err(BindError::DoesNotFit(format!("node {}: no GPU chosen", n.name)));
            }
            Ok(Reservation::of(d, n, gpus))
        };
        // Other pods' holds first (the GPUs their binds, about to come, were ranked for); where only
        // held room fits, the bind takes it: kube-scheduler chose this node, the holds only guessed.
        let mut past_holds = node.clone();
        let r = if self.holds.apply(&mut past_holds, &d.uid) == 0 {
            self.ledger.reserve(&mut node, choose)
        } else {
            self.ledger.reserve(&mut past_holds, choose).or_else(|_| {
                let r = self.ledger.reserve(&mut node, choose);
                if r.is_ok() {
                    self.metrics.binds_past_holds.inc();
                }
                r
            })
        };
        // The room is in the ledger now (or refused): the pod's own hold is done.
        self.holds.release(&d.uid);
        // Decided: the pod counts in the learned mix from the next decision on.
        self.learn(d, d.memory_mib(node.unit_mib));
        if let Ok(r) = &r {
            tracing::debug!(
                gpus = ?r.gpus,
                node_version = %node.resource_version,
                other_replicas_binds = seen.len(),
                bookings = booked.len(),
                "reserved"
            );
        }
        r
    }

    async fn bind_inner(&self, args: &ExtenderBindingArgs) -> Result<(), BindError> {
        let client = self.client.clone().ok_or(BindError::NoClient)?;
        let namespace = check_binding_args(args).map_err(BindError::BadRequest)?;
        // kube-scheduler tries a pod again once it stopped waiting for its bind, which goes on in
        // its own task: two binds of one pod would each reserve and book, and the loser's failed
        // Binding would take back the winner's reservation and booking with its own (both by pod),
        // leaving the winner's GPU free to the next pod.
        let _only = self.binding.begin(&args.pod_uid).ok_or_else(|| {
            BindError::NotBindable(format!(
                "a bind of pod {namespace}/{} is still on its way (kube-scheduler stopped waiting for it); \
                 the pod is bound or freed when it ends",
                args.pod_name
            ))
        })?;
        // The pod's own hold ends once the bind has reserved its room in the ledger (`reserve_with`),
        // or with the bind: released at the start, it left the room free to the next pods' filters while
        // the bind waited for its node's turn (at 1000 nodes, 18 % of binds then found it taken).
        let _hold = HoldEnds(&self.holds, &args.pod_uid);
        let hold = match self.holds.node_of(&args.pod_uid) {
            Some(held) if held == args.node => "on_hold",
            Some(_) => "elsewhere",
            None => "none",
        };
        self.metrics.binds.get_or_create(&HoldLabel { hold }).inc();
        // kube-scheduler starts the next pod's cycle while this bind is on its way: reserving before
        // reading the pod from the API server keeps the next `filter` from offering the same room. The
        // request is the one `filter` read from this pod (same UID; a pod's requests do not change).
        let key = format!("{namespace}/{}", args.pod_name);
        let filtered = self.filtered.take(&args.pod_uid).filter(|f| f.demand.key == key);
        let mut reserved = match &filtered {
            Some(f) => {
                self.check_scheduler(&key, &f.scheduler)?;
                Some(self.reserve(&f.demand, &args.node).await?)
            }
            None => None,
        };
        let outcome = async {
            let pods: Api<Pod> = Api::namespaced(client, namespace);
            // A pod `filter` saw needs no reading: the Binding names its UID (refused for another
            // pod of the same name), and the API server refuses it for a pod bound or being deleted.
            // One request less per bind, on an API server that is the limit at scale.
            if filtered.is_none() {
                // From the API server's watch cache (resourceVersion 0), not a quorum read from etcd:
                // kube-scheduler saw the pod through the same cache.
                let pod = pods
                    .get_with(&args.pod_name, &GetParams::any())
                    .await
                    .map_err(BindError::api(format!("reading pod {key}")))?;
                self.check_bindable(&pod, args, namespace)?;
                if let Some(d) = state::pod_demand(&pod, &self.rules).map_err(BindError::BadPod)? {
                    reserved = Some(self.reserve(&d, &args.node).await?);
                }
            }
            // The GPU choice travels in the Binding: the API server copies its annotations onto the pod
            // in the same update that sets the node, so no one sees the pod bound without them (and it
            // costs one write, not two).
            let annotations = reserved.as_ref().map(|r| {
                let uuids: Vec<&str> = r.gpus.iter().map(|(_, u)| u.as_str()).collect();
                BTreeMap::from([
                    (ASSIGNED_GPUS_ANNOTATION.to_string(), uuids.join(",")),
                    (
                        ASSIGNED_AT_ANNOTATION.to_string(),
                        k8s_openapi::jiff::Timestamp::now().to_string(),
                    ),
                ])
            });
            let binding = Binding {
                metadata: ObjectMeta {
                    name: Some(args.pod_name.clone()),
                    namespace: Some(namespace.to_string()),
                    uid: Some(args.pod_uid.clone()),
                    annotations,
                    ..ObjectMeta::default()
                },
                target: ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Node".into()),
                    name: Some(args.node.clone()),
                    ..ObjectReference::default()
                },
            };
            pods.create_subresource::<_, serde_json::Value>(
                "binding",
                &args.pod_name,
                &PostParams::default(),
                &binding,
            )
            .await
            .map_err(BindError::api("creating the binding"))?;
            Ok::<(), BindError>(())
        }
        .await;
        // A pod found bound (or whose Binding the API server refused as already assigned: bound
        // meanwhile) keeps what was reserved and booked for it: the reservation and the booking are
        // the pod's, however many binds made them, and taking them back would free the GPU it was
        // just bound to. They end when the agent's annotation shows the pod, or by themselves.
        let bound = match &outcome {
            Err(BindError::AlreadyBound(_)) => true,
            Err(BindError::Api {
                source: kube::Error::Api(status),
                ..
            }) => status.code == 409 && status.message.contains("already assigned"),
            _ => false,
        };
        if outcome.is_err()
            && !bound
            && let Some(r) = &reserved
        {
            self.ledger.release(&args.node, &r.pod);
            self.unbook(&args.node, &r.pod).await;
        }
        outcome
    }
}

/// Ends a pod's hold when its bind ends, whatever way it ends.
struct HoldEnds<'a>(&'a super::holds::GpuHolds, &'a str);

impl Drop for HoldEnds<'_> {
    fn drop(&mut self) {
        self.0.release(self.1);
    }
}

/// The pods (by UID) whose bind is running: at most one bind of a pod at a time.
#[derive(Default)]
pub(super) struct BindsRunning {
    uids: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

/// A bind in flight; its pod's UID is let go when it is dropped.
pub(super) struct InFlight {
    uids: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    uid: String,
}

impl BindsRunning {
    /// Marks `uid`'s bind as running, or `None` when one already is.
    pub(super) fn begin(&self, uid: &str) -> Option<InFlight> {
        let mut uids = self.uids.lock().unwrap_or_else(|e| e.into_inner());
        uids.insert(uid.to_string()).then(|| InFlight {
            uids: self.uids.clone(),
            uid: uid.to_string(),
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut uids = self.uids.lock().unwrap_or_else(|e| e.into_inner());
        uids.remove(&self.uid);
    }
}

/// The scheduler a pod names (the API server defaults an empty one to default-scheduler).
fn scheduler_of(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduler_name.as_deref())
        .filter(|n| !n.is_empty())
        .unwrap_or("default-scheduler")
        .to_string()
}

/// What `bind` needs of a pod `filter` was asked about: its GPU request, and its scheduler.
pub(super) struct FilteredPod {
    pub demand: PodDemand,
    pub scheduler: String,
}

/// The pods `filter` was asked about, by UID, for their `bind` (a bounded number; the oldest are
/// forgotten first, and `bind` then reads the pod from the API server).
#[derive(Default)]
pub(super) struct Filtered {
    inner: std::sync::Mutex<FilteredPods>,
}

/// Pods by UID, and the UIDs oldest first.
type FilteredPods = (HashMap<String, Arc<FilteredPod>>, VecDeque<String>);

/// Pods remembered by [`Filtered`]: far more than kube-scheduler has between a filter and its bind.
const FILTERED_PODS: usize = 4096;

impl Filtered {
    pub(super) fn remember(&self, d: &PodDemand, pod: &Pod) {
        if d.uid.is_empty() {
            return;
        }
        let filtered = FilteredPod {
            demand: d.clone(),
            scheduler: scheduler_of(pod),
        };
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (by_uid, order) = &mut *inner;
        if by_uid.insert(d.uid.clone(), Arc::new(filtered)).is_none() {
            order.push_back(d.uid.clone());
        }
        while order.len() > FILTERED_PODS {
            if let Some(oldest) = order.pop_front() {
                by_uid.remove(&oldest);
            }
        }
    }

    pub(super) fn take(&self, uid: &str) -> Option<Arc<FilteredPod>> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (by_uid, order) = &mut *inner;
        let d = by_uid.remove(uid)?;
        if let Some(at) = order.iter().position(|u| u == uid) {
            order.remove(at);
        }
        Some(d)
    }
}

/// What `bind` needs before it touches the API server: the names kube-scheduler sends are valid
/// Kubernetes names (so none can reach another API path), and the UID it always sends is there.
/// Returns the namespace.
fn check_binding_args(args: &ExtenderBindingArgs) -> Result<&str, String> {
    if args.pod_name.is_empty() || args.node.is_empty() || args.pod_uid.is_empty() {
        return Err("bind needs PodName, PodUID and Node".into());
    }
    let namespace = if args.pod_namespace.is_empty() {
        "default"
    } else {
        args.pod_namespace.as_str()
    };
    crate::names::check_label(namespace).map_err(|e| format!("PodNamespace: {e}"))?;
    crate::names::check_subdomain(&args.pod_name).map_err(|e| format!("PodName: {e}"))?;
    crate::names::check_subdomain(&args.node).map_err(|e| format!("Node: {e}"))?;
    Ok(namespace)
}
