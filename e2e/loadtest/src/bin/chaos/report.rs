//! The report of one run, as text for people or JSON (`--json`) for machines.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kube_sharding_api::Assignment;
use serde::Serialize;

use crate::churn::ChurnStats;
use crate::convergence::Outcome;
use crate::faults::FaultRecord;
use crate::findings::{ExitCounts, ShardCounts, Violation};
use crate::fleet::ShardTiming;
use crate::probes::Rss;

/// Settings of the run.
#[derive(Debug, Serialize)]
pub(crate) struct Settings {
    pub(crate) seed: u64,
    pub(crate) duration_seconds: f64,
    pub(crate) rate: f64,
    pub(crate) shards: usize,
    pub(crate) namespaces: usize,
    pub(crate) objects: usize,
    pub(crate) fault_interval_seconds: f64,
    pub(crate) shard_timing: ShardTiming,
    /// Leader election of the sharder replicas: duration, renew deadline, retry period (s).
    pub(crate) leader_election: (u32, u32, u32),
    /// `debug` or `release`: the profile of this tool and the binaries beside it.
    pub(crate) profile: &'static str,
    pub(crate) server_version: String,
    /// Where every process's log is.
    pub(crate) logs: String,
}

/// Sharder memory and API server watches, before the chaos and after convergence.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Leaks {
    pub(crate) rss_before: Vec<Rss>,
    pub(crate) rss_after: Vec<Rss>,
    /// Watches the sharder replicas and shards hold open, per resource: the API server's count
    /// with them running minus its count without them.
    pub(crate) watches_before: BTreeMap<String, u64>,
    pub(crate) watches_after: BTreeMap<String, u64>,
}

/// The pins the tool set in one ring and what they went through; how the pinned Secrets ended is
/// in [`Outcome::pins`].
#[derive(Debug, Serialize)]
pub(crate) struct PinReport {
    /// `(namespace, shard)`: the namespace pinned as a whole, if any.
    pub(crate) namespace: Option<(String, String)>,
    /// The Secrets pinned on their own, `namespace/name` and the shard pinned.
    pub(crate) objects: Vec<(String, String)>,
    /// Faults on this ring that struck a pinned shard.
    pub(crate) faults_on_pinned_shards: usize,
    /// Times one of those Secrets came back onto its pin after the ring had placed it elsewhere
    /// (the tool's watch of their versions).
    pub(crate) returns_to_pin: usize,
}

/// What one ring went through and what its checks found.
#[derive(Debug, Serialize)]
pub(crate) struct RingReport {
    pub(crate) name: String,
    pub(crate) assignment: Assignment,
    /// Whether its shards left their ConfigMaps to the sharder (`--leave-children-to-sharder`).
    pub(crate) shards_leave_children: bool,
    pub(crate) namespaces: Vec<String>,
    pub(crate) lease_namespace: String,
    /// Faults on this ring's shards or their Leases, by kind (those on the whole system are in
    /// [`Report::faults_by_kind`]).
    pub(crate) faults_by_kind: BTreeMap<&'static str, usize>,
    pub(crate) faults_skipped: usize,
    /// What the restore after the chaos phase did (shards added or retired to get back to the
    /// starting number).
    pub(crate) restore: Vec<String>,
    pub(crate) churn: ChurnStats,
    /// Seconds from the end of the last fault (or the restore, if later) to convergence.
    pub(crate) converged_after_last_fault_seconds: Option<f64>,
    pub(crate) convergence: Outcome,
    pub(crate) pins: PinReport,
    pub(crate) shards: BTreeMap<String, ShardCounts>,
    /// Drain acknowledgements a shard logged after it said its Lease was lost or released (not
    /// violations: see `ownership`).
    pub(crate) drains_logged_after_lease_end: usize,
    /// Drain acknowledgements dated by the tool's watch of the object rather than by their late
    /// record.
    pub(crate) drains_dated_by_watch: usize,
    /// Handovers evidenced by a drain the API server's history shows completed just as the tool
    /// stopped the shard, which therefore never logged it.
    pub(crate) drains_never_logged: usize,
    /// How its shards' processes ended.
    pub(crate) exits: ExitCounts,
    /// Its broken invariants: ownership, convergence, nothing lost, its shards' exits.
    pub(crate) violations: Vec<Violation>,
}

/// Everything one run found.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) settings: Settings,
    /// Faults on the whole system (sharder replicas, API server, webhook), by kind.
    pub(crate) faults_by_kind: BTreeMap<&'static str, usize>,
    pub(crate) faults_skipped: usize,
    /// Every fault carried out, on the whole system or on one ring's shards.
    pub(crate) faults: Vec<FaultRecord>,
    /// The bound convergence had to meet, derived from the Lease durations.
    pub(crate) convergence_bound_seconds: f64,
    /// Per ring under test, the webhook ring first.
    pub(crate) rings: Vec<RingReport>,
    /// Times the tool's heartbeat writes stalled (slower than a second or failing), and the
    /// longest, in seconds.
    pub(crate) api_stalls: usize,
    pub(crate) longest_api_stall_seconds: f64,
    /// Each stall: when it began, and how long it lasted in seconds.
    pub(crate) api_stall_list: Vec<(String, f64)>,
    /// How the sharder replicas' processes ended.
    pub(crate) sharder_exits: ExitCounts,
    pub(crate) leaks: Leaks,
    /// Broken invariants of the whole system (leaks, sharder exits); each ring has its own.
    pub(crate) violations: Vec<Violation>,
    pub(crate) seconds_total: f64,
}

impl Report {
    /// Violations of the whole system and of every ring.
    pub(crate) fn violation_count(&self) -> usize {
        self.violations.len() + self.rings.iter().map(|r| r.violations.len()).sum::<usize>()
    }

    /// The report as text.
    pub(crate) fn text(&self) -> String {
        let mut out = String::new();
        let s = &self.settings;
        let _ = writeln!(
            out,
            "chaos run: seed {} ({} build, {})",
            s.seed, s.profile, s.server_version
        );
        let _ = writeln!(
            out,
            "  {} s of faults every ~{} s; {} rings, each with {} churn ops/s over {} namespaces and {} shards (Lease {} s); 2 sharder replicas",
            s.duration_seconds,
            s.fault_interval_seconds,
            self.rings.len(),
            s.rate,
            s.namespaces,
            s.shards,
            s.shard_timing.lease_duration
        );
        let _ = writeln!(out, "  logs: {}", s.logs);
        write_faults(
            &mut out,
            "",
            &self.faults_by_kind,
            self.faults_skipped,
            "the whole system",
        );
        let _ = writeln!(
            out,
            "convergence bound: {} s after the last fault",
            self.convergence_bound_seconds
        );
        let _ = writeln!(
            out,
            "API server stalls seen by the tool's heartbeat: {} (longest {:.1} s)",
            self.api_stalls, self.longest_api_stall_seconds
        );
        let e = &self.sharder_exits;
        let _ = writeln!(
            out,
            "sharder exits: {} signalled by the tool ({} unclean after SIGTERM); {} unexpected",
            e.signalled, e.unclean_after_term, e.unexpected
        );
        let rss = |v: &[Rss]| {
            v.iter()
                .map(|r| format!("replica {} pid {} {} KiB", r.replica, r.pid, r.rss_kib))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(out, "sharder RSS before: {}", rss(&self.leaks.rss_before));
        let _ = writeln!(out, "sharder RSS after:  {}", rss(&self.leaks.rss_after));
        let _ = writeln!(
            out,
            "watches held by sharders and shards before: {:?}",
            self.leaks.watches_before
        );
        let _ = writeln!(
            out,
            "watches held by sharders and shards after:  {:?}",
            self.leaks.watches_after
        );
        write_violations(&mut out, "", "whole-system violations", &self.violations);
        for ring in &self.rings {
            ring.write(&mut out);
        }
        let per_ring: Vec<String> = self
            .rings
            .iter()
            .map(|r| format!("{:?} ring {}", r.assignment, r.violations.len()))
            .collect();
        let _ = writeln!(
            out,
            "violations: {} (whole system {}, {})",
            self.violation_count(),
            self.violations.len(),
            per_ring.join(", ")
        );
        let _ = writeln!(
            out,
            "{} in {:.0} s (replay with --seed {})",
            if self.violation_count() == 0 {
                "PASSED"
            } else {
                "FAILED"
            },
            self.seconds_total,
            s.seed
        );
        out
    }
}

impl RingReport {
    /// The ring's section of the text report.
    fn write(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "{:?} ring {} over {:?}, Leases in {}{}:",
            self.assignment,
            self.name,
            self.namespaces,
            self.lease_namespace,
            if self.shards_leave_children {
                ", shards leaving their ConfigMaps to the sharder"
            } else {
                ""
            }
        );
        write_faults(
            out,
            "  ",
            &self.faults_by_kind,
            self.faults_skipped,
            "its shards",
        );
        if !self.restore.is_empty() {
            let _ = writeln!(out, "  restore: {}", self.restore.join(", "));
        }
        let c = &self.churn;
        let _ = writeln!(
            out,
            "  churn: {} created ({} with a controlled ConfigMap), {} updated, {} deleted, {} failed requests, {} ops/s",
            c.created,
            c.controlled_config_maps,
            c.updated,
            c.deleted,
            c.failed.values().sum::<u64>(),
            c.achieved_rate
        );
        let o = &self.convergence;
        let _ = writeln!(
            out,
            "  convergence: {} after the last fault; placement {}, content {} into the wait; {} Secrets, {} ConfigMaps",
            fmt_seconds(self.converged_after_last_fault_seconds),
            fmt_seconds(o.placement_seconds),
            fmt_seconds(o.content_seconds),
            o.secrets,
            o.config_maps
        );
        let p = &self.pins;
        let _ = writeln!(
            out,
            "  pins: {} Secrets pinned on their own, {} on their pin at the end; {} faults struck a pinned shard; pinned Secrets came back to their pin {} times",
            o.pins.object_pinned, o.pins.on_object_pin, p.faults_on_pinned_shards, p.returns_to_pin
        );
        if let Some((namespace, shard)) = &p.namespace {
            let _ = writeln!(
                out,
                "  namespace {namespace} pinned to {shard}: {} Secrets under its pin at the end ({} on it)",
                o.pins.namespace_pinned, o.pins.on_namespace_pin
            );
        }
        let _ = writeln!(
            out,
            "  per shard (processes, reconciles, drains acknowledged):"
        );
        for (shard, n) in &self.shards {
            let _ = writeln!(
                out,
                "    {shard:<10} {:>3} {:>7} {:>6}",
                n.processes, n.reconciles, n.drains
            );
        }
        let _ = writeln!(
            out,
            "  drain acknowledgements logged after the Lease ended: {}; dated by the tool's watch: {}; never logged (shard stopped as it wrote them): {}",
            self.drains_logged_after_lease_end,
            self.drains_dated_by_watch,
            self.drains_never_logged
        );
        let e = &self.exits;
        let _ = writeln!(
            out,
            "  shard exits: {} signalled by the tool ({} unclean after SIGTERM); Lease lost: {} after a pause, {} after its deletion, {} in an API server restart, {} in an API server stall; {} unexpected",
            e.signalled,
            e.unclean_after_term,
            e.lease_lost_after_pause,
            e.lease_lost_after_deletion,
            e.lease_lost_in_apiserver_restart,
            e.lease_lost_in_api_stall,
            e.unexpected
        );
        write_violations(out, "  ", "violations", &self.violations);
    }
}

/// A line of fault counts on `what`, then one line per kind, indented by `indent`.
fn write_faults(
    out: &mut String,
    indent: &str,
    by_kind: &BTreeMap<&'static str, usize>,
    skipped: usize,
    what: &str,
) {
    let executed: usize = by_kind.values().sum();
    let _ = writeln!(
        out,
        "{indent}faults on {what}: {executed} injected, {skipped} skipped"
    );
    for (kind, n) in by_kind {
        let _ = writeln!(out, "{indent}  {kind:<18} {n}");
    }
}

/// A count of `violations` headed `heading`, then each, indented by `indent`.
fn write_violations(out: &mut String, indent: &str, heading: &str, violations: &[Violation]) {
    let _ = writeln!(out, "{indent}{heading}: {}", violations.len());
    for v in violations {
        let _ = writeln!(out, "{indent}  [{}] {}", v.invariant, v.detail);
    }
}

fn fmt_seconds(seconds: Option<f64>) -> String {
    seconds.map_or_else(|| "never".to_string(), |s| format!("{s:.1} s"))
}
