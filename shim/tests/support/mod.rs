//! Builds what the shim's tests run: `libgpumem_cuda.so`, the fake `libcuda.so.1` and the fake
//! `libnvidia-ml.so.1` (one `cargo build`, same profile and target directory as the running test
//! executable, once per test process), and the C programs under `tests/c/` (with `cc`, cached by
//! content in the target directory, so parallel test processes compile each one once).

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

#[path = "../../../tests/support/cdylib.rs"]
mod cdylib;

/// The built libraries and where the test programs go.
#[derive(Debug)]
pub struct Built {
    /// `libgpumem_cuda.so`.
    pub shim: PathBuf,
    /// A directory with `libcuda.so.1` and `libcuda.so` (symlinks to the fake driver).
    pub cuda_dir: PathBuf,
    /// A directory with `libnvidia-ml.so.1` and `libnvidia-ml.so` (the workspace's fake NVML).
    pub nvml_dir: PathBuf,
    /// Where compiled C programs are kept.
    pub bin_dir: PathBuf,
}

pub fn built() -> &'static Built {
    static BUILT: OnceLock<Built> = OnceLock::new();
    BUILT.get_or_init(build)
}

fn build() -> Built {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let profile_dir = cdylib::build_packages(&manifest, cdylib::TEST_LIBRARIES);
    let shim = cdylib::built(&profile_dir, "libgpumem_cuda.so");
    let fake_cuda = cdylib::built(&profile_dir, "libgpumem_fake_cuda.so");
    let fake_nvml = cdylib::built(&profile_dir, "libgpumem_fake_nvml.so");
    let root = profile_dir.join("gpumem-shim-tests");
    let (cuda_dir, nvml_dir, bin_dir) = (root.join("cuda"), root.join("nvml"), root.join("bin"));
    for dir in [&cuda_dir, &nvml_dir, &bin_dir] {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    }
    for name in ["libcuda.so.1", "libcuda.so"] {
        cdylib::link_atomically(&fake_cuda, &cuda_dir.join(name));
    }
    for name in ["libnvidia-ml.so.1", "libnvidia-ml.so"] {
        cdylib::link_atomically(&fake_nvml, &nvml_dir.join(name));
    }
    Built {
        shim,
        cuda_dir,
        nvml_dir,
        bin_dir,
    }
}

/// How a test program reaches the driver (see `tests/c/probe.c`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Direct,
    Dlsym,
    ProcAddr,
}

pub const MODES: [Mode; 3] = [Mode::Direct, Mode::Dlsym, Mode::ProcAddr];

impl Mode {
    fn define(self) -> &'static str {
        match self {
            Mode::Direct => "MODE_DIRECT",
            Mode::Dlsym => "MODE_DLSYM",
            Mode::ProcAddr => "MODE_PROCADDR",
        }
    }
}

/// `tests/c/<source>` compiled for `mode` (linked against the fake library `link` in direct mode).
fn compile(source: &str, mode: Mode, link: &str, extra: &[&str]) -> PathBuf {
    let built = built();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c");
    let text = std::fs::read(dir.join(source)).unwrap_or_else(|e| panic!("cannot read {source}: {e}"));
    let header = std::fs::read(dir.join("cuda_min.h")).expect("cannot read cuda_min.h");
    let mut hasher = DefaultHasher::new();
    (&text, &header, mode.define(), link, extra).hash(&mut hasher);
    let stem = source.trim_end_matches(".c");
    let out = built
        .bin_dir
        .join(format!("{stem}-{}-{:016x}", mode.define(), hasher.finish()));
    if out.exists() {
        return out;
    }
    let temp = out.with_extension(format!("tmp{}", std::process::id()));
    let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let lib_dir = if link == "cuda" {
        &built.cuda_dir
    } else {
        &built.nvml_dir
    };
    let mut command = Command::new(&cc);
    command
        .args([
            "-O2",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-D_GNU_SOURCE",
        ])
        .arg(format!("-D{}", mode.define()))
        .arg(dir.join(source))
        .arg("-o")
        .arg(&temp)
        .args(extra);
    if mode == Mode::Direct {
        command.arg("-L").arg(lib_dir).arg(format!("-l{link}"));
    }
    command.arg("-ldl");
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", Path::new(&cc).display()));
    assert!(
        output.status.success(),
        "compiling {source} failed ({command:?}):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::rename(&temp, &out).unwrap_or_else(|e| panic!("cannot rename {}: {e}", temp.display()));
    out
}

pub fn probe(mode: Mode) -> PathBuf {
    compile("probe.c", mode, "cuda", &[])
}

pub fn nvml_program(mode: Mode) -> PathBuf {
    compile("nvml.c", mode, "nvidia-ml", &[])
}

#[allow(dead_code)] // used by the benchmark
pub fn bench_program() -> PathBuf {
    compile("bench.c", Mode::Direct, "cuda", &[])
}

/// The shim's settings for one run.
#[derive(Debug, Clone, Default)]
pub struct Shim<'a> {
    /// Preload the shim at all.
    pub preload: bool,
    pub limit_mib: Option<&'a str>,
    pub dir: Option<&'a Path>,
    pub log: Option<&'a str>,
}

impl<'a> Shim<'a> {
    pub fn off() -> Self {
        Self::default()
    }

    pub fn passthrough() -> Self {
        Self {
            preload: true,
            ..Self::default()
        }
    }

    pub fn limit(mib: &'a str, dir: Option<&'a Path>) -> Self {
        Self {
            preload: true,
            limit_mib: Some(mib),
            dir,
            log: None,
        }
    }
}

/// A command for `program` with a clean environment for the shim and the fakes (no inherited
/// GPUMEM_* or LD_PRELOAD), the fakes on the library path, and `shim` applied.
pub fn command(program: &Path, shim: &Shim<'_>) -> Command {
    let built = built();
    let mut command = Command::new(program);
    for (key, _) in std::env::vars_os() {
        if key
            .to_str()
            .is_some_and(|k| k.starts_with("GPUMEM_") || k == "LD_PRELOAD")
        {
            command.env_remove(&key);
        }
    }
    let path = std::env::join_paths([&built.cuda_dir, &built.nvml_dir]).expect("library path");
    command
        .env("LD_LIBRARY_PATH", path)
        .env("GPUMEM_FAKE_NVML_PROFILE", "t4x4");
    if shim.preload {
        command.env("LD_PRELOAD", &built.shim);
    }
    if let Some(limit) = shim.limit_mib {
        command.env("GPUMEM_LIMIT_MIB", limit);
    }
    if let Some(dir) = shim.dir {
        command.env("GPUMEM_ACCOUNTING_DIR", dir);
    }
    if let Some(log) = shim.log {
        command.env("GPUMEM_LOG", log);
    }
    command.stdin(Stdio::null());
    command
}

/// Runs to completion; panics if the program fails.
pub fn run(mut command: Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A probe left running after its `hold` command: it keeps its allocations until released.
pub struct Holder {
    pub child: Child,
    pub stdout: BufReader<ChildStdout>,
}

impl Holder {
    /// Starts `command` (whose last command should be `hold`) and waits until it holds.
    pub fn start(mut command: Command) -> Self {
        command.stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
        let Some(out) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the holder's stdout is not piped");
        };
        let mut stdout = BufReader::new(out);
        let mut seen = String::new();
        loop {
            let mut line = String::new();
            match stdout.read_line(&mut line) {
                Ok(read) if read > 0 => {}
                result => {
                    let _ = child.kill();
                    let status = child.wait();
                    panic!("the holder stopped before holding ({result:?}, {status:?}); it printed:\n{seen}");
                }
            }
            seen.push_str(&line);
            if line.trim() == "holding" {
                return Self { child, stdout };
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lets it go on (closes its stdin) and returns the rest of its output once it exits.
    pub fn release(mut self) -> String {
        drop(self.child.stdin.take());
        let mut rest = String::new();
        for line in (&mut self.stdout).lines() {
            rest.push_str(&line.expect("reading the holder's output"));
            rest.push('\n');
        }
        let status = self.child.wait().expect("waiting for the holder");
        assert!(status.success(), "the holder failed: {status}");
        rest
    }

    /// SIGKILL, then reaps the child.
    pub fn kill(mut self) {
        self.child.kill().expect("killing the holder");
        self.child.wait().expect("waiting for the holder");
    }
}

/// A fresh accounting directory.
pub fn accounting_dir() -> tempfile::TempDir {
    static N: AtomicU64 = AtomicU64::new(0);
    tempfile::Builder::new()
        .prefix(&format!("gpumem-acct-{}-", N.fetch_add(1, Ordering::Relaxed)))
        .tempdir()
        .expect("temp dir")
}

pub const MIB: u64 = 1 << 20;

/// The usage in `dir`'s accounting file as the agent reads it while a process of the container is
/// attached. The agent counts nothing in a file no process holds any more (its processes all exited
/// or were killed); attaching first shows what the counters hold.
pub fn usage_while_attached(dir: &Path) -> gpumem_accounting::Usage {
    let limits = [gpumem_accounting::UNLIMITED; gpumem_accounting::MAX_DEVICES];
    let (attached, _) = gpumem_accounting::Accounting::open_or_create(dir, &limits).expect("attach");
    let usage = gpumem_accounting::read_usage(dir)
        .expect("readable")
        .expect("created");
    drop(attached);
    usage
}
