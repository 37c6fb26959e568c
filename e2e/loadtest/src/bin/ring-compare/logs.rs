//! The shards' JSON logs, read incrementally: at 100,000 objects a shard logs several hundred
//! thousand records, too many to parse again on every poll.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use anyhow::Context;
use k8s_openapi::jiff::Timestamp;
use serde_json::Value;

/// What one shard's log said so far about the Secrets of one namespace.
#[derive(Debug)]
pub(crate) struct ShardLog {
    path: PathBuf,
    namespace: String,
    offset: u64,
    /// The end of the last read when it stopped inside a line.
    partial: String,
    /// Per Secret, the times of its reconciles' outcomes (`applied`, `up_to_date`).
    finished: HashMap<String, Vec<Timestamp>>,
    /// Times of every reconcile start (`reconcile`).
    pub(crate) starts: Vec<Timestamp>,
    /// Times of every release (`released`).
    pub(crate) releases: Vec<Timestamp>,
    /// The shard library's `ranges_applied` and `ranges_acknowledged` records.
    pub(crate) range_records: Vec<(Timestamp, Value)>,
}

/// Reconcile outcomes: the ConfigMap written, or found as it would be written.
const FINISHED: [&str; 2] = ["applied", "up_to_date"];

impl ShardLog {
    pub(crate) fn new(path: PathBuf, namespace: &str) -> Self {
        Self {
            path,
            namespace: namespace.to_string(),
            offset: 0,
            partial: String::new(),
            finished: HashMap::new(),
            starts: Vec::new(),
            releases: Vec::new(),
            range_records: Vec::new(),
        }
    }

    /// Reads what the shard wrote since the last call.
    pub(crate) fn refresh(&mut self) -> anyhow::Result<()> {
        let mut file = std::fs::File::open(&self.path)
            .with_context(|| format!("failed to open {}", self.path.display()))?;
        file.seek(SeekFrom::Start(self.offset))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        self.offset += bytes.len() as u64;
        let text = std::mem::take(&mut self.partial) + &String::from_utf8_lossy(&bytes);
        let complete = match text.rfind('\n') {
            Some(end) => {
                self.partial = text[end + 1..].to_string();
                &text[..end]
            }
            None => {
                self.partial = text;
                return Ok(());
            }
        };
        for line in complete.lines() {
            if let Ok(record) = serde_json::from_str::<Value>(line) {
                self.add(record);
            }
        }
        Ok(())
    }

    fn add(&mut self, record: Value) {
        let Some(at) = record["timestamp"]
            .as_str()
            .and_then(|t| t.parse::<Timestamp>().ok())
        else {
            return;
        };
        let event = record["event"].as_str().unwrap_or_default();
        if event.starts_with("ranges_") {
            self.range_records.push((at, record));
            return;
        }
        if record["namespace"] != self.namespace.as_str() {
            return;
        }
        match event {
            "reconcile" => self.starts.push(at),
            "released" => self.releases.push(at),
            event if FINISHED.contains(&event) => {
                if let Some(name) = record["name"].as_str() {
                    self.finished.entry(name.to_string()).or_default().push(at);
                }
            }
            _ => {}
        }
    }

    /// When a reconcile of Secret `name` first finished at or after `since`.
    pub(crate) fn finished_since(&self, name: &str, since: Timestamp) -> Option<Timestamp> {
        self.finished
            .get(name)?
            .iter()
            .copied()
            .filter(|at| *at >= since)
            .min()
    }
}

/// How many of `times` fall into `[from, to]`.
pub(crate) fn count_between(times: &[Timestamp], from: Timestamp, to: Timestamp) -> usize {
    times.iter().filter(|at| **at >= from && **at <= to).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_only_complete_new_lines_and_keeps_the_namespace() {
        let dir = std::env::temp_dir().join(e2e::unique_name("ring-compare-logs"));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("shard.log");
        let line = |t: &str, event: &str, ns: &str, name: &str| {
            format!(
                "{{\"timestamp\":\"{t}\",\"event\":\"{event}\",\"namespace\":\"{ns}\",\"name\":\"{name}\"}}\n"
            )
        };
        let first = line("2026-11-29T10:00:00Z", "reconcile", "ns", "a")
            + &line("2026-11-29T10:00:01Z", "applied", "ns", "a")
            + &line("2026-11-29T10:00:01Z", "applied", "other", "b")
            + "not json\n";
        let second = line("2026-11-29T10:00:05Z", "up_to_date", "ns", "a");
        // The second record arrives in two writes: the first read sees half a line.
        std::fs::write(&path, first.clone() + &second[..20]).expect("write");
        let mut log = ShardLog::new(path.clone(), "ns");
        log.refresh().expect("read");
        let t = |s: &str| s.parse::<Timestamp>().expect("time");
        assert_eq!(log.starts.len(), 1);
        assert_eq!(
            log.finished_since("a", t("2026-11-29T10:00:00Z")),
            Some(t("2026-11-29T10:00:01Z"))
        );
        assert_eq!(log.finished_since("a", t("2026-11-29T10:00:02Z")), None);
        assert_eq!(log.finished_since("b", t("2026-11-29T09:00:00Z")), None);
        std::fs::write(&path, first + &second).expect("write");
        log.refresh().expect("read");
        assert_eq!(
            log.finished_since("a", t("2026-11-29T10:00:02Z")),
            Some(t("2026-11-29T10:00:05Z"))
        );
        assert_eq!(
            count_between(
                &log.starts,
                t("2026-11-29T10:00:00Z"),
                t("2026-11-29T10:00:00Z")
            ),
            1
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
