//! The API objects: the scale nodes (as the agent and the kubelet would show them), their Leases, the
//! pods, and the played agent's writes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use futures_util::{StreamExt as _, TryStreamExt as _};
use gpumem::node::{self, ROOM_FREED_LABEL, TopologyAnnotation, UsageAnnotation};
use gpumem::plugin::devices::{GPU_RESOURCE, MEM_RESOURCE, units_per_gpu};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceSelector, ResourceClaim, ResourceClaimTemplate, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, MicroTime};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use crate::mix::{self, NodeShape, Select as _, Shape};
use crate::played::{DRA_DRIVER, MEM_UNIT_MIB, NodeModel};
use crate::trace::Size;

/// The taint on the scale nodes, and the label that selects them.
pub const SCALE_KEY: &str = "gpumem.io/scale";
/// Pod labels: the run, and the phase.
pub const RUN_LABEL: &str = "gpumem.io/scale-run";
pub const PHASE_LABEL: &str = "gpumem.io/scale-phase";
/// Nodes that stopped answering: their Leases are not renewed, their status is not posted.
pub type Silenced = Arc<std::sync::Mutex<std::collections::HashSet<String>>>;

pub const LEASE_NAMESPACE: &str = "kube-node-lease";
/// As the kubelet: a Lease of 40 s, renewed every 10 s.
pub const LEASE_SECONDS: i32 = 40;
pub const LEASE_RENEW: Duration = Duration::from_secs(10);
/// The agent's field manager: the played agent owns the same fields the agent would.
pub const AGENT_FIELD_MANAGER: &str = gpumem::agent::apiserver::FIELD_MANAGER;

pub fn node_name(i: usize) -> String {
    format!("scale-node-{i:04}")
}

/// What the kubelet would report as capacity (= allocatable) with the agent's device plugin
/// registered: one `nvidia.com/gpu` device per GPU, one `nvidia.com/gpu-mem` device per memory unit;
/// on the DRA path (`dra`) no GPU resource at all (the GPUs are in the node's ResourceSlice).
pub fn capacity(model: &NodeModel, dra: bool) -> BTreeMap<String, String> {
    let mem_units: u64 = model
        .inventory
        .gpus
        .iter()
        .map(|g| units_per_gpu(g.memory_mib, MEM_UNIT_MIB))
        .sum();
    let mut cap = BTreeMap::from([
        ("cpu".into(), "96".into()),
        ("memory".into(), "768Gi".into()),
        ("pods".into(), "250".into()),
        ("ephemeral-storage".into(), "1Ti".into()),
    ]);
    if !dra {
        cap.insert(GPU_RESOURCE.into(), model.inventory.gpus.len().to_string());
        cap.insert(MEM_RESOURCE.into(), mem_units.to_string());
    }
    cap
}

fn now_micro() -> serde_json::Value {
    serde_json::to_value(MicroTime(k8s_openapi::jiff::Timestamp::now())).unwrap_or(json!(null))
}

fn now_time() -> serde_json::Value {
    serde_json::to_value(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::now(),
    ))
    .unwrap_or(json!(null))
}

/// The node's status as a kubelet posts it: capacity, Ready, and the pressure conditions.
pub fn status_patch(name: &str, model: &NodeModel, dra: bool) -> serde_json::Value {
    let cap = capacity(model, dra);
    let now = now_time();
    let condition = |kind: &str, status: &str, reason: &str| {
        json!({"type": kind, "status": status, "reason": reason, "message": "gpumem-scale API-only node",
               "lastHeartbeatTime": now, "lastTransitionTime": now})
    };
    json!({"status": {
    "capacity": cap, "allocatable": cap,
    "addresses": [{"type": "Hostname", "address": name}],
    "nodeInfo": {"kubeletVersion": "v1.24.1", "kubeProxyVersion": "v1.24.1", "operatingSystem": "linux",
                 "architecture": "amd64", "containerRuntimeVersion": "fake://0", "kernelVersion": "",
                 "osImage": "gpumem-scale", "machineID": "", "systemUUID": "", "bootID": ""},
    "conditions": [
        condition("Ready", "True", "KubeletReady"),
        condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
        condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
        condition("PIDPressure", "False", "KubeletHasSufficientPID"),
    ]}})
}

/// The labels and annotations the agent publishes for `model` with `usage`, plus the room label
/// when room grew.
pub fn agent_metadata(
    model: &NodeModel,
    topology: &TopologyAnnotation,
    usage: &UsageAnnotation,
    room_freed_at: Option<u128>,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let mut labels = node::labels(&model.inventory, MEM_UNIT_MIB);
    if let Some(at) = room_freed_at {
        labels.insert(ROOM_FREED_LABEL.into(), at.to_string());
    }
    (labels, node::annotations(topology, usage))
}

/// Writes the node's labels and annotations as the agent does: server-side apply, its field manager.
pub async fn apply_agent_metadata(
    nodes: &Api<Node>,
    name: &str,
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
) -> kube::Result<()> {
    let patch = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
    });
    nodes
        .patch(
            name,
            &PatchParams::apply(AGENT_FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map(drop)
}

/// The scale node's taints: the scale taint, and what its shape adds (the GPU taint, the reserved one).
pub fn node_taints(shape: NodeShape) -> serde_json::Value {
    let mut taints = vec![json!({"key": SCALE_KEY, "value": "true", "effect": "NoSchedule"})];
    if shape.gpu_taint {
        let (key, value) = mix::GPU_TAINT;
        taints.push(json!({"key": key, "value": value, "effect": "NoSchedule"}));
    }
    if shape.reserved {
        let (key, value) = mix::RESERVED_TAINT;
        taints.push(json!({"key": key, "value": value, "effect": "NoSchedule"}));
    }
    serde_json::Value::Array(taints)
}

/// The scale node as created: the kubelet's labels, the scale label, its profile, its zone (if its
/// shape has one), and its taints.
pub fn node_object(name: &str, model: &NodeModel, shape: NodeShape) -> anyhow::Result<Node> {
    let mut labels = json!({
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
        SCALE_KEY: "true", "gpumem.io/scale-profile": model.profile});
    if let Some(zone) = shape.zone {
        labels[mix::ZONE_LABEL] = zone.into();
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": node_taints(shape)},
    }))
    .context("building the Node object")
}

/// Creates (or takes over) one scale node: the object with its taints, its status (Ready), its Lease,
/// and the agent's labels and annotations (every GPU idle).
pub async fn create_node(
    client: &Client,
    name: &str,
    model: &NodeModel,
    shape: NodeShape,
    dra: bool,
) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let object = node_object(name, model, shape)?;
    match nodes.create(&PostParams::default(), &object).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(e).with_context(|| format!("creating node {name}")),
    }
    nodes
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&status_patch(name, model, dra)),
        )
        .await
        .with_context(|| format!("setting node {name}'s status"))?;
    if dra {
        create_slice(client, name, model).await?;
    }
    // The NodeTaint admission plugin puts node.kubernetes.io/not-ready on every new Node; the node
    // lifecycle controller removes it once the node is Ready, but through kube-controller-manager's
    // client limit (20 qps in 1.24, with other writes: ~5 nodes/s here, minutes for 1000 nodes). A
    // kubelet joins with the node Ready soon after; the tool does what the controller would do.
    let taints = json!({"spec": {"taints": node_taints(shape)}});
    nodes
        .patch(name, &PatchParams::default(), &Patch::Merge(&taints))
        .await
        .with_context(|| format!("removing the not-ready taint of {name}"))?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    let lease: Lease = serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": name, "namespace": LEASE_NAMESPACE},
        "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now_micro()},
    }))
    .context("building the Lease object")?;
    match leases.create(&PostParams::default(), &lease).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => renew_lease(&leases, name).await?,
        Err(e) => return Err(e).with_context(|| format!("creating the Lease of {name}")),
    }
    let topology = TopologyAnnotation::new(&model.inventory, MEM_UNIT_MIB, |_| true);
    let usage = UsageAnnotation::idle(&model.inventory);
    let (labels, annotations) = agent_metadata(model, &topology, &usage, None);
    apply_agent_metadata(&nodes, name, &labels, &annotations)
        .await
        .with_context(|| format!("writing the agent's labels and annotations on {name}"))
}

async fn renew_lease(leases: &Api<Lease>, name: &str) -> anyhow::Result<()> {
    let patch = json!({"spec": {"renewTime": now_micro()}});
    leases
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(drop)
        .with_context(|| format!("renewing the Lease of {name}"))
}

/// Renews every node's Lease each [`LEASE_RENEW`] (the node lifecycle controller counts a renewed
/// Lease as the kubelet's heartbeat), until the process ends. As 1000 kubelets would: each node on
/// its own schedule, spread over the period, every renewal its own request (a round of 1000
/// renewals behind a few connections falls more than the Lease's 40 s behind once the API server is
/// saturated, and the node goes NotReady), and, as a kubelet, one at a time per node: a node whose
/// last renewal is still waiting skips its turn (unbounded, a saturated API server had the tool
/// holding 8825 connections to it, each a renewal waiting, and it never recovered).
/// `client` should be this loop's own (its own connections).
pub async fn renew_leases(
    client: Client,
    names: Arc<Vec<String>>,
    silenced: Silenced,
    failures: Arc<AtomicU64>,
) {
    if names.is_empty() {
        return;
    }
    let leases: Api<Lease> = Api::namespaced(client, LEASE_NAMESPACE);
    let waiting: Arc<Vec<AtomicBool>> = Arc::new(names.iter().map(|_| AtomicBool::new(false)).collect());
    let mut tick = tokio::time::interval(LEASE_RENEW / names.len() as u32);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    for i in (0..names.len()).cycle() {
        tick.tick().await;
        if silenced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&names[i])
            || waiting[i].swap(true, Ordering::AcqRel)
        {
            continue;
        }
        let (leases, name, failures, waiting) = (
            leases.clone(),
            names[i].clone(),
            failures.clone(),
            waiting.clone(),
        );
        tokio::spawn(async move {
            if let Err(err) = renew_lease(&leases, &name).await {
                failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %format!("{err:#}"), "Lease renewal failed");
            }
            waiting[i].store(false, Ordering::Release);
        });
    }
}

/// Plays the kubelet's status sync: a kubelet posts its node's status again when it differs from
/// what it computes, so a node the node lifecycle controller marked NotReady (a late Lease) is Ready
/// again within seconds. Every `period`, each scale node whose Ready condition is not True gets its
/// status posted again (unless it is `silenced`: a lost node's kubelet posts nothing); returns never.
/// `reposted` counts them.
pub async fn repair_status(
    client: Client,
    models: Arc<HashMap<String, Arc<NodeModel>>>,
    dra: bool,
    period: Duration,
    silenced: Silenced,
    reposted: Arc<AtomicU64>,
) {
    let nodes: Api<Node> = Api::all(client);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let list = match nodes
            .list(&ListParams::default().labels(&format!("{SCALE_KEY}=true")))
            .await
        {
            Ok(l) => l,
            Err(err) => {
                tracing::warn!(error = %err, "cannot list the scale nodes");
                continue;
            }
        };
        for node in list.items {
            let Some(name) = node.metadata.name.as_deref() else {
                continue;
            };
            let ready = node
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let lost = silenced.lock().unwrap_or_else(|e| e.into_inner()).contains(name);
            let Some(model) = models.get(name).filter(|_| !ready && !lost) else {
                continue;
            };
            match nodes
                .patch_status(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(&status_patch(name, model, dra)),
                )
                .await
            {
                Ok(_) => {
                    reposted.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(node = name, "node was not Ready: its status is posted again");
                }
                Err(err) => tracing::warn!(node = name, error = %err, "cannot post the node's status"),
            }
        }
    }
}

/// How many scale nodes are Ready and carry no not-ready/unreachable taint.
pub async fn ready_nodes(client: &Client) -> anyhow::Result<usize> {
    let nodes: Api<Node> = Api::all(client.clone());
    let list = nodes
        .list(&ListParams::default().labels(&format!("{SCALE_KEY}=true")))
        .await
        .context("listing the scale nodes")?;
    Ok(list
        .items
        .iter()
        .filter(|n| {
            let ready = n
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let tainted = n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| {
                t.iter().any(|t| {
                    t.key == "node.kubernetes.io/not-ready" || t.key == "node.kubernetes.io/unreachable"
                })
            });
            ready && !tainted
        })
        .count())
}

pub async fn ensure_namespace(client: &Client, name: &str) -> anyhow::Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name}}))
    .context("building the Namespace")?;
    match namespaces.create(&PostParams::default(), &ns).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e).with_context(|| format!("creating namespace {name}")),
    }
}

/// A pod asking for `size`: busybox (it never runs: no kubelet behind the scale nodes), small CPU
/// and memory requests (the trace's would make CPU the limit, which is not what is measured), only
/// on the scale nodes (their label, and their taint tolerated); plus what its `shape` asks: a zone, a
/// GPU model by the node's labels (the device-plugin path; [`claim_pod`] leaves it to the claim), the
/// GPU and reserved taints tolerated.
pub fn pod(name: &str, run: &str, phase: &str, size: Size, shape: Shape) -> anyhow::Result<Pod> {
    let (resource, amount) = size.resource();
    let mut selector = BTreeMap::from([(SCALE_KEY.to_string(), "true".to_string())]);
    if let Some(zone) = shape.zone {
        selector.insert(mix::ZONE_LABEL.into(), zone.into());
    }
    let mut tolerations =
        vec![json!({"key": SCALE_KEY, "operator": "Equal", "value": "true", "effect": "NoSchedule"})];
    if shape.tolerate_gpu {
        tolerations.push(json!({"key": mix::GPU_TAINT.0, "operator": "Exists", "effect": "NoSchedule"}));
    }
    if shape.tolerate_reserved {
        let (key, value) = mix::RESERVED_TAINT;
        tolerations.push(json!({"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"}));
    }
    let mut spec = json!({
        "terminationGracePeriodSeconds": 0,
        "tolerations": tolerations,
        "containers": [{
            "name": "main", "image": "localhost/busybox:harness", "imagePullPolicy": "Never",
            "command": ["sleep", "3600"],
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                          "limits": {resource: amount.to_string()}},
        }],
    });
    if let Some(model) = shape.model {
        let (labels, expressions) = model.node_selection();
        selector.extend(labels);
        if !expressions.is_empty() {
            spec["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                {"nodeSelectorTerms": [{"matchExpressions": expressions}]}}});
        }
    }
    spec["nodeSelector"] = json!(selector);
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {RUN_LABEL: run, PHASE_LABEL: phase,
                     "gpumem.io/scale-kind": size.kind().as_str()}},
        "spec": spec,
    }))
    .context("building the Pod object")
}

/// `pod` without its GPU asks: the same selectors, tolerations, CPU and memory (the ceiling mode).
pub fn without_gpu_asks(mut pod: Pod) -> Pod {
    let containers = pod.spec.iter_mut().flat_map(|s| s.containers.iter_mut());
    for resources in containers.filter_map(|c| c.resources.as_mut()) {
        resources.limits = None;
    }
    pod
}

/// Where a fault-phase pod may run: the scale nodes, and the nodes with a real kubelet (`real`).
fn fault_placement(real: &[String]) -> serde_json::Value {
    let mut terms = vec![json!({"matchExpressions": [
        {"key": SCALE_KEY, "operator": "In", "values": ["true"]}]})];
    if !real.is_empty() {
        terms.push(json!({"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": real}]}));
    }
    json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}})
}

/// A pod of the fault phase: as [`pod`], but it may also land on the `real` nodes, where it really runs,
/// and it may name its scheduler.
pub fn fault_pod(
    name: &str,
    run: &str,
    phase: &str,
    size: Size,
    real: &[String],
    scheduler: Option<&str>,
) -> anyhow::Result<Pod> {
    let mut object =
        serde_json::to_value(pod(name, run, phase, size, Shape::default())?).context("the Pod object")?;
    let spec = &mut object["spec"];
    if let Some(spec) = spec.as_object_mut() {
        spec.remove("nodeSelector");
        spec.insert("affinity".into(), fault_placement(real));
        if let Some(s) = scheduler {
            spec.insert("schedulerName".into(), s.into());
        }
    }
    serde_json::from_value(object).context("building the Pod object")
}

/// The label that marks the fault phase's Deployment pods, holding their size.
pub const OWNED_SIZE_LABEL: &str = "gpumem.io/scale-owned-mib";

/// The fault phase's Deployment: `replicas` pods of `mib` MiB each on the scale nodes that, as a user
/// who wants them back fast would, tolerate an unreachable or not-ready node for only `tolerate_s`
/// seconds (the API server's default is 300).
pub fn deployment(
    name: &str,
    run: &str,
    phase: &str,
    replicas: i32,
    mib: u64,
    tolerate_s: i64,
) -> anyhow::Result<k8s_openapi::api::apps::v1::Deployment> {
    let mut template = serde_json::to_value(pod(name, run, phase, Size::Share { mib }, Shape::default())?)
        .context("the Pod object")?;
    let labels = json!({RUN_LABEL: run, PHASE_LABEL: phase, OWNED_SIZE_LABEL: mib.to_string(), "app": name});
    template["metadata"] = json!({"labels": labels});
    if let Some(tolerations) = template["spec"]["tolerations"].as_array_mut() {
        for key in ["node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"] {
            tolerations.push(json!({"key": key, "operator": "Exists", "effect": "NoExecute",
                                    "tolerationSeconds": tolerate_s}));
        }
    }
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": {RUN_LABEL: run}},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}}, "template": template},
    }))
    .context("building the Deployment")
}

/// The size of a pod the fault phase's Deployment made (`None` for any other pod).
pub fn owned_pod_size(pod: &Pod) -> Option<Size> {
    let mib = pod
        .metadata
        .labels
        .as_ref()?
        .get(OWNED_SIZE_LABEL)?
        .parse()
        .ok()?;
    Some(Size::Share { mib })
}

/// Why a pod failed, if it did: phase Failed (with its reason, e.g. the kubelet's
/// `UnexpectedAdmissionError` when the device plugin refused its Allocate).
pub fn failure(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let reason = status.reason.as_deref().unwrap_or("");
    if status.phase.as_deref() != Some("Failed") && reason != "UnexpectedAdmissionError" {
        return None;
    }
    let message = status.message.as_deref().unwrap_or("");
    Some(format!(
        "{}: {message}",
        if reason.is_empty() { "Failed" } else { reason }
    ))
}

/// The DeviceClass claims name (the chart's `gpu.<driverName>`).
pub const DRA_CLASS: &str = "gpu.gpumem.io";

/// The node's ResourceSlice, as the agent in DRA mode publishes it (its own code renders it).
pub async fn create_slice(client: &Client, name: &str, model: &NodeModel) -> anyhow::Result<()> {
    let healthy = vec![true; model.inventory.gpus.len()];
    let pcie_roots = gpumem::gpu::pcie_roots(&model.inventory, None);
    let spec = gpumem::node::slice::resource_slice_spec(
        &model.inventory,
        &gpumem::node::slice::SliceInputs {
            driver: DRA_DRIVER,
            node: name,
            unit_mib: MEM_UNIT_MIB,
            healthy: &healthy,
            pcie_roots: &pcie_roots,
            generation: 1,
        },
    );
    let slice = ResourceSlice {
        metadata: kube::api::ObjectMeta {
            name: Some(gpumem::node::slice::slice_name(name, DRA_DRIVER)),
            ..Default::default()
        },
        spec,
    };
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    match slices.create(&PostParams::default(), &slice).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e).with_context(|| format!("creating the ResourceSlice of {name}")),
    }
}

/// The ResourceClaimTemplate a pod of `size` names on the DRA path.
pub fn template_name(size: Size) -> String {
    match size {
        Size::Share { mib } => format!("share-{mib}mi"),
        Size::Whole { count } => format!("whole-{count}"),
    }
}

/// The template for `size`: memory of one GPU, or `count` whole GPUs (no capacity request: each
/// device's default, the whole GPU).
pub fn claim_template(size: Size) -> anyhow::Result<ResourceClaimTemplate> {
    let exactly = match size {
        Size::Share { mib } => json!({"deviceClassName": DRA_CLASS,
            "capacity": {"requests": {"memory": format!("{mib}Mi")}}}),
        Size::Whole { count } => json!({"deviceClassName": DRA_CLASS, "count": count}),
    };
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": template_name(size)},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }))
    .context("building a ResourceClaimTemplate")
}

/// The pod's own claim on the DRA path, as its size's template would make it, named after the pod;
/// its shape's model, if any, as the request's CEL selector.
/// The tool creates it itself: from a template, kube-controller-manager makes each claim and records
/// it in the pod's status, within its client limit (20 requests/s by default, which the kit keeps),
/// and that, not the scheduler, would bound every DRA run at about 9 pods/s.
pub fn claim(name: &str, run: &str, phase: &str, size: Size, shape: Shape) -> anyhow::Result<ResourceClaim> {
    let template = claim_template(size)?;
    let mut claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "labels": {RUN_LABEL: run, PHASE_LABEL: phase}},
    }))
    .context("building a ResourceClaim")?;
    claim.spec = template.spec.spec;
    if let Some(model) = shape.model {
        let selector: DeviceSelector = serde_json::from_value(json!({"cel": {"expression": model.cel()}}))
            .context("building a CEL selector")?;
        let requests = claim
            .spec
            .devices
            .iter_mut()
            .flat_map(|d| d.requests.iter_mut().flatten());
        for exactly in requests.filter_map(|r| r.exactly.as_mut()) {
            exactly.selectors.get_or_insert_default().push(selector.clone());
        }
    }
    Ok(claim)
}

/// [`pod`] on the DRA path: the GPU comes from its own claim ([`claim`], same name), which also
/// carries the shape's model.
pub fn claim_pod(name: &str, run: &str, phase: &str, size: Size, shape: Shape) -> anyhow::Result<Pod> {
    let by_claim = Shape { model: None, ..shape };
    let mut pod = pod(name, run, phase, size, by_claim)?;
    let spec = pod.spec.as_mut().context("a pod without spec")?;
    spec.resource_claims = Some(vec![k8s_openapi::api::core::v1::PodResourceClaim {
        name: "gpu".into(),
        resource_claim_name: Some(name.to_string()),
        ..Default::default()
    }]);
    for c in &mut spec.containers {
        let resources = c.resources.get_or_insert_default();
        resources.limits = None;
        resources.claims = Some(vec![k8s_openapi::api::core::v1::ResourceClaim {
            name: "gpu".into(),
            ..Default::default()
        }]);
    }
    Ok(pod)
}

/// GPU memory the allocated claims of `namespace` hold, in MiB: each result's consumed memory, or
/// its device's whole memory without one (`memory_of(node, device index)`).
pub async fn claimed_mib(
    client: &Client,
    namespace: &str,
    memory_of: impl Fn(&str, u32) -> u64,
) -> anyhow::Result<u64> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let mut total = 0u64;
    let mut params = ListParams::default().limit(500);
    loop {
        let page = claims.list(&params).await.context("listing ResourceClaims")?;
        for claim in &page.items {
            let results = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_deref())
                .unwrap_or_default();
            for r in results.iter().filter(|r| r.driver == DRA_DRIVER) {
                let consumed = r
                    .consumed_capacity
                    .as_ref()
                    .and_then(|c| c.get("memory"))
                    .and_then(|q| gpumem::quantity::Quantity::parse(&q.0).ok())
                    .and_then(|q| q.mib_ceil().ok());
                total += match consumed {
                    Some(mib) => mib,
                    None => gpumem::node::slice::device_index(&r.device).map_or(0, |i| memory_of(&r.pool, i)),
                };
            }
        }
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(total),
        }
    }
}

/// Who wrote a claim's allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocator {
    /// gpumem's placer (its field manager).
    Gpumem,
    /// kube-scheduler's own allocator.
    KubeScheduler,
    /// No allocation, or someone else's.
    Neither,
}

/// The placer's field manager (its writes of the claims' status).
pub const PLACER_FIELD_MANAGER: &str = "gpumem-placer";
/// kube-scheduler's field manager (its client's user agent).
pub const SCHEDULER_FIELD_MANAGER: &str = "kube-scheduler";

/// Who allocated a claim, from its `managedFields`: the manager whose entry for the `status`
/// subresource owns `f:status` / `f:allocation` (an update that leaves the allocation as it is does
/// not take it over, so the writer of the allocation keeps it).
pub fn allocated_by(fields: &[ManagedFieldsEntry]) -> Allocator {
    let owns = |manager: &str| {
        fields.iter().any(|f| {
            f.manager.as_deref() == Some(manager)
                && f.subresource.as_deref() == Some("status")
                && f.fields_v1
                    .as_ref()
                    .and_then(|v| v.0.get("f:status"))
                    .is_some_and(|status| status.get("f:allocation").is_some())
        })
    };
    if owns(PLACER_FIELD_MANAGER) {
        Allocator::Gpumem
    } else if owns(SCHEDULER_FIELD_MANAGER) {
        Allocator::KubeScheduler
    } else {
        Allocator::Neither
    }
}

/// Who allocated each claim of `selector` (by name): one paginated LIST of their metadata, which
/// carries `managedFields`.
pub async fn claim_allocators(
    client: &Client,
    namespace: &str,
    selector: &str,
) -> anyhow::Result<HashMap<String, Allocator>> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let mut out = HashMap::new();
    let mut params = ListParams::default().labels(selector).limit(500);
    loop {
        let page = claims
            .list_metadata(&params)
            .await
            .context("listing ResourceClaims")?;
        for claim in page.items {
            if let Some(name) = claim.metadata.name {
                let fields = claim.metadata.managed_fields.unwrap_or_default();
                out.insert(name, allocated_by(&fields));
            }
        }
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(out),
        }
    }
}

/// Deletes the run's claims of `selector`, and waits (up to `timeout`) until none is left: a claim
/// goes once the resource claim controller has taken its deleted pod out of `reservedFor` and
/// cleared its allocation.
pub async fn delete_claims(
    client: &Client,
    namespace: &str,
    selector: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let by_label = ListParams::default().labels(selector);
    claims
        .delete_collection(&kube::api::DeleteParams::default(), &by_label)
        .await
        .context("deleting claims")?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = claims
            .list_metadata(&by_label)
            .await
            .context("listing claims")?
            .items
            .len();
        if left == 0 {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("{left} claims ({selector}) still there after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Lists the pods of one phase still present (after a delete).
pub async fn count_pods(pods: &Api<Pod>, selector: &str) -> anyhow::Result<usize> {
    let list = pods
        .list_metadata(&ListParams::default().labels(selector))
        .await
        .context("listing pods")?;
    Ok(list.items.len())
}

/// Collects every page (for the node count at start). The first request of a run: a kube-apiserver
/// just started may still answer 500 (its etcd client's `unexpected EOF`), so it is tried 5 times.
pub async fn all_node_names(client: &Client) -> anyhow::Result<Vec<String>> {
    let nodes: Api<Node> = Api::all(client.clone());
    let params = ListParams::default().labels(&format!("{SCALE_KEY}=true"));
    let mut attempt = 1;
    let list = loop {
        match nodes.list_metadata(&params).await {
            Ok(list) => break list,
            Err(kube::Error::Api(e)) if e.code >= 500 && attempt < 5 => {
                tracing::warn!(attempt, error = %e, "listing nodes failed; trying again in 1 s");
                attempt += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e).context("listing nodes"),
        }
    };
    Ok(list.items.into_iter().filter_map(|n| n.metadata.name).collect())
}

/// Runs `f` over `items` with at most `limit` in flight; the first error wins.
pub async fn for_each_limited<T, F, Fut>(items: Vec<T>, limit: usize, f: F) -> anyhow::Result<()>
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    futures_util::stream::iter(items.into_iter().map(f))
        .buffer_unordered(limit)
        .try_collect::<Vec<()>>()
        .await
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str) -> NodeModel {
        NodeModel::of_profile(name)
    }

    #[test]
    fn capacity_as_the_device_plugin_reports_it() {
        let m = model("dgx-a100");
        let cap = capacity(&m, false);
        assert_eq!(cap["nvidia.com/gpu"], "8");
        assert_eq!(cap["nvidia.com/gpu-mem"], m.total_mib().to_string());
        assert_eq!(cap["nvidia.com/gpu-mem"], (8 * 81_920).to_string());
        let m = model("mixed");
        assert_eq!(capacity(&m, false)["nvidia.com/gpu"], "4");
        // On the DRA path the GPUs are in the ResourceSlice, not in the node's capacity.
        let dra = capacity(&m, true);
        assert!(!dra.contains_key("nvidia.com/gpu") && !dra.contains_key("nvidia.com/gpu-mem"));
        assert_eq!(dra["cpu"], "96");
    }

    #[test]
    fn dra_pods_ask_through_their_own_claim_made_as_their_sizes_template() {
        let p = claim_pod("p1", "run", "steady", Size::Share { mib: 7537 }, Shape::default()).unwrap();
        let spec = p.spec.unwrap();
        let claims = spec.resource_claims.unwrap();
        assert_eq!(claims[0].resource_claim_name.as_deref(), Some("p1"));
        let c = serde_json::to_value(
            claim("p1", "run", "steady", Size::Share { mib: 7537 }, Shape::default()).unwrap(),
        )
        .unwrap();
        assert_eq!(c["metadata"]["labels"][PHASE_LABEL], "steady");
        assert_eq!(
            c["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"],
            "7537Mi"
        );
        let resources = spec.containers[0].resources.as_ref().unwrap();
        assert_eq!(resources.claims.as_ref().unwrap()[0].name, "gpu");
        assert!(resources.limits.is_none(), "no extended resource on the DRA path");
        let t = serde_json::to_value(claim_template(Size::Share { mib: 7537 }).unwrap()).unwrap();
        let exactly = &t["spec"]["spec"]["devices"]["requests"][0]["exactly"];
        assert_eq!(exactly["capacity"]["requests"]["memory"], "7537Mi");
        assert_eq!(exactly["deviceClassName"], DRA_CLASS);
        let t = serde_json::to_value(claim_template(Size::Whole { count: 2 }).unwrap()).unwrap();
        let exactly = &t["spec"]["spec"]["devices"]["requests"][0]["exactly"];
        assert_eq!(
            (exactly["count"].as_i64(), exactly.get("capacity")),
            (Some(2), None)
        );
    }

    #[test]
    fn fault_pods_may_land_on_the_real_nodes_and_name_their_scheduler() {
        let real = vec!["gpu-node-1".to_string()];
        let p = fault_pod(
            "f1",
            "run",
            "faults",
            Size::Share { mib: 100 },
            &real,
            Some("gpumem-scheduler"),
        )
        .unwrap();
        let spec = p.spec.unwrap();
        assert!(spec.node_selector.is_none());
        assert_eq!(spec.scheduler_name.as_deref(), Some("gpumem-scheduler"));
        let terms = spec
            .affinity
            .unwrap()
            .node_affinity
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .unwrap()
            .node_selector_terms;
        // Terms are ORed: the scale nodes, or the real one by name.
        let keys: Vec<(String, Vec<String>)> = terms
            .iter()
            .map(|t| {
                let e = &t.match_expressions.as_ref().unwrap()[0];
                (e.key.clone(), e.values.clone().unwrap())
            })
            .collect();
        assert_eq!(
            keys,
            [
                (SCALE_KEY.to_string(), vec!["true".to_string()]),
                ("kubernetes.io/hostname".to_string(), real.clone())
            ]
        );
        let d = deployment("d", "run", "faults", 3, 4096, 10).unwrap();
        let template = d.spec.unwrap().template;
        let pod = Pod {
            metadata: template.metadata.unwrap(),
            spec: template.spec.clone(),
            status: None,
        };
        assert_eq!(owned_pod_size(&pod), Some(Size::Share { mib: 4096 }));
        let tolerations = template.spec.unwrap().tolerations.unwrap();
        assert!(
            tolerations
                .iter()
                .any(|t| t.key.as_deref() == Some("node.kubernetes.io/unreachable")
                    && t.toleration_seconds == Some(10))
        );
    }

    #[test]
    fn a_failed_pod_says_why() {
        let mut p = pod("p", "run", "faults", Size::Share { mib: 1 }, Shape::default()).unwrap();
        assert_eq!(failure(&p), None);
        p.status = Some(
            serde_json::from_value(json!({"phase": "Failed", "reason": "UnexpectedAdmissionError",
            "message": "Allocate failed"}))
            .unwrap(),
        );
        assert_eq!(
            failure(&p).as_deref(),
            Some("UnexpectedAdmissionError: Allocate failed")
        );
    }

    #[test]
    fn pods_ask_for_their_size_only_on_scale_nodes() {
        let p = pod("p1", "run", "steady", Size::Share { mib: 7537 }, Shape::default()).unwrap();
        let spec = p.spec.unwrap();
        let limits = spec.containers[0]
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .unwrap();
        assert_eq!(limits["nvidia.com/gpu-mem"].0, "7537");
        assert_eq!(spec.node_selector.unwrap()[SCALE_KEY], "true");
        assert_eq!(spec.tolerations.unwrap()[0].key.as_deref(), Some(SCALE_KEY));
        let p = pod("p2", "run", "burst", Size::Whole { count: 8 }, Shape::default()).unwrap();
        assert_eq!(p.metadata.labels.unwrap()["gpumem.io/scale-kind"], "multi-gpu");
    }

    #[test]
    fn ceiling_pods_keep_everything_but_their_gpu_asks() {
        let shaped = Shape {
            zone: Some("zone-a"),
            model: Some(mix::Model::Large),
            tolerate_gpu: true,
            tolerate_reserved: false,
        };
        let full = pod("p1", "run", "burst", Size::Share { mib: 7537 }, shaped).unwrap();
        let bare = without_gpu_asks(full.clone());
        let (full, bare) = (full.spec.unwrap(), bare.spec.unwrap());
        let resources = bare.containers[0].resources.as_ref().unwrap();
        assert!(resources.limits.is_none(), "no GPU ask");
        assert_eq!(
            resources.requests,
            full.containers[0].resources.as_ref().unwrap().requests
        );
        assert!(resources.requests.as_ref().is_some_and(|r| r.contains_key("cpu")));
        assert_eq!(bare.node_selector, full.node_selector);
        assert!(bare.affinity.is_some(), "the 40Gi+ choice is node affinity");
        assert_eq!(bare.affinity, full.affinity);
        assert_eq!(bare.tolerations, full.tolerations);
        assert!(bare.node_selector.unwrap().contains_key(mix::ZONE_LABEL));
    }

    fn shape(zone: Option<&'static str>, model: Option<mix::Model>, reserved: bool) -> Shape {
        Shape {
            zone,
            model,
            tolerate_gpu: true,
            tolerate_reserved: reserved,
        }
    }

    #[test]
    fn the_trace_mix_adds_nothing_to_pods_claims_and_nodes() {
        let p = serde_json::to_value(
            pod("p", "r", "steady", Size::Share { mib: 100 }, Shape::default()).unwrap(),
        )
        .unwrap();
        assert_eq!(p["spec"]["nodeSelector"], json!({SCALE_KEY: "true"}));
        assert_eq!(
            p["spec"]["tolerations"],
            json!([{"key": SCALE_KEY, "operator": "Equal", "value": "true", "effect": "NoSchedule"}])
        );
        assert!(p["spec"].get("affinity").is_none());
        let c = serde_json::to_value(
            claim("p", "r", "steady", Size::Share { mib: 100 }, Shape::default()).unwrap(),
        )
        .unwrap();
        assert!(
            c["spec"]["devices"]["requests"][0]["exactly"]
                .get("selectors")
                .is_none()
        );
        let n =
            serde_json::to_value(node_object("n", &model("t4x4"), NodeShape::default()).unwrap()).unwrap();
        assert_eq!(
            n["spec"]["taints"],
            json!([{"key": SCALE_KEY, "value": "true", "effect": "NoSchedule"}])
        );
        assert!(n["metadata"]["labels"].get(mix::ZONE_LABEL).is_none());
        assert_eq!(n["metadata"]["labels"]["gpumem.io/scale-profile"], "t4x4");
    }

    #[test]
    fn realistic_nodes_carry_their_zone_and_taints() {
        let reserved = NodeShape {
            zone: Some("zone-b"),
            gpu_taint: true,
            reserved: true,
        };
        let n = serde_json::to_value(node_object("n", &model("dgx-a100"), reserved).unwrap()).unwrap();
        assert_eq!(n["metadata"]["labels"]["topology.kubernetes.io/zone"], "zone-b");
        assert_eq!(
            n["spec"]["taints"],
            json!([
                {"key": SCALE_KEY, "value": "true", "effect": "NoSchedule"},
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                {"key": "gpumem.io/reserved", "value": "training", "effect": "NoSchedule"},
            ])
        );
        let plain = NodeShape {
            reserved: false,
            ..reserved
        };
        assert_eq!(node_taints(plain).as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn realistic_pods_select_their_zone_and_model_and_tolerate_the_taints() {
        let share = Size::Share { mib: 4096 };
        let p = serde_json::to_value(
            pod(
                "p",
                "r",
                "steady",
                share,
                shape(Some("zone-c"), Some(mix::Model::T4), false),
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            p["spec"]["nodeSelector"],
            json!({SCALE_KEY: "true", "topology.kubernetes.io/zone": "zone-c",
                   "nvidia.com/gpu.product": "Tesla-T4"})
        );
        assert_eq!(
            p["spec"]["tolerations"][1],
            json!({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
        );
        assert_eq!(p["spec"]["tolerations"].as_array().map(Vec::len), Some(2));
        assert!(p["spec"].get("affinity").is_none());
        // 40Gi+ by the memory label: a comparison, so node affinity.
        let p = serde_json::to_value(
            pod(
                "p",
                "r",
                "steady",
                share,
                shape(None, Some(mix::Model::Large), false),
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(p["spec"]["nodeSelector"], json!({SCALE_KEY: "true"}));
        assert_eq!(
            p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"],
            json!([{"matchExpressions": [
                {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["40959"]}]}])
        );
        let multi = Size::Whole { count: 2 };
        let p =
            serde_json::to_value(pod("p", "r", "burst", multi, shape(None, None, true)).unwrap()).unwrap();
        assert_eq!(
            p["spec"]["tolerations"][2],
            json!({"key": "gpumem.io/reserved", "operator": "Equal", "value": "training",
                   "effect": "NoSchedule"})
        );
    }

    #[test]
    fn realistic_claims_carry_the_model_as_cel_and_their_pods_do_not() {
        let share = Size::Share { mib: 4096 };
        let s = shape(Some("zone-a"), Some(mix::Model::Large), false);
        let c = serde_json::to_value(claim("p", "r", "steady", share, s).unwrap()).unwrap();
        let exactly = &c["spec"]["devices"]["requests"][0]["exactly"];
        assert_eq!(
            exactly["selectors"],
            json!([{"cel": {"expression":
                r#"device.capacity["gpumem.io"].memory.compareTo(quantity("40Gi")) >= 0"#}}])
        );
        assert_eq!(exactly["capacity"]["requests"]["memory"], "4096Mi");
        let c = serde_json::to_value(
            claim(
                "p",
                "r",
                "steady",
                share,
                shape(None, Some(mix::Model::T4), false),
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            c["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]["expression"],
            r#"device.attributes["gpumem.io"].productName == "Tesla T4""#
        );
        let p = serde_json::to_value(claim_pod("p", "r", "steady", share, s).unwrap()).unwrap();
        assert_eq!(
            p["spec"]["nodeSelector"],
            json!({SCALE_KEY: "true", "topology.kubernetes.io/zone": "zone-a"})
        );
        assert!(p["spec"].get("affinity").is_none(), "the model is the claim's");
        assert_eq!(p["spec"]["tolerations"][1]["key"], "nvidia.com/gpu");
        assert_eq!(p["spec"]["resourceClaims"][0]["resourceClaimName"], "p");
    }

    fn entries(value: serde_json::Value) -> Vec<ManagedFieldsEntry> {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn who_allocated_a_claim_is_read_from_its_managed_fields() {
        // The tool's create, then the placer's status write (allocation and reservation).
        let created = json!({"manager": "gpumem-scale", "operation": "Update", "apiVersion": "resource.k8s.io/v1",
            "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {".": {}}}, "f:spec": {"f:devices": {}}}});
        let placer = entries(json!([created,
            {"manager": "gpumem-placer", "operation": "Update", "apiVersion": "resource.k8s.io/v1",
             "subresource": "status", "fieldsType": "FieldsV1",
             "fieldsV1": {"f:status": {"f:allocation": {".": {}, "f:devices": {}}, "f:reservedFor": {}}}}]));
        assert_eq!(allocated_by(&placer), Allocator::Gpumem);
        // Given back by the placer (its entry keeps only what it still owns), allocated by kube-scheduler.
        let scheduler = entries(json!([created,
            {"manager": "gpumem-placer", "operation": "Update", "subresource": "status",
             "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:devices": {}}}},
            {"manager": "kube-scheduler", "operation": "Update", "subresource": "status",
             "fieldsType": "FieldsV1",
             "fieldsV1": {"f:status": {"f:allocation": {".": {}}, "f:reservedFor": {}}}}]));
        assert_eq!(allocated_by(&scheduler), Allocator::KubeScheduler);
        // Not allocated; or the allocation in an entry that is not the status subresource's.
        assert_eq!(allocated_by(&entries(json!([created]))), Allocator::Neither);
        let odd = entries(json!([
            {"manager": "gpumem-placer", "operation": "Update",
             "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:allocation": {}}}},
            {"manager": "kubectl-edit", "operation": "Update", "subresource": "status",
             "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:allocation": {}}}}]));
        assert_eq!(allocated_by(&odd), Allocator::Neither);
        assert_eq!(allocated_by(&[]), Allocator::Neither);
    }

    #[test]
    fn status_is_ready_with_the_capacity() {
        let m = model("t4x4");
        let s = status_patch("scale-node-0001", &m, false);
        assert_eq!(s["status"]["conditions"][0]["type"], "Ready");
        assert_eq!(s["status"]["conditions"][0]["status"], "True");
        assert_eq!(s["status"]["allocatable"]["nvidia.com/gpu"], "4");
        assert!(s["status"]["conditions"][0]["lastHeartbeatTime"].is_string());
    }
}
