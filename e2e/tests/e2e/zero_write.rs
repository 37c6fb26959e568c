//! Zero-write rings, the sharder's side (docs/zero-write-rings.md): a ring with
//! `assignment: ServerSide` gets hash ranges published on its shards' Leases, revoke before
//! grant, and the sharder neither writes, lists nor watches the ring's objects. The tests play
//! the shards: they hold the Leases and write the acknowledgements a shard would.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use e2e::fixtures::{
    WAIT, create_annotated_lease, create_lease, create_ring, ring_spec, wait_status,
};
use e2e::process::poll_until;
use e2e::scenario::{DedicatedScenario, SharedScenario};
use e2e::sharder_process::{SharderFiles, SharderSettings};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, PodTemplate};
use kube::api::{Api, ListParams, ObjectMeta, Patch, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use kube_sharding_api::labels::{ANNOTATION_RELEASED_BY, ANNOTATION_WEIGHT, SHARD_LABEL_PREFIX};
use kube_sharding_api::range_lease::{
    ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES, Acknowledgement, PublishedRanges,
};
use kube_sharding_api::ranges::{RangeRing, RangeSet};
use kube_sharding_api::{
    Assignment, ClusterRing, ClusterRingSpec, GroupResource, HashKey, RingKind, RingRef,
    RingResource,
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// How long the test holds back one shard's acknowledgement of its revoke.
const ACK_DELAY: Duration = Duration::from_secs(5);

/// How long a sharder process of its own may take to start.
const LEADER_STARTUP: Duration = Duration::from_secs(60);

/// Objects created in the ring's resource, none of which the sharder may write.
const OBJECTS: usize = 1_000;

/// One version of a shard Lease, as the test's watch saw it (in the API server's order).
#[derive(Clone, Debug)]
pub(crate) struct Version {
    at: Instant,
    shard: String,
    /// The holder is the shard itself.
    held: bool,
    published: Option<PublishedRanges>,
    acknowledged: Option<u64>,
}

fn version_of(lease: &Lease) -> Version {
    let shard = lease.name_any();
    let holder = lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .unwrap_or_default();
    let annotations = lease.annotations();
    Version {
        at: Instant::now(),
        held: holder == shard,
        published: annotations
            .get(ANNOTATION_RANGES)
            .map(|v| v.parse().expect("the sharder writes valid ranges")),
        acknowledged: annotations
            .get(ANNOTATION_ACKNOWLEDGED)
            .and_then(|v| v.parse::<Acknowledgement>().ok())
            .map(|a| a.generation),
        shard,
    }
}

/// Whether two sets share a hash.
fn overlap(a: &RangeSet, b: &RangeSet) -> bool {
    a.ranges().iter().any(|x| {
        b.ranges()
            .iter()
            .any(|y| u128::from(x.start()) < y.end() && u128::from(y.start()) < x.end())
    })
}

/// Whether `sets` are disjoint and cover the whole 64-bit space.
pub(crate) fn is_partition<'a>(sets: impl IntoIterator<Item = &'a RangeSet>) -> bool {
    let sets: Vec<&RangeSet> = sets.into_iter().collect();
    let disjoint = sets
        .iter()
        .enumerate()
        .all(|(i, a)| sets[i + 1..].iter().all(|b| !overlap(a, b)));
    let union = RangeSet::new(sets.iter().flat_map(|s| s.ranges().iter().copied()));
    disjoint && union == RangeSet::full()
}

/// Replays `versions` as the design defines holding: a shard holds a hash from the publication
/// that contains it until it acknowledges a generation without it, and nothing once its Lease is
/// no longer held by it. Returns every point at which two shards held the same hash.
pub(crate) fn overlaps(versions: &[Version]) -> Vec<String> {
    let mut publications: BTreeMap<&str, Vec<(u64, RangeSet)>> = BTreeMap::new();
    let mut found = Vec::new();
    for (i, version) in versions.iter().enumerate() {
        let entries = publications.entry(&version.shard).or_default();
        if !version.held {
            entries.clear();
        } else {
            if let Some(published) = &version.published
                && entries.last().map(|(g, _)| *g) != Some(published.generation())
            {
                entries.push((published.generation(), published.ranges().clone()));
            }
            if let Some(acknowledged) = version.acknowledged
                && let Some(from) = entries.iter().rposition(|(g, _)| *g <= acknowledged)
            {
                entries.drain(..from);
            }
        }
        let held: Vec<(&str, RangeSet)> = publications
            .iter()
            .map(|(shard, entries)| {
                let set =
                    RangeSet::new(entries.iter().flat_map(|(_, s)| s.ranges().iter().copied()));
                (*shard, set)
            })
            .collect();
        for (j, (a, set_a)) in held.iter().enumerate() {
            for (b, set_b) in &held[j + 1..] {
                if overlap(set_a, set_b) {
                    found.push(format!(
                        "after version {i} ({version:?}): {a} and {b} both hold ranges"
                    ));
                }
            }
        }
    }
    found
}

/// Records every version of the ring's shard Leases in `namespace` until `stop`.
pub(crate) fn record(
    client: &Client,
    namespace: &str,
    ring: &str,
    stop: CancellationToken,
) -> Arc<Mutex<Vec<Version>>> {
    let versions = Arc::new(Mutex::new(Vec::new()));
    let api = Api::<Lease>::namespaced(client.clone(), namespace);
    let config = watcher::Config::default()
        .labels(&format!("{}={ring}", RingKind::ClusterRing.lease_label()));
    let sink = Arc::clone(&versions);
    tokio::spawn(async move {
        let mut events = watcher(api, config).boxed();
        loop {
            let event = tokio::select! {
                () = stop.cancelled() => return,
                event = events.try_next() => event,
            };
            match event {
                Ok(Some(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease))) => {
                    sink.lock().expect("not poisoned").push(version_of(&lease));
                }
                Ok(Some(_)) => {}
                Ok(None) => return,
                Err(error) => eprintln!("Lease watch: {error}"),
            }
        }
    });
    versions
}

/// Plays the shards' acknowledgements: every Lease held by its shard acknowledges its published
/// generation, a shard in `delays` only that long after it first saw the generation.
pub(crate) fn acknowledge(
    client: &Client,
    namespace: &str,
    delays: Arc<Mutex<BTreeMap<String, Duration>>>,
    stop: CancellationToken,
) {
    let api = Api::<Lease>::namespaced(client.clone(), namespace);
    tokio::spawn(async move {
        let mut first_seen: BTreeMap<(String, u64), Instant> = BTreeMap::new();
        while !stop.is_cancelled() {
            if let Ok(leases) = api.list(&ListParams::default()).await {
                for lease in leases {
                    let version = version_of(&lease);
                    let Some(published) = version.published.filter(|_| version.held) else {
                        continue;
                    };
                    let generation = published.generation();
                    if version.acknowledged == Some(generation) {
                        continue;
                    }
                    let seen = *first_seen
                        .entry((version.shard.clone(), generation))
                        .or_insert_with(Instant::now);
                    let delay = delays
                        .lock()
                        .expect("not poisoned")
                        .get(&version.shard)
                        .copied()
                        .unwrap_or_default();
                    if seen.elapsed() < delay {
                        continue;
                    }
                    let patch = json!({"metadata": {
                        "resourceVersion": lease.resource_version(),
                        "annotations": {ANNOTATION_ACKNOWLEDGED: generation.to_string()},
                    }});
                    // A conflict (the sharder wrote meanwhile) is retried on the next round.
                    let _ = api
                        .patch(&version.shard, &e2e::patch_params(), &Patch::Merge(&patch))
                        .await;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// Waits until `shards` (with their weights) have exactly their share of a [`RangeRing`] of them
/// published and acknowledged on their Leases; returns the publications.
pub(crate) async fn wait_settled(
    client: &Client,
    namespace: &str,
    shards: &[(&str, u32)],
) -> anyhow::Result<BTreeMap<String, PublishedRanges>> {
    let target = RangeRing::weighted(shards.iter().copied()).ranges();
    let api = Api::<Lease>::namespaced(client.clone(), namespace);
    poll_until(&format!("ranges of {shards:?} to settle"), WAIT, || {
        let (api, target) = (api.clone(), target.clone());
        async move {
            let mut settled = BTreeMap::new();
            for (shard, _) in shards {
                let version = version_of(&api.get(shard).await?);
                match version.published {
                    Some(p)
                        if version.acknowledged == Some(p.generation())
                            && Some(p.ranges()) == target.get(*shard) =>
                    {
                        settled.insert((*shard).to_string(), p);
                    }
                    _ => return Ok(None),
                }
            }
            Ok(Some(settled))
        }
    })
    .await
}

pub(crate) async fn range_generation(client: &Client, ring: &str) -> anyhow::Result<Option<u64>> {
    let ring = Api::<ClusterRing>::all(client.clone()).get(ring).await?;
    Ok(ring.status.and_then(|s| s.range_generation))
}

/// Leases of three shards of ClusterRing `ring`: `shard-a` and `shard-b` of weight 1, `shard-c`
/// of weight 2.
pub(crate) async fn create_three_shards(
    client: &Client,
    ns: &str,
    ring: &str,
) -> anyhow::Result<()> {
    for shard in ["shard-a", "shard-b"] {
        create_lease(client, ns, ring, shard, 3600).await?;
    }
    let ring_ref = RingRef::new(RingKind::ClusterRing, ring);
    create_annotated_lease(
        client,
        ns,
        &ring_ref,
        "shard-c",
        3600,
        [(ANNOTATION_WEIGHT, "2")],
    )
    .await?;
    Ok(())
}

pub(crate) fn server_side_spec(namespace: &str, resource: &str) -> ClusterRingSpec {
    ClusterRingSpec {
        resources: vec![RingResource::new("", resource)],
        assignment: Some(Assignment::ServerSide),
        ..ring_spec(namespace)
    }
}

#[tokio::test]
async fn a_server_side_ring_revokes_before_it_grants_and_writes_no_object() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("zero-write").await?;
    let ring = e2e::unique_name("zero-write");
    create_ring(&client, &ring, server_side_spec(&ns, "configmaps")).await?;

    // The ring's objects, before any shard: the sharder may write none of them.
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let created: BTreeMap<String, Option<String>> = futures::stream::iter(0..OBJECTS)
        .map(|i| {
            let configmaps = configmaps.clone();
            async move {
                let object = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(format!("object-{i}")),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let created = configmaps.create(&PostParams::default(), &object).await?;
                anyhow::Ok((created.name_any(), created.resource_version()))
            }
        })
        .buffer_unordered(32)
        .try_collect()
        .await?;

    let stop = CancellationToken::new();
    let _stop_on_drop = stop.clone().drop_guard();
    let versions = record(&client, &ns, &ring, stop.clone());
    let delays = Arc::new(Mutex::new(BTreeMap::new()));
    acknowledge(&client, &ns, Arc::clone(&delays), stop.clone());

    // Three shards, one of weight 2: each gets its share, the shares partition the space.
    create_three_shards(&client, &ns, &ring).await?;
    let three = wait_settled(
        &client,
        &ns,
        &[("shard-a", 1), ("shard-b", 1), ("shard-c", 2)],
    )
    .await?;
    let share = three["shard-c"].ranges().share();
    ensure!(
        share > 0.3,
        "shard-c of weight 2 got {share:.2} of the space, not about half"
    );
    ensure!(
        is_partition(three.values().map(PublishedRanges::ranges)),
        "the three shards' ranges do not partition the space: {three:?}"
    );
    wait_status(&client, &ring, 3, 3).await?;
    let before = three
        .values()
        .map(PublishedRanges::generation)
        .max()
        .unwrap_or(0);
    let recorded = poll_until("status.rangeGeneration", WAIT, || async {
        Ok(range_generation(&client, &ring)
            .await?
            .filter(|g| *g >= before))
    })
    .await?;
    ensure!(
        recorded == before,
        "status.rangeGeneration {recorded}, latest publication {before}"
    );

    // A fourth shard, while shard-a holds back its acknowledgements: the others are cut down
    // first, and shard-d gets its share only after every one of them acknowledged.
    delays
        .lock()
        .expect("not poisoned")
        .insert("shard-a".to_string(), ACK_DELAY);
    let scale_out = versions.lock().expect("not poisoned").len();
    create_lease(&client, &ns, &ring, "shard-d", 3600).await?;
    let four = [
        ("shard-a", 1),
        ("shard-b", 1),
        ("shard-c", 2),
        ("shard-d", 1),
    ];
    let settled = wait_settled(&client, &ns, &four).await?;
    ensure!(
        is_partition(settled.values().map(PublishedRanges::ranges)),
        "the four shards' ranges do not partition the space: {settled:?}"
    );
    let seen = versions.lock().expect("not poisoned").clone();
    let after: Vec<(usize, &Version)> = seen.iter().enumerate().skip(scale_out).collect();
    let target = RangeRing::weighted(four).ranges();
    // shard-a's revoke: its new share, a subset of its old one (consistent hashing only takes
    // from the shards that stay), published before shard-d got anything.
    let (revoke_at, revoke) = after
        .iter()
        .find_map(|(i, v)| {
            (v.shard == "shard-a")
                .then_some(v.published.as_ref())
                .flatten()
                .filter(|p| p.generation() > before)
                .map(|p| (*i, p.clone()))
        })
        .context("shard-a got no new publication")?;
    ensure!(
        Some(revoke.ranges()) == target.get("shard-a"),
        "shard-a's revoke is not its new share"
    );
    let (ack_at, acked) = after
        .iter()
        .find(|(_, v)| v.shard == "shard-a" && v.acknowledged >= Some(revoke.generation()))
        .map(|(i, v)| (*i, v.at))
        .context("shard-a never acknowledged its revoke")?;
    let (grant_at, granted) = after
        .iter()
        .find(|(_, v)| {
            v.shard == "shard-d" && v.published.as_ref().is_some_and(|p| !p.ranges().is_empty())
        })
        .map(|(i, v)| (*i, v.at))
        .context("shard-d got no ranges")?;
    let revoked_at = seen[revoke_at].at;
    ensure!(
        grant_at > ack_at && granted >= acked,
        "shard-d was granted ranges (version {grant_at}) before shard-a acknowledged its revoke (version {ack_at})"
    );
    ensure!(
        acked.duration_since(revoked_at) >= ACK_DELAY - Duration::from_millis(500),
        "shard-a acknowledged {:?} after its revoke: the delay did not hold",
        acked.duration_since(revoked_at)
    );
    println!(
        "scale-out: revoke to shard-a, its acknowledgement {:?} later, grant to shard-d {:?} after that",
        acked.duration_since(revoked_at),
        granted.duration_since(acked)
    );

    // shard-b releases its Lease as the shard library does: its ranges go to the others
    // without an acknowledgement of its own.
    Api::<Lease>::namespaced(client.clone(), &ns)
        .patch(
            "shard-b",
            &e2e::patch_params(),
            &Patch::Merge(json!({
                "metadata": {"annotations": {ANNOTATION_RELEASED_BY: "shard-b"}},
                "spec": {"holderIdentity": ""},
            })),
        )
        .await?;
    let remaining = wait_settled(
        &client,
        &ns,
        &[("shard-a", 1), ("shard-c", 2), ("shard-d", 1)],
    )
    .await?;
    ensure!(
        is_partition(remaining.values().map(PublishedRanges::ranges)),
        "the three remaining shards' ranges do not partition the space: {remaining:?}"
    );
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    poll_until(
        "the released Lease's ranges to be removed",
        WAIT,
        || async {
            let lease = leases.get("shard-b").await?;
            Ok((!lease.annotations().contains_key(ANNOTATION_RANGES)).then_some(()))
        },
    )
    .await?;
    wait_status(&client, &ring, 3, 4).await?;

    stop.cancel();
    let seen = versions.lock().expect("not poisoned").clone();
    let violations = overlaps(&seen);
    ensure!(
        violations.is_empty(),
        "{} points where two shards held the same hash, first: {:?}",
        violations.len(),
        violations.first()
    );
    println!("{} Lease versions checked, no hash held twice", seen.len());

    // Not one of the ring's objects was written, by the sharder or anyone.
    let now: BTreeMap<String, Option<String>> = configmaps
        .list(&ListParams::default())
        .await?
        .into_iter()
        .filter(|c| c.name_any().starts_with("object-"))
        .map(|c| {
            let labelled = c.labels().keys().any(|k| k.starts_with(SHARD_LABEL_PREFIX));
            (
                c.name_any(),
                (!labelled).then(|| c.resource_version()).flatten(),
            )
        })
        .collect();
    ensure!(
        now.len() == OBJECTS,
        "{} of {OBJECTS} objects left",
        now.len()
    );
    let written = created
        .iter()
        .filter(|(name, rv)| now.get(*name) != Some(*rv))
        .count();
    ensure!(
        written == 0,
        "{written} of {OBJECTS} objects were written or labelled"
    );
    logs.passed();
    Ok(())
}

/// The sum of the API server's requests of `verb` on PodTemplates so far.
fn podtemplate_requests(scenario: &SharedScenario, verb: &str) -> anyhow::Result<u64> {
    scenario.cluster.apiserver_metric(
        "apiserver_request_total",
        &[("resource", "podtemplates"), ("verb", verb)],
    )
}

/// Open watches of PodTemplates, by anyone.
fn podtemplate_watches(scenario: &SharedScenario) -> anyhow::Result<u64> {
    scenario.cluster.apiserver_metric(
        "apiserver_longrunning_requests",
        &[("resource", "podtemplates"), ("verb", "WATCH")],
    )
}

#[tokio::test]
async fn the_sharder_neither_lists_nor_watches_a_server_side_rings_objects() -> anyhow::Result<()> {
    // PodTemplates: no other test shards them, so every list or watch of them is the sharder's.
    let scenario = SharedScenario::in_namespace("zero-write-reads").await?;
    let (client, ns) = (scenario.client.clone(), scenario.ns.clone());
    let templates = Api::<PodTemplate>::namespaced(client.clone(), &ns);
    for i in 0..20 {
        let template: PodTemplate = serde_json::from_value(json!({
            "metadata": {"name": format!("template-{i}")},
            "template": {"spec": {"containers": [{"name": "main", "image": "example"}]}},
        }))?;
        templates.create(&PostParams::default(), &template).await?;
    }
    // The controller-manager's garbage collector watches every resource: count only what
    // the ring adds.
    let (lists, watches) = (
        podtemplate_requests(&scenario, "LIST")?,
        podtemplate_watches(&scenario)?,
    );
    let ring = e2e::unique_name("zero-write-reads");
    create_ring(&client, &ring, server_side_spec(&ns, "podtemplates")).await?;
    create_lease(&client, &ns, &ring, "shard-a", 3600).await?;
    wait_status(&client, &ring, 1, 1).await?;
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    poll_until("shard-a's ranges", WAIT, || async {
        let lease = leases.get("shard-a").await?;
        Ok(lease
            .annotations()
            .contains_key(ANNOTATION_RANGES)
            .then_some(()))
    })
    .await?;
    // A label ring's sync would have listed them by now; give a slow one a little more.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (lists_after, watches_after) = (
        podtemplate_requests(&scenario, "LIST")?,
        podtemplate_watches(&scenario)?,
    );
    ensure!(
        lists_after == lists && watches_after <= watches,
        "the sharder read a ServerSide ring's objects: {} lists, {} more open watches",
        lists_after - lists,
        watches_after.saturating_sub(watches)
    );

    // The control: the same ring with assignment Watch has them listed and watched.
    Api::<ClusterRing>::all(client.clone())
        .patch(
            &ring,
            &e2e::patch_params(),
            &Patch::Merge(json!({"spec": {"assignment": Assignment::Watch}})),
        )
        .await?;
    poll_until(
        "the sharder to read the Watch ring's objects",
        WAIT,
        || async {
            let read = podtemplate_requests(&scenario, "LIST")? > lists
                || podtemplate_watches(&scenario)? > watches;
            Ok(read.then_some(()))
        },
    )
    .await?;
    Api::<ClusterRing>::all(client.clone())
        .delete(&ring, &Default::default())
        .await?;
    let SharedScenario { mut logs, .. } = scenario;
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn a_server_side_ring_hashing_by_object_refuses_controlled_resources() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("zero-write-invalid").await?;
    let api = Api::<ClusterRing>::all(client.clone());
    let controlled =
        RingResource::controlling("", "secrets", [GroupResource::new("", "configmaps")]);
    let spec = ClusterRingSpec {
        resources: vec![controlled],
        assignment: Some(Assignment::ServerSide),
        ..ring_spec(&ns)
    };
    let refused = e2e::unique_name("zero-write-invalid");
    match api
        .create(
            &PostParams::default(),
            &ClusterRing::new(&refused, spec.clone()),
        )
        .await
    {
        Err(kube::Error::Api(status)) => ensure!(
            status.code == 422 && status.message.contains("assignment ServerSide"),
            "refused, but not by the rule: {status:?}"
        ),
        Ok(_) => anyhow::bail!(
            "a ServerSide ring hashing by object with controlled resources was accepted"
        ),
        Err(error) => return Err(error.into()),
    }
    // By namespace, controlled objects share their controller's namespace: allowed.
    let allowed = e2e::unique_name("zero-write-namespace");
    let by_namespace = ClusterRingSpec {
        hash_key: Some(HashKey::Namespace),
        ..spec
    };
    create_ring(&client, &allowed, by_namespace).await?;
    create_lease(&client, &ns, &allowed, "shard-a", 3600).await?;
    wait_status(&client, &allowed, 1, 1).await?;
    api.delete(&allowed, &Default::default()).await?;
    logs.passed();
    Ok(())
}

/// A sharder that starts after another led the ring continues the ring's range generations from
/// its `status.rangeGeneration`, even when no Lease shows them any more: both shards release
/// their Leases while no sharder runs, a third joins, and the new leader grants it the whole space
/// under a generation above every earlier one.
#[tokio::test]
async fn a_new_sharder_leader_continues_the_range_generations() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("zero-write-leader").await?;
    let cluster = dedicated.cluster();
    let ring = e2e::unique_name("zero-write-leader");
    create_ring(&client, &ring, server_side_spec(&ns, "configmaps")).await?;
    let stop = CancellationToken::new();
    let _stop_on_drop = stop.clone().drop_guard();
    let versions = record(&client, &ns, &ring, stop.clone());
    acknowledge(&client, &ns, Arc::default(), stop.clone());
    for shard in ["shard-a", "shard-b"] {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }

    let settings = SharderSettings::default();
    let first = SharderFiles::create(cluster.kubeconfig(), &settings)?;
    let mut process = first.start_process()?;
    first.wait_ready(LEADER_STARTUP).await?;
    let two = wait_settled(&client, &ns, &[("shard-a", 1), ("shard-b", 1)]).await?;
    let before = two
        .values()
        .map(PublishedRanges::generation)
        .max()
        .unwrap_or(0);
    poll_until("status.rangeGeneration", WAIT, || async {
        Ok((range_generation(&client, &ring).await? == Some(before)).then_some(()))
    })
    .await?;
    process.terminate()?;
    ensure!(
        process.wait(LEADER_STARTUP).await?.success(),
        "the first sharder exits 0 on SIGTERM"
    );
    process.passed();

    // With no sharder running, both shards stop and a third joins: only the ring's status
    // remembers the generations.
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    for shard in ["shard-a", "shard-b"] {
        let release = json!({
            "metadata": {"annotations": {ANNOTATION_RELEASED_BY: shard}},
            "spec": {"holderIdentity": ""},
        });
        leases
            .patch(shard, &e2e::patch_params(), &Patch::Merge(&release))
            .await?;
    }
    create_lease(&client, &ns, &ring, "shard-c", 3600).await?;
    let second = SharderFiles::create(cluster.kubeconfig(), &settings)?;
    let mut process = second.start_process()?;
    second.wait_ready(LEADER_STARTUP).await?;
    let one = wait_settled(&client, &ns, &[("shard-c", 1)]).await?;
    let after = one["shard-c"].generation();
    ensure!(
        one["shard-c"].ranges() == &RangeSet::full(),
        "shard-c alone does not hold the whole space"
    );
    ensure!(
        after > before,
        "the new leader granted shard-c generation {after}, not above {before}"
    );
    poll_until("status.rangeGeneration after the restart", WAIT, || async {
        Ok((range_generation(&client, &ring).await? == Some(after)).then_some(()))
    })
    .await?;
    stop.cancel();
    let seen = versions.lock().expect("not poisoned").clone();
    let violations = overlaps(&seen);
    ensure!(
        violations.is_empty(),
        "{} points where two shards held the same hash, first: {:?}",
        violations.len(),
        violations.first()
    );
    println!("generation {before} before the restart, {after} after");
    process.passed();
    Ok(())
}
