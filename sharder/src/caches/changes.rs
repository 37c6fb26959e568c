//! The one place changes of the caches are announced: the ring views, the ring controller, the
//! shard-lease controller and the missed-assignment watches subscribe here instead of to the
//! watches themselves.

use tokio::sync::watch;

/// Counters bumped by the caches' tasks; subscribers wait for a counter to move. A counter, not a
/// queue: a burst of changes wakes a slow subscriber once.
///
/// Which rings a Lease change concerns is told by each kind's
/// [`LeaseIndex::subscribe`](super::LeaseIndex::subscribe); this hub only says that something
/// changed.
#[derive(Debug)]
pub(crate) struct Changes {
    rings: watch::Sender<u64>,
    leases: watch::Sender<u64>,
    namespaces: watch::Sender<u64>,
}

impl Default for Changes {
    fn default() -> Self {
        Self {
            rings: watch::Sender::new(0),
            leases: watch::Sender::new(0),
            namespaces: watch::Sender::new(0),
        }
    }
}

impl Changes {
    /// A cached ring of either kind was created, changed or deleted (or a ring cache relisted).
    pub(crate) fn ring_changed(&self) {
        self.rings.send_modify(|c| *c = c.wrapping_add(1));
    }

    /// A shard Lease changed in a way membership depends on (not on renewals).
    pub(crate) fn lease_changed(&self) {
        self.leases.send_modify(|c| *c = c.wrapping_add(1));
    }

    /// A Namespace was created, changed or deleted (or the namespace cache relisted): which
    /// namespaces a ring selects may have changed.
    pub(crate) fn namespace_changed(&self) {
        self.namespaces.send_modify(|c| *c = c.wrapping_add(1));
    }

    /// Wakes on every ring change after this call.
    pub(crate) fn rings(&self) -> watch::Receiver<u64> {
        self.rings.subscribe()
    }

    /// Wakes on every membership change of a shard Lease after this call.
    pub(crate) fn leases(&self) -> watch::Receiver<u64> {
        self.leases.subscribe()
    }

    /// Wakes on every Namespace change after this call.
    pub(crate) fn namespaces(&self) -> watch::Receiver<u64> {
        self.namespaces.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn subscribers_wake_once_per_burst() {
        let changes = Changes::default();
        let mut rings = changes.rings();
        let mut leases = changes.leases();
        let mut namespaces = changes.namespaces();
        changes.ring_changed();
        changes.ring_changed();
        assert!(rings.has_changed().unwrap());
        rings.changed().await.unwrap();
        assert!(!rings.has_changed().unwrap(), "two changes, one wake-up");
        assert!(
            !leases.has_changed().unwrap(),
            "a ring change is not a Lease change"
        );
        changes.lease_changed();
        leases.changed().await.unwrap();
        assert!(!rings.has_changed().unwrap());
        assert!(!namespaces.has_changed().unwrap());
        changes.namespace_changed();
        namespaces.changed().await.unwrap();
        assert!(!rings.has_changed().unwrap() && !leases.has_changed().unwrap());
    }
}
