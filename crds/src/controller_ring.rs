//! The `ControllerRing` API (docs/protocol.md §15): the Go project's ring kind from v0.9 on.
//!
//! Its spec and status are those of `ClusterRing`; only the kind and the names derived from it
//! differ ([`crate::RingKind`]). The spec is a transparent wrapper, so both kinds share one schema
//! and one set of field docs, and the sharder reads either through [`crate::RingObject`].

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::cluster_ring::{ClusterRingSpec, ClusterRingStatus};

/// Desired state of a ControllerRing: exactly a ClusterRing's spec.
///
/// A ControllerRing is a ring of controller instances (shards) that split the objects of some
/// resources between them; it differs from a ClusterRing only in the label keys, the Lease label
/// and the webhook names its ring uses.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "sharding.timebertt.dev",
    version = "v1alpha1",
    kind = "ControllerRing",
    plural = "controllerrings",
    singular = "controllerring",
    status = "ClusterRingStatus"
)]
#[serde(transparent)]
pub struct ControllerRingSpec(pub ClusterRingSpec);

impl From<ClusterRingSpec> for ControllerRingSpec {
    fn from(spec: ClusterRingSpec) -> Self {
        Self(spec)
    }
}

impl std::ops::Deref for ControllerRingSpec {
    type Target = ClusterRingSpec;

    fn deref(&self) -> &ClusterRingSpec {
        &self.0
    }
}
