//! The product installed the way users install it: a control plane with a real node
//! (`e2e/control-plane.sh start DIR OWNER --node`: containerd, kubelet, kube-proxy,
//! kube-scheduler), the images built offline from the product's own Dockerfiles
//! (`e2e/images.sh`) and imported into the node, and everything else done with `kubectl` and the
//! API, as a user would.
//!
//! The first call to [`in_cluster`] in a test process sets this up (about a minute with the
//! binaries and images cached); later calls reuse it. A watchdog stops the control plane and the
//! node, and removes everything they made, when the test process exits. Where a node cannot run
//! (not root), [`in_cluster`] returns `None` after printing why, and the tests skip.
//!
//! This is a cluster of its own, apart from the shared one of [`crate::cluster`]: the sharder
//! installed here watches every ring of its cluster and holds the leader-election Lease
//! `sharding-system/sharder`, which would collide with the sharders the other tests start.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, bail};
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::{control_plane_script, run};

/// File name of the API server's audit log in the state directory: every write the sharder's
/// ServiceAccount sends, one JSON event per line.
pub const AUDIT_LOG: &str = "audit.log";

/// The longest a script of [`InCluster::shell`] may run: far longer than any README block takes
/// on the test node, where the install with its image pulls takes the longest.
pub const SHELL_TIMEOUT: Duration = Duration::from_secs(600);

/// The cluster with a node, its state directory and kubeconfig.
#[derive(Debug)]
pub struct InCluster {
    dir: PathBuf,
    kubeconfig: PathBuf,
}

static IN_CLUSTER: OnceLock<Result<Option<InCluster>, String>> = OnceLock::new();

/// The cluster with a node, set up on first use; `None` (with the reason printed) where no node
/// can run here.
///
/// Panics with the set-up error, which fails the calling test with a clear message.
pub fn in_cluster() -> Option<&'static InCluster> {
    let result = IN_CLUSTER.get_or_init(|| InCluster::set_up().map_err(|e| format!("{e:#}")));
    match result {
        Ok(Some(cluster)) => Some(cluster),
        Ok(None) => {
            eprintln!("skipped: {}", skip_reason().unwrap_or_default());
            None
        }
        Err(e) => panic!("failed to set up the cluster with a node: {e}"),
    }
}

/// Why the in-cluster tests cannot run here, if they cannot.
fn skip_reason() -> Option<String> {
    if std::env::var_os("KUBECONFIG").is_some_and(|k| !k.is_empty()) {
        return Some(
            "the in-cluster tests start a control plane with a node of their own; they do not run \
             with KUBECONFIG set"
                .into(),
        );
    }
    let out = Command::new("bash")
        .arg(control_plane_script())
        .arg("node-support")
        .output()
        .ok()?;
    if out.status.success() {
        None
    } else {
        Some(format!(
            "the in-cluster tests need a node, and {}",
            String::from_utf8_lossy(&out.stdout).trim()
        ))
    }
}

/// The workspace root: the directory `kubectl apply -k config/...` runs in, as in the README.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ has a parent")
        .to_path_buf()
}

/// The directory of the release before this checkout's (`e2e/images.sh previous-release`): its
/// bundle (`install.yaml`, `admission-policies.yaml`, `example.yaml`), both images as OCI archives,
/// and `tag`, the tag they carry. Built from the checkout's history the first time (several
/// minutes) and cached.
pub fn previous_release() -> anyhow::Result<PathBuf> {
    let out = Command::new("bash")
        .arg(workspace_root().join("e2e/images.sh"))
        .arg("previous-release")
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("failed to run e2e/images.sh previous-release")?;
    if !out.status.success() {
        bail!("e2e/images.sh previous-release failed with {}", out.status);
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

impl InCluster {
    fn set_up() -> anyhow::Result<Option<Self>> {
        if skip_reason().is_some() {
            return Ok(None);
        }
        let script = control_plane_script();
        run(Command::new("bash").arg(&script).arg("provision"))?;
        let images = workspace_root().join("target").join("e2e-images");
        run(Command::new("bash")
            .arg(workspace_root().join("e2e").join("images.sh"))
            .arg("build")
            .arg(&images))?;
        let dir = std::env::temp_dir().join(format!(
            "controller-sharding-in-cluster-{}",
            std::process::id()
        ));
        // The API server logs every write of the sharder's ServiceAccount (e2e/node/
        // audit-policy.yaml), so a test can read what the sharder sent.
        let audit = format!(
            "--audit-policy-file {} --audit-log-path {} --audit-log-format json",
            workspace_root()
                .join("e2e/node/audit-policy.yaml")
                .display(),
            dir.join(AUDIT_LOG).display()
        );
        run(Command::new("bash")
            .arg(&script)
            .arg("start")
            .arg(&dir)
            .arg(std::process::id().to_string())
            .arg("--node")
            .env("KUBE_APISERVER_EXTRA_ARGS", audit))?;
        let cluster = Self {
            kubeconfig: dir.join("kubeconfig"),
            dir,
        };
        cluster.load_images(&images)?;
        Ok(Some(cluster))
    }

    /// Imports the two images (`sharder.tar`, `checksum-controller.tar`) of `dir`, as
    /// `e2e/images.sh` writes them, into the node's containerd under the tags they were built with.
    pub fn load_images(&self, dir: &Path) -> anyhow::Result<()> {
        run(Command::new("bash")
            .arg(control_plane_script())
            .arg("load-images")
            .arg(&self.dir)
            .arg(dir.join("sharder.tar"))
            .arg(dir.join("checksum-controller.tar")))
    }

    /// Path of the kubeconfig (cluster admin).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Directory with the logs of the control plane and the node's components.
    pub fn state_dir(&self) -> &Path {
        &self.dir
    }

    /// A fresh client for this cluster (clients are bound to the runtime they were made on).
    pub async fn client(&self) -> anyhow::Result<Client> {
        Ok(Client::try_from(self.config().await?)?)
    }

    /// The client configuration for this cluster, for a client made on another runtime.
    pub async fn config(&self) -> anyhow::Result<kube::Config> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig)
            .with_context(|| format!("failed to read {}", self.kubeconfig.display()))?;
        let mut config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .context("failed to load kubeconfig")?;
        // The tests must see a 429 (a PodDisruptionBudget refusing an eviction), not have the
        // client retry it for minutes.
        config.default_retry = false;
        Ok(config)
    }

    /// Runs kubectl with `args` in the workspace root; its standard output, or an error with its
    /// standard error.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new(crate::kubectl())
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .current_dir(workspace_root())
            .output()
            .context("failed to run kubectl")?;
        if !out.status.success() {
            bail!(
                "kubectl {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// [`Self::kubectl`] on a blocking thread. The tests run on a single-threaded runtime, so a
    /// long synchronous call (`kubectl rollout status`) would hold up their background tasks
    /// (a steady writer, say) for as long as it runs.
    pub async fn kubectl_beside_tasks(&'static self, args: &[&str]) -> anyhow::Result<String> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            self.kubectl(&args)
        })
        .await
        .context("kubectl's thread failed")?
    }

    /// `kubectl ... -o json`, parsed.
    pub fn kubectl_json(&self, args: &[&str]) -> anyhow::Result<serde_json::Value> {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let text = self.kubectl(&all)?;
        serde_json::from_str(&text)
            .with_context(|| format!("kubectl {} gave no JSON", args.join(" ")))
    }

    /// Runs a shell script as a user would type it (`bash -euo pipefail`), with this cluster's
    /// kubeconfig, the test kubectl first on `PATH`, in `cwd`; its standard output. A script
    /// still running after [`SHELL_TIMEOUT`] is stopped and fails (a README loop that waits for
    /// something that never comes must not hang the suite).
    pub fn shell(&self, script: &str, cwd: &Path) -> anyhow::Result<String> {
        let kubectl_dir = crate::kubectl()
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let path = format!(
            "{}:{}",
            kubectl_dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = Command::new("timeout")
            .arg(SHELL_TIMEOUT.as_secs().to_string())
            .args(["bash", "-euo", "pipefail", "-c", script])
            .env("KUBECONFIG", &self.kubeconfig)
            .env("PATH", path)
            .current_dir(cwd)
            .output()
            .context("failed to run bash")?;
        if !out.status.success() {
            bail!(
                "the script failed ({}):\n{script}\nstdout: {}\nstderr: {}",
                out.status,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// Kills a container with SIGKILL through the node's containerd, as the kernel's OOM killer
    /// or a crash would: no signal handler runs. `container_id` is a pod status's `containerID`
    /// (`containerd://<id>`).
    pub fn kill_container(&self, container_id: &str) -> anyhow::Result<()> {
        let id = container_id
            .strip_prefix("containerd://")
            .with_context(|| format!("not a containerd container: {container_id}"))?;
        let socket = self.dir.join("node/containerd/containerd.sock");
        run(Command::new("ctr")
            .arg("--address")
            .arg(&socket)
            .args(["-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", id]))
    }

    /// What a maintainer needs to see when an in-cluster test fails: pods, events, the sharder's
    /// and the shards' logs, and the end of the node's component logs.
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        let mut section = |title: &str, args: &[&str]| {
            out.push_str(&format!("--- {title}\n"));
            match self.kubectl(args) {
                Ok(text) => out.push_str(&tail(&text, 80)),
                Err(e) => out.push_str(&format!("{e:#}\n")),
            }
        };
        section("pods", &["get", "pods", "-A", "-o", "wide"]);
        section(
            "events",
            &["get", "events", "-A", "--sort-by=.lastTimestamp"],
        );
        section(
            "sharder logs",
            &[
                "logs",
                "-n",
                "sharding-system",
                "-l",
                "app.kubernetes.io/component=sharder",
                "--tail=60",
                "--prefix",
            ],
        );
        section(
            "shard logs",
            &[
                "logs",
                "-n",
                "checksum-controller",
                "-l",
                "app.kubernetes.io/name=checksum-controller",
                "--tail=20",
                "--prefix",
            ],
        );
        for log in ["kubelet.log", "kube-apiserver.log", "containerd.log"] {
            let text = std::fs::read_to_string(self.dir.join(log)).unwrap_or_default();
            out.push_str(&format!("--- {log}\n{}", tail(&text, 30)));
        }
        out
    }
}

/// Prints [`InCluster::diagnostics`] when dropped before [`OnFailure::passed`]: on an early `?`
/// or a panic.
#[derive(Debug)]
pub struct OnFailure {
    cluster: &'static InCluster,
    passed: bool,
}

impl OnFailure {
    /// A guard for the test that is starting.
    pub fn new(cluster: &'static InCluster) -> Self {
        Self {
            cluster,
            passed: false,
        }
    }

    /// The test passed: print nothing.
    pub fn passed(&mut self) {
        self.passed = true;
    }
}

impl Drop for OnFailure {
    fn drop(&mut self) {
        if !self.passed {
            eprintln!("{}", self.cluster.diagnostics());
        }
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    let start = all.len().saturating_sub(lines);
    let mut out = all[start..].join("\n");
    out.push('\n');
    out
}

/// Waits (polling every 500 ms) until `check` gives `Some`, for at most `timeout`; the error
/// names `what` and the last check's error, if any.
pub async fn eventually<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last_error = match check() {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => None,
            Err(e) => Some(e),
        };
        if tokio::time::Instant::now() >= deadline {
            match last_error {
                Some(e) => bail!("timed out after {timeout:?} waiting for {what}: {e:#}"),
                None => bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
