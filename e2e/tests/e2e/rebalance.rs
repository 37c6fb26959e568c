//! Rebalancing with real checksum-controller shards (docs/protocol.md §9): scale out through
//! drains, graceful scale in and crashes through moves, missed webhooks, existing objects,
//! cluster-scoped resources.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::{
    ShardTiming, create_lease, create_ring, create_ring_of, expected_shard, ring_spec, secret,
    start_checksum_shard_of, wait_status_of, wait_webhook_of,
};
use e2e::process::{Process, poll_until};
use e2e::scenario::{DedicatedScenario, SharedScenario};
use e2e::sharder_process::{SharderFiles, SharderSettings};
use e2e::{IndependentRing, unique_name};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::ByteString;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::labels;
use kube_sharding_api::{ClusterRingSpec, GroupResource, RingKind, RingRef, RingResource};

/// Lease duration of a shard these tests kill, in seconds (that of [`KILLED`]): its objects move
/// once the sharder took its Lease over, twice this after its last renewal.
const LEASE_SECONDS: u32 = 4;

/// Timing of the shard these tests kill: a short Lease, so the takeover comes within seconds,
/// with a renew deadline of 3 s, so that the shard does not lose its Lease to a busy machine
/// before the test kills it ([`ShardTiming::FAST`]'s 2 s did, once, in a full run).
const KILLED: ShardTiming = ShardTiming("4", "3", "0.5");

/// Starts a shard that stays: with relaxed timing, so that a busy machine (CI runs many tests at
/// once) never costs it its Lease; a shard that lost its Lease stops, and the objects it should
/// take would wait for nobody.
fn start_shard(ring: &RingRef, namespace: &str, shard: &str) -> anyhow::Result<Process> {
    start_checksum_shard_of(ring, namespace, shard, ShardTiming::RELAXED)
}

/// A ClusterRing named `name`.
fn cluster_ring(name: String) -> RingRef {
    RingRef::new(RingKind::ClusterRing, name)
}

/// Starts one shard per name.
fn start_shards(
    ring: &RingRef,
    namespace: &str,
    names: &[&'static str],
) -> anyhow::Result<HashMap<&'static str, Process>> {
    names
        .iter()
        .map(|name| Ok((*name, start_shard(ring, namespace, name)?)))
        .collect()
}

/// Waits until the ring of `names` is available and assigning, creates `count` Secrets, and waits
/// until they and their ConfigMaps sit on their predicted shards; returns the assignments.
async fn populate(
    client: &Client,
    namespace: &str,
    ring: &RingRef,
    names: &[&str],
    count: usize,
) -> anyhow::Result<BTreeMap<String, String>> {
    let shards = i32::try_from(names.len())?;
    wait_status_of(client, ring, shards, shards).await?;
    wait_webhook_of(client, namespace, ring, names).await?;
    create_secrets(client, namespace, count).await?;
    wait_converged(
        client,
        namespace,
        ring,
        names,
        count,
        Duration::from_secs(120),
    )
    .await
}

/// Creates `count` Secrets with data, 20 at a time.
async fn create_secrets(client: &Client, namespace: &str, count: usize) -> anyhow::Result<()> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            async move {
                let mut s = secret(&format!("secret-{i}"));
                s.data = Some(BTreeMap::from([(
                    "value".to_string(),
                    ByteString(format!("v{i}").into_bytes()),
                )]));
                api.create(&PostParams::default(), &s).await
            }
        })
        .buffer_unordered(20)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// Shard label of every Secret and of every checksum ConfigMap (by its Secret's name).
async fn assignments(
    client: &Client,
    namespace: &str,
    ring: &RingRef,
) -> anyhow::Result<(
    BTreeMap<String, Option<String>>,
    BTreeMap<String, Option<String>>,
    usize,
)> {
    let key = ring.shard_label();
    let drain = ring.drain_label();
    let secrets = Api::<Secret>::namespaced(client.clone(), namespace)
        .list_metadata(&ListParams::default())
        .await?;
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), namespace)
        .list_metadata(&ListParams::default())
        .await?;
    let draining = secrets
        .items
        .iter()
        .filter(|s| s.labels().contains_key(&drain))
        .count();
    let secrets = secrets
        .items
        .iter()
        .map(|s| (s.name_any(), s.labels().get(&key).cloned()))
        .collect();
    let configmaps = configmaps
        .items
        .iter()
        .filter_map(|c| {
            let owner = c.name_any().strip_prefix("checksums-")?.to_string();
            Some((owner, c.labels().get(&key).cloned()))
        })
        .collect();
    Ok((secrets, configmaps, draining))
}

/// Waits until every Secret (and, with `with_configmaps`, its ConfigMap) is on the shard the ring
/// of `shards` predicts, with no drain label left; returns the Secret assignments.
async fn wait_converged(
    client: &Client,
    namespace: &str,
    ring: &RingRef,
    shards: &[&str],
    count: usize,
    timeout: Duration,
) -> anyhow::Result<BTreeMap<String, String>> {
    let predicted = IndependentRing::unweighted(shards);
    poll_until(
        &format!("{count} Secrets and ConfigMaps on {shards:?}"),
        timeout,
        || async {
            let (secrets, configmaps, draining) = assignments(client, namespace, ring).await?;
            let expected =
                |name: &str| expected_shard(&predicted, namespace, name).map(str::to_string);
            let secrets_ok = secrets.len() == count
                && secrets.iter().all(|(name, shard)| *shard == expected(name));
            let configmaps_ok = configmaps.len() == count
                && configmaps
                    .iter()
                    .all(|(owner, shard)| *shard == expected(owner));
            if secrets_ok && configmaps_ok && draining == 0 {
                Ok(Some(
                    secrets
                        .into_iter()
                        .map(|(n, s)| (n, s.unwrap_or_default()))
                        .collect(),
                ))
            } else {
                Ok(None)
            }
        },
    )
    .await
}

/// Waits until every Secret in `namespace` carries the shard the ring of `shards` predicts.
async fn wait_all_assigned(
    client: &Client,
    namespace: &str,
    ring: &RingRef,
    shards: &[&str],
    timeout: Duration,
) -> anyhow::Result<()> {
    let key = ring.shard_label();
    let predicted = IndependentRing::unweighted(shards);
    let secrets = Api::<Secret>::namespaced(client.clone(), namespace);
    poll_until("all Secrets assigned", timeout, || async {
        let list = secrets.list_metadata(&ListParams::default()).await?;
        Ok(list
            .items
            .iter()
            .all(|s| {
                s.labels().get(&key).map(String::as_str)
                    == expected_shard(&predicted, namespace, &s.name_any())
            })
            .then_some(()))
    })
    .await
}

fn record_is(record: &serde_json::Value, event: &str, namespace: &str, name: &str) -> bool {
    record["event"] == event && record["namespace"] == namespace && record["name"] == name
}

#[tokio::test]
async fn scale_out_drains_exactly_the_moved_objects() -> anyhow::Result<()> {
    scale_out(RingKind::ClusterRing).await
}

#[tokio::test]
async fn controller_ring_scale_out_drains_exactly_the_moved_objects() -> anyhow::Result<()> {
    scale_out(RingKind::ControllerRing).await
}

/// Scales a ring of `kind` out from three shards to four and checks the drain handshake.
async fn scale_out(kind: RingKind) -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("scaleout").await?;
    let ring = RingRef::new(kind, unique_name("scaleout"));
    create_ring_of(&client, &ring, ring_spec(&ns)).await?;
    let names = ["shard-0", "shard-1", "shard-2", "shard-3"];
    let mut shards = start_shards(&ring, &ns, &names[..3])?;
    let before = populate(&client, &ns, &ring, &names[..3], 300).await?;
    ensure!(sharder.counter_of("controller_sharding_drains_total", &ring, "secrets")? == 0);

    shards.insert(names[3], start_shard(&ring, &ns, names[3])?);
    wait_status_of(&client, &ring, 4, 4).await?;
    let after = wait_converged(&client, &ns, &ring, &names, 300, Duration::from_secs(120)).await?;
    let moved: Vec<(&String, &String)> = after
        .iter()
        .filter(|(name, shard)| before.get(*name) != Some(*shard))
        .map(|(name, _)| (name, &before[name]))
        .collect();
    ensure!(!moved.is_empty(), "adding a shard should move some Secrets");
    ensure!(
        moved.iter().all(|(name, _)| after[*name] == names[3]),
        "only the new shard gains Secrets"
    );
    let drains = sharder.counter_of("controller_sharding_drains_total", &ring, "secrets")?;
    ensure!(
        drains == moved.len() as u64,
        "every moved Secret went through exactly one drain: {drains} drains, {} moved",
        moved.len()
    );
    ensure!(
        sharder.counter_of("controller_sharding_movements_total", &ring, "secrets")? == 0,
        "Secrets of live shards are drained, never moved directly"
    );
    // The old shard acknowledged each drain and reconciled the Secret no more after that.
    for (name, old) in &moved {
        let records = shards[old.as_str()].records();
        let drained_at = records
            .iter()
            .position(|r| record_is(r, "drain", &ns, name))
            .with_context(|| format!("{old} has no drain record for {name}"))?;
        ensure!(
            !records[drained_at..]
                .iter()
                .any(|r| record_is(r, "reconcile", &ns, name)),
            "{old} reconciled {name} after acknowledging its drain"
        );
    }
    eprintln!(
        "{kind} scale out 3 -> 4: {} of 300 Secrets moved, {drains} drains",
        moved.len()
    );
    finish(shards.into_values());
    logs.passed();
    Ok(())
}

/// Ends a passed test's shards: SIGTERM, and no log dump when they are dropped.
fn finish(processes: impl IntoIterator<Item = Process>) {
    for mut p in processes {
        let _ = p.terminate();
        p.passed();
    }
}

#[tokio::test]
async fn graceful_scale_in_moves_without_drains() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("scalein").await?;
    let ring = cluster_ring(unique_name("scalein"));
    create_ring_of(&client, &ring, ring_spec(&ns)).await?;
    let names = ["shard-0", "shard-1", "shard-2"];
    let mut shards = start_shards(&ring, &ns, &names)?;
    populate(&client, &ns, &ring, &names, 60).await?;

    let mut leaving = shards.remove("shard-1").context("shard-1")?;
    leaving.terminate()?;
    let status = leaving.wait(Duration::from_secs(15)).await?;
    ensure!(status.success(), "shard exits cleanly on SIGTERM: {status}");
    leaving.passed();
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let lease = leases.get("shard-1").await?;
    ensure!(
        lease
            .spec
            .and_then(|s| s.holder_identity)
            .unwrap_or_default()
            .is_empty(),
        "Lease released on SIGTERM"
    );
    let started = std::time::Instant::now();
    wait_converged(
        &client,
        &ns,
        &ring,
        &["shard-0", "shard-2"],
        60,
        Duration::from_secs(15),
    )
    .await?;
    eprintln!(
        "graceful scale in: converged {:?} after SIGTERM",
        started.elapsed()
    );
    ensure!(
        sharder.counter_of("controller_sharding_drains_total", &ring, "secrets")? == 0,
        "no drains"
    );
    ensure!(
        sharder.counter_of("controller_sharding_movements_total", &ring, "secrets")? > 0,
        "moves"
    );
    // The released Lease becomes orphaned 60 s after it expired, and is deleted.
    poll_until("released Lease deleted", Duration::from_secs(90), || {
        let leases = leases.clone();
        async move { Ok(leases.get_opt("shard-1").await?.is_none().then_some(())) }
    })
    .await?;
    finish(shards.into_values());
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn crashed_shard_objects_move_after_takeover() -> anyhow::Result<()> {
    crash(RingKind::ClusterRing).await
}

#[tokio::test]
async fn controller_ring_crashed_shard_objects_move_after_takeover() -> anyhow::Result<()> {
    crash(RingKind::ControllerRing).await
}

/// Kills one of three shards of a ring of `kind` and checks its objects move after takeover.
async fn crash(kind: RingKind) -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("crash").await?;
    let ring = RingRef::new(kind, unique_name("crash"));
    create_ring_of(&client, &ring, ring_spec(&ns)).await?;
    let names = ["shard-0", "shard-1", "shard-2"];
    let mut shards = start_shards(&ring, &ns, &["shard-0", "shard-2"])?;
    // The one to be killed, with a short Lease, so that the takeover comes within seconds.
    shards.insert(
        "shard-1",
        start_checksum_shard_of(&ring, &ns, "shard-1", KILLED)?,
    );
    populate(&client, &ns, &ring, &names, 60).await?;

    let mut crashed = shards.remove("shard-1").context("shard-1")?;
    crashed.signal("KILL")?;
    let _ = crashed.wait(Duration::from_secs(5)).await?;
    crashed.passed();
    let started = std::time::Instant::now();
    // Uncertain 2×duration after the last renewal, then taken over; a few seconds of slack.
    let limit = Duration::from_secs(2 * u64::from(LEASE_SECONDS) + 8);
    wait_converged(&client, &ns, &ring, &["shard-0", "shard-2"], 60, limit).await?;
    eprintln!(
        "{kind} crash: converged {:?} after SIGKILL",
        started.elapsed()
    );
    let lease = Api::<Lease>::namespaced(client.clone(), &ns)
        .get("shard-1")
        .await?;
    ensure!(
        lease.spec.and_then(|s| s.holder_identity).as_deref() == Some("shardlease-controller"),
        "the sharder took the Lease over"
    );
    finish(shards.into_values());
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn existing_objects_are_assigned_and_unselected_namespaces_untouched() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("existing").await?;
    let other = cluster.namespace(&client, "existing-other").await?;
    // Objects first, ring afterwards.
    create_secrets(&client, &ns, 30).await?;
    let outside = Api::<Secret>::namespaced(client.clone(), &other);
    outside
        .create(&PostParams::default(), &secret("outside"))
        .await?;
    let ring = cluster_ring(unique_name("existing"));
    for shard in ["shard-a", "shard-b"] {
        create_lease(&client, &ns, &ring.name, shard, 3600).await?;
    }
    create_ring_of(&client, &ring, ring_spec(&ns)).await?;
    let key = ring.shard_label();
    wait_all_assigned(
        &client,
        &ns,
        &ring,
        &["shard-a", "shard-b"],
        Duration::from_secs(20),
    )
    .await?;
    ensure!(
        !outside.get("outside").await?.labels().contains_key(&key),
        "Secret in an unselected namespace was labelled"
    );
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn cluster_scoped_resources_are_assigned() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("clusterscoped").await?;
    // PriorityClasses: cluster-scoped, and no pod here uses them.
    let roles = Api::<PriorityClass>::all(client.clone());
    let prefix = unique_name("sharded-class");
    for i in 0..5 {
        let class = PriorityClass {
            metadata: ObjectMeta {
                name: Some(format!("{prefix}-{i}")),
                ..Default::default()
            },
            value: 1000,
            ..Default::default()
        };
        roles.create(&PostParams::default(), &class).await?;
    }
    let ring = unique_name("clusterscoped");
    for shard in ["shard-a", "shard-b", "shard-c"] {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    let spec = ClusterRingSpec {
        resources: vec![RingResource::controlling(
            "scheduling.k8s.io",
            "priorityclasses",
            [GroupResource::new("", "configmaps")],
        )],
        namespace_selector: ring_spec(&ns).namespace_selector,
        hash_key: None,
        lease_namespaces: Vec::new(),
        assignment: None,
    };
    create_ring(&client, &ring, spec).await?;
    let key = labels::shard_label(&ring);
    let predicted = IndependentRing::unweighted(["shard-a", "shard-b", "shard-c"]);
    poll_until("PriorityClasses assigned", Duration::from_secs(20), || {
        let (roles, key, predicted, prefix) = (
            roles.clone(),
            key.clone(),
            predicted.clone(),
            prefix.clone(),
        );
        async move {
            let mut ok = true;
            for i in 0..5 {
                let name = format!("{prefix}-{i}");
                let role = roles.get(&name).await?;
                let expected =
                    predicted.try_shard_for(&format!("scheduling.k8s.io/PriorityClass//{name}"));
                ok &= role.labels().get(&key).map(String::as_str) == expected;
            }
            Ok(ok.then_some(()))
        }
    })
    .await?;
    logs.passed();
    Ok(())
}

#[tokio::test]
async fn objects_created_while_no_sharder_runs_are_assigned_quickly() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("missed").await?;
    let cluster = dedicated.cluster();
    let ring = cluster_ring(unique_name("missed"));
    let shards = ["shard-a", "shard-b", "shard-c"];
    for shard in shards {
        create_lease(&client, &ns, &ring.name, shard, 3600).await?;
    }
    create_ring_of(&client, &ring, ring_spec(&ns)).await?;
    create_secrets(&client, &ns, 50).await?;
    let key = ring.shard_label();
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let unlabelled = secrets.list_metadata(&ListParams::default()).await?;
    ensure!(
        unlabelled
            .items
            .iter()
            .all(|s| !s.labels().contains_key(&key))
    );

    let files = SharderFiles::create(cluster.kubeconfig(), &SharderSettings::default())?;
    let mut process = files.start_process()?;
    let started = std::time::Instant::now();
    wait_all_assigned(&client, &ns, &ring, &shards, Duration::from_secs(10)).await?;
    eprintln!(
        "missed webhook: 50 Secrets assigned {:?} after the sharder started",
        started.elapsed()
    );
    process.terminate()?;
    process.wait(Duration::from_secs(15)).await?;
    process.passed();
    Ok(())
}
