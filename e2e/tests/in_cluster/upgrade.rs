//! An upgrade as a release user makes it, on the real node: the previous release's bundle and
//! images (`e2e/images.sh previous-release`: built from the checkout's history, cached), the
//! example ring assigning, then docs/install.md's "Upgrade the release bundle" applying this
//! checkout's bundle over it while Secrets are created every 100 ms.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use e2e::in_cluster::{InCluster, OnFailure, in_cluster, previous_release};
use kube::api::Api;
use kube_sharding_api::{ClusterRing, RingKind};
use serde_json::Value;

use crate::ownership::{self, ShardLogs};
use crate::release::{
    Writer, example_assigns, install_doc_block, nothing_left, remove_installs, user_dir,
};
use crate::{
    INSTALLED, RING, SHARD_SELECTOR, SHARDS_NAMESPACE, SYSTEM, TURN, items, shard_pods,
    wait_converged, wait_ring,
};

/// The images of the bundle's two workloads, as the committed bundle names them.
const IMAGES: [&str; 2] = ["sharder", "checksum-controller"];

/// A user's directory with the previous release's bundle, each image pinned to the previous
/// release's tag (a release names its images by version; `latest` is this checkout's).
fn previous_bundle(c: &InCluster, release: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    let tag = std::fs::read_to_string(release.join("tag"))?;
    let tag = tag.trim();
    let dir = c.state_dir().join("release-previous");
    std::fs::create_dir_all(&dir)?;
    for file in ["install.yaml", "admission-policies.yaml", "example.yaml"] {
        let mut text = std::fs::read_to_string(release.join(file))?;
        for image in IMAGES {
            text = text.replace(
                &format!("image: {image}:latest"),
                &format!("image: {image}:{tag}"),
            );
        }
        std::fs::write(dir.join(file), text)?;
    }
    Ok(dir)
}

/// The images the pods of a namespace run, by pod.
fn pod_images(c: &InCluster, namespace: &str) -> anyhow::Result<Vec<(String, String)>> {
    let pods = c.kubectl_json(&["-n", namespace, "get", "pods"])?;
    Ok(items(&pods)
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .map(|p| {
            (
                p["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                p["spec"]["containers"][0]["image"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect())
}

/// Samples the ring's Ready condition every 200 ms until stopped: the number of samples and the
/// times it was not Ready (or could not be read), with what it said.
fn watch_ready(
    client: &kube::Client,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<(usize, Vec<String>)> {
    let rings: Api<ClusterRing> = Api::all(client.clone());
    tokio::spawn(async move {
        let (mut samples, mut not_ready) = (0, Vec::new());
        while !stop.is_cancelled() {
            samples += 1;
            match rings.get(RING).await {
                Ok(ring) => {
                    let ring = serde_json::to_value(&ring).unwrap_or_default();
                    let conditions = ring["status"]["conditions"].as_array().cloned();
                    let ready = conditions.iter().flatten().find(|c| c["type"] == "Ready");
                    if ready.is_none_or(|c| c["status"] != "True") {
                        not_ready.push(format!(
                            "{}: {}",
                            k8s_openapi::jiff::Timestamp::now(),
                            ready.cloned().unwrap_or(Value::Null)
                        ));
                    }
                }
                Err(e) => not_ready.push(format!("{}: {e}", k8s_openapi::jiff::Timestamp::now())),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        (samples, not_ready)
    })
}

/// docs/install.md's "Install from the release bundle" with the previous release's files and
/// images, the example ring with 200 Secrets; then "Upgrade the release bundle" with this
/// checkout's files while a Secret is created every 100 ms. Every create is admitted, every
/// Secret ends on its shard with its ConfigMap, no Secret is reconciled by two shards at once
/// (from the shards' logs, old and new pods), the ring is Ready at every sample, and every pod
/// runs this checkout's image afterwards.
#[tokio::test]
async fn upgrade_from_the_previous_release_loses_nothing() -> anyhow::Result<()> {
    let Some(c) = in_cluster() else {
        return Ok(());
    };
    // Before the turn: the first build of the previous release takes minutes, and needs no node.
    let release = previous_release()?;
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    c.load_images(&release)?;
    remove_installs(c)?;
    let previous = previous_bundle(c, &release)?;
    c.shell(
        &install_doc_block(c, "### Install from the release bundle")?,
        &previous,
    )?;
    let old_images = pod_images(c, SYSTEM)?;
    ensure!(
        old_images.iter().all(|(_, i)| !i.ends_with(":latest")),
        "the previous release does not run its own images: {old_images:?}"
    );
    let namespace = example_assigns(c, "upgrade", 200).await?;
    let old_shards = shard_pods(c)?;

    let kind = RingKind::ClusterRing;
    let client = c.client().await?;
    let logs = ShardLogs::follow(c.config().await?, SHARDS_NAMESPACE, SHARD_SELECTOR)?;
    let stop_sampling = tokio_util::sync::CancellationToken::new();
    let readiness = watch_ready(&client, stop_sampling.clone());
    let writer = Writer::start(&client, kind, &namespace, 200);
    tokio::time::sleep(Duration::from_secs(2)).await;

    let upgrading = Instant::now();
    let script = install_doc_block(c, "### Upgrade the release bundle")?;
    let current = user_dir(c, "upgrade")?;
    // Off the test's runtime, so that the writer and the sampler go on while kubectl waits.
    tokio::task::spawn_blocking(move || {
        in_cluster().context("no cluster")?.shell(&script, &current)
    })
    .await??;
    let took = upgrading.elapsed();
    wait_ring(c, kind, 3).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (created, labelled) = writer.finish(took).await?;
    stop_sampling.cancel();
    let (samples, not_ready) = readiness.await?;

    ensure!(
        not_ready.is_empty(),
        "the ring was not Ready at {} of {samples} samples during the upgrade: {not_ready:?}",
        not_ready.len()
    );
    for namespace in [SYSTEM, SHARDS_NAMESPACE] {
        let images = pod_images(c, namespace)?;
        ensure!(
            !images.is_empty() && images.iter().all(|(_, i)| i.ends_with(":latest")),
            "pods of {namespace} not on this checkout's images after the upgrade: {images:?}"
        );
    }
    let new_shards = shard_pods(c)?;
    ensure!(
        !new_shards.iter().any(|p| old_shards.contains(p)),
        "the shards did not roll: before {old_shards:?}, after {new_shards:?}"
    );
    // 0 unassigned: every Secret, those of the upgrade included, on its shard with its ConfigMap.
    wait_converged(c, kind, &namespace, Duration::from_secs(60)).await?;
    let records = logs.stop().await;
    let violations = ownership::violations(&records);
    ensure!(
        violations.is_empty(),
        "ownership overlapped during the upgrade:\n{}",
        violations.join("\n")
    );
    eprintln!(
        "upgrade from {}: {created} Secrets created while it ran for {took:?}, {labelled} labelled in \
         admission, 0 refused, 0 unassigned after; Ready at all {samples} samples; {} shard log \
         records, no overlap",
        release.display(),
        records.len()
    );
    c.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    // The upgraded install uninstalls as documented, leaving nothing of either release.
    c.shell(
        &install_doc_block(c, "### Uninstall the release bundle")?,
        &user_dir(c, "upgrade")?,
    )?;
    nothing_left(c, false)?;
    INSTALLED.store(false, std::sync::atomic::Ordering::SeqCst);
    guard.passed();
    Ok(())
}
