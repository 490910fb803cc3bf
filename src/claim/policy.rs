//! What a claim should do next, decided from its spec, its status and its pods, without I/O: the
//! controller observes, calls [`decide`], and carries out the [`Decision`] in its order (delete the
//! pod it replaces, write the status, create the new pod), so that a restart at any point leaves a
//! status from which the same decision follows.
//!
//! The rule: the pod runs at the claim's current request; while it is unschedulable because of GPU
//! memory (kube-scheduler's message says `nvidia.com/gpu-mem`, or the scorer's `MiB` reasons), and
//! has waited `fallbackAfter` since it was created, and no preemption is making room for it
//! (`nominatedNodeName`), the request steps down by `stepMiB`, never below the minimum. With
//! `path: auto` each request is first asked on the device-plugin path and, as soon as the scheduler
//! finds no node for it there, on the DRA path under the same name; only the DRA pod's wait steps it
//! down, to the device-plugin path again. At the minimum the two paths take turns.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Container, Pod, PodResourceClaim, PodTemplateSpec, ResourceClaim as ContainerClaim, ResourceRequirements,
};
use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, CapacityRequirements, DeviceClaim, DeviceRequest, DeviceSelector, ExactDeviceRequest,
    ResourceClaimSpec, ResourceClaimTemplate, ResourceClaimTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;

use super::resource::{
    ClaimPath, Condition, DEFAULT_MIN_MIB, GpuClaim, GpuClaimStatus, MAX_MIB, Phase, Step, WorkloadClass,
};
use crate::node::ASSIGNED_GPUS_ANNOTATION;
use crate::scorer::state::{
    GPU_MEM_RESOURCE, GPU_MODELS_ANNOTATION, GPU_RESOURCE, PREEMPTIBLE_KEY, WORKLOAD_CLASS_KEY,
};

/// Pod label: the name of the claim that owns the pod.
pub const CLAIM_LABEL: &str = "gpumem.io/claim";
/// Pod label: the request the pod was created with, in MiB.
pub const REQUEST_LABEL: &str = "gpumem.io/claim-request-mib";
/// Condition: whether the spec can be acted on.
pub const VALID: &str = "Valid";
/// Condition: whether the claim's pod is bound to a node.
pub const SCHEDULED: &str = "Scheduled";
/// On the DRA path, the name of the pod's claim (in `spec.resourceClaims` and the first container's
/// `resources.claims`).
pub const POD_CLAIM_NAME: &str = "gpumem";

/// A claim's spec, checked and with its defaults applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub first_mib: u64,
    pub min_mib: u64,
    pub step_mib: u64,
    pub fallback_after: Duration,
    pub models: Vec<String>,
    pub preemptible: bool,
    pub class: Option<WorkloadClass>,
    pub path: ClaimPath,
    pub template: PodTemplateSpec,
}

impl Plan {
    /// The spec, checked: every problem a user can fix, in one message.
    pub fn from_claim(claim: &GpuClaim) -> Result<Plan, String> {
        let spec = &claim.spec;
        let mut problems = Vec::new();
        let in_range = |v: u64| (1..=MAX_MIB).contains(&v);
        if !in_range(spec.gpu_mem_mib) {
            problems.push(format!("gpuMemMiB {} is not in 1..={MAX_MIB}", spec.gpu_mem_mib));
        }
        let min_mib = spec
            .min_gpu_mem_mib
            .unwrap_or(DEFAULT_MIN_MIB.min(spec.gpu_mem_mib));
        if min_mib == 0 || min_mib > spec.gpu_mem_mib {
            problems.push(format!(
                "minGpuMemMiB {min_mib} is not in 1..=gpuMemMiB ({})",
                spec.gpu_mem_mib
            ));
        }
        if !in_range(spec.step_mib) {
            problems.push(format!("stepMiB {} is not in 1..={MAX_MIB}", spec.step_mib));
        }
        let fallback_after = match spec.fallback_after.parse::<kube::core::Duration>() {
            Ok(d) if d.is_negative() => {
                problems.push(format!("fallbackAfter {:?} is negative", spec.fallback_after));
                Duration::ZERO
            }
            Ok(d) => d.into(),
            Err(e) => {
                problems.push(format!(
                    "fallbackAfter {:?} is not a duration such as 90s or 5m: {e}",
                    spec.fallback_after
                ));
                Duration::ZERO
            }
        };
        for model in &spec.gpu_models {
            if model.trim().is_empty() || model.contains(',') {
                problems.push(format!(
                    "gpuModels entry {model:?} must be one model name, without commas"
                ));
            }
        }
        let template = match serde_json::from_value::<PodTemplateSpec>(spec.template.clone()) {
            Ok(t) => check_template(t, spec.path, &mut problems),
            Err(e) => {
                problems.push(format!("template is not a pod template: {e}"));
                PodTemplateSpec::default()
            }
        };
        if let Some(name) = claim.metadata.name.as_deref() {
            // The pods carry the claim's name as a label value: at most 63 characters.
            if name.len() > 63 {
                problems.push(
                    "the claim's name is longer than 63 characters, so its pods cannot be labelled with it"
                        .to_string(),
                );
            }
            let longest = pod_name(name, spec.gpu_mem_mib);
            if let Err(e) = crate::names::check_subdomain(&longest) {
                problems.push(format!("the claim's pod name {longest:?} is not valid: {e}"));
            }
        }
        if !problems.is_empty() {
            return Err(problems.join("; "));
        }
        Ok(Plan {
            first_mib: spec.gpu_mem_mib,
            min_mib,
            step_mib: spec.step_mib,
            fallback_after,
            models: spec.gpu_models.iter().map(|m| m.trim().to_string()).collect(),
            preemptible: spec.preemptible,
            class: spec.workload_class,
            path: spec.path,
            template,
        })
    }

    /// The request to run at: the status's, kept within the spec's bounds (a user may have edited
    /// either).
    pub fn request_mib(&self, status: &GpuClaimStatus) -> u64 {
        status
            .request_mib
            .unwrap_or(self.first_mib)
            .min(self.first_mib)
            .max(self.min_mib)
    }

    /// The path the current pod asks through: the spec's, or with `path: auto` the one the status
    /// records (each request starts on the device-plugin path).
    pub fn pod_path(&self, status: &GpuClaimStatus) -> ClaimPath {
        match (self.path, status.path) {
            (ClaimPath::Auto, Some(p @ (ClaimPath::DevicePlugin | ClaimPath::Dra))) => p,
            _ => self.first_path(),
        }
    }

    /// The path each request is asked on first.
    pub fn first_path(&self) -> ClaimPath {
        match self.path {
            ClaimPath::Auto => ClaimPath::DevicePlugin,
            fixed => fixed,
        }
    }

    /// The request after one step down from `mib`.
    pub fn step_down(&self, mib: u64) -> u64 {
        mib.saturating_sub(self.step_mib).max(self.min_mib)
    }
}

fn check_template(t: PodTemplateSpec, path: ClaimPath, problems: &mut Vec<String>) -> PodTemplateSpec {
    match t.spec.as_ref().map(|s| s.containers.as_slice()) {
        None | Some([]) => problems.push("template.spec has no containers".to_string()),
        Some(containers) => {
            let asks_whole = containers
                .iter()
                .chain(t.spec.iter().flat_map(|s| s.init_containers.iter().flatten()))
                .any(|c| {
                    let r = c.resources.as_ref();
                    let has = |m: Option<&BTreeMap<String, Quantity>>| {
                        m.is_some_and(|m| m.contains_key(GPU_RESOURCE))
                    };
                    has(r.and_then(|r| r.limits.as_ref())) || has(r.and_then(|r| r.requests.as_ref()))
                });
            if asks_whole {
                problems.push(format!(
                    "template asks for {GPU_RESOURCE}: a claim asks for GPU memory only (the claim sets {GPU_MEM_RESOURCE})"
                ));
            }
            let names_ours = t
                .spec
                .iter()
                .flat_map(|s| s.resource_claims.iter().flatten())
                .any(|c| c.name == POD_CLAIM_NAME);
            if path != ClaimPath::DevicePlugin && names_ours {
                problems.push(format!(
                    "template has a resourceClaims entry named {POD_CLAIM_NAME:?}, the name the claim gives its own"
                ));
            }
        }
    }
    t
}

/// The name of the claim's pod at `request_mib`: one name per request, so that a pod being replaced
/// never holds up its successor's name, and a restarted controller finds the pod it created.
pub fn pod_name(claim: &str, request_mib: u64) -> String {
    format!("{claim}-{request_mib}mib")
}

/// A pod of the claim, as the controller lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct PodView {
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    pub request_mib: Option<u64>,
    /// How it asks for GPU memory: through the claim's ResourceClaim (`dra`), or not.
    pub path: ClaimPath,
    pub created: Option<Timestamp>,
    pub terminating: bool,
    /// `Pending`, `Running`, `Succeeded`, `Failed` or `Unknown`.
    pub phase: String,
    pub node: Option<String>,
    pub nominated_node: Option<String>,
    pub gpus: Option<String>,
    /// kube-scheduler's `PodScheduled=False, reason Unschedulable` message, if that is the pod's state.
    pub unschedulable: Option<String>,
}

impl PodView {
    pub fn from_pod(pod: &Pod) -> PodView {
        let meta = &pod.metadata;
        let status = pod.status.as_ref();
        // kube-scheduler's word, or, for a pod gpumem's placer holds gated, the placer's.
        let condition = |type_: &str, reason: &str| {
            status
                .and_then(|s| s.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.type_ == type_))
                .filter(|c| c.status == "False" && c.reason.as_deref() == Some(reason))
                .map(|c| c.message.clone().unwrap_or_default())
        };
        let unschedulable = condition("PodScheduled", "Unschedulable")
            .or_else(|| condition(crate::placer::PLACED_CONDITION, "NoRoom"));
        PodView {
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
            resource_version: meta.resource_version.clone().unwrap_or_default(),
            request_mib: meta
                .labels
                .as_ref()
                .and_then(|l| l.get(REQUEST_LABEL))
                .and_then(|v| v.parse().ok()),
            path: if pod
                .spec
                .iter()
                .flat_map(|s| s.resource_claims.iter().flatten())
                .any(|c| c.name == POD_CLAIM_NAME)
            {
                ClaimPath::Dra
            } else {
                ClaimPath::DevicePlugin
            },
            created: meta.creation_timestamp.as_ref().map(|t| t.0),
            terminating: meta.deletion_timestamp.is_some(),
            phase: status
                .and_then(|s| s.phase.clone())
                .unwrap_or_else(|| "Pending".to_string()),
            node: pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .filter(|n| !n.is_empty()),
            nominated_node: status
                .and_then(|s| s.nominated_node_name.clone())
                .filter(|n| !n.is_empty()),
            gpus: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(ASSIGNED_GPUS_ANNOTATION).cloned()),
            unschedulable,
        }
    }
}

/// Whether kube-scheduler's message says that GPU memory is what the pod lacks somewhere: then a
/// smaller request may fit. (Other reasons, a taint or too little CPU, a smaller request would not
/// cure.) On the DRA path: kube-scheduler's `cannot allocate all claims`, or gpumem's placer's `no
/// room for claim` (in its condition `gpumem.io/Placed` on the gated pods it finds no room for).
pub fn lacks_gpu_memory(message: &str) -> bool {
    message.contains(GPU_MEM_RESOURCE)
        || message.contains(" MiB")
        || message.contains("cannot allocate all claims")
        || message.contains("no room for claim")
}

/// An event on the claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
    /// The pod it concerns: events about different pods stay apart (the Events API folds events of
    /// the same reason and objects into one, keeping the first message).
    pub pod: Option<String>,
}

/// What the controller does, in this order.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Pods to delete first (a pod replaced by a step down, or left from an earlier request), each
    /// only as it was seen (uid and resourceVersion): a pod that changed meanwhile is decided again.
    pub delete: Vec<PodView>,
    /// The status to write.
    pub status: GpuClaimStatus,
    /// The pod to create, at `status.request_mib`, through `status.path`.
    pub create: Option<String>,
    pub notes: Vec<Note>,
    /// When to look again if nothing changes before.
    pub requeue: Option<Duration>,
}

/// Decides for `claim`, whose spec checked to `plan` (or did not), given its pods.
pub fn decide(claim: &GpuClaim, plan: &Result<Plan, String>, pods: &[PodView], now: Timestamp) -> Decision {
    let old = claim.status.clone().unwrap_or_default();
    let mut status = old.clone();
    status.observed_generation = claim.metadata.generation;
    let name = claim.metadata.name.as_deref().unwrap_or_default();
    let mut decision = Decision {
        delete: Vec::new(),
        status: GpuClaimStatus::default(),
        create: None,
        notes: Vec::new(),
        requeue: None,
    };
    let plan = match plan {
        Ok(plan) => plan,
        Err(problems) => {
            if old.phase != Some(Phase::Invalid) || !has_condition(&old, VALID, "False", problems) {
                decision.notes.push(Note {
                    warning: true,
                    reason: "InvalidSpec",
                    message: problems.clone(),
                    pod: None,
                });
            }
            if !old.phase.is_some_and(Phase::is_final) {
                status.phase = Some(Phase::Invalid);
            }
            set_condition(&mut status, VALID, "False", "InvalidSpec", problems, now);
            decision.status = status;
            return decision;
        }
    };
    set_condition(
        &mut status,
        VALID,
        "True",
        "Valid",
        "the spec can be acted on",
        now,
    );
    status.min_mib = Some(plan.min_mib);
    let mut request = plan.request_mib(&old);
    status.request_mib = Some(request);
    let mut path = plan.pod_path(&old);
    status.path = Some(path);
    let current_name = pod_name(name, request);

    // Pods left from an earlier request (a user lowered the spec, or edited the status) go; a
    // pod already being deleted is only waited for.
    let mut current = None;
    for pod in pods.iter().filter(|p| !p.terminating) {
        if pod.name == current_name && pod.request_mib == Some(request) && pod.path == path {
            current = Some(pod);
        } else if !old.phase.is_some_and(Phase::is_final) {
            decision.delete.push(pod.clone());
        }
    }

    if old.phase.is_some_and(Phase::is_final) {
        // The claim ran to its end: it creates nothing more.
        decision.status = status;
        return decision;
    }

    match current {
        None => {
            if pods.iter().any(|p| p.terminating && p.name == current_name) {
                // Its name is still taken: look again shortly.
                awaiting(&mut status, &current_name);
                decision.requeue = Some(Duration::from_secs(2));
            } else {
                create(&mut status, &mut decision, current_name, request, path);
            }
            set_condition(
                &mut status,
                SCHEDULED,
                "False",
                "PodCreated",
                "waiting for kube-scheduler",
                now,
            );
        }
        Some(pod) => {
            status.pod = Some(pod.name.clone());
            status.node = pod.node.clone();
            status.gpus = pod.gpus.clone();
            status.phase = Some(match pod.phase.as_str() {
                "Running" => Phase::Running,
                "Succeeded" => Phase::Succeeded,
                "Failed" => Phase::Failed,
                _ => Phase::Pending,
            });
            if let Some(node) = &pod.node {
                let gpus = pod
                    .gpus
                    .as_deref()
                    .map(|g| format!(", GPUs {g}"))
                    .unwrap_or_default();
                set_condition(
                    &mut status,
                    SCHEDULED,
                    "True",
                    "Bound",
                    &format!("pod {} on node {node}{gpus} with {request} MiB", pod.name),
                    now,
                );
            } else if let Some(message) = &pod.unschedulable {
                let waited = pod
                    .created
                    .map(|c| Duration::try_from(now.duration_since(c)).unwrap_or(Duration::ZERO))
                    .unwrap_or(Duration::ZERO);
                let wait = format!("unschedulable for {}s: {message}", waited.as_secs());
                let auto = plan.path == ClaimPath::Auto;
                if pod.nominated_node.is_some() {
                    // Preemption is making room on that node: give it the time it takes.
                    set_condition(&mut status, SCHEDULED, "False", "Preempting", &wait, now);
                    decision.requeue = Some(plan.fallback_after.max(Duration::from_secs(1)));
                } else if auto && path == ClaimPath::DevicePlugin {
                    // The same request on the other path, at once: it costs the pod nothing.
                    path = ClaimPath::Dra;
                    switch_path(&mut status, &mut decision, pod, request, path, &wait, now);
                } else if !lacks_gpu_memory(message) {
                    set_condition(
                        &mut status,
                        SCHEDULED,
                        "False",
                        "Unschedulable",
                        &format!("{wait} (not for GPU memory: the claim does not step down)"),
                        now,
                    );
                } else if request <= plan.min_mib {
                    let text = format!("at its minimum of {} MiB, {wait}", plan.min_mib);
                    if !has_reason(&old, SCHEDULED, "UnschedulableAtMinimum") {
                        decision.notes.push(Note {
                            warning: true,
                            reason: "AtMinimum",
                            message: text.clone(),
                            pod: Some(pod.name.clone()),
                        });
                    }
                    set_condition(
                        &mut status,
                        SCHEDULED,
                        "False",
                        "UnschedulableAtMinimum",
                        &text,
                        now,
                    );
                    // With both paths, room may come on either: at the minimum the claim goes on
                    // trying them in turn, each for fallbackAfter.
                    if auto {
                        if waited < plan.fallback_after {
                            decision.requeue = Some(plan.fallback_after - waited);
                        } else {
                            path = ClaimPath::DevicePlugin;
                            switch_path(&mut status, &mut decision, pod, request, path, &wait, now);
                        }
                    }
                } else if waited < plan.fallback_after {
                    set_condition(&mut status, SCHEDULED, "False", "Unschedulable", &wait, now);
                    decision.requeue = Some(plan.fallback_after - waited);
                } else {
                    let to = plan.step_down(request);
                    let reason = format!("pod {} {wait}", pod.name);
                    decision.notes.push(Note {
                        warning: false,
                        reason: "SteppedDown",
                        message: format!("{request} -> {to} MiB: {reason}"),
                        pod: Some(pod.name.clone()),
                    });
                    status.steps.push(Step {
                        at: Time(now),
                        from_mib: request,
                        to_mib: to,
                        reason,
                    });
                    decision.delete.push(pod.clone());
                    request = to;
                    status.request_mib = Some(request);
                    // Each request starts again on the device-plugin path.
                    path = plan.first_path();
                    status.path = Some(path);
                    create(&mut status, &mut decision, pod_name(name, request), request, path);
                    set_condition(
                        &mut status,
                        SCHEDULED,
                        "False",
                        "SteppedDown",
                        &format!("stepped down to {request} MiB; waiting for kube-scheduler"),
                        now,
                    );
                }
            } else {
                set_condition(
                    &mut status,
                    SCHEDULED,
                    "False",
                    "Pending",
                    "waiting for kube-scheduler",
                    now,
                );
            }
        }
    }
    decision.status = status;
    decision
}

/// The status of a claim whose pod `name` is yet to be scheduled.
fn awaiting(status: &mut GpuClaimStatus, name: &str) {
    status.phase = Some(Phase::Pending);
    status.pod = Some(name.to_string());
    status.node = None;
    status.gpus = None;
}

/// Creates the claim's pod `name` at `request_mib`, through `path`.
fn create(
    status: &mut GpuClaimStatus,
    decision: &mut Decision,
    name: String,
    request_mib: u64,
    path: ClaimPath,
) {
    awaiting(status, &name);
    status.path = Some(path);
    decision.notes.push(Note {
        warning: false,
        reason: "CreatedPod",
        message: format!(
            "pod {name} asks for {request_mib} MiB of GPU memory on {}",
            path.describe()
        ),
        pod: Some(name.clone()),
    });
    decision.create = Some(name);
}

/// With `path: auto`: replaces `pod`, which `wait`s for room, by the same request through `to`.
fn switch_path(
    status: &mut GpuClaimStatus,
    decision: &mut Decision,
    pod: &PodView,
    request_mib: u64,
    to: ClaimPath,
    wait: &str,
    now: Timestamp,
) {
    decision.notes.push(Note {
        warning: false,
        reason: "SwitchedPath",
        message: format!(
            "{request_mib} MiB on {} instead: pod {} on {} {wait}",
            to.describe(),
            pod.name,
            to.other().describe()
        ),
        pod: Some(pod.name.clone()),
    });
    decision.delete.push(pod.clone());
    // The same name: the new pod is created once the old one is gone (decide waits for a
    // terminating namesake).
    create(status, decision, pod.name.clone(), request_mib, to);
    set_condition(
        status,
        SCHEDULED,
        "False",
        "SwitchedPath",
        &format!(
            "trying {request_mib} MiB on {}; waiting for the scheduler",
            to.describe()
        ),
        now,
    );
}

fn has_condition(status: &GpuClaimStatus, type_: &str, value: &str, message: &str) -> bool {
    status
        .conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == value && c.message == message)
}

fn has_reason(status: &GpuClaimStatus, type_: &str, reason: &str) -> bool {
    status
        .conditions
        .iter()
        .any(|c| c.type_ == type_ && c.reason == reason)
}

/// Sets a condition; its transition time moves only when its status does.
fn set_condition(
    status: &mut GpuClaimStatus,
    type_: &str,
    value: &str,
    reason: &str,
    message: &str,
    now: Timestamp,
) {
    let entry = Condition {
        type_: type_.to_string(),
        status: value.to_string(),
        last_transition_time: Time(now),
        reason: reason.to_string(),
        message: message.to_string(),
    };
    match status.conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            let since = if c.status == value {
                c.last_transition_time.clone()
            } else {
                Time(now)
            };
            *c = Condition {
                last_transition_time: since,
                ..entry
            };
        }
        None => status.conditions.push(entry),
    }
}

/// The pod the claim runs at `request_mib`: the template, with `nvidia.com/gpu-mem` on its first
/// container (in units of `unit_mib`, rounded up), the annotations the scorer reads, the claim's
/// labels and the claim as its controlling owner (the garbage collector deletes it with the claim).
pub fn build_pod(claim: &GpuClaim, plan: &Plan, path: ClaimPath, request_mib: u64, unit_mib: u64) -> Pod {
    let name = claim.metadata.name.clone().unwrap_or_default();
    let template = plan.template.clone();
    let mut meta = template.metadata.unwrap_or_default();
    let labels = meta.labels.get_or_insert_with(BTreeMap::new);
    labels.insert(CLAIM_LABEL.to_string(), name.clone());
    labels.insert(REQUEST_LABEL.to_string(), request_mib.to_string());
    let annotations = meta.annotations.get_or_insert_with(BTreeMap::new);
    if !plan.models.is_empty() {
        annotations.insert(GPU_MODELS_ANNOTATION.to_string(), plan.models.join(", "));
    }
    if plan.preemptible {
        annotations.insert(PREEMPTIBLE_KEY.to_string(), "true".to_string());
    }
    if let Some(class) = plan.class {
        annotations.insert(WORKLOAD_CLASS_KEY.to_string(), class.as_str().to_string());
    }
    let mut spec = template.spec.unwrap_or_default();
    match path {
        // (`Auto` is never a pod's path: `Plan::pod_path` resolves it.)
        ClaimPath::DevicePlugin | ClaimPath::Auto => {
            let units = request_mib.div_ceil(unit_mib.max(1));
            if let Some(first) = spec.containers.first_mut() {
                set_gpu_memory(first, units);
            }
        }
        ClaimPath::Dra => {
            spec.resource_claims
                .get_or_insert_default()
                .push(PodResourceClaim {
                    name: POD_CLAIM_NAME.to_string(),
                    resource_claim_template_name: Some(pod_name(&name, request_mib)),
                    ..PodResourceClaim::default()
                });
            if let Some(first) = spec.containers.first_mut() {
                first
                    .resources
                    .get_or_insert_default()
                    .claims
                    .get_or_insert_default()
                    .push(ContainerClaim {
                        name: POD_CLAIM_NAME.to_string(),
                        ..ContainerClaim::default()
                    });
            }
        }
    }
    Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(&name, request_mib)),
            namespace: claim.metadata.namespace.clone(),
            owner_references: Some(vec![owner(claim)]),
            generate_name: None,
            ..meta
        },
        spec: Some(spec),
        status: None,
    }
}

/// The ResourceClaimTemplate the claim's pod at `request_mib` uses on the DRA path (same name as the
/// pod, the claim its owner): `request_mib` of one GPU of DeviceClass `class` (`gpu.<driver>`), of one
/// of the claim's models when it names some (a CEL selector on the driver's `productName`).
pub fn build_template(claim: &GpuClaim, plan: &Plan, request_mib: u64, class: &str) -> ResourceClaimTemplate {
    let name = claim.metadata.name.clone().unwrap_or_default();
    let driver = class.strip_prefix("gpu.").unwrap_or(class);
    let selectors = (!plan.models.is_empty()).then(|| {
        let models: Vec<String> = plan
            .models
            .iter()
            .map(|m| serde_json::Value::String(m.clone()).to_string())
            .collect();
        vec![DeviceSelector {
            cel: Some(CELDeviceSelector {
                expression: format!(
                    "device.attributes[\"{driver}\"].productName in [{}]",
                    models.join(", ")
                ),
            }),
        }]
    });
    let request = ExactDeviceRequest {
        device_class_name: class.to_string(),
        selectors,
        capacity: Some(CapacityRequirements {
            requests: Some(BTreeMap::from([(
                "memory".to_string(),
                Quantity(format!("{request_mib}Mi")),
            )])),
        }),
        ..ExactDeviceRequest::default()
    };
    ResourceClaimTemplate {
        metadata: ObjectMeta {
            name: Some(pod_name(&name, request_mib)),
            namespace: claim.metadata.namespace.clone(),
            labels: Some(BTreeMap::from([
                (CLAIM_LABEL.to_string(), name.clone()),
                (REQUEST_LABEL.to_string(), request_mib.to_string()),
            ])),
            owner_references: Some(vec![owner(claim)]),
            ..ObjectMeta::default()
        },
        spec: ResourceClaimTemplateSpec {
            metadata: None,
            spec: ResourceClaimSpec {
                devices: Some(DeviceClaim {
                    requests: Some(vec![DeviceRequest {
                        name: "gpu".to_string(),
                        exactly: Some(request),
                        first_available: None,
                    }]),
                    ..DeviceClaim::default()
                }),
            },
        },
    }
}

/// The claim as the controlling owner of what it makes.
fn owner(claim: &GpuClaim) -> OwnerReference {
    OwnerReference {
        api_version: "gpumem.io/v1alpha1".to_string(),
        kind: "GPUClaim".to_string(),
        name: claim.metadata.name.clone().unwrap_or_default(),
        uid: claim.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn set_gpu_memory(container: &mut Container, units: u64) {
    let resources = container
        .resources
        .get_or_insert_with(ResourceRequirements::default);
    for map in [&mut resources.limits, &mut resources.requests] {
        map.get_or_insert_with(BTreeMap::new)
            .insert(GPU_MEM_RESOURCE.to_string(), Quantity(units.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::jiff::SignedDuration;
    use serde_json::json;

    use super::super::resource::GpuClaimSpec;
    use super::*;

    fn claim(spec: serde_json::Value) -> GpuClaim {
        let mut full = json!({
            "apiVersion": "gpumem.io/v1alpha1", "kind": "GPUClaim",
            "metadata": {"name": "train", "namespace": "ml", "uid": "u-1", "generation": 1},
            "spec": {"gpuMemMiB": 20000, "minGpuMemMiB": 8000, "fallbackAfter": "5s",
                     "template": {"spec": {"containers": [{"name": "main", "image": "busybox"}]}}},
        });
        for (k, v) in spec.as_object().expect("an object") {
            full["spec"][k] = v.clone();
        }
        serde_json::from_value(full).expect("a claim")
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::UNIX_EPOCH
            .checked_add(SignedDuration::from_secs(1_000_000 + secs))
            .expect("in range")
    }

    fn pending(name: &str, request: u64, created: i64, message: Option<&str>) -> PodView {
        PodView {
            name: name.into(),
            uid: format!("uid-{name}"),
            resource_version: "7".into(),
            request_mib: Some(request),
            path: ClaimPath::DevicePlugin,
            created: Some(at(created)),
            terminating: false,
            phase: "Pending".into(),
            node: None,
            nominated_node: None,
            gpus: None,
            unschedulable: message.map(str::to_string),
        }
    }

    /// The claim after `decision` was carried out.
    fn applied(mut claim: GpuClaim, decision: &Decision) -> GpuClaim {
        claim.status = Some(decision.status.clone());
        claim
    }

    const NO_ROOM: &str = "0/3 nodes are available: 1 largest free GPU has 15360 MiB, pod needs 20000 MiB, \
                           2 node(s) had untolerated taint {harness.local/fake-node: true}.";

    #[test]
    fn a_new_claim_creates_its_pod_at_the_full_request() {
        let c = claim(json!({}));
        let plan = Plan::from_claim(&c);
        let d = decide(&c, &plan, &[], at(0));
        assert_eq!(d.create.as_deref(), Some("train-20000mib"));
        assert_eq!(d.status.request_mib, Some(20000));
        assert_eq!(d.status.min_mib, Some(8000));
        assert_eq!(d.status.phase, Some(Phase::Pending));
        assert!(d.delete.is_empty());
        let pod = build_pod(
            &c,
            plan.as_ref().expect("valid"),
            ClaimPath::DevicePlugin,
            20000,
            1,
        );
        let limits = pod.spec.as_ref().expect("spec").containers[0]
            .resources
            .as_ref()
            .expect("resources");
        assert_eq!(
            limits.limits.as_ref().expect("limits")[GPU_MEM_RESOURCE],
            Quantity("20000".into())
        );
        assert_eq!(
            limits.requests.as_ref().expect("requests")[GPU_MEM_RESOURCE],
            Quantity("20000".into())
        );
        let owner = &pod.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("GPUClaim", "u-1", Some(true))
        );
        assert_eq!(
            pod.metadata.labels.as_ref().expect("labels")[CLAIM_LABEL],
            "train"
        );
    }

    #[test]
    fn it_steps_down_by_the_step_only_after_fallback_after_and_never_below_the_minimum() {
        let c = claim(json!({"gpuMemMiB": 9500}));
        let plan = Plan::from_claim(&c);
        let c = applied(c.clone(), &decide(&c, &plan, &[], at(0)));
        let pod = pending("train-9500mib", 9500, 0, Some(NO_ROOM));
        // Too early: wait, and look again when the time is up.
        let d = decide(&c, &plan, std::slice::from_ref(&pod), at(3));
        assert_eq!((d.create.as_deref(), d.delete.len()), (None, 0));
        assert_eq!(d.requeue, Some(Duration::from_secs(2)));
        // Time is up: replace the pod one step lower, recorded in the history.
        let d = decide(&c, &plan, std::slice::from_ref(&pod), at(5));
        assert_eq!(d.delete, vec![pod.clone()]);
        assert_eq!(d.create.as_deref(), Some("train-8500mib"));
        assert_eq!(d.status.request_mib, Some(8500));
        assert_eq!(d.status.steps.len(), 1);
        assert_eq!(
            (d.status.steps[0].from_mib, d.status.steps[0].to_mib),
            (9500, 8500)
        );
        assert!(
            d.status.steps[0].reason.contains("pod needs 20000 MiB"),
            "{:?}",
            d.status.steps[0]
        );
        assert!(
            d.notes
                .iter()
                .any(|n| n.reason == "SteppedDown" && n.message.starts_with("9500 -> 8500 MiB"))
        );
        // The next step stops at the minimum, not at 7500.
        let c = applied(c, &d);
        let pod = pending("train-8500mib", 8500, 10, Some(NO_ROOM));
        let d = decide(&c, &plan, std::slice::from_ref(&pod), at(16));
        assert_eq!(d.status.request_mib, Some(8000));
        assert_eq!(d.create.as_deref(), Some("train-8000mib"));
        // At the minimum it stays, and says so (once as an event, always as a condition).
        let c = applied(c, &d);
        let pod = pending("train-8000mib", 8000, 20, Some(NO_ROOM));
        let d = decide(&c, &plan, std::slice::from_ref(&pod), at(600));
        assert_eq!((d.create.as_deref(), d.delete.len()), (None, 0));
        let cond = d
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == SCHEDULED)
            .expect("condition");
        assert_eq!(
            (cond.status.as_str(), cond.reason.as_str()),
            ("False", "UnschedulableAtMinimum")
        );
        assert!(cond.message.contains("minimum of 8000 MiB"), "{}", cond.message);
        assert!(d.notes.iter().any(|n| n.warning && n.reason == "AtMinimum"));
        let c = applied(c, &d);
        let d = decide(&c, &plan, std::slice::from_ref(&pod), at(700));
        assert!(d.notes.is_empty(), "said once: {:?}", d.notes);
        assert_eq!(d.status.steps.len(), 2);
    }

    #[test]
    fn it_does_not_step_down_for_a_reason_a_smaller_request_would_not_cure_or_while_preempting() {
        let c = claim(json!({}));
        let plan = Plan::from_claim(&c);
        let c = applied(c.clone(), &decide(&c, &plan, &[], at(0)));
        let taint = "0/1 nodes are available: 1 node(s) had untolerated taint {dedicated: infra}.";
        let pod = pending("train-20000mib", 20000, 0, Some(taint));
        let d = decide(&c, &plan, std::slice::from_ref(&pod), at(3600));
        assert_eq!((d.create.as_deref(), d.status.request_mib), (None, Some(20000)));
        assert!(
            d.status
                .conditions
                .iter()
                .any(|c| c.message.contains("not for GPU memory"))
        );
        let mut nominated = pending("train-20000mib", 20000, 0, Some(NO_ROOM));
        nominated.nominated_node = Some("n1".into());
        let d = decide(&c, &plan, &[nominated], at(3600));
        assert_eq!((d.create.as_deref(), d.status.request_mib), (None, Some(20000)));
        assert!(d.status.conditions.iter().any(|c| c.reason == "Preempting"));
        // The API server's own resource-fit message counts as GPU memory.
        assert!(lacks_gpu_memory(
            "0/1 nodes are available: 1 Insufficient nvidia.com/gpu-mem."
        ));
    }

    #[test]
    fn a_bound_pod_is_recorded_and_an_ended_claim_creates_nothing_more() {
        let c = claim(json!({}));
        let plan = Plan::from_claim(&c);
        let c = applied(c.clone(), &decide(&c, &plan, &[], at(0)));
        let mut pod = pending("train-20000mib", 20000, 0, None);
        pod.phase = "Running".into();
        pod.node = Some("gpu-node-1".into());
        pod.gpus = Some("GPU-2".into());
        let d = decide(&c, &plan, std::slice::from_ref(&pod), at(1));
        assert_eq!(d.status.phase, Some(Phase::Running));
        assert_eq!(
            (d.status.node.as_deref(), d.status.gpus.as_deref()),
            (Some("gpu-node-1"), Some("GPU-2"))
        );
        let cond = d
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == SCHEDULED)
            .expect("condition");
        assert_eq!((cond.status.as_str(), cond.reason.as_str()), ("True", "Bound"));
        pod.phase = "Succeeded".into();
        let c = applied(c.clone(), &decide(&c, &plan, std::slice::from_ref(&pod), at(2)));
        assert_eq!(c.status.as_ref().and_then(|s| s.phase), Some(Phase::Succeeded));
        // Its pod gone (cleaned up by someone), a finished claim does not start again.
        let d = decide(&c, &plan, &[], at(3));
        assert_eq!(
            (d.create.as_deref(), d.status.phase),
            (None, Some(Phase::Succeeded))
        );
    }

    #[test]
    fn a_restart_between_steps_converges_on_the_status() {
        // Status written at 19000, the old pod already deleted, the new one never created.
        let mut c = claim(json!({}));
        c.status = Some(GpuClaimStatus {
            request_mib: Some(19000),
            ..GpuClaimStatus::default()
        });
        let plan = Plan::from_claim(&c);
        let d = decide(&c, &plan, &[], at(0));
        assert_eq!(d.create.as_deref(), Some("train-19000mib"));
        // A pod of another request (a crash before its deletion, or an edited status) goes first.
        let stale = pending("train-20000mib", 20000, 0, None);
        let d = decide(&c, &plan, std::slice::from_ref(&stale), at(0));
        assert_eq!(d.delete, vec![stale]);
        assert_eq!(d.create.as_deref(), Some("train-19000mib"));
        // A pod of the same name still terminating: wait for it.
        let mut going = pending("train-19000mib", 19000, 0, None);
        going.terminating = true;
        let d = decide(&c, &plan, &[going], at(0));
        assert_eq!(
            (d.create.as_deref(), d.requeue),
            (None, Some(Duration::from_secs(2)))
        );
    }

    #[test]
    fn a_spec_that_cannot_be_acted_on_says_why_and_creates_nothing() {
        let cases = [
            (json!({"minGpuMemMiB": 30000}), "minGpuMemMiB 30000"),
            (json!({"fallbackAfter": "soon"}), "fallbackAfter \"soon\""),
            (json!({"fallbackAfter": "-5m"}), "negative"),
            (json!({"gpuModels": ["Tesla T4, A100"]}), "without commas"),
            (json!({"template": {"spec": {"containers": []}}}), "no containers"),
            (
                json!({"template": {"spec": {"containers": "x"}}}),
                "not a pod template",
            ),
            (
                json!({"template": {"spec": {"containers": [{"name": "m", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}),
                "asks for nvidia.com/gpu",
            ),
        ];
        for (spec, expected) in cases {
            let c = claim(spec.clone());
            let plan = Plan::from_claim(&c);
            let problems = plan.as_ref().expect_err("invalid");
            assert!(problems.contains(expected), "{spec}: {problems}");
            let d = decide(&c, &plan, &[], at(0));
            assert_eq!(
                (d.create.as_deref(), d.status.phase),
                (None, Some(Phase::Invalid)),
                "{spec}"
            );
            assert!(d.notes.iter().any(|n| n.warning && n.reason == "InvalidSpec"));
        }
        let mut long = claim(json!({}));
        long.metadata.name = Some("x".repeat(64));
        assert!(
            Plan::from_claim(&long)
                .expect_err("too long")
                .contains("63 characters")
        );
    }

    #[test]
    fn defaults_follow_the_users_rule_and_the_unit_rounds_up() {
        let spec: GpuClaimSpec = serde_json::from_value(json!({
            "gpuMemMiB": 6000, "template": {"spec": {"containers": [{"name": "m"}]}}}))
        .expect("spec");
        assert_eq!((spec.step_mib, spec.fallback_after.as_str()), (1000, "5m"));
        let mut c = claim(json!({}));
        c.spec = spec;
        let plan = Plan::from_claim(&c).expect("valid");
        assert_eq!(
            (plan.min_mib, plan.fallback_after),
            (4000, Duration::from_secs(300))
        );
        let mut small = c.clone();
        small.spec.gpu_mem_mib = 3000;
        assert_eq!(
            Plan::from_claim(&small).expect("valid").min_mib,
            3000,
            "never above the request"
        );
        let pod = build_pod(&c, &plan, ClaimPath::DevicePlugin, 6001, 4);
        let resources = pod.spec.as_ref().expect("spec").containers[0]
            .resources
            .clone()
            .expect("resources");
        assert_eq!(
            resources.limits.expect("limits")[GPU_MEM_RESOURCE],
            Quantity("1501".into())
        );
        // The scorer's annotations follow the spec.
        c.spec.gpu_models = vec!["Tesla T4".into(), "Tesla V100-SXM2-32GB".into()];
        c.spec.preemptible = true;
        c.spec.workload_class = Some(WorkloadClass::Offline);
        let plan = Plan::from_claim(&c).expect("valid");
        let pod = build_pod(&c, &plan, ClaimPath::DevicePlugin, 6000, 1);
        let a = pod.metadata.annotations.expect("annotations");
        assert_eq!(a[GPU_MODELS_ANNOTATION], "Tesla T4, Tesla V100-SXM2-32GB");
        assert_eq!(
            (a[PREEMPTIBLE_KEY].as_str(), a[WORKLOAD_CLASS_KEY].as_str()),
            ("true", "offline")
        );
    }

    #[test]
    fn on_the_dra_path_the_pod_asks_through_a_claim_template_of_its_own_name() {
        let mut c = claim(json!({"path": "dra", "gpuModels": ["Tesla T4"]}));
        let plan = Plan::from_claim(&c).expect("valid");
        let pod = build_pod(&c, &plan, ClaimPath::Dra, 15000, 1);
        let spec = pod.spec.expect("spec");
        let claims = spec.resource_claims.expect("the pod's claims");
        assert_eq!(claims.len(), 1);
        assert_eq!(
            (
                claims[0].name.as_str(),
                claims[0].resource_claim_template_name.as_deref()
            ),
            (POD_CLAIM_NAME, Some("train-15000mib"))
        );
        let resources = spec.containers[0].resources.clone().expect("resources");
        assert_eq!(resources.claims.expect("claims")[0].name, POD_CLAIM_NAME);
        assert!(resources.limits.is_none(), "no extended resource on the DRA path");

        let template = build_template(&c, &plan, 15000, "gpu.gpumem.io");
        assert_eq!(template.metadata.name.as_deref(), Some("train-15000mib"));
        assert_eq!(template.metadata.owner_references.expect("owner")[0].uid, "u-1");
        let request = template
            .spec
            .spec
            .devices
            .expect("devices")
            .requests
            .expect("requests")[0]
            .exactly
            .clone()
            .expect("exactly");
        assert_eq!(request.device_class_name, "gpu.gpumem.io");
        assert_eq!(
            request.capacity.expect("capacity").requests.expect("requests")["memory"],
            Quantity("15000Mi".into())
        );
        let cel = request.selectors.expect("a model selector")[0]
            .cel
            .clone()
            .expect("cel")
            .expression;
        assert_eq!(
            cel,
            r#"device.attributes["gpumem.io"].productName in ["Tesla T4"]"#
        );
        // A gated pod the placer finds no room for says so in its condition; the claim reads it.
        let gated: Pod = serde_json::from_value(json!({
            "metadata": {"name": "train-15000mib"},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"},
                {"type": crate::placer::PLACED_CONDITION, "status": "False", "reason": "NoRoom",
                 "message": "no room for claim ml/c request \"gpu\""}]}
        }))
        .expect("pod");
        assert_eq!(
            PodView::from_pod(&gated).unschedulable.as_deref(),
            Some("no room for claim ml/c request \"gpu\"")
        );
        // The placer's and kube-scheduler's words for a claim that fits nowhere count as GPU memory.
        assert!(lacks_gpu_memory(
            "no node has room for all of the pod's claims: n1: no room for claim ml/c request \"gpu\""
        ));
        assert!(lacks_gpu_memory(
            "0/2 nodes are available: 2 cannot allocate all claims."
        ));
        // The claim's own claim name is the claim's.
        c.spec.template = json!({"spec": {"containers": [{"name": "m", "image": "i"}],
                                          "resourceClaims": [{"name": POD_CLAIM_NAME, "resourceClaimName": "x"}]}});
        let err = Plan::from_claim(&c).expect_err("a name taken");
        assert!(err.contains("resourceClaims entry named"), "{err}");
    }

    /// A pod of the claim on `path`.
    fn on(mut pod: PodView, path: ClaimPath) -> PodView {
        pod.path = path;
        pod
    }

    #[test]
    fn with_path_auto_each_request_tries_the_device_plugin_path_then_dra_before_stepping_down() {
        let c = claim(json!({"path": "auto", "gpuMemMiB": 9000}));
        let plan = Plan::from_claim(&c);
        let d = decide(&c, &plan, &[], at(0));
        assert_eq!(
            (d.create.as_deref(), d.status.path),
            (Some("train-9000mib"), Some(ClaimPath::DevicePlugin))
        );
        assert!(
            d.notes[0].message.ends_with("on the device-plugin path"),
            "{:?}",
            d.notes
        );
        let c = applied(c, &d);

        // No node has room on the device-plugin path: the same request on the DRA path, at once
        // (well before fallbackAfter), under the same name; nothing steps down.
        let insufficient = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu-mem.";
        let dp = pending("train-9000mib", 9000, 0, Some(insufficient));
        let d = decide(&c, &plan, std::slice::from_ref(&dp), at(1));
        assert_eq!(d.delete, vec![dp.clone()]);
        assert_eq!(
            (d.create.as_deref(), d.status.path, d.status.request_mib),
            (Some("train-9000mib"), Some(ClaimPath::Dra), Some(9000))
        );
        assert!(d.status.steps.is_empty());
        let switched = d
            .notes
            .iter()
            .find(|n| n.reason == "SwitchedPath")
            .expect("a note");
        assert!(
            switched.message.starts_with("9000 MiB on the DRA path instead")
                && switched.message.contains(insufficient),
            "{switched:?}"
        );
        let c = applied(c, &d);
        // The old pod is still terminating: its name is waited for, then the DRA pod is made.
        let mut leaving = dp.clone();
        leaving.terminating = true;
        let d = decide(&c, &plan, &[leaving], at(1));
        assert_eq!(
            (d.create.as_deref(), d.requeue),
            (None, Some(Duration::from_secs(2)))
        );
        let d = decide(&c, &plan, &[], at(2));
        assert_eq!(
            (d.create.as_deref(), d.status.path),
            (Some("train-9000mib"), Some(ClaimPath::Dra))
        );
        let c = applied(c, &d);

        // A device-plugin pod of that name left over (a restart between delete and status) is not
        // the current pod: it goes.
        let d = decide(&c, &plan, std::slice::from_ref(&dp), at(2));
        assert_eq!(d.delete, vec![dp.clone()]);

        // The DRA pod waits fallbackAfter, then the claim steps down, on the device-plugin path again.
        let no_room = "no node has room for all of the pod's claims: no room for claim ml/c";
        let dra = on(pending("train-9000mib", 9000, 2, Some(no_room)), ClaimPath::Dra);
        let d = decide(&c, &plan, std::slice::from_ref(&dra), at(4));
        assert_eq!((d.create.as_deref(), d.delete.len()), (None, 0));
        assert_eq!(d.requeue, Some(Duration::from_secs(3)));
        let d = decide(&c, &plan, std::slice::from_ref(&dra), at(7));
        assert_eq!(d.delete, vec![dra.clone()]);
        assert_eq!(
            (d.create.as_deref(), d.status.path, d.status.request_mib),
            (Some("train-8000mib"), Some(ClaimPath::DevicePlugin), Some(8000))
        );
        assert_eq!(d.status.steps.len(), 1);
        let c = applied(c, &d);

        // At the minimum the paths take turns, each waited on for fallbackAfter.
        let dp = pending("train-8000mib", 8000, 8, Some(insufficient));
        let d = decide(&c, &plan, std::slice::from_ref(&dp), at(9));
        assert_eq!(d.status.path, Some(ClaimPath::Dra));
        let c = applied(c, &d);
        let dra = on(pending("train-8000mib", 8000, 9, Some(no_room)), ClaimPath::Dra);
        let d = decide(&c, &plan, std::slice::from_ref(&dra), at(10));
        assert_eq!(
            (d.create.as_deref(), d.requeue),
            (None, Some(Duration::from_secs(4)))
        );
        assert!(d.notes.iter().any(|n| n.reason == "AtMinimum"));
        let d = decide(&c, &plan, std::slice::from_ref(&dra), at(14));
        assert_eq!(d.delete, vec![dra.clone()]);
        assert_eq!(
            (d.create.as_deref(), d.status.path, d.status.request_mib),
            (Some("train-8000mib"), Some(ClaimPath::DevicePlugin), Some(8000))
        );
        assert_eq!(d.status.steps.len(), 1, "turning paths is not a step");

        // Once a pod is bound, on whichever path, it is the claim's.
        let c = applied(c, &d);
        let mut bound = on(pending("train-8000mib", 8000, 14, None), ClaimPath::DevicePlugin);
        bound.node = Some("n-dp".into());
        let d = decide(&c, &plan, std::slice::from_ref(&bound), at(15));
        assert_eq!((d.create.as_deref(), d.delete.len()), (None, 0));
        assert_eq!(
            (d.status.node.as_deref(), d.status.path),
            (Some("n-dp"), Some(ClaimPath::DevicePlugin))
        );
    }

    #[test]
    fn a_fixed_path_never_switches_and_a_pod_of_the_other_path_is_replaced() {
        let c = claim(json!({"path": "dra"}));
        let plan = Plan::from_claim(&c);
        let c = applied(c.clone(), &decide(&c, &plan, &[], at(0)));
        assert_eq!(c.status.as_ref().and_then(|s| s.path), Some(ClaimPath::Dra));
        let dra = on(
            pending(
                "train-20000mib",
                20000,
                0,
                Some("0/3 nodes are available: 3 cannot allocate all claims."),
            ),
            ClaimPath::Dra,
        );
        let d = decide(&c, &plan, std::slice::from_ref(&dra), at(1));
        assert_eq!((d.create.as_deref(), d.delete.len()), (None, 0));
        // The user changed spec.path: the pod on the old path goes, one on the new path comes.
        let mut c = c;
        c.spec.path = ClaimPath::DevicePlugin;
        let plan = Plan::from_claim(&c);
        let d = decide(&c, &plan, std::slice::from_ref(&dra), at(2));
        assert_eq!(d.delete, vec![dra]);
        assert_eq!(
            (d.create.as_deref(), d.status.path),
            (Some("train-20000mib"), Some(ClaimPath::DevicePlugin))
        );
        // A pod's path is read from its spec: the claim's ResourceClaim or none.
        let pod = build_pod(&c, plan.as_ref().expect("valid"), ClaimPath::Dra, 20000, 1);
        assert_eq!(PodView::from_pod(&pod).path, ClaimPath::Dra);
        let pod = build_pod(
            &c,
            plan.as_ref().expect("valid"),
            ClaimPath::DevicePlugin,
            20000,
            1,
        );
        assert_eq!(PodView::from_pod(&pod).path, ClaimPath::DevicePlugin);
    }
}
