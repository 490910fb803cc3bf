//! The decisions, pure: which nodes can host a pod (and why not), how good each one is, and which
//! GPU(s) the pod gets there. The ranking runs the shared placement policy ([`crate::alloc`], the code
//! `gpumem simulate` measures) on the cluster as these nodes show it, then blends in the workload class
//! and, for multi-GPU pods, the topology of the chosen set.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Weak};

use rand::SeedableRng;

use super::config::Config;
use super::state::{Demand, NodeSnapshot, PodDemand, TopologyNeed, WorkloadClass};
use super::workload::CurrentMix;
use crate::alloc::local::{PairScores, best_gpu_set, pair_score};
use crate::alloc::{self, Cluster, Gpu, GpuDemand, GpuMask, ModelTable, Request, TypicalMix};
use crate::gpu::TopologyLevel;

/// Why a node cannot host the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub reason: String,
    /// A short metric label.
    pub category: &'static str,
    /// Preemption cannot help either.
    pub unresolvable: bool,
}

impl Rejection {
    fn new(reason: String, category: &'static str, unresolvable: bool) -> Rejection {
        Rejection {
            reason: bounded_reason(reason),
            category,
            unresolvable,
        }
    }
}

/// The longest reason given for one node, in bytes. A `filter` answer holds a reason per node (twice
/// for unresolvable ones), and a reason may quote a pod's or a node's annotation: without a bound, one
/// long annotation repeated for each of thousands of nodes makes an answer of gigabytes.
pub const MAX_REASON_BYTES: usize = 512;

/// `reason`, cut to [`MAX_REASON_BYTES`] at a character boundary (the cut marked with "...").
pub fn bounded_reason(mut reason: String) -> String {
    if reason.len() > MAX_REASON_BYTES {
        let mut end = MAX_REASON_BYTES - 3;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
        reason.push_str("...");
        reason.shrink_to_fit();
    }
    reason
}

/// A node that can host the pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// MiB on one GPU (memory requests), 0 for whole GPUs.
    pub need_mib: u64,
    /// GPU positions the pod may use (healthy, of an allowed model).
    pub eligible: GpuMask,
    /// For several whole GPUs: the best set meeting the topology need, and its pair score.
    pub set: Option<(Vec<usize>, u64)>,
}

/// Can `node` host `pod`? Looks only at GPUs: kube-scheduler checks CPU, memory, taints and affinity.
/// Runs for every candidate node of every call: it allocates only to explain a rejection.
pub fn check(node: &NodeSnapshot, pod: &PodDemand) -> Result<Fit, Rejection> {
    if let Some(problem) = &node.problem {
        return Err(Rejection::new(problem.clone(), "bad_annotation", true));
    }
    if node.gpus().is_empty() {
        return Err(Rejection::new("node has no GPUs".into(), "no_gpu", true));
    }
    // Node states never hold more than MAX_GPUS_PER_NODE GPUs (see `state`), so a mask holds them all.
    // Most pods accept any model: then the node's summary answers without reading its GPUs.
    let summary = node.summary();
    let (allowed, eligible) = match pod.models {
        None => (node.gpus().len(), summary.healthy),
        Some(_) => allowed_models(node, pod),
    };
    if allowed == 0 {
        let mut models: Vec<&str> = node.gpus().iter().map(|g| g.model.as_str()).collect();
        models.dedup();
        return Err(Rejection::new(
            format!(
                "no GPU of an allowed type: pod allows {}, node has {}",
                pod.models.as_ref().map_or(String::new(), |m| m.join(", ")),
                models.join(", ")
            ),
            "gpu_type",
            true,
        ));
    }
    if eligible.is_empty() {
        return Err(Rejection::new(
            format!("all {allowed} GPU(s) of an allowed type are unhealthy"),
            "unhealthy",
            true,
        ));
    }
    let note = || match allowed - eligible.count() as usize {
        0 => String::new(),
        unhealthy => format!(" ({unhealthy} unhealthy GPU(s) not counted)"),
    };
    match pod.demand {
        Demand::Memory { .. } => {
            let need = pod.memory_mib(node.unit_mib);
            let largest = if eligible == summary.healthy {
                summary.largest_free_mib
            } else {
                eligible
                    .iter()
                    .map(|p| node.gpus()[p].free_mib())
                    .max()
                    .unwrap_or(0)
            };
            if largest >= need {
                return Ok(Fit {
                    need_mib: need,
                    eligible,
                    set: None,
                });
            }
            let biggest = eligible
                .iter()
                .map(|p| node.gpus()[p].memory_mib)
                .max()
                .unwrap_or(0);
            let (extra, unresolvable) = if biggest < need {
                (
                    format!("; no GPU here has that much memory (largest: {biggest} MiB)"),
                    true,
                )
            } else {
                (String::new(), false)
            };
            Err(Rejection::new(
                format!(
                    "largest free GPU has {largest} MiB, pod needs {need} MiB{extra}{}",
                    note()
                ),
                "gpu_memory",
                unresolvable,
            ))
        }
        Demand::Whole { count } => {
            let n = count as usize;
            let idle = GpuMask(eligible.0 & summary.idle.0);
            let idle_count = idle.count() as usize;
            if idle_count < n {
                return Err(Rejection::new(
                    format!(
                        "pod needs {n} idle GPU(s), node has {idle_count} idle GPU(s) of an allowed type{}",
                        note()
                    ),
                    "idle_gpus",
                    (eligible.count() as usize) < n,
                ));
            }
            let set = if n > 1 {
                let idle: Vec<usize> = idle.iter().collect();
                match topology_set(node, &idle, n, pod.topology) {
                    Some(set) => Some(set),
                    None => {
                        return Err(Rejection::new(
                            format!(
                                "pod needs {n} idle GPUs{}, none of the sets of the {idle_count} idle GPUs qualifies",
                                pod.topology.describe(),
                            ),
                            "topology",
                            false,
                        ));
                    }
                }
            } else {
                None
            };
            Ok(Fit {
                need_mib: 0,
                eligible,
                set,
            })
        }
    }
}

/// How many of `node`'s GPUs are of a model `pod` allows, and which of those are healthy.
fn allowed_models(node: &NodeSnapshot, pod: &PodDemand) -> (usize, GpuMask) {
    let mut allowed = 0usize;
    let mut eligible = GpuMask::EMPTY;
    let mut last: Option<(&str, bool)> = None;
    for (p, g) in node.gpus().iter().enumerate() {
        // A node's GPUs are mostly of one model: compare each model once.
        let ok = match last {
            Some((m, ok)) if m == g.model => ok,
            _ => pod.allows_model(&g.model),
        };
        last = Some((&g.model, ok));
        if ok {
            allowed += 1;
            if g.healthy {
                eligible = eligible.with(p);
            }
        }
    }
    (allowed, eligible)
}

/// NVLink links from each GPU to each other one, by position (`n x n`): what [`GpuSnapshot::nvlinks_to`]
/// answers, read once (it searches a list; the searches below ask for every pair, often).
fn nvlink_table(node: &NodeSnapshot) -> Vec<u32> {
    let n = node.gpus().len();
    let mut links = vec![0; n * n];
    for (a, g) in node.gpus().iter().enumerate() {
        // In reverse, so that a peer listed twice counts as its first listing does in `nvlinks_to`.
        for &(b, l) in g.nvlink.iter().rev() {
            if b < n {
                links[a * n + b] = l;
            }
        }
    }
    links
}

/// Pair scores of a node's GPUs from the topology annotation (see [`pair_score`]).
pub fn pair_scores(node: &NodeSnapshot) -> PairScores {
    let n = node.gpus().len();
    let links = nvlink_table(node);
    PairScores::new(n, |a, b| {
        let (ga, gb) = (&node.gpus()[a], &node.gpus()[b]);
        let level = if ga.pcie_switch.is_some() && ga.pcie_switch == gb.pcie_switch {
            TopologyLevel::Single
        } else if ga.numa_node.is_some() && ga.numa_node == gb.numa_node {
            TopologyLevel::Node
        } else {
            TopologyLevel::System
        };
        pair_score(level, links[a * n + b])
    })
}

fn set_score(scores: &PairScores, set: &[usize]) -> u64 {
    let mut total = 0;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            total += u64::from(scores.get(a, b));
        }
    }
    total
}

/// The best `n` idle GPUs meeting `need`, with their pair score.
fn topology_set(
    node: &NodeSnapshot,
    idle: &[usize],
    n: usize,
    need: TopologyNeed,
) -> Option<(Vec<usize>, u64)> {
    let scores = pair_scores(node);
    let groups: Vec<Vec<usize>> = match need {
        TopologyNeed::Any => vec![idle.to_vec()],
        TopologyNeed::Numa | TopologyNeed::PcieSwitch => {
            let mut by: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
            for &p in idle {
                let g = &node.gpus()[p];
                if let Some(k) = if need == TopologyNeed::Numa {
                    g.numa_node
                } else {
                    g.pcie_switch
                } {
                    by.entry(k).or_default().push(p);
                }
            }
            by.into_values().collect()
        }
        TopologyNeed::NvLink => return nvlink_clique(node, &scores, idle, n),
    };
    groups
        .iter()
        .filter(|g| g.len() >= n)
        .filter_map(|g| best_gpu_set(&scores, g, &[], n).ok())
        .map(|set| {
            let s = set_score(&scores, &set);
            (set, s)
        })
        .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
}

/// Steps the NVLink search takes at most: on up to 8 GPUs it sees every set (at most 2^8 x 8 steps),
/// beyond that it returns the best set found within the budget. A step costs a mask test and, for a
/// GPU added, one pair score per GPU already in the set.
pub const NVLINK_SEARCH_STEPS: u32 = 20_000;

/// The best-scoring set of `n` idle GPUs that are all NVLinked pairwise, searched in order of position
/// (the first of equal sets wins) within [`NVLINK_SEARCH_STEPS`].
fn nvlink_clique(
    node: &NodeSnapshot,
    scores: &PairScores,
    idle: &[usize],
    n: usize,
) -> Option<(Vec<usize>, u64)> {
    // `into[g]`: the GPUs with an NVLink to g (as `nvlinks_to` reads it, from their side).
    let count = node.gpus().len();
    let links = nvlink_table(node);
    let mut into = vec![GpuMask::EMPTY; count];
    for a in 0..count {
        for (b, into) in into.iter_mut().enumerate() {
            if links[a * count + b] > 0 {
                *into = into.with(a);
            }
        }
    }
    struct Search<'a> {
        idle: &'a [usize],
        n: usize,
        scores: &'a PairScores,
        into: &'a [GpuMask],
        stack: Vec<usize>,
        budget: u32,
        best: Option<(Vec<usize>, u64)>,
    }
    impl Search<'_> {
        /// Extends the stack (linked pairwise, `members`, its pair scores summing to `score`) with GPUs
        /// of `idle[start..]`.
        fn grow(&mut self, start: usize, members: GpuMask, score: u64) {
            if self.stack.len() == self.n {
                if self.best.as_ref().is_none_or(|(_, b)| score > *b) {
                    self.best = Some((self.stack.clone(), score));
                }
                return;
            }
            for i in start..self.idle.len() {
                // Out of steps, or too few GPUs left to complete a set.
                if self.budget == 0 || self.idle.len() - i < self.n - self.stack.len() {
                    return;
                }
                self.budget -= 1;
                let g = self.idle[i];
                if members.0 & !self.into[g].0 == 0 {
                    // Pair scores in set order, as `set_score` sums them.
                    let added: u64 = self.stack.iter().map(|&s| u64::from(self.scores.get(s, g))).sum();
                    self.stack.push(g);
                    self.grow(i + 1, members.with(g), score + added);
                    self.stack.pop();
                }
            }
        }
    }
    let mut search = Search {
        idle,
        n,
        scores,
        into: &into,
        stack: Vec::with_capacity(n),
        budget: NVLINK_SEARCH_STEPS,
        best: None,
    };
    search.grow(0, GpuMask::EMPTY, 0);
    search.best
}

/// One feasible node's ranking.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// `MIN_EXTENDER_PRIORITY..=MAX_EXTENDER_PRIORITY`.
    pub score: i64,
    /// The blend before rounding, 0..=1.
    pub raw: f64,
    /// GPU positions the pod would get.
    pub gpus: GpuMask,
}

/// `pod` in the placement policy's terms, asking `need_mib` of one GPU if it is a memory pod: what
/// the policy ranks, and what the learned mix counts ([`super::workload`]). Allowed models are not
/// carried: the policy reads them from the node's eligible GPUs.
pub fn request_of(pod: &PodDemand, need_mib: u64) -> Request {
    Request {
        cpu_milli: pod.cpu_milli,
        memory_mib: pod.memory_mib,
        gpu: match pod.demand {
            Demand::Memory { .. } => GpuDemand::Shared {
                amount: u32::try_from(need_mib).unwrap_or(u32::MAX),
            },
            Demand::Whole { count } => GpuDemand::Whole { count },
        },
        models: None,
    }
}

/// The configured typical request mix (`typicalMix`), in MiB: the prior of the learned one.
pub fn typical_mix(cfg: &Config) -> TypicalMix {
    let total: f64 = cfg.typical_mix.iter().map(|t| t.share.max(0.0)).sum();
    let types = cfg
        .typical_mix
        .iter()
        .filter(|t| t.share > 0.0)
        .map(|t| alloc::frag::TypicalType {
            cpu_milli: 0,
            memory_mib: 0,
            gpu: match (t.memory_mib, t.whole_gpus) {
                (Some(m), _) => GpuDemand::Shared {
                    amount: u32::try_from(m).unwrap_or(u32::MAX),
                },
                (None, Some(c)) => GpuDemand::Whole { count: c },
                (None, None) => GpuDemand::None,
            },
            models: None,
            popularity: t.share / total,
        })
        .collect();
    TypicalMix {
        types,
        all: Vec::new(),
    }
}

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
    view: std::sync::Mutex<View>,
}

#[derive(Default)]
struct View {
    cluster: Cluster,
    /// Each node's position in `cluster.nodes`.
    position: HashMap<String, u32, foldhash::fast::RandomState>,
    /// What each position was last written from.
    written: Vec<Option<Written>>,
    /// Positions by the address of the node state in `written` (its allocation is held there, so no
    /// other state can have that address meanwhile): a node unchanged since the last call is found
    /// without its name.
    by_address: HashMap<usize, u32, foldhash::fast::RandomState>,
    /// The call that last listed each node, to forget nodes that are gone.
    listed: Vec<u64>,
    calls: u64,
    /// Bumped when the shape changes; a policy built for another shape is stale.
    shape: u64,
    /// Scratch for one call, by position: the index of the node's first fit, or [`NOT_LISTED`].
    first: Vec<u32>,
    policies: Vec<KeptPolicy>,
}

/// A node state and the parts of the pod that shape its view (see [`View::place`]).
struct Written {
    /// Only its address is compared: a weak reference keeps the allocation (the address stays this
    /// node's) without keeping the node's GPUs in memory once no cache holds them.
    node: Weak<NodeSnapshot>,
    eligible: GpuMask,
    cpu: u64,
    memory: u64,
}

struct KeptPolicy {
    need: u64,
    /// The view's shape and the mix's generation it was built for.
    shape: (u64, u64),
    last_used: u64,
    policy: Box<dyn alloc::Policy>,
}

/// At most this many policies (request amounts) are kept.
const MAX_POLICIES: usize = 4;
/// A node no call has listed for this many calls is forgotten (deleted, or always filtered out earlier).
const FORGET_AFTER_CALLS: u64 = 100_000;
/// Past this many nodes the view forgets every node the last call did not list. No cluster gets there
/// (Kubernetes is tested to 5,000 nodes); `Nodes`-form requests made of ever new nodes would, and
/// without this bound they would grow the view by up to [`super::extender::MAX_NODES`] nodes a call.
const MAX_VIEW_NODES: usize = 2 * super::extender::MAX_NODES;

const NOT_LISTED: u32 = u32::MAX;

impl View {
    /// Which fit of this call listed position `at` first, if any.
    fn first_fit(&self, at: u32) -> Option<usize> {
        let k = *self.first.get(at as usize)?;
        (k != NOT_LISTED).then_some(k as usize)
    }

    /// Writes `node` as `pod` sees it (only `fit.eligible` GPUs have free memory) at its position.
    fn place(&mut self, node: &Arc<NodeSnapshot>, fit: &Fit, pod: &PodDemand) -> u32 {
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
        let model_count = self.cluster.models.len();
        let model = fit
            .eligible
            .iter()
            .next()
            .and_then(|p| self.cluster.models.intern(&node.gpus()[p].model).ok())
            .unwrap_or(0);
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
            && v.cpu_capacity == cpu
            && v.memory_capacity == memory
            && v.gpus.len() == node.gpus().len();
        v.model = model;
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
    fn forget_gone(&mut self) {
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
    fn policy(&mut self, need: u64, cfg: &Config, mix: &CurrentMix) -> Option<usize> {
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

/// Ranks `nodes` for `pod`: a score for each node that can host it ([`check`]), `None` for the others.
/// The online weight follows the share of GPU memory allocated over `nodes`. `cache` keeps the
/// policy's view between calls (a fresh [`PolicyCache`] gives the same answers, only slower).
pub fn prioritize(
    nodes: &[Arc<NodeSnapshot>],
    pod: &PodDemand,
    cfg: &Config,
    cache: &PolicyCache,
    mix: &CurrentMix,
) -> Vec<Option<Scored>> {
    let mut fits: Vec<(usize, Fit)> = Vec::new();
    let (mut used, mut total) = (0u64, 0u64);
    // The view stays locked until the end: the ranking reads GPU figures from it (compact, and just
    // read by the policy), not from the node states.
    let mut view = cache.view.lock().unwrap_or_else(|e| e.into_inner());
    view.calls += 1;
    view.forget_gone();
    // Each fit's position in the view; a node listed twice is scored once, for its first listing.
    let mut at_of: Vec<u32> = Vec::with_capacity(nodes.len());
    let mut repeated: Vec<(usize, usize)> = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        if n.problem.is_none() {
            let s = n.summary();
            (used, total) = (used + s.allocated_mib, total + s.total_mib);
        }
        if let Ok(fit) = check(n, pod) {
            let at = view.place(n, &fit, pod);
            let k = fits.len();
            match view.first_fit(at) {
                Some(first) => repeated.push((k, first)),
                None => {
                    let len = view.cluster.nodes.len();
                    view.first.resize(len, NOT_LISTED);
                    view.first[at as usize] = k as u32;
                }
            }
            at_of.push(at);
            fits.push((i, fit));
        }
    }
    let mut policy_score: Vec<Option<(f64, GpuMask)>> = vec![None; fits.len()];
    // Nodes with different memory units turn one request into different MiB: one policy run per amount.
    let mut needs: Vec<u64> = fits.iter().map(|(_, f)| f.need_mib).collect();
    needs.sort_unstable();
    needs.dedup();
    let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(1);
    let mut out = Vec::new();
    for need in needs {
        // Ascending positions, as `score_nodes` takes them: a scan of the view, cheaper than a sort.
        let members: Vec<u32> = (0..view.first.len() as u32)
            .filter(|&at| view.first_fit(at).is_some_and(|k| fits[k].1.need_mib == need))
            .collect();
        let req = request_of(pod, need);
        let Some(at) = view.policy(need, cfg, mix) else {
            continue;
        };
        let View {
            cluster, policies, ..
        } = &mut *view;
        policies[at]
            .policy
            .score_nodes(cluster, &members, &req, &mut rng, &mut out);
        for c in &out {
            if let Some(k) = view.first_fit(c.node) {
                policy_score[k] = Some((c.score, c.gpus));
            }
        }
    }
    for &(k, first) in &repeated {
        if fits[k].1.need_mib == fits[first].1.need_mib {
            policy_score[k] = policy_score[first];
        }
    }
    for &at in &at_of {
        view.first[at as usize] = NOT_LISTED;
    }
    let load = if total == 0 {
        0.0
    } else {
        used as f64 / total as f64
    };
    let (lo, hi) = policy_score
        .iter()
        .flatten()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (s, _)| {
            (lo.min(*s), hi.max(*s))
        });
    let best_set = fits
        .iter()
        .filter_map(|(_, f)| f.set.as_ref().map(|(_, s)| *s))
        .max()
        .unwrap_or(0);
    let class_weight = match pod.class {
        WorkloadClass::Online if load > cfg.hot_threshold => cfg.hot_online_weight,
        WorkloadClass::Online => cfg.online_weight,
        WorkloadClass::Offline => cfg.offline_weight,
    }
    .clamp(0.0, 1.0);
    let mut ranked: Vec<Option<Scored>> = vec![None; nodes.len()];
    for (((i, fit), policy), at) in fits.iter().zip(policy_score).zip(at_of) {
        ranked[*i] = Some({
            let n = &nodes[*i];
            // The node as the view holds it: the GPUs the pod may use have their free memory.
            let view_gpus = &view.cluster.nodes[at as usize].gpus;
            let free = |p: usize| u64::from(view_gpus[p].free);
            let memory = |p: usize| u64::from(view_gpus[p].capacity);
            let (policy_term, policy_gpus) = match policy {
                Some((s, gpus)) if hi > lo => ((s - lo) / (hi - lo), gpus),
                Some((_, gpus)) => (1.0, gpus),
                None => (0.0, GpuMask::EMPTY),
            };
            let gpus = match (&fit.set, pod.demand) {
                (Some((set, _)), _) => set.iter().fold(GpuMask::EMPTY, |m, &p| m.with(p)),
                _ if !policy_gpus.is_empty() => policy_gpus,
                (None, Demand::Memory { .. }) => fit
                    .eligible
                    .iter()
                    .filter(|&p| free(p) >= fit.need_mib)
                    .min_by_key(|&p| (free(p), p))
                    .map_or(GpuMask::EMPTY, GpuMask::single),
                (None, Demand::Whole { count }) => GpuMask(fit.eligible.0 & n.summary().idle.0)
                    .iter()
                    .take(count as usize)
                    .fold(GpuMask::EMPTY, GpuMask::with),
            };
            // How much room the placement leaves: on the GPU used (memory), on the node (whole GPUs).
            let room = match pod.demand {
                Demand::Memory { .. } => gpus.iter().next().map_or(0.0, |p| {
                    free(p).saturating_sub(fit.need_mib) as f64 / memory(p).max(1) as f64
                }),
                Demand::Whole { .. } => {
                    let total: u64 = fit.eligible.iter().map(memory).sum();
                    let taken: u64 = gpus.iter().map(memory).sum();
                    let free: u64 = fit.eligible.iter().map(free).sum();
                    free.saturating_sub(taken) as f64 / total.max(1) as f64
                }
            };
            let class_term = match pod.class {
                WorkloadClass::Online => room,
                WorkloadClass::Offline => 1.0 - room,
            };
            let base = match &fit.set {
                Some((_, s)) if best_set > 0 => 0.5 * policy_term + 0.5 * (*s as f64 / best_set as f64),
                _ => policy_term,
            };
            let raw = (class_weight * class_term + (1.0 - class_weight) * base).clamp(0.0, 1.0);
            let score = (raw * super::extender::MAX_EXTENDER_PRIORITY as f64).round() as i64;
            Scored { score, raw, gpus }
        });
    }
    ranked
}

/// The cluster's GPU memory picture, for the gauges.
#[derive(Debug, Clone, PartialEq)]
pub struct Fragmentation {
    /// Share of the idle GPU memory (healthy GPUs) that the typical mix cannot use, over all nodes.
    pub cluster: f64,
    /// The same per node (0 for a node with no idle GPU memory); nodes with bad annotations are left out.
    pub nodes: Vec<(String, f64)>,
    /// Allocated GPU memory over total, on healthy GPUs.
    pub allocated: f64,
}

/// The fragmentation of `nodes` by the shared policy's measure ([`alloc::frag`], FGD's, against `mix`,
/// the one the policy protects), as a share of idle GPU memory; and the allocated share. Unhealthy GPUs
/// and nodes with bad annotations count nowhere.
pub fn fragmentation(nodes: &[&NodeSnapshot], mix: &TypicalMix) -> Fragmentation {
    let mut models = ModelTable::default();
    let view: Vec<(&str, alloc::Node)> = nodes
        .iter()
        .filter(|n| n.problem.is_none())
        .map(|n| {
            let healthy = || n.gpus().iter().filter(|g| g.healthy);
            let model = healthy()
                .next()
                .and_then(|g| models.intern(&g.model).ok())
                .unwrap_or(0);
            let gpus = healthy()
                .map(|g| Gpu {
                    capacity: u32::try_from(g.memory_mib).unwrap_or(u32::MAX),
                    free: u32::try_from(g.free_mib()).unwrap_or(u32::MAX),
                })
                .collect();
            let node = alloc::Node::new(String::new(), model, n.cpu_milli, n.memory_mib, gpus);
            (n.name.as_str(), node)
        })
        .collect();
    let model = alloc::FragModel::new(mix, &models, false);
    let (mut frag, mut free, mut capacity) = (0.0, 0u64, 0u64);
    let mut per_node = Vec::with_capacity(view.len());
    for (name, node) in &view {
        let f = model.node_frag(node);
        let idle = node.gpu_free_total();
        frag += f;
        free += idle;
        capacity += node.gpu_capacity_total();
        per_node.push((name.to_string(), if idle == 0 { 0.0 } else { f / idle as f64 }));
    }
    let ratio = |a: f64, b: u64| if b == 0 { 0.0 } else { a / b as f64 };
    Fragmentation {
        cluster: ratio(frag, free),
        nodes: per_node,
        allocated: ratio(capacity.saturating_sub(free) as f64, capacity),
    }
}

#[cfg(test)]
mod tests {
    use super::super::state::GpuSnapshot;
    use super::*;

    fn gpu(i: usize, memory: u64, free: u64) -> GpuSnapshot {
        GpuSnapshot {
            numa_node: Some((i / 4) as u32),
            pcie_switch: Some((i / 2) as u32),
            ..GpuSnapshot::for_tests(i, "NVIDIA A100-SXM4-80GB", memory, memory - free)
        }
    }

    fn node(name: &str, gpus: Vec<GpuSnapshot>) -> NodeSnapshot {
        let mut node = NodeSnapshot::with_gpus(name, 1, gpus);
        (node.cpu_milli, node.memory_mib) = (64_000, 512_000);
        node
    }

    fn pod(demand: Demand, class: WorkloadClass) -> PodDemand {
        PodDemand {
            key: "ns/p".into(),
            uid: "u".into(),
            demand,
            models: None,
            topology: TopologyNeed::Any,
            class,
            cpu_milli: 1000,
            memory_mib: 1024,
        }
    }

    #[test]
    fn the_node_summary_answers_as_the_gpus_do() {
        // `check` reads a node's summary, not its GPUs: its answers must be what the GPUs say, also
        // after they change in place.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..300 {
            let gpus = (0..1 + next(8) as usize)
                .map(|i| {
                    let memory = [16384, 81920][next(2) as usize];
                    let mut g = gpu(i, memory, [0, 4096, 16384, memory][next(4) as usize].min(memory));
                    g.whole = next(5) == 0;
                    g.healthy = next(4) != 0;
                    g
                })
                .collect();
            let mut n = node("n", gpus);
            for change in 0..2 {
                if change == 1 {
                    let mut gpus = n.gpus_mut();
                    let p = next(gpus.len() as u64) as usize;
                    gpus[p].allocated_mib = 0;
                    gpus[p].whole = !gpus[p].whole;
                    gpus[p].healthy = !gpus[p].healthy;
                }
                let healthy = || n.gpus().iter().filter(|g| g.healthy);
                let eligible = (0..n.gpus().len())
                    .filter(|&p| n.gpus()[p].healthy)
                    .fold(GpuMask::EMPTY, GpuMask::with);
                let need = 1 + next(20000);
                let fits = check(&n, &pod(Demand::Memory { units: need }, WorkloadClass::Online));
                let room = healthy().map(|g| g.free_mib()).max().unwrap_or(0);
                assert_eq!(
                    fits.as_ref().ok().map(|f| f.eligible),
                    (room >= need).then_some(eligible)
                );
                if let Err(r) = fits {
                    assert!(r.reason.starts_with(&format!("largest free GPU has {room} MiB")) || room == 0);
                }
                let idle = healthy().filter(|g| g.is_idle()).count() as u32;
                for count in [1, 2] {
                    let fits = check(&n, &pod(Demand::Whole { count }, WorkloadClass::Online));
                    assert_eq!(fits.is_ok(), idle >= count, "{count} of {:?}", n.gpus());
                }
                assert_eq!(
                    (n.summary().allocated_mib, n.summary().total_mib),
                    n.gpus().iter().fold((0, 0), |(a, t), g| (
                        a + g.memory_mib - g.free_mib(),
                        t + g.memory_mib
                    ))
                );
            }
        }
    }

    #[test]
    fn per_gpu_fit_not_node_sum() {
        let halves = node("a", vec![gpu(0, 16384, 4096), gpu(1, 16384, 4096)]);
        let p = pod(Demand::Memory { units: 5000 }, WorkloadClass::Offline);
        let r = check(&halves, &p).expect_err("4096 + 4096 never holds 5000");
        assert_eq!(r.reason, "largest free GPU has 4096 MiB, pod needs 5000 MiB");
        assert!(!r.unresolvable);
        let one = node("b", vec![gpu(0, 16384, 6000)]);
        assert_eq!(check(&one, &p).map(|f| f.need_mib), Ok(5000));
    }

    #[test]
    fn reasons_are_cut_at_a_character_boundary() {
        let short = "largest free GPU has 4096 MiB".to_string();
        assert_eq!(bounded_reason(short.clone()), short);
        let long = "é".repeat(MAX_REASON_BYTES);
        let cut = bounded_reason(long);
        assert!(cut.len() <= MAX_REASON_BYTES && cut.ends_with("é..."), "{cut}");
        let models = format!("no GPU of an allowed type: pod allows {}", "x,".repeat(10_000));
        let rejection = Rejection::new(models, "gpu_type", true);
        assert_eq!(rejection.reason.len(), MAX_REASON_BYTES);
    }

    #[test]
    fn topology_needs_pick_qualifying_sets() {
        // 4 idle GPUs: 0,1 on switch 0 / NUMA 0, 2,3 on switch 1 / NUMA 0; 4 is on NUMA 1.
        let mut gpus: Vec<GpuSnapshot> = (0..5).map(|i| gpu(i, 16384, 16384)).collect();
        gpus[4].numa_node = Some(1);
        gpus[4].pcie_switch = Some(9);
        gpus[2].nvlink = vec![(4, 2)];
        gpus[4].nvlink = vec![(2, 2)];
        let n = node("a", gpus);
        let mut p = pod(Demand::Whole { count: 2 }, WorkloadClass::Offline);
        p.topology = TopologyNeed::NvLink;
        assert_eq!(check(&n, &p).expect("fits").set.map(|s| s.0), Some(vec![2, 4]));
        p.topology = TopologyNeed::PcieSwitch;
        assert_eq!(check(&n, &p).expect("fits").set.map(|s| s.0), Some(vec![0, 1]));
        p.demand = Demand::Whole { count: 3 };
        assert!(check(&n, &p).is_err_and(|r| r.category == "topology"));
        p.topology = TopologyNeed::Numa;
        assert_eq!(check(&n, &p).expect("fits").set.map(|s| s.0.len()), Some(3));
    }

    /// The `n`-subsets of `items`, in lexicographic order.
    fn subsets(items: &[usize], n: usize) -> Vec<Vec<usize>> {
        if n == 0 {
            return vec![Vec::new()];
        }
        (0..items.len())
            .flat_map(|i| {
                subsets(&items[i + 1..], n - 1).into_iter().map(move |mut rest| {
                    rest.insert(0, items[i]);
                    rest
                })
            })
            .collect()
    }

    #[test]
    fn nvlink_sets_on_up_to_8_gpus_are_the_best_of_all_sets() {
        // Random NVLink wiring (one-sided links too), idle GPUs and set sizes: the bounded search
        // answers what looking at every set answers, the first of equals winning.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut found = 0;
        for _ in 0..400 {
            let count = 2 + next(7) as usize;
            let mut gpus: Vec<GpuSnapshot> = (0..count).map(|i| gpu(i, 81920, 81920)).collect();
            for (a, g) in gpus.iter_mut().enumerate() {
                g.whole = next(5) == 0;
                g.nvlink = Vec::new();
                for b in (0..count).filter(|&b| b != a) {
                    if next(3) != 0 {
                        g.nvlink.push((b, 1 + next(3) as u32));
                    }
                }
            }
            let n = node("n", gpus);
            let links = nvlink_table(&n);
            for a in 0..count {
                for b in 0..count {
                    assert_eq!(links[a * count + b], n.gpus()[a].nvlinks_to(b));
                }
            }
            let idle: Vec<usize> = (0..count).filter(|&p| n.gpus()[p].is_idle()).collect();
            let size = 2 + next(count as u64 - 1) as usize;
            let scores = pair_scores(&n);
            let mut best: Option<(Vec<usize>, u64)> = None;
            for set in subsets(&idle, size) {
                let linked = set
                    .iter()
                    .enumerate()
                    .all(|(i, &a)| set[i + 1..].iter().all(|&b| n.gpus()[a].nvlinks_to(b) > 0));
                let score = set_score(&scores, &set);
                if linked && best.as_ref().is_none_or(|(_, b)| score > *b) {
                    best = Some((set, score));
                }
            }
            found += usize::from(best.is_some());
            assert_eq!(nvlink_clique(&n, &scores, &idle, size), best, "{:?}", n.gpus());
        }
        assert!(found > 100, "only {found} of 400 nodes had a set");
    }

    #[test]
    fn the_largest_node_and_pod_get_a_set_within_the_search_bounds() {
        // 64 GPUs (node::MAX_GPUS), every pair NVLinked: 32 of them all linked, or any 61.
        let gpus: Vec<GpuSnapshot> = (0..64)
            .map(|i| GpuSnapshot {
                nvlink: (0..64).filter(|&p| p != i).map(|p| (p, 18)).collect(),
                ..gpu(i, 81920, 81920)
            })
            .collect();
        let n = node("big", gpus);
        let mut p = pod(Demand::Whole { count: 32 }, WorkloadClass::Offline);
        p.topology = TopologyNeed::NvLink;
        let (set, score) = check(&n, &p).expect("fits").set.expect("a set");
        assert_eq!(set.len(), 32);
        assert_eq!(score, set_score(&pair_scores(&n), &set));
        p.demand = Demand::Whole { count: 61 };
        p.topology = TopologyNeed::Any;
        let (set, _) = check(&n, &p).expect("fits").set.expect("a set");
        assert_eq!(set.len(), 61);
        assert!(set.windows(2).all(|w| w[0] < w[1]), "{set:?}");
    }

    #[test]
    fn the_kept_policy_view_answers_as_a_fresh_one() {
        let cfg = Config::default();
        let kept = PolicyCache::default();
        // Shared states, changed as the node cache changes them: a new state for a new version.
        let mut nodes: Vec<Arc<NodeSnapshot>> = (0..7)
            .map(|i| {
                let gpus = (0..4)
                    .map(|g| gpu(g, 16384, [16384, 9000, 6000, 12000][(i + g) % 4]))
                    .collect();
                Arc::new(node(&format!("n{i}"), gpus))
            })
            .collect();
        // Answers by node name, whatever the order of the call.
        // The configured mix, then (from round 8) a learned one: a new generation rebuilds the policies.
        let configured = CurrentMix::fixed(typical_mix(&cfg));
        // What a cluster of 9000 MiB jobs would teach it.
        let nine = alloc::frag::TypicalType {
            cpu_milli: 0,
            memory_mib: 0,
            gpu: GpuDemand::Shared { amount: 9000 },
            models: None,
            popularity: 1.0,
        };
        let learned = TypicalMix {
            types: vec![nine],
            all: vec![nine],
        };
        let learned = CurrentMix {
            mix: Arc::new(learned),
            generation: 1,
        };
        let run = |nodes: &[Arc<NodeSnapshot>],
                   order: &[usize],
                   p: &PodDemand,
                   cache: &PolicyCache,
                   mix: &CurrentMix| {
            let refs: Vec<Arc<NodeSnapshot>> = order.iter().map(|&i| nodes[i].clone()).collect();
            let mut answers: Vec<(String, Option<Scored>)> = refs
                .iter()
                .map(|n| n.name.clone())
                .zip(prioritize(&refs, p, &cfg, cache, mix))
                .collect();
            answers.sort_by(|a, b| a.0.cmp(&b.0));
            answers
        };
        let all: Vec<usize> = (0..7).collect();
        // Six amounts, more than the policies kept: some repeat, some take over another's policy.
        let sizes = [5000, 3000, 5000, 1000, 7000, 2000, 9000, 5000];
        for round in 0..16 {
            // Another order each call, as kube-scheduler sends them.
            let order: Vec<usize> = (0..7).map(|k| (k * 3 + round) % 7).collect();
            let p = pod(
                Demand::Memory {
                    units: sizes[round % 8],
                },
                WorkloadClass::Offline,
            );
            let fresh = PolicyCache::default();
            let mix = if round < 8 { &configured } else { &learned };
            if round == 8 {
                // The two mixes rank differently: a kept policy of the old mix would be caught.
                assert_ne!(
                    run(&nodes, &all, &p, &PolicyCache::default(), &configured),
                    run(&nodes, &all, &p, &PolicyCache::default(), &learned)
                );
            }
            assert_eq!(
                run(&nodes, &order, &p, &kept, mix),
                run(&nodes, &all, &p, &fresh, mix),
                "round {round}"
            );
            // A subset (kube-scheduler's sampling) is scored in the view of the whole cluster seen.
            let subset = &order[..4];
            assert_eq!(
                run(&nodes, subset, &p, &kept, mix),
                run(&nodes, subset, &p, &fresh, mix),
                "round {round}"
            );
            // Usage changes (the view is updated in place).
            match round % 4 {
                0 => Arc::make_mut(&mut nodes[round % 7]).gpus_mut()[1].allocated_mib = 16000 - round as u64,
                1 => Arc::make_mut(&mut nodes[4]).gpus_mut()[0].allocated_mib = round as u64 * 100,
                // Twice a shape change (a GPU's capacity): the policies are built again.
                2 if round % 8 == 2 => {
                    Arc::make_mut(&mut nodes[4]).gpus_mut()[0].memory_mib = 81920 + round as u64
                }
                2 => Arc::make_mut(&mut nodes[5]).gpus_mut()[3].allocated_mib = 1000 * round as u64,
                _ => Arc::make_mut(&mut nodes[round % 7]).gpus_mut()[2].allocated_mib = 0,
            }
        }
        let view = kept.view.lock().expect("lock");
        assert_eq!(
            view.cluster.nodes.len(),
            7,
            "one position per node, whatever the order"
        );
        assert!(view.policies.len() <= MAX_POLICIES);
    }

    #[test]
    fn offline_packs_and_online_spreads() {
        let cfg = Config::default();
        let a = node("tight", vec![gpu(0, 16384, 6000)]);
        let b = node("roomy", vec![gpu(0, 16384, 16384)]);
        let nodes = [Arc::new(a), Arc::new(b)];
        for (class, winner) in [(WorkloadClass::Offline, 0), (WorkloadClass::Online, 1)] {
            let p = pod(Demand::Memory { units: 5000 }, class);
            let mix = CurrentMix::fixed(typical_mix(&cfg));
            let scored = prioritize(&nodes, &p, &cfg, &PolicyCache::default(), &mix);
            let best = (0..2).max_by(|&x, &y| {
                let raw = |i: usize| scored[i].as_ref().expect("both fit").raw;
                raw(x).total_cmp(&raw(y))
            });
            assert_eq!(best, Some(winner), "{class:?}: {scored:?}");
        }
    }
}
