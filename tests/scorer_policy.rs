//! What the scorer runs is what `gpumem simulate` measures. A cluster of mixed nodes and a sequence of
//! pods go through the scorer's real HTTP endpoints (prioritize, then bind to the best node, against a
//! fake API server); beside it the simulator's side: the gpumem policy built by `alloc::build_policy`
//! over the same cluster, from the mix an `OnlineMix` learns from the same pods in the same order. At
//! every pod the scorer's scores are the policy's (scaled to the extender's 0..10) and the GPU it binds
//! is the policy's choice; the scorer's mix moves from `typicalMix` to the learned one on the way.
//!
//! The cluster is the one the scorer sees: nodes' CPU and memory as allocatable (kube-scheduler checks
//! those, the scorer does not count them), GPU memory as the agent's annotations and the scorer's own
//! binds leave it.

mod scorer_support;

use std::sync::Arc;

use gpumem::alloc::{self, Candidate, Cluster, Gpu, ModelTable, OnlineMix, Request};
use gpumem::scorer::Scorer;
use gpumem::scorer::config::ScorerConfig;
use gpumem::scorer::extender::MAX_EXTENDER_PRIORITY;
use gpumem::scorer::workload::mix_config;
use rand::SeedableRng as _;
use serde_json::{Value, json};

use scorer_support::*;

const CPU_MILLI: u64 = 64_000;
const MEMORY_MIB: u64 = 512 * 1024;

/// A node: name, GPU model, per GPU (memory, allocated) in MiB.
type FleetNode = (&'static str, &'static str, Vec<(u64, u64)>);

fn fleet() -> Vec<FleetNode> {
    let a100 = "NVIDIA A100-SXM4-80GB";
    let v100 = "Tesla V100-SXM2-32GB";
    let t4 = "Tesla T4";
    vec![
        (
            "a100-0",
            a100,
            (0..8)
                .map(|i| (81920, [0, 40000, 0, 70000, 0, 0, 20000, 81920][i]))
                .collect(),
        ),
        (
            "a100-1",
            a100,
            (0..8)
                .map(|i| (81920, [60000, 0, 0, 0, 10000, 0, 0, 0][i]))
                .collect(),
        ),
        (
            "v100-0",
            v100,
            (0..4).map(|i| (32768, [0, 16000, 30000, 0][i])).collect(),
        ),
        (
            "t4-0",
            t4,
            (0..4).map(|i| (15360, [0, 4000, 15360, 8000][i])).collect(),
        ),
        ("t4-1", t4, (0..4).map(|i| (15360, [12000, 0, 0, 0][i])).collect()),
    ]
}

fn nodes_json() -> Vec<Value> {
    fleet()
        .into_iter()
        .map(|(name, model, gpus)| {
            let gpus: Vec<G> = gpus
                .iter()
                .map(|&(memory, allocated)| G {
                    model,
                    ..g(memory, allocated)
                })
                .collect();
            node_json(name, &gpus)
        })
        .collect()
}

/// The same cluster in the policy's terms.
fn cluster() -> Cluster {
    let mut models = ModelTable::default();
    let nodes = fleet()
        .into_iter()
        .map(|(name, model, gpus)| {
            let model = models.intern(model).expect("few models");
            let gpus = gpus
                .iter()
                .map(|&(memory, allocated)| Gpu {
                    capacity: memory as u32,
                    free: (memory - allocated) as u32,
                })
                .collect();
            alloc::Node::new(name, model, CPU_MILLI, MEMORY_MIB, gpus)
        })
        .collect();
    Cluster::new(models, nodes)
}

#[tokio::test]
async fn the_scorer_ranks_and_chooses_gpus_as_the_simulators_policy_does() {
    // The policy alone: no spread/pack blend on top of it.
    let cfg = ScorerConfig {
        online_weight: 0.0,
        offline_weight: 0.0,
        hot_online_weight: 0.0,
        ..ScorerConfig::default()
    };
    let nodes = nodes_json();
    let min_pods = mix_config(&cfg).min_pods as usize;
    let count = min_pods + 20;
    let sizes = [1000u64, 2000, 3000, 5000, 8000, 14000];
    let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(7);
    let pods: Vec<(String, u64)> = (0..count)
        .map(|i| {
            let pick = rand::RngExt::random_range(&mut rng, 0..sizes.len() * 3);
            // Mostly small pods, as on the shared-GPU traces.
            (
                format!("p{i}"),
                sizes[pick.min(pick / 2 + pick % 2).min(sizes.len() - 1)],
            )
        })
        .collect();
    let api = Arc::new(FakeApi::default());
    nodes.iter().for_each(|n| api.add_node(n));
    let pod_objects: Vec<Value> = pods
        .iter()
        .map(|(name, mib)| {
            pod_json(
                name,
                *mib,
                0,
                json!({}),
                json!({"gpumem.io/workload-class": "offline"}),
            )
        })
        .collect();
    pod_objects.iter().for_each(|p| api.add_pod(p));
    let client = fake_api(api.clone()).await;
    let (addr, scorer) = start(Scorer::new(cfg.clone(), Some(client), None, None)).await;

    let mut sim = cluster();
    let mut online = OnlineMix::new(mix_config(&cfg), cfg.prior_mix());
    let mut moved_at = None;
    for (k, ((name, mib), object)) in pods.iter().zip(&pod_objects).enumerate() {
        // The simulator's decision: the mix of the pods before this one, a policy built from it.
        online.refresh();
        if moved_at.is_none() && online.generation() > 0 {
            moved_at = Some(k);
        }
        let req = Request::shared(1000, 1024, *mib as u32);
        let mut policy = alloc::build_policy("gpumem", &sim, online.mix()).expect("gpumem");
        let all: Vec<u32> = (0..sim.nodes.len() as u32).collect();
        let mut candidates: Vec<Candidate> = Vec::new();
        let mut seeded = rand_pcg::Pcg64Mcg::seed_from_u64(1);
        policy.score_nodes(&sim, &all, &req, &mut seeded, &mut candidates);
        assert!(!candidates.is_empty(), "pod {k} ({mib} MiB) fits somewhere");
        let (lo, hi) = candidates
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), c| {
                (lo.min(c.score), hi.max(c.score))
            });
        let mut expected: Vec<(String, i64)> = (0..sim.nodes.len())
            .map(|n| {
                let score = candidates.iter().find(|c| c.node as usize == n).map_or(0, |c| {
                    let term = if hi > lo { (c.score - lo) / (hi - lo) } else { 1.0 };
                    (term * MAX_EXTENDER_PRIORITY as f64).round() as i64
                });
                (sim.nodes[n].name.clone(), score)
            })
            .collect();
        let best = candidates
            .iter()
            .max_by(|a, b| a.score.total_cmp(&b.score).then(b.node.cmp(&a.node)))
            .expect("a candidate");
        // The node ranked first (the first of the best) alone keeps the top score: the ones that
        // tie with it score one less, so kube-scheduler binds where the scorer holds the GPU.
        let top = expected[best.node as usize].1;
        for (n, (_, score)) in expected.iter_mut().enumerate() {
            if n != best.node as usize && top > 0 && *score >= top {
                *score = top - 1;
            }
        }

        // The scorer, as kube-scheduler calls it.
        let (status, ranked) = post_json(addr, "/prioritize", &args_nodes(object, &nodes)).await;
        assert_eq!(status, 200, "{ranked}");
        let got: Vec<(String, i64)> = ranked
            .as_array()
            .expect("a HostPriorityList")
            .iter()
            .map(|h| {
                (
                    h["Host"].as_str().expect("Host").to_string(),
                    h["Score"].as_i64().expect("Score"),
                )
            })
            .collect();
        assert_eq!(
            got, expected,
            "pod {k} ({mib} MiB): the scorer ranks as the policy scores"
        );
        let node = &sim.nodes[best.node as usize].name;
        let bind =
            json!({"PodName": name, "PodNamespace": "team-a", "PodUID": format!("uid-{name}"), "Node": node});
        let (_, r) = post_json(addr, "/bind", &bind).await;
        assert_eq!(r["Error"], "", "pod {k}: {r}");
        let assigned = api.pod(&format!("team-a/{name}")).expect("the pod")["metadata"]["annotations"]
            ["gpumem.io/assigned-gpus"]
            .as_str()
            .expect("assigned")
            .to_string();
        let gpu = best.gpus.iter().next().expect("one GPU");
        assert_eq!(
            assigned,
            uuid(node, gpu),
            "pod {k} ({mib} MiB) on {node}: the policy's GPU"
        );

        // Both sides move on: the GPU memory taken (the scorer's CPU view does not change), the pod counted.
        let taken = Request {
            cpu_milli: 0,
            memory_mib: 0,
            ..req
        };
        sim.allocate(best.node as usize, &taken, best.gpus)
            .expect("it fits");
        online.observe(&req);
    }
    let moved_at = moved_at.expect("the learned mix took over");
    assert!(
        moved_at >= min_pods,
        "the configured mix held for the first {min_pods} pods, moved at {moved_at}"
    );
    assert_eq!(scorer.workload.seen(), count as u64);
    assert_eq!(scorer.workload.current().generation, online.generation());
    assert_eq!(*scorer.workload.current().mix, *online.mix());
}

/// A pod that selects its GPU model by the node's labels (`nvidia.com/gpu.product`, as users of the
/// device-plugin path do) is learned as restricted to the models of the nodes it may use, as one with
/// `gpumem.io/gpu-models` is: the policy's scarcity term then keeps room on that model for such pods.
/// A selection that every node's model passes restricts nothing.
#[test]
fn a_pod_that_selects_its_model_by_node_labels_is_learned_restricted_to_it() {
    use gpumem::scorer::cache::NodeCache;
    use gpumem::scorer::state::{Demand, NodeSnapshot};
    let labelled = |name: &str, model: &'static str, product: &str, zone: &str| {
        let gpus: Vec<G> = (0..4)
            .map(|_| G {
                model,
                ..g(if model == "Tesla T4" { 15360 } else { 81920 }, 0)
            })
            .collect();
        let mut v = node_json(name, &gpus);
        v["metadata"]["labels"]["nvidia.com/gpu.product"] = json!(product);
        v["metadata"]["labels"]["topology.kubernetes.io/zone"] = json!(zone);
        serde_json::from_value::<k8s_openapi::api::core::v1::Node>(v).expect("a node")
    };
    let nodes = [
        labelled("t4-0", "Tesla T4", "Tesla-T4", "a"),
        labelled("a100-0", "NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB", "a"),
    ];
    let restricted_types = |spec: Value, annotations: Value| {
        let scorer = Scorer::new(
            ScorerConfig::default(),
            None,
            Some(NodeCache::from_nodes(nodes.clone())),
            None,
        );
        let demand = Demand::Memory { units: 6000 };
        for i in 0..400 {
            let mut pod = pod_json(&format!("p{i}"), 6000, 0, annotations.clone(), json!({}));
            for (k, v) in spec.as_object().into_iter().flatten() {
                pod["spec"][k] = v.clone();
            }
            let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(pod).expect("a pod");
            let d = scorer.demand_of(&pod, demand).expect("a demand");
            if i == 0 {
                // The policy's view learns the cluster's models from a ranking of a pod of any model.
                let all = nodes.each_ref().map(|n| Arc::new(NodeSnapshot::from_node(n)));
                let any = pod_json("any", 6000, 0, json!({}), json!({}));
                let any = serde_json::from_value(any).expect("a pod");
                scorer.rank(&all, &scorer.demand_of(&any, demand).expect("a demand"));
            }
            scorer.learn(&d, 6000);
        }
        let mix = scorer.workload.current().mix;
        mix.all
            .iter()
            .filter(|t| t.models.is_some())
            .map(|t| t.models)
            .collect::<Vec<_>>()
    };
    let by_selector = restricted_types(
        json!({"nodeSelector": {"nvidia.com/gpu.product": "Tesla-T4"}}),
        json!({}),
    );
    assert_eq!(by_selector.len(), 1, "one restricted type: {by_selector:?}");
    let by_affinity = restricted_types(
        json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["Tesla-T4"]}]}]}}}}),
        json!({}),
    );
    let by_annotation = restricted_types(json!({}), json!({"gpumem.io/gpu-models": "Tesla T4"}));
    assert_eq!(
        by_selector, by_annotation,
        "a node selector restricts as the annotation does"
    );
    assert_eq!(by_affinity, by_annotation, "so does a required affinity");
    assert!(
        restricted_types(
            json!({"nodeSelector": {"topology.kubernetes.io/zone": "a"}}),
            json!({})
        )
        .is_empty(),
        "a zone with every model restricts nothing"
    );
    assert!(restricted_types(json!({}), json!({})).is_empty());
}
