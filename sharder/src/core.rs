//! The sharder's pure core: plain data and time in, decisions out. Nothing here talks to the API
//! server, reads a clock or spawns a task, so every rule is unit-tested with plain values.
//!
//! | module | decides |
//! |---|---|
//! | [`hash_ring`] | the consistent hash ring: which available shard a key belongs to (docs/protocol.md §5) |
//! | `any_ring` | a `ClusterRing` or a `ControllerRing`, read the same way |
//! | `key` | the hash key of an object, from its own identity or its controller's (docs/protocol.md §6) |
//! | `owner_wait` | which controlled objects a sync holds back until their controller has left their shard (docs/protocol.md §9) |
//! | `list_scope` | whether a sync lists a namespaced resource per selected namespace or across the cluster (docs/protocol.md §9) |
//! | `pin` | whether a pin (annotation on an object, its namespace or its controller) places an object, or why not (docs/protocol.md §21) |
//! | `membership` | which shard Leases put their shard into the ring, and why others are kept out (docs/protocol.md §4, §18) |
//! | `range_handover` | which range annotations a zero-write ring's shard Leases get, revoke before grant, so no hash is held by two shards (docs/zero-write-rings.md) |
//! | `rebalance` | keep, drain or move one object (docs/protocol.md §9) |
//! | `sync_rules` | one sync's order of resources, what each listed object counts for, which controlled objects wait, the sync's outcome (docs/protocol.md §9) |
//! | `sync_schedule` | when each ring is synced: on change, periodically, with backoff (docs/protocol.md §9) |
//! | `validation` | whether a ring is acted on at all (docs/protocol.md §1) |
//! | `webhook_config` | the desired MutatingWebhookConfiguration of a ring (docs/protocol.md §8) |
//!
//! The Lease rules (shard states, expiry, takeover) are shared with the shard library and live
//! in [`kube_sharding_api::lease`].

pub(crate) mod any_ring;
pub mod hash_ring;
pub(crate) mod key;
pub mod list_scope;
pub(crate) mod membership;
pub(crate) mod owner_wait;
pub(crate) mod pin;
pub(crate) mod range_handover;
pub(crate) mod rebalance;
pub(crate) mod sync_rules;
pub(crate) mod sync_schedule;
pub(crate) mod validation;
pub mod webhook_config;
