//! Objects and waits the end-to-end tests and the load tool share: rings restricted to one
//! namespace, shard Leases the test plays itself, and conditions on the ring's status and webhook.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Event, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, MicroTime};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::{
    ClusterRing, ClusterRingSpec, ControllerRing, GroupResource, RingKind, RingObject, RingRef,
    RingResource,
};

use crate::IndependentRing;
use crate::process::poll_until;

/// How long the waits of this module give the sharder.
pub const WAIT: Duration = Duration::from_secs(30);

/// A ring over Secrets (controlling ConfigMaps) restricted to one namespace, so parallel tests do
/// not label each other's objects.
pub fn ring_spec(namespace: &str) -> ClusterRingSpec {
    ClusterRingSpec {
        resources: vec![secrets_controlling_configmaps()],
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(
                crate::LABEL_NAMESPACE_NAME.to_string(),
                namespace.to_string(),
            )])),
            match_expressions: None,
        }),
        hash_key: None,
        lease_namespaces: Vec::new(),
        assignment: None,
    }
}

/// The ring resource most tests shard: Secrets, each controlling ConfigMaps (the
/// checksum-controller's `checksums-<name>`), which go to their Secret's shard.
pub fn secrets_controlling_configmaps() -> RingResource {
    RingResource::controlling("", "secrets", [GroupResource::new("", "configmaps")])
}

/// Creates the ClusterRing `name`.
pub async fn create_ring(client: &Client, name: &str, spec: ClusterRingSpec) -> anyhow::Result<()> {
    create_ring_of(client, &RingRef::new(RingKind::ClusterRing, name), spec).await
}

/// Creates `ring`, of either kind.
pub async fn create_ring_of(
    client: &Client,
    ring: &RingRef,
    spec: ClusterRingSpec,
) -> anyhow::Result<()> {
    crate::sharder_identity::grant_ring(client, ring, &spec).await?;
    let params = PostParams::default();
    match ring.kind {
        RingKind::ClusterRing => {
            Api::<ClusterRing>::all(client.clone())
                .create(&params, &ClusterRing::new(&ring.name, spec))
                .await?;
        }
        RingKind::ControllerRing => {
            Api::<ControllerRing>::all(client.clone())
                .create(&params, &ControllerRing::new(&ring.name, spec.into()))
                .await?;
        }
    }
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
    let (namespace, ring) =
        ring_of_kind_with_shards(cluster, client, RingKind::ClusterRing, prefix, shards).await?;
    Ok((namespace, ring.name))
}

/// [`ring_with_shards`] for a ring of either kind; returns the namespace and the ring.
pub async fn ring_of_kind_with_shards(
    cluster: &crate::Cluster,
    client: &Client,
    kind: RingKind,
    prefix: &str,
    shards: &[&str],
) -> anyhow::Result<(String, RingRef)> {
    let namespace = cluster.namespace(client, prefix).await?;
    let ring = RingRef::new(kind, crate::unique_name(prefix));
    create_ring_of(client, &ring, ring_spec(&namespace)).await?;
    for shard in shards {
        create_lease_of(client, &namespace, &ring, shard, 3600).await?;
    }
    Ok((namespace, ring))
}

/// Creates a ClusterRing named after `prefix` with `assignment: Watch` over `namespace`
/// ([`ring_spec`]) and an hour-long self-held Lease in it for each of `shards`, and waits until the
/// ring is Ready with all of them available. Returns the ring's name.
pub async fn watch_ring_with_shards(
    client: &Client,
    namespace: &str,
    prefix: &str,
    shards: &[&str],
) -> anyhow::Result<String> {
    let ring = crate::unique_name(prefix);
    let spec = ClusterRingSpec {
        assignment: Some(kube_sharding_api::Assignment::Watch),
        ..ring_spec(namespace)
    };
    create_ring(client, &ring, spec).await?;
    for shard in shards {
        create_lease(client, namespace, &ring, shard, 3600).await?;
    }
    let count = i32::try_from(shards.len())?;
    wait_status(client, &ring, count, count).await?;
    Ok(ring)
}

/// Creates a shard Lease of ClusterRing `ring` held by the shard itself, renewed now.
pub async fn create_lease(
    client: &Client,
    namespace: &str,
    ring: &str,
    shard: &str,
    duration_seconds: i32,
) -> anyhow::Result<Lease> {
    let ring = RingRef::new(RingKind::ClusterRing, ring);
    create_lease_of(client, namespace, &ring, shard, duration_seconds).await
}

/// Creates a shard Lease of `ring` (either kind) held by the shard itself, renewed now.
pub async fn create_lease_of(
    client: &Client,
    namespace: &str,
    ring: &RingRef,
    shard: &str,
    duration_seconds: i32,
) -> anyhow::Result<Lease> {
    create_annotated_lease(client, namespace, ring, shard, duration_seconds, []).await
}

/// [`create_lease_of`] with `annotations` on the Lease, in the same write.
pub async fn create_annotated_lease<const N: usize>(
    client: &Client,
    namespace: &str,
    ring: &RingRef,
    shard: &str,
    duration_seconds: i32,
    annotations: [(&str, &str); N],
) -> anyhow::Result<Lease> {
    let now = MicroTime(Timestamp::now());
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(shard.into()),
            labels: Some(BTreeMap::from([(
                ring.kind.lease_label().to_string(),
                ring.name.clone(),
            )])),
            annotations: (N > 0).then(|| {
                annotations
                    .iter()
                    .map(|(key, value)| (key.to_string(), value.to_string()))
                    .collect()
            }),
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

/// Creates an empty Secret for each of `names` in `namespace`, one after the other.
pub async fn create_secrets(
    client: &Client,
    namespace: &str,
    names: &[String],
) -> anyhow::Result<()> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    for name in names {
        api.create(&PostParams::default(), &secret(name)).await?;
    }
    Ok(())
}

/// The shard a ring assigns Secret `name` in `namespace` to, predicted from the
/// [`IndependentRing`] over the shards' names (never the sharder's own ring, which would confirm
/// its own bugs) and the Secret's hash key `/Secret/<namespace>/<name>`, spelled out here rather
/// than taken from the sharder's key code, so a test checks it.
///
/// Takes the ring rather than the shard names: callers that predict many objects build it once.
pub fn expected_shard<'r>(
    ring: &'r IndependentRing,
    namespace: &str,
    name: &str,
) -> Option<&'r str> {
    ring.try_shard_for(&format!("/Secret/{namespace}/{name}"))
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

/// Waits until the ClusterRing is Ready and its status reports `available`/`shards`.
pub async fn wait_status(
    client: &Client,
    ring: &str,
    available: i32,
    shards: i32,
) -> anyhow::Result<ClusterRing> {
    wait_status_for::<ClusterRing>(client, ring, available, shards).await
}

/// Waits until `ring` (either kind) is Ready and its status reports `available`/`shards`.
pub async fn wait_status_of(
    client: &Client,
    ring: &RingRef,
    available: i32,
    shards: i32,
) -> anyhow::Result<()> {
    match ring.kind {
        RingKind::ClusterRing => {
            wait_status_for::<ClusterRing>(client, &ring.name, available, shards).await?;
        }
        RingKind::ControllerRing => {
            wait_status_for::<ControllerRing>(client, &ring.name, available, shards).await?;
        }
    }
    Ok(())
}

async fn wait_status_for<R: RingObject>(
    client: &Client,
    ring: &str,
    available: i32,
    shards: i32,
) -> anyhow::Result<R> {
    let api = Api::<R>::all(client.clone());
    poll_until(
        &format!("{} {ring} status {available}/{shards}", R::KIND),
        WAIT,
        || {
            let api = api.clone();
            async move {
                let r = api.get(ring).await?;
                let s = r.ring_status().cloned().unwrap_or_default();
                let ready = s
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                Ok((ready && s.available_shards == available && s.shards == shards).then_some(r))
            }
        },
    )
    .await
}

/// Waits until the webhook assigns a dry-run Secret as the ClusterRing of `shards` predicts,
/// i.e. the webhook configuration is in place and the sharder's view of the ring is current.
pub async fn wait_webhook(
    client: &Client,
    namespace: &str,
    ring: &str,
    shards: &[&str],
) -> anyhow::Result<()> {
    let ring = RingRef::new(RingKind::ClusterRing, ring);
    wait_webhook_of(client, namespace, &ring, shards).await
}

/// [`wait_webhook`] for a ring of either kind (object keys, not namespace keys).
pub async fn wait_webhook_of(
    client: &Client,
    namespace: &str,
    ring: &RingRef,
    shards: &[&str],
) -> anyhow::Result<()> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let key = ring.shard_label();
    let expected = expected_shard(&IndependentRing::unweighted(shards), namespace, "probe")
        .map(str::to_string);
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

/// Waits until the objects `names` of kind `K` in `namespace` carry the shard label of `ring`. The
/// webhook fails open (`failurePolicy: Ignore`): on a busy machine a create may miss it, and the
/// sharder then assigns the object within seconds. Tests that count labels call this first.
pub async fn wait_labelled<K>(
    client: &Client,
    namespace: &str,
    ring: &RingRef,
    names: &[&str],
) -> anyhow::Result<()>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api = Api::<K>::namespaced(client.clone(), namespace);
    let key = ring.shard_label();
    poll_until(
        &format!("{names:?} in {namespace} to carry the shard label of ring {ring}"),
        WAIT,
        || {
            let (api, key) = (api.clone(), key.clone());
            async move {
                let objects = api.list(&ListParams::default()).await?;
                let labelled: Vec<String> = objects
                    .items
                    .iter()
                    .filter(|o| o.labels().contains_key(&key))
                    .map(|o| o.name_any())
                    .collect();
                Ok(names
                    .iter()
                    .all(|n| labelled.iter().any(|l| l == n))
                    .then_some(()))
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

/// Starts a `checksum-controller` shard of ClusterRing `ring` that watches and leases in
/// `namespace`, with JSON logs (its records can be read with
/// [`crate::process::Process::records`]).
pub fn start_checksum_shard(
    ring: &str,
    namespace: &str,
    shard: &str,
    timing: ShardTiming,
) -> anyhow::Result<crate::process::Process> {
    let ring = RingRef::new(RingKind::ClusterRing, ring);
    start_checksum_shard_of(&ring, namespace, shard, timing)
}

/// [`start_checksum_shard`] for a ring of either kind.
pub fn start_checksum_shard_of(
    ring: &RingRef,
    namespace: &str,
    shard: &str,
    timing: ShardTiming,
) -> anyhow::Result<crate::process::Process> {
    start_checksum_shard_with(ring, namespace, shard, timing, &[])
}

/// [`start_checksum_shard_of`] with `extra` flags appended (test hooks such as
/// `--testing-reconcile-delay`, or `--rejoin-pause`).
pub fn start_checksum_shard_with(
    ring: &RingRef,
    namespace: &str,
    shard: &str,
    timing: ShardTiming,
    extra: &[&str],
) -> anyhow::Result<crate::process::Process> {
    let args = checksum_shard_args(ring, namespace, shard, timing);
    crate::process::Process::start(
        "checksum-controller",
        args.into_iter().chain(extra.iter().copied()),
    )
}

/// [`start_checksum_shard_of`] authenticating with `kubeconfig` (another cluster, or another
/// identity, such as a ServiceAccount with the example's RBAC).
pub fn start_checksum_shard_as(
    ring: &RingRef,
    namespace: &str,
    shard: &str,
    timing: ShardTiming,
    kubeconfig: &std::path::Path,
) -> anyhow::Result<crate::process::Process> {
    let args = checksum_shard_args(ring, namespace, shard, timing);
    crate::process::Process::start_with_env(
        "checksum-controller",
        args,
        [("KUBECONFIG", kubeconfig)],
    )
}

/// The flags of a test shard: `ring`, watching and leasing in `namespace`, JSON logs.
fn checksum_shard_args<'a>(
    ring: &'a RingRef,
    namespace: &'a str,
    shard: &'a str,
    timing: ShardTiming,
) -> Vec<&'a str> {
    let ShardTiming(duration, deadline, retry) = timing;
    vec![
        "--ring-kind",
        ring.kind.kind(),
        "--ring",
        &ring.name,
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
    ]
}

/// Warning Events the sharder recorded about the Lease `name` in `namespace`.
pub async fn lease_warnings(
    client: &Client,
    namespace: &str,
    name: &str,
) -> anyhow::Result<Vec<Event>> {
    let events = Api::<Event>::namespaced(client.clone(), namespace);
    Ok(events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| {
            e.type_.as_deref() == Some("Warning")
                && e.involved_object.kind.as_deref() == Some("Lease")
                && e.involved_object.name.as_deref() == Some(name)
        })
        .collect())
}

/// Waits until a dry-run create of Secret `name` in `namespace` comes back with `label` set to
/// `expected`: the ring's webhook is in place and answers from the view the test expects.
pub async fn wait_dry_run_label(
    client: &Client,
    namespace: &str,
    name: &str,
    label: &str,
    expected: &str,
) -> anyhow::Result<()> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    poll_until(
        &format!("the webhook to label {name} {label}={expected}"),
        WAIT,
        || async {
            let params = PostParams {
                dry_run: true,
                ..Default::default()
            };
            let created = api.create(&params, &secret(name)).await?;
            Ok((created.labels().get(label).map(String::as_str) == Some(expected)).then_some(()))
        },
    )
    .await
}
