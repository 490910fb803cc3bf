//! The Helm chart, rendered without `helm` (tests/deploy_support: the template subset documented in
//! deploy/helm/gpumem/README.md) for default and non-default values: every object is the typed
//! Kubernetes object it claims to be, the agent's config file is one the agent accepts, and the
//! DaemonSet mounts every path that config makes the agent use (the DRA path's among them); the DRA
//! DeviceClass and admission policy follow the agent's driver name and ServiceAccount; GPU memory is
//! counted in shares where the API server serves MutatingAdmissionPolicy v1 (or as the values say),
//! with the policy that gives each container asking memory its share, evaluated on sample pods.

mod deploy_support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::{Args as _, FromArgMatches as _};
use gpumem::agent::config::{DeviceListStrategy, DraConfig, MemCounting, MemoryLimits, Mode};
use gpumem::agent::{AgentArgs, AgentConfig};
use gpumem::claim::ControllerArgs;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingAdmissionPolicy, MutatingAdmissionPolicyBinding, MutatingAdmissionPolicySpec,
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec};
use k8s_openapi::api::rbac::v1::Role;
use k8s_openapi::api::resource::v1::DeviceClass;
use serde_json::{Value as Json, json};

use deploy_support::*;

/// Non-default values touching every switch of the chart.
fn custom_values() -> Json {
    json!({
        "memUnitMiB": 4,
        "resourceNames": {"gpu": "example.com/gpu", "mem": "example.com/vram"},
        "enforcement": {"enabled": false},
        "deviceListStrategy": "cdi-cri",
        "images": {"gpumem": {"repository": "registry.example.com/gpumem", "tag": "9.9.9", "pullPolicy": "Always"}},
        "imagePullSecrets": [{"name": "regcred"}],
        "agent": {
            "stateDir": "/opt/gpumem",
            "devicePluginDir": "/data/kubelet/device-plugins",
            "podResourcesDir": "/data/kubelet/pod-resources",
            "mode": "dra",
            "kubeletPluginsDir": "/data/kubelet/plugins",
            "pluginRegistryDir": "/data/kubelet/plugins_registry",
            "cdiDir": "/etc/cdi",
            "nvml": {"mode": "hostPath", "driverLibDir": "/usr/lib64"},
            "metrics": {"port": 9500},
            "health": {"ignoredXids": [13], "quietPeriodSeconds": 60, "probeIntervalSeconds": 2},
            "extraArgs": ["--health-quiet-period=120"],
            "nodeSelector": {"gpu": "yes"},
            "tolerations": []
        },
        "scorer": {
            "replicas": 3,
            "port": 9090,
            "service": {"clusterIP": "10.96.100.80"},
            "config": {"weights": {"online": 0.8}},
            "pdb": {"minAvailable": 2},
            "extraArgs": ["--without-kube"]
        },
        "claims": {
            "replicas": 2,
            "port": 9891,
            "resources": {"requests": {"cpu": "10m"}},
            "priorityClassName": "gpumem-online",
            "nodeSelector": {"role": "infra"},
            "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
            "extraArgs": ["--lease-namespace=gpumem-system"]
        },
        "scheduler": {"configApiVersion": "v1beta3", "name": "gpu-sched", "extender": {"weight": 3, "httpTimeout": "2s"}},
        "metrics": {
            "podMonitor": {"enabled": true, "labels": {"release": "prom"}},
            "serviceMonitor": {"enabled": true},
            "prometheusRule": {"enabled": true},
            "grafanaDashboard": {"enabled": true}
        },
        "priorityClasses": {"online": {"value": 2000000}, "offline": {"name": "batch"}},
        "dra": {"driverName": "example.com", "deviceClasses": true, "nodeRestriction": false},
        "quotas": [
            {"namespace": "team-a", "gpuMem": "163840", "gpu": "2"},
            {"namespace": "team-b", "gpuMem": 40960}
        ]
    })
}

fn objects(values: &Json) -> Vec<(String, Json)> {
    objects_with_apis(values, &[])
}

/// [`objects`] where the API server serves `api_versions` (`helm install`'s `.Capabilities`).
fn objects_with_apis(values: &Json, api_versions: &[&str]) -> Vec<(String, Json)> {
    let docs = rendered_docs(&render_chart_with_apis(values, api_versions));
    for (template, doc) in &docs {
        check_typed(doc).unwrap_or_else(|e| panic!("{template}: {e}"));
    }
    docs
}

fn find<'a>(docs: &'a [(String, Json)], kind: &str, name: &str) -> Option<&'a Json> {
    docs.iter()
        .map(|(_, d)| d)
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
}

fn get<T: serde::de::DeserializeOwned>(docs: &[(String, Json)], kind: &str, name: &str) -> T {
    parse(find(docs, kind, name).unwrap_or_else(|| panic!("no {kind} {name}")))
}

fn kinds_and_names(docs: &[(String, Json)]) -> BTreeSet<String> {
    docs.iter()
        .map(|(_, d)| format!("{}/{}", d["kind"].as_str().unwrap(), d["metadata"]["name"]))
        .collect()
}

fn pod_spec(ds: &DaemonSet) -> &PodSpec {
    ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
}

fn container<'a>(spec: &'a PodSpec, name: &str) -> &'a Container {
    spec.containers.iter().find(|c| c.name == name).unwrap()
}

#[test]
fn default_values_render_the_expected_typed_objects() {
    let docs = objects(&json!({}));
    let names = kinds_and_names(&docs);
    let expected = [
        "ServiceAccount/\"gpumem-agent\"",
        "ClusterRole/\"gpumem-agent\"",
        "ClusterRoleBinding/\"gpumem-agent\"",
        "ClusterRole/\"gpumem-agent-dra\"",
        "ClusterRoleBinding/\"gpumem-agent-dra\"",
        "ConfigMap/\"gpumem-agent\"",
        "DaemonSet/\"gpumem-agent\"",
        "ServiceAccount/\"gpumem-scorer\"",
        "ClusterRole/\"gpumem-scorer\"",
        "ClusterRoleBinding/\"gpumem-scorer\"",
        "Role/\"gpumem-scorer-bookings\"",
        "RoleBinding/\"gpumem-scorer-bookings\"",
        "ClusterRole/\"gpumem-scorer-dra\"",
        "ClusterRoleBinding/\"gpumem-scorer-dra\"",
        "Role/\"gpumem-scorer-lease\"",
        "RoleBinding/\"gpumem-scorer-lease\"",
        "ConfigMap/\"gpumem-scorer\"",
        "Deployment/\"gpumem-scorer\"",
        "Service/\"gpumem-scorer\"",
        "PodDisruptionBudget/\"gpumem-scorer\"",
        "NetworkPolicy/\"gpumem-scorer\"",
        "FlowSchema/\"gpumem-scorer\"",
        "ServiceAccount/\"gpumem-claims\"",
        "ClusterRole/\"gpumem-claims\"",
        "ClusterRoleBinding/\"gpumem-claims\"",
        "Role/\"gpumem-claims-lease\"",
        "RoleBinding/\"gpumem-claims-lease\"",
        "Deployment/\"gpumem-claims\"",
        "ClusterRole/\"gpumem-gpuclaims-edit\"",
        "ClusterRole/\"gpumem-gpuclaims-view\"",
        "ServiceAccount/\"gpumem-scheduler\"",
        "ClusterRoleBinding/\"gpumem-scheduler-kube-scheduler\"",
        "ClusterRoleBinding/\"gpumem-scheduler-volume-scheduler\"",
        "RoleBinding/\"gpumem-scheduler-authentication-reader\"",
        "Role/\"gpumem-scheduler-lease\"",
        "RoleBinding/\"gpumem-scheduler-lease\"",
        "ConfigMap/\"gpumem-scheduler\"",
        "Deployment/\"gpumem-scheduler\"",
        "PriorityClass/\"gpumem-online\"",
        "PriorityClass/\"gpumem-offline\"",
    ];
    let expected: BTreeSet<String> = expected.iter().map(|s| s.to_string()).collect();
    assert_eq!(names, expected, "objects rendered with default values");

    // Scorer: 2 replicas behind a PDB; ready once its caches synced (/readyz), alive while it serves
    // (/healthz), both at the port the Service names.
    let scorer: Deployment = get(&docs, "Deployment", "gpumem-scorer");
    assert_eq!(scorer.spec.as_ref().unwrap().replicas, Some(2));
    let spec = scorer.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let c = container(spec, "scorer");
    assert_eq!(
        c.args.as_ref().unwrap()[..2],
        ["scorer".to_string(), "--listen=0.0.0.0:8080".into()]
    );
    let port = &c.ports.as_ref().unwrap()[0];
    assert_eq!((port.name.as_deref(), port.container_port), (Some("http"), 8080));
    for (probe, path) in [(&c.readiness_probe, "/readyz"), (&c.liveness_probe, "/healthz")] {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(serde_json::to_value(&get.port).unwrap(), json!("http"));
    }
    let pod_sc = spec.security_context.as_ref().unwrap();
    assert_eq!(
        (pod_sc.run_as_non_root, pod_sc.run_as_user),
        (Some(true), Some(65532))
    );
    let pdb = find(&docs, "PodDisruptionBudget", "gpumem-scorer").unwrap();
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    let pod_labels =
        serde_json::to_value(&scorer.spec.as_ref().unwrap().template.metadata).unwrap()["labels"].clone();
    for (k, v) in pdb["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&pod_labels[k], v, "the PDB selects the scorer's pods");
    }
    let service = find(&docs, "Service", "gpumem-scorer").unwrap();
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "http");
    assert_eq!(service["spec"]["ports"][0]["port"], 8080);
    assert!(service["spec"].get("clusterIP").is_none());
}

/// The scorer's FlowSchema comes in the newest flowcontrol version the cluster serves (1.24 serves
/// v1beta2, 1.26 to 1.31 v1beta3, 1.29+ v1), names the scorer's service account and priority level,
/// and is left out with `scorer.priorityLevel: ""`.
#[test]
fn the_scorers_flow_schema_follows_the_cluster_and_the_values() {
    let group = "flowcontrol.apiserver.k8s.io";
    for (served, want) in [
        (vec!["v1beta2"], "v1beta2"),
        (vec!["v1beta2", "v1beta3"], "v1beta3"),
        (vec!["v1beta3", "v1"], "v1"),
        (vec![], "v1"),
    ] {
        let apis: Vec<String> = served.iter().map(|v| format!("{group}/{v}/FlowSchema")).collect();
        let apis: Vec<&str> = apis.iter().map(String::as_str).collect();
        let docs = objects_with_apis(&json!({}), &apis);
        let fs = find(&docs, "FlowSchema", "gpumem-scorer").expect("the FlowSchema");
        assert_eq!(fs["apiVersion"], format!("{group}/{want}"), "serving {served:?}");
        assert_eq!(fs["spec"]["priorityLevelConfiguration"]["name"], "workload-high");
        let subject = &fs["spec"]["rules"][0]["subjects"][0]["serviceAccount"];
        assert_eq!(subject["name"], "gpumem-scorer");
        assert_eq!(subject["namespace"], "gpumem-system");
    }
    let docs = objects(&json!({"scorer": {"priorityLevel": "global-default"}}));
    let fs = find(&docs, "FlowSchema", "gpumem-scorer").expect("the FlowSchema");
    assert_eq!(fs["spec"]["priorityLevelConfiguration"]["name"], "global-default");
    let docs = objects(&json!({"scorer": {"priorityLevel": ""}}));
    assert!(find(&docs, "FlowSchema", "gpumem-scorer").is_none());
}

#[test]
fn non_default_values_render_typed_objects_that_follow_them() {
    let docs = objects(&custom_values());
    let names = kinds_and_names(&docs);
    for want in [
        "PodMonitor/\"gpumem-agent\"",
        "ServiceMonitor/\"gpumem-scorer\"",
        "PrometheusRule/\"gpumem\"",
        "ConfigMap/\"gpumem-dashboard\"",
        "PriorityClass/\"batch\"",
        "DeviceClass/\"gpu.example.com\"",
    ] {
        assert!(names.contains(want), "{want} missing from {names:?}");
    }
    assert!(
        !names.iter().any(|n| n.starts_with("ValidatingAdmissionPolicy")),
        "dra.nodeRestriction false: no policy: {names:?}"
    );
    let ds: DaemonSet = get(&docs, "DaemonSet", "gpumem-agent");
    let spec = pod_spec(&ds);
    assert!(
        spec.init_containers.is_none(),
        "no shim to install without enforcement"
    );
    assert!(spec.tolerations.is_none(), "tolerations: [] leaves none");
    assert_eq!(
        spec.runtime_class_name, None,
        "hostPath NVML does not use the NVIDIA runtime"
    );
    assert_eq!(spec.image_pull_secrets.as_ref().unwrap()[0].name, "regcred");
    let agent = container(spec, "agent");
    assert_eq!(agent.image.as_deref(), Some("registry.example.com/gpumem:9.9.9"));
    assert_eq!(agent.security_context.as_ref().unwrap().privileged, Some(true));
    assert!(
        agent
            .args
            .as_ref()
            .unwrap()
            .contains(&"--health-quiet-period=120".to_string())
    );
    let env: Vec<_> = agent
        .env
        .as_ref()
        .unwrap()
        .iter()
        .map(|e| e.name.as_str())
        .collect();
    assert_eq!(env, ["NODE_NAME"], "no NVIDIA runtime variables in hostPath mode");

    let pc = find(&docs, "PriorityClass", "gpumem-online").unwrap();
    assert_eq!(pc["value"], 2000000, "large numbers survive (through `int`)");
    let quotas: Vec<_> = docs
        .iter()
        .map(|(_, d)| d)
        .filter(|d| d["kind"] == "ResourceQuota")
        .collect();
    assert_eq!(quotas.len(), 2);
    assert_eq!(quotas[0]["metadata"]["namespace"], "team-a");
    assert_eq!(quotas[0]["spec"]["hard"]["requests.example.com/vram"], "163840");
    assert_eq!(quotas[0]["spec"]["hard"]["requests.example.com/gpu"], "2");
    assert_eq!(
        quotas[1]["spec"]["hard"],
        json!({"requests.example.com/vram": "40960"})
    );

    let scorer: Deployment = get(&docs, "Deployment", "gpumem-scorer");
    assert_eq!(scorer.spec.as_ref().unwrap().replicas, Some(3));
    let scorer_cm: ConfigMap = get(&docs, "ConfigMap", "gpumem-scorer");
    let scorer_config = &yaml_docs(&scorer_cm.data.unwrap()["scorer.yaml"], "scorer.yaml")[0];
    assert_eq!(scorer_config["weights"], json!({"online": 0.8}));
    assert_eq!(scorer_config["tls"]["certFile"], "/etc/gpumem-tls/tls.crt");
    let service = find(&docs, "Service", "gpumem-scorer").unwrap();
    assert_eq!(service["spec"]["clusterIP"], "10.96.100.80");

    let dashboard: ConfigMap = get(&docs, "ConfigMap", "gpumem-dashboard");
    let json_text = &dashboard.data.unwrap()["gpumem.json"];
    let original = read(&chart_dir().join("dashboards/gpumem.json"));
    assert_eq!(
        json_text.trim_end(),
        original.trim_end(),
        "the dashboard is embedded unchanged"
    );
    let pm = find(&docs, "PodMonitor", "gpumem-agent").unwrap();
    assert_eq!(pm["metadata"]["labels"]["release"], "prom");

    // Without the scorer, the second scheduler and the claim controller, none of their objects remain.
    let none = objects(
        &json!({"scorer": {"enabled": false}, "scheduler": {"mode": "none"}, "claims": {"enabled": false},
        "priorityClasses": {"enabled": false},
        "metrics": {"serviceMonitor": {"enabled": true}, "podMonitor": {"enabled": true}}}),
    );
    let names = kinds_and_names(&none);
    assert!(
        names.iter().all(|n| n.contains("agent")),
        "only the agent is left: {names:?}"
    );
}

/// The agent's config file as rendered, loaded by the agent's own loader.
fn agent_config(docs: &[(String, Json)], dir: &Path) -> (AgentConfig, PathBuf) {
    let cm: ConfigMap = get(docs, "ConfigMap", "gpumem-agent");
    let path = dir.join("agent.yaml");
    std::fs::write(&path, &cm.data.unwrap()["agent.yaml"]).unwrap();
    let args = AgentArgs {
        config: Some(path.clone()),
        ..Default::default()
    };
    let config =
        AgentConfig::load(&args).unwrap_or_else(|e| panic!("the agent refuses the chart's config: {e:#}"));
    (config, path)
}

#[test]
fn the_agent_accepts_the_rendered_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let (config, _) = agent_config(&objects(&json!({})), dir.path());
    let default = AgentConfig::default();
    assert_eq!(config.mem_unit_mib, 1);
    assert_eq!(
        (config.gpu_resource.as_str(), config.mem_resource.as_str()),
        ("nvidia.com/gpu", "nvidia.com/gpu-mem")
    );
    assert_eq!(config.device_plugin_dir, default.device_plugin_dir);
    assert_eq!(config.pod_resources_socket, default.pod_resources_socket);
    assert_eq!(config.state_dir, default.state_dir);
    assert_eq!(
        config.shim_path, default.shim_path,
        "the chart installs the shim where the agent looks"
    );
    assert_eq!(config.memory_limits, MemoryLimits::Enforce);
    assert_eq!(config.device_list_strategy, DeviceListStrategy::Envvar);
    assert_eq!(config.ignored_xids, default.ignored_xids);
    assert_eq!(config.health_quiet_period, default.health_quiet_period);
    assert_eq!(config.nvml_lib, None);
    assert_eq!(config.mode, Mode::DevicePlugin);
    assert_eq!(
        config.dra,
        DraConfig::default(),
        "the chart's DRA directories are the agent's defaults"
    );
    assert_eq!(
        config.dra.endpoint(),
        Path::new("/var/lib/kubelet/plugins/gpumem.io/dra.sock")
    );

    let (config, _) = agent_config(&objects(&custom_values()), dir.path());
    assert_eq!(config.mode, Mode::Dra);
    assert_eq!(
        config.dra,
        DraConfig {
            driver_name: "example.com".into(),
            registry_dir: "/data/kubelet/plugins_registry".into(),
            plugin_dir: "/data/kubelet/plugins".into(),
            cdi_dir: "/etc/cdi".into(),
        }
    );
    assert_eq!(config.mem_unit_mib, 4);
    assert_eq!(config.mem_resource, "example.com/vram");
    assert_eq!(config.memory_limits, MemoryLimits::Off);
    assert_eq!(config.device_list_strategy, DeviceListStrategy::CdiCri);
    assert_eq!(config.state_dir, Path::new("/opt/gpumem"));
    assert_eq!(config.shim_path, Path::new("/opt/gpumem/lib/libgpumem_cuda.so"));
    assert_eq!(
        config.pod_resources_socket,
        Path::new("/data/kubelet/pod-resources/kubelet.sock")
    );
    assert_eq!(config.ignored_xids, [13]);
    assert_eq!(config.health_probe_interval.as_secs(), 2);
    assert_eq!(
        config.nvml_lib.as_deref(),
        Some(Path::new("/run/gpumem/driver/libnvidia-ml.so.1"))
    );
}

/// The host path behind the container path `path`, from the pod's hostPath volumes and the
/// container's mounts (the longest mount prefix wins).
fn host_path_of(spec: &PodSpec, c: &Container, path: &Path) -> Option<PathBuf> {
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| path.starts_with(&m.mount_path))
        .max_by_key(|m| m.mount_path.len())?;
    let volume = spec.volumes.iter().flatten().find(|v| v.name == mount.name)?;
    let host = &volume.host_path.as_ref()?.path;
    Some(Path::new(host).join(path.strip_prefix(&mount.mount_path).unwrap()))
}

#[test]
fn the_daemonset_mounts_every_path_the_agent_uses() {
    for values in [
        json!({}),
        custom_values(),
        json!({"agent": {"nvml": {"mode": "hostPath"}}}),
    ] {
        let docs = objects(&values);
        let dir = tempfile::tempdir().unwrap();
        let (config, _) = agent_config(&docs, dir.path());
        let ds: DaemonSet = get(&docs, "DaemonSet", "gpumem-agent");
        let spec = pod_spec(&ds);
        let agent = container(spec, "agent");
        // The agent hands the kubelet HOST paths (shim, preload file, accounting dirs) and creates
        // sockets the kubelet dials by host path: these are mounted at the same path inside.
        let mut same_path = vec![
            config.device_plugin_dir.clone(),
            config.pod_resources_socket.parent().unwrap().to_path_buf(),
            config.state_dir.clone(),
            config.state_dir.join("containers"),
        ];
        if config.memory_limits == MemoryLimits::Enforce {
            same_path.push(config.shim_path.parent().unwrap().to_path_buf());
        }
        // The DRA path, on every node whatever agent.mode (a node's label gpumem.io/mode switches
        // it): the registration socket and the driver's socket the kubelet dials by host path, and
        // the CDI specs the container runtime reads by host path. The agent creates all three.
        let dra = [
            config.dra.registry_dir.clone(),
            config.dra.endpoint().parent().unwrap().to_path_buf(),
            config.dra.cdi_dir.clone(),
        ];
        same_path.extend(dra.iter().cloned());
        for path in &same_path {
            assert_eq!(
                host_path_of(spec, agent, path).as_deref(),
                Some(path.as_path()),
                "{} must be the host's {0} inside the agent",
                path.display()
            );
        }
        let writable = |p: &Path| {
            agent
                .volume_mounts
                .iter()
                .flatten()
                .filter(|m| p.starts_with(&m.mount_path))
                .max_by_key(|m| m.mount_path.len())
                .is_some_and(|m| m.read_only != Some(true))
        };
        assert!(
            writable(&config.device_plugin_dir),
            "the agent creates its sockets there"
        );
        assert!(
            writable(&config.state_dir),
            "the agent writes accounting dirs there"
        );
        for path in &dra {
            assert!(writable(path), "the agent creates files in {}", path.display());
        }
        for dir in [
            &config.dra.registry_dir,
            &config.dra.plugin_dir,
            &config.dra.cdi_dir,
        ] {
            let mount = agent
                .volume_mounts
                .iter()
                .flatten()
                .find(|m| Path::new(&m.mount_path) == dir.as_path())
                .unwrap_or_else(|| panic!("{} is mounted as such", dir.display()));
            let volume = spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == mount.name)
                .unwrap();
            assert_eq!(
                volume.host_path.as_ref().unwrap().type_.as_deref(),
                Some("DirectoryOrCreate"),
                "{}: the kubelet or the runtime may not have made it yet",
                dir.display()
            );
        }
        if let Some(nvml) = &config.nvml_lib {
            let host = host_path_of(spec, agent, nvml).expect("the NVML library is mounted");
            assert!(host.ends_with("libnvidia-ml.so.1"), "{}", host.display());
        }
        // The config file itself.
        let args = agent.args.as_ref().unwrap();
        let config_arg = args.iter().find_map(|a| a.strip_prefix("--config=")).unwrap();
        let m = agent
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| Path::new(config_arg).starts_with(&m.mount_path));
        let volume = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| Some(&v.name) == m.map(|m| &m.name))
            .unwrap();
        assert_eq!(volume.config_map.as_ref().unwrap().name, "gpumem-agent");
        assert!(config_arg.ends_with("/agent.yaml"));
        // The init container installs the shim into the host directory the agent reads it from.
        if config.memory_limits == MemoryLimits::Enforce {
            let init = &spec.init_containers.as_ref().unwrap()[0];
            let dest = init
                .env
                .iter()
                .flatten()
                .find(|e| e.name == "DEST")
                .unwrap()
                .value
                .clone()
                .unwrap();
            assert_eq!(Path::new(&dest), config.shim_path.parent().unwrap());
            assert_eq!(
                host_path_of(spec, init, Path::new(&dest)).as_deref(),
                Some(Path::new(&dest))
            );
            let script = init.command.as_ref().unwrap().join(" ");
            assert!(
                script.contains("/usr/local/lib/gpumem/libgpumem_cuda.so"),
                "{script}"
            );
            assert!(script.contains(&format!(
                "\"$DEST/{}\"",
                config.shim_path.file_name().unwrap().to_string_lossy()
            )));
            assert!(
                script.contains("mv -f"),
                "installed by rename, never overwritten in place"
            );
        }
    }
}

/// The DRA objects of templates/dra.yaml, by template (the ClusterRole for the DRA path is in
/// agent-dra-rbac.yaml, whatever the values).
fn dra_objects(docs: &[(String, Json)]) -> BTreeSet<String> {
    kinds_and_names(
        &docs
            .iter()
            .filter(|(t, _)| t == "templates/dra.yaml")
            .cloned()
            .collect::<Vec<_>>(),
    )
}

#[test]
fn the_dra_objects_follow_the_agents_driver_and_service_account() {
    // The DeviceClass selects the devices of the driver the agent publishes as.
    let dra_on = json!({"dra": {"deviceClasses": true, "nodeRestriction": true}});
    for values in [
        dra_on.clone(),
        custom_values(),
        json!({"dra": {"driverName": "gpus.example.org", "deviceClasses": true}}),
    ] {
        let docs = objects(&values);
        let (config, _) = agent_config(&docs, tempfile::tempdir().unwrap().path());
        let name = format!("gpu.{}", config.dra.driver_name);
        let class: DeviceClass = get(&docs, "DeviceClass", &name);
        let selectors = class.spec.selectors.unwrap_or_default();
        let expressions: Vec<_> = selectors
            .iter()
            .map(|s| s.cel.as_ref().unwrap().expression.as_str())
            .collect();
        assert_eq!(
            expressions,
            [format!("device.driver == \"{}\"", config.dra.driver_name)],
            "{name}"
        );
        assert!(class.spec.config.is_none() && class.spec.extended_resource_name.is_none());
    }

    // The policy holds the ServiceAccount the agent's DaemonSet runs as, and only it, for every write
    // of a ResourceSlice, to the node its token is bound to.
    let docs = objects(&dra_on);
    let ds: DaemonSet = get(&docs, "DaemonSet", "gpumem-agent");
    let account = format!(
        "system:serviceaccount:{}:{}",
        ds.metadata.namespace.as_deref().unwrap(),
        pod_spec(&ds).service_account_name.as_deref().unwrap()
    );
    let policy: ValidatingAdmissionPolicy = get(&docs, "ValidatingAdmissionPolicy", "gpumem-agent-slices");
    let spec = policy.spec.unwrap();
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    assert!(spec.param_kind.is_none());
    let rules = spec.match_constraints.unwrap().resource_rules.unwrap_or_default();
    assert_eq!(rules.len(), 1);
    assert_eq!(
        rules[0].api_groups.as_deref(),
        Some(&["resource.k8s.io".to_string()][..])
    );
    assert_eq!(rules[0].api_versions.as_deref(), Some(&["*".to_string()][..]));
    assert_eq!(
        rules[0].resources.as_deref(),
        Some(&["resourceslices".to_string()][..])
    );
    let operations: BTreeSet<_> = rules[0].operations.iter().flatten().map(String::as_str).collect();
    assert_eq!(operations, BTreeSet::from(["CREATE", "UPDATE", "DELETE"]));
    let conditions: Vec<_> = spec
        .match_conditions
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.expression)
        .collect();
    assert_eq!(conditions, [format!("request.userInfo.username == '{account}'")]);
    let variables: Vec<_> = spec
        .variables
        .unwrap_or_default()
        .into_iter()
        .map(|v| (v.name, v.expression))
        .collect();
    assert_eq!(
        variables,
        [
            (
                "userNode".to_string(),
                "request.userInfo.extra[?'authentication.kubernetes.io/node-name'][0].orValue('')"
                    .to_string()
            ),
            (
                "objectNode".to_string(),
                "(request.operation == 'DELETE' ? oldObject : object).spec.?nodeName.orValue('')".to_string()
            ),
        ]
    );
    let validations = spec.validations.unwrap_or_default();
    let expressions: Vec<_> = validations.iter().map(|v| v.expression.as_str()).collect();
    assert_eq!(
        expressions,
        [
            "variables.userNode != ''",
            "variables.userNode == '' || variables.objectNode == variables.userNode"
        ]
    );
    for v in &validations {
        assert_eq!(v.reason.as_deref(), Some("Forbidden"));
        let message = v.message_expression.as_deref().expect("a messageExpression");
        assert!(
            message.contains("ResourceSlices") && !message.contains('\n'),
            "{message}"
        );
    }
    assert!(
        validations[1]
            .message_expression
            .as_deref()
            .unwrap()
            .contains("variables.objectNode")
    );
    let binding: ValidatingAdmissionPolicyBinding =
        get(&docs, "ValidatingAdmissionPolicyBinding", "gpumem-agent-slices");
    let binding = binding.spec;
    assert_eq!(binding.policy_name, "gpumem-agent-slices");
    assert_eq!(binding.validation_actions, ["Deny"]);
    assert!(binding.param_ref.is_none() && binding.match_resources.is_none());

    // The switches.
    let all = BTreeSet::from([
        "DeviceClass/\"gpu.gpumem.io\"".to_string(),
        "ValidatingAdmissionPolicy/\"gpumem-agent-slices\"".to_string(),
        "ValidatingAdmissionPolicyBinding/\"gpumem-agent-slices\"".to_string(),
    ]);
    assert_eq!(dra_objects(&docs), all);
    // Off by default: a cluster before 1.34 knows neither kind, and the install would fail.
    assert!(dra_objects(&objects(&json!({}))).is_empty());
    for (device_classes, node_restriction) in [(false, true), (true, false), (false, false)] {
        let docs =
            objects(&json!({"dra": {"deviceClasses": device_classes, "nodeRestriction": node_restriction}}));
        let want: BTreeSet<String> = all
            .iter()
            .filter(|n| {
                if n.starts_with("DeviceClass/") {
                    device_classes
                } else {
                    node_restriction
                }
            })
            .cloned()
            .collect();
        assert_eq!(dra_objects(&docs), want, "{device_classes} {node_restriction}");
        assert!(
            find(&docs, "ClusterRole", "gpumem-agent-dra").is_some(),
            "the agent's DRA rules stay: a node's label may switch it"
        );
    }
}

#[test]
fn the_agent_accepts_the_daemonsets_flags() {
    for values in [json!({}), custom_values()] {
        let docs = objects(&values);
        let ds: DaemonSet = get(&docs, "DaemonSet", "gpumem-agent");
        let args = container(pod_spec(&ds), "agent").args.clone().unwrap();
        assert_eq!(args[0], "agent");
        let mut argv = vec!["gpumem-agent".to_string()];
        argv.extend(args[1..].iter().cloned());
        let cmd = AgentArgs::augment_args(clap::Command::new("gpumem-agent"));
        let matches = cmd
            .try_get_matches_from(&argv)
            .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        let parsed = AgentArgs::from_arg_matches(&matches).unwrap();
        let metrics_port = values["agent"]["metrics"]["port"].as_u64().unwrap_or(9400);
        assert_eq!(
            parsed.metrics_listen.map(|a| u64::from(a.port())),
            Some(metrics_port)
        );
        assert_eq!(
            parsed.config.as_deref(),
            Some(Path::new("/etc/gpumem/agent.yaml"))
        );
    }
}

#[test]
fn the_agent_runs_with_least_privilege_in_runtime_mode() {
    let docs = objects(&json!({}));
    let ds: DaemonSet = get(&docs, "DaemonSet", "gpumem-agent");
    let spec = pod_spec(&ds);
    assert_eq!(spec.priority_class_name.as_deref(), Some("system-node-critical"));
    assert_eq!(spec.runtime_class_name.as_deref(), Some("nvidia"));
    assert!(!spec.node_selector.as_ref().unwrap().is_empty(), "GPU nodes only");
    let tolerations = spec.tolerations.as_ref().unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t.key.as_deref() == Some("nvidia.com/gpu") && t.operator.as_deref() == Some("Exists"))
    );
    assert!(!spec.host_network.unwrap_or(false) && !spec.host_pid.unwrap_or(false));
    let agent = container(spec, "agent");
    let sc = agent.security_context.as_ref().unwrap();
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let caps = sc.capabilities.as_ref().unwrap();
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    assert_eq!(
        caps.add, None,
        "NVML through the NVIDIA runtime needs no capability"
    );
    let env = agent.env.as_ref().unwrap();
    let value = |name: &str| env.iter().find(|e| e.name == name).and_then(|e| e.value.clone());
    assert_eq!(value("NVIDIA_VISIBLE_DEVICES").as_deref(), Some("all"));
    assert_eq!(value("NVIDIA_DRIVER_CAPABILITIES").as_deref(), Some("utility"));
    let node = env.iter().find(|e| e.name == "NODE_NAME").unwrap();
    let field = node.value_from.as_ref().unwrap().field_ref.as_ref().unwrap();
    assert_eq!(field.field_path, "spec.nodeName");
    for v in spec.volumes.iter().flatten() {
        if let Some(hp) = &v.host_path {
            assert!(
                hp.path.starts_with("/var/lib/") || hp.path == "/var/run/cdi",
                "only the kubelet's, gpumem's and CDI's directories: {}",
                hp.path
            );
        }
    }
    let init = &spec.init_containers.as_ref().unwrap()[0];
    let isc = init.security_context.as_ref().unwrap();
    assert_eq!(isc.read_only_root_filesystem, Some(true));
    assert_eq!(
        isc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_string()][..])
    );
}

// ---- the checks themselves can fail -------------------------------------------------------------

fn scratch_chart(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("templates")).unwrap();
    std::fs::copy(chart_dir().join("Chart.yaml"), dir.path().join("Chart.yaml")).unwrap();
    std::fs::copy(chart_dir().join("values.yaml"), dir.path().join("values.yaml")).unwrap();
    std::fs::write(dir.path().join("templates/t.yaml"), template).unwrap();
    dir
}

#[test]
fn the_renderer_refuses_what_helm_would_render_wrong() {
    // A value path that does not exist.
    let dir = scratch_chart("name: {{ .Values.agent.nosuchkey }}\n");
    let err = render_chart_at(dir.path(), &json!({})).err().unwrap();
    assert!(err.contains("<no value>"), "{err}");
    // A function outside the subset.
    let dir = scratch_chart("name: {{ include \"x\" . }}\n");
    assert!(render_chart_at(dir.path(), &json!({})).is_err());
    // A large number printed without `int` comes out as Helm prints it, and is no longer a number.
    let dir = scratch_chart("value: {{ .Values.priorityClasses.online.value }}\n");
    let out = render_chart_at(
        dir.path(),
        &json!({"priorityClasses": {"online": {"value": 2000000}}}),
    )
    .unwrap();
    assert_eq!(out[0].text, "value: 2e+06\n");
    let dir = scratch_chart("value: {{ int .Values.priorityClasses.online.value }}\n");
    let out = render_chart_at(
        dir.path(),
        &json!({"priorityClasses": {"online": {"value": 2000000}}}),
    )
    .unwrap();
    assert_eq!(out[0].text, "value: 2000000\n");
    // toYaml / nindent as Helm's.
    let dir = scratch_chart("a:\n  {{- toYaml .Values.agent.resources | nindent 2 }}\n");
    let out = render_chart_at(dir.path(), &json!({})).unwrap();
    assert_eq!(yaml_docs(&out[0].text, "t")[0]["a"]["requests"]["cpu"], "50m");
    // `.Capabilities.APIVersions.Has`, also inside `range`; the renderer's stand-in for it is not Helm's.
    let dir = scratch_chart(
        "a: {{ .Capabilities.APIVersions.Has \"x/v1/K\" }}\n\
         {{- range .Values.imagePullSecrets }} b: {{ .Capabilities.APIVersions.Has \"x/v1/K\" }}{{ end }}\n",
    );
    let out = render_chart_at_with_apis(dir.path(), &json!({"imagePullSecrets": [1]}), &["x/v1/K"]).unwrap();
    assert_eq!(out[0].text, "a: true b: true\n");
    let out = render_chart_at_with_apis(dir.path(), &json!({"imagePullSecrets": [1]}), &["x/v1"]).unwrap();
    assert_eq!(out[0].text, "a: false b: false\n");
    let dir = scratch_chart("a: {{ renderer_api_versions_has $.Capabilities.APIVersions \"x/v1/K\" }}\n");
    assert!(render_chart_at(dir.path(), &json!({})).is_err());
}

#[test]
fn typed_parsing_catches_misspelt_fields() {
    let ok = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
        "spec": {"replicas": 1, "selector": {}, "template": {"spec": {"containers": [{"name": "c"}]}}}});
    check_typed(&ok).unwrap();
    let mut typo = ok.clone();
    typo["spec"]["replica"] = json!(1);
    let err = check_typed(&typo).unwrap_err();
    assert!(err.contains(".spec.replica"), "{err}");
    let mut wrong_kind = ok.clone();
    wrong_kind["kind"] = json!("Deploymnet");
    assert!(check_typed(&wrong_kind).is_err());
    let pm = json!({"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "x"},
        "spec": {"selector": {}, "podMetricsEndpoints": [{"port": "m", "path": "/metrics", "interval": "30s", "scheme": "http"}]}});
    assert!(check_typed(&pm).unwrap_err().contains("scheme"));
}

/// The labels on the pods of the Deployment `name`.
fn deployment_pod_labels(docs: &[(String, Json)], name: &str) -> Json {
    let d: Deployment = get(docs, "Deployment", name);
    serde_json::to_value(&d.spec.as_ref().unwrap().template.metadata).unwrap()["labels"].clone()
}

fn selects(selector: &Json, labels: &Json) -> bool {
    selector["matchLabels"]
        .as_object()
        .unwrap()
        .iter()
        .all(|(k, v)| &labels[k] == v)
}

#[test]
fn only_the_scheduler_and_prometheus_reach_the_scorer() {
    // Mode second: the policy selects the scorer's pods and admits the scheduler's pods and the
    // monitoring namespace on the scorer's port, nothing else.
    let docs = objects(&json!({}));
    let policy = find(&docs, "NetworkPolicy", "gpumem-scorer").unwrap();
    let spec = &policy["spec"];
    assert!(selects(
        &spec["podSelector"],
        &deployment_pod_labels(&docs, "gpumem-scorer")
    ));
    assert!(!selects(
        &spec["podSelector"],
        &deployment_pod_labels(&docs, "gpumem-scheduler")
    ));
    assert_eq!(spec["policyTypes"], json!(["Ingress"]));
    // With TLS (the default): the scheduler reaches the verbs' port, Prometheus the plain one.
    let rules = spec["ingress"].as_array().unwrap();
    assert_eq!(rules.len(), 2, "{rules:?}");
    assert_eq!(rules[0]["ports"], json!([{"port": "https", "protocol": "TCP"}]));
    let from = rules[0]["from"].as_array().unwrap();
    assert_eq!(from.len(), 1, "{from:?}");
    assert!(selects(
        &from[0]["podSelector"],
        &deployment_pod_labels(&docs, "gpumem-scheduler")
    ));
    assert!(
        from[0].get("namespaceSelector").is_none(),
        "the scheduler's own namespace only"
    );
    let monitoring =
        json!({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}});
    assert_eq!(rules[1]["ports"], json!([{"port": "http", "protocol": "TCP"}]));
    assert_eq!(rules[1]["from"], json!([monitoring]));

    // Without TLS the verbs share the plain port with /metrics: one rule admits both.
    let plain = objects(&json!({"scorer": {"tls": {"enabled": false}}}));
    let rules = &find(&plain, "NetworkPolicy", "gpumem-scorer").unwrap()["spec"]["ingress"];
    assert_eq!(rules.as_array().unwrap().len(), 1, "{rules:?}");
    assert_eq!(rules[0]["ports"], json!([{"port": "http", "protocol": "TCP"}]));
    assert_eq!(rules[0]["from"].as_array().unwrap().len(), 2);
    assert_eq!(rules[0]["from"][1], monitoring);

    // Mode none (the default scheduler on the control plane's host network): admitted by address, and
    // no policy at all rather than one that would shut the scheduler out.
    let none = objects(&json!({"scheduler": {"mode": "none"}}));
    assert!(find(&none, "NetworkPolicy", "gpumem-scorer").is_none());
    let cidrs = objects(&json!({"scheduler": {"mode": "none"},
        "scorer": {"networkPolicy": {"schedulerCIDRs": ["10.0.0.10/32", "10.0.0.11/32"], "metricsFrom": []}}}));
    let policy = find(&cidrs, "NetworkPolicy", "gpumem-scorer").unwrap();
    assert_eq!(
        policy["spec"]["ingress"][0]["from"],
        json!([{"ipBlock": {"cidr": "10.0.0.10/32"}}, {"ipBlock": {"cidr": "10.0.0.11/32"}}])
    );
    let off = objects(&json!({"scorer": {"networkPolicy": {"enabled": false}}}));
    assert!(find(&off, "NetworkPolicy", "gpumem-scorer").is_none());
}

/// The volume of `container` mounted at the directory holding `file`: its Secret's name.
fn secret_holding(spec: &PodSpec, container: &Container, file: &str) -> String {
    let dir = Path::new(file).parent().unwrap();
    let (volume, _) = mounted_volume(spec, container, |path| Path::new(path) == dir);
    volume.secret.as_ref().unwrap().secret_name.clone().unwrap()
}

#[test]
fn the_scorer_serves_the_verbs_over_tls_from_secrets_that_gpumem_certs_makes() {
    let docs = objects(&json!({}));
    // The rendered configuration is one the scorer accepts, its files in the scorer's Secret.
    let cm: ConfigMap = get(&docs, "ConfigMap", "gpumem-scorer");
    let text = &cm.data.unwrap()["scorer.yaml"];
    let config: gpumem::scorer::config::ScorerConfig = serde_norway::from_str(text).unwrap();
    config.validate().unwrap();
    let tls = config.tls.expect("tls on by default");
    let scorer: Deployment = get(&docs, "Deployment", "gpumem-scorer");
    let spec = scorer.spec.unwrap().template.spec.unwrap();
    let c = &spec.containers[0];
    for file in [&tls.cert_file, &tls.key_file, &tls.client_ca_file] {
        let file = file.to_str().unwrap();
        assert_eq!(secret_holding(&spec, c, file), "gpumem-scorer-tls", "{file}");
    }
    // `gpumem certs` prints the commands that make these Secrets, with these keys.
    let names: Vec<_> = [&tls.cert_file, &tls.key_file, &tls.client_ca_file]
        .iter()
        .map(|f| f.file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["tls.crt", "tls.key", "ca.crt"]);
    let args = c.args.as_ref().unwrap();
    assert!(
        args.contains(&"--tls-listen=0.0.0.0:8443".to_string()),
        "{args:?}"
    );
    let ports: Vec<_> = c
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|p| (p.name.clone().unwrap(), p.container_port))
        .collect();
    assert_eq!(ports, [("http".to_string(), 8080), ("https".to_string(), 8443)]);
    // Probes stay on the plain port, which keeps answering them.
    let probe = c.readiness_probe.as_ref().unwrap().http_get.as_ref().unwrap();
    assert_eq!(
        probe.port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("http".into())
    );
    let service = find(&docs, "Service", "gpumem-scorer").unwrap();
    assert_eq!(
        service["spec"]["ports"][1],
        json!({"name": "https", "port": 8443, "targetPort": "https", "protocol": "TCP"})
    );

    // The second scheduler's client certificate comes from its own Secret.
    let sched_cm: ConfigMap = get(&docs, "ConfigMap", "gpumem-scheduler");
    let sched_config = &yaml_docs(&sched_cm.data.unwrap()["scheduler-config.yaml"], "config")[0];
    let tls_config = &sched_config["extenders"][0]["tlsConfig"];
    let sched: Deployment = get(&docs, "Deployment", "gpumem-scheduler");
    let spec = sched.spec.unwrap().template.spec.unwrap();
    for key in ["certFile", "keyFile", "caFile"] {
        let file = tls_config[key].as_str().unwrap();
        assert_eq!(
            secret_holding(&spec, &spec.containers[0], file),
            "gpumem-scheduler-tls",
            "{key}"
        );
    }

    // Off: plain HTTP everywhere, no Secret needed, a configuration the scorer accepts.
    let plain = objects(&json!({"scorer": {"tls": {"enabled": false}}}));
    let cm: ConfigMap = get(&plain, "ConfigMap", "gpumem-scorer");
    let config: gpumem::scorer::config::ScorerConfig =
        serde_norway::from_str(&cm.data.unwrap()["scorer.yaml"]).unwrap();
    assert_eq!(config.tls, None);
    let scorer: Deployment = get(&plain, "Deployment", "gpumem-scorer");
    let spec = scorer.spec.unwrap().template.spec.unwrap();
    assert!(spec.volumes.unwrap().iter().all(|v| v.secret.is_none()));
    assert!(
        !spec.containers[0]
            .args
            .as_ref()
            .unwrap()
            .iter()
            .any(|a| a.starts_with("--tls-listen"))
    );
}

/// The claim controller's pod spec and its one container.
fn claims_spec(docs: &[(String, Json)]) -> (Deployment, PodSpec, Container) {
    let d: Deployment = get(docs, "Deployment", "gpumem-claims");
    let spec = d.spec.clone().unwrap().template.spec.unwrap();
    assert_eq!(spec.containers.len(), 1);
    let c = container(&spec, "controller").clone();
    (d, spec, c)
}

#[test]
fn the_claim_controller_runs_with_the_agents_mem_unit_and_its_own_lease() {
    for values in [json!({}), custom_values()] {
        let docs = objects(&values);
        let (deployment, spec, c) = claims_spec(&docs);
        let args = c.args.clone().unwrap();
        assert_eq!(args[..2], ["claims".to_string(), "controller".into()], "{args:?}");
        // The flags are ones `gpumem claims controller` accepts, with the chart's values.
        let mut argv = vec!["gpumem-claims-controller".to_string()];
        argv.extend(args[2..].iter().cloned());
        let cmd = ControllerArgs::augment_args(clap::Command::new("gpumem-claims-controller"));
        let matches = cmd
            .clone()
            .try_get_matches_from(&argv)
            .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        let parsed = ControllerArgs::from_arg_matches(&matches).unwrap();
        let unit = values["memUnitMiB"].as_u64().unwrap_or(1);
        assert_eq!(parsed.mem_unit_mib, unit, "the agents' memUnitMiB");
        let agent = agent_config(&docs, tempfile::tempdir().unwrap().path()).0;
        assert_eq!(parsed.mem_unit_mib, agent.mem_unit_mib);
        let port = values["claims"]["port"].as_u64().unwrap_or(8890);
        assert_eq!(u64::from(parsed.listen.port()), port);
        let ports = c.ports.as_ref().unwrap();
        assert_eq!(ports.len(), 1);
        assert_eq!(
            (ports[0].name.as_deref(), i64::from(ports[0].container_port)),
            (Some("http"), port as i64)
        );
        for (probe, path) in [(&c.readiness_probe, "/readyz"), (&c.liveness_probe, "/healthz")] {
            let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
            assert_eq!(get.path.as_deref(), Some(path));
            assert_eq!(serde_json::to_value(&get.port).unwrap(), json!("http"));
        }

        // Every environment variable the flags read comes from the downward API: the pod's name is
        // its identity in the Lease, its namespace the Lease's.
        let read: BTreeSet<String> = cmd
            .get_arguments()
            .filter_map(|a| a.get_env())
            .map(|e| e.to_string_lossy().into_owned())
            .collect();
        let env = c.env.clone().unwrap();
        let given: BTreeSet<String> = env.iter().map(|e| e.name.clone()).collect();
        assert_eq!(given, read);
        for (name, field) in [
            ("POD_NAME", "metadata.name"),
            ("POD_NAMESPACE", "metadata.namespace"),
        ] {
            let e = env.iter().find(|e| e.name == name).unwrap();
            let r = e.value_from.as_ref().unwrap().field_ref.as_ref().unwrap();
            assert_eq!(r.field_path, field, "{name}");
        }
        // The Role grants get/update of the very Lease the controller is told to use, in its
        // namespace.
        let role: Role = get(&docs, "Role", "gpumem-claims-lease");
        assert_eq!(role.metadata.namespace, deployment.metadata.namespace);
        let named: Vec<_> = role
            .rules
            .unwrap()
            .into_iter()
            .filter_map(|r| r.resource_names)
            .collect();
        assert_eq!(named, [vec![parsed.lease_name.clone()]]);
        assert_eq!(spec.service_account_name.as_deref(), Some("gpumem-claims"));

        // The scorer's hardening.
        let pod_sc = spec.security_context.as_ref().unwrap();
        assert_eq!(
            (pod_sc.run_as_non_root, pod_sc.run_as_user),
            (Some(true), Some(65532))
        );
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(
            (sc.allow_privilege_escalation, sc.read_only_root_filesystem),
            (Some(false), Some(true))
        );
        assert_eq!(
            sc.capabilities.as_ref().unwrap().drop.as_deref(),
            Some(&["ALL".to_string()][..])
        );
        assert!(spec.volumes.is_none() && !spec.host_network.unwrap_or(false));
        let scorer: Deployment = get(&docs, "Deployment", "gpumem-scorer");
        assert_eq!(
            c.image,
            scorer.spec.unwrap().template.spec.unwrap().containers[0].image,
            "the one gpumem image"
        );
        let mut resources =
            json!({"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}});
        if let Some(over) = values.get("claims").and_then(|c| c.get("resources")) {
            merge(&mut resources, over);
        }
        assert_eq!(serde_json::to_value(&c.resources).unwrap(), resources);
    }

    // Defaults: one replica, no priority class, anywhere. Custom: the values.
    let (d, spec, _) = claims_spec(&objects(&json!({})));
    assert_eq!(d.spec.unwrap().replicas, Some(1));
    assert_eq!(spec.priority_class_name, None);
    assert!(spec.node_selector.is_none() && spec.tolerations.is_none());
    let (d, spec, c) = claims_spec(&objects(&custom_values()));
    assert_eq!(d.spec.unwrap().replicas, Some(2));
    assert_eq!(spec.priority_class_name.as_deref(), Some("gpumem-online"));
    assert_eq!(spec.node_selector.unwrap()["role"], "infra");
    assert_eq!(spec.tolerations.unwrap()[0].key.as_deref(), Some("infra"));
    assert_eq!(spec.image_pull_secrets.unwrap()[0].name, "regcred");
    assert_eq!(
        c.args.unwrap().last().map(String::as_str),
        Some("--lease-namespace=gpumem-system")
    );
}

#[test]
fn claims_disabled_removes_the_controller_and_keeps_the_crd() {
    let on = kinds_and_names(&objects(&json!({"metrics": {"podMonitor": {"enabled": true}}})));
    let off = kinds_and_names(&objects(
        &json!({"claims": {"enabled": false}, "metrics": {"podMonitor": {"enabled": true}}}),
    ));
    let removed: BTreeSet<_> = on.difference(&off).cloned().collect();
    let expected: BTreeSet<String> = [
        "ServiceAccount/\"gpumem-claims\"",
        "ClusterRole/\"gpumem-claims\"",
        "ClusterRoleBinding/\"gpumem-claims\"",
        "Role/\"gpumem-claims-lease\"",
        "RoleBinding/\"gpumem-claims-lease\"",
        "Deployment/\"gpumem-claims\"",
        "PodMonitor/\"gpumem-claims\"",
        "ClusterRole/\"gpumem-gpuclaims-edit\"",
        "ClusterRole/\"gpumem-gpuclaims-view\"",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(removed, expected);
    assert!(
        off.is_subset(&on),
        "nothing else changes: {:?}",
        off.difference(&on)
    );
    // The CRD is not a template: Helm installs crds/ whatever the values (and never deletes it, so
    // turning the controller off or uninstalling keeps the users' claims).
    assert!(
        on.iter().all(|n| !n.starts_with("CustomResourceDefinition/")),
        "the CRD belongs in crds/, not templates/"
    );
    let crds = files_under(&chart_dir().join("crds"), &[".yaml"]);
    let names: Vec<_> = crds
        .iter()
        .flat_map(|p| yaml_docs(&read(p), "crds"))
        .map(|d| d["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["gpuclaims.gpumem.io"]);
}

// ---- GPU memory counted in shares ---------------------------------------------------------------

/// What templates/gpu-share.yaml renders: the policy and its binding, by template.
fn gpu_share_objects(docs: &[(String, Json)]) -> BTreeSet<String> {
    kinds_and_names(
        &docs
            .iter()
            .filter(|(t, _)| t == "templates/gpu-share.yaml")
            .cloned()
            .collect::<Vec<_>>(),
    )
}

#[test]
fn memory_is_counted_in_shares_where_the_api_server_serves_mutating_admission_policy() {
    let map_v1 = &[MUTATING_ADMISSION_POLICY_V1][..];
    // What `helm template` lists without a cluster (group/versions, no kind), and Kubernetes 1.34 and
    // 1.35 with the beta API turned on: not enough for the v1 policy.
    let older = &[
        "admissionregistration.k8s.io/v1",
        "admissionregistration.k8s.io/v1beta1",
        "admissionregistration.k8s.io/v1beta1/MutatingAdmissionPolicy",
    ][..];
    let none = &[][..];
    let policy = BTreeSet::from([
        "MutatingAdmissionPolicy/\"gpumem-gpu-share\"".to_string(),
        "MutatingAdmissionPolicyBinding/\"gpumem-gpu-share\"".to_string(),
    ]);
    let defaults = kinds_and_names(&objects(&json!({})));
    for (values, apis, shares) in [
        (json!({}), none, false),
        (json!({}), older, false),
        (json!({}), map_v1, true),
        (json!({"agent": {"memCounting": "auto"}}), map_v1, true),
        (json!({"agent": {"memCounting": "units"}}), map_v1, false),
        (json!({"agent": {"memCounting": "shares"}}), none, true),
        (json!({"agent": {"memCounting": "shares"}}), older, true),
    ] {
        let what = format!("{values} with {apis:?}");
        let docs = objects_with_apis(&values, apis);
        let (config, _) = agent_config(&docs, tempfile::tempdir().unwrap().path());
        let want = if shares {
            MemCounting::Shares
        } else {
            MemCounting::Units
        };
        assert_eq!(config.mem_counting, want, "{what}");
        assert_eq!(
            (config.share_resource.as_str(), config.shares_per_gpu),
            ("gpumem.io/gpu-share", 32),
            "{what}"
        );
        // The policy exactly when the agents count in shares, and nothing else changes.
        let rendered = gpu_share_objects(&docs);
        assert_eq!(
            rendered,
            if shares { policy.clone() } else { BTreeSet::new() },
            "{what}"
        );
        let rest: BTreeSet<_> = kinds_and_names(&docs).difference(&rendered).cloned().collect();
        assert_eq!(rest, defaults, "{what}");
    }

    // The names and the slots follow the values, in the agent's config and in the policy alike.
    let values = json!({"resourceNames": {"mem": "example.com/vram", "share": "example.com/slot"},
        "agent": {"memCounting": "shares", "sharesPerGpu": 8}});
    let docs = objects(&values);
    let (config, _) = agent_config(&docs, tempfile::tempdir().unwrap().path());
    assert_eq!(config.mem_counting, MemCounting::Shares);
    assert_eq!(
        (
            config.mem_resource.as_str(),
            config.share_resource.as_str(),
            config.shares_per_gpu
        ),
        ("example.com/vram", "example.com/slot", 8)
    );
    let text =
        serde_json::to_string(find(&docs, "MutatingAdmissionPolicy", "gpumem-gpu-share").unwrap()).unwrap();
    assert!(
        text.contains("example.com/vram") && text.contains("example.com/slot"),
        "{text}"
    );
    assert!(
        !text.contains("nvidia.com/gpu-mem") && !text.contains("gpumem.io/gpu-share"),
        "{text}"
    );
    // A value the agent does not know reaches it, which refuses it rather than counting in units.
    let docs = objects_with_apis(&json!({"agent": {"memCounting": "share"}}), map_v1);
    let cm: ConfigMap = get(&docs, "ConfigMap", "gpumem-agent");
    assert!(cm.data.unwrap()["agent.yaml"].contains("memCounting: share\n"));
    assert!(gpu_share_objects(&docs).is_empty());
}

/// The policy with default values and the agents counting in shares.
fn gpu_share_policy() -> MutatingAdmissionPolicySpec {
    let docs = objects(&json!({"agent": {"memCounting": "shares"}}));
    let policy: MutatingAdmissionPolicy = get(&docs, "MutatingAdmissionPolicy", "gpumem-gpu-share");
    policy.spec.unwrap()
}

#[test]
fn the_gpu_share_policy_adds_a_share_to_every_container_asking_memory() {
    let docs = objects(&json!({"agent": {"memCounting": "shares"}}));
    let spec = gpu_share_policy();
    // Fail: a container admitted without its share would run without the agent's Allocate.
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    assert_eq!(spec.reinvocation_policy.as_deref(), Some("IfNeeded"));
    assert!(spec.param_kind.is_none() && spec.variables.is_none());
    let rules = spec.match_constraints.unwrap().resource_rules.unwrap_or_default();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].api_groups.as_deref(), Some(&[String::new()][..]));
    assert_eq!(rules[0].api_versions.as_deref(), Some(&["v1".to_string()][..]));
    assert_eq!(rules[0].resources.as_deref(), Some(&["pods".to_string()][..]));
    assert_eq!(rules[0].operations.as_deref(), Some(&["CREATE".to_string()][..]));
    let binding: MutatingAdmissionPolicyBinding =
        get(&docs, "MutatingAdmissionPolicyBinding", "gpumem-gpu-share");
    let binding = binding.spec.unwrap();
    assert_eq!(binding.policy_name.as_deref(), Some("gpumem-gpu-share"));
    assert!(binding.param_ref.is_none() && binding.match_resources.is_none());

    // Only pods with a container or an init container asking memory, in its limits or requests.
    let conditions = spec.match_conditions.unwrap_or_default();
    assert_eq!(conditions.len(), 1);
    let condition = &conditions[0].expression;
    for part in [
        "object.spec.containers",
        "object.spec.?initContainers",
        "'nvidia.com/gpu-mem' in c.?resources.?limits",
        "'nvidia.com/gpu-mem' in c.?resources.?requests",
    ] {
        assert!(condition.contains(part), "{part}: {condition}");
    }
    // One JSON patch per list and map: containers' and init containers' limits and requests, each
    // the share's key added to the map, or the map made with it.
    let mutations = spec.mutations.unwrap_or_default();
    let mut covered = BTreeSet::new();
    for m in &mutations {
        assert_eq!(m.patch_type, "JSONPatch");
        assert!(m.apply_configuration.is_none());
        let expr = &m.json_patch.as_ref().unwrap().expression.as_ref().unwrap();
        let list = if expr.starts_with("object.spec.containers.transformList(") {
            "containers"
        } else if expr.starts_with("object.spec.?initContainers.orValue([]).transformList(") {
            "initContainers"
        } else {
            panic!("{expr}")
        };
        let field = if expr.contains("/resources/limits") {
            "limits"
        } else {
            "requests"
        };
        let other = if field == "limits" { "requests" } else { "limits" };
        assert!(!expr.contains(&format!("/resources/{other}")), "{expr}");
        for part in [
            format!("!('gpumem.io/gpu-share' in c.?resources.?{field}.orValue({{}}))"),
            format!("c.?resources.?{field}.hasValue()"),
            format!(
                "'/spec/{list}/' + string(i) + '/resources/{field}/' + jsonpatch.escapeKey('gpumem.io/gpu-share'), value: '1'"
            ),
            format!(
                "'/spec/{list}/' + string(i) + '/resources/{field}', value: {{'gpumem.io/gpu-share': '1'}}"
            ),
        ] {
            assert!(expr.contains(&part), "{part}: {expr}");
        }
        assert!(covered.insert((list, field)), "{list} {field} twice");
    }
    assert_eq!(covered.len(), 4, "{covered:?}");
    // Every expression parses as CEL (optional syntax on, as in the API server).
    let env = admission_env();
    for expr in std::iter::once(condition).chain(
        mutations
            .iter()
            .map(|m| m.json_patch.as_ref().unwrap().expression.as_ref().unwrap()),
    ) {
        env.compile(expr).unwrap_or_else(|e| panic!("{e:?}: {expr}"));
    }
}

// The policy, evaluated. No API server here: its CEL runs on cel-rust (the placer's), with the parts
// of the API server's admission CEL the policy uses: optional syntax, two-variable `transformList`
// (here a fold over the list's [index, element] pairs), `JSONPatch` and `jsonpatch.escapeKey`. The API
// server also type-checks each expression against the Pod's schema; this does not.

fn admission_env() -> cel::Env {
    let mut env = cel::Env::stdlib().with_optional_support(true);
    env.add_macro(cel::parser::Macro::receiver("transformList", 4, transform_list))
        .unwrap();
    env.add_type(JsonPatchType(cel::common::types::Type::new_struct_type(
        "JSONPatch",
    )))
    .unwrap();
    env
}

/// `JSONPatch{op: .., path: .., value: ..}`: made a map of its fields (`value` of any type, which
/// cel-rust's `StructDef` cannot declare). `op` and `path` are strings, no other field is known.
struct JsonPatchType(cel::common::types::Type);

impl cel::StructType for JsonPatchType {
    fn get_type(&self) -> &cel::common::types::Type {
        &self.0
    }

    fn new_value<'b, 'v>(
        &self,
        fields: std::collections::BTreeMap<String, cel::common::value::CowVal<'b, 'v>>,
    ) -> Result<Box<dyn cel::common::value::Val + 'v>, cel::ExecutionError> {
        let mut map = std::collections::HashMap::new();
        for (name, v) in fields {
            let v = cel::Value::try_from(v.as_ref())?;
            let string = matches!(v, cel::Value::String(_));
            if !["op", "path", "value", "from"].contains(&name.as_str()) || (name != "value" && !string) {
                return Err(cel::ExecutionError::function_error(
                    "JSONPatch",
                    format!("field {name}: {v:?}"),
                ));
            }
            map.insert(cel::objects::Key::String(std::sync::Arc::new(name)), v);
        }
        cel::Value::Map(cel::objects::Map {
            map: std::sync::Arc::new(map),
        })
        .try_into()
    }
}

/// `list.transformList(i, v, filter, transform)`: for each element `v` at index `i` for which
/// `filter` holds, `transform` (cel-go's ext.TwoVarComprehensions). Expanded into a comprehension over
/// `@enumerate(list)` whose step binds `i` and `v`, as `cel.bind` does, and appends.
fn transform_list(
    helper: &mut cel::parser::MacroExprHelper<'_>,
    target: &mut Option<cel::common::ast::IdedExpr>,
    args: &mut Vec<cel::common::ast::IdedExpr>,
) -> Result<Option<cel::common::ast::IdedExpr>, cel::parser::ParseError> {
    use cel::common::ast::{CallExpr, ComprehensionExpr, Expr, IdedExpr, ListExpr, LiteralValue, operators};
    let (Some(transform), Some(filter), Some(value), Some(index)) =
        (args.pop(), args.pop(), args.pop(), args.pop())
    else {
        return Err(helper.new_error(0, "transformList takes two names, a filter and a transform"));
    };
    let (Expr::Ident(index), Expr::Ident(value)) = (index.expr, value.expr) else {
        return Err(helper.new_error(0, "transformList's variables are names"));
    };
    let list = target.take().unwrap();
    let call = |helper: &mut cel::parser::MacroExprHelper<'_>, name: &str, args: Vec<IdedExpr>| {
        helper.next_expr(Expr::Call(CallExpr {
            func_name: name.into(),
            target: None,
            args,
        }))
    };
    let ident = |helper: &mut cel::parser::MacroExprHelper<'_>, name: &str| {
        helper.next_expr(Expr::Ident(name.into()))
    };
    let element = |helper: &mut cel::parser::MacroExprHelper<'_>, n: i64| {
        let pair = ident(helper, "@pair");
        let n = helper.next_expr(Expr::Literal(LiteralValue::Int(n.into())));
        call(helper, operators::INDEX, vec![pair, n])
    };
    let bind =
        |helper: &mut cel::parser::MacroExprHelper<'_>, name: String, init: IdedExpr, body: IdedExpr| {
            let empty = helper.next_expr(Expr::List(ListExpr::new(Vec::new())));
            let never = helper.next_expr(Expr::Literal(LiteralValue::Boolean(false.into())));
            let step = ident(helper, &name);
            helper.next_expr(Expr::Comprehension(Box::new(ComprehensionExpr {
                iter_range: empty,
                iter_var: "#unused".into(),
                iter_var2: None,
                accu_var: name,
                accu_init: init,
                loop_cond: never,
                loop_step: step,
                result: body,
            })))
        };
    let accu = "@transformed";
    let listed = helper.next_expr(Expr::List(ListExpr::new(vec![transform])));
    let so_far = ident(helper, accu);
    let appended = call(helper, operators::ADD, vec![so_far, listed]);
    let so_far = ident(helper, accu);
    let step = call(helper, operators::CONDITIONAL, vec![filter, appended, so_far]);
    let v = element(helper, 1);
    let step = bind(helper, value, v, step);
    let i = element(helper, 0);
    let step = bind(helper, index, i, step);
    let range = call(helper, "@enumerate", vec![list]);
    let init = helper.next_expr(Expr::List(ListExpr::new(Vec::new())));
    let always = helper.next_expr(Expr::Literal(LiteralValue::Boolean(true.into())));
    let result = ident(helper, accu);
    Ok(Some(helper.next_expr(Expr::Comprehension(Box::new(
        ComprehensionExpr {
            iter_range: range,
            iter_var: "@pair".into(),
            iter_var2: None,
            accu_var: accu.into(),
            accu_init: init,
            loop_cond: always,
            loop_step: step,
            result,
        },
    )))))
}

fn enumerate(list: cel::Value) -> Result<cel::Value, cel::ExecutionError> {
    let cel::Value::List(items) = list else {
        return Err(cel::ExecutionError::function_error("transformList", "not a list"));
    };
    let pairs = items
        .iter()
        .enumerate()
        .map(|(i, v)| cel::Value::List(std::sync::Arc::new(vec![cel::Value::Int(i as i64), v.clone()])))
        .collect();
    Ok(cel::Value::List(std::sync::Arc::new(pairs)))
}

/// `jsonpatch.escapeKey` (k8s.io/apiserver/pkg/cel/library/jsonpatch.go): RFC 6901's escapes.
fn escape_key(
    cel::extractors::This(_): cel::extractors::This<cel::Value>,
    key: std::sync::Arc<String>,
) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

fn cel_to_json(v: &cel::Value) -> Json {
    match v {
        cel::Value::Null => Json::Null,
        cel::Value::Bool(b) => json!(b),
        cel::Value::Int(i) => json!(i),
        cel::Value::UInt(u) => json!(u),
        cel::Value::String(s) => json!(s.as_str()),
        cel::Value::List(l) => Json::Array(l.iter().map(cel_to_json).collect()),
        cel::Value::Map(m) => Json::Object(
            m.map
                .iter()
                .map(|(k, v)| match k {
                    cel::objects::Key::String(k) => (k.to_string(), cel_to_json(v)),
                    other => panic!("a map key that is not a string: {other:?}"),
                })
                .collect(),
        ),
        cel::Value::Struct(s) => Json::Object(
            s.field_values()
                .iter()
                .map(|(k, v)| (k.clone(), cel_to_json(&cel::Value::try_from(v.as_ref()).unwrap())))
                .collect(),
        ),
        other => panic!("not JSON: {other:?}"),
    }
}

/// Evaluates `expr` with `object` bound to `pod`.
fn evaluate(env: &std::sync::Arc<cel::Env>, expr: &str, pod: &Json) -> cel::Value {
    let program = env.compile(expr).unwrap_or_else(|e| panic!("{e:?}: {expr}"));
    let mut context = cel::Context::with_env(std::sync::Arc::clone(env));
    context.add_variable("object", pod.clone()).unwrap();
    context.add_variable_from_value("jsonpatch", cel::Value::Null);
    context.add_function("@enumerate", enumerate).unwrap();
    context.add_function("escapeKey", escape_key).unwrap();
    program
        .execute(&context)
        .unwrap_or_else(|e| panic!("{e:?}: {expr} on {pod}"))
}

/// JSON Patch `add` (RFC 6902) into an object member, as the API server applies it: the parent must
/// exist.
fn json_patch_add(doc: &mut Json, path: &str, value: Json) {
    let tokens: Vec<String> = path
        .strip_prefix('/')
        .unwrap_or_else(|| panic!("{path}"))
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect();
    let (last, parents) = tokens.split_last().unwrap();
    let mut at = doc;
    for t in parents {
        at = match at {
            Json::Object(o) => o.get_mut(t).unwrap_or_else(|| panic!("{path}: no {t}")),
            Json::Array(a) => a
                .get_mut(t.parse::<usize>().unwrap())
                .unwrap_or_else(|| panic!("{path}: no {t}")),
            other => panic!("{path}: {other} has no {t}"),
        };
    }
    at.as_object_mut()
        .unwrap_or_else(|| panic!("{path}: not an object"))
        .insert(last.clone(), value);
}

/// The pod as the policy leaves it, and whether the policy applied: its match condition, then each
/// mutation in turn on what the previous one made.
fn admit(spec: &MutatingAdmissionPolicySpec, pod: &Json) -> (Json, bool) {
    let env = std::sync::Arc::new(admission_env());
    for c in spec.match_conditions.iter().flatten() {
        if evaluate(&env, &c.expression, pod) != cel::Value::Bool(true) {
            return (pod.clone(), false);
        }
    }
    let mut pod = pod.clone();
    for m in spec.mutations.iter().flatten() {
        let expr = m.json_patch.as_ref().unwrap().expression.as_ref().unwrap();
        let patches = cel_to_json(&evaluate(&env, expr, &pod));
        for p in patches.as_array().unwrap() {
            assert_eq!(p["op"], "add", "{p}");
            json_patch_add(&mut pod, p["path"].as_str().unwrap(), p["value"].clone());
        }
    }
    (pod, true)
}

fn pod(containers: Json, init_containers: Option<Json>) -> Json {
    let mut pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"},
        "spec": {"containers": containers}});
    if let Some(init) = init_containers {
        pod["spec"]["initContainers"] = init;
    }
    check_typed(&pod).unwrap();
    pod
}

#[test]
fn the_gpu_share_policy_evaluated_gives_the_share_only_to_containers_asking_memory() {
    let spec = gpu_share_policy();
    let share = json!({"gpumem.io/gpu-share": "1"});
    // One container asks memory (its requests defaulted from its limits, as the API server does before
    // admission), one nothing, one only CPU; an init container asks memory in its limits alone.
    let asked = pod(
        json!([
            {"name": "sidecar", "image": "x"},
            {"name": "train", "image": "x", "resources": {
                "limits": {"nvidia.com/gpu-mem": "5k"}, "requests": {"nvidia.com/gpu-mem": "5k"}}},
            {"name": "logs", "image": "x", "resources": {"limits": {"cpu": "100m"}}}
        ]),
        Some(json!([
            {"name": "setup", "image": "x"},
            {"name": "warm", "image": "x", "resources": {"limits": {"nvidia.com/gpu-mem": "1000", "cpu": "1"}}}
        ])),
    );
    let (admitted, applied) = admit(&spec, &asked);
    assert!(applied);
    check_typed(&admitted).unwrap();
    let mut want = asked.clone();
    for r in ["limits", "requests"] {
        merge(&mut want["spec"]["containers"][1]["resources"][r], &share);
    }
    merge(
        &mut want["spec"]["initContainers"][1]["resources"]["limits"],
        &share,
    );
    want["spec"]["initContainers"][1]["resources"]["requests"] = share.clone();
    assert_eq!(admitted, want);
    // Admitted again (reinvocation): nothing more.
    assert_eq!(admit(&spec, &admitted), (admitted.clone(), true));

    // Memory asked in the requests only (the API server refuses such an extended resource later): both
    // maps get the share, the limits made for it.
    let requests_only = pod(
        json!([{"name": "a", "image": "x", "resources": {"requests": {"nvidia.com/gpu-mem": "100"}}}]),
        None,
    );
    let (admitted, _) = admit(&spec, &requests_only);
    assert_eq!(admitted["spec"]["containers"][0]["resources"]["limits"], share);
    assert_eq!(
        admitted["spec"]["containers"][0]["resources"]["requests"],
        json!({"nvidia.com/gpu-mem": "100", "gpumem.io/gpu-share": "1"})
    );
    // A share already asked is kept as it is.
    let has_one = pod(
        json!([{"name": "a", "image": "x", "resources": {
            "limits": {"nvidia.com/gpu-mem": "100", "gpumem.io/gpu-share": "1"},
            "requests": {"nvidia.com/gpu-mem": "100", "gpumem.io/gpu-share": "1"}}}]),
        None,
    );
    assert_eq!(admit(&spec, &has_one), (has_one.clone(), true));

    // A pod that asks no GPU memory is not matched at all, whole GPUs included.
    for containers in [
        json!([{"name": "a", "image": "x"}]),
        json!([{"name": "a", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]),
    ] {
        let other = pod(containers, Some(json!([{"name": "i", "image": "x"}])));
        assert_eq!(admit(&spec, &other), (other.clone(), false));
    }
}
