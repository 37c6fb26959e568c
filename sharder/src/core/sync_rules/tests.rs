use super::*;
use crate::core::key::KeyError;
use crate::core::owner_wait::HeldChild;
use crate::core::pin::{PinOutcome, PinSource};
use crate::core::rebalance::{ObjectState, decide};

/// Shards `a` and `b` may be running; `gone` may not.
fn running(shard: &str) -> bool {
    matches!(shard, "a" | "b")
}

/// The placement of an object keyed `key` (none when `None`) labelled for `current`, which the
/// ring wants on `desired`, decided as the views decide.
fn placement<'a>(
    key: Option<&str>,
    current: Option<&'a str>,
    desired: Option<&'a str>,
    draining: bool,
    main: bool,
) -> Placement<'a> {
    let object = ObjectState {
        current,
        draining,
        main,
    };
    Placement {
        key: key.map_or(Err(KeyError::GenerateNameNotSupported), |k| {
            Ok(KeyOutcome::Key(k.into()))
        }),
        desired,
        object,
        decision: decide(object, desired, running),
        pin: PinOutcome::Unpinned,
    }
}

fn secrets() -> GroupResource {
    GroupResource::new("", "secrets")
}

fn configmaps() -> GroupResource {
    GroupResource::new("", "configmaps")
}

/// Counts the main object `key` (on `current`, wanted on `desired`) into `tally`.
fn main_object(
    tally: &mut ObjectTally,
    key: &str,
    current: Option<&str>,
    desired: &str,
) -> RebalanceDecision {
    let placed = placement(Some(key), current, Some(desired), false, true);
    tally.count(&secrets(), true, (Some("ns"), key), &placed, running)
}

/// Counts the controlled object `name` keyed `key` (its controller's) into `tally`.
fn child(
    tally: &mut ObjectTally,
    key: &str,
    name: &str,
    current: Option<&str>,
    desired: &str,
) -> RebalanceDecision {
    let placed = placement(Some(key), current, Some(desired), false, false);
    tally.count(&configmaps(), false, (Some("ns"), name), &placed, running)
}

#[test]
fn main_resources_are_walked_before_controlled_ones_unless_children_go_first() {
    let (deployments, replicasets) = (
        GroupResource::new("apps", "deployments"),
        GroupResource::new("apps", "replicasets"),
    );
    let (secrets, configmaps) = (secrets(), configmaps());
    // The role of each resource: main or controlled.
    let resources = [
        (&replicasets, false),
        (&secrets, true),
        (&configmaps, false),
        (&deployments, true),
    ];
    let order = |children_first| -> Vec<String> {
        sync_order(
            resources.iter().map(|(gr, main)| (*gr, main)),
            |main| *main,
            children_first,
        )
        .into_iter()
        .map(|(gr, _)| gr.to_string())
        .collect()
    };
    assert_eq!(
        order(false),
        [
            "secrets",
            "deployments.apps",
            "configmaps",
            "replicasets.apps"
        ]
    );
    assert_eq!(
        order(true),
        [
            "configmaps",
            "replicasets.apps",
            "secrets",
            "deployments.apps"
        ]
    );
    let none: [(&GroupResource, &bool); 0] = [];
    assert!(sync_order(none, |main| *main, false).is_empty());
}

#[test]
fn children_go_first_only_where_shards_leave_them_in_rings_hashed_by_object() {
    assert!(children_first(true, HashKey::Object, true));
    // Shards that relabel their controlled objects would race the sharder's moves.
    assert!(!children_first(false, HashKey::Object, true));
    // A namespace key names many main objects: one leaving frees no child.
    assert!(!children_first(true, HashKey::Namespace, true));
    // Nothing controlled: nothing to walk first.
    assert!(!children_first(true, HashKey::Object, false));
}

#[test]
fn objects_are_counted_per_shard_unassigned_only_with_a_key_and_pins_by_outcome() {
    let mut tally = ObjectTally::new(HashKey::Object, false);
    // In place, on another available shard, unassigned, and without a key.
    assert_eq!(
        main_object(&mut tally, "s-1", Some("a"), "a"),
        RebalanceDecision::Keep
    );
    assert_eq!(
        main_object(&mut tally, "s-2", Some("b"), "a"),
        RebalanceDecision::Drain
    );
    assert_eq!(
        main_object(&mut tally, "s-3", None, "a"),
        RebalanceDecision::Move
    );
    let keyless = placement(None, None, None, false, true);
    assert_eq!(
        tally.count(&secrets(), true, (Some("ns"), ""), &keyless, running),
        RebalanceDecision::Keep
    );
    let mut pinned = placement(Some("s-4"), Some("gone"), Some("b"), false, true);
    pinned.pin = PinOutcome::Honoured {
        source: PinSource::Object,
    };
    assert_eq!(
        tally.count(&secrets(), true, (Some("ns"), "s-4"), &pinned, running),
        RebalanceDecision::Move
    );
    assert_eq!(
        tally.objects,
        RingObjects {
            per_shard: BTreeMap::from([
                (("a".to_string(), secrets()), 1),
                (("b".to_string(), secrets()), 1),
                (("gone".to_string(), secrets()), 1),
            ]),
            unassigned: BTreeMap::from([(secrets(), 1)]),
            pins: BTreeMap::from([("honoured", 1)]),
        }
    );
    assert_eq!(tally.owner_wait.waiting, 0);
}

#[test]
fn a_ring_all_in_place_holds_nothing_back() {
    let mut tally = ObjectTally::new(HashKey::Object, false);
    assert_eq!(
        main_object(&mut tally, "s-1", Some("a"), "a"),
        RebalanceDecision::Keep
    );
    assert_eq!(
        child(&mut tally, "s-1", "c-1", Some("a"), "a"),
        RebalanceDecision::Keep
    );
    assert_eq!(tally.owner_wait.waiting, 0);
    assert_eq!(tally.owner_wait.take_held(), Some(Vec::new()));
}

#[test]
fn a_child_waits_while_its_controller_sits_on_its_running_shard() {
    let mut tally = ObjectTally::new(HashKey::Object, false);
    // The controller is drained off `a`; its child on `a` waits, wanted on `b` like it.
    assert_eq!(
        main_object(&mut tally, "s-1", Some("a"), "b"),
        RebalanceDecision::Drain
    );
    assert_eq!(
        child(&mut tally, "s-1", "c-1", Some("a"), "b"),
        RebalanceDecision::Keep
    );
    // A controller in place frees its children: one on the old shard moves at once.
    assert_eq!(
        main_object(&mut tally, "s-2", Some("b"), "b"),
        RebalanceDecision::Keep
    );
    assert_eq!(
        child(&mut tally, "s-2", "c-2", Some("a"), "b"),
        RebalanceDecision::Move
    );
    // A child on a shard that is gone moves at once: nothing reconciles it there.
    assert_eq!(
        main_object(&mut tally, "s-3", Some("gone"), "b"),
        RebalanceDecision::Move
    );
    assert_eq!(
        child(&mut tally, "s-3", "c-3", Some("gone"), "b"),
        RebalanceDecision::Move
    );
    // An unassigned child has no shard to wait on.
    assert_eq!(
        child(&mut tally, "s-1", "c-4", None, "b"),
        RebalanceDecision::Move
    );
    assert_eq!(tally.owner_wait.waiting, 1);
    let held = tally.owner_wait.take_held().expect("remembered");
    assert_eq!(
        held.iter()
            .map(|c| (c.name.as_str(), c.shard.as_str(), c.desired.as_str()))
            .collect::<Vec<_>>(),
        [("c-1", "a", "b")]
    );
    let first: &HeldChild = &held[0];
    assert_eq!(
        (first.resource.clone(), first.namespace.as_deref()),
        (configmaps(), Some("ns"))
    );
}

#[test]
fn walked_first_every_misplaced_child_on_a_running_shard_waits() {
    let mut tally = ObjectTally::new(HashKey::Object, true);
    // No controller seen yet: the child waits whatever its controller does.
    assert_eq!(
        child(&mut tally, "s-1", "c-1", Some("a"), "b"),
        RebalanceDecision::Keep
    );
    assert_eq!(
        child(&mut tally, "s-2", "c-2", Some("gone"), "b"),
        RebalanceDecision::Move
    );
    assert_eq!(
        child(&mut tally, "s-3", "c-3", Some("b"), "b"),
        RebalanceDecision::Keep
    );
    assert_eq!(tally.owner_wait.waiting, 1);
}

#[test]
fn a_list_started_over_forgets_what_it_counted_since_its_checkpoint() {
    let mut tally = ObjectTally::new(HashKey::Object, false);
    main_object(&mut tally, "s-1", Some("a"), "b");
    child(&mut tally, "s-1", "c-1", Some("a"), "b");
    let checkpoint = tally.checkpoint();
    let before = tally.objects.clone();
    main_object(&mut tally, "s-2", Some("a"), "b");
    child(&mut tally, "s-1", "c-2", Some("a"), "b");
    assert_eq!(tally.owner_wait.waiting, 2);
    tally.rewind(&checkpoint);
    assert_eq!(tally.objects, before);
    assert_eq!(tally.owner_wait.waiting, 1);
    let held = tally.owner_wait.take_held().expect("remembered");
    assert_eq!(
        held.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        ["c-1"]
    );
}

#[test]
fn failed_patches_outrank_held_moves_which_outrank_waiting_children() {
    let stats = |failed, held| SyncStats {
        listed: 10,
        drained: 2,
        moved: 3,
        failed,
        held,
    };
    assert_eq!(
        outcome(&stats(1, 1), 1),
        Outcome::PatchesFailed {
            failed: 1,
            attempted: 6
        }
    );
    assert_eq!(outcome(&stats(0, 2), 1), Outcome::Held { held: 2 });
    assert_eq!(outcome(&stats(0, 0), 4), Outcome::Waiting { waiting: 4 });
    assert_eq!(outcome(&stats(0, 0), 0), Outcome::Synced);
    assert_eq!(outcome(&SyncStats::default(), 0), Outcome::Synced);
}
