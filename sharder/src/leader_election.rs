//! Leader election among sharder replicas (SPEC §11): only the leader runs the controllers.
//!
//! The election is the shard library's Lease lock on `leaderElection.resourceNamespace/
//! resourceName`, and the controllers run under [`HeldLease::run_while_held`]: dropped at once
//! when leadership is lost (another replica may lead already), stopped on shutdown before the
//! Lease is released so the next leader takes over at once.
//!
//! [`HeldLease::run_while_held`]: shard::HeldLease::run_while_held

use shard::lease::{HeldRunEnd, LeaseLock, LeaseLockConfig};
use tokio_util::sync::CancellationToken;

use crate::context::Context;
use crate::controller;

/// Runs the controllers while this replica is the leader (or always, without leader election),
/// until `shutdown` fires.
pub(crate) async fn run(ctx: Context, identity: String, shutdown: CancellationToken) {
    let le = ctx.config.leader_election.clone();
    if !le.leader_elect {
        controller::run_all(ctx, shutdown).await;
        return;
    }
    let lock_config = LeaseLockConfig::new(&le.resource_namespace, &le.resource_name, &identity)
        .with_timing(le.timing());
    let lock = match LeaseLock::new(ctx.client.clone(), lock_config) {
        Ok(lock) => lock,
        Err(error) => {
            tracing::error!(%error, "invalid leader election settings");
            return;
        }
    };
    loop {
        let held = tokio::select! {
            () = shutdown.cancelled() => return,
            held = lock.acquire() => held,
        };
        tracing::info!(%identity, "became leader, starting controllers");
        let ended = held
            .run_while_held(&shutdown, |stop| controller::run_all(ctx.clone(), stop))
            .await;
        match ended {
            Ok(HeldRunEnd::LeaseLost) => tracing::error!("lost leadership, stopped controllers"),
            Ok(HeldRunEnd::WorkEnded { .. }) => {}
            Err(error) => tracing::warn!(%error, "failed to release leader election Lease"),
        }
        if shutdown.is_cancelled() {
            return;
        }
    }
}
