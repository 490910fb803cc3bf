//! The FGD paper's baseline policies, as its artifact (hkust-adsl/kubernetes-scheduler-simulator)
//! defines them: integer node scores 0..=100 (kube-scheduler's framework), ties broken at random by
//! [`super::select`], and the GPU on the chosen node picked by best fit (Random: at random).

use rand::{Rng, RngExt};

use super::{Candidate, Cluster, GpuDemand, GpuMask, Node, Policy, Request};

const MAX_SCORE: f64 = 100.0;

/// The largest node of the cluster, used to normalise resource vectors (the artifact hard-codes
/// 128 cores and 8 GPUs, which is what the Alibaba cluster's largest node has).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaxSpec {
    pub cpu_milli: f64,
    pub gpu_units: f64,
}

impl MaxSpec {
    pub fn of(cluster: &Cluster) -> MaxSpec {
        let cpu = cluster
            .nodes
            .iter()
            .map(|n| n.cpu_capacity)
            .max()
            .unwrap_or(1)
            .max(1);
        let gpu = cluster
            .nodes
            .iter()
            .map(Node::gpu_capacity_total)
            .max()
            .unwrap_or(1)
            .max(1);
        MaxSpec {
            cpu_milli: cpu as f64,
            gpu_units: gpu as f64,
        }
    }
}

fn push_best_fit(out: &mut Vec<Candidate>, i: usize, node: &Node, req: &Request, score: f64) {
    if let Some(gpus) = node.best_fit_choice(req) {
        out.push(Candidate {
            node: i as u32,
            score,
            gpus,
        });
    }
}

/// Total units a request takes on `node` (whole GPUs count their capacity).
fn units_on(node: &Node, req: &Request) -> u64 {
    let cap = node.gpus.first().map_or(0, |g| g.capacity);
    req.gpu.units(cap)
}

/// Random: a uniformly random feasible node, and a random fitting GPU on it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "Random"
    }

    fn score(&mut self, cluster: &Cluster, req: &Request, rng: &mut dyn Rng, out: &mut Vec<Candidate>) {
        out.clear();
        for (i, n) in cluster.nodes.iter().enumerate() {
            if !n.fits(req) {
                continue;
            }
            let gpus = match req.gpu {
                GpuDemand::None => GpuMask::EMPTY,
                GpuDemand::Whole { .. } => n.first_idle(req).unwrap_or_default(),
                GpuDemand::Shared { amount } => {
                    let mut pick = 0;
                    let mut seen = 0u32;
                    for g in n.allowed(req).iter() {
                        if n.gpus[g].free >= amount {
                            seen += 1;
                            if rng.random_range(0..seen) == 0 {
                                pick = g;
                            }
                        }
                    }
                    GpuMask::single(pick)
                }
            };
            // A continuous random score makes the winner uniform over feasible nodes.
            out.push(Candidate {
                node: i as u32,
                score: rng.random::<f64>(),
                gpus,
            });
        }
    }
}

/// DotProduct (Tetris): prefer the node whose free (cpu, gpu) vector is least aligned with the request.
#[derive(Debug, Clone, Copy)]
pub struct DotProduct {
    spec: MaxSpec,
}

impl DotProduct {
    pub fn new(spec: MaxSpec) -> DotProduct {
        DotProduct { spec }
    }
}

impl Policy for DotProduct {
    fn name(&self) -> &'static str {
        "DotProduct"
    }

    fn score(&mut self, cluster: &Cluster, req: &Request, _rng: &mut dyn Rng, out: &mut Vec<Candidate>) {
        out.clear();
        let s = self.spec;
        for (i, n) in cluster.nodes.iter().enumerate() {
            if !n.fits(req) {
                continue;
            }
            let dot = (n.cpu_free as f64 / s.cpu_milli) * (req.cpu_milli as f64 / s.cpu_milli)
                + (n.gpu_free_total() as f64 / s.gpu_units) * (units_on(n, req) as f64 / s.gpu_units);
            let score = (MAX_SCORE * (1.0 - dot / 2.0)).trunc();
            push_best_fit(out, i, n, req, score);
        }
    }
}

/// GpuClustering: put GPU tasks with tasks of the same kind (shared, k whole GPUs), fuller nodes first.
#[derive(Debug, Clone, Copy)]
pub struct GpuClustering {
    spec: MaxSpec,
}

impl GpuClustering {
    pub fn new(spec: MaxSpec) -> GpuClustering {
        GpuClustering { spec }
    }
}

impl Policy for GpuClustering {
    fn name(&self) -> &'static str {
        "GpuClustering"
    }

    fn score(&mut self, cluster: &Cluster, req: &Request, _rng: &mut dyn Rng, out: &mut Vec<Candidate>) {
        out.clear();
        let max_gpu = self.spec.gpu_units as i64;
        for (i, n) in cluster.nodes.iter().enumerate() {
            if !n.fits(req) {
                continue;
            }
            let score = match req.workload_tag() {
                None => 0,
                Some(tag) => {
                    // Integer arithmetic as in the artifact: 25 * used / max + band.
                    let fill = 25 * (max_gpu - n.gpu_free_total() as i64) / max_gpu;
                    let band = if n.tag_count(tag) > 0 {
                        if n.tags.len() == 1 { 75 } else { 50 }
                    } else if n.tags.is_empty() {
                        25
                    } else {
                        0
                    };
                    fill + band
                }
            };
            push_best_fit(out, i, n, req, score as f64);
        }
    }
}

/// GpuPacking: shared GPUs first, then idle GPUs on used nodes, then idle nodes.
#[derive(Debug, Clone, Copy, Default)]
pub struct GpuPacking;

fn packing_score(n: &Node, req: &Request) -> i64 {
    let idle = n.idle_gpus() as i64;
    if req.gpu == GpuDemand::None {
        return 0;
    }
    if idle == n.gpus.len() as i64 {
        return (33 - idle).max(idle);
    }
    // Walk GPUs from the fullest, as the artifact does, taking those that fit.
    let mut order: Vec<usize> = n.allowed(req).iter().collect();
    order.sort_by_key(|&g| n.gpus[g].free);
    let mut need = req.gpu.gpus_needed();
    let mut idle_used = 0i64;
    let mut free_ratio = 0i64;
    for g in order {
        if need == 0 {
            break;
        }
        let gpu = n.gpus[g];
        if req.gpu.fits_gpu(gpu.capacity, gpu.free) {
            need -= 1;
            if gpu.is_idle() {
                idle_used += 1;
            }
            free_ratio += i64::from(gpu.free) * 100 / i64::from(gpu.capacity.max(1));
        }
    }
    if idle_used > 0 {
        (50 - idle_used).max(33)
    } else {
        (100 - free_ratio / 10).max(50)
    }
}

impl Policy for GpuPacking {
    fn name(&self) -> &'static str {
        "GpuPacking"
    }

    fn score(&mut self, cluster: &Cluster, req: &Request, _rng: &mut dyn Rng, out: &mut Vec<Candidate>) {
        out.clear();
        for (i, n) in cluster.nodes.iter().enumerate() {
            if n.fits(req) {
                push_best_fit(out, i, n, req, packing_score(n, req) as f64);
            }
        }
    }
}

/// BestFit: the node with the least (cpu, gpu) left over after placement, equally weighted.
#[derive(Debug, Clone, Copy)]
pub struct BestFit {
    spec: MaxSpec,
}

impl BestFit {
    pub fn new(spec: MaxSpec) -> BestFit {
        BestFit { spec }
    }
}

impl Policy for BestFit {
    fn name(&self) -> &'static str {
        "BestFit"
    }

    fn score(&mut self, cluster: &Cluster, req: &Request, _rng: &mut dyn Rng, out: &mut Vec<Candidate>) {
        out.clear();
        let s = self.spec;
        for (i, n) in cluster.nodes.iter().enumerate() {
            if !n.fits(req) {
                continue;
            }
            let left_cpu = (n.cpu_free - req.cpu_milli) as f64 / s.cpu_milli;
            let left_gpu = (n.gpu_free_total() - units_on(n, req)) as f64 / s.gpu_units;
            let score = ((1.0 - 0.5 * left_cpu - 0.5 * left_gpu) * MAX_SCORE).trunc();
            push_best_fit(out, i, n, req, score);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::{Gpu, ModelSet, TieBreak, select};
    use super::*;

    #[test]
    fn random_is_uniform_over_feasible_nodes_only() {
        let c = cluster(vec![
            node("a", 64_000, &[1000]),
            node("b", 64_000, &[100]),
            node("c", 64_000, &[900]),
        ]);
        let req = Request::shared(1000, 0, 500);
        let mut r = rng();
        let mut out = Vec::new();
        let mut hits = [0u32; 3];
        for _ in 0..2000 {
            Random.score(&c, &req, &mut r, &mut out);
            hits[select(&out, TieBreak::Random, &mut r).expect("feasible").node as usize] += 1;
        }
        assert_eq!(hits[1], 0, "node b cannot host 500");
        assert!(hits[0] > 850 && hits[2] > 850, "{hits:?}");
    }

    #[test]
    fn best_fit_takes_the_tightest_node_and_gpu() {
        let c = cluster(vec![
            node("idle", 64_000, &[1000, 1000]),
            node("tight", 64_000, &[1000, 350]),
            node("too-small", 64_000, &[200, 0]),
        ]);
        let spec = MaxSpec::of(&c);
        let w = winner(&mut BestFit::new(spec), &c, &Request::shared(4000, 0, 300));
        assert_eq!(
            (w.node, w.gpus),
            (1, GpuMask::single(1)),
            "GPU 1 (350 free) is the tightest fit"
        );
    }

    #[test]
    fn dot_product_prefers_the_node_least_aligned_with_the_request() {
        // GPU-heavy request: the node with lots of CPU left but little GPU wins.
        let c = cluster(vec![
            node("gpu-rich", 4000, &[1000, 1000]),
            node("cpu-rich", 64_000, &[600, 0]),
        ]);
        let w = winner(
            &mut DotProduct::new(MaxSpec::of(&c)),
            &c,
            &Request::shared(1000, 0, 500),
        );
        assert_eq!(w.node, 1);
    }

    #[test]
    fn gpu_packing_orders_shared_then_used_node_then_idle_node() {
        let c = cluster(vec![
            node("idle", 64_000, &[1000, 1000]),
            node("used", 64_000, &[1000, 0]),
            node("shared", 64_000, &[600, 0]),
        ]);
        let mut p = GpuPacking;
        let w = winner(&mut p, &c, &Request::shared(1000, 0, 500));
        assert_eq!((w.node, w.gpus), (2, GpuMask::single(0)));
        let w = winner(&mut p, &c, &Request::whole(1000, 0, 1));
        assert_eq!(w.node, 1, "a whole GPU goes to the used node, not the idle one");
    }

    #[test]
    fn gpu_clustering_groups_like_with_like() {
        let mut c = cluster(vec![
            node("a", 64_000, &[1000, 1000]),
            node("b", 64_000, &[1000, 1000]),
        ]);
        let shared = Request::shared(1000, 0, 300);
        c.allocate(1, &shared, GpuMask::single(0)).expect("fits");
        let mut p = GpuClustering::new(MaxSpec::of(&c));
        assert_eq!(winner(&mut p, &c, &shared).node, 1, "joins the other shared pod");
        let mut out = Vec::new();
        p.score(&c, &Request::whole(1000, 0, 1), &mut rng(), &mut out);
        assert!(
            cand(&out, 0).expect("a").score > cand(&out, 1).expect("b").score,
            "whole GPU avoids b"
        );
    }

    #[test]
    fn heterogeneous_capacities_and_models() {
        let mut c = cluster(vec![]);
        let a100 = c.models.intern("A100").expect("intern");
        c.nodes
            .push(Node::new("t4", 0, 32_000, 64_000, vec![Gpu::new(15_360); 4]));
        c.nodes
            .push(Node::new("a100", a100, 32_000, 64_000, vec![Gpu::new(81_920); 2]));
        let big = Request::shared(1000, 1000, 20_000);
        let w = winner(&mut BestFit::new(MaxSpec::of(&c)), &c, &big);
        assert_eq!(w.node, 1, "only an A100 has 20000 MiB");
        let t4_only = Request::shared(1000, 1000, 1000).with_models(ModelSet::NONE.with(0));
        let mut out = Vec::new();
        GpuPacking.score(&c, &t4_only, &mut rng(), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].node, 0);
    }
}
