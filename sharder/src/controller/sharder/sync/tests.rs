//! `sync_ring` against a mock API server: the error paths and orderings a real one produces only
//! by chance (an expired continue token, a conflict, a newer view arriving mid-batch) and the
//! exact patches the sync sends. The end-to-end suite covers the same sync against a real API
//! server and real shards.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::http::{Request, Response};
use http_body_util::BodyExt;
use kube::client::Body;
use kube_sharding_api::{ClusterRing, ClusterRingSpec, RingKind, RingRef, RingResource};
use serde_json::{Value, json};

use super::*;
use crate::views::{ResourceInfo, build_view};

/// One request the mock API server received.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    path: String,
    query: String,
    content_type: String,
    body: Value,
}

impl Seen {
    /// The name of the object a PATCH is for.
    fn object(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or_default()
    }
}

/// What the mock answers a request with: a status code and a JSON body, or `None` to never
/// answer.
type Answer = Option<(u16, Value)>;

/// A client whose API server answers each request with `answer` and records every request.
fn mock(
    answer: impl Fn(&Seen) -> Answer + Send + Sync + 'static,
) -> (kube::Client, Arc<Mutex<Vec<Seen>>>) {
    mock_slow(answer, |_| false)
}

/// [`mock`], answering the requests `slow` picks only after [`SLOW`], and recording each such
/// answer as a request with method `ANSWERED` once it is sent.
fn mock_slow(
    answer: impl Fn(&Seen) -> Answer + Send + Sync + 'static,
    slow: impl Fn(&Seen) -> bool + Send + Sync + 'static,
) -> (kube::Client, Arc<Mutex<Vec<Seen>>>) {
    let answer = Arc::new(answer);
    let slow = Arc::new(slow);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let service = tower::service_fn(move |request: Request<Body>| {
        let (answer, slow, log) = (answer.clone(), slow.clone(), log.clone());
        async move {
            let (parts, body) = request.into_parts();
            let bytes = body.collect().await.expect("request body").to_bytes();
            let request = Seen {
                method: parts.method.to_string(),
                path: parts.uri.path().to_string(),
                query: parts.uri.query().unwrap_or_default().to_string(),
                content_type: parts
                    .headers
                    .get(axum::http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string(),
                body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            };
            log.lock().expect("log").push(request.clone());
            let Some((code, body)) = answer(&request) else {
                return std::future::pending().await;
            };
            if slow(&request) {
                tokio::time::sleep(SLOW).await;
                let answered = Seen {
                    method: "ANSWERED".into(),
                    ..request
                };
                log.lock().expect("log").push(answered);
            }
            Response::builder()
                .status(code)
                .body(Body::from(serde_json::to_vec(&body).expect("json")))
        }
    });
    (kube::Client::new(service, "default"), seen)
}

/// How long [`mock_slow`] takes to answer a slow request: far longer than the sync takes to
/// walk a page without waiting.
const SLOW: std::time::Duration = std::time::Duration::from_millis(300);

/// Ring `r` over Secrets in namespace `a` (controlling ConfigMaps when `controlled`), with the
/// available shards `a` and `b`.
fn view(controlled: bool) -> Arc<RingView> {
    let children = if controlled {
        vec![GroupResource::new("", "configmaps")]
    } else {
        Vec::new()
    };
    let ring = ClusterRing::new(
        "r",
        ClusterRingSpec {
            resources: vec![RingResource::controlling("", "secrets", children)],
            namespace_selector: None,
            hash_key: None,
            lease_namespaces: Vec::new(),
            assignment: None,
        },
    );
    let info = |kind: &str| ResourceInfo {
        kind: kind.into(),
        version: "v1".into(),
        namespaced: true,
    };
    let discovered = HashMap::from([
        (GroupResource::new("", "secrets"), info("Secret")),
        (GroupResource::new("", "configmaps"), info("ConfigMap")),
    ]);
    let shards = BTreeMap::from([("a".to_string(), 1), ("b".to_string(), 1)]);
    Arc::new(build_view(&ring, &shards, &discovered, &Default::default()))
}

fn secrets() -> GroupResource {
    GroupResource::new("", "secrets")
}

/// The shard `view` wants the Secret `name` on.
fn desired(view: &RingView, name: &str) -> String {
    let meta = kube::api::ObjectMeta {
        name: Some(name.into()),
        namespace: Some("a".into()),
        ..Default::default()
    };
    let placement = view.placement("", &view.resources[&secrets()], &meta);
    placement.desired.expect("an available shard").to_string()
}

/// The first `count` Secret names from `secret-0` on that `view` wants on `shard`.
fn names_on(view: &RingView, shard: &str, count: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("secret-{i}"))
        .filter(|name| desired(view, name) == shard)
        .take(count)
        .collect()
}

/// A listed object in namespace `a` with `labels` (and `owner`, the Secret that controls it).
fn object(name: &str, labels: &[(&str, &str)], owner: Option<&str>) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_string(), Value::from(*v)))
        .collect();
    let mut metadata = json!({
        "name": name, "namespace": "a", "uid": format!("uid-{name}"),
        "resourceVersion": "7", "labels": labels,
    });
    if let Some(owner) = owner {
        metadata["ownerReferences"] = json!([{
            "apiVersion": "v1", "kind": "Secret", "name": owner,
            "uid": format!("uid-{owner}"), "controller": true,
        }]);
    }
    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": metadata})
}

/// One page of a metadata list, with a continue token unless it is the last.
fn page(items: Vec<Value>, token: Option<&str>) -> Answer {
    let mut metadata = json!({"resourceVersion": "10"});
    if let Some(token) = token {
        metadata["continue"] = token.into();
    }
    Some((
        200,
        json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList", "metadata": metadata, "items": items}),
    ))
}

/// A failure Status with `code`, `reason` and `metadata`.
fn status(code: u16, reason: &str, metadata: Value) -> Answer {
    Some((
        code,
        json!({
            "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code,
            "reason": reason, "message": reason, "metadata": metadata,
        }),
    ))
}

/// What the API server answers a patch of `view`'s object `name` with, as the ring's webhook
/// would leave it: a drain keeps the shard label and adds the drain label; a move is assigned the
/// shard the ring wants.
fn patched(view: &RingView, name: &str, body: &Value) -> Answer {
    let asked = &body["metadata"]["labels"];
    let mut labels = serde_json::Map::new();
    if asked[&view.drain_label] == "true" {
        labels.insert(view.drain_label.clone(), "true".into());
    } else {
        labels.insert(view.shard_label.clone(), desired(view, name).into());
    }
    Some((
        200,
        json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
               "metadata": {"name": name, "namespace": "a", "uid": format!("uid-{name}"),
                            "resourceVersion": "8", "labels": labels}}),
    ))
}

/// The sync's list requests of `resource` (not the watches of drained controllers), by query.
fn lists(seen: &Mutex<Vec<Seen>>, resource: &str) -> Vec<String> {
    seen.lock()
        .expect("log")
        .iter()
        .filter(|r| {
            r.method == "GET" && r.path.ends_with(resource) && !r.query.contains("labelSelector")
        })
        .map(|r| r.query.clone())
        .collect()
}

/// The PATCH requests, sorted by object name.
fn patches(seen: &Mutex<Vec<Seen>>) -> Vec<Seen> {
    let mut patches: Vec<Seen> = seen
        .lock()
        .expect("log")
        .iter()
        .filter(|r| r.method == "PATCH")
        .cloned()
        .collect();
    patches.sort_by(|x, y| x.object().cmp(y.object()));
    patches
}

/// How often the sync of ring `r` ended with `outcome`.
fn syncs(ctx: &Context, outcome: &'static str) -> u64 {
    let ring = RingRef::new(RingKind::ClusterRing, "r");
    ctx.metrics
        .syncs
        .get_or_create(&OutcomeLabels::new(&ring, outcome))
        .get()
}

/// The labels of the Secret metrics of ring `r`.
fn secret_labels() -> crate::metrics::ResourceLabels {
    let ring = RingRef::new(RingKind::ClusterRing, "r");
    Metrics::resource_labels(&ring, "", "secrets")
}

/// A sync of `view` through `client` with `concurrent_moves`; the patcher's context comes back
/// for the metrics.
async fn sync(
    client: kube::Client,
    view: &Arc<RingView>,
    concurrent_moves: u32,
    stop: CancellationToken,
) -> (Result<SyncStats, Error>, Context) {
    let ctx = Context::for_tests(
        client,
        |config| config.controller.sharder.concurrent_moves = concurrent_moves,
        &["a"],
    );
    let patcher = Patcher::new(ctx.clone());
    let result = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        sync_ring(&patcher, view, stop),
    )
    .await
    .expect("the sync ends");
    (result, ctx)
}

#[tokio::test]
async fn a_sync_lists_every_page_and_sends_the_patches_its_decisions_call_for() {
    let view = view(false);
    let (shard, drain) = (view.shard_label.clone(), view.drain_label.clone());
    let on_a = names_on(&view, "a", 3);
    let on_b = names_on(&view, "b", 2);
    // Page 1: one in place, one on the other available shard (drained), one unassigned (moved).
    // Page 2: one drained, one whose drain is pending (left alone), one unassigned.
    let first = vec![
        object(&on_a[0], &[(&shard, "a")], None),
        object(&on_a[1], &[(&shard, "b")], None),
        object(&on_b[0], &[], None),
    ];
    let second = vec![
        object(&on_b[1], &[(&shard, "a")], None),
        object(&on_a[2], &[(&shard, "b"), (&drain, "true")], None),
        object("unassigned-elsewhere", &[], None),
    ];
    let pages = Mutex::new(VecDeque::from([
        page(first, Some("page-2")),
        page(second, None),
    ]));
    let answering = view.clone();
    let (client, seen) = mock(move |request| match request.method.as_str() {
        "GET" => pages.lock().expect("pages").pop_front().flatten(),
        "PATCH" => patched(&answering, request.object(), &request.body),
        _ => status(404, "NotFound", json!({})),
    });
    let (result, ctx) = sync(client, &view, 10, CancellationToken::new()).await;
    let stats = result.expect("the sync succeeds");
    assert_eq!(
        stats,
        SyncStats {
            listed: 6,
            drained: 2,
            moved: 2,
            failed: 0,
            held: 0
        }
    );
    let queries = lists(&seen, "/secrets");
    assert_eq!(queries.len(), 2, "{queries:?}");
    assert!(!queries[0].contains("continue="), "{queries:?}");
    assert!(queries[1].contains("continue=page-2"), "{queries:?}");
    assert!(
        queries.iter().all(|q| q.contains("limit=500")),
        "{queries:?}"
    );
    // Drains add the drain label, moves remove both labels for the webhook; each guarded by
    // the resourceVersion listed, sent as merge patches to the object's own path.
    let drain_patch = json!({"metadata": {"resourceVersion": "7", "labels": {&drain: "true"}}});
    let move_patch =
        json!({"metadata": {"resourceVersion": "7", "labels": {&shard: null, &drain: null}}});
    let mut expected = vec![
        (on_a[1].clone(), drain_patch.clone()),
        (on_b[1].clone(), drain_patch),
        (on_b[0].clone(), move_patch.clone()),
        ("unassigned-elsewhere".to_string(), move_patch),
    ];
    expected.sort_by(|x, y| x.0.cmp(&y.0));
    let sent = patches(&seen);
    assert_eq!(
        sent.iter()
            .map(|p| (p.object().to_string(), p.body.clone()))
            .collect::<Vec<_>>(),
        expected
    );
    for patch in &sent {
        assert_eq!(
            patch.path,
            format!("/api/v1/namespaces/a/secrets/{}", patch.object())
        );
        assert_eq!(patch.content_type, "application/merge-patch+json");
    }
    assert_eq!(syncs(&ctx, "success"), 1);
    assert_eq!(ctx.metrics.drains.get_or_create(&secret_labels()).get(), 2);
    assert_eq!(
        ctx.metrics.movements.get_or_create(&secret_labels()).get(),
        2
    );
}

#[tokio::test]
async fn a_conflicting_patch_fails_the_sync_after_the_others_went_through() {
    let view = view(false);
    let shard = view.shard_label.clone();
    let on_a = names_on(&view, "a", 3);
    let items = on_a
        .iter()
        .map(|name| object(name, &[(&shard, "b")], None))
        .collect();
    let pages = Mutex::new(VecDeque::from([page(items, None)]));
    let conflicting = on_a[1].clone();
    let answering = view.clone();
    let (client, seen) = mock(move |request| match request.method.as_str() {
        "GET" => pages.lock().expect("pages").pop_front().flatten(),
        // Written since it was listed: its resourceVersion no longer matches.
        "PATCH" if request.object() == conflicting => status(409, "Conflict", json!({})),
        "PATCH" => patched(&answering, request.object(), &request.body),
        _ => status(404, "NotFound", json!({})),
    });
    let (result, ctx) = sync(client, &view, 10, CancellationToken::new()).await;
    match result {
        Err(Error::Patches { failed, attempted }) => assert_eq!((failed, attempted), (1, 3)),
        other => panic!("expected failed patches, got {other:?}"),
    }
    // Every drain was sent once; the conflict is left to the retry of the whole sync.
    assert_eq!(patches(&seen).len(), 3);
    assert_eq!(ctx.metrics.drains.get_or_create(&secret_labels()).get(), 2);
    assert_eq!(syncs(&ctx, "failure"), 1);
}

#[tokio::test]
async fn an_expired_continue_token_lists_on_with_the_token_of_its_answer() {
    let view = view(false);
    let shard = view.shard_label.clone();
    let on_a = names_on(&view, "a", 3);
    let pages = Mutex::new(VecDeque::from([
        page(vec![object(&on_a[0], &[(&shard, "a")], None)], Some("old")),
        status(410, "Expired", json!({"continue": "fresh"})),
        page(
            vec![
                object(&on_a[1], &[(&shard, "a")], None),
                object(&on_a[2], &[(&shard, "b")], None),
            ],
            None,
        ),
    ]));
    let answering = view.clone();
    let (client, seen) = mock(move |request| match request.method.as_str() {
        "GET" => pages.lock().expect("pages").pop_front().flatten(),
        "PATCH" => patched(&answering, request.object(), &request.body),
        _ => status(404, "NotFound", json!({})),
    });
    let (result, ctx) = sync(client, &view, 10, CancellationToken::new()).await;
    let stats = result.expect("the sync succeeds");
    assert_eq!((stats.listed, stats.drained), (3, 1));
    let queries = lists(&seen, "/secrets");
    assert_eq!(queries.len(), 3, "{queries:?}");
    assert!(queries[1].contains("continue=old"), "{queries:?}");
    assert!(queries[2].contains("continue=fresh"), "{queries:?}");
    assert_eq!(
        ctx.metrics
            .list_inconsistent_continuations
            .get_or_create(&secret_labels())
            .get(),
        1
    );
}

#[tokio::test]
async fn a_list_started_over_counts_its_objects_once() {
    let view = view(false);
    let (shard, drain) = (view.shard_label.clone(), view.drain_label.clone());
    let on_a = names_on(&view, "a", 2);
    let pages = Mutex::new(VecDeque::from([
        page(vec![object(&on_a[0], &[(&shard, "b")], None)], Some("old")),
        // Expired with no token to go on with: the list starts over.
        status(410, "Expired", json!({})),
        // The first page again, its object draining by now.
        page(
            vec![object(&on_a[0], &[(&shard, "b"), (&drain, "true")], None)],
            Some("again"),
        ),
        page(vec![object(&on_a[1], &[(&shard, "a")], None)], None),
    ]));
    let answering = view.clone();
    let (client, seen) = mock(move |request| match request.method.as_str() {
        "GET" => pages.lock().expect("pages").pop_front().flatten(),
        "PATCH" => patched(&answering, request.object(), &request.body),
        _ => status(404, "NotFound", json!({})),
    });
    let (result, ctx) = sync(client, &view, 10, CancellationToken::new()).await;
    let stats = result.expect("the sync succeeds");
    assert_eq!((stats.listed, stats.drained), (2, 1));
    let queries = lists(&seen, "/secrets");
    assert_eq!(queries.len(), 4, "{queries:?}");
    assert!(!queries[2].contains("continue="), "{queries:?}");
    assert_eq!(
        ctx.metrics
            .list_restarts
            .get_or_create(&secret_labels())
            .get(),
        1
    );
}

#[tokio::test]
async fn a_superseded_sync_sends_nothing_more_and_counts_what_it_sent() {
    let view = view(false);
    let shard = view.shard_label.clone();
    let on_a = names_on(&view, "a", 4);
    let items = on_a[..3]
        .iter()
        .map(|name| object(name, &[(&shard, "b")], None))
        .collect();
    let more = vec![object(&on_a[3], &[(&shard, "b")], None)];
    let pages = Mutex::new(VecDeque::from([
        page(items, Some("page-2")),
        page(more, None),
    ]));
    let stop = CancellationToken::new();
    let newer_view = stop.clone();
    let answering = view.clone();
    let (client, seen) = mock(move |request| match request.method.as_str() {
        "GET" => pages.lock().expect("pages").pop_front().flatten(),
        "PATCH" => {
            // A newer view of the ring arrives while the first patch is in flight.
            newer_view.cancel();
            patched(&answering, request.object(), &request.body)
        }
        _ => status(404, "NotFound", json!({})),
    });
    // One patch at a time: the others have not started when the newer view arrives.
    let (result, ctx) = sync(client, &view, 1, stop).await;
    match result {
        Err(Error::Superseded { unsettled }) => assert_eq!(unsettled, 0),
        other => panic!("expected a superseded sync, got {other:?}"),
    }
    assert_eq!(patches(&seen).len(), 1);
    // The patch that went out still counts; the sync's outcome is the newer sync's to report.
    assert_eq!(ctx.metrics.drains.get_or_create(&secret_labels()).get(), 1);
    assert_eq!(syncs(&ctx, "success") + syncs(&ctx, "failure"), 0);
}

#[tokio::test]
async fn a_child_waits_for_its_controllers_drain_instead_of_moving() {
    let view = view(true);
    let (shard, drain) = (view.shard_label.clone(), view.drain_label.clone());
    // The controller belongs on `b` but sits on `a`: it is drained. Its child, on `a` too, is
    // held back until the controller's drain is acknowledged.
    let owner = names_on(&view, "b", 1).remove(0);
    let secrets = Mutex::new(VecDeque::from([page(
        vec![object(&owner, &[(&shard, "a")], None)],
        None,
    )]));
    let configmaps = Mutex::new(VecDeque::from([page(
        vec![object("child", &[(&shard, "a")], Some(&owner))],
        None,
    )]));
    let answering = view.clone();
    let drain_label = drain.clone();
    let (client, seen) = mock(move |request| match request.method.as_str() {
        // The watch of drained controllers: an empty list, then a watch that never answers.
        "GET" if request.query.contains("watch=true") => None,
        "GET" if request.query.contains("labelSelector") => {
            assert!(request.query.contains(&drain_label), "{}", request.query);
            page(Vec::new(), None)
        }
        "GET" if request.path.ends_with("/secrets") => {
            secrets.lock().expect("pages").pop_front().flatten()
        }
        "GET" if request.path.ends_with("/configmaps") => {
            configmaps.lock().expect("pages").pop_front().flatten()
        }
        "PATCH" => patched(&answering, request.object(), &request.body),
        _ => status(404, "NotFound", json!({})),
    });
    let (result, ctx) = sync(client, &view, 10, CancellationToken::new()).await;
    match result {
        Err(Error::WaitingForOwners { waiting, following }) => {
            assert_eq!(waiting, 1);
            assert!(following.is_some(), "the child is handed to the following");
        }
        other => panic!("expected a child waiting for its controller, got {other:?}"),
    }
    let sent = patches(&seen);
    assert_eq!(
        sent.iter()
            .map(|p| (p.object().to_string(), p.body.clone()))
            .collect::<Vec<_>>(),
        [(
            owner,
            json!({"metadata": {"resourceVersion": "7", "labels": {&drain: "true"}}})
        )]
    );
    assert_eq!(syncs(&ctx, "waiting"), 1);
}

#[tokio::test]
async fn children_go_first_and_drains_wait_for_the_watch_of_drained_controllers() {
    let view = view(true);
    let (shard, drain) = (view.shard_label.clone(), view.drain_label.clone());
    let owner = names_on(&view, "b", 1).remove(0);
    let secrets = Mutex::new(VecDeque::from([page(
        vec![object(&owner, &[(&shard, "a")], None)],
        None,
    )]));
    let configmaps = Mutex::new(VecDeque::from([page(
        vec![object("child", &[(&shard, "a")], Some(&owner))],
        None,
    )]));
    let answering = view.clone();
    let watch_list = |request: &Seen| {
        request.query.contains("labelSelector") && !request.query.contains("watch=true")
    };
    let answer = move |request: &Seen| match request.method.as_str() {
        "GET" if request.query.contains("watch=true") => None,
        "GET" if request.query.contains("labelSelector") => page(Vec::new(), None),
        "GET" if request.path.ends_with("/secrets") => {
            secrets.lock().expect("pages").pop_front().flatten()
        }
        "GET" if request.path.ends_with("/configmaps") => {
            configmaps.lock().expect("pages").pop_front().flatten()
        }
        "PATCH" => patched(&answering, request.object(), &request.body),
        _ => status(404, "NotFound", json!({})),
    };
    // The watch of drained controllers lists slowly: the drains must wait for it.
    let (client, seen) = mock_slow(answer, watch_list);
    // The shards leave their controlled objects to the sharder: children are walked first.
    let ctx = Context::for_tests(
        client,
        |config| {
            config.controller.sharder.shards_leave_controlled_objects = true;
        },
        &["a"],
    );
    let patcher = Patcher::new(ctx.clone());
    let result = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        sync_ring(&patcher, &view, CancellationToken::new()),
    )
    .await
    .expect("the sync ends");
    match result {
        Err(Error::WaitingForOwners { waiting, following }) => {
            assert_eq!(waiting, 1);
            assert!(following.is_some(), "the child is handed to the following");
        }
        other => panic!("expected a child waiting for its controller, got {other:?}"),
    }
    // The order of the requests: the children's list, and only once the watch has listed the
    // controllers' list and their drain, so that the watch sees every drain leave.
    let order: Vec<String> = seen
        .lock()
        .expect("log")
        .iter()
        .filter(|r| !r.query.contains("watch=true"))
        .map(
            |r| match (r.method.as_str(), r.query.contains("labelSelector")) {
                ("ANSWERED", _) => "watch listed".to_string(),
                ("GET", true) => "watch list".to_string(),
                ("GET", false) => format!("list {}", r.path.rsplit('/').next().unwrap_or_default()),
                (method, _) => format!("{method} {}", r.object()),
            },
        )
        .collect();
    let at = |request: &str| {
        order
            .iter()
            .position(|r| r == request)
            .unwrap_or_else(|| panic!("no {request} in {order:?}"))
    };
    let drained = at(&format!("PATCH {owner}"));
    assert!(
        at("list configmaps") < at("list secrets")
            && at("watch listed") < drained
            && at("list secrets") < drained,
        "{order:?}"
    );
    // Only the controller was patched: its drain.
    let sent = patches(&seen);
    assert_eq!(sent.len(), 1, "{order:?}");
    assert_eq!(sent[0].body["metadata"]["labels"][&drain], "true");
}

#[tokio::test]
async fn a_move_the_webhook_did_not_assign_holds_back_the_rings_other_moves() {
    let view = view(false);
    let unassigned = names_on(&view, "a", 3);
    let items = unassigned
        .iter()
        .map(|name| object(name, &[], None))
        .collect();
    let pages = Mutex::new(VecDeque::from([page(items, None)]));
    let (client, seen) = mock(move |request| match request.method.as_str() {
        "GET" => pages.lock().expect("pages").pop_front().flatten(),
        // The webhook did not run: the object comes back without a shard label.
        "PATCH" => Some((
            200,
            json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                   "metadata": {"name": request.object(), "namespace": "a", "resourceVersion": "8"}}),
        )),
        _ => status(404, "NotFound", json!({})),
    });
    // One move at a time, so that the first one's answer is in before the next goes.
    let (result, ctx) = sync(client, &view, 1, CancellationToken::new()).await;
    match result {
        Err(Error::Patches { failed, attempted }) => assert_eq!((failed, attempted), (1, 1)),
        other => panic!("expected a failed move, got {other:?}"),
    }
    // The other two were held back without a request: moves wait for a probe to land.
    assert_eq!(patches(&seen).len(), 1);
    assert_eq!(syncs(&ctx, "failure"), 1);
    assert_eq!(
        ctx.reachability
            .gate(&view.ring_ref(), std::time::Instant::now()),
        crate::leader::reachability::MoveGate::Closed
    );
}
