use std::collections::BTreeMap;

use kube::runtime::watcher::Event;

use super::*;

const RING: &str = "example";
const SHARD_KEY: &str = "shard.alpha.sharding.timebertt.dev/clusterring-50d858e0-example";
const DRAIN_KEY: &str = "drain.alpha.sharding.timebertt.dev/clusterring-50d858e0-example";

fn meta(name: &str, uid: &str, labels: &[(&str, &str)]) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some("ns".into()),
        uid: Some(uid.into()),
        labels: Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        ),
        ..ObjectMeta::default()
    }
}

fn ours(name: &str, uid: &str) -> ObjectMeta {
    meta(name, uid, &[(SHARD_KEY, "shard-a")])
}

fn draining(name: &str, uid: &str) -> ObjectMeta {
    meta(name, uid, &[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")])
}

fn key(name: &str, uid: &str) -> ObjectKey {
    ObjectKey::of(&ours(name, uid))
}

fn candidate(name: &str, uid: &str, how: Release) -> Candidate {
    Candidate {
        object: key(name, uid),
        how,
    }
}

fn tracker() -> Tracker {
    Tracker::new(DRAIN_KEY, [])
}

#[test]
fn a_deleted_event_says_how_the_object_left() {
    let mut tracker = tracker();
    for event in [
        Event::Init,
        Event::InitApply(ours("a", "1")),
        Event::InitApply(ours("b", "2")),
        Event::InitDone,
        Event::Apply(draining("a", "1")),
    ] {
        assert_eq!(tracker.apply(&event), []);
    }
    // The API server sends the object as it was before it stopped matching.
    assert_eq!(
        tracker.apply(&Event::Delete(draining("a", "1"))),
        [candidate("a", "1", Release::Drained)]
    );
    assert_eq!(
        tracker.apply(&Event::Delete(ours("b", "2"))),
        [candidate("b", "2", Release::Reassigned)]
    );
}

#[test]
fn a_relist_reports_what_went_missing_while_not_watching() {
    let mut tracker = Tracker::new(DRAIN_KEY, [key("known", "9")]);
    for event in [
        Event::Init,
        Event::InitApply(ours("a", "1")),
        Event::InitApply(draining("b", "2")),
        Event::InitApply(ours("c", "3")),
    ] {
        assert_eq!(tracker.apply(&event), []);
    }
    // The object known from before the watch started is not listed.
    assert_eq!(
        tracker.apply(&Event::InitDone),
        [candidate("known", "9", Release::FoundMoved)]
    );
    // The watch restarts: b (draining when last seen) and c are gone, a was recreated.
    for event in [Event::Init, Event::InitApply(ours("a", "1-new"))] {
        assert_eq!(tracker.apply(&event), []);
    }
    assert_eq!(
        tracker.apply(&Event::InitDone),
        [
            candidate("a", "1", Release::FoundMoved),
            candidate("b", "2", Release::Drained),
            candidate("c", "3", Release::FoundMoved),
        ]
    );
    // Nothing is reported twice.
    assert_eq!(tracker.apply(&Event::Init), []);
    assert_eq!(tracker.apply(&Event::InitApply(ours("a", "1-new"))), []);
    assert_eq!(tracker.apply(&Event::InitDone), []);
}

#[test]
fn a_recreated_object_seen_as_an_update_reports_the_old_one() {
    let mut tracker = tracker();
    assert_eq!(tracker.apply(&Event::Apply(ours("a", "1"))), []);
    assert_eq!(tracker.apply(&Event::Apply(ours("a", "1"))), []);
    assert_eq!(
        tracker.apply(&Event::Apply(ours("a", "2"))),
        [candidate("a", "1", Release::Reassigned)]
    );
}

#[test]
fn a_read_tells_released_from_deleted() {
    let shard = Shard::new(RING, "shard-a", "default");
    let left = candidate("a", "1", Release::Drained);
    let released = Departure::Released {
        object: key("a", "1"),
        how: Release::Drained,
    };
    let deleted = Departure::Deleted {
        object: key("a", "1"),
    };
    let cases = [
        ("gone", None, Some(deleted.clone())),
        ("recreated", Some(ours("a", "2")), Some(deleted)),
        (
            "on another shard",
            Some(meta("a", "1", &[(SHARD_KEY, "shard-b")])),
            Some(released.clone()),
        ),
        ("unassigned", Some(meta("a", "1", &[])), Some(released)),
        ("back on this shard", Some(ours("a", "1")), None),
        ("back, draining", Some(draining("a", "1")), None),
    ];
    for (case, current, want) in cases {
        assert_eq!(
            classify(&shard, left.clone(), current.as_ref()),
            want,
            "{case}"
        );
    }
}

#[test]
fn release_names_are_fixed() {
    assert_eq!(Release::Drained.as_str(), "drained");
    assert_eq!(Release::Reassigned.as_str(), "reassigned");
    assert_eq!(Release::FoundMoved.as_str(), "found_moved");
    assert_eq!(key("a", "1").to_string(), "ns/a");
}
