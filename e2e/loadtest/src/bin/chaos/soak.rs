//! The phases of one run: start the processes, take the baseline, inject faults under churn,
//! restore, wait for convergence, measure leaks, and judge the evidence. Every phase covers each
//! ring under test; convergence and the evidence are judged per ring.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use e2e::fixtures::{create_ring, secrets_controlling_configmaps, wait_status};
use e2e::process::poll_until;
use e2e::{Cluster, IndependentRing, LABEL_NAMESPACE_NAME};
use futures::future::join_all;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use k8s_openapi::jiff::SignedDuration;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::range_lease::{
    ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES, Acknowledgement, PublishedRanges,
};
use kube_sharding_api::ranges::{RangeRing, fnv1a64};
use kube_sharding_api::{Assignment, ClusterRingSpec, RingResource};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::churn::{self, ChurnStats};
use crate::convergence::{self, Outcome, Target};
use crate::evidence::RunLog;
use crate::exits::{self, Outages};
use crate::faults::{FaultRecord, Injector};
use crate::findings::{ExitCounts, ShardCounts, Violation};
use crate::fleet::{self, Fleet, ShardRing, ShardTiming};
use crate::leases::LeaseLog;
use crate::ownership;
use crate::pins::{self, PinPlan};
use crate::plan::{self, FaultKind, round_ms};
use crate::probes::{self, Rss};
use crate::report::{Leaks, PinReport, Report, RingReport, Settings};
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

/// What a run works with: its flags, seed, cluster, and the rings the tool made.
pub(crate) struct Scene<'a> {
    pub(crate) args: &'a Args,
    pub(crate) seed: u64,
    pub(crate) cluster: &'a Cluster,
    pub(crate) client: Client,
    /// The rings under test, the webhook ring first; the fleet's ring indices follow this order.
    pub(crate) rings: Vec<RingScene>,
}

/// One ring under test, with namespaces, Leases and shards of its own, so that nothing one
/// ring's shards write (`checksums-<name>` ConfigMaps, Leases named after shards) is shared
/// with the other's.
pub(crate) struct RingScene {
    /// The ClusterRing's name.
    pub(crate) name: String,
    /// How its new objects get their shard label: the sharder's webhook, or its watch.
    pub(crate) assignment: Assignment,
    /// The ring's namespaces.
    pub(crate) namespaces: Vec<String>,
    /// Where its shards keep their Leases (outside the ring).
    pub(crate) lease_namespace: String,
    pub(crate) keys: LabelKeys,
    /// Its shards are named `<shard_prefix>-<n>`.
    pub(crate) shard_prefix: &'static str,
    /// Whether its shards leave their ConfigMaps to the sharder.
    pub(crate) leaves_children: bool,
    /// The stream of the seed its churn draws from.
    pub(crate) churn_stream: u64,
}

/// The running system and the tool's own watchers of it.
struct Started {
    fleet: Arc<Fleet>,
    /// Per ring: holder changes of its shard Leases, and versions of its Secrets.
    lease_logs: Vec<LeaseLog>,
    versions: Vec<VersionLog>,
    stalls: StallLog,
    /// Stops the supervisor and the Lease watch.
    stop: CancellationToken,
    /// Stops them however the run ends.
    _stop_guard: DropGuard,
    /// The API server's watches before any sharder or shard ran.
    idle_watches: BTreeMap<String, u64>,
    /// Per ring: the pins the tool set.
    pins: Vec<PinPlan>,
}

/// What the chaos phase did.
struct Chaos {
    injector: Injector,
    /// Per ring: its churn, and what the restore did to its shards.
    churn: Vec<ChurnStats>,
    restore: Vec<Vec<String>>,
    /// When the last fault ended, or the restore changed the shards, whichever is later.
    last_change: Instant,
}

/// What the wait for convergence of one ring found.
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
    let mut violations = leak_violations(&leaks);

    let stalls = started.stalls.stalls();
    let renew_deadline = SignedDuration::try_from_secs_f64(timing.renew_deadline)
        .unwrap_or(SignedDuration::from_secs(10));
    let outages = Outages {
        restarts: &chaos.injector.disruptions,
        heartbeat: &started.stalls,
        renew_deadline,
        deleted_leases: &chaos.injector.deleted_leases,
    };
    let (sharder_exits, sharder_violations) = judge_sharders(fleet, &outages);
    violations.extend(sharder_violations);

    let records = &chaos.injector.records;
    let mut rings = Vec::new();
    for (index, ((ring, converged), (churn, restore))) in scene
        .rings
        .iter()
        .zip(converged)
        .zip(chaos.churn.into_iter().zip(chaos.restore))
        .enumerate()
    {
        let judged = judge_ring(
            fleet,
            index,
            ring.assignment,
            &started.lease_logs[index],
            &started.versions[index],
            &outages,
        );
        let (faults_by_kind, faults_skipped) = by_kind(
            records
                .iter()
                .filter(|r| r.ring.as_deref() == Some(ring.name.as_str())),
        );
        let pins = pin_report(
            &started.pins[index],
            &started.versions[index],
            records
                .iter()
                .filter(|r| r.ring.as_deref() == Some(ring.name.as_str())),
        );
        let mut ring_violations = converged.violations();
        ring_violations.extend(judged.violations);
        rings.push(RingReport {
            name: ring.name.clone(),
            assignment: ring.assignment,
            shards_leave_children: ring.leaves_children,
            namespaces: ring.namespaces.clone(),
            lease_namespace: ring.lease_namespace.clone(),
            faults_by_kind,
            faults_skipped,
            restore,
            churn,
            converged_after_last_fault_seconds: converged.after_last_change,
            convergence: converged.outcome,
            pins,
            shards: judged.shards,
            drains_logged_after_lease_end: judged.drains_logged_after_end,
            drains_dated_by_watch: judged.drains_dated_by_watch,
            drains_never_logged: judged.drains_never_logged,
            exits: judged.exits,
            violations: ring_violations,
        });
    }
    let (faults_by_kind, faults_skipped) = by_kind(records.iter().filter(|r| r.ring.is_none()));

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
            logs: e2e::process::log_dir()?.display().to_string(),
        },
        faults_by_kind,
        faults_skipped,
        faults: records.clone(),
        convergence_bound_seconds: round_ms(convergence_bound(args)),
        rings,
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
        sharder_exits,
        leaks,
        violations,
        seconds_total: 0.0,
    })
}

/// The faults of `records` carried out, by kind, and how many were skipped or failed.
fn by_kind<'a>(
    records: impl Iterator<Item = &'a FaultRecord>,
) -> (BTreeMap<&'static str, usize>, usize) {
    let mut done: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut skipped = 0;
    for record in records {
        if record.outcome == "done" {
            *done.entry(record.kind.name()).or_default() += 1;
        } else {
            skipped += 1;
        }
    }
    (done, skipped)
}

/// Creates the rings, starts the tool's watchers, both sharder replicas and the shards of each
/// ring, and waits until each ring assigns as the ring of all its shards predicts; then creates
/// each ring's pinned Secrets and waits until they are on their pins.
async fn start(scene: &Scene<'_>, timing: ShardTiming) -> anyhow::Result<Started> {
    let client = &scene.client;
    for ring in &scene.rings {
        create_ring(client, &ring.name, ring_spec(ring)).await?;
    }
    let shard_rings = scene
        .rings
        .iter()
        .map(|ring| ShardRing {
            ring: ring.name.clone(),
            lease_namespace: ring.lease_namespace.clone(),
            shard_prefix: ring.shard_prefix,
            leaves_children: ring.leaves_children,
            server_side_namespace: (ring.assignment == Assignment::ServerSide)
                .then(|| ring.namespaces[0].clone()),
        })
        .collect();
    let fleet = Arc::new(
        Fleet::new(
            scene.cluster.kubeconfig(),
            shard_rings,
            timing,
            LEADER_ELECTION,
        )
        .await?,
    );
    let stop = CancellationToken::new();
    tokio::spawn(fleet.clone().supervise(stop.clone()));
    let (mut lease_logs, mut versions) = (Vec::new(), Vec::new());
    for ring in &scene.rings {
        let lease_log = LeaseLog::default();
        tokio::spawn(lease_log.clone().follow(
            client.clone(),
            ring.lease_namespace.clone(),
            ring.name.clone(),
            stop.clone(),
        ));
        let version_log = VersionLog::new(ring.keys.clone());
        for namespace in &ring.namespaces {
            tokio::spawn(version_log.clone().follow(
                client.clone(),
                namespace.clone(),
                stop.clone(),
            ));
        }
        lease_logs.push(lease_log);
        versions.push(version_log);
    }
    let stalls = StallLog::default();
    tokio::spawn(stalls.clone().follow(
        client.clone(),
        scene.rings[0].lease_namespace.clone(),
        stop.clone(),
    ));
    poll_until("the tool's watches", STARTUP, || {
        let listed = scene.rings.iter().enumerate().all(|(i, ring)| {
            lease_logs[i].is_listed() && versions[i].listed() == ring.namespaces.len()
        });
        async move { Ok(listed.then_some(())) }
    })
    .await?;
    // The API server's watches without the sharders and shards: subtracted from the readings
    // with them, so that what the control plane itself adds meanwhile (the garbage collector
    // starts watching the ring's CRD up to 30 s after it was installed) does not count.
    let idle_watches = probes::watches(client).await?;

    let pins: Vec<PinPlan> = (0..scene.rings.len())
        .map(|index| {
            // A zero-write ring ignores pins (docs/zero-write-rings.md): none to check.
            if scene.rings[index].assignment == Assignment::ServerSide {
                return PinPlan::default();
            }
            let shards: Vec<String> = (0..scene.args.shards)
                .map(|n| fleet.shard_name(index, n))
                .collect();
            let next = fleet.shard_name(index, scene.args.shards);
            PinPlan::draw(&scene.rings[index].namespaces, &shards, &next)
        })
        .collect();
    for (ring, plan) in scene.rings.iter().zip(&pins) {
        plan.pin_namespace(client, &ring.keys.pin).await?;
    }

    fleet.start_sharders(STARTUP).await?;
    for index in 0..scene.rings.len() {
        for _ in 0..scene.args.shards {
            fleet.add_shard(index)?;
        }
    }
    let count = i32::try_from(scene.args.shards)?;
    for (index, ring) in scene.rings.iter().enumerate() {
        wait_status(client, &ring.name, count, count).await?;
        let namespace = &ring.namespaces[0];
        let shards = fleet.wanted_shards(index);
        match ring.assignment {
            Assignment::Webhook => wait_webhook(client, namespace, &ring.keys, &shards).await?,
            Assignment::Watch => wait_watch(client, namespace, &ring.keys, &shards).await?,
            Assignment::ServerSide => {
                wait_ranges(client, &ring.lease_namespace, &ring.name, &shards).await?;
            }
        }
    }
    for (ring, plan) in scene.rings.iter().zip(&pins) {
        plan.create_objects(client, &ring.keys.pin).await?;
    }
    for (index, (ring, plan)) in scene.rings.iter().zip(&pins).enumerate() {
        wait_pinned(client, &ring.keys, plan, &fleet.wanted_shards(index)).await?;
    }
    progress(&format!(
        "{} sharder replicas and {} shards in each of {} rings running",
        fleet.sharder_slots(),
        scene.args.shards,
        scene.rings.len()
    ));
    Ok(Started {
        fleet,
        lease_logs,
        versions,
        stalls,
        _stop_guard: stop.clone().drop_guard(),
        stop,
        idle_watches,
        pins,
    })
}

/// The ring: Secrets controlling ConfigMaps, in exactly its namespaces, assigned its way. A
/// zero-write ring hashes uids, which leaves no room for controlled resources: Secrets alone
/// (their ConfigMaps are the shards' own, outside the ring).
fn ring_spec(ring: &RingScene) -> ClusterRingSpec {
    ClusterRingSpec {
        resources: vec![if ring.assignment == Assignment::ServerSide {
            RingResource::new("", "secrets")
        } else {
            secrets_controlling_configmaps()
        }],
        namespace_selector: Some(LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: LABEL_NAMESPACE_NAME.into(),
                operator: "In".into(),
                values: Some(ring.namespaces.clone()),
            }]),
        }),
        hash_key: None,
        lease_namespaces: Vec::new(),
        // The webhook ring's spec stays as it was before there was a choice: the default.
        assignment: (ring.assignment != Assignment::Webhook).then_some(ring.assignment),
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

/// Creates a Secret of a Watch ring and waits until the sharder's watch labels it as the
/// independent ring of `shards` predicts: the watch of unassigned objects is up and the sharder
/// sees every shard. A dry run, as for the webhook, would prove nothing: a watch sees only what
/// is stored. The Secret stays, one more object that must converge.
async fn wait_watch(
    client: &Client,
    namespace: &str,
    keys: &LabelKeys,
    shards: &[String],
) -> anyhow::Result<()> {
    const NAME: &str = "ready-probe";
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let ring = IndependentRing::unweighted(shards.iter().map(String::as_str));
    let expected = ring
        .try_shard_for(&secret_key(namespace, NAME))
        .map(str::to_string);
    let probe: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": NAME}
    }))?;
    api.create(&PostParams::default(), &probe)
        .await
        .with_context(|| format!("failed to create Secret {NAME}"))?;
    poll_until("the watch to assign like the ring", STARTUP, || {
        let (api, expected) = (api.clone(), expected.clone());
        async move {
            let probe = api.get(NAME).await?;
            Ok((probe.labels().get(&keys.shard).cloned() == expected).then_some(()))
        }
    })
    .await
}

/// Waits until the sharder has published to each of `shards` its share of the ring of exactly
/// these shards and each has acknowledged it: a zero-write ring's handover works before the
/// faults start.
async fn wait_ranges(
    client: &Client,
    lease_namespace: &str,
    ring: &str,
    shards: &[String],
) -> anyhow::Result<()> {
    let target = RangeRing::new(shards);
    let api = Api::<Lease>::namespaced(client.clone(), lease_namespace);
    poll_until(
        "the ranges to be published and acknowledged",
        STARTUP,
        || {
            let (api, target) = (api.clone(), &target);
            async move {
                for shard in shards {
                    let Some(lease) = api.get_opt(shard).await? else {
                        return Ok(None);
                    };
                    let annotations = lease.annotations();
                    let published = annotations
                        .get(ANNOTATION_RANGES)
                        .and_then(|r| r.parse::<PublishedRanges>().ok());
                    let acknowledged = annotations
                        .get(ANNOTATION_ACKNOWLEDGED)
                        .and_then(|a| a.parse::<Acknowledgement>().ok());
                    let settled = published.is_some_and(|p| {
                        *p.ranges() == target.ranges_of(shard)
                            && acknowledged.is_some_and(|a| a.generation == p.generation())
                    });
                    if !settled {
                        return Ok(None);
                    }
                }
                Ok(Some(()))
            }
        },
    )
    .await
    .with_context(|| format!("ring {ring}"))
}

/// Waits until every pinned Secret of `plan` is where its pin puts it among `shards` (the last,
/// pinned to a shard not yet added, on the ring's choice): pins work before the faults start.
async fn wait_pinned(
    client: &Client,
    keys: &LabelKeys,
    plan: &PinPlan,
    shards: &[String],
) -> anyhow::Result<()> {
    let ring = IndependentRing::unweighted(shards.iter().map(String::as_str));
    let available: BTreeSet<String> = shards.iter().cloned().collect();
    let namespace_pin = plan.namespace.as_ref();
    poll_until("the pinned Secrets to be placed", STARTUP, || async {
        for object in &plan.objects {
            let secret = Api::<Secret>::namespaced(client.clone(), &object.namespace)
                .get(&object.name)
                .await?;
            let namespace = namespace_pin
                .filter(|(ns, _)| *ns == object.namespace)
                .map(|(_, shard)| shard.as_str());
            let expected = pins::predict(
                &ring,
                &available,
                Some(&object.shard),
                namespace,
                &secret_key(&object.namespace, &object.name),
            );
            if secret.labels().get(&keys.shard).map(String::as_str) != expected {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await
}

/// What the pins of `plan` went through: the faults among `records` that struck a pinned shard,
/// and how often a pinned Secret came back to its pin, as the tool's watch saw it.
fn pin_report<'a>(
    plan: &PinPlan,
    versions: &VersionLog,
    records: impl Iterator<Item = &'a FaultRecord>,
) -> PinReport {
    let shards = plan.shards();
    PinReport {
        namespace: plan.namespace.clone(),
        objects: plan
            .objects
            .iter()
            .map(|o| (format!("{}/{}", o.namespace, o.name), o.shard.clone()))
            .collect(),
        faults_on_pinned_shards: records
            .filter(|r| r.outcome == "done")
            .filter(|r| r.target.as_deref().is_some_and(|t| shards.contains(t)))
            .count(),
        returns_to_pin: plan
            .objects
            .iter()
            .map(|o| {
                let held = versions.shards_held(&format!("{}/{}", o.namespace, o.name));
                pins::returns(&held, &o.shard)
            })
            .sum(),
    }
}

/// Churns every ring and carries out the fault plan for `--duration`, waits for every fault to
/// end, and brings each ring's shards back to `--shards`.
async fn inject(scene: &Scene<'_>, fleet: &Arc<Fleet>) -> anyhow::Result<Chaos> {
    let args = scene.args;
    let local = scene.cluster.state_dir();
    let kinds: Vec<FaultKind> = FaultKind::ALL
        .into_iter()
        .filter(|k| *k != FaultKind::ApiserverRestart || local.is_some())
        .collect();
    let plan = plan::draw(scene.seed, &plan_timing(args), &kinds);
    progress(&format!(
        "chaos for {:.0} s: {} faults planned, {} churn ops/s in each ring",
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
    let churns: Vec<_> = scene
        .rings
        .iter()
        .map(|ring| {
            tokio::spawn(churn::run(
                scene.client.clone(),
                churn::ChurnConfig {
                    namespaces: ring.namespaces.clone(),
                    rate: args.rate,
                    objects: args.objects,
                    seed: scene.seed,
                    stream: ring.churn_stream,
                    // The zero-write ring's shards take a while over these (see `fleet`).
                    prefix: if ring.assignment == Assignment::ServerSide {
                        fleet::SLOW_PREFIX
                    } else {
                        churn::SECRET_PREFIX
                    },
                },
                churn_stop.clone(),
            ))
        })
        .collect();
    let chaos_started = Instant::now();
    let ((), churn) = tokio::join!(injector.run(&plan), async {
        tokio::time::sleep(args.duration).await;
        churn_stop.cancel();
        progress("churn stopped");
        join_all(churns).await
    });
    let churn = churn
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .context("a churn task failed")?;
    progress("every fault has ended; restoring the starting number of shards");

    let mut last_change = chaos_started
        + injector
            .last_ended()
            .map_or(Duration::ZERO, Duration::from_secs_f64);
    let restore = (0..scene.rings.len())
        .map(|ring| restore(fleet, ring, args.shards))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if restore.iter().any(|done| !done.is_empty()) {
        last_change = Instant::now();
    }
    Ok(Chaos {
        injector,
        churn,
        restore,
        last_change,
    })
}

/// Brings the wanted shards of `ring` back to `count`: retires the newest extras or adds new
/// ones. Returns what it did.
fn restore(fleet: &Fleet, ring: usize, count: usize) -> anyhow::Result<Vec<String>> {
    let mut done = Vec::new();
    let mut wanted = fleet.wanted_shards(ring);
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
        fleet.retire_shard(ring, name)?;
        done.push(format!("retired {name}"));
    }
    for _ in wanted.len()..count {
        let name = fleet.add_shard(ring)?;
        done.push(format!("added {name}"));
    }
    for line in &done {
        progress(line);
    }
    Ok(done)
}

/// Worst case after the last change: a shard killed then is declared dead `2 D` after its last
/// renewal; started again under the same name, it waits out the takeover Lease (`2 D` more)
/// before taking its Lease back; a killed leader is replaced after its lease duration.
fn convergence_bound(args: &Args) -> Duration {
    args.lease_duration * 4 + Duration::from_secs(u64::from(LEADER_ELECTION.0)) + CONVERGENCE_MARGIN
}

/// Waits until every wanted process runs, creates a probe Secret for each shard of each ring,
/// and waits for invariants 2 and 3 to hold in every ring (at once, each on its own) within the
/// bound after `last_change`. Returns what it found per ring.
async fn converge(
    scene: &Scene<'_>,
    fleet: &Arc<Fleet>,
    last_change: Instant,
) -> anyhow::Result<Vec<Converged>> {
    let args = scene.args;
    poll_until("every wanted process to run", STARTUP, || {
        let fleet = fleet.clone();
        async move { Ok(fleet.all_wanted_running().then_some(())) }
    })
    .await?;
    for (index, ring) in scene.rings.iter().enumerate() {
        let shards = fleet.wanted_shards(index);
        let namespace = &ring.namespaces[0];
        let probes = if ring.assignment == Assignment::ServerSide {
            create_uid_probes(&scene.client, namespace, &shards).await?
        } else {
            create_probes(&scene.client, namespace, &shards).await?
        };
        progress(&format!(
            "created {} probe Secrets in ring {}, one for each shard, that the shards must reconcile",
            probes.len(),
            ring.name
        ));
    }

    let bound = convergence_bound(args);
    progress("waiting for convergence");
    let waits = scene
        .rings
        .iter()
        .enumerate()
        .map(|(index, ring)| async move {
            let outcome = convergence::wait(
                &Target {
                    client: &scene.client,
                    namespaces: &ring.namespaces,
                    lease_namespace: &ring.lease_namespace,
                    ring: &ring.name,
                    keys: &ring.keys,
                    zero_write: ring.assignment == Assignment::ServerSide,
                },
                || {
                    fleet
                        .active_shards(index)
                        .into_iter()
                        .collect::<BTreeSet<_>>()
                },
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
                "ring {} converged {} after the last fault",
                ring.name,
                after_last_change.map_or_else(|| "never".to_string(), |s| format!("{s:.1} s"))
            ));
            Converged {
                outcome,
                bound,
                after_last_change,
            }
        });
    Ok(join_all(waits).await)
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

/// [`create_probes`] for a zero-write ring, which hashes uids, unknown before creation:
/// creates Secrets until each of `shards` owns one in the ring of exactly these shards.
async fn create_uid_probes(
    client: &Client,
    namespace: &str,
    shards: &[String],
) -> anyhow::Result<Vec<String>> {
    /// Plenty: at 5 shards the chance that 200 draws miss one is below 10^-19.
    const MOST: usize = 200;
    let ring = RangeRing::new(shards);
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let mut missing: BTreeSet<&str> = shards.iter().map(String::as_str).collect();
    let mut names = Vec::new();
    for i in 0..MOST {
        if missing.is_empty() {
            return Ok(names);
        }
        let name = format!("probe-{i}");
        let secret: Secret = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "stringData": {"probe": name},
        }))?;
        let created = api
            .create(&PostParams::default(), &secret)
            .await
            .with_context(|| format!("failed to create probe Secret {name}"))?;
        let uid = created.uid().context("a Secret without uid")?;
        if let Some(owner) = ring.owner(fnv1a64(&uid)) {
            missing.remove(owner);
        }
        names.push(name);
    }
    anyhow::bail!("{MOST} probe Secrets left {missing:?} without one")
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

/// What the evidence about one ring's shards says.
struct Judged {
    violations: Vec<Violation>,
    shards: BTreeMap<String, ShardCounts>,
    exits: ExitCounts,
    drains_logged_after_end: usize,
    drains_dated_by_watch: usize,
    drains_never_logged: usize,
}

/// Invariant 1 and the crash half of invariant 4 for the shards of `ring`, from every process's
/// log and record. The rings' shards are judged apart: an object belongs to one ring only, and a
/// shard of one ring letting go says nothing about the other's.
fn judge_ring(
    fleet: &Fleet,
    ring: usize,
    assignment: Assignment,
    lease_log: &LeaseLog,
    versions: &VersionLog,
    outages: &Outages<'_>,
) -> Judged {
    let state = fleet.lock();
    let mut runs = Vec::new();
    let mut ended = Vec::new();
    for (name, member) in &state.shards[ring] {
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
    let found = match assignment {
        Assignment::ServerSide => ownership::check_zero_write(&runs, &lease_log.changes()),
        Assignment::Webhook | Assignment::Watch => {
            ownership::check(&runs, &lease_log.changes(), versions)
        }
    };
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

/// The crash half of invariant 4 for the sharder replicas, which serve every ring.
fn judge_sharders(fleet: &Fleet, outages: &Outages<'_>) -> (ExitCounts, Vec<Violation>) {
    let state = fleet.lock();
    let mut ended = Vec::new();
    for (slot, member) in state.sharders.iter().enumerate() {
        for incarnation in &member.incarnations {
            ended.push(exits::Ended {
                who: format!("sharder-{slot}"),
                incarnation,
                lost_lease: None,
            });
        }
    }
    exits::classify(&ended, outages)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring_scene(assignment: Assignment) -> RingScene {
        RingScene {
            name: "r".into(),
            assignment,
            namespaces: vec!["a".into(), "b".into()],
            lease_namespace: "leases".into(),
            keys: LabelKeys::for_ring("r").expect("short name"),
            shard_prefix: "shard",
            leaves_children: false,
            churn_stream: 2,
        }
    }

    /// The webhook ring's spec is the one the single ring had (the default assignment); the
    /// Watch ring's differs only in its assignment.
    #[test]
    fn ring_specs_differ_only_in_assignment() {
        let webhook = ring_spec(&ring_scene(Assignment::Webhook));
        let watch = ring_spec(&ring_scene(Assignment::Watch));
        assert_eq!(webhook.assignment, None);
        assert_eq!(watch.assignment, Some(Assignment::Watch));
        assert_eq!(
            ClusterRingSpec {
                assignment: None,
                ..watch
            },
            webhook
        );
    }

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
