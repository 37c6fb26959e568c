//! Well-known label keys, identities and names of the sharding wire protocol (docs/protocol.md §2).
//!
//! Everything here is byte-compatible with the original Go implementation, so shards written with
//! other libraries can join rings served by our sharder.

use sha2::{Digest, Sha256};

/// API group of the `ClusterRing` resource.
pub const GROUP: &str = "sharding.timebertt.dev";

/// Label on shard Leases (and on a ring's webhook configuration) naming the ClusterRing they
/// belong to.
pub const LABEL_CLUSTER_RING: &str = "alpha.sharding.timebertt.dev/clusterring";

/// Label on shard Leases (and on a ring's webhook configuration) naming the ControllerRing they
/// belong to (docs/protocol.md §15).
pub const LABEL_CONTROLLER_RING: &str = "alpha.sharding.timebertt.dev/controllerring";

/// Annotation on a shard Lease with the shard's weight (docs/protocol.md §17): an integer from 1 to
/// [`MAX_SHARD_WEIGHT`]; absent means 1.
pub const ANNOTATION_WEIGHT: &str = "alpha.sharding.timebertt.dev/weight";

/// Annotation on a shard Lease saying whether the shard leaves the objects its controllers
/// control to the sharder (`"true"`) or relabels them itself (`"false"`, or absent)
/// (docs/protocol.md §17; §19 item 9 for what the sharder does with it): a ring all of whose
/// available shards say `"true"` has its controlled objects moved as their controllers' drains
/// are acknowledged, while the sync still drains.
pub const ANNOTATION_LEAVES_CONTROLLED_OBJECTS: &str =
    "alpha.sharding.timebertt.dev/leaves-controlled-objects";

/// Whether a shard Lease's [`ANNOTATION_LEAVES_CONTROLLED_OBJECTS`] says the shard leaves its
/// controlled objects to the sharder: `Ok(true)` for `"true"`, `Ok(false)` for `"false"` or no
/// annotation, `Err` for anything else (such a shard counts as relabelling them itself).
pub fn leaves_controlled_objects(
    annotation: Option<&str>,
) -> Result<bool, InvalidLeavesControlledObjects> {
    match annotation {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(value) => Err(InvalidLeavesControlledObjects {
            value: value.to_string(),
        }),
    }
}

/// A value of [`ANNOTATION_LEAVES_CONTROLLED_OBJECTS`] that [`leaves_controlled_objects`] refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "annotation {ANNOTATION_LEAVES_CONTROLLED_OBJECTS}={value:?} is neither \"true\" nor \"false\"; the shard counts as relabelling its controlled objects itself",
    ANNOTATION_LEAVES_CONTROLLED_OBJECTS = ANNOTATION_LEAVES_CONTROLLED_OBJECTS
)]
pub struct InvalidLeavesControlledObjects {
    /// The annotation's value as found.
    pub value: String,
}

/// Largest shard weight; larger values are invalid and count as 1.
pub const MAX_SHARD_WEIGHT: u32 = 10;

/// Label on shard Leases with the shard's state as seen by the sharder (observability only).
pub const LABEL_STATE: &str = "alpha.sharding.timebertt.dev/state";

/// Annotation the sharder keeps on a shard Lease while the Lease is excluded from its ring
/// (docs/protocol.md §18), with the reason as value (for example `DuplicateShardName`). Our
/// extension: shards built with the `shard` library stop reconciling and release their Lease when
/// they see it. A shard of another library that ignores it receives no objects when its name is
/// invalid or its namespace not allowed, but an excluded duplicate name keeps receiving objects:
/// they carry the name it shares with the copy that kept it, so both reconcile them at once.
pub const ANNOTATION_EXCLUDED: &str = "alpha.sharding.timebertt.dev/excluded";

/// Annotation a shard writes on its own Lease in the same write that empties the holder, with the
/// holder identity it gives up as value: the shard released the Lease itself, has stopped, and its
/// objects may move directly (docs/protocol.md §4). Our extension: a held Lease whose holder is
/// emptied or changed *without* it (by a third party, or by a shard of another library) counts
/// as a departure, so the objects leave the shard only through drains until the shard cannot be
/// running any more. Acquiring the Lease removes it.
pub const ANNOTATION_RELEASED_BY: &str = "alpha.sharding.timebertt.dev/released-by";

/// Prefix of the ring-specific shard label key on sharded objects.
pub const SHARD_LABEL_PREFIX: &str = "shard.alpha.sharding.timebertt.dev/";

/// Prefix of the ring-specific drain label key on sharded objects.
pub const DRAIN_LABEL_PREFIX: &str = "drain.alpha.sharding.timebertt.dev/";

/// Prefix of the annotation that pins an object, or every object of a namespace, to a shard of
/// one ring; the rest of the key is the ring's part of its shard label key (this project's
/// extension, docs/protocol.md §21).
pub const PIN_ANNOTATION_PREFIX: &str = "pin.alpha.sharding.timebertt.dev/";

/// Holder identity the sharder writes when it takes over the Lease of an unresponsive shard.
pub const IDENTITY_SHARD_LEASE_CONTROLLER: &str = "shardlease-controller";

/// Namespace the sharder runs in.
pub const NAMESPACE_SYSTEM: &str = "sharding-system";

/// `app.kubernetes.io/name` label key put on every object of ours.
pub const LABEL_APP_NAME: &str = "app.kubernetes.io/name";

/// Value of [`LABEL_APP_NAME`] on every object of ours.
pub const APP_NAME: &str = "controller-sharding";

/// Name of the single webhook in each ring's MutatingWebhookConfiguration.
pub const WEBHOOK_NAME: &str = "sharder.sharding.timebertt.dev";

/// Root of every webhook path; the lowercase ring kind and the ring name follow.
pub const WEBHOOK_PATH_ROOT: &str = "/webhooks/sharder/";

/// Prefix of a ClusterRing's webhook path; the ring name follows.
pub const WEBHOOK_PATH_PREFIX: &str = "/webhooks/sharder/clusterring/";

/// Longest label name (the part after the `/` of a key) Kubernetes accepts.
const MAX_LABEL_NAME_LEN: usize = 63;

/// The ring-specific part shared by the shard and drain label keys:
/// `clusterring-<first 8 hex chars of SHA-256(ring)>-<ring>`, cut to 63 bytes.
///
/// Names of up to 42 characters are never cut. When a cut leaves trailing characters that are not
/// alphanumeric (`-`, `.`, `_`), they are dropped too, so the result is always a valid label name.
/// This last step is our own: the Go project could produce an invalid key there.
pub fn ring_suffix(ring_name: &str) -> String {
    let digest = Sha256::digest(ring_name.as_bytes());
    let mut suffix = format!("clusterring-{}-{}", &hex::encode(digest)[..8], ring_name);
    if suffix.len() > MAX_LABEL_NAME_LEN {
        let mut end = MAX_LABEL_NAME_LEN;
        // Ring names are DNS subdomains (ASCII), but never split a UTF-8 character regardless.
        while !suffix.is_char_boundary(end) {
            end -= 1;
        }
        suffix.truncate(end);
        let trimmed = suffix
            .trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
            .len();
        suffix.truncate(trimmed);
    }
    suffix
}

/// The label key that carries the name of the shard an object is assigned to in the given ring.
pub fn shard_label(ring_name: &str) -> String {
    format!("{SHARD_LABEL_PREFIX}{}", ring_suffix(ring_name))
}

/// The label key that asks the current shard of an object to give it up, in the given ring.
pub fn drain_label(ring_name: &str) -> String {
    format!("{DRAIN_LABEL_PREFIX}{}", ring_suffix(ring_name))
}

/// The annotation key that pins an object (or a namespace's objects) to a shard of the given ring.
pub fn pin_annotation(ring_name: &str) -> String {
    format!("{PIN_ANNOTATION_PREFIX}{}", ring_suffix(ring_name))
}

/// Name of the ring's MutatingWebhookConfiguration.
pub fn webhook_configuration_name(ring_name: &str) -> String {
    format!("sharding-{}", ring_suffix(ring_name))
}

/// Path under which the sharder serves the ring's webhook.
pub fn webhook_path(ring_name: &str) -> String {
    format!("{WEBHOOK_PATH_PREFIX}{ring_name}")
}

/// The weight a shard's Lease asks for through [`ANNOTATION_WEIGHT`] (docs/protocol.md §17):
/// `Ok(1)` without the annotation, `Err` with what is wrong for a value that is not an integer from
/// 1 to [`MAX_SHARD_WEIGHT`] (such a shard counts with weight 1).
pub fn parse_weight(annotation: Option<&str>) -> Result<u32, InvalidWeight> {
    let Some(value) = annotation else {
        return Ok(1);
    };
    // Decimal digits only: no sign, no blanks, as other implementations would read it.
    let digits = !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit());
    match value.parse::<u32>() {
        Ok(weight) if digits && (1..=MAX_SHARD_WEIGHT).contains(&weight) => Ok(weight),
        _ => Err(InvalidWeight {
            value: value.to_string(),
        }),
    }
}

/// A weight annotation that [`parse_weight`] refuses; the shard counts with weight 1.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "annotation {ANNOTATION_WEIGHT}={value:?} is not an integer from 1 to {MAX_SHARD_WEIGHT}; the shard counts with weight 1",
    ANNOTATION_WEIGHT = ANNOTATION_WEIGHT,
    MAX_SHARD_WEIGHT = MAX_SHARD_WEIGHT
)]
pub struct InvalidWeight {
    /// The annotation's value as found.
    pub value: String,
}

/// Checks a label key against the Kubernetes rules: an optional DNS-subdomain prefix of at most
/// 253 characters and a `/`, then a name of 1–63 characters that starts and ends alphanumeric and
/// contains only alphanumerics, `-`, `_` and `.`.
pub fn is_valid_label_key(key: &str) -> bool {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix
        && !is_dns_subdomain(prefix)
    {
        return false;
    }
    is_qualified_name_part(name)
}

/// Checks a label value: empty, or 1–63 characters like a label name.
pub fn is_valid_label_value(value: &str) -> bool {
    value.is_empty() || is_qualified_name_part(value)
}

fn is_qualified_name_part(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_LABEL_NAME_LEN
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Checks a DNS subdomain as Kubernetes does for object names: at most 253 characters of
/// dot-separated parts, each lowercase alphanumerics and `-`, starting and ending alphanumeric.
/// (Kubernetes does not limit the length of each part.)
pub fn is_dns_subdomain(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 253
        && value.split('.').all(|part| {
            let b = part.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_digit() || c.is_ascii_lowercase() || *c == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn only_true_says_a_shard_leaves_its_controlled_objects() {
        assert_eq!(leaves_controlled_objects(None), Ok(false));
        assert_eq!(leaves_controlled_objects(Some("false")), Ok(false));
        assert_eq!(leaves_controlled_objects(Some("true")), Ok(true));
        for value in ["True", "yes", "1", "", " true"] {
            let error = leaves_controlled_objects(Some(value)).expect_err(value);
            assert_eq!(error.value, value);
        }
    }

    #[test]
    fn spec_worked_examples() {
        assert_eq!(
            shard_label("example"),
            "shard.alpha.sharding.timebertt.dev/clusterring-50d858e0-example"
        );
        assert_eq!(
            drain_label("example"),
            "drain.alpha.sharding.timebertt.dev/clusterring-50d858e0-example"
        );
        assert_eq!(
            shard_label("webhosting-operator"),
            "shard.alpha.sharding.timebertt.dev/clusterring-ef3d63cd-webhosting-operator"
        );
        assert_eq!(
            shard_label("checksum-controller"),
            "shard.alpha.sharding.timebertt.dev/clusterring-f4d63fd2-checksum-controller"
        );
        assert_eq!(
            webhook_configuration_name("example"),
            "sharding-clusterring-50d858e0-example"
        );
        assert_eq!(
            webhook_path("example"),
            "/webhooks/sharder/clusterring/example"
        );
    }

    #[derive(serde::Deserialize)]
    struct Vectors {
        cases: Vec<Case>,
    }

    #[derive(serde::Deserialize)]
    struct Case {
        ring: String,
        shard_label: String,
        drain_label: String,
        webhook_configuration: String,
    }

    #[test]
    fn shared_vectors() {
        // A copy of the project's shared vectors, kept byte-identical (crds/vectors/README.md).
        let text = include_str!("../vectors/labels.json");
        let vectors: Vectors = serde_json::from_str(text).expect("labels.json parses");
        assert!(vectors.cases.len() >= 8, "expected the full vector set");
        for case in vectors.cases {
            assert_eq!(
                shard_label(&case.ring),
                case.shard_label,
                "ring {}",
                case.ring
            );
            assert_eq!(
                drain_label(&case.ring),
                case.drain_label,
                "ring {}",
                case.ring
            );
            assert_eq!(
                webhook_configuration_name(&case.ring),
                case.webhook_configuration,
                "ring {}",
                case.ring
            );
        }
    }

    #[test]
    fn names_up_to_42_chars_are_never_cut() {
        let name = "a".repeat(42);
        assert!(shard_label(&name).ends_with(&name));
        let name = "a".repeat(43);
        assert!(!shard_label(&name).ends_with(&name));
    }

    #[test]
    fn cut_drops_trailing_non_alphanumerics() {
        // 41 chars then '-' then more: the cut at 63 bytes lands right after the '-'.
        let name = format!("{}-{}", "x".repeat(41), "y".repeat(21));
        let suffix = ring_suffix(&name);
        assert!(suffix.len() < 63);
        assert!(suffix.ends_with('x'), "{suffix}");
        let name = format!("{}.{}", "x".repeat(41), "y".repeat(21));
        assert!(ring_suffix(&name).ends_with('x'));
    }

    #[test]
    fn weights() {
        assert_eq!(parse_weight(None), Ok(1));
        assert_eq!(parse_weight(Some("1")), Ok(1));
        assert_eq!(parse_weight(Some("10")), Ok(10));
        for bad in ["0", "11", "-1", "+2", " 2", "1.5", "", "two", "99999999999"] {
            let error = parse_weight(Some(bad)).expect_err(bad).to_string();
            assert!(error.contains("weight 1"), "{error}");
        }
    }

    #[test]
    fn label_key_validation() {
        assert!(is_valid_label_key("app"));
        assert!(is_valid_label_key("example.com/app-name_1.x"));
        assert!(!is_valid_label_key("example.com/"));
        assert!(!is_valid_label_key("example.com/-a"));
        assert!(!is_valid_label_key("Example.com/a"));
        assert!(!is_valid_label_key(&format!("a/{}", "b".repeat(64))));
        assert!(is_valid_label_value(""));
        assert!(!is_valid_label_value("a-"));
    }

    proptest! {
        /// Every ring name Kubernetes accepts (a DNS subdomain, here of up to 63 characters as the
        /// CRD demands) yields valid label keys and a valid object name for the webhook config.
        #[test]
        fn derived_keys_are_valid(name in "[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?") {
            prop_assume!(is_dns_subdomain(&name));
            prop_assert!(is_valid_label_key(&shard_label(&name)), "{}", shard_label(&name));
            prop_assert!(is_valid_label_key(&drain_label(&name)));
            prop_assert!(is_dns_subdomain(&webhook_configuration_name(&name)));
            prop_assert!(ring_suffix(&name).len() <= 63);
        }
    }
}
