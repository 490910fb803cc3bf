//! The `preempt` verb: of the victims kube-scheduler proposes, the set that frees room on one GPU
//! ([`super::victims`]), with the PodDisruptionBudgets read from the API server.

use super::extender::{ExtenderPreemptionArgs, ExtenderPreemptionResult, MetaPod, MetaVictims};
use super::pods::PodRecord;
use super::state::{NodeSnapshot, PodDemand};
use super::victims::VictimInfo;
use super::{BadRequest, Scorer, victims};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::Api;
use kube::api::ListParams;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument as _;

/// One node's victims: what the scorer knows of each pod (`None`: unknown), their UIDs, kube-scheduler's
/// PDB violation count.
type ProposedVictims = (Vec<Option<Arc<PodRecord>>>, Vec<String>, i64);
/// Victims per node.
type Proposed = BTreeMap<String, ProposedVictims>;

impl Scorer {
    /// `preempt`: per node, the victims that free room for the pod's GPUs (nodes where that cannot be
    /// done from preemptible pods are dropped). The node states and PodDisruptionBudgets are read here;
    /// the victims are chosen on tokio's blocking pool, off the async workers.
    pub async fn preempt(
        self: &Arc<Self>,
        args: ExtenderPreemptionArgs,
    ) -> Result<ExtenderPreemptionResult, BadRequest> {
        let span = self.span("preempt", args.pod.as_ref());
        self.preempt_in_span(args).instrument(span).await
    }

    async fn preempt_in_span(
        self: &Arc<Self>,
        args: ExtenderPreemptionArgs,
    ) -> Result<ExtenderPreemptionResult, BadRequest> {
        let start = Instant::now();
        let demand = self.demand(args.pod.as_ref())?;
        // Victims per node as (pod records when known, UIDs, kube-scheduler's PDB count).
        let mut proposed: Proposed = BTreeMap::new();
        if let Some(map) = args.node_name_to_victims {
            for (node, v) in map {
                let v = v.unwrap_or_default();
                let uids = v
                    .pods
                    .iter()
                    .map(|p| p.metadata.uid.clone().unwrap_or_default())
                    .collect();
                let pods = v
                    .pods
                    .iter()
                    .map(|p| PodRecord::on_node(p, &node).map(Arc::new))
                    .collect();
                proposed.insert(node, (pods, uids, v.num_pdb_violations));
            }
        } else if let Some(map) = args.node_name_to_meta_victims {
            let wanted: HashSet<&str> = map
                .values()
                .flatten()
                .flat_map(|v| v.pods.iter().map(|p| p.uid.as_str()))
                .collect();
            let known = match &self.pods {
                Some(cache) => cache.by_uids(&wanted),
                None => HashMap::new(),
            };
            for (node, v) in map {
                let v = v.unwrap_or_default();
                let uids: Vec<String> = v.pods.into_iter().map(|p| p.uid).collect();
                let pods = uids.iter().map(|u| known.get(u).cloned()).collect();
                proposed.insert(node, (pods, uids, v.num_pdb_violations));
            }
        }
        let mut result = ExtenderPreemptionResult::default();
        let d = match demand {
            Ok(Some(d)) => d,
            // Not a GPU pod (or one the filter refuses anyway): the GPU side has nothing to say.
            Ok(None) | Err(_) => {
                for (node, (_, uids, pdb)) in proposed {
                    let pods = uids.into_iter().map(|uid| MetaPod { uid }).collect();
                    result.node_name_to_meta_victims.insert(
                        node,
                        MetaVictims {
                            pods,
                            num_pdb_violations: pdb,
                        },
                    );
                }
                self.observe("preempt", start);
                return Ok(result);
            }
        };
        let pdbs = self.pdbs(&proposed).await;
        let mut nodes = Vec::with_capacity(proposed.len());
        for (node_name, victims) in proposed {
            match self.node_state(&node_name).await {
                Ok(node) => nodes.push((node_name, node, victims)),
                Err(e) => tracing::warn!("preempt: {e}"),
            }
        }
        let scorer = self.clone();
        let chosen = tokio::task::spawn_blocking(move || scorer.choose_victims(&d, nodes, pdbs.as_deref()))
            .await
            .map_err(|e| {
                tracing::error!("preempt: choosing the victims failed: {e}");
                BadRequest(format!("choosing the victims failed: {e}"))
            })?;
        self.observe("preempt", start);
        Ok(chosen)
    }

    /// The victims to keep on each node (see [`victims::select_victims`]).
    fn choose_victims(
        &self,
        d: &PodDemand,
        nodes: Vec<(String, NodeSnapshot, ProposedVictims)>,
        pdbs: Option<&[PodDisruptionBudget]>,
    ) -> ExtenderPreemptionResult {
        let mut result = ExtenderPreemptionResult::default();
        for (node_name, mut node, (pods, uids, num_pdb)) in nodes {
            self.ledger.apply(&mut node);
            if pods.iter().any(Option::is_none) {
                tracing::warn!("preempt: a victim on {node_name} is unknown to the scorer; node skipped");
                continue;
            }
            let pods: Vec<&PodRecord> = pods.iter().flatten().map(|p| p.as_ref()).collect();
            let mut victims: Vec<VictimInfo> =
                pods.iter().map(|p| VictimInfo::from_record(p, &node)).collect();
            if let Some(pdbs) = pdbs {
                victims::mark_pdb_violations(&mut victims, &pods, pdbs);
            }
            if let Some((keep, violations)) = victims::select_victims(&node, d, &victims, num_pdb) {
                result.node_name_to_meta_victims.insert(
                    node_name,
                    MetaVictims {
                        pods: keep
                            .into_iter()
                            .map(|v| MetaPod { uid: uids[v].clone() })
                            .collect(),
                        num_pdb_violations: violations,
                    },
                );
            }
        }
        result
    }

    /// The PodDisruptionBudgets of the victims' namespaces; `None` if they cannot be read.
    async fn pdbs(&self, proposed: &Proposed) -> Option<Vec<PodDisruptionBudget>> {
        let client = self.client.clone()?;
        let mut namespaces: Vec<String> = proposed
            .values()
            .flat_map(|(pods, _, _)| pods.iter().flatten())
            .map(|p| p.namespace().to_string())
            .collect();
        namespaces.sort();
        namespaces.dedup();
        let mut all = Vec::new();
        for ns in namespaces {
            match Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns)
                .list(&ListParams::default())
                .await
            {
                Ok(list) => all.extend(list.items),
                Err(e) => {
                    tracing::warn!("preempt: listing PodDisruptionBudgets in {ns}: {e}");
                    return None;
                }
            }
        }
        Some(all)
    }
}
