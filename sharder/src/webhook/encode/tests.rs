use k8s_openapi::ByteString;
use serde_json::{Value, json};

use super::*;

/// Strings that need every kind of escape, and some that need none.
fn awkward_strings() -> Vec<String> {
    let mut strings: Vec<String> = [
        "",
        "plain",
        "shard.alpha.sharding.timebertt.dev/clusterring-50d858e0-example",
        "quote\"backslash\\slash/tilde~",
        "\n\r\t\u{8}\u{c}\u{0}\u{1f}\u{7f}",
        "é😀\u{2028}",
    ]
    .map(String::from)
    .to_vec();
    strings.push((0u8..0x80).map(char::from).collect());
    strings
}

#[test]
fn strings_are_escaped_as_serde_json_escapes_them() {
    for text in awkward_strings() {
        let mut out = Vec::new();
        push_string(&mut out, &text);
        assert_eq!(
            String::from_utf8(out).expect("utf-8"),
            serde_json::to_string(&text).expect("json"),
            "{text:?}"
        );
    }
}

#[test]
fn pointer_segments_escape_tilde_and_slash() {
    let segment = |s: &str| {
        let mut out = Vec::new();
        push_pointer_segment(&mut out, s);
        String::from_utf8(out).expect("utf-8")
    };
    assert_eq!(segment("a/b~c"), "a~1b~0c");
    assert_eq!(segment("~/~1/"), "~0~1~01~1");
    assert_eq!(segment("/"), "~1");
    assert_eq!(segment(""), "");
    // Escaped for JSON too.
    assert_eq!(segment("a\"b/c"), "a\\\"b~1c");
}

#[test]
fn base64_matches_the_api_types() {
    let data: Vec<u8> = (0..=255u8).rev().chain(0..=255).collect();
    for len in (0..=12).chain([255, 256, 257, 512]) {
        let bytes = &data[..len];
        let mut out = Vec::new();
        push_base64(&mut out, bytes);
        let expected = serde_json::to_value(ByteString(bytes.to_vec())).expect("base64");
        assert_eq!(
            Value::from(String::from_utf8(out).expect("ascii")),
            expected,
            "{len} bytes"
        );
        assert_eq!(base64_len(len), expected.as_str().map_or(0, str::len));
    }
}

/// The patch as the webhook built it before, from JSON values.
fn patch_from_values(label: &str, value: &str, create: bool, remove: Option<&str>) -> Value {
    let escape = |s: &str| s.replace('~', "~0").replace('/', "~1");
    let mut ops = Vec::new();
    if create {
        ops.push(json!({"op": "add", "path": "/metadata/labels", "value": {}}));
    }
    ops.push(
        json!({"op": "add", "path": format!("/metadata/labels/{}", escape(label)), "value": value}),
    );
    if let Some(remove) = remove {
        ops.push(json!({"op": "remove", "path": format!("/metadata/labels/{}", escape(remove))}));
    }
    Value::from(ops)
}

#[test]
fn patches_read_back_as_the_operations_they_name() {
    let labels = [
        "shard.alpha.sharding.timebertt.dev/clusterring-50d858e0-example",
        "a~b/c~/d",
        "quote\"and\\",
    ];
    for label in labels {
        for create in [false, true] {
            for remove in [
                None,
                Some("drain.alpha.sharding.timebertt.dev/x"),
                Some("~/\""),
            ] {
                let bytes = label_patch(label, "shard-\"a\"", create, remove);
                let patch: Value = serde_json::from_slice(&bytes).expect("JSON");
                assert_eq!(
                    patch,
                    patch_from_values(label, "shard-\"a\"", create, remove),
                    "{}",
                    String::from_utf8_lossy(&bytes)
                );
            }
        }
    }
}

#[test]
fn answers_read_back_as_admission_reviews() {
    let allowed: Value =
        serde_json::from_slice(&allowed_review("705ab4f5-6393", None, &[])).expect("JSON");
    assert_eq!(
        allowed,
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": "705ab4f5-6393", "allowed": true},
        })
    );

    let warned: Value = serde_json::from_slice(&allowed_review(
        "u1",
        None,
        &["pin \"x\" is\nodd".to_string(), "second".to_string()],
    ))
    .expect("JSON");
    assert_eq!(
        warned["response"]["warnings"],
        json!(["pin \"x\" is\nodd", "second"])
    );

    let patch = label_patch("a/b", "s", true, None);
    let body = allowed_review("u\"\\\n1", Some(&patch), &[]);
    let answer: Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(
        answer,
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {
                "uid": "u\"\\\n1",
                "allowed": true,
                "patchType": "JSONPatch",
                "patch": serde_json::to_value(ByteString(patch.clone())).expect("base64"),
            },
        })
    );
}

/// Each vector is sized up front: writing an answer never grows it.
#[test]
fn answers_fit_their_first_allocation() {
    let labels = [
        "shard.alpha.sharding.timebertt.dev/clusterring-50d858e0-example",
        "a/b/c/d",
        "~~~~",
        "x",
    ];
    for label in labels {
        for create in [false, true] {
            for remove in [
                None,
                Some("drain.alpha.sharding.timebertt.dev/x"),
                Some("~/~/"),
            ] {
                let patch = label_patch(label, "shard-0", create, remove);
                assert!(
                    patch.len() <= patch_capacity(label, "shard-0", remove),
                    "{label}"
                );
                let uid = "705ab4f5-6393-11e8-b7cc-42010a800002";
                let body = allowed_review(uid, Some(&patch), &[]);
                assert_eq!(body.len(), review_capacity(uid, Some(&patch)));
                assert_eq!(
                    allowed_review(uid, None, &[]).len(),
                    review_capacity(uid, None)
                );
            }
        }
    }
}
