//! Test certificates: a CA and a serving certificate for loopback.
//!
//! The one generator of the workspace's webhook test certificates is `e2e/certs.sh`; the harness
//! (test sharders, the trivial webhook) reaches it through [`generate_certificates`], and
//! `e2e/playground.sh` runs it directly, so both serve the same kind of certificate.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// Path of `e2e/certs.sh`.
pub fn certs_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("certs.sh")
}

/// Writes a test CA (`ca.crt`, `ca.key`) and a serving certificate for 127.0.0.1 and localhost
/// signed by it (`tls.crt`, `tls.key`) into `dir`, with openssl (through `e2e/certs.sh`).
pub fn generate_certificates(dir: &Path) -> anyhow::Result<()> {
    let out = Command::new("bash")
        .arg(certs_script())
        .arg(dir)
        .arg("sharder-test-ca")
        .output()
        .context("failed to run e2e/certs.sh")?;
    if !out.status.success() {
        bail!("openssl failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}
