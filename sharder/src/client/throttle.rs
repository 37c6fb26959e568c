//! Client-side rate limiting of API requests (`clientConnection.qps`/`burst`), as a tower layer
//! around the kube client's HTTP stack.
//!
//! A token bucket: `burst` requests may go at once, then one every `1/qps`. Requests over the
//! budget are delayed, never rejected, so callers see latency instead of errors.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;
use tower::{Layer, Service};

/// Token bucket shared by all clones of the service.
#[derive(Debug)]
pub(crate) struct Bucket {
    qps: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    /// A full bucket refilled at `qps`, holding at most `burst` tokens (at least one).
    pub(crate) fn new(qps: f32, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            qps: f64::from(qps),
            burst,
            tokens: burst,
            last: Instant::now(),
        }
    }

    /// Takes a token for a request at `now` and returns how long the request must wait for it.
    /// Tokens may go negative: each waiting request holds a reservation.
    pub(crate) fn reserve(&mut self, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.qps).min(self.burst) - 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.qps)
        }
    }
}

/// Layer that rate-limits requests to `qps` with bursts of `burst`.
#[derive(Clone, Debug)]
pub(crate) struct ThrottleLayer {
    bucket: Arc<Mutex<Bucket>>,
}

impl ThrottleLayer {
    /// A layer with its own bucket. `qps` must be positive.
    pub(crate) fn new(qps: f32, burst: u32) -> Self {
        Self {
            bucket: Arc::new(Mutex::new(Bucket::new(qps, burst))),
        }
    }
}

impl<S> Layer<S> for ThrottleLayer {
    type Service = Throttle<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Throttle {
            inner,
            bucket: self.bucket.clone(),
        }
    }
}

/// A service delaying requests to stay within its bucket's rate.
#[derive(Clone, Debug)]
pub(crate) struct Throttle<S> {
    inner: S,
    bucket: Arc<Mutex<Bucket>>,
}

impl<S, R> Service<R> for Throttle<S>
where
    S: Service<R>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let wait = self
            .bucket
            .lock()
            .map(|mut b| b.reserve(Instant::now()))
            .unwrap_or_default();
        let response = self.inner.call(request);
        Box::pin(async move {
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            response.await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn burst_then_steady_rate() {
        let start = Instant::now();
        let mut bucket = Bucket::new(5.0, 2);
        let waits: Vec<_> = (0..5).map(|_| bucket.reserve(start)).collect();
        assert_eq!(waits[0], Duration::ZERO);
        assert_eq!(waits[1], Duration::ZERO);
        assert_eq!(waits[2], Duration::from_millis(200));
        assert_eq!(waits[3], Duration::from_millis(400));
        assert_eq!(waits[4], Duration::from_millis(600));
        // After a quiet second the bucket is full again (but never above the burst).
        let later = start + Duration::from_secs(10);
        assert_eq!(bucket.reserve(later), Duration::ZERO);
        assert_eq!(bucket.reserve(later), Duration::ZERO);
        assert!(bucket.reserve(later) > Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn service_delays_requests_over_the_budget() {
        let layer = ThrottleLayer::new(10.0, 1);
        let mut service = layer.layer(tower::service_fn(|()| async {
            Ok::<_, ()>(Instant::now())
        }));
        let start = Instant::now();
        let first = service.call(()).await;
        let second = service.call(()).await;
        let third = service.call(()).await;
        assert_eq!(first, Ok(start));
        assert_eq!(second, Ok(start + Duration::from_millis(100)));
        assert_eq!(third, Ok(start + Duration::from_millis(200)));
    }
}
