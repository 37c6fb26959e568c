//! Which controlled objects a sync holds back until their controller has left their shard.
//!
//! A controlled object moved while its controller still sits on the old shard is written back by
//! that shard, which still reconciles the controller until it acknowledges its drain. A sync walks
//! main resources first, so by the time it meets a controlled object it has seen the controller
//! if the controller is listed; this remembers where the misplaced controllers sit.

use std::collections::HashMap;

use crate::core::hash_ring::hash;
use crate::core::rebalance::waits_for_owner;

/// What one sync learned about controllers not yet on the shard the ring wants, and how many
/// controlled objects it held back for them.
#[derive(Debug, Default)]
pub(crate) struct OwnerWait {
    /// Hash of each listed main object's key → hash of its shard label (0 without one): only main
    /// objects not on the shard the ring wants (the others cannot hold anything back), as hashes,
    /// 16 bytes each; a sync that moves nothing keeps it empty, however large the ring.
    owner_shards: HashMap<u64, u64>,
    /// Controlled objects held back so far.
    pub(crate) waiting: usize,
}

impl OwnerWait {
    /// Takes in a listed main object with hash key `key`, labelled for shard `current`, which the
    /// ring wants on `desired`.
    pub(crate) fn main_listed(&mut self, key: &str, current: Option<&str>, desired: Option<&str>) {
        let key_hash = hash(key);
        if desired == current {
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
        let owner_on_current =
            current.is_some_and(|shard| self.owner_shards.get(&hash(key)) == Some(&hash(shard)));
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
