//! One sync of one ring: every object of its resources listed metadata-only, page by page, each
//! page's drains and moves sent while the next page is asked for, and done before its objects
//! are looked at.

use std::collections::HashSet;
use std::sync::Arc;

use crate::context::Context;
use crate::records;

use futures::StreamExt;
use kube::api::{Api, DynamicObject};
use kube::core::PartialObjectMeta;
use kube::{Resource, ResourceExt};
use kube_sharding_api::GroupResource;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::owner_moves::{FollowTask, Handover};
use super::pager::{Pager, PagerError};
use super::patch::{PatchError, Patcher, api_resource};
use crate::core::list_scope::{ListScope, list_scope};
use crate::core::rebalance::RebalanceDecision;
pub(super) use crate::core::sync_rules::SyncStats;
use crate::core::sync_rules::{ObjectTally, Outcome, children_first, outcome, sync_order};
use crate::leader::events::{
    REASON_PIN_UNSATISFIED, REASON_REBALANCE_FINISHED, REASON_REBALANCE_STARTED, REASON_SYNC_FAILED,
};
use crate::leader::observed::{DrainsSeen, uid_hash};
use crate::metrics::{Metrics, OutcomeLabels, RingLabel};
use crate::views::{ResolvedResource, RingView};

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

/// What became of one patch of a sync: the object's UID, the decision and the result (`None`:
/// not sent, the sync was superseded first).
type PatchOutcome = (String, RebalanceDecision, Option<Result<(), PatchError>>);

/// Counts one listed object of `view` into `tally` and returns its decision (the rules are
/// [`ObjectTally::count`]'s); notes its drain label and a pin that did not decide its shard.
fn tally_object(
    view: &RingView,
    gr: &GroupResource,
    resource: &ResolvedResource,
    meta: &kube::api::ObjectMeta,
    tally: &mut Tally,
) -> RebalanceDecision {
    let placement = view.placement(&gr.group, resource, meta);
    if let Some(problem) = placement.pin.problem()
        && tally.pin_problems.len() < MAX_PIN_EVENTS
    {
        tally
            .pin_problems
            .push((object_reference(gr, resource, meta), problem));
    }
    if placement.object.draining {
        tally.draining.insert(
            meta.uid.as_deref().unwrap_or_default(),
            placement.object.current.unwrap_or_default(),
        );
    }
    tally.counts.count(
        gr,
        resource.is_main(),
        (
            meta.namespace.as_deref(),
            meta.name.as_deref().unwrap_or_default(),
        ),
        &placement,
        |shard| view.may_be_running(shard),
    )
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

/// What one sync learned besides its counts: objects per shard, unassigned and draining
/// objects, drains sent, and whether a rebalance began.
#[derive(Debug)]
struct Tally {
    /// Objects per shard, unassigned and pinned, and the controlled objects held back.
    counts: ObjectTally,
    /// Every listed object carrying the drain label, with its shard.
    draining: DrainsSeen,
    /// [`uid_hash`]es of the objects this sync drained.
    drained_now: HashSet<u64>,
    /// Whether the "rebalance started" Event went out.
    announced: bool,
    /// The handover of the held controlled objects to the task that moves them as their
    /// controllers leave.
    handover: Handover,
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
    let children_first = children_first(
        view.shards_leave_controlled_objects
            || ctx
                .config
                .controller
                .sharder
                .shards_leave_controlled_objects,
        view.hash_key,
        view.resources.values().any(|r| !r.is_main()),
    );
    tracing::info!(event = records::EVENT_SYNC_STARTED, %ring, shards = view.hash_ring.len(), children_first, "starting sync of ring");
    let mut stats = SyncStats::default();
    let mut tally = Tally {
        counts: ObjectTally::new(view.hash_key, children_first),
        draining: DrainsSeen::default(),
        drained_now: HashSet::new(),
        announced: false,
        handover: Handover::start(patcher, view, stop.clone(), children_first),
        unsettled: 0,
        pin_problems: Vec::new(),
        stop,
    };
    let mut first_error = None;
    let mut main_failed = false;
    let mut draining = false;
    for (gr, resource) in sync_order(&view.resources, ResolvedResource::is_main, children_first) {
        if tally.stop.is_cancelled() {
            return Err(tally.superseded());
        }
        if resource.is_main() && !std::mem::replace(&mut draining, true) {
            tally.handover.drains_may_go().await;
            if tally.stop.is_cancelled() {
                return Err(tally.superseded());
            }
        }
        if main_failed && !resource.is_main() {
            // Controllers not listed may still sit on their old shards: moving their controlled
            // objects now could put them ahead of their controllers. The sync fails and runs again.
            tracing::warn!(event = records::EVENT_RESOURCE_NOT_SYNCED, %ring, resource = %gr, "not syncing a controlled resource: a main resource could not be listed");
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
    hand_over_held(&stats, &mut tally);
    let waiting = tally.counts.owner_wait.waiting;
    if first_error.is_none() {
        tally.handover.main_listed(&mut tally.counts.owner_wait);
    }
    let duration = started.elapsed();
    tracing::info!(
        event = records::EVENT_SYNC_FINISHED,
        %ring,
        ?duration,
        listed = stats.listed,
        drained = stats.drained,
        moved = stats.moved,
        failed = stats.failed,
        held = stats.held,
        "finished sync of ring"
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
            std::mem::take(&mut tally.counts.objects),
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
        None => match outcome(&stats, waiting) {
            Outcome::Synced => Ok(stats),
            Outcome::PatchesFailed { failed, attempted } => {
                Err(Error::Patches { failed, attempted })
            }
            Outcome::Held { held } => Err(Error::WebhookUnreachable { held }),
            Outcome::Waiting { waiting } => Err(Error::WaitingForOwners {
                waiting,
                following: tally.handover.finish(),
            }),
        },
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

/// Hands the controlled objects held back since the last call over (see
/// [`Handover::hand_over`]); a sync with failed or held patches leaves them to the next sync.
fn hand_over_held(stats: &SyncStats, tally: &mut Tally) {
    tally.handover.hand_over(
        &mut tally.counts.owner_wait,
        stats.failed > 0 || stats.held > 0,
    );
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
    let checkpoint = (stats.listed, tally.counts.checkpoint());
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
            tracing::info!(event = records::EVENT_LIST_CONTINUED_INCONSISTENTLY, %ring, resource = %gr, "continue token expired (410 Gone); listing on from where it stopped, at the current revision");
        }
        if page.restarted {
            ctx.metrics.list_restarts.get_or_create(&labels).inc();
            tracing::info!(event = records::EVENT_LIST_RESTARTED, %ring, resource = %gr, "continue token expired (410 Gone) with no token to go on with; listing again from the first page");
            stats.listed = checkpoint.0;
            tally.counts.rewind(&checkpoint.1);
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
            hand_over_held(stats, tally);
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
mod tests;
