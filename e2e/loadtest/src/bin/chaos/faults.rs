//! Carrying out the fault plan against the live system, and ending every fault: a paused shard
//! gets SIGCONT, a closed gate reopens, stopped processes are started again by the supervisor.
//!
//! A fault on shards ([`FaultKind::on_shards`]) strikes every ring under test at once, each
//! with a victim of its own picked the same way, and is recorded once per ring: so each ring
//! goes through the whole plan, as a single ring did before there were two.

use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::apiserver::ApiServer;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde::Serialize;

use crate::fleet::{Fleet, Then};
use crate::plan::{FaultKind, PlannedFault, round_ms};

/// What became of one planned fault.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct FaultRecord {
    /// Seconds after the chaos phase began that it was carried out.
    pub(crate) at_seconds: f64,
    pub(crate) kind: FaultKind,
    /// The ring whose shard (or shard Lease) it struck; `None` for a fault on the whole system.
    pub(crate) ring: Option<String>,
    /// The victim (shard name, `sharder-<slot>`, `kube-apiserver`, `webhook`), if any.
    pub(crate) target: Option<String>,
    pub(crate) hold_seconds: f64,
    /// `done`, `skipped: <why>` or `failed: <error>`.
    pub(crate) outcome: String,
    /// Seconds after the chaos phase began that the fault was over (the victim resumed, the
    /// gate reopened, the API server ready again); for kills, when the signal was sent.
    pub(crate) ended_seconds: Option<f64>,
}

/// A step that ends a fault later.
#[derive(Debug)]
enum FollowUp {
    /// SIGCONT to the paused shard of `ring`; index of the fault record.
    Resume {
        ring: usize,
        shard: String,
        record: usize,
    },
    /// Reopen the webhook gate.
    OpenGate { record: usize },
    /// Delete the squatting Lease named like `shard` in `namespace`.
    Unsquat {
        shard: String,
        namespace: String,
        record: usize,
    },
}

/// Carries out faults and their follow-ups.
pub(crate) struct Injector {
    fleet: Arc<Fleet>,
    client: Client,
    apiserver: Option<ApiServer>,
    /// Start of the chaos phase.
    started: Instant,
    /// Most shards of a ring wanted at once (scale-out stops there); least is two (scale-in stops
    /// there).
    most_shards: usize,
    /// How long to wait for a leader before a leader or follower fault is skipped.
    leader_wait: Duration,
    follow_ups: Vec<(Instant, FollowUp)>,
    /// Malformed Leases created so far, over all rings (they are named after the count).
    malformed: usize,
    pub(crate) records: Vec<FaultRecord>,
    /// API server outages: from the stop until it was ready again.
    pub(crate) disruptions: Vec<(Timestamp, Timestamp)>,
    /// Shard Leases deleted (`lease-delete`): the shard, and when.
    pub(crate) deleted_leases: Vec<(String, Timestamp)>,
}

/// Fewest shards a scale-in leaves wanted.
const FEWEST_SHARDS: usize = 2;

impl Injector {
    pub(crate) fn new(
        fleet: Arc<Fleet>,
        client: Client,
        apiserver: Option<ApiServer>,
        most_shards: usize,
        leader_wait: Duration,
    ) -> Self {
        Self {
            fleet,
            client,
            apiserver,
            started: Instant::now(),
            most_shards,
            leader_wait,
            follow_ups: Vec::new(),
            malformed: 0,
            records: Vec::new(),
            disruptions: Vec::new(),
            deleted_leases: Vec::new(),
        }
    }

    fn offset(&self) -> f64 {
        round_ms(self.started.elapsed())
    }

    /// Runs the plan from now: each fault at its offset (or as soon as the previous one is done),
    /// follow-ups when due; returns once every fault has ended.
    pub(crate) async fn run(&mut self, plan: &[PlannedFault]) {
        self.started = Instant::now();
        let mut next = 0;
        loop {
            let now = Instant::now();
            let due: Vec<usize> = self
                .follow_ups
                .iter()
                .enumerate()
                .filter(|(_, (at, _))| *at <= now)
                .map(|(i, _)| i)
                .collect();
            for i in due.into_iter().rev() {
                let (_, follow_up) = self.follow_ups.swap_remove(i);
                self.end(follow_up);
            }
            if let Some(fault) = plan.get(next)
                && self.started.elapsed().as_secs_f64() >= fault.at_seconds
            {
                next += 1;
                self.inject(fault).await;
                continue;
            }
            if next >= plan.len() && self.follow_ups.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Carries out `fault`: once for the whole system, or on each ring's shards.
    async fn inject(&mut self, fault: &PlannedFault) {
        if fault.kind.on_shards() {
            for ring in 0..self.fleet.rings().len() {
                self.inject_into(fault, Some(ring)).await;
            }
        } else {
            self.inject_into(fault, None).await;
        }
    }

    async fn inject_into(&mut self, fault: &PlannedFault, ring: Option<usize>) {
        let hold = Duration::from_secs_f64(fault.hold_seconds);
        let index = self.records.len();
        self.records.push(FaultRecord {
            at_seconds: self.offset(),
            kind: fault.kind,
            ring: ring.map(|r| self.fleet.rings()[r].ring.clone()),
            target: None,
            hold_seconds: fault.hold_seconds,
            outcome: "done".into(),
            ended_seconds: None,
        });
        let result = match ring {
            Some(ring) => self.apply_to_ring(fault, ring, hold, index).await,
            None => self.apply(fault, hold, index).await,
        };
        let offset = self.offset();
        let record = &mut self.records[index];
        match result {
            Ok(Applied::Done(target)) => {
                record.target = target;
                if !matches!(
                    fault.kind,
                    FaultKind::ShardPause | FaultKind::WebhookOutage | FaultKind::LeaseSquat
                ) {
                    record.ended_seconds = Some(offset);
                }
            }
            Ok(Applied::Skipped(why)) => record.outcome = format!("skipped: {why}"),
            Err(error) => record.outcome = format!("failed: {error:#}"),
        }
        crate::progress(&format!(
            "fault {} {} ({}){}",
            fault.kind.name(),
            record.target.as_deref().unwrap_or("-"),
            record.outcome,
            if fault.hold_seconds > 0.0 {
                format!(", hold {:.1} s", fault.hold_seconds)
            } else {
                String::new()
            }
        ));
    }

    /// Carries out a fault on the whole system.
    async fn apply(
        &mut self,
        fault: &PlannedFault,
        hold: Duration,
        index: usize,
    ) -> anyhow::Result<Applied> {
        let pick = |n: usize| (fault.pick % n.max(1) as u64) as usize;
        match fault.kind {
            FaultKind::LeaderKill
            | FaultKind::LeaderTerm
            | FaultKind::FollowerKill
            | FaultKind::FollowerTerm => {
                let Some(leader) = self.wait_for_leader().await else {
                    return Ok(Applied::Skipped("no leader"));
                };
                let slot = if matches!(fault.kind, FaultKind::LeaderKill | FaultKind::LeaderTerm) {
                    leader
                } else {
                    let followers: Vec<usize> = self
                        .fleet
                        .running_sharders()
                        .into_iter()
                        .filter(|s| *s != leader)
                        .collect();
                    if followers.is_empty() {
                        return Ok(Applied::Skipped("no follower running"));
                    }
                    followers[pick(followers.len())]
                };
                let signal =
                    if matches!(fault.kind, FaultKind::LeaderKill | FaultKind::FollowerKill) {
                        "KILL"
                    } else {
                        "TERM"
                    };
                self.fleet.signal_sharder(slot, signal, hold)?;
                Ok(Applied::Done(Some(format!("sharder-{slot}"))))
            }
            FaultKind::ApiserverRestart => {
                let Some(apiserver) = self.apiserver.as_mut() else {
                    return Ok(Applied::Skipped("not our control plane"));
                };
                let from = Timestamp::now();
                let result = apiserver.restart(&self.client, hold).await;
                self.disruptions.push((from, Timestamp::now()));
                let restarted = result?;
                crate::progress(&format!(
                    "kube-apiserver stopped in {:.1} s, ready {:.1} s after starting again",
                    restarted.stopping.as_secs_f64(),
                    restarted.starting.as_secs_f64()
                ));
                Ok(Applied::Done(Some("kube-apiserver".into())))
            }
            FaultKind::WebhookOutage => {
                self.fleet.gate.close();
                self.follow_ups
                    .push((Instant::now() + hold, FollowUp::OpenGate { record: index }));
                Ok(Applied::Done(Some("webhook".into())))
            }
            kind => anyhow::bail!("{} strikes a ring's shards", kind.name()),
        }
    }

    /// Carries out a fault on the shards (or shard Leases) of `ring`.
    async fn apply_to_ring(
        &mut self,
        fault: &PlannedFault,
        ring: usize,
        hold: Duration,
        index: usize,
    ) -> anyhow::Result<Applied> {
        let pick = |n: usize| (fault.pick % n.max(1) as u64) as usize;
        let lease_namespace = self.fleet.rings()[ring].lease_namespace.clone();
        match fault.kind {
            FaultKind::ShardKill | FaultKind::ShardTerm | FaultKind::ShardPause => {
                let candidates = self.fleet.active_shards(ring);
                if candidates.is_empty() {
                    return Ok(Applied::Skipped("no active shard"));
                }
                let shard = candidates[pick(candidates.len())].clone();
                match fault.kind {
                    FaultKind::ShardKill => {
                        self.fleet
                            .signal_shard(ring, &shard, "KILL", Then::RestartAfter(hold))?
                    }
                    FaultKind::ShardTerm => {
                        self.fleet
                            .signal_shard(ring, &shard, "TERM", Then::RestartAfter(hold))?
                    }
                    _ => {
                        self.fleet.signal_shard(ring, &shard, "STOP", Then::Keep)?;
                        self.follow_ups.push((
                            Instant::now() + hold,
                            FollowUp::Resume {
                                ring,
                                shard: shard.clone(),
                                record: index,
                            },
                        ));
                    }
                }
                Ok(Applied::Done(Some(shard)))
            }
            FaultKind::ScaleOut => {
                if self.fleet.wanted_shards(ring).len() >= self.most_shards {
                    return Ok(Applied::Skipped("at the most shards"));
                }
                Ok(Applied::Done(Some(self.fleet.add_shard(ring)?)))
            }
            FaultKind::ScaleIn => {
                if self.fleet.wanted_shards(ring).len() <= FEWEST_SHARDS {
                    return Ok(Applied::Skipped("at the fewest shards"));
                }
                let candidates = self.fleet.active_shards(ring);
                if candidates.is_empty() {
                    return Ok(Applied::Skipped("no active shard"));
                }
                let shard = candidates[pick(candidates.len())].clone();
                self.fleet
                    .signal_shard(ring, &shard, "TERM", Then::Retire)?;
                Ok(Applied::Done(Some(shard)))
            }
            FaultKind::LeaseSquat | FaultKind::LeaseDelete | FaultKind::LeaseRelabel => {
                let candidates = self.fleet.active_shards(ring);
                if candidates.is_empty() {
                    return Ok(Applied::Skipped("no active shard"));
                }
                let shard = candidates[pick(candidates.len())].clone();
                let own = Api::<Lease>::namespaced(self.client.clone(), &lease_namespace);
                match fault.kind {
                    FaultKind::LeaseSquat => {
                        let namespace = self.squat_namespace(&lease_namespace).await?;
                        let squatting = self.hostile_lease(ring, &shard, true);
                        Api::<Lease>::namespaced(self.client.clone(), &namespace)
                            .create(&PostParams::default(), &squatting)
                            .await?;
                        self.follow_ups.push((
                            Instant::now() + hold,
                            FollowUp::Unsquat {
                                shard: shard.clone(),
                                namespace,
                                record: index,
                            },
                        ));
                    }
                    FaultKind::LeaseDelete => {
                        own.delete(&shard, &DeleteParams::default()).await?;
                        self.deleted_leases.push((shard.clone(), Timestamp::now()));
                    }
                    _ => {
                        let label = kube_sharding_api::RingKind::ClusterRing.lease_label();
                        let unlabel = serde_json::json!({"metadata": {"labels": {label: null}}});
                        own.patch(&shard, &PatchParams::default(), &Patch::Merge(&unlabel))
                            .await?;
                    }
                }
                Ok(Applied::Done(Some(shard)))
            }
            FaultKind::LeaseMalformed => {
                let namespace = self.squat_namespace(&lease_namespace).await?;
                self.malformed += 1;
                let name = format!("malformed-{}", self.malformed);
                let lease = self.hostile_lease(ring, &name, false);
                Api::<Lease>::namespaced(self.client.clone(), &namespace)
                    .create(&PostParams::default(), &lease)
                    .await?;
                Ok(Applied::Done(Some(format!("{namespace}/{name}"))))
            }
            FaultKind::ClockSkew => {
                let candidates = self.fleet.active_shards(ring);
                if candidates.is_empty() {
                    return Ok(Applied::Skipped("no active shard"));
                }
                let shard = candidates[pick(candidates.len())].clone();
                // Behind by two lease durations: the sharder would take it over after every
                // renewal if it judged it by its renewTime.
                let behind = -2 * self.fleet.timing().lease_duration.ceil() as i64;
                self.fleet.skew_shard(ring, &shard, behind)?;
                self.fleet
                    .signal_shard(ring, &shard, "TERM", Then::RestartAfter(hold))?;
                Ok(Applied::Done(Some(format!("{shard} ({behind} s)"))))
            }
            kind => anyhow::bail!("{} strikes the whole system", kind.name()),
        }
    }

    /// The namespace hostile Leases of a ring with its Leases in `lease_namespace` are created in
    /// (created on first use).
    async fn squat_namespace(&self, lease_namespace: &str) -> anyhow::Result<String> {
        let name = format!("{lease_namespace}-squat");
        let namespace: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        match Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &namespace)
            .await
        {
            Ok(_) => Ok(name),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(name),
            Err(e) => Err(e.into()),
        }
    }

    /// A Lease of `ring` named `name` and held by that name, with the shards' duration, and
    /// renewed now if `timed`, else without `acquireTime` and `renewTime`.
    fn hostile_lease(&self, ring: usize, name: &str, timed: bool) -> Lease {
        let now = timed.then(|| MicroTime(Timestamp::now()));
        Lease {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                labels: Some(
                    [(
                        kube_sharding_api::RingKind::ClusterRing
                            .lease_label()
                            .to_string(),
                        self.fleet.rings()[ring].ring.clone(),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(name.to_string()),
                lease_duration_seconds: Some(self.fleet.timing().lease_duration.ceil() as i32),
                acquire_time: now.clone(),
                renew_time: now,
                ..Default::default()
            }),
        }
    }

    async fn wait_for_leader(&self) -> Option<usize> {
        let deadline = Instant::now() + self.leader_wait;
        loop {
            if let Ok(Some(slot)) = self.fleet.leader(&self.client).await {
                return Some(slot);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn end(&mut self, follow_up: FollowUp) {
        let offset = self.offset();
        match follow_up {
            FollowUp::Resume {
                ring,
                shard,
                record,
            } => {
                if let Err(error) = self.fleet.signal_shard(ring, &shard, "CONT", Then::Keep) {
                    crate::progress(&format!("failed to resume {shard}: {error:#}"));
                }
                self.records[record].ended_seconds = Some(offset);
                crate::progress(&format!("resumed {shard}"));
            }
            FollowUp::OpenGate { record } => {
                self.fleet.gate.open();
                self.records[record].ended_seconds = Some(offset);
                crate::progress("webhook reachable again");
            }
            FollowUp::Unsquat {
                shard,
                namespace,
                record,
            } => {
                let api = Api::<Lease>::namespaced(self.client.clone(), &namespace);
                let client_shard = shard.clone();
                // Deleting is quick; the follow-up loop is not async, so it runs on its own.
                tokio::spawn(async move {
                    if let Err(error) = api.delete(&client_shard, &DeleteParams::default()).await {
                        crate::progress(&format!(
                            "failed to delete the squatting Lease {client_shard}: {error:#}"
                        ));
                    }
                });
                self.records[record].ended_seconds = Some(offset);
                crate::progress(&format!("squatting Lease {shard} deleted"));
            }
        }
    }

    /// Seconds after the chaos phase began that the last fault ended.
    pub(crate) fn last_ended(&self) -> Option<f64> {
        self.records
            .iter()
            .filter_map(|r| r.ended_seconds)
            .reduce(f64::max)
    }
}

/// What [`Injector::apply`] did.
#[derive(Debug)]
enum Applied {
    Done(Option<String>),
    Skipped(&'static str),
}
