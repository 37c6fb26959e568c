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
const WHOLE: &str = "0000000000000000-10000000000000000";

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

    // The API server's own count of watch events its shard selectors kept from a watcher: a
    // change to each upper Secret, outside the shard's range, moves it with the gate on (other
    // tests' sharded watches may add to it, never take from it); with it off (a control plane
    // of this test's own) nothing is filtered on the server.
    let filtered = || {
        cluster.apiserver_metric(
            "apiserver_watch_filtered_events_total",
            &[("group", ""), ("resource", "secrets")],
        )
    };
    let filtered_before = filtered()?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    for name in upper {
        let patch = json!({"metadata": {"annotations": {"touched": "outside-the-range"}}});
        secrets
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    let filtered_moved = if gate_on {
        poll_until("the server to filter watch events", WAIT, || async {
            let now = filtered()?;
            Ok((now > filtered_before).then_some(now - filtered_before))
        })
        .await?
    } else {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let moved = filtered()?.saturating_sub(filtered_before);
        ensure!(
            moved == 0,
            "{moved} watch events filtered with the gate off"
        );
        moved
    };
    ensure!(
        named(&process, "reconcile", None) == *lower,
        "a change outside the range reached the controller"
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

    // Generation 3: the whole space. The upper half is kept unchanged: the new list holds it
    // again, and the controller must not reconcile it again (`Shard::kept_unchanged`); the
    // lower half comes back and must be reconciled again, unchanged as it is (the other shard
    // may have acted on it meanwhile).
    let reconciles = |names: &BTreeSet<String>| {
        process
            .records()
            .into_iter()
            .filter(|r| {
                r["event"] == "reconcile" && r["name"].as_str().is_some_and(|n| names.contains(n))
            })
            .count()
    };
    // The shard's own ConfigMap writes trigger one more reconcile each: let them pass.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (upper_before, lower_before) = (reconciles(upper), reconciles(lower));
    patch_lease(
        &leases,
        &shard,
        json!({"metadata": {"annotations": {ANNOTATION_RANGES: format!("3 {WHOLE}")}}}),
    )
    .await?;
    wait_acknowledged(&leases, &shard, "3").await?;
    poll_until("the lower half reconciled again", WAIT, || async {
        let again = process
            .records()
            .into_iter()
            .filter(|r| r["event"] == "reconcile")
            .filter_map(|r| r["name"].as_str().map(str::to_string))
            .filter(|n| lower.contains(n))
            .count();
        Ok((again >= lower_before + lower.len()).then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let kept_reconciled = reconciles(upper) - upper_before;
    ensure!(
        kept_reconciled == 0,
        "{kept_reconciled} reconciles of the {} kept, unchanged Secrets after generation 3",
        upper.len()
    );

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
        "zero-write shard (gate {}): {} + {} Secrets, generation 2 applied in {} ms (released {}), acknowledged {} ms after it was seen; generation 3: {kept_reconciled} reconciles of the kept half; {filtered_moved} watch events filtered by the server for {} changes outside the range",
        if gate_on { "on" } else { "off" },
        lower.len(),
        upper.len(),
        applied["took_ms"],
        applied["released"],
        acknowledged["took_ms"],
        upper.len(),
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

/// The shard label value of each ConfigMap of checksums, by its Secret's name.
async fn config_map_shards(
    client: &Client,
    ns: &str,
    ring: &str,
) -> anyhow::Result<BTreeMap<String, String>> {
    let key = kube_sharding_api::labels::shard_label(ring);
    Ok(Api::<ConfigMap>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await?
        .into_iter()
        .filter_map(|cm| {
            let secret = cm.name_any().strip_prefix("checksums-")?.to_string();
            let shard = cm.labels().get(&key)?.clone();
            Some((secret, shard))
        })
        .collect())
}

/// With the real sharder: two example shards on a `ServerSide` ring. The first gets the whole
/// space; when the second joins, every Secret that moves is released by the first (its log)
/// before the second's first reconcile of it, and each ConfigMap ends up written by the shard
/// whose published ranges hold its Secret's uid.
#[tokio::test]
async fn with_the_real_sharder_a_secret_moves_only_after_its_old_shard_released_it()
-> anyhow::Result<()> {
    use e2e::fixtures::{ShardTiming, create_ring, ring_spec, start_checksum_shard_with};
    use kube_sharding_api::{Assignment, ClusterRingSpec, RingKind, RingRef, RingResource};
    let client = cluster().client().await?;
    if gate(&client).await? != Some(true) {
        println!("skipped: the API server does not filter by shardSelector");
        return Ok(());
    }
    let e2e::scenario::SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = e2e::scenario::SharedScenario::in_namespace("zw-sharder").await?;
    let ring = unique_name("zw-ring");
    create_ring(
        &client,
        &ring,
        ClusterRingSpec {
            resources: vec![RingResource::new("", "secrets")],
            assignment: Some(Assignment::ServerSide),
            ..ring_spec(&ns)
        },
    )
    .await?;
    let halves = create_secrets(&client, &ns).await?;
    let secrets: BTreeMap<String, u64> = {
        let api = Api::<Secret>::namespaced(client.clone(), &ns);
        api.list(&Default::default())
            .await?
            .into_iter()
            .map(|s| (s.name_any(), fnv1a64(&s.uid().unwrap_or_default())))
            .collect()
    };
    ensure!(secrets.len() == halves.values().map(BTreeSet::len).sum::<usize>());
    let ring_ref = RingRef::new(RingKind::ClusterRing, &ring);
    let (a, b) = (unique_name("zw-a"), unique_name("zw-b"));
    let mut first =
        start_checksum_shard_with(&ring_ref, &ns, &a, ShardTiming::RELAXED, &["--server-side"])?;
    poll_until("every Secret on the first shard", WAIT, || async {
        let shards = config_map_shards(&client, &ns, &ring).await?;
        Ok((shards.len() == COUNT && shards.values().all(|s| *s == a)).then_some(()))
    })
    .await?;
    let mut second =
        start_checksum_shard_with(&ring_ref, &ns, &b, ShardTiming::RELAXED, &["--server-side"])?;
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    // Settled: both shards acknowledged their latest publication, which partition the space.
    let published = poll_until("both shards settled", WAIT, || async {
        let mut sets = BTreeMap::new();
        for shard in [&a, &b] {
            let Some(lease) = leases.get_opt(shard).await? else {
                return Ok(None);
            };
            let annotations = lease.annotations();
            let Some(published) = annotations.get(ANNOTATION_RANGES).and_then(|r| {
                r.parse::<kube_sharding_api::range_lease::PublishedRanges>()
                    .ok()
            }) else {
                return Ok(None);
            };
            if annotations.get(ANNOTATION_ACKNOWLEDGED) != Some(&published.generation().to_string())
                || published.ranges().is_empty()
            {
                return Ok(None);
            }
            sets.insert(shard.clone(), published.ranges().clone());
        }
        Ok(Some(sets))
    })
    .await?;
    let owner = |hash: u64| {
        published
            .iter()
            .find(|(_, set)| set.contains(hash))
            .map(|(shard, _)| shard.clone())
    };
    let expected: BTreeMap<String, String> = secrets
        .iter()
        .map(|(name, hash)| (name.clone(), owner(*hash).unwrap_or_default()))
        .collect();
    ensure!(
        expected.values().all(|s| !s.is_empty()),
        "a hash owned by no shard"
    );
    poll_until(
        "each ConfigMap written by its Secret's shard",
        WAIT,
        || async { Ok((config_map_shards(&client, &ns, &ring).await? == expected).then_some(())) },
    )
    .await?;
    // Revoke before grant: the first shard released each moved Secret before the second
    // reconciled it.
    let moved: BTreeSet<&String> = expected
        .iter()
        .filter(|(_, s)| **s == b)
        .map(|(n, _)| n)
        .collect();
    ensure!(!moved.is_empty(), "nothing moved to the second shard");
    let released: BTreeMap<String, String> = first
        .records()
        .into_iter()
        .filter(|r| r["event"] == "released" && r["how"] == "range_revoked")
        .filter_map(|r| {
            Some((
                r["name"].as_str()?.to_string(),
                r["timestamp"].as_str()?.to_string(),
            ))
        })
        .collect();
    let mut first_reconcile: BTreeMap<String, String> = BTreeMap::new();
    for r in second.records() {
        if r["event"] == "reconcile"
            && let (Some(name), Some(at)) = (r["name"].as_str(), r["timestamp"].as_str())
        {
            first_reconcile
                .entry(name.to_string())
                .or_insert_with(|| at.to_string());
        }
    }
    for name in &moved {
        let released_at = released
            .get(*name)
            .with_context(|| format!("the first shard never released {name}"))?;
        let reconciled_at = first_reconcile
            .get(*name)
            .with_context(|| format!("the second shard never reconciled {name}"))?;
        // RFC 3339 timestamps of one machine's clock.
        let parse = |at: &str| at.parse::<k8s_openapi::jiff::Timestamp>();
        ensure!(
            parse(released_at)? < parse(reconciled_at)?,
            "{name} reconciled by the second shard at {reconciled_at}, released by the first at {released_at}"
        );
    }
    println!(
        "real sharder: {} of {COUNT} Secrets moved to the second shard, each released by the first before",
        moved.len()
    );
    first.passed();
    second.passed();
    logs.passed();
    Ok(())
}
