//! What the tests of the lock and of the modules that run on it (a shard's membership) share:
//! a lock on the fake Lease store, on tokio's paused clock.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

use super::lock::Clock;
use super::store::Store;
pub(crate) use super::store::fake::FakeStore;
use super::{Error, LeaseLock, LeaseLockConfig};

pub(crate) const DURATION: Duration = Duration::from_secs(15);
pub(crate) const DEADLINE: Duration = Duration::from_secs(10);
pub(crate) const RETRY: Duration = Duration::from_secs(2);
/// The exclusion annotation the test locks watch.
pub(crate) const EXCLUDED: &str = "excluded";

/// A wall clock that advances with tokio's (paused) clock.
pub(crate) fn test_clock() -> Clock {
    let wall_start = Timestamp::from_second(1_700_000_000).expect("valid timestamp");
    let start = Instant::now();
    Arc::new(move || {
        let elapsed = Instant::now() - start;
        let micros = i64::try_from(elapsed.as_micros()).expect("small");
        wall_start
            .checked_add(k8s_openapi::jiff::SignedDuration::from_micros(micros))
            .expect("in range")
    })
}

/// A lock of Lease `ns/shard-a` for `identity`, on the test timing, watching [`EXCLUDED`].
pub(crate) fn lock(fake: &FakeStore, identity: &str) -> LeaseLock {
    let config = LeaseLockConfig::new("ns", "shard-a", identity)
        .with_label("ring", "r")
        .without_label("old-ring")
        .with_annotation("weight", "2")
        .with_exclusion_annotation(EXCLUDED)
        .with_lease_duration(DURATION)
        .with_renew_deadline(DEADLINE)
        .with_retry_period(RETRY);
    LeaseLock::with_store(Store::Fake(fake.clone()), config, test_clock()).expect("valid")
}

/// The stored Lease's spec.
pub(crate) fn spec(fake: &FakeStore) -> LeaseSpec {
    fake.lease().and_then(|l| l.spec).expect("lease exists")
}

/// Lets spawned tasks run at the current (paused) instant.
pub(crate) async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

/// Puts the exclusion annotation on the stored Lease, as the sharder would.
pub(crate) fn exclude(fake: &FakeStore, reason: &str) {
    fake.modify(|lease| {
        lease
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(EXCLUDED.into(), reason.into());
    });
}

/// A lock with `config` on the fake store `fake`, on the test clock.
pub(crate) fn fake_lock(fake: &FakeStore, config: LeaseLockConfig) -> Result<LeaseLock, Error> {
    LeaseLock::with_store(Store::Fake(fake.clone()), config, test_clock())
}
