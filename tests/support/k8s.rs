//! What a real API server does that the fake ones of the agent's and the scorer's tests copy, so that
//! what passes against them passes against a cluster:
//! - it authorizes every request by (API group, resource, verb), as k8s.io/apiserver's RequestInfo
//!   derives them from method, path and query, against the caller's RBAC: here the ClusterRoles gpumem
//!   ships for the component (`gpumem-agent`, and with it `gpumem-agent-dra` for the DRA path), in
//!   deploy/manifests/base/<role>-rbac.yaml and in the Helm chart rendered with default values (both
//!   must grant a request), and refuses with the real 403;
//! - it stores pods with each container's requests defaulted to its limits, and every resource
//!   quantity in the form it writes back (`5000` comes back as `5k`), ResourceSlices' capacities too;
//! - it filters lists by the field selectors pods and ResourceSlices support.

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Mutex, OnceLock};

use gpumem::quantity::Quantity;
use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule};
use serde_json::{Value, json};

#[path = "../deploy_support/mod.rs"]
mod deploy_support;

/// What RBAC decides on: API group ("" is core), resource (with its subresource: `pods/binding`), verb.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Access {
    pub group: String,
    pub resource: String,
    pub verb: String,
}

impl Access {
    pub fn new(group: &str, resource: &str, verb: &str) -> Access {
        Access {
            group: group.into(),
            resource: resource.into(),
            verb: verb.into(),
        }
    }
}

impl fmt::Display for Access {
    /// `core/pods:get`, as the deploy tests write rules.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        write!(f, "{group}/{}:{}", self.resource, self.verb)
    }
}

/// One request as the API server's authorizer sees it.
#[derive(Debug, Clone)]
pub struct RequestInfo {
    pub access: Access,
    pub namespace: Option<String>,
    pub name: Option<String>,
    /// Not under /api or /apis: RBAC's nonResourceURLs, which gpumem's roles never grant.
    pub non_resource_path: Option<String>,
}

/// The request's attributes, by k8s.io/apiserver's rules: `/api/v1/...` is the core group,
/// `/apis/<group>/<version>/...` another; `namespaces/<ns>/` scopes what follows; then resource, name,
/// subresource. GET is `get` on a named object, `list` on a collection, `watch` with `?watch=true` or
/// under the legacy `/watch/` prefix; POST `create`, PUT `update`, PATCH `patch`, DELETE `delete`, or
/// `deletecollection` on a collection.
pub fn request_info(method: &str, path: &str, query: &str) -> RequestInfo {
    let parts: Vec<&str> = path
        .trim_matches('/')
        .split('/')
        .filter(|p| !p.is_empty())
        .collect();
    let (group, rest) = match parts.as_slice() {
        ["api", _version, rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => ("", &[][..]),
    };
    let (legacy_watch, mut rest) = match rest {
        ["watch", rest @ ..] => (true, rest),
        _ => (false, rest),
    };
    if rest.is_empty() {
        return RequestInfo {
            access: Access::new("", "", &method.to_ascii_lowercase()),
            namespace: None,
            name: None,
            non_resource_path: Some(path.to_string()),
        };
    }
    let mut namespace = None;
    if let ["namespaces", ns, tail @ ..] = rest {
        namespace = Some(ns.to_string());
        // `namespaces/<ns>/status` and `/finalize` are the Namespace's own subresources.
        if !tail.is_empty() && !matches!(tail[0], "status" | "finalize") {
            rest = tail;
        }
    }
    let resource = match rest {
        [resource, _name, subresource, ..] => format!("{resource}/{subresource}"),
        [resource, ..] => resource.to_string(),
        [] => String::new(),
    };
    let name = rest.get(1).map(|n| n.to_string());
    let watch = legacy_watch
        || query_param(query, "watch")
            .is_some_and(|v| matches!(v.as_str(), "1" | "t" | "T" | "true" | "TRUE" | "True"));
    let verb = match (method, name.is_some()) {
        ("GET" | "HEAD", _) if watch => "watch",
        ("GET" | "HEAD", true) => "get",
        ("GET" | "HEAD", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        (other, _) => other,
    };
    RequestInfo {
        access: Access::new(group, &resource, &verb.to_ascii_lowercase()),
        namespace,
        name,
        non_resource_path: None,
    }
}

/// The decoded value of `key` in a URL query.
pub fn query_param(query: &str, key: &str) -> Option<String> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (percent_decode(k) == key).then(|| percent_decode(v))
    })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

// ---------------------------------------------------------------------------------------------
// RBAC

/// The ClusterRoles gpumem binds to one component's ServiceAccount, as shipped, with the Roles their
/// files bind to it: (where from, rules), one per source, each source holding the union of the roles'
/// rules.
pub struct ShippedRole {
    component: String,
    /// The ClusterRoles' names (`gpumem-agent`, `gpumem-agent-dra`).
    roles: Vec<String>,
    sources: Vec<(String, Vec<Scoped>)>,
}

/// A rule, and the namespace it is limited to when a Role (not a ClusterRole) holds it.
#[derive(Debug, Clone)]
pub struct Scoped {
    namespace: Option<String>,
    rule: PolicyRule,
}

impl Scoped {
    fn cluster(rules: Vec<PolicyRule>) -> Vec<Scoped> {
        rules
            .into_iter()
            .map(|rule| Scoped {
                namespace: None,
                rule,
            })
            .collect()
    }

    fn grants(&self, request: &RequestInfo) -> bool {
        self.namespace
            .as_ref()
            .is_none_or(|ns| request.namespace.as_ref() == Some(ns))
            && grants(&self.rule, request)
    }
}

/// The rules of the Roles among `docs` that a RoleBinding among them binds to ServiceAccount `sa`
/// (of gpumem's namespace), each limited to its Role's namespace.
fn bound_roles<'a>(docs: impl IntoIterator<Item = &'a Value> + Clone, sa: &str) -> Vec<Scoped> {
    let bound: Vec<String> = docs
        .clone()
        .into_iter()
        .filter(|d| d["kind"] == "RoleBinding" && d["roleRef"]["kind"] == "Role")
        .filter(|d| {
            d["subjects"].as_array().into_iter().flatten().any(|s| {
                s["kind"] == "ServiceAccount"
                    && s["name"] == sa
                    && s["namespace"] == deploy_support::NAMESPACE
            })
        })
        .filter_map(|d| d["roleRef"]["name"].as_str().map(String::from))
        .collect();
    docs.into_iter()
        .filter(|d| {
            d["kind"] == "Role"
                && d["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| bound.iter().any(|b| b == n))
        })
        .flat_map(|d| {
            let role: k8s_openapi::api::rbac::v1::Role = deploy_support::parse(d);
            let namespace = role.metadata.namespace.clone();
            role.rules
                .unwrap_or_default()
                .into_iter()
                .map(move |rule| Scoped {
                    namespace: namespace.clone(),
                    rule,
                })
        })
        .collect()
}

/// The chart rendered with default values, once per test process.
fn chart_docs() -> &'static [(String, Value)] {
    static DOCS: OnceLock<Vec<(String, Value)>> = OnceLock::new();
    DOCS.get_or_init(|| deploy_support::rendered_docs(&deploy_support::render_chart(&json!({}))))
}

/// The rules of ClusterRole `name` among `docs` (from `what`).
fn rules_of<'a>(
    docs: impl IntoIterator<Item = &'a Value>,
    name: &str,
    what: &str,
) -> (String, Vec<PolicyRule>) {
    let role = docs
        .into_iter()
        .find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{what} has no ClusterRole {name}"));
    let role: ClusterRole = deploy_support::parse(role);
    (what.to_string(), role.rules.unwrap_or_default())
}

/// The chart with default values, as a source of ClusterRoles.
const CHART: &str = "the Helm chart with default values";

impl ShippedRole {
    /// ClusterRole `gpumem-<component>`, bound to the component's ServiceAccount.
    pub fn of(component: &str) -> ShippedRole {
        ShippedRole::bound(component, &[component])
    }

    /// The ClusterRoles `gpumem-<role>` for each of `roles`, all bound to the ServiceAccount of
    /// `component` (the agent's: `agent` and `agent-dra`): a request is granted when one of them
    /// grants it, in the manifests and in the chart alike.
    ///
    /// A role whose generated manifest (`deploy/manifests/base/<role>-rbac.yaml`) does not exist yet
    /// is taken from the chart for the manifests' side too, and the source's name says so.
    pub fn bound(component: &str, roles: &[&str]) -> ShippedRole {
        let chart = chart_docs().iter().map(|(_, d)| d);
        let sa = format!("{}-{component}", deploy_support::RELEASE);
        let mut manifests = (Vec::new(), Vec::new());
        let mut charted = (Vec::new(), Vec::new());
        for role in roles {
            let name = format!("{}-{role}", deploy_support::RELEASE);
            let file = format!("deploy/manifests/base/{role}-rbac.yaml");
            let template = format!("{role}-rbac.yaml");
            let from_template = chart_docs()
                .iter()
                .filter(|(t, _)| t.ends_with(&template))
                .map(|(_, d)| d);
            let path = deploy_support::repo().join(&file);
            let (what, rules) = if path.exists() {
                let manifest = deploy_support::yaml_docs(&deploy_support::read(&path), &file);
                let (what, rules) = rules_of(&manifest, &name, &file);
                let mut rules = Scoped::cluster(rules);
                rules.extend(bound_roles(&manifest, &sa));
                (what, rules)
            } else {
                let (_, rules) = rules_of(chart.clone(), &name, CHART);
                let mut rules = Scoped::cluster(rules);
                rules.extend(bound_roles(from_template.clone(), &sa));
                (
                    format!("{file} (not generated yet: the chart's {name} stands in)"),
                    rules,
                )
            };
            manifests.0.push(what);
            manifests.1.extend(rules);
            let (what, rules) = rules_of(chart.clone(), &name, CHART);
            if charted.0.is_empty() {
                charted.0.push(what);
            }
            charted.1.extend(Scoped::cluster(rules));
            charted.1.extend(bound_roles(from_template, &sa));
        }
        ShippedRole {
            component: component.to_string(),
            roles: roles
                .iter()
                .map(|r| format!("{}-{r}", deploy_support::RELEASE))
                .collect(),
            sources: vec![
                (manifests.0.join(" + "), manifests.1),
                (charted.0.join(" + "), charted.1),
            ],
        }
    }

    /// The ClusterRoles' names.
    pub fn roles(&self) -> &[String] {
        &self.roles
    }

    /// The ServiceAccount's user name, as the API server's messages give it.
    pub fn user(&self) -> String {
        format!(
            "system:serviceaccount:{}:{}-{}",
            deploy_support::NAMESPACE,
            deploy_support::RELEASE,
            self.component
        )
    }

    /// The sources whose rules do not grant `request`.
    pub fn denying(&self, request: &RequestInfo) -> Vec<&str> {
        self.sources
            .iter()
            .filter(|(_, rules)| !rules.iter().any(|r| r.grants(request)))
            .map(|(what, _)| what.as_str())
            .collect()
    }

    /// Every (group, resource, verb) a source's rules name.
    pub fn granted(&self) -> BTreeSet<Access> {
        let mut out = BTreeSet::new();
        for (_, rules) in &self.sources {
            for Scoped { rule, .. } in rules {
                for group in rule.api_groups.iter().flatten() {
                    for resource in rule.resources.iter().flatten() {
                        for verb in &rule.verbs {
                            out.insert(Access::new(group, resource, verb));
                        }
                    }
                }
            }
        }
        out
    }

    /// The API server's message for a refused request.
    pub fn forbidden_message(&self, request: &RequestInfo) -> String {
        let user = self.user();
        let Access {
            group,
            resource,
            verb,
        } = &request.access;
        if let Some(path) = &request.non_resource_path {
            return format!("forbidden: User {user:?} cannot {verb} path {path:?}");
        }
        let base = resource.split('/').next().unwrap_or_default();
        let qualified = if group.is_empty() {
            base.to_string()
        } else {
            format!("{base}.{group}")
        };
        let subject = match &request.name {
            Some(name) => format!("{qualified} {name:?}"),
            None => qualified,
        };
        let scope = match &request.namespace {
            Some(ns) => format!("in the namespace {ns:?}"),
            None => "at the cluster scope".into(),
        };
        format!(
            "{subject} is forbidden: User {user:?} cannot {verb} resource {resource:?} in API group {group:?} {scope}"
        )
    }
}

/// RBAC's rule match (k8s.io/component-helpers/auth/rbac/validation): groups, resources (or
/// `*/<subresource>`), verbs, each with `*`; resourceNames, when given, must name the object.
fn grants(rule: &PolicyRule, request: &RequestInfo) -> bool {
    if request.non_resource_path.is_some() {
        return false;
    }
    let Access {
        group,
        resource,
        verb,
    } = &request.access;
    let any =
        |list: Option<&Vec<String>>, want: &str| list.into_iter().flatten().any(|x| x == "*" || x == want);
    let subresource = resource.split_once('/').map(|(_, s)| s);
    let resource_ok =
        rule.resources.iter().flatten().any(|r| {
            r == "*" || r == resource || subresource.is_some_and(|s| r.strip_prefix("*/") == Some(s))
        });
    let names = rule.resource_names.as_deref().unwrap_or_default();
    any(rule.api_groups.as_ref(), group)
        && resource_ok
        && any(Some(&rule.verbs), verb)
        && (names.is_empty() || request.name.as_ref().is_some_and(|n| names.contains(n)))
}

/// A fake API server's authorizer: it decides each request against the component's shipped role and
/// remembers what was asked.
pub struct Authorizer {
    role: ShippedRole,
    log: Mutex<Vec<(RequestInfo, Vec<String>)>>,
}

impl Authorizer {
    pub fn new(component: &str) -> Authorizer {
        Authorizer {
            role: ShippedRole::of(component),
            log: Mutex::new(Vec::new()),
        }
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Vec<(RequestInfo, Vec<String>)>> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An authorizer for the ServiceAccount of `component` bound to several ClusterRoles
    /// ([`ShippedRole::bound`]).
    pub fn bound(component: &str, roles: &[&str]) -> Authorizer {
        Authorizer {
            role: ShippedRole::bound(component, roles),
            log: Mutex::new(Vec::new()),
        }
    }

    /// Records the request; the 403 Status to answer when the shipped role does not grant it.
    pub fn authorize(&self, method: &str, path: &str, query: &str) -> Result<RequestInfo, Value> {
        self.authorize_request(request_info(method, path, query))
    }

    /// [`Authorizer::authorize`] for attributes the API server derives itself: a server-side apply
    /// that creates its object is also authorized as `create` (k8s.io/apiserver's patch handler).
    pub fn authorize_request(&self, request: RequestInfo) -> Result<RequestInfo, Value> {
        let denying: Vec<String> = self
            .role
            .denying(&request)
            .into_iter()
            .map(String::from)
            .collect();
        self.log().push((request.clone(), denying.clone()));
        if denying.is_empty() {
            return Ok(request);
        }
        Err(json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.role.forbidden_message(&request), "reason": "Forbidden",
            "details": {"name": request.name, "kind": request.access.resource}, "code": 403,
        }))
    }

    /// Every (group, resource, verb) requested so far.
    pub fn used(&self) -> BTreeSet<Access> {
        self.log().iter().map(|(r, _)| r.access.clone()).collect()
    }

    /// Every (group, resource, verb) the shipped roles grant that no request used, as `core/pods:list`.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used();
        self.role
            .granted()
            .difference(&used)
            .map(Access::to_string)
            .collect()
    }

    /// Panics, naming them, if the shipped role refused any request.
    pub fn assert_all_granted(&self) {
        let refused: Vec<String> = self
            .log()
            .iter()
            .filter(|(_, denying)| !denying.is_empty())
            .map(|(r, denying)| {
                format!(
                    "{} (refused by {})",
                    self.role.forbidden_message(r),
                    denying.join(", ")
                )
            })
            .collect();
        assert!(
            refused.is_empty(),
            "the {} did what its shipped role does not allow:\n{}",
            self.role.component,
            refused.join("\n")
        );
    }

    /// Panics unless the requests were all granted and used every grant of the shipped role: least
    /// privilege, for a test that makes every kind of call the component makes.
    pub fn assert_role_is_exactly_what_was_used(&self) {
        self.assert_all_granted();
        let unused = self.unused();
        assert!(
            unused.is_empty(),
            "the {}'s shipped role grants what it never used: {unused:?}",
            self.role.component
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Stored objects

/// `pod` as the API server stores and returns it: each container's requests default to its limits
/// (SetDefaults_Pod), and every resource quantity is in stored form. Panics on a quantity the API
/// server would refuse.
pub fn stored_pod(pod: &Value) -> Value {
    let mut pod = pod.clone();
    for list in ["/spec/containers", "/spec/initContainers"] {
        let containers = pod.pointer_mut(list).and_then(Value::as_array_mut);
        for resources in containers
            .into_iter()
            .flatten()
            .filter_map(|c| c.get_mut("resources"))
        {
            let limits = resources.get("limits").and_then(Value::as_object).cloned();
            if let (Some(limits), Some(resources)) = (limits, resources.as_object_mut())
                && let Some(requests) = resources
                    .entry("requests")
                    .or_insert_with(|| json!({}))
                    .as_object_mut()
            {
                for (name, limit) in limits {
                    requests.entry(name).or_insert(limit);
                }
            }
            for list in ["limits", "requests"] {
                if let Some(list) = resources.get_mut(list) {
                    store_quantities(list);
                }
            }
        }
    }
    for list in [
        "/spec/overhead",
        "/spec/resources/limits",
        "/spec/resources/requests",
    ] {
        if let Some(list) = pod.pointer_mut(list) {
            store_quantities(list);
        }
    }
    pod
}

/// `node` as the API server stores and returns it: capacity and allocatable in stored form.
pub fn stored_node(node: &Value) -> Value {
    let mut node = node.clone();
    for list in ["/status/capacity", "/status/allocatable"] {
        if let Some(list) = node.pointer_mut(list) {
            store_quantities(list);
        }
    }
    node
}

/// `slice` as the API server stores and returns it: every quantity of its devices' capacities (the
/// value, and the request policy's default, range and valid values) in stored form. Panics on a
/// quantity the API server would refuse.
pub fn stored_slice(slice: &Value) -> Value {
    let mut slice = slice.clone();
    let devices = slice.pointer_mut("/spec/devices").and_then(Value::as_array_mut);
    for capacity in devices
        .into_iter()
        .flatten()
        .filter_map(|d| d.get_mut("capacity").and_then(Value::as_object_mut))
        .flat_map(|c| c.values_mut())
    {
        let mut quantities: Vec<&mut Value> = Vec::new();
        for (key, v) in capacity.as_object_mut().into_iter().flatten() {
            match (key.as_str(), v) {
                ("value", v) => quantities.push(v),
                ("requestPolicy", Value::Object(policy)) => {
                    for (key, v) in policy.iter_mut() {
                        match (key.as_str(), v) {
                            ("default", v) => quantities.push(v),
                            ("validRange", Value::Object(range)) => quantities.extend(range.values_mut()),
                            ("validValues", Value::Array(values)) => quantities.extend(values.iter_mut()),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        for q in quantities {
            store_quantity("capacity", q);
        }
    }
    slice
}

fn store_quantity(name: &str, q: &mut Value) {
    let text = match q {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => return,
    };
    let stored = Quantity::stored(&text)
        .unwrap_or_else(|e| panic!("{name}: {text:?} is not a quantity ({e}): the API server refuses it"));
    *q = Value::String(stored);
}

fn store_quantities(list: &mut Value) {
    for (name, q) in list.as_object_mut().into_iter().flatten() {
        // JSON numbers are quantities too (the API server reads the number's text).
        let text = match q {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => continue,
        };
        let stored = Quantity::stored(&text).unwrap_or_else(|e| {
            panic!("{name}: {text:?} is not a quantity ({e}): the API server refuses it")
        });
        *q = Value::String(stored);
    }
}

/// Whether `pod` passes a list's `fieldSelector` (comma-separated `field=value`, `field==value` or
/// `field!=value`); `Err` with the API server's message for a field pods cannot be selected by.
pub fn pod_matches_fields(pod: &Value, query: &str) -> Result<bool, String> {
    matches_fields(
        pod,
        query,
        &[
            ("metadata.name", "/metadata/name"),
            ("metadata.namespace", "/metadata/namespace"),
            ("spec.nodeName", "/spec/nodeName"),
            ("spec.schedulerName", "/spec/schedulerName"),
            ("status.phase", "/status/phase"),
        ],
    )
}

/// [`pod_matches_fields`] for a ResourceSlice: the fields pkg/registry/resource/resourceslice selects
/// by (a cluster-scoped object's name, its node, its driver).
pub fn slice_matches_fields(slice: &Value, query: &str) -> Result<bool, String> {
    matches_fields(
        slice,
        query,
        &[
            ("metadata.name", "/metadata/name"),
            ("spec.nodeName", "/spec/nodeName"),
            ("spec.driver", "/spec/driver"),
        ],
    )
}

/// [`pod_matches_fields`] for a ResourceClaim: by name and namespace only.
pub fn claim_matches_fields(claim: &Value, query: &str) -> Result<bool, String> {
    matches_fields(
        claim,
        query,
        &[
            ("metadata.name", "/metadata/name"),
            ("metadata.namespace", "/metadata/namespace"),
        ],
    )
}

/// Whether `object` passes the query's `fieldSelector`, each field found at its JSON pointer in
/// `fields` (a field the object lacks has the value "").
fn matches_fields(object: &Value, query: &str, fields: &[(&str, &str)]) -> Result<bool, String> {
    let Some(selector) = query_param(query, "fieldSelector").filter(|s| !s.is_empty()) else {
        return Ok(true);
    };
    for term in selector.split(',') {
        let (field, want, equal) = if let Some((f, v)) = term.split_once("!=") {
            (f, v, false)
        } else if let Some((f, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            (f, v, true)
        } else {
            return Err(format!("invalid selector: {term:?}"));
        };
        let Some((_, pointer)) = fields.iter().find(|(name, _)| *name == field) else {
            return Err(format!("field label not supported: {field}"));
        };
        let have = object.pointer(pointer).and_then(Value::as_str).unwrap_or("");
        if (have == want) != equal {
            return Ok(false);
        }
    }
    Ok(true)
}
