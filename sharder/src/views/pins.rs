//! The pins a placement reads besides the object's own annotation: its namespace's annotation,
//! from the Namespace cache, and its controller's pin, as last seen by this process (docs/protocol.md
//! §21).
//!
//! A controller's pin is an annotation on the controller, which a request for one of its children
//! does not carry, and no watch can select objects by annotation. So each process remembers the
//! pins of the main objects it has placed: the leader's sync sees every main object before their
//! children, the webhook and the missed-assignment watch each main object they assign. A child
//! placed by a replica that has not seen its controller's pin follows the ring, and the leader's
//! next sync moves it after its controller.
//!
//! Whoever reaches the webhook port can send admission reviews, so what is remembered is bounded:
//! only pins of real (not dry-run) requests, keys no longer than a real object's, invalid values
//! as one marker, at most [`MAX_PINS_PER_RING`] per ring, and pins not seen for
//! [`Pins::with_max_age`] are dropped on every replica.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::reflector::{ObjectRef, Store};
use kube_sharding_api::RingRef;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::core::pin::is_valid_pin;
use crate::metrics::RingLabel;
use crate::records;

/// Most pins remembered per ring; beyond it new pins are not remembered (their children follow
/// the ring until the leader's sync moves them), so no caller can grow the map without bound.
pub const MAX_PINS_PER_RING: usize = 10_000;

/// Longest hash key remembered: group (253) / kind (63) / namespace (63) / name (253) and their
/// separators fit; a longer key names no object the API server could store.
pub const MAX_PIN_KEY_BYTES: usize = 640;

/// What is kept for a pin value that cannot name a shard: the value itself is not kept (any
/// length could be sent), and the marker is no label value either, so it stays invalid.
pub const INVALID_PIN: &str = "(invalid)";

/// How long a pin not seen again is kept by default; [`Pins::with_max_age`] sets it from the
/// sync period.
const DEFAULT_MAX_AGE: Duration = Duration::from_secs(3600);

/// How often, at most, remembering a pin also drops those older than the maximum age.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// Namespace pins and remembered controller pins, shared by every view of a process.
#[derive(Clone)]
pub struct Pins {
    namespaces: Store<Namespace>,
    controllers: Arc<RwLock<Controllers>>,
    max_age: Duration,
    /// Pins not remembered because their ring was full, by ring.
    not_remembered: Family<RingLabel, Counter>,
}

/// The remembered controller pins of every ring.
#[derive(Default)]
struct Controllers {
    rings: HashMap<RingRef, ControllerPins>,
    /// When pins older than the maximum age were last dropped.
    pruned: Option<Instant>,
}

/// One ring's pinned main objects.
#[derive(Default)]
struct ControllerPins {
    /// Hash key → its pin and when it was last seen.
    pins: HashMap<Box<str>, (Box<str>, Instant)>,
    /// Whether a pin was refused for the cap since the ring last had room (warned once).
    full: bool,
}

impl Default for Pins {
    /// No namespaces and no controller pins: for views built without an API server.
    fn default() -> Self {
        Self::new(kube::runtime::reflector::store().0)
    }
}

impl std::fmt::Debug for Pins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pins").finish_non_exhaustive()
    }
}

impl Pins {
    /// Pins reading namespace annotations from `namespaces`.
    pub fn new(namespaces: Store<Namespace>) -> Self {
        Self {
            namespaces,
            controllers: Arc::default(),
            max_age: DEFAULT_MAX_AGE,
            not_remembered: Family::default(),
        }
    }

    /// These pins, forgetting a pin not seen for `max_age` (on every replica; the leader's sync
    /// sees every pinned main object once per sync period, so it should be a few of those).
    #[must_use]
    pub fn with_max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// These pins, counting in `not_remembered` each pin left out because its ring already has
    /// [`MAX_PINS_PER_RING`] (`controller_sharding_pins_not_remembered_total`).
    #[must_use]
    pub(crate) fn with_not_remembered(
        mut self,
        not_remembered: Family<RingLabel, Counter>,
    ) -> Self {
        self.not_remembered = not_remembered;
        self
    }

    /// The value of annotation `key` on namespace `namespace`, if the namespace is cached and
    /// carries it.
    pub(crate) fn namespace(&self, namespace: &str, key: &str) -> Option<String> {
        self.namespaces
            .get(&ObjectRef::new(namespace))?
            .metadata
            .annotations
            .as_ref()?
            .get(key)
            .cloned()
    }

    /// The pin last seen on the main object with hash key `key` in `ring`.
    pub(crate) fn controller(&self, ring: &RingRef, key: &str) -> Option<String> {
        let controllers = self.controllers.read().ok()?;
        Some(controllers.rings.get(ring)?.pins.get(key)?.0.to_string())
    }

    /// Remembers the pin `value` (its own annotation; `None`: none) of the main object with hash
    /// key `key` in `ring`, seen now. Only for objects that exist or are being written: a dry
    /// run's pin is not remembered (callers skip it).
    pub(crate) fn main_seen(&self, ring: &RingRef, key: &str, value: Option<&str>) {
        if key.len() > MAX_PIN_KEY_BYTES {
            return;
        }
        // Most main objects carry no pin and were never pinned: a read lock finds nothing to do.
        let known = self.controllers.read().ok().is_some_and(|c| {
            c.rings
                .get(ring)
                .is_some_and(|ring| ring.pins.contains_key(key))
        });
        if !known && value.is_none() {
            return;
        }
        let Ok(mut controllers) = self.controllers.write() else {
            return;
        };
        let now = Instant::now();
        self.prune_if_due(&mut controllers, now);
        let Some(value) = value else {
            if let Some(ring) = controllers.rings.get_mut(ring) {
                ring.pins.remove(key);
            }
            return;
        };
        let value = if is_valid_pin(value) {
            value
        } else {
            INVALID_PIN
        };
        let pins = controllers.rings.entry(ring.clone()).or_default();
        if let Some(entry) = pins.pins.get_mut(key) {
            if *entry.0 != *value {
                entry.0 = value.into();
            }
            entry.1 = now;
            return;
        }
        if pins.pins.len() >= MAX_PINS_PER_RING {
            self.not_remembered
                .get_or_create(&RingLabel(ring.clone()))
                .inc();
            if !pins.full {
                pins.full = true;
                tracing::warn!(event = records::EVENT_PINS_LIMIT_REACHED, %ring, max = MAX_PINS_PER_RING, "too many pinned main objects to remember: children of further pinned objects follow the ring until the sync moves them");
            }
            return;
        }
        pins.pins.insert(key.into(), (value.into(), now));
    }

    /// Drops every pin not seen for the maximum age, unless that was done less than
    /// [`PRUNE_EVERY`] ago.
    fn prune_if_due(&self, controllers: &mut Controllers, now: Instant) {
        if controllers
            .pruned
            .is_some_and(|at| now.duration_since(at) < PRUNE_EVERY.min(self.max_age))
        {
            return;
        }
        controllers.pruned = Some(now);
        for ring in controllers.rings.values_mut() {
            ring.pins
                .retain(|_, (_, seen)| now.duration_since(*seen) < self.max_age);
            if ring.pins.len() < MAX_PINS_PER_RING {
                ring.full = false;
            }
        }
        controllers.rings.retain(|_, ring| !ring.pins.is_empty());
    }

    /// Drops the pins not seen for the maximum age, whether or not any pin is being remembered
    /// (the view maintenance calls it every few seconds on every replica).
    pub(crate) fn prune_old(&self) {
        if let Ok(mut controllers) = self.controllers.write() {
            self.prune_if_due(&mut controllers, Instant::now());
        }
    }

    /// How many pins are remembered for `ring`.
    #[cfg(test)]
    pub(crate) fn remembered(&self, ring: &RingRef) -> usize {
        self.controllers
            .read()
            .ok()
            .and_then(|c| c.rings.get(ring).map(|r| r.pins.len()))
            .unwrap_or(0)
    }

    /// Forgets the pins of `ring` not seen since `since`: a sync that listed every main object
    /// from `since` on did not meet those objects, so they are gone (or lost their pin unseen).
    pub(crate) fn forget_unseen(&self, ring: &RingRef, since: Instant) {
        if let Ok(mut controllers) = self.controllers.write()
            && let Some(ring) = controllers.rings.get_mut(ring)
        {
            ring.pins.retain(|_, (_, seen)| *seen >= since);
            if ring.pins.len() < MAX_PINS_PER_RING {
                ring.full = false;
            }
        }
    }

    /// Forgets the rings not in `keep`.
    pub(crate) fn retain(&self, keep: &std::collections::BTreeSet<RingRef>) {
        if let Ok(mut controllers) = self.controllers.write() {
            controllers.rings.retain(|ring, _| keep.contains(ring));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_sharding_api::RingKind;

    #[test]
    fn controller_pins_are_remembered_and_forgotten() {
        let pins = Pins::default();
        let ring = RingRef::new(RingKind::ClusterRing, "r");
        let other = RingRef::new(RingKind::ControllerRing, "r");
        pins.main_seen(&ring, "/Secret/ns/a", None);
        assert_eq!(pins.controller(&ring, "/Secret/ns/a"), None);
        pins.main_seen(&ring, "/Secret/ns/a", Some("shard-b"));
        assert_eq!(
            pins.controller(&ring, "/Secret/ns/a").as_deref(),
            Some("shard-b")
        );
        assert_eq!(pins.controller(&other, "/Secret/ns/a"), None);
        pins.main_seen(&ring, "/Secret/ns/a", Some("shard-c"));
        assert_eq!(
            pins.controller(&ring, "/Secret/ns/a").as_deref(),
            Some("shard-c")
        );
        pins.main_seen(&ring, "/Secret/ns/a", None);
        assert_eq!(pins.controller(&ring, "/Secret/ns/a"), None);
        let before = Instant::now();
        pins.main_seen(&ring, "/Secret/ns/kept", Some("shard-a"));
        // A sync that started before the pin was seen keeps it; one that started after forgets it.
        pins.forget_unseen(&ring, before);
        assert_eq!(
            pins.controller(&ring, "/Secret/ns/kept").as_deref(),
            Some("shard-a")
        );
        pins.forget_unseen(&ring, Instant::now() + std::time::Duration::from_secs(3600));
        assert_eq!(pins.controller(&ring, "/Secret/ns/kept"), None);
        pins.main_seen(&other, "/Secret/ns/b", Some("shard-a"));
        pins.retain(&std::collections::BTreeSet::from([ring.clone()]));
        assert_eq!(pins.controller(&other, "/Secret/ns/b"), None);
    }

    #[test]
    fn invalid_values_and_impossible_keys_are_not_kept() {
        let pins = Pins::default();
        let ring = RingRef::new(RingKind::ClusterRing, "r");
        let huge = "x".repeat(1 << 20);
        pins.main_seen(&ring, "/Secret/ns/a", Some(&huge));
        // The child still sees an invalid pin (the ring decides, as for its controller), but
        // only the marker is kept.
        assert_eq!(
            pins.controller(&ring, "/Secret/ns/a").as_deref(),
            Some(INVALID_PIN)
        );
        assert!(!is_valid_pin(INVALID_PIN));
        pins.main_seen(&ring, "/Secret/ns/b", Some(""));
        assert_eq!(
            pins.controller(&ring, "/Secret/ns/b").as_deref(),
            Some(INVALID_PIN)
        );
        let long_key = format!("/Secret/ns/{}", "n".repeat(MAX_PIN_KEY_BYTES));
        pins.main_seen(&ring, &long_key, Some("shard-a"));
        assert_eq!(pins.controller(&ring, &long_key), None);
        assert_eq!(pins.remembered(&ring), 2);
    }

    #[test]
    fn at_most_the_cap_is_remembered_per_ring() {
        let not_remembered: Family<RingLabel, Counter> = Family::default();
        let pins = Pins::default().with_not_remembered(not_remembered.clone());
        let ring = RingRef::new(RingKind::ClusterRing, "r");
        let other = RingRef::new(RingKind::ControllerRing, "r");
        for i in 0..MAX_PINS_PER_RING + 100 {
            pins.main_seen(&ring, &format!("/Secret/ns/{i}"), Some("shard-a"));
        }
        assert_eq!(pins.remembered(&ring), MAX_PINS_PER_RING);
        assert_eq!(
            not_remembered.get_or_create(&RingLabel(ring.clone())).get(),
            100
        );
        let refused = format!("/Secret/ns/{}", MAX_PINS_PER_RING);
        assert_eq!(pins.controller(&ring, &refused), None);
        // Pins already remembered still change, and other rings have their own room.
        pins.main_seen(&ring, "/Secret/ns/0", Some("shard-b"));
        assert_eq!(
            pins.controller(&ring, "/Secret/ns/0").as_deref(),
            Some("shard-b")
        );
        pins.main_seen(&other, "/Secret/ns/0", Some("shard-c"));
        assert_eq!(pins.remembered(&other), 1);
        // Once a sync forgot some, there is room again.
        pins.main_seen(&ring, "/Secret/ns/0", None);
        pins.main_seen(&ring, &refused, Some("shard-a"));
        assert_eq!(pins.controller(&ring, &refused).as_deref(), Some("shard-a"));
    }

    #[test]
    fn pins_older_than_the_maximum_age_are_dropped_on_any_replica() {
        let ring = RingRef::new(RingKind::ClusterRing, "r");
        let kept = Pins::default();
        kept.main_seen(&ring, "/Secret/ns/a", Some("shard-a"));
        kept.prune_old();
        assert_eq!(kept.remembered(&ring), 1);
        let aged = Pins::default().with_max_age(Duration::ZERO);
        aged.main_seen(&ring, "/Secret/ns/a", Some("shard-a"));
        // No sync forgot it: the age alone drops it.
        aged.prune_old();
        assert_eq!(aged.remembered(&ring), 0);
    }

    #[test]
    fn namespace_pins_come_from_the_namespace_cache() {
        let (store, mut writer) = kube::runtime::reflector::store::<Namespace>();
        let mut ns = Namespace::default();
        ns.metadata.name = Some("team-a".into());
        ns.metadata.annotations =
            Some([("pin.example/r".to_string(), "shard-a".to_string())].into());
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(ns));
        let pins = Pins::new(store);
        assert_eq!(
            pins.namespace("team-a", "pin.example/r").as_deref(),
            Some("shard-a")
        );
        assert_eq!(pins.namespace("team-a", "pin.example/other"), None);
        assert_eq!(pins.namespace("team-b", "pin.example/r"), None);
    }
}
