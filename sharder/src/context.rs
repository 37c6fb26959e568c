//! What the sharder's controllers, webhook and metrics share.

use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::Store;
use sharding_crds::ClusterRing;
use sharding_crds::config::SharderConfig;

use crate::metrics::Metrics;
use crate::ring_views::{Discovery, RingViews};

/// Shared state of one sharder process.
#[derive(Clone)]
pub(crate) struct Context {
    /// API client.
    pub(crate) client: Client,
    /// The validated configuration.
    pub(crate) config: Arc<SharderConfig>,
    /// Cache of every ClusterRing.
    pub(crate) rings: Store<ClusterRing>,
    /// Cache of every Lease carrying the ring label.
    pub(crate) leases: Store<Lease>,
    /// Cache of every Namespace (for namespace selectors).
    pub(crate) namespaces: Store<Namespace>,
    /// Current view of each ring.
    pub(crate) ring_views: Arc<RingViews>,
    /// Resource discovery with a cache.
    pub(crate) discovery: Arc<Discovery>,
    /// Counters.
    pub(crate) metrics: Metrics,
    /// Publishes Events on ClusterRings.
    pub(crate) recorder: Recorder,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}
