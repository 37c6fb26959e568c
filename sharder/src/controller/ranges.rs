//! The range publisher of rings with `assignment: ServerSide` (docs/zero-write-rings.md), called
//! by the ring controller on each reconcile of such a ring: from the ring's shard Leases (the same
//! membership as for label rings) it computes the target [`RangeRing`], runs one step of the
//! revoke-before-grant planner ([`RangeHandover`]) and writes the planner's publications on the
//! shards' Leases. It reads nothing but Leases: the ring's objects are neither listed nor watched.
//!
//! What the planner is told about each shard:
//!
//! - a Lease held by its shard (available, or kept out of the ring while held) may be running;
//!   its published ranges and acknowledgement are read from its annotations;
//! - a Lease not held by its shard (released, or taken over by the shard-lease controller) can no
//!   longer be running, as for direct moves of label rings (docs/protocol.md §4, §9). The
//!   publisher then removes both annotations (guarded by the Lease's `resourceVersion`), so that
//!   the shard's next holding starts without ranges;
//! - while a shard whose held Lease left the ring (deleted, relabelled, or handed to another
//!   holder without the shard's release mark, docs/protocol.md §18) may still run, nothing of the
//!   ring moves: its Lease no longer says what it holds.
//!
//! A namespace pin the ring cannot honour (any pin on a ring hashing uids, or one naming no
//! available shard) gets one `PinUnsatisfied` Warning Event on the Namespace while it lasts.
//! Object pins cannot be seen: the ring's objects are not read.
//!
//! On a ring hashing namespaces, a namespace carrying the ring's pin annotation with the name of
//! an available shard has its one hash cut out of its owner's target and added to the pinned
//! shard's ([`RangeRing::ranges_with_pins`]); the planner moves it like any range, revoke before
//! grant. Namespaces come from the sharder's Namespace cache, and a Namespace change reconciles
//! the rings.
//!
//! The planner assumes that its writes are seen before its next step: until the Lease cache shows
//! every publication written (or [`PENDING_FOR`] passed), the next step waits.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, ObjectReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch};
use kube::{Resource, ResourceExt};
use kube_sharding_api::lease::ShardLease;
use kube_sharding_api::range_lease::{
    ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES, Acknowledgement, PublishedRanges,
};
use kube_sharding_api::ranges::{RangeRing, RangeSet};
use kube_sharding_api::{HashKey, RingObject, RingRef};

use super::ring::Error;
use crate::context::Context;
use crate::core::membership::{Member, ring_members, shards_of};
use crate::core::pin::is_valid_pin;
use crate::core::range_handover::{RangeHandover, ShardRanges};
use crate::leader::events::REASON_PIN_UNSATISFIED;
use crate::records;

/// How long a step waits for the Lease cache to show a publication written by an earlier step;
/// after that the planner goes on with what the cache shows (it then counts the shard as holding
/// everything until it acknowledges: slower, never unsafe).
const PENDING_FOR: Duration = Duration::from_secs(10);

/// The outcome of one step for the ring's status and requeue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Step {
    /// The ring's latest range generation (`status.rangeGeneration`).
    pub(crate) generation: u64,
    /// Whether the step had to wait for the cache or a departed shard and should be retried
    /// soon rather than on the next Lease change.
    pub(crate) retry: bool,
}

/// The planners of every ServerSide ring, kept across reconciles.
#[derive(Debug, Default)]
pub(crate) struct RangePublisher {
    rings: Mutex<HashMap<RingRef, RingPlanner>>,
}

/// One ring's planner and the publications it wrote that the cache may not show yet.
#[derive(Debug)]
struct RingPlanner {
    /// The ring object's UID: a ring deleted and created again starts over.
    uid: Option<String>,
    handover: RangeHandover,
    /// Lease (namespace, name) → the ranges value written and when.
    pending: HashMap<(String, String), (String, Instant)>,
    /// Namespace pins whose problem was reported, (namespace, value): each is reported once
    /// while it lasts, not on every step.
    reported: BTreeSet<(String, String)>,
}

/// A shard as the step sees it: its Lease and what the planner is told.
struct ShardEntry<'a> {
    lease: &'a Lease,
    ranges: ShardRanges,
}

impl RangePublisher {
    /// Forgets the planner of `ring` (no longer ServerSide): a switch back starts over from the
    /// Leases and the ring's status.
    pub(crate) fn forget(&self, ring: &RingRef) {
        self.lock().remove(ring);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RingRef, RingPlanner>> {
        self.rings.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one step for `ring` and makes its writes.
    pub(crate) async fn step<R: RingObject>(&self, ring: &R, ctx: &Context) -> Result<Step, Error> {
        let ring_ref = ring.ring_ref();
        let recorded = ring.ring_status().and_then(|s| s.range_generation);
        let leases = ctx.caches.ring_leases(&ring_ref);
        let members = ring_members(
            ring_ref.kind,
            &ring_ref.name,
            &ring.ring_spec().lease_namespaces,
            leases.iter().map(AsRef::as_ref),
        );
        let now = Timestamp::now();
        let departed = !ctx
            .caches
            .lease_index(ring_ref.kind)
            .departed_shards(&ring_ref.name, now)
            .is_empty()
            || ring
                .ring_status()
                .is_some_and(|s| s.departed_shards.iter().any(|d| d.until.0 > now));
        let available = shards_of(&members).available;
        let entries = shard_entries(&members);

        let (plan, clear, pin_events) = {
            let mut rings = self.lock();
            let planner = rings
                .entry(ring_ref.clone())
                .or_insert_with(|| RingPlanner {
                    uid: ring.uid(),
                    handover: RangeHandover::new(recorded.unwrap_or(0)),
                    pending: HashMap::new(),
                    reported: BTreeSet::new(),
                });
            if planner.uid != ring.uid() {
                *planner = RingPlanner {
                    uid: ring.uid(),
                    handover: RangeHandover::new(recorded.unwrap_or(0)),
                    pending: HashMap::new(),
                    reported: BTreeSet::new(),
                };
            }
            let instant = Instant::now();
            // A write is waited for while its Lease is still there, held, and without it; the
            // planner ignores what a Lease gone or stopped says anyway.
            planner
                .pending
                .retain(|(namespace, name), (value, written)| {
                    let unseen = entries.values().any(|e| {
                        e.lease.namespace().as_deref() == Some(namespace.as_str())
                            && e.lease.name_any() == *name
                            && !e.ranges.stopped
                            && e.lease.annotations().get(ANNOTATION_RANGES) != Some(&*value)
                    });
                    unseen && instant.duration_since(*written) < PENDING_FOR
                });
            let generation = recorded.unwrap_or(0);
            if departed || !planner.pending.is_empty() {
                return Ok(Step {
                    generation,
                    retry: true,
                });
            }
            // Pins this ring cannot honour, each reported once while it lasts.
            let mut current = BTreeSet::new();
            let pin_events: Vec<(ObjectReference, String)> = pinned_namespaces(ring, ctx)
                .into_iter()
                .filter_map(|(namespace, value)| {
                    let problem = pin_problem(ring.ring_spec().hash_key(), &value, &available)?;
                    Some(((namespace, value), problem))
                })
                .filter_map(|((namespace, value), problem)| {
                    let key = (namespace.name_any(), value);
                    current.insert(key.clone());
                    (!planner.reported.contains(&key)).then(|| (namespace.object_ref(&()), problem))
                })
                .collect();
            planner.reported = current;
            let shards: BTreeMap<String, ShardRanges> = entries
                .iter()
                .map(|(name, e)| (name.clone(), e.ranges.clone()))
                .collect();
            let pins = namespace_pins(ring, ctx);
            let target = RangeRing::weighted(available.iter().map(|(n, w)| (n.as_str(), *w)))
                .ranges_with_pins(pins.iter().map(|(ns, shard)| (ns.as_str(), shard.as_str())))
                .into_iter()
                .filter(|(name, _)| entries.contains_key(name))
                .collect();
            let plan = planner.handover.plan(&shards, &target);
            for (name, publication) in &plan.writes {
                if let Some(entry) = entries.get(name) {
                    planner.pending.insert(
                        (
                            entry.lease.namespace().unwrap_or_default(),
                            entry.lease.name_any(),
                        ),
                        (publication.to_string(), instant),
                    );
                }
            }
            let clear: Vec<&Lease> = entries
                .values()
                .filter(|e| e.ranges.stopped && has_range_annotations(e.lease))
                .map(|e| e.lease)
                .collect();
            (plan, clear, pin_events)
        };

        for (namespace, problem) in pin_events {
            ctx.events
                .warning(
                    &namespace,
                    REASON_PIN_UNSATISFIED,
                    &ring_ref.name,
                    format!("{ring_ref}: {problem}"),
                )
                .await;
        }

        for (name, publication) in &plan.writes {
            let Some(entry) = entries.get(name) else {
                continue;
            };
            publish(ctx, entry.lease, publication).await?;
            tracing::info!(event = records::EVENT_RANGES_PUBLISHED, ring = %ring_ref, shard = %name, generation = publication.generation(), ranges = publication.ranges().ranges().len(), "published ranges");
        }
        for lease in clear {
            clear_annotations(ctx, lease).await?;
        }
        Ok(Step {
            generation: plan.generation.max(recorded.unwrap_or(0)),
            retry: false,
        })
    }
}

/// The namespace pins of a ring hashing namespaces, from the Namespace cache: every namespace
/// carrying the ring's pin annotation, with the shard it names (docs/zero-write-rings.md). A
/// ring hashing uids has none: a namespace's objects are spread over the whole space there, and
/// object pins would need a watch of the ring's objects, which this mode does without.
fn namespace_pins<R: RingObject>(ring: &R, ctx: &Context) -> Vec<(String, String)> {
    if ring.ring_spec().hash_key() != HashKey::Namespace {
        return Vec::new();
    }
    pinned_namespaces(ring, ctx)
        .into_iter()
        .map(|(namespace, shard)| (namespace.name_any(), shard))
        .collect()
}

/// Every cached Namespace carrying the ring's pin annotation, with the annotation's value.
fn pinned_namespaces<R: RingObject>(
    ring: &R,
    ctx: &Context,
) -> Vec<(std::sync::Arc<Namespace>, String)> {
    let key = ring.ring_ref().pin_annotation();
    ctx.caches
        .namespaces
        .state()
        .into_iter()
        .filter_map(|namespace| {
            let shard = namespace.annotations().get(&key)?.clone();
            Some((namespace, shard))
        })
        .collect()
}

/// Why the pin `value` of a namespace does not decide its objects' shard on a ServerSide ring
/// hashing `hash_key` whose available shards are `available`; `None` when it does.
fn pin_problem(
    hash_key: HashKey,
    value: &str,
    available: &BTreeMap<String, u32>,
) -> Option<String> {
    if hash_key != HashKey::Namespace {
        return Some(format!(
            "the namespace's pin to {value:?} is ignored: the ring hashes object uids (assignment ServerSide, hashKey Object), which spreads a namespace over the whole hash space; pin namespaces of a ring with hashKey Namespace"
        ));
    }
    if !is_valid_pin(value) {
        return Some(format!(
            "the namespace's pin {value:?} is not a shard name (a non-empty label value), so the hash ring decides"
        ));
    }
    (!available.contains_key(value)).then(|| {
        format!(
            "the namespace's pin names {value}, which is not an available shard, so the hash ring decides until {value} becomes available"
        )
    })
}

/// The shards of the ring by name, from its members: each name once, its available Lease first,
/// then one held by its shard, then any other.
fn shard_entries<'a>(members: &[Member<'a>]) -> BTreeMap<String, ShardEntry<'a>> {
    let rank = |m: &Member<'_>| {
        if m.is_available() {
            0
        } else if ShardLease::from_lease(m.lease).is_held_by_shard() {
            1
        } else {
            2
        }
    };
    let mut sorted: Vec<&Member<'a>> = members.iter().collect();
    sorted.sort_by_key(|m| rank(m));
    let mut entries = BTreeMap::new();
    for member in sorted {
        let lease = member.lease;
        entries
            .entry(lease.name_any())
            .or_insert_with(|| ShardEntry {
                lease,
                ranges: shard_ranges(lease),
            });
    }
    entries
}

/// What the planner is told about the shard of `lease`.
fn shard_ranges(lease: &Lease) -> ShardRanges {
    if !ShardLease::from_lease(lease).is_held_by_shard() {
        return ShardRanges {
            published: None,
            acknowledged: None,
            stopped: true,
        };
    }
    let annotations = lease.annotations();
    let published = annotations.get(ANNOTATION_RANGES).map(|value| {
        value.parse::<PublishedRanges>().unwrap_or_else(|error| {
            tracing::warn!(event = records::EVENT_RANGES_UNREADABLE, lease = %lease.name_any(), %error, "unreadable ranges annotation: the shard counts as holding every range until it acknowledges one of ours");
            // Never acknowledged, and unknown to the planner: it counts as holding everything.
            PublishedRanges::new(0, RangeSet::full()).expect("one range is within the limit")
        })
    });
    let acknowledged = annotations
        .get(ANNOTATION_ACKNOWLEDGED)
        .and_then(|value| value.parse::<Acknowledgement>().ok())
        .map(|a| a.generation);
    ShardRanges {
        published,
        acknowledged,
        stopped: false,
    }
}

fn has_range_annotations(lease: &Lease) -> bool {
    let annotations = lease.annotations();
    annotations.contains_key(ANNOTATION_RANGES) || annotations.contains_key(ANNOTATION_ACKNOWLEDGED)
}

/// Writes `publication` on `lease`. Not guarded by `resourceVersion`: only the sharder writes the
/// annotation, and a renewal in between would make the guard fail for nothing.
async fn publish(ctx: &Context, lease: &Lease, publication: &PublishedRanges) -> Result<(), Error> {
    let api: Api<Lease> =
        Api::namespaced(ctx.client.clone(), &lease.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "metadata": {"annotations": {ANNOTATION_RANGES: publication.to_string()}}
    });
    match api
        .patch(
            &lease.name_any(),
            &super::patch_params(),
            &Patch::Merge(&patch),
        )
        .await
    {
        // Deleted meanwhile: the next step no longer sees the shard.
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(source) => Err(Error::Api {
            action: "publish ranges on a shard Lease",
            source,
        }),
        Ok(_) => Ok(()),
    }
}

/// Removes both range annotations from the Lease of a shard that can no longer be running,
/// guarded by the version the decision was made on: a shard that took its Lease again meanwhile
/// keeps what the Lease says now (409, and the next step looks again).
async fn clear_annotations(ctx: &Context, lease: &Lease) -> Result<(), Error> {
    let api: Api<Lease> =
        Api::namespaced(ctx.client.clone(), &lease.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": lease.resource_version(),
            "annotations": {ANNOTATION_RANGES: null, ANNOTATION_ACKNOWLEDGED: null},
        }
    });
    match api
        .patch(
            &lease.name_any(),
            &super::patch_params(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => Ok(()),
        Err(source) => Err(Error::Api {
            action: "remove ranges from a stopped shard's Lease",
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use kube::api::ObjectMeta;
    use kube_sharding_api::RingKind;

    use super::*;

    fn lease(namespace: &str, name: &str, holder: &str, annotations: &[(&str, &str)]) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                labels: Some(
                    [(RingKind::ClusterRing.lease_label().to_string(), "r".into())].into(),
                ),
                annotations: Some(
                    annotations
                        .iter()
                        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_lease_not_held_by_its_shard_is_stopped_whatever_it_says() {
        let released = lease(
            "ns",
            "a",
            "",
            &[(ANNOTATION_RANGES, "3"), (ANNOTATION_ACKNOWLEDGED, "3")],
        );
        assert_eq!(
            shard_ranges(&released),
            ShardRanges {
                published: None,
                acknowledged: None,
                stopped: true,
            }
        );
        assert!(has_range_annotations(&released));
        let taken = lease("ns", "a", "shardlease-controller", &[]);
        assert!(shard_ranges(&taken).stopped);
        assert!(!has_range_annotations(&taken));
    }

    #[test]
    fn a_held_lease_says_what_it_was_published_and_acknowledged() {
        let held = lease(
            "ns",
            "a",
            "a",
            &[
                (ANNOTATION_RANGES, "4 0000000000000000-8000000000000000"),
                (ANNOTATION_ACKNOWLEDGED, "3"),
            ],
        );
        let ranges = shard_ranges(&held);
        assert!(!ranges.stopped);
        assert_eq!(ranges.acknowledged, Some(3));
        let published = ranges.published.expect("published");
        assert_eq!(published.generation(), 4);
        assert_eq!(published.ranges().share(), 0.5);
        // An unreadable publication counts as everything, from no generation of ours.
        let garbled = lease("ns", "a", "a", &[(ANNOTATION_RANGES, "four")]);
        let published = shard_ranges(&garbled)
            .published
            .expect("counted as published");
        assert_eq!(
            (published.generation(), published.ranges()),
            (0, &RangeSet::full())
        );
        // An unreadable acknowledgement acknowledges nothing.
        let garbled = lease("ns", "a", "a", &[(ANNOTATION_ACKNOWLEDGED, "04")]);
        assert_eq!(shard_ranges(&garbled).acknowledged, None);
    }

    #[test]
    fn each_shard_is_seen_through_its_held_lease_when_its_name_is_taken_twice() {
        let leases = [
            lease("old", "a", "", &[]),
            lease("new", "a", "a", &[(ANNOTATION_ACKNOWLEDGED, "1")]),
            lease("ns", "b", "b", &[]),
        ];
        let members = ring_members(RingKind::ClusterRing, "r", &[], leases.iter());
        let entries = shard_entries(&members);
        assert_eq!(entries.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(entries["a"].lease.namespace().as_deref(), Some("new"));
        assert_eq!(entries["a"].ranges.acknowledged, Some(1));
    }

    #[test]
    fn pins_a_server_side_ring_cannot_honour_are_named() {
        let available: BTreeMap<String, u32> = [("a".to_string(), 1)].into();
        assert_eq!(pin_problem(HashKey::Namespace, "a", &available), None);
        let unavailable = pin_problem(HashKey::Namespace, "z", &available).unwrap_or_default();
        assert!(
            unavailable.contains("not an available shard"),
            "{unavailable}"
        );
        let invalid = pin_problem(HashKey::Namespace, "-a-", &available).unwrap_or_default();
        assert!(invalid.contains("not a shard name"), "{invalid}");
        // On a ring hashing uids every namespace pin is ignored, even one naming a shard.
        let ignored = pin_problem(HashKey::Object, "a", &available).unwrap_or_default();
        assert!(ignored.contains("is ignored"), "{ignored}");
    }
}
