//! The crash half of invariant 4: every process that ended must have been ended by the tool, or
//! be a shard that stopped because it lost its Lease through something that takes Leases away:
//! it was paused, its Lease was deleted by the tool (`lease-delete`), the API server was
//! restarting, or the API server took no write promptly during
//! the whole renew deadline before the loss (every heartbeat of the tool's was slow or failed
//! then). Stopping at once on losing the Lease is the shard contract (docs/protocol.md §3), not a
//! crash; anything else is.

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::findings::{ExitCounts, Violation};
use crate::fleet::Incarnation;
use crate::stalls::StallLog;

/// One process to judge.
#[derive(Debug)]
pub(crate) struct Ended<'a> {
    /// `shard-3`, `sharder-0`.
    pub(crate) who: String,
    pub(crate) incarnation: &'a Incarnation,
    /// For shards: when its log says it lost the Lease, if it does.
    pub(crate) lost_lease: Option<Timestamp>,
}

/// What explains a shard losing its Lease.
#[derive(Debug)]
pub(crate) struct Outages<'a> {
    /// The API server's restarts, from the stop until it was ready again.
    pub(crate) restarts: &'a [(Timestamp, Timestamp)],
    /// The tool's heartbeats.
    pub(crate) heartbeat: &'a StallLog,
    /// The shards' renew deadline: a shard loses its Lease that long after its last renewal.
    pub(crate) renew_deadline: SignedDuration,
    /// Shard Leases the tool deleted: (shard, when).
    pub(crate) deleted_leases: &'a [(String, Timestamp)],
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

    /// Whether the tool deleted the Lease of `shard` at most the renew deadline and 10 s before
    /// an exit at `at`: the shard finds its Lease gone at its next renewal and stops.
    fn deletion_explains(&self, shard: &str, at: Timestamp) -> bool {
        let grace = self.renew_deadline + SignedDuration::from_secs(10);
        self.deleted_leases
            .iter()
            .any(|(deleted, when)| deleted == shard && at >= *when && at <= *when + grace)
    }

    /// Whether the API server took no write promptly during the renew deadline before a loss
    /// at `lost` (leaving out its last second, in which the shard's last attempt may still have
    /// been on its way).
    fn stall_explains(&self, lost: Timestamp) -> bool {
        let to = lost - SignedDuration::from_secs(1);
        self.heartbeat
            .impaired_throughout(lost - self.renew_deadline, to)
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
        } else if process.lost_lease.is_some() && incarnation.got("STOP") {
            counts.lease_lost_after_pause += 1;
        } else if process.lost_lease.is_some() && outages.deletion_explains(&process.who, exit.at) {
            counts.lease_lost_after_deletion += 1;
        } else if process.lost_lease.is_some() && outages.restart_explains(exit.at) {
            counts.lease_lost_in_apiserver_restart += 1;
        } else if process
            .lost_lease
            .is_some_and(|lost| outages.stall_explains(lost))
        {
            counts.lease_lost_in_api_stall += 1;
        } else {
            counts.unexpected += 1;
            let why = if process.lost_lease.is_some() {
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

    #[test]
    fn a_restart_explains_losses_during_it_and_shortly_after() {
        let restarts = [(t(100), t(110))];
        let heartbeat = StallLog::default();
        let o = Outages {
            restarts: &restarts,
            heartbeat: &heartbeat,
            renew_deadline: SignedDuration::from_secs(6),
            deleted_leases: &[],
        };
        assert!(o.restart_explains(t(105)));
        assert!(o.restart_explains(t(125)));
        assert!(!o.restart_explains(t(127)));
        assert!(!o.restart_explains(t(99)));
        // No heartbeat recorded: no stall to explain anything.
        assert!(!o.stall_explains(t(105)));
    }

    #[test]
    fn a_deleted_lease_explains_its_own_shard_stopping_shortly_after() {
        let deleted = [("shard-1".to_string(), t(100))];
        let heartbeat = StallLog::default();
        let o = Outages {
            restarts: &[],
            heartbeat: &heartbeat,
            renew_deadline: SignedDuration::from_secs(6),
            deleted_leases: &deleted,
        };
        assert!(o.deletion_explains("shard-1", t(101)));
        assert!(o.deletion_explains("shard-1", t(116)));
        assert!(!o.deletion_explains("shard-1", t(117)));
        assert!(!o.deletion_explains("shard-1", t(99)));
        assert!(
            !o.deletion_explains("shard-2", t(101)),
            "another shard's Lease"
        );
    }
}
