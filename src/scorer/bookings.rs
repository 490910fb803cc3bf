//! Binds in flight that every scorer replica sees. A replica's [`super::ledger::Ledger`] holds its own
//! binds until the node's usage annotation shows them, and its pod cache shows the other replicas'
//! binds once their pods reach its watch. Between another replica's Binding and that watch event, two
//! replicas could promise the same room, and the kubelet would fail the loser's pod
//! (`UnexpectedAdmissionError`, terminal for a bare pod). A per-node Lease in the scorer's namespace,
//! `gpumem-bookings-<node>`, closes that gap:
//!
//! - a bind reads the node's Lease, chooses its GPUs with the other replicas' bookings subtracted, and
//!   writes its own booking with the resourceVersion it read, before the Binding;
//! - when two replicas book on one node at once, one write wins; the other gets 409 Conflict and chooses
//!   again against what won (or answers that the node has no room, and kube-scheduler tries again);
//! - one replica's binds to one node take turns ([`Board::turn`]): they never conflict with each
//!   other, and each writes on top of the Lease the previous one wrote, without reading it again.
//!
//! A booking is dropped by the next write to its node's Lease once the usage annotation shows its pod,
//! once the writer's pod cache has seen its pod (that UID) deleted, once it is older than the ledger's
//! TTL, or once it is [`SETTLE`] old and the writer's pod cache has no such pod on the node (its Binding
//! failed, or the pod went while the watch was away).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use serde::{Deserialize, Serialize};

/// The Lease annotation holding a node's bookings (JSON, [`Booking`]s).
pub const BOOKINGS_ANNOTATION: &str = "gpumem.io/bookings";
/// Lease names: this prefix and the node's name.
pub const LEASE_PREFIX: &str = "gpumem-bookings-";
/// A bind gives up after this many writes lost to other replicas in a row (kube-scheduler retries it).
pub const ATTEMPTS: usize = 5;
/// Past this age a booking whose pod the writer's pod cache does not show bound to its node is dropped.
pub const SETTLE: Duration = Duration::from_secs(10);
/// More bookings than this in one Lease are not read (a hand-edited or corrupt annotation).
pub const MAX_BOOKINGS: usize = 4096;

/// One bind in flight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
// Unknown fields are ignored: a replica reads the bookings of a newer one during a rolling update.
#[serde(rename_all = "camelCase")]
pub struct Booking {
    /// `namespace/name`, as the usage annotation lists pods.
    pub pod: String,
    /// The pod's UID: a pod deleted and created again under its name is another pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// The GPUs' UUIDs.
    pub gpus: Vec<String>,
    /// MiB on each GPU; absent = the GPUs whole.
    #[serde(rename = "mib", default, skip_serializing_if = "Option::is_none")]
    pub mib: Option<u64>,
    pub at: Timestamp,
}

/// The Lease of `node`'s bookings. Node names are DNS subdomains of up to 253 characters; a name
/// too long for the prefix keeps its first characters and a hash of the whole.
pub fn lease_name(node: &str) -> String {
    const MAX: usize = 253;
    let name = format!("{LEASE_PREFIX}{node}");
    if name.len() <= MAX {
        return name;
    }
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.hash(&mut h);
    let hash = format!("-{:016x}", h.finish());
    let keep = MAX - hash.len();
    // Node names are ASCII: any byte index is a character boundary.
    let head = name[..keep].trim_end_matches(['-', '.']);
    format!("{head}{hash}")
}

/// The bookings an annotation holds; an error says why it cannot be read.
pub fn parse(text: &str) -> Result<Vec<Booking>, String> {
    let bookings: Vec<Booking> = serde_json::from_str(text)
        .map_err(|e| format!("{BOOKINGS_ANNOTATION} is not a list of bookings: {e}"))?;
    if bookings.len() > MAX_BOOKINGS {
        return Err(format!(
            "{BOOKINGS_ANNOTATION} holds {} bookings, more than {MAX_BOOKINGS}",
            bookings.len()
        ));
    }
    Ok(bookings)
}

/// What a writer keeps of the bookings it read: not `replaced` (the pod it books now), not older than
/// `ttl`, not `settled` (the usage annotation shows the pod, or the pod is gone), and, past
/// [`SETTLE`], only those whose pod is `known` bound to the node.
pub fn kept(
    read: &[Booking],
    replaced: &str,
    now: Timestamp,
    ttl: Duration,
    settled: impl Fn(&Booking) -> bool,
    known: impl Fn(&Booking) -> bool,
) -> Vec<Booking> {
    read.iter()
        .filter(|b| b.pod != replaced)
        .filter(|b| {
            let age = now.duration_since(b.at);
            // A booking from the future (a replica's clock ahead) counts as new.
            let age = Duration::try_from(age).unwrap_or(Duration::ZERO);
            age < ttl && !settled(b) && (age < SETTLE || known(b))
        })
        .cloned()
        .collect()
}

/// A node's Lease as read: the object (absent: not created yet) and its bookings.
#[derive(Debug, Default, Clone)]
pub struct Read {
    lease: Option<Lease>,
    pub bookings: Vec<Booking>,
}

/// Why a write did not take.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// Another replica wrote the Lease since it was read.
    #[error("another replica booked on this node since it was read")]
    Conflict,
    #[error(transparent)]
    Api(#[from] kube::Error),
}

/// The scorer's Leases of bookings, in its namespace.
pub struct Board {
    api: Api<Lease>,
    /// Per node, this replica's turn to write the node's Lease and the Lease as its last write left it.
    turns: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<Read>>>>>,
}

/// This replica's turn on one node's Lease ([`Board::turn`]); it holds the Lease as this replica last
/// wrote it, if no conflict or error has spoiled that since.
pub type Turn = tokio::sync::OwnedMutexGuard<Option<Read>>;

impl Board {
    pub fn new(client: kube::Client, namespace: &str) -> Board {
        Board {
            api: Api::namespaced(client, namespace),
            turns: Mutex::new(HashMap::new()),
        }
    }

    /// Waits for this replica's turn to book on `node`. A replica's binds to one node write its Lease
    /// one after another, so they never conflict with each other (only another replica's write can
    /// beat one), and each starts from the Lease the previous one wrote, without reading it again.
    pub async fn turn(&self, node: &str) -> Turn {
        let slot = {
            let mut turns = self.turns.lock().unwrap_or_else(|e| e.into_inner());
            turns.entry(node.to_string()).or_default().clone()
        };
        slot.lock_owned().await
    }

    /// The Lease as `turn` holds it, else as read from the API server.
    pub async fn current(&self, node: &str, turn: &mut Turn) -> Result<Read, kube::Error> {
        match turn.take() {
            Some(read) => Ok(read),
            None => self.read(node).await,
        }
    }

    /// `node`'s Lease, from etcd (a quorum read: a cached one would only cost a conflict later). An
    /// annotation that cannot be read is logged and taken as empty: the next write replaces it.
    pub async fn read(&self, node: &str) -> Result<Read, kube::Error> {
        let Some(lease) = self.api.get_opt(&lease_name(node)).await? else {
            return Ok(Read::default());
        };
        let text = lease
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(BOOKINGS_ANNOTATION))
            .map_or("[]", String::as_str);
        let bookings = parse(text).unwrap_or_else(|e| {
            tracing::warn!(node, lease = %lease_name(node), "{e}; its bookings are dropped");
            Vec::new()
        });
        Ok(Read {
            lease: Some(lease),
            bookings,
        })
    }

    /// Writes `bookings` as `node`'s, on top of `read` only: anything written since is a conflict.
    /// Returns the Lease as written.
    pub async fn write(&self, node: &str, read: Read, bookings: &[Booking]) -> Result<Read, WriteError> {
        let text = serde_json::to_string(bookings).unwrap_or_else(|_| "[]".into());
        let result = match read.lease {
            Some(mut lease) => {
                lease
                    .metadata
                    .annotations
                    .get_or_insert_default()
                    .insert(BOOKINGS_ANNOTATION.into(), text);
                // The object carries the resourceVersion read: the API server refuses a stale one.
                let name = lease.metadata.name.clone().unwrap_or_else(|| lease_name(node));
                self.api.replace(&name, &PostParams::default(), &lease).await
            }
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(lease_name(node)),
                        labels: Some(
                            [
                                ("app.kubernetes.io/name".to_string(), "gpumem".to_string()),
                                (
                                    "app.kubernetes.io/component".to_string(),
                                    "scorer-bookings".to_string(),
                                ),
                            ]
                            .into(),
                        ),
                        annotations: Some([(BOOKINGS_ANNOTATION.to_string(), text)].into()),
                        ..ObjectMeta::default()
                    },
                    spec: None,
                };
                self.api.create(&PostParams::default(), &lease).await
            }
        };
        match result {
            Ok(lease) => Ok(Read {
                lease: Some(lease),
                bookings: bookings.to_vec(),
            }),
            // Update with a stale resourceVersion, or a create another replica made first; or the
            // Lease deleted since it was read (read it again).
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Err(WriteError::Conflict),
            Err(e) => Err(WriteError::Api(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn booking(pod: &str, age_s: i64) -> Booking {
        Booking {
            pod: pod.into(),
            uid: None,
            gpus: vec!["GPU-a".into()],
            mib: Some(1000),
            at: Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(age_s),
        }
    }

    #[test]
    fn lease_names_are_valid_for_any_node_name() {
        assert_eq!(lease_name("gpu-node-1"), "gpumem-bookings-gpu-node-1");
        let long = "n".repeat(253);
        let name = lease_name(&long);
        assert_eq!(name.len(), 253);
        assert!(name.starts_with(LEASE_PREFIX));
        assert_ne!(
            lease_name(&long),
            lease_name(&"n".repeat(252)),
            "different nodes, different Leases"
        );
        assert!(crate::names::check_subdomain(&name).is_ok(), "{name}");
    }

    #[test]
    fn bookings_round_trip_and_bad_text_is_an_error() {
        let b = vec![
            booking("ns/a", 0),
            Booking {
                mib: None,
                uid: Some("u-b".into()),
                ..booking("ns/b", 1)
            },
        ];
        let text = serde_json::to_string(&b).unwrap();
        assert!(!text.contains("\"mib\":null"), "{text}");
        assert_eq!(parse(&text).unwrap(), b);
        assert!(parse("{").is_err());
        let newer = parse(r#"[{"pod": "a", "gpus": [], "at": "2026-01-01T00:00:00Z", "extra": 1}]"#);
        assert_eq!(
            newer.map(|b| b.len()),
            Ok(1),
            "a newer replica's field is ignored"
        );
        assert!(
            parse(r#"[{"gpus": [], "at": "2026-01-01T00:00:00Z"}]"#).is_err(),
            "no pod"
        );
        let many = vec![booking("ns/a", 0); MAX_BOOKINGS + 1];
        assert!(parse(&serde_json::to_string(&many).unwrap()).is_err());
    }

    #[test]
    fn a_writer_keeps_only_bookings_still_in_flight() {
        let read = vec![
            booking("ns/mine", 0),
            booking("ns/fresh", 1),
            booking("ns/old", 200),
            booking("ns/shown", 1),
            booking("ns/unknown-young", 5),
            booking("ns/unknown-settled", 11),
            booking("ns/known-settled", 11),
            Booking {
                // a clock ahead
                at: Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(30),
                ..booking("ns/future", 0)
            },
        ];
        let kept = kept(
            &read,
            "ns/mine",
            Timestamp::now(),
            Duration::from_secs(120),
            |b| b.pod == "ns/shown",
            |b| b.pod == "ns/known-settled",
        );
        let pods: Vec<&str> = kept.iter().map(|b| b.pod.as_str()).collect();
        assert_eq!(
            pods,
            ["ns/fresh", "ns/unknown-young", "ns/known-settled", "ns/future"]
        );
    }
}
