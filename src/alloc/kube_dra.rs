//! KubeDRA: where stock kube-scheduler 1.36 puts a pod whose ResourceClaim asks for GPU memory from
//! devices with consumable capacity (DRA, KEP-5075) — what happens on gpumem's DRA path, with no
//! extender and no gpumem policy in the loop.
//!
//! On that path each GPU is one device `gpu-<index>` of the node's ResourceSlice, with
//! `allowMultipleAllocations: true` and capacity `memory` (request policy: min = step = one unit,
//! default = the whole GPU). A shared request (`amount` units of one GPU) is a claim for one device with
//! `capacity.requests.memory = amount`; `count` whole GPUs are a claim for `count` devices with no
//! capacity request, which consumes each device's whole capacity (the policy's default), so only an
//! untouched GPU can serve it. The rule, read from the Kubernetes 1.36.2 source (file and function
//! names are in docs/simulate.md, "KubeDRA"):
//!
//! 1. **Which nodes are looked at** (`schedule_one.go`, `findNodesThatPassFilters`,
//!    `numFeasibleNodesToFind`): nodes are filtered starting at a rotating index, and filtering stops
//!    once `numFeasibleNodesToFind` nodes fit: `percentageOfNodesToScore` is 0 by default, meaning
//!    `max(5, 50 − nodes/125)` % of the nodes, at least 100 (all of them below 100 nodes): 497 of the
//!    1213 openb nodes. The index then moves on by the number of nodes processed (fitting or not).
//! 2. **Which GPU on a node** (DynamicResources `Filter` → structured allocator, the "incubating"
//!    implementation that `DRAConsumableCapacity` selects): devices are tried in slice order, the first
//!    with room wins (`allocateOne`: no scoring, "the first full solution is chosen";
//!    `CmpRequestOverCapacity`: consumed + requested ≤ capacity). Slice order is GPU index order.
//! 3. **The node score**: of the default score plugins only two tell openb's nodes apart —
//!    NodeResourcesFit (LeastAllocated over cpu and memory, weight 1) and NodeResourcesBalancedAllocation
//!    (cpu and memory, weight 1). DynamicResources scores only `firstAvailable` subrequests (0 here);
//!    TaintToleration, NodeAffinity, PodTopologySpread, InterPodAffinity and ImageLocality give every
//!    node the same score when there are no taints, affinities, spread constraints or images. GPU memory
//!    enters no score: kube-scheduler does not prefer a fuller or emptier GPU.
//! 4. **Ties** (`prioritizeNodes`, `newSortedNodeScores`): the feasible nodes go into a `container/heap`
//!    ordered by total score, then by a `Randomizer` that is only set when an extender scores; without
//!    one it is 0 everywhere, so the winner among equal scores is whichever the heap puts on top: a
//!    deterministic function of the order in which the nodes were found ([`heap_top`]). This policy
//!    therefore breaks its own ties: the winner's score gets +0.5 (scores are integers), and the
//!    simulator's `--random-ties` / rank tie-breaking never come into play.
//!
//! The rotating start index is state kept across decisions: [`KubeDra::score`] must be called once per
//! scheduling decision, in arrival order (as [`super::place`] and the simulator do).

use rand::Rng;

use super::{Candidate, Cluster, GpuDemand, GpuMask, Node, Policy, Request};

/// kube-scheduler's `MaxNodeScore`.
const MAX_NODE_SCORE: i64 = 100;
/// `schedule_one.go`: `minFeasibleNodesToFind`.
const MIN_FEASIBLE_NODES_TO_FIND: u32 = 100;
/// `schedule_one.go`: `minFeasibleNodesPercentageToFind`.
const MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND: u32 = 5;
/// `pkg/scheduler/util`: `DefaultMilliCPURequest`, counted for a pod that requests no CPU.
const DEFAULT_MILLI_CPU_REQUEST: u64 = 100;
/// `pkg/scheduler/util`: `DefaultMemoryRequest` (200 MiB), counted for a pod that requests no memory.
const DEFAULT_MEMORY_REQUEST_MIB: u64 = 200;

/// `numFeasibleNodesToFind`: how many fitting nodes kube-scheduler looks for before it stops
/// filtering. `percentage` is `percentageOfNodesToScore` (0, the default: adaptive).
pub fn num_feasible_nodes_to_find(percentage: u32, num_all_nodes: u32) -> u32 {
    if num_all_nodes < MIN_FEASIBLE_NODES_TO_FIND {
        return num_all_nodes;
    }
    let mut percentage = percentage;
    if percentage == 0 {
        percentage = 50u32
            .saturating_sub(num_all_nodes / 125)
            .max(MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND);
    }
    // int32 arithmetic in Go; the product stays far below 2^31 for any real cluster.
    let num_nodes = (u64::from(num_all_nodes) * u64::from(percentage) / 100) as u32;
    num_nodes.max(MIN_FEASIBLE_NODES_TO_FIND)
}

/// The structured allocator's answer on one node: the devices (GPUs) a claim for `req` gets there, or
/// `None` when the node does not fit (NodeResourcesFit's cpu/memory filter, the model a CEL selector
/// would require, and the devices). First fit in slice order, i.e. ascending GPU index: a shared
/// request takes the first GPU whose unconsumed memory covers it, whole GPUs the first untouched ones.
pub fn first_fit(node: &Node, req: &Request) -> Option<GpuMask> {
    if !node.admits(req) {
        return None;
    }
    match req.gpu {
        GpuDemand::None => Some(GpuMask::EMPTY),
        GpuDemand::Shared { amount } => node
            .allowed(req)
            .iter()
            .find(|&g| node.gpus[g].free >= amount)
            .map(GpuMask::single),
        GpuDemand::Whole { .. } => node.first_idle(req),
    }
}

/// `leastRequestedScore`: unused share of one resource after placement, on 0..=100 (integer).
fn least_requested_score(requested: u64, capacity: u64) -> i64 {
    if capacity == 0 || requested > capacity {
        return 0;
    }
    ((capacity - requested) as i64 * MAX_NODE_SCORE) / capacity as i64
}

/// NodeResourcesFit's score with the default strategy (`LeastAllocated`, cpu and memory, weight 1
/// each): the mean of the two unused shares. The pod's request counts the scheduler's defaults (100m,
/// 200 MiB) for a resource it does not request; the node's is what its pods request.
pub fn least_allocated(node: &Node, req: &Request) -> i64 {
    let non_zero = |v: u64, default: u64| if v == 0 { default } else { v };
    let cpu = non_zero(req.cpu_milli, DEFAULT_MILLI_CPU_REQUEST);
    let mem = non_zero(req.memory_mib, DEFAULT_MEMORY_REQUEST_MIB);
    let mut score = 0i64;
    let mut weights = 0i64;
    for (capacity, used, pod) in [
        (node.cpu_capacity, node.cpu_capacity - node.cpu_free, cpu),
        (node.memory_capacity, node.memory_capacity - node.memory_free, mem),
    ] {
        if capacity == 0 {
            continue;
        }
        score += least_requested_score(used + pod, capacity);
        weights += 1;
    }
    if weights == 0 { 0 } else { score / weights }
}

/// `balancedResourceScore`: 100 × (1 − the standard deviation of the requested shares), truncated.
fn balanced_resource_score(requested: [u64; 2], allocatable: [u64; 2]) -> i64 {
    let mut fractions = [0f64; 2];
    let mut len = 0;
    for (r, a) in requested.into_iter().zip(allocatable) {
        if a == 0 {
            continue;
        }
        fractions[len] = (r as f64 / a as f64).min(1.0);
        len += 1;
    }
    // Go computes the two-resource case as |a − b| / 2 (and the general one, unused here, by mean).
    let std = if len == 2 {
        ((fractions[0] - fractions[1]) / 2.0).abs()
    } else {
        0.0
    };
    ((1.0 - std) * MAX_NODE_SCORE as f64) as i64
}

/// `balancedResourceScorer` (1.36): 50 + (50 + with − without) / 2, with and without the pod, in
/// Go's integer division (towards zero).
pub fn balanced_scorer(with_pod: i64, without_pod: i64) -> i64 {
    MAX_NODE_SCORE / 2 + (MAX_NODE_SCORE / 2 + with_pod - without_pod) / 2
}

/// NodeResourcesBalancedAllocation's score (cpu and memory, requests as they are, no defaults): how
/// much closer to balanced the node's cpu and memory shares get with the pod. `None` for a pod that
/// requests neither (its PreScore skips the plugin).
pub fn balanced_allocation(node: &Node, req: &Request) -> Option<i64> {
    if req.cpu_milli == 0 && req.memory_mib == 0 {
        return None;
    }
    let allocatable = [node.cpu_capacity, node.memory_capacity];
    let used = [
        node.cpu_capacity - node.cpu_free,
        node.memory_capacity - node.memory_free,
    ];
    let with = [used[0] + req.cpu_milli, used[1] + req.memory_mib];
    Some(balanced_scorer(
        balanced_resource_score(with, allocatable),
        balanced_resource_score(used, allocatable),
    ))
}

/// The total of the default score plugins that differ between openb nodes (each weight 1).
pub fn node_score(node: &Node, req: &Request) -> i64 {
    least_allocated(node, req) + balanced_allocation(node, req).unwrap_or(0)
}

/// The index (into `scores`, in the order the nodes were found) of the node kube-scheduler binds to:
/// Go's `heap.Init` over the list with `Less(i, j) = score[i] > score[j]` (all `Randomizer`s 0),
/// then the first `heap.Pop`, which returns the element `Init` left at the root.
pub fn heap_top(scores: &[i64]) -> Option<usize> {
    let mut h: Vec<usize> = (0..scores.len()).collect();
    heap_top_in(scores, &mut h)
}

fn heap_top_in(scores: &[i64], h: &mut Vec<usize>) -> Option<usize> {
    h.clear();
    h.extend(0..scores.len());
    let n = h.len();
    let less = |h: &[usize], a: usize, b: usize| scores[h[a]] > scores[h[b]];
    // container/heap: Init calls down(i, n) for i = n/2 − 1 down to 0.
    for i0 in (0..n / 2).rev() {
        let mut i = i0;
        loop {
            let j1 = 2 * i + 1;
            if j1 >= n {
                break;
            }
            let mut j = j1;
            let j2 = j1 + 1;
            if j2 < n && less(h, j2, j1) {
                j = j2;
            }
            if !less(h, j, i) {
                break;
            }
            h.swap(i, j);
            i = j;
        }
    }
    h.first().copied()
}

/// Stock kube-scheduler 1.36 with the DRA allocator (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct KubeDra {
    /// `percentageOfNodesToScore`; 0 = adaptive (the default).
    percentage: u32,
    /// `nextStartNodeIndex`.
    next_start: usize,
    /// Scratch: the nodes found to fit, in the order found, and their GPUs and scores.
    found: Vec<(u32, GpuMask)>,
    scores: Vec<i64>,
    heap: Vec<usize>,
}

impl KubeDra {
    /// With `percentageOfNodesToScore` = `percentage` (0: kube-scheduler's adaptive default; 100:
    /// every node is filtered and scored).
    pub fn new(percentage: u32) -> KubeDra {
        KubeDra {
            percentage: percentage.min(100),
            ..KubeDra::default()
        }
    }

    /// Where the next decision starts filtering (`nextStartNodeIndex`).
    pub fn next_start(&self) -> usize {
        self.next_start
    }
}

impl Policy for KubeDra {
    fn name(&self) -> &'static str {
        "KubeDRA"
    }

    /// The nodes kube-scheduler evaluates for this pod (those found to fit before it stopped looking),
    /// each with its total score; the node it binds to gets +0.5, so that it alone has the highest score.
    /// Advances the rotating start index.
    fn score(&mut self, cluster: &Cluster, req: &Request, _rng: &mut dyn Rng, out: &mut Vec<Candidate>) {
        out.clear();
        let n = cluster.nodes.len();
        if n == 0 {
            return;
        }
        let to_find = num_feasible_nodes_to_find(self.percentage, n as u32) as usize;
        let start = self.next_start % n;
        self.found.clear();
        let mut processed = n;
        for i in 0..n {
            let at = (start + i) % n;
            if let Some(gpus) = first_fit(&cluster.nodes[at], req) {
                self.found.push((at as u32, gpus));
                if self.found.len() == to_find {
                    processed = i + 1;
                    break;
                }
            }
        }
        self.next_start = (start + processed) % n;
        self.scores.clear();
        self.scores.extend(
            self.found
                .iter()
                .map(|&(node, _)| node_score(&cluster.nodes[node as usize], req)),
        );
        let Some(top) = heap_top_in(&self.scores, &mut self.heap) else {
            return;
        };
        for (k, (&(node, gpus), &score)) in self.found.iter().zip(&self.scores).enumerate() {
            let bonus = if k == top { 0.5 } else { 0.0 };
            out.push(Candidate {
                node,
                score: score as f64 + bonus,
                gpus,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::{Gpu, ModelSet, TieBreak, place, select};
    use super::*;

    fn idle_nodes(n: usize) -> Cluster {
        cluster(
            (0..n)
                .map(|i| node(&format!("n{i:03}"), 64_000, &[1000; 4]))
                .collect(),
        )
    }

    #[test]
    fn the_first_device_with_room_wins_in_index_order() {
        let n = node("a", 64_000, &[300, 1000, 600, 500]);
        // Best fit would take GPU 3 (500 free) or 2; the allocator takes the first with room.
        assert_eq!(
            first_fit(&n, &Request::shared(0, 0, 500)),
            Some(GpuMask::single(1))
        );
        assert_eq!(
            first_fit(&n, &Request::shared(0, 0, 300)),
            Some(GpuMask::single(0))
        );
        assert_eq!(first_fit(&n, &Request::shared(0, 0, 1001)), None);
        // Whole GPUs: the claim names no memory, so it consumes the whole capacity: untouched GPUs only.
        let n = node("b", 64_000, &[1000, 999, 1000, 1000]);
        assert_eq!(first_fit(&n, &Request::whole(0, 0, 2)), Some(GpuMask(0b101)));
        assert_eq!(first_fit(&n, &Request::whole(0, 0, 3)), Some(GpuMask(0b1101)));
        assert_eq!(first_fit(&n, &Request::whole(0, 0, 4)), None);
        // CPU, memory and the model (a CEL selector on productName) still apply.
        assert_eq!(first_fit(&n, &Request::shared(64_001, 0, 1)), None);
        assert_eq!(
            first_fit(&n, &Request::shared(0, 0, 1).with_models(ModelSet::NONE.with(1))),
            None
        );
        assert_eq!(first_fit(&n, &Request::cpu_only(1000, 0)), Some(GpuMask::EMPTY));
    }

    #[test]
    fn nodes_to_find_follow_the_adaptive_percentage() {
        assert_eq!(num_feasible_nodes_to_find(0, 50), 50, "all nodes below 100");
        assert_eq!(
            num_feasible_nodes_to_find(0, 150),
            100,
            "49% of 150 is under the minimum"
        );
        assert_eq!(
            num_feasible_nodes_to_find(0, 1213),
            497,
            "41% of openb's 1213 nodes"
        );
        assert_eq!(num_feasible_nodes_to_find(0, 5000), 500, "10%");
        assert_eq!(num_feasible_nodes_to_find(0, 6000), 300, "floored at 5%");
        assert_eq!(num_feasible_nodes_to_find(100, 1213), 1213);
        assert_eq!(num_feasible_nodes_to_find(10, 1213), 121);
    }

    #[test]
    fn node_score_is_least_allocated_plus_balanced_allocation() {
        // 64 cores, 32 used; 256000 MiB, none used; the pod asks 16 cores and 64000 MiB.
        let mut n = node("a", 32_000, &[1000]);
        n.memory_capacity = 256_000;
        n.memory_free = 256_000;
        let req = Request::shared(16_000, 64_000, 500);
        // cpu: (64000 − 48000)·100/64000 = 25; memory: 192000·100/256000 = 75; mean 50.
        assert_eq!(least_allocated(&n, &req), 50);
        // shares with the pod 0.75 / 0.25 (std 0.25 → 75), without 0.5 / 0 (std 0.25 → 75):
        // 50 + (50 + 75 − 75) / 2 = 75.
        assert_eq!(balanced_allocation(&n, &req), Some(75));
        assert_eq!(node_score(&n, &req), 125);
        // A pod that evens the node out scores higher: 16 cores and 192000 MiB → 0.75 / 0.75.
        let even = Request::shared(16_000, 192_000, 500);
        assert_eq!(balanced_allocation(&n, &even), Some(50 + (50 + 100 - 75) / 2));
        // Go's integer division truncates towards zero, as Rust's does.
        assert_eq!(balanced_scorer(39, 100), 50 + (-11 / 2));
        assert_eq!(balanced_scorer(39, 100), 45);
        // The GPUs play no part: the same node with other GPU states scores the same.
        let mut busy = n.clone();
        busy.gpus = vec![Gpu {
            capacity: 1000,
            free: 10,
        }];
        assert_eq!(node_score(&busy, &req), node_score(&n, &req));
        // Defaults for what a pod does not request (LeastAllocated only); no BalancedAllocation at all
        // for a pod requesting nothing.
        let nothing = Request::cpu_only(0, 0);
        assert_eq!(balanced_allocation(&n, &nothing), None);
        let defaults = Request::cpu_only(100, 200);
        assert_eq!(least_allocated(&n, &nothing), least_allocated(&n, &defaults));
    }

    #[test]
    fn ties_go_to_the_heap_root_not_to_the_first_or_a_random_node() {
        assert_eq!(heap_top(&[]), None);
        assert_eq!(
            heap_top(&[7, 7, 7, 7]),
            Some(0),
            "equal scores: no swap, the first found"
        );
        assert_eq!(heap_top(&[1, 5, 5]), Some(1));
        // [1, 2, 5a, 5b]: down(1) swaps 2 and 5b, down(0) then prefers the left child (5b) since 5a
        // is not strictly greater: the later of the two equal maxima wins.
        assert_eq!(heap_top(&[1, 2, 5, 5]), Some(3));
        // Always one of the highest scores.
        let mut r = rng();
        for _ in 0..500 {
            use rand::RngExt;
            let s: Vec<i64> = (0..r.random_range(1..40)).map(|_| r.random_range(0..6)).collect();
            let top = heap_top(&s).expect("non-empty");
            assert_eq!(s[top], *s.iter().max().expect("non-empty"), "{s:?}");
        }
    }

    #[test]
    fn filtering_starts_where_the_last_decision_stopped() {
        // 200 nodes: 49% is 98, so 100 fitting nodes are looked for. Nodes 0..10 have no CPU left.
        let mut c = idle_nodes(200);
        for n in &mut c.nodes[..10] {
            n.cpu_free = 0;
        }
        let req = Request::cpu_only(1000, 1000);
        let mut p = KubeDra::new(0);
        let mut out = Vec::new();
        p.score(&c, &req, &mut rng(), &mut out);
        let nodes: Vec<u32> = out.iter().map(|c| c.node).collect();
        assert_eq!(nodes, (10..110).collect::<Vec<_>>());
        assert_eq!(p.next_start(), 110, "10 that did not fit + 100 that did");
        p.score(&c, &req, &mut rng(), &mut out);
        let nodes: Vec<u32> = out.iter().map(|c| c.node).collect();
        assert_eq!(nodes, (110..200).chain(10..20).collect::<Vec<_>>());
        assert_eq!(p.next_start(), 20, "(110 + 90 + 10 + 10) mod 200");
        // All equally idle: the winner is the first node found, whatever the tie-breaking mode.
        let w = select(&out, TieBreak::Random, &mut rng()).expect("some");
        let idle = node_score(&c.nodes[110], &req) as f64;
        assert_eq!((w.node, w.score), (110, idle + 0.5));
        assert!(out.iter().all(|x| x.node == 110 || x.score == idle));
        // When fewer nodes fit than are looked for, every node is processed: the index stays put.
        let big = Request::cpu_only(60_000, 0);
        let mut crowded = c.clone();
        for n in &mut crowded.nodes[20..190] {
            n.cpu_free = 1000;
        }
        p.score(&crowded, &big, &mut rng(), &mut out);
        assert_eq!(out.len(), 20);
        assert_eq!(p.next_start(), 20);
        // No node fits: nothing to choose, index unchanged.
        p.score(&c, &Request::cpu_only(65_000, 0), &mut rng(), &mut out);
        assert!(out.is_empty());
        assert_eq!(p.next_start(), 20);
    }

    #[test]
    fn places_by_score_then_first_fit_and_rotates() {
        // 120 nodes (all fit; 100 are looked for): node 5 is half full of CPU, the others idle.
        let mut c = idle_nodes(120);
        c.nodes[5].cpu_free = 32_000;
        c.nodes[7].gpus[0].free = 400;
        let mut p = KubeDra::new(0);
        let mut out = Vec::new();
        let req = Request::shared(4000, 8000, 300);
        // LeastAllocated prefers the emptier nodes; among the idle ones (all equal) the first found.
        let w = place(&mut p, &mut c, &req, TieBreak::Random, &mut rng(), &mut out)
            .expect("valid")
            .expect("fits");
        assert_eq!((w.node, w.gpus), (0, GpuMask::single(0)));
        assert_eq!(p.next_start(), 100);
        // The next pod starts at node 100: 100..120 and 0..80, node 0 now the fullest of them.
        let w = place(&mut p, &mut c, &req, TieBreak::Random, &mut rng(), &mut out)
            .expect("valid")
            .expect("fits");
        assert_eq!(w.node, 100);
        // Every node evaluated: node 7's GPU 0 (400 free) takes a 300 share before its idle GPUs.
        let mut all = KubeDra::new(100);
        for n in &mut c.nodes {
            n.cpu_free = 1000 * 16;
        }
        c.nodes[7].cpu_free = 64_000;
        let w = place(&mut all, &mut c, &req, TieBreak::Random, &mut rng(), &mut out)
            .expect("valid")
            .expect("fits");
        assert_eq!((w.node, w.gpus), (7, GpuMask::single(0)));
    }
}
