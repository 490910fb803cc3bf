//! The agent, played for API-only nodes: no kubelet and no agent run there, so when a pod is bound to
//! one of them this module chooses its GPUs as the agent would and renders the node's
//! `gpumem.io/gpu-usage` annotation the way the agent does ([`gpumem::agent::state::NodeState::usage`]).
//!
//! Choices, as the agent makes them:
//! - the scorer's choice (`gpumem.io/assigned-gpus`, GPU UUIDs) when it still fits;
//! - otherwise memory by best fit on one GPU ([`gpumem::alloc::local::best_fit_gpu`]) among GPUs not
//!   held whole, and whole GPUs as the best-connected set of GPUs with nothing allocated
//!   ([`gpumem::alloc::local::best_gpu_set`]).
//!
//! A pod that fits no GPU of its node is a misfit: kube-scheduler alone checks only the node's sums
//! of `nvidia.com/gpu-mem` and `nvidia.com/gpu`, and the agent (through the kubelet's admission)
//! would fail the pod. A misfit holds nothing here.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use gpumem::alloc::local::{self, FreeMemory, PairScores};
use gpumem::gpu::GpuInventory;
use gpumem::node::{GpuMode, TopologyAnnotation, UsageAnnotation};

use crate::trace::Size;

/// Memory unit of `nvidia.com/gpu-mem` (the agent's default).
pub const MEM_UNIT_MIB: u64 = 1;
/// The DRA driver's name, as the agent publishes it (the chart's default `dra.driverName`).
pub const DRA_DRIVER: &str = "gpumem.io";

/// What a node's GPUs are: shared by all nodes of one profile.
pub struct NodeModel {
    pub profile: String,
    pub inventory: GpuInventory,
    pub scores: PairScores,
    pub by_uuid: HashMap<String, usize>,
    /// The topology annotation the agent writes (every GPU healthy): the same for every node.
    pub topology: TopologyAnnotation,
}

impl NodeModel {
    /// The model of a built-in profile (tests).
    #[cfg(test)]
    pub fn of_profile(name: &str) -> Self {
        let profile = gpumem_profile::Profile::load(name).expect("a built-in profile");
        Self::new(name, GpuInventory::discover(&profile).expect("its inventory"))
    }

    pub fn new(profile: &str, inventory: GpuInventory) -> Self {
        let scores = PairScores::of(&inventory);
        let by_uuid = inventory.positions_by_uuid();
        let topology = TopologyAnnotation::new(&inventory, MEM_UNIT_MIB, |_| true);
        Self {
            profile: profile.to_string(),
            topology,
            inventory,
            scores,
            by_uuid,
        }
    }

    /// The node's GPU memory, MiB.
    pub fn total_mib(&self) -> u64 {
        self.inventory.gpus.iter().map(|g| g.memory_mib).sum()
    }
}

/// One GPU's allocations: pods holding memory (MiB each), or the one pod holding it whole.
#[derive(Debug, Clone, Default)]
struct GpuBook {
    shares: BTreeMap<String, u64>,
    whole: Option<String>,
}

/// What one pod holds.
#[derive(Debug, Clone)]
struct Held {
    gpus: Vec<usize>,
    size: Size,
}

/// One node's books.
pub struct NodeBook {
    pub model: Arc<NodeModel>,
    gpus: Vec<GpuBook>,
    pods: HashMap<String, Held>,
}

/// How a bound pod was served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// GPUs (positions) chosen; `followed` when they are the scorer's choice.
    Placed { gpus: Vec<usize>, followed: bool },
    /// No GPU of the node can serve it.
    Misfit,
    /// Already placed (a repeated event).
    Known,
}

impl NodeBook {
    pub fn new(model: Arc<NodeModel>) -> Self {
        let gpus = vec![GpuBook::default(); model.inventory.gpus.len()];
        Self {
            model,
            gpus,
            pods: HashMap::new(),
        }
    }

    fn free_mib(&self, a: usize) -> u64 {
        let used: u64 = self.gpus[a].shares.values().sum();
        self.model.inventory.gpus[a].memory_mib.saturating_sub(used)
    }

    fn idle(&self, a: usize) -> bool {
        self.gpus[a].whole.is_none() && self.gpus[a].shares.is_empty()
    }

    fn fits(&self, gpus: &[usize], size: Size) -> bool {
        match size {
            Size::Share { mib } => {
                gpus.len() == 1 && self.gpus[gpus[0]].whole.is_none() && self.free_mib(gpus[0]) >= mib
            }
            Size::Whole { count } => {
                gpus.len() == count as usize
                    && gpus.iter().collect::<BTreeSet<_>>().len() == gpus.len()
                    && gpus.iter().all(|&a| self.idle(a))
            }
        }
    }

    /// The agent's own choice.
    fn choose(&self, size: Size) -> Option<Vec<usize>> {
        match size {
            Size::Share { mib } => {
                let candidates: Vec<FreeMemory> = (0..self.gpus.len())
                    .filter(|&a| self.gpus[a].whole.is_none())
                    .map(|a| FreeMemory {
                        gpu: a,
                        free: self.free_mib(a),
                    })
                    .collect();
                local::best_fit_gpu(&candidates, mib).map(|a| vec![a])
            }
            Size::Whole { count } => {
                let available: Vec<usize> = (0..self.gpus.len()).filter(|&a| self.idle(a)).collect();
                local::best_gpu_set(&self.model.scores, &available, &[], count as usize).ok()
            }
        }
    }

    /// Pod `key` (`namespace/name`) is bound here asking for `size`; `assigned` is the scorer's
    /// choice (GPU UUIDs), if any.
    pub fn bind(&mut self, key: &str, size: Size, assigned: Option<&str>) -> Outcome {
        if self.pods.contains_key(key) {
            return Outcome::Known;
        }
        let preferred: Option<Vec<usize>> = assigned.and_then(|list| {
            list.split(',')
                .map(|u| self.model.by_uuid.get(u.trim()).copied())
                .collect()
        });
        let (gpus, followed) = match preferred.filter(|g| self.fits(g, size)) {
            Some(g) => (g, true),
            None => match self.choose(size) {
                Some(g) => (g, false),
                None => return Outcome::Misfit,
            },
        };
        for &a in &gpus {
            match size {
                Size::Share { mib } => {
                    self.gpus[a].shares.insert(key.to_string(), mib);
                }
                Size::Whole { .. } => self.gpus[a].whole = Some(key.to_string()),
            }
        }
        self.pods.insert(
            key.to_string(),
            Held {
                gpus: gpus.clone(),
                size,
            },
        );
        Outcome::Placed { gpus, followed }
    }

    /// Pod `key` is gone; true if it held anything here.
    pub fn release(&mut self, key: &str) -> bool {
        let Some(held) = self.pods.remove(key) else {
            return false;
        };
        for a in held.gpus {
            match held.size {
                Size::Share { .. } => {
                    self.gpus[a].shares.remove(key);
                }
                Size::Whole { .. } => self.gpus[a].whole = None,
            }
        }
        true
    }

    /// The usage annotation, as the agent renders it: per GPU the pods there (sorted), mode, and
    /// MiB allocated (a whole GPU counts all its memory).
    pub fn usage(&self) -> UsageAnnotation {
        let mut usage = UsageAnnotation::idle(&self.model.inventory);
        for (a, u) in usage.gpus.iter_mut().enumerate() {
            let book = &self.gpus[a];
            let pods: BTreeSet<&String> = book.whole.iter().chain(book.shares.keys()).collect();
            u.pods = pods.into_iter().cloned().collect();
            (u.mode, u.allocated_mib) = if book.whole.is_some() {
                (GpuMode::Whole, self.model.inventory.gpus[a].memory_mib)
            } else if !book.shares.is_empty() {
                (GpuMode::Shared, book.shares.values().sum())
            } else {
                (GpuMode::Free, 0)
            };
        }
        usage
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_profile::Profile;

    fn book(profile: &str) -> NodeBook {
        let inv = GpuInventory::discover(&Profile::load(profile).unwrap()).unwrap();
        NodeBook::new(Arc::new(NodeModel::new(profile, inv)))
    }

    #[test]
    fn best_fit_then_misfit_when_only_the_sum_fits() {
        // t4x4: 4 x T4; each GPU's memory from the profile.
        let mut b = book("t4x4");
        let per_gpu = b.model.inventory.gpus[0].memory_mib;
        // 3/4 of each GPU: four pods, one per GPU.
        let big = per_gpu * 3 / 4;
        for i in 0..4 {
            assert!(matches!(
                b.bind(&format!("ns/p{i}"), Size::Share { mib: big }, None),
                Outcome::Placed { .. }
            ));
        }
        // The node's sum still has a whole GPU's worth free, no GPU has half of one: a misfit.
        assert!(4 * (per_gpu - big) >= per_gpu / 2);
        assert_eq!(
            b.bind("ns/half", Size::Share { mib: per_gpu / 2 }, None),
            Outcome::Misfit
        );
        // A small one goes to the tightest GPU (best fit: all equal, lowest position).
        assert_eq!(
            b.bind("ns/small", Size::Share { mib: 10 }, None),
            Outcome::Placed {
                gpus: vec![0],
                followed: false
            }
        );
        assert_eq!(
            b.bind("ns/small2", Size::Share { mib: 10 }, None),
            Outcome::Placed {
                gpus: vec![0],
                followed: false
            }
        );
        // No GPU is idle: a whole GPU is a misfit too.
        assert_eq!(b.bind("ns/w", Size::Whole { count: 1 }, None), Outcome::Misfit);
        assert_eq!(b.bind("ns/small", Size::Share { mib: 10 }, None), Outcome::Known);
        assert!(b.release("ns/p1"));
        assert!(!b.release("ns/p1"));
        assert_eq!(
            b.bind("ns/w", Size::Whole { count: 1 }, None),
            Outcome::Placed {
                gpus: vec![1],
                followed: false
            }
        );
    }

    #[test]
    fn follows_the_scorers_choice_when_it_fits() {
        let mut b = book("dgx-a100");
        let uuid = |a: usize| b.model.inventory.gpus[a].uuid.clone();
        let (u5, u6) = (uuid(5), uuid(6));
        assert_eq!(
            b.bind("ns/a", Size::Share { mib: 1000 }, Some(&u5)),
            Outcome::Placed {
                gpus: vec![5],
                followed: true
            }
        );
        // GPU 5 is shared now: the scorer's pair no longer fits, the agent picks two idle GPUs.
        match b.bind("ns/b", Size::Whole { count: 2 }, Some(&format!("{u5},{u6}"))) {
            Outcome::Placed { gpus, followed } => {
                assert!(!followed);
                assert_eq!(gpus.len(), 2);
                assert!(!gpus.contains(&5), "{gpus:?}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            b.bind("ns/c", Size::Share { mib: 1000 }, Some("GPU-unknown")),
            Outcome::Placed {
                gpus: vec![5],
                followed: false
            }
        );
    }

    #[test]
    fn usage_parses_back_as_the_agent_writes_it() {
        let mut b = book("mixed");
        b.bind("ns/s1", Size::Share { mib: 3000 }, None);
        b.bind("ns/s2", Size::Share { mib: 2000 }, None);
        b.bind("ns/w", Size::Whole { count: 1 }, None);
        let usage = b.usage();
        let json = gpumem::node::annotations(
            &gpumem::node::TopologyAnnotation::new(&b.model.inventory, 1, |_| true),
            &usage,
        )[gpumem::node::USAGE_ANNOTATION]
            .clone();
        let parsed = UsageAnnotation::parse(&json).unwrap();
        assert_eq!(parsed, usage);
        let shared: Vec<_> = parsed.gpus.iter().filter(|g| g.mode == GpuMode::Shared).collect();
        assert_eq!(shared.len(), 1);
        assert_eq!(shared[0].allocated_mib, 5000);
        assert_eq!(shared[0].pods, vec!["ns/s1".to_string(), "ns/s2".to_string()]);
        let whole: Vec<_> = parsed.gpus.iter().filter(|g| g.mode == GpuMode::Whole).collect();
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].pods, vec!["ns/w".to_string()]);
        assert_eq!(
            whole[0].allocated_mib,
            b.model.inventory.gpus[whole[0].index as usize].memory_mib
        );
        b.release("ns/w");
        b.release("ns/s1");
        b.release("ns/s2");
        assert_eq!(b.usage(), UsageAnnotation::idle(&b.model.inventory));
    }
}
