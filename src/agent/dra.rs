//! The agent as a DRA driver (Kubernetes 1.34+): it publishes the node's ResourceSlice and prepares
//! the claims kube-scheduler allocated on it. A prepared claim is an allocation in the one
//! [`NodeState`], as an Allocate is, so health, whole/shared exclusion, metrics, the usage
//! annotation and the accounting reader do not care which path handed the GPU out.
//!
//! Prepare reads the claim's allocation (`consumedCapacity.memory` of each result on this node),
//! records it, writes the claim's CDI spec (its GPUs, its limit, the shim, the preload file, its
//! accounting directory) and a checkpoint. The checkpoint is what a restarted agent starts from:
//! the kubelet calls prepare again for running pods (answered from it, unchanged) and unprepare
//! for claims whose pods ended while the agent was away (it still knows what to clean up).
//!
//! One file, over the usual ~600 lines: prepare, unprepare, adoption, forgetting and the checkpoint
//! all read and write the one map of prepared claims under one lock, and are kept in view together.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Client;
use kube::api::Api;
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use super::cdi::{CdiSpecs, ClaimEdits};
use super::config::{DeviceListStrategy, DraConfig};
use super::enforcement::Enforcement;
use super::metrics::AgentMetrics;
use super::resource::{LIMIT_ENV, VISIBLE_DEVICES_ENV};
use super::state::{NodeState, PreparedClaim, Share};
use crate::node::slice;
use crate::plugin::dra::ClaimPreparer;
use crate::plugin::proto::dra::{Claim, Device};
use crate::plugin::proto::drahealth::{DeviceHealth, DeviceIdentifier, HealthStatus};

/// A claim lookup while a pod is being started may take this long.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Version of the checkpoint file's format.
const CHECKPOINT_VERSION: u32 = 1;

/// One allocation result of a prepared claim, as the checkpoint keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PreparedDevice {
    /// The main request's name (the kubelet matches containers' claim requests by it).
    request: String,
    device: String,
    /// The allocation's share of a shared device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    share_id: Option<String>,
    /// The GPU, by UUID: indices may change across a reboot, a UUID does not.
    uuid: String,
    share: Share,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CheckpointClaim {
    namespace: String,
    name: String,
    owner: String,
    devices: Vec<PreparedDevice>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Checkpoint {
    version: u32,
    claims: BTreeMap<String, CheckpointClaim>,
}

/// The claims the kubelet had this driver prepare, kept on disk.
struct Prepared {
    path: PathBuf,
    claims: BTreeMap<String, CheckpointClaim>,
}

impl Prepared {
    /// The checkpoint; one that cannot be read as this agent writes it (edited by hand, cut short)
    /// is moved aside to `<path>.invalid` and the agent starts without it, saying so: the claims it
    /// held are then unknown to the agent until the kubelet unprepares them.
    fn load(path: &Path) -> anyhow::Result<Self> {
        let claims = match std::fs::read(path) {
            Ok(bytes) => match serde_json::from_slice::<Checkpoint>(&bytes) {
                Ok(checkpoint) if checkpoint.version == CHECKPOINT_VERSION => checkpoint.claims,
                parsed => {
                    let why = match parsed {
                        Ok(c) => format!("version {}, this agent reads {CHECKPOINT_VERSION}", c.version),
                        Err(err) => err.to_string(),
                    };
                    let aside = path.with_extension("json.invalid");
                    std::fs::rename(path, &aside).with_context(|| {
                        format!("moving the invalid DRA checkpoint {} aside", path.display())
                    })?;
                    tracing::error!(
                        checkpoint = %path.display(),
                        kept_at = %aside.display(),
                        error = %why,
                        "the DRA checkpoint is not valid: starting without the claims it named"
                    );
                    BTreeMap::new()
                }
            },
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(err) => return Err(err).with_context(|| format!("reading {}", path.display())),
        };
        Ok(Self {
            path: path.to_path_buf(),
            claims,
        })
    }

    fn save(&self) -> anyhow::Result<()> {
        let checkpoint = Checkpoint {
            version: CHECKPOINT_VERSION,
            claims: self.claims.clone(),
        };
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        crate::durable::write(&self.path, &serde_json::to_vec_pretty(&checkpoint)?, 0o644)
            .with_context(|| format!("writing the DRA checkpoint {}", self.path.display()))
    }
}

/// What a recorded claim's accounting directory starts as.
#[derive(Debug, Clone, Copy)]
enum Accounting {
    /// Emptied: a new claim, as Allocate gives a new container.
    Fresh,
    /// Kept as it is: an adopted claim's container may be counting in it.
    Keep,
}

/// Where a claim's allocation comes from: the API server, or a test's answer.
#[tonic::async_trait]
pub trait ClaimReader: Send + Sync + 'static {
    /// The claim, None when it does not exist; an error when that cannot be known now.
    async fn read(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, String>;
    /// Every claim of the cluster (the agent keeps those allocated on its node).
    async fn list(&self) -> Result<Vec<ResourceClaim>, String>;
}

#[tonic::async_trait]
impl ClaimReader for Client {
    async fn read(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, String> {
        let api: Api<ResourceClaim> = Api::namespaced(self.clone(), namespace);
        match tokio::time::timeout(LOOKUP_TIMEOUT, api.get_opt(name)).await {
            Err(_) => Err(format!(
                "the API server did not answer within {LOOKUP_TIMEOUT:?} for ResourceClaim {namespace}/{name}"
            )),
            Ok(Err(err)) => Err(format!("reading ResourceClaim {namespace}/{name}: {err}")),
            Ok(Ok(claim)) => Ok(claim),
        }
    }

    async fn list(&self) -> Result<Vec<ResourceClaim>, String> {
        let api: Api<ResourceClaim> = Api::all(self.clone());
        match tokio::time::timeout(LOOKUP_TIMEOUT, api.list(&Default::default())).await {
            Err(_) => Err(format!(
                "the API server did not answer within {LOOKUP_TIMEOUT:?} for ResourceClaims"
            )),
            Ok(Err(err)) => Err(format!("listing ResourceClaims: {err}")),
            Ok(Ok(list)) => Ok(list.items),
        }
    }
}

/// The DRA driver: the agent's side of [`ClaimPreparer`].
pub struct DraDriver {
    pub driver: String,
    pub node: String,
    pub state: Arc<NodeState>,
    pub reader: Arc<dyn ClaimReader>,
    pub cdi: CdiSpecs,
    pub enforcement: Option<Arc<Enforcement>>,
    pub strategy: DeviceListStrategy,
    pub metrics: Arc<AgentMetrics>,
    /// Serialises prepare and unprepare: each reads and writes the checkpoint whole.
    prepared: Mutex<Prepared>,
}

impl DraDriver {
    /// Loads the checkpoint of an earlier run and puts its claims back into `state`, so nothing
    /// they hold is handed out twice, and rewrites their CDI specs (the runtime may have lost them
    /// with `/var/run`).
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        config: &DraConfig,
        node: String,
        state: Arc<NodeState>,
        reader: Arc<dyn ClaimReader>,
        enforcement: Option<Arc<Enforcement>>,
        strategy: DeviceListStrategy,
        metrics: Arc<AgentMetrics>,
        state_dir: &Path,
    ) -> anyhow::Result<Self> {
        let prepared = Prepared::load(&state_dir.join("dra").join("prepared.json"))?;
        let driver = Self {
            driver: config.driver_name.clone(),
            node,
            state,
            reader,
            cdi: CdiSpecs::new(&config.cdi_dir, &config.driver_name),
            enforcement,
            strategy,
            metrics,
            prepared: Mutex::new(Prepared {
                path: prepared.path.clone(),
                claims: BTreeMap::new(),
            }),
        };
        let by_uuid = driver.state.inventory.positions_by_uuid();
        let mut restored = Vec::new();
        for (uid, claim) in &prepared.claims {
            if !claim.devices.iter().all(|d| by_uuid.contains_key(&d.uuid)) {
                tracing::warn!(%uid, "a prepared claim names a GPU this node no longer has; left out");
                continue;
            }
            let shares = driver.shares(&claim.devices);
            if let Err(err) = driver.write_cdi(uid, claim, &shares) {
                tracing::warn!(%uid, error = %format!("{err:#}"), "cannot rewrite the CDI spec of a prepared claim");
            }
            restored.push((
                uid.clone(),
                PreparedClaim {
                    owner: claim.owner.clone(),
                    shares,
                },
            ));
        }
        tracing::info!(
            claims = restored.len(),
            "prepared DRA claims restored from the checkpoint"
        );
        driver.state.restore_claims(restored);
        driver
            .prepared
            .try_lock()
            .map_err(|_| anyhow::anyhow!("checkpoint busy"))?
            .claims = prepared.claims;
        Ok(driver)
    }

    /// Brings the prepared claims in line with the cluster: adopts the claims allocated on this node
    /// and reserved for a pod that the agent does not know of (its checkpoint was lost or spoiled:
    /// their pods run, and their memory must count), then unprepares those nobody uses any more.
    ///
    /// Adopting lists every claim of the cluster, so it is done until it has succeeded once (at
    /// start); forgetting reads only the claims prepared here. Returns whether adopting is done.
    pub async fn reconcile(&self, adopt: bool) -> bool {
        let adopted = !adopt
            || match self.reader.list().await {
                Ok(claims) => {
                    for resource in claims {
                        self.adopt(&resource).await;
                    }
                    true
                }
                Err(err) => {
                    tracing::warn!(error = %err, "cannot list claims to adopt those in use; trying again");
                    false
                }
            };
        self.forget_stale().await;
        adopted
    }

    /// Records a claim allocated here and in use that was never prepared by this agent's checkpoint.
    async fn adopt(&self, resource: &ResourceClaim) {
        let in_use = resource
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .is_some_and(|r| !r.is_empty());
        let (Some(uid), Some(namespace)) =
            (resource.metadata.uid.clone(), resource.metadata.namespace.clone())
        else {
            return;
        };
        let claim = Claim {
            namespace,
            uid,
            name: resource.metadata.name.clone().unwrap_or_default(),
        };
        let mut prepared = self.prepared.lock().await;
        if !in_use || prepared.claims.contains_key(&claim.uid) {
            return;
        }
        // Claims of other drivers or nodes are not ours: no error to report for them.
        let Ok((owner, devices)) = self.shares_of(&claim, resource) else {
            return;
        };
        let shares = self.shares(&devices);
        // Its pod may be running: a GPU that turned sick since still holds it; what the node's
        // picture cannot hold (a whole GPU with memory shared out) stays refused.
        if let Err(err) = self.state.adopt_claim(
            &claim.uid,
            PreparedClaim {
                owner: owner.clone(),
                shares: shares.clone(),
            },
        ) {
            tracing::warn!(uid = %claim.uid, error = %err, "a claim allocated on this node does not fit its picture: not adopted");
            return;
        }
        let record = CheckpointClaim {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            owner,
            devices,
        };
        // Its container may be running and counting in its accounting directory: never cleared.
        if let Err(err) = self.keep(&mut prepared, &claim.uid, record, &shares, Accounting::Keep) {
            self.state.unprepare_claim(&claim.uid);
            tracing::warn!(uid = %claim.uid, error = %format!("{err:#}"), "cannot adopt a claim allocated on this node");
            return;
        }
        tracing::warn!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, "adopted a claim allocated on this node that the checkpoint did not name");
    }

    /// Makes a recorded claim's files (accounting directories, CDI spec) and puts it in the
    /// checkpoint; on an error the checkpoint is left as it was and the spec removed.
    fn keep(
        &self,
        prepared: &mut Prepared,
        uid: &str,
        record: CheckpointClaim,
        shares: &[(usize, Share)],
        accounting: Accounting,
    ) -> anyhow::Result<()> {
        let made = (|| -> anyhow::Result<()> {
            if let Some(enforcement) = &self.enforcement {
                for &(a, share) in shares {
                    if matches!(share, Share::Mib(_)) {
                        let name =
                            Enforcement::claim_allocation_name(self.state.inventory.gpus[a].index, uid);
                        match accounting {
                            Accounting::Fresh => drop(enforcement.container(&name)?),
                            Accounting::Keep => enforcement.ensure(&name)?,
                        }
                    }
                }
            }
            self.write_cdi(uid, &record, shares)?;
            prepared.claims.insert(uid.to_string(), record);
            if let Err(err) = prepared.save() {
                prepared.claims.remove(uid);
                return Err(err);
            }
            Ok(())
        })();
        if made.is_err() {
            let _ = self.cdi.remove(uid);
        }
        made
    }

    /// Unprepares the prepared claims nobody can be using any more: deleted (or made again under the
    /// same name), or no longer reserved for any pod. The kubelet unprepares a claim when its pod
    /// ends; this catches what it cannot, such as a checkpoint that outlived its cluster or a node
    /// whose pods were removed while it was down. A claim that cannot be read now is kept.
    async fn forget_stale(&self) {
        let prepared: Vec<(String, String, String)> = self
            .prepared
            .lock()
            .await
            .claims
            .iter()
            .map(|(uid, c)| (uid.clone(), c.namespace.clone(), c.name.clone()))
            .collect();
        for (uid, namespace, name) in prepared {
            let stale = match self.reader.read(&namespace, &name).await {
                Ok(None) => true,
                Ok(Some(claim)) => {
                    claim.metadata.uid.as_deref() != Some(uid.as_str())
                        || claim
                            .status
                            .as_ref()
                            .and_then(|s| s.reserved_for.as_ref())
                            .is_none_or(Vec::is_empty)
                }
                Err(err) => {
                    tracing::debug!(%uid, error = %err, "cannot check a prepared claim; keeping it");
                    false
                }
            };
            if stale {
                tracing::warn!(claim = %format!("{namespace}/{name}"), %uid, "a prepared claim is no longer used by any pod: unpreparing it");
                let claim = Claim { namespace, uid, name };
                if let Err(err) = self.unprepare(&claim).await {
                    tracing::warn!(uid = %claim.uid, error = %err, "cannot unprepare a stale claim");
                }
            }
        }
    }

    /// The claim's results on this node, as shares of GPUs: each device's `consumedCapacity.memory`,
    /// the whole GPU when it consumed all of it (or the device is not shared).
    fn shares_of(
        &self,
        claim: &Claim,
        resource: &ResourceClaim,
    ) -> Result<(String, Vec<PreparedDevice>), String> {
        let id = format!("{}/{}", claim.namespace, claim.name);
        if resource.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
            return Err(format!(
                "ResourceClaim {id} has UID {:?}, the kubelet asked for {}: it was deleted and made again",
                resource.metadata.uid.as_deref().unwrap_or(""),
                claim.uid
            ));
        }
        if resource.status.as_ref().is_none_or(|s| s.allocation.is_none()) {
            return Err(format!("ResourceClaim {id} is not allocated"));
        }
        let owner = slice::claim_holder(resource);
        let mut devices: Vec<PreparedDevice> = Vec::new();
        for held in slice::held_devices(resource, &self.driver) {
            if held.pool != self.node {
                return Err(format!(
                    "ResourceClaim {id}: device {} is in pool {:?}, this node's pool is {:?}",
                    held.device, held.pool, self.node
                ));
            }
            let a = held
                .index
                .and_then(|index| self.state.position(index))
                .ok_or_else(|| format!("ResourceClaim {id}: this node has no device {:?}", held.device))?;
            let whole = slice::offered_mib(&self.state.inventory, a, self.state.unit_mib);
            let share = match held
                .consumed_mib
                .map_err(|e| format!("ResourceClaim {id}: {e}"))?
            {
                Some(mib) if mib < whole => Share::Mib(mib),
                _ => Share::Whole,
            };
            devices.push(PreparedDevice {
                request: held.request,
                device: held.device,
                share_id: held.share_id,
                uuid: self.state.inventory.gpus[a].uuid.clone(),
                share,
            });
        }
        if devices.is_empty() {
            return Err(format!(
                "ResourceClaim {id} has no device of driver {} allocated",
                self.driver
            ));
        }
        let gpus = self.shares(&devices);
        let shared = gpus.iter().filter(|(_, s)| matches!(s, Share::Mib(_))).count();
        if shared > 0 && gpus.len() > 1 {
            return Err(format!(
                "ResourceClaim {id}: memory is served from ONE GPU per claim, with no other GPU in it \
                 ({} GPUs, {shared} of them shared); ask for each GPU's memory in a claim of its own",
                gpus.len()
            ));
        }
        Ok((owner, devices))
    }

    /// What a container using the claim gets, as a CDI spec: one CDI device per GPU.
    fn edits(&self, uid: &str, claim: &CheckpointClaim, shares: &[(usize, Share)]) -> ClaimEdits {
        let mut edits = ClaimEdits::default();
        let mut gpus: Vec<(String, String)> = Vec::new();
        for d in &claim.devices {
            if !gpus.iter().any(|(device, _)| *device == d.device) {
                gpus.push((d.device.clone(), d.uuid.clone()));
            }
        }
        let uuids: Vec<&str> = gpus.iter().map(|(_, uuid)| uuid.as_str()).collect();
        if self.strategy == DeviceListStrategy::Envvar {
            edits.env.insert(VISIBLE_DEVICES_ENV.into(), uuids.join(","));
        }
        for &(a, share) in shares {
            if let Share::Mib(mib) = share {
                edits.env.insert(LIMIT_ENV.into(), mib.to_string());
                if let Some(enforcement) = &self.enforcement {
                    let name = Enforcement::claim_allocation_name(self.state.inventory.gpus[a].index, uid);
                    let (mounts, env) = enforcement.edits(&name);
                    edits.mounts.extend(mounts);
                    edits.env.extend(env);
                }
            }
        }
        edits.devices = gpus;
        edits
    }

    fn write_cdi(&self, uid: &str, claim: &CheckpointClaim, shares: &[(usize, Share)]) -> anyhow::Result<()> {
        self.cdi.write(uid, &self.edits(uid, claim, shares))
    }

    /// The kubelet's answer for a prepared claim.
    fn answer(&self, uid: &str, claim: &CheckpointClaim) -> Vec<Device> {
        claim
            .devices
            .iter()
            .map(|d| {
                let mut ids = vec![self.cdi.device_id(uid, &d.device)];
                if self.strategy == DeviceListStrategy::CdiCri {
                    // nvidia-ctk's spec gives the container the GPU's device nodes.
                    ids.push(format!("nvidia.com/gpu={}", d.uuid));
                }
                Device {
                    request_names: vec![d.request.clone()],
                    pool_name: self.node.clone(),
                    device_name: d.device.clone(),
                    cdi_device_ids: ids,
                    share_id: d.share_id.clone(),
                }
            })
            .collect()
    }

    /// Per GPU, what the results hold of it together: two requests of one claim may share one
    /// device (the sum; all of it is the whole GPU).
    fn shares(&self, devices: &[PreparedDevice]) -> Vec<(usize, Share)> {
        let by_uuid = self.state.inventory.positions_by_uuid();
        let mut shares: Vec<(usize, Share)> = Vec::new();
        for d in devices {
            let Some(&a) = by_uuid.get(&d.uuid) else { continue };
            let whole = slice::offered_mib(&self.state.inventory, a, self.state.unit_mib);
            match shares.iter_mut().find(|(g, _)| *g == a) {
                Some((_, share)) => {
                    *share = match (*share, d.share) {
                        (Share::Mib(x), Share::Mib(y)) if x + y < whole => Share::Mib(x + y),
                        _ => Share::Whole,
                    }
                }
                None => shares.push((a, d.share)),
            }
        }
        shares
    }
}

#[tonic::async_trait]
impl ClaimPreparer for DraDriver {
    async fn prepare(&self, claim: &Claim) -> Result<Vec<Device>, String> {
        let mut prepared = self.prepared.lock().await;
        if let Some(known) = prepared.claims.get(&claim.uid) {
            // Again (a kubelet restart): the same answer; the spec rewritten in case it was lost.
            let shares = self.shares(&known.devices);
            self.write_cdi(&claim.uid, known, &shares)
                .map_err(|e| format!("{e:#}"))?;
            return Ok(self.answer(&claim.uid, known));
        }
        let resource = self
            .reader
            .read(&claim.namespace, &claim.name)
            .await?
            .ok_or_else(|| format!("ResourceClaim {}/{} does not exist", claim.namespace, claim.name))?;
        let (owner, devices) = self.shares_of(claim, &resource)?;
        let shares = self.shares(&devices);
        self.state
            .prepare_claim(
                &claim.uid,
                PreparedClaim {
                    owner: owner.clone(),
                    shares: shares.clone(),
                },
            )
            .map_err(|e| e.to_string())?;
        let record = CheckpointClaim {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            owner,
            devices,
        };
        // A fresh accounting directory, as Allocate gives a new container.
        if let Err(err) = self.keep(
            &mut prepared,
            &claim.uid,
            record.clone(),
            &shares,
            Accounting::Fresh,
        ) {
            // Nothing half-done stays: the GPU's room goes back.
            self.state.unprepare_claim(&claim.uid);
            return Err(format!("{err:#}"));
        }
        let summary: Vec<String> = record
            .devices
            .iter()
            .map(|d| match d.share {
                Share::Whole => format!("{} whole", d.device),
                Share::Mib(mib) => format!("{} {mib} MiB", d.device),
            })
            .collect();
        tracing::info!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, owner = %record.owner, devices = ?summary, "prepared DRA claim");
        Ok(self.answer(&claim.uid, &record))
    }

    async fn unprepare(&self, claim: &Claim) -> Result<(), String> {
        let mut prepared = self.prepared.lock().await;
        if let Some(record) = prepared.claims.remove(&claim.uid) {
            if let Err(err) = prepared.save() {
                prepared.claims.insert(claim.uid.clone(), record);
                return Err(format!("{err:#}"));
            }
            tracing::info!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, "unprepared DRA claim");
        }
        self.state.unprepare_claim(&claim.uid);
        // Its accounting directory goes with the next sweep of gone allocations.
        self.cdi.remove(&claim.uid).map_err(|e| format!("{e:#}"))
    }

    fn served(&self, method: &'static str, claims: usize, failed: usize, seconds: f64) {
        self.metrics.observe_request(&self.driver, method, seconds);
        for _ in 0..failed {
            self.metrics.refused(&self.driver, "claim");
        }
        tracing::debug!(method, claims, failed, seconds, "DRA call served");
    }

    fn registered(&self, yes: bool) {
        self.metrics.set_registered(&self.driver, yes);
    }

    fn device_health(&self) -> Vec<DeviceHealth> {
        self.state
            .inventory
            .gpus
            .iter()
            .enumerate()
            .map(|(a, gpu)| {
                let why = self.state.unhealthy_reason(a);
                DeviceHealth {
                    device: Some(DeviceIdentifier {
                        pool_name: self.node.clone(),
                        device_name: slice::device_name(gpu.index),
                    }),
                    health: if why.is_some() {
                        HealthStatus::Unhealthy
                    } else {
                        HealthStatus::Healthy
                    } as i32,
                    message: why.map_or_else(String::new, |why| {
                        format!("GPU {} {}: {why}", gpu.index, gpu.uuid)
                    }),
                    ..Default::default()
                }
            })
            .collect()
    }

    fn health_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.state.subscribe()
    }
}
