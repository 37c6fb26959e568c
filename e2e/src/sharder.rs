//! The sharder in end-to-end tests.
//!
//! [`shared`] runs one sharder for the whole test process, in-process through the library on a
//! thread of its own (so it can never outlive the tests), against the shared cluster. Its logs go
//! to a file a test prints when it fails through [`SharedSharder::dump_on_failure`]. Tests that
//! need sharders of their own (leader election, a missed webhook) start real processes with
//! [`SharderFiles`] against a dedicated control plane ([`DedicatedCluster`]), because every
//! sharder on one cluster takes part in the same leader election.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio_util::sync::CancellationToken;

use crate::logs::DumpOnFailure;
use crate::process::{Process, poll_until};
use crate::{Cluster, cluster, control_plane_script};

/// A free TCP port on loopback, never one this process handed out before. The port is closed
/// again before use, so another process may still take it (rare); handing each port out once
/// keeps two sharders configured before either has started from getting the same one.
pub fn free_port() -> anyhow::Result<u16> {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    for _ in 0..100 {
        let listener = TcpListener::bind("127.0.0.1:0").context("failed to find a free port")?;
        let port = listener.local_addr()?.port();
        let mut handed_out = HANDED_OUT
            .lock()
            .map_err(|_| anyhow::anyhow!("port registry poisoned"))?;
        if handed_out.insert(port) {
            return Ok(port);
        }
    }
    anyhow::bail!("no free port found that was not handed out before")
}

/// Files and addresses of one sharder instance: serving certificate, CA, config.
#[derive(Debug)]
pub struct SharderFiles {
    /// Directory holding everything.
    pub dir: PathBuf,
    /// The SharderConfig file.
    pub config: PathBuf,
    /// CA bundle that signed the webhook serving certificate.
    pub ca: PathBuf,
    /// Webhook port on 127.0.0.1.
    pub webhook_port: u16,
    /// Metrics port on 127.0.0.1.
    pub metrics_port: u16,
    /// Health port on 127.0.0.1.
    pub health_port: u16,
}

/// Settings that differ between test sharders.
#[derive(Clone, Debug)]
pub struct SharderSettings {
    /// Lease timing of leader election, in seconds: duration, renew deadline, retry period.
    pub leader_election: (u32, u32, u32),
    /// Periodic sync interval.
    pub sync_period: String,
    /// Base URL the API server calls the webhook at; `None`: the sharder's own webhook port.
    pub webhook_url: Option<String>,
    /// How long drains may wait before the sharder warns (short, so a test can see it).
    pub drain_timeout: String,
    /// Most patches in flight per ring.
    pub concurrent_moves: u32,
}

impl Default for SharderSettings {
    fn default() -> Self {
        Self {
            leader_election: (4, 3, 1),
            sync_period: "5m".into(),
            webhook_url: None,
            drain_timeout: "15s".into(),
            concurrent_moves: 100,
        }
    }
}

impl SharderFiles {
    /// Creates certificates (CA + serving certificate for 127.0.0.1) and a config file that
    /// registers the webhook by URL on loopback, with the CA bundle from a file.
    pub fn create(kubeconfig: &Path, settings: &SharderSettings) -> anyhow::Result<Self> {
        Self::create_with_webhook_port(kubeconfig, settings, free_port()?)
    }

    /// Like [`SharderFiles::create`], with the webhook server on `webhook_port` (for a test that
    /// puts something in front of it before the sharder starts).
    pub fn create_with_webhook_port(
        kubeconfig: &Path,
        settings: &SharderSettings,
        webhook_port: u16,
    ) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(crate::unique_name("sharder"));
        std::fs::create_dir_all(&dir)?;
        generate_certificates(&dir)?;
        let (metrics_port, health_port) = (free_port()?, free_port()?);
        let (duration, deadline, retry) = settings.leader_election;
        let config = format!(
            r#"apiVersion: config.sharding.timebertt.dev/v1alpha1
kind: SharderConfig
clientConnection:
  kubeconfig: {kubeconfig}
leaderElection:
  leaderElect: true
  leaseDuration: {duration}s
  renewDeadline: {deadline}s
  retryPeriod: {retry}s
health:
  bindAddress: 127.0.0.1:{health_port}
metrics:
  bindAddress: 127.0.0.1:{metrics_port}
controller:
  sharder:
    syncPeriod: {sync}
    drainTimeout: {drain_timeout}
    concurrentMoves: {concurrent_moves}
webhook:
  server:
    bindAddress: 127.0.0.1:{webhook_port}
    certDir: {dir}
  config:
    clientConfig:
      url: {webhook_url}
      caBundleFile: {dir}/ca.crt
gracefulShutdown: 5s
shutdownDelay: 1s
"#,
            kubeconfig = kubeconfig.display(),
            dir = dir.display(),
            sync = settings.sync_period,
            drain_timeout = settings.drain_timeout,
            concurrent_moves = settings.concurrent_moves,
            webhook_url = settings
                .webhook_url
                .clone()
                .unwrap_or_else(|| format!("https://127.0.0.1:{webhook_port}")),
        );
        let config_path = dir.join("config.yaml");
        std::fs::write(&config_path, config)?;
        Ok(Self {
            ca: dir.join("ca.crt"),
            config: config_path,
            dir,
            webhook_port,
            metrics_port,
            health_port,
        })
    }

    /// The parsed configuration.
    pub fn load(&self) -> anyhow::Result<sharding_crds::config::SharderConfig> {
        sharder::load_config(Some(&self.config))
    }

    /// Starts the `sharder` binary with this config as a child process.
    pub fn start_process(&self) -> anyhow::Result<Process> {
        Process::start(
            "sharder",
            [
                "--config".as_ref(),
                self.config.as_os_str(),
                "--log-format=json".as_ref(),
            ],
        )
    }

    /// Base URL of the webhook server.
    pub fn webhook_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.webhook_port)
    }

    /// Text of `/metrics`.
    pub fn metrics(&self) -> anyhow::Result<String> {
        curl(&[
            "-sf",
            &format!("http://127.0.0.1:{}/metrics", self.metrics_port),
        ])
    }

    /// Waits until `/readyz` answers 200.
    pub async fn wait_ready(&self, timeout: Duration) -> anyhow::Result<()> {
        let url = format!("http://127.0.0.1:{}/readyz", self.health_port);
        poll_until("sharder /readyz", timeout, || {
            let ok = curl(&["-sf", &url]).is_ok();
            async move { Ok(ok.then_some(())) }
        })
        .await
    }

    /// POSTs `body` to the webhook server at `path`; returns the HTTP status and body.
    pub fn post_webhook(&self, path: &str, body: &[u8]) -> anyhow::Result<(u16, String)> {
        let body_file = self
            .dir
            .join(format!("{}.json", crate::unique_name("body")));
        std::fs::write(&body_file, body)?;
        let out = curl(&[
            "-s",
            "--cacert",
            &self.ca.display().to_string(),
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            &format!("@{}", body_file.display()),
            "-w",
            "\n%{http_code}",
            &format!("{}{path}", self.webhook_url()),
        ]);
        let _ = std::fs::remove_file(&body_file);
        let out = out?;
        let (text, code) = out.rsplit_once('\n').context("curl printed no status")?;
        Ok((code.trim().parse()?, text.to_string()))
    }
}

/// Value of the sharder's per-resource counter `metric` (the sample's name, e.g.
/// `controller_sharding_drains_total`) for `ring` and the core-group `resource` in the `/metrics`
/// text `metrics`; 0 while the series is absent, as a labelled series appears only once counted.
///
/// Labels are matched in the order the sharder writes them: `clusterring`, `group`, `resource`.
pub fn counter(metrics: &str, metric: &str, ring: &str, resource: &str) -> anyhow::Result<u64> {
    let ring = sharding_crds::RingRef::new(sharding_crds::RingKind::ClusterRing, ring);
    counter_of(metrics, metric, &ring, resource)
}

/// [`counter`] for a ring of either kind: a ControllerRing's series carry `controllerring`.
pub fn counter_of(
    metrics: &str,
    metric: &str,
    ring: &sharding_crds::RingRef,
    resource: &str,
) -> anyhow::Result<u64> {
    let (label, name) = (ring.kind.metric_label(), &ring.name);
    let prefix = format!(r#"{metric}{{{label}="{name}",group="",resource="{resource}"}} "#);
    let value = metrics.lines().find_map(|l| l.strip_prefix(&prefix));
    Ok(value
        .map(|v| v.trim().parse())
        .transpose()
        .with_context(|| format!("unexpected value of {prefix}: {value:?}"))?
        .unwrap_or(0))
}

/// Runs curl with `args` and returns what it printed; fails when curl exits non-zero (with `-f`,
/// also on an HTTP error status).
pub fn curl(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("curl")
        .args(args)
        .output()
        .context("failed to run curl")?;
    if !out.status.success() {
        bail!(
            "curl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Writes a test CA (`ca.crt`, `ca.key`) and a serving certificate for 127.0.0.1 and localhost
/// signed by it (`tls.crt`, `tls.key`) into `dir`, with openssl.
pub fn generate_certificates(dir: &Path) -> anyhow::Result<()> {
    let script = r#"set -e
openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=sharder-test-ca" -keyout ca.key -out ca.crt
openssl req -newkey rsa:2048 -nodes -subj "/CN=sharder" -keyout tls.key -out tls.csr
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' > tls.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 -extfile tls.ext -out tls.crt
"#;
    let out = Command::new("bash")
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .output()
        .context("failed to run openssl")?;
    if !out.status.success() {
        bail!("openssl failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// The sharder shared by all tests of this process.
#[derive(Debug)]
pub struct SharedSharder {
    /// Its files and ports.
    pub files: SharderFiles,
    log: PathBuf,
}

impl SharedSharder {
    /// The current value of its per-resource counter `metric` for `ring` and core `resource`:
    /// [`counter`] of a fresh [`SharderFiles::metrics`].
    pub fn counter(&self, metric: &str, ring: &str, resource: &str) -> anyhow::Result<u64> {
        counter(&self.files.metrics()?, metric, ring, resource)
    }

    /// Its metrics in the Prometheus text format.
    pub fn metrics(&self) -> anyhow::Result<String> {
        self.files.metrics()
    }

    /// `host:port` of its metrics server, for a scraper the test runs (always loopback).
    pub fn metrics_address(&self) -> String {
        format!("127.0.0.1:{}", self.files.metrics_port)
    }

    /// [`SharedSharder::counter`] for a ring of either kind.
    pub fn counter_of(
        &self,
        metric: &str,
        ring: &sharding_crds::RingRef,
        resource: &str,
    ) -> anyhow::Result<u64> {
        counter_of(&self.files.metrics()?, metric, ring, resource)
    }

    /// A guard that prints the sharder's log unless the test calls
    /// [`DumpOnFailure::passed`]: take it at the start of a test that uses the shared sharder.
    pub fn dump_on_failure(&self) -> DumpOnFailure {
        DumpOnFailure::new("the shared sharder", &self.log)
    }
}

static SHARED: OnceLock<Result<SharedSharder, String>> = OnceLock::new();

/// The shared sharder, started on first use and ready (caches synced, certificate loaded).
pub fn shared() -> &'static SharedSharder {
    let result = SHARED.get_or_init(|| start_shared().map_err(|e| format!("{e:#}")));
    match result {
        Ok(s) => s,
        Err(e) => panic!("failed to start the shared sharder: {e}"),
    }
}

fn start_shared() -> anyhow::Result<SharedSharder> {
    let cluster = cluster();
    let files = SharderFiles::create(cluster.kubeconfig(), &SharderSettings::default())?;
    let config = files.load()?;
    let log = files.dir.join("sharder.log");
    let log_file = std::fs::File::create(&log)?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(log_file))
        .try_init();
    std::thread::Builder::new()
        .name("shared-sharder".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(error) => {
                    tracing::error!(%error, "failed to start a runtime for the shared sharder");
                    return;
                }
            };
            // Never cancelled: the sharder lives as long as the test process.
            let token = CancellationToken::new();
            if let Err(error) = runtime.block_on(sharder::run(config, "e2e-shared".into(), token)) {
                tracing::error!(error = %format!("{error:#}"), "shared sharder failed");
            }
        })?;
    // Wait on a runtime of our own: callers may be inside theirs.
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(files.wait_ready(Duration::from_secs(60)))
        })
        .join()
        .map_err(|_| anyhow::anyhow!("waiting for the shared sharder panicked"))?
    })
    .with_context(|| format!("shared sharder not ready; its log is {}", log.display()))?;
    Ok(SharedSharder { files, log })
}

/// A control plane of its own for one test, stopped when dropped.
#[derive(Debug)]
pub struct DedicatedCluster {
    cluster: Cluster,
    dir: PathBuf,
}

impl DedicatedCluster {
    /// Starts a control plane (about 10 s) and installs the CRD. Fails when the suite
    /// runs against an external cluster (`KUBECONFIG`), where no second control plane can start.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with_apiserver_args(&[]).await
    }

    /// [`DedicatedCluster::start`] with `args` added to kube-apiserver's flags (a feature gate a
    /// test needs set otherwise).
    pub async fn start_with_apiserver_args(args: &[&str]) -> anyhow::Result<Self> {
        if cluster().state_dir().is_none() {
            bail!("dedicated control planes need the local control plane (KUBECONFIG is set)");
        }
        let dir = std::env::temp_dir().join(crate::unique_name("controller-sharding-dedicated"));
        let status = tokio::process::Command::new("bash")
            .arg(control_plane_script())
            .arg("start")
            .arg(&dir)
            .arg(std::process::id().to_string())
            .env("KUBE_APISERVER_EXTRA_ARGS", args.join(" "))
            .status()
            .await?;
        if !status.success() {
            bail!("failed to start a dedicated control plane");
        }
        let cluster = Cluster::external(dir.join("kubeconfig"), Some(dir.clone()));
        cluster.prepare().await?;
        Ok(Self { cluster, dir })
    }

    /// The cluster.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Client URL of its etcd (plain HTTP on loopback), for [`crate::etcd`].
    pub fn etcd_endpoint(&self) -> anyhow::Result<String> {
        let path = self.dir.join("etcd-endpoint");
        let endpoint = std::fs::read_to_string(&path)
            .with_context(|| format!("failed to read {}", path.display()))?;
        Ok(endpoint.trim().to_string())
    }
}

impl Drop for DedicatedCluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(control_plane_script())
            .arg("stop")
            .arg(&self.dir)
            .status();
    }
}
