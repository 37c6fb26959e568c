//! The product in a real cluster, driven only with `kubectl` and the API as a user would: images
//! built from the repository's Dockerfiles, installed with `kubectl apply -k`, the example ring
//! scaled with `kubectl scale`, shard pods force-deleted, the sharder restarted and evicted. See
//! [`e2e::in_cluster`] for the cluster (a control plane with a real node).
//!
//! The tests share one installation and take turns ([`TURN`]); each first brings the cluster to
//! the state it starts from (installed, the example ring of a kind with a number of shards), so
//! they pass in any order. Without root they print why and pass without checking anything.

mod autoscaling;
mod ownership;
mod release;
mod stable;
mod upgrade;

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use e2e::IndependentRing;
use e2e::docs::{DocBlock, EXAMPLE_RING, PINS, UNINSTALL, WITHOUT_CERT_MANAGER, shell_block};
use e2e::in_cluster::{InCluster, OnFailure, eventually, in_cluster, workspace_root};
use e2e::metrics_access::METRICS_READER;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::Client;
use kube::api::{Api, EvictParams, Patch, PatchParams, PostParams};
use kube_sharding_api::RingKind;
use serde_json::{Value, json};
use tokio::sync::Mutex;

use crate::ownership::ShardLogs;

/// One test at a time: they share the installation.
pub(crate) static TURN: Mutex<()> = Mutex::const_new(());
pub(crate) static INSTALLED: AtomicBool = AtomicBool::new(false);

pub(crate) const SYSTEM: &str = "sharding-system";
pub(crate) const SHARDS_NAMESPACE: &str = "checksum-controller";
pub(crate) const RING: &str = "checksum-controller";
pub(crate) const SHARD_SELECTOR: &str = "app.kubernetes.io/name=checksum-controller";
pub(crate) const SHARDER_SELECTOR: &str = "app.kubernetes.io/component=sharder";
/// The example shards' Lease duration (checksum-controller's default).
const LEASE_DURATION: Duration = Duration::from_secs(15);

/// A documented block as the install page says to run it against this cluster:
/// on an API server older than 1.30 with the `config/overlays/k8s-1.29/` variant of each install
/// (the same install without the admission policies, which 1.29 cannot serve), saying so.
fn doc_block_for(c: &InCluster, (page, heading): DocBlock) -> anyhow::Result<String> {
    let block = shell_block((page, heading))?;
    if admission_policies_served(c)? {
        return Ok(block);
    }
    let lines: Vec<String> = block
        .lines()
        .map(|line| {
            let old = ["config/overlays/no-cert-manager", "config/default"]
                .into_iter()
                .find(|install| line.contains(&format!("-k {install}")));
            match old {
                Some(install) => {
                    let variant = format!(
                        "config/overlays/k8s-1.29/{}",
                        install.rsplit('/').next().unwrap_or(install)
                    );
                    let changed = line.replace(install, &variant);
                    println!("note: on this API server, {heading:?} runs {changed:?}");
                    changed
                }
                None => line.to_string(),
            }
        })
        .collect();
    Ok(lines.join("\n"))
}

/// Whether the API server serves what `config/admission-policies` needs (1.30 or newer); asked
/// once, since a test process has one cluster.
pub(crate) fn admission_policies_served(c: &InCluster) -> anyhow::Result<bool> {
    static MINOR: OnceLock<u32> = OnceLock::new();
    let minor = match MINOR.get() {
        Some(minor) => *minor,
        None => {
            let version = c.kubectl_json(&["version"])?;
            let minor = e2e::parse_server_minor(
                version["serverVersion"]["minor"]
                    .as_str()
                    .with_context(|| format!("no server minor version in {version}"))?,
            )?;
            *MINOR.get_or_init(|| minor)
        }
    };
    Ok(minor >= e2e::ADMISSION_POLICIES_MIN_SERVER_MINOR)
}

/// A scratch directory with `config/` and `deploy/` of the checkout, where the documented commands
/// run as in a clone without leaving files in it. It lives in the cluster's directory, which goes
/// with the cluster when the test process ends, and the CA keys the install writes with it.
pub(crate) fn scratch_dir(c: &InCluster, name: &str) -> anyhow::Result<std::path::PathBuf> {
    let dir = c.state_dir().join(format!("scratch-{name}"));
    std::fs::create_dir_all(&dir)?;
    for sub in ["config", "deploy"] {
        let link = dir.join(sub);
        if !link.exists() {
            std::os::unix::fs::symlink(workspace_root().join(sub), &link)?;
        }
    }
    Ok(dir)
}

/// Installs the sharder with the "Without cert-manager" commands of docs/install-kustomize.md,
/// once.
pub(crate) fn ensure_installed(c: &InCluster) -> anyhow::Result<()> {
    if INSTALLED.load(Ordering::SeqCst) {
        return Ok(());
    }
    let script = doc_block_for(c, WITHOUT_CERT_MANAGER)?;
    c.shell(&script, &scratch_dir(c, "install")?)?;
    c.kubectl(&[
        "-n",
        SYSTEM,
        "rollout",
        "status",
        "deployment",
        "sharder",
        "--timeout=120s",
    ])?;
    INSTALLED.store(true, Ordering::SeqCst);
    Ok(())
}

/// The example directory of a ring kind.
fn example_dir(kind: RingKind) -> &'static str {
    match kind {
        RingKind::ClusterRing => "deploy",
        RingKind::ControllerRing => "deploy/controllerring",
    }
}

fn ring_resource(kind: RingKind) -> &'static str {
    match kind {
        RingKind::ClusterRing => "clusterring",
        RingKind::ControllerRing => "controllerring",
    }
}

/// The example of `kind` installed with `kubectl apply -k`, the other kind's removed, scaled to
/// `replicas` shards, all available in the ring.
pub(crate) async fn ensure_example(
    c: &InCluster,
    kind: RingKind,
    replicas: u32,
) -> anyhow::Result<()> {
    let other = match kind {
        RingKind::ClusterRing => RingKind::ControllerRing,
        RingKind::ControllerRing => RingKind::ClusterRing,
    };
    // The StatefulSet variant (deploy/statefulset, left by its test) runs the same shards.
    c.kubectl(&[
        "-n",
        SHARDS_NAMESPACE,
        "delete",
        "statefulset",
        "checksum-controller",
        "--ignore-not-found",
        "--wait=true",
    ])?;
    // Both examples share the shards' namespace and Deployment: drop only the other ring, and
    // apply this example (which rolls the shards over to this kind when they ran the other).
    // Foreground: kubectl returns once the ring's webhook configuration is gone too (it blocks
    // the ring's deletion), so no CREATE of this test still goes to the deleted ring's webhook
    // and fails open there.
    c.kubectl(&[
        "delete",
        ring_resource(other),
        RING,
        "--ignore-not-found",
        "--cascade=foreground",
        "--wait=true",
    ])?;
    let other_webhooks = format!("sharding-{}-", ring_resource(other));
    eventually(
        "the other ring's webhook configuration gone",
        Duration::from_secs(60),
        || {
            let names = c.kubectl(&["get", "mutatingwebhookconfigurations", "-o", "name"])?;
            Ok((!names.contains(&other_webhooks)).then_some(()))
        },
    )
    .await?;
    // The API server calls webhooks from its own cache of their configurations, which follows
    // the deletion a moment later.
    tokio::time::sleep(Duration::from_secs(2)).await;
    c.kubectl(&["apply", "-k", example_dir(kind)])?;
    c.kubectl(&[
        "-n",
        SHARDS_NAMESPACE,
        "scale",
        "deployment",
        "checksum-controller",
        &format!("--replicas={replicas}"),
    ])?;
    c.kubectl(&[
        "-n",
        SHARDS_NAMESPACE,
        "rollout",
        "status",
        "deployment",
        "checksum-controller",
        "--timeout=120s",
    ])?;
    wait_ring(c, kind, replicas).await
}

/// Waits until the ring is Ready with `available` available shards and exactly that many running
/// shard pods.
pub(crate) async fn wait_ring(c: &InCluster, kind: RingKind, available: u32) -> anyhow::Result<()> {
    eventually(
        &format!(
            "{} {RING} Ready with {available} available shards",
            ring_resource(kind)
        ),
        Duration::from_secs(60),
        || {
            let ring = c.kubectl_json(&["get", ring_resource(kind), RING])?;
            let ready = ring["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            });
            let count = ring["status"]["availableShards"]
                .as_u64()
                .unwrap_or_default();
            let pods = shard_pods(c)?;
            Ok(
                (ready && count == u64::from(available) && pods.len() == available as usize)
                    .then_some(()),
            )
        },
    )
    .await
}

/// Names of the shard pods that run and are not terminating.
pub(crate) fn shard_pods(c: &InCluster) -> anyhow::Result<Vec<String>> {
    let list = c.kubectl_json(&["-n", SHARDS_NAMESPACE, "get", "pods", "-l", SHARD_SELECTOR])?;
    Ok(pods_running(&list))
}

pub(crate) fn pods_running(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
                .filter(|p| p["status"]["phase"] == "Running")
                .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// A namespace of the ring (labelled for its selector) with `count` Secrets created through the
/// API; returns its name and whether every create's response already carried a shard label (set
/// in admission by the webhook).
pub(crate) async fn namespace_with_secrets(
    client: &Client,
    kind: RingKind,
    prefix: &str,
    count: usize,
) -> anyhow::Result<(String, usize)> {
    let name = e2e::unique_name(prefix);
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"checksum-controller": "enabled"}}
    }))?;
    namespaces.create(&PostParams::default(), &ns).await?;
    let labelled = create_secrets(client, kind, &name, 0..count).await?;
    Ok((name, labelled))
}

/// Creates Secrets `s-<i>` in `namespace`; how many came back from the API server labelled.
pub(crate) async fn create_secrets(
    client: &Client,
    kind: RingKind,
    namespace: &str,
    range: std::ops::Range<usize>,
) -> anyhow::Result<usize> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let label = kind.shard_label(RING);
    let mut labelled = 0;
    for i in range {
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": format!("s-{i}")},
            "stringData": {"value": format!("secret {i}")},
        }))?;
        let created = secrets
            .create(&PostParams::default(), &secret)
            .await
            .with_context(|| format!("failed to create Secret {namespace}/s-{i}"))?;
        if created
            .metadata
            .labels
            .is_some_and(|l| l.contains_key(&label))
        {
            labelled += 1;
        }
    }
    Ok(labelled)
}

/// Waits until every Secret in `namespace` carries the shard the independent ring of the running
/// shard pods gives it, no drain label, and its checksum ConfigMap exists on the same shard;
/// returns the assignment (Secret name to shard).
pub(crate) async fn wait_converged(
    c: &InCluster,
    kind: RingKind,
    namespace: &str,
    timeout: Duration,
) -> anyhow::Result<BTreeMap<String, String>> {
    let shard_label = kind.shard_label(RING);
    let drain_label = kind.drain_label(RING);
    eventually(
        &format!("every Secret in {namespace} on its shard with its ConfigMap"),
        timeout,
        || {
            let pods = shard_pods(c)?;
            let ring = IndependentRing::unweighted(pods.iter().map(String::as_str));
            let secrets = c.kubectl_json(&["-n", namespace, "get", "secrets"])?;
            let config_maps = c.kubectl_json(&["-n", namespace, "get", "configmaps"])?;
            let cm_shards: BTreeMap<&str, &str> = items(&config_maps)
                .iter()
                .filter_map(|cm| {
                    Some((
                        cm["metadata"]["name"].as_str()?,
                        cm["metadata"]["labels"][&shard_label]
                            .as_str()
                            .unwrap_or_default(),
                    ))
                })
                .collect();
            let mut assignment = BTreeMap::new();
            for secret in items(&secrets) {
                let name = secret["metadata"]["name"].as_str().unwrap_or_default();
                let labels = &secret["metadata"]["labels"];
                let shard = labels[&shard_label].as_str().unwrap_or_default();
                let expected = ring.shard_for(&format!("/Secret/{namespace}/{name}"));
                if shard != expected
                    || !labels[&drain_label].is_null()
                    || cm_shards.get(format!("checksums-{name}").as_str()) != Some(&expected)
                {
                    return Ok(None);
                }
                assignment.insert(name.to_string(), shard.to_string());
            }
            Ok(Some(assignment))
        },
    )
    .await
}

pub(crate) fn items(list: &Value) -> &[Value] {
    list["items"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// The ServiceAccount the tests scrape the sharder's metrics as.
const METRICS_SCRAPER: &str = "metrics-scraper";

/// The name the serving certificate is issued for (the Service's).
const SERVICE_NAME: &str = "sharder.sharding-system.svc";

/// The installed sharder's metrics port (config/sharder).
const METRICS_PORT: u16 = 8080;

/// What scraping the installed sharder's secure metrics takes, set up as "Who may scrape" in
/// docs/monitoring.md says: a ServiceAccount bound to the shipped `sharding:metrics-reader`, a
/// token for it from `kubectl create token`, and the CA of the serving certificate from its Secret.
struct Scraper {
    token: String,
    ca: std::path::PathBuf,
}

/// Sets up the [`Scraper`] (again, if an earlier test uninstalled everything).
async fn metrics_scraper(c: &InCluster) -> anyhow::Result<Scraper> {
    let dir = c.state_dir().join("scratch-metrics");
    std::fs::create_dir_all(&dir)?;
    c.shell(
        &format!(
            "kubectl -n {SYSTEM} create serviceaccount {METRICS_SCRAPER} --dry-run=client -o yaml \
               | kubectl apply -f -\n\
             kubectl create clusterrolebinding {METRICS_READER}:{METRICS_SCRAPER} \
               --clusterrole={METRICS_READER} --serviceaccount={SYSTEM}:{METRICS_SCRAPER} \
               --dry-run=client -o yaml | kubectl apply -f -\n"
        ),
        &dir,
    )?;
    // The sharder remembers a refusal for 10 s: scrape only once the binding counts.
    let user = format!("system:serviceaccount:{SYSTEM}:{METRICS_SCRAPER}");
    eventually(
        "the metrics-reader binding to count",
        Duration::from_secs(30),
        || {
            let answer = c.kubectl(&["auth", "can-i", "get", "/metrics", "--as", &user]);
            Ok(answer.is_ok_and(|a| a.trim() == "yes").then_some(()))
        },
    )
    .await?;
    let token = c
        .kubectl(&["-n", SYSTEM, "create", "token", METRICS_SCRAPER])?
        .trim()
        .to_string();
    let secret: Secret = serde_json::from_value(c.kubectl_json(&[
        "-n",
        SYSTEM,
        "get",
        "secret",
        "sharder-webhook-tls",
    ])?)?;
    let ca_bytes = secret
        .data
        .and_then(|mut d| d.remove("ca.crt"))
        .context("the Secret sharder-webhook-tls has no ca.crt")?;
    let ca = dir.join("ca.crt");
    std::fs::write(&ca, ca_bytes.0)?;
    Ok(Scraper { token, ca })
}

/// GETs `/metrics` from the sharder pod at `ip` over HTTPS, verifying its certificate for the
/// Service's name against the installed CA, with the scraper's token if given; the HTTP status
/// and body.
fn scrape(scraper: &Scraper, ip: &str, with_token: bool) -> anyhow::Result<(u16, String)> {
    let ca = scraper.ca.display().to_string();
    let resolve = format!("{SERVICE_NAME}:{METRICS_PORT}:{ip}");
    let url = format!("https://{SERVICE_NAME}:{METRICS_PORT}/metrics");
    let authorization = format!("Authorization: Bearer {}", scraper.token);
    let mut args = vec![
        "-sS",
        "--max-time",
        "5",
        "--cacert",
        &ca,
        "--resolve",
        &resolve,
        "-w",
        "\n%{http_code}",
    ];
    if with_token {
        args.extend(["-H", authorization.as_str()]);
    }
    args.push(&url);
    let out = e2e::net::curl(&args)?;
    let (text, code) = out.rsplit_once('\n').context("curl printed no status")?;
    Ok((code.trim().parse()?, text.to_string()))
}

/// The addresses of the running sharder pods.
fn sharder_ips(c: &InCluster) -> anyhow::Result<Vec<String>> {
    let pods = c.kubectl_json(&["-n", SYSTEM, "get", "pods", "-l", SHARDER_SELECTOR])?;
    Ok(items(&pods)
        .iter()
        .filter(|p| {
            p["metadata"]["deletionTimestamp"].is_null() && p["status"]["phase"] == "Running"
        })
        .filter_map(|p| p["status"]["podIP"].as_str().map(str::to_string))
        .collect())
}

/// Sum of a counter over every sharder replica, scraped from the pods' own addresses.
fn sharder_counter(c: &InCluster, scraper: &Scraper, metric: &str) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for ip in sharder_ips(c)? {
        let (status, text) = scrape(scraper, &ip, true)?;
        ensure!(status == 200, "scraping {ip} answered {status}: {text}");
        total += e2e::prometheus::sum(&text, metric, &[]);
    }
    Ok(total)
}

/// The API server's own metric `name` for the sharder's webhook (every ring's webhook has the
/// same name; the tests have one ring at a time).
async fn webhook_metric(client: &Client, name: &str) -> anyhow::Result<f64> {
    let text = e2e::prometheus::apiserver_metrics(client).await?;
    Ok(e2e::prometheus::sum(
        &text,
        name,
        &[("name", kube_sharding_api::labels::WEBHOOK_NAME)],
    ))
}

/// The holder of the sharder's leader-election Lease (`<pod>_<...>`).
fn leader(c: &InCluster) -> anyhow::Result<String> {
    let lease = c.kubectl_json(&["-n", SYSTEM, "get", "lease", "sharder"])?;
    Ok(lease["spec"]["holderIdentity"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

macro_rules! cluster_or_skip {
    () => {
        match in_cluster() {
            Some(c) => c,
            None => return Ok(()),
        }
    };
}

#[tokio::test]
async fn install_with_kustomize() -> anyhow::Result<()> {
    let c = cluster_or_skip!();
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    ensure_installed(c)?;
    let deployment = c.kubectl_json(&["-n", SYSTEM, "get", "deployment", "sharder"])?;
    ensure!(
        deployment["status"]["readyReplicas"] == 2,
        "the sharder Deployment is not 2/2 Ready: {}",
        deployment["status"]
    );
    // Ready through the kubelet's calls of the real readiness probe.
    let pods = c.kubectl_json(&["-n", SYSTEM, "get", "pods", "-l", SHARDER_SELECTOR])?;
    for pod in items(&pods) {
        let probe = &pod["spec"]["containers"][0]["readinessProbe"]["httpGet"];
        ensure!(
            probe["path"] == "/readyz",
            "no readiness probe on /readyz: {probe}"
        );
        let ready = pod["status"]["conditions"].as_array().is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        });
        ensure!(ready, "pod {} is not Ready", pod["metadata"]["name"]);
        ensure!(
            pod["spec"]["securityContext"]["runAsUser"] == 65532,
            "the sharder does not run as 65532"
        );
    }
    let pdb = c.kubectl_json(&["-n", SYSTEM, "get", "poddisruptionbudget", "sharder"])?;
    ensure!(
        pdb["spec"]["maxUnavailable"] == 1,
        "unexpected PDB: {}",
        pdb["spec"]
    );
    eventually(
        "the PDB to count two healthy pods",
        Duration::from_secs(30),
        || {
            let pdb = c.kubectl_json(&["-n", SYSTEM, "get", "poddisruptionbudget", "sharder"])?;
            Ok(
                (pdb["status"]["currentHealthy"] == 2 && pdb["status"]["disruptionsAllowed"] == 1)
                    .then_some(()),
            )
        },
    )
    .await?;
    guard.passed();
    Ok(())
}

/// The example steps of docs/getting-started.md, then 200 Secrets, each labelled in admission by
/// the webhook reached through its Service, each with its checksum ConfigMap.
async fn example_ring(kind: RingKind, readme: bool, count: usize) -> anyhow::Result<()> {
    let c = cluster_or_skip!();
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    ensure_installed(c)?;
    let client = c.client().await?;
    if readme {
        // From a state without either example, as a reader starts.
        for dir in ["deploy/controllerring", "deploy"] {
            c.kubectl(&[
                "delete",
                "-k",
                dir,
                "--ignore-not-found",
                "--wait=true",
                "--timeout=120s",
            ])?;
        }
        let dir = scratch_dir(c, "example")?;
        let out = c.shell(&shell_block(EXAMPLE_RING)?, &dir)?;
        let shard_label = kind.shard_label(RING);
        let demo = c.kubectl_json(&["-n", "default", "get", "secret", "demo"])?;
        let shard = demo["metadata"]["labels"][&shard_label]
            .as_str()
            .unwrap_or_default()
            .to_string();
        ensure!(
            shard_pods(c)?.contains(&shard),
            "demo is on {shard:?}, not a running shard"
        );
        // What the reader is told to look at: `--show-labels` shows the assignment, and the
        // loop ends by showing the ConfigMap that shard wrote.
        ensure!(
            out.contains(&format!("{shard_label}={shard}")),
            "the documented steps did not show demo's shard:\n{out}"
        );
        ensure!(
            out.contains("name: checksums-demo"),
            "the documented steps did not show demo's ConfigMap:\n{out}"
        );
        if kind == RingKind::ClusterRing {
            readme_pins(c, &dir, &shard_label).await?;
        }
        c.kubectl(&["-n", "default", "delete", "secret", "demo"])?;
    }
    ensure_example(c, kind, 3).await?;
    let requests = "apiserver_admission_webhook_admission_duration_seconds_count";
    let fail_open = "apiserver_admission_webhook_fail_open_count";
    let (calls_before, fail_open_before) = (
        webhook_metric(&client, requests).await?,
        webhook_metric(&client, fail_open).await?,
    );
    let (namespace, labelled) = namespace_with_secrets(&client, kind, "example", count).await?;
    ensure!(
        labelled == count,
        "{labelled} of {count} Secrets came back from their CREATE with a shard label"
    );
    let calls = webhook_metric(&client, requests).await? - calls_before;
    let failed_open = webhook_metric(&client, fail_open).await? - fail_open_before;
    ensure!(
        calls >= count as f64,
        "the API server called the webhook {calls} times for {count} CREATEs"
    );
    ensure!(
        failed_open == 0.0,
        "{failed_open} admission calls failed open"
    );
    wait_converged(c, kind, &namespace, Duration::from_secs(60)).await?;
    c.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    guard.passed();
    Ok(())
}

/// The pin commands of docs/rings.md on the example ClusterRing: a new Secret created pinned lands
/// on the pinned shard, and `demo`, pinned and drained in one write, moves there once its shard
/// acknowledges. The namespace pin is removed afterwards, and the pinned Secret deleted.
async fn readme_pins(
    c: &InCluster,
    dir: &std::path::Path,
    shard_label: &str,
) -> anyhow::Result<()> {
    c.shell(&shell_block(PINS)?, dir)?;
    let pinned = c.kubectl_json(&["-n", "default", "get", "secret", "pinned"])?;
    let shard = pinned["metadata"]["labels"][shard_label]
        .as_str()
        .unwrap_or_default()
        .to_string();
    ensure!(
        shard_pods(c)?.contains(&shard),
        "the pinned Secret is on {shard:?}, not a running shard"
    );
    let annotation = format!(
        "{}{}",
        kube_sharding_api::labels::PIN_ANNOTATION_PREFIX,
        kube_sharding_api::labels::ring_suffix(RING)
    );
    ensure!(
        pinned["metadata"]["annotations"][&annotation].as_str() == Some(shard.as_str()),
        "the pinned Secret is on {shard:?}, not on the shard its pin names: {}",
        pinned["metadata"]
    );
    eventually("demo on its pinned shard", Duration::from_secs(60), || {
        let demo = c.kubectl_json(&["-n", "default", "get", "secret", "demo"])?;
        Ok(
            (demo["metadata"]["labels"][shard_label].as_str() == Some(shard.as_str()))
                .then_some(()),
        )
    })
    .await?;
    c.kubectl(&[
        "annotate",
        "namespace",
        "default",
        &format!("{annotation}-"),
    ])?;
    c.kubectl(&["-n", "default", "delete", "secret", "pinned"])?;
    Ok(())
}

#[tokio::test]
async fn example_clusterring_assigns_through_the_service() -> anyhow::Result<()> {
    example_ring(RingKind::ClusterRing, true, 200).await
}

#[tokio::test]
async fn example_controllerring_assigns_through_the_service() -> anyhow::Result<()> {
    example_ring(RingKind::ControllerRing, false, 100).await
}

#[tokio::test]
async fn kubectl_scale_rebalances_through_drains() -> anyhow::Result<()> {
    let c = cluster_or_skip!();
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    ensure_installed(c)?;
    let kind = RingKind::ClusterRing;
    ensure_example(c, kind, 3).await?;
    let client = c.client().await?;
    let logs = ShardLogs::follow(c.config().await?, SHARDS_NAMESPACE, SHARD_SELECTOR)?;
    let (namespace, _) = namespace_with_secrets(&client, kind, "scale", 150).await?;
    let before = wait_converged(c, kind, &namespace, Duration::from_secs(60)).await?;
    // The metrics as shipped: HTTPS, and only for a token allowed to read them.
    let scraper = metrics_scraper(c).await?;
    for ip in sharder_ips(c)? {
        let (status, body) = scrape(&scraper, &ip, false)?;
        ensure!(
            (status, body.as_str()) == (401, "unauthorized\n"),
            "{ip} answered a scrape without a token with {status}: {body}"
        );
    }
    let drains_before = sharder_counter(c, &scraper, "controller_sharding_drains_total")?;
    let moves_before = sharder_counter(c, &scraper, "controller_sharding_movements_total")?;

    // Out: 3 → 5. Objects leave live shards only through drains.
    c.kubectl(&[
        "-n",
        SHARDS_NAMESPACE,
        "scale",
        "deployment",
        "checksum-controller",
        "--replicas=5",
    ])?;
    wait_ring(c, kind, 5).await?;
    let after_out = wait_converged(c, kind, &namespace, Duration::from_secs(60)).await?;
    let moved: Vec<&String> = before
        .iter()
        .filter(|(name, shard)| after_out.get(*name) != Some(shard))
        .map(|(name, _)| name)
        .collect();
    ensure!(!moved.is_empty(), "scaling out moved no Secret");
    // Streamed log lines can trail the writes they report by a moment.
    eventually(
        "a drain acknowledgement by the old shard of every moved Secret in its log",
        Duration::from_secs(10),
        || {
            let records = logs.records();
            let missing: Vec<String> = moved
                .iter()
                .map(|name| (format!("{namespace}/{name}"), &before[*name]))
                .filter(|(object, old)| {
                    !records.iter().any(|r| {
                        r.event == "drain" && &r.pod == *old && r.object.as_deref() == Some(object)
                    })
                })
                .map(|(object, old)| format!("{object} (from {old})"))
                .collect();
            if missing.is_empty() {
                Ok(Some(()))
            } else {
                Err(anyhow::anyhow!(
                    "no drain record for {}",
                    missing.join(", ")
                ))
            }
        },
    )
    .await?;

    let drains = sharder_counter(c, &scraper, "controller_sharding_drains_total")? - drains_before;
    let drain_records = logs.records().iter().filter(|r| r.event == "drain").count();
    eprintln!(
        "scale out: {} Secrets moved, {drains} drains counted, {drain_records} drain records",
        moved.len()
    );
    ensure!(
        drains >= moved.len() as f64,
        "{} Secrets moved but the sharder counted {drains} drains",
        moved.len()
    );

    // In: 5 → 2. Terminating shards release their Leases; their objects move at once.
    let started = Instant::now();
    c.kubectl(&[
        "-n",
        SHARDS_NAMESPACE,
        "scale",
        "deployment",
        "checksum-controller",
        "--replicas=2",
    ])?;
    wait_ring(c, kind, 2).await?;
    wait_converged(c, kind, &namespace, LEASE_DURATION).await?;
    let took = started.elapsed();
    ensure!(
        took < LEASE_DURATION,
        "scaling in took {took:?}, not less than the Lease duration {LEASE_DURATION:?}"
    );
    let moves = sharder_counter(c, &scraper, "controller_sharding_movements_total")? - moves_before;
    ensure!(moves > 0.0, "no move counted after scaling in");
    let records = logs.stop().await;
    let remaining = shard_pods(c)?;
    let gone: Vec<&String> = after_out
        .values()
        .filter(|s| !remaining.contains(s))
        .collect();
    for pod in gone {
        let of_pod: Vec<&ownership::Record> = records.iter().filter(|r| &r.pod == pod).collect();
        ensure!(
            of_pod.iter().any(|r| r.event == "lease_released"),
            "{pod} was scaled away without logging that it released its Lease; its last of {} \
             records: {:?}",
            of_pod.len(),
            of_pod
                .iter()
                .rev()
                .take(5)
                .map(|r| (&r.event, r.at))
                .collect::<Vec<_>>()
        );
    }
    let violations = ownership::violations(&records);
    ensure!(
        violations.is_empty(),
        "ownership overlapped:\n{}",
        violations.join("\n")
    );
    eprintln!(
        "scale: 3→5 moved {} Secrets through {drains} drains; 5→2 converged in {took:?}; {} records checked",
        moved.len(),
        records.len()
    );
    c.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    guard.passed();
    Ok(())
}

/// docs/protocol.md §3, §19.15: someone allowed to update a running shard's Lease empties its
/// holder, as a release would but without the shard's release mark (`kubectl patch lease
/// <shard> --type=merge -p '{"spec":{"holderIdentity":""}}'`), with the example's 3 shards and
/// 500 Secrets. Every Secret another shard reconciles before the patched shard stopped (it
/// notices at its next renewal and exits; its container restarts) was drained by it first, no
/// Secret is reconciled by two shards at once, and the ring converges with the shard back.
/// (Before, all of the shard's Secrets moved directly within a second while it ran on.)
#[tokio::test]
async fn a_third_party_emptying_a_running_shards_holder_moves_nothing_directly()
-> anyhow::Result<()> {
    let c = cluster_or_skip!();
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    ensure_installed(c)?;
    let kind = RingKind::ClusterRing;
    ensure_example(c, kind, 3).await?;
    let client = c.client().await?;
    let logs = ShardLogs::follow(c.config().await?, SHARDS_NAMESPACE, SHARD_SELECTOR)?;
    let (namespace, _) = namespace_with_secrets(&client, kind, "holder", 500).await?;
    let before = wait_converged(c, kind, &namespace, Duration::from_secs(90)).await?;
    let victim = before
        .values()
        .next()
        .context("no Secret assigned")?
        .clone();
    // The shard notices at its next renewal (every 2 s) and exits; what moves after that moves
    // legitimately. Striking right after a renewal leaves the whole period for the drains this
    // test is about, instead of whatever was left of it.
    let leases: Api<Lease> = Api::namespaced(client.clone(), SHARDS_NAMESPACE);
    let renewed = |lease: &Lease| lease.spec.as_ref().and_then(|s| s.renew_time.clone());
    let last = renewed(&leases.get(&victim).await?);
    let deadline = Instant::now() + Duration::from_secs(10);
    while renewed(&leases.get(&victim).await?) == last {
        ensure!(
            Instant::now() < deadline,
            "{victim} did not renew its Lease within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let patched_at = k8s_openapi::jiff::Timestamp::now();
    // What `kubectl patch lease <shard> --type=merge -p '{"spec":{"holderIdentity":""}}'` sends,
    // without kubectl's start-up time.
    leases
        .patch(
            &victim,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"holderIdentity": ""}})),
        )
        .await?;
    wait_ring(c, kind, 3).await?;
    wait_converged(c, kind, &namespace, Duration::from_secs(120)).await?;
    let records = logs.stop().await;
    let stopped = records
        .iter()
        .filter(|r| r.pod == victim && r.at >= patched_at)
        .filter(|r| matches!(r.event.as_str(), "lease_lost" | "lease_released"))
        .map(|r| r.at)
        .min()
        .with_context(|| format!("{victim} never logged that its Lease was gone"))?;
    // A drain record is written right after the acknowledging write, which the next shard's
    // reconcile follows.
    let slack = k8s_openapi::jiff::SignedDuration::from_millis(500);
    let (mut drained, mut after_stop) = (0, 0);
    for name in before.iter().filter(|(_, s)| **s == victim).map(|(n, _)| n) {
        let object = format!("{namespace}/{name}");
        let of_object = |r: &&ownership::Record| r.object.as_deref() == Some(object.as_str());
        let Some(taken) = records
            .iter()
            .filter(of_object)
            .filter(|r| r.event == "reconcile" && r.pod != victim && r.at >= patched_at)
            .map(|r| r.at)
            .min()
        else {
            continue;
        };
        if taken >= stopped {
            after_stop += 1;
            continue;
        }
        let acknowledged = records.iter().filter(of_object).any(|r| {
            r.event == "drain" && r.pod == victim && r.at >= patched_at && r.at <= taken + slack
        });
        ensure!(
            acknowledged,
            "{object} was reconciled by another shard at {taken}, while {victim} still ran \
             (until {stopped}), without {victim} acknowledging a drain of it first: it moved directly"
        );
        drained += 1;
    }
    ensure!(
        drained > 0,
        "no Secret of {victim} was taken over before it stopped at {stopped}, {:?} after the \
         patch: the test saw no handover",
        stopped.duration_since(patched_at)
    );
    let violations = ownership::violations(&records);
    ensure!(
        violations.is_empty(),
        "ownership overlapped:\n{}",
        violations.join("\n")
    );
    eprintln!(
        "holder emptied on {victim}: {drained} Secrets drained before it stopped {:?} after the \
         patch, {after_stop} taken after; {} records checked",
        stopped.duration_since(patched_at),
        records.len()
    );
    c.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    guard.passed();
    Ok(())
}

/// How a shard pod goes away in [`shard_pod_gone`].
#[derive(Clone, Copy, Debug, PartialEq)]
enum Gone {
    /// `kubectl delete pod --grace-period=0 --force`: kubelet still stops the container with
    /// SIGTERM, so the shard may release its Lease on the way out.
    ForceDeleted,
    /// SIGKILL of the shard's process through the node's containerd (as the OOM killer or a
    /// crash would: no handler runs, the Lease is not released), then the force delete, so kubelet
    /// does not restart it under the same shard name.
    Crashed,
}

/// A shard pod of the example (3 shards, 60 Secrets) goes away as `how` says; its objects must
/// have left it within two Lease durations and 5 s, after a crash not before its Lease could
/// expire; the ring then converges on the replacement pod.
async fn shard_pod_gone(how: Gone) -> anyhow::Result<()> {
    let c = cluster_or_skip!();
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    ensure_installed(c)?;
    let kind = RingKind::ClusterRing;
    ensure_example(c, kind, 3).await?;
    let client = c.client().await?;
    let (namespace, _) = namespace_with_secrets(&client, kind, "gone", 60).await?;
    let assignment = wait_converged(c, kind, &namespace, Duration::from_secs(60)).await?;
    let victim = assignment
        .values()
        .next()
        .context("no Secret assigned")?
        .clone();
    if how == Gone::Crashed {
        let pod = c.kubectl_json(&["-n", SHARDS_NAMESPACE, "get", "pod", &victim])?;
        let container = pod["status"]["containerStatuses"][0]["containerID"]
            .as_str()
            .context("the shard pod has no container ID")?;
        c.kill_container(container)?;
    }
    let started = Instant::now();
    c.kubectl(&[
        "-n",
        SHARDS_NAMESPACE,
        "delete",
        "pod",
        &victim,
        "--grace-period=0",
        "--force",
    ])?;
    let label = kind.shard_label(RING);
    let bound = LEASE_DURATION * 2 + Duration::from_secs(5);
    eventually(&format!("no Secret left on {victim}"), bound, || {
        let secrets = c.kubectl_json(&[
            "-n",
            &namespace,
            "get",
            "secrets",
            "-l",
            &format!("{label}={victim}"),
        ])?;
        Ok(items(&secrets).is_empty().then_some(()))
    })
    .await?;
    let took = started.elapsed();
    if how == Gone::Crashed {
        ensure!(
            took >= LEASE_DURATION / 2,
            "the objects left {victim} after {took:?}, before its Lease could expire: it was not a crash"
        );
    }
    wait_ring(c, kind, 3).await?;
    wait_converged(c, kind, &namespace, Duration::from_secs(60)).await?;
    eprintln!("{how:?}: the objects of {victim} left it after {took:?} (bound {bound:?})");
    c.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    guard.passed();
    Ok(())
}

#[tokio::test]
async fn force_deleted_shard_pod_is_taken_over() -> anyhow::Result<()> {
    shard_pod_gone(Gone::ForceDeleted).await
}

#[tokio::test]
async fn crashed_shard_pod_is_taken_over() -> anyhow::Result<()> {
    shard_pod_gone(Gone::Crashed).await
}

/// Every write the sharder sends to a ring's objects during rebalancing (3 → 4 → 3 shards) is a
/// merge patch of the ring's two labels (and the resourceVersion it is conditioned on), with the
/// sharder's field manager: read from the API server's audit log, where the sharder writes under
/// its own ServiceAccount.
#[tokio::test]
async fn the_sharder_writes_only_its_own_labels() -> anyhow::Result<()> {
    let c = cluster_or_skip!();
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    ensure_installed(c)?;
    let kind = RingKind::ClusterRing;
    ensure_example(c, kind, 3).await?;
    let client = c.client().await?;
    let (namespace, _) = namespace_with_secrets(&client, kind, "writes", 100).await?;
    wait_converged(c, kind, &namespace, Duration::from_secs(60)).await?;
    for replicas in [4, 3] {
        c.kubectl(&[
            "-n",
            SHARDS_NAMESPACE,
            "scale",
            "deployment",
            "checksum-controller",
            &format!("--replicas={replicas}"),
        ])?;
        wait_ring(c, kind, replicas).await?;
        wait_converged(c, kind, &namespace, Duration::from_secs(60)).await?;
    }
    let log = std::fs::read_to_string(c.state_dir().join(e2e::in_cluster::AUDIT_LOG))?;
    let sharder = "system:serviceaccount:sharding-system:sharder";
    let allowed_labels = [kind.shard_label(RING), kind.drain_label(RING)];
    let mut checked = 0;
    let mut other_writes: BTreeMap<String, usize> = BTreeMap::new();
    for line in log.lines() {
        let event: Value = serde_json::from_str(line)?;
        if event["user"]["username"] != sharder || event["stage"] != "ResponseComplete" {
            continue;
        }
        let object = &event["objectRef"];
        let resource = object["resource"].as_str().unwrap_or_default();
        if object["namespace"] != namespace.as_str() {
            *other_writes
                .entry(format!(
                    "{} {resource}",
                    event["verb"].as_str().unwrap_or_default()
                ))
                .or_default() += 1;
            continue;
        }
        let what = format!("{} {resource}/{}", event["verb"], object["name"]);
        ensure!(event["verb"] == "patch", "{what}: not a patch");
        let uri = event["requestURI"].as_str().unwrap_or_default();
        ensure!(
            uri.contains("fieldManager=sharder"),
            "{what}: no field manager in {uri}"
        );
        let body = &event["requestObject"];
        // A controlled object moved after its controller's acknowledgement: a JSON patch that
        // tests the shard label and replaces it (docs/protocol.md §19, item 9), nothing else.
        if let Some(ops) = body.as_array() {
            for op in ops {
                let path = op["path"].as_str().unwrap_or_default();
                let label = path
                    .strip_prefix("/metadata/labels/")
                    .map(|l| l.replace("~1", "/").replace("~0", "~"));
                ensure!(
                    matches!(op["op"].as_str(), Some("test" | "replace" | "remove"))
                        && label.is_some_and(|l| allowed_labels.contains(&l)),
                    "{what}: a JSON patch writing more than the ring's labels: {body}"
                );
            }
            checked += 1;
            continue;
        }
        let top: Vec<&String> = body
            .as_object()
            .map(|o| o.keys().collect())
            .unwrap_or_default();
        ensure!(
            top == ["metadata"],
            "{what}: writes more than metadata: {body}"
        );
        for (key, value) in body["metadata"].as_object().into_iter().flatten() {
            match key.as_str() {
                "resourceVersion" => {}
                "labels" => {
                    for label in value.as_object().into_iter().flatten().map(|(k, _)| k) {
                        ensure!(
                            allowed_labels.contains(label),
                            "{what}: writes the label {label}: {body}"
                        );
                    }
                }
                _ => bail!("{what}: writes metadata.{key}: {body}"),
            }
        }
        checked += 1;
    }
    ensure!(
        checked > 0,
        "the audit log holds no write of the sharder to {namespace}"
    );
    eprintln!(
        "writes: {checked} sharder patches of the ring's objects checked; its other writes: {other_writes:?}"
    );
    c.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    guard.passed();
    Ok(())
}

#[tokio::test]
async fn rollout_restart_of_the_sharder_refuses_no_write() -> anyhow::Result<()> {
    let c = cluster_or_skip!();
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    ensure_installed(c)?;
    let kind = RingKind::ClusterRing;
    ensure_example(c, kind, 3).await?;
    let client = c.client().await?;
    let (namespace, _) = namespace_with_secrets(&client, kind, "restart", 0).await?;
    let leader_before = leader(c)?;
    let old_pods = c.kubectl_json(&["-n", SYSTEM, "get", "pods", "-l", SHARDER_SELECTOR])?;
    let old_pods = pods_running(&old_pods);

    // Secrets created steadily, one every 100 ms, while the sharder rolls.
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = {
        let (client, namespace, stop) = (client.clone(), namespace.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut attempts, mut labelled, mut errors) = (Vec::new(), 0, Vec::new());
            while !stop.is_cancelled() {
                let created = attempts.len();
                attempts.push(Instant::now());
                match create_secrets(&client, kind, &namespace, created..created + 1).await {
                    Ok(n) => labelled += n,
                    Err(e) => errors.push(format!("{e:#}")),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (attempts, labelled, errors)
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    // kubectl off the test's runtime, so that the writer keeps writing while the sharder rolls.
    let rolling = Instant::now();
    c.kubectl_beside_tasks(&["-n", SYSTEM, "rollout", "restart", "deployment", "sharder"])
        .await?;
    c.kubectl_beside_tasks(&[
        "-n",
        SYSTEM,
        "rollout",
        "status",
        "deployment",
        "sharder",
        "--timeout=180s",
    ])
    .await?;
    let rolled = rolling.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.cancel();
    let (attempts, labelled, errors) = writer.await?;
    let created = attempts.len();
    ensure!(
        errors.is_empty(),
        "{} of {created} creates failed: {errors:?}",
        errors.len()
    );
    // At least one create a second while the sharder rolled (one every 100 ms is the aim), so
    // that "no write refused" speaks of the rollout itself.
    let during = attempts
        .iter()
        .filter(|at| (rolling..=rolling + rolled).contains(*at))
        .count();
    ensure!(
        during as f64 >= rolled.as_secs_f64(),
        "only {during} creates were sent during the {rolled:?} the rollout took"
    );
    wait_converged(c, kind, &namespace, Duration::from_secs(30)).await?;
    let new_leader = eventually(
        "a leader among the new pods",
        Duration::from_secs(60),
        || {
            let holder = leader(c)?;
            Ok(
                (!holder.is_empty() && !old_pods.iter().any(|p| holder.starts_with(p.as_str())))
                    .then_some(holder),
            )
        },
    )
    .await?;
    ensure!(new_leader != leader_before, "the leader did not move");
    eprintln!(
        "rollout restart: {created} Secrets created ({during} while the sharder rolled for \
         {rolled:?}), {labelled} labelled in admission, 0 refused; leader {leader_before} → \
         {new_leader}"
    );
    c.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    guard.passed();
    Ok(())
}

/// What `kubectl drain` of the node does to the sharder: with the node cordoned no replacement
/// can start, so after one sharder pod is evicted the PDB refuses to evict the last one.
#[tokio::test]
async fn pdb_refuses_the_eviction_that_would_leave_no_sharder() -> anyhow::Result<()> {
    let c = cluster_or_skip!();
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    ensure_installed(c)?;
    c.kubectl(&[
        "-n",
        SYSTEM,
        "rollout",
        "status",
        "deployment",
        "sharder",
        "--timeout=120s",
    ])?;
    let client = c.client().await?;
    eventually(
        "the PDB to allow one disruption",
        Duration::from_secs(60),
        || {
            let pdb = c.kubectl_json(&["-n", SYSTEM, "get", "poddisruptionbudget", "sharder"])?;
            Ok((pdb["status"]["disruptionsAllowed"] == 1).then_some(()))
        },
    )
    .await?;
    let pods = c.kubectl_json(&["-n", SYSTEM, "get", "pods", "-l", SHARDER_SELECTOR])?;
    let pods = pods_running(&pods);
    ensure!(pods.len() == 2, "expected two sharder pods, found {pods:?}");
    let node = "controller-sharding-node";
    c.kubectl(&["cordon", node])?;
    let outcome = async {
        let api: Api<Pod> = Api::namespaced(client.clone(), SYSTEM);
        api.evict(&pods[0], &EvictParams::default())
            .await
            .with_context(|| format!("the first eviction ({}) was refused", pods[0]))?;
        match api.evict(&pods[1], &EvictParams::default()).await {
            Ok(_) => bail!("the PDB let the last running sharder pod be evicted"),
            Err(kube::Error::Api(status)) if status.code == 429 => {
                ensure!(
                    status.message.contains("disruption budget"),
                    "refused for another reason: {}",
                    status.message
                );
            }
            Err(e) => bail!("the second eviction failed otherwise than by the PDB: {e}"),
        }
        // The webhook is still served: the last replica is Ready.
        let deployment = c.kubectl_json(&["-n", SYSTEM, "get", "deployment", "sharder"])?;
        ensure!(
            deployment["status"]["readyReplicas"] == 1,
            "expected one Ready sharder while the node is cordoned: {}",
            deployment["status"]
        );
        Ok(())
    }
    .await;
    c.kubectl(&["uncordon", node])?;
    outcome?;
    c.kubectl(&[
        "-n",
        SYSTEM,
        "rollout",
        "status",
        "deployment",
        "sharder",
        "--timeout=120s",
    ])?;
    guard.passed();
    Ok(())
}

/// "Uninstall" of docs/install-kustomize.md as written: rings, their webhook configurations, the
/// sharder, its namespace and the CRDs gone. The next test installs again.
#[tokio::test]
async fn uninstall_with_kustomize() -> anyhow::Result<()> {
    let c = cluster_or_skip!();
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    ensure_installed(c)?;
    ensure_example(c, RingKind::ClusterRing, 3).await?;
    c.kubectl(&[
        "get",
        "mutatingwebhookconfiguration",
        &RingKind::ClusterRing.webhook_configuration_name(RING),
    ])?;
    c.shell(&doc_block_for(c, UNINSTALL)?, &scratch_dir(c, "uninstall")?)?;
    INSTALLED.store(false, Ordering::SeqCst);
    eventually(
        "the ring's webhook configuration to go",
        Duration::from_secs(60),
        || {
            let left = c.kubectl(&["get", "mutatingwebhookconfigurations", "-o", "name"])?;
            Ok((!left.contains("sharding-")).then_some(()))
        },
    )
    .await?;
    let namespaces = c.kubectl(&["get", "namespaces", "-o", "name"])?;
    ensure!(
        !namespaces.contains("namespace/sharding-system")
            && !namespaces.contains("namespace/checksum-controller"),
        "namespaces left after uninstalling: {namespaces}"
    );
    let crds = c.kubectl(&["get", "crds", "-o", "name"])?;
    ensure!(
        !crds.contains("sharding.timebertt.dev"),
        "CRDs left: {crds}"
    );
    if admission_policies_served(c)? {
        let policies = c.kubectl(&["get", "validatingadmissionpolicies", "-o", "name"])?;
        ensure!(
            !policies.contains("sharding-"),
            "admission policies left: {policies}"
        );
    }
    guard.passed();
    Ok(())
}
