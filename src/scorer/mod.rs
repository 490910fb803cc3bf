//! `gpumem scorer`: the kube-scheduler extender (filter, prioritize, bind, preempt over HTTP).
//!
//! - [`extender`]: the protocol's wire types;
//! - [`state`]: node GPU state from the agent's annotations, and pod requests;
//! - [`decide`]: filter and ranking, pure, through the shared placement policy ([`crate::alloc`]);
//! - [`ledger`]: binds in flight, so that concurrent decisions never double-book a GPU;
//! - [`preempt`]: GPU-aware victim selection;
//! - [`cache`]: reflector-fed node and pod caches (`nodeCacheCapable: true`);
//! - [`server`]: HTTP (hyper + tower), `/healthz`, `/metrics`;
//! - [`metrics`]: Prometheus metrics.
//!
//! The verbs themselves ([`Scorer`]) tie these together.

pub mod cache;
pub mod decide;
pub mod extender;
pub mod ledger;
pub mod metrics;
pub mod preempt;
pub mod server;
pub mod state;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::pending;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde::Deserialize;
use tokio::signal::unix::{SignalKind, signal};

use self::cache::{NodeCache, PodCache, RawNodeCache};
use self::decide::Rejection;
use self::extender::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, ExtenderPreemptionArgs,
    ExtenderPreemptionResult, HostPriorities, MetaPod, MetaVictims, NodeList, NodeNames,
};
use self::ledger::{Ledger, Reservation};
use self::metrics::{Metrics, ReasonLabel, VerbLabel};
use self::preempt::VictimInfo;
use self::state::{ClassRules, NodeSnapshot, PodDemand};
use crate::node::{ASSIGNED_AT_ANNOTATION, ASSIGNED_GPUS_ANNOTATION};
use crate::tls::TlsFiles;

/// `gpumem scorer` command line.
#[derive(Debug, clap::Args)]
pub struct ScorerArgs {
    /// Address to serve on: the extender's verbs, `/healthz`, `/readyz` and `/metrics`; with `tls` in
    /// the configuration, all but the verbs.
    #[arg(long, default_value = "0.0.0.0:8888")]
    pub listen: SocketAddr,
    /// Address to serve the extender's verbs on over TLS, when the configuration has `tls`.
    #[arg(long, default_value = "0.0.0.0:8443")]
    pub tls_listen: SocketAddr,
    /// YAML configuration file (weights, policy, limits); see [`Config`].
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Run without a Kubernetes API (filter and prioritize in the `Nodes` form only; for demos).
    #[arg(long)]
    pub without_kube: bool,
}

/// One entry of the typical request mix.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TypicalEntry {
    /// GPU memory on one GPU, MiB.
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// Whole GPUs.
    #[serde(default)]
    pub whole_gpus: Option<u32>,
    /// Share of requests of this kind.
    pub share: f64,
}

/// The default `maxBodyBytes`: 16 MiB. The largest request kube-scheduler sends in the `NodeNames` form
/// is under 4 MiB (15,000 names of 253 bytes, [`extender::MAX_NODES`]); in the `Nodes` form, 16 MiB is
/// 1,000 nodes of 16 KiB (kube-scheduler sends a sample: 500 of 5,000 nodes by default). Measured
/// (`cargo test --release --test scorer_bounds -- --ignored --nocapture peak_memory`: VmHWM of the
/// test process, which holds the scorer and the client's request text; node cache of 5,000 nodes of
/// 8 GPUs: 52 MB): 15,000 unknown names of 253 bytes, filter then prioritize: 103 MB; twelve
/// different `Nodes`-form requests just under 16 MiB (6,585 nodes of 8 GPUs each), filter then
/// prioritize each: 419 MB. With 64 MiB the `Nodes` form alone reached 376 MB in one request, 729 MB
/// in six: the deployed limit is 512 Mi.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// The scorer's configuration (`--config`, YAML, camelCase keys; every key optional).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// The placement policy ranking nodes (as `gpumem simulate --policy`).
    pub policy: String,
    /// Weight of "spread" (room left) against the policy's fragmentation ranking, for online pods.
    pub online_weight: f64,
    /// Weight of "pack" (little room left) against the policy's ranking, for offline pods.
    pub offline_weight: f64,
    /// The online weight when the cluster's GPU memory is more than `hotThreshold` allocated.
    pub hot_online_weight: f64,
    pub hot_threshold: f64,
    /// PriorityClass names whose pods are online (without a `gpumem.io/workload-class`).
    pub online_priority_classes: Vec<String>,
    /// Pods with at least this priority are online.
    pub online_min_priority: Option<i32>,
    /// How long a bind's reservation lasts if the agent never reports the pod.
    pub ledger_ttl_seconds: u64,
    /// Largest request body accepted (see [`DEFAULT_MAX_BODY_BYTES`]).
    pub max_body_bytes: usize,
    /// The kube-scheduler profiles whose pods `bind` binds (a pod's `spec.schedulerName`); a pod of
    /// any other scheduler is refused, so a stray caller cannot make the scorer bind it.
    pub scheduler_names: Vec<String>,
    /// The request mix the fragmentation measure protects.
    pub typical_mix: Vec<TypicalEntry>,
    /// Serve the verbs over TLS to clients with a certificate (`--tls-listen`); see [`TlsFiles`].
    pub tls: Option<TlsFiles>,
}

impl Default for Config {
    fn default() -> Config {
        let mem = |m, share| TypicalEntry {
            memory_mib: Some(m),
            whole_gpus: None,
            share,
        };
        let whole = |c, share| TypicalEntry {
            memory_mib: None,
            whole_gpus: Some(c),
            share,
        };
        Config {
            policy: "gpumem".into(),
            online_weight: 0.7,
            offline_weight: 0.3,
            hot_online_weight: 0.9,
            hot_threshold: 0.8,
            online_priority_classes: Vec::new(),
            online_min_priority: None,
            ledger_ttl_seconds: 120,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            scheduler_names: vec!["default-scheduler".into(), "gpumem-scheduler".into()],
            typical_mix: vec![
                mem(2048, 0.15),
                mem(4096, 0.2),
                mem(8192, 0.2),
                mem(16384, 0.1),
                whole(1, 0.25),
                whole(2, 0.05),
                whole(4, 0.03),
                whole(8, 0.02),
            ],
            tls: None,
        }
    }
}

impl Config {
    pub fn load(path: &std::path::Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let cfg: Config =
            serde_norway::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if crate::alloc::build_policy(
            &self.policy,
            &crate::alloc::Cluster::default(),
            &crate::alloc::TypicalMix::default(),
        )
        .is_none()
        {
            anyhow::bail!(
                "unknown policy {:?} (one of {:?})",
                self.policy,
                crate::alloc::POLICY_NAMES
            );
        }
        for (name, w) in [
            ("onlineWeight", self.online_weight),
            ("offlineWeight", self.offline_weight),
            ("hotOnlineWeight", self.hot_online_weight),
            ("hotThreshold", self.hot_threshold),
        ] {
            if !(0.0..=1.0).contains(&w) {
                anyhow::bail!("{name} is {w}, must be within 0..1");
            }
        }
        if self
            .typical_mix
            .iter()
            .any(|t| t.memory_mib.is_some() == t.whole_gpus.is_some())
        {
            anyhow::bail!("each typicalMix entry needs exactly one of memoryMiB and wholeGpus");
        }
        if self.max_body_bytes == 0 {
            anyhow::bail!("maxBodyBytes is 0");
        }
        if self.scheduler_names.is_empty() {
            anyhow::bail!("schedulerNames is empty: the scorer would bind no pod");
        }
        Ok(())
    }
}

/// One node's victims: the pod objects where known, their UIDs, kube-scheduler's PDB violation count.
type ProposedVictims = (Vec<Option<Arc<Pod>>>, Vec<String>, i64);
/// Victims per node.
type Proposed = BTreeMap<String, ProposedVictims>;

/// A request the scorer cannot work with (HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

/// The extender: configuration, ledger, caches and (optionally) a Kubernetes client.
pub struct Scorer {
    pub config: Config,
    pub ledger: Ledger,
    pub metrics: Metrics,
    nodes: Option<Arc<NodeCache>>,
    pods: Option<Arc<PodCache>>,
    client: Option<Client>,
    rules: ClassRules,
    /// Parsed nodes of `Nodes`-form requests.
    raw_nodes: RawNodeCache,
    /// The policy's view of the cluster, kept between `prioritize` calls.
    policy_cache: decide::PolicyCache,
    /// Without a node cache: the nodes of the last `Nodes`-form call (for the cluster gauges).
    last_nodes: Mutex<Vec<Arc<NodeSnapshot>>>,
    /// When the cluster gauges were last computed.
    gauges_at: Mutex<Option<Instant>>,
    /// What the last few `filter` calls kept (see [`Kept`]).
    kept: Mutex<Vec<Kept>>,
}

/// The nodes a `filter` call kept, in the `NodeNames` form. kube-scheduler sends `prioritize` exactly the
/// names `filter` answered, in that order, right after: `prioritize` takes these states instead of
/// looking every name up again (a cache miss or two per node). They are the states `filter` checked, so
/// both verbs see the same cluster; a few callers at once each find their own.
struct Kept {
    pod_uid: String,
    names: NodeNames,
    states: Vec<Arc<NodeSnapshot>>,
    at: Instant,
}

/// At most this many [`Kept`] are held, each for at most [`KEPT_FOR`].
const KEPT_CALLS: usize = 4;
const KEPT_FOR: Duration = Duration::from_secs(1);

impl Scorer {
    pub fn new(
        config: Config,
        client: Option<Client>,
        nodes: Option<Arc<NodeCache>>,
        pods: Option<Arc<PodCache>>,
    ) -> Scorer {
        let rules = ClassRules {
            online_priority_classes: config.online_priority_classes.clone(),
            online_min_priority: config.online_min_priority,
        };
        // The nodes of the last requests, up to twice the largest request.
        let raw_nodes = RawNodeCache::new(config.max_body_bytes.saturating_mul(2));
        Scorer {
            ledger: Ledger::new(Duration::from_secs(config.ledger_ttl_seconds)),
            config,
            metrics: Metrics::new(),
            nodes,
            pods,
            client,
            rules,
            raw_nodes,
            policy_cache: decide::PolicyCache::default(),
            last_nodes: Mutex::new(Vec::new()),
            gauges_at: Mutex::new(None),
            kept: Mutex::new(Vec::new()),
        }
    }

    /// Lets the caches end ledger reservations the moment they are settled: a node version whose usage
    /// annotation shows the pod, or the pod's deletion.
    pub fn follow_caches(self: &Arc<Self>) {
        if let Some(nodes) = &self.nodes {
            let scorer = Arc::downgrade(self);
            nodes.on_update(move |node| {
                if let Some(scorer) = scorer.upgrade() {
                    scorer.ledger.confirm(node);
                }
            });
        }
        if let Some(pods) = &self.pods {
            let scorer = Arc::downgrade(self);
            pods.on_delete(move |pod| {
                let (Some(scorer), Some(ns), Some(name), Some(node)) = (
                    scorer.upgrade(),
                    pod.metadata.namespace.as_deref(),
                    pod.metadata.name.as_deref(),
                    pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
                ) else {
                    return;
                };
                scorer.ledger.release(node, &format!("{ns}/{name}"));
            });
        }
    }

    /// What has not read its first list from the API server yet (`None`: ready). Before the node and
    /// pod caches sync, every node looks unknown and bound pods uncounted: answering then would refuse
    /// the first pods everywhere, or double-book GPUs.
    pub fn not_synced(&self) -> Option<&'static str> {
        if self.nodes.as_ref().is_some_and(|n| !n.synced().done()) {
            Some("the node cache has not synced with the API server yet")
        } else if self.pods.as_ref().is_some_and(|p| !p.synced().done()) {
            Some("the pod cache has not synced with the API server yet")
        } else {
            None
        }
    }

    /// Waits up to `within` for [`Scorer::not_synced`] to clear; `Err` says what is still missing.
    pub async fn wait_synced(&self, within: Duration) -> Result<(), &'static str> {
        // Every request asks: once synced, answer without a timer or a subscription.
        if self.not_synced().is_none() {
            return Ok(());
        }
        let both = async {
            if let Some(nodes) = &self.nodes {
                nodes.synced().wait().await;
            }
            if let Some(pods) = &self.pods {
                pods.synced().wait().await;
            }
        };
        let _ = tokio::time::timeout(within, both).await;
        self.not_synced().map_or(Ok(()), Err)
    }

    /// Recomputes the cluster gauges (fragmentation, allocated share) if they are older than
    /// [`metrics::GAUGE_PERIOD`]: over the node cache's nodes, or without one over the nodes of the last
    /// `Nodes`-form call; binds in flight (the ledger) count as allocated.
    pub fn refresh_gauges(&self) {
        {
            let mut at = self.gauges_at.lock().unwrap_or_else(|e| e.into_inner());
            if at.is_some_and(|t| t.elapsed() < metrics::GAUGE_PERIOD) {
                return;
            }
            *at = Some(Instant::now());
        }
        let mut states = match &self.nodes {
            Some(cache) => cache.all(),
            None => self.last_nodes.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        };
        self.ledger.apply_arcs(&mut states);
        let refs: Vec<&NodeSnapshot> = states.iter().map(|s| s.as_ref()).collect();
        self.metrics
            .set_fragmentation(&decide::fragmentation(&refs, &self.config));
    }

    fn observe(&self, verb: &'static str, start: Instant) {
        self.metrics
            .latency
            .get_or_create(&VerbLabel { verb })
            .observe(start.elapsed().as_secs_f64());
    }

    fn error(&self, verb: &'static str) {
        self.metrics.errors.get_or_create(&VerbLabel { verb }).inc();
    }

    /// The candidate nodes' states (ledger applied), from the `Nodes` list or from the cache.
    fn candidates(&self, args: &ExtenderArgs) -> Result<Vec<Arc<NodeSnapshot>>, BadRequest> {
        let mut states: Vec<Arc<NodeSnapshot>> = if let Some(list) = &args.nodes {
            let states = self.raw_nodes.states(&list.items);
            if self.nodes.is_none() {
                *self.last_nodes.lock().unwrap_or_else(|e| e.into_inner()) = states.clone();
            }
            states
        } else if let Some(names) = &args.node_names {
            let Some(cache) = &self.nodes else {
                return Err(BadRequest(
                    "NodeNames given but this scorer has no node cache (nodeCacheCapable must be false)"
                        .into(),
                ));
            };
            cache.get_many(names.iter(), |name| {
                Arc::new(NodeSnapshot::broken(
                    name,
                    "node is not (yet) in the scorer's node cache".into(),
                ))
            })
        } else {
            return Err(BadRequest("ExtenderArgs has neither Nodes nor NodeNames".into()));
        };
        self.ledger.apply_arcs(&mut states);
        Ok(states)
    }

    fn demand(&self, pod: Option<&Pod>) -> Result<Result<Option<PodDemand>, String>, BadRequest> {
        let pod = pod.ok_or_else(|| BadRequest("request has no Pod".into()))?;
        Ok(state::pod_demand(pod, &self.rules))
    }

    /// `filter`.
    pub fn filter(&self, mut args: ExtenderArgs) -> Result<ExtenderFilterResult, BadRequest> {
        let start = Instant::now();
        let demand = self.demand(args.pod.as_ref())?;
        let states = self.candidates(&args)?;
        let mut result = ExtenderFilterResult::default();
        let mut keep = vec![true; states.len()];
        let mut reject = |i: usize, r: Rejection, result: &mut ExtenderFilterResult| {
            keep[i] = false;
            self.metrics
                .rejections
                .get_or_create(&ReasonLabel { reason: r.category })
                .inc();
            let name = states[i].name.clone();
            if r.unresolvable {
                result
                    .failed_and_unresolvable_nodes
                    .insert(name.clone(), r.reason.clone());
            }
            result.failed_nodes.insert(name, r.reason);
        };
        match demand {
            Err(reason) => {
                // Once, not per node: the reason may quote the pod's annotations.
                let reason = decide::bounded_reason(reason);
                for i in 0..states.len() {
                    reject(
                        i,
                        Rejection {
                            reason: reason.clone(),
                            category: "bad_pod",
                            unresolvable: true,
                        },
                        &mut result,
                    );
                }
            }
            Ok(None) => {}
            Ok(Some(d)) => {
                for (i, s) in states.iter().enumerate() {
                    if let Err(r) = decide::check(s, &d) {
                        reject(i, r, &mut result);
                    }
                }
            }
        }
        if let Some(list) = args.nodes.take() {
            let items = list
                .items
                .into_iter()
                .zip(&keep)
                .filter(|(_, k)| **k)
                .map(|(n, _)| n)
                .collect();
            result.nodes = Some(NodeList {
                items,
                metadata: if list.metadata.is_null() {
                    serde_json::json!({})
                } else {
                    list.metadata
                },
                ..list
            });
        } else {
            // The request's own names, in its order (the states are in the same order): handed back
            // as they came when every node passes, else the kept ones copied into one buffer.
            let names = args.node_names.take().unwrap_or_default();
            let names = if keep.iter().all(|k| *k) {
                names
            } else {
                names.keep(&keep)
            };
            if let Some(pod_uid) = pod_uid(args.pod.as_ref()) {
                let states = states.into_iter().zip(&keep).filter(|(_, k)| **k).map(|(s, _)| s);
                let kept = Kept {
                    pod_uid,
                    names: names.clone(),
                    states: states.collect(),
                    at: Instant::now(),
                };
                let mut all = self.kept.lock().unwrap_or_else(|e| e.into_inner());
                all.retain(|k| k.pod_uid != kept.pod_uid && k.at.elapsed() < KEPT_FOR);
                if all.len() >= KEPT_CALLS {
                    all.remove(0);
                }
                all.push(kept);
            }
            result.node_names = Some(names);
        }
        self.observe("filter", start);
        Ok(result)
    }

    /// The states the last `filter` of this pod kept, if `args` lists exactly those names (see [`Kept`]).
    fn kept_by_filter(&self, args: &ExtenderArgs) -> Option<Vec<Arc<NodeSnapshot>>> {
        let names = args.node_names.as_ref().filter(|_| args.nodes.is_none())?;
        let pod_uid = pod_uid(args.pod.as_ref())?;
        let mut all = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        let at = all.iter().position(|k| k.pod_uid == pod_uid)?;
        let kept = all.remove(at);
        (kept.names == *names && kept.at.elapsed() < KEPT_FOR).then_some(kept.states)
    }

    /// `prioritize`: every candidate node gets a score; nodes that cannot host the pod get 0.
    pub fn prioritize(&self, mut args: ExtenderArgs) -> Result<HostPriorities, BadRequest> {
        let start = Instant::now();
        let demand = self.demand(args.pod.as_ref())?;
        let states = match self.kept_by_filter(&args) {
            Some(states) => states,
            None => self.candidates(&args)?,
        };
        let mut scores: Vec<i64> = vec![extender::MIN_EXTENDER_PRIORITY; states.len()];
        if let Ok(Some(d)) = demand {
            let ranked = decide::prioritize(&states, &d, &self.config, &self.policy_cache);
            for (score, ranked) in scores.iter_mut().zip(ranked) {
                if let Some(r) = ranked {
                    *score = r.score;
                }
            }
        }
        // Named as `candidates` chose the states: from `Nodes` when given (even if `NodeNames` is
        // too), else the request's own names, in the same order.
        let names = match args.node_names.take() {
            Some(names) if args.nodes.is_none() => names,
            _ => states.iter().map(|s| s.name.as_str()).collect(),
        };
        self.observe("prioritize", start);
        Ok(HostPriorities::new(names, scores))
    }

    /// The GPU state of one node: from the cache, else from the API server.
    async fn node_state(&self, name: &str) -> Result<NodeSnapshot, String> {
        if let Some(s) = self.nodes.as_ref().and_then(|c| c.get(name)) {
            return Ok((*s).clone());
        }
        let client = self
            .client
            .clone()
            .ok_or("this scorer has no Kubernetes client")?;
        let node = Api::<Node>::all(client)
            .get(name)
            .await
            .map_err(|e| format!("reading node {name}: {e}"))?;
        Ok(NodeSnapshot::from_node(&node))
    }

    /// `bind`: choose the GPU(s), reserve them in the ledger, record them on the pod, create the Binding.
    pub async fn bind(&self, args: ExtenderBindingArgs) -> ExtenderBindingResult {
        let start = Instant::now();
        let result = self.bind_inner(&args).await;
        self.metrics.ledger.set(self.ledger.len() as i64);
        self.observe("bind", start);
        match result {
            Ok(()) => ExtenderBindingResult::default(),
            Err(e) => {
                self.error("bind");
                tracing::warn!(
                    "bind {}/{} to {}: {e}",
                    args.pod_namespace,
                    args.pod_name,
                    args.node
                );
                ExtenderBindingResult { error: e }
            }
        }
    }

    /// Binds other replicas made to `node` that its usage annotation does not show yet: pods the pod
    /// cache sees bound there, carrying `gpumem.io/assigned-gpus` from within the ledger's TTL, that
    /// this replica's ledger does not hold. Replicas share no state; this is how one sees the others'
    /// recent binds before the agent reports them.
    fn other_replicas_binds(&self, node: &NodeSnapshot) -> Vec<Reservation> {
        let Some(pods) = &self.pods else { return Vec::new() };
        let ttl = self.config.ledger_ttl_seconds;
        let now = k8s_openapi::jiff::Timestamp::now();
        pods.on_node(&node.name)
            .iter()
            .filter_map(|pod| {
                let uuids = state::assigned_gpus(pod);
                let at: k8s_openapi::jiff::Timestamp = pod
                    .metadata
                    .annotations
                    .as_ref()?
                    .get(ASSIGNED_AT_ANNOTATION)?
                    .parse()
                    .ok()?;
                let age = now.duration_since(at).as_secs();
                let d = state::pod_demand(pod, &self.rules).ok()??;
                let visible = node.gpus().iter().any(|g| g.pods.contains(&d.key));
                if uuids.is_empty()
                    || age < 0
                    || age as u64 >= ttl
                    || visible
                    || self.ledger.holds(&node.name, &d.key)
                {
                    return None;
                }
                let gpus: Vec<(usize, String)> = uuids
                    .iter()
                    .filter_map(|u| {
                        node.gpus()
                            .iter()
                            .position(|g| g.uuid == *u)
                            .map(|p| (p, u.clone()))
                    })
                    .collect();
                let mib = match d.demand {
                    state::Demand::Memory { .. } => Some(d.memory_mib(node.unit_mib)),
                    state::Demand::Whole { .. } => None,
                };
                Some(Reservation {
                    pod: d.key,
                    gpus,
                    mib,
                    at: std::time::Instant::now(),
                })
            })
            .collect()
    }

    /// Refuses to bind what kube-scheduler would never ask this scorer to bind: another incarnation of
    /// the pod, a pod already bound or being deleted, a pod of a scheduler this scorer does not serve.
    fn check_bindable(&self, pod: &Pod, args: &ExtenderBindingArgs, namespace: &str) -> Result<(), String> {
        let name = format!("{namespace}/{}", args.pod_name);
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        if uid != args.pod_uid {
            return Err(format!(
                "pod {name} has UID {uid}, not {} (recreated?)",
                args.pod_uid
            ));
        }
        if pod.metadata.deletion_timestamp.is_some() {
            return Err(format!("pod {name} is being deleted"));
        }
        let spec = pod.spec.as_ref();
        if let Some(bound) = spec
            .and_then(|s| s.node_name.as_deref())
            .filter(|n| !n.is_empty())
        {
            return Err(format!("pod {name} is already bound to {bound}"));
        }
        // The API server defaults an empty schedulerName to default-scheduler.
        let scheduler = spec
            .and_then(|s| s.scheduler_name.as_deref())
            .filter(|n| !n.is_empty())
            .unwrap_or("default-scheduler");
        if !self.config.scheduler_names.iter().any(|s| s == scheduler) {
            return Err(format!(
                "pod {name} belongs to scheduler {scheduler:?}, not one of {:?} (schedulerNames)",
                self.config.scheduler_names
            ));
        }
        Ok(())
    }

    async fn bind_inner(&self, args: &ExtenderBindingArgs) -> Result<(), String> {
        let client = self
            .client
            .clone()
            .ok_or("this scorer has no Kubernetes client")?;
        let namespace = check_binding_args(args)?;
        let pods: Api<Pod> = Api::namespaced(client, namespace);
        let pod = pods
            .get(&args.pod_name)
            .await
            .map_err(|e| format!("reading pod {namespace}/{}: {e}", args.pod_name))?;
        self.check_bindable(&pod, args, namespace)?;
        let demand = state::pod_demand(&pod, &self.rules)?;
        let mut reserved: Option<Reservation> = None;
        if let Some(d) = &demand {
            let mut node = self.node_state(&args.node).await?;
            for r in self.other_replicas_binds(&node) {
                ledger::subtract(&mut node, &r);
            }
            let (config, cache) = (&self.config, &self.policy_cache);
            let r = self.ledger.reserve(&mut node, |n| {
                decide::check(n, d).map_err(|r| format!("node {}: {}", n.name, r.reason))?;
                // The view prioritize used: the GPU(s) its score was for.
                let scored = decide::prioritize(&[Arc::new(n.clone())], d, config, cache);
                let gpus = scored
                    .into_iter()
                    .flatten()
                    .next()
                    .map(|s| s.gpus)
                    .unwrap_or_default();
                if gpus.is_empty() {
                    return Err(format!("node {}: no GPU chosen", n.name));
                }
                Ok(Reservation {
                    pod: d.key.clone(),
                    gpus: gpus.iter().map(|p| (p, n.gpus()[p].uuid.clone())).collect(),
                    mib: match d.demand {
                        state::Demand::Memory { .. } => Some(d.memory_mib(n.unit_mib)),
                        state::Demand::Whole { .. } => None,
                    },
                    at: Instant::now(),
                })
            })?;
            reserved = Some(r);
        }
        let outcome = async {
            if let Some(r) = &reserved {
                let uuids: Vec<&str> = r.gpus.iter().map(|(_, u)| u.as_str()).collect();
                let now = k8s_openapi::jiff::Timestamp::now().to_string();
                let patch = serde_json::json!({"metadata": {"annotations": {
                    ASSIGNED_GPUS_ANNOTATION: uuids.join(","),
                    ASSIGNED_AT_ANNOTATION: now,
                }}});
                pods.patch(&args.pod_name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(|e| format!("recording the GPU choice on the pod: {e}"))?;
            }
            let binding = Binding {
                metadata: ObjectMeta {
                    name: Some(args.pod_name.clone()),
                    namespace: Some(namespace.to_string()),
                    uid: pod.metadata.uid.clone(),
                    ..ObjectMeta::default()
                },
                target: ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Node".into()),
                    name: Some(args.node.clone()),
                    ..ObjectReference::default()
                },
            };
            pods.create_subresource::<_, serde_json::Value>(
                "binding",
                &args.pod_name,
                &PostParams::default(),
                &binding,
            )
            .await
            .map_err(|e| format!("creating the binding: {e}"))?;
            Ok::<(), String>(())
        }
        .await;
        if outcome.is_err()
            && let Some(r) = &reserved
        {
            self.ledger.release(&args.node, &r.pod);
        }
        outcome
    }

    /// `preempt`: per node, the victims that free room for the pod's GPUs (nodes where that cannot be
    /// done from preemptible pods are dropped). The node states and PodDisruptionBudgets are read here;
    /// the victims are chosen on tokio's blocking pool, off the async workers.
    pub async fn preempt(
        self: &Arc<Self>,
        args: ExtenderPreemptionArgs,
    ) -> Result<ExtenderPreemptionResult, BadRequest> {
        let start = Instant::now();
        let demand = self.demand(args.pod.as_ref())?;
        // Victims per node as (pod objects when known, UIDs, kube-scheduler's PDB count).
        let mut proposed: Proposed = BTreeMap::new();
        if let Some(map) = args.node_name_to_victims {
            for (node, v) in map {
                let v = v.unwrap_or_default();
                let uids = v
                    .pods
                    .iter()
                    .map(|p| p.metadata.uid.clone().unwrap_or_default())
                    .collect();
                let pods = v.pods.into_iter().map(|p| Some(Arc::new(p))).collect();
                proposed.insert(node, (pods, uids, v.num_pdb_violations));
            }
        } else if let Some(map) = args.node_name_to_meta_victims {
            let wanted: HashSet<&str> = map
                .values()
                .flatten()
                .flat_map(|v| v.pods.iter().map(|p| p.uid.as_str()))
                .collect();
            let known = match &self.pods {
                Some(cache) => cache.by_uids(&wanted),
                None => HashMap::new(),
            };
            for (node, v) in map {
                let v = v.unwrap_or_default();
                let uids: Vec<String> = v.pods.into_iter().map(|p| p.uid).collect();
                let pods = uids.iter().map(|u| known.get(u).cloned()).collect();
                proposed.insert(node, (pods, uids, v.num_pdb_violations));
            }
        }
        let mut result = ExtenderPreemptionResult::default();
        let d = match demand {
            Ok(Some(d)) => d,
            // Not a GPU pod (or one the filter refuses anyway): the GPU side has nothing to say.
            Ok(None) | Err(_) => {
                for (node, (_, uids, pdb)) in proposed {
                    let pods = uids.into_iter().map(|uid| MetaPod { uid }).collect();
                    result.node_name_to_meta_victims.insert(
                        node,
                        MetaVictims {
                            pods,
                            num_pdb_violations: pdb,
                        },
                    );
                }
                self.observe("preempt", start);
                return Ok(result);
            }
        };
        let pdbs = self.pdbs(&proposed).await;
        let mut nodes = Vec::with_capacity(proposed.len());
        for (node_name, victims) in proposed {
            match self.node_state(&node_name).await {
                Ok(node) => nodes.push((node_name, node, victims)),
                Err(e) => tracing::warn!("preempt: {e}"),
            }
        }
        let scorer = self.clone();
        let chosen = tokio::task::spawn_blocking(move || scorer.choose_victims(&d, nodes, pdbs.as_deref()))
            .await
            .map_err(|e| {
                tracing::error!("preempt: choosing the victims failed: {e}");
                BadRequest(format!("choosing the victims failed: {e}"))
            })?;
        self.observe("preempt", start);
        Ok(chosen)
    }

    /// The victims to keep on each node (see [`preempt::select_victims`]).
    fn choose_victims(
        &self,
        d: &PodDemand,
        nodes: Vec<(String, NodeSnapshot, ProposedVictims)>,
        pdbs: Option<&[PodDisruptionBudget]>,
    ) -> ExtenderPreemptionResult {
        let mut result = ExtenderPreemptionResult::default();
        for (node_name, mut node, (pods, uids, num_pdb)) in nodes {
            self.ledger.apply(&mut node);
            if pods.iter().any(Option::is_none) {
                tracing::warn!("preempt: a victim on {node_name} is unknown to the scorer; node skipped");
                continue;
            }
            let pods: Vec<&Pod> = pods.iter().flatten().map(|p| p.as_ref()).collect();
            let mut victims: Vec<VictimInfo> = pods.iter().map(|p| VictimInfo::from_pod(p, &node)).collect();
            if let Some(pdbs) = pdbs {
                preempt::mark_pdb_violations(&mut victims, &pods, pdbs);
            }
            if let Some((keep, violations)) = preempt::select_victims(&node, d, &victims, num_pdb) {
                result.node_name_to_meta_victims.insert(
                    node_name,
                    MetaVictims {
                        pods: keep
                            .into_iter()
                            .map(|v| MetaPod { uid: uids[v].clone() })
                            .collect(),
                        num_pdb_violations: violations,
                    },
                );
            }
        }
        result
    }

    /// The PodDisruptionBudgets of the victims' namespaces; `None` if they cannot be read.
    async fn pdbs(&self, proposed: &Proposed) -> Option<Vec<PodDisruptionBudget>> {
        let client = self.client.clone()?;
        let mut namespaces: Vec<String> = proposed
            .values()
            .flat_map(|(pods, _, _)| pods.iter().flatten())
            .filter_map(|p| p.metadata.namespace.clone())
            .collect();
        namespaces.sort();
        namespaces.dedup();
        let mut all = Vec::new();
        for ns in namespaces {
            match Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns)
                .list(&ListParams::default())
                .await
            {
                Ok(list) => all.extend(list.items),
                Err(e) => {
                    tracing::warn!("preempt: listing PodDisruptionBudgets in {ns}: {e}");
                    return None;
                }
            }
        }
        Some(all)
    }
}

/// The pod's UID, if it has one.
fn pod_uid(pod: Option<&Pod>) -> Option<String> {
    pod?.metadata.uid.clone().filter(|u| !u.is_empty())
}

/// What `bind` needs before it touches the API server: the names kube-scheduler sends are valid
/// Kubernetes names (so none can reach another API path), and the UID it always sends is there.
/// Returns the namespace.
fn check_binding_args(args: &ExtenderBindingArgs) -> Result<&str, String> {
    if args.pod_name.is_empty() || args.node.is_empty() || args.pod_uid.is_empty() {
        return Err("bind needs PodName, PodUID and Node".into());
    }
    let namespace = if args.pod_namespace.is_empty() {
        "default"
    } else {
        args.pod_namespace.as_str()
    };
    crate::names::check_label(namespace).map_err(|e| format!("PodNamespace: {e}"))?;
    crate::names::check_subdomain(&args.pod_name).map_err(|e| format!("PodName: {e}"))?;
    crate::names::check_subdomain(&args.node).map_err(|e| format!("Node: {e}"))?;
    Ok(namespace)
}

/// `gpumem scorer`.
pub fn run(args: &ScorerArgs) -> anyhow::Result<()> {
    let config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    // Before anything starts: a scorer that cannot authenticate its clients must not serve.
    let tls = match &config.tls {
        Some(files) => Some(Arc::new(
            crate::tls::TlsServer::new(files.clone()).context("tls")?,
        )),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let (client, nodes, pods) = if args.without_kube {
            (None, None, None)
        } else {
            let client = Client::try_default()
                .await
                .context("connecting to the Kubernetes API (use --without-kube for a demo)")?;
            let nodes = NodeCache::start(client.clone());
            let pods = PodCache::start(client.clone());
            (Some(client), Some(nodes), Some(pods))
        };
        let scorer = Arc::new(Scorer::new(config, client, nodes, pods));
        scorer.follow_caches();
        let limits = crate::http::Limits::default();
        let bind = |addr: SocketAddr| async move {
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("listening on {addr}"))
        };
        let plain = bind(args.listen).await?;
        let (plain_port, verbs) = match tls {
            Some(tls) => {
                let listener = bind(args.tls_listen).await?;
                tracing::info!(
                    "gpumem scorer: extender verbs over TLS on {} (client certificates from {}), probes and metrics on {}",
                    args.tls_listen,
                    tls.client_ca_file().display(),
                    args.listen
                );
                let serving = server::serve(listener, scorer.clone(), limits, server::Port::Tls(tls), pending());
                (server::Port::Probes, Some(serving))
            }
            None => {
                tracing::warn!(
                    "gpumem scorer listening on {} in plain HTTP: anyone who reaches it can make the scorer bind \
                     pods; configure `tls` (docs/operate.md, \"Security\")",
                    args.listen
                );
                (server::Port::Open, None)
            }
        };
        let verbs = async move {
            match verbs {
                Some(serving) => serving.await,
                None => pending().await,
            }
        };
        // SIGTERM is how Kubernetes stops a pod; as PID 1 of its image the scorer gets no default handler.
        let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        // Dropping the servers stops the accepting; connections in progress finish on their own tasks.
        tokio::select! {
            () = server::serve(plain, scorer, limits, plain_port, pending()) => {}
            () = verbs => {}
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupted: stopping"),
            _ = terminate.recv() => tracing::info!("SIGTERM: stopping"),
        }
        Ok(())
    })
}
