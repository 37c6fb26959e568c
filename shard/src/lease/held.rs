//! A held Lease: the background renewal, noticing loss, release, and running work only while
//! the Lease is held.

use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tracing::{debug, info, warn};

use super::decision::{AcquireDecision, RenewDeadline, desired_spec, is_held_by};
use super::lock::Inner;
use super::store::{is_conflict, is_not_found};
use super::{EVENT_LOST, EVENT_RELEASED, Error, LeaseLockConfig, error_chain, resource_version};

/// Outcome of one renewal.
enum Renewal {
    Renewed(Box<Lease>),
    /// The Lease is gone or has another (or no) holder.
    Lost(Option<String>),
}

impl Inner {
    /// Renews from the last Lease we wrote; if someone wrote in between (e.g. the sharder's state
    /// label), reads the Lease again and renews once more if it is still ours.
    async fn renew_once(&self, cached: &Lease) -> Result<Renewal, Error> {
        let mut current = cached.clone();
        for _ in 0..2 {
            let now = (self.clock)();
            let spec = current.spec.clone().unwrap_or_default();
            if !is_held_by(Some(&spec), &self.config.identity) {
                return Ok(Renewal::Lost(spec.holder_identity));
            }
            let Some(desired) = desired_spec(
                Some(&spec),
                &AcquireDecision::Renew,
                &self.config.identity,
                self.config.lease_duration_seconds(),
                now,
            ) else {
                return Ok(Renewal::Lost(spec.holder_identity));
            };
            let lease = self.with_spec(Some(current), desired);
            match self.store.replace(&lease).await {
                Ok(lease) => return Ok(Renewal::Renewed(Box::new(lease))),
                Err(e) if is_conflict(&e) || is_not_found(&e) => {
                    match self.store.get().await.map_err(|e| self.get_error(e))? {
                        Some(fresh) => current = fresh,
                        None => return Ok(Renewal::Lost(None)),
                    }
                }
                Err(e) => return Err(self.write_error(e)),
            }
        }
        // Two conflicts in a row: the next tick tries again, and the deadline decides.
        Err(self.contended("renew"))
    }

    /// Renews every retry period until stopped or lost; returns the last Lease it saw, which
    /// release starts from.
    pub(super) async fn renew_loop(
        self: Arc<Self>,
        mut lease: Lease,
        acquired_at: Instant,
        stop: CancellationToken,
        lost: CancellationToken,
    ) -> Lease {
        let config = &self.config;
        let mut deadline = RenewDeadline::new(acquired_at, config.renew_deadline());
        loop {
            // Wake at the deadline at the latest, so loss is signalled the moment it happens.
            let wake = (Instant::now() + config.retry_period()).min(deadline.deadline());
            tokio::select! {
                biased;
                () = stop.cancelled() => return lease,
                () = tokio::time::sleep_until(wake) => {}
            }
            if deadline.is_missed(Instant::now()) {
                // Signal first, then log: whatever checks the token after the record's timestamp
                // sees the loss.
                lost.cancel();
                warn!(
                    event = EVENT_LOST,
                    lease = %config.name,
                    namespace = %config.namespace,
                    renew_deadline = ?config.renew_deadline(),
                    resource_version = resource_version(&lease),
                    "failed to renew Lease within the renew deadline, it is lost"
                );
                return lease;
            }
            // The renew deadline counts from when a successful write was sent, not when its
            // answer arrived: the Lease's renewTime is from before the request, too.
            let started = Instant::now();
            let attempt = tokio::time::timeout_at(deadline.deadline(), self.renew_once(&lease));
            let outcome = tokio::select! {
                biased;
                () = stop.cancelled() => return lease,
                outcome = attempt => outcome,
            };
            match outcome {
                Ok(Ok(Renewal::Renewed(renewed))) => {
                    debug!(lease = %config.name, "renewed Lease");
                    lease = *renewed;
                    deadline.renewed(started);
                }
                Ok(Ok(Renewal::Lost(holder))) => {
                    lost.cancel();
                    warn!(
                        event = EVENT_LOST,
                        lease = %config.name,
                        namespace = %config.namespace,
                        holder = holder.as_deref().unwrap_or("<none>"),
                        resource_version = resource_version(&lease),
                        "Lease was taken over or removed, it is lost"
                    );
                    return lease;
                }
                Ok(Err(error)) => warn!(
                    error = %error_chain(&error),
                    lease = %config.name,
                    "failed to renew Lease, retrying until the renew deadline"
                ),
                // The deadline check at the top of the loop reports the loss.
                Err(_elapsed) => {}
            }
        }
    }
}

/// A Lease this process holds and renews in the background.
///
/// **Sharp edges:**
/// - Stop all work that needs the Lease as soon as [`HeldLease::lost`] resolves; after that
///   someone else may legitimately hold it.
/// - Dropping the `HeldLease` stops renewing without releasing: others can take the Lease only
///   once it expires. Call [`HeldLease::release`] on graceful shutdown, *after* stopping the work
///   it guards.
#[derive(Debug)]
pub struct HeldLease {
    pub(super) inner: Arc<Inner>,
    pub(super) lost: CancellationToken,
    pub(super) stop: CancellationToken,
    pub(super) renewer: Option<JoinHandle<Lease>>,
}

impl HeldLease {
    /// A future that resolves once the Lease is lost: not renewed within the renew deadline,
    /// taken over by someone else, released by someone else or deleted. It is `Send + Sync +
    /// 'static`, so it fits `Controller::graceful_shutdown_on`; resolves at once if already lost.
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.lost.clone().cancelled_owned()
    }

    /// A token cancelled once the Lease is lost, to hand to tasks that stop on it (such as
    /// [`Shard::reconciler`](crate::Shard::reconciler), which starts no reconcile and no drain
    /// acknowledgement once it fired). Cancelling the returned token does not affect the lock.
    pub fn lost_token(&self) -> CancellationToken {
        self.lost.child_token()
    }

    /// Whether the Lease has been lost.
    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// The lock's configuration.
    pub fn config(&self) -> &LeaseLockConfig {
        &self.inner.config
    }

    /// Stops renewing and, if the Lease is still ours, releases it by emptying its holder (a
    /// compare-and-swap like every write). Returns whether it released; `false` means someone
    /// else holds it now (e.g. after a loss) and nothing was written.
    ///
    /// Call this only after the work guarded by the Lease has stopped.
    pub async fn release(mut self) -> Result<bool, Error> {
        self.stop.cancel();
        let last_seen = match self.renewer.take() {
            Some(renewer) => renewer.await.ok(),
            None => None,
        };
        let Some(released) = self.inner.release(last_seen).await? else {
            return Ok(false);
        };
        info!(
            event = EVENT_RELEASED,
            lease = %self.inner.config.name,
            namespace = %self.inner.config.namespace,
            resource_version = resource_version(&released),
            "released Lease"
        );
        Ok(true)
    }
}

/// How [`HeldLease::run_while_held`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum HeldRunEnd {
    /// The Lease was lost: the work was dropped at once, mid-flight, and nothing was released
    /// (someone else may hold the Lease now).
    LeaseLost,
    /// The work ended (after shutdown, or on its own) while the Lease was still held, and then
    /// the Lease was released: `released` is `false` when someone else held it by then.
    WorkEnded {
        /// Whether the release wrote the Lease.
        released: bool,
    },
}

impl HeldLease {
    /// Runs the work guarded by this Lease (a controller, say) until it ends, enforcing the
    /// Lease contract (docs/protocol.md §3):
    ///
    /// - `work` gets a token that is cancelled when `shutdown` is: it should stop gracefully on
    ///   it (e.g. `Controller::graceful_shutdown_on(token.cancelled_owned())`). Once it has
    ///   ended, the Lease is released, so whoever waits for it takes over at once. Work still
    ///   running the renew deadline after `shutdown` is dropped, and the Lease released anyway.
    /// - When the Lease is lost, the work future is dropped at once, whatever it is doing: no
    ///   reconcile starts or continues after that, since another holder may act already.
    ///
    /// **Sharp edges:**
    /// - "At once" means at this future's next poll. The renewal runs on a task of its own and
    ///   may notice the loss while this future is in the middle of polling the work on another
    ///   thread; that poll still finishes and could start a reconcile. So work that acts on
    ///   objects checks [`HeldLease::lost_token`] right before each action, too: pass it to
    ///   [`Shard::reconciler`](crate::Shard::reconciler), which does.
    /// - Dropping only stops what the future owns. Work spawned with `tokio::spawn` from inside
    ///   it keeps running; keep such tasks in a `JoinSet` owned by the work, which aborts them
    ///   when it is dropped.
    pub async fn run_while_held<F, W>(
        self,
        shutdown: &CancellationToken,
        work: W,
    ) -> Result<HeldRunEnd, Error>
    where
        W: FnOnce(CancellationToken) -> F,
        F: Future<Output = ()>,
    {
        let work = work(shutdown.child_token());
        // A graceful stop gets the renew deadline, then the work is dropped: a controller told to
        // stop before its caches first synced can wait for them forever, and the Lease must
        // still be released.
        let grace = self.inner.config.renew_deadline();
        let stop_bound = async {
            shutdown.cancelled().await;
            tokio::time::sleep(grace).await;
        };
        tokio::select! {
            // Checked first: once lost, the work must not be polled again.
            biased;
            () = self.lost() => return Ok(HeldRunEnd::LeaseLost),
            () = work => {}
            () = stop_bound => {
                tracing::warn!(grace = ?grace, "work did not stop within the renew deadline after shutdown; dropped it");
            }
        }
        if self.is_lost() {
            return Ok(HeldRunEnd::LeaseLost);
        }
        let released = self.release().await?;
        Ok(HeldRunEnd::WorkEnded { released })
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        // Without this the renewer would keep the Lease alive for a holder that is gone.
        self.stop.cancel();
    }
}
