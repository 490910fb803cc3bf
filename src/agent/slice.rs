//! The node's ResourceSlice on the API server (the DRA path): published from the node's picture
//! (`node::slice` renders it), kept through kubelet restarts (a kubelet deletes its node's slices
//! when it starts) and edits by others, and deleted when the node leaves the DRA path.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt as _};
use tokio_stream::StreamExt as _;

use super::apiserver::FIELD_MANAGER;
use super::state::NodeState;
use crate::node::slice::{self, SliceInputs};

/// Written again after this long even when nothing changed (someone may have edited it).
const RESYNC: Duration = Duration::from_secs(300);

/// Keeps the node's ResourceSlice equal to the node's picture: one device per healthy GPU. Written
/// when health changes, when someone else changes or deletes it (the kubelet deletes its node's
/// slices when it starts), and every [`RESYNC`]. Ends when the process does.
pub async fn publish(
    client: Client,
    state: Arc<NodeState>,
    driver: String,
    node: String,
    pcie_roots: Vec<String>,
) {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let name = slice::slice_name(&node, &driver);
    let owner = node_owner(&client, &node).await;
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = Box::pin(watcher::watcher(api.clone(), config));
    let mut changes = state.subscribe();
    // The slice as the API server has it; None: absent. Unknown until the first list.
    let mut current: Option<Option<ResourceSlice>> = None;
    let mut listing: Option<Option<ResourceSlice>> = None;
    // What our last write sent (before the generation) and what the API server stored from it.
    let mut written: Option<(ResourceSliceSpec, ResourceSlice)> = None;
    let mut last_write = tokio::time::Instant::now();
    let mut backoff = Duration::from_secs(1);
    loop {
        tokio::select! {
            event = events.next() => match event {
                Some(Ok(watcher::Event::Init)) => listing = Some(None),
                Some(Ok(watcher::Event::InitApply(s))) => {
                    if s.name_any() == name { listing = Some(Some(s)); }
                }
                Some(Ok(watcher::Event::InitDone)) => current = listing.take(),
                Some(Ok(watcher::Event::Apply(s))) => {
                    if s.name_any() == name { current = Some(Some(s)); } else { continue; }
                }
                Some(Ok(watcher::Event::Delete(s))) => {
                    if s.name_any() == name {
                        tracing::info!(slice = %name, "ResourceSlice deleted (a kubelet restart?): publishing it again");
                        current = Some(None);
                    } else { continue; }
                }
                Some(Err(err)) => {
                    tracing::warn!(error = %err, "watching ResourceSlices failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                    continue;
                }
                None => return,
            },
            _ = changes.changed() => {}
            () = tokio::time::sleep(RESYNC) => {}
        }
        let Some(known) = &current else { continue };
        let healthy: Vec<bool> = (0..state.inventory.gpus.len())
            .map(|a| state.is_healthy(a))
            .collect();
        let desired = slice::resource_slice_spec(
            &state.inventory,
            &SliceInputs {
                driver: &driver,
                node: &node,
                unit_mib: state.unit_mib,
                healthy: &healthy,
                pcie_roots: &pcie_roots,
                generation: 0,
            },
        );
        // Written again when the picture changed, when the API server's copy is not the one our last
        // write left (someone else changed or deleted it), or at the resync; never because the API
        // server stores what we sent in its own normal form.
        let untouched = match (known, &written) {
            (Some(slice), Some((_, stored))) => {
                slice.metadata.resource_version == stored.metadata.resource_version
            }
            (None, _) | (_, None) => false,
        };
        // Before our first write, the slice an earlier run left counts as ours if it shows this picture.
        let unchanged = match (&written, known) {
            (Some((spec, _)), _) => *spec == desired,
            (None, Some(slice)) => {
                let mut stored = slice.spec.clone();
                stored.pool.generation = 0;
                stored == desired
            }
            (None, None) => false,
        };
        let untouched = untouched || (written.is_none() && unchanged);
        if untouched && unchanged && last_write.elapsed() < RESYNC {
            backoff = Duration::from_secs(1);
            continue;
        }
        // A changed device list is a new generation of the pool.
        let generation = match known {
            Some(slice) if unchanged => slice.spec.pool.generation,
            Some(slice) => slice.spec.pool.generation + 1,
            None => 1,
        };
        let mut spec = desired.clone();
        spec.pool.generation = generation;
        let devices = spec.devices.as_ref().map_or(0, Vec::len);
        let slice = ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                owner_references: owner.clone().map(|o| vec![o]),
                ..Default::default()
            },
            spec,
        };
        let mut body = serde_json::to_value(&slice).unwrap_or_default();
        body["apiVersion"] = "resource.k8s.io/v1".into();
        body["kind"] = "ResourceSlice".into();
        match api
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await
        {
            Ok(stored) => {
                tracing::info!(slice = %name, devices, generation = stored.spec.pool.generation, "ResourceSlice published");
                current = Some(Some(stored.clone()));
                written = Some((desired, stored));
                last_write = tokio::time::Instant::now();
                backoff = Duration::from_secs(1);
            }
            Err(err) => {
                tracing::warn!(slice = %name, error = %err, "cannot publish the ResourceSlice; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(30));
                changes.mark_changed();
            }
        }
    }
}

/// The Node as the slice's owner: the slice goes when the Node does.
async fn node_owner(client: &Client, node: &str) -> Option<OwnerReference> {
    let api: Api<Node> = Api::all(client.clone());
    match api.get(node).await {
        Ok(n) => Some(OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: node.to_string(),
            uid: n.metadata.uid.unwrap_or_default(),
            controller: Some(true),
            ..Default::default()
        }),
        Err(err) => {
            tracing::warn!(error = %err, "cannot read the Node: its ResourceSlice will not be owned by it");
            None
        }
    }
}

/// Deletes the node's slice (the agent leaves the DRA path: `gpumem agent --mode device-plugin` on
/// a node that had it, or an uninstall).
pub async fn delete(client: Client, driver: &str, node: &str) -> anyhow::Result<()> {
    let api: Api<ResourceSlice> = Api::all(client);
    let name = slice::slice_name(node, driver);
    match api.delete(&name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(err) => Err(err).with_context(|| format!("deleting ResourceSlice {name}")),
    }
}
