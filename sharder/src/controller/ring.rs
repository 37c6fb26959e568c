//! The ring controller (docs/protocol.md §10), run once per ring kind: validates each ring, keeps
//! its MutatingWebhookConfiguration applied (restoring it within seconds after deletion or edits)
//! or, for a ring with `assignment: Watch` or `ServerSide`, absent (docs/protocol.md §20),
//! publishes the ranges of a `ServerSide` ring on its shards' Leases (`super::ranges`), and writes
//! the ring's status.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube_sharding_api::cluster_ring::{
    CONDITION_READY, REASON_RECONCILIATION_FAILED, REASON_RECONCILIATION_SUCCEEDED,
};
use kube_sharding_api::labels::{APP_NAME, LABEL_APP_NAME};
use kube_sharding_api::{Assignment, ClusterRingStatus, DepartedShard, RingObject, RingRef};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::ranges::{RangePublisher, Step};
use crate::context::Context;
use crate::core::membership::ring_members;
use crate::core::validation::validate_ring;
use crate::core::webhook_config::{FIELD_MANAGER, desired_webhook_configuration};
use crate::leader::events::REASON_WEBHOOK_UNREACHABLE;
use crate::records;

/// Errors of one reconciliation.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// The ring is invalid; reported in its status, not retried until it changes.
    #[error("{0}")]
    Invalid(String),
    /// The CA bundle file from the config could not be read.
    #[error("failed to read CA bundle file {path}: {source}")]
    CaBundle {
        /// The file.
        path: String,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A webhook configuration of the name the ring's would have exists and is not the sharder's
    /// for this ring: it is left alone (a forced apply would take it over, and deleting the ring
    /// would then delete it).
    #[error(
        "webhook configuration {0} already exists and was not written by the sharder for this ring; the sharder does not take it over: delete or rename it"
    )]
    NameTaken(String),
    /// An API call failed.
    #[error("failed to {action}: {source}")]
    Api {
        /// What was attempted.
        action: &'static str,
        /// Underlying error.
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// A fixed label for metrics and logs.
    pub(crate) fn category(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "invalid",
            Self::CaBundle { .. } => "ca_bundle",
            Self::NameTaken(_) => "name_taken",
            Self::Api { .. } => "api",
        }
    }
}

/// Runs the controller of rings of type `R` until `shutdown` fires.
pub(crate) async fn run<R: RingObject>(ctx: Context, shutdown: CancellationToken) {
    let kind = R::KIND;
    let rings: Api<R> = Api::all(ctx.client.clone());
    let configs: Api<MutatingWebhookConfiguration> = Api::all(ctx.client.clone());
    // The configurations of this kind's rings carry its ring label.
    let ours = watcher::Config::default().labels(&format!(
        "{LABEL_APP_NAME}={APP_NAME},{}",
        kind.lease_label()
    ));
    // The webhook configurations the sharder owns, cached: drift is detected against this cache,
    // so a reconcile (one per Lease renewal, say) sends no request unless something changed.
    let (config_store, writer) = reflector::store();
    let config_cache = reflector::reflector(writer, watcher(configs.clone(), ours.clone()))
        .default_backoff()
        .for_each(|_| async {});
    let ready = config_store.clone();
    let state = Arc::new(State {
        ctx,
        configs: config_store,
        ranges: RangePublisher::default(),
    });
    let controller = Controller::new(rings, watcher::Config::default())
        // Deleting or editing the webhook configuration triggers its ring, which restores it.
        .owns(configs, ours)
        // Shard Lease changes that matter for membership reconcile the rings (for their status);
        // renewals, which change only `renewTime`, do not: they would cost work per renewal.
        .reconcile_all_on(lease_changes(&state.ctx))
        // A namespace pin changes a ServerSide ring's ranges; Namespaces change seldom, and a
        // reconcile of an unchanged ring sends no request.
        .reconcile_all_on(namespace_changes(&state.ctx))
        // When a ring's webhook becomes unreachable or reachable again, the rings of its kind are
        // reconciled (flips are rare, and unchanged rings cost no request), updating its status.
        .reconcile_all_on(reachability_flips::<R>(&state.ctx))
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(reconcile::<R>, error_policy::<R>, state)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, %kind, "ring reconciliation failed");
            }
        });
    let controller = async {
        // Reconciling before the cache has its first listing would re-apply every configuration.
        if ready.wait_until_ready().await.is_ok() {
            controller.await;
        }
    };
    // The cache's watch ends with the controller, which ends on `shutdown`.
    tokio::select! {
        () = controller => {}
        () = config_cache => {}
    }
}

/// Fires when a shard Lease changed in a way membership depends on.
fn lease_changes(ctx: &Context) -> impl futures::Stream<Item = ()> + Send + 'static {
    let receiver = ctx.caches.changes.leases();
    futures::stream::unfold(receiver, |mut receiver| async move {
        receiver.changed().await.ok()?;
        Some(((), receiver))
    })
}

/// Fires when a Namespace changed.
fn namespace_changes(ctx: &Context) -> impl futures::Stream<Item = ()> + Send + 'static {
    let receiver = ctx.caches.changes.namespaces();
    futures::stream::unfold(receiver, |mut receiver| async move {
        receiver.changed().await.ok()?;
        Some(((), receiver))
    })
}

/// Fires when the webhook reachability of a ring of type `R` flipped.
fn reachability_flips<R: RingObject>(
    ctx: &Context,
) -> impl futures::Stream<Item = ()> + Send + 'static {
    let receiver = ctx.caches.changes.reachability_flips();
    futures::stream::unfold(receiver, |mut receiver| async move {
        loop {
            match receiver.recv().await {
                Ok(ring) if ring.kind == R::KIND => return Some(((), receiver)),
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
}

/// Message of the `Ready=False` condition of a ring whose webhook the API server does not reach.
const WEBHOOK_UNREACHABLE_MESSAGE: &str = "The API server does not reach the ring's webhook: objects moved to be assigned came back unassigned. The sharder sends no moves for this ring until a probe lands (every few seconds); check the webhook configuration's CA bundle and the Service or URL";

/// The controller's context: the shared one and the cache of webhook configurations.
struct State {
    ctx: Context,
    configs: Store<MutatingWebhookConfiguration>,
    /// The range planners of the `ServerSide` rings.
    ranges: RangePublisher,
}

fn error_policy<R: RingObject>(ring: Arc<R>, error: &Error, _state: Arc<State>) -> Action {
    match error {
        Error::Invalid(_) => Action::await_change(),
        _ => {
            tracing::warn!(event = records::EVENT_RING_RECONCILE_FAILED, %error, ring = %ring.ring_ref(), category = error.category(), "failed to reconcile ring");
            Action::requeue(Duration::from_secs(5))
        }
    }
}

/// Reconciles one ring: validate, apply the webhook configuration, update the status.
#[tracing::instrument(skip_all, fields(ring = %ring.ring_ref()))]
async fn reconcile<R: RingObject>(ring: Arc<R>, state: Arc<State>) -> Result<Action, Error> {
    let ctx = &state.ctx;
    let result = apply_webhook_configuration(ring.as_ref(), ctx, &state.configs).await;
    let server_side = ring.ring_spec().assignment() == Assignment::ServerSide;
    if !server_side {
        state.ranges.forget(&ring.ring_ref());
    }
    let (result, step) = match result {
        Ok(()) if server_side => match state.ranges.step(ring.as_ref(), ctx).await {
            Ok(step) => (Ok(()), Some(step)),
            Err(error) => (Err(error), None),
        },
        other => (other, None),
    };
    let range_generation = step
        .map(|s| s.generation)
        .or_else(|| ring.ring_status().and_then(|s| s.range_generation));
    let name = ring.name_any();
    let leases = ctx.caches.ring_leases(&ring.ring_ref());
    let members = ring_members(
        R::KIND,
        &name,
        &ring.ring_spec().lease_namespaces,
        leases.iter().map(AsRef::as_ref),
    );
    let shards = i32::try_from(members.len()).unwrap_or(i32::MAX);
    // Leases kept out of the ring (invalid or duplicate names) count as shards, not as available.
    let available = members.iter().filter(|m| m.is_available()).count();
    let available = i32::try_from(available).unwrap_or(i32::MAX);
    let failure = result
        .as_ref()
        .err()
        .map(|e| (REASON_RECONCILIATION_FAILED, capitalised(e)))
        .or_else(|| {
            // A ring without a webhook has nothing to be unreachable; a verdict from before
            // it switched does not count.
            let webhook = ring.ring_spec().assignment() == Assignment::Webhook;
            (webhook && ctx.reachability.is_unreachable(&ring.ring_ref())).then(|| {
                (
                    REASON_WEBHOOK_UNREACHABLE,
                    WEBHOOK_UNREACHABLE_MESSAGE.to_string(),
                )
            })
        });
    let now = Timestamp::now();
    let departed = ctx.caches.lease_index(R::KIND).departures(&name, now);
    let status = desired_status(
        ring.as_ref(),
        shards,
        available,
        failure
            .as_ref()
            .map(|(reason, message)| (*reason, message.as_str())),
        departed,
        now,
    );
    let status = ClusterRingStatus {
        range_generation,
        ..status
    };
    if ring.ring_status() != Some(&status) {
        let api: Api<R> = Api::all(ctx.client.clone());
        let mut patch = serde_json::json!({"status": status});
        // A merge patch keeps a list it does not mention: an empty one must be said.
        patch["status"]["departedShards"] = serde_json::json!(status.departed_shards);
        api.patch_status(&name, &super::patch_params(), &Patch::Merge(&patch))
            .await
            .map_err(|source| Error::Api {
                action: "update ring status",
                source,
            })?;
    }
    // The sharder controller publishes the Events about an unreachable webhook itself.
    if let Some((REASON_RECONCILIATION_FAILED, message)) = &failure {
        let flipped = ready_condition(ring.as_ref())
            .is_none_or(|c| c.status != "False" || &c.message != message);
        if flipped {
            ctx.events
                .warning(
                    &ring.object_ref(&()),
                    REASON_RECONCILIATION_FAILED,
                    "",
                    message.clone(),
                )
                .await;
        }
    }
    result.map(|()| match step {
        Some(Step { retry: true, .. }) => Action::requeue(RANGE_RETRY),
        // Acknowledgements and stops arrive as Lease changes; the period only bounds a missed one.
        Some(Step { retry: false, .. }) => Action::requeue(RANGE_RESYNC),
        None => Action::await_change(),
    })
}

/// How soon a `ServerSide` ring's step that waited (for the Lease cache to show its writes, or
/// for a departed shard) runs again.
const RANGE_RETRY: Duration = Duration::from_millis(500);

/// How often a settled `ServerSide` ring's step runs without a Lease change.
const RANGE_RESYNC: Duration = Duration::from_secs(30);

async fn apply_webhook_configuration<R: RingObject>(
    ring: &R,
    ctx: &Context,
    cache: &Store<MutatingWebhookConfiguration>,
) -> Result<(), Error> {
    validate_ring(ring, &ctx.config.webhook.config.allowed_protected_resources)
        .map_err(|invalid| Error::Invalid(invalid.to_string()))?;
    let client_config = &ctx.config.webhook.config.client_config;
    let ca_bundle = match (&client_config.ca_bundle, &client_config.ca_bundle_file) {
        (Some(inline), _) => Some(inline.0.clone()),
        (None, Some(path)) => {
            Some(
                tokio::fs::read(path)
                    .await
                    .map_err(|source| Error::CaBundle {
                        path: path.display().to_string(),
                        source,
                    })?,
            )
        }
        (None, None) => None,
    };
    let desired = desired_webhook_configuration(ring, &ctx.config.webhook.config, ca_bundle);
    let name = desired.name_any();
    let api: Api<MutatingWebhookConfiguration> = Api::all(ctx.client.clone());
    let existing = cache.get(&ObjectRef::new(&name));
    if ring.ring_spec().assignment() != Assignment::Webhook {
        return remove_webhook_configuration(ring, &api, existing.as_deref()).await;
    }
    if ring.meta().deletion_timestamp.is_some() {
        // The ring is going: a configuration the garbage collector deleted (first, in a
        // foreground deletion) stays deleted, or the API server would keep calling a webhook
        // whose ring is about to be unknown here and fail open there.
        return Ok(());
    }
    let up_to_date = existing.as_ref().is_some_and(|existing| {
        let (desired, existing) = (
            serde_json::to_value(&desired),
            serde_json::to_value(existing.as_ref()),
        );
        matches!((desired, existing), (Ok(d), Ok(e)) if is_subset(&d, &e))
    });
    if existing.is_none() {
        // Not in the cache, which holds only configurations carrying this ring kind's labels:
        // new, or someone else's.
        let found = api.get_opt(&name).await.map_err(|source| Error::Api {
            action: "read webhook configuration",
            source,
        })?;
        if let Some(found) = found
            && !written_for(&found, ring)
        {
            return Err(Error::NameTaken(name));
        }
    }
    if !up_to_date {
        api.patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&desired),
        )
        .await
        .map_err(|source| Error::Api {
            action: "apply webhook configuration",
            source,
        })?;
        tracing::info!(event = records::EVENT_WEBHOOK_CONFIGURATION_APPLIED, webhook_configuration = %name, "applied webhook configuration");
    }
    Ok(())
}

/// Deletes the webhook configuration of a ring whose sharder assigns new objects itself
/// (`assignment: Watch`) or that places none (`ServerSide`), if the sharder wrote it for this ring; someone else's configuration of
/// that name is left alone.
///
/// Deleting it while objects are being created loses none of them: the API server stops calling
/// the webhook, and from then on the sharder's watch of unassigned objects labels them, as it
/// labels those created before the switch that the webhook missed. The delete is guarded by the
/// configuration's UID, so a configuration the ring got back meanwhile is not the one removed.
async fn remove_webhook_configuration<R: RingObject>(
    ring: &R,
    api: &Api<MutatingWebhookConfiguration>,
    existing: Option<&MutatingWebhookConfiguration>,
) -> Result<(), Error> {
    let Some(existing) = existing.filter(|config| written_for(config, ring)) else {
        return Ok(());
    };
    let name = existing.name_any();
    let params = kube::api::DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: existing.uid(),
            resource_version: None,
        }),
        ..Default::default()
    };
    match api.delete(&name, &params).await {
        Ok(_) => {
            tracing::info!(event = records::EVENT_WEBHOOK_CONFIGURATION_DELETED, webhook_configuration = %name, "deleted webhook configuration: the ring's objects are assigned by the sharder's watch");
            Ok(())
        }
        // Gone already, or replaced (the UID precondition failed): the cache catches up and the
        // ring is reconciled again.
        Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => Ok(()),
        Err(source) => Err(Error::Api {
            action: "delete webhook configuration",
            source,
        }),
    }
}

/// Whether `config` is the sharder's for `ring`: it carries the ring's label, or a controller
/// owner reference to a ring of that kind and name (a ring deleted and created again finds the
/// configuration of its predecessor until the garbage collector removes it).
fn written_for<R: RingObject>(config: &MutatingWebhookConfiguration, ring: &R) -> bool {
    let RingRef { kind, name } = ring.ring_ref();
    config.labels().get(kind.lease_label()) == Some(&name)
        || config.owner_references().iter().any(|owner| {
            owner.controller == Some(true) && owner.kind == R::kind(&()) && owner.name == name
        })
}

/// Whether every field set in `desired` has the same value in `actual`. Fields the API server
/// defaults (or others add) are ignored, so an unchanged object needs no write. An empty list or
/// map in `desired` matches a missing field: the API server omits empty fields (`omitempty`), and
/// treating them as drift would re-apply the object forever (a ring without resources has no
/// webhook rules).
fn is_subset(desired: &Value, actual: &Value) -> bool {
    let is_empty = |v: &Value| match v {
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    };
    match (desired, actual) {
        (Value::Object(d), Value::Object(a)) => d
            .iter()
            .all(|(k, v)| v.is_null() || a.get(k).map_or(is_empty(v), |av| is_subset(v, av))),
        (Value::Array(d), Value::Array(a)) => {
            d.len() == a.len() && d.iter().zip(a).all(|(dv, av)| is_subset(dv, av))
        }
        _ => desired == actual,
    }
}

fn capitalised(error: &Error) -> String {
    let message = error.to_string();
    let mut chars = message.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => message,
    }
}

/// The ring's `Ready` condition, if set.
fn ready_condition<R: RingObject>(ring: &R) -> Option<&Condition> {
    ring.ring_status()?
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_READY)
}

/// The status a ring should have; `lastTransitionTime` only moves when the condition flips.
fn desired_status<R: RingObject>(
    ring: &R,
    shards: i32,
    available_shards: i32,
    failure: Option<(&str, &str)>,
    departed: BTreeMap<String, Timestamp>,
    now: Timestamp,
) -> ClusterRingStatus {
    let generation = ring.meta().generation;
    let (status, reason, message) = match failure {
        None => (
            "True",
            REASON_RECONCILIATION_SUCCEEDED,
            format!("{} was successfully reconciled", R::KIND),
        ),
        Some((reason, message)) => ("False", reason, message.to_string()),
    };
    let previous = ready_condition(ring);
    let last_transition_time = previous
        .filter(|c| c.status == status)
        .map_or(Time(now), |c| c.last_transition_time.clone());
    let mut conditions: Vec<Condition> = ring
        .ring_status()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    conditions.retain(|c| c.type_ != CONDITION_READY);
    conditions.push(Condition {
        type_: CONDITION_READY.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: generation,
        last_transition_time,
    });
    // Departures this process saw, and those a predecessor kept that are not over yet: the
    // shards may still run (docs/protocol.md §18).
    let mut departed = departed;
    for kept in ring
        .ring_status()
        .map(|s| s.departed_shards.as_slice())
        .unwrap_or_default()
    {
        if kept.until.0 > now {
            let until = departed.entry(kept.name.clone()).or_insert(kept.until.0);
            *until = (*until).max(kept.until.0);
        }
    }
    ClusterRingStatus {
        observed_generation: generation,
        shards,
        available_shards,
        conditions,
        departed_shards: departed
            .into_iter()
            .map(|(name, until)| DepartedShard {
                name,
                until: Time(until),
            })
            .collect(),
        // The caller sets it for ServerSide rings; kept as it was otherwise.
        range_generation: ring.ring_status().and_then(|s| s.range_generation),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_sharding_api::{ClusterRing, ClusterRingSpec};
    use serde_json::json;

    #[test]
    fn subset_ignores_server_defaults_but_not_changes() {
        let desired = json!({"a": 1, "b": {"c": [1, {"d": "x"}]}, "n": null});
        assert!(is_subset(
            &desired,
            &json!({"a": 1, "b": {"c": [1, {"d": "x", "e": 2}]}, "z": 0})
        ));
        assert!(!is_subset(
            &desired,
            &json!({"a": 2, "b": {"c": [1, {"d": "x"}]}})
        ));
        assert!(!is_subset(&desired, &json!({"a": 1, "b": {"c": [1]}})));
        assert!(!is_subset(&desired, &json!({"a": 1})));
        // Empty lists and maps match absent fields (the server omits them), not other values.
        let empty = json!({"rules": [], "labels": {}, "a": 1});
        assert!(is_subset(&empty, &json!({"a": 1})));
        assert!(is_subset(&empty, &json!({"a": 1, "rules": []})));
        assert!(!is_subset(&empty, &json!({"a": 1, "rules": [1]})));
    }

    #[test]
    fn status_keeps_transition_time_until_flip() {
        let mut ring = ClusterRing::new("r", ClusterRingSpec::default());
        ring.metadata.generation = Some(4);
        let t1 = Timestamp::from_second(100).unwrap();
        let t2 = Timestamp::from_second(200).unwrap();
        let first = desired_status(&ring, 3, 2, None, BTreeMap::new(), t1);
        assert_eq!(first.observed_generation, Some(4));
        assert_eq!((first.shards, first.available_shards), (3, 2));
        let cond = &first.conditions[0];
        assert_eq!(
            (cond.type_.as_str(), cond.status.as_str()),
            ("Ready", "True")
        );
        assert_eq!(cond.reason, "ReconciliationSucceeded");
        assert_eq!(cond.message, "ClusterRing was successfully reconciled");
        assert_eq!(cond.observed_generation, Some(4));
        ring.status = Some(first.clone());
        let again = desired_status(&ring, 3, 3, None, BTreeMap::new(), t2);
        assert_eq!(again.conditions[0].last_transition_time, Time(t1));
        let failed = desired_status(
            &ring,
            3,
            3,
            Some((REASON_RECONCILIATION_FAILED, "Broken")),
            BTreeMap::new(),
            t2,
        );
        assert_eq!(failed.conditions.len(), 1);
        assert_eq!(failed.conditions[0].status, "False");
        assert_eq!(failed.conditions[0].reason, "ReconciliationFailed");
        assert_eq!(failed.conditions[0].message, "Broken");
        assert_eq!(failed.conditions[0].last_transition_time, Time(t2));
    }

    #[test]
    fn status_keeps_departures_a_predecessor_recorded_until_they_are_over() {
        let at = |s| Timestamp::from_second(s).unwrap();
        let departed = |entries: &[(&str, i64)]| -> Vec<DepartedShard> {
            entries
                .iter()
                .map(|(name, until)| DepartedShard {
                    name: (*name).into(),
                    until: Time(at(*until)),
                })
                .collect()
        };
        let mut ring = ClusterRing::new("r", ClusterRingSpec::default());
        ring.status = Some(ClusterRingStatus {
            departed_shards: departed(&[("a", 130), ("b", 90), ("c", 110)]),
            ..ClusterRingStatus::default()
        });
        // This process knows c (later) and d; a is only in the status, b is over.
        let known = BTreeMap::from([("c".to_string(), at(140)), ("d".to_string(), at(150))]);
        let status = desired_status(&ring, 3, 2, None, known, at(100));
        assert_eq!(
            status.departed_shards,
            departed(&[("a", 130), ("c", 140), ("d", 150)])
        );
    }

    #[test]
    fn errors_are_capitalised() {
        assert_eq!(
            capitalised(&Error::Invalid("resource x".into())),
            "Resource x"
        );
    }
}
