//! What the sharder tells operators (issue "Operating it"): metrics that explain rebalancing and
//! Events on the ring, checked against what the test sees in the API server.
//!
//! The shards are Leases the test plays, so drains are never acknowledged: that is the stuck
//! shard the drain warning is about. The shared sharder runs with `drainTimeout: 15s`.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::ensure;
use e2e::fixtures::{
    WAIT, create_lease, create_ring, ring_spec, secret, wait_status, wait_webhook,
};
use e2e::process::poll_until;
use e2e::scenario::SharedScenario;
use e2e::unique_name;
use k8s_openapi::api::core::v1::{Event, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::labels;

/// The value of the series `line_prefix` (everything up to the value) in `metrics`.
fn value(metrics: &str, line_prefix: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(line_prefix)?.trim().parse().ok())
}

/// Reasons of the Events about ClusterRing `ring`.
async fn ring_events(client: &Client, ring: &str) -> anyhow::Result<Vec<Event>> {
    Ok(Api::<Event>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| {
            e.involved_object.kind.as_deref() == Some("ClusterRing")
                && e.involved_object.name.as_deref() == Some(ring)
        })
        .collect())
}

async fn wait_event(
    client: &Client,
    ring: &str,
    reason: &str,
    text: &str,
) -> anyhow::Result<Event> {
    poll_until(&format!("Event {reason} on {ring}"), WAIT, || async {
        Ok(ring_events(client, ring).await?.into_iter().find(|e| {
            e.reason.as_deref() == Some(reason)
                && e.message.as_deref().is_some_and(|m| m.contains(text))
        }))
    })
    .await
}

/// Scale a ring out while its shards never acknowledge drains: objects per shard, pending drains
/// and their age, webhook and sync metrics match the API server's objects; Events say a shard
/// joined, the rebalance started and finished, and the drains are stuck; a shard whose Lease
/// runs out is declared dead and one whose Lease is deleted left.
#[tokio::test]
async fn metrics_and_events_explain_a_rebalance() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("observe").await?;
    let ring = unique_name("observe");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let shards = ["shard-a", "shard-b", "shard-c"];
    for shard in shards {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    wait_status(&client, &ring, 3, 3).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    for i in 0..60 {
        secrets
            .create(&PostParams::default(), &secret(&format!("s-{i}")))
            .await?;
    }
    let metrics = sharder.metrics()?;
    let assigned = value(
        &metrics,
        &format!(
            r#"controller_sharding_webhook_request_duration_seconds_count{{clusterring="{ring}",outcome="assigned"}} "#
        ),
    )
    .unwrap_or_default();
    ensure!(
        assigned >= 60.0,
        "webhook durations counted {assigned} assignments"
    );

    // A fourth shard joins: the sync drains what moves to it from the three others.
    create_lease(&client, &ns, &ring, "shard-d", 3600).await?;
    wait_event(&client, &ring, "ShardJoined", "shard-d").await?;
    wait_event(&client, &ring, "RebalanceStarted", "4 available shards").await?;
    let finished = wait_event(&client, &ring, "RebalanceFinished", "Drained").await?;
    let drain = labels::drain_label(&ring);
    let key = labels::shard_label(&ring);
    let list = secrets.list_metadata(&ListParams::default()).await?;
    let mut per_shard: BTreeMap<String, usize> = BTreeMap::new();
    let mut draining: BTreeMap<String, usize> = BTreeMap::new();
    for s in &list.items {
        let shard = s.labels().get(&key).cloned().unwrap_or_default();
        *per_shard.entry(shard.clone()).or_default() += 1;
        if s.labels().contains_key(&drain) {
            *draining.entry(shard).or_default() += 1;
        }
    }
    let drained: usize = draining.values().sum();
    ensure!(drained > 0, "scale-out drained nothing");
    ensure!(
        finished
            .message
            .as_deref()
            .is_some_and(|m| m.contains(&format!("Drained {drained} "))),
        "{:?} does not count {drained} drains",
        finished.message
    );

    let metrics = sharder.metrics()?;
    for (shard, count) in &per_shard {
        // The sync listed before it drained, so labels are as the test sees them now.
        let series = format!(
            r#"controller_sharding_shard_objects{{clusterring="{ring}",shard="{shard}",group="",resource="secrets"}} "#
        );
        ensure!(
            value(&metrics, &series) == Some(*count as f64),
            "{series}: {:?}, the API server has {count}",
            value(&metrics, &series)
        );
    }
    for (shard, count) in &draining {
        let series = format!(
            r#"controller_sharding_drains_pending{{clusterring="{ring}",shard="{shard}"}} "#
        );
        ensure!(
            value(&metrics, &series) == Some(*count as f64),
            "{series}: {:?}, the API server has {count} draining",
            value(&metrics, &series)
        );
    }
    let syncs = value(
        &metrics,
        &format!(r#"controller_sharding_syncs_total{{clusterring="{ring}",outcome="success"}} "#),
    )
    .unwrap_or_default();
    ensure!(syncs >= 1.0, "{syncs} successful syncs");
    let sync_durations = value(
        &metrics,
        &format!(r#"controller_sharding_sync_duration_seconds_count{{clusterring="{ring}"}} "#),
    )
    .unwrap_or_default();
    ensure!(sync_durations >= 1.0, "{sync_durations} sync durations");

    // Nobody acknowledges: after drainTimeout (15 s) the sharder warns about each such shard.
    let (stuck, _) = draining.iter().next().expect("a draining shard");
    let warning = poll_until(
        "a DrainNotAcknowledged Warning",
        Duration::from_secs(40),
        || async {
            Ok(ring_events(&client, &ring).await?.into_iter().find(|e| {
                e.reason.as_deref() == Some("DrainNotAcknowledged")
                    && e.message
                        .as_deref()
                        .is_some_and(|m| m.contains(stuck.as_str()))
            }))
        },
    )
    .await?;
    ensure!(warning.type_.as_deref() == Some("Warning"));
    let age = value(
        &sharder.metrics()?,
        &format!(r#"controller_sharding_drain_oldest_age_seconds{{clusterring="{ring}",shard="{stuck}"}} "#),
    )
    .unwrap_or_default();
    ensure!(age >= 15.0, "oldest drain of {stuck} is {age}s old");

    // A shard whose Lease runs out is declared dead; one whose Lease is deleted leaves.
    create_lease(&client, &ns, &ring, "shard-short", 2).await?;
    wait_event(&client, &ring, "ShardDead", "shard-short").await?;
    Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), &ns)
        .delete("shard-a", &DeleteParams::default())
        .await?;
    wait_event(&client, &ring, "ShardLeft", "shard-a").await?;
    logs.passed();
    Ok(())
}
