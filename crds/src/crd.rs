//! The generated CustomResourceDefinition of `ClusterRing` and its committed YAML.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSON;
use kube::CustomResourceExt;

use crate::cluster_ring::{ClusterRing, NAME_LENGTH_MESSAGE, NAME_LENGTH_RULE};

/// Path of the committed CRD YAML, relative to the repository root.
pub const CRD_PATH: &str = "config/crds/sharding.timebertt.dev_clusterrings.yaml";

/// Command that regenerates [`CRD_PATH`] from the Rust types.
pub const REGENERATE_COMMAND: &str = "cargo run -p sharding-crds --bin crdgen";

/// Description of the resource at the root of its schema (shown by `kubectl explain`).
const DESCRIPTION: &str = "ClusterRing is a ring of controller instances (shards) that split the \
objects of some resources between them. The sharder assigns every object of the listed resources \
to one available shard by writing the ring's shard label, and moves objects when shards come and go.";

/// The `ClusterRing` CRD, including the CEL rule on the name length.
///
/// The derive macro does not reach the root schema, so three things are set here: the CEL rule
/// (API servers older than 1.25 drop it silently; the sharder checks the name at runtime as well),
/// an optional `spec` defaulted to `{}` by the server (so a ring without one still deserializes),
/// and the description.
pub fn cluster_ring_crd() -> CustomResourceDefinition {
    let mut crd = ClusterRing::crd();
    // The server would default it; spelling it out keeps the committed YAML complete.
    crd.spec.names.list_kind = Some("ClusterRingList".into());
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            schema.description = Some(DESCRIPTION.into());
            schema.required = None;
            if let Some(spec) = schema.properties.as_mut().and_then(|p| p.get_mut("spec")) {
                spec.default = Some(JSON(serde_json::json!({})));
            }
            schema.x_kubernetes_validations = Some(vec![
                k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::ValidationRule {
                    rule: NAME_LENGTH_RULE.into(),
                    message: Some(NAME_LENGTH_MESSAGE.into()),
                    ..Default::default()
                },
            ]);
        }
    }
    crd
}

/// The CRD as the YAML text committed under [`CRD_PATH`].
pub fn cluster_ring_crd_yaml() -> Result<String, serde_yaml::Error> {
    let body = serde_yaml::to_string(&cluster_ring_crd())?;
    Ok(format!(
        "# Generated from the Rust types in crds/ by `{REGENERATE_COMMAND}`. Do not edit.\n{body}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_crd_matches_types() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../");
        let path = std::path::Path::new(path).join(CRD_PATH);
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        let generated = cluster_ring_crd_yaml().expect("CRD serializes");
        assert!(
            committed == generated,
            "{} is out of date with the Rust types; regenerate it with `{REGENERATE_COMMAND}`",
            path.display()
        );
    }

    #[test]
    fn crd_shape() {
        let crd = cluster_ring_crd();
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some("clusterrings.sharding.timebertt.dev")
        );
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(crd.spec.names.list_kind.as_deref(), Some("ClusterRingList"));
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        assert!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some()
        );
        let columns: Vec<_> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| (c.name.as_str(), c.json_path.as_str()))
            .collect();
        assert_eq!(
            columns,
            [
                ("Ready", ".status.conditions[?(@.type==\"Ready\")].status"),
                ("Available", ".status.availableShards"),
                ("Shards", ".status.shards"),
                ("Age", ".metadata.creationTimestamp"),
            ]
        );
        let json = serde_json::to_value(&crd).expect("serializes");
        let schema = &json["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        assert_eq!(
            schema["x-kubernetes-validations"][0]["rule"],
            NAME_LENGTH_RULE
        );
        let resources = &schema["properties"]["spec"]["properties"]["resources"];
        assert_eq!(resources["x-kubernetes-list-type"], "map");
        let item = &resources["items"];
        let mut required: Vec<_> = item["required"]
            .as_array()
            .expect("required list")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        required.sort_unstable();
        assert_eq!(required, ["group", "resource"]);
    }
}
