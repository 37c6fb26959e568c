//! A map whose entries expire, bounded in size: the memory of recent review answers.
//!
//! Time comes in as an argument, so the rules are tested without a clock.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Instant;

/// At most `capacity` entries, each valid until its own expiry.
#[derive(Debug)]
pub(crate) struct ExpiringCache<K, V> {
    entries: HashMap<K, (V, Instant)>,
    capacity: usize,
}

impl<K: Eq + Hash + Clone, V: Clone> ExpiringCache<K, V> {
    /// An empty cache holding at most `capacity` entries (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            capacity: capacity.max(1),
        }
    }

    /// The value of `key` if it has not expired at `now`.
    pub(crate) fn get(&self, key: &K, now: Instant) -> Option<V> {
        self.entries
            .get(key)
            .filter(|(_, expires)| *expires > now)
            .map(|(value, _)| value.clone())
    }

    /// Stores `value` for `key` until `expires`. A full cache first drops what expired by `now`,
    /// then, if still full, the entry that would expire first: it was about to go anyway, and
    /// short-lived (negative) answers go before long-lived ones.
    pub(crate) fn insert(&mut self, key: K, value: V, expires: Instant, now: Instant) {
        if !self.entries.contains_key(&key) && self.entries.len() >= self.capacity {
            self.entries.retain(|_, (_, until)| *until > now);
            if self.entries.len() >= self.capacity
                && let Some(soonest) = self
                    .entries
                    .iter()
                    .min_by_key(|(_, (_, until))| *until)
                    .map(|(k, _)| k.clone())
            {
                self.entries.remove(&soonest);
            }
        }
        self.entries.insert(key, (value, expires));
    }

    /// Entries held, expired ones included until an insert makes room.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn entries_expire_at_their_own_time() {
        let t0 = Instant::now();
        let mut cache = ExpiringCache::new(10);
        cache.insert("long", true, t0 + secs(60), t0);
        cache.insert("short", false, t0 + secs(5), t0);
        assert_eq!(cache.get(&"long", t0 + secs(4)), Some(true));
        assert_eq!(cache.get(&"short", t0 + secs(4)), Some(false));
        assert_eq!(cache.get(&"short", t0 + secs(5)), None);
        assert_eq!(cache.get(&"long", t0 + secs(59)), Some(true));
        assert_eq!(cache.get(&"long", t0 + secs(60)), None);
        assert_eq!(cache.get(&"absent", t0), None);
    }

    #[test]
    fn a_full_cache_never_grows() {
        let t0 = Instant::now();
        let mut cache = ExpiringCache::new(3);
        for i in 0..1000u64 {
            cache.insert(i, i, t0 + secs(100 + i), t0);
            assert!(cache.len() <= 3);
        }
        // The newest entries stay: each insert dropped the one expiring first.
        for i in 997..1000 {
            assert_eq!(cache.get(&i, t0), Some(i));
        }
    }

    #[test]
    fn a_full_cache_drops_expired_and_short_lived_entries_first() {
        let t0 = Instant::now();
        let mut cache = ExpiringCache::new(3);
        cache.insert("allowed", true, t0 + secs(120), t0);
        cache.insert("denied-1", false, t0 + secs(10), t0);
        cache.insert("denied-2", false, t0 + secs(10), t0);
        // Both negative answers expired: both go, the positive one stays.
        let later = t0 + secs(11);
        cache.insert("denied-3", false, later + secs(10), later);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&"allowed", later), Some(true));
        // Full again with nothing expired: the entry expiring first goes.
        cache.insert("denied-4", false, later + secs(9), later);
        cache.insert("denied-5", false, later + secs(10), later);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.get(&"denied-4", later), None);
        assert_eq!(cache.get(&"allowed", later), Some(true));
        assert_eq!(cache.get(&"denied-5", later), Some(false));
    }

    #[test]
    fn replacing_a_key_in_a_full_cache_drops_nothing_else() {
        let t0 = Instant::now();
        let mut cache = ExpiringCache::new(2);
        cache.insert("a", 1, t0 + secs(10), t0);
        cache.insert("b", 2, t0 + secs(20), t0);
        cache.insert("a", 3, t0 + secs(30), t0);
        assert_eq!(cache.get(&"a", t0), Some(3));
        assert_eq!(cache.get(&"b", t0), Some(2));
    }
}
