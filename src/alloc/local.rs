//! Node-local choices: which of this node's devices to hand out once a pod is here.
//!
//! Pure functions over plain numbers, shared by the agent's GetPreferredAllocation and by tests:
//! whole GPUs by topology ([`best_gpu_set`]), memory on one GPU by best fit ([`best_fit_gpu`]).

use crate::gpu::{GpuInventory, TopologyLevel};

/// How well two GPUs work together: NVLink links dominate, then the PCIe path
/// (one switch > several switches > host bridge > same NUMA node > across NUMA nodes).
pub fn pair_score(level: TopologyLevel, nvlinks: u32) -> u32 {
    let pcie = match level {
        TopologyLevel::Internal | TopologyLevel::Single => 50,
        TopologyLevel::Multiple => 40,
        TopologyLevel::HostBridge => 30,
        TopologyLevel::Node => 20,
        TopologyLevel::System => 10,
    };
    nvlinks * 100 + pcie
}

/// Symmetric pair scores of a node's GPUs, by position.
#[derive(Debug, Clone)]
pub struct PairScores {
    n: usize,
    scores: Vec<u32>,
}

impl PairScores {
    pub fn new(n: usize, score: impl Fn(usize, usize) -> u32) -> Self {
        let mut scores = vec![0; n * n];
        for a in 0..n {
            for b in 0..n {
                if a != b {
                    scores[a * n + b] = score(a, b);
                }
            }
        }
        Self { n, scores }
    }

    /// The scores of `inventory`'s GPU pairs: PCIe path and NVLink links ([`pair_score`]).
    pub fn of(inventory: &GpuInventory) -> Self {
        Self::new(inventory.gpus.len(), |a, b| {
            pair_score(inventory.topology(a, b), inventory.nvlink_links(a, b))
        })
    }

    pub fn get(&self, a: usize, b: usize) -> u32 {
        self.scores[a * self.n + b]
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn set_score(&self, set: &[usize]) -> u64 {
        let mut total = 0;
        for (i, &a) in set.iter().enumerate() {
            for &b in &set[i + 1..] {
                total += u64::from(self.get(a, b));
            }
        }
        total
    }
}

/// Why no devices could be chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChoiceError {
    #[error("asked for {size} GPU(s) but only {available} are available")]
    NotEnough { size: usize, available: usize },
    #[error("must include {must} device(s), more than the {size} asked for")]
    MustExceedsSize { must: usize, size: usize },
    #[error("must-include GPU {0} is not among the available ones")]
    MustNotAvailable(usize),
    #[error("GPU position {0} does not exist on this node")]
    UnknownGpu(usize),
}

/// The most pair scores an exhaustive search may read (candidate sets times the pairs of each);
/// beyond it the search turns greedy. Every choice on a node of up to 16 GPUs stays exhaustive (the
/// most: 11,440 sets of 9 of 16 GPUs, 45 terms each; on 8 GPUs, 56 sets of 5, 15 terms each); 61 of
/// 64 GPUs would be 41,664 sets of 1,891 terms each.
pub const EXHAUSTIVE_WORK: u64 = 600_000;

/// The `size` GPUs among `available` (always containing `must_include`) that work best together:
/// the highest sum of pair scores; among equals, the set that leaves the best-connected GPUs behind
/// for later multi-GPU pods (so one GPU is taken from an already broken NVLink or switch pair).
pub fn best_gpu_set(
    scores: &PairScores,
    available: &[usize],
    must_include: &[usize],
    size: usize,
) -> Result<Vec<usize>, ChoiceError> {
    if let Some(&bad) = available.iter().chain(must_include).find(|&&g| g >= scores.len()) {
        return Err(ChoiceError::UnknownGpu(bad));
    }
    let mut available: Vec<usize> = available.to_vec();
    available.sort_unstable();
    available.dedup();
    let mut must: Vec<usize> = must_include.to_vec();
    must.sort_unstable();
    must.dedup();
    if let Some(&missing) = must.iter().find(|g| available.binary_search(g).is_err()) {
        return Err(ChoiceError::MustNotAvailable(missing));
    }
    if must.len() > size {
        return Err(ChoiceError::MustExceedsSize {
            must: must.len(),
            size,
        });
    }
    if size > available.len() {
        return Err(ChoiceError::NotEnough {
            size,
            available: available.len(),
        });
    }
    let candidates: Vec<usize> = available
        .iter()
        .copied()
        .filter(|g| must.binary_search(g).is_err())
        .collect();
    let pick = size - must.len();

    // What a set takes away from the GPUs left behind: the scores of its pairs with every available GPU
    // (computed once per GPU: the search reads it for every set).
    let mut degree = vec![0u64; scores.len()];
    for &g in &available {
        degree[g] = available.iter().map(|&o| u64::from(scores.get(g, o))).sum();
    }
    // Pairs left among the rest = total - taken + inner; the constant total does not matter.
    let objective = |inner: u64, taken: u64| (inner, inner as i64 - taken as i64);
    let not_enough = ChoiceError::NotEnough {
        size,
        available: available.len(),
    };

    let terms = (size * size.saturating_sub(1) / 2 + size) as u64;
    if binomial(candidates.len() as u64, pick as u64).saturating_mul(terms) > EXHAUSTIVE_WORK {
        return Ok(greedy_gpu_set(scores, &degree, must, &candidates, size));
    }
    let mut best: Option<((u64, i64), Vec<usize>)> = None;
    let mut set = Vec::with_capacity(size);
    for_each_combination(&candidates, pick, |chosen| {
        set.clear();
        set.extend_from_slice(&must);
        set.extend_from_slice(chosen);
        set.sort_unstable();
        let taken = set.iter().map(|&g| degree[g]).sum();
        let score = objective(scores.set_score(&set), taken);
        if best.as_ref().is_none_or(|(b, _)| score > *b) {
            best = Some((score, set.clone()));
        }
    });
    best.map(|(_, set)| set).ok_or(not_enough)
}

/// [`best_gpu_set`] for large choices: from `must`, adds one candidate at a time, the one that raises
/// the objective most (the lowest position among equals). Each step reads every candidate's pair
/// scores with the GPU added last: `size x candidates` reads in all.
fn greedy_gpu_set(
    scores: &PairScores,
    degree: &[u64],
    must: Vec<usize>,
    candidates: &[usize],
    size: usize,
) -> Vec<usize> {
    let mut set = must;
    let mut left = candidates.to_vec();
    // For each candidate left: the sum of its pair scores with the set, in the set's order.
    let mut link: Vec<u64> = left
        .iter()
        .map(|&g| set.iter().map(|&s| u64::from(scores.get(s, g))).sum())
        .collect();
    let mut inner = scores.set_score(&set);
    let mut taken: u64 = set.iter().map(|&g| degree[g]).sum();
    while set.len() < size {
        let gain = |i: usize| {
            let inner = inner + link[i];
            (inner, inner as i64 - (taken + degree[left[i]]) as i64)
        };
        let Some(i) = (0..left.len()).max_by(|&x, &y| gain(x).cmp(&gain(y)).then(y.cmp(&x))) else {
            break;
        };
        let g = left.remove(i);
        inner += link.remove(i);
        taken += degree[g];
        set.push(g);
        for (l, &o) in link.iter_mut().zip(&left) {
            *l += u64::from(scores.get(g, o));
        }
    }
    set.sort_unstable();
    set
}

fn binomial(n: u64, k: u64) -> u64 {
    if k > n {
        return 0;
    }
    let k = k.min(n - k);
    let mut result: u64 = 1;
    for i in 0..k {
        result = result.saturating_mul(n - i) / (i + 1);
    }
    result
}

/// Calls `f` with every `k`-subset of `items`, in lexicographic order.
fn for_each_combination(items: &[usize], k: usize, mut f: impl FnMut(&[usize])) {
    let mut idx: Vec<usize> = (0..k).collect();
    let mut chosen: Vec<usize> = Vec::with_capacity(k);
    let n = items.len();
    if k > n {
        return;
    }
    loop {
        chosen.clear();
        chosen.extend(idx.iter().map(|&i| items[i]));
        f(&chosen);
        // Advance the rightmost index that can still move.
        let Some(i) = (0..k).rev().find(|&i| idx[i] != i + n - k) else {
            return;
        };
        idx[i] += 1;
        for j in i + 1..k {
            idx[j] = idx[j - 1] + 1;
        }
    }
}

/// One GPU's free memory, as a candidate for a memory request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreeMemory {
    pub gpu: usize,
    pub free: u64,
}

/// Best fit: the GPU with the least free memory that still holds `need` (lowest position on ties),
/// so that large holes stay whole for large requests.
pub fn best_fit_gpu(candidates: &[FreeMemory], need: u64) -> Option<usize> {
    candidates
        .iter()
        .filter(|c| c.free >= need)
        .min_by_key(|c| (c.free, c.gpu))
        .map(|c| c.gpu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_profile::Profile;

    fn scores_of(profile: &str) -> PairScores {
        PairScores::of(&GpuInventory::discover(&Profile::load(profile).unwrap()).unwrap())
    }

    #[test]
    fn t4x4_pairs_stay_on_one_numa_node() {
        let s = scores_of("t4x4");
        assert_eq!(best_gpu_set(&s, &[0, 1, 2, 3], &[], 2).unwrap(), vec![0, 1]);
        assert_eq!(best_gpu_set(&s, &[0, 2, 3], &[], 2).unwrap(), vec![2, 3]);
        assert_eq!(best_gpu_set(&s, &[0, 1, 2, 3], &[3], 2).unwrap(), vec![2, 3]);
    }

    #[test]
    fn dgx_a100_pairs_share_a_switch_and_quads_a_numa_node() {
        let s = scores_of("dgx-a100");
        let all: Vec<usize> = (0..8).collect();
        assert_eq!(best_gpu_set(&s, &all, &[], 2).unwrap(), vec![0, 1]);
        assert_eq!(best_gpu_set(&s, &all, &[], 4).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(
            best_gpu_set(&s, &[1, 2, 3, 4, 5, 6, 7], &[], 4).unwrap(),
            vec![4, 5, 6, 7]
        );
        assert_eq!(best_gpu_set(&s, &[0, 2, 4, 5, 6], &[], 2).unwrap(), vec![4, 5]);
    }

    #[test]
    fn a_single_gpu_comes_from_an_already_broken_pair() {
        let s = scores_of("dgx-a100");
        // GPU 0 is taken: its switch partner 1 is the GPU whose loss costs later pods least.
        assert_eq!(best_gpu_set(&s, &[1, 2, 3, 4, 5, 6, 7], &[], 1).unwrap(), vec![1]);
        let mixed = scores_of("mixed");
        // Keep the NVLinked V100 pair intact: a T4 goes first.
        assert_eq!(best_gpu_set(&mixed, &[0, 1, 2, 3], &[], 1).unwrap(), vec![2]);
    }

    #[test]
    fn bad_requests_are_errors() {
        let s = scores_of("t4x4");
        assert_eq!(
            best_gpu_set(&s, &[0, 1], &[], 3),
            Err(ChoiceError::NotEnough {
                size: 3,
                available: 2
            })
        );
        assert_eq!(
            best_gpu_set(&s, &[0, 1], &[2], 1),
            Err(ChoiceError::MustNotAvailable(2))
        );
        assert_eq!(
            best_gpu_set(&s, &[0, 1], &[0, 1], 1),
            Err(ChoiceError::MustExceedsSize { must: 2, size: 1 })
        );
        assert_eq!(best_gpu_set(&s, &[0, 9], &[], 1), Err(ChoiceError::UnknownGpu(9)));
    }

    #[test]
    fn large_nodes_fall_back_to_greedy_and_still_answer() {
        let s = PairScores::new(40, |a, b| if a / 4 == b / 4 { 500 } else { 10 });
        let all: Vec<usize> = (0..40).collect();
        assert_eq!(best_gpu_set(&s, &all, &[], 4).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(best_gpu_set(&s, &all, &[9], 3).unwrap(), vec![8, 9, 10]);
    }

    #[test]
    fn up_to_8_gpus_every_set_is_weighed() {
        // Random pair scores, availability and must-include GPUs: the answer is the best of all sets
        // by the objective (pair scores inside, then what is left to the others), the first of equals.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..300 {
            let n = 1 + next(8) as usize;
            let table: Vec<u32> = (0..n * n)
                .map(|_| [10, 20, 50, 150, 650][next(5) as usize])
                .collect();
            let s = PairScores::new(n, |a, b| table[a * n + b]);
            let available: Vec<usize> = (0..n).filter(|_| next(4) != 0).collect();
            if available.is_empty() {
                continue;
            }
            let size = 1 + next(available.len() as u64) as usize;
            let must: Vec<usize> = available
                .iter()
                .copied()
                .filter(|_| next(4) == 0)
                .take(size)
                .collect();
            let degree = |g: usize| -> i64 { available.iter().map(|&o| i64::from(s.get(g, o))).sum() };
            let mut best: Option<((u64, i64), Vec<usize>)> = None;
            for mask in 0u32..1 << available.len() {
                let set: Vec<usize> = (0..available.len())
                    .filter(|&i| mask & 1 << i != 0)
                    .map(|i| available[i])
                    .collect();
                if set.len() != size || must.iter().any(|m| !set.contains(m)) {
                    continue;
                }
                let inner = s.set_score(&set);
                let score = (inner, inner as i64 - set.iter().map(|&g| degree(g)).sum::<i64>());
                // Sets of one size compare as the search meets them: lexicographically.
                let better = best
                    .as_ref()
                    .is_none_or(|(b, bs)| score > *b || (score == *b && set < *bs));
                if better {
                    best = Some((score, set));
                }
            }
            assert_eq!(
                best_gpu_set(&s, &available, &must, size).ok(),
                best.map(|(_, set)| set),
                "{n} GPUs, {available:?}, must {must:?}, size {size}"
            );
        }
    }

    #[test]
    fn best_fit_takes_the_tightest_gpu_that_fits() {
        let c = [
            FreeMemory { gpu: 0, free: 8000 },
            FreeMemory { gpu: 1, free: 5000 },
            FreeMemory { gpu: 2, free: 4000 },
        ];
        assert_eq!(best_fit_gpu(&c, 4500), Some(1));
        assert_eq!(best_fit_gpu(&c, 4000), Some(2));
        assert_eq!(best_fit_gpu(&c, 9000), None);
        let halves = [
            FreeMemory { gpu: 0, free: 4096 },
            FreeMemory { gpu: 1, free: 4096 },
        ];
        assert_eq!(best_fit_gpu(&halves, 5000), None, "4 GB + 4 GB never serves 5 GB");
    }
}
