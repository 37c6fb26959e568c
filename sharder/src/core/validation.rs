//! Runtime checks of a ring (either kind) that the API server may not enforce.
//!
//! API servers before 1.25 drop the CRD's CEL rule on the name length, and no schema can express
//! "no resource twice across the ring" or a well-formed label selector. A ring that fails here is
//! reported as `Ready=False` and the sharder does not act on it.

use std::collections::HashSet;

use kube_sharding_api::cluster_ring::MAX_NAME_LEN;
use kube_sharding_api::crd::name_length_message;
use kube_sharding_api::selector::validate_label_selector;
use kube_sharding_api::{Assignment, GroupResource, HashKey, RingKind, RingObject};

/// API groups none of whose resources a ring may cover unless the sharder's configuration allows
/// them (`webhook.config.allowedProtectedResources`): a mutating webhook in front of them, or
/// the sharder patching them, would put the sharder in the path of authentication,
/// authorization, admission and its own API.
const PROTECTED_GROUPS: &[&str] = &[
    "admissionregistration.k8s.io",
    "authentication.k8s.io",
    "authorization.k8s.io",
    "rbac.authorization.k8s.io",
    kube_sharding_api::labels::GROUP,
];

/// Single resources a ring may not cover unless allowed: pods (every workload's start would pass
/// the webhook), Events (written by every controller, and by the sharder itself), Leases (leader
/// election and shard membership, the sharder's own included).
const PROTECTED_RESOURCES: &[(&str, &str)] = &[
    ("", "pods"),
    ("", "events"),
    ("events.k8s.io", "events"),
    ("coordination.k8s.io", "leases"),
];

/// Why a ring must not cover `gr`, if it must not: a wildcard or a subresource never, a protected
/// resource unless `allowed` names it.
fn refused_resource(gr: &GroupResource, allowed: &[GroupResource]) -> Option<&'static str> {
    if gr.resource.contains('*') || gr.group.contains('*') {
        return Some("wildcards are not supported");
    }
    if gr.resource.contains('/') {
        return Some("subresources are not supported");
    }
    let protected = PROTECTED_GROUPS.contains(&gr.group.as_str())
        || PROTECTED_RESOURCES.contains(&(gr.group.as_str(), gr.resource.as_str()));
    (protected && !allowed.contains(gr)).then_some(
        "it is protected: a ring may cover it only when the sharder's configuration lists it in \
         webhook.config.allowedProtectedResources",
    )
}

/// Whether a ControllerRing's `name` has the form of a ClusterRing's label-key suffix
/// (`clusterring-<8 hex digits>-<ring>`), so that the two kinds' keys would be equal.
fn aliases_cluster_ring(name: &str) -> bool {
    name.strip_prefix("clusterring-")
        .and_then(|rest| rest.get(..9))
        .is_some_and(|hash| hash.ends_with('-') && hash[..8].bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The first invariant a ring violates; its text is a capitalised sentence for the ring's
/// status.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidRing {
    message: String,
}

impl From<String> for InvalidRing {
    fn from(message: String) -> Self {
        Self { message }
    }
}

/// Describes the first invariant `ring` violates, as a capitalised sentence for its status.
/// `allowed` lists the protected resources the sharder's configuration lets rings cover.
pub fn validate_ring<R: RingObject>(
    ring: &R,
    allowed: &[GroupResource],
) -> Result<(), InvalidRing> {
    let name = ring.ring_ref().name;
    if name.len() > MAX_NAME_LEN {
        return Err(name_length_message(R::KIND).into());
    }
    if R::KIND == RingKind::ControllerRing && aliases_cluster_ring(&name) {
        return Err(format!(
            "Name {name} is refused: a ControllerRing named clusterring-<8 hex digits>-<name> \
             would carry the label keys of ClusterRing <name>, and the two rings would move each \
             other's objects"
        )
        .into());
    }
    let spec = ring.ring_spec();
    let mut main_resources = HashSet::new();
    for (i, resource) in spec.resources.iter().enumerate() {
        if resource.resource.is_empty() {
            return Err(format!("Resource spec.resources[{i}].resource must not be empty").into());
        }
        if let Some(why) = refused_resource(&resource.group_resource(), allowed) {
            return Err(format!(
                "Resource {} in spec.resources[{i}] is refused: {why}",
                resource.group_resource()
            )
            .into());
        }
        if !main_resources.insert(resource.group_resource()) {
            return Err(format!(
                "Resource {} is listed more than once in spec.resources",
                resource.group_resource()
            )
            .into());
        }
        let mut controlled = HashSet::new();
        for (j, c) in resource.controlled_resources.iter().enumerate() {
            if c.resource.is_empty() {
                return Err(format!(
                    "Resource spec.resources[{i}].controlledResources[{j}].resource must not be empty"
                ).into());
            }
            if let Some(why) = refused_resource(c, allowed) {
                return Err(format!(
                    "Resource {c} in spec.resources[{i}].controlledResources[{j}] is refused: {why}"
                )
                .into());
            }
            if !controlled.insert(c.clone()) {
                return Err(format!(
                    "Controlled resource {c} is listed more than once for {}",
                    resource.group_resource()
                )
                .into());
            }
        }
    }
    // The CRD's CEL rule says the same; API servers before 1.25 drop it.
    if spec.assignment() == Assignment::ServerSide
        && spec.hash_key() == HashKey::Object
        && let Some(resource) = spec
            .resources
            .iter()
            .find(|r| !r.controlled_resources.is_empty())
    {
        return Err(format!(
            "Resource {} has controlledResources, which assignment ServerSide refuses with \
             hashKey Object: a controlled object's uid hashes independently of its \
             controller's, so the API server's shard selector cannot keep them on one shard; \
             use hashKey Namespace, or let the controller list them unsharded",
            resource.group_resource()
        )
        .into());
    }
    for (i, namespace) in spec.lease_namespaces.iter().enumerate() {
        if !is_namespace_name(namespace) {
            return Err(format!(
                "spec.leaseNamespaces[{i}] {namespace:?} is not a namespace name (at most 63 \
                 lowercase alphanumerics or '-', starting and ending alphanumeric)"
            )
            .into());
        }
    }
    if let Some(selector) = &spec.namespace_selector {
        validate_label_selector(selector)
            .map_err(|e| InvalidRing::from(format!("Invalid spec.namespaceSelector: {e}")))?;
    }
    Ok(())
}

/// Whether `name` can name a namespace (an RFC 1123 label).
fn is_namespace_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    let inner = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes.first().is_some_and(inner)
        && bytes.last().is_some_and(inner)
        && bytes.iter().all(|b| inner(b) || *b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
    use kube_sharding_api::{ClusterRing, ClusterRingSpec, GroupResource, RingResource};

    fn ring(name: &str, resources: Vec<RingResource>) -> ClusterRing {
        ClusterRing::new(name, ClusterRingSpec::new(resources))
    }

    fn res(group: &str, resource: &str, controlled: &[(&str, &str)]) -> RingResource {
        RingResource {
            group: group.into(),
            resource: resource.into(),
            controlled_resources: controlled
                .iter()
                .map(|(g, r)| GroupResource::new(*g, *r))
                .collect(),
        }
    }

    #[test]
    fn server_side_rings_refuse_controlled_resources_only_when_hashing_by_object() {
        let mut r = ring("a", vec![res("", "secrets", &[("", "configmaps")])]);
        r.spec.assignment = Some(Assignment::ServerSide);
        let refused = validate_ring(&r, &[]).expect_err("controlled resources with uid hashing");
        assert!(
            refused
                .to_string()
                .contains("Resource secrets has controlledResources"),
            "{refused}"
        );
        r.spec.hash_key = Some(HashKey::Namespace);
        assert_eq!(validate_ring(&r, &[]), Ok(()));
        let mut plain = ring("b", vec![res("", "secrets", &[])]);
        plain.spec.assignment = Some(Assignment::ServerSide);
        assert_eq!(validate_ring(&plain, &[]), Ok(()));
    }

    #[test]
    fn accepts_valid_rings() {
        assert_eq!(validate_ring(&ring("a", vec![]), &[]), Ok(()));
        let r = ring(
            &"x".repeat(63),
            vec![
                res("", "secrets", &[("", "configmaps")]),
                res(
                    "apps",
                    "deployments",
                    &[("apps", "replicasets"), ("", "configmaps")],
                ),
            ],
        );
        assert_eq!(validate_ring(&r, &[]), Ok(()));
    }

    #[test]
    fn rejects_long_names() {
        let err = validate_ring(&ring(&"x".repeat(64), vec![]), &[])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "ClusterRing name must not be longer than 63 characters"
        );
    }

    #[test]
    fn rejects_duplicates_and_empty_resources() {
        let err = validate_ring(
            &ring("a", vec![res("", "secrets", &[]), res("", "secrets", &[])]),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "Resource secrets is listed more than once in spec.resources"
        );
        let err = validate_ring(&ring("a", vec![res("apps", "", &[])]), &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("spec.resources[0].resource must not be empty"),
            "{err}"
        );
        let err = validate_ring(
            &ring(
                "a",
                vec![res(
                    "",
                    "secrets",
                    &[("", "configmaps"), ("", "configmaps")],
                )],
            ),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("configmaps is listed more than once"), "{err}");
        let err = validate_ring(&ring("a", vec![res("", "secrets", &[("", "")])]), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("controlledResources[0].resource"), "{err}");
    }

    #[test]
    fn refuses_protected_resources_unless_allowed_and_wildcards_always() {
        for (group, resource) in [
            ("", "pods"),
            ("", "events"),
            ("coordination.k8s.io", "leases"),
            ("rbac.authorization.k8s.io", "clusterroles"),
            (
                "admissionregistration.k8s.io",
                "mutatingwebhookconfigurations",
            ),
            ("authentication.k8s.io", "tokenreviews"),
            ("authorization.k8s.io", "subjectaccessreviews"),
            ("sharding.timebertt.dev", "clusterrings"),
        ] {
            let main = ring("example", vec![res(group, resource, &[])]);
            let message = validate_ring(&main, &[]).expect_err(resource).to_string();
            assert!(message.contains("protected"), "{message}");
            let controlled = ring("example", vec![res("", "secrets", &[(group, resource)])]);
            assert!(validate_ring(&controlled, &[]).is_err(), "{resource}");
            let allowed = [GroupResource::new(group, resource)];
            assert_eq!(validate_ring(&main, &allowed), Ok(()), "{resource}");
        }
        let pods = [GroupResource::new("", "pods")];
        for (group, resource) in [("", "*"), ("*", "secrets"), ("", "pods/status")] {
            let message = validate_ring(&ring("example", vec![res(group, resource, &[])]), &pods)
                .expect_err(resource)
                .to_string();
            assert!(message.contains("not supported"), "{message}");
        }
        let ordinary = ring(
            "example",
            vec![res("apps", "deployments", &[("", "configmaps")])],
        );
        assert_eq!(validate_ring(&ordinary, &[]), Ok(()));
    }

    #[test]
    fn refuses_controller_rings_named_like_a_cluster_ring_key() {
        let named = |name: &str| {
            let mut ring = kube_sharding_api::ControllerRing::new(name, Default::default());
            ring.spec.0.resources = vec![res("", "secrets", &[])];
            ring
        };
        let alias = kube_sharding_api::labels::shard_label("example");
        let alias = alias.rsplit('/').next().expect("a key with a prefix");
        assert!(alias.starts_with("clusterring-"), "{alias}");
        let message = validate_ring(&named(alias), &[])
            .expect_err(alias)
            .to_string();
        assert!(message.contains("label keys of ClusterRing"), "{message}");
        for fine in ["example", "clusterring-example", "clusterring-0123456z-x"] {
            assert_eq!(validate_ring(&named(fine), &[]), Ok(()), "{fine}");
        }
        // The same name is fine for a ClusterRing: its keys carry a hash of the name.
        assert_eq!(validate_ring(&ring(alias, vec![]), &[]), Ok(()));
    }

    #[test]
    fn rejects_invalid_namespace_selectors() {
        let mut r = ring("a", vec![]);
        r.spec.namespace_selector = Some(LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "team".into(),
                operator: "Equals".into(),
                values: None,
            }]),
            match_labels: None,
        });
        let err = validate_ring(&r, &[]).unwrap_err().to_string();
        assert!(err.starts_with("Invalid spec.namespaceSelector: "), "{err}");
        assert!(err.contains("Equals"), "{err}");
    }

    #[test]
    fn rejects_lease_namespaces_that_cannot_be_namespace_names() {
        let mut r = ring("a", vec![]);
        r.spec.lease_namespaces = vec!["team-a".into(), "shards-2".into()];
        assert_eq!(validate_ring(&r, &[]), Ok(()));
        for bad in ["", "Team", "-a", "a-", "a.b", &"x".repeat(64)] {
            r.spec.lease_namespaces = vec!["team-a".into(), bad.to_string()];
            let err = validate_ring(&r, &[]).unwrap_err().to_string();
            assert!(
                err.starts_with("spec.leaseNamespaces[1] "),
                "{bad:?}: {err}"
            );
        }
    }
}
