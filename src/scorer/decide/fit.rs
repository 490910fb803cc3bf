//! Which nodes can host a pod, and why not: per-GPU fit of memory, models, health, idle GPUs and
//! the topology a multi-GPU pod asks for.

use super::super::state::{Demand, NodeSnapshot, PodDemand, bounded_reason};
use super::topology::*;
use crate::alloc::GpuMask;

/// Why a node cannot host the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub reason: String,
    /// A short metric label.
    pub category: &'static str,
    /// Preemption cannot help either.
    pub unresolvable: bool,
}

impl Rejection {
    pub fn new(reason: String, category: &'static str, unresolvable: bool) -> Rejection {
        Rejection {
            reason: bounded_reason(reason),
            category,
            unresolvable,
        }
    }
}

/// A node that can host the pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// MiB on one GPU (memory requests), 0 for whole GPUs.
    pub need_mib: u64,
    /// GPU positions the pod may use (healthy, of an allowed model).
    pub eligible: GpuMask,
    /// For several whole GPUs: the best set meeting the topology need, and its pair score.
    pub set: Option<(Vec<usize>, u64)>,
}

/// Can `node` host `pod`? Looks only at GPUs: kube-scheduler checks CPU, memory, taints and affinity.
/// Runs for every candidate node of every call: it allocates only to explain a rejection.
pub fn check(node: &NodeSnapshot, pod: &PodDemand) -> Result<Fit, Rejection> {
    if let Some(problem) = &node.problem {
        return Err(Rejection::new(problem.clone(), "bad_annotation", true));
    }
    if node.gpus().is_empty() {
        return Err(Rejection::new("node has no GPUs".into(), "no_gpu", true));
    }
    // Node states never hold more than MAX_GPUS_PER_NODE GPUs (see `state`), so a mask holds them all.
    // Most pods accept any model: then the node's summary answers without reading its GPUs.
    let summary = node.summary();
    let (allowed, eligible) = match pod.models {
        None => (node.gpus().len(), summary.healthy),
        Some(_) => allowed_models(node, pod),
    };
    if allowed == 0 {
        let mut models: Vec<&str> = node.gpus().iter().map(|g| g.model.as_str()).collect();
        models.dedup();
        return Err(Rejection::new(
            format!(
                "no GPU of an allowed type: pod allows {}, node has {}",
                pod.models.as_ref().map_or(String::new(), |m| m.join(", ")),
                models.join(", ")
            ),
            "gpu_type",
            true,
        ));
    }
    if eligible.is_empty() {
        return Err(Rejection::new(
            format!("all {allowed} GPU(s) of an allowed type are unhealthy"),
            "unhealthy",
            true,
        ));
    }
    let note = || match allowed - eligible.count() as usize {
        0 => String::new(),
        unhealthy => format!(" ({unhealthy} unhealthy GPU(s) not counted)"),
    };
    match pod.demand {
        Demand::Memory { .. } => {
            let need = pod.memory_mib(node.unit_mib);
            let largest = if eligible == summary.healthy {
                summary.largest_free_mib
            } else {
                eligible
                    .iter()
                    .map(|p| node.gpus()[p].free_mib())
                    .max()
                    .unwrap_or(0)
            };
            if largest >= need {
                return Ok(Fit {
                    need_mib: need,
                    eligible,
                    set: None,
                });
            }
            let biggest = eligible
                .iter()
                .map(|p| node.gpus()[p].memory_mib)
                .max()
                .unwrap_or(0);
            let (extra, unresolvable) = if biggest < need {
                (
                    format!("; no GPU here has that much memory (largest: {biggest} MiB)"),
                    true,
                )
            } else {
                (String::new(), false)
            };
            Err(Rejection::new(
                format!(
                    "largest free GPU has {largest} MiB, pod needs {need} MiB{extra}{}",
                    note()
                ),
                "gpu_memory",
                unresolvable,
            ))
        }
        Demand::Whole { count } => {
            let n = count as usize;
            let idle = GpuMask(eligible.0 & summary.idle.0);
            let idle_count = idle.count() as usize;
            if idle_count < n {
                return Err(Rejection::new(
                    format!(
                        "pod needs {n} idle GPU(s), node has {idle_count} idle GPU(s) of an allowed type{}",
                        note()
                    ),
                    "idle_gpus",
                    (eligible.count() as usize) < n,
                ));
            }
            let set = if n > 1 {
                let idle: Vec<usize> = idle.iter().collect();
                match topology_set(node, &idle, n, pod.topology) {
                    Some(set) => Some(set),
                    None => {
                        return Err(Rejection::new(
                            format!(
                                "pod needs {n} idle GPUs{}, none of the sets of the {idle_count} idle GPUs qualifies",
                                pod.topology.describe(),
                            ),
                            "topology",
                            false,
                        ));
                    }
                }
            } else {
                None
            };
            Ok(Fit {
                need_mib: 0,
                eligible,
                set,
            })
        }
    }
}

/// How many of `node`'s GPUs are of a model `pod` allows, and which of those are healthy.
pub(super) fn allowed_models(node: &NodeSnapshot, pod: &PodDemand) -> (usize, GpuMask) {
    let mut allowed = 0usize;
    let mut eligible = GpuMask::EMPTY;
    let mut last: Option<(&str, bool)> = None;
    for (p, g) in node.gpus().iter().enumerate() {
        // A node's GPUs are mostly of one model: compare each model once.
        let ok = match last {
            Some((m, ok)) if m == g.model => ok,
            _ => pod.allows_model(&g.model),
        };
        last = Some((&g.model, ok));
        if ok {
            allowed += 1;
            if g.healthy {
                eligible = eligible.with(p);
            }
        }
    }
    (allowed, eligible)
}
