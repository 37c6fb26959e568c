//! Invariant 1, exclusive ownership, checked from evidence: the shards' own log records, the
//! holder changes of their Leases as the tool's watch saw them, and the signals the tool sent.
//!
//! Three rules:
//!
//! 1. **Handover.** For every object, when shard B reconciles it after shard A did, A must have
//!    let go in between: acknowledged a drain of that object, released or lost its Lease (by its
//!    own log, or as the tool saw the Lease change holder), or stopped (killed by the tool, or
//!    exited). "In between" means after A's last reconcile of the object and no later than B's
//!    reconcile plus [`LOG_SLACK`]. A drain acknowledgement counts from its record or from when
//!    the tool's watch saw the version it wrote, whichever is earlier (see `versions`). A drain
//!    the API server's history shows completed (the object, carrying A's label and the drain
//!    label, next seen without A's label) counts without a record only if the tool stopped A
//!    (SIGSTOP or SIGKILL) within [`LOG_SLACK`] of it: the one way an acknowledgement is written
//!    but never logged.
//! 2. **Nothing after the end.** A process logs no reconcile after it said its Lease was lost or
//!    released.
//! 3. **Nothing after a takeover.** A process logs no reconcile more than [`LOG_SLACK`] after the
//!    tool saw its Lease taken over by someone else (a later `leaseTransitions` than the process
//!    acquired, another holder): the sharder declares a shard dead only when it cannot have
//!    renewed, and the shard must have stopped by then.
//!
//! Why a slack: a record is written after the fact it reports (the drain acknowledgement after
//! the patch's response, a release after the write), and the tool's watch sees a Lease change
//! after it was written, while the next shard may start within milliseconds of the write. The
//! slack only forgives that ordering of log lines; it never lets a process's own reconcile come
//! after its own end, which rule 2 compares within one log, free of clocks.
//!
//! A zero-write ring (`spec.assignment: ServerSide`) has no labels and no drains to read: its
//! objects move by hash ranges, and a shard lets an object go by the revoke the shard library
//! acknowledges. [`check_zero_write`] applies rules 2 and 3 as above and, instead of rule 1,
//! compares the shards' holdings: a process (one term of it) holds an object from its first
//! record of work on it (a reconcile's start or end) to its last such record before it logged
//! letting it go (`released`, `deleted`), or to its last one if it never did (it was stopped,
//! lost its Lease, or still holds it). Two processes may never hold one object at overlapping
//! times: the library cancels and waits for reconciles of revoked objects before it
//! acknowledges, and the sharder grants a range only after the acknowledgement or once the old
//! holder can no longer run. The `released` record only ends a holding, never dates it: the
//! example logs it from its departures stream, which may run after the acknowledgement.
//!
//! Drain acknowledgements logged after the process's own end are counted, not reported as
//! violations: an acknowledgement only gives the object up, conditioned on the version it read,
//! so it cannot make two shards own one object, and its record trails the write (a shard paused
//! between the two logs it only after it resumed and found its Lease gone).

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::evidence::{LeaseEnd, Mark, RunLog};
use crate::findings::{ShardCounts, Violation};
use crate::leases::HolderChange;

/// How much later than a reconcile of the next shard the evidence of the previous shard's
/// letting go may be written.
pub(crate) const LOG_SLACK: SignedDuration = SignedDuration::from_secs(2);

/// One shard process and the evidence about it.
#[derive(Debug)]
pub(crate) struct ShardRun {
    pub(crate) shard: String,
    pub(crate) pid: Option<u32>,
    pub(crate) log: RunLog,
    /// Signals the tool sent, with when.
    pub(crate) signals: Vec<(Timestamp, &'static str)>,
    /// When the supervisor saw it gone.
    pub(crate) exited: Option<Timestamp>,
}

impl ShardRun {
    fn describe(&self) -> String {
        match self.pid {
            Some(pid) => format!("{} (pid {pid})", self.shard),
            None => self.shard.clone(),
        }
    }
}

/// The API server's history of the objects, as the tool saw it.
pub(crate) trait History {
    /// When the first version of `object` after `version` was seen.
    fn first_after(&self, object: &str, version: u64) -> Option<Timestamp>;
    /// When `object` was seen leaving `shard` right after a version carrying `shard`'s label and
    /// the drain label (a completed drain).
    fn drained_away(&self, object: &str, shard: &str) -> Vec<Timestamp>;
}

/// What the check found.
#[derive(Debug, Default)]
pub(crate) struct Ownership {
    pub(crate) violations: Vec<Violation>,
    pub(crate) counts: BTreeMap<String, ShardCounts>,
    /// Drain acknowledgements logged after the process said its Lease was lost or released.
    pub(crate) drains_logged_after_end: usize,
    /// Drain acknowledgements the tool saw take effect more than [`LOG_SLACK`] before their
    /// record (the shard was paused in between, say).
    pub(crate) drains_dated_by_watch: usize,
    /// Handovers evidenced only by a drain the API server's history shows completed just as the
    /// tool stopped the shard, which never logged it.
    pub(crate) drains_never_logged: usize,
}

/// Applies the three rules.
pub(crate) fn check(
    runs: &[ShardRun],
    changes: &[HolderChange],
    history: &dyn History,
) -> Ownership {
    let mut found = Ownership::default();
    for run in runs {
        let c = found.counts.entry(run.shard.clone()).or_default();
        c.processes += 1;
        c.reconciles += run.log.reconciles.len();
        c.drains += run.log.drains.len();
        found.violations.extend(after_end(run));
        found.violations.extend(after_takeover(run, changes));
        if let Some((end, _)) = run.log.lease_end {
            found.drains_logged_after_end +=
                run.log.drains.iter().filter(|(at, ..)| *at > end).count();
        }
    }
    handovers(runs, changes, history, &mut found);
    found
}

/// The zero-write ring's rules: 2 and 3, and no object held by two processes at once (see
/// the module docs).
pub(crate) fn check_zero_write(runs: &[ShardRun], changes: &[HolderChange]) -> Ownership {
    let mut found = Ownership::default();
    for run in runs {
        let c = found.counts.entry(run.shard.clone()).or_default();
        c.processes += 1;
        c.reconciles += run.log.reconciles.len();
        found.violations.extend(after_end(run));
        found.violations.extend(after_takeover(run, changes));
    }
    found.violations.extend(double_holdings(runs));
    found
}

/// The holdings of each object per run: `(object, run index, first, last)`.
fn holdings(runs: &[ShardRun]) -> BTreeMap<&str, Vec<(usize, Timestamp, Timestamp)>> {
    let mut held: BTreeMap<&str, Vec<(usize, Timestamp, Timestamp)>> = BTreeMap::new();
    for (index, run) in runs.iter().enumerate() {
        let mut marks: Vec<&(Timestamp, String, Mark)> = run.log.marks.iter().collect();
        marks.sort_by_key(|(at, ..)| *at);
        let mut open: BTreeMap<&str, (Timestamp, Timestamp)> = BTreeMap::new();
        for (at, object, mark) in marks {
            match mark {
                Mark::LetGo => {
                    if let Some((first, last)) = open.remove(object.as_str()) {
                        held.entry(object).or_default().push((index, first, last));
                    }
                }
                Mark::Work => {
                    let (_, last) = open.entry(object).or_insert((*at, *at));
                    *last = *at;
                }
            }
        }
        for (object, (first, last)) in open {
            held.entry(object).or_default().push((index, first, last));
        }
    }
    held
}

/// Every pair of processes that held one object at overlapping times.
fn double_holdings(runs: &[ShardRun]) -> Vec<Violation> {
    let mut found = Vec::new();
    for (object, held) in holdings(runs) {
        for (i, (a, a_first, a_last)) in held.iter().enumerate() {
            for (b, b_first, b_last) in &held[i + 1..] {
                if a != b && a_first <= b_last && b_first <= a_last {
                    found.push(Violation {
                        invariant: "exclusive-ownership",
                        detail: format!(
                            "{object} was held by {} from {a_first} to {a_last} and by {} from \
                             {b_first} to {b_last}",
                            runs[*a].describe(),
                            runs[*b].describe()
                        ),
                    });
                }
            }
        }
    }
    found
}

/// Rule 2.
fn after_end(run: &ShardRun) -> Vec<Violation> {
    let Some((end, how)) = run.log.lease_end else {
        return Vec::new();
    };
    let how = match how {
        LeaseEnd::Lost => "lost",
        LeaseEnd::Released => "released",
    };
    run.log
        .reconciles
        .iter()
        .filter(|(at, _)| *at > end)
        .map(|(at, object)| Violation {
            invariant: "exclusive-ownership",
            detail: format!(
                "{} reconciled {object} at {at} after its Lease was {how} at {end}",
                run.describe()
            ),
        })
        .collect()
}

/// Rule 3.
fn after_takeover(run: &ShardRun, changes: &[HolderChange]) -> Vec<Violation> {
    let Some((acquired_at, transitions)) = run.log.acquired else {
        return Vec::new();
    };
    let taken = changes.iter().find(|c| {
        c.shard == run.shard
            && c.observed >= acquired_at
            && i64::from(c.transitions) > transitions
            && c.holder
                .as_deref()
                .is_some_and(|h| !h.is_empty() && h != run.shard)
    });
    let Some(taken) = taken else {
        return Vec::new();
    };
    let limit = taken.observed + LOG_SLACK;
    run.log
        .reconciles
        .iter()
        .filter(|(at, _)| *at > limit)
        .map(|(at, object)| Violation {
            invariant: "exclusive-ownership",
            detail: format!(
                "{} reconciled {object} at {at}, after its Lease was taken over by {} (seen at {})",
                run.describe(),
                taken.holder.as_deref().unwrap_or_default(),
                taken.observed
            ),
        })
        .collect()
}

/// Rule 1.
fn handovers(
    runs: &[ShardRun],
    changes: &[HolderChange],
    history: &dyn History,
    found: &mut Ownership,
) {
    // When the tool stopped each shard name's processes (SIGSTOP, SIGKILL).
    let mut stopped: HashMap<&str, Vec<Timestamp>> = HashMap::new();
    // Moments each shard name let go of everything: its processes' Lease ends, exits and kills,
    // and Lease holder changes away from it.
    let mut let_go: HashMap<&str, Vec<Timestamp>> = HashMap::new();
    // Drain acknowledgements per shard and object.
    let mut drained: HashMap<(&str, &str), Vec<Timestamp>> = HashMap::new();
    // Every reconcile per object: (time, shard).
    let mut reconciles: BTreeMap<&str, Vec<(Timestamp, &str)>> = BTreeMap::new();
    for run in runs {
        let shard = run.shard.as_str();
        let points = let_go.entry(shard).or_default();
        points.extend(run.log.lease_end.map(|(at, _)| at));
        points.extend(run.exited);
        points.extend(
            run.signals
                .iter()
                .filter(|(_, s)| *s == "KILL")
                .map(|(at, _)| *at),
        );
        stopped.entry(shard).or_default().extend(
            run.signals
                .iter()
                .filter(|(_, s)| matches!(*s, "STOP" | "KILL"))
                .map(|(at, _)| *at),
        );
        for (logged, object, version) in &run.log.drains {
            let seen = version.and_then(|v| history.first_after(object, v));
            let at = match seen {
                Some(seen) if seen < *logged => {
                    if seen + LOG_SLACK < *logged {
                        found.drains_dated_by_watch += 1;
                    }
                    seen
                }
                _ => *logged,
            };
            drained.entry((shard, object)).or_default().push(at);
        }
        for (at, object) in &run.log.reconciles {
            reconciles.entry(object).or_default().push((*at, shard));
        }
    }
    for change in changes {
        if change.holder.as_deref() != Some(change.shard.as_str()) {
            let_go
                .entry(change.shard.as_str())
                .or_default()
                .push(change.observed);
        }
    }

    for (object, mut events) in reconciles {
        events.sort();
        let mut owner: Option<(&str, Timestamp)> = None;
        for (at, shard) in events {
            if let Some((previous, last)) = owner
                && previous != shard
            {
                let covers = |points: Option<&Vec<Timestamp>>| {
                    points
                        .into_iter()
                        .flatten()
                        .any(|p| *p > last && *p <= at + LOG_SLACK)
                };
                let never_logged = || {
                    let completed = history.drained_away(object, previous);
                    completed.iter().any(|done| {
                        *done > last
                            && *done <= at + LOG_SLACK
                            && stopped.get(previous).into_iter().flatten().any(|stop| {
                                *stop >= *done - LOG_SLACK && *stop <= *done + LOG_SLACK
                            })
                    })
                };
                if covers(let_go.get(previous)) || covers(drained.get(&(previous, object))) {
                } else if never_logged() {
                    found.drains_never_logged += 1;
                } else {
                    found.violations.push(Violation {
                        invariant: "exclusive-ownership",
                        detail: format!(
                            "{object}: {shard} reconciled it at {at} while {previous}, which \
                             reconciled it last at {last}, had not let go (no drain \
                             acknowledgement, Lease release or loss, or exit in between)"
                        ),
                    });
                }
            }
            owner = Some((shard, at));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A history of made-up sightings.
    #[derive(Default)]
    struct Seen {
        /// `(object, version)` → when the next version was seen.
        next: Vec<((&'static str, u64), Timestamp)>,
        /// `(object, shard)` → when a completed drain away from `shard` was seen.
        drained: Vec<((&'static str, &'static str), Timestamp)>,
    }

    impl History for Seen {
        fn first_after(&self, object: &str, version: u64) -> Option<Timestamp> {
            self.next
                .iter()
                .find(|((o, v), _)| *o == object && *v == version)
                .map(|(_, at)| *at)
        }
        fn drained_away(&self, object: &str, shard: &str) -> Vec<Timestamp> {
            self.drained
                .iter()
                .filter(|((o, s), _)| *o == object && *s == shard)
                .map(|(_, at)| *at)
                .collect()
        }
    }

    /// A watch that saw nothing.
    const NO_WATCH: Seen = Seen {
        next: Vec::new(),
        drained: Vec::new(),
    };

    fn check_without_watch(runs: &[ShardRun], changes: &[HolderChange]) -> Vec<Violation> {
        check(runs, changes, &NO_WATCH).violations
    }

    fn t(seconds: i64) -> Timestamp {
        Timestamp::UNIX_EPOCH + SignedDuration::from_secs(1_000_000 + seconds)
    }

    fn run(shard: &str, reconciles: &[(i64, &str)]) -> ShardRun {
        ShardRun {
            shard: shard.into(),
            pid: None,
            log: RunLog {
                reconciles: reconciles
                    .iter()
                    .map(|(at, o)| (t(*at), o.to_string()))
                    .collect(),
                acquired: Some((t(0), 1)),
                ..Default::default()
            },
            signals: Vec::new(),
            exited: None,
        }
    }

    #[test]
    fn a_drain_acknowledgement_hands_the_object_over() {
        let mut a = run("a", &[(10, "ns/x")]);
        a.log.drains.push((t(20), "ns/x".into(), Some(7)));
        let b = run("b", &[(21, "ns/x")]);
        let found = check(&[a, b], &[], &NO_WATCH);
        let (violations, counts) = (found.violations, found.counts);
        assert!(violations.is_empty(), "{violations:?}");
        assert_eq!(counts["a"].drains, 1);
        assert_eq!(counts["b"].reconciles, 1);
    }

    #[test]
    fn a_drain_of_another_object_does_not() {
        let mut a = run("a", &[(10, "ns/x")]);
        a.log.drains.push((t(20), "ns/y".into(), Some(7)));
        let b = run("b", &[(21, "ns/x")]);
        let violations = check(&[a, b], &[], &NO_WATCH).violations;
        assert_eq!(violations.len(), 1);
        assert!(
            violations[0].detail.contains("ns/x: b reconciled"),
            "{violations:?}"
        );
    }

    #[test]
    fn two_shards_reconciling_back_and_forth_are_both_reported() {
        let a = run("a", &[(10, "ns/x"), (30, "ns/x")]);
        let b = run("b", &[(20, "ns/x")]);
        let violations = check(&[a, b], &[], &NO_WATCH).violations;
        assert_eq!(violations.len(), 2, "{violations:?}");
    }

    #[test]
    fn a_kill_exit_or_lease_change_lets_go_of_everything() {
        let mut killed = run("a", &[(10, "ns/x")]);
        killed.signals.push((t(15), "KILL"));
        let v = check_without_watch(&[killed, run("b", &[(40, "ns/x")])], &[]);
        assert!(v.is_empty(), "{v:?}");

        let mut exited = run("a", &[(10, "ns/x")]);
        exited.exited = Some(t(12));
        let v = check_without_watch(&[exited, run("b", &[(40, "ns/x")])], &[]);
        assert!(v.is_empty(), "{v:?}");

        let taken = HolderChange {
            observed: t(35),
            shard: "a".into(),
            holder: Some("shardlease-controller".into()),
            transitions: 2,
        };
        let v = check_without_watch(
            &[run("a", &[(10, "ns/x")]), run("b", &[(40, "ns/x")])],
            &[taken],
        );
        assert!(v.is_empty(), "{v:?}");
    }

    /// A release logged just after the next shard's first reconcile still counts (the log line
    /// trails the write), but not one logged well after it, nor one before the last reconcile.
    #[test]
    fn letting_go_must_fall_between_the_two_reconciles() {
        let released = |at: i64| {
            let mut a = run("a", &[(10, "ns/x")]);
            a.log.lease_end = Some((t(at), LeaseEnd::Released));
            a
        };
        let v = check_without_watch(&[released(41), run("b", &[(40, "ns/x")])], &[]);
        assert!(v.is_empty(), "{v:?}");
        let v = check_without_watch(&[released(45), run("b", &[(40, "ns/x")])], &[]);
        assert_eq!(v.len(), 1, "{v:?}");
        let v = check_without_watch(&[released(5), run("b", &[(40, "ns/x")])], &[]);
        // Released before its reconcile at 10: rule 2 and rule 1 both fire.
        assert_eq!(v.len(), 2, "{v:?}");
    }

    #[test]
    fn reconciling_after_a_takeover_is_reported() {
        let a = run("a", &[(10, "ns/x"), (50, "ns/y")]);
        let taken = HolderChange {
            observed: t(40),
            shard: "a".into(),
            holder: Some("shardlease-controller".into()),
            transitions: 2,
        };
        let v = check_without_watch(&[a], std::slice::from_ref(&taken));
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].detail.contains("ns/y"), "{v:?}");

        // A takeover from before this process acquired the Lease (transitions not past what it
        // acquired) is history, not a loss.
        let mut later = run("a", &[(50, "ns/y")]);
        later.log.acquired = Some((t(0), 2));
        let v = check_without_watch(&[later], &[taken]);
        assert!(v.is_empty(), "{v:?}");
    }

    /// A shard paused between its acknowledgement taking effect (t=19, as the watch saw) and
    /// logging it (t=40, after it resumed and logged the loss of its Lease at t=39): the next
    /// shard's reconcile at t=21 is a proper handover, and the late record is only counted.
    #[test]
    fn a_late_drain_record_is_dated_by_the_watch() {
        let mut a = run("a", &[(10, "ns/x")]);
        a.log.drains.push((t(40), "ns/x".into(), Some(7)));
        a.log.lease_end = Some((t(39), LeaseEnd::Lost));
        let watch = Seen {
            next: vec![(("ns/x", 7), t(19))],
            ..Seen::default()
        };
        let found = check(&[a, run("b", &[(21, "ns/x")])], &[], &watch);
        assert!(found.violations.is_empty(), "{:?}", found.violations);
        assert_eq!(found.drains_dated_by_watch, 1);
        assert_eq!(found.drains_logged_after_end, 1);

        // Without the watch's evidence the late record does not cover the handover.
        let mut a = run("a", &[(10, "ns/x")]);
        a.log.drains.push((t(40), "ns/x".into(), Some(7)));
        assert_eq!(
            check_without_watch(&[a, run("b", &[(21, "ns/x")])], &[]).len(),
            1
        );
    }

    /// A shard stopped just as its acknowledgement was written, which never logged it: the API
    /// server's history shows the drain completed at t=19 and the tool paused the shard at t=19.5.
    /// Without the pause, the same history is no excuse.
    #[test]
    fn a_drain_never_logged_counts_only_when_the_shard_was_stopped_then() {
        let history = Seen {
            drained: vec![(("ns/x", "a"), t(19))],
            ..Seen::default()
        };
        let mut paused = run("a", &[(10, "ns/x")]);
        paused
            .signals
            .push((t(19) + SignedDuration::from_millis(500), "STOP"));
        let found = check(&[paused, run("b", &[(21, "ns/x")])], &[], &history);
        assert!(found.violations.is_empty(), "{:?}", found.violations);
        assert_eq!(found.drains_never_logged, 1);

        let found = check(
            &[run("a", &[(10, "ns/x")]), run("b", &[(21, "ns/x")])],
            &[],
            &history,
        );
        assert_eq!(found.violations.len(), 1, "{:?}", found.violations);

        let mut paused_later = run("a", &[(10, "ns/x")]);
        paused_later.signals.push((t(25), "STOP"));
        let found = check(&[paused_later, run("b", &[(21, "ns/x")])], &[], &history);
        assert_eq!(found.violations.len(), 1, "{:?}", found.violations);
    }

    #[test]
    fn the_same_shard_reconciling_again_needs_no_handover() {
        let v = check_without_watch(&[run("a", &[(10, "ns/x"), (20, "ns/x")])], &[]);
        assert!(v.is_empty(), "{v:?}");
    }

    fn marked(shard: &str, marks: &[(i64, &str, Mark)]) -> ShardRun {
        let mut run = run(shard, &[]);
        run.log.marks = marks
            .iter()
            .map(|(at, o, m)| (t(*at), o.to_string(), *m))
            .collect();
        run
    }

    /// A zero-write handover: the old holder's work ends before its release, the new holder's
    /// starts after; the same handover with the old holder still working (a reconcile the
    /// revoke did not cancel) is reported, and so is a new holder starting early.
    #[test]
    fn zero_write_holdings_may_not_overlap() {
        use Mark::{LetGo, Work};
        let a = marked(
            "a",
            &[(10, "ns/x", Work), (11, "ns/x", Work), (14, "ns/x", LetGo)],
        );
        let b = marked("b", &[(12, "ns/x", Work), (13, "ns/x", Work)]);
        assert!(check_zero_write(&[a, b], &[]).violations.is_empty());

        // Back to a after b let go: two holdings of a, neither overlapping b's.
        let a = marked(
            "a",
            &[(10, "ns/x", Work), (11, "ns/x", LetGo), (20, "ns/x", Work)],
        );
        let b = marked("b", &[(12, "ns/x", Work), (13, "ns/x", LetGo)]);
        assert!(check_zero_write(&[a, b], &[]).violations.is_empty());

        // A reconcile of a running on past b's start.
        let a = marked(
            "a",
            &[(10, "ns/x", Work), (15, "ns/x", Work), (16, "ns/x", LetGo)],
        );
        let b = marked("b", &[(12, "ns/x", Work)]);
        let violations = check_zero_write(&[a, b], &[]).violations;
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].detail.starts_with("ns/x was held by a"));

        // Two processes of one shard name are two holders.
        let first = marked("a", &[(10, "ns/x", Work), (15, "ns/x", Work)]);
        let second = marked("a", &[(12, "ns/x", Work)]);
        assert_eq!(check_zero_write(&[first, second], &[]).violations.len(), 1);

        // Other objects do not interfere; reconciles after the Lease's end are still rule 2.
        let mut a = marked("a", &[(10, "ns/x", Work)]);
        a.log.reconciles.push((t(30), "ns/y".into()));
        a.log.lease_end = Some((t(20), LeaseEnd::Lost));
        let b = marked("b", &[(12, "ns/y", Work)]);
        assert_eq!(check_zero_write(&[a, b], &[]).violations.len(), 1);
    }
}
