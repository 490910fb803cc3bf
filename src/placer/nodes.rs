//! Which nodes a pod may use, decided as kube-scheduler 1.36's default profile decides it: pure.
//!
//! The placer allocates a pod's ResourceClaims on a node before kube-scheduler sees the pod, and the
//! allocation pins the pod to that node: a node kube-scheduler would then reject leaves the pod
//! Pending. So the placer asks [`PodRules::admits`] of every node, which reproduces these filter
//! plugins (kube-scheduler v1.36.2, `pkg/scheduler/framework/plugins`), in the profile's order,
//! reporting the first that rejects with kube-scheduler's words:
//!
//! - NodeUnschedulable: `spec.unschedulable` rejects unless the pod tolerates
//!   `node.kubernetes.io/unschedulable:NoSchedule`;
//! - NodeName: `spec.nodeName`, when set, is the only node;
//! - TaintToleration: every NoSchedule and NoExecute taint must be tolerated (component-helpers'
//!   `ToleratesTaint`); PreferNoSchedule only scores;
//! - NodeAffinity: `spec.nodeSelector` and the required node affinity, parsed as
//!   component-helpers' `nodeaffinity` parses them ([`crate::affinity`]); preferred terms only score;
//! - NodeResourcesFit for cpu, memory, ephemeral-storage and the pod count: the pod's request
//!   (component-helpers' `PodRequests`: sidecars, init containers, pod-level requests, overhead) must
//!   fit the node's allocatable less what its pods request ([`Resources::requested_by`]).
//!
//! Other default-profile filters read what the placer does not keep (other pods' placement and
//! labels, PersistentVolumes, CSINodes): a pod they apply to is [`Unplaceable`], which the caller
//! hands to kube-scheduler unplaced. They are required inter-pod affinity and anti-affinity
//! (InterPodAffinity), `DoNotSchedule` topology spread constraints (PodTopologySpread), host ports of
//! containers and sidecars (NodePorts: `hostNetwork` defaults them to the container ports), volumes of
//! a PersistentVolumeClaim or ephemeral claim (VolumeBinding, VolumeZone, NodeVolumeLimits,
//! VolumeRestrictions' ReadWriteOncePod), in-tree cloud and network disks (NodeVolumeLimits counts
//! the CSI-migratable ones, VolumeRestrictions compares GCE PD, EBS, RBD and iSCSI with the node's
//! pods), the node features NodeDeclaredFeatures (beta, on) infers (`RestartAllContainers` restart
//! rules, `hostNetwork` with `hostUsers: false`), and tolerations with `Lt`/`Gt`, whose meaning
//! depends on the alpha TaintTolerationComparisonOperators gate.
//!
//! What the caller must still see to: kube-scheduler also rejects a node whose topology domain holds
//! a pod with required anti-affinity against this pod (InterPodAffinity's check of existing pods), and
//! counts nominated pods of at least this priority as on their node; neither is in one pod's rules.
//! Not checked because it cannot reject a node here: scoring (preferred affinities, `ScheduleAnyway`
//! spread, the system default spread), SchedulingGates (before filters), DynamicResources (the placer's
//! own allocation), GangScheduling and topology-aware workload scheduling (alpha, off). RuntimeClass
//! and LimitRange admission have already written their node selector, tolerations, overhead and
//! defaults into the pod, as has the API server's defaulting (requests from limits), so the placer
//! applies none of it. Resources other than cpu, memory, ephemeral-storage and pods (extended,
//! DRA-backed, hugepages) are the caller's.
//!
//! What a pod requests is read by [`crate::requests`], which the scorer's pod cache shares.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod, PodSpec, Taint,
};

use crate::affinity::{NodeSelection, required_node_affinity};
use crate::requests::Resources;

/// What kube-scheduler's node filters read of a Node, kept per node by the placer's watch (small: no
/// GPU annotations, no status conditions, so that a status heartbeat compares equal).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodeFacts {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
    pub unschedulable: bool,
    pub allocatable: Resources,
}

impl NodeFacts {
    /// The facts of `node`; an allocatable quantity that does not parse counts as 0.
    pub fn from_node(node: &Node) -> NodeFacts {
        let spec = node.spec.as_ref();
        NodeFacts {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            taints: spec.and_then(|s| s.taints.clone()).unwrap_or_default(),
            unschedulable: spec.and_then(|s| s.unschedulable).unwrap_or(false),
            allocatable: Resources::of_list(node.status.as_ref().and_then(|s| s.allocatable.as_ref())),
        }
    }
}

/// Why the placer leaves a pod to kube-scheduler: a filter that reads what the placer does not keep
/// (see the module's documentation).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unplaceable {
    #[error("the pod has required pod affinity (InterPodAffinity reads other pods' placement)")]
    PodAffinity,
    #[error("the pod has required pod anti-affinity (InterPodAffinity reads other pods' placement)")]
    PodAntiAffinity,
    #[error(
        "the pod spreads over {0:?} with whenUnsatisfiable: DoNotSchedule (PodTopologySpread reads \
         other pods' placement)"
    )]
    TopologySpread(String),
    #[error("container {container:?} uses host port {port} (NodePorts reads the node's other pods' ports)")]
    HostPort { container: String, port: i32 },
    #[error("volume {name:?} is {kind} (the volume filters read PersistentVolumes, CSINodes and other pods)")]
    Volume { name: String, kind: &'static str },
    #[error("the pod needs the node feature {0} (NodeDeclaredFeatures reads the node's declared features)")]
    NodeFeature(&'static str),
    #[error(
        "a toleration uses operator {0} (its meaning depends on kube-scheduler's \
         TaintTolerationComparisonOperators gate)"
    )]
    TolerationComparison(String),
}

/// The node rules of one pod, read once per decision.
#[derive(Debug, Clone)]
pub struct PodRules {
    node_name: Option<String>,
    selection: NodeSelection,
    tolerations: Vec<Tol>,
    request: Resources,
}

impl PodRules {
    /// The rules of `pod`, or why the placer must leave it to kube-scheduler.
    pub fn of(pod: &Pod) -> Result<PodRules, Unplaceable> {
        let default_spec = PodSpec::default();
        let spec = pod.spec.as_ref().unwrap_or(&default_spec);
        leave_to_scheduler(spec)?;
        let tolerations = spec
            .tolerations
            .iter()
            .flatten()
            .map(|t| {
                let op = match t.operator.as_deref().unwrap_or_default() {
                    "" | "Equal" => TolOp::Equal,
                    "Exists" => TolOp::Exists,
                    op @ ("Lt" | "Gt") => return Err(Unplaceable::TolerationComparison(op.into())),
                    // `ToleratesTaint`: an unknown operator tolerates nothing.
                    _ => TolOp::Never,
                };
                Ok(Tol {
                    key: t.key.clone().unwrap_or_default(),
                    op,
                    value: t.value.clone().unwrap_or_default(),
                    effect: t.effect.clone().unwrap_or_default(),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(PodRules {
            node_name: spec.node_name.clone().filter(|n| !n.is_empty()),
            selection: NodeSelection::of(spec),
            tolerations,
            request: Resources::asked_by(pod),
        })
    }

    /// Why `node`, whose pods already request `in_use` (see [`Resources::requested_by`]), cannot take
    /// the pod, in kube-scheduler's words; Ok if it can.
    pub fn admits(&self, node: &NodeFacts, in_use: Resources) -> Result<(), String> {
        const UNSCHEDULABLE_TAINT: &str = "node.kubernetes.io/unschedulable";
        if node.unschedulable && !self.tolerates(UNSCHEDULABLE_TAINT, "", "NoSchedule") {
            return Err("node(s) were unschedulable".into());
        }
        if self.node_name.as_ref().is_some_and(|n| *n != node.name) {
            return Err("node(s) didn't match the requested node name".into());
        }
        for taint in &node.taints {
            let value = taint.value.as_deref().unwrap_or_default();
            if matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
                && !self.tolerates(&taint.key, value, &taint.effect)
            {
                // 1.36 says "node(s) had untolerated taint(s)"; earlier releases named the taint so.
                return Err(format!(
                    "node(s) had untolerated taint {{{}: {value}}}",
                    taint.key
                ));
            }
        }
        if !self.selection.admits(&node.name, &node.labels) {
            return Err("node(s) didn't match Pod's node affinity/selector".into());
        }
        self.fits(&node.allocatable, in_use)
    }

    /// `TolerationsTolerateTaint` with comparison operators off.
    fn tolerates(&self, key: &str, value: &str, effect: &str) -> bool {
        self.tolerations.iter().any(|t| {
            (t.effect.is_empty() || t.effect == effect)
                && (t.key.is_empty() || t.key == key)
                && match t.op {
                    // With an empty key too: API validation forbids that, kube-scheduler then matches
                    // any key with this value.
                    TolOp::Equal => t.value == value,
                    TolOp::Exists => true,
                    TolOp::Never => false,
                }
        })
    }

    /// NodeResourcesFit's `fitsRequest`, all reasons joined as kube-scheduler's status message joins
    /// them; a resource the pod does not request is not checked (the pod count always is).
    fn fits(&self, allocatable: &Resources, in_use: Resources) -> Result<(), String> {
        let req = self.request;
        let mut reasons = Vec::new();
        if in_use.pods.saturating_add(req.pods) > allocatable.pods {
            reasons.push("Too many pods");
        }
        let short = |want: u64, have: u64, used: u64| want > 0 && want > have.saturating_sub(used);
        if short(req.cpu_milli, allocatable.cpu_milli, in_use.cpu_milli) {
            reasons.push("Insufficient cpu");
        }
        if short(req.memory_bytes, allocatable.memory_bytes, in_use.memory_bytes) {
            reasons.push("Insufficient memory");
        }
        if short(
            req.ephemeral_bytes,
            allocatable.ephemeral_bytes,
            in_use.ephemeral_bytes,
        ) {
            reasons.push("Insufficient ephemeral-storage");
        }
        if reasons.is_empty() {
            Ok(())
        } else {
            Err(reasons.join(", "))
        }
    }
}

/// The required node affinity that pins a pod, still gated, to `node`: `matchFields metadata.name In
/// [node]` added to each of its terms (one such term when it has none). The claims the placer
/// allocated already bind the pod to that node, but kube-scheduler would still run every filter on
/// every node to find the one that passes; with a node name in each term, its NodeAffinity PreFilter
/// hands the filters that one node (as for a DaemonSet's pods). The API server allows this change
/// while the pod is gated: requirements added to existing terms, no term added or removed. An empty
/// term matches no node and may not gain requirements: it stays as it is.
pub fn pinned_to(spec: &PodSpec, node: &str) -> NodeSelector {
    let pin = NodeSelectorRequirement {
        key: "metadata.name".into(),
        operator: "In".into(),
        values: Some(vec![node.into()]),
    };
    let terms = required_node_affinity(spec)
        .map(|r| r.node_selector_terms.clone())
        .unwrap_or_default();
    if terms.is_empty() {
        return NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: None,
                match_fields: Some(vec![pin]),
            }],
        };
    }
    let empty = |l: &Option<Vec<NodeSelectorRequirement>>| l.as_ref().is_none_or(Vec::is_empty);
    NodeSelector {
        node_selector_terms: terms
            .into_iter()
            .map(|mut t| {
                if !(empty(&t.match_expressions) && empty(&t.match_fields)) {
                    t.match_fields.get_or_insert_default().push(pin.clone());
                }
                t
            })
            .collect(),
    }
}

/// A resource the pod requests that [`PodRules::admits`] does not weigh (an extended resource,
/// hugepages), if any: the placer cannot tell whether its node has it, so such a pod is not pinned,
/// and the give-back of its claims can still move it.
pub fn unweighed_request(spec: &PodSpec) -> Option<String> {
    const WEIGHED: [&str; 3] = ["cpu", "memory", "ephemeral-storage"];
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref())
        .flat_map(|r| [r.requests.as_ref(), r.limits.as_ref()]);
    let pod_level = spec
        .resources
        .iter()
        .flat_map(|r| [r.requests.as_ref(), r.limits.as_ref()]);
    containers
        .chain(pod_level)
        .chain([spec.overhead.as_ref()])
        .flatten()
        .flat_map(|list| list.keys())
        .find(|name| !WEIGHED.contains(&name.as_str()))
        .cloned()
}

/// The filters of kube-scheduler that `PodRules` does not reproduce, if one applies to the pod.
fn leave_to_scheduler(spec: &PodSpec) -> Result<(), Unplaceable> {
    let affinity = spec.affinity.as_ref();
    let required = |terms: Option<&Vec<_>>| terms.is_some_and(|t| !t.is_empty());
    if required(affinity.and_then(|a| {
        a.pod_affinity
            .as_ref()?
            .required_during_scheduling_ignored_during_execution
            .as_ref()
    })) {
        return Err(Unplaceable::PodAffinity);
    }
    if required(affinity.and_then(|a| {
        a.pod_anti_affinity
            .as_ref()?
            .required_during_scheduling_ignored_during_execution
            .as_ref()
    })) {
        return Err(Unplaceable::PodAntiAffinity);
    }
    if let Some(c) = spec
        .topology_spread_constraints
        .iter()
        .flatten()
        .find(|c| c.when_unsatisfiable == "DoNotSchedule")
    {
        return Err(Unplaceable::TopologySpread(c.topology_key.clone()));
    }
    // `GetHostPorts`: app containers and sidecars, not init containers that finish.
    let running = spec
        .init_containers
        .iter()
        .flatten()
        .filter(|c| c.restart_policy.as_deref() == Some("Always"));
    for c in spec.containers.iter().chain(running) {
        if let Some(port) = c
            .ports
            .iter()
            .flatten()
            .filter_map(|p| p.host_port)
            .find(|p| *p > 0)
        {
            return Err(Unplaceable::HostPort {
                container: c.name.clone(),
                port,
            });
        }
    }
    for v in spec.volumes.iter().flatten() {
        let kind = [
            (v.persistent_volume_claim.is_some(), "a PersistentVolumeClaim"),
            (v.ephemeral.is_some(), "an ephemeral volume claim"),
            (v.gce_persistent_disk.is_some(), "a GCE persistent disk"),
            (v.aws_elastic_block_store.is_some(), "an AWS EBS volume"),
            (v.azure_disk.is_some(), "an Azure disk"),
            (v.azure_file.is_some(), "an Azure file share"),
            (v.cinder.is_some(), "a Cinder volume"),
            (v.vsphere_volume.is_some(), "a vSphere volume"),
            (v.portworx_volume.is_some(), "a Portworx volume"),
            (v.rbd.is_some(), "an RBD image"),
            (v.iscsi.is_some(), "an iSCSI volume"),
        ]
        .into_iter()
        .find_map(|(is, kind)| is.then_some(kind));
        if let Some(kind) = kind {
            return Err(Unplaceable::Volume {
                name: v.name.clone(),
                kind,
            });
        }
    }
    // NodeDeclaredFeatures' `InferForScheduling` in 1.36.
    let restarts_all = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .flat_map(|c| c.restart_policy_rules.iter().flatten())
        .any(|r| r.action == "RestartAllContainers");
    if restarts_all {
        return Err(Unplaceable::NodeFeature("RestartAllContainersOnContainerExits"));
    }
    if spec.host_network == Some(true) && spec.host_users == Some(false) {
        return Err(Unplaceable::NodeFeature("UserNamespacesHostNetworkSupport"));
    }
    Ok(())
}

/// One toleration; `Lt`/`Gt` never get here.
#[derive(Debug, Clone)]
struct Tol {
    key: String,
    op: TolOp,
    value: String,
    effect: String,
}

#[derive(Debug, Clone, Copy)]
enum TolOp {
    Equal,
    Exists,
    /// An operator kube-scheduler does not know.
    Never,
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn pod(spec: Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "default"}, "spec": spec}))
            .unwrap()
    }

    fn rules(spec: Value) -> PodRules {
        PodRules::of(&pod(spec)).unwrap()
    }

    /// A container as the API server returns it (requests already defaulted from limits).
    fn ctr(name: &str, requests: Value) -> Value {
        json!({"name": name, "image": "x", "resources": {"requests": requests}})
    }

    fn node(v: Value) -> NodeFacts {
        NodeFacts::from_node(&serde_json::from_value(v).unwrap())
    }

    /// A roomy node named `name` with `labels`.
    fn labelled(name: &str, labels: Value) -> NodeFacts {
        node(json!({
            "metadata": {"name": name, "labels": labels},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "ephemeral-storage": "1Ti", "pods": "110"}},
        }))
    }

    fn tainted(taints: Value) -> NodeFacts {
        node(json!({
            "metadata": {"name": "n"},
            "spec": {"taints": taints},
            "status": {"allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"}},
        }))
    }

    fn app() -> Value {
        json!([ctr("app", json!({}))])
    }

    fn with_affinity(terms: Value) -> PodRules {
        rules(json!({"containers": app(), "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}}))
    }

    fn expr(key: &str, op: &str, values: Value) -> Value {
        json!([{"matchExpressions": [{"key": key, "operator": op, "values": values}]}])
    }

    const AFFINITY: &str = "node(s) didn't match Pod's node affinity/selector";

    fn matched(rules: &PodRules, labels: Value) -> bool {
        match rules.admits(&labelled("n", labels), Resources::default()) {
            Ok(()) => true,
            Err(why) => {
                assert_eq!(why, AFFINITY);
                false
            }
        }
    }

    #[test]
    fn in_and_not_in() {
        let r = with_affinity(expr("gpu", "In", json!(["a100", "h100"])));
        assert!(matched(&r, json!({"gpu": "h100"})));
        assert!(!matched(&r, json!({"gpu": "t4"})));
        assert!(!matched(&r, json!({})));
        let r = with_affinity(expr("gpu", "NotIn", json!(["t4"])));
        assert!(matched(&r, json!({"gpu": "h100"})));
        assert!(!matched(&r, json!({"gpu": "t4"})));
        // `Requirement.Matches`: NotIn matches a node without the label.
        assert!(matched(&r, json!({})));
    }

    #[test]
    fn exists_and_does_not_exist() {
        let r = with_affinity(json!([{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]));
        assert!(matched(&r, json!({"gpu": ""})));
        assert!(!matched(&r, json!({"cpu": "x"})));
        let r = with_affinity(json!([{"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}]));
        assert!(matched(&r, json!({})));
        assert!(!matched(&r, json!({"gpu": "a"})));
        // `NewRequirement`: Exists with values does not parse, so the term matches nothing.
        let r = with_affinity(expr("gpu", "Exists", json!(["a"])));
        assert!(!matched(&r, json!({"gpu": "a"})));
    }

    #[test]
    fn gt_and_lt() {
        let r = with_affinity(expr("mem", "Gt", json!(["40"])));
        assert!(matched(&r, json!({"mem": "80"})));
        assert!(!matched(&r, json!({"mem": "40"})), "strictly greater");
        assert!(!matched(&r, json!({"mem": "8"})));
        // `strconv.ParseInt` of the label: leading zeros are fine, anything else not an integer fails.
        assert!(matched(&r, json!({"mem": "080"})));
        assert!(!matched(&r, json!({"mem": "80Gi"})));
        assert!(!matched(&r, json!({"mem": "4e3"})));
        assert!(!matched(&r, json!({})));
        let r = with_affinity(expr("mem", "Lt", json!(["40"])));
        assert!(matched(&r, json!({"mem": "39"})));
        assert!(!matched(&r, json!({"mem": "40"})), "strictly less");
        // Beyond int64 does not parse.
        assert!(!matched(&r, json!({"mem": "-99999999999999999999"})));
        // The term does not parse: two values, a value not an integer, and a negative one (it is not a
        // valid label value, which `NewRequirement` checks too).
        for values in [json!(["1", "2"]), json!(["4k"]), json!(["-5"]), json!([])] {
            let r = with_affinity(expr("mem", "Gt", values.clone()));
            assert!(!matched(&r, json!({"mem": "100"})), "{values}");
        }
    }

    #[test]
    fn bad_requirements_fail_only_their_term() {
        // `LazyErrorNodeSelector.Match`: a term that does not parse is skipped, another may match.
        for bad in [
            json!({"key": "gpu", "operator": "Like", "values": ["a"]}),
            json!({"key": "gpu", "operator": "In", "values": []}),
            json!({"key": "gpu", "operator": "In", "values": ["a b"]}),
            json!({"key": "bad key", "operator": "Exists"}),
            json!({"key": "Example.com/gpu", "operator": "Exists"}),
            json!({"key": "a/b/c", "operator": "Exists"}),
        ] {
            let r = with_affinity(json!([{"matchExpressions": [bad.clone()]}]));
            assert!(
                !matched(
                    &r,
                    json!({"gpu": "a", "bad key": "a", "Example.com/gpu": "", "a/b/c": ""})
                ),
                "{bad}"
            );
            let r = with_affinity(json!([
                {"matchExpressions": [bad.clone()]},
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]},
            ]));
            assert!(matched(&r, json!({"zone": "z1"})), "{bad}");
        }
        // Prefixed keys are fine.
        let r =
            with_affinity(json!([{"matchExpressions": [{"key": "gpumem.io/model", "operator": "Exists"}]}]));
        assert!(matched(&r, json!({"gpumem.io/model": "A100"})));
    }

    #[test]
    fn terms_are_ored_requirements_anded() {
        let r = with_affinity(json!([
            {"matchExpressions": [
                {"key": "gpu", "operator": "In", "values": ["a100"]},
                {"key": "zone", "operator": "In", "values": ["z1"]},
            ]},
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]},
        ]));
        assert!(matched(&r, json!({"gpu": "a100", "zone": "z1"})));
        assert!(!matched(&r, json!({"gpu": "a100", "zone": "z2"})));
        assert!(matched(&r, json!({"gpu": "h100", "zone": "z2"})));
    }

    #[test]
    fn empty_terms_match_nothing() {
        // `NewLazyErrorNodeSelector` drops an empty term; no term left matches no node.
        assert!(!matched(&with_affinity(json!([{}])), json!({})));
        assert!(!matched(
            &with_affinity(json!([{"matchExpressions": [], "matchFields": []}])),
            json!({})
        ));
        assert!(!matched(&with_affinity(json!([])), json!({})));
        // An empty term beside one that matches does not matter.
        let r = with_affinity(json!([{}, {"matchExpressions": [{"key": "a", "operator": "Exists"}]}]));
        assert!(matched(&r, json!({"a": "1"})));
        // No required affinity at all: any node.
        assert!(matched(
            &rules(json!({"containers": app(), "affinity": {"nodeAffinity": {}}})),
            json!({})
        ));
    }

    fn required_terms(spec: &PodSpec) -> &[NodeSelectorTerm] {
        &required_node_affinity(spec)
            .expect("a required node affinity")
            .node_selector_terms
    }

    #[test]
    fn a_pinned_pod_admits_its_node_only_and_keeps_its_own_rules() {
        let admits = |spec: &PodSpec, name: &str, labels: Value| {
            let pod = Pod {
                spec: Some(spec.clone()),
                ..Pod::default()
            };
            PodRules::of(&pod)
                .expect("rules")
                .admits(&labelled(name, labels), Resources::default())
                .is_ok()
        };
        let pin = |spec: &mut PodSpec, node: &str| {
            let selector = pinned_to(spec, node);
            spec.affinity
                .get_or_insert_default()
                .node_affinity
                .get_or_insert_default()
                .required_during_scheduling_ignored_during_execution = Some(selector);
        };
        // No affinity: one term naming the node.
        let mut spec: PodSpec = serde_json::from_value(json!({"containers": app()})).expect("spec");
        pin(&mut spec, "gpu-1");
        assert!(admits(&spec, "gpu-1", json!({})));
        assert!(!admits(&spec, "gpu-2", json!({})));
        let terms = required_terms(&spec);
        assert_eq!(terms.len(), 1);

        // Two terms, ORed: each gains the node (no term added, the old requirements first, as the
        // API server requires of a gated pod); the empty one, which matches nothing, stays empty.
        let mut spec: PodSpec =
            serde_json::from_value(json!({"containers": app(), "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                {}]}}}}))
            .expect("spec");
        pin(&mut spec, "gpu-1");
        let terms = required_terms(&spec);
        assert_eq!(terms.len(), 3);
        assert_eq!(terms[0].match_expressions.as_ref().expect("kept")[0].key, "zone");
        assert_eq!(
            terms[1].match_fields.as_ref().expect("pinned")[0].values,
            Some(vec!["gpu-1".to_string()])
        );
        assert!(terms[2].match_expressions.is_none() && terms[2].match_fields.is_none());
        assert!(admits(&spec, "gpu-1", json!({"zone": "b"})));
        assert!(!admits(&spec, "gpu-2", json!({"zone": "b"})), "another node");
        assert!(
            !admits(&spec, "gpu-1", json!({"zone": "c"})),
            "its own rule still holds"
        );
    }

    #[test]
    fn only_a_pod_that_asks_what_the_placer_weighs_is_pinned() {
        let asks = |requests: Value| -> PodSpec {
            serde_json::from_value(json!({"containers": [ctr("app", requests)]})).expect("spec")
        };
        assert_eq!(unweighed_request(&asks(json!({}))), None);
        assert_eq!(
            unweighed_request(&asks(
                json!({"cpu": "2", "memory": "1Gi", "ephemeral-storage": "1Gi"})
            )),
            None
        );
        assert_eq!(
            unweighed_request(&asks(json!({"cpu": "2", "rdma/ib": "1"}))).as_deref(),
            Some("rdma/ib")
        );
        assert_eq!(
            unweighed_request(&asks(json!({"hugepages-2Mi": "1Gi"}))).as_deref(),
            Some("hugepages-2Mi")
        );
        // An init container's, and the pod's overhead, count too.
        let mut s = asks(json!({}));
        s.init_containers = Some(vec![
            serde_json::from_value(ctr("init", json!({"example.com/fpga": "1"}))).expect("ctr"),
        ]);
        assert_eq!(unweighed_request(&s).as_deref(), Some("example.com/fpga"));
        let mut s = asks(json!({}));
        s.overhead = Some(BTreeMap::from([(
            "example.com/sandbox".to_string(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("1".into()),
        )]));
        assert_eq!(unweighed_request(&s).as_deref(), Some("example.com/sandbox"));
    }

    #[test]
    fn match_fields() {
        let fields = |op: &str, values: Value| {
            with_affinity(
                json!([{"matchFields": [{"key": "metadata.name", "operator": op, "values": values}]}]),
            )
        };
        let admits =
            |r: &PodRules, name: &str| r.admits(&labelled(name, json!({})), Resources::default()).is_ok();
        let r = fields("In", json!(["gpu-1"]));
        assert!(admits(&r, "gpu-1"));
        assert!(!admits(&r, "gpu-2"));
        let r = fields("NotIn", json!(["gpu-1"]));
        assert!(!admits(&r, "gpu-1"));
        assert!(admits(&r, "gpu-2"));
        // Field requirements need exactly one value and In/NotIn.
        assert!(!admits(&fields("In", json!(["gpu-1", "gpu-2"])), "gpu-1"));
        assert!(!admits(&fields("Exists", json!([])), "gpu-1"));
        // Another field reads as "" (`fields.Set.Get`): In never matches, NotIn always.
        let other = |op: &str| {
            with_affinity(
                json!([{"matchFields": [{"key": "metadata.uid", "operator": op, "values": ["x"]}]}]),
            )
        };
        assert!(!admits(&other("In"), "gpu-1"));
        assert!(admits(&other("NotIn"), "gpu-1"));
        // Fields and expressions of one term are ANDed.
        let r = with_affinity(json!([{
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-1"]}],
            "matchExpressions": [{"key": "gpu", "operator": "Exists"}],
        }]));
        assert!(
            r.admits(&labelled("gpu-1", json!({"gpu": "a"})), Resources::default())
                .is_ok()
        );
        assert!(
            r.admits(&labelled("gpu-1", json!({})), Resources::default())
                .is_err()
        );
        assert!(
            r.admits(&labelled("gpu-2", json!({"gpu": "a"})), Resources::default())
                .is_err()
        );
    }

    #[test]
    fn node_selector_and_affinity_together() {
        let r = rules(json!({
            "containers": app(),
            "nodeSelector": {"pool": "gpu", "tier": "a"},
            "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": expr("gpu", "In", json!(["h100"]))},
                // Only scores.
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 1, "preference": {"matchExpressions": [{"key": "x", "operator": "Exists"}]}}],
            }},
        }));
        assert!(matched(&r, json!({"pool": "gpu", "tier": "a", "gpu": "h100"})));
        assert!(
            !matched(&r, json!({"pool": "gpu", "gpu": "h100"})),
            "every nodeSelector label"
        );
        assert!(!matched(&r, json!({"pool": "gpu", "tier": "b", "gpu": "h100"})));
        assert!(
            !matched(&r, json!({"pool": "gpu", "tier": "a", "gpu": "t4"})),
            "and the affinity"
        );
        // An empty nodeSelector selects every node.
        assert!(matched(
            &rules(json!({"containers": app(), "nodeSelector": {}})),
            json!({})
        ));
    }

    #[test]
    fn node_name() {
        let r = rules(json!({"containers": app(), "nodeName": "gpu-1"}));
        assert!(
            r.admits(&labelled("gpu-1", json!({})), Resources::default())
                .is_ok()
        );
        assert_eq!(
            r.admits(&labelled("gpu-2", json!({})), Resources::default()),
            Err("node(s) didn't match the requested node name".into())
        );
        let r = rules(json!({"containers": app(), "nodeName": ""}));
        assert!(
            r.admits(&labelled("gpu-2", json!({})), Resources::default())
                .is_ok()
        );
    }

    fn tolerated(tolerations: Value, taints: Value) -> Result<(), String> {
        rules(json!({"containers": app(), "tolerations": tolerations}))
            .admits(&tainted(taints), Resources::default())
    }

    #[test]
    fn taints_need_tolerations() {
        let gpu = json!([{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]);
        assert_eq!(
            tolerated(json!([]), gpu.clone()),
            Err("node(s) had untolerated taint {nvidia.com/gpu: }".into())
        );
        let execute = json!([{"key": "k", "value": "v", "effect": "NoExecute"}]);
        assert_eq!(
            tolerated(json!([]), execute.clone()),
            Err("node(s) had untolerated taint {k: v}".into())
        );
        assert_eq!(
            tolerated(
                json!([{"key": "k", "operator": "Exists", "effect": "NoExecute"}]),
                execute
            ),
            Ok(())
        );
        // PreferNoSchedule only scores.
        assert_eq!(
            tolerated(json!([]), json!([{"key": "k", "effect": "PreferNoSchedule"}])),
            Ok(())
        );
    }

    #[test]
    fn toleration_forms() {
        let taint = json!([{"key": "k", "value": "v", "effect": "NoSchedule"}]);
        let ok = |t: Value| tolerated(json!([t]), taint.clone()).is_ok();
        // Exists with an empty key tolerates every taint.
        assert!(ok(json!({"operator": "Exists"})));
        assert!(ok(json!({"key": "k", "operator": "Exists"})));
        assert!(!ok(json!({"key": "other", "operator": "Exists"})));
        // Equal (or no operator) compares the value.
        assert!(ok(json!({"key": "k", "operator": "Equal", "value": "v"})));
        assert!(ok(json!({"key": "k", "value": "v"})));
        assert!(!ok(json!({"key": "k", "operator": "Equal", "value": "w"})));
        assert!(
            !ok(json!({"key": "k", "operator": "Equal"})),
            "no value is the empty value"
        );
        assert!(
            tolerated(
                json!([{"key": "k", "operator": "Equal"}]),
                json!([{"key": "k", "effect": "NoSchedule"}])
            )
            .is_ok()
        );
        // An empty effect matches every effect; a set one only its own.
        assert!(ok(json!({"key": "k", "operator": "Exists", "effect": ""})));
        assert!(ok(
            json!({"key": "k", "operator": "Exists", "effect": "NoSchedule"})
        ));
        assert!(!ok(
            json!({"key": "k", "operator": "Exists", "effect": "NoExecute"})
        ));
        assert!(!ok(
            json!({"key": "k", "operator": "Exists", "effect": "PreferNoSchedule"})
        ));
        // `ToleratesTaint`: an unknown operator tolerates nothing.
        assert!(!ok(json!({"key": "k", "operator": "exists"})));
        // An empty key with Equal (API validation forbids it) matches any key with the value.
        assert!(ok(json!({"operator": "Equal", "value": "v"})));
        // Every taint must be tolerated.
        let two =
            json!([{"key": "k", "value": "v", "effect": "NoSchedule"}, {"key": "j", "effect": "NoExecute"}]);
        assert_eq!(
            tolerated(json!([{"key": "k", "operator": "Exists"}]), two.clone()),
            Err("node(s) had untolerated taint {j: }".into())
        );
        assert!(
            tolerated(
                json!([{"key": "k", "operator": "Exists"}, {"key": "j", "operator": "Exists"}]),
                two
            )
            .is_ok()
        );
    }

    #[test]
    fn cordoned_nodes() {
        let cordoned = node(json!({
            "metadata": {"name": "n"},
            "spec": {"unschedulable": true, "taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"}},
        }));
        let admits = |tolerations: Value| {
            rules(json!({"containers": app(), "tolerations": tolerations}))
                .admits(&cordoned, Resources::default())
        };
        // NodeUnschedulable runs before TaintToleration, so its reason is the one reported.
        assert_eq!(admits(json!([])), Err("node(s) were unschedulable".into()));
        assert_eq!(
            admits(
                json!([{"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}])
            ),
            Ok(())
        );
        assert_eq!(admits(json!([{"operator": "Exists"}])), Ok(()));
        assert_eq!(
            admits(
                json!([{"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoExecute"}])
            ),
            Err("node(s) were unschedulable".into())
        );
        // The flag alone rejects as well (kube-scheduler does not wait for the controller's taint).
        let flag_only = node(
            json!({"metadata": {"name": "n"}, "spec": {"unschedulable": true}, "status": {"allocatable": {"pods": "1"}}}),
        );
        assert_eq!(
            rules(json!({"containers": app()})).admits(&flag_only, Resources::default()),
            Err("node(s) were unschedulable".into())
        );
    }

    fn requested(spec: Value) -> Resources {
        rules(spec).request
    }

    #[test]
    fn requests_of_containers_and_init_containers() {
        // fit.go's example: init containers set the minimum, app containers add up.
        let r = requested(json!({
            "initContainers": [ctr("i1", json!({"cpu": "2", "memory": "1G"})), ctr("i2", json!({"cpu": "2", "memory": "3G"}))],
            "containers": [ctr("c1", json!({"cpu": "2", "memory": "1G"})), ctr("c2", json!({"cpu": "1", "memory": "1G"}))],
        }));
        assert_eq!(
            r,
            Resources {
                cpu_milli: 3000,
                memory_bytes: 3_000_000_000,
                ephemeral_bytes: 0,
                pods: 1
            }
        );
        // cpu rounds up to millicores, memory to bytes.
        let r = requested(
            json!({"containers": [ctr("c", json!({"cpu": "0.0001", "memory": "1.5", "ephemeral-storage": "1Ki"}))]}),
        );
        assert_eq!(
            r,
            Resources {
                cpu_milli: 1,
                memory_bytes: 2,
                ephemeral_bytes: 1024,
                pods: 1
            }
        );
    }

    #[test]
    fn sidecars_add_up() {
        // `AggregateContainerRequests`: a sidecar runs beside the init containers after it and the app.
        let r = requested(json!({
            "initContainers": [
                ctr("init1", json!({"cpu": "1"})),
                {"name": "side", "image": "x", "restartPolicy": "Always", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
                ctr("init2", json!({"cpu": "2", "memory": "512Mi"})),
            ],
            "containers": [ctr("app", json!({"cpu": "1", "memory": "1Gi"}))],
        }));
        // cpu: max(app 1 + side 0.5, init1 1, side 0.5 + init2 2) = 2.5; memory: max(2Gi, 1Gi + 512Mi).
        assert_eq!(r.cpu_milli, 2500);
        assert_eq!(r.memory_bytes, 2 << 30);
        // A sidecar with no init container after it still runs beside the app.
        let r = requested(
            json!({"containers": [ctr("app", json!({"cpu": "1"}))], "initContainers": [
            {"name": "s", "image": "x", "restartPolicy": "Always", "resources": {"requests": {"cpu": "1"}}}]}),
        );
        assert_eq!(r.cpu_milli, 2000);
    }

    #[test]
    fn overhead_and_pod_level_requests() {
        let r = requested(json!({
            "containers": [ctr("app", json!({"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi"}))],
            "overhead": {"cpu": "250m", "memory": "120Mi"},
        }));
        assert_eq!(
            (r.cpu_milli, r.memory_bytes, r.ephemeral_bytes),
            (1250, (1 << 30) + (120 << 20), 1 << 30)
        );
        // Pod-level requests (PodLevelResources, beta, on) replace cpu and memory, not
        // ephemeral-storage; overhead still adds.
        let r = requested(json!({
            "resources": {"requests": {"cpu": "4"}},
            "containers": [ctr("app", json!({"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi"}))],
            "overhead": {"cpu": "250m"},
        }));
        assert_eq!(
            (r.cpu_milli, r.memory_bytes, r.ephemeral_bytes),
            (4250, 1 << 30, 1 << 30)
        );
    }

    #[test]
    fn limits_are_not_requests() {
        // The API server defaults requests from limits when it admits the pod, so kube-scheduler and
        // the placer read requests only: a container with limits and no requests (not as the API
        // server sends it) requests nothing.
        let r = requested(
            json!({"containers": [{"name": "c", "image": "x", "resources": {"limits": {"cpu": "2"}}}]}),
        );
        assert_eq!(
            r,
            Resources {
                pods: 1,
                ..Resources::default()
            }
        );
    }

    #[test]
    fn running_pods_count_their_resized_resources() {
        let running = |condition: Value| {
            let mut p = pod(json!({"containers": [ctr("app", json!({"cpu": "1", "memory": "1Gi"}))]}));
            p.status = serde_json::from_value(json!({
                "phase": "Running",
                "conditions": condition,
                "containerStatuses": [{"name": "app", "image": "x", "imageID": "", "ready": true, "restartCount": 0,
                    "resources": {"requests": {"cpu": "2", "memory": "512Mi"}},
                    "allocatedResources": {"cpu": "2", "memory": "512Mi"}}],
            }))
            .unwrap();
            Resources::requested_by(&p)
        };
        // `determineEffectiveRequests`: the larger of spec, actuated and allocated...
        let r = running(json!([]));
        assert_eq!((r.cpu_milli, r.memory_bytes, r.pods), (2000, 1 << 30, 1));
        // ...but a resize found infeasible counts only what the kubelet runs.
        let r = running(json!([{"type": "PodResizePending", "status": "True", "reason": "Infeasible"}]));
        assert_eq!((r.cpu_milli, r.memory_bytes), (2000, 512 << 20));
    }

    fn gpu_node(allocatable: Value) -> NodeFacts {
        node(json!({"metadata": {"name": "n"}, "status": {"allocatable": allocatable}}))
    }

    #[test]
    fn resources_fit() {
        let n = gpu_node(json!({"cpu": "8", "memory": "32Gi", "ephemeral-storage": "100Gi", "pods": "110"}));
        let r = rules(json!({"containers": [ctr("app", json!({"cpu": "2", "memory": "8Gi"}))]}));
        let used = |cpu: u64, gib: u64| Resources {
            cpu_milli: cpu,
            memory_bytes: gib << 30,
            pods: 3,
            ..Resources::default()
        };
        assert_eq!(r.admits(&n, used(6000, 24)), Ok(()), "exactly full is a fit");
        assert_eq!(r.admits(&n, used(6001, 24)), Err("Insufficient cpu".into()));
        assert_eq!(
            r.admits(&n, used(7000, 25)),
            Err("Insufficient cpu, Insufficient memory".into())
        );
        // More in use than allocatable (the node shrank) leaves no room, without wrapping.
        assert_eq!(r.admits(&n, used(9000, 1)), Err("Insufficient cpu".into()));
        // Ephemeral storage is checked only when requested.
        let full_disk = Resources {
            ephemeral_bytes: 100 << 30,
            ..Resources::default()
        };
        assert_eq!(r.admits(&n, full_disk), Ok(()));
        let disk = rules(json!({"containers": [ctr("app", json!({"ephemeral-storage": "1"}))]}));
        assert_eq!(
            disk.admits(&n, full_disk),
            Err("Insufficient ephemeral-storage".into())
        );
    }

    #[test]
    fn memory_in_every_form() {
        for (allocatable, request, fits) in [
            ("1Gi", "1073741824", true),
            ("1073741824", "1Gi", true),
            ("1G", "1Gi", false),
            ("1Gi", "1G", true),
            ("1G", "1e9", true),
            ("1G", "1000000001", false),
            ("1024Mi", "1048576Ki", true),
            ("1.5Gi", "1536Mi", true),
        ] {
            let n = gpu_node(json!({"cpu": "1", "memory": allocatable, "pods": "1"}));
            let r = rules(json!({"containers": [ctr("app", json!({"memory": request}))]}));
            assert_eq!(
                r.admits(&n, Resources::default()).is_ok(),
                fits,
                "{request} in {allocatable}"
            );
        }
    }

    #[test]
    fn pod_count() {
        let n = gpu_node(json!({"cpu": "8", "memory": "8Gi", "pods": "2"}));
        // A pod that requests nothing still takes a pod slot (fitsRequest checks it first).
        let r = rules(json!({"containers": [ctr("app", json!({}))]}));
        assert_eq!(
            r.admits(
                &n,
                Resources {
                    pods: 1,
                    ..Resources::default()
                }
            ),
            Ok(())
        );
        assert_eq!(
            r.admits(
                &n,
                Resources {
                    pods: 2,
                    ..Resources::default()
                }
            ),
            Err("Too many pods".into())
        );
        let big = rules(json!({"containers": [ctr("app", json!({"cpu": "9"}))]}));
        assert_eq!(
            big.admits(
                &n,
                Resources {
                    pods: 2,
                    ..Resources::default()
                }
            ),
            Err("Too many pods, Insufficient cpu".into())
        );
        // No allocatable pods, or an unparsable count, is room for none.
        assert_eq!(
            r.admits(&gpu_node(json!({"cpu": "8"})), Resources::default()),
            Err("Too many pods".into())
        );
        assert_eq!(
            r.admits(&gpu_node(json!({"pods": "lots"})), Resources::default()),
            Err("Too many pods".into())
        );
    }

    #[test]
    fn in_use_adds_up_pods() {
        let on_node = [
            pod(json!({"containers": [ctr("a", json!({"cpu": "1", "memory": "1Gi"}))]})),
            pod(
                json!({"containers": [ctr("b", json!({"cpu": "500m", "ephemeral-storage": "2Gi"}))], "overhead": {"cpu": "100m"}}),
            ),
        ];
        let in_use: Resources = on_node.iter().map(Resources::requested_by).sum();
        assert_eq!(
            in_use,
            Resources {
                cpu_milli: 1600,
                memory_bytes: 1 << 30,
                ephemeral_bytes: 2 << 30,
                pods: 2
            }
        );
    }

    #[test]
    fn node_facts() {
        let facts = node(json!({
            "metadata": {"name": "gpu-1", "labels": {"a": "b"}, "annotations": {"x": "y"}},
            "spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"cpu": "7910m", "memory": "31Gi", "pods": "110", "nvidia.com/gpu": "8", "ephemeral-storage": "bad"}},
        }));
        assert_eq!(facts.name, "gpu-1");
        assert_eq!(facts.labels.get("a").map(String::as_str), Some("b"));
        assert_eq!(facts.taints.len(), 1);
        assert!(!facts.unschedulable);
        assert_eq!(
            facts.allocatable,
            Resources {
                cpu_milli: 7910,
                memory_bytes: 31 << 30,
                ephemeral_bytes: 0,
                pods: 110
            }
        );
        // Beyond u64 millis, a whole number of bytes still reads.
        let huge = gpu_node(json!({"ephemeral-storage": "16E"}));
        assert_eq!(huge.allocatable.ephemeral_bytes, 16_000_000_000_000_000_000);
        assert_eq!(NodeFacts::from_node(&Node::default()), NodeFacts::default());
    }

    fn unplaceable(spec: Value) -> Unplaceable {
        PodRules::of(&pod(spec)).unwrap_err()
    }

    #[test]
    fn left_to_kube_scheduler() {
        let term =
            json!([{"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"a": "b"}}}]);
        assert_eq!(
            unplaceable(
                json!({"containers": app(), "affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": term}}})
            ),
            Unplaceable::PodAffinity
        );
        assert_eq!(
            unplaceable(
                json!({"containers": app(), "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": term}}})
            ),
            Unplaceable::PodAntiAffinity
        );
        let spread = |when: &str| {
            json!({"containers": app(), "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": when}]})
        };
        assert_eq!(
            unplaceable(spread("DoNotSchedule")),
            Unplaceable::TopologySpread("topology.kubernetes.io/zone".into())
        );
        let port = |restart: Value| {
            json!({"containers": app(), "initContainers": [
                {"name": "side", "image": "x", "restartPolicy": restart, "ports": [{"containerPort": 80, "hostPort": 8080}]}]})
        };
        assert_eq!(
            unplaceable(port(json!("Always"))),
            Unplaceable::HostPort {
                container: "side".into(),
                port: 8080
            }
        );
        // What finishes before the app starts holds no port (`GetHostPorts`).
        assert!(PodRules::of(&pod(port(Value::Null))).is_ok());
        let volume = |v: Value| json!({"containers": app(), "volumes": [v]});
        assert!(matches!(
            unplaceable(volume(json!({"name": "data", "persistentVolumeClaim": {"claimName": "c"}}))),
            Unplaceable::Volume { name, .. } if name == "data"
        ));
        assert!(matches!(
            unplaceable(volume(
                json!({"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}})
            )),
            Unplaceable::Volume { .. }
        ));
        assert!(matches!(
            unplaceable(volume(
                json!({"name": "d", "awsElasticBlockStore": {"volumeID": "v"}})
            )),
            Unplaceable::Volume {
                kind: "an AWS EBS volume",
                ..
            }
        ));
        let rule =
            json!([{"action": "RestartAllContainers", "exitCodes": {"operator": "In", "values": [42]}}]);
        assert_eq!(
            unplaceable(json!({"containers": [{"name": "c", "image": "x", "restartPolicyRules": rule}]})),
            Unplaceable::NodeFeature("RestartAllContainersOnContainerExits")
        );
        assert_eq!(
            unplaceable(json!({"containers": app(), "hostNetwork": true, "hostUsers": false})),
            Unplaceable::NodeFeature("UserNamespacesHostNetworkSupport")
        );
        assert_eq!(
            unplaceable(
                json!({"containers": app(), "tolerations": [{"key": "k", "operator": "Gt", "value": "5"}]})
            ),
            Unplaceable::TolerationComparison("Gt".into())
        );
        // The reason reads as a sentence for the pod's events.
        assert!(Unplaceable::PodAffinity.to_string().contains("InterPodAffinity"));
    }

    #[test]
    fn placeable_despite() {
        // What only scores, or that no filter reads, does not send the pod away.
        let term = json!([{"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]);
        let r = PodRules::of(&pod(json!({
            "containers": [{"name": "c", "image": "x", "ports": [{"containerPort": 80}]}],
            "affinity": {
                "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": term, "requiredDuringSchedulingIgnoredDuringExecution": []},
                "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": term},
            },
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}],
            "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}, {"name": "cfg", "configMap": {"name": "c"}},
                        {"name": "inline", "csi": {"driver": "secrets.csi.k8s.io"}}],
        })));
        assert!(r.is_ok(), "{r:?}");
    }
}
