//! A ring's load, summed from the reports of its available shards (docs/protocol.md §23).
//!
//! Pure functions over [`ShardSnapshot`]s, so the metrics endpoint, `kubectl sharding status`
//! and the external metrics API compute the same figures from the same reports.

use kube_sharding_api::RingRef;
use kube_sharding_api::lease::ShardState;
use kube_sharding_api::load::{LoadKey, ShardLoad};

use super::ShardSnapshot;

/// What the available shards of one ring report together.
///
/// Sums and maxima cover the shards with a valid report only; a shard that leaves a signal out
/// adds nothing to it. Every value stays far below `u64::MAX`: each report's values are at most
/// [`kube_sharding_api::load::MAX_LOAD_VALUE`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RingLoad {
    /// Available shards with a valid report.
    pub(crate) reporting_shards: u64,
    /// Available shards of the ring, reporting or not.
    pub(crate) available_shards: u64,
    /// Objects the reporting shards hold.
    pub(crate) objects: u64,
    /// Objects waiting for a reconcile on the reporting shards.
    pub(crate) queue_depth: u64,
    /// The highest p99 reconcile duration reported, in milliseconds; `None` when no shard reports
    /// one.
    pub(crate) max_p99_ms: Option<u64>,
    /// Failed reconciles the reporting shards counted in their windows.
    pub(crate) errors: u64,
}

/// Whether `shard` counts toward its ring's signals: available (§4) and not kept out.
pub(crate) fn is_available(shard: &ShardSnapshot) -> bool {
    shard.excluded.is_none()
        && shard
            .state
            .parse::<ShardState>()
            .is_ok_and(ShardState::is_available)
}

/// The load report of `shard` when it counts toward its ring's signals.
pub(crate) fn counted_load(shard: &ShardSnapshot) -> Option<&ShardLoad> {
    is_available(shard).then_some(shard.load.as_ref()).flatten()
}

/// The load of ring `ring`, summed from the reports of its available shards among `shards`.
pub(crate) fn ring_load(shards: &[ShardSnapshot], ring: &RingRef) -> RingLoad {
    sum_loads(
        shards
            .iter()
            .filter(|s| &s.ring == ring)
            .map(|s| (is_available(s), s.load.as_ref())),
    )
}

/// The load of one ring's shards, given per shard whether it is available and its valid report.
pub(crate) fn sum_loads<'a>(
    shards: impl IntoIterator<Item = (bool, Option<&'a ShardLoad>)>,
) -> RingLoad {
    let mut load = RingLoad::default();
    for (available, report) in shards {
        if !available {
            continue;
        }
        load.available_shards += 1;
        let Some(report) = report else {
            continue;
        };
        load.reporting_shards += 1;
        let value = |key| report.get(key).unwrap_or_default();
        load.objects += value(LoadKey::Objects);
        load.queue_depth += value(LoadKey::Queue);
        load.errors += value(LoadKey::Errors);
        if let Some(p99) = report.get(LoadKey::P99Millis) {
            load.max_p99_ms = Some(load.max_p99_ms.map_or(p99, |max| max.max(p99)));
        }
    }
    load
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_sharding_api::RingKind;

    fn shard(name: &str, ring: &RingRef, state: &'static str, load: Option<&str>) -> ShardSnapshot {
        ShardSnapshot {
            namespace: "default".into(),
            shard: name.into(),
            ring: ring.clone(),
            uid: format!("uid-{name}"),
            state,
            excluded: None,
            weight: 1,
            clock_skew_seconds: None,
            load: load.map(|l| l.parse().unwrap()),
            load_invalid: false,
        }
    }

    #[test]
    fn a_ring_sums_the_reports_of_its_available_shards_only() {
        let ring = RingRef::new(RingKind::ControllerRing, "r");
        let other_kind = RingRef::new(RingKind::ClusterRing, "r");
        let mut excluded = shard("x", &ring, "ready", Some("objects=1000,queue=1000"));
        excluded.excluded = Some("DuplicateShardName");
        let shards = [
            shard(
                "a",
                &ring,
                "ready",
                Some("objects=10,queue=2,p50ms=3,p99ms=40,errors=1,window=60"),
            ),
            shard("b", &ring, "expired", Some("objects=5,p99ms=90")),
            shard("c", &ring, "uncertain", Some("queue=4")),
            // Available without a report.
            shard("d", &ring, "ready", None),
            // Not available: their reports do not count.
            shard(
                "e",
                &ring,
                "dead",
                Some("objects=100,queue=100,p99ms=999,errors=9"),
            ),
            shard("f", &ring, "orphaned", Some("objects=100")),
            shard("g", &ring, "unknown", Some("objects=100")),
            excluded,
            // Same name, other kind: another ring.
            shard("h", &other_kind, "ready", Some("objects=7,p99ms=5000")),
        ];
        assert_eq!(
            ring_load(&shards, &ring),
            RingLoad {
                reporting_shards: 3,
                available_shards: 4,
                objects: 15,
                queue_depth: 6,
                max_p99_ms: Some(90),
                errors: 1,
            }
        );
        assert_eq!(
            ring_load(&shards, &other_kind),
            RingLoad {
                reporting_shards: 1,
                available_shards: 1,
                objects: 7,
                queue_depth: 0,
                max_p99_ms: Some(5000),
                errors: 0,
            }
        );
    }

    #[test]
    fn a_ring_without_reports_has_no_latency_and_zero_sums() {
        let ring = RingRef::new(RingKind::ClusterRing, "r");
        assert_eq!(ring_load(&[], &ring), RingLoad::default());
        let shards = [
            shard("a", &ring, "ready", None),
            shard("b", &ring, "ready", Some("objects=3")),
        ];
        let load = ring_load(&shards, &ring);
        assert_eq!(load.max_p99_ms, None);
        assert_eq!(
            (load.reporting_shards, load.available_shards, load.objects),
            (1, 2, 3)
        );
    }

    #[test]
    fn the_largest_reports_of_many_shards_sum_without_overflow() {
        let ring = RingRef::new(RingKind::ClusterRing, "r");
        let max = kube_sharding_api::load::MAX_LOAD_VALUE;
        let full = format!("objects={max},queue={max},p99ms={max},errors={max}");
        let shards: Vec<_> = (0..10_000)
            .map(|i| shard(&format!("s{i}"), &ring, "ready", Some(&full)))
            .collect();
        let load = ring_load(&shards, &ring);
        assert_eq!(load.objects, max * 10_000);
        assert_eq!(load.max_p99_ms, Some(max));
    }
}
