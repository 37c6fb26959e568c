//! Leader election among sharder replicas (docs/protocol.md §11): only the leader runs the
//! controllers.
//!
//! The election is the shard library's Lease lock on `leaderElection.resourceNamespace/
//! resourceName`, and the controllers run under [`HeldLease::run_while_held`]: dropped at once
//! when leadership is lost (another replica may lead already), stopped on shutdown before the
//! Lease is released so the next leader takes over at once.
//!
//! [`HeldLease::run_while_held`]: kube_sharding::HeldLease::run_while_held

use anyhow::Context as _;
use kube::Client;
use kube_sharding::{HeldRunEnd, LeaseLock, LeaseLockConfig};
use tokio_util::sync::CancellationToken;

use crate::context::Context;
use crate::controller;

/// How this replica runs the controllers: under the leader-election Lease, or always.
pub(crate) enum Election {
    /// Leader election is off: this replica runs the controllers.
    Off,
    /// Only while holding this Lease lock.
    Lock {
        /// The lock on `leaderElection.resourceNamespace/resourceName`.
        lock: LeaseLock,
        /// This replica's identity.
        identity: String,
    },
}

impl Election {
    /// Builds the lock from the configuration. A setting the lock refuses is an error here, at
    /// start, so the process stops with the field's name instead of serving with no controllers.
    /// `client` is the unthrottled leader-election client.
    pub(crate) fn new(ctx: &Context, client: Client, identity: String) -> anyhow::Result<Self> {
        let le = &ctx.config.leader_election;
        if !le.leader_elect {
            return Ok(Self::Off);
        }
        let lock_config =
            LeaseLockConfig::new(&le.resource_namespace, &le.resource_name, &identity)
                .with_timing(le.timing());
        let lock =
            LeaseLock::new(client, lock_config).context("invalid leaderElection settings")?;
        Ok(Self::Lock { lock, identity })
    }

    /// Runs the controllers while this replica is the leader (or always, without leader
    /// election), until `shutdown` fires. When the controllers end on their own while the Lease
    /// is held, the Lease is released and the replica competes again, so a leader never holds
    /// the Lease idle.
    ///
    /// Nothing starts before `synced` fires: controllers act on the caches and must never see
    /// them before their first full listing.
    pub(crate) async fn run(
        self,
        ctx: Context,
        synced: CancellationToken,
        shutdown: CancellationToken,
    ) {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = synced.cancelled() => {}
        }
        let (lock, identity) = match self {
            Self::Off => {
                controller::run_all(ctx, shutdown).await;
                return;
            }
            Self::Lock { lock, identity } => (lock, identity),
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
                Ok(HeldRunEnd::LeaseLost) => {
                    tracing::error!("lost leadership, stopped controllers");
                }
                Ok(HeldRunEnd::WorkEnded { .. }) if !shutdown.is_cancelled() => {
                    tracing::error!("controllers stopped on their own; released leadership");
                }
                Ok(HeldRunEnd::WorkEnded { .. }) => {}
                Err(error) => tracing::warn!(%error, "failed to release leader election Lease"),
            }
            if shutdown.is_cancelled() {
                return;
            }
        }
    }
}

/// A leader-election identity unique per process: host name, process id and start time.
pub fn default_identity() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .unwrap_or_else(|| "sharder".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!("{host}_{}_{nanos:08x}", std::process::id())
}
