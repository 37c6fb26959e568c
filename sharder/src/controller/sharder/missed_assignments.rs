//! The missed-assignment path of the sharder controller (docs/protocol.md §9, "fast path").
//!
//! The webhook uses `failurePolicy: Ignore`, so objects created while no sharder is reachable stay
//! unassigned. A metadata-only watch per ring resource on objects *without* the shard label moves
//! them within seconds, so the webhook assigns them; the periodic sync stays the safety net. The
//! watch caches nothing, so memory does not grow with the number of objects.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use std::time::Duration;

use futures::StreamExt;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, ObjectMeta};
use kube::core::{ApiResource, PartialObjectMeta};
use kube::runtime::utils::Backoff;
use kube::runtime::{WatchStreamExt, watcher};
use sharding_crds::{GroupResource, RingRef};
use tokio::sync::Semaphore;
use tokio::task::{AbortHandle, JoinSet};

use super::patch::{PatchError, Patcher, api_resource};
use crate::core::rebalance::RebalanceDecision;
use crate::views::RingView;

/// Concurrent patches per watched resource.
const CONCURRENCY: usize = 16;
/// First delay before a failed move, or the watch after an error, is tried again.
const RETRY_INITIAL: Duration = Duration::from_millis(500);
/// Longest delay between two tries: short enough that an object missed during a webhook outage
/// is assigned within a few seconds of its end, and that the watch is back within a few seconds
/// of an API server restart.
const RETRY_MAX: Duration = Duration::from_secs(4);
/// How often an object whose move is held back (the ring's webhook unreachable) asks again; one
/// of them becomes the probe when it is due.
const HELD_WAIT: Duration = Duration::from_millis(500);

/// The running watches, one per ring resource. They are tasks of a `JoinSet` this value owns, so
/// dropping it (the sharder controller stopped, or dropped on lost leadership) stops them all.
#[derive(Debug, Default)]
pub(super) struct MissedAssignments {
    tasks: JoinSet<()>,
    /// By ring, resource and the version watched: a new version means a new watch.
    running: HashMap<(RingRef, GroupResource, String), AbortHandle>,
}

impl MissedAssignments {
    /// Starts a watch for every resource of every ring and stops those no longer needed.
    pub(super) fn reconcile(&mut self, patcher: &Patcher, views: &[Arc<RingView>]) {
        // A watch ends on its own only when its ring or resource went away; reap it.
        while self.tasks.try_join_next().is_some() {}
        let wanted: HashSet<(RingRef, GroupResource, String)> = views
            .iter()
            .flat_map(|v| {
                v.resources
                    .iter()
                    .map(|(gr, r)| (v.ring_ref(), gr.clone(), r.info.version.clone()))
            })
            .collect();
        self.running.retain(|key, task| {
            let keep = wanted.contains(key) && !task.is_finished();
            if !keep {
                task.abort();
            }
            keep
        });
        for key in wanted {
            if self.running.contains_key(&key) {
                continue;
            }
            let task = self.tasks.spawn(watch_unassigned(
                patcher.clone(),
                key.0.clone(),
                key.1.clone(),
            ));
            self.running.insert(key, task);
        }
    }

    /// Stops every watch.
    pub(super) fn stop(&mut self) {
        self.running.clear();
        self.tasks.abort_all();
    }
}

/// Watches objects of one ring resource that lack the shard label and moves them, so the webhook
/// assigns them.
///
/// The watch survives errors (the watcher re-lists with [`RetryBackoff`], after an API server
/// restart too), and a move that does not end with the object assigned (the webhook unreachable, a
/// conflict) is retried with backoff until the object is assigned or gone: objects missed during a
/// webhook outage are assigned within seconds of its end, not at the next periodic sync. Objects of
/// the initial listing count as well: after a re-list they are exactly those missed meanwhile.
async fn watch_unassigned(patcher: Patcher, ring: RingRef, gr: GroupResource) {
    let ctx = &patcher.ctx;
    let Some(view) = ctx.views.get(&ring) else {
        return;
    };
    let Some(resource) = view.resources.get(&gr) else {
        return;
    };
    let ar = api_resource(&gr, &resource.info);
    // `PartialObjectMeta` makes the watch metadata-only.
    let api: Api<PartialObjectMeta<DynamicObject>> = Api::all_with(ctx.client.clone(), &ar);
    let config = watcher::Config::default().labels(&format!("!{}", view.shard_label));
    let events = watcher::watcher(api, config).backoff(RetryBackoff::default());
    futures::pin_mut!(events);
    let backlog = ctx
        .metrics
        .missed_assignment_backlog
        .get_or_create(&crate::metrics::Metrics::resource_labels(
            &ring,
            &gr.group,
            &gr.resource,
        ))
        .clone();
    let limit = Arc::new(Semaphore::new(CONCURRENCY));
    // One task per object being assigned, owned here: they stop with the watch.
    let mut assigning: JoinSet<ObjectKey> = JoinSet::new();
    let mut pending: HashSet<ObjectKey> = HashSet::new();
    loop {
        let event = tokio::select! {
            Some(done) = assigning.join_next(), if !assigning.is_empty() => {
                if let Ok(key) = done {
                    pending.remove(&key);
                }
                backlog.set(i64::try_from(pending.len()).unwrap_or(i64::MAX));
                continue;
            }
            event = events.next() => event,
        };
        let obj = match event {
            None => return,
            Some(Ok(watcher::Event::Apply(obj) | watcher::Event::InitApply(obj))) => obj,
            Some(Ok(_)) => continue,
            Some(Err(error)) => {
                tracing::warn!(%error, %ring, resource = %gr, "missed-assignment watch failed, retrying with backoff");
                if let watcher::Error::InitialListFailed(kube::Error::Api(status))
                | watcher::Error::WatchStartFailed(kube::Error::Api(status)) = &error
                    && status.code == 404
                {
                    // The version is not served any more: the view is rebuilt with the one
                    // discovered now, and a watch of that version replaces this one.
                    ctx.discovery.forget(&gr);
                }
                continue;
            }
        };
        // Without a shard label, a drain it may have had was acknowledged.
        ctx.observed
            .unassigned_seen(&ring, obj.metadata.uid.as_deref().unwrap_or_default());
        let key = ObjectKey {
            namespace: obj.metadata.namespace.clone(),
            name: obj.name_any(),
        };
        if !pending.insert(key.clone()) {
            // Already being assigned; that task reads the object afresh on each attempt.
            continue;
        }
        backlog.set(i64::try_from(pending.len()).unwrap_or(i64::MAX));
        let (patcher, ring, gr, ar, limit) = (
            patcher.clone(),
            ring.clone(),
            gr.clone(),
            ar.clone(),
            limit.clone(),
        );
        assigning.spawn(async move {
            assign(&patcher, &ring, &gr, &ar, &limit, obj.metadata).await;
            key
        });
    }
}

/// Delays between tries, from [`RETRY_INITIAL`] doubling up to [`RETRY_MAX`]: of a move that did
/// not end with the object assigned, and of the watch after an error (reset by every event).
///
/// Not kube's default watch backoff (client-go's: 800 ms doubling, with jitter, up to 30 s):
/// errors pile up while an API server restarts (refused connections, then an expired resource
/// version once it is back), and after three or four of them that backoff waits 3 to 13 s more
/// before watching again, so objects missed just after the restart could wait longer than the
/// 10 s the fast path promises. One watch per ring resource, on the leader only, asks little of a
/// struggling API server even every 4 s.
#[derive(Debug)]
struct RetryBackoff {
    next: Duration,
}

impl Default for RetryBackoff {
    fn default() -> Self {
        Self {
            next: RETRY_INITIAL,
        }
    }
}

impl RetryBackoff {
    /// The delay before the next try.
    fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (delay * 2).min(RETRY_MAX);
        delay
    }
}

impl Iterator for RetryBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.next_delay())
    }
}

impl Backoff for RetryBackoff {
    fn reset(&mut self) {
        self.next = RETRY_INITIAL;
    }
}

/// Namespace and name of an object being assigned.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct ObjectKey {
    namespace: Option<String>,
    name: String,
}

/// Moves one unassigned object until the webhook has assigned it, it is gone, or it needs no
/// move any more, retrying with [`RetryBackoff`].
async fn assign(
    patcher: &Patcher,
    ring: &RingRef,
    gr: &GroupResource,
    ar: &ApiResource,
    limit: &Semaphore,
    mut meta: ObjectMeta,
) {
    let ctx = &patcher.ctx;
    let mut backoff = RetryBackoff::default();
    loop {
        // Always decide with the current view: shards may have changed meanwhile.
        let Some(view) = ctx.views.get(ring) else {
            return;
        };
        let Some(resource) = view.resources.get(gr) else {
            return;
        };
        if resource.info.namespaced
            && !meta
                .namespace
                .as_deref()
                .is_some_and(|ns| ctx.caches.namespace_selected(&view.namespace_selector, ns))
        {
            return;
        }
        let decision = view.placement(&gr.group, resource, &meta).decision;
        if decision == RebalanceDecision::Keep {
            return;
        }
        let result = {
            let Ok(_permit) = limit.acquire().await else {
                return;
            };
            patcher.patch(&view, gr, ar, &meta, decision).await
        };
        let delay = match result {
            Ok(()) => {
                patcher.count(&view, gr, decision);
                return;
            }
            Err(PatchError::Held) => {
                // Nothing was sent and the object is as read: wait for the webhook, without
                // reading it again (thousands of objects may be waiting).
                tokio::time::sleep(HELD_WAIT).await;
                continue;
            }
            Err(error) => {
                let delay = backoff.next_delay();
                tracing::debug!(%error, object = %meta.name.as_deref().unwrap_or_default(), retry_in = ?delay, "missed-assignment move failed, retrying");
                delay
            }
        };
        tokio::time::sleep(delay).await;
        // Read the object afresh: a new resourceVersion, or assigned or deleted meanwhile.
        let api: Api<DynamicObject> = match &meta.namespace {
            Some(ns) => Api::namespaced_with(ctx.client.clone(), ns, ar),
            None => Api::all_with(ctx.client.clone(), ar),
        };
        match api
            .get_metadata_opt(meta.name.as_deref().unwrap_or_default())
            .await
        {
            Ok(Some(current)) => meta = current.metadata,
            Ok(None) => return,
            Err(kube::Error::Api(status)) if status.code == 403 => {
                // Retrying with what we read before would conflict forever: leave the object
                // to the periodic sync, which lists instead.
                tracing::warn!(
                    %ring,
                    resource = %gr,
                    "the sharder may not get objects of this resource (grant get in the ring's \
                     ClusterRole); leaving an unassigned object to the periodic sync"
                );
                return;
            }
            Err(error) => {
                tracing::debug!(%error, "failed to read an unassigned object, retrying");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_double_up_to_the_cap_and_start_over_on_reset() {
        let mut backoff = RetryBackoff::default();
        let delays: Vec<Duration> = backoff.by_ref().take(6).collect();
        let ms = Duration::from_millis;
        assert_eq!(
            delays,
            [ms(500), ms(1000), ms(2000), ms(4000), ms(4000), ms(4000)]
        );
        backoff.reset();
        assert_eq!(backoff.next(), Some(RETRY_INITIAL));
    }
}
