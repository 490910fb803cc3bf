//! Which nodes a pod's `nodeSelector` and required node affinity admit, read as kube-scheduler 1.36's
//! NodeAffinity filter reads them (component-helpers' `nodeaffinity`): pure. The DRA placer filters
//! nodes with it (`placer::nodes`); the scorer reads from it which GPU models a pod can reach,
//! for its learned mix.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PodSpec};

/// The required node affinity of a pod of `spec`, if it has one.
pub fn required_node_affinity(spec: &PodSpec) -> Option<&NodeSelector> {
    spec.affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref())
}

/// A pod's node selector and the terms of its required node affinity.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeSelection {
    node_selector: BTreeMap<String, String>,
    /// The required node affinity's terms that can match (`None`: there is none, any node will do).
    affinity: Option<Vec<Term>>,
}

impl NodeSelection {
    /// The selection of a pod of `spec`.
    pub fn of(spec: &PodSpec) -> NodeSelection {
        let required = required_node_affinity(spec);
        NodeSelection {
            node_selector: spec.node_selector.clone().unwrap_or_default(),
            affinity: required.map(|r| r.node_selector_terms.iter().filter_map(Term::parse).collect()),
        }
    }

    /// Whether it admits every node (no selector, no required affinity).
    pub fn is_any(&self) -> bool {
        self.node_selector.is_empty() && self.affinity.is_none()
    }

    /// `RequiredNodeAffinity.Match` for the node `name` with `labels`: the node selector, then the
    /// terms ORed.
    pub fn admits(&self, name: &str, labels: &BTreeMap<String, String>) -> bool {
        self.node_selector.iter().all(|(k, v)| labels.get(k) == Some(v))
            && self
                .affinity
                .as_ref()
                .is_none_or(|terms| terms.iter().any(|t| t.matches(name, labels)))
    }
}

/// A nodeSelectorTerm that can match. As component-helpers' `nodeaffinity` has it, a term with
/// neither expressions nor fields, or with a requirement that does not parse (unknown operator, key
/// not a label key, value not a label value, wrong number of values, `Gt`/`Lt` value not an integer,
/// a field requirement other than `In`/`NotIn` with one value), matches no node: such a term is
/// dropped, and a required affinity left with no term admits no node.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Term {
    labels: Vec<(String, LabelOp)>,
    /// Node fields (`metadata.name`; any other key reads as ""): the value, and whether it must equal.
    fields: Vec<(String, String, bool)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelOp {
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    DoesNotExist,
    Gt(i64),
    Lt(i64),
}

impl Term {
    fn parse(term: &NodeSelectorTerm) -> Option<Term> {
        let expressions = term.match_expressions.as_deref().unwrap_or_default();
        let fields = term.match_fields.as_deref().unwrap_or_default();
        if expressions.is_empty() && fields.is_empty() {
            return None;
        }
        Some(Term {
            labels: expressions.iter().map(label_requirement).collect::<Option<_>>()?,
            fields: fields.iter().map(field_requirement).collect::<Option<_>>()?,
        })
    }

    fn matches(&self, name: &str, labels: &BTreeMap<String, String>) -> bool {
        let labels = self.labels.iter().all(|(key, op)| {
            let value = labels.get(key);
            match op {
                LabelOp::In(values) => value.is_some_and(|v| values.contains(v)),
                LabelOp::NotIn(values) => value.is_none_or(|v| !values.contains(v)),
                LabelOp::Exists => value.is_some(),
                LabelOp::DoesNotExist => value.is_none(),
                // A label that is not an integer does not match.
                LabelOp::Gt(n) => value.and_then(|v| v.parse::<i64>().ok()).is_some_and(|v| v > *n),
                LabelOp::Lt(n) => value.and_then(|v| v.parse::<i64>().ok()).is_some_and(|v| v < *n),
            }
        });
        // kube-scheduler skips the fields of a node without a name.
        let fields = name.is_empty()
            || self.fields.iter().all(|(key, value, equal)| {
                let actual = if key == "metadata.name" { name } else { "" };
                (actual == value) == *equal
            });
        labels && fields
    }
}

/// `labels.NewRequirement`'s checks, with the node selector operators.
fn label_requirement(r: &NodeSelectorRequirement) -> Option<(String, LabelOp)> {
    let values = r.values.clone().unwrap_or_default();
    if !is_label_key(&r.key) || !values.iter().all(|v| is_label_value(v)) {
        return None;
    }
    let op = match (r.operator.as_str(), values.as_slice()) {
        ("In", [_, ..]) => LabelOp::In(values),
        ("NotIn", [_, ..]) => LabelOp::NotIn(values),
        ("Exists", []) => LabelOp::Exists,
        ("DoesNotExist", []) => LabelOp::DoesNotExist,
        ("Gt", [v]) => LabelOp::Gt(v.parse().ok()?),
        ("Lt", [v]) => LabelOp::Lt(v.parse().ok()?),
        _ => return None,
    };
    Some((r.key.clone(), op))
}

/// `nodeSelectorRequirementsAsFieldSelector`: `In` or `NotIn` with exactly one value.
fn field_requirement(r: &NodeSelectorRequirement) -> Option<(String, String, bool)> {
    match (r.operator.as_str(), r.values.as_deref().unwrap_or_default()) {
        ("In", [v]) => Some((r.key.clone(), v.clone(), true)),
        ("NotIn", [v]) => Some((r.key.clone(), v.clone(), false)),
        _ => None,
    }
}

/// apimachinery's `IsLabelKey`: an optional DNS-1123 subdomain and '/', then a name part.
fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    prefix.is_none_or(|p| crate::names::check_subdomain(p).is_ok())
        && !name.is_empty()
        && is_label_value(name)
}

/// apimachinery's `IsLabelValue`: at most 63 of letters, digits, '-', '_', '.', starting and ending
/// alphanumeric, or empty.
fn is_label_value(value: &str) -> bool {
    let b = value.as_bytes();
    let alnum = |c: &u8| c.is_ascii_alphanumeric();
    b.len() <= 63
        && (b.is_empty()
            || (b.first().is_some_and(alnum)
                && b.last().is_some_and(alnum)
                && b.iter().all(|c| alnum(c) || matches!(c, b'-' | b'_' | b'.'))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn selection(spec: serde_json::Value) -> NodeSelection {
        let mut spec = spec;
        spec["containers"] = serde_json::json!([]);
        NodeSelection::of(&serde_json::from_value(spec).expect("a pod spec"))
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_pod_without_rules_admits_any_node() {
        let any = selection(serde_json::json!({}));
        assert!(any.is_any());
        assert!(any.admits("n", &labels(&[])));
        let some = selection(serde_json::json!({"nodeSelector": {"zone": "a"}}));
        assert!(!some.is_any());
        assert!(some.admits("n", &labels(&[("zone", "a")])));
        assert!(!some.admits("n", &labels(&[("zone", "b")])));
    }

    #[test]
    fn selector_and_terms_both_hold_terms_or() {
        let s = selection(serde_json::json!({
            "nodeSelector": {"zone": "a"},
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "mem", "operator": "Gt", "values": ["40959"]}]},
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n9"]}]},
                ]}}},
        }));
        assert!(s.admits("n1", &labels(&[("zone", "a"), ("mem", "81920")])));
        assert!(!s.admits("n1", &labels(&[("zone", "a"), ("mem", "15360")])));
        assert!(s.admits("n9", &labels(&[("zone", "a"), ("mem", "15360")])));
        assert!(!s.admits("n9", &labels(&[("zone", "b")])));
        // A required affinity whose only term cannot parse admits no node.
        let none = selection(serde_json::json!({
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "Gt", "values": ["x"]}]}]}}},
        }));
        assert!(!none.is_any());
        assert!(!none.admits("n", &labels(&[("k", "5")])));
    }
}
