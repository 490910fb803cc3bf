//! The scorer's `/metrics` over real HTTP: the names the deployed dashboard and alerts query are all
//! exported, and the cluster gauges (fragmentation, allocated share) carry the right values.

mod scorer_support;

use std::collections::BTreeSet;

use gpumem::scorer::Scorer;
use gpumem::scorer::cache::NodeCache;
use gpumem::scorer::config::ScorerConfig;
use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};

use scorer_support::*;

/// `tight`: one 16384 MiB GPU with 6000 free; `idle`: one idle 16384 MiB GPU; `mixed`: a GPU held whole
/// and an idle but unhealthy one; `edited`: hand-edited annotations.
fn world() -> Vec<Value> {
    let mut whole = g(16384, 16384);
    whole.whole = true;
    let mut mixed = node_json("mixed", &[whole, g(16384, 0)]);
    let key = "gpumem.io/gpu-topology";
    let mut topology: Value =
        serde_json::from_str(mixed["metadata"]["annotations"][key].as_str().expect("topology"))
            .expect("json");
    topology["gpus"][1]["health"] = json!("Unhealthy");
    mixed["metadata"]["annotations"][key] = json!(topology.to_string());
    let mut edited = node_json("edited", &[g(16384, 0)]);
    let usage = edited["metadata"]["annotations"]["gpumem.io/gpu-usage"]
        .as_str()
        .expect("usage")
        .replace("allocatedMiB", "allocatedMB");
    edited["metadata"]["annotations"]["gpumem.io/gpu-usage"] = json!(usage);
    vec![
        node_json("tight", &[g(16384, 10384)]),
        node_json("idle", &[g(16384, 0)]),
        mixed,
        edited,
    ]
}

/// The value of the sample `series` (name with labels, exactly as exposed).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        rest.strip_prefix(' ')?.split_whitespace().next()?.parse().ok()
    })
}

fn close(text: &str, series: &str, want: f64) {
    let got = sample(text, series).unwrap_or_else(|| panic!("{series} missing:\n{text}"));
    assert!((got - want).abs() < 1e-9, "{series} = {got}, want {want}");
}

async fn scrape(addr: std::net::SocketAddr) -> String {
    let (status, text) = Conn::open(addr).await.request("GET", "/metrics", b"").await;
    assert_eq!(status, 200, "{text}");
    text
}

/// With the default typical mix (2, 4, 8, 16 GiB at 15, 20, 20, 10 %; 1, 2, 4, 8 whole GPUs at 25, 5, 3,
/// 2 %): `tight`'s 6000 MiB serve the 2 and 4 GiB tasks only, so 65 % of it is fragment; `idle`'s GPU
/// serves all but the multi-GPU tasks (10 %); `mixed` has no healthy idle memory, its unhealthy GPU
/// counts nowhere; `edited` is left out.
fn check_gauges(text: &str) {
    close(text, "gpumem_node_fragmentation_ratio{node=\"tight\"}", 0.65);
    close(text, "gpumem_node_fragmentation_ratio{node=\"idle\"}", 0.1);
    close(text, "gpumem_node_fragmentation_ratio{node=\"mixed\"}", 0.0);
    assert!(!text.contains("node=\"edited\""), "{text}");
    close(
        text,
        "gpumem_cluster_fragmentation_ratio",
        (0.65 * 6000.0 + 0.1 * 16384.0) / (6000.0 + 16384.0),
    );
    close(
        text,
        "gpumem_cluster_gpu_memory_allocated_ratio",
        (10384.0 + 16384.0) / (3.0 * 16384.0),
    );
}

#[tokio::test]
async fn cluster_gauges_from_the_node_cache() {
    let nodes: Vec<Node> = world()
        .into_iter()
        .map(|v| serde_json::from_value(v).expect("node"))
        .collect();
    let scorer = Scorer::new(
        ScorerConfig::default(),
        None,
        Some(NodeCache::from_nodes(nodes)),
        None,
    );
    let (addr, _) = start(scorer).await;
    check_gauges(&scrape(addr).await);
}

#[tokio::test]
async fn cluster_gauges_from_the_last_nodes_call() {
    let addr = start_default().await;
    let before = scrape(addr).await;
    close(&before, "gpumem_cluster_fragmentation_ratio", 0.0);
    close(&before, "gpumem_cluster_gpu_memory_allocated_ratio", 0.0);
    let pod = pod_json("p", 5000, 0, json!({}), json!({}));
    let (status, _) = post_json(addr, "/prioritize", &args_nodes(&pod, &world())).await;
    assert_eq!(status, 200);
    // The gauges are recomputed at most every 2 s.
    tokio::time::sleep(gpumem::scorer::metrics::GAUGE_PERIOD).await;
    check_gauges(&scrape(addr).await);
}

/// Every `gpumem_[a-z_]+` in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("gpumem_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

fn base(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

#[tokio::test]
async fn every_scorer_metric_the_deployment_queries_is_exported() {
    let nodes: Vec<Node> = world()
        .into_iter()
        .map(|v| serde_json::from_value(v).expect("node"))
        .collect();
    let scorer = Scorer::new(
        ScorerConfig::default(),
        None,
        Some(NodeCache::from_nodes(nodes)),
        None,
    );
    let (addr, _) = start(scorer).await;
    // One call with a rejection, so that the per-verb and per-reason series exist.
    let (status, r) = post_json(addr, "/filter", &fixture_json("filter_nodes.json")).await;
    assert_eq!(status, 200, "{r}");
    let text = scrape(addr).await;
    let exported: BTreeSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(base)
        .collect();
    let dir = format!("{}/deploy/helm/gpumem", env!("CARGO_MANIFEST_DIR"));
    let mut used = BTreeSet::new();
    for file in ["dashboards/gpumem.json", "templates/prometheusrule.yaml"] {
        let path = format!("{dir}/{file}");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        used.extend(metric_names(&text).into_iter().filter(|n| {
            ["gpumem_scorer_", "gpumem_cluster_", "gpumem_node_"]
                .iter()
                .any(|p| n.starts_with(p))
        }));
    }
    // The deployment does query the scorer (a vacuous check would pass on any exporter).
    for name in [
        "gpumem_scorer_request_duration_seconds_bucket",
        "gpumem_scorer_filter_rejections_total",
        "gpumem_cluster_fragmentation_ratio",
        "gpumem_node_fragmentation_ratio",
        "gpumem_cluster_gpu_memory_allocated_ratio",
    ] {
        assert!(
            used.contains(name),
            "{name} not in the deployment's queries: {used:?}"
        );
    }
    for name in &used {
        assert!(
            exported.contains(base(name)),
            "{name} is queried by the deployment but the scorer does not export it:\n{text}"
        );
    }
    assert!(
        text.contains("gpumem_scorer_filter_rejections_total{reason=\"gpu_memory\"} 1"),
        "{text}"
    );
}

/// The scorer learns its typical mix from the pods it decides on (over HTTP, as kube-scheduler sends
/// them), and from then on measures (and places) against what it learned, not the configured mix.
#[tokio::test]
async fn the_typical_mix_is_learned_from_the_pods_decided() {
    let addr = start_default().await;
    let min = gpumem::alloc::MixConfig::default().min_pods;
    let tight = world().into_iter().next().expect("tight");
    // 9000 MiB jobs that `tight` (6000 MiB free) cannot take: decided at filter, each counted once
    // although filtered twice (kube-scheduler retries an unschedulable pod).
    for round in 0..2 {
        for i in 0..min {
            let pod = pod_json(&format!("job-{i}"), 9000, 0, json!({}), json!({}));
            let (status, r) =
                post_json(addr, "/filter", &args_nodes(&pod, std::slice::from_ref(&tight))).await;
            assert_eq!(status, 200, "round {round}: {r}");
            assert_eq!(r["Nodes"]["items"], json!([]), "{r}");
        }
    }
    // Ranking is no decision of the pod's: not counted.
    let pod = pod_json("ranked", 2000, 0, json!({}), json!({}));
    let (status, _) = post_json(addr, "/prioritize", &args_nodes(&pod, &world())).await;
    assert_eq!(status, 200);
    tokio::time::sleep(gpumem::scorer::metrics::GAUGE_PERIOD).await;
    let text = scrape(addr).await;
    close(&text, "gpumem_scorer_mix_pods_seen", min as f64);
    close(&text, "gpumem_scorer_mix_generation", 1.0);
    // Against 9000 MiB jobs, `tight`'s 6000 free MiB are all fragment and `idle`'s GPU none (the
    // configured mix said 0.65 and 0.1).
    close(&text, "gpumem_node_fragmentation_ratio{node=\"tight\"}", 1.0);
    close(&text, "gpumem_node_fragmentation_ratio{node=\"idle\"}", 0.0);
}

/// A restarted scorer goes on from the GPU pods bound in the cluster (its pod cache), not from the
/// prior: with more than the learner's minimum bound, the first decision already uses the learned mix,
/// and a bound pod decided again is not counted twice.
#[tokio::test]
async fn a_restarted_scorer_learns_the_mix_from_the_bound_pods() {
    use gpumem::scorer::pods::PodCache;
    use std::sync::Arc;
    let min = gpumem::alloc::MixConfig::default().min_pods;
    let api = Arc::new(FakeApi::default());
    for n in world() {
        api.add_node(&n);
    }
    let mut uids = Vec::new();
    for i in 0..min + 20 {
        let mut pod = pod_json(&format!("bound-{i}"), 9000, 0, json!({}), json!({}));
        pod["spec"]["nodeName"] = json!("idle");
        uids.push(pod["metadata"]["uid"].clone());
        api.add_pod(&pod);
    }
    // Not bound: not part of the cluster's workload yet.
    api.add_pod(&pod_json("pending", 2000, 0, json!({}), json!({})));
    let client = fake_api(api.clone()).await;
    let scorer = Arc::new(Scorer::new(
        ScorerConfig::default(),
        Some(client.clone()),
        Some(NodeCache::start(client.clone())),
        Some(PodCache::start(client)),
    ));
    scorer.follow_caches();
    let (addr, _task) = gpumem::scorer::server::spawn(scorer.clone(), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind loopback");
    let mut text = String::new();
    for _ in 0..100 {
        text = scrape(addr).await;
        if sample(&text, "gpumem_scorer_mix_pods_seen") == Some((min + 20) as f64) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    close(&text, "gpumem_scorer_mix_pods_seen", (min + 20) as f64);
    close(&text, "gpumem_scorer_mix_generation", 1.0);
    // One of them decided again (kube-scheduler retries a pod whose bind it did not see): once only.
    let again = pod_json("bound-0", 9000, 0, json!({}), json!({}));
    assert_eq!(again["metadata"]["uid"], uids[0]);
    let (status, _) = post_json(addr, "/filter", &args_nodes(&again, &world()[..1])).await;
    assert_eq!(status, 200);
    tokio::time::sleep(gpumem::scorer::metrics::GAUGE_PERIOD).await;
    close(
        &scrape(addr).await,
        "gpumem_scorer_mix_pods_seen",
        (min + 20) as f64,
    );
    // Against 9000 MiB jobs (the learned mix, not the prior's), `tight`'s 6000 free MiB are all fragment.
    close(
        &scrape(addr).await,
        "gpumem_node_fragmentation_ratio{node=\"tight\"}",
        1.0,
    );
}
