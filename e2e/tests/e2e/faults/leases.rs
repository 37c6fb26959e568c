//! Misbehaving shards and Leases: invalid and duplicate names, squatters, skewed clocks, malformed
//! Leases, held Leases taken away by third parties.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::{
    WAIT, create_lease, create_ring, lease_warnings, ring_spec, secret, wait_status, wait_webhook,
};
use e2e::process::poll_until;
use e2e::scenario::{DedicatedScenario, SharedScenario};
use e2e::sharder_process::{SharderFiles, SharderSettings};
use e2e::unique_name;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube_sharder::records::EVENT_SYNC_FINISHED;
use kube_sharding_api::{RingKind, labels};
use serde_json::json;

use super::STARTUP;

/// A shard whose name cannot be a label value never enters the ring, and of two Leases of one
/// ring with the same name only the older one does: users' writes keep succeeding and the sharder
/// says why.
#[tokio::test]
async fn invalid_and_duplicate_shard_names_stay_out_of_the_ring() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("names").await?;
    let other_ns = cluster.namespace(&client, "names-dup").await?;
    let ring = unique_name("names");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    // Far beyond a label value, and long enough that the Warning Event needs a shortened name.
    let long = format!("shard-{}", "x".repeat(234));
    create_lease(&client, &ns, &ring, "shard-a", 3600).await?;
    create_lease(&client, &ns, &ring, &long, 3600).await?;
    wait_status(&client, &ring, 1, 2).await?;
    wait_webhook(&client, &ns, &ring, &["shard-a"]).await?;

    // Every write succeeds and lands on the one valid shard.
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let key = labels::shard_label(&ring);
    for i in 0..30 {
        let created = secrets
            .create(&PostParams::default(), &secret(&format!("s-{i}")))
            .await
            .with_context(|| format!("creating s-{i} failed"))?;
        ensure!(
            created.labels().get(&key).map(String::as_str) == Some("shard-a"),
            "s-{i} assigned to {:?}",
            created.labels().get(&key)
        );
    }
    let warnings = poll_until("a Warning Event on the long-named Lease", WAIT, || async {
        let w = lease_warnings(&client, &ns, &long).await?;
        Ok((!w.is_empty()).then_some(w))
    })
    .await?;
    ensure!(
        warnings.iter().any(|e| e
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("label value")),
        "the Event does not say why: {warnings:?}"
    );

    // The same shard name in two namespaces of one ring: the older Lease keeps the shard, the
    // later copy is kept out and says why.
    create_lease(&client, &ns, &ring, "shard-dup", 3600).await?;
    // Creation times have whole seconds: the copy is created in a later one.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    create_lease(&client, &other_ns, &ring, "shard-dup", 3600).await?;
    wait_status(&client, &ring, 2, 4).await?;
    poll_until("a Warning Event on the later copy", WAIT, || async {
        let w = lease_warnings(&client, &other_ns, "shard-dup").await?;
        Ok(w.iter()
            .any(|e| {
                e.message
                    .as_deref()
                    .unwrap_or_default()
                    .contains(&format!("the older one in {ns} keeps the shard"))
            })
            .then_some(()))
    })
    .await?;
    let older = lease_warnings(&client, &ns, "shard-dup").await?;
    ensure!(
        older.is_empty(),
        "the older copy was warned about: {older:?}"
    );
    logs.passed();
    Ok(())
}

/// docs/protocol.md §18: a Lease created later under a running shard's name, in another
/// namespace, takes nothing from it: the older Lease keeps the shard and its objects, the copy is
/// kept out. A running shard that is kept out all the same (here: its Lease labelled for both ring
/// kinds) may still reconcile, so its objects leave it only through drains.
#[tokio::test]
async fn a_squatter_takes_nothing_and_a_running_shard_kept_out_loses_objects_only_by_drain()
-> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("squat").await?;
    let squatter_ns = cluster.namespace(&client, "squatter").await?;
    let ring = unique_name("squat");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let shards = ["shard-a", "shard-b", "shard-c"];
    for shard in shards {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    wait_status(&client, &ring, 3, 3).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let key = labels::shard_label(&ring);
    let drain = labels::drain_label(&ring);
    let mut on_b = BTreeSet::new();
    for i in 0..30 {
        let name = format!("s-{i}");
        let created = secrets
            .create(&PostParams::default(), &secret(&name))
            .await?;
        if created.labels().get(&key).map(String::as_str) == Some("shard-b") {
            on_b.insert(name);
        }
    }
    ensure!(!on_b.is_empty(), "no object landed on shard-b");
    let on_b_untouched = || async {
        let mut drained = 0;
        for name in &on_b {
            let secret = secrets.get(name).await?;
            let labels = secret.labels();
            ensure!(
                labels.get(&key).map(String::as_str) == Some("shard-b"),
                "{name} left shard-b without a drain while its shard may still run: {labels:?}"
            );
            drained += usize::from(labels.contains_key(&drain));
        }
        anyhow::Ok(drained)
    };

    // Creation times have whole seconds: the squatter's copy is created in a later one.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    create_lease(&client, &squatter_ns, &ring, "shard-b", 3600).await?;
    wait_status(&client, &ring, 3, 4).await?;
    poll_until("a Warning Event on the squatter's Lease", WAIT, || async {
        let w = lease_warnings(&client, &squatter_ns, "shard-b").await?;
        Ok((!w.is_empty()).then_some(()))
    })
    .await?;
    // Longer than a sync triggered by the membership change takes here.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let drained = on_b_untouched().await?;
    ensure!(
        drained == 0,
        "{drained} objects of shard-b were drained because of the squatter"
    );

    // shard-b's own Lease labelled for both ring kinds: kept out while it still holds it.
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let both = json!({"metadata": {"labels": {RingKind::ControllerRing.lease_label(): ring}}});
    leases
        .patch("shard-b", &PatchParams::default(), &Patch::Merge(&both))
        .await?;
    poll_until(
        "every object of shard-b to be asked to drain",
        WAIT,
        || async { Ok((on_b_untouched().await? == on_b.len()).then_some(())) },
    )
    .await?;
    logs.passed();
    Ok(())
}

/// Creates 30 Secrets in `ns`; returns their names by the shard the webhook gave them.
async fn secrets_by_shard(
    client: &kube::Client,
    ns: &str,
    ring: &str,
) -> anyhow::Result<std::collections::BTreeMap<String, BTreeSet<String>>> {
    let secrets = Api::<Secret>::namespaced(client.clone(), ns);
    let key = labels::shard_label(ring);
    let mut by_shard = std::collections::BTreeMap::<String, BTreeSet<String>>::new();
    for i in 0..30 {
        let name = format!("s-{i}");
        let created = secrets
            .create(&PostParams::default(), &secret(&name))
            .await?;
        let shard = created.labels().get(&key).cloned().unwrap_or_default();
        by_shard.entry(shard).or_default().insert(name);
    }
    Ok(by_shard)
}

/// docs/protocol.md §4, §19.13: a shard whose clock runs 40 s behind writes renewTimes that look
/// 40 s old; it still renews, so it keeps its Lease and its objects, and its skew is reported.
#[tokio::test]
async fn a_shard_whose_clock_is_behind_keeps_its_objects() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("skew").await?;
    let ring = unique_name("skew");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    for shard in ["shard-a", "shard-b"] {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    create_lease(&client, &ns, &ring, "shard-late", 10).await?;
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    // The shard renews every 2 s with its clock 40 s behind the sharder's.
    let renewing = {
        let leases = leases.clone();
        tokio::spawn(async move {
            loop {
                let behind = Timestamp::now() - Duration::from_secs(40);
                let patch = json!({"spec": {"renewTime": MicroTime(behind)}});
                let _ = leases
                    .patch("shard-late", &PatchParams::default(), &Patch::Merge(&patch))
                    .await;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        })
    };
    let result = async {
        wait_status(&client, &ring, 3, 3).await?;
        wait_webhook(&client, &ns, &ring, &["shard-a", "shard-b", "shard-late"]).await?;
        let by_shard = secrets_by_shard(&client, &ns, &ring).await?;
        let late = by_shard.get("shard-late").cloned().unwrap_or_default();
        ensure!(
            !late.is_empty(),
            "no object landed on shard-late: {by_shard:?}"
        );
        // One and a half lease durations: the earlier code took the Lease over at its first renewal.
        tokio::time::sleep(Duration::from_secs(15)).await;
        let lease = leases.get("shard-late").await?;
        let holder = lease.spec.and_then(|s| s.holder_identity);
        ensure!(
            holder.as_deref() == Some("shard-late"),
            "the Lease of the renewing shard was taken over: holder {holder:?}"
        );
        let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
        let (key, drain) = (labels::shard_label(&ring), labels::drain_label(&ring));
        for name in &late {
            let labels = secrets.get(name).await?.labels().clone();
            ensure!(
                labels.get(&key).map(String::as_str) == Some("shard-late")
                    && !labels.contains_key(&drain),
                "{name} was moved or drained off the renewing shard: {labels:?}"
            );
        }
        let metrics = sharder.metrics()?;
        let skew: f64 = metrics
            .lines()
            .find(|l| {
                l.starts_with("controller_sharding_shard_clock_skew_seconds{")
                    && l.contains("shard=\"shard-late\"")
                    && l.contains(&format!("clusterring=\"{ring}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .context("no clock skew series for shard-late")?
            .parse()?;
        ensure!(
            (-45.0..=-39.0).contains(&skew),
            "skew of shard-late reported as {skew}, expected about -40"
        );
        poll_until(
            "a ShardClockSkew Warning Event on the Lease",
            WAIT,
            || async {
                let warnings = lease_warnings(&client, &ns, "shard-late").await?;
                Ok(warnings
                    .iter()
                    .any(|e| e.reason.as_deref() == Some("ShardClockSkew"))
                    .then_some(()))
            },
        )
        .await
    }
    .await;
    renewing.abort();
    result?;
    logs.passed();
    Ok(())
}

/// docs/protocol.md §4, §19.13: held Leases whose timing fields are missing or claim a renewal a
/// year ahead are taken over two lease durations after the sharder last saw them change, and their
/// objects move to the shards that renew.
#[tokio::test]
async fn malformed_leases_are_taken_over_once_they_stop_changing() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("malformed").await?;
    let ring = unique_name("malformed");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    for shard in ["shard-a", "shard-b"] {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let year_ahead = MicroTime(Timestamp::now() + Duration::from_secs(365 * 24 * 3600));
    let malformed = [
        // No acquireTime, no renewTime.
        ("shard-untimed", None),
        // A renewal a year ahead of every clock.
        ("shard-future", Some(year_ahead)),
    ];
    for (name, renewed) in malformed.clone() {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(
                    [(
                        RingKind::ClusterRing.lease_label().to_string(),
                        ring.clone(),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(name.into()),
                lease_duration_seconds: Some(5),
                acquire_time: renewed.clone(),
                renew_time: renewed,
                ..Default::default()
            }),
        };
        leases.create(&PostParams::default(), &lease).await?;
    }
    let shards = ["shard-a", "shard-b", "shard-untimed", "shard-future"];
    wait_status(&client, &ring, 4, 4).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    let by_shard = secrets_by_shard(&client, &ns, &ring).await?;
    for (name, _) in &malformed {
        ensure!(
            by_shard.get(*name).is_some_and(|s| !s.is_empty()),
            "no object landed on {name} before it could be taken over: {by_shard:?}"
        );
    }
    let started = std::time::Instant::now();
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let key = labels::shard_label(&ring);
    poll_until(
        "both malformed Leases taken over and every object on shard-a or shard-b",
        Duration::from_secs(40),
        || async {
            for (name, _) in &malformed {
                let holder = leases.get(name).await?.spec.and_then(|s| s.holder_identity);
                if holder.as_deref() == Some(*name) {
                    return Ok(None);
                }
            }
            let list = secrets.list(&ListParams::default()).await?;
            Ok(list
                .items
                .iter()
                .all(|s| {
                    matches!(
                        s.labels().get(&key).map(String::as_str),
                        Some("shard-a" | "shard-b")
                    )
                })
                .then_some(()))
        },
    )
    .await?;
    eprintln!(
        "malformed Leases taken over and their objects moved {:?} after the objects were created",
        started.elapsed()
    );
    logs.passed();
    Ok(())
}

/// How a test takes a running shard's Lease away in [`held_leases_taken_away`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TakenAway {
    /// The Lease is deleted.
    Deleted,
    /// The Lease's ring label is removed.
    Unlabelled,
    /// `holderIdentity` is emptied, as a release would, but without the shard's release mark.
    HolderEmptied,
    /// `holderIdentity` names someone else.
    HolderChanged,
    /// `leaseDurationSeconds` shrinks to 1 s while the shard holds the Lease.
    DurationShortened,
}

/// docs/protocol.md §18: a running shard's Lease deleted, or stripped of its ring label, by
/// someone allowed to: the shard may still be reconciling until its Lease would have become
/// `uncertain`, so its objects are only drained until then, and move directly after.
#[tokio::test]
async fn objects_of_a_deleted_or_relabelled_held_lease_are_drained_until_it_would_expire()
-> anyhow::Result<()> {
    held_leases_taken_away(
        "departed",
        &[
            ("shard-b", TakenAway::Deleted),
            ("shard-c", TakenAway::Unlabelled),
        ],
    )
    .await
}

/// docs/protocol.md §3, §4, §19.15: whoever may update a running shard's Lease and empties or
/// changes its holder, without the release mark the shard itself writes, or shortens its duration,
/// moves none of its objects directly before the shard could have stopped: emptied or changed,
/// they are drained; shortened, the longer duration of the holding still counts. (Before, every
/// object of the shard moved directly within a second, while the shard reconciled on.)
#[tokio::test]
async fn a_third_party_changing_a_held_leases_holder_or_duration_moves_nothing_directly()
-> anyhow::Result<()> {
    held_leases_taken_away(
        "holder",
        &[
            ("shard-b", TakenAway::HolderEmptied),
            ("shard-c", TakenAway::HolderChanged),
            ("shard-d", TakenAway::DurationShortened),
        ],
    )
    .await
}

/// docs/protocol.md §18: a departure outlives the sharder that saw it. A running shard's holder
/// is emptied by someone else; the sharder drains its objects, and keeps the departure in the
/// ring's status. A new sharder process that starts meanwhile (the old one stopped) drains them
/// just the same until the shard could have stopped, and only then moves them. (Before, the new
/// process saw a Lease without holder and moved every object at once.)
#[tokio::test]
async fn a_sharder_started_during_a_departure_still_drains_until_it_is_over() -> anyhow::Result<()>
{
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("restart").await?;
    let cluster = dedicated.cluster();
    let ring = unique_name("restart");
    let files = SharderFiles::create(cluster.kubeconfig(), &SharderSettings::default())?;
    let mut first = files.start_process()?;
    files.wait_ready(STARTUP).await?;
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    create_lease(&client, &ns, &ring, "shard-a", 3600).await?;
    // Duration 20 s: shard-b may run until 40 s after this.
    create_lease(&client, &ns, &ring, "shard-b", 20).await?;
    let renewed = std::time::Instant::now();
    wait_status(&client, &ring, 2, 2).await?;
    wait_webhook(&client, &ns, &ring, &["shard-a", "shard-b"]).await?;
    let by_shard = secrets_by_shard(&client, &ns, &ring).await?;
    let leaving = by_shard.get("shard-b").cloned().unwrap_or_default();
    ensure!(!leaving.is_empty(), "no object on shard-b: {by_shard:?}");
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let emptied = json!({"spec": {"holderIdentity": ""}});
    leases
        .patch("shard-b", &PatchParams::default(), &Patch::Merge(&emptied))
        .await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let (key, drain) = (labels::shard_label(&ring), labels::drain_label(&ring));
    let on_shard_b =
        |labels: &BTreeMap<String, String>| labels.get(&key).map(String::as_str) == Some("shard-b");
    poll_until("shard-b's objects drained", WAIT, || async {
        let mut drained = 0;
        for name in &leaving {
            let labels = secrets.get(name).await?.labels().clone();
            ensure!(on_shard_b(&labels), "{name} moved at once: {labels:?}");
            drained += usize::from(labels.contains_key(&drain));
        }
        Ok((drained == leaving.len()).then_some(()))
    })
    .await?;
    let rings = Api::<kube_sharding_api::ClusterRing>::all(client.clone());
    poll_until("the departure in the ring's status", WAIT, || async {
        let ring = rings.get(&ring).await?;
        let departed = ring.status.map(|s| s.departed_shards).unwrap_or_default();
        Ok(departed.iter().any(|d| d.name == "shard-b").then_some(()))
    })
    .await?;
    first.terminate()?;
    first.wait(Duration::from_secs(20)).await?;
    let mut second = files.start_process()?;
    files.wait_ready(STARTUP).await?;
    second
        .wait_for_record("the new sharder to lead", STARTUP, |r| {
            r["event"] == EVENT_SYNC_FINISHED
        })
        .await?;
    let led_after = renewed.elapsed();
    // It synced the ring and left shard-b's objects where they were, until the departure ends.
    while renewed.elapsed() < Duration::from_secs(36) {
        for name in &leaving {
            let labels = secrets.get(name).await?.labels().clone();
            ensure!(
                on_shard_b(&labels),
                "{name} moved {:?} after shard-b's last renewal, while it may still run: {labels:?}",
                renewed.elapsed()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    poll_until(
        "shard-b's objects on shard-a once its Lease would have expired",
        Duration::from_secs(30),
        || async {
            let mut moved = 0;
            for name in &leaving {
                let labels = secrets.get(name).await?.labels().clone();
                moved += usize::from(labels.get(&key).map(String::as_str) == Some("shard-a"));
            }
            Ok((moved == leaving.len()).then_some(()))
        },
    )
    .await?;
    eprintln!(
        "{} objects of shard-b drained, a new sharder leading {led_after:?} after its last renewal kept them there, moved after {:?}",
        leaving.len(),
        renewed.elapsed()
    );
    first.passed();
    second.passed();
    Ok(())
}

/// Shard-a (held for an hour) and the shards of `taken` (lease duration 10 s, never renewed)
/// share a ring of 30 Secrets; each Lease of `taken` is then taken away as it says. Checks that
/// no object of theirs moves before its shard's Lease would have become `uncertain` (20 s after
/// the last renewal), that those whose Lease left the ring are drained meanwhile, and that all
/// are on shard-a afterwards.
async fn held_leases_taken_away(prefix: &str, taken: &[(&str, TakenAway)]) -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace(prefix).await?;
    let ring = unique_name(prefix);
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    create_lease(&client, &ns, &ring, "shard-a", 3600).await?;
    // Lease duration 10 s: these may run until 20 s after their last renewal.
    for (shard, _) in taken {
        create_lease(&client, &ns, &ring, shard, 10).await?;
    }
    let renewed = std::time::Instant::now();
    let all: Vec<&str> = std::iter::once("shard-a")
        .chain(taken.iter().map(|(shard, _)| *shard))
        .collect();
    let count = i32::try_from(all.len())?;
    wait_status(&client, &ring, count, count).await?;
    wait_webhook(&client, &ns, &ring, &all).await?;
    let by_shard = secrets_by_shard(&client, &ns, &ring).await?;
    let leaving_of = |shard: &str| by_shard.get(shard).cloned().unwrap_or_default();
    for (shard, _) in taken {
        ensure!(
            !leaving_of(shard).is_empty(),
            "no object landed on {shard}: {by_shard:?}"
        );
    }
    let leaving: BTreeSet<String> = taken.iter().flat_map(|(s, _)| leaving_of(s)).collect();
    // Those whose shard no longer counts as available are drained at once.
    let drained_first: BTreeSet<String> = taken
        .iter()
        .filter(|(_, how)| *how != TakenAway::DurationShortened)
        .flat_map(|(s, _)| leaving_of(s))
        .collect();
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    for (shard, how) in taken {
        let patch = match how {
            TakenAway::Deleted => {
                leases
                    .delete(shard, &kube::api::DeleteParams::default())
                    .await?;
                continue;
            }
            TakenAway::Unlabelled => {
                json!({"metadata": {"labels": {RingKind::ClusterRing.lease_label(): null}}})
            }
            TakenAway::HolderEmptied => json!({"spec": {"holderIdentity": ""}}),
            TakenAway::HolderChanged => json!({"spec": {"holderIdentity": "intruder"}}),
            TakenAway::DurationShortened => json!({"spec": {"leaseDurationSeconds": 1}}),
        };
        leases
            .patch(shard, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }

    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let (key, drain) = (labels::shard_label(&ring), labels::drain_label(&ring));
    let still_on_its_shard = |name: &str, labels: &BTreeMap<String, String>| {
        ensure!(
            labels.get(&key).is_some_and(|s| s != "shard-a"),
            "{name} moved while its shard may still run ({:?} after the last renewal): {labels:?}",
            renewed.elapsed()
        );
        Ok(())
    };
    poll_until(
        "every object of a Lease that left the ring drained, none moved",
        WAIT,
        || async {
            let mut drained = 0;
            for name in &leaving {
                let labels = secrets.get(name).await?.labels().clone();
                still_on_its_shard(name, &labels)?;
                drained += usize::from(drained_first.contains(name) && labels.contains_key(&drain));
            }
            Ok((drained == drained_first.len()).then_some(()))
        },
    )
    .await?;
    // Well past the moment the shortened duration would have let the sharder take over.
    while renewed.elapsed() < Duration::from_secs(8) {
        for name in &leaving {
            still_on_its_shard(name, secrets.get(name).await?.labels())?;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    poll_until(
        "every object of the taken-away Leases on shard-a once they would have expired",
        Duration::from_secs(40),
        || async {
            let mut moved = 0;
            for name in &leaving {
                let labels = secrets.get(name).await?.labels().clone();
                if labels.get(&key).map(String::as_str) == Some("shard-a") {
                    ensure!(
                        renewed.elapsed() >= Duration::from_secs(19),
                        "{name} moved {:?} after the last renewal, before its shard's Lease would have expired",
                        renewed.elapsed()
                    );
                    ensure!(!labels.contains_key(&drain), "{name} kept its drain label");
                    moved += 1;
                }
            }
            Ok((moved == leaving.len()).then_some(()))
        },
    )
    .await?;
    eprintln!(
        "{} objects of {taken:?} drained at once ({} of them) and moved {:?} after their shards' last renewal",
        leaving.len(),
        drained_first.len(),
        renewed.elapsed()
    );
    logs.passed();
    Ok(())
}
