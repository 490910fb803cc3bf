//! What the scorer knows: each Node's GPUs (from the agent's annotations) and what a pod asks for.
//!
//! A node whose annotations are missing, hand-edited or of an unknown version is kept with a
//! [`NodeSnapshot::problem`]: it is unschedulable for GPU pods, and the problem is the reason given.
//!
//! One file, over the usual ~600 lines: the two inputs of every decision (a node's snapshot, a pod's
//! demand) and the bounds on what is read from each, which the decisions rely on together.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;

use crate::affinity::NodeSelection;
use crate::alloc::{GpuMask, MAX_GPUS_PER_NODE};
use crate::node::{
    AGENT_RESTART_MARK_HOLDS, AGENT_RESTARTING_ANNOTATION, ASSIGNED_GPUS_ANNOTATION, AnnotationError,
    GpuMode, Health, TOPOLOGY_ANNOTATION, TopologyAnnotation, USAGE_ANNOTATION, UsageAnnotation, label_value,
};
use crate::quantity::{Quantity, QuantityError};

/// Whole GPUs.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// GPU memory, in units of the node's `gpumem.io/mem-unit-mib`.
pub const GPU_MEM_RESOURCE: &str = "nvidia.com/gpu-mem";
/// Node label: MiB per `nvidia.com/gpu-mem` unit.
pub const MEM_UNIT_LABEL: &str = "gpumem.io/mem-unit-mib";
/// Pod annotation: acceptable GPU models, comma-separated (as in the topology annotation, or as in the
/// `nvidia.com/gpu.product` label, compared case-insensitively).
pub const GPU_MODELS_ANNOTATION: &str = "gpumem.io/gpu-models";
/// The longest [`GPU_MODELS_ANNOTATION`] read, in bytes (a few dozen model names).
pub const MAX_MODELS_ANNOTATION_BYTES: usize = 4096;
/// Pod annotation: what a multi-GPU pod needs of its GPUs: `nvlink`, `numa`, `pcie-switch` or `any`.
pub const GPU_TOPOLOGY_ANNOTATION: &str = "gpumem.io/gpu-topology-policy";
/// Pod label or annotation: `online` (latency-sensitive) or `offline` (batch).
pub const WORKLOAD_CLASS_KEY: &str = "gpumem.io/workload-class";
/// Pod label or annotation: `"true"` lets the scorer's preemption evict this pod.
pub const PREEMPTIBLE_KEY: &str = "gpumem.io/preemptible";

/// One GPU as the scorer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSnapshot {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_mib: u64,
    pub allocated_mib: u64,
    /// Allocated whole to one pod.
    pub whole: bool,
    pub healthy: bool,
    pub numa_node: Option<u32>,
    pub pcie_switch: Option<u32>,
    /// NVLink links to other GPUs, by their position in [`NodeSnapshot::gpus`].
    pub nvlink: Vec<(usize, u32)>,
    /// `namespace/name` of the pods the agent reports on this GPU.
    pub pods: Vec<String>,
}

impl GpuSnapshot {
    /// A healthy GPU `GPU-<index>` with `allocated_mib` of `memory_mib` in use, outside any topology.
    #[cfg(test)]
    pub(crate) fn for_tests(index: usize, model: &str, memory_mib: u64, allocated_mib: u64) -> GpuSnapshot {
        GpuSnapshot {
            index: index as u32,
            uuid: format!("GPU-{index}"),
            model: model.into(),
            memory_mib,
            allocated_mib,
            whole: false,
            healthy: true,
            numa_node: None,
            pcie_switch: None,
            nvlink: Vec::new(),
            pods: Vec::new(),
        }
    }

    pub fn free_mib(&self) -> u64 {
        if self.whole {
            0
        } else {
            self.memory_mib.saturating_sub(self.allocated_mib)
        }
    }

    pub fn is_idle(&self) -> bool {
        !self.whole && self.allocated_mib == 0
    }

    pub fn nvlinks_to(&self, other: usize) -> u32 {
        self.nvlink
            .iter()
            .find(|(p, _)| *p == other)
            .map_or(0, |(_, l)| *l)
    }
}

/// One node as the scorer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSnapshot {
    pub name: String,
    pub resource_version: String,
    /// MiB per `nvidia.com/gpu-mem` unit.
    pub unit_mib: u64,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// By GPU index, increasing; changed only through [`NodeSnapshot::gpus_mut`], which keeps `summary` true.
    gpus: Vec<GpuSnapshot>,
    summary: GpuSummary,
    /// Why GPU pods cannot go here (bad or missing annotations), if they cannot.
    pub problem: Option<String>,
    /// When its agent began restarting ([`AGENT_RESTARTING_ANNOTATION`]), while the mark is on.
    pub agent_restarting: Option<Timestamp>,
    /// The node's labels, which pods' node selectors read (shared by the node's versions).
    pub labels: Arc<BTreeMap<String, String>>,
}

/// What every decision asks of a node's GPUs, derived once per node state: a call checks a thousand
/// nodes, and reading each one's GPU list (over a kilobyte with UUIDs, models and pods) would make the
/// check cost memory traffic rather than arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuSummary {
    /// Healthy GPUs, by position.
    pub healthy: GpuMask,
    /// GPUs with nothing allocated, by position.
    pub idle: GpuMask,
    /// The most free MiB on one healthy GPU.
    pub largest_free_mib: u64,
    /// GPU memory allocated (whole GPUs count in full) and in all, MiB.
    pub allocated_mib: u64,
    pub total_mib: u64,
}

impl GpuSummary {
    fn of(gpus: &[GpuSnapshot]) -> GpuSummary {
        let mut s = GpuSummary::default();
        // Node states from annotations hold at most MAX_GPUS_PER_NODE GPUs (a mask's width).
        for (p, g) in gpus.iter().enumerate().take(MAX_GPUS_PER_NODE) {
            if g.healthy {
                s.healthy = s.healthy.with(p);
                s.largest_free_mib = s.largest_free_mib.max(g.free_mib());
            }
            if g.is_idle() {
                s.idle = s.idle.with(p);
            }
            s.total_mib += g.memory_mib;
            s.allocated_mib += g.memory_mib - g.free_mib().min(g.memory_mib);
        }
        s
    }
}

/// Write access to a node's GPUs; the node's [`GpuSummary`] is brought up to date when it is dropped.
pub struct GpusMut<'a>(&'a mut NodeSnapshot);

impl std::ops::Deref for GpusMut<'_> {
    type Target = Vec<GpuSnapshot>;
    fn deref(&self) -> &Vec<GpuSnapshot> {
        &self.0.gpus
    }
}

impl std::ops::DerefMut for GpusMut<'_> {
    fn deref_mut(&mut self) -> &mut Vec<GpuSnapshot> {
        &mut self.0.gpus
    }
}

impl Drop for GpusMut<'_> {
    fn drop(&mut self) {
        self.0.summary = GpuSummary::of(&self.0.gpus);
    }
}

impl NodeSnapshot {
    /// A node with these GPUs (and no CPU or memory figures).
    pub fn with_gpus(name: &str, unit_mib: u64, gpus: Vec<GpuSnapshot>) -> NodeSnapshot {
        let mut node = NodeSnapshot::broken(name, String::new());
        node.problem = None;
        node.unit_mib = unit_mib;
        *node.gpus_mut() = gpus;
        node
    }

    /// The GPUs, by index.
    pub fn gpus(&self) -> &[GpuSnapshot] {
        &self.gpus
    }

    pub fn gpus_mut(&mut self) -> GpusMut<'_> {
        GpusMut(self)
    }

    pub fn summary(&self) -> &GpuSummary {
        &self.summary
    }

    /// From a Node object.
    pub fn from_node(node: &Node) -> NodeSnapshot {
        let empty = BTreeMap::new();
        let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
        let annotations = node.metadata.annotations.as_ref().unwrap_or(&empty);
        let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
        let quantity = |k: &str| allocatable.and_then(|a| a.get(k)).map(|q| q.0.as_str());
        NodeSnapshot::from_parts(
            node.metadata.name.as_deref().unwrap_or(""),
            node.metadata.resource_version.as_deref().unwrap_or(""),
            labels,
            annotations,
            quantity("cpu"),
            quantity("memory"),
        )
    }

    /// From a Node in raw JSON text (the `Nodes` form of the extender protocol): only the fields the
    /// scorer uses are decoded, everything else is skipped.
    pub fn from_json_str(node: &str) -> NodeSnapshot {
        match serde_json::from_str::<NodeView>(node) {
            Ok(v) => NodeSnapshot::from_parts(
                &v.metadata.name,
                &v.metadata.resource_version,
                &v.metadata.labels,
                &v.metadata.annotations,
                v.status.allocatable.get("cpu").map(String::as_str),
                v.status.allocatable.get("memory").map(String::as_str),
            ),
            Err(e) => {
                #[derive(Deserialize, Default)]
                #[serde(default)]
                struct Named {
                    metadata: NameOnly,
                }
                #[derive(Deserialize, Default)]
                #[serde(default)]
                struct NameOnly {
                    name: Option<String>,
                }
                let name = serde_json::from_str::<Named>(node)
                    .ok()
                    .and_then(|n| n.metadata.name)
                    .unwrap_or_default();
                NodeSnapshot::broken(&name, format!("node object cannot be read: {e}"))
            }
        }
    }

    /// A node GPU pods cannot go to, for `problem`.
    pub fn broken(name: &str, problem: String) -> NodeSnapshot {
        NodeSnapshot {
            name: name.to_string(),
            resource_version: String::new(),
            unit_mib: 1,
            cpu_milli: 0,
            memory_mib: 0,
            gpus: Vec::new(),
            summary: GpuSummary::default(),
            // Every filter answer that lists this node quotes it: kept short.
            problem: Some(bounded_reason(problem)),
            agent_restarting: None,
            labels: Arc::default(),
        }
    }

    pub fn from_parts(
        name: &str,
        resource_version: &str,
        labels: &BTreeMap<String, String>,
        annotations: &BTreeMap<String, String>,
        cpu: Option<&str>,
        memory: Option<&str>,
    ) -> NodeSnapshot {
        let mut state = NodeSnapshot::broken(name, String::new());
        state.resource_version = resource_version.to_string();
        state.labels = Arc::new(labels.clone());
        let read = |q: Option<&str>, value: fn(&Quantity) -> Result<u64, QuantityError>| {
            q.and_then(|q| Quantity::parse(q).and_then(|q| value(&q)).ok())
                .unwrap_or(0)
        };
        // A mark that is not a time (edited by hand) is ignored: it would only keep pods away.
        state.agent_restarting = annotations
            .get(AGENT_RESTARTING_ANNOTATION)
            .and_then(|v| v.parse().ok());
        state.cpu_milli = read(cpu, Quantity::millis_ceil);
        state.memory_mib = read(memory, Quantity::mib_ceil);
        match read_gpus(name, labels, annotations) {
            Ok((unit, gpus)) => {
                state.unit_mib = unit;
                *state.gpus_mut() = gpus;
                state.problem = None;
            }
            Err(problem) => state.problem = Some(bounded_reason(problem)),
        }
        state
    }

    /// GPU position of `uuid`.
    pub fn position_of(&self, uuid: &str) -> Option<usize> {
        self.gpus.iter().position(|g| g.uuid == uuid)
    }

    /// Why GPU pods must not come here at `now`: its agent is restarting, by a mark within
    /// [`AGENT_RESTART_MARK_HOLDS`] of `now` (either way: clocks differ). Until the agent has registered
    /// again, the kubelet would fail them.
    pub fn restarting(&self, now: Timestamp) -> Option<String> {
        let at = self.agent_restarting?;
        (now.duration_since(at).unsigned_abs() < AGENT_RESTART_MARK_HOLDS).then(|| {
            format!(
                "the gpumem agent on this node is restarting (marked at {at}); its GPUs are offered again \
                 once the kubelet counts them"
            )
        })
    }

    /// Whether the usage annotation lists `pod` (`namespace/name`) on any GPU.
    pub fn shows(&self, pod: &str) -> bool {
        self.gpus.iter().any(|g| g.pods.iter().any(|p| **p == *pod))
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct NodeView {
    metadata: MetaView,
    status: StatusView,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct MetaView {
    name: String,
    resource_version: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StatusView {
    allocatable: BTreeMap<String, String>,
}

fn read_gpus(
    node: &str,
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
) -> Result<(u64, Vec<GpuSnapshot>), String> {
    let refused = |e: AnnotationError| {
        // Not a typo or an old agent: a node claiming more than any real one (a compromised node?).
        if matches!(e, AnnotationError::Refused { .. }) {
            tracing::warn!(node, "{e}");
        }
        e.to_string()
    };
    let topology_json = annotations.get(TOPOLOGY_ANNOTATION).ok_or_else(|| {
        format!("node has no {TOPOLOGY_ANNOTATION} annotation (is the gpumem agent running on it?)")
    })?;
    let usage_json = annotations.get(USAGE_ANNOTATION).ok_or_else(|| {
        format!("node has no {USAGE_ANNOTATION} annotation (is the gpumem agent running on it?)")
    })?;
    let topology = TopologyAnnotation::parse(topology_json).map_err(refused)?;
    let usage = UsageAnnotation::parse(usage_json).map_err(refused)?;
    let unit = match labels.get(MEM_UNIT_LABEL) {
        None => topology.mem_unit_mib,
        Some(label) => match label.parse::<u64>() {
            Ok(u) if u == topology.mem_unit_mib => u,
            Ok(u) => {
                return Err(format!(
                    "label {MEM_UNIT_LABEL}={u} disagrees with memUnitMiB {} in {TOPOLOGY_ANNOTATION}",
                    topology.mem_unit_mib
                ));
            }
            Err(_) => return Err(format!("label {MEM_UNIT_LABEL}={label:?} is not a number")),
        },
    };
    // `parse` refused more than MAX_GPUS_PER_NODE GPUs (node::MAX_GPUS), so a mask holds them all.
    let mut topo = topology.gpus;
    topo.sort_by_key(|g| g.index);
    let position = |index: u32| topo.iter().position(|g| g.index == index);
    let mut gpus: Vec<GpuSnapshot> = Vec::with_capacity(topo.len());
    for g in &topo {
        let mut nvlink = Vec::new();
        for peer in &g.nvlink_peers {
            let p = position(peer.index).ok_or_else(|| {
                format!(
                    "annotation {TOPOLOGY_ANNOTATION} is inconsistent: GPU {} has an NVLink peer {} that is not listed",
                    g.index, peer.index
                )
            })?;
            nvlink.push((p, peer.links));
        }
        gpus.push(GpuSnapshot {
            index: g.index,
            uuid: g.uuid.clone(),
            model: g.model.clone(),
            memory_mib: g.memory_mib,
            allocated_mib: 0,
            whole: false,
            healthy: g.health == Health::Healthy,
            numa_node: g.numa_node,
            pcie_switch: g.pcie_switch,
            nvlink,
            pods: Vec::new(),
        });
    }
    let mut seen = vec![false; gpus.len()];
    for u in usage.gpus {
        let inconsistent = |what: String| format!("annotation {USAGE_ANNOTATION} is inconsistent: {what}");
        let p = position(u.index)
            .ok_or_else(|| inconsistent(format!("GPU {} is not in {TOPOLOGY_ANNOTATION}", u.index)))?;
        if std::mem::replace(&mut seen[p], true) {
            return Err(inconsistent(format!("GPU {} twice", u.index)));
        }
        let gpu = &mut gpus[p];
        match u.mode {
            GpuMode::Free if u.allocated_mib != 0 || !u.pods.is_empty() => {
                return Err(inconsistent(format!(
                    "GPU {} is free but has {} MiB allocated",
                    u.index, u.allocated_mib
                )));
            }
            GpuMode::Shared if u.allocated_mib > gpu.memory_mib => {
                return Err(inconsistent(format!(
                    "GPU {} has {} MiB allocated of {} MiB",
                    u.index, u.allocated_mib, gpu.memory_mib
                )));
            }
            _ => {}
        }
        gpu.whole = u.mode == GpuMode::Whole;
        gpu.allocated_mib = if gpu.whole {
            gpu.memory_mib
        } else {
            u.allocated_mib
        };
        gpu.pods = u.pods;
    }
    if let Some(p) = seen.iter().position(|s| !s) {
        return Err(format!(
            "annotation {USAGE_ANNOTATION} is inconsistent: GPU {} has no usage entry",
            gpus[p].index
        ));
    }
    Ok((unit, gpus))
}

/// Latency-sensitive work spreads; batch work packs. Written `online` / `offline` (the value of
/// [`WORKLOAD_CLASS_KEY`], and a GPUClaim's `workloadClass`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadClass {
    Online,
    Offline,
}

impl WorkloadClass {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadClass::Online => "online",
            WorkloadClass::Offline => "offline",
        }
    }
}

/// What a multi-GPU pod needs of the set of GPUs it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopologyNeed {
    Any,
    /// Every pair NVLinked.
    NvLink,
    /// All on one NUMA node.
    Numa,
    /// All behind one PCIe switch.
    PcieSwitch,
}

impl TopologyNeed {
    pub fn describe(self) -> &'static str {
        match self {
            TopologyNeed::Any => "",
            TopologyNeed::NvLink => " all NVLinked to each other",
            TopologyNeed::Numa => " on one NUMA node",
            TopologyNeed::PcieSwitch => " behind one PCIe switch",
        }
    }
}

/// What a pod asks of GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Demand {
    /// `units` of `nvidia.com/gpu-mem` on ONE GPU (MiB = units × the node's unit).
    Memory { units: u64 },
    /// `count` whole GPUs.
    Whole { count: u32 },
}

/// A GPU pod's request, as the scorer reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct PodDemand {
    /// `namespace/name`.
    pub key: String,
    pub uid: String,
    pub demand: Demand,
    /// Acceptable models, lower-cased; `None` = any.
    pub models: Option<Vec<String>>,
    /// The nodes its node selector and required node affinity admit (`None`: any node). Which
    /// models those nodes have restricts the pod as `models` does, for the learned mix.
    pub selection: Option<Arc<NodeSelection>>,
    pub topology: TopologyNeed,
    pub class: WorkloadClass,
    pub cpu_milli: u64,
    pub memory_mib: u64,
}

impl PodDemand {
    /// MiB needed on one GPU of a node with `unit_mib` per unit (whole GPUs: 0).
    pub fn memory_mib(&self, unit_mib: u64) -> u64 {
        match self.demand {
            Demand::Memory { units } => units.saturating_mul(unit_mib),
            Demand::Whole { .. } => 0,
        }
    }

    /// Whether a GPU of `model` is acceptable.
    pub fn allows_model(&self, model: &str) -> bool {
        self.models.as_ref().is_none_or(|allowed| {
            let plain = model.to_ascii_lowercase();
            let label = label_value(model).to_ascii_lowercase();
            allowed.iter().any(|a| *a == plain || *a == label)
        })
    }
}

/// How a pod's class is decided when it carries no `gpumem.io/workload-class`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassRules {
    /// PriorityClass names that mean online.
    pub online_priority_classes: Vec<String>,
    /// Pods with at least this priority are online.
    pub online_min_priority: Option<i32>,
}

impl ClassRules {
    /// The class of a pod `marked` so (or not), of PriorityClass `priority_class` and `priority`.
    pub fn class_of(
        &self,
        marked: Option<WorkloadClass>,
        priority_class: Option<&str>,
        priority: Option<i32>,
    ) -> WorkloadClass {
        if let Some(class) = marked {
            return class;
        }
        let by_class = priority_class.is_some_and(|c| self.online_priority_classes.iter().any(|o| o == c));
        let by_priority = matches!((priority, self.online_min_priority), (Some(p), Some(min)) if p >= min);
        if by_class || by_priority {
            WorkloadClass::Online
        } else {
            WorkloadClass::Offline
        }
    }
}

/// The class a pod's label or annotation `gpumem.io/workload-class` gives it (`None`: not marked).
pub fn marked_class(pod: &Pod) -> Result<Option<WorkloadClass>, String> {
    let meta = &pod.metadata;
    let value = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(WORKLOAD_CLASS_KEY))
        .or_else(|| meta.annotations.as_ref().and_then(|a| a.get(WORKLOAD_CLASS_KEY)))
        .map(|v| v.trim().to_ascii_lowercase());
    match value.as_deref() {
        None => Ok(None),
        Some("online") => Ok(Some(WorkloadClass::Online)),
        Some("offline") => Ok(Some(WorkloadClass::Offline)),
        Some(other) => Err(format!(
            "{WORKLOAD_CLASS_KEY}={other:?}: expected online or offline"
        )),
    }
}

/// The pod's effective `[gpu-mem units, whole GPUs]`: the larger of the sum over app containers and
/// any init container.
fn effective_requests(spec: &k8s_openapi::api::core::v1::PodSpec) -> Result<[u64; 2], String> {
    // Extended resources: a whole count, from the limit (the request equals it when given).
    let count = |c: &k8s_openapi::api::core::v1::Container, res: &str| {
        let r = c.resources.as_ref();
        let q = r
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get(res))
            .or_else(|| r.and_then(|r| r.requests.as_ref()).and_then(|l| l.get(res)));
        match q {
            None => Ok(0),
            Some(q) => Quantity::parse(&q.0)
                .and_then(|v| v.whole())
                .map_err(|e| format!("{res} quantity {:?} is not understood: {e}", q.0)),
        }
    };
    let mut totals = [0u64; 2];
    let mut init_max = [0u64; 2];
    for (containers, is_init) in [
        (&spec.containers, false),
        (&spec.init_containers.clone().unwrap_or_default(), true),
    ] {
        for c in containers.iter() {
            let v = [count(c, GPU_MEM_RESOURCE)?, count(c, GPU_RESOURCE)?];
            for i in 0..2 {
                if is_init {
                    init_max[i] = init_max[i].max(v[i]);
                } else {
                    totals[i] = totals[i].saturating_add(v[i]);
                }
            }
        }
    }
    Ok([0, 1].map(|i| totals[i].max(init_max[i])))
}

/// The pod's CPU (millis) and memory (MiB) requests, as kube-scheduler sums them ([`crate::requests`]).
pub fn cpu_memory_requests(pod: &Pod) -> (u64, u64) {
    let asked = crate::requests::Resources::asked_by(pod);
    (asked.cpu_milli, asked.memory_bytes.div_ceil(1 << 20))
}

/// Reads the pod's GPU request. `Ok(None)`: the pod asks for no GPU.
pub fn pod_demand(pod: &Pod, rules: &ClassRules) -> Result<Option<PodDemand>, String> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(None);
    };
    let [mem_units, whole] = effective_requests(spec)?;
    let (cpu, memory) = cpu_memory_requests(pod);
    let demand = match (mem_units, whole) {
        (0, 0) => return Ok(None),
        (m, 0) => Demand::Memory { units: m },
        (0, w) => Demand::Whole {
            count: u32::try_from(w).map_err(|_| format!("{w} whole GPUs is not a sensible request"))?,
        },
        (m, w) => {
            return Err(format!(
                "pod asks for both {GPU_RESOURCE} ({w}) and {GPU_MEM_RESOURCE} ({m}); ask for whole GPUs or for \
                 GPU memory, not both"
            ));
        }
    };
    demand_of(pod, rules, demand, cpu, memory).map(Some)
}

/// The request of a pod whose GPU `demand` is known (from its containers, or from its ResourceClaim on
/// the DRA path): what its labels and annotations add (models, topology, class).
pub fn demand_of(
    pod: &Pod,
    rules: &ClassRules,
    demand: Demand,
    cpu_milli: u64,
    memory_mib: u64,
) -> Result<PodDemand, String> {
    let meta = &pod.metadata;
    let key = format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or("")
    );
    let spec = pod.spec.as_ref();
    let annotations = meta.annotations.as_ref();
    let models = annotations.and_then(|a| a.get(GPU_MODELS_ANNOTATION));
    // Rejections quote the list, once per node: a list longer than any real one is refused outright.
    if let Some(v) = models.filter(|v| v.len() > MAX_MODELS_ANNOTATION_BYTES) {
        return Err(format!(
            "annotation {GPU_MODELS_ANNOTATION} has {} bytes, at most {MAX_MODELS_ANNOTATION_BYTES} are read",
            v.len()
        ));
    }
    let models = models.map(|v| {
        v.split(',')
            .map(|m| m.trim().to_ascii_lowercase())
            .filter(|m| !m.is_empty())
            .collect::<Vec<_>>()
    });
    let topology = match annotations
        .and_then(|a| a.get(GPU_TOPOLOGY_ANNOTATION))
        .map(|v| v.trim().to_ascii_lowercase())
        .as_deref()
    {
        None | Some("" | "any" | "none") => TopologyNeed::Any,
        Some("nvlink") => TopologyNeed::NvLink,
        Some("numa" | "same-numa") => TopologyNeed::Numa,
        Some("pcie-switch" | "pcie" | "same-pcie-switch") => TopologyNeed::PcieSwitch,
        Some(other) => {
            return Err(format!(
                "annotation {GPU_TOPOLOGY_ANNOTATION}={other:?}: expected nvlink, numa, pcie-switch or any"
            ));
        }
    };
    let class = rules.class_of(
        marked_class(pod)?,
        spec.and_then(|s| s.priority_class_name.as_deref()),
        spec.and_then(|s| s.priority),
    );
    let selection = spec.map(NodeSelection::of).filter(|s| !s.is_any()).map(Arc::new);
    Ok(PodDemand {
        key,
        uid: meta.uid.clone().unwrap_or_default(),
        demand,
        models,
        selection,
        topology,
        class,
        cpu_milli,
        memory_mib,
    })
}

/// Whether the pod may be preempted by the scorer (label or annotation `gpumem.io/preemptible: "true"`).
pub fn is_preemptible(pod: &Pod) -> bool {
    let is_true = |m: Option<&BTreeMap<String, String>>| {
        m.and_then(|m| m.get(PREEMPTIBLE_KEY))
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
    };
    is_true(pod.metadata.labels.as_ref()) || is_true(pod.metadata.annotations.as_ref())
}

/// The GPU UUIDs recorded on a pod at bind time.
pub fn assigned_gpus(pod: &Pod) -> Vec<String> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ASSIGNED_GPUS_ANNOTATION))
        .map(|v| {
            v.split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default()
}

/// The longest reason given for one node, in bytes. A `filter` answer holds a reason per node (twice
/// for unresolvable ones), and a reason may quote a pod's or a node's annotation: without a bound, one
/// long annotation repeated for each of thousands of nodes makes an answer of gigabytes.
pub const MAX_REASON_BYTES: usize = 512;

/// `reason`, cut to [`MAX_REASON_BYTES`] at a character boundary (the cut marked with "...").
pub fn bounded_reason(mut reason: String) -> String {
    if reason.len() > MAX_REASON_BYTES {
        let mut end = MAX_REASON_BYTES - 3;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
        reason.push_str("...");
        reason.shrink_to_fit();
    }
    reason
}

#[cfg(test)]
mod tests {
    use super::*;

    fn annotations(topology: &str, usage: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            (TOPOLOGY_ANNOTATION.to_string(), topology.to_string()),
            (USAGE_ANNOTATION.to_string(), usage.to_string()),
        ])
    }

    const TOPO: &str = r#"{"version":1,"memUnitMiB":1,"gpus":[
        {"index":0,"uuid":"GPU-a","model":"Tesla T4","memoryMiB":15360,"numaNode":0,"pcieSwitch":null,"nvlinkPeers":[],"health":"Healthy"},
        {"index":1,"uuid":"GPU-b","model":"Tesla T4","memoryMiB":15360,"numaNode":1,"pcieSwitch":null,"nvlinkPeers":[],"health":"Unhealthy"}]}"#;

    #[test]
    fn reads_gpus_and_reports_hand_edits() {
        let usage = r#"{"version":1,"gpus":[{"index":0,"allocatedMiB":1000,"mode":"shared","pods":["a/b"]},
            {"index":1,"allocatedMiB":0,"mode":"free","pods":[]}]}"#;
        let n = NodeSnapshot::from_parts(
            "n",
            "1",
            &BTreeMap::new(),
            &annotations(TOPO, usage),
            Some("8"),
            Some("32Gi"),
        );
        assert_eq!(n.problem, None);
        assert_eq!(n.gpus[0].free_mib(), 14360);
        assert!(!n.gpus[1].healthy);
        assert_eq!((n.cpu_milli, n.memory_mib), (8000, 32768));

        let edited = usage.replace("\"allocatedMiB\":0", "\"allocatedMiB\":77");
        let n = NodeSnapshot::from_parts(
            "n",
            "1",
            &BTreeMap::new(),
            &annotations(TOPO, &edited),
            None,
            None,
        );
        assert!(
            n.problem
                .as_deref()
                .is_some_and(|p| p.contains("GPU 1 is free but has 77 MiB")),
            "{n:?}"
        );

        let typo = usage.replace("allocatedMiB", "allocatedMB");
        let n = NodeSnapshot::from_parts("n", "1", &BTreeMap::new(), &annotations(TOPO, &typo), None, None);
        assert!(
            n.problem.as_deref().is_some_and(|p| p.contains(USAGE_ANNOTATION)),
            "{n:?}"
        );

        let labels = BTreeMap::from([(MEM_UNIT_LABEL.to_string(), "4".to_string())]);
        let n = NodeSnapshot::from_parts("n", "1", &labels, &annotations(TOPO, usage), None, None);
        assert!(
            n.problem.as_deref().is_some_and(|p| p.contains("disagrees")),
            "{n:?}"
        );

        let n = NodeSnapshot::from_parts("n", "1", &BTreeMap::new(), &BTreeMap::new(), None, None);
        assert!(
            n.problem.as_deref().is_some_and(|p| p.contains("agent running")),
            "{n:?}"
        );
    }

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).expect("pod")
    }

    #[test]
    fn pod_demands() {
        let rules = ClassRules {
            online_priority_classes: vec!["serving".into()],
            online_min_priority: None,
        };
        let p = pod(
            serde_json::json!({"metadata":{"name":"p","namespace":"ns","annotations":{
            "gpumem.io/gpu-models":"Tesla T4, NVIDIA-A100-SXM4-80GB"}},
            "spec":{"priorityClassName":"serving","containers":[
                {"name":"a","resources":{"limits":{"nvidia.com/gpu-mem":"3000"},"requests":{"cpu":"1"}}},
                {"name":"b","resources":{"limits":{"nvidia.com/gpu-mem":"2000"}}}]}}),
        );
        let d = pod_demand(&p, &rules).expect("valid").expect("gpu pod");
        assert_eq!(d.demand, Demand::Memory { units: 5000 });
        assert_eq!(d.memory_mib(4), 20000);
        assert_eq!(d.class, WorkloadClass::Online);
        assert_eq!(d.cpu_milli, 1000);
        assert!(d.allows_model("Tesla T4"));
        assert!(d.allows_model("NVIDIA A100-SXM4-80GB"));
        assert!(!d.allows_model("NVIDIA H100 80GB HBM3"));

        let both = pod(serde_json::json!({"metadata":{"name":"p"},"spec":{"containers":[
            {"name":"a","resources":{"limits":{"nvidia.com/gpu-mem":"3000","nvidia.com/gpu":"1"}}}]}}));
        assert!(pod_demand(&both, &rules).is_err_and(|e| e.contains("both")));
        let none = pod(serde_json::json!({"metadata":{"name":"p"},"spec":{"containers":[{"name":"a"}]}}));
        assert_eq!(pod_demand(&none, &rules), Ok(None));
    }

    #[test]
    fn requests_in_every_form_the_api_server_returns() {
        let rules = ClassRules {
            online_priority_classes: Vec::new(),
            online_min_priority: None,
        };
        let asking = |gpu_mem: &str, cpu: &str, memory: &str| {
            pod(
                serde_json::json!({"metadata":{"name":"p","namespace":"ns"},"spec":{"containers":[
                {"name":"a","resources":{"limits":{"nvidia.com/gpu-mem":gpu_mem},
                    "requests":{"nvidia.com/gpu-mem":gpu_mem,"cpu":cpu,"memory":memory}}}]}}),
            )
        };
        for (gpu_mem, units) in [
            ("5k", 5000),
            ("5e3", 5000),
            ("1Ki", 1024),
            ("5001", 5001),
            ("0.5k", 500),
        ] {
            let d = pod_demand(&asking(gpu_mem, "500m", "1536Mi"), &rules)
                .expect("valid")
                .expect("gpu pod");
            assert_eq!(d.demand, Demand::Memory { units }, "{gpu_mem}");
            assert_eq!((d.cpu_milli, d.memory_mib), (500, 1536), "{gpu_mem}");
        }
        for (gpu_mem, why) in [
            ("1.5", "not a whole number"),
            ("-1", "negative"),
            ("1K", "unknown suffix \"K\""),
            ("20E", "too large"),
        ] {
            let err = pod_demand(&asking(gpu_mem, "1", "1Gi"), &rules).expect_err(gpu_mem);
            assert!(
                err.starts_with(&format!(
                    "nvidia.com/gpu-mem quantity {gpu_mem:?} is not understood: {why}"
                )),
                "{err}"
            );
        }
    }
}
