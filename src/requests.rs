//! What a pod requests of its node, as kube-scheduler 1.36 counts it (component-helpers'
//! `PodRequests`: app containers add up, init containers set a floor, sidecars run beside both,
//! pod-level requests and overhead; a running pod's resized resources): one reading for the scorer's
//! pod cache and the DRA placer's check that a node has room (`placer::nodes`). Pure.
//!
//! Quantities: kube-scheduler adds a pod's quantities exactly and rounds the sum up (cpu to
//! millicores, bytes to whole bytes); here each container's is rounded up before adding, which differs
//! only for sub-millicore or fractional-byte requests, and then only by counting more.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::{Container, ContainerStatus, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as ApiQuantity;

use crate::quantity::Quantity;

/// The resources NodeResourcesFit weighs, in kube-scheduler's units: cpu in millicores, memory and
/// ephemeral storage in bytes, pods as a count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Resources {
    pub cpu_milli: u64,
    pub memory_bytes: u64,
    pub ephemeral_bytes: u64,
    pub pods: u64,
}

impl Resources {
    /// What `pod`, on a node, takes from it as kube-scheduler counts it (`PodInfo.CalculateResource`),
    /// pods: 1. Add these up over the node's pods that are not Succeeded or Failed (kube-scheduler does
    /// not watch those) for [`PodRules::admits`]' `in_use`. A running pod counts the larger of its spec
    /// and the resources its status reports (in-place resize, GA in 1.35).
    pub fn requested_by(pod: &Pod) -> Resources {
        pod_requests(pod, true)
    }

    /// What `pod` asks of the node it is placed on, from its spec (NodeResourcesFit's PreFilter), pods: 1.
    pub fn asked_by(pod: &Pod) -> Resources {
        pod_requests(pod, false)
    }

    /// cpu, memory, ephemeral-storage and pods of a resource list, as `framework.Resource.Add` reads
    /// them: each rounded up to the unit; absent, negative or unparsable is 0.
    pub fn of_list(list: Option<&BTreeMap<String, ApiQuantity>>) -> Resources {
        let Some(list) = list else {
            return Resources::default();
        };
        let get = |name: &str| list.get(name).and_then(|q| Quantity::parse(&q.0).ok());
        let units = |name: &str| {
            get(name).map_or(0, |q| {
                // `whole` first: the largest exact values would overflow thousandths.
                q.whole()
                    .or_else(|_| q.millis_ceil().map(|m| m.div_ceil(1000)))
                    .unwrap_or(0)
            })
        };
        Resources {
            cpu_milli: get("cpu").and_then(|q| q.millis_ceil().ok()).unwrap_or(0),
            memory_bytes: units("memory"),
            ephemeral_bytes: units("ephemeral-storage"),
            pods: units("pods"),
        }
    }

    /// Each resource the larger of the two (`maxResourceList`).
    fn max(self, other: Resources) -> Resources {
        Resources {
            cpu_milli: self.cpu_milli.max(other.cpu_milli),
            memory_bytes: self.memory_bytes.max(other.memory_bytes),
            ephemeral_bytes: self.ephemeral_bytes.max(other.ephemeral_bytes),
            pods: self.pods.max(other.pods),
        }
    }
}

/// Saturating: absurd quantities must not wrap into room.
impl std::ops::Add for Resources {
    type Output = Resources;

    fn add(self, other: Resources) -> Resources {
        Resources {
            cpu_milli: self.cpu_milli.saturating_add(other.cpu_milli),
            memory_bytes: self.memory_bytes.saturating_add(other.memory_bytes),
            ephemeral_bytes: self.ephemeral_bytes.saturating_add(other.ephemeral_bytes),
            pods: self.pods.saturating_add(other.pods),
        }
    }
}

impl std::iter::Sum for Resources {
    fn sum<I: Iterator<Item = Resources>>(iter: I) -> Resources {
        iter.fold(Resources::default(), |a, b| a + b)
    }
}

/// component-helpers' `PodRequests` as kube-scheduler calls it (PodLevelResources and
/// InPlacePodLevelResourcesVerticalScaling on, as by default in 1.36), pods: 1. `use_status`: a pod
/// on a node (`CalculateResource`), whose status may report resized resources; the pod being placed
/// is read from its spec only (NodeResourcesFit's PreFilter).
fn pod_requests(pod: &Pod, use_status: bool) -> Resources {
    let default_spec = PodSpec::default();
    let spec = pod.spec.as_ref().unwrap_or(&default_spec);
    let status = pod.status.as_ref().filter(|_| use_status);
    let statuses: HashMap<&str, &ContainerStatus> = status
        .into_iter()
        .flat_map(|s| {
            s.container_statuses
                .iter()
                .flatten()
                .chain(s.init_container_statuses.iter().flatten())
        })
        .map(|cs| (cs.name.as_str(), cs))
        .collect();
    // `IsPodResizeInfeasible`: the first PodResizePending condition decides.
    let infeasible = status
        .and_then(|s| {
            s.conditions
                .as_ref()?
                .iter()
                .find(|c| c.type_ == "PodResizePending")
        })
        .is_some_and(|c| c.reason.as_deref() == Some("Infeasible"));
    // `determineEffectiveRequests`: a resize the kubelet cannot do does not count.
    let effective = |spec: Resources, actuated: Resources, allocated: Resources| {
        if infeasible {
            actuated.max(allocated)
        } else {
            spec.max(actuated).max(allocated)
        }
    };
    let container = |c: &Container| {
        let own = Resources::of_list(c.resources.as_ref().and_then(|r| r.requests.as_ref()));
        match statuses.get(c.name.as_str()) {
            Some(cs) if cs.resources.is_some() => effective(
                own,
                Resources::of_list(cs.resources.as_ref().and_then(|r| r.requests.as_ref())),
                Resources::of_list(cs.allocated_resources.as_ref()),
            ),
            _ => own,
        }
    };

    let mut sum: Resources = spec.containers.iter().map(container).sum();
    // An init container runs beside the sidecars started before it; sidecars run on with the app.
    let (mut sidecars, mut init) = (Resources::default(), Resources::default());
    for c in spec.init_containers.iter().flatten() {
        if c.restart_policy.as_deref() == Some("Always") {
            let r = container(c);
            sum = sum + r;
            sidecars = sidecars + r;
            init = init.max(sidecars);
        } else {
            let r = Resources::of_list(c.resources.as_ref().and_then(|r| r.requests.as_ref()));
            init = init.max(r + sidecars);
        }
    }
    let mut total = sum.max(init);

    // Pod-level requests replace the containers' sum for cpu and memory (the pod-level resources
    // kube-scheduler supports besides hugepages).
    if let Some(pod_level) = spec.resources.as_ref().and_then(|r| r.requests.as_ref()) {
        let own = Resources::of_list(Some(pod_level));
        let chosen = match status.and_then(|s| s.resources.as_ref()) {
            Some(actuated) => effective(
                own,
                Resources::of_list(actuated.requests.as_ref()),
                Resources::of_list(status.and_then(|s| s.allocated_resources.as_ref())),
            ),
            None => own,
        };
        if pod_level.contains_key("cpu") {
            total.cpu_milli = chosen.cpu_milli;
        }
        if pod_level.contains_key("memory") {
            total.memory_bytes = chosen.memory_bytes;
        }
    }
    total.pods = 0;
    let overhead = Resources {
        pods: 0,
        ..Resources::of_list(spec.overhead.as_ref())
    };
    total
        + overhead
        + Resources {
            pods: 1,
            ..Resources::default()
        }
}
