//! Which controlled objects a sync holds back until their controller has left their shard.
//!
//! A controlled object moved while its controller still sits on the old shard is written back by
//! that shard, which still reconciles the controller until it acknowledges its drain. A sync walks
//! main resources first, so by the time it meets a controlled object it has seen the controller
//! if the controller is listed; this remembers where the misplaced controllers sit.

use std::collections::{HashMap, HashSet};

use sharding_crds::HashKey;

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
    /// Hash of each listed main object's key → hash of its shard label (0 without one): only main
    /// objects not on the shard the ring wants (the others cannot hold anything back), as hashes,
    /// 16 bytes each; a sync that moves nothing keeps it empty, however large the ring.
    owner_shards: HashMap<u64, u64>,
    /// With namespace keys: (key hash, shard hash) of every misplaced main object.
    namespace_shards: HashSet<(u64, u64)>,
    /// Controlled objects held back so far.
    pub(crate) waiting: usize,
}

impl OwnerWait {
    /// An empty record for a ring hashing by `hash_key`.
    pub(crate) fn new(hash_key: HashKey) -> Self {
        Self {
            by_namespace: hash_key == HashKey::Namespace,
            ..Self::default()
        }
    }

    /// Takes in a listed main object with hash key `key`, labelled for shard `current`, which the
    /// ring wants on `desired`.
    pub(crate) fn main_listed(&mut self, key: &str, current: Option<&str>, desired: Option<&str>) {
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
            self.owner_shards.insert(key_hash, current.map_or(0, hash));
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
                self.owner_shards.get(&hash(key)) == Some(&hash(shard))
            }
        });
        let wait = waits_for_owner(current, owner_on_current, desired, is_available);
        if wait {
            self.waiting += 1;
        }
        wait
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
        wait.main_listed(KEY, Some("a"), Some("b"));
        assert!(wait.holds_back(KEY, Some("a"), Some("b"), available));
        assert_eq!(wait.waiting, 1);
        // Another controller key is not held back by it.
        assert!(!wait.holds_back("/Secret/default/t", Some("a"), Some("b"), available));
        assert_eq!(wait.waiting, 1);
    }

    #[test]
    fn a_child_moves_once_its_controller_is_in_place_or_elsewhere() {
        let mut wait = OwnerWait::default();
        wait.main_listed(KEY, Some("a"), Some("b"));
        // Listed again (a list that started over) now on the shard the ring wants.
        wait.main_listed(KEY, Some("b"), Some("b"));
        assert!(!wait.holds_back(KEY, Some("a"), Some("b"), available));
        // A controller on another shard than the child's holds nothing back.
        wait.main_listed(KEY, None, Some("b"));
        assert!(!wait.holds_back(KEY, Some("a"), Some("b"), available));
        assert_eq!(wait.waiting, 0);
    }

    #[test]
    fn with_namespace_keys_a_child_waits_while_any_main_object_of_its_namespace_sits_misplaced_on_its_shard()
     {
        const NS: &str = "team";
        let mut wait = OwnerWait::new(HashKey::Namespace);
        // The namespace moves from `a` to `b`: one main object is still on `a`, one arrived.
        wait.main_listed(NS, Some("a"), Some("b"));
        wait.main_listed(NS, Some("b"), Some("b"));
        assert!(wait.holds_back(NS, Some("a"), Some("b"), available));
        // Nothing misplaced on the child's shard in another namespace.
        assert!(!wait.holds_back("other", Some("a"), Some("b"), available));
        assert_eq!(wait.waiting, 1);
    }

    #[test]
    fn nothing_waits_for_an_unlisted_controller_or_an_unavailable_shard() {
        let mut wait = OwnerWait::default();
        assert!(!wait.holds_back(KEY, Some("a"), Some("b"), available));
        wait.main_listed(KEY, Some("gone"), Some("b"));
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
}
