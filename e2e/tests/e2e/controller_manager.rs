//! What kube-controller-manager does to a ring's objects: the garbage collector follows the webhook
//! configuration's owner reference, and the namespace controller empties deleted namespaces.

use std::time::Duration;

use anyhow::ensure;
use e2e::fixtures::{WAIT, create_lease, ring_with_shards, secret, wait_status, wait_webhook};
use e2e::process::poll_until;
use e2e::scenario::SharedScenario;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use kube_sharding_api::ClusterRing;
use kube_sharding_api::labels;
use serde_json::json;

/// The garbage collector needs a few seconds to notice a deleted owner; a namespace's content is
/// deleted in several passes.
const GC_WAIT: Duration = Duration::from_secs(90);

#[tokio::test]
async fn deleting_a_ring_removes_its_webhook_configuration_and_keeps_labels() -> anyhow::Result<()>
{
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ..
    } = SharedScenario::open().await?;
    let shards = ["shard-a", "shard-b"];
    let (ns, ring) = ring_with_shards(cluster, &client, "gc", &shards).await?;
    wait_status(&client, &ring, 2, 2).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    let key = labels::shard_label(&ring);
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    for i in 0..5 {
        let created = secrets
            .create(&PostParams::default(), &secret(&format!("secret-{i}")))
            .await?;
        ensure!(
            created.labels().contains_key(&key),
            "secret-{i} not assigned"
        );
    }
    let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let config_name = labels::webhook_configuration_name(&ring);
    let config = configs.get(&config_name).await?;
    let rings = Api::<ClusterRing>::all(client.clone());
    let uid = rings.get(&ring).await?.uid();
    ensure!(
        config
            .owner_references()
            .iter()
            .any(|o| o.kind == "ClusterRing" && Some(&o.uid) == uid.as_ref()),
        "webhook configuration is not owned by the ring: {:?}",
        config.owner_references()
    );

    rings.delete(&ring, &DeleteParams::default()).await?;
    poll_until(
        "the garbage collector to delete the webhook configuration",
        GC_WAIT,
        || {
            let (configs, config_name) = (configs.clone(), config_name.clone());
            async move { Ok(configs.get_opt(&config_name).await?.is_none().then_some(())) }
        },
    )
    .await?;

    // The objects keep the labels they had; new objects are no longer assigned.
    for s in secrets.list(&ListParams::default()).await? {
        ensure!(
            s.labels().contains_key(&key),
            "{} lost its shard label after the ring was deleted",
            s.name_any()
        );
    }
    let created = secrets
        .create(&PostParams::default(), &secret("after"))
        .await?;
    ensure!(
        !created.labels().contains_key(&key),
        "an object was assigned after the ring and its webhook were deleted"
    );
    logs.passed();
    Ok(())
}

/// A ring deleted in the foreground stays, marked for deletion, until the garbage collector has
/// deleted its webhook configuration: the sharder must not restore the configuration meanwhile,
/// or the API server keeps calling a webhook whose ring is about to go (and, once it is gone,
/// fails open there).
#[tokio::test]
async fn a_ring_deleted_in_the_foreground_gets_no_webhook_configuration_back() -> anyhow::Result<()>
{
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ..
    } = SharedScenario::open().await?;
    let shards = ["shard-a"];
    let (ns, ring) = ring_with_shards(cluster, &client, "gc-fg", &shards).await?;
    wait_status(&client, &ring, 1, 1).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let config_name = labels::webhook_configuration_name(&ring);
    let version = configs
        .get(&config_name)
        .await?
        .resource_version()
        .unwrap_or_default();
    let mut events = configs
        .watch(
            &WatchParams::default().fields(&format!("metadata.name={config_name}")),
            &version,
        )
        .await?
        .boxed();

    let rings = Api::<ClusterRing>::all(client.clone());
    rings.delete(&ring, &DeleteParams::foreground()).await?;
    poll_until("the ring to be gone", GC_WAIT, || {
        let (rings, ring) = (rings.clone(), ring.clone());
        async move { Ok(rings.get_opt(&ring).await?.is_none().then_some(())) }
    })
    .await?;
    // Whatever the sharder's caches still held of the ring has had time to act.
    let quiet_until = tokio::time::Instant::now() + Duration::from_secs(5);
    let (mut deleted, mut restored) = (0, 0);
    while let Ok(event) = tokio::time::timeout_at(quiet_until, events.try_next()).await {
        let Some(event) = event? else { break };
        match event {
            WatchEvent::Added(_) => restored += 1,
            WatchEvent::Deleted(_) => deleted += 1,
            _ => {}
        }
    }
    ensure!(
        restored == 0,
        "the sharder restored the webhook configuration of a ring being deleted {restored} times"
    );
    ensure!(
        deleted == 1 && configs.get_opt(&config_name).await?.is_none(),
        "the webhook configuration was deleted {deleted} times and is {}",
        if configs.get_opt(&config_name).await?.is_some() {
            "still there"
        } else {
            "gone"
        }
    );
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn deleting_a_rings_namespace_leaves_the_sharder_healthy() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        cluster,
        client,
        ..
    } = SharedScenario::open().await?;
    let shards = ["shard-a", "shard-b"];
    let (ns, ring) = ring_with_shards(cluster, &client, "nsdel", &shards).await?;
    wait_status(&client, &ring, 2, 2).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    for i in 0..5 {
        secrets
            .create(&PostParams::default(), &secret(&format!("secret-{i}")))
            .await?;
    }

    // The namespace controller deletes the Secrets and the shards' Leases with it.
    let namespaces = Api::<Namespace>::all(client.clone());
    namespaces.delete(&ns, &DeleteParams::default()).await?;
    poll_until(&format!("namespace {ns} to be gone"), GC_WAIT, || {
        let (namespaces, ns) = (namespaces.clone(), ns.clone());
        async move { Ok(namespaces.get_opt(&ns).await?.is_none().then_some(())) }
    })
    .await?;
    let leases = Api::<Lease>::all(client.clone());
    let left = leases
        .list(&ListParams::default().labels(&format!("{}={ring}", labels::LABEL_CLUSTER_RING)))
        .await?;
    ensure!(
        left.items.is_empty(),
        "Leases survived their namespace: {left:?}"
    );

    // The ring stays Ready with no shards, and the sharder keeps serving and answering.
    wait_status(&client, &ring, 0, 0).await?;
    sharder.files.wait_ready(WAIT).await?;

    // The namespace comes back with its shards: the ring works as before.
    let recreated: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))?;
    namespaces
        .create(&PostParams::default(), &recreated)
        .await?;
    for shard in shards {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    wait_status(&client, &ring, 2, 2).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    logs.passed();
    Ok(())
}
