//! What the sharder's controllers, webhook and metrics share.

use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::runtime::reflector::{ObjectRef, Store};
use sharding_crds::config::SharderConfig;
use sharding_crds::{
    ClusterRing, ClusterRingSpec, ClusterRingStatus, ControllerRing, GroupResource, RingKind,
    RingObject, RingRef,
};

use crate::core::validation::validate_ring;
use crate::events::Events;
use crate::lease_index::LeaseIndex;
use crate::metrics::Metrics;
use crate::observed::Observed;
use crate::reachability::{REASON_WEBHOOK_UNREACHABLE, Reachability};
use crate::ring_views::{Discovery, RingViews};

/// Shared state of one sharder process.
#[derive(Clone)]
pub(crate) struct Context {
    /// API client.
    pub(crate) client: Client,
    /// The validated configuration.
    pub(crate) config: Arc<SharderConfig>,
    /// Cache of every ClusterRing.
    pub(crate) cluster_rings: Store<ClusterRing>,
    /// Cache of every ControllerRing.
    pub(crate) controller_rings: Store<ControllerRing>,
    /// Every Lease carrying the ClusterRing label, cached and grouped by ring.
    pub(crate) cluster_ring_leases: Arc<LeaseIndex>,
    /// Every Lease carrying the ControllerRing label, cached and grouped by ring.
    pub(crate) controller_ring_leases: Arc<LeaseIndex>,
    /// Cache of every Namespace (for namespace selectors).
    pub(crate) namespaces: Store<Namespace>,
    /// Current view of each ring.
    pub(crate) ring_views: Arc<RingViews>,
    /// Resource discovery with a cache.
    pub(crate) discovery: Arc<Discovery>,
    /// Counters.
    pub(crate) metrics: Metrics,
    /// Publishes Events on rings and Leases, rate-limited.
    pub(crate) events: Arc<Events>,
    /// What the leader learned about the rings' objects.
    pub(crate) observed: Arc<Observed>,
    /// Whether the API server reaches each ring's webhook, as the leader's moves show it.
    pub(crate) reachability: Arc<Reachability>,
    /// Bumped when a shard Lease changes in a way membership depends on (not on renewals).
    pub(crate) lease_changes: tokio::sync::watch::Sender<u64>,
    /// Bumped after every change of a cached ring of either kind.
    pub(crate) ring_changes: tokio::sync::watch::Sender<u64>,
    /// Bounds the sharder controller's patches in flight across every ring.
    pub(crate) patch_limit: Arc<crate::controller::patch_limit::PatchLimit>,
}

impl Context {
    /// Every cached ring of both kinds.
    pub(crate) fn rings(&self) -> Vec<AnyRing> {
        let cluster = self.cluster_rings.state().into_iter().map(AnyRing::Cluster);
        let controller = self
            .controller_rings
            .state()
            .into_iter()
            .map(AnyRing::Controller);
        cluster.chain(controller).collect()
    }

    /// The cached ring `ring`, if it exists.
    pub(crate) fn ring(&self, ring: &RingRef) -> Option<AnyRing> {
        match ring.kind {
            RingKind::ClusterRing => self
                .cluster_rings
                .get(&ObjectRef::new(&ring.name))
                .map(AnyRing::Cluster),
            RingKind::ControllerRing => self
                .controller_rings
                .get(&ObjectRef::new(&ring.name))
                .map(AnyRing::Controller),
        }
    }

    /// The Leases carrying the ring label of `kind`, grouped by ring.
    pub(crate) fn lease_index(&self, kind: RingKind) -> &Arc<LeaseIndex> {
        match kind {
            RingKind::ClusterRing => &self.cluster_ring_leases,
            RingKind::ControllerRing => &self.controller_ring_leases,
        }
    }

    /// Every cached Lease of ring `ring` (by its ring label), whatever its state.
    pub(crate) fn ring_leases(&self, ring: &RingRef) -> Vec<Arc<Lease>> {
        self.lease_index(ring.kind).ring_leases(&ring.name)
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

/// A cached ring of either kind.
#[derive(Clone, Debug)]
pub(crate) enum AnyRing {
    /// A ClusterRing.
    Cluster(Arc<ClusterRing>),
    /// A ControllerRing.
    Controller(Arc<ControllerRing>),
}

impl AnyRing {
    /// Kind and name.
    pub(crate) fn ring_ref(&self) -> RingRef {
        match self {
            Self::Cluster(r) => r.ring_ref(),
            Self::Controller(r) => r.ring_ref(),
        }
    }

    /// The spec.
    pub(crate) fn spec(&self) -> &ClusterRingSpec {
        match self {
            Self::Cluster(r) => r.ring_spec(),
            Self::Controller(r) => r.ring_spec(),
        }
    }

    /// The status, if set.
    pub(crate) fn status(&self) -> Option<&ClusterRingStatus> {
        match self {
            Self::Cluster(r) => r.ring_status(),
            Self::Controller(r) => r.ring_status(),
        }
    }

    /// The metadata.
    pub(crate) fn meta(&self) -> &kube::api::ObjectMeta {
        match self {
            Self::Cluster(r) => &r.metadata,
            Self::Controller(r) => &r.metadata,
        }
    }

    /// A reference to the ring, for Events.
    pub(crate) fn object_ref(&self) -> k8s_openapi::api::core::v1::ObjectReference {
        use kube::Resource;
        match self {
            Self::Cluster(r) => r.object_ref(&()),
            Self::Controller(r) => r.object_ref(&()),
        }
    }

    /// Describes the first invariant the ring violates (see [`validate_ring`]); `allowed` lists
    /// the protected resources rings may cover.
    pub(crate) fn validate(&self, allowed: &[GroupResource]) -> Result<(), String> {
        match self {
            Self::Cluster(r) => validate_ring(r.as_ref(), allowed),
            Self::Controller(r) => validate_ring(r.as_ref(), allowed),
        }
    }

    /// Whether the ring's webhook configuration has been applied for its current spec: the ring
    /// controller sets `Ready=True` with the ring's generation only after applying it, or
    /// `Ready=False` for a webhook the API server does not reach (applied, but not answering:
    /// the sync still runs, for drains and for probing it).
    pub(crate) fn webhook_in_place(&self) -> bool {
        let generation = self.meta().generation;
        self.status().is_some_and(|s| {
            s.conditions.iter().any(|c| {
                c.type_ == sharding_crds::cluster_ring::CONDITION_READY
                    && (c.status == "True" || c.reason == REASON_WEBHOOK_UNREACHABLE)
                    && c.observed_generation == generation
            })
        })
    }
}
