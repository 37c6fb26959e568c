//! The API of controller-sharding: the `ClusterRing` and `ControllerRing` custom resources, the label and Lease protocol
//! shared by the sharder and shards, and the sharder's configuration file.
//!
//! This crate makes no API calls; it holds types, constants and pure derivations only.
//!
//! | module | what |
//! |---|---|
//! | [`cluster_ring`] | the `ClusterRing` API types (the spec and status both kinds share), condition reasons and name rule |
//! | [`controller_ring`] | the `ControllerRing` API type (docs/protocol.md §15) |
//! | [`ring_kind`] | the two ring kinds and the names each derives (label keys, Lease label, webhook names) |
//! | [`crd`] | the generated CustomResourceDefinition (`crdgen` writes it to `config/crds/`) |
//! | [`labels`] | well-known labels, identities, the label-key derivation, label syntax checks |
//! | [`lease`] | the Lease protocol's rules both sides use: expiry, shard states, takeover, timing, shard names |
//! | [`config`] | `SharderConfig`, the sharder's configuration file, and its validation |
//! | [`ranges`] | hash ranges for server-side sharded list and watch: FNV-1a, range sets, the `shardSelector` grammar, the range ring |
//! | [`range_lease`] | the two Lease annotations of a zero-write ring's range handover: the published ranges and their acknowledgement |
//! | [`duration`], [`selector`] | Go-style durations and label selectors as the config and rings use them |

#![deny(missing_docs)]

pub mod cluster_ring;
pub mod config;
pub mod controller_ring;
pub mod crd;
pub mod duration;
pub mod labels;
pub mod lease;
pub mod load;
pub mod range_lease;
pub mod ranges;
pub mod ring_kind;
pub mod selector;

pub use cluster_ring::{
    Assignment, ClusterRing, ClusterRingSpec, ClusterRingStatus, DepartedShard, GroupResource,
    HashKey, RingResource,
};
pub use controller_ring::{ControllerRing, ControllerRingSpec};
pub use ring_kind::{RingKind, RingObject, RingRef};
