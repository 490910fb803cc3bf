//! What a pod's ResourceClaims ask of gpumem's GPUs, and the allocation the placer writes: pure, read
//! as kube-scheduler reads them (requests, `firstAvailable` lists, CEL selectors of the request and its
//! DeviceClass, `matchAttribute`/`distinctAttribute` constraints), within what the agent can prepare.
//!
//! What the agent prepares, and so the placer allocates: a claim's memory comes from ONE GPU (one
//! limit per container: every memory request of a claim goes on the same GPU, beside no whole GPU),
//! or a claim holds whole GPUs, any number of them. A claim asking memory of several GPUs at once,
//! admin access, another driver's class beside gpumem's, or an allocation mode other than a count is
//! left to kube-scheduler with the reason ([`Unsupported`]).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult, DeviceClass,
    DeviceRequestAllocationResult, DeviceSelector, ResourceClaim,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::node::slice::{MEMORY_CAPACITY, claim_holder, held_devices, mib_quantity};
use crate::quantity::Quantity;

/// What one request (or sub-request) asks of gpumem's GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// This much memory of one GPU.
    Mib(u64),
    /// This many whole GPUs.
    Whole(u32),
}

/// One way to satisfy a request: the request itself, or one sub-request of its `firstAvailable` list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alternative {
    /// The name the allocation result gives: `request` or `request/subrequest`.
    pub result_name: String,
    pub class: String,
    /// The request's own CEL expressions (the class's come from the class).
    pub selectors: Vec<String>,
    pub need: Need,
}

/// One request of a claim: its alternatives in order (one, unless `firstAvailable`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestAsk {
    pub name: String,
    pub alternatives: Vec<Alternative>,
}

/// A constraint over the devices of some of a claim's requests (all of them when none is named).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Constraint {
    /// The requests it covers; empty: every request of the claim.
    pub requests: Vec<String>,
    /// The fully qualified attribute (`gpumem.io/nvlinkDomain`).
    pub attribute: String,
    /// `matchAttribute` (every device the same value) or `distinctAttribute` (all different).
    pub same: bool,
}

impl Constraint {
    pub fn covers(&self, request: &str) -> bool {
        self.requests.is_empty() || self.requests.iter().any(|r| r == request)
    }
}

/// A claim the placer allocates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimPlan {
    /// `namespace/name`.
    pub key: String,
    pub requests: Vec<RequestAsk>,
    pub constraints: Vec<Constraint>,
}

/// Why a claim is left to kube-scheduler: a short kind (the metric's label) and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported {
    pub kind: &'static str,
    pub why: String,
}

/// What the placer does with one of a pod's claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimAsk {
    /// No request names one of gpumem's DeviceClasses.
    NotOurs,
    /// Allocated already (shared by several pods, or allocated by someone else).
    Allocated,
    Place(ClaimPlan),
    /// gpumem's, in a form the placer does not place: kube-scheduler allocates it.
    Unsupported(Unsupported),
}

fn unsupported(kind: &'static str, why: impl Into<String>) -> ClaimAsk {
    ClaimAsk::Unsupported(Unsupported {
        kind,
        why: why.into(),
    })
}

/// The `cel.expression`s of `selectors`; `Err` for a selector of another kind.
fn expressions(selectors: Option<&Vec<DeviceSelector>>) -> Result<Vec<String>, String> {
    selectors
        .into_iter()
        .flatten()
        .map(|s| {
            s.cel
                .as_ref()
                .map(|c| c.expression.clone())
                .ok_or_else(|| "a selector that is not CEL".to_string())
        })
        .collect()
}

/// What one request or sub-request asks, if the placer can place it.
fn need_of(
    allocation_mode: Option<&str>,
    count: Option<i64>,
    capacity: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
) -> Result<Need, ClaimAsk> {
    match allocation_mode {
        None | Some("ExactCount") => {}
        Some(mode) => return Err(unsupported("allocation_mode", format!("allocationMode {mode}"))),
    }
    let count = count.unwrap_or(1);
    let Some(count) = u32::try_from(count)
        .ok()
        .filter(|c| (1..=crate::alloc::MAX_GPUS_PER_NODE as u32).contains(c))
    else {
        return Err(unsupported("count", format!("a count of {count}")));
    };
    if let Some(other) = capacity.and_then(|c| c.keys().find(|k| *k != MEMORY_CAPACITY)) {
        return Err(unsupported("capacity", format!("capacity {other:?}")));
    }
    match capacity.and_then(|c| c.get(MEMORY_CAPACITY)) {
        None => Ok(Need::Whole(count)),
        Some(_) if count > 1 => Err(unsupported(
            "memory_of_several_gpus",
            "memory of several GPUs in one request (the agent serves a claim's memory from one GPU: \
             ask for each GPU's memory in a claim of its own)",
        )),
        Some(q) => match Quantity::parse(&q.0).and_then(|q| q.mib_ceil()) {
            Ok(mib) if mib > 0 => Ok(Need::Mib(mib)),
            Ok(_) => Err(unsupported("no_memory", "a request for no memory")),
            Err(e) => Err(unsupported("bad_quantity", format!("memory {:?}: {e}", q.0))),
        },
    }
}

/// Reads what `claim` asks, for gpumem's DeviceClasses `classes`.
pub fn claim_ask(claim: &ResourceClaim, classes: &[String]) -> ClaimAsk {
    if claim.status.as_ref().is_some_and(|s| s.allocation.is_some()) {
        return ClaimAsk::Allocated;
    }
    let devices = claim.spec.devices.as_ref();
    let requests = devices.and_then(|d| d.requests.as_deref()).unwrap_or_default();
    let ours = |class: &str| classes.iter().any(|c| c == class);
    let classes_of = |r: &k8s_openapi::api::resource::v1::DeviceRequest| -> Vec<String> {
        r.exactly
            .iter()
            .map(|e| e.device_class_name.clone())
            .chain(
                r.first_available
                    .iter()
                    .flatten()
                    .map(|s| s.device_class_name.clone()),
            )
            .collect()
    };
    if !requests.iter().flat_map(classes_of).any(|c| ours(&c)) {
        return ClaimAsk::NotOurs;
    }
    let mut asks = Vec::with_capacity(requests.len());
    for request in requests {
        if let Some(other) = classes_of(request).into_iter().find(|c| !ours(c)) {
            return unsupported(
                "other_class",
                format!(
                    "request {:?} names DeviceClass {other:?}, not one of gpumem's",
                    request.name
                ),
            );
        }
        let mut alternatives = Vec::new();
        let with_name = |ask: ClaimAsk| match ask {
            ClaimAsk::Unsupported(u) => ClaimAsk::Unsupported(Unsupported {
                kind: u.kind,
                why: format!("request {:?}: {}", request.name, u.why),
            }),
            other => other,
        };
        if let Some(exactly) = &request.exactly {
            if exactly.admin_access == Some(true) {
                return with_name(unsupported("admin_access", "admin access"));
            }
            if exactly.tolerations.as_ref().is_some_and(|t| !t.is_empty()) {
                return with_name(unsupported("device_tolerations", "device taint tolerations"));
            }
            let capacity = exactly.capacity.as_ref().and_then(|c| c.requests.as_ref());
            let need = match need_of(exactly.allocation_mode.as_deref(), exactly.count, capacity) {
                Ok(need) => need,
                Err(ask) => return with_name(ask),
            };
            let selectors = match expressions(exactly.selectors.as_ref()) {
                Ok(s) => s,
                Err(e) => return with_name(unsupported("selector", e)),
            };
            alternatives.push(Alternative {
                result_name: request.name.clone(),
                class: exactly.device_class_name.clone(),
                selectors,
                need,
            });
        }
        for sub in request.first_available.iter().flatten() {
            if sub.tolerations.as_ref().is_some_and(|t| !t.is_empty()) {
                return with_name(unsupported("device_tolerations", "device taint tolerations"));
            }
            let capacity = sub.capacity.as_ref().and_then(|c| c.requests.as_ref());
            let need = match need_of(sub.allocation_mode.as_deref(), sub.count, capacity) {
                Ok(need) => need,
                Err(ask) => return with_name(ask),
            };
            let selectors = match expressions(sub.selectors.as_ref()) {
                Ok(s) => s,
                Err(e) => return with_name(unsupported("selector", e)),
            };
            alternatives.push(Alternative {
                result_name: format!("{}/{}", request.name, sub.name),
                class: sub.device_class_name.clone(),
                selectors,
                need,
            });
        }
        if alternatives.is_empty() {
            return with_name(unsupported("empty_request", "neither exactly nor firstAvailable"));
        }
        asks.push(RequestAsk {
            name: request.name.clone(),
            alternatives,
        });
    }
    let mut constraints = Vec::new();
    for c in devices.and_then(|d| d.constraints.as_ref()).into_iter().flatten() {
        let requests = c.requests.clone().unwrap_or_default();
        match (&c.match_attribute, &c.distinct_attribute) {
            (Some(a), None) => constraints.push(Constraint {
                requests,
                attribute: a.clone(),
                same: true,
            }),
            (None, Some(a)) => constraints.push(Constraint {
                requests,
                attribute: a.clone(),
                same: false,
            }),
            _ => {
                return unsupported(
                    "constraint",
                    "a constraint that is neither matchAttribute nor distinctAttribute",
                );
            }
        }
    }
    ClaimAsk::Place(ClaimPlan {
        key: claim_key(claim),
        requests: asks,
        constraints,
    })
}

/// `namespace/name` of a claim.
pub fn claim_key(claim: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

/// A claim's allocation on one of the driver's devices, as the placer counts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatedShare {
    pub node: String,
    /// The GPU's NVML index.
    pub index: u32,
    /// MiB consumed; `None` = the whole GPU.
    pub mib: Option<u64>,
    /// Who holds it, as the agent's usage annotation will list it once prepared.
    pub owner: String,
}

/// The shares `claim` holds on `driver`'s devices (none when it is not allocated). A consumed memory
/// that is not a quantity (which the agent refuses to prepare) holds the whole GPU: room is never
/// promised twice.
pub fn allocated_shares(claim: &ResourceClaim, driver: &str) -> Vec<AllocatedShare> {
    let owner = claim_holder(claim);
    held_devices(claim, driver)
        .into_iter()
        .filter_map(|held| {
            Some(AllocatedShare {
                node: held.pool,
                index: held.index?,
                mib: held.consumed_mib.ok().flatten(),
                owner: owner.clone(),
            })
        })
        .collect()
}

/// The share ID of the `n`th result gpumem writes into a claim: the claim's UID for the first, and for
/// the others the UID with its last group counted up by `n` (a device may serve two requests of one
/// claim, each result needs its own share; the same IDs on a retry).
pub fn share_id(uid: &str, n: usize) -> String {
    if n == 0 {
        return uid.to_string();
    }
    match uid.rsplit_once('-') {
        Some((head, last)) if last.len() == 12 && u64::from_str_radix(last, 16).is_ok() => {
            let value = u64::from_str_radix(last, 16).unwrap_or(0);
            let next = value.wrapping_add(n as u64) & 0xffff_ffff_ffff;
            format!("{head}-{next:012x}")
        }
        _ => format!("{uid}-{n}"),
    }
}

/// Whether gpumem wrote `claim`'s allocation: its results of `driver` carry the share IDs
/// [`share_id`] gives (kube-scheduler's allocator makes up fresh ones).
pub fn placed_by_gpumem(claim: &ResourceClaim, driver: &str) -> bool {
    let Some(uid) = claim.metadata.uid.as_deref() else {
        return false;
    };
    let held = held_devices(claim, driver);
    !held.is_empty()
        && held
            .iter()
            .enumerate()
            .all(|(n, h)| h.share_id.as_deref() == Some(share_id(uid, n).as_str()))
}

/// One device the placer chose for a claim's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Picked {
    /// The result's request name (`request` or `request/subrequest`).
    pub result_name: String,
    /// The request's DeviceClass (its configuration goes with the result).
    pub class: String,
    /// NVML index, and the MiB it consumes there.
    pub index: u32,
    pub mib: u64,
}

/// The allocation the placer writes into `claim`: each pick a result on `node`, a share of the GPU's
/// `memory` ([`share_id`]), with the classes' and the claim's configuration, and a node selector for
/// `node`.
pub fn allocation_result(
    claim: &ResourceClaim,
    classes: &BTreeMap<String, DeviceClass>,
    driver: &str,
    node: &str,
    picks: &[Picked],
) -> AllocationResult {
    let uid = claim.metadata.uid.as_deref().unwrap_or_default();
    let results = picks
        .iter()
        .enumerate()
        .map(|(n, pick)| DeviceRequestAllocationResult {
            request: pick.result_name.clone(),
            driver: driver.to_string(),
            pool: node.to_string(),
            device: crate::node::slice::device_name(pick.index),
            share_id: Some(share_id(uid, n)),
            consumed_capacity: Some(BTreeMap::from([(
                MEMORY_CAPACITY.to_string(),
                mib_quantity(pick.mib),
            )])),
            ..Default::default()
        })
        .collect();
    // As kube-scheduler: each class's configuration for the requests that used it, then the claim's.
    let mut config: Vec<DeviceAllocationConfiguration> = Vec::new();
    let mut used: Vec<&str> = picks.iter().map(|p| p.class.as_str()).collect();
    used.dedup();
    for class in used {
        let requests: Vec<String> = picks
            .iter()
            .filter(|p| p.class == class)
            .map(|p| p.result_name.clone())
            .collect();
        let class_config = classes.get(class).and_then(|c| c.spec.config.as_ref());
        for c in class_config.into_iter().flatten() {
            config.push(DeviceAllocationConfiguration {
                opaque: c.opaque.clone(),
                requests: Some(requests.clone()),
                source: "FromClass".into(),
            });
        }
    }
    let claim_config = claim.spec.devices.as_ref().and_then(|d| d.config.as_ref());
    for c in claim_config.into_iter().flatten() {
        config.push(DeviceAllocationConfiguration {
            opaque: c.opaque.clone(),
            requests: c.requests.clone(),
            source: "FromClaim".into(),
        });
    }
    AllocationResult {
        allocation_timestamp: Some(Time(k8s_openapi::jiff::Timestamp::now())),
        devices: Some(DeviceAllocationResult {
            config: (!config.is_empty()).then_some(config),
            results: Some(results),
        }),
        node_selector: Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_fields: Some(vec![NodeSelectorRequirement {
                    key: "metadata.name".into(),
                    operator: "In".into(),
                    values: Some(vec![node.to_string()]),
                }]),
                ..Default::default()
            }],
        }),
    }
}

/// The names of `pod`'s ResourceClaims, in its order; `None` while one made from a template is not
/// created yet (the resource claim controller records it in the pod's status).
pub fn claim_names(pod: &Pod) -> Option<Vec<String>> {
    let entries = pod.spec.as_ref().and_then(|s| s.resource_claims.as_ref());
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref());
    entries
        .into_iter()
        .flatten()
        .filter_map(|e| match &e.resource_claim_name {
            Some(name) => Some(Some(name.clone())),
            None => {
                let Some(statuses) = statuses else {
                    return Some(None);
                };
                match statuses.iter().find(|s| s.name == e.name) {
                    // The controller records a template it made no claim for (none needed) with no name.
                    Some(s) => s.resource_claim_name.clone().map(Some),
                    None => Some(None),
                }
            }
        })
        .collect()
}

/// Claims and allocations the placer's tests share.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;
    use k8s_openapi::api::resource::v1::{
        CapacityRequirements, DeviceClaim, DeviceRequest, ExactDeviceRequest, ResourceClaimSpec,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity as Q;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    pub const UID: &str = "0b7e7c34-5a0e-4d5c-9a43-6f4f4d1d2a11";

    /// Claim `ns/c` with the requests `requests`.
    pub fn claim_of(requests: Vec<DeviceRequest>) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                name: Some("c".into()),
                namespace: Some("ns".into()),
                uid: Some(UID.into()),
                ..Default::default()
            },
            spec: ResourceClaimSpec {
                devices: Some(DeviceClaim {
                    requests: Some(requests),
                    ..Default::default()
                }),
            },
            status: None,
        }
    }

    /// Claim `ns/c` with one request `gpu`.
    pub fn claim(exactly: ExactDeviceRequest) -> ResourceClaim {
        claim_of(vec![DeviceRequest {
            name: "gpu".into(),
            exactly: Some(exactly),
            ..Default::default()
        }])
    }

    /// A request of class `gpu.gpumem.io` for memory `q`.
    pub fn memory(q: &str) -> ExactDeviceRequest {
        ExactDeviceRequest {
            device_class_name: "gpu.gpumem.io".into(),
            capacity: Some(CapacityRequirements {
                requests: Some(BTreeMap::from([("memory".into(), Q(q.into()))])),
            }),
            ..Default::default()
        }
    }

    /// The allocation of `claim`'s request `gpu` on `node`: (NVML index, MiB) per GPU.
    pub fn alloc(claim: &ResourceClaim, node: &str, gpus: &[(u32, u64)]) -> AllocationResult {
        let picks: Vec<Picked> = gpus
            .iter()
            .map(|&(index, mib)| Picked {
                result_name: "gpu".into(),
                class: "gpu.gpumem.io".into(),
                index,
                mib,
            })
            .collect();
        allocation_result(claim, &BTreeMap::new(), "gpumem.io", node, &picks)
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;
    use k8s_openapi::api::resource::v1::{
        DeviceClassConfiguration, DeviceClassSpec, DeviceConstraint, DeviceRequest, DeviceSubRequest,
        ExactDeviceRequest, OpaqueDeviceConfiguration, ResourceClaimConsumerReference, ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn classes() -> Vec<String> {
        vec!["gpu.gpumem.io".to_string()]
    }

    /// What a claim of `ns/c` with these (request, need) asks, with no selectors or constraints.
    fn place(requests: &[(&str, Need)]) -> ClaimAsk {
        ClaimAsk::Place(ClaimPlan {
            key: "ns/c".into(),
            requests: requests
                .iter()
                .map(|(name, need)| RequestAsk {
                    name: name.to_string(),
                    alternatives: vec![Alternative {
                        result_name: name.to_string(),
                        class: "gpu.gpumem.io".into(),
                        selectors: Vec::new(),
                        need: *need,
                    }],
                })
                .collect(),
            constraints: Vec::new(),
        })
    }

    #[test]
    fn claims_are_read_as_memory_or_whole_gpus() {
        let ask = |e| claim_ask(&claim(e), &classes());
        assert_eq!(ask(memory("5000Mi")), place(&[("gpu", Need::Mib(5000))]));
        // `5k` bytes is a fraction of a MiB: one MiB, never zero.
        assert_eq!(ask(memory("5k")), place(&[("gpu", Need::Mib(1))]));
        let whole = ExactDeviceRequest {
            device_class_name: "gpu.gpumem.io".into(),
            count: Some(2),
            ..Default::default()
        };
        assert_eq!(ask(whole), place(&[("gpu", Need::Whole(2))]));
        let other = ExactDeviceRequest {
            device_class_name: "nic.example.com".into(),
            ..Default::default()
        };
        assert_eq!(ask(other), ClaimAsk::NotOurs);
    }

    #[test]
    fn forms_the_scorer_does_not_place_are_left_to_kube_scheduler() {
        let unsupported =
            |e: ExactDeviceRequest| matches!(claim_ask(&claim(e), &classes()), ClaimAsk::Unsupported(_));
        let mut not_cel = memory("1Gi");
        not_cel.selectors = Some(vec![Default::default()]);
        assert!(unsupported(not_cel));
        let mut admin = memory("1Gi");
        admin.admin_access = Some(true);
        assert!(unsupported(admin));
        let mut several = memory("1Gi");
        several.count = Some(2);
        assert!(unsupported(several));
        let mut all = memory("1Gi");
        all.allocation_mode = Some("All".into());
        assert!(unsupported(all));
        assert!(unsupported(memory("0")));
        assert!(unsupported(memory("lots")));
        let mut allocated = claim(memory("1Gi"));
        allocated.status = Some(ResourceClaimStatus {
            allocation: Some(AllocationResult::default()),
            ..Default::default()
        });
        assert_eq!(claim_ask(&allocated, &classes()), ClaimAsk::Allocated);
    }

    #[test]
    fn an_allocation_reads_back_as_the_shares_it_wrote() {
        let c = claim(memory("5000Mi"));
        let a = alloc(&c, "node-1", &[(2, 5000)]);
        let results = a
            .devices
            .as_ref()
            .and_then(|d| d.results.clone())
            .unwrap_or_default();
        assert_eq!(results.len(), 1);
        assert_eq!(results[0].device, "gpu-2");
        assert_eq!(results[0].pool, "node-1");
        assert_eq!(results[0].share_id.as_deref(), c.metadata.uid.as_deref());
        let selector = serde_json::to_value(&a.node_selector).unwrap_or_default();
        assert_eq!(
            selector["nodeSelectorTerms"][0]["matchFields"][0]["values"][0],
            "node-1"
        );
        let mut allocated = c.clone();
        allocated.status = Some(ResourceClaimStatus {
            allocation: Some(a),
            reserved_for: Some(vec![ResourceClaimConsumerReference {
                resource: "pods".into(),
                name: "p".into(),
                uid: "u".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        assert_eq!(
            allocated_shares(&allocated, "gpumem.io"),
            vec![AllocatedShare {
                node: "node-1".into(),
                index: 2,
                mib: Some(5000),
                owner: "ns/p".into()
            }]
        );
        assert!(allocated_shares(&allocated, "other.driver").is_empty());
    }

    #[test]
    fn claim_names_wait_for_the_controller() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {
                "containers": [],
                "resourceClaims": [
                    {"name": "gpu", "resourceClaimTemplateName": "t"},
                    {"name": "own", "resourceClaimName": "mine"},
                    {"name": "none", "resourceClaimTemplateName": "u"}
                ]
            }
        }))
        .unwrap_or_default();
        assert_eq!(claim_names(&pod), None);
        let mut made = pod.clone();
        made.status = serde_json::from_value(serde_json::json!({
            "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x7k2q"}]
        }))
        .ok();
        assert_eq!(claim_names(&made), None, "one template's claim is not made yet");
        // The controller records a template that needs no claim without a name.
        made.status = serde_json::from_value(serde_json::json!({
            "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x7k2q"}, {"name": "none"}]
        }))
        .ok();
        assert_eq!(
            claim_names(&made),
            Some(vec!["p-gpu-x7k2q".to_string(), "mine".to_string()])
        );
    }

    #[test]
    fn selectors_lists_constraints_and_several_requests_are_read() {
        let mut t4 = memory("4Gi");
        t4.selectors = serde_json::from_value(serde_json::json!([
            {"cel": {"expression": "device.attributes[\"gpumem.io\"].productName == \"Tesla T4\""}}
        ]))
        .ok();
        let whole = ExactDeviceRequest {
            device_class_name: "gpu.gpumem.io".into(),
            count: Some(2),
            ..Default::default()
        };
        let sub = |name: &str, count| DeviceSubRequest {
            name: name.into(),
            device_class_name: "gpu.gpumem.io".into(),
            count: Some(count),
            ..Default::default()
        };
        let mut c = claim_of(vec![
            DeviceRequest {
                name: "small".into(),
                exactly: Some(t4),
                ..Default::default()
            },
            DeviceRequest {
                name: "pair".into(),
                exactly: Some(whole),
                ..Default::default()
            },
            DeviceRequest {
                name: "any".into(),
                first_available: Some(vec![sub("four", 4), sub("two", 2)]),
                ..Default::default()
            },
        ]);
        if let Some(d) = c.spec.devices.as_mut() {
            d.constraints = Some(vec![
                DeviceConstraint {
                    match_attribute: Some("gpumem.io/nvlinkDomain".into()),
                    requests: Some(vec!["pair".into()]),
                    ..Default::default()
                },
                DeviceConstraint {
                    distinct_attribute: Some("gpumem.io/uuid".into()),
                    ..Default::default()
                },
            ]);
        }
        let ClaimAsk::Place(plan) = claim_ask(&c, &classes()) else {
            panic!("placed: {:?}", claim_ask(&c, &classes()));
        };
        assert_eq!(plan.key, "ns/c");
        let names: Vec<&str> = plan.requests.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["small", "pair", "any"]);
        assert_eq!(plan.requests[0].alternatives[0].need, Need::Mib(4096));
        assert_eq!(plan.requests[0].alternatives[0].selectors.len(), 1);
        assert_eq!(plan.requests[1].alternatives[0].need, Need::Whole(2));
        let any: Vec<(&str, Need)> = plan.requests[2]
            .alternatives
            .iter()
            .map(|a| (a.result_name.as_str(), a.need))
            .collect();
        assert_eq!(any, [("any/four", Need::Whole(4)), ("any/two", Need::Whole(2))]);
        assert!(plan.constraints[0].same && plan.constraints[0].covers("pair"));
        assert!(!plan.constraints[0].covers("small"));
        assert!(!plan.constraints[1].same && plan.constraints[1].covers("small"));

        // A request of another driver's class beside gpumem's: kube-scheduler's.
        let mut mixed = c.clone();
        if let Some(e) = mixed
            .spec
            .devices
            .as_mut()
            .and_then(|d| d.requests.as_mut())
            .and_then(|r| r[1].exactly.as_mut())
        {
            e.device_class_name = "nic.example.com".into();
        }
        assert!(matches!(
            claim_ask(&mixed, &classes()),
            ClaimAsk::Unsupported(Unsupported {
                kind: "other_class",
                ..
            })
        ));
    }

    #[test]
    fn each_result_has_its_own_share_and_the_classes_configuration() {
        assert_eq!(share_id(UID, 0), UID);
        assert_eq!(share_id(UID, 1), "0b7e7c34-5a0e-4d5c-9a43-6f4f4d1d2a12");
        assert_eq!(share_id("0-0-0-0-ffffffffffff", 1), "0-0-0-0-000000000000");
        assert_eq!(share_id("odd", 2), "odd-2");
        let c = claim(memory("1Gi"));
        let class = DeviceClass {
            metadata: ObjectMeta {
                name: Some("gpu.gpumem.io".into()),
                ..Default::default()
            },
            spec: DeviceClassSpec {
                config: Some(vec![DeviceClassConfiguration {
                    opaque: Some(OpaqueDeviceConfiguration {
                        driver: "gpumem.io".into(),
                        parameters: k8s_openapi::apimachinery::pkg::runtime::RawExtension(serde_json::json!(
                            {}
                        )),
                    }),
                }]),
                ..Default::default()
            },
        };
        let classes = BTreeMap::from([("gpu.gpumem.io".to_string(), class)]);
        let pick = |name: &str, index| Picked {
            result_name: name.into(),
            class: "gpu.gpumem.io".into(),
            index,
            mib: 1024,
        };
        let a = allocation_result(&c, &classes, "gpumem.io", "n", &[pick("a", 1), pick("b", 1)]);
        let devices = a.devices.clone().unwrap_or_default();
        let results = devices.results.unwrap_or_default();
        assert_eq!(results.len(), 2);
        assert_ne!(results[0].share_id, results[1].share_id, "one device, two shares");
        let config = devices.config.unwrap_or_default();
        assert_eq!(config.len(), 1);
        assert_eq!(config[0].source, "FromClass");
        assert_eq!(config[0].requests, Some(vec!["a".to_string(), "b".to_string()]));
        let mut allocated = c.clone();
        allocated.status = Some(ResourceClaimStatus {
            allocation: Some(a),
            ..Default::default()
        });
        assert!(placed_by_gpumem(&allocated, "gpumem.io"));
        // A hand-edited consumed memory holds the whole GPU.
        if let Some(r) = allocated
            .status
            .as_mut()
            .and_then(|s| s.allocation.as_mut())
            .and_then(|a| a.devices.as_mut())
            .and_then(|d| d.results.as_mut())
        {
            r[0].consumed_capacity = Some(BTreeMap::from([(
                "memory".to_string(),
                k8s_openapi::apimachinery::pkg::api::resource::Quantity("lots".into()),
            )]));
        }
        let shares = allocated_shares(&allocated, "gpumem.io");
        assert_eq!(shares[0].mib, None);
        assert_eq!(shares[1].mib, Some(1024));
    }
}
