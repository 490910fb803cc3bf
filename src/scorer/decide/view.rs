//! The policy's view of the cluster, kept between calls (one position per node, updated in place),
//! and the policies built for it.

use super::super::config::ScorerConfig;
use super::super::state::{NodeSnapshot, PodDemand};
use super::super::workload::CurrentMix;
use super::fit::*;
use crate::alloc::{self, Cluster, Gpu, GpuMask};
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// The policy's view of the cluster, kept between calls, and the policies built for it.
///
/// The view holds every node the scorer has been asked about, each at a fixed position (kube-scheduler
/// lists the candidates in a different order and subset every time); a call writes its candidates' state
/// into their positions and scores only them. The policies (one per request amount, each keeping its own
/// caches of per-node fragmentation and of per-node results for a repeated request) are built again only
/// when the view's shape changes: nodes, models, capacities, what [`alloc::build_policy`] reads of "a
/// cluster like" this one. So a call costs what changed since the last one, not the cluster's size in
/// fragmentation arithmetic.
#[derive(Default)]
pub struct PolicyCache {
    pub(super) view: std::sync::Mutex<View>,
}

impl PolicyCache {
    /// The models the view has seen that `allows` admits, as the policy's model set: what a pod
    /// restricted to them adds to the learned mix, so that the policy's scarcity term keeps those
    /// models for such pods. `None` when it admits every model seen (no restriction) or none of them.
    pub fn model_set(&self, allows: impl Fn(&str) -> bool) -> Option<alloc::ModelSet> {
        let view = self.view.lock().unwrap_or_else(|e| e.into_inner());
        let table = &view.cluster.models;
        let mut set = alloc::ModelSet::NONE;
        let mut every = true;
        for id in 0..table.len() as alloc::ModelId {
            if allows(table.name(id)) {
                set = set.with(id);
            } else {
                every = false;
            }
        }
        (!every && set != alloc::ModelSet::NONE).then_some(set)
    }
}

#[derive(Default)]
pub(super) struct View {
    pub(super) cluster: Cluster,
    /// Each node's position in `cluster.nodes`.
    pub(super) position: HashMap<String, u32, foldhash::fast::RandomState>,
    /// What each position was last written from.
    pub(super) written: Vec<Option<Written>>,
    /// Positions by the address of the node state in `written` (its allocation is held there, so no
    /// other state can have that address meanwhile): a node unchanged since the last call is found
    /// without its name.
    pub(super) by_address: HashMap<usize, u32, foldhash::fast::RandomState>,
    /// The call that last listed each node, to forget nodes that are gone.
    pub(super) listed: Vec<u64>,
    pub(super) calls: u64,
    /// Bumped when the shape changes; a policy built for another shape is stale.
    pub(super) shape: u64,
    /// Scratch for one call, by position: the index of the node's first fit, or [`NOT_LISTED`].
    pub(super) first: Vec<u32>,
    pub(super) policies: Vec<KeptPolicy>,
}

/// A node state and the parts of the pod that shape its view (see [`View::place`]).
pub(super) struct Written {
    /// Only its address is compared: a weak reference keeps the allocation (the address stays this
    /// node's) without keeping the node's GPUs in memory once no cache holds them.
    pub(super) node: Weak<NodeSnapshot>,
    pub(super) eligible: GpuMask,
    pub(super) cpu: u64,
    pub(super) memory: u64,
}

pub(super) struct KeptPolicy {
    pub(super) need: u64,
    /// The view's shape and the mix's generation it was built for.
    pub(super) shape: (u64, u64),
    pub(super) last_used: u64,
    pub(super) policy: Box<dyn alloc::Policy>,
}

/// At most this many policies (request amounts) are kept.
pub(super) const MAX_POLICIES: usize = 4;
/// A node no call has listed for this many calls is forgotten (deleted, or always filtered out earlier).
pub(super) const FORGET_AFTER_CALLS: u64 = 100_000;
/// Past this many nodes the view forgets every node the last call did not list. No cluster gets there
/// (Kubernetes is tested to 5,000 nodes); `Nodes`-form requests made of ever new nodes would, and
/// without this bound they would grow the view by up to [`super::super::extender::MAX_NODES`] nodes a call.
pub(super) const MAX_VIEW_NODES: usize = 2 * super::super::extender::MAX_NODES;

pub(super) const NOT_LISTED: u32 = u32::MAX;

impl View {
    /// Which fit of this call listed position `at` first, if any.
    pub(super) fn first_fit(&self, at: u32) -> Option<usize> {
        let k = *self.first.get(at as usize)?;
        (k != NOT_LISTED).then_some(k as usize)
    }

    /// Writes `node` as `pod` sees it (only `fit.eligible` GPUs have free memory) at its position.
    pub(super) fn place(&mut self, node: &Arc<NodeSnapshot>, fit: &Fit, pod: &PodDemand) -> u32 {
        // kube-scheduler checks CPU and memory; the policy must not refuse on them.
        let cpu = node.cpu_milli.max(pod.cpu_milli);
        let memory = node.memory_mib.max(pod.memory_mib);
        let address = Arc::as_ptr(node) as usize;
        if let Some(&at) = self.by_address.get(&address)
            && let Some(w) = &self.written[at as usize]
            && (w.eligible, w.cpu, w.memory) == (fit.eligible, cpu, memory)
        {
            // Written from this very state, for a pod that sees it the same way: nothing to do.
            self.listed[at as usize] = self.calls;
            return at;
        }
        // The node's model is its first GPU's, whatever the pod may use: it stays the same from pod to
        // pod (a change reshapes the view). A node of several models names each GPU's.
        let model_count = self.cluster.models.len();
        let gpus = node.gpus();
        let models = &mut self.cluster.models;
        let model = gpus
            .first()
            .and_then(|g| models.intern(&g.model).ok())
            .unwrap_or(0);
        let gpu_models: Vec<alloc::ModelId> = if gpus.iter().all(|g| g.model == gpus[0].model) {
            Vec::new()
        } else {
            gpus.iter()
                .map(|g| models.intern(&g.model).unwrap_or(0))
                .collect()
        };
        let mut same = self.cluster.models.len() == model_count;
        let at = match self.position.get(node.name.as_str()) {
            Some(&at) => at,
            None => {
                let at = self.cluster.nodes.len() as u32;
                let fresh = alloc::Node::new(node.name.clone(), model, cpu, memory, Vec::new());
                self.cluster.nodes.push(fresh);
                self.position.insert(node.name.clone(), at);
                self.listed.push(0);
                self.written.push(None);
                same = false;
                at
            }
        };
        self.listed[at as usize] = self.calls;
        let v = &mut self.cluster.nodes[at as usize];
        same &= v.model == model
            && v.gpu_models == gpu_models
            && v.cpu_capacity == cpu
            && v.memory_capacity == memory
            && v.gpus.len() == node.gpus().len();
        v.model = model;
        v.gpu_models = gpu_models;
        (v.cpu_capacity, v.cpu_free) = (cpu, cpu);
        (v.memory_capacity, v.memory_free) = (memory, memory);
        v.gpus.resize(node.gpus().len(), Gpu { capacity: 0, free: 0 });
        for (p, (g, out)) in node.gpus().iter().zip(v.gpus.iter_mut()).enumerate() {
            let capacity = u32::try_from(g.memory_mib).unwrap_or(u32::MAX);
            let free = if fit.eligible.contains(p) {
                u32::try_from(g.free_mib()).unwrap_or(u32::MAX)
            } else {
                0
            };
            same &= out.capacity == capacity;
            *out = Gpu { capacity, free };
        }
        if !same {
            self.shape += 1;
        }
        let written = Written {
            node: Arc::downgrade(node),
            eligible: fit.eligible,
            cpu,
            memory,
        };
        if let Some(old) = self.written[at as usize].replace(written) {
            self.by_address.remove(&(Weak::as_ptr(&old.node) as usize));
        }
        self.by_address.insert(address, at);
        at
    }

    /// Forgets the nodes no call listed for [`FORGET_AFTER_CALLS`] calls (checked now and then), or,
    /// past [`MAX_VIEW_NODES`], those the last call did not list. Runs before this call lists any.
    pub(super) fn forget_gone(&mut self) {
        let crowded = self.cluster.nodes.len() > MAX_VIEW_NODES;
        let keep_from = if crowded {
            self.calls.saturating_sub(1)
        } else {
            self.calls.saturating_sub(FORGET_AFTER_CALLS)
        };
        if !crowded && (!self.calls.is_multiple_of(4096) || !self.listed.iter().any(|&c| c < keep_from)) {
            return;
        }
        let keep: Vec<bool> = self.listed.iter().map(|&c| c >= keep_from).collect();
        let mut k = keep.iter();
        self.cluster.nodes.retain(|_| *k.next().unwrap_or(&true));
        let mut k = keep.iter();
        self.listed.retain(|_| *k.next().unwrap_or(&true));
        let mut k = keep.iter();
        self.written.retain(|_| *k.next().unwrap_or(&true));
        self.by_address = self
            .written
            .iter()
            .enumerate()
            .filter_map(|(i, w)| Some((Weak::as_ptr(&w.as_ref()?.node) as usize, i as u32)))
            .collect();
        self.position = self
            .cluster
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.clone(), i as u32))
            .collect();
        self.shape += 1;
    }

    /// Where in `policies` the policy for requests of `need` MiB is, built for the current shape.
    ///
    /// A policy's state does not depend on the amount (its caches are checked by node content, its memo
    /// by request): one per amount only keeps a memo per amount. So a new amount, with all places taken,
    /// takes over the least recently used policy if it was built for this shape, caches and all.
    pub(super) fn policy(&mut self, need: u64, cfg: &ScorerConfig, mix: &CurrentMix) -> Option<usize> {
        let (calls, shape) = (self.calls, (self.shape, mix.generation));
        let mix = mix.mix.as_ref();
        let lru = || (0..self.policies.len()).min_by_key(|&i| self.policies[i].last_used);
        let at = match self.policies.iter().position(|p| p.need == need) {
            Some(at) if self.policies[at].shape == shape => at,
            Some(at) => {
                self.policies[at].policy = alloc::build_policy(&cfg.policy, &self.cluster, mix)?;
                self.policies[at].shape = shape;
                at
            }
            None if self.policies.len() >= MAX_POLICIES => {
                let at = lru()?;
                if self.policies[at].shape != shape {
                    self.policies[at].policy = alloc::build_policy(&cfg.policy, &self.cluster, mix)?;
                    self.policies[at].shape = shape;
                }
                self.policies[at].need = need;
                at
            }
            None => {
                let policy = alloc::build_policy(&cfg.policy, &self.cluster, mix)?;
                self.policies.push(KeptPolicy {
                    need,
                    shape,
                    last_used: calls,
                    policy,
                });
                self.policies.len() - 1
            }
        };
        self.policies[at].last_used = calls;
        Some(at)
    }
}
