//! The registry of ring views, shared by the webhook and the controllers.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use kube_sharding_api::RingRef;

use super::view::RingView;

/// The current view of every ring, shared between the webhook and the controllers.
#[derive(Debug)]
pub struct Views {
    views: RwLock<HashMap<RingRef, Arc<RingView>>>,
    revision: AtomicU64,
    changed: tokio::sync::watch::Sender<u64>,
    /// Slots for controller lookups (`controller_shard`), which admission requests trigger.
    pub(crate) lookups: tokio::sync::Semaphore,
}

impl Default for Views {
    fn default() -> Self {
        Self {
            views: RwLock::default(),
            revision: AtomicU64::new(0),
            changed: tokio::sync::watch::Sender::new(0),
            lookups: tokio::sync::Semaphore::new(super::controller_lookup::MAX_LOOKUPS_IN_FLIGHT),
        }
    }
}

impl Views {
    /// The current view of `ring`, if the ring is known.
    pub(crate) fn get(&self, ring: &RingRef) -> Option<Arc<RingView>> {
        self.views.read().ok()?.get(ring).cloned()
    }

    /// Every current view.
    pub(crate) fn all(&self) -> Vec<Arc<RingView>> {
        self.views
            .read()
            .map(|v| v.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Replaces the view of a ring, giving it a new revision.
    pub fn insert(&self, mut view: RingView) {
        let revision = self.revision.fetch_add(1, Ordering::SeqCst) + 1;
        view.revision = revision;
        if let Ok(mut views) = self.views.write() {
            views.insert(view.ring_ref(), Arc::new(view));
        }
        self.changed.send_replace(revision);
    }

    /// Forgets every ring not in `keep`.
    pub(crate) fn retain(&self, keep: &BTreeSet<RingRef>) {
        let removed = self.views.write().is_ok_and(|mut views| {
            let before = views.len();
            views.retain(|name, _| keep.contains(name));
            views.len() != before
        });
        if removed {
            let revision = self.revision.fetch_add(1, Ordering::SeqCst) + 1;
            self.changed.send_replace(revision);
        }
    }

    /// A receiver that is notified whenever a view is inserted or removed.
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }
}
