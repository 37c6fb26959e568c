//! Drain handling: deciding per object whether to reconcile it, acknowledge its drain, or leave
//! it alone, and a reconciler wrapper that does so before the controller's own logic runs.
//!
//! When the sharder moves an object away from a live shard, it first adds the drain label. The
//! shard must stop working on the object and answer by removing both the shard and the drain
//! label in one write that is conditional on the object's `resourceVersion`; only then does the
//! sharder's webhook hand the object to its new shard. This ordering guarantees the object is
//! never reconciled by two shards at once.

use std::collections::BTreeMap;
use std::collections::hash_map::DefaultHasher;
use std::fmt::Debug;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::runtime::Predicate;
use kube::runtime::controller::Action;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info};

use crate::Shard;

/// What a shard does with an object it was handed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Assigned to this shard and not draining: run the controller's reconciler.
    Reconcile,
    /// Assigned to this shard and draining: acknowledge the drain, never reconcile.
    Drain,
    /// Not assigned to this shard (label missing or naming another shard): do nothing.
    Ignore,
}

/// Classifies an object by its labels.
///
/// Only objects whose shard label names `shard_name` belong to the shard; among those, the mere
/// presence of the drain label (any value) means "drain". A drain label on an object owned by
/// someone else is none of this shard's business.
pub fn classify(
    labels: Option<&BTreeMap<String, String>>,
    shard_label_key: &str,
    drain_label_key: &str,
    shard_name: &str,
) -> Disposition {
    let Some(labels) = labels else {
        return Disposition::Ignore;
    };
    if labels.get(shard_label_key).map(String::as_str) != Some(shard_name) {
        return Disposition::Ignore;
    }
    if labels.contains_key(drain_label_key) {
        Disposition::Drain
    } else {
        Disposition::Reconcile
    }
}

/// The JSON merge patch acknowledging a drain: removes the shard and the drain label in one
/// write, which the API server rejects (409) if the object changed since `resource_version`.
pub fn drain_patch(
    shard_label_key: &str,
    drain_label_key: &str,
    resource_version: &str,
) -> serde_json::Value {
    json!({
        "metadata": {
            "resourceVersion": resource_version,
            "labels": {
                shard_label_key: null,
                drain_label_key: null,
            }
        }
    })
}

/// Error of a reconciler wrapped by [`Shard::reconciler`].
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError<E: std::error::Error + 'static> {
    /// The drain acknowledgement failed, typically with a conflict because the object changed
    /// meanwhile. The controller's error policy should requeue; the next attempt uses the
    /// fresh object.
    #[error("failed to acknowledge the drain of {object}")]
    Drain {
        /// `namespace/name` (or `name` when cluster-scoped) of the object.
        object: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The object has no `resourceVersion` (it was not read from the API server), so the drain
    /// cannot be acknowledged safely.
    #[error("failed to acknowledge the drain of {object}: it has no resourceVersion")]
    MissingResourceVersion {
        /// `namespace/name` (or `name` when cluster-scoped) of the object.
        object: String,
    },
    /// The wrapped reconciler failed.
    #[error(transparent)]
    Reconcile(E),
}

impl<E: std::error::Error + 'static> ReconcileError<E> {
    /// The wrapped reconciler's error, if that is what failed.
    pub fn inner(&self) -> Option<&E> {
        match self {
            Self::Reconcile(error) => Some(error),
            _ => None,
        }
    }

    /// Whether this is a drain acknowledgement that lost a race (HTTP 409).
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::Drain { source: kube::Error::Api(s), .. } if s.code == 409)
    }
}

fn object_ref(meta: &kube::api::ObjectMeta) -> String {
    let name = meta.name.as_deref().unwrap_or_default();
    match meta.namespace.as_deref() {
        Some(namespace) => format!("{namespace}/{name}"),
        None => name.to_string(),
    }
}

impl Shard {
    /// Wraps the controller's reconciler `inner` with the shard's drain handling:
    ///
    /// - assigned to this shard, not draining: `inner` runs;
    /// - assigned and draining: `inner` does **not** run; the drain is acknowledged with
    ///   [`Shard::drain_patch`] and logged at info level with `event = "drain"`; a failure (e.g.
    ///   a conflict) is returned as [`ReconcileError::Drain`] so the error policy requeues;
    /// - not assigned: nothing runs, `Action::await_change()`.
    ///
    /// The result plugs into `Controller::run` directly. `K::DynamicType` must be `Default`
    /// (every `k8s-openapi` type and derived custom resource); use
    /// [`Shard::reconciler_with`] for dynamic types.
    pub fn reconciler<K, Ctx, F, Fut, E>(
        &self,
        client: Client,
        inner: F,
    ) -> impl FnMut(Arc<K>, Arc<Ctx>) -> BoxFuture<'static, Result<Action, ReconcileError<E>>>
    + Send
    + 'static
    + use<K, Ctx, F, Fut, E>
    where
        K: Resource + Send + Sync + 'static,
        K::DynamicType: Default,
        Ctx: Send + Sync + 'static,
        F: FnMut(Arc<K>, Arc<Ctx>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: std::error::Error + Send + 'static,
    {
        self.reconciler_with(client, &K::DynamicType::default(), inner)
    }

    /// [`Shard::reconciler`] for resources with runtime type information (`DynamicObject`).
    pub fn reconciler_with<K, Ctx, F, Fut, E>(
        &self,
        client: Client,
        dyntype: &K::DynamicType,
        mut inner: F,
    ) -> impl FnMut(Arc<K>, Arc<Ctx>) -> BoxFuture<'static, Result<Action, ReconcileError<E>>>
    + Send
    + 'static
    + use<K, Ctx, F, Fut, E>
    where
        K: Resource + Send + Sync + 'static,
        Ctx: Send + Sync + 'static,
        F: FnMut(Arc<K>, Arc<Ctx>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: std::error::Error + Send + 'static,
    {
        let shard = self.clone();
        // Patching through the erased type works for namespaced and cluster-scoped kinds alike.
        let resource = ApiResource::erase::<K>(dyntype);
        move |object: Arc<K>, context: Arc<Ctx>| {
            let client = client.clone();
            let resource = resource.clone();
            dispatch(
                &shard,
                object,
                context,
                &mut inner,
                move |object: Arc<K>, patch| async move {
                    let api: Api<DynamicObject> = match object.meta().namespace.as_deref() {
                        Some(namespace) => Api::namespaced_with(client, namespace, &resource),
                        None => Api::all_with(client, &resource),
                    };
                    api.patch(
                        &object.name_any(),
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await
                    .map(|_| ())
                },
            )
        }
    }

    /// Wraps an event-filter predicate (`WatchStreamExt::predicate_filter`) so that objects
    /// carrying the drain label always pass: a filter that hides the drain (e.g. a
    /// generation-based one, as labels do not change the generation) would leave the sharder
    /// waiting forever.
    pub fn predicate<P>(&self, inner: P) -> DrainPassthrough<P> {
        DrainPassthrough {
            drain_label_key: self.drain_label_key().to_string(),
            inner,
        }
    }
}

/// Decides and starts the work for one object; the acknowledgement is injected so tests can
/// observe it without an API server.
fn dispatch<K, Ctx, F, Fut, E, A, AFut>(
    shard: &Shard,
    object: Arc<K>,
    context: Arc<Ctx>,
    inner: &mut F,
    acknowledge: A,
) -> BoxFuture<'static, Result<Action, ReconcileError<E>>>
where
    K: Resource + Send + Sync + 'static,
    F: FnMut(Arc<K>, Arc<Ctx>) -> Fut,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    A: FnOnce(Arc<K>, serde_json::Value) -> AFut,
    AFut: Future<Output = Result<(), kube::Error>> + Send + 'static,
{
    let meta = object.meta();
    match shard.classify(meta) {
        Disposition::Ignore => {
            debug!(
                object = %object_ref(meta),
                shard = %shard.name(),
                "ignoring object not assigned to this shard"
            );
            futures::future::ready(Ok(Action::await_change())).boxed()
        }
        Disposition::Reconcile => inner(object, context)
            .map(|result| result.map_err(ReconcileError::Reconcile))
            .boxed(),
        Disposition::Drain => {
            let object_name = object_ref(meta);
            let Some(resource_version) = meta.resource_version.clone() else {
                return futures::future::ready(Err(ReconcileError::MissingResourceVersion {
                    object: object_name,
                }))
                .boxed();
            };
            let namespace = meta.namespace.clone().unwrap_or_default();
            let name = meta.name.clone().unwrap_or_default();
            let shard_name = shard.name().to_string();
            let patch = shard.drain_patch(&resource_version);
            let acknowledged = acknowledge(object, patch);
            async move {
                acknowledged.await.map_err(|source| ReconcileError::Drain {
                    object: object_name,
                    source,
                })?;
                info!(
                    event = "drain",
                    %namespace,
                    %name,
                    shard = %shard_name,
                    %resource_version,
                    "acknowledged drain"
                );
                Ok(Action::await_change())
            }
            .boxed()
        }
    }
}

/// A predicate that lets every version of a drain-labelled object through and defers to `P`
/// for all others. Made by [`Shard::predicate`].
#[derive(Debug, Clone)]
pub struct DrainPassthrough<P> {
    drain_label_key: String,
    inner: P,
}

impl<K: Resource, P: Predicate<K>> Predicate<K> for DrainPassthrough<P> {
    fn hash_property(&self, object: &K) -> Option<u64> {
        let meta = object.meta();
        let draining = meta
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(&self.drain_label_key));
        if !draining {
            return self.inner.hash_property(object);
        }
        // Every write changes the resourceVersion, so every new version of a draining object
        // hashes differently and passes the filter.
        let mut hasher = DefaultHasher::new();
        ("drain", &meta.uid, &meta.resource_version).hash(&mut hasher);
        Some(hasher.finish())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use k8s_openapi::api::core::v1::Secret;
    use kube::api::ObjectMeta;
    use kube::runtime::predicates;

    use super::*;

    const RING: &str = "example";
    const SHARD_KEY: &str = "shard.alpha.sharding.timebertt.dev/clusterring-50d858e0-example";
    const DRAIN_KEY: &str = "drain.alpha.sharding.timebertt.dev/clusterring-50d858e0-example";

    fn secret(labels: &[(&str, &str)]) -> Arc<Secret> {
        Arc::new(Secret {
            metadata: ObjectMeta {
                name: Some("foo".into()),
                namespace: Some("default".into()),
                resource_version: Some("42".into()),
                uid: Some("uid-1".into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            ..Secret::default()
        })
    }

    #[derive(Debug, thiserror::Error)]
    #[error("inner failed")]
    struct InnerError;

    /// Runs `dispatch` for `object`; returns the result, how often the inner reconciler ran, and
    /// the acknowledgement patches sent.
    async fn run(
        object: Arc<Secret>,
        ack_result: Result<(), u16>,
    ) -> (
        Result<Action, ReconcileError<InnerError>>,
        usize,
        Vec<serde_json::Value>,
    ) {
        let shard = Shard::new(RING, "shard-a", "default");
        let calls = Arc::new(AtomicUsize::new(0));
        let patches = Arc::new(Mutex::new(Vec::new()));
        let mut inner = {
            let calls = Arc::clone(&calls);
            move |_: Arc<Secret>, _: Arc<()>| {
                calls.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, InnerError>(Action::requeue(std::time::Duration::from_secs(7))) }
            }
        };
        let recorded = Arc::clone(&patches);
        let result = dispatch(&shard, object, Arc::new(()), &mut inner, move |_, patch| {
            recorded.lock().expect("lock").push(patch);
            async move {
                ack_result.map_err(|code| {
                    kube::Error::Api(
                        kube::core::Status::failure("conflict", "Conflict")
                            .with_code(code)
                            .boxed(),
                    )
                })
            }
        })
        .await;
        let patches = patches.lock().expect("lock").clone();
        (result, calls.load(Ordering::SeqCst), patches)
    }

    #[test]
    fn classification() {
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let cases = [
            (labels(&[(SHARD_KEY, "shard-a")]), Disposition::Reconcile),
            (
                labels(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]),
                Disposition::Drain,
            ),
            // Only presence counts.
            (
                labels(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "")]),
                Disposition::Drain,
            ),
            (labels(&[(SHARD_KEY, "shard-b")]), Disposition::Ignore),
            (
                labels(&[(SHARD_KEY, "shard-b"), (DRAIN_KEY, "true")]),
                Disposition::Ignore,
            ),
            (labels(&[(DRAIN_KEY, "true")]), Disposition::Ignore),
            (labels(&[]), Disposition::Ignore),
            // Another ring's label is not ours.
            (
                labels(&[(
                    "shard.alpha.sharding.timebertt.dev/clusterring-0000-other",
                    "shard-a",
                )]),
                Disposition::Ignore,
            ),
        ];
        for (labels, want) in cases {
            assert_eq!(
                classify(Some(&labels), SHARD_KEY, DRAIN_KEY, "shard-a"),
                want,
                "{labels:?}"
            );
        }
        assert_eq!(
            classify(None, SHARD_KEY, DRAIN_KEY, "shard-a"),
            Disposition::Ignore
        );
    }

    #[test]
    fn drain_patch_is_exact() {
        let patch = Shard::new(RING, "shard-a", "default").drain_patch("1234");
        let expected = format!(
            r#"{{"metadata":{{"labels":{{"{DRAIN_KEY}":null,"{SHARD_KEY}":null}},"resourceVersion":"1234"}}}}"#
        );
        assert_eq!(serde_json::to_string(&patch).expect("serializes"), expected);
    }

    #[tokio::test]
    async fn assigned_object_is_reconciled() {
        let (result, calls, patches) = run(secret(&[(SHARD_KEY, "shard-a")]), Ok(())).await;
        assert_eq!(
            result.expect("ok"),
            Action::requeue(std::time::Duration::from_secs(7))
        );
        assert_eq!(calls, 1);
        assert!(patches.is_empty());
    }

    #[tokio::test]
    async fn drained_object_is_acknowledged_and_not_reconciled() {
        let (result, calls, patches) = run(
            secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]),
            Ok(()),
        )
        .await;
        assert_eq!(result.expect("ok"), Action::await_change());
        assert_eq!(
            calls, 0,
            "inner reconciler must not run for a draining object"
        );
        assert_eq!(
            patches,
            vec![
                json!({"metadata": {"resourceVersion": "42", "labels": {SHARD_KEY: null, DRAIN_KEY: null}}})
            ]
        );
    }

    #[tokio::test]
    async fn conflicting_acknowledgement_is_an_error_to_retry() {
        let (result, calls, _) = run(
            secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]),
            Err(409),
        )
        .await;
        let error = result.expect_err("conflict surfaces");
        assert!(error.is_conflict());
        assert!(error.inner().is_none());
        assert_eq!(
            error.to_string(),
            "failed to acknowledge the drain of default/foo"
        );
        assert_eq!(calls, 0);
    }

    #[tokio::test]
    async fn other_shards_objects_are_ignored() {
        for labels in [vec![(SHARD_KEY, "shard-b")], vec![]] {
            let (result, calls, patches) = run(secret(&labels), Ok(())).await;
            assert_eq!(result.expect("ok"), Action::await_change());
            assert_eq!(calls, 0);
            assert!(patches.is_empty());
        }
    }

    #[tokio::test]
    async fn drain_without_resource_version_is_refused() {
        let mut object = (*secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")])).clone();
        object.metadata.resource_version = None;
        let (result, calls, patches) = run(Arc::new(object), Ok(())).await;
        assert!(matches!(
            result,
            Err(ReconcileError::MissingResourceVersion { .. })
        ));
        assert_eq!(calls, 0);
        assert!(patches.is_empty(), "never a blind write");
    }

    #[test]
    fn predicate_lets_every_drained_version_through() {
        let shard = Shard::new(RING, "shard-a", "default");
        // Labels do not change a Secret's (absent) generation: the plain predicate sees nothing.
        let predicate = shard.predicate(predicates::generation);
        let plain = secret(&[(SHARD_KEY, "shard-a")]);
        assert_eq!(predicate.hash_property(plain.as_ref()), None);
        let drained = secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]);
        let first = predicate.hash_property(drained.as_ref());
        assert!(first.is_some());
        let mut newer = (*drained).clone();
        newer.metadata.resource_version = Some("43".into());
        let second = predicate.hash_property(&newer);
        assert!(second.is_some());
        assert_ne!(first, second);
    }
}
