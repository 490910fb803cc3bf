//! The real `gpumem agent` where it used to limp on: a taken metrics port, resource names or a memory
//! unit the cluster cannot use, a profile NVML cannot encode, an NVML error in the XID watch, and
//! `/healthz`, which says whether the agent's own loops are alive without asking NVML.

mod support;

use std::time::{Duration, Instant};

use support::agent::{Agent, Node, free_port, http_response};

const GPU: &str = "nvidia.com/gpu";
const MEM: &str = "nvidia.com/gpu-mem";
const WAIT: Duration = Duration::from_secs(20);

/// The agent's exit status once it gave up by itself, and its log.
fn exit_of(mut agent: Agent) -> (std::process::ExitStatus, String) {
    let status = agent
        .wait_exit(WAIT)
        .unwrap_or_else(|| panic!("the agent kept running:\n{}", agent.log()));
    (status, agent.log())
}

/// The one `error:` line the agent ends with.
fn error_line(log: &str) -> &str {
    log.lines()
        .rev()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line:\n{log}"))
}

/// Waits until the agent's log has `text` (`count` times).
async fn wait_log(agent: &Agent, text: &str, count: usize) {
    let deadline = Instant::now() + WAIT;
    while agent.log().matches(text).count() < count {
        assert!(
            Instant::now() < deadline,
            "{text:?} not logged {count} times:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn healthz(port: u16) -> (u16, String) {
    tokio::time::timeout(Duration::from_secs(10), http_response(port, "/healthz"))
        .await
        .expect("/healthz answers")
        .expect("/healthz is HTTP")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_metrics_port_stops_the_agent_with_one_clear_line() {
    let node = Node::new().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (status, log) = exit_of(node.agent("t4x4", &["--metrics-listen", &addr]));
    assert!(!status.success(), "{log}");
    let line = error_line(&log);
    assert!(line.contains(&addr) && line.contains("in use"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_names_the_api_server_refuses_stop_the_agent_and_a_good_one_registers() {
    for (key, name, why) in [
        ("mem", "example.com/gpu mem", "no spaces"),
        ("mem", "kubernetes.io/gpu-mem", "kubernetes.io"),
        ("gpu", "gpu.kubernetes.io/gpu", "kubernetes.io"),
        ("mem", "gpu-mem", "needs a domain"),
        ("mem", "requests.example.com/mem", "\"requests.\""),
        ("mem", "Example.com/mem", "not a DNS subdomain"),
        ("gpu", "example.com/gpu/0", "more than one '/'"),
    ] {
        let node = Node::new().await;
        let config = node.dir.path().join("agent.yaml");
        let quoted = serde_json::to_string(name).unwrap();
        std::fs::write(&config, format!("resourceNames:\n  {key}: {quoted}\n")).unwrap();
        let config = config.to_string_lossy().into_owned();
        let (status, log) = exit_of(node.agent("t4x4", &["--config", &config]));
        assert!(!status.success(), "{name}: {log}");
        let line = error_line(&log);
        assert!(
            line.contains(&format!("resourceNames.{key}: {quoted}")) && line.contains(why),
            "{name}: {line}"
        );
        assert!(node.kubelet.rejected().is_empty(), "{name} reached the kubelet");
    }

    let node = Node::new().await;
    let config = node.dir.path().join("agent.yaml");
    std::fs::write(&config, "resourceNames:\n  mem: example.com/vram_1.5\n").unwrap();
    let config = config.to_string_lossy().into_owned();
    let _agent = node.agent("t4x4", &["--config", &config, "--mem-unit-mib", "1024"]);
    node.kubelet.wait_registered("example.com/vram_1.5", WAIT).await;
    assert!(node.kubelet.rejected().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mem_unit_larger_than_every_gpu_is_refused_and_gpus_below_one_unit_are_named() {
    let node = Node::new().await;
    let (status, log) = exit_of(node.agent("t4x4", &["--mem-unit-mib", "15361"]));
    assert!(!status.success(), "{log}");
    let line = error_line(&log);
    assert!(
        line.contains("memUnitMiB 15361 is larger than every GPU") && line.contains("at most 15360"),
        "{line}"
    );
    assert!(node.kubelet.registrations(MEM).is_empty());

    // Two V100s of 32 GiB and two T4s of 15 GiB: the T4s offer no 20000 MiB unit, and say so.
    let node = Node::new().await;
    let agent = node.agent("mixed", &["--mem-unit-mib", "20000"]);
    node.kubelet.wait_registered(MEM, WAIT).await;
    let units = node.kubelet.wait_devices(MEM, WAIT, |d| !d.is_empty()).await;
    let ids: Vec<&str> = units.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["0-0", "1-0"]);
    let log = agent.log();
    for gpu in ["GPU 2 (Tesla T4, 15360 MiB)", "GPU 3 (Tesla T4, 15360 MiB)"] {
        let line = log
            .lines()
            .find(|l| l.contains(gpu))
            .unwrap_or_else(|| panic!("{gpu} not named:\n{log}"));
        assert!(
            line.contains("WARN") && line.contains("smaller than memUnitMiB 20000"),
            "{line}"
        );
    }
    assert!(!log.contains("GPU 0 ("), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_whose_cuda_version_overflows_is_a_clear_error() {
    let node = Node::new().await;
    let profile = node.dir.path().join("huge-cuda.toml");
    std::fs::write(
        &profile,
        "name = 'huge-cuda'\ndriver_version = '550.90.07'\ncuda_version = '4294968.0'\n\
         [[gpus]]\nproduct = 'Tesla T4'\nmemory_mib = 15360\ncompute_capability = '7.5'\n",
    )
    .unwrap();
    let profile = profile.to_string_lossy().into_owned();
    let (status, log) = exit_of(node.agent("t4x4", &["--profile", &profile]));
    assert!(!status.success(), "{log}");
    let line = error_line(&log);
    assert!(
        line.contains("cuda_version \"4294968.0\" is out of range"),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_xid_watch_survives_an_nvml_error_and_still_marks_a_gpu_unhealthy() {
    let mut node = Node::new().await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let agent = node.agent("t4x4", &["--mem-unit-mib", "1024", "--metrics-listen", &listen]);
    let gpus = node.kubelet.wait_devices(GPU, WAIT, |d| d.len() == 4).await;

    node.inject.set_event_wait_error(Some(999));
    wait_log(&agent, "XID watch: NVML failed", 1).await;
    // Failing for a moment is within the watch's limit: still alive.
    let (status, body) = healthz(port).await;
    assert_eq!(status, 200, "{body}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    node.inject.set_event_wait_error(None);
    wait_log(&agent, "XID watch: running again", 1).await;
    // Several failed tries, one line: the first failure is logged, the rest at most once a minute.
    assert_eq!(
        agent.log().matches("XID watch: NVML").count(),
        1,
        "{}",
        agent.log()
    );

    node.inject.push_xid(1, 48);
    let listed = node
        .kubelet
        .wait_devices(GPU, WAIT, |d| d.iter().any(|x| x.health == "Unhealthy"))
        .await;
    let unhealthy: Vec<&str> = listed
        .iter()
        .filter(|d| d.health == "Unhealthy")
        .map(|d| d.id.as_str())
        .collect();
    assert_eq!(unhealthy, [gpus[1].id.as_str()]);
    let (status, body) = healthz(port).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("XID watch: alive"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_without_nvml_while_a_gpu_hangs() {
    let mut node = Node::new().await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let _agent = node.agent("t4x4", &["--mem-unit-mib", "1024", "--metrics-listen", &listen]);
    node.kubelet.wait_registered(GPU, WAIT).await;
    node.kubelet.wait_registered(MEM, WAIT).await;
    let (status, body) = healthz(port).await;
    assert_eq!(status, 200, "{body}");
    for l in [
        "registration nvidia.com/gpu: alive",
        "registration nvidia.com/gpu-mem: alive",
        "ListAndWatch nvidia.com/gpu: alive",
        "ListAndWatch nvidia.com/gpu-mem: alive",
        "XID watch: alive",
    ] {
        assert!(body.lines().any(|line| line.starts_with(l)), "{l}: {body}");
    }

    // GPU 0 hangs: a scrape, which asks NVML, gets no answer; /healthz still does.
    node.inject.set_hung(&[0]);
    let scrape = tokio::time::timeout(Duration::from_secs(3), http_response(port, "/metrics")).await;
    assert!(
        scrape.is_err(),
        "the hung GPU did not hold up /metrics: {scrape:?}"
    );
    let (status, body) = healthz(port).await;
    assert_eq!(status, 200, "{body}");
    node.inject.set_hung(&[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_is_503_naming_the_loops_that_stopped_making_progress() {
    let mut node = Node::new().await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let agent = node.agent("t4x4", &["--mem-unit-mib", "1024", "--metrics-listen", &listen]);
    node.kubelet.wait_registered(GPU, WAIT).await;
    node.kubelet.wait_registered(MEM, WAIT).await;
    assert_eq!(healthz(port).await.0, 200);

    // The kubelet goes and does not come back, so neither plugin can register; and NVML fails
    // every wait for XID events.
    node.inject.set_event_wait_error(Some(999));
    drop(node.kubelet);
    // The loops' limits are 20.5 s (registration) and 30 s (XID watch).
    let deadline = Instant::now() + Duration::from_secs(90);
    let body = loop {
        let (status, body) = healthz(port).await;
        let head = body.lines().next().unwrap_or_default().to_string();
        if status == 503 && head.contains("XID watch") {
            break body;
        }
        assert!(status == 200 || head.starts_with("stale: "), "{status}: {body}");
        assert!(Instant::now() < deadline, "never stale:\n{body}\n{}", agent.log());
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(
        body.starts_with("stale: XID watch, registration nvidia.com/gpu, registration nvidia.com/gpu-mem\n"),
        "{body}"
    );
    assert!(
        body.contains("registration nvidia.com/gpu: no progress for"),
        "{body}"
    );
    assert!(
        !body.contains("ListAndWatch"),
        "the kubelet's streams ended with it: {body}"
    );
    // Half a minute of failures, still one line.
    assert_eq!(
        agent.log().matches("XID watch: NVML").count(),
        1,
        "{}",
        agent.log()
    );
}
