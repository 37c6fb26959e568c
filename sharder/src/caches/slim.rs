//! What the caches keep of each object: only what the sharder reads.
//!
//! Every replica caches every Lease that carries a ring label, whoever created it and whatever its
//! ring, because the webhook answers from the caches. Anyone allowed to create Leases could
//! otherwise make each replica hold their annotations and labels (up to 256 KiB per Lease) and
//! exhaust its memory. A watch still decodes each object whole, but only for as long as one event
//! takes; what the cache holds is bounded by the fields kept here.

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;
use kube::runtime::watcher;
use kube_sharding_api::RingKind;
use kube_sharding_api::labels::{
    ANNOTATION_EXCLUDED, ANNOTATION_LEAVES_CONTROLLED_OBJECTS, ANNOTATION_RELEASED_BY,
    ANNOTATION_WEIGHT, LABEL_STATE, is_dns_subdomain, is_valid_label_value,
};
use kube_sharding_api::load::{ANNOTATION_LOAD, MAX_LOAD_ANNOTATION_BYTES};
use kube_sharding_api::range_lease::{
    ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES, MAX_ACKNOWLEDGED_BYTES, MAX_RANGES_ANNOTATION_BYTES,
};

/// Applies `slim` to the object of `event`, if it carries one.
pub(super) fn for_each_object<K>(event: &mut watcher::Event<K>, slim: impl FnOnce(&mut K)) {
    match event {
        watcher::Event::Apply(object)
        | watcher::Event::InitApply(object)
        | watcher::Event::Delete(object) => slim(object),
        watcher::Event::Init | watcher::Event::InitDone => {}
    }
}

/// Drops what nothing reads from any cached object: its managed fields, by far its largest part.
pub(super) fn slim_object<K: kube::Resource>(object: &mut K) {
    object.managed_fields_mut().clear();
}

/// Longest exclusion annotation value kept; every reason the sharder writes is shorter.
const MAX_EXCLUSION_REASON_LEN: usize = 64;

/// Longest shard name: a Lease name, at most a DNS subdomain.
const MAX_SHARD_NAME_LEN: usize = 253;

/// What a longer exclusion annotation value is kept as: no reason, so the sharder rewrites it.
const TOO_LONG: &str = "(too long)";

/// Longest weight or `leaves-controlled-objects` value kept; every valid one ("100", "false") is
/// far shorter.
const MAX_STEERING_VALUE_LEN: usize = 16;

/// What a longer weight or `leaves-controlled-objects` value is kept as: no number and not
/// "true", so it reads as invalid (weight) or unset (leaves-controlled-objects).
const INVALID_VALUE: &str = "(invalid)";

/// The label selector of the Lease watch of `kind`: Leases with a non-empty ring value. A Lease
/// with an empty value belongs to no ring; listing it would let anyone who may create a Lease
/// fill the cache.
pub(super) fn lease_selector(kind: RingKind) -> String {
    let label = kind.lease_label();
    format!("{label},{label}!=")
}

/// Whether `ring` can name a ring: rings are objects, so a DNS subdomain, and the value of a
/// label, so at most 63 characters.
fn is_valid_ring_value(ring: &str) -> bool {
    is_dns_subdomain(ring) && is_valid_label_value(ring)
}

/// Makes a Lease event of the `kind` watch safe to keep, before anything else reads it: a Lease
/// whose ring value names no possible ring is treated as deleted (it is never cached, and leaves
/// the cache if it was there), and a `holderIdentity` longer than any name is replaced by
/// [`TOO_LONG`], which can name no shard. Without that the renewal tracking would copy a value
/// of up to the object size limit for every such Lease.
pub(super) fn prepare_lease(kind: RingKind, event: &mut watcher::Event<Lease>) {
    let (watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) = event else {
        if let watcher::Event::Delete(lease) = event {
            cap_holder(lease);
        }
        return;
    };
    cap_holder(lease);
    let valid = lease
        .labels()
        .get(kind.lease_label())
        .is_some_and(|ring| is_valid_ring_value(ring));
    if !valid {
        let lease = std::mem::take(lease);
        *event = watcher::Event::Delete(lease);
    }
}

/// Replaces a `holderIdentity` longer than a name with [`TOO_LONG`].
fn cap_holder(lease: &mut Lease) {
    if let Some(holder) = lease
        .spec
        .as_mut()
        .and_then(|spec| spec.holder_identity.as_mut())
        .filter(|holder| holder.len() > MAX_SHARD_NAME_LEN)
    {
        *holder = TOO_LONG.to_string();
    }
}

/// Keeps of a shard Lease only what membership, shard states, Events and metrics read: name,
/// namespace, UID, resourceVersion, creation time, the spec, the ring labels of both kinds, the
/// state label, the weight and `leaves-controlled-objects` annotations (a value too long to be
/// valid as [`INVALID_VALUE`]), the shard's load report (unless too long to be one), the shard's release mark (unless too long to name a shard),
/// a zero-write ring's range publication and acknowledgement (unless too long to parse)
/// and the exclusion annotation the sharder writes (whose value, if someone else made it long, is
/// replaced: any value other than a reason is rewritten).
/// Owner references and finalizers go too.
pub(super) fn slim_lease(lease: &mut Lease) {
    slim_object(lease);
    let meta = &mut lease.metadata;
    let kept_labels = |labels: BTreeMap<String, String>| -> BTreeMap<String, String> {
        labels
            .into_iter()
            .filter(|(key, _)| {
                key == LABEL_STATE || RingKind::ALL.iter().any(|kind| key == kind.lease_label())
            })
            .collect()
    };
    meta.labels = meta.labels.take().map(kept_labels);
    meta.annotations = meta.annotations.take().map(|annotations| {
        annotations
            .into_iter()
            .filter(|(key, value)| {
                key == ANNOTATION_WEIGHT
                    || key == ANNOTATION_EXCLUDED
                    || key == ANNOTATION_LEAVES_CONTROLLED_OBJECTS
                    // A longer value is no valid report: dropped, as no report.
                    || (key == ANNOTATION_LOAD && value.len() <= MAX_LOAD_ANNOTATION_BYTES)
                    // Compared with a shard name only: a longer value can never match one.
                    || (key == ANNOTATION_RELEASED_BY && value.len() <= MAX_SHARD_NAME_LEN)
                    // A zero-write ring's handover; longer values cannot parse (dropped, as none).
                    || (key == ANNOTATION_RANGES && value.len() <= MAX_RANGES_ANNOTATION_BYTES)
                    || (key == ANNOTATION_ACKNOWLEDGED && value.len() <= MAX_ACKNOWLEDGED_BYTES)
            })
            .map(|(key, mut value)| {
                if key == ANNOTATION_EXCLUDED && value.len() > MAX_EXCLUSION_REASON_LEN {
                    value = TOO_LONG.to_string();
                }
                if (key == ANNOTATION_WEIGHT || key == ANNOTATION_LEAVES_CONTROLLED_OBJECTS)
                    && value.len() > MAX_STEERING_VALUE_LEN
                {
                    value = INVALID_VALUE.to_string();
                }
                (key, value)
            })
            .collect()
    });
    meta.owner_references = None;
    meta.finalizers = None;
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use kube::api::ObjectMeta;

    use super::*;

    #[test]
    fn a_cached_lease_keeps_only_what_the_sharder_reads() {
        let big = "x".repeat(200 * 1024);
        let ring_label = RingKind::ClusterRing.lease_label().to_string();
        let other_ring_label = RingKind::ControllerRing.lease_label().to_string();
        let mut lease = Lease {
            metadata: ObjectMeta {
                name: Some("shard-a".into()),
                namespace: Some("team".into()),
                uid: Some("u1".into()),
                resource_version: Some("7".into()),
                labels: Some(BTreeMap::from([
                    (ring_label.clone(), "ring".into()),
                    (other_ring_label.clone(), "other".into()),
                    (LABEL_STATE.into(), "ready".into()),
                    ("team.example/owner".into(), "alice".into()),
                ])),
                annotations: Some(BTreeMap::from([
                    (ANNOTATION_WEIGHT.into(), "3".into()),
                    (ANNOTATION_EXCLUDED.into(), big.clone()),
                    ("team.example/blob".into(), big),
                ])),
                finalizers: Some(vec!["team.example/keep".into()]),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some("shard-a".into()),
                lease_duration_seconds: Some(10),
                ..Default::default()
            }),
        };
        let spec = lease.spec.clone();
        slim_lease(&mut lease);

        let labels = lease.labels();
        assert_eq!(labels.len(), 3, "{labels:?}");
        assert_eq!(labels[&ring_label], "ring");
        assert_eq!(labels[&other_ring_label], "other");
        assert_eq!(labels[LABEL_STATE], "ready");
        let annotations = lease.annotations();
        assert_eq!(annotations.len(), 2, "{:?}", annotations.keys());
        assert_eq!(annotations[ANNOTATION_WEIGHT], "3");
        assert_eq!(annotations[ANNOTATION_EXCLUDED], TOO_LONG);
        assert_eq!(lease.finalizers(), &[] as &[String]);
        assert_eq!(lease.spec, spec);
        assert_eq!(lease.metadata.name.as_deref(), Some("shard-a"));
        assert_eq!(lease.metadata.namespace.as_deref(), Some("team"));
        assert_eq!(lease.metadata.uid.as_deref(), Some("u1"));
        assert_eq!(lease.metadata.resource_version.as_deref(), Some("7"));
    }

    #[test]
    fn a_cached_lease_keeps_a_load_report_only_when_it_can_be_one() {
        let report = "objects=12,queue=3";
        for (value, kept) in [
            (report.to_string(), true),
            ("1".repeat(MAX_LOAD_ANNOTATION_BYTES), true),
            ("1".repeat(MAX_LOAD_ANNOTATION_BYTES + 1), false),
        ] {
            let mut lease = Lease {
                metadata: ObjectMeta {
                    name: Some("shard-a".into()),
                    annotations: Some(BTreeMap::from([(ANNOTATION_LOAD.into(), value.clone())])),
                    ..Default::default()
                },
                spec: None,
            };
            slim_lease(&mut lease);
            assert_eq!(
                lease.annotations().get(ANNOTATION_LOAD),
                kept.then_some(&value),
                "{} bytes",
                value.len()
            );
        }
    }

    #[test]
    fn a_cached_lease_keeps_range_annotations_only_when_they_can_parse() {
        for (ranges, acknowledged, kept) in [
            ("7".to_string(), "7".to_string(), true),
            (
                "1".repeat(MAX_RANGES_ANNOTATION_BYTES + 1),
                "1".repeat(MAX_ACKNOWLEDGED_BYTES + 1),
                false,
            ),
        ] {
            let mut lease = Lease {
                metadata: ObjectMeta {
                    name: Some("shard-a".into()),
                    annotations: Some(BTreeMap::from([
                        (ANNOTATION_RANGES.into(), ranges.clone()),
                        (ANNOTATION_ACKNOWLEDGED.into(), acknowledged.clone()),
                    ])),
                    ..Default::default()
                },
                spec: None,
            };
            slim_lease(&mut lease);
            assert_eq!(
                lease.annotations().get(ANNOTATION_RANGES),
                kept.then_some(&ranges)
            );
            assert_eq!(
                lease.annotations().get(ANNOTATION_ACKNOWLEDGED),
                kept.then_some(&acknowledged)
            );
        }
    }

    #[test]
    fn a_cached_lease_keeps_what_its_shard_says_about_controlled_objects() {
        let mut lease = Lease {
            metadata: ObjectMeta {
                name: Some("shard-a".into()),
                annotations: Some(BTreeMap::from([
                    (ANNOTATION_LEAVES_CONTROLLED_OBJECTS.into(), "true".into()),
                    ("team.example/note".into(), "x".into()),
                ])),
                ..Default::default()
            },
            spec: None,
        };
        slim_lease(&mut lease);
        let annotations = lease.annotations();
        assert_eq!(annotations.len(), 1, "{:?}", annotations.keys());
        assert_eq!(annotations[ANNOTATION_LEAVES_CONTROLLED_OBJECTS], "true");
    }

    fn ring_lease(ring: Option<&str>, holder: &str) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("shard-a".into()),
                namespace: Some("team".into()),
                labels: ring.map(|ring| {
                    BTreeMap::from([(RingKind::ClusterRing.lease_label().into(), ring.into())])
                }),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn leases_of_no_possible_ring_are_never_cached() {
        assert_eq!(
            lease_selector(RingKind::ClusterRing),
            format!("{0},{0}!=", RingKind::ClusterRing.lease_label())
        );
        for ring in [None, Some(""), Some("Upper"), Some("a_b"), Some("-a")] {
            for event in [
                watcher::Event::Apply(ring_lease(ring, "shard-a")),
                watcher::Event::InitApply(ring_lease(ring, "shard-a")),
            ] {
                let mut event = event;
                prepare_lease(RingKind::ClusterRing, &mut event);
                // A delete: the cache drops it if an earlier value put it there.
                assert!(
                    matches!(&event, watcher::Event::Delete(l) if l.metadata.name.as_deref() == Some("shard-a")),
                    "{ring:?}: {event:?}"
                );
            }
        }
        let mut event = watcher::Event::Apply(ring_lease(Some("example.ring-1"), "shard-a"));
        prepare_lease(RingKind::ClusterRing, &mut event);
        assert!(matches!(event, watcher::Event::Apply(_)), "{event:?}");
    }

    #[test]
    fn a_holder_longer_than_a_name_is_kept_as_a_marker() {
        let long = "h".repeat(10 * 1024);
        for make in [
            watcher::Event::Apply as fn(Lease) -> watcher::Event<Lease>,
            watcher::Event::Delete,
        ] {
            let mut event = make(ring_lease(Some("ring"), &long));
            prepare_lease(RingKind::ClusterRing, &mut event);
            let (watcher::Event::Apply(lease) | watcher::Event::Delete(lease)) = &event else {
                panic!("{event:?}");
            };
            let holder = lease
                .spec
                .as_ref()
                .and_then(|s| s.holder_identity.as_deref());
            assert_eq!(holder, Some(TOO_LONG));
        }
        let name = "n".repeat(MAX_SHARD_NAME_LEN);
        let mut event = watcher::Event::Apply(ring_lease(Some("ring"), &name));
        prepare_lease(RingKind::ClusterRing, &mut event);
        let watcher::Event::Apply(lease) = &event else {
            panic!("{event:?}");
        };
        let holder = lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref());
        assert_eq!(holder, Some(name.as_str()));
    }

    #[test]
    fn long_steering_annotations_are_kept_as_invalid_markers() {
        let long = "9".repeat(10 * 1024);
        let mut lease = ring_lease(Some("ring"), "shard-a");
        lease.metadata.annotations = Some(BTreeMap::from([
            (ANNOTATION_WEIGHT.into(), long.clone()),
            (ANNOTATION_LEAVES_CONTROLLED_OBJECTS.into(), long),
        ]));
        slim_lease(&mut lease);
        let annotations = lease.annotations();
        assert_eq!(annotations[ANNOTATION_WEIGHT], INVALID_VALUE);
        assert_eq!(
            annotations[ANNOTATION_LEAVES_CONTROLLED_OBJECTS],
            INVALID_VALUE
        );
        assert!(kube_sharding_api::labels::parse_weight(Some(INVALID_VALUE)).is_err());
    }
}
