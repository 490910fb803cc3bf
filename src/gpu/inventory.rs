use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::{GpuError, GpuSource, TopologyLevel};

/// One GPU, as discovered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub minor_number: u32,
    pub product: String,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// NVML form: `DDDDDDDD:BB:DD.F`.
    pub pci_bus_id: String,
    pub numa_node: Option<u32>,
    pub compute_capability: (u32, u32),
}

/// An NVLink neighbour of a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct NvLinkPeer {
    pub index: u32,
    pub links: u32,
}

/// Everything gpumem knows about the GPUs of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInventory {
    pub driver_version: String,
    /// CUDA driver API version (major, minor).
    pub cuda_version: (u32, u32),
    pub gpus: Vec<GpuInfo>,
    /// `topology[a][b]`: PCIe relationship, `Internal` on the diagonal.
    topology: Vec<Vec<TopologyLevel>>,
    /// `nvlinks[a][b]`: NVLink links usable between GPUs a and b (0: none).
    nvlinks: Vec<Vec<u32>>,
    /// PCIe-switch group of each GPU (0-based, numbered by lowest GPU index), if it shares a switch.
    pcie_switch: Vec<Option<u32>>,
}

impl GpuInventory {
    /// Reads every fact from `source` and derives switch groups and NVLink peers.
    pub fn discover(source: &dyn GpuSource) -> Result<Self, GpuError> {
        let driver_version = source.driver_version()?;
        let cuda = source.cuda_version()?;
        if cuda <= 0 {
            return Err(GpuError::Unexpected {
                what: "CUDA driver version",
                value: cuda.to_string(),
            });
        }
        let cuda_version = ((cuda / 1000) as u32, ((cuda % 1000) / 10) as u32);
        let count = source.gpu_count()?;
        let gpus = (0..count).map(|i| source.gpu(i)).collect::<Result<Vec<_>, _>>()?;
        let n = gpus.len();

        let topology = (0..n as u32)
            .map(|a| {
                (0..n as u32)
                    .map(|b| {
                        if a == b {
                            Ok(TopologyLevel::Internal)
                        } else {
                            source.topology(a, b)
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;

        // NVLink: a link whose far end is another GPU joins that pair directly; a link into anything
        // else is an NVSwitch port, and two GPUs on the switch fabric talk over min(ports) links
        // (what `nvidia-smi topo -m` shows as NV12 on a DGX A100).
        let index_by_bus: BTreeMap<&str, usize> = gpus
            .iter()
            .enumerate()
            .map(|(i, g)| (g.pci_bus_id.as_str(), i))
            .collect();
        let mut nvlinks = vec![vec![0u32; n]; n];
        let mut switch_ports = vec![0u32; n];
        for (a, gpu) in gpus.iter().enumerate() {
            for end in source.nvlinks(gpu.index)? {
                let remote =
                    gpumem_profile::normalize_bus_id(&end.remote_bus_id).unwrap_or(end.remote_bus_id);
                match index_by_bus.get(remote.as_str()) {
                    Some(&b) if b != a => nvlinks[a][b] += 1,
                    Some(_) => {}
                    None => switch_ports[a] += 1,
                }
            }
        }
        for a in 0..n {
            for b in 0..n {
                if a != b {
                    // Each side counts the same direct links; take the smaller in case they disagree.
                    let direct = nvlinks[a][b].min(nvlinks[b][a]);
                    let fabric = switch_ports[a].min(switch_ports[b]);
                    nvlinks[a][b] = direct.max(fabric);
                }
            }
        }
        for (a, row) in nvlinks.iter_mut().enumerate() {
            row[a] = 0;
        }

        let pcie_switch = switch_groups(&topology);
        Ok(Self {
            driver_version,
            cuda_version,
            gpus,
            topology,
            nvlinks,
            pcie_switch,
        })
    }

    /// Each GPU's position in [`Self::gpus`], by UUID.
    pub fn positions_by_uuid(&self) -> std::collections::HashMap<String, usize> {
        self.gpus
            .iter()
            .enumerate()
            .map(|(a, g)| (g.uuid.clone(), a))
            .collect()
    }

    /// PCIe relationship of GPUs `a` and `b` (positions in [`Self::gpus`]).
    pub fn topology(&self, a: usize, b: usize) -> TopologyLevel {
        self.topology[a][b]
    }

    /// NVLink links between GPUs `a` and `b` (0: none).
    pub fn nvlink_links(&self, a: usize, b: usize) -> u32 {
        self.nvlinks[a][b]
    }

    /// NVLink neighbours of GPU `a`, by index.
    pub fn nvlink_peers(&self, a: usize) -> Vec<NvLinkPeer> {
        self.nvlinks[a]
            .iter()
            .enumerate()
            .filter(|&(_, &links)| links > 0)
            .map(|(b, &links)| NvLinkPeer {
                index: self.gpus[b].index,
                links,
            })
            .collect()
    }

    /// PCIe-switch group of GPU `a`, if it shares a switch with another GPU.
    pub fn pcie_switch(&self, a: usize) -> Option<u32> {
        self.pcie_switch[a]
    }

    /// The GPUs behind each PCIe switch, as positions in [`Self::gpus`].
    pub fn pcie_switch_groups(&self) -> Vec<Vec<usize>> {
        let mut groups: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (a, group) in self.pcie_switch.iter().enumerate() {
            if let Some(g) = group {
                groups.entry(*g).or_default().push(a);
            }
        }
        groups.into_values().collect()
    }

    /// The NUMA nodes GPUs are attached to.
    pub fn numa_nodes(&self) -> BTreeSet<u32> {
        self.gpus.iter().filter_map(|g| g.numa_node).collect()
    }

    /// Whether every pair of GPUs has NVLink, some pairs do, or none.
    pub fn nvlink_coverage(&self) -> NvLinkCoverage {
        let n = self.gpus.len();
        let pairs = n * n.saturating_sub(1);
        let linked = (0..n)
            .flat_map(|a| (0..n).map(move |b| (a, b)))
            .filter(|&(a, b)| self.nvlinks[a][b] > 0);
        match linked.count() {
            0 => NvLinkCoverage::None,
            c if c == pairs => NvLinkCoverage::AllToAll,
            _ => NvLinkCoverage::Partial,
        }
    }
}

/// How much of a node the NVLink fabric covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvLinkCoverage {
    None,
    Partial,
    AllToAll,
}

impl NvLinkCoverage {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Partial => "partial",
            Self::AllToAll => "all-to-all",
        }
    }
}

/// Groups GPUs that reach each other without crossing a host bridge (PIX/PXB, or one board).
fn switch_groups(topology: &[Vec<TopologyLevel>]) -> Vec<Option<u32>> {
    let n = topology.len();
    let mut group: Vec<Option<u32>> = vec![None; n];
    let mut next = 0;
    for a in 0..n {
        if group[a].is_some() {
            continue;
        }
        let members: Vec<usize> = (a + 1..n)
            .filter(|&b| topology[a][b] <= TopologyLevel::Multiple && group[b].is_none())
            .collect();
        if members.is_empty() {
            continue;
        }
        group[a] = Some(next);
        for b in members {
            group[b] = Some(next);
        }
        next += 1;
    }
    group
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_profile::Profile;

    fn inventory(name: &str) -> GpuInventory {
        GpuInventory::discover(&Profile::load(name).unwrap()).unwrap()
    }

    #[test]
    fn dgx_a100_has_four_switch_pairs_two_numa_nodes_and_nvlink_everywhere() {
        let inv = inventory("dgx-a100");
        assert_eq!(inv.gpus.len(), 8);
        let uuids: BTreeSet<_> = inv.gpus.iter().map(|g| &g.uuid).collect();
        assert_eq!(uuids.len(), 8);
        assert_eq!(inv.numa_nodes(), BTreeSet::from([0, 1]));
        assert_eq!(
            inv.pcie_switch_groups(),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(inv.nvlink_coverage(), NvLinkCoverage::AllToAll);
        assert_eq!(inv.nvlink_links(0, 7), 12);
        assert_eq!(inv.nvlink_links(3, 3), 0);
        assert_eq!(inv.cuda_version, (12, 4));
    }

    #[test]
    fn t4x4_has_no_nvlink_and_sys_across_numa_nodes() {
        let inv = inventory("t4x4");
        assert_eq!(inv.nvlink_coverage(), NvLinkCoverage::None);
        assert_eq!(inv.topology(0, 1), TopologyLevel::Node);
        assert_eq!(inv.topology(1, 2), TopologyLevel::System);
        assert!(inv.pcie_switch_groups().is_empty());
    }

    #[test]
    fn mixed_links_only_the_v100_pair() {
        let inv = inventory("mixed");
        assert_eq!(inv.nvlink_coverage(), NvLinkCoverage::Partial);
        assert_eq!(inv.nvlink_peers(0), vec![NvLinkPeer { index: 1, links: 6 }]);
        assert!(inv.nvlink_peers(2).is_empty());
        assert_eq!(inv.pcie_switch(0), Some(0));
        assert_eq!(inv.pcie_switch(2), None);
    }
}
