//! The consistent-hash ring that maps hash keys to shards (docs/protocol.md §5).
//!
//! Every available shard places `TOKENS_PER_SHARD` (100) tokens on a 64-bit ring; a key belongs to the
//! shard owning the first token at or after the key's hash, wrapping around past the largest token.
//! Adding or removing one shard therefore only moves the keys between that shard's tokens and their
//! predecessors, which is what keeps rebalancing cheap.
//!
//! A shard of weight `w` (docs/protocol.md §17) places `w × 100` tokens, `XXH64(name + i)` for `i`
//! below that; its first 100 tokens are those of weight 1, so a weight change only adds or removes
//! tokens of that one shard, and weight 1 everywhere is exactly the unweighted ring.

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
pub struct HashRing {
    /// Distinct shard names, sorted ascending.
    names: Vec<String>,
    /// `weights[i]` is the weight of `names[i]`.
    weights: Vec<u32>,
    /// Token hashes, sorted ascending and unique.
    tokens: Vec<u64>,
    /// `owners[i]` is the index into `names` of the shard owning `tokens[i]`. Kept apart from
    /// `tokens` so the binary search walks a dense `u64` slice.
    owners: Vec<usize>,
}

impl HashRing {
    /// Builds a ring from shard names. Order does not matter and duplicates count once.
    #[must_use]
    pub fn new<I, S>(shards: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::weighted(shards.into_iter().map(|s| (s, 1)))
    }

    /// Builds a ring from shard names with weights (docs/protocol.md §17). Order does not matter; a
    /// name given twice counts once, with its largest weight. Weights below 1 count as 1.
    #[must_use]
    pub fn weighted<I, S>(shards: I) -> Self
    where
        I: IntoIterator<Item = (S, u32)>,
        S: AsRef<str>,
    {
        let mut members: Vec<(String, u32)> = shards
            .into_iter()
            .map(|(s, w)| (s.as_ref().to_owned(), w.max(1)))
            .collect();
        // Descending weight within a name, so `dedup` keeps the largest.
        members.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        members.dedup_by(|a, b| a.0 == b.0);
        let (names, weights): (Vec<String>, Vec<u32>) = members.into_iter().unzip();

        let total: usize = weights.iter().map(|&w| TOKENS_PER_SHARD * w as usize).sum();
        let mut pairs: Vec<(u64, usize)> = Vec::with_capacity(total);
        let mut buf = String::new();
        for (index, (name, &weight)) in names.iter().zip(&weights).enumerate() {
            for i in 0..TOKENS_PER_SHARD * weight as usize {
                buf.clear();
                // Writing to a `String` cannot fail.
                let _ = write!(buf, "{name}{i}");
                pairs.push((hash(&buf), index));
            }
        }
        Self::from_tokens(names, weights, pairs)
    }

    /// Builds the ring from sorted, distinct `names`, their `weights` and unsorted
    /// `(token, index into names)` pairs.
    fn from_tokens(names: Vec<String>, weights: Vec<u32>, mut pairs: Vec<(u64, usize)>) -> Self {
        // Sorting by (hash, index) puts the smaller name first among equal hashes because `names`
        // is sorted; `dedup_by_key` keeps that first one, which is the documented tie-break.
        pairs.sort_unstable();
        pairs.dedup_by_key(|&mut (token, _)| token);
        let (tokens, owners) = pairs.into_iter().unzip();

        Self {
            names,
            weights,
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

    /// The number of distinct shards in the ring.
    #[must_use]
    pub(crate) fn len(&self) -> usize {
        self.names.len()
    }

    /// The distinct shards with their weights, sorted by name.
    pub(crate) fn members(&self) -> impl Iterator<Item = (&str, u32)> {
        self.names
            .iter()
            .map(String::as_str)
            .zip(self.weights.iter().copied())
    }

    /// Whether `shard` is one of the ring's shards.
    #[must_use]
    pub(crate) fn contains(&self, shard: &str) -> bool {
        self.member(shard).is_some()
    }

    /// The ring's own copy of the name `shard`, if it is one of the ring's shards.
    #[must_use]
    pub(crate) fn member(&self, shard: &str) -> Option<&str> {
        let index = self
            .names
            .binary_search_by(|name| name.as_str().cmp(shard))
            .ok()?;
        Some(self.names[index].as_str())
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
        let ring = HashRing::new(["shard-a", "shard-b", "shard-c"]);
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
        let ring = HashRing::new(["shard-a", "shard-b", "shard-c"]);
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
        let ring = HashRing::new(Vec::<String>::new());
        assert_eq!(ring.len(), 0);
        assert_eq!(ring.len(), 0);
        assert_eq!(ring.shard_for("/ConfigMap/default/foo"), None);
        assert_eq!(ring.shard_for_hash(u64::MAX), None);
    }

    #[test]
    fn single_shard_takes_everything() {
        let ring = HashRing::new(["solo"]);
        for key_hash in [0, 1, u64::MAX / 2, u64::MAX] {
            assert_eq!(ring.shard_for_hash(key_hash), Some("solo"));
        }
    }

    #[test]
    fn wraps_around_past_the_largest_token() {
        let ring = HashRing::new(["shard-a", "shard-b", "shard-c"]);
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
        let ring = HashRing::new(["shard-b", "shard-a"]);
        assert_eq!(ring.tokens.len(), 2 * TOKENS_PER_SHARD);
        assert!(ring.tokens.windows(2).all(|w| w[0] < w[1]));
        // A key equal to a token maps to that token's shard (first token >= hash).
        assert_eq!(ring.shard_for_hash(hash("shard-a0")), Some("shard-a"));
        assert_eq!(ring.shard_for_hash(hash("shard-b99")), Some("shard-b"));
    }

    #[test]
    fn duplicates_count_once_and_shards_are_sorted() {
        let ring = HashRing::new(["shard-b", "shard-a", "shard-b"]);
        assert_eq!(ring.len(), 2);
        assert_eq!(ring.names, ["shard-a", "shard-b"]);
        assert_eq!(ring.tokens.len(), 2 * TOKENS_PER_SHARD);
        assert!(ring.contains("shard-a"));
        assert!(!ring.contains("shard-c"));
        assert_eq!(ring, HashRing::new(["shard-a", "shard-b"]));
    }

    #[test]
    fn colliding_tokens_go_to_the_smaller_name() {
        let names = vec!["shard-a".to_owned(), "shard-b".to_owned()];
        // Forced collisions, since real XXH64 collisions are impractical to find.
        let ring = HashRing::from_tokens(
            names,
            vec![1, 1],
            vec![(10, 1), (5, 1), (5, 0), (10, 0), (20, 1)],
        );
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
            let ring = HashRing::new(&case.shards);
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

    #[test]
    fn weights_multiply_tokens_and_weight_one_is_the_plain_ring() {
        let plain = HashRing::new(["a", "b"]);
        assert_eq!(HashRing::weighted([("a", 1), ("b", 1)]), plain);
        assert_eq!(
            HashRing::weighted([("b", 0), ("a", 1)]),
            plain,
            "0 counts as 1"
        );
        let ring = HashRing::weighted([("a", 3), ("b", 1), ("a", 2)]);
        assert_eq!(ring.members().collect::<Vec<_>>(), [("a", 3), ("b", 1)]);
        let owned_by_a = ring.owners.iter().filter(|&&o| o == 0).count();
        assert_eq!(owned_by_a, 300);
        assert_eq!(ring.tokens.len(), 400);
    }

    /// The exact share of the hash space each shard of `ring` owns (keys are assumed uniform).
    fn exact_shares(ring: &HashRing) -> Vec<f64> {
        let mut owned = vec![0u128; ring.names.len()];
        let space = 2f64.powi(64);
        for (i, &token) in ring.tokens.iter().enumerate() {
            // Token i owns the keys after the previous token up to itself; the first token also
            // owns the wrap-around part after the largest token.
            let arc = if i == 0 {
                u128::from(token)
                    + 1
                    + (u128::from(u64::MAX) - u128::from(ring.tokens[ring.tokens.len() - 1]))
            } else {
                u128::from(token - ring.tokens[i - 1])
            };
            owned[ring.owners[i]] += arc;
        }
        owned.into_iter().map(|o| o as f64 / space).collect()
    }

    /// A small deterministic generator of shard names (SplitMix64), so the averaged property
    /// below covers many name sets per proptest case without proptest shrinking them.
    fn names_from(seed: &mut u64) -> String {
        *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        format!("shard-{:x}", z ^ (z >> 31))
    }

    fn shard_names() -> impl Strategy<Value = BTreeSet<String>> {
        prop::collection::btree_set("[a-z0-9.-]{1,16}", 1..8)
    }

    fn keys() -> impl Strategy<Value = Vec<String>> {
        prop::collection::vec("[a-zA-Z0-9./-]{0,40}", 1..300)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(8))]
        /// Averaged over 400 random name sets, shards of weights 1, 2 and 3 own shares within 2 %
        /// (relative) of 1/6, 2/6 and 3/6 of the hash space.
        #[test]
        fn weighted_shares_average_to_their_weights(seed in any::<u64>()) {
            const SETS: usize = 400;
            let mut seed = seed;
            let mut sums = [0.0f64; 3];
            for _ in 0..SETS {
                let names = [names_from(&mut seed), names_from(&mut seed), names_from(&mut seed)];
                let ring = HashRing::weighted(names.iter().zip([1, 2, 3]));
                let shares = exact_shares(&ring);
                for (w, name) in names.iter().enumerate() {
                    let index = ring.names.binary_search(name).expect("member");
                    sums[w] += shares[index];
                }
            }
            for (w, sum) in sums.iter().enumerate() {
                let average = sum / SETS as f64;
                let expected = (w + 1) as f64 / 6.0;
                prop_assert!(
                    (average - expected).abs() <= 0.02 * expected,
                    "weight {}: average share {average:.4}, expected {expected:.4}", w + 1
                );
            }
        }
    }

    proptest! {
        /// Changing one shard's weight moves keys only onto it (up) or off it (down).
        #[test]
        fn a_weight_change_moves_keys_only_to_or_from_that_shard(
            shards in prop::collection::btree_map("[a-z0-9.-]{1,16}", 1u32..=10, 1..6),
            changed in any::<prop::sample::Index>(),
            new_weight in 1u32..=10,
            keys in keys(),
        ) {
            let names: Vec<&String> = shards.keys().collect();
            let changed = names[changed.index(names.len())].clone();
            let before = HashRing::weighted(shards.iter().map(|(n, w)| (n, *w)));
            let after = HashRing::weighted(
                shards.iter().map(|(n, w)| (n, if *n == changed { new_weight } else { *w })),
            );
            for key in &keys {
                let (old, new) = (before.shard_for(key), after.shard_for(key));
                if old != new {
                    prop_assert!(
                        old == Some(changed.as_str()) || new == Some(changed.as_str()),
                        "key {:?} moved from {:?} to {:?}", key, old, new
                    );
                }
            }
        }

        #[test]
        fn adding_a_shard_only_moves_keys_onto_it(
            shards in shard_names(),
            new_shard in "[a-z0-9.-]{1,16}",
            keys in keys(),
        ) {
            prop_assume!(!shards.contains(&new_shard));
            let before = HashRing::new(&shards);
            let after = HashRing::new(shards.iter().chain([&new_shard]));
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
            let before = HashRing::new(&shards);
            let after = HashRing::new(shards.iter().filter(|name| *name != removed));
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
            let a = HashRing::new(&ordered);
            let b = HashRing::new(&shuffled);
            prop_assert_eq!(&a, &b);
            for key in &keys {
                prop_assert_eq!(a.shard_for(key), b.shard_for(key));
            }
        }
    }
}
