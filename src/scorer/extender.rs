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
use serde::de::{Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Serialize, Serializer};
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
    pub node_names: Option<NodeNames>,
}

case_insensitive!(ExtenderArgs {
    pod: Option<Pod> => "Pod",
    nodes: Option<NodeList> => "Nodes",
    node_names: Option<NodeNames> => "NodeNames",
});

/// A list of node names (on the wire: a JSON array of strings), all in one buffer.
///
/// kube-scheduler sends every candidate's name on each `filter` and `prioritize` (thousands of them):
/// one `String` each made parsing the request a large share of a decision's cost.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct NodeNames {
    /// The names, back to back.
    buf: String,
    /// Where each name ends in `buf` (it starts where the previous one ends).
    ends: Vec<usize>,
}

impl NodeNames {
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Name `i`; panics if `i >= len()`, as indexing a slice does.
    pub fn get(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.buf[start..self.ends[i]]
    }

    pub fn iter(&self) -> NodeNamesIter<'_> {
        NodeNamesIter {
            buf: &self.buf,
            ends: self.ends.iter(),
            start: 0,
        }
    }

    pub fn push(&mut self, name: &str) {
        self.buf.push_str(name);
        self.ends.push(self.buf.len());
    }

    /// The names `i` with `keep[i]` set, in order, copied into one new buffer (names past the end of
    /// `keep` are dropped).
    pub fn keep(&self, keep: &[bool]) -> NodeNames {
        let mut out = NodeNames {
            // An upper bound: one allocation each.
            buf: String::with_capacity(self.buf.len()),
            ends: Vec::with_capacity(keep.iter().filter(|k| **k).count()),
        };
        for (name, _) in self.iter().zip(keep).filter(|(_, k)| **k) {
            out.push(name);
        }
        out
    }
}

/// The names of a [`NodeNames`], in order.
#[derive(Debug, Clone)]
pub struct NodeNamesIter<'a> {
    buf: &'a str,
    ends: std::slice::Iter<'a, usize>,
    start: usize,
}

impl<'a> Iterator for NodeNamesIter<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let end = *self.ends.next()?;
        let name = &self.buf[self.start..end];
        self.start = end;
        Some(name)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.ends.size_hint()
    }
}

impl ExactSizeIterator for NodeNamesIter<'_> {}

impl<'a> IntoIterator for &'a NodeNames {
    type Item = &'a str;
    type IntoIter = NodeNamesIter<'a>;

    fn into_iter(self) -> NodeNamesIter<'a> {
        self.iter()
    }
}

impl<'a> FromIterator<&'a str> for NodeNames {
    fn from_iter<I: IntoIterator<Item = &'a str>>(iter: I) -> NodeNames {
        let mut out = NodeNames::default();
        for name in iter {
            out.push(name);
        }
        out
    }
}

impl From<Vec<String>> for NodeNames {
    fn from(names: Vec<String>) -> NodeNames {
        names.iter().map(String::as_str).collect()
    }
}

impl fmt::Debug for NodeNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Serialize for NodeNames {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for NodeNames {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Names;
        impl<'de> Visitor<'de> for Names {
            type Value = NodeNames;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON array of node names")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NodeNames, A::Error> {
                let mut out = NodeNames {
                    buf: String::new(),
                    // The hint is the sender's word: trust it only so far.
                    ends: Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096)),
                };
                while seq.next_element_seed(Append(&mut out))?.is_some() {}
                Ok(out)
            }
        }
        d.deserialize_seq(Names)
    }
}

/// Appends one name (a JSON string) to a [`NodeNames`] straight from the parser's text, never as a
/// `String` of its own. serde's defaults route `visit_borrowed_str` (unescaped) and `visit_string` to
/// `visit_str` (escaped strings come that way from serde_json).
struct Append<'a>(&'a mut NodeNames);

impl<'de> DeserializeSeed<'de> for Append<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Append<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a node name (a string)")
    }
    fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<(), E> {
        self.0.push(name);
        Ok(())
    }
}

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
    pub node_names: Option<NodeNames>,
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

/// `HostPriorityList`: the answer to `prioritize`, as Go has it; the scorer writes the same JSON
/// through [`HostPriorities`].
pub type HostPriorityList = Vec<HostPriority>;

/// The answer to `prioritize` as the scorer builds it: serializes exactly as a [`HostPriorityList`]
/// (`[{"Host":"a","Score":3},...]`) but keeps the names in one [`NodeNames`] (often the request's own),
/// not a `String` per node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostPriorities {
    names: NodeNames,
    scores: Vec<i64>,
}

impl HostPriorities {
    /// `scores[i]` is the score of `names.get(i)`; the two should be as long as each other (extra
    /// entries of either are not written).
    pub fn new(names: NodeNames, scores: Vec<i64>) -> HostPriorities {
        debug_assert_eq!(names.len(), scores.len(), "one score per node");
        HostPriorities { names, scores }
    }

    pub fn len(&self) -> usize {
        self.names.len().min(self.scores.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `(host, score)`, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, i64)> {
        self.names.iter().zip(self.scores.iter().copied())
    }
}

impl Serialize for HostPriorities {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        /// [`HostPriority`], borrowing its name.
        #[derive(Serialize)]
        struct Entry<'a> {
            #[serde(rename = "Host")]
            host: &'a str,
            #[serde(rename = "Score")]
            score: i64,
        }
        s.collect_seq(self.iter().map(|(host, score)| Entry { host, score }))
    }
}

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
        assert_eq!(args.node_names, Some(NodeNames::from_iter(["a", "b"])));
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
            node_names: Some(NodeNames::from(vec!["a".to_string()])),
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
        assert_eq!(v["NodeNames"], serde_json::json!(["a"]));
    }

    #[test]
    fn node_names_round_trip() {
        // `\u00e9` and `\"` are escapes: serde_json hands those strings over through `visit_str`.
        let text = r#"["a","b\u00e9","c\"q"]"#;
        let names: NodeNames = serde_json::from_str(text).expect("parses");
        assert_eq!(names.len(), 3);
        assert!(!names.is_empty());
        assert_eq!(names.get(0), "a");
        assert_eq!(names.get(1), "b\u{e9}");
        assert_eq!(names.get(2), "c\"q");
        assert_eq!(names.iter().len(), 3);
        assert_eq!(names.iter().collect::<Vec<_>>(), ["a", "b\u{e9}", "c\"q"]);
        assert_eq!(
            serde_json::to_string(&names).expect("serializes"),
            serde_json::to_string(&["a", "b\u{e9}", "c\"q"]).expect("serializes")
        );
        assert_eq!(
            serde_json::from_str::<NodeNames>(&serde_json::to_string(&names).expect("serializes"))
                .expect("parses"),
            names
        );
        // From a reader serde_json cannot borrow at all: every string comes through `visit_str`.
        let read: NodeNames = serde_json::from_reader(text.as_bytes()).expect("parses");
        assert_eq!(read, names);
        let owned: NodeNames =
            serde_json::from_value(serde_json::json!(["a", "b\u{e9}", "c\"q"])).expect("parses");
        assert_eq!(owned, names);
        assert_eq!(format!("{names:?}"), r#"["a", "bé", "c\"q"]"#);

        let empty: NodeNames = serde_json::from_str("[]").expect("parses");
        assert!(empty.is_empty());
        assert_eq!(empty, NodeNames::default());
        assert_eq!(serde_json::to_string(&empty).expect("serializes"), "[]");
        // Empty names are names too.
        let blank: NodeNames = serde_json::from_str(r#"["","x",""]"#).expect("parses");
        assert_eq!(blank.iter().collect::<Vec<_>>(), ["", "x", ""]);

        let none: ExtenderArgs = serde_json::from_str(r#"{"NodeNames":null}"#).expect("parses");
        assert_eq!(none.node_names, None);
        let some: ExtenderArgs = serde_json::from_str(r#"{"NodeNames":[]}"#).expect("parses");
        assert_eq!(some.node_names, Some(NodeNames::default()));
    }

    #[test]
    fn node_names_keep_copies_the_kept_ones_in_order() {
        let names = NodeNames::from_iter(["a", "bb", "", "d"]);
        assert_eq!(
            names.keep(&[true, false, true, true]),
            NodeNames::from_iter(["a", "", "d"])
        );
        assert_eq!(names.keep(&[false; 4]), NodeNames::default());
        assert_eq!(names.keep(&[true; 4]), names);
        assert_eq!(names.keep(&[false, true]), NodeNames::from_iter(["bb"]));
    }

    #[test]
    fn host_priorities_serialize_like_a_host_priority_list() {
        let hosts = ["a", "b\u{e9}", "c\"q"];
        let scores = vec![3, 0, 10];
        let old: HostPriorityList = hosts
            .iter()
            .zip(&scores)
            .map(|(h, s)| HostPriority {
                host: h.to_string(),
                score: *s,
            })
            .collect();
        let new = HostPriorities::new(NodeNames::from_iter(hosts), scores);
        assert_eq!(new.len(), 3);
        assert_eq!(
            serde_json::to_string(&new).expect("serializes"),
            serde_json::to_string(&old).expect("serializes")
        );
        assert_eq!(
            serde_json::to_string(&HostPriorities::default()).expect("serializes"),
            serde_json::to_string(&HostPriorityList::new()).expect("serializes")
        );
    }

    #[test]
    fn wrong_shapes_are_errors_not_panics() {
        assert!(serde_json::from_str::<ExtenderArgs>(r#"{"NodeNames":"a"}"#).is_err());
        assert!(serde_json::from_str::<ExtenderArgs>(r#"{"NodeNames":["a",1]}"#).is_err());
        assert!(serde_json::from_str::<ExtenderArgs>(r#"{"NodeNames":["a",null]}"#).is_err());
        assert!(serde_json::from_str::<ExtenderArgs>(r#"{"NodeNames":[["a"]]}"#).is_err());
        assert!(serde_json::from_str::<ExtenderArgs>(r#"{"NodeNames":{"a":1}}"#).is_err());
        assert!(serde_json::from_str::<NodeNames>(r#""a""#).is_err());
        assert!(serde_json::from_str::<NodeNames>(r#"["a",1]"#).is_err());
        assert!(serde_json::from_str::<NodeNames>("null").is_err());
        assert!(serde_json::from_str::<NodeNames>(r#"["a""#).is_err());
        assert!(serde_json::from_str::<ExtenderArgs>("[]").is_err());
        assert!(serde_json::from_str::<ExtenderBindingArgs>(r#"{"PodName":5}"#).is_err());
    }
}
