//! The consistent-hash ring that maps hash keys to shards (SPEC §5).
//!
//! Every available shard places `TOKENS_PER_SHARD` (100) tokens on a 64-bit ring; a key belongs to the
//! shard owning the first token at or after the key's hash, wrapping around past the largest token.
//! Adding or removing one shard therefore only moves the keys between that shard's tokens and their
//! predecessors, which is what keeps rebalancing cheap.

use std::fmt::Write as _;

use xxhash_rust::xxh64::xxh64;

/// Number of tokens each shard contributes to the ring.
///
/// Part of the wire protocol: every implementation that assigns objects of the same ring must use
/// the same value, otherwise shards and sharder disagree about ownership.
pub(crate) const TOKENS_PER_SHARD: usize = 100;

/// Hashes `data` the way the ring does: XXH64 with seed 0 over its UTF-8 bytes.
#[must_use]
pub(crate) fn hash(data: &str) -> u64 {
    xxh64(data.as_bytes(), 0)
}

/// An immutable consistent-hash ring over a set of shard names.
///
/// Build it from the names of the *available* shards only; an empty ring assigns nothing.
///
/// If two tokens of different shards happen to have the same hash, the token of the
/// lexicographically smaller shard name wins. The tie-break only needs to be deterministic so that
/// every sharder replica computes the same assignment; with 64-bit hashes it practically never
/// applies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ring {
    /// Distinct shard names, sorted ascending.
    names: Vec<String>,
    /// Token hashes, sorted ascending and unique.
    tokens: Vec<u64>,
    /// `owners[i]` is the index into `names` of the shard owning `tokens[i]`. Kept apart from
    /// `tokens` so the binary search walks a dense `u64` slice.
    owners: Vec<usize>,
}

impl Ring {
    /// Builds a ring from shard names. Order does not matter and duplicates count once.
    #[must_use]
    pub fn new<I, S>(shards: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut names: Vec<String> = shards.into_iter().map(|s| s.as_ref().to_owned()).collect();
        names.sort_unstable();
        names.dedup();

        let mut pairs: Vec<(u64, usize)> = Vec::with_capacity(names.len() * TOKENS_PER_SHARD);
        let mut buf = String::new();
        for (index, name) in names.iter().enumerate() {
            for i in 0..TOKENS_PER_SHARD {
                buf.clear();
                // Writing to a `String` cannot fail.
                let _ = write!(buf, "{name}{i}");
                pairs.push((hash(&buf), index));
            }
        }
        Self::from_tokens(names, pairs)
    }

    /// Builds the ring from sorted, distinct `names` and unsorted `(token, index into names)`
    /// pairs.
    fn from_tokens(names: Vec<String>, mut pairs: Vec<(u64, usize)>) -> Self {
        // Sorting by (hash, index) puts the smaller name first among equal hashes because `names`
        // is sorted; `dedup_by_key` keeps that first one, which is the documented tie-break.
        pairs.sort_unstable();
        pairs.dedup_by_key(|&mut (token, _)| token);
        let (tokens, owners) = pairs.into_iter().unzip();

        Self {
            names,
            tokens,
            owners,
        }
    }

    /// Returns the shard responsible for `key`, or `None` if the ring has no shards.
    #[must_use]
    pub fn shard_for(&self, key: &str) -> Option<&str> {
        self.shard_for_hash(hash(key))
    }

    /// Returns the shard responsible for an already computed key hash (see [`hash`]), or `None`
    /// if the ring has no shards.
    #[must_use]
    pub(crate) fn shard_for_hash(&self, key_hash: u64) -> Option<&str> {
        let pos = self.tokens.partition_point(|&token| token < key_hash);
        // Past the largest token the ring wraps around to the smallest one.
        let pos = if pos == self.tokens.len() { 0 } else { pos };
        let owner = *self.owners.get(pos)?;
        self.names.get(owner).map(String::as_str)
    }

    /// Whether the ring has no shards, so that no key can be assigned.
    #[must_use]
    pub(crate) fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The number of distinct shards in the ring.
    #[must_use]
    pub(crate) fn len(&self) -> usize {
        self.names.len()
    }

    /// The distinct shard names in the ring, sorted ascending.
    #[must_use]
    pub(crate) fn shards(&self) -> &[String] {
        &self.names
    }

    /// Whether `shard` is one of the ring's shards.
    #[must_use]
    pub(crate) fn contains(&self, shard: &str) -> bool {
        self.names
            .binary_search_by(|name| name.as_str().cmp(shard))
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn hash_matches_spec_vectors() {
        assert_eq!(hash(""), 0xef46db3751d8e999);
        assert_eq!(hash("shard-a0"), 0x83b529463cc2a1f3);
        assert_eq!(hash("apps/Deployment/bar/foo"), 0x82cb424099458184);
    }

    #[test]
    fn assigns_spec_examples() {
        let ring = Ring::new(["shard-a", "shard-b", "shard-c"]);
        for (key, shard) in [
            ("apps/Deployment/bar/foo", "shard-b"),
            ("/ConfigMap/default/foo", "shard-b"),
            ("/Secret/default/foo", "shard-a"),
            (
                "webhosting.timebertt.dev/Website/project-foo/homepage",
                "shard-a",
            ),
        ] {
            assert_eq!(ring.shard_for(key), Some(shard), "key {key:?}");
        }
    }

    #[test]
    fn splits_spec_thousand_keys() {
        let ring = Ring::new(["shard-a", "shard-b", "shard-c"]);
        let mut counts = BTreeMap::<&str, usize>::new();
        for i in 0..1000 {
            let shard = ring.shard_for(&format!("/ConfigMap/default/foo-{i}"));
            *counts.entry(shard.expect("ring is not empty")).or_default() += 1;
        }
        assert_eq!(
            counts,
            BTreeMap::from([("shard-a", 380), ("shard-b", 307), ("shard-c", 313)])
        );
    }

    #[test]
    fn empty_ring_assigns_nothing() {
        let ring = Ring::new(Vec::<String>::new());
        assert!(ring.is_empty());
        assert_eq!(ring.len(), 0);
        assert_eq!(ring.shard_for("/ConfigMap/default/foo"), None);
        assert_eq!(ring.shard_for_hash(u64::MAX), None);
    }

    #[test]
    fn single_shard_takes_everything() {
        let ring = Ring::new(["solo"]);
        for key_hash in [0, 1, u64::MAX / 2, u64::MAX] {
            assert_eq!(ring.shard_for_hash(key_hash), Some("solo"));
        }
    }

    #[test]
    fn wraps_around_past_the_largest_token() {
        let ring = Ring::new(["shard-a", "shard-b", "shard-c"]);
        let (&first, &last) = (
            ring.tokens.first().expect("tokens"),
            ring.tokens.last().expect("tokens"),
        );
        let first_owner = ring.shard_for_hash(first);
        assert!(first_owner.is_some());
        assert_eq!(ring.shard_for_hash(u64::MAX), first_owner);
        assert_eq!(ring.shard_for_hash(0), first_owner);
        assert_eq!(ring.shard_for_hash(last + 1), first_owner);
    }

    #[test]
    fn tokens_are_sorted_and_owned_by_the_right_shard() {
        let ring = Ring::new(["shard-b", "shard-a"]);
        assert_eq!(ring.tokens.len(), 2 * TOKENS_PER_SHARD);
        assert!(ring.tokens.windows(2).all(|w| w[0] < w[1]));
        // A key equal to a token maps to that token's shard (first token >= hash).
        assert_eq!(ring.shard_for_hash(hash("shard-a0")), Some("shard-a"));
        assert_eq!(ring.shard_for_hash(hash("shard-b99")), Some("shard-b"));
    }

    #[test]
    fn duplicates_count_once_and_shards_are_sorted() {
        let ring = Ring::new(["shard-b", "shard-a", "shard-b"]);
        assert_eq!(ring.len(), 2);
        assert_eq!(ring.shards(), ["shard-a", "shard-b"]);
        assert_eq!(ring.tokens.len(), 2 * TOKENS_PER_SHARD);
        assert!(ring.contains("shard-a"));
        assert!(!ring.contains("shard-c"));
        assert_eq!(ring, Ring::new(["shard-a", "shard-b"]));
    }

    #[test]
    fn colliding_tokens_go_to_the_smaller_name() {
        let names = vec!["shard-a".to_owned(), "shard-b".to_owned()];
        // Forced collisions, since real XXH64 collisions are impractical to find.
        let ring = Ring::from_tokens(names, vec![(10, 1), (5, 1), (5, 0), (10, 0), (20, 1)]);
        assert_eq!(ring.tokens, [5, 10, 20]);
        assert_eq!(ring.shard_for_hash(5), Some("shard-a"));
        assert_eq!(ring.shard_for_hash(10), Some("shard-a"));
        assert_eq!(ring.shard_for_hash(11), Some("shard-b"));
        assert_eq!(ring.shard_for_hash(21), Some("shard-a"));
    }

    /// `vectors/ring.json`, computed by an independent implementation.
    #[derive(serde::Deserialize)]
    struct Vectors {
        xxh64: BTreeMap<String, String>,
        cases: Vec<Case>,
    }

    #[derive(serde::Deserialize)]
    struct Case {
        shards: Vec<String>,
        assignments: BTreeMap<String, String>,
    }

    #[test]
    fn matches_shared_vectors() {
        // The protocol vectors live with the wire protocol in the crds crate.
        let data = include_str!("../../../crds/vectors/ring.json");
        let vectors: Vectors = serde_json::from_str(data).expect("ring.json parses");

        assert!(!vectors.xxh64.is_empty(), "no hash vectors");
        for (input, expected) in &vectors.xxh64 {
            assert_eq!(
                format!("{:016x}", hash(input)),
                *expected,
                "XXH64({input:?})"
            );
        }

        assert!(!vectors.cases.is_empty(), "no ring cases");
        for case in &vectors.cases {
            let ring = Ring::new(&case.shards);
            assert!(!case.assignments.is_empty(), "no assignments");
            for (key, expected) in &case.assignments {
                assert_eq!(
                    ring.shard_for(key),
                    Some(expected.as_str()),
                    "key {key:?} in ring {:?}",
                    case.shards
                );
            }
        }
    }

    fn shard_names() -> impl Strategy<Value = BTreeSet<String>> {
        prop::collection::btree_set("[a-z0-9.-]{1,16}", 1..8)
    }

    fn keys() -> impl Strategy<Value = Vec<String>> {
        prop::collection::vec("[a-zA-Z0-9./-]{0,40}", 1..300)
    }

    proptest! {
        #[test]
        fn adding_a_shard_only_moves_keys_onto_it(
            shards in shard_names(),
            new_shard in "[a-z0-9.-]{1,16}",
            keys in keys(),
        ) {
            prop_assume!(!shards.contains(&new_shard));
            let before = Ring::new(&shards);
            let after = Ring::new(shards.iter().chain([&new_shard]));
            for key in &keys {
                let (old, new) = (before.shard_for(key), after.shard_for(key));
                prop_assert!(old.is_some());
                if old != new {
                    prop_assert_eq!(new, Some(new_shard.as_str()), "key {:?}", key);
                }
            }
        }

        #[test]
        fn removing_a_shard_only_moves_its_keys(
            shards in shard_names(),
            removed in any::<prop::sample::Index>(),
            keys in keys(),
        ) {
            let names: Vec<&String> = shards.iter().collect();
            let removed = names[removed.index(names.len())];
            let before = Ring::new(&shards);
            let after = Ring::new(shards.iter().filter(|name| *name != removed));
            for key in &keys {
                let (old, new) = (before.shard_for(key), after.shard_for(key));
                if old != new {
                    prop_assert_eq!(old, Some(removed.as_str()), "key {:?}", key);
                }
                prop_assert_ne!(new, Some(removed.as_str()));
            }
        }

        #[test]
        fn assignment_ignores_shard_order(
            shards in prop::collection::vec("[a-z0-9.-]{1,16}", 0..8)
                .prop_flat_map(|v| (Just(v.clone()), Just(v).prop_shuffle())),
            keys in keys(),
        ) {
            let (ordered, shuffled) = shards;
            let a = Ring::new(&ordered);
            let b = Ring::new(&shuffled);
            prop_assert_eq!(&a, &b);
            for key in &keys {
                prop_assert_eq!(a.shard_for(key), b.shard_for(key));
            }
        }
    }
}
