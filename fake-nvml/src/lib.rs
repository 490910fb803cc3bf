//! A test-only `libnvidia-ml.so.1` that answers NVML's C API from a gpumem profile.
//!
//! Tests load it exactly as gpumem loads the real library, through nvml-wrapper: either with
//! `Nvml::builder().lib_path(".../libnvidia-ml.so.1").init()`, or by starting a process with
//! `LD_LIBRARY_PATH` naming a directory that holds a `libnvidia-ml.so.1` symlink to the built
//! `libgpumem_fake_nvml.so` (the root package's `tests/support` module builds one). It is never
//! shipped.
//!
//! # Environment, read by `nvmlInit_v2` / `nvmlInitWithFlags`
//!
//! Both are read when the first (reference-counted) initialisation happens, that is at the first
//! init and again at the first init after the last `nvmlShutdown`. In between they are fixed for
//! the whole process (an init that finds them changed says so on stderr and keeps the old ones):
//! tests that load the library into one process must take turns (see `tests/support`).
//!
//! - `GPUMEM_FAKE_NVML_PROFILE`: a built-in profile name (`dgx-a100`, `hgx-h100`, `t4x4`, `mixed`)
//!   or a path to a profile `.toml` (see the `gpumem-profile` crate). Unset, empty or invalid:
//!   init returns `NVML_ERROR_DRIVER_NOT_LOADED` and one line on stderr says why.
//! - `GPUMEM_FAKE_NVML_INJECT`: optional path to a fault-injection file (below). It need not exist
//!   yet; a missing file means "no faults".
//!
//! # The inject file
//!
//! Tests rewrite it while the process using the library runs. The library re-reads it whenever
//! its inode, modification time or length changed, checking at every call that reads GPU state
//! (one `stat` per call), and while `nvmlEventSetWait_v2` waits (every 10 ms). Write it atomically
//! (write a temporary file, then rename it over the old one): a file that does not parse is
//! reported on stderr and ignored, the previous faults stay in force.
//!
//! ```toml
//! lost = [3]                 # GPU indices that stop answering: every call that takes or returns
//!                            # the device (handle look-ups included) returns NVML_ERROR_GPU_IS_LOST;
//!                            # nvmlDeviceGetCount_v2 still counts it
//! [memory_used_mib]          # memory in use per GPU index (default 0); nvmlDeviceGetMemoryInfo*
//! "0" = 2048                 # report used = this, free = total - used (reserved = 0)
//! hung = [2]                 # GPU indices that hang: every call that takes the device (handle
//!                            # look-ups excluded) blocks until the GPU leaves this list
//! event_wait_error = 999     # while present, nvmlEventSetWait_v2 returns this NVML error code at
//!                            # once (999: NVML_ERROR_UNKNOWN); remove it and waits work again
//! [[xid]]                    # critical XID events, delivered once each, in order, to every
//! gpu = 1                    # event set that registered nvmlEventTypeXidCriticalError on that GPU
//! xid = 79
//! ```
//!
//! A hung call holds no lock while it blocks (it looks at the inject file every 10 ms), so calls
//! about other GPUs, and event waits, go on answering.
//!
//! Every field is optional; unknown fields make the file invalid.
//!
//! ## Event delivery
//!
//! Each event set keeps a cursor into the `[[xid]]` list, starting at the beginning of the list:
//! a set delivers every entry it has not delivered yet whose GPU it registered for
//! XidCriticalError (entries written before the set was created included, so a test need not race
//! the process under test), skipping entries for other GPUs. Append entries to inject new events;
//! rewrite the file with fewer entries (or start from an empty one) to start over — a cursor past
//! the end of a shorter list is pulled back to its end.
//!
//! A GPU that becomes lost is reported the way the driver reports a GPU that fell off the bus:
//! each event set registered for XidCriticalError on it delivers one synthesised XID 79 event for
//! that GPU (before any pending `[[xid]]` entries); it is reported again if the GPU leaves the
//! `lost` list and later returns to it. `nvmlEventSetWait_v2` itself never returns
//! `NVML_ERROR_GPU_IS_LOST`, so the receiver knows which GPU it was (its further calls on that
//! device then return GPU_IS_LOST). Registering events on a GPU that is already lost fails with
//! GPU_IS_LOST, as every per-device call does.
//!
//! # What the fake answers
//!
//! The exported functions are those gpumem calls through nvml-wrapper 0.13; any other NVML
//! function is absent, which nvml-wrapper reports as `NvmlError::FailedToLoadSymbol` when called.
//! Conventions, as in real NVML: calls before init or after the last shutdown return
//! `NVML_ERROR_UNINITIALIZED`; unknown device or event-set handles and null output pointers
//! return `NVML_ERROR_INVALID_ARGUMENT`; string buffers too small for the answer and its NUL return
//! `NVML_ERROR_INSUFFICIENT_SIZE`. No panic crosses the C boundary (each export catches unwinds and
//! answers `NVML_ERROR_UNKNOWN`).
//!
//! NVLink: a GPU without any active link in its profile (every GPU of a profile without
//! `[nvlink]`, the T4s of `mixed`) answers NVLink queries with `NVML_ERROR_NOT_SUPPORTED`; a GPU
//! with links reports links `0..n` active and the rest (up to 17) disabled; link numbers from 18
//! up are invalid arguments.
//!
//! Telemetry is plausible and deterministic: temperature, power and utilisation follow the share
//! of memory in use; no compute processes ever run.
//!
//! One file, over the usual ~600 lines: it is one C ABI surface (every NVML entry point the agent calls
//! and the profile it answers from), read top to bottom against NVML's header.

// The exported names are NVML's; their safety contract is NVML's C API (valid pointers or null).
#![allow(non_snake_case, clippy::missing_safety_doc)]

mod inject;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CStr, OsString, c_char, c_int, c_uint, c_ulonglong};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use gpumem_profile::{GpuSpec, MAX_NVLINKS, NvLinkSpec, Profile};
use nvml_wrapper_sys::bindings::{
    nvmlDevice_st, nvmlDevice_t, nvmlEnableState_enum_NVML_FEATURE_DISABLED,
    nvmlEnableState_enum_NVML_FEATURE_ENABLED, nvmlEnableState_t, nvmlEventData_t, nvmlEventSet_st,
    nvmlEventSet_t, nvmlEventTypeClock, nvmlEventTypeDoubleBitEccError, nvmlEventTypePState,
    nvmlEventTypeSingleBitEccError, nvmlEventTypeXidCriticalError,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_ATOMICS,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK, nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_PCI,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_READ, nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_WRITE,
    nvmlGpuP2PCapsIndex_t, nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED,
    nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_NOT_SUPPORTED, nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK,
    nvmlGpuP2PStatus_t, nvmlGpuTopologyLevel_t, nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH, nvmlIntNvLinkDeviceType_t, nvmlMemory_t,
    nvmlMemory_v2_t, nvmlPciInfo_t, nvmlProcessInfo_t, nvmlReturn_enum_NVML_ERROR_ALREADY_INITIALIZED,
    nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH, nvmlReturn_enum_NVML_ERROR_CORRUPTED_INFOROM,
    nvmlReturn_enum_NVML_ERROR_DEPRECATED, nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED,
    nvmlReturn_enum_NVML_ERROR_FREQ_NOT_SUPPORTED, nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND,
    nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST, nvmlReturn_enum_NVML_ERROR_GPU_NOT_FOUND,
    nvmlReturn_enum_NVML_ERROR_IN_USE, nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_POWER,
    nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES, nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE,
    nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT, nvmlReturn_enum_NVML_ERROR_INVALID_STATE,
    nvmlReturn_enum_NVML_ERROR_IRQ_ISSUE, nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND, nvmlReturn_enum_NVML_ERROR_MEMORY,
    nvmlReturn_enum_NVML_ERROR_NO_DATA, nvmlReturn_enum_NVML_ERROR_NO_PERMISSION,
    nvmlReturn_enum_NVML_ERROR_NOT_FOUND, nvmlReturn_enum_NVML_ERROR_NOT_READY,
    nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED, nvmlReturn_enum_NVML_ERROR_OPERATING_SYSTEM,
    nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED, nvmlReturn_enum_NVML_ERROR_TIMEOUT,
    nvmlReturn_enum_NVML_ERROR_UNINITIALIZED, nvmlReturn_enum_NVML_ERROR_UNKNOWN,
    nvmlReturn_enum_NVML_ERROR_VGPU_ECC_NOT_SUPPORTED, nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t,
    nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU, nvmlTemperatureSensors_t, nvmlUtilization_t,
};

use crate::inject::{Faults, InjectSource, warn};

/// Environment variable naming the profile.
pub const PROFILE_ENV: &str = "GPUMEM_FAKE_NVML_PROFILE";
/// Environment variable naming the inject file.
pub const INJECT_ENV: &str = "GPUMEM_FAKE_NVML_INJECT";

const SUCCESS: nvmlReturn_t = nvmlReturn_enum_NVML_SUCCESS;
const UNINITIALIZED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
const INVALID_ARGUMENT: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
const INSUFFICIENT_SIZE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
const DRIVER_NOT_LOADED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED;
const TIMEOUT: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
const GPU_IS_LOST: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
const VERSION_MISMATCH: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
const UNKNOWN: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNKNOWN;

/// XID the driver logs when a GPU has fallen off the bus.
const XID_FALLEN_OFF_THE_BUS: u64 = 79;
/// The event types every simulated GPU supports (only XidCriticalError ever fires).
const SUPPORTED_EVENTS: u64 = (nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypePState
    | nvmlEventTypeXidCriticalError
    | nvmlEventTypeClock) as u64;
const XID_EVENT: u64 = nvmlEventTypeXidCriticalError as u64;
/// How often a waiting `nvmlEventSetWait_v2` looks at the inject file.
const POLL: Duration = Duration::from_millis(10);
/// `nvmlEventData_t.gpuInstanceId` / `computeInstanceId` outside MIG.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

/// Device handles are addresses of the bytes of this table (GPU `i` is `&DEVICE_SLOTS[i]`): unique
/// in the process, never dereferenced, and checked against the profile's GPU count on every call.
const MAX_DEVICES: usize = 256;
static DEVICE_SLOTS: [u8; MAX_DEVICES] = [0; MAX_DEVICES];

type Res<T> = Result<T, nvmlReturn_t>;

/// The library's process-wide state.
struct State {
    /// Successful inits not yet matched by a shutdown.
    refs: u32,
    /// Present while `refs > 0`.
    node: Option<Node>,
}

static STATE: Mutex<State> = Mutex::new(State { refs: 0, node: None });

/// The simulated node, loaded at the first init.
struct Node {
    /// `GPUMEM_FAKE_NVML_PROFILE` and `GPUMEM_FAKE_NVML_INJECT` as they were at load.
    env: [Option<OsString>; 2],
    profile: Profile,
    /// `profile.nvlinks(i)` for every GPU.
    links: Vec<Vec<NvLinkSpec>>,
    inject: InjectSource,
    event_sets: Vec<EventSet>,
}

struct EventSet {
    /// Its address is the handle; kept alive (and so unique) until `nvmlEventSetFree`.
    anchor: Box<u8>,
    /// GPU index -> registered event types.
    registered: BTreeMap<u32, u64>,
    /// Next `[[xid]]` entry to look at.
    cursor: usize,
    /// Lost GPUs this set has already reported.
    lost_reported: BTreeSet<u32>,
}

impl EventSet {
    fn handle(&self) -> nvmlEventSet_t {
        std::ptr::from_ref::<u8>(&self.anchor)
            .cast_mut()
            .cast::<nvmlEventSet_st>()
    }

    fn wants_xid(&self, gpu: u32) -> bool {
        self.registered
            .get(&gpu)
            .is_some_and(|types| types & XID_EVENT != 0)
    }
}

fn lock() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Node {
    fn from_env() -> Res<Self> {
        let name = match std::env::var(PROFILE_ENV) {
            Ok(name) if !name.trim().is_empty() => name,
            Ok(_) | Err(std::env::VarError::NotPresent) => {
                warn(&format!(
                    "{PROFILE_ENV} is not set: set it to a built-in profile ({}) or a profile .toml path; \
                     answering NVML_ERROR_DRIVER_NOT_LOADED",
                    gpumem_profile::builtin_names().join(", ")
                ));
                return Err(DRIVER_NOT_LOADED);
            }
            Err(std::env::VarError::NotUnicode(value)) => {
                warn(&format!(
                    "{PROFILE_ENV}={value:?} is not valid UTF-8; answering NVML_ERROR_DRIVER_NOT_LOADED"
                ));
                return Err(DRIVER_NOT_LOADED);
            }
        };
        let profile = Profile::load(name.trim()).map_err(|e| {
            warn(&format!(
                "{PROFILE_ENV}={name:?}: {e}; answering NVML_ERROR_DRIVER_NOT_LOADED"
            ));
            DRIVER_NOT_LOADED
        })?;
        if profile.gpus.len() > MAX_DEVICES {
            warn(&format!(
                "profile {} has {} GPUs, the fake NVML library simulates at most {MAX_DEVICES}; \
                 answering NVML_ERROR_DRIVER_NOT_LOADED",
                profile.name,
                profile.gpus.len()
            ));
            return Err(DRIVER_NOT_LOADED);
        }
        let inject_path = std::env::var_os(INJECT_ENV)
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        let links = (0..profile.gpus.len()).map(|i| profile.nvlinks(i)).collect();
        Ok(Self {
            env: current_env(),
            profile,
            links,
            inject: InjectSource::new(inject_path),
            event_sets: Vec::new(),
        })
    }

    /// The GPU index a handle stands for.
    fn index_of(&self, device: nvmlDevice_t) -> Res<usize> {
        let offset = (device as usize).wrapping_sub(DEVICE_SLOTS.as_ptr() as usize);
        if offset < self.profile.gpus.len() {
            Ok(offset)
        } else {
            Err(INVALID_ARGUMENT)
        }
    }

    fn event_set(&mut self, set: nvmlEventSet_t) -> Res<&mut EventSet> {
        self.event_sets
            .iter_mut()
            .find(|s| s.handle() == set)
            .ok_or(INVALID_ARGUMENT)
    }
}

fn handle(index: usize) -> nvmlDevice_t {
    DEVICE_SLOTS
        .as_ptr()
        .wrapping_add(index)
        .cast_mut()
        .cast::<nvmlDevice_st>()
}

/// What a per-device call sees: one GPU that is not lost, and the node around it.
struct Gpu<'a> {
    index: usize,
    spec: &'a GpuSpec,
    profile: &'a Profile,
    links: &'a [NvLinkSpec],
    faults: &'a Faults,
}

impl Gpu<'_> {
    fn memory_used_bytes(&self) -> u64 {
        self.faults
            .memory_used_mib(self.spec.index)
            .min(self.spec.memory_mib)
            .saturating_mul(MIB)
    }

    fn memory_total_bytes(&self) -> u64 {
        self.spec.memory_mib.saturating_mul(MIB)
    }

    /// Share of memory in use, 0..=100; the telemetry follows it.
    fn busy_percent(&self) -> u32 {
        let used = u128::from(
            self.faults
                .memory_used_mib(self.spec.index)
                .min(self.spec.memory_mib),
        );
        (used * 100 / u128::from(self.spec.memory_mib.max(1))) as u32
    }

    /// NVLink queries: NotSupported without links, InvalidArg from link 18, else the link if active.
    fn nvlink(&self, link: c_uint) -> Res<Option<&NvLinkSpec>> {
        if self.links.is_empty() {
            return Err(NOT_SUPPORTED);
        }
        if link >= MAX_NVLINKS {
            return Err(INVALID_ARGUMENT);
        }
        Ok(self.links.iter().find(|l| l.link == link))
    }

    fn shares_nvlink_with(&self, other: &Gpu<'_>) -> bool {
        let to_switch = |links: &[NvLinkSpec]| links.iter().any(|l| l.remote_is_switch);
        (to_switch(self.links) && to_switch(other.links))
            || self
                .links
                .iter()
                .any(|l| !l.remote_is_switch && l.remote_bus_id == other.spec.bus_id)
    }
}

const MIB: u64 = 1024 * 1024;

/// Runs an export's body: no unwind crosses the C boundary.
fn ffi(body: impl FnOnce() -> Res<()>) -> nvmlReturn_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => UNKNOWN,
    }
}

fn with_node<T>(f: impl FnOnce(&mut Node) -> Res<T>) -> Res<T> {
    let mut state = lock();
    let node = state.node.as_mut().ok_or(UNINITIALIZED)?;
    f(node)
}

/// Blocks, without the lock, while any of `devices` is a hung GPU.
fn wait_while_hung(devices: &[nvmlDevice_t]) -> Res<()> {
    loop {
        let hung = with_node(|node| {
            let gpus = devices
                .iter()
                .map(|&d| Ok(node.profile.gpus[node.index_of(d)?].index))
                .collect::<Res<Vec<u32>>>()?;
            let faults = node.inject.current();
            Ok(gpus.into_iter().any(|gpu| faults.is_hung(gpu)))
        })?;
        if !hung {
            return Ok(());
        }
        std::thread::sleep(POLL);
    }
}

/// A per-device call: initialised, valid handle, GPU not lost (waiting while it is hung).
fn with_gpu<T>(device: nvmlDevice_t, f: impl FnOnce(&Gpu<'_>) -> Res<T>) -> Res<T> {
    wait_while_hung(&[device])?;
    with_node(|node| {
        let index = node.index_of(device)?;
        let faults = node.inject.current();
        let gpu = gpu_view(&node.profile, &node.links, faults, index)?;
        f(&gpu)
    })
}

/// A call about two devices; either being lost fails it.
fn with_gpu_pair<T>(
    a: nvmlDevice_t,
    b: nvmlDevice_t,
    f: impl FnOnce(&Gpu<'_>, &Gpu<'_>) -> Res<T>,
) -> Res<T> {
    wait_while_hung(&[a, b])?;
    with_node(|node| {
        let (ia, ib) = (node.index_of(a)?, node.index_of(b)?);
        let faults = node.inject.current();
        let ga = gpu_view(&node.profile, &node.links, faults, ia)?;
        let gb = gpu_view(&node.profile, &node.links, faults, ib)?;
        f(&ga, &gb)
    })
}

fn gpu_view<'a>(
    profile: &'a Profile,
    links: &'a [Vec<NvLinkSpec>],
    faults: &'a Faults,
    index: usize,
) -> Res<Gpu<'a>> {
    let spec = profile.gpus.get(index).ok_or(INVALID_ARGUMENT)?;
    if faults.is_lost(spec.index) {
        return Err(GPU_IS_LOST);
    }
    Ok(Gpu {
        index,
        spec,
        profile,
        links: links.get(index).map(Vec::as_slice).unwrap_or(&[]),
        faults,
    })
}

/// Stores an answer through a caller's pointer.
unsafe fn put<T>(out: *mut T, value: T) -> Res<()> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and NVML's contract is that it points at a writable T.
    unsafe { out.write(value) };
    Ok(())
}

/// Copies a string and its NUL into a caller's buffer of `length` bytes.
unsafe fn put_str(buf: *mut c_char, length: c_uint, text: &str) -> Res<()> {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let bytes = text.as_bytes();
    if bytes.len() >= length as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: the caller's buffer holds `length` > bytes.len() bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len());
        buf.add(bytes.len()).write(0);
    }
    Ok(())
}

/// Reads a caller's NUL-terminated string.
unsafe fn get_str<'a>(text: *const c_char) -> Res<&'a str> {
    if text.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and NVML's contract is that it is NUL-terminated.
    unsafe { CStr::from_ptr(text) }
        .to_str()
        .map_err(|_| INVALID_ARGUMENT)
}

/// A fixed-size C string field, truncated to fit with its NUL.
fn c_field<const N: usize>(text: &str) -> [c_char; N] {
    let mut field = [0 as c_char; N];
    for (dst, &src) in field
        .iter_mut()
        .zip(text.as_bytes().iter().take(N.saturating_sub(1)))
    {
        *dst = src as c_char;
    }
    field
}

/// `nvmlPciInfo_t` for a bus id in NVML's `DDDDDDDD:BB:DD.F` form.
fn pci_info(bus_id: &str, pci_device_id: u32, pci_sub_system_id: u32) -> nvmlPciInfo_t {
    let (domain, bus, device, function) = parse_bus_id(bus_id).unwrap_or((0, 0, 0, 0));
    nvmlPciInfo_t {
        busIdLegacy: c_field(&format!("{domain:04X}:{bus:02X}:{device:02X}.{function:X}")),
        domain,
        bus,
        device,
        pciDeviceId: pci_device_id,
        pciSubSystemId: pci_sub_system_id,
        busId: c_field(&format!("{domain:08X}:{bus:02X}:{device:02X}.{function:X}")),
    }
}

fn parse_bus_id(bus_id: &str) -> Option<(u32, u32, u32, u32)> {
    let canonical = gpumem_profile::normalize_bus_id(bus_id)?;
    let mut parts = canonical.split([':', '.']);
    let mut next = || parts.next().and_then(|p| u32::from_str_radix(p, 16).ok());
    Some((next()?, next()?, next()?, next()?))
}

/// PCI (device id << 16 | vendor 0x10DE, subsystem id) of a GPU model, as real boards report them;
/// made up, but stable, for models this table does not know.
fn pci_ids(product: &str) -> (u32, u32) {
    match product {
        "NVIDIA A100-SXM4-80GB" => (0x20B2_10DE, 0x147F_10DE),
        "NVIDIA A100-SXM4-40GB" => (0x20B0_10DE, 0x134F_10DE),
        "NVIDIA H100 80GB HBM3" => (0x2330_10DE, 0x16C1_10DE),
        "Tesla V100-SXM2-32GB" => (0x1DB5_10DE, 0x1249_10DE),
        "Tesla V100-SXM2-16GB" => (0x1DB1_10DE, 0x1212_10DE),
        "Tesla T4" => (0x1EB8_10DE, 0x12A2_10DE),
        other => {
            let hash = other.bytes().fold(0x811c_9dc5_u32, |h, b| {
                (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
            });
            let device = 0x2000 + (hash & 0x0FFF);
            (device << 16 | 0x10DE, (hash >> 16) << 16 | 0x10DE)
        }
    }
}

/// PCI device id of the NVSwitch chips a GPU's links go into (NVSwitch v2 for A100, v3 for H100).
fn nvswitch_pci_id(gpu_product: &str) -> u32 {
    if gpu_product.contains("H100") || gpu_product.contains("H200") {
        0x22A3_10DE
    } else {
        0x1AF1_10DE
    }
}

/// Board power limit in milliwatts, to scale the simulated power draw.
fn power_limit_mw(product: &str) -> u32 {
    if product.contains("H100") {
        700_000
    } else if product.contains("A100") {
        400_000
    } else if product.contains("V100") {
        300_000
    } else if product.contains("T4") {
        70_000
    } else {
        250_000
    }
}

// ---------------------------------------------------------------------------------------------
// Initialisation and system queries

fn current_env() -> [Option<OsString>; 2] {
    [std::env::var_os(PROFILE_ENV), std::env::var_os(INJECT_ENV)]
}

fn init() -> Res<()> {
    let mut state = lock();
    if state.refs > 0 {
        state.refs += 1;
        if let Some(node) = &state.node
            && node.env != current_env()
        {
            // Typically tests sharing a process, one still holding NVML open (an Nvml, or a
            // thread's clone of one) while the next sets its own environment.
            warn(&format!(
                "{PROFILE_ENV}/{INJECT_ENV} changed to {:?} but NVML is still initialised ({} inits \
                 not shut down) with {:?}; keeping the profile {} and its inject file until the last \
                 nvmlShutdown",
                current_env(),
                state.refs - 1,
                node.env,
                node.profile.name
            ));
        }
        return Ok(());
    }
    let node = Node::from_env()?;
    state.node = Some(node);
    state.refs = 1;
    Ok(())
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    ffi(init)
}

/// Flags (`NVML_INIT_FLAG_NO_GPUS`, `NVML_INIT_FLAG_NO_ATTACH`) change nothing here.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    ffi(init)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    ffi(|| {
        let mut state = lock();
        if state.refs == 0 {
            return Err(UNINITIALIZED);
        }
        state.refs -= 1;
        if state.refs == 0 {
            // Handles and event sets die with the last shutdown, as in real NVML.
            state.node = None;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    #[allow(non_upper_case_globals)]
    let text: &'static CStr = match result {
        nvmlReturn_enum_NVML_SUCCESS => c"Success",
        nvmlReturn_enum_NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => c"Not Supported",
        nvmlReturn_enum_NVML_ERROR_NO_PERMISSION => c"Insufficient Permissions",
        nvmlReturn_enum_NVML_ERROR_ALREADY_INITIALIZED => c"Already Initialized",
        nvmlReturn_enum_NVML_ERROR_NOT_FOUND => c"Not Found",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_POWER => c"Insufficient External Power",
        nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED => c"Driver Not Loaded",
        nvmlReturn_enum_NVML_ERROR_TIMEOUT => c"Timeout",
        nvmlReturn_enum_NVML_ERROR_IRQ_ISSUE => c"Interrupt request issue",
        nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND => c"NVML Shared Library Not Found",
        nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND => c"Function Not Found",
        nvmlReturn_enum_NVML_ERROR_CORRUPTED_INFOROM => c"Corrupted infoROM",
        nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST => c"GPU is lost",
        nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED => c"GPU requires restart",
        nvmlReturn_enum_NVML_ERROR_OPERATING_SYSTEM => c"The operating system has blocked the request.",
        nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH => c"RM has detected an NVML/RM version mismatch.",
        nvmlReturn_enum_NVML_ERROR_IN_USE => c"In use by another client",
        nvmlReturn_enum_NVML_ERROR_MEMORY => c"Insufficient Memory",
        nvmlReturn_enum_NVML_ERROR_NO_DATA => c"No data",
        nvmlReturn_enum_NVML_ERROR_VGPU_ECC_NOT_SUPPORTED => {
            c"The requested vgpu operation is not available on target device, because ECC is enabled"
        }
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES => {
            c"Ran out of critical resources, other than memory"
        }
        nvmlReturn_enum_NVML_ERROR_FREQ_NOT_SUPPORTED => c"The requested frequency is not supported",
        nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH => {
            c"The provided version is invalid/unsupported"
        }
        nvmlReturn_enum_NVML_ERROR_DEPRECATED => c"The requested functionality has been deprecated",
        nvmlReturn_enum_NVML_ERROR_NOT_READY => c"The system is not ready for the request",
        nvmlReturn_enum_NVML_ERROR_GPU_NOT_FOUND => c"No GPUs were found",
        nvmlReturn_enum_NVML_ERROR_INVALID_STATE => c"Invalid state",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    ffi(|| {
        let text = with_node(|node| Ok(node.profile.driver_version.clone()))?;
        unsafe { put_str(version, length, &text) }
    })
}

/// NVML's own version: the CUDA major version, then the driver version (`12.550.90.07`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    ffi(|| {
        let text = with_node(|node| {
            Ok(format!(
                "{}.{}",
                node.profile.cuda_version / 1000,
                node.profile.driver_version
            ))
        })?;
        unsafe { put_str(version, length, &text) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(cuda_driver_version: *mut c_int) -> nvmlReturn_t {
    ffi(|| {
        let version = with_node(|node| Ok(node.profile.cuda_version))?;
        unsafe { put(cuda_driver_version, version) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(cuda_driver_version: *mut c_int) -> nvmlReturn_t {
    unsafe { nvmlSystemGetCudaDriverVersion_v2(cuda_driver_version) }
}

// ---------------------------------------------------------------------------------------------
// Device handles

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(device_count: *mut c_uint) -> nvmlReturn_t {
    ffi(|| {
        // Lost GPUs are still counted, as the driver does.
        let count = with_node(|node| Ok(node.profile.gpus.len() as c_uint))?;
        unsafe { put(device_count, count) }
    })
}

/// The handle of GPU `index`, unless that GPU is lost.
fn handle_of(node: &mut Node, index: usize) -> Res<nvmlDevice_t> {
    let faults = node.inject.current();
    gpu_view(&node.profile, &node.links, faults, index).map(|gpu| handle(gpu.index))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        let found = with_node(|node| handle_of(node, index as usize))?;
        unsafe { put(device, found) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        let wanted = unsafe { get_str(uuid) }?;
        let found = with_node(|node| {
            let index = node
                .profile
                .gpus
                .iter()
                .position(|g| g.uuid == wanted)
                .ok_or(NOT_FOUND)?;
            handle_of(node, index)
        })?;
        unsafe { put(device, found) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    pci_bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        let wanted = unsafe { get_str(pci_bus_id) }?;
        let found = with_node(|node| {
            let gpu = node.profile.gpu_by_bus_id(wanted).ok_or(NOT_FOUND)?;
            handle_of(node, gpu.index as usize)
        })?;
        unsafe { put(device, found) }
    })
}

// ---------------------------------------------------------------------------------------------
// Device identity and placement

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    ffi(|| {
        let value = with_gpu(device, |gpu| Ok(gpu.spec.index))?;
        unsafe { put(index, value) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let value = with_gpu(device, |gpu| Ok(gpu.spec.uuid.clone()))?;
        unsafe { put_str(uuid, length, &value) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor_number: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let value = with_gpu(device, |gpu| Ok(gpu.spec.minor_number))?;
        unsafe { put(minor_number, value) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let value = with_gpu(device, |gpu| Ok(gpu.spec.product.clone()))?;
        unsafe { put_str(name, length, &value) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let info = with_gpu(device, |gpu| {
            let (device_id, subsystem_id) = pci_ids(&gpu.spec.product);
            Ok(pci_info(&gpu.spec.bus_id, device_id, subsystem_id))
        })?;
        unsafe { put(pci, info) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    ffi(|| {
        let (ma, mi) = with_gpu(device, |gpu| Ok(gpu.spec.compute_capability))?;
        if major.is_null() || minor.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        unsafe {
            put(major, ma as c_int)?;
            put(minor, mi as c_int)
        }
    })
}

/// NotSupported for a GPU whose profile entry has no NUMA node.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(device: nvmlDevice_t, node: *mut c_uint) -> nvmlReturn_t {
    ffi(|| {
        let value = with_gpu(device, |gpu| gpu.spec.numa_node.ok_or(NOT_SUPPORTED))?;
        unsafe { put(node, value) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    path_info: *mut nvmlGpuTopologyLevel_t,
) -> nvmlReturn_t {
    ffi(|| {
        let level = with_gpu_pair(device1, device2, |a, b| {
            Ok(a.profile.topology_level(a.index, b.index) as u32)
        })?;
        unsafe { put(path_info, level) }
    })
}

/// NVLINK: OK when the two GPUs share a direct link or both link into NVSwitch. READ, WRITE and
/// PCI (PROP): OK over NVLink, or over PCIe without crossing the CPU interconnect. ATOMICS: NVLink
/// only. A GPU with itself: OK.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetP2PStatus(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    p2p_index: nvmlGpuP2PCapsIndex_t,
    p2p_status: *mut nvmlGpuP2PStatus_t,
) -> nvmlReturn_t {
    ffi(|| {
        let status = with_gpu_pair(device1, device2, |a, b| {
            let nvlink = a.index == b.index || a.shares_nvlink_with(b);
            let pcie = a.index == b.index
                || a.profile.topology_level(a.index, b.index) < gpumem_profile::TopologyLevel::System;
            #[allow(non_upper_case_globals)]
            let ok = match p2p_index {
                nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK
                | nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_ATOMICS => nvlink,
                nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_READ
                | nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_WRITE
                | nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_PCI => nvlink || pcie,
                _ => return Err(INVALID_ARGUMENT),
            };
            Ok(if ok {
                nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK
            } else if p2p_index == nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK
                || p2p_index == nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_ATOMICS
            {
                nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_NOT_SUPPORTED
            } else {
                nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED
            })
        })?;
        unsafe { put(p2p_status, status) }
    })
}

// ---------------------------------------------------------------------------------------------
// NVLink

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    is_active: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    ffi(|| {
        let state = with_gpu(device, |gpu| {
            Ok(match gpu.nvlink(link)? {
                Some(_) => nvmlEnableState_enum_NVML_FEATURE_ENABLED,
                None => nvmlEnableState_enum_NVML_FEATURE_DISABLED,
            })
        })?;
        unsafe { put(is_active, state) }
    })
}

/// PCI info of the far end of an active link (peer GPU or NVSwitch); NotSupported on an inactive
/// link. `pciSubSystemId` is 0 ("indeterminate" in NVML's documentation).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let info = with_gpu(device, |gpu| {
            let spec = gpu.nvlink(link)?.ok_or(NOT_SUPPORTED)?;
            let device_id = if spec.remote_is_switch {
                nvswitch_pci_id(&gpu.spec.product)
            } else {
                let peer = gpu.profile.gpu_by_bus_id(&spec.remote_bus_id);
                pci_ids(peer.map_or(gpu.spec.product.as_str(), |p| p.product.as_str())).0
            };
            Ok(pci_info(&spec.remote_bus_id, device_id, 0))
        })?;
        unsafe { put(pci, info) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    device: nvmlDevice_t,
    link: c_uint,
    device_type: *mut nvmlIntNvLinkDeviceType_t,
) -> nvmlReturn_t {
    ffi(|| {
        let kind = with_gpu(device, |gpu| {
            let spec = gpu.nvlink(link)?.ok_or(NOT_SUPPORTED)?;
            Ok(if spec.remote_is_switch {
                nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH
            } else {
                nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU
            })
        })?;
        unsafe { put(device_type, kind) }
    })
}

// ---------------------------------------------------------------------------------------------
// Memory and telemetry

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    ffi(|| {
        let info = with_gpu(device, |gpu| {
            let (total, used) = (gpu.memory_total_bytes(), gpu.memory_used_bytes());
            Ok(nvmlMemory_t {
                total,
                free: total - used,
                used,
            })
        })?;
        unsafe { put(memory, info) }
    })
}

/// Expects `version` = `nvmlMemory_v2` (struct size | 2 << 24), as nvml-wrapper sets it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    ffi(|| {
        let (total, used) = with_gpu(device, |gpu| {
            Ok((gpu.memory_total_bytes(), gpu.memory_used_bytes()))
        })?;
        if memory.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null; NVML's contract is that it points at an nvmlMemory_v2_t.
        let version = unsafe { std::ptr::addr_of!((*memory).version).read() };
        if version >> 24 != 2 {
            return Err(VERSION_MISMATCH);
        }
        let info = nvmlMemory_v2_t {
            version,
            total,
            reserved: 0,
            free: total - used,
            used,
        };
        unsafe { put(memory, info) }
    })
}

/// 30 °C idle, up to 75 °C with all memory in use. Only the GPU sensor exists.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor_type: nvmlTemperatureSensors_t,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let value = with_gpu(device, |gpu| {
            if sensor_type != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
                return Err(INVALID_ARGUMENT);
            }
            Ok(30 + gpu.busy_percent() * 45 / 100)
        })?;
        unsafe { put(temp, value) }
    })
}

/// Milliwatts: 15% of the board's power limit idle, up to 100% with all memory in use.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(device: nvmlDevice_t, power: *mut c_uint) -> nvmlReturn_t {
    ffi(|| {
        let value = with_gpu(device, |gpu| {
            let limit = power_limit_mw(&gpu.spec.product);
            Ok(limit / 100 * (15 + gpu.busy_percent() * 85 / 100))
        })?;
        unsafe { put(power, value) }
    })
}

/// GPU and memory utilisation both equal the share of memory in use.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    ffi(|| {
        let busy = with_gpu(device, |gpu| Ok(gpu.busy_percent()))?;
        unsafe {
            put(
                utilization,
                nvmlUtilization_t {
                    gpu: busy,
                    memory: busy,
                },
            )
        }
    })
}

/// Always an empty list: `*info_count` = 0 and success, whatever the buffer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    _infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        with_gpu(device, |_| Ok(()))?;
        unsafe { put(info_count, 0) }
    })
}

// ---------------------------------------------------------------------------------------------
// Events

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    event_types: *mut c_ulonglong,
) -> nvmlReturn_t {
    ffi(|| {
        with_gpu(device, |_| Ok(()))?;
        unsafe { put(event_types, SUPPORTED_EVENTS) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    ffi(|| {
        if set.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let created = with_node(|node| {
            let event_set = EventSet {
                anchor: Box::new(0),
                registered: BTreeMap::new(),
                cursor: 0,
                lost_reported: BTreeSet::new(),
            };
            let handle = event_set.handle();
            node.event_sets.push(event_set);
            Ok(handle)
        })?;
        unsafe { put(set, created) }
    })
}

/// Types outside nvmlDeviceGetSupportedEventTypes: NotSupported (nothing is registered).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    event_types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    ffi(|| {
        with_node(|node| {
            let index = node.index_of(device)?;
            let faults = node.inject.current();
            let gpu = gpu_view(&node.profile, &node.links, faults, index)?.spec.index;
            let event_set = node.event_set(set)?;
            if event_types & !SUPPORTED_EVENTS != 0 {
                return Err(NOT_SUPPORTED);
            }
            *event_set.registered.entry(gpu).or_insert(0) |= event_types;
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    ffi(|| {
        with_node(|node| {
            let position = node
                .event_sets
                .iter()
                .position(|s| s.handle() == set)
                .ok_or(INVALID_ARGUMENT)?;
            node.event_sets.remove(position);
            Ok(())
        })
    })
}

/// The next event of a set, if one is ready (see "Event delivery" at the top).
fn next_event(node: &mut Node, set: nvmlEventSet_t) -> Res<Option<nvmlEventData_t>> {
    let faults = node.inject.current();
    let event_set = node
        .event_sets
        .iter_mut()
        .find(|s| s.handle() == set)
        .ok_or(INVALID_ARGUMENT)?;
    if let Some(code) = faults.event_wait_error {
        return Err(code);
    }
    let event = |gpu: u32, xid: u64| nvmlEventData_t {
        device: handle(gpu as usize),
        eventType: XID_EVENT,
        eventData: xid,
        gpuInstanceId: NO_INSTANCE,
        computeInstanceId: NO_INSTANCE,
    };
    let gpu_count = node.profile.gpus.len();

    event_set.lost_reported.retain(|&gpu| faults.is_lost(gpu));
    let newly_lost = event_set.registered.keys().copied().find(|&gpu| {
        faults.is_lost(gpu) && !event_set.lost_reported.contains(&gpu) && event_set.wants_xid(gpu)
    });
    if let Some(gpu) = newly_lost {
        event_set.lost_reported.insert(gpu);
        return Ok(Some(event(gpu, XID_FALLEN_OFF_THE_BUS)));
    }

    event_set.cursor = event_set.cursor.min(faults.xid.len());
    while let Some(entry) = faults.xid.get(event_set.cursor) {
        event_set.cursor += 1;
        if (entry.gpu as usize) < gpu_count && event_set.wants_xid(entry.gpu) {
            return Ok(Some(event(entry.gpu, entry.xid)));
        }
    }
    Ok(None)
}

/// Blocks up to `timeoutms`, looking for an event every 10 ms; `NVML_ERROR_TIMEOUT` if none came,
/// the injected `event_wait_error` at once while there is one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        if data.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let deadline = Instant::now() + Duration::from_millis(u64::from(timeoutms));
        loop {
            // The lock is held only while looking, never while sleeping.
            if let Some(event) = with_node(|node| next_event(node, set))? {
                return unsafe { put(data, event) };
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TIMEOUT);
            }
            std::thread::sleep((deadline - now).min(POLL));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_info_formats_both_bus_id_forms() {
        let info = pci_info("00000000:4E:00.0", 0x20B2_10DE, 0x147F_10DE);
        let text = |field: &[c_char]| {
            unsafe { CStr::from_ptr(field.as_ptr()) }
                .to_str()
                .unwrap()
                .to_string()
        };
        assert_eq!(text(&info.busId), "00000000:4E:00.0");
        assert_eq!(text(&info.busIdLegacy), "0000:4E:00.0");
        assert_eq!((info.domain, info.bus, info.device), (0, 0x4E, 0));
    }

    #[test]
    fn error_strings_are_never_null() {
        for code in [0, 1, 2, 3, 9, 10, 15, 25, 999, 12345] {
            assert!(!nvmlErrorString(code).is_null());
        }
    }

    #[test]
    fn unknown_products_get_stable_nvidia_ids() {
        let (device, subsystem) = pci_ids("Some Future GPU");
        assert_eq!(device & 0xFFFF, 0x10DE);
        assert_eq!(subsystem & 0xFFFF, 0x10DE);
        assert_eq!(pci_ids("Some Future GPU"), (device, subsystem));
    }
}
