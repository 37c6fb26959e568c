//! `scale-load unselected`: what objects of namespaces no ring selects cost the sharder.
//!
//! A ring over ConfigMaps selects `--selected` namespaces (by a label the tool sets) and has three
//! shard Leases, held by the tool for an hour; one sharder process runs. Once the ring's first
//! sync has finished and the sharder has settled, the tool creates `--objects` ConfigMaps in a
//! namespace the ring does not select, `--writers` at a time. The webhook is never called for
//! them (its configuration selects the ring's namespaces only), so whatever the sharder spends
//! meanwhile it spends on watch events it has no use for. The tool reports the sharder's CPU time
//! (utime + stime from `/proc/<pid>/stat`) over the creation window, which ends `--tail` seconds
//! after the last CREATE so that events still in flight count, and over an idle window of the
//! same length right after; the difference divided by the objects is the cost per CREATE.
//!
//! It also reports the watches on ConfigMaps the sharder holds, as the API server counts them by
//! scope (`apiserver_longrunning_requests`, before the sharder started and once it settled), and
//! the CPU time the sharder took from its start until it settled and its RSS then: with `--selected 50` and
//! `--other-namespaces 100` (so that 50 namespaces are at most half of all) they show what a watch
//! per namespace costs next to one across the cluster.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use e2e::Cluster;
use e2e::fixtures::{create_lease, create_ring};
use e2e::process::rss_kib;
use e2e::prometheus::{apiserver_metrics, sum};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::Client;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube_sharding_api::{ClusterRing, ClusterRingSpec, RingResource};
use serde::Serialize;

use crate::progress;
use crate::samples::{cpu, start_settled_sharder};

/// The goal per CREATE in a namespace no ring selects (issue 24), in milliseconds of sharder CPU.
const GOAL_MS_PER_CREATE: f64 = 0.01;

/// Label the tool puts on the namespaces its ring selects, valued with the ring's name.
const SELECTED_LABEL: &str = "scale-load.sharding.timebertt.dev/ring";

/// Shards of the ring.
const SHARDS: [&str; 3] = ["shard-0", "shard-1", "shard-2"];

/// The sharder's request counter, as exposed.
const API_REQUESTS: &str = "controller_sharding_api_requests_total";

/// Flags of `scale-load unselected`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// ConfigMaps created in the namespace the ring does not select.
    #[arg(long, default_value_t = 10_000)]
    objects: usize,
    /// Namespaces the ring selects.
    #[arg(long, default_value_t = 1)]
    selected: usize,
    /// Further empty namespaces the ring does not select.
    #[arg(long, default_value_t = 0)]
    other_namespaces: usize,
    /// CREATEs in flight at most.
    #[arg(long, default_value_t = 32)]
    writers: usize,
    /// Seconds the sharder is left alone after the ring's first sync before anything is
    /// measured.
    #[arg(long, default_value_t = 10)]
    settle: u64,
    /// Seconds the creation window goes on after the last CREATE.
    #[arg(long, default_value_t = 2)]
    tail: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// The whole report.
#[derive(Debug, Serialize)]
struct Report {
    objects: usize,
    selected_namespaces: usize,
    /// Namespaces in the cluster once the tool created its own.
    all_namespaces: usize,
    /// Watches on ConfigMaps the sharder added, by scope (`cluster`, `namespace`), as the API
    /// server counts them.
    sharder_watches: BTreeMap<String, f64>,
    /// CPU seconds the sharder used from its start until it settled.
    settled_cpu_seconds: f64,
    /// The sharder's resident set size once it settled, in MiB.
    settled_rss_mib: f64,
    /// Length of each window, in seconds.
    window_seconds: f64,
    /// CREATEs per second the tool achieved.
    creates_per_second: f64,
    /// Sharder CPU seconds in the creation window.
    creation_cpu_seconds: f64,
    /// Sharder CPU seconds in the idle window.
    idle_cpu_seconds: f64,
    /// Sharder CPU per CREATE, in milliseconds, without and with the idle window subtracted.
    raw_ms_per_create: f64,
    net_ms_per_create: f64,
    /// Requests the sharder sent in the creation window, by `client,verb,resource`.
    sharder_requests: Vec<(String, f64)>,
}

/// Runs the measurement and prints the report.
pub(crate) async fn run(args: &Args, cluster: &Cluster) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.objects > 0 && args.selected > 0,
        "need objects and a selected namespace"
    );
    let started = Instant::now();
    let client = cluster.client().await?;
    let ring = e2e::unique_name("unselected");

    // The namespaces: those the ring selects (the Leases live in the first), the one the
    // ConfigMaps go to, and the empty others.
    let mut selected = Vec::new();
    for i in 0..args.selected {
        selected.push(create_namespace(&client, &format!("selected-{i}"), Some(&ring)).await?);
    }
    let unselected = create_namespace(&client, "unselected", None).await?;
    let mut others = Vec::new();
    for i in 0..args.other_namespaces {
        others.push(create_namespace(&client, &format!("other-{i}"), None).await?);
    }
    let all_namespaces = Api::<Namespace>::all(client.clone())
        .list_metadata(&Default::default())
        .await?
        .items
        .len();
    progress(
        started,
        &format!("{} selected namespaces of {all_namespaces}", selected.len()),
    );

    let spec = ClusterRingSpec {
        resources: vec![RingResource::new("", "configmaps")],
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(SELECTED_LABEL.to_string(), ring.clone())])),
            match_expressions: None,
        }),
        hash_key: None,
        lease_namespaces: Vec::new(),
        assignment: None,
    };
    create_ring(&client, &ring, spec).await?;
    for shard in SHARDS {
        create_lease(&client, &selected[0], &ring, shard, 3600).await?;
    }

    let watches_before = configmap_watches(&client).await?;
    let shards = i32::try_from(SHARDS.len())?;
    let (files, mut sharder) =
        start_settled_sharder(cluster, &client, &ring, shards, args.settle).await?;
    let settled_cpu_seconds = cpu(&sharder)?;
    let settled_rss_mib = rss_kib(sharder.id().context("the sharder exited")?)? as f64 / 1024.0;
    let watches_after = configmap_watches(&client).await?;
    let sharder_watches = watches_after
        .iter()
        .map(|(scope, n)| {
            let was = watches_before.get(scope).copied().unwrap_or_default();
            (scope.clone(), n - was)
        })
        .collect();
    progress(started, "the sharder settled; creating");

    let metrics_before = files.metrics()?;
    let cpu_before = cpu(&sharder)?;
    let t0 = Instant::now();
    create_configmaps(&client, &unselected, args.objects, args.writers).await?;
    let creating = t0.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(args.tail)).await;
    let window = t0.elapsed();
    let creation_cpu_seconds = cpu(&sharder)? - cpu_before;
    let metrics_after = files.metrics()?;
    progress(
        started,
        &format!(
            "{} ConfigMaps created in {creating:.1} s; idle window of {:.1} s",
            args.objects,
            window.as_secs_f64()
        ),
    );

    let idle_before = cpu(&sharder)?;
    tokio::time::sleep(window).await;
    let idle_cpu_seconds = cpu(&sharder)? - idle_before;

    let objects = args.objects as f64;
    let report = Report {
        objects: args.objects,
        selected_namespaces: selected.len(),
        all_namespaces,
        sharder_watches,
        settled_cpu_seconds,
        settled_rss_mib,
        window_seconds: window.as_secs_f64(),
        creates_per_second: objects / creating,
        creation_cpu_seconds,
        idle_cpu_seconds,
        raw_ms_per_create: creation_cpu_seconds * 1000.0 / objects,
        net_ms_per_create: (creation_cpu_seconds - idle_cpu_seconds) * 1000.0 / objects,
        sharder_requests: request_delta(&metrics_before, &metrics_after),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report));
    }

    sharder.terminate()?;
    sharder.wait(Duration::from_secs(30)).await?;
    sharder.passed();
    Api::<ClusterRing>::all(client.clone())
        .delete(&ring, &DeleteParams::default())
        .await?;
    let namespaces = Api::<Namespace>::all(client);
    for ns in selected.iter().chain([&unselected]).chain(&others) {
        namespaces.delete(ns, &DeleteParams::default()).await?;
    }
    Ok(())
}

/// Creates a namespace named after `prefix`, selected by ring `ring` when given.
async fn create_namespace(
    client: &Client,
    prefix: &str,
    ring: Option<&str>,
) -> anyhow::Result<String> {
    let name = e2e::unique_name(prefix);
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: ring.map(|r| BTreeMap::from([(SELECTED_LABEL.to_string(), r.to_string())])),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .with_context(|| format!("failed to create namespace {name}"))?;
    Ok(name)
}

/// Creates ConfigMaps `cm-00000` … in `namespace`, `writers` at a time.
async fn create_configmaps(
    client: &Client,
    namespace: &str,
    count: usize,
    writers: usize,
) -> anyhow::Result<()> {
    let api = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            async move {
                let configmap = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(format!("cm-{i:05}")),
                        ..Default::default()
                    },
                    data: Some(BTreeMap::from([("key".to_string(), "value".to_string())])),
                    ..Default::default()
                };
                api.create(&PostParams::default(), &configmap).await
            }
        })
        .buffer_unordered(writers.max(1))
        .try_for_each(|_| async { Ok(()) })
        .await
        .context("failed to create a ConfigMap")
}

/// Watches on ConfigMaps the API server holds now, by scope.
async fn configmap_watches(client: &Client) -> anyhow::Result<BTreeMap<String, f64>> {
    let metrics = apiserver_metrics(client).await?;
    Ok(["cluster", "namespace"]
        .into_iter()
        .map(|scope| {
            let n = sum(
                &metrics,
                "apiserver_longrunning_requests",
                &[
                    ("verb", "WATCH"),
                    ("resource", "configmaps"),
                    ("scope", scope),
                ],
            );
            (scope.to_string(), n)
        })
        .collect())
}

/// The sharder's requests between two `/metrics` texts, by label text, those that moved only.
fn request_delta(before: &str, after: &str) -> Vec<(String, f64)> {
    let old = e2e::prometheus::samples(before, API_REQUESTS);
    e2e::prometheus::samples(after, API_REQUESTS)
        .into_iter()
        .map(|(labels, value)| {
            let was = old
                .iter()
                .find(|(l, _)| *l == labels)
                .map_or(0.0, |(_, v)| *v);
            (labels, value - was)
        })
        .filter(|(_, n)| *n > 0.0)
        .collect()
}

/// The report as text, next to the goal.
fn text(report: &Report) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} ConfigMaps created in a namespace no ring selects; the ring selects {} of {} namespaces",
        report.objects, report.selected_namespaces, report.all_namespaces
    );
    let watches: Vec<String> = report
        .sharder_watches
        .iter()
        .map(|(scope, n)| format!("{n} {scope}-scoped"))
        .collect();
    let _ = writeln!(
        out,
        "sharder's watches on ConfigMaps: {}; from its start until settled: CPU {:.2} s, RSS \
         {:.1} MiB",
        watches.join(", "),
        report.settled_cpu_seconds,
        report.settled_rss_mib
    );
    let _ = writeln!(
        out,
        "windows of {:.1} s; {:.0} CREATEs/s",
        report.window_seconds, report.creates_per_second
    );
    let _ = writeln!(
        out,
        "sharder CPU: {:.2} s while creating, {:.2} s idle",
        report.creation_cpu_seconds, report.idle_cpu_seconds
    );
    let _ = writeln!(
        out,
        "per CREATE: {:.4} ms, {:.4} ms without the idle baseline (goal ≤ {GOAL_MS_PER_CREATE} ms)",
        report.raw_ms_per_create, report.net_ms_per_create
    );
    let _ = writeln!(out, "sharder's requests while creating:");
    for (labels, n) in &report.sharder_requests {
        let _ = writeln!(out, "  {n:>6} {labels}");
    }
    out
}
