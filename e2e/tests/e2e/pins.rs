//! Pins (docs/protocol.md §21): an annotation that puts an object, or every object of a namespace,
//! on a chosen shard; children follow their controller's pin; a pin whose shard is missing falls
//! back to the ring, is reported, and is honoured through a drain once the shard comes.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use e2e::IndependentRing;
use e2e::fixtures::{
    WAIT, create_lease, ring_with_shards, secret, wait_webhook, watch_ring_with_shards,
};
use e2e::process::poll_until;
use e2e::scenario::SharedScenario;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PostParams};
use kube_sharding_api::labels;
use serde_json::json;

/// A Secret `name` pinned to `shard` by the pin annotation of ClusterRing `ring`.
fn pinned_secret(ring: &str, name: &str, shard: &str) -> Secret {
    let mut secret = secret(name);
    secret.metadata.annotations = Some([(labels::pin_annotation(ring), shard.to_string())].into());
    secret
}

/// A name in `namespace` the hash ring of `shards` does not place on `avoid`, starting with
/// `prefix`.
fn name_off(shards: &[&str], namespace: &str, prefix: &str, avoid: &str) -> String {
    let ring = IndependentRing::unweighted(shards);
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|n| ring.try_shard_for(&format!("/Secret/{namespace}/{n}")) != Some(avoid))
        .expect("some name avoids one shard of several")
}

/// The shard label of ClusterRing `ring` on Secret `name`.
async fn shard_of(api: &Api<Secret>, ring: &str, name: &str) -> anyhow::Result<Option<String>> {
    Ok(api
        .get(name)
        .await?
        .labels()
        .get(&labels::shard_label(ring))
        .cloned())
}

/// Waits until Secret `name` carries the shard label `shard` of ClusterRing `ring`.
async fn wait_on(api: &Api<Secret>, ring: &str, name: &str, shard: &str) -> anyhow::Result<()> {
    let result = poll_until(&format!("Secret {name} on {shard}"), WAIT, || async {
        Ok((shard_of(api, ring, name).await?.as_deref() == Some(shard)).then_some(()))
    })
    .await;
    if result.is_err() {
        let now = shard_of(api, ring, name).await?;
        return result.with_context(|| format!("Secret {name} is on {now:?}"));
    }
    Ok(())
}

/// Acknowledges the drain of Secret `name` as its shard would: removes the shard and drain labels.
async fn acknowledge_drain(api: &Api<Secret>, ring: &str, name: &str) -> anyhow::Result<()> {
    let patch = json!({"metadata": {"labels": {
        labels::shard_label(ring): null,
        labels::drain_label(ring): null,
    }}});
    api.patch(name, &e2e::patch_params(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

#[tokio::test]
async fn pins_place_objects_children_and_namespaces_and_wait_for_missing_shards()
-> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        cluster,
        sharder,
        ..
    } = SharedScenario::open().await?;
    let shards = ["shard-a", "shard-b", "shard-c"];
    let (ns, ring) = ring_with_shards(cluster, &client, "pins", &shards).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let params = PostParams::default();

    // An object pin decides, against the ring's choice.
    let pinned = name_off(&shards, &ns, "pinned", "shard-b");
    secrets
        .create(&params, &pinned_secret(&ring, &pinned, "shard-b"))
        .await?;
    wait_on(&secrets, &ring, &pinned, "shard-b").await?;

    // A child without a pin of its own follows its controller's pin, not the ring's choice for
    // the controller's key.
    let controller = secrets.get(&pinned).await?;
    let child = ConfigMap {
        metadata: ObjectMeta {
            name: Some("child".into()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Secret".into(),
                name: pinned.clone(),
                uid: controller.uid().unwrap_or_default(),
                controller: Some(true),
                ..Default::default()
            }]),
            ..Default::default()
        },
        ..Default::default()
    };
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    configmaps.create(&params, &child).await?;
    let key = labels::shard_label(&ring);
    poll_until(
        "the child on its controller's pinned shard",
        WAIT,
        || async {
            let child = configmaps.get("child").await?;
            Ok((child.labels().get(&key).map(String::as_str) == Some("shard-b")).then_some(()))
        },
    )
    .await?;

    // A pin to a shard that does not exist yet, and a malformed one: the ring places both, and
    // nothing refuses the writes.
    let ring_of_three = IndependentRing::unweighted(shards);
    let waiting = "waiting".to_string();
    secrets
        .create(&params, &pinned_secret(&ring, &waiting, "shard-d"))
        .await?;
    secrets
        .create(&params, &pinned_secret(&ring, "malformed", "not a shard!"))
        .await?;
    for name in [waiting.as_str(), "malformed"] {
        let expected = ring_of_three
            .try_shard_for(&format!("/Secret/{ns}/{name}"))
            .expect("a shard");
        wait_on(&secrets, &ring, name, expected).await?;
    }

    // A namespace pin decides for objects without a pin of their own.
    let namespaces = Api::<Namespace>::all(client.clone());
    namespaces
        .patch(
            &ns,
            &e2e::patch_params(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                labels::pin_annotation(&ring): "shard-c"
            }}})),
        )
        .await?;
    let in_namespace = name_off(&shards, &ns, "in-namespace", "shard-c");
    poll_until("the namespace pin to reach the sharder", WAIT, || async {
        let probe = secrets
            .create(
                &PostParams {
                    dry_run: true,
                    ..Default::default()
                },
                &secret(&in_namespace),
            )
            .await?;
        Ok((probe.labels().get(&key).map(String::as_str) == Some("shard-c")).then_some(()))
    })
    .await?;
    secrets.create(&params, &secret(&in_namespace)).await?;
    wait_on(&secrets, &ring, &in_namespace, "shard-c").await?;

    // The pinned shard comes: the sync drains the object from the ring's choice, and once the
    // drain is acknowledged the webhook puts it on the pinned shard.
    create_lease(&client, &ns, &ring, "shard-d", 3600).await?;
    poll_until(
        "the pinned object drained towards its shard",
        WAIT,
        || async {
            let object = secrets.get(&waiting).await?;
            Ok(object
                .labels()
                .contains_key(&labels::drain_label(&ring))
                .then_some(()))
        },
    )
    .await?;
    acknowledge_drain(&secrets, &ring, &waiting).await?;
    wait_on(&secrets, &ring, &waiting, "shard-d").await?;

    // Pinning an assigned object and draining it in one write moves it at once.
    let mover = "mover".to_string();
    secrets.create(&params, &secret(&mover)).await?;
    let first = poll_until("the mover assigned", WAIT, || async {
        shard_of(&secrets, &ring, &mover).await
    })
    .await?;
    let target = ["shard-a", "shard-b"]
        .into_iter()
        .find(|s| *s != first)
        .expect("another shard");
    secrets
        .patch(
            &mover,
            &e2e::patch_params(),
            &Patch::Merge(json!({"metadata": {
                "annotations": {labels::pin_annotation(&ring): target},
                "labels": {labels::drain_label(&ring): "true"},
            }})),
        )
        .await?;
    acknowledge_drain(&secrets, &ring, &mover).await?;
    wait_on(&secrets, &ring, &mover, target).await?;

    // The malformed pin is reported on its object and counted; the others are honoured: the
    // sync that followed shard-d counted them.
    let events = Api::<Event>::namespaced(client.clone(), &ns);
    poll_until(
        "a PinUnsatisfied Event on the malformed pin",
        WAIT,
        || async {
            let found = events
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .any(|e| {
                    e.reason.as_deref() == Some("PinUnsatisfied")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("malformed")
                        && e.note
                            .as_deref()
                            .is_some_and(|n| n.contains("not a shard name"))
                });
            Ok(found.then_some(()))
        },
    )
    .await?;
    let metrics = sharder.metrics()?;
    let pins = |state: &str| {
        e2e::prometheus::sum(
            &metrics,
            "controller_sharding_pinned_objects",
            &[("clusterring", ring.as_str()), ("state", state)],
        )
    };
    // pinned, its child, waiting (shard-d came before that sync), the namespace-pinned one.
    ensure!(
        pins("invalid") == 1.0,
        "invalid pins counted: {}",
        pins("invalid")
    );
    ensure!(
        pins("honoured") >= 4.0,
        "honoured pins counted: {}",
        pins("honoured")
    );
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn a_watch_ring_honours_pins() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("pinwatch").await?;
    let shards = ["shard-a", "shard-b", "shard-c"];
    let ring = watch_ring_with_shards(&client, &ns, "pinwatch", &shards).await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let names: Vec<String> = (0..5)
        .map(|i| name_off(&shards, &ns, &format!("w{i}"), "shard-c"))
        .collect();
    for name in &names {
        secrets
            .create(
                &PostParams::default(),
                &pinned_secret(&ring, name, "shard-c"),
            )
            .await?;
    }
    for name in &names {
        wait_on(&secrets, &ring, name, "shard-c").await?;
    }
    // Nothing else wrote the label meanwhile: each is on its pin, not the ring's choice.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for name in &names {
        ensure!(
            shard_of(&secrets, &ring, name).await?.as_deref() == Some("shard-c"),
            "{name} left its pin"
        );
    }
    logs.passed();
    Ok(())
}
