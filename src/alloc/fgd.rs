//! FGD, Fragmentation Gradient Descent (Weng et al., ATC'23), as its artifact scores it: for each
//! feasible node, the placement that least increases the node's fragmentation; the node score is
//! `floor(100 * sigmoid((frag_before - frag_after) / gpu_capacity))`, and among a node's GPUs the first
//! with the highest score wins.

use rand::Rng;

use super::frag::{FragCache, FragModel, frag_after};
use super::{Candidate, Cluster, GpuDemand, GpuMask, Policy, Request, indices};

pub(crate) fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Reusable evaluation state: the compiled mix, per-node cache and scratch space.
#[derive(Debug, Clone)]
pub(crate) struct Evaluator {
    pub model: FragModel,
    pub cache: FragCache,
    fit: Vec<u32>,
    small: Vec<u64>,
    /// Scratch: one node's placements.
    masks: Vec<GpuMask>,
}

impl Evaluator {
    pub fn new(model: FragModel) -> Evaluator {
        let d = model.classes();
        Evaluator {
            model,
            cache: FragCache::default(),
            fit: vec![0; d],
            small: vec![0; d],
            masks: Vec::new(),
        }
    }

    /// Brings the cache up to date for `nodes` (indices into `cluster.nodes`).
    pub fn sync(&mut self, cluster: &Cluster, nodes: impl Iterator<Item = usize> + Clone) {
        self.cache.sync(&self.model, cluster, nodes);
    }

    /// Calls `visit(node, frag_before, gpus, frag_after)` for each feasible node of `nodes` (indices
    /// into `cluster.nodes`) and each of its placements ([`Evaluator::placements`]).
    pub fn for_each_placement(
        &mut self,
        cluster: &Cluster,
        nodes: impl Iterator<Item = usize> + Clone,
        req: &Request,
        mut visit: impl FnMut(usize, f64, GpuMask, f64),
    ) {
        self.sync(cluster, nodes.clone());
        for i in nodes {
            if cluster.nodes[i].fits(req) {
                self.placements(cluster, i, req, |f0, gpus, f1| visit(i, f0, gpus, f1));
            }
        }
    }

    /// Calls `visit(frag_before, gpus, frag_after)` for each distinct placement of `req` on node `i`,
    /// which must fit it and be synced in `cache` (shared: one per distinct free amount among fitting
    /// GPUs, lowest index first; whole: the first idle GPUs; none: one).
    pub fn placements(
        &mut self,
        cluster: &Cluster,
        i: usize,
        req: &Request,
        mut visit: impl FnMut(f64, GpuMask, f64),
    ) {
        let n = &cluster.nodes[i];
        // The placements first, then one evaluation loop (one call site keeps `frag_after` inlined).
        self.masks.clear();
        match req.gpu {
            GpuDemand::Shared { amount } => {
                let mut seen = [0u32; 8];
                let mut n_seen = 0usize;
                for g in n.allowed(req).iter() {
                    let gpu = n.gpus[g];
                    if gpu.free < amount {
                        continue;
                    }
                    if seen[..n_seen].contains(&gpu.free) {
                        continue;
                    }
                    if n_seen < seen.len() {
                        seen[n_seen] = gpu.free;
                        n_seen += 1;
                    }
                    self.masks.push(GpuMask::single(g));
                }
            }
            GpuDemand::Whole { .. } => self.masks.extend(n.first_idle(req)),
            GpuDemand::None => self.masks.push(GpuMask::EMPTY),
        }
        let (nf, sm, f0) = self.cache.node(i);
        for &mask in &self.masks {
            let f1 = frag_after(&self.model, n, nf, sm, req, mask, &mut self.fit, &mut self.small);
            visit(f0, mask, f1);
        }
    }
}

/// The FGD policy, faithful to the artifact (integer scores; ties are broken at random by `select`).
#[derive(Debug, Clone)]
pub struct Fgd {
    eval: Evaluator,
}

impl Fgd {
    pub fn new(model: FragModel) -> Fgd {
        Fgd {
            eval: Evaluator::new(model),
        }
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
        self.eval
            .for_each_placement(cluster, nodes, req, |i, f0, gpus, f1| {
                let unit = cluster.nodes[i]
                    .gpus
                    .first()
                    .map_or(1000.0, |g| f64::from(g.capacity.max(1)));
                let score = (sigmoid((f0 - f1) / unit) * 100.0).trunc();
                Candidate::keep_best(out, i as u32, score, gpus);
            });
    }
}

impl Policy for Fgd {
    fn name(&self) -> &'static str {
        "FGD"
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
    use super::super::frag::{TypicalMix, TypicalType};
    use super::super::testutil::*;
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
                t(1000, GpuDemand::Shared { amount: 500 }, 0.5),
                t(1000, GpuDemand::Whole { count: 1 }, 0.5),
            ],
            all: Vec::new(),
        }
    }

    #[test]
    fn fgd_fills_the_gpu_that_leaves_no_fragment() {
        // Placing 500 on the 500-free GPU of "b" removes 250 of fragment there;
        // on "a" it would turn an idle GPU into a half-used one.
        let c = cluster(vec![
            node("a", 64_000, &[1000, 1000]),
            node("b", 64_000, &[500, 1000]),
        ]);
        let model = FragModel::new(&mix(), &c.models, false);
        let w = winner(&mut Fgd::new(model), &c, &Request::shared(1000, 0, 500));
        assert_eq!((w.node, w.gpus), (1, GpuMask::single(0)));
    }

    #[test]
    fn fgd_keeps_idle_gpus_for_whole_gpu_tasks() {
        // 300 on "a"'s 400-free GPU leaves 100 (fragment for both types), but leaves the idle GPU alone;
        // the same on "b" breaks b's only idle GPU.
        let c = cluster(vec![
            node("a", 64_000, &[400, 1000]),
            node("b", 64_000, &[1000, 0]),
        ]);
        let model = FragModel::new(&mix(), &c.models, false);
        let mut out = Vec::new();
        Fgd::new(model).score(&c, &Request::shared(1000, 0, 300), &mut rng(), &mut out);
        let a = cand(&out, 0).expect("a");
        let b = cand(&out, 1).expect("b");
        assert_eq!(a.gpus, GpuMask::single(0));
        assert!(a.score > b.score, "{out:?}");
    }

    #[test]
    fn scores_are_artifact_integers() {
        let c = cluster(vec![node("a", 64_000, &[1000, 1000])]);
        let model = FragModel::new(&mix(), &c.models, false);
        let mut out = Vec::new();
        Fgd::new(model).score(&c, &Request::whole(1000, 0, 1), &mut rng(), &mut out);
        // Taking one idle GPU of two: frag 0 -> 0 (one idle GPU left hosts both types): sigmoid(0) = 50.
        assert_eq!(out[0].score, 50.0);
    }
}
