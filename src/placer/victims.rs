//! Preemption for gated pods: kube-scheduler never runs its preemption for a pod that still carries a
//! scheduling gate, so a gated pod that fits nowhere would wait behind pods of lower priority for good.
//! The placer chooses the victims itself, by GPU room: on one node, the pods of lower priority whose
//! shares, given back, let all of the pod's claims fit there. Pure: the controller reads the holders,
//! evicts them and holds the freed room for the pod.
//!
//! As on the extender path, a victim is a pod of lower priority that offers itself for preemption
//! (`gpumem.io/preemptible: "true"`); one that a PodDisruptionBudget protects is not taken (the
//! Eviction API would refuse). As kube-scheduler's DefaultPreemption: on each node all the candidates
//! are taken out, then as many as possible are reprieved, the most valuable first (online, higher
//! priority, smaller). Between nodes, the set with the fewest online pods wins, then the lowest highest
//! priority, then the fewest pods, then the least memory freed.

use std::sync::Arc;

use super::claims::AllocatedShare;
use crate::scorer::pods::PodRecord;
use crate::scorer::state::NodeSnapshot;

/// A pod holding gpumem shares on a node: a possible victim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub uid: String,
    /// `namespace/name`: its shares' owner.
    pub key: String,
    pub priority: i32,
    /// Marked `gpumem.io/preemptible`.
    pub preemptible: bool,
    /// Of the offline class.
    pub offline: bool,
    /// A PodDisruptionBudget allows no disruption of it.
    pub protected: bool,
    pub shares: Vec<AllocatedShare>,
}

impl Holder {
    /// MiB it holds on `state` (a whole GPU counts its memory).
    fn mib(&self, state: &NodeSnapshot) -> u64 {
        self.shares
            .iter()
            .map(|s| {
                let whole = || {
                    state
                        .gpus()
                        .iter()
                        .find(|g| g.index == s.index)
                        .map_or(0, |g| g.memory_mib)
                };
                s.mib.unwrap_or_else(whole)
            })
            .sum()
    }
}

/// The holders of `shares` (one node's) among `pods` (the pods bound there that may be preempted, each
/// with whether it is of the offline class). A share no such pod holds (a claim being written, or not
/// reserved) has no holder: it is not a victim's.
pub fn holders_of(shares: &[&AllocatedShare], pods: &[(Arc<PodRecord>, bool)]) -> Vec<Holder> {
    let mut out: Vec<Holder> = Vec::new();
    for (record, offline) in pods {
        let held: Vec<AllocatedShare> = shares
            .iter()
            .filter(|s| *s.owner == *record.key)
            .map(|s| (*s).clone())
            .collect();
        if held.is_empty() {
            continue;
        }
        out.push(Holder {
            uid: record.uid.to_string(),
            key: record.key.to_string(),
            priority: record.priority,
            preemptible: record.preemptible,
            offline: *offline,
            protected: false,
            shares: held,
        });
    }
    out
}

/// `state` with the GPUs `held` for a pod that preempted (by NVML index) out of use: a pod of no
/// higher priority than that one does not take them while its victims end.
pub fn hold(state: &NodeSnapshot, held: &[u32]) -> NodeSnapshot {
    let mut state = state.clone();
    for gpu in state.gpus_mut().iter_mut() {
        gpu.healthy &= !held.contains(&gpu.index);
    }
    state
}

/// `state` with the shares of `gone` given back.
pub fn without(state: &NodeSnapshot, gone: &[&Holder]) -> NodeSnapshot {
    let mut state = state.clone();
    let mut gpus = state.gpus_mut();
    for holder in gone {
        for share in &holder.shares {
            let Some(gpu) = gpus.iter_mut().find(|g| g.index == share.index) else {
                continue;
            };
            match share.mib.filter(|&m| m < gpu.memory_mib) {
                Some(m) => gpu.allocated_mib = gpu.allocated_mib.saturating_sub(m),
                None => {
                    gpu.whole = false;
                    gpu.allocated_mib = 0;
                }
            }
            gpu.pods.retain(|p| *p != holder.key);
        }
    }
    drop(gpus);
    state
}

/// The victims chosen: the node (an index into the nodes given) and its holders that must go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    pub node: usize,
    pub holders: Vec<usize>,
}

/// Why no victims were chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoVictims {
    /// No preemptible pod of lower priority holds room the pod could use.
    None,
    /// Only pods that PodDisruptionBudgets protect would make room (their keys, a few).
    Protected(Vec<String>),
}

impl std::fmt::Display for NoVictims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoVictims::None => write!(
                f,
                "evicting preemptible pods of lower priority would not make room"
            ),
            NoVictims::Protected(keys) => write!(
                f,
                "only evicting pods that a PodDisruptionBudget protects would make room ({})",
                keys.join(", ")
            ),
        }
    }
}

/// How many nodes with a set of victims are compared before one is chosen (kube-scheduler stops at
/// 100 candidates, or 10% of the nodes, too).
pub const NODES_COMPARED: usize = 100;

/// The victims for a pod of `priority` that fits nowhere: on each node of `nodes` (its state and
/// holders), `fits(node, state)` says whether the pod's claims fit on that node in `state`.
pub fn choose(
    priority: i32,
    nodes: &[(&NodeSnapshot, &[Holder])],
    mut fits: impl FnMut(usize, &NodeSnapshot) -> bool,
) -> Result<Chosen, NoVictims> {
    let mut best: Option<((usize, i32, usize, u64), Chosen)> = None;
    let mut protected: Vec<String> = Vec::new();
    let mut compared = 0;
    for (n, (state, holders)) in nodes.iter().enumerate() {
        let lower: Vec<usize> = (0..holders.len())
            .filter(|&h| holders[h].priority < priority && holders[h].preemptible)
            .collect();
        let mut taken: Vec<usize> = lower.iter().copied().filter(|&h| !holders[h].protected).collect();
        let refs = |set: &[usize]| set.iter().map(|&h| &holders[h]).collect::<Vec<_>>();
        if taken.is_empty() || !fits(n, &without(state, &refs(&taken))) {
            if lower.len() > taken.len() {
                let everyone = without(state, &refs(&lower));
                if fits(n, &everyone) {
                    protected.extend(
                        lower
                            .iter()
                            .filter(|&&h| holders[h].protected)
                            .map(|&h| holders[h].key.clone()),
                    );
                }
            }
            continue;
        }
        // Reprieve the most valuable first: online, higher priority, smaller.
        let mut order = taken.clone();
        order.sort_by_key(|&h| {
            let v = &holders[h];
            (v.offline, std::cmp::Reverse(v.priority), v.mib(state))
        });
        for h in order {
            let rest: Vec<usize> = taken.iter().copied().filter(|&t| t != h).collect();
            if fits(n, &without(state, &refs(&rest))) {
                taken = rest;
            }
        }
        let cost = (
            taken.iter().filter(|&&h| !holders[h].offline).count(),
            taken
                .iter()
                .map(|&h| holders[h].priority)
                .max()
                .unwrap_or(i32::MIN),
            taken.len(),
            taken.iter().map(|&h| holders[h].mib(state)).sum::<u64>(),
        );
        if best.as_ref().is_none_or(|(c, _)| cost < *c) {
            best = Some((
                cost,
                Chosen {
                    node: n,
                    holders: taken,
                },
            ));
        }
        compared += 1;
        if compared >= NODES_COMPARED {
            break;
        }
    }
    match best {
        Some((_, victims)) => Ok(victims),
        None if !protected.is_empty() => {
            protected.sort();
            protected.dedup();
            protected.truncate(5);
            Err(NoVictims::Protected(protected))
        }
        None => Err(NoVictims::None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::state::GpuSnapshot;

    /// A node of 16 GiB GPUs, each holding the given holders' MiB.
    fn node(name: &str, gpus: &[&[(&str, u64)]]) -> NodeSnapshot {
        let gpus = gpus
            .iter()
            .enumerate()
            .map(|(i, held)| {
                let mut g = GpuSnapshot::for_tests(i, "T4", 16384, held.iter().map(|(_, m)| m).sum());
                g.pods = held.iter().map(|(k, _)| format!("ns/{k}")).collect();
                g
            })
            .collect();
        NodeSnapshot::with_gpus(name, 1, gpus)
    }

    fn holder(name: &str, node: &str, gpu: u32, mib: u64, priority: i32) -> Holder {
        Holder {
            uid: format!("uid-{name}"),
            key: format!("ns/{name}"),
            priority,
            preemptible: true,
            offline: true,
            protected: false,
            shares: vec![AllocatedShare {
                node: node.into(),
                index: gpu,
                mib: Some(mib),
                owner: format!("ns/{name}"),
            }],
        }
    }

    /// A pod of `need` MiB on one GPU fits.
    fn fits_mib(need: u64) -> impl FnMut(usize, &NodeSnapshot) -> bool {
        move |_, s| s.gpus().iter().any(|g| g.healthy && g.free_mib() >= need)
    }

    fn keys(nodes: &[(&NodeSnapshot, &[Holder])], v: &Chosen) -> Vec<String> {
        v.holders
            .iter()
            .map(|&h| nodes[v.node].1[h].key.clone())
            .collect()
    }

    #[test]
    fn the_fewest_lower_priority_pods_on_one_gpu_go() {
        // GPU 0: 8000 + 8000; GPU 1: 4000 + 4000 + 4000 + 4000. 12000 MiB needs one pod of GPU 0 gone
        // (8000 + the 384 free is not enough: both of GPU 0, or three of GPU 1; GPU 0's two are fewer).
        let n = node(
            "a",
            &[
                &[("p", 8000), ("q", 8000)],
                &[("r", 4000), ("s", 4000), ("t", 4000), ("u", 4000)],
            ],
        );
        let hs: Vec<Holder> = [
            ("p", 0, 8000),
            ("q", 0, 8000),
            ("r", 1, 4000),
            ("s", 1, 4000),
            ("t", 1, 4000),
            ("u", 1, 4000),
        ]
        .iter()
        .map(|&(k, g, m)| holder(k, "a", g, m, 0))
        .collect();
        let nodes = [(&n, hs.as_slice())];
        let v = choose(1000, &nodes, fits_mib(12000)).expect("room can be made");
        assert_eq!(keys(&nodes, &v), vec!["ns/p", "ns/q"]);
        // 8000 MiB: one pod of GPU 0 is enough.
        let v = choose(1000, &nodes, fits_mib(8000)).expect("room can be made");
        assert_eq!(v.holders.len(), 1);
        assert!(keys(&nodes, &v)[0] == "ns/p" || keys(&nodes, &v)[0] == "ns/q");
    }

    #[test]
    fn pods_of_equal_or_higher_priority_unmarked_and_protected_pods_stay() {
        let n = node("a", &[&[("p", 16384)]]);
        let equal = [holder("p", "a", 0, 16384, 1000)];
        assert_eq!(
            choose(1000, &[(&n, &equal)], fits_mib(4000)),
            Err(NoVictims::None)
        );
        let mut unmarked = [holder("p", "a", 0, 16384, 0)];
        unmarked[0].preemptible = false;
        assert_eq!(
            choose(1000, &[(&n, &unmarked)], fits_mib(4000)),
            Err(NoVictims::None),
            "a pod that does not offer itself stays"
        );
        let mut protected = [holder("p", "a", 0, 16384, 0)];
        protected[0].protected = true;
        assert_eq!(
            choose(1000, &[(&n, &protected)], fits_mib(4000)),
            Err(NoVictims::Protected(vec!["ns/p".into()]))
        );
        let other = node("b", &[&[("x", 16384)]]);
        let free = [holder("x", "b", 0, 16384, 0)];
        let nodes = [(&n, protected.as_slice()), (&other, free.as_slice())];
        let v = choose(1000, &nodes, fits_mib(4000)).expect("node b's pod may go");
        assert_eq!((v.node, keys(&nodes, &v)), (1, vec!["ns/x".to_string()]));
    }

    #[test]
    fn offline_pods_and_lower_priorities_go_first() {
        // Two nodes, one GPU each, full: an online pod of priority 0 or an offline one of 500.
        let a = node("a", &[&[("online", 16384)]]);
        let b = node("b", &[&[("spare", 16384)]]);
        let mut online = [holder("online", "a", 0, 16384, 0)];
        online[0].offline = false;
        let spare = [holder("spare", "b", 0, 16384, 500)];
        let nodes = [(&a, online.as_slice()), (&b, spare.as_slice())];
        assert_eq!(choose(1000, &nodes, fits_mib(16384)).map(|v| v.node), Ok(1));
        // Between two offline pods, the lower priority goes.
        let mut low = [holder("low", "a", 0, 16384, 10)];
        low[0].offline = true;
        let high = [holder("high", "b", 0, 16384, 20)];
        let nodes = [(&a, low.as_slice()), (&b, high.as_slice())];
        assert_eq!(choose(1000, &nodes, fits_mib(16384)).map(|v| v.node), Ok(0));
    }

    #[test]
    fn a_share_belongs_to_the_bound_pod_its_claim_is_reserved_for() {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "train", "namespace": "ns", "uid": "u-train",
                         "labels": {"gpumem.io/preemptible": "true"}},
            "spec": {"nodeName": "a", "priority": 1000, "containers": []}
        }))
        .expect("pod");
        let record = Arc::new(PodRecord::from_pod(&pod).expect("bound"));
        let share = |owner: &str, index: u32| AllocatedShare {
            node: "a".into(),
            index,
            mib: Some(4000),
            owner: owner.into(),
        };
        let (mine, theirs, unreserved) = (share("ns/train", 0), share("ns/other", 1), share("ns/claim:c", 2));
        let holders = holders_of(&[&mine, &theirs, &unreserved], &[(record, true)]);
        assert_eq!(holders.len(), 1);
        let h = &holders[0];
        assert_eq!(
            (h.uid.as_str(), h.key.as_str(), h.priority),
            ("u-train", "ns/train", 1000)
        );
        assert!(h.preemptible && h.offline && !h.protected);
        assert_eq!(h.shares, vec![mine.clone()]);
    }

    #[test]
    fn taking_the_shares_out_frees_their_gpus() {
        let n = node("a", &[&[("p", 5000), ("q", 3000)], &[("w", 16384)]]);
        let p = holder("p", "a", 0, 5000, 0);
        let mut w = holder("w", "a", 1, 16384, 0);
        w.shares[0].mib = None;
        let after = without(&n, &[&p, &w]);
        assert_eq!(after.gpus()[0].allocated_mib, 3000);
        assert_eq!(after.gpus()[0].pods, vec!["ns/q".to_string()]);
        assert!(after.gpus()[1].is_idle());
        assert_eq!(n.gpus()[0].allocated_mib, 8000, "the state given is not changed");
    }
}
