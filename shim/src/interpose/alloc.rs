//! The allocation and free calls: every ABI version of `cuMemAlloc*`, `cuMemFree*`, `cuMemCreate`/
//! `cuMemRelease` and the array calls, each counted against the limit before the driver is asked.

use super::*;

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

pub(super) type FreeFn = unsafe extern "C" fn(CUdeviceptr) -> CUresult;

/// Frees a device pointer the shim could not record (undo path only).
pub(super) fn free_device_pointer(dptr: u64) {
    if let Some(free) = real!(cuMemFree_v2 as FreeFn) {
        // SAFETY: a pointer the driver just returned.
        unsafe { free(dptr) };
    }
}

/// One device-pointer allocation of `bytes` on the caller's device.
#[inline(always)]
pub(super) fn alloc_pointer(
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

pub(super) fn free_v1(dptr: u64) {
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

pub(super) type AllocAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, *mut c_void) -> CUresult;
pub(super) type AllocFromPool =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, *mut c_void, *mut c_void) -> CUresult;

/// Stream-ordered allocations count on the current context's device when the call is made.
#[inline(always)]
pub(super) fn alloc_async(
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
pub(super) fn alloc_from_pool(
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

pub(super) type FreeAsync = unsafe extern "C" fn(CUdeviceptr, *mut c_void) -> CUresult;

/// The memory is given back to the limit when the free is enqueued, not when the stream reaches
/// it: a following allocation may be refused by the driver itself for a moment, never let past
/// the limit.
#[inline(always)]
pub(super) fn free_async(real: Option<FreeAsync>, dptr: CUdeviceptr, stream: *mut c_void) -> CUresult {
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

pub(super) type ArrayHandle = *mut *mut c_void;

pub(super) fn destroy_array(array: u64) {
    if let Some(destroy) = real!(cuArrayDestroy as unsafe extern "C" fn(*mut c_void) -> CUresult) {
        // SAFETY: an array the driver just created.
        unsafe { destroy(array as *mut c_void) };
    }
}

pub(super) fn destroy_mipmapped(array: u64) {
    if let Some(destroy) = real!(cuMipmappedArrayDestroy as unsafe extern "C" fn(*mut c_void) -> CUresult) {
        // SAFETY: an array the driver just created.
        unsafe { destroy(array as *mut c_void) };
    }
}

/// One array creation of `bytes` (`None`: no descriptor, let the driver answer).
#[inline(always)]
pub(super) fn create_array(
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
