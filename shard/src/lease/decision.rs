//! The pure core of the Lease lock: who may hold a Lease at a given moment, what to write when
//! taking or renewing it, and when a holder has to consider it lost.
//!
//! Nothing here talks to the API server or reads a clock; callers pass the current time in, so
//! every rule is testable with plain values. When a Lease expires is the protocol's rule in
//! [`kube_sharding_api::lease`], the same one the sharder computes shard states with.

use std::collections::BTreeMap;
use std::ops::Add;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube_sharding_api::lease::lease_expiry;

/// What a candidate may do with a Lease, given the Lease's current spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AcquireDecision {
    /// There is no Lease yet: create it.
    Create,
    /// The candidate holds the Lease already: renew it, keeping `acquireTime` and
    /// `leaseTransitions`.
    Renew,
    /// The Lease has no holder or has expired: take it over, which sets a new `acquireTime` and
    /// increments `leaseTransitions`.
    Take,
    /// Someone else holds a Lease that has not expired: try again later.
    Wait {
        /// The current holder.
        holder: String,
        /// When the Lease expires unless its holder renews it.
        expires_at: Timestamp,
    },
}

/// Decides what `identity` may do with a Lease whose current spec is `existing` (`None`: the
/// Lease does not exist).
pub(crate) fn decide(
    existing: Option<&LeaseSpec>,
    identity: &str,
    now: Timestamp,
) -> AcquireDecision {
    let Some(spec) = existing else {
        return AcquireDecision::Create;
    };
    let holder = spec.holder_identity.as_deref().unwrap_or_default();
    if holder == identity {
        return AcquireDecision::Renew;
    }
    if holder.is_empty() {
        return AcquireDecision::Take;
    }
    // Not expired yet (`now < E`, see `kube_sharding_api::lease::is_expired`): wait for it.
    match lease_expiry(spec) {
        Some(expires_at) if now < expires_at => AcquireDecision::Wait {
            holder: holder.to_string(),
            expires_at,
        },
        _ => AcquireDecision::Take,
    }
}

/// The spec to write for an [`AcquireDecision`] other than [`AcquireDecision::Wait`] (which writes nothing, so
/// `None` is returned for it).
pub(crate) fn desired_spec(
    existing: Option<&LeaseSpec>,
    decision: &AcquireDecision,
    identity: &str,
    lease_duration_seconds: i32,
    now: Timestamp,
) -> Option<LeaseSpec> {
    let base = existing.cloned().unwrap_or_default();
    let spec = match decision {
        AcquireDecision::Wait { .. } => return None,
        AcquireDecision::Create => LeaseSpec {
            holder_identity: Some(identity.to_string()),
            lease_duration_seconds: Some(lease_duration_seconds),
            acquire_time: Some(MicroTime(now)),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(0),
            ..LeaseSpec::default()
        },
        AcquireDecision::Renew => LeaseSpec {
            holder_identity: Some(identity.to_string()),
            lease_duration_seconds: Some(lease_duration_seconds),
            // A Lease we hold but that lacks an acquire time (written by some other tool) gets
            // one, so observers can tell how long we have held it.
            acquire_time: base.acquire_time.clone().or(Some(MicroTime(now))),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(base.lease_transitions.unwrap_or(0)),
            ..base
        },
        AcquireDecision::Take => LeaseSpec {
            holder_identity: Some(identity.to_string()),
            lease_duration_seconds: Some(lease_duration_seconds),
            acquire_time: Some(MicroTime(now)),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(base.lease_transitions.unwrap_or(0).saturating_add(1)),
            ..base
        },
    };
    Some(spec)
}

/// The spec of a released Lease: the holder is emptied and everything else stays, so observers
/// (the sharder) see at once that nobody holds it.
pub(crate) fn released_spec(existing: &LeaseSpec) -> LeaseSpec {
    LeaseSpec {
        holder_identity: Some(String::new()),
        ..existing.clone()
    }
}

/// Whether `identity` is the holder recorded in `spec`.
pub(crate) fn is_held_by(spec: Option<&LeaseSpec>, identity: &str) -> bool {
    spec.and_then(|s| s.holder_identity.as_deref()) == Some(identity)
}

/// `labels` (or annotations) with every entry of `ours` put in, overwriting values under the same keys and keeping
/// every other label (e.g. the sharder's state label on shard Leases).
pub(crate) fn merge_labels(
    labels: Option<BTreeMap<String, String>>,
    ours: &BTreeMap<String, String>,
) -> Option<BTreeMap<String, String>> {
    if ours.is_empty() {
        return labels;
    }
    let mut merged = labels.unwrap_or_default();
    merged.extend(ours.iter().map(|(k, v)| (k.clone(), v.clone())));
    Some(merged)
}

/// Bookkeeping of the renew deadline: a holder that has not renewed successfully for
/// `renew_deadline` since its last success has lost the Lease.
///
/// Generic over the instant type so the same logic runs on `std` and on tokio's (pausable) clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RenewDeadline<I> {
    last_success: I,
    renew_deadline: Duration,
}

impl<I: Copy + Ord + Add<Duration, Output = I>> RenewDeadline<I> {
    /// Starts the bookkeeping at the moment the Lease was acquired.
    pub(crate) fn new(acquired_at: I, renew_deadline: Duration) -> Self {
        Self {
            last_success: acquired_at,
            renew_deadline,
        }
    }

    /// Records a successful renewal at `at`.
    pub(crate) fn renewed(&mut self, at: I) {
        self.last_success = self.last_success.max(at);
    }

    /// The moment the Lease counts as lost unless renewed before.
    pub(crate) fn deadline(&self) -> I {
        self.last_success + self.renew_deadline
    }

    /// Whether the deadline has passed at `now`.
    pub(crate) fn is_missed(&self, now: I) -> bool {
        now >= self.deadline()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(second: i64) -> Timestamp {
        Timestamp::from_second(second).expect("valid timestamp")
    }

    fn spec(holder: Option<&str>, renew: Option<i64>, duration: Option<i32>) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(str::to_string),
            renew_time: renew.map(|s| MicroTime(ts(s))),
            acquire_time: renew.map(|s| MicroTime(ts(s - 100))),
            lease_duration_seconds: duration,
            lease_transitions: Some(3),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn decision_table() {
        let now = ts(1_000);
        let me = "shard-a";
        let cases: Vec<(&str, Option<LeaseSpec>, AcquireDecision)> = vec![
            ("absent", None, AcquireDecision::Create),
            (
                "ours, fresh",
                Some(spec(Some(me), Some(999), Some(15))),
                AcquireDecision::Renew,
            ),
            (
                "ours, expired",
                Some(spec(Some(me), Some(1), Some(15))),
                AcquireDecision::Renew,
            ),
            (
                "no holder field",
                Some(spec(None, Some(999), Some(15))),
                AcquireDecision::Take,
            ),
            (
                "empty holder",
                Some(spec(Some(""), Some(999), Some(15))),
                AcquireDecision::Take,
            ),
            (
                "other, valid",
                Some(spec(Some("other"), Some(990), Some(15))),
                AcquireDecision::Wait {
                    holder: "other".into(),
                    expires_at: ts(1_005),
                },
            ),
            (
                "other, expires one second from now",
                Some(spec(Some("other"), Some(986), Some(15))),
                AcquireDecision::Wait {
                    holder: "other".into(),
                    expires_at: ts(1_001),
                },
            ),
            // Expired from exactly `renewTime + leaseDurationSeconds` on (docs/protocol.md §4), as
            // the sharder's shard states have it.
            (
                "other, expires exactly now",
                Some(spec(Some("other"), Some(985), Some(15))),
                AcquireDecision::Take,
            ),
            (
                "other, expired",
                Some(spec(Some("other"), Some(984), Some(15))),
                AcquireDecision::Take,
            ),
            (
                "other, no renew time",
                Some(spec(Some("other"), None, Some(15))),
                AcquireDecision::Take,
            ),
            (
                "other, no duration",
                Some(spec(Some("other"), Some(999), None)),
                AcquireDecision::Take,
            ),
            (
                "other, no acquire time",
                Some(LeaseSpec {
                    acquire_time: None,
                    ..spec(Some("other"), Some(999), Some(15))
                }),
                AcquireDecision::Take,
            ),
            (
                "other, zero duration",
                Some(spec(Some("other"), Some(999), Some(0))),
                AcquireDecision::Take,
            ),
            (
                "sharder took over with doubled duration",
                Some(spec(Some("shardlease-controller"), Some(980), Some(30))),
                AcquireDecision::Wait {
                    holder: "shardlease-controller".into(),
                    expires_at: ts(1_010),
                },
            ),
            (
                "sharder's takeover expired",
                Some(spec(Some("shardlease-controller"), Some(960), Some(30))),
                AcquireDecision::Take,
            ),
        ];
        for (name, existing, want) in cases {
            assert_eq!(decide(existing.as_ref(), me, now), want, "{name}");
        }
    }

    #[test]
    fn create_sets_every_field() {
        let now = ts(1_000);
        let spec = desired_spec(None, &AcquireDecision::Create, "me", 15, now).expect("writes");
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!(spec.lease_duration_seconds, Some(15));
        assert_eq!(spec.acquire_time, Some(MicroTime(now)));
        assert_eq!(spec.renew_time, Some(MicroTime(now)));
        assert_eq!(spec.lease_transitions, Some(0));
    }

    #[test]
    fn renew_keeps_acquire_time_and_transitions() {
        let now = ts(1_000);
        let existing = spec(Some("me"), Some(990), Some(15));
        let spec =
            desired_spec(Some(&existing), &AcquireDecision::Renew, "me", 20, now).expect("writes");
        assert_eq!(spec.acquire_time, existing.acquire_time);
        assert_eq!(spec.renew_time, Some(MicroTime(now)));
        assert_eq!(spec.lease_transitions, Some(3));
        assert_eq!(spec.lease_duration_seconds, Some(20));
    }

    #[test]
    fn take_increments_transitions_and_resets_acquire_time() {
        let now = ts(1_000);
        let existing = spec(Some("shardlease-controller"), Some(900), Some(30));
        let spec =
            desired_spec(Some(&existing), &AcquireDecision::Take, "me", 15, now).expect("writes");
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!(spec.acquire_time, Some(MicroTime(now)));
        assert_eq!(spec.renew_time, Some(MicroTime(now)));
        assert_eq!(spec.lease_transitions, Some(4));
        assert_eq!(spec.lease_duration_seconds, Some(15));

        let mut unset = existing.clone();
        unset.lease_transitions = None;
        let spec =
            desired_spec(Some(&unset), &AcquireDecision::Take, "me", 15, now).expect("writes");
        assert_eq!(spec.lease_transitions, Some(1));
    }

    #[test]
    fn wait_writes_nothing() {
        let decision = AcquireDecision::Wait {
            holder: "x".into(),
            expires_at: ts(5),
        };
        assert_eq!(desired_spec(None, &decision, "me", 15, ts(1)), None);
    }

    #[test]
    fn release_only_empties_the_holder() {
        let existing = spec(Some("me"), Some(990), Some(15));
        let released = released_spec(&existing);
        assert_eq!(released.holder_identity.as_deref(), Some(""));
        assert_eq!(released.renew_time, existing.renew_time);
        assert_eq!(released.lease_transitions, existing.lease_transitions);
        assert!(!is_held_by(Some(&released), "me"));
        assert!(is_held_by(Some(&existing), "me"));
        assert!(!is_held_by(None, "me"));
    }

    #[test]
    fn labels_are_merged_not_replaced() {
        let ours = BTreeMap::from([("ring".to_string(), "a".to_string())]);
        let theirs = BTreeMap::from([
            ("state".to_string(), "ready".to_string()),
            ("ring".to_string(), "stale".to_string()),
        ]);
        let merged = merge_labels(Some(theirs), &ours).expect("labels");
        assert_eq!(merged.get("ring").map(String::as_str), Some("a"));
        assert_eq!(merged.get("state").map(String::as_str), Some("ready"));
        assert_eq!(merge_labels(None, &BTreeMap::new()), None);
    }

    #[test]
    fn renew_deadline_bookkeeping() {
        let start = std::time::Instant::now();
        let mut deadline = RenewDeadline::new(start, Duration::from_secs(10));
        assert!(!deadline.is_missed(start + Duration::from_secs(9)));
        assert!(deadline.is_missed(start + Duration::from_secs(10)));
        deadline.renewed(start + Duration::from_secs(8));
        assert!(!deadline.is_missed(start + Duration::from_secs(17)));
        assert!(deadline.is_missed(start + Duration::from_secs(18)));
        // A late-arriving older success never moves the deadline back.
        deadline.renewed(start + Duration::from_secs(2));
        assert_eq!(deadline.deadline(), start + Duration::from_secs(18));
    }
}
