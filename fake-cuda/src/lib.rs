//! A test-only `libcuda.so.1`: the CUDA driver calls `libgpumem_cuda.so` wraps, answered from host
//! bookkeeping. Never shipped.
//!
//! Tests put a symlink named `libcuda.so.1` (and `libcuda.so`, for linking) to the built
//! `libgpumem_fake_cuda.so` in a directory of their own and point `-L`/`-rpath` or
//! `LD_LIBRARY_PATH` at it. Its soname is `libcuda.so.1`, like the real driver's.
//!
//! # Environment
//!
//! - `GPUMEM_FAKE_CUDA_TOTAL_MIB` (read by `cuInit`): the devices' memory, one number per device, comma-separated
//!   (default `16384`: one device of 16 GiB).
//! - `GPUMEM_FAKE_CUDA_PROC_COPIES=1` (read at each lookup): `cuGetProcAddress*` hands out private copies of the entry
//!   points instead of the exported functions (same behaviour, other addresses), as a driver may;
//!   this exercises the shim's lookup by name and version.
//!
//! # Behaviour
//!
//! Each process has its own "devices": memory is a counter per device, never real host memory, and
//! allocations fail with `CUDA_ERROR_OUT_OF_MEMORY` when a device's total would be exceeded.
//! Allocation calls need a current context (`cuDevicePrimaryCtxRetain` + `cuCtxSetCurrent`), as
//! the real driver does; async and pool allocations count on the device of the current context
//! (`cuMemAllocAsync`) or of the pool (`cuMemAllocFromPoolAsync`), and free immediately. Addresses
//! of freed blocks are reused for the next block of the same size, as a real allocator does.
//! Pitch is the width rounded up to 512 bytes; `cuMemCreate` sizes must be multiples of the 2 MiB
//! granularity; array sizes are width x height x depth x channels x element size (summed over
//! levels for mipmapped arrays). The legacy (v1) 32-bit calls hand out addresses below 4 GiB.
//! `cuCtxCreate_v2` makes the device's (only) context current; streams are handles that order
//! nothing; `cuMemAddressReserve` / `cuMemMap` / `cuMemSetAccess` / `cuMemUnmap` / `cuMemAddressFree`
//! check their ranges and handles and count nothing (the memory is counted at `cuMemCreate`).
//!
//! `cuGetProcAddress` (CUDA 11.3) and `cuGetProcAddress_v2` (CUDA 12.0) follow the driver's rules:
//! the symbol name without version suffix, the caller's CUDA version (e.g. 12080) selecting the
//! newest ABI version introduced at or before it (`cuMemAlloc` → `cuMemAlloc_v2` from 3020), and
//! `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` (2) selecting the `_ptsz` variants of calls that
//! take a stream. Unknown symbols: `CUDA_ERROR_NOT_FOUND` with status `SYMBOL_NOT_FOUND` (1); known
//! but newer than the caller: `CUDA_ERROR_NOT_FOUND` with `VERSION_NOT_SUFFICIENT` (2).
//!
//! One file, over the usual ~600 lines: it is one C ABI surface (the driver entry points the shim
//! wraps, and the host bookkeeping they share), read top to bottom against `cuda.h`.

// The exported names are the CUDA driver's; their safety contract is the driver API's.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, MutexGuard, PoisonError};

type CUresult = c_uint;
type CUdeviceptr = u64;

const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const NOT_INITIALIZED: CUresult = 3;
const INVALID_DEVICE: CUresult = 101;
const INVALID_CONTEXT: CUresult = 201;
const INVALID_HANDLE: CUresult = 400;
const NOT_FOUND: CUresult = 500;
const UNKNOWN: CUresult = 999;

const DRIVER_VERSION: c_int = 12080;
const PITCH_ALIGNMENT: usize = 512;
const VMM_GRANULARITY: usize = 2 << 20;
const LOCATION_DEVICE: c_uint = 1;

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

/// `CUmemAllocationProp` (and the leading fields of `CUmemPoolProps`, which start the same way).
#[repr(C)]
pub struct MemAllocationProp {
    kind: c_uint,
    handle_types: c_uint,
    location: MemLocation,
    win32_metadata: *mut c_void,
    alloc_flags: [u8; 8],
}

#[derive(Clone, Copy)]
struct Block {
    device: usize,
    size: u64,
}

#[derive(Default)]
struct Driver {
    initialised: bool,
    totals: Vec<u64>,
    used: Vec<u64>,
    /// Device pointers (all allocation calls), VMM handles, arrays and pools, by value.
    pointers: HashMap<u64, Block>,
    handles: HashMap<u64, Block>,
    arrays: HashMap<u64, Block>,
    pools: HashMap<u64, usize>,
    /// Streams created, virtual address ranges reserved (start, size) and mapped (start, handle).
    streams: Vec<u64>,
    ranges: HashMap<u64, u64>,
    mapped: HashMap<u64, u64>,
    /// Freed addresses by (rounded size, low): reused first.
    free_addresses: HashMap<(u64, bool), Vec<u64>>,
    next_address: u64,
    next_low_address: u64,
    next_object: u64,
}

static DRIVER: Mutex<Option<Driver>> = Mutex::new(None);

thread_local! {
    static CURRENT: Cell<Option<usize>> = const { Cell::new(None) };
}

fn driver() -> MutexGuard<'static, Option<Driver>> {
    DRIVER.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `f` on the initialised driver; no panic crosses the C boundary.
fn with_driver(f: impl FnOnce(&mut Driver) -> Result<(), CUresult>) -> CUresult {
    catch_unwind(AssertUnwindSafe(|| {
        let mut guard = driver();
        match guard.as_mut() {
            Some(d) if d.initialised => f(d).err().unwrap_or(SUCCESS),
            _ => NOT_INITIALIZED,
        }
    }))
    .unwrap_or(UNKNOWN)
}

unsafe fn put<T>(out: *mut T, value: T) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: non-null; the driver API's contract is that it points at a T.
    unsafe { out.write(value) };
    Ok(())
}

fn current_device(d: &Driver) -> Result<usize, CUresult> {
    CURRENT
        .with(Cell::get)
        .filter(|&dev| dev < d.totals.len())
        .ok_or(INVALID_CONTEXT)
}

impl Driver {
    fn reserve(&mut self, device: usize, size: u64) -> Result<(), CUresult> {
        let (Some(total), Some(used)) = (self.totals.get(device), self.used.get_mut(device)) else {
            return Err(INVALID_DEVICE);
        };
        match used.checked_add(size) {
            Some(after) if after <= *total => {
                *used = after;
                Ok(())
            }
            _ => Err(OUT_OF_MEMORY),
        }
    }

    fn unreserve(&mut self, device: usize, size: u64) {
        if let Some(used) = self.used.get_mut(device) {
            *used = used.saturating_sub(size);
        }
    }

    /// A device address for `size` bytes (below 4 GiB for the v1 calls).
    fn address(&mut self, size: u64, low: bool) -> Result<u64, CUresult> {
        let rounded = size.div_ceil(4096).max(1) * 4096;
        if let Some(address) = self.free_addresses.get_mut(&(rounded, low)).and_then(Vec::pop) {
            return Ok(address);
        }
        let next = if low {
            &mut self.next_low_address
        } else {
            &mut self.next_address
        };
        let address = *next;
        *next = next.checked_add(rounded).ok_or(OUT_OF_MEMORY)?;
        if low && *next > u64::from(u32::MAX) {
            return Err(OUT_OF_MEMORY);
        }
        Ok(address)
    }

    fn alloc(&mut self, device: usize, size: u64, low: bool) -> Result<u64, CUresult> {
        if size == 0 {
            return Err(INVALID_VALUE);
        }
        self.reserve(device, size)?;
        match self.address(size, low) {
            Ok(address) => {
                self.pointers.insert(address, Block { device, size });
                Ok(address)
            }
            Err(e) => {
                self.unreserve(device, size);
                Err(e)
            }
        }
    }

    fn free(&mut self, address: u64) -> Result<(), CUresult> {
        let block = self.pointers.remove(&address).ok_or(INVALID_VALUE)?;
        self.unreserve(block.device, block.size);
        let rounded = block.size.div_ceil(4096).max(1) * 4096;
        let low = address < u64::from(u32::MAX);
        self.free_addresses
            .entry((rounded, low))
            .or_default()
            .push(address);
        Ok(())
    }

    fn new_object(
        &mut self,
        device: usize,
        size: u64,
        table: fn(&mut Driver) -> &mut HashMap<u64, Block>,
    ) -> Result<u64, CUresult> {
        self.reserve(device, size)?;
        self.next_object += 16;
        let id = 0x7f00_0000_0000 + self.next_object;
        table(self).insert(id, Block { device, size });
        Ok(id)
    }

    fn drop_object(
        &mut self,
        id: u64,
        table: fn(&mut Driver) -> &mut HashMap<u64, Block>,
    ) -> Result<(), CUresult> {
        let block = table(self).remove(&id).ok_or(INVALID_HANDLE)?;
        self.unreserve(block.device, block.size);
        Ok(())
    }
}

fn element_size(format: c_uint) -> Option<u64> {
    match format {
        0x01 | 0x08 => Some(1),
        0x02 | 0x09 | 0x10 => Some(2),
        0x03 | 0x0a | 0x20 => Some(4),
        _ => None,
    }
}

fn array_size(
    width: u64,
    height: u64,
    depth: u64,
    format: c_uint,
    channels: c_uint,
) -> Result<u64, CUresult> {
    if width == 0 || !matches!(channels, 1 | 2 | 4) {
        return Err(INVALID_VALUE);
    }
    let element = element_size(format).ok_or(INVALID_VALUE)?;
    [height.max(1), depth.max(1), u64::from(channels), element]
        .into_iter()
        .try_fold(width, u64::checked_mul)
        .ok_or(OUT_OF_MEMORY)
}

fn mipmapped_size(desc: &Array3dDesc, levels: c_uint) -> Result<u64, CUresult> {
    if levels == 0 {
        return Err(INVALID_VALUE);
    }
    let (w, h, d) = (desc.width as u64, desc.height as u64, desc.depth as u64);
    (0..levels.min(64)).try_fold(0u64, |sum, level| {
        let shrink = |x: u64| if x == 0 { 0 } else { (x >> level).max(1) };
        let size = array_size(shrink(w), shrink(h), shrink(d), desc.format, desc.channels)?;
        sum.checked_add(size).ok_or(OUT_OF_MEMORY)
    })
}

fn read<'a, T>(ptr: *const T) -> Result<&'a T, CUresult> {
    // SAFETY: the driver API's contract: null or a valid T for the duration of the call.
    unsafe { ptr.as_ref() }.ok_or(INVALID_VALUE)
}

// -------------------------------------------------------------------------------------------------
// Exported entry points. `entry!` defines each one twice: the exported symbol, and a private copy
// with the same body that `cuGetProcAddress*` hands out under GPUMEM_FAKE_CUDA_PROC_COPIES=1.

macro_rules! entry {
    ($name:ident / $copy:ident ($($arg:ident : $ty:ty),* $(,)?) $body:block) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult $body
        unsafe extern "C" fn $copy($($arg: $ty),*) -> CUresult $body
    };
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    catch_unwind(|| {
        if flags != 0 {
            return INVALID_VALUE;
        }
        let mut guard = driver();
        if guard.as_ref().is_some_and(|d| d.initialised) {
            return SUCCESS;
        }
        let spec = std::env::var("GPUMEM_FAKE_CUDA_TOTAL_MIB").unwrap_or_else(|_| "16384".to_owned());
        let totals: Option<Vec<u64>> = spec
            .split(',')
            .map(|s| s.trim().parse::<u64>().ok().map(|m| m << 20))
            .collect();
        let Some(totals) = totals.filter(|t| !t.is_empty()) else {
            eprintln!("fake libcuda: GPUMEM_FAKE_CUDA_TOTAL_MIB={spec:?} is not a comma list of MiB");
            return INVALID_VALUE;
        };
        *guard = Some(Driver {
            initialised: true,
            used: vec![0; totals.len()],
            totals,
            next_address: 0x7_0000_0000,
            next_low_address: 0x1000_0000,
            ..Driver::default()
        });
        SUCCESS
    })
    .unwrap_or(UNKNOWN)
}

entry!(cuDriverGetVersion / copy_cuDriverGetVersion(version: *mut c_int) {
    catch_unwind(|| unsafe { put(version, DRIVER_VERSION) }.err().unwrap_or(SUCCESS)).unwrap_or(UNKNOWN)
});

entry!(cuDeviceGetCount / copy_cuDeviceGetCount(count: *mut c_int) {
    with_driver(|d| unsafe { put(count, d.totals.len() as c_int) })
});

entry!(cuDeviceGet / copy_cuDeviceGet(device: *mut c_int, ordinal: c_int) {
    with_driver(|d| {
        let ordinal = usize::try_from(ordinal).ok().filter(|&o| o < d.totals.len()).ok_or(INVALID_DEVICE)?;
        unsafe { put(device, ordinal as c_int) }
    })
});

entry!(cuDeviceTotalMem_v2 / copy_cuDeviceTotalMem_v2(bytes: *mut usize, device: c_int) {
    with_driver(|d| {
        let total = usize::try_from(device).ok().and_then(|i| d.totals.get(i)).ok_or(INVALID_DEVICE)?;
        unsafe { put(bytes, *total as usize) }
    })
});

entry!(cuDevicePrimaryCtxRetain / copy_cuDevicePrimaryCtxRetain(context: *mut *mut c_void, device: c_int) {
    with_driver(|d| {
        let device = usize::try_from(device).ok().filter(|&i| i < d.totals.len()).ok_or(INVALID_DEVICE)?;
        unsafe { put(context, (device + 1) as *mut c_void) }
    })
});

entry!(cuDevicePrimaryCtxRelease_v2 / copy_cuDevicePrimaryCtxRelease_v2(device: c_int) {
    with_driver(|d| usize::try_from(device).ok().filter(|&i| i < d.totals.len()).map(|_| ()).ok_or(INVALID_DEVICE))
});

entry!(cuCtxSetCurrent / copy_cuCtxSetCurrent(context: *mut c_void) {
    with_driver(|d| {
        let current = match context as usize {
            0 => None,
            n if n <= d.totals.len() => Some(n - 1),
            _ => return Err(INVALID_CONTEXT),
        };
        CURRENT.with(|c| c.set(current));
        Ok(())
    })
});

entry!(cuCtxCreate_v2 / copy_cuCtxCreate_v2(context: *mut *mut c_void, _flags: c_uint, device: c_int) {
    with_driver(|d| {
        let device = usize::try_from(device).ok().filter(|&i| i < d.totals.len()).ok_or(INVALID_DEVICE)?;
        unsafe { put(context, (device + 1) as *mut c_void)? };
        CURRENT.with(|c| c.set(Some(device)));
        Ok(())
    })
});

entry!(cuCtxDestroy_v2 / copy_cuCtxDestroy_v2(context: *mut c_void) {
    with_driver(|d| {
        let device = (context as usize).checked_sub(1).filter(|&i| i < d.totals.len()).ok_or(INVALID_CONTEXT)?;
        CURRENT.with(|c| {
            if c.get() == Some(device) {
                c.set(None);
            }
        });
        Ok(())
    })
});

entry!(cuCtxGetDevice / copy_cuCtxGetDevice(device: *mut c_int) {
    with_driver(|d| {
        let current = current_device(d)?;
        unsafe { put(device, current as c_int) }
    })
});

entry!(cuMemGetInfo_v2 / copy_cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
    with_driver(|d| {
        let device = current_device(d)?;
        let (t, u) = (d.totals[device], d.used[device]);
        unsafe { put(free, (t - u) as usize)?; put(total, t as usize) }
    })
});

entry!(cuMemGetInfo / copy_cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) {
    with_driver(|d| {
        let device = current_device(d)?;
        let clamp = |x: u64| x.min(u64::from(c_uint::MAX)) as c_uint;
        let (t, u) = (d.totals[device], d.used[device]);
        unsafe { put(free, clamp(t - u))?; put(total, clamp(t)) }
    })
});

entry!(cuMemAlloc_v2 / copy_cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) {
    with_driver(|d| {
        let device = current_device(d)?;
        read(dptr)?;
        let address = d.alloc(device, bytes as u64, false)?;
        unsafe { put(dptr, address) }
    })
});

entry!(cuMemAlloc / copy_cuMemAlloc(dptr: *mut c_uint, bytes: c_uint) {
    with_driver(|d| {
        let device = current_device(d)?;
        read(dptr)?;
        let address = d.alloc(device, u64::from(bytes), true)?;
        unsafe { put(dptr, address as c_uint) }
    })
});

entry!(cuMemAllocPitch_v2 / copy_cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, element: c_uint,
) {
    with_driver(|d| {
        let device = current_device(d)?;
        read(dptr)?;
        read(pitch)?;
        if !matches!(element, 4 | 8 | 16) || width == 0 || height == 0 {
            return Err(INVALID_VALUE);
        }
        let rounded = width.checked_next_multiple_of(PITCH_ALIGNMENT).ok_or(OUT_OF_MEMORY)?;
        let size = rounded.checked_mul(height).ok_or(OUT_OF_MEMORY)?;
        let address = d.alloc(device, size as u64, false)?;
        unsafe { put(dptr, address)?; put(pitch, rounded) }
    })
});

entry!(cuMemAllocPitch / copy_cuMemAllocPitch(
    dptr: *mut c_uint, pitch: *mut c_uint, width: c_uint, height: c_uint, element: c_uint,
) {
    with_driver(|d| {
        let device = current_device(d)?;
        read(dptr)?;
        read(pitch)?;
        if !matches!(element, 4 | 8 | 16) || width == 0 || height == 0 {
            return Err(INVALID_VALUE);
        }
        let rounded = u64::from(width).next_multiple_of(PITCH_ALIGNMENT as u64);
        let size = rounded * u64::from(height);
        let address = d.alloc(device, size, true)?;
        unsafe { put(dptr, address as c_uint)?; put(pitch, rounded as c_uint) }
    })
});

entry!(cuMemAllocManaged / copy_cuMemAllocManaged(dptr: *mut CUdeviceptr, bytes: usize, flags: c_uint) {
    with_driver(|d| {
        let device = current_device(d)?;
        read(dptr)?;
        if !matches!(flags, 1 | 2) {
            return Err(INVALID_VALUE);
        }
        let address = d.alloc(device, bytes as u64, false)?;
        unsafe { put(dptr, address) }
    })
});

fn alloc_async(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    with_driver(|d| {
        let device = current_device(d)?;
        read(dptr)?;
        let address = d.alloc(device, bytes as u64, false)?;
        unsafe { put(dptr, address) }
    })
}

fn alloc_from_pool(dptr: *mut CUdeviceptr, bytes: usize, pool: *mut c_void) -> CUresult {
    with_driver(|d| {
        current_device(d)?;
        read(dptr)?;
        let device = *d.pools.get(&(pool as u64)).ok_or(INVALID_HANDLE)?;
        let address = d.alloc(device, bytes as u64, false)?;
        unsafe { put(dptr, address) }
    })
}

entry!(cuMemAllocAsync / copy_cuMemAllocAsync(dptr: *mut CUdeviceptr, bytes: usize, _stream: *mut c_void) {
    alloc_async(dptr, bytes)
});
entry!(cuMemAllocAsync_ptsz / copy_cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, bytes: usize, _stream: *mut c_void) {
    alloc_async(dptr, bytes)
});
entry!(cuMemAllocFromPoolAsync / copy_cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr, bytes: usize, pool: *mut c_void, _stream: *mut c_void,
) {
    alloc_from_pool(dptr, bytes, pool)
});
entry!(cuMemAllocFromPoolAsync_ptsz / copy_cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr, bytes: usize, pool: *mut c_void, _stream: *mut c_void,
) {
    alloc_from_pool(dptr, bytes, pool)
});

entry!(cuMemFree_v2 / copy_cuMemFree_v2(dptr: CUdeviceptr) { with_driver(|d| d.free(dptr)) });
entry!(cuMemFree / copy_cuMemFree(dptr: c_uint) { with_driver(|d| d.free(u64::from(dptr))) });
entry!(cuMemFreeAsync / copy_cuMemFreeAsync(dptr: CUdeviceptr, _stream: *mut c_void) {
    with_driver(|d| d.free(dptr))
});
entry!(cuMemFreeAsync_ptsz / copy_cuMemFreeAsync_ptsz(dptr: CUdeviceptr, _stream: *mut c_void) {
    with_driver(|d| d.free(dptr))
});

entry!(cuMemPoolCreate / copy_cuMemPoolCreate(pool: *mut *mut c_void, props: *const MemAllocationProp) {
    with_driver(|d| {
        let props = read(props)?;
        let device = usize::try_from(props.location.id).ok().filter(|&i| i < d.totals.len());
        let device = device.filter(|_| props.location.kind == LOCATION_DEVICE).ok_or(INVALID_VALUE)?;
        d.next_object += 16;
        let id = 0x6f00_0000_0000 + d.next_object;
        d.pools.insert(id, device);
        unsafe { put(pool, id as *mut c_void) }
    })
});

entry!(cuMemPoolDestroy / copy_cuMemPoolDestroy(pool: *mut c_void) {
    with_driver(|d| d.pools.remove(&(pool as u64)).map(|_| ()).ok_or(INVALID_HANDLE))
});

entry!(cuDeviceGetDefaultMemPool / copy_cuDeviceGetDefaultMemPool(pool: *mut *mut c_void, device: c_int) {
    with_driver(|d| {
        let device = usize::try_from(device).ok().filter(|&i| i < d.totals.len()).ok_or(INVALID_DEVICE)?;
        let id = 0x6e00_0000_0000 + device as u64;
        d.pools.insert(id, device);
        unsafe { put(pool, id as *mut c_void) }
    })
});

entry!(cuMemGetAllocationGranularity / copy_cuMemGetAllocationGranularity(
    granularity: *mut usize, _prop: *const MemAllocationProp, _option: c_uint,
) {
    with_driver(|_| unsafe { put(granularity, VMM_GRANULARITY) })
});

entry!(cuMemCreate / copy_cuMemCreate(handle: *mut u64, size: usize, prop: *const MemAllocationProp, flags: u64) {
    with_driver(|d| {
        let prop = read(prop)?;
        read(handle)?;
        let device = usize::try_from(prop.location.id).ok().filter(|&i| i < d.totals.len());
        let device = device.filter(|_| prop.location.kind == LOCATION_DEVICE).ok_or(INVALID_DEVICE)?;
        if flags != 0 || size == 0 || !size.is_multiple_of(VMM_GRANULARITY) {
            return Err(INVALID_VALUE);
        }
        let id = d.new_object(device, size as u64, |d| &mut d.handles)?;
        unsafe { put(handle, id) }
    })
});

entry!(cuStreamCreate / copy_cuStreamCreate(stream: *mut *mut c_void, _flags: c_uint) {
    with_driver(|d| {
        current_device(d)?;
        d.next_object += 16;
        let id = 0x5f00_0000_0000 + d.next_object;
        d.streams.push(id);
        unsafe { put(stream, id as *mut c_void) }
    })
});

entry!(cuStreamDestroy_v2 / copy_cuStreamDestroy_v2(stream: *mut c_void) {
    with_driver(|d| {
        let at = d.streams.iter().position(|&s| s == stream as u64).ok_or(INVALID_HANDLE)?;
        d.streams.swap_remove(at);
        Ok(())
    })
});

entry!(cuStreamSynchronize / copy_cuStreamSynchronize(stream: *mut c_void) {
    with_driver(|d| {
        if stream.is_null() || d.streams.contains(&(stream as u64)) { Ok(()) } else { Err(INVALID_HANDLE) }
    })
});

entry!(cuMemAddressReserve / copy_cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, _alignment: usize, _addr: CUdeviceptr, _flags: u64) {
    with_driver(|d| {
        if size == 0 || !size.is_multiple_of(VMM_GRANULARITY) {
            return Err(INVALID_VALUE);
        }
        read(ptr)?;
        let address = d.address(size as u64, false)?;
        d.ranges.insert(address, size as u64);
        unsafe { put(ptr, address) }
    })
});

entry!(cuMemAddressFree / copy_cuMemAddressFree(ptr: CUdeviceptr, size: usize) {
    with_driver(|d| match d.ranges.get(&ptr) {
        Some(&reserved) if reserved == size as u64 && !d.mapped.contains_key(&ptr) => {
            d.ranges.remove(&ptr);
            Ok(())
        }
        _ => Err(INVALID_VALUE),
    })
});

entry!(cuMemMap / copy_cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: u64, flags: u64) {
    with_driver(|d| {
        let block = *d.handles.get(&handle).ok_or(INVALID_HANDLE)?;
        let fits = d.ranges.get(&ptr).is_some_and(|&reserved| size as u64 <= reserved);
        if flags != 0 || offset != 0 || size as u64 > block.size || !fits || d.mapped.contains_key(&ptr) {
            return Err(INVALID_VALUE);
        }
        d.mapped.insert(ptr, handle);
        Ok(())
    })
});

entry!(cuMemUnmap / copy_cuMemUnmap(ptr: CUdeviceptr, _size: usize) {
    with_driver(|d| d.mapped.remove(&ptr).map(|_| ()).ok_or(INVALID_VALUE))
});

entry!(cuMemSetAccess / copy_cuMemSetAccess(ptr: CUdeviceptr, _size: usize, desc: *const c_void, count: usize) {
    with_driver(|d| {
        if desc.is_null() || count == 0 || !d.mapped.contains_key(&ptr) { Err(INVALID_VALUE) } else { Ok(()) }
    })
});

entry!(cuMemRelease / copy_cuMemRelease(handle: u64) { with_driver(|d| d.drop_object(handle, |d| &mut d.handles)) });

fn create_array(handle: *mut *mut c_void, size: Result<u64, CUresult>) -> CUresult {
    with_driver(|d| {
        let device = current_device(d)?;
        read(handle)?;
        let id = d.new_object(device, size?, |d| &mut d.arrays)?;
        unsafe { put(handle, id as *mut c_void) }
    })
}

entry!(cuArrayCreate_v2 / copy_cuArrayCreate_v2(handle: *mut *mut c_void, desc: *const ArrayDesc) {
    create_array(handle, read(desc).and_then(|a| array_size(a.width as u64, a.height as u64, 0, a.format, a.channels)))
});
entry!(cuArrayCreate / copy_cuArrayCreate(handle: *mut *mut c_void, desc: *const ArrayDescV1) {
    create_array(handle, read(desc).and_then(|a| array_size(a.width.into(), a.height.into(), 0, a.format, a.channels)))
});
entry!(cuArray3DCreate_v2 / copy_cuArray3DCreate_v2(handle: *mut *mut c_void, desc: *const Array3dDesc) {
    create_array(handle, read(desc).and_then(|a| {
        array_size(a.width as u64, a.height as u64, a.depth as u64, a.format, a.channels)
    }))
});
entry!(cuArray3DCreate / copy_cuArray3DCreate(handle: *mut *mut c_void, desc: *const Array3dDescV1) {
    create_array(handle, read(desc).and_then(|a| {
        array_size(a.width.into(), a.height.into(), a.depth.into(), a.format, a.channels)
    }))
});
entry!(cuMipmappedArrayCreate / copy_cuMipmappedArrayCreate(
    handle: *mut *mut c_void, desc: *const Array3dDesc, levels: c_uint,
) {
    create_array(handle, read(desc).and_then(|a| mipmapped_size(a, levels)))
});
entry!(cuArrayDestroy / copy_cuArrayDestroy(array: *mut c_void) {
    with_driver(|d| d.drop_object(array as u64, |d| &mut d.arrays))
});
entry!(cuMipmappedArrayDestroy / copy_cuMipmappedArrayDestroy(array: *mut c_void) {
    with_driver(|d| d.drop_object(array as u64, |d| &mut d.arrays))
});

// -------------------------------------------------------------------------------------------------
// cuGetProcAddress

const PER_THREAD_DEFAULT_STREAM: u64 = 2;
const STATUS_SUCCESS: c_int = 0;
const STATUS_SYMBOL_NOT_FOUND: c_int = 1;
const STATUS_VERSION_NOT_SUFFICIENT: c_int = 2;

/// (introduced in CUDA version, exported entry, private copy), newest first.
type Versions = Vec<(c_int, *mut c_void, *mut c_void)>;

fn versions(name: &str, per_thread: bool) -> Option<Versions> {
    macro_rules! v {
        ($($since:literal => $f:ident / $c:ident),+) => {
            vec![$(($since, $f as *mut c_void, $c as *mut c_void)),+]
        };
    }
    macro_rules! stream {
        ($since:literal => $f:ident / $c:ident | $pf:ident / $pc:ident) => {
            if per_thread { v!($since => $pf / $pc) } else { v!($since => $f / $c) }
        };
    }
    Some(match name {
        "cuInit" => vec![(2000, cuInit as *mut c_void, cuInit as *mut c_void)],
        "cuDriverGetVersion" => v!(2020 => cuDriverGetVersion / copy_cuDriverGetVersion),
        "cuDeviceGetCount" => v!(2000 => cuDeviceGetCount / copy_cuDeviceGetCount),
        "cuDeviceGet" => v!(2000 => cuDeviceGet / copy_cuDeviceGet),
        "cuDeviceTotalMem" => v!(3020 => cuDeviceTotalMem_v2 / copy_cuDeviceTotalMem_v2),
        "cuDevicePrimaryCtxRetain" => v!(7000 => cuDevicePrimaryCtxRetain / copy_cuDevicePrimaryCtxRetain),
        "cuDevicePrimaryCtxRelease" => {
            v!(11000 => cuDevicePrimaryCtxRelease_v2 / copy_cuDevicePrimaryCtxRelease_v2)
        }
        "cuCtxSetCurrent" => v!(4000 => cuCtxSetCurrent / copy_cuCtxSetCurrent),
        "cuCtxGetDevice" => v!(2000 => cuCtxGetDevice / copy_cuCtxGetDevice),
        "cuCtxCreate" => v!(3020 => cuCtxCreate_v2 / copy_cuCtxCreate_v2),
        "cuCtxDestroy" => v!(4000 => cuCtxDestroy_v2 / copy_cuCtxDestroy_v2),
        "cuStreamCreate" => v!(2000 => cuStreamCreate / copy_cuStreamCreate),
        "cuStreamDestroy" => v!(4000 => cuStreamDestroy_v2 / copy_cuStreamDestroy_v2),
        "cuStreamSynchronize" if !per_thread => v!(2000 => cuStreamSynchronize / copy_cuStreamSynchronize),
        "cuMemAddressReserve" => v!(10020 => cuMemAddressReserve / copy_cuMemAddressReserve),
        "cuMemAddressFree" => v!(10020 => cuMemAddressFree / copy_cuMemAddressFree),
        "cuMemMap" => v!(10020 => cuMemMap / copy_cuMemMap),
        "cuMemUnmap" => v!(10020 => cuMemUnmap / copy_cuMemUnmap),
        "cuMemSetAccess" => v!(10020 => cuMemSetAccess / copy_cuMemSetAccess),
        "cuMemGetInfo" => {
            v!(3020 => cuMemGetInfo_v2 / copy_cuMemGetInfo_v2, 2000 => cuMemGetInfo / copy_cuMemGetInfo)
        }
        "cuMemAlloc" => v!(3020 => cuMemAlloc_v2 / copy_cuMemAlloc_v2, 2000 => cuMemAlloc / copy_cuMemAlloc),
        "cuMemAllocPitch" => {
            v!(3020 => cuMemAllocPitch_v2 / copy_cuMemAllocPitch_v2, 2000 => cuMemAllocPitch / copy_cuMemAllocPitch)
        }
        "cuMemAllocManaged" => v!(6000 => cuMemAllocManaged / copy_cuMemAllocManaged),
        "cuMemAllocAsync" => {
            stream!(11020 => cuMemAllocAsync / copy_cuMemAllocAsync | cuMemAllocAsync_ptsz / copy_cuMemAllocAsync_ptsz)
        }
        "cuMemAllocFromPoolAsync" => stream!(11020 => cuMemAllocFromPoolAsync / copy_cuMemAllocFromPoolAsync
            | cuMemAllocFromPoolAsync_ptsz / copy_cuMemAllocFromPoolAsync_ptsz),
        "cuMemFree" => v!(3020 => cuMemFree_v2 / copy_cuMemFree_v2, 2000 => cuMemFree / copy_cuMemFree),
        "cuMemFreeAsync" => {
            stream!(11020 => cuMemFreeAsync / copy_cuMemFreeAsync | cuMemFreeAsync_ptsz / copy_cuMemFreeAsync_ptsz)
        }
        "cuMemPoolCreate" => v!(11020 => cuMemPoolCreate / copy_cuMemPoolCreate),
        "cuMemPoolDestroy" => v!(11020 => cuMemPoolDestroy / copy_cuMemPoolDestroy),
        "cuDeviceGetDefaultMemPool" => {
            v!(11020 => cuDeviceGetDefaultMemPool / copy_cuDeviceGetDefaultMemPool)
        }
        "cuMemGetAllocationGranularity" => {
            v!(10020 => cuMemGetAllocationGranularity / copy_cuMemGetAllocationGranularity)
        }
        "cuMemCreate" => v!(10020 => cuMemCreate / copy_cuMemCreate),
        "cuMemRelease" => v!(10020 => cuMemRelease / copy_cuMemRelease),
        "cuArrayCreate" => {
            v!(3020 => cuArrayCreate_v2 / copy_cuArrayCreate_v2, 2000 => cuArrayCreate / copy_cuArrayCreate)
        }
        "cuArray3DCreate" => {
            v!(3020 => cuArray3DCreate_v2 / copy_cuArray3DCreate_v2, 2000 => cuArray3DCreate / copy_cuArray3DCreate)
        }
        "cuArrayDestroy" => v!(2000 => cuArrayDestroy / copy_cuArrayDestroy),
        "cuMipmappedArrayCreate" => v!(5000 => cuMipmappedArrayCreate / copy_cuMipmappedArrayCreate),
        "cuMipmappedArrayDestroy" => v!(5000 => cuMipmappedArrayDestroy / copy_cuMipmappedArrayDestroy),
        "cuGetProcAddress" => vec![
            (
                12000,
                cuGetProcAddress_v2 as *mut c_void,
                cuGetProcAddress_v2 as *mut c_void,
            ),
            (
                11030,
                cuGetProcAddress as *mut c_void,
                cuGetProcAddress as *mut c_void,
            ),
        ],
        _ => return None,
    })
}

fn proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> (CUresult, c_int) {
    catch_unwind(|| {
        if symbol.is_null() || pfn.is_null() || flags > PER_THREAD_DEFAULT_STREAM {
            return (INVALID_VALUE, STATUS_SYMBOL_NOT_FOUND);
        }
        // Works before cuInit, as the driver's does: the CUDA runtime looks cuInit up this way.
        let copies = std::env::var_os("GPUMEM_FAKE_CUDA_PROC_COPIES").is_some_and(|v| v == "1");
        // SAFETY: non-null, NUL-terminated per the API.
        let name = unsafe { CStr::from_ptr(symbol) }.to_str().unwrap_or("");
        // SAFETY: non-null per the check above.
        unsafe { pfn.write(std::ptr::null_mut()) };
        let Some(versions) = versions(name, flags == PER_THREAD_DEFAULT_STREAM) else {
            return (NOT_FOUND, STATUS_SYMBOL_NOT_FOUND);
        };
        match versions.iter().find(|(since, _, _)| *since <= version) {
            Some(&(_, exported, copy)) => {
                // SAFETY: as above.
                unsafe { pfn.write(if copies { copy } else { exported }) };
                (SUCCESS, STATUS_SUCCESS)
            }
            None => (NOT_FOUND, STATUS_VERSION_NOT_SUFFICIENT),
        }
    })
    .unwrap_or((UNKNOWN, STATUS_SYMBOL_NOT_FOUND))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    proc_address(symbol, pfn, version, flags).0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    let (result, found) = proc_address(symbol, pfn, version, flags);
    if !status.is_null() {
        // SAFETY: non-null; points at a CUdriverProcAddressQueryResult per the API.
        unsafe { status.write(found) };
    }
    result
}
