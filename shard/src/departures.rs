//! The watch that reports objects leaving the shard, told apart from deleted ones
//! ([`Shard::departures`], [`Departures`]).

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use crate::Shard;
use crate::departure::{Departure, ObjectKey, Release};
use crate::records::error_chain;
use crate::shard::Disposition;

/// An object that left the watch, not yet classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) object: ObjectKey,
    /// How it left if it turns out to exist.
    pub(crate) how: Release,
}

/// What the tracker remembers of an object on the watch.
#[derive(Debug, Clone)]
struct Seen {
    key: ObjectKey,
    draining: bool,
}

/// The pure core: follows watcher events and says which objects left the watch.
#[derive(Debug)]
pub(crate) struct Tracker {
    drain_label_key: String,
    /// Objects on the watch, by `(namespace, name)`.
    present: BTreeMap<(Option<String>, String), Seen>,
    /// Objects listed since the current `Init`, while a (re-)list runs.
    listing: Option<BTreeMap<(Option<String>, String), Seen>>,
}

impl Tracker {
    pub(crate) fn new(drain_label_key: &str, known: impl IntoIterator<Item = ObjectKey>) -> Self {
        let present = known
            .into_iter()
            .map(|key| {
                let seen = Seen {
                    key,
                    draining: false,
                };
                (seen.key.slot(), seen)
            })
            .collect();
        Self {
            drain_label_key: drain_label_key.to_string(),
            present,
            listing: None,
        }
    }

    fn seen(&self, meta: &ObjectMeta) -> Seen {
        Seen {
            key: ObjectKey::of(meta),
            draining: meta
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key(&self.drain_label_key)),
        }
    }

    /// The objects that left the watch with this event.
    pub(crate) fn apply(&mut self, event: &watcher::Event<ObjectMeta>) -> Vec<Candidate> {
        match event {
            watcher::Event::Apply(meta) => {
                let seen = self.seen(meta);
                let replaced = self.present.insert(seen.key.slot(), seen.clone());
                // Same name, new UID: the old object was deleted in between.
                match replaced {
                    Some(old) if old.key.uid.is_some() && old.key.uid != seen.key.uid => {
                        vec![Candidate {
                            object: old.key,
                            how: Release::Reassigned,
                        }]
                    }
                    _ => Vec::new(),
                }
            }
            watcher::Event::Delete(meta) => {
                // The API server sends the object as it was before it stopped matching: with
                // the drain label when this shard's acknowledgement removed its labels.
                let seen = self.seen(meta);
                self.present.remove(&seen.key.slot());
                vec![Candidate {
                    how: if seen.draining {
                        Release::Drained
                    } else {
                        Release::Reassigned
                    },
                    object: seen.key,
                }]
            }
            watcher::Event::Init => {
                self.listing = Some(BTreeMap::new());
                Vec::new()
            }
            watcher::Event::InitApply(meta) => {
                let seen = self.seen(meta);
                self.listing
                    .get_or_insert_default()
                    .insert(seen.key.slot(), seen);
                Vec::new()
            }
            watcher::Event::InitDone => {
                let listed = self.listing.take().unwrap_or_default();
                let before = std::mem::replace(&mut self.present, listed);
                before
                    .into_iter()
                    .filter_map(|(slot, old)| {
                        let now = self.present.get(&slot);
                        let same = now.is_some_and(|n| {
                            old.key.uid.is_none() || n.key.uid.is_none() || n.key.uid == old.key.uid
                        });
                        (!same).then_some(Candidate {
                            how: if old.draining {
                                Release::Drained
                            } else {
                                Release::FoundMoved
                            },
                            object: old.key,
                        })
                    })
                    .collect()
            }
        }
    }
}

/// Classifies a candidate from the object's current metadata (`None`: it does not exist).
pub(crate) fn classify(
    shard: &Shard,
    candidate: Candidate,
    current: Option<&ObjectMeta>,
) -> Option<Departure> {
    let Some(meta) = current else {
        return Some(Departure::Deleted {
            object: candidate.object,
        });
    };
    if candidate.object.uid.is_some() && meta.uid != candidate.object.uid {
        return Some(Departure::Deleted {
            object: candidate.object,
        });
    }
    match shard.classify(meta) {
        // Back on this shard (or never really gone): no departure.
        Disposition::Reconcile | Disposition::Drain => None,
        Disposition::Ignore => Some(Departure::Released {
            object: candidate.object,
            how: candidate.how,
        }),
    }
}

/// A watch of one resource's objects on this shard that reports [`Departure`]s. Made by
/// [`Shard::departures`]; run it with [`Departures::stream`].
///
/// A shard's watches select its shard label, so the API server reports an object that moved to
/// another shard exactly like one that was deleted: a DELETED event (carrying the object as it
/// was before it stopped matching). After a watch restart (a re-list) there is not even that:
/// the object is simply missing. A controller that keeps local state per object (a cache, a
/// connection, a metric series) must drop it in both cases but usually handles them
/// differently: a deleted object's external resources are cleaned up, a released object's are
/// left for its new shard.
///
/// [`Shard::departures`] watches the shard's objects of one resource and, for every object that
/// leaves the watch, asks the API server (one GET by name, without the label selector) which it
/// was:
///
/// - the object is gone, or a different object (another UID) carries its name:
///   [`Departure::Deleted`];
/// - the object exists without this shard's label: [`Departure::Released`], with how it left
///   ([`Release`]);
/// - the object exists with this shard's label again (it came back meanwhile): nothing.
///
/// Objects the controller knew from before the watch started (its state from an earlier
/// membership term, say) are passed with [`Departures::with_known`]; those missing from the
/// first listing are reported the same way.
#[derive(Debug, Clone)]
#[must_use]
pub struct Departures<K: Resource + Clone> {
    shard: Shard,
    api: Api<K>,
    known: Vec<ObjectKey>,
}

/// Longest pause between attempts to read a departed object.
const MAX_READ_BACKOFF: Duration = Duration::from_secs(5);

impl<K> Departures<K>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default + Clone + Eq + std::hash::Hash + Send + Sync,
{
    /// Objects the controller holds state for from before this watch (its previous term, or
    /// state it persisted): any not listed by the first listing is reported too, as
    /// [`Release::FoundMoved`] or [`Departure::Deleted`].
    pub fn with_known(mut self, known: impl IntoIterator<Item = ObjectKey>) -> Self {
        self.known.extend(known);
        self
    }

    /// The departures, in the order the watch saw the objects leave; runs until dropped.
    ///
    /// It opens one more watch of the resource (label-selected like the controller's) and
    /// sends one GET per departed object; a failing read is retried (backing off to 5 s)
    /// before later departures are reported. Watch errors are retried with kube's default
    /// backoff and logged at debug level.
    ///
    /// **Sharp edge:** the watch is not the controller's, so a departure may be reported a
    /// moment before or after the controller's own cache drops the object. Reconciles of the
    /// object cannot race it on a drain (the drain is acknowledged by the wrapper, after which
    /// nothing of it runs) but can on a direct reassignment after a Lease loss, which only
    /// happens once this shard stopped.
    ///
    /// On a zero-write ring ([`Shard::server_side`]) it opens no watch: the departures come
    /// from the shard's own selector layer, which reports the objects of revoked ranges as
    /// [`Release::RangeRevoked`] before the revocation is acknowledged, and objects deleted
    /// while the shard held them; `with_known` has no effect there. Subscribe (call this)
    /// before the term's work runs: departures before that are not kept.
    pub fn stream(self) -> impl Stream<Item = Departure> + Send + 'static {
        if let Some(receiver) = self
            .shard
            .sharded_watch()
            .and_then(|watch| watch.subscribe_departures())
        {
            return futures::stream::unfold(receiver, |mut receiver| async move {
                loop {
                    match receiver.recv().await {
                        Ok(departure) => return Some((departure, receiver)),
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => {
                            warn!(missed, "departures consumer too slow, some were dropped");
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
                    }
                }
            })
            .left_stream();
        }
        let Self { shard, api, known } = self;
        let mut tracker = Tracker::new(shard.drain_label_key(), known);
        let client = api.clone().into_client();
        watcher::watcher(api.clone(), shard.watcher_config())
            .default_backoff()
            .filter_map(|event| async move {
                match event {
                    Ok(event) => Some(event),
                    Err(error) => {
                        debug!(error = %error_chain(&error), "departures watch failed, retrying");
                        None
                    }
                }
            })
            .map(move |event| futures::stream::iter(tracker.apply(&metadata_of(event))))
            .flatten()
            .then(move |candidate| {
                let (client, shard) = (client.clone(), shard.clone());
                async move {
                    let current = read::<K>(client, &candidate.object).await;
                    classify(&shard, candidate, current.as_ref())
                }
            })
            .filter_map(futures::future::ready)
            .right_stream()
    }
}

/// The event with only the objects' metadata, which is all the tracker needs.
fn metadata_of<K: Resource>(event: watcher::Event<K>) -> watcher::Event<ObjectMeta> {
    match event {
        watcher::Event::Apply(object) => watcher::Event::Apply(object.meta().clone()),
        watcher::Event::Delete(object) => watcher::Event::Delete(object.meta().clone()),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(object) => watcher::Event::InitApply(object.meta().clone()),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// The object's current metadata (`None` if it does not exist), retrying failed reads.
async fn read<K>(client: kube::Client, object: &ObjectKey) -> Option<ObjectMeta>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    let resource = ApiResource::erase::<K>(&K::DynamicType::default());
    // Without the shard's label selector, and in the object's own namespace.
    let api = match &object.namespace {
        Some(namespace) => Api::<DynamicObject>::namespaced_with(client, namespace, &resource),
        None => Api::<DynamicObject>::all_with(client, &resource),
    };
    let mut backoff = Duration::from_millis(200);
    loop {
        match api.get_opt(&object.name).await {
            Ok(found) => return found.map(|o| o.metadata),
            Err(error) => {
                warn!(error = %error_chain(&error), %object, "failed to read a departed object, retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_READ_BACKOFF);
            }
        }
    }
}

impl Shard {
    /// A watch of this shard's objects of `api`'s resource that reports objects leaving the
    /// shard, told apart from deleted ones (see [`Departure`]). Run it next to the controller,
    /// under the same Lease (inside [`Shard::run`]'s work), and drop local state on each
    /// departure.
    ///
    /// `api` may be namespaced (only that namespace's objects) or cover all namespaces.
    pub fn departures<K>(&self, api: Api<K>) -> Departures<K>
    where
        K: Resource + Clone,
    {
        Departures {
            shard: self.clone(),
            api,
            known: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests;
