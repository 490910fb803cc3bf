//! RBAC: the agent, the scorer and the claim controller get the same rules from the chart with any
//! values and from deploy/manifests; each ClusterRole is bound to the ServiceAccount its workload runs
//! as; the claim controller's grants are exactly the calls it makes, its Lease's among them; the
//! second scheduler gets the built-in scheduler roles and its own Lease. What the rules grant is held to what
//! the code does by the agent's and the scorer's own tests: their fake API servers authorize every
//! request against these roles, and a test of each uses every grant (tests/support/k8s.rs). The
//! ValidatingAdmissionPolicy that RBAC needs for ResourceSlices holds the agent's own account, for
//! every slice write its roles allow.

mod deploy_support;

use std::collections::BTreeSet;

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use serde_json::{Value as Json, json};

use deploy_support::*;

/// What `gpumem claims controller` calls (src/claim/mod.rs, controller.rs), cluster-wide:
const CLAIMS_CALLS: &[&str] = &[
    // the startup check that the CRD is installed, and the claims' watch (list, then watch)
    "gpumem.io/gpuclaims:list",
    "gpumem.io/gpuclaims:watch",
    // replace_status: PUT .../gpuclaims/<name>/status
    "gpumem.io/gpuclaims/status:update",
    // its pods name the claim as owner with blockOwnerDeletion: OwnerReferencesPermissionEnforcement
    // admits that only for who may update the owner's finalizers
    "gpumem.io/gpuclaims/finalizers:update",
    // the pods' watch (label gpumem.io/claim) and each claim's list; its pod, created and replaced
    "core/pods:list",
    "core/pods:watch",
    "core/pods:create",
    "core/pods:delete",
    // kube's event recorder: a new Event, or a patch of its series when it repeats
    "events.k8s.io/events:create",
    "events.k8s.io/events:patch",
    // a claim of `path: dra`: its pod's ResourceClaimTemplate, made and deleted with the pod
    "resource.k8s.io/resourceclaimtemplates:create",
    "resource.k8s.io/resourceclaimtemplates:delete",
    // --dra-quotas: every claim, and the quotas named gpumem, watched; a quota's record patched
    "resource.k8s.io/resourceclaims:list",
    "resource.k8s.io/resourceclaims:watch",
    "core/resourcequotas:list",
    "core/resourcequotas:watch",
    "core/resourcequotas:patch",
];

fn set(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn of_kind<T: serde::de::DeserializeOwned>(docs: &[Json], kind: &str) -> Vec<T> {
    docs.iter().filter(|d| d["kind"] == kind).map(parse).collect()
}

/// The rules of ClusterRole `name` among `docs`, as `group/resource:verb`.
fn rules(docs: &[Json], name: &str, what: &str) -> BTreeSet<String> {
    let roles: Vec<ClusterRole> = of_kind(docs, "ClusterRole");
    let role = roles
        .iter()
        .find(|r| r.metadata.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("{what}: no {name}"));
    rbac_triples(role.rules.as_deref().unwrap_or_default())
}

/// Checks a set of objects (one rendering, or the manifests): the three ClusterRoles grant what the
/// chart's with default values grant, the claim controller's exactly its calls; their bindings, the
/// workloads' service accounts, the Leases' Roles, and the second scheduler's roles when it is there.
fn check(docs: &[Json], what: &str) {
    let roles: Vec<ClusterRole> = of_kind(docs, "ClusterRole");
    let bindings: Vec<ClusterRoleBinding> = of_kind(docs, "ClusterRoleBinding");
    let defaults = chart(&json!({}));
    for (name, workload_kind, workload_name) in [
        ("gpumem-agent", "DaemonSet", "gpumem-agent"),
        ("gpumem-agent-dra", "DaemonSet", "gpumem-agent"),
        ("gpumem-scorer", "Deployment", "gpumem-scorer"),
        ("gpumem-scorer-dra", "Deployment", "gpumem-scorer"),
        ("gpumem-claims", "Deployment", "gpumem-claims"),
    ] {
        assert_eq!(
            rules(docs, name, what),
            rules(&defaults, name, "chart, default values"),
            "{what}: rules of {name}"
        );
        let binding = bindings.iter().find(|b| b.role_ref.name == name).unwrap();
        assert_eq!(binding.role_ref.kind, "ClusterRole");
        let subjects = binding.subjects.as_ref().unwrap();
        assert_eq!(subjects.len(), 1);
        let workload = docs
            .iter()
            .find(|d| d["kind"] == workload_kind && d["metadata"]["name"] == workload_name)
            .unwrap();
        assert_eq!(
            workload["spec"]["template"]["spec"]["serviceAccountName"],
            subjects[0].name.as_str()
        );
        assert_eq!(
            workload["metadata"]["namespace"],
            subjects[0].namespace.as_deref().unwrap()
        );
        assert!(
            docs.iter()
                .any(|d| d["kind"] == "ServiceAccount" && d["metadata"]["name"] == subjects[0].name.as_str())
        );
    }
    // Nothing else gets a ClusterRole of ours; the scheduler binds the built-in ones. The two roles
    // for users are bound by no one: Kubernetes aggregates them into edit/admin and view.
    let ours: BTreeSet<_> = roles.iter().map(|r| r.metadata.name.clone().unwrap()).collect();
    assert_eq!(
        ours,
        set(&[
            "gpumem-agent",
            "gpumem-agent-dra",
            "gpumem-scorer",
            "gpumem-scorer-dra",
            "gpumem-claims",
            "gpumem-gpuclaims-edit",
            "gpumem-gpuclaims-view"
        ]),
        "{what}"
    );
    check_user_roles(&roles, what);
    check_claims(docs, what);
    // The admission policy ships when the DRA path's objects do (dra.nodeRestriction).
    if docs.iter().any(|d| d["kind"] == "ValidatingAdmissionPolicy") {
        check_slice_policy(docs, what);
    }
    let roles: Vec<Role> = of_kind(docs, "Role");
    let role_bindings: Vec<RoleBinding> = of_kind(docs, "RoleBinding");
    // A Role for each Lease, nothing else.
    let scheduler_there = docs
        .iter()
        .any(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "gpumem-scheduler");
    let mut leases = vec![
        "gpumem-claims-lease",
        "gpumem-scorer-lease",
        "gpumem-scorer-bookings",
    ];
    if scheduler_there {
        leases.push("gpumem-scheduler-lease");
    }
    let names: BTreeSet<_> = roles.iter().map(|r| r.metadata.name.clone().unwrap()).collect();
    assert_eq!(names, set(&leases), "{what}: a Role for each Lease");
    // The scorer's DRA placement Lease, by the name its configuration gives it with dra.placement.
    let scorer_lease = roles
        .iter()
        .find(|r| r.metadata.name.as_deref() == Some("gpumem-scorer-lease"))
        .unwrap();
    assert_eq!(
        rbac_triples(scorer_lease.rules.as_deref().unwrap()),
        set(&[
            "coordination.k8s.io/leases:create",
            "coordination.k8s.io/leases[gpumem-dra-placement]:get",
            "coordination.k8s.io/leases[gpumem-dra-placement]:update",
        ]),
        "{what}"
    );
    // The scorer's bookings: one Lease per node, named after it, so no resourceNames.
    let bookings = roles
        .iter()
        .find(|r| r.metadata.name.as_deref() == Some("gpumem-scorer-bookings"))
        .unwrap();
    assert_eq!(
        rbac_triples(bookings.rules.as_deref().unwrap()),
        set(&[
            "coordination.k8s.io/leases:create",
            "coordination.k8s.io/leases:get",
            "coordination.k8s.io/leases:update",
        ]),
        "{what}"
    );
    let placing = chart(&json!({"dra": {"placement": true}}));
    let config = placing
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "gpumem-scorer")
        .and_then(|d| d["data"]["scorer.yaml"].as_str())
        .unwrap();
    assert!(config.contains("leaseName: gpumem-dra-placement"), "{config}");
    if let Some(scheduler) = docs
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "gpumem-scheduler")
    {
        let sa = scheduler["spec"]["template"]["spec"]["serviceAccountName"]
            .as_str()
            .unwrap();
        let builtin: BTreeSet<_> = bindings
            .iter()
            .filter(|b| b.subjects.iter().flatten().any(|s| s.name == sa))
            .map(|b| b.role_ref.name.clone())
            .collect();
        assert_eq!(
            builtin,
            set(&["system:kube-scheduler", "system:volume-scheduler"]),
            "{what}"
        );
        let auth = role_bindings
            .iter()
            .find(|b| b.role_ref.name == "extension-apiserver-authentication-reader")
            .unwrap();
        assert_eq!(auth.metadata.namespace.as_deref(), Some("kube-system"));
        let role = roles
            .iter()
            .find(|r| r.metadata.name.as_deref() == Some("gpumem-scheduler-lease"))
            .unwrap();
        let lease = rbac_triples(role.rules.as_deref().unwrap());
        let name = scheduler_name(docs);
        assert_eq!(
            lease,
            set(&[
                "coordination.k8s.io/leases:create",
                &format!("coordination.k8s.io/leases[{name}]:get"),
                &format!("coordination.k8s.io/leases[{name}]:update"),
            ]),
            "{what}"
        );
    }
}

/// The claim controller's grants: exactly its calls, and its Lease by the name its Deployment
/// passes, in its namespace, bound to its account.
/// The roles for the users of claims: aggregated into the built-in ones, about GPUClaims only, and
/// only `edit`/`admin` may write.
fn check_user_roles(roles: &[ClusterRole], what: &str) {
    let role = |name: &str| {
        roles
            .iter()
            .find(|r| r.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("{what}: no {name}"))
    };
    let aggregated = |r: &ClusterRole| -> BTreeSet<String> {
        let labels = r.metadata.labels.clone().unwrap_or_default();
        labels
            .into_iter()
            .filter(|(k, v)| k.starts_with("rbac.authorization.k8s.io/aggregate-to-") && v == "true")
            .map(|(k, _)| k.rsplit('-').next().unwrap().to_string())
            .collect()
    };
    let edit = role("gpumem-gpuclaims-edit");
    assert_eq!(aggregated(edit), set(&["admin", "edit"]), "{what}");
    let granted = rbac_triples(edit.rules.as_deref().unwrap_or_default());
    let writes = ["create", "delete", "deletecollection", "patch", "update"];
    for verb in writes.iter().chain(&["get", "list", "watch"]) {
        assert!(
            granted.contains(&format!("gpumem.io/gpuclaims:{verb}")),
            "{what}: edit {verb}"
        );
    }
    assert!(
        granted.iter().all(|g| g.starts_with("gpumem.io/gpuclaims:")),
        "{what}: {granted:?}"
    );
    let view = role("gpumem-gpuclaims-view");
    assert_eq!(aggregated(view), set(&["view"]), "{what}");
    let granted = rbac_triples(view.rules.as_deref().unwrap_or_default());
    assert!(
        granted.iter().all(|g| g.starts_with("gpumem.io/gpuclaims")
            && ["get", "list", "watch"]
                .iter()
                .any(|v| g.ends_with(&format!(":{v}")))),
        "{what}: view only reads: {granted:?}"
    );
    assert!(granted.contains("gpumem.io/gpuclaims:list"), "{what}");
}

fn check_claims(docs: &[Json], what: &str) {
    assert_eq!(
        rules(docs, "gpumem-claims", what),
        set(CLAIMS_CALLS),
        "{what}: the claim controller's calls, no more"
    );
    let roles: Vec<Role> = of_kind(docs, "Role");
    let role_bindings: Vec<RoleBinding> = of_kind(docs, "RoleBinding");
    let claims = docs
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "gpumem-claims")
        .unwrap();
    let lease = claims["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|a| a.as_str().unwrap().strip_prefix("--lease-name="))
        .expect("--lease-name");
    let namespace = claims["metadata"]["namespace"].as_str().unwrap();
    let binding = role_bindings
        .iter()
        .find(|b| b.metadata.name.as_deref() == Some("gpumem-claims-lease"))
        .unwrap();
    assert_eq!(binding.metadata.namespace.as_deref(), Some(namespace));
    assert_eq!(binding.role_ref.kind, "Role");
    let subjects = binding.subjects.as_deref().unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(
        (subjects[0].name.as_str(), subjects[0].namespace.as_deref()),
        (
            claims["spec"]["template"]["spec"]["serviceAccountName"]
                .as_str()
                .unwrap(),
            Some(namespace)
        )
    );
    let role = roles
        .iter()
        .find(|r| r.metadata.name.as_deref() == Some(binding.role_ref.name.as_str()))
        .unwrap();
    assert_eq!(role.metadata.namespace.as_deref(), Some(namespace));
    assert_eq!(
        rbac_triples(role.rules.as_deref().unwrap()),
        set(&[
            "coordination.k8s.io/leases:create",
            &format!("coordination.k8s.io/leases[{lease}]:get"),
            &format!("coordination.k8s.io/leases[{lease}]:update"),
        ]),
        "{what}: the claim controller's Lease"
    );
}

/// The admission policy that keeps each agent to its own node's ResourceSlices (RBAC cannot): it
/// matches the account the agent's DaemonSet runs as, the one its DRA role is bound to, and every
/// write of a slice that the agent's roles allow.
fn check_slice_policy(docs: &[Json], what: &str) {
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{what}: no {kind} {name}"))
    };
    let agent = find("DaemonSet", "gpumem-agent");
    let account = format!(
        "system:serviceaccount:{}:{}",
        agent["metadata"]["namespace"].as_str().unwrap(),
        agent["spec"]["template"]["spec"]["serviceAccountName"]
            .as_str()
            .unwrap()
    );
    let dra_binding: ClusterRoleBinding = parse(find("ClusterRoleBinding", "gpumem-agent-dra"));
    let subject = &dra_binding.subjects.as_ref().unwrap()[0];
    assert_eq!(
        format!(
            "system:serviceaccount:{}:{}",
            subject.namespace.as_deref().unwrap(),
            subject.name
        ),
        account,
        "{what}"
    );
    let policy: ValidatingAdmissionPolicy = parse(find("ValidatingAdmissionPolicy", "gpumem-agent-slices"));
    let spec = policy.spec.unwrap();
    let conditions: Vec<_> = spec
        .match_conditions
        .iter()
        .flatten()
        .map(|c| c.expression.as_str())
        .collect();
    assert_eq!(
        conditions,
        [format!("request.userInfo.username == '{account}'")],
        "{what}: the policy holds the agent's account"
    );
    // The admission operations of the agent's grants on resourceslices (a server-side apply, a
    // patch, creates the slice when there is none).
    let mut granted = rules(docs, "gpumem-agent", what);
    granted.extend(rules(docs, "gpumem-agent-dra", what));
    let mut needed = BTreeSet::new();
    for grant in &granted {
        if let Some(verb) = grant.strip_prefix("resource.k8s.io/resourceslices:") {
            needed.extend(match verb {
                "create" => &["CREATE"][..],
                "update" => &["UPDATE"][..],
                "patch" => &["CREATE", "UPDATE"][..],
                "delete" | "deletecollection" => &["DELETE"][..],
                _ => &[][..],
            });
        }
    }
    assert!(!needed.is_empty(), "{what}: the agent writes ResourceSlices");
    let rules = spec.match_constraints.unwrap().resource_rules.unwrap_or_default();
    let covered: BTreeSet<&str> = rules
        .iter()
        .filter(|r| {
            r.api_groups.iter().flatten().any(|g| g == "resource.k8s.io")
                && r.resources.iter().flatten().any(|g| g == "resourceslices")
                && r.api_versions.iter().flatten().any(|v| v == "*")
        })
        .flat_map(|r| r.operations.iter().flatten().map(String::as_str))
        .collect();
    assert!(
        needed.is_subset(&covered),
        "{what}: the agent may {needed:?} ResourceSlices, the policy sees {covered:?}"
    );
    let binding: ValidatingAdmissionPolicyBinding =
        parse(find("ValidatingAdmissionPolicyBinding", "gpumem-agent-slices"));
    assert_eq!(
        Some(&binding.spec.policy_name),
        policy.metadata.name.as_ref(),
        "{what}"
    );
    assert_eq!(binding.spec.validation_actions, ["Deny"], "{what}");
}

/// The Lease name in the second scheduler's configuration.
fn scheduler_name(docs: &[Json]) -> String {
    let cm = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "gpumem-scheduler")
        .unwrap();
    let config = &yaml_docs(
        cm["data"]["scheduler-config.yaml"].as_str().unwrap(),
        "scheduler-config.yaml",
    )[0];
    config["leaderElection"]["resourceName"]
        .as_str()
        .unwrap()
        .to_string()
}

fn chart(values: &Json) -> Vec<Json> {
    rendered_docs(&render_chart(values))
        .into_iter()
        .map(|(_, d)| d)
        .collect()
}

#[test]
fn the_chart_grants_the_same_with_any_values() {
    check(&chart(&json!({})), "chart, default values");
    check(
        &chart(&json!({"scheduler": {"name": "gpu-sched"}, "metrics": {"podMonitor": {"enabled": true}}})),
        "chart, other values",
    );
    check(
        &chart(&json!({"scheduler": {"mode": "none"}})),
        "chart, no second scheduler",
    );
    let dra = chart(&json!({"dra": {"deviceClasses": true, "nodeRestriction": true}}));
    assert!(dra.iter().any(|d| d["kind"] == "ValidatingAdmissionPolicy"));
    check(&dra, "chart, the DRA path's objects");
}

#[test]
fn the_manifests_grant_what_the_chart_grants() {
    let mut docs = Vec::new();
    for dir in ["base", "components/second-scheduler", "components/dra"] {
        for path in files_under(&repo().join("deploy/manifests").join(dir), &[".yaml"]) {
            docs.extend(yaml_docs(&read(&path), &path.display().to_string()));
        }
    }
    check(&docs, "deploy/manifests");
}

#[test]
fn a_rule_too_many_or_too_few_fails() {
    let docs = chart(&json!({"dra": {"deviceClasses": true, "nodeRestriction": true}}));
    for change in [json!("list"), json!(null)] {
        let mut docs = docs.clone();
        let role = docs
            .iter_mut()
            .find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "gpumem-agent")
            .unwrap();
        let verbs = role["rules"][0]["verbs"].as_array_mut().unwrap();
        match change {
            Json::Null => {
                verbs.pop();
            }
            v => verbs.push(v),
        }
        let result = std::panic::catch_unwind(|| check(&docs, "mutated"));
        assert!(result.is_err(), "a changed agent role must fail the check");
    }
    // The claim controller's role is held to its calls, not only to the chart's defaults: a grant
    // more fails, as does a Lease by another name.
    let mut wider = docs.clone();
    for d in wider
        .iter_mut()
        .filter(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "gpumem-claims")
    {
        d["rules"][2]["verbs"].as_array_mut().unwrap().push(json!("get"));
    }
    let result = std::panic::catch_unwind(|| check_claims(&wider, "pods get"));
    assert!(
        result.is_err(),
        "an extra grant to the claim controller must fail"
    );
    let mut renamed = docs.clone();
    for d in renamed
        .iter_mut()
        .filter(|d| d["kind"] == "Role" && d["metadata"]["name"] == "gpumem-claims-lease")
    {
        d["rules"][1]["resourceNames"] = json!(["other"]);
    }
    let result = std::panic::catch_unwind(|| check_claims(&renamed, "lease renamed"));
    assert!(result.is_err(), "a Lease grant by another name must fail");
    // The agent's DRA role is held like the others; the slice policy must see every slice write the
    // agent may make (here DELETE, which agent-rbac.yaml grants) and hold the agent's own account.
    let mut dra = docs.clone();
    for d in dra
        .iter_mut()
        .filter(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "gpumem-agent-dra")
    {
        d["rules"][1]["verbs"]
            .as_array_mut()
            .unwrap()
            .push(json!("deletecollection"));
    }
    let result = std::panic::catch_unwind(|| check(&dra, "claims deletecollection"));
    assert!(result.is_err(), "a changed agent DRA role must fail the check");
    let mut blind = docs.clone();
    for d in blind
        .iter_mut()
        .filter(|d| d["kind"] == "ValidatingAdmissionPolicy")
    {
        d["spec"]["matchConstraints"]["resourceRules"][0]["operations"] = json!(["CREATE", "UPDATE"]);
    }
    let result = std::panic::catch_unwind(|| check_slice_policy(&blind, "no DELETE"));
    assert!(result.is_err(), "a policy that lets deletes through must fail");
    let mut other = docs.clone();
    for d in other
        .iter_mut()
        .filter(|d| d["kind"] == "DaemonSet" && d["metadata"]["name"] == "gpumem-agent")
    {
        d["spec"]["template"]["spec"]["serviceAccountName"] = json!("someone-else");
    }
    let result = std::panic::catch_unwind(|| check_slice_policy(&other, "another account"));
    assert!(
        result.is_err(),
        "a policy on another account than the agent's must fail"
    );
    check_slice_policy(&docs, "unchanged");
}
