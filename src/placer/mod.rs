//! The DRA placer: gpumem, not kube-scheduler's first fit, allocates the ResourceClaims of the pods
//! that use gpumem's DeviceClasses (Kubernetes 1.34+, `dra` in the scorer's configuration).
//!
//! kube-scheduler 1.36 gives a claim the first device with room, in slice order, on whatever node its
//! own scoring prefers (docs/simulate.md, "KubeDRA"); it honours a claim that is already allocated, and
//! only checks that the pod can go to the allocation's node. So the placer allocates first, with the
//! extender's ranking (the policy `gpumem simulate` measures), on a node kube-scheduler would accept
//! for the pod, and kube-scheduler then only binds it.
//!
//! - [`claims`]: what a pod's claims ask (requests, alternatives, selectors, constraints), the shares
//!   they hold, the allocation written; pure;
//! - [`cel`]: the CEL selectors of requests and DeviceClasses, evaluated as kube-scheduler does; pure;
//! - [`nodes`]: which nodes a pod may use (node name, selector, affinity, taints, cordon, room for its
//!   CPU, memory and pod count), as kube-scheduler's filters decide; pure;
//! - [`place`]: one node for all of a pod's claims and the GPUs of each request there; pure;
//! - [`victims`]: for a pod that fits nowhere, the pods of lower priority whose room, given back,
//!   lets it fit on one node (kube-scheduler never preempts for a gated pod); pure;
//! - [`controller`]: the watches, the one replica that places (a Lease), the writes.

pub mod cel;
pub mod claims;
pub mod controller;
pub mod nodes;
pub mod place;
pub mod victims;

use std::sync::Arc;

use kube::Client;

use crate::scorer::Scorer;
use crate::scorer::config::DraPlacementConfig;

/// The pod condition in which the placer says why a gated pod waits (`False`, reason `NoRoom`, the
/// reason as its log and Events say it) and, once it is placed after waiting, that it is (`True`). It
/// leaves `PodScheduled` (`SchedulingGated`) to the API server and kube-scheduler.
pub const PLACED_CONDITION: &str = "gpumem.io/Placed";

/// The pod annotation in which the placer says where it placed the pod's claims (`on node gpu-3:
/// claim: gpu-2 5000Mi`), written with the removal of the gate: an Event would cost a write per pod
/// on an API server that is the DRA path's limit at scale (docs/scale.md).
pub const PLACEMENT_ANNOTATION: &str = "gpumem.io/placement";

/// Starts the placer beside the scorer `scorer` (the `scorer` command's [`crate::scorer::cli::StartPlacer`]).
pub fn start(scorer: Arc<Scorer>, client: Client, config: DraPlacementConfig, identity: String) {
    tracing::info!(
        driver = %config.driver_name, classes = ?config.device_classes, gate = %config.scheduling_gate,
        "DRA placement on: claims of gated pods are allocated by gpumem"
    );
    tokio::spawn(controller::run(scorer, client, config, identity));
}
