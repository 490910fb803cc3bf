//! `gpumem simulate --bench`: how long one placement decision (score every node, pick one) takes.
//!
//! Each policy first fills the cluster to 90% arrived workload with the trace (a realistic, fragmented
//! state), then decides for requests sampled from the trace without binding them: *warm* reuses one
//! policy instance (the simulator's and a long-lived scorer's case: caches valid), *cold* builds a new
//! instance for every decision (a stateless scorer answering one request).

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::Result;
use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg64Mcg;

use super::replay;
use super::trace::Trace;
use crate::alloc::{self, Candidate, TieBreak, TypicalMix};

#[derive(Debug, Clone)]
pub struct BenchRow {
    pub policy: &'static str,
    pub warm_us: f64,
    pub cold_us: f64,
    pub decisions: usize,
}

pub fn run(
    trace: &Trace,
    policies: &[&'static str],
    mix: &TypicalMix,
    decisions: usize,
    seed: u64,
) -> Result<Vec<BenchRow>> {
    let decisions = decisions.max(1);
    let mut rows = Vec::new();
    for &name in policies {
        let mut cluster = trace.cluster.clone();
        let mut policy = super::variants::build_policy(name, &cluster, mix)
            .ok_or_else(|| anyhow::anyhow!("unknown policy {name}"))?;
        let mut rng = Pcg64Mcg::seed_from_u64(seed);
        let mut out: Vec<Candidate> = Vec::with_capacity(cluster.nodes.len());
        let target = 0.9 * cluster.gpu_capacity_total() as f64;
        let mut arrived = 0u64;
        let (pods, ranks) = replay::workload_and_ranks(trace, seed, 1.3);
        let tie = TieBreak::Rank(&ranks);
        for req in pods {
            if arrived as f64 >= target {
                break;
            }
            arrived += trace.units(&req);
            alloc::place(policy.as_mut(), &mut cluster, &req, tie, &mut rng, &mut out)?;
        }
        let sample: Vec<_> = (0..decisions)
            .map(|_| trace.pods[rng.random_range(0..trace.pods.len())])
            .collect();
        let mut chosen = 0usize;
        let t = Instant::now();
        for req in &sample {
            policy.score(&cluster, req, &mut rng, &mut out);
            chosen += usize::from(alloc::select(&out, tie, &mut rng).is_some());
        }
        let warm_us = t.elapsed().as_secs_f64() * 1e6 / decisions as f64;
        let cold_n = (decisions / 10).max(1);
        let t = Instant::now();
        for req in sample.iter().take(cold_n) {
            let mut fresh = super::variants::build_policy(name, &cluster, mix)
                .ok_or_else(|| anyhow::anyhow!("unknown policy {name}"))?;
            fresh.score(&cluster, req, &mut rng, &mut out);
            chosen += usize::from(alloc::select(&out, tie, &mut rng).is_some());
        }
        let cold_us = t.elapsed().as_secs_f64() * 1e6 / cold_n as f64;
        tracing::debug!(policy = name, chosen, "bench done");
        rows.push(BenchRow {
            policy: name,
            warm_us,
            cold_us,
            decisions,
        });
    }
    Ok(rows)
}

pub fn table(trace: &Trace, rows: &[BenchRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "One decision over {} nodes ({} GPUs), cluster filled to 90% arrived, {} requests sampled from {}:",
        trace.cluster.nodes.len(),
        trace.cluster.gpu_count(),
        rows.first().map_or(0, |r| r.decisions),
        trace.name
    );
    let w = rows.iter().map(|r| r.policy.len() + 1).max().unwrap_or(0).max(14);
    let _ = writeln!(
        s,
        "{:<w$}{:>14}{:>16}{:>14}{:>16}",
        "policy", "warm us/dec", "warm dec/s", "cold us/dec", "cold dec/s"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<w$}{:>14.1}{:>16.0}{:>14.1}{:>16.0}",
            r.policy,
            r.warm_us,
            1e6 / r.warm_us.max(1e-9),
            r.cold_us,
            1e6 / r.cold_us.max(1e-9)
        );
    }
    s
}
