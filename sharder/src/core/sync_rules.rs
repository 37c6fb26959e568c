//! The rules of one sync of a ring that need no I/O (docs/protocol.md §9): the order it walks
//! the ring's resources in, whether controlled objects go first, what each listed object counts
//! for and whether a controlled object waits for its controller, and what the sync's counts make
//! of its result. The sharder controller's `sync` lists, patches and publishes around them.

use std::collections::BTreeMap;

use kube_sharding_api::{GroupResource, HashKey};

use crate::core::key::KeyOutcome;
use crate::core::owner_wait::OwnerWait;
use crate::core::rebalance::{Placement, RebalanceDecision};

/// Counts of one ring's objects from its latest complete listing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RingObjects {
    /// Objects carrying each shard's label, by shard and resource.
    pub(crate) per_shard: BTreeMap<(String, GroupResource), u64>,
    /// Objects the ring should assign that carry no shard label, by resource.
    pub(crate) unassigned: BTreeMap<GroupResource, u64>,
    /// Objects a pin applies to, by what it did: `honoured`, `unavailable` (its shard is not
    /// available) or `invalid` (its value names no shard).
    pub(crate) pins: BTreeMap<&'static str, u64>,
}

/// Counts of one sync.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SyncStats {
    /// Objects listed.
    pub(crate) listed: usize,
    /// Drain patches sent.
    pub(crate) drained: usize,
    /// Move patches sent.
    pub(crate) moved: usize,
    /// Patches that failed.
    pub(crate) failed: usize,
    /// Moves not sent because the ring's webhook is unreachable.
    pub(crate) held: usize,
}

/// The ring's resources (`is_main` tells a main one) in the order a sync walks them: main
/// resources first, then controlled ones, each by group and name; controlled ones first when
/// `children_first`.
///
/// Main objects must start draining before their controlled objects move: a controlled object
/// moved while its owner still sits on the old shard is written back by that shard. Walked first,
/// controlled objects on available shards are all held back, to move as the watch of drained
/// controllers sees theirs leave (see [`children_first`]).
pub(crate) fn sync_order<'a, R>(
    resources: impl IntoIterator<Item = (&'a GroupResource, &'a R)>,
    is_main: impl Fn(&R) -> bool,
    children_first: bool,
) -> Vec<(&'a GroupResource, &'a R)> {
    let mut resources: Vec<_> = resources.into_iter().collect();
    resources.sort_by_key(|(gr, resource)| {
        (
            is_main(resource) == children_first,
            gr.group.as_str(),
            gr.resource.as_str(),
        )
    });
    resources
}

/// Whether a sync walks the controlled resources first and hands each held child to the watch
/// of drained controllers as it goes, so that children move as their controllers' drains are
/// acknowledged while the sync still drains others: only where the shards leave their controlled
/// objects to the sharder (`shards_leave_controlled_objects`: every available shard's Lease says
/// so, or `controller.sharder.shardsLeaveControlledObjects` is set; shards that relabel them
/// would race these moves), in rings hashed by object, where a key names one controller, so that
/// seeing it leave the child's shard frees the child, and with controlled resources at all. In
/// rings hashed by namespace several main objects share a key, and children are handed over only
/// after every drain was answered.
pub(crate) fn children_first(
    shards_leave_controlled_objects: bool,
    hash_key: HashKey,
    has_controlled: bool,
) -> bool {
    shards_leave_controlled_objects && hash_key == HashKey::Object && has_controlled
}

/// What one sync learns from the objects it lists: the counts for the metrics, and where the
/// misplaced controllers sit, which decides whether a controlled object waits for its
/// controller.
#[derive(Debug, Default)]
pub(crate) struct ObjectTally {
    /// Objects per shard, unassigned and pinned ones.
    pub(crate) objects: RingObjects,
    /// Misplaced controllers and the controlled objects held back for them.
    pub(crate) owner_wait: OwnerWait,
    /// Whether controlled objects are walked before the main ones ([`children_first`]).
    children_first: bool,
}

/// What an [`ObjectTally`] had counted when a list started: restored when the list starts over
/// from its first page, so that its objects are not counted twice.
#[derive(Clone, Debug)]
pub(crate) struct Checkpoint {
    objects: RingObjects,
    waiting: usize,
    held: usize,
}

impl ObjectTally {
    /// An empty tally for a ring hashed by `hash_key`, walking the controlled resources first
    /// when `children_first`.
    pub(crate) fn new(hash_key: HashKey, children_first: bool) -> Self {
        Self {
            objects: RingObjects::default(),
            owner_wait: OwnerWait::new(hash_key),
            children_first,
        }
    }

    /// Counts the listed object `name` (in `namespace`) of resource `gr` (a main resource when
    /// `main`), which stands at `placement` in the ring, and returns what the sync does with it:
    /// its placement's decision, or [`RebalanceDecision::Keep`] for a controlled object held back
    /// until its controller has left its shard (`may_be_running` tells the shards that may still
    /// reconcile it).
    ///
    /// A controlled object's key is its controller's key (with namespace keys, its
    /// namespace's): main resources are counted first, so its controller was seen already if it
    /// is listed; walking controlled objects first, every one on a shard that may be running is
    /// held.
    pub(crate) fn count(
        &mut self,
        gr: &GroupResource,
        main: bool,
        (namespace, name): (Option<&str>, &str),
        placement: &Placement<'_>,
        may_be_running: impl Fn(&str) -> bool,
    ) -> RebalanceDecision {
        let current = placement.object.current;
        if let Some(state) = placement.pin.state() {
            *self.objects.pins.entry(state).or_default() += 1;
        }
        let key = match &placement.key {
            Ok(KeyOutcome::Key(key)) => Some(key),
            _ => None,
        };
        match current {
            Some(shard) => {
                *self
                    .objects
                    .per_shard
                    .entry((shard.to_string(), gr.clone()))
                    .or_default() += 1;
            }
            None if key.is_some() => {
                *self.objects.unassigned.entry(gr.clone()).or_default() += 1;
            }
            None => {}
        }
        let Some(key) = key else {
            return placement.decision;
        };
        if main {
            let leaving =
                placement.object.draining || placement.decision == RebalanceDecision::Drain;
            self.owner_wait
                .main_listed(key, current, placement.desired, leaving);
            return placement.decision;
        }
        let held = placement.decision == RebalanceDecision::Move
            && if self.children_first {
                self.owner_wait
                    .holds_back_unseen(current, placement.desired, &may_be_running)
            } else {
                self.owner_wait
                    .holds_back(key, current, placement.desired, &may_be_running)
            };
        if !held {
            return placement.decision;
        }
        if let (Some(shard), Some(desired)) = (current, placement.desired) {
            self.owner_wait
                .remember(key, gr, namespace, name, (shard, desired));
        }
        RebalanceDecision::Keep
    }

    /// What the tally has counted so far.
    pub(crate) fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            objects: self.objects.clone(),
            waiting: self.owner_wait.waiting,
            held: self.owner_wait.held_len(),
        }
    }

    /// Forgets what was counted since `checkpoint`.
    pub(crate) fn rewind(&mut self, checkpoint: &Checkpoint) {
        self.objects = checkpoint.objects.clone();
        self.owner_wait.waiting = checkpoint.waiting;
        self.owner_wait.truncate_held(checkpoint.held);
    }
}

/// What a sync that listed every resource makes of its counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Every object is where the ring wants it, or on its way.
    Synced,
    /// Some patches failed; the sync runs again after a backoff.
    PatchesFailed {
        /// Failed patches.
        failed: usize,
        /// Attempted patches.
        attempted: usize,
    },
    /// Moves were held back because the ring's webhook is unreachable.
    Held {
        /// Moves not sent.
        held: usize,
    },
    /// Controlled objects wait for their controllers to leave their shard.
    Waiting {
        /// Controlled objects held back.
        waiting: usize,
    },
}

/// The outcome of a sync that listed every resource with `stats`, having held back `waiting`
/// controlled objects: failed patches first (they may have left controllers in place), then
/// moves held for the webhook, then children waiting.
pub(crate) fn outcome(stats: &SyncStats, waiting: usize) -> Outcome {
    if stats.failed > 0 {
        Outcome::PatchesFailed {
            failed: stats.failed,
            attempted: stats.drained + stats.moved + stats.failed,
        }
    } else if stats.held > 0 {
        Outcome::Held { held: stats.held }
    } else if waiting > 0 {
        Outcome::Waiting { waiting }
    } else {
        Outcome::Synced
    }
}

#[cfg(test)]
mod tests;
