//! `memCounting: shares`: which container a share's Allocate is for.
//!
//! The device plugin API never names the pod an allocation is for, and a share's device ID says
//! nothing of its size. The kubelet admits one pod at a time and puts it in its pod manager before
//! admitting it, so its PodResources `List` shows that pod with the devices its containers have been
//! given so far: the container being served is the first (init containers, then containers) that
//! asks a share in its spec and has none yet. Its memory is its `nvidia.com/gpu-mem` limit.

use std::collections::{BTreeSet, HashMap};

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::node::{ASSIGNED_AT_ANNOTATION, ASSIGNED_GPUS_ANNOTATION};
use crate::plugin::proto::podresources::ListPodResourcesResponse;
use crate::quantity::Quantity;

/// The container a share goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitting {
    /// `namespace/name`.
    pub owner: String,
    pub container: String,
    /// Its memory resource's limit, in units.
    pub units: u64,
    /// The GPU (UUID) the scorer chose for the pod, if it did.
    pub scorer_gpu: Option<String>,
}

/// The container the kubelet is giving a share now: among `pods` (this node's, from the API server),
/// the one the kubelet's `list` shows still without the share its spec asks for, leaving out those
/// this agent already served (`served`: owner and container). When the kubelet shows several pods so
/// (a kubelet 1.24-1.27 also lists pods that ended), the oldest scorer choice goes first, then the
/// oldest pod.
pub fn admitting(
    list: &ListPodResourcesResponse,
    pods: &[Pod],
    served: &BTreeSet<(String, String)>,
    share_resource: &str,
    mem_resource: &str,
) -> Result<Admitting, String> {
    // Per listed pod, its listed containers and whether each holds a share.
    let mut listed: HashMap<String, HashMap<&str, bool>> = HashMap::new();
    for pod in &list.pod_resources {
        let containers = listed
            .entry(format!("{}/{}", pod.namespace, pod.name))
            .or_default();
        for c in &pod.containers {
            let holds = c
                .devices
                .iter()
                .any(|d| d.resource_name == share_resource && !d.device_ids.is_empty());
            containers.insert(c.name.as_str(), holds);
        }
    }

    let mut candidates = Vec::new();
    for pod in pods {
        let meta = &pod.metadata;
        let (Some(namespace), Some(name), Some(spec)) = (&meta.namespace, &meta.name, &pod.spec) else {
            continue;
        };
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            continue;
        }
        let owner = format!("{namespace}/{name}");
        let Some(containers) = listed.get(&owner) else {
            continue;
        };
        let asks = |c: &&Container| container_units(c, share_resource).is_some_and(|n| n > 0);
        // A pod whose containers all hold their share was admitted; one with init containers only
        // is being admitted only while it is Pending (the kubelet does not list those).
        let app_waiting = spec
            .containers
            .iter()
            .filter(asks)
            .any(|c| containers.get(c.name.as_str()) != Some(&true));
        let only_init = !spec.containers.iter().any(|c| asks(&c));
        let init_waiting = only_init && phase == Some("Pending");
        if !(app_waiting || init_waiting) {
            continue;
        }
        let init = spec.init_containers.iter().flatten();
        let next = init.chain(&spec.containers).filter(asks).find(|c| {
            containers.get(c.name.as_str()) != Some(&true)
                && !served.contains(&(owner.clone(), c.name.clone()))
        });
        let Some(container) = next else {
            continue;
        };
        let annotations = meta.annotations.as_ref();
        let annotation = |key: &str| annotations.and_then(|a| a.get(key)).cloned();
        let scorer_gpu = annotation(ASSIGNED_GPUS_ANNOTATION)
            .and_then(|v| v.split(',').next().map(|g| g.trim().to_string()))
            .filter(|g| !g.is_empty());
        let order = (
            annotation(ASSIGNED_AT_ANNOTATION).is_none(),
            annotation(ASSIGNED_AT_ANNOTATION).unwrap_or_default(),
            meta.creation_timestamp.as_ref().map(|t| t.0),
        );
        candidates.push((order, owner, container, scorer_gpu));
    }
    candidates.sort_by(|a, b| a.0.cmp(&b.0));
    if candidates.len() > 1 {
        let names: Vec<&str> = candidates.iter().map(|c| c.1.as_str()).collect();
        tracing::warn!(
            pods = ?names,
            "several pods wait for a share; serving the one the scorer placed first"
        );
    }
    let Some((_, owner, container, scorer_gpu)) = candidates.into_iter().next() else {
        return Err(format!(
            "{share_resource}: no pod on this node is waiting for a share (the kubelet lists none \
             without one); the pod's spec may not have reached the API server's answer yet"
        ));
    };
    match container_units(container, mem_resource) {
        Some(units) if units > 0 => Ok(Admitting {
            owner,
            container: container.name.clone(),
            units,
            scorer_gpu,
        }),
        _ => Err(format!(
            "{share_resource}: container {} of {owner} asks a share but no {mem_resource}: a share is \
             how much of a GPU's memory, which {mem_resource} says",
            container.name
        )),
    }
}

/// The units container `container` of pod `owner` asks, from `pods` (for a share listed before this
/// agent learned its size).
pub fn asked_units(pods: &[Pod], owner: &str, container: &str, mem_resource: &str) -> Option<u64> {
    let pod = pods.iter().find(|p| {
        let m = &p.metadata;
        m.namespace
            .as_deref()
            .zip(m.name.as_deref())
            .is_some_and(|(ns, n)| format!("{ns}/{n}") == owner)
    })?;
    let spec = pod.spec.as_ref()?;
    let init = spec.init_containers.iter().flatten();
    let c = init.chain(&spec.containers).find(|c| c.name == container)?;
    container_units(c, mem_resource).filter(|&n| n > 0)
}

/// The whole number of `resource` units a container asks for (limits, as for any extended resource),
/// in any form the API server writes it (`5000` comes back as `5k`).
pub fn container_units(container: &Container, resource: &str) -> Option<u64> {
    let resources = container.resources.as_ref()?;
    let limit = resources.limits.as_ref().and_then(|m| m.get(resource));
    let quantity = limit.or_else(|| resources.requests.as_ref().and_then(|m| m.get(resource)))?;
    Quantity::parse(&quantity.0).and_then(|q| q.whole()).ok()
}

/// The pods (`namespace/name`, not ended) with a container that asks memory but no share.
pub fn without_share(pods: &[Pod], share_resource: &str, mem_resource: &str) -> Vec<String> {
    pods.iter()
        .filter(|p| {
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            !matches!(phase, Some("Succeeded" | "Failed"))
        })
        .filter(|p| {
            p.spec.as_ref().is_some_and(|spec| {
                let init = spec.init_containers.iter().flatten();
                init.chain(&spec.containers).any(|c| {
                    container_units(c, mem_resource).is_some_and(|n| n > 0)
                        && container_units(c, share_resource).is_none_or(|n| n == 0)
                })
            })
        })
        .filter_map(|p| {
            Some(format!(
                "{}/{}",
                p.metadata.namespace.as_deref()?,
                p.metadata.name.as_deref()?
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::proto::podresources::{ContainerDevices, ContainerResources, PodResources};

    const SHARE: &str = "gpumem.io/gpu-share";
    const MEM: &str = "nvidia.com/gpu-mem";

    fn pod(name: &str, containers: &[(&str, Option<&str>)], annotations: &[(&str, &str)]) -> Pod {
        let containers: Vec<serde_json::Value> = containers
            .iter()
            .map(|(c, mem)| match mem {
                Some(mem) => serde_json::json!({"name": c, "resources": {"limits": {MEM: mem, SHARE: "1"}}}),
                None => serde_json::json!({"name": c}),
            })
            .collect();
        let annotations: serde_json::Map<String, serde_json::Value> = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": name, "annotations": annotations,
                         "creationTimestamp": "2026-12-05T10:00:00Z"},
            "spec": {"containers": containers},
            "status": {"phase": "Pending"},
        }))
        .unwrap()
    }

    /// Container name and the share it holds, if any.
    type Listed<'a> = &'a [(&'a str, Option<&'a str>)];

    fn listed(pods: &[(&str, Listed)]) -> ListPodResourcesResponse {
        ListPodResourcesResponse {
            pod_resources: pods
                .iter()
                .map(|(name, containers)| PodResources {
                    name: name.to_string(),
                    namespace: "ns".into(),
                    containers: containers
                        .iter()
                        .map(|(c, share)| ContainerResources {
                            name: c.to_string(),
                            devices: share
                                .iter()
                                .map(|id| ContainerDevices {
                                    resource_name: SHARE.into(),
                                    device_ids: vec![id.to_string()],
                                    topology: None,
                                })
                                .collect(),
                            ..Default::default()
                        })
                        .collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn the_container_without_its_share_is_the_one_admitted_in_order() {
        let pods = [
            pod("running", &[("main", Some("3k"))], &[]),
            pod(
                "new",
                &[("sidecar", None), ("a", Some("5k")), ("b", Some("1000"))],
                &[(ASSIGNED_GPUS_ANNOTATION, "GPU-1")],
            ),
            pod("elsewhere", &[("main", Some("1k"))], &[]),
        ];
        let list = listed(&[
            ("running", &[("main", Some("0-s0"))]),
            ("new", &[("sidecar", None), ("a", None), ("b", None)]),
        ]);
        let none = BTreeSet::new();
        let first = admitting(&list, &pods, &none, SHARE, MEM).unwrap();
        assert_eq!(
            first,
            Admitting {
                owner: "ns/new".into(),
                container: "a".into(),
                units: 5000,
                scorer_gpu: Some("GPU-1".into()),
            },
            "5k is 5000 units; the pod the kubelet does not list is not it"
        );
        // Once `a` is served (by this agent, not yet listed), `b` is next.
        let served = BTreeSet::from([("ns/new".to_string(), "a".to_string())]);
        let second = admitting(&list, &pods, &served, SHARE, MEM).unwrap();
        assert_eq!((second.container.as_str(), second.units), ("b", 1000));
        // Every container listed with its share: nobody waits.
        let list = listed(&[
            ("running", &[("main", Some("0-s0"))]),
            (
                "new",
                &[("sidecar", None), ("a", Some("0-s1")), ("b", Some("1-s0"))],
            ),
        ]);
        let err = admitting(&list, &pods, &none, SHARE, MEM).unwrap_err();
        assert!(err.contains("no pod on this node is waiting"), "{err}");
    }

    #[test]
    fn several_waiting_pods_go_by_the_scorers_order_and_ended_pods_never_wait() {
        let mut ended = pod(
            "ended",
            &[("main", Some("9000"))],
            &[(ASSIGNED_AT_ANNOTATION, "2026-12-05T09:00:00Z")],
        );
        ended.status.as_mut().unwrap().phase = Some("Succeeded".into());
        let pods = [
            ended,
            pod(
                "later",
                &[("main", Some("2000"))],
                &[(ASSIGNED_AT_ANNOTATION, "2026-12-05T10:00:02Z")],
            ),
            pod("unplaced", &[("main", Some("3000"))], &[]),
            pod(
                "earlier",
                &[("main", Some("1000"))],
                &[(ASSIGNED_AT_ANNOTATION, "2026-12-05T10:00:01Z")],
            ),
        ];
        let list = listed(&[
            ("ended", &[("main", None)]),
            ("later", &[("main", None)]),
            ("unplaced", &[("main", None)]),
            ("earlier", &[("main", None)]),
        ]);
        let got = admitting(&list, &pods, &BTreeSet::new(), SHARE, MEM).unwrap();
        assert_eq!((got.owner.as_str(), got.units), ("ns/earlier", 1000));
    }

    #[test]
    fn a_share_without_memory_is_refused_by_name() {
        let bare: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": "p"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {SHARE: "1"}}}]},
            "status": {"phase": "Pending"},
        }))
        .unwrap();
        let list = listed(&[("p", &[("c", None)])]);
        let err = admitting(&list, &[bare], &BTreeSet::new(), SHARE, MEM).unwrap_err();
        assert!(err.contains("container c of ns/p") && err.contains(MEM), "{err}");
    }

    #[test]
    fn pods_asking_memory_without_a_share_are_named() {
        let without: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": "bare"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {MEM: "1k"}}}]},
        }))
        .unwrap();
        let pods = [pod("fine", &[("a", Some("5k")), ("b", None)], &[]), without];
        assert_eq!(without_share(&pods, SHARE, MEM), ["ns/bare"]);
    }

    #[test]
    fn asked_units_reads_the_named_container() {
        let pods = [pod("p", &[("a", Some("5k")), ("b", Some("7"))], &[])];
        assert_eq!(asked_units(&pods, "ns/p", "b", MEM), Some(7));
        assert_eq!(asked_units(&pods, "ns/p", "a", MEM), Some(5000));
        assert_eq!(asked_units(&pods, "ns/q", "a", MEM), None);
        assert_eq!(asked_units(&pods, "ns/p", "c", MEM), None);
    }
}
