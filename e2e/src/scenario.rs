//! Openings of end-to-end tests, in the manner of kube's `with_temp_ns`: what a test on the shared
//! sharder ([`SharedScenario`]) or on a control plane of its own ([`DedicatedScenario`]) obtains
//! before its own steps.
//!
//! Tests destructure the scenario into the locals they used to write out by hand, so their
//! bodies read as before:
//!
//! ```no_run
//! # async fn test() -> anyhow::Result<()> {
//! use e2e::scenario::SharedScenario;
//! let SharedScenario { sharder, mut logs, cluster, client, ns } =
//!     SharedScenario::in_namespace("assign").await?;
//! # let _ = (sharder, cluster, client, ns);
//! logs.passed();
//! # Ok(())
//! # }
//! ```
//!
//! The namespace type `N` is `String` for a scenario with a fresh namespace and `()` for one
//! whose test makes its namespaces itself (through a fixture that also makes the ring, say).

use kube::Client;

use crate::dedicated::DedicatedCluster;
use crate::logs::DumpOnFailure;
use crate::shared_sharder::{SharedSharder, shared};
use crate::{Cluster, cluster};

/// A test on the shared cluster and the shared sharder (not `Debug`: kube's `Client` is not).
pub struct SharedScenario<N = String> {
    /// The shared sharder, started and ready.
    pub sharder: &'static SharedSharder,
    /// Prints the sharder's log unless the test calls [`DumpOnFailure::passed`] at its end.
    pub logs: DumpOnFailure,
    /// The shared cluster.
    pub cluster: &'static Cluster,
    /// A client made on the test's runtime (clients are bound to the runtime they were made on).
    pub client: Client,
    /// The test's namespace, or `()`.
    pub ns: N,
}

impl SharedScenario<()> {
    /// The shared sharder, its log guard, the shared cluster and a client; no namespace.
    pub async fn open() -> anyhow::Result<Self> {
        // The sharder first: starting it sets up the cluster as well, once per process.
        let sharder = shared();
        let logs = sharder.dump_on_failure();
        let cluster = cluster();
        let client = cluster.client().await?;
        Ok(Self {
            sharder,
            logs,
            cluster,
            client,
            ns: (),
        })
    }
}

impl SharedScenario {
    /// [`SharedScenario::open`] and a fresh namespace whose name starts with `prefix`.
    pub async fn in_namespace(prefix: &str) -> anyhow::Result<Self> {
        let SharedScenario {
            sharder,
            logs,
            cluster,
            client,
            ns: (),
        } = SharedScenario::open().await?;
        let ns = cluster.namespace(&client, prefix).await?;
        Ok(Self {
            sharder,
            logs,
            cluster,
            client,
            ns,
        })
    }
}

/// A test on a control plane of its own, stopped when the scenario (its `dedicated` field) drops.
///
/// The cluster is borrowed from `dedicated` (`let cluster = dedicated.cluster();`), so the
/// scenario holds the control plane rather than a reference to it.
pub struct DedicatedScenario<N = String> {
    /// The control plane.
    pub dedicated: DedicatedCluster,
    /// A client of it, made on the test's runtime.
    pub client: Client,
    /// The test's namespace, or `()`.
    pub ns: N,
}

impl DedicatedScenario<()> {
    /// A control plane of its own ([`DedicatedCluster::start`]) and a client; no namespace.
    pub async fn open() -> anyhow::Result<Self> {
        Self::open_with_apiserver_args(&[]).await
    }

    /// [`DedicatedScenario::open`] with `args` added to kube-apiserver's flags
    /// ([`DedicatedCluster::start_with_apiserver_args`]).
    pub async fn open_with_apiserver_args(args: &[&str]) -> anyhow::Result<Self> {
        let dedicated = DedicatedCluster::start_with_apiserver_args(args).await?;
        let client = dedicated.cluster().client().await?;
        Ok(Self {
            dedicated,
            client,
            ns: (),
        })
    }
}

impl DedicatedScenario {
    /// [`DedicatedScenario::open`] and a fresh namespace whose name starts with `prefix`.
    pub async fn in_namespace(prefix: &str) -> anyhow::Result<Self> {
        Self::with_apiserver_args_in_namespace(&[], prefix).await
    }

    /// [`DedicatedScenario::open_with_apiserver_args`] and a fresh namespace whose name starts
    /// with `prefix`.
    pub async fn with_apiserver_args_in_namespace(
        args: &[&str],
        prefix: &str,
    ) -> anyhow::Result<Self> {
        let DedicatedScenario {
            dedicated,
            client,
            ns: (),
        } = DedicatedScenario::open_with_apiserver_args(args).await?;
        let ns = dedicated.cluster().namespace(&client, prefix).await?;
        Ok(Self {
            dedicated,
            client,
            ns,
        })
    }
}
