//! Entry-point lookup: `cuGetProcAddress` and `dlsym` hand out the wrappers, so code that finds the
//! driver's functions at run time is held to the limit too.

use super::*;

/// The wrapped symbol named `name` (exact, versioned name).
pub(super) fn wrapped_symbol(name: &[u8]) -> Option<Sym> {
    if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
        return None;
    }
    SYMBOLS
        .iter()
        .find(|(_, n, _, wrapped)| *wrapped && n.to_bytes() == name)
        .map(|s| s.0)
}

pub(super) fn real_of(sym: Sym) -> usize {
    REAL.get(sym as usize).map_or(0, |a| a.load(Ordering::Relaxed))
}

/// The shim's wrapper for the real function at `address`, if it is one the shim wraps.
pub(super) fn wrapper_of_real(address: *mut c_void) -> Option<*mut c_void> {
    SYMBOLS
        .iter()
        .find(|(sym, _, _, wrapped)| *wrapped && real_of(*sym) == address as usize)
        .map(|(sym, ..)| wrapper(*sym))
}

pub(super) fn is_wrapper(address: *mut c_void) -> bool {
    SYMBOLS
        .iter()
        .any(|(sym, _, _, wrapped)| *wrapped && wrapper(*sym) == address)
}

/// The versioned symbol the driver selects for `name` at `version` with `flags`, by the rules of
/// the CUDA headers (`cuMemAlloc` is `cuMemAlloc_v2` from CUDA 3.2, `_ptsz` for per-thread default
/// streams, ...). Used only when the driver's answer is not an address the shim knows.
pub(super) fn by_rules(name: &[u8], version: c_int, flags: u64) -> Option<Sym> {
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
pub(super) fn map_proc(found: *mut c_void, symbol: *const c_char, version: c_int, flags: u64) -> *mut c_void {
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

pub(super) type ProcFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
pub(super) type ProcV2Fn =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

/// Rewrites `*pfn` after a successful lookup when enforcing.
pub(super) fn finish_proc(
    result: CUresult,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) {
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
pub(super) extern "C" fn dlsym_route(_handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
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
pub(super) extern "C" fn dlsym_wrap(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
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
