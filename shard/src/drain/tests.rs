use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use k8s_openapi::api::core::v1::Secret;
use kube::api::ObjectMeta;
use kube::runtime::predicates;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::lease::guard_exclude;
use crate::ownership::OwnershipError;

const RING: &str = "example";
const SHARD_KEY: &str = "shard.alpha.sharding.timebertt.dev/clusterring-50d858e0-example";
const DRAIN_KEY: &str = "drain.alpha.sharding.timebertt.dev/clusterring-50d858e0-example";

fn secret(labels: &[(&str, &str)]) -> Arc<Secret> {
    Arc::new(Secret {
        metadata: ObjectMeta {
            name: Some("foo".into()),
            namespace: Some("default".into()),
            resource_version: Some("42".into()),
            uid: Some("uid-1".into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        ..Secret::default()
    })
}

#[derive(Debug, thiserror::Error)]
#[error("inner failed")]
struct InnerError;

/// What a wrapped reconcile did.
#[derive(Debug, Default)]
struct Probe {
    /// Calls of the inner reconciler (the closure itself).
    calls: AtomicUsize,
    /// Polls of the futures the inner reconciler returned: its body starting.
    started: AtomicUsize,
    /// Acknowledgement patches sent.
    patches: Mutex<Vec<serde_json::Value>>,
}

impl Probe {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }

    fn patches(&self) -> Vec<serde_json::Value> {
        self.patches.lock().expect("lock").clone()
    }
}

/// A fetch that answers with `object`'s metadata as it is now, counting reads.
fn fetch_of(object: Option<Arc<Secret>>, reads: Arc<AtomicUsize>) -> Fetch {
    Arc::new(move || {
        reads.fetch_add(1, Ordering::SeqCst);
        let meta = object.as_ref().map(|o| o.metadata.clone());
        async move { Ok(meta) }.boxed()
    })
}

/// Calls `dispatch` for `object` as the controller would and returns the future, unpolled,
/// with what it did so far.
fn start(
    object: Arc<Secret>,
    ack_result: Result<(), u16>,
    lost: &CancellationToken,
) -> (
    BoxFuture<'static, Result<Action, ReconcileError<InnerError>>>,
    Arc<Probe>,
) {
    start_guarded(object, ack_result, &LeaseGuard::from_token(lost.clone()))
}

/// [`start`] with any guard.
fn start_guarded(
    object: Arc<Secret>,
    ack_result: Result<(), u16>,
    guard: &LeaseGuard,
) -> (
    BoxFuture<'static, Result<Action, ReconcileError<InnerError>>>,
    Arc<Probe>,
) {
    let shard = Shard::new(RING, "shard-a", "default");
    let probe = Arc::new(Probe::default());
    let mut inner = {
        let probe = Arc::clone(&probe);
        move |_: Arc<Secret>, _: Arc<()>, _: Ownership| {
            probe.calls.fetch_add(1, Ordering::SeqCst);
            let probe = Arc::clone(&probe);
            async move {
                probe.started.fetch_add(1, Ordering::SeqCst);
                Ok::<_, InnerError>(Action::requeue(std::time::Duration::from_secs(7)))
            }
        }
    };
    let recorded = Arc::clone(&probe);
    let fetch = fetch_of(Some(Arc::clone(&object)), Arc::new(AtomicUsize::new(0)));
    let future = dispatch(
        &shard,
        guard,
        object,
        Arc::new(()),
        &mut inner,
        fetch,
        move |_, patch| {
            recorded.patches.lock().expect("lock").push(patch);
            async move {
                ack_result.map_err(|code| {
                    kube::Error::Api(
                        kube::core::Status::failure("conflict", "Conflict")
                            .with_code(code)
                            .boxed(),
                    )
                })
            }
        },
    );
    (future, probe)
}

/// Runs `dispatch` for `object` with a Lease that is held; returns the result, how often the
/// inner reconciler ran, and the acknowledgement patches sent.
async fn run(
    object: Arc<Secret>,
    ack_result: Result<(), u16>,
) -> (
    Result<Action, ReconcileError<InnerError>>,
    usize,
    Vec<serde_json::Value>,
) {
    let (future, probe) = start(object, ack_result, &CancellationToken::new());
    let result = future.await;
    assert_eq!(probe.calls(), probe.started(), "every call is polled");
    (result, probe.started(), probe.patches())
}

#[test]
fn classification() {
    let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let cases = [
        (labels(&[(SHARD_KEY, "shard-a")]), Disposition::Reconcile),
        (
            labels(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]),
            Disposition::Drain,
        ),
        // Only presence counts.
        (
            labels(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "")]),
            Disposition::Drain,
        ),
        (labels(&[(SHARD_KEY, "shard-b")]), Disposition::Ignore),
        (
            labels(&[(SHARD_KEY, "shard-b"), (DRAIN_KEY, "true")]),
            Disposition::Ignore,
        ),
        (labels(&[(DRAIN_KEY, "true")]), Disposition::Ignore),
        (labels(&[]), Disposition::Ignore),
        // Another ring's label is not ours.
        (
            labels(&[(
                "shard.alpha.sharding.timebertt.dev/clusterring-0000-other",
                "shard-a",
            )]),
            Disposition::Ignore,
        ),
    ];
    let shard = Shard::new(RING, "shard-a", "default");
    let meta = |labels: Option<BTreeMap<String, String>>| ObjectMeta {
        labels,
        ..ObjectMeta::default()
    };
    for (labels, want) in cases {
        assert_eq!(
            shard.classify(&meta(Some(labels.clone()))),
            want,
            "{labels:?}"
        );
    }
    assert_eq!(shard.classify(&meta(None)), Disposition::Ignore);
}

#[test]
fn drain_patch_is_exact() {
    let patch = Shard::new(RING, "shard-a", "default").drain_patch("1234");
    let expected = format!(
        r#"{{"metadata":{{"labels":{{"{DRAIN_KEY}":null,"{SHARD_KEY}":null}},"resourceVersion":"1234"}}}}"#
    );
    assert_eq!(serde_json::to_string(&patch).expect("serializes"), expected);
}

#[tokio::test]
async fn assigned_object_is_reconciled() {
    let (result, calls, patches) = run(secret(&[(SHARD_KEY, "shard-a")]), Ok(())).await;
    assert_eq!(
        result.expect("ok"),
        Action::requeue(std::time::Duration::from_secs(7))
    );
    assert_eq!(calls, 1);
    assert!(patches.is_empty());
}

#[tokio::test]
async fn drained_object_is_acknowledged_and_not_reconciled() {
    let (result, calls, patches) = run(
        secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]),
        Ok(()),
    )
    .await;
    assert_eq!(result.expect("ok"), Action::await_change());
    assert_eq!(
        calls, 0,
        "inner reconciler must not run for a draining object"
    );
    assert_eq!(
        patches,
        vec![
            json!({"metadata": {"resourceVersion": "42", "labels": {SHARD_KEY: null, DRAIN_KEY: null}}})
        ]
    );
}

#[tokio::test]
async fn conflicting_acknowledgement_is_an_error_to_retry() {
    let (result, calls, _) = run(
        secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]),
        Err(409),
    )
    .await;
    let error = result.expect_err("conflict surfaces");
    assert!(error.is_conflict());
    assert!(error.inner().is_none());
    assert_eq!(
        error.to_string(),
        "failed to acknowledge the drain of default/foo"
    );
    assert_eq!(calls, 0);
}

#[tokio::test]
async fn other_shards_objects_are_ignored() {
    for labels in [vec![(SHARD_KEY, "shard-b")], vec![]] {
        let (result, calls, patches) = run(secret(&labels), Ok(())).await;
        assert_eq!(result.expect("ok"), Action::await_change());
        assert_eq!(calls, 0);
        assert!(patches.is_empty());
    }
}

#[tokio::test]
async fn drain_without_resource_version_is_refused() {
    let mut object = (*secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")])).clone();
    object.metadata.resource_version = None;
    let (result, calls, patches) = run(Arc::new(object), Ok(())).await;
    assert!(matches!(
        result,
        Err(ReconcileError::MissingResourceVersion { .. })
    ));
    assert_eq!(calls, 0);
    assert!(patches.is_empty(), "never a blind write");
}

/// Every object a shard may be handed: assigned, draining, someone else's.
fn every_kind_of_object() -> [Arc<Secret>; 3] {
    [
        secret(&[(SHARD_KEY, "shard-a")]),
        secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]),
        secret(&[(SHARD_KEY, "shard-b")]),
    ]
}

#[tokio::test]
async fn nothing_starts_once_the_lease_is_lost() {
    let lost = CancellationToken::new();
    lost.cancel();
    for object in every_kind_of_object() {
        let (future, probe) = start(Arc::clone(&object), Ok(()), &lost);
        let error = future.await.expect_err("the loss surfaces");
        assert!(error.is_lease_lost(), "{error:?}");
        assert_eq!(
            error.to_string(),
            "failed to work on default/foo: the shard Lease is lost"
        );
        assert_eq!(probe.calls(), 0, "inner reconciler not even called");
        assert_eq!(probe.started(), 0);
        assert!(probe.patches().is_empty(), "no drain acknowledged");
    }
}

#[tokio::test]
async fn loss_between_call_and_first_poll_starts_nothing() {
    // The controller calls the wrapper, then polls the future later (possibly on another
    // thread, after the Lease was lost meanwhile).
    for object in every_kind_of_object().into_iter().take(2) {
        let lost = CancellationToken::new();
        let (future, probe) = start(object, Ok(()), &lost);
        lost.cancel();
        let error = future.await.expect_err("the loss surfaces");
        assert!(error.is_lease_lost(), "{error:?}");
        assert_eq!(probe.started(), 0, "the reconcile's body never ran");
        assert!(probe.patches().is_empty(), "no drain acknowledged");
    }
}

#[tokio::test]
async fn wrapper_sends_no_request_once_the_lease_is_lost() {
    // A client whose every request is counted (and fails): the wrapper must not use it.
    let requests = Arc::new(AtomicUsize::new(0));
    let service = {
        let requests = Arc::clone(&requests);
        tower::service_fn(move |_: http::Request<kube::client::Body>| {
            requests.fetch_add(1, Ordering::SeqCst);
            async {
                Err::<http::Response<kube::client::Body>, _>(std::io::Error::other(
                    "no API server in this test",
                ))
            }
        })
    };
    let client = Client::new(service, "default");
    let calls = Arc::new(AtomicUsize::new(0));
    let inner = {
        let calls = Arc::clone(&calls);
        move |_: Arc<Secret>, _: Arc<()>, _: Ownership| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, InnerError>(Action::await_change()) }
        }
    };
    let lost = CancellationToken::new();
    let mut reconcile = Shard::new(RING, "shard-a", "default").reconciler(
        client,
        LeaseGuard::from_token(lost.clone()),
        inner,
    );

    // While the Lease is held the seam is real: a drain is sent to the API server.
    let drained = secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]);
    let error = reconcile(Arc::clone(&drained), Arc::new(()))
        .await
        .expect_err("the counting client fails every request");
    assert!(matches!(error, ReconcileError::Drain { .. }), "{error:?}");
    assert_eq!(requests.load(Ordering::SeqCst), 1);

    lost.cancel();
    for object in every_kind_of_object() {
        let error = reconcile(object, Arc::new(()))
            .await
            .expect_err("the loss surfaces");
        assert!(error.is_lease_lost(), "{error:?}");
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "inner reconciler never ran"
    );
    assert_eq!(
        requests.load(Ordering::SeqCst),
        1,
        "no request after the loss"
    );
}

#[test]
fn predicate_lets_every_drained_version_through() {
    let shard = Shard::new(RING, "shard-a", "default");
    // Labels do not change a Secret's (absent) generation: the plain predicate sees nothing.
    let predicate = shard.predicate(predicates::generation);
    let plain = secret(&[(SHARD_KEY, "shard-a")]);
    assert_eq!(predicate.hash_property(plain.as_ref()), None);
    let drained = secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")]);
    let first = predicate.hash_property(drained.as_ref());
    assert!(first.is_some());
    let mut newer = (*drained).clone();
    newer.metadata.resource_version = Some("43".into());
    let second = predicate.hash_property(&newer);
    assert!(second.is_some());
    assert_ne!(first, second);
}

/// A wrapped reconcile whose inner reconciler fails only by refusing to write.
type WriterFuture = BoxFuture<'static, Result<Action, ReconcileError<OwnershipError>>>;

/// Builds a wrapped reconcile of `object` whose inner reconciler confirms ownership (against
/// `current`, the object as a fresh read finds it), then waits for `proceed`; returns the
/// future, the number of reads, and whether the inner reconciler "wrote" (got past both).
fn start_writer(
    object: Arc<Secret>,
    current: Option<Arc<Secret>>,
    guard: &LeaseGuard,
    proceed: Arc<tokio::sync::Notify>,
) -> (WriterFuture, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let shard = Shard::new(RING, "shard-a", "default");
    let reads = Arc::new(AtomicUsize::new(0));
    let writes = Arc::new(AtomicUsize::new(0));
    let mut inner = {
        let writes = Arc::clone(&writes);
        move |_: Arc<Secret>, _: Arc<()>, ownership: Ownership| {
            let (writes, proceed) = (Arc::clone(&writes), Arc::clone(&proceed));
            async move {
                // The slow part of a reconcile, before its first write.
                proceed.notified().await;
                ownership.confirm().await?;
                ownership.confirm().await?;
                writes.fetch_add(1, Ordering::SeqCst);
                Ok(Action::await_change())
            }
        }
    };
    let future = dispatch(
        &shard,
        guard,
        object,
        Arc::new(()),
        &mut inner,
        fetch_of(current, Arc::clone(&reads)),
        |_, _| async { Ok(()) },
    );
    (future, reads, writes)
}

#[tokio::test]
async fn a_reconcile_in_flight_is_cancelled_when_the_lease_ends() {
    let lost = CancellationToken::new();
    let guard = LeaseGuard::from_token(lost.clone());
    let object = secret(&[(SHARD_KEY, "shard-a")]);
    let proceed = Arc::new(tokio::sync::Notify::new());
    let (future, reads, writes) = start_writer(
        Arc::clone(&object),
        Some(object),
        &guard,
        Arc::clone(&proceed),
    );
    let running = tokio::spawn(future);
    tokio::task::yield_now().await;
    assert!(
        !running.is_finished(),
        "the reconcile waits in its slow part"
    );
    lost.cancel();
    let result = tokio::time::timeout(std::time::Duration::from_secs(1), running)
        .await
        .expect("cancelled at once, without waiting for the reconcile")
        .expect("no panic");
    let error = result.expect_err("the loss surfaces");
    assert!(
        matches!(error, ReconcileError::LeaseLost { .. }),
        "{error:?}"
    );
    // Nothing left to wake: the reconcile future was dropped.
    proceed.notify_one();
    tokio::task::yield_now().await;
    assert_eq!(writes.load(Ordering::SeqCst), 0);
    assert_eq!(reads.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn a_passed_renew_deadline_cancels_a_reconcile_without_the_renewer() {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    // No renewer runs here at all: only the shared deadline can end the guard.
    let guard = LeaseGuard::with_deadline(deadline);
    let object = secret(&[(SHARD_KEY, "shard-a")]);
    let proceed = Arc::new(tokio::sync::Notify::new());
    let (future, _, writes) = start_writer(Arc::clone(&object), Some(object), &guard, proceed);
    let error = future.await.expect_err("ended at the deadline");
    assert!(error.is_lease_lost(), "{error:?}");
    assert_eq!(
        tokio::time::Instant::now(),
        deadline,
        "cancelled exactly then"
    );
    assert_eq!(writes.load(Ordering::SeqCst), 0);

    // And after a stall past the deadline, nothing starts (the token never fired before).
    let stalled =
        LeaseGuard::with_deadline(tokio::time::Instant::now() + std::time::Duration::from_secs(10));
    tokio::time::advance(std::time::Duration::from_secs(60)).await;
    for object in every_kind_of_object() {
        let (future, probe) = start_guarded(object, Ok(()), &stalled);
        assert!(future.await.expect_err("refused").is_lease_lost());
        assert_eq!(probe.calls(), 0);
        assert!(probe.patches().is_empty());
    }
}

#[tokio::test]
async fn confirm_reads_once_and_refuses_objects_that_left() {
    let ours = secret(&[(SHARD_KEY, "shard-a")]);
    let mut recreated = (*ours).clone();
    recreated.metadata.uid = Some("uid-2".into());
    // (case, the object as a fresh read finds it, what the refusal says)
    type Case<'a> = (&'a str, Option<Arc<Secret>>, Option<&'a str>);
    let cases: [Case; 5] = [
        ("still ours", Some(Arc::clone(&ours)), None),
        (
            "drained meanwhile",
            Some(secret(&[(SHARD_KEY, "shard-a"), (DRAIN_KEY, "true")])),
            Some("being drained"),
        ),
        (
            "moved meanwhile",
            Some(secret(&[(SHARD_KEY, "shard-b")])),
            Some("assigned to another shard"),
        ),
        ("deleted meanwhile", None, Some("deleted")),
        (
            "recreated meanwhile",
            Some(Arc::new(recreated)),
            Some("deleted"),
        ),
    ];
    for (case, current, refused) in cases {
        let guard = LeaseGuard::from_token(CancellationToken::new());
        let proceed = Arc::new(tokio::sync::Notify::new());
        proceed.notify_one();
        let (future, reads, writes) = start_writer(Arc::clone(&ours), current, &guard, proceed);
        let result = future.await;
        assert_eq!(
            reads.load(Ordering::SeqCst),
            1,
            "{case}: one read for two confirms"
        );
        match refused {
            None => {
                assert!(result.is_ok(), "{case}: {result:?}");
                assert_eq!(writes.load(Ordering::SeqCst), 1, "{case}");
            }
            Some(reason) => {
                let error = result.expect_err(case);
                let inner = error.inner().expect("the reconciler's error");
                assert!(inner.is_final(), "{case}");
                assert!(inner.to_string().contains(reason), "{case}: {inner}");
                assert_eq!(writes.load(Ordering::SeqCst), 0, "{case}: no write");
            }
        }
    }
}

#[tokio::test]
async fn nothing_is_acknowledged_once_excluded() {
    let guard = LeaseGuard::with_deadline(
        tokio::time::Instant::now() + std::time::Duration::from_secs(3600),
    );
    guard_exclude(&guard);
    for object in every_kind_of_object() {
        let (future, probe) = start_guarded(object, Ok(()), &guard);
        let error = future.await.expect_err("refused");
        assert!(
            matches!(&error, ReconcileError::Excluded { reason, .. } if reason == "DuplicateName"),
            "{error:?}"
        );
        assert!(error.is_lease_lost());
        assert_eq!(probe.calls(), 0);
        assert!(probe.patches().is_empty(), "no drain acknowledged");
    }
}

#[tokio::test(start_paused = true)]
async fn a_shard_with_a_load_meter_measures_its_reconciles_but_not_its_drains() {
    use kube_sharding_api::load::LoadKey;
    let meter = crate::LoadMeter::new();
    let shard = Shard::new(RING, "shard-a", "default").with_load_meter(meter.clone());
    let guard = LeaseGuard::from_token(CancellationToken::new());
    // Tracked: the Secret is waiting for its reconcile.
    let mut tracked = (*secret(&[(SHARD_KEY, "shard-a")])).clone();
    meter.observe(&kube::runtime::watcher::Event::Apply(tracked.clone()));
    let failing = std::sync::atomic::AtomicBool::new(true);
    let mut inner = |_: Arc<Secret>, _: Arc<()>, _: Ownership| {
        let fail = failing.swap(false, Ordering::SeqCst);
        async move {
            if fail {
                Err(InnerError)
            } else {
                Ok(Action::await_change())
            }
        }
    };
    let reconcile = |object: Secret, inner: &mut _| {
        let object = Arc::new(object);
        let fetch = fetch_of(Some(Arc::clone(&object)), Arc::new(AtomicUsize::new(0)));
        dispatch(
            &shard,
            &guard,
            object,
            Arc::new(()),
            inner,
            fetch,
            // A slow acknowledgement: measured, it would show in the p99.
            |_, _| async {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                Ok(())
            },
        )
    };
    assert!(reconcile(tracked.clone(), &mut inner).await.is_err());
    let load = meter.report();
    assert_eq!(load.get(LoadKey::Errors), Some(1));
    assert_eq!(
        load.get(LoadKey::Queue),
        Some(1),
        "a failed reconcile leaves it queued"
    );
    assert!(reconcile(tracked.clone(), &mut inner).await.is_ok());
    let load = meter.report();
    assert_eq!(load.get(LoadKey::Errors), Some(1));
    assert_eq!(load.get(LoadKey::Queue), Some(0));
    assert!(load.get(LoadKey::P99Millis).is_some());

    // A drain acknowledgement is not a reconcile: nothing more is measured.
    tracked
        .metadata
        .labels
        .get_or_insert_default()
        .insert(DRAIN_KEY.into(), "true".into());
    assert!(reconcile(tracked, &mut inner).await.is_ok());
    assert_eq!(meter.report(), load);
}
