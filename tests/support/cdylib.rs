//! Builds workspace cdylibs (the fake NVML, the fake CUDA driver, the shim) from a running test, with
//! the test executable's cargo profile and target directory, and links them under the names the
//! dynamic loader looks for. Shared by the root package's tests (`mod cdylib;` in `support`) and the
//! shim's (`#[path]`), so the target-directory logic lives once.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Every test-only library and the shim, built together by every test that needs any of them: the
/// same invocation everywhere, so one test binary's build never rebuilds (and replaces under a running
/// process) what another's just built with other feature unification.
pub const TEST_LIBRARIES: &[&str] = &["gpumem-cuda-shim", "gpumem-fake-cuda", "gpumem-fake-nvml"];

/// Runs `cargo build -p <package>...` for `manifest` and returns the profile directory the
/// libraries were written to (`<target>/[<triple>/]<profile>`).
pub fn build_packages(manifest: &Path, packages: &[&str]) -> PathBuf {
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
    command.arg("build").arg("--manifest-path").arg(manifest);
    for package in packages {
        command.args(["-p", package]);
    }
    command
        .args(["--profile", cargo_profile])
        .arg("--target-dir")
        .arg(target_dir);
    if let Some(triple) = triple {
        command.args(["--target", triple]);
    }
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", Path::new(&cargo).display()));
    assert!(
        output.status.success(),
        "building {packages:?} failed ({command:?}):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    profile_dir.to_path_buf()
}

/// `<profile_dir>/<file>`, which the build must have produced.
pub fn built(profile_dir: &Path, file: &str) -> PathBuf {
    let path = profile_dir.join(file);
    assert!(path.exists(), "cargo built no {}", path.display());
    path
}

/// Points `link` at `target`, replacing whatever was there without a moment where it is missing
/// (test processes run side by side under nextest).
pub fn link_atomically(target: &Path, link: &Path) {
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
