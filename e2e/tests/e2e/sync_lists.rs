//! The sync's lists on a large ring (issue 13, "lists that stay correct when large"): continue
//! tokens that expire while the sync works through a page.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::ensure;
use e2e::etcd::Compactor;
use e2e::fixtures::{create_lease, create_ring, ring_spec};
use e2e::process::poll_until;
use e2e::sharder::{DedicatedCluster, SharderFiles, SharderSettings, counter};
use e2e::{IndependentRing, unique_name};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use sharder::controller::sharder::LIST_CONTINUED_INCONSISTENTLY;
use sharding_crds::labels;

/// Generous bound for processes starting up and caches syncing on a busy machine.
const STARTUP: Duration = Duration::from_secs(60);

/// Creates Secrets `s-0` … `s-<count-1>` in `namespace` carrying `labels`, 50 at a time.
async fn create_labelled_secrets(
    client: &kube::Client,
    namespace: &str,
    count: usize,
    labels: &BTreeMap<String, String>,
) -> anyhow::Result<()> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(format!("s-{i}")),
                    labels: Some(labels.clone()),
                    ..Default::default()
                },
                ..Default::default()
            };
            async move { api.create(&PostParams::default(), &secret).await }
        })
        .buffer_unordered(50)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// The value of the sharder's `controller_sharding_syncs_total` for ClusterRing `ring` and
/// `outcome` in the `/metrics` text `metrics`; 0 while the series is absent.
fn syncs(metrics: &str, ring: &str, outcome: &str) -> u64 {
    let prefix =
        format!(r#"controller_sharding_syncs_total{{clusterring="{ring}",outcome="{outcome}"}} "#);
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A sync whose continue tokens expire between pages (etcd compacted under it, as the API server
/// does every 5 minutes, here every 150 ms) goes on with the token of the 410 answer and
/// finishes: every Secret of a ring of three pages lands on its shard in one successful sync.
///
/// kube-apiserver runs with `ListFromCacheSnapshot` off, so every continuation is read from etcd,
/// as on servers before 1.34; from 1.34 on, continuations are served from watch-cache snapshots
/// until the cache sees the compaction (it polls every 15 s) or the snapshot is 75 s old, and
/// then from etcd just the same, which a test cannot wait for on every page.
#[tokio::test]
async fn a_sync_goes_on_when_its_continue_tokens_expire() -> anyhow::Result<()> {
    let dedicated = DedicatedCluster::start_with_apiserver_args(&[
        "--feature-gates=ListFromCacheSnapshot=false",
    ])
    .await?;
    let cluster = dedicated.cluster();
    let client = cluster.client().await?;
    let ns = cluster.namespace(&client, "expire").await?;
    let ring = unique_name("expire");
    let key = labels::shard_label(&ring);
    // Three pages of Secrets, created before the ring exists on a shard that never joins it: no
    // webhook assigns them and the missed-assignment watch skips labelled objects, so only the
    // sync moves them, 500 per page.
    let count = 1_300;
    let on_gone = BTreeMap::from([(key.clone(), "shard-gone".to_string())]);
    create_labelled_secrets(&client, &ns, count, &on_gone).await?;
    let shards = ["shard-a", "shard-b"];
    for shard in shards {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    create_ring(&client, &ring, ring_spec(&ns)).await?;

    let compactor = Compactor::start(dedicated.etcd_endpoint()?, Duration::from_millis(150));
    // 20 moves at a time: a page takes about a second, several compactions.
    let settings = SharderSettings {
        concurrent_moves: 20,
        ..Default::default()
    };
    let files = SharderFiles::create(cluster.kubeconfig(), &settings)?;
    let mut sharder = files.start_process()?;
    files.wait_ready(STARTUP).await?;

    let predicted = IndependentRing::unweighted(shards);
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let started = tokio::time::Instant::now();
    poll_until(
        "every Secret on the shard the ring predicts",
        Duration::from_secs(180),
        || async {
            let list = secrets.list_metadata(&ListParams::default()).await?;
            let placed = list
                .items
                .iter()
                .filter(|s| {
                    let want = predicted.shard_for(&format!("/Secret/{ns}/{}", s.name_any()));
                    s.labels().get(&key).map(String::as_str) == Some(want)
                })
                .count();
            Ok((placed == count).then_some(()))
        },
    )
    .await?;
    let converged = started.elapsed();
    let compactions = compactor.stop().await?;

    let metrics = files.metrics()?;
    let continued = counter(
        &metrics,
        "controller_sharding_list_inconsistent_continuations_total",
        &ring,
        "secrets",
    )?;
    let moved = counter(
        &metrics,
        "controller_sharding_movements_total",
        &ring,
        "secrets",
    )?;
    let (succeeded, failed) = (
        syncs(&metrics, &ring, "success"),
        syncs(&metrics, &ring, "failure"),
    );
    let logged = sharder
        .records()
        .iter()
        .filter(|r| r["fields"]["message"] == LIST_CONTINUED_INCONSISTENTLY)
        .count();
    eprintln!(
        "expired tokens: {count} Secrets assigned in {converged:?}; {compactions} compactions, \
         {continued} inconsistent continuations ({logged} logged), {moved} moves, syncs: \
         {succeeded} succeeded, {failed} failed"
    );
    ensure!(
        failed == 0,
        "{failed} syncs failed: an expired continue token must not fail the sync"
    );
    ensure!(
        continued >= 1 && logged >= 1,
        "no continue token expired during the sync ({compactions} compactions): the test proves nothing"
    );
    ensure!(
        moved == count as u64,
        "{moved} moves for {count} Secrets: the sync must move each once"
    );
    sharder.passed();
    Ok(())
}
