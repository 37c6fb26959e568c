//! One ring mode on the Secrets of the run: its shards, the placement, and the measurement of one
//! rebalance.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use e2e::IndependentRing;
use e2e::fixtures::{ShardTiming, start_checksum_shard_with};
use e2e::process::{Process, poll_until};
use e2e::prometheus::apiserver_metrics;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::{Client, ResourceExt};
use kube_sharding_api::labels::shard_label;
use kube_sharding_api::range_lease::{ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES, PublishedRanges};
use kube_sharding_api::ranges::{RangeRing, ShardField, ShardSelector};
use kube_sharding_api::{RingKind, RingRef};

use crate::logs::{ShardLog, count_between};
use crate::probes::{cpu_seconds, list_with, memory_kib, object_writes, traffic, writes};
use crate::progress;
use crate::report::{Rebalance, ShardTraffic};

/// How a ring places its objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `assignment: Webhook`: shard labels, drains and moves.
    Label,
    /// `assignment: ServerSide`: hash ranges on the shards' Leases, no object writes.
    ServerSide,
}

impl Mode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Label => "label",
            Self::ServerSide => "server-side",
        }
    }

    /// Shard names differ per mode, so a mode never takes over the other's Leases.
    pub(crate) fn shard(self, i: usize) -> String {
        match self {
            Self::Label => format!("shard-{i}"),
            Self::ServerSide => format!("zw-{i}"),
        }
    }
}

/// A change of the ring's shards.
pub(crate) enum Change {
    /// A new shard starts.
    Join(String),
    /// A shard gets SIGTERM and releases its Lease.
    Leave(String),
}

/// The shards' Lease timing: the binary's defaults, as deployed.
pub(crate) const TIMING: ShardTiming = ShardTiming::DEFAULT;

/// One mode's shards on the run's Secrets.
pub(crate) struct Bench<'a> {
    pub(crate) client: &'a Client,
    pub(crate) namespace: &'a str,
    pub(crate) ring: String,
    pub(crate) mode: Mode,
    /// The run's Secrets: name and the FNV-1a hash of its uid.
    pub(crate) secrets: Vec<(String, u64)>,
    /// The sharder's process id.
    pub(crate) sharder: u32,
    pub(crate) ticks: f64,
    /// Extra flags of every shard.
    pub(crate) shard_args: Vec<String>,
    /// Running shards, by name.
    pub(crate) shards: BTreeMap<String, (Process, ShardLog)>,
    /// Stopped shards, kept for their logs.
    pub(crate) stopped: BTreeMap<String, (Process, ShardLog)>,
    pub(crate) settle: Duration,
    pub(crate) timeout: Duration,
    pub(crate) started: Instant,
}

impl Bench<'_> {
    pub(crate) fn start_shard(&mut self, name: &str) -> anyhow::Result<()> {
        let ring = RingRef::new(RingKind::ClusterRing, &self.ring);
        let mut extra: Vec<&str> = self.shard_args.iter().map(String::as_str).collect();
        if self.mode == Mode::ServerSide {
            extra.push("--server-side");
        }
        let mut process = start_checksum_shard_with(&ring, self.namespace, name, TIMING, &extra)?;
        // Its log holds lines per object: never print it.
        process.passed();
        let log = ShardLog::new(process.log_path().to_path_buf(), self.namespace);
        self.shards.insert(name.to_string(), (process, log));
        Ok(())
    }

    /// Each Secret's shard among `shards`, by index.
    fn owners(&self, shards: &[String]) -> Vec<String> {
        match self.mode {
            Mode::Label => {
                let ring = IndependentRing::unweighted(shards);
                self.secrets
                    .iter()
                    .map(|(name, _)| {
                        ring.shard_for(&format!("/Secret/{}/{name}", self.namespace))
                            .to_string()
                    })
                    .collect()
            }
            Mode::ServerSide => {
                let ring = RangeRing::new(shards);
                self.secrets
                    .iter()
                    .map(|(_, hash)| ring.owner(*hash).unwrap_or_default().to_string())
                    .collect()
            }
        }
    }

    fn running(&self) -> Vec<String> {
        self.shards.keys().cloned().collect()
    }

    /// Waits until each Secret of `expected` (index, shard) had a reconcile finish on that shard
    /// at or after `since`; returns each one's time from `since`, in seconds.
    async fn wait_finished(
        &mut self,
        what: &str,
        expected: &[(usize, String)],
        since: Timestamp,
    ) -> anyhow::Result<Vec<f64>> {
        let mut pending: Vec<(usize, String)> = expected.to_vec();
        let mut took = Vec::with_capacity(expected.len());
        let deadline = Instant::now() + self.timeout;
        let mut reported = Instant::now();
        loop {
            for (_, log) in self.shards.values_mut() {
                log.refresh()?;
            }
            pending.retain(|(i, shard)| {
                let found = self
                    .shards
                    .get(shard)
                    .and_then(|(_, log)| log.finished_since(&self.secrets[*i].0, since));
                match found {
                    Some(at) => {
                        took.push(at.duration_since(since).as_secs_f64());
                        false
                    }
                    None => true,
                }
            });
            if pending.is_empty() {
                took.sort_by(f64::total_cmp);
                return Ok(took);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{what}: {} of {} Secrets not reconciled by their shard within {:?}, e.g. {} on {}",
                pending.len(),
                expected.len(),
                self.timeout,
                self.secrets[pending[0].0].0,
                pending[0].1
            );
            if reported.elapsed() >= Duration::from_secs(10) {
                reported = Instant::now();
                progress(
                    self.started,
                    &format!("{what}: {} of {} to go", pending.len(), expected.len()),
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits until every Secret was reconciled by its shard since `since`.
    pub(crate) async fn wait_placed(&mut self, since: Timestamp) -> anyhow::Result<()> {
        let owners = self.owners(&self.running());
        let expected: Vec<(usize, String)> = owners.into_iter().enumerate().collect();
        let what = format!("{} placement", self.mode.name());
        self.wait_finished(&what, &expected, since).await?;
        Ok(())
    }

    /// On a zero-write ring: waits until the Leases of `shards` carry their target ranges,
    /// acknowledged.
    async fn wait_ranges(&self, shards: &[String]) -> anyhow::Result<()> {
        let target = RangeRing::new(shards).ranges();
        let api = Api::<Lease>::namespaced(self.client.clone(), self.namespace);
        poll_until("ranges to settle", self.timeout, || {
            let (api, target) = (api.clone(), target.clone());
            async move {
                for shard in shards {
                    let lease = api.get(shard).await?;
                    let annotations = lease.annotations();
                    let published: Option<PublishedRanges> = annotations
                        .get(ANNOTATION_RANGES)
                        .and_then(|v| v.parse().ok());
                    let acknowledged = annotations.get(ANNOTATION_ACKNOWLEDGED);
                    match published {
                        Some(p)
                            if acknowledged == Some(&p.generation().to_string())
                                && Some(p.ranges()) == target.get(shard) => {}
                        _ => return Ok(None),
                    }
                }
                Ok(Some(()))
            }
        })
        .await
    }

    /// A list of Secrets with `shard`'s selector, as its own list sends it.
    async fn shard_list(&self, shard: &str) -> anyhow::Result<(usize, usize, bool)> {
        match self.mode {
            Mode::Label => {
                let selector = format!("{}={shard}", shard_label(&self.ring));
                list_with(self.client, self.namespace, "labelSelector", &selector).await
            }
            Mode::ServerSide => {
                let lease = Api::<Lease>::namespaced(self.client.clone(), self.namespace)
                    .get(shard)
                    .await?;
                let published: PublishedRanges = lease
                    .annotations()
                    .get(ANNOTATION_RANGES)
                    .context("a shard without ranges")?
                    .parse()?;
                let Some(selector) =
                    ShardSelector::new(ShardField::Uid, published.ranges().clone())
                else {
                    return Ok((0, 0, false));
                };
                list_with(
                    self.client,
                    self.namespace,
                    "shardSelector",
                    &selector.to_string(),
                )
                .await
            }
        }
    }

    /// Carries out `change` and measures it until every moved Secret was reconciled by its new
    /// shard and object writes stopped for the settle time.
    pub(crate) async fn rebalance(&mut self, change: Change) -> anyhow::Result<Rebalance> {
        let before_shards = self.running();
        let mut after_shards = before_shards.clone();
        let label = match &change {
            Change::Join(name) => {
                after_shards.push(name.clone());
                after_shards.sort();
                "3→4"
            }
            Change::Leave(name) => {
                after_shards.retain(|s| s != name);
                "4→3"
            }
        };
        let (before, after) = (self.owners(&before_shards), self.owners(&after_shards));
        let moved: Vec<(usize, String)> = after
            .iter()
            .enumerate()
            .filter(|(i, owner)| before[*i] != **owner)
            .map(|(i, owner)| (i, owner.clone()))
            .collect();
        let server_before = apiserver_metrics(self.client).await?;
        let cpu_before = cpu_seconds(self.sharder, self.ticks)?;
        let t0 = Timestamp::now();
        let t0_instant = Instant::now();
        match &change {
            Change::Join(name) => self.start_shard(name)?,
            Change::Leave(name) => {
                let (mut process, log) = self.shards.remove(name).context("no such shard")?;
                process.terminate()?;
                let status = process.wait(Duration::from_secs(60)).await?;
                anyhow::ensure!(status.success(), "{name} exits 0 on SIGTERM: {status}");
                self.stopped.insert(name.clone(), (process, log));
            }
        }
        progress(
            self.started,
            &format!("{} {label}: {} Secrets move", self.mode.name(), moved.len()),
        );
        if self.mode == Mode::ServerSide {
            self.wait_ranges(&after_shards).await?;
        }
        let what = format!("{} {label}", self.mode.name());
        let took = self.wait_finished(&what, &moved, t0).await?;
        // The rebalance is over when the writes it caused stop.
        let mut last = object_writes(&apiserver_metrics(self.client).await?);
        let mut quiet_since = Instant::now();
        while quiet_since.elapsed() < self.settle && t0_instant.elapsed() < self.timeout {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = object_writes(&apiserver_metrics(self.client).await?);
            if now != last {
                (last, quiet_since) = (now, Instant::now());
            }
        }
        let server_after = apiserver_metrics(self.client).await?;
        let cpu_after = cpu_seconds(self.sharder, self.ticks)?;
        let (hwm, rss) = memory_kib(self.sharder)?;
        let t1 = Timestamp::now();
        let window = t0_instant.elapsed();
        let mut shards = Vec::new();
        let names: Vec<String> = self
            .shards
            .keys()
            .chain(self.stopped.keys())
            .cloned()
            .collect();
        for name in names {
            let running = self.shards.contains_key(&name);
            let (items, bytes, filtered) = if running {
                self.shard_list(&name).await?
            } else {
                (0, 0, false)
            };
            let (_, log) = self
                .shards
                .get_mut(&name)
                .or_else(|| self.stopped.get_mut(&name))
                .context("a shard without log")?;
            log.refresh()?;
            let starts = count_between(&log.starts, t0, t1);
            // A shard stopped in an earlier window did nothing in this one.
            if !running && starts == 0 {
                continue;
            }
            let owns = after.iter().filter(|o| **o == name).count();
            let acknowledged_ms = log
                .range_records
                .iter()
                .filter(|(at, r)| *at >= t0 && *at <= t1 && r["event"] == "ranges_acknowledged")
                .filter_map(|(_, r)| r["took_ms"].as_f64())
                .collect();
            shards.push(ShardTraffic {
                owns,
                share_percent: (owns as f64 * 1000.0 / self.secrets.len() as f64).round() / 10.0,
                reconciles: starts,
                released: count_between(&log.releases, t0, t1),
                list_items: items,
                list_bytes: bytes,
                server_filtered: filtered,
                acknowledged_ms,
                shard: name,
            });
        }
        let median = took.get(took.len() / 2).copied().unwrap_or_default();
        Ok(Rebalance {
            change: label,
            moved: moved.len(),
            reconciled_seconds: took.last().copied().unwrap_or_default(),
            reconciled_median_seconds: median,
            window_seconds: window.as_secs_f64(),
            writes: writes(&server_before, &server_after),
            sharder_cpu_seconds: cpu_after - cpu_before,
            sharder_vm_hwm_kib: hwm,
            sharder_vm_rss_kib: rss,
            traffic: traffic(&server_before, &server_after),
            shards,
        })
    }

    /// Stops every shard (SIGTERM, then waits for each).
    pub(crate) async fn stop(&mut self) {
        for (process, _) in self.shards.values() {
            let _ = process.terminate();
        }
        for (process, _) in self.shards.values_mut() {
            let _ = process.wait(Duration::from_secs(60)).await;
        }
    }
}
