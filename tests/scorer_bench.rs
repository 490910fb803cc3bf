//! Decision latency of filter + prioritize over HTTP (loopback, one keep-alive connection), for
//! 500 / 1000 / 5000 nodes x 8 GPUs, in both the `Nodes` and the `NodeNames` forms. A measurement, not a
//! test: it asserts nothing about time. Run it with
//! `cargo test --release --test scorer_bench -- --ignored --nocapture`.

mod scorer_support;

use std::time::Instant;

use gpumem::scorer::cache::NodeCache;
use gpumem::scorer::{Config, Scorer};
use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};

use scorer_support::*;

fn cluster(n: usize) -> Vec<Value> {
    // Deterministic mixed usage: some idle GPUs, some shared, some whole.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|i| {
            let gpus: Vec<G> = (0..8)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let mut gpu = g(81920, [0, 0, 20480, 40960, 61440, 81920][(x % 6) as usize]);
                    gpu.whole = x.is_multiple_of(11);
                    gpu.numa = (x % 2) as u32;
                    gpu
                })
                .collect();
            node_json(&format!("node-{i:05}"), &gpus)
        })
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with --release -- --ignored --nocapture"]
async fn bench_filter_prioritize() {
    println!("form       nodes   req KiB   p50 ms   p99 ms   decisions/s (filter+prioritize)");
    for n in [500usize, 1000, 5000] {
        let nodes = cluster(n);
        let objs: Vec<Node> = nodes
            .iter()
            .map(|v| serde_json::from_value(v.clone()).expect("node"))
            .collect();
        let cfg = Config {
            max_body_bytes: 1 << 30,
            ..Config::default()
        };
        let (addr, _) = start(Scorer::new(cfg, None, Some(NodeCache::from_nodes(objs)), None)).await;
        let pod = pod_json("p", 30000, 0, json!({}), json!({}));
        let names: Vec<String> = (0..n).map(|i| format!("node-{i:05}")).collect();
        for form in ["Nodes", "NodeNames"] {
            let body = if form == "Nodes" {
                args_nodes(&pod, &nodes).to_string()
            } else {
                json!({"Pod": pod, "Nodes": null, "NodeNames": names}).to_string()
            };
            let mut conn = Conn::open(addr).await;
            let rounds = if n >= 5000 && form == "Nodes" { 20 } else { 100 };
            // Warm-up: fills the node caches (both forms keep parsed node state between calls).
            for _ in 0..3 {
                assert_eq!(conn.request("POST", "/filter", body.as_bytes()).await.0, 200);
            }
            let mut times = Vec::with_capacity(rounds);
            let all = Instant::now();
            for _ in 0..rounds {
                let t = Instant::now();
                let (s1, _) = conn.request("POST", "/filter", body.as_bytes()).await;
                let (s2, _) = conn.request("POST", "/prioritize", body.as_bytes()).await;
                assert_eq!((s1, s2), (200, 200));
                times.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            let per_sec = rounds as f64 / all.elapsed().as_secs_f64();
            times.sort_by(f64::total_cmp);
            println!(
                "{form:<10} {n:>5} {:>9} {:>8.2} {:>8.2} {:>13.0}",
                body.len() / 1024,
                percentile(&times, 0.5),
                percentile(&times, 0.99),
                per_sec
            );
        }
    }
}
