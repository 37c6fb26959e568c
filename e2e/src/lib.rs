//! Harness for end-to-end tests against a real kube-apiserver and etcd.
//!
//! The first call to [`cluster`] in a test process starts one control plane (etcd,
//! kube-apiserver, kube-controller-manager) on loopback through `e2e/control-plane.sh`
//! (provisioning and caching the binaries on first use); every later call, from any test, reuses
//! it. A watchdog stops it when the test process exits. When
//! `KUBECONFIG` is set, tests run against that cluster instead (kind, or a real one), and nothing
//! is started.
//!
//! Each test works in its own namespace ([`Cluster::namespace`]) with unique names
//! ([`unique_name`]), so tests in one process can run in parallel.
//!
//! Helpers the tests and the tools under `e2e/loadtest` share, each written once:
//!
//! | helper | what |
//! |---|---|
//! | [`shared_sharder::shared`] | the shared in-process sharder |
//! | [`sharder_process::SharderFiles`] | files, ports and processes of sharders of their own |
//! | [`dedicated::DedicatedCluster`] | a control plane of its own for one test |
//! | [`certs::generate_certificates`] | a test CA and a serving certificate for 127.0.0.1 (the one generator, `e2e/certs.sh`) |
//! | [`net::free_port`] | a free port on loopback, never handed out twice |
//! | [`process::Process`], [`process::poll_until`] | the workspace's binaries as child processes; waiting on a condition |
//! | [`logs::DumpOnFailure`] | prints a log when a test fails (an early `?` or a panic); [`shared_sharder::SharedSharder::dump_on_failure`] for the shared sharder |
//! | [`scenario::SharedScenario`], [`scenario::DedicatedScenario`] | the opening of a test: sharder, log guard, cluster, client, namespace |
//! | [`fixtures::expected_shard`] | the shard a ring assigns a Secret to |
//! | [`fixtures::secret_review`] | an `admission.k8s.io/v1` AdmissionReview of a Secret CREATE |
//! | [`Cluster::apiserver_metric`] | a metric from the API server's own `/metrics` |
//! | [`metrics_access`] | ServiceAccount tokens from the TokenRequest API, bound to the shipped `sharding:metrics-reader`, for the secure metrics ([`sharder_process::SharderFiles::scrape_metrics`]) |
//! | [`sharder_process::counter`] | a per-resource counter from the sharder's `/metrics` text |
//! | [`prometheus`] | sums and samples of any Prometheus text; the API server's whole `/metrics` |
//! | [`net::curl`] | an HTTP request through curl (metrics, health, a Prometheus server's API) |
//! | [`fixtures`] | rings, shard Leases and Secrets; waits on a ring's status and webhook; checksum-controller shards |
//! | [`etcd::Compactor`] | compacts a dedicated control plane's etcd again and again, so continue tokens expire |
//! | [`IndependentRing`] | a hash ring written from the protocol's description, to check the sharder's answers against |
//! | [`trivial_webhook`] | a webhook that answers every review with one constant patch, served like the sharder's over TLS on loopback ([`trivial_webhook::loopback_tls`]) |
//! | [`webhook_client::WebhookClient`] | admission reviews sent by the thousand to a sharder's webhook over one HTTP/2 connection |
//! | [`latency::Latencies`] | nearest-rank percentiles of latency samples |
//! | [`in_cluster::in_cluster`] | a control plane with a node, the product images loaded, for tests that install the product as users do |
//! | [`sharded_watch`] | whether the API server filters by `shardSelector` (gate `ShardedListAndWatch`); a control plane with the gate off |
//! | [`apiserver::ApiServer`] | restarting kube-apiserver of a control plane the harness started (a [`dedicated::DedicatedCluster`], never the shared one) |

pub mod apiserver;
pub mod certs;
pub mod dedicated;
pub mod docs;
pub mod etcd;
pub mod fixtures;
pub mod gate;
pub mod helm;
pub mod in_cluster;
mod independent_ring;
pub mod latency;
pub mod logs;
pub mod metrics_access;
pub mod net;
pub mod process;
pub mod prometheus;
pub mod renewals;
pub mod scenario;
pub mod sharded_watch;
pub mod sharder_identity;
pub mod sharder_process;
pub mod shared_sharder;
pub mod trivial_webhook;
pub mod webhook_client;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Config};

pub use self::independent_ring::IndependentRing;

/// Field manager of every write the harness makes.
pub const FIELD_MANAGER: &str = "controller-sharding-e2e";

/// Parameters of the harness's merge patches: [`FIELD_MANAGER`], nothing else.
pub fn patch_params() -> kube::api::PatchParams {
    kube::api::PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..kube::api::PatchParams::default()
    }
}

/// Label the API server puts on every namespace (its name); rings' selectors in the tests use it.
pub const LABEL_NAMESPACE_NAME: &str = "kubernetes.io/metadata.name";

/// Oldest API server minor version (1.x) the suite runs against: the ClusterRing CRD's CEL
/// validation rule is GA and always evaluated from 1.29 on, and the tests assert its message.
pub const MIN_SERVER_MINOR: u32 = 29;

/// Oldest API server minor version (1.x) that serves ValidatingAdmissionPolicy in
/// `admissionregistration.k8s.io/v1`, which `config/admission-policies` uses.
pub const ADMISSION_POLICIES_MIN_SERVER_MINOR: u32 = 30;

/// The minor version in a server's version information (`"29"`; providers' builds may add a
/// `+`).
pub fn parse_server_minor(minor: &str) -> anyhow::Result<u32> {
    minor
        .trim_end_matches('+')
        .parse()
        .with_context(|| format!("unexpected server minor version {minor:?}"))
}

/// Whether `config/admission-policies` can be applied to `cluster`. When it cannot, says on
/// standard output that `what` (a test, or its part that applies them) is skipped: the README asks
/// for Kubernetes 1.30 for that component and leaves it out on 1.29.
pub fn serves_admission_policies(cluster: &Cluster, what: &str) -> anyhow::Result<bool> {
    let minor = cluster.server_minor()?;
    let served = minor >= ADMISSION_POLICIES_MIN_SERVER_MINOR;
    if !served {
        println!(
            "skipped {what}: the API server is 1.{minor}, and config/admission-policies needs 1.{ADMISSION_POLICIES_MIN_SERVER_MINOR} (ValidatingAdmissionPolicy v1)"
        );
    }
    Ok(served)
}

/// The cluster the tests of this process run against.
#[derive(Debug)]
pub struct Cluster {
    kubeconfig: PathBuf,
    /// Directory of the control plane we started (logs live there); `None` for an external one.
    state_dir: Option<PathBuf>,
    /// The API server's minor version (1.x), read once by [`Cluster::prepare`].
    server_minor: OnceLock<u32>,
}

static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();

/// The shared cluster, set up on first use: started (or taken from `KUBECONFIG`), built-in
/// namespaces labelled like newer servers do, and the ClusterRing CRD installed and Established.
///
/// Panics with the setup error, which fails the calling test with a clear message.
pub fn cluster() -> &'static Cluster {
    let result = CLUSTER.get_or_init(|| Cluster::set_up().map_err(|e| format!("{e:#}")));
    match result {
        Ok(cluster) => cluster,
        Err(e) => panic!("failed to set up the test cluster: {e}"),
    }
}

/// A name unique within this test process and across runs against the same cluster:
/// `<prefix>-<pid>-<counter>`, lowercase and DNS-safe when `prefix` is.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Path of `e2e/control-plane.sh`.
pub fn control_plane_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("control-plane.sh")
}

impl Cluster {
    fn set_up() -> anyhow::Result<Self> {
        let (kubeconfig, state_dir) = match std::env::var_os("KUBECONFIG") {
            Some(path) if !path.is_empty() => (PathBuf::from(path), None),
            _ => {
                let dir = std::env::temp_dir()
                    .join(format!("controller-sharding-e2e-{}", std::process::id()));
                let script = control_plane_script();
                run(Command::new("bash").arg(&script).arg("provision"))?;
                run(Command::new("bash")
                    .arg(&script)
                    .arg("start")
                    .arg(&dir)
                    .arg(std::process::id().to_string()))?;
                (dir.join("kubeconfig"), Some(dir))
            }
        };
        let cluster = Self::external(kubeconfig, state_dir);
        // The harness runs inside tests' runtimes; set-up gets a runtime of its own on a separate
        // thread so it can block regardless of the caller's runtime flavour.
        let setup = std::thread::scope(|s| {
            s.spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("failed to build a runtime")?
                    .block_on(cluster.prepare())
            })
            .join()
        });
        match setup {
            Ok(result) => result?,
            Err(_) => bail!("cluster set-up panicked"),
        }
        Ok(cluster)
    }

    /// A cluster reached through `kubeconfig`, not yet prepared.
    pub(crate) fn external(kubeconfig: PathBuf, state_dir: Option<PathBuf>) -> Self {
        Self {
            kubeconfig,
            state_dir,
            server_minor: OnceLock::new(),
        }
    }

    /// Checks the server's version, creates the system namespace and installs the CRD.
    pub(crate) async fn prepare(&self) -> anyhow::Result<()> {
        let client = self.client().await?;
        let info = client
            .apiserver_version()
            .await
            .context("failed to reach the API server")?;
        let minor = parse_server_minor(&info.minor)?;
        if info.major != "1" || minor < MIN_SERVER_MINOR {
            bail!(
                "the API server is {}; the tests need 1.{MIN_SERVER_MINOR} or newer",
                info.git_version
            );
        }
        let _ = self.server_minor.set(minor);
        let namespaces: Api<Namespace> = Api::all(client.clone());
        // What config/crds installs besides the CRD: the system namespace (the sharder's leader
        // election Lease lives there).
        let system = kube_sharding_api::labels::NAMESPACE_SYSTEM;
        if namespaces.get_opt(system).await?.is_none() {
            let ns: Namespace =
                serde_json::from_value(serde_json::json!({"metadata": {"name": system}}))?;
            namespaces.create(&PostParams::default(), &ns).await?;
        }
        install_crds(&client).await
    }

    /// The API server's minor version (1.x), as [`Cluster::prepare`] read it.
    pub fn server_minor(&self) -> anyhow::Result<u32> {
        self.server_minor
            .get()
            .copied()
            .context("the cluster was not prepared: its server version is unknown")
    }

    /// A fresh client for this cluster. Create one per test: clients are bound to the runtime
    /// they were created on.
    pub async fn client(&self) -> anyhow::Result<Client> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig)
            .with_context(|| format!("failed to read {}", self.kubeconfig.display()))?;
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .context("failed to load kubeconfig")?;
        Ok(Client::try_from(config)?)
    }

    /// A client for this cluster that acts as `user` in `groups` (impersonation by the
    /// administrator the tests run as), for checking what other identities may do.
    pub async fn client_as(&self, user: &str, groups: &[&str]) -> anyhow::Result<Client> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig)
            .with_context(|| format!("failed to read {}", self.kubeconfig.display()))?;
        let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .context("failed to load kubeconfig")?;
        config.auth_info.impersonate = Some(user.to_string());
        config.auth_info.impersonate_groups =
            Some(groups.iter().map(|g| (*g).to_string()).collect());
        Ok(Client::try_from(config)?)
    }

    /// Applies the manifests `yaml` (one or more documents) with `kubectl apply`, as a user
    /// applies the files of `config/`.
    pub fn apply_yaml(&self, yaml: &str) -> anyhow::Result<()> {
        use std::io::Write as _;
        let mut child = Command::new(kubectl())
            .arg("--kubeconfig")
            .arg(self.kubeconfig())
            .args(["apply", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("failed to run kubectl")?;
        child
            .stdin
            .take()
            .context("kubectl has no stdin")?
            .write_all(yaml.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "kubectl apply failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Path of the kubeconfig, for processes the tests start.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Directory holding the logs of the control plane we started, if we started it.
    pub fn state_dir(&self) -> Option<&Path> {
        self.state_dir.as_deref()
    }

    /// The sum of the API server's own metric `name` (from its `/metrics`) over the series whose
    /// labels include every `label="value"` pair of `labels`.
    pub fn apiserver_metric(&self, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<u64> {
        let out = Command::new(kubectl())
            .arg("--kubeconfig")
            .arg(self.kubeconfig())
            .args(["get", "--raw", "/metrics"])
            .output()
            .context("failed to run kubectl")?;
        if !out.status.success() {
            bail!("kubectl get --raw /metrics failed");
        }
        let text = String::from_utf8(out.stdout)?;
        let prefix = format!("{name}{{");
        let needles: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        let mut total = 0.0;
        for line in text.lines() {
            if line.starts_with(&prefix) && needles.iter().all(|n| line.contains(n.as_str())) {
                let value = line.rsplit(' ').next().unwrap_or_default();
                total += value.parse::<f64>().unwrap_or_default();
            }
        }
        Ok(total as u64)
    }

    /// Creates a namespace with a unique name starting with `prefix` (the API server labels it
    /// with [`LABEL_NAMESPACE_NAME`]).
    pub async fn namespace(&self, client: &Client, prefix: &str) -> anyhow::Result<String> {
        let name = unique_name(prefix);
        let api: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        api.create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("failed to create namespace {name}"))?;
        Ok(name)
    }
}

/// Installs the ClusterRing and ControllerRing CRDs with server-side apply and waits until they
/// are Established.
pub async fn install_crds(client: &Client) -> anyhow::Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for kind in kube_sharding_api::RingKind::ALL {
        let crd = kube_sharding_api::crd::ring_crd(kind);
        let name = crd.metadata.name.clone().unwrap_or_default();
        crds.patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&crd),
        )
        .await
        .with_context(|| format!("failed to apply CRD {name}"))?;
        tokio::time::timeout(
            Duration::from_secs(30),
            await_condition(crds.clone(), &name, conditions::is_crd_established()),
        )
        .await
        .with_context(|| format!("CRD {name} not Established within 30s"))??;
    }
    Ok(())
}

/// The kubectl the tests run: the one cached with the local control plane (same release as the
/// server), else the first `kubectl` on `PATH` (with `KUBECONFIG` set, nothing was provisioned).
pub fn kubectl() -> PathBuf {
    static KUBECTL: OnceLock<PathBuf> = OnceLock::new();
    KUBECTL
        .get_or_init(|| {
            let cached = Command::new("bash")
                .arg(control_plane_script())
                .arg("bin-dir")
                .output()
                .ok()
                .filter(|out| out.status.success())
                .map(|out| {
                    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("kubectl")
                })
                .filter(|path| path.is_file());
            cached.unwrap_or_else(|| PathBuf::from("kubectl"))
        })
        .clone()
}

/// Runs `cmd`, failing with its exit status.
pub(crate) fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("failed to run {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}
