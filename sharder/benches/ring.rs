//! Benchmarks of the consistent-hash ring: building it and looking keys up.
//!
//! The sharder rebuilds a ring whenever a shard's availability changes and looks up every object
//! of the ring during rebalancing, so both paths matter.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kube_sharder::core::hash_ring::HashRing;

const SHARD_COUNTS: [usize; 4] = [3, 10, 100, 1000];
const KEYS: usize = 1000;

fn shard_names(count: usize) -> Vec<String> {
    (0..count).map(|i| format!("shard-{i}")).collect()
}

fn build(c: &mut Criterion) {
    let mut group = c.benchmark_group("ring_build");
    for count in SHARD_COUNTS {
        let names = shard_names(count);
        group.bench_with_input(BenchmarkId::from_parameter(count), &names, |b, names| {
            b.iter(|| HashRing::new(black_box(names)));
        });
    }
    group.finish();
}

fn lookup(c: &mut Criterion) {
    let keys: Vec<String> = (0..KEYS)
        .map(|i| format!("apps/Deployment/ns-{}/deployment-{i}", i % 7))
        .collect();
    let mut group = c.benchmark_group("ring_lookup_1000_keys");
    group.throughput(Throughput::Elements(KEYS as u64));
    for count in SHARD_COUNTS {
        let ring = HashRing::new(shard_names(count));
        group.bench_with_input(BenchmarkId::from_parameter(count), &ring, |b, ring| {
            b.iter(|| {
                for key in &keys {
                    black_box(ring.shard_for(black_box(key)));
                }
            });
        });
    }
    group.finish();
}

criterion_group!(benches, build, lookup);
criterion_main!(benches);
