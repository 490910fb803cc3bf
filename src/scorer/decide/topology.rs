//! Multi-GPU sets: the NVLink/PCIe/NUMA pair scores of a node's GPUs and the bounded search for the
//! best set a pod's topology need allows.

use super::super::state::{NodeSnapshot, TopologyNeed};
use crate::alloc::GpuMask;
use crate::alloc::local::{PairScores, best_gpu_set, pair_score};
use crate::gpu::TopologyLevel;
use std::collections::BTreeMap;

/// NVLink links from each GPU to each other one, by position (`n x n`): what [`GpuSnapshot::nvlinks_to`]
/// answers, read once (it searches a list; the searches below ask for every pair, often).
pub(super) fn nvlink_table(node: &NodeSnapshot) -> Vec<u32> {
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

pub(super) fn set_score(scores: &PairScores, set: &[usize]) -> u64 {
    let mut total = 0;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            total += u64::from(scores.get(a, b));
        }
    }
    total
}

/// The best `n` idle GPUs meeting `need`, with their pair score.
pub(super) fn topology_set(
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
pub(super) fn nvlink_clique(
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
