//! Placement on the DRA path: gpumem, not kube-scheduler's first fit, chooses the GPU for a claim.
//!
//! kube-scheduler 1.36 gives a claim the first device with room, in slice order, on whatever node its
//! own scoring prefers (docs/simulate.md, "KubeDRA"); it honours a claim that is already allocated,
//! and only checks that the pod can go to the allocation's node. So the scorer allocates first: the
//! chart's MutatingAdmissionPolicy adds the scheduling gate [`PLACEMENT_GATE`] to every pod with
//! ResourceClaims, which keeps kube-scheduler away from it; the one replica that holds the Lease
//! reads the pod's claims and, for a claim of gpumem's DeviceClasses, ranks the DRA nodes with the
//! extender's own ranking ([`super::decide`], the policy `gpumem simulate` measures), writes the
//! allocation (the node, the device, a share of its `memory`), then removes the gate. kube-scheduler
//! then only binds the pod to that node.
//!
//! No GPU is promised twice: one replica places, one pod at a time, against every allocated claim
//! of the driver it watches (its own, as soon as written, and any kube-scheduler made), plus what the
//! agents report. Claims in a form the scorer does not place (CEL selectors, constraints, several
//! requests) are left to kube-scheduler: the gate is removed and it allocates them as usual.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult, DeviceRequestAllocationResult,
    ResourceClaim, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client};

use super::Scorer;
use super::config::DraPlacementConfig;
use super::ledger::{self, Reservation};
use super::state::{self, Demand, NodeSnapshot};
use crate::lease;
use crate::node::slice::{MEMORY_CAPACITY, claim_holder, device_index, device_name, mib_quantity};
use crate::quantity::Quantity;

/// The scheduling gate that keeps a pod from kube-scheduler until its claim is placed.
pub const PLACEMENT_GATE: &str = "gpumem.io/placement";
/// The finalizer kube-scheduler puts on a claim it allocates: with it, the resource claim controller
/// clears the allocation once no pod uses the claim, as for kube-scheduler's own.
pub const CLAIM_FINALIZER: &str = "resource.kubernetes.io/delete-protection";
/// How often the gated pods are looked at again without an event (room freed elsewhere, a claim the
/// controller had not made yet).
const RETRY_EVERY: Duration = Duration::from_secs(2);

/// What one request of a claim asks of gpumem's GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// This much memory of one GPU.
    Mib(u64),
    /// This many whole GPUs.
    Whole(u32),
}

/// What the scorer does with one of a pod's claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimAsk {
    /// No request names one of gpumem's DeviceClasses.
    NotOurs,
    /// Allocated already (shared by several pods, or allocated by someone else).
    Allocated,
    /// gpumem places it: its request `request` asks `need`.
    Place { request: String, need: Need },
    /// gpumem's, in a form the scorer does not place (why): kube-scheduler allocates it.
    Unsupported(String),
}

/// Reads what `claim` asks, for the DeviceClasses `classes`.
pub fn claim_ask(claim: &ResourceClaim, classes: &[String]) -> ClaimAsk {
    if claim.status.as_ref().is_some_and(|s| s.allocation.is_some()) {
        return ClaimAsk::Allocated;
    }
    let devices = claim.spec.devices.as_ref();
    let requests = devices.and_then(|d| d.requests.as_deref()).unwrap_or_default();
    let ours = |class: &str| classes.iter().any(|c| c == class);
    let names_ours = |r: &k8s_openapi::api::resource::v1::DeviceRequest| {
        r.exactly.as_ref().is_some_and(|e| ours(&e.device_class_name))
            || r.first_available
                .iter()
                .flatten()
                .any(|s| ours(&s.device_class_name))
    };
    if !requests.iter().any(names_ours) {
        return ClaimAsk::NotOurs;
    }
    let unsupported = |why: &str| ClaimAsk::Unsupported(why.to_string());
    if requests.len() > 1 {
        return unsupported("it has more than one request");
    }
    if devices.is_some_and(|d| d.constraints.as_ref().is_some_and(|c| !c.is_empty())) {
        return unsupported("it has constraints");
    }
    let request = &requests[0];
    let Some(exactly) = &request.exactly else {
        return unsupported("its request is a prioritized list (firstAvailable)");
    };
    if exactly.selectors.as_ref().is_some_and(|s| !s.is_empty()) {
        return unsupported("its request has CEL selectors");
    }
    if exactly.admin_access == Some(true) {
        return unsupported("its request asks for admin access");
    }
    match exactly.allocation_mode.as_deref() {
        None | Some("ExactCount") => {}
        Some(mode) => return unsupported(&format!("its request's allocationMode is {mode}")),
    }
    let count = exactly.count.unwrap_or(1);
    let Some(count) = u32::try_from(count)
        .ok()
        .filter(|c| (1..=crate::alloc::MAX_GPUS_PER_NODE as u32).contains(c))
    else {
        return unsupported(&format!("its request's count is {count}"));
    };
    let capacity = exactly.capacity.as_ref().and_then(|c| c.requests.as_ref());
    if let Some(other) = capacity.and_then(|c| c.keys().find(|k| *k != MEMORY_CAPACITY)) {
        return unsupported(&format!("it asks for capacity {other:?}"));
    }
    let need = match capacity.and_then(|c| c.get(MEMORY_CAPACITY)) {
        None => Need::Whole(count),
        Some(_) if count > 1 => return unsupported("it asks for memory of several GPUs"),
        Some(q) => match Quantity::parse(&q.0).and_then(|q| q.mib_ceil()) {
            Ok(mib) if mib > 0 => Need::Mib(mib),
            Ok(_) => return unsupported("it asks for no memory"),
            Err(e) => return unsupported(&format!("its memory {:?}: {e}", q.0)),
        },
    };
    ClaimAsk::Place {
        request: request.name.clone(),
        need,
    }
}

/// A claim's allocation on one of the driver's devices, as the placer accounts for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatedShare {
    pub node: String,
    /// The GPU's NVML index.
    pub index: u32,
    /// MiB consumed; `None` = the whole GPU.
    pub mib: Option<u64>,
    /// Who holds it, as the agent's usage annotation will list it once prepared.
    pub owner: String,
}

/// The shares `claim` holds on `driver`'s devices (none when it is not allocated).
pub fn allocated_shares(claim: &ResourceClaim, driver: &str) -> Vec<AllocatedShare> {
    let Some(status) = claim.status.as_ref() else {
        return Vec::new();
    };
    let Some(results) = status
        .allocation
        .as_ref()
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
    else {
        return Vec::new();
    };
    // The key the agent's usage annotation gives the claim once prepared.
    let owner = claim_holder(claim);
    results
        .iter()
        .filter(|r| r.driver == driver)
        .filter_map(|r| {
            let index = device_index(&r.device)?;
            let mib = r
                .consumed_capacity
                .as_ref()
                .and_then(|c| c.get(MEMORY_CAPACITY))
                .and_then(|q| Quantity::parse(&q.0).and_then(|q| q.mib_ceil()).ok());
            Some(AllocatedShare {
                node: r.pool.clone(),
                index,
                mib,
                owner: owner.clone(),
            })
        })
        .collect()
}

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

/// The memory of a whole GPU as the agent offers it: its whole units.
fn offered_mib(memory_mib: u64, unit_mib: u64) -> u64 {
    let unit = unit_mib.max(1);
    crate::plugin::devices::units_per_gpu(memory_mib, unit) * unit
}

/// The allocation the scorer writes into `claim`: request `request` gets the GPUs `chosen` (NVML index,
/// MiB) on `node`, each as a share of its `memory` whose ID is the claim's UID (unique per device, and
/// the same on a retry), with the claim's configuration, and a node selector for `node`.
pub fn allocation_result(
    claim: &ResourceClaim,
    driver: &str,
    request: &str,
    node: &str,
    chosen: &[(u32, u64)],
) -> AllocationResult {
    let results = chosen
        .iter()
        .map(|&(index, mib)| DeviceRequestAllocationResult {
            request: request.to_string(),
            driver: driver.to_string(),
            pool: node.to_string(),
            device: device_name(index),
            share_id: claim.metadata.uid.clone(),
            consumed_capacity: Some(BTreeMap::from([(MEMORY_CAPACITY.to_string(), mib_quantity(mib))])),
            ..Default::default()
        })
        .collect();
    let config: Vec<DeviceAllocationConfiguration> = claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.config.as_ref())
        .into_iter()
        .flatten()
        .map(|c| DeviceAllocationConfiguration {
            opaque: c.opaque.clone(),
            requests: c.requests.clone(),
            source: "FromClaim".into(),
        })
        .collect();
    AllocationResult {
        allocation_timestamp: Some(Time(k8s_openapi::jiff::Timestamp::now())),
        devices: Some(DeviceAllocationResult {
            config: (!config.is_empty()).then_some(config),
            results: Some(results),
        }),
        node_selector: Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_fields: Some(vec![NodeSelectorRequirement {
                    key: "metadata.name".into(),
                    operator: "In".into(),
                    values: Some(vec![node.to_string()]),
                }]),
                ..Default::default()
            }],
        }),
    }
}

/// Whether `pod` still carries `gate`.
pub fn is_gated(pod: &Pod, gate: &str) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == gate))
}

/// How long kube-scheduler may find a pod unschedulable, with a claim gpumem placed, before the claim is
/// given back to it: the node gpumem chose does not take the pod (its selector, affinity, a taint, the
/// node's CPU), and waiting on for that node could be for good.
pub const GIVE_BACK_AFTER: Duration = Duration::from_secs(30);

/// Whether gpumem wrote `claim`'s allocation: each of `driver`'s results carries the claim's UID as its
/// share ID ([`allocation_result`]); kube-scheduler's allocator makes up a fresh one.
pub fn placed_by_gpumem(claim: &ResourceClaim, driver: &str) -> bool {
    let uid = claim.metadata.uid.as_deref();
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref());
    let mine: Vec<_> = results
        .into_iter()
        .flatten()
        .filter(|r| r.driver == driver)
        .collect();
    uid.is_some() && !mine.is_empty() && mine.iter().all(|r| r.share_id.as_deref() == uid)
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

/// The claims of `pod` (by `namespace/name`) to give back to kube-scheduler, the pod having been seen
/// unschedulable for `waited`: those gpumem placed and no pod has reserved yet, once `waited` reaches
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
    claim_names(pod)
        .into_iter()
        .flatten()
        .map(|name| format!("{namespace}/{name}"))
        .filter(|key| {
            claims.get(key).is_some_and(|c| {
                let reserved = c
                    .status
                    .as_ref()
                    .and_then(|s| s.reserved_for.as_ref())
                    .is_some_and(|r| !r.is_empty());
                !reserved && placed_by_gpumem(c, driver)
            })
        })
        .collect()
}

/// The names of `pod`'s ResourceClaims, in its order; `None` while one made from a template is not
/// created yet (the resource claim controller records it in the pod's status).
pub fn claim_names(pod: &Pod) -> Option<Vec<String>> {
    let entries = pod.spec.as_ref().and_then(|s| s.resource_claims.as_ref());
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref());
    entries
        .into_iter()
        .flatten()
        .map(|e| match &e.resource_claim_name {
            Some(name) => Some(name.clone()),
            None => statuses?
                .iter()
                .find(|s| s.name == e.name)?
                .resource_claim_name
                .clone(),
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
        self.by_claim
            .insert(uid, (version, allocated_shares(claim, driver)));
    }

    /// The write of a claim's allocation answered with `written`: it replaces what was assumed.
    pub fn settle(&mut self, written: &ResourceClaim, driver: &str) {
        self.unassume(written.metadata.uid.as_deref().unwrap_or_default());
        self.observe(written, driver);
    }

    /// The claim is gone.
    pub fn forget(&mut self, uid: &str) {
        self.by_claim.remove(uid);
    }

    /// Counts `shares` for claim `uid` while its allocation is being written.
    pub fn assume(&mut self, uid: &str, shares: Vec<AllocatedShare>) {
        self.by_claim.insert(uid.to_string(), (u64::MAX, shares));
    }

    /// The write of `uid`'s allocation failed: what the watch says next is the truth.
    pub fn unassume(&mut self, uid: &str) {
        if self.by_claim.get(uid).is_some_and(|(v, _)| *v == u64::MAX) {
            self.by_claim.remove(uid);
        }
    }

    /// A relist begins: forget what it will tell again, keep the writes in flight.
    pub fn relist(&mut self) {
        self.by_claim.retain(|_, (v, _)| *v == u64::MAX);
    }

    pub fn all(&self) -> impl Iterator<Item = &AllocatedShare> {
        self.by_claim.values().flat_map(|(_, s)| s)
    }
}

/// What the placer knows between decisions.
#[derive(Default)]
struct Known {
    /// Nodes with a ResourceSlice of the driver: the DRA nodes.
    slices: HashMap<String, HashSet<String>>,
    shares: Shares,
    /// Every claim as the watch last showed it, by `namespace/name`: a decision reads a pod's claims
    /// here, not from the API server (a stale copy only costs a conflict on the write, which is retried).
    claims: HashMap<String, Arc<ResourceClaim>>,
    /// Counts the events that may have freed room (a claim deallocated or deleted, a slice changed).
    room_freed: u64,
    /// Pods that found no room, with `room_freed` and the time then.
    no_room: HashMap<String, (u64, std::time::Instant)>,
    /// Pods whose claim is being written (by pod UID): not looked at again meanwhile.
    writing: HashSet<String>,
    /// Gated pods by UID.
    gated: HashMap<String, Pod>,
    /// Released pods kube-scheduler found unschedulable, by UID, and since when this replica has seen
    /// them so: their claims may have to be given back ([`claims_to_give_back`]).
    unschedulable: HashMap<String, (Pod, std::time::Instant)>,
    /// The last reason each pod was not placed, so an unchanged one is not logged again.
    waiting: HashMap<String, String>,
}

/// The DRA placer: the caches it reads and the one replica's loop.
pub struct Placer {
    config: DraPlacementConfig,
    known: Mutex<Known>,
    changed: tokio::sync::Notify,
    writes: Arc<tokio::sync::Semaphore>,
}

/// Where a claim goes.
struct Choice {
    node: String,
    /// NVML index and the MiB the claim consumes there, per GPU.
    gpus: Vec<(u32, u64)>,
    /// The request as ranked (what the learned mix counts).
    demand: state::PodDemand,
}

/// What became of one gated pod that is not placed now.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// Nothing for gpumem to place: the gate is gone, kube-scheduler goes on alone (why).
    Released(String),
    /// Stays gated, looked at again later (why).
    Waiting(String),
    /// Stays gated until room is freed somewhere (why).
    NoRoom(String),
}

/// What the placer decided for one gated pod.
enum Decision {
    Done(Outcome),
    /// Allocate `claim` so, on `node` (already counted there), then release the pod.
    Write {
        claim: Box<ResourceClaim>,
        allocation: Box<AllocationResult>,
        node: String,
    },
}

/// How often a pod that found no room is looked at again even if no claim freed any.
const RECHECK_EVERY: Duration = Duration::from_secs(10);

/// Allocations written at once, each a few requests to the API server: decisions stay one at a
/// time, the round trips overlap.
const WRITES_IN_FLIGHT: usize = 16;

fn claim_key(claim: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

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

impl Placer {
    pub fn new(config: DraPlacementConfig) -> Arc<Placer> {
        Arc::new(Placer {
            config,
            known: Mutex::new(Known::default()),
            changed: tokio::sync::Notify::new(),
            writes: Arc::new(tokio::sync::Semaphore::new(WRITES_IN_FLIGHT)),
        })
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the watches of slices, claims and unscheduled pods.
    fn follow(self: &Arc<Self>, client: &Client) {
        let me = Arc::clone(self);
        super::cache::follow::<ResourceSlice>(
            client.clone(),
            watcher::Config::default(),
            "resourceslice",
            move |e| me.on_slice(e),
            || (),
        );
        let me = Arc::clone(self);
        super::cache::follow::<ResourceClaim>(
            client.clone(),
            watcher::Config::default(),
            "resourceclaim",
            move |e| me.on_claim(e),
            || (),
        );
        let me = Arc::clone(self);
        let unscheduled = watcher::Config::default().fields("spec.nodeName=");
        super::cache::follow::<Pod>(
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
        let add = |known: &mut Known, s: &ResourceSlice| {
            if s.spec.driver == self.config.driver_name
                && let Some(node) = s.spec.node_name.clone()
            {
                let name = s.metadata.name.clone().unwrap_or_default();
                known.slices.entry(node).or_default().insert(name);
            }
        };
        match event {
            watcher::Event::Init => known.slices.clear(),
            watcher::Event::InitApply(s) | watcher::Event::Apply(s) => add(&mut known, s),
            watcher::Event::Delete(s) => {
                if let Some(node) = &s.spec.node_name
                    && let Some(names) = known.slices.get_mut(node)
                {
                    names.remove(s.metadata.name.as_deref().unwrap_or_default());
                    if names.is_empty() {
                        known.slices.remove(node);
                    }
                }
            }
            watcher::Event::InitDone => {}
        }
        drop(known);
        self.changed.notify_one();
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
                }
            }
            watcher::Event::Delete(p) => {
                let uid = p.metadata.uid.as_deref().unwrap_or_default();
                known.unschedulable.remove(uid);
                known.gated.remove(uid);
                known.waiting.remove(uid);
                known.no_room.remove(uid);
            }
            watcher::Event::InitDone => {}
        }
        drop(known);
        self.changed.notify_one();
    }

    /// The DRA nodes as the placer sees them: the agent's report, less the claims allocated there
    /// that the report does not show yet.
    fn nodes(&self, scorer: &Scorer) -> Vec<Arc<NodeSnapshot>> {
        let known = self.known();
        let mut by_node: HashMap<&str, Vec<AllocatedShare>> = HashMap::new();
        for share in known.shares.all() {
            by_node
                .entry(share.node.as_str())
                .or_default()
                .push(share.clone());
        }
        let mut nodes: Vec<Arc<NodeSnapshot>> = known
            .slices
            .keys()
            .filter_map(|name| scorer.nodes.as_ref()?.get(name))
            .map(|mut node| {
                if let Some(shares) = by_node.get(node.name.as_str()) {
                    subtract_unshown(Arc::make_mut(&mut node), shares);
                }
                node
            })
            .collect();
        // A stable order: ties go the same way every time.
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        nodes
    }

    /// Chooses the node and GPUs for `pod`'s `need`: the extender's ranking over the DRA nodes.
    fn choose(&self, scorer: &Scorer, pod: &Pod, need: Need) -> Result<Choice, String> {
        let nodes = self.nodes(scorer);
        if nodes.is_empty() {
            return Err("no node publishes a ResourceSlice of the driver".into());
        }
        let (cpu, memory) = state::cpu_memory_requests(pod);
        let mix = scorer.workload.current();
        // Memory is asked in MiB; a node counts it in its unit (the slice's step): rank each unit's
        // nodes with the demand in that unit (every node has the same unit in practice).
        let mut units: BTreeMap<u64, Vec<Arc<NodeSnapshot>>> = BTreeMap::new();
        for n in nodes {
            units.entry(n.unit_mib.max(1)).or_default().push(n);
        }
        let mut best: Option<(f64, Arc<NodeSnapshot>, crate::alloc::GpuMask, state::PodDemand)> = None;
        let mut rejection: Option<String> = None;
        for (unit, group) in units {
            let demand = match need {
                Need::Mib(mib) => Demand::Memory {
                    units: mib.div_ceil(unit),
                },
                Need::Whole(count) => Demand::Whole { count },
            };
            let d = state::demand_of(pod, &scorer.rules, demand, cpu, memory)?;
            let scored = super::decide::prioritize(&group, &d, &scorer.config, &scorer.policy_cache, &mix);
            for (node, s) in group.iter().zip(scored) {
                match s {
                    Some(s) if !s.gpus.is_empty() && best.as_ref().is_none_or(|b| s.raw > b.0) => {
                        best = Some((s.raw, Arc::clone(node), s.gpus, d.clone()));
                    }
                    Some(_) => {}
                    None if rejection.is_none() => {
                        rejection = super::decide::check(node, &d)
                            .err()
                            .map(|r| format!("{}: {}", node.name, r.reason));
                    }
                    None => {}
                }
            }
        }
        let Some((_, node, gpus, d)) = best else {
            return Err(format!(
                "no DRA node has room ({})",
                rejection.unwrap_or_else(|| "none fits".into())
            ));
        };
        let chosen = gpus
            .iter()
            .map(|p| {
                let gpu = &node.gpus()[p];
                let mib = match need {
                    Need::Mib(_) => d.memory_mib(node.unit_mib),
                    Need::Whole(_) => offered_mib(gpu.memory_mib, node.unit_mib),
                };
                (gpu.index, mib)
            })
            .collect();
        Ok(Choice {
            node: node.name.clone(),
            gpus: chosen,
            demand: d,
        })
    }

    /// Looks at one gated pod: decides where its claim goes (and counts it there at once), releases it
    /// to kube-scheduler, or leaves it waiting.
    async fn decide(&self, scorer: &Scorer, client: &Client, pod: &Pod) -> Result<Decision, kube::Error> {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        let Some(names) = claim_names(pod) else {
            return Ok(Decision::Done(Outcome::Waiting(
                "its claims are not created yet".into(),
            )));
        };
        let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
        let mut to_place = Vec::new();
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
                ClaimAsk::NotOurs | ClaimAsk::Allocated => {}
                ClaimAsk::Unsupported(why) => {
                    self.release(client, pod).await?;
                    return Ok(Decision::Done(Outcome::Released(format!("claim {name}: {why}"))));
                }
                ClaimAsk::Place { request, need } => to_place.push((claim, request, need)),
            }
        }
        let (claim, request, need) = match to_place.len() {
            0 => {
                self.release(client, pod).await?;
                return Ok(Decision::Done(Outcome::Released(
                    "no claim for gpumem to place".into(),
                )));
            }
            1 => to_place.remove(0),
            n => {
                self.release(client, pod).await?;
                return Ok(Decision::Done(Outcome::Released(format!(
                    "{n} claims of gpumem's classes, placed one per pod"
                ))));
            }
        };
        let choice = match self.choose(scorer, pod, need) {
            Ok(choice) => choice,
            Err(why) => return Ok(Decision::Done(Outcome::NoRoom(why))),
        };
        let allocation = allocation_result(
            &claim,
            &self.config.driver_name,
            &request,
            &choice.node,
            &choice.gpus,
        );
        // Counted from now on: the next decision sees this room taken, whatever the write's progress.
        let mut allocated = claim.clone();
        allocated.status.get_or_insert_default().allocation = Some(allocation.clone());
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        self.known()
            .shares
            .assume(&uid, allocated_shares(&allocated, &self.config.driver_name));
        let need_mib = match need {
            Need::Mib(mib) => mib,
            Need::Whole(_) => 0,
        };
        scorer.workload.observe(&choice.demand, need_mib);
        Ok(Decision::Write {
            claim: Box::new(claim),
            allocation: Box::new(allocation),
            node: choice.node,
        })
    }

    /// Writes a decided allocation (the finalizer, then the status), then releases the pod. Every write
    /// carries the resourceVersion read: a claim changed meanwhile is looked at again, not overwritten.
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
            claim = match claims.replace(&name, &PostParams::default(), &claim).await {
                Ok(c) => c,
                Err(kube::Error::Api(s)) if changed(&s) => {
                    return Ok(Some(format!("claim {name} changed meanwhile")));
                }
                Err(e) => return Err(e),
            };
        }
        claim.status.get_or_insert_default().allocation = Some(allocation);
        let written = match claims.replace_status(&name, &PostParams::default(), &claim).await {
            Ok(c) => c,
            Err(kube::Error::Api(s)) if changed(&s) => {
                return Ok(Some(format!("claim {name} changed meanwhile")));
            }
            Err(e) => return Err(e),
        };
        self.known().shares.settle(&written, &self.config.driver_name);
        self.release(client, pod).await?;
        Ok(None)
    }

    /// Removes the gate from `pod`: kube-scheduler takes it from here.
    async fn release(&self, client: &Client, pod: &Pod) -> Result<(), kube::Error> {
        let pods: Api<Pod> = Api::namespaced(
            client.clone(),
            pod.metadata.namespace.as_deref().unwrap_or("default"),
        );
        // A strategic-merge delete of the one gate: other gates stay, and the UID precondition keeps a
        // pod of the same name made meanwhile untouched.
        let patch = serde_json::json!({
            "metadata": {"uid": pod.metadata.uid},
            "spec": {"schedulingGates": [{"name": self.config.scheduling_gate, "$patch": "delete"}]},
        });
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
    async fn give_back(&self, client: &Client) {
        let due: Vec<(String, Arc<ResourceClaim>)> = {
            let known = self.known();
            let (driver, gate) = (&self.config.driver_name, &self.config.scheduling_gate);
            known
                .unschedulable
                .values()
                .flat_map(|(pod, seen)| {
                    claims_to_give_back(pod, &known.claims, driver, gate, seen.elapsed())
                        .into_iter()
                        .map(move |key| (pod_key(pod), key))
                })
                .filter_map(|(pod, key)| Some((pod, Arc::clone(known.claims.get(&key)?))))
                .collect()
        };
        for (pod, claim) in due {
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
            }
            let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), &namespace);
            match claims.replace_status(&name, &PostParams::default(), &claim).await {
                Ok(_) => tracing::warn!(
                    %pod, claim = %name, %node,
                    "kube-scheduler cannot schedule the pod on the node its claim was placed on (see the \
                     pod's events): the claim is given back, kube-scheduler allocates it itself"
                ),
                // Changed meanwhile (reserved, deallocated, deleted): the next round reads it again.
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
                Err(e) => {
                    tracing::warn!(%pod, claim = %name, "cannot give the claim back: {}", api_failure(e))
                }
            }
        }
    }

    /// Decides for every gated pod, oldest first; the writes go on beside the next decisions (at most
    /// [`WRITES_IN_FLIGHT`] at once).
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
        pods.sort_by(|a, b| {
            let at = |p: &Pod| p.metadata.creation_timestamp.as_ref().map(|t| t.0);
            at(a)
                .cmp(&at(b))
                .then_with(|| a.metadata.name.cmp(&b.metadata.name))
        });
        for pod in pods {
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            let key = pod_key(&pod);
            let started = std::time::Instant::now();
            match self.decide(scorer, client, &pod).await {
                Ok(Decision::Done(Outcome::Released(why))) => {
                    tracing::info!(pod = %key, "left to kube-scheduler: {why}");
                    self.forget(&uid);
                }
                Ok(Decision::Done(Outcome::Waiting(why))) => self.note(&uid, &key, why, false),
                Ok(Decision::Done(Outcome::NoRoom(why))) => {
                    let mut known = self.known();
                    let freed = known.room_freed;
                    known
                        .no_room
                        .insert(uid.clone(), (freed, std::time::Instant::now()));
                    drop(known);
                    self.note(&uid, &key, why, false);
                }
                Ok(Decision::Write {
                    claim,
                    allocation,
                    node,
                }) => {
                    let Ok(permit) = Arc::clone(&self.writes).acquire_owned().await else {
                        return;
                    };
                    self.known().writing.insert(uid.clone());
                    let (me, scorer, client) = (Arc::clone(self), Arc::clone(scorer), client.clone());
                    tokio::spawn(async move {
                        let claim_uid = claim.metadata.uid.clone().unwrap_or_default();
                        let outcome = me.write(&client, &pod, *claim, *allocation).await;
                        drop(permit);
                        me.known().writing.remove(&uid);
                        match outcome {
                            Ok(None) => {
                                scorer.metrics.dra_placed.inc();
                                scorer.observe("dra_place", started);
                                tracing::info!(pod = %key, %node, "placed the pod's claim");
                                me.forget(&uid);
                            }
                            Ok(Some(why)) => {
                                me.known().shares.unassume(&claim_uid);
                                me.note(&uid, &key, why, false);
                            }
                            Err(e) => {
                                me.known().shares.unassume(&claim_uid);
                                me.note(&uid, &key, api_failure(e), true);
                            }
                        }
                        me.changed.notify_one();
                    });
                }
                Err(e) => self.note(&uid, &key, api_failure(e), true),
            }
        }
    }

    /// Logs why `uid` waits, once per reason (the same reason again every round would flood the log).
    fn note(&self, uid: &str, key: &str, why: String, failed: bool) {
        let mut known = self.known();
        if known.waiting.get(uid) != Some(&why) {
            if failed {
                tracing::warn!(pod = %key, "placing failed, will retry: {why}");
            } else {
                tracing::info!(pod = %key, "waiting: {why}");
            }
            known.waiting.insert(uid.to_string(), why);
        }
    }

    /// Drops a pod the placer is done with (its watch event, with the gate gone, follows).
    fn forget(&self, uid: &str) {
        let mut known = self.known();
        known.no_room.remove(uid);
        known.gated.remove(uid);
        known.waiting.remove(uid);
    }

    /// Places while this replica leads; returns when it no longer does.
    async fn lead(self: &Arc<Self>, scorer: &Arc<Scorer>, client: &Client) {
        loop {
            self.round(scorer, client).await;
            self.give_back(client).await;
            tokio::select! {
                () = self.changed.notified() => {}
                () = tokio::time::sleep(RETRY_EVERY) => {}
            }
        }
    }
}

/// Runs the placer for as long as the process runs: this replica places while it holds the Lease.
pub async fn run(scorer: Arc<Scorer>, client: Client, config: DraPlacementConfig, identity: String) {
    let placer = Placer::new(config.clone());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::state::GpuSnapshot;
    use k8s_openapi::api::resource::v1::{
        CapacityRequirements, DeviceClaim, DeviceRequest, ExactDeviceRequest, ResourceClaimConsumerReference,
        ResourceClaimSpec, ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity as Q;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    const CLASSES: &[&str] = &["gpu.gpumem.io"];

    fn classes() -> Vec<String> {
        CLASSES.iter().map(|c| c.to_string()).collect()
    }

    fn claim(exactly: ExactDeviceRequest) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                name: Some("c".into()),
                namespace: Some("ns".into()),
                uid: Some("0b7e7c34-5a0e-4d5c-9a43-6f4f4d1d2a11".into()),
                ..Default::default()
            },
            spec: ResourceClaimSpec {
                devices: Some(DeviceClaim {
                    requests: Some(vec![DeviceRequest {
                        name: "gpu".into(),
                        exactly: Some(exactly),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
            },
            status: None,
        }
    }

    fn memory(q: &str) -> ExactDeviceRequest {
        ExactDeviceRequest {
            device_class_name: "gpu.gpumem.io".into(),
            capacity: Some(CapacityRequirements {
                requests: Some(BTreeMap::from([("memory".into(), Q(q.into()))])),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn claims_are_read_as_memory_or_whole_gpus() {
        let ask = |e| claim_ask(&claim(e), &classes());
        assert_eq!(
            ask(memory("5000Mi")),
            ClaimAsk::Place {
                request: "gpu".into(),
                need: Need::Mib(5000)
            }
        );
        // `5k` bytes is a fraction of a MiB: one MiB, never zero.
        assert_eq!(
            ask(memory("5k")),
            ClaimAsk::Place {
                request: "gpu".into(),
                need: Need::Mib(1)
            }
        );
        let whole = ExactDeviceRequest {
            device_class_name: "gpu.gpumem.io".into(),
            count: Some(2),
            ..Default::default()
        };
        assert_eq!(
            ask(whole),
            ClaimAsk::Place {
                request: "gpu".into(),
                need: Need::Whole(2)
            }
        );
        let other = ExactDeviceRequest {
            device_class_name: "nic.example.com".into(),
            ..Default::default()
        };
        assert_eq!(ask(other), ClaimAsk::NotOurs);
    }

    #[test]
    fn forms_the_scorer_does_not_place_are_left_to_kube_scheduler() {
        let unsupported =
            |e: ExactDeviceRequest| matches!(claim_ask(&claim(e), &classes()), ClaimAsk::Unsupported(_));
        let mut selectors = memory("1Gi");
        selectors.selectors = Some(vec![Default::default()]);
        assert!(unsupported(selectors));
        let mut several = memory("1Gi");
        several.count = Some(2);
        assert!(unsupported(several));
        let mut all = memory("1Gi");
        all.allocation_mode = Some("All".into());
        assert!(unsupported(all));
        assert!(unsupported(memory("0")));
        assert!(unsupported(memory("lots")));
        let mut allocated = claim(memory("1Gi"));
        allocated.status = Some(ResourceClaimStatus {
            allocation: Some(AllocationResult::default()),
            ..Default::default()
        });
        assert_eq!(claim_ask(&allocated, &classes()), ClaimAsk::Allocated);
    }

    #[test]
    fn an_allocation_reads_back_as_the_shares_it_wrote() {
        let c = claim(memory("5000Mi"));
        let a = allocation_result(&c, "gpumem.io", "gpu", "node-1", &[(2, 5000)]);
        let results = a
            .devices
            .as_ref()
            .and_then(|d| d.results.clone())
            .unwrap_or_default();
        assert_eq!(results.len(), 1);
        assert_eq!(results[0].device, "gpu-2");
        assert_eq!(results[0].pool, "node-1");
        assert_eq!(results[0].share_id.as_deref(), c.metadata.uid.as_deref());
        let selector = serde_json::to_value(&a.node_selector).unwrap_or_default();
        assert_eq!(
            selector["nodeSelectorTerms"][0]["matchFields"][0]["values"][0],
            "node-1"
        );
        let mut allocated = c.clone();
        allocated.status = Some(ResourceClaimStatus {
            allocation: Some(a),
            reserved_for: Some(vec![ResourceClaimConsumerReference {
                resource: "pods".into(),
                name: "p".into(),
                uid: "u".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        assert_eq!(
            allocated_shares(&allocated, "gpumem.io"),
            vec![AllocatedShare {
                node: "node-1".into(),
                index: 2,
                mib: Some(5000),
                owner: "ns/p".into()
            }]
        );
        assert!(allocated_shares(&allocated, "other.driver").is_empty());
    }

    #[test]
    fn an_older_event_does_not_undo_a_newer_allocation() {
        let mut c = claim(memory("5000Mi"));
        let a = allocation_result(&c, "gpumem.io", "gpu", "node-1", &[(2, 5000)]);
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
    fn claims_placed_where_the_pod_cannot_go_are_given_back_after_a_while() {
        let mut placed = claim(memory("5000Mi"));
        placed.status = Some(ResourceClaimStatus {
            allocation: Some(allocation_result(
                &placed,
                "gpumem.io",
                "gpu",
                "node-1",
                &[(2, 5000)],
            )),
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
        let reserved = HashMap::from([("ns/c".to_string(), Arc::new(reserved))]);
        assert!(give_back(&stuck, &reserved, 3600).is_empty(), "a pod holds it");
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

    #[test]
    fn claim_names_wait_for_the_controller() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {
                "containers": [],
                "resourceClaims": [
                    {"name": "gpu", "resourceClaimTemplateName": "t"},
                    {"name": "own", "resourceClaimName": "mine"}
                ],
                "schedulingGates": [{"name": PLACEMENT_GATE}]
            }
        }))
        .unwrap_or_default();
        assert!(is_gated(&pod, PLACEMENT_GATE));
        assert_eq!(claim_names(&pod), None);
        let mut made = pod.clone();
        made.status = serde_json::from_value(serde_json::json!({
            "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x7k2q"}]
        }))
        .ok();
        assert_eq!(
            claim_names(&made),
            Some(vec!["p-gpu-x7k2q".to_string(), "mine".to_string()])
        );
    }
}
