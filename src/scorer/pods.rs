//! Scheduled pods, as the scorer needs them: bind looks for other replicas' recent binds on a node, and
//! preempt resolves victims given by UID. The watch hands over whole Pod objects; only what those two
//! decisions read is kept ([`PodRecord`], a few hundred bytes instead of the object's kilobytes),
//! indexed by UID and by node, so neither scans every pod of the cluster.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::runtime::watcher;

use super::cache::Synced;
use super::state::{self, ClassRules, Demand, WorkloadClass};
use crate::node::ASSIGNED_AT_ANNOTATION;
use crate::requests::Resources;

/// What the scorer keeps of a scheduled pod. Boxed strings and slices: 20,000 of these are held.
#[derive(Debug, Clone, PartialEq)]
pub struct PodRecord {
    pub uid: Box<str>,
    /// `namespace/name`, the key of usage annotations and the ledger.
    pub key: Box<str>,
    /// Length of the namespace in `key`.
    namespace_len: usize,
    pub node: Box<str>,
    /// Matched against PodDisruptionBudget selectors (see [`PodRecord::labels`]).
    labels: Box<[(Box<str>, Box<str>)]>,
    pub preemptible: bool,
    /// GPU UUIDs recorded at bind time (`gpumem.io/assigned-gpus`), and when.
    pub assigned_gpus: Box<[Box<str>]>,
    pub assigned_at: Option<Timestamp>,
    /// Its GPU request; `None`: no GPU, or a request the scorer cannot read.
    pub demand: Option<Demand>,
    /// What it requests of its node, as kube-scheduler counts it: for the learned mix, and for the DRA
    /// placer's check that a node has room for one more pod.
    pub requests: Resources,
    /// Succeeded or Failed: kube-scheduler no longer counts what it requests.
    pub terminal: bool,
    /// Its priority (0 when the pod has none), PriorityClass and marked class: the DRA placer's
    /// preemption takes victims of lower priority, the offline class first.
    pub priority: i32,
    pub priority_class: Option<Box<str>>,
    pub marked_class: Option<WorkloadClass>,
}

impl PodRecord {
    /// The record of a pod; `None` when it is not bound to a node or has no UID.
    pub fn from_pod(pod: &Pod) -> Option<PodRecord> {
        let node = pod
            .spec
            .as_ref()?
            .node_name
            .as_deref()
            .filter(|n| !n.is_empty())?;
        PodRecord::on_node(pod, node)
    }

    /// The record of a pod on `node` (kube-scheduler's preemption victims come by node); `None` without
    /// a UID.
    pub fn on_node(pod: &Pod, node: &str) -> Option<PodRecord> {
        let meta = &pod.metadata;
        let uid = meta.uid.as_deref().filter(|u| !u.is_empty())?;
        let namespace = meta.namespace.as_deref().unwrap_or("default");
        // The class is not read here: an empty rule set is enough for the request's size.
        let rules = ClassRules {
            online_priority_classes: Vec::new(),
            online_min_priority: None,
        };
        let demand = state::pod_demand(pod, &rules).ok().flatten();
        let assigned_at = meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(ASSIGNED_AT_ANNOTATION))
            .and_then(|t| t.parse().ok());
        let labels = meta.labels.iter().flatten();
        Some(PodRecord {
            uid: uid.into(),
            key: format!("{namespace}/{}", meta.name.as_deref().unwrap_or("")).into(),
            namespace_len: namespace.len(),
            node: node.into(),
            labels: labels
                .map(|(k, v)| (k.as_str().into(), v.as_str().into()))
                .collect(),
            preemptible: state::is_preemptible(pod),
            assigned_gpus: state::assigned_gpus(pod).into_iter().map(Into::into).collect(),
            assigned_at,
            requests: Resources::requested_by(pod),
            terminal: pod
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|p| p == "Succeeded" || p == "Failed"),
            demand: demand.map(|d| d.demand),
            priority: pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
            priority_class: pod
                .spec
                .as_ref()
                .and_then(|s| s.priority_class_name.as_deref())
                .map(Into::into),
            // A mark the scorer cannot read counts as online: such a pod is not preferred as a victim.
            marked_class: state::marked_class(pod).unwrap_or(Some(WorkloadClass::Online)),
        })
    }

    /// Its class under `rules`.
    pub fn class(&self, rules: &ClassRules) -> WorkloadClass {
        rules.class_of(
            self.marked_class,
            self.priority_class.as_deref(),
            Some(self.priority),
        )
    }

    pub fn namespace(&self) -> &str {
        &self.key[..self.namespace_len]
    }

    /// Its labels, for matching selectors (built on demand: only preemption reads them).
    pub fn labels(&self) -> BTreeMap<String, String> {
        self.labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// MiB it asks for on one GPU of a node with `unit_mib` per unit; `None` for whole GPUs or no GPU.
    pub fn memory_mib(&self, unit_mib: u64) -> Option<u64> {
        match self.demand? {
            Demand::Memory { units } => Some(units.saturating_mul(unit_mib)),
            Demand::Whole { .. } => None,
        }
    }
}

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Records by UID, and the records on each node (a few hundred at most per node).
#[derive(Default)]
struct Index {
    by_uid: FastMap<Box<str>, Arc<PodRecord>>,
    by_node: FastMap<Box<str>, Vec<Arc<PodRecord>>>,
    /// UIDs seen since the current (re)list began; on its end, the others are gone.
    relist: Option<HashSet<Box<str>>>,
    /// UIDs of pods gone within [`DEPARTED_KEPT`], oldest first, and the same as a set.
    departed: VecDeque<(Instant, Box<str>)>,
    departed_uids: HashSet<Box<str>>,
}

/// How long a departed pod's UID is remembered: a shared booking holds its room for [`SETTLE`] even
/// when no pod cache shows its pod yet (the Binding on its way), unless its pod is known gone.
///
/// [`SETTLE`]: super::bookings::SETTLE
const DEPARTED_KEPT: Duration = Duration::from_secs(2 * super::bookings::SETTLE.as_secs());

impl Index {
    fn insert(&mut self, record: PodRecord) {
        if let Some(seen) = self.relist.as_mut() {
            seen.insert(record.uid.clone());
        }
        // A new version replaces the old record (a pod's node never changes once set).
        self.remove(&record.uid);
        let record = Arc::new(record);
        self.by_node
            .entry(record.node.clone())
            .or_default()
            .push(record.clone());
        self.by_uid.insert(record.uid.clone(), record);
    }

    /// Remembers that the pod with `uid` is gone, and forgets departures past [`DEPARTED_KEPT`].
    fn depart(&mut self, uid: &str, now: Instant) {
        while let Some((at, _)) = self.departed.front() {
            if now.duration_since(*at) < DEPARTED_KEPT {
                break;
            }
            if let Some((_, old)) = self.departed.pop_front() {
                self.departed_uids.remove(&old);
            }
        }
        if !uid.is_empty() && self.departed_uids.insert(uid.into()) {
            self.departed.push_back((now, uid.into()));
        }
    }

    fn remove(&mut self, uid: &str) -> Option<Arc<PodRecord>> {
        let old = self.by_uid.remove(uid)?;
        if let Some(on_node) = self.by_node.get_mut(&old.node) {
            on_node.retain(|r| !Arc::ptr_eq(r, &old));
            if on_node.is_empty() {
                self.by_node.remove(&old.node);
            }
        }
        Some(old)
    }
}

/// Told of each scheduled pod that goes away (set once, after the cache starts).
type OnDelete = Box<dyn Fn(&PodRecord) + Send + Sync>;

/// The scheduled pods of the cluster, kept in step with a watch.
pub struct PodCache {
    index: RwLock<Index>,
    synced: Synced,
    /// False from a failed watch request until the watch has listed again or sent an event: the
    /// cache may lack binds and deletions meanwhile.
    following: AtomicBool,
    on_delete: OnceLock<OnDelete>,
}

impl PodCache {
    fn empty(synced: bool) -> PodCache {
        PodCache {
            index: RwLock::new(Index::default()),
            synced: Synced::new(synced),
            following: AtomicBool::new(true),
            on_delete: OnceLock::new(),
        }
    }

    /// Watches every pod bound to a node; the returned cache fills as it lists and watches.
    pub fn start(client: Client) -> Arc<PodCache> {
        let config = watcher::Config::default().fields("spec.nodeName!=");
        let cache = Arc::new(PodCache::empty(false));
        let feed = cache.clone();
        let broken = cache.clone();
        super::cache::follow::<Pod>(
            client,
            config,
            "pod",
            move |e| feed.apply(e),
            move || broken.watch_failed(),
        );
        cache
    }

    /// A cache holding exactly `pods` (tests), fed through the same events as the watch's.
    pub fn from_pods(pods: impl IntoIterator<Item = Pod>) -> Arc<PodCache> {
        let cache = PodCache::empty(false);
        cache.apply(&watcher::Event::Init);
        for p in pods {
            cache.apply(&watcher::Event::InitApply(p));
        }
        cache.apply(&watcher::Event::InitDone);
        Arc::new(cache)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Index> {
        self.index.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Index> {
        self.index.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The watch failed: until it has listed again, what the cache lacks is unknown.
    pub fn watch_failed(&self) {
        self.following.store(false, Ordering::Relaxed);
    }

    /// Whether the cache is following the API server now (see [`PodCache::watch_failed`]).
    pub fn following(&self) -> bool {
        self.following.load(Ordering::Relaxed)
    }

    /// Applies one watch event.
    pub fn apply(&self, event: &watcher::Event<Pod>) {
        if matches!(
            event,
            watcher::Event::InitDone | watcher::Event::Apply(_) | watcher::Event::Delete(_)
        ) {
            self.following.store(true, Ordering::Relaxed);
        }
        let gone: Vec<Arc<PodRecord>> = match event {
            watcher::Event::Init => {
                self.write().relist = Some(HashSet::new());
                Vec::new()
            }
            watcher::Event::InitApply(pod) | watcher::Event::Apply(pod) => {
                match PodRecord::from_pod(pod) {
                    Some(record) => self.write().insert(record),
                    None => tracing::debug!(
                        pod = pod.metadata.name.as_deref().unwrap_or(""),
                        "pod without UID or node ignored"
                    ),
                }
                Vec::new()
            }
            watcher::Event::Delete(pod) => {
                let uid = pod.metadata.uid.as_deref().unwrap_or("");
                let mut index = self.write();
                index.depart(uid, Instant::now());
                index.remove(uid).into_iter().collect()
            }
            // Pods deleted while the watch was down are only missing from the new list.
            watcher::Event::InitDone => {
                let mut index = self.write();
                let gone = match index.relist.take() {
                    Some(seen) => {
                        let stale: Vec<Box<str>> = index
                            .by_uid
                            .keys()
                            .filter(|u| !seen.contains(*u))
                            .cloned()
                            .collect();
                        for u in &stale {
                            index.depart(u, Instant::now());
                        }
                        stale.iter().filter_map(|u| index.remove(u)).collect()
                    }
                    None => Vec::new(),
                };
                drop(index);
                self.synced.mark();
                gone
            }
        };
        if let Some(on_delete) = self.on_delete.get() {
            for record in &gone {
                on_delete(record);
            }
        }
    }

    /// Calls `f` with every scheduled pod that goes away from now on (once: a second hook is ignored).
    pub fn on_delete(&self, f: impl Fn(&PodRecord) + Send + Sync + 'static) {
        let _ = self.on_delete.set(Box::new(f));
    }

    /// Whether the pod with `uid` went away within the last [`DEPARTED_KEPT`] (20 s).
    pub fn departed(&self, uid: &str) -> bool {
        self.read().departed_uids.contains(uid)
    }

    /// Whether the first list of pods has been read.
    pub fn synced(&self) -> &Synced {
        &self.synced
    }

    /// `f` of the pods bound to `node`, read in place (filter reads every candidate node's).
    pub fn with_node<R>(&self, node: &str, f: impl FnOnce(&[Arc<PodRecord>]) -> R) -> R {
        f(self.read().by_node.get(node).map_or(&[], Vec::as_slice))
    }

    /// Every pod, oldest bind first (pods without the scorer's bind time, first of all).
    pub fn all(&self) -> Vec<Arc<PodRecord>> {
        let mut all: Vec<Arc<PodRecord>> = self.read().by_uid.values().cloned().collect();
        all.sort_by(|a, b| (a.assigned_at, &a.uid).cmp(&(b.assigned_at, &b.uid)));
        all
    }

    /// The pods with these UIDs that the cache holds, by UID.
    pub fn by_uids(&self, uids: &HashSet<&str>) -> HashMap<String, Arc<PodRecord>> {
        let index = self.read();
        uids.iter()
            .filter_map(|u| index.by_uid.get(*u).map(|r| (u.to_string(), r.clone())))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.read().by_uid.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn pod(uid: &str, name: &str, node: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name, "namespace": "ml", "uid": uid,
                "labels": {"app": "train", "gpumem.io/preemptible": "true"},
                "annotations": {
                    "gpumem.io/assigned-gpus": "GPU-a, GPU-b",
                    "gpumem.io/assigned-at": "2026-12-02T10:00:00Z"
                }
            },
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu-mem": "5k"}}}]}
        }))
        .expect("pod")
    }

    #[test]
    fn a_record_keeps_what_bind_and_preempt_read() {
        let r = PodRecord::from_pod(&pod("u1", "p1", "n1")).expect("record");
        assert_eq!(&*r.key, "ml/p1");
        assert_eq!(r.namespace(), "ml");
        assert_eq!(&*r.node, "n1");
        assert!(r.preemptible);
        assert_eq!(r.assigned_gpus, ["GPU-a".into(), "GPU-b".into()].into());
        assert_eq!(
            r.assigned_at.map(|t| t.to_string()).as_deref(),
            Some("2026-12-02T10:00:00Z")
        );
        assert_eq!(r.memory_mib(1), Some(5000), "canonical quantities are read");
        assert_eq!(r.labels().get("app").map(String::as_str), Some("train"));
        let mut unbound = pod("u2", "p2", "n1");
        unbound.spec.as_mut().expect("spec").node_name = None;
        assert!(PodRecord::from_pod(&unbound).is_none());
    }

    #[test]
    fn a_failed_watch_is_followed_again_once_it_has_listed() {
        let cache = PodCache::from_pods(std::iter::empty::<Pod>());
        assert!(cache.following());
        cache.watch_failed();
        assert!(!cache.following());
        cache.apply(&watcher::Event::Init);
        assert!(!cache.following(), "a relist under way may still lack pods");
        cache.apply(&watcher::Event::InitDone);
        assert!(cache.following());
    }

    #[test]
    fn pods_are_indexed_by_node_and_uid_and_leave_on_delete_or_relist() {
        let cache = PodCache::from_pods([
            pod("u1", "p1", "n1"),
            pod("u2", "p2", "n1"),
            pod("u3", "p3", "n2"),
        ]);
        let gone = Arc::new(Mutex::new(Vec::new()));
        let log = gone.clone();
        cache.on_delete(move |r| log.lock().expect("lock").push(r.key.to_string()));
        let mut on_n1: Vec<String> = cache
            .with_node("n1", <[_]>::to_vec)
            .iter()
            .map(|r| r.uid.to_string())
            .collect();
        on_n1.sort();
        assert_eq!(on_n1, ["u1", "u2"]);
        let wanted: HashSet<&str> = ["u3", "nope"].into();
        assert_eq!(cache.by_uids(&wanted).keys().collect::<Vec<_>>(), ["u3"]);

        cache.apply(&watcher::Event::Delete(pod("u1", "p1", "n1")));
        assert_eq!(cache.with_node("n1", <[_]>::to_vec).len(), 1);
        // A relist that no longer has u2: it is gone, and the hook hears of it.
        cache.apply(&watcher::Event::Init);
        cache.apply(&watcher::Event::InitApply(pod("u3", "p3", "n2")));
        cache.apply(&watcher::Event::InitDone);
        assert!(cache.with_node("n1", <[_]>::to_vec).is_empty());
        assert_eq!(cache.len(), 1);
        assert_eq!(*gone.lock().expect("lock"), ["ml/p1", "ml/p2"]);
    }

    #[test]
    fn departed_pods_are_remembered_by_uid() {
        let cache = PodCache::from_pods([pod("u1", "p1", "n1"), pod("u2", "p2", "n1")]);
        assert!(!cache.departed("u1"));
        cache.apply(&watcher::Event::Delete(pod("u1", "p1", "n1")));
        assert!(cache.departed("u1"));
        assert!(!cache.departed("u2"), "another pod");
        // Gone while the watch was away: missing from the relist.
        cache.apply(&watcher::Event::Init);
        cache.apply(&watcher::Event::InitDone);
        assert!(cache.departed("u2"));
        // A pod deleted before the cache ever held it (its bind and deletion in one gap) is gone too.
        cache.apply(&watcher::Event::Delete(pod("u3", "p3", "n2")));
        assert!(cache.departed("u3"));

        // Forgotten once no booking could need them.
        let mut index = Index::default();
        let t0 = Instant::now();
        index.depart("a", t0);
        index.depart("b", t0 + DEPARTED_KEPT / 2);
        index.depart("c", t0 + DEPARTED_KEPT);
        assert!(!index.departed_uids.contains("a"));
        assert!(index.departed_uids.contains("b") && index.departed_uids.contains("c"));
        assert_eq!(index.departed.len(), 2);
    }

    #[test]
    fn a_new_version_replaces_the_record() {
        let cache = PodCache::from_pods([pod("u1", "p1", "n1")]);
        let mut newer = pod("u1", "p1", "n1");
        newer.metadata.labels = None;
        cache.apply(&watcher::Event::Apply(newer));
        assert_eq!(cache.len(), 1);
        assert!(cache.with_node("n1", <[_]>::to_vec)[0].labels().is_empty());
    }
}
