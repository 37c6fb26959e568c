//! A sharded controller with controlled objects and local state that follows its objects as the
//! sharder moves them: for every Secret assigned to this shard it keeps a ConfigMap (owned by the
//! Secret, so it moves with it) and an in-memory count of the reconciles of that Secret.
//!
//! ```sh
//! RING=my-ring SHARD_NAME=shard-0 LEASE_NAMESPACE=default cargo run --example departures
//! ```
//!
//! The ring must list `secrets` as a main resource and `configmaps` as a controlled one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{ObjectMeta, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::{Api, Client, Resource, ResourceExt};
use kube_sharding::{Departure, LeaseLock, ObjectKey, Ownership, Shard, ShardRunEnd, Term};
use tokio_util::sync::CancellationToken;

/// What reconciles share: the client and the state kept per Secret.
struct Context {
    client: Client,
    /// Reconciles per Secret; must not outlive the Secret's stay on this shard.
    reconciles: Mutex<HashMap<ObjectKey, u64>>,
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Ownership(#[from] kube_sharding::OwnershipError),
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

async fn reconcile(
    secret: Arc<Secret>,
    context: Arc<Context>,
    ownership: Ownership,
) -> Result<Action, Error> {
    let namespace = secret.namespace().unwrap_or_default();
    let count = {
        let mut reconciles = context.reconciles.lock().expect("not poisoned");
        let count = reconciles.entry(ObjectKey::of(secret.meta())).or_default();
        *count += 1;
        *count
    };
    let owner = secret
        .controller_owner_ref(&())
        .expect("a Secret has a name and UID");
    // The ConfigMap is labelled for this shard by the sharder's webhook when it is created (the
    // owner decides), so the `owns` watch below sees it.
    let config_map = ConfigMap {
        metadata: ObjectMeta {
            name: Some(format!("{}-summary", secret.name_any())),
            namespace: Some(namespace.clone()),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        data: Some([("reconciles".to_string(), count.to_string())].into()),
        ..ConfigMap::default()
    };
    // Confirm right before the first write, not earlier: a drain may have arrived meanwhile.
    ownership.confirm().await?;
    Api::<ConfigMap>::namespaced(context.client.clone(), &namespace)
        .patch(
            config_map.metadata.name.as_deref().unwrap_or_default(),
            &PatchParams::apply("departures-example").force(),
            &Patch::Apply(&config_map),
        )
        .await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let env = |name: &str| std::env::var(name).map_err(|_| anyhow::anyhow!("set {name}"));
    let client = Client::try_default().await?;
    let shard = Shard::new(env("RING")?, env("SHARD_NAME")?, env("LEASE_NAMESPACE")?);
    let lock = LeaseLock::new(client.clone(), shard.lease_config())?;
    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        on_signal.cancel();
    });
    // Outside the terms: state that should survive a rejoin lives here.
    let context = Arc::new(Context {
        client: client.clone(),
        reconciles: Mutex::new(HashMap::new()),
    });

    let term = |term: Term| {
        // Watches of both the main and the controlled resource select this shard's label.
        let controller =
            Controller::new(Api::<Secret>::all(client.clone()), shard.watcher_config())
                .owns(
                    Api::<ConfigMap>::all(client.clone()),
                    shard.watcher_config(),
                )
                .graceful_shutdown_on(term.stop.cancelled_owned())
                .run(
                    shard.reconciler(client.clone(), term.guard, reconcile),
                    |_, _, _| Action::requeue(Duration::from_secs(5)),
                    context.clone(),
                )
                .for_each(|_| async {});
        // A Secret that leaves the watch was either moved to another shard or deleted; only a
        // read tells them apart. Objects counted in an earlier term are checked too, as they may
        // have left while this shard was out of the ring.
        let known: Vec<ObjectKey> = context
            .reconciles
            .lock()
            .expect("not poisoned")
            .keys()
            .cloned()
            .collect();
        let context = context.clone();
        let departures = shard
            .departures(Api::<Secret>::all(client.clone()))
            .with_known(known)
            .stream()
            .for_each(move |departure| {
                // Either way the count goes: the new shard starts its own. A deleted Secret's
                // ConfigMap goes with it (owner reference); a moved one's stays for the new shard.
                context
                    .reconciles
                    .lock()
                    .expect("not poisoned")
                    .remove(departure.object());
                if let Departure::Deleted { object } = &departure {
                    println!("{}: deleted", object.name);
                }
                async {}
            });
        async move {
            tokio::select! {
                () = controller => {}
                () = departures => {}
            }
        }
    };
    match shard.run(&lock, &shutdown, term).await? {
        ShardRunEnd::LeaseLost => anyhow::bail!("lost the shard Lease"),
        ShardRunEnd::Stopped { .. } | ShardRunEnd::Kept => Ok(()),
    }
}
