//! The process-wide bound on the sharder controller's patches in flight
//! (`controller.sharder.maxPatchesInFlight`), across every ring and both the sync and the
//! missed-assignment path; `concurrentMoves` bounds one ring's sync below it.

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{Semaphore, SemaphorePermit};

/// Hands out at most a fixed number of permits to send a patch, and reports how many are out.
#[derive(Debug)]
pub(crate) struct PatchLimit {
    permits: Semaphore,
    in_flight: Gauge,
}

/// Leave to send one patch; the slot is free again when this is dropped.
#[derive(Debug)]
pub(crate) struct PatchPermit<'a> {
    _permit: Option<SemaphorePermit<'a>>,
    in_flight: &'a Gauge,
}

impl PatchLimit {
    /// At most `max` patches at once (at least 1); `in_flight` shows how many are out.
    pub(crate) fn new(max: u32, in_flight: Gauge) -> Self {
        let max = usize::try_from(max)
            .unwrap_or(Semaphore::MAX_PERMITS)
            .clamp(1, Semaphore::MAX_PERMITS);
        Self {
            permits: Semaphore::new(max),
            in_flight,
        }
    }

    /// Waits until fewer than the maximum are out; first come, first served.
    pub(crate) async fn acquire(&self) -> PatchPermit<'_> {
        // The semaphore is never closed, so this always holds a permit.
        let permit = self.permits.acquire().await.ok();
        self.in_flight.inc();
        PatchPermit {
            _permit: permit,
            in_flight: &self.in_flight,
        }
    }
}

impl Drop for PatchPermit<'_> {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn never_more_than_the_maximum_in_flight() {
        let max = 7;
        let gauge = Gauge::default();
        let limit = Arc::new(PatchLimit::new(max, gauge.clone()));
        let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..200 {
            let (limit, now, most, gauge) =
                (limit.clone(), now.clone(), most.clone(), gauge.clone());
            tasks.spawn(async move {
                for _ in 0..5 {
                    let _permit = limit.acquire().await;
                    let current = now.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(current, Ordering::SeqCst);
                    assert!(gauge.get() <= i64::from(max), "gauge {}", gauge.get());
                    // Hold the slot across a few scheduling points, as a request would.
                    for _ in 0..3 {
                        tokio::task::yield_now().await;
                    }
                    now.fetch_sub(1, Ordering::SeqCst);
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("task");
        }
        let most = most.load(Ordering::SeqCst);
        assert!(
            most <= max as usize,
            "{most} in flight, at most {max} allowed"
        );
        assert_eq!(
            most, max as usize,
            "the limit was never reached: the test proves nothing"
        );
        assert_eq!(gauge.get(), 0, "every permit was returned");
    }

    #[test]
    fn a_maximum_of_zero_still_lets_one_through() {
        let limit = PatchLimit::new(0, Gauge::default());
        assert_eq!(limit.permits.available_permits(), 1);
    }
}
