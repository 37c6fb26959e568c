//! A lock over one `coordination.k8s.io/v1` Lease: acquire, renew in the background, notice loss,
//! release.
//!
//! The same lock serves a shard's membership Lease (name = identity = shard name, ring label) and
//! leader election among replicas (a fixed Lease name, one identity per replica, no labels):
//!
//! ```no_run
//! # async fn leader_only_work(_stop: tokio_util::sync::CancellationToken) {}
//! # async fn example(client: kube::Client) -> Result<(), kube_sharding::lease::Error> {
//! use kube_sharding::lease::{HeldRunEnd, LeaseLock, LeaseLockConfig};
//! use tokio_util::sync::CancellationToken;
//!
//! let shutdown = CancellationToken::new();
//! let config = LeaseLockConfig::new("sharding-system", "sharder", "sharder-7d9f-abcde");
//! let lock = LeaseLock::new(client, config)?;
//! loop {
//!     // Resolves once this replica is the leader.
//!     let held = lock.acquire().await;
//!     // Leader-only work runs here; it is dropped at once when leadership is lost, or stopped
//!     // on shutdown, after which leadership is handed over at once.
//!     match held.run_while_held(&shutdown, leader_only_work).await? {
//!         HeldRunEnd::LeaseLost => continue,
//!         HeldRunEnd::WorkEnded { .. } => return Ok(()),
//!     }
//! }
//! # }
//! ```
//!
//! Every write is a compare-and-swap on the Lease's `resourceVersion`: creating fails when someone
//! created the Lease first, and updates fail when someone wrote in between. A failed write never
//! counts as holding the Lease.
//!
//! # Log records
//!
//! The lock logs (through `tracing`) one record when it acquires the Lease, one when it loses it
//! and one when it releases it, each with these fields, so that tools reading the logs need not
//! match message text:
//!
//! | `event` | level | further fields |
//! |---|---|---|
//! | `lease_acquired` | info | `identity`, `transitions` (`spec.leaseTransitions`) |
//! | `lease_lost` | warn | `renew_deadline` (missed it) or `holder` (someone else, or `<none>`) |
//! | `lease_released` | info | |
//! | `lease_excluded` | error | `reason` (the exclusion annotation's value, see [`LeaseLockConfig::with_exclusion_annotation`]) |
//!
//! All three carry `lease`, `namespace` and `resource_version`: the Lease's
//! `metadata.resourceVersion` as this lock last wrote it (by the acquiring write; by the last
//! successful renewal before the loss; by the releasing write), to match against a watch of the
//! Lease. The loss is recorded right after [`HeldLease::lost_token`] fired, so anything that
//! checks the token after the record's timestamp sees the loss.

mod annotate;
mod config;
mod decision;
mod guard;
mod held;
mod lock;
mod store;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ranges;

use k8s_openapi::api::coordination::v1::Lease;

pub use self::config::LeaseLockConfig;
pub use self::guard::{GuardEnd, LeaseGuard};
pub(crate) use self::held::RunEnd;

/// Ends `guard` as excluded for `DuplicateName`, as the renewer would (for other modules' tests).
#[cfg(test)]
pub(crate) fn guard_exclude(guard: &LeaseGuard) {
    guard.exclude("DuplicateName".into());
}
pub use self::held::{HeldLease, HeldRunEnd};
pub use self::lock::LeaseLock;
pub use kube_sharding_api::lease::{
    DEFAULT_LEASE_DURATION, DEFAULT_RENEW_DEADLINE, DEFAULT_RETRY_PERIOD, LeaseTiming,
};

/// Errors of the Lease lock.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration cannot work (see [`LeaseLockConfig`] for the rules).
    #[error("failed to validate the lease lock configuration: {0}")]
    InvalidConfig(String),
    /// Reading the Lease failed.
    #[error("failed to get Lease {namespace}/{name}")]
    Get {
        /// Namespace of the Lease.
        namespace: String,
        /// Name of the Lease.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Writing the Lease failed for another reason than a lost race.
    #[error("failed to write Lease {namespace}/{name}")]
    Write {
        /// Namespace of the Lease.
        namespace: String,
        /// Name of the Lease.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// A renewal or release kept losing races against other writers.
    #[error("failed to {action} Lease {namespace}/{name}: it kept changing concurrently")]
    Contended {
        /// What the lock tried (`renew`, `release`).
        action: &'static str,
        /// Namespace of the Lease.
        namespace: String,
        /// Name of the Lease.
        name: String,
    },
}

/// `event` of the record logged when the lock acquires its Lease (see the module docs).
const EVENT_ACQUIRED: &str = "lease_acquired";
/// `event` of the record logged when the Lease is lost, right after the lost token fired.
const EVENT_LOST: &str = "lease_lost";
/// `event` of the record logged (at error level) when the lock finds its Lease excluded from its
/// ring, with the `reason` (see [`LeaseLockConfig::with_exclusion_annotation`]).
const EVENT_EXCLUDED: &str = "lease_excluded";
/// `event` of the record logged when [`HeldLease::release`] emptied the holder.
const EVENT_RELEASED: &str = "lease_released";

/// The Lease's `resourceVersion`, empty if it has none, for log records.
fn resource_version(lease: &Lease) -> &str {
    lease
        .metadata
        .resource_version
        .as_deref()
        .unwrap_or_default()
}

/// The error with its sources joined by `: `, for one-line logs.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
