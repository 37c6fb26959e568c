//! The missed-assignment path of the sharder controller (SPEC §9, "fast path").
//!
//! The webhook uses `failurePolicy: Ignore`, so objects created while no sharder is reachable stay
//! unassigned. A metadata-only watch per ring resource on objects *without* the shard label moves
//! them within seconds, so the webhook assigns them; the periodic sync stays the safety net. The
//! watch caches nothing, so memory does not grow with the number of objects.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::TryStreamExt;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject};
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use sharding_crds::GroupResource;
use tokio::task::{AbortHandle, JoinSet};

use super::sharder::{api_resource, count, decide_object, namespace_selected, patch};
use crate::context::Context;
use crate::core::rebalance::RebalanceDecision;
use crate::ring_views::RingView;

/// Concurrent patches per watched resource.
const CONCURRENCY: usize = 16;

/// The running watches, one per ring resource. They are tasks of a `JoinSet` this value owns, so
/// dropping it (the sharder controller stopped, or dropped on lost leadership) stops them all.
#[derive(Debug, Default)]
pub(crate) struct MissedAssignments {
    tasks: JoinSet<()>,
    running: HashMap<(String, GroupResource), AbortHandle>,
}

impl MissedAssignments {
    /// Starts a watch for every resource of every ring and stops those no longer needed.
    pub(crate) fn reconcile(&mut self, ctx: &Context, views: &[Arc<RingView>]) {
        // Reap watches that ended on their own; they stay listed, as they always did, so they
        // are not restarted until their ring resource goes away and comes back.
        while self.tasks.try_join_next().is_some() {}
        let wanted: HashSet<(String, GroupResource)> = views
            .iter()
            .flat_map(|v| v.resources.keys().map(|gr| (v.name.clone(), gr.clone())))
            .collect();
        self.running.retain(|key, task| {
            let keep = wanted.contains(key);
            if !keep {
                task.abort();
            }
            keep
        });
        for key in wanted {
            if self.running.contains_key(&key) {
                continue;
            }
            let task =
                self.tasks
                    .spawn(watch_unassigned(ctx.clone(), key.0.clone(), key.1.clone()));
            self.running.insert(key, task);
        }
    }

    /// Stops every watch.
    pub(crate) fn stop(&mut self) {
        self.running.clear();
        self.tasks.abort_all();
    }
}

/// Watches objects of one ring resource that lack the shard label and moves them, so the webhook
/// assigns them. Objects seen in the initial listing are left to the full sync.
async fn watch_unassigned(ctx: Context, ring: String, gr: GroupResource) {
    let Some(view) = ctx.ring_views.get(&ring) else {
        return;
    };
    let Some(resource) = view.resources.get(&gr) else {
        return;
    };
    let ar = api_resource(&gr, &resource.info);
    // `PartialObjectMeta` makes the watch metadata-only.
    let api: Api<PartialObjectMeta<DynamicObject>> = Api::all_with(ctx.client.clone(), &ar);
    let config = watcher::Config::default().labels(&format!("!{}", view.shard_label));
    let events = watcher::watcher(api, config).default_backoff();
    let result = events
        .try_for_each_concurrent(CONCURRENCY, |event| {
            let (ctx, ring, gr, ar) = (&ctx, &ring, &gr, &ar);
            async move {
                let watcher::Event::Apply(obj) = event else {
                    return Ok(());
                };
                // Always decide with the current view: shards may have changed since the start.
                let Some(view) = ctx.ring_views.get(ring) else {
                    return Ok(());
                };
                let Some(resource) = view.resources.get(gr) else {
                    return Ok(());
                };
                if resource.info.namespaced
                    && !obj
                        .metadata
                        .namespace
                        .as_deref()
                        .is_some_and(|ns| namespace_selected(ctx, ring, ns))
                {
                    return Ok(());
                }
                let decision = decide_object(&view, gr, resource, &obj.metadata);
                if decision == RebalanceDecision::Keep {
                    return Ok(());
                }
                match patch(ctx, &view, ar, &obj.metadata, decision).await {
                    Ok(()) => count(ctx, &view, gr, decision),
                    Err(error) => {
                        tracing::debug!(%error, object = %obj.name_any(), "fast-path patch failed; the sync will retry");
                    }
                }
                Ok(())
            }
        })
        .await;
    if let Err(error) = result {
        tracing::warn!(%error, ring = %ring, resource = %gr, "fast-path watch ended");
    }
}
