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
