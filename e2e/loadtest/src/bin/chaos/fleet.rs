//! The processes under test: two sharder replicas behind one webhook address, and the
//! checksum-controller shards of each ring under test. Every process the tool ever started is
//! kept, with the signals the tool sent it and how it ended, as evidence for the checks.
//!
//! A supervisor ([`Fleet::supervise`]) keeps the wanted processes running: a member whose
//! process has exited is started again once its restart time has come (set by the fault that
//! stopped it, or a second after an exit nobody asked for, such as a shard that lost its Lease).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use e2e::gate::{Balancer, TcpGate};
use e2e::process::Process;
use e2e::sharder_process::{SharderFiles, SharderSettings};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::Api;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

/// Namespace and name of the sharder's leader-election Lease (the SharderConfig defaults, which
/// the tool's sharder config keeps).
const LEADER_LEASE: (&str, &str) = ("sharding-system", "sharder");

/// How often the supervisor looks at the processes.
const SUPERVISE_EVERY: Duration = Duration::from_millis(250);

/// Pause before starting a member again after an exit the tool did not cause.
const RESTART_AFTER_EXIT: Duration = Duration::from_secs(1);

/// Lease timing of the shards, in seconds.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct ShardTiming {
    pub(crate) lease_duration: f64,
    pub(crate) renew_deadline: f64,
    pub(crate) retry_period: f64,
}

impl ShardTiming {
    /// The protocol's proportions (15 s, 10 s, 2 s) scaled to `lease_duration`, with renewals at
    /// least every second so a Lease survives a short stall of a busy machine.
    pub(crate) fn scaled(lease_duration: Duration) -> Self {
        let d = lease_duration.as_secs_f64();
        Self {
            lease_duration: d,
            renew_deadline: d * 2.0 / 3.0,
            retry_period: (d * 2.0 / 15.0).min(1.0),
        }
    }
}

/// Names of Secrets whose reconciles `--testing-reconcile-delay` slows down (checksum-controller's
/// rule): the zero-write ring's churn creates only such Secrets.
pub(crate) const SLOW_PREFIX: &str = "slow-";

/// How long the zero-write ring's shards take over each reconcile of a churned Secret: long
/// enough that new ranges usually find reconciles of revoked Secrets in flight, which the shard
/// library must cancel and wait for before it acknowledges, and longer than a handover takes,
/// so that one it failed to cancel is still running when the new owner starts (which the
/// ownership check reports); short against the convergence bound.
const SLOW_RECONCILE: &str = "4";

/// A ring whose shards the fleet runs.
#[derive(Clone, Debug)]
pub(crate) struct ShardRing {
    /// The ClusterRing's name.
    pub(crate) ring: String,
    /// Where its shards keep their Leases.
    pub(crate) lease_namespace: String,
    /// Its shards are named `<prefix>-<n>`: distinct per ring, so that a name (in progress
    /// lines, the report, the evidence) always says which ring a shard serves.
    pub(crate) shard_prefix: &'static str,
    /// Its shards leave their ConfigMaps to the sharder (`--leave-children-to-sharder`).
    pub(crate) leaves_children: bool,
    /// A zero-write ring's namespace: its shards run with `--server-side` and watch only it
    /// (the shard library selects by hash range alone, not by the ring's namespace selector).
    pub(crate) server_side_namespace: Option<String>,
}

/// How one process ended.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Exit {
    /// When the supervisor saw it gone (within [`SUPERVISE_EVERY`] of the actual exit).
    pub(crate) at: Timestamp,
    /// The exit status as printed by the OS layer, e.g. `exit status: 1` or `signal: 9 (SIGKILL)`.
    pub(crate) status: String,
    pub(crate) success: bool,
}

/// One process of a member: a run of a shard or sharder replica from start to exit.
#[derive(Debug)]
pub(crate) struct Incarnation {
    pub(crate) process: Process,
    pub(crate) pid: Option<u32>,
    /// Signals the tool sent, by name (`KILL`, `TERM`, `STOP`, `CONT`), with when.
    pub(crate) signals: Vec<(Timestamp, &'static str)>,
    pub(crate) exit: Option<Exit>,
}

impl Incarnation {
    fn start(process: Process) -> Self {
        Self {
            pid: process.id(),
            process,
            signals: Vec::new(),
            exit: None,
        }
    }

    pub(crate) fn log_path(&self) -> &Path {
        self.process.log_path()
    }

    /// Whether the tool sent `signal` to this process.
    pub(crate) fn got(&self, signal: &str) -> bool {
        self.signals.iter().any(|(_, s)| *s == signal)
    }

    pub(crate) fn is_running(&self) -> bool {
        self.exit.is_none()
    }

    /// Whether the tool stopped it with SIGSTOP and has not sent SIGCONT since.
    pub(crate) fn is_paused(&self) -> bool {
        self.signals
            .iter()
            .rev()
            .find(|(_, s)| matches!(*s, "STOP" | "CONT"))
            .is_some_and(|(_, s)| *s == "STOP")
    }
}

/// A shard name or a sharder replica slot, and every process it has had.
#[derive(Debug, Default)]
pub(crate) struct Member {
    /// Whether the member should be running (false once scaled in).
    pub(crate) wanted: bool,
    /// When to start it again if no process runs.
    pub(crate) restart_at: Option<Instant>,
    /// For a shard: seconds its clock runs off in the timestamps it writes (see `clock-skew`).
    pub(crate) clock_offset: Option<i64>,
    pub(crate) incarnations: Vec<Incarnation>,
}

impl Member {
    /// The running process, if any.
    pub(crate) fn current(&self) -> Option<&Incarnation> {
        self.incarnations.last().filter(|i| i.is_running())
    }

    fn current_mut(&mut self) -> Option<&mut Incarnation> {
        self.incarnations.last_mut().filter(|i| i.is_running())
    }
}

/// Everything the tool runs, behind one lock.
#[derive(Debug)]
pub(crate) struct Processes {
    /// Per ring (in the order of [`Fleet::new`]'s `rings`), its shards by name.
    pub(crate) shards: Vec<BTreeMap<String, Member>>,
    pub(crate) sharders: Vec<Member>,
    /// Per ring, the number of its next new shard.
    next_shard: Vec<usize>,
}

impl Processes {
    /// Shard `name` of ring `ring` (an index into [`Processes::shards`]).
    fn shard_mut(&mut self, ring: usize, name: &str) -> anyhow::Result<&mut Member> {
        self.shards
            .get_mut(ring)
            .and_then(|shards| shards.get_mut(name))
            .with_context(|| format!("no shard {name} in ring {ring}"))
    }
}

/// The fleet: processes, and how to start them.
#[derive(Debug)]
pub(crate) struct Fleet {
    state: Mutex<Processes>,
    rings: Vec<ShardRing>,
    timing: ShardTiming,
    sharder_files: Vec<SharderFiles>,
    /// Between the API server and the balancer: closing it is a webhook outage.
    pub(crate) gate: TcpGate,
    /// Kept alive: sends webhook calls to the ready replicas.
    _balancer: Balancer,
}

impl Fleet {
    /// Prepares two sharder replicas (one serving certificate, as replicas of one Deployment
    /// share) behind a balancer that, like a Service, sends webhook calls only to ready
    /// replicas, and a gate in front of it that the API server calls. Both replicas serve every
    /// ring of `rings`, whose shards the fleet runs.
    pub(crate) async fn new(
        kubeconfig: &Path,
        rings: Vec<ShardRing>,
        timing: ShardTiming,
        leader_election: (u32, u32, u32),
    ) -> anyhow::Result<Self> {
        let balancer = Balancer::start().await?;
        let gate = TcpGate::start(balancer.addr()).await?;
        let settings = SharderSettings {
            leader_election,
            sync_period: "5m".into(),
            webhook_url: Some(format!("https://{}", gate.addr())),
            ..Default::default()
        };
        let files = vec![
            SharderFiles::create(kubeconfig, &settings)?,
            SharderFiles::create(kubeconfig, &settings)?,
        ];
        for file in ["ca.crt", "ca.key", "tls.crt", "tls.key"] {
            std::fs::copy(files[0].dir.join(file), files[1].dir.join(file))
                .with_context(|| format!("failed to share the sharder's {file}"))?;
        }
        for f in &files {
            balancer.add(
                ([127, 0, 0, 1], f.webhook_port).into(),
                ([127, 0, 0, 1], f.health_port).into(),
            );
        }
        Ok(Self {
            state: Mutex::new(Processes {
                shards: rings.iter().map(|_| BTreeMap::new()).collect(),
                sharders: files.iter().map(|_| Member::default()).collect(),
                next_shard: vec![0; rings.len()],
            }),
            rings,
            timing,
            sharder_files: files,
            gate,
            _balancer: balancer,
        })
    }

    /// The processes, locked. Hold the guard briefly: the supervisor needs it too.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Processes> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Number of sharder replicas.
    pub(crate) fn sharder_slots(&self) -> usize {
        self.sharder_files.len()
    }

    /// Starts every sharder replica and waits until each is ready.
    pub(crate) async fn start_sharders(&self, timeout: Duration) -> anyhow::Result<()> {
        {
            let mut state = self.lock();
            for slot in 0..self.sharder_files.len() {
                let process = self.spawn_sharder(slot)?;
                let member = &mut state.sharders[slot];
                member.wanted = true;
                member.incarnations.push(Incarnation::start(process));
            }
        }
        for files in &self.sharder_files {
            files.wait_ready(timeout).await?;
        }
        Ok(())
    }

    fn spawn_sharder(&self, slot: usize) -> anyhow::Result<Process> {
        let mut process = self.sharder_files[slot].start_process()?;
        // Logs stay on disk (the report names the directory); never printed on drop.
        process.passed();
        Ok(process)
    }

    fn spawn_shard(
        &self,
        ring: usize,
        name: &str,
        clock_offset: Option<i64>,
    ) -> anyhow::Result<Process> {
        let t = self.timing;
        let ring = &self.rings[ring];
        let mut args: Vec<String> = [
            "--clusterring",
            &ring.ring,
            "--lease-namespace",
            &ring.lease_namespace,
            "--shard-name",
            name,
            "--lease-duration",
            &t.lease_duration.to_string(),
            "--renew-deadline",
            &t.renew_deadline.to_string(),
            "--retry-period",
            &t.retry_period.to_string(),
            "--log-format",
            "json",
        ]
        .map(str::to_string)
        .into();
        if let Some(offset) = clock_offset {
            args.push(format!("--testing-clock-offset={offset}"));
        }
        if ring.leaves_children {
            args.push("--leave-children-to-sharder".into());
        }
        if let Some(namespace) = &ring.server_side_namespace {
            args.extend(
                [
                    "--server-side",
                    "--namespace",
                    namespace,
                    "--testing-reconcile-delay",
                    SLOW_RECONCILE,
                ]
                .map(str::to_string),
            );
        }
        let mut process = Process::start("checksum-controller", args)?;
        process.passed();
        Ok(process)
    }

    /// The name of the shard of `ring` that [`Self::add_shard`] adds as the `n`th (from 0).
    pub(crate) fn shard_name(&self, ring: usize, n: usize) -> String {
        format!("{}-{n}", self.rings[ring].shard_prefix)
    }

    /// Starts a shard of `ring` under a new name (`<prefix>-<n>`); returns the name.
    pub(crate) fn add_shard(&self, ring: usize) -> anyhow::Result<String> {
        let mut state = self.lock();
        let name = self.shard_name(ring, state.next_shard[ring]);
        state.next_shard[ring] += 1;
        let process = self.spawn_shard(ring, &name, None)?;
        let member = state.shards[ring].entry(name.clone()).or_default();
        member.wanted = true;
        member.incarnations.push(Incarnation::start(process));
        Ok(name)
    }

    /// Sends `signal` to the running process of shard `name` of `ring`, then does `then`.
    pub(crate) fn signal_shard(
        &self,
        ring: usize,
        name: &str,
        signal: &'static str,
        then: Then,
    ) -> anyhow::Result<()> {
        let mut state = self.lock();
        signal_member(state.shard_mut(ring, name)?, signal, then)
    }

    /// Has shard `name` of `ring` write its Lease's timestamps `offset` seconds off from its
    /// next start on.
    pub(crate) fn skew_shard(&self, ring: usize, name: &str, offset: i64) -> anyhow::Result<()> {
        let mut state = self.lock();
        state.shard_mut(ring, name)?.clock_offset = Some(offset);
        Ok(())
    }

    /// The rings whose shards the fleet runs, in the order given to [`Fleet::new`].
    pub(crate) fn rings(&self) -> &[ShardRing] {
        &self.rings
    }

    /// The shards' Lease timing.
    pub(crate) fn timing(&self) -> ShardTiming {
        self.timing
    }

    /// Makes shard `name` of `ring` unwanted and stops its process, if one runs (SIGTERM, after
    /// SIGCONT when paused).
    pub(crate) fn retire_shard(&self, ring: usize, name: &str) -> anyhow::Result<()> {
        let mut state = self.lock();
        let member = state.shard_mut(ring, name)?;
        member.wanted = false;
        member.restart_at = None;
        if let Some(incarnation) = member.current_mut() {
            if incarnation.is_paused() {
                send(incarnation, "CONT")?;
            }
            send(incarnation, "TERM")?;
        }
        Ok(())
    }

    /// Like [`Fleet::signal_shard`] for sharder replica `slot`, which is always started again.
    pub(crate) fn signal_sharder(
        &self,
        slot: usize,
        signal: &'static str,
        restart_after: Duration,
    ) -> anyhow::Result<()> {
        let mut state = self.lock();
        let member = state
            .sharders
            .get_mut(slot)
            .with_context(|| format!("no sharder replica {slot}"))?;
        signal_member(member, signal, Then::RestartAfter(restart_after))
    }

    /// Names of the shards of `ring` with a running process that is not paused.
    pub(crate) fn active_shards(&self, ring: usize) -> Vec<String> {
        self.lock().shards[ring]
            .iter()
            .filter(|(_, m)| m.current().is_some_and(|i| !i.is_paused()))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Names of the shards of `ring` that should be running.
    pub(crate) fn wanted_shards(&self, ring: usize) -> Vec<String> {
        self.lock().shards[ring]
            .iter()
            .filter(|(_, m)| m.wanted)
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Whether every wanted member (shard or sharder) has a running process that is not paused.
    pub(crate) fn all_wanted_running(&self) -> bool {
        let state = self.lock();
        state
            .shards
            .iter()
            .flat_map(BTreeMap::values)
            .chain(state.sharders.iter())
            .filter(|m| m.wanted)
            .all(|m| m.current().is_some_and(|i| !i.is_paused()))
    }

    /// The sharder slot whose running process holds the leader Lease, if any.
    pub(crate) async fn leader(&self, client: &Client) -> anyhow::Result<Option<usize>> {
        let (namespace, name) = LEADER_LEASE;
        let lease = Api::<Lease>::namespaced(client.clone(), namespace)
            .get_opt(name)
            .await?;
        let Some(pid) = lease
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .as_deref()
            .and_then(identity_pid)
        else {
            return Ok(None);
        };
        let state = self.lock();
        Ok(state
            .sharders
            .iter()
            .position(|m| m.current().is_some_and(|i| i.pid == Some(pid))))
    }

    /// Sharder slots with a running process.
    pub(crate) fn running_sharders(&self) -> Vec<usize> {
        self.lock()
            .sharders
            .iter()
            .enumerate()
            .filter(|(_, m)| m.current().is_some())
            .map(|(slot, _)| slot)
            .collect()
    }

    /// Process id of the running process of sharder `slot`.
    pub(crate) fn sharder_pid(&self, slot: usize) -> Option<u32> {
        self.lock().sharders.get(slot)?.current()?.pid
    }

    /// Records exits and starts wanted members whose restart time has come, until `stop`.
    pub(crate) async fn supervise(self: Arc<Self>, stop: CancellationToken) {
        loop {
            self.supervise_once();
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(SUPERVISE_EVERY) => {}
            }
        }
    }

    fn supervise_once(&self) {
        let mut state = self.lock();
        let now = Instant::now();
        let Processes {
            shards, sharders, ..
        } = &mut *state;
        let members = shards
            .iter_mut()
            .enumerate()
            .flat_map(|(ring, shards)| {
                shards
                    .iter_mut()
                    .map(move |(name, m)| (Some((ring, name.clone())), None, m))
            })
            .chain(
                sharders
                    .iter_mut()
                    .enumerate()
                    .map(|(slot, m)| (None, Some(slot), m)),
            );
        for (shard, slot, member) in members {
            if let Some(incarnation) = member.current_mut()
                && let Ok(Some(status)) = incarnation.process.try_status()
            {
                incarnation.exit = Some(Exit {
                    at: Timestamp::now(),
                    status: status.to_string(),
                    success: status.success(),
                });
                let who = match (&shard, slot) {
                    (Some((_, name)), _) => name.clone(),
                    (None, slot) => format!("sharder-{}", slot.unwrap_or_default()),
                };
                crate::progress(&format!("{who} exited: {status}"));
                if member.wanted && member.restart_at.is_none() {
                    member.restart_at = Some(now + RESTART_AFTER_EXIT);
                }
            }
            let due = member.restart_at.is_some_and(|at| at <= now);
            if member.wanted && member.current().is_none() && due {
                let started = match (&shard, slot) {
                    (Some((ring, name)), _) => self.spawn_shard(*ring, name, member.clock_offset),
                    (None, Some(slot)) => self.spawn_sharder(slot),
                    (None, None) => continue,
                };
                match started {
                    Ok(process) => {
                        member.restart_at = None;
                        member.incarnations.push(Incarnation::start(process));
                    }
                    Err(error) => {
                        crate::progress(&format!("failed to start a process, retrying: {error:#}"));
                        member.restart_at = Some(now + RESTART_AFTER_EXIT);
                    }
                }
            }
        }
    }

    /// Whether any process of any member is running.
    fn any_running(&self) -> bool {
        let state = self.lock();
        state
            .shards
            .iter()
            .flat_map(BTreeMap::values)
            .chain(state.sharders.iter())
            .any(|m| m.current().is_some())
    }

    /// Sends SIGTERM to every running process (SIGCONT first to paused ones) and waits up to
    /// `timeout` for them to exit, then kills what is left.
    pub(crate) async fn stop_all(&self, timeout: Duration) {
        {
            let mut state = self.lock();
            let Processes {
                shards, sharders, ..
            } = &mut *state;
            for member in shards
                .iter_mut()
                .flat_map(BTreeMap::values_mut)
                .chain(sharders.iter_mut())
            {
                member.wanted = false;
                if let Some(incarnation) = member.current_mut() {
                    if incarnation.is_paused() {
                        let _ = send(incarnation, "CONT");
                    }
                    let _ = send(incarnation, "TERM");
                }
            }
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            self.supervise_once();
            if !self.any_running() {
                return;
            }
            tokio::time::sleep(SUPERVISE_EVERY).await;
        }
        let mut state = self.lock();
        let Processes {
            shards, sharders, ..
        } = &mut *state;
        for member in shards
            .iter_mut()
            .flat_map(BTreeMap::values_mut)
            .chain(sharders.iter_mut())
        {
            if let Some(incarnation) = member.current_mut() {
                let _ = send(incarnation, "KILL");
            }
        }
    }
}

/// What happens to a member after a signal.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Then {
    /// Nothing changes (SIGSTOP, SIGCONT).
    Keep,
    /// Once its process has exited, it is started again this long after the signal.
    RestartAfter(Duration),
    /// It is not wanted any more (scaled in).
    Retire,
}

/// Sends `signal` to the member's running process and records it.
fn signal_member(member: &mut Member, signal: &'static str, then: Then) -> anyhow::Result<()> {
    let incarnation = member
        .current_mut()
        .context("the member has no running process")?;
    send(incarnation, signal)?;
    match then {
        Then::Keep => {}
        Then::RestartAfter(after) => member.restart_at = Some(Instant::now() + after),
        Then::Retire => {
            member.wanted = false;
            member.restart_at = None;
        }
    }
    Ok(())
}

fn send(incarnation: &mut Incarnation, signal: &'static str) -> anyhow::Result<()> {
    // Recorded before sending: a process cannot log anything after a KILL that follows this.
    incarnation.signals.push((Timestamp::now(), signal));
    incarnation.process.signal(signal)
}

/// The process id inside a sharder identity `<host>_<pid>_<nanos>`.
fn identity_pid(identity: &str) -> Option<u32> {
    let mut parts = identity.rsplitn(3, '_');
    let _nanos = parts.next()?;
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pid_from_sharder_identity() {
        assert_eq!(identity_pid("host_1234_0000abcd"), Some(1234));
        assert_eq!(identity_pid("my_host_name_77_deadbeef"), Some(77));
        assert_eq!(identity_pid("thief"), None);
    }

    #[test]
    fn shard_timing_keeps_the_protocol_proportions() {
        let t = ShardTiming::scaled(Duration::from_secs(15));
        assert_eq!(t.lease_duration, 15.0);
        assert_eq!(t.renew_deadline, 10.0);
        assert_eq!(t.retry_period, 1.0);
        let t = ShardTiming::scaled(Duration::from_secs(6));
        assert!((t.retry_period - 0.8).abs() < 1e-9);
    }
}
