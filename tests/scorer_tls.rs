//! The extender over TLS, with the real binaries: `gpumem certs` makes the certificates, the scorer
//! serves its verbs only to a client presenting kube-scheduler's certificate, keeps its probes and
//! metrics on the plain port, and picks up rotated files without a restart; kube-scheduler's
//! HTTP/2 (one connection for all its calls, closed once idle: in process, with a short idle limit).
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

use gpumem::http::Limits;
use gpumem::scorer::config::ScorerConfig;
use gpumem::scorer::server;
use gpumem::tls::{TlsFiles, TlsServer};
use hyper::body::Bytes;
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

/// kube-scheduler's client hello: Go's transport with apimachinery's defaults offers HTTP/2 first.
fn scheduler_offering_h2(dir: &Path) -> Arc<ClientConfig> {
    let mut config = (*scheduler(dir)).clone();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Arc::new(config)
}

/// `POST path` with `body` on an HTTP/2 connection: the status and the answer's body.
async fn h2_post(client: &h2::client::SendRequest<Bytes>, path: &str, body: &str) -> (u16, String) {
    let mut client = client.clone().ready().await.expect("a stream slot");
    let request = hyper::Request::post(format!("https://localhost{path}"))
        .header("content-type", "application/json")
        .body(())
        .expect("request");
    let (answer, mut send) = client.send_request(request, false).expect("open a stream");
    send.send_data(Bytes::from(body.to_string()), true)
        .expect("send the body");
    let answer = answer.await.expect("an answer");
    let status = answer.status().as_u16();
    let mut body = answer.into_body();
    let mut text = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.expect("body data");
        let _ = body.flow_control().release_capacity(chunk.len());
        text.extend_from_slice(&chunk);
    }
    (status, String::from_utf8(text).expect("UTF-8 answer"))
}

#[tokio::test]
async fn kube_schedulers_calls_share_one_http2_connection() {
    let dir = tempfile::tempdir().expect("temp dir");
    let certs = dir.path().join("certs");
    make_certs(&certs, &[]);
    let scorer = start_scorer(dir.path(), &certs);
    wait_ready(&scorer).await;

    let tcp = TcpStream::connect(scorer.tls).await.expect("connect");
    let name = ServerName::try_from("gpumem-scorer.gpumem-system.svc").expect("server name");
    let tls = TlsConnector::from(scheduler_offering_h2(&certs))
        .connect(name, tcp)
        .await
        .expect("handshake");
    assert_eq!(
        tls.get_ref().1.alpn_protocol(),
        Some(b"h2".as_slice()),
        "the scorer did not choose HTTP/2"
    );
    let (client, connection) = h2::client::handshake(tls).await.expect("HTTP/2 preface");
    let driver = tokio::spawn(connection);
    let body = fixture("filter_nodes.json");
    let calls: Vec<_> = (0..16)
        .map(|_| {
            let (client, body) = (client.clone(), body.clone());
            tokio::spawn(async move { h2_post(&client, "/scheduler/filter", &body).await })
        })
        .collect();
    for call in calls {
        let (status, body) = call.await.expect("the call's task");
        assert_eq!(status, 200, "{body}");
        assert_eq!(kept(&body), ["one-big"]);
    }
    assert!(!driver.is_finished(), "the connection ended: {}", scorer.log());

    // A client that offers only HTTP/1.1 is still served, and the metric tells the two apart.
    let (status, _) = filter(scorer.tls, Some((scheduler(&certs), "localhost")))
        .await
        .expect("an HTTP/1.1 answer");
    assert_eq!(status, 200);
    let (_, metrics) = request(scorer.plain, None, "GET", "/metrics", "")
        .await
        .expect("metrics");
    for line in [
        r#"gpumem_scorer_verb_requests_total{protocol="HTTP/2"} 16"#,
        r#"gpumem_scorer_verb_requests_total{protocol="HTTP/1.1"} 1"#,
    ] {
        assert!(metrics.lines().any(|l| l == line), "no `{line}` in\n{metrics}");
    }
}

/// The scorer in this process on TLS (`certs` from `gpumem certs`), under `limits`: the idle limit
/// shortened where the binary would take its 2 minutes.
async fn scorer_in_process(certs: &Path, limits: Limits) -> SocketAddr {
    scorer_in_process_with(certs, limits, None).await
}

/// [`scorer_in_process`] with a Kubernetes client (for `bind`).
async fn scorer_in_process_with(certs: &Path, limits: Limits, client: Option<kube::Client>) -> SocketAddr {
    let files = TlsFiles {
        cert_file: certs.join("scorer.crt"),
        key_file: certs.join("scorer.key"),
        client_ca_file: certs.join("ca.crt"),
    };
    let tls = Arc::new(TlsServer::new(files).expect("the TLS files"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("bound address");
    let scorer = Arc::new(gpumem::scorer::Scorer::new(
        ScorerConfig::default(),
        client,
        None,
        None,
    ));
    tokio::spawn(server::serve(
        listener,
        scorer,
        limits,
        server::Port::Tls(tls),
        std::future::pending(),
    ));
    addr
}

/// An HTTP/2 connection to the in-process scorer at `addr` as kube-scheduler opens it (`certs`).
async fn h2_connect(
    addr: SocketAddr,
    certs: &Path,
) -> (
    h2::client::SendRequest<Bytes>,
    h2::client::Connection<tokio_rustls::client::TlsStream<TcpStream>, Bytes>,
) {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::try_from("localhost").expect("server name");
    let tls = TlsConnector::from(scheduler_offering_h2(certs))
        .connect(name, tcp)
        .await
        .expect("handshake");
    h2::client::handshake(tls).await.expect("HTTP/2 preface")
}

#[tokio::test]
async fn an_http2_connection_is_kept_while_a_call_is_open_and_sent_goaway_once_idle() {
    let dir = tempfile::tempdir().expect("temp dir");
    make_certs(dir.path(), &[]);
    let idle = Duration::from_millis(500);
    let addr = scorer_in_process(
        dir.path(),
        Limits {
            idle_timeout: idle,
            ..Limits::default()
        },
    )
    .await;
    let (client, connection) = h2_connect(addr, dir.path()).await;
    let mut driver = tokio::spawn(connection);
    let (status, _) = h2_post(&client, "/scheduler/filter", &fixture("filter_nodes.json")).await;
    assert_eq!(status, 200);

    // A call whose body is still coming keeps the connection, however long past the idle limit
    // (its body has its own deadline)...
    let mut sender = client.clone().ready().await.expect("a stream slot");
    let request = hyper::Request::post("https://localhost/scheduler/filter")
        .body(())
        .expect("request");
    let (_answer, mut body) = sender.send_request(request, false).expect("open a stream");
    body.send_data(Bytes::from_static(b"{\"Pod\":"), false)
        .expect("part of a body");
    tokio::time::sleep(3 * idle).await;
    assert!(!driver.is_finished(), "closed while a call was open");

    // ...and once the client gives it up (RST_STREAM), the connection is idle: GOAWAY, closed.
    body.send_reset(h2::Reason::CANCEL);
    let started = Instant::now();
    let closed = tokio::time::timeout(idle * 6, &mut driver).await;
    assert!(
        closed.is_ok(),
        "an idle HTTP/2 connection was kept past the idle limit"
    );
    assert!(
        started.elapsed() >= idle - Duration::from_millis(100),
        "closed {:?} after the last call, before the idle limit",
        started.elapsed()
    );
}

/// kube-scheduler gives up on a bind after its extender timeout and resets the stream: the bind goes
/// on to its end, so the pod is bound (kube-scheduler's next try finds it so) and no booking is left
/// holding room for a Binding that was never made.
#[tokio::test]
async fn a_bind_kube_scheduler_gave_up_on_still_finishes() {
    use scorer_support::{FakeApi, fake_api, g, node_json, pod_json};
    let dir = tempfile::tempdir().expect("temp dir");
    make_certs(dir.path(), &[]);
    let api = Arc::new(FakeApi::default());
    api.add_node(&node_json("n", &[g(16384, 0)]));
    api.add_pod(&pod_json(
        "p1",
        5000,
        0,
        serde_json::json!({}),
        serde_json::json!({}),
    ));
    // The bind reads its pod slowly: kube-scheduler stops waiting before its Binding is sent.
    *api.pod_get_delay.lock().expect("lock") = Duration::from_millis(800);
    let client = fake_api(api.clone()).await;
    let addr = scorer_in_process_with(dir.path(), Limits::default(), Some(client)).await;
    let (client, connection) = h2_connect(addr, dir.path()).await;
    tokio::spawn(connection);
    let mut sender = client.ready().await.expect("a stream slot");
    let request = hyper::Request::post("https://localhost/scheduler/bind")
        .header("content-type", "application/json")
        .body(())
        .expect("request");
    let (_answer, mut body) = sender.send_request(request, false).expect("open a stream");
    let args = r#"{"PodName": "p1", "PodNamespace": "team-a", "PodUID": "uid-p1", "Node": "n"}"#;
    body.send_data(Bytes::from_static(args.as_bytes()), true)
        .expect("the bind's body");
    tokio::time::sleep(Duration::from_millis(300)).await;
    body.send_reset(h2::Reason::CANCEL);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let bound = api.pod("team-a/p1").is_some_and(|p| p["spec"]["nodeName"] == "n");
        if bound {
            break;
        }
        assert!(Instant::now() < deadline, "the bind was dropped with the stream");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
