//! The crash half of invariant 4: every process that ended must have been ended by the tool, or
//! be a shard that stopped because it lost its Lease through something that takes Leases away:
//! it was paused, the API server was restarting, or the API server took no writes for a while
//! (the tool's own heartbeat stalled too). Stopping at once on losing the Lease is the shard
//! contract (SPEC §3), not a crash; anything else is.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde::Serialize;

use crate::fleet::Incarnation;
use crate::report::Violation;

/// How the processes that ended, ended.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct ExitCounts {
    /// Ended after the tool sent SIGKILL or SIGTERM.
    pub(crate) signalled: usize,
    /// Shards that exited on losing their Lease after the tool paused them.
    pub(crate) lease_lost_after_pause: usize,
    /// Shards that exited on losing their Lease while the API server was restarting.
    pub(crate) lease_lost_in_apiserver_restart: usize,
    /// Shards that exited on losing their Lease while the tool's own heartbeat stalled too (the
    /// API server did not take writes for a while: an overloaded machine, say).
    pub(crate) lease_lost_in_api_stall: usize,
    /// Ended for no reason the tool gave (each is also a violation).
    pub(crate) unexpected: usize,
    /// Processes that ended with a non-zero status after SIGTERM (not a violation: a graceful
    /// stop may fail to release a Lease while the API server is down, say).
    pub(crate) unclean_after_term: usize,
}

/// One process to judge.
#[derive(Debug)]
pub(crate) struct Ended<'a> {
    /// `shard-3`, `sharder-0`.
    pub(crate) who: String,
    pub(crate) incarnation: &'a Incarnation,
    /// For shards: whether its log says it lost the Lease.
    pub(crate) lost_lease: bool,
}

/// What explains a shard losing its Lease.
#[derive(Debug)]
pub(crate) struct Outages<'a> {
    /// The API server's restarts, from the stop until it was ready again.
    pub(crate) restarts: &'a [(Timestamp, Timestamp)],
    /// Stalls of the tool's heartbeat writes.
    pub(crate) stalls: &'a [(Timestamp, Timestamp)],
    /// The shards' renew deadline: a shard loses its Lease that long after its last renewal.
    pub(crate) renew_deadline: SignedDuration,
}

impl Outages<'_> {
    /// Whether an exit at `at` on losing the Lease falls in a restart (or within the renew
    /// deadline and 10 s after it).
    fn restart_explains(&self, at: Timestamp) -> bool {
        let grace = self.renew_deadline + SignedDuration::from_secs(10);
        self.restarts
            .iter()
            .any(|(from, to)| at >= *from && at <= *to + grace)
    }

    /// Whether a heartbeat stall of at least half the renew deadline overlaps the renew deadline
    /// before an exit at `at` (and the 10 s it may take to notice and exit).
    fn stall_explains(&self, at: Timestamp) -> bool {
        let window = at - self.renew_deadline - SignedDuration::from_secs(10);
        self.stalls.iter().any(|(from, to)| {
            to.duration_since(*from) >= self.renew_deadline / 2 && *to >= window && *from <= at
        })
    }
}

/// Classifies every ended process.
pub(crate) fn classify(
    processes: &[Ended<'_>],
    outages: &Outages<'_>,
) -> (ExitCounts, Vec<Violation>) {
    let mut counts = ExitCounts::default();
    let mut violations = Vec::new();
    for process in processes {
        let incarnation = process.incarnation;
        let Some(exit) = &incarnation.exit else {
            continue;
        };
        if incarnation.got("TERM") && !exit.success && !incarnation.got("KILL") {
            counts.unclean_after_term += 1;
        }
        if incarnation.got("KILL") || incarnation.got("TERM") {
            counts.signalled += 1;
        } else if process.lost_lease && incarnation.got("STOP") {
            counts.lease_lost_after_pause += 1;
        } else if process.lost_lease && outages.restart_explains(exit.at) {
            counts.lease_lost_in_apiserver_restart += 1;
        } else if process.lost_lease && outages.stall_explains(exit.at) {
            counts.lease_lost_in_api_stall += 1;
        } else {
            counts.unexpected += 1;
            let why = if process.lost_lease {
                "lost its Lease without a fault that explains it"
            } else {
                "exited on its own"
            };
            violations.push(Violation {
                invariant: "no-leaks",
                detail: format!(
                    "{} (pid {}) {why}: {} at {}; log {}",
                    process.who,
                    incarnation.pid.unwrap_or_default(),
                    exit.status,
                    exit.at,
                    incarnation.log_path().display()
                ),
            });
        }
    }
    (counts, violations)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(seconds: i64) -> Timestamp {
        Timestamp::UNIX_EPOCH + SignedDuration::from_secs(1_000_000 + seconds)
    }

    fn outages<'a>(
        restarts: &'a [(Timestamp, Timestamp)],
        stalls: &'a [(Timestamp, Timestamp)],
    ) -> Outages<'a> {
        Outages {
            restarts,
            stalls,
            renew_deadline: SignedDuration::from_secs(6),
        }
    }

    #[test]
    fn a_restart_explains_losses_during_it_and_shortly_after() {
        let restarts = [(t(100), t(110))];
        let o = outages(&restarts, &[]);
        assert!(o.restart_explains(t(105)));
        assert!(o.restart_explains(t(125)));
        assert!(!o.restart_explains(t(127)));
        assert!(!o.restart_explains(t(99)));
    }

    /// A stall explains a loss only when it is long enough to cost a renewal and lies in the
    /// renew deadline before the exit.
    #[test]
    fn only_a_long_stall_before_the_exit_explains_a_loss() {
        let long = [(t(100), t(104))];
        assert!(outages(&[], &long).stall_explains(t(105)));
        assert!(outages(&[], &long).stall_explains(t(119)));
        assert!(!outages(&[], &long).stall_explains(t(121)));
        assert!(!outages(&[], &long).stall_explains(t(99)));
        let short = [(t(100), t(102))];
        assert!(!outages(&[], &short).stall_explains(t(105)));
    }
}
