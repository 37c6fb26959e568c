//! Pins (docs/protocol.md §21) under faults: in each ring a few Secrets pinned to shards the
//! faults strike, and one namespace pinned, and the placement the pins predict, computed from the
//! protocol alone beside the independent hash ring.
//!
//! A pinned shard that faults make unavailable leaves its objects to the hash ring; once it is
//! available again, the sync its return triggers drains them back to it. So the convergence check
//! expects each pinned object on its pin exactly when that shard is available at the end.

use std::collections::{BTreeMap, BTreeSet};

use e2e::IndependentRing;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Client;
use kube::api::{Api, Patch, PostParams};
use serde::Serialize;

use crate::ring::secret_key;

/// Prefix of the pinned Secrets' names; the churn never touches them (its names start `s-`).
pub(crate) const PINNED_PREFIX: &str = "pinned-";

/// Pinned Secrets per ring: enough for every starting shard to be pinned at least twice.
const PINNED_OBJECTS: usize = 6;

/// The pins the tool sets in one ring.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PinPlan {
    /// `(namespace, shard)`: a namespace pinned as a whole, if the ring has a namespace to spare
    /// (the first one holds the readiness and convergence probes, which must follow the ring).
    pub(crate) namespace: Option<(String, String)>,
    /// Secrets with a pin of their own.
    pub(crate) objects: Vec<PinnedObject>,
}

/// A Secret with a pin of its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PinnedObject {
    pub(crate) namespace: String,
    pub(crate) name: String,
    /// The shard its pin names.
    pub(crate) shard: String,
}

impl PinPlan {
    /// Pins for a ring over `namespaces` whose shards are `shards` at the start, and whose first
    /// scale-out will add `next_shard`. Every pin names a shard other than the one the hash ring of
    /// `shards` gives the object (and, in the pinned namespace, other than the namespace's pin),
    /// so that an object on its pin proves the pin placed it. The last object is pinned to
    /// `next_shard`, unavailable until a scale-out adds it: it starts on the ring's choice.
    pub(crate) fn draw(namespaces: &[String], shards: &[String], next_shard: &str) -> Self {
        let ring = IndependentRing::unweighted(shards.iter().map(String::as_str));
        let namespace = (namespaces.len() >= 2)
            .then(|| namespaces.last().zip(shards.first()))
            .flatten()
            .map(|(ns, shard)| (ns.clone(), shard.clone()));
        let objects = (0..PINNED_OBJECTS)
            .map(|i| {
                let ns = &namespaces[i % namespaces.len()];
                let name = format!("{PINNED_PREFIX}{i}");
                let hashed = ring.try_shard_for(&secret_key(ns, &name));
                let namespace_pin = namespace
                    .as_ref()
                    .filter(|(pinned, _)| pinned == ns)
                    .map(|(_, shard)| shard.as_str());
                let shard = if i + 1 == PINNED_OBJECTS {
                    next_shard
                } else {
                    // Prefer a shard that is neither choice; with two shards, one that differs
                    // from the hash ring's.
                    let from = |avoid: &[Option<&str>]| {
                        (0..shards.len())
                            .map(|k| shards[(i + k) % shards.len()].as_str())
                            .find(|s| !avoid.contains(&Some(*s)))
                    };
                    from(&[hashed, namespace_pin])
                        .or_else(|| from(&[hashed]))
                        .unwrap_or(next_shard)
                };
                PinnedObject {
                    namespace: ns.clone(),
                    name,
                    shard: shard.to_string(),
                }
            })
            .collect();
        Self { namespace, objects }
    }

    /// Every shard a pin names.
    pub(crate) fn shards(&self) -> BTreeSet<&str> {
        self.objects
            .iter()
            .map(|o| o.shard.as_str())
            .chain(self.namespace.as_ref().map(|(_, shard)| shard.as_str()))
            .collect()
    }

    /// Annotates the pinned namespace with `pin_key`: before the sharders start, so that they
    /// know the pin before they place any object there.
    pub(crate) async fn pin_namespace(&self, client: &Client, pin_key: &str) -> anyhow::Result<()> {
        if let Some((namespace, shard)) = &self.namespace {
            let patch = serde_json::json!({"metadata": {"annotations": {pin_key: shard}}});
            Api::<Namespace>::all(client.clone())
                .patch(namespace, &e2e::patch_params(), &Patch::Merge(&patch))
                .await?;
        }
        Ok(())
    }

    /// Creates the pinned Secrets, each annotated with `pin_key`.
    pub(crate) async fn create_objects(
        &self,
        client: &Client,
        pin_key: &str,
    ) -> anyhow::Result<()> {
        for object in &self.objects {
            let secret: Secret = serde_json::from_value(serde_json::json!({
                "metadata": {"name": object.name, "annotations": {pin_key: object.shard}},
                "stringData": {"pin": object.shard},
            }))?;
            Api::<Secret>::namespaced(client.clone(), &object.namespace)
                .create(&PostParams::default(), &secret)
                .await?;
        }
        Ok(())
    }
}

/// The shard a Secret (and every object it controls) must be on (docs/protocol.md §21): the
/// most specific pin that applies, its own `own` else its namespace's `namespace`, if the shard
/// it names is `available`; otherwise, and without a pin, the hash ring's choice for `key`. A
/// pin to an unavailable shard leaves the object to the hash ring even where a less specific pin
/// names an available one.
pub(crate) fn predict<'a>(
    ring: &'a IndependentRing,
    available: &BTreeSet<String>,
    own: Option<&'a str>,
    namespace: Option<&'a str>,
    key: &str,
) -> Option<&'a str> {
    match own.or(namespace) {
        Some(pin) if available.contains(pin) => Some(pin),
        _ => ring.try_shard_for(key),
    }
}

/// How the pinned Secrets of one ring ended, and what they went through.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub(crate) struct PinCounts {
    /// Secrets with a pin of their own at the end, and how many of them are on it.
    pub(crate) object_pinned: usize,
    pub(crate) on_object_pin: usize,
    /// Secrets whose namespace's pin applies (no pin of their own), and how many are on it.
    pub(crate) namespace_pinned: usize,
    pub(crate) on_namespace_pin: usize,
}

/// Counts, for a converged or unconverged snapshot alike, the pinned Secrets and those on the
/// shard their pin names. `secrets` are `(namespace, own pin, shard label)`; `namespace_pins`
/// maps namespaces to their pin.
pub(crate) fn count<'a>(
    secrets: impl IntoIterator<Item = (&'a str, Option<&'a str>, Option<&'a str>)>,
    namespace_pins: &BTreeMap<String, String>,
) -> PinCounts {
    let mut counts = PinCounts::default();
    for (ns, own, shard) in secrets {
        if let Some(pin) = own {
            counts.object_pinned += 1;
            counts.on_object_pin += usize::from(shard == Some(pin));
        } else if let Some(pin) = namespace_pins.get(ns) {
            counts.namespace_pinned += 1;
            counts.on_namespace_pin += usize::from(shard == Some(pin.as_str()));
        }
    }
    counts
}

/// How often an object whose shard labels were `held` (in order, repeats collapsed) came back
/// to `pin` after leaving it: each return is a move back through the sync the pinned shard's
/// return triggered.
pub(crate) fn returns(held: &[String], pin: &str) -> usize {
    held.windows(2)
        .filter(|pair| pair[0] != pin && pair[1] == pin)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(prefix: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{prefix}-{i}")).collect()
    }

    /// Every pin names a shard other than the hash ring's choice, and other than the
    /// namespace's pin where that applies; the last names the shard a scale-out adds.
    #[test]
    fn pins_differ_from_what_would_place_the_object_anyway() {
        let (namespaces, shards) = (names("ns", 3), names("shard", 3));
        let plan = PinPlan::draw(&namespaces, &shards, "shard-3");
        let ring = IndependentRing::unweighted(&shards);
        assert_eq!(plan.namespace, Some(("ns-2".into(), "shard-0".into())));
        assert_eq!(plan.objects.len(), PINNED_OBJECTS);
        for object in &plan.objects {
            let hashed = ring.try_shard_for(&secret_key(&object.namespace, &object.name));
            assert_ne!(hashed, Some(object.shard.as_str()), "{object:?}");
            if object.namespace == "ns-2" {
                assert_ne!(object.shard, "shard-0", "{object:?}");
            }
        }
        assert_eq!(plan.objects[PINNED_OBJECTS - 1].shard, "shard-3");
        // Every starting shard is pinned: whichever shard a fault strikes, some pin goes away.
        assert!(shards.iter().all(|s| plan.shards().contains(s.as_str())));
    }

    /// The only namespace holds the probes: it is not pinned.
    #[test]
    fn a_single_namespace_is_not_pinned() {
        let plan = PinPlan::draw(&names("ns", 1), &names("shard", 2), "shard-2");
        assert_eq!(plan.namespace, None);
        let ring = IndependentRing::unweighted(names("shard", 2));
        for object in &plan.objects {
            let hashed = ring.try_shard_for(&secret_key(&object.namespace, &object.name));
            assert_ne!(hashed, Some(object.shard.as_str()), "{object:?}");
        }
    }

    #[test]
    fn the_most_specific_pin_decides_while_its_shard_is_available() {
        let ring = IndependentRing::unweighted(["a", "b", "c"]);
        let key = secret_key("ns", "x");
        let hashed = ring.try_shard_for(&key);
        let all: BTreeSet<String> = ["a", "b", "c"].map(String::from).into();
        let without_c: BTreeSet<String> = ["a", "b"].map(String::from).into();
        assert_eq!(predict(&ring, &all, Some("c"), Some("b"), &key), Some("c"));
        assert_eq!(predict(&ring, &all, None, Some("b"), &key), Some("b"));
        assert_eq!(predict(&ring, &all, None, None, &key), hashed);
        // An unavailable object pin leaves the object to the ring, not to the namespace's pin.
        assert_eq!(
            predict(&ring, &without_c, Some("c"), Some("b"), &key),
            hashed
        );
        assert_eq!(predict(&ring, &without_c, None, Some("c"), &key), hashed);
    }

    #[test]
    fn counts_pins_by_source() {
        let pins = BTreeMap::from([("p".to_string(), "b".to_string())]);
        let counts = count(
            [
                ("n", Some("a"), Some("a")),
                ("p", Some("a"), Some("c")),
                ("p", None, Some("b")),
                ("p", None, None),
                ("n", None, Some("a")),
            ],
            &pins,
        );
        assert_eq!(
            counts,
            PinCounts {
                object_pinned: 2,
                on_object_pin: 1,
                namespace_pinned: 2,
                on_namespace_pin: 1,
            }
        );
    }

    #[test]
    fn returns_count_moves_back_onto_the_pin() {
        let held = ["a", "b", "a", "c", "a"].map(String::from);
        assert_eq!(returns(&held, "a"), 2);
        assert_eq!(returns(&held[1..], "a"), 2);
        assert_eq!(returns(&held, "b"), 1);
        assert_eq!(returns(&["b".to_string()], "b"), 0);
    }
}
