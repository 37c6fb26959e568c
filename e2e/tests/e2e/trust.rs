//! Who may join a ring and what the sharder's identity may write (README "Security"): the ring's
//! namespace allow-list for shard Leases, enforced by the sharder; the admission policies of
//! `config/admission-policies`, enforced by the API server; webhook configurations the sharder
//! did not write.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use e2e::fixtures::{
    ShardTiming, WAIT, create_lease, create_ring, create_ring_of, create_secrets, expected_shard,
    lease_warnings, ring_spec, secret, start_checksum_shard_as, wait_status, wait_status_of,
    wait_webhook,
};
use e2e::process::poll_until;
use e2e::scenario::{DedicatedScenario, SharedScenario};
use e2e::sharder_identity::service_account_kubeconfig;
use e2e::sharder_process::{SharderFiles, SharderSettings, counter_of};
use e2e::{IndependentRing, serves_admission_policies, unique_name};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube_sharder::core::webhook_config::desired_webhook_configuration;
use kube_sharding_api::config::WebhookConfig;
use kube_sharding_api::{
    ClusterRing, ClusterRingSpec, ControllerRing, RingKind, RingObject, RingRef, labels,
};
use serde_json::json;

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
            let got = lease
                .annotations()
                .get(labels::ANNOTATION_EXCLUDED)
                .cloned();
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
        poll_until(
            "a Warning Event on the Lease outside the list",
            WAIT,
            || async {
                let warnings = lease_warnings(&client, &outside, name).await?;
                Ok(warnings
                    .iter()
                    .any(|e| e.reason.as_deref() == Some(reason))
                    .then_some(()))
            },
        )
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

/// The text of `config/<path>` in this checkout.
fn config_file(path: &str) -> anyhow::Result<String> {
    let file = e2e::in_cluster::workspace_root().join("config").join(path);
    std::fs::read_to_string(&file).with_context(|| format!("failed to read {}", file.display()))
}

/// Applies the shipped shard Lease policies to `cluster`. Tests running at once apply the same
/// file: the loser of a race to create a policy is told it exists, and applies again.
async fn apply_shard_lease_policies(cluster: &e2e::Cluster) -> anyhow::Result<()> {
    let policies = config_file("admission-policies/shard_lease_policies.yaml")?;
    let mut attempts = 0;
    loop {
        match cluster.apply_yaml(&policies) {
            Err(error) if attempts < 3 && error.to_string().contains("AlreadyExists") => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            result => return result,
        }
    }
}

/// A Lease `name` in `namespace`, labelled for ClusterRing `ring` when given.
fn lease(namespace: &str, name: &str, label: Option<(&str, &str)>) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: label.map(|(k, v)| BTreeMap::from([(k.to_string(), v.to_string())])),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(name.into()),
            lease_duration_seconds: Some(3600),
            ..Default::default()
        }),
    }
}

/// Whether `result` is the API server's 403 whose message contains `needle`.
fn forbidden<T: std::fmt::Debug>(result: kube::Result<T>, needle: &str) -> anyhow::Result<()> {
    match result {
        Err(kube::Error::Api(status)) if status.code == 403 && status.message.contains(needle) => {
            Ok(())
        }
        other => bail!("expected 403 mentioning {needle:?}, got {other:?}"),
    }
}

/// Grants `user` everything on Leases in `namespace` (namespace rights, nothing more).
async fn grant_lease_rights(
    client: &kube::Client,
    namespace: &str,
    user: &str,
) -> anyhow::Result<()> {
    let roles = Api::<Role>::namespaced(client.clone(), namespace);
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": format!("{user}-leases")},
        "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["*"]}],
    }))?;
    roles.create(&PostParams::default(), &role).await?;
    let bindings = Api::<RoleBinding>::namespaced(client.clone(), namespace);
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": format!("{user}-leases")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": format!("{user}-leases")},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }))?;
    bindings.create(&PostParams::default(), &binding).await?;
    Ok(())
}

/// With the shipped admission policies, a user with Lease rights in her own namespace can neither
/// create a Lease labelled for a ring nor label or relabel one into or out of a ring; an identity
/// granted `use` on the ring (as the example's RBAC grants its shards) joins, and its shard takes
/// objects; relabelling into a ring it may not use is refused.
#[tokio::test]
async fn only_identities_that_may_use_a_ring_put_leases_into_it() -> anyhow::Result<()> {
    if !serves_admission_policies(
        e2e::cluster(),
        "only_identities_that_may_use_a_ring_put_leases_into_it",
    )? {
        return Ok(());
    }
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("join").await?;
    apply_shard_lease_policies(cluster).await?;
    let ring = unique_name("join");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    let (alice, shard) = (unique_name("alice"), unique_name("shard"));
    grant_lease_rights(&client, &ns, &alice).await?;
    grant_lease_rights(&client, &ns, &shard).await?;
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": format!("use-{ring}")},
        "rules": [{"apiGroups": ["sharding.timebertt.dev"], "resources": ["clusterrings"],
                   "resourceNames": [ring], "verbs": ["use"]}],
    }))?;
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &role)
        .await?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": format!("use-{ring}")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": format!("use-{ring}")},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": shard}],
    }))?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await?;

    let as_alice = Api::<Lease>::namespaced(cluster.client_as(&alice, &[]).await?, &ns);
    let as_shard = Api::<Lease>::namespaced(cluster.client_as(&shard, &[]).await?, &ns);
    let cluster_ring = RingKind::ClusterRing.lease_label();
    let controller_ring = RingKind::ControllerRing.lease_label();
    // The API server loads each new policy and binding on its own, within a second or so: wait
    // until both policies (one per ring label) refuse.
    let admin_leases = Api::<Lease>::namespaced(client.clone(), &ns);
    for (label, resource) in [
        (cluster_ring, "clusterrings"),
        (controller_ring, "controllerrings"),
    ] {
        poll_until(
            &format!("the policy to refuse alice's Lease labelled {label}"),
            WAIT,
            || async {
                let labelled = lease(&ns, "squat", Some((label, &ring)));
                let result = as_alice.create(&PostParams::default(), &labelled).await;
                if result.is_ok() {
                    // Created before the API server loaded the policy.
                    admin_leases.delete("squat", &Default::default()).await?;
                }
                Ok(forbidden(result, &format!("use on {resource}/{ring}")).ok())
            },
        )
        .await?;
    }
    // Unlabelled Leases are hers to write; labelling one is joining.
    as_alice
        .create(&PostParams::default(), &lease(&ns, "plain", None))
        .await?;
    let label = json!({"metadata": {"labels": {cluster_ring: ring}}});
    forbidden(
        as_alice
            .patch("plain", &PatchParams::default(), &Patch::Merge(&label))
            .await,
        &format!("use on clusterrings/{ring}"),
    )?;

    // The shard's identity may use the ring: it joins and receives objects.
    as_shard
        .create(
            &PostParams::default(),
            &lease(&ns, "shard-0", Some((cluster_ring, &ring))),
        )
        .await?;
    wait_status(&client, &ring, 1, 1).await?;
    wait_webhook(&client, &ns, &ring, &["shard-0"]).await?;
    // Alice may not take it out of the ring, nor may the shard move it into another ring.
    let unlabel = json!({"metadata": {"labels": {cluster_ring: null}}});
    forbidden(
        as_alice
            .patch("shard-0", &PatchParams::default(), &Patch::Merge(&unlabel))
            .await,
        &format!("use on clusterrings/{ring}"),
    )?;
    let other = unique_name("other");
    let relabel = json!({"metadata": {"labels": {cluster_ring: other}}});
    forbidden(
        as_shard
            .patch("shard-0", &PatchParams::default(), &Patch::Merge(&relabel))
            .await,
        &format!("use on clusterrings/{other}"),
    )?;
    // Renewing leaves the label alone and needs nothing but Lease rights.
    let renew = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
    as_shard
        .patch("shard-0", &PatchParams::default(), &Patch::Merge(&renew))
        .await?;
    logs.passed();
    Ok(())
}

/// Grants `user` the verb `use` on ClusterRing `ring` (and the ControllerRing of the same name),
/// as the example's RBAC grants its shards.
async fn grant_use(client: &kube::Client, ring: &str, user: &str) -> anyhow::Result<()> {
    let name = format!("use-{ring}-{user}");
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": name},
        "rules": [{"apiGroups": ["sharding.timebertt.dev"], "resources": ["clusterrings", "controllerrings"],
                   "resourceNames": [ring], "verbs": ["use"]}],
    }))?;
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &role)
        .await?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }))?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await?;
    Ok(())
}

/// With the shipped shard Lease policies, a zero-write ring's handover annotations
/// (docs/zero-write-rings.md) are written only by whom they belong to: `ranges` only by an
/// identity that may patch the ring's status (the sharder), not by its shard, even though the
/// shard may use the ring (on create, change or removal); `acknowledged` only by an identity that
/// may use the ring (the shard), not by someone with mere Lease rights.
#[tokio::test]
async fn only_the_sharder_publishes_ranges_and_only_a_ring_user_acknowledges() -> anyhow::Result<()>
{
    if !serves_admission_policies(
        e2e::cluster(),
        "only_the_sharder_publishes_ranges_and_only_a_ring_user_acknowledges",
    )? {
        return Ok(());
    }
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("ranges-policy").await?;
    apply_shard_lease_policies(cluster).await?;
    // No ring object: the policy asks the authorizer about the name, and the shared sharder
    // leaves Leases of unknown rings alone.
    let ring = unique_name("ranges-policy");
    let (alice, shard, publisher) = (
        unique_name("alice"),
        unique_name("shard"),
        unique_name("publisher"),
    );
    for user in [&alice, &shard, &publisher] {
        grant_lease_rights(&client, &ns, user).await?;
    }
    grant_use(&client, &ring, &shard).await?;
    grant_use(&client, &ring, &publisher).await?;
    let name = format!("status-{ring}-{publisher}");
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": name},
        "rules": [{"apiGroups": ["sharding.timebertt.dev"], "resources": ["clusterrings/status"],
                   "resourceNames": [ring], "verbs": ["patch"]}],
    }))?;
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &role)
        .await?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": publisher}],
    }))?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await?;
    let as_alice = Api::<Lease>::namespaced(cluster.client_as(&alice, &[]).await?, &ns);
    let as_shard = Api::<Lease>::namespaced(cluster.client_as(&shard, &[]).await?, &ns);
    let as_publisher = Api::<Lease>::namespaced(cluster.client_as(&publisher, &[]).await?, &ns);
    let label = RingKind::ClusterRing.lease_label();
    as_shard
        .create(
            &PostParams::default(),
            &lease(&ns, "shard-0", Some((label, &ring))),
        )
        .await?;
    let ranges = kube_sharding_api::range_lease::ANNOTATION_RANGES;
    let acknowledged = kube_sharding_api::range_lease::ANNOTATION_ACKNOWLEDGED;
    let publish = |value: Option<&str>| json!({"metadata": {"annotations": {ranges: value}}});
    let only_sharder = "only the sharder writes it";
    // Another test may have loaded an older version of the file: wait for this one.
    poll_until(
        "the policy to refuse a shard's own ranges",
        WAIT,
        || async {
            let result = as_shard
                .patch(
                    "shard-0",
                    &PatchParams::default(),
                    &Patch::Merge(publish(Some("1"))),
                )
                .await;
            if result.is_ok() {
                client_remove(&client, &ns, ranges).await?;
            }
            Ok(forbidden(result, only_sharder).ok())
        },
    )
    .await?;
    as_publisher
        .patch(
            "shard-0",
            &PatchParams::default(),
            &Patch::Merge(publish(Some("1"))),
        )
        .await
        .context("the ring's status writer publishes ranges")?;
    forbidden(
        as_shard
            .patch(
                "shard-0",
                &PatchParams::default(),
                &Patch::Merge(publish(Some("2"))),
            )
            .await,
        only_sharder,
    )
    .context("the shard changes its ranges")?;
    forbidden(
        as_shard
            .patch(
                "shard-0",
                &PatchParams::default(),
                &Patch::Merge(publish(None)),
            )
            .await,
        only_sharder,
    )
    .context("the shard removes its ranges")?;
    let mut with_ranges = lease(&ns, "shard-1", Some((label, &ring)));
    with_ranges.metadata.annotations =
        Some(BTreeMap::from([(ranges.to_string(), "1".to_string())]));
    forbidden(
        as_shard.create(&PostParams::default(), &with_ranges).await,
        only_sharder,
    )
    .context("the shard creates its Lease with ranges")?;

    let acknowledge = json!({"metadata": {"annotations": {acknowledged: "1"}}});
    forbidden(
        as_alice
            .patch(
                "shard-0",
                &PatchParams::default(),
                &Patch::Merge(&acknowledge),
            )
            .await,
        &format!("steers that ring: this needs the verb use on clusterrings/{ring}"),
    )
    .context("alice acknowledges")?;
    as_shard
        .patch(
            "shard-0",
            &PatchParams::default(),
            &Patch::Merge(&acknowledge),
        )
        .await
        .context("the shard acknowledges")?;

    // A shard that takes its Lease again drops the earlier holding's ranges in the taking write:
    // refused while it holds the Lease (above), allowed when the write makes it the holder.
    as_shard
        .patch(
            "shard-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"holderIdentity": null}})),
        )
        .await
        .context("the shard releases its Lease")?;
    let take = json!({
        "metadata": {"annotations": {ranges: null, acknowledged: null}},
        "spec": {"holderIdentity": "shard-0"},
    });
    forbidden(
        as_alice
            .patch("shard-0", &PatchParams::default(), &Patch::Merge(&take))
            .await,
        &format!("this needs the verb use on clusterrings/{ring}"),
    )
    .context("alice takes the Lease dropping its ranges")?;
    forbidden(
        as_shard
            .patch(
                "shard-0",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"holderIdentity": "shard-0"},
                    "metadata": {"annotations": {ranges: "2"}}})),
            )
            .await,
        only_sharder,
    )
    .context("the shard takes its Lease with ranges of its own")?;
    let taken = as_shard
        .patch("shard-0", &PatchParams::default(), &Patch::Merge(&take))
        .await
        .context("the shard takes its Lease dropping the earlier holding's ranges")?;
    ensure!(
        !taken.annotations().contains_key(ranges)
            && !taken.annotations().contains_key(acknowledged),
        "the taking write left {:?}",
        taken.annotations()
    );
    logs.passed();
    Ok(())
}

/// Removes annotation `key` from Lease `shard-0` in `namespace` as the admin.
async fn client_remove(client: &kube::Client, namespace: &str, key: &str) -> anyhow::Result<()> {
    Api::<Lease>::namespaced(client.clone(), namespace)
        .patch(
            "shard-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {key: null}}})),
        )
        .await?;
    Ok(())
}

/// With the shipped shard Lease policies, a user who may update Leases in a shard's namespace but
/// may not `use` its ring can change nothing the sharder reads from a shard Lease: not its holder
/// (emptied or another), not its duration, not the annotations `excluded`, `weight`,
/// `leaves-controlled-objects` and `released-by` (set or removed), and she can neither delete it
/// nor label a Lease with an empty ring value. She may still renew it and write other
/// annotations, the load report among them. The shard's identity, which may use the ring, does all of it; the ControllerRing
/// policy refuses the same. The namespace controller, which has no `use`, may delete a shard
/// Lease only once its namespace is being deleted.
#[tokio::test]
async fn changing_what_a_shard_lease_says_needs_use_on_its_ring() -> anyhow::Result<()> {
    if !serves_admission_policies(
        e2e::cluster(),
        "changing_what_a_shard_lease_says_needs_use_on_its_ring",
    )? {
        return Ok(());
    }
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("steer").await?;
    apply_shard_lease_policies(cluster).await?;
    // No ring object is needed: the policy asks the authorizer about the name. Without one, the
    // shared sharder leaves these Leases alone.
    let ring = unique_name("steer");
    let (alice, shard) = (unique_name("alice"), unique_name("shard"));
    grant_lease_rights(&client, &ns, &alice).await?;
    grant_lease_rights(&client, &ns, &shard).await?;
    grant_use(&client, &ring, &shard).await?;
    let as_alice = Api::<Lease>::namespaced(cluster.client_as(&alice, &[]).await?, &ns);
    let as_shard = Api::<Lease>::namespaced(cluster.client_as(&shard, &[]).await?, &ns);
    let cluster_ring = RingKind::ClusterRing.lease_label();
    let controller_ring = RingKind::ControllerRing.lease_label();
    let admin_leases = Api::<Lease>::namespaced(client.clone(), &ns);

    // The shard joins; wait until the API server has loaded the policy that refuses alice below
    // (another test may have loaded the older version of the file).
    for (label, name) in [(cluster_ring, "shard-0"), (controller_ring, "shard-1")] {
        as_shard
            .create(
                &PostParams::default(),
                &lease(&ns, name, Some((label, &ring))),
            )
            .await?;
    }
    let steers = "steers that ring: this needs the verb use on";
    poll_until("the policy to refuse a change of holder", WAIT, || async {
        let patch = json!({"spec": {"holderIdentity": ""}});
        let result = as_alice
            .patch("shard-0", &PatchParams::default(), &Patch::Merge(&patch))
            .await;
        if result.is_ok() {
            // Admitted before the API server loaded the policy: put the holder back.
            let back = json!({"spec": {"holderIdentity": "shard-0"}});
            admin_leases
                .patch("shard-0", &PatchParams::default(), &Patch::Merge(&back))
                .await?;
        }
        Ok(forbidden(result, steers).ok())
    })
    .await?;

    let weight = labels::ANNOTATION_WEIGHT;
    let changes = [
        json!({"spec": {"holderIdentity": "mallory"}}),
        json!({"spec": {"leaseDurationSeconds": 1}}),
        json!({"spec": {"leaseDurationSeconds": null}}),
        json!({"metadata": {"annotations": {labels::ANNOTATION_EXCLUDED: "DuplicateShardName"}}}),
        json!({"metadata": {"annotations": {weight: "10"}}}),
        json!({"metadata": {"annotations": {labels::ANNOTATION_LEAVES_CONTROLLED_OBJECTS: "true"}}}),
        json!({"metadata": {"annotations": {labels::ANNOTATION_RELEASED_BY: "shard-0"}}}),
    ];
    for change in &changes {
        forbidden(
            as_alice
                .patch("shard-0", &PatchParams::default(), &Patch::Merge(change))
                .await,
            &format!("{steers} clusterrings/{ring}"),
        )
        .with_context(|| format!("alice's change {change}"))?;
    }
    // Removing a steering annotation is a change too.
    as_shard
        .patch(
            "shard-0",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {weight: "2"}}})),
        )
        .await
        .context("the shard sets its weight")?;
    forbidden(
        as_alice
            .patch(
                "shard-0",
                &PatchParams::default(),
                &Patch::Merge(&json!({"metadata": {"annotations": {weight: null}}})),
            )
            .await,
        steers,
    )?;
    forbidden(
        as_alice.delete("shard-0", &Default::default()).await,
        &format!(
            "takes a shard out of that ClusterRing: this needs the verb use on clusterrings/{ring}"
        ),
    )?;
    // The other ring kind's policy says the same.
    forbidden(
        as_alice
            .patch(
                "shard-1",
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"holderIdentity": ""}})),
            )
            .await,
        &format!("{steers} controllerrings/{ring}"),
    )?;
    forbidden(
        as_alice.delete("shard-1", &Default::default()).await,
        &format!("use on controllerrings/{ring}"),
    )?;

    // An empty ring value is no ring: refused for everyone, on create and on update.
    let empty = "must name a ClusterRing";
    forbidden(
        as_alice
            .create(
                &PostParams::default(),
                &lease(&ns, "nowhere", Some((cluster_ring, ""))),
            )
            .await,
        empty,
    )?;
    forbidden(
        as_shard
            .patch(
                "shard-0",
                &PatchParams::default(),
                &Patch::Merge(&json!({"metadata": {"labels": {cluster_ring: ""}}})),
            )
            .await,
        empty,
    )?;

    // What the sharder does not read stays free: renewing, other annotations.
    let renew = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
    as_alice
        .patch("shard-0", &PatchParams::default(), &Patch::Merge(&renew))
        .await
        .context("renewing needs no use")?;
    let other = json!({"metadata": {"annotations": {"example.com/note": "hello"}}});
    as_alice
        .patch("shard-0", &PatchParams::default(), &Patch::Merge(&other))
        .await
        .context("other annotations need no use")?;
    // Nor does a renewal carrying a load report (docs/protocol.md §23): it steers no ring, and
    // whoever may renew the Lease may keep its shard available anyway.
    let reported = json!({
        "metadata": {"annotations": {kube_sharding_api::load::ANNOTATION_LOAD: "objects=3,queue=0"}},
        "spec": {"renewTime": MicroTime(Timestamp::now())},
    });
    as_alice
        .patch("shard-0", &PatchParams::default(), &Patch::Merge(&reported))
        .await
        .context("a load report needs no use")?;

    // The shard's identity may do everything alice may not.
    for change in &changes {
        as_shard
            .patch("shard-0", &PatchParams::default(), &Patch::Merge(change))
            .await
            .with_context(|| format!("the shard's change {change}"))?;
    }
    for name in ["shard-0", "shard-1"] {
        as_shard
            .delete(name, &Default::default())
            .await
            .with_context(|| format!("the shard deletes {name}"))?;
    }

    // Deleting a namespace deletes its Leases as the namespace controller, which has no `use`:
    // refused while the namespace lives, admitted once it is being deleted. A finalizer keeps
    // the Lease (and so the namespace) there long enough to ask.
    let doomed = cluster.namespace(&client, "doomed").await?;
    grant_lease_rights(&client, &doomed, &shard).await?;
    let mut held = lease(&doomed, "held", Some((cluster_ring, &ring)));
    held.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    Api::<Lease>::namespaced(cluster.client_as(&shard, &[]).await?, &doomed)
        .create(&PostParams::default(), &held)
        .await?;
    let namespace_controller = Api::<Lease>::namespaced(
        cluster
            .client_as(
                "system:serviceaccount:kube-system:namespace-controller",
                &["system:serviceaccounts", "system:authenticated"],
            )
            .await?,
        &doomed,
    );
    let dry_run = kube::api::DeleteParams {
        dry_run: true,
        ..Default::default()
    };
    forbidden(
        namespace_controller.delete("held", &dry_run).await,
        "takes a shard out of that ClusterRing",
    )
    .context("the namespace controller deletes a shard Lease of a live namespace")?;
    Api::<Namespace>::all(client.clone())
        .delete(&doomed, &Default::default())
        .await?;
    poll_until(
        "the namespace controller's delete to be admitted in a namespace being deleted",
        WAIT,
        || async {
            let result = namespace_controller.delete("held", &dry_run).await;
            Ok(result.is_ok().then_some(()))
        },
    )
    .await?;
    let release = json!({"metadata": {"finalizers": null}});
    Api::<Lease>::namespaced(client.clone(), &doomed)
        .patch("held", &PatchParams::default(), &Patch::Merge(&release))
        .await?;
    logs.passed();
    Ok(())
}

/// `change`'s fields set on the object `target`, a `null` removing the field (a merge patch one
/// level deep).
fn merge_fields(target: &mut serde_json::Value, change: &serde_json::Value) -> anyhow::Result<()> {
    let target = target.as_object_mut().context("not an object")?;
    for (key, value) in change.as_object().context("not an object")? {
        if value.is_null() {
            target.remove(key);
        } else {
            target.insert(key.clone(), value.clone());
        }
    }
    Ok(())
}

/// The shipped policy for the sharder's identity (installed here for a ServiceAccount of the
/// test's namespace, so the shared sharder is not affected): with the shipped ClusterRole it
/// could create any webhook configuration and write any Lease; the policy lets it write only
/// webhook configurations exactly as the sharder writes them (the sharder's own code builds them
/// here) and only shard Leases, keeping their ring labels. Each field of a fail-closed,
/// cluster-wide configuration (failurePolicy Fail, wildcard rules, a long timeout, a foreign path
/// or Service, every object) is refused on its own, as are a second webhook and a name or ring
/// label that do not fit.
#[tokio::test]
async fn the_sharder_identity_writes_only_its_webhook_configurations_and_shard_leases()
-> anyhow::Result<()> {
    if !serves_admission_policies(
        e2e::cluster(),
        "the_sharder_identity_writes_only_its_webhook_configurations_and_shard_leases",
    )? {
        return Ok(());
    }
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("sharder-policy").await?;
    let shipped = "system:serviceaccount:sharding-system:sharder";
    let policy = config_file("admission-policies/sharder_policy.yaml")?;
    ensure!(
        policy.contains(shipped),
        "the policy does not name {shipped}"
    );
    let name = unique_name("sharder-writes");
    let user = format!("system:serviceaccount:{ns}:sharder");
    cluster.apply_yaml(
        &policy
            .replace(shipped, &user)
            .replace("name: sharding-sharder-writes", &format!("name: {name}"))
            .replace(
                "policyName: sharding-sharder-writes",
                &format!("policyName: {name}"),
            ),
    )?;
    cluster.apply_yaml(&config_file("rbac/cluster_role.yaml")?)?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "sharding:sharder"},
        "subjects": [{"kind": "ServiceAccount", "name": "sharder", "namespace": ns}],
    }))?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await?;
    // So that the ring-joining policy, if another test installed it, has no say below: what is
    // refused here is refused by the sharder's policy.
    let use_rings: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": name},
        "rules": [{"apiGroups": ["sharding.timebertt.dev"], "resources": ["clusterrings"],
                   "resourceNames": ["r", "other"], "verbs": ["use"]}],
    }))?;
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &use_rings)
        .await?;
    let use_binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": format!("{name}-use")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": "sharder", "namespace": ns}],
    }))?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &use_binding)
        .await?;
    let as_sharder = cluster
        .client_as(&user, &["system:serviceaccounts", "system:authenticated"])
        .await?;
    let configs = Api::<MutatingWebhookConfiguration>::all(as_sharder.clone());
    let admin_configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    // Exactly what the sharder writes for a ring (with the shipped config's Service), less the
    // owner reference: no ring exists here, and the garbage collector would delete it.
    let written = |kind: RingKind, ring: &str| -> anyhow::Result<serde_json::Value> {
        let spec = ring_spec(&ns);
        let mut config = match kind {
            RingKind::ClusterRing => desired_webhook_configuration(
                &ClusterRing::new(ring, spec),
                &WebhookConfig::default(),
                None,
            ),
            RingKind::ControllerRing => desired_webhook_configuration(
                &ControllerRing::new(ring, spec.into()),
                &WebhookConfig::default(),
                None,
            ),
        };
        config.metadata.owner_references = None;
        Ok(serde_json::to_value(config)?)
    };
    let create = |config: serde_json::Value| {
        let configs = configs.clone();
        async move {
            let config: MutatingWebhookConfiguration = serde_json::from_value(config)?;
            anyhow::Ok(configs.create(&PostParams::default(), &config).await)
        }
    };
    let refused = "its own webhook configurations";
    let ring = unique_name("p");
    let cluster_config = written(RingKind::ClusterRing, &ring)?;
    let mine = cluster_config["metadata"]["name"]
        .as_str()
        .context("no name")?
        .to_string();
    poll_until(
        "the policy to refuse a webhook configuration with a URL",
        WAIT,
        || async {
            let mut config = cluster_config.clone();
            config["webhooks"][0]["clientConfig"] =
                json!({"url": format!("https://127.0.0.1:1/webhooks/sharder/clusterring/{ring}")});
            let result = create(config).await?;
            if result.is_ok() {
                // Created before the API server loaded the policy.
                admin_configs.delete(&mine, &Default::default()).await?;
            }
            Ok(forbidden(result, "never a URL").ok())
        },
    )
    .await?;

    // The audit's fail-closed configuration, one field at a time on top of the sharder's own: each
    // alone is refused. Wildcard rules, or a path the sharder does not serve, with failurePolicy
    // Fail stop every write in the cluster; another ring's path or selector pulls objects in.
    let fails_open = "that fails open";
    let rules = "name only the operations CREATE and UPDATE";
    let calls = "calls the Service sharding-system/sharder";
    let other_ring = unique_name("other");
    let tampered: Vec<(&str, serde_json::Value, &str)> = vec![
        (
            "failurePolicy",
            json!({"failurePolicy": "Fail"}),
            fails_open,
        ),
        (
            "no failurePolicy (Fail by default)",
            json!({"failurePolicy": null}),
            fails_open,
        ),
        ("timeoutSeconds", json!({"timeoutSeconds": 30}), fails_open),
        (
            "no timeoutSeconds (10 by default)",
            json!({"timeoutSeconds": null}),
            fails_open,
        ),
        (
            "sideEffects",
            json!({"sideEffects": "NoneOnDryRun"}),
            fails_open,
        ),
        (
            "wildcard rules",
            json!({"rules": [{"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*/*"]}]}),
            rules,
        ),
        (
            "DELETE",
            json!({"rules": [{"operations": ["CREATE", "DELETE"], "apiGroups": [""], "apiVersions": ["*"], "resources": ["secrets"]}]}),
            rules,
        ),
        (
            "a wildcard group",
            json!({"rules": [{"operations": ["CREATE"], "apiGroups": ["*"], "apiVersions": ["*"], "resources": ["secrets"]}]}),
            rules,
        ),
        (
            "a subresource",
            json!({"rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["*"], "resources": ["pods/exec"]}]}),
            rules,
        ),
        (
            "a foreign path",
            json!({"clientConfig": {"service": {"namespace": "sharding-system", "name": "sharder", "path": "/nope"}}}),
            calls,
        ),
        (
            "another ring's path",
            json!({"clientConfig": {"service": {"namespace": "sharding-system", "name": "sharder",
                   "path": format!("/webhooks/sharder/clusterring/{other_ring}")}}}),
            calls,
        ),
        (
            "another Service",
            json!({"clientConfig": {"service": {"namespace": ns, "name": "sharder",
                   "path": format!("/webhooks/sharder/clusterring/{ring}")}}}),
            calls,
        ),
        (
            "every object",
            json!({"objectSelector": {}}),
            "lack the ring's shard label",
        ),
    ];
    for (what, change, message) in &tampered {
        let mut config = cluster_config.clone();
        merge_fields(&mut config["webhooks"][0], change)?;
        forbidden(create(config).await?, message)
            .with_context(|| format!("a webhook configuration with {what}"))?;
    }
    // A second webhook, or a name or label that does not fit the ring, is refused too.
    let mut two = cluster_config.clone();
    let mut second = two["webhooks"][0].clone();
    second["name"] = json!("second.sharding.timebertt.dev");
    two["webhooks"]
        .as_array_mut()
        .context("webhooks")?
        .push(second);
    forbidden(create(two).await?, fails_open).context("two webhooks")?;
    let mut relabelled = cluster_config.clone();
    relabelled["metadata"]["labels"][RingKind::ClusterRing.lease_label()] = json!(other_ring);
    forbidden(create(relabelled).await?, refused).context("another ring's label")?;
    let mut foreign = cluster_config.clone();
    foreign["metadata"]["name"] = json!(unique_name("foreign"));
    forbidden(create(foreign).await?, refused).context("a foreign name")?;

    // What the sharder writes passes, for both ring kinds; it may delete its own kind only.
    create(cluster_config.clone())
        .await?
        .context("the sharder's own webhook configuration was refused")?;
    configs
        .delete(&mine, &Default::default())
        .await
        .context("the sharder may delete its own webhook configuration")?;
    let controller_config = written(RingKind::ControllerRing, &ring)?;
    create(controller_config.clone())
        .await?
        .context("the sharder's own ControllerRing webhook configuration was refused")?;
    configs
        .delete(
            controller_config["metadata"]["name"]
                .as_str()
                .context("no name")?,
            &Default::default(),
        )
        .await?;
    let foreign = unique_name("foreign");
    let mut theirs = cluster_config.clone();
    theirs["metadata"] = json!({"name": foreign});
    admin_configs
        .create(&PostParams::default(), &serde_json::from_value(theirs)?)
        .await?;
    forbidden(configs.delete(&foreign, &Default::default()).await, refused)?;
    admin_configs.delete(&foreign, &Default::default()).await?;

    // Leases: a shard Lease's state label yes; its ring label, or any other Lease, no.
    let admin_leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let cluster_ring = RingKind::ClusterRing.lease_label();
    admin_leases
        .create(
            &PostParams::default(),
            &lease(&ns, "shard-0", Some((cluster_ring, "r"))),
        )
        .await?;
    admin_leases
        .create(&PostParams::default(), &lease(&ns, "someone-else", None))
        .await?;
    let leases = Api::<Lease>::namespaced(as_sharder, &ns);
    let state = json!({"metadata": {"labels": {labels::LABEL_STATE: "ready"}}});
    leases
        .patch("shard-0", &PatchParams::default(), &Patch::Merge(&state))
        .await
        .context("the sharder may label a shard Lease's state")?;
    let refused = "only shard Leases";
    for patch in [
        json!({"metadata": {"labels": {cluster_ring: "other"}}}),
        json!({"metadata": {"labels": {cluster_ring: null}}}),
    ] {
        forbidden(
            leases
                .patch("shard-0", &PatchParams::default(), &Patch::Merge(&patch))
                .await,
            refused,
        )?;
    }
    forbidden(
        leases
            .patch(
                "someone-else",
                &PatchParams::default(),
                &Patch::Merge(&state),
            )
            .await,
        refused,
    )?;
    forbidden(
        leases.delete("someone-else", &Default::default()).await,
        refused,
    )?;
    leases
        .delete("shard-0", &Default::default())
        .await
        .context("the sharder may delete a shard Lease")?;
    logs.passed();
    Ok(())
}

/// A webhook configuration that already has the name a ring's would get, and that the sharder
/// did not write, is left alone: the ring reports why it is not ready, nothing is merged into the
/// configuration (deleting the ring would otherwise delete it), and once it is gone the ring's
/// own is written.
#[tokio::test]
async fn a_webhook_configuration_the_sharder_did_not_write_is_never_taken_over()
-> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("taken").await?;
    let ring = unique_name("taken");
    let ring_ref = RingRef::new(RingKind::ControllerRing, ring.clone());
    let name = RingKind::ControllerRing.webhook_configuration_name(&ring);
    let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let foreign: MutatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"team.example/owner": "someone"}},
        "webhooks": [{
            "name": "someone.example.com",
            "clientConfig": {"url": "https://127.0.0.1:1/someone"},
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "failurePolicy": "Ignore",
            "objectSelector": {"matchLabels": {"never": "matches"}},
        }],
    }))?;
    let created = configs.create(&PostParams::default(), &foreign).await?;
    create_ring_of(&client, &ring_ref, ring_spec(&ns)).await?;
    let rings = Api::<ControllerRing>::all(client.clone());
    let condition = poll_until(&format!("ring {ring} Ready=False"), WAIT, || async {
        let r = rings.get(&ring).await?;
        Ok(r.ring_status().and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == "Ready" && c.status == "False")
                .cloned()
        }))
    })
    .await?;
    ensure!(
        condition.message.contains("was not written by the sharder"),
        "{condition:?}"
    );
    let now = configs.get(&name).await?;
    ensure!(
        now.metadata.resource_version == created.metadata.resource_version,
        "the foreign webhook configuration was written to: {now:?}"
    );
    configs.delete(&name, &Default::default()).await?;
    poll_until("the ring's own webhook configuration", WAIT, || async {
        let config = configs.get_opt(&name).await?;
        Ok(config
            .filter(|c| c.labels().get(RingKind::ControllerRing.lease_label()) == Some(&ring))
            .map(|_| ()))
    })
    .await?;
    wait_status_of(&client, &ring_ref, 0, 0).await?;
    rings.delete(&ring, &Default::default()).await?;
    logs.passed();
    Ok(())
}

/// The text of `deploy/<path>` in this checkout.
fn deploy_file(path: &str) -> anyhow::Result<String> {
    let file = e2e::in_cluster::workspace_root().join("deploy").join(path);
    std::fs::read_to_string(&file).with_context(|| format!("failed to read {}", file.display()))
}

/// The shipped sharder policy for a test sharder, which registers its webhooks by URL on
/// loopback (the test control plane has no Service network): the one check of the webhook's
/// client config becomes "this URL plus the ring's path"; everything else is checked as shipped.
fn sharder_policy_for_url(base: &str) -> anyhow::Result<String> {
    let policy = config_file("admission-policies/sharder_policy.yaml")?;
    let start = policy
        .find("  - name: callsTheSharder\n")
        .context("the sharder policy has no variable callsTheSharder")?;
    let end = start
        + 1
        + policy[start + 1..]
            .find("  - name: ")
            .context("callsTheSharder is the last variable")?;
    let by_url = format!(
        "  - name: callsTheSharder\n    expression: >-\n      has(variables.webhook.clientConfig.url)\n      && variables.webhook.clientConfig.url == '{base}' + variables.path\n"
    );
    Ok(format!("{}{by_url}{}", &policy[..start], &policy[end..]))
}

/// Secrets in `namespace` by name, with their shard label of ClusterRing `ring` and whether they
/// carry its drain label.
async fn secret_shards(
    client: &kube::Client,
    namespace: &str,
    ring: &str,
) -> anyhow::Result<BTreeMap<String, (Option<String>, bool)>> {
    let (key, drain) = (labels::shard_label(ring), labels::drain_label(ring));
    let list = Api::<Secret>::namespaced(client.clone(), namespace)
        .list_metadata(&Default::default())
        .await?;
    Ok(list
        .items
        .iter()
        .map(|s| {
            let labels = s.labels();
            (
                s.name_any(),
                (labels.get(&key).cloned(), labels.contains_key(&drain)),
            )
        })
        .collect())
}

/// Waits until every Secret in `namespace` sits, undrained, on the shard the ClusterRing of
/// `shards` predicts.
async fn wait_secrets_on(
    client: &kube::Client,
    namespace: &str,
    ring: &str,
    shards: &[&str],
) -> anyhow::Result<()> {
    let predicted = IndependentRing::unweighted(shards);
    poll_until(
        &format!("every Secret of {namespace} on its shard of {shards:?}"),
        Duration::from_secs(90),
        || async {
            let secrets = secret_shards(client, namespace, ring).await?;
            Ok(secrets
                .iter()
                .all(|(name, (shard, draining))| {
                    !draining && shard.as_deref() == expected_shard(&predicted, namespace, name)
                })
                .then_some(()))
        },
    )
    .await
}

/// A sharder with every shipped admission policy in force (the sharder's own with its URL, see
/// [`sharder_policy_for_url`]) and shards that run as the example's ServiceAccount with the
/// example's RBAC (`deploy/base/rbac.yaml`, `use` on the ring) work as without the policies: the
/// shards join (creating and renewing their Leases), the webhook configuration the sharder writes
/// is admitted and assigns new Secrets, a new shard's objects come through drains, and the Lease
/// of a killed shard is taken over by the sharder (a change of holder, which needs `use` on the
/// ring: the shipped ClusterRole grants it) and its objects move to the others. No write of the
/// sharder is refused on the way.
#[tokio::test]
async fn the_sharder_works_with_the_shipped_admission_policies() -> anyhow::Result<()> {
    if !serves_admission_policies(
        e2e::cluster(),
        "the_sharder_works_with_the_shipped_admission_policies",
    )? {
        return Ok(());
    }
    // A control plane of its own: the sharder policy below names the shared sharder's identity.
    let DedicatedScenario {
        dedicated,
        client,
        ns: (),
    } = DedicatedScenario::open().await?;
    let cluster = dedicated.cluster();
    let example = "checksum-controller";
    cluster.apply_yaml(&deploy_file("base/namespace.yaml")?)?;
    cluster.apply_yaml(&deploy_file("base/rbac.yaml")?)?;
    apply_shard_lease_policies(cluster).await?;
    let settings = SharderSettings {
        sync_period: "20s".into(),
        ..Default::default()
    };
    // Applies config/rbac: the sharder runs as its ServiceAccount with the shipped ClusterRole.
    let files = SharderFiles::create(cluster.kubeconfig(), &settings)?;
    cluster.apply_yaml(&sharder_policy_for_url(&files.webhook_url())?)?;

    // Both policies loaded: the sharder's identity may not write a foreign webhook
    // configuration, and nobody without `use` may join the ring.
    let as_sharder = cluster
        .client_as(
            "system:serviceaccount:sharding-system:sharder",
            &["system:serviceaccounts", "system:authenticated"],
        )
        .await?;
    let stranger = unique_name("stranger");
    grant_lease_rights(&client, example, &stranger).await?;
    let as_stranger = Api::<Lease>::namespaced(cluster.client_as(&stranger, &[]).await?, example);
    let cluster_ring = RingKind::ClusterRing.lease_label();
    // Dry runs: a write admitted before the API server loaded a policy must not persist (a
    // squatting Lease would join the ring below).
    let dry_run = PostParams {
        dry_run: true,
        ..Default::default()
    };
    poll_until("both policies to be in force", WAIT, || async {
        let foreign: MutatingWebhookConfiguration =
            serde_json::from_value(json!({"metadata": {"name": unique_name("foreign")}}))?;
        let sharder_refused = forbidden(
            Api::<MutatingWebhookConfiguration>::all(as_sharder.clone())
                .create(&dry_run, &foreign)
                .await,
            "its own webhook configurations",
        );
        let join_refused = forbidden(
            as_stranger
                .create(
                    &dry_run,
                    &lease(example, "squat", Some((cluster_ring, example))),
                )
                .await,
            "needs the verb use",
        );
        Ok((sharder_refused.is_ok() && join_refused.is_ok()).then_some(()))
    })
    .await?;

    let spec = ClusterRingSpec {
        lease_namespaces: vec![example.into()],
        ..ring_spec(example)
    };
    create_ring(&client, example, spec).await?;
    let mut sharder = files.start_process()?;
    let shard_kubeconfig =
        service_account_kubeconfig(cluster.kubeconfig(), example, "checksum-controller")?;
    let ring = RingRef::new(RingKind::ClusterRing, example);
    let start = |name: &str, timing: ShardTiming| {
        start_checksum_shard_as(&ring, example, name, timing, &shard_kubeconfig)
    };
    let mut shards = vec![
        start("shard-0", ShardTiming::RELAXED)?,
        start("shard-1", ShardTiming::RELAXED)?,
    ];
    wait_status(&client, example, 2, 2).await?;
    wait_webhook(&client, example, example, &["shard-0", "shard-1"]).await?;
    let names: Vec<String> = (0..60).map(|i| format!("s-{i}")).collect();
    create_secrets(&client, example, &names).await?;
    wait_secrets_on(&client, example, example, &["shard-0", "shard-1"]).await?;

    // A third shard: the objects it takes come through drains, none directly.
    let before = secret_shards(&client, example, example).await?;
    shards.push(start("shard-2", ShardTiming("4", "3", "0.5"))?);
    wait_status(&client, example, 3, 3).await?;
    wait_secrets_on(
        &client,
        example,
        example,
        &["shard-0", "shard-1", "shard-2"],
    )
    .await?;
    let after = secret_shards(&client, example, example).await?;
    let moved = after.iter().filter(|(n, s)| before[*n].0 != s.0).count();
    let metrics = files.metrics()?;
    let drains = counter_of(
        &metrics,
        "controller_sharding_drains_total",
        &ring,
        "secrets",
    )?;
    let moves = counter_of(
        &metrics,
        "controller_sharding_movements_total",
        &ring,
        "secrets",
    )?;
    ensure!(
        moved > 0 && drains == moved as u64 && moves == 0,
        "{moved} Secrets moved to the new shard with {drains} drains and {moves} direct moves"
    );

    // Killed, shard-2 stops renewing: the sharder takes its Lease over and moves its objects.
    shards[2].signal("KILL")?;
    let leases = Api::<Lease>::namespaced(client.clone(), example);
    poll_until("the sharder to take shard-2's Lease over", WAIT, || async {
        let lease = leases.get("shard-2").await?;
        let holder = lease.spec.and_then(|s| s.holder_identity);
        Ok((holder.as_deref() == Some(labels::IDENTITY_SHARD_LEASE_CONTROLLER)).then_some(()))
    })
    .await?;
    wait_secrets_on(&client, example, example, &["shard-0", "shard-1"]).await?;

    // A refused write surfaces as the `error` of a failure record (a failed sync, Lease or ring
    // reconcile): the API server's answer names the policy.
    let refused: Vec<_> = sharder
        .records()
        .into_iter()
        .filter(|r| {
            r["error"]
                .as_str()
                .is_some_and(|e| e.contains("ValidatingAdmissionPolicy"))
        })
        .collect();
    ensure!(
        refused.is_empty(),
        "an admission policy refused a write of the sharder: {refused:?}"
    );
    for shard in &mut shards {
        let _ = shard.terminate();
        shard.passed();
    }
    sharder.passed();
    Ok(())
}
