//! What the tool reads besides the logs: the sharder's CPU time and memory from `/proc`, the API
//! server's request and watch counters, and lists with each shard's selector.

use std::collections::BTreeMap;

use anyhow::Context;
use e2e::process::status_fields;
use e2e::prometheus::{label, samples};
use kube::Client;

use crate::report::{Traffic, Writes};

/// Clock ticks per second of `/proc/<pid>/stat`, from `getconf CLK_TCK` (100 when that fails,
/// Linux's value on every common architecture).
pub(crate) fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// The CPU seconds (user + system) process `pid` used so far.
pub(crate) fn cpu_seconds(pid: u32, ticks: f64) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    Ok(cpu_of_stat(&stat).context("unexpected /proc/<pid>/stat")? / ticks)
}

/// `utime + stime` in ticks from a `/proc/<pid>/stat` line: fields 14 and 15, counted after the
/// command name, which may contain spaces and ends at the last `)`.
fn cpu_of_stat(stat: &str) -> Option<f64> {
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// `VmHWM` and `VmRSS` of process `pid`, KiB.
pub(crate) fn memory_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
    let [hwm, rss] = status_fields(pid, ["VmHWM", "VmRSS"])?;
    Ok((hwm, rss))
}

/// The API server's counter of served requests.
const REQUESTS: &str = "apiserver_request_total";

/// Mutating verbs as the API server counts them (`APPLY` is a server-side apply PATCH).
const MUTATING: [&str; 6] = [
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

/// Mutating requests by `VERB resource[/subresource]` between two `/metrics` texts.
pub(crate) fn writes(before: &str, after: &str) -> Writes {
    let totals = |text: &str| {
        let mut totals: BTreeMap<(String, String), f64> = BTreeMap::new();
        for (labels, value) in samples(text, REQUESTS) {
            let verb = label(&labels, "verb");
            if !MUTATING.contains(&verb) {
                continue;
            }
            let (resource, sub) = (label(&labels, "resource"), label(&labels, "subresource"));
            let resource = if sub.is_empty() {
                resource.to_string()
            } else {
                format!("{resource}/{sub}")
            };
            *totals.entry((verb.to_string(), resource)).or_default() += value;
        }
        totals
    };
    let before = totals(before);
    let mut by_kind: Vec<(String, f64)> = totals(after)
        .into_iter()
        .map(|(key, value)| {
            let delta = value - before.get(&key).copied().unwrap_or_default();
            (key, delta)
        })
        .filter(|(_, delta)| *delta > 0.0)
        .map(|((verb, resource), delta)| (format!("{verb} {resource}"), delta))
        .collect();
    by_kind.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let of = |resource: &str| {
        by_kind
            .iter()
            .filter(|(kind, _)| kind.split(' ').nth(1) == Some(resource))
            .map(|(_, n)| n)
            // An empty sum is -0.0, which would print as "-0".
            .sum::<f64>()
            + 0.0
    };
    let (secrets, configmaps, leases) = (of("secrets"), of("configmaps"), of("leases"));
    let all: f64 = by_kind.iter().map(|(_, n)| n).sum();
    Writes {
        secrets,
        configmaps,
        leases,
        other: all - secrets - configmaps - leases,
        by_kind,
    }
}

/// Sum of the mutating requests on Secrets and ConfigMaps in a `/metrics` text: the work a
/// rebalance causes (Leases renew all the time).
pub(crate) fn object_writes(text: &str) -> f64 {
    samples(text, REQUESTS)
        .iter()
        .filter(|(labels, _)| {
            MUTATING.contains(&label(labels, "verb"))
                && ["secrets", "configmaps"].contains(&label(labels, "resource"))
        })
        .map(|(_, value)| value)
        .sum()
}

/// The increase of every sample of `metric` about Secrets (labelled `resource="secrets"`, or
/// `kind="Secret"` as older watch metrics are) that `keep` accepts.
fn secrets_delta(before: &str, after: &str, metric: &str, keep: impl Fn(&str) -> bool) -> f64 {
    let total = |text: &str| {
        samples(text, metric)
            .iter()
            .filter(|(labels, _)| {
                (label(labels, "resource") == "secrets" || label(labels, "kind") == "Secret")
                    && keep(labels)
            })
            .map(|(_, value)| value)
            .sum::<f64>()
    };
    total(after) - total(before)
}

/// What the API server sent about Secrets between two `/metrics` texts: watch events and their
/// bytes over all watchers, the events its sharded watch filtered away, and list requests and
/// their response bytes.
pub(crate) fn traffic(before: &str, after: &str) -> Traffic {
    let any = |_: &str| true;
    let lists = |labels: &str| label(labels, "verb") == "LIST";
    Traffic {
        watch_events: secrets_delta(before, after, "apiserver_watch_events_total", any),
        watch_event_bytes: secrets_delta(before, after, "apiserver_watch_events_sizes_sum", any),
        filtered_events: secrets_delta(before, after, "apiserver_watch_filtered_events_total", any),
        lists: secrets_delta(before, after, REQUESTS, lists),
        list_bytes: secrets_delta(before, after, "apiserver_response_sizes_sum", lists),
        watches: secrets_delta(before, after, REQUESTS, |labels| {
            label(labels, "verb") == "WATCH"
        }),
    }
}

/// Percent-encodes a query value (everything but RFC 3986's unreserved characters).
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A list of the Secrets in `namespace` with one query parameter (`labelSelector` or
/// `shardSelector`) as a shard's list sends it: items, bytes of the JSON answer, and whether the
/// server said it applied a shard selector (`metadata.shardInfo`).
pub(crate) async fn list_with(
    client: &Client,
    namespace: &str,
    parameter: &str,
    value: &str,
) -> anyhow::Result<(usize, usize, bool)> {
    let uri = format!(
        "/api/v1/namespaces/{namespace}/secrets?{parameter}={}",
        encode(value)
    );
    let request = http::Request::get(uri).body(Vec::new())?;
    let text = client.request_text(request).await?;
    let list: serde_json::Value = serde_json::from_str(&text)?;
    Ok((
        list["items"].as_array().map_or(0, Vec::len),
        text.len(),
        !list["metadata"]["shardInfo"].is_null(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_counts_user_and_system_ticks_after_the_name() {
        let stat = "4242 (a (weird) name) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 8 0 100";
        assert_eq!(cpu_of_stat(stat), Some(300.0));
        assert_eq!(cpu_of_stat("4242 (x) S 1"), None);
    }

    #[test]
    fn writes_split_by_resource_and_object_writes_ignore_leases() {
        let before = "\
apiserver_request_total{code=\"200\",resource=\"secrets\",subresource=\"\",verb=\"PATCH\"} 10
apiserver_request_total{code=\"200\",resource=\"leases\",subresource=\"\",verb=\"PUT\"} 5
";
        let after = "\
apiserver_request_total{code=\"200\",resource=\"secrets\",subresource=\"\",verb=\"PATCH\"} 12
apiserver_request_total{code=\"200\",resource=\"secrets\",subresource=\"\",verb=\"LIST\"} 50
apiserver_request_total{code=\"201\",resource=\"configmaps\",subresource=\"\",verb=\"APPLY\"} 7
apiserver_request_total{code=\"200\",resource=\"leases\",subresource=\"\",verb=\"PUT\"} 9
apiserver_request_total{code=\"200\",resource=\"clusterrings\",subresource=\"status\",verb=\"PATCH\"} 1
";
        let w = writes(before, after);
        assert_eq!(
            (w.secrets, w.configmaps, w.leases, w.other),
            (2.0, 7.0, 4.0, 1.0)
        );
        assert_eq!(w.by_kind[0], ("APPLY configmaps".to_string(), 7.0));
        assert!(
            w.by_kind
                .contains(&("PATCH clusterrings/status".to_string(), 1.0))
        );
        assert_eq!(object_writes(after), 19.0);
        assert_eq!(writes(before, before).secrets.to_string(), "0");
    }

    #[test]
    fn traffic_counts_secrets_only() {
        let before = "\
apiserver_watch_events_total{group=\"\",resource=\"secrets\",version=\"v1\"} 100
apiserver_watch_events_total{group=\"\",resource=\"configmaps\",version=\"v1\"} 100
apiserver_response_sizes_sum{component=\"apiserver\",resource=\"secrets\",verb=\"LIST\"} 1000
";
        let after = "\
apiserver_watch_events_total{group=\"\",resource=\"secrets\",version=\"v1\"} 130
apiserver_watch_events_total{group=\"\",resource=\"configmaps\",version=\"v1\"} 900
apiserver_response_sizes_sum{component=\"apiserver\",resource=\"secrets\",verb=\"LIST\"} 5000
apiserver_response_sizes_sum{component=\"apiserver\",resource=\"secrets\",verb=\"GET\"} 5000
";
        let t = traffic(before, after);
        assert_eq!((t.watch_events, t.list_bytes), (30.0, 4000.0));
    }

    #[test]
    fn selectors_are_percent_encoded() {
        assert_eq!(
            encode("shardRange(object.metadata.uid, '0x0', '0x1') || a=b"),
            "shardRange%28object.metadata.uid%2C%20%270x0%27%2C%20%270x1%27%29%20%7C%7C%20a%3Db"
        );
    }
}
