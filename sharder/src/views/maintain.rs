//! Keeps the ring views current: rebuilds a ring's view when the ring, its shard Leases or the
//! discovery of its resources change.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::jiff::Timestamp;
use kube_sharding_api::{Assignment, GroupResource, RingKind, RingRef};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::discovery::Discovery;
use super::registry::Views;
use super::view::build_view;
use crate::caches::Caches;
use crate::changes::LeaseChange;
use crate::core::any_ring::AnyRing;
use crate::core::membership::{RingShards, ring_shards};
use crate::metrics::RingLabel;

/// How often rings with unresolved resources (e.g. a CRD installed later) are resolved again.
const UNRESOLVED_RETRY: Duration = Duration::from_secs(10);

/// What the ring views are built from and where they go.
#[derive(Clone, Debug)]
pub(crate) struct ViewSources {
    /// Rings, their shard Leases and their change hub.
    pub(crate) caches: Caches,
    /// Kinds and scopes of the rings' resources.
    pub(crate) discovery: Arc<Discovery>,
    /// Where the views go.
    pub(crate) views: Arc<Views>,
    /// Protected resources rings may cover (`webhook.config.allowedProtectedResources`).
    pub(crate) allowed_protected: Vec<GroupResource>,
    /// Namespaces of rings without a selector of their own (`webhook.config.namespaceSelector`).
    pub(crate) default_selector: LabelSelector,
    /// Counts the rebuilds of each ring's hash ring.
    pub(crate) ring_calculations: Family<RingLabel, Counter>,
    /// Namespace and controller pins, handed to every view.
    pub(crate) pins: super::Pins,
}

/// Which rings a [`refresh`] looks at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Every ring; with `retry_unresolved`, rings with resources not served before are resolved
    /// again. Views of rings that are gone or invalid are forgotten.
    All {
        /// Resolve rings with unresolved resources again.
        retry_unresolved: bool,
    },
    /// These rings only (their Leases changed).
    Rings(BTreeSet<RingRef>),
}

impl Scope {
    /// The scope covering both.
    fn merge(self, other: Self) -> Self {
        match (self, other) {
            (Self::Rings(mut a), Self::Rings(b)) => {
                a.extend(b);
                Self::Rings(a)
            }
            (
                Self::All {
                    retry_unresolved: a,
                },
                Self::All {
                    retry_unresolved: b,
                },
            ) => Self::All {
                retry_unresolved: a || b,
            },
            (all @ Self::All { .. }, Self::Rings(_)) | (Self::Rings(_), all @ Self::All { .. }) => {
                all
            }
        }
    }

    /// The rings a change among the Leases of `kind` concerns.
    fn of_lease_change(
        kind: RingKind,
        change: Result<LeaseChange, tokio::sync::broadcast::error::RecvError>,
    ) -> Self {
        match change {
            Ok(LeaseChange::Membership { rings, .. }) => Self::Rings(
                rings
                    .into_iter()
                    .map(|name| RingRef::new(kind, name))
                    .collect(),
            ),
            // The state label is not part of membership.
            Ok(LeaseChange::State(_)) => Self::Rings(BTreeSet::new()),
            // Relisted, or fell behind: anything may have changed.
            Ok(LeaseChange::All) | Err(_) => Self::All {
                retry_unresolved: false,
            },
        }
    }
}

/// Rebuilds ring views until `shutdown` fires: every view when a ring changes (`rings`, from the
/// change hub), the views of the rings a Lease membership change concerns (renewals
/// concern none), and rings with unresolved resources every few seconds.
pub(crate) async fn maintain(
    sources: ViewSources,
    mut rings: watch::Receiver<u64>,
    shutdown: CancellationToken,
) {
    let mut retry = tokio::time::interval(UNRESOLVED_RETRY);
    let [mut cluster_leases, mut controller_leases] =
        RingKind::ALL.map(|kind| sources.caches.changes.lease_changes(kind));
    loop {
        let mut scope = tokio::select! {
            () = shutdown.cancelled() => return,
            Ok(()) = rings.changed() => Scope::All { retry_unresolved: false },
            _ = retry.tick() => Scope::All { retry_unresolved: true },
            change = cluster_leases.recv() => Scope::of_lease_change(RingKind::ClusterRing, change),
            change = controller_leases.recv() => Scope::of_lease_change(RingKind::ControllerRing, change),
        };
        // Take in what else arrived meanwhile: a burst of joins rebuilds each ring once.
        for (kind, receiver) in [
            (RingKind::ClusterRing, &mut cluster_leases),
            (RingKind::ControllerRing, &mut controller_leases),
        ] {
            loop {
                match receiver.try_recv() {
                    Ok(change) => scope = scope.merge(Scope::of_lease_change(kind, Ok(change))),
                    Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => {
                        scope = scope.merge(Scope::All {
                            retry_unresolved: false,
                        });
                    }
                    Err(_) => break,
                }
            }
        }
        if scope != Scope::Rings(BTreeSet::new()) {
            refresh(&sources, scope).await;
        }
    }
}

/// Rebuilds the views in `scope` whose ring's spec or set of available shards changed (and, when
/// asked, those with resources not served before); a refresh of every ring also forgets deleted
/// and invalid rings.
pub(crate) async fn refresh(sources: &ViewSources, scope: Scope) {
    let (rings, retry_unresolved) = match &scope {
        Scope::All { retry_unresolved } => (sources.caches.rings(), *retry_unresolved),
        Scope::Rings(rings) => (
            rings
                .iter()
                .filter_map(|r| sources.caches.ring(r))
                .collect(),
            false,
        ),
    };
    let mut keep = BTreeSet::new();
    for ring in rings {
        let ring_ref = ring.ring_ref();
        if ring.validate(&sources.allowed_protected).is_err() {
            // A broken ring is not acted on; the ring controller reports why.
            continue;
        }
        if ring.spec().assignment() == Assignment::ServerSide {
            // No view, so no sync, no watch of unassigned objects and no webhook answers: the
            // ring controller publishes its ranges from the Leases alone, and the sharder's
            // memory does not grow with the ring's objects (docs/zero-write-rings.md).
            continue;
        }
        keep.insert(ring_ref.clone());
        let leases = sources.caches.ring_leases(&ring_ref);
        let RingShards {
            available: shards,
            mut excluded_held,
            leave_controlled_objects,
        } = ring_shards(
            ring_ref.kind,
            &ring_ref.name,
            &ring.spec().lease_namespaces,
            leases.iter().map(AsRef::as_ref),
        );
        // Shards whose held Lease left the ring may still run too (a Lease that came back makes
        // its shard available again), including those another sharder process saw leave and
        // kept in the ring's status.
        let index = sources.caches.lease_index(ring_ref.kind);
        let now = Timestamp::now();
        for departed in ring
            .status()
            .map(|s| s.departed_shards.as_slice())
            .unwrap_or_default()
        {
            index.adopt_departure(&ring_ref.name, &departed.name, departed.until.0, now);
        }
        excluded_held.extend(
            index
                .departed_shards(&ring_ref.name, now)
                .into_iter()
                .filter(|shard| !shards.contains_key(shard)),
        );
        let current = sources.views.get(&ring_ref);
        let shards_changed = current.as_ref().is_none_or(|v| {
            !v.hash_ring
                .members()
                .eq(shards.iter().map(|(n, w)| (n.as_str(), *w)))
                || v.excluded_held != excluded_held
        });
        // Which order a sync walks the resources in; the hash ring stays as it is.
        let order_changed = current
            .as_ref()
            .is_none_or(|v| v.shards_leave_controlled_objects != leave_controlled_objects);
        let spec_changed = current
            .as_ref()
            .is_none_or(|v| v.generation != ring.meta().generation);
        let discovery_generation = sources.discovery.generation();
        let retry = retry_unresolved
            && current.as_ref().is_some_and(|v| {
                !v.unresolved.is_empty() || v.discovery_generation != discovery_generation
            });
        if !(shards_changed || spec_changed || order_changed || retry) {
            continue;
        }
        let resources: Vec<_> = ring
            .spec()
            .resources
            .iter()
            .flat_map(|r| {
                std::iter::once(r.group_resource()).chain(r.controlled_resources.iter().cloned())
            })
            .collect();
        let discovered = sources.discovery.resolve(&resources).await;
        let default_selector = &sources.default_selector;
        let mut view = match &ring {
            AnyRing::Cluster(r) => build_view(r.as_ref(), &shards, &discovered, default_selector),
            AnyRing::Controller(r) => {
                build_view(r.as_ref(), &shards, &discovered, default_selector)
            }
        };
        view.discovery_generation = discovery_generation;
        view.excluded_held = excluded_held;
        view.shards_leave_controlled_objects = leave_controlled_objects;
        view.pins = sources.pins.clone();
        if let Some(current) = &current {
            let now = std::time::Instant::now();
            view.earlier = current.earlier.clone();
            if shards_changed {
                view.earlier.insert(0, (current.hash_ring.clone(), now));
            }
            view.earlier.retain(|(_, replaced)| {
                now.duration_since(*replaced) < super::view::TRANSITION_WINDOW
            });
            view.earlier.truncate(super::view::MAX_EARLIER_RINGS);
        }
        if !(shards_changed || spec_changed || order_changed)
            && current
                .as_ref()
                .is_some_and(|v| v.unresolved == view.unresolved && v.resources == view.resources)
        {
            // A retry that resolved nothing new: keep the view and its revision, so the ring is
            // not synced again for nothing.
            continue;
        }
        if shards_changed {
            sources
                .ring_calculations
                .get_or_create(&RingLabel(ring_ref.clone()))
                .inc();
            tracing::info!(ring = %ring_ref, shards = ?shards, "rebuilt hash ring");
        }
        if !view.unresolved.is_empty() {
            tracing::warn!(ring = %ring_ref, unresolved = ?view.unresolved, "some ring resources are not served by the API server (yet)");
        }
        sources.views.insert(view);
    }
    if matches!(scope, Scope::All { .. }) {
        sources.views.retain(&keep);
        sources.pins.retain(&keep);
        // Every replica, not only the leader whose syncs forget pins of deleted objects.
        sources.pins.prune_old();
    }
}
