//! What the sharder's controllers, webhook and metrics share.

use std::sync::Arc;

use kube::Client;
use kube_sharding_api::config::SharderConfig;

use crate::caches::Caches;
use crate::leader::direct_moves::DirectMoves;
use crate::leader::events::Events;
use crate::leader::observed::Observed;
use crate::leader::reachability::Reachability;
use crate::metrics::Metrics;
use crate::views::{Discovery, Views};

/// Shared state of one sharder process.
#[derive(Clone)]
pub(crate) struct Context {
    /// API client.
    pub(crate) client: Client,
    /// The validated configuration.
    pub(crate) config: Arc<SharderConfig>,
    /// The caches of rings, shard Leases and Namespaces, and their change hub.
    pub(crate) caches: Caches,
    /// Current view of each ring.
    pub(crate) views: Arc<Views>,
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
    /// The direct moves in flight off each shard: a returning shard's Lease is labelled `ready`
    /// only when none is.
    pub(crate) direct_moves: Arc<DirectMoves>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}
