//! When the sharder controller syncs each ring (docs/protocol.md §9), as a state machine over plain
//! data and time.
//!
//! A ring is synced when it first appears and when its view changes (spec changed, a shard became
//! available or unavailable), `syncPeriod` after a successful sync, with exponential backoff
//! (5 s doubling up to `syncPeriod`) after a failed one. After one that held controlled objects
//! back for their controllers, those move as the drains are acknowledged and the ring is synced
//! once more when all have moved, or 5 s after a move failed (5 s doubling up to 30 s when the
//! sync could not remember them). At most one sync per ring runs at a
//! time; a ring whose webhook configuration is not in place yet is looked at again shortly,
//! because moves rely on the webhook.

use std::collections::{HashMap, HashSet};
use std::ops::Add;
use std::time::Duration;

/// First retry delay after a failed sync.
const INITIAL_BACKOFF: Duration = Duration::from_secs(5);

/// Longest wait between syncs of a ring that holds controlled objects back for their controllers.
pub(crate) const OWNER_WAIT_MAX: Duration = Duration::from_secs(30);

/// How often a ring whose webhook configuration is not in place yet is looked at again.
pub(crate) const WEBHOOK_WAIT: Duration = Duration::from_secs(1);

/// Exponential backoff from [`INITIAL_BACKOFF`], doubling per failure, capped at `max`.
pub(crate) fn backoff(failures: u32, max: Duration) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1));
    INITIAL_BACKOFF.saturating_mul(factor).min(max)
}

/// One ring's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RingSchedule<I> {
    /// Revision of the view the last started sync used.
    revision: Option<u64>,
    /// When the next sync is due.
    due: I,
    /// Failed syncs in a row.
    failures: u32,
    /// Syncs in a row that held controlled objects back for their controllers.
    waits: u32,
    /// Whether the ring is to be synced again as soon as the running sync ends (see
    /// [`SyncSchedule::again`]).
    again: bool,
}

/// The sync schedule of every ring. Generic over the instant type so that tests drive it with
/// plain values and the controller with tokio's clock.
#[derive(Debug)]
pub(crate) struct SyncSchedule<I> {
    sync_period: Duration,
    rings: HashMap<String, RingSchedule<I>>,
    /// Rings whose sync runs. A ring deleted and recreated while its sync runs stays here until
    /// that sync has finished, so two syncs of one ring never overlap.
    running: HashSet<String>,
}

impl<I: Copy + Ord + Add<Duration, Output = I>> SyncSchedule<I> {
    /// An empty schedule with the configured `syncPeriod`.
    pub(crate) fn new(sync_period: Duration) -> Self {
        Self {
            sync_period,
            rings: HashMap::new(),
            running: HashSet::new(),
        }
    }

    /// Takes in the current views, as `(ring, revision)`, and returns the rings whose sync starts
    /// now; they count as running until [`finished`](Self::finished). Rings no longer listed
    /// are forgotten. `webhook_in_place` tells whether a ring's webhook configuration has been
    /// applied for its current spec.
    pub(crate) fn start_due<'a>(
        &mut self,
        now: I,
        views: impl IntoIterator<Item = (&'a str, u64)>,
        webhook_in_place: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let views: Vec<(&str, u64)> = views.into_iter().collect();
        self.rings
            .retain(|name, _| views.iter().any(|(ring, _)| ring == name));
        let mut start = Vec::new();
        for (name, revision) in views {
            let schedule = self.rings.entry(name.to_owned()).or_insert(RingSchedule {
                revision: None,
                due: now,
                failures: 0,
                waits: 0,
                again: false,
            });
            if schedule.revision != Some(revision) && schedule.due > now {
                // The view changed since the last sync started: sync again now.
                schedule.due = now;
                schedule.failures = 0;
            }
            if schedule.due <= now && !self.running.contains(name) {
                if !webhook_in_place(name) {
                    schedule.due = now + WEBHOOK_WAIT;
                    continue;
                }
                schedule.revision = Some(revision);
                self.running.insert(name.to_owned());
                start.push(name.to_owned());
            }
        }
        start
    }

    /// The rings whose running sync works on an outdated view: their view's revision changed
    /// since the sync started, or the ring is gone. The caller stops those syncs and reports
    /// each with [`abandoned`](Self::abandoned).
    pub(crate) fn superseded<'a>(
        &self,
        views: impl IntoIterator<Item = (&'a str, u64)>,
    ) -> Vec<String> {
        let views: HashMap<&str, u64> = views.into_iter().collect();
        let mut stale: Vec<String> = self
            .running
            .iter()
            .filter(|name| {
                let started_with = self.rings.get(name.as_str()).and_then(|s| s.revision);
                views.get(name.as_str()).copied() != started_with
            })
            .cloned()
            .collect();
        stale.sort();
        stale
    }

    /// Records that the sync of `ring` was stopped because its view changed: it is due again at
    /// once (with the new view), and it does not count as a failure.
    pub(crate) fn abandoned(&mut self, ring: &str, now: I) {
        self.running.remove(ring);
        if let Some(schedule) = self.rings.get_mut(ring) {
            schedule.due = now;
            schedule.again = false;
        }
    }

    /// Records that `ring` needs another sync because a sync stopped for a newer view had
    /// patches land after its successor may have listed them, where the newer view does not want
    /// them: due at once, or as soon as the running sync ends, whatever that one's outcome.
    pub(crate) fn again(&mut self, ring: &str, now: I) {
        let running = self.running.contains(ring);
        if let Some(schedule) = self.rings.get_mut(ring) {
            if running {
                schedule.again = true;
            } else {
                schedule.due = now;
            }
        }
    }

    /// The end of a running sync of `ring` at `now`: brings the next one forward to `now` if
    /// [`again`](Self::again) asked for it meanwhile.
    fn ended(schedule: &mut RingSchedule<I>, now: I) {
        if std::mem::take(&mut schedule.again) {
            schedule.due = now;
        }
    }

    /// Records the end of a ring's sync at `now`. Returns the backoff before the next attempt
    /// after a failure, for logs.
    pub(crate) fn finished(&mut self, ring: &str, succeeded: bool, now: I) -> Option<Duration> {
        self.running.remove(ring);
        let schedule = self.rings.get_mut(ring)?;
        schedule.waits = 0;
        let backoff = if succeeded {
            schedule.failures = 0;
            schedule.due = now + self.sync_period;
            None
        } else {
            schedule.failures += 1;
            let backoff = backoff(schedule.failures, self.sync_period);
            schedule.due = now + backoff;
            Some(backoff)
        };
        Self::ended(schedule, now);
        backoff
    }

    /// Records the end of a ring's sync at `now` that held controlled objects back for their
    /// controllers, nothing else wrong. It runs again after a backoff that doubles from 5 s only
    /// up to [`OWNER_WAIT_MAX`] (or `syncPeriod`, if shorter), not up to `syncPeriod` as after a
    /// failure: the objects follow within half a minute of their controllers' drains being
    /// acknowledged, however long those took. Returns the backoff, for logs.
    pub(crate) fn waiting(&mut self, ring: &str, now: I) -> Option<Duration> {
        self.running.remove(ring);
        let schedule = self.rings.get_mut(ring)?;
        schedule.failures = 0;
        schedule.waits += 1;
        let backoff = backoff(schedule.waits, OWNER_WAIT_MAX.min(self.sync_period));
        schedule.due = now + backoff;
        Self::ended(schedule, now);
        Some(backoff)
    }

    /// Records the end of a ring's sync that held controlled objects back and left them to be
    /// moved as their controllers' drains are acknowledged. The following reports its end with
    /// [`followed`](Self::followed), which schedules the next sync; until then only a view change
    /// or `syncPeriod` starts one, so a safety-net sync never interrupts moves that are under
    /// way (a sync stops the following and looks at the held objects itself). Returns the wait.
    pub(crate) fn following(&mut self, ring: &str, now: I) -> Option<Duration> {
        self.running.remove(ring);
        let schedule = self.rings.get_mut(ring)?;
        schedule.failures = 0;
        schedule.waits += 1;
        schedule.due = now + self.sync_period;
        Self::ended(schedule, now);
        Some(self.sync_period)
    }

    /// Records that every controlled object a sync of `ring` left to follow its controller has
    /// moved (`all_moved`), or that some moves failed. After all moved the ring is synced once
    /// more at once: children the old shards created while their controllers were draining were
    /// labelled for those shards and are not among those the sync remembered; after a failure,
    /// after the first backoff. Ignored while a sync of the ring runs, which decides itself.
    pub(crate) fn followed(&mut self, ring: &str, all_moved: bool, now: I) {
        if self.running.contains(ring) {
            return;
        }
        if let Some(schedule) = self.rings.get_mut(ring) {
            schedule.waits = 0;
            schedule.due = if all_moved {
                now
            } else {
                now + INITIAL_BACKOFF
            };
        }
    }

    /// When to look at the schedule again unless a view changes or a sync finishes first: the
    /// earliest due time of a ring that is not syncing, else one `syncPeriod` from `now`.
    pub(crate) fn next_wake(&self, now: I) -> I {
        self.rings
            .iter()
            .filter(|(name, _)| !self.running.contains(*name))
            .map(|(_, s)| s.due)
            .min()
            .unwrap_or(now + self.sync_period)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: Duration = Duration::from_secs(300);

    #[test]
    fn a_sync_waiting_for_controllers_runs_again_within_half_a_minute() {
        let mut schedule = SyncSchedule::new(PERIOD);
        let at = |s: u64| Duration::from_secs(s);
        assert_eq!(schedule.start_due(at(0), [("a", 1)], |_| true), ["a"]);
        let mut now = at(0);
        let mut waits = Vec::new();
        for _ in 0..6 {
            let wait = schedule.waiting("a", now).expect("known ring");
            waits.push(wait.as_secs());
            now += wait;
            assert_eq!(schedule.start_due(now, [("a", 1)], |_| true), ["a"]);
        }
        assert_eq!(waits, [5, 10, 20, 30, 30, 30]);
        // A failure afterwards backs off from the start again.
        assert_eq!(schedule.finished("a", false, now), Some(at(5)));
    }

    /// Time as an offset from the start: `Duration` is a fine instant for the state machine.
    fn at(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    fn ready(_: &str) -> bool {
        true
    }

    #[test]
    fn backoff_doubles_from_five_seconds_up_to_the_sync_period() {
        let max = Duration::from_secs(300);
        assert_eq!(backoff(1, max), Duration::from_secs(5));
        assert_eq!(backoff(2, max), Duration::from_secs(10));
        assert_eq!(backoff(3, max), Duration::from_secs(20));
        assert_eq!(backoff(7, max), Duration::from_secs(300));
        assert_eq!(backoff(u32::MAX, max), Duration::from_secs(300));
    }

    #[test]
    fn new_ring_syncs_at_once_then_every_sync_period() {
        let mut schedule = SyncSchedule::new(PERIOD);
        assert_eq!(schedule.next_wake(at(0)), at(300), "nothing to do");
        assert_eq!(schedule.start_due(at(0), [("a", 1)], ready), ["a"]);
        // Running: neither started again nor woken for.
        assert!(schedule.start_due(at(1), [("a", 1)], ready).is_empty());
        assert_eq!(schedule.next_wake(at(1)), at(301));
        assert_eq!(schedule.finished("a", true, at(10)), None);
        assert_eq!(schedule.next_wake(at(10)), at(310));
        assert!(schedule.start_due(at(309), [("a", 1)], ready).is_empty());
        assert_eq!(schedule.start_due(at(310), [("a", 1)], ready), ["a"]);
    }

    #[test]
    fn failures_back_off_and_a_success_resets() {
        let mut schedule = SyncSchedule::new(PERIOD);
        let mut now = at(0);
        for expected in [5, 10, 20, 40, 80, 160, 300, 300] {
            assert_eq!(schedule.start_due(now, [("a", 1)], ready), ["a"]);
            let backoff = schedule.finished("a", false, now).expect("failed");
            assert_eq!(backoff, Duration::from_secs(expected));
            now += backoff;
            assert_eq!(schedule.next_wake(now), now);
        }
        assert_eq!(schedule.start_due(now, [("a", 1)], ready), ["a"]);
        assert_eq!(schedule.finished("a", true, now), None);
        assert_eq!(
            schedule.start_due(now, [("a", 1)], ready),
            Vec::<String>::new()
        );
        assert_eq!(
            schedule.start_due(now + at(1), [("a", 1)], ready),
            Vec::<String>::new()
        );
        schedule.start_due(now + PERIOD, [("a", 1)], ready);
        assert_eq!(
            schedule.finished("a", false, now + PERIOD),
            Some(Duration::from_secs(5)),
            "the backoff starts over"
        );
    }

    #[test]
    fn a_changed_view_syncs_at_once_and_resets_the_backoff() {
        let mut schedule = SyncSchedule::new(PERIOD);
        schedule.start_due(at(0), [("a", 1)], ready);
        schedule.finished("a", false, at(0));
        schedule.start_due(at(5), [("a", 1)], ready);
        schedule.finished("a", false, at(5));
        assert_eq!(schedule.next_wake(at(5)), at(15));
        // New revision before the retry is due.
        assert_eq!(schedule.start_due(at(6), [("a", 2)], ready), ["a"]);
        assert_eq!(
            schedule.finished("a", false, at(7)),
            Some(Duration::from_secs(5))
        );
        // The same revision again does not bring the retry forward.
        assert!(schedule.start_due(at(8), [("a", 2)], ready).is_empty());
    }

    #[test]
    fn a_view_change_during_a_sync_syncs_again_after_it() {
        let mut schedule = SyncSchedule::new(PERIOD);
        schedule.start_due(at(0), [("a", 1)], ready);
        assert!(schedule.start_due(at(1), [("a", 2)], ready).is_empty());
        schedule.finished("a", true, at(2));
        assert_eq!(schedule.start_due(at(2), [("a", 2)], ready), ["a"]);
    }

    #[test]
    fn a_superseded_sync_whose_moves_landed_elsewhere_syncs_the_ring_again() {
        let mut schedule = SyncSchedule::new(PERIOD);
        assert_eq!(schedule.start_due(at(0), [("a", 1)], ready), ["a"]);
        assert_eq!(schedule.superseded([("a", 2)]), ["a"]);
        schedule.abandoned("a", at(1));
        assert_eq!(schedule.start_due(at(1), [("a", 2)], ready), ["a"]);
        // The stopped sync's last moves land while its successor runs: once that one ends, the
        // ring is due at once, not a sync period later.
        schedule.again("a", at(2));
        assert!(schedule.start_due(at(2), [("a", 2)], ready).is_empty());
        assert_eq!(schedule.finished("a", true, at(3)), None);
        assert_eq!(schedule.start_due(at(3), [("a", 2)], ready), ["a"]);
        // Only once: the sync after it is due a period later again.
        assert_eq!(schedule.finished("a", true, at(4)), None);
        assert_eq!(schedule.next_wake(at(4)), at(4) + PERIOD);
        // Asked for when no sync runs: due at once.
        schedule.again("a", at(5));
        assert_eq!(schedule.start_due(at(5), [("a", 2)], ready), ["a"]);
        // A sync that ends waiting for controllers, or following them, is also followed at once.
        schedule.again("a", at(6));
        schedule.waiting("a", at(7));
        assert_eq!(schedule.start_due(at(7), [("a", 2)], ready), ["a"]);
        schedule.again("a", at(8));
        schedule.following("a", at(9));
        assert_eq!(schedule.start_due(at(9), [("a", 2)], ready), ["a"]);
    }

    #[test]
    fn waits_for_the_webhook_configuration() {
        let mut schedule = SyncSchedule::new(PERIOD);
        let missing = |_: &str| false;
        assert!(schedule.start_due(at(0), [("a", 1)], missing).is_empty());
        assert_eq!(schedule.next_wake(at(0)), at(0) + WEBHOOK_WAIT);
        assert!(schedule.start_due(at(1), [("a", 1)], missing).is_empty());
        assert_eq!(schedule.next_wake(at(1)), at(1) + WEBHOOK_WAIT);
        assert_eq!(schedule.start_due(at(2), [("a", 1)], ready), ["a"]);
    }

    #[test]
    fn rings_are_independent_and_forgotten_when_gone() {
        let mut schedule = SyncSchedule::new(PERIOD);
        let mut started = schedule.start_due(at(0), [("a", 1), ("b", 2)], ready);
        started.sort();
        assert_eq!(started, ["a", "b"]);
        schedule.finished("a", true, at(1));
        // `b` is deleted while it syncs, then recreated: no second sync until the first ended.
        assert!(schedule.start_due(at(2), [("a", 1)], ready).is_empty());
        assert!(
            schedule
                .start_due(at(3), [("a", 1), ("b", 5)], ready)
                .is_empty()
        );
        assert_eq!(schedule.next_wake(at(3)), at(301));
        assert_eq!(schedule.finished("b", true, at(4)), None);
        assert_eq!(schedule.next_wake(at(4)), at(301));
        // That sync was of the old ring: the new one syncs now.
        assert_eq!(
            schedule.start_due(at(4), [("a", 1), ("b", 5)], ready),
            ["b"]
        );
        // A ring that is gone is forgotten; finishing its sync changes nothing.
        schedule.start_due(at(400), [("a", 1)], ready);
        assert_eq!(schedule.finished("b", false, at(401)), None);
        assert_eq!(schedule.finished("unknown", true, at(401)), None);
    }

    #[test]
    fn a_sync_on_an_outdated_view_is_superseded_and_restarts_at_once() {
        let mut schedule = SyncSchedule::new(PERIOD);
        assert_eq!(
            schedule.start_due(at(0), [("r", 1), ("s", 1)], ready),
            ["r", "s"]
        );
        // Nothing changed: nothing to stop.
        assert!(schedule.superseded([("r", 1), ("s", 1)]).is_empty());
        // r's view changed and s is gone while both sync.
        assert_eq!(schedule.superseded([("r", 2)]), ["r", "s"]);
        schedule.abandoned("r", at(3));
        schedule.abandoned("s", at(3));
        // r starts over right away with the new revision, and without a failure's backoff.
        assert_eq!(schedule.start_due(at(3), [("r", 2)], ready), ["r"]);
        assert!(schedule.superseded([("r", 2)]).is_empty());
        assert_eq!(schedule.finished("r", true, at(4)), None);
        assert_eq!(schedule.next_wake(at(4)), at(4) + PERIOD);
    }

    #[test]
    fn a_sync_whose_children_follow_their_controllers_is_due_again_when_the_following_ends() {
        let mut schedule = SyncSchedule::new(PERIOD);
        let at = |s: u64| Duration::from_secs(s);
        assert_eq!(schedule.start_due(at(0), [("a", 1)], |_| true), ["a"]);
        assert_eq!(schedule.following("a", at(1)), Some(PERIOD));
        assert_eq!(schedule.next_wake(at(1)), at(1) + PERIOD);
        // Every child moved: one more sync at once picks up children created meanwhile.
        schedule.followed("a", true, at(3));
        assert_eq!(schedule.start_due(at(3), [("a", 1)], |_| true), ["a"]);
        assert_eq!(schedule.following("a", at(4)), Some(PERIOD));
        // A failed move brings the next sync forward to the first backoff.
        schedule.followed("a", false, at(10));
        assert!(schedule.start_due(at(14), [("a", 1)], |_| true).is_empty());
        assert_eq!(schedule.start_due(at(15), [("a", 1)], |_| true), ["a"]);
        // While a sync runs, the report of an older task changes nothing.
        schedule.followed("a", true, at(16));
        assert!(schedule.finished("a", true, at(17)).is_none());
        assert_eq!(schedule.next_wake(at(17)), at(17) + PERIOD);
    }
}
