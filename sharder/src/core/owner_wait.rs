//! Which controlled objects a sync holds back until their controller has left their shard.
//!
//! A controlled object moved while its controller still sits on the old shard is written back by
//! that shard, which still reconciles the controller until it acknowledges its drain. A sync walks
//! main resources first, so by the time it meets a controlled object it has seen the controller
//! if the controller is listed; this remembers where the misplaced controllers sit.
//!
//! The children a sync held back are remembered ([`HeldChildren`]) so that each moves the moment
//! its controller's drain is acknowledged, instead of at the next sync ([`Waiting`]).

use std::collections::{HashMap, HashSet};

use kube_sharding_api::{GroupResource, HashKey};

use crate::core::hash_ring::hash;
use crate::core::rebalance::waits_for_owner;

/// What one sync learned about controllers not yet on the shard the ring wants, and how many
/// controlled objects it held back for them.
///
/// With `hashKey: Object` a controlled object's key is its controller's, which names one main
/// object. With `hashKey: Namespace` every object of a namespace has the namespace's key, so a
/// controlled object waits while any main object of its namespace sits misplaced on its shard:
/// the whole namespace moves together, and its controller is among them.
#[derive(Debug, Default)]
pub(crate) struct OwnerWait {
    /// Whether keys name namespaces (several main objects per key) rather than objects.
    by_namespace: bool,
    /// Hash of each listed main object's key → hash of its shard label (0 without one) and
    /// whether it is leaving that shard (draining, or drained by this sync): only main objects
    /// not on the shard the ring wants (the others cannot hold anything back), as hashes, 17
    /// bytes each; a sync that moves nothing keeps it empty, however large the ring.
    owner_shards: HashMap<u64, (u64, bool)>,
    /// With namespace keys: (key hash, shard hash) of every misplaced main object.
    namespace_shards: HashSet<(u64, u64)>,
    /// Controlled objects held back so far.
    pub(crate) waiting: usize,
    /// The held-back objects not yet [taken](Self::take_held), in the order they were held, while
    /// the sync remembered at most [`MAX_REMEMBERED`]; `None` once it held more (they then wait
    /// for the next sync).
    pub(crate) held: Option<Vec<HeldChild>>,
    /// Held-back objects remembered so far, taken or not.
    remembered: usize,
}

/// Most held-back controlled objects one sync remembers (about 100 bytes each): beyond that they
/// wait for the next sync, as they would without the watch of drained controllers.
pub(crate) const MAX_REMEMBERED: usize = 100_000;

/// A controlled object a sync held back, with what it waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HeldChild {
    /// Its resource.
    pub(crate) resource: GroupResource,
    /// Its namespace, for namespaced resources.
    pub(crate) namespace: Option<String>,
    /// Its name.
    pub(crate) name: String,
    /// The shard it sits on, which its controller has to leave first.
    pub(crate) shard: String,
    /// The shard the sync wants it on: where its controller goes once it has left.
    pub(crate) desired: String,
    /// Hash of its hash key (its controller's, or its namespace's).
    key_hash: u64,
}

/// A (hash key, shard) pair as hashes: "a main object with this key sits on this shard".
type Blocker = (u64, u64);

impl OwnerWait {
    /// An empty record for a ring hashing by `hash_key`.
    pub(crate) fn new(hash_key: HashKey) -> Self {
        Self {
            by_namespace: hash_key == HashKey::Namespace,
            held: Some(Vec::new()),
            ..Self::default()
        }
    }

    /// Remembers a controlled object [`holds_back`](Self::holds_back) just held, with hash key
    /// `key`, sitting on `shard`, wanted on `desired`.
    pub(crate) fn remember(
        &mut self,
        key: &str,
        resource: &GroupResource,
        namespace: Option<&str>,
        name: &str,
        (shard, desired): (&str, &str),
    ) {
        self.remembered += 1;
        if self.remembered > MAX_REMEMBERED {
            self.held = None;
        }
        if let Some(held) = &mut self.held {
            held.push(HeldChild {
                resource: resource.clone(),
                namespace: namespace.map(str::to_owned),
                name: name.to_owned(),
                shard: shard.to_owned(),
                desired: desired.to_owned(),
                key_hash: hash(key),
            });
        }
    }

    /// Forgets what was held after the `len`th remembered object (a list that started over
    /// meets them again).
    pub(crate) fn truncate_held(&mut self, len: usize) {
        if let Some(held) = &mut self.held {
            held.truncate(len);
        }
    }

    /// Takes the held objects remembered since the last call, to be moved as their controllers
    /// leave; `None` once the sync held more than [`MAX_REMEMBERED`] (none is remembered then).
    pub(crate) fn take_held(&mut self) -> Option<Vec<HeldChild>> {
        self.held.as_mut().map(std::mem::take)
    }

    /// How many held objects are remembered, for [`truncate_held`](Self::truncate_held).
    pub(crate) fn held_len(&self) -> usize {
        self.held.as_ref().map_or(0, Vec::len)
    }

    /// Takes in a listed main object with hash key `key`, labelled for shard `current`, which the
    /// ring wants on `desired`; `leaving`: it carries the drain label or the sync drains it.
    pub(crate) fn main_listed(
        &mut self,
        key: &str,
        current: Option<&str>,
        desired: Option<&str>,
        leaving: bool,
    ) {
        let key_hash = hash(key);
        if self.by_namespace {
            // Another main object of the namespace in place says nothing about this one.
            if desired != current {
                self.namespace_shards
                    .insert((key_hash, current.map_or(0, hash)));
            }
        } else if desired == current {
            self.owner_shards.remove(&key_hash);
        } else {
            self.owner_shards
                .insert(key_hash, (current.map_or(0, hash), leaving));
        }
    }

    /// Whether a controlled object with hash key `key` (its controller's), labelled for shard
    /// `current`, that the sync would move towards `desired`, must wait for its controller; a
    /// held object is counted in [`OwnerWait::waiting`].
    pub(crate) fn holds_back(
        &mut self,
        key: &str,
        current: Option<&str>,
        desired: Option<&str>,
        is_available: impl Fn(&str) -> bool,
    ) -> bool {
        let owner_on_current = current.is_some_and(|shard| {
            if self.by_namespace {
                self.namespace_shards.contains(&(hash(key), hash(shard)))
            } else {
                self.owner_shards
                    .get(&hash(key))
                    .is_some_and(|(on, _)| *on == hash(shard))
            }
        });
        self.hold(current, owner_on_current, desired, is_available)
    }

    /// Whether a controlled object must wait as in [`holds_back`](Self::holds_back) when the sync
    /// has not listed the main resources yet: as if its controller sat on its shard. The
    /// following's [`Waiting::settle`] sorts these out once the main resources were listed.
    pub(crate) fn holds_back_unseen(
        &mut self,
        current: Option<&str>,
        desired: Option<&str>,
        is_available: impl Fn(&str) -> bool,
    ) -> bool {
        self.hold(current, true, desired, is_available)
    }

    /// [`waits_for_owner`], counting a held object in [`OwnerWait::waiting`].
    fn hold(
        &mut self,
        current: Option<&str>,
        owner_on_current: bool,
        desired: Option<&str>,
        is_available: impl Fn(&str) -> bool,
    ) -> bool {
        let wait = waits_for_owner(current, owner_on_current, desired, is_available);
        self.waiting += usize::from(wait);
        wait
    }

    /// What a held child waits for, now that every main object was listed. Only children-first
    /// syncs ask, and they run only in rings hashed by object, where a key names one controller.
    pub(crate) fn verdict(&self, child: &HeldChild) -> Verdict {
        debug_assert!(
            !self.by_namespace,
            "children go first only in rings hashed by object"
        );
        let shard = hash(&child.shard);
        match self.owner_shards.get(&child.key_hash) {
            Some((on, true)) if *on == shard => Verdict::Await,
            Some((on, false)) if *on == shard => Verdict::GiveUp,
            _ => Verdict::Free,
        }
    }
}

/// What a child held before the main objects were listed waits for, once they were.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Its controller does not sit on its shard: it may move.
    Free,
    /// Its controller sits on its shard and is leaving it: the child moves when it has left.
    Await,
    /// Its controller sits on its shard and was not drained (a newer view will decide): the
    /// next sync looks at the child again.
    GiveUp,
}

/// The controlled objects a sync held back, waiting for the main objects in their way to leave
/// their shards.
///
/// A child waits while a main object with its hash key carrying the drain label sits on the
/// child's shard (with namespace keys: any main object of its namespace). The sync holds a child
/// back only when its controller sits misplaced on the child's shard, and every such controller
/// leaves that sync draining (or moved), so watching the drain-labelled main objects tells when
/// each child may go: [`draining`](Self::draining) for each of them as the watch lists or sees
/// it, [`gone`](Self::gone) when it is deleted or loses the drain label (acknowledged), and
/// [`released`](Self::released) for what may move.
///
/// A watch that lists after every drain of the sync was answered sees each drained object that has
/// not acknowledged yet, so a (key, shard) with none of them frees its children. A watch that
/// started before the drains ([`Waiting::evidence_only`]) may not have seen a drain yet; then a
/// child moves only once the watch has seen a main object at its (key, shard) leave the set and
/// none is left there, or once the sync, having listed every main object, finds its controller
/// elsewhere ([`settle`](Self::settle)).
#[derive(Debug, Default)]
pub(crate) struct Waiting {
    /// Held children by the (key, shard) they wait on.
    held: HashMap<Blocker, Vec<HeldChild>>,
    /// Drain-labelled main objects, by UID hash: the watch they came from and where they sit.
    draining: HashMap<u64, (usize, Blocker)>,
    /// How many drain-labelled main objects sit at each (key, shard).
    blockers: HashMap<Blocker, usize>,
    /// Whether only what the watch saw leave frees a child (see the type's documentation).
    evidence_only: bool,
    /// Every (key, shard) the watch saw a drain-labelled main object leave, none left there then.
    left: HashSet<Blocker>,
    /// Whether the sync has listed every main object and said what each child waits for.
    settled: bool,
    /// Whether the watch listed again before that, so it may have missed a drain and its
    /// acknowledgement in between.
    history_lost: bool,
}

impl Waiting {
    /// For a watch that started before the sync's drains.
    pub(crate) fn evidence_only() -> Self {
        Self {
            evidence_only: true,
            ..Self::default()
        }
    }

    /// Whether the children waiting on `blocker` may move, given whether every watch has listed.
    fn free(&self, blocker: &Blocker, listed: bool) -> bool {
        !self.blockers.contains_key(blocker)
            && if self.evidence_only {
                self.left.contains(blocker)
            } else {
                listed
            }
    }

    /// Takes in more held children, as a sync holds them; once every watch has listed
    /// (`listed`), returns those of them that wait on nothing, which may move at once.
    pub(crate) fn add(&mut self, children: Vec<HeldChild>, listed: bool) -> Vec<HeldChild> {
        let mut free = Vec::new();
        for child in children {
            let blocker = (child.key_hash, hash(&child.shard));
            if self.free(&blocker, listed) {
                free.push(child);
            } else {
                self.held.entry(blocker).or_default().push(child);
            }
        }
        free
    }

    /// Children still waiting.
    pub(crate) fn len(&self) -> usize {
        self.held.values().map(Vec::len).sum()
    }

    /// Whether no child waits any more.
    pub(crate) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Takes in a main object (UID `uid`) carrying the drain label, with hash key `key`, on
    /// `shard`, as the watch `source` listed or saw it.
    pub(crate) fn draining(&mut self, source: usize, uid: &str, key: &str, shard: &str) {
        let blocker = (hash(key), hash(shard));
        if let Some((_, old)) = self.draining.insert(hash(uid), (source, blocker)) {
            self.unblock(old);
        }
        *self.blockers.entry(blocker).or_default() += 1;
    }

    /// Takes in that a main object left the drain-labelled set (its drain was acknowledged, or it
    /// was deleted). Returns the children that may move now, all of them waiting on nothing else.
    pub(crate) fn gone(&mut self, uid: &str) -> Vec<HeldChild> {
        let Some((_, blocker)) = self.draining.remove(&hash(uid)) else {
            return Vec::new();
        };
        self.unblock(blocker);
        if self.blockers.contains_key(&blocker) {
            return Vec::new();
        }
        self.left.insert(blocker);
        self.held.remove(&blocker).unwrap_or_default()
    }

    /// Takes in that the watch `source` starts a list: again, if it `listed_before`.
    pub(crate) fn listing_again(&mut self, source: usize, listed_before: bool) {
        if !listed_before {
            // A first list that starts over: no drain went out before the first list ended.
        } else if self.settled {
            // Every drain of the sync was answered before this list: it shows each one that
            // has not acknowledged yet.
            self.evidence_only = false;
        } else if self.evidence_only {
            self.history_lost = true;
        }
        self.relisting(source);
    }

    /// Takes in what the sync found once it had listed every main object: `verdict` for each
    /// child. Returns the children that may move now and how many are left to the next sync.
    pub(crate) fn settle(
        &mut self,
        verdict: impl Fn(&HeldChild) -> Verdict,
    ) -> (Vec<HeldChild>, usize) {
        self.settled = true;
        let mut free = Vec::new();
        let mut given_up = 0;
        for (blocker, children) in std::mem::take(&mut self.held) {
            let blocked = self.blockers.contains_key(&blocker);
            let mut waiting = Vec::new();
            for child in children {
                match verdict(&child) {
                    Verdict::Free if !blocked => free.push(child),
                    // The watch may have missed its controller's drain and acknowledgement.
                    Verdict::Await if self.history_lost && !blocked => given_up += 1,
                    Verdict::GiveUp => given_up += 1,
                    _ => waiting.push(child),
                }
            }
            if !waiting.is_empty() {
                self.held.insert(blocker, waiting);
            }
        }
        (free, given_up)
    }

    /// Forgets what the watch `source` listed before, as it lists again.
    fn relisting(&mut self, source: usize) {
        let stale: Vec<u64> = self
            .draining
            .iter()
            .filter(|(_, (s, _))| *s == source)
            .map(|(uid, _)| *uid)
            .collect();
        for uid in stale {
            if let Some((_, blocker)) = self.draining.remove(&uid) {
                self.unblock(blocker);
            }
        }
    }

    fn unblock(&mut self, blocker: Blocker) {
        if let Some(count) = self.blockers.get_mut(&blocker) {
            *count -= 1;
            if *count == 0 {
                self.blockers.remove(&blocker);
            }
        }
    }

    /// Takes out every child nothing waits on any more: once every watch has listed, and
    /// whenever [`gone`](Self::gone) could not be trusted to say it (not every watch listed yet).
    pub(crate) fn released(&mut self) -> Vec<HeldChild> {
        let free: Vec<Blocker> = self
            .held
            .keys()
            .filter(|blocker| self.free(blocker, true))
            .copied()
            .collect();
        free.into_iter()
            .filter_map(|blocker| self.held.remove(&blocker))
            .flatten()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "/Secret/default/s";
    fn available(shard: &str) -> bool {
        ["a", "b"].contains(&shard)
    }

    #[test]
    fn a_child_waits_while_its_controller_sits_on_the_childs_shard() {
        let mut wait = OwnerWait::default();
        // The controller is on `a`, the ring wants it on `b`: it is being drained from `a`.
        wait.main_listed(KEY, Some("a"), Some("b"), true);
        assert!(wait.holds_back(KEY, Some("a"), Some("b"), available));
        assert_eq!(wait.waiting, 1);
        // Another controller key is not held back by it.
        assert!(!wait.holds_back("/Secret/default/t", Some("a"), Some("b"), available));
        assert_eq!(wait.waiting, 1);
    }

    #[test]
    fn a_child_moves_once_its_controller_is_in_place_or_elsewhere() {
        let mut wait = OwnerWait::default();
        wait.main_listed(KEY, Some("a"), Some("b"), true);
        // Listed again (a list that started over) now on the shard the ring wants.
        wait.main_listed(KEY, Some("b"), Some("b"), true);
        assert!(!wait.holds_back(KEY, Some("a"), Some("b"), available));
        // A controller on another shard than the child's holds nothing back.
        wait.main_listed(KEY, None, Some("b"), true);
        assert!(!wait.holds_back(KEY, Some("a"), Some("b"), available));
        assert_eq!(wait.waiting, 0);
    }

    #[test]
    fn with_namespace_keys_a_child_waits_while_any_main_object_of_its_namespace_sits_misplaced_on_its_shard()
     {
        const NS: &str = "team";
        let mut wait = OwnerWait::new(HashKey::Namespace);
        // The namespace moves from `a` to `b`: one main object is still on `a`, one arrived.
        wait.main_listed(NS, Some("a"), Some("b"), true);
        wait.main_listed(NS, Some("b"), Some("b"), true);
        assert!(wait.holds_back(NS, Some("a"), Some("b"), available));
        // Nothing misplaced on the child's shard in another namespace.
        assert!(!wait.holds_back("other", Some("a"), Some("b"), available));
        assert_eq!(wait.waiting, 1);
    }

    #[test]
    fn nothing_waits_for_an_unlisted_controller_or_an_unavailable_shard() {
        let mut wait = OwnerWait::default();
        assert!(!wait.holds_back(KEY, Some("a"), Some("b"), available));
        wait.main_listed(KEY, Some("gone"), Some("b"), true);
        assert!(
            !wait.holds_back(KEY, Some("gone"), Some("b"), available),
            "a shard that is not available reconciles nothing"
        );
        assert!(
            !wait.holds_back(KEY, None, Some("b"), available),
            "unassigned"
        );
        assert_eq!(wait.waiting, 0);
    }

    fn child(wait: &mut OwnerWait, key: &str, name: &str, shard: &str) {
        let configmaps = GroupResource::new("", "configmaps");
        wait.remember(
            key,
            &configmaps,
            Some("default"),
            name,
            (shard, "elsewhere"),
        );
    }

    fn names(children: Vec<HeldChild>) -> Vec<String> {
        let mut names: Vec<String> = children.into_iter().map(|c| c.name).collect();
        names.sort();
        names
    }

    #[test]
    fn a_held_child_is_released_when_its_controller_leaves_the_drain() {
        let mut wait = OwnerWait::new(HashKey::Object);
        child(&mut wait, KEY, "c1", "a");
        child(&mut wait, KEY, "c2", "a");
        child(&mut wait, "/Secret/default/t", "c3", "a");
        let mut waiting = Waiting::default();
        waiting.add(wait.take_held().expect("remembered"), false);
        assert_eq!(waiting.len(), 3);
        // The watch lists the controller of c1/c2 draining on `a`; t already left.
        waiting.draining(0, "uid-s", KEY, "a");
        assert_eq!(names(waiting.released()), ["c3"]);
        assert!(waiting.released().is_empty());
        // Another object being drained from `b` under the same key holds nothing back.
        waiting.draining(0, "uid-other", KEY, "b");
        assert!(waiting.gone("uid-other").is_empty());
        assert_eq!(waiting.len(), 2);
        // The drain is acknowledged.
        assert_eq!(names(waiting.gone("uid-s")), ["c1", "c2"]);
        assert!(waiting.is_empty());
    }

    #[test]
    fn children_held_after_the_watch_listed_move_at_once_unless_blocked() {
        let mut wait = OwnerWait::new(HashKey::Object);
        child(&mut wait, KEY, "c1", "a");
        let mut waiting = Waiting::default();
        // Handed over before the watch listed: nothing may move yet.
        assert!(
            waiting
                .add(wait.take_held().expect("remembered"), false)
                .is_empty()
        );
        waiting.draining(0, "uid-s", KEY, "a");
        assert!(waiting.released().is_empty());
        // The sync holds more after the watch listed: a child whose controller is still
        // draining on its shard waits, one whose controller left moves at once.
        child(&mut wait, KEY, "c2", "a");
        child(&mut wait, "/Secret/default/t", "c3", "a");
        let free = waiting.add(wait.take_held().expect("remembered"), true);
        assert_eq!(names(free), ["c3"]);
        assert_eq!(waiting.len(), 2);
        assert_eq!(names(waiting.gone("uid-s")), ["c1", "c2"]);
        assert!(waiting.is_empty());
        assert_eq!(
            wait.take_held(),
            Some(Vec::new()),
            "each child is taken once"
        );
    }

    #[test]
    fn before_the_drains_only_a_controller_seen_leaving_frees_its_child() {
        let mut wait = OwnerWait::new(HashKey::Object);
        // Held before the main objects were listed: c1's controller is drained later, c2's sits
        // in place elsewhere, c3's was not drained.
        child(&mut wait, KEY, "c1", "a");
        child(&mut wait, "/Secret/default/t", "c2", "a");
        child(&mut wait, "/Secret/default/u", "c3", "a");
        let mut waiting = Waiting::evidence_only();
        // The watch listed nothing draining: that says nothing about drains not sent yet.
        assert!(
            waiting
                .add(wait.take_held().expect("remembered"), true)
                .is_empty()
        );
        assert!(waiting.released().is_empty());
        // The drain of c1's controller reaches the watch, then its acknowledgement.
        waiting.draining(0, "uid-s", KEY, "a");
        assert_eq!(names(waiting.gone("uid-s")), ["c1"]);
        // The sync has listed the main objects.
        wait.main_listed(KEY, Some("a"), Some("b"), true);
        wait.main_listed("/Secret/default/u", Some("a"), Some("b"), false);
        let (free, given_up) = waiting.settle(|c| wait.verdict(c));
        assert_eq!(names(free), ["c2"], "its controller is not on its shard");
        assert_eq!(
            given_up, 1,
            "c3's controller stays on its shard: the next sync decides"
        );
        assert!(waiting.is_empty());
        // A child held later whose controller was seen leaving moves at once.
        child(&mut wait, KEY, "c4", "a");
        assert_eq!(
            names(waiting.add(wait.take_held().expect("remembered"), true)),
            ["c4"]
        );
    }

    #[test]
    fn a_watch_that_lists_again_before_the_main_objects_were_listed_may_have_missed_a_drain() {
        let mut wait = OwnerWait::new(HashKey::Object);
        child(&mut wait, KEY, "c1", "a");
        child(&mut wait, "/Secret/default/t", "c2", "a");
        let mut waiting = Waiting::evidence_only();
        waiting.add(wait.take_held().expect("remembered"), true);
        waiting.draining(0, "uid-t", "/Secret/default/t", "a");
        // The watch lists again: c1's controller may have been drained and acknowledged between.
        waiting.listing_again(0, true);
        waiting.draining(0, "uid-t", "/Secret/default/t", "a");
        wait.main_listed(KEY, Some("a"), Some("b"), true);
        wait.main_listed("/Secret/default/t", Some("a"), Some("b"), true);
        let (free, given_up) = waiting.settle(|c| wait.verdict(c));
        assert!(free.is_empty());
        assert_eq!(given_up, 1, "c1 is left to the next sync");
        // c2's controller is still seen draining: it frees c2 when it leaves.
        assert_eq!(names(waiting.gone("uid-t")), ["c2"]);
        // A list after the sync listed the main objects shows every drain.
        child(&mut wait, "/Secret/default/v", "c3", "a");
        waiting.add(wait.take_held().expect("remembered"), true);
        waiting.listing_again(0, true);
        assert_eq!(names(waiting.released()), ["c3"]);
    }

    #[test]
    fn with_namespace_keys_children_wait_for_every_drained_main_object_of_the_namespace() {
        let mut wait = OwnerWait::new(HashKey::Namespace);
        child(&mut wait, "team", "c1", "a");
        let mut waiting = Waiting::default();
        waiting.add(wait.take_held().expect("remembered"), false);
        waiting.draining(0, "uid-1", "team", "a");
        waiting.draining(1, "uid-2", "team", "a");
        assert!(waiting.released().is_empty());
        assert!(waiting.gone("uid-1").is_empty());
        // The second watch lists again and no longer sees its object: only then it may move.
        waiting.listing_again(1, true);
        assert_eq!(names(waiting.released()), ["c1"]);
    }

    #[test]
    fn a_main_object_seen_twice_counts_once() {
        let mut wait = OwnerWait::new(HashKey::Object);
        child(&mut wait, KEY, "c1", "a");
        let mut waiting = Waiting::default();
        waiting.add(wait.take_held().expect("remembered"), false);
        waiting.draining(0, "uid-s", KEY, "a");
        waiting.draining(0, "uid-s", KEY, "a");
        assert_eq!(names(waiting.gone("uid-s")), ["c1"]);
    }

    #[test]
    fn too_many_held_children_are_not_remembered() {
        let mut wait = OwnerWait::new(HashKey::Object);
        for i in 0..=MAX_REMEMBERED {
            child(&mut wait, KEY, &i.to_string(), "a");
        }
        assert!(wait.held.is_none(), "the next sync moves them");
        assert_eq!(wait.held_len(), 0);
    }
}
