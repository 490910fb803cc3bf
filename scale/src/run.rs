//! `gpumem-scale run`: the scale nodes, the played agent, and the phases (steady, burst, fill), with
//! latencies and the processes' CPU and memory.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Args, ValueEnum};
use futures_util::StreamExt as _;
use gpumem::gpu::GpuInventory;
use gpumem::node::ASSIGNED_GPUS_ANNOTATION;
use gpumem::sim::realistic::{apportion, node_profiles, parse_profiles};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client};
use serde::Serialize;

use crate::k8s::{self, Allocator, PHASE_LABEL, RUN_LABEL};
use crate::mix::{self, Mix, Model, Shape};
use crate::played::{NodeBook, NodeModel, Outcome};
use crate::procs::{PhaseMeter, ProcessUse, Watched};
use crate::stats::{self, Latency};
use crate::trace::{self, Kind, Sampler, Size};

mod faults;
pub use faults::FaultArgs;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// kube-scheduler with the gpumem extender (the scorer binds).
    Extender,
    /// kube-scheduler alone.
    Alone,
    /// kube-scheduler alone on the same pods without their GPU asks (the same selectors, taints, CPU
    /// and memory): the pods/s this machine's control plane binds, the ceiling every GPU path is
    /// measured against. No fill or saturation phase (nothing fills up).
    Ceiling,
    /// The DRA path (Kubernetes 1.34+): ResourceSlices, pods with claims, kube-scheduler's own
    /// allocator (first fit).
    DraAlone,
    /// The DRA path with gpumem's placement: the scorer allocates the claims of gated pods.
    DraGpumem,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Extender => "extender",
            Mode::Alone => "alone",
            Mode::Ceiling => "ceiling",
            Mode::DraAlone => "dra-alone",
            Mode::DraGpumem => "dra-gpumem",
        }
    }

    /// Whether the nodes serve their GPUs through DRA.
    pub fn dra(self) -> bool {
        matches!(self, Mode::DraAlone | Mode::DraGpumem)
    }

    /// Whether the pods ask for GPUs at all.
    pub fn gpu_asks(self) -> bool {
        self != Mode::Ceiling
    }
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Which setup the cluster runs (set up by scripts/scale.sh); it only labels the results.
    #[arg(long, value_enum)]
    pub mode: Mode,
    /// API-only GPU nodes to create (scale-node-0001 ...).
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Node profiles and their share in percent.
    #[arg(long, default_value = gpumem::sim::realistic::DEFAULT_PROFILES)]
    pub profiles: String,
    /// The openb pod list whose GPU pods' sizes are sampled.
    #[arg(long, default_value = "../shared/traces/openb/openb_pod_list_default.csv")]
    pub trace: PathBuf,
    /// Seed of the pod order, the profiles' placement, and the realistic mix's draws.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The pod/node mix: the trace's sizes alone, or with zones, taints and selectors (docs/scale.md).
    #[arg(long, value_enum, default_value_t = Mix::Trace)]
    pub mix: Mix,
    /// Steady phase: pods created per second.
    #[arg(long, default_value_t = 100.0)]
    pub rate: f64,
    /// Steady phase: seconds of creation.
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,
    /// Burst phase: pods created as fast as the API server takes them (0: no burst phase).
    #[arg(long, default_value_t = 3000)]
    pub burst: u64,
    /// Creates in flight in the burst and fill phases.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Fill phase: this many pods of --fill-mib MiB each, left bound at the end (0: none).
    #[arg(long, default_value_t = 0)]
    pub fill: u64,
    #[arg(long, default_value_t = 1000)]
    pub fill_mib: u64,
    /// Saturation phase: trace pods offered, past the first that finds no room, until their GPU demand
    /// reaches this percentage of the cluster's GPU memory (a whole GPU counted at the mean GPU's
    /// memory, as `gpumem simulate` counts arrived workload); then the memory left unallocated and the
    /// share of each class of pods placed are measured (0: no such phase).
    #[arg(long, default_value_t = 0)]
    pub saturate: u64,
    /// Saturation phase: at most this many pods offered.
    #[arg(long, default_value_t = 200_000)]
    pub saturate_max: u64,
    /// A phase ends when every pod is bound or this many seconds pass with no new binding.
    #[arg(long, default_value_t = 20.0)]
    pub stall: f64,
    /// Results directory (summary.json, pods.csv).
    #[arg(long)]
    pub out: PathBuf,
    /// The kit's state directory: run/<component>.pid name the processes measured.
    #[arg(long, env = "K8S_STATE", default_value = "/tmp/gpumem-k8s")]
    pub k8s_state: PathBuf,
    /// The scorer's PID (extender mode), to measure it.
    #[arg(long)]
    pub scorer_pid: Option<u32>,
    #[arg(long, default_value = "gpumem-scale")]
    pub namespace: String,
    #[command(flatten)]
    pub faults: FaultArgs,
}

/// One pod's record.
#[derive(Debug, Clone)]
struct Rec {
    phase: usize,
    size: Size,
    /// What the mix added to it (zone, model, tolerations).
    shape: Shape,
    t0: Instant,
    t1: Option<Instant>,
    node: Option<String>,
    misfit: bool,
    followed: bool,
    error: Option<String>,
    gone: bool,
    /// Bound after its phase ended (while its phase's pods were being deleted): not in the phase's results.
    late: bool,
    /// The fault phase: why the pod failed (phase Failed, or the kubelet's admission refused it), and when
    /// that was seen.
    failed: Option<(String, Instant)>,
    /// kube-scheduler's latest reason for not placing it (the PodScheduled condition's message).
    unschedulable: Option<String>,
    /// The fault phase: how long it lives once bound (then it is deleted); `None` = until the end.
    lifetime: Option<Duration>,
    /// The fault phase's Deployment owns it.
    owned: bool,
}

#[derive(Default)]
struct Counters {
    created: AtomicU64,
    errors: AtomicU64,
    bound: AtomicU64,
    misfits: AtomicU64,
    gone: AtomicU64,
}

const PHASES: [&str; 5] = ["steady", "burst", "fill", "saturate", "faults"];
/// The fault phase's index in [`PHASES`].
const FAULTS: usize = 4;

struct World {
    run: String,
    namespace: String,
    pods: Mutex<HashMap<String, Rec>>,
    counters: [Counters; 5],
    last_bind: Mutex<Option<Instant>>,
    books: Mutex<HashMap<String, NodeBook>>,
    /// Nodes whose usage changed since the last write, and whether room grew.
    dirty: Mutex<HashMap<String, bool>>,
    /// The room-freed label each node carries (the agent keeps writing it).
    room: Mutex<HashMap<String, u128>>,
    published: AtomicU64,
    publish_errors: AtomicU64,
    current: Mutex<Option<usize>>,
    /// Phases whose results are taken.
    closed: [AtomicBool; 5],
    /// Nodes with a real kubelet and agent that the fault phase's pods may also land on.
    real_nodes: Vec<String>,
    /// The schedulers the fault phase's pods name, in turn.
    schedulers: Vec<String>,
    /// Nodes that went silent (the fault phase's lost node): no Lease renewal, no status, no usage.
    silenced: Arc<Mutex<HashSet<String>>>,
    /// The nodes serve DRA: there is no agent to play (the claims carry the allocation).
    dra: bool,
    /// The pods ask for GPUs (not in the ceiling mode: no agent to play either).
    gpu_asks: bool,
    /// The mix, and the seed its pod shapes are drawn from.
    mix: Mix,
    seed: u64,
    meter: Mutex<Option<PhaseMeter>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn unix_millis() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

impl World {
    fn new(
        run: String,
        namespace: String,
        books: HashMap<String, NodeBook>,
        real_nodes: Vec<String>,
        schedulers: Vec<String>,
        dra: bool,
    ) -> World {
        World {
            run,
            namespace,
            pods: Mutex::new(HashMap::new()),
            counters: Default::default(),
            last_bind: Mutex::new(None),
            books: Mutex::new(books),
            dirty: Mutex::new(HashMap::new()),
            room: Mutex::new(HashMap::new()),
            published: AtomicU64::new(0),
            publish_errors: AtomicU64::new(0),
            current: Mutex::new(None),
            closed: Default::default(),
            real_nodes,
            schedulers,
            silenced: Arc::new(Mutex::new(HashSet::new())),
            dra,
            gpu_asks: true,
            mix: Mix::Trace,
            seed: 0,
            meter: Mutex::new(None),
        }
    }

    /// The mix the run's pods are shaped by, drawn from `seed`.
    fn with_mix(mut self, mix: Mix, seed: u64) -> World {
        self.mix = mix;
        self.seed = seed;
        self
    }

    /// Pods without their GPU asks ([`Mode::Ceiling`]).
    fn without_gpu_asks(mut self) -> World {
        self.gpu_asks = false;
        self
    }

    /// A watch event about one of the run's pods.
    fn on_pod(&self, pod: &Pod, deleted: bool) {
        let Some(name) = pod.metadata.name.as_deref() else {
            return;
        };
        let key = format!("{}/{name}", self.namespace);
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        let mut pods = lock(&self.pods);
        if !pods.contains_key(name)
            && let Some(size) = k8s::owned_pod_size(pod)
        {
            // One of the fault phase's Deployment pods, seen for the first time.
            let mut rec = Rec::new(FAULTS, size, None);
            rec.owned = true;
            pods.insert(name.to_string(), rec);
        }
        let Some(rec) = pods.get_mut(name) else {
            return;
        };
        let counters = &self.counters[rec.phase];
        let status = pod.status.as_ref();
        rec.unschedulable = status
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| {
                c.iter()
                    .find(|c| c.type_ == "PodScheduled" && c.status == "False")
            })
            .map(|c| c.message.clone().unwrap_or_default());
        if rec.failed.is_none()
            && let Some(why) = k8s::failure(pod)
        {
            tracing::warn!(pod = %key, why = %why, "pod failed");
            rec.failed = Some((why, Instant::now()));
        }
        if rec.t1.is_none()
            && let Some(node) = node
        {
            let now = Instant::now();
            rec.t1 = Some(now);
            rec.late = self.closed[rec.phase].load(Ordering::Relaxed);
            counters.bound.fetch_add(1, Ordering::Relaxed);
            *lock(&self.last_bind) = Some(now);
            let assigned = pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ASSIGNED_GPUS_ANNOTATION))
                .map(String::as_str);
            let mut books = lock(&self.books);
            if let Some(book) = books.get_mut(&node).filter(|_| !self.dra && self.gpu_asks) {
                let outcome = book.bind(&key, rec.size, assigned);
                if matches!(outcome, Outcome::Misfit | Outcome::Placed { followed: false, .. }) {
                    let held = serde_json::to_string(&book.usage()).unwrap_or_default();
                    tracing::warn!(pod = %key, node = %node, ?assigned, %held, "the scorer's GPUs are not free in the agent's book");
                }
                match outcome {
                    Outcome::Placed { followed, .. } => {
                        rec.followed = followed;
                        lock(&self.dirty).entry(node.clone()).or_insert(false);
                    }
                    Outcome::Misfit => {
                        rec.misfit = true;
                        counters.misfits.fetch_add(1, Ordering::Relaxed);
                    }
                    Outcome::Known => {}
                }
            }
            rec.node = Some(node);
        }
        if deleted {
            self.forget(name, rec);
        }
    }

    /// A pod that is gone: its GPUs go back to its node's book.
    fn forget(&self, name: &str, rec: &mut Rec) {
        if rec.gone {
            return;
        }
        rec.gone = true;
        self.counters[rec.phase].gone.fetch_add(1, Ordering::Relaxed);
        let key = format!("{}/{name}", self.namespace);
        if let Some(node) = &rec.node
            && lock(&self.books).get_mut(node).is_some_and(|b| b.release(&key))
        {
            lock(&self.dirty).insert(node.clone(), true);
        }
    }

    /// The end of a relist (a watch that expired, as after an API server restart): a pod bound before it
    /// and not in it was deleted meanwhile, and no Delete event will say so.
    fn on_relisted(&self, listed: &HashSet<String>) {
        let mut pods = lock(&self.pods);
        for (name, rec) in pods.iter_mut() {
            if rec.node.is_some() && !listed.contains(name) {
                self.forget(name, rec);
            }
        }
    }

    /// A pod the API server no longer has (a delete answered 404).
    fn forget_named(&self, name: &str) {
        if let Some(rec) = lock(&self.pods).get_mut(name) {
            self.forget(name, rec);
        }
    }
}

/// The played agent's writes: each second, one apply per node whose usage changed.
async fn publish(world: Arc<World>, client: Client) {
    let nodes: Api<Node> = Api::all(client);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let batch: Vec<(String, bool)> = lock(&world.dirty).drain().collect();
        let writes: Vec<_> = batch
            .into_iter()
            .filter_map(|(name, grew)| {
                let room = {
                    let mut room = lock(&world.room);
                    if grew {
                        room.insert(name.clone(), unix_millis());
                    }
                    room.get(&name).copied()
                };
                if lock(&world.silenced).contains(&name) {
                    return None; // a lost node's agent writes nothing
                }
                let books = lock(&world.books);
                let book = books.get(&name)?;
                let usage = book.usage();
                let (labels, annotations) =
                    k8s::agent_metadata(&book.model, &book.model.topology, &usage, room);
                Some((name, labels, annotations))
            })
            .collect();
        let world = &world;
        let nodes = &nodes;
        futures_util::stream::iter(writes)
            .for_each_concurrent(16, |(name, labels, annotations)| async move {
                match k8s::apply_agent_metadata(nodes, &name, &labels, &annotations).await {
                    Ok(()) => {
                        world.published.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(err) => {
                        world.publish_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(node = %name, error = %err, "cannot publish the usage; retrying");
                        lock(&world.dirty).entry(name).or_insert(false);
                    }
                }
            })
            .await;
    }
}

/// Follows the run's pods until the process ends.
async fn watch_pods(world: Arc<World>, client: Client, synced: tokio::sync::oneshot::Sender<()>) {
    let pods: Api<Pod> = Api::namespaced(client, &world.namespace);
    let config = watcher::Config::default().labels(&format!("{RUN_LABEL}={}", world.run));
    let mut stream = std::pin::pin!(watcher(pods, config));
    let mut synced = Some(synced);
    let mut listed = HashSet::new();
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Apply(p)) => world.on_pod(&p, false),
            Ok(watcher::Event::InitApply(p)) => {
                listed.extend(p.metadata.name.clone());
                world.on_pod(&p, false);
            }
            Ok(watcher::Event::Delete(p)) => world.on_pod(&p, true),
            Ok(watcher::Event::InitDone) => {
                world.on_relisted(&std::mem::take(&mut listed));
                if let Some(s) = synced.take() {
                    let _ = s.send(());
                }
            }
            Ok(watcher::Event::Init) => listed.clear(),
            Err(err) => {
                tracing::warn!(error = %err, "pod watch failed; it restarts");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// One line on stderr every few seconds.
async fn progress(world: Arc<World>, started: Instant) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    for n in 0u64.. {
        tick.tick().await;
        if let Some(m) = lock(&world.meter).as_mut() {
            m.poll();
        }
        let Some(p) = *lock(&world.current) else {
            continue;
        };
        if !n.is_multiple_of(3) {
            continue;
        }
        let c = &world.counters[p];
        let (created, bound) = (c.created.load(Ordering::Relaxed), c.bound.load(Ordering::Relaxed));
        eprintln!(
            "[{:>6.1}s] {}: created {created}, bound {bound}, pending {}, misfits {}, create errors {}, gone {}, usage writes {}",
            started.elapsed().as_secs_f64(),
            PHASES[p],
            created.saturating_sub(bound),
            c.misfits.load(Ordering::Relaxed),
            c.errors.load(Ordering::Relaxed),
            c.gone.load(Ordering::Relaxed),
            world.published.load(Ordering::Relaxed),
        );
    }
}

impl Rec {
    fn new(phase: usize, size: Size, lifetime: Option<Duration>) -> Self {
        Rec {
            phase,
            size,
            shape: Shape::default(),
            t0: Instant::now(),
            t1: None,
            node: None,
            misfit: false,
            followed: false,
            error: None,
            gone: false,
            late: false,
            failed: None,
            unschedulable: None,
            lifetime,
            owned: false,
        }
    }
}

/// Creates one pod; t0 is taken just before the request goes out. In the fault phase it may also
/// land on the real nodes, and it is deleted `lifetime` after it is bound.
async fn create_one(
    world: &World,
    pods: &Api<Pod>,
    phase: usize,
    name: String,
    size: Size,
    lifetime: Option<Duration>,
) {
    // The fault phase's pods may land on the real nodes too: the mix is not theirs.
    let shape = if phase == FAULTS {
        Shape::default()
    } else {
        Shape::of(world.mix, world.seed, &name, size)
    };
    let built = if world.dra {
        k8s::claim_pod(&name, &world.run, PHASES[phase], size, shape)
    } else if phase == FAULTS {
        // Pods name the schedulers in turn, by the number in their name.
        let n: usize = name.rsplit('-').next().and_then(|d| d.parse().ok()).unwrap_or(0);
        let scheduler = world
            .schedulers
            .get(n % world.schedulers.len().max(1))
            .map(String::as_str);
        k8s::fault_pod(
            &name,
            &world.run,
            PHASES[phase],
            size,
            &world.real_nodes,
            scheduler,
        )
    } else if world.gpu_asks {
        k8s::pod(&name, &world.run, PHASES[phase], size, shape)
    } else {
        k8s::pod(&name, &world.run, PHASES[phase], size, shape).map(k8s::without_gpu_asks)
    };
    let object = match built {
        Ok(o) => o,
        Err(err) => {
            tracing::error!(error = %err, "cannot build a pod");
            return;
        }
    };
    let mut rec = Rec::new(phase, size, lifetime);
    rec.shape = shape;
    lock(&world.pods).insert(name.clone(), rec);
    let counters = &world.counters[phase];
    if world.dra {
        let claims: Api<ResourceClaim> = Api::namespaced(pods.clone().into_client(), &world.namespace);
        let made = match k8s::claim(&name, &world.run, PHASES[phase], size, shape) {
            Ok(claim) => claims
                .create(&PostParams::default(), &claim)
                .await
                .map(drop)
                .map_err(|e| e.to_string()),
            Err(e) => Err(format!("{e:#}")),
        };
        if let Err(err) = made {
            counters.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(claim = %name, error = %err, "claim create failed");
            if let Some(r) = lock(&world.pods).get_mut(&name) {
                r.error = Some(err);
            }
            return;
        }
    }
    match pods.create(&PostParams::default(), &object).await {
        Ok(_) => {
            counters.created.fetch_add(1, Ordering::Relaxed);
        }
        Err(err) => {
            counters.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(pod = %name, error = %err, "create failed");
            if let Some(r) = lock(&world.pods).get_mut(&name) {
                r.error = Some(err.to_string());
            }
        }
    }
}

/// Waits until every created pod of the phase is bound, or `stall` passes with no new binding;
/// returns when the phase's activity ended (its last binding, or the end of creation).
async fn wait_bound(world: &World, phase: usize, created_at: Instant, stall: Duration) -> Instant {
    let c = &world.counters[phase];
    loop {
        let last = lock(&world.last_bind).map_or(created_at, |b| b.max(created_at));
        if c.bound.load(Ordering::Relaxed) >= c.created.load(Ordering::Relaxed) {
            return last;
        }
        if last.elapsed() >= stall {
            tracing::warn!(
                phase = PHASES[phase],
                "no binding for {stall:?}: the phase ends with pods pending"
            );
            return last;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Deletes a phase's pods (grace period 0: no kubelet will confirm) and waits until the watch has
/// seen every one go and the played agent has released them.
async fn delete_phase(world: &World, pods: &Api<Pod>, phase: usize) -> anyhow::Result<f64> {
    let started = Instant::now();
    let selector = format!("{RUN_LABEL}={},{PHASE_LABEL}={}", world.run, PHASES[phase]);
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    if let Err(err) = pods
        .delete_collection(&params, &ListParams::default().labels(&selector))
        .await
    {
        tracing::warn!(error = %err, "delete collection failed; deleting one by one");
        let names: Vec<String> = lock(&world.pods)
            .iter()
            .filter(|(_, r)| r.phase == phase && !r.gone)
            .map(|(n, _)| n.clone())
            .collect();
        futures_util::stream::iter(names)
            .for_each_concurrent(32, |n| {
                let params = params.clone();
                async move {
                    if let Err(err) = pods.delete(&n, &params).await {
                        tracing::debug!(pod = %n, error = %err, "delete failed");
                    }
                }
            })
            .await;
    }
    let c = &world.counters[phase];
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let left = k8s::count_pods(pods, &selector).await?;
        if left == 0 && c.gone.load(Ordering::Relaxed) >= c.created.load(Ordering::Relaxed) {
            break;
        }
        if Instant::now() > deadline {
            bail!("{left} pods of phase {} still there after 300 s", PHASES[phase]);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if world.dra {
        k8s::delete_claims(
            &pods.clone().into_client(),
            &world.namespace,
            &selector,
            Duration::from_secs(600),
        )
        .await?;
    }
    // The played agent's last writes go out before the next phase starts.
    while !lock(&world.dirty).is_empty() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(started.elapsed().as_secs_f64())
}

#[derive(Serialize, Debug)]
pub struct PhaseSummary {
    pub phase: String,
    pub pods: usize,
    pub created: u64,
    pub create_errors: u64,
    pub placed: usize,
    pub fraction_placed: f64,
    pub unplaced: usize,
    pub misfits: usize,
    /// Of the placed pods.
    pub misfit_fraction: f64,
    /// Pods whose GPUs the played agent took from the scorer's choice.
    pub followed_scorer: usize,
    pub pods_by_kind: BTreeMap<String, usize>,
    /// Offered pace of creation (pods/s over the creation time).
    pub created_per_s: Option<f64>,
    /// Bindings per second between the first create and the last binding.
    pub pods_per_s: Option<f64>,
    pub wall_s: f64,
    pub latency: Option<Latency>,
    pub latency_by_kind: BTreeMap<String, Latency>,
    /// Bindings in each second since the phase's first create.
    pub bound_per_second: Vec<u64>,
    pub processes: Vec<ProcessUse>,
    pub nodes_ready_at_end: usize,
    /// The realistic mix: what the phase's pods asked beyond their size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shapes: Option<ShapeCounts>,
    /// The DRA path: who allocated the claims of the phase's bound pods.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placed_by_gpumem: Option<PlacedBy>,
}

/// How many of a phase's pods asked each thing the realistic mix adds.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct ShapeCounts {
    /// A zone by node selector.
    pub zone_selector: usize,
    /// A GPU model, by kind (`t4`, `40gi+`).
    pub model: BTreeMap<String, usize>,
    /// The reserved nodes' taint tolerated (the multi-GPU pods).
    pub tolerate_reserved: usize,
}

/// Who allocated the claims of a phase's bound pods (their `managedFields`).
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct PlacedBy {
    /// The phase's bound pods (bound before it ended).
    pub bound: usize,
    /// Of those, claims allocated by gpumem's placer.
    pub gpumem: usize,
    /// Claims allocated by kube-scheduler.
    pub kube_scheduler: usize,
    /// Claims allocated by neither, or not found.
    pub neither: usize,
    /// `gpumem` / `bound`.
    pub fraction: f64,
}

/// [`PlacedBy`] of `phase`'s bound pods, each claim named after its pod.
fn placed_by(world: &World, phase: usize, allocators: &HashMap<String, Allocator>) -> PlacedBy {
    let pods = lock(&world.pods);
    let (mut bound, mut gpumem, mut kube_scheduler) = (0, 0, 0);
    for (name, _) in pods
        .iter()
        .filter(|(_, r)| r.phase == phase && r.t1.is_some() && !r.late)
    {
        bound += 1;
        match allocators.get(name) {
            Some(Allocator::Gpumem) => gpumem += 1,
            Some(Allocator::KubeScheduler) => kube_scheduler += 1,
            Some(Allocator::Neither) | None => {}
        }
    }
    PlacedBy {
        bound,
        gpumem,
        kube_scheduler,
        neither: bound - gpumem - kube_scheduler,
        fraction: if bound == 0 {
            0.0
        } else {
            gpumem as f64 / bound as f64
        },
    }
}

/// The saturation phase: trace pods offered until their demand reached `--saturate` % of the GPU memory.
#[derive(Serialize, Debug)]
pub struct Saturation {
    pub offered: u64,
    /// The GPU demand offered, % of the cluster's GPU memory ([`Arrival`]).
    pub arrived_pct: f64,
    /// GPU memory held by the placed pods (the played agent's books; on the DRA path, the claims'
    /// consumed capacity), MiB.
    pub allocated_mib: u64,
    pub total_mib: u64,
    /// The simulator's metric on the real system: the share of all GPU memory left unallocated.
    pub unallocated_pct: f64,
    /// Per class of pods ([`classes`]): how many were offered and placed, the simulator's per-class
    /// success rate (a policy that starves one class to pack another shows here).
    pub placed: BTreeMap<String, Placed>,
    /// The pods waiting unplaced at the end, by what they ask ([`waiting_kind`]): which demand ran
    /// out of room first (a model one selector asks for fills before the cluster does).
    pub waiting: BTreeMap<String, u64>,
}

/// Pods of one class offered in the saturation phase, and how many of them were placed.
#[derive(Serialize, Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    pub offered: u64,
    pub placed: u64,
}

impl Placed {
    pub fn pct(self) -> f64 {
        100.0 * self.placed as f64 / self.offered.max(1) as f64
    }
}

/// The saturation phase's arrived workload: GPU demand against the cluster's GPU memory, a whole GPU
/// counted at the mean GPU's memory (as `gpumem simulate` counts it).
#[derive(Debug, Clone, Copy)]
struct Arrival {
    total_mib: u64,
    mean_gpu_mib: u64,
    target_mib: u64,
}

impl Arrival {
    fn new(total_mib: u64, gpus: u64, pct: u64) -> Arrival {
        Arrival {
            total_mib,
            mean_gpu_mib: total_mib / gpus.max(1),
            target_mib: total_mib.saturating_mul(pct) / 100,
        }
    }

    fn demand_mib(&self, size: Size) -> u64 {
        match size {
            Size::Share { mib } => mib,
            Size::Whole { count } => u64::from(count) * self.mean_gpu_mib,
        }
    }

    fn reached(&self, arrived_mib: u64) -> bool {
        arrived_mib >= self.target_mib
    }

    fn pct(&self, arrived_mib: u64) -> f64 {
        100.0 * arrived_mib as f64 / self.total_mib.max(1) as f64
    }
}

/// The classes a saturation pod counts in: all, restricted or not (it selects a GPU model), its kind,
/// and the model it selects.
fn classes(r: &Rec) -> Vec<String> {
    let mut out = vec![
        "all".to_string(),
        if r.shape.model.is_some() {
            "restricted"
        } else {
            "unrestricted"
        }
        .to_string(),
        r.size.kind().as_str().to_string(),
    ];
    if r.shape.model.is_some() {
        out.push(waiting_kind(r));
    }
    out
}

/// What a waiting pod asks, for [`Saturation::waiting`]: its kind, and the model it selects.
fn waiting_kind(r: &Rec) -> String {
    match r.shape.model {
        Some(m) => format!("{} {}", r.size.kind().as_str(), m.as_str()),
        None => r.size.kind().as_str().to_string(),
    }
}

/// The realistic mix's nodes.
#[derive(Serialize, Debug)]
pub struct MixNodes {
    pub by_zone: BTreeMap<String, usize>,
    /// Nodes with the reserved taint.
    pub reserved: usize,
}

#[derive(Serialize, Debug)]
pub struct Summary {
    pub mode: Mode,
    pub mix: Mix,
    pub nodes: usize,
    pub node_profiles: BTreeMap<String, usize>,
    /// The realistic mix: zones and reserved nodes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mix_nodes: Option<MixNodes>,
    pub trace: String,
    pub trace_gpu_pods: usize,
    pub trace_cpu_only_pods_left_out: usize,
    pub mapping: String,
    pub seed: u64,
    pub rate: f64,
    pub duration_s: f64,
    pub burst: u64,
    pub concurrency: usize,
    pub fill: u64,
    pub fill_mib: u64,
    /// What the saturation phase left unallocated.
    pub saturation: Option<Saturation>,
    pub setup_s: f64,
    pub phases: Vec<PhaseSummary>,
    pub deletes_s: BTreeMap<String, f64>,
    pub usage_writes: u64,
    pub usage_write_errors: u64,
    pub nodes_ready: Vec<(f64, usize)>,
    pub lease_renewal_failures: u64,
    /// Times a scale node was found not Ready and its status posted again (as its kubelet would).
    pub node_status_reposted: u64,
    /// The fault phase: one row per fault.
    pub faults: Vec<faults::FaultRow>,
}

fn summarize(
    world: &World,
    phase: usize,
    wall: f64,
    creation: Option<Duration>,
    processes: Vec<ProcessUse>,
    nodes_ready: usize,
) -> PhaseSummary {
    let pods = lock(&world.pods);
    let recs: Vec<&Rec> = pods.values().filter(|r| r.phase == phase).collect();
    let c = &world.counters[phase];
    let placed: Vec<&Rec> = recs
        .iter()
        .copied()
        .filter(|r| r.t1.is_some() && !r.late)
        .collect();
    let latency_ms = |r: &Rec| r.t1.map(|t1| (t1 - r.t0).as_secs_f64() * 1000.0);
    let all: Vec<f64> = placed.iter().filter_map(|r| latency_ms(r)).collect();
    let mut by_kind = BTreeMap::new();
    let mut counts = BTreeMap::new();
    for kind in Kind::ALL {
        let n = recs.iter().filter(|r| r.size.kind() == kind).count();
        if n > 0 {
            counts.insert(kind.as_str().to_string(), n);
        }
        let l: Vec<f64> = placed
            .iter()
            .filter(|r| r.size.kind() == kind)
            .filter_map(|r| latency_ms(r))
            .collect();
        if let Some(l) = Latency::of(&l) {
            by_kind.insert(kind.as_str().to_string(), l);
        }
    }
    let first = recs.iter().map(|r| r.t0).min();
    let last = placed.iter().filter_map(|r| r.t1).max();
    let pods_per_s = match (first, last) {
        (Some(f), Some(l)) => stats::throughput(placed.len(), l - f),
        _ => None,
    };
    let offsets: Vec<f64> = match first {
        Some(f) => placed
            .iter()
            .filter_map(|r| r.t1)
            .map(|t| (t - f).as_secs_f64())
            .collect(),
        None => Vec::new(),
    };
    let misfits = recs.iter().filter(|r| r.misfit).count();
    let created = c.created.load(Ordering::Relaxed);
    let shapes = (world.mix == Mix::Realistic).then(|| ShapeCounts {
        zone_selector: recs.iter().filter(|r| r.shape.zone.is_some()).count(),
        model: Model::ALL
            .into_iter()
            .map(|m| {
                let n = recs.iter().filter(|r| r.shape.model == Some(m)).count();
                (m.as_str().to_string(), n)
            })
            .collect(),
        tolerate_reserved: recs.iter().filter(|r| r.shape.tolerate_reserved).count(),
    });
    PhaseSummary {
        phase: PHASES[phase].to_string(),
        pods: recs.len(),
        created,
        create_errors: c.errors.load(Ordering::Relaxed),
        placed: placed.len(),
        // Of the pods whose create was sent: a create that failed (a timeout) may still have
        // made the pod, which then counts as placed.
        fraction_placed: if recs.is_empty() {
            0.0
        } else {
            placed.len() as f64 / recs.len() as f64
        },
        unplaced: recs.len() - placed.len(),
        misfits,
        misfit_fraction: if placed.is_empty() {
            0.0
        } else {
            misfits as f64 / placed.len() as f64
        },
        followed_scorer: placed.iter().filter(|r| r.followed).count(),
        pods_by_kind: counts,
        created_per_s: creation.and_then(|d| stats::throughput(created as usize, d)),
        pods_per_s,
        wall_s: wall,
        latency: Latency::of(&all),
        latency_by_kind: by_kind,
        bound_per_second: stats::per_second(&offsets),
        processes,
        nodes_ready_at_end: nodes_ready,
        shapes,
        placed_by_gpumem: None,
    }
}

fn watched(args: &RunArgs) -> Vec<Watched> {
    let mut out = Vec::new();
    for name in [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
    ] {
        let file = args.k8s_state.join("run").join(format!("{name}.pid"));
        match crate::procs::pid_from_file(&file) {
            Ok(pid) => out.push(Watched {
                name: name.into(),
                pid,
            }),
            Err(err) => tracing::warn!(error = %err, "{name} is not measured"),
        }
    }
    if let Some(pid) = args.scorer_pid {
        out.push(Watched {
            name: "gpumem-scorer".into(),
            pid,
        });
    }
    out.push(Watched {
        name: "gpumem-scale".into(),
        pid: std::process::id(),
    });
    out
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    if args.rate <= 0.0 || args.duration < 0.0 || args.concurrency == 0 {
        bail!("--rate must be > 0, --duration >= 0, --concurrency > 0");
    }
    let started = Instant::now();
    let trace_pods = trace::read(&args.trace)?;
    let mix = parse_profiles(&args.profiles)?;
    let counts = apportion(&mix, args.nodes);
    let mut models = Vec::new();
    for (name, _) in &mix {
        let profile = gpumem_profile::Profile::load(name).with_context(|| format!("profile {name}"))?;
        let inventory = GpuInventory::discover(&profile).with_context(|| format!("profile {name}"))?;
        models.push(Arc::new(NodeModel::new(name, inventory)));
    }
    // Profiles spread over the node names in a seeded order (as `simulate --mix realistic` does).
    let assignment = node_profiles(&mix, args.nodes, args.seed);
    let names: Vec<String> = (1..=args.nodes).map(k8s::node_name).collect();
    let shapes = mix::node_shapes(args.mix, args.nodes, args.seed);
    if args.mix == Mix::Realistic {
        if !args.faults.faults.is_empty() {
            bail!(
                "--mix realistic is for the steady, burst, fill and saturation phases, not the fault phase"
            );
        }
        let offered: Vec<&NodeModel> = models
            .iter()
            .zip(&counts)
            .filter(|(_, n)| **n > 0)
            .map(|(m, _)| m.as_ref())
            .collect();
        let missing = mix::unservable(&offered, args.mode.dra());
        if !missing.is_empty() {
            bail!(
                "--mix realistic: pods choosing {:?} could never bind: no node of --profiles {:?} serves them",
                missing.iter().map(|m| m.as_str()).collect::<Vec<_>>(),
                args.profiles
            );
        }
    }

    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let client = Client::try_default()
        .await
        .context("no Kubernetes client configuration (KUBECONFIG)")?;
    k8s::ensure_namespace(&client, &args.namespace).await?;

    let run_id = format!("{}-{}", args.mode.as_str(), unix_millis() / 1000);
    let books = names
        .iter()
        .zip(&assignment)
        .map(|(n, &m)| (n.clone(), NodeBook::new(models[m].clone())))
        .collect();
    let mut world = World::new(
        run_id,
        args.namespace.clone(),
        books,
        args.faults.real_nodes.clone(),
        args.faults.fault_schedulers.clone(),
        args.mode.dra(),
    )
    .with_mix(args.mix, args.seed);
    if !args.mode.gpu_asks() {
        world = world.without_gpu_asks();
    }
    let world = Arc::new(world);

    tracing::info!(nodes = args.nodes, ?counts, "creating the scale nodes");
    let pairs: Vec<(String, Arc<NodeModel>, mix::NodeShape)> = names
        .iter()
        .zip(&assignment)
        .zip(&shapes)
        .map(|((n, &m), &shape)| (n.clone(), models[m].clone(), shape))
        .collect();
    let created = AtomicU64::new(0);
    let dra = args.mode.dra();
    k8s::for_each_limited(pairs, 16, |(name, model, shape)| {
        let client = client.clone();
        let created = &created;
        async move {
            k8s::create_node(&client, &name, &model, shape, dra).await?;
            let n = created.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_multiple_of(100) {
                eprintln!("[{:>6.1}s] nodes created: {n}", started.elapsed().as_secs_f64());
            }
            Ok(())
        }
    })
    .await?;
    let all_names = Arc::new(names.clone());
    let lease_client = Client::try_default()
        .await
        .context("no Kubernetes client configuration (KUBECONFIG)")?;
    let lease_failures = Arc::new(AtomicU64::new(0));
    tokio::spawn(k8s::renew_leases(
        lease_client.clone(),
        all_names,
        world.silenced.clone(),
        lease_failures.clone(),
    ));
    let by_name: HashMap<String, Arc<NodeModel>> = names
        .iter()
        .zip(&assignment)
        .map(|(n, &m)| (n.clone(), models[m].clone()))
        .collect();
    let reposted = Arc::new(AtomicU64::new(0));
    tokio::spawn(k8s::repair_status(
        lease_client,
        Arc::new(by_name.clone()),
        dra,
        Duration::from_secs(10),
        world.silenced.clone(),
        reposted.clone(),
    ));
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let ready = k8s::ready_nodes(&client).await?;
        if ready >= args.nodes {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "only {ready} of {} scale nodes Ready (and untainted) after 300 s",
                args.nodes
            );
        }
        eprintln!(
            "[{:>6.1}s] scale nodes Ready and untainted: {ready}",
            started.elapsed().as_secs_f64()
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let extra = k8s::all_node_names(&client).await?.len();
    if extra != args.nodes {
        bail!(
            "{extra} nodes carry {}=true, expected {}: clean the cluster first",
            k8s::SCALE_KEY,
            args.nodes
        );
    }
    tokio::spawn(publish(world.clone(), client.clone()));
    let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(watch_pods(world.clone(), client.clone(), synced_tx));
    synced_rx.await.context("the pod watch ended before it synced")?;
    tokio::spawn(progress(world.clone(), started));
    let setup_s = started.elapsed().as_secs_f64();
    eprintln!("[{setup_s:>6.1}s] {} nodes Ready; phases start", args.nodes);
    // Let kube-scheduler's and the scorer's caches take in the last node updates.
    tokio::time::sleep(Duration::from_secs(5)).await;

    let pods: Api<Pod> = Api::namespaced(client.clone(), &args.namespace);
    let watched = watched(&args);
    let mut sampler = Sampler::new(trace_pods.sizes.clone(), args.seed);
    let mut phases = Phases {
        world: &world,
        client: &client,
        watched: &watched,
        stall: Duration::from_secs_f64(args.stall),
        started,
        done: Vec::new(),
        ready_log: Vec::new(),
    };
    let mut deletes = BTreeMap::new();

    // a. steady
    {
        let t = phases.begin(0);
        let n = stats::pod_count(args.rate, args.duration);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..n {
            tokio::time::sleep_until((t + stats::due(i, args.rate)).into()).await;
            let (world, pods, size) = (world.clone(), pods.clone(), sampler.next_size());
            tasks.spawn(
                async move { create_one(&world, &pods, 0, format!("steady-{i:06}"), size, None).await },
            );
        }
        while tasks.join_next().await.is_some() {}
        phases.close(0, t, Duration::ZERO).await?;
        deletes.insert("steady".to_string(), delete_phase(&world, &pods, 0).await?);
    }
    // c. burst
    if args.burst > 0 {
        let t = phases.begin(1);
        let sizes: Vec<Size> = (0..args.burst).map(|_| sampler.next_size()).collect();
        create_all(&world, &pods, 1, "burst", sizes, args.concurrency).await;
        phases.close(1, t, Duration::ZERO).await?;
        deletes.insert("burst".to_string(), delete_phase(&world, &pods, 1).await?);
    }
    // Nothing fills up without GPU asks.
    if !args.mode.gpu_asks() && (args.fill > 0 || args.saturate > 0) {
        eprintln!("no fill or saturation phase in the {} mode", args.mode.as_str());
    }
    // e. fill: left bound
    if args.fill > 0 && args.mode.gpu_asks() {
        let t = phases.begin(2);
        let sizes = vec![Size::Share { mib: args.fill_mib }; args.fill as usize];
        create_all(&world, &pods, 2, "fill", sizes, args.concurrency).await;
        // The played agent's last writes reach the scorer before its memory is read.
        phases.close(2, t, Duration::from_secs(3)).await?;
    }
    // g. saturate: offered until they stop fitting; what is left unallocated then.
    let saturation = if args.saturate > 0 && args.mode.gpu_asks() {
        if args.fill > 0 {
            deletes.insert("fill".to_string(), delete_phase(&world, &pods, 2).await?);
        }
        let t = phases.begin(3);
        let c = &world.counters[3];
        let total_mib: u64 = by_name.values().map(|m| m.total_mib()).sum();
        let gpus: u64 = by_name.values().map(|m| m.inventory.gpus.len() as u64).sum();
        let arrival = Arrival::new(total_mib, gpus, args.saturate);
        let (mut offered, mut arrived_mib) = (0u64, 0u64);
        let stall = Duration::from_secs_f64(args.stall);
        // In rounds: offer a batch, let the scheduler place what it can (until no binding for the
        // stall time), and go on past the pods that wait: what a policy strands is measured with the
        // same demand offered to every policy, not at its first failure.
        while !arrival.reached(arrived_mib) && offered < args.saturate_max {
            let mut sizes = Vec::new();
            while sizes.len() < args.concurrency * 8
                && !arrival.reached(arrived_mib)
                && offered + (sizes.len() as u64) < args.saturate_max
            {
                let size = sampler.next_size();
                arrived_mib += arrival.demand_mib(size);
                sizes.push(size);
            }
            let batch = sizes.len() as u64;
            create_all(
                &world,
                &pods,
                3,
                &format!("saturate-{offered:06}"),
                sizes,
                args.concurrency,
            )
            .await;
            offered += batch;
            wait_bound(&world, 3, Instant::now(), stall).await;
            let created = c.created.load(Ordering::Relaxed);
            let waiting = created - c.bound.load(Ordering::Relaxed).min(created);
            eprintln!(
                "[{:>6.1}s] saturate: {offered} offered ({:.1} % of the GPU memory arrived), {waiting} wait unplaced",
                started.elapsed().as_secs_f64(),
                arrival.pct(arrived_mib),
            );
        }
        phases.close(3, t, Duration::from_secs(3)).await?;
        let allocated_mib = if dra {
            k8s::claimed_mib(&client, &args.namespace, |node, index| {
                by_name
                    .get(node)
                    .and_then(|m| m.inventory.gpus.iter().find(|g| g.index == index))
                    .map_or(0, |g| g.memory_mib)
            })
            .await?
        } else {
            lock(&world.books)
                .values()
                .map(|b| b.usage().gpus.iter().map(|g| g.allocated_mib).sum::<u64>())
                .sum()
        };
        let (mut waiting, mut placed) = (BTreeMap::new(), BTreeMap::new());
        for r in lock(&world.pods).values() {
            if r.phase != 3 || r.gone {
                continue;
            }
            if r.t1.is_none() {
                *waiting.entry(waiting_kind(r)).or_insert(0) += 1;
            }
            for class in classes(r) {
                let p: &mut Placed = placed.entry(class).or_default();
                p.offered += 1;
                p.placed += u64::from(r.t1.is_some());
            }
        }
        Some(Saturation {
            offered,
            arrived_pct: arrival.pct(arrived_mib),
            allocated_mib,
            total_mib,
            unallocated_pct: 100.0 * (1.0 - allocated_mib as f64 / total_mib.max(1) as f64),
            placed,
            waiting,
        })
    } else {
        None
    };
    // h. faults: pods keep coming while faults are injected.
    let fault_rows = if args.faults.faults.is_empty() {
        Vec::new()
    } else {
        let t = phases.begin(FAULTS);
        let total_mib: u64 = by_name.values().map(|m| m.total_mib()).sum();
        let rows = faults::run_faults(
            &world,
            &client,
            sampler,
            &args.faults,
            total_mib,
            &args.out.join("faults.log"),
        )
        .await?;
        phases.close(FAULTS, t, Duration::ZERO).await?;
        rows
    };
    let Phases {
        done: phases,
        ready_log,
        ..
    } = phases;
    *lock(&world.current) = None;

    let node_profiles = mix
        .iter()
        .zip(&counts)
        .map(|((n, _), &c)| (n.clone(), c))
        .collect();
    let mix_nodes = (args.mix == Mix::Realistic).then(|| MixNodes {
        by_zone: shapes.iter().fold(BTreeMap::new(), |mut m, s| {
            *m.entry(s.zone.unwrap_or("").to_string()).or_default() += 1;
            m
        }),
        reserved: shapes.iter().filter(|s| s.reserved).count(),
    });
    let summary = Summary {
        mode: args.mode,
        mix: args.mix,
        nodes: args.nodes,
        node_profiles,
        mix_nodes,
        trace: args.trace.display().to_string(),
        trace_gpu_pods: trace_pods.sizes.len(),
        trace_cpu_only_pods_left_out: trace_pods.cpu_only,
        mapping: format!(
            "GPU pods only; a share (num_gpu 1, gpu_milli < 1000) asks nvidia.com/gpu-mem = ceil(gpu_milli * {} / 1000) MiB (openb GPUs taken as 16 GB-class); whole GPUs ask nvidia.com/gpu = num_gpu; cpu/memory requests 100m/128Mi for every pod",
            trace::OPENB_GPU_MIB
        ),
        seed: args.seed,
        rate: args.rate,
        duration_s: args.duration,
        burst: args.burst,
        concurrency: args.concurrency,
        fill: args.fill,
        fill_mib: args.fill_mib,
        saturation,
        setup_s,
        phases,
        deletes_s: deletes,
        usage_writes: world.published.load(Ordering::Relaxed),
        usage_write_errors: world.publish_errors.load(Ordering::Relaxed),
        nodes_ready: ready_log,
        lease_renewal_failures: lease_failures.load(Ordering::Relaxed),
        node_status_reposted: reposted.load(Ordering::Relaxed),
        faults: fault_rows,
    };
    let path = args.out.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    write_pods_csv(&world, &args.out.join("pods.csv"))?;
    print!("{}", render(&summary));
    let failed: Vec<&str> = summary
        .faults
        .iter()
        .filter(|r| !r.ok)
        .map(|r| r.fault.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("faults whose cost is over the bar: {}", failed.join(", "));
    }
    Ok(())
}

/// The phases run so far, and what each ends with.
struct Phases<'a> {
    world: &'a Arc<World>,
    client: &'a Client,
    watched: &'a [Watched],
    stall: Duration,
    started: Instant,
    done: Vec<PhaseSummary>,
    ready_log: Vec<(f64, usize)>,
}

impl Phases<'_> {
    /// Starts metering `phase`; its start.
    fn begin(&self, phase: usize) -> Instant {
        *lock(&self.world.meter) = Some(PhaseMeter::start(self.watched));
        *lock(&self.world.current) = Some(phase);
        Instant::now()
    }

    /// Ends `phase`, begun at `t`, its creates all sent: waits for its bindings (and `settle` more),
    /// reads the meters and the Ready nodes, and adds its summary.
    async fn close(&mut self, phase: usize, t: Instant, settle: Duration) -> anyhow::Result<()> {
        let creation = t.elapsed();
        let active_end = wait_bound(self.world, phase, Instant::now(), self.stall).await;
        tokio::time::sleep(settle).await;
        let procs = lock(&self.world.meter)
            .take()
            .map(|m| m.finish(active_end))
            .unwrap_or_default();
        let ready = k8s::ready_nodes(self.client).await?;
        self.ready_log.push((self.started.elapsed().as_secs_f64(), ready));
        let wall = t.elapsed().as_secs_f64();
        let mut summary = summarize(self.world, phase, wall, Some(creation), procs, ready);
        if self.world.dra {
            // Read once the phase's pods are bound, before they are deleted.
            let selector = format!("{RUN_LABEL}={},{PHASE_LABEL}={}", self.world.run, PHASES[phase]);
            match k8s::claim_allocators(self.client, &self.world.namespace, &selector).await {
                Ok(allocators) => {
                    summary.placed_by_gpumem = Some(placed_by(self.world, phase, &allocators));
                }
                Err(err) => {
                    tracing::warn!(error = %format!("{err:#}"), "cannot read who allocated the claims")
                }
            }
        }
        self.done.push(summary);
        self.world.closed[phase].store(true, Ordering::Relaxed);
        Ok(())
    }
}

async fn create_all(
    world: &Arc<World>,
    pods: &Api<Pod>,
    phase: usize,
    prefix: &str,
    sizes: Vec<Size>,
    limit: usize,
) {
    futures_util::stream::iter(sizes.into_iter().enumerate())
        .for_each_concurrent(limit, |(i, size)| async move {
            create_one(world, pods, phase, format!("{prefix}-{i:06}"), size, None).await;
        })
        .await;
}

fn write_pods_csv(world: &World, path: &std::path::Path) -> anyhow::Result<()> {
    let pods = lock(&world.pods);
    let mut rows: Vec<(&String, &Rec)> = pods.iter().collect();
    rows.sort_by(|a, b| (a.1.phase, a.0).cmp(&(b.1.phase, b.0)));
    let first: HashMap<usize, Instant> = rows.iter().fold(HashMap::new(), |mut m, (_, r)| {
        let e = m.entry(r.phase).or_insert(r.t0);
        *e = (*e).min(r.t0);
        m
    });
    let mut w = csv::Writer::from_path(path).with_context(|| format!("writing {}", path.display()))?;
    w.write_record([
        "phase",
        "pod",
        "kind",
        "size",
        "node",
        "created_s",
        "bound_s",
        "latency_ms",
        "misfit",
        "followed_scorer",
        "bound_after_phase",
        "zone",
        "model",
        "error",
    ])?;
    for (name, r) in rows {
        let base = first.get(&r.phase).copied().unwrap_or(r.t0);
        w.write_record([
            PHASES[r.phase].to_string(),
            name.clone(),
            r.size.kind().as_str().to_string(),
            r.size.label(),
            r.node.clone().unwrap_or_default(),
            format!("{:.4}", (r.t0 - base).as_secs_f64()),
            r.t1.map(|t| format!("{:.4}", (t - base).as_secs_f64()))
                .unwrap_or_default(),
            r.t1.map(|t| format!("{:.2}", (t - r.t0).as_secs_f64() * 1000.0))
                .unwrap_or_default(),
            r.misfit.to_string(),
            r.followed.to_string(),
            r.late.to_string(),
            r.shape.zone.unwrap_or("").to_string(),
            r.shape.model.map_or("", Model::as_str).to_string(),
            r.error.clone().unwrap_or_default(),
        ])?;
    }
    w.flush().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The human-readable summary.
pub fn render(s: &Summary) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "gpumem-scale: mode {}, mix {}, {} nodes {:?}; trace {} ({} GPU pods sampled, {} CPU-only pods left out)",
        s.mode.as_str(),
        s.mix.as_str(),
        s.nodes,
        s.node_profiles,
        s.trace,
        s.trace_gpu_pods,
        s.trace_cpu_only_pods_left_out
    );
    let _ = writeln!(out, "mapping: {}", s.mapping);
    if let Some(m) = &s.mix_nodes {
        let _ = writeln!(
            out,
            "realistic mix: nodes by zone {:?}, {} reserved ({}={}:NoSchedule), every node {}={}:NoSchedule",
            m.by_zone,
            m.reserved,
            mix::RESERVED_TAINT.0,
            mix::RESERVED_TAINT.1,
            mix::GPU_TAINT.0,
            mix::GPU_TAINT.1
        );
    }
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
    for p in &s.phases {
        let _ = writeln!(
            out,
            "\n{}: {} pods ({:?}), {} created ({} errors), {} placed ({:.1}%), misfits {} ({:.2}% of placed), created/s {}, bound pods/s {}, {:.1} s, scale nodes Ready at end {}",
            p.phase,
            p.pods,
            p.pods_by_kind,
            p.created,
            p.create_errors,
            p.placed,
            100.0 * p.fraction_placed,
            p.misfits,
            100.0 * p.misfit_fraction,
            f(p.created_per_s),
            f(p.pods_per_s),
            p.wall_s,
            p.nodes_ready_at_end
        );
        let mut lat = |name: &str, l: &Latency| {
            let _ = writeln!(
                out,
                "  latency {name:<9} n={:<6} p50 {:>8.1} ms  p95 {:>8.1} ms  p99 {:>8.1} ms  max {:>8.1} ms",
                l.count, l.p50_ms, l.p95_ms, l.p99_ms, l.max_ms
            );
        };
        if let Some(l) = &p.latency {
            lat("all", l);
        }
        for (k, l) in &p.latency_by_kind {
            lat(k, l);
        }
        if let Some(c) = &p.shapes {
            let _ = writeln!(
                out,
                "  mix: {} with a zone selector, models {:?}, {} tolerating the reserved nodes",
                c.zone_selector, c.model, c.tolerate_reserved
            );
        }
        if let Some(b) = &p.placed_by_gpumem {
            let _ = writeln!(
                out,
                "  claims allocated by gpumem {} of {} bound ({:.1}%), by kube-scheduler {}, by neither {}",
                b.gpumem,
                b.bound,
                100.0 * b.fraction,
                b.kube_scheduler,
                b.neither
            );
        }
        for u in &p.processes {
            let _ = writeln!(
                out,
                "  {:<24} cpu {:>7.1} s = {:>5.0}% of a core, peak RSS {:>7.1} MiB (end {:.1})",
                u.name, u.cpu_s, u.cpu_pct, u.peak_rss_mib, u.end_rss_mib
            );
        }
    }
    let _ = writeln!(
        out,
        "\ndeletes (s): {:?}; usage writes {} ({} errors); scale nodes Ready (t s, count): {:?}; Lease renewals failed {}; node status posted again (not Ready) {}",
        s.deletes_s,
        s.usage_writes,
        s.usage_write_errors,
        s.nodes_ready,
        s.lease_renewal_failures,
        s.node_status_reposted
    );
    if !s.faults.is_empty() {
        let _ = writeln!(out, "\nfaults:");
        for r in &s.faults {
            let _ = writeln!(out, "  {}", faults::render_row(r));
        }
    }
    if let Some(sat) = &s.saturation {
        let _ = writeln!(
            out,
            "saturation: {} pods offered ({:.1} % of the GPU memory arrived); {} of {} MiB of GPU memory allocated: {:.2}% unallocated",
            sat.offered, sat.arrived_pct, sat.allocated_mib, sat.total_mib, sat.unallocated_pct
        );
        let placed: Vec<String> = sat
            .placed
            .iter()
            .map(|(k, p)| format!("{k} {:.1} % ({}/{})", p.pct(), p.placed, p.offered))
            .collect();
        let _ = writeln!(out, "saturation: placed: {}", placed.join(", "));
        let waiting: Vec<String> = sat.waiting.iter().map(|(k, n)| format!("{n} {k}")).collect();
        let _ = writeln!(out, "saturation: waiting at the end: {}", waiting.join(", "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_profile::Profile;

    fn world_with(node: &str, profile: &str) -> World {
        let inv = GpuInventory::discover(&Profile::load(profile).unwrap()).unwrap();
        let book = NodeBook::new(Arc::new(NodeModel::new(profile, inv)));
        let books = HashMap::from([(node.to_string(), book)]);
        World::new("r".into(), "ns".into(), books, Vec::new(), Vec::new(), false)
    }

    fn bind(world: &World, name: &str, node: &str) -> bool {
        let size = Size::Share { mib: 15000 };
        lock(&world.pods).insert(name.into(), Rec::new(FAULTS, size, None));
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"nodeName": node, "containers": []}
        }))
        .unwrap();
        world.on_pod(&pod, false);
        !lock(&world.pods)[name].misfit
    }

    #[test]
    fn a_relist_without_a_bound_pod_gives_its_gpu_back() {
        // t4x4: four T4s of 15360 MiB, one 15000 MiB pod each.
        let world = world_with("n1", "t4x4");
        for i in 0..4 {
            assert!(bind(&world, &format!("p{i}"), "n1"), "p{i} fits");
        }
        assert!(!bind(&world, "p4", "n1"), "a fifth finds no GPU");
        // The watch expired (an API server restart) and p0 was deleted meanwhile: the relist lacks it.
        world.on_relisted(&["p1", "p2", "p3", "p4"].map(String::from).into());
        assert!(lock(&world.pods)["p0"].gone);
        assert!(!lock(&world.pods)["p1"].gone);
        assert!(bind(&world, "p5", "n1"), "p0's GPU is free again");
        world.forget_named("p5");
        assert!(
            bind(&world, "p6", "n1"),
            "so is p5's, gone by a delete answered 404"
        );
    }

    /// A record of `phase`, bound unless `bound` is false, `late` if bound after the phase ended.
    fn rec(phase: usize, size: Size, shape: Shape, bound: bool, late: bool) -> Rec {
        let mut r = Rec::new(phase, size, None);
        r.shape = shape;
        r.t1 = bound.then(Instant::now);
        r.late = late;
        r
    }

    fn summary_of(world: &World, mix: Mix, phases: Vec<PhaseSummary>) -> Summary {
        Summary {
            mode: Mode::DraGpumem,
            mix,
            nodes: 3,
            node_profiles: BTreeMap::new(),
            mix_nodes: (mix == Mix::Realistic).then(|| MixNodes {
                by_zone: BTreeMap::from([("zone-a".to_string(), 3)]),
                reserved: 1,
            }),
            trace: "t.csv".into(),
            trace_gpu_pods: 1,
            trace_cpu_only_pods_left_out: 0,
            mapping: String::new(),
            seed: world.seed,
            rate: 1.0,
            duration_s: 1.0,
            burst: 0,
            concurrency: 1,
            fill: 0,
            fill_mib: 0,
            saturation: None,
            setup_s: 0.0,
            phases,
            deletes_s: BTreeMap::new(),
            usage_writes: 0,
            usage_write_errors: 0,
            nodes_ready: Vec::new(),
            lease_renewal_failures: 0,
            node_status_reposted: 0,
            faults: Vec::new(),
        }
    }

    #[test]
    fn placed_by_gpumem_counts_the_phases_bound_claim_pods() {
        let world = World::new(
            "r".into(),
            "ns".into(),
            HashMap::new(),
            Vec::new(),
            Vec::new(),
            true,
        )
        .with_mix(Mix::Realistic, 1);
        let share = Size::Share { mib: 1000 };
        let t4 = Shape {
            zone: Some("zone-a"),
            model: Some(Model::T4),
            tolerate_gpu: true,
            tolerate_reserved: false,
        };
        let multi = Shape {
            tolerate_reserved: true,
            tolerate_gpu: true,
            ..Shape::default()
        };
        {
            let mut pods = lock(&world.pods);
            pods.insert("a".into(), rec(0, share, t4, true, false));
            pods.insert("b".into(), rec(0, Size::Whole { count: 2 }, multi, true, false));
            pods.insert("c".into(), rec(0, share, Shape::default(), true, false));
            pods.insert("d".into(), rec(0, share, Shape::default(), false, false));
            pods.insert("e".into(), rec(0, share, Shape::default(), true, true));
            pods.insert("f".into(), rec(1, share, Shape::default(), true, false));
        }
        // c's claim was not found; d is not bound, e bound after its phase, f another phase's.
        let allocators = HashMap::from([
            ("a".to_string(), Allocator::Gpumem),
            ("b".to_string(), Allocator::KubeScheduler),
            ("d".to_string(), Allocator::Gpumem),
            ("e".to_string(), Allocator::Gpumem),
            ("f".to_string(), Allocator::Gpumem),
        ]);
        let by = placed_by(&world, 0, &allocators);
        assert_eq!(
            by,
            PlacedBy {
                bound: 3,
                gpumem: 1,
                kube_scheduler: 1,
                neither: 1,
                fraction: 1.0 / 3.0
            }
        );
        let mut phase = summarize(&world, 0, 1.0, None, Vec::new(), 3);
        let shapes = phase.shapes.clone().unwrap();
        assert_eq!(
            (
                shapes.zone_selector,
                shapes.model["t4"],
                shapes.model["40gi+"],
                shapes.tolerate_reserved
            ),
            (1, 1, 0, 1)
        );
        phase.placed_by_gpumem = Some(by);
        let summary = summary_of(&world, Mix::Realistic, vec![phase]);
        let text = render(&summary);
        assert!(text.contains("mode dra-gpumem, mix realistic,"), "{text}");
        assert!(
            text.contains(
                "claims allocated by gpumem 1 of 3 bound (33.3%), by kube-scheduler 1, by neither 1"
            ),
            "{text}"
        );
        assert!(text.contains("1 with a zone selector"), "{text}");
        let json = serde_json::to_value(&summary).unwrap();
        assert_eq!(json["mix"], "realistic");
        assert_eq!(json["mix_nodes"]["reserved"], 1);
        assert_eq!(json["phases"][0]["placed_by_gpumem"]["gpumem"], 1);
        assert_eq!(json["phases"][0]["shapes"]["model"]["t4"], 1);
    }

    #[test]
    fn a_trace_run_summarizes_as_before() {
        let world = world_with("n1", "t4x4");
        assert!(bind(&world, "p0", "n1"));
        let phase = summarize(&world, FAULTS, 1.0, None, Vec::new(), 1);
        assert_eq!(
            (
                phase.shapes.as_ref(),
                phase.placed,
                phase.placed_by_gpumem.as_ref()
            ),
            (None, 1, None)
        );
        let json = serde_json::to_value(summary_of(&world, Mix::Trace, vec![phase])).unwrap();
        assert_eq!(json["mix"], "trace");
        assert!(json.get("mix_nodes").is_none());
        for absent in ["shapes", "placed_by_gpumem"] {
            assert!(json["phases"][0].get(absent).is_none(), "{absent}");
        }
    }

    #[test]
    fn saturation_offers_demand_up_to_the_share_of_gpu_memory_whole_gpus_at_the_mean() {
        // Two GPUs of 16 GiB and 80 GiB: the mean GPU is 48 GiB.
        let a = Arrival::new(96 * 1024, 2, 100);
        assert_eq!(a.demand_mib(Size::Share { mib: 5000 }), 5000);
        assert_eq!(a.demand_mib(Size::Whole { count: 2 }), 96 * 1024);
        assert!(!a.reached(96 * 1024 - 1) && a.reached(96 * 1024));
        assert_eq!(a.pct(48 * 1024), 50.0);
        let beyond = Arrival::new(1000, 1, 120);
        assert!(!beyond.reached(1199) && beyond.reached(1200));
        assert!(Arrival::new(1000, 1, 0).reached(0), "0: no saturation pods");
    }

    #[test]
    fn a_saturation_pod_counts_in_its_classes() {
        let mut t4_share = Rec::new(3, Size::Share { mib: 4000 }, None);
        t4_share.shape.model = Some(Model::T4);
        assert_eq!(classes(&t4_share), ["all", "restricted", "share", "share t4"]);
        let multi = Rec::new(3, Size::Whole { count: 4 }, None);
        assert_eq!(classes(&multi), ["all", "unrestricted", "multi-gpu"]);
        let p = Placed {
            offered: 8,
            placed: 6,
        };
        assert_eq!(p.pct(), 75.0);
        assert_eq!(
            Placed::default().pct(),
            0.0,
            "no pods: none placed, no division by zero"
        );
    }
}
