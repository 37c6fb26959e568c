//! Loopback networking for tests: free ports and HTTP requests through curl.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, bail};

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

/// Runs curl with `args` and returns what it printed; fails when curl exits non-zero (with `-f`,
/// also on an HTTP error status).
pub fn curl(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("curl")
        .args(args)
        .output()
        .context("failed to run curl")?;
    if !out.status.success() {
        bail!(
            "curl {args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
