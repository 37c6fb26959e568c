//! Assignment through faults of the webhook path: outages, an API server restart, namespaces
//! joining a ring, an unreachable webhook, a CRD changing its served version.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::apiserver::ApiServer;
use e2e::fixtures::{
    WAIT, create_lease, create_ring, expected_shard, ring_spec, secret, wait_status, wait_webhook,
};
use e2e::gate::TcpGate;
use e2e::process::poll_until;
use e2e::scenario::{DedicatedScenario, SharedScenario};
use e2e::sharder_process::{SharderFiles, SharderSettings, counter};
use e2e::{Cluster, IndependentRing, unique_name};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube_sharder::records::{
    EVENT_LEADERSHIP_ACQUIRED, EVENT_MISSED_ASSIGNMENT_WATCH_FAILED, EVENT_SYNC_FINISHED,
    EVENT_SYNC_STARTED,
};
use kube_sharding_api::labels;
use serde_json::json;

use super::{STARTUP, gated_sharder};

/// A gated sharder (see [`gated_sharder`]) with a ring over Secrets of a new namespace and two
/// shard Leases held for an hour, once the ring is Ready, its webhook assigns, and its first full
/// sync has finished.
struct GatedRing {
    ns: String,
    ring: String,
    shards: [&'static str; 2],
    gate: TcpGate,
    files: SharderFiles,
    sharder: e2e::process::Process,
}

async fn gated_ring(
    cluster: &Cluster,
    client: &kube::Client,
    prefix: &str,
    settings: SharderSettings,
) -> anyhow::Result<GatedRing> {
    let ns = cluster.namespace(client, prefix).await?;
    let ring = unique_name(prefix);
    let shards = ["shard-a", "shard-b"];
    let (gate, files, sharder) = gated_sharder(cluster, settings).await?;
    create_ring(client, &ring, ring_spec(&ns)).await?;
    for shard in shards {
        create_lease(client, &ns, &ring, shard, 3600).await?;
    }
    files.wait_ready(STARTUP).await?;
    wait_status(client, &ring, 2, 2).await?;
    wait_webhook(client, &ns, &ring, &shards).await?;
    sharder
        .wait_for_record("the ring's first sync to finish", STARTUP, |r| {
            r["event"] == EVENT_SYNC_FINISHED
        })
        .await?;
    Ok(GatedRing {
        ns,
        ring,
        shards,
        gate,
        files,
        sharder,
    })
}

/// Objects created while the API server cannot reach the webhook are assigned within 10 seconds
/// of it becoming reachable again, without a restart.
#[tokio::test]
async fn objects_missed_during_a_webhook_outage_are_assigned_once_it_ends() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated, client, ..
    } = DedicatedScenario::open().await?;
    let cluster = dedicated.cluster();
    // The outage starts after the ring's first full sync, so that only the missed-assignment
    // path, not a sync that happens to run right after the outage, can assign the objects.
    let GatedRing {
        ns,
        ring,
        shards,
        gate,
        files: _files,
        mut sharder,
    } = gated_ring(cluster, &client, "outage", SharderSettings::default()).await?;

    gate.close();
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let key = labels::shard_label(&ring);
    let mut missed = BTreeSet::new();
    for i in 0..20 {
        let name = format!("missed-{i}");
        let created = secrets
            .create(&PostParams::default(), &secret(&name))
            .await?;
        if !created.labels().contains_key(&key) {
            missed.insert(name);
        }
    }
    ensure!(
        missed.len() == 20,
        "the webhook was reachable during the outage: {} of 20 assigned",
        20 - missed.len()
    );
    // The outage lasts a few seconds: long enough for the sharder to try and fail.
    tokio::time::sleep(Duration::from_secs(5)).await;
    gate.open();
    let reopened = std::time::Instant::now();

    let predicted = IndependentRing::unweighted(shards);
    poll_until(
        "every missed object to be assigned",
        Duration::from_secs(10),
        || async {
            let list = secrets.list(&ListParams::default()).await?;
            let done = list.items.iter().all(|s| {
                let want = expected_shard(&predicted, &ns, &s.name_any());
                s.labels().get(&key).map(String::as_str) == want
            });
            Ok(done.then_some(()))
        },
    )
    .await?;
    println!(
        "missed objects assigned {:?} after the outage ended",
        reopened.elapsed()
    );
    sharder.passed();
    Ok(())
}

/// How many log records of `process` have the `event` `event`.
fn records_of(process: &e2e::process::Process, event: &str) -> usize {
    process
        .records()
        .iter()
        .filter(|r| r["event"] == event)
        .count()
}

/// The missed-assignment watch outlives a kube-apiserver restart: objects the webhook misses after
/// the restart are assigned within 10 seconds of it answering again. The sharder keeps running
/// and leading throughout, and starts no sync after the restart, so only the watch it had before,
/// established anew, can have assigned them: neither a new term's fresh watch nor a sync.
#[tokio::test]
async fn the_missed_assignment_watch_survives_an_apiserver_restart() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated, client, ..
    } = DedicatedScenario::open().await?;
    let cluster = dedicated.cluster();
    let settings = SharderSettings {
        // Leadership outlasts the restart (the API server is down for about 10 s here): a new
        // term would start fresh watches and hide one that died with the old connection.
        leader_election: (120, 90, 2),
        // Only the first sync runs within the test.
        sync_period: "1h".into(),
        ..Default::default()
    };
    let GatedRing {
        ns,
        ring,
        shards,
        gate,
        files,
        mut sharder,
    } = gated_ring(cluster, &client, "restart", settings).await?;

    let syncs = records_of(&sharder, EVENT_SYNC_STARTED);

    let dir = cluster
        .state_dir()
        .context("the dedicated control plane has no state directory")?;
    let mut apiserver = ApiServer::new(dir);
    // Down 3 s between the processes, the chaos tool's longest: errors pile up in the watch's
    // backoff (refused connections, then an expired resource version).
    let restarted = apiserver.restart(&client, Duration::from_secs(3)).await?;
    println!(
        "kube-apiserver stopped in {:?}, ready {:?} after starting again",
        restarted.stopping, restarted.starting
    );
    // Otherwise the restart tested nothing.
    sharder
        .wait_for_record("the missed-assignment watch to fail", WAIT, |r| {
            r["event"] == EVENT_MISSED_ASSIGNMENT_WATCH_FAILED
        })
        .await?;
    // The API server calls the webhook again (its configurations are watched anew, too).
    wait_webhook(&client, &ns, &ring, &shards).await?;

    gate.close();
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let key = labels::shard_label(&ring);
    let drain = labels::drain_label(&ring);
    for i in 0..20 {
        let name = format!("missed-{i}");
        let created = secrets
            .create(&PostParams::default(), &secret(&name))
            .await?;
        ensure!(
            !created.labels().contains_key(&key),
            "the webhook was reachable during the outage: {name} was assigned"
        );
    }
    // Seen by the watch, which the closed gate keeps from assigning them.
    poll_until(
        "the missed-assignment watch to see the 20 missed objects",
        Duration::from_secs(10),
        || async {
            let backlog = counter(
                &files.metrics()?,
                "controller_sharding_missed_assignment_backlog",
                &ring,
                "secrets",
            )?;
            Ok((backlog >= 20).then_some(()))
        },
    )
    .await?;
    gate.open();
    let reopened = std::time::Instant::now();

    let predicted = IndependentRing::unweighted(shards);
    poll_until(
        "every missed object to be assigned",
        Duration::from_secs(10),
        || async {
            let list = secrets.list(&ListParams::default()).await?;
            let done = list.items.iter().all(|s| {
                let want = expected_shard(&predicted, &ns, &s.name_any());
                s.labels().get(&key).map(String::as_str) == want && !s.labels().contains_key(&drain)
            });
            Ok((list.items.len() == 20 && done).then_some(()))
        },
    )
    .await?;
    println!(
        "missed objects assigned {:?} after the webhook answered again",
        reopened.elapsed()
    );

    ensure!(
        sharder.try_status()?.is_none(),
        "the sharder exited across the restart"
    );
    ensure!(
        records_of(&sharder, EVENT_SYNC_STARTED) == syncs,
        "a sync started across the restart: it, not the missed-assignment watch, may have \
         assigned the objects"
    );
    ensure!(
        records_of(&sharder, EVENT_LEADERSHIP_ACQUIRED) == 1,
        "the sharder lost leadership across the restart: its new term started a fresh watch"
    );
    sharder.passed();
    Ok(())
}

/// Objects created in a namespace while no ring selects it are left alone; once the namespace gains
/// the ring's selector label, the missed-assignment watch starts watching it and assigns them
/// within seconds. The periodic sync is an hour away and no sync starts meanwhile, so only that
/// watch can have done it. When the namespace loses the label again, its watch stops.
#[tokio::test]
async fn objects_of_a_namespace_that_joins_a_ring_are_assigned_within_seconds() -> anyhow::Result<()>
{
    let DedicatedScenario {
        dedicated, client, ..
    } = DedicatedScenario::open().await?;
    let cluster = dedicated.cluster();
    let ring = unique_name("joins");
    let selected_label = "e2e.sharding.timebertt.dev/ring";
    let select = |value: Option<&str>| json!({"metadata": {"labels": {selected_label: value}}});
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone());
    // The Leases live in a namespace the ring selects from the start; the objects in one it
    // comes to select later.
    let home = cluster.namespace(&client, "joins-home").await?;
    namespaces
        .patch(
            &home,
            &e2e::patch_params(),
            &Patch::Merge(select(Some(&ring))),
        )
        .await?;
    let late = cluster.namespace(&client, "joins-late").await?;
    let spec = kube_sharding_api::ClusterRingSpec {
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(selected_label.to_string(), ring.clone())])),
            match_expressions: None,
        }),
        ..ring_spec(&home)
    };
    create_ring(&client, &ring, spec).await?;
    let shards = ["shard-a", "shard-b"];
    for shard in shards {
        create_lease(&client, &home, &ring, shard, 3600).await?;
    }
    let settings = SharderSettings {
        sync_period: "1h".into(),
        ..Default::default()
    };
    let files = SharderFiles::create(cluster.kubeconfig(), &settings)?;
    let mut sharder = files.start_process()?;
    files.wait_ready(STARTUP).await?;
    wait_status(&client, &ring, 2, 2).await?;
    wait_webhook(&client, &home, &ring, &shards).await?;
    sharder
        .wait_for_record("the ring's first sync to finish", STARTUP, |r| {
            r["event"] == EVENT_SYNC_FINISHED
        })
        .await?;
    let syncs = records_of(&sharder, EVENT_SYNC_STARTED);
    // The sharder's only namespace-scoped watch of Secrets is the one of `home`.
    let namespace_watches = || {
        cluster.apiserver_metric(
            "apiserver_longrunning_requests",
            &[
                ("verb", "WATCH"),
                ("resource", "secrets"),
                ("scope", "namespace"),
            ],
        )
    };
    poll_until("one namespace-scoped watch of Secrets", WAIT, || async {
        Ok((namespace_watches()? == 1).then_some(()))
    })
    .await?;

    let secrets = Api::<Secret>::namespaced(client.clone(), &late);
    let key = labels::shard_label(&ring);
    for i in 0..20 {
        let name = format!("early-{i}");
        let created = secrets
            .create(&PostParams::default(), &secret(&name))
            .await?;
        ensure!(
            !created.labels().contains_key(&key),
            "{name} was assigned in a namespace the ring does not select"
        );
    }
    namespaces
        .patch(
            &late,
            &e2e::patch_params(),
            &Patch::Merge(select(Some(&ring))),
        )
        .await?;
    let joined = std::time::Instant::now();

    let predicted = IndependentRing::unweighted(shards);
    poll_until(
        "every object of the joining namespace to be assigned",
        Duration::from_secs(10),
        || async {
            let list = secrets.list(&ListParams::default()).await?;
            let done = list.items.iter().all(|s| {
                let want = expected_shard(&predicted, &late, &s.name_any());
                want.is_some() && s.labels().get(&key).map(String::as_str) == want
            });
            Ok((list.items.len() == 20 && done).then_some(()))
        },
    )
    .await?;
    println!(
        "objects of the joining namespace assigned {:?} after it was labelled",
        joined.elapsed()
    );
    ensure!(
        records_of(&sharder, EVENT_SYNC_STARTED) == syncs,
        "a sync started after the namespace joined: it, not the missed-assignment watch, may have \
         assigned the objects"
    );
    ensure!(
        namespace_watches()? == 2,
        "the joining namespace is not watched on its own"
    );

    // The namespace leaves the ring: its watch stops.
    namespaces
        .patch(&late, &e2e::patch_params(), &Patch::Merge(select(None)))
        .await?;
    poll_until("the left namespace's watch to stop", WAIT, || async {
        Ok((namespace_watches()? == 1).then_some(()))
    })
    .await?;
    sharder.passed();
    Ok(())
}

/// Ready condition of ClusterRing `ring` as (status, reason).
async fn ready_of(client: &kube::Client, ring: &str) -> anyhow::Result<(String, String)> {
    let object = Api::<kube_sharding_api::ClusterRing>::all(client.clone())
        .get(ring)
        .await?;
    Ok(object
        .ready_condition()
        .map(|c| (c.status.clone(), c.reason.clone()))
        .unwrap_or_default())
}

/// A ring whose webhook the API server cannot call (here: every call refused) sends no move per
/// object over and over: its moves stop after the first miss, a dry-run probe checks every few
/// seconds, the ring reports `Ready=False` (`WebhookUnreachable`), an Event and a metric, and a
/// healthy ring next to it stays Ready. Once the webhook answers, the objects it missed are
/// assigned within seconds and the ring is Ready again.
#[tokio::test]
async fn a_ring_whose_webhook_is_unreachable_sends_no_moves() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated, client, ..
    } = DedicatedScenario::open().await?;
    let cluster = dedicated.cluster();
    let healthy_ns = cluster.namespace(&client, "healthy").await?;
    let broken_ns = cluster.namespace(&client, "broken").await?;
    let (healthy, broken) = (unique_name("healthy"), unique_name("broken"));
    let shards = ["shard-a", "shard-b"];
    let (gate, files, mut sharder) = gated_sharder(cluster, SharderSettings::default()).await?;
    for (ring, ns) in [(&healthy, &healthy_ns), (&broken, &broken_ns)] {
        create_ring(&client, ring, ring_spec(ns)).await?;
        for shard in shards {
            create_lease(&client, ns, ring, shard, 3600).await?;
        }
    }
    files.wait_ready(STARTUP).await?;
    for (ring, ns) in [(&healthy, &healthy_ns), (&broken, &broken_ns)] {
        wait_status(&client, ring, 2, 2).await?;
        wait_webhook(&client, ns, ring, &shards).await?;
    }
    let create = |ns: &str, count: usize| {
        let api = Api::<Secret>::namespaced(client.clone(), ns);
        async move {
            for i in 0..count {
                api.create(&PostParams::default(), &secret(&format!("s-{i}")))
                    .await?;
            }
            anyhow::Ok(())
        }
    };
    create(&healthy_ns, 100).await?;

    // From here the API server cannot call the webhook: 300 objects are created unassigned.
    gate.close();
    create(&broken_ns, 300).await?;
    let patches_before = cluster.apiserver_metric(
        "apiserver_request_total",
        &[("verb", "PATCH"), ("resource", "secrets")],
    )?;
    poll_until("the broken ring reported as unreachable", WAIT, || async {
        let ready = ready_of(&client, &broken).await?;
        Ok((ready == ("False".into(), "WebhookUnreachable".into())).then_some(()))
    })
    .await?;
    // Let the sharder retry for a while: it must not send a move per object again and again.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let patches = cluster.apiserver_metric(
        "apiserver_request_total",
        &[("verb", "PATCH"), ("resource", "secrets")],
    )? - patches_before;
    eprintln!(
        "webhook unreachable: {patches} PATCHes of Secrets in about 15 s for 300 missed objects"
    );
    ensure!(
        patches < 60,
        "{patches} PATCHes of Secrets while the webhook was unreachable"
    );
    let metrics = files.metrics()?;
    ensure!(
        metrics.lines().any(|l| l
            == format!(r#"controller_sharding_webhook_unreachable{{clusterring="{broken}"}} 1"#)),
        "no unreachable metric for {broken}"
    );
    let events = Api::<k8s_openapi::api::core::v1::Event>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    ensure!(
        events
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("WebhookUnreachable")
                && e.involved_object.name.as_deref() == Some(broken.as_str())),
        "no WebhookUnreachable Event on {broken}"
    );
    ensure!(
        ready_of(&client, &healthy).await?.0 == "True",
        "the healthy ring stays Ready"
    );

    // The webhook answers again: every missed object lands within seconds, the ring is Ready.
    gate.open();
    let reopened = std::time::Instant::now();
    let secrets = Api::<Secret>::namespaced(client.clone(), &broken_ns);
    let key = labels::shard_label(&broken);
    let predicted = IndependentRing::unweighted(shards);
    poll_until(
        "every missed object assigned",
        Duration::from_secs(15),
        || async {
            let list = secrets.list_metadata(&ListParams::default()).await?;
            Ok(list
                .items
                .iter()
                .all(|s| {
                    s.labels().get(&key).map(String::as_str)
                        == expected_shard(&predicted, &broken_ns, &s.name_any())
                })
                .then_some(()))
        },
    )
    .await?;
    let assigned_after = reopened.elapsed();
    poll_until("the broken ring Ready again", WAIT, || async {
        Ok((ready_of(&client, &broken).await?.0 == "True").then_some(()))
    })
    .await?;
    eprintln!("webhook answering again: 300 objects assigned {assigned_after:?} after");
    sharder.terminate()?;
    sharder.wait(Duration::from_secs(15)).await?;
    sharder.passed();
    Ok(())
}

/// A CRD that stops serving the version the sharder discovered is looked up again: the sync
/// that got 404 for the old version forgets it, the ring's view is rebuilt with the new one, and
/// rebalancing goes on without a restart.
#[tokio::test]
async fn a_crd_changing_its_served_version_is_discovered_again() -> anyhow::Result<()> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{ApiResource, DynamicObject};
    use kube::runtime::wait::{await_condition, conditions};

    let SharedScenario {
        mut logs,
        cluster,
        client,
        ..
    } = SharedScenario::open().await?;
    let group = format!("{}.example.com", unique_name("versions"));
    let crd_name = format!("gadgets.{group}");
    let version = |name: &str, served: bool, storage: bool| {
        json!({"name": name, "served": served, "storage": storage, "schema": {"openAPIV3Schema": {
            "type": "object", "x-kubernetes-preserve-unknown-fields": true}}})
    };
    let crd = |versions: Vec<serde_json::Value>| -> anyhow::Result<CustomResourceDefinition> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": crd_name},
            "spec": {"group": group, "scope": "Namespaced",
                "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget", "listKind": "GadgetList"},
                "versions": versions},
        }))?)
    };
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    let apply = PatchParams::apply("e2e-versions").force();
    crds.patch(
        &crd_name,
        &apply,
        &Patch::Apply(&crd(vec![version("v1", true, true)])?),
    )
    .await?;
    tokio::time::timeout(
        Duration::from_secs(30),
        await_condition(crds.clone(), &crd_name, conditions::is_crd_established()),
    )
    .await??;

    let ns = cluster.namespace(&client, "versions").await?;
    let ring = unique_name("versions");
    for shard in ["shard-a", "shard-b"] {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    let mut spec = ring_spec(&ns);
    spec.resources = vec![kube_sharding_api::RingResource::new(
        group.clone(),
        "gadgets",
    )];
    create_ring(&client, &ring, spec).await?;
    wait_status(&client, &ring, 2, 2).await?;
    let resource = |v: &str| {
        ApiResource::from_gvk_with_plural(
            &kube::core::GroupVersionKind::gvk(&group, v, "Gadget"),
            "gadgets",
        )
    };
    let v1 = Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &resource("v1"));
    let key = labels::shard_label(&ring);
    // The webhook does not care about versions; wait until it assigns, then create the objects.
    poll_until("gadgets assigned on create", WAIT, || async {
        let params = PostParams {
            dry_run: true,
            ..Default::default()
        };
        let probe = DynamicObject::new("probe", &resource("v1"));
        let created = v1.create(&params, &probe).await?;
        Ok(created.labels().contains_key(&key).then_some(()))
    })
    .await?;
    for i in 0..20 {
        v1.create(
            &PostParams::default(),
            &DynamicObject::new(&format!("g-{i}"), &resource("v1")),
        )
        .await?;
    }

    // v2 replaces v1, which is no longer served.
    crds.patch(
        &crd_name,
        &apply,
        &Patch::Apply(&crd(vec![
            version("v1", false, false),
            version("v2", true, true),
        ])?),
    )
    .await?;
    let v2 = Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &resource("v2"));
    poll_until("v2 served", WAIT, || async {
        Ok(v2
            .list_metadata(&ListParams::default())
            .await
            .ok()
            .map(|_| ()))
    })
    .await?;
    // A shard joins: the sync must list the gadgets with v2 and drain those moving to it.
    create_lease(&client, &ns, &ring, "shard-c", 3600).await?;
    let three = IndependentRing::unweighted(["shard-a", "shard-b", "shard-c"]);
    let drain = labels::drain_label(&ring);
    poll_until(
        "gadgets moving to shard-c drained",
        Duration::from_secs(60),
        || async {
            let list = v2.list_metadata(&ListParams::default()).await?;
            Ok(list
                .items
                .iter()
                .all(|g| {
                    let want =
                        three.try_shard_for(&format!("{group}/Gadget/{ns}/{}", g.name_any()));
                    let have = g.labels().get(&key).map(String::as_str);
                    (have == want) != g.labels().contains_key(&drain)
                })
                .then_some(()))
        },
    )
    .await?;
    crds.delete(&crd_name, &Default::default()).await?;
    logs.passed();
    Ok(())
}
