//! What the scorer's caches hold at 1000 nodes and 20,000 bound pods, counted by an allocator that
//! tracks live bytes (so the figure is the same on any machine, unlike RSS). The watches hand over whole
//! objects; the caches keep only what decisions read. The object figures are what a cache of the objects
//! themselves (a kube-rs reflector store, as before) would hold.
//!
//! One test in this binary: the counter is process-wide.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use gpumem::gpu::GpuInventory;
use gpumem::node::{self, TopologyAnnotation, UsageAnnotation};
use gpumem::scorer::cache::NodeCache;
use gpumem::scorer::pods::PodCache;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

const PROFILES: [&str; 4] = ["t4x4", "mixed", "dgx-a100", "hgx-h100"];

/// A node as the API server returns it with what the agent publishes for `profile` (the agent's own
/// code writes the labels and annotations).
fn node(i: usize, profile: &str) -> Node {
    let profile = gpumem_profile::Profile::load(profile).expect("profile");
    let inventory = GpuInventory::discover(&profile).expect("inventory");
    let name = format!("gpu-node-{i:04}");
    let labels = node::labels(&inventory, 1);
    let annotations = node::annotations(
        &TopologyAnnotation::new(&inventory, 1, |_| true),
        &UsageAnnotation::idle(&inventory),
    );
    let gpus = inventory.gpus.len();
    let mib: u64 = inventory.gpus.iter().map(|g| g.memory_mib).sum();
    let node_conditions: Vec<_> = ["Ready", "MemoryPressure", "DiskPressure", "PIDPressure"]
        .map(|t| {
            json!({"type": t, "status": if t == "Ready" { "True" } else { "False" }, "reason": "KubeletReady",
                "message": "kubelet is posting ready status", "lastHeartbeatTime": "2026-12-01T00:00:00Z",
                "lastTransitionTime": "2026-12-01T00:00:00Z"})
        })
        .into();
    let resources = json!({"cpu": "96", "memory": "768Gi", "pods": "250", "ephemeral-storage": "1Ti",
        "nvidia.com/gpu": gpus.to_string(), "nvidia.com/gpu-mem": mib.to_string()});
    serde_json::from_value(json!({
        "metadata": {"name": name, "uid": format!("9b2f{i:08}-0000-4000-8000-000000000000"),
            "resourceVersion": "123456", "creationTimestamp": "2026-12-01T00:00:00Z",
            "labels": labels, "annotations": annotations},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
        "status": {"capacity": resources, "allocatable": resources,
            "conditions": node_conditions,
            "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "v1.24.1", "kubeProxyVersion": "v1.24.1", "operatingSystem": "linux",
                "architecture": "amd64", "containerRuntimeVersion": "containerd://1.6.20",
                "kernelVersion": "6.1.0-13-amd64", "osImage": "Debian GNU/Linux 12 (bookworm)",
                "machineID": "0123456789abcdef0123456789abcdef", "systemUUID": "0123-4567",
                "bootID": "89ab-cdef"}}
    }))
    .expect("node")
}

/// A GPU pod bound by the scorer, as a watch delivers it: the scorer's annotations, the API server's
/// defaults (tolerations, the service-account volume) and managed fields.
fn pod(i: usize, node: &str) -> Pod {
    let name = format!("trainer-{i:05}-7f9c6d5b8-x2kqz");
    let field = |manager: &str| {
        json!({"manager": manager, "operation": "Update", "apiVersion": "v1",
        "time": "2026-12-01T00:00:00Z", "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:annotations":
        {".": {}, "f:gpumem.io/assigned-at": {}, "f:gpumem.io/assigned-gpus": {}}, "f:labels": {".": {},
        "f:app": {}, "f:pod-template-hash": {}}}, "f:spec": {"f:containers": {"k:{\"name\":\"main\"}": {".": {},
        "f:image": {}, "f:name": {}, "f:resources": {".": {}, "f:limits": {".": {}, "f:nvidia.com/gpu-mem": {}},
        "f:requests": {".": {}, "f:cpu": {}, "f:memory": {}, "f:nvidia.com/gpu-mem": {}}}}}}}})
    };
    let pod_conditions: Vec<_> = ["Initialized", "Ready", "ContainersReady", "PodScheduled"]
        .map(|t| json!({"type": t, "status": "True", "lastTransitionTime": "2026-12-01T00:00:00Z"}))
        .into();
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "team-vision", "uid": format!("5c1e{i:08}-0000-4000-8000-000000000000"),
            "resourceVersion": "987654", "creationTimestamp": "2026-12-01T00:00:00Z", "generateName": "trainer-7f9c6d5b8-",
            "labels": {"app": "trainer", "pod-template-hash": "7f9c6d5b8"},
            "annotations": {"gpumem.io/assigned-gpus": "GPU-6f1c2b3a-0000-4000-8000-000000000001",
                "gpumem.io/assigned-at": "2026-12-01T00:00:00Z"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "trainer-7f9c6d5b8",
                "uid": "0d0e0f00-0000-4000-8000-000000000000", "controller": true, "blockOwnerDeletion": true}],
            "managedFields": [field("kube-controller-manager"), field("gpumem-scorer")]},
        "spec": {"nodeName": node, "schedulerName": "default-scheduler", "priority": 0,
            "serviceAccountName": "default", "restartPolicy": "Always", "dnsPolicy": "ClusterFirst",
            "terminationGracePeriodSeconds": 30, "enableServiceLinks": true, "preemptionPolicy": "PreemptLowerPriority",
            "containers": [{"name": "main", "image": "registry.example.com/vision/trainer:2026.11",
                "command": ["python", "-m", "train", "--config", "/etc/train/config.yaml"],
                "resources": {"limits": {"nvidia.com/gpu-mem": "5k"},
                    "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu-mem": "5k"}},
                "volumeMounts": [{"name": "kube-api-access-x2kqz", "readOnly": true,
                    "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent"}],
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}],
            "volumes": [{"name": "kube-api-access-x2kqz", "projected": {"defaultMode": 420, "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1",
                    "fieldPath": "metadata.namespace"}}]}}]}}]},
        "status": {"phase": "Running", "qosClass": "Burstable", "hostIP": "10.0.0.1", "podIP": "10.244.1.17",
            "startTime": "2026-12-01T00:00:00Z",
            "conditions": pod_conditions}
    }))
    .expect("pod")
}

#[test]
fn the_caches_keep_a_fraction_of_the_objects_at_1000_nodes_and_20000_pods() {
    const NODES: usize = 1000;
    const PODS: usize = 20_000;
    let base = live();
    let nodes: Vec<Node> = (0..NODES)
        .map(|i| node(i, PROFILES[i % PROFILES.len()]))
        .collect();
    let node_objects = live() - base;
    let node_cache = NodeCache::from_nodes(nodes);
    let node_cache_bytes = live() - base;
    assert_eq!(node_cache.len(), NODES);

    let base = live();
    let pods: Vec<Pod> = (0..PODS)
        .map(|i| pod(i, &format!("gpu-node-{:04}", i % NODES)))
        .collect();
    let pod_objects = live() - base;
    let pod_cache = PodCache::from_pods(pods);
    let pod_cache_bytes = live() - base;
    assert_eq!(pod_cache.len(), PODS);
    assert_eq!(pod_cache.with_node("gpu-node-0007", <[_]>::len), PODS / NODES);

    let mb = |b: usize| b as f64 / 1e6;
    println!(
        "{NODES} nodes: objects {:.1} MB, node cache {:.1} MB; {PODS} pods: objects {:.1} MB, pod cache {:.1} MB",
        mb(node_objects),
        mb(node_cache_bytes),
        mb(pod_objects),
        mb(pod_cache_bytes)
    );
    // What a pod record keeps is a small part of the object (managed fields, spec and status are not
    // kept); a node's parsed GPU state is smaller than its object too.
    assert!(
        pod_cache_bytes * 4 < pod_objects,
        "pod cache {pod_cache_bytes} B against {pod_objects} B of objects"
    );
    assert!(
        node_cache_bytes < node_objects,
        "node cache {node_cache_bytes} B against {node_objects} B of objects"
    );
    assert!(
        pod_cache_bytes < 20 << 20,
        "pod cache {pod_cache_bytes} B at {PODS} pods"
    );
}
