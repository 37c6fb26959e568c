use std::collections::{BTreeMap, BTreeSet};

use kube_sharding_api::ranges::RangeRing;
use proptest::prelude::*;

use super::*;

/// The target of a ring of `(shard, weight)`.
fn target(shards: &[(&str, u32)]) -> BTreeMap<String, RangeSet> {
    RangeRing::weighted(shards.iter().copied()).ranges()
}

fn unweighted(names: &[&str]) -> BTreeMap<String, RangeSet> {
    target(&names.iter().map(|n| (*n, 1)).collect::<Vec<_>>())
}

/// One holding of a shard's Lease, as the world has it.
#[derive(Clone, Debug, Default)]
struct Shard {
    /// Every publication written in this holding, oldest first.
    publications: Vec<PublishedRanges>,
    acknowledged: Option<u64>,
    stopped: bool,
}

impl Shard {
    /// What the shard may be working on: the ranges of its acknowledged generation and of every
    /// publication after it (all of them before its first acknowledgement); nothing once stopped.
    fn holds(&self) -> RangeSet {
        if self.stopped {
            return RangeSet::empty();
        }
        let acknowledged = self.acknowledged.unwrap_or(0);
        self.publications
            .iter()
            .filter(|p| p.generation() >= acknowledged)
            .fold(RangeSet::empty(), |all, p| union(&all, p.ranges()))
    }

    fn lease(&self) -> ShardRanges {
        ShardRanges {
            published: self.publications.last().cloned(),
            acknowledged: self.acknowledged,
            stopped: self.stopped,
        }
    }
}

/// The shards' Leases and what each shard does, with the sharder's planner.
#[derive(Default)]
struct World {
    shards: BTreeMap<String, Shard>,
    planner: RangeHandover,
    generation: u64,
    /// Every write of every step, for the tests to look at.
    steps: Vec<RangePlan>,
}

impl World {
    /// Fresh running shards `names` with nothing published.
    fn with(names: &[&str]) -> Self {
        let mut world = Self::default();
        for name in names {
            world.start(name);
        }
        world
    }

    /// Shard `name` takes its Lease (again): a new holding, no ranges.
    fn start(&mut self, name: &str) {
        self.shards.insert(name.to_string(), Shard::default());
        self.check();
    }

    /// Shard `name` can no longer be running.
    fn stop(&mut self, name: &str) {
        self.shards.get_mut(name).expect("known shard").stopped = true;
        self.check();
    }

    /// Shard `name` acknowledges its latest publication.
    fn ack(&mut self, name: &str) {
        let shard = self.shards.get_mut(name).expect("known shard");
        if let Some(latest) = shard.publications.last() {
            shard.acknowledged = Some(latest.generation());
        }
        self.check();
    }

    fn ack_all(&mut self) {
        let names: Vec<String> = self.shards.keys().cloned().collect();
        for name in names {
            if !self.shards[&name].stopped {
                self.ack(&name);
            }
        }
    }

    /// The sharder loses its leadership; the next leader starts from the ring's generation.
    fn new_leader(&mut self) {
        self.planner = RangeHandover::new(self.generation);
    }

    /// One sharder step, its writes applied; returns the written shards.
    fn step(&mut self, target: &BTreeMap<String, RangeSet>) -> BTreeSet<String> {
        let leases = self
            .shards
            .iter()
            .map(|(name, shard)| (name.clone(), shard.lease()))
            .collect();
        let plan = self.planner.plan(&leases, target);
        assert!(plan.generation >= self.generation, "generations only grow");
        self.generation = plan.generation;
        for (name, publication) in &plan.writes {
            let shard = self.shards.get_mut(name).expect("writes go to Leases");
            assert!(!shard.stopped, "{name}: no writes to a stopped shard");
            assert_eq!(publication.generation(), plan.generation);
            assert!(
                shard
                    .publications
                    .last()
                    .is_none_or(|last| last.generation() < publication.generation()),
                "{name}: a shard's generations only grow"
            );
            shard.publications.push(publication.clone());
        }
        let written = plan.writes.keys().cloned().collect();
        self.steps.push(plan);
        self.check();
        written
    }

    /// No hash is held by two shards.
    fn check(&self) {
        let holds: Vec<(&String, RangeSet)> = self
            .shards
            .iter()
            .map(|(name, shard)| (name, shard.holds()))
            .collect();
        for (i, (a, held_a)) in holds.iter().enumerate() {
            for (b, held_b) in &holds[i + 1..] {
                let both = intersection(held_a, held_b);
                assert!(both.is_empty(), "{a} and {b} both hold {both:?}");
            }
        }
    }

    fn published(&self, name: &str) -> RangeSet {
        self.shards[name]
            .publications
            .last()
            .map(|p| p.ranges().clone())
            .unwrap_or_default()
    }

    fn last_plan(&self) -> &RangePlan {
        self.steps.last().expect("a step was taken")
    }

    /// Steps and acknowledges until the plan is settled; every running shard then has its target
    /// published, acknowledged and nothing else held. Returns the number of steps.
    fn converge(&mut self, target: &BTreeMap<String, RangeSet>) -> usize {
        for round in 1..=10 {
            self.step(target);
            if self.last_plan().settled {
                for (name, shard) in &self.shards {
                    if shard.stopped {
                        continue;
                    }
                    let goal = target.get(name).cloned().unwrap_or_default();
                    assert_eq!(self.published(name), goal, "{name}");
                    assert_eq!(shard.holds(), goal, "{name}");
                }
                return round;
            }
            self.ack_all();
        }
        panic!("no convergence in 10 rounds");
    }
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(ToString::to_string).collect()
}

/// A ring of `shards` whose ranges are published and acknowledged.
fn settled(shards: &[&str]) -> World {
    let mut world = World::with(shards);
    let rounds = world.converge(&unweighted(shards));
    // Nobody holds anything at first: everything is granted in one step, acknowledged, settled.
    assert_eq!(rounds, 2);
    world
}

#[test]
fn range_set_operations() {
    let set = |ranges: &[(u64, u128)]| {
        RangeSet::new(
            ranges
                .iter()
                .map(|&(s, e)| HashRange::new(s, e).expect("a valid range")),
        )
    };
    let a = set(&[(0, 10), (20, 30), (40, SPACE_END)]);
    let b = set(&[(5, 25), (28, 45)]);
    assert_eq!(
        intersection(&a, &b),
        set(&[(5, 10), (20, 25), (28, 30), (40, 45)])
    );
    assert_eq!(union(&a, &b), set(&[(0, SPACE_END)]));
    assert_eq!(complement(&a), set(&[(10, 20), (30, 40)]));
    assert_eq!(complement(&RangeSet::empty()), RangeSet::full());
    assert_eq!(complement(&RangeSet::full()), RangeSet::empty());
    assert!(is_subset(&set(&[(5, 10), (50, 60)]), &a));
    assert!(!is_subset(&set(&[(5, 11)]), &a));
    assert!(is_subset(&RangeSet::empty(), &RangeSet::empty()));
}

#[test]
fn scale_out_revokes_then_grants() {
    let mut world = settled(&["a", "b", "c"]);
    let before = world.generation;
    let four = unweighted(&["a", "b", "c", "d"]);
    world.start("d");

    // Step 1: each old shard keeps what it keeps (A(s) ∩ B(s) = B(s) here); d gets nothing yet.
    assert_eq!(world.step(&four), names(&["a", "b", "c"]));
    assert_eq!(world.generation, before + 1);
    for shard in ["a", "b", "c"] {
        assert_eq!(world.published(shard), four[shard]);
    }
    // Step 2: until every loser acknowledged, d waits.
    assert_eq!(world.step(&four), names(&[]));
    world.ack("a");
    world.ack("b");
    assert_eq!(world.step(&four), names(&[]));
    world.ack("c");
    // Step 3: the grant.
    assert_eq!(world.step(&four), names(&["d"]));
    assert_eq!(world.generation, before + 2);
    assert_eq!(world.published("d"), four["d"]);
    assert!(!world.last_plan().settled);
    world.ack("d");
    world.step(&four);
    assert!(world.last_plan().settled);
}

#[test]
fn scale_in_waits_for_a_live_loser() {
    let mut world = settled(&["a", "b", "c", "d"]);
    let three = unweighted(&["a", "b", "c"]);
    // d leaves the ring but still runs: it loses everything, the others wait.
    assert_eq!(world.step(&three), names(&["d"]));
    assert_eq!(world.published("d"), RangeSet::empty());
    assert_eq!(world.step(&three), names(&[]));
    world.ack("d");
    assert_eq!(world.step(&three), names(&["a", "b", "c"]));
    for shard in ["a", "b", "c"] {
        assert_eq!(world.published(shard), three[shard]);
    }
    world.ack_all();
    world.step(&three);
    assert!(world.last_plan().settled);
}

#[test]
fn scale_in_grants_a_stopped_shards_ranges_at_once() {
    let mut world = settled(&["a", "b", "c", "d"]);
    let three = unweighted(&["a", "b", "c"]);
    world.stop("d");
    assert_eq!(world.step(&three), names(&["a", "b", "c"]));
    for shard in ["a", "b", "c"] {
        assert_eq!(world.published(shard), three[shard]);
    }
    assert_eq!(world.converge(&three), 2);
}

#[test]
fn a_shard_that_never_acknowledges_holds_the_grant_until_it_stops() {
    let mut world = settled(&["a", "b", "c"]);
    let four = unweighted(&["a", "b", "c", "d"]);
    world.start("d");
    world.step(&four);
    world.ack("a");
    world.ack("b");
    for _ in 0..5 {
        assert_eq!(world.step(&four), names(&[]), "d waits for c");
    }
    // c's Lease is released or taken over: it can no longer be running; it leaves the ring.
    world.stop("c");
    let without_c = unweighted(&["a", "b", "d"]);
    assert_eq!(world.step(&without_c), names(&["a", "b", "d"]));
    assert_eq!(world.published("d"), without_c["d"]);
    world.converge(&without_c);
}

#[test]
fn a_target_changing_mid_handover_starts_over_from_what_shards_hold() {
    let three = unweighted(&["a", "b", "c"]);
    let four = unweighted(&["a", "b", "c", "d"]);

    // d joins and leaves again before anyone acknowledged: a, b and c never lost anything (they
    // hold their acknowledged ranges until they acknowledge), so they get them back at once.
    let mut world = settled(&["a", "b", "c"]);
    world.start("d");
    world.step(&four);
    assert_eq!(world.step(&three), names(&["a", "b", "c"]));
    for shard in ["a", "b", "c"] {
        assert_eq!(world.published(shard), three[shard]);
    }
    world.converge(&three);
    assert_eq!(world.published("d"), RangeSet::empty());

    // d joins; a acknowledges; then d leaves and e joins. a's acknowledged set lacks what it gave
    // d, the others still hold theirs, and e must wait for all of them.
    let mut world = settled(&["a", "b", "c"]);
    world.start("d");
    world.step(&four);
    world.ack("a");
    world.start("e");
    let with_e = unweighted(&["a", "b", "c", "e"]);
    let written = world.step(&with_e);
    assert!(!written.contains("e"), "e waits: {written:?}");
    world.ack("b");
    world.ack("c");
    world.converge(&with_e);
}

#[test]
fn weights_move_ranges_only_after_the_loser_acknowledges() {
    let mut world = settled(&["a", "b"]);
    let heavier = target(&[("a", 1), ("b", 3)]);
    assert!(heavier["b"].width() > 2 * heavier["a"].width());
    // a loses, b gains: a is revoked first, b waits for it.
    assert_eq!(world.step(&heavier), names(&["a"]));
    assert_eq!(world.published("a"), heavier["a"]);
    assert_eq!(world.step(&heavier), names(&[]));
    world.ack("a");
    assert_eq!(world.step(&heavier), names(&["b"]));
    assert_eq!(world.published("b"), heavier["b"]);
    world.converge(&heavier);
}

#[test]
fn a_new_leader_waits_for_acknowledgements_it_cannot_account_for() {
    let mut world = settled(&["a", "b", "c"]);
    let generation = world.generation;
    let four = unweighted(&["a", "b", "c", "d"]);
    world.start("d");
    world.step(&four);
    world.new_leader();
    world.ack("a");
    world.ack("b");
    // The new leader does not know what c held before its revoke, so d still waits.
    assert_eq!(world.step(&four), names(&[]));
    world.ack("c");
    assert_eq!(world.step(&four), names(&["d"]));
    assert_eq!(world.generation, generation + 2, "the count goes on");
    world.converge(&four);
}

#[test]
fn a_shard_taking_its_lease_again_starts_with_nothing() {
    let mut world = settled(&["a", "b", "c"]);
    world.stop("c");
    let two = unweighted(&["a", "b"]);
    world.converge(&two);
    // c comes back with a new holding: a newcomer, granted only after a and b gave way.
    world.start("c");
    let three = unweighted(&["a", "b", "c"]);
    assert_eq!(world.step(&three), names(&["a", "b"]));
    world.ack_all();
    assert_eq!(world.step(&three), names(&["c"]));
    world.converge(&three);
}

#[test]
fn unknown_acknowledgements_do_not_count() {
    let mut world = settled(&["a", "b"]);
    let three = unweighted(&["a", "b", "c"]);
    world.start("c");
    world.step(&three);
    // a writes a generation that was never published to it, b an older one.
    world.shards.get_mut("a").expect("a").acknowledged = Some(world.generation + 5);
    world.shards.get_mut("b").expect("b").acknowledged = Some(1);
    assert_eq!(world.step(&three), names(&[]));
    world.ack_all();
    assert_eq!(world.step(&three), names(&["c"]));
}

/// What happens in the simulated ring.
#[derive(Clone, Debug)]
enum Event {
    /// The shard takes its Lease (again, if it had stopped) and joins with a weight.
    Join(usize, u32),
    /// The shard leaves the ring but keeps running.
    Leave(usize),
    /// The shard can no longer be running.
    Stop(usize),
    /// The shard acknowledges its latest publication.
    Ack(usize),
    /// The shard acknowledges an earlier publication it had read, not yet the latest.
    AckEarlier(usize, prop::sample::Index),
    /// A sharder step.
    Step,
    /// A new sharder leader.
    NewLeader,
}

const POOL: [&str; 5] = ["s0", "s1", "s2", "s3", "s4"];

fn events() -> impl Strategy<Value = Vec<Event>> {
    let shard = 0..POOL.len();
    proptest::collection::vec(
        prop_oneof![
            2 => (shard.clone(), 1..=3u32).prop_map(|(s, w)| Event::Join(s, w)),
            1 => shard.clone().prop_map(Event::Leave),
            1 => shard.clone().prop_map(Event::Stop),
            4 => shard.clone().prop_map(Event::Ack),
            1 => (shard, any::<prop::sample::Index>()).prop_map(|(s, i)| Event::AckEarlier(s, i)),
            5 => Just(Event::Step),
            1 => Just(Event::NewLeader),
        ],
        0..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Random joins, leaves, stops, acknowledgements and leader changes: after every event no
    /// hash is held by two shards (`World::check`), and once everyone acknowledges, the ring
    /// settles on its target.
    #[test]
    fn no_hash_is_ever_held_twice_and_the_ring_settles(events in events()) {
        let mut world = World::default();
        let mut members: BTreeMap<&str, u32> = BTreeMap::new();
        for event in events {
            match event {
                Event::Join(i, weight) => {
                    let name = POOL[i];
                    if world.shards.get(name).is_none_or(|s| s.stopped) {
                        world.start(name);
                    }
                    members.insert(name, weight);
                }
                Event::Leave(i) => {
                    members.remove(POOL[i]);
                }
                Event::Stop(i) => {
                    if world.shards.contains_key(POOL[i]) {
                        world.stop(POOL[i]);
                    }
                    members.remove(POOL[i]);
                }
                Event::Ack(i) => {
                    if world.shards.get(POOL[i]).is_some_and(|s| !s.stopped) {
                        world.ack(POOL[i]);
                    }
                }
                Event::AckEarlier(i, pick) => {
                    if let Some(shard) = world.shards.get_mut(POOL[i]).filter(|s| !s.stopped) {
                        let acknowledged = shard.acknowledged.unwrap_or(0);
                        let newer: Vec<u64> = shard
                            .publications
                            .iter()
                            .map(PublishedRanges::generation)
                            .filter(|&g| g >= acknowledged)
                            .collect();
                        if !newer.is_empty() {
                            shard.acknowledged = Some(newer[pick.index(newer.len())]);
                        }
                        world.check();
                    }
                }
                Event::Step => {
                    world.step(&target(&members.iter().map(|(n, w)| (*n, *w)).collect::<Vec<_>>()));
                }
                Event::NewLeader => world.new_leader(),
            }
        }
        world.converge(&target(&members.iter().map(|(n, w)| (*n, *w)).collect::<Vec<_>>()));
    }
}

#[test]
fn a_shard_that_never_acknowledges_costs_bounded_memory() {
    let mut world = settled(&["a", "b", "c"]);
    let three = unweighted(&["a", "b", "c"]);
    let four = unweighted(&["a", "b", "c", "d"]);
    world.start("d");
    // d comes and goes while c never acknowledges: c keeps getting publications, and what the
    // planner remembers of them stays bounded while every step stays safe (`World::check`).
    for round in 0..3 * MAX_REMEMBERED {
        world.step(if round % 2 == 0 { &four } else { &three });
        for shard in ["a", "b", "d"] {
            world.ack(shard);
        }
    }
    assert!(world.shards["c"].publications.len() > MAX_REMEMBERED);
    assert!(world.planner.remembered["c"].len() <= MAX_REMEMBERED);
    world.converge(&four);
}

#[test]
fn publications_beyond_the_limit_are_cut_to_a_subset() {
    let count = u64::try_from(MAX_PUBLISHED_RANGES).expect("small") + 100;
    let fragmented = RangeSet::new(
        (0..count).map(|i| HashRange::new(4 * i, u128::from(4 * i + 1)).expect("a valid range")),
    );
    let cut = within_limit(fragmented.clone());
    assert_eq!(cut.ranges().len(), MAX_PUBLISHED_RANGES);
    assert!(is_subset(&cut, &fragmented));
    assert_eq!(within_limit(RangeSet::full()), RangeSet::full());
}
