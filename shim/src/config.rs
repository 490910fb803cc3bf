//! The environment contract, read once per process (see the crate documentation).

use std::ffi::{CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use gpumem_accounting::{Limits, MAX_DEVICES, UNLIMITED};

/// Verbosity of the `GPUMEM ...` lines on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Off,
    Error,
    Warn,
    Info,
    Debug,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Off => "off",
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
        }
    }
}

/// What the environment says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `None`: no limit set, everything passes through untouched.
    pub limits: Option<Limits>,
    pub dir: Option<PathBuf>,
    pub log: Level,
    /// Problems found while reading the environment, logged once reading is done.
    pub problems: Vec<String>,
    /// The limit (and, if this process had none, the directory) came from the environment of the
    /// container's first process, this process's own having no `GPUMEM_LIMIT_MIB`.
    pub from_init: bool,
}

/// The variable naming the limit(s) in MiB.
pub const LIMIT_ENV: &CStr = c"GPUMEM_LIMIT_MIB";
/// The variable naming the directory of the accounting file.
pub const DIR_ENV: &CStr = c"GPUMEM_ACCOUNTING_DIR";
/// The variable naming the log level.
pub const LOG_ENV: &CStr = c"GPUMEM_LOG";

impl Config {
    /// Reads the process environment (with `getenv`: no allocation for absent variables).
    pub fn from_env() -> Self {
        fn var(name: &CStr) -> Option<&'static [u8]> {
            // SAFETY: a NUL-terminated name; the result, if any, is a NUL-terminated string in the
            // environment, which this library never changes. Read once, at load, before threads
            // normally exist.
            let value = unsafe { libc::getenv(name.as_ptr()) };
            (!value.is_null()).then(|| unsafe { CStr::from_ptr(value) }.to_bytes())
        }
        let limit = var(LIMIT_ENV);
        if limit.is_some_and(|l| !l.trim_ascii().is_empty()) {
            return Self::from_vars(limit, var(DIR_ENV), var(LOG_ENV));
        }
        // A program may have been started with a cleared environment (`env -i`, sudo, a launcher
        // that passes its workers only what it chooses): the container's own, which its first
        // process (PID 1 in the container's PID namespace) was started with, still applies.
        let init = std::fs::read("/proc/1/environ").unwrap_or_default();
        let init_var = |name: &CStr| {
            let prefix = [name.to_bytes(), b"="].concat();
            init.split(|&b| b == 0)
                .find_map(|entry| entry.strip_prefix(prefix.as_slice()))
        };
        let Some(limit) = init_var(LIMIT_ENV).filter(|l| !l.trim_ascii().is_empty()) else {
            return Self::from_vars(None, var(DIR_ENV), var(LOG_ENV));
        };
        let mut config = Self::from_vars(
            Some(limit),
            var(DIR_ENV).or_else(|| init_var(DIR_ENV)),
            var(LOG_ENV),
        );
        config.from_init = config.limits.is_some();
        config
    }

    pub fn from_vars(limit: Option<&[u8]>, dir: Option<&[u8]>, log: Option<&[u8]>) -> Self {
        let mut problems = Vec::new();
        let log = match log.map(|l| l.trim_ascii()) {
            None | Some(b"") | Some(b"warn") | Some(b"warning") => Level::Warn,
            Some(b"off") | Some(b"none") => Level::Off,
            Some(b"error") => Level::Error,
            Some(b"info") => Level::Info,
            Some(b"debug") | Some(b"trace") => Level::Debug,
            Some(other) => {
                problems.push(format!(
                    "GPUMEM_LOG={:?} is not one of off, error, warn, info, debug; using warn",
                    String::from_utf8_lossy(other)
                ));
                Level::Warn
            }
        };
        let limits = match limit.map(|l| l.trim_ascii()) {
            None | Some(b"") => None,
            Some(text) => Some(parse_limits(text).unwrap_or_else(|reason| {
                // Fail closed: a limit was meant to apply; nothing may be allocated until it is fixed.
                problems.push(format!(
                    "GPUMEM_LIMIT_MIB={:?} is invalid ({reason}); refusing all GPU memory",
                    String::from_utf8_lossy(text)
                ));
                [0; MAX_DEVICES]
            })),
        };
        let dir = dir
            .filter(|d| !d.is_empty())
            .map(|d| PathBuf::from(OsStr::from_bytes(d)));
        Self {
            limits,
            dir,
            log,
            problems,
            from_init: false,
        }
    }
}

/// `"5000"`: 5000 MiB on every device; `"5000,3000"`: per CUDA device ordinal, devices past the
/// list unlimited.
pub fn parse_limits(text: &[u8]) -> Result<Limits, String> {
    let mut limits = [UNLIMITED; MAX_DEVICES];
    let text = std::str::from_utf8(text).map_err(|_| "not UTF-8".to_owned())?;
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    if parts.len() > MAX_DEVICES {
        return Err(format!("{} values, at most {MAX_DEVICES} devices", parts.len()));
    }
    for (device, part) in parts.iter().enumerate() {
        let mib: u64 = part
            .parse()
            .map_err(|_| format!("{part:?} is not a whole number of MiB"))?;
        let bytes = mib
            .checked_mul(1 << 20)
            .filter(|&b| b != UNLIMITED)
            .ok_or_else(|| format!("{mib} MiB is too large"))?;
        limits[device] = bytes;
    }
    if parts.len() == 1 {
        limits = [limits[0]; MAX_DEVICES];
    }
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits() {
        assert_eq!(parse_limits(b"5000"), Ok([5000 << 20; MAX_DEVICES]));
        let two = parse_limits(b" 1, 2 ").expect("list");
        assert_eq!(&two[..3], &[1 << 20, 2 << 20, UNLIMITED]);
        assert_eq!(parse_limits(b"0"), Ok([0; MAX_DEVICES]));
        for bad in [
            &b"x"[..],
            b"1,,2",
            b"-1",
            b"1.5",
            b"99999999999999999",
            b"1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17",
        ] {
            assert!(parse_limits(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn environment() {
        let none = Config::from_vars(None, None, None);
        assert_eq!(
            (none.limits, none.dir, none.log, none.problems.len()),
            (None, None, Level::Warn, 0)
        );
        assert_eq!(Config::from_vars(Some(b""), Some(b""), Some(b"")).limits, None);

        let set = Config::from_vars(Some(b"100"), Some(b"/run/gpumem"), Some(b"debug"));
        assert_eq!(set.limits, Some([100 << 20; MAX_DEVICES]));
        assert_eq!(set.dir, Some(PathBuf::from("/run/gpumem")));
        assert_eq!(set.log, Level::Debug);

        let bad = Config::from_vars(Some(b"lots"), None, Some(b"loud"));
        assert_eq!(
            bad.limits,
            Some([0; MAX_DEVICES]),
            "an invalid limit refuses everything"
        );
        assert_eq!(bad.problems.len(), 2);
        assert_eq!(bad.log, Level::Warn);
    }
}
