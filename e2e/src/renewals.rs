//! Shard Lease renewals written by a load tool itself, so that many shards cost no processes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch};
use tokio_util::sync::CancellationToken;

/// What [`renew`] did so far.
#[derive(Debug, Default)]
pub struct RenewalCounters {
    /// Renewals the API server accepted.
    pub renewals: AtomicU64,
    /// Renewals that failed.
    pub failures: AtomicU64,
    /// Renewal requests sent.
    pub requests: AtomicU64,
}

impl RenewalCounters {
    /// Accepted renewals so far.
    pub fn renewals(&self) -> u64 {
        self.renewals.load(Ordering::Relaxed)
    }

    /// Failed renewals so far.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }
}

/// Renews every Lease `names` of `api` once per `period` (a merge patch of `renewTime`), spread
/// evenly over the period, with at most `writers` renewals in flight, until `stop` fires.
pub async fn renew(
    api: Api<Lease>,
    names: Vec<String>,
    period: Duration,
    writers: usize,
    counters: &RenewalCounters,
    stop: CancellationToken,
) {
    if names.is_empty() {
        return;
    }
    let gap = period.div_f64(names.len() as f64);
    let start = tokio::time::Instant::now();
    let schedule = futures::stream::iter(0u64..).then(|n| {
        let at = start + gap.mul_f64(n as f64);
        async move {
            tokio::time::sleep_until(at).await;
            n
        }
    });
    schedule
        .take_until(stop.cancelled())
        .map(|n| {
            let name = &names[(n % names.len() as u64) as usize];
            let api = &api;
            async move {
                let patch = serde_json::json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
                counters.requests.fetch_add(1, Ordering::Relaxed);
                match api
                    .patch(name, &crate::patch_params(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => counters.renewals.fetch_add(1, Ordering::Relaxed),
                    Err(_) => counters.failures.fetch_add(1, Ordering::Relaxed),
                };
            }
        })
        .buffer_unordered(writers.max(1))
        .collect::<()>()
        .await;
}
