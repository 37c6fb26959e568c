//! Ring fixtures shared by the crate's unit tests.

use kube_sharding_api::{ClusterRing, ClusterRingSpec, GroupResource, RingResource};

/// Secrets controlling ConfigMaps: the ring most tests need (and the example's).
pub(crate) fn secrets_controlling_config_maps() -> RingResource {
    RingResource::controlling("", "secrets", [GroupResource::new("", "configmaps")])
}

/// ClusterRing `name` over Secrets controlling ConfigMaps, every other field defaulted.
pub(crate) fn secrets_ring(name: &str) -> ClusterRing {
    ClusterRing::new(
        name,
        ClusterRingSpec::new([secrets_controlling_config_maps()]),
    )
}
