//! What the leader learned about each ring's objects, for the metrics and the stuck-drain
//! warnings: objects per shard and unassigned objects from the latest sync, and the objects
//! waiting for a drain acknowledgement with the time each was first seen draining.
//!
//! Only the leader syncs, so only the leader has these; other replicas report none.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube_sharding_api::{GroupResource, RingRef};

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

/// One object waiting for its shard to acknowledge a drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Draining {
    /// Hash of the shard's name (see [`ShardNames`]).
    shard: u64,
    since: Instant,
}

/// The hash of an object's UID, which the drain bookkeeping keys objects by: a scale-out of a big
/// ring drains tens of thousands of objects in one sync, and 8 bytes an object instead of a
/// 36-character string (plus the shard's name) keeps the leader's peak memory flat. Two UIDs of
/// one ring sharing a 64-bit hash would merge two drains in a metric, nothing more.
pub(crate) fn uid_hash(uid: &str) -> u64 {
    crate::core::hash_ring::hash(uid)
}

/// Shard names by the hash the drain bookkeeping stores instead of the name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct ShardNames(HashMap<u64, String>);

impl ShardNames {
    /// The hash standing for `shard`, remembering its name.
    fn intern(&mut self, shard: &str) -> u64 {
        let hash = crate::core::hash_ring::hash(shard);
        self.0.entry(hash).or_insert_with(|| shard.to_string());
        hash
    }

    fn name(&self, hash: u64) -> &str {
        self.0.get(&hash).map_or("", String::as_str)
    }
}

/// Objects seen carrying the drain label in one sync: UID hash → shard.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct DrainsSeen {
    objects: HashMap<u64, u64>,
    shards: ShardNames,
}

impl DrainsSeen {
    /// Notes that object `uid` carries the drain label of `shard`.
    pub(crate) fn insert(&mut self, uid: &str, shard: &str) {
        let shard = self.shards.intern(shard);
        self.objects.insert(uid_hash(uid), shard);
    }
}

/// One ring's drains waiting for an acknowledgement.
#[derive(Debug, Default)]
struct RingDrains {
    /// UID hash → drain.
    objects: HashMap<u64, Draining>,
    shards: ShardNames,
}

/// Drains of one shard not acknowledged yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PendingDrains {
    /// Objects carrying the drain label.
    pub(crate) objects: u64,
    /// How long the oldest of them has.
    pub(crate) oldest: Duration,
}

/// The leader's observations, shared with the metrics collector.
#[derive(Debug, Default)]
pub(crate) struct Observed {
    objects: Mutex<HashMap<RingRef, RingObjects>>,
    drains: Mutex<HashMap<RingRef, RingDrains>>,
}

impl Observed {
    /// Records the counts of a complete sync of `ring` and the objects it saw carrying the drain
    /// label: drains no longer seen were acknowledged (or the object is gone). `drained_now` holds
    /// the [`uid_hash`]es of the objects this sync drained.
    pub(crate) fn sync_finished(
        &self,
        ring: &RingRef,
        objects: RingObjects,
        draining: DrainsSeen,
        drained_now: &HashSet<u64>,
        now: Instant,
    ) {
        if let Ok(mut map) = self.objects.lock() {
            map.insert(ring.clone(), objects);
        }
        if let Ok(mut map) = self.drains.lock() {
            let tracked = map.entry(ring.clone()).or_default();
            tracked
                .objects
                .retain(|uid, _| draining.objects.contains_key(uid) || drained_now.contains(uid));
            for (uid, shard) in draining.objects {
                tracked
                    .objects
                    .entry(uid)
                    .or_insert(Draining { shard, since: now });
            }
            tracked.shards.0.extend(draining.shards.0);
            let named: HashSet<u64> = tracked.objects.values().map(|d| d.shard).collect();
            tracked.shards.0.retain(|hash, _| named.contains(hash));
        }
    }

    /// Notes that the sharder asked `shard` to drain object `uid` of `ring`.
    pub(crate) fn drain_sent(&self, ring: &RingRef, uid: &str, shard: &str, now: Instant) {
        if let Ok(mut map) = self.drains.lock() {
            let tracked = map.entry(ring.clone()).or_default();
            let shard = tracked.shards.intern(shard);
            tracked
                .objects
                .entry(uid_hash(uid))
                .or_insert(Draining { shard, since: now });
        }
    }

    /// Notes that object `uid` of `ring` carries no shard label any more: its drain, if any, was
    /// acknowledged.
    pub(crate) fn unassigned_seen(&self, ring: &RingRef, uid: &str) {
        if let Ok(mut map) = self.drains.lock()
            && let Some(tracked) = map.get_mut(ring)
        {
            tracked.objects.remove(&uid_hash(uid));
        }
    }

    /// Forgets rings that are gone.
    pub(crate) fn retain(&self, keep: impl Fn(&RingRef) -> bool) {
        if let Ok(mut map) = self.objects.lock() {
            map.retain(|r, _| keep(r));
        }
        if let Ok(mut map) = self.drains.lock() {
            map.retain(|r, _| keep(r));
        }
    }

    /// Counts per ring from the latest syncs.
    pub(crate) fn objects(&self) -> Vec<(RingRef, RingObjects)> {
        self.objects
            .lock()
            .map(|m| m.iter().map(|(r, o)| (r.clone(), o.clone())).collect())
            .unwrap_or_default()
    }

    /// Pending drains per ring and shard, as of `now`.
    pub(crate) fn pending_drains(
        &self,
        now: Instant,
    ) -> BTreeMap<(RingRef, String), PendingDrains> {
        let mut result: BTreeMap<(RingRef, String), PendingDrains> = BTreeMap::new();
        let Ok(map) = self.drains.lock() else {
            return result;
        };
        for (ring, tracked) in map.iter() {
            for draining in tracked.objects.values() {
                let age = now.saturating_duration_since(draining.since);
                let shard = tracked.shards.name(draining.shard);
                let entry =
                    result
                        .entry((ring.clone(), shard.to_string()))
                        .or_insert(PendingDrains {
                            objects: 0,
                            oldest: Duration::ZERO,
                        });
                entry.objects += 1;
                entry.oldest = entry.oldest.max(age);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_sharding_api::RingKind;

    #[test]
    fn drains_are_tracked_until_acknowledged_or_no_longer_seen() {
        let ring = RingRef::new(RingKind::ClusterRing, "r");
        let observed = Observed::default();
        let t0 = Instant::now();
        observed.drain_sent(&ring, "u1", "a", t0);
        observed.drain_sent(&ring, "u2", "a", t0 + Duration::from_secs(5));
        let pending = observed.pending_drains(t0 + Duration::from_secs(10));
        assert_eq!(
            pending[&(ring.clone(), "a".to_string())],
            PendingDrains {
                objects: 2,
                oldest: Duration::from_secs(10)
            }
        );
        // u1 acknowledged: seen without a shard label.
        observed.unassigned_seen(&ring, "u1");
        // A sync saw u2 still draining and u3 draining (left by a previous leader), and drained u4.
        let mut draining = DrainsSeen::default();
        draining.insert("u2", "a");
        draining.insert("u3", "b");
        let t1 = t0 + Duration::from_secs(20);
        observed.drain_sent(&ring, "u4", "b", t1);
        observed.sync_finished(
            &ring,
            RingObjects::default(),
            draining,
            &HashSet::from([uid_hash("u4")]),
            t1,
        );
        let pending = observed.pending_drains(t1 + Duration::from_secs(1));
        assert_eq!(pending[&(ring.clone(), "a".to_string())].objects, 1);
        assert_eq!(
            pending[&(ring.clone(), "a".to_string())].oldest,
            Duration::from_secs(16)
        );
        assert_eq!(pending[&(ring.clone(), "b".to_string())].objects, 2);
        // A later sync that sees nothing draining clears them all.
        observed.sync_finished(
            &ring,
            RingObjects::default(),
            DrainsSeen::default(),
            &HashSet::new(),
            t1,
        );
        assert!(observed.pending_drains(t1).is_empty());
        observed.retain(|_| false);
        assert!(observed.objects().is_empty());
    }
}
