//! Shared support for integration tests (`mod support;`): the fake NVML library and its inject file.
//!
//! The fake `libnvidia-ml.so.1` is the `gpumem-fake-nvml` workspace member (see its `lib.rs` for the
//! environment it reads and the inject file format). Load it in-process with
//! `Nvml::builder().lib_path(fake_nvml_lib().as_os_str()).init()`, or start a process (the agent)
//! with `LD_LIBRARY_PATH` = [`fake_nvml_dir`] so that a plain `dlopen("libnvidia-ml.so.1")` finds
//! it. `LD_LIBRARY_PATH` is read by the dynamic loader once, at process start: setting it inside
//! a running test process does not affect that process's own `dlopen`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

/// Environment variable the fake library reads its profile from (a built-in name or a path).
#[allow(dead_code)]
pub const PROFILE_ENV: &str = "GPUMEM_FAKE_NVML_PROFILE";
/// Environment variable the fake library reads the inject file's path from.
#[allow(dead_code)]
pub const INJECT_ENV: &str = "GPUMEM_FAKE_NVML_INJECT";

/// A directory holding `libnvidia-ml.so.1` (and `libnvidia-ml.so`), symlinks to the fake library,
/// built first if needed (once per test process) with the same cargo profile and target directory
/// as the running test executable.
#[allow(dead_code)]
pub fn fake_nvml_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(build_fake_nvml).clone()
}

/// The fake library under the name NVML has: `fake_nvml_dir()/libnvidia-ml.so.1`.
#[allow(dead_code)]
pub fn fake_nvml_lib() -> PathBuf {
    fake_nvml_dir().join("libnvidia-ml.so.1")
}

/// Serialises the tests of one test binary that load the fake library into the test process itself.
///
/// The library keeps process-wide state (every `dlopen` of the same path returns the same copy) and
/// reads its environment variables only at the first init after the last `nvmlShutdown`. nextest
/// runs each test in a process of its own, but `cargo test` runs a binary's tests as threads of one
/// process: hold this guard from before setting the variables until every `Nvml` of the test (and
/// any clone a background thread holds) has been dropped. Tests that start a separate process
/// (the agent) with the variables in its environment need no lock.
#[allow(dead_code)]
pub fn fake_nvml_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    // A test that failed while holding it has dropped its Nvml while unwinding.
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Builds the fake NVML library for the test executable's profile and target directory, then
/// links it into a directory of its own under the names NVML has.
fn build_fake_nvml() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let profile_dir = cdylib::build_packages(&manifest, cdylib::TEST_LIBRARIES);
    let built = cdylib::built(&profile_dir, "libgpumem_fake_nvml.so");
    let dir = profile_dir.join("fake-nvml");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    for name in ["libnvidia-ml.so.1", "libnvidia-ml.so"] {
        cdylib::link_atomically(&built, &dir.join(name));
    }
    dir
}

/// Writes the fake library's inject file (format: the doc comment of `fake-nvml/src/lib.rs`).
///
/// Every change rewrites the whole file atomically (a temporary file renamed over it), so the
/// process under test never reads half a file, and each version has a new inode, which the
/// library notices even within one modification-time tick.
#[allow(dead_code)]
#[derive(Debug)]
pub struct InjectFile {
    path: PathBuf,
    lost: Vec<u32>,
    memory_used_mib: BTreeMap<u32, u64>,
    xid: Vec<(u32, u64)>,
    hung: Vec<u32>,
    event_wait_error: Option<u32>,
}

#[allow(dead_code)]
impl InjectFile {
    /// Starts the file over, with no faults, and writes it now.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        let file = Self {
            path: path.into(),
            lost: Vec::new(),
            memory_used_mib: BTreeMap::new(),
            xid: Vec::new(),
            hung: Vec::new(),
            event_wait_error: None,
        };
        file.write();
        file
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// These GPU indices (and only these) are lost from now on.
    pub fn set_lost(&mut self, gpus: &[u32]) {
        self.lost = gpus.to_vec();
        self.write();
    }

    /// GPU `gpu` has `mib` MiB of memory in use from now on.
    pub fn set_memory_used(&mut self, gpu: u32, mib: u64) {
        self.memory_used_mib.insert(gpu, mib);
        self.write();
    }

    /// These GPU indices (and only these) hang from now on: calls about them block until released.
    pub fn set_hung(&mut self, gpus: &[u32]) {
        self.hung = gpus.to_vec();
        self.write();
    }

    /// Every `nvmlEventSetWait_v2` fails with this NVML error code from now on (None: waits work).
    pub fn set_event_wait_error(&mut self, code: Option<u32>) {
        self.event_wait_error = code;
        self.write();
    }

    /// Appends a critical XID event on GPU `gpu`; every event set registered for it delivers it once.
    pub fn push_xid(&mut self, gpu: u32, xid: u64) {
        self.xid.push((gpu, xid));
        self.write();
    }

    /// The TOML text this file holds.
    pub fn to_toml(&self) -> String {
        let mut text = String::new();
        let lost: Vec<String> = self.lost.iter().map(u32::to_string).collect();
        let _ = writeln!(text, "lost = [{}]", lost.join(", "));
        let hung: Vec<String> = self.hung.iter().map(u32::to_string).collect();
        let _ = writeln!(text, "hung = [{}]", hung.join(", "));
        if let Some(code) = self.event_wait_error {
            let _ = writeln!(text, "event_wait_error = {code}");
        }
        text.push_str("\n[memory_used_mib]\n");
        for (gpu, mib) in &self.memory_used_mib {
            let _ = writeln!(text, "\"{gpu}\" = {mib}");
        }
        for (gpu, xid) in &self.xid {
            let _ = write!(text, "\n[[xid]]\ngpu = {gpu}\nxid = {xid}\n");
        }
        text
    }

    fn write(&self) {
        static SEQUENCE: AtomicU64 = AtomicU64::new(0);
        let name = self
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("inject.toml");
        let temp = self.path.with_file_name(format!(
            ".{name}.{}.{}.tmp",
            std::process::id(),
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&temp, self.to_toml())
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", temp.display()));
        std::fs::rename(&temp, &self.path)
            .unwrap_or_else(|e| panic!("cannot rename {} to {}: {e}", temp.display(), self.path.display()));
    }
}
/// `program` as a command; with `open_files`, started through `sh` under that `RLIMIT_NOFILE`
/// (`ulimit -n`, then `exec`: the child's pid is the program's).
#[allow(dead_code)]
pub fn command(program: &str, open_files: Option<u64>) -> Command {
    match open_files {
        None => Command::new(program),
        Some(limit) => {
            let mut sh = Command::new("sh");
            sh.args([
                "-c",
                r#"ulimit -n "$0" && exec "$@""#,
                &limit.to_string(),
                program,
            ]);
            sh
        }
    }
}

pub mod agent;
pub mod apiserver;
mod cdylib;
pub mod dra_kubelet;
pub mod kubelet;
