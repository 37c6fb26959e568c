//! The Lease protocol's pure rules, shared by the sharder and the shard library
//! (docs/protocol.md §3, §4, §18).
//!
//! - when a Lease expires ([`expiry`], [`is_expired`]), written once for both sides: a shard
//!   taking a Lease back and the sharder computing a shard's state use the same instant;
//! - the [`ShardState`] of a shard's membership Lease ([`ShardLease`]), when that state next
//!   changes on its own, and what the sharder writes when it takes over an `uncertain` Lease;
//! - [`LeaseTiming`]: lease duration, renew deadline and retry period, and the rule they obey;
//! - [`is_valid_shard_name`]: a shard name is used as a label value.
//!
//! Nothing here reads a clock: callers pass `now`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::labels::{IDENTITY_SHARD_LEASE_CONTROLLER, is_valid_label_value};

/// Default `leaseDurationSeconds` of a shard's or the sharder's Lease (docs/protocol.md §3, §11).
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
/// Default time after the last successful renewal at which a holder gives the Lease up.
pub const DEFAULT_RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// Default interval between attempts to acquire or renew a Lease.
pub const DEFAULT_RETRY_PERIOD: Duration = Duration::from_secs(2);

/// The longest lease duration the sharder counts (docs/protocol.md §4): a Lease that claims more is
/// judged as if it said this, so a shard that died is taken over at most twice this long after
/// its last renewal, whatever its fields say. A holder must therefore not use a longer one:
/// [`LeaseTiming::validate`] refuses it, since the sharder would take over a Lease its holder
/// still considers its own.
pub const MAX_LEASE_DURATION: Duration = Duration::from_secs(300);

/// Lease duration assumed when a Lease lacks `acquireTime`, `renewTime` or a positive
/// `leaseDurationSeconds` (docs/protocol.md §4).
const MISSING_LEASE_DURATION: SignedDuration = SignedDuration::from_secs(15);

/// How long a released or taken-over Lease stays `dead` after its expiry before it is `orphaned`
/// and gets deleted.
pub const ORPHAN_AFTER: SignedDuration = SignedDuration::from_secs(60);

/// `E` and `D` of docs/protocol.md §4: when a Lease expires (`renewTime + leaseDurationSeconds`)
/// and its duration.
///
/// `None` when `acquireTime`, `renewTime` or a positive `leaseDurationSeconds` is missing: such a
/// Lease counts as expiring at every `now`, with a duration of 15 s. The addition saturates at the
/// ends of the representable range, so garbage fields never make the computation fail.
#[must_use]
pub fn expiry(
    acquire_time: Option<Timestamp>,
    renew_time: Option<Timestamp>,
    lease_duration_seconds: Option<i32>,
) -> Option<(Timestamp, SignedDuration)> {
    let seconds = lease_duration_seconds.filter(|&secs| secs > 0)?;
    // `E` does not depend on `acquireTime`, but a Lease without it was never properly acquired.
    acquire_time?;
    let duration = SignedDuration::from_secs(i64::from(seconds));
    Some((add(renew_time?, duration), duration))
}

/// When the Lease with this spec expires; see [`expiry`].
#[must_use]
pub fn lease_expiry(spec: &LeaseSpec) -> Option<Timestamp> {
    expiry(
        spec.acquire_time.as_ref().map(|t| t.0),
        spec.renew_time.as_ref().map(|t| t.0),
        spec.lease_duration_seconds,
    )
    .map(|(expiry, _)| expiry)
}

/// Whether the Lease with this spec has expired at `now`: `now ≥ renewTime +
/// leaseDurationSeconds`, or it lacks timing fields (docs/protocol.md §4). A shard's Lease is
/// `expired` from exactly that instant on, and from then on another candidate may take it.
#[must_use]
pub fn is_expired(spec: &LeaseSpec, now: Timestamp) -> bool {
    lease_expiry(spec).is_none_or(|expiry| now >= expiry)
}

/// Whether `name` can be a shard name: it is written as a label value on every object the shard
/// owns, so it must be a non-empty label value (at most 63 characters of alphanumerics, `-`, `_`
/// and `.`, starting and ending alphanumeric; docs/protocol.md §18).
#[must_use]
pub fn is_valid_shard_name(name: &str) -> bool {
    !name.is_empty() && is_valid_label_value(name)
}

/// How a Lease holder times its Lease: how long the Lease is valid, when the holder gives it up
/// without a successful renewal, and how often it tries.
///
/// **Sharp edge:** the gap between `renew_deadline` and `lease_duration` is a safety margin. A
/// holder stops considering itself the owner `renew_deadline` after it sent its last renewal,
/// while others wait for `lease_duration` before taking over. Whoever judges expiry by comparing
/// `renewTime` with their own clock (a sharder replica taking leadership, a shard taking its Lease
/// back) is only safe while the two clocks agree within that gap. The sharder judges shard Leases
/// by when it saw them renewed, not by `renewTime`, and waits two lease durations, so for shard
/// Leases the clocks' offsets do not matter (docs/protocol.md §4). Do not shrink it to nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseTiming {
    /// `leaseDurationSeconds`: how long others wait after the last renewal before taking over.
    pub lease_duration: Duration,
    /// How long the holder keeps considering itself the owner without a successful renewal.
    pub renew_deadline: Duration,
    /// Interval between renewals, and between attempts to acquire.
    pub retry_period: Duration,
}

impl Default for LeaseTiming {
    fn default() -> Self {
        Self {
            lease_duration: DEFAULT_LEASE_DURATION,
            renew_deadline: DEFAULT_RENEW_DEADLINE,
            retry_period: DEFAULT_RETRY_PERIOD,
        }
    }
}

/// Which of the [`LeaseTiming`] values breaks the rule, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseTimingError {
    /// The Lease stores whole seconds, so a shorter duration cannot be written.
    #[error("must be at least one second")]
    LeaseDurationTooShort,
    /// The sharder counts at most [`MAX_LEASE_DURATION`]: a longer one would let it take the Lease
    /// over while its holder still considers it held.
    #[error("must be at most 300 seconds, the longest lease duration the sharder counts")]
    LeaseDurationTooLong,
    /// A zero renew deadline gives the Lease up at once.
    #[error("must be positive")]
    RenewDeadlineNotPositive,
    /// A zero retry period would spin.
    #[error("must be positive")]
    RetryPeriodNotPositive,
    /// The holder must give the Lease up before others may take it.
    #[error("must be shorter than the lease duration")]
    RenewDeadlineNotShorter,
    /// At least one renewal must fit before the deadline.
    #[error("must be shorter than the renew deadline")]
    RetryPeriodNotShorter,
}

impl LeaseTimingError {
    /// The offending value: `leaseDuration`, `renewDeadline` or `retryPeriod`.
    #[must_use]
    pub const fn field(self) -> &'static str {
        match self {
            Self::LeaseDurationTooShort | Self::LeaseDurationTooLong => "leaseDuration",
            Self::RenewDeadlineNotPositive | Self::RenewDeadlineNotShorter => "renewDeadline",
            Self::RetryPeriodNotPositive | Self::RetryPeriodNotShorter => "retryPeriod",
        }
    }
}

impl LeaseTiming {
    /// Checks `0 < retry_period < renew_deadline < lease_duration` and a lease duration from one
    /// second to [`MAX_LEASE_DURATION`]; the error names the first offending value.
    pub fn validate(&self) -> Result<(), LeaseTimingError> {
        if self.lease_duration < Duration::from_secs(1) {
            return Err(LeaseTimingError::LeaseDurationTooShort);
        }
        if self.lease_duration > MAX_LEASE_DURATION {
            return Err(LeaseTimingError::LeaseDurationTooLong);
        }
        if self.renew_deadline.is_zero() {
            return Err(LeaseTimingError::RenewDeadlineNotPositive);
        }
        if self.retry_period.is_zero() {
            return Err(LeaseTimingError::RetryPeriodNotPositive);
        }
        if self.renew_deadline >= self.lease_duration {
            return Err(LeaseTimingError::RenewDeadlineNotShorter);
        }
        if self.retry_period >= self.renew_deadline {
            return Err(LeaseTimingError::RetryPeriodNotShorter);
        }
        Ok(())
    }

    /// `leaseDurationSeconds` as written to the Lease (rounded up to whole seconds).
    #[must_use]
    pub fn lease_duration_seconds(&self) -> i32 {
        let whole =
            self.lease_duration.as_secs() + u64::from(self.lease_duration.subsec_nanos() > 0);
        i32::try_from(whole).unwrap_or(i32::MAX)
    }
}

/// The state of a shard, as written to the state label of its Lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ShardState {
    /// The shard holds its Lease and renews it in time.
    Ready,
    /// The shard holds its Lease but missed the renewal for less than one lease duration.
    Expired,
    /// The shard holds its Lease but missed the renewal for at least one lease duration; the
    /// sharder takes the Lease over at once.
    Uncertain,
    /// The Lease was released or taken over; the shard no longer runs.
    Dead,
    /// The Lease has been dead for long enough to be deleted.
    Orphaned,
}

impl ShardState {
    /// Every state, in the order of the lifecycle.
    pub const ALL: [Self; 5] = [
        Self::Ready,
        Self::Expired,
        Self::Uncertain,
        Self::Dead,
        Self::Orphaned,
    ];

    /// The label value of the state: `ready`, `expired`, `uncertain`, `dead` or `orphaned`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Expired => "expired",
            Self::Uncertain => "uncertain",
            Self::Dead => "dead",
            Self::Orphaned => "orphaned",
        }
    }

    /// Whether objects may be assigned to a shard in this state.
    ///
    /// `expired` and `uncertain` shards stay available so that a short renewal hiccup does not
    /// move objects around; an `uncertain` Lease is taken over immediately, making it `dead`.
    #[must_use]
    pub const fn is_available(self) -> bool {
        matches!(self, Self::Ready | Self::Expired | Self::Uncertain)
    }
}

impl fmt::Display for ShardState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A state label value that is not one of the known states.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid shard state {0:?}: expected ready, expired, uncertain, dead or orphaned")]
pub struct ParseShardStateError(pub String);

impl FromStr for ShardState {
    type Err = ParseShardStateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| ParseShardStateError(s.to_owned()))
    }
}

/// The fields of a shard's membership Lease that its state depends on.
///
/// Build it with [`ShardLease::from_lease`] or field by field.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardLease<'a> {
    /// `metadata.name`, which is the shard name.
    pub name: &'a str,
    /// `spec.holderIdentity`.
    pub holder_identity: Option<&'a str>,
    /// `spec.leaseDurationSeconds`.
    pub lease_duration_seconds: Option<i32>,
    /// `spec.acquireTime`.
    pub acquire_time: Option<Timestamp>,
    /// `spec.renewTime`.
    pub renew_time: Option<Timestamp>,
    /// `spec.leaseTransitions`; only the takeover uses it.
    pub lease_transitions: Option<i32>,
}

/// Expiry and duration of a Lease as the state table uses them.
struct Timing {
    /// `E`: when the Lease expires.
    expiry: Timestamp,
    /// `D`: the lease duration.
    duration: SignedDuration,
    /// Whether the Lease lacked timing fields, so `E` is "now" whenever it is evaluated and the
    /// state never changes just because time passes.
    floating: bool,
}

impl<'a> ShardLease<'a> {
    /// Borrows the relevant fields of a Lease. Missing metadata or spec reads as empty.
    #[must_use]
    pub fn from_lease(lease: &'a Lease) -> Self {
        let name = lease.metadata.name.as_deref().unwrap_or_default();
        let Some(spec) = lease.spec.as_ref() else {
            return Self {
                name,
                ..Self::default()
            };
        };
        Self {
            name,
            holder_identity: spec.holder_identity.as_deref(),
            lease_duration_seconds: spec.lease_duration_seconds,
            acquire_time: spec.acquire_time.as_ref().map(|t| t.0),
            renew_time: spec.renew_time.as_ref().map(|t| t.0),
            lease_transitions: spec.lease_transitions,
        }
    }

    /// Whether the shard itself holds the Lease (the holder is non-empty and equals the name).
    #[must_use]
    pub fn is_held_by_shard(&self) -> bool {
        self.holder_identity
            .is_some_and(|holder| !holder.is_empty() && holder == self.name)
    }

    /// The positive lease duration in seconds, if the Lease has usable timing fields.
    fn duration_seconds(&self) -> Option<i32> {
        self.lease_duration_seconds.filter(|&secs| secs > 0)
    }

    /// `E` of docs/protocol.md §4; `None` when the Lease lacks timing fields, so it expires at
    /// every `now`.
    #[must_use]
    pub fn expiry(&self) -> Option<Timestamp> {
        expiry(
            self.acquire_time,
            self.renew_time,
            self.lease_duration_seconds,
        )
        .map(|(expiry, _)| expiry)
    }

    fn timing(&self, now: Timestamp) -> Timing {
        match expiry(
            self.acquire_time,
            self.renew_time,
            self.lease_duration_seconds,
        ) {
            Some((expiry, duration)) => Timing {
                expiry,
                duration,
                floating: false,
            },
            None => Timing {
                expiry: now,
                duration: MISSING_LEASE_DURATION,
                floating: true,
            },
        }
    }

    /// The shard's state at `now`.
    ///
    /// A Lease without `acquireTime`, `renewTime` or a positive `leaseDurationSeconds` counts as
    /// expiring at `now` with a duration of 15 s: `expired` if the shard holds it, `dead`
    /// otherwise, for as long as it stays that way.
    #[must_use]
    pub fn state(&self, now: Timestamp) -> ShardState {
        self.evaluate(now).0
    }

    /// The instant after `now` at which [`state`](Self::state) changes if nobody writes the Lease,
    /// or `None` if it never changes on its own (`uncertain`, `orphaned`, and Leases lacking timing
    /// fields).
    ///
    /// With absurd durations the boundary can lie decades ahead, up to [`Timestamp::MAX`]:
    /// cap it before handing it to a timer.
    #[must_use]
    pub fn next_boundary(&self, now: Timestamp) -> Option<Timestamp> {
        self.evaluate(now).1
    }

    /// The state at `now` together with [`next_boundary`](Self::next_boundary).
    #[must_use]
    pub fn evaluate(&self, now: Timestamp) -> (ShardState, Option<Timestamp>) {
        let Timing {
            expiry,
            duration,
            floating,
        } = self.timing(now);
        let (state, boundary) = if self.is_held_by_shard() {
            let uncertain_at = add(expiry, duration);
            if now < expiry {
                (ShardState::Ready, Some(expiry))
            } else if now < uncertain_at {
                (ShardState::Expired, Some(uncertain_at))
            } else {
                (ShardState::Uncertain, None)
            }
        } else {
            let orphaned_at = add(expiry, ORPHAN_AFTER);
            if now < orphaned_at {
                (ShardState::Dead, Some(orphaned_at))
            } else {
                (ShardState::Orphaned, None)
            }
        };
        // A floating expiry moves with `now`, so the boundary computed above is never reached.
        (state, boundary.filter(|_| !floating))
    }

    /// What the sharder writes to take over this Lease at `now`, once it is `uncertain`.
    ///
    /// The new duration is twice the old one: a shard that merely lost its connection cannot take
    /// its Lease back (and with it objects the sharder is moving away) until that longer duration
    /// passed. That the shard has stopped by the time of the takeover follows from the timing, not
    /// from the doubling: it is `uncertain` two lease durations after the last renewal the sharder
    /// saw, and the shard gave up `renewDeadline` after sending it.
    #[must_use]
    pub fn takeover(&self, now: Timestamp) -> Takeover {
        let duration_seconds = self
            .duration_seconds()
            .map_or(2 * MISSING_LEASE_DURATION.as_secs(), |secs| {
                i64::from(secs) * 2
            });
        Takeover {
            holder_identity: IDENTITY_SHARD_LEASE_CONTROLLER,
            lease_duration_seconds: i32::try_from(duration_seconds).unwrap_or(i32::MAX),
            acquire_time: now,
            renew_time: now,
            lease_transitions: self.lease_transitions.unwrap_or(0).saturating_add(1),
        }
    }
}

/// The state of a shard's Lease at `now`; shorthand for [`ShardLease::state`].
#[must_use]
pub fn lease_state(lease: &Lease, now: Timestamp) -> ShardState {
    ShardLease::from_lease(lease).state(now)
}

/// The Lease fields the sharder sets when it takes over an `uncertain` Lease.
///
/// Write them as an update guarded by the Lease's `resourceVersion`: only a successful write proves
/// that the shard can no longer renew.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Takeover {
    /// The new holder: [`IDENTITY_SHARD_LEASE_CONTROLLER`].
    pub holder_identity: &'static str,
    /// Twice the previous lease duration (30 s if it was missing), saturating at `i32::MAX`.
    pub lease_duration_seconds: i32,
    /// The takeover time.
    pub acquire_time: Timestamp,
    /// The takeover time.
    pub renew_time: Timestamp,
    /// The previous transition count plus one (a missing count is 0).
    pub lease_transitions: i32,
}

impl Takeover {
    /// Writes the takeover into a Lease spec, leaving its other fields alone.
    pub fn apply(&self, spec: &mut LeaseSpec) {
        spec.holder_identity = Some(self.holder_identity.to_owned());
        spec.lease_duration_seconds = Some(self.lease_duration_seconds);
        spec.acquire_time = Some(MicroTime(self.acquire_time));
        spec.renew_time = Some(MicroTime(self.renew_time));
        spec.lease_transitions = Some(self.lease_transitions);
    }
}

/// Adds without failing: timestamps saturate at the ends of the representable range, so garbage
/// Lease fields cannot make the state computation error out.
fn add(timestamp: Timestamp, duration: SignedDuration) -> Timestamp {
    timestamp
        .checked_add(duration)
        .unwrap_or(if duration.is_negative() {
            Timestamp::MIN
        } else {
            Timestamp::MAX
        })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    const NAME: &str = "shard-a";

    fn t0() -> Timestamp {
        "2025-01-01T00:00:00Z".parse().expect("valid timestamp")
    }

    fn secs(n: i64) -> SignedDuration {
        SignedDuration::from_secs(n)
    }

    fn at(offset: SignedDuration) -> Timestamp {
        t0() + offset
    }

    const NS: SignedDuration = SignedDuration::from_nanos(1);

    /// A Lease renewed at `t0` with duration `d`, held by `holder`.
    fn lease(holder: Option<&'static str>, d: Option<i32>) -> ShardLease<'static> {
        ShardLease {
            name: NAME,
            holder_identity: holder,
            lease_duration_seconds: d,
            acquire_time: Some(t0() - secs(100)),
            renew_time: Some(t0()),
            lease_transitions: Some(3),
        }
    }

    #[test]
    fn state_labels_round_trip() {
        for state in ShardState::ALL {
            assert_eq!(state.as_str().parse::<ShardState>(), Ok(state));
            assert_eq!(state.to_string(), state.as_str());
        }
        let labels: Vec<_> = ShardState::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(
            labels,
            ["ready", "expired", "uncertain", "dead", "orphaned"]
        );
        let err = "Ready"
            .parse::<ShardState>()
            .expect_err("labels are lowercase");
        assert_eq!(err, ParseShardStateError("Ready".into()));
        assert!(err.to_string().starts_with("invalid shard state \"Ready\""));
        assert!("".parse::<ShardState>().is_err());
    }

    #[test]
    fn availability() {
        let available: Vec<_> = ShardState::ALL
            .into_iter()
            .filter(|s| s.is_available())
            .collect();
        assert_eq!(
            available,
            [
                ShardState::Ready,
                ShardState::Expired,
                ShardState::Uncertain
            ]
        );
    }

    #[test]
    fn held_lease_boundaries() {
        use ShardState::*;
        let d = 10;
        let e = secs(d); // renewTime (t0) + D
        let cases = [
            (-secs(1000), Ready, Some(at(e))),
            (e - NS, Ready, Some(at(e))),
            (e, Expired, Some(at(e + e))),
            (e + NS, Expired, Some(at(e + e))),
            (e + e - NS, Expired, Some(at(e + e))),
            (e + e, Uncertain, None),
            (e + e + NS, Uncertain, None),
            (secs(1_000_000), Uncertain, None),
        ];
        let lease = lease(Some(NAME), Some(d as i32));
        for (offset, state, boundary) in cases {
            let now = at(offset);
            assert_eq!(lease.state(now), state, "now = t0 + {offset}");
            assert_eq!(lease.next_boundary(now), boundary, "now = t0 + {offset}");
            assert_eq!(lease.evaluate(now), (state, boundary));
        }
    }

    #[test]
    fn released_or_foreign_lease_boundaries() {
        use ShardState::*;
        let d = 10;
        let orphaned_at = secs(d) + ORPHAN_AFTER; // E + 60 s
        let cases = [
            (-secs(1000), Dead, Some(at(orphaned_at))),
            (secs(0), Dead, Some(at(orphaned_at))),
            (orphaned_at - NS, Dead, Some(at(orphaned_at))),
            (orphaned_at, Orphaned, None),
            (orphaned_at + NS, Orphaned, None),
        ];
        for holder in [
            None,
            Some(""),
            Some("shard-b"),
            Some(IDENTITY_SHARD_LEASE_CONTROLLER),
        ] {
            let lease = lease(holder, Some(d as i32));
            for (offset, state, boundary) in cases {
                let now = at(offset);
                assert_eq!(
                    lease.evaluate(now),
                    (state, boundary),
                    "holder {holder:?}, now = t0 + {offset}"
                );
                assert!(!state.is_available());
            }
        }
    }

    #[test]
    fn empty_name_and_holder_is_not_held() {
        let lease = ShardLease {
            name: "",
            holder_identity: Some(""),
            ..lease(None, Some(10))
        };
        assert!(!lease.is_held_by_shard());
        assert_eq!(lease.state(t0()), ShardState::Dead);
    }

    #[test]
    fn missing_timing_fields_expire_now_with_default_duration() {
        let complete = lease(Some(NAME), Some(10));
        let variants = [
            ShardLease {
                acquire_time: None,
                ..complete
            },
            ShardLease {
                renew_time: None,
                ..complete
            },
            ShardLease {
                lease_duration_seconds: None,
                ..complete
            },
        ];
        // Far in the past and future of renewTime: the expiry follows `now`.
        for now in [at(-secs(10_000)), t0(), at(secs(10_000))] {
            for lease in variants {
                assert_eq!(
                    lease.evaluate(now),
                    (ShardState::Expired, None),
                    "{lease:?}"
                );
                let released = ShardLease {
                    holder_identity: None,
                    ..lease
                };
                assert_eq!(
                    released.evaluate(now),
                    (ShardState::Dead, None),
                    "{lease:?}"
                );
            }
        }
    }

    #[test]
    fn garbage_durations_do_not_panic() {
        for d in [0, -1, -15, i32::MIN] {
            for holder in [Some(NAME), None] {
                let lease = lease(holder, Some(d));
                let expected = if holder.is_some() {
                    ShardState::Expired
                } else {
                    ShardState::Dead
                };
                // Non-positive durations count as missing.
                assert_eq!(lease.evaluate(t0()), (expected, None), "duration {d}");
                assert_eq!(lease.takeover(t0()).lease_duration_seconds, 30);
            }
        }

        // i32::MAX seconds is about 68 years: valid, just long.
        let lease = lease(Some(NAME), Some(i32::MAX));
        let expiry = at(secs(i64::from(i32::MAX)));
        assert_eq!(lease.evaluate(t0()), (ShardState::Ready, Some(expiry)));
        assert_eq!(lease.takeover(t0()).lease_duration_seconds, i32::MAX);

        // Near the end of time, arithmetic saturates instead of failing.
        for holder in [Some(NAME), None] {
            let late = ShardLease {
                renew_time: Some(Timestamp::MAX - secs(5)),
                ..lease
            };
            let late = ShardLease {
                holder_identity: holder,
                ..late
            };
            for now in [t0(), Timestamp::MAX - secs(1), Timestamp::MAX] {
                let (state, boundary) = late.evaluate(now);
                if let Some(boundary) = boundary {
                    assert!(boundary > now, "{state}: {boundary} <= {now}");
                }
            }
            assert_eq!(
                late.evaluate(t0()).1,
                Some(Timestamp::MAX),
                "saturated boundary"
            );
        }
        let early = ShardLease {
            renew_time: Some(Timestamp::MIN),
            ..lease
        };
        assert_eq!(early.state(Timestamp::MAX), ShardState::Uncertain);
    }

    #[test]
    fn boundary_is_where_the_state_changes() {
        let d = 7;
        for holder in [Some(NAME), None] {
            let lease = lease(holder, Some(d));
            let mut now = at(-secs(5));
            let mut seen = vec![lease.state(now)];
            while let Some(boundary) = lease.next_boundary(now) {
                assert!(boundary > now);
                assert_eq!(lease.state(boundary - NS), lease.state(now));
                assert_ne!(lease.state(boundary), lease.state(now));
                now = boundary;
                seen.push(lease.state(now));
            }
            let expected: &[ShardState] = if holder.is_some() {
                &[
                    ShardState::Ready,
                    ShardState::Expired,
                    ShardState::Uncertain,
                ]
            } else {
                &[ShardState::Dead, ShardState::Orphaned]
            };
            assert_eq!(seen, expected);
        }
    }

    #[test]
    fn takeover_doubles_duration_and_bumps_transitions() {
        let now = at(secs(30));
        let takeover = lease(Some(NAME), Some(10)).takeover(now);
        assert_eq!(
            takeover,
            Takeover {
                holder_identity: "shardlease-controller",
                lease_duration_seconds: 20,
                acquire_time: now,
                renew_time: now,
                lease_transitions: 4,
            }
        );

        let fresh = ShardLease {
            lease_transitions: None,
            lease_duration_seconds: None,
            ..lease(Some(NAME), None)
        };
        let takeover = fresh.takeover(now);
        assert_eq!(takeover.lease_transitions, 1);
        assert_eq!(takeover.lease_duration_seconds, 30);

        let saturated = ShardLease {
            lease_transitions: Some(i32::MAX),
            ..fresh
        };
        assert_eq!(saturated.takeover(now).lease_transitions, i32::MAX);
    }

    #[test]
    fn taken_over_lease_is_dead_then_orphaned() {
        let d = 10;
        let now = at(secs(2 * d));
        let original = lease(Some(NAME), Some(d as i32));
        assert_eq!(original.state(now), ShardState::Uncertain);

        let mut raw = Lease {
            metadata: ObjectMeta {
                name: Some(NAME.into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(NAME.into()),
                lease_duration_seconds: Some(d as i32),
                acquire_time: original.acquire_time.map(MicroTime),
                renew_time: original.renew_time.map(MicroTime),
                lease_transitions: Some(3),
                strategy: Some("kept".into()),
                ..LeaseSpec::default()
            }),
        };
        assert_eq!(ShardLease::from_lease(&raw), original);
        assert_eq!(lease_state(&raw, now), ShardState::Uncertain);

        let spec = raw.spec.as_mut().expect("spec");
        original.takeover(now).apply(spec);
        assert_eq!(spec.strategy.as_deref(), Some("kept"));
        assert_eq!(spec.lease_transitions, Some(4));

        let taken = ShardLease::from_lease(&raw);
        let orphaned_at = now + secs(2 * d) + ORPHAN_AFTER;
        assert_eq!(taken.evaluate(now), (ShardState::Dead, Some(orphaned_at)));
        assert_eq!(lease_state(&raw, orphaned_at), ShardState::Orphaned);
    }

    #[test]
    fn lease_without_spec_or_name() {
        let lease = Lease::default();
        let view = ShardLease::from_lease(&lease);
        assert_eq!(view, ShardLease::default());
        assert_eq!(view.evaluate(t0()), (ShardState::Dead, None));
    }

    #[test]
    fn spec_expiry_is_the_state_tables_expiry() {
        let spec = |acquire: Option<i64>, renew: Option<i64>, duration: Option<i32>| LeaseSpec {
            holder_identity: Some("other".into()),
            acquire_time: acquire.map(|s| MicroTime(at(secs(s)))),
            renew_time: renew.map(|s| MicroTime(at(secs(s)))),
            lease_duration_seconds: duration,
            ..LeaseSpec::default()
        };
        let complete = spec(Some(-100), Some(0), Some(10));
        assert_eq!(lease_expiry(&complete), Some(at(secs(10))));
        assert!(!is_expired(&complete, at(secs(10) - NS)));
        // Expired from exactly `E` on, as the shard state table has it.
        assert!(is_expired(&complete, at(secs(10))));
        assert_eq!(
            ShardLease {
                name: "other",
                ..ShardLease::default()
            }
            .expiry(),
            None
        );
        for incomplete in [
            spec(None, Some(0), Some(10)),
            spec(Some(-100), None, Some(10)),
            spec(Some(-100), Some(0), None),
            spec(Some(-100), Some(0), Some(0)),
            spec(Some(-100), Some(0), Some(-5)),
        ] {
            assert_eq!(lease_expiry(&incomplete), None, "{incomplete:?}");
            assert!(is_expired(&incomplete, at(-secs(10_000))), "{incomplete:?}");
        }
        // Saturates instead of failing.
        let late = LeaseSpec {
            renew_time: Some(MicroTime(Timestamp::MAX - secs(5))),
            ..complete
        };
        assert_eq!(lease_expiry(&late), Some(Timestamp::MAX));
    }

    #[test]
    fn lease_timing_rule() {
        let ok = LeaseTiming::default();
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(ok.lease_duration_seconds(), 15);
        let with = |lease: u64, renew: u64, retry: u64| LeaseTiming {
            lease_duration: Duration::from_millis(lease),
            renew_deadline: Duration::from_millis(renew),
            retry_period: Duration::from_millis(retry),
        };
        let cases = [
            (
                with(0, 10_000, 2_000),
                LeaseTimingError::LeaseDurationTooShort,
            ),
            (with(500, 400, 100), LeaseTimingError::LeaseDurationTooShort),
            // The audit's case: the sharder would take over after 2 × 300 s while the holder,
            // partitioned for 650 s, still counts on its 800 s renew deadline.
            (
                with(900_000, 800_000, 2_000),
                LeaseTimingError::LeaseDurationTooLong,
            ),
            (
                with(300_001, 10_000, 2_000),
                LeaseTimingError::LeaseDurationTooLong,
            ),
            (
                with(15_000, 0, 2_000),
                LeaseTimingError::RenewDeadlineNotPositive,
            ),
            (
                with(15_000, 10_000, 0),
                LeaseTimingError::RetryPeriodNotPositive,
            ),
            (
                with(15_000, 15_000, 2_000),
                LeaseTimingError::RenewDeadlineNotShorter,
            ),
            (
                with(15_000, 20_000, 2_000),
                LeaseTimingError::RenewDeadlineNotShorter,
            ),
            (
                with(15_000, 10_000, 10_000),
                LeaseTimingError::RetryPeriodNotShorter,
            ),
        ];
        for (timing, error) in cases {
            assert_eq!(timing.validate(), Err(error), "{timing:?}");
        }
        assert_eq!(
            LeaseTimingError::RenewDeadlineNotShorter.to_string(),
            "must be shorter than the lease duration"
        );
        assert_eq!(
            LeaseTimingError::RetryPeriodNotShorter.field(),
            "retryPeriod"
        );
        assert_eq!(with(1_000, 900, 100).validate(), Ok(()));
        assert_eq!(with(300_000, 10_000, 2_000).validate(), Ok(()));
        assert_eq!(with(2_500, 2_000, 100).lease_duration_seconds(), 3);
        let huge = LeaseTiming {
            lease_duration: Duration::from_secs(u64::MAX),
            ..ok
        };
        assert_eq!(huge.lease_duration_seconds(), i32::MAX);
    }

    #[test]
    fn shard_names_are_label_values() {
        for name in [
            "shard-0",
            "a",
            "checksum-controller-7d9f-abcde",
            "a.b_c",
            &"a".repeat(63),
        ] {
            assert!(is_valid_shard_name(name), "{name}");
        }
        for name in ["", &"a".repeat(64), "-a", "a-", "a/b", "Ä", "a b"] {
            assert!(!is_valid_shard_name(name), "{name}");
        }
    }
}
