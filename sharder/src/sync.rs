//! The sharder controller (SPEC §9): on the leader, keeps every object of every ring on the shard
//! the ring assigns it to.
//!
//! A ring is synced when its view changes (spec changed, a shard became available or
//! unavailable), every `syncPeriod` after a successful sync, and with exponential backoff (5 s up to
//! `syncPeriod`) after a failed one. A sync lists objects metadata-only in pages and sends drain or
//! move patches, each guarded by the object's `resourceVersion`. Besides, a metadata-only watch per
//! ring resource on objects *without* the shard label assigns objects the webhook missed within
//! seconds; it caches nothing, so memory does not grow with the number of objects.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::{ApiResource, PartialObjectMeta};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;
use sharding_crds::GroupResource;
use sharding_crds::selector::selector_matches;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::context::Context;
use crate::key::{self, KeyOutcome, ObjectInfo, ResourceRole};
use crate::metrics::Metrics;
use crate::rebalance::{Decision, ObjectState, decide};
use crate::rings::{ResourceInfo, RingView, Role};

/// Page size of sync lists.
const PAGE_SIZE: u32 = 500;
/// First retry delay after a failed sync.
const INITIAL_BACKOFF: Duration = Duration::from_secs(5);
/// Concurrent patches of the fast path per watched resource.
const FAST_PATH_CONCURRENCY: usize = 16;
/// How often a ring whose webhook configuration is not in place yet is looked at again.
const WEBHOOK_WAIT: Duration = Duration::from_secs(1);

/// A failed sync; the ring is synced again after a backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Listing a resource failed.
    #[error("failed to list {resource}: {source}")]
    List {
        /// The resource.
        resource: GroupResource,
        /// Underlying error.
        #[source]
        source: kube::Error,
    },
    /// Some patches failed (conflicts included); the others went through.
    #[error("failed to patch {failed} of {attempted} objects")]
    Patches {
        /// Failed patches.
        failed: usize,
        /// Attempted patches.
        attempted: usize,
    },
}

/// Counts of one sync.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// Objects listed.
    pub listed: usize,
    /// Drain patches sent.
    pub drained: usize,
    /// Move patches sent.
    pub moved: usize,
    /// Patches that failed.
    pub failed: usize,
}

#[derive(Debug)]
struct Schedule {
    /// Revision of the view the last started sync used.
    revision: Option<u64>,
    due: Instant,
    failures: u32,
}

/// Runs the sharder controller until `shutdown` fires.
pub async fn run(ctx: Context, shutdown: CancellationToken) {
    let sync_period = ctx.config.controller.sharder.sync_period.0;
    let mut changes = ctx.registry.subscribe();
    let mut schedules: HashMap<String, Schedule> = HashMap::new();
    let mut running: JoinSet<(String, Result<SyncStats, Error>)> = JoinSet::new();
    let mut in_flight: HashSet<String> = HashSet::new();
    let mut fast_paths: HashMap<(String, GroupResource), CancellationToken> = HashMap::new();
    loop {
        let now = Instant::now();
        let views = ctx.registry.all();
        let names: HashSet<String> = views.iter().map(|v| v.name.clone()).collect();
        schedules.retain(|name, _| names.contains(name));
        for view in &views {
            let schedule = schedules.entry(view.name.clone()).or_insert(Schedule {
                revision: None,
                due: now,
                failures: 0,
            });
            if schedule.revision != Some(view.revision) && schedule.due > now {
                // The view changed since the last sync started: sync again now.
                schedule.due = now;
                schedule.failures = 0;
            }
            if schedule.due <= now && !in_flight.contains(&view.name) {
                if !webhook_in_place(&ctx, &view.name) {
                    // Moves rely on the ring's webhook; look again shortly.
                    schedule.due = now + WEBHOOK_WAIT;
                    continue;
                }
                schedule.revision = Some(view.revision);
                in_flight.insert(view.name.clone());
                let (ctx, view) = (ctx.clone(), view.clone());
                running.spawn(async move {
                    let name = view.name.clone();
                    (name, sync_ring(&ctx, &view).await)
                });
            }
        }
        reconcile_fast_paths(&ctx, &views, &mut fast_paths, &shutdown);

        let next_due = schedules
            .iter()
            .filter(|(name, _)| !in_flight.contains(*name))
            .map(|(_, s)| s.due)
            .min();
        let sleep_until = next_due.unwrap_or(now + sync_period);
        tokio::select! {
            () = shutdown.cancelled() => break,
            _ = changes.changed() => {}
            () = tokio::time::sleep_until(sleep_until) => {}
            Some(joined) = running.join_next(), if !running.is_empty() => {
                let Ok((name, result)) = joined else { continue };
                in_flight.remove(&name);
                if let Some(schedule) = schedules.get_mut(&name) {
                    match result {
                        Ok(_) => {
                            schedule.failures = 0;
                            schedule.due = Instant::now() + sync_period;
                        }
                        Err(error) => {
                            schedule.failures += 1;
                            let backoff = backoff(schedule.failures, sync_period);
                            tracing::warn!(%error, ring = %name, retry_in = ?backoff, "sync failed");
                            schedule.due = Instant::now() + backoff;
                        }
                    }
                }
            }
        }
    }
    for token in fast_paths.values() {
        token.cancel();
    }
    running.shutdown().await;
}

/// Exponential backoff from [`INITIAL_BACKOFF`], doubling per failure, capped at `max`.
pub fn backoff(failures: u32, max: Duration) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1));
    INITIAL_BACKOFF.saturating_mul(factor).min(max)
}

fn api_resource(gr: &GroupResource, info: &ResourceInfo) -> ApiResource {
    ApiResource {
        group: gr.group.clone(),
        version: info.version.clone(),
        api_version: if gr.group.is_empty() {
            info.version.clone()
        } else {
            format!("{}/{}", gr.group, info.version)
        },
        kind: info.kind.clone(),
        plural: gr.resource.clone(),
    }
}

/// Whether the ring's webhook configuration has been applied for its current spec: the ring
/// controller sets `Ready=True` with the ring's generation only after applying it.
fn webhook_in_place(ctx: &Context, ring: &str) -> bool {
    ctx.rings.get(&ObjectRef::new(ring)).is_some_and(|r| {
        r.ready_condition()
            .is_some_and(|c| c.status == "True" && c.observed_generation == r.metadata.generation)
    })
}

/// Whether objects in `namespace` belong to `ring` (its selector, else the configured default).
fn namespace_selected(ctx: &Context, ring: &str, namespace: &str) -> bool {
    let Some(ring) = ctx.rings.get(&ObjectRef::new(ring)) else {
        return false;
    };
    let selector = ring
        .spec
        .namespace_selector
        .as_ref()
        .unwrap_or(&ctx.config.webhook.config.namespace_selector);
    ctx.namespaces
        .get(&ObjectRef::new(namespace))
        .is_some_and(|ns| selector_matches(selector, ns.labels()))
}

/// The decision for one object of `view`.
fn decide_object(
    view: &RingView,
    gr: &GroupResource,
    role: &Role,
    meta: &kube::api::ObjectMeta,
) -> Decision {
    let info = ObjectInfo::from_meta(meta);
    let outcome = match role {
        Role::Main { info: ri } => key::hash_key(
            &info,
            &ResourceRole::Main {
                group: &gr.group,
                kind: &ri.kind,
            },
        ),
        Role::Controlled { controllers, .. } => {
            key::hash_key(&info, &ResourceRole::Controlled { controllers })
        }
    };
    let Ok(KeyOutcome::Key(key)) = outcome else {
        return Decision::Keep;
    };
    let labels = meta.labels.as_ref();
    let state = ObjectState {
        current: labels
            .and_then(|l| l.get(&view.shard_label))
            .map(String::as_str)
            .filter(|s| !s.is_empty()),
        draining: labels.is_some_and(|l| l.contains_key(&view.drain_label)),
        main: matches!(role, Role::Main { .. }),
    };
    decide(state, view.ring.shard_for(&key), |s| view.ring.contains(s))
}

/// A patch that did not have the intended effect.
#[derive(Debug, thiserror::Error)]
enum PatchError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// The move went through but no webhook assigned the object (its configuration not yet seen
    /// by the API server, or no sharder replica reachable): retry later.
    #[error("object was moved but not assigned by the webhook")]
    NotAssigned,
}

/// Sends the patch for `decision`, guarded by the object's resourceVersion.
async fn patch(
    ctx: &Context,
    view: &RingView,
    ar: &ApiResource,
    meta: &kube::api::ObjectMeta,
    decision: Decision,
) -> Result<(), PatchError> {
    let labels = match decision {
        Decision::Keep => return Ok(()),
        Decision::Drain => json!({ &view.drain_label: "true" }),
        Decision::Move => json!({ &view.shard_label: null, &view.drain_label: null }),
    };
    let body = json!({"metadata": {"resourceVersion": meta.resource_version, "labels": labels}});
    let api: Api<DynamicObject> = match &meta.namespace {
        Some(ns) => Api::namespaced_with(ctx.client.clone(), ns, ar),
        None => Api::all_with(ctx.client.clone(), ar),
    };
    let name = meta.name.as_deref().unwrap_or_default();
    match api
        .patch_metadata(name, &PatchParams::default(), &Patch::Merge(&body))
        .await
    {
        Ok(updated) => {
            // A move is only done once the webhook assigned the object in the same request.
            let assigned = updated.labels().contains_key(&view.shard_label);
            if decision == Decision::Move && !assigned && !view.ring.is_empty() {
                return Err(PatchError::NotAssigned);
            }
            Ok(())
        }
        // Deleted meanwhile: nothing left to move.
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn count(ctx: &Context, view: &RingView, gr: &GroupResource, decision: Decision) {
    let labels = Metrics::resource_labels(&view.name, &gr.group, &gr.resource);
    match decision {
        Decision::Drain => ctx.metrics.drains.get_or_create(&labels).inc(),
        Decision::Move => ctx.metrics.movements.get_or_create(&labels).inc(),
        Decision::Keep => 0,
    };
}

/// The ring's resources in the order a sync walks them: main resources first, then controlled
/// ones, each by group and name.
///
/// Main objects must start draining before their controlled objects move: a controlled object
/// moved while its owner still sits on the old shard is written back by that shard.
pub fn sync_order(view: &RingView) -> Vec<(&GroupResource, &Role)> {
    let mut resources: Vec<_> = view.resources.iter().collect();
    resources.sort_by_key(|(gr, role)| {
        (
            !matches!(role, Role::Main { .. }),
            gr.group.as_str(),
            gr.resource.as_str(),
        )
    });
    resources
}

/// Syncs every resource of one ring.
#[tracing::instrument(skip_all, fields(ring = %view.name))]
pub async fn sync_ring(ctx: &Context, view: &RingView) -> Result<SyncStats, Error> {
    let started = Instant::now();
    tracing::info!(ring = %view.name, shards = view.ring.len(), "starting sync of ring");
    let mut stats = SyncStats::default();
    let mut first_error = None;
    for (gr, role) in sync_order(view) {
        if let Err(error) = sync_resource(ctx, view, gr, role, &mut stats).await {
            first_error.get_or_insert(error);
        }
    }
    tracing::info!(
        ring = %view.name,
        duration = ?started.elapsed(),
        listed = stats.listed,
        drained = stats.drained,
        moved = stats.moved,
        failed = stats.failed,
        "finished sync of ring"
    );
    if let Some(error) = first_error {
        return Err(error);
    }
    if stats.failed > 0 {
        return Err(Error::Patches {
            failed: stats.failed,
            attempted: stats.drained + stats.moved + stats.failed,
        });
    }
    Ok(stats)
}

async fn sync_resource(
    ctx: &Context,
    view: &RingView,
    gr: &GroupResource,
    role: &Role,
    stats: &mut SyncStats,
) -> Result<(), Error> {
    let info = role.info();
    let ar = api_resource(gr, info);
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &ar);
    let concurrency = usize::try_from(ctx.config.controller.sharder.concurrent_moves)
        .unwrap_or(1)
        .max(1);
    // Pages are read from etcd, not from the watch cache (resourceVersion=0), deliberately
    // unlike SPEC §9: API servers before the paginated watch cache ignore `limit` for
    // resourceVersion=0 and return every object in one page (measured on 1.20: 10 000 Secrets,
    // 4.9 MiB, no continue token), which would make the sharder's memory grow with the ring. kube
    // drops resourceVersion=0 from limited lists for the same reason. Later pages pass only the
    // continue token, as the API requires.
    let mut params = ListParams::default().limit(PAGE_SIZE);
    loop {
        let page = api
            .list_metadata(&params)
            .await
            .map_err(|source| Error::List {
                resource: gr.clone(),
                source,
            })?;
        stats.listed += page.items.len();
        let actions: Vec<(PartialObjectMeta<DynamicObject>, Decision)> = page
            .items
            .into_iter()
            .filter(|obj| {
                !info.namespaced
                    || obj
                        .metadata
                        .namespace
                        .as_deref()
                        .is_some_and(|ns| namespace_selected(ctx, &view.name, ns))
            })
            .map(|obj| {
                let decision = decide_object(view, gr, role, &obj.metadata);
                (obj, decision)
            })
            .filter(|(_, d)| *d != Decision::Keep)
            .collect();
        let results: Vec<(Decision, Result<(), PatchError>)> = futures::stream::iter(actions)
            .map(|(obj, decision)| {
                let ar = &ar;
                async move {
                    let result = patch(ctx, view, ar, obj.meta(), decision).await;
                    if let Err(error) = &result {
                        tracing::debug!(%error, object = %obj.name_any(), ?decision, "patch failed");
                    }
                    (decision, result)
                }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
        for (decision, result) in results {
            match result {
                Ok(()) => {
                    count(ctx, view, gr, decision);
                    match decision {
                        Decision::Drain => stats.drained += 1,
                        Decision::Move => stats.moved += 1,
                        Decision::Keep => {}
                    }
                }
                Err(_) => stats.failed += 1,
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => {
                params = ListParams::default().limit(PAGE_SIZE);
                params.continue_token = Some(token);
            }
            None => return Ok(()),
        }
    }
}

/// Starts a fast-path watch for every resource of every ring and stops those no longer needed.
fn reconcile_fast_paths(
    ctx: &Context,
    views: &[Arc<RingView>],
    running: &mut HashMap<(String, GroupResource), CancellationToken>,
    shutdown: &CancellationToken,
) {
    let wanted: HashSet<(String, GroupResource)> = views
        .iter()
        .flat_map(|v| v.resources.keys().map(|gr| (v.name.clone(), gr.clone())))
        .collect();
    running.retain(|key, token| {
        let keep = wanted.contains(key);
        if !keep {
            token.cancel();
        }
        keep
    });
    for key in wanted {
        if running.contains_key(&key) {
            continue;
        }
        let token = shutdown.child_token();
        running.insert(key.clone(), token.clone());
        let ctx = ctx.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = token.cancelled() => {}
                () = fast_path(ctx, key.0, key.1) => {}
            }
        });
    }
}

/// Watches objects of one ring resource that lack the shard label and moves them, so the webhook
/// assigns them. Objects seen in the initial listing are left to the full sync.
async fn fast_path(ctx: Context, ring: String, gr: GroupResource) {
    let Some(view) = ctx.registry.get(&ring) else {
        return;
    };
    let Some(role) = view.resources.get(&gr) else {
        return;
    };
    let ar = api_resource(&gr, role.info());
    // `PartialObjectMeta` makes the watch metadata-only.
    let api: Api<PartialObjectMeta<DynamicObject>> = Api::all_with(ctx.client.clone(), &ar);
    let config = watcher::Config::default().labels(&format!("!{}", view.shard_label));
    let events = watcher::watcher(api, config).default_backoff();
    let result = events
        .try_for_each_concurrent(FAST_PATH_CONCURRENCY, |event| {
            let (ctx, ring, gr, ar) = (&ctx, &ring, &gr, &ar);
            async move {
                let watcher::Event::Apply(obj) = event else {
                    return Ok(());
                };
                // Always decide with the current view: shards may have changed since the start.
                let Some(view) = ctx.registry.get(ring) else {
                    return Ok(());
                };
                let Some(role) = view.resources.get(gr) else {
                    return Ok(());
                };
                if role.info().namespaced
                    && !obj
                        .metadata
                        .namespace
                        .as_deref()
                        .is_some_and(|ns| namespace_selected(ctx, ring, ns))
                {
                    return Ok(());
                }
                let decision = decide_object(&view, gr, role, &obj.metadata);
                if decision == Decision::Keep {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn main_resources_sync_before_controlled_ones() {
        use crate::rings::{ResourceInfo, build_view};
        use sharding_crds::{ClusterRing, ClusterRingSpec, RingResource};
        use std::collections::{BTreeSet, HashMap};

        let info = |kind: &str| ResourceInfo {
            kind: kind.into(),
            version: "v1".into(),
            namespaced: true,
        };
        let ring = ClusterRing::new(
            "r",
            ClusterRingSpec {
                resources: vec![
                    RingResource {
                        group: String::new(),
                        resource: "secrets".into(),
                        controlled_resources: vec![GroupResource::new("", "configmaps")],
                    },
                    RingResource {
                        group: "apps".into(),
                        resource: "deployments".into(),
                        controlled_resources: vec![GroupResource::new("apps", "replicasets")],
                    },
                ],
                namespace_selector: None,
            },
        );
        let discovered = HashMap::from([
            (GroupResource::new("", "secrets"), info("Secret")),
            (GroupResource::new("", "configmaps"), info("ConfigMap")),
            (
                GroupResource::new("apps", "deployments"),
                info("Deployment"),
            ),
            (
                GroupResource::new("apps", "replicasets"),
                info("ReplicaSet"),
            ),
        ]);
        let view = build_view(&ring, &BTreeSet::new(), &discovered);
        let order: Vec<String> = sync_order(&view)
            .into_iter()
            .map(|(gr, _)| gr.to_string())
            .collect();
        assert_eq!(
            order,
            [
                "secrets",
                "deployments.apps",
                "configmaps",
                "replicasets.apps"
            ]
        );
    }

    #[test]
    fn backoff_doubles_from_five_seconds_up_to_the_sync_period() {
        let max = Duration::from_secs(300);
        assert_eq!(backoff(1, max), Duration::from_secs(5));
        assert_eq!(backoff(2, max), Duration::from_secs(10));
        assert_eq!(backoff(3, max), Duration::from_secs(20));
        assert_eq!(backoff(7, max), Duration::from_secs(300));
        assert_eq!(backoff(u32::MAX, max), Duration::from_secs(300));
    }
}
