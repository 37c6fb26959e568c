//! Prometheus metrics of the sharder (docs/protocol.md §12).
//!
//! Counters are incremented where things happen. State metrics (`state`) are computed at scrape
//! time from a `StateSource`, which reads the caches (`crate::state_source`), so every replica
//! reports them, leader or not.

use kube_sharding_api::RingRef;

pub(crate) mod load;
mod state;

pub(crate) use self::state::{
    ObjectsSnapshot, RingSnapshot, ShardSnapshot, StateCollector, StateSource,
};
use crate::client::requests::ApiRequests;

use prometheus_client::encoding::{EncodeLabelSet, LabelSetEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Name of the counter of move patches; exposed as `controller_sharding_movements_total`.
pub const MOVEMENTS: &str = "controller_sharding_movements";

/// Name of the counter of drain patches; exposed as `controller_sharding_drains_total`.
pub const DRAINS: &str = "controller_sharding_drains";

/// Name of the counter of sync lists resumed after an expired continue token; exposed as
/// `controller_sharding_list_inconsistent_continuations_total`.
pub const LIST_INCONSISTENT_CONTINUATIONS: &str =
    "controller_sharding_list_inconsistent_continuations";

/// Name of the counter of sync lists started over after an expired continue token; exposed as
/// `controller_sharding_list_restarts_total`.
pub const LIST_RESTARTS: &str = "controller_sharding_list_restarts";

/// The ring label of a series: `clusterring="<name>"` for a ClusterRing, `controllerring="<name>"`
/// for a ControllerRing (docs/protocol.md §15), so each kind's series look as its own protocol's
/// do.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub(crate) struct RingLabel(pub(crate) RingRef);

impl EncodeLabelSet for RingLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        [(self.0.kind.metric_label(), self.0.name.as_str())].encode(encoder)
    }
}

/// Labels of the per-resource counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ResourceLabels {
    /// The ring.
    #[prometheus(flatten)]
    pub(crate) ring: RingLabel,
    /// API group of the resource.
    pub(crate) group: String,
    /// Plural resource name.
    pub(crate) resource: String,
}

/// Labels of a ring with the outcome of something done for it (a webhook request, a sync).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabels {
    /// The ring.
    #[prometheus(flatten)]
    pub(crate) ring: RingLabel,
    /// What came of it.
    pub(crate) outcome: &'static str,
}

impl OutcomeLabels {
    /// Labels for `ring` and `outcome`.
    pub(crate) fn new(ring: &RingRef, outcome: &'static str) -> Self {
        Self {
            ring: RingLabel(ring.clone()),
            outcome,
        }
    }
}

/// A histogram family whose histograms all have the same buckets.
pub(crate) type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Webhook request durations: 100 µs to 10 s, with the API server's timeout (5 s) as a bound.
fn webhook_histogram() -> Histogram {
    Histogram::new([
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        5.0, 10.0,
    ])
}

/// Sync durations: 10 ms to 30 minutes.
fn sync_histogram() -> Histogram {
    Histogram::new([
        0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
    ])
}

/// Counters, histograms and gauges the sharder sets.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Webhook request durations by ring and outcome (`assigned`, `already_assigned`, `unnamed`,
    /// `skipped`, `invalid`).
    pub(crate) webhook_duration: HistogramFamily<OutcomeLabels>,
    /// Durations of complete syncs by ring.
    pub(crate) sync_duration: HistogramFamily<RingLabel>,
    /// Syncs by ring and outcome (`success`, `failure`).
    pub(crate) syncs: Family<OutcomeLabels, Counter>,
    /// Events not published because of the rate limit.
    pub(crate) events_suppressed: Counter,
    /// Objects assigned by the webhook (dry-run requests excluded).
    pub(crate) assignments: Family<ResourceLabels, Counter>,
    /// Move patches sent by the sharder controller.
    pub(crate) movements: Family<ResourceLabels, Counter>,
    /// Drain patches sent by the sharder controller.
    pub(crate) drains: Family<ResourceLabels, Counter>,
    /// Rebuilds of a ring's hash ring.
    pub(crate) ring_calculations: Family<RingLabel, Counter>,
    /// Unassigned objects the missed-assignment path is moving or waiting to retry, per resource.
    pub(crate) missed_assignment_backlog: Family<ResourceLabels, Gauge>,
    /// Requests the sharder's API clients sent.
    pub(crate) api_requests: ApiRequests,
    /// Sync lists resumed with the token of a 410 Gone answer (an expired continue token).
    pub(crate) list_inconsistent_continuations: Family<ResourceLabels, Counter>,
    /// Sync lists started over from the first page (an expired continue token, no successor).
    pub(crate) list_restarts: Family<ResourceLabels, Counter>,
    /// Drain and move patches (and dry-run probes) the sharder controller has in flight.
    pub(crate) patches_in_flight: Gauge,
    /// Controllers' pins not remembered because the ring already had its maximum (views::pins).
    pub(crate) pins_not_remembered: Family<RingLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            webhook_duration: Family::new_with_constructor(webhook_histogram),
            sync_duration: Family::new_with_constructor(sync_histogram),
            syncs: Family::default(),
            events_suppressed: Counter::default(),
            assignments: Family::default(),
            movements: Family::default(),
            drains: Family::default(),
            ring_calculations: Family::default(),
            missed_assignment_backlog: Family::default(),
            api_requests: Family::default(),
            list_inconsistent_continuations: Family::default(),
            list_restarts: Family::default(),
            patches_in_flight: Gauge::default(),
            pins_not_remembered: Family::default(),
        }
    }
}

impl Metrics {
    /// Registers the counters (prometheus-client appends `_total`).
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "controller_sharding_api_requests",
            "Requests sent to the API server by the sharder's clients, by client, verb and resource",
            self.api_requests.clone(),
        );
        registry.register(
            "controller_sharding_assignments",
            "Objects assigned to a shard by the sharder webhook",
            self.assignments.clone(),
        );
        registry.register(
            MOVEMENTS,
            "Move patches sent by the sharder for objects whose shard changed",
            self.movements.clone(),
        );
        registry.register(
            DRAINS,
            "Drain patches sent by the sharder for objects whose shard changed",
            self.drains.clone(),
        );
        registry.register(
            "controller_sharding_pins_not_remembered",
            "Pins of main objects this process did not remember because their ring already had 10,000; their children follow the ring until the leader's sync moves them",
            self.pins_not_remembered.clone(),
        );
        registry.register(
            "controller_sharding_ring_calculations",
            "Rebuilds of a ring's hash ring",
            self.ring_calculations.clone(),
        );
        registry.register(
            "controller_sharding_webhook_request_duration_seconds",
            "Time the sharder webhook took to answer an admission request, by ring and outcome",
            self.webhook_duration.clone(),
        );
        registry.register(
            "controller_sharding_sync_duration_seconds",
            "Time a full sync of a ring took, on the leader",
            self.sync_duration.clone(),
        );
        registry.register(
            "controller_sharding_syncs",
            "Full syncs of a ring by outcome, on the leader",
            self.syncs.clone(),
        );
        registry.register(
            "controller_sharding_events_suppressed",
            "Events the sharder did not publish because of its rate limit",
            self.events_suppressed.clone(),
        );
        registry.register(
            "controller_sharding_missed_assignment_backlog",
            "Unassigned objects the sharder is moving or retrying to get assigned by the webhook",
            self.missed_assignment_backlog.clone(),
        );
        registry.register(
            LIST_INCONSISTENT_CONTINUATIONS,
            "Sync lists whose continue token expired (410 Gone) and that went on with the token of that answer, reading later pages at a newer revision",
            self.list_inconsistent_continuations.clone(),
        );
        registry.register(
            LIST_RESTARTS,
            "Sync lists whose continue token expired (410 Gone) with no token to go on with, started over from the first page",
            self.list_restarts.clone(),
        );
        registry.register(
            "controller_sharding_patches_in_flight",
            "Drain and move patches the sharder controller has in flight across every ring, at most controller.sharder.maxPatchesInFlight",
            self.patches_in_flight.clone(),
        );
    }

    /// Labels for a resource of a ring.
    pub(crate) fn resource_labels(ring: &RingRef, group: &str, resource: &str) -> ResourceLabels {
        ResourceLabels {
            ring: RingLabel(ring.clone()),
            group: group.into(),
            resource: resource.into(),
        }
    }
}

/// Renders the registry in the Prometheus text format.
pub(crate) fn render(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}
