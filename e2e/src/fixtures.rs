//! Objects and waits the end-to-end tests and the load tool share: rings restricted to one
//! namespace, shard Leases the test plays itself, and conditions on the ring's status and webhook.

use std::collections::BTreeMap;
use std::time::Duration;

use ::sharder::core::ring::Ring;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, MicroTime};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use sharding_crds::labels;
use sharding_crds::{ClusterRing, ClusterRingSpec, GroupResource, RingResource};

use crate::process::poll_until;

/// How long the waits of this module give the sharder.
pub const WAIT: Duration = Duration::from_secs(30);

/// A ring over Secrets (controlling ConfigMaps) restricted to one namespace, so parallel tests do
/// not label each other's objects.
pub fn ring_spec(namespace: &str) -> ClusterRingSpec {
    ClusterRingSpec {
        resources: vec![RingResource {
            group: String::new(),
            resource: "secrets".into(),
            controlled_resources: vec![GroupResource::new("", "configmaps")],
        }],
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(
                crate::LABEL_NAMESPACE_NAME.to_string(),
                namespace.to_string(),
            )])),
            match_expressions: None,
        }),
        hash_key: None,
    }
}

/// Creates the ClusterRing `name`.
pub async fn create_ring(client: &Client, name: &str, spec: ClusterRingSpec) -> anyhow::Result<()> {
    Api::<ClusterRing>::all(client.clone())
        .create(&PostParams::default(), &ClusterRing::new(name, spec))
        .await?;
    Ok(())
}

/// The usual opening of a test: a fresh namespace starting with `prefix`, a ring of the same
/// prefix restricted to it ([`ring_spec`]), and an hour-long self-held Lease in it for each of
/// `shards`. Returns the namespace and the ring name.
pub async fn ring_with_shards(
    cluster: &crate::Cluster,
    client: &Client,
    prefix: &str,
    shards: &[&str],
) -> anyhow::Result<(String, String)> {
    let namespace = cluster.namespace(client, prefix).await?;
    let ring = crate::unique_name(prefix);
    create_ring(client, &ring, ring_spec(&namespace)).await?;
    for shard in shards {
        create_lease(client, &namespace, &ring, shard, 3600).await?;
    }
    Ok((namespace, ring))
}

/// Creates a shard Lease held by the shard itself, renewed now.
pub async fn create_lease(
    client: &Client,
    namespace: &str,
    ring: &str,
    shard: &str,
    duration_seconds: i32,
) -> anyhow::Result<Lease> {
    let now = MicroTime(Timestamp::now());
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(shard.into()),
            labels: Some(BTreeMap::from([(
                labels::LABEL_CLUSTER_RING.to_string(),
                ring.to_string(),
            )])),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(shard.into()),
            lease_duration_seconds: Some(duration_seconds),
            acquire_time: Some(now.clone()),
            renew_time: Some(now),
            lease_transitions: Some(0),
            ..Default::default()
        }),
    };
    Ok(Api::<Lease>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &lease)
        .await?)
}

/// An empty Secret named `name`.
pub fn secret(name: &str) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The shard a ring assigns Secret `name` in `namespace` to, predicted from the pure hash ring
/// ([`Ring`] over the shards' names) and the Secret's hash key `/Secret/<namespace>/<name>`,
/// spelled out here rather than taken from the sharder's key code, so a test checks it.
///
/// Takes the ring rather than the shard names: callers that predict many objects build it once.
pub fn expected_shard<'r>(ring: &'r Ring, namespace: &str, name: &str) -> Option<&'r str> {
    ring.shard_for(&format!("/Secret/{namespace}/{name}"))
}

/// An `admission.k8s.io/v1` AdmissionReview as the API server sends it to a ring's webhook for
/// creating Secret `name` in `namespace`: request `uid`, and the object's `labels` (the object has
/// no `labels` field when there are none, so the webhook's patch must create it).
pub fn secret_review(
    uid: &str,
    namespace: &str,
    name: &str,
    labels: &[(&str, &str)],
) -> serde_json::Value {
    let mut metadata = serde_json::json!({"name": name, "namespace": namespace});
    if !labels.is_empty() {
        metadata["labels"] = labels
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
            .collect();
    }
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Secret"},
            "resource": {"group": "", "version": "v1", "resource": "secrets"},
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "test"},
            "object": {"metadata": metadata},
        }
    })
}

/// Waits until the ring is Ready and its status reports `available`/`shards`.
pub async fn wait_status(
    client: &Client,
    ring: &str,
    available: i32,
    shards: i32,
) -> anyhow::Result<ClusterRing> {
    let api = Api::<ClusterRing>::all(client.clone());
    poll_until(
        &format!("ring {ring} status {available}/{shards}"),
        WAIT,
        || {
            let api = api.clone();
            async move {
                let r = api.get(ring).await?;
                let s = r.status.clone().unwrap_or_default();
                let ready = r.ready_condition().is_some_and(|c| c.status == "True");
                Ok((ready && s.available_shards == available && s.shards == shards).then_some(r))
            }
        },
    )
    .await
}

/// Waits until the webhook assigns a dry-run Secret as the ring of `shards` predicts, i.e. the
/// webhook configuration is in place and the sharder's view of the ring is current.
pub async fn wait_webhook(
    client: &Client,
    namespace: &str,
    ring: &str,
    shards: &[&str],
) -> anyhow::Result<()> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let key = labels::shard_label(ring);
    let expected = expected_shard(&Ring::new(shards), namespace, "probe").map(str::to_string);
    poll_until(
        &format!("webhook of ring {ring} to assign like {shards:?}"),
        WAIT,
        || {
            let (api, key, expected) = (api.clone(), key.clone(), expected.clone());
            async move {
                let params = PostParams {
                    dry_run: true,
                    ..Default::default()
                };
                let created = api.create(&params, &secret("probe")).await?;
                Ok((created.labels().get(&key).cloned() == expected).then_some(()))
            }
        },
    )
    .await
}

/// Lease timing of a test shard: duration, renew deadline, retry period (seconds, as flags).
#[derive(Clone, Copy, Debug)]
pub struct ShardTiming(pub &'static str, pub &'static str, pub &'static str);

impl ShardTiming {
    /// Short timing, so loss and takeover play out within seconds.
    pub const FAST: Self = Self("3", "2", "0.5");
    /// Relaxed timing, so a busy machine never costs a shard its Lease.
    pub const RELAXED: Self = Self("15", "10", "1");
    /// The binary's defaults (15 s, 10 s, 2 s).
    pub const DEFAULT: Self = Self("15", "10", "2");
}

/// Starts a `checksum-controller` shard of `ring` that watches and leases in `namespace`, with
/// JSON logs (its records can be read with [`crate::process::Process::records`]).
pub fn start_checksum_shard(
    ring: &str,
    namespace: &str,
    shard: &str,
    timing: ShardTiming,
) -> anyhow::Result<crate::process::Process> {
    let ShardTiming(duration, deadline, retry) = timing;
    crate::process::Process::start(
        "checksum-controller",
        [
            "--clusterring",
            ring,
            "--namespace",
            namespace,
            "--lease-namespace",
            namespace,
            "--shard-name",
            shard,
            "--lease-duration",
            duration,
            "--renew-deadline",
            deadline,
            "--retry-period",
            retry,
            "--log-format",
            "json",
        ],
    )
}
