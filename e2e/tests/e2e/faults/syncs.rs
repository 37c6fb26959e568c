//! Syncs overtaken by events: a shard joining mid-sync, a move landing after a newer sync listed
//! its object.

use std::time::Duration;

use anyhow::ensure;
use e2e::fixtures::{
    WAIT, create_lease, create_ring, expected_shard, ring_spec, secret, wait_status, wait_webhook,
};
use e2e::gate::TcpGate;
use e2e::process::poll_until;
use e2e::scenario::DedicatedScenario;
use e2e::sharder_process::{SharderFiles, SharderSettings};
use e2e::{IndependentRing, unique_name};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube_sharder::records::EVENT_SUPERSEDED_MOVES_UNSETTLED;
use kube_sharding_api::labels;
use serde_json::json;

use super::{STARTUP, gated_sharder};

/// A sync stops when the ring's view changes under it and starts over with the current one: a
/// shard that leaves and comes back while its objects are being moved away keeps the objects
/// the outdated sync had not reached yet, and no more move patches go out for them. (A sync that
/// went on would patch every one of them for nothing: the webhook puts each back on the shard.)
#[tokio::test]
async fn a_sync_stops_when_a_shard_joins_mid_sync() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("midsync").await?;
    let cluster = dedicated.cluster();
    let ring = unique_name("midsync");
    create_four_leases(&client, &ns, &ring).await?;
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    // One patch at a time, so moving a shard's objects takes seconds.
    let settings = SharderSettings {
        concurrent_moves: 1,
        ..Default::default()
    };
    let files = SharderFiles::create(cluster.kubeconfig(), &settings)?;
    let mut sharder = files.start_process()?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let on_d = on_shard_d(&ring);
    let initially = create_secrets_on_four_shards(&client, &ns, &ring, 400).await?;
    ensure!(initially > 20, "only {initially} Secrets on shard-d");

    // shard-d leaves (releases its Lease, so it is known to have stopped): its objects are moved
    // one by one. As soon as the first has moved, it is back.
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    leave_and_return_after_a_move(&leases, &secrets, &on_d, initially, None).await?;

    // Converged: every Secret is where the four shards want it, or draining towards it from a
    // live shard (the test plays the shards and never acknowledges).
    let drain = labels::drain_label(&ring);
    let list = wait_settled(&secrets, &ns, &ring, &FOUR_SHARDS).await?;
    let kept = on_d(&list);
    let drained = list
        .items
        .iter()
        .filter(|s| s.labels().contains_key(&drain))
        .count();
    eprintln!(
        "mid-sync join: {kept} of {initially} Secrets never left shard-d, {drained} moved and drained back"
    );
    ensure!(
        kept > 0 && kept + drained == initially,
        "the outdated sync went on: {kept} kept, {drained} draining, {initially} were on shard-d"
    );
    let metrics = files.metrics()?;
    let moves = e2e::sharder_process::counter(
        &metrics,
        "controller_sharding_movements_total",
        &ring,
        "secrets",
    )?;
    // The moves that happened before the sync stopped, and at most one in flight.
    ensure!(
        moves <= drained as u64 + 1,
        "{moves} move patches for {drained} Secrets that moved: the outdated sync went on"
    );
    ensure!(
        metrics.lines().any(|l| l.starts_with(&format!(
            r#"controller_sharding_syncs_total{{clusterring="{ring}",outcome="superseded"}} "#
        ))),
        "no superseded sync counted"
    );
    sharder.terminate()?;
    sharder.wait(Duration::from_secs(15)).await?;
    sharder.passed();
    Ok(())
}

/// A move a stopped sync still had in flight lands after the newer view's sync listed its object,
/// placed by the old view, so that sync leaves it where it is: the stopped sync says so, and the
/// ring is synced once more right after, which drains the object to where the ring wants it.
/// The gate holds the webhook's answers back, so the move's placement is decided with the old
/// view and lands well after the new sync's listing, every time.
#[tokio::test]
async fn a_move_landing_after_a_newer_sync_listed_it_is_corrected() -> anyhow::Result<()> {
    // A control plane of its own: on the shared one the shared sharder leads and syncs.
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("late-move").await?;
    let cluster = dedicated.cluster();
    let ring = unique_name("late-move");
    create_four_leases(&client, &ns, &ring).await?;
    // One patch at a time, and no periodic sync within the test: only the sync the late move
    // asks for can put its object right.
    let settings = SharderSettings {
        concurrent_moves: 1,
        sync_period: "1h".into(),
        ..Default::default()
    };
    let (gate, files, mut sharder) = gated_sharder(cluster, settings).await?;
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    files.wait_ready(STARTUP).await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let on_d = on_shard_d(&ring);
    let initially = create_secrets_on_four_shards(&client, &ns, &ring, 60).await?;
    ensure!(initially >= 3, "only {initially} Secrets on shard-d");

    // Every answer of the webhook now arrives 2 s after the sharder gave it.
    gate.delay_answers(Duration::from_secs(2));
    // When shard-d is back, the second move's answer is on its way, decided without shard-d.
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    leave_and_return_after_a_move(&leases, &secrets, &on_d, initially, Some(&gate)).await?;
    sharder
        .wait_for_record("the stopped sync's late move reported", WAIT, |r| {
            r["event"] == EVENT_SUPERSEDED_MOVES_UNSETTLED
        })
        .await?;
    gate.delay_answers(Duration::ZERO);

    // Every Secret ends where the four shards want it, or draining towards it (the test plays the
    // shards and never acknowledges).
    wait_settled(&secrets, &ns, &ring, &FOUR_SHARDS).await?;
    sharder.terminate()?;
    sharder.wait(Duration::from_secs(15)).await?;
    sharder.passed();
    Ok(())
}

/// The shards of the tests of a shard that leaves and returns mid-sync: shard-d does.
const FOUR_SHARDS: [&str; 4] = ["shard-a", "shard-b", "shard-c", "shard-d"];

/// Creates the Leases of [`FOUR_SHARDS`] in `ns` for ring `ring`, held for an hour.
async fn create_four_leases(client: &kube::Client, ns: &str, ring: &str) -> anyhow::Result<()> {
    for shard in FOUR_SHARDS {
        create_lease(client, ns, ring, shard, 3600).await?;
    }
    Ok(())
}

/// Counts the Secrets of a list that ring `ring` has on shard-d.
fn on_shard_d(
    ring: &str,
) -> impl Fn(&kube::core::ObjectList<kube::core::PartialObjectMeta<Secret>>) -> usize {
    let key = labels::shard_label(ring);
    move |list| {
        list.items
            .iter()
            .filter(|s| s.labels().get(&key).map(String::as_str) == Some("shard-d"))
            .count()
    }
}

/// Once ring `ring` counts all of [`FOUR_SHARDS`] and its webhook assigns, creates Secrets
/// `s-0` .. `s-<count - 1>` in `ns`; returns how many the ring put on shard-d.
async fn create_secrets_on_four_shards(
    client: &kube::Client,
    ns: &str,
    ring: &str,
    count: usize,
) -> anyhow::Result<usize> {
    wait_status(client, ring, 4, 4).await?;
    wait_webhook(client, ns, ring, &FOUR_SHARDS).await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), ns);
    for i in 0..count {
        secrets
            .create(&PostParams::default(), &secret(&format!("s-{i}")))
            .await?;
    }
    Ok(on_shard_d(ring)(
        &secrets.list_metadata(&ListParams::default()).await?,
    ))
}

/// shard-d leaves (releases its Lease, so it is known to have stopped) and its objects are moved
/// one by one; as soon as the first of the `initially` on it (counted by `on_d`) has moved, it is
/// back: with `answers_held_by`, once that gate holds an answer of the webhook sent after the
/// first move (the next move's, placed without shard-d).
async fn leave_and_return_after_a_move(
    leases: &Api<Lease>,
    secrets: &Api<Secret>,
    on_d: &impl Fn(&kube::core::ObjectList<kube::core::PartialObjectMeta<Secret>>) -> usize,
    initially: usize,
    answers_held_by: Option<&TcpGate>,
) -> anyhow::Result<()> {
    // A release the shard marks itself (as the shard library does): its objects move directly.
    let release = json!({
        "metadata": {"annotations": {labels::ANNOTATION_RELEASED_BY: "shard-d"}},
        "spec": {"holderIdentity": null},
    });
    leases
        .patch("shard-d", &PatchParams::default(), &Patch::Merge(&release))
        .await?;
    poll_until("the first Secret moved off shard-d", WAIT, || async {
        let left = on_d(&secrets.list_metadata(&ListParams::default()).await?);
        Ok((left < initially).then_some(()))
    })
    .await?;
    if let Some(gate) = answers_held_by {
        // The next move's webhook call has reached the sharder, which decided it without
        // shard-d; its answer is held while shard-d comes back.
        let moved = std::time::Instant::now();
        poll_until("the next move's webhook answer held", WAIT, || async {
            Ok(gate.last_answer_held().filter(|held| *held > moved))
        })
        .await?;
    }
    let now = MicroTime(Timestamp::now());
    let acquire = json!({
        "metadata": {"annotations": {labels::ANNOTATION_RELEASED_BY: null}},
        "spec": {"holderIdentity": "shard-d", "acquireTime": now, "renewTime": now},
    });
    leases
        .patch("shard-d", &PatchParams::default(), &Patch::Merge(&acquire))
        .await?;
    Ok(())
}

/// Waits until every Secret of `ns` sits where ring `ring` of `shards` wants it, or carries the
/// drain label towards it (the tests play the shards and never acknowledge); returns them.
async fn wait_settled(
    secrets: &Api<Secret>,
    ns: &str,
    ring: &str,
    shards: &[&str],
) -> anyhow::Result<kube::core::ObjectList<kube::core::PartialObjectMeta<Secret>>> {
    let predicted = IndependentRing::unweighted(shards.iter().copied());
    let (key, drain) = (labels::shard_label(ring), labels::drain_label(ring));
    poll_until("Secrets settled on the four-shard ring", WAIT, || async {
        let list = secrets.list_metadata(&ListParams::default()).await?;
        let settled = list.items.iter().all(|s| {
            let want = expected_shard(&predicted, ns, &s.name_any());
            let have = s.labels().get(&key).map(String::as_str);
            have == want || (have.is_some() && s.labels().contains_key(&drain))
        });
        Ok(settled.then_some(list))
    })
    .await
}
