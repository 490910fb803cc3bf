//! Choices waiting for their bind. kube-scheduler starts the next pod's scheduling cycle as soon as it
//! has sent the last pod to bind, so the next `filter` and `prioritize` often come before that bind
//! reaches the scorer (and the [`super::ledger`]). Without a hold, the next pod ranks the same tightest
//! GPU first, kube-scheduler sends it to the same node, and its bind finds the room gone: a refused
//! bind, a lost scheduling cycle and a backoff for that pod.
//!
//! So `prioritize` holds the GPU(s) of the node it ranked first for the pod, and every other pod's
//! `filter`, `prioritize` and `bind` sees them taken. A hold ends when the pod's bind arrives (to
//! whichever node kube-scheduler chose), when the pod is deleted, when the pod is ranked again, or
//! after [`HOLD_FOR`] (kube-scheduler chose no node, or its bind never came).
//!
//! Holds are this replica's alone: across replicas the [`super::bookings`] keep GPUs from being
//! double-booked. A hold only steers choices; a bind that finds no room but under other pods' holds
//! takes that room (a hold is a guess at kube-scheduler's choice, the bind is its choice).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ledger::{self, Reservation};
use super::state::NodeSnapshot;

/// How long a hold lasts without its bind: far longer than a bind takes to follow `prioritize`
/// (milliseconds, or a few seconds when the API server is saturated), short enough that a pod
/// kube-scheduler gave up on holds nothing for long.
pub const HOLD_FOR: Duration = Duration::from_secs(10);

/// Held GPUs by node, and the node of each pod's hold (by pod UID).
#[derive(Debug, Default)]
pub struct GpuHolds {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_node: HashMap<String, Vec<Held>>,
    node_of: HashMap<String, String>,
}

#[derive(Debug, Clone)]
struct Held {
    uid: String,
    reservation: Reservation,
}

impl GpuHolds {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every update leaves both maps consistent before it can panic.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds `r` on `node` for the pod with `uid`, replacing the pod's earlier hold.
    pub fn hold(&self, uid: &str, node: &str, r: Reservation) {
        if uid.is_empty() {
            return;
        }
        let mut inner = self.lock();
        inner.remove(uid);
        inner.node_of.insert(uid.to_string(), node.to_string());
        inner.by_node.entry(node.to_string()).or_default().push(Held {
            uid: uid.to_string(),
            reservation: r,
        });
    }

    /// Ends the hold of the pod with `uid` (its bind arrived, or it was deleted); returns the node
    /// and GPUs it held.
    pub fn release(&self, uid: &str) -> Option<(String, Reservation)> {
        self.lock().remove(uid)
    }

    /// The node the pod with `uid` holds room on, if any.
    pub fn node_of(&self, uid: &str) -> Option<String> {
        self.lock().node_of.get(uid).cloned()
    }

    /// Takes the live holds on `node` out of its free memory, except the hold of the pod with
    /// `except_uid` (a pod's own choice is not in its way). Returns how many holds were applied.
    pub fn apply(&self, node: &mut NodeSnapshot, except_uid: &str) -> usize {
        let mut inner = self.lock();
        inner.apply(node, except_uid, Instant::now())
    }

    /// [`GpuHolds::apply`] over many nodes under one lock, copying only the nodes that have holds.
    pub fn apply_arcs(&self, states: &mut [Arc<NodeSnapshot>], except_uid: &str) {
        let mut inner = self.lock();
        if inner.by_node.is_empty() {
            return;
        }
        let now = Instant::now();
        for s in states.iter_mut() {
            let others = inner
                .by_node
                .get(&s.name)
                .is_some_and(|list| list.iter().any(|h| h.uid != except_uid));
            if others {
                inner.apply(Arc::make_mut(s), except_uid, now);
            }
        }
    }

    /// Holds in place, over all nodes.
    pub fn len(&self) -> usize {
        self.lock().node_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Inner {
    fn remove(&mut self, uid: &str) -> Option<(String, Reservation)> {
        let node = self.node_of.remove(uid)?;
        let list = self.by_node.get_mut(&node)?;
        let at = list.iter().position(|h| h.uid == uid)?;
        let held = list.swap_remove(at);
        if list.is_empty() {
            self.by_node.remove(&node);
        }
        Some((node, held.reservation))
    }

    fn apply(&mut self, node: &mut NodeSnapshot, except_uid: &str, now: Instant) -> usize {
        let Some(list) = self.by_node.get_mut(&node.name) else {
            return 0;
        };
        let node_of = &mut self.node_of;
        list.retain(|h| {
            let live = now.duration_since(h.reservation.at) < HOLD_FOR;
            if !live {
                node_of.remove(&h.uid);
            }
            live
        });
        let mut applied = 0;
        for h in list.iter().filter(|h| h.uid != except_uid) {
            ledger::subtract(node, &h.reservation);
            applied += 1;
        }
        if list.is_empty() {
            self.by_node.remove(&node.name);
        }
        applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::ledger::tests::node;

    fn on_gpu(n: &NodeSnapshot, pod: &str, gpu: usize, mib: Option<u64>) -> Reservation {
        Reservation {
            pod: pod.into(),
            gpus: vec![(gpu, n.gpus()[gpu].uuid.clone())],
            mib,
            at: Instant::now(),
        }
    }

    #[test]
    fn a_hold_is_in_every_other_pods_way_until_its_bind_arrives() {
        let holds = GpuHolds::default();
        let n = node(&[8000, 8000]);
        holds.hold("u1", "n", on_gpu(&n, "a/p1", 0, Some(6000)));
        holds.hold("u2", "n", on_gpu(&n, "a/p2", 1, None));

        let mut seen = n.clone();
        assert_eq!(holds.apply(&mut seen, "u3"), 2);
        assert_eq!(seen.gpus()[0].free_mib(), 2000);
        assert_eq!(seen.gpus()[1].free_mib(), 0, "a whole GPU held");

        let mut own = n.clone();
        assert_eq!(holds.apply(&mut own, "u1"), 1, "p1's own hold is not in its way");
        assert_eq!(own.gpus()[0].free_mib(), 8000);

        let (node_name, r) = holds.release("u1").expect("held");
        assert_eq!((node_name.as_str(), r.pod.as_str()), ("n", "a/p1"));
        assert!(holds.release("u1").is_none(), "released once");
        let mut after = n.clone();
        assert_eq!(holds.apply(&mut after, "u3"), 1);
        assert_eq!(after.gpus()[0].free_mib(), 8000);
        assert_eq!(holds.len(), 1);
    }

    #[test]
    fn ranking_a_pod_again_replaces_its_hold() {
        let holds = GpuHolds::default();
        let n = node(&[8000, 8000]);
        holds.hold("u1", "n", on_gpu(&n, "a/p1", 0, Some(6000)));
        let mut other = n.clone();
        other.name = "m".into();
        holds.hold("u1", "m", on_gpu(&other, "a/p1", 1, Some(1000)));
        assert_eq!(holds.len(), 1);
        let mut seen = n.clone();
        assert_eq!(holds.apply(&mut seen, "u2"), 0, "nothing left on n");
        let untouched = Arc::new(n.clone());
        let mut states = vec![untouched.clone(), Arc::new(other.clone())];
        holds.apply_arcs(&mut states, "u2");
        assert!(
            Arc::ptr_eq(&states[0], &untouched),
            "a node without holds is not copied"
        );
        assert_eq!(states[1].gpus()[1].free_mib(), 7000);
    }

    #[test]
    fn a_hold_ends_by_itself_and_a_pod_without_uid_holds_nothing() {
        let holds = GpuHolds::default();
        let n = node(&[8000]);
        let mut old = on_gpu(&n, "a/p1", 0, Some(6000));
        old.at = Instant::now() - HOLD_FOR;
        holds.hold("u1", "n", old);
        let mut seen = n.clone();
        assert_eq!(holds.apply(&mut seen, "u2"), 0);
        assert_eq!(seen.gpus()[0].free_mib(), 8000);
        assert!(holds.is_empty(), "an expired hold is forgotten");
        holds.hold("", "n", on_gpu(&n, "a/p2", 0, Some(1000)));
        assert!(holds.is_empty());
    }
}
