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

/// Runs `cargo build -p gpumem-fake-nvml` for the test executable's profile and target directory,
/// then links the built library into a directory of its own.
fn build_fake_nvml() -> PathBuf {
    let exe = std::env::current_exe().expect("cannot tell where the test executable is");
    // The test executable is <target-dir>/[<triple>/]<profile-dir>/deps/<name>-<hash>.
    let profile_dir = exe.parent().and_then(Path::parent).unwrap_or_else(|| {
        panic!(
            "test executable {} is not in <target>/<profile>/deps",
            exe.display()
        )
    });
    let profile_name = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_else(|| panic!("cannot tell the cargo profile from {}", profile_dir.display()));
    let cargo_profile = match profile_name {
        "debug" => "dev",
        other => other,
    };
    let above = profile_dir.parent().expect("the profile directory has a parent");
    // Cargo marks the root of a target directory with CACHEDIR.TAG; one level further up means a
    // `--target <triple>` build.
    let (target_dir, triple) = match above.parent() {
        Some(root) if !above.join("CACHEDIR.TAG").exists() && root.join("CACHEDIR.TAG").exists() => {
            (root, above.file_name().and_then(|n| n.to_str()))
        }
        _ => (above, None),
    };

    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(&cargo);
    command
        .arg("build")
        .arg("--manifest-path")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .args(["-p", "gpumem-fake-nvml", "--profile", cargo_profile])
        .arg("--target-dir")
        .arg(target_dir)
        .arg("--message-format=json-render-diagnostics");
    if let Some(triple) = triple {
        command.args(["--target", triple]);
    }
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", Path::new(&cargo).display()));
    if !output.status.success() {
        panic!(
            "building the fake NVML library failed ({:?}):\n{}",
            command,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let built = built_library(&output.stdout).unwrap_or_else(|| {
        panic!(
            "cargo built gpumem-fake-nvml but reported no libgpumem_fake_nvml.so:\n{}",
            String::from_utf8_lossy(&output.stdout)
        )
    });

    let dir = built
        .parent()
        .expect("the library has a directory")
        .join("fake-nvml");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    for name in ["libnvidia-ml.so.1", "libnvidia-ml.so"] {
        link_atomically(&built, &dir.join(name));
    }
    dir
}

/// The `.so` path from cargo's JSON messages (`compiler-artifact` of target `gpumem_fake_nvml`).
fn built_library(json_lines: &[u8]) -> Option<PathBuf> {
    String::from_utf8_lossy(json_lines)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "gpumem_fake_nvml")
        .flat_map(|m| m["filenames"].as_array().cloned().unwrap_or_default())
        .filter_map(|f| f.as_str().map(PathBuf::from))
        .find(|f| f.extension().is_some_and(|e| e == "so"))
}

/// Points `link` at `target`, replacing whatever was there without a moment where it is missing
/// (test processes run side by side under nextest).
fn link_atomically(target: &Path, link: &Path) {
    if std::fs::read_link(link).is_ok_and(|current| current == target) {
        return;
    }
    let name = link.file_name().and_then(|n| n.to_str()).unwrap_or("link");
    let temp = link.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&temp);
    std::os::unix::fs::symlink(target, &temp)
        .unwrap_or_else(|e| panic!("cannot create symlink {}: {e}", temp.display()));
    std::fs::rename(&temp, link)
        .unwrap_or_else(|e| panic!("cannot rename {} into place: {e}", temp.display()));
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
pub mod apiserver;
pub mod kubelet;
