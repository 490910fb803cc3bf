//! The real node: GPU facts and health events from NVML through nvml-wrapper.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{TemperatureSensor, TopologyLevel as NvmlLevel};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, EventSet, Nvml};

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
    /// from a background thread until the [`HealthEvents`] is dropped. `progress` is called whenever
    /// a wait for events returns (an event, or nothing within 200 ms): the watch is running. When
    /// NVML fails, the thread logs (at a bounded rate), waits with backoff up to [`EVENT_RETRY_MAX`]
    /// and sets the watch up again; `progress` is not called meanwhile. Only a failure to set it up
    /// the first time is an error here.
    pub fn health_events(&self, progress: impl Fn() + Send + 'static) -> Result<HealthEvents, GpuError> {
        let nvml = Arc::clone(&self.nvml);
        let stop = Arc::new(AtomicBool::new(false));
        let (events_tx, events_rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread_stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("nvml-events".into())
            .spawn(move || watch_events(&nvml, &thread_stop, &ready_tx, &events_tx, &progress))
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
    /// watcher thread has ended (it does not end on NVML errors); no event will come any more.
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
/// The first pause after NVML failed the watch; it doubles with each failure in a row.
const EVENT_RETRY_FIRST: Duration = Duration::from_millis(200);
/// The longest pause between two attempts to set the watch up again.
pub const EVENT_RETRY_MAX: Duration = Duration::from_secs(10);
/// While NVML keeps failing the watch, one log line per this period at most.
const EVENT_FAILURE_LOG_EVERY: Duration = Duration::from_secs(60);

/// An event set registered for critical XIDs on every GPU that reports them.
struct Watch<'n> {
    set: EventSet<'n>,
    uuids: Vec<String>,
}

fn set_up(nvml: &Nvml) -> Result<Watch<'_>, GpuError> {
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
    Ok(Watch { set, uuids })
}

/// NVML failing the watch several times in a row: the pause before the next try, and what to log.
struct Failures {
    since: Instant,
    count: u64,
    last_logged: Instant,
    pause: Duration,
}

impl Failures {
    /// Counts one failure (logging the first, then at most one line per period) and returns how long
    /// to wait before trying again.
    fn record(this: &mut Option<Self>, err: &GpuError) -> Duration {
        let now = Instant::now();
        let Some(failures) = this else {
            tracing::error!(
                error = %err,
                retry_in_ms = EVENT_RETRY_FIRST.as_millis() as u64,
                "XID watch: NVML failed; setting it up again with backoff (no XID is seen meanwhile; \
                 lost-GPU probes go on)"
            );
            *this = Some(Self {
                since: now,
                count: 1,
                last_logged: now,
                pause: EVENT_RETRY_FIRST,
            });
            return EVENT_RETRY_FIRST;
        };
        failures.count += 1;
        failures.pause = failures.pause.saturating_mul(2).min(EVENT_RETRY_MAX);
        if now.duration_since(failures.last_logged) >= EVENT_FAILURE_LOG_EVERY {
            failures.last_logged = now;
            tracing::error!(
                error = %err,
                failures = failures.count,
                failing_for_s = now.duration_since(failures.since).as_secs(),
                "XID watch: NVML still failing; retrying"
            );
        }
        failures.pause
    }

    /// A wait returned: the watch runs again.
    fn recovered(this: &mut Option<Self>) {
        if let Some(failures) = this.take() {
            tracing::info!(
                failures = failures.count,
                after_ms = failures.since.elapsed().as_millis() as u64,
                "XID watch: running again"
            );
        }
    }
}

/// Sleeps `pause` in steps of one poll, returning early once `stop` is set.
fn pause_unless_stopped(pause: Duration, stop: &AtomicBool) {
    let deadline = Instant::now() + pause;
    while !stop.load(Ordering::Relaxed) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(u64::from(EVENT_POLL_MS))));
    }
}

fn watch_events(
    nvml: &Nvml,
    stop: &AtomicBool,
    ready: &mpsc::SyncSender<Result<(), GpuError>>,
    events: &mpsc::Sender<GpuEvent>,
    progress: &dyn Fn(),
) {
    let mut watch = match set_up(nvml) {
        Ok(watch) => {
            let _ = ready.send(Ok(()));
            Some(watch)
        }
        Err(err) => {
            let _ = ready.send(Err(err));
            return;
        }
    };
    let mut failures = None;
    while !stop.load(Ordering::Relaxed) {
        let Some(current) = &watch else {
            match set_up(nvml) {
                Ok(fresh) => watch = Some(fresh),
                Err(err) => pause_unless_stopped(Failures::record(&mut failures, &err), stop),
            }
            continue;
        };
        let event = match current.set.wait(EVENT_POLL_MS) {
            Ok(data) => {
                let uuid = data.device.uuid().ok();
                let index = uuid
                    .as_ref()
                    .and_then(|u| current.uuids.iter().position(|x| x == u));
                let xid = match data.event_data {
                    Some(XidError::Value(xid)) => xid,
                    _ => 0,
                };
                match (index, uuid) {
                    (Some(index), Some(uuid)) => Some(GpuEvent::Xid {
                        index: index as u32,
                        uuid,
                        xid,
                    }),
                    _ => Some(GpuEvent::Lost { index: None }),
                }
            }
            Err(NvmlError::Timeout) => None,
            Err(NvmlError::GpuLost) => Some(GpuEvent::Lost { index: None }),
            Err(err) => {
                // A set NVML failed may not work again: drop it and set up a new one after the pause.
                watch = None;
                let err = nvml_error("nvmlEventSetWait_v2", None, err);
                pause_unless_stopped(Failures::record(&mut failures, &err), stop);
                continue;
            }
        };
        Failures::recovered(&mut failures);
        progress();
        if let Some(event) = event
            && events.send(event).is_err()
        {
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
