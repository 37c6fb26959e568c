//! Benchmarks of the admission webhook handler, in-process: an `AdmissionReview` request through
//! the axum router to the response body, without sockets or TLS.
//!
//! Three kinds of request reach the webhook: an unassigned main object (decoded, hashed, patched),
//! an unassigned controlled object (the key comes from its controller reference) and an object
//! that already carries the shard label (answered unchanged). Each runs against rings of 3 and 100
//! shards; the view is prebuilt, as the sharder rebuilds it only when membership changes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use http_body_util::BodyExt;
use kube::api::ObjectMeta;
use kube_sharder::metrics::Metrics;
use kube_sharder::views::{ResourceInfo, Views, build_view};
use kube_sharder::webhook::{WebhookState, router};
use kube_sharding_api::labels;
use kube_sharding_api::{ClusterRing, ClusterRingSpec, GroupResource, RingResource};
use serde_json::{Value, json};
use tower::ServiceExt;

const RING: &str = "example";
const SHARD_COUNTS: [usize; 2] = [3, 100];

/// Webhook state with one ring over Secrets (controlling ConfigMaps) and `shards` available shards.
fn state(shards: usize) -> WebhookState {
    let ring = ClusterRing {
        metadata: ObjectMeta {
            name: Some(RING.into()),
            generation: Some(1),
            ..Default::default()
        },
        spec: ClusterRingSpec::new([RingResource::controlling(
            "",
            "secrets",
            [GroupResource::new("", "configmaps")],
        )]),
        status: None,
    };
    let info = ResourceInfo::core_namespaced;
    let discovered = HashMap::from([
        (GroupResource::new("", "secrets"), info("Secret")),
        (GroupResource::new("", "configmaps"), info("ConfigMap")),
    ]);
    let shards: BTreeMap<String, u32> = (0..shards).map(|i| (format!("shard-{i}"), 1)).collect();
    let views = Arc::new(Views::default());
    views.insert(build_view(&ring, &shards, &discovered, &Default::default()));
    WebhookState {
        views,
        metrics: Metrics::default(),
        client: None,
    }
}

/// A CREATE review as the API server sends it, with a Secret-sized object.
fn review(resource: &str, kind: &str, metadata: Value) -> Bytes {
    let body = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": resource},
            "requestKind": {"group": "", "version": "v1", "kind": kind},
            "requestResource": {"group": "", "version": "v1", "resource": resource},
            "name": metadata["name"],
            "namespace": "default",
            "operation": "CREATE",
            "userInfo": {"username": "system:admin", "groups": ["system:masters", "system:authenticated"]},
            "object": {
                "apiVersion": "v1",
                "kind": kind,
                "metadata": metadata,
                "data": {"user": "YWRtaW4=", "password": "aHVudGVyMg=="},
            },
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        }
    });
    Bytes::from(body.to_string())
}

/// The three requests, by name.
fn requests() -> [(&'static str, Bytes); 3] {
    let shard_label = labels::shard_label(RING);
    [
        (
            "main_assign",
            review(
                "secrets",
                "Secret",
                json!({"name": "foo", "namespace": "default", "labels": {"app": "bench"}}),
            ),
        ),
        (
            "controlled_assign",
            review(
                "configmaps",
                "ConfigMap",
                json!({
                    "name": "checksums-foo",
                    "namespace": "default",
                    "labels": {"app": "bench"},
                    "ownerReferences": [{
                        "apiVersion": "v1", "kind": "Secret", "name": "foo",
                        "uid": "6f0b1c9e-0000-4000-8000-000000000001", "controller": true,
                    }],
                }),
            ),
        ),
        (
            "already_assigned",
            review(
                "secrets",
                "Secret",
                json!({"name": "foo", "namespace": "default",
                       "labels": {"app": "bench", shard_label: "shard-0"}}),
            ),
        ),
    ]
}

/// One request through the router, body read to the end.
async fn call(app: Router, body: Bytes) -> Bytes {
    let request = Request::post(format!("/webhooks/sharder/clusterring/{RING}"))
        .header("content-type", "application/json")
        .body(Body::from(body))
        .expect("valid request");
    let response = app.oneshot(request).await.expect("infallible router");
    assert_eq!(response.status(), StatusCode::OK);
    response
        .into_body()
        .collect()
        .await
        .expect("response body")
        .to_bytes()
}

fn webhook(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime");
    let mut group = c.benchmark_group("webhook");
    for shards in SHARD_COUNTS {
        // One router per ring size, cloned per request as the server does per connection.
        let app = router(state(shards));
        for (name, body) in requests() {
            // Make sure the case does what its name says before timing it.
            let response: Value =
                serde_json::from_slice(&runtime.block_on(call(app.clone(), body.clone())))
                    .expect("JSON response");
            assert_eq!(
                response["response"].get("patch").is_some(),
                name != "already_assigned",
                "{name}: {response}"
            );
            group.bench_with_input(BenchmarkId::new(name, shards), &body, |b, body| {
                b.to_async(&runtime)
                    .iter(|| call(app.clone(), body.clone()));
            });
        }
    }
    group.finish();
}

criterion_group!(benches, webhook);
criterion_main!(benches);
