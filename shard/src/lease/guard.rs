//! What work guarded by a Lease checks before it acts: the lost token, the monotonic renew
//! deadline it shares with the renewer, and whether the holder was excluded from its ring.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Why a [`LeaseGuard`] stopped admitting work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuardEnd {
    /// The Lease is lost: not renewed within the renew deadline (by the monotonic clock), taken
    /// over, released by someone else or deleted.
    LeaseLost,
    /// The sharder keeps the holder's Lease out of its ring (docs/protocol.md §18), with this
    /// reason (the value of [`ANNOTATION_EXCLUDED`]).
    ///
    /// [`ANNOTATION_EXCLUDED`]: kube_sharding_api::labels::ANNOTATION_EXCLUDED
    Excluded(String),
}

/// State one held Lease shares between its renewer and the work it guards.
#[derive(Debug)]
struct Shared {
    /// Fired once, on loss or exclusion; never reset.
    ended: CancellationToken,
    /// `renewDeadline` after the last successful renewal was *sent*; `None` for a guard without
    /// a Lease behind it.
    deadline: Mutex<Option<Instant>>,
    /// The exclusion reason, set before `ended` fires.
    excluded: Mutex<Option<String>>,
    /// Counts successful renewals.
    renewals: tokio::sync::watch::Sender<u64>,
}

/// The gate work passes right before it acts on behalf of a Lease holder (a reconcile starting,
/// a write, a drain acknowledgement). Cheap to clone; clones share the state.
///
/// It admits work while all of these hold:
///
/// - the renewer has not signalled loss or exclusion;
/// - the monotonic clock is before the renew deadline counted from the last successful
///   renewal. The renewer task notices a passed deadline only when it is scheduled; after a VM
///   suspend or a long stall the work may be scheduled first. Checking the same deadline here
///   closes that window: whoever sees the deadline pass first ends the guard for everyone;
/// - the sharder has not excluded the Lease from its ring.
///
/// Ending is a latch: once [`LeaseGuard::check`] failed it fails for good, even if a renewal
/// answered late.
#[derive(Debug, Clone)]
pub struct LeaseGuard {
    shared: Arc<Shared>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave a half-written value behind.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LeaseGuard {
    /// A guard with a deadline, for the renewer of a Lease acquired by a write sent when the
    /// deadline started.
    pub(crate) fn with_deadline(deadline: Instant) -> Self {
        Self::new(CancellationToken::new(), Some(deadline))
    }

    fn new(ended: CancellationToken, deadline: Option<Instant>) -> Self {
        Self {
            shared: Arc::new(Shared {
                ended,
                deadline: Mutex::new(deadline),
                excluded: Mutex::new(None),
                renewals: tokio::sync::watch::Sender::new(0),
            }),
        }
    }

    /// A guard that ends only when `token` is cancelled (as [`GuardEnd::LeaseLost`]), with no
    /// deadline of its own. For work not guarded by a [`LeaseLock`](super::LeaseLock), or
    /// guarded by a lock of another implementation; pass a token that never fires for work
    /// guarded by nothing.
    pub fn from_token(token: CancellationToken) -> Self {
        Self::new(token, None)
    }

    /// Whether work may act now; ends the guard for everyone if the deadline has passed.
    pub fn check(&self) -> Result<(), GuardEnd> {
        if let Some(end) = self.end() {
            return Err(end);
        }
        let deadline = *lock(&self.shared.deadline);
        if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            self.shared.ended.cancel();
            return Err(GuardEnd::LeaseLost);
        }
        Ok(())
    }

    /// Whether [`LeaseGuard::check`] passes now.
    pub fn is_held(&self) -> bool {
        self.check().is_ok()
    }

    /// Why the guard ended, if it has (without looking at the clock).
    pub fn end(&self) -> Option<GuardEnd> {
        if !self.shared.ended.is_cancelled() {
            return None;
        }
        Some(match lock(&self.shared.excluded).clone() {
            Some(reason) => GuardEnd::Excluded(reason),
            None => GuardEnd::LeaseLost,
        })
    }

    /// Resolves once the guard ends: at once if it has, else when the renewer signals loss or
    /// exclusion or when the deadline passes, whichever comes first. Race work against it to
    /// cancel that work mid-flight.
    pub async fn ended(&self) -> GuardEnd {
        loop {
            if let Err(end) = self.check() {
                return end;
            }
            let deadline = *lock(&self.shared.deadline);
            match deadline {
                // A renewal may move the deadline meanwhile: look again when this one passes.
                Some(deadline) => tokio::select! {
                    () = self.shared.ended.cancelled() => {}
                    () = tokio::time::sleep_until(deadline) => {}
                },
                None => self.shared.ended.cancelled().await,
            }
        }
    }

    /// Resolves after the next successful renewal, or with the end if the guard ends first.
    pub(crate) async fn renewed(&self) -> Result<(), GuardEnd> {
        let mut renewals = self.shared.renewals.subscribe();
        tokio::select! {
            biased;
            end = self.ended() => Err(end),
            changed = renewals.changed() => match changed {
                Ok(()) => Ok(()),
                // The sender lives as long as `self`: unreachable, but never "renewed".
                Err(_) => Err(self.ended().await),
            },
        }
    }

    /// A token cancelled when the renewer signals loss or exclusion, or when a check found the
    /// deadline passed (a clone: cancelling it ends the guard).
    pub(super) fn token(&self) -> CancellationToken {
        self.shared.ended.clone()
    }

    /// Records a successful renewal: the deadline moves to `deadline` unless the guard ended
    /// (a latch) or it already is later.
    pub(super) fn extend(&self, deadline: Instant) {
        if self.shared.ended.is_cancelled() {
            return;
        }
        {
            let mut current = lock(&self.shared.deadline);
            if let Some(current) = current.as_mut() {
                *current = (*current).max(deadline);
            }
        }
        self.shared.renewals.send_modify(|count| *count += 1);
    }

    /// Ends the guard as lost.
    pub(super) fn lose(&self) {
        self.shared.ended.cancel();
    }

    /// Ends the guard as excluded for `reason`, unless it ended already.
    pub(super) fn exclude(&self, reason: String) {
        if self.shared.ended.is_cancelled() {
            return;
        }
        *lock(&self.shared.excluded) = Some(reason);
        self.shared.ended.cancel();
    }
}

impl From<CancellationToken> for LeaseGuard {
    fn from(token: CancellationToken) -> Self {
        Self::from_token(token)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_deadline_ends_the_guard_without_the_renewer() {
        let guard = LeaseGuard::with_deadline(Instant::now() + Duration::from_secs(10));
        assert!(guard.is_held());
        guard.extend(Instant::now() + Duration::from_secs(12));
        // An older success never moves the deadline back.
        guard.extend(Instant::now() + Duration::from_secs(3));
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(guard.is_held(), "extended to 12 s");
        let end = tokio::time::timeout(Duration::from_secs(5), guard.ended()).await;
        assert_eq!(end, Ok(GuardEnd::LeaseLost));
        // The check latched: the token fired, and a late renewal revives nothing.
        assert!(guard.token().is_cancelled());
        guard.extend(Instant::now() + Duration::from_secs(60));
        assert_eq!(guard.check(), Err(GuardEnd::LeaseLost));
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_after_a_stall_fails_before_the_renewer_runs() {
        let guard = LeaseGuard::with_deadline(Instant::now() + Duration::from_secs(10));
        // A suspend: the clock jumps past the deadline, and nothing ran in between.
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(!guard.token().is_cancelled(), "nothing noticed yet");
        assert_eq!(guard.check(), Err(GuardEnd::LeaseLost));
        assert!(guard.token().is_cancelled(), "the check told everyone");
    }

    #[tokio::test(start_paused = true)]
    async fn exclusion_carries_its_reason_and_wins_no_race_with_loss() {
        let guard = LeaseGuard::with_deadline(Instant::now() + Duration::from_secs(10));
        guard.exclude("DuplicateName".into());
        assert_eq!(
            guard.ended().await,
            GuardEnd::Excluded("DuplicateName".into())
        );
        assert_eq!(
            guard.check(),
            Err(GuardEnd::Excluded("DuplicateName".into()))
        );

        let lost = LeaseGuard::with_deadline(Instant::now() + Duration::from_secs(10));
        lost.lose();
        lost.exclude("DuplicateName".into());
        assert_eq!(lost.end(), Some(GuardEnd::LeaseLost), "the first end stays");
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_guard_has_no_deadline() {
        let token = CancellationToken::new();
        let guard = LeaseGuard::from(token.clone());
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(guard.is_held());
        token.cancel();
        assert_eq!(guard.check(), Err(GuardEnd::LeaseLost));
    }
}
