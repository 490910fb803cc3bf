//! The offline bound: with every pod known in advance, the least unallocated GPU % that any placement
//! of any subset of the pods could reach on the empty cluster. The policies of `gpumem simulate` are
//! measured against it.
//!
//! An LP relaxation, aggregated so it stays small on openb (~1200 nodes, ~8000 pods): pods are grouped
//! into types (equal requests), nodes into classes (equal GPUs, CPU, memory and pool), and a node's GPUs
//! into groups (equal capacity and model). Variables count the pods of a type placed on a class; a share
//! is also told which GPU group it sits on, a multi-GPU pod how many GPUs of each group it takes. Rows:
//! no more pods of a type than there are; per class, CPU and memory; per (class, group), GPU units and
//! GPU count; per class with multi-GPU pods, the GPUs of a node they and the shares take. Each of these
//! per-node or per-GPU rows is also repeated with the item sizes passed through the dual feasible
//! functions of Fekete and Schepers (`dff`): valid for any packing of one bin, these count, e.g., that
//! a GPU holds at most one share above half its capacity, or a 4-GPU node one 3-GPU pod. On openb these
//! cuts are what lifts the bound off the trivial one (at 100 % arrived: 0.01 % without, 2.8 % with u_1
//! to u_4, u_4 on the GPUs doing most). The objective is the GPU units allocated; every real placement
//! is a feasible point with the same units, so the LP's maximum is at least the best placement's and
//! 100 − that maximum in % is a lower bound.
//!
//! A restricted pod (`Request::models`) only uses GPUs of its models, GPU by GPU, on a node of several
//! models too.

use std::collections::{BTreeMap, HashMap};

use good_lp::{
    Expression, IntoAffineExpression, ProblemVariables, ResolutionError, Solution, SolutionStatus,
    SolverModel, Variable, microlp, variable,
};

use crate::alloc::{Cluster, GpuDemand, ModelId, Node, Request};

/// Parameters k of the dual feasible functions added as cuts, 1..=DFF_MAX (k = 1: "at most one item
/// above half", k = 2: "at most two above a third", ...). More are cheap but add little.
const DFF_MAX: u64 = 4;

/// Why no bound could be computed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BoundError {
    #[error("the LP solver failed: {0}")]
    Solver(#[from] ResolutionError),
    #[error("the LP solver stopped before proving optimality ({0:?})")]
    NotOptimal(SolutionStatus),
    #[error("the LP solver returned a non-finite optimum ({0})")]
    NotFinite(f64),
}

/// The pool a node belongs to ([`Node::pool`]): nodes of different pools never share a class.
fn pool_key(node: &Node) -> u64 {
    u64::from(node.pool)
}

/// One empty node like `node` could host `req`: its pool, CPU, memory, and enough GPUs of an allowed
/// model with the capacity asked for (a share needs one such GPU, whole GPUs `count` of them).
fn admits(node: &Node, req: &Request) -> bool {
    if node.cpu_capacity < req.cpu_milli
        || node.memory_capacity < req.memory_mib
        || req.pools.is_some_and(|p| !p.contains(node.pool))
    {
        return false;
    }
    let allowed = |g: usize| req.models.is_none_or(|m| m.contains(node.gpu_model(g)));
    match req.gpu {
        GpuDemand::None => true,
        GpuDemand::Shared { amount } => {
            (0..node.gpus.len()).any(|g| allowed(g) && node.gpus[g].capacity >= amount)
        }
        GpuDemand::Whole { count } => (0..node.gpus.len()).filter(|&g| allowed(g)).count() >= count as usize,
    }
}

/// The Fekete–Schepers dual feasible function u_k at `size / bin` (`size <= bin`, `bin > 0`): for any
/// items that fit in one bin together, their u_k sum to at most 1. u_k(x) = x where (k+1)·x is an
/// integer, ⌊(k+1)·x⌋ / k elsewhere.
fn dff(k: u64, size: u64, bin: u64) -> f64 {
    let scaled = u128::from(k + 1) * u128::from(size);
    let bin128 = u128::from(bin);
    if scaled % bin128 == 0 {
        size as f64 / bin as f64
    } else {
        (scaled / bin128) as f64 / k as f64
    }
}

/// GPUs of one capacity and model on each node of a class.
#[derive(Debug, Clone, Copy)]
struct Group {
    capacity: u32,
    model: ModelId,
    gpus: u32,
}

/// Equal nodes: `nodes` of them, like `cluster.nodes[rep]`.
#[derive(Debug)]
struct Class {
    rep: usize,
    nodes: u32,
    groups: Vec<Group>,
}

type ClassKey = (Vec<(u32, ModelId)>, u64, u64, u64);

/// The nodes with GPUs, by class (others host no GPU pod).
fn classes(cluster: &Cluster) -> Vec<Class> {
    let mut by_key: BTreeMap<ClassKey, (usize, u32)> = BTreeMap::new();
    for (i, n) in cluster.nodes.iter().enumerate() {
        if n.gpus.is_empty() {
            continue;
        }
        // GPU order on a node does not matter for what it can host.
        let mut gpus: Vec<(u32, ModelId)> = n
            .gpus
            .iter()
            .enumerate()
            .map(|(g, gpu)| (gpu.capacity, n.gpu_model(g)))
            .collect();
        gpus.sort_unstable();
        let key = (gpus, n.cpu_capacity, n.memory_capacity, pool_key(n));
        by_key.entry(key).or_insert((i, 0)).1 += 1;
    }
    by_key
        .into_iter()
        .map(|((gpus, ..), (rep, nodes))| {
            let mut groups: Vec<Group> = Vec::new();
            for (capacity, model) in gpus {
                match groups.last_mut() {
                    Some(g) if g.capacity == capacity && g.model == model => g.gpus += 1,
                    _ => groups.push(Group {
                        capacity,
                        model,
                        gpus: 1,
                    }),
                }
            }
            Class { rep, nodes, groups }
        })
        .collect()
}

/// The GPU pods by type (equal requests), with their counts, in order of first appearance; pods that
/// allocate no GPU unit are left out (placing them never raises the allocation).
fn types(pods: &[Request]) -> Vec<(Request, u32)> {
    let mut index: HashMap<Request, usize> = HashMap::new();
    let mut out: Vec<(Request, u32)> = Vec::new();
    for p in pods {
        let units = match p.gpu {
            GpuDemand::None => 0,
            GpuDemand::Shared { amount } => amount,
            GpuDemand::Whole { count } => count,
        };
        if units == 0 {
            continue;
        }
        let i = *index.entry(*p).or_insert_with(|| {
            out.push((*p, 0));
            out.len() - 1
        });
        out[i].1 += 1;
    }
    out
}

/// One resource row: `expr <= rhs`.
struct Row {
    expr: Expression,
    rhs: f64,
}

impl Row {
    fn new(rhs: f64) -> Row {
        Row {
            expr: Expression::default(),
            rhs,
        }
    }
}

/// The rows of one class: per node CPU and memory (index 0: sizes as they are, k: through u_k), per
/// GPU group units and count (same indexing; the whole-GPU count is in every cut), per node GPU count.
struct ClassRows {
    cpu: Vec<Row>,
    memory: Vec<Row>,
    groups: Vec<Vec<Row>>,
    node_gpus: Vec<Row>,
    /// A pod of several whole GPUs may go there: only then can `node_gpus` cut anything off.
    multi: bool,
}

/// The least unallocated GPU % of `cluster`'s capacity (0..=100) that any placement of any subset of
/// `pods` on the empty `cluster` can reach: a lower bound from an LP relaxation. The cluster's current
/// allocations are ignored: only capacities count (100 on a cluster without GPU capacity).
pub fn unallocated_bound(cluster: &Cluster, pods: &[Request]) -> Result<f64, BoundError> {
    bound_with_cuts(cluster, pods, DFF_MAX)
}

/// [`unallocated_bound`] with the cuts of u_1..=u_`cuts` (none for 0).
fn bound_with_cuts(cluster: &Cluster, pods: &[Request], cuts: u64) -> Result<f64, BoundError> {
    let capacity = cluster.gpu_capacity_total();
    if capacity == 0 {
        return Ok(100.0);
    }
    let classes = classes(cluster);
    let types = types(pods);
    // Objective in units of the largest GPU, rows in fractions of a node or GPU: coefficients near 1.
    let scale = classes
        .iter()
        .flat_map(|c| c.groups.iter().map(|g| g.capacity))
        .max()
        .unwrap_or(1)
        .max(1) as f64;

    let mut vars = ProblemVariables::new();
    let mut objective = Expression::default();
    // (variable, GPU units per unit of it), to read the optimum back in units.
    let mut units: Vec<(Variable, f64)> = Vec::new();
    let mut type_rows: Vec<Row> = types.iter().map(|&(_, n)| Row::new(f64::from(n))).collect();
    let mut links: Vec<good_lp::Constraint> = Vec::new();
    let mut rows: Vec<ClassRows> = classes
        .iter()
        .map(|c| {
            let n = f64::from(c.nodes);
            ClassRows {
                cpu: (0..=cuts).map(|_| Row::new(n)).collect(),
                memory: (0..=cuts).map(|_| Row::new(n)).collect(),
                groups: c
                    .groups
                    .iter()
                    .map(|g| (0..=cuts).map(|_| Row::new(n * f64::from(g.gpus))).collect())
                    .collect(),
                node_gpus: (0..cuts).map(|_| Row::new(n)).collect(),
                multi: false,
            }
        })
        .collect();

    for (t, (req, _)) in types.iter().enumerate() {
        for (c, class) in classes.iter().enumerate() {
            let node = &cluster.nodes[class.rep];
            if !admits(node, req) {
                continue;
            }
            let r = &mut rows[c];
            let node_gpus: u64 = class.groups.iter().map(|g| u64::from(g.gpus)).sum();
            let allowed = |g: &Group| req.models.is_none_or(|m| m.contains(g.model));
            // Every pod of the type placed on the class, wherever on its nodes.
            let mut place = |v: Variable, r: &mut ClassRows| {
                type_rows[t].expr.add_mul(1.0, v);
                for (dim, size, bin) in [
                    (&mut r.cpu, req.cpu_milli, node.cpu_capacity),
                    (&mut r.memory, req.memory_mib, node.memory_capacity),
                ] {
                    if size == 0 {
                        continue;
                    }
                    dim[0].expr.add_mul(size as f64 / bin as f64, v);
                    for k in 1..=cuts {
                        dim[k as usize].expr.add_mul(dff(k, size, bin), v);
                    }
                }
            };
            match req.gpu {
                GpuDemand::None => {}
                GpuDemand::Shared { amount } => {
                    for (gi, g) in class.groups.iter().enumerate() {
                        if !allowed(g) || g.capacity < amount {
                            continue;
                        }
                        let v = vars.add(variable().min(0));
                        place(v, r);
                        let (a, cap) = (u64::from(amount), u64::from(g.capacity));
                        let frac = a as f64 / cap as f64;
                        r.groups[gi][0].expr.add_mul(frac, v);
                        for k in 1..=cuts {
                            r.groups[gi][k as usize].expr.add_mul(dff(k, a, cap), v);
                            // The GPUs the node's shares occupy are at least their units over capacity.
                            r.node_gpus[k as usize - 1]
                                .expr
                                .add_mul(dff(k, 1, node_gpus) * frac, v);
                        }
                        objective.add_mul(a as f64 / scale, v);
                        units.push((v, a as f64));
                    }
                }
                GpuDemand::Whole { count } => {
                    let v = vars.add(variable().min(0));
                    place(v, r);
                    r.multi |= count >= 2;
                    for k in 1..=cuts {
                        r.node_gpus[k as usize - 1]
                            .expr
                            .add_mul(dff(k, u64::from(count), node_gpus), v);
                    }
                    let ok: Vec<usize> = (0..class.groups.len())
                        .filter(|&gi| allowed(&class.groups[gi]))
                        .collect();
                    let ok_gpus: u32 = ok.iter().map(|&gi| class.groups[gi].gpus).sum();
                    // The GPUs of each allowed group the type's pods take on the class.
                    let mut taken: Vec<(usize, Expression)> = Vec::new();
                    if let [gi] = ok[..] {
                        taken.push((gi, f64::from(count) * v));
                    } else {
                        let mut sum = Expression::default();
                        for &gi in &ok {
                            let g = class.groups[gi];
                            let y = vars.add(variable().min(0));
                            sum.add_mul(1.0, y);
                            // Per pod, at most the group's GPUs, at least what the others cannot give.
                            links.push((y - f64::from(g.gpus) * v).leq(0.0));
                            let least = f64::from(count) - f64::from(ok_gpus - g.gpus);
                            if least > 0.0 {
                                links.push((least * v - y).leq(0.0));
                            }
                            taken.push((gi, y.into()));
                        }
                        links.push((sum - f64::from(count) * v).eq(0.0));
                    }
                    for (gi, gpus) in taken {
                        let cap = f64::from(class.groups[gi].capacity);
                        // A whole GPU fills its GPU in every row: u_k(1) = 1.
                        for row in &mut r.groups[gi] {
                            row.expr.add_mul(1.0, gpus.clone());
                        }
                        objective.add_mul(cap / scale, gpus.clone());
                        for (var, coef) in (&gpus).linear_coefficients() {
                            units.push((var, coef * cap));
                        }
                    }
                }
            }
        }
    }

    let mut model = vars.maximise(objective).using(microlp);
    let mut add = |row: Row| {
        // A row with no term constrains nothing (and a solver may take it for a bad row).
        if (&row.expr).linear_coefficients().next().is_some() {
            model.add_constraint(row.expr.leq(row.rhs));
        }
    };
    for row in type_rows {
        add(row);
    }
    for r in rows {
        r.cpu.into_iter().chain(r.memory).for_each(&mut add);
        r.groups.into_iter().flatten().for_each(&mut add);
        if r.multi {
            r.node_gpus.into_iter().for_each(&mut add);
        }
    }
    for l in links {
        model.add_constraint(l);
    }
    let solution = model.solve()?;
    if !matches!(solution.status(), SolutionStatus::Optimal) {
        return Err(BoundError::NotOptimal(solution.status()));
    }
    let allocated: f64 = units.iter().map(|&(v, u)| solution.value(v) * u).sum();
    if !allocated.is_finite() {
        return Err(BoundError::NotFinite(allocated));
    }
    Ok((100.0 - allocated / capacity as f64 * 100.0).clamp(0.0, 100.0))
}

#[cfg(test)]
mod tests {
    use rand::{RngExt, SeedableRng};
    use rand_pcg::Pcg64Mcg;

    use super::*;
    use crate::alloc::testutil::{random_cluster, random_request};
    use crate::alloc::{Gpu, GpuMask, ModelSet, ModelTable, TieBreak, TypicalMix};

    /// A cluster of models "T4" (0) and "A100" (1).
    fn cluster(nodes: Vec<Node>) -> Cluster {
        let mut models = ModelTable::default();
        models.intern("T4").expect("first model");
        models.intern("A100").expect("second model");
        Cluster::new(models, nodes)
    }

    fn node(name: &str, model: ModelId, cpu: u64, caps: &[u32]) -> Node {
        Node::new(
            name,
            model,
            cpu,
            64_000,
            caps.iter().map(|&c| Gpu::new(c)).collect(),
        )
    }

    fn bound(c: &Cluster, pods: &[Request]) -> f64 {
        unallocated_bound(c, pods).expect("the LP solves")
    }

    fn shares(amounts: &[u32]) -> Vec<Request> {
        amounts.iter().map(|&a| Request::shared(0, 0, a)).collect()
    }

    /// Unallocated % for `allocated` units of `c`.
    fn pct(c: &Cluster, allocated: u64) -> f64 {
        100.0 - allocated as f64 / c.gpu_capacity_total() as f64 * 100.0
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6
    }

    /// The most GPU units any placement of a subset of `pods` allocates on the empty `c`, by trying them
    /// all (GPU models checked GPU by GPU).
    fn brute_force(c: &Cluster, pods: &[Request]) -> u64 {
        fn go(nodes: &mut [Node], pods: &[Request]) -> u64 {
            let Some((req, rest)) = pods.split_first() else {
                return 0;
            };
            let mut best = go(nodes, rest);
            for i in 0..nodes.len() {
                let n = &nodes[i];
                if n.cpu_free < req.cpu_milli || n.memory_free < req.memory_mib {
                    continue;
                }
                let ok = |g: usize| req.models.is_none_or(|m| m.contains(n.gpu_model(g)));
                let gpus = n.gpus.len();
                let masks: Vec<GpuMask> = match req.gpu {
                    GpuDemand::None => vec![GpuMask::EMPTY],
                    GpuDemand::Shared { amount } => (0..gpus)
                        .filter(|&g| ok(g) && n.gpus[g].free >= amount)
                        .map(GpuMask::single)
                        .collect(),
                    GpuDemand::Whole { count } => (0..1u64 << gpus)
                        .map(GpuMask)
                        .filter(|m| m.count() == count)
                        .filter(|m| m.iter().all(|g| ok(g) && n.gpus[g].is_idle()))
                        .collect(),
                };
                for m in masks {
                    let saved = nodes[i].clone();
                    let n = &mut nodes[i];
                    n.cpu_free -= req.cpu_milli;
                    n.memory_free -= req.memory_mib;
                    let mut got = 0u64;
                    for g in m.iter() {
                        let take = match req.gpu {
                            GpuDemand::Shared { amount } => amount,
                            _ => n.gpus[g].capacity,
                        };
                        n.gpus[g].free -= take;
                        got += u64::from(take);
                    }
                    best = best.max(got + go(nodes, rest));
                    nodes[i] = saved;
                }
            }
            best
        }
        go(&mut c.nodes.clone(), pods)
    }

    #[test]
    fn dff_is_exact_on_multiples_and_rounds_down_elsewhere() {
        assert_eq!(dff(1, 600, 1000), 1.0);
        assert_eq!(dff(1, 500, 1000), 0.5);
        assert_eq!(dff(1, 400, 1000), 0.0);
        assert_eq!(dff(2, 400, 1000), 0.5);
        assert_eq!(dff(2, 700, 1000), 1.0);
        assert!(close(dff(2, 1000, 3000), 1.0 / 3.0));
        assert_eq!(dff(3, 1000, 1000), 1.0);
    }

    #[test]
    fn shares_that_pair_on_no_gpu_are_counted_one_per_gpu() {
        // 3 x 600 on 2 x 1000: one per GPU, 1200 of 2000. The units alone would allow 1800 (10 %).
        let c = cluster(vec![node("a", 0, 64_000, &[1000, 1000])]);
        let pods = shares(&[600, 600, 600]);
        assert_eq!(brute_force(&c, &pods), 1200);
        assert!(close(bound(&c, &pods), 40.0), "{}", bound(&c, &pods));
        let uncut = bound_with_cuts(&c, &pods, 0).expect("the LP solves");
        assert!(close(uncut, 10.0), "without cuts, the units alone: {uncut}");
        // 600, 600, 400: 600 + 400 and 600, 1600 of 2000.
        let pods = shares(&[600, 600, 400]);
        assert_eq!(brute_force(&c, &pods), 1600);
        assert!(close(bound(&c, &pods), 20.0));
        // 5 x 400: two per GPU (k = 2), 1600.
        let pods = shares(&[400; 5]);
        assert_eq!(brute_force(&c, &pods), 1600);
        assert!(close(bound(&c, &pods), 20.0));
    }

    #[test]
    fn cpu_that_two_pods_cannot_share_keeps_a_gpu_idle() {
        // Two whole-GPU pods of 3 of the node's 4 cores: one fits. CPU as a sum would allow 4/3 pods.
        let c = cluster(vec![node("a", 0, 4000, &[1000, 1000])]);
        let pods = vec![Request::whole(3000, 0, 1); 2];
        assert_eq!(brute_force(&c, &pods), 1000);
        assert!(close(bound(&c, &pods), 50.0));
        let uncut = bound_with_cuts(&c, &pods, 0).expect("the LP solves");
        assert!(close(uncut, 100.0 / 3.0), "without cuts, CPU as a sum: {uncut}");
        // Not worse than the truth with the cores to spare.
        assert!(close(bound(&c, &[Request::whole(2000, 0, 1); 2]), 0.0));
    }

    #[test]
    fn multi_gpu_pods_that_leave_gpus_over_are_counted_per_node() {
        // 3-GPU pods on 4-GPU nodes: one per node, a quarter idle; the GPU count alone would allow 8/3.
        let c = cluster(vec![
            node("a", 0, 64_000, &[1000; 4]),
            node("b", 0, 64_000, &[1000; 4]),
        ]);
        let pods = vec![Request::whole(0, 0, 3); 3];
        assert_eq!(brute_force(&c, &pods), 6000);
        assert!(close(bound(&c, &pods), 25.0), "{}", bound(&c, &pods));
        let uncut = bound_with_cuts(&c, &pods, 0).expect("the LP solves");
        assert!(close(uncut, 0.0), "without cuts, GPUs as a sum: {uncut}");
    }

    #[test]
    fn a_restricted_pod_uses_only_its_model() {
        let c = cluster(vec![
            node("t4", 0, 64_000, &[1000]),
            node("a100", 1, 64_000, &[1000]),
        ]);
        let t4 = ModelSet::NONE.with(0);
        let pods = vec![Request::whole(0, 0, 1).with_models(t4); 2];
        assert!(close(bound(&c, &pods), 50.0));
        // Unrestricted, both fit.
        assert!(close(bound(&c, &[Request::whole(0, 0, 1); 2]), 0.0));
        // A model no node has: nothing.
        let none = ModelSet::NONE.with(5);
        assert!(close(
            bound(&c, &[Request::whole(0, 0, 1).with_models(none)]),
            100.0
        ));
    }

    #[test]
    fn a_pod_uses_only_the_nodes_of_its_pools() {
        let mut c = cluster(vec![node("a", 0, 64_000, &[1000]), node("b", 0, 64_000, &[1000])]);
        c.nodes[1].pool = 1;
        let pool_1 = crate::alloc::PoolSet::NONE.with(1);
        assert!(close(
            bound(&c, &[Request::whole(0, 0, 1).with_pools(pool_1); 2]),
            50.0
        ));
        assert!(close(bound(&c, &[Request::whole(0, 0, 1); 2]), 0.0));
    }

    #[test]
    fn a_node_of_two_models_gives_a_restricted_pod_only_its_gpus() {
        // GPU 0 a T4, GPU 1 an A100 (the node's `model` is the first GPU's).
        let mut n = node("mixed", 0, 64_000, &[1000, 1000]);
        n.gpu_models = vec![0, 1];
        let c = cluster(vec![n]);
        let t4 = ModelSet::NONE.with(0);
        let pods = vec![Request::shared(0, 0, 700).with_models(t4); 2];
        assert_eq!(brute_force(&c, &pods), 700);
        assert!(close(bound(&c, &pods), 65.0), "{}", bound(&c, &pods));
        // Two T4s are asked for, the node has one.
        assert!(close(
            bound(&c, &[Request::whole(0, 0, 2).with_models(t4)]),
            100.0
        ));
        // An A100 pod beside the T4 shares: both GPUs used.
        let mut pods = pods;
        pods.push(Request::whole(0, 0, 1).with_models(ModelSet::NONE.with(1)));
        assert!(close(bound(&c, &pods), 15.0), "{}", bound(&c, &pods));
    }

    #[test]
    fn a_node_of_two_capacities_counts_each_gpu_as_it_is() {
        let c = cluster(vec![node("a", 0, 64_000, &[1000, 2000])]);
        // Whole GPUs count their capacity: 3000 of 3000.
        assert!(close(bound(&c, &[Request::whole(0, 0, 1); 2]), 0.0));
        // One whole GPU: at most the larger, 2000 of 3000.
        assert!(close(bound(&c, &[Request::whole(0, 0, 1)]), 100.0 / 3.0));
        // 1500-unit shares fit only the 2000 GPU, one of them.
        assert!(close(bound(&c, &shares(&[1500, 1500])), 50.0));
    }

    #[test]
    fn never_above_the_best_placement_on_tiny_random_clusters() {
        let mut exact = 0;
        for seed in 0..150 {
            let mut r = Pcg64Mcg::seed_from_u64(seed);
            let nodes = (0..r.random_range(1..=2))
                .map(|i| {
                    let gpus = r.random_range(1..=3);
                    let caps: Vec<u32> = (0..gpus).map(|_| [1000, 2000][r.random_range(0..2)]).collect();
                    let mut n = node(
                        &format!("n{i}"),
                        r.random_range(0..2),
                        [4000, 8000][r.random_range(0..2)],
                        &caps,
                    );
                    n.memory_capacity = 32_000;
                    n.memory_free = 32_000;
                    if r.random_bool(0.3) {
                        n.gpu_models = (0..gpus).map(|_| r.random_range(0..2)).collect();
                        n.model = n.gpu_models[0];
                    }
                    n
                })
                .collect();
            let c = cluster(nodes);
            let pods: Vec<Request> = (0..r.random_range(1..=5))
                .map(|_| {
                    let (cpu, mem) = (r.random_range(0..=5) * 1000, r.random_range(0..=2) * 12_000);
                    let req = if r.random_bool(0.6) {
                        Request::shared(
                            cpu,
                            mem,
                            [300, 400, 500, 600, 700, 1000, 1500][r.random_range(0..7)],
                        )
                    } else {
                        Request::whole(cpu, mem, r.random_range(1..=3))
                    };
                    if r.random_bool(0.3) {
                        req.with_models(ModelSet::NONE.with(r.random_range(0..2)))
                    } else {
                        req
                    }
                })
                .collect();
            let best = pct(&c, brute_force(&c, &pods));
            let b = bound(&c, &pods);
            assert!(
                b <= best + 1e-6,
                "seed {seed}: bound {b} above the best placement's {best}: {c:?} {pods:?}"
            );
            exact += usize::from(close(b, best));
        }
        // Most tiny cases are exact: a bound that says 0 everywhere would fail this.
        assert!(exact >= 100, "only {exact} of 150 exact");
    }

    #[test]
    fn never_above_the_best_placement_with_openb_sizes_and_more_cuts() {
        // openb's share sizes (milli-GPU) and CPU requests, where the cuts of u_3, u_4 bind.
        const SHARES: [u32; 16] = [
            810, 470, 320, 230, 650, 590, 550, 460, 160, 220, 370, 110, 480, 50, 330, 1000,
        ];
        const CPUS: [u64; 6] = [3152, 11300, 11908, 8000, 4000, 18708];
        for seed in 0..120 {
            let mut r = Pcg64Mcg::seed_from_u64(seed);
            let nodes = (0..r.random_range(1..=2))
                .map(|i| {
                    node(
                        &format!("n{i}"),
                        0,
                        [16_000, 32_000][r.random_range(0..2)],
                        &[1000; 2],
                    )
                })
                .collect();
            let c = cluster(nodes);
            let pods: Vec<Request> = (0..r.random_range(2..=6))
                .map(|_| {
                    let cpu = CPUS[r.random_range(0..CPUS.len())];
                    if r.random_bool(0.8) {
                        Request::shared(cpu, 0, SHARES[r.random_range(0..SHARES.len())])
                    } else {
                        Request::whole(cpu, 0, r.random_range(1..=2))
                    }
                })
                .collect();
            let best = pct(&c, brute_force(&c, &pods));
            for cuts in [DFF_MAX, 8] {
                let b = bound_with_cuts(&c, &pods, cuts).expect("the LP solves");
                assert!(
                    b <= best + 1e-6,
                    "seed {seed}, cuts {cuts}: bound {b} above the best placement's {best}: {pods:?}"
                );
            }
        }
    }

    #[test]
    fn never_above_what_best_fit_reaches() {
        for seed in 0..6 {
            let mut r = Pcg64Mcg::seed_from_u64(seed);
            let mut c = random_cluster(&mut r, 30, 8);
            // The bound is about the empty cluster.
            for n in &mut c.nodes {
                n.cpu_free = n.cpu_capacity;
                n.memory_free = n.memory_capacity;
                n.gpus.iter_mut().for_each(|g| g.free = g.capacity);
            }
            // As the simulator reports it: pods until their GPU request reaches the capacity (a whole
            // GPU counted at the largest capacity, so no more than this could be allocated).
            let (capacity, mut asked) = (c.gpu_capacity_total(), 0u64);
            let mut pods: Vec<Request> = Vec::new();
            loop {
                let req = random_request(&mut r);
                let units = req.gpu.units(2000);
                if asked + units > capacity {
                    break;
                }
                asked += units;
                pods.push(req);
            }
            let mix = TypicalMix::from_requests(&pods, 0.95);
            let mut policy = crate::alloc::build_policy("BestFit", &c, &mix).expect("known policy");
            let mut placed = c.clone();
            let (mut allocated, mut scratch) = (0u64, Vec::new());
            for req in &pods {
                if let Some(cand) = crate::alloc::place(
                    policy.as_mut(),
                    &mut placed,
                    req,
                    TieBreak::Random,
                    &mut r,
                    &mut scratch,
                )
                .expect("placement")
                {
                    let n = &placed.nodes[cand.node as usize];
                    allocated += match req.gpu {
                        GpuDemand::Shared { amount } => u64::from(amount),
                        _ => cand.gpus.iter().map(|g| u64::from(n.gpus[g].capacity)).sum(),
                    };
                }
            }
            let greedy = pct(&c, allocated);
            let b = bound(&c, &pods);
            assert!(
                b <= greedy + 1e-6,
                "seed {seed}: bound {b} above BestFit's {greedy}"
            );
            eprintln!("seed {seed}: bound {b:.2} % unallocated, BestFit {greedy:.2} %");
            assert!(
                b >= pct(&c, asked) - 1e-6,
                "seed {seed}: bound {b} allocates more than the {asked} units asked"
            );
        }
    }
}
