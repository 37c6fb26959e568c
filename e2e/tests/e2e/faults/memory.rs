//! What the sharder spends: no request per Lease renewal, no memory for big Leases or dry-run pins.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::{
    WAIT, create_lease, create_ring, ring_spec, ring_with_shards, secret, secret_review,
    wait_status, wait_webhook,
};
use e2e::process::poll_until;
use e2e::scenario::DedicatedScenario;
use e2e::sharder_process::{SharderFiles, SharderSettings};
use e2e::unique_name;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube_sharding_api::{RingKind, labels};
use serde_json::json;

use super::STARTUP;

/// Lease renewals cost the sharder no API request: with five shards renewing every second, the
/// API server serves no GET or write of the ring's webhook configuration, and the sharder's own
/// request counter (counted where requests leave the process) shows no request at all besides
/// its own leader election, nor a hash ring rebuilt.
#[tokio::test]
async fn lease_renewals_cost_the_sharder_no_request() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated, client, ..
    } = DedicatedScenario::open().await?;
    let cluster = dedicated.cluster();
    let shards = ["shard-a", "shard-b", "shard-c", "shard-d", "shard-e"];
    let (ns, ring) = ring_with_shards(cluster, &client, "renewals", &shards).await?;
    let files = SharderFiles::create(cluster.kubeconfig(), &SharderSettings::default())?;
    let mut sharder = files.start_process()?;
    files.wait_ready(STARTUP).await?;
    wait_status(&client, &ring, 5, 5).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    // Let the start-up writes settle.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let requests = |verb: &'static str| {
        cluster.apiserver_metric(
            "apiserver_request_total",
            &[
                ("resource", "mutatingwebhookconfigurations"),
                ("verb", verb),
            ],
        )
    };
    let before = (requests("GET")?, requests("PATCH")?);
    let sharder_before = sent_and_rebuilt(&files.metrics()?);
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    for _ in 0..8 {
        for shard in shards {
            let renew = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
            leases
                .patch(shard, &PatchParams::default(), &Patch::Merge(&renew))
                .await?;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let after = (requests("GET")?, requests("PATCH")?);
    ensure!(
        after == before,
        "40 renewals made the API server serve webhook configuration GETs/PATCHes: {before:?} -> {after:?}"
    );
    let sharder_after = sent_and_rebuilt(&files.metrics()?);
    ensure!(
        sharder_after == sharder_before,
        "40 renewals made the sharder send requests or rebuild its hash ring: (requests, rebuilds) went from {sharder_before:?} to {sharder_after:?}"
    );
    sharder.passed();
    Ok(())
}

/// From a sharder's `/metrics` text: the requests its clients sent, its own leader election and
/// watches aside (a watch is re-established every few minutes whatever happens), and the hash
/// rings it rebuilt.
fn sent_and_rebuilt(metrics: &str) -> (u64, u64) {
    let total = |prefix: &str, skip: &[&str]| -> u64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(prefix) && !skip.iter().any(|s| l.contains(s)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    (
        total(
            "controller_sharding_api_requests_total{",
            &["client=\"leader_election\"", "verb=\"watch\""],
        ),
        total("controller_sharding_ring_calculations_total{", &[]),
    )
}

/// Anyone allowed to create Leases can label them for a ring, any ring: every sharder replica
/// caches such Leases. A tenant's 300 Leases for a ring that does not exist, each with 200 KiB of
/// annotations (60 MiB in all), leave the sharder's resident memory about flat, because its
/// caches keep only the fields it reads. So do 100 Leases each with an empty ring value (never
/// listed), with a ring value no ring can have (never cached), and with a valid one but a
/// 100 KiB `holderIdentity`, weight and `leaves-controlled-objects` (kept as markers): 70 MiB
/// more. A real shard still joins its ring afterwards.
#[tokio::test]
async fn big_labelled_leases_do_not_grow_the_sharders_memory() -> anyhow::Result<()> {
    const LEASES: usize = 300;
    const ANNOTATION_KIB: usize = 200;
    const HOSTILE: usize = 100;
    const FIELD_KIB: usize = 100;
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("big-leases").await?;
    let cluster = dedicated.cluster();
    let files = SharderFiles::create(cluster.kubeconfig(), &SharderSettings::default())?;
    let mut sharder = files.start_process()?;
    files.wait_ready(STARTUP).await?;
    let pid = sharder.id().context("the sharder has a process id")?;
    // Past its start-up allocations.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = e2e::process::rss_kib(pid)?;

    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let blob = "x".repeat(ANNOTATION_KIB * 1024);
    for i in 0..LEASES {
        let name = format!("squat-{i}");
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(
                    [(
                        RingKind::ClusterRing.lease_label().to_string(),
                        "no-such-ring".to_string(),
                    )]
                    .into(),
                ),
                annotations: Some([("tenant.example/blob".to_string(), blob.clone())].into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(name),
                lease_duration_seconds: Some(3600),
                renew_time: Some(MicroTime(Timestamp::now())),
                ..Default::default()
            }),
        };
        leases.create(&PostParams::default(), &lease).await?;
    }
    // Ring values no ring can have, and fields longer than any valid value.
    let field = "9".repeat(FIELD_KIB * 1024);
    for (prefix, ring, fields) in [
        ("empty", "", 2),
        ("invalid", "No_Such_Ring", 2),
        ("long", "no-such-ring", 3),
    ] {
        for i in 0..HOSTILE {
            let mut annotations =
                BTreeMap::from([(labels::ANNOTATION_WEIGHT.to_string(), field.clone())]);
            if fields == 3 {
                annotations.insert(
                    labels::ANNOTATION_LEAVES_CONTROLLED_OBJECTS.to_string(),
                    field.clone(),
                );
            }
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(format!("{prefix}-{i}")),
                    labels: Some(
                        [(
                            RingKind::ClusterRing.lease_label().to_string(),
                            ring.to_string(),
                        )]
                        .into(),
                    ),
                    annotations: Some(annotations),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(field.clone()),
                    lease_duration_seconds: Some(3600),
                    renew_time: Some(MicroTime(Timestamp::now())),
                    ..Default::default()
                }),
            };
            leases.create(&PostParams::default(), &lease).await?;
        }
    }
    // Every Lease of a possible ring is in the sharder's cache: its state metrics report each.
    // None of the others is.
    poll_until("the sharder to report every Lease", WAIT, || async {
        let metrics = files.metrics()?;
        let info = |ring: &str| {
            metrics
                .lines()
                .filter(|l| {
                    l.starts_with("controller_sharding_shard_info{")
                        && l.contains(&format!("clusterring=\"{ring}\""))
                })
                .count()
        };
        let cached = info("no-such-ring");
        ensure!(
            info("") == 0 && info("No_Such_Ring") == 0,
            "Leases of no possible ring were cached"
        );
        Ok((cached == LEASES + HOSTILE).then_some(()))
    })
    .await?;
    let after = e2e::process::rss_kib(pid)?;
    let payload = (LEASES * ANNOTATION_KIB + HOSTILE * FIELD_KIB * 7) as u64;
    println!(
        "sharder VmRSS {before} KiB before, {after} KiB after {} Leases with {payload} KiB of \
         annotations and holders",
        LEASES + 3 * HOSTILE
    );
    ensure!(
        after.saturating_sub(before) < payload / 4,
        "the sharder's memory grew by {} KiB with {payload} KiB of Lease annotations",
        after.saturating_sub(before)
    );
    // The cache still serves real shards.
    let ring = unique_name("after-squat");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    create_lease(&client, &ns, &ring, "shard-a", 3600).await?;
    wait_status(&client, &ring, 1, 1).await?;
    sharder.passed();
    Ok(())
}

/// Whoever reaches the webhook port can send it admission reviews, and anyone who may dry-run a
/// create can make the API server send them: neither grows the sharder's memory through the pins
/// it remembers for controllers' children. 1,000 dry-run reviews with a 200 KiB pin each and
/// 1,000 real-looking reviews with a 200 KiB pin each (no shard name; 400 MiB in all), then
/// 20,000 reviews with valid pins on names of 253 characters (twice the per-ring cap), leave the
/// sharder's resident memory within 48 MiB of where it was; a real create is still assigned to
/// its pinned shard.
#[tokio::test]
async fn dry_run_pins_do_not_grow_the_sharders_memory() -> anyhow::Result<()> {
    const BIG: usize = 1_000;
    const PIN_KIB: usize = 200;
    const VALID: usize = 20_000;
    const BOUND_KIB: u64 = 48 * 1024;
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("dry-pins").await?;
    let cluster = dedicated.cluster();
    let files = SharderFiles::create(cluster.kubeconfig(), &SharderSettings::default())?;
    let mut sharder = files.start_process()?;
    files.wait_ready(STARTUP).await?;
    let pid = sharder.id().context("the sharder has a process id")?;
    let ring = unique_name("dry-pins");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let shards = ["shard-a", "shard-b", "shard-c"];
    for shard in shards {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    wait_status(&client, &ring, 3, 3).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    let webhook = e2e::webhook_client::WebhookClient::connect(
        ([127, 0, 0, 1], files.webhook_port).into(),
        &files.ca,
    )
    .await?;
    let path = labels::webhook_path(&ring);
    let pin = labels::pin_annotation(&ring);
    let review = |uid: String, name: String, value: &str, dry_run: bool| {
        let mut review = secret_review(&uid, &ns, &name, &[]);
        review["request"]["object"]["metadata"]["annotations"] = json!({ pin.as_str(): value });
        review["request"]["dryRun"] = json!(dry_run);
        review.to_string().into_bytes()
    };
    // Past its start-up allocations, and the connection's buffers.
    webhook
        .post_all(&path, 50, 8, |i| {
            review(format!("warm-{i}"), format!("warm-{i}"), "shard-b", true)
        })
        .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = e2e::process::rss_kib(pid)?;

    let big = "x".repeat(PIN_KIB * 1024);
    webhook
        .post_all(&path, BIG, 8, |i| {
            review(format!("dry-{i}"), format!("dry-{i}"), &big, true)
        })
        .await?;
    webhook
        .post_all(&path, BIG, 8, |i| {
            review(format!("invalid-{i}"), format!("invalid-{i}"), &big, false)
        })
        .await?;
    let long_name = |i: usize| format!("{i:0>253}");
    webhook
        .post_all(&path, VALID, 16, |i| {
            review(format!("valid-{i}"), long_name(i), shards[i % 3], false)
        })
        .await?;
    let after = e2e::process::rss_kib(pid)?;
    let sent = (2 * BIG * PIN_KIB) as u64;
    println!(
        "sharder VmRSS {before} KiB before, {after} KiB after {BIG} dry-run and {BIG} invalid \
         pins ({sent} KiB) and {VALID} valid pins"
    );
    ensure!(
        after.saturating_sub(before) < BOUND_KIB,
        "the sharder's memory grew by {} KiB (bound {BOUND_KIB} KiB)",
        after.saturating_sub(before)
    );
    // Real writes are still answered, pins included.
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let mut real = secret("real");
    real.metadata.annotations = Some([(pin.clone(), "shard-b".to_string())].into());
    let created = secrets.create(&PostParams::default(), &real).await?;
    ensure!(
        created
            .labels()
            .get(&labels::shard_label(&ring))
            .map(String::as_str)
            == Some("shard-b"),
        "the pinned Secret was not assigned to shard-b: {:?}",
        created.labels()
    );
    sharder.passed();
    Ok(())
}
