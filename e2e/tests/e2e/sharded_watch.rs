//! Server-side sharded list and watch (the ground for zero-write rings) on the real
//! API server: the `shardSelector` grammar and FNV-1a hash of `kube_sharding_api::ranges`
//! against kube-apiserver's, and the shard library's selector layer under a kube-rs watcher,
//! with the gate `ShardedListAndWatch` on and off.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::fixtures::secret;
use e2e::sharded_watch::{gate, start_with_gate_off};
use e2e::{Cluster, cluster};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use kube::{Client, Config, ResourceExt};
use kube_sharding::sharded_watch::{ServerFiltering, ShardedWatch};
use kube_sharding_api::ranges::{
    HashRange, RangeRing, RangeSet, ShardField, ShardSelector, fnv1a64,
};
use serde_json::Value;

/// Secrets per test: enough that each half of the space gets some (all 50 in one half has odds
/// of 2^-49).
const COUNT: usize = 50;

const LOWER_HALF: &str =
    "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')";
const UPPER_HALF: &str =
    "shardRange(object.metadata.uid, '0x8000000000000000', '0x10000000000000000')";

const WAIT: Duration = Duration::from_secs(30);

/// Names to uids of the Secrets.
type Created = BTreeMap<String, String>;

/// Whether the shared cluster's API server filters by `shardSelector`: it must where it knows
/// the gate (`control-plane.sh` turns it on, 1.36 on); where it does not, says the test is
/// skipped.
async fn gate_on(cluster: &Cluster, client: &Client, test: &str) -> anyhow::Result<bool> {
    match gate(client).await? {
        Some(true) => Ok(true),
        Some(false) => anyhow::bail!(
            "the API server (1.{}) knows ShardedListAndWatch but runs with it off",
            cluster.server_minor()?
        ),
        None => {
            println!(
                "skipped {test}: the API server (1.{}) has no ShardedListAndWatch gate",
                cluster.server_minor()?
            );
            Ok(false)
        }
    }
}

async fn create(client: &Client, ns: &str, prefix: &str, count: usize) -> anyhow::Result<Created> {
    let api = Api::<Secret>::namespaced(client.clone(), ns);
    let mut created = Created::new();
    for i in 0..count {
        let made = api
            .create(&PostParams::default(), &secret(&format!("{prefix}-{i}")))
            .await?;
        created.insert(made.name_any(), made.uid().context("a Secret without uid")?);
    }
    Ok(created)
}

/// Every byte but the unreserved characters percent-encoded, written out here rather than taken
/// from the shard library, whose encoding its unit tests pin to this test's.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A raw list of the Secrets of `ns` with `selector`: the echoed `metadata.shardInfo.selector`
/// (`None` without `shardInfo`), and the names and uids listed.
async fn list(
    client: &Client,
    ns: &str,
    selector: &str,
) -> anyhow::Result<(Option<String>, Created)> {
    list_path(
        client,
        &format!("/api/v1/namespaces/{ns}/secrets"),
        selector,
    )
    .await
}

/// [`list`] of the collection at `path`.
async fn list_path(
    client: &Client,
    path: &str,
    selector: &str,
) -> anyhow::Result<(Option<String>, Created)> {
    let uri = format!("{path}?shardSelector={}", encode(selector));
    let request = http::Request::get(uri).body(Vec::new())?;
    let list: Value = client.request(request).await?;
    let echo = list["metadata"].get("shardInfo").map(|info| {
        info["selector"]
            .as_str()
            .unwrap_or("<not a string>")
            .to_string()
    });
    let items = list["items"].as_array().context("a list without items")?;
    let listed = items
        .iter()
        .map(|item| {
            let meta = &item["metadata"];
            (
                meta["name"].as_str().unwrap_or_default().to_string(),
                meta["uid"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    Ok((echo, listed))
}

/// The Secrets of `created` whose uid hash is selected by `keep`.
fn subset(created: &Created, keep: impl Fn(u64) -> bool) -> Created {
    created
        .iter()
        .filter(|(_, uid)| keep(fnv1a64(uid)))
        .map(|(n, u)| (n.clone(), u.clone()))
        .collect()
}

/// kube-apiserver keeps exactly the Secrets whose FNV-1a(uid), as `fnv1a64` computes it, lies
/// in the selected ranges, and echoes the selector as `ShardSelector` writes it: two halves
/// (the top bound `0x10000000000000000`), a three-shard `RangeRing`'s selectors (several ranges
/// joined with ` || `; together they list every Secret once), and the namespace field, with
/// which cluster-scoped objects hash the empty namespace.
#[tokio::test]
async fn the_api_server_lists_only_the_selected_hash_ranges() -> anyhow::Result<()> {
    let cluster = cluster();
    let client = cluster.client().await?;
    if !gate_on(
        cluster,
        &client,
        "the_api_server_lists_only_the_selected_hash_ranges",
    )
    .await?
    {
        return Ok(());
    }
    let ns = cluster.namespace(&client, "shard-ranges").await?;
    let created = create(&client, &ns, "s", COUNT).await?;

    let lower = subset(&created, |h| h < 1 << 63);
    let upper = subset(&created, |h| h >= 1 << 63);
    ensure!(
        !lower.is_empty() && !upper.is_empty(),
        "all {COUNT} uids hash into one half"
    );
    for (selector, expected) in [(LOWER_HALF, &lower), (UPPER_HALF, &upper)] {
        let (echo, listed) = list(&client, &ns, selector).await?;
        ensure!(
            echo.as_deref() == Some(selector),
            "echo {echo:?} for {selector}"
        );
        ensure!(
            listed == *expected,
            "{selector}: listed {:?}, FNV-1a expects {:?}",
            listed.keys(),
            expected.keys()
        );
    }
    // Written by our own types, and read back from the echo.
    let parsed: ShardSelector = LOWER_HALF.parse()?;
    ensure!(parsed.to_string() == LOWER_HALF);

    let ring = RangeRing::new(["shard-a", "shard-b", "shard-c"]);
    let mut seen = Created::new();
    for (shard, ranges) in ring.ranges() {
        let selector = ShardSelector::new(ShardField::Uid, ranges.clone())
            .context("a shard without ranges")?;
        let text = selector.to_string();
        let (echo, listed) = list(&client, &ns, &text).await?;
        ensure!(
            echo.as_deref() == Some(text.as_str()),
            "echo {echo:?} for {text}"
        );
        ensure!(
            echo.as_deref()
                .map(str::parse::<ShardSelector>)
                .transpose()?
                == Some(selector),
            "the echo does not parse back"
        );
        let expected = subset(&created, |h| ranges.contains(h));
        ensure!(
            listed == expected,
            "{shard} ({} ranges)",
            ranges.ranges().len()
        );
        println!(
            "{shard}: {} ranges, selector {} bytes, {} of {COUNT} Secrets",
            ranges.ranges().len(),
            text.len(),
            listed.len()
        );
        for name in listed.keys() {
            ensure!(!seen.contains_key(name), "{name} listed by two shards");
        }
        seen.extend(listed);
    }
    ensure!(seen == created, "the three shards together miss Secrets");

    // By namespace: a one-hash range around the namespace's hash keeps all, the rest none.
    let hash = fnv1a64(&ns);
    let around = format!(
        "shardRange(object.metadata.namespace, '0x{hash:016x}', '0x{:016x}')",
        u128::from(hash) + 1
    );
    let (echo, listed) = list(&client, &ns, &around).await?;
    ensure!(echo.as_deref() == Some(around.as_str()) && listed == created);
    let elsewhere: String = if hash > 0 {
        format!("shardRange(object.metadata.namespace, '0x0000000000000000', '0x{hash:016x}')")
    } else {
        "shardRange(object.metadata.namespace, '0x0000000000000001', '0x10000000000000000')"
            .to_string()
    };
    let (echo, listed) = list(&client, &ns, &elsewhere).await?;
    ensure!(echo.is_some() && listed.is_empty(), "{listed:?}");

    // Cluster-scoped objects hash their empty namespace: every Namespace is in the one-hash
    // range of fnv1a64(""), none outside it.
    let empty = fnv1a64("");
    let selector = ShardSelector::new(
        ShardField::Namespace,
        RangeSet::new(HashRange::new(empty, u128::from(empty) + 1)),
    )
    .context("not empty")?;
    let (echo, listed) = list_path(&client, "/api/v1/namespaces", &selector.to_string()).await?;
    ensure!(echo.is_some() && listed.contains_key(&ns), "{listed:?}");
    let rest = RangeSet::from_arcs([(empty.wrapping_add(1), empty)]);
    let selector = ShardSelector::new(ShardField::Namespace, rest).context("not empty")?;
    let (echo, listed) = list_path(&client, "/api/v1/namespaces", &selector.to_string()).await?;
    ensure!(echo.is_some() && listed.is_empty(), "{listed:?}");
    Ok(())
}

/// A client with the shard library's selector layer for Secrets, from `cluster`'s kubeconfig.
async fn layered_client(cluster: &Cluster, handle: &ShardedWatch) -> anyhow::Result<Client> {
    let kubeconfig = Kubeconfig::read_from(cluster.kubeconfig())?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(handle.client(config)?)
}

/// The objects a kube-rs watcher over `api` delivers: the initial list, then each event until
/// `done` says enough was seen (or [`WAIT`] passed).
async fn watch_until(api: Api<Secret>, done: impl Fn(&Created) -> bool) -> anyhow::Result<Created> {
    let mut seen = Created::new();
    let mut synced = false;
    let stream = watcher(api, watcher::Config::default());
    let mut stream = std::pin::pin!(stream);
    tokio::time::timeout(WAIT, async {
        while let Some(event) = stream.try_next().await? {
            match event {
                watcher::Event::InitApply(s) | watcher::Event::Apply(s) => {
                    seen.insert(s.name_any(), s.uid().unwrap_or_default());
                }
                watcher::Event::InitDone => synced = true,
                watcher::Event::Init | watcher::Event::Delete(_) => {}
            }
            if synced && done(&seen) {
                return anyhow::Ok(());
            }
        }
        anyhow::bail!("the watch ended")
    })
    .await
    .with_context(|| format!("saw only {:?} within {WAIT:?}", seen.keys()))??;
    Ok(seen)
}

/// A kube-rs watcher through the selector layer sees exactly the Secrets of its range, in its
/// initial list and in later watch events, and the layer reports that the server applied the
/// selector (`metadata.shardInfo` in the list).
#[tokio::test]
async fn a_watcher_through_the_selector_layer_sees_only_its_range() -> anyhow::Result<()> {
    let cluster = cluster();
    let client = cluster.client().await?;
    if !gate_on(
        cluster,
        &client,
        "a_watcher_through_the_selector_layer_sees_only_its_range",
    )
    .await?
    {
        return Ok(());
    }
    let ns = cluster.namespace(&client, "shard-watch").await?;
    let before = create(&client, &ns, "before", COUNT / 2).await?;

    let handle = ShardedWatch::for_resource::<Secret>();
    handle.set_selector(Some(LOWER_HALF.parse()?));
    let api = Api::<Secret>::namespaced(layered_client(cluster, &handle).await?, &ns);
    let expected = subset(&before, |h| h < 1 << 63);
    let initial = watch_until(api.clone(), |seen| seen.len() >= expected.len()).await?;
    ensure!(
        initial == expected,
        "the initial list gave {:?}, expected {:?}",
        initial.keys(),
        expected.keys()
    );
    ensure!(
        handle.server_filtering() == ServerFiltering::Applied,
        "the layer says {:?}",
        handle.server_filtering()
    );

    // Later Secrets arrive as watch events, filtered by the server. Events come in
    // resourceVersion order: once the last selected one is in, every earlier one that the
    // server sent is too.
    let mut events = Box::pin(watcher(api, watcher::Config::default()));
    let mut synced = false;
    while !synced {
        let event = tokio::time::timeout(WAIT, events.try_next()).await??;
        synced = matches!(event, Some(watcher::Event::InitDone));
    }
    let after = create(&client, &ns, "after", COUNT / 2).await?;
    let wanted = subset(&after, |h| h < 1 << 63);
    // Creation order: the last created Secret in the range, and everything created up to it.
    let order: Vec<String> = (0..COUNT / 2).map(|i| format!("after-{i}")).collect();
    let last_index = order
        .iter()
        .rposition(|name| wanted.contains_key(name))
        .context("no later Secret in the lower half")?;
    let last = order[last_index].clone();
    let mut seen = Created::new();
    while !seen.contains_key(&last) {
        let event = tokio::time::timeout(WAIT, events.next())
            .await
            .with_context(|| format!("saw only {:?} of the later Secrets", seen.keys()))?
            .context("the watch ended")??;
        if let watcher::Event::Apply(s) = event {
            seen.insert(s.name_any(), s.uid().unwrap_or_default());
        }
    }
    let created_up_to_last: Created = order[..=last_index]
        .iter()
        .map(|name| (name.clone(), after[name].clone()))
        .collect();
    let expected = subset(&created_up_to_last, |h| h < 1 << 63);
    ensure!(
        seen == expected,
        "watch events gave {:?}, expected {:?}",
        seen.keys(),
        expected.keys()
    );
    println!(
        "initial list {} of {}, watch events {} of {} (server-filtered)",
        initial.len(),
        before.len(),
        seen.len(),
        created_up_to_last.len()
    );
    Ok(())
}

/// With the gate off, kube-apiserver ignores `shardSelector`: a list returns every Secret
/// without `shardInfo`, the layer says [`ServerFiltering::Ignored`] after a watcher's initial
/// list, and the client-side filter keeps exactly the Secrets whose FNV-1a(uid) lies in the
/// range, the set the server keeps when the gate is on (the test above).
#[tokio::test]
async fn with_the_gate_off_the_layer_says_so_and_the_client_side_filter_selects_the_same()
-> anyhow::Result<()> {
    let shared = cluster().client().await?;
    let dedicated = start_with_gate_off(&shared).await?;
    let cluster = dedicated.cluster();
    let client = cluster.client().await?;
    ensure!(
        gate(&client).await? != Some(true),
        "the dedicated API server has the gate on"
    );
    let ns = cluster.namespace(&client, "shard-gate-off").await?;
    let created = create(&client, &ns, "s", COUNT).await?;

    let (echo, listed) = list(&client, &ns, LOWER_HALF).await?;
    ensure!(echo.is_none(), "shardInfo {echo:?} with the gate off");
    ensure!(listed == created, "listed {} of {COUNT}", listed.len());

    let handle = ShardedWatch::for_resource::<Secret>();
    handle.set_selector(Some(LOWER_HALF.parse()?));
    // The layer in front of an existing client this time.
    let api = Api::<Secret>::namespaced(handle.wrap(client.clone()), &ns);
    let all = watch_until(api, |seen| seen.len() >= COUNT).await?;
    ensure!(all == created, "the watcher saw {} of {COUNT}", all.len());
    ensure!(
        handle.server_filtering() == ServerFiltering::Ignored,
        "the layer says {:?}",
        handle.server_filtering()
    );
    let api = Api::<Secret>::namespaced(client, &ns);
    let mut filtered = BTreeSet::new();
    for s in api.list(&Default::default()).await? {
        if handle.accepts(&s.metadata) {
            filtered.insert(s.name_any());
        }
    }
    let expected: BTreeSet<String> = subset(&created, |h| h < 1 << 63).into_keys().collect();
    ensure!(!expected.is_empty() && expected.len() < COUNT);
    ensure!(
        filtered == expected,
        "client-side {filtered:?}, expected {expected:?}"
    );
    println!(
        "gate off: {} listed, {} kept by the client-side filter",
        listed.len(),
        filtered.len()
    );
    Ok(())
}
