//! Several processes at once: two sharder replicas electing a leader on a control plane of their
//! own, and the sharder with three `checksum-controller` shards splitting a ring between them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::{
    ShardTiming, create_lease, create_ring, expected_shard, ring_spec, secret, secret_review,
    start_checksum_shard, wait_status, wait_webhook,
};
use e2e::process::{Process, poll_until};
use e2e::scenario::{DedicatedScenario, SharedScenario};
use e2e::sharder_process::{SharderFiles, SharderSettings};
use e2e::{IndependentRing, unique_name};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use kube_sharder::records::EVENT_LEADERSHIP_ACQUIRED;
use kube_sharding_api::labels;
use serde_json::Value;
use sha2::{Digest, Sha256};

const SHARDS: [&str; 3] = ["shard-a", "shard-b", "shard-c"];

/// Generous bound for processes starting up and caches syncing on a busy machine.
const STARTUP: Duration = Duration::from_secs(60);

/// Identities this sharder process logged becoming the leader with.
fn leader_identities(process: &Process) -> Vec<String> {
    process
        .records()
        .iter()
        .filter(|r| r["event"] == EVENT_LEADERSHIP_ACQUIRED)
        .filter_map(|r| r["identity"].as_str().map(str::to_string))
        .collect()
}

/// Holder of the sharder's leader-election Lease, if any.
async fn election_holder(client: &Client) -> anyhow::Result<Option<String>> {
    let leases = Api::<Lease>::namespaced(client.clone(), labels::NAMESPACE_SYSTEM);
    Ok(leases
        .get_opt("sharder")
        .await?
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty()))
}

/// The URL the ring's webhook configuration points the API server at.
async fn webhook_url(client: &Client, ring: &str) -> anyhow::Result<Option<String>> {
    let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    Ok(configs
        .get_opt(&labels::webhook_configuration_name(ring))
        .await?
        .and_then(|c| c.webhooks)
        .and_then(|hooks| hooks.into_iter().next())
        .and_then(|hook| hook.client_config.url))
}

/// Posts a review straight to one replica's webhook server; returns the shard its patch assigns,
/// or `None` while the replica answers without a patch (its view of the ring is not built yet).
fn assigned_by_replica(
    files: &SharderFiles,
    ring: &str,
    namespace: &str,
    name: &str,
) -> anyhow::Result<Option<String>> {
    let review = secret_review(
        &format!("uid-{name}"),
        namespace,
        name,
        &[("app", "leader")],
    );
    let (status, text) =
        files.post_webhook(&labels::webhook_path(ring), review.to_string().as_bytes())?;
    ensure!(status == 200, "webhook answered {status}: {text}");
    let body: Value = serde_json::from_str(&text)?;
    let response = &body["response"];
    ensure!(
        body["kind"] == "AdmissionReview" && response["uid"] == format!("uid-{name}"),
        "not a response to our review: {body}"
    );
    ensure!(response["allowed"] == true, "{body}");
    let Some(patch) = response.get("patch") else {
        return Ok(None);
    };
    ensure!(response["patchType"] == "JSONPatch", "{body}");
    let patch: ByteString = serde_json::from_value(patch.clone())?;
    let patch: Value = serde_json::from_slice(&patch.0)?;
    let pointer = format!(
        "/metadata/labels/{}",
        labels::shard_label(ring)
            .replace('~', "~0")
            .replace('/', "~1")
    );
    let op = patch
        .as_array()
        .and_then(|ops| ops.iter().find(|op| op["path"] == pointer.as_str()))
        .with_context(|| format!("patch does not add the shard label: {patch}"))?;
    ensure!(op["op"] == "add", "{patch}");
    Ok(op["value"].as_str().map(str::to_string))
}

/// Creates Secret `name` through the API server and checks it got the shard the ring predicts.
async fn create_and_check(
    client: &Client,
    namespace: &str,
    ring: &str,
    name: &str,
) -> anyhow::Result<()> {
    let created = Api::<Secret>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &secret(name))
        .await?;
    let predicted = IndependentRing::unweighted(SHARDS);
    let expected = expected_shard(&predicted, namespace, name);
    let got = created.labels().get(&labels::shard_label(ring));
    ensure!(
        got.map(String::as_str) == expected,
        "{name}: got shard {got:?}, ring predicts {expected:?}"
    );
    Ok(())
}

/// Two sharder replicas: one leader runs the controllers, both answer the webhook, and stopping
/// the leader hands over to the other within the lease duration.
#[tokio::test]
async fn two_sharders_elect_one_leader_and_hand_over_on_sigterm() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("leader").await?;
    let cluster = dedicated.cluster();
    let ring = unique_name("leader");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    for shard in SHARDS {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }

    let settings = SharderSettings::default();
    let files = [
        SharderFiles::create(cluster.kubeconfig(), &settings)?,
        SharderFiles::create(cluster.kubeconfig(), &settings)?,
    ];
    let mut processes = [files[0].start_process()?, files[1].start_process()?];
    for f in &files {
        f.wait_ready(STARTUP).await?;
    }

    // Exactly one leader: the Lease names it, only its log says so, and the ring's webhook
    // configuration points at its own URL.
    let holder = poll_until("a leader to be elected", STARTUP, || async {
        election_holder(&client).await
    })
    .await?;
    let leader = poll_until("the leader to log its election", STARTUP, || {
        let found = processes
            .iter()
            .position(|p| leader_identities(p).contains(&holder));
        async move { Ok(found) }
    })
    .await?;
    let follower = 1 - leader;
    ensure!(
        leader_identities(&processes[follower]).is_empty(),
        "the follower logged an election too"
    );
    wait_status(&client, &ring, 3, 3).await?;
    let leader_url = format!(
        "{}{}",
        files[leader].webhook_url(),
        labels::webhook_path(&ring)
    );
    poll_until(
        "the webhook configuration to name the leader",
        STARTUP,
        || async {
            Ok(
                (webhook_url(&client, &ring).await?.as_deref() == Some(leader_url.as_str()))
                    .then_some(()),
            )
        },
    )
    .await?;
    ensure!(
        election_holder(&client).await?.as_ref() == Some(&holder),
        "leadership moved without a reason"
    );

    // Both replicas answer webhooks with the same assignment: every replica keeps the rings view.
    for (i, f) in files.iter().enumerate() {
        for name in ["direct-0", "direct-1", "direct-2"] {
            let expected =
                expected_shard(&IndependentRing::unweighted(SHARDS), &ns, name).map(str::to_string);
            let got = poll_until(&format!("replica {i} to assign {name}"), STARTUP, || {
                let got = assigned_by_replica(f, &ring, &ns, name);
                async move { got }
            })
            .await?;
            ensure!(
                Some(&got) == expected.as_ref(),
                "replica {i} assigned {name} to {got}, ring predicts {expected:?}"
            );
        }
    }
    wait_webhook(&client, &ns, &ring, &SHARDS).await?;
    create_and_check(&client, &ns, &ring, "before-handover").await?;

    // SIGTERM to the leader: it stops its controllers and releases the Lease, the follower
    // takes over within the lease duration (plus slack for a busy machine).
    let handover_bound =
        Duration::from_secs(settings.leader_election.0.into()) + Duration::from_secs(5);
    let signalled = std::time::Instant::now();
    processes[leader].terminate()?;
    let status = processes[leader].wait(handover_bound).await?;
    ensure!(
        status.success(),
        "the leader exits 0 on SIGTERM, got {status}"
    );
    let successor = poll_until(
        "the follower to take over",
        handover_bound.saturating_sub(signalled.elapsed()),
        || async {
            let holder = election_holder(&client).await?;
            Ok(holder.filter(|h| leader_identities(&processes[follower]).contains(h)))
        },
    )
    .await?;
    ensure!(successor != holder, "the new leader has its own identity");
    let took = signalled.elapsed();
    ensure!(
        took <= handover_bound,
        "handover took {took:?} after SIGTERM, more than {handover_bound:?}"
    );

    // The new leader re-applies the webhook configuration with its own URL, and assignment
    // through the API server keeps working.
    let follower_url = format!(
        "{}{}",
        files[follower].webhook_url(),
        labels::webhook_path(&ring)
    );
    poll_until(
        "the webhook configuration to name the new leader",
        STARTUP,
        || async {
            Ok(
                (webhook_url(&client, &ring).await?.as_deref() == Some(follower_url.as_str()))
                    .then_some(()),
            )
        },
    )
    .await?;
    wait_webhook(&client, &ns, &ring, &SHARDS).await?;
    create_and_check(&client, &ns, &ring, "after-handover").await?;

    processes[follower].terminate()?;
    let status = processes[follower].wait(STARTUP).await?;
    ensure!(
        status.success(),
        "the new leader exits 0 on SIGTERM, got {status}"
    );
    ensure!(
        election_holder(&client).await?.is_none(),
        "the last leader released the Lease on shutdown"
    );
    for p in &mut processes {
        p.passed();
    }
    Ok(())
}

/// The data of Secret number `i`: a few keys with distinct values.
fn secret_data(i: usize) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("index".to_string(), i.to_string()),
        ("password".to_string(), format!("hunter{}", i * 7)),
        ("empty".to_string(), String::new()),
    ])
}

/// The sharder assigns Secrets over three real shards as the ring predicts; each shard writes the
/// checksums ConfigMaps of its own Secrets, on the same shard.
#[tokio::test]
async fn sharder_and_three_checksum_shards_split_a_ring() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("checksums").await?;
    let ring = unique_name("checksums");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let mut shards = Vec::new();
    for name in SHARDS {
        shards.push(start_checksum_shard(
            &ring,
            &ns,
            name,
            ShardTiming::RELAXED,
        )?);
    }

    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    poll_until("three shards to hold their Leases", STARTUP, || async {
        let mut held = 0;
        for shard in SHARDS {
            let holder = leases
                .get_opt(shard)
                .await?
                .and_then(|l| l.spec)
                .and_then(|s| s.holder_identity);
            held += usize::from(holder.as_deref() == Some(shard));
        }
        Ok((held == SHARDS.len()).then_some(()))
    })
    .await?;
    wait_status(&client, &ring, 3, 3).await?;
    wait_webhook(&client, &ns, &ring, &SHARDS).await?;

    let key = labels::shard_label(&ring);
    let predicted = IndependentRing::unweighted(SHARDS);
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let count = 30;
    let mut expected = BTreeMap::new();
    for i in 0..count {
        let name = format!("secret-{i}");
        let data = secret_data(i);
        let object = Secret {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            data: Some(
                data.iter()
                    .map(|(k, v)| (k.clone(), ByteString(v.as_bytes().to_vec())))
                    .collect(),
            ),
            ..Default::default()
        };
        let created = secrets.create(&PostParams::default(), &object).await?;
        let shard = expected_shard(&predicted, &ns, &name)
            .context("a ring of three shards assigns every key")?;
        let got = created.labels().get(&key);
        ensure!(
            got.map(String::as_str) == Some(shard),
            "{name}: got shard {got:?}, ring predicts {shard}"
        );
        let checksums: BTreeMap<String, String> = data
            .iter()
            .map(|(k, v)| (k.clone(), hex_sha256(v)))
            .collect();
        expected.insert(name, (shard.to_string(), checksums));
    }
    let used: BTreeSet<_> = expected.values().map(|(s, _)| s.clone()).collect();
    ensure!(
        used.len() == 3,
        "{count} Secrets should spread over all 3 shards: {used:?}"
    );

    let config_maps = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    poll_until(
        &format!("{count} checksums ConfigMaps with the right data and shard"),
        STARTUP,
        || async {
            let mut missing = Vec::new();
            for (name, (shard, checksums)) in &expected {
                let cm = config_maps.get_opt(&format!("checksums-{name}")).await?;
                let ok = cm.is_some_and(|cm| {
                    cm.data.as_ref() == Some(checksums) && cm.labels().get(&key) == Some(shard)
                });
                if !ok {
                    missing.push(name.clone());
                }
            }
            if missing.is_empty() {
                Ok(Some(()))
            } else {
                Err(anyhow::anyhow!("not yet right: {missing:?}"))
            }
        },
    )
    .await?;

    // Each Secret was reconciled by its own shard and by no other.
    for (process, shard) in shards.iter().zip(SHARDS) {
        let reconciled: BTreeSet<String> = process
            .records()
            .iter()
            .filter(|r| r["event"] == "reconcile" && r["namespace"] == ns.as_str())
            .filter_map(|r| r["name"].as_str().map(str::to_string))
            .collect();
        let own: BTreeSet<String> = expected
            .iter()
            .filter(|(_, (s, _))| s == shard)
            .map(|(name, _)| name.clone())
            .collect();
        ensure!(
            reconciled == own,
            "{shard} reconciled {reconciled:?}, owns {own:?}"
        );
    }

    for process in &shards {
        process.terminate()?;
    }
    for process in &mut shards {
        let status = process.wait(STARTUP).await?;
        ensure!(status.success(), "a shard exits 0 on SIGTERM, got {status}");
    }
    for process in &mut shards {
        process.passed();
    }
    logs.passed();
    Ok(())
}

/// Lowercase hex SHA-256 of `value`.
fn hex_sha256(value: &str) -> String {
    hex::encode(Sha256::digest(value.as_bytes()))
}
