//! The pulse (`--pulse`): one Secret in a namespace no ring selects, patched one write at a time
//! from shortly before the scale-out until it converged. Each write is timed from sending to the
//! API server's answer, and from the answer to a watch of that namespace delivering it.
//!
//! Nothing of the sharding protocol touches it: no webhook call, no shard reconciles it, its watch
//! sees only its own changes. So what its writes and their events wait for during the scale-out
//! is what any write waits for at that moment: the API server's latency under the burst. The
//! handover gap is the same span for an acknowledgement; the difference is what the protocol and
//! the shards add. The writes before the scale-out show the same API server unloaded.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use e2e::fixtures::secret;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PostParams};
use kube::{Client, ResourceExt};
use serde::Serialize;
use serde_json::json;

use crate::handover::Percentiles;
use crate::objects::FirstSeen;

/// The pulse's Secret.
const PULSE_SECRET: &str = "pulse";

/// Label whose value the pulse counts up, one value per write.
const PULSE_LABEL: &str = "load.sharding.timebertt.dev/pulse";

/// How long a write's event may take before it counts as not delivered.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(2);

/// Pause between a write's delivery and the next write: the pulse measures the API server, it
/// must not load it (about 40 writes a second during a scale-out here).
const PAUSE: Duration = Duration::from_millis(1);

/// One timed write.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Beat {
    /// When it was sent.
    pub(crate) sent: Instant,
    /// Sent → answered, in milliseconds.
    pub(crate) answered_ms: f64,
    /// Answered → the watch delivered the change, in milliseconds; `None` when it did not within
    /// [`DELIVERY_TIMEOUT`]. 0 when the event came before the answer was read.
    pub(crate) delivered_ms: Option<f64>,
}

/// A running pulse; [`Pulse::stop`] ends it and returns its writes.
pub(crate) struct Pulse {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<PulseRun>,
}

/// What a pulse wrote.
#[derive(Debug, Default)]
pub(crate) struct PulseRun {
    /// Its answered writes, timed.
    pub(crate) beats: Vec<Beat>,
    /// Every patch it sent, failed ones included: what the API server counted of it.
    pub(crate) writes: usize,
}

impl Pulse {
    /// Creates the pulse's Secret in `namespace`, opens and lists its watch, and starts writing.
    pub(crate) async fn start(client: &Client, namespace: &str) -> anyhow::Result<Self> {
        let secrets = Api::<Secret>::namespaced(client.clone(), namespace);
        secrets
            .create(&PostParams::default(), &secret(PULSE_SECRET))
            .await?;
        let watch = FirstSeen::start(Api::namespaced(client.clone(), namespace), |meta| {
            meta.labels().get(PULSE_LABEL).cloned()
        })
        .await?;
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let stop = Arc::clone(&stop);
            async move { beat(&secrets, &watch, &stop).await }
        });
        Ok(Self { stop, task })
    }

    /// Stops writing (after the write in flight) and returns every write.
    pub(crate) async fn stop(self) -> PulseRun {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap_or_default()
    }
}

/// Writes until `stop`, one write at a time, each followed by waiting for its event.
async fn beat(secrets: &Api<Secret>, watch: &FirstSeen, stop: &AtomicBool) -> PulseRun {
    let mut run = PulseRun::default();
    for n in 1u64.. {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        run.writes += 1;
        let value = n.to_string();
        let body = json!({"metadata": {"labels": {PULSE_LABEL: value}}});
        let sent = Instant::now();
        let written = secrets
            .patch_metadata(PULSE_SECRET, &e2e::patch_params(), &Patch::Merge(&body))
            .await;
        let answered = Instant::now();
        if let Err(error) = written {
            eprintln!("the pulse's write failed: {error}");
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let delivered = watch.wait(&value, answered + DELIVERY_TIMEOUT).await;
        run.beats.push(Beat {
            sent,
            answered_ms: millis(answered - sent),
            delivered_ms: delivered.map(|at| millis(at.saturating_duration_since(answered))),
        });
        tokio::time::sleep(PAUSE).await;
    }
    run
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// The pulse's writes of one stretch of time.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub(crate) struct Stretch {
    /// Writes sent in the stretch.
    pub(crate) writes: usize,
    /// Their round trips (sent → answered).
    pub(crate) answered_ms: Option<Percentiles>,
    /// Answered → delivered to the watch, of those delivered.
    pub(crate) delivered_ms: Option<Percentiles>,
    /// Writes whose event did not come within 2 s.
    pub(crate) undelivered: usize,
}

impl Stretch {
    fn of<'a>(beats: impl Iterator<Item = &'a Beat>) -> Self {
        let beats: Vec<&Beat> = beats.collect();
        let delivered: Vec<f64> = beats.iter().filter_map(|b| b.delivered_ms).collect();
        Self {
            writes: beats.len(),
            answered_ms: Percentiles::of(beats.iter().map(|b| b.answered_ms).collect()),
            undelivered: beats.len() - delivered.len(),
            delivered_ms: Percentiles::of(delivered),
        }
    }
}

/// The pulse's writes before the scale-out and during it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub(crate) struct PulseReport {
    /// Sent before the 4th shard started.
    pub(crate) before: Stretch,
    /// Sent from the 4th shard's start until convergence.
    pub(crate) during: Stretch,
}

impl PulseReport {
    /// Splits `beats` at `start` (the 4th shard started) and `end` (converged); later ones are
    /// left out.
    pub(crate) fn of(beats: &[Beat], start: Instant, end: Instant) -> Self {
        Self {
            before: Stretch::of(beats.iter().filter(|b| b.sent < start)),
            during: Stretch::of(beats.iter().filter(|b| b.sent >= start && b.sent < end)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(at: Instant, offset_ms: u64, answered_ms: f64, delivered_ms: Option<f64>) -> Beat {
        Beat {
            sent: at + Duration::from_millis(offset_ms),
            answered_ms,
            delivered_ms,
        }
    }

    #[test]
    fn writes_are_split_at_the_scale_out_and_its_end() {
        let t = Instant::now();
        let beats = [
            beat(t, 0, 3.0, Some(0.0)),
            beat(t, 10, 4.0, Some(1.0)),
            beat(t, 1000, 30.0, Some(12.0)),
            beat(t, 1100, 50.0, None),
            beat(t, 1200, 20.0, Some(4.0)),
            beat(t, 5000, 3.0, Some(0.0)),
        ];
        let start = t + Duration::from_millis(1000);
        let report = PulseReport::of(&beats, start, t + Duration::from_millis(2000));
        assert_eq!(report.before.writes, 2);
        assert_eq!(report.before.undelivered, 0);
        assert_eq!(report.before.answered_ms.map(|p| p.max), Some(4.0));
        assert_eq!(report.during.writes, 3);
        assert_eq!(report.during.undelivered, 1);
        let delivered = report.during.delivered_ms.expect("two delivered");
        assert_eq!((delivered.p50, delivered.max), (4.0, 12.0));
        assert_eq!(report.during.answered_ms.map(|p| p.p50), Some(30.0));
    }

    #[test]
    fn no_writes_give_no_percentiles() {
        let t = Instant::now();
        let report = PulseReport::of(&[], t, t);
        assert_eq!(report, PulseReport::default());
    }
}
