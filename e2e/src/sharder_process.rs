//! Sharders of a test's own: their files, ports and settings ([`SharderFiles`]), the `sharder`
//! binary as a child process, and reading their per-resource counters ([`counter`]).
//!
//! Tests that need sharders of their own (leader election, a missed webhook) start them against a
//! [`DedicatedCluster`](crate::dedicated::DedicatedCluster), because every sharder on one cluster
//! takes part in the same leader election.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use crate::certs::generate_certificates;
use crate::net::{curl, free_port};
use crate::process::{Process, poll_until};

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
    /// Whether the metrics are served over HTTPS to authorized tokens only (`metrics.secure`).
    pub metrics_secure: bool,
}

/// The directory holds a CA's and a serving certificate's private keys: it goes with the files, so
/// test runs leave no keys behind. Processes started from it are dropped first (declared later),
/// and their logs live elsewhere ([`Process`]), so a failed test still prints its sharder's log.
impl Drop for SharderFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
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
    /// Most patches in flight per ring (default: the sharder's).
    pub concurrent_moves: u32,
    /// `controller.sharder.shardsLeaveControlledObjects`.
    pub shards_leave_controlled_objects: bool,
    /// `metrics.secure`: HTTPS with the serving certificate, and a token allowed to get
    /// `/metrics` for every scrape ([`SharderFiles::scrape_metrics`]). Off by default, unlike the
    /// shipped configuration: the tests and tools read counters with a plain
    /// [`SharderFiles::metrics`], and the config file says `secure: false` explicitly.
    pub metrics_secure: bool,
    /// `metrics.tokenAudiences`: audiences a scraper's token must be issued for; empty: the API
    /// server's.
    pub metrics_token_audiences: Vec<String>,
}

impl Default for SharderSettings {
    fn default() -> Self {
        Self {
            leader_election: (4, 3, 1),
            sync_period: "5m".into(),
            webhook_url: None,
            drain_timeout: "15s".into(),
            concurrent_moves: kube_sharding_api::config::SharderController::default()
                .concurrent_moves,
            shards_leave_controlled_objects: false,
            metrics_secure: false,
            metrics_token_audiences: Vec::new(),
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
        Self::create_in(&std::env::temp_dir(), kubeconfig, settings, webhook_port)
    }

    /// Like [`SharderFiles::create_with_webhook_port`], in a new directory under `parent`.
    pub fn create_in(
        parent: &Path,
        kubeconfig: &Path,
        settings: &SharderSettings,
        webhook_port: u16,
    ) -> anyhow::Result<Self> {
        // The sharder's ServiceAccount with the shipped RBAC, never the tests' administrator.
        let kubeconfig = crate::sharder_identity::sharder_kubeconfig(kubeconfig)?;
        let dir = parent.join(crate::unique_name("sharder"));
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
  secure: {metrics_secure}
  tokenAudiences: {audiences}
controller:
  sharder:
    syncPeriod: {sync}
    drainTimeout: {drain_timeout}
    concurrentMoves: {concurrent_moves}
    shardsLeaveControlledObjects: {leave}
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
            leave = settings.shards_leave_controlled_objects,
            metrics_secure = settings.metrics_secure,
            audiences = serde_json::to_string(&settings.metrics_token_audiences)?,
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
            metrics_secure: settings.metrics_secure,
        })
    }

    /// The parsed configuration.
    pub fn load(&self) -> anyhow::Result<kube_sharding_api::config::SharderConfig> {
        kube_sharder::load_config(Some(&self.config))
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

    /// Like [`SharderFiles::start_process`], running the sharder executable at `path` (another
    /// build) with extra environment variables `envs`.
    pub fn start_process_at<E, K, V>(&self, path: &Path, envs: E) -> anyhow::Result<Process>
    where
        E: IntoIterator<Item = (K, V)>,
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        Process::start_binary(
            path,
            "sharder",
            [
                "--config".as_ref(),
                self.config.as_os_str(),
                "--log-format=json".as_ref(),
            ],
            envs,
        )
    }

    /// Base URL of the webhook server.
    pub fn webhook_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.webhook_port)
    }

    /// Text of `/metrics`, served over plain HTTP (see [`SharderSettings::metrics_secure`]).
    pub fn metrics(&self) -> anyhow::Result<String> {
        anyhow::ensure!(
            !self.metrics_secure,
            "this sharder's metrics need a token: use scrape_metrics"
        );
        curl(&["-sf", &self.metrics_url()])
    }

    /// URL of `/metrics`: `https` when the metrics are secure.
    pub fn metrics_url(&self) -> String {
        let scheme = if self.metrics_secure { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}/metrics", self.metrics_port)
    }

    /// GETs `/metrics` with `token` as the bearer token, if any, verifying the server against
    /// the test CA; returns the HTTP status and body, whatever the status.
    pub fn scrape_metrics(&self, token: Option<&str>) -> anyhow::Result<(u16, String)> {
        let url = self.metrics_url();
        let ca = self.ca.display().to_string();
        let authorization = token.map(|t| format!("Authorization: Bearer {t}"));
        let mut args = vec![
            "-sS",
            "--max-time",
            "10",
            "--cacert",
            &ca,
            "-w",
            "\n%{http_code}",
        ];
        if let Some(header) = &authorization {
            args.extend(["-H", header.as_str()]);
        }
        args.push(&url);
        let out = curl(&args)?;
        let (text, code) = out.rsplit_once('\n').context("curl printed no status")?;
        Ok((code.trim().parse()?, text.to_string()))
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
    ///
    /// Over HTTP/1.1: for a path it does not serve the sharder answers before reading the body
    /// and, over HTTP/2, then resets the stream with `NO_ERROR`, as RFC 9113 §8.1 allows. The API
    /// server's client takes that answer; curl 7.88 (Debian bookworm's) fails with error 92 when
    /// the reset arrives before it sent the whole body, which happened in 2 of 30 posts of `{}`
    /// to `/wrong/path` on an idle machine and in 171 of 400 on a busy one (none of 600 over
    /// HTTP/1.1).
    pub fn post_webhook(&self, path: &str, body: &[u8]) -> anyhow::Result<(u16, String)> {
        let body_file = self
            .dir
            .join(format!("{}.json", crate::unique_name("body")));
        std::fs::write(&body_file, body)?;
        let out = curl(&[
            "-sS",
            "--http1.1",
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
    let ring = kube_sharding_api::RingRef::new(kube_sharding_api::RingKind::ClusterRing, ring);
    counter_of(metrics, metric, &ring, resource)
}

/// [`counter`] for a ring of either kind: a ControllerRing's series carry `controllerring`.
pub fn counter_of(
    metrics: &str,
    metric: &str,
    ring: &kube_sharding_api::RingRef,
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
