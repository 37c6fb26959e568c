//! A record of who held each shard Lease when, as the API server told a watch of the tool's own:
//! evidence, independent of the shards' logs, that a shard lost its Lease (the sharder took it
//! over) or gave it up.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

/// Label every shard Lease of a ring carries (docs/protocol.md §2).
const LABEL_CLUSTER_RING: &str = "alpha.sharding.timebertt.dev/clusterring";

/// One change of a shard Lease's holder, as observed.
#[derive(Clone, Debug)]
pub(crate) struct HolderChange {
    /// When the tool's watch delivered it (the API server has no write time for a release).
    pub(crate) observed: Timestamp,
    /// The Lease's name, which is the shard's.
    pub(crate) shard: String,
    /// The new holder: empty when released, `None` when the Lease was deleted.
    pub(crate) holder: Option<String>,
    /// `spec.leaseTransitions` of that version.
    pub(crate) transitions: i32,
}

/// Watches a ring's shard Leases in one namespace and records every holder change.
#[derive(Clone, Debug, Default)]
pub(crate) struct LeaseLog {
    changes: Arc<Mutex<Vec<HolderChange>>>,
    /// Set once the first listing is in: the watch is open.
    listed: Arc<AtomicBool>,
}

impl LeaseLog {
    /// Watches until `stop`; the watch restarts by itself after errors (API server restarts).
    pub(crate) async fn follow(
        self,
        client: Client,
        namespace: String,
        ring: String,
        stop: CancellationToken,
    ) {
        let api = Api::<Lease>::namespaced(client, &namespace);
        let config = watcher::Config::default().labels(&format!("{LABEL_CLUSTER_RING}={ring}"));
        let mut events = watcher(api, config).default_backoff().boxed();
        // Last (holder, transitions) seen per Lease: only changes are recorded.
        let mut last: BTreeMap<String, (Option<String>, i32)> = BTreeMap::new();
        loop {
            let event = tokio::select! {
                () = stop.cancelled() => return,
                event = events.next() => event,
            };
            let (lease, deleted) = match event {
                Some(Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l))) => (l, false),
                Some(Ok(watcher::Event::Delete(l))) => (l, true),
                Some(Ok(watcher::Event::InitDone)) => {
                    self.listed.store(true, Ordering::Relaxed);
                    continue;
                }
                Some(Ok(_) | Err(_)) => continue,
                None => return,
            };
            let name = lease.name_any();
            let spec = lease.spec.unwrap_or_default();
            let state = (
                if deleted {
                    None
                } else {
                    Some(spec.holder_identity.unwrap_or_default())
                },
                spec.lease_transitions.unwrap_or(0),
            );
            if last.get(&name) != Some(&state) {
                self.changes
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(HolderChange {
                        observed: Timestamp::now(),
                        shard: name.clone(),
                        holder: state.0.clone(),
                        transitions: state.1,
                    });
                last.insert(name, state);
            }
        }
    }

    /// Whether the watch has listed the Leases once (and so is open).
    pub(crate) fn is_listed(&self) -> bool {
        self.listed.load(Ordering::Relaxed)
    }

    /// Every change recorded so far, in the order observed.
    pub(crate) fn changes(&self) -> Vec<HolderChange> {
        self.changes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}
