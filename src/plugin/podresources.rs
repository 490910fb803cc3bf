//! What the kubelet has handed out: the PodResources API (`List`), polled, and asked again right
//! before every decision. The kubelet never tells a device plugin that a pod ended; this does.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use super::proto::podresources::pod_resources_lister_client::PodResourcesListerClient;
use super::proto::podresources::{
    AllocatableResourcesRequest, ListPodResourcesRequest, ListPodResourcesResponse,
};
use super::uds;

/// Something that makes what the kubelet handed out current before a decision.
#[tonic::async_trait]
pub trait Refresh: Send + Sync + 'static {
    async fn refresh(&self);

    /// A fresh `List`, also handed on; for decisions that need to see what the kubelet lists now.
    async fn list(&self) -> anyhow::Result<ListPodResourcesResponse> {
        anyhow::bail!("no PodResources here")
    }
}

/// Where each `List` goes (the agent's node state).
pub trait Allocations: Send + Sync + 'static {
    fn apply(&self, list: &ListPodResourcesResponse);
}

/// One `List` may take this long before the last known picture is used instead.
const LIST_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest `GetAllocatableResources` answer read: the kubelet takes device lists of up to 4 MiB
/// per resource, and lists each device in an entry of its own (its resource name repeated).
const ALLOCATABLE_MAX_BYTES: usize = 64 << 20;
/// A decision within this long of the last `List` uses it as it is: the kubelet rate-limits the API
/// (100 requests/s, bursts of 10), and the agent's own recent allocations are in its books anyway.
const FRESH_ENOUGH: Duration = Duration::from_millis(100);

pub struct PodResources {
    socket: PathBuf,
    allocations: Arc<dyn Allocations>,
    client: Mutex<Option<PodResourcesListerClient<tonic::transport::Channel>>>,
    last_listed: std::sync::Mutex<Option<Instant>>,
}

impl PodResources {
    pub fn new(socket: PathBuf, allocations: Arc<dyn Allocations>) -> Self {
        Self {
            socket,
            allocations,
            client: Mutex::new(None),
            last_listed: std::sync::Mutex::new(None),
        }
    }

    /// Lists what is allocated and hands it on.
    pub async fn refresh_now(&self) -> anyhow::Result<()> {
        self.list_now().await.map(drop)
    }

    /// Lists what is allocated, hands it on and returns it.
    pub async fn list_now(&self) -> anyhow::Result<ListPodResourcesResponse> {
        let mut guard = self.client.lock().await;
        let attempt = async {
            if guard.is_none() {
                *guard = Some(PodResourcesListerClient::new(uds::connect(&self.socket).await?));
            }
            let client = guard
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("no PodResources client"))?;
            anyhow::Ok(client.list(ListPodResourcesRequest {}).await?.into_inner())
        };
        match tokio::time::timeout(LIST_TIMEOUT, attempt).await {
            Ok(Ok(list)) => {
                self.allocations.apply(&list);
                *self.last_listed.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
                Ok(list)
            }
            failed => {
                // Reconnect next time: the kubelet may have restarted.
                *guard = None;
                match failed {
                    Ok(Err(err)) => Err(err),
                    _ => Err(anyhow::anyhow!(
                        "PodResources List took longer than {LIST_TIMEOUT:?}"
                    )),
                }
            }
        }
        .map_err(|e| anyhow::anyhow!("PodResources {}: {e}", self.socket.display()))
    }

    /// How many devices of each resource the kubelet counts allocatable, healthy ones only
    /// (`GetAllocatableResources`); `None` when this kubelet does not serve the call (its feature gate
    /// off). One entry per device: a node's lists can pass the client's default 4 MiB limit.
    pub async fn allocatable_counts(&self) -> anyhow::Result<Option<BTreeMap<String, usize>>> {
        let attempt = async {
            let mut client = PodResourcesListerClient::new(uds::connect(&self.socket).await?)
                .max_decoding_message_size(ALLOCATABLE_MAX_BYTES);
            match client
                .get_allocatable_resources(AllocatableResourcesRequest {})
                .await
            {
                Ok(answer) => {
                    let mut counts = BTreeMap::new();
                    for d in answer.into_inner().devices {
                        *counts.entry(d.resource_name).or_insert(0) += d.device_ids.len();
                    }
                    anyhow::Ok(Some(counts))
                }
                // Before 1.28 a kubelet with KubeletPodResourcesGetAllocatable off says "disabled".
                Err(s) if s.code() == tonic::Code::Unimplemented || s.message().contains("disabled") => {
                    Ok(None)
                }
                Err(s) => Err(s.into()),
            }
        };
        tokio::time::timeout(LIST_TIMEOUT, attempt)
            .await
            .map_err(|_| anyhow::anyhow!("GetAllocatableResources took longer than {LIST_TIMEOUT:?}"))?
    }

    /// Polls every `interval` until the process ends.
    pub async fn poll(self: Arc<Self>, interval: Duration) {
        let mut failing = false;
        loop {
            match self.refresh_now().await {
                Ok(()) if failing => {
                    tracing::info!("PodResources reachable again");
                    failing = false;
                }
                Ok(()) => {}
                Err(err) if !failing => {
                    tracing::warn!(error = %err, "cannot read what the kubelet allocated; using the last known picture");
                    failing = true;
                }
                Err(_) => {}
            }
            tokio::time::sleep(interval).await;
        }
    }
}

#[tonic::async_trait]
impl Refresh for PodResources {
    async fn refresh(&self) {
        let last = *self.last_listed.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|at| at.elapsed() < FRESH_ENOUGH) {
            return;
        }
        if let Err(err) = self.refresh_now().await {
            tracing::warn!(error = %err, "deciding on the last known allocations");
        }
    }

    async fn list(&self) -> anyhow::Result<ListPodResourcesResponse> {
        self.list_now().await
    }
}
