//! The helm the release tests run: built from its Go module by `e2e/helm.sh provision` the first
//! time, cached like the control plane, and asked for once per test process.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context, ensure};

use crate::in_cluster::workspace_root;

/// The path of the cached helm binary, provisioning it first when missing.
pub fn binary() -> anyhow::Result<PathBuf> {
    static HELM: OnceLock<PathBuf> = OnceLock::new();
    if let Some(path) = HELM.get() {
        return Ok(path.clone());
    }
    let out = Command::new("bash")
        .arg(workspace_root().join("e2e/helm.sh"))
        .arg("provision")
        .output()
        .context("failed to run e2e/helm.sh")?;
    ensure!(
        out.status.success(),
        "e2e/helm.sh provision failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    Ok(HELM.get_or_init(|| path).clone())
}
