//! The sync's lists on a large ring (issue 13, "lists that stay correct when large"): continue
//! tokens that expire while the sync works through a page, and lists of only the namespaces a
//! ring selects.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::ensure;
use e2e::etcd::Compactor;
use e2e::fixtures::{create_lease, create_ring, ring_spec};
use e2e::process::poll_until;
use e2e::scenario::DedicatedScenario;
use e2e::sharder_process::{SharderFiles, SharderSettings, counter};
use e2e::{IndependentRing, unique_name};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use kube::ResourceExt;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use kube_sharder::records::{EVENT_LIST_CONTINUED_INCONSISTENTLY, EVENT_SYNC_FINISHED};
use kube_sharding_api::{ClusterRingSpec, RingKind, RingRef, RingResource, labels};

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
/// then from etcd just the same, which a test cannot wait for on every page. Servers before 1.33
/// do not know the gate (and always read continuations from etcd), so they start without it.
#[tokio::test]
async fn a_sync_goes_on_when_its_continue_tokens_expire() -> anyhow::Result<()> {
    // A dedicated control plane runs the shared one's binaries.
    let snapshots_off: &[&str] = if e2e::cluster().server_minor()? >= 33 {
        &["--feature-gates=ListFromCacheSnapshot=false"]
    } else {
        &[]
    };
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::with_apiserver_args_in_namespace(snapshots_off, "expire").await?;
    let cluster = dedicated.cluster();
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
        .filter(|r| r["event"] == EVENT_LIST_CONTINUED_INCONSISTENTLY)
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

/// LIST requests of core `resource` the API server served with `scope` (`namespace` or
/// `cluster`), from its own metrics.
fn lists_of(cluster: &e2e::Cluster, resource: &str, scope: &str) -> anyhow::Result<u64> {
    cluster.apiserver_metric(
        "apiserver_request_total",
        &[("verb", "LIST"), ("resource", resource), ("scope", scope)],
    )
}

/// A ClusterRing spec over the core `resource` alone, in the namespaces `selector` selects.
fn spec_of(resource: &str, selector: LabelSelector) -> ClusterRingSpec {
    ClusterRingSpec {
        resources: vec![RingResource::new("", resource)],
        namespace_selector: Some(selector),
        hash_key: None,
        lease_namespaces: Vec::new(),
        assignment: None,
    }
}

/// A sync of a ring over one namespace lists that namespace only: the API server counts
/// namespace-scoped LISTs of its resource and no cluster-scoped one, where the earlier code read
/// every object of the cluster on each sync. A ring that selects most namespaces still lists
/// across the cluster, in fewer requests.
#[tokio::test]
async fn a_sync_lists_only_the_namespaces_its_ring_selects() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("few").await?;
    let cluster = dedicated.cluster();
    // Objects elsewhere that a cluster-wide list would read for nothing.
    let elsewhere = cluster.namespace(&client, "elsewhere").await?;
    create_labelled_secrets(&client, &ns, 20, &BTreeMap::new()).await?;
    create_labelled_secrets(&client, &elsewhere, 20, &BTreeMap::new()).await?;

    // Secrets of one namespace, and ConfigMaps of every namespace but kube-system.
    let (one, most) = (unique_name("one-ns"), unique_name("most-ns"));
    let only = LabelSelector {
        match_labels: Some(BTreeMap::from([(
            e2e::LABEL_NAMESPACE_NAME.to_string(),
            ns.clone(),
        )])),
        match_expressions: None,
    };
    let all_but_system = LabelSelector {
        match_labels: None,
        match_expressions: Some(vec![LabelSelectorRequirement {
            key: e2e::LABEL_NAMESPACE_NAME.into(),
            operator: "NotIn".into(),
            values: Some(vec!["kube-system".into()]),
        }]),
    };
    create_lease(&client, &ns, &one, "shard-one", 3600).await?;
    create_lease(&client, &ns, &most, "shard-most", 3600).await?;
    create_ring(&client, &one, spec_of("secrets", only)).await?;
    create_ring(&client, &most, spec_of("configmaps", all_but_system)).await?;

    // A sync every 2 s, so a few of them run in a short window.
    let settings = SharderSettings {
        sync_period: "2s".into(),
        ..Default::default()
    };
    let files = SharderFiles::create(cluster.kubeconfig(), &settings)?;
    let mut sharder = files.start_process()?;
    files.wait_ready(STARTUP).await?;
    let finished = |ring: &str| {
        let ring = RingRef::new(RingKind::ClusterRing, ring).to_string();
        sharder
            .records()
            .iter()
            .filter(|r| r["event"] == EVENT_SYNC_FINISHED && r["ring"] == ring)
            .count()
    };
    // Counted from the first finished sync of each ring on, when the missed-assignment watches
    // (which list across the cluster once, then only watch) are running.
    poll_until("a first sync of both rings", STARTUP, || async {
        Ok((finished(&one) >= 1 && finished(&most) >= 1).then_some(()))
    })
    .await?;
    let before = (
        finished(&one),
        finished(&most),
        lists_of(cluster, "secrets", "namespace")?,
        lists_of(cluster, "secrets", "cluster")?,
        lists_of(cluster, "configmaps", "namespace")?,
        lists_of(cluster, "configmaps", "cluster")?,
    );
    poll_until("three more syncs of both rings", STARTUP, || async {
        Ok((finished(&one) >= before.0 + 3 && finished(&most) >= before.1 + 3).then_some(()))
    })
    .await?;
    let syncs = (finished(&one) - before.0, finished(&most) - before.1);
    let secrets = (
        lists_of(cluster, "secrets", "namespace")? - before.2,
        lists_of(cluster, "secrets", "cluster")? - before.3,
    );
    let configmaps = (
        lists_of(cluster, "configmaps", "namespace")? - before.4,
        lists_of(cluster, "configmaps", "cluster")? - before.5,
    );
    eprintln!(
        "namespace lists: {} syncs of the one-namespace ring sent {} namespace-scoped and {} \
         cluster-scoped LISTs of Secrets; {} syncs of the most-namespaces ring sent {} and {} of \
         ConfigMaps",
        syncs.0, secrets.0, secrets.1, syncs.1, configmaps.0, configmaps.1
    );
    ensure!(
        secrets.1 == 0,
        "{} cluster-scoped LISTs of Secrets: a ring over one namespace must list that namespace only",
        secrets.1
    );
    ensure!(
        secrets.0 >= 3,
        "{} namespace-scoped LISTs of Secrets in {} syncs",
        secrets.0,
        syncs.0
    );
    ensure!(
        configmaps.1 >= 3 && configmaps.0 == 0,
        "a ring over most namespaces must list across the cluster: {} cluster-scoped and {} \
         namespace-scoped LISTs of ConfigMaps",
        configmaps.1,
        configmaps.0
    );
    sharder.passed();
    Ok(())
}
