//! Rings with `assignment: ServerSide` (docs/zero-write-rings.md): their objects carry no shard
//! label, so `status`, `explain` and `simulate` read placement from the hash ranges the sharder
//! publishes on each shard's Lease, and compute the ring's target as the sharder does
//! ([`RangeRing`] over the available shards and their weights, namespace pins cut out of it for a
//! ring hashing namespaces).
//!
//! A shard holds the ranges of its latest publication while its Lease is held by it; a handover
//! is pending while a held shard has not acknowledged its publication, or holds other ranges than
//! the target gives it.

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;
use kube::api::ObjectMeta;
use kube_sharding_api::lease::ShardLease;
use kube_sharding_api::range_lease::{
    ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES, Acknowledgement, PublishedRanges,
};
use kube_sharding_api::ranges::{RangeRing, RangeSet, ShardField, fnv1a64};
use kube_sharding_api::{Assignment, HashKey};
use serde::Serialize;

use super::cluster::LoadedRing;
use crate::core::pin::is_valid_pin;

/// Whether the sharder places `ring`'s objects by published ranges.
pub(crate) fn is_server_side(ring: &LoadedRing) -> bool {
    ring.view.assignment == Assignment::ServerSide
}

/// A namespace carrying the ring's pin annotation, on a ring hashing namespaces.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct NamespacePin {
    /// The pinned namespace.
    pub(crate) namespace: String,
    /// The annotation's value: the shard it names.
    pub(crate) shard: String,
    /// The namespace's hash, `0x` and 16 hex digits: the one hash the pin moves.
    pub(crate) hash: String,
    /// `honoured` (the shard is available: its target holds the hash), `unavailable` or
    /// `invalid` (the hash ring decides).
    pub(crate) state: &'static str,
}

/// What the placement of a ServerSide ring depends on: who holds which ranges now, and the
/// target the sharder moves towards.
#[derive(Debug)]
pub(crate) struct RingRanges {
    /// The hashed field.
    pub(crate) field: ShardField,
    /// The target ranges of each available shard, pins applied.
    pub(crate) target: BTreeMap<String, RangeSet>,
    /// The latest publication of each Lease held by its shard, by shard name.
    pub(crate) held: Vec<(String, PublishedRanges, Option<u64>)>,
    /// The namespace pins of a ring hashing namespaces, by namespace.
    pub(crate) pins: Vec<NamespacePin>,
    /// Namespaces pinning objects of a ring hashing uids: ignored.
    pub(crate) ignored_pins: Vec<String>,
}

/// The hash of `hash` as the tables print it.
pub(crate) fn hash_text(hash: u64) -> String {
    format!("0x{hash:016x}")
}

impl RingRanges {
    /// The ranges of `ring`; `namespace_pins` maps each namespace to its annotations that carry a
    /// pin (of any ring).
    pub(crate) fn new(
        ring: &LoadedRing,
        namespace_pins: &BTreeMap<String, BTreeMap<String, String>>,
    ) -> Self {
        let view = &ring.view;
        let field = ShardField::from(view.hash_key);
        let pinned: Vec<(&String, &String)> = namespace_pins
            .iter()
            .filter_map(|(ns, pins)| Some((ns, pins.get(&view.pin_annotation)?)))
            .collect();
        let (pins, ignored_pins) = if view.hash_key == HashKey::Namespace {
            let pins = pinned
                .iter()
                .map(|(ns, shard)| NamespacePin {
                    namespace: (*ns).clone(),
                    shard: (*shard).clone(),
                    hash: hash_text(fnv1a64(ns)),
                    state: if !is_valid_pin(shard) {
                        "invalid"
                    } else if view.hash_ring.contains(shard) {
                        "honoured"
                    } else {
                        "unavailable"
                    },
                })
                .collect();
            (pins, Vec::new())
        } else {
            (
                Vec::new(),
                pinned.iter().map(|(ns, _)| (*ns).clone()).collect(),
            )
        };
        let target = target_ranges(view.hash_ring.members(), &pins);
        let held = ring
            .leases
            .iter()
            .filter(|lease| ShardLease::from_lease(lease).is_held_by_shard())
            .filter_map(|lease| {
                let published = published(lease)?.ok()?;
                Some((lease.name_any(), published, acknowledged(lease)))
            })
            .collect();
        Self {
            field,
            target,
            held,
            pins,
            ignored_pins,
        }
    }

    /// The shard whose latest publication holds `hash`, its generation and acknowledgement.
    pub(crate) fn holder(&self, hash: u64) -> Option<(&str, u64, Option<u64>)> {
        self.held
            .iter()
            .find(|(_, published, _)| published.ranges().contains(hash))
            .map(|(name, published, acked)| (name.as_str(), published.generation(), *acked))
    }

    /// The shard the target gives `hash`.
    pub(crate) fn wanted(&self, hash: u64) -> Option<&str> {
        self.target
            .iter()
            .find(|(_, set)| set.contains(hash))
            .map(|(name, _)| name.as_str())
    }
}

/// The target of shards `members` (name, weight) with the honoured pins of `pins` cut out.
pub(crate) fn target_ranges<'a>(
    members: impl IntoIterator<Item = (&'a str, u32)>,
    pins: &[NamespacePin],
) -> BTreeMap<String, RangeSet> {
    RangeRing::weighted(members).ranges_with_pins(
        pins.iter()
            .filter(|p| is_valid_pin(&p.shard))
            .map(|p| (p.namespace.as_str(), p.shard.as_str())),
    )
}

/// The value the ring hashes for the object `meta` and its hash; `None` for a uid ring's object
/// without a uid.
pub(crate) fn object_hash(field: ShardField, meta: &ObjectMeta) -> Option<(String, u64)> {
    let value = match field {
        ShardField::Uid => meta.uid.clone()?,
        ShardField::Namespace => meta.namespace.clone().unwrap_or_default(),
    };
    let hash = fnv1a64(&value);
    Some((value, hash))
}

/// The publication on `lease`: `None` without one, an error for an unreadable one.
fn published(lease: &Lease) -> Option<Result<PublishedRanges, String>> {
    lease
        .annotations()
        .get(ANNOTATION_RANGES)
        .map(|value| value.parse::<PublishedRanges>().map_err(|e| e.to_string()))
}

/// The generation `lease` acknowledges, if readable.
fn acknowledged(lease: &Lease) -> Option<u64> {
    lease
        .annotations()
        .get(ANNOTATION_ACKNOWLEDGED)
        .and_then(|value| value.parse::<Acknowledgement>().ok())
        .map(|a| a.generation)
}

/// A percentage of the hash space with two decimals, for JSON.
pub(crate) fn percent(set: &RangeSet) -> f64 {
    (set.share() * 10_000.0).round() / 100.0
}

/// One shard's ranges, for `status`.
#[derive(Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct MemberRanges {
    /// The generation of its latest publication.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) generation: Option<u64>,
    /// How many ranges it was published.
    pub(crate) ranges: usize,
    /// Their share of the hash space, in percent.
    pub(crate) share_percent: f64,
    /// The generation it acknowledged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) acknowledged: Option<u64>,
    /// How many ranges the target gives it.
    pub(crate) target_ranges: usize,
    /// Their share of the hash space, in percent.
    pub(crate) target_share_percent: f64,
    /// What is still to happen for this shard, when its handover is not complete.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) pending: Option<String>,
    /// What is wrong with its annotations, if anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<String>,
}

/// The ranges of the shard of `lease`, given its target (`None` when it is not available).
pub(crate) fn member_ranges(lease: &Lease, target: Option<&RangeSet>) -> MemberRanges {
    let empty = RangeSet::empty();
    let target_set = target.unwrap_or(&empty);
    let held = ShardLease::from_lease(lease).is_held_by_shard();
    let acknowledged = acknowledged(lease);
    let mut ranges = MemberRanges {
        acknowledged,
        target_ranges: target_set.ranges().len(),
        target_share_percent: percent(target_set),
        ..MemberRanges::default()
    };
    let publication = match published(lease) {
        Some(Err(error)) => {
            ranges.error = Some(format!("unreadable ranges annotation: {error}"));
            ranges.pending = Some(
                "the sharder counts it as holding everything until it acknowledges a publication"
                    .into(),
            );
            return ranges;
        }
        Some(Ok(publication)) => Some(publication),
        None => None,
    };
    if let Some(publication) = &publication {
        ranges.generation = Some(publication.generation());
        ranges.ranges = publication.ranges().ranges().len();
        ranges.share_percent = percent(publication.ranges());
    }
    ranges.pending = if !held {
        (publication.is_some() || acknowledged.is_some())
            .then(|| "not held by its shard: the sharder removes its ranges".to_string())
    } else {
        match &publication {
            None if !target_set.is_empty() => Some("waiting for its first ranges".into()),
            None => None,
            Some(p) if acknowledged != Some(p.generation()) => Some(format!(
                "waiting for its acknowledgement of generation {}",
                p.generation()
            )),
            Some(p) if p.ranges() == target_set => None,
            Some(p) if target.is_none() => Some(format!(
                "acknowledged {}, not available: the sharder revokes its ranges",
                p.generation()
            )),
            Some(p) => Some(format!(
                "acknowledged {}, not yet at its target: the sharder revokes what others must get, and grants the rest once its holders let go",
                p.generation()
            )),
        }
    };
    ranges
}

#[cfg(test)]
mod tests {
    use kube_sharding_api::RingKind;

    use super::super::fixtures::{lease, server_side, with_ranges};
    use super::*;

    #[test]
    fn pending_says_what_each_shard_waits_for() {
        let half = "0000000000000000-8000000000000000";
        let target =
            RangeSet::new(
                [kube_sharding_api::ranges::HashRange::new(0, 1 << 63).expect("a range")],
            );
        let settled = member_ranges(
            &with_ranges(
                lease("a", "a", 1, None),
                Some(&format!("4 {half}")),
                Some("4"),
            ),
            Some(&target),
        );
        assert_eq!(
            settled,
            MemberRanges {
                generation: Some(4),
                ranges: 1,
                share_percent: 50.0,
                acknowledged: Some(4),
                target_ranges: 1,
                target_share_percent: 50.0,
                pending: None,
                error: None,
            }
        );
        let unacknowledged = member_ranges(
            &with_ranges(
                lease("a", "a", 1, None),
                Some(&format!("5 {half}")),
                Some("4"),
            ),
            Some(&target),
        );
        assert_eq!(
            unacknowledged.pending.as_deref(),
            Some("waiting for its acknowledgement of generation 5")
        );
        let cut_down = member_ranges(
            &with_ranges(lease("a", "a", 1, None), Some("5"), Some("5")),
            Some(&target),
        );
        assert!(
            cut_down
                .pending
                .as_deref()
                .is_some_and(|p| p.starts_with("acknowledged 5, not yet at its target")),
            "{cut_down:?}"
        );
        let newcomer = member_ranges(&lease("a", "a", 1, None), Some(&target));
        assert_eq!(
            newcomer.pending.as_deref(),
            Some("waiting for its first ranges")
        );
        let released = member_ranges(
            &with_ranges(lease("a", "", 1, None), Some(&format!("5 {half}")), None),
            None,
        );
        assert_eq!(
            released.pending.as_deref(),
            Some("not held by its shard: the sharder removes its ranges")
        );
        let garbled = member_ranges(
            &with_ranges(lease("a", "a", 1, None), Some("five"), None),
            Some(&target),
        );
        assert!(garbled.error.is_some() && garbled.pending.is_some());
        assert!(
            member_ranges(&lease("a", "", 1, None), None)
                .pending
                .is_none()
        );
    }

    #[test]
    fn holders_and_targets_come_from_the_leases_and_the_weighted_ring() {
        let ring = server_side(
            vec![
                with_ranges(
                    lease("a", "a", 1, None),
                    Some("3 0000000000000000-8000000000000000"),
                    Some("3"),
                ),
                with_ranges(
                    lease("b", "b", 1, Some("2")),
                    Some("3 8000000000000000-10000000000000000"),
                    Some("2"),
                ),
                // Released: what it says holds nothing.
                with_ranges(
                    lease("c", "", 1, None),
                    Some("3 0000000000000000-10000000000000000"),
                    None,
                ),
            ],
            HashKey::Object,
        );
        let ranges = RingRanges::new(&ring, &BTreeMap::new());
        assert_eq!(ranges.field, ShardField::Uid);
        assert_eq!(ranges.holder(1), Some(("a", 3, Some(3))));
        assert_eq!(ranges.holder(u64::MAX), Some(("b", 3, Some(2))));
        assert_eq!(
            ranges.target,
            RangeRing::weighted([("a", 1), ("b", 2)]).ranges()
        );
        for hash in [0, 1 << 40, 1 << 63, u64::MAX] {
            let owner = RangeRing::weighted([("a", 1), ("b", 2)])
                .owner(hash)
                .map(str::to_string);
            assert_eq!(ranges.wanted(hash).map(str::to_string), owner);
        }
    }

    #[test]
    fn namespace_pins_count_on_namespace_rings_only() {
        let leases = || vec![lease("a", "a", 1, None), lease("b", "b", 1, None)];
        let key = RingKind::ClusterRing.pin_annotation("r");
        let pins: BTreeMap<String, BTreeMap<String, String>> = [
            ("team".to_string(), [(key.clone(), "b".to_string())].into()),
            ("gone".to_string(), [(key.clone(), "z".to_string())].into()),
            ("bad".to_string(), [(key.clone(), "-x-".to_string())].into()),
            (
                "other".to_string(),
                [("pin.alpha.sharding.timebertt.dev/x".to_string(), "a".into())].into(),
            ),
        ]
        .into();
        let by_namespace = RingRanges::new(&server_side(leases(), HashKey::Namespace), &pins);
        let states: Vec<(&str, &str)> = by_namespace
            .pins
            .iter()
            .map(|p| (p.namespace.as_str(), p.state))
            .collect();
        assert_eq!(
            states,
            [
                ("bad", "invalid"),
                ("gone", "unavailable"),
                ("team", "honoured")
            ]
        );
        assert_eq!(by_namespace.wanted(fnv1a64("team")), Some("b"));
        let twin = RangeRing::new(["a", "b"]).ranges_with_pins([("team", "b")]);
        assert_eq!(by_namespace.target, twin);
        let by_uid = RingRanges::new(&server_side(leases(), HashKey::Object), &pins);
        assert!(by_uid.pins.is_empty());
        assert_eq!(by_uid.ignored_pins, ["bad", "gone", "team"]);
        assert_eq!(by_uid.target, RangeRing::new(["a", "b"]).ranges());
    }
}
