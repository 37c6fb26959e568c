//! Every version of every Secret, with its shard and drain labels, as a metadata watch of the
//! tool's own saw it: the API server's account of each handover, independent of when (or
//! whether) the shard that let go got around to logging it.
//!
//! Two uses, both in `ownership`:
//!
//! - **Dating a drain acknowledgement.** It is a patch conditioned on the version its record
//!   names, so the version that follows is its own result; a shard stopped (SIGSTOP) between the
//!   write and its record writes the record only after it resumes, long after the next shard took
//!   over, and the API server's history is not delayed by that. kube-apiserver's resourceVersions
//!   are etcd revisions, which grow with every write, so "follows" is compared as numbers.
//! - **An acknowledgement that was never logged.** A shard stopped between the write and the
//!   record, which finds its Lease lost when it resumes, drops its work at once, the responses
//!   still to be handled included: the write happened, the record never comes. The history then
//!   shows a version carrying the shard's label and the drain label followed by one without the
//!   shard's label: a drain completed (the only other writer of that step, the sharder's move of a
//!   draining object, happens only once the shard is unavailable).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::ownership::History;
use crate::ring::LabelKeys;

/// One version of one object as seen.
#[derive(Clone, Debug)]
struct Version {
    resource_version: u64,
    seen: Timestamp,
    /// Value of the shard label.
    shard: Option<String>,
    /// Whether the drain label is present.
    draining: bool,
}

/// Versions seen per `namespace/name`, in the order seen.
#[derive(Clone, Debug)]
pub(crate) struct VersionLog {
    keys: LabelKeys,
    seen: Arc<Mutex<HashMap<String, Vec<Version>>>>,
    /// How many of the watches have listed their namespace once (and so are open).
    listed: Arc<AtomicUsize>,
}

impl VersionLog {
    /// An empty log for the ring with label keys `keys`.
    pub(crate) fn new(keys: LabelKeys) -> Self {
        Self {
            keys,
            seen: Arc::default(),
            listed: Arc::default(),
        }
    }

    /// Watches the Secrets of `namespace` until `stop`, restarting after errors.
    pub(crate) async fn follow(self, client: Client, namespace: String, stop: CancellationToken) {
        // Metadata only: versions and labels are all that is needed.
        let api = Api::<PartialObjectMeta<Secret>>::namespaced(client, &namespace);
        let mut events = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        let mut listed = false;
        loop {
            let event = tokio::select! {
                () = stop.cancelled() => return,
                event = events.next() => event,
            };
            let object = match event {
                Some(Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))) => o,
                Some(Ok(watcher::Event::InitDone)) if !listed => {
                    listed = true;
                    self.listed.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Some(Ok(_) | Err(_)) => continue,
                None => return,
            };
            let Some(resource_version) = object
                .resource_version()
                .and_then(|v| v.parse::<u64>().ok())
            else {
                continue;
            };
            let labels = object.labels();
            self.record(
                &format!("{namespace}/{}", object.name_any()),
                Version {
                    resource_version,
                    seen: Timestamp::now(),
                    shard: labels.get(&self.keys.shard).cloned(),
                    draining: labels.contains_key(&self.keys.drain),
                },
            );
        }
    }

    fn record(&self, object: &str, version: Version) {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let versions = seen.entry(object.to_string()).or_default();
        // A relist repeats what was seen: only newer versions count.
        if versions
            .last()
            .is_none_or(|v| v.resource_version < version.resource_version)
        {
            versions.push(version);
        }
    }

    /// How many namespaces the watches have listed once.
    pub(crate) fn listed(&self) -> usize {
        self.listed.load(Ordering::Relaxed)
    }

    /// The shards `object` (`namespace/name`) was seen on, in order, repeats collapsed and
    /// versions without a shard skipped.
    pub(crate) fn shards_held(&self, object: &str) -> Vec<String> {
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let mut held: Vec<String> = Vec::new();
        for shard in seen
            .get(object)
            .into_iter()
            .flatten()
            .filter_map(|v| v.shard.as_ref())
        {
            if held.last() != Some(shard) {
                held.push(shard.clone());
            }
        }
        held
    }
}

impl History for VersionLog {
    fn first_after(&self, object: &str, version: u64) -> Option<Timestamp> {
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        seen.get(object)?
            .iter()
            .find(|v| v.resource_version > version)
            .map(|v| v.seen)
    }

    fn drained_away(&self, object: &str, shard: &str) -> Vec<Timestamp> {
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(versions) = seen.get(object) else {
            return Vec::new();
        };
        versions
            .windows(2)
            .filter(|pair| {
                pair[0].shard.as_deref() == Some(shard)
                    && pair[0].draining
                    && pair[1].shard.as_deref() != Some(shard)
            })
            .map(|pair| pair[1].seen)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::SignedDuration;

    fn t(s: i64) -> Timestamp {
        Timestamp::UNIX_EPOCH + SignedDuration::from_secs(s)
    }

    fn version(resource_version: u64, seen: i64, shard: Option<&str>, draining: bool) -> Version {
        Version {
            resource_version,
            seen: t(seen),
            shard: shard.map(str::to_string),
            draining,
        }
    }

    fn log() -> VersionLog {
        VersionLog::new(LabelKeys::for_ring("chaos").expect("short name"))
    }

    #[test]
    fn finds_the_first_version_after_a_given_one() {
        let log = log();
        log.record("ns/a", version(10, 1, Some("a"), false));
        log.record("ns/a", version(12, 2, Some("a"), true));
        // A relist repeats what was seen: it does not move the first sighting.
        log.record("ns/a", version(12, 3, Some("a"), true));
        log.record("ns/a", version(15, 4, Some("b"), false));
        assert_eq!(log.first_after("ns/a", 10), Some(t(2)));
        assert_eq!(log.first_after("ns/a", 11), Some(t(2)));
        assert_eq!(log.first_after("ns/a", 12), Some(t(4)));
        assert_eq!(log.first_after("ns/a", 15), None);
        assert_eq!(log.first_after("ns/b", 1), None);
    }

    /// Only a step away from the shard right after it was asked to drain counts; a move while
    /// not draining (from a dead shard, say) does not.
    #[test]
    fn finds_completed_drains() {
        let log = log();
        log.record("ns/a", version(10, 1, Some("a"), false));
        log.record("ns/a", version(11, 2, Some("b"), false));
        log.record("ns/a", version(12, 3, Some("b"), true));
        log.record("ns/a", version(13, 4, Some("a"), false));
        log.record("ns/a", version(14, 5, Some("a"), true));
        log.record("ns/a", version(15, 6, None, false));
        assert_eq!(log.drained_away("ns/a", "a"), [t(6)]);
        assert_eq!(log.drained_away("ns/a", "b"), [t(4)]);
        assert!(log.drained_away("ns/a", "c").is_empty());
        assert_eq!(log.shards_held("ns/a"), ["a", "b", "a"]);
        assert!(log.shards_held("ns/b").is_empty());
    }
}
