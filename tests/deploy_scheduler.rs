//! kube-scheduler configuration: the second scheduler's profile (chart, v1 and v1beta3; manifests)
//! and the default scheduler's configuration files (v1, v1beta3) with the kubeadm patch. Each calls
//! the verbs the scorer serves, at the scorer's address, for both gpumem resources.

mod deploy_support;

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value as Json, json};

use deploy_support::*;

/// The paths the scorer serves under its urlPrefix (issue 6); the lead ties this list to the code.
const SCORER_VERBS: [&str; 4] = ["filter", "prioritize", "bind", "preempt"];

fn check_extender(config: &KubeSchedulerConfiguration, resources: [&str; 2], url: &str, what: &str) {
    assert_eq!(config.kind, "KubeSchedulerConfiguration");
    assert!(
        [
            "kubescheduler.config.k8s.io/v1",
            "kubescheduler.config.k8s.io/v1beta3"
        ]
        .contains(&config.api_version.as_str()),
        "{what}: {}",
        config.api_version
    );
    assert_eq!(
        config.extenders.len(),
        1,
        "{what}: one extender (only one may bind)"
    );
    let e = &config.extenders[0];
    let verbs = [&e.filter_verb, &e.prioritize_verb, &e.bind_verb, &e.preempt_verb];
    assert_eq!(verbs.map(|v| v.as_str()), SCORER_VERBS, "{what}: verbs");
    assert_eq!(e.url_prefix, url, "{what}: urlPrefix");
    assert!(
        !e.url_prefix.ends_with('/'),
        "{what}: kube-scheduler joins prefix and verb with '/'"
    );
    let managed: Vec<_> = e
        .managed_resources
        .iter()
        .map(|m| (m.name.as_str(), m.ignored_by_scheduler))
        .collect();
    assert_eq!(
        managed,
        [(resources[0], false), (resources[1], false)],
        "{what}: managedResources"
    );
    assert!(e.node_cache_capable, "{what}");
    assert!(
        !e.ignorable,
        "{what}: GPU pods must not be placed without the scorer"
    );
    assert!(e.weight > 0, "{what}");
    let timeout = go_duration_secs(&e.http_timeout)
        .unwrap_or_else(|| panic!("{what}: httpTimeout {:?}", e.http_timeout));
    assert!(timeout > 0.0 && timeout < 30.0, "{what}: httpTimeout {timeout}s");
    // The verbs are served over TLS to the scheduler's client certificate only (docs/operate.md,
    // "Security"): the scheduler verifies the scorer and presents its own certificate.
    assert!(e.enable_https, "{what}: enableHTTPS");
    assert!(e.url_prefix.starts_with("https://"), "{what}: {}", e.url_prefix);
    let tls = e
        .tls_config
        .as_ref()
        .unwrap_or_else(|| panic!("{what}: tlsConfig"));
    assert!(!tls.insecure, "{what}: the scorer's certificate is verified");
    for file in [&tls.cert_file, &tls.key_file, &tls.ca_file] {
        assert!(file.starts_with('/'), "{what}: {file}");
    }
    assert_eq!(config.profiles.len(), 1, "{what}");
}

fn chart_config(values: &Json) -> (KubeSchedulerConfiguration, Vec<Json>) {
    let docs: Vec<Json> = rendered_docs(&render_chart(values))
        .into_iter()
        .map(|(_, d)| d)
        .collect();
    let cm = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "gpumem-scheduler")
        .unwrap();
    let text = cm["data"]["scheduler-config.yaml"].as_str().unwrap();
    let doc = &yaml_docs(text, "scheduler-config.yaml")[0];
    check_typed(doc).unwrap();
    (parse(doc), docs)
}

#[test]
fn the_second_scheduler_calls_the_scorer_for_both_resources() {
    let (config, docs) = chart_config(&json!({}));
    check_extender(
        &config,
        ["nvidia.com/gpu-mem", "nvidia.com/gpu"],
        "https://gpumem-scorer.gpumem-system.svc:8443",
        "chart",
    );
    assert_eq!(config.api_version, "kubescheduler.config.k8s.io/v1");
    assert_eq!(config.profiles[0].scheduler_name, "gpumem-scheduler");
    let le = config.leader_election.as_ref().unwrap();
    assert_eq!(
        (le.resource_name.as_deref(), le.resource_namespace.as_deref()),
        (Some("gpumem-scheduler"), Some("gpumem-system"))
    );
    // The Service behind the URL serves the scorer's port, and the scorer listens there.
    let service = docs
        .iter()
        .find(|d| d["kind"] == "Service" && d["metadata"]["name"] == "gpumem-scorer")
        .unwrap();
    assert_eq!(service["spec"]["ports"][1]["port"], 8443);
    let scorer = docs
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "gpumem-scorer")
        .unwrap();
    let args = &scorer["spec"]["template"]["spec"]["containers"][0]["args"];
    assert!(args.as_array().unwrap().contains(&json!("--listen=0.0.0.0:8080")));
    // The scheduler reads the file the ConfigMap holds.
    let sched = docs
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "gpumem-scheduler")
        .unwrap();
    let c = &sched["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        c["command"],
        json!([
            "kube-scheduler",
            "--config=/etc/kubernetes/gpumem/scheduler-config.yaml"
        ])
    );
    assert_eq!(c["volumeMounts"][0]["mountPath"], "/etc/kubernetes/gpumem");

    let (config, _) = chart_config(
        &json!({"scheduler": {"configApiVersion": "v1beta3", "name": "gpu-sched"},
        "resourceNames": {"gpu": "example.com/gpu", "mem": "example.com/vram"}, "scorer": {"port": 9090, "tls": {"port": 9443}}}),
    );
    check_extender(
        &config,
        ["example.com/vram", "example.com/gpu"],
        "https://gpumem-scorer.gpumem-system.svc:9443",
        "chart v1beta3",
    );
    assert_eq!(config.api_version, "kubescheduler.config.k8s.io/v1beta3");
    assert_eq!(config.profiles[0].scheduler_name, "gpu-sched");
}

#[test]
fn the_default_scheduler_files_call_the_scorer_at_its_fixed_address() {
    let dir = repo().join("deploy/manifests/default-scheduler");
    let overlay = &yaml_docs(
        &read(&repo().join("deploy/manifests/overlays/default-scheduler/scorer-cluster-ip.yaml")),
        "patch",
    )[0];
    let ip = overlay["spec"]["clusterIP"].as_str().unwrap();
    let mut versions = Vec::new();
    for file in ["kube-scheduler-config.yaml", "kube-scheduler-config.v1beta3.yaml"] {
        let doc = &yaml_docs(&read(&dir.join(file)), file)[0];
        check_typed(doc).unwrap();
        let config: KubeSchedulerConfiguration = parse(doc);
        check_extender(
            &config,
            ["nvidia.com/gpu-mem", "nvidia.com/gpu"],
            &format!("https://{ip}:8443"),
            file,
        );
        assert_eq!(config.profiles[0].scheduler_name, "default-scheduler");
        assert_eq!(
            config.client_connection.as_ref().unwrap().kubeconfig,
            "/etc/kubernetes/scheduler.conf"
        );
        assert!(config.leader_election.as_ref().unwrap().leader_elect);
        versions.push(config.api_version);
    }
    assert_eq!(
        versions,
        [
            "kubescheduler.config.k8s.io/v1",
            "kubescheduler.config.k8s.io/v1beta3"
        ]
    );

    // The kubeadm patch starts kube-scheduler with that file, mounted from the host.
    let patch_file = dir.join("kubeadm-patches/kube-scheduler+strategic.yaml");
    let doc = &yaml_docs(&read(&patch_file), "patch")[0];
    check_typed(doc).unwrap();
    let pod: Pod = parse(doc);
    let spec = pod.spec.unwrap();
    let c = &spec.containers[0];
    assert_eq!(c.name, "kube-scheduler");
    let command = c.command.clone().unwrap();
    assert_eq!(command[0], "kube-scheduler");
    let config = command.iter().find_map(|a| a.strip_prefix("--config=")).unwrap();
    assert!(config.ends_with("/kube-scheduler-config.yaml"));
    for flag in ["--kubeconfig", "--leader-elect"] {
        assert!(
            !command.iter().any(|a| a.starts_with(flag)),
            "{flag} is in the configuration file"
        );
    }
    let (volume, mount_path) = mounted_volume(&spec, c, |path| config.starts_with(path));
    assert_eq!(volume.host_path.as_ref().unwrap().path, mount_path);
}

#[test]
fn a_wrong_verb_or_resource_fails() {
    let (config, _) = chart_config(&json!({}));
    let url = "https://gpumem-scorer.gpumem-system.svc:8443";
    let text = read(&repo().join("deploy/manifests/default-scheduler/kube-scheduler-config.yaml"));
    let original = yaml_docs(&text, "x")[0].clone();
    for (pointer, value) in [
        ("/extenders/0/bindVerb", json!("binding")),
        ("/extenders/0/managedResources/1/ignoredByScheduler", json!(true)),
        ("/extenders/0/enableHTTPS", json!(false)),
        ("/extenders/0/tlsConfig/caFile", json!("ca.crt")),
    ] {
        let mut doc = original.clone();
        *doc.pointer_mut(pointer).unwrap() = value;
        let config: KubeSchedulerConfiguration = parse(&doc);
        let result = std::panic::catch_unwind(|| {
            check_extender(
                &config,
                ["nvidia.com/gpu-mem", "nvidia.com/gpu"],
                "https://10.96.100.80:8443",
                "mutated",
            )
        });
        assert!(result.is_err(), "{pointer}");
    }
    let result = std::panic::catch_unwind(|| {
        check_extender(
            &config,
            ["nvidia.com/gpu-mem", "nvidia.com/gpu"],
            &format!("{url}/"),
            "x",
        )
    });
    assert!(result.is_err());
    let mut typo = original.clone();
    typo["extenders"][0]["filterverb"] = json!("filter");
    assert!(
        check_typed(&typo).is_err(),
        "a misspelt extender field is refused"
    );
    assert_eq!(go_duration_secs("1m30s"), Some(90.0));
    assert_eq!(go_duration_secs("5"), None);
}
