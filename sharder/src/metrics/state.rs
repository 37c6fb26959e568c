//! The state metrics: computed from a [`StateSource`] on every scrape.

use std::collections::BTreeMap;
use std::sync::Arc;

use std::sync::atomic::AtomicU64;

use kube_sharding_api::load::{LoadKey, ShardLoad};
use kube_sharding_api::{RingKind, RingRef};
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::load::{RingLoad, counted_load, ring_load};
use super::{ResourceLabels, RingLabel};
use crate::leader::observed::{PendingDrains, RingObjects};

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
    /// 1 when the `Ready` condition is `True`, else 0.
    pub(crate) ready: i64,
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
    /// How far the shard's clock was off the sharder's at its last renewal seen as it happened,
    /// in seconds (its `renewTime` minus when the sharder saw it); `None` before the first.
    pub(crate) clock_skew_seconds: Option<f64>,
    /// The load the shard reports on its Lease, when it reports a valid one.
    pub(crate) load: Option<ShardLoad>,
    /// Whether the Lease carries a load annotation that is no valid report (counted as none).
    pub(crate) load_invalid: bool,
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
    /// What the leader observed about the rings' objects.
    fn objects(&self) -> ObjectsSnapshot;
}

/// What the state metrics report about the rings' objects (leader only).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ObjectsSnapshot {
    /// Counts of each ring's latest complete sync.
    pub(crate) rings: Vec<(RingRef, RingObjects)>,
    /// Drains not acknowledged yet, by ring and shard.
    pub(crate) pending_drains: BTreeMap<(RingRef, String), PendingDrains>,
    /// Rings whose webhook the API server does not reach.
    pub(crate) unreachable: Vec<RingRef>,
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
struct ShardObjectLabels {
    #[prometheus(flatten)]
    ring: RingLabel,
    shard: String,
    group: String,
    resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PinLabels {
    #[prometheus(flatten)]
    ring: RingLabel,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RingShardLabels {
    #[prometheus(flatten)]
    ring: RingLabel,
    shard: String,
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

fn encode_float_gauges<L>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: impl IntoIterator<Item = (L, f64)>,
) -> Result<(), std::fmt::Error>
where
    L: EncodeLabelSet + Clone + std::hash::Hash + Eq + std::fmt::Debug + Send + Sync + 'static,
{
    let family = Family::<L, Gauge<f64, AtomicU64>>::default();
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
            encode_gauges(
                &mut encoder,
                &format!("controller_sharding_{prefix}_ready"),
                &format!("1 when the {kind}'s Ready condition is True, else 0"),
                ring_gauge(|r| r.ready),
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
        )?;
        encode_float_gauges(
            &mut encoder,
            "controller_sharding_shard_clock_skew_seconds",
            "How far a shard's clock was off this replica's at its last renewal: the renewTime it wrote minus when this replica saw the write (negative: behind)",
            shards.iter().filter_map(|s| {
                let labels = ShardWeightLabels {
                    namespace: s.namespace.clone(),
                    shard: s.shard.clone(),
                    ring: RingLabel(s.ring.clone()),
                };
                Some((labels, s.clock_skew_seconds?))
            }),
        )?;

        encode_load(&mut encoder, &rings, &shards)?;

        let objects = self.0.objects();
        encode_gauges(
            &mut encoder,
            "controller_sharding_shard_objects",
            "Objects carrying a shard's label, per resource, as of the ring's latest sync (leader only)",
            objects.rings.iter().flat_map(|(ring, o)| {
                o.per_shard.iter().map(move |((shard, gr), count)| {
                    let labels = ShardObjectLabels {
                        ring: RingLabel(ring.clone()),
                        shard: shard.clone(),
                        group: gr.group.clone(),
                        resource: gr.resource.clone(),
                    };
                    (labels, i64::try_from(*count).unwrap_or(i64::MAX))
                })
            }),
        )?;
        encode_gauges(
            &mut encoder,
            "controller_sharding_unassigned_objects",
            "Objects of a ring that carry no shard label although the ring assigns them, as of its latest sync (leader only)",
            objects.rings.iter().flat_map(|(ring, o)| {
                o.unassigned.iter().map(move |(gr, count)| {
                    let labels = ResourceLabels {
                        ring: RingLabel(ring.clone()),
                        group: gr.group.clone(),
                        resource: gr.resource.clone(),
                    };
                    (labels, i64::try_from(*count).unwrap_or(i64::MAX))
                })
            }),
        )?;
        encode_gauges(
            &mut encoder,
            "controller_sharding_pinned_objects",
            "Objects a pin applies to (their own, their controller's or their namespace's), by what it did: honoured, unavailable (the shard is not available; the ring placed them) or invalid (the value names no shard), as of the ring's latest sync (leader only)",
            objects.rings.iter().flat_map(|(ring, o)| {
                o.pins.iter().map(move |(state, count)| {
                    let labels = PinLabels {
                        ring: RingLabel(ring.clone()),
                        state: (*state).to_string(),
                    };
                    (labels, i64::try_from(*count).unwrap_or(i64::MAX))
                })
            }),
        )?;
        encode_gauges(
            &mut encoder,
            "controller_sharding_drains_pending",
            "Objects carrying the drain label, waiting for their shard to acknowledge (leader only)",
            objects.pending_drains.iter().map(|((ring, shard), p)| {
                let labels = RingShardLabels {
                    ring: RingLabel(ring.clone()),
                    shard: shard.clone(),
                };
                (labels, i64::try_from(p.objects).unwrap_or(i64::MAX))
            }),
        )?;
        encode_gauges(
            &mut encoder,
            "controller_sharding_webhook_unreachable",
            "1 for a ring whose webhook the API server does not reach, as moves show it: its moves stop until a probe lands (leader only)",
            objects
                .unreachable
                .iter()
                .map(|ring| (RingLabel(ring.clone()), 1)),
        )?;
        encode_float_gauges(
            &mut encoder,
            "controller_sharding_drain_oldest_age_seconds",
            "How long the oldest drain of a shard has waited for its acknowledgement (leader only)",
            objects.pending_drains.iter().map(|((ring, shard), p)| {
                let labels = RingShardLabels {
                    ring: RingLabel(ring.clone()),
                    shard: shard.clone(),
                };
                (labels, p.oldest.as_secs_f64())
            }),
        )
    }
}

/// The load reports (docs/protocol.md §23): per available shard with a valid report, and per ring
/// summed by [`ring_load`].
fn encode_load(
    encoder: &mut DescriptorEncoder,
    rings: &[RingSnapshot],
    shards: &[ShardSnapshot],
) -> Result<(), std::fmt::Error> {
    let shard_labels = |s: &ShardSnapshot| ShardWeightLabels {
        namespace: s.namespace.clone(),
        shard: s.shard.clone(),
        ring: RingLabel(s.ring.clone()),
    };
    let shard_value = |key: LoadKey| {
        shards.iter().filter_map(move |s| {
            let value = counted_load(s)?.get(key)?;
            Some((shard_labels(s), saturating_i64(value)))
        })
    };
    let shard_seconds = |key: LoadKey| {
        shards.iter().filter_map(move |s| {
            let millis = counted_load(s)?.get(key)?;
            Some((shard_labels(s), seconds(millis)))
        })
    };
    encode_gauges(
        encoder,
        "controller_sharding_shard_reported_objects",
        "Objects an available shard reports holding on its Lease",
        shard_value(LoadKey::Objects),
    )?;
    encode_gauges(
        encoder,
        "controller_sharding_shard_reported_queue_depth",
        "Objects an available shard reports waiting for a reconcile (changed since their last one)",
        shard_value(LoadKey::Queue),
    )?;
    encode_float_gauges(
        encoder,
        "controller_sharding_shard_reported_reconcile_p50_seconds",
        "Median reconcile duration an available shard reports over its window",
        shard_seconds(LoadKey::P50Millis),
    )?;
    encode_float_gauges(
        encoder,
        "controller_sharding_shard_reported_reconcile_p99_seconds",
        "99th percentile reconcile duration an available shard reports over its window",
        shard_seconds(LoadKey::P99Millis),
    )?;
    encode_gauges(
        encoder,
        "controller_sharding_shard_reported_reconcile_errors",
        "Failed reconciles an available shard reports over its window",
        shard_value(LoadKey::Errors),
    )?;
    encode_gauges(
        encoder,
        "controller_sharding_shard_load_report_invalid",
        "1 for a shard Lease whose load annotation is no valid report (it counts as none)",
        shards
            .iter()
            .filter(|s| s.load_invalid)
            .map(|s| (shard_labels(s), 1)),
    )?;

    let loads: Vec<_> = rings
        .iter()
        .map(|r| (RingLabel(r.ring.clone()), ring_load(shards, &r.ring)))
        .collect();
    // Sums only for rings with a report: a ring nobody reports for has no load, not zero.
    let ring_value = |f: fn(&RingLoad) -> u64| {
        loads
            .iter()
            .filter(|(_, l)| l.reporting_shards > 0)
            .map(move |(ring, l)| (ring.clone(), saturating_i64(f(l))))
    };
    encode_gauges(
        encoder,
        "controller_sharding_ring_reporting_shards",
        "Available shards of a ring with a valid load report",
        loads
            .iter()
            .map(|(ring, l)| (ring.clone(), saturating_i64(l.reporting_shards))),
    )?;
    encode_gauges(
        encoder,
        "controller_sharding_ring_reported_objects",
        "Objects the available shards of a ring report holding, summed",
        ring_value(|l| l.objects),
    )?;
    encode_gauges(
        encoder,
        "controller_sharding_ring_reported_queue_depth",
        "Objects waiting for a reconcile on the available shards of a ring, summed from their reports",
        ring_value(|l| l.queue_depth),
    )?;
    encode_gauges(
        encoder,
        "controller_sharding_ring_reported_reconcile_errors",
        "Failed reconciles the available shards of a ring report over their windows, summed",
        ring_value(|l| l.errors),
    )?;
    encode_float_gauges(
        encoder,
        "controller_sharding_ring_reported_reconcile_p99_max_seconds",
        "The highest 99th percentile reconcile duration the available shards of a ring report",
        loads
            .iter()
            .filter_map(|(ring, l)| Some((ring.clone(), seconds(l.max_p99_ms?)))),
    )
}

/// Milliseconds as seconds; reports hold at most 10^12, which an `f64` holds exactly.
fn seconds(millis: u64) -> f64 {
    millis as f64 / 1000.0
}

fn saturating_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Metrics, OutcomeLabels, RingLabel, render};
    use prometheus_client::registry::Registry;

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
                    ready: 0,
                },
                RingSnapshot {
                    ring: RingRef::new(RingKind::ControllerRing, "example"),
                    uid: "u2".into(),
                    generation: 5,
                    observed_generation: 5,
                    shards: 1,
                    available_shards: 1,
                    ready: 1,
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
                    clock_skew_seconds: Some(-40.5),
                    load: None,
                    load_invalid: true,
                },
                ShardSnapshot {
                    namespace: "default".into(),
                    shard: "shard-c".into(),
                    ring: RingRef::new(RingKind::ControllerRing, "example"),
                    uid: "l3".into(),
                    state: "ready",
                    excluded: None,
                    weight: 3,
                    clock_skew_seconds: None,
                    load: Some(
                        "objects=12,queue=3,p50ms=5,p99ms=1250,errors=2,window=60"
                            .parse()
                            .expect("valid"),
                    ),
                    load_invalid: false,
                },
                ShardSnapshot {
                    namespace: "default".into(),
                    shard: "x".repeat(64),
                    ring: RingRef::new(RingKind::ClusterRing, "example"),
                    uid: "l2".into(),
                    state: "ready",
                    excluded: Some("InvalidShardName"),
                    weight: 1,
                    clock_skew_seconds: Some(0.25),
                    // Kept out of the ring: its report does not count.
                    load: Some("objects=99".parse().expect("valid")),
                    load_invalid: false,
                },
            ]
        }

        fn objects(&self) -> ObjectsSnapshot {
            let ring = RingRef::new(RingKind::ControllerRing, "example");
            let secrets = kube_sharding_api::GroupResource::new("", "secrets");
            ObjectsSnapshot {
                rings: vec![(
                    ring.clone(),
                    RingObjects {
                        per_shard: BTreeMap::from([(("shard-c".to_string(), secrets.clone()), 7)]),
                        unassigned: BTreeMap::from([(secrets, 2)]),
                        pins: BTreeMap::from([("honoured", 4), ("unavailable", 1)]),
                    },
                )],
                pending_drains: BTreeMap::from([(
                    (ring.clone(), "shard-c".to_string()),
                    PendingDrains {
                        objects: 3,
                        oldest: std::time::Duration::from_millis(1500),
                    },
                )]),
                unreachable: vec![ring],
            }
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
        metrics
            .webhook_duration
            .get_or_create(&OutcomeLabels::new(&controller, "assigned"))
            .observe(0.0002);
        metrics
            .syncs
            .get_or_create(&OutcomeLabels::new(&controller, "failure"))
            .inc();
        metrics
            .list_inconsistent_continuations
            .get_or_create(&Metrics::resource_labels(&controller, "", "secrets"))
            .inc_by(2);
        metrics.patches_in_flight.set(3);
        let text = render(&registry).expect("renders");
        for line in [
            r#"controller_sharding_list_inconsistent_continuations_total{controllerring="example",group="",resource="secrets"} 2"#,
            "controller_sharding_patches_in_flight 3",
            r#"controller_sharding_assignments_total{clusterring="example",group="",resource="secrets"} 1"#,
            r#"controller_sharding_assignments_total{controllerring="example",group="",resource="secrets"} 4"#,
            r#"controller_sharding_controllerring_metadata_generation{controllerring="example",uid="u2"} 5"#,
            r#"controller_sharding_controllerring_status_available_shards{controllerring="example",uid="u2"} 1"#,
            r#"controller_sharding_controllerring_ready{controllerring="example",uid="u2"} 1"#,
            r#"controller_sharding_clusterring_ready{clusterring="example",uid="u1"} 0"#,
            r#"controller_sharding_shard_state{namespace="default",shard="shard-c",controllerring="example",state="ready"} 1"#,
            r#"controller_sharding_shard_weight{namespace="default",shard="shard-c",controllerring="example"} 3"#,
            r#"controller_sharding_shard_weight{namespace="default",shard="shard-a",clusterring="example"} 1"#,
            r#"controller_sharding_shard_clock_skew_seconds{namespace="default",shard="shard-a",clusterring="example"} -40.5"#,
            r#"controller_sharding_shard_objects{controllerring="example",shard="shard-c",group="",resource="secrets"} 7"#,
            r#"controller_sharding_unassigned_objects{controllerring="example",group="",resource="secrets"} 2"#,
            r#"controller_sharding_drains_pending{controllerring="example",shard="shard-c"} 3"#,
            r#"controller_sharding_pinned_objects{controllerring="example",state="honoured"} 4"#,
            r#"controller_sharding_pinned_objects{controllerring="example",state="unavailable"} 1"#,
            r#"controller_sharding_webhook_unreachable{controllerring="example"} 1"#,
            r#"controller_sharding_drain_oldest_age_seconds{controllerring="example",shard="shard-c"} 1.5"#,
            r#"controller_sharding_webhook_request_duration_seconds_count{controllerring="example",outcome="assigned"} 1"#,
            r#"controller_sharding_webhook_request_duration_seconds_bucket{le="0.00025",controllerring="example",outcome="assigned"} 1"#,
            r#"controller_sharding_syncs_total{controllerring="example",outcome="failure"} 1"#,
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
            r#"controller_sharding_shard_reported_objects{namespace="default",shard="shard-c",controllerring="example"} 12"#,
            r#"controller_sharding_shard_reported_queue_depth{namespace="default",shard="shard-c",controllerring="example"} 3"#,
            r#"controller_sharding_shard_reported_reconcile_p50_seconds{namespace="default",shard="shard-c",controllerring="example"} 0.005"#,
            r#"controller_sharding_shard_reported_reconcile_p99_seconds{namespace="default",shard="shard-c",controllerring="example"} 1.25"#,
            r#"controller_sharding_shard_reported_reconcile_errors{namespace="default",shard="shard-c",controllerring="example"} 2"#,
            r#"controller_sharding_shard_load_report_invalid{namespace="default",shard="shard-a",clusterring="example"} 1"#,
            r#"controller_sharding_ring_reporting_shards{controllerring="example"} 1"#,
            r#"controller_sharding_ring_reporting_shards{clusterring="example"} 0"#,
            r#"controller_sharding_ring_reported_objects{controllerring="example"} 12"#,
            r#"controller_sharding_ring_reported_queue_depth{controllerring="example"} 3"#,
            r#"controller_sharding_ring_reported_reconcile_errors{controllerring="example"} 2"#,
            r#"controller_sharding_ring_reported_reconcile_p99_max_seconds{controllerring="example"} 1.25"#,
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
        }
        // No sums for a ring nobody reports for, and no report of a Lease kept out.
        assert!(
            !text.contains(r#"controller_sharding_ring_reported_objects{clusterring="example"}"#),
            "{text}"
        );
        assert!(
            !text.contains(&format!(
                r#"reported_objects{{namespace="default",shard="{}""#,
                "x".repeat(64)
            )),
            "{text}"
        );
    }
}
