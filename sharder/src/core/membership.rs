//! Which shard Leases of a ring put their shard into the ring (docs/protocol.md §4, §18).
//!
//! A shard is available when its Lease is held by the shard itself, unless the Lease is kept out
//! of the ring: a name that cannot be a label value would make the webhook return patches the API
//! server rejects (users' writes would fail), one name in two namespaces of one ring would make
//! two processes own the same objects (the oldest copy keeps the shard, the others are kept out),
//! a Lease labelled for a ClusterRing and a ControllerRing
//! at once has no single ring it could serve (docs/protocol.md §15), and a ring that names the
//! namespaces its shards run in (`spec.leaseNamespaces`) takes no Lease from elsewhere.
//!
//! An available shard takes part with its weight (docs/protocol.md §17), read from its Lease's
//! annotation.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube_sharding_api::RingKind;
use kube_sharding_api::labels::{
    ANNOTATION_LEAVES_CONTROLLED_OBJECTS, ANNOTATION_WEIGHT, leaves_controlled_objects,
    parse_weight,
};
use kube_sharding_api::lease::{ShardLease, is_valid_shard_name};

/// Why a Lease of a ring is kept out of the ring, whatever its holder.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Exclusion {
    /// The Lease name cannot be a label value.
    InvalidName,
    /// Another Lease of the ring, in another namespace, has the same name, and this one is not the
    /// oldest of them.
    DuplicateName {
        /// Namespaces of every Lease of the ring with this name, sorted.
        namespaces: Vec<String>,
        /// The namespace of the oldest copy, which keeps the shard; `None` when several copies
        /// were created in the same second, so none is known to be first and all are kept out.
        kept: Option<String>,
    },
    /// The Lease carries the ring labels of both kinds.
    BothRingKinds,
    /// The ring names the namespaces of its shard Leases, and this Lease is in none of them.
    NamespaceNotAllowed {
        /// The ring's `spec.leaseNamespaces`.
        allowed: Vec<String>,
    },
}

impl Exclusion {
    /// A fixed reason, for Events and metric labels.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Self::InvalidName => "InvalidShardName",
            Self::DuplicateName { .. } => "DuplicateShardName",
            Self::BothRingKinds => "AmbiguousRingKind",
            Self::NamespaceNotAllowed { .. } => "ShardLeaseNamespaceNotAllowed",
        }
    }

    /// What a user reads about shard `name` of ring `ring` of `kind`.
    pub(crate) fn message(&self, kind: RingKind, ring: &str, name: &str) -> String {
        match self {
            Self::InvalidName => format!(
                "Shard {name:?} of {kind} {ring} is kept out of the ring: its name is not a valid label value (at most 63 characters: alphanumerics, '-', '_' or '.', starting and ending alphanumeric)"
            ),
            Self::DuplicateName {
                namespaces,
                kept: Some(kept),
            } => format!(
                "This Lease of shard {name:?} of {kind} {ring} is kept out of the ring: Leases of that name exist in namespaces {}, and the older one in {kept} keeps the shard; delete this one",
                namespaces.join(", ")
            ),
            Self::DuplicateName {
                namespaces,
                kept: None,
            } => format!(
                "Shard {name:?} of {kind} {ring} is kept out of the ring: Leases of that name created in the same second exist in namespaces {}; keep exactly one",
                namespaces.join(", ")
            ),
            Self::BothRingKinds => format!(
                "Shard {name:?} of {kind} {ring} is kept out of the ring: its Lease carries both {} and {}; keep the label of the one ring it serves",
                RingKind::ClusterRing.lease_label(),
                RingKind::ControllerRing.lease_label()
            ),
            Self::NamespaceNotAllowed { allowed } => format!(
                "This Lease of shard {name:?} of {kind} {ring} is kept out of the ring: the ring takes shard Leases only from namespaces {} (spec.leaseNamespaces)",
                allowed.join(", ")
            ),
        }
    }
}

/// One Lease of a ring and whether its shard takes part.
#[derive(Debug)]
pub(crate) struct Member<'a> {
    /// The Lease.
    pub(crate) lease: &'a Lease,
    /// Why the Lease is kept out of the ring, if it is.
    pub(crate) exclusion: Option<Exclusion>,
    /// The shard's weight: 1 unless the Lease asks for a valid other one.
    pub(crate) weight: u32,
    /// What is wrong with the Lease's weight annotation, if anything.
    pub(crate) weight_error: Option<String>,
    /// Whether the Lease says the shard leaves its controlled objects to the sharder.
    pub(crate) leaves_controlled_objects: bool,
    /// What is wrong with the Lease's annotation saying so, if anything.
    pub(crate) leaves_error: Option<String>,
}

impl Member<'_> {
    /// Whether the shard receives objects: held by itself and not kept out.
    pub(crate) fn is_available(&self) -> bool {
        self.exclusion.is_none() && ShardLease::from_lease(self.lease).is_held_by_shard()
    }
}

/// The namespaces ring `ring` takes shard Leases from (its `spec.leaseNamespaces`): empty for
/// every namespace.
pub(crate) type LeaseNamespaces<'a> = &'a [String];

/// Whether `lease` is in one of `allowed` (every namespace when empty).
fn namespace_allowed(lease: &Lease, allowed: LeaseNamespaces<'_>) -> bool {
    allowed.is_empty()
        || lease
            .metadata
            .namespace
            .as_ref()
            .is_some_and(|ns| allowed.contains(ns))
}

/// The Leases of ring `ring` of `kind` among `leases` (those carrying its ring label), each with
/// its exclusion and weight. Leases outside `allowed` are kept out and do not count as copies of
/// a name, so they cannot make a shard in an allowed namespace a duplicate.
pub(crate) fn ring_members<'a>(
    kind: RingKind,
    ring: &str,
    allowed: LeaseNamespaces<'_>,
    leases: impl IntoIterator<Item = &'a Lease>,
) -> Vec<Member<'a>> {
    let leases: Vec<&Lease> = leases
        .into_iter()
        .filter(|l| l.labels().get(kind.lease_label()).map(String::as_str) == Some(ring))
        .collect();
    // Per name: the namespaces of its Leases, and each Lease's creation time (the API server sets
    // it, so a later copy cannot claim to be older).
    let mut copies: BTreeMap<String, Vec<(String, Option<Timestamp>)>> = BTreeMap::new();
    for lease in leases.iter().filter(|l| namespace_allowed(l, allowed)) {
        copies.entry(lease.name_any()).or_default().push((
            lease.namespace().unwrap_or_default(),
            lease.metadata.creation_timestamp.as_ref().map(|t| t.0),
        ));
    }
    let duplicates: BTreeMap<String, Exclusion> = copies
        .into_iter()
        .filter(|(_, copies)| copies.len() > 1)
        .map(|(name, copies)| {
            let oldest = copies.iter().filter_map(|(_, created)| *created).min();
            let mut first = copies
                .iter()
                .filter(|(_, created)| oldest.is_some() && *created == oldest);
            let kept = match (first.next(), first.next()) {
                (Some((namespace, _)), None) => Some(namespace.clone()),
                _ => None,
            };
            let namespaces: BTreeSet<String> = copies.into_iter().map(|(ns, _)| ns).collect();
            let exclusion = Exclusion::DuplicateName {
                namespaces: namespaces.into_iter().collect(),
                kept,
            };
            (name, exclusion)
        })
        .collect();
    leases
        .into_iter()
        .map(|lease| {
            let name = lease.name_any();
            let exclusion = if !namespace_allowed(lease, allowed) {
                Some(Exclusion::NamespaceNotAllowed {
                    allowed: allowed.to_vec(),
                })
            } else if !is_valid_shard_name(&name) {
                Some(Exclusion::InvalidName)
            } else if lease.labels().contains_key(kind.other().lease_label()) {
                Some(Exclusion::BothRingKinds)
            } else {
                duplicates.get(&name).cloned().filter(|exclusion| {
                    // The oldest copy keeps the shard: a Lease created later under a running
                    // shard's name, in a namespace its creator controls, takes nothing from it.
                    !matches!(exclusion, Exclusion::DuplicateName { kept: Some(kept), .. }
                        if lease.namespace().as_deref() == Some(kept.as_str()))
                })
            };
            let (weight, weight_error) = match parse_weight(
                lease
                    .annotations()
                    .get(ANNOTATION_WEIGHT)
                    .map(String::as_str),
            ) {
                Ok(weight) => (weight, None),
                Err(error) => (1, Some(error.to_string())),
            };
            let (leaves_controlled_objects, leaves_error) = match leaves_controlled_objects(
                lease
                    .annotations()
                    .get(ANNOTATION_LEAVES_CONTROLLED_OBJECTS)
                    .map(String::as_str),
            ) {
                Ok(leaves) => (leaves, None),
                Err(error) => (false, Some(error.to_string())),
            };
            Member {
                lease,
                exclusion,
                weight,
                weight_error,
                leaves_controlled_objects,
                leaves_error,
            }
        })
        .collect()
}

/// The available shards of ring `ring` of `kind` among `leases` (docs/protocol.md §4: ready,
/// expired and uncertain Leases held by the shard itself), without the Leases kept out of the ring,
/// each with its weight.
#[cfg(test)]
pub(crate) fn available_shards<'a>(
    kind: RingKind,
    ring: &str,
    allowed: LeaseNamespaces<'_>,
    leases: impl IntoIterator<Item = &'a Lease>,
) -> BTreeMap<String, u32> {
    shards_of(&ring_members(kind, ring, allowed, leases)).available
}

/// What a ring's Leases say about its shards, from one pass over its members: a view is rebuilt
/// on every membership change.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct RingShards {
    /// The available shards with their weights: ready, expired and uncertain Leases held by the
    /// shard itself, without those kept out.
    pub(crate) available: BTreeMap<String, u32>,
    /// The shards kept out of the ring while their Leases are held by themselves (they receive no
    /// objects but may still be running).
    pub(crate) excluded_held: BTreeSet<String>,
    /// Whether there are available shards and every one of them leaves its controlled objects to
    /// the sharder (docs/protocol.md §19): one that relabels them would race the sharder's moves.
    pub(crate) leave_controlled_objects: bool,
}

/// What the Leases of ring `ring` of `kind` among `leases` say about its shards (see
/// [`RingShards`]).
pub(crate) fn ring_shards<'a>(
    kind: RingKind,
    ring: &str,
    allowed: LeaseNamespaces<'_>,
    leases: impl IntoIterator<Item = &'a Lease>,
) -> RingShards {
    shards_of(&ring_members(kind, ring, allowed, leases))
}

/// What `members`, the Leases of one ring, say about its shards (see [`RingShards`]).
pub(crate) fn shards_of(members: &[Member<'_>]) -> RingShards {
    let available_members = || members.iter().filter(|m| m.is_available());
    let available: BTreeMap<String, u32> = available_members()
        .map(|m| (m.lease.name_any(), m.weight))
        .collect();
    let leave_controlled_objects =
        !available.is_empty() && available_members().all(|m| m.leaves_controlled_objects);
    let excluded_held = members
        .iter()
        .filter(|m| m.exclusion.is_some() && ShardLease::from_lease(m.lease).is_held_by_shard())
        .map(|m| m.lease.name_any())
        // A newer copy of an available shard's name is kept out, but the name keeps its objects.
        .filter(|name| !available.contains_key(name))
        .collect();
    RingShards {
        available,
        excluded_held,
        leave_controlled_objects,
    }
}

/// The shards of ring `ring` of `kind` that are kept out of the ring although their Leases are held
/// by the shards themselves. They receive no objects, but may still be running and reconciling the
/// ones they have: those leave them only through a drain, never by a direct move.
#[cfg(test)]
pub(crate) fn excluded_held_shards<'a>(
    kind: RingKind,
    ring: &str,
    allowed: LeaseNamespaces<'_>,
    leases: impl IntoIterator<Item = &'a Lease>,
) -> BTreeSet<String> {
    shards_of(&ring_members(kind, ring, allowed, leases)).excluded_held
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use kube::api::ObjectMeta;

    const KIND: RingKind = RingKind::ClusterRing;

    fn names(shards: BTreeMap<String, u32>) -> Vec<String> {
        shards.into_keys().collect()
    }

    fn lease(namespace: &str, name: &str, ring: &str, holder: Option<&str>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                labels: Some([(KIND.lease_label().to_string(), ring.to_string())].into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_string),
                ..Default::default()
            }),
        }
    }

    /// `lease` carrying the annotation that says whether its shard leaves controlled objects.
    fn leaving(mut lease: Lease, value: &str) -> Lease {
        lease.metadata.annotations = Some(
            [(
                ANNOTATION_LEAVES_CONTROLLED_OBJECTS.to_string(),
                value.to_string(),
            )]
            .into(),
        );
        lease
    }

    #[test]
    fn a_ring_leaves_controlled_objects_to_the_sharder_only_when_every_available_shard_says_so() {
        let leave = |leases: &[Lease]| ring_shards(KIND, "r", &[], leases).leave_controlled_objects;
        let a = || leaving(lease("ns", "a", "r", Some("a")), "true");
        let b = || leaving(lease("ns", "b", "r", Some("b")), "true");
        assert!(leave(&[a(), b()]));
        // One available shard that relabels them (or says nothing, as other libraries' shards).
        assert!(!leave(&[
            a(),
            leaving(lease("ns", "b", "r", Some("b")), "false")
        ]));
        assert!(!leave(&[a(), lease("ns", "b", "r", Some("b"))]));
        // Only the exact values count; another one is reported.
        assert!(!leave(&[
            a(),
            leaving(lease("ns", "b", "r", Some("b")), "True")
        ]));
        let unclear = [leaving(lease("ns", "b", "r", Some("b")), "True")];
        let members = ring_members(KIND, "r", &[], &unclear);
        let error = members[0].leaves_error.as_deref().unwrap_or_default();
        assert!(
            error.contains(r#"="True" is neither "true" nor "false""#),
            "{error}"
        );
        // Shards that receive no objects do not count: not held by themselves, other rings.
        assert!(leave(&[
            a(),
            lease("ns", "c", "r", Some("shardlease-controller")),
            lease("ns", "d", "other", Some("d")),
        ]));
        // No available shard: nothing to say.
        assert!(!leave(&[lease("ns", "c", "r", None)]));
        assert!(!leave(&[]));
    }

    #[test]
    fn available_shards_are_self_held_leases_of_the_ring() {
        let leases = [
            lease("ns", "a", "r", Some("a")),
            lease("ns", "b", "r", Some("shardlease-controller")),
            lease("ns", "c", "r", None),
            lease("ns", "d", "other", Some("d")),
            lease("ns", "e", "r", Some("e")),
        ];
        let shards = available_shards(KIND, "r", &[], &leases);
        assert_eq!(names(shards), ["a", "e"]);
    }

    #[test]
    fn names_that_cannot_be_label_values_are_kept_out() {
        let long = "x".repeat(64);
        let leases = [
            lease("ns", "a", "r", Some("a")),
            lease("ns", &long, "r", Some(&long)),
            lease("ns", "b.", "r", Some("b.")),
        ];
        assert_eq!(names(available_shards(KIND, "r", &[], &leases)), ["a"]);
        let members = ring_members(KIND, "r", &[], &leases);
        assert_eq!(members[1].exclusion, Some(Exclusion::InvalidName));
        assert_eq!(members[2].exclusion, Some(Exclusion::InvalidName));
        assert!(
            Exclusion::InvalidName
                .message(KIND, "r", &long)
                .contains("not a valid label value")
        );
    }

    fn created(mut lease: Lease, second: i64) -> Lease {
        lease.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                Timestamp::from_second(1_800_000_000 + second).expect("timestamp"),
            ));
        lease
    }

    #[test]
    fn the_oldest_copy_of_a_name_keeps_the_shard_and_later_ones_are_kept_out() {
        let leases = [
            created(lease("team", "a", "r", Some("a")), 10),
            // Created later under the running shard's name, in another namespace.
            created(lease("squat", "a", "r", Some("a")), 20),
            created(lease("team", "b", "r", Some("b")), 10),
        ];
        assert_eq!(names(available_shards(KIND, "r", &[], &leases)), ["a", "b"]);
        let members = ring_members(KIND, "r", &[], &leases);
        let duplicate = Exclusion::DuplicateName {
            namespaces: vec!["squat".into(), "team".into()],
            kept: Some("team".into()),
        };
        assert_eq!(members[0].exclusion, None);
        assert!(members[0].is_available());
        assert_eq!(members[1].exclusion.as_ref(), Some(&duplicate));
        assert!(!members[1].is_available());
        assert!(
            duplicate
                .message(KIND, "r", "a")
                .contains("older one in team")
        );
        // The name keeps its objects: nothing to drain because of the copy.
        assert!(excluded_held_shards(KIND, "r", &[], &leases).is_empty());
    }

    #[test]
    fn duplicate_names_keep_every_copy_out_until_one_remains() {
        let leases = [
            lease("ns1", "a", "r", Some("a")),
            lease("ns2", "a", "r", Some("a")),
            lease("ns1", "b", "r", Some("b")),
            // Same name in another ring is no duplicate.
            lease("ns3", "b", "other", Some("b")),
        ];
        assert_eq!(names(available_shards(KIND, "r", &[], &leases)), ["b"]);
        let members = ring_members(KIND, "r", &[], &leases);
        // Created in the same second (here: without creation times), so none is known to be first.
        let duplicate = Exclusion::DuplicateName {
            namespaces: vec!["ns1".into(), "ns2".into()],
            kept: None,
        };
        assert_eq!(members[0].exclusion.as_ref(), Some(&duplicate));
        assert_eq!(members[1].exclusion.as_ref(), Some(&duplicate));
        assert_eq!(members[2].exclusion, None);
        assert!(duplicate.message(KIND, "r", "a").contains("ns1, ns2"));

        // Once one copy is gone, the other takes part again.
        let available = available_shards(KIND, "r", &[], [&leases[0], &leases[2]]);
        assert_eq!(names(available), ["a", "b"]);
    }

    #[test]
    fn excluded_shards_that_hold_their_leases_may_still_be_running() {
        let long = "x".repeat(64);
        let leases = [
            lease("ns1", "a", "r", Some("a")),
            lease("ns2", "a", "r", None),
            lease("ns1", "b", "r", Some("b")),
            lease("ns1", &long, "r", Some(&long)),
            lease("ns1", "c", "r", Some("shardlease-controller")),
            lease("ns1", "d", "other", Some("d")),
        ];
        // "a" is out of the ring (two copies) but its shard holds one of them; the invalid name is
        // out too and held; "b" is available, not excluded; "c" is dead; "d" is another ring's.
        assert_eq!(
            excluded_held_shards(KIND, "r", &[], &leases),
            BTreeSet::from(["a".to_string(), long.clone()])
        );
        assert_eq!(names(available_shards(KIND, "r", &[], &leases)), ["b"]);
        // Neither copy held: nothing can be running under that name.
        let released = [lease("ns1", "a", "r", None), lease("ns2", "a", "r", None)];
        assert!(excluded_held_shards(KIND, "r", &[], &released).is_empty());
    }

    #[test]
    fn kinds_see_only_their_own_leases_and_a_lease_of_both_kinds_serves_neither() {
        let mut both = lease("ns", "both", "r", Some("both"));
        both.metadata
            .labels
            .get_or_insert_default()
            .insert(RingKind::ControllerRing.lease_label().into(), "r".into());
        let mut controller = lease("ns", "c", "r", Some("c"));
        controller.metadata.labels = Some(
            [(
                RingKind::ControllerRing.lease_label().to_string(),
                "r".to_string(),
            )]
            .into(),
        );
        let leases = [lease("ns", "a", "r", Some("a")), both, controller];
        assert_eq!(names(available_shards(KIND, "r", &[], &leases)), ["a"]);
        assert_eq!(
            names(available_shards(
                RingKind::ControllerRing,
                "r",
                &[],
                &leases
            )),
            ["c"]
        );
        let members = ring_members(RingKind::ControllerRing, "r", &[], &leases);
        assert_eq!(members[0].exclusion, Some(Exclusion::BothRingKinds));
        assert!(
            Exclusion::BothRingKinds
                .message(RingKind::ControllerRing, "r", "both")
                .contains("ControllerRing r")
        );
    }

    #[test]
    fn weights_come_from_the_annotation_and_bad_values_count_as_one() {
        let weighted = |name: &str, weight: &str| {
            let mut l = lease("ns", name, "r", Some(name));
            l.metadata.annotations =
                Some([(ANNOTATION_WEIGHT.to_string(), weight.to_string())].into());
            l
        };
        let leases = [
            lease("ns", "plain", "r", Some("plain")),
            weighted("three", "3"),
            weighted("bad", "eleven"),
        ];
        let shards = available_shards(KIND, "r", &[], &leases);
        assert_eq!(
            shards,
            BTreeMap::from([
                ("bad".to_string(), 1),
                ("plain".to_string(), 1),
                ("three".to_string(), 3)
            ])
        );
        let members = ring_members(KIND, "r", &[], &leases);
        assert!(members[0].weight_error.is_none());
        assert!(
            members[2]
                .weight_error
                .as_deref()
                .is_some_and(|e| e.contains("eleven"))
        );
    }

    #[test]
    fn leases_outside_the_allowed_namespaces_are_kept_out_and_are_no_copies() {
        let leases = [
            lease("team-a", "a", "r", Some("a")),
            lease("team-a", "b", "r", Some("b")),
            // A copy of "a" elsewhere: not a duplicate, just not a member.
            lease("team-b", "a", "r", Some("a")),
            lease("team-b", "evil", "r", Some("evil")),
        ];
        let allowed = ["team-a".to_string()];
        assert_eq!(
            names(available_shards(KIND, "r", &allowed, &leases)),
            ["a", "b"]
        );
        let members = ring_members(KIND, "r", &allowed, &leases);
        let expected = Exclusion::NamespaceNotAllowed {
            allowed: allowed.to_vec(),
        };
        assert_eq!(members[0].exclusion, None);
        assert_eq!(members[2].exclusion, Some(expected.clone()));
        assert_eq!(members[3].exclusion, Some(expected.clone()));
        assert!(expected.message(KIND, "r", "evil").contains("team-a"));
        // "evil" holds its Lease, so it may be running: anything it had leaves it by drain. The
        // copy of "a" shares its name with an available shard, which keeps the name's objects.
        assert_eq!(
            excluded_held_shards(KIND, "r", &allowed, &leases),
            BTreeSet::from(["evil".to_string()])
        );
        // Without a list, the two copies of "a" make a duplicate again.
        assert_eq!(
            names(available_shards(KIND, "r", &[], &leases)),
            ["b", "evil"]
        );
    }
}
