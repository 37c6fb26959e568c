//! The smallest complete sharded controller: it reconciles the Secrets assigned to this shard of
//! a `ClusterRing` and does nothing else.
//!
//! Run one copy per replica, with the sharder installed and a ring whose resources include
//! `secrets`:
//!
//! ```sh
//! RING=my-ring SHARD_NAME=shard-0 LEASE_NAMESPACE=default cargo run --example minimal
//! ```
//!
//! In a Deployment, set `SHARD_NAME` to the pod name (the downward API's `metadata.name`): a shard
//! name must be unique within the ring and stable while the process runs.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::controller::{Action, Controller};
use kube::{Api, Client, ResourceExt};
use kube_sharding::{LeaseLock, Ownership, OwnershipError, Shard, ShardRunEnd, Term};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Called only for Secrets assigned to this shard that are not being drained, and only while the
/// shard holds its Lease.
async fn reconcile(
    secret: Arc<Secret>,
    _context: Arc<()>,
    ownership: Ownership,
) -> Result<Action, OwnershipError> {
    // Read and compute here; nothing that changes the cluster yet.
    let keys = secret.data.as_ref().map_or(0, |data| data.len());
    // One GET right before the first write: the Secret is still ours, not being drained, and
    // the Lease is still held. A reconcile that started before a drain stops here.
    ownership.confirm().await?;
    // Write here.
    println!(
        "{}/{}: {keys} keys",
        secret.namespace().unwrap_or_default(),
        secret.name_any()
    );
    Ok(Action::await_change())
}

fn env(name: &str) -> anyhow::Result<String> {
    std::env::var(name).map_err(|_| anyhow::anyhow!("set {name}"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let client = Client::try_default().await?;
    let shard = Shard::new(env("RING")?, env("SHARD_NAME")?, env("LEASE_NAMESPACE")?);
    let lock = LeaseLock::new(client.clone(), shard.lease_config())?;

    // SIGTERM (the kubelet stopping the pod) or Ctrl-C: stop reconciling, then release the
    // Lease, so that the sharder hands this shard's Secrets to the others at once instead of
    // waiting for the Lease to expire.
    let shutdown = CancellationToken::new();
    let mut terminate = signal(SignalKind::terminate())?;
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        on_signal.cancel();
    });

    // A term is one stretch of holding the Lease; the controller is rebuilt for each, with the
    // term's guard, which ends when the Lease does.
    let end = shard
        .run(&lock, &shutdown, |term: Term| {
            Controller::new(Api::<Secret>::all(client.clone()), shard.watcher_config())
                .graceful_shutdown_on(term.stop.cancelled_owned())
                .run(
                    shard.reconciler(client.clone(), term.guard, reconcile),
                    |_, _, _| Action::requeue(Duration::from_secs(5)),
                    Arc::new(()),
                )
                .for_each(|_| async {})
        })
        .await?;
    match end {
        // Another process may own our Secrets by now: exit, and let the pod restart.
        ShardRunEnd::LeaseLost => anyhow::bail!("lost the shard Lease"),
        ShardRunEnd::Stopped { .. } | ShardRunEnd::Kept => Ok(()),
    }
}
