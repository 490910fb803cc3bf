//! What the agent knows about its GPUs right now: their health, and what is allocated on them.
//!
//! Allocations come from the kubelet's PodResources API (the only place that learns when a pod ends,
//! and the picture an agent restart starts from), plus the agent's own allocations the kubelet has not
//! listed yet. Every change that alters a device list bumps a version that ListAndWatch streams follow.
//!
//! One file, over the usual ~600 lines: every node-local decision reads and writes the one state behind
//! one lock, and the invariants between health, the kubelet's allocations and the agent's own pending
//! ones are kept in view together.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::enforcement::Enforcement;
use crate::alloc::local::{self, FreeMemory, PairScores};
use crate::gpu::GpuInventory;
use crate::node::{ALLOCATING_POD, GpuMode, GpuUsage, UsageAnnotation};
use crate::plugin::devices;
use crate::plugin::podresources::Allocations;
use crate::plugin::proto::podresources::ListPodResourcesResponse;
use crate::plugin::proto::v1beta1::Device;
use crate::plugin::server::RequestError;

/// An allocation the kubelet has not listed after this long never reached a container (admission
/// failed after Allocate); forget it.
const PENDING_TTL: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Health {
    Healthy,
    Unhealthy { reason: String, last_event: Instant },
}

/// What is allocated on one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct GpuAllocation {
    /// Pods holding the GPU as a whole (`namespace/name`).
    whole: BTreeSet<String>,
    /// Memory unit numbers in use, and by whom.
    units: BTreeMap<u64, String>,
    /// Memory held by prepared DRA claims: claim UID -> (owner, MiB).
    claimed: BTreeMap<String, (String, u64)>,
    /// Share slots in use (`memCounting: shares`), by slot number.
    shares: BTreeMap<u32, ShareHold>,
}

/// One container's share of a GPU when the kubelet counts memory per node.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ShareHold {
    /// `namespace/name`.
    owner: String,
    container: String,
    /// The units its container asked; None until known (after an agent restart, until the pod's spec
    /// is read), and counted as the whole GPU meanwhile: nothing more goes there on a guess.
    units: Option<u64>,
}

#[derive(Debug, Clone)]
enum PendingKind {
    Whole,
    Units(Vec<u64>),
    Share { slot: u32, hold: ShareHold },
}

#[derive(Debug, Clone)]
struct Pending {
    gpu: usize,
    kind: PendingKind,
    at: Instant,
}

/// Whether a GPU is held whole, and how many of its memory units and share slots are in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Occupancy {
    whole: bool,
    units: u64,
    shares: u64,
}

impl Occupancy {
    fn shared(self) -> bool {
        self.units > 0 || self.shares > 0
    }
}

struct Inner {
    health: Vec<Health>,
    listed: Vec<GpuAllocation>,
    /// Each listed container's memory allocation: (GPU index, lowest unit).
    listed_mem: BTreeSet<(u32, u64)>,
    pending: Vec<Pending>,
    /// Prepared DRA claims, by UID.
    claims: BTreeMap<String, PreparedClaim>,
    /// The units each share slot's container asked, once known (at Allocate, or from its pod's spec):
    /// (GPU position, slot) -> (owner, container, units). Kept while the slot is listed or pending.
    share_units: BTreeMap<(usize, u32), (String, String, u64)>,
}

/// `memCounting: shares`: the device-plugin resource of share slots and how many each GPU has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareSlots {
    pub resource: String,
    pub per_gpu: u32,
}

/// How much of one GPU a prepared DRA claim holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Share {
    /// The whole GPU (the claim consumed all of its memory).
    Whole,
    /// This much memory, in MiB.
    Mib(u64),
}

/// A DRA claim the kubelet had prepared: an allocation like an Allocate's, by another path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedClaim {
    /// Who holds it, as the usage annotation shows it (`namespace/pod`).
    pub owner: String,
    /// Per GPU position, its share.
    pub shares: Vec<(usize, Share)>,
}

/// Health policy.
#[derive(Debug, Clone)]
pub struct HealthPolicy {
    pub ignored_xids: Vec<u64>,
    pub quiet_period: Duration,
}

pub struct NodeState {
    pub inventory: GpuInventory,
    pub unit_mib: u64,
    pub gpu_resource: String,
    pub mem_resource: String,
    /// Present when the kubelet counts memory per node and each container holds one share slot.
    pub shares: Option<ShareSlots>,
    health_policy: HealthPolicy,
    scores: PairScores,
    by_uuid: HashMap<String, usize>,
    /// GPU position by NVML index (indices are small).
    position_of_index: Vec<Option<usize>>,
    inner: Mutex<Inner>,
    /// Bumped when a device list may have changed.
    version: watch::Sender<u64>,
    /// Bumped when anything the Node's annotations show may have changed.
    usage_version: watch::Sender<u64>,
}

impl Allocations for NodeState {
    fn apply(&self, list: &ListPodResourcesResponse) {
        self.apply_pod_resources(list);
    }
}

impl NodeState {
    pub fn new(
        inventory: GpuInventory,
        unit_mib: u64,
        gpu_resource: String,
        mem_resource: String,
        health_policy: HealthPolicy,
    ) -> Self {
        let n = inventory.gpus.len();
        let scores = PairScores::of(&inventory);
        let by_uuid = inventory.positions_by_uuid();
        let max_index = inventory.gpus.iter().map(|g| g.index as usize).max().unwrap_or(0);
        let mut position_of_index = vec![None; max_index + 1];
        for (a, g) in inventory.gpus.iter().enumerate() {
            position_of_index[g.index as usize] = Some(a);
        }
        let inner = Inner {
            health: vec![Health::Healthy; n],
            listed: vec![GpuAllocation::default(); n],
            listed_mem: BTreeSet::new(),
            pending: Vec::new(),
            claims: BTreeMap::new(),
            share_units: BTreeMap::new(),
        };
        Self {
            inventory,
            unit_mib,
            gpu_resource,
            mem_resource,
            shares: None,
            health_policy,
            scores,
            by_uuid,
            position_of_index,
            inner: Mutex::new(inner),
            version: watch::channel(0).0,
            usage_version: watch::channel(0).0,
        }
    }

    /// Counts memory per container share (`memCounting: shares`) rather than per unit.
    pub fn with_shares(mut self, slots: ShareSlots) -> Self {
        self.shares = Some(slots);
        self
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave Inner half-updated in a way later readers trip
        // over (every update is a plain assignment), so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
        self.bump_usage();
    }

    fn bump_usage(&self) {
        self.usage_version.send_modify(|v| *v += 1);
    }

    /// Follows changes of health and usage (what the Node's annotations show).
    pub fn subscribe_usage(&self) -> watch::Receiver<u64> {
        self.usage_version.subscribe()
    }

    /// Whether the kubelet lists memory (units or a share) held by pod `owner` (`namespace/name`).
    pub fn holds_memory(&self, owner: &str) -> bool {
        self.lock()
            .listed
            .iter()
            .any(|a| a.units.values().any(|o| o == owner) || a.shares.values().any(|h| h.owner == owner))
    }

    /// Follows changes of the device lists.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    fn units_of(&self, gpu: usize) -> u64 {
        devices::units_per_gpu(self.inventory.gpus[gpu].memory_mib, self.unit_mib)
    }

    /// Effective allocation per GPU: listed by the kubelet, plus our own not yet listed.
    fn effective(inner: &Inner) -> Vec<GpuAllocation> {
        let mut all = inner.listed.clone();
        for p in &inner.pending {
            match &p.kind {
                PendingKind::Whole => {
                    all[p.gpu].whole.insert(ALLOCATING_POD.into());
                }
                PendingKind::Units(units) => {
                    for &u in units {
                        all[p.gpu].units.entry(u).or_insert_with(|| ALLOCATING_POD.into());
                    }
                }
                PendingKind::Share { slot, hold } => {
                    // Newer than a listing that still shows the slot's earlier holder.
                    all[p.gpu].shares.insert(*slot, hold.clone());
                }
            }
        }
        for (uid, claim) in &inner.claims {
            for &(gpu, share) in &claim.shares {
                match share {
                    Share::Whole => {
                        all[gpu].whole.insert(claim.owner.clone());
                    }
                    Share::Mib(mib) => {
                        all[gpu].claimed.insert(uid.clone(), (claim.owner.clone(), mib));
                    }
                }
            }
        }
        all
    }

    /// The units a share counts for: what its container asked, or the whole GPU while that is unknown.
    fn share_units(&self, gpu: usize, hold: &ShareHold) -> u64 {
        hold.units.unwrap_or_else(|| self.units_of(gpu))
    }

    /// Per GPU, what decisions and device lists depend on; cheap (no clone of the unit maps).
    fn occupancy(&self, inner: &Inner) -> Vec<Occupancy> {
        let unit_mib = self.unit_mib;
        let mut occ: Vec<Occupancy> = inner
            .listed
            .iter()
            .enumerate()
            .map(|(gpu, a)| Occupancy {
                whole: !a.whole.is_empty(),
                units: a.units.len() as u64
                    + a.shares.values().map(|h| self.share_units(gpu, h)).sum::<u64>(),
                shares: a.shares.len() as u64,
            })
            .collect();
        for p in &inner.pending {
            match &p.kind {
                PendingKind::Whole => occ[p.gpu].whole = true,
                PendingKind::Units(units) => occ[p.gpu].units += units.len() as u64,
                PendingKind::Share { slot, hold } => {
                    let listed = inner.listed[p.gpu].shares.get(slot);
                    if listed.is_none_or(|h| h.owner != hold.owner || h.container != hold.container) {
                        occ[p.gpu].units += self.share_units(p.gpu, hold);
                        occ[p.gpu].shares += 1;
                    }
                }
            }
        }
        for claim in inner.claims.values() {
            for &(gpu, share) in &claim.shares {
                match share {
                    Share::Whole => occ[gpu].whole = true,
                    Share::Mib(mib) => occ[gpu].units += mib.div_ceil(unit_mib),
                }
            }
        }
        occ
    }

    // ----- device lists -----

    /// `nvidia.com/gpu`: a GPU with any memory units in use is not allocatable whole.
    pub fn gpu_devices(&self) -> Vec<Device> {
        let offered = self.gpus_offered();
        devices::gpu_devices(&self.inventory, |a| offered[a])
    }

    /// `nvidia.com/gpu-mem`: a sick GPU's units are Unhealthy. A GPU held whole keeps its units Healthy:
    /// flipping them costs a 1.36 kubelet one lookup per unit against every unit held (minutes at 1 MiB,
    /// docs/operate.md), and the scorer and Allocate already refuse memory on a GPU held whole.
    pub fn mem_devices(&self) -> Vec<Device> {
        let offered = self.units_offered();
        devices::mem_devices(&self.inventory, self.unit_mib, |a| offered[a])
    }

    /// Per GPU, whether its whole-GPU device is Healthy: all the `nvidia.com/gpu` list depends on.
    pub fn gpus_offered(&self) -> Vec<bool> {
        let inner = self.lock();
        let occ = self.occupancy(&inner);
        (0..occ.len())
            .map(|a| inner.health[a] == Health::Healthy && !occ[a].shared())
            .collect()
    }

    /// The memory units of the healthy GPUs: the node's memory resource when the kubelet counts it
    /// per node.
    pub fn healthy_units(&self) -> u64 {
        let inner = self.lock();
        (0..self.inventory.gpus.len())
            .filter(|&a| inner.health[a] == Health::Healthy)
            .map(|a| self.units_of(a))
            .sum()
    }

    /// Per GPU, whether its memory units are Healthy: all the `nvidia.com/gpu-mem` list depends on.
    pub fn units_offered(&self) -> Vec<bool> {
        let inner = self.lock();
        inner.health.iter().map(|h| *h == Health::Healthy).collect()
    }

    /// `gpumem.io/gpu-share` (`memCounting: shares`): like units, a sick GPU's slots are Unhealthy and a
    /// GPU held whole keeps its slots Healthy (GetPreferredAllocation and Allocate refuse them).
    pub fn share_devices(&self) -> Vec<Device> {
        let Some(slots) = &self.shares else {
            return Vec::new();
        };
        let offered = self.units_offered();
        devices::share_devices(&self.inventory, slots.per_gpu, |a| offered[a])
    }

    /// Per-GPU usage, as the agent publishes it.
    pub fn usage(&self) -> UsageAnnotation {
        let inner = self.lock();
        let alloc = Self::effective(&inner);
        let mut usage = UsageAnnotation::idle(&self.inventory);
        for (gpu, (u, a)) in usage.gpus.iter_mut().zip(&alloc).enumerate() {
            let pods: BTreeSet<&String> = a
                .whole
                .iter()
                .chain(a.units.values())
                .chain(a.claimed.values().map(|(owner, _)| owner))
                .chain(a.shares.values().map(|h| &h.owner))
                .collect();
            u.pods = pods.into_iter().cloned().collect();
            // Units and shares are counted in units, claims in MiB.
            let units =
                a.units.len() as u64 + a.shares.values().map(|h| self.share_units(gpu, h)).sum::<u64>();
            let claimed_mib: u64 = a.claimed.values().map(|(_, mib)| mib).sum();
            (u.mode, u.allocated_mib) = if !a.whole.is_empty() {
                (GpuMode::Whole, self.inventory.gpus[gpu].memory_mib)
            } else if units > 0 || claimed_mib > 0 || !a.shares.is_empty() {
                (GpuMode::Shared, units * self.unit_mib + claimed_mib)
            } else {
                (GpuMode::Free, 0)
            };
        }
        usage
    }

    /// Every live memory allocation, listed, ours and not yet listed, or a prepared claim's share: its
    /// accounting name ([`Enforcement::allocation_name`], [`Enforcement::claim_allocation_name`]) and
    /// who holds it (`namespace/name`, [`ALLOCATING_POD`] until the kubelet lists it).
    pub fn live_allocations(&self) -> BTreeMap<String, String> {
        let inner = self.lock();
        let mut live = BTreeMap::new();
        for p in &inner.pending {
            let index = self.inventory.gpus[p.gpu].index;
            match &p.kind {
                PendingKind::Units(units) => {
                    if let Some(&lowest) = units.iter().min() {
                        live.insert(
                            Enforcement::allocation_name(index, &[lowest]),
                            ALLOCATING_POD.to_string(),
                        );
                    }
                }
                PendingKind::Share { .. } | PendingKind::Whole => {}
            }
        }
        for (a, allocation) in inner.listed.iter().enumerate() {
            for (&slot, hold) in &allocation.shares {
                let name = Enforcement::share_allocation_name(self.inventory.gpus[a].index, slot);
                live.insert(name, hold.owner.clone());
            }
        }
        // After the listed ones: a slot just handed on may still be listed under its earlier holder.
        for p in &inner.pending {
            if let PendingKind::Share { slot, hold } = &p.kind {
                let name = Enforcement::share_allocation_name(self.inventory.gpus[p.gpu].index, *slot);
                live.insert(name, hold.owner.clone());
            }
        }
        // Listed after pending: once the kubelet lists an allocation, its pod is known.
        for &(index, lowest) in &inner.listed_mem {
            let owner = self
                .position(index)
                .and_then(|a| inner.listed[a].units.get(&lowest))
                .map_or(ALLOCATING_POD, String::as_str);
            live.insert(Enforcement::allocation_name(index, &[lowest]), owner.to_string());
        }
        for (uid, claim) in &inner.claims {
            for &(a, share) in &claim.shares {
                if matches!(share, Share::Mib(_)) {
                    let name = Enforcement::claim_allocation_name(self.inventory.gpus[a].index, uid);
                    live.insert(name, claim.owner.clone());
                }
            }
        }
        live
    }

    /// Why GPU `a` is unhealthy; None while it is healthy.
    pub fn unhealthy_reason(&self, a: usize) -> Option<String> {
        match &self.lock().health.get(a)? {
            Health::Healthy => None,
            Health::Unhealthy { reason, .. } => Some(reason.clone()),
        }
    }

    /// Whether GPU `a` is healthy.
    pub fn is_healthy(&self, a: usize) -> bool {
        self.lock().health[a] == Health::Healthy
    }

    // ----- what the kubelet says is in use -----

    /// Replaces the listed allocations with a PodResources `List` answer.
    pub fn apply_pod_resources(&self, list: &ListPodResourcesResponse) {
        let mut listed = vec![GpuAllocation::default(); self.inventory.gpus.len()];
        let mut listed_mem = BTreeSet::new();
        let share_resource = self.shares.as_ref().map(|s| s.resource.as_str());
        for pod in &list.pod_resources {
            let owner = format!("{}/{}", pod.namespace, pod.name);
            for (container, device) in pod
                .containers
                .iter()
                .flat_map(|c| c.devices.iter().map(move |d| (&c.name, d)))
            {
                if Some(device.resource_name.as_str()) == share_resource {
                    for id in &device.device_ids {
                        match devices::parse_share_id(id)
                            .and_then(|(index, n)| Some((self.position(index)?, n)))
                        {
                            Some((a, slot)) => {
                                let hold = ShareHold {
                                    owner: owner.clone(),
                                    container: container.clone(),
                                    units: None,
                                };
                                listed[a].shares.insert(slot, hold);
                            }
                            None => {
                                tracing::debug!(%id, "PodResources lists a share this node does not have")
                            }
                        }
                    }
                    continue;
                }
                if device.resource_name == self.mem_resource {
                    let units = device.device_ids.iter().filter_map(|id| parse_unit_id(id));
                    if let Some(lowest) = units.min_by_key(|&(_, n)| n) {
                        listed_mem.insert(lowest);
                    }
                }
                for id in &device.device_ids {
                    if device.resource_name == self.gpu_resource {
                        match self.by_uuid.get(id) {
                            Some(&a) => {
                                listed[a].whole.insert(owner.clone());
                            }
                            None => tracing::debug!(%id, "PodResources lists a GPU this node does not have"),
                        }
                    } else if device.resource_name == self.mem_resource {
                        // A unit beyond today's count (the unit size changed since) still marks its GPU shared.
                        match parse_unit_id(id).and_then(|(index, n)| Some((self.position(index)?, n))) {
                            Some((a, n)) => {
                                listed[a].units.insert(n, owner.clone());
                            }
                            None => {
                                tracing::debug!(%id, "PodResources lists a memory unit this node does not have")
                            }
                        }
                    }
                }
            }
        }
        let mut inner = self.lock();
        // A share's size is what its container asked, when this container's is known.
        for (a, allocation) in listed.iter_mut().enumerate() {
            for (&slot, hold) in allocation.shares.iter_mut() {
                hold.units = inner
                    .share_units
                    .get(&(a, slot))
                    .filter(|(owner, container, _)| *owner == hold.owner && *container == hold.container)
                    .map(|&(_, _, units)| units);
            }
        }
        let now = Instant::now();
        // A pending allocation is done once the kubelet lists any of it (or it is too old to matter).
        inner.pending.retain(|p| {
            let seen = match &p.kind {
                PendingKind::Whole => !listed[p.gpu].whole.is_empty(),
                PendingKind::Units(units) => units.iter().any(|u| listed[p.gpu].units.contains_key(u)),
                // The slot's earlier holder may still be listed: only this container's listing counts.
                PendingKind::Share { slot, hold } => listed[p.gpu]
                    .shares
                    .get(slot)
                    .is_some_and(|h| h.owner == hold.owner && h.container == hold.container),
            };
            !seen && now.duration_since(p.at) < PENDING_TTL
        });
        let Inner {
            pending, share_units, ..
        } = &mut *inner;
        // Kept while no one else holds the slot (one entry per slot at most): a kubelet that has just
        // restarted lists no pod for a moment, and its next listing still shows the same holders.
        share_units.retain(|&(a, slot), (owner, container, _)| {
            let pending_here = pending.iter().any(|p| {
                p.gpu == a && matches!(&p.kind, PendingKind::Share { slot: s, hold } if *s == slot && hold.owner == *owner)
            });
            pending_here
                || listed[a].shares.get(&slot).is_none_or(|h| h.owner == *owner && h.container == *container)
        });
        let before = self.exclusion(&inner);
        let usage_changed = inner.listed != listed;
        inner.listed = listed;
        inner.listed_mem = listed_mem;
        let after = self.exclusion(&inner);
        drop(inner);
        if before != after {
            self.bump();
        } else if usage_changed {
            self.bump_usage();
        }
    }

    /// The part of the allocation that the device lists depend on: whole / shared per GPU.
    fn exclusion(&self, inner: &Inner) -> Vec<(bool, bool)> {
        self.occupancy(inner)
            .iter()
            .map(|o| (o.whole, o.shared()))
            .collect()
    }

    // ----- shares whose size is learned from the API server -----

    /// Shares the kubelet lists whose size is not known yet (after an agent restart): slot ID, owner
    /// (`namespace/name`) and container.
    pub fn unsized_shares(&self) -> Vec<(String, String, String)> {
        let inner = self.lock();
        let mut unknown = Vec::new();
        for (a, allocation) in inner.listed.iter().enumerate() {
            for (&slot, hold) in &allocation.shares {
                if hold.units.is_none() {
                    let id = devices::share_id(self.inventory.gpus[a].index, slot);
                    unknown.push((id, hold.owner.clone(), hold.container.clone()));
                }
            }
        }
        unknown
    }

    /// Records the units the container holding share `id` asked, read from its pod's spec.
    pub fn size_share(&self, id: &str, owner: &str, container: &str, units: u64) {
        let Ok((a, slot)) = self.share_position(id) else {
            return;
        };
        let mut inner = self.lock();
        let Some(hold) = inner.listed[a].shares.get_mut(&slot) else {
            return;
        };
        if hold.owner != owner || hold.container != container {
            return;
        }
        hold.units = Some(units);
        inner
            .share_units
            .insert((a, slot), (owner.to_string(), container.to_string(), units));
        drop(inner);
        self.bump();
    }

    /// The containers this agent allocated a share to that the kubelet does not list yet: (owner, container).
    pub fn pending_shares(&self) -> BTreeSet<(String, String)> {
        self.lock()
            .pending
            .iter()
            .filter_map(|p| match &p.kind {
                PendingKind::Share { hold, .. } => Some((hold.owner.clone(), hold.container.clone())),
                _ => None,
            })
            .collect()
    }

    // ----- health -----

    /// A critical XID on GPU `a`. Application XIDs in the ignore list change nothing.
    pub fn record_xid(&self, a: usize, xid: u64) {
        if self.health_policy.ignored_xids.contains(&xid) {
            tracing::info!(gpu = a, xid, "application XID, GPU stays healthy");
            return;
        }
        self.mark_unhealthy(a, format!("XID {xid}"));
    }

    /// GPU `a` does not answer (fallen off the bus).
    pub fn record_lost(&self, a: usize) {
        self.mark_unhealthy(a, "not answering (GPU is lost)".into());
    }

    fn mark_unhealthy(&self, a: usize, reason: String) {
        let Some(gpu) = self.inventory.gpus.get(a) else {
            return;
        };
        let mut inner = self.lock();
        let was_healthy = inner.health[a] == Health::Healthy;
        if was_healthy {
            tracing::warn!(gpu = a, uuid = %gpu.uuid, %reason, "GPU unhealthy");
        }
        inner.health[a] = Health::Unhealthy {
            reason,
            last_event: Instant::now(),
        };
        drop(inner);
        if was_healthy {
            self.bump();
        }
    }

    /// GPU `a` answered a probe: healthy again once the quiet period has passed since its last event.
    pub fn record_answered(&self, a: usize) {
        let mut inner = self.lock();
        let recovered = match &inner.health[a] {
            Health::Unhealthy { last_event, reason }
                if last_event.elapsed() >= self.health_policy.quiet_period =>
            {
                tracing::info!(gpu = a, previous = %reason, "GPU healthy again");
                true
            }
            _ => false,
        };
        if recovered {
            inner.health[a] = Health::Healthy;
            drop(inner);
            self.bump();
        }
    }

    // ----- decisions -----

    /// GetPreferredAllocation for whole GPUs: the best-connected set.
    pub fn prefer_whole(
        &self,
        available: &[String],
        must: &[String],
        size: usize,
    ) -> Result<Vec<String>, RequestError> {
        let to_pos = |ids: &[String]| -> Result<Vec<usize>, RequestError> {
            ids.iter()
                .map(|id| {
                    self.by_uuid
                        .get(id)
                        .copied()
                        .ok_or_else(|| unknown(&self.gpu_resource, id))
                })
                .collect()
        };
        let (available, must) = (to_pos(available)?, to_pos(must)?);
        // GPUs sharing memory are reported unhealthy, but the kubelet may not have seen that yet.
        let occ = self.occupancy(&self.lock());
        let usable: Vec<usize> = available.into_iter().filter(|&a| !occ[a].shared()).collect();
        let set = local::best_gpu_set(&self.scores, &usable, &must, size)
            .map_err(|e| RequestError::Unavailable(format!("{}: {e}", self.gpu_resource)))?;
        Ok(set
            .into_iter()
            .map(|a| self.inventory.gpus[a].uuid.clone())
            .collect())
    }

    /// GetPreferredAllocation for memory: `size` units, all from ONE GPU, best fit.
    ///
    /// The kubelet offers every free unit (131,072 IDs on an 8 x 80 GB node at 5 MiB). The agent's own
    /// books already say how much each GPU has free, so the choice is made from them and confirmed by
    /// finding `size` offered units of that GPU; only when the offer disagrees (units the kubelet is
    /// holding back) is the whole offer counted per GPU.
    pub fn prefer_mem(
        &self,
        available: &[String],
        must: &[String],
        size: usize,
        preferred: Option<&str>,
    ) -> Result<Vec<String>, RequestError> {
        let n = self.inventory.gpus.len();
        let mut must_gpu = None;
        for id in must {
            let (a, _) = self.unit_position(id)?;
            if must_gpu.is_some_and(|g| g != a) {
                return Err(RequestError::Invalid(format!(
                    "{}: the units that must be included span several GPUs; a request is served by one GPU",
                    self.mem_resource
                )));
            }
            must_gpu = Some(a);
        }
        let (occ, healthy) = {
            let inner = self.lock();
            (
                self.occupancy(&inner),
                inner
                    .health
                    .iter()
                    .map(|h| *h == Health::Healthy)
                    .collect::<Vec<_>>(),
            )
        };
        let eligible = |a: &usize| healthy[*a] && !occ[*a].whole && must_gpu.is_none_or(|g| g == *a);

        // The scorer's choice (by UUID), when it still fits.
        if let Some(gpu) = preferred
            .and_then(|uuid| self.by_uuid.get(uuid).copied())
            .filter(eligible)
            && let Some(ids) = self.offered_units(available, must, gpu, size)?
        {
            return Ok(ids);
        }

        let booked: Vec<FreeMemory> = (0..n)
            .filter(eligible)
            .map(|a| FreeMemory {
                gpu: a,
                free: self.units_of(a).saturating_sub(occ[a].units),
            })
            .collect();
        if let Some(gpu) = local::best_fit_gpu(&booked, size as u64)
            && let Some(ids) = self.offered_units(available, must, gpu, size)?
        {
            return Ok(ids);
        }

        let mut offered = vec![0u64; n];
        for id in available {
            offered[self.unit_gpu(id)?] += 1;
        }
        let counted: Vec<FreeMemory> = (0..n)
            .filter(|a| offered[*a] > 0 && eligible(a))
            .map(|a| FreeMemory {
                gpu: a,
                free: offered[a],
            })
            .collect();
        if let Some(gpu) = local::best_fit_gpu(&counted, size as u64)
            && let Some(ids) = self.offered_units(available, must, gpu, size)?
        {
            return Ok(ids);
        }
        let have = counted.iter().max_by_key(|c| c.free).map_or_else(
            || "no GPU has free memory".to_string(),
            |c| {
                let index = self.inventory.gpus[c.gpu].index;
                format!(
                    "the largest free block is {} MiB on GPU {index}",
                    c.free * self.unit_mib
                )
            },
        );
        Err(RequestError::Unavailable(format!(
            "{}: no single GPU has {} MiB free ({have}); a request is served by one GPU",
            self.mem_resource,
            size as u64 * self.unit_mib
        )))
    }

    /// `size` offered units of GPU `gpu`, must-include ones first, then in the kubelet's order;
    /// None if the offer holds fewer.
    fn offered_units(
        &self,
        available: &[String],
        must: &[String],
        gpu: usize,
        size: usize,
    ) -> Result<Option<Vec<String>>, RequestError> {
        let mut chosen: Vec<&String> = must.iter().collect();
        for id in available {
            if chosen.len() >= size {
                break;
            }
            if self.unit_gpu(id)? == gpu && !must.contains(id) {
                chosen.push(id);
            }
        }
        if chosen.len() < size {
            return Ok(None);
        }
        for id in &chosen {
            self.unit_position(id)?;
        }
        Ok(Some(chosen.into_iter().cloned().collect()))
    }

    /// Allocate whole GPUs: every ID known, healthy, and with no memory shared out.
    pub fn allocate_whole(&self, ids: &[String]) -> Result<Vec<usize>, RequestError> {
        if ids.is_empty() {
            return Err(RequestError::Invalid(format!(
                "{}: Allocate with no devices",
                self.gpu_resource
            )));
        }
        let mut inner = self.lock();
        let occ = self.occupancy(&inner);
        let mut gpus = Vec::new();
        for id in ids {
            let a = *self
                .by_uuid
                .get(id)
                .ok_or_else(|| unknown(&self.gpu_resource, id))?;
            if let Health::Unhealthy { reason, .. } = &inner.health[a] {
                return Err(RequestError::Unavailable(format!(
                    "GPU {id} is unhealthy: {reason}"
                )));
            }
            if occ[a].shared() {
                return Err(RequestError::Unavailable(format!(
                    "GPU {id} is shared ({} MiB allocated through {}); it cannot be allocated whole",
                    occ[a].units * self.unit_mib,
                    self.mem_resource
                )));
            }
            gpus.push(a);
        }
        let now = Instant::now();
        inner.pending.extend(gpus.iter().map(|&gpu| Pending {
            gpu,
            kind: PendingKind::Whole,
            at: now,
        }));
        drop(inner);
        self.bump();
        Ok(gpus)
    }

    /// Allocate memory units: all on one GPU, known, healthy, and that GPU not allocated whole.
    /// Returns the GPU and the unit numbers.
    pub fn allocate_mem(&self, ids: &[String]) -> Result<(usize, Vec<u64>), RequestError> {
        let mut gpu: Option<usize> = None;
        let mut units = Vec::with_capacity(ids.len());
        for id in ids {
            let (a, n) = self.unit_position(id)?;
            if let Some(g) = gpu.filter(|&g| g != a) {
                return Err(RequestError::Invalid(format!(
                    "{}: the devices span several GPUs ({} and {}); a request is served by one GPU",
                    self.mem_resource, self.inventory.gpus[g].index, self.inventory.gpus[a].index
                )));
            }
            gpu = Some(a);
            units.push(n);
        }
        let Some(a) = gpu else {
            return Err(RequestError::Invalid(format!(
                "{}: Allocate with no devices",
                self.mem_resource
            )));
        };
        let mut inner = self.lock();
        if let Health::Unhealthy { reason, .. } = &inner.health[a] {
            return Err(RequestError::Unavailable(format!(
                "GPU {} is unhealthy: {reason}",
                self.inventory.gpus[a].index
            )));
        }
        let occ = self.occupancy(&inner)[a];
        if occ.whole {
            return Err(RequestError::Unavailable(format!(
                "GPU {} is allocated whole; its memory cannot be shared",
                self.inventory.gpus[a].index
            )));
        }
        inner.pending.push(Pending {
            gpu: a,
            kind: PendingKind::Units(units.clone()),
            at: Instant::now(),
        });
        drop(inner);
        if occ.shared() {
            self.bump_usage();
        } else {
            self.bump();
        }
        Ok((a, units))
    }

    /// GetPreferredAllocation for a share (`memCounting: shares`): `size` offered slots (one, as the
    /// admission policy asks) of the GPU that takes `units` best, the scorer's choice first.
    pub fn prefer_share(
        &self,
        available: &[String],
        must: &[String],
        size: usize,
        units: u64,
        preferred: Option<&str>,
    ) -> Result<Vec<String>, RequestError> {
        let resource = self.share_resource()?;
        let mut must_gpu = None;
        for id in must {
            let (a, _) = self.share_position(id)?;
            if must_gpu.is_some_and(|g| g != a) {
                return Err(RequestError::Invalid(format!(
                    "{resource}: the shares that must be included span several GPUs"
                )));
            }
            must_gpu = Some(a);
        }
        let n = self.inventory.gpus.len();
        let mut offered = vec![Vec::new(); n];
        for id in available {
            let (a, _) = self.share_position(id)?;
            if !must.contains(id) {
                offered[a].push(id);
            }
        }
        let (occ, healthy) = {
            let inner = self.lock();
            let healthy: Vec<bool> = inner.health.iter().map(|h| *h == Health::Healthy).collect();
            (self.occupancy(&inner), healthy)
        };
        let free = |a: usize| self.units_of(a).saturating_sub(occ[a].units);
        let eligible = |a: &usize| {
            healthy[*a]
                && !occ[*a].whole
                && must_gpu.is_none_or(|g| g == *a)
                && offered[*a].len() + must.len() >= size
                && free(*a) >= units
        };
        let scorer_choice = preferred
            .and_then(|uuid| self.by_uuid.get(uuid).copied())
            .filter(eligible);
        let fits: Vec<FreeMemory> = (0..n)
            .filter(eligible)
            .map(|a| FreeMemory {
                gpu: a,
                free: free(a),
            })
            .collect();
        let Some(gpu) = scorer_choice.or_else(|| local::best_fit_gpu(&fits, units)) else {
            let largest = (0..n)
                .filter(|a| healthy[*a] && !occ[*a].whole && !offered[*a].is_empty())
                .max_by_key(|&a| free(a));
            let have = largest.map_or_else(
                || "no healthy GPU has a free share slot".to_string(),
                |a| {
                    format!(
                        "the most free is {} MiB on GPU {}",
                        free(a) * self.unit_mib,
                        self.inventory.gpus[a].index
                    )
                },
            );
            return Err(RequestError::Unavailable(format!(
                "{resource}: no GPU has {} MiB free and a free share slot ({have})",
                units * self.unit_mib
            )));
        };
        let chosen = must
            .iter()
            .chain(offered[gpu].iter().copied())
            .take(size)
            .cloned()
            .collect();
        Ok(chosen)
    }

    /// Allocate a share: one slot, of a known healthy GPU not held whole with `units` free, for
    /// container `container` of pod `owner` (`namespace/name`). Returns the GPU's position and the slot.
    pub fn allocate_share(
        &self,
        ids: &[String],
        owner: &str,
        container: &str,
        units: u64,
    ) -> Result<(usize, u32), RequestError> {
        let resource = self.share_resource()?;
        let [id] = ids else {
            return Err(RequestError::Invalid(format!(
                "{resource}: a container holds one share, not {} (its {} says how much memory)",
                ids.len(),
                self.mem_resource
            )));
        };
        let (a, slot) = self.share_position(id)?;
        let index = self.inventory.gpus[a].index;
        let mut inner = self.lock();
        if let Health::Unhealthy { reason, .. } = &inner.health[a] {
            return Err(RequestError::Unavailable(format!(
                "GPU {index} is unhealthy: {reason}"
            )));
        }
        let same = |h: &ShareHold| h.owner == owner && h.container == container;
        let listed = inner.listed[a].shares.get(&slot);
        // The kubelet hands out a slot only when it is free: an earlier holder still in the last
        // listing has ended, and its memory is not counted against this share.
        let ended = listed.filter(|h| !same(h)).map_or(0, |h| self.share_units(a, h));
        let again = listed.is_some_and(same)
            || inner.pending.iter().any(|p| {
                p.gpu == a
                    && matches!(&p.kind, PendingKind::Share { slot: s, hold } if *s == slot && same(hold))
            });
        if !again {
            let occ = self.occupancy(&inner)[a];
            if occ.whole {
                return Err(RequestError::Unavailable(format!(
                    "GPU {index} is allocated whole; its memory cannot be shared"
                )));
            }
            let free = self.units_of(a).saturating_sub(occ.units.saturating_sub(ended));
            if free < units {
                return Err(RequestError::Unavailable(format!(
                    "GPU {index} has {} MiB free; {owner} ({container}) asks {} MiB",
                    free * self.unit_mib,
                    units * self.unit_mib
                )));
            }
        }
        let hold = ShareHold {
            owner: owner.to_string(),
            container: container.to_string(),
            units: Some(units),
        };
        inner
            .pending
            .retain(|p| !(p.gpu == a && matches!(&p.kind, PendingKind::Share { slot: s, .. } if *s == slot)));
        inner.pending.push(Pending {
            gpu: a,
            kind: PendingKind::Share { slot, hold },
            at: Instant::now(),
        });
        inner
            .share_units
            .insert((a, slot), (owner.to_string(), container.to_string(), units));
        drop(inner);
        self.bump();
        Ok((a, slot))
    }

    fn share_resource(&self) -> Result<&str, RequestError> {
        self.shares
            .as_ref()
            .map(|s| s.resource.as_str())
            .ok_or_else(|| RequestError::Invalid("this agent counts memory in units, not shares".into()))
    }

    /// GPU position and slot of a share ID, checked against this node.
    fn share_position(&self, id: &str) -> Result<(usize, u32), RequestError> {
        let resource = self.share_resource()?;
        let per_gpu = self.shares.as_ref().map_or(0, |s| s.per_gpu);
        devices::parse_share_id(id)
            .and_then(|(index, slot)| Some((self.position(index)?, slot)))
            .filter(|&(_, slot)| slot < per_gpu)
            .ok_or_else(|| unknown(resource, id))
    }

    // ----- DRA claims -----

    /// Records a prepared DRA claim, refusing what an Allocate would refuse: an unknown or unhealthy
    /// GPU, a whole GPU that holds shared memory, memory on a GPU held whole, or more memory than the
    /// GPU has left. Preparing a claim already recorded changes nothing.
    pub fn prepare_claim(&self, uid: &str, claim: PreparedClaim) -> Result<(), RequestError> {
        self.record_claim(uid, claim, true)
    }

    /// Records a claim already in use (adopted from the API server): the same checks but health, as
    /// a GPU that fell sick since still holds what its pod has.
    pub fn adopt_claim(&self, uid: &str, claim: PreparedClaim) -> Result<(), RequestError> {
        self.record_claim(uid, claim, false)
    }

    fn record_claim(&self, uid: &str, claim: PreparedClaim, check_health: bool) -> Result<(), RequestError> {
        let mut inner = self.lock();
        if inner.claims.contains_key(uid) {
            return Ok(());
        }
        let occ = self.occupancy(&inner);
        for &(a, share) in &claim.shares {
            let Some(gpu) = self.inventory.gpus.get(a) else {
                return Err(RequestError::Invalid(format!(
                    "claim {uid}: no GPU at position {a}"
                )));
            };
            if let Health::Unhealthy { reason, .. } = &inner.health[a]
                && check_health
            {
                return Err(RequestError::Unavailable(format!(
                    "GPU {} is unhealthy: {reason}",
                    gpu.index
                )));
            }
            match share {
                Share::Whole if occ[a].whole || occ[a].shared() => {
                    return Err(RequestError::Unavailable(format!(
                        "GPU {} is in use ({}); it cannot be prepared whole",
                        gpu.index,
                        if occ[a].whole {
                            "held whole"
                        } else {
                            "memory shared out"
                        }
                    )));
                }
                Share::Mib(_) if occ[a].whole => {
                    return Err(RequestError::Unavailable(format!(
                        "GPU {} is held whole; its memory cannot be shared",
                        gpu.index
                    )));
                }
                Share::Mib(mib) => {
                    let free = self.units_of(a).saturating_sub(occ[a].units) * self.unit_mib;
                    if mib > free {
                        return Err(RequestError::Unavailable(format!(
                            "GPU {} has {free} MiB free, the claim holds {mib} MiB",
                            gpu.index
                        )));
                    }
                }
                Share::Whole => {}
            }
        }
        inner.claims.insert(uid.to_string(), claim);
        drop(inner);
        self.bump();
        Ok(())
    }

    /// Puts back claims prepared before a restart (from the driver's checkpoint), unchecked: they
    /// were checked when prepared, and their containers may be running.
    pub fn restore_claims(&self, claims: impl IntoIterator<Item = (String, PreparedClaim)>) {
        let mut inner = self.lock();
        let n = self.inventory.gpus.len();
        for (uid, claim) in claims {
            if claim.shares.iter().all(|&(a, _)| a < n) {
                inner.claims.insert(uid, claim);
            }
        }
        drop(inner);
        self.bump();
    }

    /// Forgets a prepared claim; what it held, if it was recorded.
    pub fn unprepare_claim(&self, uid: &str) -> Option<PreparedClaim> {
        let removed = self.lock().claims.remove(uid);
        if removed.is_some() {
            self.bump();
        }
        removed
    }

    /// Position in the inventory of the GPU with NVML index `index`.
    pub fn position(&self, index: u32) -> Option<usize> {
        self.position_of_index.get(index as usize).copied().flatten()
    }

    /// The GPU position a memory unit ID names, reading only its `<gpu index>-` prefix: this runs
    /// once per offered unit, so it avoids hashing and allocation.
    fn unit_gpu(&self, id: &str) -> Result<usize, RequestError> {
        let digits = id.bytes().take_while(u8::is_ascii_digit).count();
        let index = if digits == 0 || digits > 4 || id.as_bytes().get(digits) != Some(&b'-') {
            None
        } else {
            id[..digits].parse::<usize>().ok()
        };
        index
            .and_then(|i| self.position_of_index.get(i).copied().flatten())
            .ok_or_else(|| unknown(&self.mem_resource, id))
    }

    /// GPU position and unit number of a memory unit ID, checked against this node.
    fn unit_position(&self, id: &str) -> Result<(usize, u64), RequestError> {
        let (index, n) = parse_unit_id(id).ok_or_else(|| unknown(&self.mem_resource, id))?;
        let a = self
            .position(index)
            .ok_or_else(|| unknown(&self.mem_resource, id))?;
        if n >= self.units_of(a) {
            return Err(unknown(&self.mem_resource, id));
        }
        Ok((a, n))
    }

    /// GPU usage rows, for tests and metrics.
    pub fn gpu_usage(&self) -> Vec<GpuUsage> {
        self.usage().gpus
    }
}

fn unknown(resource: &str, id: &str) -> RequestError {
    RequestError::Invalid(format!("{resource}: unknown device ID {id:?} on this node"))
}

/// `<gpu index>-<unit>` → (gpu index, unit).
pub fn parse_unit_id(id: &str) -> Option<(u32, u64)> {
    let (gpu, unit) = id.split_once('-')?;
    Some((gpu.parse().ok()?, unit.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::proto::HEALTHY;
    use crate::plugin::proto::podresources::{ContainerDevices, ContainerResources, PodResources};
    use gpumem_profile::Profile;

    fn state(profile: &str, unit_mib: u64) -> NodeState {
        let inventory = GpuInventory::discover(&Profile::load(profile).unwrap()).unwrap();
        NodeState::new(
            inventory,
            unit_mib,
            "nvidia.com/gpu".into(),
            "nvidia.com/gpu-mem".into(),
            HealthPolicy {
                ignored_xids: vec![13],
                quiet_period: Duration::ZERO,
            },
        )
    }

    fn ids(gpu: u32, range: std::ops::Range<u64>) -> Vec<String> {
        range.map(|n| devices::mem_unit_id(gpu, n)).collect()
    }

    fn healthy(devices: &[Device]) -> Vec<&str> {
        devices
            .iter()
            .filter(|d| d.health == HEALTHY)
            .map(|d| d.id.as_str())
            .collect()
    }

    fn pod(name: &str, resource: &str, device_ids: Vec<String>) -> PodResources {
        PodResources {
            name: name.into(),
            namespace: "default".into(),
            containers: vec![ContainerResources {
                name: "main".into(),
                devices: vec![ContainerDevices {
                    resource_name: resource.into(),
                    device_ids,
                    topology: None,
                }],
                ..Default::default()
            }],
        }
    }

    #[test]
    fn memory_goes_to_the_tightest_gpu_and_never_spans_two() {
        // t4x4 at 1024 MiB units: 15 units per GPU.
        let s = state("t4x4", 1024);
        // A pod holds 10 of GPU 1's 15 units; the kubelet offers the rest of the node.
        s.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![pod("a", "nvidia.com/gpu-mem", ids(1, 0..10))],
        });
        let mut available = ids(0, 0..15);
        available.extend(ids(1, 10..15));
        available.extend(ids(2, 0..15));
        let chosen = s.prefer_mem(&available, &[], 4, None).unwrap();
        assert_eq!(chosen, ids(1, 10..14));
        // The kubelet holding back units the books think free: the offer decides.
        let offer: Vec<String> = ids(0, 0..3).into_iter().chain(ids(2, 0..6)).collect();
        assert_eq!(s.prefer_mem(&offer, &[], 4, None).unwrap(), ids(2, 0..4));
        // The scorer's choice wins while it fits, and is ignored when it does not.
        let gpu2 = s.inventory.gpus[2].uuid.clone();
        assert_eq!(
            s.prefer_mem(&available, &[], 4, Some(&gpu2)).unwrap(),
            ids(2, 0..4)
        );
        let gpu1 = s.inventory.gpus[1].uuid.clone();
        assert_eq!(
            s.prefer_mem(&available, &[], 6, Some(&gpu1)).unwrap(),
            ids(0, 0..6)
        );
        // Must-include units pin the GPU.
        assert_eq!(
            s.prefer_mem(&available, &ids(2, 5..6), 2, None).unwrap(),
            vec!["2-5".to_string(), "2-0".to_string()]
        );

        // 4 GiB free on two GPUs never serves 5 GiB.
        let halves: Vec<String> = ids(0, 11..15).into_iter().chain(ids(3, 11..15)).collect();
        let err = s.prefer_mem(&halves, &[], 5, None).unwrap_err().to_string();
        assert!(err.contains("no single GPU has 5120 MiB free"), "{err}");
        assert!(err.contains("largest free block is 4096 MiB"), "{err}");

        let spanning: Vec<String> = ids(0, 0..2).into_iter().chain(ids(1, 0..2)).collect();
        let err = s.allocate_mem(&spanning).unwrap_err().to_string();
        assert!(err.contains("span several GPUs"), "{err}");
        assert!(
            s.allocate_mem(&["0-15".to_string()])
                .unwrap_err()
                .to_string()
                .contains("unknown device")
        );
        assert!(s.allocate_mem(&["zero".to_string()]).is_err());
    }

    #[test]
    fn whole_and_shared_exclude_each_other() {
        let s = state("t4x4", 1024);
        let uuid = |a: usize| s.inventory.gpus[a].uuid.clone();
        // Memory on GPU 0: its whole device turns unhealthy at once, before the kubelet lists it.
        assert_eq!(s.allocate_mem(&ids(0, 0..3)).unwrap(), (0, vec![0, 1, 2]));
        assert!(!healthy(&s.gpu_devices()).contains(&uuid(0).as_str()));
        let err = s.allocate_whole(&[uuid(0)]).unwrap_err().to_string();
        assert!(err.contains("is shared"), "{err}");
        // GPU 1 whole: its units stay Healthy (no flip for the kubelet to look up), and are refused.
        let mem_before = s.mem_devices();
        assert_eq!(s.allocate_whole(&[uuid(1)]).unwrap(), vec![1]);
        assert_eq!(
            s.mem_devices(),
            mem_before,
            "taking a GPU whole changes no memory unit"
        );
        let err = s
            .prefer_mem(&ids(1, 0..15), &[], 1, Some(&uuid(1)))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no single GPU"), "{err}");
        assert!(
            s.allocate_mem(&ids(1, 0..1))
                .unwrap_err()
                .to_string()
                .contains("allocated whole")
        );
        // And a preferred whole-GPU set never includes a shared GPU.
        let all: Vec<String> = (0..4).map(uuid).collect();
        assert_eq!(s.prefer_whole(&all, &[], 1).unwrap(), vec![uuid(1)]);
    }

    #[test]
    fn pod_resources_restore_the_picture_and_retire_pending_allocations() {
        let s = state("t4x4", 1024);
        let uuid = |a: usize| s.inventory.gpus[a].uuid.clone();
        // What an agent restart finds: a whole GPU and a shared one in use.
        let list = ListPodResourcesResponse {
            pod_resources: vec![
                pod("train", "nvidia.com/gpu", vec![uuid(2)]),
                pod("infer", "nvidia.com/gpu-mem", ids(3, 0..5)),
            ],
        };
        let mut changes = s.subscribe();
        s.apply_pod_resources(&list);
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        assert!(s.allocate_mem(&ids(2, 0..1)).is_err(), "GPU 2 is held whole");
        assert!(s.allocate_whole(&[uuid(3)]).is_err(), "GPU 3 is shared");
        let usage = s.gpu_usage();
        assert_eq!(usage[3].mode, GpuMode::Shared);
        assert_eq!(usage[3].allocated_mib, 5 * 1024);
        assert_eq!(usage[3].pods, vec!["default/infer".to_string()]);
        assert_eq!(usage[2].mode, GpuMode::Whole);

        // The same list again changes nothing visible.
        s.apply_pod_resources(&list);
        assert!(!changes.has_changed().unwrap());

        // A pod ends: its GPU is free again.
        s.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![pod("train", "nvidia.com/gpu", vec![uuid(2)])],
        });
        assert!(healthy(&s.gpu_devices()).contains(&uuid(3).as_str()));

        // Our own allocation stays until the kubelet lists it, then the listed picture takes over.
        s.allocate_mem(&ids(0, 0..2)).unwrap();
        assert_eq!(
            s.live_allocations(),
            BTreeMap::from([("g0-u0".to_string(), ALLOCATING_POD.to_string())])
        );
        s.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![],
        });
        assert_eq!(
            s.gpu_usage()[0].mode,
            GpuMode::Shared,
            "not listed yet: still pending"
        );
        s.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![pod("new", "nvidia.com/gpu-mem", ids(0, 0..2))],
        });
        assert_eq!(
            s.live_allocations(),
            BTreeMap::from([("g0-u0".to_string(), "default/new".to_string())]),
            "listed: its pod is known"
        );
        s.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![],
        });
        assert!(s.live_allocations().is_empty(), "gone");
        assert_eq!(
            s.gpu_usage()[0].mode,
            GpuMode::Free,
            "listed once, then gone: the pod ended"
        );
    }

    fn shared_state() -> NodeState {
        // t4x4 at 1 MiB: 15,360 units per GPU; 4 slots each.
        state("t4x4", 1).with_shares(ShareSlots {
            resource: devices::SHARE_RESOURCE.into(),
            per_gpu: 4,
        })
    }

    fn slots(gpu: u32, range: std::ops::Range<u32>) -> Vec<String> {
        range.map(|n| devices::share_id(gpu, n)).collect()
    }

    #[test]
    fn shares_count_what_their_containers_asked_and_exclude_whole_gpus() {
        let s = shared_state();
        let uuid = |a: usize| s.inventory.gpus[a].uuid.clone();
        let all: Vec<String> = (0..4).flat_map(|g| slots(g, 0..4)).collect();
        assert_eq!(s.share_devices().len(), 16);
        assert_eq!(s.healthy_units(), 4 * 15_360);

        // 10,000 MiB on GPU 1 leaves 5,360 there: a 6,000 MiB share goes elsewhere, a 5,000 one there.
        assert_eq!(
            s.allocate_share(&slots(1, 0..1), "ns/a", "main", 10_000).unwrap(),
            (1, 0)
        );
        let six = s.prefer_share(&all, &[], 1, 6_000, None).unwrap();
        assert_ne!(devices::parse_share_id(&six[0]).unwrap().0, 1, "{six:?}");
        let five = s.prefer_share(&all, &[], 1, 5_000, None).unwrap();
        assert_eq!(five, slots(1, 0..1), "the tightest GPU, the first slot offered");
        // The scorer's choice wins when it fits, and is passed over when it does not.
        assert_eq!(
            s.prefer_share(&all, &[], 1, 5_000, Some(&uuid(3))).unwrap(),
            slots(3, 0..1)
        );
        assert_eq!(
            s.prefer_share(&all, &[], 1, 6_000, Some(&uuid(1))).unwrap().len(),
            1
        );
        let err = s
            .allocate_share(&slots(1, 1..2), "ns/b", "main", 6_000)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("5360 MiB free") && err.contains("ns/b (main) asks 6000 MiB"),
            "{err}"
        );
        let err = s
            .prefer_share(&all, &[], 1, 16_000, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no GPU has 16000 MiB free"), "{err}");
        let err = s
            .allocate_share(&slots(0, 0..2), "ns/b", "main", 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("one share, not 2"), "{err}");
        assert!(
            s.allocate_share(&["0-s4".into()], "ns/b", "main", 1).is_err(),
            "slot 4 of 4"
        );
        assert!(
            s.allocate_share(&["0-3".into()], "ns/b", "main", 1).is_err(),
            "a unit ID"
        );

        // Whole and shared exclude each other, as with units.
        assert!(s.allocate_whole(&[uuid(1)]).is_err(), "GPU 1 holds a share");
        s.allocate_whole(&[uuid(2)]).unwrap();
        let err = s
            .allocate_share(&slots(2, 0..1), "ns/c", "main", 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("allocated whole"), "{err}");
        assert!(!healthy(&s.gpu_devices()).contains(&uuid(1).as_str()));

        // Usage names the pod from the start (it is known at Allocate).
        let usage = s.gpu_usage();
        assert_eq!((usage[1].mode, usage[1].allocated_mib), (GpuMode::Shared, 10_000));
        assert_eq!(usage[1].pods, vec!["ns/a".to_string()]);
        assert_eq!(
            s.live_allocations().get("g1-s0").map(String::as_str),
            Some("ns/a"),
            "the shim's accounting is named by GPU and slot"
        );
    }

    #[test]
    fn listed_shares_keep_their_size_and_unknown_ones_count_whole_until_read() {
        let s = shared_state();
        let share = |name: &str, id: &str| pod(name, devices::SHARE_RESOURCE, vec![id.to_string()]);
        s.allocate_share(&slots(0, 0..1), "default/a", "main", 3_000)
            .unwrap();
        s.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![share("a", "0-s0")],
        });
        assert_eq!(s.gpu_usage()[0].allocated_mib, 3_000, "listed: the size stays");
        assert!(s.pending_shares().is_empty(), "listed, no longer pending");
        assert!(s.holds_memory("default/a"));

        // The slot handed on while a listing still shows its earlier holder: the new share stays
        // pending (and live, under its new holder) until the kubelet lists it.
        s.allocate_share(&slots(0, 0..1), "default/next", "main", 1_000)
            .unwrap();
        s.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![share("a", "0-s0")],
        });
        assert_eq!(
            s.live_allocations().get("g0-s0").map(String::as_str),
            Some("default/next")
        );
        s.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![],
        });
        assert_eq!(
            s.gpu_usage()[0].allocated_mib,
            1_000,
            "still pending, not forgotten"
        );
        s.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![share("next", "0-s0")],
        });
        assert!(s.pending_shares().is_empty());
        assert_eq!(s.gpu_usage()[0].allocated_mib, 1_000, "listed now, with its size");

        // After a restart nothing is known of a listed share but its holder: the whole GPU counts.
        let restarted = shared_state();
        restarted.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![share("a", "0-s0"), share("b", "2-s3")],
        });
        assert_eq!(restarted.gpu_usage()[2].allocated_mib, 15_360);
        let err = restarted
            .allocate_share(&slots(2, 0..1), "default/c", "main", 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("0 MiB free"), "{err}");
        let mut unknown = restarted.unsized_shares();
        unknown.sort();
        assert_eq!(
            unknown,
            vec![
                ("0-s0".to_string(), "default/a".to_string(), "main".to_string()),
                ("2-s3".to_string(), "default/b".to_string(), "main".to_string()),
            ]
        );
        restarted.size_share("2-s3", "default/b", "main", 2_000);
        restarted.size_share("0-s0", "default/someone-else", "main", 1);
        assert_eq!(restarted.gpu_usage()[2].allocated_mib, 2_000);
        assert_eq!(
            restarted.unsized_shares().len(),
            1,
            "a size for another holder is ignored"
        );
        // A kubelet that has just restarted lists nobody for a moment: the sizes survive it.
        restarted.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![],
        });
        restarted.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![share("b", "2-s3")],
        });
        assert_eq!(restarted.gpu_usage()[2].allocated_mib, 2_000);
        // The next listing keeps the learned size; a slot passed to another pod starts unknown again.
        restarted.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![share("b", "2-s3")],
        });
        assert_eq!(restarted.gpu_usage()[2].allocated_mib, 2_000);
        restarted.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![share("d", "2-s3")],
        });
        assert_eq!(restarted.gpu_usage()[2].allocated_mib, 15_360);
        restarted.apply_pod_resources(&ListPodResourcesResponse {
            pod_resources: vec![],
        });
        assert_eq!(restarted.gpu_usage()[2].mode, GpuMode::Free, "gone");
    }

    #[test]
    fn a_sick_gpu_leaves_the_node_total_and_its_slots_turn_unhealthy() {
        let s = shared_state();
        s.record_xid(3, 48);
        assert_eq!(s.healthy_units(), 3 * 15_360);
        let unhealthy: Vec<String> = s
            .share_devices()
            .into_iter()
            .filter(|d| d.health != HEALTHY)
            .map(|d| d.id)
            .collect();
        assert_eq!(unhealthy, slots(3, 0..4));
        assert!(s.allocate_share(&slots(3, 0..1), "ns/a", "main", 1).is_err());
    }

    #[test]
    fn xids_make_a_gpu_unhealthy_until_it_is_quiet_and_answers() {
        let s = state("dgx-a100", 64);
        s.record_xid(4, 13);
        assert!(s.is_healthy(4), "application XIDs are ignored");
        s.record_xid(4, 79);
        assert!(!s.is_healthy(4));
        let uuid4 = s.inventory.gpus[4].uuid.clone();
        assert!(!healthy(&s.gpu_devices()).contains(&uuid4.as_str()));
        assert!(healthy(&s.mem_devices()).iter().all(|id| !id.starts_with("4-")));
        assert!(
            s.allocate_whole(&[uuid4])
                .unwrap_err()
                .to_string()
                .contains("XID 79")
        );
        // Quiet period zero: the next successful probe brings it back.
        s.record_answered(4);
        assert!(s.is_healthy(4));
    }

    #[test]
    fn topology_preference_skips_unknown_ids() {
        let s = state("dgx-a100", 64);
        let err = s
            .prefer_whole(&["GPU-nope".into()], &[], 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown device"), "{err}");
        let all: Vec<String> = s.inventory.gpus.iter().map(|g| g.uuid.clone()).collect();
        let four = s.prefer_whole(&all, &[], 4).unwrap();
        assert_eq!(four, all[0..4].to_vec());
    }
}
