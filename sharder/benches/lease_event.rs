//! Benchmark of what every shard Lease renewal costs each sharder replica before any of our
//! code runs: decoding the watch event. With 1,000 shards renewing every 2 s that happens 500
//! times a second per Lease watch, so it bounds how cheap renewals can be.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use k8s_openapi::api::coordination::v1::Lease;
use kube::core::WatchEvent;

/// A renewal as the API server sends it: the shard's Lease with its ring and state labels and
/// the managed fields of the two writers (the shard, and the sharder's state label).
fn event(with_managed_fields: bool) -> String {
    let managed = if with_managed_fields {
        r#","managedFields":[{"manager":"checksum-controller","operation":"Update","apiVersion":"coordination.k8s.io/v1","time":"2026-11-23T06:00:00Z","fieldsType":"FieldsV1","fieldsV1":{"f:metadata":{"f:labels":{".":{},"f:alpha.sharding.timebertt.dev/clusterring":{}}},"f:spec":{"f:acquireTime":{},"f:holderIdentity":{},"f:leaseDurationSeconds":{},"f:leaseTransitions":{},"f:renewTime":{}}}},{"manager":"sharder","operation":"Update","apiVersion":"coordination.k8s.io/v1","time":"2026-11-23T05:59:00Z","fieldsType":"FieldsV1","fieldsV1":{"f:metadata":{"f:labels":{"f:alpha.sharding.timebertt.dev/state":{}}}}}]"#
    } else {
        ""
    };
    format!(
        r#"{{"type":"MODIFIED","object":{{"kind":"Lease","apiVersion":"coordination.k8s.io/v1","metadata":{{"name":"shard-00042","namespace":"scale-1","uid":"0b6c2d5e-6f1a-4a8e-9d3c-2f1e0c9b8a7d","resourceVersion":"123456","creationTimestamp":"2026-11-23T05:58:00Z","labels":{{"alpha.sharding.timebertt.dev/clusterring":"example","alpha.sharding.timebertt.dev/state":"ready"}}{managed}}},"spec":{{"holderIdentity":"shard-00042","leaseDurationSeconds":10,"acquireTime":"2026-11-23T05:58:00.000000Z","renewTime":"2026-11-23T06:00:00.123456Z","leaseTransitions":0}}}}}}"#
    )
}

fn decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("lease_watch_event_decode");
    for (name, with) in [
        ("with_managed_fields", true),
        ("without_managed_fields", false),
    ] {
        let text = event(with);
        serde_json::from_str::<WatchEvent<Lease>>(&text).expect("a valid event");
        group.bench_function(name, |b| {
            b.iter(|| {
                serde_json::from_str::<WatchEvent<Lease>>(black_box(&text)).expect("a valid event")
            });
        });
    }
    group.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
