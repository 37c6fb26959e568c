//! The release as a user installs it, on the real node: docs/install.md's blocks for the release
//! bundle (`kubectl apply -f` of the files in `dist/`) and for the Helm chart (install, an upgrade
//! of replicas and configuration while Secrets are created every 100 ms, uninstall). Each test
//! first removes whatever install an earlier test left (the kustomize one included: the objects
//! share their names) and leaves the cluster uninstalled, so the next kustomize test installs
//! again.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use e2e::in_cluster::{InCluster, OnFailure, eventually, in_cluster, workspace_root};
use kube_sharding_api::RingKind;

use crate::{
    INSTALLED, RING, SHARDER_SELECTOR, SYSTEM, TURN, admission_policies_served, create_secrets,
    namespace_with_secrets, pods_running, wait_converged, wait_ring,
};

const RELEASE: &str = "kube-sharding";

/// The headings of docs/install.md whose shell blocks the tests below run.
const DOC_BLOCKS: &[&str] = &[
    "### Install from the release bundle",
    "### Uninstall the release bundle",
    "### Upgrade the release bundle",
    "### Install with Helm",
    "### Upgrade with Helm",
    "### Uninstall with Helm",
];

/// The shell block after `heading` in docs/install.md.
fn doc_block(heading: &str) -> anyhow::Result<String> {
    let doc = std::fs::read_to_string(workspace_root().join("docs/install.md"))?;
    Ok(doc
        .split_once(&format!("\n{heading}\n"))
        .with_context(|| format!("no heading {heading:?} in docs/install.md"))?
        .1
        .split_once("```sh\n")
        .and_then(|(_, b)| b.split_once("\n```"))
        .with_context(|| format!("no sh block after {heading:?}"))?
        .0
        .to_string())
}

/// The shell block after `heading` in docs/install.md, for this cluster: on an API server
/// without ValidatingAdmissionPolicy v1 without the admission policies, as the document says.
pub(crate) fn install_doc_block(c: &InCluster, heading: &str) -> anyhow::Result<String> {
    ensure!(
        DOC_BLOCKS.contains(&heading),
        "{heading:?} is not in DOC_BLOCKS"
    );
    let block = doc_block(heading)?;
    if admission_policies_served(c)? {
        return Ok(block);
    }
    println!("note: this API server has no admission policies v1; {heading:?} runs without them");
    Ok(block
        .lines()
        .filter(|l| !l.contains("admission-policies.yaml"))
        .map(|l| {
            // Both helm commands that install end their line with --wait.
            if !l.starts_with("helm uninstall") && l.trim_end().ends_with("--wait") {
                format!("{l} --set admissionPolicies.enabled=false")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n"))
}

/// A directory laid out as a user has it: the bundle's files (for the bundle's blocks), or a
/// checkout with `dist/` and `charts/` (for Helm's), and helm on `PATH`.
pub(crate) fn user_dir(c: &InCluster, name: &str) -> anyhow::Result<PathBuf> {
    let dir = c.state_dir().join(format!("release-{name}"));
    std::fs::create_dir_all(&dir)?;
    for file in [
        "install.yaml",
        "install-cert-manager.yaml",
        "admission-policies.yaml",
        "example.yaml",
    ] {
        std::fs::copy(workspace_root().join("dist").join(file), dir.join(file))?;
    }
    for sub in ["dist", "charts"] {
        let link = dir.join(sub);
        if !link.exists() {
            std::os::unix::fs::symlink(workspace_root().join(sub), &link)?;
        }
    }
    Ok(dir)
}

/// The cached helm's directory (`e2e/helm.sh provision` builds it the first time).
fn helm_dir() -> anyhow::Result<PathBuf> {
    Ok(e2e::helm::binary()?
        .parent()
        .context("helm has no directory")?
        .to_path_buf())
}

/// Runs `script` with helm first on `PATH`.
fn with_helm(c: &InCluster, script: &str, dir: &Path) -> anyhow::Result<String> {
    let helm = helm_dir()?;
    c.shell(
        &format!("export PATH={}:\"$PATH\"\n{script}", helm.display()),
        dir,
    )
}

/// kubectl with `args` on files of the bundle, where kinds whose CRD or API is not served (the
/// rings once their CRD is gone, the admission policies on 1.29) count as absent: kubectl goes
/// on with the other objects and fails at the end only for those. Its standard output.
fn kubectl_on_files(c: &InCluster, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(e2e::kubectl())
        .arg("--kubeconfig")
        .arg(c.kubeconfig())
        .args(args)
        .output()
        .context("failed to run kubectl")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let unserved = |l: &str| {
        l.contains("resource mapping not found") || l.contains("ensure CRDs are installed first")
    };
    ensure!(
        out.status.success()
            || stderr
                .lines()
                .filter(|l| l.starts_with("error"))
                .all(unserved),
        "kubectl {} failed: {stderr}",
        args.join(" ")
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// Removes every install an earlier test left, however it was made.
pub(crate) fn remove_installs(c: &InCluster) -> anyhow::Result<()> {
    let releases = with_helm(c, "helm list -A -q", c.state_dir())?;
    if releases.lines().any(|l| l.trim() == RELEASE) {
        with_helm(
            c,
            &format!("helm uninstall {RELEASE} --namespace {SYSTEM} --wait"),
            c.state_dir(),
        )?;
    }
    for ring in ["clusterring", "controllerring"] {
        // The CRD may be gone already.
        let _ = c.kubectl(&[
            "delete",
            ring,
            RING,
            "--ignore-not-found",
            "--cascade=foreground",
        ]);
    }
    let dist = workspace_root().join("dist");
    for file in ["example.yaml", "admission-policies.yaml", "install.yaml"] {
        kubectl_on_files(
            c,
            &[
                "delete",
                "-f",
                &dist.join(file).display().to_string(),
                "--ignore-not-found",
                "--wait=true",
                "--timeout=180s",
            ],
        )?;
    }
    c.kubectl(&[
        "delete",
        "namespace",
        SYSTEM,
        "--ignore-not-found",
        "--wait=true",
        "--timeout=180s",
    ])?;
    INSTALLED.store(false, Ordering::SeqCst);
    Ok(())
}

/// The example ring assigns through the Service: `count` Secrets in a new namespace of the ring,
/// each labelled in its CREATE's response (by the webhook), each on its shard with its
/// ConfigMap.
pub(crate) async fn example_assigns(
    c: &InCluster,
    prefix: &str,
    count: usize,
) -> anyhow::Result<String> {
    let kind = RingKind::ClusterRing;
    wait_ring(c, kind, 3).await?;
    let client = c.client().await?;
    let (namespace, labelled) = namespace_with_secrets(&client, kind, prefix, count).await?;
    ensure!(
        labelled == count,
        "{labelled} of {count} Secrets came back from their CREATE with a shard label"
    );
    wait_converged(c, kind, &namespace, Duration::from_secs(60)).await?;
    Ok(namespace)
}

/// Nothing of the install is left in the cluster: no object of the bundle (the namespace
/// `sharding-system` aside when `namespace_may_stay`: Helm does not delete it) and no webhook
/// configuration of a ring.
pub(crate) fn nothing_left(c: &InCluster, namespace_may_stay: bool) -> anyhow::Result<()> {
    let dist = workspace_root().join("dist");
    let mut files = vec!["install.yaml", "example.yaml"];
    if admission_policies_served(c)? {
        files.push("admission-policies.yaml");
    }
    let mut args = vec!["get".to_string()];
    for file in files {
        args.extend(["-f".to_string(), dist.join(file).display().to_string()]);
    }
    args.extend(["--ignore-not-found", "-o", "name"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let found = kubectl_on_files(c, &args)?;
    let left: Vec<&str> = found
        .lines()
        .filter(|l| !(namespace_may_stay && *l == format!("namespace/{SYSTEM}")))
        .collect();
    ensure!(left.is_empty(), "left after uninstalling: {left:?}");
    let webhooks = c.kubectl(&["get", "mutatingwebhookconfigurations", "-o", "name"])?;
    ensure!(!webhooks.contains("sharding-"), "webhooks left: {webhooks}");
    Ok(())
}

/// docs/install.md's "Install from the release bundle" as written (`kubectl apply -f` of
/// install.yaml, the admission policies and the example), the example ring assigning through the
/// Service, then "Uninstall the release bundle" leaving nothing behind.
#[tokio::test]
async fn install_from_the_release_bundle() -> anyhow::Result<()> {
    let Some(c) = in_cluster() else {
        return Ok(());
    };
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    remove_installs(c)?;
    let dir = user_dir(c, "bundle")?;
    c.shell(
        &install_doc_block(c, "### Install from the release bundle")?,
        &dir,
    )?;
    // The bundle's own objects, beyond what the kustomize install has.
    c.kubectl(&["-n", SYSTEM, "get", "networkpolicy", "sharder"])?;
    let deployment = c.kubectl_json(&["-n", SYSTEM, "get", "deployment", "sharder"])?;
    ensure!(
        deployment["status"]["readyReplicas"] == 2,
        "the sharder is not 2/2 Ready: {}",
        deployment["status"]
    );
    let namespace = example_assigns(c, "bundle", 50).await?;
    c.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    c.shell(
        &install_doc_block(c, "### Uninstall the release bundle")?,
        &dir,
    )?;
    nothing_left(c, false)?;
    guard.passed();
    Ok(())
}

/// Creates a Secret of the ring every 100 ms in a namespace, from a background task, through an
/// install or upgrade.
pub(crate) struct Writer {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<(usize, usize, Vec<String>)>,
}

impl Writer {
    /// Starts writing Secrets numbered from `first` (the ones before exist already).
    pub(crate) fn start(
        client: &kube::Client,
        kind: RingKind,
        namespace: &str,
        first: usize,
    ) -> Self {
        let stop = tokio_util::sync::CancellationToken::new();
        let (client, namespace, stopped) = (client.clone(), namespace.to_string(), stop.clone());
        let task = tokio::spawn(async move {
            let (mut next, mut labelled, mut errors) = (first, 0, Vec::new());
            while !stopped.is_cancelled() {
                match create_secrets(&client, kind, &namespace, next..next + 1).await {
                    Ok(n) => labelled += n,
                    Err(e) => errors.push(format!("{e:#}")),
                }
                next += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (next - first, labelled, errors)
        });
        Self { stop, task }
    }

    /// Stops writing. Fails when a create failed, or when fewer Secrets were created than one per
    /// second of `during` (the writer stalled); else the number created and the number that came
    /// back from their CREATE with a shard label.
    pub(crate) async fn finish(self, during: Duration) -> anyhow::Result<(usize, usize)> {
        self.stop.cancel();
        let (created, labelled, errors) = self.task.await?;
        ensure!(
            errors.is_empty(),
            "{} of {created} creates failed: {errors:?}",
            errors.len()
        );
        ensure!(
            created as f64 >= during.as_secs_f64(),
            "only {created} creates in the {during:?} the change took"
        );
        Ok((created, labelled))
    }
}

/// docs/install.md's Helm blocks as written: install, the example ring assigning through the
/// Service; an upgrade to 3 replicas and another sync period while Secrets are created every
/// 100 ms (none refused, every one assigned after); uninstall leaving nothing of the chart.
/// One test, not three: each install on the node costs a sharder rollout.
#[tokio::test]
async fn helm_install_upgrade_under_writes_and_uninstall() -> anyhow::Result<()> {
    let Some(c) = in_cluster() else {
        return Ok(());
    };
    let _turn = TURN.lock().await;
    let mut guard = OnFailure::new(c);
    remove_installs(c)?;
    let dir = user_dir(c, "helm")?;
    with_helm(c, &install_doc_block(c, "### Install with Helm")?, &dir)?;
    let namespace = example_assigns(c, "helm", 50).await?;

    let kind = RingKind::ClusterRing;
    let client = c.client().await?;
    let old_pods =
        pods_running(&c.kubectl_json(&["-n", SYSTEM, "get", "pods", "-l", SHARDER_SELECTOR])?);
    let writer = Writer::start(&client, kind, &namespace, 50);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let upgrading = Instant::now();
    let script = install_doc_block(c, "### Upgrade with Helm")?;
    let helm = helm_dir()?;
    let shell_dir = dir.clone();
    // Off the test's runtime, so that the writer keeps writing while helm waits.
    tokio::task::spawn_blocking(move || {
        let c = in_cluster().context("no cluster")?;
        c.shell(
            &format!("export PATH={}:\"$PATH\"\n{script}", helm.display()),
            &shell_dir,
        )
    })
    .await??;
    // Writing on until the rollout is complete, whenever helm's wait returned.
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
    let took = upgrading.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (created, labelled) = writer.finish(took).await?;
    // Replicas and configuration changed, and the configuration change rolled every pod.
    let deployment = c.kubectl_json(&["-n", SYSTEM, "get", "deployment", "sharder"])?;
    ensure!(
        deployment["spec"]["replicas"] == 3 && deployment["status"]["readyReplicas"] == 3,
        "the sharder is not 3/3 Ready after the upgrade: {}",
        deployment["status"]
    );
    let config = c.kubectl_json(&["-n", SYSTEM, "get", "configmap", "sharder-config"])?;
    let text = config["data"]["config.yaml"].as_str().unwrap_or_default();
    ensure!(
        text.contains("syncPeriod: 2m"),
        "the configuration did not change: {text}"
    );
    let new_pods =
        pods_running(&c.kubectl_json(&["-n", SYSTEM, "get", "pods", "-l", SHARDER_SELECTOR])?);
    ensure!(
        new_pods.len() == 3 && !new_pods.iter().any(|p| old_pods.contains(p)),
        "the pods did not roll: before {old_pods:?}, after {new_pods:?}"
    );
    // 0 unassigned: every Secret, those of the upgrade included, on its shard with its ConfigMap.
    wait_converged(c, kind, &namespace, Duration::from_secs(60)).await?;
    eprintln!(
        "helm upgrade: {created} Secrets created while it and the rollout ran for {took:?}, {labelled} labelled \
         in admission, 0 refused, 0 unassigned after"
    );
    c.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;

    // The docs' uninstall, stopping before its last command (deleting the namespace) to check
    // what `helm uninstall` left there: only what Kubernetes puts in every namespace and the
    // sharder's own leader-election Lease, written at run time.
    let uninstall = install_doc_block(c, "### Uninstall with Helm")?;
    let (last, rest): (Vec<&str>, Vec<&str>) = uninstall
        .lines()
        .partition(|l| l.starts_with("kubectl delete namespace"));
    ensure!(last.len() == 1, "no namespace deletion in {uninstall:?}");
    with_helm(c, &rest.join("\n"), &dir)?;
    nothing_left(c, true)?;
    // The pods go after their Deployment, by the garbage collector, within their grace period.
    eventually(
        "nothing of the chart left in sharding-system",
        Duration::from_secs(90),
        || {
            let left = c.kubectl(&[
                "-n",
                SYSTEM,
                "get",
                "all,configmaps,secrets,serviceaccounts,roles,rolebindings,networkpolicies,\
                 poddisruptionbudgets,leases",
                "-o",
                "name",
            ])?;
            let unexpected = left.lines().any(|l| {
                !matches!(
                    l,
                    "configmap/kube-root-ca.crt"
                        | "serviceaccount/default"
                        | "lease.coordination.k8s.io/sharder"
                )
            });
            if unexpected {
                println!("left in {SYSTEM}: {}", left.replace('\n', " "));
            }
            Ok((!unexpected).then_some(()))
        },
    )
    .await?;
    c.shell(last[0], &dir)?;
    nothing_left(c, false)?;
    INSTALLED.store(false, Ordering::SeqCst);
    guard.passed();
    Ok(())
}

/// Runs without a node too: the blocks the tests above run are where they look for them.
#[test]
fn install_doc_blocks_are_found() -> anyhow::Result<()> {
    for heading in DOC_BLOCKS {
        let block = doc_block(heading)?;
        ensure!(
            block.contains("kubectl ") || block.contains("helm "),
            "{heading}: {block}"
        );
    }
    Ok(())
}
