//! [`Ownership`]: what a reconcile checks before it writes, so that a reconcile that started
//! while the object was this shard's does not write after the object left or the Lease ended.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::future::BoxFuture;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::Shard;
use crate::lease::{GuardEnd, LeaseGuard};
use crate::shard::Disposition;

/// Reads the object's current metadata from the API server; `None` when it does not exist.
pub(crate) type Fetch =
    Arc<dyn Fn() -> BoxFuture<'static, Result<Option<ObjectMeta>, kube::Error>> + Send + Sync>;

/// Why [`Ownership`] refused a write. Every variant but [`OwnershipError::Read`] means: stop,
/// nothing to retry (the next event about the object starts over).
#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    /// The shard's Lease is lost or its renew deadline passed.
    #[error("failed to confirm ownership of {object}: the shard Lease is lost")]
    LeaseLost {
        /// `namespace/name` (or `name` when cluster-scoped) of the object.
        object: String,
    },
    /// The sharder excluded the shard's Lease from its ring.
    #[error(
        "failed to confirm ownership of {object}: the shard is excluded from its ring ({reason})"
    )]
    Excluded {
        /// `namespace/name` (or `name` when cluster-scoped) of the object.
        object: String,
        /// The exclusion reason the sharder gave.
        reason: String,
    },
    /// The object now carries the drain label: the shard must let go of it, not write.
    #[error("failed to confirm ownership of {object}: it is being drained")]
    Draining {
        /// `namespace/name` (or `name` when cluster-scoped) of the object.
        object: String,
    },
    /// The object's shard label no longer names this shard.
    #[error("failed to confirm ownership of {object}: it is assigned to another shard")]
    Moved {
        /// `namespace/name` (or `name` when cluster-scoped) of the object.
        object: String,
    },
    /// The object is gone (or was replaced by a new object of the same name).
    #[error("failed to confirm ownership of {object}: it was deleted")]
    Deleted {
        /// `namespace/name` (or `name` when cluster-scoped) of the object.
        object: String,
    },
    /// Reading the object failed; retrying may succeed.
    #[error("failed to confirm ownership of {object}: failed to read it")]
    Read {
        /// `namespace/name` (or `name` when cluster-scoped) of the object.
        object: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

impl OwnershipError {
    /// Whether this is a decision rather than a failure: the reconcile should stop without
    /// retrying (everything but [`OwnershipError::Read`]).
    pub fn is_final(&self) -> bool {
        !matches!(self, Self::Read { .. })
    }

    pub(crate) fn from_end(end: GuardEnd, object: String) -> Self {
        match end {
            GuardEnd::LeaseLost => Self::LeaseLost { object },
            GuardEnd::Excluded(reason) => Self::Excluded { object, reason },
        }
    }
}

/// Handed to every reconcile by [`Shard::reconciler`]: call [`Ownership::confirm`] before the
/// reconcile's first write, and [`Ownership::check`] before each later one.
///
/// A reconcile starts from the object as the shard's cache last saw it. While it runs (a slow
/// computation, a call to another system) the object may be drained, or the shard's Lease may
/// end; a write after that could land on an object another shard already owns.
///
/// **Cost:** the first [`Ownership::confirm`] of a reconcile sends one GET for the object (a
/// quorum read, no watch cache), so a reconcile that writes pays one extra request; later
/// calls, and [`Ownership::check`], send nothing. One read is enough: kube-runtime never runs
/// two reconciles of one object at once, so a drain that arrives meanwhile is acknowledged only
/// after this reconcile ended, and until then the sharder does not take the object away
/// without the Lease ending, which the Lease guard catches without a request.
pub struct Ownership {
    shard: Shard,
    object: String,
    uid: Option<String>,
    guard: LeaseGuard,
    fetch: Fetch,
    confirmed: AtomicBool,
}

impl fmt::Debug for Ownership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ownership")
            .field("shard", &self.shard.name())
            .field("object", &self.object)
            .field("confirmed", &self.confirmed.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Ownership {
    pub(crate) fn new(
        shard: Shard,
        object: String,
        uid: Option<String>,
        guard: LeaseGuard,
        fetch: Fetch,
    ) -> Self {
        Self {
            shard,
            object,
            uid,
            guard,
            fetch,
            confirmed: AtomicBool::new(false),
        }
    }

    /// Whether the shard's Lease still admits work (no request): for every write after the
    /// first.
    pub fn check(&self) -> Result<(), OwnershipError> {
        self.guard
            .check()
            .map_err(|end| OwnershipError::from_end(end, self.object.clone()))
    }

    /// Confirms, with a fresh read the first time it is called, that the object still exists
    /// (same UID), carries this shard's label and no drain label, and that the Lease still
    /// admits work; later calls only check the Lease (see the type's docs for why).
    pub async fn confirm(&self) -> Result<(), OwnershipError> {
        self.check()?;
        if self.confirmed.load(Ordering::Acquire) {
            return Ok(());
        }
        let object = || self.object.clone();
        let fresh = (self.fetch)()
            .await
            .map_err(|source| OwnershipError::Read {
                object: object(),
                source,
            })?;
        let Some(meta) = fresh else {
            return Err(OwnershipError::Deleted { object: object() });
        };
        if self.uid.is_some() && meta.uid != self.uid {
            return Err(OwnershipError::Deleted { object: object() });
        }
        match self.shard.classify(&meta) {
            Disposition::Reconcile => {}
            Disposition::Drain => return Err(OwnershipError::Draining { object: object() }),
            Disposition::Ignore => return Err(OwnershipError::Moved { object: object() }),
        }
        // The read may have taken a while: the Lease must still hold when it answered.
        self.check()?;
        self.confirmed.store(true, Ordering::Release);
        Ok(())
    }
}
