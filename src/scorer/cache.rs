//! The node (and pod) cache for `nodeCacheCapable: true`, fed by kube-rs reflectors. Parsed GPU state is
//! kept per node and reparsed only when the node's resourceVersion changes.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio_stream::StreamExt;

use super::state::NodeState;

/// Nodes by name, as the API server last said, with their parsed GPU state.
pub struct NodeCache {
    store: Store<Node>,
    parsed: RwLock<HashMap<String, Arc<NodeState>>>,
    /// Keeps a hand-fed store's writer alive (see [`NodeCache::from_nodes`]).
    _writer: Option<reflector::store::Writer<Node>>,
}

impl NodeCache {
    /// Starts a reflector on all Nodes; the returned cache fills as it lists and watches.
    pub fn start(client: Client) -> Arc<NodeCache> {
        let (store, writer) = reflector::store();
        let stream = reflector::reflector(
            writer,
            watcher(Api::<Node>::all(client), watcher::Config::default()),
        )
        .default_backoff();
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                if let Err(e) = event {
                    tracing::warn!("node watch: {e}");
                }
            }
        });
        Arc::new(NodeCache {
            store,
            parsed: RwLock::new(HashMap::new()),
            _writer: None,
        })
    }

    /// A cache holding exactly `nodes` (tests and benchmarks), through the same store type.
    pub fn from_nodes(nodes: impl IntoIterator<Item = Node>) -> Arc<NodeCache> {
        let mut writer = reflector::store::Writer::<Node>::default();
        writer.apply_watcher_event(&watcher::Event::Init);
        for n in nodes {
            writer.apply_watcher_event(&watcher::Event::InitApply(n));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        Arc::new(NodeCache {
            store: writer.as_reader(),
            parsed: RwLock::new(HashMap::new()),
            _writer: Some(writer),
        })
    }

    /// Node `name`'s GPU state, if the cache has the node.
    pub fn get(&self, name: &str) -> Option<Arc<NodeState>> {
        let node = self.store.get(&ObjectRef::new(name))?;
        let rv = node.metadata.resource_version.as_deref().unwrap_or("");
        if let Some(s) = self
            .parsed
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .filter(|s| s.resource_version == rv && !rv.is_empty())
        {
            return Some(s.clone());
        }
        let state = Arc::new(NodeState::from_node(&node));
        self.parsed
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), state.clone());
        Some(state)
    }

    pub fn len(&self) -> usize {
        self.store.len()
    }

    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }
}

/// Scheduled pods, to resolve preemption victims given by UID.
pub struct PodCache {
    store: Store<Pod>,
    _writer: Option<reflector::store::Writer<Pod>>,
}

impl PodCache {
    pub fn start(client: Client) -> Arc<PodCache> {
        let (store, writer) = reflector::store();
        let config = watcher::Config::default().fields("spec.nodeName!=");
        let stream = reflector::reflector(writer, watcher(Api::<Pod>::all(client), config)).default_backoff();
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                if let Err(e) = event {
                    tracing::warn!("pod watch: {e}");
                }
            }
        });
        Arc::new(PodCache { store, _writer: None })
    }

    pub fn from_pods(pods: impl IntoIterator<Item = Pod>) -> Arc<PodCache> {
        let mut writer = reflector::store::Writer::<Pod>::default();
        writer.apply_watcher_event(&watcher::Event::Init);
        for p in pods {
            writer.apply_watcher_event(&watcher::Event::InitApply(p));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        Arc::new(PodCache {
            store: writer.as_reader(),
            _writer: Some(writer),
        })
    }

    pub fn by_uid(&self, uid: &str) -> Option<Arc<Pod>> {
        self.store
            .state()
            .into_iter()
            .find(|p| p.metadata.uid.as_deref() == Some(uid))
    }
}
