//! When each version of each Secret appeared, as a metadata watch of the tool's own saw it:
//! evidence of when a shard's drain acknowledgement took effect, independent of when the shard
//! got around to logging it. A shard stopped (SIGSTOP) between sending the acknowledgement and
//! logging it writes the record only after it resumes, long after the next shard took over; the
//! API server's history of the object is not delayed by that.
//!
//! A drain acknowledgement is a patch conditioned on the version it read (its record carries that
//! `resourceVersion`), so the version that follows it in the object's history is the
//! acknowledgement's own result. kube-apiserver's resourceVersions are etcd revisions, which
//! grow with every write, so "follows" is compared as numbers.

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

/// `(resourceVersion, when seen)` of one object, in the order seen.
type Versions = Vec<(u64, Timestamp)>;

/// Versions seen per `namespace/name`.
#[derive(Clone, Debug, Default)]
pub(crate) struct VersionLog {
    seen: Arc<Mutex<HashMap<String, Versions>>>,
    /// How many of the watches have listed their namespace once (and so are open).
    listed: Arc<AtomicUsize>,
}

impl VersionLog {
    /// Watches the Secrets of `namespace` until `stop`, restarting after errors.
    pub(crate) async fn follow(self, client: Client, namespace: String, stop: CancellationToken) {
        // Metadata only: the versions are all that is needed.
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
            let Some(version) = object
                .resource_version()
                .and_then(|v| v.parse::<u64>().ok())
            else {
                continue;
            };
            self.record(
                &format!("{namespace}/{}", object.name_any()),
                version,
                Timestamp::now(),
            );
        }
    }

    fn record(&self, object: &str, version: u64, at: Timestamp) {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let versions = seen.entry(object.to_string()).or_default();
        if versions.last().is_none_or(|(v, _)| *v < version) {
            versions.push((version, at));
        }
    }

    /// How many namespaces the watches have listed once.
    pub(crate) fn listed(&self) -> usize {
        self.listed.load(Ordering::Relaxed)
    }

    /// When the tool first saw a version of `object` later than `version`, if it did.
    pub(crate) fn first_after(&self, object: &str, version: u64) -> Option<Timestamp> {
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        seen.get(object)?
            .iter()
            .find(|(v, _)| *v > version)
            .map(|(_, at)| *at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::SignedDuration;

    #[test]
    fn finds_the_first_version_after_a_given_one() {
        let log = VersionLog::default();
        let t = |s: i64| Timestamp::UNIX_EPOCH + SignedDuration::from_secs(s);
        log.record("ns/a", 10, t(1));
        log.record("ns/a", 12, t(2));
        // A relist repeats what was seen: it does not move the first sighting.
        log.record("ns/a", 12, t(3));
        log.record("ns/a", 15, t(4));
        assert_eq!(log.first_after("ns/a", 10), Some(t(2)));
        assert_eq!(log.first_after("ns/a", 11), Some(t(2)));
        assert_eq!(log.first_after("ns/a", 12), Some(t(4)));
        assert_eq!(log.first_after("ns/a", 15), None);
        assert_eq!(log.first_after("ns/b", 1), None);
    }
}
