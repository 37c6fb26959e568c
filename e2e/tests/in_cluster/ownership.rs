//! The shards' own log records, streamed from their pods through the API (`kubectl logs -f`'s
//! request) from the moment each pod runs, and the exclusive-ownership rule checked on them.
//!
//! The rule, for every object: when shard B reconciles it after shard A did, A must have let go
//! in between, by acknowledging a drain of that object or by releasing or losing its Lease, and A
//! logs no reconcile of it after letting go unless it got the object back the same way. A pod
//! whose container restarts (a shard exits when it loses its Lease) starts a new term under the
//! same name: its reconciles count again from its next `term_started`. Records
//! of all pods carry the node's one clock, so their timestamps compare; a letting-go record may
//! trail the next shard's reconcile by [`LOG_SLACK`], since it is written after the write it
//! reports.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{AsyncBufReadExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, ListParams, LogParams};
use serde_json::Value;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How much later than the next shard's reconcile a letting-go record may be written.
const LOG_SLACK: SignedDuration = SignedDuration::from_secs(2);

/// One JSON record of a shard pod.
#[derive(Clone, Debug)]
pub struct Record {
    pub pod: String,
    pub at: Timestamp,
    pub event: String,
    /// `namespace/name` of the object, for `reconcile` and `drain`.
    pub object: Option<String>,
}

/// Follows the logs of every pod matching a label selector until dropped or [`Self::stop`]ped.
///
/// It runs on a thread and runtime of its own: the tests call kubectl and curl synchronously,
/// which holds up every task of their runtime, and a shard pod that is scaled away within a
/// second or two of starting must still be followed.
pub struct ShardLogs {
    records: Arc<Mutex<Vec<Record>>>,
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ShardLogs {
    /// Starts following the pods of `selector` in `namespace`, those running now and those that
    /// start later, with a client made from `config` on the follower's own runtime.
    pub fn follow(config: kube::Config, namespace: &str, selector: &str) -> anyhow::Result<Self> {
        let records = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let (namespace, selector) = (namespace.to_string(), selector.to_string());
        let (records_, stop_) = (records.clone(), stop.clone());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // Made inside the follower's runtime, so its connection tasks run there.
        let client = {
            let _inside = runtime.enter();
            Client::try_from(config)?
        };
        let thread = std::thread::Builder::new()
            .name("shard-logs".into())
            .spawn(move || {
                runtime.block_on(follow_pods(client, namespace, selector, records_, stop_));
            })?;
        Ok(Self {
            records,
            stop,
            thread: Some(thread),
        })
    }

    /// The records so far.
    pub fn records(&self) -> Vec<Record> {
        self.records.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Stops following and returns every record.
    pub async fn stop(mut self) -> Vec<Record> {
        self.stop.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        self.records()
    }
}

impl Drop for ShardLogs {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Lists the pods every 300 ms and follows each one from the moment it is bound to a node: its
/// log can be read from the moment its container starts, which the pod's status may report
/// only seconds later. A pod is known by its UID: a StatefulSet's replacement pod has the name of
/// the pod it replaces, and is followed as a new one.
async fn follow_pods(
    client: Client,
    namespace: String,
    selector: String,
    records: Arc<Mutex<Vec<Record>>>,
    stop: CancellationToken,
) {
    let pods: Api<Pod> = Api::namespaced(client, &namespace);
    let mut followed = HashSet::new();
    let mut streams = JoinSet::new();
    while !stop.is_cancelled() {
        if let Ok(list) = pods.list(&ListParams::default().labels(&selector)).await {
            for pod in list {
                let name = pod.metadata.name.clone().unwrap_or_default();
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                let bound = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
                if bound && followed.insert(uid.clone()) {
                    let follow = stream(pods.clone(), name, uid, records.clone(), stop.clone());
                    streams.spawn(follow);
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => {}
            () = tokio::time::sleep(Duration::from_millis(300)) => {}
        }
    }
    // Streams end with their containers; give the last lines a moment.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while streams.join_next().await.is_some() {}
    })
    .await;
}

/// Follows one pod's log into `records`. Opening the stream is retried every 250 ms until it
/// opens (the container may still be starting), the pod (of UID `uid`) is gone, or `stop`. A stream that ends
/// while the container still runs (an API server or kubelet connection dropped) is opened again,
/// from the start of the log, and lines already read are skipped: a shard's last records (its
/// Lease released) are what the scale tests look for, and a lost connection must not lose them.
/// The stream is done when a fresh one brings no new line before its end (the container exited),
/// when the pod is gone, or on `stop`.
async fn stream(
    pods: Api<Pod>,
    pod: String,
    uid: String,
    records: Arc<Mutex<Vec<Record>>>,
    stop: CancellationToken,
) {
    let params = LogParams {
        follow: true,
        ..LogParams::default()
    };
    let mut seen: HashSet<String> = HashSet::new();
    loop {
        // The log is read by name: once a replacement of the same name exists, it is that
        // pod's, which a stream of its own follows.
        match pods.get_opt(&pod).await {
            Ok(Some(current)) if current.metadata.uid.as_deref() == Some(uid.as_str()) => {}
            Ok(_) => return,
            Err(_) => {}
        }
        let reader = match pods.log_stream(&pod, &params).await {
            Ok(reader) => reader,
            Err(kube::Error::Api(e)) if e.code == 404 => return,
            Err(_) if !stop.is_cancelled() => {
                tokio::time::sleep(Duration::from_millis(250)).await;
                continue;
            }
            Err(_) => return,
        };
        let mut lines = reader.lines();
        let mut new_lines = 0;
        loop {
            let line = tokio::select! {
                () = stop.cancelled() => {
                    // Whatever is already buffered still counts.
                    match tokio::time::timeout(Duration::from_millis(500), lines.try_next()).await {
                        Ok(Ok(Some(line))) => line,
                        _ => return,
                    }
                }
                next = lines.try_next() => match next {
                    Ok(Some(line)) => line,
                    _ => break,
                },
            };
            if !seen.insert(line.clone()) {
                continue;
            }
            new_lines += 1;
            if let Some(record) = parse(&pod, &line)
                && let Ok(mut all) = records.lock()
            {
                all.push(record);
            }
        }
        if new_lines == 0 || stop.is_cancelled() {
            return;
        }
    }
}

fn parse(pod: &str, line: &str) -> Option<Record> {
    let value: Value = serde_json::from_str(line).ok()?;
    let at = value["timestamp"].as_str()?.parse().ok()?;
    let event = value["event"].as_str().unwrap_or_default().to_string();
    let object = match (value["namespace"].as_str(), value["name"].as_str()) {
        (Some(ns), Some(name)) if event == "reconcile" || event == "drain" => {
            Some(format!("{ns}/{name}"))
        }
        _ => None,
    };
    Some(Record {
        pod: pod.to_string(),
        at,
        event,
        object,
    })
}

/// Every breach of the rule in `records`, described; empty when ownership never overlapped.
pub fn violations(records: &[Record]) -> Vec<String> {
    let mut out = Vec::new();
    // Each pod's terms in order: when a term started (`true`) and when the pod let go of
    // everything (`false`: released or lost its Lease, stopped).
    let mut terms: BTreeMap<&str, Vec<(Timestamp, bool)>> = BTreeMap::new();
    for r in records {
        let began = match r.event.as_str() {
            "term_started" => true,
            "lease_released" | "lease_lost" | "shard_stopped" => false,
            _ => continue,
        };
        terms.entry(&r.pod).or_default().push((r.at, began));
    }
    for changes in terms.values_mut() {
        changes.sort();
    }
    // Whether `pod` let go in `(after, until]`.
    let ended_within = |pod: &str, after: Timestamp, until: Timestamp| {
        terms.get(pod).is_some_and(|c| {
            c.iter()
                .any(|(at, began)| !began && *at > after && *at <= until)
        })
    };
    // When `pod` let go last before `at`, unless a term started since.
    let ended_before = |pod: &str, at: Timestamp| {
        terms.get(pod).and_then(|c| {
            c.iter()
                .rev()
                .find(|(t, _)| *t < at)
                .and_then(|(t, began)| (!began).then_some(*t))
        })
    };
    let mut by_object: BTreeMap<&str, Vec<&Record>> = BTreeMap::new();
    for r in records {
        if let Some(object) = &r.object {
            by_object.entry(object).or_default().push(r);
        }
    }
    for (object, mut events) in by_object {
        events.sort_by_key(|r| r.at);
        let reconciles: Vec<&&Record> = events.iter().filter(|r| r.event == "reconcile").collect();
        for pair in reconciles.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if a.pod == b.pod {
                continue;
            }
            let let_go = |at: Timestamp| at > a.at && at <= b.at + LOG_SLACK;
            let drained = events
                .iter()
                .any(|r| r.event == "drain" && r.pod == a.pod && let_go(r.at));
            let stopped = ended_within(&a.pod, a.at, b.at + LOG_SLACK);
            if !drained && !stopped {
                out.push(format!(
                    "{object}: reconciled by {} at {} and by {} at {} without {} letting go in between",
                    a.pod, a.at, b.pod, b.at, a.pod
                ));
            }
        }
    }
    for r in records {
        if r.event == "reconcile"
            && let Some(end) = ended_before(&r.pod, r.at)
        {
            out.push(format!(
                "{}: {} reconciled it at {} after its Lease ended at {end}",
                r.object.as_deref().unwrap_or_default(),
                r.pod,
                r.at
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(pod: &str, seconds: i64, event: &str, object: Option<&str>) -> Record {
        Record {
            pod: pod.into(),
            at: Timestamp::from_second(seconds).expect("timestamp"),
            event: event.into(),
            object: object.map(str::to_string),
        }
    }

    #[test]
    fn a_handover_needs_a_drain_or_an_end_in_between() {
        let overlap = [
            record("a", 10, "reconcile", Some("ns/x")),
            record("b", 20, "reconcile", Some("ns/x")),
        ];
        assert_eq!(violations(&overlap).len(), 1);
        let drained = [
            record("a", 10, "reconcile", Some("ns/x")),
            record("a", 15, "drain", Some("ns/x")),
            record("b", 20, "reconcile", Some("ns/x")),
        ];
        assert!(violations(&drained).is_empty());
        let released = [
            record("a", 10, "reconcile", Some("ns/x")),
            record("a", 15, "lease_released", None),
            record("b", 20, "reconcile", Some("ns/x")),
        ];
        assert!(violations(&released).is_empty());
        let drained_other = [
            record("a", 10, "reconcile", Some("ns/x")),
            record("a", 15, "drain", Some("ns/y")),
            record("b", 20, "reconcile", Some("ns/x")),
        ];
        assert_eq!(violations(&drained_other).len(), 1);
    }

    #[test]
    fn nothing_after_the_end() {
        let late = [
            record("a", 10, "lease_released", None),
            record("a", 11, "reconcile", Some("ns/x")),
        ];
        assert_eq!(violations(&late).len(), 1);
    }

    #[test]
    fn a_restarted_container_reconciles_again_in_its_new_term() {
        let restarted = [
            record("a", 10, "lease_lost", None),
            record("a", 14, "term_started", None),
            record("a", 15, "reconcile", Some("ns/x")),
        ];
        assert!(violations(&restarted).is_empty());
        let between = [
            record("a", 10, "lease_lost", None),
            record("a", 12, "reconcile", Some("ns/x")),
            record("a", 14, "term_started", None),
        ];
        assert_eq!(violations(&between).len(), 1);
    }
}
