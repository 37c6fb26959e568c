//! A shard of a zero-write ring (docs/zero-write-rings.md): the sharder publishes the shard's
//! hash ranges on its Lease; the shard lists and watches only those ranges (through an
//! enforcing [`ShardedWatch`]), and on every new generation restarts its watches, reports the
//! objects of revoked ranges as released, cancels their reconciles in flight, waits for them
//! to end and only then acknowledges the generation on its Lease.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube_sharding_api::range_lease::{
    ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES, Acknowledgement, PublishedRanges,
    RangeAnnotationError,
};
use kube_sharding_api::ranges::{ShardField, ShardSelector};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::departure::{Departure, ObjectKey, Release};
use crate::lease::{LeaseGuard, LeaseLock};
use crate::records::{EVENT_RANGES_ACKNOWLEDGED, EVENT_RANGES_APPLIED, error_chain};
use crate::sharded_watch::ShardedWatch;

/// The zero-write part of a [`Shard`](crate::Shard): the hashed field, the enforcing handle of
/// the ring's resource and the reconciles in flight. Clones share the state.
#[derive(Clone)]
pub(crate) struct ServerSide {
    pub(crate) field: ShardField,
    pub(crate) watch: ShardedWatch,
    in_flight: Arc<InFlight>,
}

impl fmt::Debug for ServerSide {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerSide")
            .field("field", &self.field)
            .field("selector", &self.watch.selector())
            .finish_non_exhaustive()
    }
}

impl PartialEq for ServerSide {
    fn eq(&self, other: &Self) -> bool {
        self.field == other.field && self.watch.same(&other.watch)
    }
}

impl Eq for ServerSide {}

/// What a version of the shard's own Lease asks of it: the ranges to run with, when they are
/// of a newer generation than `applied` (the one it runs with, `None` at the start of a term).
/// Older and equal generations are ignored: a watch may show versions out of date.
pub(crate) fn newer_ranges(
    applied: Option<u64>,
    annotations: Option<&BTreeMap<String, String>>,
) -> Result<Option<PublishedRanges>, RangeAnnotationError> {
    let Some(text) = annotations.and_then(|a| a.get(ANNOTATION_RANGES)) else {
        return Ok(None);
    };
    let published: PublishedRanges = text.parse()?;
    Ok(applied
        .is_none_or(|applied| published.generation() > applied)
        .then_some(published))
}

impl ServerSide {
    pub(crate) fn new(field: ShardField, watch: ShardedWatch) -> Self {
        Self {
            field,
            watch,
            in_flight: Arc::new(InFlight::default()),
        }
    }

    /// Forgets the ranges (a new term starts with none); the objects held are released.
    pub(crate) fn reset(&self) {
        for object in self.watch.revoke_to(None) {
            self.watch.announce(Departure::Released {
                object,
                how: Release::RangeRevoked,
            });
        }
    }

    /// Registers a reconcile of the object `meta` about to start, so that a revocation of its
    /// range cancels it and waits for it.
    pub(crate) fn register(&self, meta: &ObjectMeta) -> InFlightGuard {
        self.in_flight.register(ObjectKey::of(meta))
    }

    /// Runs with `published`: the new selector, the watches restarted, the objects out of
    /// range released, their reconciles cancelled and ended.
    async fn apply(&self, shard: &str, published: &PublishedRanges) {
        let started = std::time::Instant::now();
        let selector = ShardSelector::new(self.field, published.ranges().clone());
        let released = self.watch.revoke_to(selector);
        let count = released.len();
        for object in released {
            self.watch.announce(Departure::Released {
                object,
                how: Release::RangeRevoked,
            });
        }
        let cancelled = self.in_flight.cancel_unselected(&self.watch).await;
        info!(
            event = EVENT_RANGES_APPLIED,
            %shard,
            generation = published.generation(),
            ranges = published.ranges().ranges().len(),
            share = published.ranges().share(),
            released = count,
            cancelled,
            took_ms = started.elapsed().as_secs_f64() * 1e3,
            "running with new ranges"
        );
    }

    /// Follows the shard's own Lease for the rest of the term: every newer generation of
    /// ranges is applied and then acknowledged at once (see the module docs). Never ends.
    pub(crate) fn follow(
        &self,
        lock: &LeaseLock,
        guard: LeaseGuard,
        shard: String,
    ) -> impl Future<Output = ()> + Send + 'static {
        let mut versions = lock.changes();
        let lock = lock.clone();
        let this = self.clone();
        let identity = lock.config().identity().to_string();
        async move {
            let mut applied: Option<u64> = None;
            let mut last_error: Option<String> = None;
            while let Some(lease) = versions.next().await {
                if guard.check().is_err() {
                    break;
                }
                let holder = lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.as_deref());
                if holder != Some(identity.as_str()) {
                    continue;
                }
                let annotations = lease.metadata.annotations.as_ref();
                let published = match newer_ranges(applied, annotations) {
                    Ok(Some(published)) => published,
                    Ok(None) => continue,
                    Err(error) => {
                        let text = error.to_string();
                        if last_error.as_ref() != Some(&text) {
                            warn!(%shard, error = %text, "ignoring malformed ranges on the shard's Lease");
                            last_error = Some(text);
                        }
                        continue;
                    }
                };
                let seen = std::time::Instant::now();
                let generation = published.generation();
                this.apply(&shard, &published).await;
                applied = Some(generation);
                let acknowledged = annotations
                    .and_then(|a| a.get(ANNOTATION_ACKNOWLEDGED))
                    .and_then(|a| a.parse::<Acknowledgement>().ok());
                if acknowledged.is_some_and(|a| a.generation == generation) {
                    continue;
                }
                acknowledge(&lock, &guard, &shard, generation).await;
                info!(
                    event = EVENT_RANGES_ACKNOWLEDGED,
                    %shard,
                    generation,
                    took_ms = seen.elapsed().as_secs_f64() * 1e3,
                    "acknowledged ranges"
                );
            }
            std::future::pending::<()>().await;
        }
    }
}

/// Writes the acknowledgement of `generation`, retrying failures while the guard holds; gives
/// up when a newer generation is on the Lease (it is acknowledged next).
async fn acknowledge(lock: &LeaseLock, guard: &LeaseGuard, shard: &str, generation: u64) {
    let value = Acknowledgement { generation }.to_string();
    let current = |annotations: &BTreeMap<String, String>| {
        annotations
            .get(ANNOTATION_RANGES)
            .and_then(|r| r.parse::<PublishedRanges>().ok())
            .is_none_or(|r| r.generation() <= generation)
    };
    let mut backoff = Duration::from_millis(100);
    while guard.check().is_ok() {
        match lock
            .annotate_held(ANNOTATION_ACKNOWLEDGED, &value, current)
            .await
        {
            Ok(_) => return,
            Err(error) => {
                warn!(%shard, generation, error = %error_chain(&error), "failed to acknowledge ranges, retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// A backoff for `Controller::trigger_backoff` on a zero-write ring: the first retry after a
/// success comes at once, later ones as kube's default (from 0.8 s, doubling, with jitter).
///
/// A new generation of ranges ends the controller's watch with a 410 event, which kube's
/// watcher reports as an error before it lists again; with kube's default backoff every such
/// restart waits 0.8 to 1.6 s before the list. With this one it lists at once, and a server that
/// keeps failing is still backed off.
#[derive(Default)]
pub struct RestartBackoff {
    retried: bool,
    inner: kube::runtime::watcher::DefaultBackoff,
}

impl fmt::Debug for RestartBackoff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RestartBackoff")
            .field("retried", &self.retried)
            .finish_non_exhaustive()
    }
}

impl Iterator for RestartBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        if self.retried {
            self.inner.next()
        } else {
            self.retried = true;
            Some(Duration::ZERO)
        }
    }
}

impl kube::runtime::utils::Backoff for RestartBackoff {
    fn reset(&mut self) {
        self.retried = false;
        self.inner.reset();
    }
}

/// The reconciles in flight on a zero-write ring.
#[derive(Debug, Default)]
struct InFlight {
    next: AtomicU64,
    entries: Mutex<HashMap<u64, (ObjectKey, CancellationToken)>>,
    ended: Notify,
}

/// Held by a reconcile in flight: its token is cancelled when the object's range is revoked;
/// dropping it (the reconcile ended or was dropped) tells the revocation.
#[derive(Debug)]
pub(crate) struct InFlightGuard {
    id: u64,
    registry: Arc<InFlight>,
    pub(crate) token: CancellationToken,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.registry.entries().remove(&self.id);
        self.registry.ended.notify_waiters();
    }
}

impl InFlight {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (ObjectKey, CancellationToken)>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn register(self: &Arc<Self>, key: ObjectKey) -> InFlightGuard {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let token = CancellationToken::new();
        self.entries().insert(id, (key, token.clone()));
        InFlightGuard {
            id,
            registry: Arc::clone(self),
            token,
        }
    }

    /// Cancels the reconciles of objects `watch` no longer selects and waits until they have
    /// ended; returns how many there were.
    async fn cancel_unselected(&self, watch: &ShardedWatch) -> usize {
        let mut cancelled = std::collections::HashSet::new();
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let outside: Vec<(u64, CancellationToken)> = self
                .entries()
                .iter()
                .filter(|(_, (key, _))| !watch.selects_key(key))
                .map(|(id, (_, token))| (*id, token.clone()))
                .collect();
            if outside.is_empty() {
                return cancelled.len();
            }
            for (id, token) in outside {
                token.cancel();
                cancelled.insert(id);
            }
            ended.await;
        }
    }
}

#[cfg(test)]
mod tests;
