//! One sync of one ring: every object of its resources listed metadata-only, page by page, each
//! page's drains and moves sent while the next page is asked for, and done before its objects
//! are looked at.

use std::collections::HashSet;
use std::sync::Arc;

use crate::context::Context;

use futures::StreamExt;
use kube::api::{Api, DynamicObject};
use kube::core::PartialObjectMeta;
use kube::{Resource, ResourceExt};
use kube_sharding_api::{GroupResource, HashKey};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::owner_moves::{FollowTask, Following};
use super::pager::{Pager, PagerError};
use super::patch::{PatchError, Patcher, api_resource};
use crate::core::key::KeyOutcome;
use crate::core::list_scope::{ListScope, list_scope};
use crate::core::owner_wait::OwnerWait;
use crate::core::rebalance::RebalanceDecision;
use crate::leader::events::{
    REASON_PIN_UNSATISFIED, REASON_REBALANCE_FINISHED, REASON_REBALANCE_STARTED, REASON_SYNC_FAILED,
};
use crate::leader::observed::{DrainsSeen, RingObjects, uid_hash};
use crate::metrics::{Metrics, OutcomeLabels, RingLabel};
use crate::views::{ResolvedResource, RingView};

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
pub(super) enum Error {
    /// Listing a resource failed, or its continue tokens kept expiring.
    #[error("failed to list {resource}: {source}")]
    List {
        /// The resource.
        resource: GroupResource,
        /// Underlying error.
        #[source]
        source: PagerError,
    },
    /// Controlled objects wait for their controllers to leave their shard (drain acknowledged):
    /// each moves when its controller's drain is acknowledged, or at the next sync, soon.
    #[error("{waiting} controlled objects wait for their controllers to leave their shard")]
    WaitingForOwners {
        /// Controlled objects held back.
        waiting: usize,
        /// The task moving them as their controllers leave, when the sync could remember them
        /// all.
        following: Option<FollowTask>,
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
    Superseded {
        /// Moves it had in flight that landed where the newer view does not want them. The
        /// newer view's sync may have listed those objects before they landed, and then leaves
        /// them there: the ring is synced once more after it.
        unsettled: usize,
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
pub(super) struct SyncStats {
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
    if let Some(state) = placement.pin.state() {
        *tally.objects.pins.entry(state).or_default() += 1;
    }
    if let Some(problem) = placement.pin.problem()
        && tally.pin_problems.len() < MAX_PIN_EVENTS
    {
        tally
            .pin_problems
            .push((object_reference(gr, resource, meta), problem));
    }
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
    // A controlled object's key is its controller's key (with namespace keys, its namespace's):
    // main resources are synced first, so the controller was seen already if it is listed.
    if let Ok(KeyOutcome::Key(key)) = &placement.key {
        let available = |shard: &str| view.may_be_running(shard);
        if resource.is_main() {
            let leaving =
                placement.object.draining || placement.decision == RebalanceDecision::Drain;
            tally
                .owner_wait
                .main_listed(key, current, placement.desired, leaving);
        } else if placement.decision == RebalanceDecision::Move
            && if tally.children_first {
                tally
                    .owner_wait
                    .holds_back_unseen(current, placement.desired, available)
            } else {
                tally
                    .owner_wait
                    .holds_back(key, current, placement.desired, available)
            }
        {
            if let (Some(shard), Some(desired)) = (current, placement.desired) {
                tally.owner_wait.remember(
                    key,
                    gr,
                    meta.namespace.as_deref(),
                    meta.name.as_deref().unwrap_or_default(),
                    (shard, desired),
                );
            }
            return RebalanceDecision::Keep;
        }
    }
    placement.decision
}

/// Most Warning Events about unsatisfied pins one sync publishes (the process's Event budget
/// applies on top): the metric counts them all.
const MAX_PIN_EVENTS: usize = 50;

/// A reference to the listed object `meta` of `resource`, for an Event about it.
fn object_reference(
    gr: &GroupResource,
    resource: &ResolvedResource,
    meta: &kube::api::ObjectMeta,
) -> k8s_openapi::api::core::v1::ObjectReference {
    let api_version = if gr.group.is_empty() {
        resource.info.version.clone()
    } else {
        format!("{}/{}", gr.group, resource.info.version)
    };
    k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some(api_version),
        kind: Some(resource.info.kind.clone()),
        namespace: meta.namespace.clone(),
        name: meta.name.clone(),
        uid: meta.uid.clone(),
        ..Default::default()
    }
}

/// The ring's resources in the order a sync walks them: main resources first, then controlled
/// ones, each by group and name; controlled ones first when `children_first`.
///
/// Main objects must start draining before their controlled objects move: a controlled object
/// moved while its owner still sits on the old shard is written back by that shard. Walked first,
/// controlled objects on available shards are all held back, to move as the watch of drained
/// controllers sees theirs leave (see [`children_first`]).
fn sync_order(view: &RingView, children_first: bool) -> Vec<(&GroupResource, &ResolvedResource)> {
    let mut resources: Vec<_> = view.resources.iter().collect();
    resources.sort_by_key(|(gr, resource)| {
        (
            resource.is_main() == children_first,
            gr.group.as_str(),
            gr.resource.as_str(),
        )
    });
    resources
}

/// Whether a sync of `view` walks the controlled resources first and hands each held child to
/// the watch of drained controllers as it goes, so that children move as their controllers'
/// drains are acknowledged, while the sync still drains others: only where the shards leave
/// their controlled objects to the sharder (every available shard's Lease says so, or
/// `controller.sharder.shardsLeaveControlledObjects` is set; shards that relabel them would race
/// these moves), and in rings hashed by object, where a key
/// names one controller, so that seeing it leave the child's shard frees the child. In rings
/// hashed by namespace several main objects share a key, and children are handed over only after
/// every drain was answered.
fn children_first(ctx: &Context, view: &RingView) -> bool {
    (view.shards_leave_controlled_objects
        || ctx
            .config
            .controller
            .sharder
            .shards_leave_controlled_objects)
        && view.hash_key == HashKey::Object
        && view.resources.values().any(|r| !r.is_main())
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
    /// Controlled objects held back because their controller has not left their shard yet.
    owner_wait: OwnerWait,
    /// The task moving them as their controllers leave, from the first one held on.
    following: Option<Following>,
    /// Whether controlled objects are walked before the main ones ([`children_first`]).
    children_first: bool,
    /// Whether the held objects are left to the next sync instead: some of the sync's patches
    /// failed (a controller whose drain failed must not be taken for one that left), or it held
    /// more than it remembers.
    no_following: bool,
    /// Moves that did not land where the ring's current view wants them (counted as failed):
    /// when the view changed meanwhile, what a stopped sync reports (see
    /// [`Error::Superseded`]).
    unsettled: usize,
    /// Objects whose pin did not decide their shard, with why, for Warning Events.
    pin_problems: Vec<(k8s_openapi::api::core::v1::ObjectReference, String)>,
    /// Fires when a newer view supersedes this sync.
    stop: CancellationToken,
}

impl Tally {
    /// What a sync stopped for a newer view returns, with the moves it saw land elsewhere.
    fn superseded(&self) -> Error {
        Error::Superseded {
            unsettled: self.unsettled,
        }
    }
}

/// Syncs every resource of one ring, records what it saw for the metrics and publishes the
/// rebalance Events.
#[tracing::instrument(skip_all, fields(ring = %view.ring_ref()))]
pub(super) async fn sync_ring(
    patcher: &Patcher,
    view: &Arc<RingView>,
    stop: CancellationToken,
) -> Result<SyncStats, Error> {
    let ctx = &patcher.ctx;
    let ring = view.ring_ref();
    let started = Instant::now();
    let children_first = children_first(ctx, view);
    tracing::info!(%ring, shards = view.hash_ring.len(), children_first, "{SYNC_STARTED}");
    let mut stats = SyncStats::default();
    let mut tally = Tally {
        following: children_first
            .then(|| Following::start(patcher, Arc::clone(view), stop.clone(), true)),
        stop,
        owner_wait: OwnerWait::new(view.hash_key),
        children_first,
        ..Tally::default()
    };
    let mut first_error = None;
    let mut main_failed = false;
    let mut draining = false;
    for (gr, resource) in sync_order(view, children_first) {
        if tally.stop.is_cancelled() {
            return Err(tally.superseded());
        }
        if resource.is_main() && !std::mem::replace(&mut draining, true) {
            drains_may_go(&mut tally, &ring).await?;
        }
        if main_failed && !resource.is_main() {
            // Controllers not listed may still sit on their old shards: moving their controlled
            // objects now could put them ahead of their controllers. The sync fails and runs again.
            tracing::warn!(%ring, resource = %gr, "not syncing a controlled resource: a main resource could not be listed");
            continue;
        }
        if let Err(error) = sync_resource(patcher, view, gr, resource, &mut stats, &mut tally).await
        {
            main_failed |= resource.is_main();
            first_error.get_or_insert(error);
        }
    }
    if tally.stop.is_cancelled() {
        return Err(tally.superseded());
    }
    hand_over_held(patcher, view, &stats, &mut tally);
    let waiting = tally.owner_wait.waiting;
    // Only a complete listing of the main objects may free a child whose controller it did not
    // show on the child's shard.
    if tally.children_first
        && first_error.is_none()
        && let Some(following) = &tally.following
    {
        following.main_listed(std::mem::take(&mut tally.owner_wait));
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
    for (object, problem) in std::mem::take(&mut tally.pin_problems) {
        ctx.events
            .warning(&object, REASON_PIN_UNSATISFIED, "", problem)
            .await;
    }
    let reference = ctx.caches.ring(&ring).map(|r| r.object_ref());
    if first_error.is_none() {
        // Every main object was listed since the sync started: pins not seen are gone.
        view.pins.forget_unseen(&ring, started.into_std());
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
        None if waiting > 0 => Err(Error::WaitingForOwners {
            waiting,
            following: tally.following.take().map(Following::finish),
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

/// Longest a sync's first drain waits for the watch of drained controllers to list; after that
/// the sync drains without it and leaves the held objects to the next sync, so that a watch that
/// cannot list does not hold up the drains.
const DRAINS_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Before the sync's first drain: waits until the watch of drained controllers has listed, when
/// it walked the controlled objects first, so that every drain reaches the watch as an event. A
/// watch that ended or did not list within [`DRAINS_WAIT`] leaves the held objects to the next
/// sync.
async fn drains_may_go(tally: &mut Tally, ring: &kube_sharding_api::RingRef) -> Result<(), Error> {
    let Some(following) = &mut tally.following else {
        return Ok(());
    };
    let listed = tokio::select! {
        () = tally.stop.cancelled() => return Err(tally.superseded()),
        listed = tokio::time::timeout(DRAINS_WAIT, following.listed()) => listed.unwrap_or(false),
    };
    if !listed {
        tracing::warn!(%ring, "the watch of drained controllers did not list in time; the held objects wait for the next sync");
        tally.no_following = true;
        tally.following = None;
    }
    Ok(())
}

/// Hands the controlled objects held back since the last call to the task that moves them as
/// their controllers leave, starting it with the first of them.
///
/// With the controlled objects walked first the task runs from the start of the sync; otherwise
/// it starts here, once every patch of the ring's main resources was answered (controlled
/// objects are looked at after them), so its watch lists after all of the sync's drains.
fn hand_over_held(patcher: &Patcher, view: &Arc<RingView>, stats: &SyncStats, tally: &mut Tally) {
    if tally.no_following {
        return;
    }
    if stats.failed > 0 || stats.held > 0 {
        // The result is a failure, which leaves the held objects to the next sync.
        tally.no_following = true;
        tally.following = None;
        return;
    }
    let Some(children) = tally.owner_wait.take_held() else {
        // Held more than it remembers: the next sync moves them.
        tally.no_following = true;
        tally.following = None;
        return;
    };
    if children.is_empty() {
        return;
    }
    if tally.following.is_none() && !tally.children_first {
        tally.following = Some(Following::start(
            patcher,
            Arc::clone(view),
            tally.stop.clone(),
            false,
        ));
    }
    if let Some(following) = &tally.following {
        following.hand_over(children);
    }
}

/// Syncs every object of one resource of a ring, listed page by page; each page's objects are
/// patched before the next page's objects are looked at.
async fn sync_resource(
    patcher: &Patcher,
    view: &Arc<RingView>,
    gr: &GroupResource,
    resource: &ResolvedResource,
    stats: &mut SyncStats,
    tally: &mut Tally,
) -> Result<(), Error> {
    for api in list_apis(&patcher.ctx, view, gr, resource) {
        sync_list(patcher, view, gr, resource, api, stats, tally).await?;
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
    let (selected, all) = ctx.caches.selected_namespaces(&view.namespace_selector);
    match list_scope(selected.len(), all) {
        ListScope::Cluster => vec![Api::all_with(ctx.client.clone(), &ar)],
        ListScope::Namespaces => selected
            .iter()
            .map(|ns| Api::namespaced_with(ctx.client.clone(), ns, &ar))
            .collect(),
    }
}

/// Lists what `api` reaches page by page and patches each page's objects before asking for the
/// next page.
async fn sync_list(
    patcher: &Patcher,
    view: &Arc<RingView>,
    gr: &GroupResource,
    resource: &ResolvedResource,
    api: Api<DynamicObject>,
    stats: &mut SyncStats,
    tally: &mut Tally,
) -> Result<(), Error> {
    let ctx = &patcher.ctx;
    let info = &resource.info;
    let ar = &api_resource(gr, info);
    let ring = view.ring_ref();
    let labels = Metrics::resource_labels(&ring, &gr.group, &gr.resource);
    let concurrency = usize::try_from(ctx.config.controller.sharder.concurrent_moves)
        .unwrap_or(1)
        .max(1);
    // What this list has counted is counted again when it starts over from the first page.
    let checkpoint = (
        stats.listed,
        tally.objects.clone(),
        tally.owner_wait.waiting,
        tally.owner_wait.held_len(),
    );
    let mut pager = Pager::new(api);
    let mut next = tokio::select! {
        () = tally.stop.cancelled() => return Err(tally.superseded()),
        next = pager.next_page() => next,
    };
    loop {
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
            tally.owner_wait.waiting = checkpoint.2;
            tally.owner_wait.truncate_held(checkpoint.3);
        }
        stats.listed += page.items.len();
        let actions: Vec<(PartialObjectMeta<DynamicObject>, RebalanceDecision)> = page
            .items
            .into_iter()
            .filter(|obj| {
                !info.namespaced
                    || obj.metadata.namespace.as_deref().is_some_and(|ns| {
                        ctx.caches.namespace_selected(&view.namespace_selector, ns)
                    })
            })
            .map(|obj| {
                let decision = tally_object(view, gr, resource, &obj.metadata, tally);
                (obj, decision)
            })
            .filter(|(_, d)| *d != RebalanceDecision::Keep)
            .collect();
        if !resource.is_main() {
            // Each held child may move as soon as its controller left, while the sync goes on.
            hand_over_held(patcher, view, stats, tally);
        }
        if !actions.is_empty() && !tally.announced {
            tally.announced = true;
            if let Some(ring) = ctx.caches.ring(&ring) {
                let note = format!(
                    "Rebalancing onto {} available shards: objects whose shard changed are drained or moved",
                    view.hash_ring.len()
                );
                ctx.events
                    .normal(&ring.object_ref(), REASON_REBALANCE_STARTED, "", note)
                    .await;
            }
        }
        let ring = &ring;
        let stop = &tally.stop;
        let patches = futures::stream::iter(actions)
            .map(|(obj, decision)| async move {
                let uid = obj.uid().unwrap_or_default();
                // Checked as each patch is about to start (the stream starts one per free
                // slot): a superseded sync sends nothing more.
                if stop.is_cancelled() {
                    return (uid, decision, None);
                }
                let result = patcher.patch(view, gr, ar, obj.meta(), decision).await;
                match &result {
                    // Counted and tracked as each patch lands, not when the batch is done: a
                    // sync superseded by a newer view is aborted mid-batch, and the patches it
                    // sent must still count and their drains still be watched for stuck ones.
                    Ok(()) => {
                        patcher.count(view, gr, decision);
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
            .collect::<Vec<PatchOutcome>>();
        // The next page is asked for while this page's patches are in flight: on a busy API
        // server a page takes hundreds of milliseconds to list, which every page of a sync that
        // drains would otherwise add to the drains' wait.
        let following = async {
            tokio::select! {
                () = stop.cancelled() => None,
                next = pager.next_page() => Some(next),
            }
        };
        let (results, following) = tokio::join!(patches, following);
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
                Err(PatchError::NotAssigned) => {
                    stats.failed += 1;
                    tally.unsettled += usize::from(decision == RebalanceDecision::Move);
                }
                // The view changed under the sync; the next sync decides with the shard back.
                Err(PatchError::ShardBack) => {}
                Err(_) => stats.failed += 1,
            }
        }
        next = following.ok_or_else(|| tally.superseded())?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn main_resources_sync_before_controlled_ones() {
        use crate::views::{ResourceInfo, build_view};
        use kube_sharding_api::{ClusterRing, ClusterRingSpec, RingResource};
        use std::collections::BTreeMap;
        use std::collections::HashMap;

        let info = |kind: &str| ResourceInfo {
            kind: kind.into(),
            version: "v1".into(),
            namespaced: true,
        };
        let ring = ClusterRing::new(
            "r",
            ClusterRingSpec {
                resources: vec![
                    RingResource::controlling(
                        "",
                        "secrets",
                        vec![GroupResource::new("", "configmaps")],
                    ),
                    RingResource::controlling(
                        "apps",
                        "deployments",
                        vec![GroupResource::new("apps", "replicasets")],
                    ),
                ],
                namespace_selector: None,
                hash_key: None,
                lease_namespaces: Vec::new(),
                assignment: None,
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
        let order: Vec<String> = sync_order(&view, false)
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
