//! `libgpumem_cuda.so`: holds every process of a container to the container's GPU memory limit, by
//! interposing the CUDA driver API in-process.
//!
//! Loaded into every process of the container (through `/etc/ld.so.preload`, which the agent mounts,
//! or `LD_PRELOAD`). In a process that never touches CUDA it costs one `getenv` per variable at load.
//!
//! # Environment (set by the agent in Allocate; read once, at load)
//!
//! - `GPUMEM_LIMIT_MIB`: the limit in MiB. One number applies to every visible device (each counted
//!   on its own); a comma list gives one limit per CUDA device ordinal (`5000,3000`), devices past
//!   the list unlimited. Unset or empty: the value the container's first process (PID 1 of its PID
//!   namespace) was started with, from `/proc/1/environ` (so a program started with a cleared
//!   environment is still held, and `GPUMEM_ACCOUNTING_DIR` comes from there too if it lacks it); if
//!   that has none either: **pass-through**, every call goes to the driver untouched and every lookup
//!   returns the driver's own answer. Set but invalid: every allocation is refused (fail closed) and
//!   an error says why.
//! - `GPUMEM_ACCOUNTING_DIR`: the directory (one per container, mounted by the agent) holding the
//!   accounting file `gpumem-accounting` that all processes of the container share (format: the
//!   `gpumem-accounting` crate). Unset or unusable: each process is held to the limit on its own,
//!   with a warning.
//! - `GPUMEM_LOG`: `off`, `error`, `warn` (default), `info` or `debug`. Lines go to stderr, prefixed
//!   `GPUMEM <level> [pid N]:`. Reaching the limit is logged once per process at `warn`.
//! - `CUDA_DEVICE_ORDER=PCI_BUS_ID` (set by the agent with a comma list) makes CUDA ordinals agree
//!   with NVML indices, which the NVML wrappers rely on.
//!
//! # What is interposed
//!
//! Every ABI version the CUDA 11/12/13 headers define of: `cuMemAlloc[_v2]`,
//! `cuMemAllocPitch[_v2]`, `cuMemAllocManaged`, `cuMemAllocAsync[_ptsz]`,
//! `cuMemAllocFromPoolAsync[_ptsz]`, `cuMemFree[_v2]`, `cuMemFreeAsync[_ptsz]`, `cuMemCreate`,
//! `cuMemRelease`, `cuArrayCreate[_v2]`, `cuArray3DCreate[_v2]`, `cuArrayDestroy`,
//! `cuMipmappedArrayCreate`, `cuMipmappedArrayDestroy`, `cuMemGetInfo[_v2]` (total = limit, free =
//! min(driver's free, limit - used)), and `nvmlDeviceGetMemoryInfo[_v2]` (same view, for
//! `nvidia-smi`). The three ways code reaches them are covered: linking (the exports above),
//! `dlsym` (interposed: a lookup of a wrapped symbol that yields the driver's function yields the
//! wrapper), and `cuGetProcAddress[_v2]` (interposed: the driver's answer is replaced by the wrapper
//! of the very ABI version it chose, by address, or by name and the header rules).
//!
//! # Hot path
//!
//! An allocation costs: a few relaxed loads (configuration, resolved function, enforcer), one
//! compare-and-swap on the container's shared per-device counter (the only contended atomic), one
//! uncontended add on this process's slot, and one uncontended CAS in this process's pointer table;
//! a free the same in reverse. No allocation, no syscall, no `getenv`, no lock. Everything else —
//! resolving the driver, mapping the accounting file, building the tables, reaping dead processes,
//! logging — happens once, or only on the way to refusing an allocation.
//!
//! No panic crosses the C boundary: hot paths are panic-free by construction (checked arithmetic,
//! no indexing that can fail), cold paths run under `catch_unwind`.

#![allow(non_snake_case, clippy::missing_safety_doc)]
// The unit-test build leaves out the exported layer (see `interpose`), so some helpers go unused.
#![cfg_attr(test, allow(dead_code))]

mod config;
#[cfg(not(test))]
mod interpose;
mod log;
mod sizes;
mod table;
