//! Invariants 2 and 3, read from the API server once the faults have stopped:
//!
//! - **Convergence**: the shards whose Leases make them available are exactly the shards the tool
//!   keeps running; every Secret carries the shard label the [`IndependentRing`] gives
//!   for them, or its pin's shard while that is available ([`pins::predict`]), every ConfigMap a
//!   Secret controls carries its controller's, a ConfigMap without a controller carries none, and
//!   no object carries the drain label.
//! - **Convergence of a zero-write ring** (`spec.assignment: ServerSide`), which labels nothing:
//!   the available shards are the running ones, each shard's Lease carries exactly the ranges the
//!   ring of the available shards gives it ([`RangeRing`]) and has acknowledged their generation,
//!   and every Secret's `checksums-<name>` ConfigMap was last written by the shard whose ranges
//!   hold the hash of the Secret's uid (the shard labels what it writes).
//! - **Nothing lost**: every Secret has its `checksums-<name>` ConfigMap, controlled by it, with
//!   the lowercase hex SHA-256 of each of its values; no ConfigMap controlled by a Secret that is
//!   gone survives.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use e2e::IndependentRing;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::range_lease::{
    ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES, Acknowledgement, PublishedRanges,
};
use kube_sharding_api::ranges::{RangeRing, fnv1a64};
use sha2::{Digest, Sha256};

use crate::pins::{self, PinCounts};
use crate::ring::{LabelKeys, available_shards, secret_key};

/// Prefix checksum-controller gives its ConfigMaps' names.
const CHECKSUMS_PREFIX: &str = "checksums-";

/// How many problems a report lists.
const SHOWN: usize = 10;

/// The objects and Leases the checks look at, listed together.
#[derive(Debug, Default)]
pub(crate) struct Snapshot {
    /// `(namespace, Secret)`.
    pub(crate) secrets: Vec<(String, Secret)>,
    /// `(namespace, ConfigMap)`.
    pub(crate) config_maps: Vec<(String, ConfigMap)>,
    pub(crate) leases: Vec<Lease>,
    /// The ring's pin on each namespace that carries one.
    pub(crate) namespace_pins: BTreeMap<String, String>,
}

impl Snapshot {
    /// Lists the ring's namespaces (their pins `pin_key` too) and the shard Leases.
    pub(crate) async fn take(
        client: &Client,
        namespaces: &[String],
        lease_namespace: &str,
        ring: &str,
        pin_key: &str,
    ) -> anyhow::Result<Self> {
        let mut snapshot = Self::default();
        for ns in namespaces {
            let namespace = Api::<Namespace>::all(client.clone()).get(ns).await?;
            if let Some(pin) = namespace.annotations().get(pin_key) {
                snapshot.namespace_pins.insert(ns.clone(), pin.clone());
            }
            let secrets = Api::<Secret>::namespaced(client.clone(), ns)
                .list(&ListParams::default())
                .await?;
            snapshot
                .secrets
                .extend(secrets.items.into_iter().map(|s| (ns.clone(), s)));
            let config_maps = Api::<ConfigMap>::namespaced(client.clone(), ns)
                .list(&ListParams::default())
                .await?;
            snapshot
                .config_maps
                .extend(config_maps.items.into_iter().map(|c| (ns.clone(), c)));
        }
        let selector = format!("alpha.sharding.timebertt.dev/clusterring={ring}");
        snapshot.leases = Api::<Lease>::namespaced(client.clone(), lease_namespace)
            .list(&ListParams::default().labels(&selector))
            .await?
            .items;
        Ok(snapshot)
    }

    /// Secrets not being deleted, by `(namespace, name)`.
    fn live_secrets(&self) -> BTreeMap<(&str, String), &Secret> {
        self.secrets
            .iter()
            .filter(|(_, s)| s.metadata.deletion_timestamp.is_none())
            .map(|(ns, s)| ((ns.as_str(), s.name_any()), s))
            .collect()
    }

    /// The pinned Secrets and how many are on their pin.
    fn pin_counts(&self, keys: &LabelKeys) -> PinCounts {
        let secrets = self.live_secrets();
        pins::count(
            secrets.iter().map(|((ns, _), secret)| {
                (
                    *ns,
                    secret.annotations().get(&keys.pin).map(String::as_str),
                    secret.labels().get(&keys.shard).map(String::as_str),
                )
            }),
            &self.namespace_pins,
        )
    }
}

/// The Secret controlling `config_map`, by name, with its UID.
fn controller(config_map: &ConfigMap) -> Option<(&str, &str)> {
    config_map
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .filter(|o| o.api_version == "v1" && o.kind == "Secret")
        .map(|o| (o.name.as_str(), o.uid.as_str()))
}

/// Invariant 2: where the snapshot's objects differ from the placement the ring of `running`
/// shards and the pins predict, as readable lines (empty when converged).
pub(crate) fn placement_problems(
    snapshot: &Snapshot,
    keys: &LabelKeys,
    running: &BTreeSet<String>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let available = available_shards(&snapshot.leases);
    if &available != running {
        problems.push(format!(
            "available shards by their Leases {available:?} differ from the running shards {running:?}"
        ));
    }
    let ring = IndependentRing::unweighted(available.iter().map(String::as_str));
    let secrets = snapshot.live_secrets();
    let mut check = |kind: &str,
                     ns: &str,
                     name: String,
                     labels: &BTreeMap<String, String>,
                     owner: Option<&str>| {
        // A controlled object follows its controller, pin included; the controller's own pin is
        // read from the controller (the controlled object's own annotation does not count).
        let expected = owner.and_then(|secret| {
            let own = secrets
                .get(&(ns, secret.to_string()))
                .and_then(|s| s.annotations().get(&keys.pin))
                .map(String::as_str);
            let namespace = snapshot.namespace_pins.get(ns).map(String::as_str);
            pins::predict(&ring, &available, own, namespace, &secret_key(ns, secret))
        });
        let actual = labels.get(&keys.shard).map(String::as_str);
        if actual != expected {
            problems.push(format!(
                "{kind} {ns}/{name} is on {actual:?}, the ring says {expected:?}"
            ));
        }
        if labels.contains_key(&keys.drain) {
            problems.push(format!("{kind} {ns}/{name} still carries the drain label"));
        }
    };
    for (ns, secret) in &snapshot.secrets {
        if secret.metadata.deletion_timestamp.is_none() {
            let name = secret.name_any();
            check("Secret", ns, name.clone(), secret.labels(), Some(&name));
        }
    }
    for (ns, config_map) in &snapshot.config_maps {
        if config_map.metadata.deletion_timestamp.is_none() {
            let owner = controller(config_map).map(|(name, _)| name);
            check(
                "ConfigMap",
                ns,
                config_map.name_any(),
                config_map.labels(),
                owner,
            );
        }
    }
    problems
}

/// Invariant 2 on a zero-write ring: where the published ranges, their acknowledgements and the
/// writers of the checksum ConfigMaps differ from what the ring of `running` shards gives.
pub(crate) fn zero_write_placement_problems(
    snapshot: &Snapshot,
    keys: &LabelKeys,
    running: &BTreeSet<String>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let available = available_shards(&snapshot.leases);
    if &available != running {
        problems.push(format!(
            "available shards by their Leases {available:?} differ from the running shards {running:?}"
        ));
    }
    let ring = RangeRing::new(available.iter());
    for lease in &snapshot.leases {
        let Some(name) = lease.metadata.name.as_deref() else {
            continue;
        };
        if !available.contains(name) {
            continue;
        }
        let annotation = |key: &str| lease.annotations().get(key).map(String::as_str);
        let published = annotation(ANNOTATION_RANGES).map(str::parse::<PublishedRanges>);
        let Some(Ok(published)) = published else {
            problems.push(format!("shard {name} has no valid ranges on its Lease"));
            continue;
        };
        if *published.ranges() != ring.ranges_of(name) {
            problems.push(format!(
                "shard {name} has ranges of generation {} that are not its share of the ring",
                published.generation()
            ));
        }
        let acknowledged = annotation(ANNOTATION_ACKNOWLEDGED)
            .and_then(|a| a.parse::<Acknowledgement>().ok())
            .map(|a| a.generation);
        if acknowledged != Some(published.generation()) {
            problems.push(format!(
                "shard {name} acknowledged {acknowledged:?}, its ranges are of generation {}",
                published.generation()
            ));
        }
    }
    let written: HashMap<(&str, String), Option<&str>> = snapshot
        .config_maps
        .iter()
        .filter(|(_, c)| c.metadata.deletion_timestamp.is_none())
        .filter_map(|(ns, c)| {
            let secret = c.name_any().strip_prefix(CHECKSUMS_PREFIX)?.to_string();
            Some((
                (ns.as_str(), secret),
                c.labels().get(&keys.shard).map(String::as_str),
            ))
        })
        .collect();
    for ((ns, name), secret) in snapshot.live_secrets() {
        let uid = secret.metadata.uid.as_deref().unwrap_or_default();
        let expected = ring.owner(fnv1a64(uid));
        // A missing ConfigMap is invariant 3's.
        if let Some(writer) = written.get(&(ns, name.clone()))
            && *writer != expected
        {
            problems.push(format!(
                "{ns}/{CHECKSUMS_PREFIX}{name} was written by {writer:?}, the ranges give {expected:?}"
            ));
        }
    }
    problems
}

/// Invariant 3: what is missing, wrong or left over, as readable lines (empty when all is well).
pub(crate) fn content_problems(snapshot: &Snapshot) -> Vec<String> {
    let mut problems = Vec::new();
    let secrets = snapshot.live_secrets();
    let config_maps: HashMap<(&str, String), &ConfigMap> = snapshot
        .config_maps
        .iter()
        .filter(|(_, c)| c.metadata.deletion_timestamp.is_none())
        .map(|(ns, c)| ((ns.as_str(), c.name_any()), c))
        .collect();
    for ((ns, name), secret) in &secrets {
        let key = (*ns, format!("{CHECKSUMS_PREFIX}{name}"));
        let Some(config_map) = config_maps.get(&key) else {
            problems.push(format!(
                "Secret {ns}/{name} has no {CHECKSUMS_PREFIX}{name}"
            ));
            continue;
        };
        let uid = secret.metadata.uid.as_deref().unwrap_or_default();
        if controller(config_map) != Some((name.as_str(), uid)) {
            problems.push(format!(
                "{ns}/{CHECKSUMS_PREFIX}{name} is not controlled by Secret {name} (uid {uid})"
            ));
        }
        let expected: BTreeMap<String, String> = secret
            .data
            .iter()
            .flatten()
            .map(|(k, v)| (k.clone(), hex::encode(Sha256::digest(&v.0))))
            .collect();
        if config_map.data.clone().unwrap_or_default() != expected {
            problems.push(format!(
                "{ns}/{CHECKSUMS_PREFIX}{name} does not hold the checksums of the Secret's data"
            ));
        }
    }
    for ((ns, name), config_map) in &config_maps {
        if let Some((owner, uid)) = controller(config_map) {
            let alive = secrets
                .get(&(*ns, owner.to_string()))
                .is_some_and(|s| s.metadata.uid.as_deref() == Some(uid));
            if !alive {
                problems.push(format!(
                    "ConfigMap {ns}/{name} survives its deleted Secret {owner}"
                ));
            }
        }
    }
    problems
}

/// How the wait for convergence ended.
#[derive(Debug, Default, serde::Serialize)]
pub(crate) struct Outcome {
    /// Seconds from the last change until the placement became right for good.
    pub(crate) placement_seconds: Option<f64>,
    /// Seconds from the last change until the content became right for good.
    pub(crate) content_seconds: Option<f64>,
    /// Problems left at the end of the wait (the first few of each kind).
    pub(crate) placement_problems: Vec<String>,
    pub(crate) content_problems: Vec<String>,
    /// Secrets and ConfigMaps at the end.
    pub(crate) secrets: usize,
    pub(crate) config_maps: usize,
    /// The pinned Secrets at the end, and how many were on their pin.
    pub(crate) pins: PinCounts,
    /// Checks that failed to list (API errors), retried.
    pub(crate) list_errors: usize,
}

/// What [`wait`] checks against.
pub(crate) struct Target<'a> {
    pub(crate) client: &'a Client,
    pub(crate) namespaces: &'a [String],
    pub(crate) lease_namespace: &'a str,
    pub(crate) ring: &'a str,
    pub(crate) keys: &'a LabelKeys,
    /// A zero-write ring: placement by published ranges ([`zero_write_placement_problems`]).
    pub(crate) zero_write: bool,
}

/// Checks every second until both invariants have held for `settle`, or until `bound` after
/// `since` (the last change) has passed and they did not hold since then. `running` gives the
/// shards the tool keeps running.
pub(crate) async fn wait(
    target: &Target<'_>,
    running: impl Fn() -> BTreeSet<String>,
    since: Instant,
    bound: Duration,
    settle: Duration,
) -> Outcome {
    let mut outcome = Outcome::default();
    let (mut placed_since, mut content_since): (Option<Instant>, Option<Instant>) = (None, None);
    loop {
        let snapshot = Snapshot::take(
            target.client,
            target.namespaces,
            target.lease_namespace,
            target.ring,
            &target.keys.pin,
        )
        .await;
        let now = Instant::now();
        match snapshot {
            Ok(snapshot) => {
                let placement = if target.zero_write {
                    zero_write_placement_problems(&snapshot, target.keys, &running())
                } else {
                    placement_problems(&snapshot, target.keys, &running())
                };
                let content = content_problems(&snapshot);
                placed_since = if placement.is_empty() {
                    placed_since.or(Some(now))
                } else {
                    None
                };
                content_since = if content.is_empty() {
                    content_since.or(Some(now))
                } else {
                    None
                };
                outcome.secrets = snapshot.live_secrets().len();
                outcome.config_maps = snapshot.config_maps.len();
                outcome.pins = snapshot.pin_counts(target.keys);
                outcome.placement_problems = placement.into_iter().take(SHOWN).collect();
                outcome.content_problems = content.into_iter().take(SHOWN).collect();
            }
            Err(_) => {
                outcome.list_errors += 1;
                (placed_since, content_since) = (None, None);
            }
        }
        let held = |since: Option<Instant>| since.is_some_and(|s| now - s >= settle);
        // Past the bound, a state that became right before it may still finish settling.
        let hopeless = |good: Option<Instant>| good.is_none_or(|g| g - since > bound);
        if held(placed_since) && held(content_since)
            || now - since > bound && (hopeless(placed_since) || hopeless(content_since))
        {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let seconds = |good: Option<Instant>| good.map(|g| crate::plan::round_ms(g - since));
    outcome.placement_seconds = seconds(placed_since);
    outcome.content_seconds = seconds(content_since);
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use kube::api::ObjectMeta;

    fn keys() -> LabelKeys {
        LabelKeys::for_ring("chaos").expect("short name")
    }

    fn secret(name: &str, shard: &str, value: &[u8]) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                labels: Some(BTreeMap::from([(keys().shard, shard.to_string())])),
                ..Default::default()
            },
            data: Some(BTreeMap::from([(
                "v".to_string(),
                ByteString(value.to_vec()),
            )])),
            ..Default::default()
        }
    }

    fn checksums(owner: &str, shard: &str, value: &[u8]) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(format!("{CHECKSUMS_PREFIX}{owner}")),
                labels: Some(BTreeMap::from([(keys().shard, shard.to_string())])),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Secret".into(),
                    name: owner.into(),
                    uid: format!("uid-{owner}"),
                    controller: Some(true),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            data: Some(BTreeMap::from([(
                "v".to_string(),
                hex::encode(Sha256::digest(value)),
            )])),
            ..Default::default()
        }
    }

    fn held_lease(name: &str) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(k8s_openapi::api::coordination::v1::LeaseSpec {
                holder_identity: Some(name.into()),
                ..Default::default()
            }),
        }
    }

    /// The shard the independent ring of `shard-a` and `shard-b` gives Secret `ns/name`.
    fn shard_of(name: &str) -> String {
        IndependentRing::unweighted(["shard-a", "shard-b"])
            .try_shard_for(&secret_key("ns", name))
            .expect("a shard")
            .to_string()
    }

    fn converged() -> Snapshot {
        let (x, y) = (shard_of("x"), shard_of("y"));
        Snapshot {
            secrets: vec![
                ("ns".into(), secret("x", &x, b"1")),
                ("ns".into(), secret("y", &y, b"2")),
            ],
            config_maps: vec![
                ("ns".into(), checksums("x", &x, b"1")),
                ("ns".into(), checksums("y", &y, b"2")),
            ],
            leases: vec![held_lease("shard-a"), held_lease("shard-b")],
            namespace_pins: BTreeMap::new(),
        }
    }

    fn running() -> BTreeSet<String> {
        ["shard-a", "shard-b"].map(String::from).into()
    }

    #[test]
    fn a_converged_snapshot_has_no_problems() {
        let snapshot = converged();
        assert_eq!(
            placement_problems(&snapshot, &keys(), &running()),
            Vec::<String>::new()
        );
        assert_eq!(content_problems(&snapshot), Vec::<String>::new());
    }

    #[test]
    fn misplaced_draining_and_unassigned_objects_are_problems() {
        let mut snapshot = converged();
        let other = if shard_of("x") == "shard-a" {
            "shard-b"
        } else {
            "shard-a"
        };
        snapshot.secrets[0]
            .1
            .labels_mut()
            .insert(keys().shard, other.into());
        snapshot.secrets[1]
            .1
            .labels_mut()
            .insert(keys().drain, "true".into());
        snapshot.config_maps[1].1.labels_mut().clear();
        let problems = placement_problems(&snapshot, &keys(), &running());
        assert_eq!(problems.len(), 3, "{problems:?}");
    }

    /// Puts Secret `index` of `snapshot` and its checksums on `shard`.
    fn place(snapshot: &mut Snapshot, index: usize, shard: &str) {
        let labels = [
            snapshot.secrets[index].1.labels_mut(),
            snapshot.config_maps[index].1.labels_mut(),
        ];
        for labels in labels {
            labels.insert(keys().shard, shard.into());
        }
    }

    /// A pinned Secret and its checksums belong on the pin while its shard is available, else
    /// on the ring's choice; an object's own pin comes before its namespace's.
    #[test]
    fn pinned_objects_belong_on_their_pin_while_it_is_available() {
        let problems = |s: &Snapshot| placement_problems(s, &keys(), &running());
        let (x, y) = (shard_of("x"), shard_of("y"));
        let other = |shard: &str| {
            if shard == "shard-a" {
                "shard-b"
            } else {
                "shard-a"
            }
        };
        let mut snapshot = converged();
        let pin = |snapshot: &mut Snapshot, shard: &str| {
            snapshot.secrets[0]
                .1
                .annotations_mut()
                .insert(keys().pin, shard.into());
        };
        pin(&mut snapshot, other(&x));
        assert_eq!(problems(&snapshot).len(), 2, "{:?}", problems(&snapshot));
        place(&mut snapshot, 0, other(&x));
        assert_eq!(problems(&snapshot), Vec::<String>::new());
        pin(&mut snapshot, "shard-c");
        assert_eq!(problems(&snapshot).len(), 2, "{:?}", problems(&snapshot));
        place(&mut snapshot, 0, &x);
        assert_eq!(problems(&snapshot), Vec::<String>::new());

        // The namespace's pin moves y, not x: x's own pin (unavailable) leaves it to the ring.
        snapshot
            .namespace_pins
            .insert("ns".into(), other(&y).to_string());
        assert_eq!(problems(&snapshot).len(), 2, "{:?}", problems(&snapshot));
        place(&mut snapshot, 1, other(&y));
        assert_eq!(problems(&snapshot), Vec::<String>::new());
        assert_eq!(
            snapshot.pin_counts(&keys()),
            PinCounts {
                object_pinned: 1,
                on_object_pin: 0,
                namespace_pinned: 1,
                on_namespace_pin: 1,
            }
        );
    }

    #[test]
    fn a_dead_shard_still_available_is_a_problem() {
        let snapshot = converged();
        let only_a: BTreeSet<String> = ["shard-a".to_string()].into();
        let problems = placement_problems(&snapshot, &keys(), &only_a);
        assert!(
            problems[0].contains("differ from the running shards"),
            "{problems:?}"
        );
    }

    #[test]
    fn stale_missing_and_orphaned_checksums_are_problems() {
        let mut snapshot = converged();
        snapshot.secrets[0].1.data =
            Some(BTreeMap::from([("v".into(), ByteString(b"new".to_vec()))]));
        snapshot.config_maps.remove(1);
        snapshot
            .config_maps
            .push(("ns".into(), checksums("gone", "shard-a", b"3")));
        let problems = content_problems(&snapshot);
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(
            problems
                .iter()
                .any(|p| p.contains("survives its deleted Secret gone"))
        );
    }
}
