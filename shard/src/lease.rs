//! A lock over one `coordination.k8s.io/v1` Lease: acquire, renew in the background, notice loss,
//! release.
//!
//! The same lock serves a shard's membership Lease (name = identity = shard name, ring label) and
//! leader election among replicas (a fixed Lease name, one identity per replica, no labels):
//!
//! ```no_run
//! # async fn leader_only_work(_stop: tokio_util::sync::CancellationToken) {}
//! # async fn example(client: kube::Client) -> Result<(), shard::lease::Error> {
//! use shard::lease::{HeldRunEnd, LeaseLock, LeaseLockConfig};
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
//!
//! All three carry `lease`, `namespace` and `resource_version`: the Lease's
//! `metadata.resourceVersion` as this lock last wrote it (by the acquiring write; by the last
//! successful renewal before the loss; by the releasing write), to match against a watch of the
//! Lease. The loss is recorded right after [`HeldLease::lost_token`] fired, so anything that
//! checks the token after the record's timestamp sees the loss.

pub mod decision;
mod store;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ObjectMeta};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tracing::{debug, info, warn};

pub use self::decision::{AcquireDecision, decide};
use self::decision::{RenewDeadline, desired_spec, is_held_by, merge_labels, released_spec};
use self::store::{Store, is_conflict, is_not_found};
pub use sharding_crds::lease::{
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

/// What a [`LeaseLock`] locks, under which identity, and how fast.
///
/// Timing rules, checked by [`LeaseLock::new`] with [`LeaseTiming::validate`] (the rule the
/// sharder's configuration is checked with, too): `0 < retry_period < renew_deadline <
/// lease_duration`, and `lease_duration` of at least one second (the Lease stores whole seconds;
/// sub-second parts are rounded up).
///
/// **Sharp edge:** the gap between `renew_deadline` and `lease_duration` is the safety margin of
/// the whole scheme; see [`LeaseTiming`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseLockConfig {
    namespace: String,
    name: String,
    identity: String,
    labels: BTreeMap<String, String>,
    removed_labels: Vec<String>,
    annotations: BTreeMap<String, String>,
    timing: LeaseTiming,
}

impl LeaseLockConfig {
    /// A lock on Lease `namespace/name`, held as `identity`, with default timing (15 s duration,
    /// 10 s renew deadline, 2 s retry period) and no labels.
    ///
    /// For leader election pick an identity unique per replica (e.g. the pod name plus a random
    /// suffix): two processes with one identity both believe they hold the Lease.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            labels: BTreeMap::new(),
            removed_labels: Vec::new(),
            annotations: BTreeMap::new(),
            timing: LeaseTiming::default(),
        }
    }

    /// Adds a label the lock puts on the Lease when creating, taking and renewing it. Labels
    /// written by others (such as the sharder's state label) are kept.
    #[must_use]
    pub fn with_label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Sets `leaseDurationSeconds`: how long others wait after the last renewal before taking
    /// the Lease over.
    #[must_use]
    pub fn with_lease_duration(mut self, duration: Duration) -> Self {
        self.timing.lease_duration = duration;
        self
    }

    /// Sets how long the holder keeps considering itself the owner without a successful renewal.
    /// Must be shorter than the lease duration.
    #[must_use]
    pub fn with_renew_deadline(mut self, deadline: Duration) -> Self {
        self.timing.renew_deadline = deadline;
        self
    }

    /// Sets the interval between renewals, and between attempts to acquire. Must be shorter than
    /// the renew deadline, ideally a fraction of it so several attempts fit in.
    #[must_use]
    pub fn with_retry_period(mut self, period: Duration) -> Self {
        self.timing.retry_period = period;
        self
    }

    /// Sets lease duration, renew deadline and retry period at once.
    #[must_use]
    pub fn with_timing(mut self, timing: LeaseTiming) -> Self {
        self.timing = timing;
        self
    }

    /// Namespace of the Lease.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Name of the Lease.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The holder identity this lock writes.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Labels the lock keeps on the Lease.
    pub fn labels(&self) -> &BTreeMap<String, String> {
        &self.labels
    }

    /// Makes the lock remove the label `key` from the Lease whenever it writes it (a shard moving
    /// to the other ring kind drops its old ring label, so the Lease never carries both).
    pub fn without_label(mut self, key: impl Into<String>) -> Self {
        self.removed_labels.push(key.into());
        self
    }

    /// Adds an annotation the lock puts on the Lease when creating, taking and renewing it (a
    /// shard's weight, say). Annotations written by others are kept.
    pub fn with_annotation(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.annotations.insert(key.into(), value.into());
        self
    }

    /// Annotations the lock keeps on the Lease.
    pub fn annotations(&self) -> &BTreeMap<String, String> {
        &self.annotations
    }

    /// Lease duration, renew deadline and retry period.
    pub fn timing(&self) -> LeaseTiming {
        self.timing
    }

    /// The lease duration.
    pub fn lease_duration(&self) -> Duration {
        self.timing.lease_duration
    }

    /// The renew deadline.
    pub fn renew_deadline(&self) -> Duration {
        self.timing.renew_deadline
    }

    /// The retry period.
    pub fn retry_period(&self) -> Duration {
        self.timing.retry_period
    }

    /// `leaseDurationSeconds` as written to the Lease (rounded up to whole seconds).
    pub fn lease_duration_seconds(&self) -> i32 {
        self.timing.lease_duration_seconds()
    }

    fn validate(&self) -> Result<(), Error> {
        let invalid = |message: &str| Err(Error::InvalidConfig(message.to_string()));
        if self.namespace.is_empty() || self.name.is_empty() || self.identity.is_empty() {
            return invalid("namespace, name and identity must not be empty");
        }
        self.timing
            .validate()
            .map_err(|error| Error::InvalidConfig(format!("{}: {error}", error.field())))?;
        Ok(())
    }
}

/// The wall clock written into Leases. Injected so unit tests can run it on tokio's paused time.
type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// The system clock, truncated to microseconds as a `MicroTime` stores it.
fn system_clock() -> Timestamp {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let micros = i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX);
    Timestamp::from_microsecond(micros).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// A lock over one Lease. Cheap to clone; clones lock the same Lease under the same identity.
#[derive(Clone)]
pub struct LeaseLock {
    inner: Arc<Inner>,
}

struct Inner {
    store: Store,
    config: LeaseLockConfig,
    clock: Clock,
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

    fn with_store(store: Store, config: LeaseLockConfig, clock: Clock) -> Result<Self, Error> {
        config.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                config,
                clock,
            }),
        })
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
    pub async fn acquire(&self) -> HeldLease {
        let mut last_holder = None;
        loop {
            let started = Instant::now();
            match self.inner.try_acquire_once().await {
                Ok(Attempt::Acquired(lease)) => return self.start_renewing(*lease, started),
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
            Attempt::Acquired(lease) => Ok(Some(self.start_renewing(*lease, started))),
            Attempt::HeldBy(_) | Attempt::LostRace => Ok(None),
        }
    }

    /// Starts the renewer for a Lease acquired by a write sent at `written_at`.
    fn start_renewing(&self, lease: Lease, written_at: Instant) -> HeldLease {
        let config = &self.inner.config;
        info!(
            event = EVENT_ACQUIRED,
            lease = %config.name,
            namespace = %config.namespace,
            identity = %config.identity,
            transitions = lease.spec.as_ref().and_then(|s| s.lease_transitions).unwrap_or(0),
            resource_version = resource_version(&lease),
            "acquired Lease"
        );
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let renewer = tokio::spawn(Arc::clone(&self.inner).renew_loop(
            lease,
            written_at,
            stop.clone(),
            lost.clone(),
        ));
        HeldLease {
            inner: Arc::clone(&self.inner),
            lost,
            stop,
            renewer: Some(renewer),
        }
    }
}

/// Outcome of one acquire attempt.
enum Attempt {
    Acquired(Box<Lease>),
    HeldBy(String),
    LostRace,
}

/// Outcome of one renewal.
enum Renewal {
    Renewed(Box<Lease>),
    /// The Lease is gone or has another (or no) holder.
    Lost(Option<String>),
}

impl Inner {
    fn get_error(&self, source: kube::Error) -> Error {
        Error::Get {
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            source,
        }
    }

    fn contended(&self, action: &'static str) -> Error {
        Error::Contended {
            action,
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
        }
    }

    fn write_error(&self, source: kube::Error) -> Error {
        Error::Write {
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            source,
        }
    }

    /// `existing` with `spec` and our labels; the existing `resourceVersion` stays, which is
    /// what makes the following replace a compare-and-swap.
    fn with_spec(&self, existing: Option<Lease>, spec: LeaseSpec) -> Lease {
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
        // Server-populated fields must not be echoed back in an update.
        lease.metadata.managed_fields = None;
        lease.spec = Some(spec);
        lease
    }

    async fn try_acquire_once(&self) -> Result<Attempt, Error> {
        let existing = self.store.get().await.map_err(|e| self.get_error(e))?;
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
        let lease = self.with_spec(existing, desired);
        let written = if creating {
            self.store.create(&lease).await
        } else {
            self.store.replace(&lease).await
        };
        match written {
            Ok(lease) => Ok(Attempt::Acquired(Box::new(lease))),
            // Someone created, changed or deleted it since we read it: look again next time.
            // (A 404 on create means the namespace is missing: an error worth a warning.)
            Err(e) if is_conflict(&e) || (!creating && is_not_found(&e)) => Ok(Attempt::LostRace),
            Err(e) => Err(self.write_error(e)),
        }
    }

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
    async fn renew_loop(
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

    /// Empties the holder if we still hold the Lease. Returns the Lease as written, if it wrote.
    async fn release(&self, mut current: Option<Lease>) -> Result<Option<Lease>, Error> {
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
            let released = self.with_spec(Some(lease), released_spec(&spec));
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

/// `event` of the record logged when the lock acquires its Lease (see the module docs).
const EVENT_ACQUIRED: &str = "lease_acquired";
/// `event` of the record logged when the Lease is lost, right after the lost token fired.
const EVENT_LOST: &str = "lease_lost";
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
    inner: Arc<Inner>,
    lost: CancellationToken,
    stop: CancellationToken,
    renewer: Option<JoinHandle<Lease>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
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

#[cfg(test)]
mod tests {
    use super::store::fake::{FakeStore, Mode};
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    const DURATION: Duration = Duration::from_secs(15);
    const DEADLINE: Duration = Duration::from_secs(10);
    const RETRY: Duration = Duration::from_secs(2);

    /// A wall clock that advances with tokio's (paused) clock.
    fn test_clock() -> Clock {
        let wall_start = Timestamp::from_second(1_700_000_000).expect("valid timestamp");
        let start = Instant::now();
        Arc::new(move || {
            let elapsed = Instant::now() - start;
            let micros = i64::try_from(elapsed.as_micros()).expect("small");
            wall_start
                .checked_add(k8s_openapi::jiff::SignedDuration::from_micros(micros))
                .expect("in range")
        })
    }

    fn lock(fake: &FakeStore, identity: &str) -> LeaseLock {
        let config = LeaseLockConfig::new("ns", "shard-a", identity)
            .with_label("ring", "r")
            .without_label("old-ring")
            .with_annotation("weight", "2")
            .with_lease_duration(DURATION)
            .with_renew_deadline(DEADLINE)
            .with_retry_period(RETRY);
        LeaseLock::with_store(Store::Fake(fake.clone()), config, test_clock()).expect("valid")
    }

    fn spec(fake: &FakeStore) -> LeaseSpec {
        fake.lease().and_then(|l| l.spec).expect("lease exists")
    }

    /// Lets spawned tasks run at the current (paused) instant.
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[test]
    fn config_validation() {
        let ok = LeaseLockConfig::new("ns", "n", "id");
        assert!(ok.validate().is_ok());
        assert_eq!(ok.lease_duration_seconds(), 15);
        let bad = [
            LeaseLockConfig::new("", "n", "id"),
            ok.clone().with_renew_deadline(DURATION),
            ok.clone().with_retry_period(DEADLINE),
            ok.clone().with_retry_period(Duration::ZERO),
            ok.clone()
                .with_lease_duration(Duration::from_millis(500))
                .with_renew_deadline(Duration::from_millis(400))
                .with_retry_period(Duration::from_millis(100)),
        ];
        for config in bad {
            assert!(config.validate().is_err(), "{config:?}");
        }
        let rounded = ok.with_lease_duration(Duration::from_millis(2_500));
        assert_eq!(rounded.lease_duration_seconds(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn acquire_creates_and_renews_every_retry_period() {
        let fake = FakeStore::new();
        let lock = lock(&fake, "shard-a");
        let held = lock.acquire().await;
        let created = fake.lease().expect("created");
        assert_eq!(
            created
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("ring"))
                .map(String::as_str),
            Some("r")
        );
        let first = spec(&fake);
        assert_eq!(first.holder_identity.as_deref(), Some("shard-a"));
        assert_eq!(first.lease_duration_seconds, Some(15));
        assert_eq!(first.lease_transitions, Some(0));
        assert_eq!(first.acquire_time, first.renew_time);

        tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
        settle().await;
        let second = spec(&fake);
        assert!(second.renew_time > first.renew_time, "renewTime advances");
        assert_eq!(second.acquire_time, first.acquire_time, "acquireTime stays");
        assert_eq!(fake.writes(), 2);

        tokio::time::sleep(RETRY * 10).await;
        settle().await;
        assert!(!held.is_lost());
        assert_eq!(fake.writes(), 12);
    }

    #[tokio::test(start_paused = true)]
    async fn hung_api_loses_the_lease_exactly_at_the_renew_deadline() {
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        // One more successful renewal, then the API stops answering.
        tokio::time::sleep(RETRY).await;
        settle().await;
        assert_eq!(fake.writes(), 2);
        fake.set_mode(Mode::Hang);
        let last_success = Instant::now();

        tokio::time::sleep_until(last_success + DEADLINE - Duration::from_millis(1)).await;
        settle().await;
        assert!(!held.is_lost(), "not lost before the deadline");
        tokio::time::sleep(Duration::from_millis(1)).await;
        settle().await;
        assert!(held.is_lost(), "lost at the deadline");
        // The future resolves at once now.
        tokio::time::timeout(Duration::from_millis(1), held.lost())
            .await
            .expect("lost() resolves");
    }

    #[tokio::test(start_paused = true)]
    async fn failing_api_is_retried_until_the_renew_deadline() {
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        let acquired = Instant::now();
        let token = held.lost_token();

        // Renewals at 2, 4 and 6 s fail; the one at 8 s succeeds and moves the deadline to 18 s.
        fake.set_mode(Mode::Fail);
        tokio::time::sleep_until(acquired + Duration::from_secs(7)).await;
        settle().await;
        assert!(!token.is_cancelled());
        fake.set_mode(Mode::Normal);
        tokio::time::sleep_until(acquired + Duration::from_secs(13)).await;
        settle().await;
        assert!(
            !held.is_lost(),
            "a success before the deadline keeps the lease"
        );

        // Last success at 12 s: failing from now on loses the Lease at exactly 22 s.
        fake.set_mode(Mode::Fail);
        tokio::time::sleep_until(acquired + Duration::from_secs(22) - Duration::from_millis(1))
            .await;
        settle().await;
        assert!(!held.is_lost());
        tokio::time::sleep(Duration::from_millis(1)).await;
        settle().await;
        assert!(held.is_lost());
        assert!(token.is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn takeover_is_noticed_at_the_next_renewal() {
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        fake.modify(|lease| {
            let spec = lease.spec.get_or_insert_default();
            spec.holder_identity = Some("shardlease-controller".into());
            spec.lease_duration_seconds = Some(30);
        });
        tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
        settle().await;
        assert!(held.is_lost());
        assert_eq!(
            spec(&fake).holder_identity.as_deref(),
            Some("shardlease-controller"),
            "the lock never overwrites a new holder"
        );
        assert!(
            !held.release().await.expect("release"),
            "nothing to release"
        );
        assert_eq!(
            spec(&fake).holder_identity.as_deref(),
            Some("shardlease-controller")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn foreign_label_change_is_not_a_loss_and_labels_survive() {
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        fake.modify(|lease| {
            lease
                .metadata
                .labels
                .get_or_insert_default()
                .insert("state".into(), "ready".into());
            lease
                .metadata
                .labels
                .get_or_insert_default()
                .insert("old-ring".into(), "r".into());
            lease
                .metadata
                .annotations
                .get_or_insert_default()
                .insert("note".into(), "kept".into());
        });
        tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
        settle().await;
        assert!(!held.is_lost());
        let labels = fake
            .lease()
            .and_then(|l| l.metadata.labels)
            .expect("labels");
        assert_eq!(labels.get("state").map(String::as_str), Some("ready"));
        assert_eq!(labels.get("ring").map(String::as_str), Some("r"));
        assert!(
            !labels.contains_key("old-ring"),
            "removed at the next write"
        );
        let annotations = fake
            .lease()
            .and_then(|l| l.metadata.annotations)
            .expect("annotations");
        assert_eq!(annotations.get("weight").map(String::as_str), Some("2"));
        assert_eq!(annotations.get("note").map(String::as_str), Some("kept"));
        assert_eq!(fake.writes(), 2, "renewed after re-reading");
    }

    #[tokio::test(start_paused = true)]
    async fn waits_for_a_takeover_to_expire_then_takes_the_lease() {
        let fake = FakeStore::new();
        let lock = lock(&fake, "shard-a");
        drop(lock.acquire().await);
        // The sharder took it over: holder changed, duration doubled, renewed "now".
        let taken_at = Instant::now();
        let now = (lock.inner.clock)();
        fake.modify(|lease| {
            let spec = lease.spec.get_or_insert_default();
            spec.holder_identity = Some("shardlease-controller".into());
            spec.lease_duration_seconds = Some(30);
            spec.acquire_time = Some(MicroTime(now));
            spec.renew_time = Some(MicroTime(now));
            spec.lease_transitions = Some(1);
        });
        let held = lock.acquire().await;
        let waited = Instant::now() - taken_at;
        // Expired from exactly `renewTime + leaseDurationSeconds` on (docs/protocol.md §4), so the
        // attempt at exactly 30 s takes it.
        assert!(waited >= Duration::from_secs(30), "waited {waited:?}");
        assert!(
            waited <= Duration::from_secs(30) + RETRY,
            "waited {waited:?}"
        );
        let spec = spec(&fake);
        assert_eq!(spec.holder_identity.as_deref(), Some("shard-a"));
        assert_eq!(spec.lease_transitions, Some(2));
        assert_eq!(spec.lease_duration_seconds, Some(15));
        assert!(spec.acquire_time > Some(MicroTime(now)));
        assert!(!held.is_lost());
    }

    #[tokio::test(start_paused = true)]
    async fn second_identity_waits_while_the_first_renews_and_gets_it_on_release() {
        let fake = FakeStore::new();
        let first = lock(&fake, "replica-1").acquire().await;
        let second = lock(&fake, "replica-2");
        assert!(second.try_acquire().await.expect("no error").is_none());

        let waiting = tokio::spawn(async move { second.acquire().await });
        tokio::time::sleep(DURATION * 3).await;
        settle().await;
        assert!(!waiting.is_finished(), "a renewed lease is never taken");

        assert!(first.release().await.expect("release"));
        assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
        let held = tokio::time::timeout(RETRY * 2, waiting)
            .await
            .expect("acquired soon after release")
            .expect("task ok");
        let spec = spec(&fake);
        assert_eq!(spec.holder_identity.as_deref(), Some("replica-2"));
        assert_eq!(spec.lease_transitions, Some(1));
        assert!(!held.is_lost());
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_stops_renewal_without_releasing() {
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        drop(held);
        tokio::time::sleep(RETRY * 5).await;
        settle().await;
        assert_eq!(fake.writes(), 1);
        assert_eq!(spec(&fake).holder_identity.as_deref(), Some("shard-a"));
    }

    /// Work that counts its "reconciles", one per second, and records when it stopped.
    async fn counting_work(
        reconciles: Arc<std::sync::atomic::AtomicUsize>,
        stop: CancellationToken,
        finish_after_stop: Duration,
    ) {
        use std::sync::atomic::Ordering;
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(Duration::from_secs(1)) => {
                    reconciles.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        // A graceful stop takes a while (e.g. finishing reconciles in flight).
        tokio::time::sleep(finish_after_stop).await;
        reconciles.fetch_add(1_000, Ordering::SeqCst);
    }

    #[tokio::test(start_paused = true)]
    async fn run_while_held_drops_the_work_at_once_on_loss() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        let reconciles = Arc::new(AtomicUsize::new(0));
        let shutdown = CancellationToken::new();
        let counter = reconciles.clone();
        let run = tokio::spawn(async move {
            held.run_while_held(&shutdown, |stop| {
                counting_work(counter, stop, Duration::from_secs(5))
            })
            .await
        });
        tokio::time::sleep(Duration::from_millis(3_500)).await;
        settle().await;
        assert_eq!(reconciles.load(Ordering::SeqCst), 3);
        // Taken over: the next renewal (at 4 s) notices.
        fake.modify(|lease| {
            lease.spec.get_or_insert_default().holder_identity = Some("other".into());
        });
        let ended = tokio::time::timeout(RETRY, run)
            .await
            .expect("ends at the next renewal")
            .expect("task ok")
            .expect("no error");
        assert_eq!(ended, HeldRunEnd::LeaseLost);
        let at_loss = reconciles.load(Ordering::SeqCst);
        assert!(at_loss < 1_000, "no graceful finish after a loss");
        tokio::time::sleep(Duration::from_secs(30)).await;
        settle().await;
        assert_eq!(
            reconciles.load(Ordering::SeqCst),
            at_loss,
            "nothing runs on"
        );
        assert_eq!(
            spec(&fake).holder_identity.as_deref(),
            Some("other"),
            "nothing released"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn run_while_held_stops_the_work_then_releases_on_shutdown() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        let reconciles = Arc::new(AtomicUsize::new(0));
        let shutdown = CancellationToken::new();
        let (counter, token) = (reconciles.clone(), shutdown.clone());
        let run = tokio::spawn(async move {
            held.run_while_held(&token, |stop| {
                counting_work(counter, stop, Duration::from_secs(3))
            })
            .await
        });
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        shutdown.cancel();
        // Still finishing gracefully: the Lease is held until the work has ended.
        tokio::time::sleep(Duration::from_secs(2)).await;
        settle().await;
        assert_eq!(spec(&fake).holder_identity.as_deref(), Some("shard-a"));
        let ended = run.await.expect("task ok").expect("no error");
        assert_eq!(ended, HeldRunEnd::WorkEnded { released: true });
        assert_eq!(
            reconciles.load(Ordering::SeqCst),
            1_002,
            "finished gracefully"
        );
        assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
    }

    #[tokio::test(start_paused = true)]
    async fn run_while_held_drops_work_that_ignores_shutdown_after_the_renew_deadline() {
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        let started = Instant::now();
        // Work that never stops by itself, like a controller waiting for caches that never sync.
        let ended = held
            .run_while_held(&shutdown, |_stop| std::future::pending::<()>())
            .await
            .expect("no error");
        assert_eq!(ended, HeldRunEnd::WorkEnded { released: true });
        assert_eq!(started.elapsed(), DEADLINE);
        assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
    }

    #[tokio::test(start_paused = true)]
    async fn run_while_held_releases_when_the_work_ends_on_its_own() {
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        let ended = held
            .run_while_held(&CancellationToken::new(), |_stop| {
                tokio::time::sleep(Duration::from_secs(7))
            })
            .await
            .expect("no error");
        assert_eq!(ended, HeldRunEnd::WorkEnded { released: true });
        assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
    }

    /// JSON log records captured from the current thread, each with whether `token` (once set)
    /// had fired when the record was written.
    #[derive(Clone, Default)]
    struct CapturedLog {
        records: Arc<std::sync::Mutex<Vec<(serde_json::Value, bool)>>>,
        token: Arc<std::sync::OnceLock<CancellationToken>>,
    }

    impl std::io::Write for CapturedLog {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let fired = self
                .token
                .get()
                .is_some_and(CancellationToken::is_cancelled);
            let text = String::from_utf8_lossy(buf);
            let mut records = self.records.lock().expect("lock");
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                records.push((serde_json::from_str(line).expect("JSON record"), fired));
            }
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl CapturedLog {
        /// Installs a JSON subscriber like checksum-controller's for the current thread (the
        /// paused runtime runs the renewer here too).
        fn install(&self) -> tracing::subscriber::DefaultGuard {
            let writer = self.clone();
            let subscriber = tracing_subscriber::fmt()
                .json()
                .flatten_event(true)
                .with_writer(move || writer.clone())
                .finish();
            tracing::subscriber::set_default(subscriber)
        }

        /// The records with `event` set to `event`.
        fn events(&self, event: &str) -> Vec<(serde_json::Value, bool)> {
            self.records
                .lock()
                .expect("lock")
                .iter()
                .filter(|(record, _)| record["event"] == event)
                .cloned()
                .collect()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn lease_records_carry_their_event_and_resource_version() {
        let log = CapturedLog::default();
        let _guard = log.install();
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        log.token.set(held.lost_token()).expect("set once");
        let acquired = log.events("lease_acquired");
        assert_eq!(acquired.len(), 1);
        assert_eq!(acquired[0].0["resource_version"], "1", "as created");
        assert_eq!(acquired[0].0["transitions"], 0);
        assert_eq!(acquired[0].0["lease"], "shard-a");

        // Renewed once (version 2), then taken over (version 3).
        tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
        settle().await;
        fake.modify(|lease| {
            lease.spec.get_or_insert_default().holder_identity = Some("other".into());
        });
        tokio::time::sleep(RETRY).await;
        settle().await;
        assert!(held.is_lost());
        let lost = log.events("lease_lost");
        assert_eq!(lost.len(), 1);
        let (record, fired) = &lost[0];
        assert_eq!(
            record["resource_version"], "2",
            "as this lock last wrote it"
        );
        assert_eq!(record["holder"], "other");
        assert!(fired, "the token fired before the loss was recorded");
        assert!(!held.release().await.expect("release"));
        assert!(log.events("lease_released").is_empty(), "nothing released");

        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        assert!(held.release().await.expect("release"));
        let released = log.events("lease_released");
        assert_eq!(released.len(), 1);
        assert_eq!(
            released[0].0["resource_version"], "2",
            "the releasing write"
        );
        assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
    }

    #[tokio::test(start_paused = true)]
    async fn missed_deadline_is_recorded_after_the_token_fired() {
        let log = CapturedLog::default();
        let _guard = log.install();
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        log.token.set(held.lost_token()).expect("set once");
        fake.set_mode(Mode::Fail);
        tokio::time::sleep(DEADLINE + Duration::from_millis(1)).await;
        settle().await;
        assert!(held.is_lost());
        let lost = log.events("lease_lost");
        assert_eq!(lost.len(), 1);
        let (record, fired) = &lost[0];
        assert_eq!(record["resource_version"], "1", "never renewed");
        assert!(fired, "the token fired before the loss was recorded");
    }

    #[tokio::test(start_paused = true)]
    async fn deleted_lease_is_lost() {
        let fake = FakeStore::new();
        let held = lock(&fake, "shard-a").acquire().await;
        fake.delete();
        tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
        settle().await;
        assert!(held.is_lost());
    }
}
