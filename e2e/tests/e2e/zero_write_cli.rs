//! `kubectl sharding` on zero-write rings, and namespace pins of rings hashing namespaces
//! (docs/kubectl-sharding.md, docs/zero-write-rings.md), against the real API server and the
//! shared sharder. The tests play the shards as `zero_write` does: they hold the Leases and write
//! the acknowledgements; every answer of the plugin is compared with the Leases' annotations and
//! the test's own [`RangeRing`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::{WAIT, create_lease, create_ring, wait_status};
use e2e::process::poll_until;
use e2e::scenario::SharedScenario;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ObjectMeta, Patch, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::range_lease::{
    ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES, Acknowledgement, PublishedRanges,
};
use kube_sharding_api::ranges::{RangeRing, RangeSet, fnv1a64};
use kube_sharding_api::{ClusterRingSpec, HashKey, RingKind, RingRef};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::cli::{json as plugin_json, table as plugin_table};
use crate::zero_write::{
    acknowledge, create_three_shards, overlaps, range_generation, record, server_side_spec,
};

/// What one shard Lease says about ranges.
struct LeaseRanges {
    published: Option<PublishedRanges>,
    acknowledged: Option<u64>,
}

/// The range annotations of every Lease in `namespace`, by shard.
async fn lease_ranges(
    client: &Client,
    namespace: &str,
) -> anyhow::Result<BTreeMap<String, LeaseRanges>> {
    let leases = Api::<Lease>::namespaced(client.clone(), namespace)
        .list(&Default::default())
        .await?;
    leases
        .into_iter()
        .map(|lease| {
            let annotations = lease.annotations();
            let published = annotations
                .get(ANNOTATION_RANGES)
                .map(|v| v.parse::<PublishedRanges>())
                .transpose()?;
            let acknowledged = annotations
                .get(ANNOTATION_ACKNOWLEDGED)
                .map(|v| v.parse::<Acknowledgement>().map(|a| a.generation))
                .transpose()?;
            Ok((
                lease.name_any(),
                LeaseRanges {
                    published,
                    acknowledged,
                },
            ))
        })
        .collect()
}

/// Waits until every shard of `target` has exactly its target published and acknowledged.
async fn wait_target(
    client: &Client,
    namespace: &str,
    target: &BTreeMap<String, RangeSet>,
) -> anyhow::Result<BTreeMap<String, PublishedRanges>> {
    poll_until("the ranges to settle on the target", WAIT, || async {
        let leases = lease_ranges(client, namespace).await?;
        let mut settled = BTreeMap::new();
        for (shard, set) in target {
            match leases.get(shard) {
                Some(LeaseRanges {
                    published: Some(p),
                    acknowledged,
                }) if p.ranges() == set && *acknowledged == Some(p.generation()) => {
                    settled.insert(shard.clone(), p.clone());
                }
                _ => return Ok(None),
            }
        }
        Ok(Some(settled))
    })
    .await
}

/// The share of `set` in percent as the plugin rounds it.
fn percent(set: &RangeSet) -> f64 {
    (set.share() * 10_000.0).round() / 100.0
}

/// Checks `status -o json`'s answer for `ring` against the Leases' annotations and `target`.
fn check_status(
    ring: &Value,
    leases: &BTreeMap<String, LeaseRanges>,
    target: &BTreeMap<String, RangeSet>,
    generation: Option<u64>,
) -> anyhow::Result<()> {
    ensure!(ring["assignment"] == "ServerSide", "{ring}");
    ensure!(
        ring["ranges"]["rangeGeneration"].as_u64() == generation,
        "rangeGeneration {} but the ring's status says {generation:?}",
        ring["ranges"]["rangeGeneration"]
    );
    let members = ring["members"].as_array().context("members")?;
    ensure!(
        members.len() == leases.len(),
        "{} members, {} Leases",
        members.len(),
        leases.len()
    );
    for member in members {
        let name = member["name"].as_str().context("name")?;
        let lease = leases.get(name).context("a member without a Lease")?;
        let ranges = &member["ranges"];
        let published = lease.published.as_ref();
        ensure!(
            ranges["generation"].as_u64() == published.map(PublishedRanges::generation),
            "{name}: generation {} but its Lease says {:?}",
            ranges["generation"],
            published.map(PublishedRanges::generation)
        );
        ensure!(
            ranges["acknowledged"].as_u64() == lease.acknowledged,
            "{name}: acknowledged {} but its Lease says {:?}",
            ranges["acknowledged"],
            lease.acknowledged
        );
        let set = published
            .map(PublishedRanges::ranges)
            .cloned()
            .unwrap_or_default();
        ensure!(
            ranges["ranges"].as_u64() == Some(set.ranges().len() as u64),
            "{name}: {} ranges but its Lease has {}",
            ranges["ranges"],
            set.ranges().len()
        );
        ensure!(
            ranges["sharePercent"].as_f64() == Some(percent(&set)),
            "{name}: share {} but its Lease's ranges hold {}",
            ranges["sharePercent"],
            percent(&set)
        );
        let wanted = target.get(name).cloned().unwrap_or_default();
        ensure!(
            ranges["targetSharePercent"].as_f64() == Some(percent(&wanted)),
            "{name}: target share {} but the ring's target is {}",
            ranges["targetSharePercent"],
            percent(&wanted)
        );
        let settled = published
            .is_some_and(|p| lease.acknowledged == Some(p.generation()) && p.ranges() == &wanted)
            || (published.is_none() && wanted.is_empty());
        ensure!(
            ranges["pending"].is_null() == settled,
            "{name}: pending {} but its Lease is {}settled",
            ranges["pending"],
            if settled { "" } else { "not " }
        );
    }
    Ok(())
}

/// A ConfigMap `name` in `namespace`; returns its uid.
async fn configmap(client: &Client, namespace: &str, name: &str) -> anyhow::Result<String> {
    let created = Api::<ConfigMap>::namespaced(client.clone(), namespace)
        .create(
            &PostParams::default(),
            &ConfigMap {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;
    created.uid().context("a created object has a uid")
}

/// The shard whose published ranges hold `hash`.
fn holder(leases: &BTreeMap<String, LeaseRanges>, hash: u64) -> Option<&str> {
    leases
        .iter()
        .find(|(_, l)| {
            l.published
                .as_ref()
                .is_some_and(|p| p.ranges().contains(hash))
        })
        .map(|(name, _)| name.as_str())
}

#[tokio::test]
async fn kubectl_sharding_reads_a_server_side_ring_from_its_leases() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("zero-write-cli").await?;
    let ring = e2e::unique_name("zero-write-cli");
    create_ring(&client, &ring, server_side_spec(&ns, "configmaps")).await?;
    let mut uids = Vec::new();
    for i in 0..20 {
        uids.push(configmap(&client, &ns, &format!("object-{i}")).await?);
    }
    let stop = CancellationToken::new();
    let _stop_on_drop = stop.clone().drop_guard();
    let delays = Arc::new(Mutex::new(BTreeMap::new()));
    acknowledge(&client, &ns, Arc::clone(&delays), stop.clone());
    create_three_shards(&client, &ns, &ring).await?;
    let ring_ref = RingRef::new(RingKind::ClusterRing, &ring);
    let three = [("shard-a", 1), ("shard-b", 1), ("shard-c", 2)];
    let target = RangeRing::weighted(three).ranges();
    wait_target(&client, &ns, &target).await?;
    wait_status(&client, &ring, 3, 3).await?;
    let generation = poll_until("status.rangeGeneration", WAIT, || async {
        let leases = lease_ranges(&client, &ns).await?;
        let latest = leases
            .values()
            .filter_map(|l| l.published.as_ref().map(PublishedRanges::generation))
            .max();
        let recorded = range_generation(&client, &ring).await?;
        Ok((recorded == latest).then_some(recorded))
    })
    .await?;

    // status: every shard as its Lease says, settled, and every object counted in the ranges
    // that hold its uid's hash.
    let status = plugin_json(&["status", &ring]).await?;
    let answer = &status["rings"][0];
    let leases = lease_ranges(&client, &ns).await?;
    check_status(answer, &leases, &target, generation)?;
    ensure!(answer["ranges"]["handoverPending"] == false, "{answer}");
    ensure!(
        answer["ranges"]["field"] == "object.metadata.uid",
        "{answer}"
    );
    let mut expected: BTreeMap<&str, u64> = BTreeMap::new();
    for uid in &uids {
        *expected
            .entry(holder(&leases, fnv1a64(uid)).context("a hash held by nobody")?)
            .or_default() += 1;
    }
    for member in answer["members"].as_array().context("members")? {
        let name = member["name"].as_str().context("name")?;
        ensure!(
            member["total"].as_u64() == Some(expected.get(name).copied().unwrap_or(0)),
            "{name}: {} objects, the Leases' ranges hold {:?} of the test's",
            member["total"],
            expected.get(name)
        );
    }
    let text = plugin_table(&["status", &ring]).await?;
    println!("{text}");
    ensure!(
        text.contains("assignment ServerSide, rangeGeneration ")
            && text.contains("settled: every shard holds its target and acknowledged it"),
        "{text}"
    );

    // explain: the object's hash, the shard whose published ranges hold it, the target's shard.
    let explained = plugin_json(&["explain", "configmap", "object-0", "-n", &ns]).await?;
    let answer = explained["rings"]
        .as_array()
        .context("rings")?
        .iter()
        .find(|r| r["ring"] == ring.as_str())
        .context("the ring explains the object")?;
    let hash = fnv1a64(&uids[0]);
    let holder_now = holder(&leases, hash).context("held")?;
    ensure!(
        answer["ranges"]["hash"] == format!("0x{hash:016x}")
            && answer["ranges"]["value"] == uids[0].as_str()
            && answer["ranges"]["heldBy"] == holder_now
            && answer["ranges"]["acknowledged"] == true
            && answer["desiredShard"].as_str() == RangeRing::weighted(three).owner(hash)
            && answer["verdict"] == "InPlace",
        "explain: {answer}, expected hash {hash:#018x} held by {holder_now}"
    );
    println!(
        "{}",
        plugin_table(&["explain", "configmap/object-0", "-n", &ns]).await?
    );

    // simulate: the share moving when shard-d joins is the newcomer's target share, all of it
    // coming to shard-d, from the shards that held it.
    let four = [
        ("shard-a", 1),
        ("shard-b", 1),
        ("shard-c", 2),
        ("shard-d", 1),
    ];
    let target_four = RangeRing::weighted(four).ranges();
    let simulated = plugin_json(&["simulate", &ring, "--add-shard", "shard-d"]).await?;
    let moved = simulated["movedSharePercent"]
        .as_f64()
        .context("moved share")?;
    ensure!(
        moved == percent(&target_four["shard-d"]),
        "simulate says {moved}% moves, shard-d's target is {}%",
        percent(&target_four["shard-d"])
    );
    for shard in simulated["shards"].as_array().context("shards")? {
        let name = shard["name"].as_str().context("name")?;
        ensure!(
            shard["shareAfterPercent"].as_f64() == Some(percent(&target_four[name])),
            "{name}: {shard}"
        );
    }
    println!(
        "{}",
        plugin_table(&["simulate", &ring, "--add-shard", "shard-d"]).await?
    );

    // A handover in progress: shard-a holds back its acknowledgement; status shows its pending
    // revoke exactly as its Lease says, then the settled ring of four.
    delays
        .lock()
        .expect("not poisoned")
        .insert("shard-a".to_string(), Duration::from_secs(8));
    create_lease(&client, &ns, &ring, "shard-d", 3600).await?;
    poll_until("status to show shard-a's pending revoke", WAIT, || async {
        let status = plugin_json(&["status", &ring]).await?;
        let answer = &status["rings"][0];
        let leases = lease_ranges(&client, &ns).await?;
        let a = &leases["shard-a"];
        let revoked = a.published.as_ref().is_some_and(|p| {
            Some(p.generation()) != a.acknowledged && p.ranges() == &target_four["shard-a"]
        });
        if !revoked || answer["ranges"]["handoverPending"] != true {
            return Ok(None);
        }
        let generation = range_generation(&client, &ring).await?;
        // The Leases may change between the two reads; a mismatch is read again.
        if check_status(answer, &leases, &target_four, generation).is_err() {
            return Ok(None);
        }
        let member = answer["members"]
            .as_array()
            .and_then(|m| m.iter().find(|m| m["name"] == "shard-a"))
            .cloned()
            .unwrap_or_default();
        ensure!(
            member["ranges"]["pending"]
                .as_str()
                .is_some_and(|p| p.starts_with("waiting for its acknowledgement of generation")),
            "{member}"
        );
        Ok(Some(()))
    })
    .await?;
    println!("{}", plugin_table(&["status", &ring]).await?);
    wait_target(&client, &ns, &target_four).await?;

    // A namespace pin cannot work on a ring hashing uids: the sharder reports it on the
    // Namespace, status lists it, and the ranges stay the hash ring's.
    Api::<Namespace>::all(client.clone())
        .patch(
            &ns,
            &e2e::patch_params(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {ring_ref.pin_annotation(): "shard-a"}}}),
            ),
        )
        .await?;
    wait_pin_event(&client, &ns, &ring, "is ignored").await?;
    let status = plugin_json(&["status", &ring]).await?;
    ensure!(
        status["rings"][0]["ranges"]["ignoredNamespacePins"] == json!([ns]),
        "{}",
        status["rings"][0]["ranges"]
    );
    wait_target(&client, &ns, &target_four).await?;
    poll_until("status to show the settled ring of four", WAIT, || async {
        let status = plugin_json(&["status", &ring]).await?;
        let leases = lease_ranges(&client, &ns).await?;
        let generation = range_generation(&client, &ring).await?;
        Ok(
            check_status(&status["rings"][0], &leases, &target_four, generation)
                .is_ok()
                .then_some(()),
        )
    })
    .await?;
    logs.passed();
    Ok(())
}

/// Waits for a `PinUnsatisfied` Warning Event on Namespace `namespace` about `ring` whose note
/// contains `words` (Events of cluster-scoped objects are in `default`).
async fn wait_pin_event(
    client: &Client,
    namespace: &str,
    ring: &str,
    words: &str,
) -> anyhow::Result<()> {
    let events = Api::<Event>::namespaced(client.clone(), "default");
    poll_until(
        &format!("a PinUnsatisfied Event on {namespace}"),
        WAIT,
        || async {
            let found = events
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .any(|e| {
                    e.reason.as_deref() == Some("PinUnsatisfied")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(namespace)
                        && e.note
                            .as_deref()
                            .is_some_and(|n| n.contains(ring) && n.contains(words))
                });
            Ok(found.then_some(()))
        },
    )
    .await
}

/// A `ServerSide` ring hashing namespaces over ConfigMaps in `namespace`.
fn namespace_spec(namespace: &str) -> ClusterRingSpec {
    ClusterRingSpec {
        hash_key: Some(HashKey::Namespace),
        ..server_side_spec(namespace, "configmaps")
    }
}

/// Sets (or with `None` removes) the pin of `ring` on namespace `namespace`.
async fn pin(
    client: &Client,
    namespace: &str,
    ring: &RingRef,
    shard: Option<&str>,
) -> anyhow::Result<()> {
    Api::<Namespace>::all(client.clone())
        .patch(
            namespace,
            &e2e::patch_params(),
            &Patch::Merge(json!({"metadata": {"annotations": {ring.pin_annotation(): shard}}})),
        )
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_namespace_pin_moves_the_namespaces_hash_revoke_before_grant() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("zero-write-pin").await?;
    let ring = e2e::unique_name("zero-write-pin");
    let ring_ref = RingRef::new(RingKind::ClusterRing, &ring);
    create_ring(&client, &ring, namespace_spec(&ns)).await?;
    configmap(&client, &ns, "object").await?;
    let stop = CancellationToken::new();
    let _stop_on_drop = stop.clone().drop_guard();
    let versions = record(&client, &ns, &ring, stop.clone());
    let delays = Arc::new(Mutex::new(BTreeMap::new()));
    acknowledge(&client, &ns, Arc::clone(&delays), stop.clone());
    let shards = ["shard-a", "shard-b", "shard-c"];
    for shard in shards {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    let hashes = RangeRing::new(shards);
    let plain = hashes.ranges();
    wait_target(&client, &ns, &plain).await?;

    // A pin to a shard that is not available decides nothing and is reported on the Namespace.
    pin(&client, &ns, &ring_ref, Some("shard-z")).await?;
    wait_pin_event(&client, &ns, &ring, "not an available shard").await?;
    let leases = lease_ranges(&client, &ns).await?;
    for (shard, set) in &plain {
        ensure!(
            leases[shard]
                .published
                .as_ref()
                .map(PublishedRanges::ranges)
                == Some(set),
            "{shard}'s ranges changed for a pin to an unavailable shard"
        );
    }

    // Pin the namespace to a shard the hash ring does not give it, while the owner holds back
    // its acknowledgement: the owner is cut down first, the pinned shard granted after.
    let hash = fnv1a64(&ns);
    let owner = hashes.owner(hash).context("an owner")?.to_string();
    let pinned = shards
        .into_iter()
        .find(|s| *s != owner)
        .context("another shard")?;
    delays
        .lock()
        .expect("not poisoned")
        .insert(owner.clone(), Duration::from_secs(3));
    pin(&client, &ns, &ring_ref, Some(pinned)).await?;
    let with_pin = hashes.ranges_with_pins([(ns.as_str(), pinned)]);
    let settled = wait_target(&client, &ns, &with_pin).await?;
    ensure!(
        settled[pinned].ranges().contains(hash) && !settled[&owner].ranges().contains(hash),
        "the pinned shard does not hold the namespace's hash: {settled:?}"
    );
    // Only the one hash moved.
    for shard in shards {
        let width = |set: &RangeSet| set.width();
        let change =
            i128::try_from(width(settled[shard].ranges()))? - i128::try_from(width(&plain[shard]))?;
        let expected = if shard == pinned {
            1
        } else if shard == owner {
            -1
        } else {
            0
        };
        ensure!(change == expected, "{shard} changed by {change} hashes");
    }

    // The plugin agrees: the object is held by the pinned shard, the pin is honoured.
    let explained = plugin_json(&["explain", "configmap", "object", "-n", &ns]).await?;
    let answer = explained["rings"]
        .as_array()
        .context("rings")?
        .iter()
        .find(|r| r["ring"] == ring.as_str())
        .context("the ring explains the object")?;
    ensure!(
        answer["ranges"]["heldBy"] == pinned
            && answer["desiredShard"] == pinned
            && answer["pin"]["state"] == "honoured"
            && answer["ranges"]["value"] == ns.as_str(),
        "{answer}"
    );
    let status = plugin_json(&["status", &ring]).await?;
    let pins = &status["rings"][0]["ranges"]["pinnedNamespaces"];
    ensure!(
        pins[0]["namespace"] == ns.as_str() && pins[0]["state"] == "honoured",
        "{pins}"
    );

    // Without the pin the hash goes back to its owner.
    pin(&client, &ns, &ring_ref, None).await?;
    wait_target(&client, &ns, &plain).await?;
    stop.cancel();
    let seen = versions.lock().expect("not poisoned").clone();
    let violations = overlaps(&seen);
    ensure!(
        violations.is_empty(),
        "{} points where two shards held the same hash, first: {:?}",
        violations.len(),
        violations.first()
    );
    println!(
        "{} Lease versions checked, no hash held twice; {ns} (hash {hash:#018x}) moved {owner} -> {pinned} -> {owner}",
        seen.len()
    );
    logs.passed();
    Ok(())
}
