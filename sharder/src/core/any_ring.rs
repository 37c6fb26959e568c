//! A ring of either kind, as the caches and the kubectl plugin hold it.

use std::sync::Arc;

use kube_sharding_api::{
    ClusterRing, ClusterRingSpec, ClusterRingStatus, ControllerRing, GroupResource, RingObject,
    RingRef,
};

use crate::core::validation::{InvalidRing, validate_ring};

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
    pub(crate) fn validate(&self, allowed: &[GroupResource]) -> Result<(), InvalidRing> {
        match self {
            Self::Cluster(r) => validate_ring(r.as_ref(), allowed),
            Self::Controller(r) => validate_ring(r.as_ref(), allowed),
        }
    }
}
