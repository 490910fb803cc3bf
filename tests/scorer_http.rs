//! The extender over real HTTP on 127.0.0.1: filter and prioritize with the JSON kube-scheduler sends,
//! both the `Nodes` and the `NodeNames` forms, bad bodies, health and metrics.

mod scorer_support;

use gpumem::scorer::Scorer;
use gpumem::scorer::cache::NodeCache;
use gpumem::scorer::config::ScorerConfig;
use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};

use scorer_support::*;

fn names(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|n| {
                    n.pointer("/metadata/name")
                        .or(Some(n))
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                        .to_string()
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn filter_nodes_form_keeps_the_node_where_one_gpu_fits() {
    let addr = start_default().await;
    let args = fixture_json("filter_nodes.json");
    let (status, r) = post_json(addr, "/filter", &args).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(names(&r["Nodes"]["items"]), ["one-big"]);
    assert_eq!(r["NodeNames"], Value::Null);
    assert_eq!(r["Error"], "");
    assert_eq!(
        r["FailedNodes"]["halves"], "largest free GPU has 4096 MiB, pod needs 5000 MiB",
        "4096 + 4096 free on two GPUs never holds 5000: {r}"
    );
    // The kept node comes back exactly as sent.
    assert_eq!(r["Nodes"]["items"][0], args["Nodes"]["items"][1]);
    // The hand-edited usage annotation: unschedulable for GPU pods, with the reason, and not worth preempting.
    let edited = r["FailedNodes"]["edited"]
        .as_str()
        .expect("edited node has a reason");
    assert!(
        edited.contains("gpumem.io/gpu-usage") && edited.contains("allocatedMB"),
        "{edited}"
    );
    assert_eq!(r["FailedAndUnresolvableNodes"]["edited"], edited);
    assert!(
        r["FailedAndUnresolvableNodes"].get("halves").is_none(),
        "preemption can help there"
    );
}

#[tokio::test]
async fn filter_node_names_form_reads_the_cache() {
    let list = fixture_json("nodes.json");
    let nodes: Vec<Node> = serde_json::from_value(list["items"].clone()).expect("nodes");
    let scorer = Scorer::new(
        ScorerConfig::default(),
        None,
        Some(NodeCache::from_nodes(nodes)),
        None,
    );
    let (addr, _) = start(scorer).await;
    let (status, r) = post_json(addr, "/filter", &fixture_json("filter_nodenames.json")).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["NodeNames"], json!(["one-big"]));
    assert_eq!(r["Nodes"], Value::Null);
    assert_eq!(
        r["FailedNodes"]["halves"],
        "largest free GPU has 4096 MiB, pod needs 5000 MiB"
    );
    assert!(
        r["FailedNodes"]["not-in-cache"]
            .as_str()
            .is_some_and(|s| s.contains("cache")),
        "{r}"
    );
}

#[tokio::test]
async fn keys_match_case_insensitively() {
    let addr = start_default().await;
    let text = fixture("filter_nodes.json")
        .replacen("\"Pod\":", "\"pod\":", 1)
        .replacen("\"Nodes\":", "\"NODES\":", 1)
        .replacen("\"NodeNames\":", "\"nodenames\":", 1);
    let (status, body) = post(addr, "/filter", &text).await;
    assert_eq!(status, 200, "{body}");
    let r: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(names(&r["Nodes"]["items"]), ["one-big"]);
}

/// A `HostPriorityList` as (host, score) pairs.
fn host_scores(r: &Value) -> Vec<(String, i64)> {
    r.as_array()
        .expect("HostPriorityList")
        .iter()
        .map(|h| {
            (
                h["Host"].as_str().expect("Host").to_string(),
                h["Score"].as_i64().expect("Score"),
            )
        })
        .collect()
}

async fn scores(addr: std::net::SocketAddr, pod: &Value, nodes: &[Value]) -> Vec<(String, i64)> {
    let (status, r) = post_json(addr, "/prioritize", &args_nodes(pod, nodes)).await;
    assert_eq!(status, 200, "{r}");
    host_scores(&r)
}

#[tokio::test]
async fn prioritize_best_fit_and_workload_classes() {
    let addr = start_default().await;
    let nodes = [
        node_json("tight", &[g(16384, 10384)]),
        node_json("medium", &[g(16384, 8384)]),
        node_json("idle", &[g(16384, 0)]),
        node_json("full", &[g(16384, 16000)]),
    ];
    let offline = pod_json(
        "batch",
        5000,
        0,
        json!({}),
        json!({"gpumem.io/workload-class": "offline"}),
    );
    let s = scores(addr, &offline, &nodes).await;
    assert_eq!(
        s.iter().map(|(h, _)| h.as_str()).collect::<Vec<_>>(),
        ["tight", "medium", "idle", "full"]
    );
    let v: Vec<i64> = s.iter().map(|(_, v)| *v).collect();
    assert!(v[0] > v[1] && v[1] > v[2], "offline packs, best fit first: {s:?}");
    assert_eq!(v[3], 0, "a node that cannot host the pod scores 0");
    assert!(v.iter().all(|x| (0..=10).contains(x)));

    let online = pod_json(
        "serve",
        5000,
        0,
        json!({"gpumem.io/workload-class": "online"}),
        json!({}),
    );
    let s = scores(addr, &online, &nodes).await;
    assert!(s[2].1 > s[0].1, "online spreads to the idle GPU: {s:?}");
}

#[tokio::test]
async fn class_weights_are_configurable() {
    // With the class weight at 0, online and offline rank the same (by the policy alone).
    let cfg = ScorerConfig {
        online_weight: 0.0,
        offline_weight: 0.0,
        ..ScorerConfig::default()
    };
    // Each pod on a scorer of its own: a ranking holds the GPU it ranks first for its pod.
    let (addr, _) = start(Scorer::new(cfg.clone(), None, None, None)).await;
    let (other, _) = start(Scorer::new(cfg, None, None, None)).await;
    let nodes = [
        node_json("tight", &[g(16384, 10384)]),
        node_json("idle", &[g(16384, 0)]),
    ];
    let online = pod_json(
        "serve",
        5000,
        0,
        json!({"gpumem.io/workload-class": "online"}),
        json!({}),
    );
    let offline = pod_json(
        "batch",
        5000,
        0,
        json!({"gpumem.io/workload-class": "offline"}),
        json!({}),
    );
    assert_eq!(
        scores(addr, &online, &nodes).await,
        scores(other, &offline, &nodes).await
    );
}

#[tokio::test]
async fn gpu_type_constraint() {
    let addr = start_default().await;
    let mut t4 = g(15360, 0);
    t4.model = "Tesla T4";
    let nodes = [node_json("a100", &[g(81920, 0)]), node_json("t4", &[t4])];
    let pod = pod_json(
        "p",
        5000,
        0,
        json!({"gpumem.io/gpu-models": "Tesla-T4"}),
        json!({}),
    );
    let (status, r) = post_json(addr, "/filter", &args_nodes(&pod, &nodes)).await;
    assert_eq!(status, 200);
    assert_eq!(names(&r["Nodes"]["items"]), ["t4"]);
    let reason = r["FailedNodes"]["a100"].as_str().expect("reason");
    assert!(reason.starts_with("no GPU of an allowed type"), "{reason}");
}

#[tokio::test]
async fn two_gpu_pods_prefer_nvlink_and_can_require_it() {
    let addr = start_default().await;
    let mut linked = vec![g(81920, 0), g(81920, 0)];
    linked[0].nvlink = vec![(1, 12)];
    linked[1].nvlink = vec![(0, 12)];
    let mut split = vec![g(81920, 0), g(81920, 0)];
    split[1].numa = 1;
    let nodes = [node_json("split", &split), node_json("nvlink", &linked)];
    let pod = pod_json("train", 0, 2, json!({}), json!({}));
    let s = scores(addr, &pod, &nodes).await;
    assert!(s[1].1 > s[0].1, "NVLinked pair wins: {s:?}");

    let strict = pod_json(
        "train",
        0,
        2,
        json!({"gpumem.io/gpu-topology-policy": "nvlink"}),
        json!({}),
    );
    let (_, r) = post_json(addr, "/filter", &args_nodes(&strict, &nodes)).await;
    assert_eq!(names(&r["Nodes"]["items"]), ["nvlink"]);
    assert!(
        r["FailedNodes"]["split"]
            .as_str()
            .is_some_and(|s| s.contains("NVLinked")),
        "{r}"
    );
}

#[tokio::test]
async fn pods_asking_for_both_resources_are_refused() {
    let addr = start_default().await;
    let nodes = [node_json("a", &[g(81920, 0)])];
    let pod = pod_json("p", 5000, 1, json!({}), json!({}));
    let (status, r) = post_json(addr, "/filter", &args_nodes(&pod, &nodes)).await;
    assert_eq!(status, 200);
    assert_eq!(r["Nodes"]["items"], json!([]));
    let reason = r["FailedAndUnresolvableNodes"]["a"].as_str().expect("reason");
    assert!(reason.contains("both nvidia.com/gpu"), "{reason}");
}

#[tokio::test]
async fn malformed_bodies_get_400_and_the_server_lives_on() {
    let addr = start_default().await;
    let (status, body) = post(addr, "/filter", "{\"Pod\": {").await;
    assert_eq!(status, 400);
    assert!(body.contains("malformed filter request"), "{body}");
    let (status, body) = post(addr, "/prioritize", r#"{"Pod":{},"NodeNames":"x"}"#).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = post(addr, "/bind", r#"[1,2]"#).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = post(addr, "/filter", r#"{"Nodes":{"items":[]}}"#).await;
    assert_eq!(status, 400, "no Pod: {body}");
    let (status, _) = Conn::open(addr).await.request("GET", "/healthz", b"").await;
    assert_eq!(status, 200);
    let (status, _) = Conn::open(addr).await.request("GET", "/filter", b"").await;
    assert_eq!(status, 405);
}

#[tokio::test]
async fn oversized_bodies_get_413() {
    let cfg = ScorerConfig {
        max_body_bytes: 64 * 1024,
        ..ScorerConfig::default()
    };
    let (addr, _) = start(Scorer::new(cfg, None, None, None)).await;
    let big = format!("{{\"Pod\":{{}},\"NodeNames\":[\"{}\"]}}", "x".repeat(200 * 1024));
    let (status, body) = post(addr, "/filter", &big).await;
    assert_eq!(status, 413, "{body}");
    let (status, body) = Conn::open(addr)
        .await
        .request_chunked("/filter", big.as_bytes())
        .await;
    assert_eq!(status, 413, "chunked, no Content-Length: {body}");
    // Just under the limit is fine.
    let args = fixture("filter_nodes.json");
    assert!(args.len() < 64 * 1024);
    assert_eq!(post(addr, "/filter", &args).await.0, 200);
}

#[tokio::test]
async fn metrics_count_decisions_and_rejections() {
    let addr = start_default().await;
    assert_eq!(
        post_json(addr, "/filter", &fixture_json("filter_nodes.json"))
            .await
            .0,
        200
    );
    let (status, text) = Conn::open(addr).await.request("GET", "/metrics", b"").await;
    assert_eq!(status, 200);
    assert!(
        text.contains("gpumem_scorer_request_duration_seconds_count{verb=\"filter\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("gpumem_scorer_filter_rejections_total{reason=\"gpu_memory\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("gpumem_scorer_filter_rejections_total{reason=\"bad_annotation\"} 1"),
        "{text}"
    );
}

/// kube-scheduler sends `prioritize` the names `filter` kept, right after: the scorer ranks the very states
/// `filter` checked (a node changing in between does not make the two verbs disagree), for each pod on its
/// own, and looks names up again for anything else.
#[tokio::test]
async fn prioritize_ranks_the_states_filter_checked() {
    let node = |name: &str, allocated: u64| -> Node {
        let mut v = node_json(name, &[g(16384, allocated)]);
        v["metadata"]["resourceVersion"] = json!(allocated.to_string());
        serde_json::from_value(v).expect("node")
    };
    let cache = NodeCache::from_nodes([node("a", 0), node("b", 8192), node("c", 15000)]);
    let (addr, _) = start(Scorer::new(
        ScorerConfig::default(),
        None,
        Some(cache.clone()),
        None,
    ))
    .await;
    let args = |pod: &str, names: &[&str]| json!({"Pod": pod_json(pod, 4096, 0, json!({}), json!({})), "Nodes": null, "NodeNames": names});
    let (status, r) = post_json(addr, "/filter", &args("p1", &["a", "b", "c"])).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["NodeNames"], json!(["a", "b"]));
    let (_, before) = post_json(addr, "/prioritize", &args("p0", &["a", "b"])).await;
    let before = host_scores(&before);
    assert!(before.iter().all(|(_, s)| *s > 0), "{before:?}");

    // "b" fills up between p1's filter and prioritize: p1 is still ranked on what its filter saw...
    cache.apply(&kube::runtime::watcher::Event::Apply(node("b", 16384)));
    let (_, during) = post_json(addr, "/prioritize", &args("p1", &["a", "b"])).await;
    assert_eq!(host_scores(&during), before);
    // ...once: the next call, and any other pod, sees the node as it is now.
    for pod in ["p1", "p2"] {
        let (_, after) = post_json(addr, "/prioritize", &args(pod, &["a", "b"])).await;
        assert_eq!(host_scores(&after)[1], ("b".to_string(), 0), "{pod}");
    }
    // Other names than filter kept: looked up.
    let (status, r) = post_json(addr, "/filter", &args("p3", &["a", "b", "c"])).await;
    assert_eq!((status, &r["NodeNames"]), (200, &json!(["a"])));
    let (_, other) = post_json(addr, "/prioritize", &args("p3", &["a", "c"])).await;
    assert_eq!(host_scores(&other)[1], ("c".to_string(), 0));
}

#[tokio::test]
async fn a_starting_scorer_waits_for_its_caches_instead_of_refusing_every_node() {
    let api = std::sync::Arc::new(FakeApi::default());
    api.add_node(&node_json("n1", &[g(16000, 0)]));
    api.hold_lists.send_replace(true);
    let client = fake_api(api.clone()).await;
    let nodes = NodeCache::start(client.clone());
    let pods = gpumem::scorer::pods::PodCache::start(client.clone());
    let (addr, _) = start(Scorer::new(
        ScorerConfig::default(),
        Some(client),
        Some(nodes),
        Some(pods),
    ))
    .await;

    let (status, body) = Conn::open(addr).await.request("GET", "/readyz", b"").await;
    assert_eq!((status, body.contains("node cache")), (503, true), "{body}");
    let (status, _) = Conn::open(addr).await.request("GET", "/healthz", b"").await;
    assert_eq!(status, 200, "alive while not ready");

    // Not synced within the wait: an error kube-scheduler retries, not "no such node".
    let args = json!({"Pod": pod_json("p", 5000, 0, json!({}), json!({})), "NodeNames": ["n1"]});
    let (status, body) = post(addr, "/filter", &args.to_string()).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("has not synced"), "{body}");

    // A call that arrives before the first list, which then comes: answered from the synced cache.
    let waiting = tokio::spawn(async move { post_json(addr, "/filter", &args).await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    api.hold_lists.send_replace(false);
    let (status, result) = waiting.await.expect("filter");
    assert_eq!(status, 200, "{result}");
    assert_eq!(result["NodeNames"], json!(["n1"]), "{result}");
    let (status, _) = Conn::open(addr).await.request("GET", "/readyz", b"").await;
    assert_eq!(status, 200);
    api.assert_all_granted();
}

#[tokio::test]
async fn a_shortlist_hands_back_the_best_ranked_nodes_with_their_scores_among_all() {
    let names_of = |i: std::ops::Range<u64>| i.map(|i| format!("n{i:02}")).collect::<Vec<_>>();
    let all = names_of(0..12);
    let node = |i: u64| -> Node {
        // 16 GiB each, 1000 MiB more allocated on each next node.
        serde_json::from_value(node_json(&format!("n{i:02}"), &[g(16384, i * 1000)])).expect("node")
    };
    let cache = NodeCache::from_nodes((0..12).map(node));
    let scorer = |filter_shortlist| {
        Scorer::new(
            ScorerConfig {
                filter_shortlist,
                ..ScorerConfig::default()
            },
            None,
            Some(cache.clone()),
            None,
        )
    };
    let (every, _) = start(scorer(0)).await;
    let (short, _) = start(scorer(3)).await;
    let args = |pod: &str, mib: u64, names: &[String]| json!({"Pod": pod_json(pod, mib, 0, json!({}), json!({})), "NodeNames": names});

    // Without a shortlist every node that fits comes back; its ranking is the reference.
    let (_, r) = post_json(every, "/filter", &args("p", 4096, &all)).await;
    assert_eq!(r["NodeNames"], json!(all));
    let (_, reference) = post_json(every, "/prioritize", &args("p", 4096, &all)).await;
    let reference = host_scores(&reference);
    let score_of = |name: &str| reference.iter().find(|(n, _)| n == name).expect("ranked").1;

    // With one of 3: three nodes, none ranked below a node left out, and not reported as failures.
    let (status, r) = post_json(short, "/filter", &args("p", 4096, &all)).await;
    assert_eq!(status, 200, "{r}");
    let kept: Vec<String> = serde_json::from_value(r["NodeNames"].clone()).expect("names");
    assert_eq!(kept.len(), 3, "{r}");
    let worst_kept = kept.iter().map(|n| score_of(n)).min().expect("kept");
    let best_left = all
        .iter()
        .filter(|n| !kept.contains(n))
        .map(|n| score_of(n))
        .max()
        .expect("left");
    assert!(worst_kept >= best_left, "kept {kept:?} of {reference:?}");
    assert!(
        reference.iter().map(|(_, s)| s).any(|s| *s != worst_kept),
        "all nodes tie: {reference:?}"
    );
    assert_eq!(r["FailedNodes"], json!({}), "{r}");
    // prioritize answers the shortlist's scores as ranked among all twelve.
    let (_, scores) = post_json(short, "/prioritize", &args("p", 4096, &kept)).await;
    let expected: Vec<(String, i64)> = kept.iter().map(|n| (n.clone(), score_of(n))).collect();
    assert_eq!(host_scores(&scores), expected);

    // Fewer nodes fit than the shortlist holds: all of them, and the others failed with a reason.
    let (_, r) = post_json(short, "/filter", &args("q", 15000, &all)).await;
    assert_eq!(r["NodeNames"], json!(names_of(0..2)), "{r}");
    let failed = r["FailedNodes"].as_object().expect("FailedNodes");
    assert_eq!(failed.len(), 10, "{r}");
}
