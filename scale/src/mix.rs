//! The pod/node mix. `trace`: the openb trace's sizes on nodes that carry only the scale label and
//! taint (the runs measured so far). `realistic` adds what a real GPU fleet has (docs/scale.md, "What
//! is measured"): zones, the GPU nodes' taint, a tenth of the nodes reserved for training, and pods
//! that select a zone or a GPU model.

use std::collections::BTreeMap;

use clap::ValueEnum;
use rand::seq::SliceRandom;
use rand::{RngExt as _, SeedableRng};
use rand_pcg::Pcg64Mcg;
use serde::Serialize;

use crate::played::NodeModel;
use crate::trace::Size;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mix {
    /// The trace's sizes; nodes with only the scale label and taint.
    #[default]
    Trace,
    /// Zones, the GPU taint, reserved nodes, pods selecting a zone or a GPU model.
    Realistic,
}

impl Mix {
    pub fn as_str(self) -> &'static str {
        match self {
            Mix::Trace => "trace",
            Mix::Realistic => "realistic",
        }
    }
}

/// The well-known zone label, and the zones the nodes are spread over (round robin by node number).
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
pub const ZONES: [&str; 3] = ["zone-a", "zone-b", "zone-c"];
/// The taint users put on GPU nodes to keep other pods off them; every realistic-mix pod tolerates it.
pub const GPU_TAINT: (&str, &str) = ("nvidia.com/gpu", "present");
/// Nodes kept for training: only the multi-GPU pods tolerate it.
pub const RESERVED_TAINT: (&str, &str) = ("gpumem.io/reserved", "training");
/// Share of the nodes reserved, percent (rounded to whole nodes).
pub const RESERVED_PERCENT: usize = 10;
/// Of the pods, one in this many selects a zone.
pub const ZONE_ONE_IN: u32 = 3;
/// Of the share pods, one in this many selects a GPU model.
pub const MODEL_ONE_IN: u32 = 4;

/// The agent's product name of the T4, and its memory (the `t4x4` and `mixed` profiles).
pub const T4_PRODUCT: &str = "Tesla T4";
pub const T4_MIB: u64 = 15_360;
/// The "large GPU" choice: at least this much memory (40Gi).
pub const LARGE_MIB: u64 = 40 * 1024;
/// The node label with the product (`node::labels`: `mixed` on a node of several models).
pub const PRODUCT_LABEL: &str = "nvidia.com/gpu.product";
/// The node label with the memory of the node's smallest GPU, MiB (`node::labels`).
pub const MEMORY_LABEL: &str = "nvidia.com/gpu.memory";

/// What one scale node carries beyond the scale label and taint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeShape {
    pub zone: Option<&'static str>,
    /// Carries [`GPU_TAINT`].
    pub gpu_taint: bool,
    /// Carries [`RESERVED_TAINT`].
    pub reserved: bool,
}

/// The shapes of `nodes` nodes (index i = `scale-node-{i+1}`): zones round robin, and
/// [`RESERVED_PERCENT`] of the nodes, chosen by `seed`, reserved. All default in the trace mix.
pub fn node_shapes(mix: Mix, nodes: usize, seed: u64) -> Vec<NodeShape> {
    if mix == Mix::Trace {
        return vec![NodeShape::default(); nodes];
    }
    let mut shapes: Vec<NodeShape> = (0..nodes)
        .map(|i| NodeShape {
            zone: Some(ZONES[i % ZONES.len()]),
            gpu_taint: true,
            reserved: false,
        })
        .collect();
    let mut order: Vec<usize> = (0..nodes).collect();
    // Its own stream: the profiles' placement (seeded by `seed` itself) stays as it was.
    order.shuffle(&mut Pcg64Mcg::seed_from_u64(seed ^ 0x7265_7365_7276_6564));
    let reserved = (nodes * RESERVED_PERCENT + 50) / 100;
    for &i in &order[..reserved] {
        shapes[i].reserved = true;
    }
    shapes
}

/// A GPU model a pod selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Model {
    /// A Tesla T4.
    #[serde(rename = "t4")]
    T4,
    /// A GPU of 40Gi or more (A100 80GB, H100 in the default profiles).
    #[serde(rename = "40gi+")]
    Large,
}

impl Model {
    pub const ALL: [Model; 2] = [Model::T4, Model::Large];

    pub fn as_str(self) -> &'static str {
        match self {
            Model::T4 => "t4",
            Model::Large => "40gi+",
        }
    }

    /// The CEL selector of a claim's request on the DRA path, on the attribute and capacity the
    /// agent's ResourceSlice publishes (`node::slice::resource_slice_spec`).
    pub fn cel(self) -> String {
        let driver = crate::k8s::DRA_DRIVER;
        match self {
            Model::T4 => format!(r#"device.attributes["{driver}"].productName == "{T4_PRODUCT}""#),
            Model::Large => format!(
                r#"device.capacity["{driver}"].{}.compareTo(quantity("{}Gi")) >= 0"#,
                gpumem::node::slice::MEMORY_CAPACITY,
                LARGE_MIB / 1024
            ),
        }
    }

    /// Whether the CEL selector picks a GPU of `product` with `memory_mib` (1 MiB units: the
    /// slice's memory capacity is the GPU's memory).
    pub fn admits_gpu(self, product: &str, memory_mib: u64) -> bool {
        match self {
            Model::T4 => product == T4_PRODUCT,
            Model::Large => memory_mib >= LARGE_MIB,
        }
    }

    /// On the device-plugin path, as a user of device plugins would say it: the T4 by the product
    /// label (a node selector), 40Gi+ by the memory label (node affinity: a node selector cannot
    /// compare). Returns (nodeSelector entries, node affinity match expressions).
    pub fn node_selection(self) -> (BTreeMap<String, String>, Vec<serde_json::Value>) {
        match self {
            Model::T4 => (
                BTreeMap::from([(PRODUCT_LABEL.to_string(), gpumem::node::label_value(T4_PRODUCT))]),
                Vec::new(),
            ),
            Model::Large => (
                BTreeMap::new(),
                vec![serde_json::json!({"key": MEMORY_LABEL, "operator": "Gt",
                                        "values": [(LARGE_MIB - 1).to_string()]})],
            ),
        }
    }

    /// Whether a node with `labels` passes [`Model::node_selection`], as kube-scheduler reads it.
    pub fn admits_node(self, labels: &BTreeMap<String, String>) -> bool {
        let (selector, expressions) = self.node_selection();
        let selected = selector.iter().all(|(k, v)| labels.get(k) == Some(v));
        let affine = expressions.iter().all(|e| {
            let key = e["key"].as_str().unwrap_or("");
            let bound = e["values"][0].as_str().and_then(|v| v.parse::<i64>().ok());
            let value = labels.get(key).and_then(|v| v.parse::<i64>().ok());
            e["operator"] == "Gt" && matches!((value, bound), (Some(v), Some(b)) if v > b)
        });
        selected && affine
    }
}

/// The models no node of the mix can serve: on the DRA path a GPU must match the CEL selector, on
/// the device-plugin path a node must match the labels. A pod choosing one would never bind.
pub fn unservable(models: &[&NodeModel], dra: bool) -> Vec<Model> {
    Model::ALL
        .into_iter()
        .filter(|&m| {
            !models.iter().any(|n| {
                if dra {
                    n.inventory
                        .gpus
                        .iter()
                        .any(|g| m.admits_gpu(&g.product, g.memory_mib))
                } else {
                    m.admits_node(&gpumem::node::labels(&n.inventory, crate::k8s::MEM_UNIT_MIB))
                }
            })
        })
        .collect()
}

/// What one pod asks beyond its size. All empty in the trace mix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shape {
    /// Runs only in this zone (a node selector).
    pub zone: Option<&'static str>,
    /// Runs only on this GPU model (a claim's CEL selector, or node labels on the device-plugin path).
    pub model: Option<Model>,
    /// Tolerates [`GPU_TAINT`].
    pub tolerate_gpu: bool,
    /// Tolerates [`RESERVED_TAINT`].
    pub tolerate_reserved: bool,
}

/// FNV-1a: a hash that stays the same across Rust releases (std's does not promise to).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Shape {
    /// The shape of pod `name` of `size`: drawn from (`seed`, `name`) alone, so a pod gets the same
    /// shape whatever order the concurrent creates go out in. One pod in [`ZONE_ONE_IN`] selects a
    /// zone; one share in [`MODEL_ONE_IN`] a model, half of them the T4 (if it fits one), the others
    /// 40Gi+; every pod tolerates the GPU taint, multi-GPU pods the reserved one too.
    pub fn of(mix: Mix, seed: u64, name: &str, size: Size) -> Shape {
        if mix == Mix::Trace {
            return Shape::default();
        }
        let mut rng = Pcg64Mcg::seed_from_u64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ fnv1a(name));
        let zoned = rng.random_ratio(1, ZONE_ONE_IN);
        let zone = ZONES[rng.random_range(0..ZONES.len())];
        let choosing = rng.random_ratio(1, MODEL_ONE_IN);
        let t4 = rng.random_ratio(1, 2);
        let model = match size {
            Size::Share { mib } if choosing => Some(if t4 && mib <= T4_MIB {
                Model::T4
            } else {
                Model::Large
            }),
            _ => None,
        };
        Shape {
            zone: zoned.then_some(zone),
            model,
            tolerate_gpu: true,
            tolerate_reserved: matches!(size, Size::Whole { count } if count >= 2),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str) -> NodeModel {
        NodeModel::of_profile(name)
    }

    #[test]
    fn nodes_are_zoned_round_robin_and_a_tenth_reserved_by_the_seed() {
        let shapes = node_shapes(Mix::Realistic, 1000, 1);
        assert_eq!(shapes, node_shapes(Mix::Realistic, 1000, 1));
        assert_ne!(shapes, node_shapes(Mix::Realistic, 1000, 2));
        for (i, zone) in ZONES.iter().enumerate() {
            let n = shapes.iter().filter(|s| s.zone == Some(zone)).count();
            assert_eq!(n, if i == 0 { 334 } else { 333 }, "{zone}");
        }
        assert_eq!(shapes.iter().filter(|s| s.reserved).count(), 100);
        // Reserved nodes are spread, not the first hundred.
        assert!(shapes[..100].iter().filter(|s| s.reserved).count() < 30);
        assert_eq!(
            node_shapes(Mix::Realistic, 7, 1)
                .iter()
                .filter(|s| s.reserved)
                .count(),
            1
        );
        assert_eq!(node_shapes(Mix::Trace, 5, 1), vec![NodeShape::default(); 5]);
    }

    #[test]
    fn pod_shapes_are_seeded_per_name_in_the_stated_proportions() {
        let share = Size::Share { mib: 4096 };
        let names: Vec<String> = (0..6000).map(|i| format!("steady-{i:06}")).collect();
        let shapes: Vec<Shape> = names
            .iter()
            .map(|n| Shape::of(Mix::Realistic, 1, n, share))
            .collect();
        assert_eq!(shapes[17], Shape::of(Mix::Realistic, 1, &names[17], share));
        assert!(
            (0..50).any(|i| shapes[i] != Shape::of(Mix::Realistic, 2, &names[i], share)),
            "another seed, other shapes"
        );
        let zoned = shapes.iter().filter(|s| s.zone.is_some()).count();
        assert!((1800..2200).contains(&zoned), "a third zoned: {zoned}");
        for zone in ZONES {
            let n = shapes.iter().filter(|s| s.zone == Some(zone)).count();
            assert!((500..800).contains(&n), "{zone}: {n}");
        }
        let t4 = shapes.iter().filter(|s| s.model == Some(Model::T4)).count();
        let large = shapes.iter().filter(|s| s.model == Some(Model::Large)).count();
        assert!(
            (1300..1700).contains(&(t4 + large)),
            "a quarter choose: {t4} + {large}"
        );
        assert!(
            (600..900).contains(&t4) && (600..900).contains(&large),
            "{t4} / {large}"
        );
        assert!(shapes.iter().all(|s| s.tolerate_gpu && !s.tolerate_reserved));
        // A share too big for a T4 never chooses one; whole GPUs choose no model.
        for n in &names[..400] {
            let big = Shape::of(Mix::Realistic, 1, n, Size::Share { mib: T4_MIB + 1 });
            assert_ne!(big.model, Some(Model::T4));
            let whole = Shape::of(Mix::Realistic, 1, n, Size::Whole { count: 1 });
            assert_eq!((whole.model, whole.tolerate_reserved), (None, false));
            let multi = Shape::of(Mix::Realistic, 1, n, Size::Whole { count: 2 });
            assert!(multi.tolerate_reserved && multi.tolerate_gpu && multi.model.is_none());
        }
        assert_eq!(Shape::of(Mix::Trace, 1, &names[0], share), Shape::default());
    }

    #[test]
    fn the_cel_names_what_the_agents_slice_publishes() {
        assert_eq!(
            Model::T4.cel(),
            r#"device.attributes["gpumem.io"].productName == "Tesla T4""#
        );
        assert_eq!(
            Model::Large.cel(),
            r#"device.capacity["gpumem.io"].memory.compareTo(quantity("40Gi")) >= 0"#
        );
        let m = model("mixed");
        let spec = gpumem::node::slice::resource_slice_spec(
            &m.inventory,
            &gpumem::node::slice::SliceInputs {
                driver: crate::k8s::DRA_DRIVER,
                node: "n",
                unit_mib: 1,
                healthy: &[true; 4],
                pcie_roots: &[],
                generation: 1,
            },
        );
        let devices = serde_json::to_value(spec.devices.unwrap()).unwrap();
        let products: Vec<&str> = devices
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["attributes"]["productName"]["string"].as_str().unwrap())
            .collect();
        assert!(products.contains(&T4_PRODUCT), "{products:?}");
        assert!(devices[0]["capacity"]["memory"]["value"].is_string(), "{devices}");
        let t4 = m.inventory.gpus.iter().find(|g| g.product == T4_PRODUCT).unwrap();
        assert_eq!(t4.memory_mib, T4_MIB);
    }

    #[test]
    fn node_labels_select_only_nodes_whose_every_gpu_is_the_model() {
        for profile in ["t4x4", "mixed", "dgx-a100", "hgx-h100"] {
            let m = model(profile);
            let labels = gpumem::node::labels(&m.inventory, 1);
            for model in Model::ALL {
                if model.admits_node(&labels) {
                    assert!(
                        m.inventory
                            .gpus
                            .iter()
                            .all(|g| model.admits_gpu(&g.product, g.memory_mib)),
                        "{profile} selected for {model:?} has another GPU"
                    );
                }
            }
        }
        let admitted = |profile: &str| {
            let labels = gpumem::node::labels(&model(profile).inventory, 1);
            Model::ALL
                .into_iter()
                .filter(|m| m.admits_node(&labels))
                .collect::<Vec<_>>()
        };
        assert_eq!(admitted("t4x4"), [Model::T4]);
        assert_eq!(admitted("dgx-a100"), [Model::Large]);
        assert_eq!(admitted("hgx-h100"), [Model::Large]);
        assert_eq!(admitted("mixed"), []);
    }

    #[test]
    fn a_mix_without_a_model_is_refused() {
        let (t4, mixed, a100) = (model("t4x4"), model("mixed"), model("dgx-a100"));
        assert!(unservable(&[&t4, &a100], false).is_empty());
        assert!(unservable(&[&t4, &a100], true).is_empty());
        assert_eq!(unservable(&[&t4], false), [Model::Large]);
        // The mixed node's T4s serve a claim's selector; its `mixed` product label no node selector.
        assert_eq!(unservable(&[&mixed, &a100], true), []);
        assert_eq!(unservable(&[&mixed, &a100], false), [Model::T4]);
    }
}
