//! Runtime checks of a ring (either kind) that the API server may not enforce.
//!
//! API servers before 1.25 drop the CRD's CEL rule on the name length, and no schema can express
//! "no resource twice across the ring" or a well-formed label selector. A ring that fails here is
//! reported as `Ready=False` and the sharder does not act on it.

use std::collections::HashSet;

use sharding_crds::RingObject;
use sharding_crds::cluster_ring::MAX_NAME_LEN;
use sharding_crds::crd::name_length_message;
use sharding_crds::selector::validate_label_selector;

/// Describes the first invariant `ring` violates, as a capitalised sentence for its status.
pub fn validate_ring<R: RingObject>(ring: &R) -> Result<(), String> {
    let name = ring.ring_ref().name;
    if name.len() > MAX_NAME_LEN {
        return Err(name_length_message(R::KIND));
    }
    let spec = ring.ring_spec();
    let mut main_resources = HashSet::new();
    for (i, resource) in spec.resources.iter().enumerate() {
        if resource.resource.is_empty() {
            return Err(format!(
                "Resource spec.resources[{i}].resource must not be empty"
            ));
        }
        if !main_resources.insert(resource.group_resource()) {
            return Err(format!(
                "Resource {} is listed more than once in spec.resources",
                resource.group_resource()
            ));
        }
        let mut controlled = HashSet::new();
        for (j, c) in resource.controlled_resources.iter().enumerate() {
            if c.resource.is_empty() {
                return Err(format!(
                    "Resource spec.resources[{i}].controlledResources[{j}].resource must not be empty"
                ));
            }
            if !controlled.insert(c.clone()) {
                return Err(format!(
                    "Controlled resource {c} is listed more than once for {}",
                    resource.group_resource()
                ));
            }
        }
    }
    if let Some(selector) = &spec.namespace_selector {
        validate_label_selector(selector)
            .map_err(|e| format!("Invalid spec.namespaceSelector: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
    use sharding_crds::{ClusterRing, ClusterRingSpec, GroupResource, RingResource};

    fn ring(name: &str, resources: Vec<RingResource>) -> ClusterRing {
        ClusterRing::new(
            name,
            ClusterRingSpec {
                resources,
                namespace_selector: None,
                hash_key: None,
            },
        )
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
    fn accepts_valid_rings() {
        assert_eq!(validate_ring(&ring("a", vec![])), Ok(()));
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
        assert_eq!(validate_ring(&r), Ok(()));
    }

    #[test]
    fn rejects_long_names() {
        let err = validate_ring(&ring(&"x".repeat(64), vec![])).unwrap_err();
        assert_eq!(
            err,
            "ClusterRing name must not be longer than 63 characters"
        );
    }

    #[test]
    fn rejects_duplicates_and_empty_resources() {
        let err = validate_ring(&ring(
            "a",
            vec![res("", "secrets", &[]), res("", "secrets", &[])],
        ))
        .unwrap_err();
        assert_eq!(
            err,
            "Resource secrets is listed more than once in spec.resources"
        );
        let err = validate_ring(&ring("a", vec![res("apps", "", &[])])).unwrap_err();
        assert!(
            err.contains("spec.resources[0].resource must not be empty"),
            "{err}"
        );
        let err = validate_ring(&ring(
            "a",
            vec![res(
                "",
                "secrets",
                &[("", "configmaps"), ("", "configmaps")],
            )],
        ))
        .unwrap_err();
        assert!(err.contains("configmaps is listed more than once"), "{err}");
        let err = validate_ring(&ring("a", vec![res("", "secrets", &[("", "")])])).unwrap_err();
        assert!(err.contains("controlledResources[0].resource"), "{err}");
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
        let err = validate_ring(&r).unwrap_err();
        assert!(err.starts_with("Invalid spec.namespaceSelector: "), "{err}");
        assert!(err.contains("Equals"), "{err}");
    }
}
