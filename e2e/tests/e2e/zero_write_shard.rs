//! The shard library on a zero-write ring, with the `checksum-controller` example run with
//! `--server-side` against the real API server. No sharder runs: the test plays its part,
//! writing the state label `ready` and the ranges on the shard's Lease as the sharder does
//! (docs/zero-write-rings.md), and reads the shard's acknowledgements there.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::secret;
use e2e::process::{Process, poll_until};
use e2e::sharded_watch::{gate, start_with_gate_off};
use e2e::{Cluster, cluster, unique_name};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::labels::LABEL_STATE;
use kube_sharding_api::range_lease::{ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES};
use kube_sharding_api::ranges::fnv1a64;
use serde_json::{Value, json};

const COUNT: usize = 300;
const WAIT: Duration = Duration::from_secs(60);
const LOWER: &str = "0000000000000000-8000000000000000";
const UPPER: &str = "8000000000000000-10000000000000000";

/// Names of the Secrets whose uid hashes into the lower half (`true`) and the upper one.
type Halves = BTreeMap<bool, BTreeSet<String>>;

async fn create_secrets(client: &Client, ns: &str) -> anyhow::Result<Halves> {
    let api = Api::<Secret>::namespaced(client.clone(), ns);
    let made: Vec<Secret> = futures::stream::iter(0..COUNT)
        .map(|i| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &secret(&format!("s-{i}")))
                    .await
            }
        })
        .buffer_unordered(16)
        .try_collect()
        .await?;
    let mut halves = Halves::new();
    for s in made {
        let uid = s.uid().context("a Secret without uid")?;
        halves
            .entry(fnv1a64(&uid) < 1 << 63)
            .or_default()
            .insert(s.name_any());
    }
    ensure!(halves.len() == 2, "all {COUNT} Secrets hash into one half");
    Ok(halves)
}

fn start_shard(ns: &str, shard: &str, kubeconfig: &Path) -> anyhow::Result<Process> {
    Process::start_with_env(
        "checksum-controller",
        [
            "--ring",
            "zero-write",
            "--namespace",
            ns,
            "--lease-namespace",
            ns,
            "--shard-name",
            shard,
            "--lease-duration",
            "15",
            "--renew-deadline",
            "10",
            "--retry-period",
            "1",
            "--log-format",
            "json",
            "--server-side",
        ],
        [("KUBECONFIG", kubeconfig)],
    )
}

/// Writes `patch` on the shard's Lease as the sharder would.
async fn patch_lease(leases: &Api<Lease>, shard: &str, patch: Value) -> anyhow::Result<()> {
    leases
        .patch(shard, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("failed to patch Lease {shard}"))?;
    Ok(())
}

async fn wait_acknowledged(
    leases: &Api<Lease>,
    shard: &str,
    generation: &str,
) -> anyhow::Result<()> {
    poll_until(&format!("acknowledgement {generation}"), WAIT, || async {
        let lease = leases.get_opt(shard).await?;
        let acknowledged = lease
            .as_ref()
            .and_then(|l| l.annotations().get(ANNOTATION_ACKNOWLEDGED).cloned());
        Ok((acknowledged.as_deref() == Some(generation)).then_some(()))
    })
    .await
}

/// The Secrets with a ConfigMap of checksums.
async fn with_config_maps(client: &Client, ns: &str) -> anyhow::Result<BTreeSet<String>> {
    Ok(Api::<ConfigMap>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await?
        .into_iter()
        .filter_map(|cm| cm.name_any().strip_prefix("checksums-").map(str::to_string))
        .collect())
}

async fn wait_config_maps(
    client: &Client,
    ns: &str,
    expected: &BTreeSet<String>,
) -> anyhow::Result<()> {
    poll_until(
        &format!("ConfigMaps of {} Secrets", expected.len()),
        WAIT,
        || async {
            let found = with_config_maps(client, ns).await?;
            ensure!(
                found.is_subset(expected),
                "ConfigMaps of Secrets outside the ranges: {:?}",
                found.difference(expected).collect::<Vec<_>>()
            );
            Ok((found == *expected).then_some(()))
        },
    )
    .await
}

/// Names of the Secrets of the shard's records with `event` (and `how`, if given).
fn named(process: &Process, event: &str, how: Option<&str>) -> BTreeSet<String> {
    process
        .records()
        .into_iter()
        .filter(|r| r["event"] == event && how.is_none_or(|h| r["how"] == h))
        .filter_map(|r| r["name"].as_str().map(str::to_string))
        .collect()
}

fn record(process: &Process, event: &str, generation: u64) -> Option<Value> {
    process
        .records()
        .into_iter()
        .find(|r| r["event"] == event && r["generation"] == generation)
}

/// The scenario on `cluster`, whose API server applies the selector (`gate_on`) or not.
async fn scenario(cluster: &Cluster, gate_on: bool) -> anyhow::Result<()> {
    let client = cluster.client().await?;
    let ns = cluster.namespace(&client, "zw-shard").await?;
    let halves = create_secrets(&client, &ns).await?;
    let (lower, upper) = (&halves[&true], &halves[&false]);
    let shard = unique_name("zw");
    let mut process = start_shard(&ns, &shard, cluster.kubeconfig())?;
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    poll_until("the shard's Lease", WAIT, || async {
        let lease = leases.get_opt(&shard).await?;
        Ok(lease.filter(|l| {
            l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) == Some(shard.as_str())
        }))
    })
    .await?;
    // The sharder's judgement, then generation 1: the lower half.
    patch_lease(
        &leases,
        &shard,
        json!({"metadata": {"labels": {LABEL_STATE: "ready"}}}),
    )
    .await?;
    process
        .wait_for_record("work started", WAIT, |r| r["event"] == "term_started")
        .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(
        with_config_maps(&client, &ns).await?.is_empty(),
        "ConfigMaps before the shard had any ranges"
    );
    patch_lease(
        &leases,
        &shard,
        json!({"metadata": {"annotations": {ANNOTATION_RANGES: format!("1 {LOWER}")}}}),
    )
    .await?;
    wait_acknowledged(&leases, &shard, "1").await?;
    wait_config_maps(&client, &ns, lower).await?;
    // Nothing of the upper half trickles in later.
    tokio::time::sleep(Duration::from_secs(1)).await;
    ensure!(with_config_maps(&client, &ns).await? == *lower);
    let reconciled = named(&process, "reconcile", None);
    ensure!(
        reconciled == *lower,
        "reconciled {} Secrets outside the range",
        reconciled.difference(lower).count()
    );

    // Generation 2: the upper half. The lower half is released before the acknowledgement.
    patch_lease(
        &leases,
        &shard,
        json!({"metadata": {"annotations": {ANNOTATION_RANGES: format!("2 {UPPER}")}}}),
    )
    .await?;
    wait_acknowledged(&leases, &shard, "2").await?;
    let applied = record(&process, "ranges_applied", 2).context("no ranges_applied record")?;
    ensure!(
        applied["released"] == lower.len(),
        "released {} of {} before acknowledging",
        applied["released"],
        lower.len()
    );
    let everything: BTreeSet<String> = lower.union(upper).cloned().collect();
    wait_config_maps(&client, &ns, &everything).await?;
    poll_until("the released records", WAIT, || async {
        Ok((named(&process, "released", Some("range_revoked")) == *lower).then_some(()))
    })
    .await?;
    let reconciled_after = named(&process, "reconcile", None);
    ensure!(reconciled_after == everything);

    let count = |event: &str| {
        process
            .records()
            .into_iter()
            .filter(|r| r["event"] == event)
            .count()
    };
    // What the shard read from its list responses: `shardInfo`, or none.
    let said = (
        count("shard_selector_applied"),
        count("shard_selector_ignored"),
    );
    let expected = if gate_on { (1, 0) } else { (0, 1) };
    ensure!(
        said == expected,
        "(applied, ignored) records {said:?}, expected {expected:?}"
    );
    let acknowledged = record(&process, "ranges_acknowledged", 2).context("no record")?;
    println!(
        "zero-write shard (gate {}): {} + {} Secrets, generation 2 applied in {} ms (released {}), acknowledged {} ms after it was seen",
        if gate_on { "on" } else { "off" },
        lower.len(),
        upper.len(),
        applied["took_ms"],
        applied["released"],
        acknowledged["took_ms"],
    );
    process.passed();
    Ok(())
}

/// With the gate on: the API server filters, the shard follows its ranges generation by
/// generation and acknowledges each only after releasing what it lost.
#[tokio::test]
async fn a_zero_write_shard_follows_its_ranges_and_acknowledges_after_releasing()
-> anyhow::Result<()> {
    let client = cluster().client().await?;
    match gate(&client).await? {
        Some(true) => {}
        Some(false) => anyhow::bail!("the API server knows ShardedListAndWatch but has it off"),
        None => {
            println!("skipped: the API server has no ShardedListAndWatch gate");
            return Ok(());
        }
    }
    scenario(cluster(), true).await
}

/// With the gate off: the same placement through the client-side filter, and the shard says
/// once that the server ignored its selector.
#[tokio::test]
async fn with_the_gate_off_a_zero_write_shard_filters_on_the_client() -> anyhow::Result<()> {
    let shared = cluster().client().await?;
    let dedicated = start_with_gate_off(&shared).await?;
    let cluster = dedicated.cluster();
    ensure!(
        gate(&cluster.client().await?).await? != Some(true),
        "the dedicated API server has the gate on"
    );
    scenario(cluster, false).await
}
