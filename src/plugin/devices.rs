//! The device lists the agent advertises in ListAndWatch, and whether they fit the kubelet's limit.
//!
//! `nvidia.com/gpu` has one device per GPU (ID = UUID). `nvidia.com/gpu-mem` has one device per memory
//! unit, IDs `<gpu index>-<n>`, or, when the kubelet counts memory per node (`memCounting: shares`),
//! none: `gpumem.io/gpu-share` then has a few share slots per GPU, IDs `<gpu index>-s<n>`. All carry
//! the GPU's NUMA node as topology, which is what the kubelet's Topology Manager aligns on.

use prost::Message;

use super::proto::v1beta1::{Device, ListAndWatchResponse, NumaNode, TopologyInfo};
use super::proto::{HEALTHY, KUBELET_MAX_RECV_BYTES, UNHEALTHY};
use crate::gpu::GpuInventory;

/// Whole GPUs.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// GPU memory, in units of `memUnitMiB`.
pub const MEM_RESOURCE: &str = "nvidia.com/gpu-mem";
/// One container's share of one GPU (`memCounting: shares`): the one device the kubelet lists for a
/// container asking `nvidia.com/gpu-mem`.
pub const SHARE_RESOURCE: &str = "gpumem.io/gpu-share";

fn topology(numa_node: Option<u32>) -> Option<TopologyInfo> {
    numa_node.map(|id| TopologyInfo {
        nodes: vec![NumaNode { id: i64::from(id) }],
    })
}

fn health(healthy: bool) -> String {
    if healthy { HEALTHY } else { UNHEALTHY }.to_string()
}

/// The ID of memory unit `n` of GPU `gpu_index`.
pub fn mem_unit_id(gpu_index: u32, n: u64) -> String {
    format!("{gpu_index}-{n}")
}

/// The ID of share slot `n` of GPU `gpu_index`.
pub fn share_id(gpu_index: u32, n: u32) -> String {
    format!("{gpu_index}-s{n}")
}

/// `<gpu index>-s<n>` → (gpu index, slot).
pub fn parse_share_id(id: &str) -> Option<(u32, u32)> {
    let (gpu, slot) = id.split_once("-s")?;
    Some((gpu.parse().ok()?, slot.parse().ok()?))
}

/// `gpumem.io/gpu-share` devices, `per_gpu` slots per GPU; `healthy(position)` tells each GPU's state.
pub fn share_devices(inventory: &GpuInventory, per_gpu: u32, healthy: impl Fn(usize) -> bool) -> Vec<Device> {
    let mut devices = Vec::new();
    for (a, gpu) in inventory.gpus.iter().enumerate() {
        let (state, topo) = (health(healthy(a)), topology(gpu.numa_node));
        devices.extend((0..per_gpu).map(|n| Device {
            id: share_id(gpu.index, n),
            health: state.clone(),
            topology: topo.clone(),
        }));
    }
    devices
}

/// How many whole units of `unit_mib` a GPU of `memory_mib` offers (a remainder is not advertised).
pub fn units_per_gpu(memory_mib: u64, unit_mib: u64) -> u64 {
    memory_mib.checked_div(unit_mib).unwrap_or(0)
}

/// `nvidia.com/gpu` devices; `healthy(position)` tells each GPU's state.
pub fn gpu_devices(inventory: &GpuInventory, healthy: impl Fn(usize) -> bool) -> Vec<Device> {
    inventory
        .gpus
        .iter()
        .enumerate()
        .map(|(a, gpu)| Device {
            id: gpu.uuid.clone(),
            health: health(healthy(a)),
            topology: topology(gpu.numa_node),
        })
        .collect()
}

/// `nvidia.com/gpu-mem` devices at `unit_mib`; `healthy(position)` tells each GPU's units' state.
pub fn mem_devices(inventory: &GpuInventory, unit_mib: u64, healthy: impl Fn(usize) -> bool) -> Vec<Device> {
    let mut devices = Vec::new();
    for (a, gpu) in inventory.gpus.iter().enumerate() {
        let (state, topo) = (health(healthy(a)), topology(gpu.numa_node));
        for n in 0..units_per_gpu(gpu.memory_mib, unit_mib) {
            devices.push(Device {
                id: mem_unit_id(gpu.index, n),
                health: state.clone(),
                topology: topo.clone(),
            });
        }
    }
    devices
}

/// Encoded bytes of one ListAndWatch response for `nvidia.com/gpu-mem` at `unit_mib`, in the worst case
/// (every unit Unhealthy, the longer state word), computed without building the list.
pub fn mem_list_bytes(inventory: &GpuInventory, unit_mib: u64) -> usize {
    let mut total = 0;
    for gpu in &inventory.gpus {
        let count = units_per_gpu(gpu.memory_mib, unit_mib);
        let prefix = decimal_digits(u64::from(gpu.index)) + 1;
        // Unit numbers with d digits: [10^(d-1), 10^d), and 0 with one digit.
        let (mut low, mut digits) = (0u64, 1usize);
        while low < count {
            let high = 10u64.saturating_pow(digits as u32).min(count);
            total += (high - low) as usize * device_entry_bytes(prefix + digits, gpu.numa_node);
            low = high;
            digits += 1;
        }
    }
    total
}

/// Bytes one `devices` entry takes in a ListAndWatchResponse: key, length, and the Device itself.
fn device_entry_bytes(id_len: usize, numa_node: Option<u32>) -> usize {
    let device = Device {
        id: "0".repeat(id_len),
        health: UNHEALTHY.to_string(),
        topology: topology(numa_node),
    };
    let len = device.encoded_len();
    1 + prost::length_delimiter_len(len) + len
}

fn decimal_digits(mut n: u64) -> usize {
    let mut digits = 1;
    while n >= 10 {
        n /= 10;
        digits += 1;
    }
    digits
}

/// The smallest memory unit (MiB) at which one gpu-mem ListAndWatch response fits the kubelet's
/// receive limit, or None if not even one unit per GPU fits.
pub fn smallest_fitting_unit(inventory: &GpuInventory) -> Option<u64> {
    let largest = inventory.gpus.iter().map(|g| g.memory_mib).max()?;
    let fits = |unit: u64| mem_list_bytes(inventory, unit) <= KUBELET_MAX_RECV_BYTES;
    if !fits(largest) {
        return None;
    }
    // Fewer, shorter IDs as the unit grows: the size never increases, so bisect.
    let (mut lo, mut hi) = (1u64, largest);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) { hi = mid } else { lo = mid + 1 }
    }
    Some(lo)
}

/// Bytes one listed device adds to a pod object on a kubelet that lists them
/// (`status.containerStatuses[].allocatedResourcesStatus`, and its managedFields entry): 2,039,585 bytes
/// for a pod of 12,000 units on the kit's 1.36 kubelet.
pub const POD_BYTES_PER_LISTED_DEVICE: u64 = 170;
/// The pod object size past which the agent warns: every watcher of pods carries it.
pub const POD_OBJECT_BUDGET: u64 = 64 * 1024;

/// What listing every memory unit in pod status costs on this node, when its kubelet does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedUnitsCost {
    /// Kubelet 1.36+: `ResourceHealthStatus` is on by default (alpha, off, in 1.31-1.35).
    pub listed: bool,
    /// The pod object of a pod holding the largest GPU's memory, in bytes (its listed units alone).
    pub whole_gpu_pod_bytes: u64,
    /// The smallest unit at which that pod stays within [`POD_OBJECT_BUDGET`].
    pub fitting_unit_mib: u64,
}

impl ListedUnitsCost {
    /// Whether the agent should warn: the kubelet lists units and a pod can pass the budget.
    pub fn too_costly(&self) -> bool {
        self.listed && self.whole_gpu_pod_bytes > POD_OBJECT_BUDGET
    }
}

/// The cost of the kubelet `kubelet_version` (`v1.36.2`, as the Node's `nodeInfo` says) listing units
/// of `unit_mib`; None when the inventory is empty or the version cannot be read.
pub fn listed_units_cost(
    inventory: &GpuInventory,
    unit_mib: u64,
    kubelet_version: &str,
) -> Option<ListedUnitsCost> {
    let largest = inventory.gpus.iter().map(|g| g.memory_mib).max()?;
    let mut parts = kubelet_version.trim_start_matches('v').split('.');
    let major: u64 = parts.next()?.parse().ok()?;
    let minor: u64 = parts
        .next()?
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .ok()?;
    let per_pod_units = POD_OBJECT_BUDGET / POD_BYTES_PER_LISTED_DEVICE;
    Some(ListedUnitsCost {
        listed: (major, minor) >= (1, 36),
        whole_gpu_pod_bytes: units_per_gpu(largest, unit_mib) * POD_BYTES_PER_LISTED_DEVICE,
        fitting_unit_mib: largest.div_ceil(per_pod_units).max(1),
    })
}

/// Encoded bytes of a ListAndWatch response carrying `devices`.
pub fn list_bytes(devices: Vec<Device>) -> usize {
    ListAndWatchResponse { devices }.encoded_len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_profile::Profile;

    fn inventory(name: &str) -> GpuInventory {
        GpuInventory::discover(&Profile::load(name).unwrap()).unwrap()
    }

    #[test]
    fn listed_units_cost_follows_the_kubelet_version_and_the_unit() {
        let t4 = inventory("t4x4");
        let cost = listed_units_cost(&t4, 1, "v1.36.2").unwrap();
        assert!(cost.listed && cost.too_costly());
        // 15,360 units of 170 bytes: 2.6 MB for a pod holding a whole T4.
        assert_eq!(cost.whole_gpu_pod_bytes, 15_360 * 170);
        // 385 units fit 64 KiB: 15,360 MiB / 385 = 39.9, so 40 MiB.
        assert_eq!(cost.fitting_unit_mib, 40);
        let coarse = listed_units_cost(&t4, cost.fitting_unit_mib, "v1.36.2").unwrap();
        assert!(!coarse.too_costly(), "{coarse:?}");
        assert!(
            !listed_units_cost(&t4, 1, "v1.35.3").unwrap().too_costly(),
            "the gate is off by default"
        );
        assert!(!listed_units_cost(&t4, 1, "v1.24.1").unwrap().listed);
        assert!(listed_units_cost(&t4, 1, "v1.40.0-rc.1+abc").unwrap().listed);
        assert!(listed_units_cost(&t4, 1, "v2").is_none());
        assert!(listed_units_cost(&t4, 1, "").is_none());
    }

    #[test]
    fn share_ids_round_trip_and_are_not_unit_ids() {
        let t4 = inventory("t4x4");
        let devices = share_devices(&t4, 3, |a| a != 1);
        assert_eq!(devices.len(), 12);
        assert_eq!(devices[4].id, "1-s1");
        assert_eq!(devices[4].health, UNHEALTHY);
        assert_eq!(devices[0].health, HEALTHY);
        assert_eq!(parse_share_id("12-s31"), Some((12, 31)));
        for not_a_share in ["0-17", "s1", "0-s", "-s1", "0-s-1", "0-sx"] {
            assert_eq!(parse_share_id(not_a_share), None, "{not_a_share}");
        }
    }

    #[test]
    fn computed_size_equals_the_encoded_message() {
        for (name, unit) in [("t4x4", 1), ("mixed", 3), ("dgx-a100", 64), ("hgx-h100", 7)] {
            let inv = inventory(name);
            let unhealthy = mem_devices(&inv, unit, |_| false);
            let expected = ListAndWatchResponse { devices: unhealthy }.encode_to_vec().len();
            assert_eq!(mem_list_bytes(&inv, unit), expected, "{name} at {unit} MiB");
            assert!(list_bytes(mem_devices(&inv, unit, |_| true)) < expected);
        }
    }

    #[test]
    fn dgx_a100_needs_a_larger_unit_and_t4x4_fits_at_one_mib() {
        let dgx = inventory("dgx-a100");
        assert!(mem_list_bytes(&dgx, 1) > KUBELET_MAX_RECV_BYTES);
        let unit = smallest_fitting_unit(&dgx).unwrap();
        assert!(unit > 1);
        assert!(mem_list_bytes(&dgx, unit) <= KUBELET_MAX_RECV_BYTES);
        assert!(mem_list_bytes(&dgx, unit - 1) > KUBELET_MAX_RECV_BYTES);
        assert_eq!(smallest_fitting_unit(&inventory("t4x4")), Some(1));
    }

    #[test]
    fn units_carry_gpu_index_health_and_numa_node() {
        let inv = inventory("t4x4");
        let devices = mem_devices(&inv, 1024, |a| a != 1);
        assert_eq!(devices.len(), 4 * 15);
        assert_eq!(devices[15].id, "1-0");
        assert_eq!(devices[15].health, UNHEALTHY);
        assert_eq!(devices[0].health, HEALTHY);
        assert_eq!(devices[59].topology.as_ref().unwrap().nodes[0].id, 1);
        let gpus = gpu_devices(&inv, |_| true);
        assert_eq!(gpus[2].id, inv.gpus[2].uuid);
    }
}
