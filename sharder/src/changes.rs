//! The one place every change a controller or the ring views can wake on is announced: the
//! caches' rings, Leases and Namespaces, the Lease index's detailed membership changes, flips of a
//! ring's webhook reachability, and the last direct move off a shard landing. Producers send here;
//! subscribers take a receiver here, never from the producer.
//!
//! Two shapes: counters (`watch`) where a subscriber only needs to know that something changed, so
//! a burst wakes it once; and `broadcast` queues where it needs to know what changed (which Lease,
//! which ring), with a capacity after which a slow subscriber is told it lagged and looks at
//! everything.

use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::reflector::ObjectRef;
use kube_sharding_api::{RingKind, RingRef};
use tokio::sync::{broadcast, watch};

/// How many Lease changes a slow subscriber may fall behind before it is told to start over
/// ([`LeaseChange::All`] semantics on `Lagged`).
const LEASE_CHANGES_CAPACITY: usize = 4096;

/// How many reachability flips a slow subscriber may fall behind by.
const REACHABILITY_CAPACITY: usize = 64;

/// How many "the last move off a shard landed" notices a slow subscriber may fall behind by
/// before it is told it lagged (and looks at every Lease).
const LANDED_CAPACITY: usize = 256;

/// What changed among the Leases of one kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LeaseChange {
    /// The membership of `rings` may have changed because of `lease` (the ring it left and the
    /// ring it joined, when its ring label changed).
    Membership {
        /// The Lease.
        lease: ObjectRef<Lease>,
        /// The rings (names, of the index's kind) whose members may have changed.
        rings: Vec<String>,
    },
    /// The Lease's state label no longer matches its timing, or its holder's clock skew crossed
    /// the warning threshold; membership is unchanged.
    State(ObjectRef<Lease>),
    /// The cache was listed again: anything may have changed.
    All,
}

/// The change hub of one sharder process.
#[derive(Debug)]
pub(crate) struct Changes {
    rings: watch::Sender<u64>,
    leases: watch::Sender<u64>,
    namespaces: watch::Sender<u64>,
    cluster_ring_leases: broadcast::Sender<LeaseChange>,
    controller_ring_leases: broadcast::Sender<LeaseChange>,
    reachability: broadcast::Sender<RingRef>,
    landed: broadcast::Sender<(RingRef, String)>,
}

impl Default for Changes {
    fn default() -> Self {
        Self {
            rings: watch::Sender::new(0),
            leases: watch::Sender::new(0),
            namespaces: watch::Sender::new(0),
            cluster_ring_leases: broadcast::Sender::new(LEASE_CHANGES_CAPACITY),
            controller_ring_leases: broadcast::Sender::new(LEASE_CHANGES_CAPACITY),
            reachability: broadcast::Sender::new(REACHABILITY_CAPACITY),
            landed: broadcast::Sender::new(LANDED_CAPACITY),
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

    /// What changed among the Leases of `kind`, as the kind's Lease index tells it.
    pub(crate) fn lease_change(&self, kind: RingKind, change: LeaseChange) {
        // Nobody listening (a replica that does not lead) is fine.
        let _ = self.lease_sender(kind).send(change);
    }

    /// The webhook reachability of `ring` flipped.
    pub(crate) fn reachability_flipped(&self, ring: RingRef) {
        let _ = self.reachability.send(ring);
    }

    /// The last direct move in flight off `shard` of `ring` landed.
    pub(crate) fn direct_moves_landed(&self, ring: RingRef, shard: String) {
        let _ = self.landed.send((ring, shard));
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

    /// Every change among the Leases of `kind` after this call, with what it concerns.
    pub(crate) fn lease_changes(&self, kind: RingKind) -> broadcast::Receiver<LeaseChange> {
        self.lease_sender(kind).subscribe()
    }

    /// Every ring whose webhook reachability flips after this call.
    pub(crate) fn reachability_flips(&self) -> broadcast::Receiver<RingRef> {
        self.reachability.subscribe()
    }

    /// (ring, shard) each time the last direct move in flight off that shard lands after this
    /// call.
    pub(crate) fn landed_direct_moves(&self) -> broadcast::Receiver<(RingRef, String)> {
        self.landed.subscribe()
    }

    fn lease_sender(&self, kind: RingKind) -> &broadcast::Sender<LeaseChange> {
        match kind {
            RingKind::ClusterRing => &self.cluster_ring_leases,
            RingKind::ControllerRing => &self.controller_ring_leases,
        }
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

    #[test]
    fn lease_changes_reach_the_subscribers_of_their_kind_only() {
        let changes = Changes::default();
        let mut cluster = changes.lease_changes(RingKind::ClusterRing);
        let mut controller = changes.lease_changes(RingKind::ControllerRing);
        changes.lease_change(RingKind::ControllerRing, LeaseChange::All);
        assert_eq!(controller.try_recv().ok(), Some(LeaseChange::All));
        assert!(cluster.try_recv().is_err(), "another kind's change");
        let ring = RingRef::new(RingKind::ClusterRing, "r");
        let mut flips = changes.reachability_flips();
        let mut landed = changes.landed_direct_moves();
        changes.reachability_flipped(ring.clone());
        changes.direct_moves_landed(ring.clone(), "shard-a".into());
        assert_eq!(flips.try_recv().ok(), Some(ring.clone()));
        assert_eq!(landed.try_recv().ok(), Some((ring, "shard-a".to_string())));
        assert!(cluster.try_recv().is_err(), "neither is a Lease change");
    }
}
