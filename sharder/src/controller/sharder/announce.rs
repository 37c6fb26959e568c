//! Events the leader publishes about ring membership and stuck drains (docs/protocol.md §12 and our
//! own): a shard joined or left a ring, a shard has not acknowledged drains for `drainTimeout`.
//!
//! Membership changes are seen in the ring views, which every change of available shards
//! rebuilds; the first views a new leader sees are its baseline, so a leader change announces
//! nothing by itself.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use kube_sharding_api::RingRef;

use crate::context::Context;
use crate::leader::events::{
    REASON_DRAIN_NOT_ACKNOWLEDGED, REASON_SHARD_JOINED, REASON_SHARD_LEFT,
};
use crate::views::RingView;

/// How often pending drains are compared with `drainTimeout`.
pub(super) const DRAIN_CHECK_PERIOD: Duration = Duration::from_secs(5);

/// What was announced already.
#[derive(Debug, Default)]
pub(super) struct Announcer {
    /// Available shards with weights per ring, as last seen.
    members: HashMap<RingRef, BTreeMap<String, u32>>,
    /// Shards warned about stuck drains; warned again only after their drains cleared.
    warned: HashSet<(RingRef, String)>,
}

/// The shards that joined and left between `before` and `after`.
pub(super) fn membership_changes(
    before: &BTreeMap<String, u32>,
    after: &BTreeMap<String, u32>,
) -> (Vec<String>, Vec<String>) {
    let joined = after
        .keys()
        .filter(|s| !before.contains_key(*s))
        .cloned()
        .collect();
    let left = before
        .keys()
        .filter(|s| !after.contains_key(*s))
        .cloned()
        .collect();
    (joined, left)
}

impl Announcer {
    /// Publishes an Event for every shard that joined or left a ring since the last call.
    pub(super) async fn membership(&mut self, ctx: &Context, views: &[Arc<RingView>]) {
        let mut current = HashMap::new();
        for view in views {
            let ring = view.ring_ref();
            let members: BTreeMap<String, u32> = view
                .hash_ring
                .members()
                .map(|(name, weight)| (name.to_string(), weight))
                .collect();
            if let Some(before) = self.members.get(&ring)
                && before != &members
                && let Some(object) = ctx.caches.ring(&ring)
            {
                let (joined, left) = membership_changes(before, &members);
                let reference = object.object_ref();
                let available = members.len();
                for shard in joined {
                    let note = format!("Shard {shard} joined; {available} shards available");
                    ctx.events
                        .normal(&reference, REASON_SHARD_JOINED, &shard, note)
                        .await;
                }
                for shard in left {
                    let note = format!(
                        "Shard {shard} is no longer available; {available} shards available"
                    );
                    ctx.events
                        .normal(&reference, REASON_SHARD_LEFT, &shard, note)
                        .await;
                }
            }
            current.insert(ring, members);
        }
        self.members = current;
        ctx.observed.retain(|ring| self.members.contains_key(ring));
        ctx.reachability
            .retain(|ring| self.members.contains_key(ring));
    }

    /// Warns once per shard whose oldest pending drain is older than `drainTimeout`.
    pub(super) async fn stuck_drains(&mut self, ctx: &Context) {
        let timeout = ctx.config.controller.sharder.drain_timeout.0;
        let pending = ctx.observed.pending_drains(std::time::Instant::now());
        self.warned.retain(|key| pending.contains_key(key));
        for ((ring, shard), drains) in pending {
            if drains.oldest < timeout || self.warned.contains(&(ring.clone(), shard.clone())) {
                continue;
            }
            let Some(object) = ctx.caches.ring(&ring) else {
                continue;
            };
            let note = format!(
                "Shard {shard} has not acknowledged the drain of {} objects for more than {:?}; it may be stuck",
                drains.objects, timeout
            );
            tracing::warn!(%ring, %shard, objects = drains.objects, oldest = ?drains.oldest, "drains not acknowledged");
            ctx.events
                .warning(
                    &object.object_ref(),
                    REASON_DRAIN_NOT_ACKNOWLEDGED,
                    &shard,
                    note,
                )
                .await;
            self.warned.insert((ring, shard));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_name_joined_and_left_shards() {
        let before = BTreeMap::from([("a".to_string(), 1), ("b".to_string(), 1)]);
        let after = BTreeMap::from([("b".to_string(), 2), ("c".to_string(), 1)]);
        let (joined, left) = membership_changes(&before, &after);
        assert_eq!(joined, ["c"]);
        assert_eq!(left, ["a"]);
        // A weight change alone is neither.
        let (joined, left) = membership_changes(&after, &after);
        assert!(joined.is_empty() && left.is_empty());
    }
}
