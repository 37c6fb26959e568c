//! The shard library and the `checksum-controller` example against a real API server.
//!
//! No sharder runs here, except for the exclusion test and the start of a new shard: the tests
//! write shard and drain labels themselves, playing the sharder's part of the protocol.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::{
    ShardTiming, create_lease, create_ring, ring_spec, secret, start_checksum_shard_with,
    wait_labelled, wait_status, wait_webhook,
};
use e2e::process::{Process, poll_until};
use e2e::scenario::SharedScenario;
use e2e::{cluster, unique_name};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::ByteString;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::{Client, ResourceExt};
use kube_sharding::{LeaseLock, LeaseLockConfig};
use kube_sharding_api::labels;
use kube_sharding_api::{RingKind, RingRef};
use serde_json::{Value, json};

const RING: &str = "checksum-controller";
/// Lease duration of [`ShardTiming::FAST`], which the shards here use so that loss and takeover
/// play out within seconds.
const LEASE_DURATION_SECONDS: i32 = 3;
const WAIT: Duration = Duration::from_secs(20);

fn shard_key() -> String {
    labels::shard_label(RING)
}

fn drain_key() -> String {
    labels::drain_label(RING)
}

/// The judgement fallback of shards that run without a sharder here: no sharder labels their
/// Leases, so they start once it has passed.
const NO_SHARDER: [&str; 2] = ["--judgement-fallback", "1"];

/// Starts a checksum-controller shard watching and leasing in `namespace`, where no sharder
/// runs.
fn start_shard(namespace: &str, shard: &str) -> anyhow::Result<Process> {
    let ring = RingRef::new(RingKind::ClusterRing, RING);
    start_checksum_shard_with(&ring, namespace, shard, ShardTiming::FAST, &NO_SHARDER)
}

fn now() -> anyhow::Result<Timestamp> {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_micros();
    Ok(Timestamp::from_microsecond(i64::try_from(micros)?)?)
}

fn holder(lease: &Lease) -> &str {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or_default()
}

/// The shard's JSON log records whose `event` is `event`.
fn events(process: &Process, event: &str) -> Vec<Value> {
    process
        .records()
        .into_iter()
        .filter(|r| r["event"] == event)
        .collect()
}

/// Waits until the Lease exists and is held by `identity`.
async fn wait_for_holder(api: &Api<Lease>, name: &str, identity: &str) -> anyhow::Result<Lease> {
    poll_until(
        &format!("Lease {name} held by {identity:?}"),
        WAIT,
        || async {
            let lease = api.get_opt(name).await?;
            Ok(lease.filter(|l| holder(l) == identity))
        },
    )
    .await
}

async fn create_secret(
    client: &Client,
    namespace: &str,
    name: &str,
    shard: Option<&str>,
    data: &[(&str, &str)],
) -> anyhow::Result<Secret> {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: shard.map(|s| BTreeMap::from([(shard_key(), s.to_string())])),
            ..ObjectMeta::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Secret::default()
    };
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    api.create(&PostParams::default(), &secret)
        .await
        .with_context(|| format!("failed to create Secret {name}"))
}

/// Lowercase hex SHA-256 of the values the tests use, computed independently of the controller
/// (`printf %s VALUE | sha256sum`).
fn sha256_hex(value: &str) -> String {
    match value {
        "" => "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "admin" => "8c6976e5b5410415bde908bd4dee15dfb167a9c873fc4bb8a81f6f2ab448a918",
        "hunter2" => "f52fbd32b2b3b86ff88ef6c490628285f482af15ddcb29541f94bcf526a3f6c7",
        "v1" => "3bfc269594ef649228e9a74bab00f042efc91d5acc6fbee31a382e80d42388fe",
        "v2" => "fb04dcb6970e4c3d1873de51fd5a50d7bb46b3383113602665c350ec40b5f990",
        other => panic!("no precomputed checksum for {other:?}"),
    }
    .to_string()
}

/// Waits until ConfigMap `checksums-<secret>` holds exactly `expected` checksums.
async fn wait_for_checksums(
    client: &Client,
    namespace: &str,
    secret: &str,
    expected: &[(&str, &str)],
) -> anyhow::Result<ConfigMap> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let want: BTreeMap<String, String> = expected
        .iter()
        .map(|(k, v)| (k.to_string(), sha256_hex(v)))
        .collect();
    let name = format!("checksums-{secret}");
    poll_until(&format!("ConfigMap {name} with {want:?}"), WAIT, || async {
        let config_map = api.get_opt(&name).await?;
        Ok(config_map.filter(|cm| cm.data.as_ref() == Some(&want)))
    })
    .await
}

fn is_record(record: &Value, event: &str, namespace: &str, name: &str) -> bool {
    record["event"] == event && record["namespace"] == namespace && record["name"] == name
}

#[tokio::test]
async fn shard_lease_is_created_renewed_and_released_on_sigterm() -> anyhow::Result<()> {
    let client = cluster().client().await?;
    let namespace = cluster().namespace(&client, "shard-lease").await?;
    let shard = unique_name("shard");
    let mut process = start_shard(&namespace, &shard)?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);

    let lease = wait_for_holder(&leases, &shard, &shard).await?;
    assert_eq!(lease.name_any(), shard, "Lease name is the shard name");
    assert_eq!(
        lease
            .labels()
            .get(labels::LABEL_CLUSTER_RING)
            .map(String::as_str),
        Some(RING),
        "ring label"
    );
    let spec = lease.spec.clone().context("Lease has a spec")?;
    assert_eq!(spec.lease_duration_seconds, Some(LEASE_DURATION_SECONDS));
    assert_eq!(spec.lease_transitions, Some(0));
    assert!(spec.acquire_time.is_some());
    let first_renewal = spec.renew_time.context("renewTime set")?;

    let renewed = poll_until("renewTime to advance", WAIT, || async {
        let lease = leases.get(&shard).await?;
        let renew = lease.spec.as_ref().and_then(|s| s.renew_time.clone());
        Ok(renew.filter(|r| *r > first_renewal).map(|_| lease))
    })
    .await?;
    assert_eq!(holder(&renewed), shard);
    assert_eq!(
        renewed.spec.as_ref().and_then(|s| s.acquire_time.clone()),
        spec.acquire_time,
        "acquireTime stays while renewing"
    );

    process.terminate()?;
    let status = process.wait(WAIT).await?;
    ensure!(status.success(), "graceful shutdown exits 0, got {status}");
    let released = leases.get(&shard).await?;
    assert_eq!(holder(&released), "", "released Lease has an empty holder");
    // The records name the Lease versions the shard wrote (no one else writes it here).
    let acquired = events(&process, "lease_acquired");
    ensure!(acquired.len() == 1, "one acquired record: {acquired:?}");
    ensure!(
        acquired[0]["resource_version"]
            .as_str()
            .is_some_and(|v| !v.is_empty()),
        "acquired record names the version: {acquired:?}"
    );
    let released_records = events(&process, "lease_released");
    ensure!(
        released_records.len() == 1
            && released_records[0]["resource_version"].as_str()
                == released.metadata.resource_version.as_deref(),
        "released record names the released version {:?}: {released_records:?}",
        released.metadata.resource_version
    );
    let stopped = events(&process, "shard_stopped");
    ensure!(
        stopped.len() == 1 && stopped[0]["reason"] == "shutdown",
        "{stopped:?}"
    );
    assert_eq!(
        released
            .labels()
            .get(labels::LABEL_CLUSTER_RING)
            .map(String::as_str),
        Some(RING)
    );
    process.passed();
    Ok(())
}

#[tokio::test]
async fn shard_exits_when_its_lease_is_taken_over_and_waits_for_expiry_to_rejoin()
-> anyhow::Result<()> {
    let client = cluster().client().await?;
    let namespace = cluster().namespace(&client, "shard-takeover").await?;
    let shard = unique_name("shard");
    let mut process = start_shard(&namespace, &shard)?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    wait_for_holder(&leases, &shard, &shard).await?;

    // Take the Lease over as the sharder does for an unresponsive shard: a compare-and-swap
    // update, retried when the shard's renewal wins the race.
    let (last_written, taken) = poll_until("the takeover to be written", WAIT, || async {
        let mut lease = leases.get(&shard).await?;
        // The shard is the only other writer: the version the takeover replaces is its last.
        let last_written = lease.metadata.resource_version.clone();
        let spec = lease.spec.get_or_insert_default();
        let now = MicroTime(now()?);
        spec.holder_identity = Some(labels::IDENTITY_SHARD_LEASE_CONTROLLER.to_string());
        spec.lease_duration_seconds = Some(2 * LEASE_DURATION_SECONDS);
        spec.acquire_time = Some(now.clone());
        spec.renew_time = Some(now);
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        match leases.replace(&shard, &PostParams::default(), &lease).await {
            Ok(lease) => Ok(Some((last_written, lease))),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(None),
            Err(error) => Err(error.into()),
        }
    })
    .await?;

    let status = process.wait(WAIT).await?;
    ensure!(
        !status.success(),
        "a shard that lost its Lease exits non-zero"
    );
    assert!(
        process
            .records()
            .iter()
            .any(|r| r["level"] == "ERROR"
                && r["message"].as_str().is_some_and(|m| m.contains("lost"))),
        "the shard logs the loss"
    );
    let lost = events(&process, "lease_lost");
    ensure!(
        lost.len() == 1
            && lost[0]["holder"] == labels::IDENTITY_SHARD_LEASE_CONTROLLER
            && lost[0]["resource_version"].as_str() == last_written.as_deref(),
        "one lost record naming the taker and the shard's last version {last_written:?}: {lost:?}"
    );
    let stopped = events(&process, "shard_stopped");
    ensure!(
        stopped.len() == 1 && stopped[0]["reason"] == "lease_lost",
        "{stopped:?}"
    );
    let lease = leases.get(&shard).await?;
    assert_eq!(
        holder(&lease),
        labels::IDENTITY_SHARD_LEASE_CONTROLLER,
        "the shard never overwrites the takeover"
    );
    process.passed();

    // A restarted shard waits until the takeover expires, then takes the Lease back.
    let mut restarted = start_shard(&namespace, &shard)?;
    let rejoined = wait_for_holder(&leases, &shard, &shard).await?;
    let taken_spec = taken.spec.context("takeover spec")?;
    let spec = rejoined.spec.context("rejoined spec")?;
    let taken_expiry = taken_spec
        .renew_time
        .context("takeover renewTime")?
        .0
        .checked_add(SignedDuration::from_secs(i64::from(
            2 * LEASE_DURATION_SECONDS,
        )))?;
    let acquired = spec.acquire_time.context("acquireTime")?.0;
    assert!(
        acquired > taken_expiry,
        "re-acquired at {acquired} before the takeover expired at {taken_expiry}"
    );
    assert_eq!(
        spec.lease_transitions,
        taken_spec.lease_transitions.map(|t| t + 1)
    );
    restarted.terminate()?;
    ensure!(restarted.wait(WAIT).await?.success());
    restarted.passed();
    Ok(())
}

#[tokio::test]
async fn shard_reconciles_only_objects_labelled_with_its_name() -> anyhow::Result<()> {
    let client = cluster().client().await?;
    let namespace = cluster().namespace(&client, "shard-select").await?;
    let shard = unique_name("shard");
    let mut process = start_shard(&namespace, &shard)?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    wait_for_holder(&leases, &shard, &shard).await?;

    let data = [("user", "admin"), ("password", "hunter2"), ("empty", "")];
    create_secret(&client, &namespace, "other", Some("other-shard"), &data).await?;
    create_secret(&client, &namespace, "unassigned", None, &data).await?;
    let mine = create_secret(&client, &namespace, "mine", Some(&shard), &data).await?;

    let config_map = wait_for_checksums(&client, &namespace, "mine", &data).await?;
    let owner = config_map
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .context("ConfigMap has a controller reference")?;
    assert_eq!(owner.kind, "Secret");
    assert_eq!(owner.name, "mine");
    assert_eq!(Some(&owner.uid), mine.metadata.uid.as_ref());

    // The others were created before "mine", yet never reached the shard's watch.
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    for name in ["other", "unassigned"] {
        assert!(
            config_maps
                .get_opt(&format!("checksums-{name}"))
                .await?
                .is_none(),
            "{name} must not be reconciled"
        );
        assert!(
            !process
                .records()
                .iter()
                .any(|r| is_record(r, "reconcile", &namespace, name)),
            "{name} must not be reconciled"
        );
    }
    let record = process
        .records()
        .into_iter()
        .find(|r| is_record(r, "reconcile", &namespace, "mine"))
        .context("reconcile record for mine")?;
    assert_eq!(record["shard"], shard.as_str());
    assert_eq!(record["level"], "INFO");

    // Assigning an object later (as the sharder's webhook would) brings it into the watch.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    secrets
        .patch(
            "other",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {shard_key(): shard}}})),
        )
        .await?;
    wait_for_checksums(&client, &namespace, "other", &data).await?;

    process.terminate()?;
    ensure!(process.wait(WAIT).await?.success());
    process.passed();
    Ok(())
}

#[tokio::test]
async fn shard_acknowledges_drain_in_one_write_and_stops_reconciling() -> anyhow::Result<()> {
    let client = cluster().client().await?;
    let namespace = cluster().namespace(&client, "shard-drain").await?;
    let shard = unique_name("shard");
    let mut process = start_shard(&namespace, &shard)?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);

    let v1 = [("key", "v1")];
    create_secret(&client, &namespace, "drained", Some(&shard), &v1).await?;
    create_secret(&client, &namespace, "canary", Some(&shard), &v1).await?;
    wait_for_checksums(&client, &namespace, "drained", &v1).await?;
    wait_for_checksums(&client, &namespace, "canary", &v1).await?;

    // Drain as the sharder does: add the drain label, guarded by resourceVersion.
    let current = secrets.get("drained").await?;
    let drained = secrets
        .patch(
            "drained",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {
                "resourceVersion": current.resource_version(),
                "labels": {drain_key(): "true"},
            }})),
        )
        .await?;
    let drain_version = drained.resource_version().context("resourceVersion")?;

    // Every version after the drain label was added: the next one must have lost both labels
    // at once (one merge patch), never just one of them.
    let watch = WatchParams::default()
        .fields("metadata.name=drained")
        .timeout(20);
    let mut events = secrets.watch(&watch, &drain_version).await?.boxed();
    let acknowledged = tokio::time::timeout(WAIT, async {
        while let Some(event) = events.try_next().await? {
            let secret = match event {
                WatchEvent::Modified(secret) => secret,
                WatchEvent::Bookmark(_) => continue,
                other => anyhow::bail!("unexpected watch event {other:?}"),
            };
            return Ok(secret);
        }
        anyhow::bail!("watch ended before the drain was acknowledged")
    })
    .await
    .context("drain not acknowledged in time")??;
    let labels = acknowledged.labels();
    assert!(
        !labels.contains_key(&shard_key()) && !labels.contains_key(&drain_key()),
        "the acknowledgement removes both labels in one write: {labels:?}"
    );

    let drain_record = process
        .wait_for_record("drain record", WAIT, |r| {
            is_record(r, "drain", &namespace, "drained")
        })
        .await?;
    assert_eq!(drain_record["shard"], shard.as_str());

    // Change both Secrets; the canary's update proves the shard processed later events, and the
    // drained Secret's ConfigMap must stay as it was.
    let v2 = [("key", "v2")];
    for name in ["drained", "canary"] {
        secrets
            .patch(
                name,
                &PatchParams::default(),
                // base64 of "v2"
                &Patch::Merge(json!({"data": {"key": "djI="}})),
            )
            .await?;
    }
    wait_for_checksums(&client, &namespace, "canary", &v2).await?;
    let drained_checksums = config_maps.get("checksums-drained").await?;
    assert_eq!(
        drained_checksums.data,
        Some(BTreeMap::from([("key".to_string(), sha256_hex("v1"))])),
        "a drained Secret is not reconciled any more"
    );

    let records = process.records();
    let drain_at = records
        .iter()
        .position(|r| is_record(r, "drain", &namespace, "drained"))
        .context("drain record")?;
    assert!(
        !records[drain_at..]
            .iter()
            .any(|r| is_record(r, "reconcile", &namespace, "drained")),
        "no reconcile of the drained Secret after its drain was acknowledged"
    );

    process.terminate()?;
    ensure!(process.wait(WAIT).await?.success());
    process.passed();
    Ok(())
}

/// The Lease lock as the sharder uses it for leader election: identities differ from the Lease
/// name, no labels; one holder at a time, handed over on release.
#[tokio::test]
async fn lease_lock_elects_one_holder_and_hands_over_on_release() -> anyhow::Result<()> {
    let client = cluster().client().await?;
    let namespace = cluster().namespace(&client, "leader").await?;
    let config = |identity: &str| {
        LeaseLockConfig::new(&namespace, "leader", identity)
            .with_lease_duration(Duration::from_secs(3))
            .with_renew_deadline(Duration::from_secs(2))
            .with_retry_period(Duration::from_millis(500))
    };
    let first = LeaseLock::new(client.clone(), config("replica-1"))?;
    let second = LeaseLock::new(client.clone(), config("replica-2"))?;

    let held = tokio::time::timeout(WAIT, first.acquire()).await?;
    assert!(
        second.try_acquire().await?.is_none(),
        "a held Lease is not handed out twice"
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    let lease = leases.get("leader").await?;
    assert_eq!(holder(&lease), "replica-1");
    assert!(lease.metadata.labels.unwrap_or_default().is_empty());

    // The second candidate keeps trying while the first renews, well past the lease duration.
    let waiting = tokio::spawn(async move { second.acquire().await });
    poll_until("two renewals by the leader", WAIT, || async {
        let renewed = leases.get("leader").await?;
        let renew = renewed
            .spec
            .and_then(|s| s.renew_time)
            .context("renewTime")?;
        let first_renew = lease
            .spec
            .as_ref()
            .and_then(|s| s.renew_time.clone())
            .context("renewTime")?;
        let gap = renew.0.duration_since(first_renew.0);
        Ok((gap > SignedDuration::from_secs(4)).then_some(()))
    })
    .await?;
    assert!(
        !waiting.is_finished(),
        "no second leader while the first renews"
    );
    assert!(!held.is_lost());

    assert!(held.release().await?, "release empties the holder");
    let successor = tokio::time::timeout(WAIT, waiting).await??;
    let lease = leases.get("leader").await?;
    assert_eq!(holder(&lease), "replica-2");
    assert_eq!(lease.spec.and_then(|s| s.lease_transitions), Some(1));
    assert!(!successor.is_lost());
    assert!(successor.release().await?);
    Ok(())
}

/// Starts a checksum-controller shard whose reconciles of `slow-*` Secrets wait `delay` seconds
/// before writing, where no sharder runs.
fn start_slow_shard(namespace: &str, shard: &str, delay: &str) -> anyhow::Result<Process> {
    let ring = RingRef::new(RingKind::ClusterRing, RING);
    start_checksum_shard_with(
        &ring,
        namespace,
        shard,
        ShardTiming::FAST,
        &[
            "--testing-reconcile-delay",
            delay,
            NO_SHARDER[0],
            NO_SHARDER[1],
        ],
    )
}

/// Adds the drain label to Secret `name` as the sharder does: a merge patch guarded by the
/// `resourceVersion` just read.
async fn drain_secret(secrets: &Api<Secret>, name: &str) -> anyhow::Result<Secret> {
    let current = secrets.get(name).await?;
    Ok(secrets
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {
                "resourceVersion": current.resource_version(),
                "labels": {drain_key(): "true"},
            }})),
        )
        .await?)
}

/// A reconcile that was in flight when its object was drained re-reads the object before its
/// first write, finds the drain label and stops: its ConfigMap is never written, and the drain
/// is acknowledged once the reconcile has ended. Without the check the write landed on an
/// object being handed to another shard.
#[tokio::test]
async fn a_reconcile_in_flight_when_its_object_is_drained_does_not_write() -> anyhow::Result<()> {
    let client = cluster().client().await?;
    let namespace = cluster().namespace(&client, "shard-slow-drain").await?;
    let shard = unique_name("shard");
    let mut process = start_slow_shard(&namespace, &shard, "4")?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    wait_for_holder(&leases, &shard, &shard).await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);

    let v1 = [("key", "v1")];
    create_secret(&client, &namespace, "slow-a", Some(&shard), &v1).await?;
    process
        .wait_for_record("the slow reconcile to start", WAIT, |r| {
            is_record(r, "reconcile", &namespace, "slow-a")
        })
        .await?;
    drain_secret(&secrets, "slow-a").await?;

    let refused = process
        .wait_for_record("the reconcile to stop before writing", WAIT, |r| {
            is_record(r, "write_refused", &namespace, "slow-a")
        })
        .await?;
    ensure!(
        refused["error"]
            .as_str()
            .is_some_and(|e| e.contains("being drained")),
        "{refused}"
    );
    process
        .wait_for_record("the drain acknowledgement", WAIT, |r| {
            is_record(r, "drain", &namespace, "slow-a")
        })
        .await?;
    let acknowledged = secrets.get("slow-a").await?;
    ensure!(
        !acknowledged.labels().contains_key(&shard_key()),
        "acknowledged: {:?}",
        acknowledged.labels()
    );
    ensure!(
        config_maps.get_opt("checksums-slow-a").await?.is_none(),
        "the reconcile in flight wrote after the drain"
    );
    ensure!(
        !process
            .records()
            .iter()
            .any(|r| is_record(r, "applied", &namespace, "slow-a")),
        "an applied record for the drained Secret"
    );
    process.terminate()?;
    ensure!(process.wait(WAIT).await?.success());
    process.passed();
    Ok(())
}

/// The shard's local state learns how each object left: one drained (released, `drained`), one
/// relabelled directly (released, `reassigned`), one deleted (deleted), each dropped from the
/// record of what the shard served, and never mistaken for the other kind.
#[tokio::test]
async fn released_and_deleted_objects_are_told_apart() -> anyhow::Result<()> {
    let client = cluster().client().await?;
    let namespace = cluster().namespace(&client, "shard-departures").await?;
    let shard = unique_name("shard");
    let mut process = start_shard(&namespace, &shard)?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    wait_for_holder(&leases, &shard, &shard).await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);

    let data = [("key", "v1"), ("user", "admin")];
    let names = ["drained", "moved", "deleted"];
    for name in names {
        create_secret(&client, &namespace, name, Some(&shard), &data).await?;
    }
    for name in names {
        process
            .wait_for_record(&format!("{name} served"), WAIT, |r| {
                is_record(r, "applied", &namespace, name)
            })
            .await?;
    }

    drain_secret(&secrets, "drained").await?;
    secrets
        .patch(
            "moved",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {shard_key(): "other-shard"}}})),
        )
        .await?;
    secrets
        .delete("deleted", &kube::api::DeleteParams::default())
        .await?;

    let expected = [
        ("drained", "released", Some("drained")),
        ("moved", "released", Some("reassigned")),
        ("deleted", "deleted", None),
    ];
    for (name, event, how) in expected {
        let record = process
            .wait_for_record(&format!("{event} record of {name}"), WAIT, |r| {
                is_record(r, event, &namespace, name)
            })
            .await?;
        ensure!(
            record["had_state"] == true && record["checksums"] == 2,
            "{name}: the served record was dropped: {record}"
        );
        if let Some(how) = how {
            ensure!(record["how"] == how, "{name}: {record}");
        }
        let other = if event == "released" {
            "deleted"
        } else {
            "released"
        };
        ensure!(
            !process
                .records()
                .iter()
                .any(|r| is_record(r, other, &namespace, name)),
            "{name} also reported as {other}"
        );
    }
    process.terminate()?;
    ensure!(process.wait(WAIT).await?.success());
    process.passed();
    Ok(())
}

/// What the in-process test controller below did.
#[derive(Default)]
struct Probe {
    /// When a reconcile started its slow part.
    started: std::sync::Mutex<Option<std::time::Instant>>,
    /// Writes the reconciles sent.
    writes: std::sync::atomic::AtomicUsize,
    /// Reconciles dropped before they finished.
    dropped: std::sync::atomic::AtomicUsize,
}

/// Counts a reconcile dropped mid-flight.
struct DropCounter(std::sync::Arc<Probe>, bool);

impl Drop for DropCounter {
    fn drop(&mut self) {
        if !self.1 {
            self.0
                .dropped
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// A controller built on the library, run in the test without `run_while_held` (so nothing but
/// the reconciler wrapper stands between a lost Lease and a write): its reconcile waits 3 s,
/// then creates a ConfigMap. The Lease is taken over while the reconcile waits: the wrapper
/// cancels it at once, and the write never happens. Without the cancellation the reconcile
/// finished and wrote after the loss.
#[tokio::test]
async fn a_reconcile_in_flight_is_cancelled_at_once_when_the_lease_is_lost() -> anyhow::Result<()> {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    use kube::runtime::controller::{Action, Controller};

    let client = cluster().client().await?;
    let namespace = cluster().namespace(&client, "shard-cancel").await?;
    let name = unique_name("shard");
    let shard = kube_sharding::Shard::new(RING, &name, &namespace);
    let config = shard
        .lease_config()
        .with_lease_duration(Duration::from_secs(3))
        .with_renew_deadline(Duration::from_secs(2))
        .with_retry_period(Duration::from_millis(500));
    let held = LeaseLock::new(client.clone(), config)?.acquire().await;
    let probe = Arc::new(Probe::default());

    let reconcile = {
        let (probe, client) = (Arc::clone(&probe), client.clone());
        move |secret: Arc<Secret>, _: Arc<()>, ownership: kube_sharding::Ownership| {
            let (probe, client) = (Arc::clone(&probe), client.clone());
            async move {
                let mut finished = DropCounter(Arc::clone(&probe), false);
                *probe.started.lock().expect("lock") = Some(std::time::Instant::now());
                tokio::time::sleep(Duration::from_secs(3)).await;
                // Deliberately no ownership check: only the wrapper's cancellation stops this.
                let _ = &ownership;
                let config_map = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(format!("written-{}", secret.name_any())),
                        ..ObjectMeta::default()
                    },
                    ..ConfigMap::default()
                };
                probe.writes.fetch_add(1, Ordering::SeqCst);
                Api::<ConfigMap>::namespaced(client, &secret.namespace().unwrap_or_default())
                    .create(&PostParams::default(), &config_map)
                    .await?;
                finished.1 = true;
                Ok::<_, kube::Error>(Action::await_change())
            }
        }
    };
    let (results, mut ended) = tokio::sync::mpsc::unbounded_channel();
    let controller = Controller::new(
        Api::<Secret>::namespaced(client.clone(), &namespace),
        shard.watcher_config(),
    )
    .run(
        shard.reconciler(client.clone(), held.guard(), reconcile),
        |_, _, _| Action::await_change(),
        Arc::new(()),
    )
    .for_each(move |result| {
        if let Err(kube::runtime::controller::Error::ReconcilerFailed(error, _)) = result {
            let _ = results.send((error.is_lease_lost(), std::time::Instant::now()));
        }
        futures::future::ready(())
    });
    let controller = tokio::spawn(controller);

    create_secret(
        &client,
        &namespace,
        "in-flight",
        Some(&name),
        &[("key", "v1")],
    )
    .await?;
    poll_until("the reconcile to start", WAIT, || async {
        Ok(*probe.started.lock().expect("lock"))
    })
    .await?;

    // Take the Lease over as the sharder does for an unresponsive shard.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    let taken_at = poll_until("the takeover to be written", WAIT, || async {
        let mut lease = leases.get(&name).await?;
        let spec = lease.spec.get_or_insert_default();
        spec.holder_identity = Some(labels::IDENTITY_SHARD_LEASE_CONTROLLER.to_string());
        spec.renew_time = Some(MicroTime(now()?));
        match leases.replace(&name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(Some(std::time::Instant::now())),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(None),
            Err(error) => Err(error.into()),
        }
    })
    .await?;

    let (lease_lost, at) = tokio::time::timeout(WAIT, ended.recv())
        .await
        .context("the reconcile did not end")?
        .context("controller ended")?;
    ensure!(lease_lost, "the reconcile ended for another reason");
    let started = probe.started.lock().expect("lock").context("started")?;
    ensure!(
        at < started + Duration::from_secs(3),
        "cancelled only after the reconcile's own 3 s"
    );
    // The next renewal (every 0.5 s) notices the takeover.
    ensure!(
        at.duration_since(taken_at) < Duration::from_millis(1500),
        "cancelled {:?} after the takeover",
        at.duration_since(taken_at)
    );
    assert_eq!(
        probe.dropped.load(Ordering::SeqCst),
        1,
        "dropped mid-flight"
    );
    // Past the moment the reconcile would have written.
    tokio::time::sleep_until(tokio::time::Instant::from_std(
        started + Duration::from_secs(4),
    ))
    .await;
    assert_eq!(
        probe.writes.load(Ordering::SeqCst),
        0,
        "no write after the loss"
    );
    ensure!(
        Api::<ConfigMap>::namespaced(client.clone(), &namespace)
            .get_opt("written-in-flight")
            .await?
            .is_none()
    );
    controller.abort();
    Ok(())
}

/// docs/protocol.md §18: a checksum-controller whose shard name is taken by an older Lease of
/// the same ring in another namespace is excluded by the sharder (the annotation
/// `alpha.sharding.timebertt.dev/excluded`). It stops at once, releases its Lease, says why at
/// error level, acknowledges no drain and reconciles none of the objects labelled with its name
/// (they are the older copy's), and keeps waiting to rejoin.
///
/// Needs a sharder that writes the exclusion annotation.
#[tokio::test]
async fn an_excluded_shard_steps_out_and_touches_nothing() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("shard-excluded").await?;
    let older_ns = cluster.namespace(&client, "shard-excluded-older").await?;
    let ring = unique_name("excluded");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let name = "shard-x";
    create_lease(&client, &older_ns, &ring, name, 3600).await?;
    wait_status(&client, &ring, 1, 1).await?;
    wait_webhook(&client, &ns, &ring, &[name]).await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let key = labels::shard_label(&ring);
    let drain = labels::drain_label(&ring);
    secrets
        .create(&PostParams::default(), &secret("before"))
        .await?;
    wait_labelled::<Secret>(
        &client,
        &ns,
        &RingRef::new(RingKind::ClusterRing, ring.clone()),
        &["before"],
    )
    .await?;

    // Creation times have whole seconds: the shard's own Lease is created in a later one.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut process = start_checksum_shard_with(
        &RingRef::new(RingKind::ClusterRing, ring.clone()),
        &ns,
        name,
        ShardTiming::FAST,
        &["--rejoin-pause", "2"],
    )?;
    let excluded = process
        .wait_for_record("the shard to step out", WAIT, |r| {
            r["event"] == kube_sharding::records::EVENT_SHARD_EXCLUDED
        })
        .await?;
    ensure!(
        excluded["level"] == "ERROR" && excluded["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{excluded}"
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let lease = leases.get(name).await?;
    ensure!(holder(&lease).is_empty(), "released: {lease:?}");
    ensure!(
        lease
            .annotations()
            .contains_key(labels::ANNOTATION_EXCLUDED),
        "{lease:?}"
    );

    // From now on: the older copy's objects are none of this process's business.
    let stepped_out = process.records().len();
    secrets
        .create(&PostParams::default(), &secret("after"))
        .await?;
    // A drain of this ring (the older copy's sharder would ask it when the shard moves).
    secrets
        .patch(
            "before",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {&drain: "true"}}})),
        )
        .await?;
    // Longer than a pause and a few retry periods.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let later = &process.records()[stepped_out..];
    ensure!(
        !later
            .iter()
            .any(|r| r["event"] == "reconcile" || r["event"] == "drain" || r["event"] == "applied"),
        "the excluded shard acted: {later:?}"
    );
    let before = secrets.get("before").await?;
    ensure!(
        before.labels().get(&key).map(String::as_str) == Some(name)
            && before.labels().contains_key(&drain),
        "the drain was acknowledged: {:?}",
        before.labels()
    );
    ensure!(
        holder(&leases.get(name).await?).is_empty(),
        "rejoined while excluded"
    );
    ensure!(process.try_status()?.is_none(), "the shard keeps running");
    process.terminate()?;
    ensure!(process.wait(WAIT).await?.success());
    process.passed();
    logs.passed();
    Ok(())
}

/// A shard whose Lease is new starts its work as soon as the sharder has labelled the Lease with
/// its state (and no exclusion), not one retry period later at the first renewal: the sharder
/// moves objects to a new shard from the moment it sees its Lease, so every moment of waiting
/// is a moment those objects have no shard at work.
#[tokio::test]
async fn a_new_shard_starts_when_the_sharder_has_labelled_its_lease() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("shard-judged").await?;
    let ring = unique_name("judged");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let name = "shard-j";
    // Already the shard's: its work reconciles it at once when it starts.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let mut first = secret("first");
    first
        .metadata
        .labels
        .get_or_insert_default()
        .insert(labels::shard_label(&ring), name.to_string());
    secrets.create(&PostParams::default(), &first).await?;
    // A retry period far longer than the sharder takes to label a Lease: before, the work
    // started with the first renewal, 8 s after the Lease was created.
    let retry = Duration::from_secs(8);
    let mut process = start_checksum_shard_with(
        &RingRef::new(RingKind::ClusterRing, ring.clone()),
        &ns,
        name,
        ShardTiming("30", "20", "8"),
        &[],
    )?;
    let timestamp = |record: &Value| -> anyhow::Result<Timestamp> {
        Ok(record["timestamp"]
            .as_str()
            .context("a timestamp")?
            .parse::<Timestamp>()?)
    };
    let acquired = process
        .wait_for_record("the shard's Lease acquired", WAIT, |r| {
            r["event"] == "lease_acquired"
        })
        .await?;
    let started = process
        .wait_for_record("the term's work started", WAIT, |r| {
            r["event"] == kube_sharding::records::EVENT_TERM_STARTED
        })
        .await?;
    let reconciled = process
        .wait_for_record("the shard's first reconcile", WAIT, |r| {
            is_record(r, "reconcile", &ns, "first")
        })
        .await?;
    let waited = timestamp(&reconciled)?.duration_since(timestamp(&acquired)?);
    ensure!(
        waited < SignedDuration::try_from(retry / 2)?,
        "the work started {waited:?} after the Lease was created, retry period {retry:?}"
    );
    // The record says how long the work waited for the sharder's judgement, and comes first.
    let judged = started["waited_ms"].as_f64().context("waited_ms")?;
    ensure!(
        judged > 0.0 && judged < waited.as_secs_f64() * 1e3 + 1.0,
        "the term's start says it waited {judged} ms; the first reconcile came {waited:?} after the Lease was acquired"
    );
    ensure!(
        started["term"] == 1 && timestamp(&started)? <= timestamp(&reconciled)?,
        "the first term started before its first reconcile: {started}"
    );
    let lease = Api::<Lease>::namespaced(client.clone(), &ns)
        .get(name)
        .await?;
    ensure!(
        lease.labels().contains_key(labels::LABEL_STATE),
        "the sharder labelled the Lease: {lease:?}"
    );
    process.terminate()?;
    ensure!(process.wait(WAIT).await?.success());
    process.passed();
    logs.passed();
    Ok(())
}

/// Audit F6.2: a shard process stopped (SIGSTOP, as a suspended VM) past its renew deadline while
/// a reconcile waits, then resumed: the reconcile's timer and the renewer's fire together, in no
/// set order. The reconcile checks the renew deadline it shares with the renewer (by the
/// monotonic clock) and stops; nothing is written, although nobody took the Lease and the API
/// server would have accepted the write. The shard then exits for the lost Lease.
#[tokio::test]
async fn a_shard_resumed_after_its_renew_deadline_writes_nothing() -> anyhow::Result<()> {
    let client = cluster().client().await?;
    let namespace = cluster().namespace(&client, "shard-suspend").await?;
    let shard = unique_name("shard");
    let mut process = start_slow_shard(&namespace, &shard, "3")?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    wait_for_holder(&leases, &shard, &shard).await?;

    create_secret(
        &client,
        &namespace,
        "slow-a",
        Some(&shard),
        &[("key", "v1")],
    )
    .await?;
    process
        .wait_for_record("the slow reconcile to start", WAIT, |r| {
            is_record(r, "reconcile", &namespace, "slow-a")
        })
        .await?;
    process.signal("STOP")?;
    // Past the reconcile's 3 s and the renew deadline (2 s after the last renewal).
    tokio::time::sleep(Duration::from_secs(5)).await;
    process.signal("CONT")?;
    let status = process.wait(WAIT).await?;
    ensure!(
        !status.success(),
        "a shard past its deadline exits non-zero"
    );
    // Whoever saw the deadline first reports it: the renewer (`lease_lost`), or the shard
    // stopping on the ended guard.
    ensure!(
        !events(&process, "lease_lost").is_empty()
            || process
                .records()
                .iter()
                .any(|r| r["event"] == "shard_stopped" && r["reason"] == "lease_lost"),
        "the loss is reported"
    );
    ensure!(
        !process
            .records()
            .iter()
            .any(|r| is_record(r, "applied", &namespace, "slow-a")),
        "the resumed reconcile wrote"
    );
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    ensure!(
        config_maps.get_opt("checksums-slow-a").await?.is_none(),
        "the resumed reconcile wrote its ConfigMap"
    );
    process.passed();
    Ok(())
}

/// Objects a shard held state for before its watch started (an earlier term) and that left
/// while it was not watching are reported from the first listing: one moved to another shard
/// (released, `found_moved`), one deleted (deleted); one still on the shard is not reported.
#[tokio::test]
async fn departures_while_not_watching_are_found_by_the_first_listing() -> anyhow::Result<()> {
    use kube_sharding::{Departure, ObjectKey, Release};

    let client = cluster().client().await?;
    let namespace = cluster().namespace(&client, "shard-found").await?;
    let name = unique_name("shard");
    let shard = kube_sharding::Shard::new(RING, &name, &namespace);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let key = |secret: &Secret| ObjectKey {
        namespace: secret.namespace(),
        name: secret.name_any(),
        uid: secret.uid(),
    };
    // What the shard served in its earlier term, and what happened to each since.
    let stayed = create_secret(&client, &namespace, "stayed", Some(&name), &[]).await?;
    let moved = create_secret(&client, &namespace, "moved", Some("other-shard"), &[]).await?;
    let deleted = create_secret(&client, &namespace, "deleted", Some(&name), &[]).await?;
    secrets
        .delete("deleted", &kube::api::DeleteParams::default())
        .await?;
    // Recreated under the same name: a new object, the old one is still deleted.
    create_secret(&client, &namespace, "deleted", Some(&name), &[]).await?;

    let mut departures = shard
        .departures(secrets.clone())
        .with_known([key(&stayed), key(&moved), key(&deleted)])
        .stream()
        .boxed();
    let mut seen = Vec::new();
    for _ in 0..2 {
        let departure = tokio::time::timeout(WAIT, departures.next())
            .await
            .context("no departure reported")?
            .context("the stream ended")?;
        seen.push(departure);
    }
    seen.sort_by(|a, b| a.object().name.cmp(&b.object().name));
    assert_eq!(
        seen,
        vec![
            Departure::Deleted {
                object: key(&deleted)
            },
            Departure::Released {
                object: key(&moved),
                how: Release::FoundMoved
            },
        ]
    );
    // Nothing about the object that stayed.
    ensure!(
        tokio::time::timeout(Duration::from_secs(2), departures.next())
            .await
            .is_err(),
        "a departure reported for an object still on the shard"
    );
    Ok(())
}

/// The `resourceVersion` of `object` as a number: one etcd orders every write of the control
/// plane, so versions of different objects compare (a test's shortcut; clients must not rely on
/// it).
fn version<K: kube::Resource>(object: &K) -> anyhow::Result<u64> {
    Ok(object
        .resource_version()
        .context("resourceVersion")?
        .parse()?)
}

/// How many moves off the returning shard are seen before it comes back.
const MOVES_BEFORE_RETURN: usize = 20;

/// docs/protocol.md §22: a shard that comes back while the sharder is still moving its objects
/// off it (directly, since it had released its Lease) starts its new term only when the moves
/// in flight have landed, and no move starts after the sharder has seen it back. So nothing the
/// new term lists is moved away under it; before, the moves sent before the shard came back
/// landed after its first listing, and two shards started reconciles of those objects.
///
/// The shard comes back once a few moves off it are seen, which is mid-flight (the sharder has up
/// to `maxPatchesInFlight` on their way): the test fails unless some moves were still landing
/// after the Lease was taken again. It checks the versions the API server gave the writes: the
/// sharder's `ready` comes after the last move, the new term's listing after `ready`.
///
/// Whether a move is still on its way when the shard comes back depends on timing: an attempt
/// where none was checks everything else, and the scenario runs again in a new namespace, up to
/// [`RETURN_ATTEMPTS`] times; the test fails unless one attempt exercised the race.
#[tokio::test]
async fn a_returning_shard_starts_after_the_moves_off_it_landed() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        cluster,
        ..
    } = SharedScenario::in_namespace("shard-return").await?;
    let mut namespace = ns;
    for attempt in 1..=RETURN_ATTEMPTS {
        if returning_shard_attempt(&client, &namespace).await? > 0 {
            logs.passed();
            return Ok(());
        }
        println!("attempt {attempt}: no move was in flight when the shard came back");
        namespace = cluster.namespace(&client, "shard-return").await?;
    }
    anyhow::bail!(
        "no move was in flight when the shard came back in {RETURN_ATTEMPTS} attempts: the test did \
         not exercise the race"
    )
}

/// Most runs of the scenario of [`a_returning_shard_starts_after_the_moves_off_it_landed`].
const RETURN_ATTEMPTS: usize = 3;

/// One run of [`a_returning_shard_starts_after_the_moves_off_it_landed`] in `ns`: checks the
/// order of the writes and returns how many moves off the shard landed after it came back.
async fn returning_shard_attempt(client: &kube::Client, ns: &str) -> anyhow::Result<usize> {
    use tokio_util::sync::CancellationToken;
    let (client, ns) = (client.clone(), ns.to_string());
    let ring = unique_name("return");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    // The other shard: a Lease nobody renews, valid for the whole test; it never acknowledges a
    // drain, so what moves to it stays.
    create_lease(&client, &ns, &ring, "shard-b", 3600).await?;
    let name = "shard-r";
    let shard = kube_sharding::Shard::new(&ring, name, &ns);
    let lock = || -> anyhow::Result<LeaseLock> {
        let config = shard
            .lease_config()
            .with_lease_duration(Duration::from_secs(15))
            .with_renew_deadline(Duration::from_secs(10))
            .with_retry_period(Duration::from_secs(2));
        Ok(LeaseLock::new(client.clone(), config)?)
    };
    let first_term = CancellationToken::new();
    let first = {
        let (shard, lock, stop) = (shard.clone(), lock()?, first_term.clone());
        tokio::spawn(async move {
            shard
                .run(
                    &lock,
                    &stop,
                    |term| async move { term.stop.cancelled().await },
                )
                .await
        })
    };
    wait_status(&client, &ring, 2, 2).await?;
    wait_webhook(&client, &ns, &ring, &["shard-b", name]).await?;

    let names: Vec<String> = (0..1200).map(|i| format!("s-{i}")).collect();
    let creates = futures::stream::iter(names.iter().map(|n| {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
        async move { secrets.create(&PostParams::default(), &secret(n)).await }
    }))
    .buffer_unordered(16)
    .try_collect::<Vec<_>>();
    creates.await?;
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let ring_ref = RingRef::new(RingKind::ClusterRing, ring.clone());
    wait_labelled::<Secret>(&client, &ns, &ring_ref, &refs).await?;
    let key = labels::shard_label(&ring);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let listed = secrets.list(&Default::default()).await?;
    let on_r = listed
        .items
        .iter()
        .filter(|s| s.labels().get(&key).map(String::as_str) == Some(name))
        .count();
    ensure!(on_r > 300, "{on_r} of 1200 on {name}");

    // Every move off shard-r from here on, with the version it was written at.
    let from = listed.metadata.resource_version.context("list version")?;
    let (moved_tx, mut moved_rx) = tokio::sync::mpsc::unbounded_channel::<(String, u64)>();
    let watcher = {
        let (secrets, key, from) = (secrets.clone(), key.clone(), from.clone());
        let mut shards: BTreeMap<String, String> = listed
            .items
            .iter()
            .map(|s| {
                (
                    s.name_any(),
                    s.labels().get(&key).cloned().unwrap_or_default(),
                )
            })
            .collect();
        tokio::spawn(async move {
            let mut events = secrets
                .watch(&WatchParams::default().timeout(120), &from)
                .await?
                .boxed();
            while let Some(event) = events.try_next().await? {
                let WatchEvent::Modified(secret) = event else {
                    continue;
                };
                let now = secret.labels().get(&key).cloned().unwrap_or_default();
                let before = shards.insert(secret.name_any(), now.clone());
                if before.as_deref() == Some(name) && now != name {
                    let _ = moved_tx.send((secret.name_any(), version(&secret)?));
                }
            }
            anyhow::Ok(())
        })
    };

    // Every version of shard-r's Lease from here on: its holder, state label and version.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let lease_versions = {
        let leases = leases.clone();
        let mut events = leases
            .watch(
                &WatchParams::default()
                    .fields(&format!("metadata.name={name}"))
                    .timeout(120),
                &from,
            )
            .await?
            .boxed();
        let versions = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let recorded = std::sync::Arc::clone(&versions);
        let task = tokio::spawn(async move {
            while let Some(event) = events.try_next().await? {
                if let WatchEvent::Modified(lease) = event {
                    let state = lease.labels().get(labels::LABEL_STATE).cloned();
                    recorded
                        .lock()
                        .map_err(|_| anyhow::anyhow!("poisoned"))?
                        .push((version(&lease)?, holder(&lease).to_string(), state));
                }
            }
            anyhow::Ok(())
        });
        (versions, task)
    };

    // Released: the sharder moves shard-r's objects to shard-b directly. Back at the first
    // move seen.
    first_term.cancel();
    let ended = first.await??;
    ensure!(
        ended == kube_sharding::ShardRunEnd::Stopped { released: true },
        "{ended:?}"
    );
    let mut moves = Vec::new();
    while moves.len() < MOVES_BEFORE_RETURN {
        let moved = tokio::time::timeout(WAIT, moved_rx.recv())
            .await?
            .context("watch ended")?;
        moves.push(moved);
    }
    let (listing_tx, listing_rx) = tokio::sync::oneshot::channel();
    let second_term = CancellationToken::new();
    let second = {
        let (shard, lock, stop, secrets) =
            (shard.clone(), lock()?, second_term.clone(), secrets.clone());
        let selector = format!("{key}={name}");
        tokio::spawn(async move {
            let mut listing_tx = Some(listing_tx);
            shard
                .run(&lock, &stop, |term| {
                    let (secrets, selector, tx) =
                        (secrets.clone(), selector.clone(), listing_tx.take());
                    async move {
                        // What the new term's work sees first: a consistent listing.
                        let listed = secrets
                            .list(&kube::api::ListParams::default().labels(&selector))
                            .await;
                        if let Some(tx) = tx {
                            let _ = tx.send(listed);
                        }
                        term.stop.cancelled().await
                    }
                })
                .await
        })
    };
    let listing = tokio::time::timeout(WAIT, listing_rx).await??;
    let listing = listing?;
    let listed_at: u64 = listing
        .metadata
        .resource_version
        .as_deref()
        .context("list version")?
        .parse()?;
    let listed_names: std::collections::BTreeSet<String> =
        listing.items.iter().map(|s| s.name_any()).collect();

    // The moves settle: nothing more moves off shard-r for 3 s.
    while let Ok(Some(moved)) = tokio::time::timeout(Duration::from_secs(3), moved_rx.recv()).await
    {
        moves.push(moved);
    }
    // The Lease's versions after the release: taken again, then `ready` from the sharder.
    let versions = lease_versions
        .0
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    let released = versions
        .iter()
        .position(|(_, holder, _)| holder.is_empty())
        .context("the release was seen")?;
    let (taken_at, _, verdict) = versions[released..]
        .iter()
        .find(|(_, holder, _)| holder == name)
        .context("taken again")?;
    ensure!(
        verdict.is_none(),
        "the take removed the state label: {verdict:?}"
    );
    let (ready_at, _, _) = versions[released..]
        .iter()
        .find(|(at, holder, state)| {
            at > taken_at && holder == name && state.as_deref() == Some("ready")
        })
        .context("labelled ready again")?;
    let last_move = moves.iter().map(|(_, at)| *at).max().unwrap_or_default();
    println!(
        "versions: taken {taken_at}, last move {last_move}, ready {ready_at}, new term listed at \
         {listed_at}"
    );
    ensure!(
        last_move < *ready_at,
        "the sharder wrote `ready` (version {ready_at}) before the last move off the shard \
         landed ({last_move})"
    );
    ensure!(
        listed_at >= *ready_at,
        "the new term listed (version {listed_at}) before the sharder's `ready` ({ready_at})"
    );
    let landed_after_return = moves.iter().filter(|(_, at)| at > taken_at).count();
    let under_the_new_term: Vec<&String> = moves
        .iter()
        .filter(|(moved, at)| *at > listed_at && listed_names.contains(moved))
        .map(|(moved, _)| moved)
        .collect();
    println!(
        "{} moves off {name}, {landed_after_return} landed after it took its Lease again; its new \
         term listed {} objects",
        moves.len(),
        listed_names.len()
    );
    ensure!(
        under_the_new_term.is_empty(),
        "moved away after the new term listed them: {under_the_new_term:?}"
    );
    second_term.cancel();
    ensure!(
        second.await?? == kube_sharding::ShardRunEnd::Stopped { released: true },
        "second term ended cleanly"
    );
    watcher.abort();
    lease_versions.1.abort();
    Ok(landed_after_return)
}
