//! Revoke before grant: which range annotations the sharder writes on shard Leases of a
//! zero-write ring, so that no hash is ever held by two shards (docs/zero-write-rings.md,
//! "Revoke before grant"). Pure: Lease contents and the target assignment in, writes
//! out. The ring controller runs it for each `assignment: ServerSide` ring
//! (`controller::ranges`).
//!
//! A shard **holds** a hash from the moment a publication containing it is written to its Lease
//! until it acknowledges a generation without it: it may already run with a publication it has
//! not acknowledged, and it stops work outside its ranges only before it acknowledges. So a
//! shard holds the union of the ranges of its acknowledged generation and of every publication
//! after it. A shard that can no longer be running (its Lease released or taken over, judged as
//! for direct moves, docs/protocol.md §4) holds nothing.
//!
//! Each step, for every shard that may be running and whose published ranges differ from its
//! target `B(s)`:
//!
//! - if no other shard may hold a hash of `B(s)`, publish `B(s)` (a grant; for a shard that only
//!   loses, this is the revoke `A(s) ∩ B(s)` of the design);
//! - otherwise, if it was published ranges outside `B(s)`, publish what it holds within `B(s)`
//!   (a revoke: it gains nothing, drops what the target gives others);
//! - otherwise wait: the shards holding parts of `B(s)` have to acknowledge (or stop running)
//!   first.
//!
//! A scale-out thus revokes from the shards the newcomer takes from, waits for their
//! acknowledgements and then grants, the two steps of the design; a target that changes
//! mid-handover starts over from what each shard holds, and nothing waits for a shard whose
//! holdings do not touch the ranges in question.
//!
//! The planner remembers what it published since each shard's last acknowledgement, because the
//! Lease shows only the latest publication. A new planner (a new sharder leader) does not know
//! what a shard with an unacknowledged publication still holds, so it counts such a shard as
//! holding everything until it acknowledges or stops running: slower, never unsafe.
//!
//! The caller's part: each step sees the Leases as they are after the previous step's writes;
//! `published` and `acknowledged` are those of the shard's current holding of its Lease (a shard
//! that takes its Lease again starts with neither: it ignores annotations written before, and
//! gets ranges like any newcomer); every shard whose Lease may still be held is passed.

use std::collections::BTreeMap;

use kube_sharding_api::range_lease::{MAX_PUBLISHED_RANGES, PublishedRanges};
use kube_sharding_api::ranges::{HashRange, RangeSet, SPACE_END};

/// What the Lease of one shard says, as far as the handover needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ShardRanges {
    /// The ranges annotation written for the current holding, if any.
    pub published: Option<PublishedRanges>,
    /// The generation the shard acknowledged in the current holding, if any.
    pub acknowledged: Option<u64>,
    /// The shard can no longer be running: its Lease was released, or taken over by the sharder.
    pub stopped: bool,
}

/// The writes of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RangePlan {
    /// The ring's generation after this step: the one every write carries, or the previous one
    /// when nothing is written.
    pub generation: u64,
    /// The ranges annotation to write, by shard.
    pub writes: BTreeMap<String, PublishedRanges>,
    /// Whether every running shard has its target published and acknowledged (and no write is
    /// needed).
    pub settled: bool,
}

/// Publications longer than this many entries since a shard's acknowledgement are folded
/// together, so that a shard that never acknowledges costs bounded memory.
const MAX_REMEMBERED: usize = 8;

/// What a shard holds, as the planner knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Held {
    Known(RangeSet),
    /// It has an unacknowledged publication whose predecessors this planner did not see.
    Unknown,
}

/// The revoke-before-grant planner of one ring.
#[derive(Clone, Debug, Default)]
pub(crate) struct RangeHandover {
    /// The ring's latest generation (`status.rangeGeneration`).
    generation: u64,
    /// Per shard, the publications since its last acknowledged one (first) up to the latest;
    /// an acknowledgement of generation `a` means holding the entries from the last one at or
    /// below `a` on. Generation 0 with no ranges marks the start of a holding.
    remembered: BTreeMap<String, Vec<(u64, RangeSet)>>,
}

impl RangeHandover {
    /// A planner continuing from the ring's recorded generation.
    pub(crate) fn new(generation: u64) -> Self {
        Self {
            generation,
            remembered: BTreeMap::new(),
        }
    }

    /// Decides this step's writes from every shard's Lease (`shards`) and the target assignment
    /// (`target`, each available shard's ranges, e.g. from a `RangeRing`; shards without a Lease
    /// in `shards` are skipped). The planner assumes the writes are made before the next step.
    pub(crate) fn plan(
        &mut self,
        shards: &BTreeMap<String, ShardRanges>,
        target: &BTreeMap<String, RangeSet>,
    ) -> RangePlan {
        self.remembered.retain(|name, _| shards.contains_key(name));
        let held: BTreeMap<&str, Held> = shards
            .iter()
            .map(|(name, shard)| (name.as_str(), self.observe(name, shard)))
            .collect();
        let latest = shards
            .values()
            .filter_map(|s| s.published.as_ref().map(PublishedRanges::generation))
            .chain(self.remembered.values().flatten().map(|(g, _)| *g))
            .fold(self.generation, u64::max);
        self.generation = latest;

        let empty = RangeSet::empty();
        let mut wanted: BTreeMap<&str, RangeSet> = BTreeMap::new();
        let mut settled = true;
        for (name, shard) in shards {
            if shard.stopped {
                continue;
            }
            let goal = target.get(name).unwrap_or(&empty);
            let published = shard.published.as_ref().map_or(&empty, |p| p.ranges());
            if published == goal {
                settled &= shard.published.is_none()
                    || shard.acknowledged == shard.published.as_ref().map(|p| p.generation());
                continue;
            }
            settled = false;
            // Nobody else may hold any of it, nor be granted it in this step (targets of one ring
            // never overlap, but the planner does not rely on it).
            let others_clear = held.iter().all(|(other, holds)| {
                *other == name.as_str()
                    || match holds {
                        Held::Known(set) => intersection(set, goal).is_empty(),
                        Held::Unknown => false,
                    }
            }) && wanted
                .values()
                .all(|granted| intersection(granted, goal).is_empty());
            if others_clear {
                wanted.insert(name, goal.clone());
            } else if !is_subset(published, goal) {
                // Keep what it holds within its target: dropping and later regaining it would
                // only lengthen the handover. Without knowing its holdings, its latest ranges
                // are a safe subset of them.
                let keep = match &held[name.as_str()] {
                    Held::Known(set) => set,
                    Held::Unknown => published,
                };
                wanted.insert(name, intersection(keep, goal));
            }
        }

        if wanted.is_empty() {
            return RangePlan {
                generation: self.generation,
                writes: BTreeMap::new(),
                settled,
            };
        }
        // 2^64 writes are out of reach; were they not, stopping beats reusing a generation.
        let Some(generation) = self.generation.checked_add(1) else {
            return RangePlan {
                generation: self.generation,
                writes: BTreeMap::new(),
                settled: false,
            };
        };
        self.generation = generation;
        let mut writes = BTreeMap::new();
        for (name, ranges) in wanted {
            let publication = PublishedRanges::new(generation, within_limit(ranges))
                .expect("within_limit keeps the count allowed");
            if let Some(history) = self.remembered.get_mut(name) {
                history.push((generation, publication.ranges().clone()));
                if history.len() > MAX_REMEMBERED {
                    // Folding the second entry into the first keeps every lookup a superset.
                    let (_, second) = history.remove(1);
                    history[0].1 = union(&history[0].1, &second);
                }
            }
            writes.insert(name.to_string(), publication);
        }
        RangePlan {
            generation,
            writes,
            settled: false,
        }
    }

    /// What `shard` holds, updating what the planner remembers of it.
    fn observe(&mut self, name: &str, shard: &ShardRanges) -> Held {
        if shard.stopped {
            self.remembered.remove(name);
            return Held::Known(RangeSet::empty());
        }
        let Some(published) = &shard.published else {
            self.remembered
                .insert(name.to_string(), vec![(0, RangeSet::empty())]);
            return Held::Known(RangeSet::empty());
        };
        let latest = (published.generation(), published.ranges().clone());
        if shard.acknowledged == Some(latest.0) {
            let held = Held::Known(latest.1.clone());
            self.remembered.insert(name.to_string(), vec![latest]);
            return held;
        }
        let acknowledged = shard.acknowledged.unwrap_or(0);
        let known = self.remembered.get_mut(name).and_then(|history| {
            if history.last() != Some(&latest) || acknowledged > latest.0 {
                return None;
            }
            let from = history.iter().rposition(|(g, _)| *g <= acknowledged)?;
            history.drain(..from);
            Some(
                history
                    .iter()
                    .fold(RangeSet::empty(), |all, (_, set)| union(&all, set)),
            )
        });
        match known {
            Some(set) => Held::Known(set),
            None => {
                // Its history is not ours: a previous leader's, or a write we did not make.
                self.remembered.remove(name);
                Held::Unknown
            }
        }
    }
}

/// `set`, or its first [`MAX_PUBLISHED_RANGES`] ranges: a subset is always safe to publish (the
/// rest stays unowned) and only fragmentation far beyond any ring's weights could need it.
fn within_limit(set: RangeSet) -> RangeSet {
    if set.ranges().len() <= MAX_PUBLISHED_RANGES {
        return set;
    }
    RangeSet::new(set.ranges()[..MAX_PUBLISHED_RANGES].iter().copied())
}

/// The hashes in both sets.
pub(crate) fn intersection(a: &RangeSet, b: &RangeSet) -> RangeSet {
    let (a, b) = (a.ranges(), b.ranges());
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::new();
    while i < a.len() && j < b.len() {
        let start = a[i].start().max(b[j].start());
        let end = a[i].end().min(b[j].end());
        out.extend(HashRange::new(start, end));
        // Advance whichever ends first; the other may still overlap the next range.
        if a[i].end() < b[j].end() {
            i += 1;
        } else {
            j += 1;
        }
    }
    RangeSet::new(out)
}

/// The hashes in either set.
pub(crate) fn union(a: &RangeSet, b: &RangeSet) -> RangeSet {
    RangeSet::new(a.ranges().iter().chain(b.ranges()).copied())
}

/// The hashes outside `set`.
fn complement(set: &RangeSet) -> RangeSet {
    let mut out = Vec::new();
    let mut from: u128 = 0;
    for range in set.ranges() {
        if let Ok(start) = u64::try_from(from) {
            out.extend(HashRange::new(start, u128::from(range.start())));
        }
        from = range.end();
    }
    if let Ok(start) = u64::try_from(from) {
        out.extend(HashRange::new(start, SPACE_END));
    }
    RangeSet::new(out)
}

/// Whether every hash of `a` is in `b`.
pub(crate) fn is_subset(a: &RangeSet, b: &RangeSet) -> bool {
    intersection(a, &complement(b)).is_empty()
}

#[cfg(test)]
mod tests;
