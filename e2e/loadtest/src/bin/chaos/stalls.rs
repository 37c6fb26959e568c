//! How the API server took writes, as the tool's own heartbeat saw it: a Lease of its own
//! (without the ring label, so no sharder cares) renewed every second, the way shards renew
//! theirs. A shard that loses its Lease while every heartbeat of its renew deadline was slow or
//! failed lost it to the API server (an overloaded machine, say), not to a bug of its own; one
//! that loses it while a heartbeat went through quickly has no such excuse.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, Patch, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Name of the heartbeat Lease.
const HEARTBEAT: &str = "chaos-heartbeat";

/// Interval between heartbeats.
const EVERY: Duration = Duration::from_secs(1);

/// A heartbeat that took longer than this was slow.
const SLOW: SignedDuration = SignedDuration::from_secs(1);

/// Longest a heartbeat may take before it counts as failed.
const TIMEOUT: Duration = Duration::from_secs(30);

/// One heartbeat.
#[derive(Clone, Copy, Debug)]
struct Beat {
    started: Timestamp,
    ended: Timestamp,
    ok: bool,
}

impl Beat {
    fn quick(&self) -> bool {
        self.ok && self.ended.duration_since(self.started) <= SLOW
    }
}

/// Every heartbeat so far.
#[derive(Clone, Debug, Default)]
pub(crate) struct StallLog {
    beats: Arc<Mutex<Vec<Beat>>>,
}

impl StallLog {
    /// Beats until `stop`.
    pub(crate) async fn follow(self, client: Client, namespace: String, stop: CancellationToken) {
        let api = Api::<Lease>::namespaced(client, &namespace);
        loop {
            let started = Timestamp::now();
            let result = tokio::select! {
                () = stop.cancelled() => return,
                result = tokio::time::timeout(TIMEOUT, beat(&api)) => result,
            };
            self.push(Beat {
                started,
                ended: Timestamp::now(),
                ok: matches!(result, Ok(Ok(()))),
            });
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(EVERY) => {}
            }
        }
    }

    fn push(&self, beat: Beat) {
        self.beats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(beat);
    }

    /// Whether no heartbeat between `from` and `to` went through quickly, and at least one was
    /// tried: the API server did not take writes promptly at any moment of that time.
    pub(crate) fn impaired_throughout(&self, from: Timestamp, to: Timestamp) -> bool {
        let beats = self.beats.lock().unwrap_or_else(PoisonError::into_inner);
        let within: Vec<&Beat> = beats
            .iter()
            .filter(|b| b.started >= from && b.started <= to)
            .collect();
        !within.is_empty() && !within.iter().any(|b| b.quick())
    }

    /// Stalls: runs of consecutive slow or failed heartbeats, from the first one's start to the
    /// last one's end.
    pub(crate) fn stalls(&self) -> Vec<(Timestamp, Timestamp)> {
        let beats = self.beats.lock().unwrap_or_else(PoisonError::into_inner);
        let mut stalls: Vec<(Timestamp, Timestamp)> = Vec::new();
        let mut open: Option<(Timestamp, Timestamp)> = None;
        for beat in beats.iter() {
            match (beat.quick(), open.as_mut()) {
                (false, Some(run)) => run.1 = beat.ended,
                (false, None) => open = Some((beat.started, beat.ended)),
                (true, _) => stalls.extend(open.take()),
            }
        }
        stalls.extend(open);
        stalls
    }
}

/// One heartbeat: renew the Lease, creating it the first time.
async fn beat(api: &Api<Lease>) -> Result<(), kube::Error> {
    let now = MicroTime(Timestamp::now());
    let patch = json!({"spec": {"holderIdentity": "chaos", "renewTime": now}});
    match api
        .patch(HEARTBEAT, &e2e::patch_params(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => {
            let lease: Lease = serde_json::from_value(json!({
                "metadata": {"name": HEARTBEAT},
                "spec": {"holderIdentity": "chaos", "renewTime": now},
            }))
            .map_err(kube::Error::SerdeError)?;
            api.create(&PostParams::default(), &lease).await.map(|_| ())
        }
        Err(error) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: i64) -> Timestamp {
        Timestamp::UNIX_EPOCH + SignedDuration::from_millis(ms)
    }

    fn log(beats: &[(i64, i64, bool)]) -> StallLog {
        let log = StallLog::default();
        for (started, ended, ok) in beats {
            log.push(Beat {
                started: t(*started),
                ended: t(*ended),
                ok: *ok,
            });
        }
        log
    }

    #[test]
    fn impaired_only_when_no_beat_went_through_quickly() {
        // Quick, slow, failed, slow, quick.
        let log = log(&[
            (0, 100, true),
            (1_100, 3_500, true),
            (4_500, 5_000, false),
            (6_000, 8_000, true),
            (9_000, 9_100, true),
        ]);
        assert!(log.impaired_throughout(t(1_000), t(8_500)));
        assert!(!log.impaired_throughout(t(0), t(8_500)));
        assert!(!log.impaired_throughout(t(1_000), t(9_500)));
        // No beat tried at all is no evidence of anything.
        assert!(!log.impaired_throughout(t(20_000), t(30_000)));
        assert_eq!(log.stalls(), [(t(1_100), t(8_000))]);
    }
}
