//! The decisions, pure: which nodes can host a pod (and why not), how good each one is, and which
//! GPU(s) the pod gets there. The ranking runs the shared placement policy ([`crate::alloc`], the code
//! `gpumem simulate` measures) on the cluster as these nodes show it, then blends in the workload class
//! and, for multi-GPU pods, the topology of the chosen set.

use std::collections::BTreeMap;

use rand::SeedableRng;

use super::Config;
use super::state::{Demand, NodeState, PodDemand, TopologyNeed, WorkloadClass};
use crate::alloc::local::{PairScores, best_gpu_set, pair_score};
use crate::alloc::{self, Cluster, Gpu, GpuDemand, ModelTable, Request, TypicalMix};
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
            reason,
            category,
            unresolvable,
        }
    }
}

/// A node that can host the pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// MiB on one GPU (memory requests), 0 for whole GPUs.
    pub need_mib: u64,
    /// GPU positions the pod may use (healthy, of an allowed model).
    pub eligible: Vec<usize>,
    /// For several whole GPUs: the best set meeting the topology need, and its pair score.
    pub set: Option<(Vec<usize>, u64)>,
}

/// Can `node` host `pod`? Looks only at GPUs: kube-scheduler checks CPU, memory, taints and affinity.
pub fn check(node: &NodeState, pod: &PodDemand) -> Result<Fit, Rejection> {
    if let Some(problem) = &node.problem {
        return Err(Rejection::new(problem.clone(), "bad_annotation", true));
    }
    if node.gpus.is_empty() {
        return Err(Rejection::new("node has no GPUs".into(), "no_gpu", true));
    }
    let mut allowed = 0usize;
    let mut eligible: Vec<usize> = Vec::with_capacity(node.gpus.len());
    for (p, g) in node.gpus.iter().enumerate() {
        if pod.allows_model(&g.model) {
            allowed += 1;
            if g.healthy {
                eligible.push(p);
            }
        }
    }
    if allowed == 0 {
        let mut models: Vec<&str> = node.gpus.iter().map(|g| g.model.as_str()).collect();
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
    let unhealthy = allowed - eligible.len();
    let note = if unhealthy > 0 {
        format!(" ({unhealthy} unhealthy GPU(s) not counted)")
    } else {
        String::new()
    };
    match pod.demand {
        Demand::Memory { .. } => {
            let need = pod.memory_mib(node.unit_mib);
            let largest = eligible
                .iter()
                .map(|&p| node.gpus[p].free_mib())
                .max()
                .unwrap_or(0);
            if largest >= need {
                return Ok(Fit {
                    need_mib: need,
                    eligible,
                    set: None,
                });
            }
            let biggest = eligible
                .iter()
                .map(|&p| node.gpus[p].memory_mib)
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
                format!("largest free GPU has {largest} MiB, pod needs {need} MiB{extra}{note}"),
                "gpu_memory",
                unresolvable,
            ))
        }
        Demand::Whole { count } => {
            let n = count as usize;
            let idle: Vec<usize> = eligible
                .iter()
                .copied()
                .filter(|&p| node.gpus[p].is_idle())
                .collect();
            if idle.len() < n {
                return Err(Rejection::new(
                    format!(
                        "pod needs {n} idle GPU(s), node has {} idle GPU(s) of an allowed type{note}",
                        idle.len()
                    ),
                    "idle_gpus",
                    eligible.len() < n,
                ));
            }
            let set = if n > 1 {
                match topology_set(node, &idle, n, pod.topology) {
                    Some(set) => Some(set),
                    None => {
                        return Err(Rejection::new(
                            format!(
                                "pod needs {n} idle GPUs{}, none of the sets of the {} idle GPUs qualifies",
                                pod.topology.describe(),
                                idle.len()
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

/// Pair scores of a node's GPUs from the topology annotation (see [`pair_score`]).
pub fn pair_scores(node: &NodeState) -> PairScores {
    PairScores::new(node.gpus.len(), |a, b| {
        let (ga, gb) = (&node.gpus[a], &node.gpus[b]);
        let level = if ga.pcie_switch.is_some() && ga.pcie_switch == gb.pcie_switch {
            TopologyLevel::Single
        } else if ga.numa_node.is_some() && ga.numa_node == gb.numa_node {
            TopologyLevel::Node
        } else {
            TopologyLevel::System
        };
        pair_score(level, ga.nvlinks_to(b))
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
fn topology_set(node: &NodeState, idle: &[usize], n: usize, need: TopologyNeed) -> Option<(Vec<usize>, u64)> {
    let scores = pair_scores(node);
    let groups: Vec<Vec<usize>> = match need {
        TopologyNeed::Any => vec![idle.to_vec()],
        TopologyNeed::Numa | TopologyNeed::PcieSwitch => {
            let mut by: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
            for &p in idle {
                let g = &node.gpus[p];
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

/// The best-scoring set of `n` idle GPUs that are all NVLinked pairwise (bounded search).
fn nvlink_clique(
    node: &NodeState,
    scores: &PairScores,
    idle: &[usize],
    n: usize,
) -> Option<(Vec<usize>, u64)> {
    let linked = |a: usize, b: usize| node.gpus[a].nvlinks_to(b) > 0;
    let mut best: Option<(Vec<usize>, u64)> = None;
    let mut stack: Vec<usize> = Vec::with_capacity(n);
    let mut budget = 100_000u32;
    fn grow(
        start: usize,
        idle: &[usize],
        n: usize,
        stack: &mut Vec<usize>,
        budget: &mut u32,
        linked: &dyn Fn(usize, usize) -> bool,
        found: &mut dyn FnMut(&[usize]),
    ) {
        if stack.len() == n {
            found(stack);
            return;
        }
        for i in start..idle.len() {
            if *budget == 0 {
                return;
            }
            *budget -= 1;
            let g = idle[i];
            if stack.iter().all(|&s| linked(s, g)) {
                stack.push(g);
                grow(i + 1, idle, n, stack, budget, linked, found);
                stack.pop();
            }
        }
    }
    grow(
        0,
        idle,
        n,
        &mut stack,
        &mut budget,
        &linked,
        &mut |set: &[usize]| {
            let s = set_score(scores, set);
            if best.as_ref().is_none_or(|(_, b)| s > *b) {
                best = Some((set.to_vec(), s));
            }
        },
    );
    best
}

/// One feasible node's ranking.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// `MIN_EXTENDER_PRIORITY..=MAX_EXTENDER_PRIORITY`.
    pub score: i64,
    /// The blend before rounding, 0..=1.
    pub raw: f64,
    /// GPU positions the pod would get.
    pub gpus: Vec<usize>,
}

/// The typical request mix the fragmentation measure protects, in MiB.
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

/// The policy's view of the cluster and the policy built for it, kept between calls: a decision
/// updates the view in place, and builds the policy again only when the view's shape changed (nodes,
/// models, capacities: what [`alloc::build_policy`] reads of "a cluster like" this one). The policy's own
/// caches (the fragmentation of each node) then only look at what changed. Holding the view is what
/// makes `prioritize` cheap; a call that finds it busy (concurrent prioritize calls) builds its own.
#[derive(Default)]
pub struct PolicyCache {
    slots: std::sync::Mutex<Vec<Slot>>,
}

/// One view per request amount (nodes with different memory units need different amounts).
struct Slot {
    need: u64,
    cluster: Cluster,
    policy: Box<dyn alloc::Policy>,
}

/// At most this many views are kept.
const MAX_SLOTS: usize = 4;

/// Writes the policy's view of the nodes `members` (indices into `fits`) into `cluster`, reusing what is
/// there; returns whether the shape (names, models, capacities) stayed the same.
fn fill_view(
    cluster: &mut Cluster,
    nodes: &[&NodeState],
    fits: &[(usize, Fit)],
    members: &[usize],
    pod: &PodDemand,
) -> bool {
    let mut models = ModelTable::default();
    let mut same = cluster.nodes.len() == members.len();
    cluster.nodes.truncate(members.len());
    for (slot, &k) in members.iter().enumerate() {
        let (i, fit) = &fits[k];
        let n = nodes[*i];
        let model = fit
            .eligible
            .first()
            .and_then(|&p| models.intern(&n.gpus[p].model).ok())
            .unwrap_or(0);
        // kube-scheduler checks CPU and memory; the policy must not refuse on them.
        let cpu = n.cpu_milli.max(pod.cpu_milli);
        let memory = n.memory_mib.max(pod.memory_mib);
        if slot == cluster.nodes.len() {
            cluster
                .nodes
                .push(alloc::Node::new(n.name.clone(), model, cpu, memory, Vec::new()));
            same = false;
        }
        let v = &mut cluster.nodes[slot];
        if v.name != n.name {
            v.name.clone_from(&n.name);
            same = false;
        }
        same &= v.model == model && v.cpu_capacity == cpu && v.memory_capacity == memory;
        v.model = model;
        (v.cpu_capacity, v.cpu_free) = (cpu, cpu);
        (v.memory_capacity, v.memory_free) = (memory, memory);
        v.tags.clear();
        same &= v.gpus.len() == n.gpus.len();
        v.gpus.resize(n.gpus.len(), Gpu { capacity: 0, free: 0 });
        for (p, (g, out)) in n.gpus.iter().zip(v.gpus.iter_mut()).enumerate() {
            let capacity = u32::try_from(g.memory_mib).unwrap_or(u32::MAX);
            let free = if fit.eligible.contains(&p) {
                u32::try_from(g.free_mib()).unwrap_or(u32::MAX)
            } else {
                0
            };
            same &= out.capacity == capacity;
            *out = Gpu { capacity, free };
        }
    }
    let old = &cluster.models;
    same &= old.len() == models.len() && (0..models.len()).all(|m| old.name(m as u8) == models.name(m as u8));
    cluster.models = models;
    same
}

/// Ranks the nodes in `fits` (index into `nodes`, and its fit) for `pod`. `load` is the share of GPU
/// memory allocated in the cluster as the scorer sees it (decides the online weight).
pub fn prioritize(
    nodes: &[&NodeState],
    fits: &[(usize, Fit)],
    pod: &PodDemand,
    cfg: &Config,
    load: f64,
) -> Vec<(usize, Scored)> {
    prioritize_cached(nodes, fits, pod, cfg, load, None)
}

/// [`prioritize`], keeping the policy's view of the cluster in `cache` between calls (same answers).
pub fn prioritize_cached(
    nodes: &[&NodeState],
    fits: &[(usize, Fit)],
    pod: &PodDemand,
    cfg: &Config,
    load: f64,
    cache: Option<&PolicyCache>,
) -> Vec<(usize, Scored)> {
    if fits.is_empty() {
        return Vec::new();
    }
    // Nodes with different memory units turn one request into different MiB: one policy run per amount.
    let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (k, (_, fit)) in fits.iter().enumerate() {
        groups.entry(fit.need_mib).or_default().push(k);
    }
    let mix = typical_mix(cfg);
    let mut policy_score: Vec<Option<(f64, Vec<usize>)>> = vec![None; fits.len()];
    let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(1);
    let mut out = Vec::new();
    let mut slots = cache.and_then(|c| c.slots.try_lock().ok());
    for (need, members) in groups {
        let gpu = match pod.demand {
            Demand::Memory { .. } => GpuDemand::Shared {
                amount: u32::try_from(need).unwrap_or(u32::MAX),
            },
            Demand::Whole { count } => GpuDemand::Whole { count },
        };
        let req = Request {
            cpu_milli: pod.cpu_milli,
            memory_mib: pod.memory_mib,
            gpu,
            models: None,
        };
        let kept = slots.as_deref_mut().map(|slots| {
            let at = match slots.iter().position(|s| s.need == need) {
                Some(at) => at,
                None => {
                    if slots.len() >= MAX_SLOTS {
                        slots.remove(0);
                    }
                    slots.len()
                }
            };
            (slots, at)
        });
        let mut fresh: Option<(Cluster, Box<dyn alloc::Policy>)> = None;
        let (cluster, policy) = match kept {
            Some((slots, at)) if at < slots.len() => {
                let slot = &mut slots[at];
                if !fill_view(&mut slot.cluster, nodes, fits, &members, pod) {
                    let Some(p) = alloc::build_policy(&cfg.policy, &slot.cluster, &mix) else {
                        slots.remove(at);
                        continue;
                    };
                    slot.policy = p;
                }
                let slot = &mut slots[at];
                (&slot.cluster, &mut slot.policy)
            }
            kept => {
                let mut cluster = Cluster::default();
                fill_view(&mut cluster, nodes, fits, &members, pod);
                let Some(policy) = alloc::build_policy(&cfg.policy, &cluster, &mix) else {
                    continue;
                };
                match kept {
                    Some((slots, _)) => {
                        slots.push(Slot {
                            need,
                            cluster,
                            policy,
                        });
                        let slot = slots.last_mut().expect("just pushed");
                        (&slot.cluster, &mut slot.policy)
                    }
                    None => {
                        let f = fresh.insert((cluster, policy));
                        (&f.0, &mut f.1)
                    }
                }
            }
        };
        policy.score(cluster, &req, &mut rng, &mut out);
        for c in &out {
            if let Some(&k) = members.get(c.node as usize) {
                policy_score[k] = Some((c.score, c.gpus.iter().collect()));
            }
        }
    }
    drop(slots);
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
    fits.iter()
        .zip(policy_score)
        .map(|((i, fit), policy)| {
            let n = nodes[*i];
            let (policy_term, policy_gpus) = match policy {
                Some((s, gpus)) if hi > lo => ((s - lo) / (hi - lo), gpus),
                Some((_, gpus)) => (1.0, gpus),
                None => (0.0, Vec::new()),
            };
            let gpus = match (&fit.set, pod.demand) {
                (Some((set, _)), _) => set.clone(),
                _ if !policy_gpus.is_empty() => policy_gpus,
                (None, Demand::Memory { .. }) => fit
                    .eligible
                    .iter()
                    .copied()
                    .filter(|&p| n.gpus[p].free_mib() >= fit.need_mib)
                    .min_by_key(|&p| (n.gpus[p].free_mib(), p))
                    .into_iter()
                    .collect(),
                (None, Demand::Whole { count }) => fit
                    .eligible
                    .iter()
                    .copied()
                    .filter(|&p| n.gpus[p].is_idle())
                    .take(count as usize)
                    .collect(),
            };
            // How much room the placement leaves: on the GPU used (memory), on the node (whole GPUs).
            let room = match pod.demand {
                Demand::Memory { .. } => gpus.first().map_or(0.0, |&p| {
                    let g = &n.gpus[p];
                    g.free_mib().saturating_sub(fit.need_mib) as f64 / g.memory_mib.max(1) as f64
                }),
                Demand::Whole { .. } => {
                    let total: u64 = fit.eligible.iter().map(|&p| n.gpus[p].memory_mib).sum();
                    let taken: u64 = gpus.iter().map(|&p| n.gpus[p].memory_mib).sum();
                    let free: u64 = fit.eligible.iter().map(|&p| n.gpus[p].free_mib()).sum();
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
            (*i, Scored { score, raw, gpus })
        })
        .collect()
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

/// The fragmentation of `nodes` by the shared policy's measure ([`alloc::frag`], FGD's, against the
/// configured typical mix), as a share of idle GPU memory; and the allocated share. Unhealthy GPUs and
/// nodes with bad annotations count nowhere.
pub fn fragmentation(nodes: &[&NodeState], cfg: &Config) -> Fragmentation {
    let mut models = ModelTable::default();
    let view: Vec<(&str, alloc::Node)> = nodes
        .iter()
        .filter(|n| n.problem.is_none())
        .map(|n| {
            let healthy = || n.gpus.iter().filter(|g| g.healthy);
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
    let model = alloc::FragModel::new(&typical_mix(cfg), &models, false);
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

/// Share of GPU memory allocated over `nodes` (0 when they have no GPUs).
pub fn load(nodes: &[&NodeState]) -> f64 {
    let (used, total) = nodes
        .iter()
        .filter(|n| n.problem.is_none())
        .map(|n| n.allocated_fraction())
        .fold((0u64, 0u64), |(u, t), (a, b)| (u + a, t + b));
    if total == 0 {
        0.0
    } else {
        used as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::super::state::GpuState;
    use super::*;

    fn gpu(i: usize, memory: u64, free: u64) -> GpuState {
        GpuState {
            index: i as u32,
            uuid: format!("GPU-{i}"),
            model: "NVIDIA A100-SXM4-80GB".into(),
            memory_mib: memory,
            allocated_mib: memory - free,
            whole: false,
            healthy: true,
            numa_node: Some((i / 4) as u32),
            pcie_switch: Some((i / 2) as u32),
            nvlink: Vec::new(),
            pods: Vec::new(),
        }
    }

    fn node(name: &str, gpus: Vec<GpuState>) -> NodeState {
        NodeState {
            name: name.into(),
            resource_version: "1".into(),
            unit_mib: 1,
            cpu_milli: 64_000,
            memory_mib: 512_000,
            gpus,
            problem: None,
        }
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
    fn topology_needs_pick_qualifying_sets() {
        // 4 idle GPUs: 0,1 on switch 0 / NUMA 0, 2,3 on switch 1 / NUMA 0; 4 is on NUMA 1.
        let mut gpus: Vec<GpuState> = (0..5).map(|i| gpu(i, 16384, 16384)).collect();
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

    #[test]
    fn the_kept_policy_view_answers_as_a_fresh_one() {
        let cfg = Config::default();
        let cache = PolicyCache::default();
        let p = pod(Demand::Memory { units: 5000 }, WorkloadClass::Offline);
        let mut nodes: Vec<NodeState> = (0..6)
            .map(|i| {
                let gpus = (0..4)
                    .map(|g| gpu(g, 16384, [16384, 9000, 6000, 12000][(i + g) % 4]))
                    .collect();
                node(&format!("n{i}"), gpus)
            })
            .collect();
        let run = |nodes: &[NodeState], cache: Option<&PolicyCache>| {
            let refs: Vec<&NodeState> = nodes.iter().collect();
            let fits: Vec<(usize, Fit)> = refs
                .iter()
                .enumerate()
                .filter_map(|(i, n)| check(n, &p).ok().map(|f| (i, f)))
                .collect();
            prioritize_cached(&refs, &fits, &p, &cfg, load(&refs), cache)
        };
        for round in 0..4 {
            let kept = run(&nodes, Some(&cache));
            assert_eq!(kept, run(&nodes, None), "round {round}");
            // Usage changes (the view is updated in place), then the shape changes (rebuilt).
            match round {
                0 => nodes[2].gpus[1].allocated_mib = 16000,
                1 => nodes[4].gpus[0].memory_mib = 40960,
                _ => {
                    nodes.pop();
                }
            }
        }
        assert_eq!(cache.slots.lock().expect("lock").len(), 1);
    }

    #[test]
    fn offline_packs_and_online_spreads() {
        let cfg = Config::default();
        let a = node("tight", vec![gpu(0, 16384, 6000)]);
        let b = node("roomy", vec![gpu(0, 16384, 16384)]);
        let nodes = [&a, &b];
        for (class, winner) in [(WorkloadClass::Offline, 0), (WorkloadClass::Online, 1)] {
            let p = pod(Demand::Memory { units: 5000 }, class);
            let fits: Vec<(usize, Fit)> = (0..2).map(|i| (i, check(nodes[i], &p).expect("fits"))).collect();
            let scored = prioritize(&nodes, &fits, &p, &cfg, 0.0);
            let best = scored
                .iter()
                .max_by(|x, y| x.1.raw.total_cmp(&y.1.raw))
                .map(|s| s.0);
            assert_eq!(best, Some(winner), "{class:?}: {scored:?}");
        }
    }
}
