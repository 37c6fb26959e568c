//! Drain handling: deciding per object whether to reconcile it, acknowledge its drain, or leave
//! it alone, and a reconciler wrapper that does so before the controller's own logic runs.
//!
//! When the sharder moves an object away from a live shard, it first adds the drain label. The
//! shard must stop working on the object and answer by removing both the shard and the drain
//! label in one write that is conditional on the object's `resourceVersion`; only then does the
//! sharder's webhook hand the object to its new shard. This ordering guarantees the object is
//! never reconciled by two shards at once.
//!
//! The wrapper is also the last gate before the shard acts on an object: it is given the token
//! that fires when the shard's Lease is lost ([`HeldLease::lost_token`]) and starts neither a
//! reconcile nor a drain acknowledgement once it has fired.
//!
//! [`HeldLease::lost_token`]: crate::HeldLease::lost_token

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
use tokio_util::sync::CancellationToken;
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
    /// The shard's Lease was lost before the work on this object started: the wrapped
    /// reconciler did not run and no drain was acknowledged. Nothing is left to do: the
    /// controller is about to be dropped ([`HeldLease::run_while_held`]), and another shard may
    /// own the object already.
    ///
    /// [`HeldLease::run_while_held`]: crate::HeldLease::run_while_held
    #[error("failed to start work on {object}: the shard Lease is lost")]
    LeaseLost {
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

    /// Whether nothing was done because the shard's Lease was lost
    /// ([`ReconcileError::LeaseLost`]): not a failure to retry.
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Self::LeaseLost { .. })
    }
}

/// Field manager of the shard library's writes, so `managedFields` names who removed the labels.
const FIELD_MANAGER: &str = "shard";

/// Parameters of the library's merge patches: its field manager, nothing else.
fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
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
    /// Wraps the controller's reconciler `inner` with the shard's drain handling, and stops it
    /// from acting once the shard's Lease is lost:
    ///
    /// - assigned to this shard, not draining: `inner` runs;
    /// - assigned and draining: `inner` does **not** run; the drain is acknowledged with
    ///   [`Shard::drain_patch`] and logged at info level with `event = "drain"`; a failure (e.g.
    ///   a conflict) is returned as [`ReconcileError::Drain`] so the error policy requeues;
    /// - not assigned: nothing runs, `Action::await_change()`;
    /// - `lost` has fired: nothing runs and nothing is written, [`ReconcileError::LeaseLost`].
    ///
    /// Pass the shard Lease's [`HeldLease::lost_token`] as `lost`. The wrapper checks it when
    /// the controller calls it and again when the controller first polls the returned future,
    /// right before `inner` starts and right before the acknowledgement is sent.
    /// [`HeldLease::run_while_held`] drops the controller once the Lease is lost, but only at
    /// its own next poll; until then a controller running on another thread could still start
    /// work, and this check closes that gap.
    ///
    /// **Sharp edge:** the check races with the loss. A reconcile or acknowledgement that
    /// passed it a moment before the token fired goes on (until the controller is dropped) and
    /// may log, or finish its write, microseconds after the loss was recorded. What the check
    /// guarantees is that nothing *starts* after the token has fired. Pass a token that never
    /// fires (`CancellationToken::new()`) only for work that is not guarded by a Lease.
    ///
    /// The result plugs into `Controller::run` directly. `K::DynamicType` must be `Default`
    /// (every `k8s-openapi` type and derived custom resource); use
    /// [`Shard::reconciler_with`] for dynamic types.
    ///
    /// [`HeldLease::lost_token`]: crate::HeldLease::lost_token
    /// [`HeldLease::run_while_held`]: crate::HeldLease::run_while_held
    pub fn reconciler<K, Ctx, F, Fut, E>(
        &self,
        client: Client,
        lost: CancellationToken,
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
        self.reconciler_with(client, &K::DynamicType::default(), lost, inner)
    }

    /// [`Shard::reconciler`] for resources with runtime type information (`DynamicObject`).
    pub fn reconciler_with<K, Ctx, F, Fut, E>(
        &self,
        client: Client,
        dyntype: &K::DynamicType,
        lost: CancellationToken,
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
                &lost,
                object,
                context,
                &mut inner,
                move |object: Arc<K>, patch| async move {
                    let api: Api<DynamicObject> = match object.meta().namespace.as_deref() {
                        Some(namespace) => Api::namespaced_with(client, namespace, &resource),
                        None => Api::all_with(client, &resource),
                    };
                    api.patch(&object.name_any(), &patch_params(), &Patch::Merge(&patch))
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
///
/// `lost` is checked now and again when the returned future is first polled, right before
/// `inner`'s future or the acknowledgement starts: the controller may poll it later than it
/// called the wrapper. `acknowledge` is only called after that second check.
fn dispatch<K, Ctx, F, Fut, E, A, AFut>(
    shard: &Shard,
    lost: &CancellationToken,
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
    A: FnOnce(Arc<K>, serde_json::Value) -> AFut + Send + 'static,
    AFut: Future<Output = Result<(), kube::Error>> + Send + 'static,
{
    let meta = object.meta();
    let object_name = object_ref(meta);
    if lost.is_cancelled() {
        debug!(object = %object_name, shard = %shard.name(), "not starting work: the shard Lease is lost");
        return futures::future::ready(Err(ReconcileError::LeaseLost {
            object: object_name,
        }))
        .boxed();
    }
    let lost = lost.clone();
    match shard.classify(meta) {
        Disposition::Ignore => {
            debug!(
                object = %object_name,
                shard = %shard.name(),
                "ignoring object not assigned to this shard"
            );
            futures::future::ready(Ok(Action::await_change())).boxed()
        }
        Disposition::Reconcile => {
            // Calling an `async fn` only builds its future; its body starts at the first poll,
            // after the check below.
            let reconcile = inner(object, context);
            async move {
                if lost.is_cancelled() {
                    return Err(ReconcileError::LeaseLost {
                        object: object_name,
                    });
                }
                reconcile.await.map_err(ReconcileError::Reconcile)
            }
            .boxed()
        }
        Disposition::Drain => {
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
            async move {
                if lost.is_cancelled() {
                    return Err(ReconcileError::LeaseLost {
                        object: object_name,
                    });
                }
                acknowledge(object, patch)
                    .await
                    .map_err(|source| ReconcileError::Drain {
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
    use std::collections::BTreeMap;
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

    /// What a wrapped reconcile did.
    #[derive(Debug, Default)]
    struct Probe {
        /// Calls of the inner reconciler (the closure itself).
        calls: AtomicUsize,
        /// Polls of the futures the inner reconciler returned: its body starting.
        started: AtomicUsize,
        /// Acknowledgement patches sent.
        patches: Mutex<Vec<serde_json::Value>>,
    }

    impl Probe {
        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }

        fn started(&self) -> usize {
            self.started.load(Ordering::SeqCst)
        }

        fn patches(&self) -> Vec<serde_json::Value> {
            self.patches.lock().expect("lock").clone()
        }
    }

    /// Calls `dispatch` for `object` as the controller would and returns the future, unpolled,
    /// with what it did so far.
    fn start(
        object: Arc<Secret>,
        ack_result: Result<(), u16>,
        lost: &CancellationToken,
    ) -> (
        BoxFuture<'static, Result<Action, ReconcileError<InnerError>>>,
        Arc<Probe>,
    ) {
        let shard = Shard::new(RING, "shard-a", "default");
        let probe = Arc::new(Probe::default());
        let mut inner = {
            let probe = Arc::clone(&probe);
            move |_: Arc<Secret>, _: Arc<()>| {
                probe.calls.fetch_add(1, Ordering::SeqCst);
                let probe = Arc::clone(&probe);
                async move {
                    probe.started.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, InnerError>(Action::requeue(std::time::Duration::from_secs(7)))
                }
            }
        };
        let recorded = Arc::clone(&probe);
        let future = dispatch(
            &shard,
            lost,
            object,
            Arc::new(()),
            &mut inner,
            move |_, patch| {
                recorded.patches.lock().expect("lock").push(patch);
                async move {
                    ack_result.map_err(|code| {
                        kube::Error::Api(
                            kube::core::Status::failure("conflict", "Conflict")
                                .with_code(code)
                                .boxed(),
                        )
                    })
                }
            },
        );
        (future, probe)
    }

    /// Runs `dispatch` for `object` with a Lease that is held; returns the result, how often the
    /// inner reconciler ran, and the acknowledgement patches sent.
    async fn run(
        object: Arc<Secret>,
        ack_result: Result<(), u16>,
    ) -> (
        Result<Action, ReconcileError<InnerError>>,
        usize,
        Vec<serde_json::Value>,
    ) {
        let (future, probe) = start(object, ack_result, &CancellationToken::new());
        let result = future.await;
        assert_eq!(probe.calls(), probe.started(), "every call is polled");
        (result, probe.started(), probe.patches())
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
        let shard = Shard::new(RING, "shard-a", "default");
        let meta = |labels: Option<BTreeMap<String, String>>| ObjectMeta {
            labels,
            ..ObjectMeta::default()
        };
        for (labels, want) in cases {
            assert_eq!(
                shard.classify(&meta(Some(labels.clone()))),
                want,
                "{labels:?}"
            );
        }
        assert_eq!(shard.classify(&meta(None)), Disposition::Ignore);
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

    /// Every object a shard may be handed: assigned, draining, someone else's.
    fn every_kind_of_object() -> [Arc<Secret>; 3] {
        [
            secret(&[(SHARD_KEY, "shard-a")]),
            secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]),
            secret(&[(SHARD_KEY, "shard-b")]),
        ]
    }

    #[tokio::test]
    async fn nothing_starts_once_the_lease_is_lost() {
        let lost = CancellationToken::new();
        lost.cancel();
        for object in every_kind_of_object() {
            let (future, probe) = start(Arc::clone(&object), Ok(()), &lost);
            let error = future.await.expect_err("the loss surfaces");
            assert!(error.is_lease_lost(), "{error:?}");
            assert_eq!(
                error.to_string(),
                "failed to start work on default/foo: the shard Lease is lost"
            );
            assert_eq!(probe.calls(), 0, "inner reconciler not even called");
            assert_eq!(probe.started(), 0);
            assert!(probe.patches().is_empty(), "no drain acknowledged");
        }
    }

    #[tokio::test]
    async fn loss_between_call_and_first_poll_starts_nothing() {
        // The controller calls the wrapper, then polls the future later (possibly on another
        // thread, after the Lease was lost meanwhile).
        for object in every_kind_of_object().into_iter().take(2) {
            let lost = CancellationToken::new();
            let (future, probe) = start(object, Ok(()), &lost);
            lost.cancel();
            let error = future.await.expect_err("the loss surfaces");
            assert!(error.is_lease_lost(), "{error:?}");
            assert_eq!(probe.started(), 0, "the reconcile's body never ran");
            assert!(probe.patches().is_empty(), "no drain acknowledged");
        }
    }

    #[tokio::test]
    async fn wrapper_sends_no_request_once_the_lease_is_lost() {
        // A client whose every request is counted (and fails): the wrapper must not use it.
        let requests = Arc::new(AtomicUsize::new(0));
        let service = {
            let requests = Arc::clone(&requests);
            tower::service_fn(move |_: http::Request<kube::client::Body>| {
                requests.fetch_add(1, Ordering::SeqCst);
                async {
                    Err::<http::Response<kube::client::Body>, _>(std::io::Error::other(
                        "no API server in this test",
                    ))
                }
            })
        };
        let client = Client::new(service, "default");
        let calls = Arc::new(AtomicUsize::new(0));
        let inner = {
            let calls = Arc::clone(&calls);
            move |_: Arc<Secret>, _: Arc<()>| {
                calls.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, InnerError>(Action::await_change()) }
            }
        };
        let lost = CancellationToken::new();
        let mut reconcile =
            Shard::new(RING, "shard-a", "default").reconciler(client, lost.clone(), inner);

        // While the Lease is held the seam is real: a drain is sent to the API server.
        let drained = secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]);
        let error = reconcile(Arc::clone(&drained), Arc::new(()))
            .await
            .expect_err("the counting client fails every request");
        assert!(matches!(error, ReconcileError::Drain { .. }), "{error:?}");
        assert_eq!(requests.load(Ordering::SeqCst), 1);

        lost.cancel();
        for object in every_kind_of_object() {
            let error = reconcile(object, Arc::new(()))
                .await
                .expect_err("the loss surfaces");
            assert!(error.is_lease_lost(), "{error:?}");
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            0,
            "inner reconciler never ran"
        );
        assert_eq!(
            requests.load(Ordering::SeqCst),
            1,
            "no request after the loss"
        );
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
