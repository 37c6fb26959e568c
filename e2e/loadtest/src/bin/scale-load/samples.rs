//! What the tool reads from processes and threads.

use std::time::Duration;

use anyhow::Context as _;
use e2e::Cluster;
use e2e::fixtures::wait_status;
use e2e::process::Process;
use e2e::sharder_process::{SharderFiles, SharderSettings};
use kube::Client;
use kube_sharder::records::EVENT_SYNC_FINISHED;

/// CPU time (user + system) a process used so far, in seconds.
pub(crate) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    stat_cpu_seconds(&format!("/proc/{pid}/stat"))
}

/// CPU seconds the sharder process used so far.
pub(crate) fn cpu(sharder: &Process) -> anyhow::Result<f64> {
    cpu_seconds(sharder.id().context("the sharder exited")?)
}

/// Starts the sharder beside the tool with no periodic sync within a run (only the first one),
/// and returns once ClusterRing `ring` reports `shards` shards, that first sync has finished and
/// `settle_seconds` more have passed: what the tool then measures is its own load alone.
pub(crate) async fn start_settled_sharder(
    cluster: &Cluster,
    client: &Client,
    ring: &str,
    shards: i32,
    settle_seconds: u64,
) -> anyhow::Result<(SharderFiles, Process)> {
    let settings = SharderSettings {
        sync_period: "1h".into(),
        ..SharderSettings::default()
    };
    let files = SharderFiles::create(cluster.kubeconfig(), &settings)?;
    let sharder = files.start_process()?;
    files.wait_ready(Duration::from_secs(120)).await?;
    wait_status(client, ring, shards, shards).await?;
    sharder
        .wait_for_record(
            "the ring's first sync to finish",
            Duration::from_secs(120),
            |r| r["event"] == EVENT_SYNC_FINISHED,
        )
        .await?;
    tokio::time::sleep(Duration::from_secs(settle_seconds)).await;
    Ok((files, sharder))
}

/// CPU time (user + system) one thread of this process used so far, in seconds.
pub(crate) fn thread_cpu_seconds(tid: u32) -> anyhow::Result<f64> {
    stat_cpu_seconds(&format!("/proc/self/task/{tid}/stat"))
}

/// utime + stime of a `stat` file of `/proc`, in seconds.
fn stat_cpu_seconds(path: &str) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(path).with_context(|| format!("failed to read {path}"))?;
    // The command name (field 2) may hold spaces; the fields after its closing parenthesis are
    // `state` (3) onwards, so utime (14) and stime (15) are the 12th and 13th after it.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("unexpected /proc/pid/stat")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<f64> {
        Ok(fields
            .get(i)
            .context("short /proc/pid/stat")?
            .parse::<f64>()?)
    };
    // The kernel's USER_HZ, 100 on every Linux architecture we run on.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}
