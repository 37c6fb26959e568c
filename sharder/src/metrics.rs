//! Prometheus metrics of the sharder (SPEC §12).
//!
//! Counters are incremented where things happen. State metrics are computed at scrape time from
//! the caches through a `StateSource` (`CacheState`), so every replica reports them, leader or
//! not.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use sharding_crds::labels::LABEL_CLUSTER_RING;
use sharding_crds::lease::ShardLease;

use crate::context::Context;
use crate::core::membership::{Exclusion, ring_members};

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Name of the counter of move patches; exposed as `controller_sharding_movements_total`.
pub const MOVEMENTS: &str = "controller_sharding_movements";

/// Name of the counter of drain patches; exposed as `controller_sharding_drains_total`.
pub const DRAINS: &str = "controller_sharding_drains";

/// Labels of the per-resource counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ResourceLabels {
    /// Ring name.
    pub(crate) clusterring: String,
    /// API group of the resource.
    pub(crate) group: String,
    /// Plural resource name.
    pub(crate) resource: String,
}

/// Labels of the per-ring counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RingLabels {
    /// Ring name.
    pub(crate) clusterring: String,
}

/// Counters the sharder increments.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    /// Objects assigned by the webhook (dry-run requests excluded).
    pub(crate) assignments: Family<ResourceLabels, Counter>,
    /// Move patches sent by the sharder controller.
    pub(crate) movements: Family<ResourceLabels, Counter>,
    /// Drain patches sent by the sharder controller.
    pub(crate) drains: Family<ResourceLabels, Counter>,
    /// Rebuilds of a ring's hash ring.
    pub(crate) ring_calculations: Family<RingLabels, Counter>,
    /// Unassigned objects the missed-assignment path is moving or waiting to retry, per resource.
    pub(crate) missed_assignment_backlog: Family<ResourceLabels, Gauge>,
}

impl Metrics {
    /// Registers the counters (prometheus-client appends `_total`).
    pub(crate) fn register(&self, registry: &mut Registry) {
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
            "controller_sharding_ring_calculations",
            "Rebuilds of a ClusterRing's hash ring",
            self.ring_calculations.clone(),
        );
        registry.register(
            "controller_sharding_missed_assignment_backlog",
            "Unassigned objects the sharder is moving or retrying to get assigned by the webhook",
            self.missed_assignment_backlog.clone(),
        );
    }

    /// Labels for a resource of a ring.
    pub(crate) fn resource_labels(ring: &str, group: &str, resource: &str) -> ResourceLabels {
        ResourceLabels {
            clusterring: ring.into(),
            group: group.into(),
            resource: resource.into(),
        }
    }
}

/// What the state metrics report about one ring.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RingSnapshot {
    /// Ring name.
    pub(crate) name: String,
    /// Ring UID.
    pub(crate) uid: String,
    /// `metadata.generation`.
    pub(crate) generation: i64,
    /// `status.observedGeneration`.
    pub(crate) observed_generation: i64,
    /// `status.shards`.
    pub(crate) shards: i64,
    /// `status.availableShards`.
    pub(crate) available_shards: i64,
}

/// What the state metrics report about one shard Lease.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ShardSnapshot {
    /// Namespace of the Lease.
    pub(crate) namespace: String,
    /// Shard name (the Lease name).
    pub(crate) shard: String,
    /// Ring name.
    pub(crate) clusterring: String,
    /// UID of the Lease.
    pub(crate) uid: String,
    /// Current state, one of [`SHARD_STATES`] (`unknown` when it cannot be determined).
    pub(crate) state: &'static str,
    /// Why the Lease is kept out of the ring (an invalid or duplicate name), if it is.
    pub(crate) excluded: Option<&'static str>,
}

/// Every value of the `state` label of `controller_sharding_shard_state`.
pub(crate) const SHARD_STATES: [&str; 6] = [
    "ready",
    "expired",
    "uncertain",
    "dead",
    "orphaned",
    "unknown",
];

/// Provides the current state at scrape time.
pub(crate) trait StateSource: std::fmt::Debug + Send + Sync + 'static {
    /// The rings known to this replica.
    fn rings(&self) -> Vec<RingSnapshot>;
    /// The shard Leases known to this replica, with their state as of now.
    fn shards(&self) -> Vec<ShardSnapshot>;
}

/// Collector computing the state metrics from a [`StateSource`] on every scrape.
#[derive(Debug)]
pub(crate) struct StateCollector<S>(pub(crate) Arc<S>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RingUidLabels {
    clusterring: String,
    uid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardInfoLabels {
    namespace: String,
    shard: String,
    clusterring: String,
    uid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardStateLabels {
    namespace: String,
    shard: String,
    clusterring: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardExcludedLabels {
    namespace: String,
    shard: String,
    clusterring: String,
    reason: String,
}

fn encode_gauges<L>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: impl IntoIterator<Item = (L, i64)>,
) -> Result<(), std::fmt::Error>
where
    L: EncodeLabelSet + Clone + std::hash::Hash + Eq + std::fmt::Debug + Send + Sync + 'static,
{
    let family = Family::<L, Gauge>::default();
    for (labels, value) in values {
        family.get_or_create(&labels).set(value);
    }
    family.encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

impl<S: StateSource> prometheus_client::collector::Collector for StateCollector<S> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let rings = self.0.rings();
        let ring_gauge = |f: fn(&RingSnapshot) -> i64| {
            rings
                .iter()
                .map(move |r| {
                    let labels = RingUidLabels {
                        clusterring: r.name.clone(),
                        uid: r.uid.clone(),
                    };
                    (labels, f(r))
                })
                .collect::<Vec<_>>()
        };
        encode_gauges(
            &mut encoder,
            "controller_sharding_clusterring_metadata_generation",
            "metadata.generation of the ClusterRing",
            ring_gauge(|r| r.generation),
        )?;
        encode_gauges(
            &mut encoder,
            "controller_sharding_clusterring_observed_generation",
            "status.observedGeneration of the ClusterRing",
            ring_gauge(|r| r.observed_generation),
        )?;
        encode_gauges(
            &mut encoder,
            "controller_sharding_clusterring_status_shards",
            "status.shards of the ClusterRing: all shard Leases of the ring",
            ring_gauge(|r| r.shards),
        )?;
        encode_gauges(
            &mut encoder,
            "controller_sharding_clusterring_status_available_shards",
            "status.availableShards of the ClusterRing",
            ring_gauge(|r| r.available_shards),
        )?;

        let shards = self.0.shards();
        encode_gauges(
            &mut encoder,
            "controller_sharding_shard_info",
            "Information about a shard of a ClusterRing",
            shards.iter().map(|s| {
                let labels = ShardInfoLabels {
                    namespace: s.namespace.clone(),
                    shard: s.shard.clone(),
                    clusterring: s.clusterring.clone(),
                    uid: s.uid.clone(),
                };
                (labels, 1)
            }),
        )?;
        encode_gauges(
            &mut encoder,
            "controller_sharding_shard_state",
            "State of a shard as a state set: 1 for its current state, 0 for the others",
            shards.iter().flat_map(|s| {
                SHARD_STATES.iter().map(move |state| {
                    let labels = ShardStateLabels {
                        namespace: s.namespace.clone(),
                        shard: s.shard.clone(),
                        clusterring: s.clusterring.clone(),
                        state: (*state).to_string(),
                    };
                    (labels, i64::from(*state == s.state))
                })
            }),
        )?;
        encode_gauges(
            &mut encoder,
            "controller_sharding_shard_excluded",
            "Shard Leases kept out of their ring although held: 1 per Lease, with the reason (InvalidShardName, DuplicateShardName)",
            shards.iter().filter_map(|s| {
                let labels = ShardExcludedLabels {
                    namespace: s.namespace.clone(),
                    shard: s.shard.clone(),
                    clusterring: s.clusterring.clone(),
                    reason: s.excluded?.to_string(),
                };
                Some((labels, 1))
            }),
        )
    }
}

/// Renders the registry in the Prometheus text format.
pub(crate) fn render(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}

/// State metrics read from the caches at scrape time.
#[derive(Debug)]
pub(crate) struct CacheState(pub(crate) Context);

impl StateSource for CacheState {
    fn rings(&self) -> Vec<RingSnapshot> {
        self.0
            .rings
            .state()
            .iter()
            .map(|r| {
                let status = r.status.clone().unwrap_or_default();
                RingSnapshot {
                    name: r.name_any(),
                    uid: r.uid().unwrap_or_default(),
                    generation: r.metadata.generation.unwrap_or_default(),
                    observed_generation: status.observed_generation.unwrap_or_default(),
                    shards: status.shards.into(),
                    available_shards: status.available_shards.into(),
                }
            })
            .collect()
    }

    fn shards(&self) -> Vec<ShardSnapshot> {
        let now = Timestamp::now();
        let leases = self.0.leases.state();
        let rings: BTreeSet<&String> = leases
            .iter()
            .filter_map(|l| l.labels().get(LABEL_CLUSTER_RING))
            .collect();
        rings
            .into_iter()
            .flat_map(|ring| {
                ring_members(ring, leases.iter().map(AsRef::as_ref))
                    .into_iter()
                    .map(move |m| ShardSnapshot {
                        namespace: m.lease.namespace().unwrap_or_default(),
                        shard: m.lease.name_any(),
                        clusterring: ring.clone(),
                        uid: m.lease.uid().unwrap_or_default(),
                        state: ShardLease::from_lease(m.lease).state(now).as_str(),
                        excluded: m.exclusion.as_ref().map(Exclusion::reason),
                    })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fixed;

    impl StateSource for Fixed {
        fn rings(&self) -> Vec<RingSnapshot> {
            vec![RingSnapshot {
                name: "example".into(),
                uid: "u1".into(),
                generation: 3,
                observed_generation: 2,
                shards: 3,
                available_shards: 2,
            }]
        }

        fn shards(&self) -> Vec<ShardSnapshot> {
            vec![
                ShardSnapshot {
                    namespace: "default".into(),
                    shard: "shard-a".into(),
                    clusterring: "example".into(),
                    uid: "l1".into(),
                    state: "expired",
                    excluded: None,
                },
                ShardSnapshot {
                    namespace: "default".into(),
                    shard: "x".repeat(64),
                    clusterring: "example".into(),
                    uid: "l2".into(),
                    state: "ready",
                    excluded: Some("InvalidShardName"),
                },
            ]
        }
    }

    #[test]
    fn renders_counters_and_state() {
        let metrics = Metrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        registry.register_collector(Box::new(StateCollector(Arc::new(Fixed))));
        metrics
            .assignments
            .get_or_create(&Metrics::resource_labels("example", "", "secrets"))
            .inc();
        metrics
            .ring_calculations
            .get_or_create(&RingLabels {
                clusterring: "example".into(),
            })
            .inc_by(2);
        let text = render(&registry).expect("renders");
        for line in [
            r#"controller_sharding_assignments_total{clusterring="example",group="",resource="secrets"} 1"#,
            r#"controller_sharding_ring_calculations_total{clusterring="example"} 2"#,
            r#"controller_sharding_clusterring_metadata_generation{clusterring="example",uid="u1"} 3"#,
            r#"controller_sharding_clusterring_observed_generation{clusterring="example",uid="u1"} 2"#,
            r#"controller_sharding_clusterring_status_shards{clusterring="example",uid="u1"} 3"#,
            r#"controller_sharding_clusterring_status_available_shards{clusterring="example",uid="u1"} 2"#,
            r#"controller_sharding_shard_info{namespace="default",shard="shard-a",clusterring="example",uid="l1"} 1"#,
            r#"controller_sharding_shard_state{namespace="default",shard="shard-a",clusterring="example",state="expired"} 1"#,
            r#"controller_sharding_shard_state{namespace="default",shard="shard-a",clusterring="example",state="ready"} 0"#,
            r#"controller_sharding_shard_state{namespace="default",shard="shard-a",clusterring="example",state="unknown"} 0"#,
            &format!(
                r#"controller_sharding_shard_excluded{{namespace="default",shard="{}",clusterring="example",reason="InvalidShardName"}} 1"#,
                "x".repeat(64)
            ),
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
        }
    }
}
