use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use serde_json::{Value, json};

use super::*;

fn review(request: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": request,
    }))
    .expect("json")
}

fn request_of(body: &[u8]) -> Request<'_> {
    let review: Review<'_> = serde_json::from_slice(body).expect("decodes");
    review.request.expect("a request")
}

fn minimal(object: Value) -> Value {
    json!({
        "uid": "u1",
        "kind": {"group": "", "version": "v1", "kind": "Secret"},
        "resource": {"group": "", "version": "v1", "resource": "secrets"},
        "object": object,
    })
}

/// Whether `text` points into `body`: borrowed, not copied.
fn borrows_from(text: &Text<'_>, body: &[u8]) -> bool {
    matches!(text.0, Cow::Borrowed(_)) && body.as_ptr_range().contains(&text.as_str().as_ptr())
}

#[test]
fn reads_the_fields_the_decision_needs_borrowed() {
    let body = review(json!({
        "uid": "705ab4f5",
        "kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
        "resource": {"group": "apps", "version": "v1", "resource": "deployments"},
        "subResource": "status",
        "namespace": "team-a",
        "dryRun": true,
        "object": {"metadata": {
            "name": "web",
            "namespace": "team-b",
            "labels": {"app": "web", "tier": "front"},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Secret", "name": "other", "uid": "u0"},
                {"apiVersion": "example.com/v1", "kind": "Site", "name": "s", "uid": "u1", "controller": true},
                {"apiVersion": "v1", "kind": "Secret", "name": "second", "uid": "u2", "controller": true},
            ],
        }},
    }));
    let request = request_of(&body);
    assert_eq!(request.uid.as_str(), "705ab4f5");
    assert!(borrows_from(&request.uid, &body));
    assert_eq!(
        (request.kind.group.as_str(), request.kind.kind.as_str()),
        ("apps", "Deployment")
    );
    assert_eq!(
        (
            request.resource.group.as_str(),
            request.resource.resource.as_str()
        ),
        ("apps", "deployments")
    );
    assert_eq!(request.sub_resource.as_deref(), Some("status"));
    assert_eq!(request.namespace.as_deref(), Some("team-a"));
    assert_eq!(request.dry_run, Some(true));
    let meta = request.object.expect("object").metadata;
    assert_eq!(meta.name.as_deref(), Some("web"));
    assert_eq!(meta.namespace.as_deref(), Some("team-b"));
    let labels = meta.labels.expect("labels");
    assert_eq!(labels.get("app"), Some("web"));
    assert_eq!(labels.get("tier"), Some("front"));
    assert_eq!(labels.get("missing"), None);
    assert!(
        labels
            .0
            .iter()
            .all(|(k, v)| borrows_from(k, &body) && borrows_from(v, &body))
    );
    // The first controller only.
    let controller = meta
        .controller
        .expect("owner references")
        .0
        .expect("a controller");
    assert_eq!(controller.api_version.as_str(), "example.com/v1");
    assert_eq!(controller.kind.as_str(), "Site");
    assert_eq!(controller.name.as_str(), "s");
    assert!(borrows_from(&controller.name, &body));
}

#[test]
fn unknown_fields_are_ignored_at_every_level() {
    let body = review(json!({
        "uid": "u1",
        "kind": {"group": "", "version": "v1", "kind": "Secret", "extra": [1, {"a": null}]},
        "resource": {"group": "", "version": "v1", "resource": "secrets", "extra": true},
        "operation": "CREATE",
        "userInfo": {"username": "admin", "groups": ["a", "b"], "extra": {"k": ["v"]}},
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        "oldObject": {"metadata": {"name": "old", "labels": {"x": "y"}}},
        "future": {"nested": [[[]]]},
        "object": {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "data": {"k": "dg=="},
            "metadata": {
                "name": "foo",
                "uid": "x",
                "generateName": "foo-",
                "annotations": {"a": "b"},
                "finalizers": ["f"],
                "ownerReferences": [{"apiVersion": "v1", "kind": "Secret", "name": "n",
                    "uid": "u", "controller": true, "blockOwnerDeletion": true, "future": {}}],
            },
        },
    }));
    let request = request_of(&body);
    let meta = request.object.expect("object").metadata;
    assert_eq!(meta.name.as_deref(), Some("foo"));
    assert!(meta.labels.is_none());
    assert_eq!(
        meta.controller.and_then(|c| c.0).map(|c| c.name),
        Some(Text(Cow::Borrowed("n")))
    );
}

#[test]
fn huge_fields_are_skipped_without_copies() {
    let payload = "x".repeat(4 << 20);
    let managed: Vec<Value> = (0..2000)
        .map(|i| json!({"manager": format!("m{i}"), "fieldsV1": {"f:data": {"f:k": {}}}}))
        .collect();
    let body = review(minimal(json!({
        "data": {"payload": payload, "escaped": "a\"b\\c\u{1}".repeat(1000)},
        "metadata": {"name": "foo", "managedFields": managed},
    })));
    assert!(body.len() > 4 << 20);
    let request = request_of(&body);
    let meta = request.object.expect("object").metadata;
    assert_eq!(meta.name.as_deref(), Some("foo"));
    assert!(borrows_from(meta.name.as_ref().expect("name"), &body));
}

#[test]
fn escaped_strings_are_unescaped() {
    // Written by hand: serde_json would not escape `/` itself.
    let body = br#"{"apiVersion":"admission.k8s.io\/v1","kind":"AdmissionReview","request":{
        "uid":"u\u0031","kind":{"kind":"Secret"},"resource":{"resource":"secrets"},
        "object":{"metadata":{"name":"f\u006fo","namespace":"n\"s",
            "labels":{"shard.alpha.sharding.timebertt.dev\u002fexample":"shard-\u0061",
                      "plain":"v","tab\t":"\u00e9\ud83d\ude00"},
            "ownerReferences":[{"apiVersion":"apps\/v1","kind":"Deployment","name":"w\u0065b",
                "uid":"\u0075","controller":true}]}}}}"#;
    let review: Review<'_> = serde_json::from_slice(body).expect("decodes");
    assert_eq!(review.api_version.as_str(), "admission.k8s.io/v1");
    let request = review.request.expect("request");
    assert_eq!(request.uid.as_str(), "u1");
    assert!(!borrows_from(&request.uid, body));
    let meta = request.object.expect("object").metadata;
    assert_eq!(meta.name.as_deref(), Some("foo"));
    assert_eq!(meta.namespace.as_deref(), Some("n\"s"));
    let labels = meta.labels.expect("labels");
    assert_eq!(
        labels.get("shard.alpha.sharding.timebertt.dev/example"),
        Some("shard-a")
    );
    assert_eq!(labels.get("tab\t"), Some("é😀"));
    assert_eq!(labels.get("plain"), Some("v"));
    let controller = meta.controller.and_then(|c| c.0).expect("controller");
    assert_eq!(controller.api_version.as_str(), "apps/v1");
    assert_eq!(controller.name.as_str(), "web");
}

#[test]
fn missing_optional_fields() {
    let body = review(json!({
        "uid": "u1",
        "kind": {"kind": "Secret"},
        "resource": {"resource": "secrets"},
    }));
    let request = request_of(&body);
    assert_eq!(request.kind.group.as_str(), "");
    assert_eq!(request.resource.group.as_str(), "");
    assert!(request.sub_resource.is_none() && request.namespace.is_none());
    assert!(request.object.is_none() && request.dry_run.is_none());

    // Nulls count as absent; an object without metadata has empty metadata.
    let body = review(json!({
        "uid": "u1",
        "kind": {"kind": "Secret"},
        "resource": {"resource": "secrets"},
        "subResource": null,
        "namespace": null,
        "dryRun": null,
        "object": {},
    }));
    let request = request_of(&body);
    assert!(request.sub_resource.is_none() && request.namespace.is_none());
    let meta = request.object.expect("object").metadata;
    assert!(meta.name.is_none() && meta.labels.is_none() && meta.controller.is_none());

    let body = review(minimal(json!({"metadata": {
        "name": null, "labels": null, "ownerReferences": null,
    }})));
    let meta = request_of(&body).object.expect("object").metadata;
    assert!(meta.name.is_none() && meta.labels.is_none() && meta.controller.is_none());
    let body = review(minimal(Value::Null));
    assert!(request_of(&body).object.is_none());
}

#[test]
fn owner_references_read_like_the_api_types() {
    // Missing strings are empty, a repeated field's last value counts, nulls are absent.
    let owners = json!([
        {"kind": "Secret", "controller": false},
        {"apiVersion": null, "name": "a", "name": "b", "controller": true},
        {"name": "c", "controller": true},
    ]);
    let text = owners
        .to_string()
        .replace(r#""name":"a""#, r#""name":"a","name":"b""#);
    let body = format!(
        r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"u","kind":{{"kind":"ConfigMap"}},"resource":{{"resource":"configmaps"}},"object":{{"metadata":{{"ownerReferences":{text}}}}}}}}}"#
    );
    let request = request_of(body.as_bytes());
    let controller = request
        .object
        .expect("object")
        .metadata
        .controller
        .and_then(|c| c.0)
        .expect("controller");
    let expected: Vec<OwnerReference> = serde_json::from_str(&text).expect("api types");
    assert_eq!(controller.to_owner_reference(), expected[1]);
    assert_eq!(controller.api_version.as_str(), "");
    assert_eq!(controller.name.as_str(), "b");

    // No controller among them.
    let body = review(minimal(json!({"metadata": {"ownerReferences": [
        {"apiVersion": "v1", "kind": "Secret", "name": "n", "uid": "u"},
    ]}})));
    let meta = request_of(&body).object.expect("object").metadata;
    assert!(meta.controller.expect("owner references").0.is_none());
}

/// What the owned types refused is refused: values of the wrong type, wherever they are read.
#[test]
fn wrong_types_are_refused_like_the_api_types() {
    let objects = [
        json!({"metadata": null}),
        json!({"metadata": {"name": 1}}),
        json!({"metadata": {"labels": {"a": null}}}),
        json!({"metadata": {"labels": {"a": 1}}}),
        json!({"metadata": {"labels": ["a"]}}),
        json!({"metadata": {"ownerReferences": {}}}),
        json!({"metadata": {"ownerReferences": [null]}}),
        json!({"metadata": {"ownerReferences": [{"uid": 1}]}}),
        json!({"metadata": {"ownerReferences": [{"controller": "true"}]}}),
        json!({"metadata": {"ownerReferences": [{"blockOwnerDeletion": 1}]}}),
        json!({"metadata": {"ownerReferences": [{"name": []}]}}),
        json!("object"),
    ];
    for object in objects {
        let body = review(minimal(object.clone()));
        assert!(
            serde_json::from_slice::<Review<'_>>(&body).is_err(),
            "{object}"
        );
        // The owned types agree.
        let owned = serde_json::from_value::<OwnedObject>(object.clone());
        assert!(owned.is_err(), "{object}");
    }
    for request in [
        json!({"uid": 1, "kind": {"kind": "S"}, "resource": {"resource": "s"}}),
        json!({"kind": {"kind": "S"}, "resource": {"resource": "s"}}),
        json!({"uid": "u", "resource": {"resource": "s"}}),
        json!({"uid": "u", "kind": {"kind": "S"}, "resource": {}}),
        json!({"uid": "u", "kind": {"kind": "S"}, "resource": {"resource": "s"}, "dryRun": "yes"}),
    ] {
        let body = review(request.clone());
        assert!(
            serde_json::from_slice::<Review<'_>>(&body).is_err(),
            "{request}"
        );
    }
}

/// The owned shape the decoder replaces, to compare what each refuses.
#[derive(serde::Deserialize)]
#[allow(dead_code)]
struct OwnedObject {
    #[serde(default)]
    metadata: OwnedMeta,
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct OwnedMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    owner_references: Option<Vec<OwnerReference>>,
}

#[test]
fn a_label_given_twice_counts_with_its_last_value() {
    let body = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{
        "uid":"u","kind":{"kind":"Secret"},"resource":{"resource":"secrets"},
        "object":{"metadata":{"labels":{"a":"1","b":"x","a":"2"}}}}}"#;
    let labels = request_of(body)
        .object
        .expect("object")
        .metadata
        .labels
        .expect("labels");
    let owned: BTreeMap<String, String> =
        serde_json::from_str(r#"{"a":"1","b":"x","a":"2"}"#).expect("map");
    assert_eq!(labels.get("a"), owned.get("a").map(String::as_str));
    assert!(labels.contains_key("b") && !labels.contains_key("c"));
}
