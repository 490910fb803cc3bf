//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's `leaderelection` does it: the
//! holder renews the Lease every few seconds; another replica takes it once it has gone unrenewed
//! for its duration; every write carries the resourceVersion read, so two replicas never both win.
//! A holder that cannot renew in time stops (the controller exits, and its pod restarts as a
//! candidate) rather than act beside a new leader.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::PostParams;

/// How a replica takes part in the election.
#[derive(Debug, Clone)]
pub struct Election {
    pub name: String,
    pub identity: String,
    /// How long a Lease stays the holder's without renewal (client-go's default: 15 s).
    pub duration: Duration,
    /// How often the holder renews (client-go retries every 2 s within a 10 s deadline).
    pub renew_every: Duration,
}

/// Whether `me` may write itself into a Lease that reads `spec` at `now`: it is free, already ours,
/// or its holder has not renewed it within its duration.
pub fn may_take(spec: &LeaseSpec, me: &str, now: Timestamp) -> bool {
    let holder = spec.holder_identity.as_deref().unwrap_or("");
    if holder.is_empty() || holder == me {
        return true;
    }
    let Some(renewed) = spec.renew_time.as_ref().map(|t| t.0) else {
        return true;
    };
    let duration = SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(0).max(0)));
    renewed.checked_add(duration).is_ok_and(|expiry| expiry < now)
}

/// The spec after `me` takes or renews the Lease.
fn taken(spec: &LeaseSpec, election: &Election, now: Timestamp) -> LeaseSpec {
    let ours = spec.holder_identity.as_deref() == Some(election.identity.as_str());
    LeaseSpec {
        holder_identity: Some(election.identity.clone()),
        lease_duration_seconds: Some(i32::try_from(election.duration.as_secs()).unwrap_or(i32::MAX)),
        acquire_time: if ours {
            spec.acquire_time.clone()
        } else {
            Some(MicroTime(now))
        },
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(spec.lease_transitions.unwrap_or(0) + i32::from(!ours)),
        ..spec.clone()
    }
}

/// One attempt to take or renew: `Ok(true)` when the Lease is ours now, `Ok(false)` when someone
/// else holds it or won the race.
pub async fn try_take(api: &Api<Lease>, election: &Election) -> kube::Result<bool> {
    let now = Timestamp::now();
    match api.get_opt(&election.name).await? {
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(election.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(taken(&LeaseSpec::default(), election, now)),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
        Some(lease) => {
            let spec = lease.spec.clone().unwrap_or_default();
            if !may_take(&spec, &election.identity, now) {
                return Ok(false);
            }
            // The resourceVersion read travels with the write: a concurrent writer makes it a 409.
            let updated = Lease {
                spec: Some(taken(&spec, election, now)),
                ..lease
            };
            match api
                .replace(&election.name, &PostParams::default(), &updated)
                .await
            {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
    }
}

/// Waits until this replica holds the Lease.
pub async fn acquire(api: &Api<Lease>, election: &Election) {
    let mut said = false;
    loop {
        match try_take(api, election).await {
            Ok(true) => {
                tracing::info!(lease = %election.name, identity = %election.identity, "leading");
                return;
            }
            Ok(false) if !said => {
                tracing::info!(lease = %election.name, "another replica leads: standing by");
                said = true;
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(lease = %election.name, "lease: {e}"),
        }
        tokio::time::sleep(election.renew_every).await;
    }
}

/// Renews the Lease until a renewal has failed for the Lease's whole duration; then returns, and the
/// caller must stop acting as leader.
pub async fn keep(api: &Api<Lease>, election: &Election) {
    let mut last = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(election.renew_every).await;
        match try_take(api, election).await {
            Ok(true) => last = tokio::time::Instant::now(),
            Ok(false) => {
                tracing::error!(lease = %election.name, "another replica took the lease");
                return;
            }
            Err(e) => tracing::warn!(lease = %election.name, "renewing the lease: {e}"),
        }
        if last.elapsed() >= election.duration {
            tracing::error!(lease = %election.name, "could not renew the lease in time");
            return;
        }
    }
}

/// Gives the Lease up (on SIGTERM), so that a standby need not wait for it to expire.
pub async fn release(api: &Api<Lease>, election: &Election) {
    let Ok(Some(lease)) = api.get_opt(&election.name).await else {
        return;
    };
    let Some(spec) = lease.spec.clone() else { return };
    if spec.holder_identity.as_deref() != Some(election.identity.as_str()) {
        return;
    }
    let released = Lease {
        spec: Some(LeaseSpec {
            holder_identity: None,
            lease_duration_seconds: Some(1),
            ..spec
        }),
        ..lease
    };
    if let Err(e) = api
        .replace(&election.name, &PostParams::default(), &released)
        .await
    {
        tracing::warn!(lease = %election.name, "releasing the lease: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: Option<&str>, renewed_secs_ago: Option<i64>, duration: i32, now: Timestamp) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(str::to_string),
            renew_time: renewed_secs_ago
                .map(|s| MicroTime(now.checked_sub(SignedDuration::from_secs(s)).expect("in range"))),
            lease_duration_seconds: Some(duration),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn a_lease_is_taken_when_free_ours_or_expired_only() {
        let now = Timestamp::now();
        assert!(may_take(&spec(None, None, 15, now), "a", now));
        assert!(may_take(&spec(Some(""), Some(1), 15, now), "a", now));
        assert!(may_take(&spec(Some("a"), Some(1), 15, now), "a", now));
        assert!(!may_take(&spec(Some("b"), Some(1), 15, now), "a", now));
        assert!(
            !may_take(&spec(Some("b"), Some(15), 15, now), "a", now),
            "expires after, not at, its duration"
        );
        assert!(may_take(&spec(Some("b"), Some(16), 15, now), "a", now));
        assert!(
            may_take(&spec(Some("b"), None, 15, now), "a", now),
            "never renewed"
        );
    }

    #[test]
    fn taking_counts_a_transition_and_renewing_keeps_the_acquire_time() {
        let election = Election {
            name: "l".into(),
            identity: "a".into(),
            duration: Duration::from_secs(15),
            renew_every: Duration::from_secs(5),
        };
        let now = Timestamp::now();
        let first = taken(&spec(Some("b"), Some(30), 15, now), &election, now);
        assert_eq!(first.holder_identity.as_deref(), Some("a"));
        assert_eq!(first.lease_transitions, Some(1));
        assert_eq!(first.acquire_time, Some(MicroTime(now)));
        let later = now.checked_add(SignedDuration::from_secs(5)).expect("in range");
        let renewed = taken(&first, &election, later);
        assert_eq!(renewed.lease_transitions, Some(1));
        assert_eq!(renewed.acquire_time, Some(MicroTime(now)));
        assert_eq!(renewed.renew_time, Some(MicroTime(later)));
        assert_eq!(renewed.lease_duration_seconds, Some(15));
    }
}
