//! The enforcing layer against a scripted server: filtering, the restart on a new selection,
//! the gate on resumed watches, the "nothing" answers and the held objects.

use std::convert::Infallible;
use std::sync::atomic::AtomicUsize;

use futures::channel::mpsc;
use futures::{SinkExt, StreamExt};
use http_body_util::StreamBody;
use k8s_openapi::api::core::v1::Secret;
use kube_sharding_api::ranges::{HashRange, RangeSet, fnv1a64};

use super::*;

fn half(lower: bool) -> ShardSelector {
    let range = if lower {
        HashRange::new(0, 1 << 63)
    } else {
        HashRange::new(1 << 63, 1 << 64)
    };
    ShardSelector::new(ShardField::Uid, RangeSet::new(range)).expect("not empty")
}

/// `count` uids whose hash is in the lower half (`lower`) or the upper one.
fn uids(lower: bool, count: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("uid-{i}"))
        .filter(|u| (fnv1a64(u) < 1 << 63) == lower)
        .take(count)
        .collect()
}

fn item(uid: &str) -> serde_json::Value {
    serde_json::json!({"metadata": {"name": format!("s-{uid}"), "namespace": "ns", "uid": uid, "resourceVersion": "5"}})
}

fn event(kind: &str, uid: &str, rv: &str) -> String {
    let mut object = item(uid);
    object["metadata"]["resourceVersion"] = rv.into();
    format!("{}\n", serde_json::json!({"type": kind, "object": object}))
}

type Chunks = mpsc::UnboundedSender<Bytes>;
type Scripted = Either<
    Full<Bytes>,
    StreamBody<futures::stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>,
>;

/// A server answering lists with `list` (and counting requests) and watches with a body fed
/// through the returned senders, one per watch request.
struct Server {
    requests: Arc<AtomicUsize>,
    watches: mpsc::UnboundedReceiver<Chunks>,
}

fn server(
    list: serde_json::Value,
) -> (
    Server,
    impl Service<
        Request<Full<Bytes>>,
        Response = Response<Scripted>,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone,
) {
    let requests = Arc::new(AtomicUsize::new(0));
    let (watch_tx, watches) = mpsc::unbounded::<Chunks>();
    let counter = Arc::clone(&requests);
    let service = tower::service_fn(move |request: Request<Full<Bytes>>| {
        counter.fetch_add(1, Ordering::SeqCst);
        let query = request.uri().query().unwrap_or_default().to_string();
        let watch = query.contains("watch=true");
        let mut list = list.clone();
        // The first page names a continue token, the second (the same items) ends the list.
        if query.contains("continue=")
            && let Some(meta) = list["metadata"].as_object_mut()
        {
            meta.remove("continue");
        }
        let watch_tx = watch_tx.clone();
        async move {
            let body: Scripted = if watch {
                let (tx, rx) = mpsc::unbounded::<Bytes>();
                watch_tx.unbounded_send(tx).expect("test alive");
                Either::Right(StreamBody::new(rx.map(|b| Ok(Frame::data(b))).boxed()))
            } else {
                Either::Left(Full::new(Bytes::from(list.to_string())))
            };
            Ok::<_, Infallible>(Response::new(body))
        }
    });
    (Server { requests, watches }, service)
}

async fn send<S, B>(service: &mut S, uri: &str) -> Response<B>
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
{
    let request = Request::get(uri)
        .body(Full::new(Bytes::new()))
        .expect("request");
    service.call(request).await.expect("answered")
}

async fn next_data<B>(body: &mut B) -> Option<String>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    let frame = tokio::time::timeout(std::time::Duration::from_secs(5), body.frame())
        .await
        .expect("a frame in time")?;
    Some(
        String::from_utf8(frame.expect("no error").into_data().expect("data").to_vec())
            .expect("utf-8"),
    )
}

async fn whole<B>(body: B) -> serde_json::Value
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let bytes = body.collect().await.expect("body").to_bytes();
    serde_json::from_slice(&bytes).expect("json")
}

fn item_uids(list: &serde_json::Value) -> Vec<String> {
    list["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|i| i["metadata"]["uid"].as_str().expect("uid").to_string())
        .collect()
}

#[tokio::test]
async fn the_layer_filters_restarts_and_keeps_what_it_delivered() {
    let (lower, upper) = (uids(true, 3), uids(false, 2));
    let mut all: Vec<serde_json::Value> = lower.iter().chain(&upper).map(|u| item(u)).collect();
    all.rotate_left(2);
    // A server that ignores the selector: every object, no shardInfo.
    let list = serde_json::json!({"kind": "SecretList", "apiVersion": "v1", "metadata": {"resourceVersion": "10", "continue": "tok=="}, "items": all});
    let (mut server, inner) = server(list);
    let handle = ShardedWatch::enforcing_for_resource::<Secret>();
    let mut service = handle.layer().layer(inner);
    let mut departures = handle.subscribe_departures().expect("enforcing");

    // No ranges yet: the layer answers, the server sees nothing.
    let empty = whole(
        send(&mut service, "/api/v1/secrets?limit=500")
            .await
            .into_body(),
    )
    .await;
    assert_eq!(item_uids(&empty), Vec::<String>::new());
    assert_eq!(server.requests.load(Ordering::SeqCst), 0);

    assert_eq!(handle.revoke_to(Some(half(true))), Vec::new());
    let first = whole(
        send(&mut service, "/api/v1/secrets?limit=500")
            .await
            .into_body(),
    )
    .await;
    assert_eq!(item_uids(&first).len(), lower.len());
    let listed = whole(
        send(&mut service, "/api/v1/secrets?limit=500&continue=tok%3D%3D")
            .await
            .into_body(),
    )
    .await;
    let mut expected = lower.clone();
    expected.sort();
    let mut got = item_uids(&listed);
    got.sort();
    assert_eq!(got, expected, "only the lower half passes");
    assert_eq!(handle.server_filtering(), ServerFiltering::Ignored);
    assert_eq!(handle.ignored_lists(), 2, "both pages");
    let mut registry = prometheus_client::registry::Registry::default();
    handle.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
    assert!(
        text.contains("kube_sharding_shard_selector_ignored_lists_total{resource=\"secrets\"} 2"),
        "{text}"
    );

    // A watch from an unknown resource version: told to list again, without the server.
    let before = server.requests.load(Ordering::SeqCst);
    let mut gone = send(&mut service, "/api/v1/secrets?watch=true&resourceVersion=3")
        .await
        .into_body();
    assert!(
        next_data(&mut gone)
            .await
            .expect("an event")
            .contains("\"code\":410")
    );
    assert_eq!(server.requests.load(Ordering::SeqCst), before);

    // From the list's version: the server's events, filtered, lines split across chunks.
    let mut watch = send(
        &mut service,
        "/api/v1/secrets?watch=true&resourceVersion=10",
    )
    .await
    .into_body();
    let mut chunks = server
        .watches
        .next()
        .await
        .expect("a watch reached the server");
    let added = event("ADDED", &lower[0], "11");
    let (first, second) = added.split_at(20);
    chunks
        .send(Bytes::from(first.to_string()))
        .await
        .expect("sent");
    chunks
        .send(Bytes::from(format!(
            "{second}{}",
            event("ADDED", &upper[0], "12")
        )))
        .await
        .expect("sent");
    assert_eq!(next_data(&mut watch).await.as_deref(), Some(added.as_str()));
    let bookmark =
        "{\"type\":\"BOOKMARK\",\"object\":{\"metadata\":{\"resourceVersion\":\"13\"}}}\n";
    chunks
        .send(Bytes::from(format!(
            "{}{bookmark}",
            event("MODIFIED", &upper[1], "12")
        )))
        .await
        .expect("sent");
    assert_eq!(
        next_data(&mut watch).await.as_deref(),
        Some(bookmark),
        "bookmarks always pass"
    );
    // A deletion of a held object is a departure.
    chunks
        .send(Bytes::from(event("DELETED", &lower[1], "14")))
        .await
        .expect("sent");
    assert!(
        next_data(&mut watch)
            .await
            .expect("event")
            .contains("DELETED")
    );
    assert_eq!(
        departures
            .recv()
            .await
            .expect("a departure")
            .object()
            .uid
            .as_deref(),
        Some(lower[1].as_str())
    );

    // New ranges: the held lower objects are revoked, the open watch ends with a 410.
    let mut revoked: Vec<String> = handle
        .revoke_to(Some(half(false)))
        .into_iter()
        .filter_map(|k| k.uid)
        .collect();
    revoked.sort();
    let mut expected = vec![lower[0].clone(), lower[2].clone()];
    expected.sort();
    assert_eq!(revoked, expected);
    assert!(
        next_data(&mut watch)
            .await
            .expect("an event")
            .contains("\"code\":410")
    );
    assert_eq!(next_data(&mut watch).await, None, "then the watch ends");
    // Resuming from a version of the old selection: listed again instead.
    let mut resumed = send(
        &mut service,
        "/api/v1/secrets?watch=true&resourceVersion=13",
    )
    .await
    .into_body();
    assert!(
        next_data(&mut resumed)
            .await
            .expect("an event")
            .contains("\"code\":410")
    );

    // A streaming list starts from scratch: it reaches the server.
    let requests = server.requests.load(Ordering::SeqCst);
    let _streaming = send(
        &mut service,
        "/api/v1/secrets?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
    )
    .await;
    assert_eq!(server.requests.load(Ordering::SeqCst), requests + 1);

    // A page of a list begun under the previous selection: the whole list again.
    let stale = send(&mut service, "/api/v1/secrets?limit=2&continue=tok%3D%3D").await;
    assert_eq!(stale.status(), http::StatusCode::GONE);

    // No ranges: an open silent watch ends when ranges come.
    handle.revoke_to(None);
    let listed = whole(send(&mut service, "/api/v1/secrets").await.into_body()).await;
    assert_eq!(item_uids(&listed), Vec::<String>::new());
    let version = listed["metadata"]["resourceVersion"]
        .as_str()
        .expect("rv")
        .to_string();
    let requests = server.requests.load(Ordering::SeqCst);
    let mut silent = send(
        &mut service,
        &format!("/api/v1/secrets?watch=true&resourceVersion={version}"),
    )
    .await
    .into_body();
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(50), silent.frame())
            .await
            .is_err(),
        "silent while there are no ranges"
    );
    assert_eq!(server.requests.load(Ordering::SeqCst), requests);
    handle.revoke_to(Some(half(true)));
    assert!(
        next_data(&mut silent)
            .await
            .expect("an event")
            .contains("\"code\":410")
    );
}
