//! The sharder controller's loop: one sync per ring at a time, started when the ring's view
//! changes, periodically, or after a backoff; a sync of an outdated view is stopped.

use std::collections::HashMap;
use std::sync::Arc;

use kube_sharding_api::RingRef;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::announce::{Announcer, DRAIN_CHECK_PERIOD};
use super::missed_assignments::MissedAssignments;
use super::owner_moves::OwnerMoves;
use super::patch::Patcher;
use super::sync::{Error, SyncStats, sync_ring};
use crate::context::Context;
use crate::core::sync_schedule::SyncSchedule;
use crate::leader::events::REASON_WEBHOOK_UNREACHABLE;
use crate::metrics::OutcomeLabels;
use crate::records;
use crate::views::RingView;

/// Runs the sharder controller until `shutdown` fires. Dropping it (on lost leadership) stops the
/// syncs and the missed-assignment watches it started, which it owns.
pub(crate) async fn run(ctx: Context, shutdown: CancellationToken) {
    let mut changes = ctx.views.subscribe();
    let mut schedule = SyncSchedule::new(ctx.config.controller.sharder.sync_period.0);
    let mut running: JoinSet<(String, u64, Result<SyncStats, Error>)> = JoinSet::new();
    // The sync each ring runs now, by a number unique per started sync: a sync stopped just as
    // it finished must not be taken for its successor.
    let mut started_syncs = 0u64;
    // Running syncs by ring, with the token that stops one when a newer view supersedes it.
    let mut handles: HashMap<String, (u64, CancellationToken)> = HashMap::new();
    let patcher = Patcher::new(ctx.clone());
    let mut missed = MissedAssignments::default();
    let mut owner_moves = OwnerMoves::default();
    let mut announcer = Announcer::default();
    let mut drain_check = tokio::time::interval(DRAIN_CHECK_PERIOD);
    loop {
        let now = Instant::now();
        let views = ctx.views.all();
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
            tracing::info!(event = records::EVENT_SYNC_SUPERSEDED, ring = %key, "view changed during the sync; starting over with the current view");
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
            // The sync looks at the children left to follow their controllers itself.
            owner_moves.stop(&key);
            let (patcher, view) = (patcher.clone(), Arc::clone(view));
            let task_key = key.clone();
            started_syncs += 1;
            let id = started_syncs;
            let stop = shutdown.child_token();
            let task_stop = stop.clone();
            running
                .spawn(async move { (task_key, id, sync_ring(&patcher, &view, task_stop).await) });
            handles.insert(key, (id, stop));
        }
        owner_moves.retain(|key| keyed.contains_key(key));
        missed.reconcile(&patcher, &views);
        announcer.membership(&ctx, &views).await;

        tokio::select! {
            () = shutdown.cancelled() => break,
            _ = changes.changed() => {}
            _ = drain_check.tick() => {
                for ring in announcer.stuck_drains(&ctx).await {
                    schedule.again(&ring.to_string(), Instant::now());
                }
            }
            () = tokio::time::sleep_until(schedule.next_wake(now)) => {}
            (name, followed) = owner_moves.next_done() => {
                schedule.followed(&name, followed.failed == 0, Instant::now());
            }
            Some(joined) = running.join_next(), if !running.is_empty() => {
                // A superseded sync was accounted for when it was stopped.
                let Ok((name, id, result)) = joined else { continue };
                if let Err(Error::Superseded { unsettled }) = &result
                    && *unsettled > 0
                {
                    tracing::info!(event = records::EVENT_SUPERSEDED_MOVES_UNSETTLED, ring = %name, unsettled, "moves of a superseded sync landed where the current view does not want them; syncing the ring again");
                    schedule.again(&name, Instant::now());
                }
                if handles.get(&name).is_none_or(|(current, _)| *current != id) {
                    continue;
                }
                handles.remove(&name);
                let error = result.as_ref().err().map(ToString::to_string);
                let now = Instant::now();
                let (waiting, retry) = match result {
                    Err(Error::WaitingForOwners { following: Some(following), .. }) => {
                        owner_moves.adopt(name.clone(), following);
                        (true, schedule.following(&name, now))
                    }
                    Err(Error::WaitingForOwners { following: None, .. }) => {
                        (true, schedule.waiting(&name, now))
                    }
                    result => (false, schedule.finished(&name, result.is_ok(), now)),
                };
                if let Some(backoff) = retry {
                    let error = error.unwrap_or_default();
                    if waiting {
                        tracing::info!(event = records::EVENT_SYNC_WAITING, %error, ring = %name, retry_in = ?backoff, "sync again soon");
                    } else {
                        tracing::warn!(event = records::EVENT_SYNC_FAILED, %error, ring = %name, retry_in = ?backoff, "sync failed");
                    }
                }
            }
        }
    }
    missed.stop();
    running.shutdown().await;
}

/// Whether the ring's webhook configuration has been applied for its current spec: the ring
/// controller sets `Ready=True` with the ring's generation only after applying it, or
/// `Ready=False` for a webhook the API server does not reach (applied, but not answering: the
/// sync still runs, for drains and for probing it).
fn webhook_in_place(ctx: &Context, ring: &RingRef) -> bool {
    ctx.caches.ring(ring).is_some_and(|ring| {
        let generation = ring.meta().generation;
        ring.status().is_some_and(|s| {
            s.conditions.iter().any(|c| {
                c.type_ == kube_sharding_api::cluster_ring::CONDITION_READY
                    && (c.status == "True" || c.reason == REASON_WEBHOOK_UNREACHABLE)
                    && c.observed_generation == generation
            })
        })
    })
}
