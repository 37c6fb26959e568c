//! Pins in the webhook's answer (docs/protocol.md §21).

use k8s_openapi::api::core::v1::Namespace;

use super::*;

const PIN: &str = "pin.alpha.sharding.timebertt.dev/clusterring-50d858e0-example";

/// [`state`] whose views read namespace pins from `namespaces` (name, pin of the ClusterRing
/// `example`).
fn pinned_state(shards: &[&str], namespaces: &[(&str, &str)]) -> WebhookState {
    let (store, mut writer) = kube::runtime::reflector::store::<Namespace>();
    for (name, pin) in namespaces {
        let mut ns = Namespace::default();
        ns.metadata.name = Some((*name).into());
        ns.metadata.annotations = Some([(PIN.to_string(), (*pin).to_string())].into());
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(ns));
    }
    let pins = crate::views::Pins::new(store);
    let state = state(shards);
    for view in state.views.all() {
        let mut rebuilt = build_view(
            &ClusterRing::new(&view.name, Default::default()),
            &BTreeMap::new(),
            &HashMap::new(),
            &Default::default(),
        );
        // Copy the view with the shared pins: every field the webhook reads.
        rebuilt.kind = view.kind;
        rebuilt.shard_label = view.shard_label.clone();
        rebuilt.drain_label = view.drain_label.clone();
        rebuilt.pin_annotation = view.pin_annotation.clone();
        rebuilt.hash_ring = view.hash_ring.clone();
        rebuilt.hash_key = view.hash_key;
        rebuilt.resources = view.resources.clone();
        rebuilt.pins = pins.clone();
        state.views.insert(rebuilt);
    }
    state
}

fn secret(name: &str, annotations: Value) -> Value {
    json!({"metadata": {"name": name, "namespace": "default", "annotations": annotations}})
}

fn assigned_shard(response: &Value) -> String {
    patch_of(response)[1]["value"]
        .as_str()
        .expect("an assigning patch")
        .to_string()
}

/// A name the hash ring of `shards` does not place on `avoid`.
fn name_not_on(shards: &[&str], avoid: &str) -> String {
    let ring = HashRing::new(shards.iter().copied());
    (0..)
        .map(|i| format!("s{i}"))
        .find(|n| ring.shard_for(&format!("/Secret/default/{n}")) != Some(avoid))
        .expect("a name")
}

#[tokio::test]
async fn an_object_pin_to_an_available_shard_decides() {
    let shards = ["shard-a", "shard-b", "shard-c"];
    let name = name_not_on(&shards, "shard-b");
    let state = pinned_state(&shards, &[]);
    let response = admit(
        state,
        review(
            "secrets",
            "Secret",
            secret(&name, json!({PIN: "shard-b", "other": "x\"y"})),
        ),
    )
    .await;
    assert_eq!(assigned_shard(&response), "shard-b");
    assert!(response.get("warnings").is_none(), "{response}");
}

#[tokio::test]
async fn a_namespace_pin_decides_for_objects_without_their_own() {
    let shards = ["shard-a", "shard-b", "shard-c"];
    let name = name_not_on(&shards, "shard-c");
    let state = pinned_state(&shards, &[("default", "shard-c")]);
    let response = admit(
        state.clone(),
        review("secrets", "Secret", secret(&name, json!({}))),
    )
    .await;
    assert_eq!(assigned_shard(&response), "shard-c");
    // The object's own pin is more specific.
    let response = admit(
        state,
        review("secrets", "Secret", secret(&name, json!({PIN: "shard-a"}))),
    )
    .await;
    assert_eq!(assigned_shard(&response), "shard-a");
}

#[tokio::test]
async fn unavailable_and_malformed_pins_fall_back_with_a_warning() {
    let shards = ["shard-a", "shard-b"];
    let expected = HashRing::new(shards)
        .shard_for("/Secret/default/foo")
        .map(str::to_string);
    for (value, says) in [
        ("shard-z", "not available"),
        ("not a shard!", "not a shard name"),
    ] {
        let state = pinned_state(&shards, &[]);
        let response = admit(
            state,
            review("secrets", "Secret", secret("foo", json!({PIN: value}))),
        )
        .await;
        assert_eq!(Some(assigned_shard(&response)), expected, "{value}");
        let warnings = response["warnings"].as_array().expect("warnings");
        assert_eq!(warnings.len(), 1, "{response}");
        assert!(
            warnings[0].as_str().is_some_and(|w| w.contains(says)),
            "{value}: {warnings:?}"
        );
    }
}

#[tokio::test]
async fn a_child_follows_its_controllers_pin_and_ignores_its_own() {
    let shards = ["shard-a", "shard-b", "shard-c"];
    let controller = name_not_on(&shards, "shard-a");
    let state = pinned_state(&shards, &[]);
    let response = admit(
        state.clone(),
        review(
            "secrets",
            "Secret",
            secret(&controller, json!({PIN: "shard-a"})),
        ),
    )
    .await;
    assert_eq!(assigned_shard(&response), "shard-a");
    let child = json!({"metadata": {
        "name": "child",
        "namespace": "default",
        "annotations": {PIN: "shard-c"},
        "ownerReferences": [
            {"apiVersion": "v1", "kind": "Secret", "name": controller, "uid": "u1", "controller": true},
        ],
    }});
    let response = admit(state, review("configmaps", "ConfigMap", child)).await;
    assert_eq!(assigned_shard(&response), "shard-a");
    let warnings = response["warnings"].as_array().expect("warnings");
    assert!(
        warnings[0]
            .as_str()
            .is_some_and(|w| w.contains("follows its controller")),
        "{warnings:?}"
    );
}

#[tokio::test]
async fn a_dry_run_pin_is_answered_but_not_remembered() {
    let shards = ["shard-a", "shard-b", "shard-c"];
    let controller = name_not_on(&shards, "shard-a");
    let state = pinned_state(&shards, &[]);
    let mut dry_run = review(
        "secrets",
        "Secret",
        secret(&controller, json!({PIN: "shard-a"})),
    );
    dry_run["request"]["dryRun"] = json!(true);
    let response = admit(state.clone(), dry_run).await;
    assert_eq!(assigned_shard(&response), "shard-a");
    // The ClusterRing's view: the state also holds a ControllerRing of the same name, and the
    // views come in no fixed order.
    let view = state
        .views
        .all()
        .into_iter()
        .find(|view| view.kind == kube_sharding_api::RingKind::ClusterRing)
        .expect("the ClusterRing's view");
    // Nothing a dry run sends is kept: the children of an object that does not exist follow
    // the ring.
    assert_eq!(view.pins.remembered(&view.ring_ref()), 0);
    let response = admit(
        state.clone(),
        review(
            "secrets",
            "Secret",
            secret(&controller, json!({PIN: "shard-a"})),
        ),
    )
    .await;
    assert_eq!(assigned_shard(&response), "shard-a");
    assert_eq!(view.pins.remembered(&view.ring_ref()), 1);
}

/// A client whose API server answers nothing useful; it records the path of every request.
fn recording_client() -> (kube::Client, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    let paths = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = paths.clone();
    let service = tower::service_fn(move |request: HttpRequest<kube::client::Body>| {
        seen.lock()
            .expect("paths")
            .push(request.uri().path().to_string());
        async move {
            axum::http::Response::builder()
                .status(404)
                .body(kube::client::Body::empty())
        }
    });
    (kube::Client::new(service, "default"), paths)
}

#[tokio::test]
async fn a_crafted_controller_reference_makes_no_request() {
    let shards = ["shard-a", "shard-b", "shard-c"];
    for (controller, requests) in [("parent", 1), ("../../../api/v1/secrets", 0)] {
        let (client, paths) = recording_client();
        let mut state = pinned_state(&shards, &[]);
        state.client = Some(client);
        // A remembered pin on the controller makes its children ask where it sits.
        admit(
            state.clone(),
            review(
                "secrets",
                "Secret",
                secret(controller, json!({PIN: "shard-a"})),
            ),
        )
        .await;
        let child = json!({"metadata": {
            "name": "child",
            "namespace": "default",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Secret", "name": controller, "uid": "u1", "controller": true},
            ],
        }});
        let response = admit(state, review("configmaps", "ConfigMap", child)).await;
        // Answered either way: the controller's pin, its shard unread.
        assert_eq!(assigned_shard(&response), "shard-a");
        let paths = paths.lock().expect("paths");
        assert_eq!(paths.len(), requests, "{controller}: {paths:?}");
    }
}

#[tokio::test]
async fn a_pin_for_an_unknown_ring_is_reported_and_changes_nothing() {
    let shards = ["shard-a", "shard-b"];
    let expected = HashRing::new(shards)
        .shard_for("/Secret/default/foo")
        .map(str::to_string);
    let unknown = format!("{}nope", kube_sharding_api::labels::PIN_ANNOTATION_PREFIX);
    // The ControllerRing `example` beside it is known: its pin key is not reported.
    let known = format!(
        "{}example",
        kube_sharding_api::labels::PIN_ANNOTATION_PREFIX
    );
    let response = admit(
        pinned_state(&shards, &[]),
        review(
            "secrets",
            "Secret",
            secret("foo", json!({&unknown: "shard-b", &known: "shard-b"})),
        ),
    )
    .await;
    assert_eq!(Some(assigned_shard(&response)), expected);
    let warnings = response["warnings"].as_array().expect("warnings");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].as_str().is_some_and(|w| w.contains(&unknown)),
        "{warnings:?}"
    );
}

#[tokio::test]
async fn annotations_that_are_not_strings_are_a_bad_request() {
    let (status, _) = call(
        pinned_state(&["shard-a"], &[]),
        PATH,
        review("secrets", "Secret", secret("foo", json!({"a": 1}))).to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}
