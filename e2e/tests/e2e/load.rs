//! Load reports (docs/protocol.md §23): real checksum-controller shards report their load on
//! their Leases, the sharder sums the reports per ring on its metrics endpoint, and reports that
//! are too long or malformed count as none without costing the sharder a ring rebuild or a sync.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::{
    ShardTiming, WAIT, create_annotated_lease, create_ring_of, ring_spec, secret,
    start_checksum_shard_of, wait_status_of, wait_webhook_of,
};
use e2e::process::{binary, poll_until};
use e2e::scenario::SharedScenario;
use e2e::{cluster, unique_name};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::ByteString;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube_sharding_api::load::{ANNOTATION_LOAD, MAX_LOAD_ANNOTATION_BYTES};
use kube_sharding_api::{RingKind, RingRef};

/// The value of the series `series` (name and labels, as printed) in `metrics`.
fn value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// `name{clusterring="<ring>"}`.
fn ring_series(name: &str, ring: &RingRef) -> String {
    format!(r#"{name}{{clusterring="{}"}}"#, ring.name)
}

/// `name{namespace=..,shard=..,clusterring=..}`.
fn shard_series(name: &str, namespace: &str, shard: &str, ring: &RingRef) -> String {
    format!(
        r#"{name}{{namespace="{namespace}",shard="{shard}",clusterring="{}"}}"#,
        ring.name
    )
}

/// Two example shards and 40 Secrets: within a few renewals the ring's reported objects are the
/// 40 Secrets (each shard's the Secrets labelled for it), nothing is queued once they are
/// reconciled, and the shards report reconcile latencies; `kubectl sharding status` shows the same
/// sums.
#[tokio::test]
async fn shards_report_their_load_and_the_sharder_sums_it_per_ring() -> anyhow::Result<()> {
    const SECRETS: usize = 40;
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("load").await?;
    let ring = RingRef::new(RingKind::ClusterRing, unique_name("load"));
    create_ring_of(&client, &ring, ring_spec(&ns)).await?;
    let names = ["shard-0", "shard-1"];
    let mut shards = names
        .iter()
        .map(|name| start_checksum_shard_of(&ring, &ns, name, ShardTiming::RELAXED))
        .collect::<anyhow::Result<Vec<_>>>()?;
    wait_status_of(&client, &ring, 2, 2).await?;
    wait_webhook_of(&client, &ns, &ring, &names).await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    futures::stream::iter(0..SECRETS)
        .map(|i| {
            let secrets = secrets.clone();
            async move {
                let mut s = secret(&format!("secret-{i}"));
                s.data = Some(BTreeMap::from([(
                    "value".to_string(),
                    ByteString(format!("v{i}").into_bytes()),
                )]));
                secrets.create(&PostParams::default(), &s).await
            }
        })
        .buffer_unordered(10)
        .try_collect::<Vec<_>>()
        .await?;
    let created = std::time::Instant::now();

    let reported = |name: &str| ring_series(name, &ring);
    let metrics = poll_until(
        "the ring's reports to count every Secret, none queued",
        WAIT,
        || async {
            let metrics = sharder.metrics()?;
            let done = value(
                &metrics,
                &reported("controller_sharding_ring_reporting_shards"),
            ) == Some(2.0)
                && value(
                    &metrics,
                    &reported("controller_sharding_ring_reported_objects"),
                ) == Some(SECRETS as f64)
                && value(
                    &metrics,
                    &reported("controller_sharding_ring_reported_queue_depth"),
                ) == Some(0.0)
                && value(
                    &metrics,
                    &reported("controller_sharding_ring_reported_reconcile_p99_max_seconds"),
                )
                .is_some();
            Ok(done.then_some(metrics))
        },
    )
    .await?;
    eprintln!(
        "the ring's reports showed {SECRETS} Secrets, none queued, {:.1} s after the creates",
        created.elapsed().as_secs_f64()
    );
    ensure!(
        value(
            &metrics,
            &reported("controller_sharding_ring_reported_reconcile_errors")
        ) == Some(0.0),
        "reconcile errors reported:\n{metrics}"
    );

    // Each shard reports the Secrets labelled for it.
    let key = ring.shard_label();
    let mut per_shard: BTreeMap<String, f64> = BTreeMap::new();
    for s in secrets.list_metadata(&ListParams::default()).await?.items {
        *per_shard
            .entry(s.labels().get(&key).cloned().unwrap_or_default())
            .or_default() += 1.0;
    }
    for name in names {
        let series = shard_series(
            "controller_sharding_shard_reported_objects",
            &ns,
            name,
            &ring,
        );
        let labelled = per_shard.get(name).copied().unwrap_or_default();
        ensure!(
            value(&metrics, &series) == Some(labelled),
            "{series}: {:?}, the API server has {labelled}",
            value(&metrics, &series)
        );
        let p99 = shard_series(
            "controller_sharding_shard_reported_reconcile_p99_seconds",
            &ns,
            name,
            &ring,
        );
        ensure!(
            labelled == 0.0 || value(&metrics, &p99).is_some(),
            "{p99} missing:\n{metrics}"
        );
    }

    // The report is on the Lease, in the protocol's format.
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let lease = leases.get(names[0]).await?;
    let report = lease
        .annotations()
        .get(ANNOTATION_LOAD)
        .context("no load report on the Lease")?;
    ensure!(
        report.starts_with("objects=")
            && report.contains(",queue=0,")
            && report.ends_with(",window=60"),
        "report {report:?}"
    );

    // `kubectl sharding status` reads the same reports from the Leases.
    let output = tokio::process::Command::new(binary("kubectl-sharding")?)
        .arg("--kubeconfig")
        .arg(cluster().kubeconfig())
        .args(["status", &ring.name, "-o", "json"])
        .env_remove("KUBECONFIG")
        .output()
        .await
        .context("failed to run kubectl-sharding")?;
    ensure!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let load = &status["rings"][0]["load"];
    ensure!(
        load["reportingShards"] == 2 && load["availableShards"] == 2 && load["objects"] == SECRETS,
        "status says {load}"
    );

    for shard in &mut shards {
        shard.terminate()?;
    }
    for mut shard in shards {
        shard.wait(Duration::from_secs(15)).await?;
        shard.passed();
    }
    logs.passed();
    Ok(())
}

/// Leases whose load annotation is too long or malformed, rewritten 20 times each: neither
/// counts as a report, the malformed one is counted as invalid while the sharder's cache drops
/// the one too long to be a report, the ring is neither rebuilt nor synced for them, and a valid
/// report written last counts.
#[tokio::test]
async fn hostile_load_reports_are_ignored_without_a_resync() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("hostile-load").await?;
    let ring = RingRef::new(RingKind::ClusterRing, unique_name("hostile-load"));
    create_ring_of(&client, &ring, ring_spec(&ns)).await?;
    let too_long = format!("objects={}", "9".repeat(MAX_LOAD_ANNOTATION_BYTES));
    create_annotated_lease(
        &client,
        &ns,
        &ring,
        "long",
        3600,
        [(ANNOTATION_LOAD, too_long.as_str())],
    )
    .await?;
    create_annotated_lease(
        &client,
        &ns,
        &ring,
        "malformed",
        3600,
        [(ANNOTATION_LOAD, "objects=01")],
    )
    .await?;
    wait_status_of(&client, &ring, 2, 2).await?;
    let invalid = shard_series(
        "controller_sharding_shard_load_report_invalid",
        &ns,
        "malformed",
        &ring,
    );
    let metrics = poll_until("the malformed report counted as invalid", WAIT, || async {
        let metrics = sharder.metrics()?;
        Ok((value(&metrics, &invalid) == Some(1.0)).then_some(metrics))
    })
    .await?;
    // The sharder's cache does not even keep the value too long to be a report: it shows as no
    // annotation, not as an invalid one.
    let long_invalid = shard_series(
        "controller_sharding_shard_load_report_invalid",
        &ns,
        "long",
        &ring,
    );
    ensure!(value(&metrics, &long_invalid).is_none(), "{metrics}");
    let calculations = ring_series("controller_sharding_ring_calculations_total", &ring);
    let syncs = format!(
        r#"controller_sharding_syncs_total{{clusterring="{}",outcome="success"}}"#,
        ring.name
    );
    // The ring's syncs for its two shards joining may still come: start from a settled ring,
    // synced once and unchanged for two seconds.
    let before = poll_until("the ring to settle", WAIT, || async {
        let first = sharder.metrics()?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let second = sharder.metrics()?;
        let settled = value(&second, &syncs).is_some_and(|n| n >= 1.0)
            && [&calculations, &syncs]
                .iter()
                .all(|series| value(&first, series) == value(&second, series));
        Ok(settled.then_some(second))
    })
    .await?;

    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let annotate = |name: &'static str, report: String| {
        let leases = leases.clone();
        async move {
            let patch = serde_json::json!({"metadata": {"annotations": {ANNOTATION_LOAD: report}}});
            leases
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
        }
    };
    for i in 0..20 {
        annotate("long", format!("objects={i}{}", "0".repeat(200))).await?;
        annotate("malformed", format!("objects=0{i},queue={i}")).await?;
    }
    // Written last: once it counts, the sharder has seen every write before it.
    annotate("long", "objects=5,queue=1".to_string()).await?;
    let reporting = ring_series("controller_sharding_ring_reporting_shards", &ring);
    let after = poll_until("the valid report to count", WAIT, || async {
        let metrics = sharder.metrics()?;
        Ok((value(&metrics, &reporting) == Some(1.0)).then_some(metrics))
    })
    .await?;
    ensure!(
        value(
            &after,
            &ring_series("controller_sharding_ring_reported_objects", &ring)
        ) == Some(5.0),
        "{after}"
    );
    ensure!(value(&after, &invalid) == Some(1.0), "{after}");
    for series in [&calculations, &syncs] {
        ensure!(
            value(&after, series) == value(&before, series),
            "{series} went from {:?} to {:?} with reports alone",
            value(&before, series),
            value(&after, series)
        );
    }
    logs.passed();
    Ok(())
}
