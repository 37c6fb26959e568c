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
use crate::leader::observed::PendingDrains;
use crate::records;
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

    /// The shards whose oldest pending drain just passed `timeout`, each once until its drains
    /// cleared: `pending` as [`Observed::pending_drains`](crate::leader::observed::Observed::pending_drains)
    /// gives it.
    fn newly_stuck(
        &mut self,
        pending: BTreeMap<(RingRef, String), PendingDrains>,
        timeout: Duration,
    ) -> Vec<((RingRef, String), PendingDrains)> {
        self.warned.retain(|key| pending.contains_key(key));
        let stuck: Vec<_> = pending
            .into_iter()
            .filter(|(key, drains)| drains.oldest >= timeout && !self.warned.contains(key))
            .collect();
        self.warned.extend(stuck.iter().map(|(key, _)| key.clone()));
        stuck
    }

    /// Warns once per shard whose oldest pending drain is older than `drainTimeout`, and returns
    /// the rings of those shards: the caller syncs them again. A drain that looks stuck may have
    /// been acknowledged and assigned straight back to the same shard by a replica whose view of
    /// the ring was older (its Lease watch reconnecting after an API server restart, say); only a
    /// sync drains such an object again, and waiting for the periodic one would leave it on the
    /// wrong shard for up to `syncPeriod`. A sync drains nothing twice, and this happens once per
    /// shard until its drains clear, so a shard that is really stuck costs one extra sync.
    pub(super) async fn stuck_drains(&mut self, ctx: &Context) -> Vec<RingRef> {
        let timeout = ctx.config.controller.sharder.drain_timeout.0;
        let pending = ctx.observed.pending_drains(std::time::Instant::now());
        let mut rings = Vec::new();
        for ((ring, shard), drains) in self.newly_stuck(pending, timeout) {
            let Some(object) = ctx.caches.ring(&ring) else {
                continue;
            };
            let note = format!(
                "Shard {shard} has not acknowledged the drain of {} objects for more than {:?}; it may be stuck",
                drains.objects, timeout
            );
            tracing::warn!(event = records::EVENT_DRAINS_NOT_ACKNOWLEDGED, %ring, %shard, objects = drains.objects, oldest = ?drains.oldest, "drains not acknowledged; syncing the ring again");
            ctx.events
                .warning(
                    &object.object_ref(),
                    REASON_DRAIN_NOT_ACKNOWLEDGED,
                    &shard,
                    note,
                )
                .await;
            if !rings.contains(&ring) {
                rings.push(ring);
            }
        }
        rings
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

    #[test]
    fn a_shard_is_stuck_once_until_its_drains_clear() {
        let timeout = Duration::from_secs(10);
        let key = (
            RingRef::new(kube_sharding_api::RingKind::ClusterRing, "r"),
            "shard-a".to_string(),
        );
        let pending = |oldest: u64| {
            BTreeMap::from([(
                key.clone(),
                PendingDrains {
                    objects: 3,
                    oldest: Duration::from_secs(oldest),
                },
            )])
        };
        let mut announcer = Announcer::default();
        assert!(
            announcer.newly_stuck(pending(9), timeout).is_empty(),
            "not yet"
        );
        let stuck = announcer.newly_stuck(pending(10), timeout);
        assert_eq!(stuck.len(), 1);
        assert_eq!(stuck[0].0, key);
        assert!(
            announcer.newly_stuck(pending(30), timeout).is_empty(),
            "once per episode: a stuck shard costs one extra sync"
        );
        assert!(announcer.newly_stuck(BTreeMap::new(), timeout).is_empty());
        assert_eq!(
            announcer.newly_stuck(pending(12), timeout).len(),
            1,
            "drains cleared, then stuck again: a new episode"
        );
    }
}
