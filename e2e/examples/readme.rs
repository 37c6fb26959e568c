//! The README's shard library example, compiled: the lines between the `README begin` and
//! `README end` markers are the README's Rust block, and the `book::readme_example_compiles`
//! test fails when the two differ. The rest is what the README leaves out to stay short.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::controller::{Action, Controller};
use kube::{Api, Client};
use kube_sharding::{LeaseLock, Ownership, OwnershipError, Shard, ShardRunEnd, Term};
use tokio_util::sync::CancellationToken;

/// Your reconciler, with the third argument the shard library hands it.
async fn reconcile(
    _secret: Arc<Secret>,
    _context: Arc<()>,
    ownership: Ownership,
) -> Result<Action, OwnershipError> {
    // Right before the first write: still this shard's object, not drained, Lease held.
    ownership.confirm().await?;
    Ok(Action::await_change())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let client = Client::try_default().await?;
    let pod = std::env::var("POD_NAME")?;
    let shutdown = CancellationToken::new();
    let retry = |_: Arc<Secret>, _: &_, _: Arc<()>| Action::requeue(Duration::from_secs(5));
    // README begin
    let shard = Shard::new("my-ring", pod, "my-namespace"); // ring, shard name, Lease namespace
    let lock = LeaseLock::new(client.clone(), shard.lease_config())?;
    let end = shard.run(&lock, &shutdown, |term: Term| {
        // acknowledges drains, never shows you an object that is leaving this shard
        let reconcile = shard.reconciler(client.clone(), term.guard, reconcile);
        Controller::new(Api::<Secret>::all(client.clone()), shard.watcher_config())
            .graceful_shutdown_on(term.stop.cancelled_owned())
            .run(reconcile, retry, Arc::new(()))
            .for_each(|_| async {})
    });
    if let ShardRunEnd::LeaseLost = end.await? {
        anyhow::bail!("lost the shard Lease: exit, a restart rejoins the ring");
    }
    // README end
    Ok(())
}
