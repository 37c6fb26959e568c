//! The processes the tool starts (sharder, shards) and what it reads from them: sync log
//! records, memory, metrics, and the first page of a sync list.

use std::time::Duration;

use anyhow::Context;
use e2e::fixtures::{ShardTiming, start_checksum_shard_with};
use e2e::process::{Process, poll_until, status_fields};
use e2e::sharder_process::{SharderFiles, counter};
use http_body_util::BodyExt;
use kube::Client;
use kube::api::ListParams;

use kube_sharder::core::list_scope::PAGE_SIZE;
use kube_sharder::metrics::{DRAINS, MOVEMENTS};
use kube_sharder::records::EVENT_SYNC_FINISHED;
use kube_sharding_api::{RingKind, RingRef};

use crate::report::{Counters, MemorySample, PageProbe, SyncRecord};

/// Starts a checksum-controller shard restricted to `namespace`, with default Lease timing and
/// `shard_args`, that leaves its ConfigMaps' labels to the sharder if `leave_children`.
///
/// Its log stays on disk (see the report); it is never printed, as it holds a line per object.
pub(crate) fn start_shard(
    ring: &str,
    namespace: &str,
    shard: &str,
    leave_children: bool,
    shard_args: &[String],
) -> anyhow::Result<Process> {
    let ring = RingRef::new(RingKind::ClusterRing, ring);
    let mut extra: Vec<&str> = shard_args.iter().map(String::as_str).collect();
    if leave_children {
        extra.push("--leave-children-to-sharder");
    }
    let mut process =
        start_checksum_shard_with(&ring, namespace, shard, ShardTiming::DEFAULT, &extra)?;
    process.passed();
    Ok(process)
}

/// Stops `old` (if any) and starts a fresh sharder (as `SharderFiles::start_process` does, plus
/// `envs`), ready once its caches synced.
pub(crate) async fn restart_sharder(
    old: Option<Process>,
    files: &SharderFiles,
    envs: &[(String, String)],
) -> anyhow::Result<Process> {
    if let Some(mut old) = old {
        old.terminate()?;
        old.wait(Duration::from_secs(30)).await?;
    }
    let mut process = Process::start_with_env(
        "sharder",
        [
            "--config".as_ref(),
            files.config.as_os_str(),
            "--log-format=json".as_ref(),
        ],
        envs.iter().map(|(k, v)| (k, v)),
    )?;
    process.passed();
    files.wait_ready(Duration::from_secs(60)).await?;
    Ok(process)
}

/// The sharder's `sync_finished` records of ClusterRing `ring`, in order.
pub(crate) fn sync_records(sharder: &Process, ring: &str) -> Vec<SyncRecord> {
    // The records name a ring by kind and name (`ClusterRing/<name>`).
    let ring = RingRef::new(RingKind::ClusterRing, ring).to_string();
    sharder
        .records()
        .iter()
        .filter(|r| r["event"] == EVENT_SYNC_FINISHED && r["ring"] == ring)
        .map(|f| SyncRecord {
            duration: f["duration"].as_str().unwrap_or_default().to_string(),
            listed: f["listed"].as_u64().unwrap_or_default(),
            drained: f["drained"].as_u64().unwrap_or_default(),
            moved: f["moved"].as_u64().unwrap_or_default(),
            failed: f["failed"].as_u64().unwrap_or_default(),
        })
        .collect()
}

/// Waits until the sharder has finished more than `seen` syncs of `ring`; returns the next one.
pub(crate) async fn wait_sync(
    sharder: &Process,
    ring: &str,
    seen: usize,
    timeout: Duration,
) -> anyhow::Result<SyncRecord> {
    poll_until(
        &format!("sync {} of ring {ring}", seen + 1),
        timeout,
        || {
            let record = sync_records(sharder, ring).into_iter().nth(seen);
            async move { Ok(record) }
        },
    )
    .await
}

/// `VmHWM` and `VmRSS` of a process.
pub(crate) fn memory(process: &Process) -> anyhow::Result<MemorySample> {
    let pid = process.id().context("the sharder has exited")?;
    let [vm_hwm_kib, vm_rss_kib] = status_fields(pid, ["VmHWM", "VmRSS"])?;
    Ok(MemorySample {
        vm_hwm_kib,
        vm_rss_kib,
    })
}

/// Requests the first page of a cluster-wide metadata list of `path`: with `raw_rv0`, with
/// `limit=500&resourceVersion=0` as docs/protocol.md §9 describes; else built from the very
/// `ListParams` the sharder's sync uses (`limit(500)` and `resource_version = "0"`), which
/// kube-core turns into a query without `resourceVersion` (it drops `0` whenever a limit is set).
pub(crate) async fn probe_page(
    client: &Client,
    resource: &'static str,
    path: &str,
    raw_rv0: bool,
) -> anyhow::Result<PageProbe> {
    let mut params = ListParams::default().limit(PAGE_SIZE);
    params.resource_version = Some("0".into());
    let mut request = kube::core::Request::new(path).list_metadata(&params)?;
    if raw_rv0 {
        *request.uri_mut() = format!("{path}?limit={PAGE_SIZE}&resourceVersion=0").parse()?;
    }
    let query = request.uri().query().unwrap_or_default().to_string();
    let text = client.request_text(request).await?;
    let list: serde_json::Value = serde_json::from_str(&text)?;
    Ok(PageProbe {
        resource,
        request: if raw_rv0 { "spec" } else { "sharder" },
        query,
        items: list["items"].as_array().map_or(0, Vec::len),
        bytes: text.len(),
        has_continue: list["metadata"]["continue"]
            .as_str()
            .is_some_and(|c| !c.is_empty()),
    })
}

pub(crate) async fn probe_pages(client: &Client) -> anyhow::Result<Vec<PageProbe>> {
    let mut pages = Vec::new();
    for (resource, path) in [
        ("secrets", "/api/v1/secrets"),
        ("configmaps", "/api/v1/configmaps"),
    ] {
        for raw_rv0 in [false, true] {
            pages.push(probe_page(client, resource, path, raw_rv0).await?);
        }
    }
    Ok(pages)
}

/// A CPU profile of the API server over the next `seconds` (its `/debug/pprof/profile`, which
/// kube-apiserver serves to cluster admins unless started with `--profiling=false`).
pub(crate) async fn apiserver_profile(client: &Client, seconds: u64) -> anyhow::Result<Vec<u8>> {
    let request = hyper::Request::get(format!("/debug/pprof/profile?seconds={seconds}"))
        .body(kube::client::Body::empty())?;
    let response = client
        .send(request)
        .await
        .context("failed to request the API server's CPU profile")?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .context("failed to read the API server's CPU profile")?
        .to_bytes();
    anyhow::ensure!(
        status.is_success(),
        "the API server answered {status} for its CPU profile: {}",
        String::from_utf8_lossy(&body)
    );
    Ok(body.to_vec())
}

pub(crate) fn counters(files: &SharderFiles, ring: &str) -> anyhow::Result<Counters> {
    let text = files.metrics()?;
    let drains = &format!("{DRAINS}_total");
    let moves = &format!("{MOVEMENTS}_total");
    Ok(Counters {
        secret_drains: counter(&text, drains, ring, "secrets")?,
        secret_moves: counter(&text, moves, ring, "secrets")?,
        configmap_drains: counter(&text, drains, ring, "configmaps")?,
        configmap_moves: counter(&text, moves, ring, "configmaps")?,
    })
}
