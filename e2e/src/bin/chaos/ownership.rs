//! Invariant 1, exclusive ownership, checked from evidence: the shards' own log records, the
//! holder changes of their Leases as the tool's watch saw them, and the signals the tool sent.
//!
//! Three rules:
//!
//! 1. **Handover.** For every object, when shard B reconciles it after shard A did, A must have
//!    let go in between: acknowledged a drain of that object, released or lost its Lease (by its
//!    own log, or as the tool saw the Lease change holder), or stopped (killed by the tool, or
//!    exited). "In between" means after A's last reconcile of the object and no later than B's
//!    reconcile plus [`LOG_SLACK`].
//! 2. **Nothing after the end.** A process logs no reconcile or drain after it said its Lease
//!    was lost or released.
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

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::evidence::{LeaseEnd, RunLog};
use crate::leases::HolderChange;
use crate::report::Violation;

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

/// Reconcile and drain counts of one shard name, over all its processes.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub(crate) struct ShardCounts {
    pub(crate) processes: usize,
    pub(crate) reconciles: usize,
    pub(crate) drains: usize,
}

/// Applies the three rules; returns the violations and the per-shard counts.
pub(crate) fn check(
    runs: &[ShardRun],
    changes: &[HolderChange],
) -> (Vec<Violation>, BTreeMap<String, ShardCounts>) {
    let mut violations = Vec::new();
    let mut counts: BTreeMap<String, ShardCounts> = BTreeMap::new();
    for run in runs {
        let c = counts.entry(run.shard.clone()).or_default();
        c.processes += 1;
        c.reconciles += run.log.reconciles.len();
        c.drains += run.log.drains.len();
        violations.extend(after_end(run));
        violations.extend(after_takeover(run, changes));
    }
    violations.extend(handovers(runs, changes));
    (violations, counts)
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
    let reconciles = run.log.reconciles.iter().map(|r| ("reconciled", r));
    let drains = run
        .log
        .drains
        .iter()
        .map(|d| ("acknowledged a drain of", d));
    reconciles
        .chain(drains)
        .filter(|(_, (at, _))| *at > end)
        .map(|(what, (at, object))| Violation {
            invariant: "exclusive-ownership",
            detail: format!(
                "{} {what} {object} at {at} after its Lease was {how} at {end}",
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
fn handovers(runs: &[ShardRun], changes: &[HolderChange]) -> Vec<Violation> {
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
        for (at, object) in &run.log.drains {
            drained.entry((shard, object)).or_default().push(*at);
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

    let mut violations = Vec::new();
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
                if !covers(let_go.get(previous)) && !covers(drained.get(&(previous, object))) {
                    violations.push(Violation {
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
    violations
}

#[cfg(test)]
mod tests {
    use super::*;

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
        a.log.drains.push((t(20), "ns/x".into()));
        let b = run("b", &[(21, "ns/x")]);
        let (violations, counts) = check(&[a, b], &[]);
        assert!(violations.is_empty(), "{violations:?}");
        assert_eq!(counts["a"].drains, 1);
        assert_eq!(counts["b"].reconciles, 1);
    }

    #[test]
    fn a_drain_of_another_object_does_not() {
        let mut a = run("a", &[(10, "ns/x")]);
        a.log.drains.push((t(20), "ns/y".into()));
        let b = run("b", &[(21, "ns/x")]);
        let (violations, _) = check(&[a, b], &[]);
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
        let (violations, _) = check(&[a, b], &[]);
        assert_eq!(violations.len(), 2, "{violations:?}");
    }

    #[test]
    fn a_kill_exit_or_lease_change_lets_go_of_everything() {
        let mut killed = run("a", &[(10, "ns/x")]);
        killed.signals.push((t(15), "KILL"));
        let (v, _) = check(&[killed, run("b", &[(40, "ns/x")])], &[]);
        assert!(v.is_empty(), "{v:?}");

        let mut exited = run("a", &[(10, "ns/x")]);
        exited.exited = Some(t(12));
        let (v, _) = check(&[exited, run("b", &[(40, "ns/x")])], &[]);
        assert!(v.is_empty(), "{v:?}");

        let taken = HolderChange {
            observed: t(35),
            shard: "a".into(),
            holder: Some("shardlease-controller".into()),
            transitions: 2,
        };
        let (v, _) = check(
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
        let (v, _) = check(&[released(41), run("b", &[(40, "ns/x")])], &[]);
        assert!(v.is_empty(), "{v:?}");
        let (v, _) = check(&[released(45), run("b", &[(40, "ns/x")])], &[]);
        assert_eq!(v.len(), 1, "{v:?}");
        let (v, _) = check(&[released(5), run("b", &[(40, "ns/x")])], &[]);
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
        let (v, _) = check(&[a], std::slice::from_ref(&taken));
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].detail.contains("ns/y"), "{v:?}");

        // A takeover from before this process acquired the Lease (transitions not past what it
        // acquired) is history, not a loss.
        let mut later = run("a", &[(50, "ns/y")]);
        later.log.acquired = Some((t(0), 2));
        let (v, _) = check(&[later], &[taken]);
        assert!(v.is_empty(), "{v:?}");
    }

    #[test]
    fn the_same_shard_reconciling_again_needs_no_handover() {
        let (v, _) = check(&[run("a", &[(10, "ns/x"), (20, "ns/x")])], &[]);
        assert!(v.is_empty(), "{v:?}");
    }
}
