//! gpumem's own policy: the one the scorer runs.
//!
//! The score of a placement is lexicographic in effect (the later terms are small next to the first):
//!
//! 1. **FGD's gain**: `floor(100 * sigmoid(-(frag_after - frag_before) / gpu))`, the expected fragmentation
//!    of the typical task mix (the paper's measure, [`super::frag`]), as FGD scores it.
//! 2. **Model scarcity** (`sc`): a pod that takes GPUs of a model that `gpu_spec`-restricted task types
//!    depend on pays `scarcity x pressure(model)` points per GPU taken. The pressure is the share of GPU
//!    demand that must run on that model over its share of the cluster's capacity ([`pressure`]), scaled
//!    by how fast the model fills relative to the cluster (free share of the cluster / free share of the
//!    model). Without `gpu_spec` pods every pressure is 0 and the term vanishes.
//! 3. **Reserve for multi-GPU work** (`rv`, `rx`): a placement that takes away a node's ability to host a
//!    multi-GPU task type of the trace (idle GPUs, CPU, memory, model) pays
//!    `reserve x popularity / (share of nodes able to host it)^rx`: a type only a few nodes can host
//!    (8 GPUs with 120 cores fit only the 39 G3 nodes of the Alibaba cluster) is protected strongly, a
//!    type most nodes can host hardly at all.
//! 4. **CPU/memory stranding** (`ft`): the change of the *fill* measure ([`FragModel::fill`]): the idle GPU
//!    capacity a node cannot use once packed with typical tasks as far as its CPU and memory allow. Its
//!    weight keeps it a tie-breaker among placements FGD scores the same.
//!
//! Ties left after that go to the caller's tie-break (the simulator's per-seed node ranking, as the FGD
//! artifact does). Units are the cluster's own (milli-GPUs, or MiB on a mixed fleet; one "GPU" in the
//! terms above is the cluster's mean GPU capacity). `gpumem:ft=0:rv=0:sc=0` ranks exactly like FGD.
//! Variants are selected with `--policy gpumem:<spec>` (see [`Options::parse`]).

use rand::Rng;

use super::fgd::Evaluator;
use super::frag::{FragCache, FragModel, TypicalMix, TypicalType, frag_after};
use super::{Candidate, Cluster, Policy, Request};

/// Tuning knobs. The defaults (`ft=0.001:rv=12:rx=2:sc=10:dyn=1`, FGD's sigmoid score) are what
/// `gpumem simulate` measures as "gpumem" and what the scorer runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
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
}

impl Default for Options {
    fn default() -> Options {
        Options {
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
            scarcity: 10.0,
            dynamic: true,
            reserve_exp: 2.0,
        }
    }
}

impl Options {
    /// Parses `key=value` pairs separated by `:` (`dw=1:q=0.04:pack=0`), starting from the defaults.
    /// Keys: `dw` demand-weighted, `q` quantum, `pack`, `fill`, `mem`, `all`, `gn`, `ft` fill tie weight,
    /// `fgn` fill tie by GPUs needed, `sig` sigmoid score, `rv` reserve weight, `rx` reserve exponent,
    /// `sc` scarcity weight, `dyn` dynamic scarcity (booleans: 0 or 1).
    pub fn parse(spec: &str) -> Option<Options> {
        let mut o = Options::default();
        for kv in spec.split(':').filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=')?;
            let x: f64 = v.parse().ok()?;
            match k {
                "dw" => o.demand_weighted = x != 0.0,
                "q" => o.quantum = x,
                "pack" => o.pack = x,
                "fill" => o.fill = x != 0.0,
                "mem" => o.memory = x != 0.0,
                "all" => o.all_types = x != 0.0,
                "gn" => o.gpus_needed = x != 0.0,
                "ft" => o.fill_tie = x,
                "fgn" => o.fill_tie_gpus = x != 0.0,
                "sig" => o.sigmoid = x != 0.0,
                "rv" => o.reserve = x,
                "sc" => o.scarcity = x,
                "dyn" => o.dynamic = x != 0.0,
                "rx" => o.reserve_exp = x,
                _ => return None,
            }
        }
        Some(o)
    }
}

/// Per model: the share of GPU demand (from `mix.all`) that must run on it, over its share of capacity.
/// A type allowed on several models is apportioned by their capacity; unrestricted types count nowhere.
pub fn pressure(mix: &TypicalMix, cluster: &Cluster) -> Vec<f64> {
    let n = cluster.models.len();
    let mut cap = vec![0.0f64; n];
    for node in &cluster.nodes {
        if let Some(c) = cap.get_mut(node.model as usize) {
            *c += node.gpu_capacity_total() as f64;
        }
    }
    let total_cap: f64 = cap.iter().sum();
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
                (demand[m] / total_demand) / (cap[m] / total_cap)
            }
        })
        .collect()
}

#[derive(Debug, Clone)]
pub struct Gpumem {
    eval: Evaluator,
    unit: f64,
    opts: Options,
    /// The fill measure for tie-breaking: model, cache, scratch.
    second: Option<(FragModel, FragCache, Vec<u32>, Vec<u64>)>,
    /// Multi-GPU task types worth keeping room for, with their weight.
    reserve: Vec<(TypicalType, f64)>,
    /// Per model: cost of one GPU's worth of units (scarcity term).
    pressure: Vec<f64>,
    /// Scratch: this decision's pressure per model.
    now: Vec<f64>,
    /// Capacity per model.
    model_cap: Vec<f64>,
}

impl Gpumem {
    /// A policy protecting `mix` on a cluster like `cluster`.
    pub fn new(mix: &TypicalMix, cluster: &Cluster) -> Gpumem {
        Gpumem::with_options(mix, cluster, Options::default())
    }

    pub fn with_options(mix: &TypicalMix, cluster: &Cluster, opts: Options) -> Gpumem {
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
        let mut model_cap = vec![0.0; cluster.models.len()];
        for node in &cluster.nodes {
            if let Some(c) = model_cap.get_mut(node.model as usize) {
                *c += node.gpu_capacity_total() as f64;
            }
        }
        Gpumem {
            now: pressure.clone(),
            model_cap,
            pressure,
            reserve,
            eval: Evaluator::new(FragModel::new(&mix, &cluster.models, opts.memory).fill(opts.fill)),
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
        if self.pressure.is_empty() {
            return;
        }
        let mut free = vec![0.0f64; self.pressure.len()];
        for node in &cluster.nodes {
            if let Some(f) = free.get_mut(node.model as usize) {
                *f += node.gpu_free_total() as f64;
            }
        }
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
}

impl Policy for Gpumem {
    fn name(&self) -> &'static str {
        "gpumem"
    }

    fn score(&mut self, cluster: &Cluster, req: &Request, _rng: &mut dyn Rng, out: &mut Vec<Candidate>) {
        out.clear();
        let nodes = &cluster.nodes;
        let unit = self.unit;
        let o = self.opts;
        if o.dynamic {
            self.update_pressure(cluster);
        }
        let mut second = self.second.as_mut();
        if let Some((m, cache, _, _)) = second.as_mut() {
            cache.sync(m, cluster);
        }
        let now = &self.now;
        self.eval.for_each_placement(cluster, req, |i, f0, gpus, f1| {
            let n = &nodes[i];
            let taken: u64 = match req.gpu {
                super::GpuDemand::Shared { amount } => u64::from(amount),
                _ => gpus.iter().map(|g| u64::from(n.gpus[g].capacity)).sum(),
            };
            let chosen_free: u64 = gpus.iter().map(|g| u64::from(n.gpus[g].free)).sum();
            let gpu_left = (chosen_free - taken) as f64 / unit;
            let node_left = (n.gpu_free_total() - taken) as f64 / unit;
            let mut gain = -(f1 - f0) / unit;
            if o.sigmoid {
                gain = (super::fgd::sigmoid(gain) * 100.0).trunc();
            } else if o.quantum > 0.0 {
                gain = (gain / o.quantum).floor() * o.quantum;
            }
            let mut score = gain - o.pack * (gpu_left + 1e-3 * node_left);
            if let Some(p) = now.get(n.model as usize) {
                score -= p * taken as f64 / unit;
            }
            if !self.reserve.is_empty() {
                let idle = n.idle_gpus() as u32;
                let idle_after = idle - gpus.iter().filter(|&g| n.gpus[g].is_idle()).count() as u32;
                for (t, w) in &self.reserve {
                    let k = t.gpu.gpus_needed();
                    let able = |cpu: u64, mem: u64, idle: u32| {
                        cpu >= t.cpu_milli && mem >= t.memory_mib && idle >= k
                    };
                    if t.models.is_none_or(|m| m.contains(n.model))
                        && able(n.cpu_free, n.memory_free, idle)
                        && !able(
                            n.cpu_free - req.cpu_milli,
                            n.memory_free - req.memory_mib,
                            idle_after,
                        )
                    {
                        score -= w;
                    }
                }
            }
            if let Some((m, cache, fit, small)) = second.as_mut() {
                let (nf, sm, g0) = cache.node(i);
                let g1 = frag_after(m, n, nf, sm, req, gpus, fit, small);
                score -= o.fill_tie * (g1 - g0) / unit;
            }
            Candidate::keep_best(out, i as u32, score, gpus);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::fgd::Fgd;
    use super::super::testutil::*;
    use super::super::{Gpu, GpuDemand, GpuMask, ModelSet, Node};
    use super::*;

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

    fn exact() -> Options {
        Options::parse("sig=0:pack=0.000001:ft=0:rv=0:sc=0").expect("valid spec")
    }

    /// The knobs off: FGD's ranking.
    fn fgd_like() -> Options {
        Options::parse("ft=0:rv=0:sc=0").expect("valid spec")
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
        for opts in [Options::default(), exact()] {
            let w = winner(
                &mut Gpumem::with_options(&mix(), &c, opts),
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
        Gpumem::with_options(&mix(), &c, fgd_like()).score(&c, &req, &mut rng(), &mut out);
        assert_eq!(out[0].score, out[1].score, "FGD's integer score ties them");
        let w = winner(&mut Gpumem::with_options(&mix(), &c, exact()), &c, &req);
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
        let opts = Options::parse("ft=0.001").expect("valid spec");
        let w = winner(
            &mut Gpumem::with_options(&mix(), &c, opts),
            &c,
            &Request::cpu_only(2500, 0),
        );
        assert_eq!(w.node, 1);
    }

    #[test]
    fn option_specs_parse_and_reject_garbage() {
        assert_eq!(Options::parse(""), Some(Options::default()));
        let o = Options::parse("q=0.08:ft=0.01:fgn=1:sig=0").expect("valid");
        assert!(o.quantum == 0.08 && o.fill_tie == 0.01 && o.fill_tie_gpus && !o.sigmoid);
        assert!(Options::parse("nope=1").is_none());
        assert!(Options::parse("q").is_none());
        let d = Options::default();
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
        let mut ours = Gpumem::with_options(&mix(), &c, fgd_like());
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
        Gpumem::with_options(&m, &c, fgd_like()).score(&c, &req, &mut rng(), &mut fgd_out);
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
        assert!((fresh - 10.0).abs() < 1e-9, "scarcity 10 x pressure 1: {fresh}");
        c.nodes[1].gpus[0].free = 0;
        p.score(&c, &Request::whole(1000, 0, 1), &mut rng(), &mut out);
        // Cluster 3/4 free, B 1/2 free: 10 x 0.75 / 0.5.
        assert!((p.now[1] - 15.0).abs() < 1e-9, "{}", p.now[1]);
        let mut fixed = Gpumem::with_options(&m, &c, Options::parse("dyn=0").expect("valid"));
        fixed.score(&c, &Request::whole(1000, 0, 1), &mut rng(), &mut out);
        assert!((fixed.now[1] - 10.0).abs() < 1e-9);
    }

    #[test]
    fn works_with_mixed_capacities() {
        let mut c = cluster(vec![]);
        let big = c.models.intern("A100").expect("intern");
        c.nodes
            .push(Node::new("t4", 0, 32_000, 64_000, vec![Gpu::new(15_360); 2]));
        c.nodes
            .push(Node::new("a100", big, 32_000, 64_000, vec![Gpu::new(81_920); 2]));
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
        // Restricted types on a mixed fleet: the pressure is in GPUs of the cluster's mean capacity.
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
}
