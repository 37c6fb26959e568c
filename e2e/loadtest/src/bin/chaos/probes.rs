//! Invariant 4's measurements: the sharder replicas' resident memory, and the watches the API
//! server holds open per resource, from its own metrics.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use kube::Client;
use serde::Serialize;

/// Memory of one sharder replica's process.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Rss {
    pub(crate) replica: usize,
    pub(crate) pid: u32,
    /// `VmRSS` from `/proc/<pid>/status`.
    pub(crate) rss_kib: u64,
}

/// Open watches per resource (`apiserver_longrunning_requests{verb="WATCH"}`, summed over the
/// other labels), from the API server's `/metrics`.
pub(crate) async fn watches(client: &Client) -> anyhow::Result<BTreeMap<String, u64>> {
    let request = kube::core::Request::new("")
        .get("metrics", &Default::default())
        .context("failed to build the /metrics request")?;
    let text = client.request_text(request).await?;
    Ok(parse_watches(&text))
}

/// [`watches`] once they have stayed the same for `hold` (clients re-establish watches a while
/// after a restart or a fault), or the last reading after `limit`.
pub(crate) async fn stable_watches(
    client: &Client,
    hold: Duration,
    limit: Duration,
) -> anyhow::Result<BTreeMap<String, u64>> {
    let deadline = Instant::now() + limit;
    let mut last = watches(client).await?;
    let mut since = Instant::now();
    while since.elapsed() < hold && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = watches(client).await?;
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    Ok(last)
}

/// Per resource, how many more watches `with` has than `without`: the watches of the processes
/// that run in one reading and not in the other.
pub(crate) fn difference(
    with: &BTreeMap<String, u64>,
    without: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    with.iter()
        .map(|(resource, n)| {
            let base = without.get(resource).copied().unwrap_or(0);
            (resource.clone(), n.saturating_sub(base))
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

fn parse_watches(metrics: &str) -> BTreeMap<String, u64> {
    let mut watches = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("apiserver_longrunning_requests{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        if !labels.contains(r#"verb="WATCH""#) {
            continue;
        }
        let resource = labels
            .split(',')
            .find_map(|l| l.strip_prefix("resource=\""))
            .map(|r| r.trim_end_matches('"').to_string())
            .unwrap_or_default();
        let count = value.trim().parse::<f64>().unwrap_or_default() as u64;
        *watches.entry(resource).or_default() += count;
    }
    watches.retain(|_, n| *n > 0);
    watches
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_watches_per_resource() {
        let text = r#"# HELP apiserver_longrunning_requests x
apiserver_longrunning_requests{component="apiserver",group="",resource="secrets",scope="cluster",subresource="",verb="WATCH",version="v1"} 2
apiserver_longrunning_requests{component="apiserver",group="",resource="secrets",scope="namespace",subresource="",verb="WATCH",version="v1"} 3
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="namespace",subresource="log",verb="CONNECT",version="v1"} 4
apiserver_longrunning_requests{component="apiserver",group="coordination.k8s.io",resource="leases",scope="namespace",subresource="",verb="WATCH",version="v1"} 0
"#;
        let watches = parse_watches(text);
        assert_eq!(watches, BTreeMap::from([("secrets".to_string(), 5)]));
    }

    #[test]
    fn difference_keeps_what_only_one_side_has() {
        let with = BTreeMap::from([("secrets".to_string(), 5), ("leases".to_string(), 2)]);
        let without = BTreeMap::from([("secrets".to_string(), 1), ("leases".to_string(), 3)]);
        assert_eq!(
            difference(&with, &without),
            BTreeMap::from([("secrets".to_string(), 4)])
        );
    }
}
