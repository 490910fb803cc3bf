//! GPU-aware preemption: of the victims kube-scheduler proposes on a node, keep only a set that frees
//! enough memory on ONE GPU (or enough idle GPUs), drawn from pods marked preemptible, with the fewest
//! PodDisruptionBudget violations, then the fewest pods.
//!
//! kube-scheduler picks victims by priority and CPU/memory only: it may propose pods spread over several
//! GPUs (freeing 4 GB on each of two GPUs does not host a 5 GB pod) or far more than the GPU needs.

use std::collections::BTreeMap;

use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::pods::PodRecord;
use super::state::{Demand, NodeSnapshot, PodDemand};

/// What the scorer knows of one proposed victim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VictimInfo {
    pub uid: String,
    /// `namespace/name`.
    pub key: String,
    pub preemptible: bool,
    /// Evicting it would violate a PodDisruptionBudget; `None` = unknown.
    pub violates_pdb: Option<bool>,
    /// GPU positions it uses on the node, and MiB on each (`None` = whole GPUs). Empty: no GPU.
    pub gpus: Vec<usize>,
    pub mib: Option<u64>,
}

impl VictimInfo {
    /// From what the scorer knows of the pod, on `node` (`unit_mib` from the node). The GPUs come from
    /// the pod's assigned-GPUs annotation, or else from the usage annotation's pod lists.
    pub fn from_record(pod: &PodRecord, node: &NodeSnapshot) -> VictimInfo {
        let mut gpus: Vec<usize> = pod
            .assigned_gpus
            .iter()
            .filter_map(|u| node.position_of(u))
            .collect();
        if gpus.is_empty() {
            gpus = (0..node.gpus().len())
                .filter(|&p| node.gpus()[p].pods.iter().any(|k| **k == *pod.key))
                .collect();
        }
        if pod.demand.is_none() {
            gpus.clear();
        }
        VictimInfo {
            uid: pod.uid.to_string(),
            key: pod.key.to_string(),
            preemptible: pod.preemptible,
            violates_pdb: None,
            gpus,
            mib: pod.memory_mib(node.unit_mib),
        }
    }
}

/// The victims to keep on one node (indices into `victims`, in their order) and their PDB violations;
/// `None` when preempting there cannot make room for `pod`'s GPUs from preemptible pods.
pub fn select_victims(
    node: &NodeSnapshot,
    pod: &PodDemand,
    victims: &[VictimInfo],
    num_pdb_violations: i64,
) -> Option<(Vec<usize>, i64)> {
    if node.problem.is_some() {
        return None;
    }
    // Victims without a GPU were proposed for CPU or memory: they stay, and must be preemptible.
    let cpu_victims: Vec<usize> = (0..victims.len())
        .filter(|&v| victims[v].gpus.is_empty())
        .collect();
    if cpu_victims.iter().any(|&v| !victims[v].preemptible) {
        return None;
    }
    let eligible: Vec<usize> = (0..node.gpus().len())
        .filter(|&p| node.gpus()[p].healthy && pod.allows_model(&node.gpus()[p].model))
        .collect();
    let on_gpu = |p: usize| -> Vec<usize> {
        (0..victims.len())
            .filter(|&v| victims[v].preemptible && victims[v].gpus.contains(&p))
            .collect()
    };
    let freed = |v: usize, p: usize| victims[v].mib.unwrap_or(node.gpus()[p].memory_mib);
    let cost = |set: &[usize]| {
        let bad = set
            .iter()
            .filter(|&&v| victims[v].violates_pdb == Some(true))
            .count();
        (bad, set.len())
    };
    // Cheapest first: pods that violate no PDB, then the biggest (fewest pods).
    let order = |p: usize, mut cands: Vec<usize>| {
        cands.sort_by_key(|&v| {
            (
                victims[v].violates_pdb == Some(true),
                std::cmp::Reverse(freed(v, p)),
            )
        });
        cands
    };
    let gpu_victims: Vec<usize> = match pod.demand {
        Demand::Memory { .. } => {
            let need = pod.memory_mib(node.unit_mib);
            let mut best: Option<Vec<usize>> = None;
            for &p in &eligible {
                let mut free = node.gpus()[p].free_mib();
                let mut set = Vec::new();
                for v in order(p, on_gpu(p)) {
                    if free >= need {
                        break;
                    }
                    free = free.saturating_add(freed(v, p));
                    set.push(v);
                }
                if free >= need && best.as_ref().is_none_or(|b| cost(&set) < cost(b)) {
                    best = Some(set);
                }
            }
            best?
        }
        Demand::Whole { count } => {
            // Each GPU that can become idle, with the victims that must go for it.
            let mut options: Vec<Vec<usize>> = Vec::new();
            for &p in &eligible {
                let g = &node.gpus()[p];
                let cands = on_gpu(p);
                let freeable: u64 = cands.iter().map(|&v| freed(v, p)).sum();
                if g.is_idle() {
                    options.push(Vec::new());
                } else if g.free_mib().saturating_add(freeable) >= g.memory_mib {
                    options.push(cands);
                }
            }
            if options.len() < count as usize {
                return None;
            }
            options.sort_by_key(|o| cost(o));
            let mut set: Vec<usize> = options.into_iter().take(count as usize).flatten().collect();
            set.sort_unstable();
            set.dedup();
            set
        }
    };
    let mut keep: Vec<usize> = cpu_victims.into_iter().chain(gpu_victims).collect();
    keep.sort_unstable();
    keep.dedup();
    let known = keep.iter().all(|&v| victims[v].violates_pdb.is_some());
    let violations = if known {
        keep.iter()
            .filter(|&&v| victims[v].violates_pdb == Some(true))
            .count() as i64
    } else {
        num_pdb_violations.min(keep.len() as i64)
    };
    Some((keep, violations))
}

/// Marks each victim that would violate a PodDisruptionBudget, as kube-scheduler decides it: in order,
/// a pod matching a PDB with no disruptions left violates it; otherwise it uses one up.
pub fn mark_pdb_violations(victims: &mut [VictimInfo], pods: &[&PodRecord], pdbs: &[PodDisruptionBudget]) {
    let mut allowed: Vec<i32> = pdbs
        .iter()
        .map(|p| p.status.as_ref().and_then(|s| s.disruptions_allowed).unwrap_or(0))
        .collect();
    for (v, pod) in victims.iter_mut().zip(pods) {
        let labels = pod.labels();
        let mut violates = false;
        for (i, pdb) in pdbs.iter().enumerate() {
            if pdb.metadata.namespace.as_deref() != Some(pod.namespace()) {
                continue;
            }
            let Some(selector) = pdb.spec.as_ref().and_then(|s| s.selector.as_ref()) else {
                continue;
            };
            if !selector_matches(selector, &labels) {
                continue;
            }
            if allowed[i] <= 0 {
                violates = true;
            } else {
                allowed[i] -= 1;
            }
        }
        v.violates_pdb = Some(violates);
    }
}

/// A label selector matches (an empty selector matches nothing for PDBs, as in kube-scheduler).
pub fn selector_matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let exprs = selector.match_expressions.as_deref().unwrap_or(&[]);
    let plain = selector.match_labels.as_ref();
    if exprs.is_empty() && plain.is_none_or(|m| m.is_empty()) {
        return false;
    }
    let labels_ok = plain.is_none_or(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)));
    labels_ok
        && exprs.iter().all(|e| {
            let values = e.values.as_deref().unwrap_or(&[]);
            let value = labels.get(&e.key);
            match e.operator.as_str() {
                "In" => value.is_some_and(|v| values.contains(v)),
                "NotIn" => value.is_none_or(|v| !values.contains(v)),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                _ => false,
            }
        })
}

#[cfg(test)]
mod tests {
    use super::super::state::{GpuSnapshot, TopologyNeed, WorkloadClass};
    use super::*;

    fn node(allocated: &[u64]) -> NodeSnapshot {
        let gpus = allocated
            .iter()
            .enumerate()
            .map(|(i, &a)| GpuSnapshot::for_tests(i, "m", 8192, a))
            .collect();
        NodeSnapshot::with_gpus("n", 1, gpus)
    }

    fn victim(uid: &str, gpu: usize, mib: u64, preemptible: bool, pdb: bool) -> VictimInfo {
        VictimInfo {
            uid: uid.into(),
            key: format!("ns/{uid}"),
            preemptible,
            violates_pdb: Some(pdb),
            gpus: vec![gpu],
            mib: Some(mib),
        }
    }

    fn pod(mib: u64) -> PodDemand {
        PodDemand {
            key: "ns/big".into(),
            uid: "big".into(),
            demand: Demand::Memory { units: mib },
            models: None,
            selection: None,
            topology: TopologyNeed::Any,
            class: WorkloadClass::Online,
            cpu_milli: 0,
            memory_mib: 0,
        }
    }

    #[test]
    fn keeps_only_victims_on_one_gpu() {
        // Both GPUs full with 4096 + 4096; a 5000 MiB pod needs both pods of ONE GPU gone.
        let n = node(&[8192, 8192]);
        let vs = [
            victim("a", 0, 4096, true, false),
            victim("b", 1, 4096, true, false),
            victim("c", 0, 4096, true, false),
        ];
        let (keep, pdb) = select_victims(&n, &pod(5000), &vs, 0).expect("GPU 0 can be freed");
        assert_eq!(keep, vec![0, 2]);
        assert_eq!(pdb, 0);
    }

    #[test]
    fn non_preemptible_and_pdb_violations_are_avoided() {
        let n = node(&[8192, 8192]);
        let vs = [
            victim("a", 0, 8192, false, false),
            victim("b", 1, 8192, true, true),
        ];
        assert_eq!(select_victims(&n, &pod(5000), &vs, 1), Some((vec![1], 1)));
        let vs = [victim("a", 0, 8192, false, false)];
        assert_eq!(
            select_victims(&n, &pod(5000), &vs, 0),
            None,
            "only a non-preemptible pod frees room"
        );
        let vs = [
            victim("x", 0, 8192, true, true),
            victim("y", 1, 8192, true, false),
        ];
        assert_eq!(
            select_victims(&n, &pod(5000), &vs, 1),
            Some((vec![1], 0)),
            "fewest PDB violations"
        );
    }

    #[test]
    fn pdb_selectors() {
        let sel: LabelSelector = serde_json::from_value(serde_json::json!({
            "matchLabels": {"app": "web"},
            "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]
        }))
        .expect("selector");
        let labels = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        assert!(selector_matches(&sel, &labels(&[("app", "web"), ("tier", "a")])));
        assert!(!selector_matches(&sel, &labels(&[("app", "web"), ("tier", "c")])));
        assert!(!selector_matches(
            &LabelSelector::default(),
            &labels(&[("app", "web")])
        ));
    }
}
