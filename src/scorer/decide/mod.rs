//! The decisions, pure: which nodes can host a pod (and why not), how good each one is, and which
//! GPU(s) the pod gets there. The ranking runs the shared placement policy ([`crate::alloc`], the code
//! `gpumem simulate` measures) on the cluster as these nodes show it, then blends in the workload class
//! and, for multi-GPU pods, the topology of the chosen set.
//!
//! - `fit`: which nodes can host the pod, and why not;
//! - `topology`: the best GPU set for a multi-GPU pod's topology need;
//! - `view`: the policy's view of the cluster, kept between calls;
//! - `rank`: the policy's scores over that view, blended with class and topology;
//! - `gauges`: fragmentation and allocation, for the metrics.

mod fit;
mod gauges;
mod rank;
mod topology;
mod view;

pub use super::state::{MAX_REASON_BYTES, bounded_reason};
pub use super::workload::{request, request_of};
pub use fit::{Fit, Rejection, check};
pub use gauges::{Fragmentation, fragmentation};
pub use rank::{Scored, prioritize};
pub use topology::{NVLINK_SEARCH_STEPS, pair_scores};
pub use view::PolicyCache;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::config::ScorerConfig;
    use super::super::state::{
        Demand, GpuSnapshot, MAX_REASON_BYTES, NodeSnapshot, PodDemand, TopologyNeed, WorkloadClass,
        bounded_reason,
    };
    use super::super::workload::CurrentMix;
    use super::fit::*;
    use super::rank::*;
    use super::topology::*;
    use super::view::*;
    use crate::alloc::{self, GpuDemand, GpuMask, TypicalMix};

    fn gpu(i: usize, memory: u64, free: u64) -> GpuSnapshot {
        GpuSnapshot {
            numa_node: Some((i / 4) as u32),
            pcie_switch: Some((i / 2) as u32),
            ..GpuSnapshot::for_tests(i, "NVIDIA A100-SXM4-80GB", memory, memory - free)
        }
    }

    fn node(name: &str, gpus: Vec<GpuSnapshot>) -> NodeSnapshot {
        let mut node = NodeSnapshot::with_gpus(name, 1, gpus);
        (node.cpu_milli, node.memory_mib) = (64_000, 512_000);
        node
    }

    fn pod(demand: Demand, class: WorkloadClass) -> PodDemand {
        PodDemand {
            key: "ns/p".into(),
            uid: "u".into(),
            demand,
            models: None,
            selection: None,
            topology: TopologyNeed::Any,
            class,
            cpu_milli: 1000,
            memory_mib: 1024,
        }
    }

    #[test]
    fn the_node_summary_answers_as_the_gpus_do() {
        // `check` reads a node's summary, not its GPUs: its answers must be what the GPUs say, also
        // after they change in place.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..300 {
            let gpus = (0..1 + next(8) as usize)
                .map(|i| {
                    let memory = [16384, 81920][next(2) as usize];
                    let mut g = gpu(i, memory, [0, 4096, 16384, memory][next(4) as usize].min(memory));
                    g.whole = next(5) == 0;
                    g.healthy = next(4) != 0;
                    g
                })
                .collect();
            let mut n = node("n", gpus);
            for change in 0..2 {
                if change == 1 {
                    let mut gpus = n.gpus_mut();
                    let p = next(gpus.len() as u64) as usize;
                    gpus[p].allocated_mib = 0;
                    gpus[p].whole = !gpus[p].whole;
                    gpus[p].healthy = !gpus[p].healthy;
                }
                let healthy = || n.gpus().iter().filter(|g| g.healthy);
                let eligible = (0..n.gpus().len())
                    .filter(|&p| n.gpus()[p].healthy)
                    .fold(GpuMask::EMPTY, GpuMask::with);
                let need = 1 + next(20000);
                let fits = check(&n, &pod(Demand::Memory { units: need }, WorkloadClass::Online));
                let room = healthy().map(|g| g.free_mib()).max().unwrap_or(0);
                assert_eq!(
                    fits.as_ref().ok().map(|f| f.eligible),
                    (room >= need).then_some(eligible)
                );
                if let Err(r) = fits {
                    assert!(r.reason.starts_with(&format!("largest free GPU has {room} MiB")) || room == 0);
                }
                let idle = healthy().filter(|g| g.is_idle()).count() as u32;
                for count in [1, 2] {
                    let fits = check(&n, &pod(Demand::Whole { count }, WorkloadClass::Online));
                    assert_eq!(fits.is_ok(), idle >= count, "{count} of {:?}", n.gpus());
                }
                assert_eq!(
                    (n.summary().allocated_mib, n.summary().total_mib),
                    n.gpus().iter().fold((0, 0), |(a, t), g| (
                        a + g.memory_mib - g.free_mib(),
                        t + g.memory_mib
                    ))
                );
            }
        }
    }

    #[test]
    fn per_gpu_fit_not_node_sum() {
        let halves = node("a", vec![gpu(0, 16384, 4096), gpu(1, 16384, 4096)]);
        let p = pod(Demand::Memory { units: 5000 }, WorkloadClass::Offline);
        let r = check(&halves, &p).expect_err("4096 + 4096 never holds 5000");
        assert_eq!(r.reason, "largest free GPU has 4096 MiB, pod needs 5000 MiB");
        assert!(!r.unresolvable);
        let one = node("b", vec![gpu(0, 16384, 6000)]);
        assert_eq!(check(&one, &p).map(|f| f.need_mib), Ok(5000));
    }

    #[test]
    fn reasons_are_cut_at_a_character_boundary() {
        let short = "largest free GPU has 4096 MiB".to_string();
        assert_eq!(bounded_reason(short.clone()), short);
        let long = "é".repeat(MAX_REASON_BYTES);
        let cut = bounded_reason(long);
        assert!(cut.len() <= MAX_REASON_BYTES && cut.ends_with("é..."), "{cut}");
        let models = format!("no GPU of an allowed type: pod allows {}", "x,".repeat(10_000));
        let rejection = Rejection::new(models, "gpu_type", true);
        assert_eq!(rejection.reason.len(), MAX_REASON_BYTES);
    }

    #[test]
    fn topology_needs_pick_qualifying_sets() {
        // 4 idle GPUs: 0,1 on switch 0 / NUMA 0, 2,3 on switch 1 / NUMA 0; 4 is on NUMA 1.
        let mut gpus: Vec<GpuSnapshot> = (0..5).map(|i| gpu(i, 16384, 16384)).collect();
        gpus[4].numa_node = Some(1);
        gpus[4].pcie_switch = Some(9);
        gpus[2].nvlink = vec![(4, 2)];
        gpus[4].nvlink = vec![(2, 2)];
        let n = node("a", gpus);
        let mut p = pod(Demand::Whole { count: 2 }, WorkloadClass::Offline);
        p.topology = TopologyNeed::NvLink;
        assert_eq!(check(&n, &p).expect("fits").set.map(|s| s.0), Some(vec![2, 4]));
        p.topology = TopologyNeed::PcieSwitch;
        assert_eq!(check(&n, &p).expect("fits").set.map(|s| s.0), Some(vec![0, 1]));
        p.demand = Demand::Whole { count: 3 };
        assert!(check(&n, &p).is_err_and(|r| r.category == "topology"));
        p.topology = TopologyNeed::Numa;
        assert_eq!(check(&n, &p).expect("fits").set.map(|s| s.0.len()), Some(3));
    }

    /// The `n`-subsets of `items`, in lexicographic order.
    fn subsets(items: &[usize], n: usize) -> Vec<Vec<usize>> {
        if n == 0 {
            return vec![Vec::new()];
        }
        (0..items.len())
            .flat_map(|i| {
                subsets(&items[i + 1..], n - 1).into_iter().map(move |mut rest| {
                    rest.insert(0, items[i]);
                    rest
                })
            })
            .collect()
    }

    #[test]
    fn nvlink_sets_on_up_to_8_gpus_are_the_best_of_all_sets() {
        // Random NVLink wiring (one-sided links too), idle GPUs and set sizes: the bounded search
        // answers what looking at every set answers, the first of equals winning.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut found = 0;
        for _ in 0..400 {
            let count = 2 + next(7) as usize;
            let mut gpus: Vec<GpuSnapshot> = (0..count).map(|i| gpu(i, 81920, 81920)).collect();
            for (a, g) in gpus.iter_mut().enumerate() {
                g.whole = next(5) == 0;
                g.nvlink = Vec::new();
                for b in (0..count).filter(|&b| b != a) {
                    if next(3) != 0 {
                        g.nvlink.push((b, 1 + next(3) as u32));
                    }
                }
            }
            let n = node("n", gpus);
            let links = nvlink_table(&n);
            for a in 0..count {
                for b in 0..count {
                    assert_eq!(links[a * count + b], n.gpus()[a].nvlinks_to(b));
                }
            }
            let idle: Vec<usize> = (0..count).filter(|&p| n.gpus()[p].is_idle()).collect();
            let size = 2 + next(count as u64 - 1) as usize;
            let scores = pair_scores(&n);
            let mut best: Option<(Vec<usize>, u64)> = None;
            for set in subsets(&idle, size) {
                let linked = set
                    .iter()
                    .enumerate()
                    .all(|(i, &a)| set[i + 1..].iter().all(|&b| n.gpus()[a].nvlinks_to(b) > 0));
                let score = set_score(&scores, &set);
                if linked && best.as_ref().is_none_or(|(_, b)| score > *b) {
                    best = Some((set, score));
                }
            }
            found += usize::from(best.is_some());
            assert_eq!(nvlink_clique(&n, &scores, &idle, size), best, "{:?}", n.gpus());
        }
        assert!(found > 100, "only {found} of 400 nodes had a set");
    }

    #[test]
    fn the_largest_node_and_pod_get_a_set_within_the_search_bounds() {
        // 64 GPUs (node::MAX_GPUS), every pair NVLinked: 32 of them all linked, or any 61.
        let gpus: Vec<GpuSnapshot> = (0..64)
            .map(|i| GpuSnapshot {
                nvlink: (0..64).filter(|&p| p != i).map(|p| (p, 18)).collect(),
                ..gpu(i, 81920, 81920)
            })
            .collect();
        let n = node("big", gpus);
        let mut p = pod(Demand::Whole { count: 32 }, WorkloadClass::Offline);
        p.topology = TopologyNeed::NvLink;
        let (set, score) = check(&n, &p).expect("fits").set.expect("a set");
        assert_eq!(set.len(), 32);
        assert_eq!(score, set_score(&pair_scores(&n), &set));
        p.demand = Demand::Whole { count: 61 };
        p.topology = TopologyNeed::Any;
        let (set, _) = check(&n, &p).expect("fits").set.expect("a set");
        assert_eq!(set.len(), 61);
        assert!(set.windows(2).all(|w| w[0] < w[1]), "{set:?}");
    }

    #[test]
    fn the_kept_policy_view_answers_as_a_fresh_one() {
        let cfg = ScorerConfig::default();
        let kept = PolicyCache::default();
        // Shared states, changed as the node cache changes them: a new state for a new version.
        let mut nodes: Vec<Arc<NodeSnapshot>> = (0..7)
            .map(|i| {
                let gpus = (0..4)
                    .map(|g| gpu(g, 16384, [16384, 9000, 6000, 12000][(i + g) % 4]))
                    .collect();
                Arc::new(node(&format!("n{i}"), gpus))
            })
            .collect();
        // Answers by node name, whatever the order of the call.
        // The configured mix, then (from round 8) a learned one: a new generation rebuilds the policies.
        let configured = CurrentMix::fixed(cfg.prior_mix());
        // What a cluster of 9000 MiB jobs would teach it.
        let nine = alloc::frag::TypicalType {
            cpu_milli: 0,
            memory_mib: 0,
            gpu: GpuDemand::Shared { amount: 9000 },
            models: None,
            popularity: 1.0,
        };
        let learned = TypicalMix {
            types: vec![nine],
            all: vec![nine],
        };
        let learned = CurrentMix {
            mix: Arc::new(learned),
            generation: 1,
        };
        let run = |nodes: &[Arc<NodeSnapshot>],
                   order: &[usize],
                   p: &PodDemand,
                   cache: &PolicyCache,
                   mix: &CurrentMix| {
            let refs: Vec<Arc<NodeSnapshot>> = order.iter().map(|&i| nodes[i].clone()).collect();
            let mut answers: Vec<(String, Option<Scored>)> = refs
                .iter()
                .map(|n| n.name.clone())
                .zip(prioritize(&refs, p, &cfg, cache, mix))
                .collect();
            answers.sort_by(|a, b| a.0.cmp(&b.0));
            answers
        };
        let all: Vec<usize> = (0..7).collect();
        // Six amounts, more than the policies kept: some repeat, some take over another's policy.
        let sizes = [5000, 3000, 5000, 1000, 7000, 2000, 9000, 5000];
        for round in 0..16 {
            // Another order each call, as kube-scheduler sends them.
            let order: Vec<usize> = (0..7).map(|k| (k * 3 + round) % 7).collect();
            let p = pod(
                Demand::Memory {
                    units: sizes[round % 8],
                },
                WorkloadClass::Offline,
            );
            let fresh = PolicyCache::default();
            let mix = if round < 8 { &configured } else { &learned };
            if round == 8 {
                // The two mixes rank differently: a kept policy of the old mix would be caught.
                assert_ne!(
                    run(&nodes, &all, &p, &PolicyCache::default(), &configured),
                    run(&nodes, &all, &p, &PolicyCache::default(), &learned)
                );
            }
            assert_eq!(
                run(&nodes, &order, &p, &kept, mix),
                run(&nodes, &all, &p, &fresh, mix),
                "round {round}"
            );
            // A subset (kube-scheduler's sampling) is scored in the view of the whole cluster seen.
            let subset = &order[..4];
            assert_eq!(
                run(&nodes, subset, &p, &kept, mix),
                run(&nodes, subset, &p, &fresh, mix),
                "round {round}"
            );
            // Usage changes (the view is updated in place).
            match round % 4 {
                0 => Arc::make_mut(&mut nodes[round % 7]).gpus_mut()[1].allocated_mib = 16000 - round as u64,
                1 => Arc::make_mut(&mut nodes[4]).gpus_mut()[0].allocated_mib = round as u64 * 100,
                // Twice a shape change (a GPU's capacity): the policies are built again.
                2 if round % 8 == 2 => {
                    Arc::make_mut(&mut nodes[4]).gpus_mut()[0].memory_mib = 81920 + round as u64
                }
                2 => Arc::make_mut(&mut nodes[5]).gpus_mut()[3].allocated_mib = 1000 * round as u64,
                _ => Arc::make_mut(&mut nodes[round % 7]).gpus_mut()[2].allocated_mib = 0,
            }
        }
        let view = kept.view.lock().expect("lock");
        assert_eq!(
            view.cluster.nodes.len(),
            7,
            "one position per node, whatever the order"
        );
        assert!(view.policies.len() <= MAX_POLICIES);
    }

    #[test]
    fn offline_packs_and_online_spreads() {
        let cfg = ScorerConfig::default();
        let a = node("tight", vec![gpu(0, 16384, 6000)]);
        let b = node("roomy", vec![gpu(0, 16384, 16384)]);
        let nodes = [Arc::new(a), Arc::new(b)];
        for (class, winner) in [(WorkloadClass::Offline, 0), (WorkloadClass::Online, 1)] {
            let p = pod(Demand::Memory { units: 5000 }, class);
            let mix = CurrentMix::fixed(cfg.prior_mix());
            let scored = prioritize(&nodes, &p, &cfg, &PolicyCache::default(), &mix);
            let best = (0..2).max_by(|&x, &y| {
                let raw = |i: usize| scored[i].as_ref().expect("both fit").raw;
                raw(x).total_cmp(&raw(y))
            });
            assert_eq!(best, Some(winner), "{class:?}: {scored:?}");
        }
    }

    /// Pods that must run on one model (a DRA selector, `gpumem.io/gpu-types`) are learned with it, so
    /// that the policy's scarcity term has a pressure on that model: without the models in the mix
    /// the term never acted in the scorer.
    #[test]
    fn a_node_of_two_models_keeps_its_view_whatever_model_the_pod_asks() {
        // Two V100s and two T4s: a pod that may use only the T4s, then one that may use any GPU.
        let mut gpus: Vec<GpuSnapshot> = (0..4).map(|g| gpu(g, 16384, 16384)).collect();
        for g in &mut gpus[..2] {
            g.model = "Tesla V100".into();
        }
        for g in &mut gpus[2..] {
            g.model = "Tesla T4".into();
        }
        let nodes = vec![Arc::new(node("mixed", gpus))];
        let cfg = ScorerConfig::default();
        let cache = PolicyCache::default();
        let mix = CurrentMix::fixed(cfg.prior_mix());
        let any = pod(Demand::Memory { units: 4000 }, WorkloadClass::Offline);
        let t4 = PodDemand {
            models: Some(vec!["tesla t4".into()]),
            ..any.clone()
        };
        let scored = prioritize(&nodes, &t4, &cfg, &cache, &mix);
        let on = scored[0].as_ref().map(|s| s.gpus.iter().collect::<Vec<_>>());
        assert!(matches!(on.as_deref(), Some([2] | [3])), "a T4: {on:?}");
        let shape = |cache: &PolicyCache| cache.view.lock().map(|v| v.shape).unwrap_or(0);
        let (after_t4, view_node) = {
            let v = cache.view.lock().expect("view");
            (v.shape, v.cluster.nodes[0].clone())
        };
        assert_eq!(view_node.gpu_models.len(), 4, "each GPU's model");
        assert_eq!(
            view_node.gpu_model(0),
            view_node.model,
            "the node's model is its first GPU's"
        );
        assert_ne!(view_node.gpu_model(2), view_node.model);
        prioritize(&nodes, &any, &cfg, &cache, &mix);
        prioritize(&nodes, &t4, &cfg, &cache, &mix);
        assert_eq!(
            shape(&cache),
            after_t4,
            "pods asking different models do not reshape the view"
        );
    }

    #[test]
    fn a_model_that_restricted_pods_depend_on_is_learned_with_them() {
        let cfg = ScorerConfig::default();
        let t4 = |i| GpuSnapshot::for_tests(i, "Tesla T4", 15360, 0);
        let a100 = |i| GpuSnapshot::for_tests(i, "NVIDIA A100-SXM4-80GB", 81920, 0);
        let nodes = [
            Arc::new(node("t4", (0..4).map(t4).collect())),
            Arc::new(node("a100", (0..4).map(a100).collect())),
        ];
        let cache = PolicyCache::default();
        let anywhere = pod(Demand::Memory { units: 4000 }, WorkloadClass::Offline);
        prioritize(
            &nodes,
            &anywhere,
            &cfg,
            &cache,
            &CurrentMix::fixed(cfg.prior_mix()),
        );
        // The view interned the models in the order it met them.
        let set = cache.model_set(|m| m == "Tesla T4");
        assert_eq!(set, Some(alloc::ModelSet::NONE.with(0)));
        assert_eq!(cache.model_set(|_| true), None, "every model: no restriction");
        assert_eq!(
            cache.model_set(|_| false),
            None,
            "no model known: nothing to learn"
        );
        let mut models = alloc::ModelTable::default();
        let ids = [models.intern("Tesla T4").unwrap(), models.intern("A100").unwrap()];
        let cluster = alloc::Cluster::new(
            models,
            ids.iter()
                .zip([15360, 81920])
                .map(|(&m, mib)| alloc::Node::new("n", m, 64_000, 512_000, vec![alloc::Gpu::new(mib); 4]))
                .collect(),
        );
        let t4_pressure = |t4_models: Option<alloc::ModelSet>| {
            let workload = super::super::workload::Workload::new(&cfg);
            for i in 0..400 {
                let mut p = pod(Demand::Memory { units: 6000 }, WorkloadClass::Offline);
                p.uid = format!("p{i}");
                workload.observe(&p, 6000, if i % 2 == 0 { t4_models } else { None });
            }
            let mix = workload.current().mix;
            assert_eq!(mix.all.iter().any(|t| t.models.is_some()), t4_models.is_some());
            alloc::gpumem::pressure(&mix, &cluster)[0]
        };
        assert_eq!(t4_pressure(None), 0.0, "no pod needs a T4");
        let pressed = t4_pressure(set);
        // Half the demand needs the T4s, a sixth of the capacity: pressure 0.5 / (1/6) = 3.
        assert!((pressed - 3.0).abs() < 0.3, "{pressed}");
    }
}
