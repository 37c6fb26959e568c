//! Direct moves in flight off each shard, so that a shard coming back is let in only after its
//! objects stopped moving (docs/protocol.md §22).
//!
//! The sync moves the objects of an unavailable shard directly, without a drain, because nobody
//! reconciles them. When that shard takes its Lease again while such moves are still on their way
//! to the API server, they land after the shard's new term may have listed the objects, and two
//! shards would reconcile them at once for a moment. So the shard-lease controller labels a Lease
//! `ready` again only when no direct move off its shard is in flight, and a move that would start
//! after the shard came back is not sent: the shard library starts a new term's work only on
//! that label.
//!
//! Both sides decide under one lock and from the same Lease cache: once the shard-lease
//! controller found no move in flight for a Lease it saw held, every later [`DirectMoves::begin`]
//! sees that Lease held too and refuses. When the last move off a shard lands, the registry says
//! so (on the change hub,
//! [`Changes::landed_direct_moves`]), and the controller looks at that shard's Lease again at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kube_sharding_api::RingRef;

use crate::changes::Changes;

/// The direct moves in flight, by ring and the shard they leave.
#[derive(Debug)]
pub(crate) struct DirectMoves {
    /// Ring → shard → moves in flight off it (never 0: an entry goes with its last move).
    in_flight: Mutex<HashMap<RingRef, HashMap<String, usize>>>,
    /// Where the last move in flight off a shard landing is announced.
    changes: Arc<Changes>,
}

/// One direct move in flight; dropping it ends it.
#[derive(Debug)]
#[must_use = "the move counts as in flight only while this is held"]
pub(crate) struct DirectMove {
    moves: Arc<DirectMoves>,
    ring: RingRef,
    shard: String,
}

impl DirectMoves {
    /// No move in flight; landings are announced on `changes`.
    pub(crate) fn new(changes: Arc<Changes>) -> Self {
        Self {
            in_flight: Mutex::default(),
            changes,
        }
    }

    /// Starts a direct move of an object of `ring` off `shard`, unless `shard_is_back` (asked
    /// under the lock, from the Lease cache) says the shard holds its Lease again: then `None`,
    /// and the move must not be sent.
    pub(crate) fn begin(
        self: &Arc<Self>,
        ring: &RingRef,
        shard: &str,
        shard_is_back: impl FnOnce() -> bool,
    ) -> Option<DirectMove> {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        if shard_is_back() {
            return None;
        }
        *in_flight
            .entry(ring.clone())
            .or_default()
            .entry(shard.to_string())
            .or_default() += 1;
        Some(DirectMove {
            moves: Arc::clone(self),
            ring: ring.clone(),
            shard: shard.to_string(),
        })
    }

    /// Whether a direct move of an object of `ring` off `shard` is in flight.
    pub(crate) fn in_flight(&self, ring: &RingRef, shard: &str) -> bool {
        let in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        in_flight
            .get(ring)
            .is_some_and(|shards| shards.contains_key(shard))
    }
}

impl Drop for DirectMove {
    fn drop(&mut self) {
        let mut in_flight = self
            .moves
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let Some(shards) = in_flight.get_mut(&self.ring) else {
            return;
        };
        if let Some(count) = shards.get_mut(&self.shard) {
            *count -= 1;
            if *count == 0 {
                shards.remove(&self.shard);
                self.moves
                    .changes
                    .direct_moves_landed(self.ring.clone(), self.shard.clone());
            }
        }
        if shards.is_empty() {
            in_flight.remove(&self.ring);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_sharding_api::RingKind;

    fn ring(name: &str) -> RingRef {
        RingRef::new(RingKind::ClusterRing, name.to_string())
    }

    #[test]
    fn a_move_is_in_flight_until_dropped() {
        let moves = Arc::new(DirectMoves::new(Arc::default()));
        let first = moves.begin(&ring("r"), "shard-a", || false).expect("sent");
        let second = moves.begin(&ring("r"), "shard-a", || false).expect("sent");
        assert!(moves.in_flight(&ring("r"), "shard-a"));
        assert!(!moves.in_flight(&ring("r"), "shard-b"), "another shard");
        assert!(!moves.in_flight(&ring("other"), "shard-a"), "another ring");
        drop(first);
        assert!(moves.in_flight(&ring("r"), "shard-a"), "one left");
        drop(second);
        assert!(!moves.in_flight(&ring("r"), "shard-a"));
        let left = moves.in_flight.lock().unwrap();
        assert!(left.is_empty(), "no entry outlives its moves: {left:?}");
    }

    #[test]
    fn the_last_move_off_a_shard_is_announced_when_it_lands() {
        let changes = Arc::new(Changes::default());
        let moves = Arc::new(DirectMoves::new(changes.clone()));
        let mut landed = changes.landed_direct_moves();
        let first = moves.begin(&ring("r"), "shard-a", || false).expect("sent");
        let second = moves.begin(&ring("r"), "shard-a", || false).expect("sent");
        let other = moves.begin(&ring("r"), "shard-b", || false).expect("sent");
        drop(first);
        assert!(landed.try_recv().is_err(), "one move off shard-a is left");
        drop(second);
        assert_eq!(
            landed.try_recv().unwrap(),
            (ring("r"), "shard-a".to_string())
        );
        assert!(landed.try_recv().is_err(), "announced once");
        drop(other);
        assert_eq!(
            landed.try_recv().unwrap(),
            (ring("r"), "shard-b".to_string())
        );
    }

    #[test]
    fn no_move_starts_once_the_shard_is_back() {
        let moves = Arc::new(DirectMoves::new(Arc::default()));
        assert!(moves.begin(&ring("r"), "shard-a", || true).is_none());
        assert!(!moves.in_flight(&ring("r"), "shard-a"), "nothing counted");
    }
}
