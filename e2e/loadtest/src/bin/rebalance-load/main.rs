//! `rebalance-load`: what scaling a ring of many objects from 3 to 4 shards costs.
//!
//! Against a real API server, with a real `sharder` process and real `checksum-controller`
//! shards, for `--objects` Secrets (each with the checksum ConfigMap its shard writes):
//!
//! 1. **convergence**: the time from starting the 4th shard until every Secret and ConfigMap
//!    carries the shard the 4-shard ring (`kube_sharder::core::hash_ring::Ring`, key `/Secret/<ns>/<name>`)
//!    predicts and no drain label is left. Placements are followed with metadata-only watches, so
//!    the time is that of the watch event that completed convergence (which then has to hold for
//!    `--settle` seconds), and measuring does not load the API server with repeated lists;
//! 2. **patches**: the sharder's `controller_sharding_drains_total` and
//!    `controller_sharding_movements_total` per resource against the minimum, one drain per moved
//!    Secret and one move per moved ConfigMap (fewer moves when the new shard's own write already
//!    relabelled a ConfigMap);
//! 3. **handover gap**: for every moved Secret, from its old shard sending the drain
//!    acknowledgement to its new shard's first reconcile, from the shards' own log records
//!    (`handover`);
//! 4. **floor**: the time the same number of plain merge patches, each setting a label on one of
//!    the objects that moved, take with the sharder's `concurrentMoves` in flight, against the
//!    same server in the same run (`--floor-runs` times, median reported);
//! 5. **sharder memory**: `VmHWM` (peak RSS) and `VmRSS` of the sharder process from
//!    `/proc/<pid>/status`, each measured on a *fresh* sharder process right after its first full
//!    sync, once with `--small` objects in the ring and once with `--objects` (two sharder runs on
//!    the same growing namespace; the later one also carries out the scale-out). Beside it, the
//!    first page of the sync's list is requested twice: exactly as the sharder builds it, and with
//!    `limit=500&resourceVersion=0` as docs/protocol.md §9 describes, to show which pages the
//!    server returns.
//!
//! Without `KUBECONFIG` it starts the local control plane of the test harness, which stops when
//! the tool exits; with it, it uses that cluster, whose API server must reach the sharder's
//! webhook on this host's 127.0.0.1. The binaries it starts (`sharder`, `checksum-controller`)
//! must sit beside it: build with `cargo build --release --workspace --bins` and run
//! `target/release/rebalance-load`. Progress goes to stderr, the report to stdout.
//!
//! ```sh
//! cargo build --release --workspace --bins
//! target/release/rebalance-load --objects 10000 [--json]
//! ```
//!
//! | module | what |
//! |---|---|
//! | `main` | flags, the run and its phases |
//! | `handover` | the gap from each drain acknowledgement to the new shard's first reconcile |
//! | `objects` | creating the Secrets, the floor measurement |
//! | `placement` | following every object's placement until it converges |
//! | `probes` | the sharder and shard processes, their sync records, memory, metrics, list pages |
//! | `report` | the report, as JSON or text |
//! | `timeline` | objects per shard over the scale-out, as CSV and an SVG chart |
//!
//! The sharder's page size, end-of-sync record `event` and counter names are imported from the
//! `sharder` crate, so the tool follows when they change.

mod handover;
mod objects;
mod placement;
mod probes;
mod pulse;
mod report;
mod timeline;

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use clap::Parser;
use e2e::fixtures::{create_ring, ring_spec, wait_status, wait_webhook};
use e2e::process::Process;
use e2e::prometheus::{apiserver_metrics, label, samples, sum};
use e2e::sharder_process::{SharderFiles, SharderSettings};
use e2e::{Cluster, cluster, unique_name};
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, DeleteParams};
use kube_sharding_api::ClusterRing;
use kube_sharding_api::config::SharderController;

use crate::handover::{Percentiles, ShardLog, handover, reconcile_after_writes};
use crate::objects::{create_secrets, floor_run};
use crate::placement::{Kind, Tracker};
use crate::probes::{
    apiserver_profile, counters, memory, probe_pages, restart_sharder, start_shard, sync_records,
    wait_sync,
};
use crate::pulse::{Pulse, PulseReport};
use crate::report::{Counters, Duplicates, Floor, Goals, Phase, Report, ScaleOut, Writes};
use crate::timeline::Timeline;
use crate::timeline::secs;

/// Shards before the scale-out; the last one joins for it.
const SHARDS: [&str; 4] = ["shard-0", "shard-1", "shard-2", "shard-3"];

/// Prefix of the Secrets' names.
pub(crate) const SECRET_PREFIX: &str = "secret-";

/// Prefix the checksum-controller gives its ConfigMaps' names (a binary, so there is no constant to
/// import).
pub(crate) const CONFIG_MAP_PREFIX: &str = "checksums-";

/// Label the floor measurement sets.
pub(crate) const FLOOR_LABEL: &str = "load.sharding.timebertt.dev/floor";

/// How long the pulse writes before the scale-out starts.
const PULSE_LEAD: Duration = Duration::from_secs(2);

/// How often waits print progress.
pub(crate) const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// Measures rebalancing from 3 to 4 shards over many objects.
#[derive(Debug, Parser)]
#[command(name = "rebalance-load")]
struct Args {
    /// Secrets in the ring (each gets a ConfigMap from its shard).
    #[arg(long, default_value_t = 10_000)]
    objects: usize,
    /// Objects at the first memory measurement; no second phase when `--objects` is not larger.
    #[arg(long, default_value_t = 1000)]
    small: usize,
    /// Secrets created concurrently.
    #[arg(long, default_value_t = 50)]
    create_concurrency: usize,
    /// Repetitions of the floor measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    floor_runs: usize,
    /// Seconds the converged state must hold before it counts.
    #[arg(long, default_value_t = 10)]
    settle: u64,
    /// Seconds any single wait (creation, convergence, sync) may take.
    #[arg(long, default_value_t = 1800)]
    timeout: u64,
    /// Extra environment variable of the sharder process, `NAME=VALUE` (repeatable), e.g.
    /// `MALLOC_ARENA_MAX=1` to see how much of its memory is allocator arenas.
    #[arg(long, value_parser = parse_env)]
    sharder_env: Vec<(String, String)>,
    /// Write the objects per shard during the scale-out to `<PREFIX>.csv` and draw them as a line
    /// chart in `<PREFIX>.svg`.
    #[arg(long, value_name = "PREFIX")]
    timeline: Option<PathBuf>,
    /// Milliseconds between two samples of the timeline.
    #[arg(long, default_value_t = 500)]
    sample_every: u64,
    /// Run the shards with `--leave-children-to-sharder`: ConfigMaps then follow their Secret
    /// only by the sharder's moves, as with shards that never relabel what they own. Their
    /// Leases say so, and the sharder (with its default configuration) moves each ConfigMap as its
    /// Secret's drain is acknowledged.
    #[arg(long)]
    leave_children_to_sharder: bool,
    /// Extra argument of every checksum-controller shard (repeatable), e.g.
    /// `--shard-arg=--max-concurrent-reconciles=8`.
    #[arg(long, allow_hyphen_values = true)]
    shard_arg: Vec<String>,
    /// The sharder's `controller.sharder.concurrentMoves` (drain and move patches in flight per
    /// ring; the floor measurement uses as many); default: the sharder's default.
    #[arg(long, default_value_t = SharderController::default().concurrent_moves,
          value_parser = clap::value_parser!(u32).range(1..))]
    concurrent_moves: u32,
    /// Patch one Secret outside the ring, one write at a time, from 2 s before the scale-out
    /// until it converged, and report what its writes and their watch events waited for
    /// (see `pulse.rs`).
    #[arg(long)]
    pulse: bool,
    /// Write a CPU profile of the API server, taken from the 4th shard's start for
    /// `--apiserver-profile-seconds`, to this file (read it with `go tool pprof`).
    #[arg(long, value_name = "FILE")]
    apiserver_profile: Option<PathBuf>,
    /// Seconds the API server's CPU profile covers.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=60))]
    apiserver_profile_seconds: u64,
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
    anyhow::ensure!(
        args.objects > 0 && args.small > 0,
        "--objects and --small must be positive"
    );
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

async fn run(args: &Args, cluster: &Cluster) -> anyhow::Result<Report> {
    let started = Instant::now();
    let client = cluster.client().await?;
    let server_version = client.apiserver_version().await?.git_version;
    let namespace = cluster.namespace(&client, "load").await?;
    let ring = unique_name("load");
    let pulse_namespace = if args.pulse {
        Some(cluster.namespace(&client, "pulse").await?)
    } else {
        None
    };
    let logs = e2e::process::log_dir()?;
    progress(
        started,
        &format!(
            "namespace {namespace}, ring {ring}, process logs in {}",
            logs.display()
        ),
    );
    let result = measure(
        args,
        cluster,
        &client,
        (&namespace, pulse_namespace.as_deref()),
        &ring,
        started,
    )
    .await;
    // A local control plane goes away with this process; on an external cluster, clean up.
    if cluster.state_dir().is_none() {
        let _ = Api::<ClusterRing>::all(client.clone())
            .delete(&ring, &DeleteParams::default())
            .await;
        for namespace in std::iter::once(&namespace).chain(&pulse_namespace) {
            let _ = Api::<Namespace>::all(client.clone())
                .delete(namespace, &DeleteParams::default())
                .await;
        }
    }
    let (phases, scale_out, floor, concurrent_moves, timeline) =
        result.with_context(|| format!("process logs are in {}", logs.display()))?;
    let mut timeline_files = Vec::new();
    if let Some(prefix) = &args.timeline {
        for (extension, text) in [("csv", timeline.csv()), ("svg", timeline.svg())] {
            let mut path = prefix.clone().into_os_string();
            path.push(format!(".{extension}"));
            let path = PathBuf::from(path);
            std::fs::write(&path, text)
                .with_context(|| format!("failed to write {}", path.display()))?;
            timeline_files.push(path.display().to_string());
        }
    }
    Ok(Report {
        objects: args.objects,
        server_version,
        profile: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        concurrent_moves,
        sharder_env: args
            .sharder_env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect(),
        logs: logs.display().to_string(),
        phases,
        scale_out,
        floor,
        goals: Goals::for_objects(args.objects),
        timeline_files,
    })
}

async fn measure(
    args: &Args,
    cluster: &Cluster,
    client: &Client,
    (namespace, pulse_namespace): (&str, Option<&str>),
    ring: &str,
    started: Instant,
) -> anyhow::Result<(Vec<Phase>, ScaleOut, Floor, usize, Timeline)> {
    let timeout = Duration::from_secs(args.timeout);
    let settle = Duration::from_secs(args.settle);
    let files = SharderFiles::create(
        cluster.kubeconfig(),
        &SharderSettings {
            // Production timing: the machine is busy, short leases would flap.
            leader_election: (15, 10, 2),
            sync_period: "5m".into(),
            concurrent_moves: args.concurrent_moves,
            // With `--leave-children-to-sharder` the shards' Leases say so; nothing to set here.
            ..Default::default()
        },
    )?;
    let concurrency = usize::try_from(files.load()?.controller.sharder.concurrent_moves)?;
    let mut sharder = restart_sharder(None, &files, &args.sharder_env).await?;
    create_ring(client, ring, ring_spec(namespace)).await?;

    let three = &SHARDS[..3];
    let mut shards = Vec::new();
    for shard in three {
        shards.push(start_shard(
            ring,
            namespace,
            shard,
            args.leave_children_to_sharder,
            &args.shard_arg,
        )?);
    }
    wait_status(client, ring, 3, 3).await?;
    wait_webhook(client, namespace, ring, three).await?;
    progress(started, "sharder and 3 shards running");
    let tracker = Tracker::start(client, namespace, ring);

    let mut sizes = vec![args.small.min(args.objects)];
    if args.objects > args.small {
        sizes.push(args.objects);
    }
    let mut phases = Vec::new();
    let mut created = 0;
    for size in sizes {
        let phase_started = Instant::now();
        tracker.set_target(three, size);
        create_secrets(
            client,
            namespace,
            created..size,
            args.create_concurrency,
            started,
        )
        .await?;
        let create_seconds = secs(phase_started.elapsed());
        created = size;
        tracker
            .wait_settled(
                &format!("{size} Secrets and ConfigMaps on 3 shards"),
                Duration::ZERO,
                timeout,
                started,
            )
            .await?;
        let placed_seconds = secs(phase_started.elapsed());
        progress(
            started,
            &format!("{size} Secrets and ConfigMaps placed; restarting the sharder"),
        );
        // A fresh sharder syncs the ring once at start: its peak is that of one full sync.
        sharder = restart_sharder(Some(sharder), &files, &args.sharder_env).await?;
        let sync = wait_sync(&sharder, ring, 0, timeout).await?;
        let sample = memory(&sharder)?;
        progress(
            started,
            &format!(
                "fresh sharder synced {} objects in {}: VmHWM {} KiB, VmRSS {} KiB",
                sync.listed, sync.duration, sample.vm_hwm_kib, sample.vm_rss_kib
            ),
        );
        let pages = probe_pages(client).await?;
        phases.push(Phase {
            objects: size,
            create_seconds,
            placed_seconds,
            sharder: sample,
            sync,
            pages,
        });
    }

    // Scale out.
    let count = args.objects;
    let before = tracker.snapshot();
    let counters_before = counters(&files, ring)?;
    let syncs_before = sync_records(&sharder, ring).len();
    let relists_before = tracker.lock().relists;
    let server_before = apiserver_metrics(client).await?;
    let sharder_before = files.metrics()?;
    tracker.set_target(&SHARDS, count);
    let predicted_moves = tracker.lock().target.as_ref().map_or(0, |t| t.bad.len()) / 2;
    progress(
        started,
        &format!(
            "starting {}: {predicted_moves} Secrets and their ConfigMaps should move",
            SHARDS[3]
        ),
    );
    let pulse = match pulse_namespace {
        Some(pulse_namespace) => {
            let pulse = Pulse::start(client, pulse_namespace).await?;
            tokio::time::sleep(PULSE_LEAD).await;
            Some(pulse)
        }
        None => None,
    };
    let profile = args.apiserver_profile.as_ref().map(|_| {
        let (client, seconds) = (client.clone(), args.apiserver_profile_seconds);
        tokio::spawn(async move { apiserver_profile(&client, seconds).await })
    });
    let t0 = Instant::now();
    let t0_wall = SystemTime::now();
    let sampler = tracker.sample(&SHARDS, t0, Duration::from_millis(args.sample_every.max(1)));
    shards.push(start_shard(
        ring,
        namespace,
        SHARDS[3],
        args.leave_children_to_sharder,
        &args.shard_arg,
    )?);
    wait_status(client, ring, 4, 4).await?;
    let available = t0.elapsed();
    progress(started, "4 shards available");
    let converged_at = tracker
        .wait_settled(
            &format!("{count} Secrets and ConfigMaps on 4 shards"),
            settle,
            timeout,
            started,
        )
        .await?;
    let converged = converged_at.saturating_duration_since(t0);
    // The pulse ran inside the window of the write counts: its create and its patches.
    let (pulse, pulse_writes) = match pulse {
        Some(pulse) => {
            let run = pulse.stop().await;
            let own = vec![("POST secrets", 1.0), ("PATCH secrets", run.writes as f64)];
            (Some(PulseReport::of(&run.beats, t0, converged_at)), own)
        }
        None => (None, Vec::new()),
    };
    let apiserver_profile = match (profile, &args.apiserver_profile) {
        (Some(profile), Some(path)) => {
            let bytes = profile.await.context("the profile's task failed")??;
            std::fs::write(path, bytes)
                .with_context(|| format!("failed to write {}", path.display()))?;
            Some(path.display().to_string())
        }
        _ => None,
    };
    let secrets_converged = tracker
        .lock()
        .target
        .as_ref()
        .and_then(|t| t.secrets_good_since)
        .map(|at| secs(at.saturating_duration_since(t0)));
    let window = t0.elapsed();
    let server_after = apiserver_metrics(client).await?;
    let sharder_after_text = files.metrics()?;
    let timeline = Timeline {
        shards: SHARDS.iter().map(|s| (*s).to_string()).collect(),
        objects: count,
        converged_secs: Some(secs(converged)),
        samples: sampler.finish(),
    };
    progress(
        started,
        &format!("converged after {:.2} s", converged.as_secs_f64()),
    );
    wait_sync(&sharder, ring, syncs_before, timeout).await?;
    let after_counters = counters(&files, ring)?;
    let counters = Counters {
        secret_drains: after_counters.secret_drains - counters_before.secret_drains,
        secret_moves: after_counters.secret_moves - counters_before.secret_moves,
        configmap_drains: after_counters.configmap_drains - counters_before.configmap_drains,
        configmap_moves: after_counters.configmap_moves - counters_before.configmap_moves,
    };
    let syncs = sync_records(&sharder, ring)
        .into_iter()
        .skip(syncs_before)
        .collect();
    let sharder_after = memory(&sharder)?;
    let after = tracker.snapshot();
    let moved: Vec<(Kind, String)> = after
        .iter()
        .filter(|(key, shard)| before.get(*key) != Some(*shard))
        .map(|(key, _)| key.clone())
        .collect();
    let only_new_shard_gained = moved
        .iter()
        .all(|key| after.get(key).and_then(Option::as_deref) == Some(SHARDS[3]));
    let moved_of = |kind: Kind| moved.iter().filter(|(k, _)| *k == kind).count();
    let (changes, relists) = tracker.changes();
    let handover = handover(&shard_logs(&shards), &changes, namespace, t0_wall);
    let webhook = |suffix: &str| {
        let metric = format!("{WEBHOOK_DURATION}_{suffix}");
        let labels = [("operation", "UPDATE"), ("type", "admit")];
        sum(&server_after, &metric, &labels) - sum(&server_before, &metric, &labels)
    };
    let inside = |suffix: &str| {
        let metric = format!("{SHARDER_WEBHOOK_DURATION}_{suffix}");
        sum(&sharder_after_text, &metric, &[]) - sum(&sharder_before, &metric, &[])
    };
    let sharder_webhook_requests = inside("count");
    let sharder_webhook_mean_ms = if sharder_webhook_requests > 0.0 {
        (inside("sum") / sharder_webhook_requests * 1e6).round() / 1000.0
    } else {
        0.0
    };
    let webhook_updates = webhook("count");
    let webhook_update_mean_ms = if webhook_updates > 0.0 {
        (webhook("sum") / webhook_updates * 1e5).round() / 100.0
    } else {
        0.0
    };
    let mut duplicates = Duplicates {
        watch_relists: relists - relists_before,
        sharder_secret_patches: sharder_requests(&sharder_before, &sharder_after_text, "secrets"),
        sharder_configmap_patches: sharder_requests(
            &sharder_before,
            &sharder_after_text,
            "configmaps",
        ),
        ..Duplicates::default()
    };
    let mut twice: Vec<_> = changes
        .iter()
        .filter(|(_, c)| c.drains > 1 || c.relabels > 1)
        .collect();
    twice.sort_by(|a, b| a.0.cmp(b.0));
    for ((kind, _), c) in &twice {
        match kind {
            Kind::Secret => {
                duplicates.secrets_drained_twice += usize::from(c.drains > 1);
                duplicates.secrets_relabelled_twice += usize::from(c.relabels > 1);
            }
            Kind::ConfigMap => duplicates.configmaps_relabelled_twice += 1,
        }
    }
    duplicates.examples = twice
        .iter()
        .take(10)
        .map(|((kind, name), c)| {
            format!(
                "{kind:?}/{name}: {} drains, {} relabels",
                c.drains, c.relabels
            )
        })
        .collect();
    let writes = writes(
        &server_before,
        &server_after,
        &sharder_before,
        &sharder_after_text,
        window,
        &pulse_writes,
    );
    let scale_out = ScaleOut {
        available_seconds: secs(available),
        converged_seconds: secs(converged),
        secrets_converged_seconds: secrets_converged,
        children_left_to_sharder: args.leave_children_to_sharder,
        patch_conflicts: ["secrets", "configmaps"]
            .iter()
            .map(|resource| {
                let labels = [("code", "409"), ("verb", "PATCH"), ("resource", *resource)];
                sum(&server_after, APISERVER_REQUESTS, &labels)
                    - sum(&server_before, APISERVER_REQUESTS, &labels)
            })
            .sum(),
        predicted_moves,
        moved_secrets: moved_of(Kind::Secret),
        moved_configmaps: moved_of(Kind::ConfigMap),
        only_new_shard_gained,
        counters,
        syncs,
        transitions: tracker.transitions(),
        sharder_after,
        duplicates,
        writes,
        handover,
        webhook_updates,
        webhook_update_mean_ms,
        sharder_webhook_requests,
        sharder_webhook_mean_ms,
        pulse,
        apiserver_profile,
    };
    drop(tracker);

    // The floor: the same number of plain label patches on the same objects.
    let mut runs = Vec::new();
    let mut failed = 0;
    let mut delivery = Vec::new();
    let mut secret_writes = Vec::new();
    for run in 0..args.floor_runs.max(1) {
        // Let the shards finish reacting to the previous run's updates.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let floor = floor_run(client, namespace, &moved, concurrency, &run.to_string()).await;
        let (took, run_failed) = (floor.took, floor.failed);
        delivery.extend(floor.delivery_ms);
        secret_writes.extend(floor.secret_writes);
        progress(
            started,
            &format!(
                "floor run {}: {} patches in {:.2} s",
                run + 1,
                moved.len(),
                took.as_secs_f64()
            ),
        );
        runs.push(took);
        failed += run_failed;
    }
    // Each run but the last was followed by 5 s in which the shards reconciled its patches; give
    // the last one time too before reading their logs.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut sorted = runs.clone();
    sorted.sort();
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or_default();
    let floor = Floor {
        patches: moved.len(),
        concurrency,
        runs_seconds: runs.into_iter().map(secs).collect(),
        median_seconds: secs(median),
        failed,
        delivery_ms: Percentiles::of(delivery),
        reconcile_ms: reconcile_after_writes(&shard_logs(&shards), namespace, &secret_writes),
    };

    for shard in &shards {
        let _ = shard.terminate();
    }
    let _ = sharder.terminate();
    Ok((phases, scale_out, floor, concurrency, timeline))
}

/// The API server's histogram of admission webhook calls.
const WEBHOOK_DURATION: &str = "apiserver_admission_webhook_admission_duration_seconds";

/// The sharder's histogram of its webhook's answers.
const SHARDER_WEBHOOK_DURATION: &str = "controller_sharding_webhook_request_duration_seconds";

/// The API server's counter of served requests.
const APISERVER_REQUESTS: &str = "apiserver_request_total";

/// The sharder's counter of requests it sent.
const SHARDER_REQUESTS: &str = "controller_sharding_api_requests_total";

/// The API server's mutating verbs (`APPLY` is a server-side apply PATCH).
const MUTATING_SERVER_VERBS: [&str; 6] = [
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

/// The sharder's mutating verbs, as its request counter names them.
const MUTATING_SHARDER_VERBS: [&str; 4] = ["create", "update", "patch", "delete"];

/// PATCH requests the sharder sent on `resource` between two of its `/metrics` texts.
fn sharder_requests(before: &str, after: &str, resource: &str) -> f64 {
    let labels = [("verb", "patch"), ("resource", resource)];
    sum(after, SHARDER_REQUESTS, &labels) - sum(before, SHARDER_REQUESTS, &labels)
}

/// Mutating requests between two pairs of `/metrics` texts: the API server's and the sharder's.
/// `own` are the tool's own writes in the window by `verb resource` (the pulse's), which are
/// not the cluster's work: they are left out of the API server's counts.
fn writes(
    server_before: &str,
    server_after: &str,
    sharder_before: &str,
    sharder_after: &str,
    window: Duration,
    own: &[(&str, f64)],
) -> Writes {
    let mut server = delta_by(server_before, server_after, APISERVER_REQUESTS, |labels| {
        let verb = label(labels, "verb");
        MUTATING_SERVER_VERBS.contains(&verb).then(|| {
            let (resource, sub) = (label(labels, "resource"), label(labels, "subresource"));
            if sub.is_empty() {
                format!("{verb} {resource}")
            } else {
                format!("{verb} {resource}/{sub}")
            }
        })
    });
    let sharder = delta_by(sharder_before, sharder_after, SHARDER_REQUESTS, |labels| {
        let verb = label(labels, "verb");
        MUTATING_SHARDER_VERBS.contains(&verb).then(|| {
            format!(
                "{} {verb} {}",
                label(labels, "client"),
                label(labels, "resource")
            )
        })
    });
    for (kind, n) in own {
        if let Some((_, count)) = server.iter_mut().find(|(k, _)| k == kind) {
            *count = (*count - n).max(0.0);
        }
    }
    server.retain(|(_, n)| *n > 0.0);
    server.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total = |kinds: &[(String, f64)]| kinds.iter().map(|(_, n)| n).sum::<f64>();
    let (apiserver, sharder_total) = (total(&server), total(&sharder));
    Writes {
        window_seconds: secs(window),
        own_left_out: own.iter().map(|(_, n)| n).sum(),
        apiserver,
        apiserver_by_kind: server,
        sharder: sharder_total,
        sharder_by_kind: sharder,
        sharder_share_percent: if apiserver > 0.0 {
            (sharder_total / apiserver * 1000.0).round() / 10.0
        } else {
            0.0
        },
    }
}

/// The increase of `metric` between two texts, summed per key that `key` derives from a sample's
/// labels (samples it maps to `None` are left out), largest first, zeros dropped.
fn delta_by(
    before: &str,
    after: &str,
    metric: &str,
    key: impl Fn(&str) -> Option<String>,
) -> Vec<(String, f64)> {
    let totals = |text: &str| {
        let mut totals: BTreeMap<String, f64> = BTreeMap::new();
        for (labels, value) in samples(text, metric) {
            if let Some(k) = key(&labels) {
                *totals.entry(k).or_default() += value;
            }
        }
        totals
    };
    let before = totals(before);
    let mut delta: Vec<(String, f64)> = totals(after)
        .into_iter()
        .map(|(k, v)| {
            let d = v - before.get(&k).copied().unwrap_or_default();
            (k, d)
        })
        .filter(|(_, d)| *d > 0.0)
        .collect();
    delta.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    delta
}

/// The shards' parsed logs so far, by shard name.
fn shard_logs(shards: &[Process]) -> Vec<(String, ShardLog)> {
    SHARDS
        .iter()
        .zip(shards)
        .map(|(name, process)| ((*name).to_string(), ShardLog::parse(&process.records())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_count_mutating_requests_of_the_window() {
        let server_before = "\
apiserver_request_total{code=\"200\",resource=\"secrets\",subresource=\"\",verb=\"PATCH\"} 10
apiserver_request_total{code=\"200\",resource=\"secrets\",subresource=\"\",verb=\"LIST\"} 5
";
        let server_after = "\
apiserver_request_total{code=\"200\",resource=\"secrets\",subresource=\"\",verb=\"PATCH\"} 90
apiserver_request_total{code=\"409\",resource=\"secrets\",subresource=\"\",verb=\"PATCH\"} 10
apiserver_request_total{code=\"200\",resource=\"secrets\",subresource=\"\",verb=\"LIST\"} 50
apiserver_request_total{code=\"201\",resource=\"configmaps\",subresource=\"\",verb=\"APPLY\"} 100
apiserver_request_total{code=\"200\",resource=\"clusterrings\",subresource=\"status\",verb=\"PUT\"} 0
";
        let sharder_before = "\
controller_sharding_api_requests_total{client=\"main\",verb=\"patch\",resource=\"secrets\"} 5
";
        let sharder_after = "\
controller_sharding_api_requests_total{client=\"main\",verb=\"patch\",resource=\"secrets\"} 55
controller_sharding_api_requests_total{client=\"main\",verb=\"list\",resource=\"secrets\"} 7
controller_sharding_api_requests_total{client=\"leader_election\",verb=\"update\",resource=\"leases\"} 2
";
        let counted = |own: &[(&str, f64)]| {
            writes(
                server_before,
                server_after,
                sharder_before,
                sharder_after,
                Duration::from_secs(3),
                own,
            )
        };
        let w = counted(&[]);
        assert_eq!(w.apiserver, 190.0);
        assert_eq!(
            w.apiserver_by_kind,
            vec![
                ("APPLY configmaps".to_string(), 100.0),
                ("PATCH secrets".to_string(), 90.0)
            ]
        );
        assert_eq!(w.sharder, 52.0);
        assert_eq!(
            w.sharder_by_kind[0],
            ("main patch secrets".to_string(), 50.0)
        );
        assert_eq!(w.sharder_share_percent, 27.4);
        assert_eq!(
            sharder_requests(sharder_before, sharder_after, "secrets"),
            50.0
        );
        // The tool's own 85 PATCHes of Secrets come off the API server's count.
        let w = counted(&[("PATCH secrets", 85.0)]);
        assert_eq!(w.apiserver, 105.0);
        assert_eq!(w.own_left_out, 85.0);
        assert_eq!(
            w.apiserver_by_kind,
            vec![
                ("APPLY configmaps".to_string(), 100.0),
                ("PATCH secrets".to_string(), 5.0)
            ]
        );
        assert_eq!(w.sharder_share_percent, 49.5);
    }
}
