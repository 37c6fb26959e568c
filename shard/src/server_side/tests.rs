use kube_sharding_api::ranges::{HashRange, RangeSet};

use super::*;
use crate::sharded_watch::enforce_snapshot;

fn annotations(ranges: Option<&str>) -> BTreeMap<String, String> {
    ranges
        .map(|r| BTreeMap::from([(ANNOTATION_RANGES.to_string(), r.to_string())]))
        .unwrap_or_default()
}

const LOWER: &str = "0000000000000000-8000000000000000";
const UPPER: &str = "8000000000000000-10000000000000000";

#[test]
fn the_first_generation_of_a_term_is_taken_whatever_its_number() {
    let a = annotations(Some(&format!("7 {LOWER}")));
    let published = newer_ranges(None, Some(&a)).expect("valid").expect("taken");
    assert_eq!(published.generation(), 7);
    assert_eq!(published.ranges().ranges().len(), 1);
    // No ranges in a generation: taken too (the shard then watches nothing).
    let a = annotations(Some("8"));
    let published = newer_ranges(Some(7), Some(&a))
        .expect("valid")
        .expect("taken");
    assert!(published.ranges().is_empty());
}

#[test]
fn older_and_equal_generations_are_ignored() {
    for generation in [1, 4, 5] {
        let a = annotations(Some(&format!("{generation} {UPPER}")));
        assert_eq!(
            newer_ranges(Some(5), Some(&a)).expect("valid"),
            None,
            "generation {generation} after 5"
        );
    }
    let a = annotations(Some(&format!("6 {UPPER}")));
    assert_eq!(
        newer_ranges(Some(5), Some(&a))
            .expect("valid")
            .map(|p| p.generation()),
        Some(6)
    );
}

#[test]
fn a_lease_without_ranges_asks_nothing_and_malformed_ranges_are_an_error() {
    assert_eq!(newer_ranges(None, None).expect("valid"), None);
    assert_eq!(
        newer_ranges(None, Some(&annotations(None))).expect("valid"),
        None
    );
    for bad in ["", "01 0-1", "3 0000000000000000-8000000000000000,", "x"] {
        assert!(
            newer_ranges(None, Some(&annotations(Some(bad)))).is_err(),
            "{bad:?} must be refused"
        );
    }
}

fn key(namespace: &str, name: &str) -> ObjectKey {
    ObjectKey {
        namespace: Some(namespace.to_string()),
        name: name.to_string(),
        uid: Some(format!("{name}-{namespace}-uid")),
    }
}

fn hash_of(key: &ObjectKey, field: ShardField) -> u64 {
    kube_sharding_api::ranges::fnv1a64(match field {
        ShardField::Uid => key.uid.as_deref().unwrap_or_default(),
        ShardField::Namespace => key.namespace.as_deref().unwrap_or_default(),
    })
}

#[test]
fn the_held_objects_outside_the_new_ranges_are_released() {
    let held: Vec<ObjectKey> = (0..200)
        .map(|i| key(&format!("{}-ns", i % 40), &format!("s{i}")))
        .collect();
    for field in [ShardField::Uid, ShardField::Namespace] {
        let lower = RangeSet::new(HashRange::new(0, 1 << 63));
        let selection = enforce_snapshot(ShardSelector::new(field, lower.clone()));
        let released = crate::sharded_watch::revoked_of(&held, &selection);
        let expected: Vec<ObjectKey> = held
            .iter()
            .filter(|k| !lower.contains(hash_of(k, field)))
            .cloned()
            .collect();
        assert_eq!(released, expected, "{field:?}");
        assert!(!released.is_empty() && released.len() < held.len());
        // No ranges: everything goes.
        let nothing = enforce_snapshot(None);
        assert_eq!(crate::sharded_watch::revoked_of(&held, &nothing), held);
    }
}

#[test]
fn the_restart_backoff_retries_at_once_after_a_success_then_as_kube_does() {
    use kube::runtime::utils::Backoff;
    let mut backoff = RestartBackoff::default();
    assert_eq!(backoff.next(), Some(Duration::ZERO));
    let second = backoff.next().expect("more");
    assert!(second >= Duration::from_millis(800), "{second:?}");
    backoff.reset();
    assert_eq!(backoff.next(), Some(Duration::ZERO));
}
