//! What the agent publishes on its Node: small selectable labels, and versioned JSON annotations
//! that carry the per-GPU picture the scorer places pods by.
//!
//! The types here are the contract between the agent (writer) and the scorer (reader).

pub mod slice;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::gpu::{GpuInventory, NvLinkPeer};

/// Per-GPU topology (JSON, [`TopologyAnnotation`]).
pub const TOPOLOGY_ANNOTATION: &str = "gpumem.io/gpu-topology";
/// Per-GPU usage (JSON, [`UsageAnnotation`]).
pub const USAGE_ANNOTATION: &str = "gpumem.io/gpu-usage";
/// Per-GPU memory the pods' processes really hold, as the shim counts it (JSON, [`UsedAnnotation`]).
/// Apart from [`USAGE_ANNOTATION`] because it changes as programs run, not as pods come and go: it is
/// written at most once per report interval, and the scorer neither reads nor waits for it.
pub const USED_ANNOTATION: &str = "gpumem.io/gpu-used";
/// On a pod: the GPU(s) the scorer chose at bind time, as comma-separated GPU UUIDs. The agent's
/// GetPreferredAllocation honours it for a pod bound to its node and not yet allocated; Allocate
/// never trusts it (the device IDs the kubelet passes decide).
pub const ASSIGNED_GPUS_ANNOTATION: &str = "gpumem.io/assigned-gpus";
/// On a pod: when the scorer made that choice (RFC 3339); old choices expire.
pub const ASSIGNED_AT_ANNOTATION: &str = "gpumem.io/assigned-at";
/// When a GPU of the node last gained room: less memory allocated, no longer held whole, or healthy
/// again (Unix milliseconds). A label, not an annotation, because kube-scheduler retries the pods it could
/// not place when a node's labels change, and not when only its annotations do: without it a pod waiting
/// for memory that frees on a GPU still shared would wait for the scheduler's periodic retry (minutes).
pub const ROOM_FREED_LABEL: &str = "gpumem.io/room-freed-at";
/// On the Node, while its agent restarts (RFC 3339, when it began): the stopping agent writes it on
/// SIGTERM and the next one takes it off once the kubelet has its device lists again. Meanwhile the kubelet
/// counts every device of the agent's plugins unhealthy, and a pod admitted then fails for good
/// (`UnexpectedAdmissionError`): the scorer sends no GPU pod to a node so marked.
pub const AGENT_RESTARTING_ANNOTATION: &str = "gpumem.io/agent-restarting";
/// A mark older (or further ahead) than this is ignored: an agent that never came back must not keep its
/// node from GPU pods once the kubelet has stopped offering its devices anyway.
pub const AGENT_RESTART_MARK_HOLDS: std::time::Duration = std::time::Duration::from_secs(60);
/// The schema version both annotations carry; a reader refuses any other.
pub const ANNOTATION_VERSION: u32 = 1;

// What an annotation may claim. Annotations are written by agents, and a compromised node can write
// anything: these bounds keep one node from costing the scorer unbounded memory or CPU, or skewing the
// cluster gauges, while staying well above any real node.

/// The longest annotation read, in bytes: the API server refuses objects whose annotations together
/// exceed 256 KiB, so no stored annotation is longer.
pub const MAX_ANNOTATION_BYTES: usize = 256 * 1024;
/// GPUs per node. The scorer keeps a GPU set as a 64-bit mask ([`crate::alloc::MAX_GPUS_PER_NODE`]);
/// the largest nodes sold hold 8 to 16 GPUs (DGX/HGX), and 64 is the search bound the scorer is
/// measured against (docs/architecture.md).
pub const MAX_GPUS: usize = crate::alloc::MAX_GPUS_PER_NODE;
/// Memory of one GPU, MiB: 1 TiB, several times the largest GPU today (H200: 141 GB, B300: 288 GB).
/// It also keeps every sum over a node's GPUs far from overflowing.
pub const MAX_GPU_MEMORY_MIB: u64 = 1 << 20;
/// NVLink links between two GPUs: NVML has at most 18 per GPU (`NVML_NVLINK_MAX_LINKS`).
pub const MAX_NVLINK_LINKS: u32 = 64;
/// Pods listed on one GPU: kubelets run at most a few hundred pods per node (110 by default).
pub const MAX_PODS_PER_GPU: usize = 1024;
/// A GPU's UUID or model name, in bytes: NVML's buffers are 96 bytes.
pub const MAX_GPU_TEXT_BYTES: usize = 256;
/// A pod as `namespace/name`: a namespace has at most 63 bytes, a name 253.
pub const MAX_POD_KEY_BYTES: usize = 63 + 1 + 253;

/// GFD-compatible GPU labels plus gpumem's topology summary.
pub fn labels(inventory: &GpuInventory, mem_unit_mib: u64) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut put = |key: &str, value: String| {
        labels.insert(key.to_string(), value);
    };
    let gpus = &inventory.gpus;
    put("nvidia.com/gpu.count", gpus.len().to_string());
    if let Some(first) = gpus.first() {
        let homogeneous = gpus.iter().all(|g| g.product == first.product);
        // A node with several models cannot be described by one product label; the per-GPU models
        // are in the topology annotation, which the scorer filters by.
        let product = if homogeneous {
            label_value(&first.product)
        } else {
            "mixed".to_string()
        };
        put("nvidia.com/gpu.product", product);
        let smallest = gpus
            .iter()
            .map(|g| g.memory_mib)
            .min()
            .unwrap_or(first.memory_mib);
        put("nvidia.com/gpu.memory", smallest.to_string());
        let (major, minor) = gpus
            .iter()
            .map(|g| g.compute_capability)
            .min()
            .unwrap_or(first.compute_capability);
        put("nvidia.com/gpu.family", family(major, minor).to_string());
        put("nvidia.com/gpu.compute.major", major.to_string());
        put("nvidia.com/gpu.compute.minor", minor.to_string());
    }
    // GFD's cuda.driver.* labels carry the NVIDIA driver version, cuda.runtime.* the CUDA version.
    let mut driver = inventory.driver_version.split('.');
    if let (Some(major), Some(minor)) = (driver.next(), driver.next()) {
        put("nvidia.com/cuda.driver.major", label_value(major));
        put("nvidia.com/cuda.driver.minor", label_value(minor));
        put(
            "nvidia.com/cuda.driver.rev",
            label_value(driver.next().unwrap_or("")),
        );
    }
    put(
        "nvidia.com/cuda.runtime.major",
        inventory.cuda_version.0.to_string(),
    );
    put(
        "nvidia.com/cuda.runtime.minor",
        inventory.cuda_version.1.to_string(),
    );
    put("gpumem.io/numa-nodes", inventory.numa_nodes().len().to_string());
    put(
        "gpumem.io/pcie-switches",
        inventory.pcie_switch_groups().len().to_string(),
    );
    put(
        "gpumem.io/nvlink",
        inventory.nvlink_coverage().as_str().to_string(),
    );
    put("gpumem.io/mem-unit-mib", mem_unit_mib.to_string());
    labels
}

/// GPU architecture family from the compute capability, named as GFD names them.
pub fn family(major: u32, minor: u32) -> &'static str {
    match (major, minor) {
        (3, _) => "kepler",
        (5, _) => "maxwell",
        (6, _) => "pascal",
        (7, m) if m < 5 => "volta",
        (7, _) => "turing",
        (8, m) if m < 9 => "ampere",
        (8, _) => "ada-lovelace",
        (9, _) => "hopper",
        (10 | 12, _) => "blackwell",
        _ => "undefined",
    }
}

/// A Kubernetes label value: at most 63 characters of `[A-Za-z0-9._-]`, alphanumeric at both ends
/// (spaces become `-`, as GFD does: "NVIDIA A100-SXM4-80GB" -> "NVIDIA-A100-SXM4-80GB").
pub fn label_value(text: &str) -> String {
    let mapped: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    mapped
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}

/// Whether a GPU can take work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Health {
    Healthy,
    Unhealthy,
}

/// How a GPU is being used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuMode {
    /// Nothing allocated.
    Free,
    /// Memory units allocated to one or more pods.
    Shared,
    /// Allocated as a whole GPU to one pod.
    Whole,
}

/// `gpumem.io/gpu-topology`: what each GPU is and how it is wired.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TopologyAnnotation {
    pub version: u32,
    #[serde(rename = "memUnitMiB")]
    pub mem_unit_mib: u64,
    pub gpus: Vec<GpuTopology>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuTopology {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    pub numa_node: Option<u32>,
    pub pcie_switch: Option<u32>,
    pub nvlink_peers: Vec<NvLinkPeerJson>,
    pub health: Health,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvLinkPeerJson {
    pub index: u32,
    pub links: u32,
}

impl From<NvLinkPeer> for NvLinkPeerJson {
    fn from(peer: NvLinkPeer) -> Self {
        Self {
            index: peer.index,
            links: peer.links,
        }
    }
}

/// The pod name the usage annotation gives an allocation the kubelet made but has not listed yet (its
/// pod is not known until PodResources lists it).
pub const ALLOCATING_POD: &str = "(allocating)";

/// `gpumem.io/gpu-usage`: what is allocated on each GPU, and to whom.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsageAnnotation {
    pub version: u32,
    pub gpus: Vec<GpuUsage>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuUsage {
    pub index: u32,
    #[serde(rename = "allocatedMiB")]
    pub allocated_mib: u64,
    pub mode: GpuMode,
    /// `namespace/name` of each pod with an allocation here.
    pub pods: Vec<String>,
}

/// How far, in percent of a GPU's memory, a figure of [`UsedAnnotation`] moves before it is written again.
pub const USED_STEP_PERCENT: u64 = 1;

/// `gpumem.io/gpu-used`: what the processes of the pods on each GPU hold, which is at most what
/// [`UsageAnnotation`] says they were granted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsedAnnotation {
    pub version: u32,
    pub gpus: Vec<GpuUsed>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuUsed {
    pub index: u32,
    /// All of the GPU's pods together, MiB (rounded up: a byte held shows).
    #[serde(rename = "usedMiB")]
    pub used_mib: u64,
    /// MiB held, by `namespace/name` (each rounded up); only pods that hold some.
    pub pods: BTreeMap<String, u64>,
}

impl UsedAnnotation {
    /// From bytes held per GPU index and pod: every GPU of `inventory` listed, idle ones at 0.
    pub fn new(inventory: &GpuInventory, held: &BTreeMap<u32, BTreeMap<String, u64>>) -> Self {
        let mib = |bytes: u64| bytes.div_ceil(1 << 20);
        let gpus = inventory
            .gpus
            .iter()
            .map(|g| {
                let pods = held.get(&g.index);
                let total: u64 = pods.map_or(0, |p| p.values().fold(0u64, |a, &b| a.saturating_add(b)));
                GpuUsed {
                    index: g.index,
                    used_mib: mib(total),
                    pods: pods
                        .into_iter()
                        .flatten()
                        .filter(|&(_, &bytes)| bytes > 0)
                        .map(|(pod, &bytes)| (pod.clone(), mib(bytes)))
                        .collect(),
                }
            })
            .collect();
        Self {
            version: ANNOTATION_VERSION,
            gpus,
        }
    }

    /// Parses and checks an annotation someone (or something) wrote, with the bounds of the usage
    /// annotation.
    pub fn parse(json: &str) -> Result<Self, AnnotationError> {
        let key = USED_ANNOTATION;
        let parsed: Self = parse_versioned(key, json)?;
        at_most(key, "GPUs", parsed.gpus.len(), MAX_GPUS)?;
        for gpu in &parsed.gpus {
            let i = gpu.index;
            at_most(
                key,
                &format!("MiB used on GPU {i}"),
                gpu.used_mib,
                MAX_GPU_MEMORY_MIB,
            )?;
            at_most(key, &format!("pods on GPU {i}"), gpu.pods.len(), MAX_PODS_PER_GPU)?;
            if let Some(pod) = gpu.pods.keys().find(|p| p.len() > MAX_POD_KEY_BYTES) {
                return Err(AnnotationError::Refused {
                    key,
                    message: format!(
                        "a pod on GPU {i} is named in {} bytes, at most {MAX_POD_KEY_BYTES} are accepted",
                        pod.len()
                    ),
                });
            }
        }
        Ok(parsed)
    }

    /// Whether `self` says something `before` did not: a pod that starts or stops holding memory,
    /// another set of GPUs, or a figure that moved by [`USED_STEP_PERCENT`] of its GPU's memory or more
    /// (`memory_mib` by GPU index). Smaller moves are not worth a Node update, which every watcher of
    /// Nodes receives.
    pub fn moved(&self, before: &Self, memory_mib: impl Fn(u32) -> u64) -> bool {
        if self.gpus.len() != before.gpus.len() {
            return true;
        }
        self.gpus.iter().zip(&before.gpus).any(|(now, was)| {
            let step = (memory_mib(now.index) * USED_STEP_PERCENT / 100).max(1);
            let far = |a: u64, b: u64| a.abs_diff(b) >= step;
            now.index != was.index
                || !now.pods.keys().eq(was.pods.keys())
                || far(now.used_mib, was.used_mib)
                || now.pods.values().zip(was.pods.values()).any(|(&a, &b)| far(a, b))
        })
    }

    /// As the agent writes it.
    pub fn to_json(&self) -> String {
        to_json(self)
    }
}

/// Whether the GPUs described by `after` have room those of `before` lacked: a GPU with less allocated, one
/// no longer held whole, one healthy again, or one not there before (see [`ROOM_FREED_LABEL`]). Also, for
/// the scorer, a GPU whose unnamed allocation ([`ALLOCATING_POD`]) now has its pod's name: until then
/// the scorer counts that pod twice, in the annotation and in the reservation its bind made, which it
/// drops only once the annotation names the pod. Without a label change kube-scheduler would not
/// retry the pods refused meanwhile for a minute or more.
pub fn room_grew(
    before: (&TopologyAnnotation, &UsageAnnotation),
    after: (&TopologyAnnotation, &UsageAnnotation),
) -> bool {
    let healthy = |t: &TopologyAnnotation, index: u32| {
        t.gpus
            .iter()
            .find(|g| g.index == index)
            .is_some_and(|g| g.health == Health::Healthy)
    };
    after.1.gpus.iter().any(|now| {
        let Some(was) = before.1.gpus.iter().find(|g| g.index == now.index) else {
            return true;
        };
        let named = || {
            was.pods.iter().any(|p| p == ALLOCATING_POD)
                && now
                    .pods
                    .iter()
                    .any(|p| p != ALLOCATING_POD && !was.pods.contains(p))
        };
        now.allocated_mib < was.allocated_mib
            || (was.mode == GpuMode::Whole && now.mode != GpuMode::Whole)
            || named()
            || (healthy(after.0, now.index) && !healthy(before.0, now.index))
    })
}

impl TopologyAnnotation {
    /// The topology of `inventory`; `healthy(position)` tells each GPU's health.
    pub fn new(inventory: &GpuInventory, mem_unit_mib: u64, healthy: impl Fn(usize) -> bool) -> Self {
        let gpus = inventory
            .gpus
            .iter()
            .enumerate()
            .map(|(a, gpu)| GpuTopology {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                model: gpu.product.clone(),
                memory_mib: gpu.memory_mib,
                numa_node: gpu.numa_node,
                pcie_switch: inventory.pcie_switch(a),
                nvlink_peers: inventory.nvlink_peers(a).into_iter().map(Into::into).collect(),
                health: if healthy(a) {
                    Health::Healthy
                } else {
                    Health::Unhealthy
                },
            })
            .collect();
        Self {
            version: ANNOTATION_VERSION,
            mem_unit_mib,
            gpus,
        }
    }

    /// Parses and checks an annotation someone (or something) wrote; the error says what is wrong,
    /// including a claim beyond the bounds above ([`AnnotationError::Refused`]).
    pub fn parse(json: &str) -> Result<Self, AnnotationError> {
        let key = TOPOLOGY_ANNOTATION;
        let parsed: Self = parse_versioned(key, json)?;
        at_most(key, "GPUs", parsed.gpus.len(), MAX_GPUS)?;
        let mut seen = std::collections::BTreeSet::new();
        for gpu in &parsed.gpus {
            let i = gpu.index;
            if !seen.insert(i) {
                return Err(AnnotationError::invalid(key, format!("GPU {i} twice")));
            }
            at_most(
                key,
                &format!("MiB on GPU {i}"),
                gpu.memory_mib,
                MAX_GPU_MEMORY_MIB,
            )?;
            at_most(
                key,
                &format!("bytes of GPU {i}'s uuid"),
                gpu.uuid.len(),
                MAX_GPU_TEXT_BYTES,
            )?;
            at_most(
                key,
                &format!("bytes of GPU {i}'s model"),
                gpu.model.len(),
                MAX_GPU_TEXT_BYTES,
            )?;
            // Peers are other GPUs of the node, each once: so at most MAX_GPUS - 1 of them.
            let mut peers = std::collections::BTreeSet::new();
            for peer in &gpu.nvlink_peers {
                if peer.index == i || !peers.insert(peer.index) {
                    return Err(AnnotationError::invalid(
                        key,
                        format!("GPU {i} lists NVLink peer {} twice or itself", peer.index),
                    ));
                }
                at_most(
                    key,
                    &format!("NVLink links from GPU {i} to GPU {}", peer.index),
                    peer.links,
                    MAX_NVLINK_LINKS,
                )?;
            }
        }
        if parsed.mem_unit_mib == 0 {
            return Err(AnnotationError::invalid(key, "memUnitMiB is 0".into()));
        }
        at_most(
            key,
            "MiB per memory unit",
            parsed.mem_unit_mib,
            MAX_GPU_MEMORY_MIB,
        )?;
        Ok(parsed)
    }
}

impl UsageAnnotation {
    /// Every GPU of `inventory` free.
    pub fn idle(inventory: &GpuInventory) -> Self {
        let gpus = inventory
            .gpus
            .iter()
            .map(|g| GpuUsage {
                index: g.index,
                allocated_mib: 0,
                mode: GpuMode::Free,
                pods: Vec::new(),
            })
            .collect();
        Self {
            version: ANNOTATION_VERSION,
            gpus,
        }
    }

    /// Parses and checks an annotation someone (or something) wrote; the error says what is wrong,
    /// including a claim beyond the bounds above ([`AnnotationError::Refused`]).
    pub fn parse(json: &str) -> Result<Self, AnnotationError> {
        let key = USAGE_ANNOTATION;
        let parsed: Self = parse_versioned(key, json)?;
        at_most(key, "GPUs", parsed.gpus.len(), MAX_GPUS)?;
        for gpu in &parsed.gpus {
            let i = gpu.index;
            at_most(
                key,
                &format!("MiB allocated on GPU {i}"),
                gpu.allocated_mib,
                MAX_GPU_MEMORY_MIB,
            )?;
            at_most(key, &format!("pods on GPU {i}"), gpu.pods.len(), MAX_PODS_PER_GPU)?;
            if let Some(pod) = gpu.pods.iter().find(|p| p.len() > MAX_POD_KEY_BYTES) {
                return Err(AnnotationError::Refused {
                    key,
                    message: format!(
                        "a pod on GPU {i} is named in {} bytes, at most {MAX_POD_KEY_BYTES} are accepted",
                        pod.len()
                    ),
                });
            }
        }
        Ok(parsed)
    }
}

/// `Err(Refused)` when the annotation claims more `what` than `max`.
fn at_most<T: PartialOrd + std::fmt::Display>(
    key: &'static str,
    what: &str,
    claimed: T,
    max: T,
) -> Result<(), AnnotationError> {
    if claimed > max {
        return Err(AnnotationError::Refused {
            key,
            message: format!("{claimed} {what}, at most {max} are accepted"),
        });
    }
    Ok(())
}

/// Why an annotation cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AnnotationError {
    #[error("annotation {key} is not valid JSON for gpumem: {message}")]
    Malformed { key: &'static str, message: String },
    #[error("annotation {key} has version {found}, this gpumem reads version {ANNOTATION_VERSION}")]
    Version { key: &'static str, found: String },
    #[error("annotation {key} is inconsistent: {message}")]
    Invalid { key: &'static str, message: String },
    /// Beyond what any real node has (see [`MAX_GPUS`] and the other bounds): the node is not believed.
    #[error("annotation {key} is refused: {message}")]
    Refused { key: &'static str, message: String },
}

impl AnnotationError {
    fn invalid(key: &'static str, message: String) -> Self {
        Self::Invalid { key, message }
    }
}

fn parse_versioned<T: serde::de::DeserializeOwned>(
    key: &'static str,
    json: &str,
) -> Result<T, AnnotationError> {
    // No real annotation is this long; parsing one would cost memory in proportion.
    at_most(key, "bytes of annotation", json.len(), MAX_ANNOTATION_BYTES)?;
    // Check the version first, so that a future schema is reported as such rather than as garbage.
    let value: serde_json::Value = serde_json::from_str(json).map_err(|e| AnnotationError::Malformed {
        key,
        message: e.to_string(),
    })?;
    match value.get("version") {
        Some(v) if v.as_u64() == Some(u64::from(ANNOTATION_VERSION)) => {}
        Some(v) => {
            return Err(AnnotationError::Version {
                key,
                found: v.to_string(),
            });
        }
        None => {
            return Err(AnnotationError::Version {
                key,
                found: "none".into(),
            });
        }
    }
    serde_json::from_value(value).map_err(|e| AnnotationError::Malformed {
        key,
        message: e.to_string(),
    })
}

/// Both annotations, serialized as the agent writes them.
pub fn annotations(topology: &TopologyAnnotation, usage: &UsageAnnotation) -> BTreeMap<String, String> {
    BTreeMap::from([
        (TOPOLOGY_ANNOTATION.to_string(), to_json(topology)),
        (USAGE_ANNOTATION.to_string(), to_json(usage)),
    ])
}

fn to_json<T: Serialize>(value: &T) -> String {
    // Plain structs with string keys always serialize; an empty object is the harmless fallback.
    serde_json::to_string(value).unwrap_or_else(|_| "{}".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_profile::Profile;

    fn inventory(name: &str) -> GpuInventory {
        GpuInventory::discover(&Profile::load(name).unwrap()).unwrap()
    }

    #[test]
    fn dgx_a100_labels_match_gfd_and_summarize_topology() {
        let labels = labels(&inventory("dgx-a100"), 4);
        let get = |k: &str| labels.get(k).map(String::as_str);
        assert_eq!(get("nvidia.com/gpu.product"), Some("NVIDIA-A100-SXM4-80GB"));
        assert_eq!(get("nvidia.com/gpu.count"), Some("8"));
        assert_eq!(get("nvidia.com/gpu.memory"), Some("81920"));
        assert_eq!(get("nvidia.com/gpu.family"), Some("ampere"));
        assert_eq!(get("nvidia.com/gpu.compute.major"), Some("8"));
        assert_eq!(get("nvidia.com/cuda.driver.major"), Some("550"));
        assert_eq!(get("nvidia.com/cuda.driver.rev"), Some("07"));
        assert_eq!(get("nvidia.com/cuda.runtime.minor"), Some("4"));
        assert_eq!(get("gpumem.io/numa-nodes"), Some("2"));
        assert_eq!(get("gpumem.io/pcie-switches"), Some("4"));
        assert_eq!(get("gpumem.io/nvlink"), Some("all-to-all"));
        assert_eq!(get("gpumem.io/mem-unit-mib"), Some("4"));
    }

    #[test]
    fn the_used_annotation_rounds_up_lists_every_gpu_and_refuses_hand_edits() {
        let inv = inventory("t4x4");
        let held = BTreeMap::from([(
            1,
            BTreeMap::from([
                ("ns/a".to_string(), 3000 << 20),
                ("ns/b".to_string(), 1),
                ("ns/idle".to_string(), 0),
            ]),
        )]);
        let used = UsedAnnotation::new(&inv, &held);
        assert_eq!(used.gpus.len(), 4, "idle GPUs are listed at 0");
        assert_eq!(used.gpus[0].used_mib, 0);
        assert_eq!(used.gpus[1].used_mib, 3001, "one byte held shows as a MiB");
        assert_eq!(
            used.gpus[1].pods,
            BTreeMap::from([("ns/a".to_string(), 3000), ("ns/b".to_string(), 1)]),
            "a pod holding nothing is left out"
        );
        let json = used.to_json();
        assert!(
            json.contains(r#""usedMiB":3001,"pods":{"ns/a":3000,"ns/b":1}"#),
            "{json}"
        );
        assert_eq!(UsedAnnotation::parse(&json).unwrap(), used);

        let memory = |_| 15360;
        let mut nudged = used.clone();
        nudged.gpus[1].used_mib += 100;
        *nudged.gpus[1].pods.get_mut("ns/a").unwrap() += 100;
        assert!(!nudged.moved(&used, memory), "100 MiB of 15360 is under the step");
        nudged.gpus[1].used_mib += 100;
        assert!(nudged.moved(&used, memory), "200 MiB is over it");
        let mut left = used.clone();
        left.gpus[1].pods.remove("ns/b");
        assert!(
            left.moved(&used, memory),
            "a pod that stops holding memory always counts"
        );

        let unknown = json.replacen("\"usedMiB\"", "\"grantedMiB\":1,\"usedMiB\"", 1);
        assert!(matches!(
            UsedAnnotation::parse(&unknown),
            Err(AnnotationError::Malformed { .. })
        ));
        let huge = json.replacen("3001", &(MAX_GPU_MEMORY_MIB + 1).to_string(), 1);
        let err = UsedAnnotation::parse(&huge).unwrap_err();
        assert!(
            matches!(
                err,
                AnnotationError::Refused {
                    key: USED_ANNOTATION,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_mixed_node_does_not_claim_one_product() {
        let labels = labels(&inventory("mixed"), 1);
        assert_eq!(labels["nvidia.com/gpu.product"], "mixed");
        assert_eq!(labels["nvidia.com/gpu.memory"], "15360");
        assert_eq!(labels["nvidia.com/gpu.family"], "volta");
        assert_eq!(labels["gpumem.io/nvlink"], "partial");
    }

    #[test]
    fn label_values_are_valid() {
        assert_eq!(label_value("Tesla T4"), "Tesla-T4");
        assert_eq!(label_value(" (weird) name! "), "weird--name");
        assert_eq!(label_value(&"x".repeat(80)).len(), 63);
    }

    #[test]
    fn annotations_round_trip_and_reject_hand_edits() {
        let inv = inventory("dgx-a100");
        let topology = TopologyAnnotation::new(&inv, 1, |a| a != 3);
        let usage = UsageAnnotation::idle(&inv);
        let written = annotations(&topology, &usage);
        let back = TopologyAnnotation::parse(&written[TOPOLOGY_ANNOTATION]).unwrap();
        assert_eq!(back, topology);
        assert_eq!(back.gpus[3].health, Health::Unhealthy);
        assert_eq!(back.gpus[0].nvlink_peers.len(), 7);
        assert_eq!(UsageAnnotation::parse(&written[USAGE_ANNOTATION]).unwrap(), usage);

        let future = written[TOPOLOGY_ANNOTATION].replacen("\"version\":1", "\"version\":2", 1);
        assert!(matches!(
            TopologyAnnotation::parse(&future),
            Err(AnnotationError::Version { .. })
        ));
        assert!(matches!(
            TopologyAnnotation::parse("{not json"),
            Err(AnnotationError::Malformed { .. })
        ));
        let typo = written[USAGE_ANNOTATION].replacen("allocatedMiB", "allocatedMB", 1);
        assert!(matches!(
            UsageAnnotation::parse(&typo),
            Err(AnnotationError::Malformed { .. })
        ));
        let twice = r#"{"version":1,"memUnitMiB":1,"gpus":[
            {"index":0,"uuid":"a","model":"m","memoryMiB":1,"numaNode":null,"pcieSwitch":null,"nvlinkPeers":[],"health":"Healthy"},
            {"index":0,"uuid":"b","model":"m","memoryMiB":1,"numaNode":null,"pcieSwitch":null,"nvlinkPeers":[],"health":"Healthy"}]}"#;
        assert!(matches!(
            TopologyAnnotation::parse(twice),
            Err(AnnotationError::Invalid { .. })
        ));
    }

    /// A topology annotation of `n` healthy GPUs of `memory` MiB, each NVLinked to every other one
    /// with `links` links, as JSON.
    fn topology_json(n: u32, memory: u64, links: u32) -> String {
        let gpus = (0..n)
            .map(|i| GpuTopology {
                index: i,
                uuid: format!("GPU-{i}"),
                model: "NVIDIA H200".into(),
                memory_mib: memory,
                numa_node: Some(0),
                pcie_switch: None,
                nvlink_peers: (0..n)
                    .filter(|&p| p != i)
                    .map(|index| NvLinkPeerJson { index, links })
                    .collect(),
                health: Health::Healthy,
            })
            .collect();
        to_json(&TopologyAnnotation {
            version: ANNOTATION_VERSION,
            mem_unit_mib: 1,
            gpus,
        })
    }

    fn usage_json(n: u32, allocated: u64, pods: Vec<String>) -> String {
        let gpus = (0..n)
            .map(|index| GpuUsage {
                index,
                allocated_mib: allocated,
                mode: GpuMode::Shared,
                pods: pods.clone(),
            })
            .collect();
        to_json(&UsageAnnotation {
            version: ANNOTATION_VERSION,
            gpus,
        })
    }

    /// The refusal's message, or a panic naming what came instead.
    fn refused<T: std::fmt::Debug>(parsed: Result<T, AnnotationError>) -> String {
        match parsed {
            Err(e @ AnnotationError::Refused { .. }) => e.to_string(),
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn annotations_claiming_more_than_any_node_has_are_refused() {
        // At the bounds: accepted.
        let full = TopologyAnnotation::parse(&topology_json(64, MAX_GPU_MEMORY_MIB, MAX_NVLINK_LINKS))
            .expect("64 GPUs of 1 TiB, fully NVLinked");
        assert_eq!(full.gpus.len(), MAX_GPUS);
        UsageAnnotation::parse(&usage_json(64, MAX_GPU_MEMORY_MIB, Vec::new())).expect("at the bounds");
        let pods = (0..MAX_PODS_PER_GPU).map(|p| format!("ns/p-{p}")).collect();
        UsageAnnotation::parse(&usage_json(1, 1, pods)).expect("at the bounds");
        let longest = vec!["n".repeat(63) + "/" + &"p".repeat(253)];
        UsageAnnotation::parse(&usage_json(1, 1, longest)).expect("at the bounds");

        // One past each bound: refused, saying what and how much.
        let message = refused(TopologyAnnotation::parse(&topology_json(65, 81920, 1)));
        assert_eq!(
            message,
            "annotation gpumem.io/gpu-topology is refused: 65 GPUs, at most 64 are accepted"
        );
        let message = refused(TopologyAnnotation::parse(&topology_json(2, u64::MAX, 1)));
        assert!(
            message.contains(&format!("{} MiB on GPU 0, at most 1048576", u64::MAX)),
            "{message}"
        );
        let message = refused(TopologyAnnotation::parse(&topology_json(2, 81920, 65)));
        assert!(
            message.contains("65 NVLink links from GPU 0 to GPU 1"),
            "{message}"
        );
        let message = refused(UsageAnnotation::parse(&usage_json(65, 0, Vec::new())));
        assert!(
            message.starts_with("annotation gpumem.io/gpu-usage is refused: 65 GPUs"),
            "{message}"
        );
        let message = refused(UsageAnnotation::parse(&usage_json(1, u64::MAX, Vec::new())));
        assert!(message.contains("MiB allocated on GPU 0"), "{message}");
        let crowded = vec!["ns/p".to_string(); MAX_PODS_PER_GPU + 1];
        let message = refused(UsageAnnotation::parse(&usage_json(1, 1, crowded)));
        assert!(message.contains("1025 pods on GPU 0"), "{message}");
        let long = vec!["n".repeat(MAX_POD_KEY_BYTES + 1)];
        let message = refused(UsageAnnotation::parse(&usage_json(1, 1, long)));
        assert!(
            message.contains("a pod on GPU 0 is named in 318 bytes"),
            "{message}"
        );

        let mut topology = TopologyAnnotation::parse(&topology_json(2, 81920, 1)).expect("valid");
        topology.gpus[1].model = "m".repeat(MAX_GPU_TEXT_BYTES + 1);
        let message = refused(TopologyAnnotation::parse(&to_json(&topology)));
        assert!(message.contains("257 bytes of GPU 1's model"), "{message}");
        topology.gpus[1].model = "m".into();
        topology.gpus[0].uuid = "u".repeat(MAX_GPU_TEXT_BYTES + 1);
        assert!(refused(TopologyAnnotation::parse(&to_json(&topology))).contains("GPU 0's uuid"));
        topology.gpus[0].uuid = "GPU-0".into();
        topology.mem_unit_mib = MAX_GPU_MEMORY_MIB + 1;
        assert!(refused(TopologyAnnotation::parse(&to_json(&topology))).contains("MiB per memory unit"));

        // Longer than the API server stores, whatever it holds: refused before it is parsed.
        let padded = format!("{}{}", " ".repeat(MAX_ANNOTATION_BYTES), topology_json(1, 1, 1));
        assert!(refused(TopologyAnnotation::parse(&padded)).contains("bytes of annotation"));
        assert!(refused(UsageAnnotation::parse(&padded)).contains("bytes of annotation"));
    }

    #[test]
    fn nvlink_peers_are_other_gpus_each_listed_once() {
        let mut topology = TopologyAnnotation::parse(&topology_json(3, 81920, 2)).expect("valid");
        topology.gpus[0]
            .nvlink_peers
            .push(NvLinkPeerJson { index: 1, links: 2 });
        let twice = TopologyAnnotation::parse(&to_json(&topology));
        assert!(
            matches!(&twice, Err(AnnotationError::Invalid { message, .. }) if message.contains("GPU 0 lists NVLink peer 1")),
            "{twice:?}"
        );
        topology.gpus[0].nvlink_peers = vec![NvLinkPeerJson { index: 0, links: 2 }];
        assert!(matches!(
            TopologyAnnotation::parse(&to_json(&topology)),
            Err(AnnotationError::Invalid { .. })
        ));
    }

    #[test]
    fn room_grows_when_memory_frees_a_whole_gpu_ends_or_a_gpu_recovers() {
        let inv = inventory("t4x4");
        let healthy = TopologyAnnotation::new(&inv, 1, |_| true);
        let sick = TopologyAnnotation::new(&inv, 1, |a| a != 2);
        let idle = UsageAnnotation::idle(&inv);
        let mut shared = idle.clone();
        shared.gpus[1].allocated_mib = 9000;
        shared.gpus[1].mode = GpuMode::Shared;
        let mut more = shared.clone();
        more.gpus[1].allocated_mib = 12400;
        let mut whole = idle.clone();
        whole.gpus[0].allocated_mib = whole.gpus[0].allocated_mib.max(15360);
        whole.gpus[0].mode = GpuMode::Whole;

        assert!(
            !room_grew((&healthy, &idle), (&healthy, &idle)),
            "nothing changed"
        );
        assert!(
            !room_grew((&healthy, &shared), (&healthy, &more)),
            "more allocated"
        );
        assert!(
            room_grew((&healthy, &more), (&healthy, &shared)),
            "memory freed on a GPU still shared"
        );
        assert!(
            room_grew((&healthy, &whole), (&healthy, &idle)),
            "a whole GPU given back"
        );
        assert!(!room_grew((&healthy, &idle), (&sick, &idle)), "a GPU turned sick");
        assert!(
            room_grew((&sick, &idle), (&healthy, &idle)),
            "a GPU healthy again"
        );
        let mut fewer = idle.clone();
        fewer.gpus.pop();
        assert!(
            room_grew((&healthy, &fewer), (&healthy, &idle)),
            "a GPU that was not there"
        );
        // The kubelet's allocation gets its pod's name: same memory, but the scorer stops counting
        // it twice.
        let mut allocating = shared.clone();
        allocating.gpus[1].pods = vec![ALLOCATING_POD.into()];
        let mut named = shared.clone();
        named.gpus[1].pods = vec!["team-a/p".into()];
        assert!(
            room_grew((&healthy, &allocating), (&healthy, &named)),
            "an allocation named"
        );
        assert!(
            !room_grew((&healthy, &named), (&healthy, &allocating)),
            "an allocation not yet named"
        );
        let mut both = more.clone();
        both.gpus[1].pods = vec![ALLOCATING_POD.into(), "team-a/p".into()];
        assert!(
            !room_grew((&healthy, &named), (&healthy, &both)),
            "another allocation begins beside a named one"
        );
    }
}
