//! Stable shards (docs/shard-library.md, "Stable shards"): checksum-controller shards named like
//! the pods of a StatefulSet, with `--on-shutdown=keep-if-returning`, against the shared sharder.
//! A shard stopped with SIGTERM whose StatefulSet recreates its pod keeps its Lease, and a new
//! process of the same name takes it back at once: no object changes shard, and the new process
//! reconciles them all. On scale-in the stopping shard releases and its objects move.
//!
//! The StatefulSet is a real object of the API server, read by the shards; its pods never run
//! here (the shards are processes of the test), which does not matter to what the shards read.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use e2e::fixtures::{
    ShardTiming, create_ring, ring_spec, secret, start_checksum_shard_with, wait_labelled,
    wait_status, wait_webhook,
};
use e2e::process::{Process, poll_until};
use e2e::scenario::SharedScenario;
use e2e::unique_name;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PostParams, WatchEvent, WatchParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::{RingKind, RingRef, labels};
use serde_json::{Value, json};

/// The StatefulSet the shards say they belong to.
const STATEFULSET: &str = "stable";
const SECRETS: usize = 200;
const WAIT: Duration = Duration::from_secs(30);
/// [`ShardTiming::RELAXED`]'s Lease duration: the time a stopped shard's pod has to come back
/// before its Lease expires.
const LEASE_DURATION: Duration = Duration::from_secs(15);

fn start_stable_shard(ring: &str, namespace: &str, shard: &str) -> anyhow::Result<Process> {
    let ring = RingRef::new(RingKind::ClusterRing, ring);
    start_checksum_shard_with(
        &ring,
        namespace,
        shard,
        ShardTiming::RELAXED,
        &["--on-shutdown", "keep-if-returning"],
    )
}

/// A StatefulSet of `replicas` pods named `stable-<ordinal>`.
async fn create_statefulset(client: &Client, namespace: &str, replicas: i32) -> anyhow::Result<()> {
    let statefulset: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": STATEFULSET},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": STATEFULSET}},
            "template": {
                "metadata": {"labels": {"app": STATEFULSET}},
                "spec": {"containers": [{"name": "shard", "image": "checksum-controller:latest"}]},
            },
        },
    }))?;
    Api::<StatefulSet>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &statefulset)
        .await?;
    Ok(())
}

/// Every change of a Secret's shard label away from a shard, and every drain label added, seen
/// by a watch of `namespace` from `from` on.
#[derive(Clone, Default)]
struct LabelChanges(Arc<Mutex<Vec<String>>>);

impl LabelChanges {
    fn watch(
        secrets: Api<Secret>,
        ring: &str,
        from: String,
        mut shards: BTreeMap<String, String>,
    ) -> (Self, tokio::task::JoinHandle<anyhow::Result<()>>) {
        let changes = Self::default();
        let (shard_key, drain_key) = (labels::shard_label(ring), labels::drain_label(ring));
        let recorded = changes.clone();
        let task = tokio::spawn(async move {
            let mut events = secrets
                .watch(&WatchParams::default().timeout(290), &from)
                .await?
                .boxed();
            while let Some(event) = events.try_next().await? {
                let (WatchEvent::Added(secret) | WatchEvent::Modified(secret)) = event else {
                    continue;
                };
                let name = secret.name_any();
                let now = secret.labels().get(&shard_key).cloned().unwrap_or_default();
                let before = shards.insert(name.clone(), now.clone());
                let mut found = Vec::new();
                if let Some(before) = before.filter(|b| !b.is_empty() && *b != now) {
                    found.push(format!("{name}: {before} -> {now:?}"));
                }
                if secret.labels().contains_key(&drain_key) {
                    found.push(format!("{name}: drained on {now}"));
                }
                recorded
                    .0
                    .lock()
                    .map_err(|_| anyhow::anyhow!("poisoned"))?
                    .extend(found);
            }
            anyhow::Ok(())
        });
        (changes, task)
    }

    fn seen(&self) -> Vec<String> {
        self.0.lock().map(|c| c.clone()).unwrap_or_default()
    }
}

/// The Secrets labelled for `shard`.
async fn secrets_of(secrets: &Api<Secret>, ring: &str, shard: &str) -> anyhow::Result<Vec<String>> {
    let selector = format!("{}={shard}", labels::shard_label(ring));
    let listed = secrets
        .list(&kube::api::ListParams::default().labels(&selector))
        .await?;
    Ok(listed.items.iter().map(ResourceExt::name_any).collect())
}

fn holder(lease: &Lease) -> &str {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or_default()
}

fn transitions(lease: &Lease) -> i32 {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.lease_transitions)
        .unwrap_or_default()
}

fn events(process: &Process, event: &str) -> Vec<Value> {
    process
        .records()
        .into_iter()
        .filter(|r| r["event"] == event)
        .collect()
}

#[tokio::test]
async fn a_statefulset_shard_keeps_its_lease_over_a_restart_and_releases_on_scale_in()
-> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("stable").await?;
    let ring = unique_name("stable");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    create_statefulset(&client, &ns, 2).await?;
    let names = [format!("{STATEFULSET}-0"), format!("{STATEFULSET}-1")];
    let mut first = start_stable_shard(&ring, &ns, &names[0])?;
    let mut second = start_stable_shard(&ring, &ns, &names[1])?;
    wait_status(&client, &ring, 2, 2).await?;
    wait_webhook(&client, &ns, &ring, &[&names[0], &names[1]]).await?;

    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let all: Vec<String> = (0..SECRETS).map(|i| format!("s-{i}")).collect();
    futures::stream::iter(all.iter().map(|name| {
        let secrets = secrets.clone();
        async move { secrets.create(&PostParams::default(), &secret(name)).await }
    }))
    .buffer_unordered(16)
    .try_collect::<Vec<_>>()
    .await?;
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    wait_labelled::<Secret>(
        &client,
        &ns,
        &RingRef::new(RingKind::ClusterRing, &ring),
        &refs,
    )
    .await?;
    let on_second = secrets_of(&secrets, &ring, &names[1]).await?;
    ensure!(
        !on_second.is_empty() && on_second.len() < SECRETS,
        "{} of {SECRETS} Secrets on {}",
        on_second.len(),
        names[1]
    );
    // Every Secret of the second shard reconciled once, so the restart has a before and after.
    let reconciled = |process: &Process, since: usize| {
        let records = process.records();
        let names: std::collections::BTreeSet<String> = records[since.min(records.len())..]
            .iter()
            .filter(|r| r["event"] == "reconcile" && r["namespace"] == ns.as_str())
            .filter_map(|r| r["name"].as_str().map(str::to_string))
            .collect();
        names
    };
    poll_until("the second shard reconciled its Secrets", WAIT, || {
        let done = on_second.iter().all(|n| reconciled(&second, 0).contains(n));
        async move { Ok(done.then_some(())) }
    })
    .await?;

    // From here on, every label change of a Secret.
    let listed = secrets.list(&Default::default()).await?;
    let from = listed
        .metadata
        .resource_version
        .clone()
        .context("list version")?;
    let key = labels::shard_label(&ring);
    let before: BTreeMap<String, String> = listed
        .items
        .iter()
        .map(|s| {
            (
                s.name_any(),
                s.labels().get(&key).cloned().unwrap_or_default(),
            )
        })
        .collect();
    let (changes, watcher) = LabelChanges::watch(secrets.clone(), &ring, from, before);

    // A rollout of the second shard's pod: SIGTERM, the same name back within the Lease duration.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let held_before = leases.get(&names[1]).await?;
    second.terminate()?;
    let stopped_at = Instant::now();
    let status = second.wait(WAIT).await?;
    ensure!(status.success(), "{} exited with {status}", names[1]);
    let stop_took = stopped_at.elapsed();
    ensure!(
        !events(&second, "lease_kept").is_empty(),
        "no lease_kept record:\n{}",
        second.logs()
    );
    ensure!(
        events(&second, "lease_released").is_empty(),
        "the stopping shard released its Lease"
    );
    let kept = leases.get(&names[1]).await?;
    ensure!(holder(&kept) == names[1], "holder now {:?}", holder(&kept));
    second.passed();
    // As a StatefulSet would: the old process is gone before the new one starts.
    let restarted_at = Instant::now();
    let mut back = start_stable_shard(&ring, &ns, &names[1])?;
    poll_until(
        "the returning shard reconciled every Secret of its name",
        WAIT,
        || {
            let done = on_second.iter().all(|n| reconciled(&back, 0).contains(n));
            async move { Ok(done.then_some(())) }
        },
    )
    .await?;
    let all_back = restarted_at.elapsed();
    let acquired = events(&back, "lease_acquired");
    let acquired = acquired.first().context("no lease_acquired record")?;
    ensure!(
        acquired["transitions"].as_i64() == Some(i64::from(transitions(&held_before))),
        "the returning shard took the Lease as a new holding ({acquired}), not as a renewal"
    );
    let term = events(&back, "term_started");
    let waited = term
        .first()
        .and_then(|t| t["waited_ms"].as_f64())
        .context("no term_started record")?;
    ensure!(
        waited < 100.0,
        "the returning shard waited {waited} ms to start"
    );
    ensure!(
        stopped_at.elapsed() < LEASE_DURATION,
        "the restart took longer than the Lease duration: the test did not test a quick return"
    );

    // A few seconds for any move the sharder might make, then: nothing moved.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let seen = changes.seen();
    ensure!(
        seen.is_empty(),
        "the restart changed {} labels: {seen:?}",
        seen.len()
    );
    println!(
        "restart of {}: stopped in {stop_took:?}, its {} Secrets reconciled again {all_back:?} \
         after the new process started (waited {waited} ms for its term), 0 label changes",
        names[1],
        on_second.len()
    );

    // Scale-in to 1: ordinal 1 goes away for good, so its shard releases and its Secrets move.
    Api::<StatefulSet>::namespaced(client.clone(), &ns)
        .patch(
            STATEFULSET,
            &e2e::patch_params(),
            &Patch::Merge(json!({"spec": {"replicas": 1}})),
        )
        .await?;
    back.terminate()?;
    let status = back.wait(WAIT).await?;
    ensure!(status.success(), "{} exited with {status}", names[1]);
    ensure!(
        !events(&back, "lease_released").is_empty() && events(&back, "lease_kept").is_empty(),
        "scaled in without releasing:\n{}",
        back.logs()
    );
    let released = leases.get(&names[1]).await?;
    ensure!(
        holder(&released).is_empty(),
        "holder {:?}",
        holder(&released)
    );
    poll_until("no Secret left on the scaled-in shard", WAIT, || {
        let (secrets, ring, shard) = (secrets.clone(), ring.clone(), names[1].clone());
        async move {
            Ok(secrets_of(&secrets, &ring, &shard)
                .await?
                .is_empty()
                .then_some(()))
        }
    })
    .await?;
    // The watch sees moves, so the zero above was not for want of looking.
    let moved = changes.seen().len();
    ensure!(
        moved >= on_second.len(),
        "the watch saw {moved} label changes for the {} Secrets that moved on scale-in",
        on_second.len()
    );
    println!("scale-in: {} released, {moved} label changes", names[1]);

    watcher.abort();
    first.terminate()?;
    first.wait(WAIT).await?;
    first.passed();
    back.passed();
    logs.passed();
    Ok(())
}
