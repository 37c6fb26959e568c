//! `scale-load membership`: shard Leases renewed by the tool, two sharder replicas, and what the
//! renewals and membership changes cost them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use e2e::Cluster;
use e2e::fixtures::{create_lease, create_ring, ring_spec, wait_status};
use e2e::process::{Process, rss_kib};
use e2e::renewals::{RenewalCounters, renew};
use e2e::sharder_process::{SharderFiles, SharderSettings};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch};
use kube_sharding_api::ClusterRing;
use kube_sharding_api::labels::{ANNOTATION_WEIGHT, NAMESPACE_SYSTEM};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use e2e::prometheus::{apiserver_metrics, label, samples, sum};

use crate::progress;
use crate::samples::cpu_seconds;

/// The sharder's request counter, as exposed.
const API_REQUESTS: &str = "controller_sharding_api_requests_total";

/// The sharder's counter of hash-ring rebuilds, as exposed.
const RING_CALCULATIONS: &str = "controller_sharding_ring_calculations_total";

/// The API server's request counter.
const APISERVER_REQUESTS: &str = "apiserver_request_total";

/// The goal for the leading replica's CPU use while only renewals flow (issue 13), in % of a core.
const CPU_GOAL_PERCENT: f64 = 3.0;

/// Flags of `scale-load membership`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Shard Leases in all.
    #[arg(long, default_value_t = 1000)]
    shards: usize,
    /// Rings the Leases are spread over, round robin.
    #[arg(long, default_value_t = 1)]
    rings: usize,
    /// Seconds between two renewals of one Lease.
    #[arg(long, default_value_t = 2.0)]
    renew_period: f64,
    /// `leaseDurationSeconds` of the Leases.
    #[arg(long, default_value_t = 10)]
    lease_duration: i32,
    /// Seconds of renewals before the first window.
    #[arg(long, default_value_t = 20)]
    warmup: u64,
    /// Seconds each measurement window lasts.
    #[arg(long, default_value_t = 60)]
    window: u64,
    /// Seconds between two membership changes (a weight flip of one Lease) in the second window;
    /// 0: no second window.
    #[arg(long, default_value_t = 1.0)]
    churn_every: f64,
    /// Renewals in flight at most.
    #[arg(long, default_value_t = 64)]
    writers: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// What one window measured.
#[derive(Debug, Serialize)]
struct Window {
    /// What ran besides the renewals.
    name: &'static str,
    seconds: f64,
    /// Renewals the tool completed, per second.
    renewals_per_second: f64,
    /// Renewals that failed.
    renewal_failures: u64,
    /// Membership changes the tool made.
    membership_changes: u64,
    leader: Replica,
    follower: Replica,
    /// Requests the API server counted in the window (`apiserver_request_total`), all clients.
    apiserver_requests: f64,
    /// Of those, the tool's own (renewals, membership changes and its two `/metrics` reads).
    tool_requests: f64,
    /// The API server's requests other than Lease PATCHes (the tool's renewals and membership
    /// changes), by `verb resource[/subresource]`: the sharders' requests, seen from the server.
    apiserver_other_requests: Vec<(String, f64)>,
}

/// One sharder replica in one window.
#[derive(Debug, Serialize)]
struct Replica {
    /// CPU use, in % of one core.
    cpu_percent: f64,
    /// Resident set size at the end of the window, in MiB.
    rss_mib: f64,
    /// Requests of its clients but the leader-election one (controllers and caches), by
    /// `client,verb,resource`.
    requests: Vec<(String, f64)>,
    /// Requests of its controllers' and caches' clients in all.
    main_requests: f64,
    /// Requests of its leader-election client (its own Lease).
    leader_election_requests: f64,
    /// Hash rings it rebuilt.
    ring_calculations: f64,
}

/// The whole report.
#[derive(Debug, Serialize)]
struct Report {
    shards: usize,
    rings: usize,
    renew_period_seconds: f64,
    windows: Vec<Window>,
}

/// The state of one sharder replica at one moment.
struct Sample {
    cpu: f64,
    metrics: String,
}

impl Sample {
    fn take(process: &Process, files: &SharderFiles) -> anyhow::Result<Self> {
        let pid = process.id().context("a sharder exited")?;
        Ok(Self {
            cpu: cpu_seconds(pid)?,
            metrics: files.metrics()?,
        })
    }
}

/// Runs the measurement and prints the report.
pub(crate) async fn run(args: &Args, cluster: &Cluster) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.shards > 0 && args.rings > 0 && args.rings <= args.shards,
        "need at least one ring and as many shards as rings"
    );
    let started = Instant::now();
    let client = cluster.client().await?;
    let namespace = cluster.namespace(&client, "scale").await?;
    let rings: Vec<String> = (0..args.rings)
        .map(|i| e2e::unique_name(&format!("scale-{i}")))
        .collect();
    for ring in &rings {
        create_ring(&client, ring, ring_spec(&namespace)).await?;
    }

    let settings = SharderSettings::default();
    let files = [
        SharderFiles::create(cluster.kubeconfig(), &settings)?,
        SharderFiles::create(cluster.kubeconfig(), &settings)?,
    ];
    let mut processes = Vec::new();
    for f in &files {
        let mut process = f.start_process()?;
        process.passed();
        processes.push(process);
    }
    for f in &files {
        f.wait_ready(Duration::from_secs(120)).await?;
    }
    progress(started, "two sharder replicas ready");

    // Leases first (as fast as the API server takes them), renewed from the moment they exist.
    let names: Vec<String> = (0..args.shards).map(|i| format!("shard-{i:05}")).collect();
    futures::stream::iter(names.iter().enumerate())
        .map(|(i, name)| {
            let (client, namespace, ring) = (&client, &namespace, &rings[i % args.rings]);
            async move { create_lease(client, namespace, ring, name, args.lease_duration).await }
        })
        .buffer_unordered(50)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<Vec<_>>>()?;
    progress(started, &format!("{} Leases created", args.shards));
    let stop = CancellationToken::new();
    let counters = Arc::new(Counters::default());
    let renewer = tokio::spawn({
        let (api, names, counters, stop) = (
            Api::namespaced(client.clone(), &namespace),
            names.clone(),
            counters.clone(),
            stop.clone(),
        );
        let period = Duration::from_secs_f64(args.renew_period);
        let writers = args.writers;
        async move { renew(api, names, period, writers, &counters.renewal, stop).await }
    });
    for (i, ring) in rings.iter().enumerate() {
        let members = names.iter().skip(i).step_by(args.rings).count();
        let members = i32::try_from(members)?;
        wait_status(&client, ring, members, members).await?;
    }
    progress(
        started,
        "every ring reports all its shards available; warming up",
    );
    tokio::time::sleep(Duration::from_secs(args.warmup)).await;

    let leader = leader_slot(&client, &processes).await?;
    let mut windows = vec![
        measure(
            "renewals only",
            args,
            &client,
            (&files, &processes, leader),
            &counters,
            None,
        )
        .await?,
    ];
    progress(started, "first window done");
    if args.churn_every > 0.0 {
        let churn = Churn {
            leases: Api::namespaced(client.clone(), &namespace),
            names: &names,
            every: Duration::from_secs_f64(args.churn_every),
        };
        windows.push(
            measure(
                "renewals and membership changes",
                args,
                &client,
                (&files, &processes, leader),
                &counters,
                Some(churn),
            )
            .await?,
        );
        progress(started, "second window done");
    }
    stop.cancel();
    renewer.await?;

    let report = Report {
        shards: args.shards,
        rings: args.rings,
        renew_period_seconds: args.renew_period,
        windows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report));
    }

    for process in &processes {
        process.terminate()?;
    }
    let api: Api<ClusterRing> = Api::all(client.clone());
    for ring in &rings {
        api.delete(ring, &DeleteParams::default()).await?;
    }
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client)
        .delete(&namespace, &DeleteParams::default())
        .await?;
    Ok(())
}

/// Renewals and membership changes done by the tool.
#[derive(Debug, Default)]
struct Counters {
    renewal: RenewalCounters,
    changes: AtomicU64,
    change_requests: AtomicU64,
}

impl Counters {
    /// Requests the tool sent for renewals and membership changes.
    fn requests(&self) -> u64 {
        self.renewal.requests.load(Ordering::Relaxed) + self.change_requests.load(Ordering::Relaxed)
    }
}

/// Membership changes during a window: every `every`, the next Lease flips its weight between 1
/// (no annotation) and 2.
struct Churn<'a> {
    leases: Api<Lease>,
    names: &'a [String],
    every: Duration,
}

impl Churn<'_> {
    async fn run(&self, counters: &Counters, until: tokio::time::Instant) -> anyhow::Result<()> {
        let mut tick = tokio::time::interval(self.every);
        let mut n = 0usize;
        loop {
            tick.tick().await;
            if tokio::time::Instant::now() >= until {
                return Ok(());
            }
            let name = &self.names[n % self.names.len()];
            // The first pass sets weight 2, the second removes it again, and so on.
            let weight = if (n / self.names.len()).is_multiple_of(2) {
                serde_json::json!("2")
            } else {
                serde_json::Value::Null
            };
            let patch =
                serde_json::json!({"metadata": {"annotations": {ANNOTATION_WEIGHT: weight}}});
            counters.change_requests.fetch_add(1, Ordering::Relaxed);
            self.leases
                .patch(name, &e2e::patch_params(), &Patch::Merge(&patch))
                .await?;
            counters.changes.fetch_add(1, Ordering::Relaxed);
            n += 1;
        }
    }
}

/// Measures one window: samples both replicas and the API server before and after.
async fn measure(
    name: &'static str,
    args: &Args,
    client: &Client,
    (files, processes, leader): (&[SharderFiles; 2], &[Process], usize),
    counters: &Counters,
    churn: Option<Churn<'_>>,
) -> anyhow::Result<Window> {
    let follower = 1 - leader;
    let window = Duration::from_secs(args.window);
    let before = [
        Sample::take(&processes[0], &files[0])?,
        Sample::take(&processes[1], &files[1])?,
    ];
    let server_before = apiserver_metrics(client).await?;
    let renewals_before = counters.renewal.renewals();
    let failures_before = counters.renewal.failures();
    let changes_before = counters.changes.load(Ordering::Relaxed);
    let requests_before = counters.requests();
    let t0 = Instant::now();
    match &churn {
        Some(churn) => {
            churn
                .run(counters, tokio::time::Instant::now() + window)
                .await?
        }
        None => tokio::time::sleep(window).await,
    }
    let seconds = t0.elapsed().as_secs_f64();
    let after = [
        Sample::take(&processes[0], &files[0])?,
        Sample::take(&processes[1], &files[1])?,
    ];
    let server_after = apiserver_metrics(client).await?;
    let replica = |slot: usize| -> anyhow::Result<Replica> {
        let (b, a) = (&before[slot], &after[slot]);
        let delta = |text_b: &str, text_a: &str, labels: &[(&str, &str)]| {
            sum(text_a, API_REQUESTS, labels) - sum(text_b, API_REQUESTS, labels)
        };
        let before_samples = samples(&b.metrics, API_REQUESTS);
        let requests = samples(&a.metrics, API_REQUESTS)
            .into_iter()
            .filter(|(labels, _)| !labels.contains("client=\"leader_election\""))
            .map(|(labels, value)| {
                let old = before_samples
                    .iter()
                    .find(|(l, _)| *l == labels)
                    .map_or(0.0, |(_, v)| *v);
                (labels, value - old)
            })
            .filter(|(_, v)| *v > 0.0)
            .collect();
        let pid = processes[slot].id().context("a sharder exited")?;
        Ok(Replica {
            cpu_percent: (a.cpu - b.cpu) / seconds * 100.0,
            rss_mib: rss_kib(pid)? as f64 / 1024.0,
            requests,
            main_requests: delta(&b.metrics, &a.metrics, &[("client", "main")])
                + delta(&b.metrics, &a.metrics, &[("client", "caches")]),
            leader_election_requests: delta(
                &b.metrics,
                &a.metrics,
                &[("client", "leader_election")],
            ),
            ring_calculations: sum(&a.metrics, RING_CALCULATIONS, &[])
                - sum(&b.metrics, RING_CALCULATIONS, &[]),
        })
    };
    Ok(Window {
        name,
        seconds,
        renewals_per_second: (counters.renewal.renewals() - renewals_before) as f64 / seconds,
        renewal_failures: counters.renewal.failures() - failures_before,
        membership_changes: counters.changes.load(Ordering::Relaxed) - changes_before,
        leader: replica(leader)?,
        follower: replica(follower)?,
        apiserver_requests: sum(&server_after, APISERVER_REQUESTS, &[])
            - sum(&server_before, APISERVER_REQUESTS, &[]),
        apiserver_other_requests: other_requests(&server_before, &server_after),
        // The two reads of the API server's /metrics count too.
        tool_requests: (counters.requests() - requests_before) as f64 + 2.0,
    })
}

/// The API server's requests between two `/metrics` texts by `verb resource[/subresource]`,
/// without Lease PATCHes, largest first.
fn other_requests(before: &str, after: &str) -> Vec<(String, f64)> {
    let by_kind = |text: &str| {
        let mut totals: BTreeMap<String, f64> = BTreeMap::new();
        for (labels, value) in samples(text, APISERVER_REQUESTS) {
            let (verb, resource) = (label(&labels, "verb"), label(&labels, "resource"));
            if verb == "PATCH" && resource == "leases" {
                continue;
            }
            let subresource = label(&labels, "subresource");
            let key = if subresource.is_empty() {
                format!("{verb} {resource}")
            } else {
                format!("{verb} {resource}/{subresource}")
            };
            *totals.entry(key).or_default() += value;
        }
        totals
    };
    let old = by_kind(before);
    let mut delta: Vec<(String, f64)> = by_kind(after)
        .into_iter()
        .map(|(key, value)| {
            let was = old.get(&key).copied().unwrap_or_default();
            (key, value - was)
        })
        .filter(|(_, v)| *v > 0.0)
        .collect();
    delta.sort_by(|a, b| b.1.total_cmp(&a.1));
    delta
}

/// Which of `processes` holds the sharder's leader Lease (its identity carries the process id).
async fn leader_slot(client: &Client, processes: &[Process]) -> anyhow::Result<usize> {
    let lease = Api::<Lease>::namespaced(client.clone(), NAMESPACE_SYSTEM)
        .get("sharder")
        .await
        .context("failed to read the sharder's leader Lease")?;
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .context("the sharder's leader Lease has no holder")?;
    processes
        .iter()
        .position(|p| {
            p.id()
                .is_some_and(|pid| holder.contains(&format!("_{pid}_")))
        })
        .with_context(|| format!("the leader {holder:?} is none of the started replicas"))
}

/// The report as text, each figure next to its goal where the issue sets one.
fn text(report: &Report) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} shard Leases in {} ring(s), each renewed every {} s",
        report.shards, report.rings, report.renew_period_seconds
    );
    for w in &report.windows {
        let _ = writeln!(out, "\n## {} ({:.0} s)", w.name, w.seconds);
        let _ = writeln!(
            out,
            "renewals: {:.1}/s ({} failed); membership changes: {}",
            w.renewals_per_second, w.renewal_failures, w.membership_changes
        );
        for (role, r) in [("leader", &w.leader), ("follower", &w.follower)] {
            let goal = if w.membership_changes == 0 {
                format!(" (goal ≤ {CPU_GOAL_PERCENT} %)")
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                "{role}: CPU {:.2} % of a core{goal}; RSS {:.1} MiB; API requests {} (goal 0 for renewals) + {} of its own leader election; hash rings rebuilt {}",
                r.cpu_percent,
                r.rss_mib,
                r.main_requests,
                r.leader_election_requests,
                r.ring_calculations
            );
            for (labels, n) in &r.requests {
                let _ = writeln!(out, "  {n:>6} {labels}");
            }
        }
        let _ = writeln!(
            out,
            "API server: {} requests in the window, {} of them the tool's; besides Lease PATCHes:",
            w.apiserver_requests, w.tool_requests
        );
        for (kind, n) in &w.apiserver_other_requests {
            let _ = writeln!(out, "  {n:>6} {kind}");
        }
    }
    out
}
