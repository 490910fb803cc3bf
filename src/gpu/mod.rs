//! GPU discovery: what GPUs this node has and how they are wired.
//!
//! Facts come from a [`GpuSource`]: NVML through nvml-wrapper on a real node ([`NvmlSource`]), or a
//! simulated profile ([`gpumem_profile::Profile`]) for demos and tests. [`GpuInventory::discover`]
//! turns those raw facts into the picture the rest of gpumem works with (PCIe-switch groups, NVLink
//! peers with link counts), with the same code for both sources.

mod inventory;
mod nvml;
mod profile;

pub use gpumem_profile::TopologyLevel;
pub use inventory::{GpuInfo, GpuInventory, NvLinkPeer};
pub use nvml::{EVENT_RETRY_MAX, GpuEvent, HealthEvents, NvmlSource, Telemetry, numa_node_from_sysfs};

/// Why GPU facts could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "NVML library not found ({lib}): is the NVIDIA driver installed? \
         Try --nvml-lib PATH, or --profile dgx-a100 for a simulated node"
    )]
    LibraryNotFound { lib: String },
    #[error("NVIDIA driver is not loaded (NVML: {0}); try --profile dgx-a100 for a simulated node")]
    DriverNotLoaded(String),
    #[error(
        "no permission to talk to the NVIDIA driver (NVML: {0}); run as root or with access to /dev/nvidia*"
    )]
    NoPermission(String),
    #[error("GPU {index} has fallen off the bus or stopped answering (NVML: GPU is lost)")]
    GpuLost { index: u32 },
    #[error("NVML {call} failed: {message}")]
    Nvml { call: &'static str, message: String },
    #[error("NVML reported {what} {value:?}, which gpumem cannot interpret")]
    Unexpected { what: &'static str, value: String },
    #[error(transparent)]
    Profile(#[from] gpumem_profile::ProfileError),
}

/// One active NVLink link of a GPU, as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvLinkEnd {
    /// PCI bus id (NVML form) at the far end: a peer GPU, or an NVSwitch.
    pub remote_bus_id: String,
}

/// Raw per-node facts, in the shape NVML answers them.
pub trait GpuSource {
    fn driver_version(&self) -> Result<String, GpuError>;
    /// CUDA driver API version as NVML encodes it (1000 * major + 10 * minor).
    fn cuda_version(&self) -> Result<i32, GpuError>;
    fn gpu_count(&self) -> Result<u32, GpuError>;
    fn gpu(&self, index: u32) -> Result<GpuInfo, GpuError>;
    fn topology(&self, a: u32, b: u32) -> Result<TopologyLevel, GpuError>;
    /// Active NVLink links of GPU `index`; empty when the GPU has no NVLink.
    fn nvlinks(&self, index: u32) -> Result<Vec<NvLinkEnd>, GpuError>;
}

/// Each GPU's PCIe root complex (`pci<domain>:<bus>`, as sysfs and the standard DRA attribute
/// `resource.kubernetes.io/pcieRoot` name it). With `sysfs` (a real node: `/sys`) it is the
/// `pci…` directory the GPU's device path starts under. Otherwise, or where sysfs does not say (a
/// simulated node), GPUs that reach each other without leaving a host bridge (`PHB` or closer)
/// share a root, numbered in GPU order.
pub fn pcie_roots(inventory: &GpuInventory, sysfs: Option<&std::path::Path>) -> Vec<String> {
    let n = inventory.gpus.len();
    let mut group = vec![usize::MAX; n];
    let mut groups = 0;
    for a in 0..n {
        if group[a] != usize::MAX {
            continue;
        }
        for (b, group_b) in group.iter_mut().enumerate().skip(a) {
            if *group_b == usize::MAX && inventory.topology(a, b) <= TopologyLevel::HostBridge {
                *group_b = groups;
            }
        }
        groups += 1;
    }
    inventory
        .gpus
        .iter()
        .enumerate()
        .map(|(a, gpu)| {
            let (domain, _) = gpu.pci_bus_id.split_once(':').unwrap_or(("0000", ""));
            let domain = &domain[domain.len().saturating_sub(4)..];
            sysfs
                .and_then(|root| pcie_root_from_sysfs(root, domain, &gpu.pci_bus_id))
                .unwrap_or_else(|| format!("pci{}:{:02x}", domain.to_lowercase(), group[a]))
        })
        .collect()
}

/// `/sys/bus/pci/devices/0000:3b:00.0` → `/sys/devices/pci0000:3a/…` → `pci0000:3a`.
fn pcie_root_from_sysfs(sysfs: &std::path::Path, domain: &str, bus_id: &str) -> Option<String> {
    let (_, rest) = bus_id.split_once(':')?;
    let device = format!("{domain}:{rest}").to_lowercase();
    let path = std::fs::canonicalize(sysfs.join("bus/pci/devices").join(device)).ok()?;
    path.components()
        .filter_map(|c| c.as_os_str().to_str())
        .find(|c| c.starts_with("pci") && c.contains(':'))
        .map(str::to_string)
}
