//! etcd of a control plane the tests started, reached through its JSON gateway (`/v3/kv/...`),
//! which etcd serves on its plain-HTTP loopback client URL: compaction on demand.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::ByteString;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The key in which the API server records the revision it compacted etcd to; its watch cache
/// follows it (since 1.34, to drop list snapshots older than that revision).
const COMPACT_REV_KEY: &[u8] = b"compact_rev_key";

/// POSTs `body` to etcd's gateway at `endpoint` + `path`; returns the JSON answer.
async fn post(endpoint: &str, path: &str, body: &Value) -> anyhow::Result<Value> {
    let out = tokio::process::Command::new("curl")
        .args(["-sf", "--max-time", "5", "-X", "POST", "--data-binary"])
        .arg(body.to_string())
        .arg(format!("{endpoint}{path}"))
        .output()
        .await
        .context("failed to run curl")?;
    if !out.status.success() {
        bail!(
            "POST {path} to etcd failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).with_context(|| format!("unexpected answer to {path}"))
}

/// etcd's current revision.
pub async fn revision(endpoint: &str) -> anyhow::Result<i64> {
    // A range over a key nobody writes: only the header matters.
    let answer = post(
        endpoint,
        "/v3/kv/range",
        &json!({"key": ByteString(b"/controller-sharding-e2e/none".to_vec())}),
    )
    .await?;
    answer["header"]["revision"]
        .as_str()
        .context("no revision in the range answer")?
        .parse()
        .context("revision is not a number")
}

/// Compacts etcd to its current revision the way the API server does: records the revision in
/// `compact_rev_key` (a write, so the revision always moves on), then compacts to it. Returns
/// the revision compacted to.
pub async fn compact(endpoint: &str) -> anyhow::Result<i64> {
    let revision = revision(endpoint).await?;
    post(
        endpoint,
        "/v3/kv/put",
        &json!({
            "key": ByteString(COMPACT_REV_KEY.to_vec()),
            "value": ByteString(revision.to_string().into_bytes()),
        }),
    )
    .await?;
    post(
        endpoint,
        "/v3/kv/compaction",
        &json!({"revision": revision.to_string()}),
    )
    .await?;
    Ok(revision)
}

/// Compacts etcd again and again in the background, so that continue tokens expire within a
/// period; stops when dropped.
#[derive(Debug)]
pub struct Compactor {
    compactions: Arc<AtomicU64>,
    stop: CancellationToken,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl Compactor {
    /// Starts [`compact`]ing etcd at `endpoint` every `period`.
    pub fn start(endpoint: String, period: Duration) -> Self {
        let compactions = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let (compactions, stop) = (compactions.clone(), stop.clone());
            async move {
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return Ok(()),
                        _ = tick.tick() => {}
                    }
                    compact(&endpoint).await?;
                    compactions.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Self {
            compactions,
            stop,
            task: Some(task),
        }
    }

    /// Compactions done so far.
    pub fn compactions(&self) -> u64 {
        self.compactions.load(Ordering::Relaxed)
    }

    /// Stops compacting; fails with the error that stopped it early, if one did.
    pub async fn stop(mut self) -> anyhow::Result<u64> {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.await.context("the compactor panicked")??;
        }
        Ok(self.compactions())
    }
}

impl Drop for Compactor {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
