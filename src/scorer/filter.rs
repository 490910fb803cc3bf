//! The `filter` and `prioritize` verbs: which nodes can take the pod, and how well each would.

use super::decide::Rejection;
use super::extender::{ExtenderArgs, ExtenderFilterResult, HostPriorities, NodeList};
use super::ledger::Reservation;
use super::metrics::ReasonLabel;
use super::state::{NodeSnapshot, PodDemand};
use super::{BadRequest, KEPT_CALLS, KEPT_FOR, Kept, Scorer, decide, extender, pod_uid};
use std::sync::Arc;
use std::time::Instant;

impl Scorer {
    /// `filter`.
    pub fn filter(&self, mut args: ExtenderArgs) -> Result<ExtenderFilterResult, BadRequest> {
        let start = Instant::now();
        let _span = self.span("filter", args.pod.as_ref()).entered();
        let demand = self.demand(args.pod.as_ref())?;
        let states = self.candidates(&args)?;
        let mut result = ExtenderFilterResult::default();
        let mut keep = vec![true; states.len()];
        // With a shortlist: the scores `prioritize` is to answer, by position in `states`, and the
        // hold on the node ranked first.
        let mut scores: Option<Vec<i64>> = None;
        let mut best = None;
        let mut reject = |i: usize, r: Rejection, result: &mut ExtenderFilterResult| {
            keep[i] = false;
            self.metrics
                .rejections
                .get_or_create(&ReasonLabel { reason: r.category })
                .inc();
            let name = states[i].name.clone();
            if r.unresolvable {
                result
                    .failed_and_unresolvable_nodes
                    .insert(name.clone(), r.reason.clone());
            }
            result.failed_nodes.insert(name, r.reason);
        };
        match demand {
            Err(reason) => {
                // Once, not per node: the reason may quote the pod's annotations.
                let reason = decide::bounded_reason(reason);
                for i in 0..states.len() {
                    reject(
                        i,
                        Rejection {
                            reason: reason.clone(),
                            category: "bad_pod",
                            unresolvable: true,
                        },
                        &mut result,
                    );
                }
            }
            Ok(None) => {}
            Ok(Some(d)) => {
                if let Some(pod) = &args.pod {
                    self.filtered.remember(&d, pod);
                }
                let now = k8s_openapi::jiff::Timestamp::now();
                for (i, s) in states.iter().enumerate() {
                    if let Some(reason) = s.restarting(now) {
                        reject(i, Rejection::new(reason, "agent_restarting", true), &mut result);
                    } else if let Err(r) = decide::check(s, &d) {
                        reject(i, r, &mut result);
                    }
                }
                // A pod no node can take arrived all the same: it counts in the learned mix (a pod
                // that is placed counts at its bind, after the decision, as in `gpumem simulate`).
                if let Some(first) = states.first()
                    && !keep.iter().any(|k| *k)
                {
                    self.learn(&d, d.memory_mib(first.unit_mib));
                }
                let shortlist = self.config.filter_shortlist;
                let kept = keep.iter().filter(|k| **k).count();
                if shortlist > 0 && kept > shortlist {
                    let (ranked, first) = self.shortlist(&states, &d, shortlist, &mut keep);
                    scores = Some(ranked);
                    best = first;
                }
                // kube-scheduler binds a pod that one node passed without asking `prioritize`: its
                // hold starts here, or the next pods are offered the same room before the bind.
                if kept == 1
                    && let Some(i) = keep.iter().position(|k| *k)
                {
                    self.hold_alone(&states[i], &d);
                }
            }
        }
        if let Some(list) = args.nodes.take() {
            let items = list
                .items
                .into_iter()
                .zip(&keep)
                .filter(|(_, k)| **k)
                .map(|(n, _)| n)
                .collect();
            result.nodes = Some(NodeList {
                items,
                metadata: if list.metadata.is_null() {
                    serde_json::json!({})
                } else {
                    list.metadata
                },
                ..list
            });
        } else {
            // The request's own names, in its order (the states are in the same order): handed back
            // as they came when every node passes, else the kept ones copied into one buffer.
            let names = args.node_names.take().unwrap_or_default();
            let names = if keep.iter().all(|k| *k) {
                names
            } else {
                names.keep(&keep)
            };
            if let Some(pod_uid) = pod_uid(args.pod.as_ref()) {
                let states = states.into_iter().zip(&keep).filter(|(_, k)| **k).map(|(s, _)| s);
                let scores = scores.map(|all| {
                    all.into_iter()
                        .zip(&keep)
                        .filter(|(_, k)| **k)
                        .map(|(s, _)| s)
                        .collect()
                });
                let kept = Kept {
                    pod_uid,
                    names: names.clone(),
                    states: states.collect(),
                    scores,
                    best,
                    at: Instant::now(),
                };
                let mut all = self.kept.lock().unwrap_or_else(|e| e.into_inner());
                all.retain(|k| k.pod_uid != kept.pod_uid && k.at.elapsed() < KEPT_FOR);
                if all.len() >= KEPT_CALLS {
                    all.remove(0);
                }
                all.push(kept);
            }
            result.node_names = Some(names);
        }
        self.observe("filter", start);
        Ok(result)
    }

    /// Narrows `keep` to the `shortlist` nodes ranked best for `demand` (ties: in the request's order,
    /// which kube-scheduler rotates from call to call); the nodes left out are not failures. Returns
    /// each node's score, for `prioritize` to answer as ranked among all the candidates.
    ///
    /// Why: kube-scheduler runs its own score plugins on every node `filter` hands back, and sends
    /// them all to `prioritize` (at 1000 nodes, ~420 names per call, its adaptive
    /// `percentageOfNodesToScore`). Each point of the extender's 0..10 is worth 50 of its node score
    /// (weight 5), so a node ranked well below the best rarely wins there: CPU spent for little. Its
    /// own preferences (affinity, spreading) still choose among the shortlist. In the `Nodes` form
    /// (no [`Kept`]) `prioritize` ranks the shortlist again, among itself. Also returns what the pod
    /// would hold on the node ranked first.
    fn shortlist(
        &self,
        states: &[Arc<NodeSnapshot>],
        demand: &PodDemand,
        shortlist: usize,
        keep: &mut [bool],
    ) -> (Vec<i64>, Option<(String, Reservation)>) {
        let mix = self.workload.current();
        let ranked = decide::prioritize(states, demand, &self.config, &self.policy_cache, &mix);
        let mut order: Vec<(usize, f64)> = ranked
            .iter()
            .enumerate()
            .filter(|(i, _)| keep[*i])
            .filter_map(|(i, r)| r.as_ref().map(|r| (i, r.raw)))
            .collect();
        // Stable: equal blends keep the request's order.
        order.sort_by(|a, b| b.1.total_cmp(&a.1));
        for (i, _) in order.iter().skip(shortlist) {
            keep[*i] = false;
        }
        let best = order.first().and_then(|&(i, _)| {
            let gpus = ranked[i].as_ref()?.gpus;
            Some((states[i].name.clone(), Reservation::of(demand, &states[i], gpus)))
        });
        let scores = ranked
            .iter()
            .map(|r| r.as_ref().map_or(extender::MIN_EXTENDER_PRIORITY, |r| r.score))
            .collect();
        (scores, best)
    }

    /// Holds the GPU(s) `prioritize` would rank first on `node` for `demand`.
    fn hold_alone(&self, node: &Arc<NodeSnapshot>, demand: &PodDemand) {
        let mix = self.workload.current();
        let one = std::slice::from_ref(node);
        let ranked = decide::prioritize(one, demand, &self.config, &self.policy_cache, &mix);
        if let Some(Some(r)) = ranked.first() {
            self.hold(&demand.uid, &node.name, Reservation::of(demand, node, r.gpus));
        }
    }

    /// Holds `r` on `node` for the pod with `uid` (see [`super::holds`]), and counts the holds.
    fn hold(&self, uid: &str, node: &str, r: Reservation) {
        self.holds.hold(uid, node, r);
        self.metrics.holds.set(self.holds.len() as i64);
    }

    /// What the last `filter` of this pod kept, if `args` lists exactly those names (see [`Kept`]).
    fn kept_by_filter(&self, args: &ExtenderArgs) -> Option<Kept> {
        let names = args.node_names.as_ref().filter(|_| args.nodes.is_none())?;
        let pod_uid = pod_uid(args.pod.as_ref())?;
        let mut all = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        let at = all.iter().position(|k| k.pod_uid == pod_uid)?;
        let kept = all.remove(at);
        (kept.names == *names && kept.at.elapsed() < KEPT_FOR).then_some(kept)
    }

    /// `prioritize`: every candidate node gets a score; nodes that cannot host the pod get 0.
    pub fn prioritize(&self, mut args: ExtenderArgs) -> Result<HostPriorities, BadRequest> {
        let start = Instant::now();
        let _span = self.span("prioritize", args.pod.as_ref()).entered();
        let demand = self.demand(args.pod.as_ref())?;
        let (states, shortlisted, mut best) = match self.kept_by_filter(&args) {
            Some(kept) => (kept.states, kept.scores, kept.best),
            None => (self.candidates(&args)?, None, None),
        };
        let mut scores: Vec<i64> = vec![extender::MIN_EXTENDER_PRIORITY; states.len()];
        if let Some(shortlisted) = shortlisted {
            // Ranked by `filter` among all its candidates, not only among the shortlist.
            scores = shortlisted;
        } else if let Ok(Some(d)) = &demand {
            let mix = self.workload.current();
            let ranked = decide::prioritize(&states, d, &self.config, &self.policy_cache, &mix);
            // The first of the best blends, as `filter` shortlists.
            let mut first: Option<(usize, f64)> = None;
            for (i, (score, ranked)) in scores.iter_mut().zip(&ranked).enumerate() {
                if let Some(r) = ranked {
                    *score = r.score;
                    if first.is_none_or(|(_, raw)| r.raw > raw) {
                        first = Some((i, r.raw));
                    }
                }
            }
            best = first.and_then(|(i, _)| {
                let gpus = ranked[i].as_ref()?.gpus;
                Some((states[i].name.clone(), Reservation::of(d, &states[i], gpus)))
            });
        }
        // kube-scheduler binds the pod next, to this node when it is the only one with the top
        // score: the next pods rank around it.
        if let Some((node, r)) = best {
            if let Some(at) = states.iter().position(|s| s.name == node) {
                single_out(&mut scores, at);
            }
            if let Some(uid) = pod_uid(args.pod.as_ref()) {
                self.hold(&uid, &node, r);
            }
        }
        // Named as `candidates` chose the states: from `Nodes` when given (even if `NodeNames` is
        // too), else the request's own names, in the same order.
        let names = match args.node_names.take() {
            Some(names) if args.nodes.is_none() => names,
            _ => states.iter().map(|s| s.name.as_str()).collect(),
        };
        self.observe("prioritize", start);
        Ok(HostPriorities::new(names, scores))
    }
}

/// Leaves the node at `best` alone with the top score: the nodes that tie with it score one less.
/// kube-scheduler picks at random among the nodes of equal total score, and its own scores barely tell
/// GPU nodes apart for a pod asking little CPU; among tied nodes it chose others than the one the
/// scorer holds a GPU on, whose bind then found the room gone (1000 nodes, realistic mix: 130 of 472
/// binds refused). One point here is worth 50 of kube-scheduler's node score (weight 5).
fn single_out(scores: &mut [i64], best: usize) {
    let Some(&top) = scores.get(best) else { return };
    if top <= extender::MIN_EXTENDER_PRIORITY {
        return;
    }
    for (i, score) in scores.iter_mut().enumerate() {
        if i != best && *score >= top {
            *score = top - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_ranked_first_alone_keeps_the_top_score() {
        let mut scores = vec![10, 10, 7, 10, 9];
        single_out(&mut scores, 3);
        assert_eq!(scores, [9, 9, 7, 10, 9]);
        // At the lowest score nothing can be singled out.
        let mut low = vec![0, 0, 0];
        single_out(&mut low, 1);
        assert_eq!(low, [0, 0, 0]);
        let mut alone = vec![4];
        single_out(&mut alone, 0);
        assert_eq!(alone, [4]);
        let mut out_of_range = vec![5, 5];
        single_out(&mut out_of_range, 2);
        assert_eq!(out_of_range, [5, 5]);
    }
}
