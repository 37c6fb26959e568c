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
mod tests;
