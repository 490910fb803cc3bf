//! The cluster's fragmentation and allocation, for the scorer's gauges.

use super::super::state::NodeSnapshot;
use crate::alloc::{self, Gpu, ModelTable, TypicalMix};

/// The cluster's GPU memory picture, for the gauges.
#[derive(Debug, Clone, PartialEq)]
pub struct Fragmentation {
    /// Share of the idle GPU memory (healthy GPUs) that the typical mix cannot use, over all nodes.
    pub cluster: f64,
    /// The same per node (0 for a node with no idle GPU memory); nodes with bad annotations are left out.
    pub nodes: Vec<(String, f64)>,
    /// Allocated GPU memory over total, on healthy GPUs.
    pub allocated: f64,
}

/// The fragmentation of `nodes` by the shared policy's measure ([`alloc::frag`], FGD's, against `mix`,
/// the one the policy protects), as a share of idle GPU memory; and the allocated share. Unhealthy GPUs
/// and nodes with bad annotations count nowhere.
pub fn fragmentation(nodes: &[&NodeSnapshot], mix: &TypicalMix) -> Fragmentation {
    let mut models = ModelTable::default();
    let view: Vec<(&str, alloc::Node)> = nodes
        .iter()
        .filter(|n| n.problem.is_none())
        .map(|n| {
            let healthy = || n.gpus().iter().filter(|g| g.healthy);
            let model = healthy()
                .next()
                .and_then(|g| models.intern(&g.model).ok())
                .unwrap_or(0);
            let gpus = healthy()
                .map(|g| Gpu {
                    capacity: u32::try_from(g.memory_mib).unwrap_or(u32::MAX),
                    free: u32::try_from(g.free_mib()).unwrap_or(u32::MAX),
                })
                .collect();
            let node = alloc::Node::new(String::new(), model, n.cpu_milli, n.memory_mib, gpus);
            (n.name.as_str(), node)
        })
        .collect();
    let model = alloc::FragModel::new(mix, &models, false);
    let (mut frag, mut free, mut capacity) = (0.0, 0u64, 0u64);
    let mut per_node = Vec::with_capacity(view.len());
    for (name, node) in &view {
        let f = model.node_frag(node);
        let idle = node.gpu_free_total();
        frag += f;
        free += idle;
        capacity += node.gpu_capacity_total();
        per_node.push((name.to_string(), if idle == 0 { 0.0 } else { f / idle as f64 }));
    }
    let ratio = |a: f64, b: u64| if b == 0 { 0.0 } else { a / b as f64 };
    Fragmentation {
        cluster: ratio(frag, free),
        nodes: per_node,
        allocated: ratio(capacity.saturating_sub(free) as f64, capacity),
    }
}
