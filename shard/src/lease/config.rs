//! What a [`LeaseLock`] locks, under which identity and how fast, and the rules that
//! configuration must follow.

use std::collections::BTreeMap;
use std::time::Duration;

#[cfg(doc)]
use super::LeaseLock;
use super::{Error, LeaseTiming};
use crate::load::LoadMeter;

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
    pub(super) namespace: String,
    pub(super) name: String,
    pub(super) identity: String,
    pub(super) labels: BTreeMap<String, String>,
    pub(super) removed_labels: Vec<String>,
    pub(super) annotations: BTreeMap<String, String>,
    pub(super) removed_annotations: Vec<String>,
    pub(super) exclusion_annotation: Option<String>,
    pub(super) verdict_label: Option<String>,
    /// Annotations about one holding, removed by the write that starts a new one.
    pub(super) holding_annotations: Vec<String>,
    pub(super) release_mark: Option<String>,
    pub(super) load: Option<LoadMeter>,
    pub(super) timing: LeaseTiming,
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
            removed_annotations: Vec::new(),
            exclusion_annotation: None,
            verdict_label: None,
            holding_annotations: Vec::new(),
            release_mark: None,
            load: None,
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

    /// Makes the lock remove the annotation `key` from the Lease whenever it writes it (a shard
    /// that no longer says something it said before a restart).
    #[must_use]
    pub fn without_annotation(mut self, key: impl Into<String>) -> Self {
        self.removed_annotations.push(key.into());
        self
    }

    /// Makes the lock treat the annotation `key` on its Lease, written by someone else, as "you
    /// are excluded" (a shard Lease the sharder keeps out of its ring, docs/protocol.md §18):
    /// seen in the answer to a renewal or in a read, it ends the [`LeaseGuard`] as
    /// [`GuardEnd::Excluded`] with the annotation's value as reason and stops renewing;
    /// [`HeldLease::run_while_held`] then drops the work and releases the Lease, and
    /// [`LeaseLock::acquire`] does not take a Lease that carries it. Without it (leader
    /// election) annotations never stop the lock.
    ///
    /// [`LeaseGuard`]: super::LeaseGuard
    /// [`GuardEnd::Excluded`]: super::GuardEnd::Excluded
    /// [`HeldLease::run_while_held`]: super::HeldLease::run_while_held
    #[must_use]
    pub fn with_exclusion_annotation(mut self, key: impl Into<String>) -> Self {
        self.exclusion_annotation = Some(key.into());
        self
    }

    /// The annotation the lock treats as exclusion, if any.
    pub fn exclusion_annotation(&self) -> Option<&str> {
        self.exclusion_annotation.as_deref()
    }

    /// Makes the lock treat the label `key` as an observer's verdict on the Lease's holder (the
    /// sharder's state label on a shard Lease, docs/protocol.md §22): the write that starts a new
    /// holding (creating the Lease, or taking it over after a release or an expiry) removes it,
    /// so a value seen after that write was written about this holding
    /// ([`HeldLease::unjudged`]). Renewals keep it.
    ///
    /// [`HeldLease::unjudged`]: super::HeldLease::unjudged
    #[must_use]
    pub fn with_verdict_label(mut self, key: impl Into<String>) -> Self {
        self.verdict_label = Some(key.into());
        self
    }

    /// The label the lock treats as an observer's verdict on the holder, if any.
    pub fn verdict_label(&self) -> Option<&str> {
        self.verdict_label.as_deref()
    }

    /// Makes the lock treat the annotation `key` as being about one holding (the ranges a
    /// sharder published to a shard of a zero-write ring and the shard's acknowledgement,
    /// docs/zero-write-rings.md): the write that starts a new holding removes it, like a
    /// [verdict label](Self::with_verdict_label), so a value seen after that write was written
    /// during this holding. Renewals keep it.
    #[must_use]
    pub fn with_holding_annotation(mut self, key: impl Into<String>) -> Self {
        self.holding_annotations.push(key.into());
        self
    }

    /// The annotations the write starting a new holding removes.
    pub fn holding_annotations(&self) -> &[String] {
        &self.holding_annotations
    }

    /// Makes the lock mark its own releases: the write that empties the holder also sets the
    /// annotation `key` to the identity that gives the Lease up, and every write that acquires
    /// or renews the Lease removes it. The sharder moves a shard's objects directly only after
    /// a release marked this way (docs/protocol.md §4); any other emptied or changed holder
    /// may have been written by someone else while the shard still runs, so its objects leave
    /// through drains.
    #[must_use]
    pub fn with_release_mark(mut self, key: impl Into<String>) -> Self {
        self.release_mark = Some(key.into());
        self
    }

    /// The annotation with which the lock marks its own releases, if any.
    pub fn release_mark(&self) -> Option<&str> {
        self.release_mark.as_deref()
    }

    /// Makes the lock report the shard's load from `meter` (docs/protocol.md §23): every write
    /// that acquires or renews the Lease sets the annotation
    /// [`ANNOTATION_LOAD`](kube_sharding_api::load::ANNOTATION_LOAD) to the meter's current
    /// [report](LoadMeter::report), or removes it while the report is empty; the release
    /// removes it. No request is sent for a report alone. A renewal the API server refuses
    /// with the report (an admission policy, say) is sent again without a new one, and the
    /// lock reports nothing more: the report never costs the Lease.
    #[must_use]
    pub fn with_load_report(mut self, meter: LoadMeter) -> Self {
        self.load = Some(meter);
        self
    }

    /// The meter whose report the lock writes, if any.
    pub fn load_meter(&self) -> Option<&LoadMeter> {
        self.load.as_ref()
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

    pub(super) fn validate(&self) -> Result<(), Error> {
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
