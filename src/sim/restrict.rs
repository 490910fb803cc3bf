//! GPU-model-restricted variants of a trace (`gpumem simulate --restrict F`): a policy tuned on the four
//! shared traces must also hold where more (or less) of the demand names its GPU model.
//!
//! The variant is drawn once per trace, from its own seed, before the per-seed shuffles: GPU pods
//! without a `gpu_spec` are picked at random until `F` of all GPU pods carry one, and each picked pod
//! gets a model set drawn from a source of real restrictions (by default the `gpu_spec` column of
//! openb's `gpuspec20` trace, as often as each set occurs there). A drawn set that no node could host
//! the pod on (CPU, memory, GPU count, model) is drawn again, so the variant asks for nothing the
//! cluster cannot give; a pod with no such set in a few draws stays unrestricted.

use std::path::Path;

use anyhow::{Result, bail};
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg64Mcg;

use crate::alloc::{Cluster, GpuDemand, ModelSet, Request};

use super::trace::{Trace, load_pods};

/// Draws of a model set per pod before the pod is left unrestricted.
const DRAWS: usize = 16;

/// The restricted model sets of `path`'s pods, one per restricted pod (so sets occur as often as in the
/// source), resolved against `cluster`'s models (names it does not have are dropped).
pub fn source_sets(path: &Path, cluster: &Cluster) -> Result<Vec<ModelSet>> {
    let sets: Vec<ModelSet> = load_pods(path, &cluster.models)?
        .into_iter()
        .filter_map(|p| p.models)
        .filter(|m| *m != ModelSet::NONE)
        .collect();
    if sets.is_empty() {
        bail!("{}: no pod names a GPU model (gpu_spec)", path.display());
    }
    Ok(sets)
}

/// Whether some node of `cluster`, empty, could host `req`.
fn hostable(cluster: &Cluster, req: &Request) -> bool {
    cluster.nodes.iter().any(|n| {
        n.cpu_capacity >= req.cpu_milli
            && n.memory_capacity >= req.memory_mib
            && n.gpus.len() as u32 >= req.gpu.gpus_needed()
            && req.models.is_none_or(|m| m.contains(n.model))
    })
}

/// `trace` with `fraction` of its GPU pods restricted to a GPU model (see the module comment); the
/// pods already restricted count towards it. Deterministic in (`trace`, `fraction`, `sets`, `seed`).
pub fn restrict(trace: &Trace, fraction: f64, sets: &[ModelSet], seed: u64) -> Result<Trace> {
    if !(0.0..=1.0).contains(&fraction) {
        bail!("--restrict must be a fraction in 0..1, got {fraction}");
    }
    if sets.is_empty() {
        bail!("no model sets to restrict pods to");
    }
    let gpu_pods = trace.pods.iter().filter(|p| p.gpu != GpuDemand::None).count();
    let already = trace
        .pods
        .iter()
        .filter(|p| p.gpu != GpuDemand::None && p.models.is_some())
        .count();
    let target = (fraction * gpu_pods as f64).round() as usize;
    let mut rng = Pcg64Mcg::seed_from_u64(seed ^ 0x7265_7374_7269_6374);
    let mut free: Vec<usize> = (0..trace.pods.len())
        .filter(|&i| trace.pods[i].gpu != GpuDemand::None && trace.pods[i].models.is_none())
        .collect();
    free.shuffle(&mut rng);
    let mut out = trace.clone();
    let mut restricted = already;
    for i in free {
        if restricted >= target {
            break;
        }
        let pod = out.pods[i];
        let drawn = (0..DRAWS)
            .map(|_| pod.with_models(sets[rng.random_range(0..sets.len())]))
            .find(|r| hostable(&out.cluster, r));
        if let Some(r) = drawn {
            out.pods[i] = r;
            restricted += 1;
        }
    }
    out.name = format!("{}+r{}", trace.name, (fraction * 100.0).round());
    tracing::info!(
        trace = %out.name,
        restricted,
        gpu_pods,
        "restricted variant"
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::testutil::{cluster, node};

    fn trace(pods: Vec<Request>) -> Trace {
        let mut c = cluster(vec![node("a", 8000, &[1000, 1000]), node("b", 8000, &[1000])]);
        let t4 = c.models.intern("T4").expect("model");
        c.nodes[1].model = t4;
        Trace {
            name: "t".into(),
            cluster: c,
            pods,
        }
    }

    fn share() -> Request {
        Request::shared(1000, 0, 500)
    }

    #[test]
    fn restricts_the_asked_fraction_of_gpu_pods_and_leaves_cpu_pods_alone() {
        let mut pods = vec![share(); 100];
        pods.extend(vec![Request::cpu_only(100, 0); 50]);
        let t = trace(pods);
        let t4 = t.cluster.models.set_of(["T4"]);
        let r = restrict(&t, 0.33, &[t4], 1).expect("variant");
        let restricted = r.pods.iter().filter(|p| p.models == Some(t4)).count();
        assert_eq!(restricted, 33);
        assert!(r.pods[100..].iter().all(|p| p.models.is_none()));
        assert_eq!(r.name, "t+r33");
        assert_eq!(r.pods, restrict(&t, 0.33, &[t4], 1).expect("variant").pods);
        assert_ne!(r.pods, restrict(&t, 0.33, &[t4], 2).expect("variant").pods);
    }

    #[test]
    fn never_asks_for_a_model_no_node_could_host_the_pod_on() {
        // Two whole GPUs: only node a (model 0) has two; a T4 set cannot host it.
        let t = trace(vec![Request::whole(1000, 0, 2); 10]);
        let t4 = t.cluster.models.set_of(["T4"]);
        let r = restrict(&t, 0.5, &[t4], 1).expect("variant");
        assert!(r.pods.iter().all(|p| p.models.is_none()));
    }

    #[test]
    fn refuses_a_fraction_outside_0_to_1() {
        let t = trace(vec![share()]);
        let t4 = t.cluster.models.set_of(["T4"]);
        assert!(restrict(&t, 1.5, &[t4], 1).is_err());
        assert!(restrict(&t, f64::NAN, &[t4], 1).is_err());
    }
}
