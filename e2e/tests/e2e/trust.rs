//! Who may join a ring and what the sharder's identity may write (README "Security"): the ring's
//! namespace allow-list for shard Leases, enforced by the sharder; the admission policies of
//! `config/admission-policies`, enforced by the API server; webhook configurations the sharder
//! did not write.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use e2e::fixtures::{
    WAIT, create_lease, create_ring, create_ring_of, lease_warnings, ring_spec, secret,
    wait_status, wait_status_of, wait_webhook,
};
use e2e::process::poll_until;
use e2e::scenario::SharedScenario;
use e2e::{serves_admission_policies, unique_name};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;
use sharding_crds::{
    ClusterRing, ClusterRingSpec, ControllerRing, RingKind, RingObject, RingRef, labels,
};

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
    cluster.apply_yaml(&config_file(
        "admission-policies/shard_lease_policies.yaml",
    )?)?;
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

/// The shipped policy for the sharder's identity (installed here for a ServiceAccount of the
/// test's namespace, so the shared sharder is not affected): with the shipped ClusterRole it
/// could create any webhook configuration and write any Lease; the policy lets it write only
/// webhook configurations named like its own that call the sharder's Service, and only shard
/// Leases, keeping their ring labels.
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
    let config = |name: &str, client_config: serde_json::Value| -> anyhow::Result<_> {
        Ok(serde_json::from_value::<MutatingWebhookConfiguration>(
            json!({
                "metadata": {"name": name},
                "webhooks": [{
                    "name": "sharder.sharding.timebertt.dev",
                    "clientConfig": client_config,
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                    "failurePolicy": "Ignore",
                    "objectSelector": {"matchLabels": {"never": "matches"}},
                }],
            }),
        )?)
    };
    let service =
        json!({"service": {"namespace": "sharding-system", "name": "sharder", "path": "/x"}});
    let mine = format!("controllerring-{}", unique_name("p"));
    let refused = "its own webhook configurations";
    poll_until(
        "the policy to refuse a webhook configuration with a URL",
        WAIT,
        || async {
            let url = json!({"url": "https://127.0.0.1:1/x"});
            let result = configs
                .create(&PostParams::default(), &config(&mine, url)?)
                .await;
            if result.is_ok() {
                // Created before the API server loaded the policy.
                Api::<MutatingWebhookConfiguration>::all(client.clone())
                    .delete(&mine, &Default::default())
                    .await?;
            }
            Ok(forbidden(result, refused).ok())
        },
    )
    .await?;
    forbidden(
        configs
            .create(
                &PostParams::default(),
                &config(&unique_name("foreign"), service.clone())?,
            )
            .await,
        refused,
    )?;
    let other_service = json!({"service": {"namespace": ns, "name": "sharder", "path": "/x"}});
    forbidden(
        configs
            .create(&PostParams::default(), &config(&mine, other_service)?)
            .await,
        refused,
    )?;
    configs
        .create(&PostParams::default(), &config(&mine, service.clone())?)
        .await
        .context("the sharder's own kind of webhook configuration was refused")?;
    // Deleting: its own kind yes (a ring switched to `assignment: Watch`), anyone else's no.
    configs
        .delete(&mine, &Default::default())
        .await
        .context("the sharder may delete its own kind of webhook configuration")?;
    let foreign = unique_name("foreign");
    let admin_configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    admin_configs
        .create(&PostParams::default(), &config(&foreign, service.clone())?)
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
