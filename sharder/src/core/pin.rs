//! Pins: an annotation that names the shard an object must live on, set on the object itself,
//! on its namespace (for every object of the ring there), or inherited from its controller
//! (docs/protocol.md §21).
//!
//! A pin only ever chooses among the available shards: a pin to a shard that is not available,
//! or a malformed one, leaves the object to the hash ring and is reported, never refusing a write.

use kube_sharding_api::labels::is_valid_label_value;

use super::hash_ring::HashRing;

/// Where the pin of an object came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PinSource {
    /// The object's own annotation.
    Object,
    /// Its controller's pin (its own annotation or its namespace's).
    Controller,
    /// The annotation on its namespace.
    Namespace,
}

impl PinSource {
    /// A short name for logs, warnings and `kubectl sharding explain`.
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Object => "object",
            Self::Controller => "controller",
            Self::Namespace => "namespace",
        }
    }
}

/// The pin values that may apply to one object, most specific first; each `None` when absent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PinInputs<'a> {
    /// The object's own annotation; only read for a main object (a controlled object follows its
    /// controller).
    pub(crate) object: Option<&'a str>,
    /// The shard its controller is pinned to, for a controlled object.
    pub(crate) controller: Option<&'a str>,
    /// The annotation on its namespace.
    pub(crate) namespace: Option<&'a str>,
}

impl<'a> PinInputs<'a> {
    /// The pin that applies: the most specific one present, with its source.
    pub(crate) fn effective(&self) -> Option<(&'a str, PinSource)> {
        self.object
            .map(|v| (v, PinSource::Object))
            .or_else(|| self.controller.map(|v| (v, PinSource::Controller)))
            .or_else(|| self.namespace.map(|v| (v, PinSource::Namespace)))
    }
}

/// What a pin did for one object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum PinOutcome {
    /// No pin applies: the hash ring decides.
    #[default]
    Unpinned,
    /// The pin placed the object on its shard.
    Honoured {
        /// Where the pin came from.
        source: PinSource,
    },
    /// The pinned shard is not available: the hash ring decides until it is.
    Unavailable {
        /// The shard the pin names.
        shard: String,
        /// Where the pin came from.
        source: PinSource,
    },
    /// The pin's value cannot name a shard: the hash ring decides.
    Invalid {
        /// The value as written.
        value: String,
        /// Where the pin came from.
        source: PinSource,
    },
}

impl PinOutcome {
    /// Whether a controlled object's shard must come from where its controller sits now, not
    /// from the ring: the ring's choice while the ring changes (no pin decided), or its
    /// controller's pin, which the controller may not have reached yet. A shard must not write a
    /// child that another shard reconciles while it still holds the controller.
    pub(crate) const fn asks_controller(&self, recently_moved: bool) -> bool {
        match self {
            Self::Honoured { source } => matches!(source, PinSource::Controller),
            Self::Unpinned | Self::Unavailable { .. } | Self::Invalid { .. } => recently_moved,
        }
    }

    /// The `state` label of `controller_sharding_pinned_objects` for this outcome; `None` when no
    /// pin applies.
    pub(crate) const fn state(&self) -> Option<&'static str> {
        match self {
            Self::Unpinned => None,
            Self::Honoured { .. } => Some("honoured"),
            Self::Unavailable { .. } => Some("unavailable"),
            Self::Invalid { .. } => Some("invalid"),
        }
    }

    /// A sentence for users on why the pin did not decide, for unsatisfied pins.
    pub(crate) fn problem(&self) -> Option<String> {
        match self {
            Self::Unavailable { shard, source } => Some(format!(
                "The {} pin names shard {shard:?}, which is not available; the ring places the object until it is",
                source.as_str()
            )),
            Self::Invalid { value, source } => Some(format!(
                "The {} pin {value:?} is not a shard name (a non-empty label value); the ring places the object",
                source.as_str()
            )),
            Self::Unpinned | Self::Honoured { .. } => None,
        }
    }
}

/// Whether `value` can name a shard: a non-empty label value (shard names are label values).
pub(crate) fn is_valid_pin(value: &str) -> bool {
    !value.is_empty() && is_valid_label_value(value)
}

/// The shard `pins` place an object on among the shards of `ring` (the ring's own copy of the
/// name), and what the pin did; `None` leaves the object to the hash ring.
pub(crate) fn resolve<'r>(
    ring: &'r HashRing,
    pins: &PinInputs<'_>,
) -> (Option<&'r str>, PinOutcome) {
    let Some((value, source)) = pins.effective() else {
        return (None, PinOutcome::Unpinned);
    };
    if !is_valid_pin(value) {
        let value = value.to_string();
        return (None, PinOutcome::Invalid { value, source });
    }
    match ring.member(value) {
        Some(shard) => (Some(shard), PinOutcome::Honoured { source }),
        None => {
            let shard = value.to_string();
            (None, PinOutcome::Unavailable { shard, source })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring() -> HashRing {
        HashRing::new(["shard-a", "shard-b"])
    }

    #[test]
    fn the_most_specific_pin_applies() {
        let all = PinInputs {
            object: Some("shard-a"),
            controller: Some("shard-b"),
            namespace: Some("shard-c"),
        };
        assert_eq!(all.effective(), Some(("shard-a", PinSource::Object)));
        let inherited = PinInputs {
            object: None,
            ..all
        };
        assert_eq!(
            inherited.effective(),
            Some(("shard-b", PinSource::Controller))
        );
        let namespace = PinInputs {
            namespace: Some("shard-c"),
            ..PinInputs::default()
        };
        assert_eq!(
            namespace.effective(),
            Some(("shard-c", PinSource::Namespace))
        );
        assert_eq!(PinInputs::default().effective(), None);
    }

    #[test]
    fn an_available_shard_is_honoured() {
        let ring = ring();
        let pins = PinInputs {
            namespace: Some("shard-b"),
            ..PinInputs::default()
        };
        let (shard, outcome) = resolve(&ring, &pins);
        assert_eq!(shard, Some("shard-b"));
        assert_eq!(
            outcome,
            PinOutcome::Honoured {
                source: PinSource::Namespace
            }
        );
        assert_eq!(outcome.problem(), None);
    }

    #[test]
    fn a_missing_shard_falls_back_and_says_so() {
        let ring = ring();
        let pins = PinInputs {
            object: Some("shard-z"),
            ..PinInputs::default()
        };
        let (shard, outcome) = resolve(&ring, &pins);
        assert_eq!(shard, None);
        assert!(
            outcome.problem().is_some_and(|p| p.contains("\"shard-z\"")),
            "{outcome:?}"
        );
        // An empty ring cannot satisfy any pin.
        let empty = HashRing::new(Vec::<String>::new());
        let (shard, outcome) = resolve(&empty, &pins);
        assert_eq!(shard, None);
        assert!(matches!(outcome, PinOutcome::Unavailable { .. }));
    }

    #[test]
    fn children_ask_their_controller_when_its_pin_or_a_ring_change_decides() {
        let honoured = |source| PinOutcome::Honoured { source };
        assert!(honoured(PinSource::Controller).asks_controller(false));
        assert!(!honoured(PinSource::Namespace).asks_controller(true));
        assert!(PinOutcome::Unpinned.asks_controller(true));
        assert!(!PinOutcome::Unpinned.asks_controller(false));
        let unavailable = PinOutcome::Unavailable {
            shard: "s".into(),
            source: PinSource::Controller,
        };
        assert!(unavailable.asks_controller(true));
        assert!(!unavailable.asks_controller(false));
    }

    #[test]
    fn malformed_values_are_invalid_not_errors() {
        let ring = ring();
        let long = "x".repeat(64);
        for value in ["", "-a", "shard a", "a/b", long.as_str()] {
            let pins = PinInputs {
                object: Some(value),
                ..PinInputs::default()
            };
            let (shard, outcome) = resolve(&ring, &pins);
            assert_eq!(shard, None, "{value:?}");
            assert!(
                matches!(outcome, PinOutcome::Invalid { .. }),
                "{value:?}: {outcome:?}"
            );
        }
        assert!(is_valid_pin("shard-a.b_c"));
    }
}
