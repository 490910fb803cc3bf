//! Decision latency of filter + prioritize over HTTP (loopback, one keep-alive connection), for
//! 500 / 1000 / 5000 nodes x 8 GPUs, in both the `Nodes` and the `NodeNames` forms. A measurement, not a
//! test: it asserts nothing about time. Run it with
//! `cargo test --release --test scorer_bench -- --ignored --nocapture`; `GPUMEM_BENCH_NODES=1000`,
//! `GPUMEM_BENCH_FORM=NodeNames` and `GPUMEM_BENCH_MIX=repeat` narrow it (for a profiler),
//! `GPUMEM_BENCH_ROUNDS` sets the rounds.
//!
//! Each decision is shaped like kube-scheduler's: the node list comes in a different order every time
//! (its filter runs in parallel and starts at a rotating offset), and in the `NodeNames` form one node's
//! usage changes between decisions (the previous bind, as the node watch reports it). Pod sizes either
//! repeat (three sizes in turn, as replicas of a few deployments do) or are new every decision; pods
//! asking for no GPU show what the protocol alone costs.

mod scorer_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use gpumem::scorer::Scorer;
use gpumem::scorer::cache::NodeCache;
use gpumem::scorer::config::ScorerConfig;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::watcher;
use serde_json::{Value, json};

use scorer_support::*;

/// A deterministic xorshift stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Node `i` with mixed usage: some idle GPUs, some shared, some whole.
fn node(i: usize, rng: &mut Rng, version: u64) -> Value {
    let gpus: Vec<G> = (0..8)
        .map(|_| {
            let x = rng.next();
            let mut gpu = g(81920, [0, 0, 20480, 40960, 61440, 81920][(x % 6) as usize]);
            gpu.whole = x.is_multiple_of(11);
            gpu.numa = (x % 2) as u32;
            gpu
        })
        .collect();
    let mut v = node_json(&format!("node-{i:05}"), &gpus);
    v["metadata"]["resourceVersion"] = json!(version.to_string());
    v
}

/// Node versions for the watch updates: each one new, so the cache parses the node again.
static VERSION: AtomicU64 = AtomicU64::new(2);

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Up to `k` orders of `0..n`: shuffled, as kube-scheduler's parallel filter returns them.
fn orders(n: usize, k: usize, rng: &mut Rng) -> Vec<Vec<usize>> {
    (0..k)
        .map(|_| {
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
            }
            order
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with --release -- --ignored --nocapture"]
async fn bench_filter_prioritize() {
    let only = |var: &str, value: &str| std::env::var(var).map_or(true, |v| v == value);
    let rounds_override = std::env::var("GPUMEM_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok());
    println!(
        "form       nodes listed pod sizes  req KiB   p50 ms   p99 ms   decisions/s (filter+prioritize)"
    );
    for n in [500usize, 1000, 5000] {
        if !only("GPUMEM_BENCH_NODES", &n.to_string()) {
            continue;
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let nodes: Vec<Value> = (0..n).map(|i| node(i, &mut rng, 1)).collect();
        let objs: Vec<Node> = nodes
            .iter()
            .map(|v| serde_json::from_value(v.clone()).expect("node"))
            .collect();
        // prioritize is sent every listed name (not filter's answer, as kube-scheduler does), so
        // filter hands back every node too: both verbs rank all of them. With the shortlist, filter
        // ranks them and prioritize answers 10 from what filter kept: about the same work in all.
        let cfg = ScorerConfig {
            max_body_bytes: 1 << 30,
            filter_shortlist: 0,
            ..ScorerConfig::default()
        };
        let cache = NodeCache::from_nodes(objs);
        let (addr, _) = start(Scorer::new(cfg, None, Some(cache.clone()), None)).await;
        let orders = orders(n, if n >= 5000 { 3 } else { 8 }, &mut rng);
        // kube-scheduler sends the extender only the first feasible nodes it finds: by default
        // max(100, n x (50 - n/125)%), so 420 of 1000 and 500 of 5000 (`percentageOfNodesToScore`).
        let sampled = (n * (50 - n / 125).max(5) / 100).max(100);
        for (form, listed) in [("Nodes", n), ("NodeNames", n), ("NodeNames", sampled)] {
            if !only("GPUMEM_BENCH_FORM", form) || (listed < n && n < 5000) {
                continue;
            }
            // "none": pods asking for no GPU, answered without a decision: what the protocol itself
            // costs (parsing, node lookups, answers, HTTP), the floor under the other lines.
            for mix in ["repeat", "new", "none"] {
                if !only("GPUMEM_BENCH_MIX", mix) {
                    continue;
                }
                let rounds = rounds_override.unwrap_or(if n >= 5000 && form == "Nodes" { 20 } else { 200 });
                let bodies: Vec<String> = (0..rounds.min(24))
                    .map(|r| {
                        let mib = match mix {
                            "repeat" => [30000, 10240, 4096][r % 3],
                            "none" => 0,
                            _ => 1000 + 997 * r as u64,
                        };
                        let pod = pod_json(&format!("p{r}"), mib, 0, json!({}), json!({}));
                        // A window at a rotating start, as kube-scheduler's nextStartNodeIndex moves.
                        let order = &orders[r % orders.len()];
                        let start = r * listed % n;
                        let order: Vec<usize> = (0..listed).map(|k| order[(start + k) % n]).collect();
                        if form == "Nodes" {
                            let list: Vec<Value> = order.iter().map(|&i| nodes[i].clone()).collect();
                            args_nodes(&pod, &list).to_string()
                        } else {
                            let names: Vec<String> = order.iter().map(|&i| format!("node-{i:05}")).collect();
                            json!({"Pod": pod, "Nodes": null, "NodeNames": names}).to_string()
                        }
                    })
                    .collect();
                let mut conn = Conn::open(addr).await;
                // Warm-up: fills the node caches (both forms keep parsed node state between calls) and,
                // for repeating sizes, the policies' memos.
                for body in bodies.iter().take(3) {
                    assert_eq!(conn.request("POST", "/filter", body.as_bytes()).await.0, 200);
                    assert_eq!(conn.request("POST", "/prioritize", body.as_bytes()).await.0, 200);
                }
                drop(conn);
                let bodies = Arc::new(bodies);
                // One connection, as one kube-scheduler calls; for repeating sizes in the NodeNames form
                // also two at once (scheduler profiles or replicas sharing one scorer).
                let parallel: &[usize] = if form == "NodeNames" && mix == "repeat" {
                    &[1, 2]
                } else {
                    &[1]
                };
                for &conns in parallel {
                    let all = Instant::now();
                    let tasks: Vec<_> = (0..conns)
                        .map(|_| {
                            let (bodies, cache, seed) = (bodies.clone(), cache.clone(), rng.next());
                            let watch = form == "NodeNames";
                            tokio::spawn(async move {
                                let mut rng = Rng(seed | 1);
                                let mut conn = Conn::open(addr).await;
                                let mut times = Vec::with_capacity(rounds);
                                for r in 0..rounds / conns {
                                    if watch {
                                        // The previous decision's bind, as the node watch reports it.
                                        let i = (rng.next() % n as u64) as usize;
                                        let version = VERSION.fetch_add(1, Ordering::Relaxed);
                                        let changed =
                                            serde_json::from_value(node(i, &mut rng, version)).expect("node");
                                        cache.apply(&watcher::Event::Apply(changed));
                                    }
                                    let body = bodies[r % bodies.len()].as_bytes();
                                    let t = Instant::now();
                                    let (s1, _) = conn.request("POST", "/filter", body).await;
                                    let (s2, _) = conn.request("POST", "/prioritize", body).await;
                                    assert_eq!((s1, s2), (200, 200));
                                    times.push(t.elapsed().as_secs_f64() * 1000.0);
                                }
                                times
                            })
                        })
                        .collect();
                    let mut times = Vec::with_capacity(rounds);
                    for task in tasks {
                        times.extend(task.await.expect("bench connection"));
                    }
                    let per_sec = times.len() as f64 / all.elapsed().as_secs_f64();
                    times.sort_by(f64::total_cmp);
                    let label = if conns == 1 {
                        mix.to_string()
                    } else {
                        format!("{mix} x{conns}")
                    };
                    println!(
                        "{form:<10} {n:>5} {listed:>6} {label:<9} {:>8} {:>8.2} {:>8.2} {:>13.0}",
                        bodies[0].len() / 1024,
                        percentile(&times, 0.5),
                        percentile(&times, 0.99),
                        per_sec
                    );
                }
            }
        }
    }
}
