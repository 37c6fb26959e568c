//! What one shard process said it did, read back from its JSON log.
//!
//! `checksum-controller --log-format=json` prints one object per line with the event's fields at
//! the top level and a `timestamp` (RFC 3339, microseconds, the machine's clock, which the tool's
//! own records share). Every record used carries an `event` field:
//!
//! | record | fields |
//! |---|---|
//! | a reconcile starts | `event: "reconcile"`, `namespace`, `name`, `shard` |
//! | a drain was acknowledged (logged after the patch succeeded) | `event: "drain"`, `namespace`, `name`, `shard`, `resource_version` (the version the patch was conditioned on) |
//! | the shard library acquired the Lease | `event: "lease_acquired"`, `transitions`, `resource_version` (of the Lease) |
//! | the Lease was lost (renew deadline missed, or taken over) | `event: "lease_lost"`, `resource_version`; then `event: "shard_stopped"`, `reason: "lease_lost"` |
//! | the Lease was released on graceful shutdown | `event: "lease_released"`, `resource_version` |
//! | a reconcile ended (zero-write ring's holdings) | `event` one of `applied`, `up_to_date`, `awaiting_move`, `write_refused`, with `namespace`, `name` |
//! | the shard let a Secret go (zero-write ring's holdings) | `event: "released"` or `"deleted"`, `namespace`, `name` |
//!
//! Records are recognised by their `event` only, never by their message, which is free to change.
//! The names are the shard's, not the tool's: if they change, loss and release evidence disappears
//! and the ownership check reports violations rather than missing them, so a rename cannot make
//! the check pass silently.

use std::path::Path;

use k8s_openapi::jiff::Timestamp;

/// How one process's Lease ended, by its own account.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LeaseEnd {
    Lost,
    Released,
}

/// What a record says about a shard's hold on one object, for the zero-write ring's check
/// (`ownership::check_zero_write`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mark {
    /// The shard worked on the object: a reconcile started or ended.
    Work,
    /// The shard let the object go: released (its range revoked) or deleted.
    LetGo,
}

impl Mark {
    fn of(record: &serde_json::Value) -> Option<Self> {
        match record["event"].as_str()? {
            "reconcile" | "applied" | "up_to_date" | "awaiting_move" | "write_refused" => {
                Some(Self::Work)
            }
            "released" | "deleted" => Some(Self::LetGo),
            _ => None,
        }
    }
}

/// The kinds of record the checks use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Record {
    Reconcile,
    Drain,
    Acquired,
    Lost,
    Released,
}

impl Record {
    /// What `record` reports, by its `event` field.
    fn of(record: &serde_json::Value) -> Option<Self> {
        match record["event"].as_str() {
            Some("reconcile") => Some(Self::Reconcile),
            Some("drain") => Some(Self::Drain),
            Some("lease_acquired") => Some(Self::Acquired),
            Some("lease_lost") => Some(Self::Lost),
            Some("lease_released") => Some(Self::Released),
            Some("shard_stopped") if record["reason"].as_str() == Some("lease_lost") => {
                Some(Self::Lost)
            }
            _ => None,
        }
    }
}

/// The records of one shard process that the checks use.
#[derive(Debug, Default)]
pub(crate) struct RunLog {
    /// Reconcile starts: time and `namespace/name`.
    pub(crate) reconciles: Vec<(Timestamp, String)>,
    /// Drain acknowledgements: time, `namespace/name`, and the `resourceVersion` acknowledged.
    pub(crate) drains: Vec<(Timestamp, String, Option<u64>)>,
    /// When it acquired its Lease, and the Lease's `leaseTransitions` then.
    pub(crate) acquired: Option<(Timestamp, i64)>,
    /// The first record saying the Lease was lost or released.
    pub(crate) lease_end: Option<(Timestamp, LeaseEnd)>,
    /// Records of work on and letting go of objects: time, `namespace/name`, which.
    pub(crate) marks: Vec<(Timestamp, String, Mark)>,
    /// Lines that were not JSON records with a timestamp (panics, say).
    pub(crate) other_lines: usize,
}

impl RunLog {
    /// Reads the log at `path`, one [`RunLog`] per term of membership (see
    /// [`RunLog::parse_terms`]); a missing file reads as one empty term.
    pub(crate) fn read_terms(path: &Path) -> Vec<Self> {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        Self::parse_terms(&text)
    }

    /// Parses log text into terms: a shard that stepped out of its ring (its Lease excluded by
    /// the sharder, then released) and joined again later is, between the two, a process that
    /// holds nothing, and each term is judged on its own. A term ends with the first record of
    /// the Lease lost or released; an acquisition after that starts the next one.
    pub(crate) fn parse_terms(text: &str) -> Vec<Self> {
        let mut terms = vec![String::new()];
        let mut ended = false;
        for line in text.lines() {
            let record = serde_json::from_str::<serde_json::Value>(line).ok();
            let kind = record.as_ref().and_then(Record::of);
            if ended && kind == Some(Record::Acquired) {
                terms.push(String::new());
                ended = false;
            }
            if matches!(kind, Some(Record::Lost | Record::Released)) {
                ended = true;
            }
            let current = terms.last_mut().expect("one term at least");
            current.push_str(line);
            current.push('\n');
        }
        terms.iter().map(|t| Self::parse(t)).collect()
    }

    /// Parses log text.
    pub(crate) fn parse(text: &str) -> Self {
        let mut log = Self::default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let Ok(record) = serde_json::from_str::<serde_json::Value>(line) else {
                log.other_lines += 1;
                continue;
            };
            let Some(at) = record["timestamp"]
                .as_str()
                .and_then(|t| t.parse::<Timestamp>().ok())
            else {
                log.other_lines += 1;
                continue;
            };
            let object = || {
                format!(
                    "{}/{}",
                    record["namespace"].as_str().unwrap_or_default(),
                    record["name"].as_str().unwrap_or_default()
                )
            };
            if let Some(mark) = Mark::of(&record) {
                log.marks.push((at, object(), mark));
            }
            match Record::of(&record) {
                Some(Record::Reconcile) => log.reconciles.push((at, object())),
                Some(Record::Drain) => {
                    let version = record["resource_version"]
                        .as_str()
                        .and_then(|v| v.parse().ok());
                    log.drains.push((at, object(), version));
                }
                Some(Record::Acquired) if log.acquired.is_none() => {
                    log.acquired = Some((at, record["transitions"].as_i64().unwrap_or(0)));
                }
                _ if log.lease_end.is_some() => {}
                Some(Record::Lost) => log.lease_end = Some((at, LeaseEnd::Lost)),
                Some(Record::Released) => log.lease_end = Some((at, LeaseEnd::Released)),
                _ => {}
            }
        }
        log
    }

    /// When the process said it lost its Lease, if it did.
    pub(crate) fn lost_at(&self) -> Option<Timestamp> {
        self.lease_end
            .filter(|(_, end)| *end == LeaseEnd::Lost)
            .map(|(at, _)| at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as checksum-controller prints them with `--log-format=json`.
    const LOG: &str = r#"{"timestamp":"2026-01-01T00:00:00.000001Z","level":"INFO","message":"acquiring shard Lease","shard":"shard-0"}
{"timestamp":"2026-01-01T00:00:01.000000Z","level":"INFO","message":"acquired Lease","event":"lease_acquired","lease":"shard-0","namespace":"leases","identity":"shard-0","transitions":3,"resource_version":"100"}
{"timestamp":"2026-01-01T00:00:02.000000Z","level":"INFO","message":"reconciling Secret","event":"reconcile","namespace":"ns","name":"s-1","shard":"shard-0"}
{"timestamp":"2026-01-01T00:00:03.000000Z","level":"INFO","message":"acknowledged drain","event":"drain","namespace":"ns","name":"s-1","shard":"shard-0","resource_version":"12"}
{"timestamp":"2026-01-01T00:00:04.000000Z","level":"WARN","message":"Lease was taken over or removed, it is lost","event":"lease_lost","lease":"shard-0","namespace":"leases","holder":"shardlease-controller","resource_version":"104"}
{"timestamp":"2026-01-01T00:00:04.100000Z","level":"ERROR","message":"lost the shard Lease, stopped at once","event":"shard_stopped","reason":"lease_lost","shard":"shard-0"}
thread 'main' panicked at somewhere
"#;

    #[test]
    fn reads_the_records_the_checks_use() {
        let at = |s: &str| s.parse::<Timestamp>().expect("timestamp");
        let log = RunLog::parse(LOG);
        assert_eq!(
            log.reconciles,
            [(at("2026-01-01T00:00:02Z"), "ns/s-1".to_string())]
        );
        assert_eq!(
            log.drains,
            [(at("2026-01-01T00:00:03Z"), "ns/s-1".to_string(), Some(12))]
        );
        assert_eq!(log.acquired, Some((at("2026-01-01T00:00:01Z"), 3)));
        // The first loss record counts.
        assert_eq!(
            log.lease_end,
            Some((at("2026-01-01T00:00:04Z"), LeaseEnd::Lost))
        );
        assert_eq!(log.lost_at(), Some(at("2026-01-01T00:00:04Z")));
        assert_eq!(log.other_lines, 1);
    }

    #[test]
    fn the_event_field_wins_over_the_message() {
        // A renamed message still counts by its event; a record whose event says something
        // else does not count by its message.
        let log = RunLog::parse(
            r#"{"timestamp":"2026-01-01T00:00:01Z","message":"got it","event":"lease_acquired","transitions":1}
{"timestamp":"2026-01-01T00:00:02Z","message":"released Lease","event":"something_else"}
{"timestamp":"2026-01-01T00:00:03Z","message":"stopped","event":"shard_stopped","reason":"shutdown"}
{"timestamp":"2026-01-01T00:00:04Z","message":"gone","event":"shard_stopped","reason":"lease_lost"}"#,
        );
        let at = |s: &str| s.parse::<Timestamp>().expect("timestamp");
        assert_eq!(log.acquired, Some((at("2026-01-01T00:00:01Z"), 1)));
        assert_eq!(
            log.lease_end,
            Some((at("2026-01-01T00:00:04Z"), LeaseEnd::Lost))
        );
    }

    #[test]
    fn a_release_is_not_a_loss() {
        let log = RunLog::parse(
            r#"{"timestamp":"2026-01-01T00:00:05Z","level":"INFO","message":"released Lease","event":"lease_released","lease":"shard-0","resource_version":"7"}"#,
        );
        assert_eq!(log.lease_end.map(|(_, end)| end), Some(LeaseEnd::Released));
        assert_eq!(log.lost_at(), None);
    }

    #[test]
    fn a_record_without_an_event_counts_for_nothing() {
        // The messages of the records the checks use, without their `event`.
        let log = RunLog::parse(
            r#"{"timestamp":"2026-01-01T00:00:01Z","level":"INFO","message":"acquired Lease","transitions":1}
{"timestamp":"2026-01-01T00:00:05Z","level":"INFO","message":"released Lease","lease":"shard-0"}"#,
        );
        assert_eq!(log.acquired, None);
        assert_eq!(log.lease_end, None);
    }

    #[test]
    fn a_shard_that_steps_out_and_rejoins_has_two_terms() {
        let terms = RunLog::parse_terms(concat!(
            r#"{"timestamp":"2026-01-01T00:00:01Z","event":"lease_acquired","transitions":1}"#,
            "\n",
            r#"{"timestamp":"2026-01-01T00:00:02Z","event":"reconcile","namespace":"ns","name":"a"}"#,
            "\n",
            r#"{"timestamp":"2026-01-01T00:00:03Z","event":"lease_released"}"#,
            "\n",
            r#"{"timestamp":"2026-01-01T00:00:09Z","event":"lease_acquired","transitions":3}"#,
            "\n",
            r#"{"timestamp":"2026-01-01T00:00:10Z","event":"reconcile","namespace":"ns","name":"b"}"#,
            "\n",
        ));
        assert_eq!(terms.len(), 2);
        assert_eq!(terms[0].reconciles.len(), 1);
        assert_eq!(
            terms[0].lease_end.map(|(_, end)| end),
            Some(LeaseEnd::Released)
        );
        assert_eq!(terms[1].acquired.map(|(_, t)| t), Some(3));
        assert_eq!(terms[1].reconciles[0].1, "ns/b");
        assert_eq!(terms[1].lease_end, None);
    }
}
