//! The `GPUClaim` custom resource (`gpumem.io/v1alpha1`): what a user asks of a GPU, and what the
//! claim controller records of the pod it runs for it. The CRD is built from these types
//! (`gpumem claims crd`), so the schema, the printer columns and the code cannot disagree.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::scorer::state::WorkloadClass;

/// The request the claim steps down by, unless its spec says otherwise.
pub const DEFAULT_STEP_MIB: u64 = 1000;
/// How long a pod waits for GPU memory before the claim steps down, unless its spec says otherwise.
pub const DEFAULT_FALLBACK_AFTER: &str = "5m";
/// The floor of a claim that names none: the users' rule steps down only while above 4000 MiB.
pub const DEFAULT_MIN_MIB: u64 = 4000;
/// The largest request a claim may make (1 TiB, as the scorer's cap on one GPU).
pub const MAX_MIB: u64 = 1 << 20;

/// A request for GPU memory that may shrink: the controller runs the pod in `template` with
/// `nvidia.com/gpu-mem` at the claim's current request and, while that pod cannot be scheduled for
/// lack of GPU memory for `fallbackAfter`, lowers the request by `stepMiB`, never below
/// `minGpuMemMiB`.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "gpumem.io",
    version = "v1alpha1",
    kind = "GPUClaim",
    root = "GpuClaim",
    doc = "A GPU memory request that steps down while fragmentation keeps its pod unscheduled.",
    plural = "gpuclaims",
    singular = "gpuclaim",
    shortname = "gpuc",
    namespaced,
    status = "GpuClaimStatus",
    printcolumn = r#"{"name":"MEM","type":"integer","description":"GPU memory requested now, MiB","jsonPath":".status.requestMiB"}"#,
    printcolumn = r#"{"name":"MIN","type":"integer","description":"The smallest request the claim steps down to, MiB","jsonPath":".status.minMiB"}"#,
    printcolumn = r#"{"name":"PHASE","type":"string","description":"Pending, Running, Succeeded, Failed or Invalid","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"NODE","type":"string","description":"Where the claim's pod runs","jsonPath":".status.node"}"#,
    printcolumn = r#"{"name":"PATH","type":"string","description":"How the current pod asks for its GPU memory: devicePlugin or dra","jsonPath":".status.path"}"#,
    printcolumn = r#"{"name":"AGE","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuClaimSpec {
    /// GPU memory to ask for first, in MiB.
    #[schemars(range(min = 1, max = 1_048_576))]
    #[serde(rename = "gpuMemMiB")]
    pub gpu_mem_mib: u64,
    /// The smallest request the claim steps down to, in MiB. Unset: 4000, or gpuMemMiB if that is
    /// smaller (a claim of 4000 MiB or less never steps down).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_048_576))]
    #[serde(rename = "minGpuMemMiB")]
    pub min_gpu_mem_mib: Option<u64>,
    /// How much each step lowers the request, in MiB.
    #[serde(default = "default_step_mib")]
    #[schemars(range(min = 1, max = 1_048_576))]
    #[serde(rename = "stepMiB")]
    pub step_mib: u64,
    /// How long the pod may wait, unschedulable for lack of GPU memory, before the claim steps
    /// down (a Go duration: `90s`, `5m`, `1h30m`).
    #[serde(default = "default_fallback_after")]
    #[schemars(length(min = 2, max = 64))]
    pub fallback_after: String,
    /// Acceptable GPU models (as `kubectl describe node` shows them, e.g. `Tesla T4`); empty: any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_models: Vec<String>,
    /// Whether the scorer's preemption may evict the pod to place a more important one.
    #[serde(default)]
    pub preemptible: bool,
    /// `online` (latency-sensitive) or `offline` (batch), as the scorer reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "workload_class_schema")]
    pub workload_class: Option<WorkloadClass>,
    /// How the pod asks for its GPU memory: `devicePlugin` (an `nvidia.com/gpu-mem` request, for
    /// nodes on the device-plugin path), `dra` (a ResourceClaim of the controller's `--dra-class`
    /// with `capacity.requests.memory`, made from a ResourceClaimTemplate of the same name as the
    /// pod, for nodes on the DRA path) or `auto` (for a cluster with nodes on both: at each request,
    /// the device-plugin path first and, if no node has room there, the DRA path, before the claim
    /// steps down).
    #[serde(default, skip_serializing_if = "ClaimPath::is_default")]
    pub path: ClaimPath,
    /// The pod to run (a PodTemplateSpec: `metadata` and `spec`). Its first container gets the
    /// GPU memory request; the API server checks the pod when the controller creates it.
    #[schemars(schema_with = "pod_template_schema")]
    pub template: serde_json::Value,
}

/// How a claim's pod asks for GPU memory: which of gpumem's two paths serves it.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ClaimPath {
    /// `nvidia.com/gpu-mem` on the first container.
    #[default]
    DevicePlugin,
    /// A ResourceClaim with `capacity.requests.memory`, used by the first container.
    Dra,
    /// Whichever of the two has room: each request is tried on the device-plugin path, then on
    /// the DRA path.
    Auto,
}

impl ClaimPath {
    fn is_default(&self) -> bool {
        *self == ClaimPath::DevicePlugin
    }

    /// The other path of the two a pod can ask through.
    pub fn other(self) -> ClaimPath {
        match self {
            ClaimPath::Dra => ClaimPath::DevicePlugin,
            ClaimPath::DevicePlugin | ClaimPath::Auto => ClaimPath::Dra,
        }
    }

    /// For messages: "the device-plugin path", "the DRA path".
    pub fn describe(self) -> &'static str {
        match self {
            ClaimPath::DevicePlugin => "the device-plugin path",
            ClaimPath::Dra => "the DRA path",
            ClaimPath::Auto => "either path",
        }
    }
}

fn workload_class_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["online", "offline"],
        "description": "`online` (latency-sensitive) or `offline` (batch), as the scorer reads it.",
    })
}

fn pod_path_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["devicePlugin", "dra"],
        "description": "The path the current pod asks through.",
    })
}

fn default_step_mib() -> u64 {
    DEFAULT_STEP_MIB
}

fn default_fallback_after() -> String {
    DEFAULT_FALLBACK_AFTER.to_string()
}

/// An object whose fields the API server keeps as given: the pod's own schema is checked when the
/// pod is created, and inlining it would make the CRD larger than the pod API it copies.
fn pod_template_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "description": "The pod to run: a PodTemplateSpec (metadata and spec).",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// What the controller knows of the claim: everything it needs after a restart.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuClaimStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// GPU memory the current pod asks for, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "requestMiB")]
    pub request_mib: Option<u64>,
    /// The floor the claim steps down to, in MiB (the spec's, or its default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "minMiB")]
    pub min_mib: Option<u64>,
    /// The claim's current pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The node the pod was bound to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The path the current pod asks through: `devicePlugin` or `dra` (with `path: auto`, the one
    /// being tried).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "pod_path_schema")]
    pub path: Option<ClaimPath>,
    /// The GPUs the scorer chose for the pod (its `gpumem.io/assigned-gpus`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<String>,
    /// Every step down, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<Step>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The spec generation this status was written for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Where a claim is in its life.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Phase {
    /// Its pod waits to be scheduled or started.
    Pending,
    /// Its pod runs.
    Running,
    /// Its pod ended with every container successful; the claim creates no other.
    Succeeded,
    /// Its pod failed; the claim creates no other.
    Failed,
    /// The spec cannot be acted on (see the `Valid` condition).
    Invalid,
}

impl Phase {
    pub fn is_final(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }
}

/// One step down of the request.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    #[schemars(schema_with = "time_schema")]
    pub at: Time,
    #[serde(rename = "fromMiB")]
    pub from_mib: u64,
    #[serde(rename = "toMiB")]
    pub to_mib: u64,
    /// Why: what kube-scheduler said of the pod, and for how long.
    pub reason: String,
}

/// A condition as Kubernetes objects carry them (`metav1.Condition`, without observedGeneration).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    #[schemars(schema_with = "time_schema")]
    pub last_transition_time: Time,
    /// One CamelCase word.
    pub reason: String,
    pub message: String,
}

fn time_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": "string", "format": "date-time" })
}

/// The CRD, as YAML (what `gpumem claims crd` prints and the chart ships).
pub fn crd_yaml() -> anyhow::Result<String> {
    use kube::CustomResourceExt as _;
    let crd = GpuClaim::crd();
    Ok(serde_norway::to_string(&crd)?)
}

impl GpuClaim {
    /// `namespace/name`, for logs.
    pub fn key(&self) -> String {
        format!(
            "{}/{}",
            self.metadata.namespace.as_deref().unwrap_or(""),
            self.metadata.name.as_deref().unwrap_or("")
        )
    }
}
