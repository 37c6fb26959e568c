//! The rebalancing decision of the sharder controller (docs/protocol.md §9): what to do with one
//! object given its labels and the ring's current assignment. Pure: no I/O, no time.

use crate::core::key::{KeyError, KeyOutcome};
use crate::core::pin::PinOutcome;

/// What the sharder does with an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RebalanceDecision {
    /// Leave it alone.
    Keep,
    /// Ask its current (available) shard to let go: add the drain label. The shard acknowledges by
    /// removing both labels, and that update reaches the webhook, which assigns the desired shard.
    Drain,
    /// Remove the shard and drain labels: the resulting update reaches the webhook, which assigns
    /// the desired shard in the same request.
    Move,
}

/// The labels and role of one object, as far as the decision needs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ObjectState<'a> {
    /// Value of the ring's shard label, if set and non-empty.
    pub current: Option<&'a str>,
    /// Whether the object carries the ring's drain label.
    pub draining: bool,
    /// Whether the object is of a main resource (controlled objects are never drained).
    pub main: bool,
}

/// Decides for one object. `desired` is the shard the ring assigns it to now (`None` without a
/// key or without available shards); `is_available` tells whether a shard is available.
pub(crate) fn decide(
    object: ObjectState<'_>,
    desired: Option<&str>,
    is_available: impl Fn(&str) -> bool,
) -> RebalanceDecision {
    let Some(desired) = desired else {
        return RebalanceDecision::Keep;
    };
    match object.current {
        Some(current) if current == desired => RebalanceDecision::Keep,
        Some(current) if object.main && is_available(current) => {
            if object.draining {
                // Already asked; the shard has not acknowledged yet.
                RebalanceDecision::Keep
            } else {
                RebalanceDecision::Drain
            }
        }
        // Unassigned, assigned to an unavailable shard, or a controlled object.
        _ => RebalanceDecision::Move,
    }
}

/// Whether a controlled object whose decision is [`RebalanceDecision::Move`] must wait for its
/// controller: the controller still sits on the object's `current` shard (`owner_on_current`),
/// which is available, so that shard is still reconciling the controller (until it acknowledges
/// its drain) and would write the object back.
pub(crate) fn waits_for_owner(
    current: Option<&str>,
    owner_on_current: bool,
    desired: Option<&str>,
    is_available: impl Fn(&str) -> bool,
) -> bool {
    match current {
        Some(current) => owner_on_current && desired != Some(current) && is_available(current),
        None => false,
    }
}

/// One object's standing in a ring, as the ring's view places it (`RingView::placement`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Placement<'a> {
    /// Its hash key, or why it has none.
    pub(crate) key: Result<KeyOutcome, KeyError>,
    /// The shard the ring wants it on now: `None` without a key or without available shards.
    pub(crate) desired: Option<&'a str>,
    /// Its shard label (non-empty values only), drain label and role.
    pub(crate) object: ObjectState<'a>,
    /// What the sharder's sync does with it.
    pub(crate) decision: RebalanceDecision,
    /// Whether a pin decided `desired`, or why not.
    pub(crate) pin: PinOutcome,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(current: Option<&str>, draining: bool, main: bool) -> ObjectState<'_> {
        ObjectState {
            current,
            draining,
            main,
        }
    }

    const AVAILABLE: [&str; 2] = ["a", "b"];

    fn available(s: &str) -> bool {
        AVAILABLE.contains(&s)
    }

    #[test]
    fn decision_table() {
        use RebalanceDecision::*;
        let cases = [
            // (current, draining, main, desired) -> decision
            ((None, false, true, None), Keep),
            ((Some("a"), false, true, None), Keep),
            ((Some("a"), false, true, Some("a")), Keep),
            ((Some("a"), true, true, Some("a")), Keep),
            ((Some("a"), false, true, Some("b")), Drain),
            ((Some("a"), true, true, Some("b")), Keep),
            ((Some("gone"), false, true, Some("b")), Move),
            ((Some("gone"), true, true, Some("b")), Move),
            ((None, false, true, Some("b")), Move),
            ((None, true, true, Some("b")), Move),
            ((Some("a"), false, false, Some("b")), Move),
            ((Some("a"), false, false, Some("a")), Keep),
            ((None, false, false, Some("a")), Move),
        ];
        for ((current, draining, main, desired), expected) in cases {
            assert_eq!(
                decide(state(current, draining, main), desired, available),
                expected,
                "current={current:?} draining={draining} main={main} desired={desired:?}"
            );
        }
    }

    #[test]
    fn controlled_objects_wait_while_their_owner_stays_on_a_live_shard() {
        // Owner still on live shard a: wait.
        assert!(waits_for_owner(Some("a"), true, Some("b"), available));
        // Owner gone over to b already, unassigned meanwhile, or not seen at all: move.
        assert!(!waits_for_owner(Some("a"), false, Some("b"), available));
        // Already where the ring wants it: nothing to wait for.
        assert!(!waits_for_owner(Some("a"), true, Some("a"), available));
        // Old shard dead: nobody reconciles there, move at once.
        assert!(!waits_for_owner(Some("gone"), true, Some("b"), available));
        // Unassigned controlled object: assign at once.
        assert!(!waits_for_owner(None, true, Some("b"), available));
    }
}
