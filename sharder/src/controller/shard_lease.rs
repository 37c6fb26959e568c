//! The shard-lease controller (SPEC §4): keeps each shard Lease's state label current, takes over
//! `uncertain` Leases, deletes `orphaned` ones, and requeues exactly at the next state boundary.

use std::collections::{BTreeSet, HashMap};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::{self, Action, applier};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use sharding_crds::labels::LABEL_STATE;
use sharding_crds::lease::{ShardLease, ShardState};
use sharding_crds::{RingKind, RingObject, RingRef};
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;

use crate::context::{AnyRing, Context};
use crate::core::membership::{Exclusion, ring_members};
use crate::lease_index::{LeaseChange, LeaseIndex};

/// Reason of the Normal Event on a ring when the sharder declares one of its shards dead.
pub const REASON_SHARD_DEAD: &str = "ShardDead";

/// Reason of the Warning Event about a weight annotation that is not a valid weight.
const REASON_INVALID_WEIGHT: &str = "InvalidShardWeight";

/// Longest requeue; far-away boundaries (absurd durations) are re-evaluated at least this often.
const MAX_REQUEUE: Duration = Duration::from_secs(3600);

/// Errors of one reconciliation; the Lease is retried after a short delay.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// A write to the API failed (a conflict means the Lease changed and a new event follows).
    #[error("failed to {action} Lease {namespace}/{name}: {source}")]
    Write {
        /// What was attempted.
        action: &'static str,
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        name: String,
        /// Underlying error.
        #[source]
        source: kube::Error,
    },
}

/// Runs the controller of the shard Leases of rings of type `R` until `shutdown` fires.
///
/// It is driven by the Lease index rather than by a watch of its own: a Lease is reconciled when
/// it appears, when its membership or state changes (never on a plain renewal), when its ring
/// appears, and at the state boundary its last reconcile computed. So renewals cost it nothing,
/// and each Lease is looked at about once per Lease duration.
pub(crate) async fn run<R: RingObject>(ctx: Context, shutdown: CancellationToken) {
    let kind = R::KIND;
    let index = ctx.lease_index(kind).clone();
    let store = index.store().clone();
    let queue = triggers(ctx.clone(), index).take_until(shutdown.cancelled_owned());
    let state = Arc::new(State {
        ctx,
        kind,
        reported: Mutex::default(),
        problems: Mutex::default(),
    });
    applier(
        |lease, state| Box::pin(reconcile(lease, state)),
        error_policy,
        state,
        store,
        queue,
        controller::Config::default(),
    )
    .for_each(|result| async move {
        if let Err(error) = result {
            tracing::debug!(%error, "shard lease reconciliation failed");
        }
    })
    .await;
}

/// The Leases to reconcile: every cached one at first and after the cache was listed again,
/// then those the index reports changed, and those of rings that appear.
fn triggers(
    ctx: Context,
    index: Arc<LeaseIndex>,
) -> impl Stream<Item = Result<ObjectRef<Lease>, Infallible>> + Send + 'static {
    let kind = index.kind();
    let changes = index.subscribe();
    let rings = ctx.ring_changes.subscribe();
    let every = |index: &LeaseIndex| {
        index
            .store()
            .state()
            .iter()
            .map(|l| ObjectRef::from_obj(l.as_ref()))
            .collect::<Vec<_>>()
    };
    let start = every(&index);
    let known_rings = ring_names(&ctx, kind);
    let state = (ctx, index, changes, rings, known_rings);
    futures::stream::iter(start)
        .chain(
            futures::stream::unfold(state, move |mut state| async move {
                let (ctx, index, changes, rings, known_rings) = &mut state;
                let batch = tokio::select! {
                    change = changes.recv() => match change {
                        Ok(LeaseChange::Membership { lease, .. } | LeaseChange::State(lease)) => {
                            vec![lease]
                        }
                        Ok(LeaseChange::All) | Err(RecvError::Lagged(_)) => every(index),
                        Err(RecvError::Closed) => return None,
                    },
                    changed = rings.changed() => {
                        changed.ok()?;
                        // Leases of a ring that did not exist were left alone: look at them now.
                        let current = ring_names(ctx, kind);
                        let new: Vec<_> = current
                            .difference(known_rings)
                            .flat_map(|ring| index.ring_lease_refs(ring))
                            .collect();
                        *known_rings = current;
                        new
                    }
                };
                Some((futures::stream::iter(batch), state))
            })
            .flatten(),
        )
        .map(Ok)
}

/// The names of the cached rings of `kind`.
fn ring_names(ctx: &Context, kind: RingKind) -> BTreeSet<String> {
    ctx.rings()
        .iter()
        .map(AnyRing::ring_ref)
        .filter(|r| r.kind == kind)
        .map(|r| r.name)
        .collect()
}

/// The controller's context: the shared one, its ring kind, and the problems already reported.
struct State {
    ctx: Context,
    kind: RingKind,
    /// Lease UID → the problems (exclusion, invalid weight) Warning Events were published for, so
    /// that renewals (every few seconds per shard) do not publish them again.
    reported: Mutex<HashMap<String, Problems>>,
    /// Each ring's Lease problems by Lease UID, with the ring's membership version they are of.
    problems: Mutex<HashMap<RingRef, (RingVersion, Arc<ProblemsByUid>)>>,
}

/// A ring's membership version, from [`LeaseIndex::ring_version`].
type RingVersion = (u64, u64);

/// Problems of Leases by their UID; Leases without problems are absent.
type ProblemsByUid = HashMap<String, Problems>;

/// What is wrong with a shard Lease, as reported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Problems {
    exclusion: Option<Exclusion>,
    weight: Option<String>,
}

fn error_policy(_lease: Arc<Lease>, error: &Error, _state: Arc<State>) -> Action {
    tracing::warn!(%error, "failed to reconcile shard Lease");
    Action::requeue(Duration::from_secs(5))
}

/// Reconciles one Lease at the current time.
#[tracing::instrument(skip_all, fields(lease = %lease.name_any(), namespace = lease.namespace().unwrap_or_default()))]
async fn reconcile(lease: Arc<Lease>, state: Arc<State>) -> Result<Action, Error> {
    let ctx = &state.ctx;
    let kind = state.kind;
    let Some(ring) = lease.labels().get(kind.lease_label()) else {
        return Ok(Action::await_change());
    };
    let ring_ref = RingRef::new(kind, ring.clone());
    let Some(ring_object) = ctx.ring(&ring_ref) else {
        // Leases of rings that do not exist are not ours to manage.
        return Ok(Action::await_change());
    };
    let problems = report_problems(&state, &lease, &ring_object).await;
    if problems.exclusion == Some(Exclusion::BothRingKinds) {
        // Used by neither kind's ring (SPEC §15), so neither controller labels, takes over or
        // deletes it: it is not clear whose it is.
        return Ok(Action::await_change());
    }
    let namespace = lease.namespace().unwrap_or_default();
    let name = lease.name_any();
    let api: Api<Lease> = Api::namespaced(ctx.client.clone(), &namespace);
    let write_err = |action| {
        let (namespace, name) = (namespace.clone(), name.clone());
        move |source| Error::Write {
            action,
            namespace,
            name,
            source,
        }
    };

    let now = Timestamp::now();
    let view = ShardLease::from_lease(&lease);
    let (state, next) = view.evaluate(now);
    match state {
        ShardState::Uncertain => {
            // The shard stopped renewing long ago. Taking the Lease over with an update guarded by
            // resourceVersion proves the API server is reachable and the shard can no longer
            // renew, so it must have stopped: from here on it is dead and its objects can move.
            let mut taken = (*lease).clone();
            let spec = taken.spec.get_or_insert_with(Default::default);
            view.takeover(now).apply(spec);
            taken
                .labels_mut()
                .insert(LABEL_STATE.into(), ShardState::Dead.as_str().into());
            taken.metadata.managed_fields = None;
            api.replace(&name, &PostParams::default(), &taken)
                .await
                .map_err(write_err("take over"))?;
            tracing::info!(ring = %ring, shard = %name, "took over the Lease of an unresponsive shard");
            let note = format!(
                "Shard {name} stopped renewing its Lease and was declared dead; its objects move to the available shards"
            );
            ctx.events
                .normal(&ring_object.object_ref(), REASON_SHARD_DEAD, &name, note)
                .await;
            // The write triggers a new event, which computes the next boundary.
            Ok(Action::await_change())
        }
        ShardState::Orphaned => {
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: lease.resource_version(),
                    uid: lease.uid(),
                }),
                ..Default::default()
            };
            match api.delete(&name, &params).await {
                Ok(_) => {
                    tracing::info!(ring = %ring, shard = %name, "deleted orphaned shard Lease")
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(write_err("delete")(e)),
            }
            Ok(Action::await_change())
        }
        _ => {
            if lease.labels().get(LABEL_STATE).map(String::as_str) != Some(state.as_str()) {
                let patch = serde_json::json!({"metadata": {
                    "resourceVersion": lease.resource_version(),
                    "labels": {LABEL_STATE: state.as_str()},
                }});
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(write_err("label"))?;
            }
            Ok(requeue_at(next, now))
        }
    }
}

/// The problems of every Lease of `ring` by UID, computed once per membership change of the
/// ring: a reconcile at a Lease's state boundary (about once per Lease duration per shard) must
/// not cost work proportional to the ring's size.
fn ring_problems(state: &State, ring: &RingRef) -> Arc<ProblemsByUid> {
    let index = state.ctx.lease_index(ring.kind);
    let version = index.ring_version(&ring.name);
    if let Ok(cache) = state.problems.lock()
        && let Some((cached, problems)) = cache.get(ring)
        && *cached == version
    {
        return problems.clone();
    }
    let leases = index.ring_leases(&ring.name);
    let problems: ProblemsByUid =
        ring_members(ring.kind, &ring.name, leases.iter().map(AsRef::as_ref))
            .into_iter()
            .map(|m| {
                let problems = Problems {
                    exclusion: m.exclusion,
                    weight: m.weight_error,
                };
                (m.lease.uid().unwrap_or_default(), problems)
            })
            .filter(|(_, p)| *p != Problems::default())
            .collect();
    let problems = Arc::new(problems);
    if let Ok(mut cache) = state.problems.lock() {
        cache.insert(ring.clone(), (version, problems.clone()));
    }
    problems
}

/// Publishes Warning Events about what is wrong with a shard Lease, once per Lease and problem:
/// on the Lease and its ring when it is kept out of the ring (SPEC §15, §18), on the Lease when
/// its weight annotation is invalid (SPEC §17). Returns the Lease's current problems.
async fn report_problems(state: &State, lease: &Lease, ring: &AnyRing) -> Problems {
    let ctx = &state.ctx;
    let kind = state.kind;
    let ring_ref = ring.ring_ref();
    let uid = lease.uid().unwrap_or_default();
    let problems = ring_problems(state, &ring_ref)
        .get(&uid)
        .cloned()
        .unwrap_or_default();
    let previous = {
        let Ok(mut reported) = state.reported.lock() else {
            return problems;
        };
        if problems == Problems::default() {
            reported.remove(&uid);
            return problems;
        }
        match reported.insert(uid, problems.clone()) {
            Some(previous) if previous == problems => return problems,
            previous => previous.unwrap_or_default(),
        }
    };
    let shard = lease.name_any();
    let namespace = lease.namespace().unwrap_or_default();
    if let Some(exclusion) = problems
        .exclusion
        .as_ref()
        .filter(|e| previous.exclusion.as_ref() != Some(*e))
    {
        let message = exclusion.message(kind, &ring_ref.name, &shard);
        tracing::warn!(ring = %ring_ref, %shard, %namespace, reason = exclusion.reason(), "{message}");
        for reference in [lease.object_ref(&()), ring.object_ref()] {
            ctx.events
                .warning(
                    &reference,
                    exclusion.reason(),
                    &uid_of(lease),
                    message.clone(),
                )
                .await;
        }
    }
    if let Some(error) = problems
        .weight
        .as_ref()
        .filter(|e| previous.weight.as_ref() != Some(*e))
    {
        let message = format!("Shard {shard:?} of {ring_ref}: {error}");
        tracing::warn!(ring = %ring_ref, %shard, %namespace, reason = REASON_INVALID_WEIGHT, "{message}");
        ctx.events
            .warning(&lease.object_ref(&()), REASON_INVALID_WEIGHT, "", message)
            .await;
    }
    problems
}

/// The UID of a Lease, naming it in Event subjects on its ring.
fn uid_of(lease: &Lease) -> String {
    lease.uid().unwrap_or_default()
}

/// Requeue exactly at `boundary` (plus a millisecond so the new state has begun).
fn requeue_at(boundary: Option<Timestamp>, now: Timestamp) -> Action {
    match boundary {
        None => Action::await_change(),
        Some(at) => {
            let wait = at
                .duration_since(now)
                .try_into()
                .unwrap_or(Duration::ZERO)
                .min(MAX_REQUEUE);
            Action::requeue(wait + Duration::from_millis(1))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requeue_is_capped_and_exact() {
        let now = Timestamp::from_second(1_000).unwrap();
        let at = Timestamp::from_second(1_010).unwrap();
        assert_eq!(
            requeue_at(Some(at), now),
            Action::requeue(Duration::from_secs(10) + Duration::from_millis(1))
        );
        assert_eq!(
            requeue_at(Some(Timestamp::MAX), now),
            Action::requeue(MAX_REQUEUE + Duration::from_millis(1))
        );
        assert_eq!(requeue_at(None, now), Action::await_change());
        assert_eq!(
            requeue_at(Some(now), at),
            Action::requeue(Duration::from_millis(1))
        );
    }
}
