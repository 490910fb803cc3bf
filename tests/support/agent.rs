//! The real `gpumem agent` process on a node of doubles: a temp dir, the kubelet and PodResources
//! doubles, and the fake NVML library's inject file.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::InjectFile;
use super::apiserver::FakeApiServer;
use super::kubelet::{Authority, FakeKubelet, FakePodResources};

/// A running agent; killed when dropped.
pub struct Agent {
    pub child: Child,
    stderr: PathBuf,
}

impl Agent {
    fn start(
        dir: &Path,
        profile: &str,
        inject: &Path,
        extra: &[&str],
        kubeconfig: Option<&Path>,
        open_files: Option<u64>,
    ) -> Agent {
        let stderr = dir.join(format!("agent-{}.log", std::process::id()));
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&stderr)
            .unwrap();
        let child = super::command(env!("CARGO_BIN_EXE_gpumem"), open_files)
            .arg("agent")
            .arg("--device-plugin-dir")
            .arg(dir.join("plugins"))
            .arg("--pod-resources-socket")
            .arg(dir.join("pod-resources.sock"))
            .args(["--health-quiet-period", "1", "--health-probe-interval", "1"])
            .args(if extra.contains(&"--memory-limits") {
                &[][..]
            } else {
                &["--memory-limits", "off"][..]
            })
            .args(extra)
            .env("LD_LIBRARY_PATH", super::fake_nvml_dir())
            .env("GPUMEM_FAKE_NVML_PROFILE", profile)
            .env("GPUMEM_FAKE_NVML_INJECT", inject)
            .env("RUST_LOG", "info")
            .env_remove("NODE_NAME")
            .envs(kubeconfig.map(|k| ("KUBECONFIG", k)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Agent { child, stderr }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not exit on SIGTERM:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A node: temp dir, kubelet double, PodResources double, inject file.
pub struct Node {
    pub kubelet: FakeKubelet,
    pub pods: FakePodResources,
    pub inject: InjectFile,
    /// Last: fields drop in order, and the doubles must stop writing here before it is removed.
    pub dir: tempfile::TempDir,
}

impl Node {
    /// A node whose kubelet is older than 1.26 (it sends the socket path as `:authority`).
    pub async fn new() -> Node {
        Node::with_kubelet(Authority::SocketPath).await
    }

    pub async fn with_kubelet(authority: Authority) -> Node {
        let dir = tempfile::Builder::new().prefix("gpm").tempdir_in("/tmp").unwrap();
        let kubelet = FakeKubelet::start_with(&dir.path().join("plugins"), authority).await;
        let pods = FakePodResources::start(&dir.path().join("pod-resources.sock")).await;
        let inject = InjectFile::new(dir.path().join("inject.toml"));
        Node {
            dir,
            kubelet,
            pods,
            inject,
        }
    }

    pub fn agent(&self, profile: &str, extra: &[&str]) -> Agent {
        Agent::start(self.dir.path(), profile, self.inject.path(), extra, None, None)
    }

    /// An agent that may hold at most `open_files` descriptors (`RLIMIT_NOFILE`).
    pub fn agent_with_open_files(&self, profile: &str, extra: &[&str], open_files: u64) -> Agent {
        Agent::start(
            self.dir.path(),
            profile,
            self.inject.path(),
            extra,
            None,
            Some(open_files),
        )
    }

    /// An agent for Node `node-a` that talks to `api`.
    pub fn agent_with_api(&self, profile: &str, api: &FakeApiServer, extra: &[&str]) -> Agent {
        let mut args = vec!["--node-name", "node-a"];
        args.extend_from_slice(extra);
        Agent::start(
            self.dir.path(),
            profile,
            self.inject.path(),
            &args,
            Some(api.kubeconfig()),
            None,
        )
    }
}
