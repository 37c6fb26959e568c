//! The identity test sharders run as: the ServiceAccount `sharding-system/sharder` with exactly
//! the RBAC shipped in `config/rbac`, plus the per-ring ClusterRole the README asks users to
//! grant for each ring ([`grant_ring`], called by the ring fixtures). A permission the sharder
//! needs and the shipped RBAC lacks thus fails the tests, as it would fail a user.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, bail};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::config::Kubeconfig;
use kube_sharding_api::labels::NAMESPACE_SYSTEM;
use kube_sharding_api::{ClusterRingSpec, RingKind, RingRef};
use serde_json::json;

use crate::in_cluster::workspace_root;
use crate::kubectl;

/// The sharder's ServiceAccount, as `config/rbac` creates it.
const SERVICE_ACCOUNT: &str = "sharder";

/// How long the token of a test sharder is valid: longer than any test run.
const TOKEN_DURATION: &str = "48h";

/// Kubeconfigs made so far, by the administrator's kubeconfig they were made from.
static MADE: Mutex<BTreeMap<PathBuf, PathBuf>> = Mutex::new(BTreeMap::new());

/// A kubeconfig for the cluster of `admin` (an administrator's kubeconfig) that authenticates as
/// the sharder's ServiceAccount, after applying `config/rbac` to that cluster; made once per
/// cluster and written next to `admin`.
pub fn sharder_kubeconfig(admin: &Path) -> anyhow::Result<PathBuf> {
    let mut made = MADE.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    if let Some(path) = made.get(admin) {
        return Ok(path.clone());
    }
    let rbac = workspace_root().join("config/rbac");
    kubectl_as(admin, &["apply", "-k", &rbac.to_string_lossy()])?;
    let path = service_account_kubeconfig(admin, NAMESPACE_SYSTEM, SERVICE_ACCOUNT)?;
    made.insert(admin.to_path_buf(), path.clone());
    Ok(path)
}

/// A kubeconfig for the cluster of `admin` (an administrator's kubeconfig) that authenticates as
/// the existing ServiceAccount `namespace/name` with a token valid longer than any test run,
/// written next to `admin` (`sharder.kubeconfig` for the sharder's, `<namespace>.<name>.kubeconfig`
/// for others).
pub fn service_account_kubeconfig(
    admin: &Path,
    namespace: &str,
    name: &str,
) -> anyhow::Result<PathBuf> {
    let token = kubectl_as(
        admin,
        &[
            "-n",
            namespace,
            "create",
            "token",
            name,
            "--duration",
            TOKEN_DURATION,
        ],
    )?;
    let mut config = Kubeconfig::read_from(admin)
        .with_context(|| format!("failed to read {}", admin.display()))?;
    for named in &mut config.auth_infos {
        named.auth_info = Some(kube::config::AuthInfo {
            token: Some(token.trim().to_string().into()),
            ..Default::default()
        });
    }
    let file = if (namespace, name) == (NAMESPACE_SYSTEM, SERVICE_ACCOUNT) {
        "sharder.kubeconfig".to_string()
    } else {
        format!("{namespace}.{name}.kubeconfig")
    };
    // JSON is YAML: every kubeconfig reader takes it.
    let path = admin.with_file_name(file);
    std::fs::write(&path, serde_json::to_string(&config)?)
        .with_context(|| format!("failed to write {}", path.display()))?;
    Ok(path)
}

/// Runs kubectl with `args` as the administrator of `admin`; returns its standard output.
fn kubectl_as(admin: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(kubectl())
        .arg("--kubeconfig")
        .arg(admin)
        .args(args)
        .output()
        .context("failed to run kubectl")?;
    if !out.status.success() {
        bail!(
            "kubectl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// Grants the sharder's ServiceAccount what the README asks for each ring: `get`, `list`,
/// `watch` and `patch` on every main and controlled resource of `ring`, in the ClusterRole
/// `sharding:<kind>:<ring>` (applied, so calling it again after the ring's resources changed
/// updates it).
pub async fn grant_ring(
    client: &Client,
    ring: &RingRef,
    spec: &ClusterRingSpec,
) -> anyhow::Result<()> {
    let name = format!(
        "sharding:{}:{}",
        match ring.kind {
            RingKind::ClusterRing => "clusterring",
            RingKind::ControllerRing => "controllerring",
        },
        ring.name
    );
    let mut by_group: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for resource in &spec.resources {
        by_group
            .entry(&resource.group)
            .or_default()
            .insert(&resource.resource);
        for controlled in &resource.controlled_resources {
            by_group
                .entry(&controlled.group)
                .or_default()
                .insert(&controlled.resource);
        }
    }
    let rules: Vec<_> = by_group
        .into_iter()
        .map(|(group, resources)| {
            json!({"apiGroups": [group], "resources": resources, "verbs": ["get", "list", "watch", "patch"]})
        })
        .collect();
    let params = PatchParams::apply("e2e").force();
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": rules,
    });
    Api::<ClusterRole>::all(client.clone())
        .patch(&name, &params, &Patch::Apply(&role))
        .await
        .with_context(|| format!("failed to grant the sharder ring {}", ring.name))?;
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE_SYSTEM}],
    });
    Api::<ClusterRoleBinding>::all(client.clone())
        .patch(&name, &params, &Patch::Apply(&binding))
        .await?;
    Ok(())
}
