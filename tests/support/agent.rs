//! The real `gpumem agent` process for integration tests: started against the kubelet doubles
//! ([`Node`]) with the fake NVML library as its driver, and plain HTTP to its metrics server.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
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
    pub fn start(
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

impl Agent {
    /// The exit status once the agent exits by itself; None if it still runs after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
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

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET `path` from `127.0.0.1:port` over plain HTTP/1.1; the status code and the body, once the
/// server answers.
pub async fn http_response(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// [`http_response`]'s body.
pub async fn http_get(port: u16, path: &str) -> Option<String> {
    http_response(port, path).await.map(|(_, body)| body)
}
