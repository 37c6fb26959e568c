//! Prometheus metrics of the sharder (SPEC §12).
//!
//! Counters are incremented where things happen. State metrics are computed at scrape time from
//! the caches through a `StateSource` (`CacheState`), so every replica reports them, leader or
//! not.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use sharding_crds::lease::ShardLease;
use sharding_crds::{RingKind, RingRef};

use crate::context::Context;
use crate::core::membership::{Exclusion, ring_members};

use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeMetric, LabelSetEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Name of the counter of move patches; exposed as `controller_sharding_movements_total`.
pub const MOVEMENTS: &str = "controller_sharding_movements";

/// Name of the counter of drain patches; exposed as `controller_sharding_drains_total`.
pub const DRAINS: &str = "controller_sharding_drains";

/// The ring label of a series: `clusterring="<name>"` for a ClusterRing, `controllerring="<name>"`
/// for a ControllerRing (SPEC §15), so each kind's series look as its own protocol's do.
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
    pub(crate) ring_calculations: Family<RingLabel, Counter>,
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
            "Rebuilds of a ring's hash ring",
            self.ring_calculations.clone(),
        );
        registry.register(
            "controller_sharding_missed_assignment_backlog",
            "Unassigned objects the sharder is moving or retrying to get assigned by the webhook",
            self.missed_assignment_backlog.clone(),
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

/// What the state metrics report about one ring.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RingSnapshot {
    /// Ring kind and name.
    pub(crate) ring: RingRef,
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
    /// The ring.
    pub(crate) ring: RingRef,
    /// UID of the Lease.
    pub(crate) uid: String,
    /// Current state, one of [`SHARD_STATES`] (`unknown` when it cannot be determined).
    pub(crate) state: &'static str,
    /// Why the Lease is kept out of the ring (an invalid or duplicate name), if it is.
    pub(crate) excluded: Option<&'static str>,
    /// The shard's weight (1 unless its Lease asks for a valid other one).
    pub(crate) weight: u32,
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
    #[prometheus(flatten)]
    ring: RingLabel,
    uid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardInfoLabels {
    namespace: String,
    shard: String,
    #[prometheus(flatten)]
    ring: RingLabel,
    uid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardStateLabels {
    namespace: String,
    shard: String,
    #[prometheus(flatten)]
    ring: RingLabel,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardExcludedLabels {
    namespace: String,
    shard: String,
    #[prometheus(flatten)]
    ring: RingLabel,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardWeightLabels {
    namespace: String,
    shard: String,
    #[prometheus(flatten)]
    ring: RingLabel,
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
        // Each kind's ring metrics carry its own name, as in the protocol it comes from:
        // `controller_sharding_clusterring_*` and `controller_sharding_controllerring_*`.
        for kind in RingKind::ALL {
            let ring_gauge = |f: fn(&RingSnapshot) -> i64| {
                rings
                    .iter()
                    .filter(|r| r.ring.kind == kind)
                    .map(move |r| {
                        let labels = RingUidLabels {
                            ring: RingLabel(r.ring.clone()),
                            uid: r.uid.clone(),
                        };
                        (labels, f(r))
                    })
                    .collect::<Vec<_>>()
            };
            let (prefix, kind) = (kind.metric_label(), kind.kind());
            encode_gauges(
                &mut encoder,
                &format!("controller_sharding_{prefix}_metadata_generation"),
                &format!("metadata.generation of the {kind}"),
                ring_gauge(|r| r.generation),
            )?;
            encode_gauges(
                &mut encoder,
                &format!("controller_sharding_{prefix}_observed_generation"),
                &format!("status.observedGeneration of the {kind}"),
                ring_gauge(|r| r.observed_generation),
            )?;
            encode_gauges(
                &mut encoder,
                &format!("controller_sharding_{prefix}_status_shards"),
                &format!("status.shards of the {kind}: all shard Leases of the ring"),
                ring_gauge(|r| r.shards),
            )?;
            encode_gauges(
                &mut encoder,
                &format!("controller_sharding_{prefix}_status_available_shards"),
                &format!("status.availableShards of the {kind}"),
                ring_gauge(|r| r.available_shards),
            )?;
        }

        let shards = self.0.shards();
        encode_gauges(
            &mut encoder,
            "controller_sharding_shard_info",
            "Information about a shard of a ring",
            shards.iter().map(|s| {
                let labels = ShardInfoLabels {
                    namespace: s.namespace.clone(),
                    shard: s.shard.clone(),
                    ring: RingLabel(s.ring.clone()),
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
                        ring: RingLabel(s.ring.clone()),
                        state: (*state).to_string(),
                    };
                    (labels, i64::from(*state == s.state))
                })
            }),
        )?;
        encode_gauges(
            &mut encoder,
            "controller_sharding_shard_excluded",
            "Shard Leases kept out of their ring although held: 1 per Lease, with the reason (InvalidShardName, DuplicateShardName, AmbiguousRingKind)",
            shards.iter().filter_map(|s| {
                let labels = ShardExcludedLabels {
                    namespace: s.namespace.clone(),
                    shard: s.shard.clone(),
                    ring: RingLabel(s.ring.clone()),
                    reason: s.excluded?.to_string(),
                };
                Some((labels, 1))
            }),
        )?;
        encode_gauges(
            &mut encoder,
            "controller_sharding_shard_weight",
            "Weight of a shard in its ring (tokens are 100 times the weight)",
            shards.iter().map(|s| {
                let labels = ShardWeightLabels {
                    namespace: s.namespace.clone(),
                    shard: s.shard.clone(),
                    ring: RingLabel(s.ring.clone()),
                };
                (labels, i64::from(s.weight))
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
            .rings()
            .iter()
            .map(|r| {
                let status = r.status().cloned().unwrap_or_default();
                RingSnapshot {
                    ring: r.ring_ref(),
                    uid: r.meta().uid.clone().unwrap_or_default(),
                    generation: r.meta().generation.unwrap_or_default(),
                    observed_generation: status.observed_generation.unwrap_or_default(),
                    shards: status.shards.into(),
                    available_shards: status.available_shards.into(),
                }
            })
            .collect()
    }

    fn shards(&self) -> Vec<ShardSnapshot> {
        let now = Timestamp::now();
        let mut snapshots = Vec::new();
        for kind in RingKind::ALL {
            let leases = self.0.leases(kind);
            let rings: BTreeSet<&String> = leases
                .iter()
                .filter_map(|l| l.labels().get(kind.lease_label()))
                .collect();
            for ring in rings {
                let members = ring_members(kind, ring, leases.iter().map(AsRef::as_ref));
                snapshots.extend(members.into_iter().map(|m| ShardSnapshot {
                    namespace: m.lease.namespace().unwrap_or_default(),
                    shard: m.lease.name_any(),
                    ring: RingRef::new(kind, ring.clone()),
                    uid: m.lease.uid().unwrap_or_default(),
                    state: ShardLease::from_lease(m.lease).state(now).as_str(),
                    excluded: m.exclusion.as_ref().map(Exclusion::reason),
                    weight: m.weight,
                }));
            }
        }
        snapshots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fixed;

    impl StateSource for Fixed {
        fn rings(&self) -> Vec<RingSnapshot> {
            vec![
                RingSnapshot {
                    ring: RingRef::new(RingKind::ClusterRing, "example"),
                    uid: "u1".into(),
                    generation: 3,
                    observed_generation: 2,
                    shards: 3,
                    available_shards: 2,
                },
                RingSnapshot {
                    ring: RingRef::new(RingKind::ControllerRing, "example"),
                    uid: "u2".into(),
                    generation: 5,
                    observed_generation: 5,
                    shards: 1,
                    available_shards: 1,
                },
            ]
        }

        fn shards(&self) -> Vec<ShardSnapshot> {
            vec![
                ShardSnapshot {
                    namespace: "default".into(),
                    shard: "shard-a".into(),
                    ring: RingRef::new(RingKind::ClusterRing, "example"),
                    uid: "l1".into(),
                    state: "expired",
                    excluded: None,
                    weight: 1,
                },
                ShardSnapshot {
                    namespace: "default".into(),
                    shard: "shard-c".into(),
                    ring: RingRef::new(RingKind::ControllerRing, "example"),
                    uid: "l3".into(),
                    state: "ready",
                    excluded: None,
                    weight: 3,
                },
                ShardSnapshot {
                    namespace: "default".into(),
                    shard: "x".repeat(64),
                    ring: RingRef::new(RingKind::ClusterRing, "example"),
                    uid: "l2".into(),
                    state: "ready",
                    excluded: Some("InvalidShardName"),
                    weight: 1,
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
        let cluster = RingRef::new(RingKind::ClusterRing, "example");
        let controller = RingRef::new(RingKind::ControllerRing, "example");
        metrics
            .assignments
            .get_or_create(&Metrics::resource_labels(&cluster, "", "secrets"))
            .inc();
        metrics
            .assignments
            .get_or_create(&Metrics::resource_labels(&controller, "", "secrets"))
            .inc_by(4);
        metrics
            .ring_calculations
            .get_or_create(&RingLabel(cluster))
            .inc_by(2);
        let text = render(&registry).expect("renders");
        for line in [
            r#"controller_sharding_assignments_total{clusterring="example",group="",resource="secrets"} 1"#,
            r#"controller_sharding_assignments_total{controllerring="example",group="",resource="secrets"} 4"#,
            r#"controller_sharding_controllerring_metadata_generation{controllerring="example",uid="u2"} 5"#,
            r#"controller_sharding_controllerring_status_available_shards{controllerring="example",uid="u2"} 1"#,
            r#"controller_sharding_shard_state{namespace="default",shard="shard-c",controllerring="example",state="ready"} 1"#,
            r#"controller_sharding_shard_weight{namespace="default",shard="shard-c",controllerring="example"} 3"#,
            r#"controller_sharding_shard_weight{namespace="default",shard="shard-a",clusterring="example"} 1"#,
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
