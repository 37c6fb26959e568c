//! Rings, Leases and objects the CLI's unit tests share.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, MicroTime, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::ObjectMeta;
use kube_sharding_api::labels::ANNOTATION_WEIGHT;
use kube_sharding_api::range_lease::{ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES};
use kube_sharding_api::{
    Assignment, ClusterRing, ClusterRingSpec, GroupResource, HashKey, RingKind, RingResource,
};

use super::cluster::{LoadedRing, Namespaces, SelectorSource};
use crate::core::any_ring::AnyRing;
use crate::core::membership::available_shards;
use crate::views::{ResourceInfo, RingView, build_view};

/// The tests' "now".
pub(crate) fn now() -> Timestamp {
    "2025-01-10T12:00:00Z".parse().expect("timestamp")
}

/// A Lease of ClusterRing `r` named `name`, held by `holder`, renewed `renewed_ago` seconds
/// before [`now`], optionally with a weight annotation.
pub(crate) fn lease(name: &str, holder: &str, renewed_ago: i64, weight: Option<&str>) -> Lease {
    let renewed = MicroTime(now() - k8s_openapi::jiff::SignedDuration::from_secs(renewed_ago));
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("shards".into()),
            labels: Some(
                [(
                    RingKind::ClusterRing.lease_label().to_string(),
                    "r".to_string(),
                )]
                .into(),
            ),
            annotations: weight.map(|w| [(ANNOTATION_WEIGHT.to_string(), w.to_string())].into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            acquire_time: Some(renewed.clone()),
            renew_time: Some(renewed),
            ..LeaseSpec::default()
        }),
    }
}

/// Ring `r` over Secrets controlling ConfigMaps, with these Leases.
pub(crate) fn loaded(leases: Vec<Lease>) -> LoadedRing {
    let ring = crate::test_rings::secrets_ring("r");
    let infos = HashMap::from([
        (GroupResource::new("", "secrets"), info("Secret")),
        (GroupResource::new("", "configmaps"), info("ConfigMap")),
    ]);
    let shards = available_shards(RingKind::ClusterRing, "r", &[], &leases);
    let view = build_view(&ring, &shards, &infos, &LabelSelector::default());
    LoadedRing {
        ring: AnyRing::Cluster(Arc::new(ring)),
        leases,
        view,
        selector_source: SelectorSource::Ring,
        invalid: None,
        ranges: None,
    }
}

/// A namespaced resource of kind `kind` at `v1`.
fn info(kind: &str) -> ResourceInfo {
    ResourceInfo {
        kind: kind.into(),
        version: "v1".into(),
        namespaced: true,
    }
}

/// The first `n` names `s-<i>` of Secrets in namespace `ns` the ring of `view` wants on
/// `shard`, so expectations do not depend on particular hashes.
pub(crate) fn names_on(view: &RingView, shard: &str, n: usize) -> Vec<String> {
    (0..10_000)
        .map(|i| format!("s-{i}"))
        .filter(|name| view.hash_ring.shard_for(&format!("/Secret/ns/{name}")) == Some(shard))
        .take(n)
        .collect()
}

/// Metadata of an object `name` in namespace `ns` with `labels`, controlled by Secret `owner`.
pub(crate) fn object(name: &str, labels: &[(&str, &str)], owner: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some("ns".into()),
        labels: Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
        owner_references: owner.map(|owner| {
            vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Secret".into(),
                name: owner.into(),
                uid: "uid".into(),
                controller: Some(true),
                block_owner_deletion: None,
            }]
        }),
        ..ObjectMeta::default()
    }
}

/// `meta` carrying `value` as its pin of the ring of `view`.
pub(crate) fn pinned(mut meta: ObjectMeta, view: &RingView, value: &str) -> ObjectMeta {
    meta.annotations
        .get_or_insert_with(Default::default)
        .insert(view.pin_annotation.clone(), value.into());
    meta
}

/// Gives `view` the pins of a namespace `ns` pinned to `value` in its ring, as the commands
/// read namespaces.
pub(crate) fn pin_namespace(view: &mut RingView, value: &str) {
    let ns = ObjectMeta {
        name: Some("ns".into()),
        ..ObjectMeta::default()
    };
    view.pins = Namespaces::from_metadata([pinned(ns, view, value)]).pins;
}

/// The ranges annotation publishing `ranges` at `generation`.
pub(crate) fn published(generation: u64, ranges: &kube_sharding_api::ranges::RangeSet) -> String {
    kube_sharding_api::range_lease::PublishedRanges::new(generation, ranges.clone())
        .expect("within the limits")
        .to_string()
}

/// `lease` with the range annotations `ranges` and `acknowledged`.
pub(crate) fn with_ranges(mut lease: Lease, ranges: Option<&str>, ack: Option<&str>) -> Lease {
    let annotations = lease.metadata.annotations.get_or_insert_default();
    for (key, value) in [(ANNOTATION_RANGES, ranges), (ANNOTATION_ACKNOWLEDGED, ack)] {
        if let Some(value) = value {
            annotations.insert(key.to_string(), value.to_string());
        }
    }
    lease
}

/// Ring `r` over Secrets, `ServerSide`, hashing `hash_key`, with these Leases.
pub(crate) fn server_side(leases: Vec<Lease>, hash_key: HashKey) -> LoadedRing {
    let mut ring = loaded(leases);
    let spec = ClusterRingSpec {
        resources: vec![RingResource::new("", "secrets")],
        assignment: Some(Assignment::ServerSide),
        hash_key: Some(hash_key),
        ..ClusterRingSpec::default()
    };
    ring.ring = AnyRing::Cluster(Arc::new(ClusterRing::new("r", spec)));
    ring.view.assignment = Assignment::ServerSide;
    ring.view.hash_key = hash_key;
    ring.view
        .resources
        .retain(|gr, _| gr == &GroupResource::new("", "secrets"));
    ring.ranges = Some(super::ranges::RingRanges::new(
        &ring,
        &std::collections::BTreeMap::new(),
    ));
    ring
}
