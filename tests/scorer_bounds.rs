//! What one request may cost the scorer, over real HTTP (issue #14): requests past the node limit are
//! refused while parsed, nodes whose annotations claim more than any real node are refused (with their
//! reason, without skewing the cluster gauges), and heavy decisions run off the async workers, so that
//! `/healthz` answers while they run.

mod scorer_support;

use std::time::{Duration, Instant};

use gpumem::scorer::Scorer;
use gpumem::scorer::cache::NodeCache;
use gpumem::scorer::config::ScorerConfig;
use gpumem::scorer::extender::{MAX_NODE_NAME_BYTES, MAX_NODES, MAX_VICTIM_PODS};
use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};

use scorer_support::*;

fn cache_of(nodes: Vec<Value>) -> std::sync::Arc<NodeCache> {
    NodeCache::from_nodes(
        nodes
            .into_iter()
            .map(|v| serde_json::from_value::<Node>(v).expect("node")),
    )
}

fn names_args(pod: &Value, names: &[String]) -> String {
    json!({"Pod": pod, "Nodes": null, "NodeNames": names}).to_string()
}

#[tokio::test]
async fn requests_past_the_node_limit_get_400_and_the_scorer_still_answers() {
    let cache = cache_of(vec![node_json("a", &[g(16384, 0)])]);
    let (addr, _) = start(Scorer::new(ScorerConfig::default(), None, Some(cache), None)).await;
    let pod = pod_json("p", 5000, 0, json!({}), json!({}));

    // The largest request accepted: MAX_NODES names, of the longest length a node name has.
    let mut names: Vec<String> = vec!["a".into()];
    names.extend((1..MAX_NODES).map(|i| format!("{i:0width$}", width = MAX_NODE_NAME_BYTES)));
    let (status, body) = post(addr, "/filter", &names_args(&pod, &names)).await;
    assert_eq!(status, 200, "{}", &body[..body.len().min(300)]);
    let answer: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(answer["NodeNames"], json!(["a"]));
    let failed = answer["FailedNodes"].as_object().expect("FailedNodes");
    assert_eq!(failed.len(), MAX_NODES - 1);

    // One more name, or a name longer than Kubernetes allows: refused, saying why.
    names.push("b".into());
    let (status, body) = post(addr, "/filter", &names_args(&pod, &names)).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains(&format!("more than {MAX_NODES} nodes in one request")),
        "{body}"
    );
    let long = vec!["n".repeat(MAX_NODE_NAME_BYTES + 1)];
    let (status, body) = post(addr, "/prioritize", &names_args(&pod, &long)).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("a node name of 254 bytes"), "{body}");
    // Names with escapes take the other parsing path: bounded the same.
    let escaped: Vec<String> = (0..=MAX_NODES).map(|i| format!("n\\u0041{i}")).collect();
    let text = format!(
        r#"{{"Pod":{pod},"NodeNames":[{}]}}"#,
        escaped
            .iter()
            .map(|n| format!("\"{n}\""))
            .collect::<Vec<_>>()
            .join(",")
    );
    let (status, body) = post(addr, "/filter", &text).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("more than 15000 nodes"), "{body}");

    // The `Nodes` form and preempt's victims are bounded too.
    let items = vec![json!({}); MAX_NODES + 1];
    let (status, body) = post(addr, "/filter", &args_nodes(&pod, &items).to_string()).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("more than 15000 nodes"), "{body}");
    let victims = vec![json!({}); MAX_VICTIM_PODS / 2 + 1];
    let args = json!({"Pod": pod, "NodeNameToVictims": {
        "a": {"Pods": victims, "NumPDBViolations": 0},
        "b": {"Pods": victims, "NumPDBViolations": 0}}});
    let (status, body) = post(addr, "/preempt", &args.to_string()).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains(&format!("more than {MAX_VICTIM_PODS} victim pods")),
        "{body}"
    );

    // And it still answers.
    let (status, _) = Conn::open(addr).await.request("GET", "/healthz", b"").await;
    assert_eq!(status, 200);
    let (status, answer) = post_json(addr, "/filter", &json!({"Pod": pod, "NodeNames": ["a"]})).await;
    assert_eq!((status, &answer["NodeNames"]), (200, &json!(["a"])), "{answer}");
}

/// The value of the sample `series` (name with labels, exactly as exposed).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        rest.strip_prefix(' ')?.split_whitespace().next()?.parse().ok()
    })
}

async fn cluster_gauges(nodes: Vec<Value>) -> (Vec<Option<f64>>, String) {
    let (addr, _) = start(Scorer::new(
        ScorerConfig::default(),
        None,
        Some(cache_of(nodes)),
        None,
    ))
    .await;
    let (status, text) = Conn::open(addr).await.request("GET", "/metrics", b"").await;
    assert_eq!(status, 200, "{text}");
    let gauges = [
        "gpumem_cluster_fragmentation_ratio",
        "gpumem_cluster_gpu_memory_allocated_ratio",
        "gpumem_node_fragmentation_ratio{node=\"good\"}",
    ]
    .iter()
    .map(|s| sample(&text, s))
    .collect();
    (gauges, text)
}

#[tokio::test]
async fn hostile_annotations_are_refused_with_their_reason_and_leave_the_gauges_alone() {
    let good = node_json("good", &[g(16384, 6000), g(16384, 0)]);
    // More GPUs than the scorer accepts (node::MAX_GPUS), and a GPU of u64::MAX MiB.
    let greedy = node_json("greedy", &vec![g(16384, 0); 65]);
    let vast = node_json("vast", &[g(u64::MAX, 0), g(16384, 0)]);
    let cache = cache_of(vec![good.clone(), greedy.clone(), vast.clone()]);
    let (addr, _) = start(Scorer::new(ScorerConfig::default(), None, Some(cache), None)).await;
    let pod = pod_json("p", 5000, 0, json!({}), json!({}));
    let names = ["greedy", "good", "vast"];

    let (status, r) = post_json(addr, "/filter", &json!({"Pod": pod, "NodeNames": names})).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["NodeNames"], json!(["good"]), "{r}");
    for (node, claim) in [
        ("greedy", "65 GPUs, at most 64 are accepted".to_string()),
        (
            "vast",
            format!("{} MiB on GPU 0, at most 1048576 are accepted", u64::MAX),
        ),
    ] {
        let reason = r["FailedNodes"][node].as_str().unwrap_or_default();
        assert!(
            reason.starts_with("annotation gpumem.io/gpu-topology is refused") && reason.contains(&claim),
            "{node}: {r}"
        );
        assert_eq!(r["FailedAndUnresolvableNodes"][node], reason, "{r}");
    }
    let (status, r) = post_json(addr, "/prioritize", &json!({"Pod": pod, "NodeNames": names})).await;
    assert_eq!(status, 200, "{r}");
    let scores: Vec<i64> = (0..3).map(|i| r[i]["Score"].as_i64().expect("Score")).collect();
    assert!(scores[0] == 0 && scores[1] > 0 && scores[2] == 0, "{r}");

    // The cluster gauges read as if the hostile nodes were not there.
    let (alone, _) = cluster_gauges(vec![good.clone()]).await;
    let (with_hostile, text) = cluster_gauges(vec![good, greedy, vast]).await;
    assert!(alone.iter().all(Option::is_some), "{alone:?}");
    assert_eq!(with_hostile, alone, "{text}");
    assert!(
        !text.contains("node=\"greedy\"") && !text.contains("node=\"vast\""),
        "{text}"
    );
}

/// A node of 64 GPUs (node::MAX_GPUS), every pair NVLinked.
fn nvlinked_node(name: &str) -> Value {
    let gpus: Vec<G> = (0..64u32)
        .map(|i| G {
            nvlink: (0..64).filter(|&p| p != i).map(|p| (p, 18)).collect(),
            ..g(81920, 0)
        })
        .collect();
    node_json(name, &gpus)
}

/// The scorer's runtime has this many async workers; more heavy calls than that run at once.
const WORKERS: usize = 2;

#[test]
fn heavy_decisions_leave_health_answering() {
    // The scorer on a runtime of its own, as in the binary, so that the probes below are timed from
    // outside it.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .enable_all()
        .build()
        .expect("scorer runtime");
    // Decisions for a 32-GPU pod that needs NVLink between all its GPUs, on nodes of 64 NVLinked GPUs:
    // the most a node's topology may cost.
    let nodes: Vec<String> = (0..300).map(|i| format!("big-{i}")).collect();
    let template = nvlinked_node("template");
    let cache = cache_of(
        nodes
            .iter()
            .map(|name| {
                let mut node = template.clone();
                node["metadata"]["name"] = json!(name);
                node
            })
            .collect(),
    );
    // Every node back from filter: the heaviest answer (no shortlist).
    let config = ScorerConfig {
        filter_shortlist: 0,
        ..ScorerConfig::default()
    };
    let (addr, _) = runtime.block_on(start(Scorer::new(config, None, Some(cache), None)));
    let pod = pod_json(
        "train",
        0,
        32,
        json!({"gpumem.io/gpu-topology-policy": "nvlink"}),
        json!({}),
    );
    let args = json!({"Pod": pod, "NodeNames": nodes});
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    client.block_on(async {
        let heavy: Vec<_> = (0..2 * WORKERS)
            .map(|k| {
                let args = args.clone();
                tokio::spawn(async move {
                    let verb = if k % 2 == 0 { "/filter" } else { "/prioritize" };
                    let (status, r) = post_json(addr, verb, &args).await;
                    (verb, status, r)
                })
            })
            .collect();
        // Health is asked while they run: each answer within 1 s (the old scorer stalled it for
        // seconds).
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut asked = 0;
        while heavy.iter().any(|h| !h.is_finished()) {
            let started = Instant::now();
            let (status, _) = Conn::open(addr).await.request("GET", "/healthz", b"").await;
            let took = started.elapsed();
            assert!(
                status == 200 && took < Duration::from_secs(1),
                "/healthz: {status} after {took:?} while decisions ran"
            );
            asked += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for h in heavy {
            let (verb, status, r) = h.await.expect("request task");
            assert_eq!(status, 200, "{verb}: {r}");
            match verb {
                "/filter" => assert_eq!(r["NodeNames"], json!(nodes), "{r}"),
                _ => assert!(
                    r.as_array().is_some_and(
                        |a| a.len() == nodes.len() && a.iter().all(|h| h["Score"].as_i64() > Some(0))
                    ),
                    "{r}"
                ),
            }
        }
        // Not a speed check: the probes must have overlapped the decisions to mean anything.
        assert!(asked >= 3, "only {asked} health probes while the decisions ran");
    });
}

/// This process's peak resident memory (VmHWM), in MB.
fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kb / 1000.0
}

/// The figures behind `DEFAULT_MAX_BODY_BYTES` (issue #14, item 3). A measurement, not a check of speed:
/// `cargo test --release --test scorer_bounds -- --ignored --nocapture peak_memory`. The process holds the
/// client's side too (each request's text, one at a time), so the figures are an upper bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run in release with --nocapture"]
async fn peak_memory_of_the_largest_accepted_requests() {
    let eight = |k: usize| -> Vec<G> { (0..8).map(|i| g(81920, ((k + i) % 4) as u64 * 10240)).collect() };
    let known: Vec<Value> = (0..5000)
        .map(|k| node_json(&format!("node-{k:04}"), &eight(k)))
        .collect();
    let (addr, _) = start(Scorer::new(
        ScorerConfig::default(),
        None,
        Some(cache_of(known)),
        None,
    ))
    .await;
    let pod = pod_json("p", 5000, 0, json!({}), json!({}));
    println!(
        "node cache of 5,000 nodes of 8 GPUs: peak {:.0} MB",
        peak_rss_mb()
    );

    let names: Vec<String> = (0..MAX_NODES)
        .map(|i| format!("{i:0width$}", width = MAX_NODE_NAME_BYTES))
        .collect();
    let body = names_args(&pod, &names);
    for verb in ["/filter", "/prioritize"] {
        let (status, _) = post(addr, verb, &body).await;
        assert_eq!(status, 200, "{verb}");
    }
    drop(body);
    println!(
        "{MAX_NODES} unknown names of {MAX_NODE_NAME_BYTES} bytes, filter then prioritize: peak {:.0} MB",
        peak_rss_mb()
    );

    // `Nodes`-form requests just under the limit, each of nodes never seen before.
    let limit = ScorerConfig::default().max_body_bytes;
    // Measured on a sample of the request as sent (the pod and the list around the nodes included).
    let sample: Vec<Value> = (0..100)
        .map(|k| node_json(&format!("r10-n{k:05}"), &eight(k)))
        .collect();
    let per_node = args_nodes(&pod, &sample).to_string().len() / 100 + 8;
    let count = (limit - 4096) / per_node;
    for round in 0..12 {
        let items: Vec<Value> = (0..count)
            .map(|k| node_json(&format!("r{round}-n{k:05}"), &eight(k)))
            .collect();
        let body = args_nodes(&pod, &items).to_string();
        drop(items);
        assert!(body.len() <= limit, "{} bytes", body.len());
        for verb in ["/filter", "/prioritize"] {
            let (status, _) = post(addr, verb, &body).await;
            assert_eq!(status, 200, "{verb}");
        }
    }
    println!(
        "12 different `Nodes`-form requests of {count} nodes of 8 GPUs (under {} MiB), filter then \
         prioritize each: peak {:.0} MB",
        limit >> 20,
        peak_rss_mb()
    );
}
