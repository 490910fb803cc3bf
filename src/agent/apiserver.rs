//! The agent and the API server: it publishes its Node's GPU picture (labels and annotations, by
//! server-side apply with its own field manager, only on its own Node), reads the GPU the scorer chose
//! for pods bound here, and reports problems as events on its Node. Nothing here is needed to hand
//! out devices: when the API server is away, the agent keeps serving and catches up later.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};

use super::enforcement::Enforcement;
use super::restart::Fence;
use super::share::container_units;
use super::state::NodeState;
use crate::node::{
    self, AGENT_RESTARTING_ANNOTATION, ASSIGNED_AT_ANNOTATION, ASSIGNED_GPUS_ANNOTATION, ROOM_FREED_LABEL,
    TopologyAnnotation, USED_ANNOTATION, UsageAnnotation, UsedAnnotation,
};
use crate::quantity::Quantity;

/// The field manager of everything the agent writes: it owns these labels and annotations, and
/// nothing else on the Node.
pub const FIELD_MANAGER: &str = "gpumem-agent";
/// The field manager of [`USED_ANNOTATION`]: written on its own clock, it must not take the other
/// annotations out of [`FIELD_MANAGER`]'s applies (server-side apply removes what a manager's apply omits).
pub const USED_FIELD_MANAGER: &str = "gpumem-agent-used";
/// How often the accounting is read for [`USED_ANNOTATION`].
const USED_SAMPLE: Duration = Duration::from_secs(1);
/// At most one write per this interval, so a burst of pod changes becomes one update.
const MIN_INTERVAL: Duration = Duration::from_millis(500);
/// Written again after this long even without a change (someone may have edited it by hand).
const RESYNC: Duration = Duration::from_secs(300);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Between writing annotations that show more room and changing [`ROOM_FREED_LABEL`]: the scorers' node
/// caches (watches of the same Node) see the room before kube-scheduler, woken by the label, asks them.
const ROOM_LABEL_DELAY: Duration = Duration::from_millis(300);
/// How often the pods of the node are checked for memory asked without a share (`memCounting: shares`).
const SHARELESS_CHECK: Duration = Duration::from_secs(30);
/// How often the Node's memory capacity is checked (`memCounting: shares`).
const CAPACITY_CHECK: Duration = Duration::from_secs(30);
/// An API call made while a pod is being admitted may take this long.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);

pub struct ApiServer {
    client: Client,
    node: String,
    recorder: Recorder,
}

impl ApiServer {
    /// A client from the in-cluster service account or KUBECONFIG.
    pub async fn connect(node: String) -> anyhow::Result<Self> {
        let client = Client::try_default().await?;
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance: Some(node.clone()),
        };
        let recorder = Recorder::new(client.clone(), reporter);
        Ok(Self {
            client,
            node,
            recorder,
        })
    }

    /// This Node; None when it cannot be read.
    pub async fn node(&self) -> Option<Node> {
        let api = Api::<Node>::all(self.client.clone());
        match tokio::time::timeout(LOOKUP_TIMEOUT * 5, api.get(&self.node)).await {
            Ok(Ok(node)) => Some(node),
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "cannot read the Node");
                None
            }
            Err(_) => {
                tracing::warn!("the API server did not answer for the Node");
                None
            }
        }
    }

    /// The client, for the DRA driver's calls.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    fn node_ref(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.node.clone()),
            // Events about Nodes are conventionally recorded with the node name as UID.
            uid: Some(self.node.clone()),
            ..Default::default()
        }
    }

    /// Sets one condition of the Node's status (`kubectl describe node` lists it), leaving the others:
    /// a strategic merge on the condition's type, as node-problem-detector writes its own.
    pub async fn set_condition(&self, type_: &str, status: bool, reason: &str, message: String) {
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let patch = serde_json::json!({ "status": { "conditions": [{
            "type": type_,
            "status": if status { "True" } else { "False" },
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }]}});
        if let Err(err) = Api::<Node>::all(self.client.clone())
            .patch_status(&self.node, &PatchParams::default(), &Patch::Strategic(&patch))
            .await
        {
            tracing::warn!(error = %err, condition = type_, "cannot set a condition on the Node");
        }
    }

    /// `memCounting: shares`: keeps the Node's memory resource (capacity and allocatable, as the kubelet
    /// makes a patched extended resource's allocatable its capacity) at the healthy GPUs' units. The
    /// kubelet admits by it; it keeps a value written so, and zeroes it only when the node is
    /// registered anew, which the check every [`CAPACITY_CHECK`] mends.
    pub async fn publish_capacity(self: Arc<Self>, state: Arc<NodeState>) {
        let resource = state.mem_resource.clone();
        let mut changes = state.subscribe();
        let mut written: Option<u64> = None;
        let mut check = true;
        let mut backoff = Duration::from_secs(1);
        loop {
            let want = state.healthy_units();
            if check || written != Some(want) {
                match self.write_capacity(&resource, want).await {
                    Ok(changed) => {
                        if changed {
                            tracing::info!(%resource, units = want, "the Node's capacity set");
                        }
                        written = Some(want);
                        check = false;
                        backoff = Duration::from_secs(1);
                    }
                    Err(err) => {
                        tracing::warn!(error = %format!("{err:#}"), %resource, retry_in = ?backoff, "cannot set the Node's capacity");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        continue;
                    }
                }
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(CAPACITY_CHECK) => check = true,
            }
        }
    }

    /// Sets `resource` to `units` in the Node's capacity and allocatable unless both say so already;
    /// whether it wrote.
    async fn write_capacity(&self, resource: &str, units: u64) -> anyhow::Result<bool> {
        let nodes = Api::<Node>::all(self.client.clone());
        let node = nodes.get(&self.node).await?;
        let status = node.status.unwrap_or_default();
        let says =
            |list: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
                list.and_then(|l| l.get(resource))
                    .and_then(|q| Quantity::parse(&q.0).and_then(|q| q.whole()).ok())
            };
        if says(status.capacity.as_ref()) == Some(units) && says(status.allocatable.as_ref()) == Some(units) {
            return Ok(false);
        }
        let patch = serde_json::json!({ "status": {
            "capacity": { resource: units.to_string() },
            "allocatable": { resource: units.to_string() },
        }});
        nodes
            .patch_status(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(true)
    }

    /// Takes `resource` out of the Node's capacity and allocatable if it is there: on the DRA path a
    /// memory total left from `memCounting: shares` would offer kube-scheduler memory no plugin serves.
    pub async fn remove_capacity(&self, resource: &str) {
        let nodes = Api::<Node>::all(self.client.clone());
        let has = |node: &Node| {
            let status = node.status.as_ref();
            let listed = |l: Option<&BTreeMap<String, _>>| l.is_some_and(|l| l.contains_key(resource));
            listed(status.and_then(|s| s.capacity.as_ref()))
                || listed(status.and_then(|s| s.allocatable.as_ref()))
        };
        match nodes.get(&self.node).await {
            Ok(node) if has(&node) => {
                let patch = serde_json::json!({ "status": {
                    "capacity": { resource: null },
                    "allocatable": { resource: null },
                }});
                match nodes
                    .patch_status(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => tracing::info!(%resource, "removed from the Node's capacity"),
                    Err(err) => {
                        tracing::warn!(error = %err, %resource, "cannot remove from the Node's capacity")
                    }
                }
            }
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %err, "cannot read the Node"),
        }
    }

    /// `memCounting: shares`: learns the size of the shares the kubelet lists that this agent did not
    /// allocate (after its restart) from their pods' specs, every `every`; and, every
    /// [`SHARELESS_CHECK`], warns on the Node of each pod here with a container that asks memory but
    /// no share (admitted without the chart's admission policy: it runs with no GPU chosen for it and
    /// no limit).
    pub async fn watch_shares(self: Arc<Self>, state: Arc<NodeState>, every: Duration) {
        let Some(share) = state.shares.as_ref().map(|s| s.resource.clone()) else {
            return;
        };
        let mem = state.mem_resource.clone();
        let mut warned = std::collections::BTreeSet::new();
        let mut last_check: Option<tokio::time::Instant> = None;
        loop {
            let unknown = state.unsized_shares();
            let check = last_check.is_none_or(|at| at.elapsed() >= SHARELESS_CHECK);
            if !unknown.is_empty() || check {
                match self.pods_on_node().await {
                    Ok(pods) => {
                        for (id, owner, container) in unknown {
                            match super::share::asked_units(&pods, &owner, &container, &mem) {
                                Some(units) => state.size_share(&id, &owner, &container, units),
                                None => {
                                    tracing::debug!(%id, %owner, %container, "a share's pod does not say its size yet")
                                }
                            }
                        }
                        if check {
                            last_check = Some(tokio::time::Instant::now());
                            for pod in super::share::without_share(&pods, &share, &mem) {
                                if warned.insert(pod.clone()) {
                                    let note = format!(
                                        "pod {pod} asks {mem} without {share}: it was admitted without the \
                                         admission policy that adds the share (chart: agent.memCounting, \
                                         kustomize: components/gpu-share), so it runs with no GPU chosen for \
                                         it and no memory limit"
                                    );
                                    tracing::warn!("{note}");
                                    self.warn("GpuMemWithoutShare", note).await;
                                }
                            }
                        }
                    }
                    Err(err) => {
                        tracing::debug!(error = %format!("{err:#}"), "shares of unknown size stay counted whole")
                    }
                }
            }
            tokio::time::sleep(every).await;
        }
    }

    /// A warning on the Node (`kubectl describe node` shows it).
    pub async fn warn(&self, reason: &str, note: String) {
        let event = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(note),
            action: "Advertise".into(),
            secondary: None,
        };
        if let Err(err) = self.recorder.publish(&event, &self.node_ref()).await {
            tracing::warn!(error = %err, reason, "cannot record an event on the Node");
        }
    }

    async fn apply(
        &self,
        labels: &BTreeMap<String, String>,
        annotations: &BTreeMap<String, String>,
    ) -> kube::Result<()> {
        let patch = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": { "name": self.node, "labels": labels, "annotations": annotations },
        });
        Api::<Node>::all(self.client.clone())
            .patch(
                &self.node,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
            .map(drop)
    }

    /// Keeps the Node's labels and annotations equal to the agent's picture and `fence`'s restart mark,
    /// until the process ends.
    pub async fn publish(self: Arc<Self>, state: Arc<NodeState>, fence: Arc<Fence>) {
        let mut labels = node::labels(&state.inventory, state.unit_mib);
        let mut changes = state.subscribe_usage();
        let mut marks = fence.subscribe();
        // What was last written, and the picture it came from (to tell when room grew).
        let mut written: Option<(BTreeMap<String, String>, BTreeMap<String, String>)> = None;
        let mut picture: Option<(TopologyAnnotation, UsageAnnotation)> = None;
        // Room grew and the label has not said so yet.
        let mut announce = false;
        let mut backoff = Duration::from_secs(1);
        // The mark last published: its lifting is room for the pods the scorer refused meanwhile.
        let mut marked = None;
        loop {
            changes.mark_unchanged();
            let mark = *marks.borrow_and_update();
            let topology = TopologyAnnotation::new(&state.inventory, state.unit_mib, |a| state.is_healthy(a));
            let usage = state.usage();
            // At start room may have grown while the agent was away: the first picture counts as grown.
            announce |= picture
                .as_ref()
                .is_none_or(|(t, u)| node::room_grew((t, u), (&topology, &usage)));
            announce |= marked.is_some() && mark.is_none();
            let mut annotations = node::annotations(&topology, &usage);
            if let Some(at) = mark {
                annotations.insert(AGENT_RESTARTING_ANNOTATION.into(), at.to_string());
            }
            marked = mark;
            picture = Some((topology, usage));
            let mut result = Ok(());
            // The new annotations go out under the old label first, and the label a moment later: kube-scheduler
            // retries waiting pods when the label changes, and the scorer's node cache must have the room by then.
            if announce && written.as_ref().is_some_and(|(_, a)| *a != annotations) {
                result = self.apply(&labels, &annotations).await;
                if result.is_ok() {
                    written = Some((labels.clone(), annotations.clone()));
                    tokio::time::sleep(ROOM_LABEL_DELAY).await;
                }
            }
            if announce && result.is_ok() {
                labels.insert(ROOM_FREED_LABEL.into(), unix_millis().to_string());
            }
            if result.is_ok() && written.as_ref().map(|(l, a)| (l, a)) != Some((&labels, &annotations)) {
                result = self.apply(&labels, &annotations).await;
                if result.is_ok() {
                    tracing::debug!(node = %self.node, room_grew = announce, "published GPU labels and annotations");
                    written = Some((labels.clone(), annotations));
                    announce = false;
                }
            }
            if result.is_ok() {
                fence.written(mark);
            }
            if let Err(err) = result {
                tracing::warn!(node = %self.node, error = %err, retry_in = ?backoff, "cannot update the Node");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
            backoff = Duration::from_secs(1);
            // A stopping agent's mark goes out at once; other changes at most every MIN_INTERVAL.
            tokio::select! {
                () = tokio::time::sleep(MIN_INTERVAL) => {}
                _ = marks.changed() => continue,
            }
            tokio::select! {
                _ = changes.changed() => {}
                _ = marks.changed() => {}
                () = tokio::time::sleep(RESYNC) => written = None,
            }
        }
    }

    /// Keeps the Node's [`USED_ANNOTATION`] at what the pods' processes hold: the accounting is read every
    /// second, and the annotation written when it has moved ([`UsedAnnotation::moved`]), at most once per
    /// `every` (and again after [`RESYNC`] in any case: someone may have edited it). Until the process ends.
    pub async fn publish_used(
        self: Arc<Self>,
        state: Arc<NodeState>,
        enforcement: Arc<Enforcement>,
        every: Duration,
    ) {
        let memory_mib = |index| {
            state
                .position(index)
                .map_or(0, |a| state.inventory.gpus[a].memory_mib)
        };
        let mut written: Option<(UsedAnnotation, tokio::time::Instant)> = None;
        let mut backoff = Duration::from_secs(1);
        loop {
            let read = {
                let (state, enforcement) = (Arc::clone(&state), Arc::clone(&enforcement));
                // Reading files: off the async runtime.
                tokio::task::spawn_blocking(move || {
                    UsedAnnotation::new(
                        &state.inventory,
                        &enforcement.held(&state.live_allocations()).bytes,
                    )
                })
                .await
            };
            let due = |used: &UsedAnnotation| match &written {
                None => true,
                Some((last, at)) => {
                    at.elapsed() >= every && (used.moved(last, memory_mib) || at.elapsed() >= RESYNC)
                }
            };
            if let Ok(used) = read
                && due(&used)
            {
                let patch = serde_json::json!({
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": { "name": self.node, "annotations": { USED_ANNOTATION: used.to_json() } },
                });
                let params = PatchParams::apply(USED_FIELD_MANAGER).force();
                match Api::<Node>::all(self.client.clone())
                    .patch(&self.node, &params, &Patch::Apply(&patch))
                    .await
                {
                    Ok(_) => {
                        tracing::debug!(node = %self.node, "published what the pods' processes hold");
                        written = Some((used, tokio::time::Instant::now()));
                        backoff = Duration::from_secs(1);
                    }
                    Err(err) => {
                        tracing::warn!(node = %self.node, error = %err, retry_in = ?backoff, "cannot write {USED_ANNOTATION}");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        continue;
                    }
                }
            }
            tokio::time::sleep(USED_SAMPLE).await;
        }
    }

    /// The pods bound to this node.
    pub async fn pods_on_node(&self) -> anyhow::Result<Vec<Pod>> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let params = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        match tokio::time::timeout(LOOKUP_TIMEOUT, pods.list(&params)).await {
            Ok(Ok(list)) => Ok(list.items),
            Ok(Err(err)) => Err(anyhow::Error::new(err).context("cannot list this node's pods")),
            Err(_) => anyhow::bail!("listing this node's pods took longer than {LOOKUP_TIMEOUT:?}"),
        }
    }

    /// The GPU the scorer chose for a pod on this node that asks for `units` of memory in one
    /// container and has none allocated yet (oldest choice first).
    pub async fn assigned_gpu(&self, resource: &str, units: u64, state: &NodeState) -> Option<String> {
        let pods = match self.pods_on_node().await {
            Ok(pods) => pods,
            Err(err) => {
                tracing::debug!(error = %format!("{err:#}"), "choosing the GPU locally");
                return None;
            }
        };
        let mut candidates: Vec<(String, String)> = pods
            .iter()
            .filter_map(|pod| {
                let meta = &pod.metadata;
                let owner = format!("{}/{}", meta.namespace.as_deref()?, meta.name.as_deref()?);
                let annotations = meta.annotations.as_ref()?;
                let gpu = annotations
                    .get(ASSIGNED_GPUS_ANNOTATION)?
                    .split(',')
                    .next()?
                    .trim()
                    .to_string();
                let asks = pod
                    .spec
                    .as_ref()?
                    .containers
                    .iter()
                    .any(|c| container_units(c, resource) == Some(units));
                let at = annotations
                    .get(ASSIGNED_AT_ANNOTATION)
                    .cloned()
                    .unwrap_or_default();
                (asks && !state.holds_memory(&owner)).then_some((at, gpu))
            })
            .collect();
        candidates.sort();
        candidates.into_iter().next().map(|(_, gpu)| gpu)
    }
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
fn unix_millis() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}
