//! Who may join a ring (README "Security"): the ring's own namespace allow-list for shard
//! Leases, enforced by the sharder, against the real API server.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::ensure;
use e2e::fixtures::{
    WAIT, create_lease, create_ring, lease_warnings, ring_spec, secret, wait_status, wait_webhook,
};
use e2e::process::poll_until;
use e2e::scenario::SharedScenario;
use e2e::unique_name;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use sharding_crds::{ClusterRing, ClusterRingSpec, labels};

/// The exclusion annotation on Lease `namespace`/`name`, once it equals `want`.
async fn wait_exclusion_annotation(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    want: Option<&str>,
) -> anyhow::Result<()> {
    let leases = Api::<Lease>::namespaced(client.clone(), namespace);
    poll_until(
        &format!("the exclusion annotation of Lease {namespace}/{name} to be {want:?}"),
        WAIT,
        || async {
            let lease = leases.get(name).await?;
            let got = lease.annotations().get(labels::ANNOTATION_EXCLUDED).cloned();
            Ok((got.as_deref() == want).then_some(()))
        },
    )
    .await
}

/// A ring with `spec.leaseNamespaces` takes no shard from elsewhere: a held Lease in another
/// namespace never receives an object, however it is named (an older copy of a member's name
/// outside the list does not push the member out as a duplicate); it is reported by a Warning
/// Event, the exclusion metric and the exclusion annotation. Allowing its namespace lets it join.
#[tokio::test]
async fn a_lease_outside_the_rings_lease_namespaces_never_receives_an_object() -> anyhow::Result<()>
{
    let SharedScenario {
        sharder,
        mut logs,
        cluster,
        client,
        ns,
    } = SharedScenario::in_namespace("allow").await?;
    let outside = cluster.namespace(&client, "outside").await?;
    let ring = unique_name("allow");
    // An older copy of shard-a's name outside the list: without the list it would keep the name.
    create_lease(&client, &outside, &ring, "shard-a", 3600).await?;
    create_lease(&client, &outside, &ring, "intruder", 3600).await?;
    // Creation times have whole seconds: the allowed copy of shard-a is the younger one.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for shard in ["shard-a", "shard-b"] {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    let spec = ClusterRingSpec {
        lease_namespaces: vec![ns.clone()],
        ..ring_spec(&ns)
    };
    create_ring(&client, &ring, spec).await?;
    wait_status(&client, &ring, 2, 4).await?;
    wait_webhook(&client, &ns, &ring, &["shard-a", "shard-b"]).await?;

    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let key = labels::shard_label(&ring);
    let mut shards = BTreeSet::new();
    for i in 0..40 {
        let created = secrets
            .create(&PostParams::default(), &secret(&format!("s-{i}")))
            .await?;
        shards.insert(created.labels().get(&key).cloned().unwrap_or_default());
    }
    ensure!(
        shards == BTreeSet::from(["shard-a".to_string(), "shard-b".to_string()]),
        "40 Secrets went to {shards:?}, not to shard-a and shard-b only"
    );

    let reason = "ShardLeaseNamespaceNotAllowed";
    for name in ["intruder", "shard-a"] {
        wait_exclusion_annotation(&client, &outside, name, Some(reason)).await?;
        poll_until("a Warning Event on the Lease outside the list", WAIT, || async {
            let warnings = lease_warnings(&client, &outside, name).await?;
            Ok(warnings
                .iter()
                .any(|e| e.reason.as_deref() == Some(reason))
                .then_some(()))
        })
        .await?;
    }
    wait_exclusion_annotation(&client, &ns, "shard-a", None).await?;
    let series = format!(
        r#"controller_sharding_shard_excluded{{namespace="{outside}",shard="intruder",clusterring="{ring}",reason="{reason}"}} 1"#
    );
    poll_until("the exclusion metric of the intruder", WAIT, || async {
        Ok(sharder.metrics()?.contains(&series).then_some(()))
    })
    .await?;
    let drain = labels::drain_label(&ring);
    for secret in secrets.list(&Default::default()).await? {
        ensure!(
            !secret.labels().contains_key(&drain),
            "{} is being drained although no member changed",
            secret.name_any()
        );
    }

    // Both namespaces allowed: the intruder joins, and the older copy of shard-a keeps the name.
    let rings = Api::<ClusterRing>::all(client.clone());
    let allow_both = json!({"spec": {"leaseNamespaces": [ns, outside]}});
    rings
        .patch(&ring, &PatchParams::default(), &Patch::Merge(&allow_both))
        .await?;
    wait_status(&client, &ring, 3, 4).await?;
    wait_exclusion_annotation(&client, &outside, "intruder", None).await?;
    wait_exclusion_annotation(&client, &outside, "shard-a", None).await?;
    wait_exclusion_annotation(&client, &ns, "shard-a", Some("DuplicateShardName")).await?;
    logs.passed();
    Ok(())
}
