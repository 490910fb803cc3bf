//! The kube-scheduler extender protocol (`k8s.io/kube-scheduler/extender/v1`), on the wire.
//!
//! The Go types carry no JSON tags, so their field names are the JSON keys (`Pod`, `NodeNames`,
//! `FailedNodes`, ...), and Go's decoder matches keys case-insensitively: so do we on input (a key
//! given twice in different case: the last one wins, as in Go). What we write uses the exact Go names.
//! The embedded `v1.Pod` / `v1.Node` objects are ordinary Kubernetes JSON.
//!
//! In the `Nodes` form (`nodeCacheCapable: false`) the nodes are kept as raw JSON text ([`RawValue`]):
//! decoding a request only finds where each node starts and ends, the scorer reads from a node only what
//! it needs (and only when it has not seen those exact bytes before), and a filter answer hands back
//! exactly the bytes kube-scheduler sent.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::Pod;
use serde::Serialize;
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

/// The score range an extender answers in (`MinExtenderPriority` / `MaxExtenderPriority`).
pub const MIN_EXTENDER_PRIORITY: i64 = 0;
pub const MAX_EXTENDER_PRIORITY: i64 = 10;

/// Implements `Deserialize` for a struct whose fields all have defaults, matching each Go key
/// case-insensitively; a JSON `null` leaves the default, unknown keys are skipped (as Go does).
macro_rules! case_insensitive {
    ($ty:ident { $($field:ident : $fty:ty => $key:literal),* $(,)? }) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> Visitor<'de> for V {
                    type Value = $ty;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str(concat!("a JSON object (", stringify!($ty), ")"))
                    }
                    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<$ty, A::Error> {
                        let mut out = $ty::default();
                        while let Some(key) = map.next_key::<String>()? {
                            $(
                                if key.eq_ignore_ascii_case($key) {
                                    let value: Option<$fty> = map.next_value()?;
                                    out.$field = value.unwrap_or_default();
                                    continue;
                                }
                            )*
                            map.next_value::<IgnoredAny>()?;
                        }
                        Ok(out)
                    }
                }
                d.deserialize_map(V)
            }
        }
    };
}

/// `ExtenderArgs`: the body of `filter` and `prioritize`.
#[derive(Debug, Clone, Default)]
pub struct ExtenderArgs {
    pub pod: Option<Pod>,
    /// Set when `nodeCacheCapable` is false: the candidate nodes, in full.
    pub nodes: Option<NodeList>,
    /// Set when `nodeCacheCapable` is true: the candidate node names.
    pub node_names: Option<Vec<String>>,
}

case_insensitive!(ExtenderArgs {
    pod: Option<Pod> => "Pod",
    nodes: Option<NodeList> => "Nodes",
    node_names: Option<Vec<String>> => "NodeNames",
});

/// A `v1.NodeList`, its items kept as raw JSON text.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NodeList {
    #[serde(skip_serializing_if = "Option::is_none", rename = "apiVersion")]
    pub api_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub metadata: serde_json::Value,
    pub items: Vec<Box<RawValue>>,
}

case_insensitive!(NodeList {
    api_version: Option<String> => "apiVersion",
    kind: Option<String> => "kind",
    metadata: serde_json::Value => "metadata",
    items: Vec<Box<RawValue>> => "items",
});

/// `FailedNodesMap`: node name → why the pod cannot go there.
pub type FailedNodesMap = BTreeMap<String, String>;

/// `ExtenderFilterResult`: the answer to `filter`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ExtenderFilterResult {
    #[serde(rename = "Nodes")]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames")]
    pub node_names: Option<Vec<String>>,
    #[serde(rename = "FailedNodes")]
    pub failed_nodes: FailedNodesMap,
    /// Nodes where preemption would not help either (they also appear in `FailedNodes`; this map
    /// takes precedence in kube-scheduler).
    #[serde(rename = "FailedAndUnresolvableNodes")]
    pub failed_and_unresolvable_nodes: FailedNodesMap,
    #[serde(rename = "Error")]
    pub error: String,
}

/// `HostPriority`: one node's score, `MIN_EXTENDER_PRIORITY..=MAX_EXTENDER_PRIORITY`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostPriority {
    #[serde(rename = "Host")]
    pub host: String,
    #[serde(rename = "Score")]
    pub score: i64,
}

/// `HostPriorityList`: the answer to `prioritize`.
pub type HostPriorityList = Vec<HostPriority>;

/// `ExtenderBindingArgs`: the body of `bind`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtenderBindingArgs {
    pub pod_name: String,
    pub pod_namespace: String,
    pub pod_uid: String,
    pub node: String,
}

case_insensitive!(ExtenderBindingArgs {
    pod_name: String => "PodName",
    pod_namespace: String => "PodNamespace",
    pod_uid: String => "PodUID",
    node: String => "Node",
});

/// `ExtenderBindingResult`: the answer to `bind` (empty `Error` = bound).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ExtenderBindingResult {
    #[serde(rename = "Error")]
    pub error: String,
}

/// `ExtenderPreemptionArgs`: the body of `preempt`.
#[derive(Debug, Clone, Default)]
pub struct ExtenderPreemptionArgs {
    pub pod: Option<Pod>,
    /// Set when `nodeCacheCapable` is false.
    pub node_name_to_victims: Option<BTreeMap<String, Option<Victims>>>,
    /// Set when `nodeCacheCapable` is true.
    pub node_name_to_meta_victims: Option<BTreeMap<String, Option<MetaVictims>>>,
}

case_insensitive!(ExtenderPreemptionArgs {
    pod: Option<Pod> => "Pod",
    node_name_to_victims: Option<BTreeMap<String, Option<Victims>>> => "NodeNameToVictims",
    node_name_to_meta_victims: Option<BTreeMap<String, Option<MetaVictims>>> => "NodeNameToMetaVictims",
});

/// `Victims`: the pods kube-scheduler would preempt on one node, in full.
#[derive(Debug, Clone, Default)]
pub struct Victims {
    pub pods: Vec<Pod>,
    pub num_pdb_violations: i64,
}

case_insensitive!(Victims {
    pods: Vec<Pod> => "Pods",
    num_pdb_violations: i64 => "NumPDBViolations",
});

/// `MetaPod`: a pod by UID.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MetaPod {
    #[serde(rename = "UID")]
    pub uid: String,
}

case_insensitive!(MetaPod { uid: String => "UID" });

/// `MetaVictims`: victims by UID.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MetaVictims {
    #[serde(rename = "Pods")]
    pub pods: Vec<MetaPod>,
    #[serde(rename = "NumPDBViolations")]
    pub num_pdb_violations: i64,
}

case_insensitive!(MetaVictims {
    pods: Vec<MetaPod> => "Pods",
    num_pdb_violations: i64 => "NumPDBViolations",
});

/// `ExtenderPreemptionResult`: the answer to `preempt`: the nodes (and victims) still worth preempting.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ExtenderPreemptionResult {
    #[serde(rename = "NodeNameToMetaVictims")]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_case_insensitively_and_null_is_default() {
        let args: ExtenderArgs =
            serde_json::from_str(r#"{"pod":{"metadata":{"name":"p"}},"NODENAMES":["a","b"],"nodes":null}"#)
                .expect("parses");
        assert_eq!(
            args.node_names.as_deref(),
            Some(&["a".to_string(), "b".to_string()][..])
        );
        assert!(args.nodes.is_none());
        assert_eq!(args.pod.and_then(|p| p.metadata.name).as_deref(), Some("p"));
        let bind: ExtenderBindingArgs =
            serde_json::from_str(r#"{"podname":"p","PodNamespace":"ns","poduid":"u","NODE":"n","Extra":1}"#)
                .expect("parses");
        assert_eq!(bind.pod_name, "p");
        assert_eq!(bind.node, "n");
        assert_eq!(bind.pod_uid, "u");
        let meta: MetaVictims =
            serde_json::from_str(r#"{"pods":[{"uid":"x"}],"numpdbviolations":2}"#).expect("parses");
        assert_eq!(meta.pods[0].uid, "x");
        assert_eq!(meta.num_pdb_violations, 2);
    }

    #[test]
    fn output_uses_go_field_names() {
        let r = ExtenderFilterResult {
            node_names: Some(vec!["a".into()]),
            ..Default::default()
        };
        let v = serde_json::to_value(&r).expect("serializes");
        for key in [
            "Nodes",
            "NodeNames",
            "FailedNodes",
            "FailedAndUnresolvableNodes",
            "Error",
        ] {
            assert!(v.get(key).is_some(), "{key} missing in {v}");
        }
        let p = serde_json::to_string(&vec![HostPriority {
            host: "a".into(),
            score: 3,
        }])
        .expect("serializes");
        assert_eq!(p, r#"[{"Host":"a","Score":3}]"#);
    }

    #[test]
    fn wrong_shapes_are_errors_not_panics() {
        assert!(serde_json::from_str::<ExtenderArgs>(r#"{"NodeNames":"a"}"#).is_err());
        assert!(serde_json::from_str::<ExtenderArgs>("[]").is_err());
        assert!(serde_json::from_str::<ExtenderBindingArgs>(r#"{"PodName":5}"#).is_err());
    }
}
