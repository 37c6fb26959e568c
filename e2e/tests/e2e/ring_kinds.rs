//! Beyond ClusterRing (docs/protocol.md §15–§17): ControllerRings beside ClusterRings, hashing by
//! namespace, weighted shards, and the ControllerRing protocol driven from outside the project's
//! code.
//!
//! Assignments are checked against [`IndependentRing`], a hash ring written in the harness from
//! the protocol's description (XXH64 tokens, 100 per unit of weight), not the sharder's ring code.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::IndependentRing;
use e2e::fixtures::{
    WAIT, create_lease_of, create_ring_of, create_secrets, lease_warnings, ring_spec,
    wait_dry_run_label, wait_status_of,
};
use e2e::process::poll_until;
use e2e::scenario::SharedScenario;
use e2e::unique_name;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::{ControllerRing, HashKey, RingKind, RingRef};
use serde_json::json;

/// The ControllerRing label keys and Lease label, spelled out from docs/protocol.md §15.
const CONTROLLER_RING_LEASE_LABEL: &str = "alpha.sharding.timebertt.dev/controllerring";
const SHARD_PREFIX: &str = "shard.alpha.sharding.timebertt.dev/";
const DRAIN_PREFIX: &str = "drain.alpha.sharding.timebertt.dev/";
const WEIGHT_ANNOTATION: &str = "alpha.sharding.timebertt.dev/weight";

/// Shard label value of every Secret in `namespace`, by name, for the label key `key`.
async fn secret_labels(
    client: &Client,
    namespace: &str,
    key: &str,
) -> anyhow::Result<BTreeMap<String, Option<String>>> {
    Ok(Api::<Secret>::namespaced(client.clone(), namespace)
        .list_metadata(&ListParams::default())
        .await?
        .items
        .iter()
        .map(|s| (s.name_any(), s.labels().get(key).cloned()))
        .collect())
}

/// A ClusterRing and a ControllerRing of the same name over the same Secrets: each assigns with
/// its own label key from its own shards, counts only its own Leases, and owns its own webhook
/// configuration. A Lease labelled for both is used by neither and reported.
#[tokio::test]
async fn same_name_rings_of_both_kinds_coexist() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("kinds").await?;
    let name = unique_name("kinds");
    let cluster_ring = RingRef::new(RingKind::ClusterRing, &name);
    let controller_ring = RingRef::new(RingKind::ControllerRing, &name);
    create_ring_of(&client, &cluster_ring, ring_spec(&ns)).await?;
    create_ring_of(&client, &controller_ring, ring_spec(&ns)).await?;
    for shard in ["cluster-a", "cluster-b"] {
        create_lease_of(&client, &ns, &cluster_ring, shard, 3600).await?;
    }
    for shard in ["controller-a", "controller-b", "controller-c"] {
        create_lease_of(&client, &ns, &controller_ring, shard, 3600).await?;
    }
    // One Lease carrying both ring labels.
    let both = create_lease_of(&client, &ns, &cluster_ring, "both", 3600).await?;
    let patch = json!({"metadata": {"labels": {CONTROLLER_RING_LEASE_LABEL: name}}});
    Api::<Lease>::namespaced(client.clone(), &ns)
        .patch(
            &both.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    wait_status_of(&client, &cluster_ring, 2, 3).await?;
    wait_status_of(&client, &controller_ring, 3, 4).await?;

    let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let controller_config = configs.get(&format!("controllerring-{name}")).await?;
    ensure!(
        controller_config
            .owner_references()
            .iter()
            .any(|o| o.kind == "ControllerRing" && o.name == name),
        "the ControllerRing owns its webhook configuration"
    );
    configs
        .get(&RingKind::ClusterRing.webhook_configuration_name(&name))
        .await
        .context("the ClusterRing keeps its own webhook configuration")?;

    let cluster_key = cluster_ring.shard_label();
    let controller_key = format!("{SHARD_PREFIX}{name}");
    let cluster_predicted = IndependentRing::unweighted(["cluster-a", "cluster-b"]);
    let controller_predicted =
        IndependentRing::unweighted(["controller-a", "controller-b", "controller-c"]);
    let names: Vec<String> = (0..40).map(|i| format!("s-{i}")).collect();
    // Both webhooks must be in place with their current views before the writes count.
    let probe_key = format!("/Secret/{ns}/probe");
    let expected = cluster_predicted.shard_for(&probe_key);
    wait_dry_run_label(&client, &ns, "probe", &cluster_key, expected).await?;
    let expected = controller_predicted.shard_for(&probe_key);
    wait_dry_run_label(&client, &ns, "probe", &controller_key, expected).await?;
    create_secrets(&client, &ns, &names).await?;

    let by_cluster = secret_labels(&client, &ns, &cluster_key).await?;
    let by_controller = secret_labels(&client, &ns, &controller_key).await?;
    for secret in &names {
        let key = format!("/Secret/{ns}/{secret}");
        ensure!(
            by_cluster[secret].as_deref() == Some(cluster_predicted.shard_for(&key)),
            "ClusterRing label of {secret}: {:?}",
            by_cluster[secret]
        );
        ensure!(
            by_controller[secret].as_deref() == Some(controller_predicted.shard_for(&key)),
            "ControllerRing label of {secret}: {:?}",
            by_controller[secret]
        );
    }

    // The Lease of both kinds is reported on the Lease and kept out of both rings.
    poll_until(
        "a Warning Event on the Lease of both kinds",
        WAIT,
        || async {
            let warnings = lease_warnings(&client, &ns, "both").await?;
            Ok(warnings
                .iter()
                .any(|e| e.reason.as_deref() == Some("AmbiguousRingKind"))
                .then_some(()))
        },
    )
    .await?;
    let lease = Api::<Lease>::namespaced(client.clone(), &ns)
        .get("both")
        .await?;
    ensure!(
        !lease
            .labels()
            .contains_key(kube_sharding_api::labels::LABEL_STATE),
        "neither kind's controller labels a Lease of both kinds"
    );
    logs.passed();
    Ok(())
}

/// `hashKey: Namespace` puts every object of a namespace on the namespace's shard, main objects
/// created with `generateName` included; switching back to `Object` rebalances through drains.
#[tokio::test]
async fn namespace_hashing_keeps_a_namespace_on_one_shard() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("nshash").await?;
    let ring = RingRef::new(RingKind::ControllerRing, unique_name("nshash"));
    let mut spec = ring_spec(&ns);
    spec.hash_key = Some(HashKey::Namespace);
    create_ring_of(&client, &ring, spec).await?;
    let shards = ["shard-a", "shard-b", "shard-c", "shard-d"];
    for shard in shards {
        create_lease_of(&client, &ns, &ring, shard, 3600).await?;
    }
    wait_status_of(&client, &ring, 4, 4).await?;
    let predicted = IndependentRing::unweighted(shards);
    let namespace_shard = predicted
        .shard_for(&format!("/Namespace//{ns}"))
        .to_string();
    let key = ring.shard_label();

    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    wait_dry_run_label(&client, &ns, "probe", &key, &namespace_shard).await?;
    let names: Vec<String> = (0..20).map(|i| format!("s-{i}")).collect();
    create_secrets(&client, &ns, &names).await?;
    // A main object with only generateName is assigned in its CREATE too (with object keys it is
    // assigned only after it exists).
    let generated = Secret {
        metadata: ObjectMeta {
            generate_name: Some("gen-".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let generated = secrets.create(&PostParams::default(), &generated).await?;
    ensure!(
        generated.labels().get(&key) == Some(&namespace_shard),
        "generateName Secret assigned to the namespace's shard"
    );
    // A ConfigMap without any controller lands there as well.
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let orphan = ConfigMap {
        metadata: ObjectMeta {
            name: Some("orphan".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let orphan = configmaps.create(&PostParams::default(), &orphan).await?;
    ensure!(orphan.labels().get(&key) == Some(&namespace_shard));
    let labels = secret_labels(&client, &ns, &key).await?;
    ensure!(
        labels
            .values()
            .all(|l| l.as_deref() == Some(namespace_shard.as_str())),
        "every Secret on {namespace_shard}: {labels:?}"
    );

    // Back to object keys: a spec change; the Secrets whose object key points elsewhere are
    // drained (the shards here are played by the test and never acknowledge), the rest stay.
    let patch = json!({"spec": {"hashKey": "Object"}});
    Api::<ControllerRing>::all(client.clone())
        .patch(&ring.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    let drain = ring.drain_label();
    let moves_away =
        |name: &str| predicted.shard_for(&format!("/Secret/{ns}/{name}")) != namespace_shard;
    ensure!(
        names.iter().any(|n| moves_away(n)),
        "some Secrets have another object key shard"
    );
    poll_until("Secrets drained after the hashKey change", WAIT, || async {
        let list = secrets.list_metadata(&ListParams::default()).await?;
        // Exactly the Secrets whose object key points elsewhere carry the drain label (the
        // generateName one has a name by now, so an object key too).
        Ok(list
            .items
            .iter()
            .all(|s| s.labels().contains_key(&drain) == moves_away(&s.name_any()))
            .then_some(()))
    })
    .await?;
    logs.passed();
    Ok(())
}

/// Shards with weights 1 and 3 get the assignments of the weighted protocol ring; an invalid
/// weight counts as 1 and is reported on its Lease.
#[tokio::test]
async fn weighted_shards_follow_the_weighted_ring() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("weights").await?;
    let ring = RingRef::new(RingKind::ClusterRing, unique_name("weights"));
    create_ring_of(&client, &ring, ring_spec(&ns)).await?;
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    for (shard, weight) in [("light", "1"), ("heavy", "3"), ("odd", "eleven")] {
        create_lease_of(&client, &ns, &ring, shard, 3600).await?;
        let patch = json!({"metadata": {"annotations": {WEIGHT_ANNOTATION: weight}}});
        leases
            .patch(shard, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    wait_status_of(&client, &ring, 3, 3).await?;
    let predicted = IndependentRing::new([("light", 1), ("heavy", 3), ("odd", 1)]);
    let key = ring.shard_label();
    // Wait for the weighted view: a probe whose shard differs between weighted and plain rings.
    let plain = IndependentRing::unweighted(["light", "heavy", "odd"]);
    let probe = (0..1000)
        .map(|i| format!("probe-{i}"))
        .find(|n| {
            let k = format!("/Secret/{ns}/{n}");
            predicted.shard_for(&k) != plain.shard_for(&k)
        })
        .context("a probe name that tells the rings apart")?;
    let expected = predicted
        .shard_for(&format!("/Secret/{ns}/{probe}"))
        .to_string();
    wait_dry_run_label(&client, &ns, &probe, &key, &expected).await?;
    let names: Vec<String> = (0..200).map(|i| format!("s-{i}")).collect();
    create_secrets(&client, &ns, &names).await?;
    let labels = secret_labels(&client, &ns, &key).await?;
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for name in &names {
        let want = predicted.shard_for(&format!("/Secret/{ns}/{name}"));
        ensure!(
            labels[name].as_deref() == Some(want),
            "{name}: {:?}, expected {want}",
            labels[name]
        );
        *counts.entry(want).or_default() += 1;
    }
    eprintln!("weights 1/3/1(invalid): Secrets per shard {counts:?}");
    poll_until("a Warning Event on the invalid weight", WAIT, || async {
        let warnings = lease_warnings(&client, &ns, "odd").await?;
        Ok(warnings
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("InvalidShardWeight")
                    && e.message.as_deref().is_some_and(|n| n.contains("eleven"))
            })
            .then_some(()))
    })
    .await?;
    let metrics = sharder.metrics()?;
    let series = format!(
        r#"controller_sharding_shard_weight{{namespace="{ns}",shard="heavy",clusterring="{}"}} 3"#,
        ring.name
    );
    ensure!(metrics.lines().any(|l| l == series), "missing {series}");
    logs.passed();
    Ok(())
}

/// The ControllerRing protocol played by the test with plain API calls and literal label keys
/// (docs/protocol.md §3, §15): Leases, assignment on create, a drain on scale-out acknowledged by
/// removing both labels, and reassignment to the new shard, all as the independent ring predicts.
#[tokio::test]
async fn controller_ring_protocol_from_outside() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("protocol").await?;
    let name = unique_name("protocol");
    let ring_object = json!({
        "apiVersion": "sharding.timebertt.dev/v1alpha1",
        "kind": "ControllerRing",
        "metadata": {"name": name},
        "spec": {
            "resources": [{"group": "", "resource": "secrets"}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
        },
    });
    let rings = Api::<ControllerRing>::all(client.clone());
    rings
        .create(
            &PostParams::default(),
            &serde_json::from_value(ring_object)?,
        )
        .await?;
    let shard_key = format!("{SHARD_PREFIX}{name}");
    let drain_key = format!("{DRAIN_PREFIX}{name}");
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let lease = |shard: &str| -> anyhow::Result<Lease> {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        Ok(serde_json::from_value(json!({
            "metadata": {"name": shard, "labels": {CONTROLLER_RING_LEASE_LABEL: name}},
            "spec": {
                "holderIdentity": shard,
                "leaseDurationSeconds": 3600,
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": 0,
            },
        }))?)
    };
    for shard in ["p-0", "p-1"] {
        leases
            .create(&PostParams::default(), &lease(shard)?)
            .await?;
    }
    let ring = RingRef::new(RingKind::ControllerRing, &name);
    wait_status_of(&client, &ring, 2, 2).await?;
    let two = IndependentRing::unweighted(["p-0", "p-1"]);
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let probe_shard = two.shard_for(&format!("/Secret/{ns}/probe")).to_string();
    wait_dry_run_label(&client, &ns, "probe", &shard_key, &probe_shard).await?;
    let names: Vec<String> = (0..40).map(|i| format!("s-{i}")).collect();
    create_secrets(&client, &ns, &names).await?;
    let labels = secret_labels(&client, &ns, &shard_key).await?;
    for n in &names {
        ensure!(labels[n].as_deref() == Some(two.shard_for(&format!("/Secret/{ns}/{n}"))));
    }

    // A third shard joins: the Secrets that move to it are drained from their live shards.
    leases
        .create(&PostParams::default(), &lease("p-2")?)
        .await?;
    let three = IndependentRing::unweighted(["p-0", "p-1", "p-2"]);
    let moving: Vec<&String> = names
        .iter()
        .filter(|n| three.shard_for(&format!("/Secret/{ns}/{n}")) == "p-2")
        .collect();
    ensure!(!moving.is_empty(), "some Secrets move to the new shard");
    // Play the old shards: acknowledge every drain by removing both labels in one write,
    // guarded by resourceVersion, until every Secret sits where the three-shard ring wants it.
    poll_until(
        "drains acknowledged and Secrets reassigned",
        Duration::from_secs(60),
        || async {
            let list = secrets.list_metadata(&ListParams::default()).await?;
            for s in &list.items {
                if s.labels().contains_key(&drain_key) {
                    let ack = json!({"metadata": {
                        "resourceVersion": s.resource_version(),
                        "labels": {&shard_key: null, &drain_key: null},
                    }});
                    // A conflict means the object changed; the next round sees it again.
                    let _ = secrets
                        .patch(&s.name_any(), &PatchParams::default(), &Patch::Merge(&ack))
                        .await;
                }
            }
            let done = list.items.iter().all(|s| {
                !s.labels().contains_key(&drain_key)
                    && s.labels().get(&shard_key).map(String::as_str)
                        == Some(three.shard_for(&format!("/Secret/{ns}/{}", s.name_any())))
            });
            Ok(done.then_some(()))
        },
    )
    .await?;
    let moved = sharder.counter_of("controller_sharding_drains_total", &ring, "secrets")?;
    ensure!(
        moved == moving.len() as u64,
        "{moved} drains for {} moving Secrets",
        moving.len()
    );
    logs.passed();
    Ok(())
}
