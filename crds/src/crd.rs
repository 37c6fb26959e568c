//! The generated CustomResourceDefinitions of `ClusterRing` and `ControllerRing` and their
//! committed YAML.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSON;
use kube::CustomResourceExt;

use crate::RingKind;
use crate::cluster_ring::{
    ClusterRing, NAME_LENGTH_RULE, SERVER_SIDE_CONTROLLED_MESSAGE, SERVER_SIDE_CONTROLLED_RULE,
};

/// Path of the committed ClusterRing CRD YAML, relative to the repository root.
pub const CRD_PATH: &str = "config/crds/sharding.timebertt.dev_clusterrings.yaml";

/// Command that regenerates the committed CRD YAML files from the Rust types.
pub const REGENERATE_COMMAND: &str = "cargo run -p kube-sharding-api --bin crdgen";

/// Path of the committed CRD YAML of `kind`, relative to the repository root.
pub fn crd_path(kind: RingKind) -> String {
    format!("config/crds/sharding.timebertt.dev_{}.yaml", kind.plural())
}

/// Description of the resource at the root of its schema (shown by `kubectl explain`).
fn description(kind: RingKind) -> String {
    format!(
        "{} is a ring of controller instances (shards) that split the objects of some resources \
between them. The sharder assigns every object of the listed resources to one available shard by \
writing the ring's shard label, and moves objects when shards come and go.",
        kind.kind()
    )
}

/// The message of the CEL rule on the name length.
pub fn name_length_message(kind: RingKind) -> String {
    format!("{} name must not be longer than 63 characters", kind.kind())
}

/// The `ClusterRing` CRD, including the CEL rule on the name length.
pub fn cluster_ring_crd() -> CustomResourceDefinition {
    ring_crd(RingKind::ClusterRing)
}

/// The CRD of `kind`, including the CEL rules on the name length and on `assignment: ServerSide`.
///
/// Both kinds have one schema: the ControllerRing CRD is the ClusterRing one with the names
/// changed, so the two can never drift apart. The derive macro does not reach the root schema, so
/// three things are set here: the CEL rules (API servers older than 1.25 drop them silently; the
/// sharder checks them at runtime as well), an optional `spec` defaulted to `{}` by the server
/// (so a ring without one still deserializes), and the description.
pub fn ring_crd(kind: RingKind) -> CustomResourceDefinition {
    let mut crd = ClusterRing::crd();
    let names = &mut crd.spec.names;
    names.kind = kind.kind().into();
    names.plural = kind.plural().into();
    names.singular = Some(kind.kind().to_ascii_lowercase());
    // The server would default it; spelling it out keeps the committed YAML complete.
    names.list_kind = Some(format!("{}List", kind.kind()));
    crd.metadata.name = Some(format!("{}.{}", kind.plural(), crate::labels::GROUP));
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            schema.description = Some(description(kind));
            schema.title = Some(kind.kind().into());
            schema.required = None;
            if let Some(spec) = schema.properties.as_mut().and_then(|p| p.get_mut("spec")) {
                spec.default = Some(JSON(serde_json::json!({})));
            }
            schema.x_kubernetes_validations = Some(vec![
                k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::ValidationRule {
                    rule: NAME_LENGTH_RULE.into(),
                    message: Some(name_length_message(kind)),
                    ..Default::default()
                },
                k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::ValidationRule {
                    rule: SERVER_SIDE_CONTROLLED_RULE.into(),
                    message: Some(SERVER_SIDE_CONTROLLED_MESSAGE.into()),
                    ..Default::default()
                },
            ]);
        }
    }
    crd
}

/// The CRD of `kind` as the YAML text committed under [`crd_path`].
pub fn ring_crd_yaml(kind: RingKind) -> Result<String, serde_yaml::Error> {
    let body = serde_yaml::to_string(&ring_crd(kind))?;
    Ok(format!(
        "# Generated from the Rust types in crds/ by `{REGENERATE_COMMAND}`. Do not edit.\n{body}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_crds_match_types() {
        assert_eq!(crd_path(RingKind::ClusterRing), CRD_PATH);
        for kind in RingKind::ALL {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../");
            let path = std::path::Path::new(path).join(crd_path(kind));
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            let generated = ring_crd_yaml(kind).expect("CRD serializes");
            assert!(
                committed == generated,
                "{} is out of date with the Rust types; regenerate it with `{REGENERATE_COMMAND}`",
                path.display()
            );
        }
    }

    #[test]
    fn both_kinds_share_one_schema() {
        let cluster = ring_crd(RingKind::ClusterRing);
        let controller = ring_crd(RingKind::ControllerRing);
        assert_eq!(
            controller.metadata.name.as_deref(),
            Some("controllerrings.sharding.timebertt.dev")
        );
        assert_eq!(controller.spec.names.kind, "ControllerRing");
        assert_eq!(
            controller.spec.names.list_kind.as_deref(),
            Some("ControllerRingList")
        );
        // The ControllerRing type's own derived schema equals the one the CRD carries, so what
        // the sharder deserializes is what the API server validates.
        let derived = crate::ControllerRing::crd();
        let schema = |crd: &CustomResourceDefinition| {
            let mut s = crd.spec.versions[0].schema.clone().expect("schema");
            let root = s.open_api_v3_schema.as_mut().expect("root");
            root.description = None;
            root.title = None;
            root.required = None;
            root.x_kubernetes_validations = None;
            if let Some(spec) = root.properties.as_mut().and_then(|p| p.get_mut("spec")) {
                spec.default = None;
                spec.description = None;
            }
            serde_json::to_value(s).expect("serializes")
        };
        assert_eq!(schema(&cluster), schema(&controller));
        assert_eq!(schema(&derived), schema(&cluster));
        let json = serde_json::to_value(&cluster).expect("serializes");
        let hash_key = &json["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["hashKey"];
        assert_eq!(hash_key["enum"], serde_json::json!(["Object", "Namespace"]));
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
