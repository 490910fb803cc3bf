//! Quotas by GPU memory on the DRA path (`gpumem claims controller --dra-quotas`).
//!
//! Kubernetes 1.36's ResourceQuota counts a DRA claim by devices (`<class>.deviceclass.resource.k8s.io/
//! devices`): ten 1 GiB claims and ten whole GPUs cost the same, and a claim's consumable capacity is not
//! counted at all. So the namespace's ResourceQuota `gpumem` (the one that limits
//! `requests.nvidia.com/gpu-mem` and `requests.nvidia.com/gpu` on the device-plugin path) limits claims
//! too: this controller writes on it what the namespace's claims of gpumem's class hold
//! ([`MEMORY_USED_ANNOTATION`], [`GPUS_USED_ANNOTATION`]), and a ValidatingAdmissionPolicy (chart:
//! `dra.quotas`) refuses a new claim that would take the namespace past the quota's `hard`, with a
//! message that says by how much. The policy reads the claim with the same rule as [`claim_use`].
//!
//! - this module: what a claim holds, per namespace; the annotations; pure;
//! - [`controller`]: the watches (claims, the quotas named [`QUOTA_NAME`]) and the writes.

pub mod controller;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceQuota;
use k8s_openapi::api::resource::v1::{ExactDeviceRequest, ResourceClaim};

use crate::quantity::Quantity;

/// The ResourceQuota each namespace's limits are read from, and written on.
pub const QUOTA_NAME: &str = "gpumem";
/// MiB of GPU memory the namespace's claims of gpumem's class ask, as last counted.
pub const MEMORY_USED_ANNOTATION: &str = "gpumem.io/dra-memory-mib";
/// Whole GPUs the namespace's claims of gpumem's class ask, as last counted.
pub const GPUS_USED_ANNOTATION: &str = "gpumem.io/dra-gpus";

/// What claims hold of a namespace's quota.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Use {
    pub memory_mib: u64,
    pub gpus: u64,
}

impl std::ops::Add for Use {
    type Output = Use;
    fn add(self, other: Use) -> Use {
        Use {
            memory_mib: self.memory_mib.saturating_add(other.memory_mib),
            gpus: self.gpus.saturating_add(other.gpus),
        }
    }
}

/// What one request of `class` asks: its memory times its count, or its count of whole GPUs. A memory
/// the policy could not read either (not a quantity) counts nothing: such a claim is refused by the API
/// server's validation already.
fn exact_use(request: &ExactDeviceRequest) -> Use {
    let count = request.count.unwrap_or(1).max(0) as u64;
    let memory = request
        .capacity
        .as_ref()
        .and_then(|c| c.requests.as_ref())
        .and_then(|r| r.get("memory"));
    match memory {
        Some(q) => Use {
            memory_mib: Quantity::parse(&q.0)
                .ok()
                .and_then(|q| q.mib_ceil().ok())
                .unwrap_or(0)
                .saturating_mul(count),
            gpus: 0,
        },
        None => Use {
            memory_mib: 0,
            gpus: count,
        },
    }
}

/// What `claim` holds of its namespace's quota: per request of `class`, what it asks; for a prioritized
/// list, the most any of its alternatives of `class` asks (memory and GPUs each), whichever is taken.
pub fn claim_use(claim: &ResourceClaim, class: &str) -> Use {
    let requests = claim.spec.devices.as_ref().and_then(|d| d.requests.as_ref());
    let mut total = Use::default();
    for request in requests.into_iter().flatten() {
        if let Some(exactly) = &request.exactly {
            if exactly.device_class_name == class {
                total = total + exact_use(exactly);
            }
            continue;
        }
        let mut most = Use::default();
        for alternative in request.first_available.iter().flatten() {
            if alternative.device_class_name != class {
                continue;
            }
            let ask = exact_use(&ExactDeviceRequest {
                count: alternative.count,
                capacity: alternative.capacity.clone(),
                ..ExactDeviceRequest::default()
            });
            most.memory_mib = most.memory_mib.max(ask.memory_mib);
            most.gpus = most.gpus.max(ask.gpus);
        }
        total = total + most;
    }
    total
}

/// What the claims hold, per namespace (namespaces without a claim of `class` are absent).
pub fn uses_by_namespace<'a>(
    claims: impl IntoIterator<Item = &'a ResourceClaim>,
    class: &str,
) -> BTreeMap<String, Use> {
    let mut out: BTreeMap<String, Use> = BTreeMap::new();
    for claim in claims {
        let used = claim_use(claim, class);
        if used == Use::default() {
            continue;
        }
        let namespace = claim.metadata.namespace.clone().unwrap_or_default();
        let entry = out.entry(namespace).or_default();
        *entry = *entry + used;
    }
    out
}

/// What `quota` says its namespace's claims hold (`None`: not written yet, or edited into something
/// that is not a count).
pub fn recorded(quota: &ResourceQuota) -> Option<Use> {
    let annotations = quota.metadata.annotations.as_ref()?;
    Some(Use {
        memory_mib: annotations.get(MEMORY_USED_ANNOTATION)?.parse().ok()?,
        gpus: annotations.get(GPUS_USED_ANNOTATION)?.parse().ok()?,
    })
}

/// The merge patch that records `used` on a quota.
pub fn record_patch(used: Use) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {
        MEMORY_USED_ANNOTATION: used.memory_mib.to_string(),
        GPUS_USED_ANNOTATION: used.gpus.to_string(),
    }}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(namespace: &str, requests: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "namespace": namespace},
            "spec": {"devices": {"requests": requests}}
        }))
        .expect("claim")
    }

    const CLASS: &str = "gpu.gpumem.io";

    #[test]
    fn a_claim_holds_its_memory_times_its_count_and_its_whole_gpus() {
        let c = claim(
            "a",
            serde_json::json!([
                {"name": "m", "exactly": {"deviceClassName": CLASS, "count": 2,
                                          "capacity": {"requests": {"memory": "5000Mi"}}}},
                {"name": "w", "exactly": {"deviceClassName": CLASS, "count": 3}},
                {"name": "one", "exactly": {"deviceClassName": CLASS}},
                {"name": "gi", "exactly": {"deviceClassName": CLASS, "capacity": {"requests": {"memory": "1.5Gi"}}}},
                {"name": "odd", "exactly": {"deviceClassName": CLASS, "capacity": {"requests": {"memory": "1"}}}},
                {"name": "other", "exactly": {"deviceClassName": "nic.example.com", "count": 4}},
            ]),
        );
        // 2 x 5000 + 1536 + 1 (a byte rounds up to a MiB), 3 + 1 whole GPUs; another class counts nothing.
        assert_eq!(
            claim_use(&c, CLASS),
            Use {
                memory_mib: 11537,
                gpus: 4
            }
        );
    }

    #[test]
    fn a_prioritized_list_holds_the_most_any_alternative_asks() {
        let c = claim(
            "a",
            serde_json::json!([{"name": "gpu", "firstAvailable": [
                {"name": "big", "deviceClassName": CLASS, "capacity": {"requests": {"memory": "40000Mi"}}},
                {"name": "small", "deviceClassName": CLASS, "capacity": {"requests": {"memory": "1000Mi"}}},
                {"name": "whole", "deviceClassName": CLASS, "count": 2},
            ]}]),
        );
        assert_eq!(
            claim_use(&c, CLASS),
            Use {
                memory_mib: 40000,
                gpus: 2
            }
        );
    }

    #[test]
    fn a_claim_the_policy_reads_so() {
        // The claim tests/e2e/quotas.sh sends to the admission policy, which answers 43072 MiB.
        let c = claim(
            "a",
            serde_json::json!([
                {"name": "gpu", "firstAvailable": [
                    {"name": "big", "deviceClassName": CLASS, "capacity": {"requests": {"memory": "40000Mi"}}},
                    {"name": "small", "deviceClassName": CLASS, "capacity": {"requests": {"memory": "1000Mi"}}}]},
                {"name": "two", "exactly": {"deviceClassName": CLASS, "count": 2,
                                            "capacity": {"requests": {"memory": "1.5Gi"}}}},
            ]),
        );
        assert_eq!(claim_use(&c, CLASS).memory_mib, 43072);
    }

    #[test]
    fn namespaces_are_summed_apart_and_the_record_reads_back() {
        let mem = |ns: &str, q: &str| {
            claim(
                ns,
                serde_json::json!([{"name": "g", "exactly": {"deviceClassName": CLASS,
                                    "capacity": {"requests": {"memory": q}}}}]),
            )
        };
        let claims = [mem("a", "1000Mi"), mem("a", "2000Mi"), mem("b", "3Gi")];
        let uses = uses_by_namespace(&claims, CLASS);
        assert_eq!(uses["a"].memory_mib, 3000);
        assert_eq!(uses["b"].memory_mib, 3072);
        let mut quota: ResourceQuota = serde_json::from_value(record_patch(uses["a"])).expect("quota");
        assert_eq!(recorded(&quota), Some(uses["a"]));
        quota
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(MEMORY_USED_ANNOTATION.into(), "lots".into());
        assert_eq!(recorded(&quota), None, "edited by hand: written again");
    }
}
