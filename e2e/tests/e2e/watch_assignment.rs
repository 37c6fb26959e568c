//! Rings with `assignment: Watch`: no webhook configuration, new objects labelled by the
//! sharder's watch of unassigned objects, and no assignment lost while a ring switches modes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::ensure;
use e2e::fixtures::{
    WAIT, create_lease, create_ring, expected_shard, ring_spec, secret, wait_status,
    watch_ring_with_shards,
};
use e2e::process::poll_until;
use e2e::scenario::SharedScenario;
use e2e::{IndependentRing, unique_name};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::{Assignment, ClusterRing, labels};
use serde_json::json;

/// How soon a new object of a Watch ring must carry its label: the watch event reaches the
/// sharder within milliseconds and the patch follows at once; seconds leave room for a busy
/// machine.
const LABELLED_WITHIN: Duration = Duration::from_secs(5);

/// Whether the webhook configuration of ClusterRing `ring` exists.
async fn has_webhook_configuration(client: &Client, ring: &str) -> anyhow::Result<bool> {
    let api = Api::<MutatingWebhookConfiguration>::all(client.clone());
    Ok(api
        .get_opt(&labels::webhook_configuration_name(ring))
        .await?
        .is_some())
}

/// Switches ClusterRing `ring` to `assignment`.
async fn set_assignment(client: &Client, ring: &str, assignment: Assignment) -> anyhow::Result<()> {
    Api::<ClusterRing>::all(client.clone())
        .patch(
            ring,
            &e2e::patch_params(),
            &Patch::Merge(json!({"spec": {"assignment": assignment}})),
        )
        .await?;
    Ok(())
}

/// Waits until every Secret of `names` in `namespace` carries the shard the independent ring
/// `predicted` gives it; returns the labels seen.
async fn wait_assigned(
    client: &Client,
    namespace: &str,
    ring: &str,
    predicted: &IndependentRing,
    names: &[String],
    within: Duration,
) -> anyhow::Result<()> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let key = labels::shard_label(ring);
    let result = poll_until(
        &format!(
            "{} Secrets in {namespace} to carry their shard",
            names.len()
        ),
        within,
        || {
            let (api, key) = (api.clone(), key.clone());
            async move {
                let labelled: BTreeMap<String, Option<String>> = api
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .map(|s| (s.name_any(), s.labels().get(&key).cloned()))
                    .collect();
                Ok(names
                    .iter()
                    .all(|name| {
                        labelled.get(name).cloned().flatten().as_deref()
                            == expected_shard(predicted, namespace, name)
                    })
                    .then_some(()))
            }
        },
    )
    .await;
    if result.is_err() {
        let secrets = api.list(&ListParams::default()).await?;
        let wrong: Vec<(String, Option<String>)> = secrets
            .items
            .iter()
            .filter(|s| {
                names.contains(&s.name_any())
                    && s.labels().get(&key).map(String::as_str)
                        != expected_shard(predicted, namespace, &s.name_any())
            })
            .map(|s| (s.name_any(), s.labels().get(&key).cloned()))
            .collect();
        anyhow::bail!(
            "{} objects not where the ring wants them: {wrong:?}",
            wrong.len()
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_watch_ring_has_no_webhook_and_labels_new_objects_within_seconds() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("watch").await?;
    let shards = ["shard-a", "shard-b", "shard-c"];
    // Ready means the ring controller reconciled the ring: a webhook ring has its configuration
    // by now.
    let ring = watch_ring_with_shards(&client, &ns, "watch", &shards).await?;
    ensure!(
        !has_webhook_configuration(&client, &ring).await?,
        "a Watch ring got a webhook configuration"
    );

    let key = labels::shard_label(&ring);
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let names: Vec<String> = (0..30).map(|i| format!("secret-{i}")).collect();
    for name in &names {
        let created = secrets
            .create(&PostParams::default(), &secret(name))
            .await?;
        // No admission-time label: the API server calls no webhook of ours.
        ensure!(
            !created.labels().contains_key(&key),
            "{name} was labelled at admission: {:?}",
            created.labels()
        );
    }
    let predicted = IndependentRing::unweighted(shards);
    wait_assigned(&client, &ns, &ring, &predicted, &names, LABELLED_WITHIN).await?;
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn controlled_objects_follow_their_controller_in_watch_mode() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("watch-owner").await?;
    let ring = unique_name("watch-owner");
    let spec = kube_sharding_api::ClusterRingSpec {
        assignment: Some(Assignment::Watch),
        ..ring_spec(&ns)
    };
    create_ring(&client, &ring, spec).await?;
    let two = ["shard-a", "shard-b"];
    for shard in two {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    wait_status(&client, &ring, 2, 2).await?;
    // An owner the third shard will take: its drain stays pending, as these Leases have no
    // running shard to acknowledge it.
    let three = ["shard-a", "shard-b", "shard-c"];
    let (before, after) = (
        IndependentRing::unweighted(two),
        IndependentRing::unweighted(three),
    );
    let owner = (0..1000)
        .map(|i| format!("owner-{i}"))
        .find(|name| expected_shard(&after, &ns, name) == Some("shard-c"))
        .ok_or_else(|| anyhow::anyhow!("no owner name that shard-c takes"))?;
    let old_shard = expected_shard(&before, &ns, &owner).map(str::to_string);
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    secrets
        .create(&PostParams::default(), &secret(&owner))
        .await?;
    wait_assigned(
        &client,
        &ns,
        &ring,
        &before,
        std::slice::from_ref(&owner),
        LABELLED_WITHIN,
    )
    .await?;
    let owner_ref = OwnerReference {
        api_version: "v1".into(),
        kind: "Secret".into(),
        name: owner.clone(),
        uid: secrets.get(&owner).await?.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    };
    let child = |name: &str| ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            owner_references: Some(vec![owner_ref.clone()]),
            ..Default::default()
        },
        ..Default::default()
    };
    let key = labels::shard_label(&ring);
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let child_shard = |name: String| {
        let (configmaps, key) = (configmaps.clone(), key.clone());
        async move {
            poll_until(&format!("{name} to be labelled"), LABELLED_WITHIN, || {
                let (configmaps, key, name) = (configmaps.clone(), key.clone(), name.clone());
                async move {
                    let cm = configmaps.get(&name).await?;
                    Ok(cm.labels().get(&key).cloned())
                }
            })
            .await
        }
    };
    // A child of a settled owner lands on the owner's shard.
    configmaps
        .create(&PostParams::default(), &child("child-before"))
        .await?;
    ensure!(Some(child_shard("child-before".into()).await?) == old_shard);

    // The third shard joins: the ring wants the owner there, but it stays on its old shard until
    // its drain is acknowledged, which never happens here. A child created meanwhile goes where
    // the owner is, not where the ring wants it: its owner's shard still reconciles the owner.
    create_lease(&client, &ns, &ring, "shard-c", 3600).await?;
    wait_status(&client, &ring, 3, 3).await?;
    let drain = labels::drain_label(&ring);
    poll_until("the owner's drain", WAIT, || {
        let (secrets, owner, drain) = (secrets.clone(), owner.clone(), drain.clone());
        async move {
            Ok(secrets
                .get(&owner)
                .await?
                .labels()
                .contains_key(&drain)
                .then_some(()))
        }
    })
    .await?;
    configmaps
        .create(&PostParams::default(), &child("child-during"))
        .await?;
    let during = child_shard("child-during".into()).await?;
    ensure!(
        Some(&during) == old_shard.as_ref(),
        "a child created while its owner's drain is pending went to {during}, its owner is on {old_shard:?}"
    );
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn switching_assignment_modes_loses_no_assignment() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("switch").await?;
    let ring = unique_name("switch");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let shards = ["shard-a", "shard-b", "shard-c"];
    for shard in shards {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    wait_status(&client, &ring, 3, 3).await?;
    let webhook_is = |present: bool| {
        let (client, ring) = (client.clone(), ring.clone());
        async move {
            poll_until(
                &format!("the ring's webhook configuration to be present: {present}"),
                WAIT,
                || {
                    let (client, ring) = (client.clone(), ring.clone());
                    async move {
                        Ok(
                            (has_webhook_configuration(&client, &ring).await? == present)
                                .then_some(()),
                        )
                    }
                },
            )
            .await
        }
    };
    webhook_is(true).await?;

    // Objects are created without pause while the ring switches Webhook → Watch → Webhook.
    let stop = Arc::new(AtomicBool::new(false));
    let creator = {
        let (secrets, stop) = (Api::<Secret>::namespaced(client.clone(), &ns), stop.clone());
        tokio::spawn(async move {
            let mut names = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let name = format!("secret-{}", names.len());
                secrets
                    .create(&PostParams::default(), &secret(&name))
                    .await?;
                names.push(name);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            anyhow::Ok(names)
        })
    };
    let pause = || tokio::time::sleep(Duration::from_secs(2));
    pause().await;
    set_assignment(&client, &ring, Assignment::Watch).await?;
    webhook_is(false).await?;
    pause().await;
    set_assignment(&client, &ring, Assignment::Webhook).await?;
    webhook_is(true).await?;
    pause().await;
    stop.store(true, Ordering::Relaxed);
    let names = creator.await??;
    ensure!(names.len() > 100, "only {} objects created", names.len());

    let predicted = IndependentRing::unweighted(shards);
    wait_assigned(&client, &ns, &ring, &predicted, &names, LABELLED_WITHIN).await?;
    logs.passed();
    Ok(())
}
