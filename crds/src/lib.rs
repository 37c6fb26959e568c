//! The API of controller-sharding: the `ClusterRing` custom resource, the label and Lease protocol
//! shared by the sharder and shards, and the sharder's configuration file.
//!
//! This crate makes no API calls; it holds types, constants and pure derivations only.

pub mod cluster_ring;
pub mod config;
pub mod crd;
pub mod duration;
pub mod labels;
pub mod selector;

pub use cluster_ring::{
    ClusterRing, ClusterRingSpec, ClusterRingStatus, GroupResource, RingResource,
};
