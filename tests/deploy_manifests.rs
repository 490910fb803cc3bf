//! deploy/manifests: the kustomize tree. Most of its objects are the chart rendered with default
//! values (so the two cannot drift apart); the GPUClaim CRD, in the chart's crds/ and in the base, is
//! what `gpumem claims crd` prints; every YAML file under deploy/ parses into the typed object it
//! claims to be; every kustomization names files that exist; only the `dra` overlay needs an API newer
//! than Kubernetes 1.24; the DRA example claims ask for what the agent's ResourceSlice offers.

mod deploy_support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gpumem::node::slice::{MEMORY_CAPACITY, SliceInputs, resource_slice_spec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{Device, ResourceClaimTemplate};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{Value as Json, json};

use deploy_support::*;

const REGENERATE: &str = "GPUMEM_REGENERATE_MANIFESTS";

fn manifests() -> PathBuf {
    repo().join("deploy/manifests")
}

/// (file under deploy/manifests, chart template, values) for every generated file.
fn generated() -> Vec<(&'static str, &'static str, Json)> {
    let monitoring = json!({"metrics": {"podMonitor": {"enabled": true}, "serviceMonitor": {"enabled": true},
        "prometheusRule": {"enabled": true}}});
    vec![
        ("base/agent-rbac.yaml", "templates/agent-rbac.yaml", json!({})),
        (
            "base/agent-dra-rbac.yaml",
            "templates/agent-dra-rbac.yaml",
            json!({}),
        ),
        (
            "base/agent-configmap.yaml",
            "templates/agent-configmap.yaml",
            json!({}),
        ),
        (
            "base/agent-daemonset.yaml",
            "templates/agent-daemonset.yaml",
            json!({}),
        ),
        ("base/scorer-rbac.yaml", "templates/scorer-rbac.yaml", json!({})),
        (
            "components/flow-schema/scorer-flowschema.yaml",
            "templates/scorer-flowschema.yaml",
            json!({}),
        ),
        (
            "base/scorer-dra-rbac.yaml",
            "templates/scorer-dra-rbac.yaml",
            json!({}),
        ),
        ("base/scorer.yaml", "templates/scorer.yaml", json!({})),
        ("base/claims-rbac.yaml", "templates/claims-rbac.yaml", json!({})),
        ("base/claims.yaml", "templates/claims.yaml", json!({})),
        (
            "base/priorityclasses.yaml",
            "templates/priorityclasses.yaml",
            json!({}),
        ),
        (
            "components/second-scheduler/scheduler.yaml",
            "templates/scheduler.yaml",
            json!({}),
        ),
        (
            "components/second-scheduler/scorer-networkpolicy.yaml",
            "templates/scorer-networkpolicy.yaml",
            json!({}),
        ),
        (
            "components/dra/dra.yaml",
            "templates/dra.yaml",
            json!({"dra": {"deviceClasses": true, "nodeRestriction": true}}),
        ),
        (
            "components/dra-placement/placement.yaml",
            "templates/dra-placement.yaml",
            json!({"dra": {"placement": true}}),
        ),
        (
            "components/dra-placement/scorer-config.yaml",
            "templates/scorer.yaml",
            json!({"dra": {"placement": true}}),
        ),
        (
            "components/dra-quotas/dra-quotas.yaml",
            "templates/dra-quotas.yaml",
            json!({"dra": {"quotas": true}}),
        ),
        (
            "components/dra-quotas/claims.yaml",
            "templates/claims.yaml",
            json!({"dra": {"quotas": true}}),
        ),
        (
            "components/gpu-share/gpu-share.yaml",
            "templates/gpu-share.yaml",
            json!({"agent": {"memCounting": "shares"}}),
        ),
        (
            "components/gpu-share/agent-config.yaml",
            "templates/agent-configmap.yaml",
            json!({"agent": {"memCounting": "shares"}}),
        ),
        (
            "components/monitoring/monitoring.yaml",
            "templates/monitoring.yaml",
            monitoring.clone(),
        ),
        (
            "components/monitoring/prometheusrule.yaml",
            "templates/prometheusrule.yaml",
            monitoring,
        ),
    ]
}

fn expected_text(file: &str, template: &str, values: &Json) -> String {
    let rendered = render_chart(values);
    let r = rendered.iter().find(|r| r.template == template).unwrap();
    let mut text = r.text.as_str();
    // A kustomize patch: only the template's first object (the scorer's ConfigMap).
    if file.ends_with("scorer-config.yaml") {
        text = text.split("\n---").next().unwrap_or(text);
        assert!(text.contains("kind: ConfigMap"), "{file}: {text}");
    }
    let body = text.trim_start_matches('\n').replace(
        "app.kubernetes.io/managed-by: Helm",
        "app.kubernetes.io/managed-by: kustomize",
    );
    format!(
        "# GENERATED from deploy/helm/gpumem/{template} with default values (release gpumem, namespace\n\
         # gpumem-system). Edit the chart, then: {REGENERATE}=1 cargo test --test deploy_manifests\n{body}"
    )
}

#[test]
fn generated_manifests_are_the_chart_rendered() {
    let regenerate = std::env::var_os(REGENERATE).is_some();
    let mut stale = Vec::new();
    for (file, template, values) in generated() {
        let path = manifests().join(file);
        let want = expected_text(file, template, &values);
        if regenerate {
            std::fs::write(&path, &want).unwrap();
        } else if std::fs::read_to_string(&path).ok().as_deref() != Some(want.as_str()) {
            stale.push(file);
        }
    }
    // The dashboard is a file of the chart; kustomize cannot read outside its tree: a copy.
    let dashboard = read(&chart_dir().join("dashboards/gpumem.json"));
    let copy = manifests().join("components/monitoring/gpumem.json");
    if regenerate {
        std::fs::write(&copy, &dashboard).unwrap();
    } else if std::fs::read_to_string(&copy).ok() != Some(dashboard) {
        stale.push("components/monitoring/gpumem.json");
    }
    assert!(
        stale.is_empty(),
        "stale, run `{REGENERATE}=1 cargo test --test deploy_manifests`: {stale:?}"
    );
}

/// The files that ship the GPUClaim CRD: Helm installs crds/ before the templates (and never
/// upgrades or deletes it); the end-to-end script applies the base's copy on its own.
const CRD_FILES: [&str; 2] = [
    "deploy/helm/gpumem/crds/gpuclaim-crd.yaml",
    "deploy/manifests/base/gpuclaim-crd.yaml",
];

/// `gpumem claims crd`'s output, with the header the shipped files carry.
fn crd_text() -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(["claims", "crd"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpumem claims crd: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let crd = String::from_utf8(out.stdout).unwrap();
    format!(
        "# GENERATED: `gpumem claims crd` (the types in src/claim/resource.rs). Change those, then:\n\
         # {REGENERATE}=1 cargo test --test deploy_manifests\n{crd}"
    )
}

#[test]
fn the_shipped_crd_is_what_gpumem_claims_crd_prints() {
    let want = crd_text();
    let mut stale = Vec::new();
    for file in CRD_FILES {
        let path = repo().join(file);
        if std::env::var_os(REGENERATE).is_some() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &want).unwrap();
        } else if std::fs::read_to_string(&path).ok().as_deref() != Some(want.as_str()) {
            stale.push(file);
        }
    }
    assert!(
        stale.is_empty(),
        "stale, run `{REGENERATE}=1 cargo test --test deploy_manifests`: {stale:?}"
    );
    // The API the controller uses: namespaced gpuclaims.gpumem.io/v1alpha1 with a status
    // subresource (it writes the status with PUT .../status, which 404s without one).
    let docs = yaml_docs(&want, "gpumem claims crd");
    assert_eq!(docs.len(), 1);
    assert_eq!(check_typed(&docs[0]).unwrap(), "CustomResourceDefinition");
    let crd: CustomResourceDefinition = parse(&docs[0]);
    assert_eq!(crd.metadata.name.as_deref(), Some("gpuclaims.gpumem.io"));
    assert_eq!(
        (
            crd.spec.group.as_str(),
            crd.spec.names.plural.as_str(),
            crd.spec.scope.as_str()
        ),
        ("gpumem.io", "gpuclaims", "Namespaced")
    );
    let versions: Vec<_> = crd
        .spec
        .versions
        .iter()
        .map(|v| (v.name.as_str(), v.served, v.storage))
        .collect();
    assert_eq!(versions, [("v1alpha1", true, true)]);
    let subresources = crd.spec.versions[0].subresources.as_ref().unwrap();
    assert!(subresources.status.is_some(), "no status subresource");
}

/// Every YAML file under deploy/ except the chart's templates (tests/deploy_chart.rs renders those).
fn yaml_files() -> Vec<PathBuf> {
    files_under(&repo().join("deploy"), &[".yaml", ".yml"])
        .into_iter()
        .filter(|p| !p.starts_with(chart_dir().join("templates")))
        .collect()
}

#[test]
fn every_yaml_file_under_deploy_is_a_typed_object() {
    let mut kinds = BTreeSet::new();
    let mut checked = 0;
    for path in yaml_files() {
        let rel = path.strip_prefix(repo()).unwrap().display().to_string();
        if path == chart_dir().join("values.yaml") {
            let values = yaml_docs(&read(&path), &rel);
            assert!(values.len() == 1 && values[0].is_object(), "{rel}");
            continue;
        }
        if path == chart_dir().join("Chart.yaml") {
            let chart: ChartYaml = parse(&yaml_docs(&read(&path), &rel)[0]);
            assert_eq!(
                (chart.api_version.as_str(), chart.name.as_str()),
                ("v2", "gpumem")
            );
            continue;
        }
        let docs = yaml_docs(&read(&path), &rel);
        assert!(!docs.is_empty(), "{rel} is empty");
        for doc in docs {
            kinds.insert(check_typed(&doc).unwrap_or_else(|e| panic!("{rel}: {e}")));
            checked += 1;
        }
    }
    for want in [
        "DaemonSet",
        "Deployment",
        "PodDisruptionBudget",
        "PriorityClass",
        "ResourceQuota",
        "PodMonitor",
        "ServiceMonitor",
        "PrometheusRule",
        "KubeSchedulerConfiguration",
        "Kustomization",
        "Component",
        "CustomResourceDefinition",
        "DeviceClass",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ResourceClaimTemplate",
    ] {
        assert!(
            kinds.contains(want),
            "no {want} under deploy/ ({checked} objects: {kinds:?})"
        );
    }
    // The generated ConfigMap of the second scheduler holds a KubeSchedulerConfiguration as text.
    let cm = yaml_docs(
        &read(&manifests().join("components/second-scheduler/scheduler.yaml")),
        "scheduler.yaml",
    )
    .into_iter()
    .find(|d| d["kind"] == "ConfigMap")
    .unwrap();
    let inner = &yaml_docs(
        cm["data"]["scheduler-config.yaml"].as_str().unwrap(),
        "scheduler-config.yaml",
    )[0];
    assert_eq!(check_typed(inner).unwrap(), "KubeSchedulerConfiguration");
}

/// Chart.yaml: every field Helm knows that the chart uses, nothing else (fields are checked by parsing).
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct ChartYaml {
    api_version: String,
    name: String,
    description: String,
    #[serde(rename = "type")]
    type_: String,
    version: String,
    app_version: String,
    kube_version: String,
    keywords: Vec<String>,
    home: String,
    sources: Vec<String>,
}

/// One object a kustomization produces.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Built {
    api: String,
    kind: String,
    ns: String,
    name: String,
}

/// The objects a kustomization produces, following resources and components, and checking every
/// path it names exists.
fn build(dir: &Path, seen: &mut Vec<Built>) {
    let file = dir.join("kustomization.yaml");
    let rel = file.strip_prefix(repo()).unwrap().display().to_string();
    let doc = &yaml_docs(&read(&file), &rel)[0];
    check_typed(doc).unwrap_or_else(|e| panic!("{rel}: {e}"));
    let k: Kustomization = parse(doc);
    assert!(
        k.namespace.is_none(),
        "{rel}: a namespace transformer would move the kube-system RoleBinding"
    );
    for entry in k.resources.iter().chain(&k.components) {
        let path = dir.join(entry);
        assert!(path.exists(), "{rel}: {entry} does not exist");
        if path.is_dir() {
            build(&path, seen);
        } else {
            for d in yaml_docs(&read(&path), entry) {
                let text = |v: &Json| v.as_str().unwrap_or("").to_string();
                seen.push(Built {
                    api: text(&d["apiVersion"]),
                    kind: text(&d["kind"]),
                    ns: text(&d["metadata"]["namespace"]),
                    name: text(&d["metadata"]["name"]),
                });
            }
        }
    }
    for generator in &k.config_map_generator {
        for f in &generator.files {
            assert!(dir.join(f).is_file(), "{rel}: {f} does not exist");
        }
        let ns = generator.namespace.clone().unwrap_or_default();
        assert!(
            !ns.is_empty(),
            "{rel}: generated ConfigMap {} has no namespace",
            generator.name
        );
        seen.push(Built {
            api: "v1".into(),
            kind: "ConfigMap".into(),
            ns,
            name: generator.name.clone(),
        });
    }
    for patch in &k.patches {
        let path = dir.join(&patch.path);
        let target = patch.target.as_ref().unwrap();
        let doc = &yaml_docs(&read(&path), &patch.path)[0];
        assert_eq!(
            (
                doc["kind"].as_str().unwrap(),
                doc["metadata"]["name"].as_str().unwrap()
            ),
            (target.kind.as_str(), target.name.as_str())
        );
        assert!(
            seen.iter()
                .any(|b| b.kind == target.kind && b.name == target.name),
            "{rel}: patch target {}/{} is not among the resources",
            target.kind,
            target.name
        );
    }
}

/// Every overlay. The end-to-end suite applies each with `--dry-run=server` to a Kubernetes 1.24
/// cluster and to a 1.36 one, skipping on 1.24 only the one named `dra` (tests/e2e/scenarios.sh).
const OVERLAYS: [&str; 4] = [
    "default-scheduler",
    "dra",
    "second-scheduler",
    "second-scheduler-monitoring",
];

/// The API versions a Kubernetes 1.24 cluster serves that the overlays use (and the Prometheus
/// Operator's, whose CRDs the end-to-end suite installs first).
const SERVED_BY_1_24: [&str; 9] = [
    "v1",
    "apps/v1",
    "policy/v1",
    "networking.k8s.io/v1",
    "rbac.authorization.k8s.io/v1",
    "scheduling.k8s.io/v1",
    "apiextensions.k8s.io/v1",
    "coordination.k8s.io/v1",
    "monitoring.coreos.com/v1",
];

fn build_overlay(overlay: &str) -> Vec<Built> {
    let mut seen = Vec::new();
    build(&manifests().join("overlays").join(overlay), &mut seen);
    seen
}

#[test]
fn overlays_build_from_files_that_exist() {
    let dirs: BTreeSet<String> = std::fs::read_dir(manifests().join("overlays"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        dirs,
        OVERLAYS.iter().map(|s| s.to_string()).collect(),
        "the overlays (the end-to-end suite applies every one)"
    );
    let mut all = BTreeSet::new();
    for overlay in OVERLAYS {
        let seen = build_overlay(overlay);
        let unique: BTreeSet<_> = seen.iter().cloned().collect();
        assert_eq!(unique.len(), seen.len(), "{overlay}: an object appears twice");
        for b in &seen {
            let namespaced = ![
                "Namespace",
                "ClusterRole",
                "ClusterRoleBinding",
                "PriorityClass",
                "FlowSchema",
                "CustomResourceDefinition",
                "DeviceClass",
                "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding",
            ]
            .contains(&b.kind.as_str());
            if namespaced {
                assert!(
                    ["gpumem-system", "kube-system"].contains(&b.ns.as_str()),
                    "{overlay}: {}/{} in {:?}",
                    b.kind,
                    b.name,
                    b.ns
                );
            } else {
                assert_eq!(b.ns, "", "{overlay}: {}/{} is cluster-scoped", b.kind, b.name);
            }
        }
        all.extend(seen.into_iter().map(|b| format!("{}/{}", b.kind, b.name)));
    }
    for want in [
        "DaemonSet/gpumem-agent",
        "Deployment/gpumem-scorer",
        "Deployment/gpumem-scheduler",
        "Deployment/gpumem-claims",
        "CustomResourceDefinition/gpuclaims.gpumem.io",
        "PodMonitor/gpumem-claims",
        "PrometheusRule/gpumem",
        "ConfigMap/gpumem-dashboard",
        "Namespace/gpumem-system",
        "ClusterRole/gpumem-agent-dra",
        "DeviceClass/gpu.gpumem.io",
        "ValidatingAdmissionPolicy/gpumem-agent-slices",
        "ValidatingAdmissionPolicyBinding/gpumem-agent-slices",
    ] {
        assert!(all.contains(want), "no overlay produces {want}");
    }
}

/// Only the `dra` overlay holds objects of APIs that Kubernetes 1.24 lacks (resource.k8s.io from
/// 1.34, ValidatingAdmissionPolicy from 1.30): the others keep applying to every supported cluster.
#[test]
fn only_the_dra_overlay_needs_a_newer_kubernetes() {
    for overlay in OVERLAYS {
        let newer: BTreeSet<String> = build_overlay(overlay)
            .into_iter()
            .map(|b| b.api)
            .filter(|api| !SERVED_BY_1_24.contains(&api.as_str()))
            .collect();
        let want: &[&str] = if overlay == "dra" {
            &[
                "admissionregistration.k8s.io/v1",
                "flowcontrol.apiserver.k8s.io/v1",
                "resource.k8s.io/v1",
            ]
        } else {
            &[]
        };
        assert_eq!(
            newer,
            want.iter().map(|s| s.to_string()).collect(),
            "{overlay}: APIs newer than Kubernetes 1.24"
        );
    }
    // The base, in every overlay, grants the agent its DRA rules whatever the cluster (RBAC rules may
    // name API groups a cluster does not serve): a node switches to DRA by its label alone.
    for overlay in OVERLAYS {
        assert!(
            build_overlay(overlay)
                .iter()
                .any(|b| b.kind == "ClusterRoleBinding" && b.name == "gpumem-agent-dra"),
            "{overlay}"
        );
    }
}

/// The devices of the ResourceSlice the agent publishes for the built-in profile `mixed` (2 x V100
/// joined by NVLink, 2 x T4), with the default driver name and memory unit.
fn published_devices(driver: &str) -> Vec<Device> {
    let profile = gpumem_profile::Profile::load("mixed").unwrap();
    let inventory = gpumem::gpu::GpuInventory::discover(&profile).unwrap();
    let roots = gpumem::gpu::pcie_roots(&inventory, None);
    let healthy = vec![true; inventory.gpus.len()];
    let spec = resource_slice_spec(
        &inventory,
        &SliceInputs {
            driver,
            node: "n1",
            unit_mib: 1,
            healthy: &healthy,
            pcie_roots: &roots,
            generation: 1,
        },
    );
    spec.devices.unwrap()
}

/// The `device.attributes["domain"].name` a CEL expression reads, as `domain/name`, and the string
/// literals it compares them with (`== "..."`).
fn cel_attributes(expr: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    const READ: &str = "device.attributes[\"";
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find(READ) {
        rest = &rest[at + READ.len()..];
        let (domain, after) = rest
            .split_once("\"].")
            .expect("device.attributes[\"domain\"].name");
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        names.insert(format!("{domain}/{name}"));
    }
    let literals = expr
        .split("== \"")
        .skip(1)
        .map(|s| s.split('"').next().unwrap().to_string())
        .collect();
    (names, literals)
}

#[test]
fn the_dra_examples_ask_for_what_the_agent_publishes() {
    let driver = gpumem::agent::config::DraConfig::default().driver_name;
    let devices = published_devices(&driver);
    // Attributes as claims name them: a bare name is in the driver's domain.
    let qualified = |name: &str| {
        if name.contains('/') {
            name.to_string()
        } else {
            format!("{driver}/{name}")
        }
    };
    let attribute = |d: &Device, name: &str| {
        d.attributes
            .iter()
            .flatten()
            .find(|(k, _)| qualified(k) == name)
            .map(|(_, v)| v.clone())
    };
    let published: BTreeSet<String> = devices
        .iter()
        .flat_map(|d| d.attributes.iter().flatten().map(|(k, _)| qualified(k)))
        .collect();
    let classes: BTreeSet<String> =
        yaml_docs(&read(&manifests().join("components/dra/dra.yaml")), "dra.yaml")
            .into_iter()
            .filter(|d| d["kind"] == "DeviceClass")
            .map(|d| d["metadata"]["name"].as_str().unwrap().to_string())
            .collect();
    assert_eq!(classes, BTreeSet::from([format!("gpu.{driver}")]));

    let docs = yaml_docs(
        &read(&manifests().join("examples/dra-claims.yaml")),
        "dra-claims.yaml",
    );
    let templates: Vec<ResourceClaimTemplate> = docs
        .iter()
        .filter(|d| d["kind"] == "ResourceClaimTemplate")
        .map(parse)
        .collect();
    let names: BTreeSet<_> = templates
        .iter()
        .map(|t| t.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(
        names,
        ["gpu-mem-5000mi", "gpu-nvlink-pair", "gpu-t4-8gi", "gpu-whole"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );
    for template in &templates {
        let name = template.metadata.name.as_deref().unwrap();
        let claim = template.spec.spec.devices.clone().unwrap();
        let requests = claim.requests.unwrap_or_default();
        assert_eq!(requests.len(), 1, "{name}");
        let exact = requests[0].exactly.clone().expect("an exact request");
        assert!(classes.contains(&exact.device_class_name), "{name}");
        // The devices this request can get: every attribute it reads exists, every product it
        // names is one the agent reports (the simple `==` of the examples, not a CEL evaluator).
        let mut candidates: Vec<&Device> = devices.iter().collect();
        for selector in exact.selectors.iter().flatten() {
            let expr = &selector.cel.as_ref().unwrap().expression;
            let (read, literals) = cel_attributes(expr);
            assert!(!read.is_empty(), "{name}: {expr}");
            for a in &read {
                assert!(
                    published.contains(a),
                    "{name}: {a} is not an attribute the agent publishes"
                );
            }
            candidates.retain(|d| {
                literals.iter().all(|l| {
                    read.iter()
                        .any(|a| attribute(d, a).and_then(|v| v.string).as_deref() == Some(l.as_str()))
                })
            });
        }
        assert!(!candidates.is_empty(), "{name}: no GPU of the profile matches");
        // Memory: the capacity the agent offers, within a GPU that can hold it; none: the whole GPU.
        let capacity = |d: &Device| d.capacity.clone().unwrap()[MEMORY_CAPACITY].clone();
        let requested = exact.capacity.and_then(|c| c.requests).unwrap_or_default();
        assert!(
            requested.keys().all(|k| k == MEMORY_CAPACITY),
            "{name}: {requested:?}"
        );
        let mib = |q: &str| gpumem::quantity::Quantity::parse(q).unwrap().mib_ceil().unwrap();
        if let Some(memory) = requested.get(MEMORY_CAPACITY) {
            candidates.retain(|d| mib(&memory.0) <= mib(&capacity(d).value.0));
            assert!(
                !candidates.is_empty(),
                "{name}: no matching GPU holds {}",
                memory.0
            );
        } else {
            for d in &candidates {
                let policy = capacity(d).request_policy.unwrap();
                assert_eq!(policy.default, Some(capacity(d).value), "{name}: the whole GPU");
            }
        }
        let count = match exact.allocation_mode.as_deref().unwrap_or("ExactCount") {
            "ExactCount" => exact.count.unwrap_or(1) as usize,
            other => panic!("{name}: {other}"),
        };
        // Constraints name the claim's requests and attributes the agent publishes; matchAttribute
        // can be met: `count` candidates share a value.
        for constraint in claim.constraints.iter().flatten() {
            for r in constraint.requests.iter().flatten() {
                assert!(requests.iter().any(|q| &q.name == r), "{name}: {r}");
            }
            let a = constraint.match_attribute.as_deref().unwrap();
            assert!(published.contains(a), "{name}: {a}");
            let mut groups = std::collections::BTreeMap::<String, usize>::new();
            for d in &candidates {
                if let Some(v) = attribute(d, a) {
                    *groups.entry(format!("{v:?}")).or_default() += 1;
                }
            }
            assert!(
                groups.values().any(|&n| n >= count),
                "{name}: no {count} GPUs share {a}"
            );
        }
        assert!(candidates.len() >= count, "{name}: {count} GPUs");
    }

    // The pod's claims come from those templates, and its container uses them.
    let pods: Vec<Pod> = docs.iter().filter(|d| d["kind"] == "Pod").map(parse).collect();
    assert_eq!(pods.len(), 1);
    let spec = pods[0].spec.clone().unwrap();
    let claims = spec.resource_claims.unwrap_or_default();
    assert!(!claims.is_empty());
    for c in &claims {
        assert!(names.contains(c.resource_claim_template_name.as_ref().unwrap()));
    }
    for container in &spec.containers {
        let used = container.resources.as_ref().unwrap().claims.clone().unwrap();
        assert!(used.iter().all(|u| claims.iter().any(|c| c.name == u.name)));
    }
}

#[test]
fn the_example_checks_can_fail() {
    let (read, literals) = cel_attributes(r#"device.attributes["gpumem.io"].productName == "Tesla T4" && x"#);
    assert_eq!(read, BTreeSet::from(["gpumem.io/productName".to_string()]));
    assert_eq!(literals, BTreeSet::from(["Tesla T4".to_string()]));
    let devices = published_devices("gpumem.io");
    let products: BTreeSet<_> = devices
        .iter()
        .filter_map(|d| d.attributes.as_ref()?.get("productName")?.string.clone())
        .collect();
    assert!(products.contains("Tesla T4"), "{products:?}");
    assert!(!products.contains("Tesla T5"));
}
