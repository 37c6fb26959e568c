//! Controlled objects follow their controller, and only after it left its old shard.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::{
    WAIT, create_annotated_lease, create_lease, create_ring, expected_shard, lease_warnings,
    ring_spec, ring_with_shards, secret, wait_status, wait_webhook,
};
use e2e::process::poll_until;
use e2e::scenario::{DedicatedScenario, SharedScenario};
use e2e::sharder_process::{SharderFiles, SharderSettings};
use e2e::{Cluster, IndependentRing, unique_name};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube_sharder::records::EVENT_SYNC_STARTED;
use kube_sharding_api::{RingKind, RingRef, labels};
use serde_json::json;

use super::STARTUP;

/// A controlled object moves only after its controller has left its shard: while a Secret waits
/// for its old shard to acknowledge the drain, its ConfigMap stays with it (that shard still
/// reconciles the Secret and would write the ConfigMap back); once the drain is acknowledged,
/// the ConfigMap follows at once, not at a later sync. The test plays the shards.
#[tokio::test]
async fn controlled_objects_follow_their_controller_only_after_it_left() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ..
    } = SharedScenario::open().await?;
    follow_only_after_left(cluster, &client, "follow", false).await?;
    logs.passed();
    Ok(())
}

/// Shards that leave their controlled objects to the sharder say so on their Leases, and the
/// sharder (here without `shardsLeaveControlledObjects`) then syncs their ring children first:
/// still no ConfigMap moves while its Secret waits on its old shard, and all follow as the drains
/// are acknowledged. When one shard takes it back, the next sync walks the Secrets first again;
/// a value that is neither "true" nor "false" gets a Warning Event on the Lease.
#[tokio::test]
async fn shards_saying_they_leave_controlled_objects_have_them_moved_children_first()
-> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        sharder,
        cluster,
        client,
        ..
    } = SharedScenario::open().await?;
    let (ns, ring) = follow_only_after_left(cluster, &client, "leave", true).await?;
    // The shared sharder's log: its syncs of this ring, whether each walked children first.
    let syncs = || -> anyhow::Result<Vec<bool>> {
        let ring = RingRef::new(RingKind::ClusterRing, &ring).to_string();
        Ok(sharder
            .records()?
            .iter()
            .filter(|r| r["event"] == EVENT_SYNC_STARTED && r["ring"] == ring.as_str())
            .map(|r| r["children_first"] == true)
            .collect())
    };
    let seen = syncs()?;
    ensure!(
        seen.last() == Some(&true),
        "the sync after shard-d joined walked children first ({seen:?})"
    );
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let relabelling = json!({"metadata": {"annotations": {
        labels::ANNOTATION_LEAVES_CONTROLLED_OBJECTS: "false",
    }}});
    leases
        .patch(
            "shard-b",
            &PatchParams::default(),
            &Patch::Merge(&relabelling),
        )
        .await?;
    poll_until("a sync walking the Secrets first", WAIT, || async {
        let now = syncs()?;
        Ok((now.len() > seen.len() && now.last() == Some(&false)).then_some(()))
    })
    .await?;
    // A value that is neither "true" nor "false" is reported on the Lease.
    let unclear = json!({"metadata": {"annotations": {
        labels::ANNOTATION_LEAVES_CONTROLLED_OBJECTS: "yes",
    }}});
    leases
        .patch("shard-c", &PatchParams::default(), &Patch::Merge(&unclear))
        .await?;
    poll_until("a Warning Event about the annotation", WAIT, || async {
        let warnings = lease_warnings(&client, &ns, "shard-c").await?;
        Ok(warnings
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("InvalidLeavesControlledObjects")
                    && e.message
                        .as_deref()
                        .is_some_and(|m| m.contains(r#"="yes""#))
            })
            .then_some(()))
    })
    .await?;
    logs.passed();
    Ok(())
}

/// Drains some Secrets of a new ring on `cluster` towards a fourth shard without acknowledging
/// them, checks that their ConfigMaps stay put meanwhile (and that a child created meanwhile
/// lands with its Secret), then acknowledges and checks that the ConfigMaps follow at once. The
/// test plays the shards; a sharder must be running.
///
/// With `leases_leave`, every shard's Lease says it leaves its controlled objects to the sharder.
/// Returns the namespace and the ring.
async fn follow_only_after_left(
    cluster: &Cluster,
    client: &kube::Client,
    prefix: &str,
    leases_leave: bool,
) -> anyhow::Result<(String, String)> {
    let client = client.clone();
    let (ns, ring) =
        ring_with_shards(cluster, &client, prefix, &["shard-a", "shard-b", "shard-c"]).await?;
    let leaving = [(labels::ANNOTATION_LEAVES_CONTROLLED_OBJECTS, "true")];
    if leases_leave {
        let leases = Api::<Lease>::namespaced(client.clone(), &ns);
        let annotate = json!({"metadata": {"annotations": BTreeMap::from(leaving)}});
        for shard in ["shard-a", "shard-b", "shard-c"] {
            leases
                .patch(shard, &PatchParams::default(), &Patch::Merge(&annotate))
                .await?;
        }
    }
    wait_status(&client, &ring, 3, 3).await?;
    wait_webhook(&client, &ns, &ring, &["shard-a", "shard-b", "shard-c"]).await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let configmaps = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client.clone(), &ns);
    create_controlled_pairs(&secrets, &configmaps, 40).await?;
    let key = labels::shard_label(&ring);
    let drain = labels::drain_label(&ring);
    let shard_of_secret = |i: usize, list: &kube::core::ObjectList<Secret>| {
        list.items
            .iter()
            .find(|s| s.name_any() == format!("s-{i}"))
            .and_then(|s| s.labels().get(&key).cloned())
    };
    let before = secrets.list(&ListParams::default()).await?;

    // shard-d joins: the Secrets that go to it are drained, and nobody acknowledges yet.
    if leases_leave {
        let ring_ref = RingRef::new(RingKind::ClusterRing, &ring);
        create_annotated_lease(&client, &ns, &ring_ref, "shard-d", 3600, leaving).await?;
    } else {
        create_lease(&client, &ns, &ring, "shard-d", 3600).await?;
    }
    let four = IndependentRing::unweighted(["shard-a", "shard-b", "shard-c", "shard-d"]);
    let moving: Vec<usize> = (0..40)
        .filter(|i| expected_shard(&four, &ns, &format!("s-{i}")) == Some("shard-d"))
        .collect();
    ensure!(!moving.is_empty(), "some Secrets move to shard-d");
    poll_until("the moving Secrets drained", WAIT, || async {
        let list = secrets.list_metadata(&ListParams::default()).await?;
        let drained = list
            .items
            .iter()
            .filter(|s| s.labels().contains_key(&drain))
            .count();
        Ok((drained == moving.len()).then_some(()))
    })
    .await?;
    // Their ConfigMaps stay put while the drains wait (give the sharder time to get it wrong).
    tokio::time::sleep(Duration::from_secs(8)).await;
    let cms = configmaps.list_metadata(&ListParams::default()).await?;
    for i in &moving {
        let cm = cms
            .items
            .iter()
            .find(|c| c.name_any() == format!("cm-{i}"))
            .context("ConfigMap listed")?;
        ensure!(
            cm.labels().get(&key) == shard_of_secret(*i, &before).as_ref(),
            "cm-{i} moved to {:?} while s-{i} still waited on its old shard",
            cm.labels().get(&key)
        );
    }

    // A child created now, as the old shard reconciling its Secret would: the webhook labels it
    // for the shard the Secret still sits on, not for shard-d (audit F6.4).
    let late_parent = moving[0];
    let parent = before
        .items
        .iter()
        .find(|s| s.name_any() == format!("s-{late_parent}"))
        .context("Secret listed")?;
    let late: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(json!({
        "metadata": {
            "name": "late",
            "ownerReferences": [{
                "apiVersion": "v1", "kind": "Secret", "name": parent.name_any(),
                "uid": parent.uid(), "controller": true,
            }],
        },
    }))?;
    let late = configmaps.create(&PostParams::default(), &late).await?;
    let parent_shard = shard_of_secret(late_parent, &before);
    ensure!(
        late.labels().get(&key) == parent_shard.as_ref(),
        "a child created while s-{late_parent} waits on {parent_shard:?} was labelled {:?}",
        late.labels().get(&key)
    );

    // The old shards acknowledge: the Secrets land on shard-d, and their ConfigMaps follow.
    let list = secrets.list_metadata(&ListParams::default()).await?;
    for s in list
        .items
        .iter()
        .filter(|s| s.labels().contains_key(&drain))
    {
        let ack = json!({"metadata": {
            "resourceVersion": s.resource_version(),
            "labels": {&key: null, &drain: null},
        }});
        secrets
            .patch(&s.name_any(), &PatchParams::default(), &Patch::Merge(&ack))
            .await?;
    }
    // The ConfigMaps the sync held back move as the acknowledgements arrive, sooner than any
    // sync after a backoff (5 s at the least) could move them.
    poll_until(
        "held-back ConfigMaps on their Secrets' new shard",
        Duration::from_secs(4),
        || async {
            let cms = configmaps.list_metadata(&ListParams::default()).await?;
            Ok(moving
                .iter()
                .all(|i| {
                    cms.items.iter().any(|c| {
                        c.name_any() == format!("cm-{i}")
                            && c.labels().get(&key).map(String::as_str) == Some("shard-d")
                    })
                })
                .then_some(()))
        },
    )
    .await?;
    poll_until(
        "ConfigMaps on their Secrets' new shard",
        Duration::from_secs(30),
        || async {
            let cms = configmaps.list_metadata(&ListParams::default()).await?;
            Ok(cms
                .items
                .iter()
                .filter_map(|c| {
                    let parent = match c.name_any().strip_prefix("cm-") {
                        Some(i) => format!("s-{i}"),
                        None if c.name_any() == "late" => format!("s-{late_parent}"),
                        None => return None,
                    };
                    Some((parent, c))
                })
                .all(|(parent, c)| {
                    c.labels().get(&key).map(String::as_str) == expected_shard(&four, &ns, &parent)
                })
                .then_some(()))
        },
    )
    .await?;
    Ok((ns, ring))
}

/// The same with `shardsLeaveControlledObjects` on, where a sync walks the ConfigMaps before the
/// Secrets and holds back every misplaced one before it has seen any Secret: still none moves
/// while its Secret waits on its old shard, and all follow at once when the drains are
/// acknowledged.
#[tokio::test]
async fn controlled_objects_held_before_their_controllers_were_listed_wait_for_them_just_the_same()
-> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated, client, ..
    } = DedicatedScenario::open().await?;
    let cluster = dedicated.cluster();
    let settings = SharderSettings {
        shards_leave_controlled_objects: true,
        ..Default::default()
    };
    let files = SharderFiles::create(cluster.kubeconfig(), &settings)?;
    let mut sharder = files.start_process()?;
    files.wait_ready(STARTUP).await?;
    follow_only_after_left(cluster, &client, "first", false).await?;
    sharder.terminate()?;
    sharder.wait(Duration::from_secs(15)).await?;
    sharder.passed();
    Ok(())
}

/// Creates Secrets `s-0` … `s-<count-1>`, each controlling a ConfigMap `cm-<i>`.
async fn create_controlled_pairs(
    secrets: &Api<Secret>,
    configmaps: &Api<k8s_openapi::api::core::v1::ConfigMap>,
    count: usize,
) -> anyhow::Result<()> {
    for i in 0..count {
        let created = secrets
            .create(&PostParams::default(), &secret(&format!("s-{i}")))
            .await?;
        let owner = k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "Secret".into(),
            name: created.name_any(),
            uid: created.uid().unwrap_or_default(),
            controller: Some(true),
            block_owner_deletion: None,
        };
        let cm = k8s_openapi::api::core::v1::ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(format!("cm-{i}")),
                owner_references: Some(vec![owner]),
                ..Default::default()
            },
            ..Default::default()
        };
        configmaps.create(&PostParams::default(), &cm).await?;
    }
    Ok(())
}

/// With `hashKey: Namespace` too, controlled objects wait for their controllers: a namespace
/// moving to a new shard drains its Secrets, and their ConfigMaps stay on the old shard, which
/// still reconciles the Secrets, until the drains are acknowledged.
#[tokio::test]
async fn with_namespace_keys_controlled_objects_wait_for_their_controllers() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("nsfollow").await?;
    let ring = unique_name("nsfollow");
    let mut spec = ring_spec(&ns);
    spec.hash_key = Some(kube_sharding_api::HashKey::Namespace);
    create_ring(&client, &ring, spec).await?;
    let shards = ["shard-a", "shard-b", "shard-c"];
    for shard in shards {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    wait_status(&client, &ring, 3, 3).await?;
    let namespace_key = format!("/Namespace//{ns}");
    let old = IndependentRing::unweighted(shards)
        .shard_for(&namespace_key)
        .to_string();
    // A joining shard the namespace moves to. A new name takes one key only when one of its
    // virtual nodes lands in the gap before it, which is rare for a key just after a node: 100
    // names were not always enough (a CI run found none), and trying more costs microseconds.
    let joining = (0..10_000)
        .map(|i| format!("shard-new-{i}"))
        .find(|name| {
            IndependentRing::unweighted(shards.iter().copied().chain([name.as_str()]))
                .shard_for(&namespace_key)
                == name
        })
        .context("no shard name takes the namespace")?;
    e2e::fixtures::wait_dry_run_label(&client, &ns, "probe", &labels::shard_label(&ring), &old)
        .await?;

    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let configmaps = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client.clone(), &ns);
    create_controlled_pairs(&secrets, &configmaps, 10).await?;
    let (key, drain) = (labels::shard_label(&ring), labels::drain_label(&ring));
    let on = |labels: &std::collections::BTreeMap<String, String>, shard: &str| {
        labels.get(&key).map(String::as_str) == Some(shard)
    };

    create_lease(&client, &ns, &ring, &joining, 3600).await?;
    poll_until("the namespace's Secrets drained", WAIT, || async {
        let list = secrets.list_metadata(&ListParams::default()).await?;
        Ok(list
            .items
            .iter()
            .all(|s| on(s.labels(), &old) && s.labels().contains_key(&drain))
            .then_some(()))
    })
    .await?;
    // The ConfigMaps stay while the drains wait (give the sharder time to get it wrong).
    tokio::time::sleep(Duration::from_secs(8)).await;
    let cms = configmaps.list_metadata(&ListParams::default()).await?;
    for cm in cms.items.iter().filter(|c| c.name_any().starts_with("cm-")) {
        ensure!(
            on(cm.labels(), &old),
            "{} moved to {:?} while its Secret still waited on {old}",
            cm.name_any(),
            cm.labels().get(&key)
        );
    }

    // The old shard acknowledges: the Secrets land on the new shard, the ConfigMaps follow.
    let list = secrets.list_metadata(&ListParams::default()).await?;
    for s in &list.items {
        let ack = json!({"metadata": {
            "resourceVersion": s.resource_version(),
            "labels": {&key: null, &drain: null},
        }});
        secrets
            .patch(&s.name_any(), &PatchParams::default(), &Patch::Merge(&ack))
            .await?;
    }
    poll_until(
        "Secrets and ConfigMaps on the namespace's new shard",
        Duration::from_secs(30),
        || async {
            let s = secrets.list_metadata(&ListParams::default()).await?;
            let c = configmaps.list_metadata(&ListParams::default()).await?;
            Ok((s.items.iter().all(|o| on(o.labels(), &joining))
                && c.items
                    .iter()
                    .filter(|o| o.name_any().starts_with("cm-"))
                    .all(|o| on(o.labels(), &joining)))
            .then_some(()))
        },
    )
    .await?;
    logs.passed();
    Ok(())
}
