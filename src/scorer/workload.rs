//! The workload the scorer has seen: every GPU pod it decided on, counted once (by UID) once decided
//! (at its bind, or at a filter that leaves it no node), in the order they came, into the learner
//! `gpumem simulate` replays with ([`crate::alloc::mix`]): a decision never knows its own pod, and
//! `prioritize` and `bind` of one pod see the same mix. The
//! fragmentation-aware policy protects the mix learned from them; `typicalMix` in the configuration
//! is the prior until [`MixConfig::min_pods`] pods were seen. A restarted scorer first counts the GPU
//! pods bound in the cluster ([`Workload::observe_request`], from the pod cache), so it does not fall
//! back to the prior for the next hundred pods.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use super::config::ScorerConfig;
use super::state::{Demand, PodDemand};
use crate::alloc::{GpuDemand, MixConfig, ModelSet, OnlineMix, Request, TypicalMix};

/// Pod UIDs remembered, so that a pod ranked again (kube-scheduler retries, `bind` re-ranks) is
/// counted once; the oldest are forgotten first.
const REMEMBERED_PODS: usize = 100_000;

/// The mix policies are built from now, and its generation (a policy built at another is stale).
#[derive(Debug, Clone)]
pub struct CurrentMix {
    pub mix: Arc<TypicalMix>,
    pub generation: u64,
}

impl CurrentMix {
    /// A fixed mix (tests, and the fragmentation gauge of a scorer that has seen nothing).
    pub fn fixed(mix: TypicalMix) -> CurrentMix {
        CurrentMix {
            mix: Arc::new(mix),
            generation: 0,
        }
    }
}

pub struct Workload {
    inner: Mutex<Inner>,
}

struct Inner {
    online: OnlineMix,
    current: CurrentMix,
    seen: HashSet<String>,
    order: VecDeque<String>,
}

/// How the scorer learns: the simulator's defaults, with the configured window.
pub fn mix_config(cfg: &ScorerConfig) -> MixConfig {
    MixConfig {
        window: if cfg.mix_window_pods > 0.0 {
            cfg.mix_window_pods
        } else {
            f64::INFINITY
        },
        ..MixConfig::default()
    }
}

impl Workload {
    pub fn new(cfg: &ScorerConfig) -> Workload {
        let online = OnlineMix::new(mix_config(cfg), cfg.prior_mix());
        let current = CurrentMix::fixed(online.mix().clone());
        Workload {
            inner: Mutex::new(Inner {
                online,
                current,
                seen: HashSet::new(),
                order: VecDeque::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts `pod` (once per UID), asking `need_mib` of one GPU where it is a memory pod (the MiB
    /// its request is on the nodes it was ranked on).
    /// `models`: the models the pod is restricted to (the policy's scarcity term keeps them for
    /// such pods), `None` = any.
    pub fn observe(&self, pod: &PodDemand, need_mib: u64, models: Option<ModelSet>) {
        let request = request_of(pod, need_mib);
        let request = match models {
            Some(set) => request.with_models(set),
            None => request,
        };
        self.observe_request(&pod.uid, &request);
    }

    /// Counts the pod `uid` (once) asking for `request`.
    pub fn observe_request(&self, uid: &str, request: &Request) {
        let mut inner = self.lock();
        if !uid.is_empty() {
            if !inner.seen.insert(uid.to_string()) {
                return;
            }
            inner.order.push_back(uid.to_string());
            if inner.order.len() > REMEMBERED_PODS
                && let Some(oldest) = inner.order.pop_front()
            {
                inner.seen.remove(&oldest);
            }
        }
        inner.online.observe(request);
    }

    /// The mix to decide with now (moved on to the learned one when it drifted far enough).
    pub fn current(&self) -> CurrentMix {
        let mut inner = self.lock();
        if inner.online.refresh() {
            let generation = inner.online.generation();
            inner.current = CurrentMix {
                mix: Arc::new(inner.online.mix().clone()),
                generation,
            };
            tracing::debug!(
                generation,
                types = inner.current.mix.types.len(),
                seen = inner.online.learner().seen(),
                "typical mix moved"
            );
        }
        inner.current.clone()
    }

    /// Pods counted so far.
    /// Whether the pod `uid` was counted already.
    pub fn counted(&self, uid: &str) -> bool {
        self.lock().seen.contains(uid)
    }

    pub fn seen(&self) -> u64 {
        self.lock().online.learner().seen()
    }
}

/// `pod` in the placement policy's terms, asking `need_mib` of one GPU if it is a memory pod: what
/// the policy ranks, and what the learned mix counts ([`super::workload`]). Allowed models are not
/// carried: the policy reads them from the node's eligible GPUs.
pub fn request_of(pod: &PodDemand, need_mib: u64) -> Request {
    request(pod.demand, need_mib, pod.cpu_milli, pod.memory_mib)
}

/// The policy's request for a GPU `demand` of `need_mib` on one GPU (memory pods) with these CPU and
/// memory requests.
pub fn request(demand: Demand, need_mib: u64, cpu_milli: u64, memory_mib: u64) -> Request {
    Request {
        cpu_milli,
        memory_mib,
        gpu: match demand {
            Demand::Memory { .. } => GpuDemand::Shared {
                amount: u32::try_from(need_mib).unwrap_or(u32::MAX),
            },
            Demand::Whole { count } => GpuDemand::Whole { count },
        },
        models: None,
        pools: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::GpuDemand;
    use crate::scorer::state::{Demand, TopologyNeed, WorkloadClass};

    fn pod(uid: &str, units: u64) -> PodDemand {
        PodDemand {
            key: format!("ns/{uid}"),
            uid: uid.into(),
            demand: Demand::Memory { units },
            models: None,
            selection: None,
            topology: TopologyNeed::Any,
            class: WorkloadClass::Offline,
            cpu_milli: 4000,
            memory_mib: 8192,
        }
    }

    #[test]
    fn the_configured_mix_holds_until_enough_pods_were_seen_then_the_learned_one() {
        let cfg = ScorerConfig::default();
        let workload = Workload::new(&cfg);
        let prior = workload.current();
        assert_eq!(*prior.mix, cfg.prior_mix());
        assert!(prior.mix.all.is_empty(), "the configured mix has no 'all types'");
        let min = mix_config(&cfg).min_pods;
        for i in 0..min - 1 {
            workload.observe(&pod(&format!("p{i}"), 7000), 7000, None);
            assert_eq!(
                workload.current().generation,
                0,
                "still the prior after {} pods",
                i + 1
            );
        }
        // Seen again (a retry, or bind ranking it once more): not counted.
        workload.observe(&pod("p0", 7000), 7000, None);
        assert_eq!(workload.seen(), min - 1);
        workload.observe(&pod("last", 3000), 3000, None);
        let learned = workload.current();
        assert_eq!(learned.generation, 1);
        let seven = learned.mix.types.first().expect("a type");
        assert_eq!(
            (seven.gpu, seven.cpu_milli, seven.memory_mib),
            (GpuDemand::Shared { amount: 7000 }, 4000, 8192)
        );
        assert_eq!(
            learned.mix.all.len(),
            2,
            "every type seen, for the policy's scarcity and reserve terms"
        );
        let share: f64 = learned.mix.all.iter().map(|t| t.popularity).sum();
        assert!((share - 1.0).abs() < 1e-9, "{share}");
    }

    #[test]
    fn a_pod_without_uid_still_counts_and_old_uids_are_forgotten() {
        let workload = Workload::new(&ScorerConfig::default());
        workload.observe(&pod("", 1000), 1000, None);
        workload.observe(&pod("", 1000), 1000, None);
        assert_eq!(workload.seen(), 2);
        for i in 0..REMEMBERED_PODS + 1 {
            workload.observe(&pod(&format!("u{i}"), 1000), 1000, None);
        }
        // The first UID was forgotten: seen again, it counts again.
        workload.observe(&pod("u0", 1000), 1000, None);
        assert_eq!(workload.seen(), 2 + REMEMBERED_PODS as u64 + 2);
    }

    #[test]
    fn the_window_comes_from_the_configuration() {
        let mut cfg = ScorerConfig::default();
        assert_eq!(mix_config(&cfg).window, 5000.0);
        cfg.mix_window_pods = 0.0;
        assert!(mix_config(&cfg).window.is_infinite());
        cfg.mix_window_pods = -1.0;
        assert!(cfg.validate().is_err());
    }
}
