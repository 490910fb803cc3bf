//! Memory queries: `cuMemGetInfo` and `nvmlDeviceGetMemoryInfo` answer with the container's view
//! (total = limit, free = what is left of it).

use super::*;

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
pub(super) fn nvml_view(device: *mut c_void) -> Option<(u64, u64)> {
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
