//! The log records the crate writes for machines: the values of their `event` field.
//!
//! The crate logs through `tracing`. The records below carry an `event` field with a fixed
//! value, so that operators (alerts, log queries) and tests match on it and never on the
//! message text, which may be reworded. Their other fields are part of the same contract.
//!
//! | `event` | level | written when | further fields |
//! |---|---|---|---|
//! | [`lease_acquired`](EVENT_LEASE_ACQUIRED) | info | the Lease lock holds its Lease | `identity`, `transitions` (`spec.leaseTransitions`) |
//! | [`lease_lost`](EVENT_LEASE_LOST) | warn | the Lease was lost, right after [`HeldLease::lost_token`] fired | `renew_deadline` (missed it) or `holder` (someone else, or `<none>`) |
//! | [`lease_released`](EVENT_LEASE_RELEASED) | info | [`HeldLease::release`] emptied the holder | |
//! | [`lease_excluded`](EVENT_LEASE_EXCLUDED) | error | the lock found its Lease excluded from its ring | `reason` (see [`LeaseLockConfig::with_exclusion_annotation`]) |
//! | [`lease_kept`](EVENT_LEASE_KEPT) | info | [`Shard::run`] stopped on shutdown and left the Lease held for the returning pod ([`OnShutdown::KeepIfReturning`]) | `shard`, `statefulset`, `ordinal`, `replicas` |
//! | [`term_started`](EVENT_TERM_STARTED) | info | a term's work starts under [`Shard::run`] | `shard`, `term`, `waited_ms`, `judged` |
//! | [`shard_excluded`](EVENT_SHARD_EXCLUDED) | error | [`Shard::run`] stepped out because the sharder excluded its Lease | `shard`, `reason`, `released`, `rejoin_pause` |
//! | [`drain`](EVENT_DRAIN) | info | [`Shard::reconciler`] acknowledged a drain | `namespace`, `name`, `shard`, `resource_version`, `took_ms` |
//! | [`ranges_applied`](EVENT_RANGES_APPLIED) | info | a zero-write shard runs with a new generation of ranges | `shard`, `generation`, `ranges`, `share`, `released`, `cancelled`, `took_ms` |
//! | [`ranges_acknowledged`](EVENT_RANGES_ACKNOWLEDGED) | info | a zero-write shard acknowledged a generation on its Lease | `shard`, `generation`, `took_ms` |
//! | [`shard_selector_applied`](EVENT_SELECTOR_APPLIED) | info | once per [`ShardedWatch`]: the API server applied the shard selector | `resource` |
//! | [`shard_selector_ignored`](EVENT_SELECTOR_IGNORED) | warn | once per [`ShardedWatch`]: the API server ignored it, the client filters | `resource` |
//!
//! The four `lease_*` records of the lock also carry `lease`, `namespace` and
//! `resource_version`: the Lease's `metadata.resourceVersion` as the lock last wrote it (by the
//! acquiring write; by the last successful renewal before the loss; by the releasing write), to
//! match against a watch of the Lease. The loss is recorded right after the lost token fired, so
//! anything that checks the token after the record's timestamp sees the loss.
//!
//! [`HeldLease::lost_token`]: crate::HeldLease::lost_token
//! [`HeldLease::release`]: crate::HeldLease::release
//! [`LeaseLockConfig::with_exclusion_annotation`]: crate::LeaseLockConfig::with_exclusion_annotation
//! [`Shard::run`]: crate::Shard::run
//! [`Shard::reconciler`]: crate::Shard::reconciler
//! [`OnShutdown::KeepIfReturning`]: crate::OnShutdown::KeepIfReturning
//! [`ShardedWatch`]: crate::sharded_watch::ShardedWatch

/// The Lease lock acquired its Lease.
pub const EVENT_LEASE_ACQUIRED: &str = "lease_acquired";
/// The Lease lock lost its Lease (missed its renew deadline, or someone else holds it).
pub const EVENT_LEASE_LOST: &str = "lease_lost";
/// The Lease lock released its Lease.
pub const EVENT_LEASE_RELEASED: &str = "lease_released";
/// The Lease lock found its Lease excluded from its ring, with the `reason`.
pub const EVENT_LEASE_EXCLUDED: &str = "lease_excluded";
/// The shard stopped on shutdown and left its Lease held for the pod that comes back.
pub const EVENT_LEASE_KEPT: &str = "lease_kept";
/// A term's work starts, with `waited_ms`: how long it waited for the sharder to judge a Lease
/// just created or taken over (0 otherwise).
pub const EVENT_TERM_STARTED: &str = "term_started";
/// The shard stepped out of its ring because the sharder excluded its Lease.
pub const EVENT_SHARD_EXCLUDED: &str = "shard_excluded";
/// The shard acknowledged the drain of one object.
pub const EVENT_DRAIN: &str = "drain";
/// A zero-write shard runs with a new generation of ranges, before it acknowledges it.
pub const EVENT_RANGES_APPLIED: &str = "ranges_applied";
/// A zero-write shard wrote its acknowledgement of a generation of ranges.
pub const EVENT_RANGES_ACKNOWLEDGED: &str = "ranges_acknowledged";
/// A list response showed that the API server applied the shard selector.
pub const EVENT_SELECTOR_APPLIED: &str = "shard_selector_applied";
/// A list response showed that the API server ignored the shard selector.
pub const EVENT_SELECTOR_IGNORED: &str = "shard_selector_ignored";

/// The error with its sources joined by `: `, for the one-line `error` field of records.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
