//! What the checks find and the report shows: broken invariants ([`Violation`]) and the counts
//! the checks keep. Both sides import these from here, so the report depends on the checks' types
//! without the checks depending on the report.

use serde::Serialize;

/// A broken invariant, with the evidence in words.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Violation {
    /// `exclusive-ownership`, `convergence`, `nothing-lost` or `no-leaks`.
    pub(crate) invariant: &'static str,
    pub(crate) detail: String,
}

/// How the processes that ended, ended.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct ExitCounts {
    /// Ended after the tool sent SIGKILL or SIGTERM.
    pub(crate) signalled: usize,
    /// Shards that exited on losing their Lease after the tool paused them.
    pub(crate) lease_lost_after_pause: usize,
    /// Shards that exited on losing their Lease after the tool deleted it.
    pub(crate) lease_lost_after_deletion: usize,
    /// Shards that exited on losing their Lease while the API server was restarting.
    pub(crate) lease_lost_in_apiserver_restart: usize,
    /// Shards that exited on losing their Lease while the API server took no write promptly (an
    /// overloaded machine, say), as the tool's heartbeat saw.
    pub(crate) lease_lost_in_api_stall: usize,
    /// Ended for no reason the tool gave (each is also a violation).
    pub(crate) unexpected: usize,
    /// Processes that ended with a non-zero status after SIGTERM (not a violation: a graceful
    /// stop may fail to release a Lease while the API server is down, say).
    pub(crate) unclean_after_term: usize,
}

/// Reconcile and drain counts of one shard name, over all its processes.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct ShardCounts {
    pub(crate) processes: usize,
    pub(crate) reconciles: usize,
    pub(crate) drains: usize,
}
