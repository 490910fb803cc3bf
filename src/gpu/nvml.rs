//! The real node: GPU facts and health events from NVML through nvml-wrapper.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{TemperatureSensor, TopologyLevel as NvmlLevel};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use super::{GpuError, GpuInfo, GpuSource, NvLinkEnd, TopologyLevel};

/// The library name NVML is loaded by when no path is given (the dynamic loader searches for it).
pub const DEFAULT_NVML_LIB: &str = "libnvidia-ml.so.1";

/// NVML, opened once per process.
pub struct NvmlSource {
    nvml: Arc<Nvml>,
    sysfs_root: PathBuf,
}

fn nvml_error(call: &'static str, index: Option<u32>, err: NvmlError) -> GpuError {
    match (err, index) {
        (NvmlError::GpuLost, Some(index)) => GpuError::GpuLost { index },
        (NvmlError::DriverNotLoaded, _) => GpuError::DriverNotLoaded("driver not loaded".into()),
        (NvmlError::NoPermission, _) => GpuError::NoPermission("no permission".into()),
        (err, _) => GpuError::Nvml {
            call,
            message: err.to_string(),
        },
    }
}

impl NvmlSource {
    /// Loads NVML (`lib`, or `libnvidia-ml.so.1` from the loader's search path) and initializes it.
    pub fn open(lib: Option<&Path>) -> Result<Self, GpuError> {
        let mut builder = Nvml::builder();
        if let Some(path) = lib {
            builder.lib_path(path.as_os_str());
        }
        let lib_name = lib.map_or_else(|| DEFAULT_NVML_LIB.to_string(), |p| p.display().to_string());
        let nvml = builder.init().map_err(|err| match err {
            NvmlError::LibloadingError(_) => GpuError::LibraryNotFound { lib: lib_name },
            NvmlError::FailedToLoadSymbol(symbol) => GpuError::LibraryNotFound {
                lib: format!("{lib_name} lacks {symbol}, it is not NVML"),
            },
            NvmlError::DriverNotLoaded => GpuError::DriverNotLoaded(err.to_string()),
            NvmlError::NoPermission => GpuError::NoPermission(err.to_string()),
            other => nvml_error("nvmlInit_v2", None, other),
        })?;
        Ok(Self {
            nvml: Arc::new(nvml),
            sysfs_root: PathBuf::from("/sys"),
        })
    }

    /// Reads NUMA placement under another sysfs root (tests; containers that mount the host's /sys elsewhere).
    pub fn with_sysfs_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.sysfs_root = root.into();
        self
    }

    fn device(&self, index: u32) -> Result<Device<'_>, GpuError> {
        self.nvml
            .device_by_index(index)
            .map_err(|e| nvml_error("nvmlDeviceGetHandleByIndex", Some(index), e))
    }

    /// Memory in use on GPU `index`, in MiB, as the driver sees it (every process, not only ours).
    pub fn memory_used_mib(&self, index: u32) -> Result<u64, GpuError> {
        let info = self
            .device(index)?
            .memory_info()
            .map_err(|e| nvml_error("nvmlDeviceGetMemoryInfo_v2", Some(index), e))?;
        Ok(info.used / (1024 * 1024))
    }

    /// What a GPU is doing now: memory in use, utilization, temperature, power. A reading the GPU
    /// does not support is None; a GPU that stopped answering is an error.
    pub fn telemetry(&self, index: u32) -> Result<Telemetry, GpuError> {
        let device = self.device(index)?;
        let memory = device
            .memory_info()
            .map_err(|e| nvml_error("nvmlDeviceGetMemoryInfo_v2", Some(index), e))?;
        Ok(Telemetry {
            memory_used_bytes: memory.used,
            utilization_ratio: device.utilization_rates().ok().map(|u| f64::from(u.gpu) / 100.0),
            temperature_celsius: device.temperature(TemperatureSensor::Gpu).ok(),
            power_watts: device.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
        })
    }

    /// Starts watching for critical XID events on every GPU. Events arrive on the returned channel
    /// from a background thread until the [`HealthEvents`] is dropped.
    pub fn health_events(&self) -> Result<HealthEvents, GpuError> {
        let nvml = Arc::clone(&self.nvml);
        let stop = Arc::new(AtomicBool::new(false));
        let (events_tx, events_rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread_stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("nvml-events".into())
            .spawn(move || watch_events(&nvml, &thread_stop, &ready_tx, &events_tx))
            .map_err(|e| GpuError::Nvml {
                call: "event thread",
                message: e.to_string(),
            })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(HealthEvents {
                events: events_rx,
                stop,
            }),
            Ok(Err(err)) => Err(err),
            Err(_) => Err(GpuError::Nvml {
                call: "nvmlEventSetCreate",
                message: "event thread died".into(),
            }),
        }
    }
}

/// One reading of a GPU's activity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Telemetry {
    pub memory_used_bytes: u64,
    pub utilization_ratio: Option<f64>,
    pub temperature_celsius: Option<u32>,
    pub power_watts: Option<f64>,
}

/// Something that happened to a GPU's health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuEvent {
    /// A critical XID error (e.g. 79: fallen off the bus; 48: double-bit ECC error).
    Xid { index: u32, uuid: String, xid: u64 },
    /// The driver reports a GPU as lost; `index` is None when NVML could not say which one.
    Lost { index: Option<u32> },
}

/// A running XID watch; dropping it stops the watcher thread within one poll interval.
pub struct HealthEvents {
    events: mpsc::Receiver<GpuEvent>,
    stop: Arc<AtomicBool>,
}

impl HealthEvents {
    /// The next event, waiting at most `timeout` (`Ok(None)`: nothing happened). An error means the
    /// watch has ended (NVML failed); no event will come any more.
    pub fn next(&self, timeout: Duration) -> Result<Option<GpuEvent>, GpuError> {
        match self.events.recv_timeout(timeout) {
            Ok(event) => Ok(Some(event)),
            Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(GpuError::Nvml {
                call: "nvmlEventSetWait_v2",
                message: "the XID watch has ended".into(),
            }),
        }
    }
}

impl Drop for HealthEvents {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// How long one NVML wait blocks before the watcher checks whether it should stop.
const EVENT_POLL_MS: u32 = 200;

fn watch_events(
    nvml: &Nvml,
    stop: &AtomicBool,
    ready: &mpsc::SyncSender<Result<(), GpuError>>,
    events: &mpsc::Sender<GpuEvent>,
) {
    let setup = || -> Result<_, GpuError> {
        let mut set = nvml
            .create_event_set()
            .map_err(|e| nvml_error("nvmlEventSetCreate", None, e))?;
        let count = nvml
            .device_count()
            .map_err(|e| nvml_error("nvmlDeviceGetCount", None, e))?;
        let mut uuids = Vec::with_capacity(count as usize);
        for index in 0..count {
            let device = nvml
                .device_by_index(index)
                .map_err(|e| nvml_error("nvmlDeviceGetHandleByIndex", Some(index), e))?;
            let uuid = device
                .uuid()
                .map_err(|e| nvml_error("nvmlDeviceGetUUID", Some(index), e))?;
            let supported = device.supported_event_types().unwrap_or(EventTypes::empty());
            if supported.contains(EventTypes::CRITICAL_XID_ERROR) {
                set = device
                    .register_events(EventTypes::CRITICAL_XID_ERROR, set)
                    .map_err(|e| nvml_error("nvmlDeviceRegisterEvents", Some(index), e.error))?;
            } else {
                tracing::warn!(index, %uuid, "GPU does not report XID events; only lost-GPU checks apply");
            }
            uuids.push(uuid);
        }
        Ok((set, uuids))
    };
    let (set, uuids) = match setup() {
        Ok(ok) => {
            let _ = ready.send(Ok(()));
            ok
        }
        Err(err) => {
            let _ = ready.send(Err(err));
            return;
        }
    };
    while !stop.load(Ordering::Relaxed) {
        let event = match set.wait(EVENT_POLL_MS) {
            Ok(data) => {
                let uuid = data.device.uuid().ok();
                let index = uuid.as_ref().and_then(|u| uuids.iter().position(|x| x == u));
                let xid = match data.event_data {
                    Some(XidError::Value(xid)) => xid,
                    _ => 0,
                };
                match (index, uuid) {
                    (Some(index), Some(uuid)) => GpuEvent::Xid {
                        index: index as u32,
                        uuid,
                        xid,
                    },
                    _ => GpuEvent::Lost { index: None },
                }
            }
            Err(NvmlError::Timeout) => continue,
            Err(NvmlError::GpuLost) => GpuEvent::Lost { index: None },
            Err(err) => {
                tracing::error!(error = %err, "NVML event wait failed; stopping the XID watch");
                return;
            }
        };
        if events.send(event).is_err() {
            return;
        }
    }
}

fn map_level(level: NvmlLevel) -> TopologyLevel {
    match level {
        NvmlLevel::Internal => TopologyLevel::Internal,
        NvmlLevel::Single => TopologyLevel::Single,
        NvmlLevel::Multiple => TopologyLevel::Multiple,
        NvmlLevel::HostBridge => TopologyLevel::HostBridge,
        NvmlLevel::Node => TopologyLevel::Node,
        NvmlLevel::System => TopologyLevel::System,
    }
}

/// NUMA node of a PCI device from sysfs (`/sys/bus/pci/devices/<bus id>/numa_node`); `-1` means none.
pub fn numa_node_from_sysfs(sysfs_root: &Path, nvml_bus_id: &str) -> Option<u32> {
    // sysfs names devices with a 4-digit domain, lower case: 0000:07:00.0
    let canonical = gpumem_profile::normalize_bus_id(nvml_bus_id)?;
    let short = canonical.get(4..)?.to_ascii_lowercase();
    let path = sysfs_root.join("bus/pci/devices").join(short).join("numa_node");
    let text = std::fs::read_to_string(path).ok()?;
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

impl GpuSource for NvmlSource {
    fn driver_version(&self) -> Result<String, GpuError> {
        self.nvml
            .sys_driver_version()
            .map_err(|e| nvml_error("nvmlSystemGetDriverVersion", None, e))
    }

    fn cuda_version(&self) -> Result<i32, GpuError> {
        self.nvml
            .sys_cuda_driver_version()
            .map_err(|e| nvml_error("nvmlSystemGetCudaDriverVersion", None, e))
    }

    fn gpu_count(&self) -> Result<u32, GpuError> {
        self.nvml
            .device_count()
            .map_err(|e| nvml_error("nvmlDeviceGetCount", None, e))
    }

    fn gpu(&self, index: u32) -> Result<GpuInfo, GpuError> {
        let at = Some(index);
        let device = self.device(index)?;
        let pci = device
            .pci_info()
            .map_err(|e| nvml_error("nvmlDeviceGetPciInfo", at, e))?;
        let pci_bus_id =
            gpumem_profile::normalize_bus_id(&pci.bus_id).ok_or_else(|| GpuError::Unexpected {
                what: "PCI bus id",
                value: pci.bus_id.clone(),
            })?;
        let numa_node = match device.numa_node_id() {
            Ok(node) => Some(node),
            // Older drivers lack nvmlDeviceGetNumaNodeId; the kernel knows too.
            Err(NvmlError::GpuLost) => return Err(GpuError::GpuLost { index }),
            Err(_) => numa_node_from_sysfs(&self.sysfs_root, &pci_bus_id),
        };
        let cc = device
            .cuda_compute_capability()
            .map_err(|e| nvml_error("nvmlDeviceGetCudaComputeCapability", at, e))?;
        let compute_capability = match (u32::try_from(cc.major), u32::try_from(cc.minor)) {
            (Ok(major), Ok(minor)) => (major, minor),
            _ => {
                return Err(GpuError::Unexpected {
                    what: "compute capability",
                    value: format!("{}.{}", cc.major, cc.minor),
                });
            }
        };
        Ok(GpuInfo {
            index,
            uuid: device
                .uuid()
                .map_err(|e| nvml_error("nvmlDeviceGetUUID", at, e))?,
            minor_number: device
                .minor_number()
                .map_err(|e| nvml_error("nvmlDeviceGetMinorNumber", at, e))?,
            product: device
                .name()
                .map_err(|e| nvml_error("nvmlDeviceGetName", at, e))?,
            memory_mib: device
                .memory_info()
                .map_err(|e| nvml_error("nvmlDeviceGetMemoryInfo_v2", at, e))?
                .total
                / (1024 * 1024),
            pci_bus_id,
            numa_node,
            compute_capability,
        })
    }

    fn topology(&self, a: u32, b: u32) -> Result<TopologyLevel, GpuError> {
        let (da, db) = (self.device(a)?, self.device(b)?);
        da.topology_common_ancestor(db)
            .map(map_level)
            .map_err(|e| nvml_error("nvmlDeviceGetTopologyCommonAncestor", Some(a), e))
    }

    fn nvlinks(&self, index: u32) -> Result<Vec<NvLinkEnd>, GpuError> {
        let device = self.device(index)?;
        let mut ends = Vec::new();
        for link in 0..gpumem_profile::MAX_NVLINKS {
            let nvlink = device.link_wrapper_for(link);
            match nvlink.is_active() {
                Ok(true) => {}
                Ok(false) => continue,
                // No NVLink hardware (PCIe cards), or a link number this GPU does not have.
                Err(NvmlError::NotSupported | NvmlError::InvalidArg) => break,
                Err(NvmlError::GpuLost) => return Err(GpuError::GpuLost { index }),
                Err(e) => return Err(nvml_error("nvmlDeviceGetNvLinkState", Some(index), e)),
            }
            let remote = nvlink
                .remote_pci_info()
                .map_err(|e| nvml_error("nvmlDeviceGetNvLinkRemotePciInfo_v2", Some(index), e))?;
            ends.push(NvLinkEnd {
                remote_bus_id: remote.bus_id,
            });
        }
        Ok(ends)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_numa_node_is_read_from_the_short_bus_id() {
        let root = tempfile::tempdir().unwrap();
        let dev = root.path().join("bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        assert_eq!(numa_node_from_sysfs(root.path(), "00000000:3B:00.0"), Some(1));
        std::fs::write(dev.join("numa_node"), "-1\n").unwrap();
        assert_eq!(numa_node_from_sysfs(root.path(), "00000000:3B:00.0"), None);
        assert_eq!(numa_node_from_sysfs(root.path(), "00000000:5E:00.0"), None);
    }

    #[test]
    fn a_missing_library_is_a_clear_error() {
        let err = NvmlSource::open(Some(Path::new("/nonexistent/libnvidia-ml.so.1")))
            .err()
            .unwrap();
        let text = err.to_string();
        assert!(
            text.contains("NVML library not found") && text.contains("--profile"),
            "{text}"
        );
    }
}
