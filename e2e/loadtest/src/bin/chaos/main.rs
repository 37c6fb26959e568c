//! `chaos`: a soak under random faults that checks, from evidence, the product's promise: no
//! object is ever reconciled by two shards at once, and every object ends up on exactly one live
//! shard with nothing lost.
//!
//! It starts the local control plane of the test harness (or uses `KUBECONFIG`'s cluster), two
//! `sharder` replicas with leader election behind one webhook address, and three rings over
//! Secrets side by side, each in namespaces of its own and with `--shards`
//! `checksum-controller` shards of its own: one assigned by the sharder's webhook and one with
//! `spec.assignment: Watch` (no webhook: the sharder labels new objects from its watch,
//! docs/protocol.md §20), both over `--namespaces` namespaces with controlled ConfigMaps; and a
//! zero-write ring (`spec.assignment: ServerSide`, docs/zero-write-rings.md) over one namespace,
//! whose shards (`--server-side`) get hash ranges on their Leases and list and watch only those.
//! Then, for `--duration`, it:
//!
//! - **churns** each ring's Secrets: creates, updates and deletes `--rate` per second, a quarter
//!   of the creates with a `generateName` ConfigMap the Secret controls, beside a few Secrets
//!   pinned to shards the faults strike and a pinned namespace (docs/protocol.md §21);
//! - **injects faults** from a plan drawn from `--seed` (printed at start; pass it to replay the
//!   plan): SIGKILL and SIGTERM of shards, scale-out and scale-in, SIGKILL and SIGTERM of the
//!   leading and of the other sharder replica, a SIGSTOP of a shard long enough for the sharder to
//!   take its Lease over, a kube-apiserver restart, a webhook outage, hostile and damaged shard
//!   Leases, a skewed clock. A fault on shards strikes each ring with a victim of its own.
//!
//! Then it ends every fault, brings each ring's shards back to `--shards`, waits for
//! convergence and checks four invariants, the first three per ring:
//!
//! 1. exclusive ownership, from the shards' reconcile, drain and Lease log records, the Lease
//!    holder changes its own watch saw and the signals it sent (`ownership`); in the zero-write
//!    ring, from the shards' records of work and release: no Secret held by two processes at
//!    overlapping times;
//! 2. convergence, against a hash ring computed here from the protocol alone (`ring`) and the
//!    pins (`pins`: a pin decides while its shard is available), within a bound derived from the
//!    Lease durations (`convergence`); in the zero-write ring, the published and acknowledged
//!    ranges against `RangeRing` and each checksum ConfigMap written by the owner of its
//!    Secret's uid;
//! 3. nothing lost: checksums right, no ConfigMap of a deleted Secret left (`convergence`);
//! 4. no leaks: sharder RSS and the API server's open watches back to the same order as before,
//!    no process ended that the tool did not end (`probes`, `exits`).
//!
//! The report (text, or `--json`) lists faults by kind, memory and watches, and per ring its
//! churn, convergence time after the last fault, per-shard reconcile counts and violations; the
//! exit status is non-zero when there is any violation, in the whole system or in any ring.
//! Progress goes to stderr, the report to stdout. The binaries it starts must sit beside it
//! (`cargo build --workspace --bins`).
//!
//! ```sh
//! cargo build --workspace --bins
//! target/debug/chaos --duration 30m [--seed N] [--json]
//! ```
//!
//! | module | what |
//! |---|---|
//! | `main` | flags, setting up and cleaning up a run |
//! | `soak` | the phases of a run |
//! | `plan` | the seeded generator and the fault plan |
//! | `fleet` | sharder replicas and shards as processes, their supervisor, the webhook gate |
//! | `faults` | carrying out the plan |
//! | `churn` | creating, updating and deleting Secrets |
//! | `leases`, `versions`, `stalls` | the tool's own records: shard Lease holders, Secret versions, API server stalls |
//! | `evidence` | reading a shard's JSON log |
//! | `ownership` | invariant 1 |
//! | `ring` | the independent hash ring, label keys and shard availability |
//! | `pins` | the pins the tool sets, and the placement they predict |
//! | `convergence` | invariants 2 and 3 |
//! | `probes`, `exits` | invariant 4 |
//! | `report` | the report |

mod churn;
mod convergence;
mod evidence;
mod exits;
mod faults;
mod findings;
mod fleet;
mod leases;
mod ownership;
mod pins;
mod plan;
mod probes;
mod report;
mod ring;
mod soak;
mod stalls;
mod versions;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use e2e::{Cluster, cluster, unique_name};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams};
use kube_sharding_api::{Assignment, ClusterRing};

use crate::plan::{FaultKind, PlanTiming, round_ms};
use crate::report::Report;
use crate::ring::LabelKeys;
use crate::soak::{RingScene, Scene, soak};

/// Soaks the sharder and its shards under random faults and checks their invariants.
#[derive(Debug, Parser)]
#[command(name = "chaos")]
struct Args {
    /// How long faults are injected and Secrets churned: `90s`, `30m`, `1h`.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    duration: Duration,
    /// Seed of the fault plan and the churn; drawn at random (and printed) when unset.
    #[arg(long)]
    seed: Option<u64>,
    /// Churn operations (create, update or delete a Secret) per second, in each ring.
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Shards of each ring at the start, and again once the faults are over.
    #[arg(long, default_value_t = 3)]
    shards: usize,
    /// Namespaces of each ring.
    #[arg(long, default_value_t = 3)]
    namespaces: usize,
    /// Live Secrets the churn keeps around in each ring (between half and one and a half of it).
    #[arg(long, default_value_t = 100)]
    objects: usize,
    /// Mean time between faults.
    #[arg(long, default_value = "6s", value_parser = parse_duration)]
    fault_interval: Duration,
    /// Lease duration of the shards; their renew deadline and retry period keep the protocol's
    /// proportions (2/3 and 2/15 of it, renewing at least every second).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    lease_duration: Duration,
    /// How long the converged state must hold before it counts.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    settle: Duration,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Only print the fault plan the seed draws (as JSON) and exit, without starting anything.
    #[arg(long)]
    plan_only: bool,
    /// The first ring's shards (the one assigned by the webhook) leave their ConfigMaps to the
    /// sharder (`checksum-controller --leave-children-to-sharder`, which says so on their Leases),
    /// so that the sharder syncs that ring children first and moves the ConfigMaps itself; the
    /// other ring's shards relabel theirs, as without the flag.
    #[arg(long)]
    leave_children_to_sharder: bool,
}

/// `90`, `90s`, `30m`, `1h`, `1.5m`.
fn parse_duration(value: &str) -> Result<Duration, String> {
    let (number, unit) = match value.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => value.split_at(i),
        None => (value, "s"),
    };
    let number: f64 = number
        .trim()
        .parse()
        .map_err(|e| format!("not a duration {value:?}: {e}"))?;
    let seconds = match unit {
        "s" => number,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        _ => return Err(format!("unknown unit {unit:?} in {value:?}; use s, m or h")),
    };
    Duration::try_from_secs_f64(seconds)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{value:?} is not a positive duration"))
}

/// When the tool started, for progress lines.
static STARTED: OnceLock<Instant> = OnceLock::new();

/// Prints a progress line to stderr, stamped with seconds since the start.
pub(crate) fn progress(message: &str) {
    let started = STARTED.get_or_init(Instant::now);
    eprintln!("[{:>7.1}s] {message}", started.elapsed().as_secs_f64());
}

/// Resolves on SIGTERM or SIGINT (never, if the handlers cannot be installed), naming it.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// A seed from the clock and the process id, for runs without `--seed`.
fn random_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    plan::Rng::new(nanos ^ u64::from(std::process::id()) << 32).next_u64() >> 1
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    STARTED.get_or_init(Instant::now);
    anyhow::ensure!(args.shards >= 2, "--shards must be at least 2");
    anyhow::ensure!(args.namespaces >= 1, "--namespaces must be at least 1");
    anyhow::ensure!(args.rate > 0.0, "--rate must be positive");
    let seed = args.seed.unwrap_or_else(random_seed);
    progress(&format!("seed {seed} (replay with --seed {seed})"));
    if args.plan_only {
        // Without knowing the cluster, the plan includes API server restarts, as it does for the
        // local control plane.
        let plan = plan::draw(seed, &plan_timing(&args), &FaultKind::ALL);
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Blocks on a runtime of its own: set the cluster up before entering ours.
    let cluster = cluster();
    let runtime = tokio::runtime::Runtime::new().context("failed to start a runtime")?;
    let report = runtime.block_on(async {
        tokio::select! {
            report = run(&args, seed, cluster) => report,
            signal = interrupted() => Err(anyhow::anyhow!("interrupted by {signal}")),
        }
    });
    // Dropping the runtime drops every task and with them the processes, which kill their
    // children; the control plane's watchdog stops it once this process is gone.
    drop(runtime);
    let report = report?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.text());
    }
    let violations = report.violation_count();
    if violations > 0 {
        anyhow::bail!("{violations} violation(s); replay with --seed {seed}");
    }
    Ok(())
}

async fn run(args: &Args, seed: u64, cluster: &Cluster) -> anyhow::Result<Report> {
    let started = Instant::now();
    let client = cluster.client().await?;
    let server_version = client.apiserver_version().await?.git_version;
    let mut rings = Vec::new();
    for (index, (prefix, assignment, shard_prefix, churn_stream)) in RINGS.into_iter().enumerate() {
        let leaves_children = args.leave_children_to_sharder && index == 0;
        let mut namespaces = Vec::new();
        // A zero-write shard selects by hash range alone, so its controller watches one
        // namespace (`--namespace`), rather than every Secret of the cluster.
        let count = if assignment == Assignment::ServerSide {
            1
        } else {
            args.namespaces
        };
        for _ in 0..count {
            namespaces.push(cluster.namespace(&client, prefix).await?);
        }
        let lease_namespace = cluster
            .namespace(&client, &format!("{prefix}-leases"))
            .await?;
        let name = unique_name(prefix);
        progress(&format!(
            "{assignment:?} ring {name} over {namespaces:?}, Leases in {lease_namespace}{}",
            if leaves_children {
                ", shards leave their ConfigMaps to the sharder"
            } else {
                ""
            }
        ));
        rings.push(RingScene {
            leaves_children,
            keys: LabelKeys::for_ring(&name)?,
            name,
            assignment,
            namespaces,
            lease_namespace,
            shard_prefix,
            churn_stream,
        });
    }
    let logs = e2e::process::log_dir()?;
    progress(&format!("process logs in {}", logs.display()));
    let scene = Scene {
        args,
        seed,
        cluster,
        client: client.clone(),
        rings,
    };
    let result = soak(&scene).await;
    // A local control plane goes away with this process; on an external cluster, clean up.
    if cluster.state_dir().is_none() {
        for ring in &scene.rings {
            let _ = Api::<ClusterRing>::all(client.clone())
                .delete(&ring.name, &DeleteParams::default())
                .await;
            for ns in ring.namespaces.iter().chain([&ring.lease_namespace]) {
                let _ = Api::<Namespace>::all(client.clone())
                    .delete(ns, &DeleteParams::default())
                    .await;
            }
        }
    }
    let mut report = result.with_context(|| {
        format!(
            "the run failed (seed {seed}); process logs are in {}",
            logs.display()
        )
    })?;
    report.settings.server_version = server_version;
    report.seconds_total = round_ms(started.elapsed());
    Ok(report)
}

/// The rings under test: name prefix (of the ring and its namespaces), assignment, shard name
/// prefix, churn stream. The webhook ring keeps the names and churn of the single ring the soak
/// ran before (stream 2; the plan draws from stream 1), so a seed replays as it did then.
///
/// Both are ClusterRings. The kinds share the engine (docs/protocol.md §15) and differ only in
/// names, but the tool's independent derivations of label keys (`ring`), Lease labels (`leases`,
/// `convergence`, `faults`) and the shards' `--clusterring` flag are written for one kind;
/// mixing kinds would double those for no extra coverage of what is under test here, assignment
/// without a webhook under faults.
const RINGS: [(&str, Assignment, &str, u64); 3] = [
    ("chaos", Assignment::Webhook, "shard", 2),
    ("chaos-watch", Assignment::Watch, "watch", 3),
    ("chaos-zw", Assignment::ServerSide, "zw", 4),
];

/// What the fault plan's draws depend on besides the seed.
fn plan_timing(args: &Args) -> PlanTiming {
    PlanTiming {
        duration: args.duration,
        interval: args.fault_interval,
        shard_lease: args.lease_duration,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("45s"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("1.5m"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("soon").is_err());
    }
}
