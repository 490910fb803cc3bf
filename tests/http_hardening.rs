//! The HTTP server of the scorer and of the agent's metrics (`gpumem::http`) against hostile clients:
//! half-sent heads, trickled bodies, more connections than its cap, and a flood past its descriptor
//! limit. Timeouts are shortened through `Limits` where a case waits for one; the floods run the
//! real binaries with their default limits.
#![allow(
    clippy::duplicate_mod,
    reason = "the scorer's and the agent's support code each include the shared k8s rules"
)]

mod scorer_support;
mod support;

use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpumem::http::Limits;
use gpumem::scorer::config::ScorerConfig;
use gpumem::scorer::{Scorer, server};
use scorer_support::{Conn, args_nodes, closed_within, g, node_json, pod_json};
use serde_json::json;
use support::agent::{Node, free_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A scorer without Kubernetes, serving on 127.0.0.1 under `limits`.
async fn scorer(limits: Limits) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("bound address");
    let scorer = Arc::new(Scorer::new(ScorerConfig::default(), None, None, None));
    tokio::spawn(server::serve(
        listener,
        scorer,
        limits,
        server::Port::Open,
        std::future::pending(),
    ));
    addr
}

/// `GET /healthz` on a new connection: the status, if one came within `wait`.
async fn healthz(addr: SocketAddr, wait: Duration) -> Option<u16> {
    let answer = async {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        let request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
        stream.write_all(request).await.ok()?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.ok()?;
        std::str::from_utf8(&response)
            .ok()?
            .split(' ')
            .nth(1)?
            .parse()
            .ok()
    };
    tokio::time::timeout(wait, answer).await.ok().flatten()
}

#[tokio::test]
async fn half_sent_heads_neither_block_healthz_nor_outlive_the_header_timeout() {
    let header_timeout = Duration::from_secs(2);
    let addr = scorer(Limits {
        header_timeout,
        ..Limits::default()
    })
    .await;
    // A head that starts after a first request on a kept-alive connection is timed the same.
    let mut kept = Conn::open(addr).await;
    assert_eq!(kept.request("GET", "/healthz", b"").await.0, 200);
    kept.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n").await;
    let mut slow = Vec::new();
    for _ in 0..50 {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(b"POST /filter HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
            .await
            .expect("half a head");
        slow.push(stream);
    }

    assert_eq!(
        healthz(addr, Duration::from_secs(1)).await,
        Some(200),
        "/healthz while 50 heads hang"
    );
    let last = slow.last_mut().expect("50 connections");
    assert!(
        !closed_within(last, Duration::from_millis(100)).await,
        "closed before its header timeout"
    );
    for (i, stream) in slow.iter_mut().enumerate() {
        assert!(
            closed_within(stream, header_timeout + Duration::from_secs(3)).await,
            "half-sent connection {i} still open well past the header timeout"
        );
    }
    assert!(
        kept.closed_within(Duration::from_secs(3)).await,
        "a second head, half sent, still open well past the header timeout"
    );
}

#[tokio::test]
async fn a_kept_alive_connection_outlives_the_header_timeout_until_the_idle_timeout() {
    let header_timeout = Duration::from_secs(1);
    let idle_timeout = Duration::from_secs(3);
    let addr = scorer(Limits {
        header_timeout,
        idle_timeout,
        ..Limits::default()
    })
    .await;
    let mut conn = Conn::open(addr).await;
    assert_eq!(conn.request("GET", "/healthz", b"").await.0, 200);
    // kube-scheduler reuses its connections: idle time between calls is not a slow head.
    tokio::time::sleep(2 * header_timeout).await;
    assert_eq!(conn.request("GET", "/healthz", b"").await.0, 200);
    let idle = Instant::now();
    assert!(
        conn.closed_within(idle_timeout + Duration::from_secs(3)).await,
        "an idle connection stays open well past the idle timeout"
    );
    assert!(
        idle.elapsed() >= idle_timeout - Duration::from_millis(500),
        "closed after {:?} idle, before the idle timeout",
        idle.elapsed()
    );
}

#[tokio::test]
async fn a_body_trickled_past_the_body_timeout_is_cut_off_with_408() {
    let addr = scorer(Limits {
        body_timeout: Duration::from_secs(1),
        ..Limits::default()
    })
    .await;
    let (mut read, mut write) = TcpStream::connect(addr).await.expect("connect").into_split();
    let head = "POST /filter HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n";
    write.write_all(head.as_bytes()).await.expect("head");
    // A byte every 100 ms, steadily: the whole body would take 100 s.
    let trickle = tokio::spawn(async move {
        while write.write_all(b" ").await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let mut response = Vec::new();
    let mut chunk = [0u8; 4096];
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        // The server closes with trickled bytes unread: a reset may follow its answer.
        while let Ok(n) = read.read(&mut chunk).await
            && n > 0
        {
            response.extend_from_slice(&chunk[..n]);
        }
    })
    .await;
    trickle.abort();
    let response = String::from_utf8_lossy(&response);
    assert!(ended.is_ok(), "still open after 5 s; got {response:?}");
    assert!(response.starts_with("HTTP/1.1 408"), "{response}");
    assert!(
        response.contains("filter body did not arrive in time"),
        "{response}"
    );
}

#[tokio::test]
async fn a_client_that_does_not_read_its_answers_is_dropped_after_the_idle_timeout() {
    let idle_timeout = Duration::from_secs(1);
    let addr = scorer(Limits {
        idle_timeout,
        ..Limits::default()
    })
    .await;
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    // Pipelined requests, answers never read: once the socket buffers are full, the server's write
    // waits on the client.
    let requests = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".repeat(200);
    while let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&requests)).await {}
    tokio::time::sleep(idle_timeout + Duration::from_secs(2)).await;
    // Reading now would let a server still at it go on answering the requests queued; one that
    // gave up has closed, and what it had sent is read at once.
    assert!(
        closed_within(&mut stream, Duration::from_secs(3)).await,
        "still writing to a client that reads nothing"
    );
}

#[tokio::test]
async fn a_body_slower_than_the_header_timeout_but_within_the_body_timeout_is_read() {
    let header_timeout = Duration::from_secs(1);
    let addr = scorer(Limits {
        header_timeout,
        body_timeout: Duration::from_secs(10),
        ..Limits::default()
    })
    .await;
    let pod = pod_json("p", 5000, 0, json!({}), json!({}));
    let body = args_nodes(&pod, &[node_json("n1", &[g(15_000, 0)])]).to_string();
    let (first, rest) = body.split_at(body.len() / 2);
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /filter HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("head");
    stream.write_all(first.as_bytes()).await.expect("first half");
    tokio::time::sleep(2 * header_timeout).await;
    stream.write_all(rest.as_bytes()).await.expect("second half");
    let mut response = String::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response)).await;
    assert!(matches!(read, Ok(Ok(_))), "{read:?}: {response:?}");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains(r#""name":"n1""#), "n1 kept: {response}");
    assert!(response.contains(r#""FailedNodes":{}"#), "{response}");
}

#[tokio::test]
async fn past_the_connection_cap_a_client_waits_for_a_free_slot() {
    let addr = scorer(Limits {
        max_connections: 2,
        ..Limits::default()
    })
    .await;
    let mut first = Conn::open(addr).await;
    let mut second = Conn::open(addr).await;
    assert_eq!(first.request("GET", "/healthz", b"").await.0, 200);
    assert_eq!(second.request("GET", "/healthz", b"").await.0, 200);

    let third = tokio::spawn(async move {
        let mut conn = Conn::open(addr).await;
        let status = conn.request("GET", "/healthz", b"").await.0;
        (status, conn)
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !third.is_finished(),
        "served a third connection with two slots taken"
    );

    drop(first);
    let (status, third) = tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("served once a slot is free")
        .expect("third client");
    assert_eq!(status, 200);
    drop(third);
    assert_eq!(healthz(addr, Duration::from_secs(5)).await, Some(200));
    assert_eq!(second.request("GET", "/healthz", b"").await.0, 200, "kept alive");
}

/// The descriptor limit of the flooded processes.
const OPEN_FILES: u64 = 64;
/// More connections than the process has descriptors for, fewer than that plus its listen backlog
/// (128), so that every connect completes.
const FLOOD: usize = 120;

/// User plus system CPU time of process `pid`, in clock ticks (USER_HZ: 100 a second on Linux).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    // Fields after the command name, which ends at the last ')': the 3rd field (state) first,
    // then utime and stime as the 14th and 15th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
}

/// Floods `addr`, served by process `pid` under [`OPEN_FILES`], past its descriptors: over 3 s it
/// must neither spin nor flood its log (read by `log`), and it must serve again once the flood ends.
async fn flood_out_of_descriptors(addr: SocketAddr, pid: u32, log: impl Fn() -> String) {
    let mut flood = Vec::new();
    for _ in 0..FLOOD {
        flood.push(TcpStream::connect(addr).await.expect("connect to the backlog"));
    }
    // Let the accept loop reach the limit.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = cpu_ticks(pid);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let used = cpu_ticks(pid) - before;
    // The figure issue 14 asked for (9.9 s of CPU in 10 s before): `--no-capture` shows it.
    eprintln!("out of descriptors: {:.2} s of CPU in 3 s", used as f64 / 100.0);
    assert!(
        used < 150,
        "{:.2} s of CPU in 3 s out of descriptors: the accept loop spins",
        used as f64 / 100.0
    );
    let text = log();
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Too many open files"))
        .collect();
    assert!(
        !errors.is_empty(),
        "never out of descriptors: the flood is too small\n{text}"
    );
    assert!(
        errors.len() <= 20,
        "{} lines about running out of descriptors, the first: {:?}",
        errors.len(),
        &errors[..3]
    );

    drop(flood);
    assert_eq!(
        healthz(addr, Duration::from_secs(10)).await,
        Some(200),
        "/healthz once the flood is gone"
    );
}

/// Waits until `/healthz` on `addr` answers 200.
async fn wait_serving(addr: SocketAddr, log: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while healthz(addr, Duration::from_secs(1)).await != Some(200) {
        assert!(Instant::now() < deadline, "not serving on {addr}:\n{}", log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A child process, killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_scorer_out_of_descriptors_neither_spins_nor_floods_its_log() {
    let dir = tempfile::tempdir().expect("temp dir");
    let stderr = dir.path().join("scorer.log");
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let scorer = support::command(env!("CARGO_BIN_EXE_gpumem"), Some(OPEN_FILES))
        .args(["scorer", "--without-kube", "--listen", &addr.to_string()])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).expect("log file"))
        .spawn()
        .map(Killed)
        .expect("start the scorer");
    let log = || std::fs::read_to_string(&stderr).unwrap_or_default();
    wait_serving(addr, log).await;
    flood_out_of_descriptors(addr, scorer.0.id(), log).await;
}

#[tokio::test]
async fn the_agent_metrics_out_of_descriptors_neither_spin_nor_flood_its_log() {
    let node = Node::new().await;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let listen = addr.to_string();
    let agent = node.agent_with_open_files(
        "t4x4",
        &["--mem-unit-mib", "1024", "--metrics-listen", &listen],
        OPEN_FILES,
    );
    let log = || agent.log();
    wait_serving(addr, log).await;
    flood_out_of_descriptors(addr, agent.child.id(), log).await;
}
