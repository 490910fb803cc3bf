//! The placer's controller: the watches (slices, claims, DeviceClasses, Nodes, gated pods), the one
//! replica that places (a Lease), and the writes (each claim's allocation, then the gate removed).
//!
//! The chart's MutatingAdmissionPolicy adds the scheduling gate to every pod with ResourceClaims, which
//! keeps kube-scheduler away from it. The replica that holds the Lease reads the pod's claims
//! ([`super::claims`]), keeps the DRA nodes the pod may use ([`super::nodes`]), chooses one node and the
//! GPUs of every claim there ([`super::place`], with the extender's ranking), writes the allocations,
//! then removes the gate: kube-scheduler only binds the pod to that node.
//!
//! No GPU is promised twice: one replica places, one pod at a time, against every allocated claim
//! of the driver it watches (its own, as soon as decided, and any kube-scheduler made), plus what the
//! agents report. A pod the placer cannot read (a claim form it does not place, inter-pod affinity)
//! is released at once: kube-scheduler allocates it as usual.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::resource::v1::{
    AllocationResult, Device, DeviceClass, ResourceClaim, ResourceClaimConsumerReference, ResourceSlice,
};
use kube::api::{DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Api, Client};

use super::cel::Selector;
use super::claims::{
    AllocatedShare, Alternative, ClaimAsk, ClaimPlan, Need, allocated_shares, allocation_result, claim_ask,
    claim_key, claim_names, placed_by_gpumem,
};
use super::nodes::{self, NodeFacts, PodRules};
use super::place::{self, DraNode, Ranked, SelectionMemo, Unplaced};
use super::victims::{self, Holder};
use super::{PLACED_CONDITION, PLACEMENT_ANNOTATION};
use crate::lease;
use crate::scorer::Scorer;
use crate::scorer::config::DraPlacementConfig;
use crate::scorer::ledger::{self, Reservation};
use crate::scorer::pods::PodRecord;
use crate::scorer::state::{Demand, NodeSnapshot};
use crate::scorer::victims::selector_matches;

/// The finalizer kube-scheduler puts on a claim it allocates: with it, the resource claim controller
/// clears the allocation once no pod uses the claim, as for kube-scheduler's own.
pub const CLAIM_FINALIZER: &str = "resource.kubernetes.io/delete-protection";
/// How often the gated pods are looked at again without an event (room freed elsewhere, a claim the
/// controller had not made yet).
const RETRY_EVERY: Duration = Duration::from_secs(2);

/// Takes out of `node` the shares its usage annotation does not show yet (allocated, not prepared).
pub fn subtract_unshown(node: &mut NodeSnapshot, shares: &[AllocatedShare]) {
    for share in shares {
        let Some(p) = node.gpus().iter().position(|g| g.index == share.index) else {
            continue;
        };
        let gpu = &node.gpus()[p];
        if gpu.pods.contains(&share.owner) {
            continue;
        }
        let reservation = Reservation {
            pod: share.owner.clone(),
            gpus: vec![(p, gpu.uuid.clone())],
            mib: share.mib.filter(|&m| m < gpu.memory_mib),
            at: std::time::Instant::now(),
        };
        ledger::subtract(node, &reservation);
    }
}

/// How long kube-scheduler may find a pod unschedulable, with a claim gpumem placed, before the claim is
/// given back to it: the node gpumem chose does not take the pod (a rule the placer does not read, or
/// one that changed since), and waiting on for that node could be for good.
pub const GIVE_BACK_AFTER: Duration = Duration::from_secs(30);

/// Whether `pod` still carries `gate`.
pub fn is_gated(pod: &Pod, gate: &str) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == gate))
}

/// Whether kube-scheduler has found `pod` unschedulable (its `PodScheduled` condition False, reason
/// `Unschedulable`) and it is neither bound nor going. The condition's transition time cannot tell since
/// when: it stays at the time the pod was gated (False either way).
pub fn is_unschedulable(pod: &Pod) -> bool {
    let unbound =
        pod.metadata.deletion_timestamp.is_none() && pod.spec.as_ref().is_some_and(|s| s.node_name.is_none());
    let condition = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "PodScheduled"));
    unbound && condition.is_some_and(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
}

/// The placer's writes name it (`kubectl get resourceclaim --show-managed-fields`).
fn writer() -> PostParams {
    PostParams {
        field_manager: Some("gpumem-placer".into()),
        ..Default::default()
    }
}

/// Whether a claim's consumer is the pod of UID `pod_uid` (a pod of the same name made later is another).
fn consumer_is(consumer: &ResourceClaimConsumerReference, pod_uid: &str) -> bool {
    consumer.resource == "pods" && consumer.uid == pod_uid
}

/// The claims of `pod` (by `namespace/name`) to give back to kube-scheduler, the pod having been seen
/// unschedulable for `waited`: those gpumem placed and no other pod has reserved, once `waited` reaches
/// [`GIVE_BACK_AFTER`]. Deallocated, they are allocated by kube-scheduler's own allocator, on a node the
/// pod can go to.
pub fn claims_to_give_back(
    pod: &Pod,
    claims: &HashMap<String, Arc<ResourceClaim>>,
    driver: &str,
    gate: &str,
    waited: Duration,
) -> Vec<String> {
    if !is_unschedulable(pod) || is_gated(pod, gate) || waited < GIVE_BACK_AFTER {
        return Vec::new();
    }
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let pod_uid = pod.metadata.uid.as_deref().unwrap_or_default();
    claim_names(pod)
        .into_iter()
        .flatten()
        .map(|name| format!("{namespace}/{name}"))
        .filter(|key| {
            claims.get(key).is_some_and(|c| {
                // The placer reserves the claim for the pod it places; anyone else's holds it.
                let held_by_another = c
                    .status
                    .as_ref()
                    .and_then(|s| s.reserved_for.as_ref())
                    .is_some_and(|r| r.iter().any(|c| !consumer_is(c, pod_uid)));
                !held_by_another && placed_by_gpumem(c, driver)
            })
        })
        .collect()
}

/// The allocated shares of the driver, by claim UID, each with the resourceVersion it was read at
/// (an etcd revision: client-go's assume cache compares them as numbers too). A watch event older than
/// what is held changes nothing: the event of the placer's own finalizer update, arriving after the
/// allocation it wrote next, must not make that allocation look undone. A share being written is held
/// with version `u64::MAX` until the write answers.
#[derive(Debug, Default)]
pub struct Shares {
    by_claim: HashMap<String, (u64, Vec<AllocatedShare>)>,
    /// The claims with shares on each node, and the count of changes when that node's last changed:
    /// what was worked out from a node's shares stays good while its count does.
    by_node: HashMap<String, (u64, BTreeSet<String>)>,
    changes: u64,
}

fn version_of(claim: &ResourceClaim) -> u64 {
    claim
        .metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

impl Shares {
    /// Takes in a claim as the API server has it (a watch event, or what a write returned).
    pub fn observe(&mut self, claim: &ResourceClaim, driver: &str) {
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        let version = version_of(claim);
        if self.by_claim.get(&uid).is_some_and(|(held, _)| *held > version) {
            return;
        }
        // Kept even when empty: the version seen holds off an older copy arriving later.
        self.put(uid, version, allocated_shares(claim, driver));
    }

    /// The write of a claim's allocation answered with `written`: it replaces what was assumed.
    pub fn settle(&mut self, written: &ResourceClaim, driver: &str) {
        self.unassume(written.metadata.uid.as_deref().unwrap_or_default());
        self.observe(written, driver);
    }

    /// The claim is gone.
    pub fn forget(&mut self, uid: &str) {
        self.take(uid);
    }

    /// Counts `shares` for claim `uid` while its allocation is being written.
    pub fn assume(&mut self, uid: &str, shares: Vec<AllocatedShare>) {
        self.put(uid.to_string(), u64::MAX, shares);
    }

    /// The write of `uid`'s allocation failed: what the watch says next is the truth.
    pub fn unassume(&mut self, uid: &str) {
        if self.by_claim.get(uid).is_some_and(|(v, _)| *v == u64::MAX) {
            self.take(uid);
        }
    }

    /// A relist begins: forget what it will tell again, keep the writes in flight.
    pub fn relist(&mut self) {
        let told_again: Vec<String> = self
            .by_claim
            .iter()
            .filter(|(_, (v, _))| *v != u64::MAX)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in told_again {
            self.take(&uid);
        }
    }

    pub fn all(&self) -> impl Iterator<Item = &AllocatedShare> {
        self.by_claim.values().flat_map(|(_, s)| s)
    }

    /// The shares on `node`, and the count of changes when they last changed (0: never any).
    pub fn on_node(&self, node: &str) -> (u64, Vec<&AllocatedShare>) {
        let Some((changed, claims)) = self.by_node.get(node) else {
            return (0, Vec::new());
        };
        let shares = claims
            .iter()
            .filter_map(|uid| self.by_claim.get(uid))
            .flat_map(|(_, s)| s)
            .filter(|s| s.node == node)
            .collect();
        (*changed, shares)
    }

    fn put(&mut self, uid: String, version: u64, shares: Vec<AllocatedShare>) {
        self.take(&uid);
        self.changes += 1;
        for share in &shares {
            let (changed, claims) = self.by_node.entry(share.node.clone()).or_default();
            *changed = self.changes;
            claims.insert(uid.clone());
        }
        self.by_claim.insert(uid, (version, shares));
    }

    fn take(&mut self, uid: &str) {
        let Some((_, shares)) = self.by_claim.remove(uid) else {
            return;
        };
        self.changes += 1;
        for share in &shares {
            if let Some((changed, claims)) = self.by_node.get_mut(&share.node) {
                *changed = self.changes;
                claims.remove(uid);
            }
        }
    }
}

/// What the placer knows between decisions.
#[derive(Default)]
struct Known {
    /// The driver's ResourceSlices by name: the node each is for, and its devices.
    slices: HashMap<String, (String, Arc<Vec<Device>>)>,
    /// Each node's devices: its slices', joined (in the slices' name order), the same `Arc` until one
    /// of them changes.
    node_devices: BTreeMap<String, Arc<Vec<Device>>>,
    /// Each node's GPUs as the placer counts them ([`subtract_unshown`]), worked out from the agent's
    /// report and the node's shares at their change count: reused while neither changes.
    counted: HashMap<String, Counted>,
    /// DeviceClasses by name (their selectors and configuration apply to the requests naming them).
    classes: BTreeMap<String, DeviceClass>,
    /// What kube-scheduler's node filters read of each Node.
    nodes: HashMap<String, NodeFacts>,
    shares: Shares,
    /// Every claim as the watch last showed it, by `namespace/name`: a decision reads a pod's claims
    /// here, not from the API server (a stale copy only costs a conflict on the write, which is retried).
    claims: HashMap<String, Arc<ResourceClaim>>,
    /// Counts the events that may have freed room (a claim deallocated or deleted, a slice, class or
    /// node changed).
    room_freed: u64,
    /// Pods that found no room, with `room_freed` and the time then.
    no_room: HashMap<String, (u64, std::time::Instant)>,
    /// Pods whose claims are being written (by pod UID): not looked at again meanwhile.
    writing: HashSet<String>,
    /// Gated pods by UID.
    gated: HashMap<String, Pod>,
    /// Released pods kube-scheduler found unschedulable, by UID, and since when this replica has seen
    /// them so: their claims may have to be given back ([`claims_to_give_back`]).
    unschedulable: HashMap<String, (Pod, std::time::Instant)>,
    /// The last reason each pod was not placed, so an unchanged one is not logged again.
    waiting: HashMap<String, String>,
    /// Pods that preempted others, by UID: the room held for each while its victims end.
    nominated: HashMap<String, Nomination>,
    /// Pods marked [`PLACED_CONDITION`]`=False` (by UID): marked placed when they are.
    marked: HashSet<String>,
}

/// The room held for a pod that preempted others ([`super::victims`]), as kube-scheduler nominates a
/// node: until the victims' claims are given back, pods of no higher priority do not take its GPUs.
struct Nomination {
    node: String,
    /// The GPUs (NVML indices) the victims held.
    gpus: Vec<u32>,
    priority: i32,
    /// The victims (`namespace/name`, their shares' owner).
    victims: Vec<String>,
}

impl Nomination {
    /// The victims not ended yet: a victim has ended once its claims are deallocated (`shares`, the
    /// node's) and its agent no longer reports it (`report`): only then is its room free.
    fn victims_left(&self, shares: &[&AllocatedShare], report: Option<&NodeSnapshot>) -> Vec<&str> {
        let reported = |v: &str| {
            report
                .iter()
                .flat_map(|r| r.gpus())
                .any(|g| g.pods.iter().any(|p| p == v))
        };
        self.victims
            .iter()
            .filter(|v| shares.iter().any(|s| s.owner == **v) || reported(v))
            .map(String::as_str)
            .collect()
    }
}

/// The GPUs of `node` held for pods that preempted, out of reach of the pod `uid` of `priority`: those
/// held for another pod of no lower priority.
fn held_from(nominated: &HashMap<String, Nomination>, node: &str, (uid, priority): (&str, i32)) -> Vec<u32> {
    nominated
        .iter()
        .filter(|(other, n)| *other != uid && n.priority >= priority && n.node == node)
        .flat_map(|(_, n)| n.gpus.iter().copied())
        .collect()
}

/// A node's GPUs as the placer counts them, and what they were worked out from.
struct Counted {
    report: Arc<NodeSnapshot>,
    shares_changed: u64,
    state: Arc<NodeSnapshot>,
}

impl Known {
    /// `node`'s GPUs as the placer counts them: its agent's `report`, less the shares allocated there
    /// that the report does not show yet.
    fn counted(&mut self, node: &str, report: Arc<NodeSnapshot>) -> Arc<NodeSnapshot> {
        let (shares_changed, shares) = self.shares.on_node(node);
        if let Some(c) = self.counted.get(node)
            && Arc::ptr_eq(&c.report, &report)
            && c.shares_changed == shares_changed
        {
            return Arc::clone(&c.state);
        }
        let mut state = Arc::clone(&report);
        if !shares.is_empty() {
            let shares: Vec<AllocatedShare> = shares.into_iter().cloned().collect();
            subtract_unshown(Arc::make_mut(&mut state), &shares);
        }
        let counted = Counted {
            report,
            shares_changed,
            state: Arc::clone(&state),
        };
        self.counted.insert(node.to_string(), counted);
        state
    }

    /// Joins the devices of `node`'s slices again, after one of them changed.
    fn join_devices(&mut self, node: &str) {
        let mut of_node: Vec<(&String, &Arc<Vec<Device>>)> = self
            .slices
            .iter()
            .filter(|(_, (n, _))| n == node)
            .map(|(name, (_, devices))| (name, devices))
            .collect();
        of_node.sort_by(|a, b| a.0.cmp(b.0));
        let joined = match of_node.as_slice() {
            [] => None,
            [(_, devices)] => Some(Arc::clone(devices)),
            several => Some(Arc::new(
                several.iter().flat_map(|(_, d)| d.iter().cloned()).collect(),
            )),
        };
        match joined {
            Some(devices) => self.node_devices.insert(node.to_string(), devices),
            None => self.node_devices.remove(node),
        };
    }
}

/// Compiled CEL selectors by expression, kept between decisions (at most this many).
const SELECTORS_KEPT: usize = 1024;

/// The DRA placer: the caches it reads and the one replica's loop.
pub struct Placer {
    config: DraPlacementConfig,
    /// Who writes the Events on the pods (why one waits, was left to kube-scheduler, or where it was
    /// placed: `kubectl describe pod`); `None` in tests.
    reporter: Option<(Client, Reporter)>,
    known: Mutex<Known>,
    selectors: Mutex<HashMap<String, Arc<Selector>>>,
    /// What each node's devices answered to the selectors, kept between decisions.
    selections: Mutex<SelectionMemo>,
    changed: tokio::sync::Notify,
    writes: Arc<tokio::sync::Semaphore>,
}

/// What became of one gated pod that is not placed now.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// Nothing for gpumem to place: the gate is gone, kube-scheduler goes on alone (a short kind for
    /// the metric, and why).
    Released(&'static str, String),
    /// Stays gated, looked at again later (why).
    Waiting(String),
    /// Stays gated until room is freed somewhere (why).
    NoRoom(String),
}

/// Why a pod is still gated, as its log line and Event tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// For a moment (its claims are being made, a write met a change): logged only.
    Brief,
    /// Until room is freed or a node changes: logged, and an Event on the pod.
    NoRoom,
    /// A request to the API server failed: logged as a warning, and a warning Event.
    Failed,
}

/// What the placer decided for one gated pod.
enum Decision {
    Done(Outcome),
    /// Allocate each claim so, on `node` (already counted there), then release the pod.
    Write {
        writes: Vec<(ResourceClaim, AllocationResult)>,
        node: String,
        /// What each claim gets, for the pod's [`PLACEMENT_ANNOTATION`] (`claim: gpu-2 5000Mi`).
        summary: String,
    },
}

/// How often a pod that found no room is looked at again even if no claim freed any.
const RECHECK_EVERY: Duration = Duration::from_secs(10);

/// Allocations written at once, each two requests to the API server one after the other (the claim's
/// status, then the gate): decisions stay one at a time, the round trips overlap. With 16, at 1000
/// nodes and ~420 ms a pair on a loaded API server, the writes held placement at ~36 pods/s.
const WRITES_IN_FLIGHT: usize = 64;

fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// A failed request, in a line.
fn api_failure(e: kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("the API server refused: {} ({})", s.message, s.code),
        e => format!("the API server did not answer: {e}"),
    }
}

/// `claim: gpu-2 5000Mi, ...; claim2: ...` for each written claim and its picks.
fn to_place_summary(
    writes: &[(ResourceClaim, AllocationResult)],
    picks: &[Vec<super::claims::Picked>],
) -> String {
    writes
        .iter()
        .zip(picks)
        .map(|((claim, _), picks)| {
            let gpus: Vec<String> = picks
                .iter()
                .map(|p| format!("{} {}Mi", crate::node::slice::device_name(p.index), p.mib))
                .collect();
            format!(
                "{}: {}",
                claim.metadata.name.as_deref().unwrap_or_default(),
                gpus.join(", ")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether a claim's search may have missed room kube-scheduler's would find: several requests,
/// alternatives or constraints (the placer's search is greedy, kube-scheduler's backtracks).
fn searched_greedily(plans: &[ClaimPlan]) -> bool {
    plans.len() > 1
        || plans.iter().any(|p| {
            p.requests.len() > 1
                || !p.constraints.is_empty()
                || p.requests.iter().any(|r| r.alternatives.len() > 1)
        })
}

impl Placer {
    pub fn new(config: DraPlacementConfig, reporter: Option<(Client, Reporter)>) -> Arc<Placer> {
        Arc::new(Placer {
            config,
            reporter,
            known: Mutex::new(Known::default()),
            selectors: Mutex::new(HashMap::new()),
            selections: Mutex::new(SelectionMemo::default()),
            changed: tokio::sync::Notify::new(),
            writes: Arc::new(tokio::sync::Semaphore::new(WRITES_IN_FLIGHT)),
        })
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn selections(&self) -> std::sync::MutexGuard<'_, SelectionMemo> {
        self.selections.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the watches of slices, claims, DeviceClasses, Nodes and unscheduled pods.
    fn follow(self: &Arc<Self>, client: &Client) {
        use crate::scorer::cache::follow;
        let me = Arc::clone(self);
        follow::<ResourceSlice>(
            client.clone(),
            watcher::Config::default(),
            "resourceslice",
            move |e| me.on_slice(e),
            || (),
        );
        let me = Arc::clone(self);
        follow::<ResourceClaim>(
            client.clone(),
            watcher::Config::default(),
            "resourceclaim",
            move |e| me.on_claim(e),
            || (),
        );
        let me = Arc::clone(self);
        follow::<DeviceClass>(
            client.clone(),
            watcher::Config::default(),
            "deviceclass",
            move |e| me.on_class(e),
            || (),
        );
        let me = Arc::clone(self);
        follow::<Node>(
            client.clone(),
            watcher::Config::default(),
            "node",
            move |e| me.on_node(e),
            || (),
        );
        let me = Arc::clone(self);
        let unscheduled = watcher::Config::default().fields("spec.nodeName=");
        follow::<Pod>(
            client.clone(),
            unscheduled,
            "unscheduled pod",
            move |e| me.on_pod(e),
            || (),
        );
    }

    fn on_slice(&self, event: &watcher::Event<ResourceSlice>) {
        let mut known = self.known();
        known.room_freed += 1;
        let name = |s: &ResourceSlice| s.metadata.name.clone().unwrap_or_default();
        match event {
            watcher::Event::Init => {
                known.slices.clear();
                known.node_devices.clear();
            }
            watcher::Event::InitApply(s) | watcher::Event::Apply(s) => {
                let before = known.slices.remove(&name(s)).map(|(node, _)| node);
                if s.spec.driver == self.config.driver_name
                    && let Some(node) = s.spec.node_name.clone()
                {
                    let devices = Arc::new(s.spec.devices.clone().unwrap_or_default());
                    known.slices.insert(name(s), (node.clone(), devices));
                    known.join_devices(&node);
                }
                if let Some(node) = before {
                    known.join_devices(&node);
                }
            }
            watcher::Event::Delete(s) => {
                if let Some((node, _)) = known.slices.remove(&name(s)) {
                    known.join_devices(&node);
                }
            }
            watcher::Event::InitDone => {}
        }
        // What was kept for nodes that publish no devices any more goes.
        let Known {
            node_devices,
            counted,
            ..
        } = &mut *known;
        counted.retain(|n, _| node_devices.contains_key(n));
        self.selections().retain(|n| node_devices.contains_key(n));
        drop(known);
        self.changed.notify_one();
    }

    fn on_class(&self, event: &watcher::Event<DeviceClass>) {
        let mut known = self.known();
        known.room_freed += 1;
        let name = |c: &DeviceClass| c.metadata.name.clone().unwrap_or_default();
        match event {
            watcher::Event::Init => known.classes.clear(),
            watcher::Event::InitApply(c) | watcher::Event::Apply(c) => {
                known.classes.insert(name(c), c.clone());
            }
            watcher::Event::Delete(c) => {
                known.classes.remove(&name(c));
            }
            watcher::Event::InitDone => {}
        }
        drop(known);
        self.changed.notify_one();
    }

    fn on_node(&self, event: &watcher::Event<Node>) {
        let mut known = self.known();
        let changed = match event {
            watcher::Event::Init => {
                known.nodes.clear();
                true
            }
            watcher::Event::InitApply(n) | watcher::Event::Apply(n) => {
                let facts = NodeFacts::from_node(n);
                // A Node's status is written every few seconds: only a change of what the node filters
                // read may let a waiting pod in, or, on a node where victims end, any change (its
                // agent's report no longer listing one of them frees the room held).
                let same = known.nodes.get(&facts.name) == Some(&facts);
                let victims_end_here = known.nominated.values().any(|v| v.node == facts.name);
                known.nodes.insert(facts.name.clone(), facts);
                !same || victims_end_here
            }
            watcher::Event::Delete(n) => {
                known.nodes.remove(n.metadata.name.as_deref().unwrap_or_default());
                true
            }
            watcher::Event::InitDone => false,
        };
        if changed {
            known.room_freed += 1;
            drop(known);
            self.changed.notify_one();
        }
    }

    fn on_claim(&self, event: &watcher::Event<ResourceClaim>) {
        let mut known = self.known();
        match event {
            watcher::Event::Init => {
                known.shares.relist();
                known.claims.clear();
            }
            watcher::Event::InitApply(c) | watcher::Event::Apply(c) => {
                known.shares.observe(c, &self.config.driver_name);
                if c.status.as_ref().is_none_or(|s| s.allocation.is_none()) {
                    known.room_freed += 1;
                }
                known.claims.insert(claim_key(c), Arc::new(c.clone()));
            }
            watcher::Event::Delete(c) => {
                known.shares.forget(c.metadata.uid.as_deref().unwrap_or_default());
                known.claims.remove(&claim_key(c));
                known.room_freed += 1;
            }
            watcher::Event::InitDone => {}
        }
        drop(known);
        // Freed room may let a waiting pod in.
        self.changed.notify_one();
    }

    fn on_pod(&self, event: &watcher::Event<Pod>) {
        let gate = &self.config.scheduling_gate;
        let mut known = self.known();
        match event {
            watcher::Event::Init => {
                known.gated.clear();
                known.unschedulable.clear();
            }
            watcher::Event::InitApply(p) | watcher::Event::Apply(p) => {
                let uid = p.metadata.uid.clone().unwrap_or_default();
                if is_unschedulable(p) && !is_gated(p, gate) {
                    let seen = known
                        .unschedulable
                        .get(&uid)
                        .map_or_else(std::time::Instant::now, |(_, at)| *at);
                    known.unschedulable.insert(uid.clone(), (p.clone(), seen));
                } else {
                    known.unschedulable.remove(&uid);
                }
                if is_gated(p, gate) && p.metadata.deletion_timestamp.is_none() {
                    known.gated.insert(uid, p.clone());
                } else {
                    known.gated.remove(&uid);
                    known.waiting.remove(&uid);
                    known.no_room.remove(&uid);
                    known.nominated.remove(&uid);
                }
            }
            watcher::Event::Delete(p) => {
                let uid = p.metadata.uid.as_deref().unwrap_or_default();
                known.unschedulable.remove(uid);
                known.gated.remove(uid);
                known.waiting.remove(uid);
                known.no_room.remove(uid);
                known.nominated.remove(uid);
                known.marked.remove(uid);
            }
            watcher::Event::InitDone => {}
        }
        drop(known);
        self.changed.notify_one();
    }

    /// The DRA nodes `rules` let the pod (`uid`, of `priority`) use (only `pinned`, when one of its
    /// claims is allocated there), each as the placer counts it: the agent's report, less the claims
    /// allocated there that the report does not show yet, less the GPUs held for pods of no lower
    /// priority that preempted. Also why each other DRA node is not one.
    fn candidates(
        &self,
        scorer: &Scorer,
        rules: &PodRules,
        pinned: Option<&str>,
        (uid, priority): (&str, i32),
    ) -> (Vec<DraNode>, Vec<String>) {
        let mut known = self.known();
        let known = &mut *known;
        let (mut candidates, mut rejected) = (Vec::new(), Vec::new());
        let nodes: Vec<(String, Arc<Vec<Device>>)> = known
            .node_devices
            .iter()
            .filter(|(name, _)| pinned.is_none_or(|p| p == name.as_str()))
            .map(|(name, devices)| (name.clone(), Arc::clone(devices)))
            .collect();
        for (name, devices) in nodes {
            let Some(facts) = known.nodes.get(&name) else {
                rejected.push(format!("{name}: its Node is not known yet"));
                continue;
            };
            let in_use = scorer.requested_on(&name).unwrap_or_default();
            if let Err(why) = rules.admits(facts, in_use) {
                rejected.push(format!("{name}: {why}"));
                continue;
            }
            let Some(report) = scorer.node_report(&name) else {
                rejected.push(format!("{name}: the agent's report is not read yet"));
                continue;
            };
            let mut state = known.counted(&name, report);
            let held = held_from(&known.nominated, &name, (uid, priority));
            if !held.is_empty() {
                state = Arc::new(victims::hold(&state, &held));
            }
            candidates.push(DraNode { state, devices });
        }
        (candidates, rejected)
    }

    /// The compiled selectors of `expressions`; `Err`: one the CEL library cannot compile.
    fn compiled(&self, expressions: &[&str]) -> Result<HashMap<String, Arc<Selector>>, String> {
        let mut kept = self.selectors.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() > SELECTORS_KEPT {
            kept.clear();
        }
        let mut out = HashMap::new();
        for &e in expressions {
            let selector = match kept.get(e) {
                Some(s) => Arc::clone(s),
                None => {
                    let s =
                        Arc::new(Selector::compile(e).map_err(|err| format!("CEL selector {e:?}: {err}"))?);
                    kept.insert(e.to_string(), Arc::clone(&s));
                    s
                }
            };
            out.insert(e.to_string(), selector);
        }
        Ok(out)
    }

    /// The CEL expressions of the DeviceClasses the claims' alternatives name; `Err`: a class that does
    /// not exist yet (wait), or one with a selector that is not CEL (release).
    fn class_selectors(
        &self,
        to_place: &[(ResourceClaim, ClaimPlan)],
    ) -> Result<HashMap<String, Vec<String>>, Outcome> {
        let known = self.known();
        let mut out = HashMap::new();
        for alt in to_place
            .iter()
            .flat_map(|(_, p)| &p.requests)
            .flat_map(|r| &r.alternatives)
        {
            let Some(class) = known.classes.get(&alt.class) else {
                return Err(Outcome::Waiting(format!(
                    "DeviceClass {} does not exist",
                    alt.class
                )));
            };
            let expressions = class.spec.selectors.iter().flatten();
            let Some(expressions) = expressions
                .map(|s| s.cel.as_ref().map(|c| c.expression.clone()))
                .collect()
            else {
                return Err(Outcome::Released(
                    "selector",
                    format!("DeviceClass {} has a selector that is not CEL", alt.class),
                ));
            };
            out.insert(alt.class.clone(), expressions);
        }
        Ok(out)
    }

    /// Looks at one gated pod: decides where its claims go (and counts them there at once), releases
    /// it to kube-scheduler, or leaves it waiting.
    async fn decide(&self, scorer: &Scorer, client: &Client, pod: &Pod) -> Result<Decision, kube::Error> {
        let driver = self.config.driver_name.as_str();
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        let Some(names) = claim_names(pod) else {
            return Ok(Decision::Done(Outcome::Waiting(
                "its claims are not created yet".into(),
            )));
        };
        let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
        let mut to_place: Vec<(ResourceClaim, ClaimPlan)> = Vec::new();
        let mut pinned: Option<String> = None;
        for name in &names {
            let cached = self.known().claims.get(&format!("{namespace}/{name}")).cloned();
            let claim = match cached {
                Some(claim) => Some((*claim).clone()),
                None => claims.get_opt(name).await?,
            };
            let Some(claim) = claim else {
                return Ok(Decision::Done(Outcome::Waiting(format!(
                    "claim {name} does not exist yet"
                ))));
            };
            match claim_ask(&claim, &self.config.device_classes) {
                ClaimAsk::NotOurs => {}
                // The pod goes where its allocated claims are.
                ClaimAsk::Allocated => {
                    if let Some(share) = allocated_shares(&claim, driver).first() {
                        pinned = Some(share.node.clone());
                    }
                }
                ClaimAsk::Unsupported(u) => {
                    return self
                        .released(client, pod, u.kind, format!("claim {name}: {}", u.why))
                        .await;
                }
                ClaimAsk::Place(plan) => to_place.push((claim, plan)),
            }
        }
        if to_place.is_empty() {
            return self
                .released(
                    client,
                    pod,
                    "nothing_to_place",
                    "no claim for gpumem to place".into(),
                )
                .await;
        }
        let rules = match PodRules::of(pod) {
            Ok(rules) => rules,
            Err(why) => return self.released(client, pod, "pod_rules", why.to_string()).await,
        };
        // The selectors: each alternative's, and its class's.
        let class_selectors = match self.class_selectors(&to_place) {
            Ok(selectors) => selectors,
            Err(Outcome::Released(kind, why)) => return self.released(client, pod, kind, why).await,
            Err(other) => return Ok(Decision::Done(other)),
        };
        let all: Vec<&str> = class_selectors
            .values()
            .flatten()
            .chain(
                to_place
                    .iter()
                    .flat_map(|(_, p)| &p.requests)
                    .flat_map(|r| &r.alternatives)
                    .flat_map(|a| &a.selectors),
            )
            .map(String::as_str)
            .collect();
        let compiled = match self.compiled(&all) {
            Ok(c) => c,
            Err(why) => return self.released(client, pod, "cel", why).await,
        };
        // A pod whose labels or annotations the scorer cannot read waits with the reason, as on the
        // extender path.
        if let Err(why) = scorer.demand_of(pod, Demand::Whole { count: 1 }) {
            return Ok(Decision::Done(Outcome::NoRoom(why)));
        }
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        let priority = pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
        let (candidates, rejected) = self.candidates(scorer, &rules, pinned.as_deref(), (uid, priority));
        if candidates.is_empty() {
            let shown: Vec<&str> = rejected.iter().take(3).map(String::as_str).collect();
            return Ok(Decision::Done(Outcome::NoRoom(format!(
                "no DRA node the pod may use ({})",
                if shown.is_empty() {
                    "no node publishes a ResourceSlice of the driver".into()
                } else {
                    shown.join("; ")
                }
            ))));
        }
        let selects = |node: &DraNode, alt: &Alternative| -> Result<Vec<usize>, String> {
            let class = class_selectors.get(&alt.class).into_iter().flatten();
            let selectors: Vec<String> = class.chain(&alt.selectors).cloned().collect();
            let evaluate = || {
                place::select_each(node, |device| {
                    for e in &selectors {
                        let Some(selector) = compiled.get(e) else {
                            return Ok(false);
                        };
                        if !selector.matches(driver, device).map_err(|err| err.to_string())? {
                            return Ok(false);
                        }
                    }
                    Ok(true)
                })
            };
            self.selections().select(node, selectors.clone(), evaluate)
        };
        let rank = |nodes: &[Arc<NodeSnapshot>], need: Need| -> Vec<Option<Ranked>> {
            // Memory is asked in MiB; a node counts it in its unit: rank each unit's nodes in that unit.
            let mut by_unit: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
            for (i, n) in nodes.iter().enumerate() {
                by_unit.entry(n.unit_mib.max(1)).or_default().push(i);
            }
            let mut out = vec![None; nodes.len()];
            for (unit, members) in by_unit {
                let Ok(d) = scorer.demand_of(pod, demand_of(need, unit)) else {
                    continue;
                };
                let group: Vec<Arc<NodeSnapshot>> = members.iter().map(|&i| Arc::clone(&nodes[i])).collect();
                for (&i, scored) in members.iter().zip(scorer.rank(&group, &d)) {
                    out[i] = scored.filter(|s| !s.gpus.is_empty()).map(|s| Ranked {
                        raw: s.raw,
                        gpus: s.gpus,
                    });
                }
            }
            out
        };
        let plans: Vec<ClaimPlan> = to_place.iter().map(|(_, p)| p.clone()).collect();
        let placement = match place::place(&plans, &candidates, driver, &selects, &rank) {
            Ok(p) => p,
            Err(Unplaced::Selector(why)) => {
                let why =
                    format!("{why}; kube-scheduler stops at such an error and says so in the pod's events");
                return self.released(client, pod, "cel_error", why).await;
            }
            Err(Unplaced::NoRoom(why)) if searched_greedily(&plans) => {
                let why = format!("{why}; kube-scheduler's search may find what the placer's did not");
                return self.released(client, pod, "no_room_searched", why).await;
            }
            Err(Unplaced::NoRoom(why)) => {
                // A pod that fits nowhere counts in the learned mix all the same (as on the extender
                // path): the demand for a model that has filled up must not vanish from it.
                if let Some(alt) = plans
                    .first()
                    .and_then(|p| p.requests.first())
                    .and_then(|r| r.alternatives.first())
                {
                    let unit = candidates.first().map_or(1, |c| c.state.unit_mib.max(1));
                    let need_mib = match alt.need {
                        Need::Mib(mib) => mib,
                        Need::Whole(_) => 0,
                    };
                    learn(scorer, pod, demand_of(alt.need, unit), need_mib, || {
                        place::models_taken(&candidates, alt, &selects)
                    });
                }
                let fits = |node: &DraNode| {
                    place::place(&plans, std::slice::from_ref(node), driver, &selects, &rank).is_ok()
                };
                return Ok(Decision::Done(
                    self.preempt(scorer, client, pod, &candidates, &fits, why).await,
                ));
            }
        };
        let classes = self.known().classes.clone();
        let mut writes = Vec::new();
        for ((claim, _), picks) in to_place.into_iter().zip(&placement.picks) {
            let allocation = allocation_result(&claim, &classes, driver, &placement.node, picks);
            // Counted from now on: the next decision sees this room taken, whatever the write's progress.
            let mut allocated = claim.clone();
            allocated.status.get_or_insert_default().allocation = Some(allocation.clone());
            let uid = claim.metadata.uid.clone().unwrap_or_default();
            self.known()
                .shares
                .assume(&uid, allocated_shares(&allocated, driver));
            writes.push((claim, allocation));
        }
        // The learned mix counts the pod by its first pick.
        if let Some(first) = placement.picks.iter().flatten().next() {
            let alt = plans
                .iter()
                .flat_map(|p| &p.requests)
                .flat_map(|r| &r.alternatives)
                .find(|a| a.result_name == first.result_name);
            let memory = alt.map(|a| a.need);
            let unit = candidates
                .iter()
                .find(|c| c.state.name == placement.node)
                .map_or(1, |c| c.state.unit_mib.max(1));
            let (demand, need_mib) = match memory {
                Some(Need::Mib(_)) => (
                    Demand::Memory {
                        units: first.mib.div_ceil(unit),
                    },
                    first.mib,
                ),
                _ => (
                    Demand::Whole {
                        count: placement.picks.iter().flatten().count() as u32,
                    },
                    0,
                ),
            };
            learn(scorer, pod, demand, need_mib, || {
                alt.and_then(|a| place::models_taken(&candidates, a, &selects))
            });
        }
        let summary = to_place_summary(&writes, &placement.picks);
        Ok(Decision::Write {
            writes,
            node: placement.node,
            summary,
        })
    }

    /// For a pod that fits nowhere (`why`): evicts the pods of lower priority that make room for it
    /// on one of `candidates` ([`victims::choose`]; `fits` places its claims on one node) and holds
    /// that room for it while they end; or says why it waits.
    async fn preempt(
        &self,
        scorer: &Scorer,
        client: &Client,
        pod: &Pod,
        candidates: &[DraNode],
        fits: &(dyn Fn(&DraNode) -> bool + Sync),
        why: String,
    ) -> Outcome {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let spec = pod.spec.as_ref();
        let priority = spec.and_then(|s| s.priority).unwrap_or(0);
        if spec.and_then(|s| s.preemption_policy.as_deref()) == Some("Never") {
            return Outcome::NoRoom(why);
        }
        // Holders of lower priority on each node, and the records (labels) for the PDBs.
        let mut nodes: Vec<(usize, Vec<Holder>)> = Vec::new();
        let mut records: HashMap<String, Arc<PodRecord>> = HashMap::new();
        {
            let mut known = self.known();
            if let Some(n) = known.nominated.get(&uid) {
                let (_, shares) = known.shares.on_node(&n.node);
                let left = n.victims_left(&shares, scorer.node_report(&n.node).as_deref());
                if !left.is_empty() {
                    return Outcome::NoRoom(format!(
                        "{why}; waiting for the pods it preempted on node {} to end ({}): their GPUs are \
                         held for it",
                        n.node,
                        left.join(", ")
                    ));
                }
                // Its victims are gone and it still does not fit (its room went to a pod of higher
                // priority, or was not enough): it may preempt again.
                known.nominated.remove(&uid);
            }
            for (c, node) in candidates.iter().enumerate() {
                let (_, shares) = known.shares.on_node(&node.state.name);
                if shares.is_empty() {
                    continue;
                }
                let pods = scorer.preemptible_on(&node.state.name, priority);
                let holders = victims::holders_of(&shares, &pods);
                if !holders.is_empty() {
                    for (record, _) in pods {
                        records.insert(record.uid.to_string(), record);
                    }
                    nodes.push((c, holders));
                }
            }
        }
        if nodes.is_empty() {
            return Outcome::NoRoom(why);
        }
        if let Err(e) = protect(client, &mut nodes, &records).await {
            return Outcome::NoRoom(format!("{why}; cannot preempt: {e}"));
        }
        let states: Vec<(&NodeSnapshot, &[Holder])> = nodes
            .iter()
            .map(|(c, h)| (&*candidates[*c].state, h.as_slice()))
            .collect();
        let chosen = victims::choose(priority, &states, |n, state| {
            let candidate = &candidates[nodes[n].0];
            fits(&DraNode {
                state: Arc::new(state.clone()),
                devices: Arc::clone(&candidate.devices),
            })
        });
        let chosen = match chosen {
            Ok(v) => v,
            Err(no) => return Outcome::NoRoom(format!("{why}; {no}")),
        };
        let (c, holders) = &nodes[chosen.node];
        let node = candidates[*c].state.name.clone();
        let gone: Vec<&Holder> = chosen.holders.iter().map(|&h| &holders[h]).collect();
        let key = pod_key(pod);
        let (mut evicted, mut refused) = (Vec::new(), Vec::new());
        for victim in &gone {
            match evict(client, victim).await {
                Ok(()) => {
                    scorer.metrics.dra_preempted.inc();
                    tracing::info!(preemptor = %key, victim = %victim.key, %node, "evicted to make GPU room");
                    self.tell_ref(
                        pod_reference(victim),
                        EventType::Normal,
                        "PreemptedForGPU",
                        &format!("evicted by gpumem to make GPU room on node {node} for {key} (priority {priority})"),
                    );
                    evicted.push(victim.key.clone());
                }
                Err(e) => refused.push(format!("{}: {e}", victim.key)),
            }
        }
        if !evicted.is_empty() {
            let mut gpus: Vec<u32> = gone
                .iter()
                .flat_map(|h| h.shares.iter().map(|s| s.index))
                .collect();
            gpus.sort_unstable();
            gpus.dedup();
            self.tell(
                pod,
                EventType::Normal,
                "Preempting",
                &format!(
                    "evicting {} on node {node} to make GPU room, held for this pod",
                    evicted.join(", ")
                ),
            );
            self.known().nominated.insert(
                uid,
                Nomination {
                    node: node.clone(),
                    gpus,
                    priority,
                    victims: evicted.clone(),
                },
            );
        }
        if refused.is_empty() {
            Outcome::NoRoom(format!(
                "{why}; preempting {} on node {node}: waits for them to end",
                evicted.join(", ")
            ))
        } else {
            Outcome::NoRoom(format!(
                "{why}; preempting on node {node} refused: {}",
                refused.join("; ")
            ))
        }
    }

    /// Releases `pod` to kube-scheduler unplaced, counted under `kind`.
    async fn released(
        &self,
        client: &Client,
        pod: &Pod,
        kind: &'static str,
        why: String,
    ) -> Result<Decision, kube::Error> {
        self.release(client, pod, None, None).await?;
        self.mark_released(client, pod, &why);
        Ok(Decision::Done(Outcome::Released(kind, why)))
    }

    /// Writes one decided allocation (the finalizer, then the status, reserved for `pod` as
    /// kube-scheduler's PreBind would: it then finds the claim reserved and makes no write of its own).
    /// Every write carries the resourceVersion read: a claim changed meanwhile is looked at again, not
    /// overwritten.
    async fn write(
        &self,
        client: &Client,
        pod: &Pod,
        claim: ResourceClaim,
        allocation: AllocationResult,
    ) -> Result<Option<String>, kube::Error> {
        let namespace = claim.metadata.namespace.clone().unwrap_or_default();
        let name = claim.metadata.name.clone().unwrap_or_default();
        let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), &namespace);
        let mut claim = claim;
        let changed = |s: &kube::core::Status| s.code == 409;
        if !claim
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == CLAIM_FINALIZER))
        {
            claim
                .metadata
                .finalizers
                .get_or_insert_default()
                .push(CLAIM_FINALIZER.to_string());
            claim = match claims.replace(&name, &writer(), &claim).await {
                Ok(c) => c,
                Err(kube::Error::Api(s)) if changed(&s) => {
                    return Ok(Some(format!("claim {name} changed meanwhile")));
                }
                Err(e) => return Err(e),
            };
        }
        let status = claim.status.get_or_insert_default();
        status.allocation = Some(allocation);
        let reserved = status.reserved_for.get_or_insert_default();
        if !reserved
            .iter()
            .any(|c| consumer_is(c, pod.metadata.uid.as_deref().unwrap_or_default()))
        {
            reserved.push(ResourceClaimConsumerReference {
                api_group: None,
                resource: "pods".into(),
                name: pod.metadata.name.clone().unwrap_or_default(),
                uid: pod.metadata.uid.clone().unwrap_or_default(),
            });
        }
        let written = match claims.replace_status(&name, &writer(), &claim).await {
            Ok(c) => c,
            Err(kube::Error::Api(s)) if changed(&s) => {
                return Ok(Some(format!("claim {name} changed meanwhile")));
            }
            Err(e) => return Err(e),
        };
        self.known().shares.settle(&written, &self.config.driver_name);
        Ok(None)
    }

    /// Writes every claim of a decision, then releases the pod (pinned to `node`, unless the
    /// configuration says otherwise or the pod asks for a resource the placer does not weigh), with
    /// `summary` in its [`PLACEMENT_ANNOTATION`]. A claim written before a later one failed stays
    /// allocated: the next decision finds it so and keeps the pod on its node.
    async fn write_all(
        &self,
        client: &Client,
        pod: &Pod,
        node: &str,
        writes: Vec<(ResourceClaim, AllocationResult)>,
        summary: &str,
    ) -> Result<Option<String>, kube::Error> {
        for (claim, allocation) in writes {
            if let Some(why) = self.write(client, pod, claim, allocation).await? {
                return Ok(Some(why));
            }
        }
        let pin = self.config.pin_to_node
            && pod
                .spec
                .as_ref()
                .is_some_and(|s| nodes::unweighed_request(s).is_none());
        let placement = format!("on node {node}: {summary}");
        self.release(client, pod, pin.then_some(node), Some(&placement))
            .await?;
        Ok(None)
    }

    /// Removes the gate from `pod`, in the same write pinning it to node `pin` when given
    /// ([`nodes::pinned_to`]) and saying where its claims went (`placement`, the
    /// [`PLACEMENT_ANNOTATION`]): kube-scheduler takes it from here.
    async fn release(
        &self,
        client: &Client,
        pod: &Pod,
        pin: Option<&str>,
        placement: Option<&str>,
    ) -> Result<(), kube::Error> {
        let pods: Api<Pod> = Api::namespaced(
            client.clone(),
            pod.metadata.namespace.as_deref().unwrap_or("default"),
        );
        let patch = release_patch(pod, &self.config.scheduling_gate, pin, placement);
        match pods
            .patch(
                pod.metadata.name.as_deref().unwrap_or_default(),
                &PatchParams::default(),
                &Patch::Strategic(patch),
            )
            .await
        {
            Ok(_) => Ok(()),
            // Gone, or another incarnation: nothing to release.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Gives back to kube-scheduler the claims of pods it cannot schedule where gpumem put them
    /// ([`claims_to_give_back`]): the allocation is removed (with the resourceVersion read, so a pod that
    /// reserved the claim meanwhile keeps it), and kube-scheduler allocates the claim itself.
    async fn give_back(&self, scorer: &Scorer, client: &Client) {
        let due: Vec<(String, String, Arc<ResourceClaim>)> = {
            let known = self.known();
            let (driver, gate) = (&self.config.driver_name, &self.config.scheduling_gate);
            known
                .unschedulable
                .values()
                .flat_map(|(pod, seen)| {
                    claims_to_give_back(pod, &known.claims, driver, gate, seen.elapsed())
                        .into_iter()
                        .map(move |key| (pod_key(pod), pod.metadata.uid.clone().unwrap_or_default(), key))
                })
                .filter_map(|(pod, uid, key)| Some((pod, uid, Arc::clone(known.claims.get(&key)?))))
                .collect()
        };
        for (pod, pod_uid, claim) in due {
            let mut claim = (*claim).clone();
            let namespace = claim.metadata.namespace.clone().unwrap_or_default();
            let name = claim.metadata.name.clone().unwrap_or_default();
            let node = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_ref())
                .and_then(|r| r.first())
                .map(|r| r.pool.clone())
                .unwrap_or_default();
            if let Some(status) = claim.status.as_mut() {
                status.allocation = None;
                // The placer's reservation for the pod goes with it (a claim is reserved only while
                // allocated).
                if let Some(reserved) = status.reserved_for.as_mut() {
                    reserved.retain(|c| !consumer_is(c, &pod_uid));
                }
                if status.reserved_for.as_ref().is_some_and(Vec::is_empty) {
                    status.reserved_for = None;
                }
            }
            let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), &namespace);
            match claims.replace_status(&name, &writer(), &claim).await {
                Ok(_) => {
                    scorer.metrics.dra_given_back.inc();
                    tracing::warn!(
                    %pod, claim = %name, %node,
                    "kube-scheduler cannot schedule the pod on the node its claim was placed on (see the \
                     pod's events): the claim is given back, kube-scheduler allocates it itself"
                    )
                }
                // Changed meanwhile (reserved, deallocated, deleted): the next round reads it again.
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
                Err(e) => {
                    tracing::warn!(%pod, claim = %name, "cannot give the claim back: {}", api_failure(e))
                }
            }
        }
    }

    /// Decides for every gated pod, highest priority then oldest first; the writes go on beside the
    /// next decisions (at most [`WRITES_IN_FLIGHT`] at once).
    async fn round(self: &Arc<Self>, scorer: &Arc<Scorer>, client: &Client) {
        let mut pods: Vec<Pod> = {
            let known = self.known();
            known
                .gated
                .iter()
                .filter(|(uid, _)| !known.writing.contains(*uid))
                // A pod that found no room waits until room is freed (or for RECHECK_EVERY: a GPU
                // healthy again shows only in the node cache).
                .filter(|(uid, _)| {
                    known
                        .no_room
                        .get(*uid)
                        .is_none_or(|(freed, at)| *freed != known.room_freed || at.elapsed() >= RECHECK_EVERY)
                })
                .map(|(_, p)| p.clone())
                .collect()
        };
        // Higher priority first (kube-scheduler's queue order): a pod that preempted gets the room it
        // freed before any pod of lower priority is looked at.
        pods.sort_by(|a, b| {
            let at = |p: &Pod| p.metadata.creation_timestamp.as_ref().map(|t| t.0);
            let priority = |p: &Pod| p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
            priority(b)
                .cmp(&priority(a))
                .then_with(|| at(a).cmp(&at(b)))
                .then_with(|| a.metadata.name.cmp(&b.metadata.name))
        });
        for pod in pods {
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            let key = pod_key(&pod);
            let started = std::time::Instant::now();
            let decision = self.decide(scorer, client, &pod).await;
            scorer.decided_on_dra(started);
            match decision {
                Ok(Decision::Done(Outcome::Released(kind, why))) => {
                    scorer
                        .metrics
                        .dra_released
                        .get_or_create(&crate::scorer::metrics::KindLabel { kind })
                        .inc();
                    tracing::info!(pod = %key, kind, "left to kube-scheduler: {why}");
                    self.tell(&pod, EventType::Normal, "LeftToKubeScheduler", &why);
                    self.forget(&uid);
                }
                Ok(Decision::Done(Outcome::Waiting(why))) => self.note(&pod, why, Wait::Brief),
                Ok(Decision::Done(Outcome::NoRoom(why))) => {
                    let mut known = self.known();
                    let freed = known.room_freed;
                    known
                        .no_room
                        .insert(uid.clone(), (freed, std::time::Instant::now()));
                    drop(known);
                    self.note(&pod, why, Wait::NoRoom);
                }
                Ok(Decision::Write {
                    writes,
                    node,
                    summary,
                }) => {
                    let Ok(permit) = Arc::clone(&self.writes).acquire_owned().await else {
                        return;
                    };
                    self.known().writing.insert(uid.clone());
                    let (me, scorer, client) = (Arc::clone(self), Arc::clone(scorer), client.clone());
                    tokio::spawn(async move {
                        let claim_uids: Vec<String> = writes
                            .iter()
                            .map(|(c, _)| c.metadata.uid.clone().unwrap_or_default())
                            .collect();
                        let claims: Vec<String> = writes.iter().map(|(c, _)| claim_key(c)).collect();
                        let outcome = me.write_all(&client, &pod, &node, writes, &summary).await;
                        drop(permit);
                        me.known().writing.remove(&uid);
                        let unassume = |me: &Placer| {
                            let mut known = me.known();
                            for claim_uid in &claim_uids {
                                known.shares.unassume(claim_uid);
                            }
                        };
                        match outcome {
                            Ok(None) => {
                                scorer.placed_on_dra(started);
                                me.mark_placed(&client, &pod, &node);
                                tracing::info!(
                                    pod = %key, %node, claims = ?claims, placement = %summary,
                                    "placed the pod's claims"
                                );
                                me.forget(&uid);
                            }
                            Ok(Some(why)) => {
                                unassume(&me);
                                me.note(&pod, why, Wait::Brief);
                            }
                            Err(e) => {
                                unassume(&me);
                                me.note(&pod, api_failure(e), Wait::Failed);
                            }
                        }
                        me.changed.notify_one();
                    });
                }
                Err(e) => self.note(&pod, api_failure(e), Wait::Failed),
            }
        }
    }

    /// Logs why `pod` waits, once per reason (the same reason again every round would flood the log),
    /// and says so in an Event on it unless the wait is `Wait::Brief`.
    fn note(&self, pod: &Pod, why: String, wait: Wait) {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let key = pod_key(pod);
        let mut known = self.known();
        if known.waiting.get(&uid) != Some(&why) {
            match wait {
                Wait::Failed => {
                    tracing::warn!(pod = %key, "placing failed, will retry: {why}");
                    self.tell(pod, EventType::Warning, "GPUPlacementFailed", &why);
                }
                Wait::NoRoom => {
                    tracing::info!(pod = %key, "waiting: {why}");
                    self.tell(pod, EventType::Normal, "WaitingForGPU", &why);
                    known.marked.insert(uid.clone());
                    let nominated = known.nominated.get(&uid).map(|n| n.node.clone());
                    self.mark_unschedulable(pod, &why, nominated);
                }
                Wait::Brief => tracing::info!(pod = %key, "waiting: {why}"),
            }
            known.waiting.insert(uid, why);
        }
    }

    /// Says on the gated `pod` why it waits, in its condition [`PLACED_CONDITION`] (`False`, reason
    /// `NoRoom`): `kubectl describe pod` shows it beside `PodScheduled=False, SchedulingGated`, and a
    /// GPUClaim's controller reads it to step the claim down (failures only logged). The node whose
    /// room is held for it, if it preempted, goes in `status.nominatedNodeName` (as kube-scheduler's
    /// preemption writes it; cleared when it holds none). The caller records the pod in
    /// `Known::marked` (it holds the lock).
    fn mark_unschedulable(&self, pod: &Pod, why: &str, nominated: Option<String>) {
        if let Some((client, _)) = &self.reporter {
            let mark = Placed {
                placed: false,
                reason: "NoRoom",
                message: why.to_string(),
                nominated: Some(nominated),
            };
            set_placed_condition(client, pod, mark);
        }
    }

    /// Turns [`PLACED_CONDITION`] true on a pod it had marked unplaced (only those: a pod placed at
    /// once carries no such condition, and costs no write), and clears its nomination: its claims
    /// now say where it goes.
    fn mark_placed(&self, client: &Client, pod: &Pod, node: &str) {
        let mark = Placed {
            placed: true,
            reason: "Placed",
            message: format!("its claims are allocated on node {node}"),
            nominated: Some(None),
        };
        self.remark(client, pod, mark);
    }

    /// On a pod it had marked unplaced and now releases to kube-scheduler unplaced: reason
    /// `Released`, so that nobody reads the old `NoRoom` as the pod's state (kube-scheduler's
    /// `PodScheduled` says what comes of it).
    fn mark_released(&self, client: &Client, pod: &Pod, why: &str) {
        let mark = Placed {
            placed: false,
            reason: "Released",
            message: format!("released to kube-scheduler: {why}"),
            nominated: None,
        };
        self.remark(client, pod, mark);
    }

    /// Writes `mark` over the condition of a pod it had marked unplaced; a pod never marked costs
    /// no write.
    fn remark(&self, client: &Client, pod: &Pod, mark: Placed) {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        if self.known().marked.remove(uid) {
            set_placed_condition(client, pod, mark);
        }
    }

    /// An Event on `pod` (failures only logged): what the placer did with it, in `kubectl describe pod`.
    fn tell(&self, pod: &Pod, type_: EventType, reason: &'static str, note: &str) {
        self.tell_ref(kube::Resource::object_ref(pod, &()), type_, reason, note);
    }

    /// An Event on the object `reference`.
    fn tell_ref(&self, reference: ObjectReference, type_: EventType, reason: &'static str, note: &str) {
        let Some((client, reporter)) = self.reporter.clone() else {
            return;
        };
        // A recorder of its own: kube's keeps a series per reason and pod, and would only count a
        // second wait with a new reason under the first one's note.
        let recorder = Recorder::new(client, reporter);
        let mut end = note.len().min(1000);
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        let event = Event {
            type_,
            reason: reason.into(),
            // The Events API takes at most 1 kB of note.
            note: Some(note[..end].to_string()),
            action: "Place".into(),
            secondary: None,
        };
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&event, &reference).await {
                tracing::debug!("event {reason} on pod {:?}: {e}", reference.name);
            }
        });
    }

    /// Drops a pod the placer is done with (its watch event, with the gate gone, follows).
    fn forget(&self, uid: &str) {
        let mut known = self.known();
        known.no_room.remove(uid);
        known.gated.remove(uid);
        known.waiting.remove(uid);
        known.nominated.remove(uid);
    }

    /// Places while this replica leads; returns when it no longer does.
    async fn lead(self: &Arc<Self>, scorer: &Arc<Scorer>, client: &Client) {
        loop {
            self.round(scorer, client).await;
            self.give_back(scorer, client).await;
            tokio::select! {
                () = self.changed.notified() => {}
                () = tokio::time::sleep(RETRY_EVERY) => {}
            }
        }
    }
}

/// Runs the placer for as long as the process runs: this replica places while it holds the Lease.
pub async fn run(scorer: Arc<Scorer>, client: Client, config: DraPlacementConfig, identity: String) {
    let reporter = Reporter {
        controller: "gpumem-placer".into(),
        instance: Some(identity.clone()),
    };
    let placer = Placer::new(config.clone(), Some((client.clone(), reporter)));
    placer.follow(&client);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &config.lease_namespace);
    let election = lease::Election {
        name: config.lease_name.clone(),
        identity,
        duration: Duration::from_secs(15),
        renew_every: Duration::from_secs(5),
    };
    loop {
        lease::acquire(&leases, &election).await;
        scorer.metrics.dra_leading.set(1);
        tokio::select! {
            () = placer.lead(&scorer, &client) => {}
            () = lease::keep(&leases, &election) => {
                tracing::error!("DRA placement: lost the lease, standing by");
            }
        }
        scorer.metrics.dra_leading.set(0);
    }
}

/// What the placer writes in a pod's status.
struct Placed {
    placed: bool,
    reason: &'static str,
    message: String,
    /// `status.nominatedNodeName`: left as it is (`None`), cleared (`Some(None)`) or set.
    nominated: Option<Option<String>>,
}

/// Writes `pod`'s condition [`PLACED_CONDITION`] (a strategic merge of that one condition, on its
/// own task; failures only logged), and its nomination. The UID keeps a pod of the same name made
/// meanwhile untouched.
fn set_placed_condition(client: &Client, pod: &Pod, mark: Placed) {
    let pods: Api<Pod> = Api::namespaced(
        client.clone(),
        pod.metadata.namespace.as_deref().unwrap_or("default"),
    );
    let name = pod.metadata.name.clone().unwrap_or_default();
    let patch = placed_patch(
        pod.metadata.uid.as_deref(),
        mark,
        k8s_openapi::jiff::Timestamp::now(),
    );
    tokio::spawn(async move {
        if let Err(e) = pods
            .patch_status(&name, &PatchParams::default(), &Patch::Strategic(patch))
            .await
        {
            tracing::debug!("condition {PLACED_CONDITION} of pod {name}: {e}");
        }
    });
}

/// The strategic merge patch that removes `gate` from `pod`, pins it to node `pin` when given and
/// writes `placement` as its [`PLACEMENT_ANNOTATION`] when given.
fn release_patch(pod: &Pod, gate: &str, pin: Option<&str>, placement: Option<&str>) -> serde_json::Value {
    // A strategic-merge delete of the one gate: other gates stay, and the UID precondition keeps a
    // pod of the same name made meanwhile untouched.
    let mut patch = serde_json::json!({
        "metadata": {"uid": pod.metadata.uid},
        "spec": {"schedulingGates": [{"name": gate, "$patch": "delete"}]},
    });
    if let Some(placement) = placement {
        patch["metadata"]["annotations"] = serde_json::json!({PLACEMENT_ANNOTATION: placement});
    }
    if let (Some(node), Some(spec)) = (pin, pod.spec.as_ref()) {
        // The terms are an atomic list: the patch carries all of them.
        patch["spec"]["affinity"] = serde_json::json!({"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": nodes::pinned_to(spec, node),
        }});
    }
    patch
}

/// The strategic merge patch of `mark` on the pod of `uid` (a null `nominatedNodeName` removes it;
/// the message is cut to 2000 bytes).
fn placed_patch(uid: Option<&str>, mark: Placed, now: k8s_openapi::jiff::Timestamp) -> serde_json::Value {
    let mut end = mark.message.len().min(2000);
    while !mark.message.is_char_boundary(end) {
        end -= 1;
    }
    let message = &mark.message[..end];
    let mut patch = serde_json::json!({
        "metadata": {"uid": uid},
        "status": {"conditions": [{
            "type": PLACED_CONDITION, "status": if mark.placed { "True" } else { "False" },
            "reason": mark.reason, "message": message, "lastTransitionTime": now,
        }]},
    });
    if let Some(nominated) = mark.nominated {
        patch["status"]["nominatedNodeName"] = serde_json::json!(nominated);
    }
    patch
}

/// Marks the holders that a PodDisruptionBudget protects: one that allows no disruption now and
/// selects the pod (`records` has each holder's labels). The Eviction API has the last word.
async fn protect(
    client: &Client,
    nodes: &mut [(usize, Vec<Holder>)],
    records: &HashMap<String, Arc<PodRecord>>,
) -> Result<(), String> {
    let budgets = Api::<PodDisruptionBudget>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|e| format!("listing PodDisruptionBudgets: {}", api_failure(e)))?;
    let closed: Vec<&PodDisruptionBudget> = budgets
        .items
        .iter()
        .filter(|b| b.status.as_ref().and_then(|s| s.disruptions_allowed).unwrap_or(0) <= 0)
        .collect();
    if closed.is_empty() {
        return Ok(());
    }
    for holder in nodes.iter_mut().flat_map(|(_, h)| h.iter_mut()) {
        let Some(record) = records.get(&holder.uid) else {
            continue;
        };
        let labels = record.labels();
        holder.protected = closed.iter().any(|b| {
            b.metadata.namespace.as_deref() == Some(record.namespace())
                && b.spec
                    .as_ref()
                    .and_then(|s| s.selector.as_ref())
                    .is_some_and(|sel| selector_matches(sel, &labels))
        });
    }
    Ok(())
}

/// Evicts `victim` through the Eviction API (its PodDisruptionBudgets are checked there, and it has
/// its grace period); one already gone counts as evicted.
async fn evict(client: &Client, victim: &Holder) -> Result<(), String> {
    let (namespace, name) = victim.key.split_once('/').unwrap_or(("default", &victim.key));
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let params = EvictParams {
        delete_options: Some(DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(victim.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        }),
        ..EvictParams::default()
    };
    match pods.evict(name, &params).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 429 => Err(format!(
            "its PodDisruptionBudget allows no disruption now ({})",
            s.message
        )),
        Err(e) => Err(api_failure(e)),
    }
}

/// A reference to the pod `holder` is, for an Event.
fn pod_reference(holder: &Holder) -> ObjectReference {
    let (namespace, name) = holder.key.split_once('/').unwrap_or(("default", &holder.key));
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: Some(holder.uid.clone()),
        ..ObjectReference::default()
    }
}

/// What `need` asks of a node that counts memory in `unit` MiB.
fn demand_of(need: Need, unit: u64) -> Demand {
    match need {
        Need::Mib(mib) => Demand::Memory {
            units: mib.div_ceil(unit),
        },
        Need::Whole(count) => Demand::Whole { count },
    }
}

/// Counts `pod` (once) into the scorer's learned mix, asking `demand`, restricted to the GPU models
/// `models` names (evaluated only for a pod not counted yet: it reads every candidate's selection).
fn learn(
    scorer: &Scorer,
    pod: &Pod,
    demand: Demand,
    need_mib: u64,
    models: impl FnOnce() -> Option<BTreeSet<String>>,
) {
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    if uid.is_empty() || scorer.workload.counted(uid) {
        return;
    }
    if let Ok(mut d) = scorer.demand_of(pod, demand) {
        if let Some(taken) = models() {
            d.models = Some(taken.iter().map(|n| n.to_ascii_lowercase()).collect());
        }
        scorer.learn(&d, need_mib);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placer::claims::fixtures::{alloc, claim, memory};
    use crate::scorer::config::PLACEMENT_GATE;
    use crate::scorer::state::GpuSnapshot;
    use k8s_openapi::api::resource::v1::{ResourceClaimConsumerReference, ResourceClaimStatus};

    #[test]
    fn the_placed_mark_sets_clears_or_leaves_the_nomination() {
        let mark = |nominated: Option<Option<&str>>| Placed {
            placed: false,
            reason: "NoRoom",
            message: "no room for claim ns/c".into(),
            nominated: nominated.map(|n| n.map(str::to_string)),
        };
        let now = k8s_openapi::jiff::Timestamp::UNIX_EPOCH;
        let patch = placed_patch(Some("u1"), mark(Some(Some("n1"))), now);
        assert_eq!(patch["metadata"]["uid"], "u1");
        assert_eq!(patch["status"]["nominatedNodeName"], "n1");
        let condition = &patch["status"]["conditions"][0];
        assert_eq!(
            (&condition["type"], &condition["status"], &condition["reason"]),
            (
                &serde_json::json!(PLACED_CONDITION),
                &serde_json::json!("False"),
                &serde_json::json!("NoRoom")
            )
        );
        // Cleared: an explicit null, which a strategic merge reads as "remove".
        let patch = placed_patch(Some("u1"), mark(Some(None)), now);
        assert!(
            patch["status"]
                .as_object()
                .is_some_and(|s| s.get("nominatedNodeName") == Some(&serde_json::Value::Null))
        );
        // Left alone: not in the patch at all.
        let patch = placed_patch(Some("u1"), mark(None), now);
        assert!(patch["status"].get("nominatedNodeName").is_none());
    }

    #[test]
    fn the_release_removes_only_the_gate_and_says_where_the_claims_went() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [], "schedulingGates": [{"name": PLACEMENT_GATE}, {"name": "other"}]},
        }))
        .expect("a pod");
        let placed = release_patch(
            &pod,
            PLACEMENT_GATE,
            Some("n1"),
            Some("on node n1: c: gpu-2 3000Mi"),
        );
        assert_eq!(placed["metadata"]["uid"], "u1");
        assert_eq!(
            placed["spec"]["schedulingGates"],
            serde_json::json!([{"name": PLACEMENT_GATE, "$patch": "delete"}])
        );
        assert_eq!(
            placed["metadata"]["annotations"][PLACEMENT_ANNOTATION],
            "on node n1: c: gpu-2 3000Mi"
        );
        let terms = &placed["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        assert_eq!(terms[0]["matchFields"][0]["values"], serde_json::json!(["n1"]));
        // Released unplaced: the gate only.
        let unplaced = release_patch(&pod, PLACEMENT_GATE, None, None);
        assert!(unplaced["metadata"].get("annotations").is_none());
        assert!(unplaced["spec"].get("affinity").is_none());
    }

    #[test]
    fn the_room_held_for_a_preemptor_is_kept_from_pods_of_no_higher_priority_until_its_victims_end() {
        let nomination = |node: &str, gpus: Vec<u32>, priority: i32| Nomination {
            node: node.into(),
            gpus,
            priority,
            victims: vec!["ns/victim".into()],
        };
        let nominated: HashMap<String, Nomination> = [
            ("online".to_string(), nomination("n1", vec![2], 1000)),
            ("other".to_string(), nomination("n2", vec![0, 1], 10)),
        ]
        .into();
        assert_eq!(
            held_from(&nominated, "n1", ("online", 1000)),
            Vec::<u32>::new(),
            "its own room"
        );
        assert_eq!(
            held_from(&nominated, "n1", ("later", 1000)),
            vec![2],
            "equal priority waits"
        );
        assert_eq!(held_from(&nominated, "n1", ("low", 5)), vec![2]);
        assert_eq!(
            held_from(&nominated, "n1", ("urgent", 2000)),
            Vec::<u32>::new(),
            "higher goes first"
        );
        assert_eq!(
            held_from(&nominated, "n3", ("low", 5)),
            Vec::<u32>::new(),
            "another node"
        );

        let n = &nominated["online"];
        let share = AllocatedShare {
            node: "n1".into(),
            index: 2,
            mib: Some(8000),
            owner: "ns/victim".into(),
        };
        let mut report = NodeSnapshot::with_gpus("n1", 1, vec![GpuSnapshot::for_tests(2, "T4", 15360, 8000)]);
        assert_eq!(
            n.victims_left(&[&share], None),
            vec!["ns/victim"],
            "its claim still allocated"
        );
        report.gpus_mut()[0].pods = vec!["ns/victim".into()];
        assert_eq!(
            n.victims_left(&[], Some(&report)),
            vec!["ns/victim"],
            "its agent still reports it"
        );
        report.gpus_mut()[0].pods.clear();
        assert!(
            n.victims_left(&[], Some(&report)).is_empty(),
            "gone from both: its room is free"
        );
    }

    #[test]
    fn an_older_event_does_not_undo_a_newer_allocation() {
        let mut c = claim(memory("5000Mi"));
        let a = alloc(&c, "node-1", &[(2, 5000)]);
        let mut shares = Shares::default();
        let count = |s: &Shares| s.all().count();
        let uid = c.metadata.uid.clone().unwrap_or_default();
        // Decided: counted before any write.
        shares.assume(&uid, vec![]);
        shares.assume(
            &uid,
            allocated_shares(
                &ResourceClaim {
                    status: Some(ResourceClaimStatus {
                        allocation: Some(a.clone()),
                        ..Default::default()
                    }),
                    ..c.clone()
                },
                "gpumem.io",
            ),
        );
        assert_eq!(count(&shares), 1);
        // The finalizer update's event (no allocation yet) arrives while the status is written.
        c.metadata.resource_version = Some("100".into());
        shares.observe(&c, "gpumem.io");
        assert_eq!(count(&shares), 1, "a write in flight stays counted");
        shares.relist();
        assert_eq!(count(&shares), 1, "and survives a relist");
        // The status write answers (version 101); a late event of version 100 changes nothing.
        let mut written = c.clone();
        written.metadata.resource_version = Some("101".into());
        written.status = Some(ResourceClaimStatus {
            allocation: Some(a),
            ..Default::default()
        });
        shares.settle(&written, "gpumem.io");
        shares.observe(&c, "gpumem.io");
        assert_eq!(count(&shares), 1);
        // Deallocated later (version 102): gone.
        let mut freed = c.clone();
        freed.metadata.resource_version = Some("102".into());
        shares.observe(&freed, "gpumem.io");
        assert_eq!(count(&shares), 0);
        // A failed write gives back what it assumed, and nothing else.
        shares.assume("other", vec![]);
        shares.unassume("other");
        shares.observe(&written, "gpumem.io");
        shares.unassume(&uid);
        assert_eq!(
            count(&shares),
            0,
            "version 101 is older than the deallocation seen"
        );
    }

    #[test]
    fn allocated_claims_the_agent_does_not_show_yet_take_their_room() {
        let gpus = vec![
            GpuSnapshot::for_tests(0, "Tesla T4", 15360, 0),
            GpuSnapshot::for_tests(1, "Tesla T4", 15360, 0),
        ];
        let mut node = NodeSnapshot::with_gpus("n", 1, gpus);
        let share = |index, mib: Option<u64>, owner: &str| AllocatedShare {
            node: "n".into(),
            index,
            mib,
            owner: owner.into(),
        };
        subtract_unshown(&mut node, &[share(0, Some(5000), "ns/a"), share(1, None, "ns/b")]);
        assert_eq!(node.gpus()[0].allocated_mib, 5000);
        assert!(node.gpus()[1].whole);
        // Once the agent lists the owner on the GPU, its report already counts the share.
        let mut shown = NodeSnapshot::with_gpus(
            "n",
            1,
            vec![GpuSnapshot {
                pods: vec!["ns/a".into()],
                ..GpuSnapshot::for_tests(0, "Tesla T4", 15360, 5000)
            }],
        );
        subtract_unshown(&mut shown, &[share(0, Some(5000), "ns/a")]);
        assert_eq!(shown.gpus()[0].allocated_mib, 5000);
    }

    #[test]
    fn a_node_with_several_slices_has_their_devices_joined_and_kept_until_one_changes() {
        let device = |name: &str| Device {
            name: name.into(),
            ..Default::default()
        };
        let mut known = Known::default();
        let slice = |known: &mut Known, name: &str, node: &str, devices: &[&str]| {
            let devices = Arc::new(devices.iter().map(|d| device(d)).collect());
            known.slices.insert(name.into(), (node.into(), devices));
            known.join_devices(node);
        };
        slice(&mut known, "n-b", "n", &["gpu-2"]);
        slice(&mut known, "n-a", "n", &["gpu-0", "gpu-1"]);
        let names = |known: &Known, node: &str| -> Vec<String> {
            known
                .node_devices
                .get(node)
                .map_or(Vec::new(), |d| d.iter().map(|d| d.name.clone()).collect())
        };
        assert_eq!(
            names(&known, "n"),
            ["gpu-0", "gpu-1", "gpu-2"],
            "in the slices' name order"
        );
        let joined = Arc::clone(&known.node_devices["n"]);
        slice(&mut known, "m-a", "m", &["gpu-0"]);
        assert!(
            Arc::ptr_eq(&joined, &known.node_devices["n"]),
            "another node's slice: n's kept"
        );
        known.slices.remove("n-a");
        known.join_devices("n");
        assert_eq!(names(&known, "n"), ["gpu-2"]);
        known.slices.remove("n-b");
        known.join_devices("n");
        assert!(!known.node_devices.contains_key("n"), "no slice, no devices");
    }

    #[test]
    fn a_node_counted_once_is_counted_again_only_when_its_report_or_its_shares_change() {
        let report = |used| {
            Arc::new(NodeSnapshot::with_gpus(
                "n",
                1,
                vec![GpuSnapshot::for_tests(0, "Tesla T4", 15360, used)],
            ))
        };
        let share = |node: &str, owner: &str| AllocatedShare {
            node: node.into(),
            index: 0,
            mib: Some(5000),
            owner: owner.into(),
        };
        let mut known = Known::default();
        let first = report(0);
        let idle = known.counted("n", Arc::clone(&first));
        assert!(Arc::ptr_eq(&idle, &first), "no shares: the report itself");
        known.shares.assume("a", vec![share("n", "ns/a")]);
        let (changed, on_n) = known.shares.on_node("n");
        assert_eq!((on_n.len(), known.shares.on_node("m").0), (1, 0));
        let counted = known.counted("n", Arc::clone(&first));
        assert_eq!(
            counted.gpus()[0].allocated_mib,
            5000,
            "the share not shown yet is taken"
        );
        assert!(
            Arc::ptr_eq(&counted, &known.counted("n", Arc::clone(&first))),
            "reused"
        );
        // A share on another node changes nothing here.
        known.shares.assume("b", vec![share("m", "ns/b")]);
        assert_eq!(known.shares.on_node("n").0, changed);
        assert!(Arc::ptr_eq(&counted, &known.counted("n", Arc::clone(&first))));
        // A new report: counted again from it.
        let newer = report(1000);
        assert_eq!(known.counted("n", newer).gpus()[0].allocated_mib, 6000);
        // The share gone (the write failed): back to the report alone.
        known.shares.unassume("a");
        assert!(known.shares.on_node("n").0 > changed);
        assert_eq!(known.counted("n", Arc::clone(&first)).gpus()[0].allocated_mib, 0);
        known.shares.relist();
        assert_eq!(
            known.shares.on_node("m").1.len(),
            1,
            "a write in flight outlives a relist"
        );
    }

    #[test]
    fn claims_placed_where_the_pod_cannot_go_are_given_back_after_a_while() {
        let mut placed = claim(memory("5000Mi"));
        placed.status = Some(ResourceClaimStatus {
            allocation: Some(alloc(&placed, "node-1", &[(2, 5000)])),
            ..Default::default()
        });
        assert!(placed_by_gpumem(&placed, "gpumem.io"));
        assert!(
            !placed_by_gpumem(&placed, "other.driver"),
            "no result of that driver"
        );
        let mut by_kube = placed.clone();
        if let Some(r) = by_kube
            .status
            .as_mut()
            .and_then(|s| s.allocation.as_mut())
            .and_then(|a| a.devices.as_mut())
            .and_then(|d| d.results.as_mut())
        {
            r[0].share_id = Some("a-share-kube-scheduler-made".into());
        }
        assert!(!placed_by_gpumem(&by_kube, "gpumem.io"));

        let since = "2026-12-03T10:00:00Z";
        let pod = |scheduled: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "pod-uid"},
                "spec": {"containers": [], "resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}]},
                "status": {"conditions": [scheduled]}
            }))
            .unwrap_or_default()
        };
        let stuck = pod(serde_json::json!({
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "lastTransitionTime": since
        }));
        let claims = HashMap::from([("ns/c".to_string(), Arc::new(placed.clone()))]);
        let give_back = |p: &Pod, claims: &HashMap<String, Arc<ResourceClaim>>, secs| {
            claims_to_give_back(p, claims, "gpumem.io", PLACEMENT_GATE, Duration::from_secs(secs))
        };
        assert!(is_unschedulable(&stuck));
        assert!(give_back(&stuck, &claims, 29).is_empty(), "not yet");
        assert_eq!(give_back(&stuck, &claims, 30), vec!["ns/c".to_string()]);

        let kube = HashMap::from([("ns/c".to_string(), Arc::new(by_kube))]);
        assert!(give_back(&stuck, &kube, 3600).is_empty(), "kube-scheduler's own");
        let mut reserved = placed.clone();
        if let Some(s) = reserved.status.as_mut() {
            s.reserved_for = Some(vec![ResourceClaimConsumerReference {
                resource: "pods".into(),
                name: "p".into(),
                uid: "pod-uid".into(),
                ..Default::default()
            }]);
        }
        let reserved_for_it = HashMap::from([("ns/c".to_string(), Arc::new(reserved.clone()))]);
        assert_eq!(
            give_back(&stuck, &reserved_for_it, 30),
            vec!["ns/c".to_string()],
            "the placer's own reservation for the stuck pod"
        );
        if let Some(r) = reserved.status.as_mut().and_then(|s| s.reserved_for.as_mut()) {
            r.push(ResourceClaimConsumerReference {
                resource: "pods".into(),
                name: "other".into(),
                uid: "other-uid".into(),
                ..Default::default()
            });
        }
        let reserved = HashMap::from([("ns/c".to_string(), Arc::new(reserved))]);
        assert!(
            give_back(&stuck, &reserved, 3600).is_empty(),
            "another pod holds it"
        );
        let mut gated = stuck.clone();
        if let Some(spec) = gated.spec.as_mut() {
            spec.scheduling_gates = Some(vec![k8s_openapi::api::core::v1::PodSchedulingGate {
                name: PLACEMENT_GATE.into(),
            }]);
        }
        assert!(
            give_back(&gated, &claims, 3600).is_empty(),
            "still gpumem's to place"
        );
        let waiting = pod(serde_json::json!({
            "type": "PodScheduled", "status": "False", "reason": "SchedulingGated", "lastTransitionTime": since
        }));
        assert!(!is_unschedulable(&waiting));
        let mut bound = stuck.clone();
        if let Some(spec) = bound.spec.as_mut() {
            spec.node_name = Some("node-1".into());
        }
        assert!(!is_unschedulable(&bound));
    }
}
