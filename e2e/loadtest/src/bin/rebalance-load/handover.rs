//! The handover gap: for every Secret that moved during the scale-out, the time from its old
//! shard's drain acknowledgement (the `drain` record it logs when the API server answered the
//! write: from then on the object is the new shard's) to its new shard starting its first
//! reconcile (`reconcile`), from the shards' own log records, all written on this machine's clock.
//! A negative gap means the new shard started before the old one had read the answer.
//!
//! Beside it: the acknowledgement's round trip (`took_ms` of the record: the API server, and the
//! sharder's webhook that names the new shard in the same write), the gap counted from sending
//! the acknowledgement, and from the tool's own watch seeing the new shard label to the new
//! shard's reconcile (its watch, its queue, its runtime).

use std::collections::HashMap;
use std::time::SystemTime;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde::Serialize;

use crate::placement::{Changes, Kind};

/// A shard's log records that matter here.
#[derive(Debug, Default)]
pub(crate) struct ShardLog {
    /// Drain acknowledgements: when answered, of which object (`namespace/name`), round trip.
    drains: Vec<(Timestamp, String, SignedDuration)>,
    /// Reconcile starts, of which object.
    reconciles: Vec<(Timestamp, String)>,
    /// Terms started (`term_started`): when, and how long the work waited for the sharder's
    /// judgement of the Lease (`waited_ms`).
    terms: Vec<(Timestamp, f64)>,
}

impl ShardLog {
    /// Reads a shard's JSON records (fields at the top level, as the checksum-controller writes
    /// them).
    pub(crate) fn parse(records: &[serde_json::Value]) -> Self {
        let mut log = Self::default();
        for record in records {
            let Some(at) = record["timestamp"]
                .as_str()
                .and_then(|t| t.parse::<Timestamp>().ok())
            else {
                continue;
            };
            let object = format!(
                "{}/{}",
                record["namespace"].as_str().unwrap_or_default(),
                record["name"].as_str().unwrap_or_default()
            );
            match record["event"].as_str() {
                Some("drain") => {
                    let took = record["took_ms"].as_f64().unwrap_or_default();
                    let took = SignedDuration::from_secs_f64(took / 1e3);
                    log.drains.push((at, object, took));
                }
                Some("reconcile") => log.reconciles.push((at, object)),
                Some("term_started") => {
                    log.terms
                        .push((at, record["waited_ms"].as_f64().unwrap_or_default()));
                }
                _ => {}
            }
        }
        log
    }
}

/// Nearest-rank percentiles of a set of durations, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub(crate) struct Percentiles {
    pub(crate) p50: f64,
    pub(crate) p90: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
}

impl Percentiles {
    pub(crate) fn of(mut values: Vec<f64>) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        values.sort_by(f64::total_cmp);
        let rank = |p: f64| {
            // Nearest rank: the smallest value with at least p of all values at or below it.
            let index = ((p * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1;
            (values[index] * 100.0).round() / 100.0
        };
        Some(Self {
            p50: rank(0.5),
            p90: rank(0.9),
            p99: rank(0.99),
            max: rank(1.0),
        })
    }
}

/// The handover gaps of one scale-out.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub(crate) struct Handover {
    /// Acknowledged drains of Secrets in the scale-out with a later reconcile on another shard.
    pub(crate) handovers: usize,
    /// Acknowledged drains with no later reconcile on another shard in the logs.
    pub(crate) unmatched: usize,
    /// From the acknowledgement's answer to the new shard's first reconcile.
    pub(crate) gap_ms: Option<Percentiles>,
    /// From sending the acknowledgement to the new shard's first reconcile.
    pub(crate) from_sent_ms: Option<Percentiles>,
    /// The acknowledgement's round trip (sent → answered).
    pub(crate) acknowledgement_ms: Option<Percentiles>,
    /// From the tool's watch seeing the new shard label to the new shard's first reconcile.
    pub(crate) seen_to_reconcile_ms: Option<Percentiles>,
    /// Handovers acknowledged before their new shard's first reconcile of the scale-out: a
    /// shard that joined was still starting (waiting for the sharder's `ready`, listing), so
    /// these wait for its start, not for the watch event.
    pub(crate) before_start: usize,
    /// The gap of the other handovers, acknowledged once their new shard was reconciling.
    pub(crate) gap_after_start_ms: Option<Percentiles>,
    /// Shards whose term started during the scale-out.
    pub(crate) joined: Vec<Joined>,
}

/// A shard that started a term during the scale-out: how its start went.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub(crate) struct Joined {
    pub(crate) shard: String,
    /// From acquiring the Lease to the sharder's judgement (the work's start).
    pub(crate) judged_ms: f64,
    /// From the work's start to its first reconcile.
    pub(crate) to_first_reconcile_ms: Option<f64>,
}

/// Every reconcile start in `logs`, by object (`namespace/name`): when, and by which shard, in
/// order.
fn reconcile_starts(logs: &[(String, ShardLog)]) -> HashMap<&str, Vec<(Timestamp, &str)>> {
    let mut reconciles: HashMap<&str, Vec<(Timestamp, &str)>> = HashMap::new();
    for (shard, log) in logs {
        for (at, object) in &log.reconciles {
            reconciles
                .entry(object.as_str())
                .or_default()
                .push((*at, shard.as_str()));
        }
    }
    for starts in reconciles.values_mut() {
        starts.sort();
    }
    reconciles
}

/// Matches every drain acknowledgement answered after `since` with the first reconcile of the
/// same object by another shard that started after the acknowledgement was sent.
///
/// `logs` are the shards' parsed logs by shard name; `changes` the tool's watch's label changes
/// per object (by Secret name; for the split of the gap).
pub(crate) fn handover(
    logs: &[(String, ShardLog)],
    changes: &HashMap<(Kind, String), Changes>,
    namespace: &str,
    since: SystemTime,
) -> Handover {
    let since = Timestamp::try_from(since).unwrap_or(Timestamp::UNIX_EPOCH);
    let reconciles = reconcile_starts(logs);
    // Each shard's first reconcile of the scale-out: a joining shard's start.
    let mut first_reconcile: HashMap<&str, Timestamp> = HashMap::new();
    for (shard, log) in logs {
        if let Some(first) = log
            .reconciles
            .iter()
            .map(|(at, _)| *at)
            .filter(|at| *at >= since)
            .min()
        {
            first_reconcile.insert(shard.as_str(), first);
        }
    }
    let ms = |d: SignedDuration| d.as_secs_f64() * 1e3;
    let prefix = format!("{namespace}/");
    let (mut gaps, mut from_sent, mut trips, mut after_seen) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let joined = logs
        .iter()
        .filter_map(|(shard, log)| {
            let (started, waited) = *log.terms.iter().find(|(at, _)| *at >= since)?;
            Some(Joined {
                shard: shard.clone(),
                judged_ms: waited,
                to_first_reconcile_ms: first_reconcile
                    .get(shard.as_str())
                    .map(|first| ms(first.duration_since(started))),
            })
        })
        .collect();
    let (mut unmatched, mut before_start, mut after_start) = (0, 0, Vec::new());
    for (shard, log) in logs {
        for (answered, object, took) in log.drains.iter().filter(|(at, ..)| *at >= since) {
            let sent = *answered - *took;
            let next = reconciles.get(object.as_str()).and_then(|starts| {
                starts
                    .iter()
                    .find(|(at, by)| *at >= sent && *by != shard.as_str())
            });
            let Some((started, by)) = next else {
                unmatched += 1;
                continue;
            };
            let gap = ms(started.duration_since(*answered));
            gaps.push(gap);
            if first_reconcile
                .get(by)
                .is_some_and(|first| answered < first)
            {
                before_start += 1;
            } else {
                after_start.push(gap);
            }
            from_sent.push(ms(started.duration_since(sent)));
            trips.push(ms(*took));
            let seen = object
                .strip_prefix(&prefix)
                .and_then(|name| changes.get(&(Kind::Secret, name.to_string())))
                .and_then(|c| c.relabelled_at)
                .and_then(|at| Timestamp::try_from(at).ok());
            if let Some(seen) = seen {
                after_seen.push(ms(started.duration_since(seen)));
            }
        }
    }
    Handover {
        handovers: gaps.len(),
        unmatched,
        gap_ms: Percentiles::of(gaps),
        from_sent_ms: Percentiles::of(from_sent),
        acknowledgement_ms: Percentiles::of(trips),
        seen_to_reconcile_ms: Percentiles::of(after_seen),
        before_start,
        gap_after_start_ms: Percentiles::of(after_start),
        joined,
    }
}

/// For each write of a Secret (`namespace`/name, sent, answered), from the answer to the first
/// reconcile of that Secret by any shard that started after the write was sent: what the
/// handover gap is for an acknowledgement, for any other write the shards watch.
pub(crate) fn reconcile_after_writes(
    logs: &[(String, ShardLog)],
    namespace: &str,
    writes: &[(String, SystemTime, SystemTime)],
) -> Option<Percentiles> {
    let reconciles = reconcile_starts(logs);
    let at = |t: SystemTime| Timestamp::try_from(t).unwrap_or(Timestamp::UNIX_EPOCH);
    let gaps = writes
        .iter()
        .filter_map(|(name, sent, answered)| {
            let (sent, answered) = (at(*sent), at(*answered));
            let started = reconciles
                .get(format!("{namespace}/{name}").as_str())?
                .iter()
                .find(|(t, _)| *t >= sent)?
                .0;
            Some(started.duration_since(answered).as_secs_f64() * 1e3)
        })
        .collect();
    Percentiles::of(gaps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(text: &str) -> Vec<serde_json::Value> {
        text.lines()
            .map(|l| serde_json::from_str(l).expect("valid record"))
            .collect()
    }

    /// The parsed logs of shards "a" (`old`) and "b" (`new`).
    fn shard_logs(old: &[serde_json::Value], new: &[serde_json::Value]) -> Vec<(String, ShardLog)> {
        vec![
            ("a".to_string(), ShardLog::parse(old)),
            ("b".to_string(), ShardLog::parse(new)),
        ]
    }

    fn at(timestamp: &str) -> SystemTime {
        timestamp.parse::<Timestamp>().expect("timestamp").into()
    }

    #[test]
    fn a_gap_runs_from_sending_the_acknowledgement_to_the_other_shards_reconcile() {
        let old = records(
            r#"{"timestamp":"2026-01-01T00:00:01.000000Z","event":"reconcile","namespace":"ns","name":"s-1","shard":"a"}
{"timestamp":"2026-01-01T00:00:10.020000Z","event":"drain","namespace":"ns","name":"s-1","shard":"a","took_ms":20.0}
{"timestamp":"2026-01-01T00:00:10.500000Z","event":"drain","namespace":"ns","name":"s-2","shard":"a","took_ms":5.0}"#,
        );
        let new = records(
            r#"{"timestamp":"2026-01-01T00:00:10.030000Z","event":"reconcile","namespace":"ns","name":"s-1","shard":"b"}
{"timestamp":"2026-01-01T00:00:10.040000Z","event":"reconcile","namespace":"ns","name":"s-1","shard":"b"}"#,
        );
        let logs = shard_logs(&old, &new);
        let seen = at("2026-01-01T00:00:10.025Z");
        let changes = HashMap::from([(
            (Kind::Secret, "s-1".to_string()),
            Changes {
                relabelled_at: Some(seen),
                ..Changes::default()
            },
        )]);
        let since = at("2026-01-01T00:00:05Z");
        let h = handover(&logs, &changes, "ns", since);
        // s-1: sent at 10.000, answered at 10.020, reconciled by b at 10.030; s-2 never
        // reconciled elsewhere.
        assert_eq!(h.handovers, 1);
        assert_eq!(h.unmatched, 1);
        assert_eq!(h.gap_ms.map(|p| p.p50), Some(10.0));
        assert_eq!(h.from_sent_ms.map(|p| p.p50), Some(30.0));
        assert_eq!(h.acknowledgement_ms.map(|p| p.max), Some(20.0));
        assert_eq!(h.seen_to_reconcile_ms.map(|p| p.p50), Some(5.0));
    }

    #[test]
    fn drains_before_the_scale_out_and_reconciles_before_the_acknowledgement_do_not_count() {
        let old = records(
            r#"{"timestamp":"2026-01-01T00:00:01.000000Z","event":"drain","namespace":"ns","name":"s-1","shard":"a","took_ms":1.0}
{"timestamp":"2026-01-01T00:00:10.000000Z","event":"drain","namespace":"ns","name":"s-1","shard":"a","took_ms":1.0}"#,
        );
        let new = records(
            r#"{"timestamp":"2026-01-01T00:00:02.000000Z","event":"reconcile","namespace":"ns","name":"s-1","shard":"b"}
{"timestamp":"2026-01-01T00:00:10.100000Z","event":"reconcile","namespace":"ns","name":"s-1","shard":"b"}"#,
        );
        let logs = shard_logs(&old, &new);
        let since = at("2026-01-01T00:00:05Z");
        let h = handover(&logs, &HashMap::new(), "ns", since);
        assert_eq!(h.handovers, 1);
        assert_eq!(h.gap_ms.map(|p| p.p50), Some(100.0));
        assert_eq!(h.from_sent_ms.map(|p| p.p50), Some(101.0));
        assert_eq!(h.seen_to_reconcile_ms, None);
    }

    #[test]
    fn handovers_acknowledged_while_the_new_shard_was_starting_are_told_apart() {
        let old = records(
            r#"{"timestamp":"2026-01-01T00:00:10.000000Z","event":"drain","namespace":"ns","name":"s-1","shard":"a","took_ms":1.0}
{"timestamp":"2026-01-01T00:00:10.300000Z","event":"drain","namespace":"ns","name":"s-2","shard":"a","took_ms":1.0}"#,
        );
        // b's first reconcile of the scale-out is s-1's, 200 ms after s-1 was acknowledged.
        let new = records(
            r#"{"timestamp":"2026-01-01T00:00:10.150000Z","event":"term_started","shard":"b","waited_ms":40.5}
{"timestamp":"2026-01-01T00:00:10.200000Z","event":"reconcile","namespace":"ns","name":"s-1","shard":"b"}
{"timestamp":"2026-01-01T00:00:10.310000Z","event":"reconcile","namespace":"ns","name":"s-2","shard":"b"}"#,
        );
        let logs = shard_logs(&old, &new);
        let since = at("2026-01-01T00:00:05Z");
        let h = handover(&logs, &HashMap::new(), "ns", since);
        assert_eq!(h.handovers, 2);
        assert_eq!(h.gap_ms.map(|p| p.max), Some(200.0));
        assert_eq!(h.before_start, 1, "s-1 waited for b's start");
        assert_eq!(h.gap_after_start_ms.map(|p| p.max), Some(10.0));
        assert_eq!(
            h.joined,
            [Joined {
                shard: "b".into(),
                judged_ms: 40.5,
                to_first_reconcile_ms: Some(50.0),
            }]
        );
    }

    #[test]
    fn a_write_is_timed_to_the_first_reconcile_started_after_it_was_sent() {
        let shard = records(
            r#"{"timestamp":"2026-01-01T00:00:09.000000Z","event":"reconcile","namespace":"ns","name":"s-1","shard":"a"}
{"timestamp":"2026-01-01T00:00:10.008000Z","event":"reconcile","namespace":"ns","name":"s-1","shard":"a"}
{"timestamp":"2026-01-01T00:00:10.050000Z","event":"reconcile","namespace":"ns","name":"s-1","shard":"a"}"#,
        );
        let logs = vec![("a".to_string(), ShardLog::parse(&shard))];
        let writes = [
            (
                "s-1".to_string(),
                at("2026-01-01T00:00:10.000Z"),
                at("2026-01-01T00:00:10.005Z"),
            ),
            // Never reconciled: not counted.
            (
                "s-2".to_string(),
                at("2026-01-01T00:00:10.000Z"),
                at("2026-01-01T00:00:10.005Z"),
            ),
        ];
        let p = reconcile_after_writes(&logs, "ns", &writes).expect("one write matched");
        assert_eq!((p.p50, p.max), (3.0, 3.0));
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let p = Percentiles::of((1..=100).map(f64::from).collect()).expect("values");
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(Percentiles::of(Vec::new()), None);
    }
}
