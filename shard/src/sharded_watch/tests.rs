use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{ListParams, WatchParams};
use kube_sharding_api::ranges::{HashRange, RangeSet, ShardField};

use super::*;

/// The selector the e2e test `sharded_watch::` sends to kube-apiserver 1.37.2, which accepts it.
fn lower_half() -> ShardSelector {
    ShardSelector::new(ShardField::Uid, RangeSet::new(HashRange::new(0, 1 << 63)))
        .expect("not empty")
}

/// What `lower_half` looks like in a query string, byte for byte.
const LOWER_HALF_QUERY: &str = "shardSelector=shardRange%28object.metadata.uid%2C%20%270x0000000000000000%27%2C%20%270x8000000000000000%27%29";

fn handle() -> ShardedWatch {
    let handle = ShardedWatch::for_resource::<Secret>();
    handle.set_selector(Some(lower_half()));
    handle
}

/// The URI `handle` makes of `request` (a request kube's typed API builds), and the verb it saw.
fn rewritten(handle: &ShardedWatch, request: Request<Vec<u8>>) -> (String, Option<Verb>) {
    let mut request = request;
    let verb = handle.rewrite(&mut request).map(|(verb, _)| verb);
    (request.uri().to_string(), verb)
}

fn secrets(namespace: Option<&str>) -> kube::core::Request {
    kube::core::Request::new(match namespace {
        Some(ns) => format!("/api/v1/namespaces/{ns}/secrets"),
        None => "/api/v1/secrets".to_string(),
    })
}

#[test]
fn a_list_carries_the_encoded_selector_last() {
    let request = secrets(Some("team-a"))
        .list(&ListParams::default().limit(500))
        .expect("a request");
    assert_eq!(
        rewritten(&handle(), request),
        (
            format!("/api/v1/namespaces/team-a/secrets?&limit=500&{LOWER_HALF_QUERY}"),
            Some(Verb::List)
        )
    );
    // All namespaces, no other parameter.
    let request = http::Request::get("/api/v1/secrets")
        .body(Vec::new())
        .expect("a request");
    assert_eq!(
        rewritten(&handle(), request),
        (
            format!("/api/v1/secrets?{LOWER_HALF_QUERY}"),
            Some(Verb::List)
        )
    );
}

#[test]
fn a_watch_carries_the_encoded_selector_last() {
    let request = secrets(None)
        .watch(&WatchParams::default().timeout(290), "1234")
        .expect("a request");
    assert_eq!(
        rewritten(&handle(), request),
        (
            format!(
                "/api/v1/secrets?&watch=true&timeoutSeconds=290&allowWatchBookmarks=true&resourceVersion=1234&{LOWER_HALF_QUERY}"
            ),
            Some(Verb::Watch)
        )
    );
}

#[test]
fn a_group_resource_is_matched_by_group_and_version() {
    let handle = ShardedWatch::for_resource::<Lease>();
    handle.set_selector(Some(lower_half()));
    let request = kube::core::Request::new("/apis/coordination.k8s.io/v1/namespaces/x/leases")
        .list(&ListParams::default())
        .expect("a request");
    assert_eq!(rewritten(&handle, request).1, Some(Verb::List));
    for other in [
        "/apis/coordination.k8s.io/v1beta1/namespaces/x/leases",
        "/apis/other.example.com/v1/namespaces/x/leases",
        "/api/v1/namespaces/x/leases",
    ] {
        let request = http::Request::get(other)
            .body(Vec::new())
            .expect("a request");
        assert_eq!(rewritten(&handle, request), (other.to_string(), None));
    }
}

#[test]
fn other_requests_pass_unchanged() {
    let handle = handle();
    let untouched = [
        // One object, its subresource, another resource, a namespace itself.
        http::Request::get("/api/v1/namespaces/x/secrets/s1"),
        http::Request::get("/api/v1/namespaces/x/secrets/s1/status"),
        http::Request::get("/api/v1/namespaces/x/configmaps?watch=true"),
        http::Request::get("/api/v1/namespaces/x"),
        http::Request::get("/api/v1/secretsfoo"),
        http::Request::get("/apis/v1/secrets"),
        // Writes to the collection.
        http::Request::post("/api/v1/namespaces/x/secrets"),
        http::Request::delete("/api/v1/namespaces/x/secrets"),
        // A selector of the caller's own.
        http::Request::get("/api/v1/secrets?shardSelector=mine"),
    ];
    for request in untouched {
        let request = request.body(Vec::new()).expect("a request");
        let before = request.uri().to_string();
        assert_eq!(rewritten(&handle, request), (before, None));
    }
    // No selector: nothing is added, even to the resource's lists.
    let unset = ShardedWatch::for_resource::<Secret>();
    let request = secrets(None)
        .list(&ListParams::default())
        .expect("a request");
    assert_eq!(
        rewritten(&unset, request),
        ("/api/v1/secrets?".to_string(), None)
    );
    // Namespaces are a resource like any other: `/api/v1/namespaces` is their collection.
    let namespaces = ShardedWatch::for_resource::<Namespace>();
    namespaces.set_selector(Some(lower_half()));
    let request = http::Request::get("/api/v1/namespaces")
        .body(Vec::new())
        .expect("a request");
    assert_eq!(rewritten(&namespaces, request).1, Some(Verb::List));
}

#[test]
fn encodes_every_reserved_byte() {
    assert_eq!(
        encode_query_value("a-z.A_Z~09 ()',|%+&="),
        "a-z.A_Z~09%20%28%29%27%2C%7C%25%2B%26%3D"
    );
    let full = ShardSelector::new(ShardField::Namespace, RangeSet::full()).expect("not empty");
    assert_eq!(
        encode_query_value(&full.to_string()),
        "shardRange%28object.metadata.namespace%2C%20%270x0000000000000000%27%2C%20%270x10000000000000000%27%29"
    );
}

/// As kube-apiserver 1.37.2 answers a list with the gate on.
const APPLIED: &[u8] = br#"{"kind":"SecretList","apiVersion":"v1","metadata":{"resourceVersion":"225","shardInfo":{"selector":"shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')"}},"items":[]}"#;
/// As kube-apiserver 1.37.2 answers a list with the gate off.
const IGNORED: &[u8] = br#"{"kind":"SecretList","apiVersion":"v1","metadata":{"resourceVersion":"212"},"items":[{"metadata":{"name":"s1"}}]}"#;

/// The generation a list of Secrets sent through `handle` now carries.
fn list_generation(handle: &ShardedWatch) -> u64 {
    let mut request = http::Request::get("/api/v1/secrets")
        .body(())
        .expect("a request");
    let (verb, generation) = handle
        .rewrite(&mut request)
        .expect("a list of the resource");
    assert_eq!(verb, Verb::List);
    generation.generation
}

#[test]
fn list_metadata_tells_whether_the_server_applied_the_selector() {
    let handle = handle();
    let mut changes = handle.subscribe();
    assert_eq!(handle.server_filtering(), ServerFiltering::Unknown);
    let generation = list_generation(&handle);
    handle.observe_list(generation, APPLIED);
    assert_eq!(handle.server_filtering(), ServerFiltering::Applied);
    assert!(changes.has_changed().expect("open"));
    changes.mark_unchanged();
    handle.observe_list(generation, IGNORED);
    assert_eq!(handle.server_filtering(), ServerFiltering::Ignored);
    assert!(changes.has_changed().expect("open"));
    // Not a list: no news.
    changes.mark_unchanged();
    handle.observe_list(generation, b"\x6b\x38\x73\x00protobuf");
    assert_eq!(handle.server_filtering(), ServerFiltering::Ignored);
    assert!(!changes.has_changed().expect("open"));
    // A new selector starts over, and a list sent with the old one, answered late, says nothing
    // about it.
    handle.set_selector(Some(lower_half()));
    assert_eq!(handle.server_filtering(), ServerFiltering::Unknown);
    handle.observe_list(generation, APPLIED);
    assert_eq!(handle.server_filtering(), ServerFiltering::Unknown);
    handle.observe_list(list_generation(&handle), APPLIED);
    assert_eq!(handle.server_filtering(), ServerFiltering::Applied);
}

#[test]
fn the_client_side_filter_uses_the_same_ranges() {
    let handle = handle();
    // FNV-1a 0x1f7a9771bb9aeca3 (a uid kube-apiserver kept for this selector) and
    // 0xe24bc6b58ead2d20 (in the upper half).
    let kept = ObjectMeta {
        uid: Some("5668c9bb-d8c3-49d6-a4ea-58e23d628822".into()),
        ..ObjectMeta::default()
    };
    assert!(handle.accepts(&kept));
    assert!(handle.accepts_value("5668c9bb-d8c3-49d6-a4ea-58e23d628822"));
    assert!(!handle.accepts_value("cf3e6dd6-0000-0000-0000-000000000000"));
    handle.set_selector(None);
    assert!(handle.accepts_value("cf3e6dd6-0000-0000-0000-000000000000"));
}
