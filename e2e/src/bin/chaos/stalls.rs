//! When the API server did not take writes, as the tool's own heartbeat saw it: a Lease of its
//! own (without the ring label, so no sharder cares) renewed every second, the way shards renew
//! theirs. A shard that loses its Lease while the heartbeat also stalled lost it to the API server
//! (an overloaded machine, say), not to a bug of its own; one that loses it while the heartbeat
//! went through did not have that excuse.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Name of the heartbeat Lease.
const HEARTBEAT: &str = "chaos-heartbeat";

/// Interval between heartbeats.
const EVERY: Duration = Duration::from_secs(1);

/// A heartbeat slower than this counts as a stall.
const SLOW: Duration = Duration::from_secs(1);

/// Longest a heartbeat may take before it counts as failed.
const TIMEOUT: Duration = Duration::from_secs(30);

/// Intervals in which the heartbeat stalled: from the start of the first slow or failed write to
/// the end of the next successful one.
#[derive(Clone, Debug, Default)]
pub(crate) struct StallLog {
    stalls: Arc<Mutex<Vec<(Timestamp, Timestamp)>>>,
}

impl StallLog {
    /// Beats until `stop`.
    pub(crate) async fn follow(self, client: Client, namespace: String, stop: CancellationToken) {
        let api = Api::<Lease>::namespaced(client, &namespace);
        let mut failing_since: Option<Timestamp> = None;
        loop {
            let started = Timestamp::now();
            let beat = tokio::select! {
                () = stop.cancelled() => break,
                beat = tokio::time::timeout(TIMEOUT, beat(&api)) => beat,
            };
            let ended = Timestamp::now();
            match beat {
                Ok(Ok(())) => {
                    let slow = ended.duration_since(started)
                        > SignedDuration::try_from(SLOW).unwrap_or_default();
                    if let Some(from) = failing_since.take() {
                        self.push(from, ended);
                    } else if slow {
                        self.push(started, ended);
                    }
                }
                Ok(Err(_)) | Err(_) => {
                    failing_since.get_or_insert(started);
                }
            }
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(EVERY) => {}
            }
        }
        if let Some(from) = failing_since {
            self.push(from, Timestamp::now());
        }
    }

    fn push(&self, from: Timestamp, to: Timestamp) {
        self.stalls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((from, to));
    }

    /// Every stall so far.
    pub(crate) fn stalls(&self) -> Vec<(Timestamp, Timestamp)> {
        self.stalls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// One heartbeat: renew the Lease, creating it the first time.
async fn beat(api: &Api<Lease>) -> Result<(), kube::Error> {
    let now = MicroTime(Timestamp::now());
    let patch = json!({"spec": {"holderIdentity": "chaos", "renewTime": now}});
    match api
        .patch(HEARTBEAT, &PatchParams::default(), &Patch::Merge(&patch))
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
