//! gpumem's own policy: the one the scorer runs.
//!
//! The score of a placement is lexicographic in effect (the later terms are small next to the first):
//!
//! 1. **FGD's gain**: `floor(100 * sigmoid(-(frag_after - frag_before) / gpu))`, the expected fragmentation
//!    of the typical task mix (the paper's measure, [`super::frag`]), as FGD scores it, but for one change
//!    on a fleet of mixed GPU sizes (`wg`): a GPU a whole-GPU type cannot use counts as a mean-sized GPU
//!    with the same memory taken, not by its free memory ([`FragModel::whole_in_mean_gpus`]), so that a
//!    share breaking a T4 costs the whole-GPU pods what breaking an A100 does.
//! 2. **Model scarcity** (`sc`): a pod that takes GPUs of a model that `gpu_spec`-restricted task types
//!    depend on pays `scarcity x pressure(model)` points per GPU taken (a share: its fraction of its
//!    GPU; a GPU counts as one whatever its memory). The pressure is the share of GPU
//!    demand that must run on that model over its share of the cluster's capacity ([`pressure`]), scaled
//!    by how fast the model fills relative to the cluster (free share of the cluster / free share of the
//!    model). Without `gpu_spec` pods every pressure is 0 and the term vanishes. Each GPU counts as
//!    its own model (a node may have GPUs of several models). An **idle** part (`idle`, off in
//!    production; docs/simulate.md says what it gained and cost): taking an idle GPU of such a model
//!    costs `idle x pressure x (idle share of the cluster's GPUs / idle share of the model's - 1)`
//!    while the model has fewer idle GPUs, for its size, than the cluster. It only reorders: every
//!    node that fits stays a candidate.
//! 3. **Reserve for multi-GPU work** (`rv`, `rx`): a placement that takes away a node's ability to host a
//!    multi-GPU task type of the trace (idle GPUs, CPU, memory, model) pays
//!    `reserve x popularity / (share of nodes able to host it)^rx`: a type only a few nodes can host
//!    (8 GPUs with 120 cores fit only the 39 G3 nodes of the Alibaba cluster) is protected strongly, a
//!    type most nodes can host hardly at all.
//! 4. **CPU/memory stranding** (`ft`): the change of the *fill* measure ([`FragModel::fill`]): the idle GPU
//!    capacity a node cannot use once packed with typical tasks as far as its CPU and memory allow. Its
//!    weight keeps it a tie-breaker among placements FGD scores the same.
//!
//! Among one node's equal placements the one leaving its GPUs the least room wins. Ties between nodes
//! left after that go to the caller's tie-break (the simulator's per-seed node ranking, as the FGD
//! artifact does). Units are the cluster's own (milli-GPUs, or MiB on a mixed fleet; one "GPU" in the
//! terms above is the cluster's mean GPU capacity). `gpumem:ft=0:rv=0:sc=0` ranks exactly like FGD.
//! The scorer runs the one configuration, [`Tuning::default`]; `gpumem simulate --policy gpumem:<spec>`
//! varies the knobs for experiments (`sim::variants`).

use rand::Rng;

use super::fgd::Evaluator;
use super::frag::{FragCache, FragModel, TypicalMix, TypicalType, frag_after};
use super::{Candidate, Cluster, GpuMask, ModelSet, Node, Policy, Request, indices};

/// The policy's knobs, for experiments. The defaults (`ft=0.001:rv=12:rx=2:sc=20:dyn=1:idle=0:wg=1`, FGD's sigmoid
/// score) are the policy: what the scorer runs ([`Gpumem::new`]) and `gpumem simulate` measures as
/// "gpumem"; only the simulator builds other tunings ([`Gpumem::with_tuning`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tuning {
    /// Weigh task types by their share of GPU demand instead of their share of tasks.
    pub demand_weighted: bool,
    /// Fragmentation differences below this many GPUs count as equal (0: exact).
    pub quantum: f64,
    /// Weight of the packing tie-breakers (free units left on the chosen GPU, then on the node).
    pub pack: f64,
    /// Use the fill measure ([`FragModel::fill`]) instead of the paper's.
    pub fill: bool,
    /// Count memory in the measure.
    pub memory: bool,
    /// Use every task type (not only the popular ones covering 95% of tasks), weighted by count.
    pub all_types: bool,
    /// Use every GPU task type, whole-GPU types weighted by count x GPUs ([`TypicalMix::by_gpus_needed`]).
    pub gpus_needed: bool,
    /// Break ties of the main measure by the fill measure's gain, with this weight (0: off).
    pub fill_tie: f64,
    /// The fill tie-breaker weighs whole-GPU types by their GPU count ([`TypicalMix::by_gpus_needed`]).
    pub fill_tie_gpus: bool,
    /// Main score as FGD's: `floor(100 * sigmoid(gain))` (then `quantum` is not used).
    pub sigmoid: bool,
    /// Weight of the reserve term: breaking a node's ability to host a multi-GPU task type costs
    /// `reserve x popularity / (share of nodes able to host it)^reserve_exp` points.
    pub reserve: f64,
    /// Weight of the scarcity term: a GPU of model m costs `scarcity x pressure(m)` per GPU taken, where
    /// pressure is the share of GPU demand that only m (or a few models) can serve over m's capacity share.
    pub scarcity: f64,
    /// Scarcity follows the free capacity: pressure(m) x (free share of the cluster) / (free share of m).
    pub dynamic: bool,
    /// Exponent of the reserve term's scarcity (1 / share of able nodes).
    pub reserve_exp: f64,
    /// Weight of the idle term: taking an idle GPU of a model that restricted task types depend on
    /// costs `idle x pressure x (idle share of the cluster's GPUs / idle share of the model's - 1)`
    /// points while the model has fewer idle GPUs, for its size, than the cluster (0: off).
    pub idle: f64,
    /// Whole-GPU task types count a GPU they cannot use as a mean GPU with the same memory taken
    /// ([`FragModel::whole_in_mean_gpus`]), not by its free memory.
    pub whole_in_mean_gpus: bool,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            demand_weighted: false,
            quantum: 0.0,
            pack: 0.0,
            fill: false,
            memory: false,
            all_types: false,
            gpus_needed: false,
            fill_tie: 0.001,
            fill_tie_gpus: false,
            sigmoid: true,
            reserve: 12.0,
            scarcity: 20.0,
            dynamic: true,
            reserve_exp: 2.0,
            idle: 0.0,
            whole_in_mean_gpus: true,
        }
    }
}

/// Per model: the GPU units of `cluster` (`free`: only those free), GPU by GPU (a node may have GPUs
/// of several models).
pub fn units_by_model(cluster: &Cluster, free: bool) -> Vec<f64> {
    let mut units = vec![0.0f64; cluster.models.len()];
    for node in &cluster.nodes {
        let of = |g: &super::Gpu| f64::from(if free { g.free } else { g.capacity });
        if node.gpu_models.is_empty() {
            if let Some(u) = units.get_mut(node.model as usize) {
                *u += node.gpus.iter().map(of).sum::<f64>();
            }
        } else {
            for (g, gpu) in node.gpus.iter().enumerate() {
                if let Some(u) = units.get_mut(node.gpu_model(g) as usize) {
                    *u += of(gpu);
                }
            }
        }
    }
    units
}

/// Per model: the share of GPU demand (from `mix.all`) that must run on it, over its share of capacity.
/// A type allowed on several models is apportioned by their capacity; unrestricted types count nowhere.
pub fn pressure(mix: &TypicalMix, cluster: &Cluster) -> Vec<f64> {
    let cap = units_by_model(cluster, false);
    let total_cap: f64 = cap.iter().sum();
    restricted_share(mix, cluster, &cap)
        .into_iter()
        .enumerate()
        .map(|(m, share)| {
            if cap[m] <= 0.0 {
                0.0
            } else {
                share / (cap[m] / total_cap)
            }
        })
        .collect()
}

/// Per model: the share of GPU demand (from `mix.all`) that must run on it (`cap`: its capacity).
fn restricted_share(mix: &TypicalMix, cluster: &Cluster, cap: &[f64]) -> Vec<f64> {
    let n = cap.len();
    let whole = cluster.mean_gpu_capacity();
    let total_demand: f64 = mix
        .all
        .iter()
        .map(|t| t.popularity * t.gpu.units(whole) as f64)
        .sum();
    let mut demand = vec![0.0f64; n];
    for t in &mix.all {
        let Some(set) = t.models else { continue };
        let d = t.popularity * t.gpu.units(whole) as f64;
        let set_cap: f64 = (0..n).filter(|&m| set.contains(m as u8)).map(|m| cap[m]).sum();
        if set_cap <= 0.0 {
            continue;
        }
        for m in 0..n {
            if set.contains(m as u8) {
                demand[m] += d * cap[m] / set_cap;
            }
        }
    }
    (0..n)
        .map(|m| {
            if cap[m] <= 0.0 || total_demand <= 0.0 {
                0.0
            } else {
                demand[m] / total_demand
            }
        })
        .collect()
}

/// The node-local parts of one placement's score: all but the scarcity term, whose pressure follows
/// the whole cluster.
#[derive(Debug, Clone, Copy, Default)]
struct Piece {
    gpus: GpuMask,
    /// FGD's gain less the packing term.
    base: f64,
    /// GPUs taken, a share counting as its fraction of its GPU (what the scarcity term charges for).
    taken: f64,
    /// The fill tie-breaker's term.
    fill: f64,
    /// Free units the chosen GPUs keep: among one node's equal scores the tightest wins.
    left: u64,
}

/// What a node's memo entry was computed from: the node's content, as the main cache's epoch names it
/// (the fill cache follows it, so it recomputes exactly then too), and the request.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Stamp {
    epoch: u64,
    req: u64,
}

/// Where node `i`'s memo entry is in [`Memo::pieces`], and what it was computed from.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Head {
    stamp: Stamp,
    start: usize,
    /// 0: the node cannot host the request.
    len: usize,
}

/// The placements of the last request on each node, replayed while neither the request nor the node
/// changes: a scorer asks the same request of a mostly unchanged cluster again and again (filter,
/// prioritize, the replicas of one workload). Entries are appended to flat arrays (no allocation per
/// node); a node that changes appends a new one, and the arrays are compacted when mostly garbage.
#[derive(Debug, Clone, Default)]
struct Memo {
    /// The request of the entries and its number, bumped when it changes (which voids every entry).
    req: Option<Request>,
    req_no: u64,
    /// `u64` words per placement in `broken`.
    words: usize,
    heads: Vec<Head>,
    pieces: Vec<Piece>,
    /// Per placement: the reserve types it breaks (bit k: `Gpumem::reserve[k]`), `words` words.
    broken: Vec<u64>,
    /// Placements in entries for the current request; the rest of `pieces` is garbage.
    live: usize,
    /// Scratch for compaction.
    spare: (Vec<Piece>, Vec<u64>),
}

impl Memo {
    /// Prepares for `req` on a cluster of `n` nodes.
    fn begin(&mut self, req: &Request, n: usize) {
        if self.req != Some(*req) {
            self.req = Some(*req);
            self.req_no += 1;
            self.pieces.clear();
            self.broken.clear();
            self.live = 0;
        }
        // Nodes added or dropped: the others keep their entries (their stamps still check content).
        for h in self.heads.iter().skip(n) {
            self.live -= self.live_len(h);
        }
        self.heads.resize(n, Head::default());
        // Once the garbage outweighs the live entries and the nodes, a compaction (which costs both)
        // is paid for by as many appends.
        if self.pieces.len() > 2 * self.live + n {
            self.compact();
        }
    }

    /// The placements entry `h` keeps live in `pieces` (none when it is for an earlier request).
    fn live_len(&self, h: &Head) -> usize {
        if h.stamp.req == self.req_no { h.len } else { 0 }
    }

    /// Sets node `i`'s entry to the placements appended since `start`.
    fn set(&mut self, i: usize, stamp: Stamp, start: usize) {
        let old = std::mem::replace(
            &mut self.heads[i],
            Head {
                stamp,
                start,
                len: self.pieces.len() - start,
            },
        );
        self.live = self.live + self.heads[i].len - self.live_len(&old);
    }

    /// Drops the garbage: copies the current entries, in node order, to the spare arrays.
    fn compact(&mut self) {
        let (pieces, broken) = &mut self.spare;
        pieces.clear();
        broken.clear();
        let w = self.words;
        for h in self.heads.iter_mut().filter(|h| h.stamp.req == self.req_no) {
            let start = pieces.len();
            pieces.extend_from_slice(&self.pieces[h.start..h.start + h.len]);
            broken.extend_from_slice(&self.broken[h.start * w..(h.start + h.len) * w]);
            h.start = start;
        }
        std::mem::swap(&mut self.pieces, pieces);
        std::mem::swap(&mut self.broken, broken);
    }
}

#[derive(Debug, Clone)]
pub struct Gpumem {
    eval: Evaluator,
    unit: f64,
    opts: Tuning,
    /// The fill measure for tie-breaking: model, cache, scratch.
    second: Option<(FragModel, FragCache, Vec<u32>, Vec<u64>)>,
    /// Multi-GPU task types worth keeping room for, with their weight.
    reserve: Vec<(TypicalType, f64)>,
    /// Per model: cost of one GPU's worth of units (scarcity term).
    pressure: Vec<f64>,
    /// Scratch: this decision's pressure per model.
    now: Vec<f64>,
    /// Scratch: this decision's idle term per model, per idle GPU taken.
    idle_cost: Vec<f64>,
    /// Capacity per model.
    model_cap: Vec<f64>,
    memo: Memo,
}

impl Gpumem {
    /// A policy protecting `mix` on a cluster like `cluster`.
    pub fn new(mix: &TypicalMix, cluster: &Cluster) -> Gpumem {
        Gpumem::with_tuning(mix, cluster, Tuning::default())
    }

    pub fn with_tuning(mix: &TypicalMix, cluster: &Cluster, opts: Tuning) -> Gpumem {
        let unit = f64::from(cluster.mean_gpu_capacity().max(1));
        let mix = if opts.gpus_needed && !mix.all.is_empty() {
            mix.by_gpus_needed()
        } else if opts.demand_weighted && !mix.all.is_empty() {
            mix.by_gpu_demand(cluster.mean_gpu_capacity())
        } else if opts.all_types && !mix.all.is_empty() {
            TypicalMix {
                types: mix.all.clone(),
                all: mix.all.clone(),
            }
        } else {
            mix.clone()
        };
        let second = (opts.fill_tie > 0.0).then(|| {
            let tie_mix = if opts.fill_tie_gpus && !mix.all.is_empty() {
                mix.by_gpus_needed()
            } else {
                mix.clone()
            };
            let m = FragModel::new(&tie_mix, &cluster.models, true).fill(true);
            let d = m.classes();
            (m, FragCache::default(), vec![0; d], vec![0; d])
        });
        let mut reserve = Vec::new();
        if opts.reserve > 0.0 {
            for t in &mix.all {
                if t.gpu.gpus_needed() < 2 {
                    continue;
                }
                let able = cluster
                    .nodes
                    .iter()
                    .filter(|n| {
                        n.cpu_capacity >= t.cpu_milli
                            && n.memory_capacity >= t.memory_mib
                            && n.gpus.len() as u32 >= t.gpu.gpus_needed()
                            && t.models.is_none_or(|m| m.contains(n.model))
                    })
                    .count();
                if able > 0 {
                    let share = able as f64 / cluster.nodes.len() as f64;
                    reserve.push((*t, opts.reserve * t.popularity / share.powf(opts.reserve_exp)));
                }
            }
        }
        let pressure = if opts.scarcity > 0.0 {
            pressure(&mix, cluster)
                .into_iter()
                .map(|p| p * opts.scarcity)
                .collect()
        } else {
            Vec::new()
        };
        let model_cap = units_by_model(cluster, false);
        let memo = Memo {
            words: reserve.len().div_ceil(64),
            ..Memo::default()
        };
        Gpumem {
            memo,
            now: pressure.clone(),
            idle_cost: vec![0.0; pressure.len()],
            model_cap,
            pressure,
            reserve,
            eval: Evaluator::new(
                FragModel::new(&mix, &cluster.models, opts.memory)
                    .fill(opts.fill)
                    .whole_in_mean_gpus(if opts.whole_in_mean_gpus { unit as u32 } else { 0 }),
            ),
            unit,
            opts,
            second,
        }
    }
}

impl Gpumem {
    /// Scales each model's pressure by how fast it fills: `pressure x (free share of the cluster) /
    /// (free share of the model)`, so a scarce model that runs out first grows dearer.
    fn update_pressure(&mut self, cluster: &Cluster) {
        // Without restricted task types every pressure is 0 whatever is free: no need to scan.
        if self.pressure.iter().all(|&p| p == 0.0) {
            return;
        }
        if self.opts.idle > 0.0 {
            self.update_idle(cluster);
        }
        if !self.opts.dynamic {
            return;
        }
        let free = units_by_model(cluster, true);
        let total_free: f64 = free.iter().sum();
        let total_cap: f64 = self.model_cap.iter().sum();
        for (m, now) in self.now.iter_mut().enumerate() {
            let base = self.pressure[m];
            *now = if base == 0.0 || total_free <= 0.0 || self.model_cap[m] <= 0.0 {
                base
            } else {
                let model_free_share = (free[m] / self.model_cap[m]).max(1e-3);
                base * (total_free / total_cap) / model_free_share
            };
        }
    }

    /// Sets each model's idle term ([`Tuning::idle`]) from the idle GPUs of the cluster.
    fn update_idle(&mut self, cluster: &Cluster) {
        let n = self.pressure.len();
        let (mut idle, mut all) = (vec![0.0f64; n], vec![0.0f64; n]);
        for node in &cluster.nodes {
            for (g, gpu) in node.gpus.iter().enumerate() {
                let m = node.gpu_model(g) as usize;
                if m < n {
                    all[m] += 1.0;
                    idle[m] += f64::from(u8::from(gpu.is_idle()));
                }
            }
        }
        let cluster_idle = idle.iter().sum::<f64>() / all.iter().sum::<f64>().max(1.0);
        for m in 0..n {
            let model_idle = (idle[m] / all[m].max(1.0)).max(1e-3);
            let short = (cluster_idle / model_idle - 1.0).max(0.0);
            self.idle_cost[m] = self.opts.idle * self.pressure[m] / self.opts.scarcity * short;
        }
    }

    /// The idle term of taking `gpus` of `node` ([`Tuning::idle`]).
    fn idle_costs(&self, node: &Node, gpus: GpuMask) -> f64 {
        if self.opts.idle <= 0.0 {
            return 0.0;
        }
        gpus.iter()
            .filter(|&g| node.gpus[g].is_idle())
            .filter_map(|g| self.idle_cost.get(node.gpu_model(g) as usize))
            .sum()
    }

    /// [`Policy::score_nodes`] for any iterator of node indices ([`Policy::score`]: all of them).
    fn score_indices(
        &mut self,
        cluster: &Cluster,
        nodes: impl Iterator<Item = usize> + Clone,
        req: &Request,
        out: &mut Vec<Candidate>,
    ) {
        out.clear();
        self.update_pressure(cluster);
        self.eval.sync(cluster, nodes.clone());
        if let Some((m, cache, _, _)) = self.second.as_mut() {
            cache.follow(m, cluster, nodes.clone(), &self.eval.cache);
        }
        self.memo.begin(req, cluster.nodes.len());
        for i in nodes {
            let stamp = Stamp {
                epoch: self.eval.cache.epoch(i),
                req: self.memo.req_no,
            };
            if self.memo.heads[i].stamp != stamp {
                let start = self.memo.pieces.len();
                self.placements(cluster, i, req);
                self.memo.set(i, stamp, start);
            }
            self.replay(cluster, i, out);
        }
    }

    /// Appends the placements of `req` on node `i` (the caches synced) to the memo.
    fn placements(&mut self, cluster: &Cluster, i: usize, req: &Request) {
        let n = &cluster.nodes[i];
        if !n.fits(req) {
            return;
        }
        let (unit, o) = (self.unit, self.opts);
        let (memo, reserve, second) = (&mut self.memo, &self.reserve, &mut self.second);
        let node_free = n.gpu_free_total();
        let idle = n.idle_gpus() as u32;
        self.eval.placements(cluster, i, req, |f0, gpus, f1| {
            let taken: u64 = match req.gpu {
                super::GpuDemand::Shared { amount } => u64::from(amount),
                _ => gpus.iter().map(|g| u64::from(n.gpus[g].capacity)).sum(),
            };
            let chosen_free: u64 = gpus.iter().map(|g| u64::from(n.gpus[g].free)).sum();
            let gpu_left = (chosen_free - taken) as f64 / unit;
            let node_left = (node_free - taken) as f64 / unit;
            let mut gain = -(f1 - f0) / unit;
            if o.sigmoid {
                gain = (super::fgd::sigmoid(gain) * 100.0).trunc();
            } else if o.quantum > 0.0 {
                gain = (gain / o.quantum).floor() * o.quantum;
            }
            let at = memo.broken.len();
            memo.broken.resize(at + memo.words, 0);
            let broken = &mut memo.broken[at..];
            let idle_after = idle - gpus.iter().filter(|&g| n.gpus[g].is_idle()).count() as u32;
            for (k, (t, _)) in reserve.iter().enumerate() {
                let need = t.gpu.gpus_needed();
                let able =
                    |cpu: u64, mem: u64, idle: u32| cpu >= t.cpu_milli && mem >= t.memory_mib && idle >= need;
                if t.models.is_none_or(|m| m.contains(n.model))
                    && able(n.cpu_free, n.memory_free, idle)
                    && !able(
                        n.cpu_free - req.cpu_milli,
                        n.memory_free - req.memory_mib,
                        idle_after,
                    )
                {
                    broken[k / 64] |= 1 << (k % 64);
                }
            }
            let fill = second.as_mut().map_or(0.0, |(m, cache, fit, small)| {
                let (nf, sm, g0) = cache.node(i);
                let g1 = frag_after(m, n, nf, sm, req, gpus, fit, small);
                o.fill_tie * (g1 - g0) / unit
            });
            // The scarcity term charges per GPU, whatever its memory: on a mixed fleet a whole T4
            // costs a T4's worth of scarcity, not the sixth of a large GPU its memory is.
            let gpus_taken = match req.gpu {
                super::GpuDemand::Shared { amount } => gpus
                    .iter()
                    .next()
                    .map_or(0.0, |g| f64::from(amount) / f64::from(n.gpus[g].capacity.max(1))),
                _ => f64::from(gpus.count()),
            };
            memo.pieces.push(Piece {
                gpus,
                base: gain - o.pack * (gpu_left + 1e-3 * node_left),
                taken: gpus_taken,
                fill,
                left: chosen_free - taken,
            });
        });
    }

    /// The scarcity term of `piece` on a node of several models, each model charged for the GPUs
    /// taken of it.
    fn model_costs(&self, node: &Node, piece: &Piece) -> f64 {
        // A share takes `taken` of its one GPU; whole GPUs are counted per model.
        let shared = matches!(self.memo.req, Some(r) if matches!(r.gpu, super::GpuDemand::Shared { .. }));
        let mut cost = 0.0;
        let mut seen = ModelSet::NONE;
        for g in piece.gpus.iter() {
            let m = node.gpu_model(g);
            if seen.contains(m) {
                continue;
            }
            seen = seen.with(m);
            let taken = if shared {
                piece.taken
            } else {
                piece.gpus.iter().filter(|&h| node.gpu_model(h) == m).count() as f64
            };
            if let Some(p) = self.now.get(m as usize) {
                cost += p * taken;
            }
        }
        cost
    }

    /// Scores node `i`'s memoized placements into `out`: the node-local parts plus this decision's
    /// scarcity, in the order the terms were always added (so the sums are the same to the bit).
    fn replay(&self, cluster: &Cluster, i: usize, out: &mut Vec<Candidate>) {
        let memo = &self.memo;
        let Head { start, len, .. } = memo.heads[i];
        if len == 0 {
            return;
        }
        let node = &cluster.nodes[i];
        let pressure = self.now.get(node.model as usize);
        // The node's best placement; among equal scores the one leaving its GPUs the least room
        // (a small share on a T4 rather than a V100 when nothing else tells them apart).
        let mut best: Option<(f64, u64, GpuMask)> = None;
        for k in start..start + len {
            let piece = memo.pieces[k];
            let mut score = piece.base;
            if !node.gpu_models.is_empty() {
                score -= self.model_costs(node, &piece);
            } else {
                if let Some(p) = pressure {
                    score -= p * piece.taken;
                }
            }
            for (w, &word) in memo.broken[k * memo.words..(k + 1) * memo.words]
                .iter()
                .enumerate()
            {
                let mut bits = word;
                while bits != 0 {
                    score -= self.reserve[w * 64 + bits.trailing_zeros() as usize].1;
                    bits &= bits - 1;
                }
            }
            if self.second.is_some() {
                score -= piece.fill;
            }
            score -= self.idle_costs(node, piece.gpus);
            if best.is_none_or(|(s, left, _)| score > s || (score == s && piece.left < left)) {
                best = Some((score, piece.left, piece.gpus));
            }
        }
        if let Some((score, _, gpus)) = best {
            Candidate::keep_best(out, i as u32, score, gpus);
        }
    }
}

impl Policy for Gpumem {
    fn name(&self) -> &'static str {
        "gpumem"
    }

    fn score(&mut self, cluster: &Cluster, req: &Request, _rng: &mut dyn Rng, out: &mut Vec<Candidate>) {
        self.score_indices(cluster, 0..cluster.nodes.len(), req, out);
    }

    fn score_nodes(
        &mut self,
        cluster: &Cluster,
        nodes: &[u32],
        req: &Request,
        _rng: &mut dyn Rng,
        out: &mut Vec<Candidate>,
    ) {
        self.score_indices(cluster, indices(nodes), req, out);
    }
}

#[cfg(test)]
mod tests {
    use super::super::fgd::Fgd;
    use super::super::testutil::*;
    use super::super::{Gpu, GpuDemand, ModelSet, Node, TieBreak, select};
    use super::*;
    use rand::RngExt;

    fn mix() -> TypicalMix {
        let t = |cpu_milli, gpu, popularity| TypicalType {
            cpu_milli,
            memory_mib: 0,
            gpu,
            models: None,
            popularity,
        };
        TypicalMix {
            types: vec![
                t(1000, GpuDemand::Shared { amount: 500 }, 0.4),
                t(1000, GpuDemand::Shared { amount: 250 }, 0.2),
                t(1000, GpuDemand::Whole { count: 1 }, 0.4),
            ],
            all: Vec::new(),
        }
    }

    fn exact() -> Tuning {
        Tuning {
            sigmoid: false,
            pack: 0.000001,
            fill_tie: 0.0,
            reserve: 0.0,
            scarcity: 0.0,
            ..Tuning::default()
        }
    }

    /// The knobs off: FGD's ranking.
    fn fgd_like() -> Tuning {
        Tuning {
            fill_tie: 0.0,
            reserve: 0.0,
            scarcity: 0.0,
            ..Tuning::default()
        }
    }

    fn typ(cpu_milli: u64, gpu: GpuDemand, models: Option<ModelSet>, popularity: f64) -> TypicalType {
        TypicalType {
            cpu_milli,
            memory_mib: 0,
            gpu,
            models,
            popularity,
        }
    }

    #[test]
    fn packs_onto_used_gpus_before_breaking_idle_ones() {
        let c = cluster(vec![
            node("idle", 64_000, &[1000, 1000]),
            node("used", 64_000, &[750, 1000]),
        ]);
        for opts in [Tuning::default(), exact()] {
            let w = winner(
                &mut Gpumem::with_tuning(&mix(), &c, opts),
                &c,
                &Request::shared(1000, 0, 250),
            );
            assert_eq!((w.node, w.gpus), (1, GpuMask::single(0)), "{opts:?}");
        }
    }

    #[test]
    fn exact_gains_separate_what_fgd_scores_lump_together() {
        // Both placements change fragmentation by a few milli only: FGD's integer score ties them.
        let c = cluster(vec![
            node("a", 64_000, &[1000, 260]),
            node("b", 64_000, &[1000, 270]),
        ]);
        let req = Request::shared(1000, 0, 255);
        let mut out = Vec::new();
        Gpumem::with_tuning(&mix(), &c, fgd_like()).score(&c, &req, &mut rng(), &mut out);
        assert_eq!(out[0].score, out[1].score, "FGD's integer score ties them");
        let w = winner(&mut Gpumem::with_tuning(&mix(), &c, exact()), &c, &req);
        assert_eq!(
            (w.node, w.gpus),
            (0, GpuMask::single(1)),
            "leaves 5 instead of 15 stranded"
        );
    }

    #[test]
    fn fill_tie_break_keeps_cpu_for_gpus() {
        // A CPU-only pod: FGD sees no fragmentation change on either node; the fill measure sees that on
        // "gpus" it would strand idle GPUs without CPU, so the pod goes to the node whose GPUs are busy.
        let c = cluster(vec![
            node("gpus", 3000, &[1000, 1000]),
            node("busy", 3000, &[0, 0]),
        ]);
        let opts = Tuning {
            fill_tie: 0.001,
            ..Tuning::default()
        };
        let w = winner(
            &mut Gpumem::with_tuning(&mix(), &c, opts),
            &c,
            &Request::cpu_only(2500, 0),
        );
        assert_eq!(w.node, 1);
    }

    #[test]
    fn the_production_tuning_has_every_term_on() {
        let d = Tuning::default();
        assert!(d.sigmoid && d.fill_tie > 0.0 && d.reserve > 0.0 && d.scarcity > 0.0 && d.dynamic);
        let off = fgd_like();
        assert!(off.fill_tie == 0.0 && off.reserve == 0.0 && off.scarcity == 0.0);
    }

    #[test]
    fn with_the_knobs_off_it_scores_exactly_like_fgd() {
        let c = cluster(vec![
            node("a", 64_000, &[1000, 1000, 1000, 1000]),
            node("b", 9000, &[500, 1000, 250, 0]),
            node("c", 30_000, &[760, 240, 1000, 1000]),
            node("d", 2000, &[1000, 1000]),
        ]);
        let reqs = [
            Request::shared(1000, 0, 250),
            Request::shared(8000, 0, 500),
            Request::whole(1000, 0, 1),
            Request::whole(4000, 0, 2),
            Request::cpu_only(3000, 0),
        ];
        let mut ours = Gpumem::with_tuning(&mix(), &c, fgd_like());
        let mut fgd = Fgd::new(FragModel::new(&mix(), &c.models, false));
        for req in &reqs {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            ours.score(&c, req, &mut rng(), &mut a);
            fgd.score(&c, req, &mut rng(), &mut b);
            assert_eq!(a, b, "{req:?}");
        }
    }

    #[test]
    fn reserve_keeps_the_only_nodes_a_big_multi_gpu_type_fits() {
        // Both 8-GPU nodes are idle; only "big" has the CPU for the rare 8-GPU, 120-core type. FGD sees
        // no fragmentation change for a 1-GPU pod on either; gpumem keeps "big" whole.
        let mut big = node("big", 128_000, &[1000; 8]);
        big.cpu_capacity = 128_000;
        let mut small = node("small", 96_000, &[1000; 8]);
        small.cpu_capacity = 96_000;
        let c = cluster(vec![big, small]);
        let mut m = mix();
        m.all = vec![
            typ(1000, GpuDemand::Whole { count: 1 }, None, 0.95),
            typ(120_000, GpuDemand::Whole { count: 8 }, None, 0.05),
        ];
        let req = Request::whole(11_000, 0, 1);
        let mut fgd_out = Vec::new();
        Gpumem::with_tuning(&m, &c, fgd_like()).score(&c, &req, &mut rng(), &mut fgd_out);
        assert_eq!(fgd_out[0].score, fgd_out[1].score, "FGD ties the two");
        let w = winner(&mut Gpumem::new(&m, &c), &c, &req);
        assert_eq!(
            w.node, 1,
            "the 1-GPU pod goes to the node the big type cannot use"
        );
        // Soft, not a rule: when only "big" fits, the pod still goes there.
        let only_big = Request::whole(100_000, 0, 1);
        let mut out = Vec::new();
        Gpumem::new(&m, &c).score(&c, &only_big, &mut rng(), &mut out);
        assert_eq!(out.iter().map(|c| c.node).collect::<Vec<_>>(), vec![0]);
    }

    fn two_models() -> (Cluster, ModelSet, TypicalMix) {
        let mut c = cluster(vec![
            node("a", 64_000, &[1000, 1000]),
            node("b", 64_000, &[1000, 1000]),
        ]);
        let scarce = c.models.intern("B").expect("intern");
        c.nodes[1].model = scarce;
        let only_b = ModelSet::NONE.with(scarce);
        let mut m = mix();
        m.all = vec![
            typ(1000, GpuDemand::Whole { count: 1 }, None, 0.5),
            typ(1000, GpuDemand::Whole { count: 1 }, Some(only_b), 0.5),
        ];
        (c, only_b, m)
    }

    #[test]
    fn scarcity_steers_unrestricted_pods_off_models_restricted_pods_need() {
        let (c, only_b, m) = two_models();
        let p = pressure(&m, &c);
        assert_eq!(p[0], 0.0);
        assert!(
            (p[1] - 1.0).abs() < 1e-9,
            "half the demand needs B, B is half the capacity: {p:?}"
        );
        assert_eq!(
            pressure(&mix(), &c),
            vec![0.0, 0.0],
            "no restricted types, no pressure"
        );
        let w = winner(&mut Gpumem::new(&m, &c), &c, &Request::whole(1000, 0, 1));
        assert_eq!(
            w.node, 0,
            "the unrestricted pod leaves B to the pods that need it"
        );
        let restricted = Request::whole(1000, 0, 1).with_models(only_b);
        let w = winner(&mut Gpumem::new(&m, &c), &c, &restricted);
        assert_eq!(w.node, 1);
    }

    #[test]
    fn scarcity_grows_as_the_scarce_model_fills_first() {
        let (mut c, _, m) = two_models();
        let mut p = Gpumem::new(&m, &c);
        let mut out = Vec::new();
        p.score(&c, &Request::whole(1000, 0, 1), &mut rng(), &mut out);
        let fresh = p.now[1];
        assert!((fresh - 20.0).abs() < 1e-9, "scarcity 20 x pressure 1: {fresh}");
        c.nodes[1].gpus[0].free = 0;
        p.score(&c, &Request::whole(1000, 0, 1), &mut rng(), &mut out);
        // Cluster 3/4 free, B 1/2 free: 20 x 0.75 / 0.5.
        assert!((p.now[1] - 30.0).abs() < 1e-9, "{}", p.now[1]);
        let mut fixed = Gpumem::with_tuning(
            &m,
            &c,
            Tuning {
                dynamic: false,
                ..Tuning::default()
            },
        );
        fixed.score(&c, &Request::whole(1000, 0, 1), &mut rng(), &mut out);
        assert!((fixed.now[1] - 20.0).abs() < 1e-9);
    }

    #[test]
    fn memo_gives_bit_for_bit_what_a_fresh_policy_computes() {
        let mut r = rng();
        // (requests the mix is drawn from, options, chance that the request changes between calls)
        for (case, (mix_size, opts, new_req)) in [
            (150, Tuning::default(), 0.4),
            (150, Tuning::default(), 0.03),
            (
                150,
                Tuning {
                    sigmoid: false,
                    quantum: 0.04,
                    pack: 0.01,
                    fill_tie_gpus: true,
                    memory: true,
                    ..Tuning::default()
                },
                0.4,
            ),
            (
                150,
                Tuning {
                    fill_tie: 0.0,
                    dynamic: false,
                    ..Tuning::default()
                },
                0.4,
            ),
            (
                150,
                Tuning {
                    reserve: 0.0,
                    scarcity: 0.0,
                    ..Tuning::default()
                },
                0.4,
            ),
            (3000, Tuning::default(), 0.4),
        ]
        .into_iter()
        .enumerate()
        {
            let base = random_cluster(&mut r, 12, 6);
            let reqs: Vec<Request> = (0..mix_size).map(|_| random_request(&mut r)).collect();
            let mix = TypicalMix::from_requests(&reqs, 0.95);
            let mut memo = Gpumem::with_tuning(&mix, &base, opts);
            let words = if mix_size > 1000 && opts.reserve > 0.0 {
                2
            } else {
                1
            };
            assert!(
                memo.memo.words <= words,
                "{case}: {} reserve types",
                memo.reserve.len()
            );
            let mut c = base.clone();
            let pool: Vec<Request> = (0..6).map(|_| random_request(&mut r)).collect();
            let mut req = pool[0];
            let (mut a, mut b) = (Vec::new(), Vec::new());
            let (mut hits, mut compactions) = (0, 0);
            for step in 0..400 {
                for _ in 0..r.random_range(1..4) {
                    match r.random_range(0..10) {
                        0..=2 => {
                            let k = r.random_range(0..c.nodes.len());
                            scramble(&mut r, &mut c.nodes[k]);
                        }
                        3 => {
                            // The last winner, unless this step's other changes took its room.
                            if let Some(w) = select(&a, TieBreak::Random, &mut r) {
                                c.allocate(w.node as usize, &req, w.gpus).ok();
                            }
                        }
                        4 if c.nodes.len() < 40 => {
                            // Up to 8 GPUs: wider than the nodes so far, so the layout grows at some point.
                            c.nodes.push(random_node(&mut r, c.nodes.len(), 8));
                        }
                        5 => c.nodes[r.random_range(0..12)].model ^= 1,
                        6 if c.nodes.len() > 12 => drop(c.nodes.pop()),
                        _ => {}
                    }
                }
                if r.random_bool(new_req) {
                    req = pool[r.random_range(0..pool.len())];
                }
                let nodes: Vec<u32> = (0..c.nodes.len() as u32).filter(|_| r.random_bool(0.7)).collect();
                let before = memo.memo.heads.clone();
                let (req_no, kept) = (memo.memo.req_no, memo.memo.pieces.len());
                if r.random_bool(0.8) {
                    memo.score_nodes(&c, &nodes, &req, &mut rng(), &mut a);
                } else {
                    memo.score(&c, &req, &mut rng(), &mut a);
                    b.clear();
                }
                hits += (0..before.len().min(c.nodes.len()))
                    .filter(|&i| before[i] == memo.memo.heads[i])
                    .count();
                compactions += usize::from(memo.memo.req_no == req_no && memo.memo.pieces.len() < kept);
                Gpumem::with_tuning(&mix, &base, opts).score(&c, &req, &mut rng(), &mut b);
                if a.len() != b.len() {
                    b.retain(|x| nodes.contains(&x.node));
                }
                assert_eq!(to_bits(&a), to_bits(&b), "case {case} step {step}: {req:?}");
            }
            assert!(
                hits > 1000,
                "case {case}: the memo was replayed only {hits} times"
            );
            assert!(new_req > 0.1 || compactions > 0, "case {case}: never compacted");
        }
    }

    #[test]
    fn memo_is_replayed_until_its_node_or_the_request_changes() {
        let mut c = cluster(vec![
            node("a", 64_000, &[1000, 500]),
            node("b", 64_000, &[1000, 750]),
        ]);
        let req = Request::shared(1000, 0, 250);
        let mut p = Gpumem::new(&mix(), &c);
        let mut out = Vec::new();
        let scores = |p: &mut Gpumem, c: &Cluster, req: &Request, out: &mut Vec<Candidate>| {
            p.score(c, req, &mut rng(), out);
            out.iter().map(|x| x.score).collect::<Vec<_>>()
        };
        let fresh = scores(&mut p, &c, &req, &mut out);
        // Mark every memoized placement: a replay shows the mark, a recomputation does not.
        let mark = |p: &mut Gpumem| p.memo.pieces.iter_mut().for_each(|x| x.base += 1000.0);
        mark(&mut p);
        let marked = scores(&mut p, &c, &req, &mut out);
        assert!(
            marked
                .iter()
                .zip(&fresh)
                .all(|(m, f)| (m - f - 1000.0).abs() < 1e-9)
        );
        // Another request voids every entry.
        scores(&mut p, &c, &Request::whole(1000, 0, 1), &mut out);
        assert_eq!(scores(&mut p, &c, &req, &mut out), fresh);
        // A node that changes voids its own entry only; so does one the main cache keeps apart (model).
        mark(&mut p);
        c.nodes[0].cpu_free -= 1000;
        let now = scores(&mut p, &c, &req, &mut out);
        assert_eq!(
            now[0], fresh[0],
            "recomputed: the CPU does not matter to this measure"
        );
        assert!((now[1] - fresh[1] - 1000.0).abs() < 1e-9, "replayed");
        c.nodes[1].gpus[0].free = 750;
        let now = scores(&mut p, &c, &req, &mut out);
        let fresh = scores(&mut Gpumem::new(&mix(), &c), &c, &req, &mut out);
        assert_eq!(now, fresh);
        // Scoring other nodes leaves an entry alone.
        mark(&mut p);
        p.score_nodes(&c, &[1], &req, &mut rng(), &mut out);
        assert_eq!(out.iter().map(|x| x.node).collect::<Vec<_>>(), vec![1]);
        p.score_nodes(&c, &[0], &req, &mut rng(), &mut out);
        assert!((out[0].score - fresh[0] - 1000.0).abs() < 1e-9);
    }

    /// A T4 node (model 0, 4 x 15360 MiB) nearly full, an idle A100 node (model 1), and a mix where a
    /// tenth of the demand (4000 MiB shares) runs only on the T4.
    fn t4s_nearly_full() -> (Cluster, ModelSet, TypicalMix) {
        let mut c = cluster(vec![]);
        let a100 = c.models.intern("A100").expect("intern");
        let mut t4 = Node::new("t4", 0, 64_000, 256_000, vec![Gpu::new(15_360); 4]);
        for g in &mut t4.gpus {
            g.free = 0;
        }
        t4.gpus[0].free = 4000;
        c.nodes.push(t4);
        c.nodes.push(Node::new(
            "a100",
            a100,
            64_000,
            256_000,
            vec![Gpu::new(81_920); 2],
        ));
        let only_t4 = ModelSet::NONE.with(0);
        let mut m = mix();
        m.all = vec![
            typ(1000, GpuDemand::Shared { amount: 4000 }, None, 0.9),
            typ(1000, GpuDemand::Shared { amount: 4000 }, Some(only_t4), 0.1),
        ];
        (c, only_t4, m)
    }

    #[test]
    fn the_idle_term_charges_an_idle_gpu_of_a_model_short_of_idle_gpus() {
        // Two idle T4s of four (half idle) against two idle A100s of two: the cluster is 4/6 idle,
        // the T4 half, so an idle T4 costs idle x pressure x (4/6 / 1/2 - 1).
        let (mut c, _, m) = t4s_nearly_full();
        c.nodes[0].gpus[2].free = 15_360;
        c.nodes[0].gpus[3].free = 15_360;
        let whole = Request::whole(1000, 0, 1);
        let score_on_t4 = |idle: f64| {
            let mut p = Gpumem::with_tuning(
                &m,
                &c,
                Tuning {
                    idle,
                    ..Tuning::default()
                },
            );
            let mut out = Vec::new();
            p.score_nodes(&c, &[0], &whole, &mut rng(), &mut out);
            (out[0].score, p.pressure[0] / p.opts.scarcity)
        };
        let (without, _) = score_on_t4(0.0);
        let (with, pressure) = score_on_t4(10.0);
        assert!(pressure > 0.0);
        let want = 10.0 * pressure * ((4.0 / 6.0) / 0.5 - 1.0);
        assert!(
            (without - with - want).abs() < 1e-9,
            "{without} - {with} != {want}"
        );
        // A share on the T4 that is already in use takes no idle GPU: no charge.
        let share = Request::shared(1000, 0, 4000);
        let mut out = Vec::new();
        let dear = Tuning {
            idle: 10.0,
            ..Tuning::default()
        };
        Gpumem::with_tuning(&m, &c, dear).score_nodes(&c, &[0], &share, &mut rng(), &mut out);
        let mut plain = Vec::new();
        Gpumem::new(&m, &c).score_nodes(&c, &[0], &share, &mut rng(), &mut plain);
        assert_eq!(out[0].gpus, GpuMask::single(0));
        assert_eq!(out[0].score, plain[0].score);
    }

    #[test]
    fn a_node_of_two_models_charges_each_gpu_as_its_model() {
        // "mixed": an A100 (position 0) and a T4 (position 1, 4000 MiB free); the T4 node is full.
        let (mut c, _, m) = t4s_nearly_full();
        c.nodes[0].gpus[0].free = 0;
        c.nodes[1].gpus = vec![Gpu::new(81_920), Gpu::new(15_360)];
        c.nodes[1].gpus[1].free = 4000;
        c.nodes[1].gpu_models = vec![1, 0];
        let cap = units_by_model(&c, false);
        assert_eq!(cap, vec![4.0 * 15_360.0 + 15_360.0, 81_920.0]);
        assert_eq!(units_by_model(&c, true), vec![4000.0, 81_920.0]);
        let share = Request::shared(1000, 0, 4000);
        let no_scarcity = Tuning {
            scarcity: 0.0,
            ..Tuning::default()
        };
        let w = winner(&mut Gpumem::with_tuning(&m, &c, no_scarcity), &c, &share);
        assert_eq!(
            (w.node, w.gpus),
            (1, GpuMask::single(1)),
            "FGD closes the T4's gap"
        );
        // A weight at which the T4's charge outweighs FGD: were the node charged as its first GPU's
        // model (the A100, no pressure), the T4 would still win.
        let dear = Tuning {
            scarcity: 1000.0,
            ..Tuning::default()
        };
        let w = winner(&mut Gpumem::with_tuning(&m, &c, dear), &c, &share);
        assert_eq!(
            (w.node, w.gpus),
            (1, GpuMask::single(0)),
            "the T4 of the mixed node is kept for the T4 pods"
        );
    }

    /// A node of two T4s (model 0) and one of two A100s, units in MiB.
    fn t4_and_a100() -> Cluster {
        let mut c = cluster(vec![]);
        let big = c.models.intern("A100").expect("intern");
        c.nodes
            .push(Node::new("t4", 0, 32_000, 64_000, vec![Gpu::new(15_360); 2]));
        c.nodes
            .push(Node::new("a100", big, 32_000, 64_000, vec![Gpu::new(81_920); 2]));
        c
    }

    /// A mix of one half-T4 share that must run on a T4 (model 0) and `wholes` whole-GPU pods that may
    /// run anywhere.
    fn t4_shares_and_whole_gpus(wholes: usize) -> TypicalMix {
        let mut reqs = vec![Request::shared(1000, 1000, 7680).with_models(ModelSet::NONE.with(0))];
        reqs.extend(std::iter::repeat_n(Request::whole(1000, 0, 1), wholes));
        TypicalMix::from_requests(&reqs, 1.0)
    }

    #[test]
    fn works_with_mixed_capacities() {
        let c = t4_and_a100();
        let reqs = [
            Request::shared(1000, 1000, 15_000),
            Request::shared(1000, 1000, 15_000),
            Request::whole(1000, 0, 1),
        ];
        let mix = TypicalMix::from_requests(&reqs, 1.0);
        let mut p = Gpumem::new(&mix, &c);
        let mut out = Vec::new();
        p.score(&c, &Request::shared(1000, 1000, 30_000), &mut rng(), &mut out);
        assert_eq!(
            out.iter().map(|c| c.node).collect::<Vec<_>>(),
            vec![1],
            "only an A100 holds 30000 MiB"
        );
        // Restricted types on a mixed fleet.
        let only_t4 = ModelSet::NONE.with(0);
        let mix = TypicalMix::from_requests(
            &[
                Request::whole(1000, 0, 1).with_models(only_t4),
                Request::shared(1000, 1000, 15_000),
            ],
            1.0,
        );
        let mut p = Gpumem::new(&mix, &c);
        p.score(&c, &Request::shared(1000, 1000, 15_000), &mut rng(), &mut out);
        assert!(out.iter().all(|c| c.score.is_finite()), "{out:?}");
        assert_eq!(out.len(), 2);
        let best = out
            .iter()
            .max_by(|a, b| a.score.total_cmp(&b.score))
            .map(|c| c.node);
        assert_eq!(
            best,
            Some(1),
            "the T4s are what the restricted type needs: {out:?}"
        );
    }

    #[test]
    fn a_share_breaks_a_large_gpu_rather_than_the_t4s_restricted_pods_need() {
        // Half the pods are shares that must run on a T4, the others whole GPUs that may run anywhere.
        let c = t4_and_a100();
        let mix = t4_shares_and_whole_gpus(1);
        let share = Request::shared(1000, 1000, 7680);
        let w = winner(&mut Gpumem::new(&mix, &c), &c, &share);
        assert_eq!(
            w.node, 1,
            "an A100, the T4s kept for the pods that can only use them"
        );
        // Counting a broken GPU by its free memory, breaking a T4 looked five times cheaper than
        // breaking an A100 for the whole-GPU pods, and the share took a T4.
        let paper = Tuning {
            whole_in_mean_gpus: false,
            ..Tuning::default()
        };
        assert_eq!(
            winner(&mut Gpumem::with_tuning(&mix, &c, paper), &c, &share).node,
            0
        );
    }

    #[test]
    fn among_equal_placements_on_a_node_the_tightest_gpu() {
        // A node of two V100s and two T4s, alone in the cluster; nothing in the mix tells a V100 and
        // a T4 apart for a 5000 MiB share: the T4 is the tighter fit, the V100s stay whole.
        let mut c = cluster(vec![]);
        let v100 = c.models.intern("V100").expect("intern");
        let mut n = Node::new("mixed", v100, 32_000, 64_000, vec![Gpu::new(32_768); 2]);
        n.gpus.extend([Gpu::new(15_360); 2]);
        n.gpu_models = vec![v100, v100, 0, 0];
        c.nodes.push(n);
        let share = Request::shared(1000, 1000, 5000);
        let mix = TypicalMix::from_requests(&[share], 1.0);
        let w = winner(&mut Gpumem::new(&mix, &c), &c, &share);
        assert_eq!(w.gpus, GpuMask::single(2));
    }

    #[test]
    fn scarcity_charges_per_gpu_taken_whatever_its_memory() {
        // A third of the demand must run on the T4s.
        let c = t4_and_a100();
        let mix = t4_shares_and_whole_gpus(2);
        let t4_score = |tuning: Tuning, req: &Request| {
            let mut p = Gpumem::with_tuning(&mix, &c, tuning);
            let mut out = Vec::new();
            p.score(&c, req, &mut rng(), &mut out);
            let on_t4 = out.iter().find(|x| x.node == 0).map(|x| x.score);
            (
                on_t4.expect("the T4 node fits"),
                p.now.first().copied().unwrap_or(0.0),
            )
        };
        let free = Tuning {
            scarcity: 0.0,
            ..Tuning::default()
        };
        for (req, gpus) in [
            (Request::whole(1000, 0, 1), 1.0),
            (Request::shared(1000, 1000, 7680), 0.5),
        ] {
            let (charged, now) = t4_score(Tuning::default(), &req);
            let (plain, _) = t4_score(free, &req);
            assert!(now > 0.0, "the T4 is under pressure");
            assert!(
                (plain - charged - now * gpus).abs() < 1e-9,
                "{req:?}: {gpus} T4 taken costs {} points, not its memory's share of the mean GPU: {plain} - {charged}",
                now * gpus
            );
        }
    }
}
