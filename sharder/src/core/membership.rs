//! Which shard Leases of a ring put their shard into the ring (SPEC §4, §18).
//!
//! A shard is available when its Lease is held by the shard itself, unless the Lease is kept out
//! of the ring: a name that cannot be a label value would make the webhook return patches the API
//! server rejects (users' writes would fail), and one name in two namespaces of one ring would
//! make two processes own the same objects.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;
use sharding_crds::labels::LABEL_CLUSTER_RING;
use sharding_crds::lease::{ShardLease, is_valid_shard_name};

/// Why a Lease of a ring is kept out of the ring, whatever its holder.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Exclusion {
    /// The Lease name cannot be a label value.
    InvalidName,
    /// Another Lease of the ring, in another namespace, has the same name.
    DuplicateName {
        /// Namespaces of every Lease of the ring with this name, sorted.
        namespaces: Vec<String>,
    },
}

impl Exclusion {
    /// A fixed reason, for Events and metric labels.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Self::InvalidName => "InvalidShardName",
            Self::DuplicateName { .. } => "DuplicateShardName",
        }
    }

    /// What a user reads about shard `name` of ring `ring`.
    pub(crate) fn message(&self, ring: &str, name: &str) -> String {
        match self {
            Self::InvalidName => format!(
                "Shard {name:?} of ClusterRing {ring} is kept out of the ring: its name is not a valid label value (at most 63 characters: alphanumerics, '-', '_' or '.', starting and ending alphanumeric)"
            ),
            Self::DuplicateName { namespaces } => format!(
                "Shard {name:?} of ClusterRing {ring} is kept out of the ring: Leases of that name exist in namespaces {}; keep exactly one",
                namespaces.join(", ")
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
}

impl Member<'_> {
    /// Whether the shard receives objects: held by itself and not kept out.
    pub(crate) fn is_available(&self) -> bool {
        self.exclusion.is_none() && ShardLease::from_lease(self.lease).is_held_by_shard()
    }
}

/// The Leases of `ring` among `leases` (those carrying its ring label), each with its exclusion.
pub(crate) fn ring_members<'a>(
    ring: &str,
    leases: impl IntoIterator<Item = &'a Lease>,
) -> Vec<Member<'a>> {
    let leases: Vec<&Lease> = leases
        .into_iter()
        .filter(|l| l.labels().get(LABEL_CLUSTER_RING).map(String::as_str) == Some(ring))
        .collect();
    let mut namespaces: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for lease in &leases {
        namespaces
            .entry(lease.name_any())
            .or_default()
            .insert(lease.namespace().unwrap_or_default());
    }
    leases
        .into_iter()
        .map(|lease| {
            let name = lease.name_any();
            let exclusion = if !is_valid_shard_name(&name) {
                Some(Exclusion::InvalidName)
            } else {
                namespaces
                    .get(&name)
                    .filter(|set| set.len() > 1)
                    .map(|set| Exclusion::DuplicateName {
                        namespaces: set.iter().cloned().collect(),
                    })
            };
            Member { lease, exclusion }
        })
        .collect()
}

/// Names of the available shards of `ring` among `leases` (SPEC §4: ready, expired and uncertain
/// Leases held by the shard itself), without the Leases kept out of the ring.
pub(crate) fn available_shards<'a>(
    ring: &str,
    leases: impl IntoIterator<Item = &'a Lease>,
) -> BTreeSet<String> {
    ring_members(ring, leases)
        .into_iter()
        .filter(Member::is_available)
        .map(|m| m.lease.name_any())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use kube::api::ObjectMeta;

    fn lease(namespace: &str, name: &str, ring: &str, holder: Option<&str>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                labels: Some([(LABEL_CLUSTER_RING.to_string(), ring.to_string())].into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_string),
                ..Default::default()
            }),
        }
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
        let shards = available_shards("r", &leases);
        assert_eq!(shards.into_iter().collect::<Vec<_>>(), ["a", "e"]);
    }

    #[test]
    fn names_that_cannot_be_label_values_are_kept_out() {
        let long = "x".repeat(64);
        let leases = [
            lease("ns", "a", "r", Some("a")),
            lease("ns", &long, "r", Some(&long)),
            lease("ns", "b.", "r", Some("b.")),
        ];
        assert_eq!(
            available_shards("r", &leases)
                .into_iter()
                .collect::<Vec<_>>(),
            ["a"]
        );
        let members = ring_members("r", &leases);
        assert_eq!(members[1].exclusion, Some(Exclusion::InvalidName));
        assert_eq!(members[2].exclusion, Some(Exclusion::InvalidName));
        assert!(
            Exclusion::InvalidName
                .message("r", &long)
                .contains("not a valid label value")
        );
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
        assert_eq!(
            available_shards("r", &leases)
                .into_iter()
                .collect::<Vec<_>>(),
            ["b"]
        );
        let members = ring_members("r", &leases);
        let duplicate = Exclusion::DuplicateName {
            namespaces: vec!["ns1".into(), "ns2".into()],
        };
        assert_eq!(members[0].exclusion.as_ref(), Some(&duplicate));
        assert_eq!(members[1].exclusion.as_ref(), Some(&duplicate));
        assert_eq!(members[2].exclusion, None);
        assert!(duplicate.message("r", "a").contains("ns1, ns2"));

        // Once one copy is gone, the other takes part again.
        let available = available_shards("r", [&leases[0], &leases[2]]);
        assert_eq!(available.into_iter().collect::<Vec<_>>(), ["a", "b"]);
    }
}
