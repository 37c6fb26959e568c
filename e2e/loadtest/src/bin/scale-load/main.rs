//! `scale-load`: what the sharder costs at scale, measured against the local control plane.
//!
//! `scale-load membership` creates shard Leases in one or more ClusterRings and renews every
//! one of them itself, at the shards' usual period, with no shard processes. With two sharder
//! replicas running (leader election on), it measures over a window:
//! - each replica's CPU use (utime + stime from `/proc`), as a share of one core;
//! - the API requests each replica sent (its own `controller_sharding_api_requests_total`, counted
//!   where requests leave the process), and the API server's count of all requests next to the
//!   tool's own, so that nothing is taken on the sharder's word alone;
//! - with `--churn-every`, a second window in which one Lease at a time also changes its weight
//!   (a membership change of one ring): the work and requests per change, and how many rings
//!   were rebuilt for it.
//!
//! `scale-load unselected` creates ConfigMaps in a namespace that a ring over ConfigMaps does not
//! select and measures the sharder's CPU per CREATE against an idle window of the same length:
//! what objects no ring owns cost it (issue 24).
//!
//! `scale-load churn` fills a ring with Secrets and the ConfigMaps they control, then creates,
//! updates and deletes them at a steady rate and samples the sharder's resident memory and CPU
//! every second (issue 24, part 5).
//! `scale-load assign` creates ConfigMaps at a steady rate in a ring without a webhook
//! (`assignment: Watch`) and measures each one's time from CREATE answered to its shard label
//! seen, and the sharder's CPU per object (issue 25).
//!
//! `scale-load webhook` needs no control plane: it serves the sharder's webhook and a trivial one
//! in-process, each on one core, and loads both over TLS on loopback with concurrent HTTP/2
//! clients: reviews per second per core and client-observed latency, side by side.
//!
//! Build in release (the sharder it starts is the one next to it) and run it alone on the machine:
//! `cargo build --release --workspace --bins && target/release/scale-load membership`.
//! docs/scale.md has the last results.

mod assign;
mod churn;
mod membership;
mod samples;
mod unselected;
mod webhook;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(about = "Measure the sharder's cost at scale against the local control plane")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Shard Leases renewed by the tool: the sharder's CPU and API requests per renewal and per
    /// membership change.
    Membership(membership::Args),
    /// A ring's objects created, updated and deleted at a steady rate: the sharder's resident
    /// memory and CPU.
    Churn(churn::Args),
    /// ConfigMaps created in a namespace no ring selects: the sharder's CPU per CREATE.
    Unselected(unselected::Args),
    /// ConfigMaps created at a rate in a Watch ring: time from CREATE to shard label, and the
    /// sharder's CPU per object.
    Assign(assign::Args),
    /// The webhook's admission reviews per second on one core and its latency under concurrent
    /// clients, next to a trivial webhook's; in-process, no control plane.
    Webhook(webhook::Args),
}

/// Prints a progress line to stderr, with the seconds since `started`.
pub(crate) fn progress(started: std::time::Instant, message: &str) {
    eprintln!("[{:>6.1}s] {message}", started.elapsed().as_secs_f64());
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    match args.command {
        Command::Membership(args) => {
            // Blocks on a runtime of its own: set the cluster up before entering ours.
            let cluster = e2e::cluster();
            let runtime = tokio::runtime::Runtime::new().context("failed to start a runtime")?;
            runtime.block_on(membership::run(&args, cluster))
        }
        Command::Churn(args) => {
            let cluster = e2e::cluster();
            let runtime = tokio::runtime::Runtime::new().context("failed to start a runtime")?;
            runtime.block_on(churn::run(&args, cluster))
        }
        Command::Unselected(args) => {
            let cluster = e2e::cluster();
            let runtime = tokio::runtime::Runtime::new().context("failed to start a runtime")?;
            runtime.block_on(unselected::run(&args, cluster))
        }
        Command::Assign(args) => {
            let cluster = e2e::cluster();
            let runtime = tokio::runtime::Runtime::new().context("failed to start a runtime")?;
            runtime.block_on(assign::run(&args, cluster))
        }
        // Starts its servers' and its clients' runtimes itself.
        Command::Webhook(args) => webhook::run(&args),
    }
}
