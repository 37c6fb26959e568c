//! Tests of the lock against a fake API, on tokio's paused clock.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::store::Store;
use super::store::fake::{FakeStore, Mode};
use super::testing::*;
use super::*;

#[test]
fn config_validation() {
    let ok = LeaseLockConfig::new("ns", "n", "id");
    assert!(ok.validate().is_ok());
    assert_eq!(ok.lease_duration_seconds(), 15);
    let bad = [
        LeaseLockConfig::new("", "n", "id"),
        ok.clone().with_renew_deadline(DURATION),
        ok.clone().with_retry_period(DEADLINE),
        ok.clone().with_retry_period(Duration::ZERO),
        ok.clone()
            .with_lease_duration(Duration::from_millis(500))
            .with_renew_deadline(Duration::from_millis(400))
            .with_retry_period(Duration::from_millis(100)),
        // Longer than the sharder counts: it would take the Lease over while still held.
        ok.clone()
            .with_lease_duration(Duration::from_secs(900))
            .with_renew_deadline(Duration::from_secs(800)),
    ];
    for config in bad {
        assert!(config.validate().is_err(), "{config:?}");
    }
    let rounded = ok.with_lease_duration(Duration::from_millis(2_500));
    assert_eq!(rounded.lease_duration_seconds(), 3);
}

#[tokio::test(start_paused = true)]
async fn acquire_creates_and_renews_every_retry_period() {
    let fake = FakeStore::new();
    let lock = lock(&fake, "shard-a");
    let held = lock.acquire().await;
    let created = fake.lease().expect("created");
    assert_eq!(
        created
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("ring"))
            .map(String::as_str),
        Some("r")
    );
    let first = spec(&fake);
    assert_eq!(first.holder_identity.as_deref(), Some("shard-a"));
    assert_eq!(first.lease_duration_seconds, Some(15));
    assert_eq!(first.lease_transitions, Some(0));
    assert_eq!(first.acquire_time, first.renew_time);

    tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
    settle().await;
    let second = spec(&fake);
    assert!(second.renew_time > first.renew_time, "renewTime advances");
    assert_eq!(second.acquire_time, first.acquire_time, "acquireTime stays");
    assert_eq!(fake.writes(), 2);

    tokio::time::sleep(RETRY * 10).await;
    settle().await;
    assert!(!held.is_lost());
    assert_eq!(fake.writes(), 12);
}

#[tokio::test(start_paused = true)]
async fn hung_api_loses_the_lease_exactly_at_the_renew_deadline() {
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    // One more successful renewal, then the API stops answering.
    tokio::time::sleep(RETRY).await;
    settle().await;
    assert_eq!(fake.writes(), 2);
    fake.set_mode(Mode::Hang);
    let last_success = Instant::now();

    tokio::time::sleep_until(last_success + DEADLINE - Duration::from_millis(1)).await;
    settle().await;
    assert!(!held.is_lost(), "not lost before the deadline");
    tokio::time::sleep(Duration::from_millis(1)).await;
    settle().await;
    assert!(held.is_lost(), "lost at the deadline");
    // The future resolves at once now.
    tokio::time::timeout(Duration::from_millis(1), held.lost())
        .await
        .expect("lost() resolves");
}

#[tokio::test(start_paused = true)]
async fn failing_api_is_retried_until_the_renew_deadline() {
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    let acquired = Instant::now();
    let token = held.lost_token();

    // Renewals at 2, 4 and 6 s fail; the one at 8 s succeeds and moves the deadline to 18 s.
    fake.set_mode(Mode::Fail);
    tokio::time::sleep_until(acquired + Duration::from_secs(7)).await;
    settle().await;
    assert!(!token.is_cancelled());
    fake.set_mode(Mode::Normal);
    tokio::time::sleep_until(acquired + Duration::from_secs(13)).await;
    settle().await;
    assert!(
        !held.is_lost(),
        "a success before the deadline keeps the lease"
    );

    // Last success at 12 s: failing from now on loses the Lease at exactly 22 s.
    fake.set_mode(Mode::Fail);
    tokio::time::sleep_until(acquired + Duration::from_secs(22) - Duration::from_millis(1)).await;
    settle().await;
    assert!(!held.is_lost());
    tokio::time::sleep(Duration::from_millis(1)).await;
    settle().await;
    assert!(held.is_lost());
    assert!(token.is_cancelled());
}

#[tokio::test(start_paused = true)]
async fn takeover_is_noticed_at_the_next_renewal() {
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    fake.modify(|lease| {
        let spec = lease.spec.get_or_insert_default();
        spec.holder_identity = Some("shardlease-controller".into());
        spec.lease_duration_seconds = Some(30);
    });
    tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
    settle().await;
    assert!(held.is_lost());
    assert_eq!(
        spec(&fake).holder_identity.as_deref(),
        Some("shardlease-controller"),
        "the lock never overwrites a new holder"
    );
    assert!(
        !held.release().await.expect("release"),
        "nothing to release"
    );
    assert_eq!(
        spec(&fake).holder_identity.as_deref(),
        Some("shardlease-controller")
    );
}

#[tokio::test(start_paused = true)]
async fn foreign_label_change_is_not_a_loss_and_labels_survive() {
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    fake.modify(|lease| {
        lease
            .metadata
            .labels
            .get_or_insert_default()
            .insert("state".into(), "ready".into());
        lease
            .metadata
            .labels
            .get_or_insert_default()
            .insert("old-ring".into(), "r".into());
        lease
            .metadata
            .annotations
            .get_or_insert_default()
            .insert("note".into(), "kept".into());
    });
    tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
    settle().await;
    assert!(!held.is_lost());
    let labels = fake
        .lease()
        .and_then(|l| l.metadata.labels)
        .expect("labels");
    assert_eq!(labels.get("state").map(String::as_str), Some("ready"));
    assert_eq!(labels.get("ring").map(String::as_str), Some("r"));
    assert!(
        !labels.contains_key("old-ring"),
        "removed at the next write"
    );
    let annotations = fake
        .lease()
        .and_then(|l| l.metadata.annotations)
        .expect("annotations");
    assert_eq!(annotations.get("weight").map(String::as_str), Some("2"));
    assert_eq!(annotations.get("note").map(String::as_str), Some("kept"));
    assert_eq!(fake.writes(), 2, "renewed after re-reading");
}

#[tokio::test(start_paused = true)]
async fn an_annotation_the_lock_no_longer_writes_is_removed_at_the_next_write() {
    let fake = FakeStore::new();
    let config = LeaseLockConfig::new("ns", "shard-a", "shard-a")
        .without_annotation("said")
        .with_lease_duration(DURATION)
        .with_renew_deadline(DEADLINE)
        .with_retry_period(RETRY);
    let held = LeaseLock::with_store(Store::Fake(fake.clone()), config, test_clock())
        .expect("valid")
        .acquire()
        .await;
    // What an earlier run of the shard wrote, and what someone else wrote.
    fake.modify(|lease| {
        let annotations = lease.metadata.annotations.get_or_insert_default();
        annotations.insert("said".into(), "true".into());
        annotations.insert("note".into(), "kept".into());
    });
    tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
    settle().await;
    assert!(!held.is_lost());
    let annotations = fake
        .lease()
        .and_then(|l| l.metadata.annotations)
        .expect("annotations");
    assert!(!annotations.contains_key("said"), "{annotations:?}");
    assert_eq!(annotations.get("note").map(String::as_str), Some("kept"));
}

#[tokio::test(start_paused = true)]
async fn waits_for_a_takeover_to_expire_then_takes_the_lease() {
    let fake = FakeStore::new();
    let lock = lock(&fake, "shard-a");
    drop(lock.acquire().await);
    // The sharder took it over: holder changed, duration doubled, renewed "now".
    let taken_at = Instant::now();
    let now = (lock.inner.clock)();
    fake.modify(|lease| {
        let spec = lease.spec.get_or_insert_default();
        spec.holder_identity = Some("shardlease-controller".into());
        spec.lease_duration_seconds = Some(30);
        spec.acquire_time = Some(MicroTime(now));
        spec.renew_time = Some(MicroTime(now));
        spec.lease_transitions = Some(1);
    });
    let held = lock.acquire().await;
    let waited = Instant::now() - taken_at;
    // Expired from exactly `renewTime + leaseDurationSeconds` on (docs/protocol.md §4), so the
    // attempt at exactly 30 s takes it.
    assert!(waited >= Duration::from_secs(30), "waited {waited:?}");
    assert!(
        waited <= Duration::from_secs(30) + RETRY,
        "waited {waited:?}"
    );
    let spec = spec(&fake);
    assert_eq!(spec.holder_identity.as_deref(), Some("shard-a"));
    assert_eq!(spec.lease_transitions, Some(2));
    assert_eq!(spec.lease_duration_seconds, Some(15));
    assert!(spec.acquire_time > Some(MicroTime(now)));
    assert!(!held.is_lost());
}

#[tokio::test(start_paused = true)]
async fn second_identity_waits_while_the_first_renews_and_gets_it_on_release() {
    let fake = FakeStore::new();
    let first = lock(&fake, "replica-1").acquire().await;
    let second = lock(&fake, "replica-2");
    assert!(second.try_acquire().await.expect("no error").is_none());

    let waiting = tokio::spawn(async move { second.acquire().await });
    tokio::time::sleep(DURATION * 3).await;
    settle().await;
    assert!(!waiting.is_finished(), "a renewed lease is never taken");

    assert!(first.release().await.expect("release"));
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
    let held = tokio::time::timeout(RETRY * 2, waiting)
        .await
        .expect("acquired soon after release")
        .expect("task ok");
    let spec = spec(&fake);
    assert_eq!(spec.holder_identity.as_deref(), Some("replica-2"));
    assert_eq!(spec.lease_transitions, Some(1));
    assert!(!held.is_lost());
}

/// A lock reporting the load of `meter`, with the test timing.
fn reporting_lock(fake: &FakeStore, meter: &crate::LoadMeter) -> LeaseLock {
    let config = LeaseLockConfig::new("ns", "shard-a", "shard-a")
        .with_load_report(meter.clone())
        .with_lease_duration(DURATION)
        .with_renew_deadline(DEADLINE)
        .with_retry_period(RETRY);
    LeaseLock::with_store(Store::Fake(fake.clone()), config, test_clock()).expect("valid")
}

fn load_annotation(fake: &FakeStore) -> Option<String> {
    fake.lease()
        .and_then(|l| l.metadata.annotations)
        .and_then(|a| a.get(kube_sharding_api::load::ANNOTATION_LOAD).cloned())
}

#[tokio::test(start_paused = true)]
async fn the_load_report_goes_with_the_renewals_and_the_release_removes_it() {
    let fake = FakeStore::new();
    let meter = crate::LoadMeter::new();
    let held = reporting_lock(&fake, &meter).acquire().await;
    // Nothing measured yet: nothing reported.
    assert_eq!(load_annotation(&fake), None);
    meter.set_objects(5);
    meter.set_queue_depth(1);
    // Only the renewal writes it: no request of its own.
    settle().await;
    assert_eq!((fake.writes(), load_annotation(&fake)), (1, None));
    tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
    settle().await;
    assert_eq!(fake.writes(), 2);
    assert_eq!(load_annotation(&fake).as_deref(), Some("objects=5,queue=1"));
    meter.set_queue_depth(0);
    tokio::time::sleep(RETRY).await;
    settle().await;
    assert_eq!(fake.writes(), 3);
    assert_eq!(load_annotation(&fake).as_deref(), Some("objects=5,queue=0"));
    assert!(held.release().await.expect("release"));
    assert_eq!(load_annotation(&fake), None);
    // Acquiring again reports at once: the write is sent anyway.
    let again = reporting_lock(&fake, &meter).acquire().await;
    assert_eq!(load_annotation(&fake).as_deref(), Some("objects=5,queue=0"));
    drop(again);
}

#[tokio::test(start_paused = true)]
async fn a_refused_load_report_never_costs_the_lease() {
    let fake = FakeStore::new();
    let meter = crate::LoadMeter::new();
    meter.set_objects(5);
    let held = reporting_lock(&fake, &meter).acquire().await;
    assert_eq!(load_annotation(&fake).as_deref(), Some("objects=5"));
    let renewed = |fake: &FakeStore| spec(fake).renew_time;
    let before = renewed(&fake);
    // An admission policy now refuses any change of the report.
    fake.refuse_annotation(Some(kube_sharding_api::load::ANNOTATION_LOAD));
    meter.set_objects(6);
    tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
    settle().await;
    // Renewed, with the report as it was; and no report is tried again.
    assert!(!held.is_lost());
    assert!(renewed(&fake) > before);
    assert_eq!(load_annotation(&fake).as_deref(), Some("objects=5"));
    let writes = fake.writes();
    meter.set_objects(7);
    for _ in 0..10 {
        tokio::time::sleep(RETRY).await;
        settle().await;
    }
    assert!(!held.is_lost());
    assert_eq!(fake.writes(), writes + 10, "one write per renewal");
    assert_eq!(load_annotation(&fake).as_deref(), Some("objects=5"));
    // The release leaves the refused annotation alone, too.
    assert!(held.release().await.expect("release"));
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
}

#[tokio::test(start_paused = true)]
async fn a_release_is_marked_in_the_same_write_and_acquiring_removes_the_mark() {
    const MARK: &str = "released-by";
    let marked = |fake: &FakeStore, identity: &str| {
        let config = LeaseLockConfig::new("ns", "shard-a", identity)
            .with_release_mark(MARK)
            .with_lease_duration(DURATION)
            .with_renew_deadline(DEADLINE)
            .with_retry_period(RETRY);
        LeaseLock::with_store(Store::Fake(fake.clone()), config, test_clock()).expect("valid")
    };
    let annotation = |fake: &FakeStore| {
        fake.lease()
            .and_then(|l| l.metadata.annotations)
            .and_then(|a| a.get(MARK).cloned())
    };
    let fake = FakeStore::new();
    let held = marked(&fake, "shard-a").acquire().await;
    assert_eq!(annotation(&fake), None);
    assert!(held.release().await.expect("release"));
    // One write: the holder emptied and the mark naming who gave it up.
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
    assert_eq!(annotation(&fake).as_deref(), Some("shard-a"));
    // Taking it again removes the mark, so a later emptying by anyone else is not a release.
    let again = marked(&fake, "shard-a").acquire().await;
    assert_eq!(annotation(&fake), None);
    drop(again);
}

#[tokio::test(start_paused = true)]
async fn dropping_stops_renewal_without_releasing() {
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    drop(held);
    tokio::time::sleep(RETRY * 5).await;
    settle().await;
    assert_eq!(fake.writes(), 1);
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some("shard-a"));
}

/// Work that counts its "reconciles", one per second, and records when it stopped.
async fn counting_work(
    reconciles: Arc<std::sync::atomic::AtomicUsize>,
    stop: CancellationToken,
    finish_after_stop: Duration,
) {
    use std::sync::atomic::Ordering;
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(Duration::from_secs(1)) => {
                reconciles.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    // A graceful stop takes a while (e.g. finishing reconciles in flight).
    tokio::time::sleep(finish_after_stop).await;
    reconciles.fetch_add(1_000, Ordering::SeqCst);
}

#[tokio::test(start_paused = true)]
async fn run_while_held_drops_the_work_at_once_on_loss() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    let reconciles = Arc::new(AtomicUsize::new(0));
    let shutdown = CancellationToken::new();
    let counter = reconciles.clone();
    let run = tokio::spawn(async move {
        held.run_while_held(&shutdown, |stop| {
            counting_work(counter, stop, Duration::from_secs(5))
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    settle().await;
    assert_eq!(reconciles.load(Ordering::SeqCst), 3);
    // Taken over: the next renewal (at 4 s) notices.
    fake.modify(|lease| {
        lease.spec.get_or_insert_default().holder_identity = Some("other".into());
    });
    let ended = tokio::time::timeout(RETRY, run)
        .await
        .expect("ends at the next renewal")
        .expect("task ok")
        .expect("no error");
    assert_eq!(ended, HeldRunEnd::LeaseLost);
    let at_loss = reconciles.load(Ordering::SeqCst);
    assert!(at_loss < 1_000, "no graceful finish after a loss");
    tokio::time::sleep(Duration::from_secs(30)).await;
    settle().await;
    assert_eq!(
        reconciles.load(Ordering::SeqCst),
        at_loss,
        "nothing runs on"
    );
    assert_eq!(
        spec(&fake).holder_identity.as_deref(),
        Some("other"),
        "nothing released"
    );
}

#[tokio::test(start_paused = true)]
async fn run_while_held_stops_the_work_then_releases_on_shutdown() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    let reconciles = Arc::new(AtomicUsize::new(0));
    let shutdown = CancellationToken::new();
    let (counter, token) = (reconciles.clone(), shutdown.clone());
    let run = tokio::spawn(async move {
        held.run_while_held(&token, |stop| {
            counting_work(counter, stop, Duration::from_secs(3))
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    shutdown.cancel();
    // Still finishing gracefully: the Lease is held until the work has ended.
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some("shard-a"));
    let ended = run.await.expect("task ok").expect("no error");
    assert_eq!(ended, HeldRunEnd::WorkEnded { released: true });
    assert_eq!(
        reconciles.load(Ordering::SeqCst),
        1_002,
        "finished gracefully"
    );
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
}

#[tokio::test(start_paused = true)]
async fn run_while_held_drops_work_that_ignores_shutdown_after_the_renew_deadline() {
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    let started = Instant::now();
    // Work that never stops by itself, like a controller waiting for caches that never sync.
    let ended = held
        .run_while_held(&shutdown, |_stop| std::future::pending::<()>())
        .await
        .expect("no error");
    assert_eq!(ended, HeldRunEnd::WorkEnded { released: true });
    assert_eq!(started.elapsed(), DEADLINE);
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
}

#[tokio::test(start_paused = true)]
async fn run_while_held_releases_when_the_work_ends_on_its_own() {
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    let ended = held
        .run_while_held(&CancellationToken::new(), |_stop| {
            tokio::time::sleep(Duration::from_secs(7))
        })
        .await
        .expect("no error");
    assert_eq!(ended, HeldRunEnd::WorkEnded { released: true });
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
}

/// JSON log records captured from the current thread, each with whether `token` (once set)
/// had fired when the record was written.
#[derive(Clone, Default)]
struct CapturedLog {
    records: Arc<std::sync::Mutex<Vec<(serde_json::Value, bool)>>>,
    token: Arc<std::sync::OnceLock<CancellationToken>>,
}

impl std::io::Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let fired = self
            .token
            .get()
            .is_some_and(CancellationToken::is_cancelled);
        let text = String::from_utf8_lossy(buf);
        let mut records = self.records.lock().expect("lock");
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            records.push((serde_json::from_str(line).expect("JSON record"), fired));
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CapturedLog {
    /// Installs a JSON subscriber like checksum-controller's for the current thread (the
    /// paused runtime runs the renewer here too).
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        let writer = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    /// The records with `event` set to `event`.
    fn events(&self, event: &str) -> Vec<(serde_json::Value, bool)> {
        self.records
            .lock()
            .expect("lock")
            .iter()
            .filter(|(record, _)| record["event"] == event)
            .cloned()
            .collect()
    }
}

#[tokio::test(start_paused = true)]
async fn lease_records_carry_their_event_and_resource_version() {
    let log = CapturedLog::default();
    let _guard = log.install();
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    log.token.set(held.lost_token()).expect("set once");
    let acquired = log.events("lease_acquired");
    assert_eq!(acquired.len(), 1);
    assert_eq!(acquired[0].0["resource_version"], "1", "as created");
    assert_eq!(acquired[0].0["transitions"], 0);
    assert_eq!(acquired[0].0["lease"], "shard-a");

    // Renewed once (version 2), then taken over (version 3).
    tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
    settle().await;
    fake.modify(|lease| {
        lease.spec.get_or_insert_default().holder_identity = Some("other".into());
    });
    tokio::time::sleep(RETRY).await;
    settle().await;
    assert!(held.is_lost());
    let lost = log.events("lease_lost");
    assert_eq!(lost.len(), 1);
    let (record, fired) = &lost[0];
    assert_eq!(
        record["resource_version"], "2",
        "as this lock last wrote it"
    );
    assert_eq!(record["holder"], "other");
    assert!(fired, "the token fired before the loss was recorded");
    assert!(!held.release().await.expect("release"));
    assert!(log.events("lease_released").is_empty(), "nothing released");

    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    assert!(held.release().await.expect("release"));
    let released = log.events("lease_released");
    assert_eq!(released.len(), 1);
    assert_eq!(
        released[0].0["resource_version"], "2",
        "the releasing write"
    );
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
}

#[tokio::test(start_paused = true)]
async fn missed_deadline_is_recorded_after_the_token_fired() {
    let log = CapturedLog::default();
    let _guard = log.install();
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    log.token.set(held.lost_token()).expect("set once");
    fake.set_mode(Mode::Fail);
    tokio::time::sleep(DEADLINE + Duration::from_millis(1)).await;
    settle().await;
    assert!(held.is_lost());
    let lost = log.events("lease_lost");
    assert_eq!(lost.len(), 1);
    let (record, fired) = &lost[0];
    assert_eq!(record["resource_version"], "1", "never renewed");
    assert!(fired, "the token fired before the loss was recorded");
}

#[tokio::test(start_paused = true)]
async fn deleted_lease_is_lost() {
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    fake.delete();
    tokio::time::sleep(RETRY + Duration::from_millis(1)).await;
    settle().await;
    assert!(held.is_lost());
}

#[tokio::test(start_paused = true)]
async fn exclusion_seen_at_a_renewal_drops_the_work_and_releases() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    let guard = held.guard();
    let reconciles = Arc::new(AtomicUsize::new(0));
    let counter = reconciles.clone();
    let run = tokio::spawn(async move {
        held.run(
            &CancellationToken::new(),
            |stop| counting_work(counter, stop, Duration::from_secs(5)),
            || std::future::ready(false),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    // The sharder's write conflicts with the next renewal, whose fresh read shows it.
    exclude(&fake, "DuplicateName");
    let ended = tokio::time::timeout(RETRY, run)
        .await
        .expect("ends at the next renewal")
        .expect("task ok")
        .expect("no error");
    assert_eq!(
        ended,
        RunEnd::Excluded {
            reason: "DuplicateName".into(),
            released: true
        }
    );
    assert_eq!(
        guard.check(),
        Err(GuardEnd::Excluded("DuplicateName".into()))
    );
    assert!(
        reconciles.load(Ordering::SeqCst) < 1_000,
        "dropped, not stopped gracefully"
    );
    let lease = fake.lease().expect("lease");
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""), "released");
    assert_eq!(
        lease
            .metadata
            .annotations
            .and_then(|a| a.get(EXCLUDED).cloned())
            .as_deref(),
        Some("DuplicateName"),
        "the sharder's annotation is kept"
    );
}

#[tokio::test(start_paused = true)]
async fn an_excluded_lease_is_not_taken_and_one_still_held_is_given_up() {
    let fake = FakeStore::new();
    // A previous run of this shard held the Lease when the sharder excluded it.
    let held = lock(&fake, "shard-a").acquire().await;
    drop(held);
    exclude(&fake, "DuplicateName");
    let lock = lock(&fake, "shard-a");
    assert!(lock.try_acquire().await.expect("no error").is_none());
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""), "given up");
    let writes = fake.writes();

    let waiting = tokio::spawn(async move { lock.acquire().await });
    tokio::time::sleep(RETRY * 5).await;
    settle().await;
    assert!(!waiting.is_finished(), "waits while excluded");
    assert_eq!(fake.writes(), writes, "only reads while excluded");

    // The sharder lifts the exclusion (the older copy is gone): the shard joins.
    fake.modify(|lease| {
        lease
            .metadata
            .annotations
            .get_or_insert_default()
            .remove(EXCLUDED);
    });
    let held = tokio::time::timeout(RETRY * 2, waiting)
        .await
        .expect("joins at the next attempt")
        .expect("task ok");
    assert!(held.guard().is_held());
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some("shard-a"));
}

#[tokio::test(start_paused = true)]
async fn a_lock_without_an_exclusion_annotation_ignores_it() {
    let fake = FakeStore::new();
    let config = LeaseLockConfig::new("ns", "leader", "replica-1")
        .with_lease_duration(DURATION)
        .with_renew_deadline(DEADLINE)
        .with_retry_period(RETRY);
    let lock =
        LeaseLock::with_store(Store::Fake(fake.clone()), config, test_clock()).expect("valid");
    let held = lock.acquire().await;
    exclude(&fake, "DuplicateName");
    tokio::time::sleep(RETRY * 3).await;
    settle().await;
    assert!(held.guard().is_held());
}

#[tokio::test(start_paused = true)]
async fn the_renewer_reports_a_deadline_a_guard_check_found_passed() {
    let fake = FakeStore::new();
    let held = lock(&fake, "shard-a").acquire().await;
    fake.set_mode(Mode::Hang);
    let guard = held.guard();
    // The renewer is not scheduled while the clock jumps (a suspended VM).
    tokio::time::advance(DEADLINE + Duration::from_secs(5)).await;
    assert!(!guard.token().is_cancelled());
    assert_eq!(guard.check(), Err(GuardEnd::LeaseLost));
    assert!(held.is_lost());
    let ended = held
        .run_while_held(&CancellationToken::new(), |_| std::future::pending::<()>())
        .await
        .expect("no error");
    assert_eq!(ended, HeldRunEnd::LeaseLost);
}
