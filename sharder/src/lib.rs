//! The sharder: assigns the objects of every `ClusterRing` to the ring's available shards and
//! moves them when shards come and go.
//!
//! Pure modules ([`ring`], [`key`], [`shard_state`]) take plain data and time and make the
//! decisions; the controller and webhook modules wire them to the Kubernetes API.

pub mod discovery;
pub mod key;
pub mod metrics;
pub mod ring;
pub mod rings;
pub mod shard_state;
pub mod tls;
pub mod validation;
pub mod webhook;
pub mod webhook_config;
