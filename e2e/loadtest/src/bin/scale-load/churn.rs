//! `scale-load churn`: the sharder's memory and CPU while a ring's objects are created, changed
//! and deleted at a steady rate (issue 24, part 5).
//!
//! One ClusterRing over Secrets that control ConfigMaps (the rings the end-to-end tests use), in
//! one namespace, with three shard Leases the tool renews itself every 2 s: no shard processes.
//! The tool fills the ring with `--objects` objects, pairs of a Secret and a ConfigMap it controls,
//! while the sharder assigns them through its webhook, as a long-running sharder would (with
//! `--fresh`, a new sharder takes over after the fill and its first sync lists every object).
//! After `--warmup` seconds of churn it measures `--window` seconds of it: `--rate` requests a
//! second, a third updates (a data change of a Secret or ConfigMap), a third deletes pairs and a
//! third creates pairs, so the count stays where it was. The sharder runs with the shipped
//! configuration's secure metrics (HTTPS behind TokenReview), though nothing scrapes it. Every second it samples the sharder's
//! `VmRSS`, `VmHWM` and threads from `/proc/<pid>/status`; its CPU is utime + stime over the
//! window. With `--sharder` it runs another build of the sharder, for a "before" beside an
//! "after" from one session.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use e2e::Cluster;
use e2e::fixtures::{create_lease, create_ring, ring_spec, wait_status, wait_webhook};
use e2e::process::{Process, binary, status_fields};
use e2e::renewals::{RenewalCounters, renew};
use e2e::sharder_process::{SharderFiles, SharderSettings};
use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PostParams};
use kube_sharder::records::EVENT_SYNC_FINISHED;
use kube_sharding_api::{ClusterRing, RingKind, RingRef};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::progress;
use crate::samples::cpu_seconds;

/// The goal under churn at 9,000 objects (issue 24, part 5), in MiB of the sharder's RSS.
const GOAL_RSS_MIB: f64 = 30.0;

/// Shards of the ring.
const SHARDS: [&str; 3] = ["shard-0", "shard-1", "shard-2"];

/// Renewal period and duration of the shard Leases: the shard library's defaults.
const RENEW_PERIOD: Duration = Duration::from_secs(2);
const LEASE_DURATION_SECONDS: i32 = 15;

/// Requests of the churn in flight at most: far above what 155 a second need on loopback, so the
/// rate is the schedule's and not the API server's latency.
const CHURN_IN_FLIGHT: usize = 64;

/// Flags of `scale-load churn`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Objects of the ring: half Secrets, half ConfigMaps each controlled by one of them.
    #[arg(long, default_value_t = 9000)]
    objects: usize,
    /// Requests of the churn per second: a third updates, a third deletes, a third creates.
    #[arg(long, default_value_t = 155.0)]
    rate: f64,
    /// Length of the measured churn, e.g. `60s` or `2m`.
    #[arg(long, default_value = "60s", value_parser = parse_seconds)]
    window: Duration,
    /// Churn before the window, after the fresh sharder's first sync, e.g. `10s`.
    #[arg(long, default_value = "10s", value_parser = parse_seconds)]
    warmup: Duration,
    /// Start a fresh sharder after the fill and measure it instead of the one that assigned the
    /// objects.
    #[arg(long)]
    fresh: bool,
    /// CREATEs in flight while filling the ring.
    #[arg(long, default_value_t = 50)]
    writers: usize,
    /// The sharder executable to measure; default: the `sharder` next to this tool.
    #[arg(long)]
    sharder: Option<PathBuf>,
    /// Environment variables for the sharder (`NAME=value`, repeatable), e.g.
    /// `MALLOC_ARENA_MAX=1` to see how much of its memory is allocator arenas.
    #[arg(long = "sharder-env", value_parser = parse_env)]
    sharder_env: Vec<(String, String)>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Parses `60s`, `2m` or a bare number of seconds.
fn parse_seconds(value: &str) -> Result<Duration, String> {
    let (number, unit) = match value.strip_suffix('m') {
        Some(minutes) => (minutes, 60.0),
        None => (value.strip_suffix('s').unwrap_or(value), 1.0),
    };
    number
        .parse::<f64>()
        .ok()
        .filter(|n| n.is_finite() && *n >= 0.0)
        .map(|n| Duration::from_secs_f64(n * unit))
        .ok_or_else(|| format!("expected a duration such as 60s or 2m, got {value:?}"))
}

/// Parses `NAME=value`.
fn parse_env(value: &str) -> Result<(String, String), String> {
    value
        .split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected NAME=value, got {value:?}"))
}

/// The whole report.
#[derive(Debug, Serialize)]
struct Report {
    /// The sharder executable measured.
    sharder: String,
    /// Its extra environment, `NAME=value`.
    sharder_env: Vec<String>,
    /// Objects of the ring after the fill, and at the end of the window.
    objects: usize,
    objects_after: usize,
    /// Seconds the fill took.
    fill_seconds: f64,
    /// The RSS and high-water mark of the sharder that assigned them, at the end of the fill, in
    /// MiB.
    filled_rss_mib: f64,
    filled_hwm_mib: f64,
    /// With `--fresh`: the objects the fresh sharder's first sync listed, how long it took, and
    /// its RSS and high-water mark right after, in MiB.
    fresh: Option<FreshSync>,
    window_seconds: f64,
    /// Churn requests per second the tool completed in the window, by kind, and those that failed.
    updates_per_second: f64,
    deletes_per_second: f64,
    creates_per_second: f64,
    failed_requests: u64,
    /// Objects created in the window whose CREATE came back without the shard label (the webhook
    /// was not reached; the sharder assigns them later).
    created_unassigned: u64,
    /// The sharder's RSS over the window's one-second samples, in MiB.
    rss_median_mib: f64,
    rss_max_mib: f64,
    /// Its `VmHWM` at the end of the window, in MiB: the peak over its whole life.
    hwm_mib: f64,
    /// Its threads at the end of the window.
    threads: u64,
    /// Its CPU time over the window, as a share of one core.
    cpu_share: f64,
    /// The 1-minute load average at the window's start and end.
    load_average: (f64, f64),
}

/// The first sync of a fresh sharder after the fill.
#[derive(Debug, Serialize)]
struct FreshSync {
    listed: u64,
    duration: String,
    rss_mib: f64,
    hwm_mib: f64,
}

/// What the tool tracks of the ring's objects: which pairs exist.
#[derive(Default)]
struct Pool {
    /// Pairs that exist, by index.
    live: Vec<usize>,
    /// Indexes free to be created again, oldest first.
    free: VecDeque<usize>,
    /// The next index never used.
    next: usize,
}

/// Counts of the churn.
#[derive(Default)]
struct Churned {
    updates: AtomicU64,
    deletes: AtomicU64,
    creates: AtomicU64,
    failed: AtomicU64,
    unassigned: AtomicU64,
}

impl Churned {
    fn read(&self) -> [u64; 5] {
        [
            &self.updates,
            &self.deletes,
            &self.creates,
            &self.failed,
            &self.unassigned,
        ]
        .map(|n| n.load(Ordering::Relaxed))
    }
}

/// The Secrets and ConfigMaps of the ring's namespace.
#[derive(Clone)]
struct Objects {
    secrets: Api<Secret>,
    configmaps: Api<ConfigMap>,
    /// The shard label of the ring.
    shard_label: String,
}

/// One action of the churn; pairs take two requests, one per object.
#[derive(Clone, Copy, Debug)]
enum Action {
    Update,
    Delete,
    Create,
}

/// The churn's cycle of six requests: two updates, a pair deleted, a pair created.
const CYCLE: [Action; 4] = [
    Action::Update,
    Action::Update,
    Action::Delete,
    Action::Create,
];

/// One sample of the sharder's `/proc/<pid>/status`.
#[derive(Clone, Copy, Debug)]
struct Memory {
    rss_kib: u64,
    hwm_kib: u64,
    threads: u64,
}

/// Runs the measurement and prints the report.
pub(crate) async fn run(args: &Args, cluster: &Cluster) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.objects >= 2 && args.rate > 0.0,
        "need at least one pair of objects and a positive rate"
    );
    let sharder_path = match &args.sharder {
        Some(path) => path.clone(),
        None => binary("sharder")?,
    };
    let started = Instant::now();
    let client = cluster.client().await?;
    let namespace = cluster.namespace(&client, "churn").await?;
    let ring = e2e::unique_name("churn");
    create_ring(&client, &ring, ring_spec(&namespace)).await?;
    for shard in SHARDS {
        create_lease(&client, &namespace, &ring, shard, LEASE_DURATION_SECONDS).await?;
    }
    let stop_renewals = CancellationToken::new();
    let renewal_counters = Arc::new(RenewalCounters::default());
    let renewer = tokio::spawn({
        let api = Api::<Lease>::namespaced(client.clone(), &namespace);
        let names = SHARDS.map(str::to_string).to_vec();
        let (counters, stop) = (renewal_counters.clone(), stop_renewals.clone());
        async move { renew(api, names, RENEW_PERIOD, 4, &counters, stop).await }
    });

    let files = SharderFiles::create(
        cluster.kubeconfig(),
        &SharderSettings {
            // Production timing: the machine is busy, short leases would flap.
            leader_election: (15, 10, 2),
            metrics_secure: true,
            ..SharderSettings::default()
        },
    )?;
    let mut sharder = start_sharder(&files, &sharder_path, &args.sharder_env).await?;
    let shards = i32::try_from(SHARDS.len())?;
    wait_status(&client, &ring, shards, shards).await?;
    wait_webhook(&client, &namespace, &ring, &SHARDS).await?;
    progress(started, "sharder ready, 3 shards available; filling");

    let objects = Objects {
        secrets: Api::namespaced(client.clone(), &namespace),
        configmaps: Api::namespaced(client.clone(), &namespace),
        shard_label: RingRef::new(RingKind::ClusterRing, &ring).shard_label(),
    };
    let pairs = args.objects / 2;
    let fill_started = Instant::now();
    let filled = Churned::default();
    futures::stream::iter(0..pairs)
        .map(|i| {
            let (objects, filled) = (&objects, &filled);
            async move {
                create_pair(objects, i, filled).await;
                let n = i + 1;
                if n % 5000 == 0 {
                    progress(started, &format!("about {} objects created", 2 * n));
                }
            }
        })
        .buffer_unordered(args.writers.max(1))
        .collect::<()>()
        .await;
    let fill_seconds = fill_started.elapsed().as_secs_f64();
    let [.., fill_failed, _] = filled.read();
    anyhow::ensure!(fill_failed == 0, "{fill_failed} CREATEs of the fill failed");
    let pool = Mutex::new(Pool {
        live: (0..pairs).collect(),
        free: VecDeque::new(),
        next: pairs,
    });
    let filled = memory(sharder.id().context("the sharder exited")?)?;
    progress(
        started,
        &format!(
            "{} objects in {fill_seconds:.1} s; sharder RSS {:.1} MiB",
            2 * pairs,
            mib(filled.rss_kib)
        ),
    );

    let mut fresh = None;
    if args.fresh {
        sharder.terminate()?;
        sharder.wait(Duration::from_secs(30)).await?;
        sharder = start_sharder(&files, &sharder_path, &args.sharder_env).await?;
        let sync = sharder
            .wait_for_record(
                "the fresh sharder's first sync",
                Duration::from_secs(600),
                |r| r["event"] == EVENT_SYNC_FINISHED,
            )
            .await?;
        let synced = memory(sharder.id().context("the sharder exited")?)?;
        let sync = FreshSync {
            listed: sync["listed"].as_u64().unwrap_or_default(),
            duration: sync["duration"].as_str().unwrap_or_default().to_string(),
            rss_mib: mib(synced.rss_kib),
            hwm_mib: mib(synced.hwm_kib),
        };
        progress(
            started,
            &format!(
                "fresh sharder synced {} objects in {}",
                sync.listed, sync.duration
            ),
        );
        fresh = Some(sync);
    }
    let pid = sharder.id().context("the sharder exited")?;
    progress(started, "churning");

    // The churn runs through warm-up and window alike; only the window is measured.
    let churned = Arc::new(Churned::default());
    let stop_churn = CancellationToken::new();
    let churn = {
        let (objects, churned, stop) = (objects.clone(), churned.clone(), stop_churn.clone());
        let rate = args.rate;
        let pool = Arc::new(pool);
        tokio::spawn(async move { run_churn(&objects, &pool, rate, &churned, stop).await })
    };
    tokio::time::sleep(args.warmup).await;

    let load_before = load_average()?;
    let counts_before = churned.read();
    let cpu_before = cpu_seconds(pid)?;
    let t0 = Instant::now();
    let mut samples = Vec::new();
    let mut ticks = tokio::time::interval(Duration::from_secs(1));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while t0.elapsed() < args.window {
        ticks.tick().await;
        samples.push(memory(pid)?);
    }
    let window = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid)? - cpu_before;
    let counts_after = churned.read();
    let last = memory(pid)?;
    let load_after = load_average()?;
    stop_churn.cancel();
    let pool = churn.await.context("the churn panicked")?;
    progress(started, "window done");

    let delta = |i: usize| counts_after[i] - counts_before[i];
    let mut rss: Vec<f64> = samples.iter().map(|m| mib(m.rss_kib)).collect();
    rss.sort_by(f64::total_cmp);
    let report = Report {
        sharder: sharder_path.display().to_string(),
        sharder_env: args
            .sharder_env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect(),
        objects: 2 * pairs,
        objects_after: 2 * pool.live.len(),
        fill_seconds,
        filled_rss_mib: mib(filled.rss_kib),
        filled_hwm_mib: mib(filled.hwm_kib),
        fresh,
        window_seconds: window,
        updates_per_second: delta(0) as f64 / window,
        deletes_per_second: delta(1) as f64 / window,
        creates_per_second: delta(2) as f64 / window,
        failed_requests: delta(3),
        created_unassigned: delta(4),
        rss_median_mib: median(&rss),
        rss_max_mib: rss.last().copied().unwrap_or_default(),
        hwm_mib: mib(last.hwm_kib),
        threads: last.threads,
        cpu_share: cpu / window,
        load_average: (load_before, load_after),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report));
    }

    sharder.terminate()?;
    sharder.wait(Duration::from_secs(30)).await?;
    stop_renewals.cancel();
    renewer.await.context("the renewals panicked")?;
    Api::<ClusterRing>::all(client.clone())
        .delete(&ring, &DeleteParams::default())
        .await?;
    Ok(())
}

/// Starts a sharder from `path` and waits until it is ready. Its log is kept only when the tool
/// fails.
async fn start_sharder(
    files: &SharderFiles,
    path: &Path,
    envs: &[(String, String)],
) -> anyhow::Result<Process> {
    let mut process = files.start_process_at(path, envs.iter().map(|(k, v)| (k, v)))?;
    process.passed();
    files.wait_ready(Duration::from_secs(120)).await?;
    Ok(process)
}

/// Creates pair `i`: Secret `s-<i>`, then ConfigMap `c-<i>` controlled by it.
async fn create_pair(objects: &Objects, i: usize, counts: &Churned) {
    let mut secret = e2e::fixtures::secret(&format!("s-{i}"));
    secret.data = Some(BTreeMap::from([(
        "value".to_string(),
        ByteString(format!("v{i}").into_bytes()),
    )]));
    let created = match objects
        .secrets
        .create(&PostParams::default(), &secret)
        .await
    {
        Ok(created) => created,
        Err(error) => {
            fail(counts, &format!("create Secret s-{i}"), &error);
            return;
        }
    };
    counts.creates.fetch_add(1, Ordering::Relaxed);
    note_assignment(objects, counts, created.labels());
    let configmap = ConfigMap {
        metadata: ObjectMeta {
            name: Some(format!("c-{i}")),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Secret".into(),
                name: created.name_any(),
                uid: created.uid().unwrap_or_default(),
                controller: Some(true),
                ..Default::default()
            }]),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("value".to_string(), format!("v{i}"))])),
        ..Default::default()
    };
    match objects
        .configmaps
        .create(&PostParams::default(), &configmap)
        .await
    {
        Ok(created) => {
            counts.creates.fetch_add(1, Ordering::Relaxed);
            note_assignment(objects, counts, created.labels());
        }
        Err(error) => fail(counts, &format!("create ConfigMap c-{i}"), &error),
    }
}

/// Counts an object the webhook did not label on CREATE.
fn note_assignment(objects: &Objects, counts: &Churned, labels: &BTreeMap<String, String>) {
    if !labels.contains_key(&objects.shard_label) {
        counts.unassigned.fetch_add(1, Ordering::Relaxed);
    }
}

/// Counts a failed request and says which.
fn fail(counts: &Churned, what: &str, error: &kube::Error) {
    counts.failed.fetch_add(1, Ordering::Relaxed);
    eprintln!("{what} failed: {error}");
}

/// Deletes pair `i`: the ConfigMap first, so that the garbage collector has nothing to do.
async fn delete_pair(objects: &Objects, i: usize, counts: &Churned) {
    let params = DeleteParams::default();
    for result in [
        objects
            .configmaps
            .delete(&format!("c-{i}"), &params)
            .await
            .map(drop),
        objects
            .secrets
            .delete(&format!("s-{i}"), &params)
            .await
            .map(drop),
    ] {
        match result {
            Ok(()) => {
                counts.deletes.fetch_add(1, Ordering::Relaxed);
            }
            Err(error) => fail(counts, &format!("delete pair {i}"), &error),
        }
    }
}

/// Changes the data of the Secret or the ConfigMap of pair `i`.
async fn update(objects: &Objects, i: usize, secret: bool, n: u64, counts: &Churned) {
    let value = format!("u{n}");
    let params = e2e::patch_params();
    let result = if secret {
        let patch = serde_json::json!({"data": {"value": ByteString(value.into_bytes())}});
        objects
            .secrets
            .patch(&format!("s-{i}"), &params, &Patch::Merge(&patch))
            .await
            .map(drop)
    } else {
        let patch = serde_json::json!({"data": {"value": value}});
        objects
            .configmaps
            .patch(&format!("c-{i}"), &params, &Patch::Merge(&patch))
            .await
            .map(drop)
    };
    match result {
        Ok(()) => {
            counts.updates.fetch_add(1, Ordering::Relaxed);
        }
        // The pair was picked for deletion meanwhile: not the API server's failure.
        Err(kube::Error::Api(status)) if status.code == 404 => {}
        Err(error) => fail(counts, &format!("update pair {i}"), &error),
    }
}

/// Churns at `rate` requests a second until `stop`; returns the pool as it ends.
async fn run_churn(
    objects: &Objects,
    pool: &Mutex<Pool>,
    rate: f64,
    counts: &Churned,
    stop: CancellationToken,
) -> Pool {
    let gap = Duration::from_secs_f64(1.0 / rate);
    let start = tokio::time::Instant::now();
    // Requests scheduled so far: a pair's action takes two request slots of the schedule.
    let mut requests = 0u64;
    let schedule = futures::stream::iter(0u64..).then(|n| {
        let action = CYCLE[(n % CYCLE.len() as u64) as usize];
        let at = start + gap.mul_f64(requests as f64);
        requests += match action {
            Action::Update => 1,
            Action::Delete | Action::Create => 2,
        };
        async move {
            tokio::time::sleep_until(at).await;
            (n, action)
        }
    });
    schedule
        .take_until(stop.cancelled())
        .map(|(n, action)| async move {
            match action {
                Action::Update => {
                    let picked = {
                        let pool = pool.lock().expect("the pool's lock");
                        pick(&pool.live, n).copied()
                    };
                    if let Some(i) = picked {
                        update(objects, i, n % 2 == 0, n, counts).await;
                    }
                }
                Action::Delete => {
                    let picked = {
                        let mut pool = pool.lock().expect("the pool's lock");
                        let len = pool.live.len();
                        (len > 0).then(|| pool.live.swap_remove(spread(n) % len))
                    };
                    if let Some(i) = picked {
                        delete_pair(objects, i, counts).await;
                        pool.lock().expect("the pool's lock").free.push_back(i);
                    }
                }
                Action::Create => {
                    let i = {
                        let mut pool = pool.lock().expect("the pool's lock");
                        match pool.free.pop_front() {
                            Some(i) => i,
                            None => {
                                pool.next += 1;
                                pool.next - 1
                            }
                        }
                    };
                    create_pair(objects, i, counts).await;
                    pool.lock().expect("the pool's lock").live.push(i);
                }
            }
        })
        .buffer_unordered(CHURN_IN_FLIGHT)
        .collect::<()>()
        .await;
    std::mem::take(&mut *pool.lock().expect("the pool's lock"))
}

/// Element `spread(n) % len` of `items`: a pick that looks random but repeats from run to run.
fn pick<T>(items: &[T], n: u64) -> Option<&T> {
    (!items.is_empty()).then(|| &items[spread(n) % items.len()])
}

/// `n` spread over the 64-bit range (the finaliser of SplitMix64).
fn spread(n: u64) -> usize {
    let mut z = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    // Truncation on 32-bit targets only shortens the range.
    (z ^ (z >> 31)) as usize
}

/// `VmRSS`, `VmHWM` and `Threads` of process `pid`.
fn memory(pid: u32) -> anyhow::Result<Memory> {
    let [rss_kib, hwm_kib, threads] = status_fields(pid, ["VmRSS", "VmHWM", "Threads"])?;
    Ok(Memory {
        rss_kib,
        hwm_kib,
        threads,
    })
}

/// The 1-minute load average.
fn load_average() -> anyhow::Result<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").context("failed to read /proc/loadavg")?;
    text.split_whitespace()
        .next()
        .context("empty /proc/loadavg")?
        .parse()
        .context("unexpected /proc/loadavg")
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Median of sorted `values`.
fn median(values: &[f64]) -> f64 {
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The report as text, next to the goal.
fn text(report: &Report) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "sharder: {}", report.sharder);
    if !report.sharder_env.is_empty() {
        let _ = writeln!(out, "sharder environment: {}", report.sharder_env.join(" "));
    }
    let _ = writeln!(
        out,
        "{} objects (filled in {:.1} s), {} at the end of the window",
        report.objects, report.fill_seconds, report.objects_after
    );
    let _ = writeln!(
        out,
        "sharder RSS at the end of the fill: {:.1} MiB (peak {:.1})",
        report.filled_rss_mib, report.filled_hwm_mib
    );
    if let Some(fresh) = &report.fresh {
        let _ = writeln!(
            out,
            "fresh sharder's first sync: {} objects in {}; RSS then {:.1} MiB (peak {:.1})",
            fresh.listed, fresh.duration, fresh.rss_mib, fresh.hwm_mib
        );
    }
    let _ = writeln!(
        out,
        "window of {:.1} s: {:.1} updates/s, {:.1} deletes/s, {:.1} creates/s, {} failed, {} \
         created without a shard label",
        report.window_seconds,
        report.updates_per_second,
        report.deletes_per_second,
        report.creates_per_second,
        report.failed_requests,
        report.created_unassigned
    );
    let _ = writeln!(
        out,
        "sharder RSS: median {:.1} MiB, max {:.1} MiB (goal ≤ {GOAL_RSS_MIB} MiB); VmHWM {:.1} \
         MiB; {} threads",
        report.rss_median_mib, report.rss_max_mib, report.hwm_mib, report.threads
    );
    let _ = writeln!(
        out,
        "sharder CPU: {:.3} of a core; load average {:.2} → {:.2}",
        report.cpu_share, report.load_average.0, report.load_average.1
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_and_without_a_unit() {
        assert_eq!(parse_seconds("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_seconds("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_seconds("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_seconds("soon").is_err());
        assert!(parse_seconds("-1s").is_err());
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(&[1.0, 2.0, 3.0, 10.0]), 2.5);
        assert_eq!(median(&[1.0, 2.0, 30.0]), 2.0);
        assert_eq!(median(&[]), 0.0);
    }
}
