//! Shard liveness by the sharder's own clock (docs/protocol.md §4).
//!
//! A shard writes `renewTime` with its own clock. Comparing that with the sharder's clock would
//! make every decision depend on two machines agreeing on the time: a shard whose clock runs 30 s
//! behind would look dead right after each renewal, and its objects would move while it still
//! reconciles them. So the Lease caches do what client-go's leader election does: they note when
//! the sharder *saw* each renewal (a change of holder, `acquireTime`, `renewTime` or duration)
//! and store that instant as the cached Lease's `renewTime`. Every state, boundary and takeover
//! computed from the cache then counts the lease duration from the sharder's observation. A shard
//! gives its Lease up `renewDeadline` after it *sent* its last renewal, which the sharder can only
//! see later, so the margin between the two no longer depends on the clocks' offsets, only on
//! their rates.
//!
//! The same normalisation keeps malformed Leases from stranding objects: a held Lease without
//! `acquireTime` or `renewTime` counts from when the sharder first saw it, a missing or
//! non-positive `leaseDurationSeconds` counts as [`MISSING_LEASE_DURATION`], and a longer one than
//! [`MAX_LEASE_DURATION`] as that. A shard that stops renewing is therefore taken over at most
//! `2 × MAX_LEASE_DURATION` after the sharder last saw it change, whatever its fields say.
//!
//! A holder's duration only grows while it holds the Lease: a write that shortens
//! `leaseDurationSeconds` without changing the holder (which a shard never does; anyone with
//! `update` on the Lease could) is counted with the longest duration seen since the holder took
//! it. Otherwise such a write would make a running shard look dead and its objects move to
//! another shard before it noticed (docs/protocol.md §4).
//!
//! What the shard's clock says is still measured: the difference between the `renewTime` it
//! wrote and the instant the sharder saw the write is its [clock skew](Renewals::skew), reported
//! as a metric and, beyond [`SKEW_WARNING`], as a Warning Event.
//!
//! The price: after the sharder starts, a Lease it has not seen renewed counts as renewed at that
//! moment, so a shard that died while no sharder ran is taken over two lease durations after the
//! start instead of at once.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::runtime::watcher;
use kube_sharding_api::lease::ShardLease;

/// The lease duration counted for a Lease without a positive `leaseDurationSeconds`
/// (docs/protocol.md §4).
pub(crate) const MISSING_LEASE_DURATION: i32 = 15;

/// The longest lease duration the sharder counts: a Lease that claims more (up to 68 years fit
/// the field) would otherwise keep the objects of a shard that died for that long. The shard
/// library refuses longer ones ([`kube_sharding_api::lease::MAX_LEASE_DURATION`]).
pub(crate) const MAX_LEASE_DURATION: i32 = {
    let secs = kube_sharding_api::lease::MAX_LEASE_DURATION.as_secs();
    assert!(secs <= i32::MAX as u64);
    secs as i32
};

/// How far a shard's `renewTime` may lie from the sharder's clock before it is reported. Watch
/// delivery adds well under a second; anything beyond a few seconds is the shard's clock.
pub(crate) const SKEW_WARNING: SignedDuration = SignedDuration::from_secs(5);

/// What the sharder saw of each Lease of one ring kind: when it last changed, and the skew of its
/// holder's clock.
#[derive(Debug, Default)]
pub(crate) struct Renewals {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Lease UID → what was seen of it.
    seen: HashMap<String, Seen>,
    /// The UIDs listed since the watch restarted, until the listing is complete; then every other
    /// entry is forgotten.
    listing: Option<HashSet<String>>,
}

#[derive(Debug)]
struct Seen {
    /// The Lease's timing fields as its holder wrote them.
    written: Written,
    /// When the sharder saw them change last.
    observed: Timestamp,
    /// The longest positive duration written since the current holder took the Lease: what
    /// the sharder counts while the holder stays.
    longest: Option<i32>,
    /// `renewTime` minus `observed`, for renewals seen as they happened.
    skew: Option<SignedDuration>,
    /// Whether the last reported skew exceeded [`SKEW_WARNING`].
    skewed: bool,
    /// Whether `skewed` changed with the last event and nobody asked yet.
    skewed_changed: bool,
}

/// The fields a renewal or a takeover writes.
#[derive(Debug, PartialEq, Eq)]
struct Written {
    holder: Option<String>,
    acquire: Option<Timestamp>,
    renew: Option<Timestamp>,
    duration: Option<i32>,
}

impl Written {
    fn of(lease: &Lease) -> Self {
        let spec = lease.spec.as_ref();
        Self {
            holder: spec.and_then(|s| s.holder_identity.clone()),
            acquire: spec.and_then(|s| s.acquire_time.as_ref()).map(|t| t.0),
            renew: spec.and_then(|s| s.renew_time.as_ref()).map(|t| t.0),
            duration: spec.and_then(|s| s.lease_duration_seconds),
        }
    }
}

impl Renewals {
    /// Notes what a watch event shows at `now` and rewrites its Lease's timing to the sharder's
    /// observation (see the module docs). Called for every event before the cache applies it.
    pub(crate) fn prepare(&self, event: &mut watcher::Event<Lease>, now: Timestamp) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        match event {
            watcher::Event::Init => inner.listing = Some(HashSet::new()),
            watcher::Event::InitApply(lease) => {
                if let Some(listing) = inner.listing.as_mut() {
                    listing.insert(lease.uid().unwrap_or_default());
                }
                // Listed after a restart of the watch: a change may be as old as the gap, so it
                // says nothing about the holder's clock.
                inner.stamp(lease, now, false);
            }
            watcher::Event::InitDone => {
                if let Some(listing) = inner.listing.take() {
                    inner.seen.retain(|uid, _| listing.contains(uid));
                }
            }
            watcher::Event::Apply(lease) => inner.stamp(lease, now, true),
            watcher::Event::Delete(lease) => {
                // The deleted Lease as last seen, by the sharder's clock: whether its shard may
                // still run is judged from it.
                inner.stamp(lease, now, false);
                inner.seen.remove(&lease.uid().unwrap_or_default());
            }
        }
    }

    /// How far the clock of the Lease's holder was off the sharder's at its last renewal seen as
    /// it happened (`renewTime` minus the instant the sharder saw it); `None` before the first.
    pub(crate) fn skew(&self, uid: &str) -> Option<SignedDuration> {
        self.inner.lock().ok()?.seen.get(uid).and_then(|s| s.skew)
    }

    /// Whether the Lease's skew crossed [`SKEW_WARNING`] (either way) since the last call for it.
    pub(crate) fn take_skew_change(&self, uid: &str) -> bool {
        let Ok(mut inner) = self.inner.lock() else {
            return false;
        };
        inner
            .seen
            .get_mut(uid)
            .is_some_and(|s| std::mem::take(&mut s.skewed_changed))
    }
}

impl Inner {
    fn stamp(&mut self, lease: &mut Lease, now: Timestamp, live: bool) {
        let written = Written::of(lease);
        let uid = lease.uid().unwrap_or_default();
        let previous = self.seen.get(&uid);
        if previous.is_none_or(|seen| seen.written != written) {
            let measured = written
                .renew
                .filter(|_| live && ShardLease::from_lease(lease).is_held_by_shard())
                .map(|renew| renew.duration_since(now));
            let (last_skew, was_skewed, unasked) = previous.map_or((None, false, false), |s| {
                (s.skew, s.skewed, s.skewed_changed)
            });
            // A renewal seen late (in a listing) keeps the last measurement.
            let skew = measured.or(last_skew);
            let skewed = skew.is_some_and(|s| s.abs() > SKEW_WARNING);
            let written_duration = written.duration.filter(|&d| d > 0);
            let longest = match previous {
                Some(seen)
                    if seen.written.holder == written.holder
                        && written.holder.as_deref().is_some_and(|h| !h.is_empty()) =>
                {
                    seen.longest.max(written_duration)
                }
                _ => written_duration,
            };
            let seen = Seen {
                written,
                observed: now,
                longest,
                skew,
                skewed,
                skewed_changed: unasked || skewed != was_skewed,
            };
            self.seen.insert(uid.clone(), seen);
        }
        let Some(seen) = self.seen.get(&uid) else {
            return;
        };
        let observed = MicroTime(seen.observed);
        let longest = seen.longest;
        if let Some(spec) = lease.spec.as_mut() {
            spec.renew_time = Some(observed.clone());
            spec.acquire_time = Some(spec.acquire_time.take().unwrap_or(observed));
            spec.lease_duration_seconds =
                Some(longest.map_or(MISSING_LEASE_DURATION, |d| d.min(MAX_LEASE_DURATION)));
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use kube::api::ObjectMeta;
    use kube_sharding_api::lease::ShardState;

    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).expect("timestamp")
    }

    fn lease(renew: Option<i64>, duration: Option<i32>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("shard-a".into()),
                uid: Some("u1".into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some("shard-a".into()),
                lease_duration_seconds: duration,
                acquire_time: renew.map(|s| MicroTime(at(s))),
                renew_time: renew.map(|s| MicroTime(at(s))),
                ..Default::default()
            }),
        }
    }

    /// Applies `lease` as a live watch event at `now`; returns the cached copy.
    fn apply(renewals: &Renewals, lease: &Lease, now: i64) -> Lease {
        let mut event = watcher::Event::Apply(lease.clone());
        renewals.prepare(&mut event, at(now));
        match event {
            watcher::Event::Apply(lease) => lease,
            _ => unreachable!(),
        }
    }

    fn state(lease: &Lease, now: i64) -> ShardState {
        ShardLease::from_lease(lease).state(at(now))
    }

    #[test]
    fn a_shard_whose_clock_is_behind_stays_ready_while_it_renews() {
        let renewals = Renewals::default();
        // The shard's clock is 40 s behind: each renewal it writes is 40 s old by ours.
        for now in (0..60).step_by(2) {
            let cached = apply(&renewals, &lease(Some(now - 40), Some(10)), now);
            assert_eq!(state(&cached, now + 1), ShardState::Ready, "at {now}");
        }
        let skew = renewals.skew("u1").expect("measured");
        assert_eq!(skew, SignedDuration::from_secs(-40));
        assert!(renewals.take_skew_change("u1"), "crossed the warning once");
        assert!(!renewals.take_skew_change("u1"), "reported once");
    }

    #[test]
    fn a_shard_that_stops_renewing_expires_by_the_sharders_clock() {
        let renewals = Renewals::default();
        // Its clock is 100 s ahead; its last renewal is seen at 0.
        let cached = apply(&renewals, &lease(Some(100), Some(10)), 0);
        assert_eq!(state(&cached, 9), ShardState::Ready);
        assert_eq!(state(&cached, 10), ShardState::Expired);
        assert_eq!(state(&cached, 20), ShardState::Uncertain);
        // The sharder writing its state label changes no timing field: still counted from 0.
        let again = apply(&renewals, &lease(Some(100), Some(10)), 15);
        assert_eq!(state(&again, 20), ShardState::Uncertain);
    }

    #[test]
    fn a_held_lease_without_timing_is_taken_over_after_two_default_durations() {
        let renewals = Renewals::default();
        let cached = apply(&renewals, &lease(None, None), 0);
        let duration = i64::from(MISSING_LEASE_DURATION);
        assert_eq!(state(&cached, duration - 1), ShardState::Ready);
        assert_eq!(state(&cached, 2 * duration), ShardState::Uncertain);
    }

    #[test]
    fn absurd_durations_count_as_the_maximum() {
        let renewals = Renewals::default();
        let cached = apply(&renewals, &lease(Some(0), Some(i32::MAX)), 0);
        let max = i64::from(MAX_LEASE_DURATION);
        assert_eq!(state(&cached, max - 1), ShardState::Ready);
        assert_eq!(state(&cached, 2 * max), ShardState::Uncertain);
        let cached = apply(&Renewals::default(), &lease(Some(0), Some(-5)), 1);
        assert_eq!(
            cached.spec.and_then(|s| s.lease_duration_seconds),
            Some(MISSING_LEASE_DURATION)
        );
    }

    #[test]
    fn a_listing_after_a_watch_restart_measures_no_skew_and_forgets_deleted_leases() {
        let renewals = Renewals::default();
        let mut events = [
            watcher::Event::Init,
            watcher::Event::InitApply(lease(Some(-600), Some(10))),
            watcher::Event::InitDone,
        ];
        for event in &mut events {
            renewals.prepare(event, at(0));
        }
        assert_eq!(renewals.skew("u1"), None, "a listed renewal may be old");
        assert!(!renewals.take_skew_change("u1"));
        let mut other = lease(Some(0), Some(10));
        other.metadata.uid = Some("u2".into());
        apply(&renewals, &other, 0);
        for mut event in [watcher::Event::Init, watcher::Event::InitDone] {
            renewals.prepare(&mut event, at(1));
        }
        let inner = renewals.inner.lock().expect("lock");
        assert!(inner.seen.is_empty(), "{:?}", inner.seen.keys());
    }

    #[test]
    fn shortening_a_held_lease_counts_the_longest_duration_until_the_holder_changes() {
        let renewals = Renewals::default();
        apply(&renewals, &lease(Some(0), Some(10)), 0);
        // Someone else shortens it to 1 s at 1: the shard renewed at 0 and still runs.
        let cached = apply(&renewals, &lease(Some(0), Some(1)), 1);
        assert_eq!(
            cached.spec.as_ref().and_then(|s| s.lease_duration_seconds),
            Some(10)
        );
        assert_eq!(
            state(&cached, 5),
            ShardState::Ready,
            "not expired after 1 s"
        );
        assert_eq!(state(&cached, 11), ShardState::Expired);
        // Its own renewals keep the longest duration of the holding too.
        let renewed = apply(&renewals, &lease(Some(3), Some(1)), 3);
        assert_eq!(state(&renewed, 12), ShardState::Ready);
        // A new holder starts from what it writes.
        let mut taken = lease(Some(20), Some(4));
        if let Some(spec) = taken.spec.as_mut() {
            spec.holder_identity = Some("other".into());
        }
        let cached = apply(&renewals, &taken, 20);
        assert_eq!(
            cached.spec.as_ref().and_then(|s| s.lease_duration_seconds),
            Some(4)
        );
    }

    #[test]
    fn a_released_lease_has_no_skew() {
        let renewals = Renewals::default();
        let mut released = lease(Some(-600), Some(10));
        if let Some(spec) = released.spec.as_mut() {
            spec.holder_identity = None;
        }
        let cached = apply(&renewals, &released, 0);
        assert_eq!(renewals.skew("u1"), None);
        assert_eq!(state(&cached, 0), ShardState::Dead);
    }
}
