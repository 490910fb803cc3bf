//! Shared by the tests/deploy_*.rs tests: a renderer for the Helm chart's template subset
//! (deploy/helm/gpumem/README.md), YAML loading, typed parsing into k8s-openapi objects, the serde
//! shapes of the CRDs and configuration files deploy/ holds, and the metric names gpumem exports.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use gtmpl::{Context, Template};
use gtmpl_value::{FuncError, Number, Value};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value as Json, json};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn chart_dir() -> PathBuf {
    repo().join("deploy/helm/gpumem")
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every file under `dir` whose name ends with one of `exts`, sorted.
pub fn files_under(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if exts.iter().any(|ext| path.to_string_lossy().ends_with(ext)) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

// ---------------------------------------------------------------------------------------------
// YAML

/// The documents of a (multi-document) YAML text as JSON values; empty documents are skipped.
pub fn yaml_docs(text: &str, what: &str) -> Vec<Json> {
    let mut docs = Vec::new();
    for (i, de) in serde_norway::Deserializer::from_str(text).enumerate() {
        let doc = Json::deserialize(de).unwrap_or_else(|e| panic!("{what}: document {i} is not YAML: {e}"));
        if !doc.is_null() {
            docs.push(doc);
        }
    }
    docs
}

/// Deep merge: maps merge key by key, anything else in `over` replaces `base` (Helm's rule for -f/--set).
pub fn merge(base: &mut Json, over: &Json) {
    match (base, over) {
        (Json::Object(b), Json::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (b, o) => *b = o.clone(),
    }
}

// ---------------------------------------------------------------------------------------------
// The chart renderer

/// One rendered template: its path under templates/ and the text.
pub struct Rendered {
    pub template: String,
    pub text: String,
}

pub const RELEASE: &str = "gpumem";
pub const NAMESPACE: &str = "gpumem-system";

/// The `.Capabilities.APIVersions` entry of the API server's MutatingAdmissionPolicy v1 (Kubernetes
/// 1.36+), which `helm install` and `helm upgrade` list when the cluster serves it.
pub const MUTATING_ADMISSION_POLICY_V1: &str = "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy";

/// Renders every template of the chart with values.yaml merged with `overrides`, as
/// `helm template gpumem deploy/helm/gpumem -n gpumem-system` would. Panics with the template's
/// name on any error, and on `<no value>` in the output (a value path that does not exist).
pub fn render_chart(overrides: &Json) -> Vec<Rendered> {
    render_chart_with_apis(overrides, &[])
}

/// [`render_chart`] with `--api-versions` for each of `api_versions`: what `helm install` sees of a
/// cluster that serves them (`group/version/Kind`).
pub fn render_chart_with_apis(overrides: &Json, api_versions: &[&str]) -> Vec<Rendered> {
    render_chart_at_with_apis(&chart_dir(), overrides, api_versions).unwrap_or_else(|e| panic!("{e}"))
}

pub fn render_chart_at(dir: &Path, overrides: &Json) -> Result<Vec<Rendered>, String> {
    render_chart_at_with_apis(dir, overrides, &[])
}

/// `.Capabilities.APIVersions` holds `api_versions` only. Helm's own default list (`helm template`
/// without --api-versions) holds the group/versions its client library knows and no kind, so a
/// template asking for a `group/version/Kind`, as the chart's do, sees the same answer.
pub fn render_chart_at_with_apis(
    dir: &Path,
    overrides: &Json,
    api_versions: &[&str],
) -> Result<Vec<Rendered>, String> {
    let mut values = yaml_docs(&read(&dir.join("values.yaml")), "values.yaml")
        .pop()
        .unwrap_or(json!({}));
    merge(&mut values, overrides);
    let chart = yaml_docs(&read(&dir.join("Chart.yaml")), "Chart.yaml")
        .pop()
        .unwrap();
    let mut files = serde_json::Map::new();
    for path in files_under(dir, &[""]) {
        let rel = path.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
        if !rel.starts_with("templates/") {
            files.insert(rel, Json::String(read(&path)));
        }
    }
    let root = json!({
        "Values": values,
        "Release": {"Name": RELEASE, "Namespace": NAMESPACE, "Service": "Helm"},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
        "Files": files,
        "Capabilities": {"APIVersions": api_versions},
    });
    let root = to_gtmpl(&root);
    let mut out = Vec::new();
    for path in files_under(&dir.join("templates"), &[".yaml"]) {
        let name = path.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
        let text = render_text(&read(&path), &root).map_err(|e| format!("{name}: {e}"))?;
        if text.contains("<no value>") {
            return Err(format!(
                "{name}: renders <no value> (a value that does not exist):\n{text}"
            ));
        }
        out.push(Rendered { template: name, text });
    }
    Ok(out)
}

/// Renders one template text against a root context.
pub fn render_text(text: &str, root: &Value) -> Result<String, String> {
    let mut tmpl = Template::default();
    tmpl.add_funcs(&[
        ("toYaml", to_yaml as gtmpl_value::Func),
        ("toJson", to_json),
        ("nindent", nindent),
        ("indent", indent),
        ("quote", quote),
        ("default", default),
        ("int", int),
        (API_VERSIONS_HAS, api_versions_has),
    ]);
    if text.contains(API_VERSIONS_HAS) {
        return Err(format!("{API_VERSIONS_HAS} is not a Helm function"));
    }
    tmpl.parse(capabilities_has(&files_get(text)?))
        .map_err(|e| e.to_string())?;
    tmpl.render(&Context::from(root.clone()))
        .map_err(|e| e.to_string())
}

/// `.Files.Get "path"` (a string literal) becomes `(index .Files "path")`: gtmpl cannot call a
/// method with arguments, and the chart's files are a map in the context.
fn files_get(text: &str) -> Result<String, String> {
    const CALL: &str = ".Files.Get \"";
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(CALL) {
        out.push_str(&rest[..at]);
        let after = &rest[at + CALL.len()..];
        let end = after.find('"').ok_or(".Files.Get without a closing quote")?;
        out.push_str(&format!("(index .Files \"{}\")", &after[..end]));
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// What `.Capabilities.APIVersions.Has` becomes: a function of the renderer, never of a template.
const API_VERSIONS_HAS: &str = "renderer_api_versions_has";

/// `.Capabilities.APIVersions.Has "x"` becomes `renderer_api_versions_has $.Capabilities.APIVersions
/// "x"` (gtmpl cannot call a method; `$`, the root, also inside `range` and `with`).
fn capabilities_has(text: &str) -> String {
    text.replace(
        ".Capabilities.APIVersions.Has ",
        &format!("{API_VERSIONS_HAS} $.Capabilities.APIVersions "),
    )
}

/// Helm's `VersionSet.Has`: whether the list holds the string.
fn api_versions_has(args: &[Value]) -> Result<Value, FuncError> {
    arg(args, 2, API_VERSIONS_HAS)?;
    let Value::Array(list) = &args[0] else {
        return Err(FuncError::Generic(format!("{API_VERSIONS_HAS}: not a list")));
    };
    let Value::String(want) = &args[1] else {
        return Err(FuncError::Generic(format!("{API_VERSIONS_HAS}: not a string")));
    };
    Ok(Value::Bool(
        list.iter().any(|v| matches!(v, Value::String(s) if s == want)),
    ))
}

/// JSON → gtmpl. Numbers as Helm sees them (float64): integers below 1e6 print as integers; larger
/// ones print in Go's `%v` e-notation (1e+06) unless passed through `int`, as in Helm.
pub fn to_gtmpl(v: &Json) -> Value {
    match v {
        Json::Null => Value::Nil,
        Json::Bool(b) => Value::Bool(*b),
        Json::String(s) => Value::String(s.clone()),
        Json::Number(n) => {
            let f = n.as_f64().unwrap();
            if f.fract() == 0.0 && f.abs() < 1e6 {
                Value::Number(Number::from(f as i64))
            } else if f.fract() == 0.0 {
                Value::String(go_float(f))
            } else {
                Value::Number(Number::from(f))
            }
        }
        Json::Array(a) => Value::Array(a.iter().map(to_gtmpl).collect()),
        Json::Object(o) => Value::Map(o.iter().map(|(k, v)| (k.clone(), to_gtmpl(v))).collect()),
    }
}

/// Go's `%v` of a large integral float64: `1e+06`, `1.048576e+06`.
fn go_float(f: f64) -> String {
    let s = format!("{f:e}");
    let (mantissa, exp) = s.split_once('e').unwrap();
    let exp: i32 = exp.parse().unwrap();
    format!("{mantissa}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
}

fn from_gtmpl(v: &Value) -> Json {
    match v {
        Value::NoValue | Value::Nil => Json::Null,
        Value::Bool(b) => Json::Bool(*b),
        Value::String(s) => Json::String(s.clone()),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                json!(i)
            } else if let Some(u) = n.as_u64() {
                json!(u)
            } else {
                json!(n.as_f64().unwrap())
            }
        }
        Value::Array(a) => Json::Array(a.iter().map(from_gtmpl).collect()),
        Value::Map(m) | Value::Object(m) => {
            let sorted: BTreeMap<_, _> = m.iter().map(|(k, v)| (k.clone(), from_gtmpl(v))).collect();
            Json::Object(sorted.into_iter().collect())
        }
        Value::Function(_) => Json::Null,
    }
}

fn arg<'a>(args: &'a [Value], n: usize, name: &str) -> Result<&'a Value, FuncError> {
    if args.len() != n {
        return Err(FuncError::ExactlyXArgs(name.into(), n));
    }
    Ok(&args[n - 1])
}

fn string_of(v: &Value) -> String {
    match v {
        Value::NoValue | Value::Nil => String::new(),
        other => other.to_string(),
    }
}

fn count(v: &Value, name: &str) -> Result<usize, FuncError> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| FuncError::Generic(format!("{name}: not a count"))),
        _ => Err(FuncError::Generic(format!("{name}: not a count"))),
    }
}

/// Helm's toYaml: block YAML, no trailing newline; an empty map is `{}`.
fn to_yaml(args: &[Value]) -> Result<Value, FuncError> {
    let v = from_gtmpl(arg(args, 1, "toYaml")?);
    let text = serde_norway::to_string(&v).map_err(|e| FuncError::Generic(e.to_string()))?;
    Ok(Value::String(text.trim_end_matches('\n').to_string()))
}

fn to_json(args: &[Value]) -> Result<Value, FuncError> {
    Ok(Value::String(from_gtmpl(arg(args, 1, "toJson")?).to_string()))
}

fn indent_by(n: usize, s: &str) -> String {
    let pad = " ".repeat(n);
    s.split('\n')
        .map(|line| format!("{pad}{line}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn indent(args: &[Value]) -> Result<Value, FuncError> {
    arg(args, 2, "indent")?;
    Ok(Value::String(indent_by(
        count(&args[0], "indent")?,
        &string_of(&args[1]),
    )))
}

fn nindent(args: &[Value]) -> Result<Value, FuncError> {
    arg(args, 2, "nindent")?;
    Ok(Value::String(format!(
        "\n{}",
        indent_by(count(&args[0], "nindent")?, &string_of(&args[1]))
    )))
}

fn quote(args: &[Value]) -> Result<Value, FuncError> {
    let s = string_of(arg(args, 1, "quote")?);
    Ok(Value::String(Json::String(s).to_string()))
}

/// sprig's default: the second argument unless it is empty.
fn default(args: &[Value]) -> Result<Value, FuncError> {
    arg(args, 2, "default")?;
    let empty = match &args[1] {
        Value::NoValue | Value::Nil => true,
        Value::Bool(b) => !b,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Map(m) | Value::Object(m) => m.is_empty(),
        Value::Number(n) => number(n) == 0.0,
        Value::Function(_) => false,
    };
    Ok(if empty { args[0].clone() } else { args[1].clone() })
}

fn number(n: &Number) -> f64 {
    n.as_i64()
        .map(|i| i as f64)
        .or_else(|| n.as_u64().map(|u| u as f64))
        .or_else(|| n.as_f64())
        .unwrap_or(f64::NAN)
}

fn int(args: &[Value]) -> Result<Value, FuncError> {
    match arg(args, 1, "int")? {
        Value::Number(n) => Ok(Value::Number(Number::from(number(n) as i64))),
        Value::String(s) => s
            .parse::<f64>()
            .map(|f| Value::Number(Number::from(f as i64)))
            .map_err(|_| FuncError::Generic(format!("int: {s:?} is not a number"))),
        other => Err(FuncError::Generic(format!("int: {other} is not a number"))),
    }
}

/// Every document of every rendered template, with the template it came from.
pub fn rendered_docs(rendered: &[Rendered]) -> Vec<(String, Json)> {
    rendered
        .iter()
        .flat_map(|r| {
            yaml_docs(&r.text, &r.template)
                .into_iter()
                .map(|d| (r.template.clone(), d))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Typed objects

/// Parses `doc` into the type its apiVersion/kind name and serializes it back: the two must be
/// equal, so a misspelt or misplaced field (which serde would otherwise skip) fails. Returns the
/// kind. CRDs and configuration kinds go through the strict structs below.
pub fn check_typed(doc: &Json) -> Result<String, String> {
    use k8s_openapi::api::{
        admissionregistration, apps, core, flowcontrol, networking, policy, rbac, resource, scheduling,
    };
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions;
    let api = doc["apiVersion"].as_str().ok_or("no apiVersion")?;
    let kind = doc["kind"].as_str().ok_or("no kind")?;
    let key = format!("{api}/{kind}");
    match key.as_str() {
        "v1/Namespace" => round_trip::<core::v1::Namespace>(doc),
        "v1/ServiceAccount" => round_trip::<core::v1::ServiceAccount>(doc),
        "v1/ConfigMap" => round_trip::<core::v1::ConfigMap>(doc),
        "v1/Service" => round_trip::<core::v1::Service>(doc),
        "v1/Pod" => round_trip::<core::v1::Pod>(doc),
        "v1/ResourceQuota" => round_trip::<core::v1::ResourceQuota>(doc),
        "apps/v1/DaemonSet" => round_trip::<apps::v1::DaemonSet>(doc),
        "apps/v1/Deployment" => round_trip::<apps::v1::Deployment>(doc),
        "networking.k8s.io/v1/NetworkPolicy" => round_trip::<networking::v1::NetworkPolicy>(doc),
        "policy/v1/PodDisruptionBudget" => round_trip::<policy::v1::PodDisruptionBudget>(doc),
        "rbac.authorization.k8s.io/v1/ClusterRole" => round_trip::<rbac::v1::ClusterRole>(doc),
        "rbac.authorization.k8s.io/v1/ClusterRoleBinding" => round_trip::<rbac::v1::ClusterRoleBinding>(doc),
        "rbac.authorization.k8s.io/v1/Role" => round_trip::<rbac::v1::Role>(doc),
        "rbac.authorization.k8s.io/v1/RoleBinding" => round_trip::<rbac::v1::RoleBinding>(doc),
        "scheduling.k8s.io/v1/PriorityClass" => round_trip::<scheduling::v1::PriorityClass>(doc),
        "flowcontrol.apiserver.k8s.io/v1/FlowSchema" => round_trip::<flowcontrol::v1::FlowSchema>(doc),
        // Kubernetes 1.24 to 1.31 serve the same FlowSchema as v1beta2 and v1beta3, which
        // k8s-openapi no longer has: checked as v1.
        "flowcontrol.apiserver.k8s.io/v1beta2/FlowSchema"
        | "flowcontrol.apiserver.k8s.io/v1beta3/FlowSchema" => {
            let mut v1 = doc.clone();
            v1["apiVersion"] = Json::from("flowcontrol.apiserver.k8s.io/v1");
            round_trip::<flowcontrol::v1::FlowSchema>(&v1)
        }
        "resource.k8s.io/v1/DeviceClass" => round_trip::<resource::v1::DeviceClass>(doc),
        "resource.k8s.io/v1/ResourceClaimTemplate" => round_trip::<resource::v1::ResourceClaimTemplate>(doc),
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" => {
            round_trip::<admissionregistration::v1::ValidatingAdmissionPolicy>(doc)
        }
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicyBinding" => {
            round_trip::<admissionregistration::v1::ValidatingAdmissionPolicyBinding>(doc)
        }
        "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" => {
            round_trip::<admissionregistration::v1::MutatingAdmissionPolicy>(doc)
        }
        "admissionregistration.k8s.io/v1/MutatingAdmissionPolicyBinding" => {
            round_trip::<admissionregistration::v1::MutatingAdmissionPolicyBinding>(doc)
        }
        "apiextensions.k8s.io/v1/CustomResourceDefinition" => {
            round_trip::<apiextensions::v1::CustomResourceDefinition>(doc)
        }
        "monitoring.coreos.com/v1/PodMonitor" => strict::<PodMonitor>(doc),
        "monitoring.coreos.com/v1/ServiceMonitor" => strict::<ServiceMonitor>(doc),
        "monitoring.coreos.com/v1/PrometheusRule" => strict::<PrometheusRule>(doc),
        "kubescheduler.config.k8s.io/v1/KubeSchedulerConfiguration"
        | "kubescheduler.config.k8s.io/v1beta3/KubeSchedulerConfiguration" => {
            strict::<KubeSchedulerConfiguration>(doc)
        }
        "kustomize.config.k8s.io/v1beta1/Kustomization" => strict::<Kustomization>(doc),
        "kustomize.config.k8s.io/v1alpha1/Component" => strict::<Kustomization>(doc),
        _ => return Err(format!("unknown kind {key}: add it to check_typed")),
    }
    .map_err(|e| format!("{key} {}: {e}", doc["metadata"]["name"]))?;
    Ok(kind.to_string())
}

fn round_trip<T: DeserializeOwned + serde::Serialize>(doc: &Json) -> Result<(), String> {
    let typed: T = serde_json::from_value(doc.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut diffs = Vec::new();
    diff("", doc, &back, &mut diffs);
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(format!("fields the type does not have: {diffs:?}"))
    }
}

/// Paths present in `a` and missing or different in `b`.
fn diff(path: &str, a: &Json, b: &Json, out: &mut Vec<String>) {
    match (a, b) {
        (Json::Object(x), Json::Object(y)) => {
            for (k, v) in x {
                match y.get(k) {
                    Some(w) => diff(&format!("{path}.{k}"), v, w, out),
                    None => out.push(format!("{path}.{k}")),
                }
            }
        }
        (Json::Array(x), Json::Array(y)) if x.len() == y.len() => {
            for (i, (v, w)) in x.iter().zip(y).enumerate() {
                diff(&format!("{path}[{i}]"), v, w, out);
            }
        }
        (Json::Number(x), Json::Number(y)) if x.as_f64() == y.as_f64() => {}
        (x, y) if x == y => {}
        _ => out.push(format!("{path}: {a} became {b}")),
    }
}

fn strict<T: DeserializeOwned>(doc: &Json) -> Result<(), String> {
    serde_json::from_value::<T>(doc.clone())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

pub fn parse<T: DeserializeOwned>(doc: &Json) -> T {
    serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{e}: {doc}"))
}

// Prometheus Operator CRDs: the fields gpumem uses, nothing else accepted.

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodMonitor {
    pub api_version: String,
    pub kind: String,
    pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    pub spec: PodMonitorSpec,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodMonitorSpec {
    pub selector: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    pub pod_metrics_endpoints: Vec<Endpoint>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceMonitor {
    pub api_version: String,
    pub kind: String,
    pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    pub spec: ServiceMonitorSpec,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceMonitorSpec {
    pub selector: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    pub endpoints: Vec<Endpoint>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Endpoint {
    pub port: String,
    pub path: String,
    pub interval: String,
    #[serde(default)]
    pub relabelings: Vec<Relabeling>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Relabeling {
    pub source_labels: Vec<String>,
    pub target_label: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PrometheusRule {
    pub api_version: String,
    pub kind: String,
    pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    pub spec: RuleSpec,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    pub groups: Vec<RuleGroup>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RuleGroup {
    pub name: String,
    pub rules: Vec<Rule>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub alert: String,
    pub expr: String,
    #[serde(rename = "for")]
    pub for_: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

// kube-scheduler's configuration (kubescheduler.config.k8s.io v1 and v1beta3 share these fields).

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubeSchedulerConfiguration {
    pub api_version: String,
    pub kind: String,
    pub client_connection: Option<ClientConnection>,
    pub leader_election: Option<LeaderElection>,
    pub profiles: Vec<Profile>,
    pub extenders: Vec<Extender>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientConnection {
    pub kubeconfig: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaderElection {
    pub leader_elect: bool,
    pub resource_name: Option<String>,
    pub resource_namespace: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Profile {
    pub scheduler_name: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Extender {
    pub url_prefix: String,
    pub filter_verb: String,
    pub prioritize_verb: String,
    pub bind_verb: String,
    pub preempt_verb: String,
    pub weight: i64,
    /// A Go duration.
    #[serde(rename = "httpTimeout")]
    pub http_timeout: String,
    #[serde(rename = "enableHTTPS")]
    pub enable_https: bool,
    pub tls_config: Option<ExtenderTlsConfig>,
    pub node_cache_capable: bool,
    pub ignorable: bool,
    pub managed_resources: Vec<ManagedResource>,
}

/// kube-scheduler's `ExtenderTLSConfig` (the file fields; `certData` and the like are not used).
#[derive(Debug, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExtenderTlsConfig {
    #[serde(default)]
    pub insecure: bool,
    pub server_name: Option<String>,
    pub cert_file: String,
    pub key_file: String,
    pub ca_file: String,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ManagedResource {
    pub name: String,
    pub ignored_by_scheduler: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Kustomization {
    pub api_version: String,
    pub kind: String,
    pub namespace: Option<String>,
    #[serde(default)]
    pub resources: Vec<String>,
    #[serde(default)]
    pub components: Vec<String>,
    #[serde(default)]
    pub patches: Vec<KustomizePatch>,
    #[serde(default)]
    pub config_map_generator: Vec<ConfigMapGenerator>,
    #[serde(default)]
    pub labels: Vec<Json>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KustomizePatch {
    pub path: String,
    pub target: Option<PatchTarget>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PatchTarget {
    pub kind: String,
    pub name: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConfigMapGenerator {
    pub name: String,
    pub namespace: Option<String>,
    #[serde(default)]
    pub files: Vec<String>,
    pub options: Option<Json>,
}

/// Parses a Go duration as kube-scheduler does (`5s`, `1m30s`, `500ms`); None if it is not one.
pub fn go_duration_secs(s: &str) -> Option<f64> {
    let mut total = 0.0;
    let mut rest = s;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let n: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        total += n * match &rest[..unit] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        rest = &rest[unit..];
    }
    Some(total)
}

// ---------------------------------------------------------------------------------------------
// RBAC

/// (apiGroup, resource, verb) triples of a list of rules, expanded. resourceNames are kept.
pub fn rbac_triples(rules: &[k8s_openapi::api::rbac::v1::PolicyRule]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for rule in rules {
        for group in rule.api_groups.clone().unwrap_or_default() {
            for resource in rule.resources.clone().unwrap_or_default() {
                for verb in &rule.verbs {
                    let names = rule.resource_names.clone().unwrap_or_default().join(",");
                    let names = if names.is_empty() {
                        String::new()
                    } else {
                        format!("[{names}]")
                    };
                    let group = if group.is_empty() { "core" } else { group.as_str() };
                    out.insert(format!("{group}/{resource}{names}:{verb}"));
                }
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Metrics

/// The metrics gpumem's agent and scorer export (names final; the lead ties this list to the code).
/// (name, type): histograms also expose `_bucket`, `_sum` and `_count`.
pub const METRICS: &[(&str, &str)] = &[
    ("gpumem_gpu_memory_total_bytes", "gauge"),
    ("gpumem_gpu_memory_allocated_bytes", "gauge"),
    ("gpumem_gpu_memory_used_bytes", "gauge"),
    ("gpumem_gpu_utilization_ratio", "gauge"),
    ("gpumem_gpu_temperature_celsius", "gauge"),
    ("gpumem_gpu_power_watts", "gauge"),
    ("gpumem_gpu_healthy", "gauge"),
    ("gpumem_gpu_xid_errors_total", "counter"),
    ("gpumem_gpu_pods", "gauge"),
    ("gpumem_plugin_registered", "gauge"),
    ("gpumem_plugin_request_duration_seconds", "histogram"),
    ("gpumem_plugin_allocation_failures_total", "counter"),
    ("gpumem_accounting_rejected_total", "counter"),
    ("gpumem_scorer_request_duration_seconds", "histogram"),
    ("gpumem_scorer_filter_rejections_total", "counter"),
    ("gpumem_cluster_fragmentation_ratio", "gauge"),
    ("gpumem_node_fragmentation_ratio", "gauge"),
    ("gpumem_cluster_gpu_memory_allocated_ratio", "gauge"),
];

/// Every series name a query may select: the metrics, plus the histogram series.
pub fn exported_series() -> HashMap<String, &'static str> {
    let mut out = HashMap::new();
    for &(name, kind) in METRICS {
        out.insert(name.to_string(), kind);
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                out.insert(format!("{name}{suffix}"), kind);
            }
        }
    }
    out
}

/// PromQL words that are not metric names: keywords and aggregation operators (which may be
/// followed by `by (...)` rather than by their parenthesis).
const PROMQL_WORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];

/// The metric names a PromQL expression selects: identifiers outside label matchers `{...}`, range
/// selectors `[...]`, strings, grouping clauses `by (...)`, that are not functions or keywords.
/// Grafana's `$variables` are skipped.
pub fn promql_metrics(expr: &str) -> Result<BTreeSet<String>, String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = BTreeSet::new();
    let mut i = 0;
    let mut last_word = String::new();
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            let end = chars[i + 1..]
                .iter()
                .position(|&d| d == c)
                .ok_or("unterminated string")?;
            i += end + 2;
        } else if c == '{' || c == '[' {
            let close = if c == '{' { '}' } else { ']' };
            let mut j = i + 1;
            while j < chars.len() && chars[j] != close {
                if chars[j] == '"' {
                    j += chars[j + 1..]
                        .iter()
                        .position(|&d| d == '"')
                        .ok_or("unterminated string")?
                        + 1;
                }
                j += 1;
            }
            if j == chars.len() {
                return Err(format!("unclosed {c} in {expr}"));
            }
            i = j + 1;
        } else if c == '$' {
            i += 1;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars[i..].iter().find(|c| !c.is_whitespace());
            let grouping = ["by", "without", "on", "ignoring", "group_left", "group_right"];
            if grouping.contains(&word.as_str()) && next == Some(&'(') {
                // skip the label list
                let close = chars[i..]
                    .iter()
                    .position(|&d| d == ')')
                    .ok_or("unclosed grouping")?;
                i += close + 1;
            } else if next == Some(&'(') || PROMQL_WORDS.contains(&word.to_ascii_lowercase().as_str()) {
                // a function call or a keyword
            } else if start > 0 && chars[start - 1].is_ascii_digit() {
                // a unit of a number/duration such as 5m (outside a range selector: offsets)
            } else {
                out.insert(word.clone());
            }
            last_word = word;
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.' || chars[i] == '+')
            {
                // numbers such as 0.99, 1e+06, and durations such as 5m
                if (chars[i] == '+') && !matches!(chars[i - 1], 'e' | 'E') {
                    break;
                }
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    let _ = last_word;
    Ok(out)
}

/// The volume `container` of `spec` mounts at a path `at` accepts.
pub fn mounted_volume<'a>(
    spec: &'a k8s_openapi::api::core::v1::PodSpec,
    container: &k8s_openapi::api::core::v1::Container,
    at: impl Fn(&str) -> bool,
) -> (&'a k8s_openapi::api::core::v1::Volume, String) {
    let mount = container
        .volume_mounts
        .as_ref()
        .expect("volume mounts")
        .iter()
        .find(|m| at(&m.mount_path))
        .expect("a volume mounted there");
    let volume = spec
        .volumes
        .as_ref()
        .expect("volumes")
        .iter()
        .find(|v| v.name == mount.name)
        .expect("the mounted volume");
    (volume, mount.mount_path.clone())
}
