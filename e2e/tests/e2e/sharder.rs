//! The sharder (webhook, ClusterRing and shard-lease controllers) against a real API server.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::{
    WAIT, create_lease, create_ring, expected_shard, ring_spec, secret, secret_review, wait_status,
    wait_webhook,
};
use e2e::process::poll_until;
use e2e::scenario::SharedScenario;
use e2e::{IndependentRing, unique_name};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, MicroTime, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube_sharding_api::labels;
use kube_sharding_api::{ClusterRing, GroupResource, RingResource};
use serde_json::json;

#[tokio::test]
async fn webhook_assigns_in_the_create_response() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("assign").await?;
    let ring = unique_name("assign");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let shards = ["shard-a", "shard-b", "shard-c"];
    for shard in shards {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    wait_status(&client, &ring, 3, 3).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    let key = labels::shard_label(&ring);
    let predicted = IndependentRing::unweighted(shards);
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..20 {
        let name = format!("secret-{i}");
        let created = secrets
            .create(&PostParams::default(), &secret(&name))
            .await?;
        let expected = expected_shard(&predicted, &ns, &name);
        ensure!(
            created.labels().get(&key).map(String::as_str) == expected,
            "{name}: got {:?}, ring predicts {expected:?}",
            created.labels().get(&key)
        );
        seen.extend(expected.map(str::to_string));
    }
    ensure!(
        seen.len() == 3,
        "20 objects should spread over all 3 shards: {seen:?}"
    );

    // Controlled objects land on their controller's shard, generateName included.
    let owner = secrets.get("secret-0").await?;
    let owner_shard = owner.labels().get(&key).cloned();
    let controller_ref = OwnerReference {
        api_version: "v1".into(),
        kind: "Secret".into(),
        name: "secret-0".into(),
        uid: owner.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    };
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let cm = ConfigMap {
        metadata: ObjectMeta {
            generate_name: Some("checksums-".into()),
            owner_references: Some(vec![controller_ref.clone()]),
            ..Default::default()
        },
        ..Default::default()
    };
    let created = configmaps.create(&PostParams::default(), &cm).await?;
    ensure!(
        created.labels().get(&key) == owner_shard.as_ref(),
        "controlled object not on its owner's shard"
    );
    // Without a controller reference a controlled object stays unlabelled.
    let mut loose = controller_ref;
    loose.controller = None;
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some("loose".into()),
            owner_references: Some(vec![loose]),
            ..Default::default()
        },
        ..Default::default()
    };
    let created = configmaps.create(&PostParams::default(), &cm).await?;
    ensure!(
        !created.labels().contains_key(&key),
        "object without controller was labelled"
    );

    // generateName on a main resource: the CREATE succeeds unassigned (the name its key needs
    // does not exist yet; a denial would refuse the user's write), and the missed-assignment path
    // assigns it within seconds, where the ring wants it by its generated name.
    let generated = Secret {
        metadata: ObjectMeta {
            generate_name: Some("gen-".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let created = secrets
        .create(&PostParams::default(), &generated)
        .await
        .context("a generateName Secret must not be refused")?;
    ensure!(
        !created.labels().contains_key(&key),
        "a generateName Secret cannot be assigned in its CREATE: {:?}",
        created.labels()
    );
    let name = created.name_any();
    let want = expected_shard(&predicted, &ns, &name);
    ensure!(want.is_some(), "the ring has shards");
    let created_at = std::time::Instant::now();
    poll_until(
        "the generateName Secret to be assigned",
        Duration::from_secs(10),
        || async {
            let secret = secrets.get(&name).await?;
            Ok((secret.labels().get(&key).map(String::as_str) == want).then_some(()))
        },
    )
    .await?;
    println!(
        "generateName Secret {name} assigned {:?} after its creation",
        created_at.elapsed()
    );

    // An object in a namespace the ring does not select stays unlabelled.
    let other_ns = cluster.namespace(&client, "unselected").await?;
    let created = Api::<Secret>::namespaced(client.clone(), &other_ns)
        .create(&PostParams::default(), &secret("outside"))
        .await?;
    ensure!(
        !created.labels().contains_key(&key),
        "object outside the ring's namespaces was labelled"
    );
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn status_follows_leases_and_no_shard_leaves_objects_unassigned() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("status").await?;
    let ring = unique_name("status");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    wait_status(&client, &ring, 0, 0).await?;
    create_lease(&client, &ns, &ring, "shard-a", 3600).await?;
    wait_status(&client, &ring, 1, 1).await?;
    create_lease(&client, &ns, &ring, "shard-b", 3600).await?;
    wait_status(&client, &ring, 2, 2).await?;
    // Releasing a Lease (holder empty) makes the shard unavailable but keeps counting it.
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    // The test plays the shard; the sharder writes state labels meanwhile, so no resourceVersion.
    let patch = json!({"spec": {"holderIdentity": null}});
    leases
        .patch("shard-b", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    wait_status(&client, &ring, 1, 2).await?;
    wait_webhook(&client, &ns, &ring, &["shard-a"]).await?;
    let patch = json!({"spec": {"holderIdentity": ""}});
    leases
        .patch("shard-a", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    wait_status(&client, &ring, 0, 2).await?;
    wait_webhook(&client, &ns, &ring, &[]).await?;
    let created = Api::<Secret>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &secret("unassigned"))
        .await?;
    ensure!(
        !created.labels().contains_key(&labels::shard_label(&ring)),
        "object labelled although no shard is available"
    );
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn webhook_configuration_matches_spec_and_is_restored() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("webhookcfg").await?;
    let ring = unique_name("webhookcfg");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let name = labels::webhook_configuration_name(&ring);
    let fetch = || {
        let (configs, name) = (configs.clone(), name.clone());
        async move { Ok(configs.get_opt(&name).await?) }
    };
    let config = poll_until("webhook configuration", WAIT, fetch).await?;
    let ring_obj = Api::<ClusterRing>::all(client.clone()).get(&ring).await?;
    let labels_map = config.labels();
    ensure!(
        labels_map.get("app.kubernetes.io/name").map(String::as_str) == Some("controller-sharding")
    );
    ensure!(labels_map.get(labels::LABEL_CLUSTER_RING) == Some(&ring));
    let owner = &config.metadata.owner_references.clone().unwrap_or_default()[0];
    ensure!(owner.kind == "ClusterRing" && owner.name == ring && owner.controller == Some(true));
    ensure!(Some(owner.uid.clone()) == ring_obj.uid());
    let hooks = config.webhooks.clone().unwrap_or_default();
    ensure!(hooks.len() == 1, "exactly one webhook");
    let hook = &hooks[0];
    ensure!(hook.name == "sharder.sharding.timebertt.dev");
    ensure!(
        hook.client_config.url.as_deref()
            == Some(
                format!(
                    "{}/webhooks/sharder/clusterring/{ring}",
                    sharder.files.webhook_url()
                )
                .as_str()
            )
    );
    let ca = std::fs::read(&sharder.files.ca)?;
    ensure!(
        hook.client_config.ca_bundle.as_ref().map(|b| &b.0) == Some(&ca),
        "CA bundle from the config file"
    );
    ensure!(hook.namespace_selector == ring_spec(&ns).namespace_selector);
    let object_selector = hook.object_selector.clone().unwrap_or_default();
    let req = &object_selector.match_expressions.unwrap_or_default()[0];
    ensure!(req.key == labels::shard_label(&ring) && req.operator == "DoesNotExist");
    let rules = hook.rules.clone().unwrap_or_default();
    let resources: Vec<_> = rules
        .iter()
        .map(|r| r.resources.clone().unwrap_or_default())
        .collect();
    ensure!(
        resources == [vec!["secrets".to_string()], vec!["configmaps".to_string()]],
        "{resources:?}"
    );
    for rule in &rules {
        ensure!(rule.operations == Some(vec!["CREATE".into(), "UPDATE".into()]));
        ensure!(rule.api_groups == Some(vec![String::new()]));
        ensure!(rule.api_versions == Some(vec!["*".into()]));
        ensure!(rule.scope.as_deref() == Some("*"));
    }
    ensure!(hook.failure_policy.as_deref() == Some("Ignore"));
    ensure!(hook.timeout_seconds == Some(5));
    ensure!(hook.side_effects == "None");
    ensure!(hook.admission_review_versions == ["v1"]);

    // Deleted: restored within seconds.
    configs.delete(&name, &DeleteParams::default()).await?;
    poll_until("webhook configuration restored after deletion", WAIT, fetch).await?;
    // Edited: restored too.
    let patch =
        json!({"webhooks": [{"name": "sharder.sharding.timebertt.dev", "timeoutSeconds": 30}]});
    configs
        .patch(&name, &PatchParams::default(), &Patch::Strategic(&patch))
        .await?;
    poll_until("webhook configuration restored after an edit", WAIT, || {
        let (configs, name) = (configs.clone(), name.clone());
        async move {
            let c = configs.get(&name).await?;
            Ok((c.webhooks.unwrap_or_default()[0].timeout_seconds == Some(5)).then_some(()))
        }
    })
    .await?;
    logs.passed();
    Ok(())
}

/// Waits until the Lease carries `state` in its state label; returns it.
async fn wait_lease_state(
    api: &Api<Lease>,
    name: &str,
    state: &str,
    timeout: Duration,
) -> anyhow::Result<Lease> {
    poll_until(&format!("Lease {name} in state {state}"), timeout, || {
        let api = api.clone();
        async move {
            let lease = api.get(name).await?;
            Ok(
                (lease.labels().get(labels::LABEL_STATE).map(String::as_str) == Some(state))
                    .then_some(lease),
            )
        }
    })
    .await
}

#[tokio::test]
async fn lease_lifecycle_from_ready_to_deleted() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("lifecycle").await?;
    let ring = unique_name("lifecycle");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let api = Api::<Lease>::namespaced(client.clone(), &ns);
    create_lease(&client, &ns, &ring, "shard-a", 2).await?;
    wait_lease_state(&api, "shard-a", "ready", WAIT).await?;
    wait_lease_state(&api, "shard-a", "expired", Duration::from_secs(10)).await?;
    // Uncertain at renewTime + 2×2 s: the sharder takes the Lease over at once, so the shard
    // becomes dead.
    let taken = wait_lease_state(&api, "shard-a", "dead", Duration::from_secs(10)).await?;
    let spec = taken.spec.clone().unwrap_or_default();
    ensure!(
        spec.holder_identity.as_deref() == Some("shardlease-controller"),
        "{spec:?}"
    );
    ensure!(
        spec.lease_duration_seconds == Some(4),
        "duration doubled: {spec:?}"
    );
    ensure!(
        spec.lease_transitions == Some(1),
        "transitions + 1: {spec:?}"
    );
    wait_status(&client, &ring, 0, 1).await?;
    // Orphaned 60 s after the takeover's expiry (4 s), then deleted.
    poll_until("orphaned Lease deleted", Duration::from_secs(90), || {
        let api = api.clone();
        async move { Ok(api.get_opt("shard-a").await?.is_none().then_some(())) }
    })
    .await?;
    wait_status(&client, &ring, 0, 0).await?;
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn garbage_leases_crash_nothing() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("garbage").await?;
    let ring = unique_name("garbage");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let api = Api::<Lease>::namespaced(client.clone(), &ns);
    let label = BTreeMap::from([(labels::LABEL_CLUSTER_RING.to_string(), ring.clone())]);
    let leases = [
        (
            "no-times",
            LeaseSpec {
                holder_identity: Some("no-times".into()),
                ..Default::default()
            },
        ),
        // (The API server itself rejects non-positive durations; the unit tests cover them.)
        (
            "foreign-holder",
            LeaseSpec {
                holder_identity: Some("other".into()),
                ..Default::default()
            },
        ),
        (
            "huge-duration",
            LeaseSpec {
                holder_identity: Some("huge-duration".into()),
                lease_duration_seconds: Some(i32::MAX),
                acquire_time: Some(MicroTime(Timestamp::now())),
                renew_time: Some(MicroTime(Timestamp::now())),
                ..Default::default()
            },
        ),
        ("no-spec", LeaseSpec::default()),
    ];
    for (name, spec) in leases {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(label.clone()),
                ..Default::default()
            },
            spec: Some(spec),
        };
        api.create(&PostParams::default(), &lease).await?;
    }
    // docs/protocol.md §4: missing times or duration count as expiring now.
    wait_lease_state(&api, "no-times", "expired", WAIT).await?;
    wait_lease_state(&api, "foreign-holder", "dead", WAIT).await?;
    wait_lease_state(&api, "huge-duration", "ready", WAIT).await?;
    wait_lease_state(&api, "no-spec", "dead", WAIT).await?;
    wait_status(&client, &ring, 2, 4).await?;
    sharder.files.wait_ready(Duration::from_secs(5)).await?;
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn invalid_rings_are_reported_and_not_acted_on() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("invalid").await?;
    let rings = Api::<ClusterRing>::all(client.clone());
    let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let mut cases = vec![];
    let bad_selector = unique_name("badselector");
    let mut spec = ring_spec(&ns);
    spec.namespace_selector = Some(LabelSelector {
        match_expressions: Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                key: "team".into(),
                operator: "Equals".into(),
                values: Some(vec!["a".into()]),
            },
        ]),
        match_labels: None,
    });
    create_ring(&client, &bad_selector, spec).await?;
    cases.push((bad_selector, "Invalid spec.namespaceSelector".to_string()));
    // Resources the sharder must never stand in front of, and wildcards.
    for (group, resource, controlled, message) in [
        (
            "",
            "pods",
            None,
            "Resource pods in spec.resources[0] is refused: it is protected",
        ),
        (
            "",
            "secrets",
            Some(("coordination.k8s.io", "leases")),
            "controlledResources[0] is refused: it is protected",
        ),
        (
            "rbac.authorization.k8s.io",
            "clusterroles",
            None,
            "is refused: it is protected",
        ),
        ("", "*", None, "is refused: wildcards are not supported"),
    ] {
        let ring = unique_name("refused");
        let mut spec = ring_spec(&ns);
        spec.resources = vec![RingResource::controlling(
            group,
            resource,
            controlled.map(|(g, r)| GroupResource::new(g, r)),
        )];
        create_ring(&client, &ring, spec).await?;
        cases.push((ring, message.to_string()));
    }
    for (ring, message) in &cases {
        let r = poll_until(&format!("ring {ring} Ready=False"), WAIT, || {
            let rings = rings.clone();
            async move {
                let r = rings.get(ring).await?;
                Ok(r.ready_condition()
                    .is_some_and(|c| c.status == "False")
                    .then_some(r))
            }
        })
        .await?;
        let condition = r.ready_condition().context("no Ready condition")?;
        ensure!(condition.reason == "ReconciliationFailed", "{condition:?}");
        ensure!(
            condition.message.contains(message.as_str()),
            "{condition:?}"
        );
        ensure!(
            configs
                .get_opt(&labels::webhook_configuration_name(ring))
                .await?
                .is_none(),
            "webhook configuration written for invalid ring {ring}"
        );
    }
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn webhook_server_answers_bad_input_with_4xx_and_keeps_serving() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("bad-input").await?;
    let files = &sharder.files;
    // A ring the sharder knows; a path naming any other ring is not found, body unread.
    let ring = unique_name("bad-input");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    create_lease(&client, &ns, &ring, "shard-a", 3600).await?;
    wait_status(&client, &ring, 1, 1).await?;
    let path = format!("/webhooks/sharder/clusterring/{ring}");
    let path = path.as_str();
    let unknown = "/webhooks/sharder/clusterring/no-such-ring";
    let big = vec![b'x'; 3 * 1024 * 1024 + 1];
    // (A body over the limit to an unknown ring is answered before it is read, which curl reports
    // as a failed upload; the router test covers that case.)
    let cases: [(&str, &[u8], u16, &str); 5] = [
        (path, b"{not json", 400, "failed to decode AdmissionReview"),
        (path, b"", 400, "failed to decode AdmissionReview"),
        ("/wrong/path", b"{}", 404, "not found"),
        (path, &big, 413, ""),
        (unknown, b"{}", 404, "no such ring"),
    ];
    for (p, body, code, message) in cases {
        let (status, text) = files.post_webhook(p, body)?;
        ensure!(status == code, "{p}: expected {code}, got {status}: {text}");
        ensure!(text.contains(message), "{p}: {text}");
    }
    let review = secret_review("u-1", &ns, "x", &[]);
    let (status, text) = files.post_webhook(path, review.to_string().as_bytes())?;
    ensure!(status == 200, "still serving: {status} {text}");
    let body: serde_json::Value = serde_json::from_str(&text)?;
    ensure!(body["response"]["allowed"] == true, "{body}");
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn metrics_report_rings_and_shards() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("metrics").await?;
    let ring = unique_name("metrics");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    create_lease(&client, &ns, &ring, "shard-a", 3600).await?;
    wait_status(&client, &ring, 1, 1).await?;
    wait_webhook(&client, &ns, &ring, &["shard-a"]).await?;
    Api::<Secret>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &secret("counted"))
        .await?;
    let expected = [
        format!(
            r#"controller_sharding_assignments_total{{clusterring="{ring}",group="",resource="secrets"}} 1"#
        ),
        format!(r#"controller_sharding_ring_calculations_total{{clusterring="{ring}"}}"#),
        format!(r#"controller_sharding_clusterring_status_available_shards{{clusterring="{ring}""#),
        format!(
            r#"controller_sharding_shard_info{{namespace="{ns}",shard="shard-a",clusterring="{ring}""#
        ),
        format!(
            r#"controller_sharding_shard_state{{namespace="{ns}",shard="shard-a",clusterring="{ring}",state="ready"}} 1"#
        ),
    ];
    let text = poll_until("metrics of the ring", WAIT, || {
        let text = sharder.files.metrics();
        let expected = expected.clone();
        async move {
            let text = text?;
            Ok(expected
                .iter()
                .all(|e| text.contains(e.as_str()))
                .then_some(text))
        }
    })
    .await;
    if text.is_err() {
        eprintln!("{}", sharder.files.metrics().unwrap_or_default());
    }
    text?;
    logs.passed();
    Ok(())
}
