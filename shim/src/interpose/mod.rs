//! The exported symbols: CUDA driver and NVML wrappers, `dlsym`, and what they share (the
//! configuration, logging, the driver's constants and the macros naming its functions).
//!
//! - `real`: the driver's functions, resolved once;
//! - `enforcer`: the accounting, this process's tables, and their lifecycle (load, fork, exit);
//! - `alloc`: the allocation and free wrappers;
//! - `query`: the memory queries;
//! - `lookup`: `cuGetProcAddress` and `dlsym`.
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

macro_rules! symbols {
    (wrapped { $($w:ident: $wl:ident),* $(,)? } helpers { $($h:ident: $hl:ident),* $(,)? }) => {
        /// Every driver symbol the shim calls; the wrapped ones are also exported by the shim.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, PartialEq, Eq, Debug)]
        pub(super) enum Sym { $($w,)* $($h,)* }

        pub(super) const SYMBOLS: &[(Sym, &CStr, Lib, bool)] = &[
            $((Sym::$w, cstr(concat!(stringify!($w), "\0")), Lib::$wl, true),)*
            $((Sym::$h, cstr(concat!(stringify!($h), "\0")), Lib::$hl, false),)*
        ];

        /// The shim's own export for a wrapped symbol.
        pub(super) fn wrapper(sym: Sym) -> *mut c_void {
            match sym {
                $(Sym::$w => $w as *mut c_void,)*
                _ => null_mut(),
            }
        }
    };
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

mod alloc;
mod enforcer;
mod lookup;
mod query;
mod real;

use alloc::*;
use enforcer::*;
use lookup::*;
use query::*;
use real::*;
