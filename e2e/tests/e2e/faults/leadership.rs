//! Leadership and rollouts of the sharder: losing leadership stops its controllers, refused
//! settings stop it at start, a rollout refuses no admission call, a ready replica assigns at once.

use std::time::Duration;

use anyhow::ensure;
use e2e::fixtures::{
    WAIT, create_lease, create_ring, expected_shard, ring_spec, ring_with_shards, secret,
    secret_review, wait_status, wait_webhook,
};
use e2e::gate::Balancer;
use e2e::process::poll_until;
use e2e::scenario::{DedicatedScenario, SharedScenario};
use e2e::sharder_process::{SharderFiles, SharderSettings};
use e2e::{Cluster, IndependentRing, cluster, unique_name};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube_sharder::records::EVENT_LEADERSHIP_LOST;
use kube_sharding_api::labels;
use serde_json::json;

use super::STARTUP;

/// Watches the API server holds open on `resource` (core group), from its own metrics.
fn watches_on(cluster: &Cluster, resource: &str) -> anyhow::Result<u64> {
    cluster.apiserver_metric(
        "apiserver_longrunning_requests",
        &[("verb", "WATCH"), ("resource", resource)],
    )
}

/// Waits until the API server holds exactly `expected` watches on `resource`, and they stay so
/// for `hold`.
async fn wait_watches(
    cluster: &Cluster,
    resource: &str,
    expected: u64,
    hold: Duration,
) -> anyhow::Result<()> {
    poll_until(
        &format!("{expected} watches on {resource}"),
        Duration::from_secs(20),
        || async { Ok((watches_on(cluster, resource)? == expected).then_some(())) },
    )
    .await?;
    let until = tokio::time::Instant::now() + hold;
    while tokio::time::Instant::now() < until {
        let now = watches_on(cluster, resource)?;
        ensure!(
            now == expected,
            "watches on {resource} went from {expected} to {now}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

/// Losing the leader Lease stops every task started under leadership (the missed-assignment
/// watches included) at once, and winning it back starts exactly one set again.
#[tokio::test]
async fn leadership_loss_stops_every_controller_watch() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("flap").await?;
    let cluster = dedicated.cluster();
    let ring = unique_name("flap");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    create_lease(&client, &ns, &ring, "shard-a", 3600).await?;
    // kube-controller-manager's garbage collector watches every resource: wait until it does, and
    // count from there.
    let baseline = poll_until(
        "the garbage collector to watch Secrets",
        STARTUP,
        || async {
            let n = watches_on(cluster, "secrets")?;
            Ok((n > 0).then_some(n))
        },
    )
    .await?;

    let files = SharderFiles::create(cluster.kubeconfig(), &SharderSettings::default())?;
    let mut sharder = files.start_process()?;
    files.wait_ready(STARTUP).await?;
    wait_status(&client, &ring, 1, 1).await?;
    // One missed-assignment watch per ring resource while leading.
    wait_watches(cluster, "secrets", baseline + 1, Duration::from_secs(2)).await?;

    // Another replica takes the Lease: the sharder must stop its watches at once.
    let leases = Api::<Lease>::namespaced(client.clone(), labels::NAMESPACE_SYSTEM);
    let steal = json!({"spec": {
        "holderIdentity": "thief",
        "leaseDurationSeconds": 8,
        "renewTime": MicroTime(Timestamp::now()),
        "acquireTime": MicroTime(Timestamp::now()),
    }});
    leases
        .patch("sharder", &PatchParams::default(), &Patch::Merge(&steal))
        .await?;
    sharder
        .wait_for_record("the sharder to notice the loss", WAIT, |r| {
            r["event"] == EVENT_LEADERSHIP_LOST
        })
        .await?;
    wait_watches(cluster, "secrets", baseline, Duration::from_secs(3)).await?;

    // The thief stops renewing; the sharder leads again with exactly one set of watches.
    poll_until("the sharder to lead again", STARTUP, || async {
        let holder = leases
            .get("sharder")
            .await?
            .spec
            .and_then(|s| s.holder_identity)
            .unwrap_or_default();
        Ok((!holder.is_empty() && holder != "thief").then_some(()))
    })
    .await?;
    wait_watches(cluster, "secrets", baseline + 1, Duration::from_secs(5)).await?;
    sharder.passed();
    Ok(())
}

/// A leader-election setting the Lease lock refuses stops the sharder at start, naming the field.
#[tokio::test]
async fn refused_leader_election_settings_stop_the_sharder_at_start() -> anyhow::Result<()> {
    let cluster = cluster();
    let settings = SharderSettings {
        // The renew deadline must be shorter than the Lease duration.
        leader_election: (3, 5, 1),
        ..Default::default()
    };
    let files = SharderFiles::create(cluster.kubeconfig(), &settings)?;
    let mut sharder = files.start_process()?;
    let status = sharder.wait(WAIT).await?;
    ensure!(!status.success(), "the sharder ran with refused settings");
    let logs = sharder.logs();
    ensure!(
        logs.contains("leaderElection.renewDeadline")
            || logs.contains("leaderElection.leaseDuration"),
        "the error does not name the field: {logs}"
    );
    sharder.passed();
    Ok(())
}

/// A rolling update of the sharder (a new replica becomes ready, then the old one gets SIGTERM)
/// under a steady stream of creates refuses no admission call: the old replica stops being ready
/// first and serves on until the balancer (standing in for the Service) has dropped it, so every
/// object is assigned in its CREATE response.
#[tokio::test]
async fn a_sharder_rollout_refuses_no_admission_call() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("rollout").await?;
    let cluster = dedicated.cluster();
    let ring = unique_name("rollout");
    let shards = ["shard-a", "shard-b"];
    let balancer = Balancer::start().await?;
    let settings = SharderSettings {
        webhook_url: Some(format!("https://{}", balancer.addr())),
        ..Default::default()
    };
    let files = [
        SharderFiles::create(cluster.kubeconfig(), &settings)?,
        SharderFiles::create(cluster.kubeconfig(), &settings)?,
    ];
    // Replicas of one Deployment serve one certificate (one Secret), which the webhook
    // configuration's CA bundle trusts whichever replica leads.
    for file in ["ca.crt", "ca.key", "tls.crt", "tls.key"] {
        std::fs::copy(files[0].dir.join(file), files[1].dir.join(file))?;
    }
    for f in &files {
        balancer.add(
            ([127, 0, 0, 1], f.webhook_port).into(),
            ([127, 0, 0, 1], f.health_port).into(),
        );
    }
    let mut old = files[0].start_process()?;
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    for shard in shards {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    files[0].wait_ready(STARTUP).await?;
    wait_status(&client, &ring, 2, 2).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;

    // A steady stream of creates, every one checked for its assignment.
    let stop = tokio_util::sync::CancellationToken::new();
    // Ends the stream of creates however the test returns.
    let _stop_creates = stop.clone().drop_guard();
    let creates = {
        let (secrets, key, stop) = (
            Api::<Secret>::namespaced(client.clone(), &ns),
            labels::shard_label(&ring),
            stop.clone(),
        );
        tokio::spawn(async move {
            let (mut created, mut unassigned) = (0usize, Vec::new());
            while !stop.is_cancelled() {
                let name = format!("steady-{created}");
                let object = secrets
                    .create(&PostParams::default(), &secret(&name))
                    .await?;
                if !object.labels().contains_key(&key) {
                    unassigned.push(name);
                }
                created += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            anyhow::Ok((created, unassigned))
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut new = files[1].start_process()?;
    files[1].wait_ready(STARTUP).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    old.terminate()?;
    let status = old.wait(Duration::from_secs(20)).await?;
    ensure!(
        status.success(),
        "the old replica exits 0 on SIGTERM, got {status}"
    );
    // The new replica answers alone for a while.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.cancel();
    let (created, unassigned) = creates.await??;
    ensure!(created >= 40, "only {created} creates during the rollout");
    ensure!(
        unassigned.is_empty(),
        "{} of {created} objects created during the rollout were not assigned: {unassigned:?}",
        unassigned.len()
    );
    new.passed();
    old.passed();
    Ok(())
}

/// A replica reports ready only once its webhook answers from complete ring views: the first
/// admission review it gets after `/readyz` turns 200 is assigned as the ring predicts.
#[tokio::test]
async fn a_ready_replica_assigns_at_once() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ..
    } = SharedScenario::open().await?;
    let shards = ["shard-a", "shard-b", "shard-c"];
    let (ns, ring) = ring_with_shards(cluster, &client, "ready", &shards).await?;
    // The shared sharder leads; this replica follows, serving the webhook and probes only.
    let files = SharderFiles::create(cluster.kubeconfig(), &SharderSettings::default())?;
    wait_status(&client, &ring, 3, 3).await?;
    let mut replica = files.start_process()?;
    let readyz = format!("http://127.0.0.1:{}/readyz", files.health_port);
    poll_until("the replica to be ready", STARTUP, || {
        let ready = std::process::Command::new("curl")
            .args(["-sf", "-o", "/dev/null", &readyz])
            .status()
            .is_ok_and(|s| s.success());
        async move { Ok(ready.then_some(())) }
    })
    .await?;
    let review = secret_review("u-ready", &ns, "first", &[]);
    let (status, body) =
        files.post_webhook(&labels::webhook_path(&ring), review.to_string().as_bytes())?;
    ensure!(status == 200, "webhook answered {status}: {body}");
    let response: serde_json::Value = serde_json::from_str(&body)?;
    let patch = response["response"]["patch"].as_str().unwrap_or_default();
    ensure!(
        !patch.is_empty(),
        "the first review after readiness was not assigned: {body}"
    );
    let decoded: k8s_openapi::ByteString =
        serde_json::from_value(response["response"]["patch"].clone())?;
    let decoded = String::from_utf8(decoded.0)?;
    let predicted = IndependentRing::unweighted(shards);
    let want = expected_shard(&predicted, &ns, "first").unwrap_or_default();
    ensure!(
        decoded.contains(&format!("\"{want}\"")),
        "assigned {decoded}, the ring predicts {want}"
    );
    replica.passed();
    logs.passed();
    Ok(())
}
