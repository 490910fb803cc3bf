//! The scorer's only state: binds it made that the node's `gpumem.io/gpu-usage` annotation does not show
//! yet. Every decision sees node state with these reservations subtracted, and a bind reserves its GPUs
//! with one short critical section ([`Ledger::reserve`]: check and record together), so two concurrent
//! binds can never both take the last room on one GPU. There is no node lock: any number of pods per
//! node may be in flight.
//!
//! A reservation ends when any version of the node's usage annotation lists the pod on the GPU (the node
//! cache reports each version: [`Ledger::confirm`]), when the pod is deleted, when the bind fails, or after
//! a TTL (a pod that never started). Waiting for the next decision to notice would be too late: a pod that
//! ran and was deleted in between would hold its GPU until the TTL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::state::{Demand, GpuSnapshot, NodeSnapshot, PodDemand};
use crate::alloc::GpuMask;

/// One bind in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// `namespace/name`, as the usage annotation lists pods.
    pub pod: String,
    /// GPU positions on the node and their UUIDs.
    pub gpus: Vec<(usize, String)>,
    /// MiB taken on each GPU; `None` = whole GPUs.
    pub mib: Option<u64>,
    pub at: Instant,
}

impl Reservation {
    /// `d` on the GPUs at positions `gpus` of `n` (positions `n` lacks are skipped).
    pub fn of(d: &PodDemand, n: &NodeSnapshot, gpus: GpuMask) -> Reservation {
        Reservation {
            pod: d.key.clone(),
            gpus: gpus
                .iter()
                .filter_map(|p| n.gpus().get(p).map(|g| (p, g.uuid.clone())))
                .collect(),
            mib: match d.demand {
                Demand::Memory { .. } => Some(d.memory_mib(n.unit_mib)),
                Demand::Whole { .. } => None,
            },
            at: Instant::now(),
        }
    }
}

/// Reservations per node.
#[derive(Debug)]
pub struct Ledger {
    ttl: Duration,
    nodes: Mutex<HashMap<String, Vec<Reservation>>>,
}

impl Ledger {
    pub fn new(ttl: Duration) -> Ledger {
        Ledger {
            ttl,
            nodes: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Reservation>>> {
        // A panic while holding the lock cannot leave the map half-updated in a way that matters.
        self.nodes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Subtracts this node's reservations from `node` (dropping those the annotation already shows, and
    /// expired ones). Returns how many MiB were taken.
    pub fn apply(&self, node: &mut NodeSnapshot) -> u64 {
        let mut nodes = self.lock();
        apply_locked(&mut nodes, self.ttl, node)
    }

    /// Applies reservations to many nodes under one lock (copying only the nodes that have some).
    pub fn apply_arcs(&self, states: &mut [Arc<NodeSnapshot>]) {
        let mut nodes = self.lock();
        if nodes.is_empty() {
            return;
        }
        for s in states.iter_mut() {
            if nodes.contains_key(&s.name) {
                apply_locked(&mut nodes, self.ttl, Arc::make_mut(s));
            }
        }
    }

    /// Atomically: applies reservations to `node`, asks `choose` for GPUs on what is left, and records
    /// the choice. `choose` returns the reservation or why nothing fits.
    pub fn reserve<E>(
        &self,
        node: &mut NodeSnapshot,
        choose: impl FnOnce(&NodeSnapshot) -> Result<Reservation, E>,
    ) -> Result<Reservation, E> {
        let mut nodes = self.lock();
        apply_locked(&mut nodes, self.ttl, node);
        let r = choose(node)?;
        nodes.entry(node.name.clone()).or_default().push(r.clone());
        Ok(r)
    }

    /// Ends the reservations that `node`'s usage annotation shows: the agent accounts for them now.
    pub fn confirm(&self, node: &NodeSnapshot) {
        let mut nodes = self.lock();
        if let Some(list) = nodes.get_mut(&node.name) {
            list.retain(|r| !shown(r, node.gpus()));
            if list.is_empty() {
                nodes.remove(&node.name);
            }
        }
    }

    /// Forgets `pod`'s reservation on `node` (its bind failed, or the pod is gone).
    pub fn release(&self, node: &str, pod: &str) {
        let mut nodes = self.lock();
        if let Some(list) = nodes.get_mut(node) {
            list.retain(|r| r.pod != pod);
            if list.is_empty() {
                nodes.remove(node);
            }
        }
    }

    /// Whether this replica holds a reservation for `pod` on `node`.
    pub fn holds(&self, node: &str, pod: &str) -> bool {
        self.lock()
            .get(node)
            .is_some_and(|list| list.iter().any(|r| r.pod == pod))
    }

    /// Reservations held, over all nodes.
    pub fn len(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn apply_locked(
    nodes: &mut HashMap<String, Vec<Reservation>>,
    ttl: Duration,
    node: &mut NodeSnapshot,
) -> u64 {
    let Some(list) = nodes.get_mut(&node.name) else {
        return 0;
    };
    let now = Instant::now();
    list.retain(|r| now.duration_since(r.at) < ttl && !shown(r, node.gpus()));
    let taken = list.iter().map(|r| subtract(node, r)).sum();
    if list.is_empty() {
        nodes.remove(&node.name);
    }
    taken
}

/// Whether the usage annotation behind `gpus` lists `r`'s pod on one of its GPUs.
fn shown(r: &Reservation, gpus: &[GpuSnapshot]) -> bool {
    r.gpus
        .iter()
        .any(|(p, _)| gpus.get(*p).is_some_and(|g| g.pods.contains(&r.pod)))
}

/// Takes what `r` holds out of `node`'s free memory; returns the MiB taken.
pub fn subtract(node: &mut NodeSnapshot, r: &Reservation) -> u64 {
    let mut taken = 0;
    let mut gpus = node.gpus_mut();
    for (p, uuid) in &r.gpus {
        // Match by UUID: positions only hold while the node's GPU list is the same.
        let Some(g) = gpus.get_mut(*p).filter(|g| g.uuid == *uuid) else {
            continue;
        };
        match r.mib {
            Some(m) => {
                g.allocated_mib = g.allocated_mib.saturating_add(m).min(g.memory_mib);
                taken += m;
            }
            None => {
                taken += g.free_mib();
                g.whole = true;
                g.allocated_mib = g.memory_mib;
            }
        }
    }
    taken
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Node "n" with one 8000 MiB GPU per entry, each with that many MiB free.
    pub(crate) fn node(free: &[u64]) -> NodeSnapshot {
        let gpus = free
            .iter()
            .enumerate()
            .map(|(i, &f)| GpuSnapshot::for_tests(i, "m", 8000, 8000 - f))
            .collect();
        NodeSnapshot::with_gpus("n", 1, gpus)
    }

    fn take(pod: &str, mib: u64) -> impl FnOnce(&NodeSnapshot) -> Result<Reservation, String> {
        move |n: &NodeSnapshot| {
            let p = n
                .gpus()
                .iter()
                .position(|g| g.free_mib() >= mib)
                .ok_or("no room")?;
            Ok(Reservation {
                pod: pod.into(),
                gpus: vec![(p, n.gpus()[p].uuid.clone())],
                mib: Some(mib),
                at: Instant::now(),
            })
        }
    }

    #[test]
    fn reservations_are_seen_until_the_annotation_shows_them() {
        let ledger = Ledger::new(Duration::from_secs(60));
        ledger
            .reserve(&mut node(&[6000]), take("a/p1", 5000))
            .expect("fits");
        assert!(
            ledger.reserve(&mut node(&[6000]), take("a/p2", 5000)).is_err(),
            "only 1000 left"
        );
        let mut seen = node(&[6000]);
        assert_eq!(ledger.apply(&mut seen), 5000);
        assert_eq!(seen.gpus()[0].free_mib(), 1000);

        // The agent reports p1: the reservation is dropped, the annotation alone counts.
        let mut reported = node(&[1000]);
        reported.gpus_mut()[0].pods.push("a/p1".into());
        assert_eq!(ledger.apply(&mut reported), 0);
        assert!(ledger.is_empty());
    }

    #[test]
    fn a_node_version_that_showed_the_pod_ends_its_reservation_for_good() {
        let ledger = Ledger::new(Duration::from_secs(60));
        ledger
            .reserve(&mut node(&[6000]), take("a/p1", 5000))
            .expect("fits");
        // The agent lists p1; no decision happens to look.
        let mut shows = node(&[1000]);
        shows.gpus_mut()[0].pods.push("a/p1".into());
        ledger.confirm(&node(&[6000]));
        assert_eq!(ledger.len(), 1, "a version without the pod changes nothing");
        ledger.confirm(&shows);
        // p1 is deleted and the annotation is idle again: nothing is held for it any more.
        let mut idle = node(&[6000]);
        assert_eq!(ledger.apply(&mut idle), 0);
        assert_eq!(idle.gpus()[0].free_mib(), 6000);
    }

    #[test]
    fn release_and_expiry_free_the_room() {
        let ledger = Ledger::new(Duration::from_secs(60));
        ledger
            .reserve(&mut node(&[6000]), take("a/p1", 5000))
            .expect("fits");
        ledger.release("n", "a/p1");
        assert!(ledger.reserve(&mut node(&[6000]), take("a/p2", 5000)).is_ok());
        let short = Ledger::new(Duration::ZERO);
        short
            .reserve(&mut node(&[6000]), take("a/p1", 5000))
            .expect("fits");
        assert_eq!(short.apply(&mut node(&[6000])), 0, "expired at once");
    }
}
