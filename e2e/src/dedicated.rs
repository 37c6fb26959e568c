//! A control plane of its own for one test ([`DedicatedCluster`]): for tests that run sharders
//! as processes (every sharder on one cluster takes part in the same leader election), restart
//! the API server or compact etcd.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};

use crate::{Cluster, cluster, control_plane_script};

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
