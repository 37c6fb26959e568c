//! The generated ClusterRing CRD against a real API server.

use e2e::fixtures::secrets_controlling_configmaps;
use e2e::{cluster, unique_name};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, ObjectMeta};
use kube_sharding_api::{
    ClusterRing, ClusterRingSpec, ClusterRingStatus, GroupResource, RingResource,
};

fn ring_api(client: &kube::Client) -> Api<ClusterRing> {
    Api::all(client.clone())
}

fn dynamic_ring_api(client: &kube::Client) -> Api<DynamicObject> {
    Api::all_with(client.clone(), &ApiResource::erase::<ClusterRing>(&()))
}

#[tokio::test]
async fn crd_is_established_with_spec_names() -> anyhow::Result<()> {
    let client = cluster().client().await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client);
    let crd = crds.get("clusterrings.sharding.timebertt.dev").await?;
    let established = crd
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .any(|c| c.type_ == "Established" && c.status == "True");
    assert!(established, "CRD is not Established");
    assert_eq!(crd.spec.scope, "Cluster");
    assert_eq!(crd.spec.names.list_kind.as_deref(), Some("ClusterRingList"));
    assert_eq!(crd.spec.names.singular.as_deref(), Some("clusterring"));
    Ok(())
}

#[tokio::test]
async fn valid_ring_round_trips_with_status() -> anyhow::Result<()> {
    let client = cluster().client().await?;
    let api = ring_api(&client);
    let name = unique_name("roundtrip");
    let spec = ClusterRingSpec {
        resources: vec![
            secrets_controlling_configmaps(),
            RingResource::controlling(
                "apps",
                "deployments",
                [GroupResource::new("apps", "replicasets")],
            ),
        ],
        namespace_selector: Some(LabelSelector {
            match_labels: Some([("team".to_string(), String::new())].into()),
            ..Default::default()
        }),
        hash_key: Some(kube_sharding_api::HashKey::Namespace),
        lease_namespaces: Vec::new(),
        assignment: None,
    };
    let created = api
        .create(
            &PostParams::default(),
            &ClusterRing::new(&name, spec.clone()),
        )
        .await?;
    assert_eq!(
        created.spec, spec,
        "spec (with core group \"\") survives the round trip"
    );
    assert_eq!(api.get(&name).await?.spec, spec);

    let status = ClusterRingStatus {
        observed_generation: created.metadata.generation,
        shards: 3,
        available_shards: 2,
        conditions: vec![Condition {
            type_: "Ready".into(),
            status: "True".into(),
            reason: "ReconciliationSucceeded".into(),
            message: "ClusterRing was successfully reconciled".into(),
            observed_generation: created.metadata.generation,
            last_transition_time: Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_000)?),
        }],
        departed_shards: vec![kube_sharding_api::DepartedShard {
            name: "shard-a".into(),
            until: Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_030)?),
        }],
        range_generation: Some(7),
    };
    // A running sharder writes this ring's status too, so each check reads the answer to its own
    // write rather than a later GET.
    let written = api
        .patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "status": status })),
        )
        .await?;
    assert_eq!(written.status.as_ref(), Some(&status));
    assert_eq!(
        written.metadata.generation, created.metadata.generation,
        "a status write must not bump the generation"
    );

    // Spec writes through the main resource ignore the status they carry.
    let replaced = loop {
        let current = api.get(&name).await?;
        let mut changed = current.clone();
        changed.spec.resources.pop();
        changed.status = None;
        match api.replace(&name, &PostParams::default(), &changed).await {
            Ok(replaced) => break (replaced, current.status),
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    };
    assert_eq!(replaced.0.spec.resources.len(), 1);
    assert!(
        replaced.1.is_some(),
        "the ring had a status before the spec write"
    );
    assert_eq!(
        replaced.0.status, replaced.1,
        "a spec write changed the status"
    );
    api.delete(&name, &Default::default()).await?;
    Ok(())
}

#[tokio::test]
async fn ring_without_spec_gets_empty_spec() -> anyhow::Result<()> {
    let client = cluster().client().await?;
    let name = unique_name("bare");
    let obj: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "sharding.timebertt.dev/v1alpha1",
        "kind": "ClusterRing",
        "metadata": {"name": name},
    }))?;
    dynamic_ring_api(&client)
        .create(&PostParams::default(), &obj)
        .await?;
    let ring = ring_api(&client).get(&name).await?;
    assert_eq!(ring.spec, ClusterRingSpec::default());
    Ok(())
}

/// Creates a ring from raw JSON and returns the server's rejection message.
async fn rejection(spec: serde_json::Value) -> anyhow::Result<String> {
    let client = cluster().client().await?;
    let obj: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "sharding.timebertt.dev/v1alpha1",
        "kind": "ClusterRing",
        "metadata": {"name": unique_name("invalid")},
        "spec": spec,
    }))?;
    match dynamic_ring_api(&client)
        .create(&PostParams::default(), &obj)
        .await
    {
        Ok(created) => anyhow::bail!("server accepted an invalid ClusterRing: {created:?}"),
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422, "{status:?}");
            Ok(status.message)
        }
        Err(other) => Err(other.into()),
    }
}

#[tokio::test]
async fn schema_rejects_missing_resource() -> anyhow::Result<()> {
    let message = rejection(serde_json::json!({"resources": [{"group": "apps"}]})).await?;
    assert!(
        message.contains("spec.resources[0].resource: Required value"),
        "{message}"
    );
    Ok(())
}

#[tokio::test]
async fn schema_rejects_missing_group() -> anyhow::Result<()> {
    let message = rejection(serde_json::json!({"resources": [{"resource": "secrets"}]})).await?;
    assert!(
        message.contains("spec.resources[0].group: Required value"),
        "{message}"
    );
    let message = rejection(serde_json::json!({
        "resources": [{"group": "", "resource": "secrets", "controlledResources": [{"resource": "configmaps"}]}]
    }))
    .await?;
    assert!(
        message.contains("spec.resources[0].controlledResources[0].group: Required value"),
        "{message}"
    );
    Ok(())
}

#[tokio::test]
async fn schema_rejects_wrong_types() -> anyhow::Result<()> {
    let message =
        rejection(serde_json::json!({"resources": [{"group": "", "resource": 5}]})).await?;
    assert!(
        message.contains("spec.resources[0].resource in body must be of type string"),
        "{message}"
    );
    let message = rejection(serde_json::json!({"resources": "secrets"})).await?;
    assert!(message.contains("spec.resources"), "{message}");
    assert!(message.contains("must be of type array"), "{message}");
    let message = rejection(serde_json::json!({"namespaceSelector": {"matchLabels": []}})).await?;
    assert!(
        message.contains("spec.namespaceSelector.matchLabels"),
        "{message}"
    );
    Ok(())
}

#[tokio::test]
async fn duplicate_resources_are_rejected_by_the_list_map() -> anyhow::Result<()> {
    let message = rejection(serde_json::json!({"resources": [
        {"group": "", "resource": "secrets"},
        {"group": "", "resource": "secrets"},
    ]}))
    .await?;
    assert!(message.contains("Duplicate value"), "{message}");
    Ok(())
}

#[tokio::test]
async fn long_names_are_rejected_by_the_cel_rule() -> anyhow::Result<()> {
    let cluster = cluster();
    let client = cluster.client().await?;
    let name = format!("{}-{}", unique_name("long"), "x".repeat(60));
    let ring = ClusterRing {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        spec: ClusterRingSpec::default(),
        status: None,
    };
    let result = ring_api(&client)
        .create(&PostParams::default(), &ring)
        .await;
    let Err(kube::Error::Api(status)) = result else {
        anyhow::bail!("a {}-character name was accepted: {result:?}", name.len());
    };
    assert_eq!(status.code, 422, "{status:?}");
    assert!(
        status
            .message
            .contains("ClusterRing name must not be longer than 63 characters"),
        "{status:?}"
    );
    Ok(())
}
