//! A held Lease: the background renewal, noticing loss, release, and running work only while
//! the Lease is held.

use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tracing::{debug, error, info, warn};

use super::decision::{AcquireDecision, RenewDeadline, desired_spec, is_held_by};
use super::guard::{GuardEnd, LeaseGuard};
use super::lock::Inner;
use super::store::{is_conflict, is_not_found, is_refusal};
use super::{Error, LeaseLockConfig, resource_version};
use crate::records::{EVENT_LEASE_EXCLUDED, EVENT_LEASE_LOST, EVENT_LEASE_RELEASED, error_chain};

/// Outcome of one renewal.
enum Renewal {
    Renewed(Box<Lease>),
    /// The Lease is gone or has another (or no) holder.
    Lost(Option<String>),
    /// The Lease (as written or read) carries the exclusion annotation, with this reason.
    Excluded(Box<Lease>, String),
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
            let mut lease = self.with_spec(Some(current), desired);
            let reported = self.report_load(&mut lease);
            let written = match (self.store.replace(&lease).await, reported) {
                // Refused for the report: renew without it.
                (Err(e), Some(before)) if is_refusal(&e) => {
                    self.unreport(&mut lease, before, &e);
                    self.store.replace(&lease).await
                }
                (written, _) => written,
            };
            match written {
                Ok(lease) => {
                    return Ok(match self.exclusion(&lease) {
                        Some(reason) => Renewal::Excluded(Box::new(lease), reason),
                        None => Renewal::Renewed(Box::new(lease)),
                    });
                }
                Err(e) if is_conflict(&e) || is_not_found(&e) => {
                    match self.store.get().await.map_err(|e| self.get_error(e))? {
                        Some(fresh) => match self.exclusion(&fresh) {
                            Some(reason)
                                if is_held_by(fresh.spec.as_ref(), &self.config.identity) =>
                            {
                                return Ok(Renewal::Excluded(Box::new(fresh), reason));
                            }
                            _ => current = fresh,
                        },
                        None => return Ok(Renewal::Lost(None)),
                    }
                }
                Err(e) => return Err(self.write_error(e)),
            }
        }
        // Two conflicts in a row: the next tick tries again, and the deadline decides.
        Err(self.contended("renew"))
    }

    /// Renews every retry period until stopped, lost or excluded; returns the last Lease it saw,
    /// which release starts from. Shares the renew deadline with `guard`, and ends it on loss or
    /// exclusion.
    pub(super) async fn renew_loop(
        self: Arc<Self>,
        mut lease: Lease,
        acquired_at: Instant,
        stop: CancellationToken,
        guard: LeaseGuard,
    ) -> Lease {
        let config = &self.config;
        let mut deadline = RenewDeadline::new(acquired_at, config.renew_deadline());
        let ended = guard.token();
        loop {
            // Wake at the deadline at the latest, so loss is signalled the moment it happens.
            let wake = (Instant::now() + config.retry_period()).min(deadline.deadline());
            tokio::select! {
                biased;
                () = stop.cancelled() => return lease,
                // A guard check that found the deadline passed (after a stall, before this task
                // was scheduled again) ended the guard: report it like a missed deadline.
                () = ended.cancelled() => {}
                () = tokio::time::sleep_until(wake) => {}
            }
            if deadline.is_missed(Instant::now()) || ended.is_cancelled() {
                // Signal first, then log: whatever checks the guard after the record's timestamp
                // sees the loss.
                guard.lose();
                warn!(
                    event = EVENT_LEASE_LOST,
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
                    guard.extend(deadline.deadline());
                }
                Ok(Ok(Renewal::Excluded(current, reason))) => {
                    guard.exclude(reason.clone());
                    lease = *current;
                    error!(
                        event = EVENT_LEASE_EXCLUDED,
                        lease = %config.name,
                        namespace = %config.namespace,
                        %reason,
                        resource_version = resource_version(&lease),
                        "the sharder excluded this Lease from its ring, stopping work to release it"
                    );
                    return lease;
                }
                Ok(Ok(Renewal::Lost(holder))) => {
                    guard.lose();
                    warn!(
                        event = EVENT_LEASE_LOST,
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
///   someone else may legitimately hold it. Work that acts on objects checks
///   [`HeldLease::guard`] right before each action, too.
/// - Dropping the `HeldLease` stops renewing without releasing: others can take the Lease only
///   once it expires. Call [`HeldLease::release`] on graceful shutdown, *after* stopping the work
///   it guards.
#[derive(Debug)]
pub struct HeldLease {
    pub(super) inner: Arc<Inner>,
    pub(super) guard: LeaseGuard,
    /// Whether acquiring created the Lease (nobody else can have judged it yet).
    pub(super) created: bool,
    /// Whether acquiring started a new holding and removed the verdict label.
    pub(super) unjudged: bool,
    pub(super) stop: CancellationToken,
    pub(super) renewer: Option<JoinHandle<Lease>>,
}

impl HeldLease {
    /// A future that resolves once the Lease is lost: not renewed within the renew deadline,
    /// taken over by someone else, released by someone else or deleted (or, for a lock that
    /// watches an exclusion annotation, excluded). It is `Send + Sync + 'static`, so it fits
    /// `Controller::graceful_shutdown_on`; resolves at once if already lost.
    ///
    /// It resolves when the renewer signals, or when a [`LeaseGuard::check`] found the renew
    /// deadline passed; [`LeaseGuard::ended`] also resolves at the deadline by itself.
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.guard.token().cancelled_owned()
    }

    /// A token cancelled once the Lease is lost (see [`HeldLease::lost`]). Cancelling the
    /// returned token does not affect the lock. Prefer [`HeldLease::guard`], which also checks
    /// the renew deadline itself.
    pub fn lost_token(&self) -> CancellationToken {
        self.guard.token().child_token()
    }

    /// The guard work checks right before it acts: it fails once the Lease is lost or excluded,
    /// and once the renew deadline shared with the renewer has passed by the monotonic clock,
    /// even before the renewer noticed. Pass it to
    /// [`Shard::reconciler`](crate::Shard::reconciler).
    pub fn guard(&self) -> LeaseGuard {
        self.guard.clone()
    }

    /// Whether acquiring this Lease created it: no one (the sharder, say) can have looked at it
    /// before.
    pub fn created(&self) -> bool {
        self.created
    }

    /// Whether no observer has judged this holding yet: acquiring created the Lease or took it
    /// over (after a release or an expiry) and, for a lock with a verdict label
    /// ([`LeaseLockConfig::with_verdict_label`]), removed that label in the same write. A verdict
    /// label seen on a later version was written about this holding.
    pub fn unjudged(&self) -> bool {
        self.unjudged
    }

    /// Whether the Lease has been lost (or its renew deadline has passed, or it was excluded).
    pub fn is_lost(&self) -> bool {
        !self.guard.is_held()
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
            event = EVENT_LEASE_RELEASED,
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

/// How a run of guarded work ended, exclusion included (what [`crate::Shard::run`] needs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RunEnd {
    /// As [`HeldRunEnd::LeaseLost`].
    Lost,
    /// The sharder excluded the Lease: the work was dropped at once, then the Lease released.
    Excluded { reason: String, released: bool },
    /// As [`HeldRunEnd::WorkEnded`].
    Ended { released: bool },
    /// Shutdown: the work stopped, then the renewals, and the Lease was left held for the
    /// process that comes back under the same identity.
    Kept,
}

impl HeldLease {
    /// Runs the work guarded by this Lease (a controller, say) until it ends, enforcing the
    /// Lease contract (docs/protocol.md §3):
    ///
    /// - `work` gets a token that is cancelled when `shutdown` is: it should stop gracefully on
    ///   it (e.g. `Controller::graceful_shutdown_on(token.cancelled_owned())`). Once it has
    ///   ended, the Lease is released, so whoever waits for it takes over at once. Work still
    ///   running the renew deadline after `shutdown` is dropped, and the Lease released anyway.
    /// - When the Lease is lost, or its renew deadline passes by the monotonic clock, the work
    ///   future is dropped at once, whatever it is doing: no reconcile starts or continues after
    ///   that, since another holder may act already.
    ///
    /// **Sharp edges:**
    /// - "At once" means at this future's next poll. The loss may be noticed while this future
    ///   is in the middle of polling the work on another thread; that poll still finishes. So
    ///   work that acts on objects checks [`HeldLease::guard`] right before each action, and
    ///   races what it is doing against [`LeaseGuard::ended`]: pass the guard to
    ///   [`Shard::reconciler`](crate::Shard::reconciler), which does both.
    /// - Dropping only stops what the future owns. Work spawned with `tokio::spawn` from inside
    ///   it keeps running; keep such tasks in a `JoinSet` owned by the work, which aborts them
    ///   when it is dropped.
    /// - A lock watching an exclusion annotation ([`LeaseLockConfig::with_exclusion_annotation`])
    ///   ends an excluded run as [`HeldRunEnd::WorkEnded`] after releasing; shards use
    ///   [`Shard::run`](crate::Shard::run), which tells exclusion apart and rejoins.
    pub async fn run_while_held<F, W>(
        self,
        shutdown: &CancellationToken,
        work: W,
    ) -> Result<HeldRunEnd, Error>
    where
        W: FnOnce(CancellationToken) -> F,
        F: Future<Output = ()>,
    {
        let release = || std::future::ready(false);
        Ok(match self.run(shutdown, work, release).await? {
            RunEnd::Lost => HeldRunEnd::LeaseLost,
            RunEnd::Excluded { released, .. } | RunEnd::Ended { released } => {
                HeldRunEnd::WorkEnded { released }
            }
            // `release` never keeps.
            RunEnd::Kept => HeldRunEnd::WorkEnded { released: false },
        })
    }

    /// [`HeldLease::run_while_held`], telling exclusion apart; after a graceful stop on
    /// `shutdown`, `keep()` decides whether the Lease is left held instead of released.
    pub(crate) async fn run<F, W, K, KF>(
        self,
        shutdown: &CancellationToken,
        work: W,
        keep: K,
    ) -> Result<RunEnd, Error>
    where
        W: FnOnce(CancellationToken) -> F,
        F: Future<Output = ()>,
        K: FnOnce() -> KF,
        KF: Future<Output = bool>,
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
        let guard = self.guard.clone();
        tokio::select! {
            // Checked first: once the guard ended, the work must not be polled again.
            biased;
            end = guard.ended() => match end {
                GuardEnd::LeaseLost => return Ok(RunEnd::Lost),
                GuardEnd::Excluded(reason) => {
                    // The work is dropped; the Lease is still ours: give it up, so the sharder
                    // and the older copy of this shard see at once that this one is gone.
                    let released = self.release().await?;
                    return Ok(RunEnd::Excluded { reason, released });
                }
            },
            () = work => {}
            () = stop_bound => {
                tracing::warn!(grace = ?grace, "work did not stop within the renew deadline after shutdown; dropped it");
            }
        }
        // Only a stop on shutdown may keep the Lease: work that ended by itself says nothing
        // about a process coming back. The renewals go on while `keep` looks.
        let kept = self.guard.check().is_ok() && shutdown.is_cancelled() && keep().await;
        match self.guard.check() {
            Err(GuardEnd::LeaseLost) => Ok(RunEnd::Lost),
            Err(GuardEnd::Excluded(reason)) => {
                let released = self.release().await?;
                Ok(RunEnd::Excluded { reason, released })
            }
            Ok(()) if kept => {
                self.stop_renewing().await;
                Ok(RunEnd::Kept)
            }
            Ok(()) => {
                let released = self.release().await?;
                Ok(RunEnd::Ended { released })
            }
        }
    }

    /// Stops renewing and waits until the renewer has stopped, writing nothing: the Lease stays
    /// held until it expires or the same identity renews it.
    async fn stop_renewing(mut self) {
        self.stop.cancel();
        if let Some(renewer) = self.renewer.take() {
            let _ = renewer.await;
        }
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        // Without this the renewer would keep the Lease alive for a holder that is gone.
        self.stop.cancel();
    }
}
