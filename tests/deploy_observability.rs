//! Monitoring: the Grafana dashboard parses and its queries, like the PrometheusRule's expressions,
//! select only metrics gpumem exports; the issue's alerts are all there; the monitors scrape the
//! ports the workloads expose.

mod deploy_support;

use std::collections::BTreeSet;

use serde_json::{Value as Json, json};

use deploy_support::*;

fn check_names(expr: &str, what: &str) -> BTreeSet<String> {
    let series = exported_series();
    let names = promql_metrics(expr).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(!names.is_empty(), "{what}: {expr} selects no metric");
    for name in &names {
        assert!(
            series.contains_key(name),
            "{what}: {name} is not a metric gpumem exports ({expr})"
        );
        if series[name] == "histogram" {
            assert!(
                !METRICS.iter().any(|(m, _)| m == name),
                "{what}: select a histogram by _bucket/_sum/_count: {expr}"
            );
        }
    }
    names
}

/// Every `expr` in a dashboard, with the panel's title.
fn dashboard_queries(dashboard: &Json) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack: Vec<&Json> = dashboard["panels"].as_array().unwrap().iter().collect();
    while let Some(panel) = stack.pop() {
        stack.extend(panel["panels"].as_array().into_iter().flatten());
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push((
                panel["title"].as_str().unwrap().to_string(),
                target["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    out
}

#[test]
fn the_dashboard_queries_only_exported_metrics() {
    let text = read(&chart_dir().join("dashboards/gpumem.json"));
    let dashboard: Json = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert_eq!(dashboard["uid"], "gpumem");
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() >= 15, "{}", queries.len());
    let mut used = BTreeSet::new();
    for (title, expr) in &queries {
        used.extend(check_names(expr, title));
    }
    // Per-node and per-GPU memory allocated vs used, fragmentation, pods per GPU, health, scorer latency.
    for name in [
        "gpumem_gpu_memory_allocated_bytes",
        "gpumem_gpu_memory_used_bytes",
        "gpumem_gpu_memory_total_bytes",
        "gpumem_cluster_fragmentation_ratio",
        "gpumem_node_fragmentation_ratio",
        "gpumem_gpu_pods",
        "gpumem_gpu_healthy",
        "gpumem_scorer_request_duration_seconds_bucket",
    ] {
        assert!(used.contains(name), "the dashboard shows no {name}");
    }
    // The node variable reads a label the PodMonitor sets.
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if var["type"] == "query" {
            let q = var["definition"].as_str().unwrap();
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|q| q.strip_suffix(')'))
                .unwrap();
            let (metric, label) = inner.split_once(',').unwrap();
            check_names(metric.trim(), "variable");
            assert_eq!(label.trim(), "node");
        }
    }
    // Panels have unique ids, and every panel names the templated data source.
    let ids: Vec<_> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), ids.len());
}

fn rules(values: &Json) -> (PrometheusRule, Vec<Json>) {
    let docs: Vec<Json> = rendered_docs(&render_chart(values))
        .into_iter()
        .map(|(_, d)| d)
        .collect();
    let rule = docs
        .iter()
        .find(|d| d["kind"] == "PrometheusRule")
        .expect("a PrometheusRule");
    check_typed(rule).unwrap();
    (parse(rule), docs)
}

#[test]
fn the_alerts_cover_the_issue_and_query_only_exported_metrics() {
    let (rule, _) = rules(&json!({"metrics": {"prometheusRule": {"enabled": true}}}));
    let mut alerts = BTreeSet::new();
    for group in &rule.spec.groups {
        for r in &group.rules {
            check_names(&r.expr, &r.alert);
            assert!(
                ["critical", "warning", "info"].contains(&r.labels["severity"].as_str()),
                "{}",
                r.alert
            );
            assert!(r.annotations.contains_key("summary") && r.annotations.contains_key("description"));
            if let Some(d) = &r.for_ {
                assert!(go_duration_secs(d).is_some(), "{}: for {d}", r.alert);
            }
            assert!(alerts.insert(r.alert.clone()), "{} twice", r.alert);
        }
    }
    let want = [
        ("GpumemGPUUnhealthy", "gpumem_gpu_healthy"),
        ("GpumemXIDStorm", "gpumem_gpu_xid_errors_total"),
        ("GpumemPluginNotRegistered", "gpumem_plugin_registered"),
        (
            "GpumemScorerLatencyHigh",
            "gpumem_scorer_request_duration_seconds_bucket",
        ),
        (
            "GpumemClusterFragmentationHigh",
            "gpumem_cluster_fragmentation_ratio",
        ),
        (
            "GpumemAllocationFailures",
            "gpumem_plugin_allocation_failures_total",
        ),
    ];
    for (alert, metric) in want {
        let r = rule
            .spec
            .groups
            .iter()
            .flat_map(|g| &g.rules)
            .find(|r| r.alert == alert)
            .unwrap_or_else(|| panic!("no {alert}"));
        assert!(
            promql_metrics(&r.expr).unwrap().contains(metric),
            "{alert} does not watch {metric}"
        );
    }
    // docs/operate.md explains every alert.
    let operate = read(&repo().join("docs/operate.md"));
    for alert in &alerts {
        assert!(
            operate.contains(&format!("### {alert}")),
            "docs/operate.md has no section for {alert}"
        );
    }
    // Thresholds come from values; the manifests hold the same rules as the chart's defaults.
    let (custom, _) =
        rules(&json!({"metrics": {"prometheusRule": {"enabled": true, "fragmentationRatio": 0.45}}}));
    let frag = custom
        .spec
        .groups
        .iter()
        .flat_map(|g| &g.rules)
        .find(|r| r.alert == "GpumemClusterFragmentationHigh")
        .unwrap();
    assert!(frag.expr.ends_with("> 0.45"), "{}", frag.expr);
    let file = repo().join("deploy/manifests/components/monitoring/prometheusrule.yaml");
    let manifest: PrometheusRule = parse(&yaml_docs(&read(&file), "prometheusrule.yaml")[0]);
    assert_eq!(manifest.spec, rule.spec);
}

#[test]
fn the_monitors_scrape_the_ports_the_workloads_expose() {
    let (_, docs) = rules(
        &json!({"metrics": {"prometheusRule": {"enabled": true}, "podMonitor": {"enabled": true}, "serviceMonitor": {"enabled": true}}}),
    );
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap()
    };
    let pm: PodMonitor = parse(find("PodMonitor", "gpumem-agent"));
    let ds = find("DaemonSet", "gpumem-agent");
    let pod_labels = &ds["spec"]["template"]["metadata"]["labels"];
    for (k, v) in pm.spec.selector.match_labels.as_ref().unwrap() {
        assert_eq!(
            pod_labels[k],
            v.as_str(),
            "the PodMonitor selects the agent's pods"
        );
    }
    let ports = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap();
    let endpoint = &pm.spec.pod_metrics_endpoints[0];
    assert!(
        ports.iter().any(|p| p["name"] == endpoint.port.as_str()),
        "agent port {}",
        endpoint.port
    );
    assert_eq!(endpoint.path, "/metrics");
    let relabel = &endpoint.relabelings[0];
    assert_eq!(
        (relabel.source_labels[0].as_str(), relabel.target_label.as_str()),
        ("__meta_kubernetes_pod_node_name", "node")
    );

    let sm: ServiceMonitor = parse(find("ServiceMonitor", "gpumem-scorer"));
    let svc = find("Service", "gpumem-scorer");
    for (k, v) in sm.spec.selector.match_labels.as_ref().unwrap() {
        assert_eq!(
            svc["metadata"]["labels"][k],
            v.as_str(),
            "the ServiceMonitor selects the scorer's Service"
        );
    }
    assert_eq!(
        svc["spec"]["ports"][0]["name"],
        sm.spec.endpoints[0].port.as_str()
    );
    assert_eq!(sm.spec.endpoints[0].path, "/metrics");

    // The claim controller: every replica, at the port its probes use too.
    let pm: PodMonitor = parse(find("PodMonitor", "gpumem-claims"));
    let claims = find("Deployment", "gpumem-claims");
    let pod_labels = &claims["spec"]["template"]["metadata"]["labels"];
    let selector = pm.spec.selector.match_labels.as_ref().unwrap();
    for (k, v) in selector {
        assert_eq!(
            pod_labels[k],
            v.as_str(),
            "the PodMonitor selects the controller's pods"
        );
    }
    let agents = &ds["spec"]["template"]["metadata"]["labels"];
    assert!(
        selector.iter().any(|(k, v)| agents[k] != v.as_str()),
        "and not the agents"
    );
    let container = &claims["spec"]["template"]["spec"]["containers"][0];
    let endpoint = &pm.spec.pod_metrics_endpoints[0];
    assert!(
        container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == endpoint.port.as_str()),
        "claims port {}",
        endpoint.port
    );
    assert_eq!(endpoint.path, "/metrics");
    let listen = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|a| a.as_str().unwrap().strip_prefix("--listen="))
        .unwrap();
    assert!(
        listen.ends_with(&format!(":{}", container["ports"][0]["containerPort"])),
        "it serves /metrics on {listen}"
    );
}

#[test]
fn the_metric_name_check_can_fail() {
    assert_eq!(
        promql_metrics(r#"sum by (node, gpu) (increase(gpumem_gpu_xid_errors_total{xid!="13"}[10m])) > 5"#)
            .unwrap(),
        BTreeSet::from(["gpumem_gpu_xid_errors_total".to_string()])
    );
    assert_eq!(
        promql_metrics("histogram_quantile(0.99, sum by (le) (rate(a_bucket[$__rate_interval]))) / on (x) group_left b offset 5m").unwrap(),
        BTreeSet::from(["a_bucket".to_string(), "b".to_string()])
    );
    assert!(std::panic::catch_unwind(|| check_names("gpumem_gpu_memory_free_bytes > 0", "typo")).is_err());
    assert!(
        std::panic::catch_unwind(|| check_names(
            "rate(gpumem_scorer_request_duration_seconds[5m])",
            "histogram"
        ))
        .is_err()
    );
    assert!(std::panic::catch_unwind(|| check_names("DCGM_FI_DEV_FB_USED", "foreign")).is_err());
}

#[test]
fn the_agent_metrics_the_deployment_uses_are_the_ones_the_agent_exports() {
    let used: std::collections::BTreeSet<&str> = METRICS
        .iter()
        .map(|&(name, _)| name)
        .filter(|n| {
            ["gpumem_gpu_", "gpumem_plugin_", "gpumem_accounting_"]
                .iter()
                .any(|p| n.starts_with(p))
        })
        .collect();
    let exported: std::collections::BTreeSet<&str> =
        gpumem::agent::metrics::EXPORTED.iter().copied().collect();
    assert_eq!(used, exported);
}
