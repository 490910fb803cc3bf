//! `gpumem scorer`: the kube-scheduler extender (filter, prioritize, bind, preempt over HTTP). This
//! file holds [`Scorer`], what every verb shares (configuration, caches, ledger, metrics, the view);
//! each verb has its own file.
//!
//! - [`cli`]: the command line and the server's run loop;
//! - [`config`]: the configuration file;
//! - [`extender`]: the protocol's wire types;
//! - [`state`]: node GPU state from the agent's annotations, and pod requests;
//! - [`decide`]: filter and ranking, pure, through the shared placement policy ([`crate::alloc`]);
//! - `filter`, [`bind`], `preempt`: the verbs (each in a tracing span naming the pod);
//! - [`ledger`]: binds in flight, so that concurrent decisions never double-book a GPU;
//! - [`holds`]: GPUs ranked first for a pod until its bind comes, so the next pods rank around them;
//! - [`bookings`]: binds in flight that every replica sees, so that replicas never double-book one;
//! - [`victims`]: GPU-aware victim selection, pure;
//! - [`workload`]: the typical mix learned from the pods the scorer ranks;
//! - [`cache`]: reflector-fed node and pod caches (`nodeCacheCapable: true`);
//! - [`server`]: HTTP (hyper + tower), `/healthz`, `/metrics`;
//! - [`metrics`]: Prometheus metrics.

pub mod bind;
pub mod bookings;
pub mod cache;
pub mod cli;
pub mod config;
pub mod decide;
pub mod extender;
mod filter;
pub mod holds;
pub mod ledger;
pub mod metrics;
pub mod pods;
mod preempt;
pub mod server;
pub mod state;
pub mod victims;
pub mod workload;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Client;

use self::cache::{NodeCache, RawNodeCache};
use self::config::ScorerConfig;
use self::extender::{ExtenderArgs, NodeNames};
use self::ledger::Ledger;
use self::metrics::{Metrics, VerbLabel};
use self::pods::{PodCache, PodRecord};
use self::state::{ClassRules, NodeSnapshot, PodDemand};
use crate::affinity::NodeSelection;
use crate::alloc;

/// A request the scorer cannot work with (HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

/// The extender: configuration, ledger, caches and (optionally) a Kubernetes client.
pub struct Scorer {
    pub config: ScorerConfig,
    pub ledger: Ledger,
    /// GPUs `prioritize` ranked first, until each pod's bind.
    holds: holds::GpuHolds,
    pub metrics: Metrics,
    nodes: Option<Arc<NodeCache>>,
    pods: Option<Arc<PodCache>>,
    client: Option<Client>,
    rules: ClassRules,
    /// Parsed nodes of `Nodes`-form requests.
    raw_nodes: RawNodeCache,
    /// The policy's view of the cluster, kept between `prioritize` calls.
    policy_cache: decide::PolicyCache,
    /// The pods seen so far, and the typical mix learned from them.
    pub workload: workload::Workload,
    /// Without a node cache: the nodes of the last `Nodes`-form call (for the cluster gauges).
    last_nodes: Mutex<Vec<Arc<NodeSnapshot>>>,
    /// When the cluster gauges were last computed.
    gauges_at: Mutex<Option<Instant>>,
    /// What the last few `filter` calls kept (see [`Kept`]).
    kept: Mutex<Vec<Kept>>,
    /// The requests of the pods `filter` saw, for their `bind`.
    filtered: bind::Filtered,
    /// The pods whose bind is running (one at a time per pod).
    binding: bind::BindsRunning,
    /// The bookings replicas share (`sharedBookings`, with a client).
    board: Option<bookings::Board>,
}

/// The namespace the scorer runs in (`POD_NAMESPACE`, from the downward API), where its Leases live.
pub fn own_namespace() -> String {
    std::env::var("POD_NAMESPACE")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "gpumem-system".into())
}

/// The nodes a `filter` call kept, in the `NodeNames` form. kube-scheduler sends `prioritize` exactly the
/// names `filter` answered, in that order, right after: `prioritize` takes these states instead of
/// looking every name up again (a cache miss or two per node). They are the states `filter` checked, so
/// both verbs see the same cluster; a few callers at once each find their own.
struct Kept {
    pod_uid: String,
    names: NodeNames,
    states: Vec<Arc<NodeSnapshot>>,
    /// Their scores, where `filter` ranked the candidates to shortlist them.
    scores: Option<Vec<i64>>,
    /// What the pod would hold on the node ranked first, where `filter` ranked them.
    best: Option<(String, ledger::Reservation)>,
    at: Instant,
}

/// At most this many [`Kept`] are held, each for at most [`KEPT_FOR`].
const KEPT_CALLS: usize = 4;
const KEPT_FOR: Duration = Duration::from_secs(1);

impl Scorer {
    pub fn new(
        config: ScorerConfig,
        client: Option<Client>,
        nodes: Option<Arc<NodeCache>>,
        pods: Option<Arc<PodCache>>,
    ) -> Scorer {
        let workload = workload::Workload::new(&config);
        let rules = ClassRules {
            online_priority_classes: config.online_priority_classes.clone(),
            online_min_priority: config.online_min_priority,
        };
        // The nodes of the last requests, up to twice the largest request.
        let raw_nodes = RawNodeCache::new(config.max_body_bytes.saturating_mul(2));
        let board = client
            .clone()
            .filter(|_| config.shared_bookings)
            .map(|c| bookings::Board::new(c, &own_namespace()));
        Scorer {
            board,
            ledger: Ledger::new(Duration::from_secs(config.ledger_ttl_seconds)),
            holds: holds::GpuHolds::default(),
            config,
            metrics: Metrics::new(),
            nodes,
            pods,
            client,
            rules,
            raw_nodes,
            policy_cache: decide::PolicyCache::default(),
            workload,
            last_nodes: Mutex::new(Vec::new()),
            gauges_at: Mutex::new(None),
            kept: Mutex::new(Vec::new()),
            filtered: bind::Filtered::default(),
            binding: bind::BindsRunning::default(),
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
                if let Some(scorer) = scorer.upgrade() {
                    scorer.ledger.release(&pod.node, &pod.key);
                    scorer.holds.release(&pod.uid);
                }
            });
        }
        if let (Some(nodes), Some(pods)) = (self.nodes.clone(), self.pods.clone()) {
            let scorer = Arc::downgrade(self);
            tokio::spawn(async move {
                nodes.synced().wait().await;
                pods.synced().wait().await;
                if let Some(scorer) = scorer.upgrade() {
                    scorer.learn_from_bound_pods(&nodes, &pods);
                }
            });
        }
    }

    /// Counts the GPU pods already bound into the learned mix, oldest bind first: a restarted scorer
    /// goes on from the cluster's workload, not from the prior.
    fn learn_from_bound_pods(&self, nodes: &NodeCache, pods: &PodCache) {
        let before = self.workload.seen();
        for pod in pods.all() {
            let (Some(demand), Some(node)) = (pod.demand, nodes.get(&pod.node)) else {
                continue;
            };
            let need_mib = pod.memory_mib(node.unit_mib).unwrap_or(0);
            let request = decide::request(
                demand,
                need_mib,
                pod.requests.cpu_milli,
                pod.requests.memory_bytes.div_ceil(1 << 20),
            );
            self.workload.observe_request(&pod.uid, &request);
        }
        tracing::info!(
            pods = self.workload.seen() - before,
            "learned mix: counted the GPU pods bound in the cluster"
        );
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
        let mix = self.workload.current();
        self.metrics
            .set_fragmentation(&decide::fragmentation(&refs, &mix.mix));
        self.metrics
            .mix_pods_seen
            .set(i64::try_from(self.workload.seen()).unwrap_or(i64::MAX));
        self.metrics
            .mix_generation
            .set(i64::try_from(mix.generation).unwrap_or(i64::MAX));
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
        // Other pods' holds: GPUs ranked first for pods whose binds are on their way.
        let uid = pod_uid(args.pod.as_ref()).unwrap_or_default();
        self.holds.apply_arcs(&mut states, &uid);
        // Also the other replicas' binds that the annotation does not show yet, as bind counts them:
        // without them filter passes a node whose room another replica has just taken, and
        // kube-scheduler's bind fails there, again for each pod, until the agent's next report.
        for s in states.iter_mut() {
            let seen = self.other_replicas_binds(s);
            if !seen.is_empty() {
                let node = Arc::make_mut(s);
                for r in &seen {
                    ledger::subtract(node, r);
                }
            }
        }
        Ok(states)
    }

    /// A span for one extender call: the verb and the pod it is about.
    /// Its fields are borrowed: a call costs no allocation when the span is not recorded.
    fn span(&self, verb: &'static str, pod: Option<&Pod>) -> tracing::Span {
        let meta = pod.map(|p| &p.metadata);
        let namespace = meta.and_then(|m| m.namespace.as_deref()).unwrap_or("");
        let name = meta.and_then(|m| m.name.as_deref()).unwrap_or("");
        tracing::debug_span!("extender", verb, namespace, pod = name)
    }

    fn demand(&self, pod: Option<&Pod>) -> Result<Result<Option<PodDemand>, String>, BadRequest> {
        let pod = pod.ok_or_else(|| BadRequest("request has no Pod".into()))?;
        Ok(state::pod_demand(pod, &self.rules))
    }
}

/// What the DRA placer (`src/placer/`) uses of the scorer: the node states, the reading of a pod's
/// class and the ranking (the same as the extender's), what each node's pods request, and the metrics.
impl Scorer {
    /// The GPU state of node `name` as the agent reports it.
    pub fn node_report(&self, name: &str) -> Option<Arc<NodeSnapshot>> {
        self.nodes.as_ref()?.get(name)
    }

    /// `pod`'s request for a GPU `demand`, with what its labels, annotations and priority add.
    pub fn demand_of(&self, pod: &Pod, demand: state::Demand) -> Result<PodDemand, String> {
        let (cpu, memory) = state::cpu_memory_requests(pod);
        state::demand_of(pod, &self.rules, demand, cpu, memory)
    }

    /// Counts `pod`, asking `need_mib` of one GPU where it is a memory pod, into the learned mix (once
    /// per UID), with the models it is restricted to: the policy's scarcity term keeps a model that
    /// such pods depend on for them, rather than filling it with pods that could run anywhere.
    /// Without a list of models, the pod is restricted to the models of the nodes its node selection
    /// admits (a `nvidia.com/gpu.product` selector, a `nvidia.com/gpu.memory` affinity), read from
    /// the node cache once per pod.
    pub fn learn(&self, pod: &PodDemand, need_mib: u64) {
        if self.workload.counted(&pod.uid) {
            return;
        }
        let models = match (&pod.models, &pod.selection) {
            (Some(_), _) => self.policy_cache.model_set(|m| pod.allows_model(m)),
            (None, Some(selection)) => self.models_admitted(selection),
            (None, None) => None,
        };
        self.workload.observe(pod, need_mib, models);
    }

    /// The models of the GPUs on the nodes `selection` admits (`None`: every model, or no node cache).
    fn models_admitted(&self, selection: &NodeSelection) -> Option<alloc::ModelSet> {
        let nodes = self.nodes.as_ref()?;
        let mut models = std::collections::HashSet::new();
        for node in nodes.all() {
            if selection.admits(&node.name, &node.labels) {
                models.extend(node.gpus().iter().map(|g| g.model.to_ascii_lowercase()));
            }
        }
        self.policy_cache
            .model_set(|m| models.contains(&m.to_ascii_lowercase()))
    }

    /// The extender's ranking of `nodes` for `pod` (`None`: it does not fit there).
    pub fn rank(&self, nodes: &[Arc<NodeSnapshot>], pod: &PodDemand) -> Vec<Option<decide::Scored>> {
        let mix = self.workload.current();
        decide::prioritize(nodes, pod, &self.config, &self.policy_cache, &mix)
    }

    /// What the pods bound to `node` request, as kube-scheduler counts it (succeeded and failed pods
    /// not counted). `None` without a pod cache.
    pub fn requested_on(&self, node: &str) -> Option<crate::requests::Resources> {
        let pods = self.pods.as_ref()?;
        Some(pods.with_node(node, |records| {
            records.iter().filter(|r| !r.terminal).map(|r| r.requests).sum()
        }))
    }

    /// The pods bound to `node` that may be preempted for a pod of `priority`: marked preemptible, of
    /// lower priority, not ended (none without a pod cache); each with whether it is of the offline class.
    pub fn preemptible_on(&self, node: &str, priority: i32) -> Vec<(Arc<PodRecord>, bool)> {
        let Some(pods) = self.pods.as_ref() else {
            return Vec::new();
        };
        pods.with_node(node, |records| {
            records
                .iter()
                .filter(|r| r.preemptible && r.priority < priority && !r.terminal)
                .map(|r| {
                    (
                        Arc::clone(r),
                        r.class(&self.rules) == state::WorkloadClass::Offline,
                    )
                })
                .collect()
        })
    }

    /// One decision of the DRA placer made (whatever it decided): the part of placing that is one
    /// pod at a time.
    pub fn decided_on_dra(&self, started: Instant) {
        self.observe("dra_decide", started);
    }

    /// Counts a pod the placer placed, `started` when it began deciding.
    pub fn placed_on_dra(&self, started: Instant) {
        self.metrics.dra_placed.inc();
        self.observe("dra_place", started);
    }
}

/// The pod's UID, if it has one.
fn pod_uid(pod: Option<&Pod>) -> Option<String> {
    pod?.metadata.uid.clone().filter(|u| !u.is_empty())
}
