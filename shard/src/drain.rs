//! Drain handling: deciding per object whether to reconcile it, acknowledge its drain, or leave
//! it alone, and a reconciler wrapper that does so before the controller's own logic runs.
//!
//! When the sharder moves an object away from a live shard, it first adds the drain label. The
//! shard must stop working on the object and answer by removing both the shard and the drain
//! label in one write that is conditional on the object's `resourceVersion`; only then does the
//! sharder's webhook hand the object to its new shard. This ordering guarantees the object is
//! never reconciled by two shards at once.
//!
//! The wrapper is also the last gate before the shard acts on an object: it is given the shard
//! Lease's guard ([`HeldLease::guard`]), starts neither a reconcile nor a drain acknowledgement
//! once it has ended, and cancels those in flight when it ends.
//!
//! [`HeldLease::guard`]: crate::HeldLease::guard

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
use tracing::{debug, info};

use crate::lease::{GuardEnd, LeaseGuard};
use crate::ownership::{Fetch, Ownership};
use crate::records::EVENT_DRAIN;
use crate::shard::{Disposition, Shard};

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
    /// The shard's Lease was lost (or its renew deadline passed) before the work on this object
    /// started, or while it ran: the wrapped reconciler did not run or was cancelled mid-flight,
    /// and no drain was acknowledged. Nothing is left to do: another shard may own the object
    /// already.
    #[error("failed to work on {object}: the shard Lease is lost")]
    LeaseLost {
        /// `namespace/name` (or `name` when cluster-scoped) of the object.
        object: String,
    },
    /// The sharder excluded this shard's Lease from its ring: as [`ReconcileError::LeaseLost`],
    /// and no drain is acknowledged either (the objects labelled with this shard's name may be
    /// another shard's of the same name).
    #[error("failed to work on {object}: the shard is excluded from its ring ({reason})")]
    Excluded {
        /// `namespace/name` (or `name` when cluster-scoped) of the object.
        object: String,
        /// The exclusion reason the sharder gave.
        reason: String,
    },
    /// Zero-write rings: the object's hash range was revoked from this shard while the
    /// reconcile ran; it was cancelled (dropped at whatever `.await` it waited) before the
    /// shard acknowledged the revocation. Nothing is left to do: another shard gets the object.
    #[error("cancelled work on {object}: its hash range was revoked from this shard")]
    Revoked {
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

    /// Whether nothing was done, or the work was cancelled, because the shard's Lease was lost
    /// ([`ReconcileError::LeaseLost`]) or excluded ([`ReconcileError::Excluded`]): not a
    /// failure to retry.
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Self::LeaseLost { .. } | Self::Excluded { .. })
    }

    fn from_end(end: GuardEnd, object: String) -> Self {
        match end {
            GuardEnd::LeaseLost => Self::LeaseLost { object },
            GuardEnd::Excluded(reason) => Self::Excluded { object, reason },
        }
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
    /// from acting once the shard's Lease ends:
    ///
    /// - assigned to this shard, not draining: `inner` runs, with an [`Ownership`] to confirm
    ///   before its first write;
    /// - assigned and draining: `inner` does **not** run; the drain is acknowledged with
    ///   [`Shard::drain_patch`] and logged at info level with `event = "drain"`; a failure (e.g.
    ///   a conflict) is returned as [`ReconcileError::Drain`] so the error policy requeues;
    /// - not assigned: nothing runs, `Action::await_change()`;
    /// - `guard` ended (Lease lost, renew deadline passed, excluded): nothing starts and nothing
    ///   is written, [`ReconcileError::LeaseLost`] or [`ReconcileError::Excluded`].
    ///
    /// Pass the shard Lease's [`HeldLease::guard`] ([`Term::guard`] under [`Shard::run`]; for
    /// work not guarded by a [`LeaseLock`], [`LeaseGuard::from_token`]). The wrapper checks it when the controller calls
    /// it and again when the controller first polls the returned future, right before `inner`
    /// starts and right before the acknowledgement is sent; the guard fails from the renew
    /// deadline on by the monotonic clock, even if the renewer has not run since (after a VM
    /// suspend, say). While `inner` or the acknowledgement runs, it races them against
    /// [`LeaseGuard::ended`]: when the guard ends, the reconcile future is dropped at once, at
    /// whatever `.await` it waits, and returns [`ReconcileError::LeaseLost`].
    ///
    /// **Sharp edges:**
    /// - Dropping cancels only what the reconcile future owns: a request already on the wire
    ///   may still be applied by the API server, and a task the reconcile spawned keeps
    ///   running. Confirm with [`Ownership::confirm`] right before the first write, which
    ///   checks the guard and the object's labels, so a write is never *sent* after the
    ///   guard or the object's assignment says no.
    /// - A check racing the end can pass microseconds before it; what passed is cancelled as
    ///   soon as the guard's end is noticed.
    ///
    /// The result plugs into `Controller::run` directly. `K::DynamicType` must be `Default`
    /// (every `k8s-openapi` type and derived custom resource); use
    /// [`Shard::reconciler_with`] for dynamic types.
    ///
    /// [`HeldLease::guard`]: crate::HeldLease::guard
    /// [`LeaseLock`]: crate::LeaseLock
    /// [`Term::guard`]: crate::Term::guard
    pub fn reconciler<K, Ctx, F, Fut, E>(
        &self,
        client: Client,
        guard: LeaseGuard,
        inner: F,
    ) -> impl FnMut(Arc<K>, Arc<Ctx>) -> BoxFuture<'static, Result<Action, ReconcileError<E>>>
    + Send
    + 'static
    + use<K, Ctx, F, Fut, E>
    where
        K: Resource + Send + Sync + 'static,
        K::DynamicType: Default,
        Ctx: Send + Sync + 'static,
        F: FnMut(Arc<K>, Arc<Ctx>, Ownership) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: std::error::Error + Send + 'static,
    {
        self.reconciler_with(client, &K::DynamicType::default(), guard, inner)
    }

    /// [`Shard::reconciler`] for resources with runtime type information (`DynamicObject`).
    pub fn reconciler_with<K, Ctx, F, Fut, E>(
        &self,
        client: Client,
        dyntype: &K::DynamicType,
        guard: LeaseGuard,
        mut inner: F,
    ) -> impl FnMut(Arc<K>, Arc<Ctx>) -> BoxFuture<'static, Result<Action, ReconcileError<E>>>
    + Send
    + 'static
    + use<K, Ctx, F, Fut, E>
    where
        K: Resource + Send + Sync + 'static,
        Ctx: Send + Sync + 'static,
        F: FnMut(Arc<K>, Arc<Ctx>, Ownership) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: std::error::Error + Send + 'static,
    {
        let shard = self.clone();
        // Patching through the erased type works for namespaced and cluster-scoped kinds alike.
        let resource = ApiResource::erase::<K>(dyntype);
        move |object: Arc<K>, context: Arc<Ctx>| {
            let api: Api<DynamicObject> = match object.meta().namespace.as_deref() {
                Some(namespace) => Api::namespaced_with(client.clone(), namespace, &resource),
                None => Api::all_with(client.clone(), &resource),
            };
            let name = object.name_any();
            let fetch: Fetch = {
                let (api, name) = (api.clone(), name.clone());
                Arc::new(move || {
                    let (api, name) = (api.clone(), name.clone());
                    async move { Ok(api.get_opt(&name).await?.map(|o| o.metadata)) }.boxed()
                })
            };
            dispatch(
                &shard,
                &guard,
                object,
                context,
                &mut inner,
                fetch,
                move |_object: Arc<K>, patch| async move {
                    api.patch(&name, &patch_params(), &Patch::Merge(&patch))
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

/// Decides and starts the work for one object; the reads and the acknowledgement are injected
/// so tests can observe them without an API server.
///
/// `guard` is checked now and again when the returned future is first polled, right before
/// `inner`'s future or the acknowledgement starts: the controller may poll it later than it
/// called the wrapper. `acknowledge` is only called after that second check. Both then race
/// against the guard's end.
fn dispatch<K, Ctx, F, Fut, E, A, AFut>(
    shard: &Shard,
    guard: &LeaseGuard,
    object: Arc<K>,
    context: Arc<Ctx>,
    inner: &mut F,
    fetch: Fetch,
    acknowledge: A,
) -> BoxFuture<'static, Result<Action, ReconcileError<E>>>
where
    K: Resource + Send + Sync + 'static,
    F: FnMut(Arc<K>, Arc<Ctx>, Ownership) -> Fut,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    A: FnOnce(Arc<K>, serde_json::Value) -> AFut + Send + 'static,
    AFut: Future<Output = Result<(), kube::Error>> + Send + 'static,
{
    let meta = object.meta();
    let object_name = object_ref(meta);
    if let Err(end) = guard.check() {
        debug!(object = %object_name, shard = %shard.name(), ?end, "not starting work: the shard Lease ended");
        return futures::future::ready(Err(ReconcileError::from_end(end, object_name))).boxed();
    }
    let guard = guard.clone();
    // Registered before the object is judged: a revocation that changes the ranges after the
    // judgement finds the registration and waits for it.
    let in_flight = shard.register_in_flight(meta);
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
            let ownership = Ownership::new(
                shard.clone(),
                object_name.clone(),
                meta.uid.clone(),
                guard.clone(),
                fetch,
            );
            // Calling an `async fn` only builds its future; its body starts at the first poll,
            // after the check below.
            let measured = Arc::clone(&object);
            let reconcile = inner(object, context, ownership);
            let reconcile = match shard.load_meter() {
                Some(meter) => meter.measure(measured.meta(), reconcile).boxed(),
                None => reconcile.boxed(),
            };
            async move {
                guard
                    .check()
                    .map_err(|end| ReconcileError::from_end(end, object_name.clone()))?;
                let revoked = async {
                    match &in_flight {
                        Some(in_flight) => in_flight.token.cancelled().await,
                        None => std::future::pending().await,
                    }
                };
                let result = tokio::select! {
                    biased;
                    end = guard.ended() => {
                        debug!(object = %object_name, ?end, "cancelled a reconcile in flight: the shard Lease ended");
                        Err(ReconcileError::from_end(end, object_name))
                    }
                    () = revoked => {
                        debug!(object = %object_name, "cancelled a reconcile in flight: its range was revoked");
                        Err(ReconcileError::Revoked { object: object_name })
                    }
                    result = reconcile => result.map_err(ReconcileError::Reconcile),
                };
                // Ended: the revocation waiting for it may go on.
                drop(in_flight);
                result
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
                guard
                    .check()
                    .map_err(|end| ReconcileError::from_end(end, object_name.clone()))?;
                // The record carries the write's round trip, so that a reader of the log can
                // tell when the acknowledgement was sent, not only when it was answered.
                let sent = std::time::Instant::now();
                let acknowledged = tokio::select! {
                    biased;
                    end = guard.ended() => return Err(ReconcileError::from_end(end, object_name)),
                    acknowledged = acknowledge(object, patch) => acknowledged,
                };
                acknowledged.map_err(|source| ReconcileError::Drain {
                    object: object_name,
                    source,
                })?;
                info!(
                    event = EVENT_DRAIN,
                    %namespace,
                    %name,
                    shard = %shard_name,
                    %resource_version,
                    took_ms = sent.elapsed().as_secs_f64() * 1e3,
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
