//! The shard-lease controller (docs/protocol.md §4): keeps each shard Lease's state label current,
//! takes over `uncertain` Leases, deletes `orphaned` ones, and looks at each Lease again exactly at
//! its next state boundary.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, Preconditions};
use kube::runtime::controller::{self, Action, applier};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use kube_sharding_api::labels::{ANNOTATION_EXCLUDED, LABEL_STATE};
use kube_sharding_api::lease::{ShardLease, ShardState};
use kube_sharding_api::{RingKind, RingObject, RingRef};
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;
use tokio_util::time::{DelayQueue, delay_queue};

use crate::caches::{LeaseIndex, SKEW_WARNING, state_label_is_stale};
use crate::changes::LeaseChange;
use crate::context::Context;
use crate::core::any_ring::AnyRing;
use crate::core::membership::{Exclusion, ring_members};
use crate::leader::events::{
    REASON_CLOCK_SKEW, REASON_INVALID_LEAVES_CONTROLLED_OBJECTS, REASON_INVALID_WEIGHT,
    REASON_SHARD_DEAD,
};

/// Longest requeue; far-away boundaries (absurd durations) are re-evaluated at least this often.
const MAX_REQUEUE: Duration = Duration::from_secs(3600);

/// How soon a returning shard's Lease is looked at again while direct moves off the shard are in
/// flight, in case the notice that the last one landed was missed: the notice is what normally
/// brings it back ([`Triggers::next_batch`]).
const READY_RECHECK: Duration = Duration::from_secs(1);

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
/// appears, and when a state boundary passes with its state label wrong ([`triggers`]). So
/// renewals cost it nothing, and a renewed Lease is only looked at (a timer and a state
/// evaluation) about once per Lease duration.
pub(crate) async fn run<R: RingObject>(ctx: Context, shutdown: CancellationToken) {
    let kind = R::KIND;
    let index = ctx.caches.lease_index(kind).clone();
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
/// then those the index reports changed, those of rings that appear, and those whose state
/// boundary passed with their state label now wrong.
///
/// The boundaries are kept here rather than as requeues of the reconciler: at 1,000 shards with
/// a 10 s Lease duration about 100 boundaries pass per second, nearly all of them moved by a
/// renewal meanwhile; checking one here is a map lookup and a state evaluation, where a
/// reconcile is a task, a span and a scheduler entry.
fn triggers(
    ctx: Context,
    index: Arc<LeaseIndex>,
) -> impl Stream<Item = Result<ObjectRef<Lease>, Infallible>> + Send + 'static {
    let state = Triggers {
        kind: index.kind(),
        changes: ctx.caches.changes.lease_changes(index.kind()),
        landed: ctx.caches.changes.landed_direct_moves(),
        rings: ctx.caches.changes.rings(),
        known_rings: ring_names(&ctx, index.kind()),
        boundaries: Boundaries::default(),
        ctx,
        index,
    };
    futures::stream::unfold((state, true), |(mut state, first)| async move {
        let batch = if first {
            state.every()
        } else {
            state.next_batch().await?
        };
        for lease in &batch {
            state.boundaries.schedule(lease, state.index.store());
        }
        Some((futures::stream::iter(batch), (state, false)))
    })
    .flatten()
    .map(Ok)
}

/// What [`triggers`] follows.
struct Triggers {
    kind: RingKind,
    ctx: Context,
    index: Arc<LeaseIndex>,
    changes: tokio::sync::broadcast::Receiver<LeaseChange>,
    /// (ring, shard) when the last direct move off the shard landed: a returning shard's Lease
    /// may be labelled `ready` now (docs/protocol.md §22).
    landed: tokio::sync::broadcast::Receiver<(RingRef, String)>,
    rings: tokio::sync::watch::Receiver<u64>,
    /// Each ring of the kind with its `spec.leaseNamespaces`.
    known_rings: BTreeMap<String, Vec<String>>,
    boundaries: Boundaries,
}

impl Triggers {
    /// Every cached Lease.
    fn every(&self) -> Vec<ObjectRef<Lease>> {
        self.index
            .store()
            .state()
            .iter()
            .map(|l| ObjectRef::from_obj(l.as_ref()))
            .collect()
    }

    /// The next Leases to reconcile; `None` when the sources are gone.
    async fn next_batch(&mut self) -> Option<Vec<ObjectRef<Lease>>> {
        loop {
            let batch = tokio::select! {
                change = self.changes.recv() => match change {
                    Ok(LeaseChange::Membership { lease, rings }) => {
                        // Copies of its name in other namespaces may have gained or lost the
                        // shard with it (docs/protocol.md §18): their exclusion changes too.
                        let mut batch: Vec<_> = rings
                            .iter()
                            .flat_map(|ring| self.index.ring_lease_refs_named(ring, &lease.name))
                            .filter(|other| *other != lease)
                            .collect();
                        batch.push(lease);
                        batch
                    }
                    Ok(LeaseChange::State(lease)) => vec![lease],
                    Ok(LeaseChange::All) | Err(RecvError::Lagged(_)) => self.every(),
                    Err(RecvError::Closed) => return None,
                },
                landed = self.landed.recv() => match landed {
                    Ok((ring, shard)) if ring.kind == self.kind => {
                        self.index.ring_lease_refs_named(&ring.name, &shard)
                    }
                    Ok(_) => continue,
                    Err(RecvError::Lagged(_)) => self.every(),
                    Err(RecvError::Closed) => return None,
                },
                changed = self.rings.changed() => {
                    changed.ok()?;
                    // Leases of a ring that did not exist were left alone, and a ring that names
                    // other namespaces for its Leases changes which are kept out: look at them now.
                    let current = ring_names(&self.ctx, self.kind);
                    let new: Vec<_> = current
                        .iter()
                        .filter(|(ring, allowed)| self.known_rings.get(*ring) != Some(allowed))
                        .flat_map(|(ring, _)| self.index.ring_lease_refs(ring))
                        .collect();
                    self.known_rings = current;
                    new
                }
                Some(due) = self.boundaries.next_due() => {
                    // Reconcile only if the state changed; otherwise (renewed meanwhile) wait
                    // for the new boundary.
                    match self.index.store().get(&due) {
                        Some(lease) if state_label_is_stale(&lease, Timestamp::now()) => vec![due],
                        Some(_) => {
                            self.boundaries.schedule(&due, self.index.store());
                            continue;
                        }
                        None => continue,
                    }
                }
            };
            return Some(batch);
        }
    }
}

/// Timers fire on multiples of this after [`Boundaries::epoch`]. With 1,000 shards about 100
/// boundaries pass each second, and a timer of its own for each would wake the process 100 times
/// a second; on a tick they are handled together, at most 4 times a second, for at most 250 ms of
/// delay on a state label (and on what follows from it, a shard leaving the ring when its Lease
/// expired), next to Lease durations of seconds.
const BOUNDARY_TICK: Duration = Duration::from_millis(250);

/// The next state boundary of each Lease, as timers.
struct Boundaries {
    queue: DelayQueue<ObjectRef<Lease>>,
    keys: HashMap<ObjectRef<Lease>, delay_queue::Key>,
    /// Where the ticks count from.
    epoch: tokio::time::Instant,
}

impl Default for Boundaries {
    fn default() -> Self {
        Self {
            queue: DelayQueue::new(),
            keys: HashMap::new(),
            epoch: tokio::time::Instant::now(),
        }
    }
}

/// `deadline` moved up to the next tick of [`BOUNDARY_TICK`] after `epoch`.
fn on_tick(epoch: tokio::time::Instant, deadline: tokio::time::Instant) -> tokio::time::Instant {
    let since = deadline.saturating_duration_since(epoch);
    let tick = BOUNDARY_TICK.as_nanos();
    let ticks = since.as_nanos().div_ceil(tick);
    let nanos = u64::try_from(ticks.saturating_mul(tick)).unwrap_or(u64::MAX);
    epoch + Duration::from_nanos(nanos)
}

impl Boundaries {
    /// Sets the timer of `lease` to its next state boundary (plus a millisecond, so the new state
    /// has begun), or removes it when the Lease is gone or has none.
    fn schedule(&mut self, lease: &ObjectRef<Lease>, store: &Store<Lease>) {
        let now = Timestamp::now();
        let wait = store
            .get(lease)
            .and_then(|l| ShardLease::from_lease(&l).evaluate(now).1)
            .map(|at| {
                at.duration_since(now)
                    .try_into()
                    .unwrap_or(Duration::ZERO)
                    .min(MAX_REQUEUE)
                    + Duration::from_millis(1)
            });
        let deadline = wait.map(|wait| on_tick(self.epoch, tokio::time::Instant::now() + wait));
        match (deadline, self.keys.get(lease)) {
            (Some(deadline), Some(key)) => self.queue.reset_at(key, deadline),
            (Some(deadline), None) => {
                let key = self.queue.insert_at(lease.clone(), deadline);
                self.keys.insert(lease.clone(), key);
            }
            (None, Some(_)) => {
                if let Some(key) = self.keys.remove(lease) {
                    self.queue.remove(&key);
                }
            }
            (None, None) => {}
        }
    }

    /// The next Lease whose boundary passed; pending forever while there is none.
    async fn next_due(&mut self) -> Option<ObjectRef<Lease>> {
        let expired = std::future::poll_fn(|cx| match self.queue.poll_expired(cx) {
            // An empty queue answers `None`; wait for a timer to be inserted instead (the select
            // polls again after another branch fired).
            std::task::Poll::Ready(None) => std::task::Poll::Pending,
            other => other,
        })
        .await?;
        let lease = expired.into_inner();
        self.keys.remove(&lease);
        Some(lease)
    }
}

/// The names of the cached rings of `kind`.
/// The rings of `kind`, each with its `spec.leaseNamespaces`.
fn ring_names(ctx: &Context, kind: RingKind) -> BTreeMap<String, Vec<String>> {
    ctx.caches
        .rings()
        .iter()
        .filter(|r| r.ring_ref().kind == kind)
        .map(|r| (r.ring_ref().name, r.spec().lease_namespaces.clone()))
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
    /// Keyed by the ring's membership version and its `spec.leaseNamespaces`, which decide them.
    problems: Mutex<HashMap<RingRef, CachedProblems>>,
}

/// A ring's membership version, from [`LeaseIndex::ring_version`].
type RingVersion = (u64, u64);

/// Problems of Leases by their UID; Leases without problems are absent.
type ProblemsByUid = HashMap<String, Problems>;

/// A ring's problems with the membership version and `spec.leaseNamespaces` they were computed
/// for.
type CachedProblems = (RingVersion, Vec<String>, Arc<ProblemsByUid>);

/// What is wrong with a shard Lease, as reported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Problems {
    exclusion: Option<Exclusion>,
    weight: Option<String>,
    /// What is wrong with its annotation saying whether it leaves controlled objects to the
    /// sharder.
    leaves: Option<String>,
    /// The holder's clock was off the sharder's by more than `SKEW_WARNING` at its last renewal.
    clock_skewed: bool,
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
    let Some(ring_object) = ctx.caches.ring(&ring_ref) else {
        // Leases of rings that do not exist are not ours to manage.
        return Ok(Action::await_change());
    };
    let problems = report_problems(&state, &lease, &ring_object).await;
    if problems.exclusion == Some(Exclusion::BothRingKinds) {
        // Used by neither kind's ring (docs/protocol.md §15), so neither controller labels, takes
        // over or deletes it: it is not clear whose it is.
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

    // Tell the shard it is kept out (our extension; shards of other libraries ignore it): shards
    // built with our library stop reconciling and release their Lease, so their objects can move
    // at once instead of through drains nobody may acknowledge. Written with the state label.
    let wanted = problems.exclusion.as_ref().map(Exclusion::reason);
    let annotate = lease
        .annotations()
        .get(ANNOTATION_EXCLUDED)
        .map(String::as_str)
        != wanted;
    let annotations = || {
        if annotate {
            serde_json::json!({ANNOTATION_EXCLUDED: wanted})
        } else {
            serde_json::json!({})
        }
    };

    let now = Timestamp::now();
    let view = ShardLease::from_lease(&lease);
    let (state, _) = view.evaluate(now);
    match state {
        ShardState::Uncertain => {
            // The shard stopped renewing long ago. Taking the Lease over with an update guarded by
            // resourceVersion proves the API server is reachable and the shard can no longer
            // renew, so it must have stopped: from here on it is dead and its objects can move.
            // A merge patch guarded by the resourceVersion is as safe as an update, and writes
            // only the fields it names: the cached copy holds only what the sharder reads, so an
            // update from it would drop the Lease's other labels and annotations.
            let mut spec = LeaseSpec::default();
            view.takeover(now).apply(&mut spec);
            let patch = serde_json::json!({
                "metadata": {
                    "resourceVersion": lease.resource_version(),
                    "labels": {LABEL_STATE: ShardState::Dead.as_str()},
                    "annotations": annotations(),
                },
                "spec": spec,
            });
            api.patch(&name, &super::patch_params(), &Patch::Merge(&patch))
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
        ShardState::Ready
            if lease.labels().get(LABEL_STATE).map(String::as_str) != Some(state.as_str())
                && ctx.direct_moves.in_flight(&ring_ref, &name) =>
        {
            // The shard holds its Lease again while the sync still moves its objects off it:
            // `ready` is what lets the shard library start its work, so it waits until those
            // moves have landed (docs/protocol.md §22). No new one starts: they check the cache
            // this Lease came from. The last one's landing brings this Lease back.
            Ok(Action::requeue(READY_RECHECK))
        }
        _ => {
            if lease.labels().get(LABEL_STATE).map(String::as_str) != Some(state.as_str())
                || annotate
            {
                let patch = serde_json::json!({"metadata": {
                    "resourceVersion": lease.resource_version(),
                    "labels": {LABEL_STATE: state.as_str()},
                    "annotations": annotations(),
                }});
                api.patch(&name, &super::patch_params(), &Patch::Merge(&patch))
                    .await
                    .map_err(write_err("label"))?;
            }
            // The next boundary is watched by `triggers`.
            Ok(Action::await_change())
        }
    }
}

/// The problems of every Lease of `ring` by UID, computed once per membership change of the
/// ring: a reconcile at a Lease's state boundary (about once per Lease duration per shard) must
/// not cost work proportional to the ring's size.
fn ring_problems(state: &State, ring_object: &AnyRing) -> Arc<ProblemsByUid> {
    let ring = &ring_object.ring_ref();
    let allowed = &ring_object.spec().lease_namespaces;
    let index = state.ctx.caches.lease_index(ring.kind);
    let version = index.ring_version(&ring.name);
    if let Ok(cache) = state.problems.lock()
        && let Some((cached, cached_allowed, problems)) = cache.get(ring)
        && *cached == version
        && cached_allowed == allowed
    {
        return problems.clone();
    }
    let leases = index.ring_leases(&ring.name);
    let problems: ProblemsByUid = ring_members(
        ring.kind,
        &ring.name,
        allowed,
        leases.iter().map(AsRef::as_ref),
    )
    .into_iter()
    .map(|m| {
        let problems = Problems {
            exclusion: m.exclusion,
            weight: m.weight_error,
            leaves: m.leaves_error,
            clock_skewed: false,
        };
        (m.lease.uid().unwrap_or_default(), problems)
    })
    .filter(|(_, p)| *p != Problems::default())
    .collect();
    let problems = Arc::new(problems);
    if let Ok(mut cache) = state.problems.lock() {
        cache.insert(ring.clone(), (version, allowed.clone(), problems.clone()));
    }
    problems
}

/// Publishes Warning Events about what is wrong with a shard Lease, once per Lease and problem:
/// on the Lease and its ring when it is kept out of the ring (docs/protocol.md §15, §18), on the
/// Lease when its weight annotation or the one saying whether it leaves its controlled objects to
/// the sharder is invalid (docs/protocol.md §17). Returns the Lease's current
/// problems.
async fn report_problems(state: &State, lease: &Lease, ring: &AnyRing) -> Problems {
    let ctx = &state.ctx;
    let kind = state.kind;
    let ring_ref = ring.ring_ref();
    let uid = lease.uid().unwrap_or_default();
    let skew = ctx.caches.lease_index(kind).renewals().skew(&uid);
    let problems = Problems {
        clock_skewed: skew.is_some_and(|s| s.abs() > SKEW_WARNING),
        ..ring_problems(state, ring)
            .get(&uid)
            .cloned()
            .unwrap_or_default()
    };
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
    // Annotations of the Lease the sharder cannot read (docs/protocol.md §17).
    for (reason, error, before) in [
        (REASON_INVALID_WEIGHT, &problems.weight, &previous.weight),
        (
            REASON_INVALID_LEAVES_CONTROLLED_OBJECTS,
            &problems.leaves,
            &previous.leaves,
        ),
    ] {
        let Some(error) = error.as_ref().filter(|e| before.as_ref() != Some(*e)) else {
            continue;
        };
        let message = format!("Shard {shard:?} of {ring_ref}: {error}");
        tracing::warn!(ring = %ring_ref, %shard, %namespace, reason, "{message}");
        ctx.events
            .warning(&lease.object_ref(&()), reason, "", message)
            .await;
    }
    if let Some(skew) = skew.filter(|_| problems.clock_skewed && !previous.clock_skewed) {
        let message = format!(
            "The clock of shard {shard:?} of {ring_ref} is {:.1} s {} the sharder's (renewTime it wrote minus when the sharder saw the write). The sharder counts the Lease's duration from what it saw, so its objects stay safe, but the shard's own timing and other Lease readers are off: synchronise its clock",
            skew.abs().as_secs_f64(),
            if skew.is_negative() {
                "behind"
            } else {
                "ahead of"
            }
        );
        tracing::warn!(ring = %ring_ref, %shard, %namespace, reason = REASON_CLOCK_SKEW, "{message}");
        ctx.events
            .warning(&lease.object_ref(&()), REASON_CLOCK_SKEW, "", message)
            .await;
    }
    problems
}

/// The UID of a Lease, naming it in Event subjects on its ring.
fn uid_of(lease: &Lease) -> String {
    lease.uid().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use kube::api::ObjectMeta;
    use kube::runtime::{reflector, watcher};

    fn lease(name: &str, duration: Option<i32>) -> Lease {
        let now = MicroTime(Timestamp::now());
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(name.into()),
                lease_duration_seconds: duration,
                renew_time: Some(now.clone()),
                acquire_time: Some(now),
                ..Default::default()
            }),
        }
    }

    #[tokio::test]
    async fn a_boundary_fires_once_per_schedule_and_leases_without_one_get_no_timer() {
        let (store, mut writer) = reflector::store();
        for l in [lease("timed", Some(1)), lease("untimed", None)] {
            writer.apply_watcher_event(&watcher::Event::Apply(l));
        }
        let mut boundaries = Boundaries::default();
        let timed = ObjectRef::new("timed").within("ns");
        let untimed = ObjectRef::new("untimed").within("ns");
        boundaries.schedule(&timed, &store);
        boundaries.schedule(&untimed, &store);
        assert_eq!(
            boundaries.keys.len(),
            1,
            "a Lease without timing has no boundary"
        );
        // Scheduling again moves the one timer instead of adding another.
        boundaries.schedule(&timed, &store);
        assert_eq!(boundaries.queue.len(), 1);
        let due = tokio::time::timeout(Duration::from_secs(5), boundaries.next_due())
            .await
            .expect("the boundary one second away fires");
        assert_eq!(due, Some(timed));
        assert!(boundaries.keys.is_empty());
        // Nothing more is due: waiting stays pending.
        assert!(
            tokio::time::timeout(Duration::from_millis(100), boundaries.next_due())
                .await
                .is_err()
        );
    }

    #[test]
    fn deadlines_move_up_to_the_next_tick() {
        let epoch = tokio::time::Instant::now();
        let at = |ms: u64| epoch + Duration::from_millis(ms);
        assert_eq!(on_tick(epoch, at(0)), at(0));
        assert_eq!(on_tick(epoch, at(1)), at(250));
        assert_eq!(on_tick(epoch, at(250)), at(250));
        assert_eq!(on_tick(epoch, at(251)), at(500));
        assert_eq!(on_tick(epoch, at(9_999)), at(10_000));
        // A deadline before the epoch cannot be earlier than the epoch.
        assert_eq!(on_tick(at(100), epoch), at(100));
    }

    #[tokio::test(start_paused = true)]
    async fn boundaries_within_one_tick_fire_together() {
        let (store, mut writer) = reflector::store();
        let names = ["a", "b", "c"];
        for name in names {
            writer.apply_watcher_event(&watcher::Event::Apply(lease(name, Some(1))));
        }
        let mut boundaries = Boundaries::default();
        for name in names {
            // Renewed at slightly different moments: the boundaries are milliseconds apart.
            tokio::time::advance(Duration::from_millis(7)).await;
            boundaries.schedule(&ObjectRef::new(name).within("ns"), &store);
        }
        let deadlines: std::collections::BTreeSet<_> = boundaries
            .keys
            .values()
            .map(|key| boundaries.queue.deadline(key))
            .collect();
        assert_eq!(
            deadlines.len(),
            1,
            "one timer deadline for the three Leases"
        );
        let first = deadlines.first().copied().expect("a deadline");
        assert_eq!(
            first.duration_since(boundaries.epoch).as_nanos() % BOUNDARY_TICK.as_nanos(),
            0
        );
    }
}
