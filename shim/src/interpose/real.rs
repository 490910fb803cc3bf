//! The real functions: the driver's and NVML's symbols, resolved once (loading the library if
//! asked), and glibc's `dlsym`.

use super::*;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Lib {
    Cuda,
    Nvml,
}

pub(super) const fn cstr(bytes: &str) -> &CStr {
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

pub(super) const COUNT: usize = SYMBOLS.len();
pub(super) static REAL: [AtomicUsize; COUNT] = [const { AtomicUsize::new(0) }; COUNT];

pub(super) fn lib_of(sym: Sym) -> Lib {
    SYMBOLS.get(sym as usize).map_or(Lib::Cuda, |s| s.2)
}

pub(super) const UNRESOLVED: u8 = 0;
pub(super) const RESOLVING: u8 = 1;
pub(super) const READY: u8 = 2;

pub(super) static CUDA_STATE: AtomicU8 = AtomicU8::new(UNRESOLVED);
pub(super) static NVML_STATE: AtomicU8 = AtomicU8::new(UNRESOLVED);

thread_local! {
    /// Set while this thread resolves a library: its loader may call back into `dlsym`.
    static RESOLVING_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(super) fn state(lib: Lib) -> &'static AtomicU8 {
    match lib {
        Lib::Cuda => &CUDA_STATE,
        Lib::Nvml => &NVML_STATE,
    }
}

/// Whether `lib`'s real functions are known. `load`: `dlopen` it if needed (an exported wrapper
/// was called, so the program uses the library); otherwise only find it if already loaded.
#[inline]
pub(super) fn ensure(lib: Lib, load: bool) -> bool {
    state(lib).load(Ordering::Acquire) == READY || resolve(lib, load)
}

#[cold]
#[inline(never)]
pub(super) fn resolve(lib: Lib, load: bool) -> bool {
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

pub(super) fn resolve_now(lib: Lib, load: bool) -> bool {
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
pub(super) fn real_address(sym: Sym) -> usize {
    if !ensure(lib_of(sym), true) {
        return 0;
    }
    REAL.get(sym as usize).map_or(0, |a| a.load(Ordering::Relaxed))
}

pub(super) type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
pub(super) static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// glibc's `dlsym`, found with `dlvsym(RTLD_NEXT, ...)` (the shim's own `dlsym` shadows it).
pub(super) fn real_dlsym() -> Option<DlsymFn> {
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
