//! The sharder shared by all tests of a process ([`shared`]).
//!
//! It runs in-process through the library on a thread of its own (so it can never outlive the
//! tests), against the shared cluster. Its logs go to a file a test prints when it fails through
//! [`SharedSharder::dump_on_failure`].

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::cluster;
use crate::logs::DumpOnFailure;
use crate::net::free_port;
use crate::sharder_process::{SharderFiles, SharderSettings, counter, counter_of};

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

    /// [`SharedSharder::counter`] for a ring of either kind.
    pub fn counter_of(
        &self,
        metric: &str,
        ring: &kube_sharding_api::RingRef,
        resource: &str,
    ) -> anyhow::Result<u64> {
        counter_of(&self.files.metrics()?, metric, ring, resource)
    }

    /// Its log records so far, in order: JSON objects with the fields at the top level, as the
    /// sharder prints them with `--log-format=json` (every test of the process writes to it;
    /// match records by their `event`, see `kube_sharder::records`).
    pub fn records(&self) -> anyhow::Result<Vec<serde_json::Value>> {
        let text = std::fs::read_to_string(&self.log)
            .with_context(|| format!("failed to read {}", self.log.display()))?;
        Ok(text
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(serde_json::Value::is_object)
            .collect())
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
    // Plain metrics, said explicitly: most tests read its counters with a plain scrape. The secure
    // metrics have tests of their own, on sharders of their own.
    let settings = SharderSettings {
        metrics_secure: false,
        ..SharderSettings::default()
    };
    // It lives as long as the test process and is never dropped: its keys go with the control
    // plane's directory, which is removed when the process ends, and its log beside the other
    // processes' logs.
    let parent = cluster
        .state_dir()
        .map_or_else(std::env::temp_dir, Path::to_path_buf);
    let files = SharderFiles::create_in(&parent, cluster.kubeconfig(), &settings, free_port()?)?;
    let config = files.load()?;
    let log = crate::process::log_dir()?.join(crate::unique_name("shared-sharder") + ".log");
    let log_file = std::fs::File::create(&log)?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .json()
        .flatten_event(true)
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
            if let Err(error) =
                runtime.block_on(kube_sharder::run(config, "e2e-shared".into(), token))
            {
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
