//! Where the state metrics come from on every replica: the caches, and what the leader observed
//! about the rings' objects.

use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube_sharding_api::lease::ShardLease;
use kube_sharding_api::load::ShardLoad;
use kube_sharding_api::{RingKind, RingRef};

use crate::caches::Caches;
use crate::core::membership::{Exclusion, ring_members};
use crate::leader::observed::Observed;
use crate::leader::reachability::Reachability;
use crate::metrics::{ObjectsSnapshot, RingSnapshot, ShardSnapshot, StateSource};

/// State metrics read from the caches at scrape time.
#[derive(Debug)]
pub(crate) struct CacheState {
    /// Rings and shard Leases.
    pub(crate) caches: Caches,
    /// What the leader observed about the rings' objects.
    pub(crate) observed: Arc<Observed>,
    /// Rings whose webhook the API server does not reach.
    pub(crate) reachability: Arc<Reachability>,
}

impl StateSource for CacheState {
    fn rings(&self) -> Vec<RingSnapshot> {
        self.caches
            .rings()
            .iter()
            .map(|r| {
                let status = r.status().cloned().unwrap_or_default();
                RingSnapshot {
                    ring: r.ring_ref(),
                    uid: r.meta().uid.clone().unwrap_or_default(),
                    generation: r.meta().generation.unwrap_or_default(),
                    observed_generation: status.observed_generation.unwrap_or_default(),
                    shards: status.shards.into(),
                    available_shards: status.available_shards.into(),
                    ready: i64::from(status.conditions.iter().any(|c| {
                        c.type_ == kube_sharding_api::cluster_ring::CONDITION_READY
                            && c.status == "True"
                    })),
                }
            })
            .collect()
    }

    fn shards(&self) -> Vec<ShardSnapshot> {
        let now = Timestamp::now();
        let mut snapshots = Vec::new();
        for kind in RingKind::ALL {
            let index = self.caches.lease_index(kind);
            for ring in index.rings() {
                let leases = index.ring_leases(&ring);
                let allowed = self
                    .caches
                    .ring(&RingRef::new(kind, ring.clone()))
                    .map(|r| r.spec().lease_namespaces.clone())
                    .unwrap_or_default();
                let members = ring_members(kind, &ring, &allowed, leases.iter().map(AsRef::as_ref));
                snapshots.extend(members.into_iter().map(|m| {
                    let load = ShardLoad::from_annotations(m.lease.annotations());
                    ShardSnapshot {
                        namespace: m.lease.namespace().unwrap_or_default(),
                        shard: m.lease.name_any(),
                        ring: RingRef::new(kind, ring.clone()),
                        uid: m.lease.uid().unwrap_or_default(),
                        state: ShardLease::from_lease(m.lease).state(now).as_str(),
                        excluded: m.exclusion.as_ref().map(Exclusion::reason),
                        weight: m.weight,
                        clock_skew_seconds: index
                            .renewals()
                            .skew(m.lease.uid().as_deref().unwrap_or_default())
                            .map(|skew| skew.as_secs_f64()),
                        load_invalid: matches!(load, Some(Err(_))),
                        load: load.and_then(Result::ok),
                    }
                }));
            }
        }
        snapshots
    }

    fn objects(&self) -> ObjectsSnapshot {
        ObjectsSnapshot {
            rings: self.observed.objects(),
            pending_drains: self.observed.pending_drains(std::time::Instant::now()),
            unreachable: self.reachability.unreachable(),
        }
    }
}
