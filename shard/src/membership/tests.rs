//! Tests of [`Shard::run`] against the fake Lease store, on tokio's paused clock: stepping out
//! and rejoining, waiting for the sharder's judgement, and keeping the Lease for a returning
//! StatefulSet pod.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::lease::testing::*;
use crate::lease::{Error, LeaseLock, LeaseLockConfig};
use crate::{OnShutdown, Shard, ShardRunEnd, StatefulSetPod, Term};

#[tokio::test(start_paused = true)]
async fn a_shard_steps_out_when_excluded_and_rejoins_after_the_pause() {
    let fake = FakeStore::new();
    let lock = lock(&fake, "shard-a");
    let shard = Shard::new("r", "shard-a", "ns").with_rejoin_pause(Duration::from_secs(30));
    let terms = Arc::new(std::sync::Mutex::new(Vec::new()));
    let shutdown = CancellationToken::new();
    let run = {
        let (terms, shutdown) = (Arc::clone(&terms), shutdown.clone());
        tokio::spawn(async move {
            shard
                .run(&lock, &shutdown, |term: Term| {
                    terms
                        .lock()
                        .expect("lock")
                        .push((term.number, Instant::now()));
                    async move { term.stop.cancelled().await }
                })
                .await
        })
    };
    // The Lease was created: the work starts after the first renewal, at 2 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(terms.lock().expect("lock").len(), 1);
    exclude(&fake, "DuplicateName");
    let excluded_at = Instant::now();
    // Stepped out at the next renewal; the annotation stays for a while, then goes.
    tokio::time::sleep(RETRY * 2).await;
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
    tokio::time::sleep(Duration::from_secs(40)).await;
    assert_eq!(
        terms.lock().expect("lock").len(),
        1,
        "no term while excluded"
    );
    fake.modify(|lease| {
        lease
            .metadata
            .annotations
            .get_or_insert_default()
            .remove(EXCLUDED);
    });
    tokio::time::sleep(RETRY * 2).await;
    settle().await;
    let started: Vec<_> = terms.lock().expect("lock").clone();
    assert_eq!(started.len(), 2, "rejoined");
    assert_eq!(started[1].0, 2);
    assert!(
        started[1].1 >= excluded_at + Duration::from_secs(30),
        "after the pause"
    );
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some("shard-a"));
    shutdown.cancel();
    let ended = run.await.expect("task ok").expect("no error");
    assert_eq!(ended, ShardRunEnd::Stopped { released: true });
}

/// When the work of a shard run began, if it did.
type Started = Arc<std::sync::Mutex<Option<Instant>>>;

/// Runs `shard` on `lock` in a task until `shutdown`; its work records when it started.
fn spawn_shard_run(
    shard: &Shard,
    lock: LeaseLock,
    shutdown: &CancellationToken,
) -> (Started, tokio::task::JoinHandle<Result<ShardRunEnd, Error>>) {
    let started: Started = Arc::default();
    let run = {
        let (shard, started, shutdown) = (shard.clone(), Arc::clone(&started), shutdown.clone());
        tokio::spawn(async move {
            shard
                .run(&lock, &shutdown, |term: Term| {
                    let started = Arc::clone(&started);
                    async move {
                        *started.lock().expect("lock") = Some(Instant::now());
                        term.stop.cancelled().await;
                    }
                })
                .await
        })
    };
    (started, run)
}

#[tokio::test(start_paused = true)]
async fn work_on_a_created_lease_starts_when_the_sharder_labels_it() {
    use kube_sharding_api::labels::LABEL_STATE;
    let shard = Shard::new("r", "shard-a", "ns");
    let judged_after = Duration::from_millis(300);
    for excluded in [false, true] {
        let fake = FakeStore::new();
        let shutdown = CancellationToken::new();
        let begin = Instant::now();
        let (started, run) = spawn_shard_run(&shard, lock(&fake, "shard-a"), &shutdown);
        tokio::time::sleep(judged_after).await;
        assert_eq!(
            *started.lock().expect("lock"),
            None,
            "not before the judgement"
        );
        // The sharder writes its state label, and the exclusion with it when it excludes.
        fake.modify(|lease| {
            lease
                .metadata
                .labels
                .get_or_insert_default()
                .insert(LABEL_STATE.into(), "ready".into());
            if excluded {
                lease
                    .metadata
                    .annotations
                    .get_or_insert_default()
                    .insert(EXCLUDED.into(), "DuplicateName".into());
            }
        });
        settle().await;
        let at = *started.lock().expect("lock");
        if excluded {
            assert_eq!(at, None, "an excluded Lease does not start the work");
            tokio::time::sleep(RETRY + Duration::from_millis(100)).await;
            settle().await;
            assert_eq!(*started.lock().expect("lock"), None, "nor does its renewal");
        } else {
            assert_eq!(at, Some(begin + judged_after), "started on the state label");
        }
        shutdown.cancel();
        let ended = run.await.expect("task ok").expect("no error");
        assert!(matches!(ended, ShardRunEnd::Stopped { .. }), "{ended:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn work_on_a_created_lease_no_sharder_labels_starts_after_the_fallback() {
    let fallback = Duration::from_secs(60);
    let shard = Shard::new("r", "shard-a", "ns").with_judgement_fallback(fallback);
    for excluded_at_once in [false, true] {
        let fake = FakeStore::new();
        let shutdown = CancellationToken::new();
        let begin = Instant::now();
        let (started, run) = spawn_shard_run(&shard, lock(&fake, "shard-a"), &shutdown);
        settle().await;
        assert!(fake.lease().is_some(), "created");
        if excluded_at_once {
            // The sharder judges the new Lease a duplicate before the first renewal.
            exclude(&fake, "DuplicateName");
        }
        tokio::time::sleep(RETRY + Duration::from_millis(100)).await;
        settle().await;
        // Renewed, but the sharder may still be moving objects off this shard: no start yet.
        assert_eq!(
            *started.lock().expect("lock"),
            None,
            "not at the first renewal"
        );
        tokio::time::sleep(fallback).await;
        settle().await;
        let at = *started.lock().expect("lock");
        if excluded_at_once {
            assert_eq!(at, None, "never worked on another copy's objects");
            assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
        } else {
            assert_eq!(
                at,
                Some(begin + fallback),
                "started once the fallback passed"
            );
        }
        shutdown.cancel();
        let ended = run.await.expect("task ok").expect("no error");
        assert!(matches!(ended, ShardRunEnd::Stopped { .. }), "{ended:?}");
    }
}

/// [`lock`] with the sharder's state label as its verdict label, as [`Shard::lease_config`]
/// has it.
fn judged_lock(fake: &FakeStore) -> LeaseLock {
    let config = LeaseLockConfig::new("ns", "shard-a", "shard-a")
        .with_exclusion_annotation(EXCLUDED)
        .with_verdict_label(kube_sharding_api::labels::LABEL_STATE)
        .with_lease_duration(DURATION)
        .with_renew_deadline(DEADLINE)
        .with_retry_period(RETRY);
    fake_lock(fake, config).expect("valid")
}

/// The sharder's state label on the fake's Lease.
fn state_label(fake: &FakeStore) -> Option<String> {
    fake.lease()
        .and_then(|l| l.metadata.labels)
        .and_then(|l| l.get(kube_sharding_api::labels::LABEL_STATE).cloned())
}

fn set_state_label(fake: &FakeStore, state: &str) {
    fake.modify(|lease| {
        lease
            .metadata
            .labels
            .get_or_insert_default()
            .insert(kube_sharding_api::labels::LABEL_STATE.into(), state.into());
    });
}

#[tokio::test(start_paused = true)]
async fn work_on_a_taken_over_lease_starts_on_a_ready_written_after_the_take() {
    let shard = Shard::new("r", "shard-a", "ns");
    let fake = FakeStore::new();
    // An earlier term: held, judged ready, released on shutdown. The sharder has not relabelled
    // it yet, so `ready` is still on it, about the holding that ended.
    let held = judged_lock(&fake).acquire().await;
    assert!(held.unjudged(), "a created Lease is unjudged");
    set_state_label(&fake, "ready");
    assert!(held.release().await.expect("released"));
    assert_eq!(state_label(&fake).as_deref(), Some("ready"));

    let shutdown = CancellationToken::new();
    let begin = Instant::now();
    let (started, run) = spawn_shard_run(&shard, judged_lock(&fake), &shutdown);
    settle().await;
    assert_eq!(
        spec(&fake).holder_identity.as_deref(),
        Some("shard-a"),
        "taken"
    );
    assert_eq!(state_label(&fake), None, "the take removed the old verdict");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(*started.lock().expect("lock"), None, "not before a verdict");
    // A verdict other than `ready` (the sharder still moving objects off the shard would write
    // nothing; a stale one would be refused by its resourceVersion) does not start it either.
    set_state_label(&fake, "dead");
    settle().await;
    assert_eq!(*started.lock().expect("lock"), None, "not on `dead`");
    tokio::time::sleep(Duration::from_millis(200)).await;
    set_state_label(&fake, "ready");
    settle().await;
    assert_eq!(
        *started.lock().expect("lock"),
        Some(begin + Duration::from_millis(500)),
        "started on `ready`"
    );
    shutdown.cancel();
    let ended = run.await.expect("task ok").expect("no error");
    assert_eq!(ended, ShardRunEnd::Stopped { released: true });
}

/// The sharder holds `ready` back while it still moves objects off the shard (docs/protocol.md
/// §22): a shard that takes its Lease back waits for it however long the moves take, once the
/// sharder has shown itself by labelling the Lease, and never starts at its first renewal.
#[tokio::test(start_paused = true)]
async fn work_on_a_taken_lease_waits_for_ready_past_renewals_and_the_fallback() {
    let fallback = Duration::from_secs(60);
    let shard = Shard::new("r", "shard-a", "ns").with_judgement_fallback(fallback);
    let fake = FakeStore::new();
    let held = judged_lock(&fake).acquire().await;
    set_state_label(&fake, "ready");
    assert!(held.release().await.expect("released"));

    let shutdown = CancellationToken::new();
    let begin = Instant::now();
    let (started, run) = spawn_shard_run(&shard, judged_lock(&fake), &shutdown);
    settle().await;
    assert_eq!(state_label(&fake), None, "the take removed the old verdict");
    // Renewals go on while the sharder's moves are in flight: no start.
    tokio::time::sleep(RETRY * 3).await;
    settle().await;
    assert_eq!(*started.lock().expect("lock"), None, "not at a renewal");
    // The sharder labels the Lease (here `expired`, a late renewal seen): it runs, so its
    // `ready` is waited for past the fallback.
    set_state_label(&fake, "expired");
    tokio::time::sleep(fallback * 2).await;
    settle().await;
    assert_eq!(
        *started.lock().expect("lock"),
        None,
        "not while a sharder withholds ready"
    );
    set_state_label(&fake, "ready");
    settle().await;
    assert_eq!(
        *started.lock().expect("lock"),
        Some(begin + RETRY * 3 + fallback * 2),
        "started on `ready`"
    );
    shutdown.cancel();
    let ended = run.await.expect("task ok").expect("no error");
    assert_eq!(ended, ShardRunEnd::Stopped { released: true });
}

#[tokio::test(start_paused = true)]
async fn work_on_a_lease_still_held_starts_at_once() {
    let shard = Shard::new("r", "shard-a", "ns");
    let fake = FakeStore::new();
    let held = judged_lock(&fake).acquire().await;
    set_state_label(&fake, "ready");
    // The process ends without releasing (a crash) and comes back within the Lease duration: to
    // the sharder the shard never left, so there is nothing to wait for.
    drop(held);
    tokio::time::sleep(RETRY).await;
    let shutdown = CancellationToken::new();
    let begin = Instant::now();
    let (started, run) = spawn_shard_run(&shard, judged_lock(&fake), &shutdown);
    settle().await;
    assert_eq!(
        state_label(&fake).as_deref(),
        Some("ready"),
        "renewal keeps it"
    );
    assert_eq!(
        *started.lock().expect("lock"),
        Some(begin),
        "started at once"
    );
    shutdown.cancel();
    let ended = run.await.expect("task ok").expect("no error");
    assert_eq!(ended, ShardRunEnd::Stopped { released: true });
}

/// A StatefulSet of `replicas` pods, as a shard's shutdown check reads it.
fn statefulset(replicas: i32) -> k8s_openapi::api::apps::v1::StatefulSet {
    k8s_openapi::api::apps::v1::StatefulSet {
        spec: Some(k8s_openapi::api::apps::v1::StatefulSetSpec {
            replicas: Some(replicas),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test(start_paused = true)]
async fn a_statefulset_shard_keeps_its_lease_for_the_returning_pod_and_releases_on_scale_in() {
    let shard = Shard::new("r", "web-1", "ns")
        .with_on_shutdown(OnShutdown::KeepIfReturning(StatefulSetPod::new("ns")));
    let fake = FakeStore::new();
    let shard_lock = || {
        let config = shard
            .lease_config()
            .with_lease_duration(DURATION)
            .with_renew_deadline(DEADLINE)
            .with_retry_period(RETRY);
        fake_lock(&fake, config).expect("valid")
    };
    fake.set_statefulset(Some(statefulset(3)));

    // First start: a new Lease, judged by the sharder.
    let shutdown = CancellationToken::new();
    let (started, run) = spawn_shard_run(&shard, shard_lock(), &shutdown);
    settle().await;
    set_state_label(&fake, "ready");
    settle().await;
    assert!(started.lock().expect("lock").is_some(), "judged, started");
    tokio::time::sleep(RETRY * 2).await;

    // A rollout: ordinal 1 of 3 comes back. Nothing is written, and nothing renews any more.
    shutdown.cancel();
    let ended = run.await.expect("task ok").expect("no error");
    assert_eq!(ended, ShardRunEnd::Kept);
    let writes = fake.writes();
    let kept = fake.lease().expect("lease");
    assert_eq!(holder_of(&kept), "web-1", "still held");
    let annotations = kept.metadata.annotations.clone().unwrap_or_default();
    assert!(
        !annotations.contains_key(kube_sharding_api::labels::ANNOTATION_RELEASED_BY),
        "no release mark"
    );
    tokio::time::sleep(RETRY * 3).await;
    settle().await;
    assert_eq!(fake.writes(), writes, "no renewal after the stop");

    // The pod returns within the Lease duration: a renewal, no wait for the sharder.
    let shutdown = CancellationToken::new();
    let begin = Instant::now();
    let (started, run) = spawn_shard_run(&shard, shard_lock(), &shutdown);
    settle().await;
    assert_eq!(
        *started.lock().expect("lock"),
        Some(begin),
        "started at once"
    );
    assert_eq!(state_label(&fake).as_deref(), Some("ready"), "same holding");
    assert_eq!(
        spec(&fake).lease_transitions,
        kept.spec.and_then(|s| s.lease_transitions)
    );

    // Scale-in to 1: ordinal 1 does not come back, the Lease is released as usual.
    fake.set_statefulset(Some(statefulset(1)));
    shutdown.cancel();
    let ended = run.await.expect("task ok").expect("no error");
    assert_eq!(ended, ShardRunEnd::Stopped { released: true });
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
}

#[tokio::test(start_paused = true)]
async fn a_statefulset_shard_releases_when_its_statefulset_cannot_be_read_or_it_stops_by_itself() {
    let shard = Shard::new("r", "web-0", "ns")
        .with_on_shutdown(OnShutdown::KeepIfReturning(StatefulSetPod::new("ns")));
    let fake = FakeStore::new();
    let config = shard
        .lease_config()
        .with_lease_duration(DURATION)
        .with_renew_deadline(DEADLINE)
        .with_retry_period(RETRY);
    let shard_lock = || fake_lock(&fake, config.clone());
    // No StatefulSet to read (deleted, or a read that failed): release.
    let shutdown = CancellationToken::new();
    let (_, run) = spawn_shard_run(&shard, shard_lock().expect("valid"), &shutdown);
    settle().await;
    shutdown.cancel();
    let ended = run.await.expect("task ok").expect("no error");
    assert_eq!(ended, ShardRunEnd::Stopped { released: true });
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));

    // Work that ends without a shutdown says nothing about a pod coming back: release.
    fake.set_statefulset(Some(statefulset(3)));
    let ended = shard
        .run(
            &shard_lock().expect("valid"),
            &CancellationToken::new(),
            |_| std::future::ready(()),
        )
        .await
        .expect("no error");
    assert_eq!(ended, ShardRunEnd::Stopped { released: true });
    assert_eq!(spec(&fake).holder_identity.as_deref(), Some(""));
}

fn holder_of(lease: &k8s_openapi::api::coordination::v1::Lease) -> &str {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or_default()
}
