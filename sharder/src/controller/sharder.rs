//! The sharder controller (SPEC §9): on the leader, keeps every object of every ring on the shard
//! the ring assigns it to.
//!
//! When each ring is synced is decided by the pure `SyncSchedule` (in `core`). A sync lists objects
//! metadata-only in pages and sends drain or move patches, each guarded by the object's
//! `resourceVersion`. Besides, the missed-assignment path (`missed_assignments`) assigns
//! objects the webhook missed within seconds.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, PartialObjectMeta};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde_json::json;
use sharding_crds::selector::selector_matches;
use sharding_crds::{GroupResource, HashKey, RingRef};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

mod pager;

use self::pager::{Pager, PagerError};
use super::announce::{Announcer, DRAIN_CHECK_PERIOD};
use super::missed_assignments::MissedAssignments;
use crate::context::Context;
use crate::core::key::KeyOutcome;
use crate::core::list_scope::{ListScope, list_scope};
use crate::core::rebalance::{RebalanceDecision, waits_for_owner};
use crate::core::sync_schedule::SyncSchedule;
use crate::metrics::{Metrics, OutcomeLabels, RingLabel};
use crate::observed::{DrainsSeen, RingObjects, uid_hash};
use crate::reachability::{MoveGate, REASON_WEBHOOK_REACHABLE, REASON_WEBHOOK_UNREACHABLE};
use crate::ring_views::{ResolvedResource, ResourceInfo, RingView};

/// Message of the log record when a running sync is stopped because its ring's view changed (or
/// the ring is gone), with the field `ring`; a sync with the current view starts right after.
pub const SYNC_SUPERSEDED: &str =
    "view changed during the sync; starting over with the current view";

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

/// Page size of sync lists.
pub const PAGE_SIZE: u32 = 500;

/// Message of the info record when a sync list's continue token expired (410 Gone) and the list
/// goes on with the token of that answer, reading later pages at a newer revision; with the
/// fields `ring` and `resource`.
pub const LIST_CONTINUED_INCONSISTENTLY: &str =
    "continue token expired (410 Gone); listing on from where it stopped, at the current revision";

/// Message of the info record when a sync list's continue token expired (410 Gone) with no token
/// to go on with, and the list starts over from its first page; with the fields `ring` and
/// `resource`.
pub const LIST_RESTARTED: &str = "continue token expired (410 Gone) with no token to go on with; listing again from the first page";
/// Message of the log record at the start of every sync of a ring, with the fields `ring` and
/// `shards`.
pub const SYNC_STARTED: &str = "starting sync of ring";

/// Message of the log record at the end of every sync of a ring, with the fields `ring`,
/// `duration`, `listed`, `drained`, `moved`, `failed` and `held`.
pub const SYNC_FINISHED: &str = "finished sync of ring";

/// A failed sync; the ring is synced again after a backoff.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// Listing a resource failed, or its continue tokens kept expiring.
    #[error("failed to list {resource}: {source}")]
    List {
        /// The resource.
        resource: GroupResource,
        /// Underlying error.
        #[source]
        source: PagerError,
    },
    /// Controlled objects wait for their controllers to leave their shard (drain acknowledged);
    /// the sync runs again soon, with backoff.
    #[error("{waiting} controlled objects wait for their controllers to leave their shard")]
    WaitingForOwners {
        /// Controlled objects held back.
        waiting: usize,
    },
    /// Moves were held back because the ring's webhook is unreachable.
    #[error("held back {held} moves: the API server does not reach the ring's webhook")]
    WebhookUnreachable {
        /// Moves not sent.
        held: usize,
    },
    /// A newer view of the ring superseded this sync, which stopped before its next page; the
    /// patches it had sent completed and were counted.
    #[error("superseded by a newer view of the ring")]
    Superseded,
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
pub(crate) struct SyncStats {
    /// Objects listed.
    pub(crate) listed: usize,
    /// Drain patches sent.
    pub(crate) drained: usize,
    /// Move patches sent.
    pub(crate) moved: usize,
    /// Patches that failed.
    pub(crate) failed: usize,
    /// Moves not sent because the ring's webhook is unreachable.
    pub(crate) held: usize,
}

/// Runs the sharder controller until `shutdown` fires. Dropping it (on lost leadership) stops the
/// syncs and the missed-assignment watches it started, which it owns.
pub(crate) async fn run(ctx: Context, shutdown: CancellationToken) {
    let mut changes = ctx.ring_views.subscribe();
    let mut schedule = SyncSchedule::new(ctx.config.controller.sharder.sync_period.0);
    let mut running: JoinSet<(String, u64, Result<SyncStats, Error>)> = JoinSet::new();
    // The sync each ring runs now, by a number unique per started sync: a sync stopped just as
    // it finished must not be taken for its successor.
    let mut started_syncs = 0u64;
    // Running syncs by ring, with the token that stops one when a newer view supersedes it.
    let mut handles: HashMap<String, (u64, CancellationToken)> = HashMap::new();
    let mut missed = MissedAssignments::default();
    let mut announcer = Announcer::default();
    let mut drain_check = tokio::time::interval(DRAIN_CHECK_PERIOD);
    loop {
        let now = Instant::now();
        let views = ctx.ring_views.all();
        // The schedule keys rings by `Kind/name`, which is unique across both kinds.
        let keyed: HashMap<String, &Arc<RingView>> = views
            .iter()
            .map(|v| (v.ring_ref().to_string(), v))
            .collect();
        // A sync must not go on with an outdated view (shards came or went, the spec or ring
        // changed): stop it and start over below with the current one.
        for key in schedule.superseded(keyed.iter().map(|(key, v)| (key.as_str(), v.revision))) {
            // Stopped, not aborted: a sync stops before its next page, so the patches in flight
            // complete and are counted. The next sync of the ring may start meanwhile; both
            // write only labels towards the ring's current wishes, and the newer one decides.
            if let Some((_, stop)) = handles.remove(&key) {
                stop.cancel();
            }
            schedule.abandoned(&key, now);
            if let Some(view) = keyed.get(&key) {
                ctx.metrics
                    .syncs
                    .get_or_create(&OutcomeLabels::new(&view.ring_ref(), "superseded"))
                    .inc();
            }
            tracing::info!(ring = %key, "{SYNC_SUPERSEDED}");
        }
        let start = schedule.start_due(
            now,
            keyed.iter().map(|(key, v)| (key.as_str(), v.revision)),
            |key| {
                keyed
                    .get(key)
                    .is_some_and(|v| webhook_in_place(&ctx, &v.ring_ref()))
            },
        );
        for key in start {
            let Some(view) = keyed.get(&key) else {
                continue;
            };
            let (ctx, view) = (ctx.clone(), Arc::clone(view));
            let task_key = key.clone();
            started_syncs += 1;
            let id = started_syncs;
            let stop = shutdown.child_token();
            let task_stop = stop.clone();
            running.spawn(async move { (task_key, id, sync_ring(&ctx, &view, task_stop).await) });
            handles.insert(key, (id, stop));
        }
        missed.reconcile(&ctx, &views);
        announcer.membership(&ctx, &views).await;

        tokio::select! {
            () = shutdown.cancelled() => break,
            _ = changes.changed() => {}
            _ = drain_check.tick() => announcer.stuck_drains(&ctx).await,
            () = tokio::time::sleep_until(schedule.next_wake(now)) => {}
            Some(joined) = running.join_next(), if !running.is_empty() => {
                // A superseded sync was accounted for when it was stopped.
                let Ok((name, id, result)) = joined else { continue };
                if handles.get(&name).is_none_or(|(current, _)| *current != id) {
                    continue;
                }
                handles.remove(&name);
                let waiting = matches!(result, Err(Error::WaitingForOwners { .. }));
                let error = result.as_ref().err().map(ToString::to_string);
                if let Some(backoff) = schedule.finished(&name, result.is_ok(), Instant::now()) {
                    let error = error.unwrap_or_default();
                    if waiting {
                        tracing::info!(%error, ring = %name, retry_in = ?backoff, "sync again soon");
                    } else {
                        tracing::warn!(%error, ring = %name, retry_in = ?backoff, "sync failed");
                    }
                }
            }
        }
    }
    missed.stop();
    running.shutdown().await;
}

pub(super) fn api_resource(gr: &GroupResource, info: &ResourceInfo) -> ApiResource {
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

/// Whether the ring's webhook configuration has been applied for its current spec.
fn webhook_in_place(ctx: &Context, ring: &RingRef) -> bool {
    ctx.ring(ring).is_some_and(|r| r.webhook_in_place())
}

/// Whether objects in `namespace` belong to the ring of `view` (its selector, else the
/// configured default, resolved when the view was built).
pub(super) fn namespace_selected(ctx: &Context, view: &RingView, namespace: &str) -> bool {
    ctx.namespaces
        .get(&ObjectRef::new(namespace))
        .is_some_and(|ns| selector_matches(&view.namespace_selector, ns.labels()))
}

/// The decision for one object of `view`.
pub(super) fn decide_object(
    view: &RingView,
    gr: &GroupResource,
    resource: &ResolvedResource,
    meta: &kube::api::ObjectMeta,
) -> RebalanceDecision {
    view.placement(&gr.group, resource, meta).decision
}

/// What became of one patch of a sync: the object's UID, the decision and the result (`None`:
/// not sent, the sync was superseded first).
type PatchOutcome = (String, RebalanceDecision, Option<Result<(), PatchError>>);

/// Counts one listed object of `view` into `tally` and returns its decision.
fn tally_object(
    view: &RingView,
    gr: &GroupResource,
    resource: &ResolvedResource,
    meta: &kube::api::ObjectMeta,
    tally: &mut Tally,
) -> RebalanceDecision {
    let placement = view.placement(&gr.group, resource, meta);
    let current = placement.object.current;
    match current {
        Some(shard) => {
            *tally
                .objects
                .per_shard
                .entry((shard.to_string(), gr.clone()))
                .or_default() += 1;
        }
        None if matches!(placement.key, Ok(KeyOutcome::Key(_))) => {
            *tally.objects.unassigned.entry(gr.clone()).or_default() += 1;
        }
        None => {}
    }
    if placement.object.draining {
        tally.draining.insert(
            meta.uid.as_deref().unwrap_or_default(),
            current.unwrap_or_default(),
        );
    }
    // With object keys, a controlled object's key is its controller's key: main resources are
    // synced first, so the controller was seen already if it is listed.
    if view.hash_key == HashKey::Object
        && let Ok(KeyOutcome::Key(key)) = &placement.key
    {
        let key_hash = crate::core::ring::hash(key);
        let shard_hash = current.map_or(0, crate::core::ring::hash);
        if resource.is_main() {
            // Only a controller that is not where the ring wants it can hold a controlled object
            // back (see `waits_for_owner`); one in place needs no entry, which keeps the map empty
            // in a sync that moves nothing, however large the ring.
            if placement.desired == current {
                tally.owner_shards.remove(&key_hash);
            } else {
                tally.owner_shards.insert(key_hash, shard_hash);
            }
        } else if placement.decision == RebalanceDecision::Move
            && waits_for_owner(
                current,
                current.is_some() && tally.owner_shards.get(&key_hash) == Some(&shard_hash),
                placement.desired,
                |shard| view.ring.contains(shard),
            )
        {
            tally.waiting_for_owner += 1;
            return RebalanceDecision::Keep;
        }
    }
    placement.decision
}

/// A patch that did not have the intended effect.
#[derive(Debug, thiserror::Error)]
pub(super) enum PatchError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// The move went through but the object did not land on the shard the ring's current view
    /// wants: no webhook assigned it (its configuration not yet seen by the API server, or no
    /// sharder replica reachable), or the replica that answered had another view: retry later.
    #[error("object was moved but not assigned to the shard the ring wants now")]
    NotAssigned,
    /// The ring's webhook is unreachable and no probe is due: the move was not sent.
    #[error("the ring's webhook is unreachable; move held back")]
    Held,
}

/// Sends the patch for `decision` about an object of resource `gr`, guarded by the object's
/// resourceVersion. A move counts as done only when the object landed where the ring's view
/// wants it now, which may be newer than `view`.
pub(super) async fn patch(
    ctx: &Context,
    view: &RingView,
    gr: &GroupResource,
    ar: &ApiResource,
    meta: &kube::api::ObjectMeta,
    decision: RebalanceDecision,
) -> Result<(), PatchError> {
    let labels = match decision {
        RebalanceDecision::Keep => return Ok(()),
        RebalanceDecision::Drain => json!({ &view.drain_label: "true" }),
        RebalanceDecision::Move => json!({ &view.shard_label: null, &view.drain_label: null }),
    };
    // Every ring's sync and the missed-assignment path share one bound; held for the probe and
    // the patch alike.
    let _permit = ctx.patch_limit.acquire().await;
    let body = json!({"metadata": {"resourceVersion": meta.resource_version, "labels": labels}});
    let api: Api<DynamicObject> = match &meta.namespace {
        Some(ns) => Api::namespaced_with(ctx.client.clone(), ns, ar),
        None => Api::all_with(ctx.client.clone(), ar),
    };
    let name = meta.name.as_deref().unwrap_or_default();
    let ring = view.ring_ref();
    if decision == RebalanceDecision::Move {
        match ctx.reachability.gate(&ring, std::time::Instant::now()) {
            MoveGate::Open => {}
            MoveGate::Closed => return Err(PatchError::Held),
            MoveGate::Probe => {
                // A dry run goes through admission like the real write, without changing the
                // object: if the webhook assigns it, moves may go again.
                let params = PatchParams {
                    dry_run: true,
                    ..super::patch_params()
                };
                match api
                    .patch_metadata(name, &params, &Patch::Merge(&body))
                    .await
                {
                    Ok(probed) if !webhook_ran(ctx, view, &probed.metadata) => {
                        webhook_missed(ctx, &ring).await;
                        return Err(PatchError::NotAssigned);
                    }
                    Ok(_) => webhook_answered(ctx, &ring).await,
                    Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    match api
        .patch_metadata(name, &super::patch_params(), &Patch::Merge(&body))
        .await
    {
        Ok(updated) => {
            if decision == RebalanceDecision::Move {
                if !webhook_ran(ctx, view, &updated.metadata) {
                    webhook_missed(ctx, &ring).await;
                    return Err(PatchError::NotAssigned);
                }
                webhook_answered(ctx, &ring).await;
                // The webhook assigned the object in the same request, as the current view wants.
                let current = ctx.ring_views.get(&ring);
                let current = current.as_deref().unwrap_or(view);
                let landed = current.resources.get(gr).is_none_or(|resource| {
                    decide_object(current, gr, resource, &updated.metadata)
                        == RebalanceDecision::Keep
                });
                if !landed {
                    return Err(PatchError::NotAssigned);
                }
            }
            Ok(())
        }
        // Deleted meanwhile: nothing left to move.
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Whether the ring's webhook ran on a moved object: it carries a shard label again. Without
/// available shards the webhook assigns nothing, which says nothing about reaching it.
fn webhook_ran(ctx: &Context, view: &RingView, meta: &kube::api::ObjectMeta) -> bool {
    let current = ctx.ring_views.get(&view.ring_ref());
    let shards = current.as_deref().unwrap_or(view).ring.len();
    shards == 0
        || meta
            .labels
            .as_ref()
            .is_some_and(|l| l.get(&view.shard_label).is_some_and(|s| !s.is_empty()))
}

/// Records a move that came back unassigned; the first one after a good run stops the ring's
/// moves and is reported.
async fn webhook_missed(ctx: &Context, ring: &RingRef) {
    if ctx.reachability.failed(ring, std::time::Instant::now()) {
        tracing::warn!(%ring, reason = REASON_WEBHOOK_UNREACHABLE, "a moved object came back unassigned: the API server does not reach the ring's webhook; moves stop until a probe lands");
        if let Some(object) = ctx.ring(ring) {
            let note = "A moved object came back unassigned: the API server does not reach this ring's webhook. Moves stop until a dry-run probe lands (every few seconds)".to_string();
            ctx.events
                .warning(&object.object_ref(), REASON_WEBHOOK_UNREACHABLE, "", note)
                .await;
        }
    }
}

/// Records a move (or probe) the webhook assigned; reports a webhook that answers again.
async fn webhook_answered(ctx: &Context, ring: &RingRef) {
    if ctx.reachability.landed(ring) {
        tracing::info!(%ring, "the ring's webhook answers again; moves resume");
        if let Some(object) = ctx.ring(ring) {
            let note = "The API server reaches this ring's webhook again; moves resume".to_string();
            ctx.events
                .normal(&object.object_ref(), REASON_WEBHOOK_REACHABLE, "", note)
                .await;
        }
    }
}

pub(super) fn count(
    ctx: &Context,
    view: &RingView,
    gr: &GroupResource,
    decision: RebalanceDecision,
) {
    let labels = Metrics::resource_labels(&view.ring_ref(), &gr.group, &gr.resource);
    match decision {
        RebalanceDecision::Drain => ctx.metrics.drains.get_or_create(&labels).inc(),
        RebalanceDecision::Move => ctx.metrics.movements.get_or_create(&labels).inc(),
        RebalanceDecision::Keep => 0,
    };
}

/// The ring's resources in the order a sync walks them: main resources first, then controlled
/// ones, each by group and name.
///
/// Main objects must start draining before their controlled objects move: a controlled object
/// moved while its owner still sits on the old shard is written back by that shard.
fn sync_order(view: &RingView) -> Vec<(&GroupResource, &ResolvedResource)> {
    let mut resources: Vec<_> = view.resources.iter().collect();
    resources.sort_by_key(|(gr, resource)| {
        (!resource.is_main(), gr.group.as_str(), gr.resource.as_str())
    });
    resources
}

/// What one sync learned besides its counts: objects per shard, unassigned and draining
/// objects, drains sent, and whether a rebalance began.
#[derive(Debug, Default)]
struct Tally {
    objects: RingObjects,
    /// Every listed object carrying the drain label, with its shard.
    draining: DrainsSeen,
    /// [`uid_hash`]es of the objects this sync drained.
    drained_now: HashSet<u64>,
    /// Whether the "rebalance started" Event went out.
    announced: bool,
    /// Hash of each listed main object's key → hash of its shard label (0 without one), for
    /// controlled objects that must wait for their controller: only main objects not on the
    /// shard the ring wants (the others cannot hold anything back), as hashes, 16 bytes each.
    owner_shards: HashMap<u64, u64>,
    /// Controlled objects held back because their controller has not left their shard yet.
    waiting_for_owner: usize,
    /// Fires when a newer view supersedes this sync.
    stop: CancellationToken,
}

/// Syncs every resource of one ring, records what it saw for the metrics and publishes the
/// rebalance Events.
#[tracing::instrument(skip_all, fields(ring = %view.ring_ref()))]
async fn sync_ring(
    ctx: &Context,
    view: &RingView,
    stop: CancellationToken,
) -> Result<SyncStats, Error> {
    let ring = view.ring_ref();
    let started = Instant::now();
    tracing::info!(%ring, shards = view.ring.len(), "{SYNC_STARTED}");
    let mut stats = SyncStats::default();
    let mut tally = Tally {
        stop,
        ..Tally::default()
    };
    let mut first_error = None;
    for (gr, resource) in sync_order(view) {
        if tally.stop.is_cancelled() {
            return Err(Error::Superseded);
        }
        if let Err(error) = sync_resource(ctx, view, gr, resource, &mut stats, &mut tally).await {
            first_error.get_or_insert(error);
        }
    }
    if tally.stop.is_cancelled() {
        return Err(Error::Superseded);
    }
    let duration = started.elapsed();
    tracing::info!(
        %ring,
        ?duration,
        listed = stats.listed,
        drained = stats.drained,
        moved = stats.moved,
        failed = stats.failed,
        held = stats.held,
        "{SYNC_FINISHED}"
    );
    let reference = ctx.ring(&ring).map(|r| r.object_ref());
    if first_error.is_none() {
        // Every resource was listed to the end: the counts are complete.
        ctx.observed.sync_finished(
            &ring,
            std::mem::take(&mut tally.objects),
            std::mem::take(&mut tally.draining),
            &tally.drained_now,
            std::time::Instant::now(),
        );
        ctx.metrics
            .sync_duration
            .get_or_create(&RingLabel(ring.clone()))
            .observe(duration.as_secs_f64());
    }
    if let Some(reference) = &reference
        && stats.drained + stats.moved > 0
    {
        let note = format!(
            "Drained {} and moved {} of {} objects in {:.1}s ({} failed)",
            stats.drained,
            stats.moved,
            stats.listed,
            duration.as_secs_f64(),
            stats.failed
        );
        ctx.events
            .normal(reference, REASON_REBALANCE_FINISHED, "", note)
            .await;
    }
    let result = match first_error {
        Some(error) => Err(error),
        None if stats.failed > 0 => Err(Error::Patches {
            failed: stats.failed,
            attempted: stats.drained + stats.moved + stats.failed,
        }),
        None if stats.held > 0 => Err(Error::WebhookUnreachable { held: stats.held }),
        None if tally.waiting_for_owner > 0 => Err(Error::WaitingForOwners {
            waiting: tally.waiting_for_owner,
        }),
        None => Ok(stats),
    };
    let outcome = match &result {
        Ok(_) => "success",
        Err(Error::WaitingForOwners { .. }) => "waiting",
        Err(_) => "failure",
    };
    ctx.metrics
        .syncs
        .get_or_create(&OutcomeLabels::new(&ring, outcome))
        .inc();
    if let (Err(error), Some(reference)) = (&result, &reference)
        && !matches!(error, Error::WaitingForOwners { .. })
    {
        let note = format!("Sync failed, retrying with backoff: {error}");
        ctx.events
            .warning(reference, REASON_SYNC_FAILED, "", note)
            .await;
    }
    result
}

/// Syncs every object of one resource of a ring, listed page by page; each page's objects are
/// patched before the next page is asked for.
async fn sync_resource(
    ctx: &Context,
    view: &RingView,
    gr: &GroupResource,
    resource: &ResolvedResource,
    stats: &mut SyncStats,
    tally: &mut Tally,
) -> Result<(), Error> {
    for api in list_apis(ctx, view, gr, resource) {
        sync_list(ctx, view, gr, resource, api, stats, tally).await?;
    }
    Ok(())
}

/// What a sync lists `resource` of `view` through: the whole cluster, or each namespace the ring
/// selects when it selects few of them (the rule is [`list_scope`]'s).
fn list_apis(
    ctx: &Context,
    view: &RingView,
    gr: &GroupResource,
    resource: &ResolvedResource,
) -> Vec<Api<DynamicObject>> {
    let ar = api_resource(gr, &resource.info);
    if !resource.info.namespaced {
        return vec![Api::all_with(ctx.client.clone(), &ar)];
    }
    let namespaces = ctx.namespaces.state();
    let mut selected: Vec<String> = namespaces
        .iter()
        .filter(|ns| selector_matches(&view.namespace_selector, ns.labels()))
        .map(|ns| ns.name_any())
        .collect();
    match list_scope(selected.len(), namespaces.len()) {
        ListScope::Cluster => vec![Api::all_with(ctx.client.clone(), &ar)],
        ListScope::Namespaces => {
            selected.sort();
            selected
                .iter()
                .map(|ns| Api::namespaced_with(ctx.client.clone(), ns, &ar))
                .collect()
        }
    }
}

/// Lists what `api` reaches page by page and patches each page's objects before asking for the
/// next page.
async fn sync_list(
    ctx: &Context,
    view: &RingView,
    gr: &GroupResource,
    resource: &ResolvedResource,
    api: Api<DynamicObject>,
    stats: &mut SyncStats,
    tally: &mut Tally,
) -> Result<(), Error> {
    let info = &resource.info;
    let ar = &api_resource(gr, info);
    let ring = view.ring_ref();
    let labels = Metrics::resource_labels(&ring, &gr.group, &gr.resource);
    let concurrency = usize::try_from(ctx.config.controller.sharder.concurrent_moves)
        .unwrap_or(1)
        .max(1);
    // What this list has counted is counted again when it starts over from the first page.
    let checkpoint = (stats.listed, tally.objects.clone(), tally.waiting_for_owner);
    let mut pager = Pager::new(api);
    loop {
        let next = tokio::select! {
            () = tally.stop.cancelled() => return Err(Error::Superseded),
            next = pager.next_page() => next,
        };
        let page = match next {
            Ok(Some(page)) => page,
            Ok(None) => return Ok(()),
            Err(source) => {
                if let PagerError::Api(kube::Error::Api(status)) = &source
                    && status.code == 404
                {
                    // The version we know is not served any more (a CRD changed its versions):
                    // look it up again; the view is rebuilt with the new one and the sync starts
                    // over.
                    ctx.discovery.forget(gr);
                }
                return Err(Error::List {
                    resource: gr.clone(),
                    source,
                });
            }
        };
        if page.inconsistent_continuations > 0 {
            ctx.metrics
                .list_inconsistent_continuations
                .get_or_create(&labels)
                .inc_by(u64::from(page.inconsistent_continuations));
            tracing::info!(%ring, resource = %gr, "{LIST_CONTINUED_INCONSISTENTLY}");
        }
        if page.restarted {
            ctx.metrics.list_restarts.get_or_create(&labels).inc();
            tracing::info!(%ring, resource = %gr, "{LIST_RESTARTED}");
            stats.listed = checkpoint.0;
            tally.objects = checkpoint.1.clone();
            tally.waiting_for_owner = checkpoint.2;
        }
        stats.listed += page.items.len();
        let actions: Vec<(PartialObjectMeta<DynamicObject>, RebalanceDecision)> = page
            .items
            .into_iter()
            .filter(|obj| {
                !info.namespaced
                    || obj
                        .metadata
                        .namespace
                        .as_deref()
                        .is_some_and(|ns| namespace_selected(ctx, view, ns))
            })
            .map(|obj| {
                let decision = tally_object(view, gr, resource, &obj.metadata, tally);
                (obj, decision)
            })
            .filter(|(_, d)| *d != RebalanceDecision::Keep)
            .collect();
        if !actions.is_empty() && !tally.announced {
            tally.announced = true;
            if let Some(ring) = ctx.ring(&ring) {
                let note = format!(
                    "Rebalancing onto {} available shards: objects whose shard changed are drained or moved",
                    view.ring.len()
                );
                ctx.events
                    .normal(&ring.object_ref(), REASON_REBALANCE_STARTED, "", note)
                    .await;
            }
        }
        let ring = &ring;
        let stop = &tally.stop;
        let results: Vec<PatchOutcome> = futures::stream::iter(actions)
            .map(|(obj, decision)| async move {
                let uid = obj.uid().unwrap_or_default();
                // Checked as each patch is about to start (the stream starts one per free
                // slot): a superseded sync sends nothing more.
                if stop.is_cancelled() {
                    return (uid, decision, None);
                }
                let result = patch(ctx, view, gr, ar, obj.meta(), decision).await;
                match &result {
                    // Counted and tracked as each patch lands, not when the batch is done: a
                    // sync superseded by a newer view is aborted mid-batch, and the patches it
                    // sent must still count and their drains still be watched for stuck ones.
                    Ok(()) => {
                        count(ctx, view, gr, decision);
                        if decision == RebalanceDecision::Drain {
                            let shard = obj.labels().get(&view.shard_label);
                            let shard = shard.map(String::as_str).unwrap_or_default();
                            ctx.observed
                                .drain_sent(ring, &uid, shard, std::time::Instant::now());
                        }
                    }
                    Err(error) => {
                        tracing::debug!(%error, object = %obj.name_any(), ?decision, "patch failed");
                    }
                }
                (uid, decision, Some(result))
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
        for (uid, decision, result) in results {
            let Some(result) = result else { continue };
            match result {
                Ok(()) => match decision {
                    RebalanceDecision::Drain => {
                        stats.drained += 1;
                        tally.drained_now.insert(uid_hash(&uid));
                    }
                    RebalanceDecision::Move => stats.moved += 1,
                    RebalanceDecision::Keep => {}
                },
                Err(PatchError::Held) => stats.held += 1,
                Err(_) => stats.failed += 1,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn main_resources_sync_before_controlled_ones() {
        use crate::ring_views::{ResourceInfo, build_view};
        use sharding_crds::{ClusterRing, ClusterRingSpec, RingResource};
        use std::collections::BTreeMap;

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
                hash_key: None,
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
        let view = build_view(&ring, &BTreeMap::new(), &discovered, &Default::default());
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
}
