//! The pod/node mix of a scale run. The generator itself (zones, the GPU taint, reserved nodes, pods
//! that select a zone or a GPU model) is `gpumem::sim::realistic`, shared with `gpumem simulate --mix
//! realistic`; here is how a pod's model choice is said to the API server ([`Select`]).

use std::collections::BTreeMap;

pub use gpumem::sim::realistic::{
    GPU_TAINT, LARGE_MIB, MEMORY_LABEL, Mix, Model, NodeShape, PRODUCT_LABEL, RESERVED_TAINT, Shape,
    T4_PRODUCT, ZONE_LABEL, node_shapes,
};

use crate::played::{DRA_DRIVER, MEM_UNIT_MIB, NodeModel};

/// How a pod's model choice reads on each path.
pub trait Select {
    /// The CEL selector of a claim's request on the DRA path.
    fn cel(self) -> String;
    /// The node selector entries and node affinity match expressions on the device-plugin path.
    fn node_selection(self) -> (BTreeMap<String, String>, Vec<serde_json::Value>);
    /// Whether a node with `labels` passes [`Select::node_selection`], as kube-scheduler reads it.
    fn admits_node(self, labels: &BTreeMap<String, String>) -> bool;
}

impl Select for Model {
    /// The CEL selector of a claim's request on the DRA path, on the attribute and capacity the
    /// agent's ResourceSlice publishes (`node::slice::resource_slice_spec`).
    fn cel(self) -> String {
        let driver = DRA_DRIVER;
        match self {
            Model::T4 => format!(r#"device.attributes["{driver}"].productName == "{T4_PRODUCT}""#),
            Model::Large => format!(
                r#"device.capacity["{driver}"].{}.compareTo(quantity("{}Gi")) >= 0"#,
                gpumem::node::slice::MEMORY_CAPACITY,
                LARGE_MIB / 1024
            ),
        }
    }

    /// On the device-plugin path, as a user of device plugins would say it: the T4 by the product
    /// label (a node selector), 40Gi+ by the memory label (node affinity: a node selector cannot
    /// compare). Returns (nodeSelector entries, node affinity match expressions).
    fn node_selection(self) -> (BTreeMap<String, String>, Vec<serde_json::Value>) {
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
    fn admits_node(self, labels: &BTreeMap<String, String>) -> bool {
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
                    m.admits_node(&gpumem::node::labels(&n.inventory, MEM_UNIT_MIB))
                }
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem::sim::realistic::T4_MIB;

    fn model(name: &str) -> NodeModel {
        NodeModel::of_profile(name)
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
                driver: DRA_DRIVER,
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
