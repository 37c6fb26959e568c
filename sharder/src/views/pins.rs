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

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::reflector::{ObjectRef, Store};
use sharding_crds::RingRef;

/// Namespace pins and remembered controller pins, shared by every view of a process.
#[derive(Clone)]
pub struct Pins {
    namespaces: Store<Namespace>,
    controllers: Arc<RwLock<HashMap<RingRef, ControllerPins>>>,
}

/// One ring's pinned main objects: hash key → its pin and when it was last seen.
type ControllerPins = HashMap<String, (String, Instant)>;

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
        }
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
        Some(controllers.get(ring)?.get(key)?.0.clone())
    }

    /// Remembers the pin `value` (its own annotation; `None`: none) of the main object with hash
    /// key `key` in `ring`, seen now.
    pub(crate) fn main_seen(&self, ring: &RingRef, key: &str, value: Option<&str>) {
        // Most main objects carry no pin and were never pinned: a read lock finds nothing to do.
        let known = self
            .controllers
            .read()
            .ok()
            .is_some_and(|c| c.get(ring).is_some_and(|pins| pins.contains_key(key)));
        if !known && value.is_none() {
            return;
        }
        let Ok(mut controllers) = self.controllers.write() else {
            return;
        };
        match value {
            Some(value) => {
                controllers
                    .entry(ring.clone())
                    .or_default()
                    .insert(key.to_string(), (value.to_string(), Instant::now()));
            }
            None => {
                if let Some(pins) = controllers.get_mut(ring) {
                    pins.remove(key);
                }
            }
        }
    }

    /// Forgets the pins of `ring` not seen since `since`: a sync that listed every main object
    /// from `since` on did not meet those objects, so they are gone (or lost their pin unseen).
    pub(crate) fn forget_unseen(&self, ring: &RingRef, since: Instant) {
        if let Ok(mut controllers) = self.controllers.write()
            && let Some(pins) = controllers.get_mut(ring)
        {
            pins.retain(|_, (_, seen)| *seen >= since);
        }
    }

    /// Forgets the rings not in `keep`.
    pub(crate) fn retain(&self, keep: &std::collections::BTreeSet<RingRef>) {
        if let Ok(mut controllers) = self.controllers.write() {
            controllers.retain(|ring, _| keep.contains(ring));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sharding_crds::RingKind;

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
