//! `ring-compare`: a label ring against a zero-write ring (docs/zero-write-rings.md) on the same
//! Secrets, in one run, for a scale-out 3 → 4 and a scale-in 4 → 3.
//!
//! Against a real API server, with a real `sharder` process and real `checksum-controller`
//! shards. It creates `--objects` Secrets once and runs both modes over them, one after the
//! other, each with a fresh sharder process:
//!
//! 1. **label ring** (`assignment` unset: the webhook labels each Secret at its creation; the
//!    shards' ConfigMaps are controlled resources): three shards place the Secrets, a fourth
//!    joins, then one of the first three gets SIGTERM and releases its Lease;
//! 2. **zero-write ring** (`assignment: ServerSide`, uid hashing, the Secrets only; shards run
//!    with `--server-side`): the same three steps with shards of other names.
//!
//! Per rebalance it reports:
//!
//! - **writes**: the API server's `apiserver_request_total` of mutating verbs in the window, to
//!   Secrets (the ring's objects), to ConfigMaps (the shards' output), Leases and the rest;
//! - **time until every moved Secret was reconciled by its new shard**: from starting the new
//!   shard or sending SIGTERM to the last moved Secret's first finished reconcile (`applied` or
//!   `up_to_date`) in its new shard's log; the moved Secrets and their new shards are predicted
//!   (the label ring by `IndependentRing`, the zero-write ring by `RangeRing` over the uid
//!   hashes), so a wrong prediction shows as a timeout;
//! - **sharder CPU** (`utime + stime` of `/proc/<pid>/stat` over the window) and **memory**
//!   (`VmHWM`, `VmRSS`);
//! - **watch traffic about Secrets**: the API server's watch events and their bytes, the events
//!   its sharded watch filtered away, list requests and their bytes, all clients together; per
//!   shard, the reconciles it started in the window (each follows a list item or watch event it
//!   received) and a list of Secrets with its selector after the rebalance (the label selector
//!   or the `shardSelector` of its published ranges), as its own list receives it.
//!
//! The window of a rebalance ends when the moved Secrets are reconciled and the API server
//! counted no write to Secrets or ConfigMaps for `--settle` seconds. The shards use the binary's
//! default Lease timing (renewal every 2 s).
//!
//! Without `KUBECONFIG` it starts the local control plane of the test harness (with the
//! `ShardedListAndWatch` gate on where the server knows it). The binaries it starts must sit
//! beside it:
//!
//! ```sh
//! cargo build --release --workspace --bins
//! target/release/ring-compare --objects 10000 [--json]
//! ```
//!
//! | module | what |
//! |---|---|
//! | `main` | flags, the Secrets, the two modes in order |
//! | `logs` | the shards' logs, read incrementally |
//! | `probes` | `/proc` of the sharder, the API server's counters, lists with a shard's selector |
//! | `rebalance` | one mode's shards, its placement and the measurement of one rebalance |
//! | `report` | the report, as JSON or text |

mod logs;
mod probes;
mod rebalance;
mod report;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use e2e::fixtures::{create_ring, ring_spec, secret, wait_status, wait_webhook};
use e2e::process::{Process, poll_until};
use e2e::sharder_process::{SharderFiles, SharderSettings};
use e2e::{Cluster, cluster, unique_name};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::ranges::fnv1a64;
use kube_sharding_api::{Assignment, ClusterRing, ClusterRingSpec, RingKind, RingResource};

use crate::probes::{clock_ticks, cpu_seconds, memory_kib};
use crate::rebalance::{Bench, Change, Mode, TIMING};
use crate::report::{ModeReport, Report};

/// Compares a label ring with a zero-write ring on the same Secrets.
#[derive(Debug, Parser)]
#[command(name = "ring-compare")]
struct Args {
    /// Secrets in the ring (each gets a ConfigMap from its shard).
    #[arg(long, default_value_t = 10_000)]
    objects: usize,
    /// Secrets created concurrently.
    #[arg(long, default_value_t = 50)]
    create_concurrency: usize,
    /// Seconds without a write to Secrets or ConfigMaps that end a rebalance's window.
    #[arg(long, default_value_t = 5)]
    settle: u64,
    /// Seconds any single wait (creation, placement, a rebalance) may take.
    #[arg(long, default_value_t = 1800)]
    timeout: u64,
    /// Extra environment variable of the sharder process, `NAME=VALUE` (repeatable).
    #[arg(long, value_parser = parse_env)]
    sharder_env: Vec<(String, String)>,
    /// Extra argument of every checksum-controller shard of both modes (repeatable), e.g.
    /// `--shard-arg=--max-concurrent-reconciles=50`.
    #[arg(long, allow_hyphen_values = true)]
    shard_arg: Vec<String>,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    json: bool,
}

fn parse_env(value: &str) -> Result<(String, String), String> {
    value
        .split_once('=')
        .filter(|(name, _)| !name.is_empty())
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .ok_or_else(|| format!("expected NAME=VALUE, got {value:?}"))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.objects > 0, "--objects must be positive");
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Blocks on a runtime of its own: set the cluster up before entering ours.
    let cluster = cluster();
    let runtime = tokio::runtime::Runtime::new().context("failed to start a runtime")?;
    let report = runtime.block_on(run(&args, cluster))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

/// Prints a progress line to stderr.
pub(crate) fn progress(started: Instant, message: &str) {
    eprintln!("[{:>7.1}s] {message}", started.elapsed().as_secs_f64());
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_default();
    format!("{cpus} CPUs ({model})")
}

async fn run(args: &Args, cluster: &Cluster) -> anyhow::Result<Report> {
    let started = Instant::now();
    let started_utc = Timestamp::now().strftime("%Y-%m-%d %H:%M").to_string();
    let load_start = load_average();
    let client = cluster.client().await?;
    let server_version = client.apiserver_version().await?.git_version;
    let namespace = cluster.namespace(&client, "compare").await?;
    let logs = e2e::process::log_dir()?;
    progress(
        started,
        &format!("namespace {namespace}, process logs in {}", logs.display()),
    );
    let (create_seconds, modes) = measure(args, cluster, &client, &namespace, started)
        .await
        .with_context(|| format!("process logs are in {}", logs.display()))?;
    if cluster.state_dir().is_none() {
        let _ = Api::<Namespace>::all(client.clone())
            .delete(&namespace, &DeleteParams::default())
            .await;
    }
    Ok(Report {
        objects: args.objects,
        server_version,
        profile: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        started_utc,
        machine: machine(),
        load_average: [load_start, load_average()],
        shard_args: args.shard_arg.clone(),
        renewal_seconds: TIMING.2.parse().unwrap_or_default(),
        create_seconds,
        modes,
        logs: logs.display().to_string(),
    })
}

/// Starts a fresh sharder, ready once its caches synced.
async fn start_sharder(files: &SharderFiles, envs: &[(String, String)]) -> anyhow::Result<Process> {
    let mut process = Process::start_with_env(
        "sharder",
        [
            "--config".as_ref(),
            files.config.as_os_str(),
            "--log-format=json".as_ref(),
        ],
        envs.iter().map(|(k, v)| (k, v)),
    )?;
    process.passed();
    files.wait_ready(Duration::from_secs(60)).await?;
    Ok(process)
}

/// Creates the Secrets `secret-<i>` with one data key each; returns each one's name and the
/// hash of its uid.
async fn create_secrets(
    client: &Client,
    namespace: &str,
    count: usize,
    concurrency: usize,
    started: Instant,
) -> anyhow::Result<Vec<(String, u64)>> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let done = AtomicUsize::new(0);
    let mut secrets: Vec<(String, u64)> = futures::stream::iter(0..count)
        .map(|i| {
            let (api, done) = (&api, &done);
            async move {
                let mut s = secret(&format!("secret-{i}"));
                s.data = Some(BTreeMap::from([(
                    "value".to_string(),
                    ByteString(format!("v{i}").into_bytes()),
                )]));
                let mut attempt = 0;
                let created = loop {
                    attempt += 1;
                    match api.create(&PostParams::default(), &s).await {
                        Ok(created) => break created,
                        Err(error) if attempt < 5 => {
                            eprintln!("creating {} failed, retrying: {error}", s.name_any());
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(error) => {
                            return Err(anyhow::Error::new(error)
                                .context(format!("failed to create {}", s.name_any())));
                        }
                    }
                };
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                if n % 5000 == 0 || n == count {
                    progress(started, &format!("created {n}/{count} Secrets"));
                }
                let uid = created.uid().context("a Secret without uid")?;
                Ok((created.name_any(), fnv1a64(&uid)))
            }
        })
        .buffer_unordered(concurrency.max(1))
        .try_collect()
        .await?;
    secrets.sort();
    Ok(secrets)
}

/// The two modes, label ring first: its webhook labels the Secrets as they are created, so
/// neither mode needs a pass of writes before it starts.
async fn measure(
    args: &Args,
    cluster: &Cluster,
    client: &Client,
    namespace: &str,
    started: Instant,
) -> anyhow::Result<(f64, Vec<ModeReport>)> {
    let timeout = Duration::from_secs(args.timeout);
    let files = SharderFiles::create(
        cluster.kubeconfig(),
        &SharderSettings {
            // Production timing: the machine is busy, short leases would flap.
            leader_election: (15, 10, 2),
            ..Default::default()
        },
    )?;
    let ticks = clock_ticks();
    let mut modes = Vec::new();
    let mut secrets = Vec::new();
    let mut create_seconds = 0.0;
    for mode in [Mode::Label, Mode::ServerSide] {
        let mut sharder = start_sharder(&files, &args.sharder_env).await?;
        let ring = unique_name(match mode {
            Mode::Label => "cmp-label",
            Mode::ServerSide => "cmp-zw",
        });
        let spec = match mode {
            Mode::Label => ring_spec(namespace),
            Mode::ServerSide => ClusterRingSpec {
                resources: vec![RingResource::new("", "secrets")],
                assignment: Some(Assignment::ServerSide),
                ..ring_spec(namespace)
            },
        };
        create_ring(client, &ring, spec).await?;
        let mut bench = Bench {
            client,
            namespace,
            ring: ring.clone(),
            mode,
            secrets: Vec::new(),
            sharder: sharder.id().context("the sharder has exited")?,
            ticks,
            shard_args: args.shard_arg.clone(),
            shards: BTreeMap::new(),
            stopped: BTreeMap::new(),
            settle: Duration::from_secs(args.settle),
            timeout,
            started,
        };
        let three: Vec<String> = (0..3).map(|i| mode.shard(i)).collect();
        let since = Timestamp::now();
        let placing = Instant::now();
        for shard in &three {
            bench.start_shard(shard)?;
        }
        if mode == Mode::Label {
            wait_status(client, &ring, 3, 3).await?;
            let names: Vec<&str> = three.iter().map(String::as_str).collect();
            wait_webhook(client, namespace, &ring, &names).await?;
            progress(started, "label ring: sharder and 3 shards running");
            let creating = Instant::now();
            secrets = create_secrets(
                client,
                namespace,
                args.objects,
                args.create_concurrency,
                started,
            )
            .await?;
            create_seconds = creating.elapsed().as_secs_f64();
        }
        bench.secrets = secrets.clone();
        bench.wait_placed(since).await?;
        let placed_seconds = placing.elapsed().as_secs_f64();
        let (hwm, _) = memory_kib(bench.sharder)?;
        let placement_cpu = cpu_seconds(bench.sharder, ticks)?;
        progress(
            started,
            &format!(
                "{}: {} Secrets placed in {placed_seconds:.1} s",
                mode.name(),
                secrets.len()
            ),
        );
        let mut rebalances = Vec::new();
        for change in [Change::Join(mode.shard(3)), Change::Leave(mode.shard(1))] {
            let rebalance = bench.rebalance(change).await?;
            progress(
                started,
                &format!(
                    "{} {}: last moved Secret reconciled after {:.2} s, {} Secret writes",
                    mode.name(),
                    rebalance.change,
                    rebalance.reconciled_seconds,
                    rebalance.writes.secrets
                ),
            );
            rebalances.push(rebalance);
        }
        modes.push(ModeReport {
            mode: mode.name(),
            placed_seconds,
            sharder_cpu_seconds_placement: placement_cpu,
            sharder_vm_hwm_kib_placed: hwm,
            rebalances,
        });
        // The sharder goes first, so that the shards' goodbyes move nothing; then the ring,
        // whose webhook configuration the garbage collector removes with it.
        sharder.terminate()?;
        sharder.wait(Duration::from_secs(60)).await?;
        bench.stop().await;
        drop(bench);
        Api::<ClusterRing>::all(client.clone())
            .delete(&ring, &DeleteParams::default())
            .await?;
        let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
        let config = RingKind::ClusterRing.webhook_configuration_name(&ring);
        let gone = poll_until(
            "the ring's webhook configuration to go",
            Duration::from_secs(60),
            || {
                let (configs, config) = (configs.clone(), config.clone());
                async move { Ok(configs.get_opt(&config).await?.is_none().then_some(())) }
            },
        )
        .await;
        if let Err(error) = gone {
            progress(
                started,
                &format!("{error:#} (its failure policy is Ignore)"),
            );
        }
    }
    Ok((create_seconds, modes))
}
