use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

fn range(start: u64, end: u128) -> HashRange {
    HashRange::new(start, end).expect("a valid range")
}

fn uid_selector(ranges: &[(u64, u128)]) -> ShardSelector {
    let set = RangeSet::new(ranges.iter().map(|&(s, e)| range(s, e)));
    ShardSelector::new(ShardField::Uid, set).expect("not empty")
}

#[test]
fn fnv1a64_matches_reference_vectors_and_the_server() {
    // The published FNV-1a 64 test vectors.
    assert_eq!(fnv1a64(""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64("a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a64("foobar"), 0x8594_4171_f739_67e8);
    // Uids kube-apiserver 1.37.2 kept in `[0, 0x8000000000000000)` and left out of it (the e2e
    // test `sharded_watch::` checks this against the server on every run).
    assert_eq!(
        fnv1a64("5668c9bb-d8c3-49d6-a4ea-58e23d628822"),
        0x1f7a_9771_bb9a_eca3
    );
    assert_eq!(
        fnv1a64("f4902724-3c9c-4640-b839-aecc4e82519f"),
        0x55a8_cafb_4f89_d369
    );
    assert_eq!(
        fnv1a64("cf3e6dd6-0000-0000-0000-000000000000"),
        0xe24b_c6b5_8ead_2d20
    );
}

#[test]
fn writes_the_servers_normalized_form() {
    let selector = uid_selector(&[(0xc000_0000_0000_0000, SPACE_END), (0, 1 << 63)]);
    assert_eq!(
        selector.to_string(),
        "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000') || \
         shardRange(object.metadata.uid, '0xc000000000000000', '0x10000000000000000')"
    );
    let namespaces = ShardSelector::new(ShardField::Namespace, RangeSet::new([range(0x0f, 0x10f)]))
        .expect("not empty");
    assert_eq!(
        namespaces.to_string(),
        "shardRange(object.metadata.namespace, '0x000000000000000f', '0x000000000000010f')"
    );
}

#[test]
fn reads_what_the_server_accepts() {
    let expected = uid_selector(&[(0, 1 << 63), (0xc000_0000_0000_0000, SPACE_END)]);
    for text in [
        "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000') || shardRange(object.metadata.uid, '0xc000000000000000', '0x10000000000000000')",
        // No whitespace, double quotes, another order, overlapping and adjacent terms: the same
        // hashes, so the same normalized set.
        "shardRange(object.metadata.uid,'0x0000000000000000','0x8000000000000000')||shardRange(object.metadata.uid,'0xc000000000000000','0x10000000000000000')",
        "  shardRange ( object.metadata.uid , \"0xc000000000000000\" , \"0x10000000000000000\" ) ||shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')",
        "shardRange(object.metadata.uid, '0x0000000000000000', '0x4000000000000000') || shardRange(object.metadata.uid, '0x2000000000000000', '0x8000000000000000') || shardRange(object.metadata.uid, '0xc000000000000000', '0xd000000000000000') || shardRange(object.metadata.uid, '0xd000000000000000', '0x10000000000000000')",
    ] {
        assert_eq!(
            text.parse::<ShardSelector>(),
            Ok(expected.clone()),
            "{text}"
        );
    }
}

#[test]
fn refuses_what_the_server_refuses() {
    let cases: &[(&str, ParseError)] = &[
        ("", ParseError::Empty),
        ("  ", ParseError::Empty),
        (
            "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000') || shardRange(object.metadata.namespace, '0xc000000000000000', '0x10000000000000000')",
            ParseError::MixedFields(
                "object.metadata.uid".into(),
                "object.metadata.namespace".into(),
            ),
        ),
        (
            "shardRange(object.metadata.uid, '0x0', '0x8000000000000000')",
            ParseError::Bound("0x0".into()),
        ),
        (
            "shardRange(object.metadata.uid, '0x000000000000000A', '0x8000000000000000')",
            ParseError::Bound("0x000000000000000A".into()),
        ),
        (
            "shardRange(object.metadata.uid, '0x10000000000000000', '0x10000000000000000')",
            ParseError::Bound("0x10000000000000000".into()),
        ),
        (
            "shardRange(object.metadata.name, '0x0000000000000000', '0x8000000000000000')",
            ParseError::Field("object.metadata.name".into()),
        ),
        (
            "shardRange(object.metadata.uid, '0x8000000000000000', '0x8000000000000000')",
            ParseError::Order("0x8000000000000000".into(), "0x8000000000000000".into()),
        ),
        (
            "shardRange(object.metadata.uid, '0x8000000000000000', '0x0000000000000000')",
            ParseError::Order("0x8000000000000000".into(), "0x0000000000000000".into()),
        ),
        (
            "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000'",
            ParseError::Term(
                "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000'"
                    .into(),
            ),
        ),
        (
            "shardRange(object.metadata.uid, 0x0000000000000000, '0x8000000000000000')",
            ParseError::Term(
                "shardRange(object.metadata.uid, 0x0000000000000000, '0x8000000000000000')"
                    .into(),
            ),
        ),
        (
            "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000') && shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')",
            ParseError::Term(
                "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000') && shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')"
                    .into(),
            ),
        ),
    ];
    for (text, error) in cases {
        assert_eq!(text.parse::<ShardSelector>().as_ref(), Err(error), "{text}");
    }
}

#[test]
fn range_sets_merge_sort_and_split_at_zero() {
    assert_eq!(HashRange::new(5, 5), None);
    assert_eq!(HashRange::new(0, SPACE_END + 1), None);
    let set = RangeSet::new([range(30, 40), range(0, 10), range(10, 20), range(35, 50)]);
    assert_eq!(set.ranges(), &[range(0, 20), range(30, 50)]);
    assert_eq!(set.width(), 40);
    for (hash, inside) in [
        (0, true),
        (19, true),
        (20, false),
        (29, false),
        (30, true),
        (49, true),
        (50, false),
        (u64::MAX, false),
    ] {
        assert_eq!(set.contains(hash), inside, "{hash}");
    }
    // An arc over the top is split at 0; the top range ends at 2^64.
    let wrapped = RangeSet::from_arcs([(u64::MAX - 1, 3)]);
    assert_eq!(
        wrapped.ranges(),
        &[range(0, 3), range(u64::MAX - 1, SPACE_END)]
    );
    assert!(wrapped.contains(u64::MAX) && wrapped.contains(0) && !wrapped.contains(3));
    assert_eq!(RangeSet::from_arcs([(7, 7)]), RangeSet::full());
    assert!(RangeSet::full().contains(u64::MAX));
    assert_eq!(RangeSet::empty().width(), 0);
    assert!(ShardSelector::new(ShardField::Uid, RangeSet::empty()).is_none());
}

#[test]
fn selects_objects_by_uid_or_namespace() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let uid = "5668c9bb-d8c3-49d6-a4ea-58e23d628822";
    let low = uid_selector(&[(0, 1 << 63)]);
    let high = uid_selector(&[(1 << 63, SPACE_END)]);
    let meta = ObjectMeta {
        uid: Some(uid.into()),
        namespace: Some("team-a".into()),
        ..ObjectMeta::default()
    };
    assert!(low.matches(&meta) && !high.matches(&meta));
    assert!(!low.matches(&ObjectMeta::default()) && !high.matches(&ObjectMeta::default()));
    let team_a = fnv1a64("team-a");
    let by_namespace = ShardSelector::new(
        ShardField::Namespace,
        RangeSet::new([range(team_a, u128::from(team_a) + 1)]),
    )
    .expect("not empty");
    assert!(by_namespace.matches(&meta));
    // A cluster-scoped object hashes the empty namespace, as on the server.
    let empty = fnv1a64("");
    let cluster_scoped = ShardSelector::new(
        ShardField::Namespace,
        RangeSet::new([range(empty, u128::from(empty) + 1)]),
    )
    .expect("not empty");
    assert!(cluster_scoped.matches(&ObjectMeta::default()));
    assert_eq!(ShardField::from(HashKey::Object), ShardField::Uid);
    assert_eq!(ShardField::from(HashKey::Namespace), ShardField::Namespace);
}

/// Every shard's set, checked to tile the space exactly: sorted together, each range starts
/// where the previous ended, from 0 to 2^64.
fn assert_partition(sets: &BTreeMap<String, RangeSet>) {
    let mut all: Vec<HashRange> = sets.values().flat_map(|s| s.ranges().to_vec()).collect();
    all.sort_unstable();
    let mut next = 0u128;
    for r in &all {
        assert_eq!(u128::from(r.start()), next, "gap or overlap at {next:#x}");
        next = r.end();
    }
    assert_eq!(next, SPACE_END, "the ranges stop short of the top");
}

/// How many hashes `a` and `b` share.
fn overlap(a: &RangeSet, b: &RangeSet) -> u128 {
    let mut total = 0;
    for x in a.ranges() {
        for y in b.ranges() {
            let start = u128::from(x.start()).max(u128::from(y.start()));
            let end = x.end().min(y.end());
            total += end.saturating_sub(start);
        }
    }
    total
}

#[test]
fn ring_edge_cases() {
    assert!(RangeRing::new(Vec::<String>::new()).ranges().is_empty());
    assert_eq!(RangeRing::new(Vec::<String>::new()).owner(7), None);
    let one = RangeRing::new(["only"]);
    assert_eq!(one.ranges_of("only"), RangeSet::full());
    assert_eq!(one.owner(u64::MAX), Some("only"));
    assert_eq!(one.ranges_of("other"), RangeSet::empty());
    let twice = RangeRing::weighted([("a", 1), ("a", 2), ("b", 0)]);
    assert_eq!(twice.shards().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(twice, RangeRing::weighted([("b", 1), ("a", 2)]));
}

fn shard_names() -> impl Strategy<Value = BTreeSet<String>> {
    prop::collection::btree_set("[a-z]{1,3}-[0-9]{1,2}", 1..12)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn selectors_read_back_what_they_write(
        arcs in prop::collection::vec((any::<u64>(), any::<u64>()), 1..20),
        namespace in any::<bool>(),
    ) {
        let field = if namespace { ShardField::Namespace } else { ShardField::Uid };
        let selector = ShardSelector::new(field, RangeSet::from_arcs(arcs)).expect("not empty");
        let text = selector.to_string();
        prop_assert_eq!(text.parse::<ShardSelector>(), Ok(selector));
    }

    #[test]
    fn shards_partition_the_space_and_own_their_hashes(
        shards in shard_names(),
        weights in prop::collection::vec(1u32..4, 12),
        hashes in prop::collection::vec(any::<u64>(), 50),
    ) {
        let ring = RangeRing::weighted(shards.iter().zip(&weights).map(|(s, &w)| (s, w)));
        let sets = ring.ranges();
        assert_partition(&sets);
        prop_assert_eq!(sets.len(), shards.len());
        let mut probes = hashes;
        // The edges of every range, where an off-by-one would show.
        for set in sets.values() {
            for r in set.ranges() {
                probes.push(r.start());
                probes.push(u64::try_from(r.end() - 1).expect("below 2^64"));
            }
        }
        for hash in probes {
            let owner = ring.owner(hash).expect("a shard");
            prop_assert!(sets[owner].contains(hash), "{} not in its owner {}'s ranges", hash, owner);
        }
    }

    #[test]
    fn a_shard_coming_or_going_moves_only_its_own_ranges(
        shards in shard_names(),
        newcomer in "[a-z]{1,3}-[0-9]{1,2}",
    ) {
        prop_assume!(!shards.contains(&newcomer));
        let before = RangeRing::new(&shards).ranges();
        let after = RangeRing::new(shards.iter().chain([&newcomer])).ranges();
        assert_partition(&after);
        for shard in &shards {
            // Every shard keeps a subset of what it had; what it lost went to the newcomer.
            let kept = overlap(&before[shard], &after[shard]);
            prop_assert_eq!(kept, after[shard].width(), "{} gained hashes", shard);
            prop_assert_eq!(
                before[shard].width() - kept,
                overlap(&before[shard], &after[&newcomer]),
                "{} lost hashes to another shard", shard
            );
        }
        // Removing the newcomer again is the reverse move, back to the same ring.
        prop_assert_eq!(RangeRing::new(&shards).ranges(), before);
    }

    #[test]
    fn a_weight_change_moves_only_the_reweighted_shards_ranges(
        shards in shard_names(),
        weight in 2u32..5,
    ) {
        let heavy = shards.iter().next().expect("one shard").clone();
        let before = RangeRing::new(&shards).ranges();
        let after = RangeRing::weighted(
            shards.iter().map(|s| (s, if *s == heavy { weight } else { 1 })),
        )
        .ranges();
        for shard in shards.iter().filter(|s| **s != heavy) {
            let kept = overlap(&before[shard], &after[shard]);
            prop_assert_eq!(kept, after[shard].width(), "{} gained hashes", shard);
        }
    }
}

/// The statistics a token count gives a ring of `n` shards named as a StatefulSet's pods:
/// the largest share over the mean, and the longest selector (object uid field) in bytes.
fn measure(tokens: usize, n: usize) -> (f64, usize, usize) {
    let ring = RangeRing::with_tokens((0..n).map(|i| (format!("controller-{i}"), 1)), tokens);
    let sets = ring.ranges();
    let largest = sets.values().map(RangeSet::share).fold(0.0, f64::max);
    let (longest, most_ranges) = sets
        .values()
        .map(|set| {
            let selector = ShardSelector::new(ShardField::Uid, set.clone()).expect("not empty");
            (selector.to_string().len(), set.ranges().len())
        })
        .fold((0, 0), |(l, r), (sl, sr)| (l.max(sl), r.max(sr)));
    #[allow(clippy::cast_precision_loss)]
    let imbalance = largest * n as f64;
    (imbalance, longest, most_ranges)
}

/// The measurement behind [`RANGE_TOKENS_PER_SHARD`]: balance and selector length at 3, 10 and
/// 100 shards, for the chosen count (asserted) and its neighbours (printed with `--nocapture`).
#[test]
fn token_count_keeps_selectors_short_and_shares_near_even() {
    println!("tokens shards  max/mean  longest selector (bytes)  most ranges");
    for tokens in [8, 16, 32, 64, 100] {
        for n in [3, 10, 100] {
            let (imbalance, longest, ranges) = measure(tokens, n);
            println!("{tokens:6} {n:6}  {imbalance:8.2}  {longest:24}  {ranges:11}");
        }
    }
    // The chosen count: a weight-1 selector stays under 3 KB (about 3.5 KB URL-encoded) at
    // every size, and the largest share stays within the stated bounds.
    for (n, max_imbalance) in [(3, 1.2), (10, 1.35), (100, 1.75)] {
        let (imbalance, longest, _) = measure(RANGE_TOKENS_PER_SHARD, n);
        assert!(longest < 3_000, "{n} shards: a selector of {longest} bytes");
        assert!(
            imbalance < max_imbalance,
            "{n} shards: the largest share is {imbalance:.2}× the mean"
        );
    }
}

#[test]
fn a_hash_is_cut_out_and_added_as_a_one_hash_range() {
    let set = RangeSet::new([range(0, 100), range(200, 300)]);
    assert_eq!(
        set.without_hash(50),
        RangeSet::new([range(0, 50), range(51, 100), range(200, 300)])
    );
    assert_eq!(
        set.without_hash(0),
        RangeSet::new([range(1, 100), range(200, 300)])
    );
    assert_eq!(
        set.without_hash(150),
        set,
        "a hash outside the set changes nothing"
    );
    assert_eq!(
        RangeSet::full().without_hash(u64::MAX),
        RangeSet::new([range(0, u128::from(u64::MAX))])
    );
    assert_eq!(
        set.with_hash(100),
        RangeSet::new([range(0, 101), range(200, 300)])
    );
    assert_eq!(
        set.with_hash(150),
        RangeSet::new([range(0, 100), range(150, 151), range(200, 300)])
    );
    assert_eq!(RangeSet::empty().with_hash(u64::MAX).width(), 1);
}

#[test]
fn namespace_pins_move_exactly_their_namespaces_hash() {
    let ring = RangeRing::new(["a", "b", "c"]);
    let plain = ring.ranges();
    let namespace = "team-blue";
    let hash = fnv1a64(namespace);
    let owner = ring.owner(hash).expect("an owner").to_string();
    let pinned_to = ["a", "b", "c"]
        .into_iter()
        .find(|s| *s != owner)
        .expect("another shard");
    let pinned = ring.ranges_with_pins([(namespace, pinned_to), ("other", "not-a-shard")]);
    assert_partition(&pinned);
    assert!(pinned[pinned_to].contains(hash));
    assert!(!pinned[&owner].contains(hash));
    // Only the one hash moved: the owner lost a width of 1, the pinned shard gained it, the
    // third shard is untouched, and the pin to a shard outside the ring did nothing.
    assert_eq!(pinned[&owner].width() + 1, plain[&owner].width());
    assert_eq!(pinned[pinned_to].width(), plain[pinned_to].width() + 1);
    for (shard, set) in &plain {
        if shard != &owner && shard != pinned_to {
            assert_eq!(&pinned[shard], set);
        }
    }
    // A pin to the owner changes nothing; no pins change nothing.
    assert_eq!(ring.ranges_with_pins([(namespace, owner.as_str())]), plain);
    assert_eq!(ring.ranges_with_pins([]), plain);
    // The selector of the pinned shard still writes and reads back.
    let selector =
        ShardSelector::new(ShardField::Namespace, pinned[pinned_to].clone()).expect("not empty");
    assert_eq!(
        selector.to_string().parse::<ShardSelector>(),
        Ok(selector.clone())
    );
    assert!(selector.matches_value(namespace));
}
