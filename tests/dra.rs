//! The real `gpumem agent` on the DRA path (`--mode dra`, or its Node's `gpumem.io/mode` label): a
//! kubelet double registers it through the plugin registry and prepares claims over real unix
//! sockets, a fake API server holds its Node, its ResourceSlice (applied and watched) and the
//! claims' allocations, and the fake NVML library is its driver ("mixed": GPUs 0 and 1 V100-SXM2-32GB
//! with 32768 MiB, NVLinked; 2 and 3 Tesla T4 with 15360 MiB).

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpumem::node::{GpuMode, UsageAnnotation};
use gpumem::plugin::proto::dra::{Claim, Device, NodePrepareResourceResponse};
use serde_json::{Value, json};
use support::InjectFile;
use support::agent::{Agent, Node};
use support::apiserver::{FakeApiServer, allocated_claim, metadata_maps, share_id, unallocated_claim};
use support::dra_kubelet::{DraKubelet, DraPlugin, claim};
use support::kubelet::FakePodResources;

const NODE: &str = "node-a";
const SLICE: &str = "node-a-gpumem.io";
const WAIT: Duration = Duration::from_secs(8);
const USAGE: &str = "gpumem.io/gpu-usage";

/// A node on the DRA path: the kubelet's plugin registry, its PodResources, the API server with the
/// Node, the inject file of the fake NVML.
struct DraNode {
    api: FakeApiServer,
    kubelet: DraKubelet,
    _pods: FakePodResources,
    inject: InjectFile,
    node_uid: String,
    /// Last: the doubles must stop writing here before it is removed.
    dir: tempfile::TempDir,
}

impl DraNode {
    async fn new() -> DraNode {
        DraNode::with_labels(&[]).await
    }

    async fn with_labels(labels: &[(&str, &str)]) -> DraNode {
        let dir = tempfile::Builder::new().prefix("gpm").tempdir_in("/tmp").unwrap();
        let api = FakeApiServer::start_dra(dir.path()).await;
        let node_uid = api.set_node(NODE, labels);
        let pods = FakePodResources::start(&dir.path().join("pod-resources.sock")).await;
        let inject = InjectFile::new(dir.path().join("inject.toml"));
        let kubelet = DraKubelet::new(&dir.path().join("registry"));
        let shim = dir.path().join("libgpumem_cuda.so");
        std::fs::write(&shim, b"stand-in").unwrap();
        DraNode {
            api,
            kubelet,
            _pods: pods,
            inject,
            node_uid,
            dir,
        }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn state_dir(&self) -> PathBuf {
        self.path("state")
    }

    /// The CDI spec of a claim.
    fn spec_path(&self, uid: &str) -> PathBuf {
        self.path("cdi").join(format!("gpumem.io-claim_{uid}.json"))
    }

    /// The agent of this node with memory limits enforced; `--mode dra` unless `mode` is None (the
    /// Node's label decides, or the default).
    fn agent_in(&self, mode: Option<&str>) -> Agent {
        let path = |rel: &str| self.path(rel).display().to_string();
        let mut args: Vec<String> = vec![
            "--node-name".into(),
            NODE.into(),
            "--dra-registry-dir".into(),
            path("registry"),
            "--dra-plugin-dir".into(),
            path("dra-plugins"),
            "--cdi-dir".into(),
            path("cdi"),
            "--state-dir".into(),
            path("state"),
            "--memory-limits".into(),
            "enforce".into(),
            "--shim-path".into(),
            path("libgpumem_cuda.so"),
        ];
        if let Some(mode) = mode {
            args.extend(["--mode".into(), mode.into()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Agent::start(
            self.dir.path(),
            "mixed",
            self.inject.path(),
            &args,
            Some(self.api.kubeconfig()),
            None,
        )
    }

    /// The agent in DRA mode, registered with the kubelet double.
    async fn started(&self) -> (Agent, DraPlugin) {
        let agent = self.agent_in(Some("dra"));
        let plugin = self.register(&agent).await;
        (agent, plugin)
    }

    async fn register(&self, agent: &Agent) -> DraPlugin {
        self.kubelet
            .register(WAIT)
            .await
            .unwrap_or_else(|e| panic!("the kubelet refused the driver: {e}\n{}", agent.log()))
    }

    /// The usage annotation on the stored Node.
    fn usage(&self) -> Option<UsageAnnotation> {
        let node = self.api.node(NODE)?;
        UsageAnnotation::parse(node["metadata"]["annotations"][USAGE].as_str()?).ok()
    }

    /// Waits for the Node's usage annotation to pass `check`.
    async fn wait_usage(&self, what: &str, check: impl Fn(&UsageAnnotation) -> bool) -> UsageAnnotation {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(usage) = self.usage().filter(|u| check(u)) {
                return usage;
            }
            assert!(
                Instant::now() < deadline,
                "the Node's usage never showed {what}; it shows {:?}",
                self.usage()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for the stored ResourceSlice to pass `check`.
    async fn wait_slice(&self, what: &str, check: impl Fn(&Value) -> bool) -> Value {
        self.api
            .wait_for(what, WAIT, |api| api.slice(SLICE).filter(|s| check(s)))
            .await
    }

    /// The claims in the driver's checkpoint.
    fn checkpoint(&self) -> Value {
        let path = self.state_dir().join("dra").join("prepared.json");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let checkpoint: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(checkpoint["version"], 1, "{checkpoint}");
        checkpoint["claims"].clone()
    }

    /// The files in the CDI directory.
    fn cdi_files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.path("cdi"))
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    /// How many times the agent read ResourceClaim `namespace/name`.
    fn claim_reads(&self, namespace: &str, name: &str) -> usize {
        let path = format!("/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}");
        self.api
            .requests()
            .iter()
            .filter(|r| r.method == "GET" && r.path == path)
            .count()
    }
}

/// The UUID of each GPU of the "mixed" profile, as discovery gives it.
fn uuids() -> Vec<String> {
    let profile = gpumem_profile::Profile::load("mixed").unwrap();
    gpumem::gpu::GpuInventory::discover(&profile)
        .unwrap()
        .gpus
        .into_iter()
        .map(|g| g.uuid)
        .collect()
}

/// A memory (or, with None, whole-GPU) claim `team/<name>` of pod `pod-<name>` on one device of this
/// node, stored in the API server; the kubelet's name for it.
fn put_claim(api: &FakeApiServer, name: &str, device: &str, memory: Option<&str>) -> Claim {
    let uid = format!("uid-{name}");
    api.set_claim(allocated_claim(
        "team",
        name,
        &uid,
        &format!("pod-{name}"),
        &[(NODE, device, memory)],
    ));
    claim("team", name, &uid)
}

fn prepared_ok(answer: &NodePrepareResourceResponse) -> &[Device] {
    assert_eq!(answer.error, "", "the claim was refused: {answer:?}");
    &answer.devices
}

fn refused(answer: &NodePrepareResourceResponse) -> &str {
    assert!(
        !answer.error.is_empty() && answer.devices.is_empty(),
        "the claim should have been refused: {answer:?}"
    );
    &answer.error
}

fn spec(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

fn idle_but(usage: &UsageAnnotation, busy: &[u32]) -> bool {
    usage
        .gpus
        .iter()
        .filter(|g| !busy.contains(&g.index))
        .all(|g| g.mode == GpuMode::Free && g.allocated_mib == 0 && g.pods.is_empty())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nodes_label_picks_dra_and_the_slice_offers_every_gpus_memory() {
    // No --mode: the label on the Node chooses the DRA path.
    let node = DraNode::with_labels(&[("gpumem.io/mode", "dra")]).await;
    let agent = node.agent_in(None);
    let plugin = node.register(&agent).await;
    assert_eq!(plugin.info.r#type, "DRAPlugin");
    assert_eq!(plugin.info.name, "gpumem.io");
    assert!(
        plugin.info.supported_versions.iter().any(|v| v == "v1.DRAPlugin"),
        "{:?}",
        plugin.info.supported_versions
    );
    assert_eq!(
        PathBuf::from(&plugin.info.endpoint),
        node.path("dra-plugins/gpumem.io/dra.sock")
    );
    assert_eq!(
        plugin.registration_socket,
        node.path("registry/gpumem.io-reg.sock")
    );

    let slice = node.wait_slice("the node's ResourceSlice", |_| true).await;
    let apply = node.api.slice_applies(SLICE).remove(0);
    assert_eq!(apply.content_type, "application/apply-patch+yaml");
    assert!(
        apply.query.contains("fieldManager=gpumem-agent") && apply.query.contains("force=true"),
        "{}",
        apply.query
    );
    // Stored as the API server stores what it creates.
    let meta = &slice["metadata"];
    assert!(meta["uid"].as_str().is_some_and(|u| !u.is_empty()), "{meta}");
    assert_eq!(meta["generation"], 1);
    assert_eq!(
        meta["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node.node_uid, "controller": true}]),
        "the slice goes with its Node"
    );
    let spec = &slice["spec"];
    assert_eq!(spec["driver"], "gpumem.io");
    assert_eq!(spec["nodeName"], NODE);
    assert_eq!(
        spec["pool"],
        json!({"name": NODE, "generation": 1, "resourceSliceCount": 1})
    );
    let devices = spec["devices"].as_array().unwrap();
    let names: Vec<&str> = devices.iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);
    let uuids = uuids();
    for (i, device) in devices.iter().enumerate() {
        let (whole, product) = if i < 2 {
            ("32Gi", "Tesla V100-SXM2-32GB")
        } else {
            ("15Gi", "Tesla T4")
        };
        let memory = &device["capacity"]["memory"];
        assert_eq!(memory["value"], whole, "{device}");
        assert_eq!(
            memory["requestPolicy"],
            json!({"default": whole, "validRange": {"min": "1Mi", "step": "1Mi"}}),
            "no memory asked: the whole GPU; else whole MiB: {device}"
        );
        assert_eq!(device["allowMultipleAllocations"], true);
        let attrs = &device["attributes"];
        assert_eq!(attrs["productName"]["string"], product);
        assert_eq!(attrs["uuid"]["string"], uuids[i].as_str());
        assert_eq!(attrs["index"]["int"], i);
        let domain = attrs["nvlinkDomain"]["string"].as_str();
        assert_eq!(domain, (i < 2).then_some("nvlink-0"), "{device}");
    }
    // The Node shows every GPU free.
    let usage = node.wait_usage("four idle GPUs", |u| u.gpus.len() == 4).await;
    assert!(idle_but(&usage, &[]), "{usage:?}");
    node.api.assert_all_granted();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_claim_is_prepared_once_and_unprepared_without_a_trace() {
    let node = DraNode::new().await;
    let (_agent, plugin) = node.started().await;
    let uuid2 = uuids()[2].clone();
    let claim_a = put_claim(&node.api, "a", "gpu-2", Some("5000Mi"));

    let answer = plugin.prepare_one(&claim_a).await;
    assert_eq!(
        prepared_ok(&answer),
        [Device {
            request_names: vec!["gpu".into()],
            pool_name: NODE.into(),
            device_name: "gpu-2".into(),
            cdi_device_ids: vec!["gpumem.io/claim=uid-a-gpu-2".into()],
            share_id: Some(share_id("uid-a", "gpu-2")),
        }]
    );

    // The CDI spec: the GPU, its limit, the shim, the preload file and the claim's accounting.
    let spec_path = node.spec_path("uid-a");
    let spec = spec(&spec_path);
    assert_eq!(spec["cdiVersion"], "0.6.0");
    assert_eq!(spec["kind"], "gpumem.io/claim");
    assert_eq!(
        spec["devices"],
        json!([{"name": "uid-a-gpu-2", "containerEdits": {"env": [format!("GPUMEM_DEVICE_GPU_2={uuid2}")]}}])
    );
    assert_eq!(
        strings(&spec["containerEdits"]["env"]),
        [
            "CUDA_DEVICE_ORDER=PCI_BUS_ID".to_string(),
            "GPUMEM_ACCOUNTING_DIR=/var/run/gpumem".into(),
            "GPUMEM_LIMIT_MIB=5000".into(),
            format!("NVIDIA_VISIBLE_DEVICES={uuid2}"),
        ]
    );
    let state = node.state_dir();
    let accounting = state.join("containers").join("g2-cuid-a");
    let mount = |host: &Path, container: &str, mode: &str| {
        json!({"hostPath": host.display().to_string(), "containerPath": container, "type": "bind",
               "options": [mode, "nosuid", "nodev", "rbind"]})
    };
    assert_eq!(
        spec["containerEdits"]["mounts"],
        json!([
            mount(
                &node.path("libgpumem_cuda.so"),
                "/usr/local/gpumem/libgpumem_cuda.so",
                "ro"
            ),
            mount(&state.join("ld.so.preload"), "/etc/ld.so.preload", "ro"),
            mount(&accounting, "/var/run/gpumem", "rw"),
        ])
    );
    assert!(accounting.is_dir(), "the claim's accounting directory is made");
    assert_eq!(
        std::fs::read_to_string(state.join("ld.so.preload")).unwrap(),
        "/usr/local/gpumem/libgpumem_cuda.so\n"
    );
    assert_eq!(
        node.checkpoint(),
        json!({"uid-a": {"namespace": "team", "name": "a", "owner": "team/pod-a",
            "devices": [{"request": "gpu", "device": "gpu-2", "shareId": share_id("uid-a", "gpu-2"),
                "uuid": uuid2, "share": {"mib": 5000}}]}})
    );
    let usage = node
        .wait_usage("5000 MiB of GPU 2 for team/pod-a", |u| {
            u.gpus[2].allocated_mib == 5000
        })
        .await;
    assert_eq!(usage.gpus[2].mode, GpuMode::Shared);
    assert_eq!(usage.gpus[2].pods, ["team/pod-a"]);
    assert!(idle_but(&usage, &[2]), "{usage:?}");

    // Again (a kubelet restart): the same answer, from what was prepared, not read again.
    let written = std::fs::read(&spec_path).unwrap();
    assert_eq!(plugin.prepare_one(&claim_a).await, answer);
    assert_eq!(std::fs::read(&spec_path).unwrap(), written);
    assert_eq!(node.claim_reads("team", "a"), 1);

    assert_eq!(plugin.unprepare_one(&claim_a).await, "");
    assert!(!spec_path.exists(), "the spec goes with the claim");
    assert_eq!(node.checkpoint(), json!({}));
    node.wait_usage("GPU 2 free again", |u| idle_but(u, &[])).await;
    let deadline = Instant::now() + WAIT;
    while accounting.exists() {
        assert!(
            Instant::now() < deadline,
            "the accounting of an unprepared claim stays"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Unprepared twice, or never prepared: nothing to do, no error.
    assert_eq!(plugin.unprepare_one(&claim_a).await, "");
    assert_eq!(
        plugin.unprepare_one(&claim("team", "never", "uid-never")).await,
        ""
    );
    node.api.assert_all_granted();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_keeps_what_it_prepared_and_drops_what_lost_its_pod() {
    let node = DraNode::new().await;
    let (agent, plugin) = node.started().await;
    let claim_a = put_claim(&node.api, "a", "gpu-2", Some("5000Mi"));
    let answer = plugin.prepare_one(&claim_a).await;
    prepared_ok(&answer);
    let claim_b = put_claim(&node.api, "b", "gpu-3", Some("2Gi"));
    prepared_ok(&plugin.prepare_one(&claim_b).await);
    node.wait_usage("the claims on GPUs 2 and 3", |u| {
        u.gpus[2].allocated_mib == 5000 && u.gpus[3].allocated_mib == 2048
    })
    .await;

    // The agent dies; the runtime's CDI directory (tmpfs) is emptied; claim b's pod is deleted, and
    // with it the claim, while the agent is away (the kubelet will never unprepare it).
    // It died half-way through its next checkpoint write: what it left of that is a temporary
    // (gpumem::durable), the checkpoint itself stays whole.
    drop(agent);
    let checkpoint = node.state_dir().join("dra").join("prepared.json");
    let cut_short = gpumem::durable::temp_path(&checkpoint);
    std::fs::write(&cut_short, b"{\"version\": 1, \"claims\": {\"uid-").unwrap();
    let (spec_a, spec_b) = (node.spec_path("uid-a"), node.spec_path("uid-b"));
    std::fs::remove_file(&spec_a).unwrap();
    assert!(node.api.remove_claim("team", "b"));
    let agent = node.agent_in(Some("dra"));
    let plugin = node.register(&agent).await;

    let deadline = Instant::now() + WAIT;
    while !spec_a.exists() || spec_b.exists() {
        assert!(
            Instant::now() < deadline,
            "the restarted agent did not write claim a's CDI spec again ({}) and remove claim b's ({}):\n{}",
            spec_a.exists(),
            spec_b.exists(),
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        strings(&spec(&spec_a)["containerEdits"]["env"])[2],
        "GPUMEM_LIMIT_MIB=5000"
    );
    // The restarted agent's Node shows claim a, and no longer b.
    let usage = node
        .wait_usage("claim a alone", |u| {
            u.gpus[2].allocated_mib == 5000 && u.gpus[3].allocated_mib == 0
        })
        .await;
    assert_eq!(usage.gpus[2].pods, ["team/pod-a"]);
    assert!(idle_but(&usage, &[2]), "{usage:?}");
    let kept: Vec<String> = node.checkpoint().as_object().unwrap().keys().cloned().collect();
    assert_eq!(kept, ["uid-a"]);
    assert!(
        !cut_short.exists(),
        "the next write replaced the cut-short temporary"
    );
    // Claim a's room is taken: GPU 2 is not handed out whole.
    let whole = put_claim(&node.api, "whole", "gpu-2", None);
    let error = plugin.prepare_one(&whole).await;
    assert!(refused(&error).contains("memory shared out"), "{error:?}");
    // The kubelet prepares it again after its own restart: the same answer, not read again.
    let reads = node.claim_reads("team", "a");
    assert_eq!(plugin.prepare_one(&claim_a).await, answer);
    assert_eq!(node.claim_reads("team", "a"), reads);
    assert_eq!(plugin.unprepare_one(&claim_a).await, "");
    assert!(!spec_a.exists());
    node.wait_usage("every GPU free", |u| idle_but(u, &[])).await;
    assert_eq!(node.checkpoint(), json!({}));
    node.api.assert_all_granted();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_checkpoint_is_made_up_from_the_claims_in_use_on_this_node() {
    let node = DraNode::new().await;
    let (agent, plugin) = node.started().await;
    let claim_a = put_claim(&node.api, "a", "gpu-2", Some("5000Mi"));
    let answer = plugin.prepare_one(&claim_a).await;
    prepared_ok(&answer);
    node.wait_usage("the claim on GPU 2", |u| u.gpus[2].allocated_mib == 5000)
        .await;
    // Not to adopt: a claim of another node, and one of this node that no pod uses (any more).
    node.api.set_claim(allocated_claim(
        "team",
        "there",
        "uid-there",
        "pod-there",
        &[("node-b", "gpu-1", Some("1Gi"))],
    ));
    let mut unused = allocated_claim("team", "idle", "uid-idle", "pod-idle", &[(NODE, "gpu-1", None)]);
    unused["status"].as_object_mut().unwrap().remove("reservedFor");
    node.api.set_claim(unused);

    // The agent dies and its state directory is wiped; the runtime's CDI specs go too.
    drop(agent);
    let spec_a = node.spec_path("uid-a");
    std::fs::remove_file(node.state_dir().join("dra").join("prepared.json")).unwrap();
    std::fs::remove_file(&spec_a).unwrap();
    let agent = node.agent_in(Some("dra"));
    let plugin = node.register(&agent).await;

    let deadline = Instant::now() + WAIT;
    while !spec_a.exists() {
        assert!(
            Instant::now() < deadline,
            "the claim in use was not adopted:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(strings(&spec(&spec_a)["containerEdits"]["env"]).contains(&"GPUMEM_LIMIT_MIB=5000".to_string()));
    let usage = node
        .wait_usage("the adopted claim", |u| u.gpus[2].allocated_mib == 5000)
        .await;
    assert_eq!(usage.gpus[2].pods, ["team/pod-a"]);
    assert!(idle_but(&usage, &[2]), "{usage:?}");
    let kept: Vec<String> = node.checkpoint().as_object().unwrap().keys().cloned().collect();
    assert_eq!(kept, ["uid-a"]);
    assert_eq!(node.cdi_files(), ["gpumem.io-claim_uid-a.json"]);
    // The kubelet's prepare after the restart gets what the first one got.
    assert_eq!(plugin.prepare_one(&claim_a).await, answer);
    node.api.assert_all_granted();
}

/// A claim the agent refused (here: the whole of a GPU whose memory is shared out) stays reserved
/// for its pod, which waits; the kubelet retries. Adopting it after a restart must not let it in
/// without the checks prepare makes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_claim_is_not_adopted_past_the_checks() {
    let node = DraNode::new().await;
    let (agent, plugin) = node.started().await;
    prepared_ok(
        &plugin
            .prepare_one(&put_claim(&node.api, "share", "gpu-2", Some("5000Mi")))
            .await,
    );
    let whole = put_claim(&node.api, "whole", "gpu-2", None);
    refused(&plugin.prepare_one(&whole).await);
    drop(agent);
    let agent = node.agent_in(Some("dra"));
    let plugin = node.register(&agent).await;
    let answer = plugin.prepare_one(&whole).await;
    assert!(
        answer.error.contains("memory shared out"),
        "prepared after the restart: {answer:?}"
    );
}

/// The Node's usage annotation is what the scorer and `gpumem inspect` read, and a GPU that looks
/// emptier than before moves the room-freed label (kube-scheduler retries its waiting pods): a
/// restarted agent must not publish its GPUs free before it has restored what it prepared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agents_first_picture_of_the_node_has_its_prepared_claims() {
    let node = DraNode::new().await;
    let (agent, plugin) = node.started().await;
    prepared_ok(
        &plugin
            .prepare_one(&put_claim(&node.api, "a", "gpu-2", Some("5000Mi")))
            .await,
    );
    node.wait_usage("the claim on GPU 2", |u| u.gpus[2].allocated_mib == 5000)
        .await;
    drop(agent);
    let applied_before = node.api.node_applies(NODE).len();
    let agent = node.agent_in(Some("dra"));
    let first = node
        .api
        .wait_for("the restarted agent's first apply of the Node", WAIT, |api| {
            api.node_applies(NODE).get(applied_before).cloned()
        })
        .await;
    let (_, annotations) = metadata_maps(&first);
    let usage = UsageAnnotation::parse(&annotations[USAGE]).unwrap();
    assert_eq!(
        (usage.gpus[2].allocated_mib, usage.gpus[2].pods.clone()),
        (5000, vec!["team/pod-a".to_string()]),
        "{usage:?}\n{}",
        agent.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_takes_the_gpu_out_of_the_slice_until_it_recovers() {
    let mut node = DraNode::new().await;
    let (_agent, plugin) = node.started().await;
    node.wait_slice("four devices", |s| {
        s["spec"]["devices"].as_array().is_some_and(|d| d.len() == 4)
    })
    .await;

    node.inject.push_xid(3, 79);
    let names = |s: &Value| -> Vec<String> {
        s["spec"]["devices"]
            .as_array()
            .map(|d| {
                d.iter()
                    .map(|x| x["name"].as_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    let sick = node
        .api
        .wait_for("an apply without gpu-3", WAIT, |api| {
            api.slice_applies(SLICE)
                .into_iter()
                .map(|a| a.body)
                .find(|b| names(b).len() == 3)
        })
        .await;
    assert_eq!(names(&sick), ["gpu-0", "gpu-1", "gpu-2"]);
    assert_eq!(
        sick["spec"]["pool"]["generation"], 2,
        "a changed device list is a new generation of the pool"
    );
    // Quiet for the quiet period and answering: back in the slice, one generation on.
    let back = node
        .wait_slice("gpu-3 back", |s| s["spec"]["pool"]["generation"] == 3)
        .await;
    assert_eq!(names(&back), ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);
    assert_eq!(back["metadata"]["generation"], 3, "the spec changed twice");

    // A GPU lost from the driver stays out until it answers again, and takes no new claim.
    node.inject.set_lost(&[3]);
    let lost = node
        .wait_slice("gpu-3 out again", |s| s["spec"]["pool"]["generation"] == 4)
        .await;
    assert_eq!(names(&lost), ["gpu-0", "gpu-1", "gpu-2"]);
    let answer = plugin
        .prepare_one(&put_claim(&node.api, "late", "gpu-3", Some("1Gi")))
        .await;
    assert!(refused(&answer).contains("GPU 3 is unhealthy"), "{answer:?}");
    assert!(!node.spec_path("uid-late").exists());
    node.inject.set_lost(&[]);
    node.wait_slice("gpu-3 back again", |s| {
        s["spec"]["pool"]["generation"] == 5 && names(s).len() == 4
    })
    .await;
    prepared_ok(&plugin.prepare_one(&claim("team", "late", "uid-late")).await);
    node.api.assert_all_granted();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_deleted_or_changed_by_someone_else_is_published_again() {
    let node = DraNode::new().await;
    let (_agent, _plugin) = node.started().await;
    let first = node.wait_slice("the first slice", |_| true).await;
    // Its watch is open: what follows reaches the agent through it (the resync is minutes away).
    node.api
        .wait_for("the agent's watch of its slices", WAIT, |api| {
            (api.slice_watches() > 0).then_some(())
        })
        .await;
    let watch = node
        .api
        .requests()
        .into_iter()
        .find(|r| r.access.verb == "watch")
        .unwrap();
    assert!(
        watch.query.contains("fieldSelector=spec.nodeName%3Dnode-a"),
        "{}",
        watch.query
    );

    // The kubelet deletes its node's slices when it starts.
    assert!(node.api.delete_slice(SLICE).is_some());
    let again = node
        .wait_slice("the slice published again", |s| {
            s["metadata"]["uid"] != first["metadata"]["uid"]
        })
        .await;
    assert_eq!(again["spec"]["devices"].as_array().unwrap().len(), 4);
    assert_eq!(again["spec"]["pool"]["name"], NODE);

    // Someone edits it: it is put back.
    let mut edited = again.clone();
    edited["spec"]["devices"] = json!([again["spec"]["devices"][0]]);
    node.api.put_slice(edited);
    let restored = node
        .wait_slice("the slice restored", |s| {
            s["spec"]["devices"].as_array().is_some_and(|d| d.len() == 4)
        })
        .await;
    assert_eq!(restored["spec"], again["spec"], "as the agent published it");
    node.api.assert_all_granted();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_claims_are_refused_each_with_its_reason_and_change_nothing() {
    let node = DraNode::new().await;
    let (_agent, plugin) = node.started().await;
    let api = &node.api;
    // Deleted and made again under the same name: another UID.
    api.set_claim(allocated_claim(
        "team",
        "stale",
        "uid-new",
        "pod-stale",
        &[(NODE, "gpu-2", Some("1Gi"))],
    ));
    api.set_claim(unallocated_claim("team", "pending", "uid-pending"));
    let elsewhere = allocated_claim(
        "team",
        "elsewhere",
        "uid-elsewhere",
        "p",
        &[("node-b", "gpu-2", Some("1Gi"))],
    );
    api.set_claim(elsewhere);
    put_claim(api, "unknown", "gpu-7", Some("1Gi"));
    api.set_claim(allocated_claim(
        "team",
        "two",
        "uid-two",
        "pod-two",
        &[(NODE, "gpu-0", Some("5000Mi")), (NODE, "gpu-1", Some("5000Mi"))],
    ));
    let mut foreign = allocated_claim("team", "foreign", "uid-foreign", "p", &[(NODE, "gpu-2", None)]);
    foreign["status"]["allocation"]["devices"]["results"][0]["driver"] = json!("other.example.com");
    api.set_claim(foreign);
    put_claim(api, "garbled", "gpu-2", Some("5000MiB"));
    let good = put_claim(api, "good", "gpu-3", Some("5000Mi"));

    let cases: Vec<(Claim, &str)> = vec![
        (
            claim("team", "stale", "uid-old"),
            "ResourceClaim team/stale has UID \"uid-new\", the kubelet asked for uid-old",
        ),
        (
            claim("team", "pending", "uid-pending"),
            "ResourceClaim team/pending is not allocated",
        ),
        (
            claim("team", "elsewhere", "uid-elsewhere"),
            "device gpu-2 is in pool \"node-b\", this node's pool is \"node-a\"",
        ),
        (
            claim("team", "unknown", "uid-unknown"),
            "this node has no device \"gpu-7\"",
        ),
        (
            claim("team", "two", "uid-two"),
            "memory is served from ONE GPU per claim",
        ),
        (
            claim("team", "foreign", "uid-foreign"),
            "has no device of driver gpumem.io allocated",
        ),
        (
            claim("team", "garbled", "uid-garbled"),
            "consumed memory \"5000MiB\"",
        ),
        (
            claim("team", "missing", "uid-missing"),
            "ResourceClaim team/missing does not exist",
        ),
        (claim("Team_A", "x", "uid-ns"), "claim namespace"),
        (claim("team", "No Name", "uid-name"), "claim name"),
        (claim("team", "x", ""), "bad UID"),
    ];
    let mut claims: Vec<Claim> = cases.iter().map(|(c, _)| c.clone()).collect();
    claims.push(good.clone());
    // One call, as the kubelet makes for a pod's claims: each claim gets its own answer.
    let answers = plugin
        .prepare(&claims)
        .await
        .expect("per-claim errors are no call error");
    assert_eq!(answers.len(), claims.len(), "{answers:?}");
    for (claim, reason) in &cases {
        let answer = &answers[&claim.uid];
        assert!(
            refused(answer).contains(reason),
            "claim {}/{} ({}): {:?} does not say {reason:?}",
            claim.namespace,
            claim.name,
            claim.uid,
            answer.error
        );
    }
    assert_eq!(
        prepared_ok(&answers["uid-good"])[0].cdi_device_ids,
        ["gpumem.io/claim=uid-good-gpu-3"]
    );

    // Only the good claim left anything behind.
    assert_eq!(node.cdi_files(), ["gpumem.io-claim_uid-good.json"]);
    let checkpoint = node.checkpoint();
    let kept: Vec<&String> = checkpoint.as_object().unwrap().keys().collect();
    assert_eq!(kept, ["uid-good"]);
    let usage = node
        .wait_usage("the good claim on GPU 3", |u| u.gpus[3].allocated_mib == 5000)
        .await;
    assert!(idle_but(&usage, &[3]), "{usage:?}");
    let dirs: Vec<String> = std::fs::read_dir(node.state_dir().join("containers"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(dirs, ["g3-cuid-good"]);
    api.assert_all_granted();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_gpus_and_memory_shares_exclude_each_other() {
    let node = DraNode::new().await;
    let (_agent, plugin) = node.started().await;
    let uuids = uuids();
    let api = &node.api;

    prepared_ok(
        &plugin
            .prepare_one(&put_claim(api, "share", "gpu-2", Some("5000Mi")))
            .await,
    );
    // A whole-GPU claim (no memory named: the policy's default) on the shared GPU is refused.
    let whole2 = put_claim(api, "whole2", "gpu-2", None);
    let answer = plugin.prepare_one(&whole2).await;
    assert!(
        refused(&answer).contains("GPU 2 is in use (memory shared out); it cannot be prepared whole"),
        "{answer:?}"
    );
    assert!(!node.spec_path("uid-whole2").exists());
    // The rest of GPU 2 fits exactly; then nothing is left.
    prepared_ok(
        &plugin
            .prepare_one(&put_claim(api, "rest", "gpu-2", Some("10360Mi")))
            .await,
    );
    let answer = plugin
        .prepare_one(&put_claim(api, "more", "gpu-2", Some("1Mi")))
        .await;
    assert!(refused(&answer).contains("GPU 2 has 0 MiB free"), "{answer:?}");

    // GPUs 0 and 1 whole in one claim, next to a device of another driver (not ours to prepare):
    // both GPUs visible, no limit, no shim; then their memory is not shared.
    let mut pair = allocated_claim(
        "team",
        "pair",
        "uid-pair",
        "pod-pair",
        &[(NODE, "gpu-0", None), (NODE, "gpu-1", None)],
    );
    let results = pair["status"]["allocation"]["devices"]["results"]
        .as_array_mut()
        .unwrap();
    results.insert(
        0,
        json!({"request": "nic", "driver": "nic.example.com", "pool": NODE, "device": "eth1"}),
    );
    api.set_claim(pair);
    let answer = plugin.prepare_one(&claim("team", "pair", "uid-pair")).await;
    let devices: Vec<(&str, &[String])> = prepared_ok(&answer)
        .iter()
        .map(|d| (d.device_name.as_str(), &d.cdi_device_ids[..]))
        .collect();
    assert_eq!(
        devices,
        [
            ("gpu-0", &["gpumem.io/claim=uid-pair-gpu-0".to_string()][..]),
            ("gpu-1", &["gpumem.io/claim=uid-pair-gpu-1".to_string()][..]),
        ]
    );
    let pair_spec = spec(&node.spec_path("uid-pair"));
    assert_eq!(
        strings(&pair_spec["containerEdits"]["env"]),
        [format!("NVIDIA_VISIBLE_DEVICES={},{}", uuids[0], uuids[1])]
    );
    assert!(pair_spec["containerEdits"]["mounts"].is_null(), "{pair_spec}");
    let cdi_names: Vec<&str> = pair_spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(cdi_names, ["uid-pair-gpu-0", "uid-pair-gpu-1"]);
    let answer = plugin
        .prepare_one(&put_claim(api, "share0", "gpu-0", Some("1Gi")))
        .await;
    assert!(
        refused(&answer).contains("GPU 0 is held whole; its memory cannot be shared"),
        "{answer:?}"
    );
    // All of a GPU's memory, named: the whole GPU.
    prepared_ok(
        &plugin
            .prepare_one(&put_claim(api, "all3", "gpu-3", Some("15Gi")))
            .await,
    );
    let env = strings(&spec(&node.spec_path("uid-all3"))["containerEdits"]["env"]);
    assert_eq!(env, [format!("NVIDIA_VISIBLE_DEVICES={}", uuids[3])]);

    let usage = node
        .wait_usage("GPUs 0, 1 and 3 whole, GPU 2 full", |u| {
            [0, 1, 3].iter().all(|&g| u.gpus[g].mode == GpuMode::Whole) && u.gpus[2].allocated_mib == 15360
        })
        .await;
    assert_eq!(usage.gpus[2].pods, ["team/pod-rest", "team/pod-share"]);
    assert_eq!(usage.gpus[0].pods, ["team/pod-pair"]);
    assert_eq!(usage.gpus[1].pods, ["team/pod-pair"]);
    assert_eq!(usage.gpus[3].pods, ["team/pod-all3"]);
    api.assert_all_granted();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_requests_of_one_claim_on_one_gpu_hold_the_sum() {
    let node = DraNode::new().await;
    let (_agent, plugin) = node.started().await;
    let uuid3 = uuids()[3].clone();
    let mut duo = allocated_claim(
        "team",
        "duo",
        "uid-duo",
        "pod-duo",
        &[(NODE, "gpu-3", Some("2000Mi")), (NODE, "gpu-3", Some("3000Mi"))],
    );
    let results = duo["status"]["allocation"]["devices"]["results"]
        .as_array_mut()
        .unwrap();
    results[0]["request"] = json!("model");
    results[0]["shareID"] = json!(share_id("uid-duo", "model"));
    // A request with alternatives names the one chosen: `<request>/<subrequest>`.
    results[1]["request"] = json!("cache/small");
    results[1]["shareID"] = json!(share_id("uid-duo", "cache"));
    node.api.set_claim(duo);
    let answer = plugin.prepare_one(&claim("team", "duo", "uid-duo")).await;
    // One answer per allocation result, both the same CDI device.
    let devices = prepared_ok(&answer);
    let cdi = vec!["gpumem.io/claim=uid-duo-gpu-3".to_string()];
    assert_eq!(
        devices,
        [
            Device {
                request_names: vec!["model".into()],
                pool_name: NODE.into(),
                device_name: "gpu-3".into(),
                cdi_device_ids: cdi.clone(),
                share_id: Some(share_id("uid-duo", "model")),
            },
            Device {
                request_names: vec!["cache".into()],
                pool_name: NODE.into(),
                device_name: "gpu-3".into(),
                cdi_device_ids: cdi,
                share_id: Some(share_id("uid-duo", "cache")),
            },
        ]
    );
    let duo_spec = spec(&node.spec_path("uid-duo"));
    assert_eq!(duo_spec["devices"].as_array().unwrap().len(), 1, "{duo_spec}");
    let env = strings(&duo_spec["containerEdits"]["env"]);
    assert!(env.contains(&"GPUMEM_LIMIT_MIB=5000".to_string()), "{env:?}");
    assert!(
        env.contains(&format!("NVIDIA_VISIBLE_DEVICES={uuid3}")),
        "{env:?}"
    );
    let usage = node
        .wait_usage("5000 MiB of GPU 3", |u| u.gpus[3].allocated_mib == 5000)
        .await;
    assert_eq!(usage.gpus[3].pods, ["team/pod-duo"]);
    // What is left of GPU 3 is 10360 MiB.
    let answer = plugin
        .prepare_one(&put_claim(&node.api, "big", "gpu-3", Some("10361Mi")))
        .await;
    assert!(
        refused(&answer).contains("GPU 3 has 10360 MiB free"),
        "{answer:?}"
    );
    node.api.assert_all_granted();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_plugin_node_removes_the_slice_the_dra_path_left() {
    // --mode dra, but the Node's label says device-plugin; a slice of this node is left over.
    let node = Node::new().await;
    let api = FakeApiServer::start(node.dir.path()).await;
    api.set_node(NODE, &[("gpumem.io/mode", "device-plugin")]);
    api.put_slice(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": SLICE},
        "spec": {"driver": "gpumem.io", "nodeName": NODE,
                 "pool": {"name": NODE, "generation": 4, "resourceSliceCount": 1}, "devices": []},
    }));
    let registry = node.dir.path().join("registry");
    let _agent = node.agent_with_api(
        "mixed",
        &api,
        &["--mode", "dra", "--dra-registry-dir", registry.to_str().unwrap()],
    );
    node.kubelet.wait_registered("nvidia.com/gpu", WAIT).await;
    api.wait_for("the slice deleted", WAIT, |api| {
        api.slice(SLICE).is_none().then_some(())
    })
    .await;
    assert!(
        !registry.join("gpumem.io-reg.sock").exists(),
        "no DRA driver on a device-plugin node"
    );
    // The device-plugin path needs nothing of the DRA role.
    api.assert_all_granted();
}

/// Least privilege: an agent on the DRA path, and one on the device-plugin path that warns on its
/// Node and looks up the scorer's choice, use every grant of the agent's two roles, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_roles_grant_exactly_what_both_paths_use() {
    let dra = DraNode::new().await;
    let (_agent, plugin) = dra.started().await;
    prepared_ok(
        &plugin
            .prepare_one(&put_claim(&dra.api, "a", "gpu-1", Some("1Gi")))
            .await,
    );
    dra.wait_slice("the slice", |_| true).await;

    // The other agent: a Node label it does not know (a warning), the device plugins, a pod asking
    // for memory (the scorer's choice is looked up), a slice to remove.
    let other = Node::new().await;
    dra.api.set_node("node-b", &[("gpumem.io/mode", "sideways")]);
    let _other = Agent::start(
        other.dir.path(),
        "mixed",
        other.inject.path(),
        &["--node-name", "node-b", "--mem-unit-mib", "1024"],
        Some(dra.api.kubeconfig()),
        None,
    );
    other.kubelet.wait_registered("nvidia.com/gpu-mem", WAIT).await;
    let all: Vec<String> = (0..2).map(|n| format!("2-{n}")).collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    other
        .kubelet
        .preferred("nvidia.com/gpu-mem", &all, &[], 1)
        .await
        .unwrap();
    dra.api
        .wait_for("the warning about the label", WAIT, |api| {
            api.events().into_iter().find(|e| e["reason"] == "BadModeLabel")
        })
        .await;
    dra.api
        .wait_for("the other node's slice removal", WAIT, |api| {
            api.requests()
                .into_iter()
                .find(|r| r.method == "DELETE" && r.path.ends_with("/resourceslices/node-b-gpumem.io"))
        })
        .await;
    // Everything asked was granted, and every grant was used: least privilege for both paths.
    dra.api.assert_role_is_exactly_what_was_used();
}
