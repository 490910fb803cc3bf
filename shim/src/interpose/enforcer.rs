//! The enforcer: the container's accounting file, this process's tables of what it allocated, the
//! device of the calling context, and its lifecycle (first use, fork, exit).

use super::*;

// Its lifecycle: set up at load, given back at exit, forgotten in a forked child.

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
        if config.from_init {
            log!(
                Info,
                "GPUMEM_LIMIT_MIB is not in this process's environment: the container's (its first process's) applies"
            );
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

/// Whether `/proc` shows process `pid` (this one) as started at `start`: only then can it tell which
/// processes of the container have exited. A `/proc` that is missing, or that a process replaced with a
/// file system of its own (a tmpfs in a mount namespace of its own), would make every process, this
/// one included, look dead, and reaping them would hand their memory out a second time.
fn proc_shows(pid: u32, start: u64) -> bool {
    start != 0 && process_start_time(pid) == Some(start)
}

/// A forked child is another process: it gets its own slot and its own first warning.
extern "C" fn after_fork_in_child() {
    ENFORCER.store(null_mut(), Ordering::Relaxed);
    ENFORCER_INIT.store(false, Ordering::Relaxed);
    OVER_LIMIT_LOGGED.store(false, Ordering::Relaxed);
    TABLE_FULL_LOGGED.store(false, Ordering::Relaxed);
}

pub(super) struct Enforcer {
    acct: Accounting,
    slot: Option<SlotId>,
    pid: u32,
    /// This process's start time as `/proc` showed it when it first used CUDA (0: it did not).
    start: u64,
    /// Device pointers of every allocation call, VMM handles, arrays and mipmapped arrays.
    pub(super) pointers: Table,
    pub(super) handles: Table,
    pub(super) arrays: Table,
    devices: AtomicU8,
    /// Set at exit, after which nothing is counted any more.
    closed: AtomicBool,
}

pub(super) const DEVICES_UNKNOWN: u8 = 0;
pub(super) const DEVICES_ONE: u8 = 1;
pub(super) const DEVICES_MANY: u8 = 2;

pub(super) static ENFORCER: AtomicPtr<Enforcer> = AtomicPtr::new(null_mut());
pub(super) static ENFORCER_INIT: AtomicBool = AtomicBool::new(false);
pub(super) static OVER_LIMIT_LOGGED: AtomicBool = AtomicBool::new(false);
pub(super) static TABLE_FULL_LOGGED: AtomicBool = AtomicBool::new(false);

pub(super) enum Gate {
    /// No limit set: pass through untouched.
    Pass,
    Enforce(&'static Enforcer),
    /// A limit is set but no accounting could be set up at all: refuse allocations.
    Refuse,
}

#[inline]
pub(super) fn gate() -> Gate {
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
pub(super) fn start_enforcing(limits: &Limits) -> Gate {
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
        let start = process_start_time(pid).unwrap_or(0);
        let reclaimed = if proc_shows(pid, start) {
            acct.reap(is_alive)
        } else {
            log!(
                Warn,
                "/proc does not show this process: processes of the container that exit are not reclaimed by this one"
            );
            0
        };
        if reclaimed > 0 {
            log!(Info, "reclaimed {reclaimed} bytes of processes that have exited");
        }
        let slot = acct.claim_slot(pid, start);
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
            start,
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
    pub(super) fn device(&self) -> usize {
        match self.devices.load(Ordering::Relaxed) {
            DEVICES_ONE => 0,
            DEVICES_MANY => context_device(),
            _ => self.count_devices(),
        }
    }

    #[cold]
    #[inline(never)]
    pub(super) fn count_devices(&self) -> usize {
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
    pub(super) fn reserve(&self, device: usize, bytes: u64) -> bool {
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
    pub(super) fn unreserve(&self, device: usize, bytes: u64) {
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
    pub(super) fn reserve_after_reaping(&self, device: usize, bytes: u64) -> bool {
        let reclaimed = if proc_shows(self.pid, self.start) {
            self.acct.reap(is_alive)
        } else {
            0
        };
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
    pub(super) fn track(
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
    pub(super) fn untrack(&self, table: &Table, key: u64, call: impl FnOnce() -> CUresult) -> CUresult {
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
    pub(super) fn view(&self, device: usize) -> Option<(u64, u64)> {
        let limit = self.acct.limit(device);
        (limit != UNLIMITED).then(|| (limit, self.acct.used(device).min(limit)))
    }
}

pub(super) fn context_device() -> usize {
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
pub(super) unsafe fn out<T: Copy>(ptr: *const T) -> T {
    // SAFETY: per the contract.
    unsafe { ptr.read() }
}
