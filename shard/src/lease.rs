//! A lock over one `coordination.k8s.io/v1` Lease: acquire, renew in the background, notice loss,
//! release.
//!
//! The lock logs a record when it acquires, loses and releases its Lease; their `event` values
//! and fields are listed in [`crate::records`].

mod annotate;
mod config;
mod decision;
mod guard;
mod held;
mod lock;
mod store;
#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;

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
use kube_sharding_api::lease::LeaseTiming;

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

/// The Lease's `resourceVersion`, empty if it has none, for log records.
fn resource_version(lease: &Lease) -> &str {
    lease
        .metadata
        .resource_version
        .as_deref()
        .unwrap_or_default()
}
