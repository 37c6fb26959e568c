//! Harness for end-to-end tests against a real kube-apiserver and etcd.
//!
//! The first call to [`cluster`] in a test process starts one control plane on loopback through
//! `e2e/control-plane.sh` (provisioning and caching kube-apiserver on first use); every later
//! call, from any test, reuses it. A watchdog stops it when the test process exits. When
//! `KUBECONFIG` is set, tests run against that cluster instead (kind, or a real one), and nothing
//! is started.
//!
//! Each test works in its own namespace ([`Cluster::namespace`]) with unique names
//! ([`unique_name`]), so tests in one process can run in parallel.

pub mod fixtures;
pub mod process;
pub mod sharder;

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

/// Field manager of every write the harness makes.
pub const FIELD_MANAGER: &str = "controller-sharding-e2e";

/// Label newer API servers (1.21+) put on every namespace; selectors rely on it.
pub const LABEL_NAMESPACE_NAME: &str = "kubernetes.io/metadata.name";

/// The cluster the tests of this process run against.
#[derive(Debug)]
pub struct Cluster {
    kubeconfig: PathBuf,
    /// Directory of the control plane we started (logs live there); `None` for an external one.
    state_dir: Option<PathBuf>,
    /// Minor version of the API server, e.g. 20 for 1.20.
    minor_version: u32,
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
        let mut cluster = Self::external(kubeconfig, state_dir);
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
        cluster.minor_version = match setup {
            Ok(result) => result?,
            Err(_) => bail!("cluster set-up panicked"),
        };
        Ok(cluster)
    }

    /// A cluster reached through `kubeconfig`, not yet prepared.
    pub(crate) fn external(kubeconfig: PathBuf, state_dir: Option<PathBuf>) -> Self {
        Self {
            kubeconfig,
            state_dir,
            minor_version: 0,
        }
    }

    /// Labels built-in namespaces, installs the CRD; returns the server's minor version.
    pub(crate) async fn prepare(&self) -> anyhow::Result<u32> {
        let client = self.client().await?;
        let info = client
            .apiserver_version()
            .await
            .context("failed to reach the API server")?;
        let minor: u32 = info
            .minor
            .trim_end_matches('+')
            .parse()
            .with_context(|| format!("unexpected server minor version {:?}", info.minor))?;
        let namespaces: Api<Namespace> = Api::all(client.clone());
        for ns in namespaces.list(&Default::default()).await? {
            let name = ns.metadata.name.unwrap_or_default();
            label_namespace(&namespaces, &name).await?;
        }
        // What config/crds installs besides the CRD: the system namespace (the sharder's leader
        // election Lease lives there).
        let system = sharding_crds::labels::NAMESPACE_SYSTEM;
        if namespaces.get_opt(system).await?.is_none() {
            let ns: Namespace = serde_json::from_value(serde_json::json!({
                "metadata": {"name": system, "labels": {LABEL_NAMESPACE_NAME: system}}
            }))?;
            namespaces.create(&PostParams::default(), &ns).await?;
        }
        install_crds(&client, minor).await?;
        Ok(minor)
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

    /// Path of the kubeconfig, for processes the tests start.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Minor version of the API server (20 for the local 1.20 control plane).
    pub fn minor_version(&self) -> u32 {
        self.minor_version
    }

    /// Whether the API server evaluates CRD validation rules (CEL), which 1.25+ does.
    pub fn supports_cel(&self) -> bool {
        self.minor_version >= 25
    }

    /// Directory holding the logs of the control plane we started, if we started it.
    pub fn state_dir(&self) -> Option<&Path> {
        self.state_dir.as_deref()
    }

    /// Creates a namespace with a unique name starting with `prefix`, labelled with
    /// `kubernetes.io/metadata.name` as newer servers do by themselves.
    pub async fn namespace(&self, client: &Client, prefix: &str) -> anyhow::Result<String> {
        let name = unique_name(prefix);
        let api: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {LABEL_NAMESPACE_NAME: name}}
        }))?;
        api.create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("failed to create namespace {name}"))?;
        Ok(name)
    }
}

async fn label_namespace(api: &Api<Namespace>, name: &str) -> anyhow::Result<()> {
    let patch = serde_json::json!({"metadata": {"labels": {LABEL_NAMESPACE_NAME: name}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("failed to label namespace {name}"))?;
    Ok(())
}

/// The CRD as it can be installed on a server of the given minor version: servers before 1.25 do
/// not know `x-kubernetes-validations` and refuse it in server-side apply, so it is left out there.
pub fn crd_for_server(minor: u32) -> CustomResourceDefinition {
    let mut crd = sharding_crds::crd::cluster_ring_crd();
    if minor < 25 {
        for version in &mut crd.spec.versions {
            if let Some(schema) = version
                .schema
                .as_mut()
                .and_then(|s| s.open_api_v3_schema.as_mut())
            {
                schema.x_kubernetes_validations = None;
            }
        }
    }
    crd
}

/// Installs the ClusterRing CRD with server-side apply and waits until it is Established.
pub async fn install_crds(client: &Client, minor: u32) -> anyhow::Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crd_for_server(minor);
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
        await_condition(crds, &name, conditions::is_crd_established()),
    )
    .await
    .with_context(|| format!("CRD {name} not Established within 30s"))??;
    Ok(())
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("failed to run {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}
