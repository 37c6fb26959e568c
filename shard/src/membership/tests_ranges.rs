//! A zero-write ring's shard against the fake Lease store, on tokio's paused clock: ranges of
//! an earlier holding are dropped by the take, generations are applied in order and
//! acknowledged, and only after the reconciles of revoked ranges ended.

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube_sharding_api::labels::LABEL_STATE;
use kube_sharding_api::range_lease::{ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES};
use kube_sharding_api::ranges::{ShardField, fnv1a64};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::lease::LeaseLock;
use crate::lease::testing::{FakeStore, fake_lock};
use crate::shard::Disposition;

const LOWER: &str = "0000000000000000-8000000000000000";
const UPPER: &str = "8000000000000000-10000000000000000";

fn shard() -> crate::Shard {
    crate::Shard::new("r", "shard-a", "ns").server_side::<Secret>(ShardField::Uid)
}

fn lock(shard: &crate::Shard, fake: &FakeStore) -> LeaseLock {
    let config = shard
        .lease_config()
        .with_lease_duration(Duration::from_secs(15))
        .with_renew_deadline(Duration::from_secs(10))
        .with_retry_period(Duration::from_secs(2));
    fake_lock(fake, config).expect("valid")
}

async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

fn annotation(fake: &FakeStore, key: &str) -> Option<String> {
    fake.lease()
        .and_then(|l| l.metadata.annotations)
        .and_then(|a| a.get(key).cloned())
}

fn annotate(fake: &FakeStore, key: &str, value: &str) {
    fake.modify(|lease| {
        lease
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(key.into(), value.into());
    });
}

/// An object whose uid hashes into the lower half (`lower`) or the upper one.
fn object(lower: bool) -> ObjectMeta {
    let uid = (0..)
        .map(|i| format!("uid-{i}"))
        .find(|u| (fnv1a64(u) < 1 << 63) == lower)
        .expect("found");
    ObjectMeta {
        name: Some(uid.clone()),
        namespace: Some("ns".into()),
        uid: Some(uid),
        ..ObjectMeta::default()
    }
}

#[tokio::test(start_paused = true)]
async fn a_taken_lease_starts_without_ranges_and_acknowledges_each_newer_generation() {
    let shard = shard();
    let fake = FakeStore::new();
    // An earlier holding, with ranges and their acknowledgement, released.
    let held = lock(&shard, &fake).acquire().await;
    annotate(&fake, ANNOTATION_RANGES, &format!("4 {LOWER}"));
    annotate(&fake, ANNOTATION_ACKNOWLEDGED, "4");
    assert!(held.release().await.expect("released"));

    let shutdown = CancellationToken::new();
    let run = {
        let (shard, shutdown, lock) = (shard.clone(), shutdown.clone(), lock(&shard, &fake));
        tokio::spawn(async move {
            shard
                .run(&lock, &shutdown, |term: crate::Term| async move {
                    term.stop.cancelled().await;
                })
                .await
        })
    };
    settle().await;
    assert_eq!(
        annotation(&fake, ANNOTATION_RANGES),
        None,
        "the take dropped the old ranges"
    );
    assert_eq!(
        annotation(&fake, ANNOTATION_ACKNOWLEDGED),
        None,
        "and their acknowledgement"
    );
    let (lower, upper) = (object(true), object(false));
    assert_eq!(shard.classify(&lower), Disposition::Ignore, "no ranges yet");

    fake.modify(|lease| {
        lease
            .metadata
            .labels
            .get_or_insert_default()
            .insert(LABEL_STATE.into(), "ready".into());
    });
    annotate(&fake, ANNOTATION_RANGES, &format!("1 {LOWER}"));
    settle().await;
    assert_eq!(
        annotation(&fake, ANNOTATION_ACKNOWLEDGED).as_deref(),
        Some("1")
    );
    assert_eq!(shard.classify(&lower), Disposition::Reconcile);
    assert_eq!(shard.classify(&upper), Disposition::Ignore);

    // A reconcile of a lower object in flight: generation 2 (the upper half) cancels it, and
    // the acknowledgement waits until it has ended.
    let in_flight = shard.register_in_flight(&lower).expect("server-side");
    let cancelled = in_flight.token.clone();
    let reconcile = tokio::spawn(async move {
        cancelled.cancelled().await;
        // A reconcile that takes a while to unwind.
        tokio::time::sleep(Duration::from_millis(700)).await;
        drop(in_flight);
        Instant::now()
    });
    let begin = Instant::now();
    annotate(&fake, ANNOTATION_RANGES, &format!("2 {UPPER}"));
    settle().await;
    assert_eq!(
        shard.classify(&lower),
        Disposition::Ignore,
        "revoked at once"
    );
    assert_eq!(
        annotation(&fake, ANNOTATION_ACKNOWLEDGED).as_deref(),
        Some("1"),
        "not yet"
    );
    let ended = reconcile.await.expect("task");
    assert_eq!(ended, begin + Duration::from_millis(700));
    settle().await;
    assert_eq!(
        annotation(&fake, ANNOTATION_ACKNOWLEDGED).as_deref(),
        Some("2")
    );
    assert_eq!(shard.classify(&upper), Disposition::Reconcile);

    // An older generation showing up later is ignored.
    annotate(&fake, ANNOTATION_RANGES, &format!("1 {LOWER}"));
    settle().await;
    assert_eq!(shard.classify(&upper), Disposition::Reconcile);
    assert_eq!(shard.classify(&lower), Disposition::Ignore);
    assert_eq!(
        annotation(&fake, ANNOTATION_ACKNOWLEDGED).as_deref(),
        Some("2")
    );
    // Renewals keep both annotations.
    annotate(&fake, ANNOTATION_RANGES, &format!("3 {UPPER}"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    settle().await;
    assert_eq!(
        annotation(&fake, ANNOTATION_ACKNOWLEDGED).as_deref(),
        Some("3")
    );
    assert_eq!(
        annotation(&fake, ANNOTATION_RANGES).as_deref(),
        Some(format!("3 {UPPER}").as_str())
    );

    shutdown.cancel();
    let ended = run.await.expect("task ok").expect("no error");
    assert_eq!(ended, crate::ShardRunEnd::Stopped { released: true });
}
