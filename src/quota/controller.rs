//! The watches and writes of the quota controller: every ResourceClaim, and the ResourceQuotas named
//! [`QUOTA_NAME`]; when what a namespace's claims hold differs from what its quota records, the record
//! is written again (a merge patch of two annotations: nothing else of the quota is touched).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::ResourceQuota;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, Client};

use super::{QUOTA_NAME, Use, claim_use, record_patch, recorded};
use crate::scorer::cache::follow;

/// Events closer together than this are counted in one pass (a burst of claims, one write).
const SETTLE: Duration = Duration::from_millis(100);

#[derive(Default)]
struct Known {
    /// Each claim's namespace and what it holds, by `namespace/name`.
    claims: HashMap<String, (String, Use)>,
    /// Whether the claims' first list is in (before that, a namespace would look emptier than it is).
    claims_listed: bool,
    /// Each quota's namespace, and what it records.
    quotas: HashMap<String, Option<Use>>,
}

impl Known {
    fn on_claim(&mut self, event: &watcher::Event<ResourceClaim>, class: &str) {
        let key = |c: &ResourceClaim| {
            format!(
                "{}/{}",
                c.metadata.namespace.as_deref().unwrap_or_default(),
                c.metadata.name.as_deref().unwrap_or_default()
            )
        };
        match event {
            watcher::Event::Init => {
                self.claims.clear();
                self.claims_listed = false;
            }
            watcher::Event::InitApply(c) | watcher::Event::Apply(c) => {
                let namespace = c.metadata.namespace.clone().unwrap_or_default();
                self.claims.insert(key(c), (namespace, claim_use(c, class)));
            }
            watcher::Event::Delete(c) => {
                self.claims.remove(&key(c));
            }
            watcher::Event::InitDone => self.claims_listed = true,
        }
    }

    fn on_quota(&mut self, event: &watcher::Event<ResourceQuota>) {
        let namespace = |q: &ResourceQuota| q.metadata.namespace.clone().unwrap_or_default();
        match event {
            watcher::Event::Init => self.quotas.clear(),
            watcher::Event::InitApply(q) | watcher::Event::Apply(q) => {
                self.quotas.insert(namespace(q), recorded(q));
            }
            watcher::Event::Delete(q) => {
                self.quotas.remove(&namespace(q));
            }
            watcher::Event::InitDone => {}
        }
    }

    /// The quotas whose record is not what their namespace's claims hold, with what they hold.
    fn due(&self) -> Vec<(String, Use)> {
        if !self.claims_listed {
            return Vec::new();
        }
        let mut held: HashMap<&str, Use> = HashMap::new();
        for (namespace, used) in self.claims.values() {
            let entry = held.entry(namespace.as_str()).or_default();
            *entry = *entry + *used;
        }
        self.quotas
            .iter()
            .filter_map(|(namespace, recorded)| {
                let now = held.get(namespace.as_str()).copied().unwrap_or_default();
                (*recorded != Some(now)).then(|| (namespace.clone(), now))
            })
            .collect()
    }
}

fn lock(known: &Mutex<Known>) -> std::sync::MutexGuard<'_, Known> {
    known.lock().unwrap_or_else(|e| e.into_inner())
}

/// Keeps every quota's record true, for as long as the process runs: claims of `class` count.
pub async fn run(client: Client, class: String) {
    let known = Arc::new(Mutex::new(Known::default()));
    let changed = Arc::new(tokio::sync::Notify::new());
    let (k, n) = (Arc::clone(&known), Arc::clone(&changed));
    follow::<ResourceClaim>(
        client.clone(),
        watcher::Config::default(),
        "resourceclaim",
        move |e| {
            lock(&k).on_claim(e, &class);
            n.notify_one();
        },
        || (),
    );
    let (k, n) = (Arc::clone(&known), Arc::clone(&changed));
    follow::<ResourceQuota>(
        client.clone(),
        watcher::Config::default().fields(&format!("metadata.name={QUOTA_NAME}")),
        "resourcequota",
        move |e| {
            lock(&k).on_quota(e);
            n.notify_one();
        },
        || (),
    );
    tracing::info!(
        "DRA quotas: recording what each namespace's claims hold on its ResourceQuota {QUOTA_NAME}"
    );
    loop {
        changed.notified().await;
        tokio::time::sleep(SETTLE).await;
        let due = lock(&known).due();
        for (namespace, used) in due {
            let quotas: Api<ResourceQuota> = Api::namespaced(client.clone(), &namespace);
            let patch = Patch::Merge(record_patch(used));
            match quotas.patch(QUOTA_NAME, &PatchParams::default(), &patch).await {
                Ok(_) => tracing::info!(
                    %namespace, memory_mib = used.memory_mib, gpus = used.gpus,
                    "recorded what the namespace's claims hold on its quota"
                ),
                // Gone meanwhile: its delete event follows.
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => {
                    tracing::warn!(%namespace, "cannot record the claims' use on the quota: {e}");
                    // Tried again on the next event; with none, after a while.
                    let retry = Arc::clone(&changed);
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        retry.notify_one();
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(namespace: &str, name: &str, memory: &str) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "gpu.gpumem.io",
                "capacity": {"requests": {"memory": memory}}}}]}}
        }))
        .expect("claim")
    }

    fn quota(namespace: &str, annotations: serde_json::Value) -> ResourceQuota {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": QUOTA_NAME, "namespace": namespace, "annotations": annotations}
        }))
        .expect("quota")
    }

    #[test]
    fn a_quota_is_written_when_its_record_differs_from_its_namespaces_claims() {
        let mut known = Known::default();
        let class = "gpu.gpumem.io";
        known.on_quota(&watcher::Event::Apply(quota("a", serde_json::json!({}))));
        known.on_claim(&watcher::Event::InitApply(claim("a", "one", "4000Mi")), class);
        assert_eq!(
            known.due(),
            vec![],
            "nothing is written before the claims are listed"
        );
        known.on_claim(&watcher::Event::InitDone, class);
        let four = Use {
            memory_mib: 4000,
            gpus: 0,
        };
        assert_eq!(known.due(), vec![("a".to_string(), four)]);
        known.on_quota(&watcher::Event::Apply(quota(
            "a",
            record_patch(four)["metadata"]["annotations"].clone(),
        )));
        assert_eq!(known.due(), vec![], "recorded");
        known.on_claim(&watcher::Event::Apply(claim("b", "x", "1000Mi")), class);
        assert_eq!(known.due(), vec![], "a namespace without a quota is not written");
        known.on_claim(&watcher::Event::Delete(claim("a", "one", "4000Mi")), class);
        assert_eq!(
            known.due(),
            vec![("a".to_string(), Use::default())],
            "its claim gone"
        );
    }
}
