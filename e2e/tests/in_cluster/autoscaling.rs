//! docs/autoscaling.md on the real node: the external metrics API installed as the page says
//! (config/external-metrics, the CA bundle patched in without cert-manager), the example's
//! StatefulSet with its HPA (deploy/autoscaling), and the HPA controller scaling the shards on
//! objects per shard through the API server's aggregation layer: 2 → 4 when the Secrets double,
//! back to 2 when they go, with every Secret on its shard after each step, no refused create and
//! no Secret reconciled by two shards at once (the shards' logs).

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use e2e::in_cluster::{InCluster, OnFailure, eventually, in_cluster};
use kube_sharding_api::RingKind;
use serde_json::json;

use crate::ownership::{self, ShardLogs};
use crate::{
    RING, SHARD_SELECTOR, SHARDS_NAMESPACE, SYSTEM, TURN, ensure_example, ensure_installed,
    namespace_with_secrets, wait_converged, wait_ring,
};

/// The external metrics API's path of the example ring's objects, as the HPA asks for it.
fn objects_path() -> String {
    format!(
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/{SHARDS_NAMESPACE}/sharding-ring-objects?labelSelector=clusterring%3D{RING}"
    )
}

/// The ring's objects as the API server's aggregation layer returns them from the sharder.
fn ring_objects(c: &InCluster) -> anyhow::Result<u64> {
    let answer: serde_json::Value =
        serde_json::from_str(&c.kubectl(&["get", "--raw", &objects_path()])?)?;
    answer["items"][0]["value"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no value in {answer}"))
}

/// The HPA's current and desired replicas.
fn hpa_replicas(c: &InCluster) -> anyhow::Result<(u64, u64)> {
    let hpa = c.kubectl_json(&["-n", SHARDS_NAMESPACE, "get", "hpa", "checksum-controller"])?;
    Ok((
        hpa["status"]["currentReplicas"]
            .as_u64()
            .unwrap_or_default(),
        hpa["status"]["desiredReplicas"]
            .as_u64()
            .unwrap_or_default(),
    ))
}

/// Waits until the HPA runs `replicas` shards, all available in the ring; how long it took.
async fn wait_scaled(c: &InCluster, replicas: u32, timeout: Duration) -> anyhow::Result<Duration> {
    let started = Instant::now();
    eventually(&format!("the HPA at {replicas} replicas"), timeout, || {
        let (current, desired) = hpa_replicas(c)?;
        Ok((current == u64::from(replicas) && desired == u64::from(replicas)).then_some(()))
    })
    .await?;
    wait_ring(c, RingKind::ClusterRing, replicas).await?;
    Ok(started.elapsed())
}

/// Installs the external metrics API as docs/autoscaling.md says for an install without
/// cert-manager, and waits until the API server reports it available.
async fn install_external_metrics(c: &InCluster) -> anyhow::Result<()> {
    c.kubectl(&["apply", "-k", "config/external-metrics"])?;
    let secret = c.kubectl_json(&["-n", SYSTEM, "get", "secret", "sharder-webhook-tls"])?;
    let ca = secret["data"]["ca.crt"]
        .as_str()
        .context("no ca.crt in the webhook's Secret")?;
    c.kubectl(&[
        "patch",
        "apiservice",
        "v1beta1.external.metrics.k8s.io",
        "--type",
        "merge",
        "-p",
        &json!({"spec": {"caBundle": ca}}).to_string(),
    ])?;
    eventually(
        "the APIService v1beta1.external.metrics.k8s.io Available",
        Duration::from_secs(90),
        || {
            let api = c.kubectl_json(&["get", "apiservice", "v1beta1.external.metrics.k8s.io"])?;
            let available = api["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Available" && c["status"] == "True")
            });
            Ok(available.then_some(()))
        },
    )
    .await
}

/// Removes the HPA and the APIService: an APIService whose backend is gone would fail the API
/// server's discovery for the other tests (and stall namespace deletion).
fn uninstall(c: &InCluster) {
    let _ = c.kubectl(&[
        "-n",
        SHARDS_NAMESPACE,
        "delete",
        "hpa",
        "checksum-controller",
        "--ignore-not-found",
    ]);
    let _ = c.kubectl(&[
        "delete",
        "-k",
        "config/external-metrics",
        "--ignore-not-found",
    ]);
}

#[tokio::test]
async fn hpa_scales_shards_on_objects_per_shard() -> anyhow::Result<()> {
    let Some(c) = in_cluster() else {
        return Ok(());
    };
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    ensure_installed(c)?;
    let result = scale_with_the_hpa(c).await;
    uninstall(c);
    result?;
    guard.passed();
    Ok(())
}

async fn scale_with_the_hpa(c: &'static InCluster) -> anyhow::Result<()> {
    let kind = RingKind::ClusterRing;
    ensure_example(c, kind, 2).await?;
    install_external_metrics(c).await?;
    // The example's Deployment gives way to the StatefulSet with its HPA (min 2 replicas).
    c.kubectl(&[
        "-n",
        SHARDS_NAMESPACE,
        "delete",
        "deployment",
        "checksum-controller",
        "--wait=true",
    ])?;
    c.kubectl(&["apply", "-k", "deploy/autoscaling"])?;
    let took = wait_scaled(c, 2, Duration::from_secs(120)).await?;
    eprintln!("autoscaling: StatefulSet at the HPA's minimum of 2 after {took:?}");
    let client = c.client().await?;
    let logs = ShardLogs::follow(c.config().await?, SHARDS_NAMESPACE, SHARD_SELECTOR)?;

    // A first batch; the target is set to what 2 shards then hold each (5 % above, within the
    // HPA's tolerance), so doubling the Secrets asks for 4.
    let (first, labelled) = namespace_with_secrets(&client, kind, "autoscale-a", 100).await?;
    ensure!(
        labelled == 100,
        "{labelled} of 100 creates came back labelled"
    );
    wait_converged(c, kind, &first, Duration::from_secs(90)).await?;
    let objects = eventually(
        "the ring's objects through the aggregation layer",
        Duration::from_secs(60),
        || {
            let value = ring_objects(c)?;
            Ok((value >= 100).then_some(value))
        },
    )
    .await?;
    let target = (objects * 105).div_ceil(200);
    // Faster scale-down than the example's for the test: the same policy shape (1 pod per period
    // after a stabilization window), with shorter times.
    c.kubectl(&[
        "-n",
        SHARDS_NAMESPACE,
        "patch",
        "hpa",
        "checksum-controller",
        "--type",
        "merge",
        "-p",
        &json!({"spec": {
            "metrics": [{"type": "External", "external": {
                "metric": {"name": "sharding-ring-objects",
                           "selector": {"matchLabels": {"clusterring": RING}}},
                "target": {"type": "AverageValue", "averageValue": target.to_string()},
            }}],
            "behavior": {"scaleDown": {
                "stabilizationWindowSeconds": 15,
                "selectPolicy": "Min",
                "policies": [{"type": "Pods", "value": 1, "periodSeconds": 15}],
            }},
        }})
        .to_string(),
    ])?;
    eprintln!("autoscaling: {objects} objects on 2 shards, target {target} per shard");
    // Still 2 after two syncs (every 5 s on the test control plane).
    tokio::time::sleep(Duration::from_secs(10)).await;
    ensure!(
        hpa_replicas(c)? == (2, 2),
        "the HPA left 2 replicas before the load grew"
    );

    // Out: twice the Secrets.
    let started = Instant::now();
    let (second, labelled) = namespace_with_secrets(&client, kind, "autoscale-b", 100).await?;
    ensure!(
        labelled == 100,
        "{labelled} of 100 creates came back labelled"
    );
    let scaled_out = wait_scaled(c, 4, Duration::from_secs(180)).await?;
    let after_out = ring_objects(c)?;
    wait_converged(c, kind, &first, Duration::from_secs(120)).await?;
    wait_converged(c, kind, &second, Duration::from_secs(120)).await?;
    let converged_out = started.elapsed();
    eprintln!(
        "autoscaling: 2→4 with {after_out} objects: HPA at 4 and shards available {scaled_out:?} \
         after the second batch began, every Secret on its shard after {converged_out:?}"
    );
    // Stays at 4 while the load holds (two more syncs).
    tokio::time::sleep(Duration::from_secs(10)).await;
    ensure!(
        hpa_replicas(c)? == (4, 4),
        "the HPA left 4 replicas while the load held"
    );

    // In: the second batch goes.
    let started = Instant::now();
    c.kubectl(&[
        "delete",
        "namespace",
        &second,
        "--wait=true",
        "--timeout=120s",
    ])?;
    let scaled_in = wait_scaled(c, 2, Duration::from_secs(240)).await?;
    wait_converged(c, kind, &first, Duration::from_secs(120)).await?;
    let converged_in = started.elapsed();
    eprintln!(
        "autoscaling: 4→2 {scaled_in:?} after the second batch was deleted, every Secret on its \
         shard after {converged_in:?}"
    );

    let records = logs.stop().await;
    let violations = ownership::violations(&records);
    ensure!(
        violations.is_empty(),
        "ownership overlapped:\n{}",
        violations.join("\n")
    );
    eprintln!("autoscaling: {} shard log records checked", records.len());
    c.kubectl(&["delete", "namespace", &first, "--wait=false"])?;
    Ok(())
}
