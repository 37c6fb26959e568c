//! The sharder under faults (issue: leadership loss, webhook outages, misbehaving shards): each
//! test injects one fault against the real API server and checks what the README promises.
//!
//! | module | what |
//! |---|---|
//! | `assignment` | Assignment through faults of the webhook path: outages, an API server restart, namespaces joining a ring, an unreachable webhook, a CRD changing its served version. |
//! | `controlled` | Controlled objects follow their controller, and only after it left its old shard. |
//! | `leadership` | Leadership and rollouts of the sharder: losing leadership stops its controllers, refused settings stop it at start, a rollout refuses no admission call, a ready replica assigns at once. |
//! | `leases` | Misbehaving shards and Leases: invalid and duplicate names, squatters, skewed clocks, malformed Leases, held Leases taken away by third parties. |
//! | `memory` | What the sharder spends: no request per Lease renewal, no memory for big Leases or dry-run pins. |
//! | `syncs` | Syncs overtaken by events: a shard joining mid-sync, a move landing after a newer sync listed its object. |

mod assignment;
mod controlled;
mod leadership;
mod leases;
mod memory;
mod syncs;

use std::time::Duration;

use e2e::Cluster;
use e2e::gate::TcpGate;
use e2e::sharder_process::{SharderFiles, SharderSettings};

/// Generous bound for processes starting up and caches syncing on a busy machine.
const STARTUP: Duration = Duration::from_secs(60);

/// A sharder process on `cluster` with `settings` whose webhook the API server calls through a
/// gate the test can close (a network blip, or a webhook it cannot reach at all).
async fn gated_sharder(
    cluster: &Cluster,
    settings: SharderSettings,
) -> anyhow::Result<(TcpGate, SharderFiles, e2e::process::Process)> {
    let webhook_port = e2e::net::free_port()?;
    let gate = TcpGate::start(([127, 0, 0, 1], webhook_port).into()).await?;
    let settings = SharderSettings {
        webhook_url: Some(format!("https://{}", gate.addr())),
        ..settings
    };
    let files =
        SharderFiles::create_with_webhook_port(cluster.kubeconfig(), &settings, webhook_port)?;
    let sharder = files.start_process()?;
    Ok((gate, files, sharder))
}
