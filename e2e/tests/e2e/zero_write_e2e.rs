//! Zero-write rings end to end (docs/zero-write-rings.md): the real sharder publishes ranges on
//! the Leases of real `checksum-controller --server-side` shards, which follow them. Nobody plays
//! a part: the test only starts and stops shards, and reads the Leases, the shards' log records
//! and the Secrets.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::{ShardTiming, create_ring, start_checksum_shard_with};
use e2e::process::{Process, poll_until};
use e2e::scenario::SharedScenario;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::labels::shard_label;
use kube_sharding_api::range_lease::PublishedRanges;
use kube_sharding_api::ranges::{RangeRing, fnv1a64};
use kube_sharding_api::{RingKind, RingRef};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::zero_write::{is_partition, overlaps, record, server_side_spec, wait_settled};

const SECRETS: usize = 600;
const FIRST: [&str; 3] = ["shard-0", "shard-1", "shard-2"];
const NEWCOMER: &str = "shard-3";
const LEAVING: &str = "shard-1";
/// Secrets named `slow-…`, whose reconciles wait [`SLOW_RECONCILE`] before they write, so that
/// some are in flight when their range is revoked.
const SLOW: usize = 40;
/// Longer than a revoke takes to reach a shard after a newcomer starts (about 1 s).
const SLOW_RECONCILE: &str = "4";
/// Long enough for 600 first reconciles on a busy debug build.
const RECONCILED: Duration = Duration::from_secs(60);

/// A shard's log record about one Secret: a reconcile's start or outcome, or its release.
#[derive(Clone, Debug)]
struct Mark {
    at: Timestamp,
    shard: String,
    name: String,
    event: String,
}

/// The events that show a shard working on (or giving up) a Secret.
const MARKED: [&str; 6] = [
    "reconcile",
    "applied",
    "up_to_date",
    "awaiting_move",
    "write_refused",
    "released",
];

fn marks(shard: &str, process: &Process, ns: &str) -> anyhow::Result<Vec<Mark>> {
    process
        .records()
        .into_iter()
        .filter(|r| r["namespace"] == ns && MARKED.iter().any(|e| r["event"] == *e))
        .map(|r| mark(shard, &r))
        .collect()
}

fn mark(shard: &str, record: &Value) -> anyhow::Result<Mark> {
    Ok(Mark {
        at: record["timestamp"]
            .as_str()
            .context("a record without timestamp")?
            .parse()?,
        shard: shard.to_string(),
        name: record["name"]
            .as_str()
            .context("a record without name")?
            .into(),
        event: record["event"].as_str().unwrap_or_default().into(),
    })
}

/// Every pair of shards that held the same Secret at overlapping times. A shard holds a Secret
/// from its first record about it to its last reconcile record before it released it (or to its
/// last one, if it never released it: it stopped, or still holds it); a record after a release
/// starts a new holding. The `released` record itself only ends a holding: the example logs it
/// from its departures stream, which may run a moment after the library acknowledged.
fn double_holdings(marks: &[Mark]) -> Vec<String> {
    let mut holdings: BTreeMap<&str, Vec<(&str, Timestamp, Timestamp)>> = BTreeMap::new();
    let mut by_shard: BTreeMap<(&str, &str), Vec<&Mark>> = BTreeMap::new();
    for mark in marks {
        by_shard
            .entry((mark.name.as_str(), mark.shard.as_str()))
            .or_default()
            .push(mark);
    }
    for ((name, shard), mut marks) in by_shard {
        marks.sort_by_key(|m| m.at);
        let mut open: Option<(Timestamp, Timestamp)> = None;
        for mark in marks {
            if mark.event == "released" {
                holdings
                    .entry(name)
                    .or_default()
                    .extend(open.take().map(|(s, e)| (shard, s, e)));
                continue;
            }
            let (start, _) = open.get_or_insert((mark.at, mark.at));
            open = Some((*start, mark.at));
        }
        holdings
            .entry(name)
            .or_default()
            .extend(open.map(|(s, e)| (shard, s, e)));
    }
    let mut found = Vec::new();
    for (name, held) in holdings {
        for (i, (a, a_start, a_end)) in held.iter().enumerate() {
            for (b, b_start, b_end) in &held[i + 1..] {
                if a != b && a_start <= b_end && b_start <= a_end {
                    found.push(format!(
                        "{name}: {a} from {a_start} to {a_end}, {b} from {b_start} to {b_end}"
                    ));
                }
            }
        }
    }
    found
}

/// The Secrets each shard logged a reconcile of, from `since` on.
fn reconciled(
    shards: &BTreeMap<&str, Process>,
    ns: &str,
    since: Timestamp,
) -> anyhow::Result<BTreeMap<String, BTreeMap<String, Timestamp>>> {
    let mut out = BTreeMap::new();
    for (shard, process) in shards {
        let mut first = BTreeMap::new();
        for mark in marks(shard, process, ns)? {
            if mark.event == "reconcile" && mark.at >= since {
                first.entry(mark.name).or_insert(mark.at);
            }
        }
        out.insert((*shard).to_string(), first);
    }
    Ok(out)
}

/// The owner of each Secret under `published`, by the hash of its uid.
fn owners(
    hashes: &BTreeMap<String, u64>,
    published: &BTreeMap<String, PublishedRanges>,
) -> anyhow::Result<BTreeMap<String, String>> {
    hashes
        .iter()
        .map(|(name, hash)| {
            let owner = published
                .iter()
                .find(|(_, p)| p.ranges().contains(*hash))
                .map(|(shard, _)| shard.clone())
                .with_context(|| format!("no shard's ranges hold {name}"))?;
            Ok((name.clone(), owner))
        })
        .collect()
}

/// Waits until every Secret of `expected` (name → shard) was reconciled by that shard from
/// `since` on; returns when the last of them was first reconciled.
async fn wait_reconciled_by(
    shards: &BTreeMap<&str, Process>,
    ns: &str,
    expected: &BTreeMap<String, String>,
    since: Timestamp,
) -> anyhow::Result<Timestamp> {
    poll_until(
        &format!("{} Secrets reconciled by their shards", expected.len()),
        RECONCILED,
        || async {
            let seen = reconciled(shards, ns, since)?;
            let mut last = since;
            for (name, shard) in expected {
                match seen.get(shard).and_then(|s| s.get(name)) {
                    Some(at) => last = last.max(*at),
                    None => return Ok(None),
                }
            }
            Ok(Some(last))
        },
    )
    .await
}

fn ms(d: SignedDuration) -> i128 {
    d.as_millis()
}

async fn resource_versions(
    secrets: &Api<Secret>,
) -> anyhow::Result<BTreeMap<String, Option<String>>> {
    Ok(secrets
        .list(&ListParams::default())
        .await?
        .into_iter()
        .map(|s| (s.name_any(), s.resource_version()))
        .collect())
}

/// Waits until every Secret's ConfigMap carries the shard label of its owner in `owners`.
async fn wait_config_maps(
    client: &Client,
    ns: &str,
    ring: &str,
    owners: &BTreeMap<String, String>,
) -> anyhow::Result<()> {
    let api = Api::<ConfigMap>::namespaced(client.clone(), ns);
    let key = shard_label(ring);
    poll_until(
        "every ConfigMap written by its Secret's owner",
        RECONCILED,
        || {
            let (api, key) = (api.clone(), key.clone());
            async move {
                let labelled: BTreeMap<String, String> = api
                    .list(&ListParams::default())
                    .await?
                    .into_iter()
                    .filter_map(|cm| {
                        let secret = cm.name_any().strip_prefix("checksums-")?.to_string();
                        Some((secret, cm.labels().get(&key)?.clone()))
                    })
                    .collect();
                Ok((labelled == *owners).then_some(()))
            }
        },
    )
    .await
}

#[tokio::test]
async fn real_shards_follow_the_sharders_ranges_without_a_write_to_their_objects()
-> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("zw-e2e").await?;
    let started = std::time::Instant::now();
    let ring = e2e::unique_name("zw-e2e");
    create_ring(&client, &ring, server_side_spec(&ns, "secrets")).await?;
    let ring_ref = RingRef::new(RingKind::ClusterRing, &ring);
    let stop = CancellationToken::new();
    let _stop_on_drop = stop.clone().drop_guard();
    let versions = record(&client, &ns, &ring, stop.clone());

    let start = |shard: &str| {
        start_checksum_shard_with(
            &ring_ref,
            &ns,
            shard,
            ShardTiming::RELAXED,
            &["--server-side", "--testing-reconcile-delay", SLOW_RECONCILE],
        )
    };
    let mut shards: BTreeMap<&str, Process> = BTreeMap::new();
    for shard in FIRST {
        shards.insert(shard, start(shard)?);
    }
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let made: Vec<Secret> = futures::stream::iter(0..SECRETS)
        .map(|i| {
            let secrets = secrets.clone();
            async move {
                let name = if i < SLOW {
                    format!("slow-{i}")
                } else {
                    format!("s-{i}")
                };
                let secret = e2e::fixtures::secret(&name);
                secrets.create(&PostParams::default(), &secret).await
            }
        })
        .buffer_unordered(16)
        .try_collect()
        .await?;
    let hashes: BTreeMap<String, u64> = made
        .iter()
        .map(|s| {
            Ok((
                s.name_any(),
                fnv1a64(&s.uid().context("a Secret without uid")?),
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let created: BTreeMap<String, Option<String>> = made
        .iter()
        .map(|s| (s.name_any(), s.resource_version()))
        .collect();

    // Three shards: each Secret reconciled by the shard whose published ranges hold its hash.
    let three = wait_settled(&client, &ns, &FIRST.map(|s| (s, 1))).await?;
    ensure!(is_partition(three.values().map(PublishedRanges::ranges)));
    let before = owners(&hashes, &three)?;
    let epoch = Timestamp::UNIX_EPOCH;
    wait_reconciled_by(&shards, &ns, &before, epoch).await?;
    wait_config_maps(&client, &ns, &ring, &before).await?;
    let placed = std::time::Instant::now();

    // A fourth shard: the moved Secrets are released by their old shards and reconciled by it.
    // Slow Secrets about to move get their ConfigMap deleted first: their old shards start a
    // slow reconcile, which the revoke must cancel before the old shard acknowledges.
    let four_shards = [FIRST[0], FIRST[1], FIRST[2], NEWCOMER].map(|s| (s, 1));
    let newcomer_target = RangeRing::weighted(four_shards).ranges_of(NEWCOMER);
    let slow_moving: BTreeMap<String, String> = before
        .iter()
        .filter(|(name, _)| name.starts_with("slow-") && newcomer_target.contains(hashes[*name]))
        .map(|(name, owner)| (name.clone(), owner.clone()))
        .collect();
    ensure!(
        !slow_moving.is_empty(),
        "no slow Secret moves to {NEWCOMER}"
    );
    let deleted = Timestamp::now();
    let config_maps = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    for name in slow_moving.keys() {
        config_maps
            .delete(&format!("checksums-{name}"), &Default::default())
            .await?;
    }
    wait_reconciled_by(&shards, &ns, &slow_moving, deleted).await?;
    let joined = Timestamp::now();
    shards.insert(NEWCOMER, start(NEWCOMER)?);
    let four = wait_settled(&client, &ns, &four_shards).await?;
    ensure!(is_partition(four.values().map(PublishedRanges::ranges)));
    let after = owners(&hashes, &four)?;
    let moved: BTreeMap<String, String> = after
        .iter()
        .filter(|(name, owner)| before[*name] != **owner)
        .map(|(name, owner)| (name.clone(), owner.clone()))
        .collect();
    ensure!(!moved.is_empty(), "a fourth shard took no Secret");
    ensure!(
        moved.values().all(|owner| owner == NEWCOMER),
        "Secrets moved between the old shards"
    );
    let last = wait_reconciled_by(&shards, &ns, &moved, joined).await?;
    let scale_out = last.duration_since(joined);
    let by_newcomer: BTreeSet<String> = reconciled(&shards, &ns, epoch)?[NEWCOMER]
        .keys()
        .cloned()
        .collect();
    ensure!(
        by_newcomer == moved.keys().cloned().collect(),
        "{NEWCOMER} reconciled {} Secrets, {} moved to it",
        by_newcomer.len(),
        moved.len()
    );
    poll_until("the old shards' releases", RECONCILED, || async {
        let mut released = BTreeSet::new();
        for shard in FIRST {
            for r in shards[shard].records() {
                if r["event"] == "released"
                    && r["how"] == "range_revoked"
                    && r["namespace"] == ns.as_str()
                    && let Some(name) = r["name"].as_str()
                {
                    ensure!(
                        moved.contains_key(name),
                        "{shard} released {name}, which did not move"
                    );
                    released.insert(name.to_string());
                }
            }
        }
        Ok((released.len() == moved.len()).then_some(()))
    })
    .await?;
    wait_config_maps(&client, &ns, &ring, &after).await?;
    let cancelled: usize = FIRST
        .iter()
        .map(|shard| {
            shards[shard]
                .records()
                .iter()
                .filter(|r| {
                    r["event"] == "reconcile_revoked"
                        && r["object"]
                            .as_str()
                            .and_then(|o| o.strip_prefix(&format!("{ns}/")))
                            .is_some_and(|name| slow_moving.contains_key(name))
                })
                .count()
        })
        .sum();
    // Without one in flight, the overlap check below would have nothing to catch.
    ensure!(
        cancelled > 0,
        "none of {} slow reconciles of moving Secrets was in flight at the revoke",
        slow_moving.len()
    );

    // shard-1 stops gracefully: the others take its ranges without its acknowledgement.
    let leaving_since = Timestamp::now();
    let mut leaving = shards.remove(LEAVING).context("the leaving shard")?;
    leaving.terminate()?;
    let status = leaving.wait(Duration::from_secs(20)).await?;
    ensure!(status.success(), "{LEAVING} exits 0 on SIGTERM: {status}");
    let stayed = [FIRST[0], FIRST[2], NEWCOMER].map(|s| (s, 1));
    let three_again = wait_settled(&client, &ns, &stayed).await?;
    ensure!(is_partition(
        three_again.values().map(PublishedRanges::ranges)
    ));
    let last_owners = owners(&hashes, &three_again)?;
    let orphaned: BTreeMap<String, String> = last_owners
        .iter()
        .filter(|(name, _)| after[*name] == LEAVING)
        .map(|(name, owner)| (name.clone(), owner.clone()))
        .collect();
    ensure!(!orphaned.is_empty(), "{LEAVING} held no Secret");
    ensure!(
        last_owners
            .iter()
            .all(|(name, owner)| orphaned.contains_key(name) || after[name] == *owner),
        "Secrets of the staying shards moved when {LEAVING} stopped"
    );
    let last = wait_reconciled_by(&shards, &ns, &orphaned, leaving_since).await?;
    let scale_in = last.duration_since(leaving_since);
    wait_config_maps(&client, &ns, &ring, &last_owners).await?;
    shards.insert(LEAVING, leaving);

    // No hash held by two shards on the Leases, and no Secret by two shards in their logs.
    stop.cancel();
    let seen = versions.lock().expect("not poisoned").clone();
    let violations = overlaps(&seen);
    ensure!(
        violations.is_empty(),
        "{} Lease versions where two shards held the same hash, first: {:?}",
        violations.len(),
        violations.first()
    );
    let mut all = Vec::new();
    let mut counts = BTreeMap::new();
    for (shard, process) in &shards {
        let marks = marks(shard, process, &ns)?;
        let reconciles = marks.iter().filter(|m| m.event == "reconcile").count();
        ensure!(reconciles > 0, "{shard} logged no reconcile");
        counts.insert(*shard, reconciles);
        all.extend(marks);
    }
    let doubles = double_holdings(&all);
    ensure!(
        doubles.is_empty(),
        "{} Secrets held by two shards at once, first: {:?}",
        doubles.len(),
        doubles.first()
    );

    // Not one write to a Secret, by the sharder or a shard.
    let now = resource_versions(&secrets).await?;
    let written = created
        .iter()
        .filter(|(name, rv)| now.get(*name) != Some(*rv))
        .count();
    ensure!(
        now.len() == SECRETS && written == 0,
        "{written} of {SECRETS} Secrets written ({} left)",
        now.len()
    );
    println!(
        "zero-write end to end: {SECRETS} Secrets placed in {:?}; 3 -> 4: {} moved ({cancelled} slow reconciles cancelled by the revoke), the last reconciled by {NEWCOMER} {} ms after it started; \
         {LEAVING} stopped: {} moved, the last reconciled by its new owner {} ms after SIGTERM; reconciles per shard {counts:?}; \
         {} Lease versions and {} log records checked; 0 Secret writes; {:?} in all",
        placed.duration_since(started),
        moved.len(),
        ms(scale_out),
        orphaned.len(),
        ms(scale_in),
        seen.len(),
        all.len(),
        started.elapsed(),
    );
    for (_, mut process) in shards {
        let _ = process.terminate();
        process.passed();
    }
    logs.passed();
    Ok(())
}

/// The check above must see a double holding when there is one.
#[test]
fn a_reconcile_inside_another_shards_holding_is_a_double_holding() {
    let at = |s: i64| Timestamp::from_second(1_000 + s).expect("a valid time");
    let mark = |s, shard: &str, event: &str| Mark {
        at: at(s),
        shard: shard.into(),
        name: "s-1".into(),
        event: event.into(),
    };
    // a reconciles, releases; b reconciles after: a handover.
    let handover = [
        mark(0, "a", "reconcile"),
        mark(1, "a", "applied"),
        mark(2, "a", "released"),
        mark(3, "b", "reconcile"),
        mark(4, "b", "applied"),
    ];
    assert!(double_holdings(&handover).is_empty());
    // b reconciles while a's reconcile still runs.
    let early = [
        mark(0, "a", "reconcile"),
        mark(2, "a", "applied"),
        mark(3, "a", "released"),
        mark(1, "b", "reconcile"),
    ];
    assert_eq!(double_holdings(&early).len(), 1);
    // It comes back to a after b released it: two holdings of a, neither overlapping b's.
    let back = [
        mark(0, "a", "reconcile"),
        mark(1, "a", "released"),
        mark(2, "b", "reconcile"),
        mark(3, "b", "released"),
        mark(4, "a", "reconcile"),
    ];
    assert!(double_holdings(&back).is_empty());
    // a never released it (it stopped) and b reconciled it before a's last reconcile ended.
    let stopped = [
        mark(0, "a", "reconcile"),
        mark(1, "b", "reconcile"),
        mark(2, "a", "applied"),
    ];
    assert_eq!(double_holdings(&stopped).len(), 1);
}
