//! Events the sharder publishes about rings and shard Leases, rate-limited, and every reason
//! they carry besides the shard-exclusion reasons of `core::membership`.
//!
//! A shard that flaps (joins, leaves, joins…) or a ring whose syncs keep failing must not flood
//! the API server with Events. Two limits apply: one Event per subject (the object, the reason and
//! what it is about, e.g. the shard) per `PER_SUBJECT_INTERVAL`, and a budget for all Events of
//! the process (`BURST`, refilled at `REFILL_PER_SECOND`). Suppressed Events are counted in
//! `controller_sharding_events_suppressed_total` and still logged.
//!
//! Every Event is created as a new `events.k8s.io/v1` Event. kube's `Recorder` would fold Events
//! of one reason about one object within six minutes into a series that keeps the first note, so
//! "shard-b joined" would read "shard-a joined" and a second rebalance would show the first's
//! counts; our own limiter bounds the number instead.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use prometheus_client::metrics::counter::Counter;

/// Reason of the Normal Event when a sync starts draining or moving objects of a ring.
pub const REASON_REBALANCE_STARTED: &str = "RebalanceStarted";
/// Reason of the Normal Event when a sync that drained or moved objects finished.
pub const REASON_REBALANCE_FINISHED: &str = "RebalanceFinished";
/// Reason of the Warning Event when a sync failed.
pub const REASON_SYNC_FAILED: &str = "SyncFailed";
/// Reason of the Normal Event when a shard joins a ring (becomes available).
pub const REASON_SHARD_JOINED: &str = "ShardJoined";
/// Reason of the Normal Event when a shard leaves a ring (is no longer available).
pub const REASON_SHARD_LEFT: &str = "ShardLeft";
/// Reason of the Warning Event when a shard has not acknowledged drains for `drainTimeout`.
pub const REASON_DRAIN_NOT_ACKNOWLEDGED: &str = "DrainNotAcknowledged";
/// Reason of the `Ready=False` condition, the Warning Event and the log record of a ring whose
/// webhook the API server does not reach.
pub const REASON_WEBHOOK_UNREACHABLE: &str = "WebhookUnreachable";
/// Reason of the Normal Event when the webhook answers again.
pub const REASON_WEBHOOK_REACHABLE: &str = "WebhookReachable";
/// Reason of the Normal Event on a ring when the sharder declares one of its shards dead.
pub const REASON_SHARD_DEAD: &str = "ShardDead";
/// Reason of the Warning Event about a weight annotation that is not a valid weight.
pub const REASON_INVALID_WEIGHT: &str = "InvalidShardWeight";
/// Reason of the Warning Event about an annotation saying whether a shard leaves its controlled
/// objects to the sharder that is neither `"true"` nor `"false"`.
pub const REASON_INVALID_LEAVES_CONTROLLED_OBJECTS: &str = "InvalidLeavesControlledObjects";
/// Reason of the Warning Event on a shard Lease whose holder's clock is off the sharder's by more
/// than a few seconds (docs/protocol.md §4).
pub const REASON_CLOCK_SKEW: &str = "ShardClockSkew";

/// Reason of the Warning Event on an object whose pin did not decide its shard: the pinned shard
/// is not available, or the value names no shard (docs/protocol.md §21).
pub const REASON_PIN_UNSATISFIED: &str = "PinUnsatisfied";

/// `reportingController` of our Events.
const REPORTING_CONTROLLER: &str = "sharder";
/// Longest note the API server accepts.
const MAX_NOTE_BYTES: usize = 1024;

/// Least time between two Events about one subject.
pub(crate) const PER_SUBJECT_INTERVAL: Duration = Duration::from_secs(10);
/// Events the process may publish at once after a quiet time.
pub(crate) const BURST: f64 = 100.0;
/// Events per second the budget refills with.
pub(crate) const REFILL_PER_SECOND: f64 = 5.0;
/// Subjects remembered at most; older ones are forgotten first when the map is full.
const MAX_SUBJECTS: usize = 10_000;

/// The pure rate limiter: whether an Event about `subject` may go out at `now`.
#[derive(Debug)]
pub(crate) struct Limiter {
    last: HashMap<String, Instant>,
    tokens: f64,
    refilled: Instant,
}

impl Limiter {
    /// A limiter with a full budget at `now`.
    pub(crate) fn new(now: Instant) -> Self {
        Self {
            last: HashMap::new(),
            tokens: BURST,
            refilled: now,
        }
    }

    /// Takes a token for `subject` if both limits allow it.
    pub(crate) fn allow(&mut self, subject: &str, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * REFILL_PER_SECOND).min(BURST);
        self.refilled = now;
        if self
            .last
            .get(subject)
            .is_some_and(|t| now.saturating_duration_since(*t) < PER_SUBJECT_INTERVAL)
        {
            return false;
        }
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        if self.last.len() >= MAX_SUBJECTS {
            self.last
                .retain(|_, t| now.saturating_duration_since(*t) < PER_SUBJECT_INTERVAL);
        }
        self.last.insert(subject.to_string(), now);
        true
    }
}

/// Publishes Events through the limiter.
pub(crate) struct Events {
    client: kube::Client,
    instance: String,
    limiter: Mutex<Limiter>,
    suppressed: Counter,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").finish_non_exhaustive()
    }
}

impl Events {
    /// Events created with `client`, reported by `instance` (the process identity), counting
    /// suppressed ones in `suppressed`.
    pub(crate) fn new(client: kube::Client, instance: String, suppressed: Counter) -> Self {
        Self {
            client,
            instance,
            limiter: Mutex::new(Limiter::new(Instant::now())),
            suppressed,
        }
    }

    /// Publishes a Normal Event on `reference`; `about` names what it concerns besides the
    /// object and reason (a shard, say), so Events about different shards are limited apart.
    pub(crate) async fn normal(
        &self,
        reference: &ObjectReference,
        reason: &str,
        about: &str,
        note: String,
    ) {
        self.publish(reference, "Normal", reason, about, note).await;
    }

    /// Publishes a Warning Event on `reference` (see [`Events::normal`]).
    pub(crate) async fn warning(
        &self,
        reference: &ObjectReference,
        reason: &str,
        about: &str,
        note: String,
    ) {
        self.publish(reference, "Warning", reason, about, note)
            .await;
    }

    async fn publish(
        &self,
        reference: &ObjectReference,
        type_: &str,
        reason: &str,
        about: &str,
        note: String,
    ) {
        let subject = format!(
            "{}/{}/{}/{}/{reason}/{about}",
            reference.kind.as_deref().unwrap_or_default(),
            reference.namespace.as_deref().unwrap_or_default(),
            reference.name.as_deref().unwrap_or_default(),
            reference.uid.as_deref().unwrap_or_default(),
        );
        let allowed = self
            .limiter
            .lock()
            .map(|mut l| l.allow(&subject, Instant::now()))
            .unwrap_or(false);
        if !allowed {
            self.suppressed.inc();
            tracing::debug!(%subject, %note, "Event suppressed by the rate limit");
            return;
        }
        let now = Timestamp::now();
        // Events of cluster-scoped objects go to `default`, as kubectl looks for them there.
        let namespace = reference
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = event_name(reference.name.as_deref().unwrap_or("object"), now);
        let event = Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            action: Some(reason.into()),
            reason: Some(reason.into()),
            note: Some(truncate(note, MAX_NOTE_BYTES)),
            type_: Some(type_.into()),
            event_time: Some(MicroTime(now)),
            regarding: Some(reference.clone()),
            reporting_controller: Some(REPORTING_CONTROLLER.into()),
            reporting_instance: Some(self.instance.clone()),
            ..Default::default()
        };
        let api: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        if let Err(error) = api.create(&PostParams::default(), &event).await {
            tracing::warn!(%error, reason, "failed to publish an Event");
        }
    }
}

/// `text` cut to at most `max` bytes on a character boundary.
/// The name of an Event about the object named `regarding`, at `now`: `<regarding>.<hex
/// nanoseconds>`, with `regarding` cut so that the name stays a valid DNS subdomain of at most
/// 253 characters (a Lease name may have 253 itself; the Event would be refused).
fn event_name(regarding: &str, now: Timestamp) -> String {
    let suffix = format!(".{:x}", now.as_nanosecond());
    let room = MAX_NAME_BYTES - suffix.len();
    // Names are ASCII; each dot-separated part must end alphanumeric.
    let mut prefix = &regarding[..regarding.len().min(room)];
    prefix = prefix.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    if prefix.is_empty() {
        prefix = "object";
    }
    format!("{prefix}{suffix}")
}

/// Longest object name the API server takes (a DNS subdomain).
const MAX_NAME_BYTES: usize = 253;

fn truncate(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_on_character_boundaries() {
        assert_eq!(truncate("abc".into(), 5), "abc");
        let now = Timestamp::from_second(1_800_000_000).expect("timestamp");
        assert_eq!(
            event_name("shard-a", now),
            format!("shard-a.{:x}", now.as_nanosecond())
        );
        // A 253-character Lease name (the most the API server allows) leaves room for the suffix,
        // and the cut part ends alphanumeric.
        let suffix = format!(".{:x}", now.as_nanosecond());
        let room = MAX_NAME_BYTES - suffix.len();
        // The cut falls right after a '-', which may not end a part of the name.
        let long = format!(
            "{}-{}",
            "a".repeat(room - 1),
            "b".repeat(MAX_NAME_BYTES - room)
        );
        assert_eq!(long.len(), MAX_NAME_BYTES);
        assert_eq!(
            event_name(&long, now),
            format!("{}{suffix}", "a".repeat(room - 1))
        );
        assert_eq!(truncate("aé".into(), 2), "a");
    }

    #[test]
    fn one_event_per_subject_per_interval() {
        let start = Instant::now();
        let mut limiter = Limiter::new(start);
        assert!(limiter.allow("ring/ShardJoined/a", start));
        assert!(!limiter.allow("ring/ShardJoined/a", start + Duration::from_secs(9)));
        assert!(limiter.allow("ring/ShardJoined/b", start + Duration::from_secs(9)));
        assert!(limiter.allow("ring/ShardJoined/a", start + PER_SUBJECT_INTERVAL));
    }

    #[test]
    fn the_budget_caps_bursts_and_refills() {
        let start = Instant::now();
        let mut limiter = Limiter::new(start);
        let allowed = (0..1000)
            .filter(|i| limiter.allow(&format!("subject-{i}"), start))
            .count();
        assert_eq!(allowed as f64, BURST);
        // Two seconds later, ten more.
        let later = start + Duration::from_secs(2);
        let allowed = (1000..2000)
            .filter(|i| limiter.allow(&format!("subject-{i}"), later))
            .count();
        assert_eq!(allowed as f64, 2.0 * REFILL_PER_SECOND);
    }
}
