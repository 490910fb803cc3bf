//! The node caches. For `nodeCacheCapable: true`, a watch keeps every node's parsed GPU state ready
//! (a node is parsed again only when its resourceVersion changes; the Node objects themselves are not
//! kept), so a decision only looks nodes up by name, under one lock. For the `Nodes` form, parsed states
//! by the node's text.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio_stream::StreamExt;

use super::state::NodeSnapshot;

/// The longest a watch waits before it tries the API server again. kube's default (30 s, client-go's)
/// kept the caches frozen for up to half a minute after a 30 s API server outage, while binds went on
/// against them; two replicas' caches are a small load to relist.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Feeds each event of a watch of every `K` (narrowed by `config`) to `apply`, on a task of its own,
/// for as long as the process runs, and calls `failed` when a request fails (the cache may then miss
/// events until the watcher, backing off up to [`MAX_BACKOFF`], has listed again). Errors are logged.
pub fn follow<K>(
    client: Client,
    config: watcher::Config,
    what: &'static str,
    apply: impl Fn(&watcher::Event<K>) + Send + 'static,
    failed: impl Fn() + Send + 'static,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    K::DynamicType: Default,
{
    let backoff = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(MAX_BACKOFF)
        .with_jitter()
        .without_max_times();
    let stream = watcher(Api::<K>::all(client), config).backoff(watcher::ExponentialBackoff::from(backoff));
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(event) => apply(&event),
                Err(e) => {
                    failed();
                    tracing::warn!("{what} watch: {e}");
                }
            }
        }
    });
}

/// Whether a cache has applied its first list from the API server (before that, a missing object may just
/// not be read yet); it can be waited for.
pub struct Synced(tokio::sync::watch::Sender<bool>);

impl Synced {
    pub(super) fn new(done: bool) -> Synced {
        Synced(tokio::sync::watch::Sender::new(done))
    }

    pub(super) fn mark(&self) {
        self.0.send_replace(true);
    }

    pub fn done(&self) -> bool {
        *self.0.borrow()
    }

    pub async fn wait(&self) {
        // The sender lives as long as `self`: the wait cannot end in an error.
        let _ = self.0.subscribe().wait_for(|done| *done).await;
    }
}

/// Something told of each object a cache sees change (set once, after the cache starts).
type Hook<T> = Box<dyn Fn(&T) + Send + Sync>;

/// Parsed GPU state by node name, kept in step with the watch events.
#[derive(Default)]
struct View {
    /// A fast hash: every decision looks up every candidate node by name.
    nodes: HashMap<String, Arc<NodeSnapshot>, foldhash::fast::RandomState>,
    /// Names seen since the current (re)list began; on its end, the others are gone.
    relist: Option<HashSet<String>>,
}

/// Nodes by name, as the API server last said, with their parsed GPU state.
pub struct NodeCache {
    view: RwLock<View>,
    synced: Synced,
    /// Told every node version as it arrives (see [`NodeCache::on_update`]).
    on_update: OnceLock<Hook<NodeSnapshot>>,
}

impl NodeCache {
    fn empty() -> NodeCache {
        NodeCache {
            view: RwLock::new(View::default()),
            synced: Synced::new(false),
            on_update: OnceLock::new(),
        }
    }

    /// Watches all Nodes; the returned cache fills as it lists and watches.
    pub fn start(client: Client) -> Arc<NodeCache> {
        let cache = Arc::new(NodeCache::empty());
        let feed = cache.clone();
        // A stale annotation only shows fewer pods: nothing to do when the watch fails.
        follow::<Node>(
            client,
            watcher::Config::default(),
            "node",
            move |e| feed.apply(e),
            || (),
        );
        cache
    }

    /// A cache holding exactly `nodes` (tests and benchmarks), fed through the same events as the
    /// watch's.
    pub fn from_nodes(nodes: impl IntoIterator<Item = Node>) -> Arc<NodeCache> {
        let cache = NodeCache::empty();
        cache.apply(&watcher::Event::Init);
        for n in nodes {
            cache.apply(&watcher::Event::InitApply(n));
        }
        cache.apply(&watcher::Event::InitDone);
        Arc::new(cache)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, View> {
        self.view.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, View> {
        self.view.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies one watch event.
    pub fn apply(&self, event: &watcher::Event<Node>) {
        match event {
            watcher::Event::Init => self.write().relist = Some(HashSet::new()),
            watcher::Event::InitApply(node) | watcher::Event::Apply(node) => {
                let name = node.metadata.name.as_deref().unwrap_or("");
                let rv = node.metadata.resource_version.as_deref().unwrap_or("");
                let current = self.read().nodes.get(name).cloned();
                let state = match current {
                    Some(s) if !rv.is_empty() && s.resource_version == rv => s,
                    _ => Arc::new(NodeSnapshot::from_node(node)),
                };
                if let Some(on_update) = self.on_update.get() {
                    on_update(&state);
                }
                let mut view = self.write();
                if let Some(seen) = view.relist.as_mut() {
                    seen.insert(name.to_string());
                }
                view.nodes.insert(name.to_string(), state);
            }
            watcher::Event::Delete(node) => {
                let name = node.metadata.name.as_deref().unwrap_or("");
                let mut view = self.write();
                view.nodes.remove(name);
                if let Some(seen) = view.relist.as_mut() {
                    seen.remove(name);
                }
            }
            watcher::Event::InitDone => {
                let mut view = self.write();
                if let Some(seen) = view.relist.take() {
                    view.nodes.retain(|name, _| seen.contains(name));
                }
                drop(view);
                self.synced.mark();
            }
        }
    }

    /// Calls `f` with every node version from now on (once: a second hook is ignored). The ledger hears
    /// of each usage annotation this way, including versions no decision happens to read.
    pub fn on_update(&self, f: impl Fn(&NodeSnapshot) + Send + Sync + 'static) {
        let _ = self.on_update.set(Box::new(f));
    }

    /// Whether the first list of nodes has been applied.
    pub fn synced(&self) -> &Synced {
        &self.synced
    }

    /// Node `name`'s GPU state, if the cache has the node.
    pub fn get(&self, name: &str) -> Option<Arc<NodeSnapshot>> {
        self.read().nodes.get(name).cloned()
    }

    /// The GPU states of `names` (in that order), under one lock; `missing` stands in for a node the
    /// cache does not have.
    pub fn get_many<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
        missing: impl Fn(&str) -> Arc<NodeSnapshot>,
    ) -> Vec<Arc<NodeSnapshot>> {
        let view = self.read();
        names
            .into_iter()
            .map(|n| view.nodes.get(n).cloned().unwrap_or_else(|| missing(n)))
            .collect()
    }

    /// Every node's GPU state, by name.
    pub fn all(&self) -> Vec<Arc<NodeSnapshot>> {
        let mut all: Vec<Arc<NodeSnapshot>> = self.read().nodes.values().cloned().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    pub fn len(&self) -> usize {
        self.read().nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.read().nodes.is_empty()
    }
}

/// Parsed GPU state of the nodes of `Nodes`-form requests (`nodeCacheCapable: false`), by the node's
/// exact JSON text: a node kube-scheduler sends again unchanged (same name, same resourceVersion, so the
/// same bytes) is not decoded again. Looked up by a hash of the text, confirmed by comparing the text.
/// Nodes absent from recent requests are forgotten, and the text held is bounded.
pub struct RawNodeCache {
    inner: std::sync::Mutex<RawInner>,
    /// Past this much node text, only the last request's nodes are kept.
    keep_bytes: usize,
}

#[derive(Default)]
struct RawInner {
    entries: HashMap<u64, RawEntry>,
    /// Counts requests; an entry remembers the last one that used it.
    generation: u64,
    /// The length of all texts held.
    bytes: usize,
}

struct RawEntry {
    text: Box<str>,
    state: Arc<NodeSnapshot>,
    used: u64,
}

/// A fast, non-cryptographic hash of a node's text: its length, its first 512 bytes (the name and
/// resourceVersion come first) and one 8-byte word in every 64. Two texts that differ elsewhere hash
/// alike, which only costs a decode: a match is always confirmed by comparing the whole text.
fn text_hash(text: &[u8]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mix = |h: u64, w: u64| (h.rotate_left(5) ^ w).wrapping_mul(K);
    let word = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&text[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let mut h = text.len() as u64;
    let head = text.len().min(512) / 8 * 8;
    for at in (0..head).step_by(8) {
        h = mix(h, word(at));
    }
    for at in (head..text.len().saturating_sub(7)).step_by(64) {
        h = mix(h, word(at));
    }
    if text.len() >= 8 {
        h = mix(h, word(text.len() - 8));
    } else {
        for &b in text {
            h = mix(h, u64::from(b));
        }
    }
    h
}

impl RawNodeCache {
    /// A cache that holds up to `keep_bytes` of node text (more only while one request sends more).
    pub fn new(keep_bytes: usize) -> RawNodeCache {
        RawNodeCache {
            inner: std::sync::Mutex::default(),
            keep_bytes,
        }
    }

    /// The parsed state of each node in `items`, in order.
    pub fn states(&self, items: &[Box<serde_json::value::RawValue>]) -> Vec<Arc<NodeSnapshot>> {
        let hashes: Vec<u64> = items.iter().map(|n| text_hash(n.get().as_bytes())).collect();
        let mut out: Vec<Option<Arc<NodeSnapshot>>> = Vec::with_capacity(items.len());
        let generation = {
            let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            inner.generation += 1;
            let generation = inner.generation;
            for (item, h) in items.iter().zip(&hashes) {
                out.push(match inner.entries.get_mut(h) {
                    Some(e) if *e.text == *item.get() => {
                        e.used = generation;
                        Some(e.state.clone())
                    }
                    _ => None,
                });
            }
            generation
        };
        // Decode what is new outside the lock.
        let mut new = Vec::new();
        for (k, slot) in out.iter_mut().enumerate() {
            if slot.is_none() {
                let state = Arc::new(NodeSnapshot::from_json_str(items[k].get()));
                new.push(k);
                *slot = Some(state);
            }
        }
        if !new.is_empty() {
            let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            for k in new {
                let state = out[k].clone().expect("decoded above");
                let text: Box<str> = items[k].get().into();
                inner.bytes += text.len();
                let entry = RawEntry {
                    text,
                    state,
                    used: generation,
                };
                if let Some(old) = inner.entries.insert(hashes[k], entry) {
                    inner.bytes -= old.text.len();
                }
            }
            // Forget nodes the last few requests did not send, once the cache grows well past a
            // request; past `keep_bytes` of text, all that this one did not send (requests in the
            // `Nodes` form can be large: this bounds what they leave behind).
            let keep_from = if inner.bytes > self.keep_bytes {
                Some(generation)
            } else if inner.entries.len() > 2 * items.len() + 1024 {
                Some(generation.saturating_sub(4))
            } else {
                None
            };
            if let Some(keep_from) = keep_from {
                inner.entries.retain(|_, e| e.used >= keep_from);
                inner.bytes = inner.entries.values().map(|e| e.text.len()).sum();
            }
        }
        out.into_iter().map(|s| s.expect("filled above")).collect()
    }

    /// Nodes held.
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_nodes_are_decoded_once_per_distinct_text() {
        let cache = RawNodeCache::new(1 << 20);
        let raw = |s: &str| serde_json::value::RawValue::from_string(s.to_string()).expect("raw");
        let a = raw(r#"{"metadata":{"name":"a","resourceVersion":"1"}}"#);
        let b = raw(r#"{"metadata":{"name":"b","resourceVersion":"1"}}"#);
        let first = cache.states(&[a.clone(), b.clone()]);
        assert_eq!(first[0].name, "a");
        assert_eq!(first[1].name, "b");
        let again = cache.states(&[b.clone(), a.clone()]);
        assert!(Arc::ptr_eq(&again[0], &first[1]) && Arc::ptr_eq(&again[1], &first[0]));
        // Same name and version but other bytes (a hand-made request): decoded again.
        let a2 = raw(r#"{"metadata":{"name":"a","resourceVersion":"1","labels":{"x":"y"}}}"#);
        let third = cache.states(&[a2]);
        assert!(!Arc::ptr_eq(&third[0], &first[0]));
        assert_eq!(third[0].name, "a");
        assert_eq!(cache.len(), 3);
        // Same length, differing only past the hashed head, between the sampled words: still told apart.
        let padded = |c: char| {
            let pad = "p".repeat(600);
            raw(&format!(
                r#"{{"metadata":{{"name":"z","labels":{{"pad":"{pad}","v":"{c}"}}}}}}"#
            ))
        };
        let first = cache.states(&[padded('1')]);
        let second = cache.states(&[padded('2')]);
        assert!(!Arc::ptr_eq(&first[0], &second[0]));
        assert_eq!(cache.states(&[padded('2')])[0], second[0]);
        let broken = cache.states(&[raw(r#"{"metadata":{"name":"x","labels":5}}"#)]);
        assert!(
            broken[0]
                .problem
                .as_deref()
                .is_some_and(|p| p.contains("cannot be read"))
        );
        assert_eq!(broken[0].name, "x");
    }

    #[test]
    fn the_update_hook_hears_every_node_version_and_sync_is_reported() {
        let node = |rv: &str| -> Node {
            serde_json::from_value(serde_json::json!({"metadata": {"name": "a", "resourceVersion": rv}}))
                .expect("node")
        };
        let cache = NodeCache::from_nodes([]);
        assert!(cache.synced().done(), "a hand-fed cache has had its list");
        let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = heard.clone();
        cache.on_update(move |n| log.lock().expect("lock").push(n.resource_version.clone()));
        cache.apply(&watcher::Event::Apply(node("1")));
        cache.apply(&watcher::Event::Apply(node("2")));
        cache.apply(&watcher::Event::Init);
        assert!(cache.synced().done(), "a relist does not make it unsynced");
        cache.apply(&watcher::Event::InitApply(node("3")));
        assert_eq!(*heard.lock().expect("lock"), ["1", "2", "3"]);
    }

    #[test]
    fn node_events_keep_the_view_in_step() {
        let node = |name: &str, rv: &str| -> Node {
            serde_json::from_value(serde_json::json!({"metadata": {"name": name, "resourceVersion": rv}}))
                .expect("node")
        };
        let cache = NodeCache::from_nodes([node("a", "1"), node("b", "1")]);
        assert_eq!(cache.len(), 2);
        let a1 = cache.get("a").expect("a");
        cache.apply(&watcher::Event::Apply(node("a", "1")));
        assert!(
            Arc::ptr_eq(&a1, &cache.get("a").expect("a")),
            "same version: not reparsed"
        );
        cache.apply(&watcher::Event::Apply(node("a", "2")));
        assert_eq!(cache.get("a").expect("a").resource_version, "2");
        cache.apply(&watcher::Event::Delete(node("b", "1")));
        assert!(cache.get("b").is_none());
        // A relist that no longer has "a" drops it.
        cache.apply(&watcher::Event::Init);
        cache.apply(&watcher::Event::InitApply(node("c", "7")));
        cache.apply(&watcher::Event::InitDone);
        let names: Vec<String> = cache.all().iter().map(|n| n.name.clone()).collect();
        assert_eq!(names, ["c"]);
        let stand_in = |name: &str| Arc::new(NodeSnapshot::broken(name, "missing".into()));
        assert_eq!(
            cache
                .get_many(["c", "zz"], stand_in)
                .iter()
                .map(|n| (n.name.as_str(), n.problem.as_deref() == Some("missing")))
                .collect::<Vec<_>>(),
            [("c", false), ("zz", true)]
        );
    }
}
