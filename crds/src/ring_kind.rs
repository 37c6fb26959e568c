//! The two ring kinds the protocol knows (docs/protocol.md §15) and the names each derives for a
//! ring.
//!
//! `ClusterRing` is the protocol of the Go project before v0.9, `ControllerRing` the one from
//! v0.9 on. Both rings work the same way; only the label keys, the Lease label, the webhook
//! configuration name and path, and the metric label differ. Everything kind-specific goes through
//! [`RingKind`], so the sharder and the shard library have one engine for both.

use std::fmt;

use kube::core::ClusterResourceScope;
use kube::{CustomResourceExt, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::cluster_ring::{ClusterRing, ClusterRingSpec, ClusterRingStatus};
use crate::controller_ring::ControllerRing;
use crate::labels;

/// A kind of ring: which label keys, Lease label and webhook names its rings use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RingKind {
    /// `ClusterRing` (docs/protocol.md §1–§14).
    ClusterRing,
    /// `ControllerRing` (docs/protocol.md §15).
    ControllerRing,
}

impl RingKind {
    /// Both kinds.
    pub const ALL: [Self; 2] = [Self::ClusterRing, Self::ControllerRing];

    /// The resource kind, e.g. `ClusterRing`.
    pub const fn kind(self) -> &'static str {
        match self {
            Self::ClusterRing => "ClusterRing",
            Self::ControllerRing => "ControllerRing",
        }
    }

    /// The plural resource name, e.g. `clusterrings`.
    pub const fn plural(self) -> &'static str {
        match self {
            Self::ClusterRing => "clusterrings",
            Self::ControllerRing => "controllerrings",
        }
    }

    /// The label on shard Leases naming the ring they belong to.
    pub const fn lease_label(self) -> &'static str {
        match self {
            Self::ClusterRing => labels::LABEL_CLUSTER_RING,
            Self::ControllerRing => labels::LABEL_CONTROLLER_RING,
        }
    }

    /// The label name of this kind's ring in metric series: `clusterring` or `controllerring`.
    pub const fn metric_label(self) -> &'static str {
        match self {
            Self::ClusterRing => "clusterring",
            Self::ControllerRing => "controllerring",
        }
    }

    /// The other kind: a Lease carrying both kinds' ring labels is used by neither.
    pub const fn other(self) -> Self {
        match self {
            Self::ClusterRing => Self::ControllerRing,
            Self::ControllerRing => Self::ClusterRing,
        }
    }

    /// The label key carrying the shard an object of ring `ring` is assigned to.
    pub fn shard_label(self, ring: &str) -> String {
        match self {
            Self::ClusterRing => labels::shard_label(ring),
            Self::ControllerRing => format!("{}{ring}", labels::SHARD_LABEL_PREFIX),
        }
    }

    /// The label key asking the shard of an object of ring `ring` to give it up.
    pub fn drain_label(self, ring: &str) -> String {
        match self {
            Self::ClusterRing => labels::drain_label(ring),
            Self::ControllerRing => format!("{}{ring}", labels::DRAIN_LABEL_PREFIX),
        }
    }

    /// The annotation key pinning an object of ring `ring` (or a namespace's objects) to a shard.
    pub fn pin_annotation(self, ring: &str) -> String {
        match self {
            Self::ClusterRing => labels::pin_annotation(ring),
            Self::ControllerRing => format!("{}{ring}", labels::PIN_ANNOTATION_PREFIX),
        }
    }

    /// Name of the MutatingWebhookConfiguration of ring `ring`.
    pub fn webhook_configuration_name(self, ring: &str) -> String {
        match self {
            Self::ClusterRing => labels::webhook_configuration_name(ring),
            Self::ControllerRing => format!("controllerring-{ring}"),
        }
    }

    /// The path segment after `/webhooks/sharder/`: the lowercase kind.
    pub const fn path_segment(self) -> &'static str {
        match self {
            Self::ClusterRing => "clusterring",
            Self::ControllerRing => "controllerring",
        }
    }

    /// The kind whose webhook paths use `segment`, if any.
    pub fn from_path_segment(segment: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.path_segment() == segment)
    }

    /// Path under which the sharder serves the webhook of ring `ring`.
    pub fn webhook_path(self, ring: &str) -> String {
        format!(
            "{}{}/{ring}",
            labels::WEBHOOK_PATH_ROOT,
            self.path_segment()
        )
    }

    /// The kind named `kind` (`ClusterRing` or `ControllerRing`, case-insensitive).
    pub fn parse(kind: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.kind().eq_ignore_ascii_case(kind))
    }
}

impl fmt::Display for RingKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind())
    }
}

impl std::str::FromStr for RingKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
            .ok_or_else(|| format!("unknown ring kind {s:?}: use ClusterRing or ControllerRing"))
    }
}

/// One ring, named by kind and name: a ClusterRing and a ControllerRing may share a name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RingRef {
    /// The ring's kind.
    pub kind: RingKind,
    /// The ring's name.
    pub name: String,
}

impl RingRef {
    /// Names ring `name` of `kind`.
    pub fn new(kind: RingKind, name: impl Into<String>) -> Self {
        Self {
            kind,
            name: name.into(),
        }
    }

    /// The ring's shard label key.
    pub fn shard_label(&self) -> String {
        self.kind.shard_label(&self.name)
    }

    /// The ring's drain label key.
    pub fn drain_label(&self) -> String {
        self.kind.drain_label(&self.name)
    }

    /// The ring's pin annotation key.
    pub fn pin_annotation(&self) -> String {
        self.kind.pin_annotation(&self.name)
    }
}

impl fmt::Display for RingRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind.kind(), self.name)
    }
}

/// What the sharder needs of either ring type: its kind, spec and status.
pub trait RingObject:
    Resource<DynamicType = (), Scope = ClusterResourceScope>
    + CustomResourceExt
    + Clone
    + fmt::Debug
    + DeserializeOwned
    + Serialize
    + Send
    + Sync
    + 'static
{
    /// The ring kind of this type.
    const KIND: RingKind;

    /// The ring's spec.
    fn ring_spec(&self) -> &ClusterRingSpec;

    /// The ring's status, if set.
    fn ring_status(&self) -> Option<&ClusterRingStatus>;

    /// The ring's kind and name.
    fn ring_ref(&self) -> RingRef {
        RingRef::new(Self::KIND, self.meta().name.clone().unwrap_or_default())
    }
}

impl RingObject for ClusterRing {
    const KIND: RingKind = RingKind::ClusterRing;

    fn ring_spec(&self) -> &ClusterRingSpec {
        &self.spec
    }

    fn ring_status(&self) -> Option<&ClusterRingStatus> {
        self.status.as_ref()
    }
}

impl RingObject for ControllerRing {
    const KIND: RingKind = RingKind::ControllerRing;

    fn ring_spec(&self) -> &ClusterRingSpec {
        &self.spec.0
    }

    fn ring_status(&self) -> Option<&ClusterRingStatus> {
        self.status.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_worked_example() {
        let kind = RingKind::ControllerRing;
        assert_eq!(
            kind.shard_label("example"),
            "shard.alpha.sharding.timebertt.dev/example"
        );
        assert_eq!(
            kind.drain_label("example"),
            "drain.alpha.sharding.timebertt.dev/example"
        );
        assert_eq!(
            kind.webhook_configuration_name("example"),
            "controllerring-example"
        );
        assert_eq!(
            kind.webhook_path("example"),
            "/webhooks/sharder/controllerring/example"
        );
        assert_eq!(
            kind.lease_label(),
            "alpha.sharding.timebertt.dev/controllerring"
        );
        assert_eq!(
            RingKind::ClusterRing.webhook_path("example"),
            labels::webhook_path("example")
        );
    }

    #[test]
    fn pin_annotations_share_the_shard_labels_ring_part() {
        assert_eq!(
            RingKind::ControllerRing.pin_annotation("example"),
            "pin.alpha.sharding.timebertt.dev/example"
        );
        assert_eq!(
            RingKind::ClusterRing.pin_annotation("example"),
            "pin.alpha.sharding.timebertt.dev/clusterring-50d858e0-example"
        );
        for kind in RingKind::ALL {
            let name = "a-ring-name-long-enough-to-be-cut-in-the-label-key-of-its-kind";
            let pin = kind.pin_annotation(name);
            let shard = kind.shard_label(name);
            assert_eq!(
                pin.strip_prefix(labels::PIN_ANNOTATION_PREFIX),
                shard.strip_prefix(labels::SHARD_LABEL_PREFIX)
            );
            assert!(labels::is_valid_label_key(&pin), "{pin}");
        }
    }

    #[test]
    fn kinds_round_trip() {
        for kind in RingKind::ALL {
            assert_eq!(RingKind::from_path_segment(kind.path_segment()), Some(kind));
            assert_eq!(kind.kind().parse::<RingKind>(), Ok(kind));
            assert_eq!(kind.other().other(), kind);
            assert_ne!(kind.lease_label(), kind.other().lease_label());
        }
        assert!("Ring".parse::<RingKind>().is_err());
    }

    #[derive(serde::Deserialize)]
    struct Vectors {
        cases: Vec<Case>,
    }

    #[derive(serde::Deserialize)]
    struct Case {
        ring: String,
        shard_label: String,
        drain_label: String,
        webhook_configuration: String,
        lease_label: String,
        webhook_path: String,
    }

    #[test]
    fn controller_ring_vectors() {
        let text = include_str!("../vectors/controllerring_labels.json");
        let vectors: Vectors = serde_json::from_str(text).expect("vectors parse");
        assert!(vectors.cases.len() >= 5);
        let kind = RingKind::ControllerRing;
        for case in vectors.cases {
            assert_eq!(kind.shard_label(&case.ring), case.shard_label);
            assert_eq!(kind.drain_label(&case.ring), case.drain_label);
            assert_eq!(
                kind.webhook_configuration_name(&case.ring),
                case.webhook_configuration
            );
            assert_eq!(kind.lease_label(), case.lease_label);
            assert_eq!(kind.webhook_path(&case.ring), case.webhook_path);
        }
    }
}
