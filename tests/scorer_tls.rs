//! The extender over TLS, with the real binaries: `gpumem certs` makes the certificates, the scorer
//! serves its verbs only to a client presenting kube-scheduler's certificate, keeps its probes and
//! metrics on the plain port, and picks up rotated files without a restart.
#![allow(
    clippy::duplicate_mod,
    reason = "the scorer's and the agent's support code each include the shared k8s rules"
)]

mod scorer_support;
mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use scorer_support::fixture;
use serde_json::Value;
use support::agent::free_port;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

const GPUMEM: &str = env!("CARGO_BIN_EXE_gpumem");

fn certs(out: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(GPUMEM)
        .arg("certs")
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .expect("run gpumem certs")
}

fn make_certs(out: &Path, extra: &[&str]) {
    let done = certs(out, extra);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
}

struct Scorer {
    child: Child,
    log: PathBuf,
    plain: SocketAddr,
    tls: SocketAddr,
}

impl Drop for Scorer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Scorer {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// The scorer without Kubernetes, its `tls` from `scorer.crt`, `scorer.key` and `ca.crt` in `certs`.
fn start_scorer(dir: &Path, certs: &Path) -> Scorer {
    let config = dir.join("scorer.yaml");
    let file = |name: &str| certs.join(name).display().to_string();
    std::fs::write(
        &config,
        format!(
            "tls:\n  certFile: {}\n  keyFile: {}\n  clientCAFile: {}\n",
            file("scorer.crt"),
            file("scorer.key"),
            file("ca.crt")
        ),
    )
    .expect("write the config");
    let plain = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let tls = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let log = dir.join("scorer.log");
    let child = Command::new(GPUMEM)
        .args(["scorer", "--without-kube", "--listen", &plain.to_string()])
        .args(["--tls-listen", &tls.to_string()])
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("start the scorer");
    Scorer {
        child,
        log,
        plain,
        tls,
    }
}

fn pem_certs(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .expect("certificate file")
        .collect::<Result<_, _>>()
        .expect("PEM certificates")
}

/// A client trusting `ca`, presenting `identity` (a certificate and its key) if given.
fn client(ca: &Path, identity: Option<(&Path, &Path)>) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    for cert in pem_certs(ca) {
        roots.add(cert).expect("CA certificate");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots);
    Arc::new(match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(pem_certs(cert), PrivateKeyDer::from_pem_file(key).expect("key"))
            .expect("client identity"),
        None => builder.with_no_client_auth(),
    })
}

/// kube-scheduler's identity from `gpumem certs --out dir`.
fn scheduler(dir: &Path) -> Arc<ClientConfig> {
    client(
        &dir.join("ca.crt"),
        Some((&dir.join("scheduler.crt"), &dir.join("scheduler.key"))),
    )
}

/// One request on a new connection (HTTP/1.1, `Connection: close`): status and body, or `None` if
/// no answer came (the handshake or the read failed).
async fn request(
    addr: SocketAddr,
    tls: Option<(Arc<ClientConfig>, &str)>,
    method: &str,
    path: &str,
    body: &str,
) -> Option<(u16, String)> {
    let exchange = async {
        let tcp = TcpStream::connect(addr).await.ok()?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: scorer\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let mut response = Vec::new();
        match tls {
            Some((config, name)) => {
                let name = ServerName::try_from(name.to_string()).expect("server name");
                let mut stream = TlsConnector::from(config).connect(name, tcp).await.ok()?;
                stream.write_all(head.as_bytes()).await.ok()?;
                stream.read_to_end(&mut response).await.ok()?;
            }
            None => {
                let mut stream = tcp;
                stream.write_all(head.as_bytes()).await.ok()?;
                stream.read_to_end(&mut response).await.ok()?;
            }
        }
        let text = String::from_utf8(response).ok()?;
        let status = text.split(' ').nth(1)?.parse().ok()?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .ok()
        .flatten()
}

async fn wait_ready(scorer: &Scorer) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while request(scorer.plain, None, "GET", "/healthz", "")
        .await
        .map(|r| r.0)
        != Some(200)
    {
        assert!(
            Instant::now() < deadline,
            "the scorer never served: {}",
            scorer.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `POST /filter` with a Nodes-form request where only `one-big` fits the pod.
async fn filter(addr: SocketAddr, tls: Option<(Arc<ClientConfig>, &str)>) -> Option<(u16, String)> {
    request(
        addr,
        tls,
        "POST",
        "/scheduler/filter",
        &fixture("filter_nodes.json"),
    )
    .await
}

fn kept(body: &str) -> Vec<String> {
    let answer: Value = serde_json::from_str(body).expect("JSON answer");
    answer["Nodes"]["items"]
        .as_array()
        .expect("kept nodes")
        .iter()
        .filter_map(|n| n["metadata"]["name"].as_str().map(String::from))
        .collect()
}

#[tokio::test]
async fn only_a_client_with_the_schedulers_certificate_gets_the_verbs() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ours = dir.path().join("ours");
    let theirs = dir.path().join("theirs");
    make_certs(&ours, &[]);
    make_certs(&theirs, &[]);
    let scorer = start_scorer(dir.path(), &ours);
    wait_ready(&scorer).await;

    // kube-scheduler, by every name the Service gives the scorer and by loopback.
    for name in [
        "gpumem-scorer.gpumem-system.svc",
        "gpumem-scorer",
        "localhost",
        "127.0.0.1",
    ] {
        let (status, body) = filter(scorer.tls, Some((scheduler(&ours), name)))
            .await
            .unwrap_or_else(|| panic!("no answer over TLS to {name}: {}", scorer.log()));
        assert_eq!(status, 200, "{body}");
        assert_eq!(kept(&body), ["one-big"]);
    }
    let (status, _) = request(
        scorer.tls,
        Some((scheduler(&ours), "localhost")),
        "GET",
        "/healthz",
        "",
    )
    .await
    .expect("healthz over TLS");
    assert_eq!(status, 200);

    // No certificate; a certificate from another CA: refused in the handshake, before any request.
    let anonymous = client(&ours.join("ca.crt"), None);
    assert_eq!(filter(scorer.tls, Some((anonymous, "localhost"))).await, None);
    let stranger = client(
        &ours.join("ca.crt"),
        Some((&theirs.join("scheduler.crt"), &theirs.join("scheduler.key"))),
    );
    assert_eq!(filter(scorer.tls, Some((stranger, "localhost"))).await, None);
    // The scorer's own certificate is a server certificate: it cannot pass for the scheduler.
    let server_as_client = client(
        &ours.join("ca.crt"),
        Some((&ours.join("scorer.crt"), &ours.join("scorer.key"))),
    );
    assert_eq!(
        filter(scorer.tls, Some((server_as_client, "localhost"))).await,
        None
    );
    // Plain HTTP on the TLS port gets no answer either.
    assert_eq!(filter(scorer.tls, None).await, None);

    // The plain port: probes and metrics, no verbs.
    let (status, body) = filter(scorer.plain, None)
        .await
        .expect("an answer on the plain port");
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("TLS"), "{body}");
    for verb in ["prioritize", "bind", "preempt"] {
        let (status, _) = request(scorer.plain, None, "POST", &format!("/scheduler/{verb}"), "{}")
            .await
            .expect("an answer");
        assert_eq!(status, 403, "{verb}");
    }
    let (status, metrics) = request(scorer.plain, None, "GET", "/metrics", "")
        .await
        .expect("metrics");
    assert_eq!(status, 200);
    assert!(metrics.contains("# EOF"), "{metrics}");

    // The refusals are in the log, the scorer up.
    let log = scorer.log();
    assert!(log.contains("TLS handshake refused"), "{log}");
    let (status, _) = request(scorer.plain, None, "GET", "/healthz", "")
        .await
        .expect("healthz");
    assert_eq!(status, 200);
}

#[tokio::test]
async fn rotated_certificates_are_used_without_a_restart_and_broken_ones_are_not() {
    let dir = tempfile::tempdir().expect("temp dir");
    let certs_dir = dir.path().join("certs");
    let old = dir.path().join("old");
    make_certs(&certs_dir, &[]);
    std::fs::create_dir(&old).expect("mkdir");
    for file in ["ca.crt", "scheduler.crt", "scheduler.key"] {
        std::fs::copy(certs_dir.join(file), old.join(file)).expect("keep the old identity");
    }
    let scorer = start_scorer(dir.path(), &certs_dir);
    wait_ready(&scorer).await;
    assert_eq!(
        filter(scorer.tls, Some((scheduler(&old), "localhost")))
            .await
            .map(|r| r.0),
        Some(200)
    );

    // Rotation: a new CA and new certificates where the old ones were.
    make_certs(&certs_dir, &["--force"]);
    let (status, body) = filter(scorer.tls, Some((scheduler(&certs_dir), "localhost")))
        .await
        .unwrap_or_else(|| panic!("the new certificates are not served: {}", scorer.log()));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        filter(scorer.tls, Some((scheduler(&old), "localhost"))).await,
        None
    );
    assert!(scorer.log().contains("reloaded"), "{}", scorer.log());

    // A key that does not match the certificate: reported, and the last good files still serve.
    let good_key = std::fs::read(certs_dir.join("scorer.key")).expect("key");
    let other = dir.path().join("other");
    make_certs(&other, &[]);
    std::fs::copy(other.join("scorer.key"), certs_dir.join("scorer.key")).expect("break the key");
    let (status, _) = filter(scorer.tls, Some((scheduler(&certs_dir), "localhost")))
        .await
        .unwrap_or_else(|| panic!("the last good certificates stopped serving: {}", scorer.log()));
    assert_eq!(status, 200);
    assert!(scorer.log().contains("do not load"), "{}", scorer.log());
    std::fs::write(certs_dir.join("scorer.key"), good_key).expect("restore the key");
}

#[test]
fn the_scorer_refuses_to_start_on_files_that_do_not_make_a_certificate() {
    let dir = tempfile::tempdir().expect("temp dir");
    let certs_dir = dir.path().join("certs");
    let other = dir.path().join("other");
    make_certs(&certs_dir, &[]);
    make_certs(&other, &[]);
    std::fs::copy(other.join("scorer.key"), certs_dir.join("scorer.key")).expect("mismatched key");
    let mut scorer = start_scorer(dir.path(), &certs_dir);
    let status = scorer.child.wait().expect("the scorer exits");
    assert!(!status.success());
    let log = scorer.log();
    assert!(log.contains("do not make a certificate and its key"), "{log}");

    std::fs::remove_file(certs_dir.join("ca.crt")).expect("remove the CA");
    let mut scorer = start_scorer(dir.path(), &certs_dir);
    assert!(!scorer.child.wait().expect("exits").success());
    assert!(scorer.log().contains("ca.crt"), "{}", scorer.log());
}

#[test]
fn certs_keeps_keys_private_and_does_not_overwrite_without_force() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("certs");
    make_certs(&out, &["--scorer-name", "scorer.example.com", "--days", "30"]);
    for (file, mode) in [
        ("ca.crt", 0o644),
        ("scorer.crt", 0o644),
        ("scorer.key", 0o600),
        ("scheduler.crt", 0o644),
        ("scheduler.key", 0o600),
    ] {
        let meta = std::fs::metadata(out.join(file)).expect(file);
        assert_eq!(meta.permissions().mode() & 0o777, mode, "{file}");
    }
    assert!(!out.join("ca.key").exists(), "the CA's key is not kept");
    let before = std::fs::read(out.join("scheduler.key")).expect("key");

    let again = certs(&out, &[]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    assert_eq!(std::fs::read(out.join("scheduler.key")).expect("key"), before);

    for bad in [
        &["--scorer-name", "not a name"][..],
        &["--days", "0"],
        &["--namespace", "Bad_NS"],
    ] {
        let refused = certs(&dir.path().join("bad"), bad);
        assert!(!refused.status.success(), "{bad:?}");
        assert!(!dir.path().join("bad/scorer.key").exists(), "{bad:?} wrote files");
    }
}
