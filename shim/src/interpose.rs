//! The exported symbols: CUDA driver and NVML wrappers, `dlsym`, and what they share.
//!
//! Not compiled into the unit-test executable (`cfg(not(test))` in `lib.rs`): exporting `dlsym`
//! and CUDA symbols from a test binary would interpose them in the test process itself.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::null_mut;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicUsize, Ordering};

use gpumem_accounting::{
    Accounting, Limits, MAX_SLOTS, Opened, SlotId, UNLIMITED, is_alive, process_start_time,
};

use crate::config::{Config, Level};
use crate::sizes::{array_bytes, mipmapped_bytes};
use crate::table::{Table, pack, unpack};

type CUresult = c_uint;
type CUdeviceptr = u64;

const SUCCESS: CUresult = 0;
const OUT_OF_MEMORY: CUresult = 2;
const NOT_FOUND: CUresult = 500;
const NVML_SUCCESS: c_uint = 0;
const NVML_ERROR_FUNCTION_NOT_FOUND: c_uint = 13;
const LOCATION_DEVICE: c_uint = 1;
const PER_THREAD_DEFAULT_STREAM: u64 = 2;

// -------------------------------------------------------------------------------------------------
// Configuration and logging

static CONFIG: OnceLock<Config> = OnceLock::new();

/// The environment, read once (at load, by the constructor below, or by whichever entry point
/// runs first if another library's constructor calls in earlier).
fn config() -> &'static Config {
    CONFIG.get_or_init(Config::from_env)
}

macro_rules! log {
    ($level:ident, $($arg:tt)*) => {
        crate::log::emit(config().log, Level::$level, format_args!($($arg)*))
    };
}

#[used]
#[unsafe(link_section = ".init_array")]
static CONSTRUCTOR: extern "C" fn() = constructor;

#[used]
#[unsafe(link_section = ".fini_array")]
static DESTRUCTOR: extern "C" fn() = destructor;

extern "C" fn constructor() {
    let _ = catch_unwind(|| {
        let config = config();
        for problem in &config.problems {
            log!(Error, "{problem}");
        }
        if let Some(limits) = &config.limits {
            log!(
                Debug,
                "limits (bytes per device) {limits:?}, accounting directory {:?}",
                config.dir
            );
        }
        let _ = real_dlsym();
        // SAFETY: registers a handler that only stores atomics.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
}

/// At a clean exit, give the slot back now rather than leave it to a reaper. Later frees (other
/// libraries' exit handlers) are then no longer counted.
extern "C" fn destructor() {
    let enforcer = ENFORCER.load(Ordering::Acquire);
    // SAFETY: a non-null ENFORCER points at a leaked, never freed Enforcer.
    if let Some(enforcer) = unsafe { enforcer.as_ref() } {
        enforcer.closed.store(true, Ordering::Relaxed);
        if let Some(slot) = enforcer.slot {
            enforcer.acct.release_slot(slot, enforcer.pid);
        }
    }
}

/// A forked child is another process: it gets its own slot and its own first warning.
extern "C" fn after_fork_in_child() {
    ENFORCER.store(null_mut(), Ordering::Relaxed);
    ENFORCER_INIT.store(false, Ordering::Relaxed);
    OVER_LIMIT_LOGGED.store(false, Ordering::Relaxed);
    TABLE_FULL_LOGGED.store(false, Ordering::Relaxed);
}

// -------------------------------------------------------------------------------------------------
// The real functions

#[derive(Clone, Copy, PartialEq, Eq)]
enum Lib {
    Cuda,
    Nvml,
}

macro_rules! symbols {
    (wrapped { $($w:ident: $wl:ident),* $(,)? } helpers { $($h:ident: $hl:ident),* $(,)? }) => {
        /// Every driver symbol the shim calls; the wrapped ones are also exported by the shim.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, PartialEq, Eq, Debug)]
        enum Sym { $($w,)* $($h,)* }

        const SYMBOLS: &[(Sym, &CStr, Lib, bool)] = &[
            $((Sym::$w, cstr(concat!(stringify!($w), "\0")), Lib::$wl, true),)*
            $((Sym::$h, cstr(concat!(stringify!($h), "\0")), Lib::$hl, false),)*
        ];

        /// The shim's own export for a wrapped symbol.
        fn wrapper(sym: Sym) -> *mut c_void {
            match sym {
                $(Sym::$w => $w as *mut c_void,)*
                _ => null_mut(),
            }
        }
    };
}

const fn cstr(bytes: &str) -> &CStr {
    match CStr::from_bytes_with_nul(bytes.as_bytes()) {
        Ok(s) => s,
        Err(_) => panic!("symbol names are NUL-terminated"),
    }
}

symbols! {
    wrapped {
        cuMemAlloc_v2: Cuda, cuMemAlloc: Cuda,
        cuMemAllocPitch_v2: Cuda, cuMemAllocPitch: Cuda,
        cuMemAllocManaged: Cuda,
        cuMemAllocAsync: Cuda, cuMemAllocAsync_ptsz: Cuda,
        cuMemAllocFromPoolAsync: Cuda, cuMemAllocFromPoolAsync_ptsz: Cuda,
        cuMemFree_v2: Cuda, cuMemFree: Cuda,
        cuMemFreeAsync: Cuda, cuMemFreeAsync_ptsz: Cuda,
        cuMemCreate: Cuda, cuMemRelease: Cuda,
        cuArrayCreate_v2: Cuda, cuArrayCreate: Cuda,
        cuArray3DCreate_v2: Cuda, cuArray3DCreate: Cuda,
        cuArrayDestroy: Cuda,
        cuMipmappedArrayCreate: Cuda, cuMipmappedArrayDestroy: Cuda,
        cuMemGetInfo_v2: Cuda, cuMemGetInfo: Cuda,
        cuGetProcAddress: Cuda, cuGetProcAddress_v2: Cuda,
        nvmlDeviceGetMemoryInfo: Nvml, nvmlDeviceGetMemoryInfo_v2: Nvml,
    }
    helpers {
        cuCtxGetDevice: Cuda, cuDeviceGetCount: Cuda, nvmlDeviceGetIndex: Nvml,
    }
}

const COUNT: usize = SYMBOLS.len();
static REAL: [AtomicUsize; COUNT] = [const { AtomicUsize::new(0) }; COUNT];

fn lib_of(sym: Sym) -> Lib {
    SYMBOLS.get(sym as usize).map_or(Lib::Cuda, |s| s.2)
}

const UNRESOLVED: u8 = 0;
const RESOLVING: u8 = 1;
const READY: u8 = 2;

static CUDA_STATE: AtomicU8 = AtomicU8::new(UNRESOLVED);
static NVML_STATE: AtomicU8 = AtomicU8::new(UNRESOLVED);

thread_local! {
    /// Set while this thread resolves a library: its loader may call back into `dlsym`.
    static RESOLVING_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn state(lib: Lib) -> &'static AtomicU8 {
    match lib {
        Lib::Cuda => &CUDA_STATE,
        Lib::Nvml => &NVML_STATE,
    }
}

/// Whether `lib`'s real functions are known. `load`: `dlopen` it if needed (an exported wrapper
/// was called, so the program uses the library); otherwise only find it if already loaded.
#[inline]
fn ensure(lib: Lib, load: bool) -> bool {
    state(lib).load(Ordering::Acquire) == READY || resolve(lib, load)
}

#[cold]
#[inline(never)]
fn resolve(lib: Lib, load: bool) -> bool {
    if RESOLVING_HERE.with(|r| r.get()) {
        return false;
    }
    let state = state(lib);
    loop {
        match state.compare_exchange(UNRESOLVED, RESOLVING, Ordering::Acquire, Ordering::Acquire) {
            Ok(_) => {
                RESOLVING_HERE.with(|r| r.set(true));
                let ok = catch_unwind(|| resolve_now(lib, load)).unwrap_or(false);
                RESOLVING_HERE.with(|r| r.set(false));
                state.store(if ok { READY } else { UNRESOLVED }, Ordering::Release);
                return ok;
            }
            Err(READY) => return true,
            Err(_) => std::thread::yield_now(),
        }
    }
}

fn resolve_now(lib: Lib, load: bool) -> bool {
    let soname = match lib {
        Lib::Cuda => c"libcuda.so.1",
        Lib::Nvml => c"libnvidia-ml.so.1",
    };
    let flags = libc::RTLD_LAZY | if load { 0 } else { libc::RTLD_NOLOAD };
    // SAFETY: a NUL-terminated name. The handle is never closed: the library stays loaded.
    let handle = unsafe { libc::dlopen(soname.as_ptr(), flags) };
    let Some(dlsym) = real_dlsym() else { return false };
    if handle.is_null() {
        if load {
            log!(Debug, "cannot load {soname:?}");
        }
        return false;
    }
    for &(sym, name, owner, _) in SYMBOLS {
        if owner == lib {
            // SAFETY: a valid handle and NUL-terminated name.
            let address = unsafe { dlsym(handle, name.as_ptr()) };
            if let Some(slot) = REAL.get(sym as usize) {
                slot.store(address as usize, Ordering::Relaxed);
            }
        }
    }
    log!(Debug, "resolved {soname:?}");
    true
}

/// The real function's address, 0 if the library or the symbol is missing.
#[inline]
fn real_address(sym: Sym) -> usize {
    if !ensure(lib_of(sym), true) {
        return 0;
    }
    REAL.get(sym as usize).map_or(0, |a| a.load(Ordering::Relaxed))
}

/// The real driver function `$sym` as type `$ty`, or `None`.
macro_rules! real {
    ($sym:ident as $ty:ty) => {
        match real_address(Sym::$sym) {
            0 => None,
            // SAFETY: the address of the driver's `$sym`, whose C signature is `$ty`.
            address => Some(unsafe { std::mem::transmute::<usize, $ty>(address) }),
        }
    };
}

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// glibc's `dlsym`, found with `dlvsym(RTLD_NEXT, ...)` (the shim's own `dlsym` shadows it).
fn real_dlsym() -> Option<DlsymFn> {
    let mut address = REAL_DLSYM.load(Ordering::Relaxed);
    if address == 0 {
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            // SAFETY: NUL-terminated strings.
            let found = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !found.is_null() {
                address = found as usize;
                REAL_DLSYM.store(address, Ordering::Relaxed);
                break;
            }
        }
    }
    // SAFETY: glibc's dlsym has this signature.
    (address != 0).then(|| unsafe { std::mem::transmute::<usize, DlsymFn>(address) })
}

// -------------------------------------------------------------------------------------------------
// The enforcer: accounting, tables, device of the caller

struct Enforcer {
    acct: Accounting,
    slot: Option<SlotId>,
    pid: u32,
    /// Device pointers of every allocation call, VMM handles, arrays and mipmapped arrays.
    pointers: Table,
    handles: Table,
    arrays: Table,
    devices: AtomicU8,
    /// Set at exit, after which nothing is counted any more.
    closed: AtomicBool,
}

const DEVICES_UNKNOWN: u8 = 0;
const DEVICES_ONE: u8 = 1;
const DEVICES_MANY: u8 = 2;

static ENFORCER: AtomicPtr<Enforcer> = AtomicPtr::new(null_mut());
static ENFORCER_INIT: AtomicBool = AtomicBool::new(false);
static OVER_LIMIT_LOGGED: AtomicBool = AtomicBool::new(false);
static TABLE_FULL_LOGGED: AtomicBool = AtomicBool::new(false);

enum Gate {
    /// No limit set: pass through untouched.
    Pass,
    Enforce(&'static Enforcer),
    /// A limit is set but no accounting could be set up at all: refuse allocations.
    Refuse,
}

#[inline]
fn gate() -> Gate {
    let Some(limits) = &config().limits else {
        return Gate::Pass;
    };
    // SAFETY: a non-null ENFORCER points at a leaked, never freed Enforcer.
    match unsafe { ENFORCER.load(Ordering::Acquire).as_ref() } {
        Some(enforcer) => Gate::Enforce(enforcer),
        None => start_enforcing(limits),
    }
}

#[cold]
#[inline(never)]
fn start_enforcing(limits: &Limits) -> Gate {
    loop {
        // SAFETY: as in `gate`.
        if let Some(enforcer) = unsafe { ENFORCER.load(Ordering::Acquire).as_ref() } {
            return Gate::Enforce(enforcer);
        }
        if ENFORCER_INIT
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            let built = catch_unwind(|| Enforcer::new(limits)).ok().flatten();
            let gate = match built {
                Some(enforcer) => {
                    let leaked: &'static Enforcer = Box::leak(Box::new(enforcer));
                    ENFORCER.store(std::ptr::from_ref(leaked).cast_mut(), Ordering::Release);
                    Gate::Enforce(leaked)
                }
                None => Gate::Refuse,
            };
            ENFORCER_INIT.store(false, Ordering::Release);
            return gate;
        }
        std::thread::yield_now();
    }
}

impl Enforcer {
    fn new(limits: &Limits) -> Option<Self> {
        let config = config();
        let anonymous = || match Accounting::anonymous(limits) {
            Ok(acct) => Some(acct),
            Err(e) => {
                log!(Error, "{e}; refusing all GPU memory");
                None
            }
        };
        let acct = match &config.dir {
            Some(dir) => match Accounting::open_or_create(dir, limits) {
                Ok((acct, opened)) => {
                    if opened == Opened::LimitsDiffer {
                        log!(
                            Warn,
                            "{} holds other limits than GPUMEM_LIMIT_MIB; this process enforces its own",
                            dir.display()
                        );
                    }
                    acct
                }
                Err(e) => {
                    log!(Warn, "{e}; enforcing the limit within this process only");
                    anonymous()?
                }
            },
            None => {
                log!(
                    Info,
                    "GPUMEM_ACCOUNTING_DIR is not set: enforcing the limit within this process only"
                );
                anonymous()?
            }
        };
        let pid = std::process::id();
        let reclaimed = acct.reap(is_alive);
        if reclaimed > 0 {
            log!(Info, "reclaimed {reclaimed} bytes of processes that have exited");
        }
        let slot = acct.claim_slot(pid, process_start_time(pid).unwrap_or(0));
        if slot.is_none() {
            log!(
                Warn,
                "all {MAX_SLOTS} process slots are taken: this process's usage is counted but cannot be reclaimed if it is killed"
            );
        }
        Some(Self {
            acct,
            slot,
            pid,
            pointers: Table::new(18),
            handles: Table::new(14),
            arrays: Table::new(14),
            devices: AtomicU8::new(DEVICES_UNKNOWN),
            closed: AtomicBool::new(false),
        })
    }

    /// The device the calling thread allocates on: 0 when the process sees one device (asked once),
    /// otherwise the current context's.
    #[inline]
    fn device(&self) -> usize {
        match self.devices.load(Ordering::Relaxed) {
            DEVICES_ONE => 0,
            DEVICES_MANY => context_device(),
            _ => self.count_devices(),
        }
    }

    #[cold]
    #[inline(never)]
    fn count_devices(&self) -> usize {
        if let Some(get_count) = real!(cuDeviceGetCount as unsafe extern "C" fn(*mut c_int) -> CUresult) {
            let mut count = 0;
            // SAFETY: a valid out-pointer.
            if unsafe { get_count(&mut count) } == SUCCESS {
                let many = if count > 1 { DEVICES_MANY } else { DEVICES_ONE };
                self.devices.store(many, Ordering::Relaxed);
            }
        }
        context_device()
    }

    /// Reserves `bytes` on `device` for this container and charges this process: one CAS on the
    /// shared counter, one uncontended add on this process's slot. Over the limit: reap dead
    /// processes once and retry, else log and refuse.
    #[inline]
    fn reserve(&self, device: usize, bytes: u64) -> bool {
        if self.closed.load(Ordering::Relaxed) {
            return true;
        }
        if !self.acct.try_reserve(device, bytes) && !self.reserve_after_reaping(device, bytes) {
            return false;
        }
        if let Some(slot) = self.slot {
            self.acct.charge(slot, device, bytes);
        }
        true
    }

    #[inline]
    fn unreserve(&self, device: usize, bytes: u64) {
        if self.closed.load(Ordering::Relaxed) {
            return;
        }
        self.acct.release(device, bytes);
        if let Some(slot) = self.slot {
            self.acct.discharge(slot, device, bytes);
        }
    }

    #[cold]
    #[inline(never)]
    fn reserve_after_reaping(&self, device: usize, bytes: u64) -> bool {
        let reclaimed = self.acct.reap(is_alive);
        if reclaimed > 0 {
            log!(Info, "reclaimed {reclaimed} bytes of processes that have exited");
            if self.acct.try_reserve(device, bytes) {
                return true;
            }
        }
        let (limit, used) = (self.acct.limit(device), self.acct.used(device));
        if !OVER_LIMIT_LOGGED.swap(true, Ordering::Relaxed) {
            log!(
                Warn,
                "GPU memory limit reached on device {device}: {bytes} more bytes requested, {used} of {limit} in use \
                 by this container; returning CUDA_ERROR_OUT_OF_MEMORY (not logged again by this process)"
            );
        } else {
            log!(
                Debug,
                "refused {bytes} bytes on device {device}: {used} of {limit} in use"
            );
        }
        false
    }

    /// The common shape of every allocation: reserve `estimate`, call the driver, then record the
    /// object under its key with its actual size (`after` returns both; more than the estimate is
    /// reserved on top, or the allocation is undone). On failure the reservation is given back.
    #[inline(always)]
    fn track(
        &self,
        table: &Table,
        device: usize,
        estimate: u64,
        call: impl FnOnce() -> CUresult,
        after: impl FnOnce() -> (u64, u64),
        undo: impl FnOnce(u64),
    ) -> CUresult {
        if !self.reserve(device, estimate) {
            return OUT_OF_MEMORY;
        }
        let result = call();
        if result != SUCCESS {
            self.unreserve(device, estimate);
            return result;
        }
        let (key, actual) = after();
        if actual > estimate && !self.reserve(device, actual - estimate) {
            undo(key);
            self.unreserve(device, estimate);
            return OUT_OF_MEMORY;
        }
        let counted = actual.max(estimate);
        if !table.insert(key, pack(counted, device)) {
            undo(key);
            self.unreserve(device, counted);
            if !TABLE_FULL_LOGGED.swap(true, Ordering::Relaxed) {
                log!(
                    Warn,
                    "too many live allocations to track; returning CUDA_ERROR_OUT_OF_MEMORY"
                );
            }
            return OUT_OF_MEMORY;
        }
        SUCCESS
    }

    /// The common shape of every free: forget the object, call the driver, give the memory back
    /// (or remember the object again if the driver refused). Unknown objects pass through.
    #[inline(always)]
    fn untrack(&self, table: &Table, key: u64, call: impl FnOnce() -> CUresult) -> CUresult {
        let Some(value) = (key != 0).then(|| table.remove(key)).flatten() else {
            return call();
        };
        let result = call();
        if result == SUCCESS {
            let (bytes, device) = unpack(value);
            self.unreserve(device, bytes);
        } else {
            table.insert(key, value);
        }
        result
    }

    /// (limit, used) of `device` when it is limited.
    fn view(&self, device: usize) -> Option<(u64, u64)> {
        let limit = self.acct.limit(device);
        (limit != UNLIMITED).then(|| (limit, self.acct.used(device).min(limit)))
    }
}

fn context_device() -> usize {
    let Some(get_device) = real!(cuCtxGetDevice as unsafe extern "C" fn(*mut c_int) -> CUresult) else {
        return 0;
    };
    let mut device = 0;
    // SAFETY: a valid out-pointer.
    if unsafe { get_device(&mut device) } == SUCCESS {
        usize::try_from(device).unwrap_or(0)
    } else {
        0
    }
}

/// Reads an out-parameter the driver has just written.
///
/// # Safety
/// `ptr` must be valid for reads (the driver succeeded writing it).
#[inline(always)]
unsafe fn out<T: Copy>(ptr: *const T) -> T {
    // SAFETY: per the contract.
    unsafe { ptr.read() }
}

// -------------------------------------------------------------------------------------------------
// Allocation calls

#[repr(C)]
pub struct ArrayDesc {
    width: usize,
    height: usize,
    format: c_uint,
    channels: c_uint,
}

#[repr(C)]
pub struct ArrayDescV1 {
    width: c_uint,
    height: c_uint,
    format: c_uint,
    channels: c_uint,
}

#[repr(C)]
pub struct Array3dDesc {
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
    flags: c_uint,
}

#[repr(C)]
pub struct Array3dDescV1 {
    width: c_uint,
    height: c_uint,
    depth: c_uint,
    format: c_uint,
    channels: c_uint,
    flags: c_uint,
}

#[repr(C)]
pub struct MemLocation {
    kind: c_uint,
    id: c_int,
}

/// `CUmemAllocationProp`: only the location is read.
#[repr(C)]
pub struct MemAllocationProp {
    kind: c_uint,
    handle_types: c_uint,
    location: MemLocation,
}

type FreeFn = unsafe extern "C" fn(CUdeviceptr) -> CUresult;

/// Frees a device pointer the shim could not record (undo path only).
fn free_device_pointer(dptr: u64) {
    if let Some(free) = real!(cuMemFree_v2 as FreeFn) {
        // SAFETY: a pointer the driver just returned.
        unsafe { free(dptr) };
    }
}

/// One device-pointer allocation of `bytes` on the caller's device.
#[inline(always)]
fn alloc_pointer(
    e: &Enforcer,
    bytes: u64,
    dptr: *const CUdeviceptr,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let device = e.device();
    // SAFETY (after): read only once the driver succeeded, so it wrote *dptr.
    e.track(
        &e.pointers,
        device,
        bytes,
        call,
        || (unsafe { out(dptr) }, bytes),
        free_device_pointer,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    let Some(real) = real!(cuMemAlloc_v2 as unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult) else {
        return NOT_FOUND;
    };
    match gate() {
        // SAFETY (all arms): the caller's arguments, passed on unchanged.
        Gate::Pass => unsafe { real(dptr, bytes) },
        Gate::Enforce(e) => alloc_pointer(e, bytes as u64, dptr, || unsafe { real(dptr, bytes) }),
        Gate::Refuse => OUT_OF_MEMORY,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc(dptr: *mut c_uint, bytes: c_uint) -> CUresult {
    let Some(real) = real!(cuMemAlloc as unsafe extern "C" fn(*mut c_uint, c_uint) -> CUresult) else {
        return NOT_FOUND;
    };
    match gate() {
        Gate::Pass => unsafe { real(dptr, bytes) },
        Gate::Enforce(e) => {
            let device = e.device();
            e.track(
                &e.pointers,
                device,
                u64::from(bytes),
                || unsafe { real(dptr, bytes) },
                || (u64::from(unsafe { out(dptr) }), u64::from(bytes)),
                free_v1,
            )
        }
        Gate::Refuse => OUT_OF_MEMORY,
    }
}

fn free_v1(dptr: u64) {
    if let (Some(free), Ok(dptr)) = (
        real!(cuMemFree as unsafe extern "C" fn(c_uint) -> CUresult),
        c_uint::try_from(dptr),
    ) {
        // SAFETY: a pointer the driver just returned.
        unsafe { free(dptr) };
    }
}

/// Pitch is only known afterwards: the lower bound `width * height` is reserved first, the rest
/// (`(pitch - width) * height`) once the driver has answered; over the limit the allocation is
/// undone. This never refuses an allocation that fits, and overshoots the limit by at most the
/// padding of one allocation for the duration of that call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element: c_uint,
) -> CUresult {
    type Pitch = unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> CUresult;
    let Some(real) = real!(cuMemAllocPitch_v2 as Pitch) else {
        return NOT_FOUND;
    };
    match gate() {
        Gate::Pass => unsafe { real(dptr, pitch, width, height, element) },
        Gate::Enforce(e) => {
            let device = e.device();
            let rows = height as u64;
            e.track(
                &e.pointers,
                device,
                (width as u64).saturating_mul(rows),
                || unsafe { real(dptr, pitch, width, height, element) },
                || unsafe { (out(dptr), (out(pitch) as u64).saturating_mul(rows)) },
                free_device_pointer,
            )
        }
        Gate::Refuse => OUT_OF_MEMORY,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch(
    dptr: *mut c_uint,
    pitch: *mut c_uint,
    width: c_uint,
    height: c_uint,
    element: c_uint,
) -> CUresult {
    type Pitch = unsafe extern "C" fn(*mut c_uint, *mut c_uint, c_uint, c_uint, c_uint) -> CUresult;
    let Some(real) = real!(cuMemAllocPitch as Pitch) else {
        return NOT_FOUND;
    };
    match gate() {
        Gate::Pass => unsafe { real(dptr, pitch, width, height, element) },
        Gate::Enforce(e) => {
            let device = e.device();
            e.track(
                &e.pointers,
                device,
                u64::from(width) * u64::from(height),
                || unsafe { real(dptr, pitch, width, height, element) },
                || unsafe { (u64::from(out(dptr)), u64::from(out(pitch)) * u64::from(height)) },
                free_v1,
            )
        }
        Gate::Refuse => OUT_OF_MEMORY,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytes: usize, flags: c_uint) -> CUresult {
    let Some(real) =
        real!(cuMemAllocManaged as unsafe extern "C" fn(*mut CUdeviceptr, usize, c_uint) -> CUresult)
    else {
        return NOT_FOUND;
    };
    match gate() {
        Gate::Pass => unsafe { real(dptr, bytes, flags) },
        Gate::Enforce(e) => alloc_pointer(e, bytes as u64, dptr, || unsafe { real(dptr, bytes, flags) }),
        Gate::Refuse => OUT_OF_MEMORY,
    }
}

type AllocAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, *mut c_void) -> CUresult;
type AllocFromPool = unsafe extern "C" fn(*mut CUdeviceptr, usize, *mut c_void, *mut c_void) -> CUresult;

/// Stream-ordered allocations count on the current context's device when the call is made.
#[inline(always)]
fn alloc_async(
    real: Option<AllocAsync>,
    dptr: *mut CUdeviceptr,
    bytes: usize,
    stream: *mut c_void,
) -> CUresult {
    let Some(real) = real else { return NOT_FOUND };
    match gate() {
        Gate::Pass => unsafe { real(dptr, bytes, stream) },
        Gate::Enforce(e) => alloc_pointer(e, bytes as u64, dptr, || unsafe { real(dptr, bytes, stream) }),
        Gate::Refuse => OUT_OF_MEMORY,
    }
}

#[inline(always)]
fn alloc_from_pool(
    real: Option<AllocFromPool>,
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: *mut c_void,
    stream: *mut c_void,
) -> CUresult {
    let Some(real) = real else { return NOT_FOUND };
    match gate() {
        Gate::Pass => unsafe { real(dptr, bytes, pool, stream) },
        Gate::Enforce(e) => alloc_pointer(e, bytes as u64, dptr, || unsafe {
            real(dptr, bytes, pool, stream)
        }),
        Gate::Refuse => OUT_OF_MEMORY,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    stream: *mut c_void,
) -> CUresult {
    alloc_async(real!(cuMemAllocAsync as AllocAsync), dptr, bytes, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    stream: *mut c_void,
) -> CUresult {
    alloc_async(real!(cuMemAllocAsync_ptsz as AllocAsync), dptr, bytes, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: *mut c_void,
    stream: *mut c_void,
) -> CUresult {
    alloc_from_pool(
        real!(cuMemAllocFromPoolAsync as AllocFromPool),
        dptr,
        bytes,
        pool,
        stream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: *mut c_void,
    stream: *mut c_void,
) -> CUresult {
    alloc_from_pool(
        real!(cuMemAllocFromPoolAsync_ptsz as AllocFromPool),
        dptr,
        bytes,
        pool,
        stream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    let Some(real) = real!(cuMemFree_v2 as FreeFn) else {
        return NOT_FOUND;
    };
    match gate() {
        Gate::Enforce(e) => e.untrack(&e.pointers, dptr, || unsafe { real(dptr) }),
        Gate::Pass | Gate::Refuse => unsafe { real(dptr) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree(dptr: c_uint) -> CUresult {
    let Some(real) = real!(cuMemFree as unsafe extern "C" fn(c_uint) -> CUresult) else {
        return NOT_FOUND;
    };
    match gate() {
        Gate::Enforce(e) => e.untrack(&e.pointers, u64::from(dptr), || unsafe { real(dptr) }),
        Gate::Pass | Gate::Refuse => unsafe { real(dptr) },
    }
}

type FreeAsync = unsafe extern "C" fn(CUdeviceptr, *mut c_void) -> CUresult;

/// The memory is given back to the limit when the free is enqueued, not when the stream reaches
/// it: a following allocation may be refused by the driver itself for a moment, never let past
/// the limit.
#[inline(always)]
fn free_async(real: Option<FreeAsync>, dptr: CUdeviceptr, stream: *mut c_void) -> CUresult {
    let Some(real) = real else { return NOT_FOUND };
    match gate() {
        Gate::Enforce(e) => e.untrack(&e.pointers, dptr, || unsafe { real(dptr, stream) }),
        Gate::Pass | Gate::Refuse => unsafe { real(dptr, stream) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, stream: *mut c_void) -> CUresult {
    free_async(real!(cuMemFreeAsync as FreeAsync), dptr, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: *mut c_void) -> CUresult {
    free_async(real!(cuMemFreeAsync_ptsz as FreeAsync), dptr, stream)
}

/// VMM physical memory, counted on the device it is created on (`prop->location`). Memory on the
/// host (`location.type` other than device) is not GPU memory and passes through.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const MemAllocationProp,
    flags: u64,
) -> CUresult {
    type Create = unsafe extern "C" fn(*mut u64, usize, *const MemAllocationProp, u64) -> CUresult;
    let Some(real) = real!(cuMemCreate as Create) else {
        return NOT_FOUND;
    };
    // SAFETY: the API's contract: null or a valid CUmemAllocationProp.
    let device = match unsafe { prop.as_ref() } {
        Some(p) if p.location.kind == LOCATION_DEVICE => usize::try_from(p.location.id).ok(),
        _ => None,
    };
    match (gate(), device) {
        (Gate::Enforce(e), Some(device)) => e.track(
            &e.handles,
            device,
            size as u64,
            || unsafe { real(handle, size, prop, flags) },
            || (unsafe { out(handle) }, size as u64),
            |h| {
                if let Some(release) = real!(cuMemRelease as unsafe extern "C" fn(u64) -> CUresult) {
                    // SAFETY: a handle the driver just returned.
                    unsafe { release(h) };
                }
            },
        ),
        (Gate::Refuse, Some(_)) => OUT_OF_MEMORY,
        _ => unsafe { real(handle, size, prop, flags) },
    }
}

/// Counted free at release. Physical memory still mapped (`cuMemMap`) is freed by the driver only
/// at the last `cuMemUnmap`; that window is not counted (see docs/enforcement.md).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    let Some(real) = real!(cuMemRelease as unsafe extern "C" fn(u64) -> CUresult) else {
        return NOT_FOUND;
    };
    match gate() {
        Gate::Enforce(e) => e.untrack(&e.handles, handle, || unsafe { real(handle) }),
        Gate::Pass | Gate::Refuse => unsafe { real(handle) },
    }
}

type ArrayHandle = *mut *mut c_void;

fn destroy_array(array: u64) {
    if let Some(destroy) = real!(cuArrayDestroy as unsafe extern "C" fn(*mut c_void) -> CUresult) {
        // SAFETY: an array the driver just created.
        unsafe { destroy(array as *mut c_void) };
    }
}

fn destroy_mipmapped(array: u64) {
    if let Some(destroy) = real!(cuMipmappedArrayDestroy as unsafe extern "C" fn(*mut c_void) -> CUresult) {
        // SAFETY: an array the driver just created.
        unsafe { destroy(array as *mut c_void) };
    }
}

/// One array creation of `bytes` (`None`: no descriptor, let the driver answer).
#[inline(always)]
fn create_array(
    bytes: Option<u64>,
    handle: ArrayHandle,
    call: impl FnOnce() -> CUresult,
    undo: impl FnOnce(u64),
) -> CUresult {
    match (gate(), bytes) {
        (Gate::Enforce(e), Some(bytes)) => {
            let device = e.device();
            e.track(
                &e.arrays,
                device,
                bytes,
                call,
                || (unsafe { out(handle) } as u64, bytes),
                undo,
            )
        }
        (Gate::Refuse, Some(_)) => OUT_OF_MEMORY,
        _ => call(),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(handle: ArrayHandle, desc: *const ArrayDesc) -> CUresult {
    let Some(real) =
        real!(cuArrayCreate_v2 as unsafe extern "C" fn(ArrayHandle, *const ArrayDesc) -> CUresult)
    else {
        return NOT_FOUND;
    };
    // SAFETY: the API's contract: null or a valid descriptor.
    let bytes = unsafe { desc.as_ref() }
        .map(|d| array_bytes(d.width as u64, d.height as u64, 0, d.format, d.channels));
    create_array(bytes, handle, || unsafe { real(handle, desc) }, destroy_array)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate(handle: ArrayHandle, desc: *const ArrayDescV1) -> CUresult {
    let Some(real) =
        real!(cuArrayCreate as unsafe extern "C" fn(ArrayHandle, *const ArrayDescV1) -> CUresult)
    else {
        return NOT_FOUND;
    };
    // SAFETY: as above.
    let bytes = unsafe { desc.as_ref() }
        .map(|d| array_bytes(d.width.into(), d.height.into(), 0, d.format, d.channels));
    create_array(bytes, handle, || unsafe { real(handle, desc) }, destroy_array)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(handle: ArrayHandle, desc: *const Array3dDesc) -> CUresult {
    let Some(real) =
        real!(cuArray3DCreate_v2 as unsafe extern "C" fn(ArrayHandle, *const Array3dDesc) -> CUresult)
    else {
        return NOT_FOUND;
    };
    // SAFETY: as above.
    let bytes = unsafe { desc.as_ref() }.map(|d| {
        array_bytes(
            d.width as u64,
            d.height as u64,
            d.depth as u64,
            d.format,
            d.channels,
        )
    });
    create_array(bytes, handle, || unsafe { real(handle, desc) }, destroy_array)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate(handle: ArrayHandle, desc: *const Array3dDescV1) -> CUresult {
    let Some(real) =
        real!(cuArray3DCreate as unsafe extern "C" fn(ArrayHandle, *const Array3dDescV1) -> CUresult)
    else {
        return NOT_FOUND;
    };
    // SAFETY: as above.
    let bytes = unsafe { desc.as_ref() }.map(|d| {
        array_bytes(
            d.width.into(),
            d.height.into(),
            d.depth.into(),
            d.format,
            d.channels,
        )
    });
    create_array(bytes, handle, || unsafe { real(handle, desc) }, destroy_array)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    handle: ArrayHandle,
    desc: *const Array3dDesc,
    levels: c_uint,
) -> CUresult {
    type Create = unsafe extern "C" fn(ArrayHandle, *const Array3dDesc, c_uint) -> CUresult;
    let Some(real) = real!(cuMipmappedArrayCreate as Create) else {
        return NOT_FOUND;
    };
    // SAFETY: as above.
    let bytes = unsafe { desc.as_ref() }.map(|d| {
        mipmapped_bytes(
            d.width as u64,
            d.height as u64,
            d.depth as u64,
            d.format,
            d.channels,
            levels,
        )
    });
    create_array(
        bytes,
        handle,
        || unsafe { real(handle, desc, levels) },
        destroy_mipmapped,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(array: *mut c_void) -> CUresult {
    let Some(real) = real!(cuArrayDestroy as unsafe extern "C" fn(*mut c_void) -> CUresult) else {
        return NOT_FOUND;
    };
    match gate() {
        Gate::Enforce(e) => e.untrack(&e.arrays, array as u64, || unsafe { real(array) }),
        Gate::Pass | Gate::Refuse => unsafe { real(array) },
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(array: *mut c_void) -> CUresult {
    let Some(real) = real!(cuMipmappedArrayDestroy as unsafe extern "C" fn(*mut c_void) -> CUresult) else {
        return NOT_FOUND;
    };
    match gate() {
        Gate::Enforce(e) => e.untrack(&e.arrays, array as u64, || unsafe { real(array) }),
        Gate::Pass | Gate::Refuse => unsafe { real(array) },
    }
}

// -------------------------------------------------------------------------------------------------
// Memory queries

/// total = the limit, free = min(the driver's free, limit - used by the container).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let Some(real) = real!(cuMemGetInfo_v2 as unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult)
    else {
        return NOT_FOUND;
    };
    // SAFETY: the caller's arguments, unchanged.
    let result = unsafe { real(free, total) };
    if result == SUCCESS
        && !free.is_null()
        && !total.is_null()
        && let Gate::Enforce(e) = gate()
        && let Some((limit, used)) = e.view(e.device())
    {
        // SAFETY: non-null, and the driver just wrote both.
        unsafe {
            free.write((out(free) as u64).min(limit - used) as usize);
            total.write(limit as usize);
        }
    }
    result
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) -> CUresult {
    let Some(real) = real!(cuMemGetInfo as unsafe extern "C" fn(*mut c_uint, *mut c_uint) -> CUresult) else {
        return NOT_FOUND;
    };
    // SAFETY: as above.
    let result = unsafe { real(free, total) };
    if result == SUCCESS
        && !free.is_null()
        && !total.is_null()
        && let Gate::Enforce(e) = gate()
        && let Some((limit, used)) = e.view(e.device())
    {
        let clamp = |x: u64| x.min(u64::from(c_uint::MAX)) as c_uint;
        // SAFETY: as above.
        unsafe {
            free.write(out(free).min(clamp(limit - used)));
            total.write(clamp(limit));
        }
    }
    result
}

#[repr(C)]
pub struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct NvmlMemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

/// (limit, used) of the NVML device, by its index (CUDA ordinals follow NVML's order when
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID`, which the agent sets).
fn nvml_view(device: *mut c_void) -> Option<(u64, u64)> {
    let Gate::Enforce(e) = gate() else { return None };
    let get_index = real!(nvmlDeviceGetIndex as unsafe extern "C" fn(*mut c_void, *mut c_uint) -> c_uint)?;
    let mut index: c_uint = 0;
    // SAFETY: the caller's device handle and a valid out-pointer.
    if unsafe { get_index(device, &mut index) } != NVML_SUCCESS {
        return None;
    }
    e.view(index as usize)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(device: *mut c_void, memory: *mut NvmlMemory) -> c_uint {
    type Info = unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_uint;
    let Some(real) = real!(nvmlDeviceGetMemoryInfo as Info) else {
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    };
    // SAFETY: the caller's arguments, unchanged.
    let result = unsafe { real(device, memory) };
    if result == NVML_SUCCESS
        && let Some((limit, used)) = nvml_view(device)
        // SAFETY: the driver just filled it, so it is valid.
        && let Some(memory) = unsafe { memory.as_mut() }
    {
        memory.free = memory.free.min(limit - used);
        memory.used = used;
        memory.total = limit;
    }
    result
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: *mut c_void,
    memory: *mut NvmlMemoryV2,
) -> c_uint {
    type Info = unsafe extern "C" fn(*mut c_void, *mut NvmlMemoryV2) -> c_uint;
    let Some(real) = real!(nvmlDeviceGetMemoryInfo_v2 as Info) else {
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    };
    // SAFETY: as above.
    let result = unsafe { real(device, memory) };
    if result == NVML_SUCCESS
        && let Some((limit, used)) = nvml_view(device)
        // SAFETY: as above.
        && let Some(memory) = unsafe { memory.as_mut() }
    {
        memory.free = memory.free.min(limit - used);
        memory.used = used;
        memory.reserved = 0;
        memory.total = limit;
    }
    result
}

// -------------------------------------------------------------------------------------------------
// Entry-point lookup: cuGetProcAddress and dlsym

/// The wrapped symbol named `name` (exact, versioned name).
fn wrapped_symbol(name: &[u8]) -> Option<Sym> {
    if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
        return None;
    }
    SYMBOLS
        .iter()
        .find(|(_, n, _, wrapped)| *wrapped && n.to_bytes() == name)
        .map(|s| s.0)
}

fn real_of(sym: Sym) -> usize {
    REAL.get(sym as usize).map_or(0, |a| a.load(Ordering::Relaxed))
}

/// The shim's wrapper for the real function at `address`, if it is one the shim wraps.
fn wrapper_of_real(address: *mut c_void) -> Option<*mut c_void> {
    SYMBOLS
        .iter()
        .find(|(sym, _, _, wrapped)| *wrapped && real_of(*sym) == address as usize)
        .map(|(sym, ..)| wrapper(*sym))
}

fn is_wrapper(address: *mut c_void) -> bool {
    SYMBOLS
        .iter()
        .any(|(sym, _, _, wrapped)| *wrapped && wrapper(*sym) == address)
}

/// The versioned symbol the driver selects for `name` at `version` with `flags`, by the rules of
/// the CUDA headers (`cuMemAlloc` is `cuMemAlloc_v2` from CUDA 3.2, `_ptsz` for per-thread default
/// streams, ...). Used only when the driver's answer is not an address the shim knows.
fn by_rules(name: &[u8], version: c_int, flags: u64) -> Option<Sym> {
    let v2 = |new: Sym, old: Sym| if version >= 3020 { new } else { old };
    let ptsz = |legacy: Sym, per_thread: Sym| {
        if flags & PER_THREAD_DEFAULT_STREAM != 0 {
            per_thread
        } else {
            legacy
        }
    };
    Some(match name {
        b"cuMemAlloc" => v2(Sym::cuMemAlloc_v2, Sym::cuMemAlloc),
        b"cuMemAllocPitch" => v2(Sym::cuMemAllocPitch_v2, Sym::cuMemAllocPitch),
        b"cuMemFree" => v2(Sym::cuMemFree_v2, Sym::cuMemFree),
        b"cuMemGetInfo" => v2(Sym::cuMemGetInfo_v2, Sym::cuMemGetInfo),
        b"cuArrayCreate" => v2(Sym::cuArrayCreate_v2, Sym::cuArrayCreate),
        b"cuArray3DCreate" => v2(Sym::cuArray3DCreate_v2, Sym::cuArray3DCreate),
        b"cuMemAllocManaged" => Sym::cuMemAllocManaged,
        b"cuMemAllocAsync" => ptsz(Sym::cuMemAllocAsync, Sym::cuMemAllocAsync_ptsz),
        b"cuMemAllocFromPoolAsync" => ptsz(Sym::cuMemAllocFromPoolAsync, Sym::cuMemAllocFromPoolAsync_ptsz),
        b"cuMemFreeAsync" => ptsz(Sym::cuMemFreeAsync, Sym::cuMemFreeAsync_ptsz),
        b"cuMemCreate" => Sym::cuMemCreate,
        b"cuMemRelease" => Sym::cuMemRelease,
        b"cuArrayDestroy" => Sym::cuArrayDestroy,
        b"cuMipmappedArrayCreate" => Sym::cuMipmappedArrayCreate,
        b"cuMipmappedArrayDestroy" => Sym::cuMipmappedArrayDestroy,
        b"cuGetProcAddress" if version >= 12000 => Sym::cuGetProcAddress_v2,
        b"cuGetProcAddress" => Sym::cuGetProcAddress,
        _ => return None,
    })
}

/// Replaces an entry point the driver handed out by the shim's wrapper of the same ABI version.
/// First by address (exact: whichever version the driver chose); failing that, by name and the
/// header rules, for drivers whose table holds other addresses than their exported symbols.
fn map_proc(found: *mut c_void, symbol: *const c_char, version: c_int, flags: u64) -> *mut c_void {
    if found.is_null() || symbol.is_null() || !ensure(Lib::Cuda, false) {
        return found;
    }
    if let Some(wrapper) = wrapper_of_real(found) {
        return wrapper;
    }
    if is_wrapper(found) {
        return found;
    }
    // SAFETY: non-null and NUL-terminated per the API.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    match by_rules(name, version, flags) {
        Some(sym) if real_of(sym) != 0 => {
            log!(
                Debug,
                "cuGetProcAddress({}, {version}, {flags}): unknown address, using {sym:?}",
                String::from_utf8_lossy(name)
            );
            wrapper(sym)
        }
        _ => found,
    }
}

type ProcFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
type ProcV2Fn = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

/// Rewrites `*pfn` after a successful lookup when enforcing.
fn finish_proc(result: CUresult, symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
    if result != SUCCESS || pfn.is_null() || !matches!(gate(), Gate::Enforce(_)) {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: non-null; the driver just wrote it.
        unsafe { pfn.write(map_proc(out(pfn), symbol, version, flags)) };
    }));
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    let Some(real) = real!(cuGetProcAddress as ProcFn) else {
        return NOT_FOUND;
    };
    // SAFETY: the caller's arguments, unchanged.
    let result = unsafe { real(symbol, pfn, version, flags) };
    finish_proc(result, symbol, pfn, version, flags);
    result
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    let Some(real) = real!(cuGetProcAddress_v2 as ProcV2Fn) else {
        return NOT_FOUND;
    };
    // SAFETY: as above.
    let result = unsafe { real(symbol, pfn, version, flags, status) };
    finish_proc(result, symbol, pfn, version, flags);
    result
}

/// Where the exported `dlsym` goes: glibc's `dlsym` (returned, to be tail-called with the caller's
/// own return address, so `RTLD_NEXT` and caller-relative scopes work exactly as without the
/// shim), or null for "ask [`dlsym_wrap`]": only for the wrapped symbols, and only when enforcing.
extern "C" fn dlsym_route(_handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let Some(real) = real_dlsym() else {
        return null_mut();
    };
    if symbol.is_null() || config().limits.is_none() {
        return real as *mut c_void;
    }
    // SAFETY: non-null, NUL-terminated per dlsym's contract.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    if wrapped_symbol(name).is_none() {
        real as *mut c_void
    } else {
        null_mut()
    }
}

/// `dlsym` for a wrapped symbol: glibc's answer, replaced by the shim's wrapper when it is the
/// real driver function. For `RTLD_NEXT` (asked by another interposer) the answer is always the
/// wrapper, which calls the driver directly: enforcement cannot be skipped that way, and no
/// interposer ends up calling itself.
extern "C" fn dlsym_wrap(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let Some(real) = real_dlsym() else {
        return null_mut();
    };
    // SAFETY: the caller's arguments, unchanged.
    let found = unsafe { real(handle, symbol) };
    if symbol.is_null() {
        return found;
    }
    catch_unwind(|| {
        // SAFETY: non-null, NUL-terminated.
        let Some(sym) = wrapped_symbol(unsafe { CStr::from_ptr(symbol) }.to_bytes()) else {
            return found;
        };
        if !ensure(lib_of(sym), false) {
            return found;
        }
        if let Some(wrapper) = wrapper_of_real(found) {
            return wrapper;
        }
        if is_wrapper(found) {
            // The shim's own export, found first in the global scope: only if the driver has it.
            return if real_of(sym) != 0 { found } else { null_mut() };
        }
        if handle == libc::RTLD_NEXT && real_of(sym) != 0 {
            return wrapper(sym);
        }
        found
    })
    .unwrap_or(found)
}

/// The exported `dlsym`: asks [`dlsym_route`], then tail-jumps to glibc's `dlsym` (so glibc sees
/// the original caller's return address) or to [`dlsym_wrap`]. The handle and name registers are
/// preserved around the routing call.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "endbr64",
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {route}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 2f",
        "jmp rax",
        "2:",
        "jmp {wrap}",
        route = sym dlsym_route,
        wrap = sym dlsym_wrap,
    )
}

/// Other architectures: the same routing without the tail call, so glibc sees the shim as the
/// caller of `dlsym(RTLD_NEXT, ...)` (see docs/enforcement.md).
#[cfg(not(target_arch = "x86_64"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let route = dlsym_route(handle, symbol);
    if route.is_null() {
        dlsym_wrap(handle, symbol)
    } else {
        // SAFETY: `route` is glibc's dlsym.
        unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(route)(handle, symbol) }
    }
}
