//! The lock itself: acquiring the Lease, and the writes shared by renewal and release.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, ObjectMeta};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::decision::{
    AcquireDecision, decide, desired_spec, is_held_by, merge_labels, released_spec,
};
use super::guard::LeaseGuard;
use super::store::{Store, is_conflict, is_not_found, is_refusal};
use super::{Error, HeldLease, LeaseLockConfig, resource_version};
use crate::records::{
    EVENT_LEASE_ACQUIRED, EVENT_LEASE_EXCLUDED, EVENT_LEASE_RELEASED, error_chain,
};
use kube_sharding_api::load::ANNOTATION_LOAD;

/// The wall clock written into Leases. Injected so unit tests can run it on tokio's paused time.
pub(super) type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// The system clock, truncated to microseconds as a `MicroTime` stores it.
fn system_clock() -> Timestamp {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let micros = i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX);
    Timestamp::from_microsecond(micros).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// A lock over one `coordination.k8s.io/v1` Lease: acquire, renew in the background, notice
/// loss, release. Cheap to clone; clones lock the same Lease under the same identity.
///
/// The same lock serves a shard's membership Lease (name = identity = shard name, ring label) and
/// leader election among replicas (a fixed Lease name, one identity per replica, no labels):
///
/// ```no_run
/// # async fn leader_only_work(_stop: tokio_util::sync::CancellationToken) {}
/// # async fn example(client: kube::Client) -> Result<(), kube_sharding::LeaseError> {
/// use kube_sharding::{HeldRunEnd, LeaseLock, LeaseLockConfig};
/// use tokio_util::sync::CancellationToken;
///
/// let shutdown = CancellationToken::new();
/// let config = LeaseLockConfig::new("sharding-system", "sharder", "sharder-7d9f-abcde");
/// let lock = LeaseLock::new(client, config)?;
/// loop {
///     // Resolves once this replica is the leader.
///     let held = lock.acquire().await;
///     // Leader-only work runs here; it is dropped at once when leadership is lost, or stopped
///     // on shutdown, after which leadership is handed over at once.
///     match held.run_while_held(&shutdown, leader_only_work).await? {
///         HeldRunEnd::LeaseLost => continue,
///         HeldRunEnd::WorkEnded { .. } => return Ok(()),
///     }
/// }
/// # }
/// ```
///
/// Every write is a compare-and-swap on the Lease's `resourceVersion`: creating fails when someone
/// created the Lease first, and updates fail when someone wrote in between. A failed write never
/// counts as holding the Lease.
///
/// It logs a record when it acquires, loses and releases the Lease (see [`crate::records`]).
#[derive(Clone)]
pub struct LeaseLock {
    pub(super) inner: Arc<Inner>,
}

/// What a lock, its clones and the Leases it hands out share (the renewer task holds it, too).
pub(super) struct Inner {
    pub(super) store: Store,
    pub(super) config: LeaseLockConfig,
    pub(super) clock: Clock,
    /// Set once the API server refused a write for its load report: no more reports.
    pub(super) load_refused: AtomicBool,
}

impl std::fmt::Debug for LeaseLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseLock")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl LeaseLock {
    /// A lock using `client`; checks the configuration's timing rules.
    pub fn new(client: Client, config: LeaseLockConfig) -> Result<Self, Error> {
        let store = Store::Api {
            api: Api::namespaced(client, &config.namespace),
            name: config.name.clone(),
        };
        Self::with_store(store, config, Arc::new(system_clock))
    }

    /// A lock like [`LeaseLock::new`] whose timestamps (`acquireTime`, `renewTime`) run `offset`
    /// off the system clock, as on a machine whose clock is wrong. Only for testing what the
    /// sharder and other readers make of a skewed holder: the lock itself then judges others'
    /// Leases by the wrong clock as well.
    #[doc(hidden)]
    pub fn new_with_clock_offset(
        client: Client,
        config: LeaseLockConfig,
        offset: SignedDuration,
    ) -> Result<Self, Error> {
        let store = Store::Api {
            api: Api::namespaced(client, &config.namespace),
            name: config.name.clone(),
        };
        let clock = move || {
            system_clock()
                .checked_add(offset)
                .unwrap_or(Timestamp::UNIX_EPOCH)
        };
        Self::with_store(store, config, Arc::new(clock))
    }

    pub(super) fn with_store(
        store: Store,
        config: LeaseLockConfig,
        clock: Clock,
    ) -> Result<Self, Error> {
        config.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                config,
                clock,
                load_refused: AtomicBool::new(false),
            }),
        })
    }

    /// Every version of the Lease from now on, as a watch by name sees them.
    pub(crate) fn changes(&self) -> futures::stream::BoxStream<'static, Lease> {
        self.inner.store.changes()
    }

    /// Where a shard's shutdown check reads its StatefulSet: the API server of this lock.
    pub(crate) fn statefulset_reader(&self) -> Option<crate::shutdown::Reader> {
        match &self.inner.store {
            Store::Api { api, .. } => Some(crate::shutdown::Reader::Api(api.clone().into_client())),
            #[cfg(test)]
            Store::Fake(fake) => Some(crate::shutdown::Reader::Fixed(
                fake.statefulset().map(Box::new),
            )),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &LeaseLockConfig {
        &self.inner.config
    }

    /// Waits until the Lease is ours, then keeps renewing it in the background.
    ///
    /// Tries every retry period; API errors are logged and retried (a missing RBAC rule shows
    /// up as a repeated warning, not as an error). Cancel by dropping the future (e.g. in a
    /// `tokio::select!` with a shutdown signal): it holds nothing between attempts.
    ///
    /// Must be called within a tokio runtime: renewal runs as a spawned task.
    ///
    /// A lock watching an exclusion annotation
    /// ([`LeaseLockConfig::with_exclusion_annotation`]) does not take a Lease that carries it:
    /// it logs the reason at error level (once per reason), gives the Lease up if it still holds
    /// it (after a restart, say), and keeps looking every retry period until the annotation is
    /// gone.
    pub async fn acquire(&self) -> HeldLease {
        let mut last_holder = None;
        let mut last_exclusion = None;
        loop {
            let started = Instant::now();
            match self.inner.try_acquire_once().await {
                Ok(Attempt::Acquired(lease, fresh)) => {
                    return self.start_renewing(*lease, started, fresh);
                }
                Ok(Attempt::Excluded(reason)) => {
                    if last_exclusion.as_ref() != Some(&reason) {
                        error!(
                            event = EVENT_LEASE_EXCLUDED,
                            lease = %self.inner.config.name,
                            namespace = %self.inner.config.namespace,
                            %reason,
                            "the sharder excludes this Lease from its ring, waiting until it no longer does"
                        );
                        last_exclusion = Some(reason);
                    }
                }
                Ok(Attempt::HeldBy(holder)) => {
                    if last_holder.as_ref() != Some(&holder) {
                        info!(
                            lease = %self.inner.config.name,
                            namespace = %self.inner.config.namespace,
                            %holder,
                            "Lease is held by someone else, waiting for it to expire or be released"
                        );
                        last_holder = Some(holder);
                    }
                }
                Ok(Attempt::LostRace) => {
                    debug!(lease = %self.inner.config.name, "lost a race for the Lease, retrying");
                }
                Err(error) => warn!(
                    error = %error_chain(&error),
                    lease = %self.inner.config.name,
                    "failed to acquire Lease, retrying"
                ),
            }
            tokio::time::sleep(self.inner.config.retry_period()).await;
        }
    }

    /// One attempt to acquire the Lease: `Ok(None)` when someone else holds it or won a race.
    ///
    /// Must be called within a tokio runtime: on success renewal runs as a spawned task.
    pub async fn try_acquire(&self) -> Result<Option<HeldLease>, Error> {
        let started = Instant::now();
        match self.inner.try_acquire_once().await? {
            Attempt::Acquired(lease, fresh) => {
                Ok(Some(self.start_renewing(*lease, started, fresh)))
            }
            Attempt::HeldBy(_) | Attempt::LostRace | Attempt::Excluded(_) => Ok(None),
        }
    }

    /// Starts the renewer for a Lease acquired by a write sent at `written_at` (which created
    /// it, or took or renewed an existing one, as `fresh` tells).
    fn start_renewing(&self, lease: Lease, written_at: Instant, fresh: Fresh) -> HeldLease {
        let config = &self.inner.config;
        info!(
            event = EVENT_LEASE_ACQUIRED,
            lease = %config.name,
            namespace = %config.namespace,
            identity = %config.identity,
            transitions = lease.spec.as_ref().and_then(|s| s.lease_transitions).unwrap_or(0),
            resource_version = resource_version(&lease),
            "acquired Lease"
        );
        let guard = LeaseGuard::with_deadline(written_at + config.renew_deadline());
        let stop = CancellationToken::new();
        let renewer = tokio::spawn(Arc::clone(&self.inner).renew_loop(
            lease,
            written_at,
            stop.clone(),
            guard.clone(),
        ));
        HeldLease {
            inner: Arc::clone(&self.inner),
            guard,
            created: fresh.creating,
            unjudged: fresh.fresh && config.verdict_label.is_some(),
            stop,
            renewer: Some(renewer),
        }
    }
}

/// How new a holding that an acquire attempt started is.
#[derive(Clone, Copy, Debug)]
struct Fresh {
    /// The attempt created the Lease.
    creating: bool,
    /// The attempt created the Lease or took it over: a new holding.
    fresh: bool,
}

/// Outcome of one acquire attempt.
enum Attempt {
    /// Ours now.
    Acquired(Box<Lease>, Fresh),
    HeldBy(String),
    LostRace,
    /// The Lease carries the exclusion annotation with this reason; it is not ours (any more).
    Excluded(String),
}

impl Inner {
    pub(super) fn get_error(&self, source: kube::Error) -> Error {
        Error::Get {
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            source,
        }
    }

    pub(super) fn contended(&self, action: &'static str) -> Error {
        Error::Contended {
            action,
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
        }
    }

    pub(super) fn write_error(&self, source: kube::Error) -> Error {
        Error::Write {
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            source,
        }
    }

    /// `existing` with `spec` and our labels; the existing `resourceVersion` stays, which is
    /// what makes the following replace a compare-and-swap.
    pub(super) fn with_spec(&self, existing: Option<Lease>, spec: LeaseSpec) -> Lease {
        let mut lease = existing.unwrap_or_else(|| Lease {
            metadata: ObjectMeta {
                name: Some(self.config.name.clone()),
                namespace: Some(self.config.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: None,
        });
        lease.metadata.labels = merge_labels(lease.metadata.labels.take(), &self.config.labels);
        if let Some(labels) = lease.metadata.labels.as_mut() {
            for key in &self.config.removed_labels {
                labels.remove(key);
            }
        }
        lease.metadata.annotations =
            merge_labels(lease.metadata.annotations.take(), &self.config.annotations);
        if let Some(annotations) = lease.metadata.annotations.as_mut() {
            // A write that holds the Lease ends what a release mark said; `release` adds it back.
            for key in self
                .config
                .removed_annotations
                .iter()
                .chain(&self.config.release_mark)
            {
                annotations.remove(key);
            }
        }
        // Server-populated fields must not be echoed back in an update.
        lease.metadata.managed_fields = None;
        lease.spec = Some(spec);
        lease
    }

    /// Sets the load annotation of `lease`, about to be written as held, to the current report of
    /// the lock's meter (docs/protocol.md §23), or removes it while the report is empty. Returns
    /// the value the annotation had before when this changed it, for [`Inner::unreport`]; `None`
    /// when the lock reports nothing (no meter, or reports refused) or the value stays.
    pub(super) fn report_load(&self, lease: &mut Lease) -> Option<Option<String>> {
        let meter = self.config.load.as_ref()?;
        if self.load_refused.load(Ordering::Relaxed) {
            return None;
        }
        let report = meter.report();
        let annotations = lease.metadata.annotations.get_or_insert_default();
        let before = if report.is_empty() {
            annotations.remove(ANNOTATION_LOAD)
        } else {
            annotations.insert(ANNOTATION_LOAD.to_string(), report.to_string())
        };
        let after = annotations.get(ANNOTATION_LOAD);
        (before.as_ref() != after).then_some(before)
    }

    /// Puts back the load annotation `before` on `lease` after the API server refused a write
    /// that changed it with `error`, and stops reporting: the report must never cost the Lease.
    pub(super) fn unreport(&self, lease: &mut Lease, before: Option<String>, error: &kube::Error) {
        let annotations = lease.metadata.annotations.get_or_insert_default();
        match before {
            Some(value) => annotations.insert(ANNOTATION_LOAD.to_string(), value),
            None => annotations.remove(ANNOTATION_LOAD),
        };
        if !self.load_refused.swap(true, Ordering::Relaxed) {
            warn!(
                error = %error_chain(error),
                lease = %self.config.name,
                namespace = %self.config.namespace,
                "the API server refused the Lease with its load report; writing it without, and reporting no more load"
            );
        }
    }

    /// The exclusion reason `lease` carries, if this lock watches an exclusion annotation.
    pub(super) fn exclusion(&self, lease: &Lease) -> Option<String> {
        let key = self.config.exclusion_annotation.as_ref()?;
        lease.metadata.annotations.as_ref()?.get(key).cloned()
    }

    /// Gives up an excluded Lease this lock may still hold; logs when it wrote.
    async fn release_excluded(&self, lease: Lease) -> Result<(), Error> {
        if let Some(released) = self.release(Some(lease)).await? {
            info!(
                event = EVENT_LEASE_RELEASED,
                lease = %self.config.name,
                namespace = %self.config.namespace,
                resource_version = resource_version(&released),
                "released Lease"
            );
        }
        Ok(())
    }

    async fn try_acquire_once(&self) -> Result<Attempt, Error> {
        let existing = self.store.get().await.map_err(|e| self.get_error(e))?;
        if let Some(lease) = existing.as_ref()
            && let Some(reason) = self.exclusion(lease)
        {
            if is_held_by(lease.spec.as_ref(), &self.config.identity) {
                self.release_excluded(lease.clone()).await?;
            }
            return Ok(Attempt::Excluded(reason));
        }
        let now = (self.clock)();
        let spec = existing
            .as_ref()
            .map(|l| l.spec.clone().unwrap_or_default());
        let decision = decide(spec.as_ref(), &self.config.identity, now);
        if let AcquireDecision::Wait { holder, .. } = decision {
            return Ok(Attempt::HeldBy(holder));
        }
        let Some(desired) = desired_spec(
            spec.as_ref(),
            &decision,
            &self.config.identity,
            self.config.lease_duration_seconds(),
            now,
        ) else {
            return Ok(Attempt::LostRace);
        };
        let creating = existing.is_none();
        // A new holding: whatever verdict an observer wrote was about the one before.
        let fresh = matches!(decision, AcquireDecision::Create | AcquireDecision::Take);
        let mut lease = self.with_spec(existing, desired);
        if fresh
            && let (Some(key), Some(labels)) = (
                self.config.verdict_label.as_ref(),
                lease.metadata.labels.as_mut(),
            )
        {
            labels.remove(key);
        }
        if fresh && let Some(annotations) = lease.metadata.annotations.as_mut() {
            for key in &self.config.holding_annotations {
                annotations.remove(key);
            }
        }
        let reported = self.report_load(&mut lease);
        let write = |lease: Lease| async move {
            if creating {
                self.store.create(&lease).await
            } else {
                self.store.replace(&lease).await
            }
        };
        let written = match (write(lease.clone()).await, reported) {
            (Err(e), Some(before)) if is_refusal(&e) => {
                self.unreport(&mut lease, before, &e);
                write(lease).await
            }
            (written, _) => written,
        };
        match written {
            // Only a concurrent writer could have put the annotation there; give it up at once.
            Ok(lease) => match self.exclusion(&lease) {
                Some(reason) => {
                    self.release_excluded(lease).await?;
                    Ok(Attempt::Excluded(reason))
                }
                None => Ok(Attempt::Acquired(
                    Box::new(lease),
                    Fresh { creating, fresh },
                )),
            },
            // Someone created, changed or deleted it since we read it: look again next time.
            // (A 404 on create means the namespace is missing: an error worth a warning.)
            Err(e) if is_conflict(&e) || (!creating && is_not_found(&e)) => Ok(Attempt::LostRace),
            Err(e) => Err(self.write_error(e)),
        }
    }

    /// Empties the holder if we still hold the Lease. Returns the Lease as written, if it wrote.
    pub(super) async fn release(&self, mut current: Option<Lease>) -> Result<Option<Lease>, Error> {
        if current.is_none() {
            current = self.store.get().await.map_err(|e| self.get_error(e))?;
        }
        for _ in 0..3 {
            let Some(lease) = current.take() else {
                return Ok(None);
            };
            let spec = lease.spec.clone().unwrap_or_default();
            if !is_held_by(Some(&spec), &self.config.identity) {
                return Ok(None);
            }
            let mut released = self.with_spec(Some(lease), released_spec(&spec));
            // A released shard counts toward no ring: its last report goes (unless the API
            // server refused reports, which then leaves the annotation alone).
            if self.config.load.is_some()
                && !self.load_refused.load(Ordering::Relaxed)
                && let Some(annotations) = released.metadata.annotations.as_mut()
            {
                annotations.remove(ANNOTATION_LOAD);
            }
            if let Some(key) = &self.config.release_mark {
                released
                    .metadata
                    .annotations
                    .get_or_insert_default()
                    .insert(key.clone(), self.config.identity.clone());
            }
            match self.store.replace(&released).await {
                Ok(written) => return Ok(Some(written)),
                Err(e) if is_conflict(&e) || is_not_found(&e) => {
                    current = self.store.get().await.map_err(|e| self.get_error(e))?;
                }
                Err(e) => return Err(self.write_error(e)),
            }
        }
        Err(self.contended("release"))
    }
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
