//! The report: what was measured per mode and rebalance, the targets, as JSON or text.

use std::fmt::Write as _;

use serde::Serialize;

/// One run: both modes at one object count.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) objects: usize,
    pub(crate) server_version: String,
    pub(crate) profile: &'static str,
    pub(crate) started_utc: String,
    pub(crate) machine: String,
    /// `/proc/loadavg` (1, 5, 15 minutes) when the run started and when it ended.
    pub(crate) load_average: [String; 2],
    /// Extra flags of every shard.
    pub(crate) shard_args: Vec<String>,
    /// The shards' Lease renewal interval (`--retry-period`), seconds.
    pub(crate) renewal_seconds: f64,
    pub(crate) create_seconds: f64,
    pub(crate) modes: Vec<ModeReport>,
    pub(crate) logs: String,
}

/// One ring mode: its initial placement and its two rebalances.
#[derive(Debug, Serialize)]
pub(crate) struct ModeReport {
    /// `label` or `server-side`.
    pub(crate) mode: &'static str,
    /// From starting the mode's first shards (label ring: creating the Secrets) until every
    /// Secret was reconciled by its shard.
    pub(crate) placed_seconds: f64,
    /// The sharder process of this mode (a fresh one per mode), after the placement.
    pub(crate) sharder_cpu_seconds_placement: f64,
    pub(crate) sharder_vm_hwm_kib_placed: u64,
    pub(crate) rebalances: Vec<Rebalance>,
}

/// One rebalance of one mode.
#[derive(Debug, Serialize)]
pub(crate) struct Rebalance {
    /// `3→4` (a shard starts) or `4→3` (SIGTERM to one shard, which releases its Lease).
    pub(crate) change: &'static str,
    /// Secrets whose shard changed.
    pub(crate) moved: usize,
    /// From starting the new shard (or sending SIGTERM) until the last moved Secret's first
    /// finished reconcile by its new shard, by the shards' log timestamps.
    pub(crate) reconciled_seconds: f64,
    /// The median moved Secret's.
    pub(crate) reconciled_median_seconds: f64,
    /// From the change until object writes stopped for the settle time; the counters below
    /// cover this window.
    pub(crate) window_seconds: f64,
    pub(crate) writes: Writes,
    /// The sharder's user + system CPU time in the window.
    pub(crate) sharder_cpu_seconds: f64,
    /// The sharder's peak RSS so far (it ran the placement and any earlier rebalance too).
    pub(crate) sharder_vm_hwm_kib: u64,
    pub(crate) sharder_vm_rss_kib: u64,
    /// What the API server sent about Secrets in the window, over all clients.
    pub(crate) traffic: Traffic,
    pub(crate) shards: Vec<ShardTraffic>,
}

/// Mutating requests the API server served in a window.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Writes {
    /// To the ring's objects.
    pub(crate) secrets: f64,
    /// The checksum ConfigMaps (the shards' own output; on a label ring also the sharder's moves).
    pub(crate) configmaps: f64,
    pub(crate) leases: f64,
    pub(crate) other: f64,
    /// By `VERB resource`, largest first.
    pub(crate) by_kind: Vec<(String, f64)>,
}

/// The API server's counters about Secrets in a window (`apiserver_watch_events_total`,
/// `apiserver_watch_events_sizes_sum`, `apiserver_watch_filtered_events_total`,
/// `apiserver_request_total` and `apiserver_response_sizes_sum` of LIST and WATCH).
#[derive(Debug, Default, Serialize)]
pub(crate) struct Traffic {
    pub(crate) watch_events: f64,
    pub(crate) watch_event_bytes: f64,
    pub(crate) filtered_events: f64,
    pub(crate) lists: f64,
    pub(crate) list_bytes: f64,
    pub(crate) watches: f64,
}

/// One shard after a rebalance.
#[derive(Debug, Serialize)]
pub(crate) struct ShardTraffic {
    pub(crate) shard: String,
    /// Secrets it owns after the rebalance, and their share of all.
    pub(crate) owns: usize,
    pub(crate) share_percent: f64,
    /// Reconciles it started in the window (each follows a list item or watch event it received;
    /// the controller merges events of an object that arrive while it is queued).
    pub(crate) reconciles: usize,
    /// Secrets it released in the window.
    pub(crate) released: usize,
    /// A list of Secrets with its selector after the rebalance, as its own (re)list receives it.
    pub(crate) list_items: usize,
    pub(crate) list_bytes: usize,
    /// The server answered that list with `shardInfo` (zero-write rings only).
    pub(crate) server_filtered: bool,
    /// Zero-write rings: `took_ms` of each acknowledgement it wrote in the window (from seeing a
    /// new generation to the acknowledgement on its Lease).
    pub(crate) acknowledged_ms: Vec<f64>,
}

/// One cell of the text table, from one mode's rebalance.
type Cell = fn(&Rebalance) -> String;

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

impl Report {
    /// The report as text: a table per rebalance with both modes side by side.
    pub(crate) fn text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "ring-compare: {} Secrets, {} ({} build), {}, started {} UTC, load average {} → {}",
            self.objects,
            self.server_version,
            self.profile,
            self.machine,
            self.started_utc,
            self.load_average[0],
            self.load_average[1]
        );
        let _ = writeln!(
            out,
            "Secrets created in {:.1} s; shards renew their Lease every {} s, extra flags {:?}; logs in {}\n",
            self.create_seconds, self.renewal_seconds, self.shard_args, self.logs
        );
        let _ = writeln!(out, "| | {} |", self.column_heads().join(" | "));
        let _ = writeln!(out, "|---|{}", "---|".repeat(self.modes.len()));
        let row = |out: &mut String, name: &str, cell: &dyn Fn(&ModeReport) -> String| {
            let cells: Vec<String> = self.modes.iter().map(cell).collect();
            let _ = writeln!(out, "| {name} | {} |", cells.join(" | "));
        };
        row(&mut out, "placed", &|m| {
            format!("{:.1} s", m.placed_seconds)
        });
        row(&mut out, "sharder CPU, placement", &|m| {
            format!("{:.2} s", m.sharder_cpu_seconds_placement)
        });
        row(&mut out, "sharder VmHWM after placement", &|m| {
            mib(m.sharder_vm_hwm_kib_placed)
        });
        let changes: Vec<&'static str> = self
            .modes
            .first()
            .map(|m| m.rebalances.iter().map(|r| r.change).collect())
            .unwrap_or_default();
        for (i, change) in changes.iter().enumerate() {
            let rows: [(String, Cell); 11] = [
                (format!("**{change}** Secrets moved"), |r| {
                    r.moved.to_string()
                }),
                (
                    "last moved Secret reconciled by its new shard (median)".into(),
                    |r| {
                        format!(
                            "{:.2} s ({:.2} s)",
                            r.reconciled_seconds, r.reconciled_median_seconds
                        )
                    },
                ),
                ("writes to Secrets".into(), |r| r.writes.secrets.to_string()),
                ("writes to ConfigMaps".into(), |r| {
                    r.writes.configmaps.to_string()
                }),
                ("writes to Leases, other".into(), |r| {
                    format!("{}, {}", r.writes.leases, r.writes.other)
                }),
                ("window".into(), |r| format!("{:.1} s", r.window_seconds)),
                ("sharder CPU in the window".into(), |r| {
                    format!("{:.2} s", r.sharder_cpu_seconds)
                }),
                ("sharder VmHWM / VmRSS after".into(), |r| {
                    format!(
                        "{} / {}",
                        mib(r.sharder_vm_hwm_kib),
                        mib(r.sharder_vm_rss_kib)
                    )
                }),
                ("Secret watch events (MiB), filtered away".into(), |r| {
                    format!(
                        "{} ({:.1}), {}",
                        r.traffic.watch_events,
                        r.traffic.watch_event_bytes / 1_048_576.0,
                        r.traffic.filtered_events
                    )
                }),
                ("Secret lists (MiB), watches opened".into(), |r| {
                    format!(
                        "{} ({:.1}), {}",
                        r.traffic.lists,
                        r.traffic.list_bytes / 1_048_576.0,
                        r.traffic.watches
                    )
                }),
                (
                    "per shard: share, reconciles in the window, its list (items, MiB)".into(),
                    |r| {
                        r.shards
                            .iter()
                            .map(|s| {
                                format!(
                                    "{} {:.1} %, {}, ({}, {:.2}){}",
                                    s.shard,
                                    s.share_percent,
                                    s.reconciles,
                                    s.list_items,
                                    s.list_bytes as f64 / 1_048_576.0,
                                    if s.server_filtered { " shardInfo" } else { "" }
                                )
                            })
                            .collect::<Vec<_>>()
                            .join("; ")
                    },
                ),
            ];
            for (name, cell) in rows {
                let cells: Vec<String> = self
                    .modes
                    .iter()
                    .map(|m| m.rebalances.get(i).map_or_else(|| "-".into(), cell))
                    .collect();
                let _ = writeln!(out, "| {name} | {} |", cells.join(" | "));
            }
        }
        out
    }

    fn column_heads(&self) -> Vec<String> {
        self.modes
            .iter()
            .map(|m| match m.mode {
                "label" => "label ring".to_string(),
                _ => "zero-write ring".to_string(),
            })
            .collect()
    }
}
