//! Whether the API server reaches each ring's webhook, as the leader's moves show it.
//!
//! A move removes an object's shard label so that the webhook assigns it in the same request.
//! When the API server cannot call the webhook (no usable CA bundle, a wrong Service, a network
//! policy), every such request ends with the object unassigned (`failurePolicy: Ignore`), and a
//! sync of a big ring would send one useless write per object, retried every few seconds. So
//! the first move that does not land marks the ring's webhook unreachable: from then on no move
//! of that ring goes out, except one probe at a time, a dry run, with backoff from
//! `PROBE_INITIAL` up to `PROBE_MAX`. The first probe (or move) that lands marks it reachable
//! again. The ring controller reports the state in the ring's `Ready` condition.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube_sharding_api::RingRef;

use crate::changes::Changes;

/// First delay between probes of an unreachable webhook.
pub(crate) const PROBE_INITIAL: Duration = Duration::from_secs(1);
/// Longest delay between probes: objects missed while the webhook was unreachable must be
/// assigned within seconds of it answering again.
pub(crate) const PROBE_MAX: Duration = Duration::from_secs(5);

/// What is known about a ring whose webhook is unreachable.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Unreachable {
    /// Failed moves and probes in a row.
    failures: u32,
    /// When the next probe may go out.
    next_probe: Instant,
}

/// What a move of a ring may do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MoveGate {
    /// The webhook answers: move.
    Open,
    /// The webhook did not answer; this move is the probe: dry-run it first.
    Probe,
    /// The webhook did not answer and another probe is not due yet: do not move.
    Closed,
}

/// The reachability of every ring's webhook, shared by the sync, the missed-assignment path, the
/// ring controller and the metrics.
#[derive(Debug)]
pub(crate) struct Reachability {
    rings: Mutex<HashMap<RingRef, Unreachable>>,
    /// Where flips are announced, for the ring controller to update the ring's status.
    changes: Arc<Changes>,
}

impl Reachability {
    /// Every webhook reachable until a move says otherwise; flips are announced on `changes`.
    pub(crate) fn new(changes: Arc<Changes>) -> Self {
        Self {
            rings: Mutex::default(),
            changes,
        }
    }

    /// Whether `ring`'s webhook is known to be unreachable.
    pub(crate) fn is_unreachable(&self, ring: &RingRef) -> bool {
        self.rings.lock().is_ok_and(|m| m.contains_key(ring))
    }

    /// Every ring whose webhook is unreachable.
    pub(crate) fn unreachable(&self) -> Vec<RingRef> {
        self.rings
            .lock()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// What a move of `ring` may do at `now`; taking the probe makes the next one wait.
    pub(crate) fn gate(&self, ring: &RingRef, now: Instant) -> MoveGate {
        let Ok(mut map) = self.rings.lock() else {
            return MoveGate::Open;
        };
        match map.get_mut(ring) {
            None => MoveGate::Open,
            Some(state) if state.next_probe <= now => {
                // Claim the probe; its outcome sets the next time.
                state.next_probe = now + PROBE_MAX;
                MoveGate::Probe
            }
            Some(_) => MoveGate::Closed,
        }
    }

    /// Records a move or probe of `ring` that did not land; returns whether the ring just became
    /// unreachable.
    pub(crate) fn failed(&self, ring: &RingRef, now: Instant) -> bool {
        let Ok(mut map) = self.rings.lock() else {
            return false;
        };
        let state = map.entry(ring.clone()).or_insert(Unreachable {
            failures: 0,
            next_probe: now,
        });
        state.failures += 1;
        let factor = 2u32.saturating_pow(state.failures.saturating_sub(1));
        state.next_probe = now + PROBE_INITIAL.saturating_mul(factor).min(PROBE_MAX);
        let newly = state.failures == 1;
        drop(map);
        if newly {
            self.changes.reachability_flipped(ring.clone());
        }
        newly
    }

    /// Records a move or probe of `ring` that landed; returns whether the ring was unreachable.
    pub(crate) fn landed(&self, ring: &RingRef) -> bool {
        let recovered = self
            .rings
            .lock()
            .is_ok_and(|mut m| m.remove(ring).is_some());
        if recovered {
            self.changes.reachability_flipped(ring.clone());
        }
        recovered
    }

    /// Forgets rings that are gone.
    pub(crate) fn retain(&self, keep: impl Fn(&RingRef) -> bool) {
        if let Ok(mut map) = self.rings.lock() {
            map.retain(|r, _| keep(r));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_sharding_api::RingKind;

    #[test]
    fn moves_stop_after_a_miss_and_probes_back_off() {
        let ring = RingRef::new(RingKind::ClusterRing, "r");
        let other = RingRef::new(RingKind::ControllerRing, "r");
        let changes = Arc::new(Changes::default());
        let reach = Reachability::new(changes.clone());
        let mut flips = changes.reachability_flips();
        let t0 = Instant::now();
        assert_eq!(reach.gate(&ring, t0), MoveGate::Open);
        assert!(reach.failed(&ring, t0), "just became unreachable");
        assert_eq!(flips.try_recv().ok(), Some(ring.clone()));
        assert_eq!(reach.gate(&ring, t0), MoveGate::Closed);
        assert_eq!(reach.gate(&other, t0), MoveGate::Open, "rings are apart");
        // First probe after 1 s; only one caller gets it.
        let t1 = t0 + PROBE_INITIAL;
        assert_eq!(reach.gate(&ring, t1), MoveGate::Probe);
        assert_eq!(reach.gate(&ring, t1), MoveGate::Closed);
        assert!(!reach.failed(&ring, t1), "still unreachable, no new flip");
        assert!(flips.try_recv().is_err());
        // Then 2 s, 4 s, and never more than 5 s.
        assert_eq!(
            reach.gate(&ring, t1 + Duration::from_millis(1999)),
            MoveGate::Closed
        );
        let t2 = t1 + Duration::from_secs(2);
        assert_eq!(reach.gate(&ring, t2), MoveGate::Probe);
        reach.failed(&ring, t2);
        let t3 = t2 + Duration::from_secs(4);
        assert_eq!(reach.gate(&ring, t3), MoveGate::Probe);
        reach.failed(&ring, t3);
        assert_eq!(reach.gate(&ring, t3 + PROBE_MAX), MoveGate::Probe);
        assert_eq!(reach.unreachable(), std::slice::from_ref(&ring));
        // A probe lands: moves go again.
        assert!(reach.landed(&ring));
        assert_eq!(flips.try_recv().ok(), Some(ring.clone()));
        assert_eq!(reach.gate(&ring, t3), MoveGate::Open);
        assert!(!reach.landed(&ring));
    }
}
