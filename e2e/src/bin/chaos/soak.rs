//! The phases of one run: start the processes, take the baseline, inject faults under churn,
//! restore, wait for convergence, measure leaks, and judge the evidence.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use e2e::fixtures::{create_ring, secrets_controlling_configmaps, wait_status};
use e2e::process::poll_until;
use e2e::{Cluster, IndependentRing, LABEL_NAMESPACE_NAME};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use k8s_openapi::jiff::SignedDuration;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use sharding_crds::ClusterRingSpec;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::churn::{self, ChurnStats};
use crate::convergence::{self, Outcome, Target};
use crate::evidence::RunLog;
use crate::exits::{self, Outages};
use crate::faults::Injector;
use crate::findings::{ExitCounts, ShardCounts, Violation};
use crate::fleet::{self, Fleet, ShardTiming};
use crate::leases::LeaseLog;
use crate::ownership;
use crate::plan::{self, FaultKind, round_ms};
use crate::probes::{self, Rss};
use crate::report::{Leaks, Report, Settings};
use crate::ring::{LabelKeys, secret_key};
use crate::stalls::StallLog;
use crate::versions::VersionLog;
use crate::{Args, plan_timing, progress};

/// Leader election of the sharder replicas (duration, renew deadline, retry period, seconds):
/// short enough that a killed leader is replaced within seconds, long enough that a busy machine
/// does not make leadership flap.
const LEADER_ELECTION: (u32, u32, u32) = (8, 6, 2);

/// How long processes may take to start and become ready.
const STARTUP: Duration = Duration::from_secs(90);

/// Faults of the plan listed in the progress output.
const PLAN_SHOWN: usize = 22;

/// Most shards above `--shards` that scale-outs may add.
const EXTRA_SHARDS: usize = 2;

/// Margin of the convergence bound for what is not a Lease timeout: syncs and their retries,
/// webhook backoff, and a busy machine.
const CONVERGENCE_MARGIN: Duration = Duration::from_secs(30);

/// How long the API server's watch count may take to settle after convergence.
const WATCHES_SETTLE: Duration = Duration::from_secs(60);

/// A sharder replica's RSS after the run may not exceed this many times its RSS before...
const RSS_FACTOR: u64 = 3;
/// ...unless it grew by less than this (KiB): small processes double on noise.
const RSS_SLACK_KIB: u64 = 64 * 1024;

/// What a run works with: its flags, seed, cluster, and the ring the tool made.
pub(crate) struct Scene<'a> {
    pub(crate) args: &'a Args,
    pub(crate) seed: u64,
    pub(crate) cluster: &'a Cluster,
    pub(crate) client: Client,
    /// The ring's namespaces.
    pub(crate) namespaces: Vec<String>,
    /// Where the shards keep their Leases (outside the ring).
    pub(crate) lease_namespace: String,
    pub(crate) ring: String,
    pub(crate) keys: LabelKeys,
}

/// The running system and the tool's own watchers of it.
struct Started {
    fleet: Arc<Fleet>,
    lease_log: LeaseLog,
    versions: VersionLog,
    stalls: StallLog,
    /// Stops the supervisor and the Lease watch.
    stop: CancellationToken,
    /// Stops them however the run ends.
    _stop_guard: DropGuard,
    /// The API server's watches before any sharder or shard ran.
    idle_watches: BTreeMap<String, u64>,
}

/// What the chaos phase did.
struct Chaos {
    injector: Injector,
    churn: ChurnStats,
    restore: Vec<String>,
    /// When the last fault ended, or the restore changed the shards, whichever is later.
    last_change: Instant,
}

/// What the wait for convergence found.
struct Converged {
    outcome: Outcome,
    bound: Duration,
    /// Seconds from the last change until both invariants held.
    after_last_change: Option<f64>,
}

/// Runs every phase and reports.
pub(crate) async fn soak(scene: &Scene<'_>) -> anyhow::Result<Report> {
    let timing = ShardTiming::scaled(scene.args.lease_duration);
    let started = start(scene, timing).await?;
    let fleet = &started.fleet;
    // The baseline, once the leader's watches are up.
    let with_watches = probes::stable_watches(
        &scene.client,
        Duration::from_secs(3),
        Duration::from_secs(20),
    )
    .await?;
    let mut leaks = Leaks {
        watches_before: probes::difference(&with_watches, &started.idle_watches),
        rss_before: rss(fleet),
        ..Default::default()
    };

    let chaos = inject(scene, fleet).await?;
    let converged = converge(scene, fleet, chaos.last_change).await?;
    let mut violations = converged.violations();

    // Every client re-establishes its watches a while after the faults.
    let with_watches =
        probes::stable_watches(&scene.client, Duration::from_secs(5), WATCHES_SETTLE).await?;
    leaks.rss_after = rss(fleet);
    progress("stopping every process");
    fleet.stop_all(Duration::from_secs(30)).await;
    let idle_watches = probes::stable_watches(
        &scene.client,
        Duration::from_secs(3),
        Duration::from_secs(30),
    )
    .await?;
    started.stop.cancel();
    leaks.watches_after = probes::difference(&with_watches, &idle_watches);
    violations.extend(leak_violations(&leaks));

    let stalls = started.stalls.stalls();
    let renew_deadline = SignedDuration::try_from_secs_f64(timing.renew_deadline)
        .unwrap_or(SignedDuration::from_secs(10));
    let judged = judge(
        fleet,
        &started.lease_log,
        &started.versions,
        &Outages {
            restarts: &chaos.injector.disruptions,
            heartbeat: &started.stalls,
            renew_deadline,
            deleted_leases: &chaos.injector.deleted_leases,
        },
    );
    violations.extend(judged.violations);

    let records = &chaos.injector.records;
    let mut faults_by_kind: BTreeMap<&'static str, usize> = BTreeMap::new();
    for record in records.iter().filter(|r| r.outcome == "done") {
        *faults_by_kind.entry(record.kind.name()).or_default() += 1;
    }
    let args = scene.args;
    Ok(Report {
        settings: Settings {
            seed: scene.seed,
            duration_seconds: round_ms(args.duration),
            rate: args.rate,
            shards: args.shards,
            namespaces: args.namespaces,
            objects: args.objects,
            fault_interval_seconds: round_ms(args.fault_interval),
            shard_timing: timing,
            leader_election: LEADER_ELECTION,
            profile: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            server_version: String::new(),
            logs: fleet::log_dir().display().to_string(),
        },
        faults_skipped: records.iter().filter(|r| r.outcome != "done").count(),
        faults_by_kind,
        faults: records.clone(),
        restore: chaos.restore,
        churn: chaos.churn,
        converged_after_last_fault_seconds: converged.after_last_change,
        convergence_bound_seconds: round_ms(converged.bound),
        convergence: converged.outcome,
        shards: judged.shards,
        drains_logged_after_lease_end: judged.drains_logged_after_end,
        drains_dated_by_watch: judged.drains_dated_by_watch,
        drains_never_logged: judged.drains_never_logged,
        api_stalls: stalls.len(),
        longest_api_stall_seconds: stalls
            .iter()
            .map(|(from, to)| to.duration_since(*from).as_secs_f64())
            .fold(0.0, f64::max),
        api_stall_list: stalls
            .iter()
            .map(|(from, to)| {
                let seconds = to.duration_since(*from).as_secs_f64();
                (from.to_string(), (seconds * 1000.0).round() / 1000.0)
            })
            .collect(),
        exits: judged.exits,
        leaks,
        violations,
        seconds_total: 0.0,
    })
}

/// Creates the ring, starts the tool's watchers, both sharder replicas and the shards, and
/// waits until the webhook assigns as the ring of all shards predicts.
async fn start(scene: &Scene<'_>, timing: ShardTiming) -> anyhow::Result<Started> {
    let client = &scene.client;
    create_ring(client, &scene.ring, ring_spec(&scene.namespaces)).await?;
    let fleet = Arc::new(
        Fleet::new(
            scene.cluster.kubeconfig(),
            &scene.ring,
            &scene.lease_namespace,
            timing,
            LEADER_ELECTION,
        )
        .await?,
    );
    let stop = CancellationToken::new();
    tokio::spawn(fleet.clone().supervise(stop.clone()));
    let lease_log = LeaseLog::default();
    tokio::spawn(lease_log.clone().follow(
        client.clone(),
        scene.lease_namespace.clone(),
        scene.ring.clone(),
        stop.clone(),
    ));
    let versions = VersionLog::new(scene.keys.clone());
    for namespace in &scene.namespaces {
        tokio::spawn(
            versions
                .clone()
                .follow(client.clone(), namespace.clone(), stop.clone()),
        );
    }
    let stalls = StallLog::default();
    tokio::spawn(stalls.clone().follow(
        client.clone(),
        scene.lease_namespace.clone(),
        stop.clone(),
    ));
    poll_until("the tool's watches", STARTUP, || {
        let listed = lease_log.is_listed() && versions.listed() == scene.namespaces.len();
        async move { Ok(listed.then_some(())) }
    })
    .await?;
    // The API server's watches without the sharders and shards: subtracted from the readings
    // with them, so that what the control plane itself adds meanwhile (the garbage collector
    // starts watching the ring's CRD up to 30 s after it was installed) does not count.
    let idle_watches = probes::watches(client).await?;

    fleet.start_sharders(STARTUP).await?;
    for _ in 0..scene.args.shards {
        fleet.add_shard()?;
    }
    let count = i32::try_from(scene.args.shards)?;
    wait_status(client, &scene.ring, count, count).await?;
    wait_webhook(
        client,
        &scene.namespaces[0],
        &scene.keys,
        &fleet.wanted_shards(),
    )
    .await?;
    progress(&format!(
        "{} sharder replicas and {} shards running",
        fleet.sharder_slots(),
        scene.args.shards
    ));
    Ok(Started {
        fleet,
        lease_log,
        versions,
        stalls,
        _stop_guard: stop.clone().drop_guard(),
        stop,
        idle_watches,
    })
}

/// The ring: Secrets controlling ConfigMaps, in exactly the tool's namespaces.
fn ring_spec(namespaces: &[String]) -> ClusterRingSpec {
    ClusterRingSpec {
        resources: vec![secrets_controlling_configmaps()],
        namespace_selector: Some(LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: LABEL_NAMESPACE_NAME.into(),
                operator: "In".into(),
                values: Some(namespaces.to_vec()),
            }]),
        }),
        hash_key: None,
        lease_namespaces: Vec::new(),
        assignment: None,
    }
}

/// Waits until the webhook assigns a dry-run Secret as the independent ring of `shards`
/// predicts: the webhook configuration is in place and the sharder sees every shard.
async fn wait_webhook(
    client: &Client,
    namespace: &str,
    keys: &LabelKeys,
    shards: &[String],
) -> anyhow::Result<()> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let ring = IndependentRing::unweighted(shards.iter().map(String::as_str));
    let expected = ring
        .try_shard_for(&secret_key(namespace, "probe"))
        .map(str::to_string);
    poll_until("the webhook to assign like the ring", STARTUP, || {
        let (api, expected) = (api.clone(), expected.clone());
        async move {
            let params = PostParams {
                dry_run: true,
                ..Default::default()
            };
            let probe: Secret = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "probe"}
            }))?;
            let created = api.create(&params, &probe).await?;
            Ok((created.labels().get(&keys.shard).cloned() == expected).then_some(()))
        }
    })
    .await
}

/// Churns and carries out the fault plan for `--duration`, waits for every fault to end, and
/// brings the shards back to `--shards`.
async fn inject(scene: &Scene<'_>, fleet: &Arc<Fleet>) -> anyhow::Result<Chaos> {
    let args = scene.args;
    let local = scene.cluster.state_dir();
    let kinds: Vec<FaultKind> = FaultKind::ALL
        .into_iter()
        .filter(|k| *k != FaultKind::ApiserverRestart || local.is_some())
        .collect();
    let plan = plan::draw(scene.seed, &plan_timing(args), &kinds);
    progress(&format!(
        "chaos for {:.0} s: {} faults planned, {} churn ops/s",
        args.duration.as_secs_f64(),
        plan.len(),
        args.rate
    ));
    let shown: Vec<String> = plan
        .iter()
        .take(PLAN_SHOWN)
        .map(|f| format!("{:.1}s {}", f.at_seconds, f.kind.name()))
        .collect();
    let more = plan.len().saturating_sub(PLAN_SHOWN);
    progress(&format!(
        "plan: {}{}",
        shown.join(", "),
        if more > 0 {
            format!(", ... and {more} more (--plan-only prints them all)")
        } else {
            String::new()
        }
    ));
    let mut injector = Injector::new(
        fleet.clone(),
        scene.client.clone(),
        local.map(e2e::apiserver::ApiServer::new),
        args.shards + EXTRA_SHARDS,
        Duration::from_secs(u64::from(LEADER_ELECTION.0) * 3),
    );
    let churn_stop = CancellationToken::new();
    let churn = tokio::spawn(churn::run(
        scene.client.clone(),
        churn::ChurnConfig {
            namespaces: scene.namespaces.clone(),
            rate: args.rate,
            objects: args.objects,
            seed: scene.seed,
        },
        churn_stop.clone(),
    ));
    let chaos_started = Instant::now();
    let ((), churn) = tokio::join!(injector.run(&plan), async {
        tokio::time::sleep(args.duration).await;
        churn_stop.cancel();
        progress("churn stopped");
        churn.await
    });
    let churn = churn.context("the churn task failed")?;
    progress("every fault has ended; restoring the starting number of shards");

    let mut last_change = chaos_started
        + injector
            .last_ended()
            .map_or(Duration::ZERO, Duration::from_secs_f64);
    let restore = restore(fleet, args.shards)?;
    if !restore.is_empty() {
        last_change = Instant::now();
    }
    Ok(Chaos {
        injector,
        churn,
        restore,
        last_change,
    })
}

/// Brings the wanted shards back to `count`: retires the newest extras or adds new ones.
/// Returns what it did.
fn restore(fleet: &Fleet, count: usize) -> anyhow::Result<Vec<String>> {
    let mut done = Vec::new();
    let mut wanted = fleet.wanted_shards();
    // Newest first: `shard-<n>` by number.
    wanted.sort_by_key(|name| {
        std::cmp::Reverse(
            name.rsplit('-')
                .next()
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or_default(),
        )
    });
    for name in wanted.iter().take(wanted.len().saturating_sub(count)) {
        fleet.retire_shard(name)?;
        done.push(format!("retired {name}"));
    }
    for _ in wanted.len()..count {
        let name = fleet.add_shard()?;
        done.push(format!("added {name}"));
    }
    for line in &done {
        progress(line);
    }
    Ok(done)
}

/// Waits until every wanted process runs, creates a probe Secret for each shard, and waits for
/// invariants 2 and 3 to hold within the bound after `last_change`.
async fn converge(
    scene: &Scene<'_>,
    fleet: &Arc<Fleet>,
    last_change: Instant,
) -> anyhow::Result<Converged> {
    let args = scene.args;
    poll_until("every wanted process to run", STARTUP, || {
        let fleet = fleet.clone();
        async move { Ok(fleet.all_wanted_running().then_some(())) }
    })
    .await?;
    let probes = create_probes(&scene.client, &scene.namespaces[0], &fleet.wanted_shards()).await?;
    progress(&format!(
        "created {} probe Secrets, one for each shard, that the shards must reconcile",
        probes.len()
    ));

    // Worst case after the last change: a shard killed then is declared dead `2 D` after its
    // last renewal; started again under the same name, it waits out the takeover Lease (`2 D`
    // more) before taking its Lease back; a killed leader is replaced after its lease duration.
    let bound = args.lease_duration * 4
        + Duration::from_secs(u64::from(LEADER_ELECTION.0))
        + CONVERGENCE_MARGIN;
    progress("waiting for convergence");
    let outcome = convergence::wait(
        &Target {
            client: &scene.client,
            namespaces: &scene.namespaces,
            lease_namespace: &scene.lease_namespace,
            ring: &scene.ring,
            keys: &scene.keys,
        },
        || fleet.active_shards().into_iter().collect::<BTreeSet<_>>(),
        last_change,
        bound,
        args.settle,
    )
    .await;
    let after_last_change = match (outcome.placement_seconds, outcome.content_seconds) {
        (Some(p), Some(c)) => Some(p.max(c)),
        _ => None,
    };
    progress(&format!(
        "converged {} after the last fault",
        after_last_change.map_or_else(|| "never".to_string(), |s| format!("{s:.1} s"))
    ));
    Ok(Converged {
        outcome,
        bound,
        after_last_change,
    })
}

impl Converged {
    /// Invariants 2 and 3 as violations: not holding, or holding only after the bound.
    fn violations(&self) -> Vec<Violation> {
        let bound = self.bound.as_secs_f64();
        let mut violations = Vec::new();
        let late = |s: Option<f64>| s.is_none_or(|s| s > bound);
        if late(self.outcome.placement_seconds) {
            violations.push(Violation {
                invariant: "convergence",
                detail: format!(
                    "placement not converged within {bound:.0} s of the last fault: {}",
                    self.outcome.placement_problems.join("; ")
                ),
            });
        }
        if late(self.outcome.content_seconds) {
            violations.push(Violation {
                invariant: "nothing-lost",
                detail: format!(
                    "checksums not right within {bound:.0} s of the last fault: {}",
                    self.outcome.content_problems.join("; ")
                ),
            });
        }
        violations
    }
}

/// Creates a Secret for each of `shards` that the ring of exactly these shards assigns to it, so
/// that convergence (their checksum ConfigMaps written) proves every shard works after the
/// faults, not only that nothing changed. Returns their names.
async fn create_probes(
    client: &Client,
    namespace: &str,
    shards: &[String],
) -> anyhow::Result<Vec<String>> {
    let ring = IndependentRing::unweighted(shards.iter().map(String::as_str));
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let mut names = Vec::new();
    for shard in shards {
        let name = (0..10_000)
            .map(|i| format!("probe-{shard}-{i}"))
            .find(|name| ring.try_shard_for(&secret_key(namespace, name)) == Some(shard.as_str()))
            .with_context(|| format!("no probe name maps to {shard}"))?;
        let secret: Secret = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "stringData": {"shard": shard},
        }))?;
        api.create(&PostParams::default(), &secret)
            .await
            .with_context(|| format!("failed to create probe Secret {name}"))?;
        names.push(name);
    }
    Ok(names)
}

/// Resident memory of every running sharder replica.
fn rss(fleet: &Fleet) -> Vec<Rss> {
    (0..fleet.sharder_slots())
        .filter_map(|slot| {
            let pid = fleet.sharder_pid(slot)?;
            Some(Rss {
                replica: slot,
                pid,
                rss_kib: e2e::process::rss_kib(pid).ok()?,
            })
        })
        .collect()
}

/// Invariant 4's measurements as violations: a replica's memory grown out of its order, or
/// more watches held on a resource than before.
fn leak_violations(leaks: &Leaks) -> Vec<Violation> {
    let mut violations = Vec::new();
    for after in &leaks.rss_after {
        let before = leaks
            .rss_before
            .iter()
            .find(|b| b.replica == after.replica)
            .map_or(0, |b| b.rss_kib);
        if before > 0
            && after.rss_kib > before * RSS_FACTOR
            && after.rss_kib > before + RSS_SLACK_KIB
        {
            violations.push(Violation {
                invariant: "no-leaks",
                detail: format!(
                    "sharder replica {} uses {} KiB after the run, {before} KiB before",
                    after.replica, after.rss_kib
                ),
            });
        }
    }
    for (resource, before, after) in grown(&leaks.watches_before, &leaks.watches_after) {
        violations.push(Violation {
            invariant: "no-leaks",
            detail: format!(
                "the sharders and shards hold {after} watches on {resource} after the run, \
                 {before} before"
            ),
        });
    }
    violations
}

/// Resources with more watches in `after` than in `before`: `(resource, before, after)`.
fn grown(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> Vec<(String, u64, u64)> {
    after
        .iter()
        .filter_map(|(resource, n)| {
            let b = before.get(resource).copied().unwrap_or(0);
            (*n > b).then(|| (resource.clone(), b, *n))
        })
        .collect()
}

/// What the evidence says.
struct Judged {
    violations: Vec<Violation>,
    shards: BTreeMap<String, ShardCounts>,
    exits: ExitCounts,
    drains_logged_after_end: usize,
    drains_dated_by_watch: usize,
    drains_never_logged: usize,
}

/// Invariant 1 and the crash half of invariant 4, from every process's log and record.
fn judge(
    fleet: &Fleet,
    lease_log: &LeaseLog,
    versions: &VersionLog,
    outages: &Outages<'_>,
) -> Judged {
    let state = fleet.lock();
    let mut runs = Vec::new();
    let mut ended = Vec::new();
    for (name, member) in &state.shards {
        for incarnation in &member.incarnations {
            let terms = RunLog::read_terms(incarnation.log_path());
            ended.push(exits::Ended {
                who: name.clone(),
                incarnation,
                lost_lease: terms.iter().find_map(RunLog::lost_at),
            });
            let last = terms.len() - 1;
            for (i, log) in terms.into_iter().enumerate() {
                runs.push(ownership::ShardRun {
                    shard: name.clone(),
                    pid: incarnation.pid,
                    log,
                    signals: incarnation.signals.clone(),
                    // An earlier term ended with the Lease released, not with the process.
                    exited: incarnation
                        .exit
                        .as_ref()
                        .filter(|_| i == last)
                        .map(|e| e.at),
                });
            }
        }
    }
    for (slot, member) in state.sharders.iter().enumerate() {
        for incarnation in &member.incarnations {
            ended.push(exits::Ended {
                who: format!("sharder-{slot}"),
                incarnation,
                lost_lease: None,
            });
        }
    }
    let found = ownership::check(&runs, &lease_log.changes(), versions);
    let mut violations = found.violations;
    let (exits, exit_violations) = exits::classify(&ended, outages);
    violations.extend(exit_violations);
    Judged {
        violations,
        shards: found.counts,
        exits,
        drains_logged_after_end: found.drains_logged_after_end,
        drains_dated_by_watch: found.drains_dated_by_watch,
        drains_never_logged: found.drains_never_logged,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_growth_counts_as_grown() {
        let before = BTreeMap::from([("secrets".to_string(), 5), ("leases".to_string(), 2)]);
        let after = BTreeMap::from([
            ("secrets".to_string(), 5),
            ("leases".to_string(), 1),
            ("configmaps".to_string(), 1),
        ]);
        assert_eq!(grown(&before, &after), [("configmaps".to_string(), 0, 1)]);
    }

    fn leaks(before_kib: u64, after_kib: u64) -> Leaks {
        let rss = |kib| {
            vec![Rss {
                replica: 0,
                pid: 1,
                rss_kib: kib,
            }]
        };
        Leaks {
            rss_before: rss(before_kib),
            rss_after: rss(after_kib),
            ..Default::default()
        }
    }

    /// Memory must both triple and grow by 64 MiB to count as a leak.
    #[test]
    fn memory_leaks_need_both_factor_and_size() {
        assert!(leak_violations(&leaks(30_000, 80_000)).is_empty());
        assert!(leak_violations(&leaks(300_000, 380_000)).is_empty());
        assert_eq!(leak_violations(&leaks(30_000, 100_000)).len(), 1);
    }
}
