//! The crash half of invariant 4: every process that ended must have been ended by the tool, or
//! be a shard that stopped because it lost its Lease through a fault that takes Leases away (it
//! was paused, or the API server was down longer than its renew deadline). Stopping at once on
//! losing the Lease is the shard contract (SPEC §3), not a crash; anything else is.

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

/// Classifies every ended process; `disruptions` are the API server's outages and
/// `renew_deadline` the shards' (a shard loses its Lease up to that long after an outage began,
/// and notices within a few seconds after).
pub(crate) fn classify(
    processes: &[Ended<'_>],
    disruptions: &[(Timestamp, Timestamp)],
    renew_deadline: SignedDuration,
) -> (ExitCounts, Vec<Violation>) {
    let mut counts = ExitCounts::default();
    let mut violations = Vec::new();
    let grace = renew_deadline + SignedDuration::from_secs(10);
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
        } else if process.lost_lease
            && disruptions
                .iter()
                .any(|(from, to)| exit.at >= *from && exit.at <= *to + grace)
        {
            counts.lease_lost_in_apiserver_restart += 1;
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
