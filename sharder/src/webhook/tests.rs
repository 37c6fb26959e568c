use std::collections::{BTreeMap, HashMap};

use axum::body::Body;
use axum::http::{Request as HttpRequest, StatusCode};
use http_body_util::BodyExt;
use k8s_openapi::ByteString;
use kube::api::ObjectMeta;
use kube_sharding_api::{ClusterRing, ClusterRingSpec, ControllerRing, GroupResource, HashKey};
use serde_json::{Value, json};
use tower::ServiceExt;

use super::*;
use crate::core::hash_ring::HashRing;
use crate::metrics::Metrics;
use crate::views::{ResourceInfo, build_view};

const SHARD_LABEL: &str = "shard.alpha.sharding.timebertt.dev/clusterring-50d858e0-example";

/// Decodes a review for a test that keeps the request after the body it was decoded from: a
/// request borrows its strings from its body, so the body is leaked (a few bytes per test).
fn decode(body: &[u8]) -> Result<Request<'static>, BadRequest> {
    super::decode(Vec::leak(body.to_vec()))
}

/// A label key escaped as a JSON pointer segment, as the patch writer escapes it.
fn escape_pointer(segment: &str) -> String {
    let mut out = Vec::new();
    encode::push_pointer_segment(&mut out, segment);
    String::from_utf8(out).expect("utf-8")
}

fn state(shards: &[&str]) -> WebhookState {
    let ring = ClusterRing {
        metadata: ObjectMeta {
            name: Some("example".into()),
            ..Default::default()
        },
        spec: ClusterRingSpec::new([crate::test_rings::secrets_controlling_config_maps()]),
        status: None,
    };
    let info = ResourceInfo::core_namespaced;
    let discovered = HashMap::from([
        (GroupResource::new("", "secrets"), info("Secret")),
        (GroupResource::new("", "configmaps"), info("ConfigMap")),
    ]);
    let shards: BTreeMap<String, u32> = shards.iter().map(|s| (s.to_string(), 1)).collect();
    let views = Arc::new(Views::default());
    let selector = Default::default();
    // A ControllerRing of the same name, hashing by namespace, beside the ClusterRing.
    let mut controller_spec = ring.spec.clone();
    controller_spec.hash_key = Some(HashKey::Namespace);
    let controller_ring = ControllerRing::new("example", controller_spec.into());
    views.insert(build_view(&ring, &shards, &discovered, &selector));
    views.insert(build_view(
        &controller_ring,
        &shards,
        &discovered,
        &selector,
    ));
    WebhookState {
        views,
        metrics: Metrics::default(),
        client: None,
    }
}

fn review(resource: &str, kind: &str, object: Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": resource},
            "namespace": "default",
            "operation": "CREATE",
            "userInfo": {"username": "admin"},
            "object": object,
            "oldObject": null,
            "dryRun": false,
        }
    })
}

async fn call(state: WebhookState, path: &str, body: impl Into<Body>) -> (StatusCode, Vec<u8>) {
    let response = router(state)
        .oneshot(
            HttpRequest::post(path)
                .header("content-type", "application/json")
                .body(body.into())
                .expect("request"),
        )
        .await
        .expect("infallible");
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, bytes.to_vec())
}

const PATH: &str = "/webhooks/sharder/clusterring/example";

async fn admit(state: WebhookState, review: Value) -> Value {
    let (status, body) = call(state, PATH, review.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let body: Value = serde_json::from_slice(&body).expect("json response");
    assert_eq!(body["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(body["kind"], "AdmissionReview");
    assert_eq!(
        body["response"]["uid"],
        "705ab4f5-6393-11e8-b7cc-42010a800002"
    );
    body["response"].clone()
}

fn patch_of(response: &Value) -> Value {
    assert_eq!(response["patchType"], "JSONPatch");
    let bytes: ByteString =
        serde_json::from_value(response["patch"].clone()).expect("base64 patch");
    serde_json::from_slice(&bytes.0).expect("patch json")
}

#[tokio::test]
async fn assigns_main_object_to_predicted_shard() {
    let state = state(&["shard-a", "shard-b", "shard-c"]);
    let metrics = state.metrics.clone();
    let object =
        json!({"metadata": {"name": "foo", "namespace": "default", "labels": {"app": "x"}}});
    let response = admit(state, review("secrets", "Secret", object)).await;
    assert_eq!(response["allowed"], true);
    // docs/protocol.md §5 vector: /Secret/default/foo -> shard-a.
    assert_eq!(
        patch_of(&response),
        json!([{"op": "add", "path": format!("/metadata/labels/{}", SHARD_LABEL.replace('/', "~1")), "value": "shard-a"}])
    );
    let count = metrics
        .assignments
        .get_or_create(&Metrics::resource_labels(
            &RingRef::new(RingKind::ClusterRing, "example"),
            "",
            "secrets",
        ))
        .get();
    assert_eq!(count, 1);
}

#[tokio::test]
async fn creates_labels_map_when_missing() {
    let object = json!({"metadata": {"name": "foo", "namespace": "default"}});
    let response = admit(
        state(&["shard-a", "shard-b", "shard-c"]),
        review("secrets", "Secret", object),
    )
    .await;
    let patch = patch_of(&response);
    assert_eq!(
        patch[0],
        json!({"op": "add", "path": "/metadata/labels", "value": {}})
    );
    assert_eq!(patch[1]["value"], "shard-a");
}

#[tokio::test]
async fn assignment_removes_a_stale_drain_label() {
    let drain = kube_sharding_api::labels::drain_label("example");
    let object =
        json!({"metadata": {"name": "foo", "namespace": "default", "labels": {&drain: "true"}}});
    let response = admit(
        state(&["shard-a", "shard-b", "shard-c"]),
        review("secrets", "Secret", object),
    )
    .await;
    assert_eq!(
        patch_of(&response),
        json!([
            {"op": "add", "path": format!("/metadata/labels/{}", SHARD_LABEL.replace('/', "~1")), "value": "shard-a"},
            {"op": "remove", "path": format!("/metadata/labels/{}", drain.replace('/', "~1"))},
        ])
    );
}

#[tokio::test]
async fn controlled_object_follows_its_controller() {
    let state = state(&["shard-a", "shard-b", "shard-c"]);
    let expected = HashRing::new(["shard-a", "shard-b", "shard-c"])
        .shard_for("/Secret/default/foo")
        .map(str::to_string);
    let object = json!({"metadata": {
        "generateName": "checksums-",
        "namespace": "default",
        "ownerReferences": [
            {"apiVersion": "v1", "kind": "Secret", "name": "other", "uid": "u0"},
            {"apiVersion": "v1", "kind": "Secret", "name": "foo", "uid": "u1", "controller": true},
        ],
    }});
    let response = admit(state, review("configmaps", "ConfigMap", object)).await;
    let patch = patch_of(&response);
    assert_eq!(patch[1]["value"].as_str().map(str::to_string), expected);
}

#[tokio::test]
async fn controlled_object_without_controller_stays_unassigned() {
    let object = json!({"metadata": {"name": "cm", "namespace": "default",
        "ownerReferences": [{"apiVersion": "v1", "kind": "Secret", "name": "foo", "uid": "u1"}]}});
    let response = admit(
        state(&["shard-a"]),
        review("configmaps", "ConfigMap", object),
    )
    .await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none(), "{response}");
    let object = json!({"metadata": {"name": "cm", "namespace": "default",
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "d", "uid": "u1", "controller": true}]}});
    let response = admit(
        state(&["shard-a"]),
        review("configmaps", "ConfigMap", object),
    )
    .await;
    assert!(response.get("patch").is_none(), "{response}");
}

#[tokio::test]
async fn generate_name_on_main_resource_is_allowed_unassigned() {
    // Hashed by a name the API server has not chosen yet: never a denial, which would refuse the
    // user's write; the missed-assignment path assigns the object once it exists.
    let object = json!({"metadata": {"generateName": "foo-", "namespace": "default"}});
    let response = admit(state(&["shard-a"]), review("secrets", "Secret", object)).await;
    assert_eq!(response["allowed"], true, "{response}");
    assert!(response.get("patch").is_none(), "{response}");
    assert!(response.get("status").is_none(), "{response}");
}

#[tokio::test]
async fn allows_unchanged_when_nothing_to_do() {
    // Already assigned.
    let object = json!({"metadata": {"name": "foo", "namespace": "default", "labels": {SHARD_LABEL: "shard-b"}}});
    let response = admit(state(&["shard-a"]), review("secrets", "Secret", object)).await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none());
    // No available shard.
    let object = json!({"metadata": {"name": "foo", "namespace": "default"}});
    let response = admit(state(&[]), review("secrets", "Secret", object.clone())).await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none());
    // Resource not part of the ring.
    let response = admit(state(&["shard-a"]), review("pods", "Pod", object.clone())).await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none());
}

/// A path names a ring the sharder does not know: 404 before the body is read (a body over the
/// limit is not even looked at), and no metric series for the made-up name; the same for a name
/// longer than any ring's.
#[tokio::test]
async fn unknown_rings_are_not_found_and_not_measured() {
    let state = state(&["shard-a"]);
    let metrics = state.metrics.clone();
    let long = format!("/webhooks/sharder/clusterring/{}", "x".repeat(300));
    for path in ["/webhooks/sharder/clusterring/nope", long.as_str()] {
        let (status, body) = call(
            state.clone(),
            path,
            Body::from(vec![b' '; MAX_BODY_BYTES + 1]),
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(String::from_utf8_lossy(&body), UNKNOWN_RING);
    }
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let text = crate::metrics::render(&registry).expect("render");
    assert!(!text.contains("nope") && !text.contains("xxxx"), "{text}");
}

/// A 400 names what is wrong without repeating the request's content.
#[tokio::test]
async fn bad_request_answers_do_not_echo_the_request() {
    let state = state(&["shard-a"]);
    for body in [
        r#"{"apiVersion": "SECRET-VALUE", "kind": "AdmissionReview"}"#,
        r#"{"apiVersion": 7, "kind": "SECRET-VALUE"}"#,
        r#"{"apiVersion": "admission.k8s.io/v1", "kind": "SECRET-VALUE"}"#,
    ] {
        let (status, answer) = call(state.clone(), PATH, body).await;
        let text = String::from_utf8_lossy(&answer);
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        assert!(!text.contains("SECRET"), "{text}");
    }
}

#[tokio::test]
async fn dry_run_gets_the_same_answer_without_metrics() {
    let state = state(&["shard-a", "shard-b", "shard-c"]);
    let metrics = state.metrics.clone();
    let mut review = review(
        "secrets",
        "Secret",
        json!({"metadata": {"name": "foo", "namespace": "default"}}),
    );
    review["request"]["dryRun"] = json!(true);
    let response = admit(state, review).await;
    assert_eq!(patch_of(&response)[1]["value"], "shard-a");
    let count = metrics
        .assignments
        .get_or_create(&Metrics::resource_labels(
            &RingRef::new(RingKind::ClusterRing, "example"),
            "",
            "secrets",
        ))
        .get();
    assert_eq!(count, 0);
}

#[tokio::test]
async fn bad_input_gets_4xx_with_a_message() {
    let cases: Vec<(&str, Body, StatusCode, &str)> = vec![
        (
            PATH,
            Body::from("{not json"),
            StatusCode::BAD_REQUEST,
            "failed to decode AdmissionReview",
        ),
        (
            PATH,
            Body::empty(),
            StatusCode::BAD_REQUEST,
            "failed to decode AdmissionReview",
        ),
        (
            PATH,
            Body::from(r#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview"}"#),
            StatusCode::BAD_REQUEST,
            "expected an admission.k8s.io/v1 AdmissionReview",
        ),
        (
            PATH,
            Body::from(r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#),
            StatusCode::BAD_REQUEST,
            "no request",
        ),
        (
            "/other",
            Body::from("{}"),
            StatusCode::NOT_FOUND,
            "not found",
        ),
        (
            PATH,
            Body::from(vec![b' '; MAX_BODY_BYTES + 1]),
            StatusCode::PAYLOAD_TOO_LARGE,
            "",
        ),
    ];
    let state = state(&["shard-a"]);
    for (path, body, code, message) in cases {
        let (status, body) = call(state.clone(), path, body).await;
        let text = String::from_utf8_lossy(&body);
        assert_eq!(status, code, "{path}: {text}");
        assert!(text.contains(message), "{path}: {text}");
    }
    // The router keeps serving after bad input.
    let response = admit(
        state,
        review(
            "secrets",
            "Secret",
            json!({"metadata": {"name": "foo", "namespace": "default"}}),
        ),
    )
    .await;
    assert_eq!(response["allowed"], true);
}

#[test]
fn pointer_escaping() {
    assert_eq!(escape_pointer("a/b~c"), "a~1b~0c");
}

#[tokio::test]
async fn controller_ring_path_uses_its_label_and_namespace_keys() {
    let state = state(&["shard-a", "shard-b", "shard-c"]);
    let metrics = state.metrics.clone();
    let expected = HashRing::new(["shard-a", "shard-b", "shard-c"])
        .shard_for("/Namespace//default")
        .expect("a shard")
        .to_string();
    // Two objects in one namespace land on the namespace's shard, a generateName one included.
    for object in [
        json!({"metadata": {"name": "foo", "namespace": "default"}}),
        json!({"metadata": {"generateName": "foo-", "namespace": "default"}}),
    ] {
        let body = review("secrets", "Secret", object).to_string();
        let (status, body) = call(
            state.clone(),
            "/webhooks/sharder/controllerring/example",
            body,
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let body: Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(body["response"]["allowed"], true);
        assert_eq!(
            patch_of(&body["response"]),
            json!([
                {"op": "add", "path": "/metadata/labels", "value": {}},
                {"op": "add", "path": "/metadata/labels/shard.alpha.sharding.timebertt.dev~1example", "value": expected},
            ])
        );
    }
    let count = metrics
        .assignments
        .get_or_create(&Metrics::resource_labels(
            &RingRef::new(RingKind::ControllerRing, "example"),
            "",
            "secrets",
        ))
        .get();
    assert_eq!(count, 2);
}

#[tokio::test]
async fn unknown_ring_kind_is_not_found() {
    let body = review("secrets", "Secret", json!({"metadata": {"name": "foo"}})).to_string();
    let (status, body) = call(state(&["shard-a"]), "/webhooks/sharder/ring/example", body).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(String::from_utf8_lossy(&body).contains("controllerring"));
}

/// Right after the ring changed, a child whose controller an earlier ring placed elsewhere is
/// labelled only after its controller is read; its controller and objects of a ring that did
/// not change cost no read.
#[test]
fn a_child_of_a_controller_that_may_be_moving_asks_for_its_controller() {
    let state = state(&["shard-a", "shard-b", "shard-c"]);
    let ring = RingRef::new(RingKind::ClusterRing, "example");
    let child = |name: &str| {
        let object = json!({"metadata": {
            "name": format!("checksums-{name}"),
            "namespace": "default",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Secret", "name": name, "uid": "u1", "controller": true},
            ],
        }});
        let body = serde_json::to_vec(&review("configmaps", "ConfigMap", object)).expect("json");
        decode(&body).ok().expect("decodes")
    };
    // A controller the current ring does not place on shard-a.
    let current = HashRing::new(["shard-a", "shard-b", "shard-c"]);
    let moved = (0..100)
        .map(|i| format!("s-{i}"))
        .find(|n| current.shard_for(&format!("/Secret/default/{n}")) != Some("shard-a"))
        .expect("some key is not on shard-a");
    assert!(
        decide(&state, &ring, &child(&moved)).1.is_none(),
        "no ring change, no read"
    );

    // The ring had only shard-a until now: every controller elsewhere may still sit there.
    let shards = BTreeMap::from([
        ("shard-a".to_string(), 1),
        ("shard-b".to_string(), 1),
        ("shard-c".to_string(), 1),
    ]);
    let mut view = build_view(
        &crate::test_rings::secrets_ring("example"),
        &shards,
        &HashMap::from([
            (
                GroupResource::new("", "secrets"),
                ResourceInfo::core_namespaced("Secret"),
            ),
            (
                GroupResource::new("", "configmaps"),
                ResourceInfo::core_namespaced("ConfigMap"),
            ),
        ]),
        &Default::default(),
    );
    view.earlier = vec![(HashRing::new(["shard-a"]), std::time::Instant::now())];
    state.views.insert(view);
    let (decision, lookup, _) = decide(&state, &ring, &child(&moved));
    assert!(matches!(decision, AdmissionDecision::Assign { .. }));
    let lookup = lookup.expect("the controller is read");
    assert_eq!(
        (
            lookup.resource.plural.as_str(),
            lookup.resource.kind.as_str()
        ),
        ("secrets", "Secret")
    );
    assert_eq!(lookup.namespace.as_deref(), Some("default"));
    assert_eq!(lookup.name, moved);
    // The controller itself is placed by the ring, unread.
    let main = json!({"metadata": {"name": moved, "namespace": "default"}});
    let body = serde_json::to_vec(&review("secrets", "Secret", main)).expect("json");
    let request = decode(&body).ok().expect("decodes");
    assert!(decide(&state, &ring, &request).1.is_none());
}

/// Only an `admission.k8s.io/v1` AdmissionReview is read, however its strings are escaped; the
/// answer to any other names what was expected, not what came.
#[test]
fn decode_accepts_only_v1_admission_reviews() {
    let request = r#"{"uid":"u","kind":{"kind":"Secret"},"resource":{"resource":"secrets"}}"#;
    let body = |api_version: &str, kind: &str| {
        format!(r#"{{"apiVersion":{api_version},"kind":{kind},"request":{request}}}"#)
    };
    let escaped = body(r#""admission.k8s.io\/v1""#, r#""Admission\u0052eview""#);
    assert!(super::decode(escaped.as_bytes()).is_ok());
    for (api_version, kind, message) in [
        (
            r#""admission.k8s.io/v1beta1""#,
            r#""AdmissionReview""#,
            "expected an admission.k8s.io/v1 AdmissionReview",
        ),
        (
            r#""admission.k8s.io/v1""#,
            r#""AdmissionReviewList""#,
            "expected an admission.k8s.io/v1 AdmissionReview",
        ),
        (
            r#""v1""#,
            r#""AdmissionReview""#,
            "expected an admission.k8s.io/v1 AdmissionReview",
        ),
        (
            r#""""#,
            r#""""#,
            "expected an admission.k8s.io/v1 AdmissionReview",
        ),
        (
            "null",
            r#""AdmissionReview""#,
            "failed to decode AdmissionReview",
        ),
        (
            "1",
            r#""AdmissionReview""#,
            "failed to decode AdmissionReview",
        ),
    ] {
        let body = body(api_version, kind);
        let Err(BadRequest(text)) = super::decode(body.as_bytes()) else {
            panic!("{body} decoded");
        };
        assert!(text.starts_with(message), "{body}: {text}");
        assert!(!text.contains("beta") && !text.contains("List"), "{text}");
    }
}

mod pins;
