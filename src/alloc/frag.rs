//! The FGD paper's fragmentation measure (Weng et al., ATC'23, §3).
//!
//! A node's idle GPU capacity is a *fragment* for a task type when that task cannot use it: all of it
//! when the node cannot host the task at all (not enough CPU, not enough GPU, wrong model), otherwise
//! the free units of the GPUs too small for one share of the task. The node's fragmentation is the
//! expectation over the *typical* task mix, each type weighted by its popularity. Following the paper's
//! artifact, CPU-only task types count all idle GPU capacity as fragment, and memory is not part of the
//! measure unless asked for ([`FragModel::new`]'s `use_memory`).
//!
//! For speed the mix is compiled per GPU model into *demand classes* (task types that ask the same of
//! GPUs), so a node is summarised by two numbers per class: how many of its GPUs fit one share, and the
//! free units on the GPUs that do not. A placement changes one or a few GPUs, so its effect on those
//! numbers, and on the fragmentation, is computed from the summary without rescanning the node.

use super::{Cluster, Gpu, GpuDemand, ModelId, ModelSet, ModelTable, Node, Request};

/// One typical task type and its popularity (the popularities of a mix sum to 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TypicalType {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub gpu: GpuDemand,
    pub models: Option<ModelSet>,
    pub popularity: f64,
}

/// The typical workload: the most popular task types that together make up `threshold` of all tasks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TypicalMix {
    /// The typical types (popularities sum to 1).
    pub types: Vec<TypicalType>,
    /// Every task type seen, most popular first (popularity = share of all tasks).
    pub all: Vec<TypicalType>,
}

impl TypicalMix {
    /// All GPU task types, a whole-GPU type weighted by its count times its number of GPUs (so keeping
    /// an 8-GPU node whole counts for eight 1-GPU tasks), a shared type by its count.
    pub fn by_gpus_needed(&self) -> TypicalMix {
        let mut types: Vec<TypicalType> = self
            .all
            .iter()
            .filter(|t| t.gpu != GpuDemand::None)
            .map(|t| TypicalType {
                popularity: t.popularity * f64::from(t.gpu.gpus_needed()),
                ..*t
            })
            .collect();
        let sum: f64 = types.iter().map(|t| t.popularity).sum();
        for t in &mut types {
            t.popularity /= sum.max(f64::MIN_POSITIVE);
        }
        TypicalMix {
            types,
            all: self.all.clone(),
        }
    }

    /// All task types, each weighted by its share of the GPU demand (a whole GPU counts `whole_units`):
    /// a rare 8-GPU task type weighs as much as eight common 1-GPU ones. CPU-only types are dropped.
    pub fn by_gpu_demand(&self, whole_units: u32) -> TypicalMix {
        let mut types: Vec<TypicalType> = self
            .all
            .iter()
            .filter(|t| t.gpu != GpuDemand::None)
            .map(|t| TypicalType {
                popularity: t.popularity * t.gpu.units(whole_units) as f64,
                ..*t
            })
            .collect();
        let sum: f64 = types.iter().map(|t| t.popularity).sum();
        for t in &mut types {
            t.popularity /= sum.max(f64::MIN_POSITIVE);
        }
        TypicalMix {
            types,
            all: self.all.clone(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    cpu: u64,
    mem: u64,
    p: f64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Range {
    start: usize,
    end: usize,
    p_total: f64,
}

/// A [`TypicalMix`] compiled for fast evaluation on the nodes of one cluster.
#[derive(Debug, Clone)]
pub struct FragModel {
    /// Fill mode: see [`FragModel::fill`].
    fill: bool,
    /// See [`FragModel::whole_in_mean_gpus`] (0: off).
    whole_unit: u32,
    classes: Vec<GpuDemand>,
    need: Vec<u32>,
    /// Per model: popularity of the types that count all idle capacity as fragment regardless of state.
    always: Vec<f64>,
    /// Popularity of the CPU-only types (fill mode ignores types the model cannot serve: they would
    /// otherwise pull work toward scarce models).
    cpu_only: f64,
    /// Per (model, class): the types of that class the model can serve.
    ranges: Vec<Range>,
    entries: Vec<Entry>,
}

impl FragModel {
    /// Compiles `mix` for the models in `models`. With `use_memory`, a type also needs its memory free on
    /// the node to count as hostable (the paper's measure ignores memory).
    pub fn new(mix: &TypicalMix, models: &ModelTable, use_memory: bool) -> FragModel {
        let n_models = models.len().max(1);
        let mut classes: Vec<GpuDemand> = Vec::new();
        for t in &mix.types {
            if t.gpu != GpuDemand::None && !classes.contains(&t.gpu) {
                classes.push(t.gpu);
            }
        }
        let d = classes.len();
        let mut always = vec![0.0; n_models];
        let mut per: Vec<Vec<Entry>> = vec![Vec::new(); n_models * d];
        for t in &mix.types {
            for (m, always_m) in always.iter_mut().enumerate() {
                let accessible = t.models.is_none_or(|s| s.contains(m as ModelId));
                match (t.gpu, accessible) {
                    (GpuDemand::None, _) | (_, false) => *always_m += t.popularity,
                    (g, true) => {
                        let c = classes.iter().position(|x| *x == g).unwrap_or(0);
                        let mem = if use_memory { t.memory_mib } else { 0 };
                        per[m * d + c].push(Entry {
                            cpu: t.cpu_milli,
                            mem,
                            p: t.popularity,
                        });
                    }
                }
            }
        }
        let mut ranges = Vec::with_capacity(per.len());
        let mut entries = Vec::new();
        for mut list in per {
            list.sort_by_key(|e| (e.cpu, e.mem));
            let start = entries.len();
            let p_total = list.iter().map(|e| e.p).sum();
            entries.extend(list);
            ranges.push(Range {
                start,
                end: entries.len(),
                p_total,
            });
        }
        let need = classes.iter().map(|c| c.gpus_needed()).collect();
        let cpu_only = mix
            .types
            .iter()
            .filter(|t| t.gpu == GpuDemand::None)
            .map(|t| t.popularity)
            .sum();
        FragModel {
            fill: false,
            whole_unit: 0,
            classes,
            need,
            always,
            cpu_only,
            ranges,
            entries,
        }
    }

    /// Fill mode (gpumem's measure): a node's fragment for a task type is the idle GPU capacity left
    /// over once the node is packed with as many tasks of that type as its GPUs, CPU and memory allow.
    /// Unlike the paper's measure (is there room for one more task?), it sees CPU and memory stranding
    /// (8 idle GPUs with CPU for 3 tasks leave 5 GPUs unusable) and holes smaller than a share.
    pub fn fill(mut self, on: bool) -> FragModel {
        self.fill = on;
        self
    }

    /// Whole-GPU task types count a GPU they cannot use as a GPU of `unit` units (the cluster's mean
    /// GPU) with the same memory taken: `free + unit - capacity` (at least 0; nothing once full),
    /// instead of its free units. A whole-GPU pod needs one GPU whatever its memory, so on a mixed
    /// fleet breaking a T4 costs it as much as breaking an A100; in the paper's measure it cost a
    /// fifth as much, and shares broke the small GPUs first. On a fleet of one GPU size this is the
    /// paper's measure. 0: off (the paper's measure).
    pub fn whole_in_mean_gpus(mut self, unit: u32) -> FragModel {
        self.whole_unit = unit;
        self
    }

    /// The fragment one GPU of `capacity` units with `free` of them free counts for `class` when it
    /// cannot host one of its shares.
    #[inline]
    fn small_of(&self, class: GpuDemand, capacity: u32, free: u32) -> u64 {
        match class {
            GpuDemand::Whole { .. } if self.whole_unit > 0 && free > 0 => {
                (u64::from(free) + u64::from(self.whole_unit)).saturating_sub(u64::from(capacity))
            }
            _ => u64::from(free),
        }
    }

    /// In fill mode, how many units of class `c` one GPU in this state holds (shares, or idle GPUs).
    #[inline]
    fn slots_of(class: GpuDemand, capacity: u32, free: u32) -> u32 {
        match class {
            GpuDemand::None => 0,
            GpuDemand::Shared { amount } => free / amount.max(1),
            GpuDemand::Whole { .. } => u32::from(free == capacity),
        }
    }

    /// Number of demand classes (the length of a node summary).
    pub fn classes(&self) -> usize {
        self.classes.len()
    }

    /// Fills the per-class summary of `node`: GPUs that fit one share, and free units on those that do not.
    pub fn summarize(&self, node: &Node, n_fit: &mut [u32], small: &mut [u64]) {
        for (c, class) in self.classes.iter().enumerate() {
            let mut fit = 0u32;
            let mut sm = 0u64;
            for g in &node.gpus {
                if self.fill {
                    fit += Self::slots_of(*class, g.capacity, g.free);
                } else if class.fits_gpu(g.capacity, g.free) {
                    fit += 1;
                } else {
                    sm += self.small_of(*class, g.capacity, g.free);
                }
            }
            n_fit[c] = fit;
            small[c] = sm;
        }
    }

    /// How one GPU going from `before` to `after` free units changes class `c`'s summary.
    #[inline]
    pub fn apply(&self, c: usize, capacity: u32, before: u32, after: u32, n_fit: &mut u32, small: &mut u64) {
        let class = self.classes[c];
        if self.fill {
            *n_fit =
                *n_fit + Self::slots_of(class, capacity, after) - Self::slots_of(class, capacity, before);
            return;
        }
        let fb = class.fits_gpu(capacity, before);
        let fa = class.fits_gpu(capacity, after);
        match (fb, fa) {
            (true, false) => {
                *n_fit -= 1;
                *small += self.small_of(class, capacity, after);
            }
            (false, true) => {
                *n_fit += 1;
                *small -= self.small_of(class, capacity, before);
            }
            (false, false) => {
                *small =
                    *small - self.small_of(class, capacity, before) + self.small_of(class, capacity, after)
            }
            (true, true) => {}
        }
    }

    /// Fragmentation (in GPU units) of a node of `model` with `cpu_free`/`mem_free`, `total_free` idle
    /// GPU units, GPUs of `gpu_capacity` units, and class summaries given by `class_state(c) -> (n_fit, small)`.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn eval(
        &self,
        model: ModelId,
        cpu_free: u64,
        mem_free: u64,
        total_free: u64,
        gpu_capacity: u32,
        mut class_state: impl FnMut(usize) -> (u32, u64),
    ) -> f64 {
        if total_free == 0 {
            return 0.0;
        }
        let m = (model as usize).min(self.always.len() - 1);
        let total = total_free as f64;
        let d = self.classes.len();
        if self.fill {
            let mut frag = self.cpu_only * total;
            for c in 0..d {
                let r = self.ranges[m * d + c];
                if r.start == r.end {
                    continue;
                }
                let (units, _) = class_state(c);
                let (slots, per_task) = match self.classes[c] {
                    GpuDemand::Shared { amount } => (u64::from(units), f64::from(amount)),
                    GpuDemand::Whole { count } => (u64::from(units / count.max(1)), f64::from(gpu_capacity)),
                    GpuDemand::None => (0, 0.0),
                };
                for e in &self.entries[r.start..r.end] {
                    let by_cpu = cpu_free.checked_div(e.cpu).unwrap_or(u64::MAX);
                    let by_mem = mem_free.checked_div(e.mem).unwrap_or(u64::MAX);
                    let tasks = slots.min(by_cpu).min(by_mem) as f64;
                    let usable = match self.classes[c] {
                        GpuDemand::Whole { count } => tasks * f64::from(count) * per_task,
                        _ => tasks * per_task,
                    };
                    frag += e.p * (total - usable.min(total));
                }
            }
            return frag;
        }
        let mut frag = self.always[m] * total;
        for c in 0..d {
            let r = self.ranges[m * d + c];
            if r.start == r.end {
                continue;
            }
            let (n_fit, small) = class_state(c);
            if n_fit < self.need[c] {
                frag += r.p_total * total;
                continue;
            }
            let mut p_ok = 0.0;
            for e in &self.entries[r.start..r.end] {
                if e.cpu > cpu_free {
                    break;
                }
                if e.mem <= mem_free {
                    p_ok += e.p;
                }
            }
            frag += p_ok * small as f64 + (r.p_total - p_ok) * total;
        }
        frag
    }

    /// Fragmentation of `node` as it stands (the slow, obviously-right path).
    pub fn node_frag(&self, node: &Node) -> f64 {
        let d = self.classes.len();
        let mut n_fit = vec![0u32; d];
        let mut small = vec![0u64; d];
        self.summarize(node, &mut n_fit, &mut small);
        let cap = node.gpus.first().map_or(0, |g| g.capacity);
        self.eval(
            node.model,
            node.cpu_free,
            node.memory_free,
            node.gpu_free_total(),
            cap,
            |c| (n_fit[c], small[c]),
        )
    }

    /// Fragmentation of the whole cluster, in GPU units.
    pub fn cluster_frag(&self, cluster: &Cluster) -> f64 {
        cluster.nodes.iter().map(|n| self.node_frag(n)).sum()
    }
}

/// What a cache entry was computed from: everything of a node that the measure and the policies
/// read, except its GPUs (kept apart, `stride` per node).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct NodeKey {
    cpu_free: u64,
    memory_free: u64,
    gpus: u32,
    model: ModelId,
}

impl NodeKey {
    fn of(node: &Node) -> NodeKey {
        NodeKey {
            cpu_free: node.cpu_free,
            memory_free: node.memory_free,
            gpus: node.gpus.len() as u32,
            model: node.model,
        }
    }
}

/// Per-node summaries and fragmentation, kept between decisions and recomputed only for nodes whose
/// state changed (checked by content, so the cache cannot go stale whoever mutates the cluster).
#[derive(Debug, Clone, Default)]
pub struct FragCache {
    d: usize,
    /// Recomputations so far; never reset, so an epoch is never reused.
    recomputed: u64,
    /// Per node: the value of `recomputed` when its entry was computed (0: never).
    epoch: Vec<u64>,
    n_fit: Vec<u32>,
    small: Vec<u64>,
    frag: Vec<f64>,
    /// Content keys ([`FragCache::sync`]): per node, and its GPUs `stride` per node.
    key: Vec<NodeKey>,
    stride: usize,
    key_gpus: Vec<Gpu>,
    /// Per node, the leader's epoch the entry was computed at ([`FragCache::follow`]).
    followed: Vec<u64>,
}

impl FragCache {
    /// Brings the entries of `nodes` (indices into `cluster.nodes`) up to date; the others are left as
    /// they are, to be checked when next asked for.
    pub fn sync(&mut self, model: &FragModel, cluster: &Cluster, nodes: impl Iterator<Item = usize> + Clone) {
        let n = cluster.nodes.len();
        self.fit(model, n);
        // The GPU keys are laid out `stride` per node: a node with more GPUs than any before lays them
        // out anew (and every entry is recomputed).
        let widest = nodes
            .clone()
            .map(|i| cluster.nodes[i].gpus.len())
            .max()
            .unwrap_or(0);
        if widest > self.stride {
            self.stride = widest;
            self.key_gpus.clear();
            self.epoch.fill(0);
        }
        self.key.resize(n, NodeKey::default());
        self.key_gpus.resize(n * self.stride, Gpu::new(0));
        for i in nodes {
            let node = &cluster.nodes[i];
            let key = NodeKey::of(node);
            let gpus = &mut self.key_gpus[i * self.stride..i * self.stride + node.gpus.len()];
            // Branch-free over the GPUs: most nodes are unchanged, so every GPU is compared anyway.
            let differ = gpus
                .iter()
                .zip(&node.gpus)
                .fold(0, |d, (k, g)| d | (k.free ^ g.free) | (k.capacity ^ g.capacity));
            if self.epoch[i] != 0 && self.key[i] == key && differ == 0 {
                continue;
            }
            gpus.copy_from_slice(&node.gpus);
            self.key[i] = key;
            self.recompute(model, i, node);
        }
    }

    /// [`FragCache::sync`] for a second model over the same nodes, without repeating the content
    /// check: a node is recomputed exactly when `leader` (synced first, over the same `nodes`)
    /// recomputed it since.
    pub fn follow(
        &mut self,
        model: &FragModel,
        cluster: &Cluster,
        nodes: impl Iterator<Item = usize>,
        leader: &FragCache,
    ) {
        self.fit(model, cluster.nodes.len());
        self.followed.resize(cluster.nodes.len(), 0);
        for i in nodes {
            if self.epoch[i] != 0 && self.followed[i] == leader.epoch(i) {
                continue;
            }
            self.followed[i] = leader.epoch(i);
            self.recompute(model, i, &cluster.nodes[i]);
        }
    }

    /// Sizes the entries for `n` nodes: nodes added or dropped since the last call, the others keep
    /// their entries.
    fn fit(&mut self, model: &FragModel, n: usize) {
        if self.d != model.classes() {
            self.d = model.classes();
            self.epoch.clear();
            self.n_fit.clear();
            self.small.clear();
        }
        self.epoch.resize(n, 0);
        self.n_fit.resize(n * self.d, 0);
        self.small.resize(n * self.d, 0);
        self.frag.resize(n, 0.0);
    }

    fn recompute(&mut self, model: &FragModel, i: usize, node: &Node) {
        let (nf, sm) = (
            &mut self.n_fit[i * self.d..(i + 1) * self.d],
            &mut self.small[i * self.d..(i + 1) * self.d],
        );
        model.summarize(node, nf, sm);
        let cap = node.gpus.first().map_or(0, |g| g.capacity);
        self.frag[i] = model.eval(
            node.model,
            node.cpu_free,
            node.memory_free,
            node.gpu_free_total(),
            cap,
            |c| (nf[c], sm[c]),
        );
        self.recomputed += 1;
        self.epoch[i] = self.recomputed;
    }

    /// Summary and fragmentation of node `i` (after [`FragCache::sync`] of `i`).
    #[inline]
    pub fn node(&self, i: usize) -> (&[u32], &[u64], f64) {
        (
            &self.n_fit[i * self.d..(i + 1) * self.d],
            &self.small[i * self.d..(i + 1) * self.d],
            self.frag[i],
        )
    }

    /// Which content node `i`'s entry was computed from (after [`FragCache::sync`] of `i`): equal
    /// epochs mean the node's cpu, memory, model and GPUs are unchanged in between.
    #[inline]
    pub fn epoch(&self, i: usize) -> u64 {
        self.epoch[i]
    }
}

/// Fragmentation of `node` after placing `req` on `gpus` (computed from the node's cached summary).
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn frag_after(
    model: &FragModel,
    node: &Node,
    n_fit: &[u32],
    small: &[u64],
    req: &Request,
    gpus: super::GpuMask,
    scratch_fit: &mut [u32],
    scratch_small: &mut [u64],
) -> f64 {
    let d = model.classes();
    scratch_fit[..d].copy_from_slice(n_fit);
    scratch_small[..d].copy_from_slice(small);
    let mut taken = 0u64;
    for i in gpus.iter() {
        let g = node.gpus[i];
        let after = match req.gpu {
            GpuDemand::Shared { amount } => g.free - amount,
            _ => 0,
        };
        taken += u64::from(g.free - after);
        for c in 0..d {
            model.apply(
                c,
                g.capacity,
                g.free,
                after,
                &mut scratch_fit[c],
                &mut scratch_small[c],
            );
        }
    }
    model.eval(
        node.model,
        node.cpu_free - req.cpu_milli,
        node.memory_free - req.memory_mib,
        node.gpu_free_total() - taken,
        node.gpus.first().map_or(0, |g| g.capacity),
        |c| (scratch_fit[c], scratch_small[c]),
    )
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::{Cluster, Gpu, GpuMask, ModelTable};
    use super::*;

    fn mix(types: &[(u64, GpuDemand, f64)]) -> TypicalMix {
        TypicalMix {
            types: types
                .iter()
                .map(|&(cpu_milli, gpu, popularity)| TypicalType {
                    cpu_milli,
                    memory_mib: 0,
                    gpu,
                    models: None,
                    popularity,
                })
                .collect(),
            all: Vec::new(),
        }
    }

    fn models() -> ModelTable {
        let mut m = ModelTable::default();
        m.intern("G").expect("intern");
        m
    }

    #[test]
    fn measure_matches_the_paper_on_hand_examples() {
        // Half the tasks want 500 milli, half want a whole GPU; both need 4 cores.
        let m = FragModel::new(
            &mix(&[
                (4000, GpuDemand::Shared { amount: 500 }, 0.5),
                (4000, GpuDemand::Whole { count: 1 }, 0.5),
            ]),
            &models(),
            false,
        );
        // GPUs free 1000 and 300: the 500-task can run, 300 is its fragment; the whole-GPU task can run,
        // 300 is its fragment too.
        assert!((m.node_frag(&node("a", 64_000, &[1000, 300])) - 300.0).abs() < 1e-9);
        // Without CPU, nothing can run: all 1300 idle units are fragment.
        assert!((m.node_frag(&node("b", 2000, &[1000, 300])) - 1300.0).abs() < 1e-9);
        // 400 + 400 free: no task fits anywhere.
        assert!((m.node_frag(&node("c", 64_000, &[400, 400])) - 800.0).abs() < 1e-9);
        // 600 + 0: the 500-task fits (no fragment), the whole-GPU task does not (600).
        assert!((m.node_frag(&node("d", 64_000, &[600, 0])) - 300.0).abs() < 1e-9);
        // A full node has no fragment at all.
        assert_eq!(m.node_frag(&node("e", 64_000, &[0, 0])), 0.0);
    }

    #[test]
    fn cpu_only_types_count_all_idle_gpu_and_models_gate_access() {
        let mut table = models();
        let other = table.intern("H").expect("intern");
        let mut x = mix(&[
            (1000, GpuDemand::None, 0.5),
            (1000, GpuDemand::Shared { amount: 100 }, 0.5),
        ]);
        x.types[1].models = Some(ModelSet::NONE.with(other));
        let m = FragModel::new(&x, &table, false);
        let n = node("a", 64_000, &[1000]);
        assert!(
            (m.node_frag(&n) - 1000.0).abs() < 1e-9,
            "model G serves neither type"
        );
        let mut h = n.clone();
        h.model = other;
        assert!((m.node_frag(&h) - 500.0).abs() < 1e-9);
    }

    #[test]
    fn incremental_evaluation_equals_recomputation() {
        let m = FragModel::new(
            &mix(&[
                (2000, GpuDemand::Shared { amount: 250 }, 0.3),
                (8000, GpuDemand::Shared { amount: 700 }, 0.2),
                (6000, GpuDemand::Whole { count: 2 }, 0.2),
                (3000, GpuDemand::Whole { count: 1 }, 0.2),
                (500, GpuDemand::None, 0.1),
            ]),
            &models(),
            false,
        );
        let n = node("a", 20_000, &[1000, 800, 250, 1000, 0, 600]);
        let d = m.classes();
        let (mut nf, mut sm) = (vec![0; d], vec![0; d]);
        m.summarize(&n, &mut nf, &mut sm);
        let (mut f2, mut s2) = (vec![0; d], vec![0; d]);
        let cases = [
            (Request::shared(1000, 0, 250), GpuMask::single(1)),
            (Request::shared(9000, 0, 600), GpuMask::single(5)),
            (Request::shared(100, 0, 1000), GpuMask::single(0)),
            (Request::whole(4000, 0, 2), GpuMask(0b1001)),
            (Request::cpu_only(19_000, 0), GpuMask::EMPTY),
        ];
        for (req, gpus) in cases {
            let fast = frag_after(&m, &n, &nf, &sm, &req, gpus, &mut f2, &mut s2);
            let mut c = Cluster::new(models(), vec![n.clone()]);
            c.allocate(0, &req, gpus).expect("fits");
            let slow = m.node_frag(&c.nodes[0]);
            assert!((fast - slow).abs() < 1e-6, "{req:?} on {gpus}: {fast} vs {slow}");
        }
    }

    #[test]
    fn whole_gpu_types_can_count_a_broken_gpu_as_a_mean_gpu() {
        let paper = FragModel::new(&mix(&[(0, GpuDemand::Whole { count: 1 }, 1.0)]), &models(), false);
        // A T4 (15360 MiB) and an A100 (81920 MiB): the mean GPU is 48640 MiB.
        let mean = paper.clone().whole_in_mean_gpus(48_640);
        let t4_and_a100 = |t4: u32, a100: u32| {
            let mut n = node("a", 64_000, &[]);
            n.gpus = vec![Gpu::new(15_360), Gpu::new(81_920)];
            (n.gpus[0].free, n.gpus[1].free) = (t4, a100);
            n
        };
        // 5000 MiB taken of the T4, or of the A100: the paper's measure counts what each keeps free,
        // so breaking the T4 looks seven times cheaper.
        let (on_t4, on_a100) = (t4_and_a100(10_360, 81_920), t4_and_a100(15_360, 76_920));
        assert_eq!(paper.node_frag(&on_t4), 10_360.0);
        assert_eq!(paper.node_frag(&on_a100), 76_920.0);
        // As mean GPUs, both lose the whole-GPU pod one GPU less the 5000 MiB taken.
        assert_eq!(mean.node_frag(&on_t4), 43_640.0);
        assert_eq!(mean.node_frag(&on_a100), 43_640.0);
        // A full GPU is no fragment; nor is an A100 with less free than a mean GPU's worth of room.
        assert_eq!(mean.node_frag(&t4_and_a100(0, 81_920)), 0.0);
        assert_eq!(mean.node_frag(&t4_and_a100(15_360, 30_000)), 0.0);
        // The incremental path agrees with a recomputation.
        let d = mean.classes();
        let (mut nf, mut sm, mut f2, mut s2) = (vec![0; d], vec![0; d], vec![0; d], vec![0; d]);
        let n = t4_and_a100(10_360, 81_920);
        mean.summarize(&n, &mut nf, &mut sm);
        for (req, gpus) in [
            (Request::shared(0, 0, 10_360), GpuMask::single(0)),
            (Request::shared(0, 0, 4_000), GpuMask::single(0)),
            (Request::shared(0, 0, 4_000), GpuMask::single(1)),
            (Request::whole(0, 0, 1), GpuMask::single(1)),
        ] {
            let fast = frag_after(&mean, &n, &nf, &sm, &req, gpus, &mut f2, &mut s2);
            let mut after = n.clone();
            for g in gpus.iter() {
                after.gpus[g].free -= match req.gpu {
                    GpuDemand::Shared { amount } => amount,
                    _ => after.gpus[g].capacity,
                };
            }
            assert_eq!(fast, mean.node_frag(&after), "{req:?} on {gpus}");
        }
        // On a fleet of one GPU size it is the paper's measure.
        let uniform = node("u", 64_000, &[1000, 300]);
        assert_eq!(
            paper.clone().whole_in_mean_gpus(1000).node_frag(&uniform),
            paper.node_frag(&uniform)
        );
    }

    #[test]
    fn typical_mix_keeps_the_popular_types_and_renormalises() {
        let mut reqs = vec![Request::shared(1000, 0, 500); 60];
        reqs.extend(vec![Request::whole(8000, 0, 1); 35]);
        reqs.extend(vec![Request::cpu_only(4000, 0); 4]);
        reqs.push(Request::whole(64_000, 0, 8));
        let mix = TypicalMix::from_requests(&reqs, 0.95);
        assert_eq!(mix.types.len(), 2);
        assert!((mix.types[0].popularity - 60.0 / 95.0).abs() < 1e-12);
        let all = TypicalMix::from_requests(&reqs, 1.0);
        assert_eq!(all.types.len(), 4);
        let sum: f64 = all.types.iter().map(|t| t.popularity).sum();
        assert!((sum - 1.0).abs() < 1e-12);
    }

    #[test]
    fn cache_follows_changes_made_behind_its_back() {
        let m = FragModel::new(
            &mix(&[(1000, GpuDemand::Shared { amount: 500 }, 1.0)]),
            &models(),
            false,
        );
        let mut c = Cluster::new(
            models(),
            vec![node("a", 64_000, &[1000, 1000]), node("b", 64_000, &[300])],
        );
        let mut cache = FragCache::default();
        cache.sync(&m, &c, 0..2);
        assert_eq!(cache.node(1).2, 300.0);
        let (e0, e1) = (cache.epoch(0), cache.epoch(1));
        c.nodes[0].gpus[0].free = 200;
        c.nodes.push(Node::new("c", 0, 1000, 1000, vec![Gpu::new(1000)]));
        cache.sync(&m, &c, 0..3);
        assert_eq!(cache.node(0).2, 200.0);
        assert_eq!(cache.node(2).2, 0.0);
        assert_ne!(cache.epoch(0), e0, "node 0 changed");
        assert_eq!(cache.epoch(1), e1, "node 1 did not");
        // A node that is not listed is left alone until it is.
        c.nodes[1].gpus[0].free = 1000;
        cache.sync(&m, &c, [0, 2].into_iter());
        assert_eq!((cache.node(1).2, cache.epoch(1)), (300.0, e1));
        cache.sync(&m, &c, 1..2);
        assert_eq!(cache.node(1).2, 0.0);
        // Capacity and model are content too (a node re-registered under the same name).
        let e2 = cache.epoch(2);
        c.nodes[2].gpus[0].capacity = 2000;
        cache.sync(&m, &c, 2..3);
        assert_ne!(cache.epoch(2), e2);
        let e2 = cache.epoch(2);
        c.nodes[2].model = 1;
        cache.sync(&m, &c, 2..3);
        assert_ne!(cache.epoch(2), e2);
        // A wider node lays the cache out anew; every entry is then recomputed under a fresh epoch.
        let e0 = cache.epoch(0);
        c.nodes.push(node("d", 64_000, &[1000; 4]));
        cache.sync(&m, &c, 0..4);
        assert!(cache.epoch(0) > e0);
        assert_eq!((cache.node(0).2, cache.node(3).2), (200.0, 0.0));
    }

    #[test]
    fn a_follower_recomputes_exactly_when_its_leader_does() {
        let x = mix(&[(4000, GpuDemand::Shared { amount: 500 }, 1.0)]);
        let (lead_model, fill_model) = (
            FragModel::new(&x, &models(), false),
            FragModel::new(&x, &models(), true).fill(true),
        );
        let mut c = Cluster::new(
            models(),
            vec![node("a", 64_000, &[1000, 700]), node("b", 2000, &[300])],
        );
        let (mut lead, mut follower, mut own) =
            (FragCache::default(), FragCache::default(), FragCache::default());
        let mut sync = |c: &Cluster, nodes: &[usize]| {
            lead.sync(&lead_model, c, nodes.iter().copied());
            follower.follow(&fill_model, c, nodes.iter().copied(), &lead);
            own.sync(&fill_model, c, nodes.iter().copied());
            for &i in nodes {
                assert_eq!(follower.node(i), own.node(i), "node {i}");
            }
            (0..c.nodes.len()).map(|i| follower.epoch(i)).collect::<Vec<_>>()
        };
        let e = sync(&c, &[0, 1]);
        c.nodes[1].cpu_free = 8000;
        let f = sync(&c, &[1]);
        assert!(f[0] == e[0] && f[1] != e[1]);
        c.nodes[0].gpus[1].free = 200;
        c.nodes.push(node("c", 64_000, &[1000]));
        let g = sync(&c, &[0, 2]);
        assert!(g[0] != f[0] && g[1] == f[1] && g[2] != 0);
        assert_eq!(sync(&c, &[0, 1, 2]), g, "nothing changed");
    }
}
