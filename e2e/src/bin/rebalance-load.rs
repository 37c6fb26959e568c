//! `rebalance-load`: what scaling a ring of many objects from 3 to 4 shards costs.
//!
//! Against a real API server, with a real `sharder` process and real `checksum-controller`
//! shards, for `--objects` Secrets (each with the checksum ConfigMap its shard writes):
//!
//! 1. **convergence**: the time from starting the 4th shard until every Secret and ConfigMap
//!    carries the shard the 4-shard ring (`sharder::core::ring::Ring`, key `/Secret/<ns>/<name>`)
//!    predicts and no drain label is left. Placements are followed with metadata-only watches, so
//!    the time is that of the watch event that completed convergence (which then has to hold for
//!    `--settle` seconds), and measuring does not load the API server with repeated lists;
//! 2. **patches**: the sharder's `controller_sharding_drains_total` and
//!    `controller_sharding_movements_total` per resource against the minimum, one drain per moved
//!    Secret and one move per moved ConfigMap (fewer moves when the new shard's own write already
//!    relabelled a ConfigMap);
//! 3. **floor**: the time the same number of plain merge patches, each setting a label on one of
//!    the objects that moved, take with the sharder's `concurrentMoves` in flight, against the
//!    same server in the same run (`--floor-runs` times, median reported);
//! 4. **sharder memory**: `VmHWM` (peak RSS) and `VmRSS` of the sharder process from
//!    `/proc/<pid>/status`, each measured on a *fresh* sharder process right after its first full
//!    sync, once with `--small` objects in the ring and once with `--objects` (two sharder runs on
//!    the same growing namespace; the later one also carries out the scale-out). Beside it, the
//!    first page of the sync's list is requested twice: exactly as the sharder builds it, and with
//!    `limit=500&resourceVersion=0` as SPEC §9 describes, to show which pages the server returns.
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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Debug;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use e2e::fixtures::{
    ShardTiming, create_ring, ring_spec, secret, start_checksum_shard, wait_status, wait_webhook,
};
use e2e::process::{Process, poll_until};
use e2e::sharder::{SharderFiles, SharderSettings};
use e2e::{Cluster, cluster, unique_name};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use sharder::core::ring::Ring;
use sharding_crds::{ClusterRing, labels};
use tokio::task::JoinHandle;

/// Shards before the scale-out; the last one joins for it.
const SHARDS: [&str; 4] = ["shard-0", "shard-1", "shard-2", "shard-3"];

/// Prefix of the Secrets' names.
const SECRET_PREFIX: &str = "secret-";

/// Prefix the checksum-controller gives its ConfigMaps' names.
const CONFIG_MAP_PREFIX: &str = "checksums-";

/// Label the floor measurement sets.
const FLOOR_LABEL: &str = "load.sharding.timebertt.dev/floor";

/// Page size of the sharder's sync lists.
const SYNC_PAGE_SIZE: u32 = 500;

/// Message of the sharder's log record at the end of a sync.
const SYNC_FINISHED: &str = "finished sync of ring";

/// How often waits print progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

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
fn progress(started: Instant, message: &str) {
    eprintln!("[{:>7.1}s] {message}", started.elapsed().as_secs_f64());
}

/// An optional number of seconds as text.
fn seconds(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_string(), |s| format!("{s:.2} s"))
}

/// Seconds with millisecond precision, for the report.
fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

// ---------------------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------------------

/// Everything measured in one run.
#[derive(Debug, Serialize)]
struct Report {
    objects: usize,
    server_version: String,
    /// `release` or `debug`: the profile this tool (and the binaries beside it) was built with.
    profile: &'static str,
    concurrent_moves: usize,
    /// Extra environment of the sharder process (`--sharder-env`).
    sharder_env: Vec<String>,
    logs: String,
    phases: Vec<Phase>,
    scale_out: ScaleOut,
    floor: Floor,
}

/// Setting up one ring size and measuring a fresh sharder's memory after its full sync.
#[derive(Debug, Serialize)]
struct Phase {
    objects: usize,
    /// Seconds to create this phase's Secrets.
    create_seconds: f64,
    /// Seconds from the first create until every Secret and ConfigMap was placed.
    placed_seconds: f64,
    sharder: MemorySample,
    /// The sharder's log record of that sync.
    sync: SyncRecord,
    /// First pages of the sync's lists, requested the same way.
    pages: Vec<PageProbe>,
}

/// Memory of the sharder process, in KiB.
#[derive(Debug, Clone, Copy, Serialize)]
struct MemorySample {
    vm_hwm_kib: u64,
    vm_rss_kib: u64,
}

/// A "finished sync of ring" record of the sharder.
#[derive(Debug, Clone, Serialize)]
struct SyncRecord {
    duration: String,
    listed: u64,
    drained: u64,
    moved: u64,
    failed: u64,
}

/// The first page a cluster-wide metadata list returns.
#[derive(Debug, Serialize)]
struct PageProbe {
    resource: &'static str,
    /// `sharder`: the request the sharder's sync sends; `spec`: `resourceVersion=0` with the limit.
    request: &'static str,
    /// The query string sent.
    query: String,
    items: usize,
    bytes: usize,
    has_continue: bool,
}

/// The 3 → 4 scale-out.
#[derive(Debug, Serialize)]
struct ScaleOut {
    /// Seconds from starting the 4th shard until the ring reported 4 available shards.
    available_seconds: f64,
    /// Seconds from starting the 4th shard until convergence.
    converged_seconds: f64,
    /// Objects the 4-shard ring puts elsewhere than the 3-shard ring (per kind, equal).
    predicted_moves: usize,
    moved_secrets: usize,
    moved_configmaps: usize,
    /// Whether every moved object went to the new shard.
    only_new_shard_gained: bool,
    counters: Counters,
    /// Syncs the sharder finished between starting the 4th shard and the end of the settle time.
    syncs: Vec<SyncRecord>,
    transitions: Transitions,
    /// Sharder memory after the scale-out (its peak includes the startup sync at full size).
    sharder_after: MemorySample,
}

/// Patches the sharder counted during the scale-out.
#[derive(Debug, Default, Serialize)]
struct Counters {
    secret_drains: u64,
    secret_moves: u64,
    configmap_drains: u64,
    configmap_moves: u64,
}

impl Counters {
    fn total(&self) -> u64 {
        self.secret_drains + self.secret_moves + self.configmap_drains + self.configmap_moves
    }
}

/// Label changes the watches saw after the 4th shard started.
#[derive(Debug, Default, Clone, Copy, Serialize)]
struct Transitions {
    /// Secrets that gained the drain label.
    drains_seen: u64,
    /// Shard-label changes of Secrets.
    secret_relabels: u64,
    /// Shard-label changes of ConfigMaps.
    configmap_relabels: u64,
    /// Shard-label changes to a shard other than the 4-shard ring's (e.g. a shard re-applying a
    /// ConfigMap the sharder had just moved away from it).
    wrong_relabels: u64,
    /// Seconds after the target was set until the first drain label was seen.
    first_drain_seconds: Option<f64>,
    /// Seconds after the target was set until the first ConfigMap changed its shard label.
    first_configmap_relabel_seconds: Option<f64>,
    /// Seconds after the target was set until the last drain label was seen (about when the
    /// sharder's drain pass ended).
    last_drain_seconds: Option<f64>,
    /// Seconds after the target was set until the last ConfigMap changed its shard label.
    last_configmap_relabel_seconds: Option<f64>,
}

/// The floor: plain label patches on the moved objects.
#[derive(Debug, Serialize)]
struct Floor {
    patches: usize,
    concurrency: usize,
    runs_seconds: Vec<f64>,
    median_seconds: f64,
    failed: usize,
}

impl Report {
    fn rss_growth_percent(&self) -> Option<f64> {
        let (first, last) = (self.phases.first()?, self.phases.last()?);
        if self.phases.len() < 2 {
            return None;
        }
        let (a, b) = (
            first.sharder.vm_hwm_kib as f64,
            last.sharder.vm_hwm_kib as f64,
        );
        Some((b - a) / a * 100.0)
    }

    fn text(&self) -> String {
        let mut out = String::new();
        let s = &self.scale_out;
        let _ = writeln!(
            out,
            "rebalance-load: {} Secrets + {} ConfigMaps, 3 -> 4 shards, kube-apiserver {}, {} build, concurrentMoves {}",
            self.objects, self.objects, self.server_version, self.profile, self.concurrent_moves
        );
        if !self.sharder_env.is_empty() {
            let _ = writeln!(out, "sharder environment: {}", self.sharder_env.join(" "));
        }
        let _ = writeln!(out, "process logs: {}", self.logs);
        let _ = writeln!(
            out,
            "\nsetup and sharder memory (fresh sharder, after its first full sync):"
        );
        for p in &self.phases {
            let _ = writeln!(
                out,
                "  {:>6} Secrets: created in {:.1} s, placed after {:.1} s; sync listed {} objects in {}; \
                 VmHWM {:.1} MiB, VmRSS {:.1} MiB",
                p.objects,
                p.create_seconds,
                p.placed_seconds,
                p.sync.listed,
                p.sync.duration,
                p.sharder.vm_hwm_kib as f64 / 1024.0,
                p.sharder.vm_rss_kib as f64 / 1024.0,
            );
            for page in &p.pages {
                let _ = writeln!(
                    out,
                    "         first page of {} as {} requests it (?{}): {} items, {:.1} MiB, continue: {}",
                    page.resource,
                    page.request,
                    page.query,
                    page.items,
                    page.bytes as f64 / 1024.0 / 1024.0,
                    page.has_continue
                );
            }
        }
        if let Some(growth) = self.rss_growth_percent() {
            let _ = writeln!(out, "  VmHWM growth: {growth:+.1} %");
        }
        let _ = writeln!(out, "\nscale-out 3 -> 4:");
        let _ = writeln!(
            out,
            "  4 shards available after {:.2} s, converged after {:.2} s",
            s.available_seconds, s.converged_seconds
        );
        let _ = writeln!(
            out,
            "  moved: {} Secrets, {} ConfigMaps (ring predicts {} each); only the new shard gained: {}",
            s.moved_secrets, s.moved_configmaps, s.predicted_moves, s.only_new_shard_gained
        );
        let c = &s.counters;
        let _ = writeln!(
            out,
            "  sharder patches: {} (Secrets: {} drains, {} moves; ConfigMaps: {} drains, {} moves); \
             minimum {} = {} drains + {} moves (or fewer moves where the shard relabelled the ConfigMap itself)",
            c.total(),
            c.secret_drains,
            c.secret_moves,
            c.configmap_drains,
            c.configmap_moves,
            s.moved_secrets + s.moved_configmaps,
            s.moved_secrets,
            s.moved_configmaps
        );
        for sync in &s.syncs {
            let _ = writeln!(
                out,
                "  sync: {} listed, {} drained, {} moved, {} failed, took {}",
                sync.listed, sync.drained, sync.moved, sync.failed, sync.duration
            );
        }
        let t = &s.transitions;
        let _ = writeln!(
            out,
            "  watched: {} drain labels, {} Secret and {} ConfigMap relabels, {} to a wrong shard; \
             drains seen {} .. {}, ConfigMap relabels {} .. {}",
            t.drains_seen,
            t.secret_relabels,
            t.configmap_relabels,
            t.wrong_relabels,
            seconds(t.first_drain_seconds),
            seconds(t.last_drain_seconds),
            seconds(t.first_configmap_relabel_seconds),
            seconds(t.last_configmap_relabel_seconds),
        );
        let _ = writeln!(
            out,
            "  sharder after the scale-out: VmHWM {:.1} MiB, VmRSS {:.1} MiB",
            s.sharder_after.vm_hwm_kib as f64 / 1024.0,
            s.sharder_after.vm_rss_kib as f64 / 1024.0
        );
        let f = &self.floor;
        let _ = writeln!(
            out,
            "\nfloor: {} label patches with {} in flight: {:?} s, median {:.2} s ({} failed)",
            f.patches, f.concurrency, f.runs_seconds, f.median_seconds, f.failed
        );
        let _ = writeln!(out, "\ngoals:");
        let minimum = (s.moved_secrets + s.moved_configmaps) as u64;
        let _ = writeln!(
            out,
            "  patches == minimum:       {} vs {} ({})",
            c.total(),
            minimum,
            if c.total() == minimum {
                "met"
            } else if c.total() < minimum {
                "below: the shard relabelled some ConfigMaps itself"
            } else {
                "MISSED"
            }
        );
        let ratio = s.converged_seconds / f.median_seconds.max(f64::EPSILON);
        let _ = writeln!(
            out,
            "  convergence <= 2x floor:  {:.2} s / {:.2} s = {ratio:.2}x ({})",
            s.converged_seconds,
            f.median_seconds,
            if ratio <= 2.0 { "met" } else { "MISSED" }
        );
        if let Some(last) = self.phases.last() {
            let mib = last.sharder.vm_hwm_kib as f64 / 1024.0;
            let _ = writeln!(
                out,
                "  sharder RSS <= 40 MiB:    peak {mib:.1} MiB at {} objects ({})",
                last.objects,
                if mib <= 40.0 { "met" } else { "MISSED" }
            );
        }
        if let Some(growth) = self.rss_growth_percent() {
            let _ = writeln!(
                out,
                "  RSS growth <= 10 %:       {growth:+.1} % ({})",
                if growth <= 10.0 { "met" } else { "MISSED" }
            );
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Placement tracking
// ---------------------------------------------------------------------------------------------

/// Which kind of object a watch follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Secret,
    ConfigMap,
}

/// The labels of one object that matter here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Placement {
    shard: Option<String>,
    draining: bool,
}

/// The ring the objects should converge to, and what was seen since it was set.
#[derive(Debug)]
struct Target {
    ring: Ring,
    count: usize,
    set_at: Instant,
    /// Objects (by kind and Secret name) that are misplaced or draining.
    bad: HashSet<(Kind, String)>,
    /// Since when every object has been in place, if it is.
    good_since: Option<Instant>,
    transitions: Transitions,
}

/// Placements of every Secret and ConfigMap, keyed by the Secret's name.
#[derive(Debug)]
struct State {
    namespace: String,
    shard_key: String,
    drain_key: String,
    secrets: HashMap<String, Placement>,
    configmaps: HashMap<String, Placement>,
    synced: HashSet<Kind>,
    target: Option<Target>,
}

impl State {
    fn objects(&self, kind: Kind) -> &HashMap<String, Placement> {
        match kind {
            Kind::Secret => &self.secrets,
            Kind::ConfigMap => &self.configmaps,
        }
    }

    fn objects_mut(&mut self, kind: Kind) -> &mut HashMap<String, Placement> {
        match kind {
            Kind::Secret => &mut self.secrets,
            Kind::ConfigMap => &mut self.configmaps,
        }
    }

    fn expected<'r>(ring: &'r Ring, namespace: &str, secret: &str) -> Option<&'r str> {
        ring.shard_for(&format!("/Secret/{namespace}/{secret}"))
    }

    fn misplaced(ring: &Ring, namespace: &str, secret: &str, placement: &Placement) -> bool {
        placement.draining || placement.shard.as_deref() != Self::expected(ring, namespace, secret)
    }

    /// Sets the ring to converge to and rebuilds the set of misplaced objects.
    fn set_target(&mut self, ring: Ring, count: usize) {
        let mut bad = HashSet::new();
        for kind in [Kind::Secret, Kind::ConfigMap] {
            for (name, placement) in self.objects(kind) {
                if Self::misplaced(&ring, &self.namespace, name, placement) {
                    bad.insert((kind, name.clone()));
                }
            }
        }
        self.target = Some(Target {
            ring,
            count,
            set_at: Instant::now(),
            bad,
            good_since: None,
            transitions: Transitions::default(),
        });
        self.update_good();
    }

    fn replace_all(&mut self, kind: Kind, objects: HashMap<String, Placement>) {
        *self.objects_mut(kind) = objects;
        self.synced.insert(kind);
        if let Some(target) = self.target.take() {
            let (transitions, set_at) = (target.transitions, target.set_at);
            self.set_target(target.ring, target.count);
            if let Some(t) = self.target.as_mut() {
                t.transitions = transitions;
                t.set_at = set_at;
            }
        }
    }

    fn update(&mut self, kind: Kind, name: String, placement: Option<Placement>) {
        let previous = match &placement {
            Some(p) => self.objects_mut(kind).insert(name.clone(), p.clone()),
            None => self.objects_mut(kind).remove(&name),
        };
        if let Some(target) = self.target.as_mut() {
            if let (Some(old), Some(new)) = (&previous, &placement) {
                let since = secs(target.set_at.elapsed());
                let t = &mut target.transitions;
                if !old.draining && new.draining {
                    t.drains_seen += 1;
                    t.first_drain_seconds.get_or_insert(since);
                    t.last_drain_seconds = Some(since);
                }
                if old.shard != new.shard && new.shard.is_some() {
                    match kind {
                        Kind::Secret => t.secret_relabels += 1,
                        Kind::ConfigMap => {
                            t.configmap_relabels += 1;
                            t.first_configmap_relabel_seconds.get_or_insert(since);
                            t.last_configmap_relabel_seconds = Some(since);
                        }
                    }
                    if new.shard.as_deref() != Self::expected(&target.ring, &self.namespace, &name)
                    {
                        target.transitions.wrong_relabels += 1;
                    }
                }
            }
            match &placement {
                Some(p) if Self::misplaced(&target.ring, &self.namespace, &name, p) => {
                    target.bad.insert((kind, name));
                }
                _ => {
                    target.bad.remove(&(kind, name));
                }
            }
        }
        self.update_good();
    }

    fn is_good(&self) -> bool {
        self.target.as_ref().is_some_and(|t| {
            t.bad.is_empty()
                && self.synced.len() == 2
                && self.secrets.len() == t.count
                && self.configmaps.len() == t.count
        })
    }

    fn update_good(&mut self) {
        let good = self.is_good();
        if let Some(target) = self.target.as_mut() {
            if !good {
                target.good_since = None;
            } else if target.good_since.is_none() {
                target.good_since = Some(Instant::now());
            }
        }
    }

    fn summary(&self) -> String {
        let (bad, count) = self
            .target
            .as_ref()
            .map_or((0, 0), |t| (t.bad.len(), t.count));
        format!(
            "Secrets {}/{count}, ConfigMaps {}/{count}, {bad} misplaced or draining",
            self.secrets.len(),
            self.configmaps.len()
        )
    }
}

/// Follows the placement of every Secret and ConfigMap of a namespace through metadata-only
/// watches.
struct Tracker {
    state: Arc<Mutex<State>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Tracker {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Tracker {
    fn start(client: &Client, namespace: &str, ring: &str) -> Self {
        let state = Arc::new(Mutex::new(State {
            namespace: namespace.to_string(),
            shard_key: labels::shard_label(ring),
            drain_key: labels::drain_label(ring),
            secrets: HashMap::new(),
            configmaps: HashMap::new(),
            synced: HashSet::new(),
            target: None,
        }));
        let tasks = vec![
            tokio::spawn(follow(
                Api::<PartialObjectMeta<Secret>>::namespaced(client.clone(), namespace),
                Kind::Secret,
                state.clone(),
            )),
            tokio::spawn(follow(
                Api::<PartialObjectMeta<ConfigMap>>::namespaced(client.clone(), namespace),
                Kind::ConfigMap,
                state.clone(),
            )),
        ];
        Self { state, tasks }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Shard labels of every Secret and ConfigMap, keyed by kind and Secret name.
    fn snapshot(&self) -> HashMap<(Kind, String), Option<String>> {
        let state = self.lock();
        [Kind::Secret, Kind::ConfigMap]
            .into_iter()
            .flat_map(|kind| {
                state
                    .objects(kind)
                    .iter()
                    .map(move |(name, p)| ((kind, name.clone()), p.shard.clone()))
            })
            .collect()
    }

    fn set_target(&self, shards: &[&str], count: usize) {
        self.lock().set_target(Ring::new(shards), count);
    }

    fn transitions(&self) -> Transitions {
        self.lock()
            .target
            .as_ref()
            .map(|t| t.transitions)
            .unwrap_or_default()
    }

    /// Waits until the target has held for `settle`; returns when it started to hold.
    async fn wait_settled(
        &self,
        what: &str,
        settle: Duration,
        timeout: Duration,
        started: Instant,
    ) -> anyhow::Result<Instant> {
        let deadline = Instant::now() + timeout;
        let mut next_progress = Instant::now() + PROGRESS_EVERY;
        loop {
            {
                let state = self.lock();
                let since = state.target.as_ref().and_then(|t| t.good_since);
                if let Some(since) = since.filter(|s| s.elapsed() >= settle) {
                    return Ok(since);
                }
                if Instant::now() >= deadline {
                    bail!(
                        "timed out after {timeout:?} waiting for {what}: {}",
                        state.summary()
                    );
                }
                if Instant::now() >= next_progress {
                    progress(started, &format!("waiting for {what}: {}", state.summary()));
                    next_progress += PROGRESS_EVERY;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Runs a metadata-only watch of one kind and feeds its events into `state`.
async fn follow<K>(api: Api<PartialObjectMeta<K>>, kind: Kind, state: Arc<Mutex<State>>)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let (shard_key, drain_key) = {
        let s = state.lock().unwrap_or_else(PoisonError::into_inner);
        (s.shard_key.clone(), s.drain_key.clone())
    };
    let entry = |obj: &PartialObjectMeta<K>| -> Option<(String, Placement)> {
        let name = obj.name_any();
        let secret = match kind {
            Kind::Secret => name.starts_with(SECRET_PREFIX).then_some(name)?,
            Kind::ConfigMap => name.strip_prefix(CONFIG_MAP_PREFIX)?.to_string(),
        };
        let labels = obj.labels();
        Some((
            secret,
            Placement {
                shard: labels.get(&shard_key).cloned(),
                draining: labels.contains_key(&drain_key),
            },
        ))
    };
    let mut buffer: HashMap<String, Placement> = HashMap::new();
    let mut events =
        std::pin::pin!(watcher::watcher(api, watcher::Config::default()).default_backoff());
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                eprintln!("watch of {kind:?} failed, retrying: {error}");
                continue;
            }
        };
        let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
        match event {
            watcher::Event::Init => buffer.clear(),
            watcher::Event::InitApply(obj) => {
                if let Some((name, placement)) = entry(&obj) {
                    buffer.insert(name, placement);
                }
            }
            watcher::Event::InitDone => state.replace_all(kind, std::mem::take(&mut buffer)),
            watcher::Event::Apply(obj) => {
                if let Some((name, placement)) = entry(&obj) {
                    state.update(kind, name, Some(placement));
                }
            }
            watcher::Event::Delete(obj) => {
                if let Some((name, _)) = entry(&obj) {
                    state.update(kind, name, None);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Processes and probes
// ---------------------------------------------------------------------------------------------

/// Starts a checksum-controller shard restricted to `namespace`, with default Lease timing.
///
/// Its log stays on disk (see the report); it is never printed, as it holds a line per object.
fn start_shard(ring: &str, namespace: &str, shard: &str) -> anyhow::Result<Process> {
    let mut process = start_checksum_shard(ring, namespace, shard, ShardTiming::DEFAULT)?;
    process.passed();
    Ok(process)
}

/// Stops `old` (if any) and starts a fresh sharder (as `SharderFiles::start_process` does, plus
/// `envs`), ready once its caches synced.
async fn restart_sharder(
    old: Option<Process>,
    files: &SharderFiles,
    envs: &[(String, String)],
) -> anyhow::Result<Process> {
    if let Some(mut old) = old {
        old.terminate()?;
        old.wait(Duration::from_secs(30)).await?;
    }
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

/// The sharder's "finished sync of ring" records of `ring`, in order.
fn sync_records(sharder: &Process, ring: &str) -> Vec<SyncRecord> {
    sharder
        .records()
        .iter()
        .filter(|r| r["fields"]["message"] == SYNC_FINISHED && r["fields"]["ring"] == ring)
        .map(|r| {
            let f = &r["fields"];
            SyncRecord {
                duration: f["duration"].as_str().unwrap_or_default().to_string(),
                listed: f["listed"].as_u64().unwrap_or_default(),
                drained: f["drained"].as_u64().unwrap_or_default(),
                moved: f["moved"].as_u64().unwrap_or_default(),
                failed: f["failed"].as_u64().unwrap_or_default(),
            }
        })
        .collect()
}

/// Waits until the sharder has finished more than `seen` syncs of `ring`; returns the next one.
async fn wait_sync(
    sharder: &Process,
    ring: &str,
    seen: usize,
    timeout: Duration,
) -> anyhow::Result<SyncRecord> {
    poll_until(
        &format!("sync {} of ring {ring}", seen + 1),
        timeout,
        || {
            let record = sync_records(sharder, ring).into_iter().nth(seen);
            async move { Ok(record) }
        },
    )
    .await
}

/// `VmHWM` and `VmRSS` of a process.
fn memory(process: &Process) -> anyhow::Result<MemorySample> {
    let pid = process.id().context("the sharder has exited")?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("failed to read /proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .with_context(|| format!("no {name} in /proc/{pid}/status"))?;
        let kib = line.trim().trim_end_matches("kB").trim();
        kib.parse()
            .with_context(|| format!("unexpected {name} value {line:?}"))
    };
    Ok(MemorySample {
        vm_hwm_kib: field("VmHWM:")?,
        vm_rss_kib: field("VmRSS:")?,
    })
}

/// Requests the first page of a cluster-wide metadata list of `path`: with `raw_rv0`, with
/// `limit=500&resourceVersion=0` as SPEC §9 describes; else built from the very `ListParams` the
/// sharder's sync uses (`limit(500)` and `resource_version = "0"`), which kube-core turns into a
/// query without `resourceVersion` (it drops `0` whenever a limit is set).
async fn probe_page(
    client: &Client,
    resource: &'static str,
    path: &str,
    raw_rv0: bool,
) -> anyhow::Result<PageProbe> {
    let mut params = ListParams::default().limit(SYNC_PAGE_SIZE);
    params.resource_version = Some("0".into());
    let mut request = kube::core::Request::new(path).list_metadata(&params)?;
    if raw_rv0 {
        *request.uri_mut() = format!("{path}?limit={SYNC_PAGE_SIZE}&resourceVersion=0").parse()?;
    }
    let query = request.uri().query().unwrap_or_default().to_string();
    let text = client.request_text(request).await?;
    let list: serde_json::Value = serde_json::from_str(&text)?;
    Ok(PageProbe {
        resource,
        request: if raw_rv0 { "spec" } else { "sharder" },
        query,
        items: list["items"].as_array().map_or(0, Vec::len),
        bytes: text.len(),
        has_continue: list["metadata"]["continue"]
            .as_str()
            .is_some_and(|c| !c.is_empty()),
    })
}

async fn probe_pages(client: &Client) -> anyhow::Result<Vec<PageProbe>> {
    let mut pages = Vec::new();
    for (resource, path) in [
        ("secrets", "/api/v1/secrets"),
        ("configmaps", "/api/v1/configmaps"),
    ] {
        for raw_rv0 in [false, true] {
            pages.push(probe_page(client, resource, path, raw_rv0).await?);
        }
    }
    Ok(pages)
}

/// Value of a counter of the sharder for `ring` and core `resource` (0 when absent).
fn counter(metrics: &str, metric: &str, ring: &str, resource: &str) -> anyhow::Result<u64> {
    let prefix = format!(r#"{metric}{{clusterring="{ring}",group="",resource="{resource}"}} "#);
    Ok(metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.trim().parse())
        .transpose()?
        .unwrap_or(0))
}

fn counters(files: &SharderFiles, ring: &str) -> anyhow::Result<Counters> {
    let text = files.metrics()?;
    let drains = "controller_sharding_drains_total";
    let moves = "controller_sharding_movements_total";
    Ok(Counters {
        secret_drains: counter(&text, drains, ring, "secrets")?,
        secret_moves: counter(&text, moves, ring, "secrets")?,
        configmap_drains: counter(&text, drains, ring, "configmaps")?,
        configmap_moves: counter(&text, moves, ring, "configmaps")?,
    })
}

/// Creates Secrets `range` with one data key each, `concurrency` at a time.
async fn create_secrets(
    client: &Client,
    namespace: &str,
    range: std::ops::Range<usize>,
    concurrency: usize,
    started: Instant,
) -> anyhow::Result<()> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let total = range.len();
    let done = AtomicUsize::new(0);
    futures::stream::iter(range)
        .map(|i| {
            let (api, done) = (&api, &done);
            async move {
                let mut s = secret(&format!("{SECRET_PREFIX}{i}"));
                s.data = Some(BTreeMap::from([(
                    "value".to_string(),
                    ByteString(format!("v{i}").into_bytes()),
                )]));
                let mut attempt = 0;
                loop {
                    attempt += 1;
                    match api.create(&PostParams::default(), &s).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(status)) if status.code == 409 => break,
                        Err(error) if attempt < 5 => {
                            eprintln!("creating {} failed, retrying: {error}", s.name_any());
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(error) => {
                            return Err(anyhow::Error::new(error)
                                .context(format!("failed to create {}", s.name_any())));
                        }
                    }
                }
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                if n % 1000 == 0 || n == total {
                    progress(started, &format!("created {n}/{total} Secrets"));
                }
                Ok(())
            }
        })
        .buffer_unordered(concurrency.max(1))
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Patches `value` into [`FLOOR_LABEL`] on every object of `objects`, `concurrency` in flight;
/// returns the time taken and the number of failed patches.
async fn floor_run(
    client: &Client,
    namespace: &str,
    objects: &[(Kind, String)],
    concurrency: usize,
    value: &str,
) -> (Duration, usize) {
    let secrets = Api::<Secret>::namespaced(client.clone(), namespace);
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    let body = json!({"metadata": {"labels": {FLOOR_LABEL: value}}});
    let started = Instant::now();
    let failed = futures::stream::iter(objects)
        .map(|(kind, secret)| {
            let (secrets, configmaps, body) = (&secrets, &configmaps, &body);
            async move {
                let params = PatchParams::default();
                let result = match kind {
                    Kind::Secret => secrets
                        .patch_metadata(secret, &params, &Patch::Merge(body))
                        .await
                        .map(drop),
                    Kind::ConfigMap => configmaps
                        .patch_metadata(
                            &format!("{CONFIG_MAP_PREFIX}{secret}"),
                            &params,
                            &Patch::Merge(body),
                        )
                        .await
                        .map(drop),
                };
                result.is_err()
            }
        })
        .buffer_unordered(concurrency.max(1))
        .filter(|failed| std::future::ready(*failed))
        .count()
        .await;
    (started.elapsed(), failed)
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

async fn run(args: &Args, cluster: &Cluster) -> anyhow::Result<Report> {
    let started = Instant::now();
    let client = cluster.client().await?;
    let server_version = client.apiserver_version().await?.git_version;
    let namespace = cluster.namespace(&client, "load").await?;
    let ring = unique_name("load");
    let logs = std::env::temp_dir().join(format!(
        "controller-sharding-e2e-logs-{}",
        std::process::id()
    ));
    progress(
        started,
        &format!(
            "namespace {namespace}, ring {ring}, process logs in {}",
            logs.display()
        ),
    );
    let result = measure(args, cluster, &client, &namespace, &ring, started).await;
    // A local control plane goes away with this process; on an external cluster, clean up.
    if cluster.state_dir().is_none() {
        let _ = Api::<ClusterRing>::all(client.clone())
            .delete(&ring, &DeleteParams::default())
            .await;
        let _ = Api::<Namespace>::all(client.clone())
            .delete(&namespace, &DeleteParams::default())
            .await;
    }
    let (phases, scale_out, floor, concurrent_moves) =
        result.with_context(|| format!("process logs are in {}", logs.display()))?;
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
    })
}

async fn measure(
    args: &Args,
    cluster: &Cluster,
    client: &Client,
    namespace: &str,
    ring: &str,
    started: Instant,
) -> anyhow::Result<(Vec<Phase>, ScaleOut, Floor, usize)> {
    let timeout = Duration::from_secs(args.timeout);
    let settle = Duration::from_secs(args.settle);
    let files = SharderFiles::create(
        cluster.kubeconfig(),
        &SharderSettings {
            // Production timing: the machine is busy, short leases would flap.
            leader_election: (15, 10, 2),
            sync_period: "5m".into(),
        },
    )?;
    let concurrency = usize::try_from(files.load()?.controller.sharder.concurrent_moves)?;
    let mut sharder = restart_sharder(None, &files, &args.sharder_env).await?;
    create_ring(client, ring, ring_spec(namespace)).await?;

    let three = &SHARDS[..3];
    let mut shards = Vec::new();
    for shard in three {
        shards.push(start_shard(ring, namespace, shard)?);
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
    tracker.set_target(&SHARDS, count);
    let predicted_moves = tracker.lock().target.as_ref().map_or(0, |t| t.bad.len()) / 2;
    progress(
        started,
        &format!(
            "starting {}: {predicted_moves} Secrets and their ConfigMaps should move",
            SHARDS[3]
        ),
    );
    let t0 = Instant::now();
    shards.push(start_shard(ring, namespace, SHARDS[3])?);
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
    let scale_out = ScaleOut {
        available_seconds: secs(available),
        converged_seconds: secs(converged),
        predicted_moves,
        moved_secrets: moved_of(Kind::Secret),
        moved_configmaps: moved_of(Kind::ConfigMap),
        only_new_shard_gained,
        counters,
        syncs,
        transitions: tracker.transitions(),
        sharder_after,
    };
    drop(tracker);

    // The floor: the same number of plain label patches on the same objects.
    let mut runs = Vec::new();
    let mut failed = 0;
    for run in 0..args.floor_runs.max(1) {
        // Let the shards finish reacting to the previous run's updates.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let (took, run_failed) =
            floor_run(client, namespace, &moved, concurrency, &run.to_string()).await;
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
    let mut sorted = runs.clone();
    sorted.sort();
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or_default();
    let floor = Floor {
        patches: moved.len(),
        concurrency,
        runs_seconds: runs.into_iter().map(secs).collect(),
        median_seconds: secs(median),
        failed,
    };

    for shard in &shards {
        let _ = shard.terminate();
    }
    let _ = sharder.terminate();
    Ok((phases, scale_out, floor, concurrency))
}
