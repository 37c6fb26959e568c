//! The placement the objects must converge to, computed here from the wire protocol alone
//! (docs/protocol.md §2, §4, §6; the ring itself, docs/protocol.md §5, is the harness's
//! [`e2e::IndependentRing`]) and never through the sharder's or the shard library's code, so that a
//! bug shared by both sides of the protocol cannot hide itself.

use std::collections::BTreeSet;

use k8s_openapi::api::coordination::v1::Lease;
use sha2::{Digest, Sha256};

/// Longest ring name whose label suffix is never cut (63 bytes minus the fixed part).
const LONGEST_UNCUT_RING_NAME: usize = 42;

/// The shard and drain label keys of a ring (docs/protocol.md §2) and its pin annotation key
/// (§21), for ring names short enough that the suffix is never cut; the tool names its rings, so
/// longer names are refused rather than cut.
#[derive(Clone, Debug)]
pub(crate) struct LabelKeys {
    /// `shard.alpha.sharding.timebertt.dev/<suffix>`.
    pub(crate) shard: String,
    /// `drain.alpha.sharding.timebertt.dev/<suffix>`.
    pub(crate) drain: String,
    /// `pin.alpha.sharding.timebertt.dev/<suffix>`, the annotation that pins an object or a
    /// namespace to a shard of the ring.
    pub(crate) pin: String,
}

impl LabelKeys {
    pub(crate) fn for_ring(ring: &str) -> anyhow::Result<Self> {
        anyhow::ensure!(
            ring.len() <= LONGEST_UNCUT_RING_NAME,
            "ring name {ring:?} is longer than {LONGEST_UNCUT_RING_NAME} characters"
        );
        let digest = hex::encode(Sha256::digest(ring.as_bytes()));
        let suffix = format!("clusterring-{}-{ring}", &digest[..8]);
        Ok(Self {
            shard: format!("shard.alpha.sharding.timebertt.dev/{suffix}"),
            drain: format!("drain.alpha.sharding.timebertt.dev/{suffix}"),
            pin: format!("pin.alpha.sharding.timebertt.dev/{suffix}"),
        })
    }
}

/// Hash key of a Secret (docs/protocol.md §6: core group, kind, namespace, name); the ConfigMaps a
/// Secret controls share it.
pub(crate) fn secret_key(namespace: &str, name: &str) -> String {
    format!("/Secret/{namespace}/{name}")
}

/// The shards whose Leases make them available (docs/protocol.md §4): a shard is ready, expired or
/// uncertain, all of them available, exactly as long as its Lease's holder is the Lease's own
/// name; once released or taken over (holder empty or another name) it is dead or orphaned.
pub(crate) fn available_shards(leases: &[Lease]) -> BTreeSet<String> {
    leases
        .iter()
        .filter_map(|lease| {
            let name = lease.metadata.name.as_deref()?;
            let holder = lease.spec.as_ref()?.holder_identity.as_deref()?;
            (holder == name).then(|| name.to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use kube::api::ObjectMeta;

    /// docs/protocol.md §2's and §21's worked examples.
    #[test]
    fn label_keys_match_the_protocol_examples() {
        let keys = LabelKeys::for_ring("example").expect("short name");
        assert_eq!(
            keys.shard,
            "shard.alpha.sharding.timebertt.dev/clusterring-50d858e0-example"
        );
        assert_eq!(
            keys.drain,
            "drain.alpha.sharding.timebertt.dev/clusterring-50d858e0-example"
        );
        assert_eq!(
            keys.pin,
            "pin.alpha.sharding.timebertt.dev/clusterring-50d858e0-example"
        );
        let keys = LabelKeys::for_ring("checksum-controller").expect("short name");
        assert!(
            keys.shard
                .ends_with("/clusterring-f4d63fd2-checksum-controller")
        );
        assert!(LabelKeys::for_ring(&"x".repeat(43)).is_err());
    }

    fn lease(name: &str, holder: Option<&str>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_string),
                ..Default::default()
            }),
        }
    }

    /// A shard holding its own Lease is available however old its renewal (expired and
    /// uncertain shards still count); a released, taken-over or holderless Lease is not.
    #[test]
    fn availability_follows_the_holder() {
        let leases = [
            lease("held", Some("held")),
            lease("taken", Some("shardlease-controller")),
            lease("released", Some("")),
            lease("unheld", None),
        ];
        let available: Vec<String> = available_shards(&leases).into_iter().collect();
        assert_eq!(available, ["held"]);
    }
}
