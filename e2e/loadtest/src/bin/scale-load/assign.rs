//! `scale-load assign`: how soon a ring without a webhook (`assignment: Watch`) labels a new
//! object, and what that costs the sharder.
//!
//! A Watch ring over ConfigMaps selects one namespace and has `--shards` shard Leases, renewed by
//! the tool every 2 s (15 s duration) so no shard process runs; one sharder process runs. Once
//! the ring's first sync has finished and the sharder has settled, the tool creates ConfigMaps at
//! `--rate` per second for `--seconds`, each CREATE sent on schedule whatever the ones before it
//! still wait for. A watch of the namespace's ConfigMaps that carry the ring's shard label stamps
//! each object when its first labelled event arrives; an object's latency is that stamp minus the
//! moment its CREATE answered. Both stamps are taken in this process, on one clock.
//!
//! It reports the latency's percentiles, objects never labelled within `--tail` seconds after the
//! last CREATE, and the sharder's CPU time (utime + stime from `/proc/<pid>/stat`) over the
//! creation window and an idle window of the same length right after: the difference divided by
//! the objects is the cost per assignment. The machine's load average is printed with it, since
//! the latency depends on what else runs.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use e2e::Cluster;
use e2e::fixtures::{create_lease, create_ring};
use e2e::renewals::{RenewalCounters, renew};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::runtime::watcher;
use kube_sharding_api::{Assignment, ClusterRing, ClusterRingSpec, RingResource, labels};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::progress;
use crate::samples::{cpu, start_settled_sharder};

/// Targets at 100 CREATEs per second (issue 25), in milliseconds from CREATE answered to label
/// seen.
const GOAL_P50_MS: f64 = 50.0;
const GOAL_P99_MS: f64 = 250.0;

/// Label the tool puts on the namespace its ring selects, valued with the ring's name.
const SELECTED_LABEL: &str = "scale-load.sharding.timebertt.dev/ring";

/// Flags of `scale-load assign`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// CREATEs per second.
    #[arg(long, default_value_t = 100)]
    rate: u32,
    /// Seconds of creating.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Shard Leases of the ring.
    #[arg(long, default_value_t = 3)]
    shards: usize,
    /// Seconds the sharder is left alone after the ring's first sync before anything is
    /// measured.
    #[arg(long, default_value_t = 5)]
    settle: u64,
    /// Seconds the tool waits after the last CREATE for the last labels.
    #[arg(long, default_value_t = 10)]
    tail: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// The whole report.
#[derive(Debug, Serialize)]
struct Report {
    rate: u32,
    objects: usize,
    shards: usize,
    /// CREATEs per second the tool achieved.
    creates_per_second: f64,
    /// Objects whose label was seen.
    labelled: usize,
    /// Latency from CREATE answered to label seen, in milliseconds.
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// Objects whose label was seen before their CREATE answered (counted as 0 ms).
    labelled_before_answer: usize,
    /// Length of each CPU window, in seconds.
    window_seconds: f64,
    /// Sharder CPU seconds in the creation window and in the idle window.
    creation_cpu_seconds: f64,
    idle_cpu_seconds: f64,
    /// Sharder CPU per object, in milliseconds, with the idle window subtracted.
    cpu_ms_per_object: f64,
    /// `/proc/loadavg`'s 1, 5 and 15 minute averages at the end of the creation window.
    load_average: String,
}

/// When each object was answered and when its label was seen, by name.
#[derive(Debug, Default)]
struct Stamps {
    created: HashMap<String, Instant>,
    labelled: HashMap<String, Instant>,
}

/// Runs the measurement and prints the report.
pub(crate) async fn run(args: &Args, cluster: &Cluster) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rate > 0 && args.seconds > 0 && args.shards > 0,
        "need a rate, seconds and shards"
    );
    let started = Instant::now();
    let client = cluster.client().await?;
    let ring = e2e::unique_name("assign");
    let namespace = e2e::unique_name("assign");
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some(namespace.clone()),
                    labels: Some(BTreeMap::from([(SELECTED_LABEL.into(), ring.clone())])),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;
    let spec = ClusterRingSpec {
        resources: vec![RingResource::new("", "configmaps")],
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(SELECTED_LABEL.to_string(), ring.clone())])),
            match_expressions: None,
        }),
        assignment: Some(Assignment::Watch),
        ..ClusterRingSpec::default()
    };
    create_ring(&client, &ring, spec).await?;
    let shards: Vec<String> = (0..args.shards).map(|i| format!("shard-{i}")).collect();
    for shard in &shards {
        create_lease(&client, &namespace, &ring, shard, 15).await?;
    }
    let stop = CancellationToken::new();
    let counters = Arc::new(RenewalCounters::default());
    let renewals = tokio::spawn({
        let (api, names, counters, stop) = (
            Api::<Lease>::namespaced(client.clone(), &namespace),
            shards.clone(),
            counters.clone(),
            stop.clone(),
        );
        async move { renew(api, names, Duration::from_secs(2), 4, &counters, stop).await }
    });

    let n = i32::try_from(shards.len())?;
    // No periodic sync within the run: every label comes from the watch.
    let (_files, mut sharder) =
        start_settled_sharder(cluster, &client, &ring, n, args.settle).await?;
    progress(started, "the sharder settled; creating");

    let stamps = Arc::new(Mutex::new(Stamps::default()));
    let key = labels::shard_label(&ring);
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), &namespace);
    let (watching, watched) = tokio::sync::oneshot::channel();
    let watch = tokio::spawn({
        let (api, stamps, key) = (configmaps.clone(), stamps.clone(), key.clone());
        async move {
            let mut events = std::pin::pin!(watcher(api, watcher::Config::default().labels(&key)));
            let mut watching = Some(watching);
            while let Some(event) = events.next().await {
                let now = Instant::now();
                match event {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = watching.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm)) => {
                        if let Ok(mut stamps) = stamps.lock() {
                            stamps.labelled.entry(cm.name_any()).or_insert(now);
                        }
                    }
                    Ok(_) => {}
                    Err(error) => eprintln!("watch: {error}"),
                }
            }
        }
    });
    watched
        .await
        .context("the watch of labelled objects ended")?;

    let objects = usize::try_from(u64::from(args.rate) * args.seconds)?;
    let cpu_before = cpu(&sharder)?;
    let t0 = Instant::now();
    let gap = Duration::from_secs(1).div_f64(f64::from(args.rate));
    let creates = futures::stream::iter(0..objects)
        .map(|i| {
            let (api, stamps) = (configmaps.clone(), stamps.clone());
            let at = tokio::time::Instant::from_std(t0 + gap.mul_f64(i as f64));
            async move {
                tokio::time::sleep_until(at).await;
                let name = format!("cm-{i:06}");
                let configmap = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                api.create(&PostParams::default(), &configmap).await?;
                let now = Instant::now();
                if let Ok(mut stamps) = stamps.lock() {
                    stamps.created.insert(name, now);
                }
                anyhow::Ok(())
            }
        })
        // Enough in flight that the schedule, not the answers, sets the pace.
        .buffer_unordered(1024)
        .collect::<Vec<_>>()
        .await;
    let creating = t0.elapsed();
    let load_average = std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    let failed = creates.iter().filter(|r| r.is_err()).count();
    anyhow::ensure!(failed == 0, "{failed} CREATEs failed");
    // Wait for the last labels, then measure an idle window as long as the creation window.
    let deadline = Instant::now() + Duration::from_secs(args.tail);
    while Instant::now() < deadline {
        let done = stamps
            .lock()
            .map(|s| s.labelled.len() >= objects)
            .unwrap_or(false);
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let window = t0.elapsed();
    let creation_cpu_seconds = cpu(&sharder)? - cpu_before;
    progress(
        started,
        &format!(
            "{objects} ConfigMaps created in {:.1} s; idle window",
            creating.as_secs_f64()
        ),
    );
    let idle_before = cpu(&sharder)?;
    tokio::time::sleep(window).await;
    let idle_cpu_seconds = cpu(&sharder)? - idle_before;
    watch.abort();

    let (mut latencies, early) = {
        let stamps = stamps
            .lock()
            .map_err(|_| anyhow::anyhow!("stamps poisoned"))?;
        let mut early = 0;
        let latencies: Vec<f64> = stamps
            .created
            .iter()
            .filter_map(|(name, created)| {
                let labelled = stamps.labelled.get(name)?;
                if labelled < created {
                    early += 1;
                }
                Some(labelled.saturating_duration_since(*created).as_secs_f64() * 1000.0)
            })
            .collect();
        (latencies, early)
    };
    latencies.sort_by(f64::total_cmp);
    let report = Report {
        rate: args.rate,
        objects,
        shards: args.shards,
        creates_per_second: objects as f64 / creating.as_secs_f64(),
        labelled: latencies.len(),
        p50_ms: percentile(&latencies, 0.50),
        p90_ms: percentile(&latencies, 0.90),
        p99_ms: percentile(&latencies, 0.99),
        max_ms: latencies.last().copied().unwrap_or(f64::NAN),
        labelled_before_answer: early,
        window_seconds: window.as_secs_f64(),
        creation_cpu_seconds,
        idle_cpu_seconds,
        cpu_ms_per_object: (creation_cpu_seconds - idle_cpu_seconds) * 1000.0 / objects as f64,
        load_average,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report));
    }

    stop.cancel();
    renewals.await?;
    if counters.failures() > 0 {
        eprintln!("{} Lease renewals failed", counters.failures());
    }
    sharder.terminate()?;
    sharder.wait(Duration::from_secs(30)).await?;
    sharder.passed();
    Api::<ClusterRing>::all(client.clone())
        .delete(&ring, &DeleteParams::default())
        .await?;
    Api::<Namespace>::all(client)
        .delete(&namespace, &DeleteParams::default())
        .await?;
    Ok(())
}

/// The value below which a share `q` of the sorted `values` lies (nearest rank).
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The report as text, next to the targets.
fn text(report: &Report) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} ConfigMaps at {} CREATEs/s (achieved {:.0}/s) in a Watch ring of {} shards",
        report.objects, report.rate, report.creates_per_second, report.shards
    );
    let _ = writeln!(
        out,
        "labelled: {} of {} ({} seen before their CREATE answered)",
        report.labelled, report.objects, report.labelled_before_answer
    );
    let _ = writeln!(
        out,
        "CREATE answered → label seen: p50 {:.1} ms (target ≤ {GOAL_P50_MS}), p90 {:.1} ms, p99 {:.1} ms (target ≤ {GOAL_P99_MS}), max {:.1} ms",
        report.p50_ms, report.p90_ms, report.p99_ms, report.max_ms
    );
    let _ = writeln!(
        out,
        "sharder CPU: {:.2} s in {:.1} s while creating, {:.2} s idle; {:.3} ms per object",
        report.creation_cpu_seconds,
        report.window_seconds,
        report.idle_cpu_seconds,
        report.cpu_ms_per_object
    );
    let _ = writeln!(out, "load average: {}", report.load_average);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 0.50), 50.0);
        assert_eq!(percentile(&values, 0.99), 99.0);
        assert_eq!(percentile(&values[..1], 0.99), 1.0);
        assert!(percentile(&[], 0.5).is_nan());
    }
}
