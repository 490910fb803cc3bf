//! The ranking: the shared policy's scores over the kept view, blended with the workload class
//! (spread or pack) and, for multi-GPU pods, the topology of the chosen set.

use super::super::config::ScorerConfig;
use super::super::state::{Demand, NodeSnapshot, PodDemand, WorkloadClass};
use super::super::workload::CurrentMix;
use super::super::workload::request_of;
use super::fit::*;
use super::view::*;
use crate::alloc::GpuMask;
use rand::SeedableRng;
use std::sync::Arc;

/// One feasible node's ranking.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// `MIN_EXTENDER_PRIORITY..=MAX_EXTENDER_PRIORITY`.
    pub score: i64,
    /// The blend before rounding, 0..=1.
    pub raw: f64,
    /// GPU positions the pod would get.
    pub gpus: GpuMask,
}

/// Ranks `nodes` for `pod`: a score for each node that can host it ([`check`]), `None` for the others.
/// The online weight follows the share of GPU memory allocated over `nodes`. `cache` keeps the
/// policy's view between calls (a fresh [`PolicyCache`] gives the same answers, only slower).
pub fn prioritize(
    nodes: &[Arc<NodeSnapshot>],
    pod: &PodDemand,
    cfg: &ScorerConfig,
    cache: &PolicyCache,
    mix: &CurrentMix,
) -> Vec<Option<Scored>> {
    let mut fits: Vec<(usize, Fit)> = Vec::new();
    let (mut used, mut total) = (0u64, 0u64);
    // The view stays locked until the end: the ranking reads GPU figures from it (compact, and just
    // read by the policy), not from the node states.
    let mut view = cache.view.lock().unwrap_or_else(|e| e.into_inner());
    view.calls += 1;
    view.forget_gone();
    // Each fit's position in the view; a node listed twice is scored once, for its first listing.
    let mut at_of: Vec<u32> = Vec::with_capacity(nodes.len());
    let mut repeated: Vec<(usize, usize)> = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        if n.problem.is_none() {
            let s = n.summary();
            (used, total) = (used + s.allocated_mib, total + s.total_mib);
        }
        if let Ok(fit) = check(n, pod) {
            let at = view.place(n, &fit, pod);
            let k = fits.len();
            match view.first_fit(at) {
                Some(first) => repeated.push((k, first)),
                None => {
                    let len = view.cluster.nodes.len();
                    view.first.resize(len, NOT_LISTED);
                    view.first[at as usize] = k as u32;
                }
            }
            at_of.push(at);
            fits.push((i, fit));
        }
    }
    let mut policy_score: Vec<Option<(f64, GpuMask)>> = vec![None; fits.len()];
    // Nodes with different memory units turn one request into different MiB: one policy run per amount.
    let mut needs: Vec<u64> = fits.iter().map(|(_, f)| f.need_mib).collect();
    needs.sort_unstable();
    needs.dedup();
    let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(1);
    let mut out = Vec::new();
    for need in needs {
        // Ascending positions, as `score_nodes` takes them: a scan of the view, cheaper than a sort.
        let members: Vec<u32> = (0..view.first.len() as u32)
            .filter(|&at| view.first_fit(at).is_some_and(|k| fits[k].1.need_mib == need))
            .collect();
        let req = request_of(pod, need);
        let Some(at) = view.policy(need, cfg, mix) else {
            continue;
        };
        let View {
            cluster, policies, ..
        } = &mut *view;
        policies[at]
            .policy
            .score_nodes(cluster, &members, &req, &mut rng, &mut out);
        for c in &out {
            if let Some(k) = view.first_fit(c.node) {
                policy_score[k] = Some((c.score, c.gpus));
            }
        }
    }
    for &(k, first) in &repeated {
        if fits[k].1.need_mib == fits[first].1.need_mib {
            policy_score[k] = policy_score[first];
        }
    }
    for &at in &at_of {
        view.first[at as usize] = NOT_LISTED;
    }
    let load = if total == 0 {
        0.0
    } else {
        used as f64 / total as f64
    };
    let (lo, hi) = policy_score
        .iter()
        .flatten()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (s, _)| {
            (lo.min(*s), hi.max(*s))
        });
    let best_set = fits
        .iter()
        .filter_map(|(_, f)| f.set.as_ref().map(|(_, s)| *s))
        .max()
        .unwrap_or(0);
    let class_weight = match pod.class {
        WorkloadClass::Online if load > cfg.hot_threshold => cfg.hot_online_weight,
        WorkloadClass::Online => cfg.online_weight,
        WorkloadClass::Offline => cfg.offline_weight,
    }
    .clamp(0.0, 1.0);
    let mut ranked: Vec<Option<Scored>> = vec![None; nodes.len()];
    for (((i, fit), policy), at) in fits.iter().zip(policy_score).zip(at_of) {
        ranked[*i] = Some({
            let n = &nodes[*i];
            // The node as the view holds it: the GPUs the pod may use have their free memory.
            let view_gpus = &view.cluster.nodes[at as usize].gpus;
            let free = |p: usize| u64::from(view_gpus[p].free);
            let memory = |p: usize| u64::from(view_gpus[p].capacity);
            let (policy_term, policy_gpus) = match policy {
                Some((s, gpus)) if hi > lo => ((s - lo) / (hi - lo), gpus),
                Some((_, gpus)) => (1.0, gpus),
                None => (0.0, GpuMask::EMPTY),
            };
            let gpus = match (&fit.set, pod.demand) {
                (Some((set, _)), _) => set.iter().fold(GpuMask::EMPTY, |m, &p| m.with(p)),
                _ if !policy_gpus.is_empty() => policy_gpus,
                (None, Demand::Memory { .. }) => fit
                    .eligible
                    .iter()
                    .filter(|&p| free(p) >= fit.need_mib)
                    .min_by_key(|&p| (free(p), p))
                    .map_or(GpuMask::EMPTY, GpuMask::single),
                (None, Demand::Whole { count }) => GpuMask(fit.eligible.0 & n.summary().idle.0)
                    .iter()
                    .take(count as usize)
                    .fold(GpuMask::EMPTY, GpuMask::with),
            };
            // How much room the placement leaves: on the GPU used (memory), on the node (whole GPUs).
            let room = match pod.demand {
                Demand::Memory { .. } => gpus.iter().next().map_or(0.0, |p| {
                    free(p).saturating_sub(fit.need_mib) as f64 / memory(p).max(1) as f64
                }),
                Demand::Whole { .. } => {
                    let total: u64 = fit.eligible.iter().map(memory).sum();
                    let taken: u64 = gpus.iter().map(memory).sum();
                    let free: u64 = fit.eligible.iter().map(free).sum();
                    free.saturating_sub(taken) as f64 / total.max(1) as f64
                }
            };
            let class_term = match pod.class {
                WorkloadClass::Online => room,
                WorkloadClass::Offline => 1.0 - room,
            };
            let base = match &fit.set {
                Some((_, s)) if best_set > 0 => 0.5 * policy_term + 0.5 * (*s as f64 / best_set as f64),
                _ => policy_term,
            };
            let raw = (class_weight * class_term + (1.0 - class_weight) * base).clamp(0.0, 1.0);
            let score = (raw * super::super::extender::MAX_EXTENDER_PRIORITY as f64).round() as i64;
            Scored { score, raw, gpus }
        });
    }
    ranked
}
