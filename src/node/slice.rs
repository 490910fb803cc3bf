//! The node's ResourceSlice on the DRA path: one device per GPU whose memory is consumable capacity
//! (KEP-5075), rendered from the inventory as the labels and annotations are. Pure: the agent
//! publishes what this returns, the tests read it, `gpumem inspect` could print it.
//!
//! What kube-scheduler does with it: a claim asking `capacity.requests.memory: 5000Mi` gets ONE
//! device with 5000Mi left, rounded up to the unit (the request policy's step); a claim that asks
//! for no memory gets the policy's default, the whole GPU, so whole and shared use exclude each
//! other through the same accounting. A GPU that is not healthy is left out of the slice: the
//! scheduler allocates nothing new on it, while claims already allocated there keep their share.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity, ResourcePool,
    ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::gpu::GpuInventory;
use crate::plugin::devices::units_per_gpu;

/// The consumable capacity: GPU memory.
pub const MEMORY_CAPACITY: &str = "memory";
/// The standard attribute naming the PCIe root complex a device sits under.
pub const PCIE_ROOT_ATTRIBUTE: &str = "resource.kubernetes.io/pcieRoot";
/// Prefix of each GPU's device name (`gpu-<NVML index>`).
const DEVICE_PREFIX: &str = "gpu-";

/// The device name of the GPU with NVML index `index`.
pub fn device_name(index: u32) -> String {
    format!("{DEVICE_PREFIX}{index}")
}

/// The NVML index a device name names, if it is one of ours.
pub fn device_index(name: &str) -> Option<u32> {
    let digits = name.strip_prefix(DEVICE_PREFIX)?;
    if digits.is_empty() || digits.len() > 4 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The slice's name: one slice per node and driver.
pub fn slice_name(node: &str, driver: &str) -> String {
    format!("{node}-{driver}")
}

/// Who holds a claim, as the usage annotation lists it: `namespace/pod` of the first pod it is
/// reserved for, or `namespace/claim:<name>` before any is. The agent writes it, and the scorer's DRA
/// placement reads it to tell an allocation the annotation already counts from one it does not.
pub fn claim_holder(claim: &k8s_openapi::api::resource::v1::ResourceClaim) -> String {
    let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .and_then(|r| r.iter().find(|c| c.resource == "pods"))
        .map_or_else(
            || {
                format!(
                    "{namespace}/claim:{}",
                    claim.metadata.name.as_deref().unwrap_or_default()
                )
            },
            |p| format!("{namespace}/{}", p.name),
        )
}

/// One device of the driver in a claim's allocation, as the agent prepares it and the placer counts
/// it: read here once, so that both read a claim alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldDevice {
    /// The claim's request it serves (a prioritized list's result names `<request>/<subrequest>`: the
    /// request's part).
    pub request: String,
    /// The pool (the node) and the device name (`gpu-<index>`).
    pub pool: String,
    pub device: String,
    /// The NVML index the device name names; `None` for a name that is not one of ours.
    pub index: Option<u32>,
    pub share_id: Option<String>,
    /// The memory consumed, in whole MiB (rounded up); `Ok(None)`: no `consumedCapacity.memory`, the
    /// whole GPU; `Err`: a value that is not a quantity (the API server validates it; a hand edit).
    pub consumed_mib: Result<Option<u64>, String>,
}

/// The devices of `driver` that `claim`'s allocation holds (none when it is not allocated).
pub fn held_devices(claim: &k8s_openapi::api::resource::v1::ResourceClaim, driver: &str) -> Vec<HeldDevice> {
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default();
    results
        .iter()
        .filter(|r| r.driver == driver)
        .map(|r| HeldDevice {
            request: r.request.split('/').next().unwrap_or_default().to_string(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            index: device_index(&r.device),
            share_id: r.share_id.clone(),
            consumed_mib: match r.consumed_capacity.as_ref().and_then(|c| c.get(MEMORY_CAPACITY)) {
                None => Ok(None),
                Some(q) => crate::quantity::Quantity::parse(&q.0)
                    .and_then(|v| v.mib_ceil())
                    .map(Some)
                    .map_err(|e| format!("consumed memory {:?}: {e}", q.0)),
            },
        })
        .collect()
}

/// A whole number of MiB as a quantity, in the canonical form the API server stores (`15Gi`,
/// `15358Mi`), so that what is published compares equal to what is read back.
pub fn mib_quantity(mib: u64) -> Quantity {
    let text = format!("{mib}Mi");
    Quantity(crate::quantity::Quantity::parse(&text).map_or(text, |q| q.canonical()))
}

/// What the slice is made from besides the inventory.
pub struct SliceInputs<'a> {
    pub driver: &'a str,
    pub node: &'a str,
    pub unit_mib: u64,
    /// Per GPU position: healthy, so offered.
    pub healthy: &'a [bool],
    /// Per GPU position: its PCIe root (`pci0000:00`).
    pub pcie_roots: &'a [String],
    /// The pool's generation: higher than any earlier slice of this pool.
    pub generation: i64,
}

/// The slice's spec: the pool of this node, one device per healthy GPU.
pub fn resource_slice_spec(inventory: &GpuInventory, inputs: &SliceInputs) -> ResourceSliceSpec {
    let devices = (0..inventory.gpus.len())
        .filter(|&a| inputs.healthy.get(a).copied().unwrap_or(false))
        .map(|a| gpu_device(inventory, a, inputs))
        .collect();
    ResourceSliceSpec {
        driver: inputs.driver.to_string(),
        node_name: Some(inputs.node.to_string()),
        pool: ResourcePool {
            name: inputs.node.to_string(),
            generation: inputs.generation,
            resource_slice_count: 1,
        },
        devices: Some(devices),
        ..Default::default()
    }
}

/// The offered memory of GPU `a`: its whole units (the scheduler never hands out a partial unit).
pub fn offered_mib(inventory: &GpuInventory, a: usize, unit_mib: u64) -> u64 {
    units_per_gpu(inventory.gpus[a].memory_mib, unit_mib) * unit_mib
}

fn gpu_device(inventory: &GpuInventory, a: usize, inputs: &SliceInputs) -> Device {
    let gpu = &inventory.gpus[a];
    let whole = offered_mib(inventory, a, inputs.unit_mib);
    let unit = mib_quantity(inputs.unit_mib);
    let capacity = DeviceCapacity {
        value: mib_quantity(whole),
        request_policy: Some(CapacityRequestPolicy {
            // A claim that names no memory gets the whole GPU.
            default: Some(mib_quantity(whole)),
            valid_range: Some(CapacityRequestPolicyRange {
                min: unit.clone(),
                step: Some(unit),
                max: None,
            }),
            valid_values: None,
        }),
    };
    let mut attributes = BTreeMap::new();
    let mut put = |name: &str, value: DeviceAttribute| {
        attributes.insert(name.to_string(), value);
    };
    put("index", int(i64::from(gpu.index)));
    put("uuid", string(&gpu.uuid));
    put("productName", string(&gpu.product));
    put("memoryMiB", int(gpu.memory_mib as i64));
    let (major, minor) = gpu.compute_capability;
    put("computeCapability", version(&format!("{major}.{minor}.0")));
    put("architecture", string(crate::node::family(major, minor)));
    if let Some(v) = semver(&inventory.driver_version) {
        put("driverVersion", version(&v));
    }
    let (cuda_major, cuda_minor) = inventory.cuda_version;
    put(
        "cudaDriverVersion",
        version(&format!("{cuda_major}.{cuda_minor}.0")),
    );
    put("pciBusID", string(&gpu.pci_bus_id.to_lowercase()));
    if let Some(root) = inputs.pcie_roots.get(a) {
        put(PCIE_ROOT_ATTRIBUTE, string(root));
    }
    if let Some(numa) = gpu.numa_node {
        put("numaNode", int(i64::from(numa)));
    }
    if let Some(switch) = inventory.pcie_switch(a) {
        put("pcieSwitch", int(i64::from(switch)));
    }
    let peers = inventory.nvlink_peers(a);
    put("nvlinkPeers", int(peers.len() as i64));
    if let Some(domain) = nvlink_domain(inventory, a) {
        put("nvlinkDomain", string(&domain));
    }
    Device {
        name: device_name(gpu.index),
        allow_multiple_allocations: Some(true),
        attributes: Some(attributes),
        capacity: Some(BTreeMap::from([(MEMORY_CAPACITY.to_string(), capacity)])),
        ..Default::default()
    }
}

/// The NVLink domain of GPU `a`: the GPUs it reaches over NVLink, directly or through others, named
/// by the lowest index among them (`nvlink-0`). `matchAttribute: gpumem.io/nvlinkDomain` keeps a
/// multi-GPU claim on one NVLink island. None for a GPU without NVLink.
pub fn nvlink_domain(inventory: &GpuInventory, a: usize) -> Option<String> {
    let n = inventory.gpus.len();
    let mut seen = vec![false; n];
    let mut stack = vec![a];
    seen[a] = true;
    while let Some(x) = stack.pop() {
        for (y, seen_y) in seen.iter_mut().enumerate() {
            if !*seen_y && inventory.nvlink_links(x, y) > 0 {
                *seen_y = true;
                stack.push(y);
            }
        }
    }
    let island: Vec<u32> = (0..n)
        .filter(|&y| seen[y])
        .map(|y| inventory.gpus[y].index)
        .collect();
    (island.len() > 1).then(|| format!("nvlink-{}", island.iter().min().copied().unwrap_or(0)))
}

/// A driver version as semantic version: `535.104.05` → `535.104.5` (no leading zeros in semver),
/// `550.54` → `550.54.0`. None when it is not made of numbers.
fn semver(text: &str) -> Option<String> {
    let mut parts: Vec<u64> = text
        .split('.')
        .map(|p| p.parse::<u64>().ok())
        .collect::<Option<_>>()?;
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    parts.resize(3, 0);
    Some(format!("{}.{}.{}", parts[0], parts[1], parts[2]))
}

fn int(v: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(v),
        ..Default::default()
    }
}

fn string(v: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(v.to_string()),
        ..Default::default()
    }
}

fn version(v: &str) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(v.to_string()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inventory(profile: &str) -> GpuInventory {
        GpuInventory::discover(&gpumem_profile::Profile::load(profile).unwrap()).unwrap()
    }

    fn spec(inv: &GpuInventory, unit_mib: u64, healthy: &[bool]) -> ResourceSliceSpec {
        let roots = crate::gpu::pcie_roots(inv, None);
        resource_slice_spec(
            inv,
            &SliceInputs {
                driver: "gpumem.io",
                node: "n1",
                unit_mib,
                healthy,
                pcie_roots: &roots,
                generation: 3,
            },
        )
    }

    #[test]
    fn one_shareable_device_per_gpu_with_its_memory_as_capacity() {
        let inv = inventory("mixed");
        let spec = spec(&inv, 1, &[true; 4]);
        assert_eq!(spec.driver, "gpumem.io");
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        assert_eq!(
            (
                spec.pool.name.as_str(),
                spec.pool.generation,
                spec.pool.resource_slice_count
            ),
            ("n1", 3, 1)
        );
        let devices = spec.devices.unwrap();
        let names: Vec<_> = devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);
        let t4 = &devices[2];
        assert_eq!(t4.allow_multiple_allocations, Some(true));
        let memory = &t4.capacity.as_ref().unwrap()[MEMORY_CAPACITY];
        assert_eq!(memory.value.0, "15Gi");
        let policy = memory.request_policy.as_ref().unwrap();
        assert_eq!(
            policy.default.as_ref().unwrap().0,
            "15Gi",
            "no memory asked: the whole GPU"
        );
        let range = policy.valid_range.as_ref().unwrap();
        assert_eq!(
            (range.min.0.as_str(), range.step.as_ref().unwrap().0.as_str()),
            ("1Mi", "1Mi")
        );
        let attrs = t4.attributes.as_ref().unwrap();
        assert_eq!(attrs["productName"].string.as_deref(), Some("Tesla T4"));
        assert_eq!(attrs["uuid"].string.as_deref(), Some(inv.gpus[2].uuid.as_str()));
        assert_eq!(attrs["computeCapability"].version.as_deref(), Some("7.5.0"));
        assert_eq!(attrs["architecture"].string.as_deref(), Some("turing"));
        assert_eq!(attrs["memoryMiB"].int, Some(15360));
        assert!(
            attrs[PCIE_ROOT_ATTRIBUTE]
                .string
                .as_deref()
                .unwrap()
                .starts_with("pci")
        );
        assert!(attrs.len() < 32, "attributes and capacities: at most 32");
    }

    #[test]
    fn nvlink_islands_and_pcie_roots_follow_the_topology() {
        let inv = inventory("mixed");
        let devices = spec(&inv, 1, &[true; 4]).devices.unwrap();
        let attr = |d: usize, name: &str| devices[d].attributes.as_ref().unwrap().get(name).cloned();
        // GPUs 0 and 1 are NVLinked; the T4s have no NVLink.
        assert_eq!(
            attr(0, "nvlinkDomain").unwrap().string.as_deref(),
            Some("nvlink-0")
        );
        assert_eq!(
            attr(1, "nvlinkDomain").unwrap().string.as_deref(),
            Some("nvlink-0")
        );
        assert!(attr(2, "nvlinkDomain").is_none());
        assert_eq!(attr(0, "nvlinkPeers").unwrap().int, Some(1));
        assert_eq!(attr(3, "nvlinkPeers").unwrap().int, Some(0));
        let dgx = inventory("dgx-a100");
        let devices = spec(&dgx, 5, &[true; 8]).devices.unwrap();
        let domains: Vec<_> = devices
            .iter()
            .map(|d| {
                d.attributes.as_ref().unwrap()["nvlinkDomain"]
                    .string
                    .clone()
                    .unwrap()
            })
            .collect();
        assert!(domains.iter().all(|d| d == "nvlink-0"), "{domains:?}");
    }

    #[test]
    fn a_sick_gpu_is_left_out_and_units_round_the_capacity_down() {
        let inv = inventory("mixed");
        let devices = spec(&inv, 7, &[true, true, true, false]).devices.unwrap();
        assert_eq!(devices.len(), 3);
        assert!(devices.iter().all(|d| d.name != "gpu-3"));
        let memory = &devices[2].capacity.as_ref().unwrap()[MEMORY_CAPACITY];
        // 15360 MiB is 2194 units of 7 MiB (15358 MiB): a unit is never split.
        assert_eq!(memory.value.0, "15358Mi");
        assert_eq!(
            memory
                .request_policy
                .as_ref()
                .unwrap()
                .default
                .as_ref()
                .unwrap()
                .0,
            "15358Mi"
        );
    }

    #[test]
    fn device_names_round_trip_and_strangers_are_refused() {
        assert_eq!(device_index(&device_name(7)), Some(7));
        for bad in ["gpu-", "gpu-x", "gpu--1", "gpu-12345", "cpu-1", "gpu-1 "] {
            assert_eq!(device_index(bad), None, "{bad}");
        }
    }

    #[test]
    fn driver_versions_become_semver() {
        assert_eq!(semver("535.104.05").as_deref(), Some("535.104.5"));
        assert_eq!(semver("550.54").as_deref(), Some("550.54.0"));
        assert_eq!(semver("r550"), None);
        assert_eq!(semver("1.2.3.4"), None);
    }
}
