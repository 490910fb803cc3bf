//! deploy/manifests: the kustomize tree. Most of its objects are the chart rendered with default
//! values (so the two cannot drift apart); the GPUClaim CRD, in the chart's crds/ and in the base, is
//! what `gpumem claims crd` prints; every YAML file under deploy/ parses into the typed object it
//! claims to be; every kustomization names files that exist.

mod deploy_support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

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

fn expected_text(template: &str, values: &Json) -> String {
    let rendered = render_chart(values);
    let r = rendered.iter().find(|r| r.template == template).unwrap();
    let body = r.text.trim_start_matches('\n').replace(
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
        let want = expected_text(template, &values);
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

/// The objects a kustomization produces (kind, namespace, name), following resources and
/// components, and checking every path it names exists.
fn build(dir: &Path, seen: &mut Vec<(String, String, String)>) {
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
                let ns = d["metadata"]["namespace"].as_str().unwrap_or("").to_string();
                seen.push((
                    d["kind"].as_str().unwrap().into(),
                    ns,
                    d["metadata"]["name"].as_str().unwrap().into(),
                ));
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
        seen.push(("ConfigMap".into(), ns, generator.name.clone()));
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
                .any(|(kind, _, name)| kind == &target.kind && name == &target.name),
            "{rel}: patch target {}/{} is not among the resources",
            target.kind,
            target.name
        );
    }
}

#[test]
fn overlays_build_from_files_that_exist() {
    let mut all = BTreeSet::new();
    for overlay in [
        "second-scheduler",
        "second-scheduler-monitoring",
        "default-scheduler",
    ] {
        let mut seen = Vec::new();
        build(&manifests().join("overlays").join(overlay), &mut seen);
        let unique: BTreeSet<_> = seen.iter().cloned().collect();
        assert_eq!(unique.len(), seen.len(), "{overlay}: an object appears twice");
        for (kind, ns, name) in &seen {
            let namespaced = ![
                "Namespace",
                "ClusterRole",
                "ClusterRoleBinding",
                "PriorityClass",
                "CustomResourceDefinition",
            ]
            .contains(&kind.as_str());
            if namespaced {
                assert!(
                    ["gpumem-system", "kube-system"].contains(&ns.as_str()),
                    "{overlay}: {kind}/{name} in {ns:?}"
                );
            }
        }
        all.extend(seen.into_iter().map(|(kind, _, name)| format!("{kind}/{name}")));
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
    ] {
        assert!(all.contains(want), "no overlay produces {want}");
    }
}
