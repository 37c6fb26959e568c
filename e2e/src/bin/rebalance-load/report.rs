//! The report of one run: what was measured, as JSON or text.

use std::fmt::Debug;
use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

/// Everything measured in one run.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) objects: usize,
    pub(crate) server_version: String,
    /// `release` or `debug`: the profile this tool (and the binaries beside it) was built with.
    pub(crate) profile: &'static str,
    pub(crate) concurrent_moves: usize,
    /// Extra environment of the sharder process (`--sharder-env`).
    pub(crate) sharder_env: Vec<String>,
    pub(crate) logs: String,
    pub(crate) phases: Vec<Phase>,
    pub(crate) scale_out: ScaleOut,
    pub(crate) floor: Floor,
}

/// Setting up one ring size and measuring a fresh sharder's memory after its full sync.
#[derive(Debug, Serialize)]
pub(crate) struct Phase {
    pub(crate) objects: usize,
    /// Seconds to create this phase's Secrets.
    pub(crate) create_seconds: f64,
    /// Seconds from the first create until every Secret and ConfigMap was placed.
    pub(crate) placed_seconds: f64,
    pub(crate) sharder: MemorySample,
    /// The sharder's log record of that sync.
    pub(crate) sync: SyncRecord,
    /// First pages of the sync's lists, requested the same way.
    pub(crate) pages: Vec<PageProbe>,
}

/// Memory of the sharder process, in KiB.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct MemorySample {
    pub(crate) vm_hwm_kib: u64,
    pub(crate) vm_rss_kib: u64,
}

/// A "finished sync of ring" record of the sharder.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SyncRecord {
    pub(crate) duration: String,
    pub(crate) listed: u64,
    pub(crate) drained: u64,
    pub(crate) moved: u64,
    pub(crate) failed: u64,
}

/// The first page a cluster-wide metadata list returns.
#[derive(Debug, Serialize)]
pub(crate) struct PageProbe {
    pub(crate) resource: &'static str,
    /// `sharder`: the request the sharder's sync sends; `spec`: `resourceVersion=0` with the limit.
    pub(crate) request: &'static str,
    /// The query string sent.
    pub(crate) query: String,
    pub(crate) items: usize,
    pub(crate) bytes: usize,
    pub(crate) has_continue: bool,
}

/// The 3 → 4 scale-out.
#[derive(Debug, Serialize)]
pub(crate) struct ScaleOut {
    /// Seconds from starting the 4th shard until the ring reported 4 available shards.
    pub(crate) available_seconds: f64,
    /// Seconds from starting the 4th shard until convergence.
    pub(crate) converged_seconds: f64,
    /// Objects the 4-shard ring puts elsewhere than the 3-shard ring (per kind, equal).
    pub(crate) predicted_moves: usize,
    pub(crate) moved_secrets: usize,
    pub(crate) moved_configmaps: usize,
    /// Whether every moved object went to the new shard.
    pub(crate) only_new_shard_gained: bool,
    pub(crate) counters: Counters,
    /// Syncs the sharder finished between starting the 4th shard and the end of the settle time.
    pub(crate) syncs: Vec<SyncRecord>,
    pub(crate) transitions: Transitions,
    /// Sharder memory after the scale-out (its peak includes the startup sync at full size).
    pub(crate) sharder_after: MemorySample,
}

/// Patches the sharder counted during the scale-out.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Counters {
    pub(crate) secret_drains: u64,
    pub(crate) secret_moves: u64,
    pub(crate) configmap_drains: u64,
    pub(crate) configmap_moves: u64,
}

impl Counters {
    pub(crate) fn total(&self) -> u64 {
        self.secret_drains + self.secret_moves + self.configmap_drains + self.configmap_moves
    }
}

/// Label changes the watches saw after the 4th shard started.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub(crate) struct Transitions {
    /// Secrets that gained the drain label.
    pub(crate) drains_seen: u64,
    /// Shard-label changes of Secrets.
    pub(crate) secret_relabels: u64,
    /// Shard-label changes of ConfigMaps.
    pub(crate) configmap_relabels: u64,
    /// Shard-label changes to a shard other than the 4-shard ring's (e.g. a shard re-applying a
    /// ConfigMap the sharder had just moved away from it).
    pub(crate) wrong_relabels: u64,
    /// Seconds after the target was set until the first drain label was seen.
    pub(crate) first_drain_seconds: Option<f64>,
    /// Seconds after the target was set until the first ConfigMap changed its shard label.
    pub(crate) first_configmap_relabel_seconds: Option<f64>,
    /// Seconds after the target was set until the last drain label was seen (about when the
    /// sharder's drain pass ended).
    pub(crate) last_drain_seconds: Option<f64>,
    /// Seconds after the target was set until the last ConfigMap changed its shard label.
    pub(crate) last_configmap_relabel_seconds: Option<f64>,
}

/// The floor: plain label patches on the moved objects.
#[derive(Debug, Serialize)]
pub(crate) struct Floor {
    pub(crate) patches: usize,
    pub(crate) concurrency: usize,
    pub(crate) runs_seconds: Vec<f64>,
    pub(crate) median_seconds: f64,
    pub(crate) failed: usize,
}

impl Report {
    pub(crate) fn rss_growth_percent(&self) -> Option<f64> {
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

    pub(crate) fn text(&self) -> String {
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

/// An optional number of seconds as text.
pub(crate) fn seconds(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_string(), |s| format!("{s:.2} s"))
}

/// Seconds with millisecond precision, for the report.
pub(crate) fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}
