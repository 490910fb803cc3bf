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
//!
//! One file, over the usual ~600 lines: it is one protocol's wire format (`k8s.io/kube-scheduler/extender/v1`),
//! its decoders and encoders, checked field by field against the Go types.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use k8s_openapi::api::core::v1::Pod;
use serde::Serialize;
use serde::de::{Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// The score range an extender answers in (`MinExtenderPriority` / `MaxExtenderPriority`).
pub const MIN_EXTENDER_PRIORITY: i64 = 0;
pub const MAX_EXTENDER_PRIORITY: i64 = 10;

/// At most this many nodes in one request: names in `NodeNames`, nodes in `Nodes`, entries of
/// preempt's victim maps. Three times the 5,000 nodes a Kubernetes cluster is tested to (and
/// kube-scheduler sends the extender a sample of its feasible nodes, 500 of 5,000 by default). Enforced
/// while the request is parsed: 650,000 names in 16 MiB took the scorer to 752 MB before.
pub const MAX_NODES: usize = 15_000;
/// Node names are DNS subdomains: at most 253 bytes.
pub const MAX_NODE_NAME_BYTES: usize = 253;

/// Victims in one `preempt` request, over all its nodes. kube-scheduler proposes a few victims on each
/// of at most max(100, 10% of the nodes) candidates by default. As whole pods (the `Nodes` form) each
/// costs 2 KiB parsed, even when sent as `{}`: 5.6 million of those fit in 16 MiB.
pub const MAX_VICTIM_PODS: usize = 10_000;
/// Victims by UID in one `preempt` request (the `NodeNames` form), over all its nodes.
pub const MAX_VICTIM_UIDS: usize = 100_000;

/// Implements `Deserialize` for a struct whose fields all have defaults, matching each Go key
/// case-insensitively; a JSON `null` leaves the default, unknown keys are skipped (as Go does).
/// Each key's value is read as the type given (a field's own type, or a bounded form of it such as
/// [`AtMost`]) and converted into the field with `Into`.
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
                                    out.$field = value.map(Into::into).unwrap_or_default();
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
#[derive(Clone, Default)]
pub struct NodeNames {
    /// The names, back to back.
    buf: String,
    /// Where each name ends in `buf` (it starts where the previous one ends).
    ends: Vec<usize>,
    /// Some name needs escaping in JSON (never, for names Kubernetes accepts).
    needs_escaping: bool,
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
        self.needs_escaping |= name.bytes().any(|c| needs_escape(c) || c == b'"');
        self.append(name);
    }

    /// Appends a name that needs no escaping, or any name once `needs_escaping` is set.
    fn append(&mut self, name: &str) {
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
            needs_escaping: self.needs_escaping,
        };
        for (name, _) in self.iter().zip(keep).filter(|(_, k)| **k) {
            out.append(name);
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

/// The same names in the same order (however they were written on the wire).
impl PartialEq for NodeNames {
    fn eq(&self, other: &NodeNames) -> bool {
        self.ends == other.ends && self.buf == other.buf
    }
}

impl Eq for NodeNames {}

impl fmt::Debug for NodeNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl NodeNames {
    /// Refuses one more name when the list is full or the name is longer than a node name can be.
    fn room_for(&self, name: &str) -> Result<(), String> {
        if self.len() == MAX_NODES {
            return Err(Nodes::too_many());
        }
        if name.len() > MAX_NODE_NAME_BYTES {
            return Err(format!(
                "a node name of {} bytes (Kubernetes node names have at most {MAX_NODE_NAME_BYTES})",
                name.len()
            ));
        }
        Ok(())
    }

    /// The names of a JSON array of strings none of which has an escape (node names as Kubernetes
    /// allows them never do), taken straight from the text; `None` for anything else, `Some(Err)` past
    /// the limits ([`MAX_NODES`], [`MAX_NODE_NAME_BYTES`]). `text` must be JSON already checked by
    /// serde_json: this only splits it.
    fn split_plain(text: &str) -> Option<Result<NodeNames, String>> {
        let b = text.as_bytes();
        let skip_space = |i: &mut usize| {
            while b
                .get(*i)
                .is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r'))
            {
                *i += 1;
            }
        };
        let mut i = 0;
        skip_space(&mut i);
        if b.get(i) != Some(&b'[') {
            return None;
        }
        i += 1;
        skip_space(&mut i);
        let mut names = NodeNames {
            buf: String::with_capacity(text.len()),
            ..NodeNames::default()
        };
        if b.get(i) == Some(&b']') {
            return Some(Ok(names));
        }
        loop {
            if b.get(i) != Some(&b'"') {
                return None;
            }
            // Checked JSON has no control characters in strings: without a backslash, the string
            // ends at the next quote.
            let start = i + 1;
            i = start + memchr::memchr2(b'"', b'\\', b.get(start..)?)?;
            if b[i] != b'"' {
                return None;
            }
            let name = &text[start..i];
            if let Err(e) = names.room_for(name) {
                return Some(Err(e));
            }
            names.append(name);
            i += 1;
            skip_space(&mut i);
            match b.get(i) {
                Some(b',') => {
                    i += 1;
                    skip_space(&mut i);
                }
                Some(b']') => return Some(Ok(names)),
                _ => return None,
            }
        }
    }

    /// Appends the names as a JSON array.
    fn write_json(&self, out: &mut Vec<u8>) {
        out.push(b'[');
        for (k, name) in self.iter().enumerate() {
            if k > 0 {
                out.push(b',');
            }
            self.write_name(out, name);
        }
        out.push(b']');
    }

    /// Appends one of these names as a JSON string.
    fn write_name(&self, out: &mut Vec<u8>, name: &str) {
        if self.needs_escaping {
            write_json_str(out, name);
        } else {
            out.push(b'"');
            out.extend_from_slice(name.as_bytes());
            out.push(b'"');
        }
    }
}

/// A byte JSON cannot hold as it is inside a string (besides the closing quote).
fn needs_escape(c: u8) -> bool {
    c == b'\\' || c < 0x20
}

/// Appends `s` as a JSON string, exactly as serde_json writes it: copied as it is unless it needs
/// escaping (serde_json's byte-by-byte escaping of thousands of node names per answer cost more than
/// the decision itself).
fn write_json_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().any(|c| needs_escape(c) || c == b'"') {
        // Writing into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
    } else {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    }
}

impl<'de> Deserialize<'de> for NodeNames {
    /// Reads from serde_json only (which hands over the array's text, checked); names without escapes
    /// are split off that text, others go through serde_json's string parsing.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(d)?;
        if let Some(names) = NodeNames::split_plain(raw.get()) {
            return names.map_err(serde::de::Error::custom);
        }
        struct Names;
        impl<'de> Visitor<'de> for Names {
            type Value = NodeNames;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON array of node names")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NodeNames, A::Error> {
                let mut out = NodeNames {
                    needs_escaping: false,
                    buf: String::new(),
                    // The hint is the sender's word: trust it only so far.
                    ends: Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096)),
                };
                while seq.next_element_seed(Append(&mut out))?.is_some() {}
                Ok(out)
            }
        }
        serde_json::Deserializer::from_str(raw.get())
            .deserialize_seq(Names)
            .map_err(serde::de::Error::custom)
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
        self.0.room_for(name).map_err(E::custom)?;
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
    items: AtMost<Vec<Box<RawValue>>, Nodes> => "items",
});

/// A JSON array or object of at most `B::MAX` entries, refused as soon as the parser meets one more:
/// what a request holds in memory is bounded by these limits, not only by `maxBodyBytes`.
pub struct AtMost<T, B>(T, PhantomData<B>);

/// What an [`AtMost`] counts, and how many it accepts.
pub trait Bound {
    const MAX: usize;
    const WHAT: &'static str;

    fn too_many() -> String {
        format!(
            "more than {} {} in one request (the scorer's limit)",
            Self::MAX,
            Self::WHAT
        )
    }
}

/// Nodes: [`MAX_NODES`].
pub enum Nodes {}

impl Bound for Nodes {
    const MAX: usize = MAX_NODES;
    const WHAT: &'static str = "nodes";
}

/// Victims given as whole pods (`NodeNameToVictims`), over all nodes of a request: [`MAX_VICTIM_PODS`].
pub enum VictimPods {}

impl Bound for VictimPods {
    const MAX: usize = MAX_VICTIM_PODS;
    const WHAT: &'static str = "victim pods";
}

/// Victims given by UID (`NodeNameToMetaVictims`), over all nodes of a request: [`MAX_VICTIM_UIDS`].
pub enum VictimUids {}

impl Bound for VictimUids {
    const MAX: usize = MAX_VICTIM_UIDS;
    const WHAT: &'static str = "victim UIDs";
}

impl<V, B> From<AtMost<Vec<V>, B>> for Vec<V> {
    fn from(list: AtMost<Vec<V>, B>) -> Vec<V> {
        list.0
    }
}

impl<V, B> From<AtMost<BTreeMap<String, V>, B>> for Option<BTreeMap<String, V>> {
    fn from(map: AtMost<BTreeMap<String, V>, B>) -> Option<BTreeMap<String, V>> {
        Some(map.0)
    }
}

impl<'de, V: Deserialize<'de>, B: Bound> Deserialize<'de> for AtMost<Vec<V>, B> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct List<V, B>(PhantomData<(V, B)>);
        impl<'de, V: Deserialize<'de>, B: Bound> Visitor<'de> for List<V, B> {
            type Value = AtMost<Vec<V>, B>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a JSON array of at most {} {}", B::MAX, B::WHAT)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                // The hint is the sender's word: trust it only so far.
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(v) = seq.next_element()? {
                    if out.len() == B::MAX {
                        return Err(serde::de::Error::custom(B::too_many()));
                    }
                    out.push(v);
                }
                Ok(AtMost(out, PhantomData))
            }
        }
        d.deserialize_seq(List(PhantomData))
    }
}

/// A value of a map bounded by [`AtMost`] that holds entries of its own, bounded over the whole map.
pub trait Holds {
    type Bound: Bound;
    fn held(&self) -> usize;
}

impl Holds for Option<Victims> {
    type Bound = VictimPods;
    fn held(&self) -> usize {
        self.as_ref().map_or(0, |v| v.pods.len())
    }
}

impl Holds for Option<MetaVictims> {
    type Bound = VictimUids;
    fn held(&self) -> usize {
        self.as_ref().map_or(0, |v| v.pods.len())
    }
}

impl<'de, V: Deserialize<'de> + Holds, B: Bound> Deserialize<'de> for AtMost<BTreeMap<String, V>, B> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Map<V, B>(PhantomData<(V, B)>);
        impl<'de, V: Deserialize<'de> + Holds, B: Bound> Visitor<'de> for Map<V, B> {
            type Value = AtMost<BTreeMap<String, V>, B>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a JSON object of at most {} {}", B::MAX, B::WHAT)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = BTreeMap::new();
                let mut held = 0usize;
                while let Some((k, v)) = map.next_entry::<String, V>()? {
                    // Each value's own list is bounded as it is parsed; this bounds their sum.
                    held = held.saturating_add(v.held());
                    if held > <V::Bound as Bound>::MAX {
                        return Err(serde::de::Error::custom(<V::Bound as Bound>::too_many()));
                    }
                    if out.len() == B::MAX {
                        return Err(serde::de::Error::custom(B::too_many()));
                    }
                    out.insert(k, v);
                }
                Ok(AtMost(out, PhantomData))
            }
        }
        d.deserialize_map(Map(PhantomData))
    }
}

/// `FailedNodesMap`: node name → why the pod cannot go there.
pub type FailedNodesMap = BTreeMap<String, String>;

/// `ExtenderFilterResult`: the answer to `filter`.
#[derive(Debug, Clone, Default)]
pub struct ExtenderFilterResult {
    pub nodes: Option<NodeList>,
    pub node_names: Option<NodeNames>,
    pub failed_nodes: FailedNodesMap,
    /// Nodes where preemption would not help either (they also appear in `FailedNodes`; this map
    /// takes precedence in kube-scheduler).
    pub failed_and_unresolvable_nodes: FailedNodesMap,
    pub error: String,
}

impl ExtenderFilterResult {
    /// The JSON kube-scheduler reads (Go field names).
    pub fn to_json(&self) -> Vec<u8> {
        let names = self.node_names.as_ref().map_or(0, |n| n.buf.len() + 3 * n.len());
        let mut out = Vec::with_capacity(names + 128);
        // Writing into a Vec cannot fail.
        out.extend_from_slice(br#"{"Nodes":"#);
        let _ = serde_json::to_writer(&mut out, &self.nodes);
        out.extend_from_slice(br#","NodeNames":"#);
        match &self.node_names {
            Some(names) => names.write_json(&mut out),
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(br#","FailedNodes":"#);
        let _ = serde_json::to_writer(&mut out, &self.failed_nodes);
        out.extend_from_slice(br#","FailedAndUnresolvableNodes":"#);
        let _ = serde_json::to_writer(&mut out, &self.failed_and_unresolvable_nodes);
        out.extend_from_slice(br#","Error":"#);
        write_json_str(&mut out, &self.error);
        out.push(b'}');
        out
    }
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

impl HostPriorities {
    /// The JSON kube-scheduler reads: a [`HostPriorityList`].
    pub fn to_json(&self) -> Vec<u8> {
        use std::io::Write;
        let mut out = Vec::with_capacity(self.names.buf.len() + 28 * self.len() + 2);
        out.push(b'[');
        for (k, (host, score)) in self.iter().enumerate() {
            if k > 0 {
                out.push(b',');
            }
            out.extend_from_slice(br#"{"Host":"#);
            self.names.write_name(&mut out, host);
            out.extend_from_slice(br#","Score":"#);
            match u8::try_from(score) {
                // Scores are 0..=10: two digits at most, without the formatting machinery.
                Ok(d) if d < 100 => {
                    if d >= 10 {
                        out.push(b'0' + d / 10);
                    }
                    out.push(b'0' + d % 10);
                }
                // Writing into a Vec cannot fail.
                _ => drop(write!(out, "{score}")),
            }
            out.push(b'}');
        }
        out.push(b']');
        out
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
    node_name_to_victims: AtMost<BTreeMap<String, Option<Victims>>, Nodes> => "NodeNameToVictims",
    node_name_to_meta_victims: AtMost<BTreeMap<String, Option<MetaVictims>>, Nodes> => "NodeNameToMetaVictims",
});

/// `Victims`: the pods kube-scheduler would preempt on one node, in full.
#[derive(Debug, Clone, Default)]
pub struct Victims {
    pub pods: Vec<Pod>,
    pub num_pdb_violations: i64,
}

case_insensitive!(Victims {
    pods: AtMost<Vec<Pod>, VictimPods> => "Pods",
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
    pods: AtMost<Vec<MetaPod>, VictimUids> => "Pods",
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
        let v: serde_json::Value = serde_json::from_slice(&r.to_json()).expect("valid JSON");
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

    fn json(names: &NodeNames) -> String {
        let mut out = Vec::new();
        names.write_json(&mut out);
        String::from_utf8(out).expect("UTF-8")
    }

    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        for s in [
            "node-1",
            "",
            "a\"b",
            "back\\slash",
            "tab\there",
            "\u{1}\u{1f}\u{7f}",
            "é/ü",
        ] {
            let mut out = Vec::new();
            write_json_str(&mut out, s);
            assert_eq!(
                String::from_utf8(out).expect("UTF-8"),
                serde_json::to_string(s).expect("serializes")
            );
        }
        let r = ExtenderFilterResult {
            node_names: Some(NodeNames::from_iter(["a", "b"])),
            failed_nodes: [("c".to_string(), "needs \"5000\" MiB".to_string())].into(),
            error: "x\ny".into(),
            ..Default::default()
        };
        let v: serde_json::Value = serde_json::from_slice(&r.to_json()).expect("valid JSON");
        assert_eq!(
            v,
            serde_json::json!({"Nodes": null, "NodeNames": ["a", "b"],
                "FailedNodes": {"c": "needs \"5000\" MiB"}, "FailedAndUnresolvableNodes": {}, "Error": "x\ny"})
        );
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
        let written = json(&names);
        assert_eq!(
            written,
            serde_json::to_string(&["a", "b\u{e9}", "c\"q"]).expect("serializes")
        );
        assert_eq!(
            serde_json::from_str::<NodeNames>(&written).expect("parses"),
            names
        );
        // Without escapes the names are split off the text: the same names, spaces or not.
        let plain: NodeNames = serde_json::from_str(" [ \"n-1\" ,\"n.2\",\n\"\u{e9}\"] ").expect("parses");
        assert_eq!(plain.iter().collect::<Vec<_>>(), ["n-1", "n.2", "\u{e9}"]);
        assert_eq!(json(&plain), "[\"n-1\",\"n.2\",\"\u{e9}\"]");
        // From a reader too.
        let read: NodeNames = serde_json::from_reader(text.as_bytes()).expect("parses");
        assert_eq!(read, names);
        assert_eq!(format!("{names:?}"), r#"["a", "bé", "c\"q"]"#);

        let empty: NodeNames = serde_json::from_str("[]").expect("parses");
        assert!(empty.is_empty());
        assert_eq!(empty, NodeNames::default());
        assert_eq!(json(&empty), "[]");
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
        let hosts = ["a", "b\u{e9}", "c\"q", "d", "e"];
        let scores = vec![3, 0, 10, -1, 123];
        let old: HostPriorityList = hosts
            .iter()
            .zip(&scores)
            .map(|(h, s)| HostPriority {
                host: h.to_string(),
                score: *s,
            })
            .collect();
        let new = HostPriorities::new(NodeNames::from_iter(hosts), scores);
        assert_eq!(new.len(), 5);
        assert_eq!(
            String::from_utf8(new.to_json()).expect("UTF-8"),
            serde_json::to_string(&old).expect("serializes")
        );
        // Names needing no escaping are copied as they are.
        let plain = HostPriorities::new(serde_json::from_str(r#"["x","y"]"#).expect("parses"), vec![7, 10]);
        assert_eq!(
            plain.to_json(),
            br#"[{"Host":"x","Score":7},{"Host":"y","Score":10}]"#
        );
        assert_eq!(
            String::from_utf8(HostPriorities::default().to_json()).expect("UTF-8"),
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
