//! gpumem's own policy: the one the scorer runs.
//!
//! Status: by default it ranks placements exactly as FGD does (the expected fragmentation of the typical
//! task mix, `floor(100 * sigmoid(gain))`), so in simulation it matches FGD; what it adds today is the
//! production side: fragmentation in the cluster's own units (MiB on mixed fleets), one call for filter,
//! prioritize and bind. [`Options`] holds the variants measured against FGD (exact or quantised gains,
//! demand-weighted mixes, a CPU/memory-aware "fill" measure as tie-breaker); they beat FGD on some
//! traces and lose on others (see the simulate README), so none is the default yet. Select one with
//! `--policy gpumem:<spec>`, e.g. `gpumem:sig=1:ft=0.001` (see [`Options::parse`]).

use rand::Rng;

use super::fgd::Evaluator;
use super::frag::{FragCache, FragModel, TypicalMix, frag_after};
use super::{Candidate, Cluster, Policy, Request};

/// Tuning knobs (the defaults are what `gpumem simulate` measures).
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
            fill_tie: 0.0,
            fill_tie_gpus: false,
            sigmoid: true,
        }
    }
}

impl Options {
    /// Parses `key=value` pairs separated by `:` (`dw=1:q=0.04:pack=0`), starting from the defaults.
    /// Keys: `dw` demand-weighted, `q` quantum, `pack`, `fill`, `mem`, `all`, `gn`, `ft` fill tie weight,
    /// `fgn` fill tie by GPUs needed, `sig` sigmoid score (booleans: 0 or 1).
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
                _ => return None,
            }
        }
        Some(o)
    }
}

#[derive(Debug, Clone)]
pub struct Gpumem {
    eval: Evaluator,
    unit: f64,
    opts: Options,
    /// The fill measure for tie-breaking: model, cache, scratch.
    second: Option<(FragModel, FragCache, Vec<u32>, Vec<u64>)>,
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
        Gpumem {
            eval: Evaluator::new(FragModel::new(&mix, &cluster.models, opts.memory).fill(opts.fill)),
            unit,
            opts,
            second,
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
        let mut second = self.second.as_mut();
        if let Some((m, cache, _, _)) = second.as_mut() {
            cache.sync(m, cluster);
        }
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
            if let Some((m, cache, fit, small)) = second.as_mut() {
                let (nf, sm, g0) = cache.node(i);
                let g1 = frag_after(m, n, nf, sm, req, gpus, fit, small);
                score -= o.fill_tie * (g1 - g0) / unit;
            }
            match out.last_mut() {
                Some(last) if last.node == i as u32 => {
                    if score > last.score {
                        last.score = score;
                        last.gpus = gpus;
                    }
                }
                _ => out.push(Candidate {
                    node: i as u32,
                    score,
                    gpus,
                }),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::frag::TypicalType;
    use super::super::testutil::*;
    use super::super::{Gpu, GpuDemand, GpuMask, Node};
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
        Options::parse("sig=0:pack=0.000001").expect("valid spec")
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
        Gpumem::new(&mix(), &c).score(&c, &req, &mut rng(), &mut out);
        assert_eq!(out[0].score, out[1].score, "default ranks like FGD");
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
    }
}
