//! The fault phase: pods keep arriving at a cluster held near `--fault-target` of its GPU memory
//! (each pod deleted a lifetime after it is bound), and faults are injected one at a time, then all
//! together. Each fault gets one row: what was offered, placed, failed and left pending while it
//! lasted and until the placement rate came back, the GPUs any usage annotation showed over capacity,
//! and how long recovery took (docs/operate.md, "What a fault costs"; scripts/faults.sh runs it).
//!
//! A fault is a shell command run by `bash -c` (the script knows how to kill a scorer replica or
//! restart kube-apiserver on the kit); it lasts until the command exits. `@node-lost` is built in: the
//! scale node holding most of a Deployment's pods stops renewing its Lease and posting its status,
//! as a node that lost power would, and the fault lasts until the Deployment's pods are all placed
//! on other nodes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Args;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde::Serialize;

use super::{FAULTS, PHASES, Rec, World, create_one, lock};
use crate::k8s;
use crate::stats;
use crate::trace::{OPENB_GPU_MIB, Sampler};

#[derive(Args, Debug, Clone, Default)]
pub struct FaultArgs {
    /// A fault, NAME=COMMAND: COMMAND runs under `bash -c` and the fault lasts until it exits;
    /// `@node-lost` is built in (a scale node with the Deployment's pods goes silent). Repeat; they
    /// run in the order given (no --fault: no fault phase).
    #[arg(long = "fault", value_name = "NAME=COMMAND")]
    pub faults: Vec<String>,
    /// After one at a time, all the faults at once.
    #[arg(long)]
    pub fault_together: bool,
    /// A fault that crashes the device plugin (SIGKILL of the agent): the kubelet fails the pods it
    /// admits until the plugin registers again, as with any device plugin, and the row counts them
    /// apart. Elsewhere (a restart by SIGTERM, which the agent fences) such a failure fails the row.
    #[arg(long = "fault-plugin-crash", value_name = "NAME")]
    pub fault_plugin_crashes: Vec<String>,
    /// The share of the scale nodes' GPU memory the fault phase keeps allocated.
    #[arg(long, default_value_t = 0.9)]
    pub fault_target: f64,
    /// Pods offered per second at most (while the target is not reached).
    #[arg(long, default_value_t = 20.0)]
    pub fault_rate: f64,
    /// Mean seconds a pod lives once bound (each lives 0.5 to 1.5 times that).
    #[arg(long, default_value_t = 60.0)]
    pub fault_lifetime: f64,
    /// Seconds before each fault whose placement rate is the one to come back to.
    #[arg(long, default_value_t = 20.0)]
    pub fault_baseline: f64,
    /// Seconds after a fault's end to wait for the placement rate to come back.
    #[arg(long, default_value_t = 120.0)]
    pub fault_observe: f64,
    /// A row passes only if the placement rate came back within this many seconds of the fault's end.
    #[arg(long, default_value_t = 60.0)]
    pub fault_recovery_limit: f64,
    /// Seconds the phase waits for the target to be reached before the first fault.
    #[arg(long, default_value_t = 240.0)]
    pub fault_warmup: f64,
    /// Seconds a pod may wait unbound before it is deleted, as a job that gives up would (it counts as
    /// pending, with kube-scheduler's reason, in its fault's row).
    #[arg(long, default_value_t = 60.0)]
    pub fault_give_up: f64,
    /// Replicas of the Deployment whose node `@node-lost` takes down.
    #[arg(long, default_value_t = 6)]
    pub fault_deployment: i32,
    /// Seconds the Deployment's pods tolerate an unreachable node (the API server's default is 300).
    #[arg(long, default_value_t = 10)]
    pub fault_toleration: i64,
    /// The schedulers the fault phase's pods name, in turn (spec.schedulerName): with two, two
    /// kube-schedulers bind at once, each over its own connection to the scorers (the chart's
    /// `scheduler.mode: second` beside the default scheduler).
    #[arg(long = "fault-scheduler", default_value = "default-scheduler")]
    pub fault_schedulers: Vec<String>,
    /// A node with a real kubelet and agent that the fault phase's pods may also land on (repeat).
    #[arg(long = "real-node")]
    pub real_nodes: Vec<String>,
}

/// One fault as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub name: String,
    pub action: Action,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Shell(String),
    NodeLost,
}

pub fn parse_fault(text: &str) -> anyhow::Result<Fault> {
    let (name, command) = text
        .split_once('=')
        .with_context(|| format!("fault {text:?}: expected NAME=COMMAND"))?;
    let (name, command) = (name.trim(), command.trim());
    if name.is_empty() || command.is_empty() {
        bail!("fault {text:?}: the name and the command must not be empty");
    }
    let action = match command {
        "@node-lost" => Action::NodeLost,
        c if c.starts_with('@') => bail!("fault {text:?}: {c} is not built in (only @node-lost)"),
        c => Action::Shell(c.to_string()),
    };
    Ok(Fault {
        name: name.to_string(),
        action,
    })
}

/// What one fault cost.
#[derive(Serialize, Debug, Clone)]
pub struct FaultRow {
    pub fault: String,
    /// The command, or the node lost.
    pub detail: String,
    /// From injection to the command's exit (node lost: until the Deployment's pods were all placed again).
    pub fault_s: f64,
    /// Bindings per second over the baseline seconds before the fault, at most those before the first
    /// fault.
    pub baseline_per_s: f64,
    /// Pods created from the fault's start to the row's end, and of those, bound.
    pub offered: usize,
    pub placed: usize,
    /// Pods failed for GPU reasons (the kubelet's UnexpectedAdmissionError; on an API-only node, a pod no
    /// GPU of its node can hold, which the agent would refuse), and for any other reason.
    pub failed_gpu: usize,
    /// Pods the kubelet failed because the device plugin was not serving when it admitted them (no
    /// healthy device at all: the agent restarting). Any device plugin has that window; it is reported
    /// apart from `failed_gpu`, which counts what gpumem decided wrong.
    pub failed_plugin_down: usize,
    pub failed_other: usize,
    pub failures: Vec<String>,
    /// Pods unbound at the row's end or given up on during it, by kube-scheduler's reason (their
    /// PodScheduled message).
    pub pending: usize,
    pub pending_reasons: BTreeMap<String, usize>,
    /// Pending for more than 10 s with no reason given.
    pub pending_without_reason: usize,
    pub pending_without_reason_examples: Vec<String>,
    /// Samples of the nodes' usage annotations in which a GPU showed more allocated than it has.
    pub over_capacity: usize,
    pub over_capacity_examples: Vec<String>,
    /// Pods the agent placed on another GPU than the scorer chose (its room was taken).
    pub moved_by_agent: usize,
    /// From the fault's start to the first binding after it.
    pub first_placement_s: Option<f64>,
    /// From the fault's end until a 15 s window's placement rate is back to 80% of the baseline.
    pub recovered_s: Option<f64>,
    pub ok: bool,
    pub verdict: String,
}

/// The samples of the usage annotations: when, and the GPUs found over capacity.
type OverCapacity = Arc<std::sync::Mutex<Vec<(Instant, Vec<String>)>>>;

/// Tasks the phase runs beside the faults, stopped at its end.
struct Loops {
    stop: Arc<AtomicBool>,
    over: OverCapacity,
}

/// The scale nodes' GPU memory allocated now (the played agent's books, lost nodes left out), the pods
/// of the phase waiting unbound that were created in the last [`IN_FLIGHT`], and all those waiting.
fn load(world: &World) -> (u64, usize, usize) {
    let silenced = lock(&world.silenced).clone();
    let allocated = lock(&world.books)
        .iter()
        .filter(|(n, _)| !silenced.contains(*n))
        .map(|(_, b)| b.usage().gpus.iter().map(|g| g.allocated_mib).sum::<u64>())
        .sum();
    let pods = lock(&world.pods);
    let waiting: Vec<&Rec> = pods
        .values()
        .filter(|r| r.phase == FAULTS && r.t1.is_none() && !r.gone && r.failed.is_none() && r.error.is_none())
        .collect();
    let in_flight = waiting.iter().filter(|r| r.t0.elapsed() < IN_FLIGHT).count();
    (allocated, in_flight, waiting.len())
}

/// The window whose placement rate must be back to the baseline's, seconds.
const RECOVERY_WINDOW: f64 = 15.0;

/// A pod created this recently and not bound yet is on its way, not waiting for room.
const IN_FLIGHT: Duration = Duration::from_secs(15);

/// A pod's lifetime: spread evenly over 0.5 to 1.5 times the mean (golden-ratio steps, no RNG needed).
fn lifetime(i: u64, mean_s: f64) -> Duration {
    let frac = (i as f64 * 0.618_033_988_749_895).fract();
    Duration::from_secs_f64(mean_s * (0.5 + frac))
}

/// Creates pods while the scale nodes are below the target and few wait: at most 5 s of offers on
/// their way, and at most 10 s of offers waiting in all (pods that wait for room the cluster, kept
/// near full, rarely has: whole GPUs; the reaper gives up on them after `--fault-give-up`).
async fn offer(
    world: Arc<World>,
    pods: Api<Pod>,
    mut sampler: Sampler,
    args: FaultArgs,
    capacity_mib: u64,
    stop: Arc<AtomicBool>,
) {
    let max_in_flight = (args.fault_rate * 5.0).max(20.0) as usize;
    let max_waiting = (args.fault_rate * 10.0).max(40.0) as usize;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.fault_rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let (allocated, in_flight, waiting) = load(&world);
        if allocated as f64 >= args.fault_target * capacity_mib as f64
            || in_flight >= max_in_flight
            || waiting >= max_waiting
        {
            continue;
        }
        let (world, pods, size) = (world.clone(), pods.clone(), sampler.next_size());
        let life = lifetime(i, args.fault_lifetime);
        let name = format!("fault-{i:06}");
        tokio::spawn(async move { create_one(&world, &pods, FAULTS, name, size, Some(life)).await });
        i += 1;
    }
}

/// Deletes the pods whose lifetime is over, failed pods (they hold nothing; a user would clear them),
/// and pods unbound after `give_up`, as their owner would; a delete that did not take is sent again
/// after 5 s.
async fn reap(world: Arc<World>, pods: Api<Pod>, give_up: Duration, stop: Arc<AtomicBool>) {
    let mut sent: HashMap<String, Instant> = HashMap::new();
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = Instant::now();
        let due: Vec<String> = lock(&world.pods)
            .iter()
            .filter(|(_, r)| r.phase == FAULTS && !r.gone && !r.owned)
            .filter(|(_, r)| {
                r.failed.is_some()
                    || matches!((r.t1, r.lifetime), (Some(t1), Some(l)) if now >= t1 + l)
                    || (r.t1.is_none() && now - r.t0 >= give_up && has_reason(r))
            })
            .filter(|(n, _)| sent.get(*n).is_none_or(|t| now - *t > Duration::from_secs(5)))
            .map(|(n, _)| n.clone())
            .collect();
        for name in &due {
            sent.insert(name.clone(), now);
        }
        sent.retain(|_, t| now - *t < Duration::from_secs(60));
        let (pods, params, world) = (&pods, &params, &world);
        futures_util::StreamExt::for_each_concurrent(futures_util::stream::iter(due), 16, |n| async move {
            match pods.delete(&n, params).await {
                // Deleted while the watch was away (an API server restart): no event will say so.
                Err(kube::Error::Api(e)) if e.code == 404 => world.forget_named(&n),
                Err(err) => tracing::debug!(pod = %n, error = %err, "delete failed; sent again later"),
                Ok(_) => {}
            }
        })
        .await;
    }
}

/// Whether the kubelet refused the pod because its device plugin was not serving. Either the resource had
/// no healthy device at all (the kubelet marks every device of a plugin whose stream broke unhealthy
/// until it registers again), or the kubelet called a plugin that had just died, before it noticed: the
/// call fails in gRPC's transport (`connection error`, `error reading from server`, `transport is
/// closing`) or on an endpoint the kubelet already stopped. A refusal by the agent's own Allocate reads
/// `rpc error` too, with the agent's reason after `desc =`, never a transport's.
fn plugin_was_down(why: &str) -> bool {
    let no_device = why.contains("devices unavailable") && why.contains("Available: 0,");
    let unreachable = [
        "connection error",
        "error reading from server",
        "transport is closing",
    ]
    .iter()
    .any(|t| why.contains(&format!("code = Unavailable desc = {t}")));
    let stopped = why.contains("has been stopped");
    why.starts_with("UnexpectedAdmissionError") && (no_device || unreachable || stopped)
}

/// Whether kube-scheduler has said why the pod waits. A pod without a reason is never given up on: it
/// waits until it has one (or is placed), so that a pod no scheduler looked at is seen at the row's end.
fn has_reason(r: &Rec) -> bool {
    r.unschedulable.as_deref().is_some_and(|m| !m.is_empty())
}

/// Pods waiting unbound for over 10 s that no scheduler has given a reason for yet.
fn unseen_by_schedulers(world: &World) -> usize {
    let now = Instant::now();
    lock(&world.pods)
        .values()
        .filter(|r| r.phase == FAULTS && !r.gone && r.t1.is_none())
        .filter(|r| r.failed.is_none() && r.error.is_none() && !has_reason(r))
        .filter(|r| now - r.t0 > Duration::from_secs(10))
        .count()
}

/// Every 2 s, the GPUs that any node's usage annotation shows over capacity.
async fn watch_capacity(client: Client, over: OverCapacity, stop: Arc<AtomicBool>) {
    let nodes: Api<Node> = Api::all(client);
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let Ok(list) = nodes.list(&ListParams::default()).await else {
            continue; // the API server is down: nothing to read
        };
        let found: Vec<String> = list.items.iter().flat_map(over_capacity).collect();
        lock(&over).push((Instant::now(), found));
    }
}

/// The GPUs of `node` whose usage annotation shows more allocated than the topology says they have.
pub fn over_capacity(node: &Node) -> Vec<String> {
    let name = node.metadata.name.as_deref().unwrap_or("?");
    let Some(a) = node.metadata.annotations.as_ref() else {
        return Vec::new();
    };
    let (Some(topo), Some(usage)) = (
        a.get(gpumem::node::TOPOLOGY_ANNOTATION)
            .and_then(|t| gpumem::node::TopologyAnnotation::parse(t).ok()),
        a.get(gpumem::node::USAGE_ANNOTATION)
            .and_then(|u| gpumem::node::UsageAnnotation::parse(u).ok()),
    ) else {
        return Vec::new();
    };
    usage
        .gpus
        .iter()
        .filter_map(|u| {
            let memory = topo.gpus.iter().find(|g| g.index == u.index)?.memory_mib;
            (u.allocated_mib > memory)
                .then(|| format!("{name} GPU {}: {} of {memory} MiB", u.index, u.allocated_mib))
        })
        .collect()
}

/// The phase: warm up to the target, each fault, then all together; the rows.
pub async fn run_faults(
    world: &Arc<World>,
    client: &Client,
    sampler: Sampler,
    args: &FaultArgs,
    capacity_mib: u64,
    log: &std::path::Path,
) -> anyhow::Result<Vec<FaultRow>> {
    let faults = args
        .faults
        .iter()
        .map(|f| parse_fault(f))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &world.namespace);
    let deployment_name = format!("fault-deploy-{}", world.run);
    if faults.iter().any(|f| f.action == Action::NodeLost) {
        let d = k8s::deployment(
            &deployment_name,
            &world.run,
            PHASES[FAULTS],
            args.fault_deployment,
            OPENB_GPU_MIB / 4,
            args.fault_toleration,
        )?;
        Api::<Deployment>::namespaced(client.clone(), &world.namespace)
            .create(&PostParams::default(), &d)
            .await
            .context("creating the fault phase's Deployment")?;
    }
    let loops = Loops {
        stop: Arc::new(AtomicBool::new(false)),
        over: Arc::new(std::sync::Mutex::new(Vec::new())),
    };
    tokio::spawn(offer(
        world.clone(),
        pods.clone(),
        sampler,
        args.clone(),
        capacity_mib,
        loops.stop.clone(),
    ));
    tokio::spawn(reap(
        world.clone(),
        pods.clone(),
        Duration::from_secs_f64(args.fault_give_up),
        loops.stop.clone(),
    ));
    tokio::spawn(watch_capacity(
        client.clone(),
        loops.over.clone(),
        loops.stop.clone(),
    ));

    // Warm-up: the target reached (within 5 points) and the Deployment's pods placed.
    let started = Instant::now();
    loop {
        let (allocated, _, pending) = load(world);
        let fraction = allocated as f64 / capacity_mib.max(1) as f64;
        let owned = owned_placed(world, None);
        let want_owned = if faults.iter().any(|f| f.action == Action::NodeLost) {
            args.fault_deployment as usize
        } else {
            0
        };
        // At the target, and one mean lifetime in, so that pods are leaving at their steady pace.
        let steady = started.elapsed().as_secs_f64() >= args.fault_lifetime;
        if fraction >= args.fault_target - 0.05 && owned >= want_owned && steady {
            eprintln!(
                "faults: warm at {:.1}% of the scale nodes' GPU memory allocated after {:.0} s",
                100.0 * fraction,
                started.elapsed().as_secs_f64()
            );
            break;
        }
        if started.elapsed().as_secs_f64() > args.fault_warmup {
            eprintln!(
                "faults: only {:.1}% allocated after {:.0} s ({pending} pending, {owned}/{want_owned} Deployment pods placed); the faults start anyway",
                100.0 * fraction,
                args.fault_warmup
            );
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    let mut rows = Vec::new();
    let mut sets: Vec<(String, Vec<Fault>)> =
        faults.iter().map(|f| (f.name.clone(), vec![f.clone()])).collect();
    if args.fault_together && faults.len() > 1 {
        sets.push(("all together".into(), faults.clone()));
    }
    let mut steady = None;
    for fault in &sets {
        let row = one_fault(world, &pods, args, &loops, fault, log, &mut steady).await;
        eprintln!("{}", render_row(&row));
        rows.push(row);
    }
    loops.stop.store(true, Ordering::Relaxed);
    Ok(rows)
}

/// The Deployment's pods bound to a node that is not silenced (nor `except`), and not gone.
fn owned_placed(world: &World, except: Option<&str>) -> usize {
    let silenced = lock(&world.silenced).clone();
    lock(&world.pods)
        .values()
        .filter(|r| r.owned && !r.gone)
        .filter(|r| {
            r.node
                .as_deref()
                .is_some_and(|n| !silenced.contains(n) && Some(n) != except)
        })
        .count()
}

/// The times of the phase's bindings, in seconds from `origin` (negative: before it).
fn bindings_since(world: &World, origin: Instant) -> Vec<f64> {
    lock(&world.pods)
        .values()
        .filter(|r| r.phase == FAULTS)
        .filter_map(|r| r.t1)
        .map(|t| signed_s(t, origin))
        .collect()
}

fn signed_s(t: Instant, origin: Instant) -> f64 {
    if t >= origin {
        (t - origin).as_secs_f64()
    } else {
        -(origin - t).as_secs_f64()
    }
}

async fn one_fault(
    world: &Arc<World>,
    pods: &Api<Pod>,
    args: &FaultArgs,
    loops: &Loops,
    (name, set): &(String, Vec<Fault>),
    log: &std::path::Path,
    steady: &mut Option<f64>,
) -> FaultRow {
    tokio::time::sleep(Duration::from_secs_f64(args.fault_baseline)).await;
    let start = Instant::now();
    let before = bindings_since(world, start);
    let recent = before
        .iter()
        .filter(|&&t| t >= -args.fault_baseline && t < 0.0)
        .count() as f64
        / args.fault_baseline.max(1.0);
    // The rate to come back to: the one before this fault, but never above the one before the first
    // fault (the seconds after a fault place its backlog at a rate the steady load never asks for).
    let baseline = recent.min(*steady.get_or_insert(recent));
    eprintln!("faults: {name} starts (baseline {baseline:.1} bindings/s; {recent:.1} just before it)");
    let mut details = Vec::new();
    let runs = set.iter().map(|f| {
        let (world, pods) = (world.clone(), pods.clone());
        let (f, args, log) = (f.clone(), args.clone(), log.to_path_buf());
        async move {
            match &f.action {
                Action::Shell(cmd) => run_shell(&f.name, cmd, &log).await.map(|()| cmd.clone()),
                Action::NodeLost => node_lost(&world, &pods, &args).await,
            }
        }
    });
    for (f, result) in set.iter().zip(futures_util::future::join_all(runs).await) {
        details.push(match result {
            Ok(d) => format!("{}: {d}", f.name),
            Err(e) => format!("{}: FAILED TO INJECT: {e:#}", f.name),
        });
    }
    let end = Instant::now();
    // Recovery: the first window of RECOVERY_WINDOW from the fault's end whose rate is back to 80% of the
    // baseline (a burst of pods placed at once, then a stall, is not a recovery).
    // The row goes on while pods wait that no scheduler has looked at yet (one that restarted waits
    // for its leader Lease): they get their chance before they count as pending without a reason.
    let mut recovered = None;
    while (recovered.is_none() || unseen_by_schedulers(world) > 0)
        && end.elapsed().as_secs_f64() < args.fault_observe
    {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if recovered.is_none() {
            let times = bindings_since(world, end);
            let elapsed = end.elapsed().as_secs_f64();
            recovered = stats::recovered_after(&times, baseline, RECOVERY_WINDOW, elapsed);
        }
    }
    // Pods of the fault's aftermath that are still settling get a few more seconds.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let row_end = Instant::now();
    let times = bindings_since(world, start);
    let first = times.iter().copied().filter(|&t| t >= 0.0).reduce(f64::min);
    let over: Vec<String> = lock(&loops.over)
        .iter()
        .filter(|(t, _)| *t >= start && *t <= row_end)
        .flat_map(|(_, found)| found.clone())
        .collect();
    let pods_now = lock(&world.pods);
    let in_window = |t: Instant| t >= start && t <= row_end;
    let offered: Vec<&Rec> = pods_now
        .values()
        .filter(|r| r.phase == FAULTS && !r.owned && in_window(r.t0))
        .collect();
    let mut failures = Vec::new();
    let (mut failed_gpu, mut failed_plugin_down, mut failed_other) = (0, 0, 0);
    for r in pods_now.values().filter(|r| r.phase == FAULTS) {
        if let Some((why, at)) = &r.failed
            && in_window(*at)
        {
            if plugin_was_down(why) {
                failed_plugin_down += 1;
            } else if why.starts_with("UnexpectedAdmissionError") {
                failed_gpu += 1;
            } else {
                failed_other += 1;
            }
            failures.push(why.clone());
        }
        if r.misfit && r.t1.is_some_and(in_window) {
            failed_gpu += 1;
            failures.push(format!("misfit on {}", r.node.as_deref().unwrap_or("?")));
        }
    }
    failures.truncate(5);
    // Unbound at the row's end, or given up on (deleted unbound) during it.
    let waiting: Vec<(&String, &Rec)> = pods_now
        .iter()
        .filter(|(_, r)| r.phase == FAULTS && r.t1.is_none() && r.failed.is_none() && r.error.is_none())
        .filter(|(_, r)| !r.gone || in_window(r.t0 + Duration::from_secs_f64(args.fault_give_up)))
        .collect();
    let mut pending_reasons = BTreeMap::new();
    let mut without_reason = Vec::new();
    for (name, r) in &waiting {
        match r.unschedulable.as_deref().filter(|m| !m.is_empty()) {
            Some(m) => *pending_reasons.entry(reason_key(m)).or_insert(0) += 1,
            None if row_end - r.t0 > Duration::from_secs(10) => without_reason.push(format!(
                "{name} ({} for {:.0} s{})",
                r.size.label(),
                (row_end - r.t0).as_secs_f64(),
                if r.gone { ", deleted" } else { "" }
            )),
            None => *pending_reasons.entry("(just created)".to_string()).or_insert(0) += 1,
        }
    }
    let pending_without_reason = without_reason.len();
    without_reason.sort();
    without_reason.truncate(5);
    let moved = pods_now
        .values()
        .filter(|r| r.phase == FAULTS && r.t1.is_some_and(in_window) && !r.misfit && !r.followed)
        .filter(|r| {
            r.node
                .as_deref()
                .is_some_and(|n| !world.real_nodes.iter().any(|x| x == n))
        })
        .count();
    let placed = offered.iter().filter(|r| r.t1.is_some()).count();
    let mut problems = Vec::new();
    if failed_gpu > 0 {
        problems.push(format!("{failed_gpu} pods failed for GPU reasons"));
    }
    let plugin_crashed = set.iter().any(|f| args.fault_plugin_crashes.contains(&f.name));
    if failed_plugin_down > 0 && !plugin_crashed {
        problems.push(format!(
            "{failed_plugin_down} pods failed while the device plugin was not serving"
        ));
    }
    if !over.is_empty() {
        problems.push(format!("{} GPU samples over capacity", over.len()));
    }
    if pending_without_reason > 0 {
        problems.push(format!("{pending_without_reason} pods pending with no reason"));
    }
    if baseline < 0.5 {
        problems.push(format!(
            "baseline of {baseline:.2} bindings/s: too few to tell a recovery"
        ));
    }
    match recovered {
        Some(r) if r <= args.fault_recovery_limit => {}
        Some(r) => problems.push(format!("recovered after {r:.0} s")),
        None => problems.push(format!("not recovered within {:.0} s", args.fault_observe)),
    }
    if details.iter().any(|d| d.contains("FAILED TO INJECT")) {
        problems.push("a fault could not be injected".into());
    }
    FaultRow {
        fault: name.to_string(),
        detail: details.join("; "),
        fault_s: (end - start).as_secs_f64(),
        baseline_per_s: baseline,
        offered: offered.len(),
        placed,
        failed_gpu,
        failed_plugin_down,
        failed_other,
        failures,
        pending: waiting.len(),
        pending_reasons,
        pending_without_reason,
        pending_without_reason_examples: without_reason,
        over_capacity: over.len(),
        over_capacity_examples: over.into_iter().take(3).collect(),
        moved_by_agent: moved,
        first_placement_s: first,
        recovered_s: recovered,
        ok: problems.is_empty(),
        verdict: if problems.is_empty() {
            "ok".into()
        } else {
            problems.join("; ")
        },
    }
}

/// kube-scheduler's message, cut to what groups alike reasons (the node counts vary).
fn reason_key(message: &str) -> String {
    let m = message.trim();
    // "0/21 nodes are available: 3 Insufficient nvidia.com/gpu-mem, ..." -> the part after the count.
    let m = m.split_once("are available: ").map_or(m, |(_, rest)| rest);
    m.chars().take(120).collect()
}

async fn run_shell(name: &str, cmd: &str, log: &std::path::Path) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let _ = writeln!(file, "== {name}: {cmd}");
    let out = tokio::process::Command::new("bash")
        .arg("-c")
        .arg(cmd)
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .await
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.success() {
        bail!("{cmd:?} exited with {out} (see {})", log.display());
    }
    Ok(())
}

/// `@node-lost`: the scale node holding most of the Deployment's pods goes silent until the
/// Deployment has all its pods placed elsewhere; then it comes back (as a repaired node would) and
/// the pods left on it are deleted by force, as an operator would. Returns the node.
async fn node_lost(world: &Arc<World>, pods: &Api<Pod>, args: &FaultArgs) -> anyhow::Result<String> {
    let victim = {
        let mut count: HashMap<String, usize> = HashMap::new();
        for r in lock(&world.pods).values().filter(|r| r.owned && !r.gone) {
            if let Some(n) = &r.node {
                *count.entry(n.clone()).or_default() += 1;
            }
        }
        count
            .into_iter()
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
            .map(|(n, _)| n)
            .context("no Deployment pod is bound: no node to lose")?
    };
    lock(&world.silenced).insert(victim.clone());
    let started = Instant::now();
    let limit = Duration::from_secs_f64(args.fault_observe + 300.0);
    let replaced = loop {
        if owned_placed(world, Some(&victim)) >= args.fault_deployment as usize {
            break true;
        }
        if started.elapsed() > limit {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    lock(&world.silenced).remove(&victim);
    let left: Vec<String> = lock(&world.pods)
        .iter()
        .filter(|(_, r)| r.owned && !r.gone && r.node.as_deref() == Some(victim.as_str()))
        .map(|(n, _)| n.clone())
        .collect();
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    for n in left {
        if let Err(err) = pods.delete(&n, &params).await {
            tracing::warn!(pod = %n, error = %err, "cannot delete a pod left on the lost node");
        }
    }
    if !replaced {
        bail!("{victim}: the Deployment's pods were not all placed elsewhere within {limit:?}");
    }
    Ok(format!(
        "{victim} silent; the Deployment's {} pods all placed on other nodes after {:.0} s",
        args.fault_deployment,
        started.elapsed().as_secs_f64()
    ))
}

pub fn render_row(r: &FaultRow) -> String {
    let opt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
    format!(
        "fault {:<22} {:>6.1} s | offered {:>5} placed {:>5} failed {} (+{} plugin down, +{} other) pending {:>4} ({} with no reason) | over capacity {} | moved by agent {} | first placement {} s, recovered {} s after its end | {}",
        r.fault,
        r.fault_s,
        r.offered,
        r.placed,
        r.failed_gpu,
        r.failed_plugin_down,
        r.failed_other,
        r.pending,
        r.pending_without_reason,
        r.over_capacity,
        r.moved_by_agent,
        opt(r.first_placement_s),
        opt(r.recovered_s),
        r.verdict
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plugin_down_refusal_is_told_from_the_agents() {
        let down = "UnexpectedAdmissionError: Pod Allocate failed due to requested number of devices \
                    unavailable for nvidia.com/gpu-mem. Requested: 9667, Available: 0, which is unexpected";
        assert!(plugin_was_down(down));
        let some = down.replace("Available: 0,", "Available: 4000,");
        assert!(!plugin_was_down(&some), "devices left: not a plugin that is down");
        let agent = "UnexpectedAdmissionError: Pod Allocate failed due to rpc error: code = \
                     ResourceExhausted desc = GPU-1 has 2000 MiB free, which is unexpected";
        assert!(!plugin_was_down(agent));
        assert!(!plugin_was_down("OutOfmemory: Available: 0, devices unavailable"));
        let unavailable = "UnexpectedAdmissionError: Allocate failed due to rpc error: code = Unavailable \
                           desc = GPU 2 is unhealthy: Xid 79, which is unexpected";
        assert!(!plugin_was_down(unavailable), "the agent's own refusal");
    }

    #[test]
    fn a_plugin_that_died_under_a_call_is_a_plugin_that_is_down() {
        // What the kubelet 1.24 says when it calls a plugin in the moment between its death and the
        // kubelet noticing it (its format strings: "Allocate failed due to %v, which is unexpected",
        // "device plugin GetPreferredAllocation rpc failed with err: %v", "endpoint %v has been stopped").
        for why in [
            "UnexpectedAdmissionError: Allocate failed due to rpc error: code = Unavailable desc = \
             connection error: desc = \"transport: Error while dialing dial unix \
             /var/lib/kubelet/device-plugins/gpumem-gpu.sock: connect: connection refused\", which is unexpected",
            "UnexpectedAdmissionError: Allocate failed due to device plugin GetPreferredAllocation rpc \
             failed with err: rpc error: code = Unavailable desc = error reading from server: EOF, which \
             is unexpected",
            "UnexpectedAdmissionError: Allocate failed due to rpc error: code = Unavailable desc = \
             transport is closing, which is unexpected",
            "UnexpectedAdmissionError: Allocate failed due to endpoint &{0xc000 0xc001} has been \
             stopped, which is unexpected",
        ] {
            assert!(plugin_was_down(why), "{why}");
        }
    }

    #[test]
    fn faults_parse_as_name_and_command() {
        assert_eq!(
            parse_fault("scorer-kill = kill -9 $(cat a.pid)").unwrap(),
            Fault {
                name: "scorer-kill".into(),
                action: Action::Shell("kill -9 $(cat a.pid)".into())
            }
        );
        assert_eq!(parse_fault("lost=@node-lost").unwrap().action, Action::NodeLost);
        assert!(parse_fault("no-command").is_err());
        assert!(parse_fault("=cmd").is_err());
        assert!(parse_fault("x=@nothing").is_err());
    }

    #[test]
    fn lifetimes_spread_between_half_and_one_and_a_half_times_the_mean() {
        let l: Vec<f64> = (0..1000).map(|i| lifetime(i, 60.0).as_secs_f64()).collect();
        assert!(l.iter().all(|&x| (30.0..90.0).contains(&x)));
        let mean = l.iter().sum::<f64>() / l.len() as f64;
        assert!((mean - 60.0).abs() < 1.0, "mean {mean}");
    }

    #[test]
    fn a_gpu_over_capacity_is_found_in_the_annotations() {
        let inventory =
            gpumem::gpu::GpuInventory::discover(&gpumem_profile::Profile::load("t4x4").unwrap()).unwrap();
        let topo = gpumem::node::TopologyAnnotation::new(&inventory, 1, |_| true);
        let mut usage = gpumem::node::UsageAnnotation::idle(&inventory);
        let node = |usage: &gpumem::node::UsageAnnotation| -> Node {
            let mut n = Node::default();
            n.metadata.name = Some("n1".into());
            n.metadata.annotations = Some(gpumem::node::annotations(&topo, usage));
            n
        };
        assert!(over_capacity(&node(&usage)).is_empty());
        usage.gpus[1].allocated_mib = topo.gpus[1].memory_mib + 1;
        let found = over_capacity(&node(&usage));
        assert_eq!(found.len(), 1);
        assert!(found[0].starts_with("n1 GPU 1: "), "{found:?}");
    }

    #[test]
    fn reasons_group_without_the_node_counts() {
        assert_eq!(
            reason_key("0/21 nodes are available: 21 gpumem: no GPU has 5000 MiB free."),
            "21 gpumem: no GPU has 5000 MiB free."
        );
        assert_eq!(reason_key("  other  "), "other");
    }
}
