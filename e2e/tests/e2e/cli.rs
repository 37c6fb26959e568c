//! `kubectl sharding` (the `kubectl-sharding` binary) against the real API server and the shared
//! sharder. Every answer is compared with the test's own computation: [`IndependentRing`] for
//! the hash ring, keys spelled out from the protocol, and counts of the objects the test made.

use std::collections::BTreeMap;
use std::process::Output;

use anyhow::{Context, ensure};
use e2e::IndependentRing;
use e2e::fixtures::{
    WAIT, create_lease_of, create_ring_of, create_secrets, ring_of_kind_with_shards, ring_spec,
    ring_with_shards, secret, wait_dry_run_label, wait_labelled, wait_status_of, wait_webhook,
};
use e2e::process::{binary, poll_until};
use e2e::scenario::SharedScenario;
use e2e::{FIELD_MANAGER, cluster, unique_name};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::labels::{ANNOTATION_LEAVES_CONTROLLED_OBJECTS, ANNOTATION_WEIGHT};
use kube_sharding_api::{HashKey, RingKind, RingRef};
use serde_json::{Value, json};

/// What one run of `kubectl-sharding` printed.
struct Run {
    output: Output,
}

impl Run {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }

    /// The failure message, after checking the run failed.
    fn failure(&self) -> anyhow::Result<String> {
        ensure!(
            !self.output.status.success(),
            "expected a failure, got success with {}",
            self.stdout()
        );
        Ok(self.stderr())
    }
}

/// Runs `kubectl-sharding` with `args` against the test cluster, given by `--kubeconfig` as a
/// user would.
async fn kubectl_sharding(args: &[&str]) -> anyhow::Result<Run> {
    let output = tokio::process::Command::new(binary("kubectl-sharding")?)
        .arg("--kubeconfig")
        .arg(cluster().kubeconfig())
        .args(args)
        .env_remove("KUBECONFIG")
        .output()
        .await
        .context("failed to run kubectl-sharding")?;
    Ok(Run { output })
}

/// The answer of a successful run with `-o json`.
pub(crate) async fn json(args: &[&str]) -> anyhow::Result<Value> {
    let run = kubectl_sharding(&[args, &["-o", "json"]].concat()).await?;
    ensure!(
        run.output.status.success(),
        "kubectl-sharding {args:?} failed: {}",
        run.stderr()
    );
    serde_json::from_slice(&run.output.stdout).context("output is not JSON")
}

/// The text of a successful run with the default (table) output.
pub(crate) async fn table(args: &[&str]) -> anyhow::Result<String> {
    let run = kubectl_sharding(args).await?;
    ensure!(
        run.output.status.success(),
        "kubectl-sharding {args:?} failed: {}",
        run.stderr()
    );
    Ok(run.stdout())
}

/// Waits until the webhook of `ring` assigns a dry-run Secret in `namespace` as `predicted` says
/// (by object key): its configuration is in place and its view current.
async fn wait_assigns(
    client: &Client,
    namespace: &str,
    ring: &RingRef,
    predicted: &IndependentRing,
) -> anyhow::Result<()> {
    let expected = predicted.shard_for(&format!("/Secret/{namespace}/probe"));
    wait_dry_run_label(client, namespace, "probe", &ring.shard_label(), expected).await
}

/// A ring of `kind` over Secrets in a fresh namespace with self-held Leases of `shards`, Ready
/// and served by the webhook; returns the namespace, the ring and its independent hash ring.
async fn serving_ring(
    client: &Client,
    kind: RingKind,
    prefix: &str,
    shards: &[&str],
) -> anyhow::Result<(String, RingRef, IndependentRing)> {
    let (ns, ring) = ring_of_kind_with_shards(cluster(), client, kind, prefix, shards).await?;
    let count = i32::try_from(shards.len())?;
    wait_status_of(client, &ring, count, count).await?;
    let predicted = IndependentRing::unweighted(shards.iter().copied());
    wait_assigns(client, &ns, &ring, &predicted).await?;
    Ok((ns, ring, predicted))
}

/// A ConfigMap `name` whose controller is `owner` (a Secret when `owner_kind` is `Secret`).
fn configmap(name: &str, owner: Option<(&str, &str, String)>) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            owner_references: owner.map(|(kind, owner, uid)| {
                vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: kind.into(),
                    name: owner.into(),
                    uid,
                    controller: Some(true),
                    block_owner_deletion: None,
                }]
            }),
            ..Default::default()
        },
        ..Default::default()
    }
}

async fn annotate_lease(
    client: &Client,
    ns: &str,
    lease: &str,
    annotation: &str,
    value: &str,
) -> anyhow::Result<()> {
    let patch = json!({"metadata": {"annotations": {annotation: value}}});
    Api::<Lease>::namespaced(client.clone(), ns)
        .patch(lease, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// The ring of `kind` in a status answer.
fn ring_of<'a>(status: &'a Value, kind: &str) -> anyhow::Result<&'a Value> {
    status["rings"]
        .as_array()
        .and_then(|rings| rings.iter().find(|r| r["kind"] == kind))
        .with_context(|| format!("no {kind} in {status}"))
}

/// The member `shard` of a ring in a status answer.
fn member<'a>(ring: &'a Value, shard: &str) -> anyhow::Result<&'a Value> {
    ring["members"]
        .as_array()
        .and_then(|members| members.iter().find(|m| m["name"] == shard))
        .with_context(|| format!("no shard {shard} in {ring}"))
}

/// `max / mean` of `counts`, computed here for comparison.
#[allow(clippy::cast_precision_loss)]
fn max_over_mean(counts: &[usize]) -> f64 {
    let max = counts.iter().copied().max().unwrap_or(0) as f64;
    let mean = counts.iter().sum::<usize>() as f64 / counts.len() as f64;
    max / mean
}

/// `status` of a ClusterRing and a ControllerRing of the same name: shards with states, holders
/// and weights, objects per shard and resource as the independent rings predict, the orphan
/// ConfigMap as not sharded, and the imbalance; the same with `--kind`, `-n` and `-o yaml`.
#[tokio::test]
async fn status_reports_rings_of_both_kinds() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        ns,
        ..
    } = SharedScenario::in_namespace("cli-status").await?;
    let name = unique_name("cli-status");
    let cluster_ring = RingRef::new(RingKind::ClusterRing, &name);
    let controller_ring = RingRef::new(RingKind::ControllerRing, &name);
    create_ring_of(&client, &cluster_ring, ring_spec(&ns)).await?;
    create_ring_of(&client, &controller_ring, ring_spec(&ns)).await?;
    for shard in ["a", "b", "gone"] {
        create_lease_of(&client, &ns, &cluster_ring, shard, 3600).await?;
    }
    annotate_lease(&client, &ns, "b", ANNOTATION_WEIGHT, "2").await?;
    // A released Lease: its shard is dead and takes no objects.
    let release = json!({"spec": {"holderIdentity": ""}});
    Api::<Lease>::namespaced(client.clone(), &ns)
        .patch("gone", &PatchParams::default(), &Patch::Merge(&release))
        .await?;
    for shard in ["c", "d"] {
        create_lease_of(&client, &ns, &controller_ring, shard, 3600).await?;
    }
    // Every available shard of the ControllerRing leaves its controlled objects to the sharder;
    // one of the ClusterRing's two does.
    for shard in ["a", "c", "d"] {
        annotate_lease(
            &client,
            &ns,
            shard,
            ANNOTATION_LEAVES_CONTROLLED_OBJECTS,
            "true",
        )
        .await?;
    }
    wait_status_of(&client, &cluster_ring, 2, 3).await?;
    wait_status_of(&client, &controller_ring, 2, 2).await?;
    let cluster_predicted = IndependentRing::new([("a", 1), ("b", 2)]);
    let controller_predicted = IndependentRing::unweighted(["c", "d"]);
    wait_assigns(&client, &ns, &cluster_ring, &cluster_predicted).await?;
    wait_assigns(&client, &ns, &controller_ring, &controller_predicted).await?;

    let names: Vec<String> = (0..40).map(|i| format!("s-{i}")).collect();
    create_secrets(&client, &ns, &names).await?;
    let owner = Api::<Secret>::namespaced(client.clone(), &ns)
        .get("s-0")
        .await?;
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let child = configmap(
        "child",
        Some(("Secret", "s-0", owner.uid().unwrap_or_default())),
    );
    configmaps.create(&PostParams::default(), &child).await?;
    configmaps
        .create(&PostParams::default(), &configmap("orphan", None))
        .await?;
    let secret_names: Vec<&str> = names.iter().map(String::as_str).collect();
    for ring in [&cluster_ring, &controller_ring] {
        wait_labelled::<Secret>(&client, &ns, ring, &secret_names).await?;
        wait_labelled::<ConfigMap>(&client, &ns, ring, &["child"]).await?;
    }

    let status = json(&["status", &name]).await?;
    ensure!(
        status["rings"].as_array().map(Vec::len) == Some(2),
        "{status}"
    );
    // `KIND/NAME` as kubectl names it picks one of the two rings.
    for (arg, kind) in [
        (format!("clusterring/{name}"), "ClusterRing"),
        (
            format!("controllerrings.sharding.timebertt.dev/{name}"),
            "ControllerRing",
        ),
    ] {
        let one = json(&["status", &arg]).await?;
        let rings = one["rings"].as_array().context("rings")?;
        ensure!(
            rings.len() == 1 && rings[0]["kind"] == kind,
            "status {arg}: {one}"
        );
    }
    for (kind, predicted, shards) in [
        ("ClusterRing", &cluster_predicted, vec!["a", "b"]),
        ("ControllerRing", &controller_predicted, vec!["c", "d"]),
    ] {
        let ring = ring_of(&status, kind)?;
        ensure!(
            ring["name"] == name.as_str() && ring["ready"] == "True",
            "{ring}"
        );
        ensure!(ring["availableShards"] == 2, "{ring}");
        ensure!(
            ring["resources"] == json!(["secrets", "configmaps"]),
            "{ring}"
        );
        // The test's own count of Secrets per shard; the child ConfigMap follows s-0.
        let mut secrets: BTreeMap<&str, usize> = BTreeMap::new();
        for secret in &names {
            *secrets
                .entry(predicted.shard_for(&format!("/Secret/{ns}/{secret}")))
                .or_default() += 1;
        }
        let child_shard = predicted.shard_for(&format!("/Secret/{ns}/s-0"));
        for shard in &shards {
            let m = member(ring, shard)?;
            let want_secrets = secrets.get(shard).copied().unwrap_or(0);
            let want_configmaps = usize::from(child_shard == *shard);
            ensure!(
                m["objects"]["secrets"] == want_secrets
                    && m["objects"]["configmaps"].as_u64().unwrap_or(0) == want_configmaps as u64
                    && m["total"] == want_secrets + want_configmaps
                    && m["wanted"] == want_secrets + want_configmaps
                    && m["draining"] == 0,
                "{kind} shard {shard}: expected {want_secrets} Secrets and {want_configmaps} ConfigMaps: {m}"
            );
            ensure!(
                m["state"] == "ready" && m["holder"] == *shard && m["available"] == true,
                "{m}"
            );
            ensure!(m["renewTime"].is_string(), "{m}");
        }
        let counts: Vec<usize> = shards
            .iter()
            .map(|s| secrets.get(s).copied().unwrap_or(0) + usize::from(child_shard == *s))
            .collect();
        let imbalance = ring["imbalance"].as_f64().context("imbalance")?;
        ensure!(
            (imbalance - max_over_mean(&counts)).abs() < 1e-9,
            "{kind} imbalance {imbalance}, expected {}",
            max_over_mean(&counts)
        );
        ensure!(
            ring["totals"]
                == json!({"objects": 42, "assigned": 41, "draining": 0, "unassigned": 1, "misplaced": 0}),
            "{ring}"
        );
        ensure!(
            ring["unassigned"]
                == json!({"objects": {"configmaps": 1}, "total": 1, "waitingForSharder": 0, "notSharded": 1, "noAvailableShard": 0}),
            "{ring}"
        );
    }
    let cluster_status = ring_of(&status, "ClusterRing")?;
    ensure!(member(cluster_status, "b")?["weight"] == 2);
    let gone = member(cluster_status, "gone")?;
    ensure!(
        gone["state"] == "dead" && gone["available"] == false && gone["total"] == 0,
        "{gone}"
    );
    ensure!(cluster_status["shards"] == 3, "{cluster_status}");
    ensure!(
        cluster_status["shardsLeaveControlledObjects"] == false
            && member(cluster_status, "a")?["leavesControlledObjects"] == true
            && member(cluster_status, "b")?["leavesControlledObjects"] == false,
        "{cluster_status}"
    );
    let controller_status = ring_of(&status, "ControllerRing")?;
    ensure!(
        controller_status["shardsLeaveControlledObjects"] == true,
        "{controller_status}"
    );

    // One kind, one namespace, YAML: the same counts.
    let run = kubectl_sharding(&[
        "status",
        &name,
        "--kind",
        "ControllerRing",
        "-n",
        &ns,
        "-o",
        "yaml",
    ])
    .await?;
    ensure!(run.output.status.success(), "{}", run.stderr());
    let yaml: Value = serde_yaml::from_slice(&run.output.stdout)?;
    ensure!(yaml["namespace"] == ns.as_str(), "{yaml}");
    ensure!(yaml["rings"].as_array().map(Vec::len) == Some(1), "{yaml}");
    ensure!(yaml["rings"][0] == *ring_of(&status, "ControllerRing")?);

    let text = table(&["status", &name]).await?;
    eprintln!("{text}");
    ensure!(
        text.contains(&format!(
            "ClusterRing {name}: Ready=True, 3 shards, 2 available, hashKey Object, assignment Webhook"
        )),
        "{text}"
    );
    ensure!(
        text.contains("SECRETS") && text.contains("(unassigned)"),
        "{text}"
    );
    ensure!(
        text.contains("controlled objects: 1 of 2 available shards leave them to the sharder")
            && text
                .contains("controlled objects: every available shard leaves them to the sharder"),
        "{text}"
    );

    // Both kinds have a ring of this name: simulate wants to be told which.
    let ambiguous = kubectl_sharding(&["simulate", &name, "--add-shard", "e"]).await?;
    ensure!(ambiguous.failure()?.contains("choose one with --kind"));
    logs.passed();
    Ok(())
}

/// `explain` of objects in every situation the ring knows, each compared with the independent
/// ring: in place, controlled, without a controller, with a foreign controller, outside the
/// selected namespaces, being drained, without an available shard, and created with
/// generateName in a ring hashed by namespace.
#[tokio::test]
async fn explain_says_where_and_why() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        cluster,
        client,
        ..
    } = SharedScenario::open().await?;
    let (ns, ring, three) = serving_ring(
        &client,
        RingKind::ClusterRing,
        "cli-explain",
        &["a", "b", "c"],
    )
    .await?;
    let four = IndependentRing::unweighted(["a", "b", "c", "d"]);
    let names: Vec<String> = (0..30).map(|i| format!("m-{i}")).collect();
    create_secrets(&client, &ns, &names).await?;
    let key_of = |secret: &str| format!("/Secret/{ns}/{secret}");
    // One Secret that moves to d once d joins, one that stays where it is.
    let mover = names
        .iter()
        .find(|n| four.shard_for(&key_of(n)) == "d")
        .context("a Secret that moves to d")?;
    let stayer = names
        .iter()
        .find(|n| four.shard_for(&key_of(n)) == three.shard_for(&key_of(n)))
        .context("a Secret that stays")?;
    let secret_uid = Api::<Secret>::namespaced(client.clone(), &ns)
        .get(stayer)
        .await?
        .uid()
        .unwrap_or_default();
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    configmaps
        .create(
            &PostParams::default(),
            &configmap("child", Some(("Secret", stayer, secret_uid))),
        )
        .await?;
    let orphan = configmaps
        .create(&PostParams::default(), &configmap("orphan", None))
        .await?;
    // Owned by an existing ConfigMap, so the garbage collector keeps it; but the ring lists only
    // Secrets as controllers of ConfigMaps.
    configmaps
        .create(
            &PostParams::default(),
            &configmap(
                "foreign",
                Some(("ConfigMap", "orphan", orphan.uid().unwrap_or_default())),
            ),
        )
        .await?;

    // The explanation in our ring (other tests' rings cover Secrets too, in their namespaces).
    let explain = |resource: &'static str, object: String, namespace: String| {
        let ring = ring.name.clone();
        async move {
            let answer = json(&["explain", resource, &object, "-n", &namespace]).await?;
            answer["rings"]
                .as_array()
                .and_then(|rings| rings.iter().find(|r| r["ring"] == ring.as_str()))
                .cloned()
                .with_context(|| format!("ring {ring} missing in {answer}"))
        }
    };
    let placed = explain("secret", stayer.clone(), ns.clone()).await?;
    // kubectl's other spellings of the same object get the same answer.
    for resource in [format!("secret/{stayer}"), format!("secrets.v1./{stayer}")] {
        let answer = json(&["explain", &resource, "-n", &ns]).await?;
        let same = answer["rings"]
            .as_array()
            .and_then(|rings| rings.iter().find(|r| r["ring"] == ring.name.as_str()));
        ensure!(same == Some(&placed), "explain {resource}: {answer}");
    }
    let placed_shard = three.shard_for(&key_of(stayer));
    ensure!(
        placed["verdict"] == "InPlace"
            && placed["key"] == key_of(stayer).as_str()
            && placed["desiredShard"] == placed_shard
            && placed["shardLabel"]["key"] == ring.shard_label().as_str()
            && placed["shardLabel"]["value"] == placed_shard
            && placed["drainLabel"]["key"] == ring.drain_label().as_str()
            && placed["drainLabel"]["value"].is_null()
            && placed["ringKind"] == "ClusterRing"
            && placed["role"] == "main",
        "{placed}"
    );
    // kubectl's other spellings of the resource reach the same object.
    for spelling in ["secrets", "Secret"] {
        ensure!(explain(spelling, stayer.clone(), ns.clone()).await? == placed);
    }
    let child = explain("cm", "child".into(), ns.clone()).await?;
    ensure!(
        child["verdict"] == "InPlace"
            && child["role"] == "controlled"
            && child["key"] == key_of(stayer).as_str()
            && child["desiredShard"] == placed_shard,
        "{child}"
    );
    let orphan = explain("configmaps", "orphan".into(), ns.clone()).await?;
    ensure!(
        orphan["verdict"] == "NoController"
            && orphan["key"].is_null()
            && orphan["shardLabel"]["value"].is_null(),
        "{orphan}"
    );
    let foreign = explain("configmap", "foreign".into(), ns.clone()).await?;
    ensure!(
        foreign["verdict"] == "ForeignController"
            && foreign["reason"]
                .as_str()
                .is_some_and(|r| r.contains("its controller is a ConfigMap")),
        "{foreign}"
    );

    // A namespace the ring does not select.
    let other = cluster.namespace(&client, "cli-explain-other").await?;
    create_secrets(&client, &other, &["outside".to_string()]).await?;
    let outside = explain("secrets", "outside".into(), other.clone()).await?;
    ensure!(
        outside["verdict"] == "NamespaceNotSelected"
            && outside["desiredShard"].is_null()
            && outside["reason"]
                .as_str()
                .is_some_and(|r| r.contains(&format!("namespace {other} is not selected"))),
        "{outside}"
    );

    // d joins; the test plays the shards and never acknowledges, so the mover stays draining.
    create_lease_of(&client, &ns, &ring, "d", 3600).await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    poll_until("the mover carries the drain label", WAIT, || async {
        let s = secrets.get(mover).await?;
        Ok(s.labels().contains_key(&ring.drain_label()).then_some(()))
    })
    .await?;
    let draining = explain("secret", mover.clone(), ns.clone()).await?;
    ensure!(
        draining["verdict"] == "Draining"
            && draining["desiredShard"] == "d"
            && draining["shardLabel"]["value"] == three.shard_for(&key_of(mover))
            && draining["drainLabel"]["value"] == "true",
        "{draining}"
    );
    let still = explain("secret", stayer.clone(), ns.clone()).await?;
    ensure!(still["verdict"] == "InPlace", "{still}");
    eprintln!("{}", table(&["explain", "secret", mover, "-n", &ns]).await?);

    // A ControllerRing hashed by namespace, first without shards, then with one.
    let by_ns = cluster.namespace(&client, "cli-explain-ns").await?;
    let ns_ring = RingRef::new(RingKind::ControllerRing, unique_name("cli-explain-ns"));
    let mut spec = ring_spec(&by_ns);
    spec.hash_key = Some(HashKey::Namespace);
    create_ring_of(&client, &ns_ring, spec).await?;
    wait_status_of(&client, &ns_ring, 0, 0).await?;
    create_secrets(&client, &by_ns, &["early".to_string()]).await?;
    let explain_in = |resource: &'static str, object: String| {
        let (ring, namespace) = (ns_ring.name.clone(), by_ns.clone());
        async move {
            let answer = json(&["explain", resource, &object, "-n", &namespace]).await?;
            answer["rings"]
                .as_array()
                .and_then(|rings| rings.iter().find(|r| r["ring"] == ring.as_str()))
                .cloned()
                .with_context(|| format!("ring {ring} missing in {answer}"))
        }
    };
    let early = explain_in("secret", "early".into()).await?;
    ensure!(
        early["verdict"] == "NoAvailableShard"
            && early["key"] == format!("/Namespace//{by_ns}").as_str()
            && early["desiredShard"].is_null()
            && early["hashKey"] == "Namespace",
        "{early}"
    );
    create_lease_of(&client, &by_ns, &ns_ring, "only", 3600).await?;
    wait_status_of(&client, &ns_ring, 1, 1).await?;
    let generated = Secret {
        metadata: ObjectMeta {
            generate_name: Some("gen-".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let api = Api::<Secret>::namespaced(client.clone(), &by_ns);
    let generated = poll_until(
        "a generateName Secret assigned by namespace",
        WAIT,
        || async {
            let created = api.create(&PostParams::default(), &generated).await?;
            if created.labels().contains_key(&ns_ring.shard_label()) {
                return Ok(Some(created.name_any()));
            }
            // Created before the webhook saw the shard; try again with a fresh one.
            api.delete(&created.name_any(), &DeleteParams::default())
                .await?;
            Ok(None)
        },
    )
    .await?;
    let gen_explained = explain_in("secret", generated).await?;
    ensure!(
        gen_explained["verdict"] == "InPlace"
            && gen_explained["desiredShard"] == "only"
            && gen_explained["key"] == format!("/Namespace//{by_ns}").as_str()
            && gen_explained["notes"]
                .as_array()
                .is_some_and(|notes| notes.iter().any(|n| n
                    .as_str()
                    .is_some_and(|n| n.contains("generateName \"gen-\"")))),
        "{gen_explained}"
    );

    // Errors a user meets: an unknown resource, an unknown object, an unknown ring.
    let unknown_resource = kubectl_sharding(&["explain", "gadgets", "x", "-n", &ns]).await?;
    ensure!(
        unknown_resource
            .failure()?
            .contains("the server doesn't have a resource type \"gadgets\"")
    );
    let unknown_object = kubectl_sharding(&["explain", "secret", "missing", "-n", &ns]).await?;
    let message = unknown_object.failure()?;
    ensure!(
        message.contains(&format!(
            "secrets \"missing\" not found in namespace \"{ns}\""
        )),
        "{message}"
    );
    let unknown_ring = kubectl_sharding(&["status", "no-such-ring"]).await?;
    ensure!(
        unknown_ring
            .failure()?
            .contains("no ClusterRing or ControllerRing named \"no-such-ring\"")
    );
    let unknown_kind =
        kubectl_sharding(&["status", &ring.name, "--kind", "ControllerRing"]).await?;
    let message = unknown_kind.failure()?;
    ensure!(
        message.contains(&format!("ControllerRing \"{}\" not found", ring.name)),
        "{message}"
    );
    logs.passed();
    Ok(())
}

/// `simulate` adding a shard, and removing one while adding a weighted one: the moves between
/// every pair of shards equal the independent rings' difference, and nothing is written.
#[tokio::test]
async fn simulate_predicts_moves_without_writing() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs, client, ..
    } = SharedScenario::open().await?;
    let (ns, ring, now) = serving_ring(
        &client,
        RingKind::ControllerRing,
        "cli-simulate",
        &["a", "b", "c"],
    )
    .await?;
    let names: Vec<String> = (0..90).map(|i| format!("s-{i}")).collect();
    create_secrets(&client, &ns, &names).await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let versions = || async {
        let list = secrets.list_metadata(&ListParams::default()).await?;
        anyhow::Ok(
            list.items
                .iter()
                .map(|s| (s.name_any(), s.resource_version()))
                .collect::<BTreeMap<_, _>>(),
        )
    };
    let before = versions().await?;

    for (args, after) in [
        (
            vec!["--add-shard", "d"],
            IndependentRing::unweighted(["a", "b", "c", "d"]),
        ),
        (
            vec!["--remove-shard", "b", "--add-shard", "e:2"],
            IndependentRing::new([("a", 1), ("c", 1), ("e", 2)]),
        ),
    ] {
        let mut command = vec!["simulate", ring.name.as_str(), "--kind", "ControllerRing"];
        command.extend(&args);
        let answer = json(&command).await?;
        let mut expected: BTreeMap<(String, String), u64> = BTreeMap::new();
        let mut per_shard: BTreeMap<String, (u64, u64, u64, u64)> = BTreeMap::new();
        for name in &names {
            let key = format!("/Secret/{ns}/{name}");
            let (from, to) = (now.shard_for(&key), after.shard_for(&key));
            per_shard.entry(from.into()).or_default().0 += 1;
            per_shard.entry(to.into()).or_default().3 += 1;
            if from != to {
                *expected.entry((from.into(), to.into())).or_default() += 1;
                per_shard.entry(from.into()).or_default().1 += 1;
                per_shard.entry(to.into()).or_default().2 += 1;
            }
        }
        let moves: BTreeMap<(String, String), u64> = answer["moves"]
            .as_array()
            .context("moves")?
            .iter()
            .map(|m| {
                (
                    (
                        m["from"].as_str().unwrap_or_default().to_string(),
                        m["to"].as_str().unwrap_or_default().to_string(),
                    ),
                    m["objects"].as_u64().unwrap_or_default(),
                )
            })
            .collect();
        ensure!(!expected.is_empty(), "{args:?} moves something");
        ensure!(
            moves == expected,
            "{args:?}: moves {moves:?}, predicted {expected:?}"
        );
        ensure!(answer["totalMoves"] == expected.values().sum::<u64>());
        ensure!(
            answer["objects"] == names.len() && answer["unsettled"] == 0,
            "{answer}"
        );
        for shard in answer["shards"].as_array().context("shards")? {
            let name = shard["name"].as_str().unwrap_or_default();
            let (objects, out, into, after) = per_shard.get(name).copied().unwrap_or_default();
            ensure!(
                shard["objectsBefore"] == objects
                    && shard["movesOut"] == out
                    && shard["movesIn"] == into
                    && shard["objectsAfter"] == after,
                "{args:?}: shard {shard}, predicted {:?}",
                (objects, out, into, after)
            );
        }
        eprintln!("{}", table(&command).await?);
    }
    ensure!(versions().await? == before, "simulate changed Secrets");

    let wrong = kubectl_sharding(&["simulate", &ring.name, "--remove-shard", "x"]).await?;
    ensure!(wrong.failure()?.contains(&format!(
        "shard x is not an available shard of ControllerRing/{}",
        ring.name
    )));
    logs.passed();
    Ok(())
}

/// A user without the permissions `status` needs is told which one is missing.
#[tokio::test]
async fn missing_permissions_are_named() -> anyhow::Result<()> {
    let cluster = cluster();
    let client = cluster.client().await?;
    let (_, ring) =
        ring_of_kind_with_shards(cluster, &client, RingKind::ClusterRing, "cli-rbac", &[]).await?;
    let user = unique_name("cli-viewer");
    let status = [
        "status",
        ring.name.as_str(),
        "--kind",
        "ClusterRing",
        "--as",
        user.as_str(),
    ];
    let nothing = kubectl_sharding(&status).await?;
    let message = nothing.failure()?;
    ensure!(
        message.contains("forbidden: kubectl sharding needs permission to get clusterrings.sharding.timebertt.dev"),
        "{message}"
    );

    // Rings but no Leases: the next missing permission is named.
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": user},
        "rules": [{
            "apiGroups": ["sharding.timebertt.dev"],
            "resources": ["clusterrings", "controllerrings"],
            "verbs": ["get", "list"],
        }],
    }))?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": user},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": user},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }))?;
    let roles = Api::<ClusterRole>::all(client.clone());
    let bindings = Api::<ClusterRoleBinding>::all(client.clone());
    let apply = PatchParams::apply(FIELD_MANAGER);
    roles.patch(&user, &apply, &Patch::Apply(&role)).await?;
    bindings
        .patch(&user, &apply, &Patch::Apply(&binding))
        .await?;
    // With the ring readable, its Leases are the next thing read.
    let result = poll_until("the Lease permission named", WAIT, || async {
        let message = kubectl_sharding(&status).await?.failure()?;
        Ok(message
            .contains("needs permission to list leases.coordination.k8s.io in all namespaces")
            .then_some(()))
    })
    .await;
    let _ = roles.delete(&user, &DeleteParams::default()).await;
    let _ = bindings.delete(&user, &DeleteParams::default()).await;
    result
}

/// `explain` says which pin decided an object's shard, or why it did not; `simulate` keeps a
/// pinned object on its shard and counts pins (docs/protocol.md §21).
#[tokio::test]
async fn explain_and_simulate_know_pins() -> anyhow::Result<()> {
    let SharedScenario {
        mut logs,
        client,
        cluster,
        ..
    } = SharedScenario::open().await?;
    let shards = ["a", "b", "c"];
    let (ns, ring) = ring_with_shards(cluster, &client, "cli-pins", &shards).await?;
    wait_webhook(&client, &ns, &ring, &shards).await?;
    let three = IndependentRing::unweighted(shards);
    let pin = kube_sharding_api::labels::pin_annotation(&ring);
    let name = (0..)
        .map(|i| format!("pinned-{i}"))
        .find(|n| three.shard_for(&format!("/Secret/{ns}/{n}")) != "b")
        .expect("a name off b");
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    for (object, value) in [(name.as_str(), "b"), ("waiting", "z")] {
        let mut secret = secret(object);
        secret.metadata.annotations = Some([(pin.clone(), value.to_string())].into());
        secrets.create(&PostParams::default(), &secret).await?;
    }
    let explained = |object: String| {
        let (ring, ns) = (ring.clone(), ns.clone());
        async move {
            let answer = json(&["explain", "secret", &object, "-n", &ns]).await?;
            answer["rings"]
                .as_array()
                .and_then(|rings| rings.iter().find(|r| r["ring"] == ring.as_str()))
                .cloned()
                .with_context(|| format!("ring {ring} missing in {answer}"))
        }
    };
    let pinned = explained(name.clone()).await?;
    ensure!(
        pinned["desiredShard"] == "b"
            && pinned["pin"]["source"] == "object"
            && pinned["pin"]["state"] == "honoured"
            && pinned["pin"]["annotation"] == pin.as_str(),
        "{pinned}"
    );
    let waiting = explained("waiting".into()).await?;
    ensure!(
        waiting["pin"]["state"] == "unavailable"
            && waiting["desiredShard"] == three.shard_for(&format!("/Secret/{ns}/waiting")),
        "{waiting}"
    );
    let text = table(&["explain", "secret", &name, "-n", &ns]).await?;
    ensure!(text.contains("honoured"), "{text}");

    // Adding shard z satisfies the waiting pin; removing b leaves the other to the ring.
    let simulated = json(&[
        "simulate",
        &ring,
        "--kind",
        "ClusterRing",
        "--add-shard",
        "z",
        "--remove-shard",
        "b",
        "-n",
        &ns,
    ])
    .await?;
    ensure!(
        simulated["pinned"] == 2
            && simulated["pinsUnsatisfiedBefore"] == 1
            && simulated["pinsUnsatisfiedAfter"] == 1,
        "{simulated}"
    );
    logs.passed();
    Ok(())
}
