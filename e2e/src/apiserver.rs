//! Restarting kube-apiserver of a control plane `e2e/control-plane.sh` started (the chaos tool's
//! fault, and end-to-end tests against a [`DedicatedCluster`](crate::dedicated::DedicatedCluster)),
//! which the script has no command for: stop the running process, start the same binary with the
//! same flags (so ports, certificates and etcd stay), log to the same file, and put its new
//! process id into the control plane's `pids` file so that `control-plane.sh stop` and the
//! watchdog still stop it.
//!
//! Never restart the shared control plane ([`cluster`](crate::cluster)): other tests run on it
//! in parallel.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kube::Client;

/// How long the old process may take to shut down gracefully before it is killed. kube-apiserver
/// refuses new connections at once but waits up to a minute for open watches to end; a short
/// grace period, as a pod's, keeps the outage to seconds.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the new process may take to report ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The API server of a control plane started by `control-plane.sh start DIR`.
///
/// The process a restart starts is a child of this process; dropping the value leaves it running
/// (the control plane's `stop` ends it) and reaps it once it has ended.
#[derive(Debug)]
pub struct ApiServer {
    dir: PathBuf,
    /// The process we started on the previous restart, if any (we must reap it).
    child: Option<Child>,
}

/// How one restart went.
#[derive(Debug)]
pub struct Restarted {
    /// From sending SIGTERM until the old process was gone.
    pub stopping: Duration,
    /// From starting the new process until `/readyz` answered `ok`.
    pub starting: Duration,
}

impl ApiServer {
    /// The API server of the control plane whose state lives in `dir`.
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            child: None,
        }
    }

    /// Stops the API server (SIGTERM, then SIGKILL after 5 s), waits `down`, starts it again with
    /// the same command line and waits until it is ready (`/readyz` through `client`, which must
    /// talk to this control plane; it reconnects on its own).
    ///
    /// Every watch open on the API server ends, and requests fail until it is ready again. Fails
    /// when the control plane's `pids` file names no running kube-apiserver.
    pub async fn restart(&mut self, client: &Client, down: Duration) -> anyhow::Result<Restarted> {
        let pids_file = self.dir.join("pids");
        let pids = std::fs::read_to_string(&pids_file)
            .with_context(|| format!("failed to read {}", pids_file.display()))?;
        let old = pids
            .lines()
            .filter_map(|l| l.trim().parse::<u32>().ok())
            .find(|pid| comm(*pid).as_deref() == Some("kube-apiserver"))
            .context("no running kube-apiserver in the control plane's pids file")?;
        let cmdline = std::fs::read(format!("/proc/{old}/cmdline"))
            .with_context(|| format!("failed to read the command line of process {old}"))?;
        let argv: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let (program, args) = argv.split_first().context("empty command line")?;

        let stopping_started = Instant::now();
        kill(old, "TERM")?;
        if !self.wait_gone(old, STOP_TIMEOUT).await {
            kill(old, "KILL")?;
            if !self.wait_gone(old, Duration::from_secs(10)).await {
                bail!("kube-apiserver {old} survived SIGKILL");
            }
        }
        let stopping = stopping_started.elapsed();
        tokio::time::sleep(down).await;

        let log_path = self.dir.join("kube-apiserver.log");
        let log = OpenOptions::new()
            .append(true)
            .create(true)
            .open(&log_path)
            .with_context(|| format!("failed to open {}", log_path.display()))?;
        let starting_started = Instant::now();
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("failed to start {program}"))?;
        let new = child.id();
        self.child = Some(child);
        let replaced: String = pids
            .lines()
            .map(|l| {
                if l.trim() == old.to_string() {
                    format!("{new}\n")
                } else {
                    format!("{l}\n")
                }
            })
            .collect();
        std::fs::write(&pids_file, replaced)
            .with_context(|| format!("failed to update {}", pids_file.display()))?;

        let ready = crate::process::poll_until("kube-apiserver /readyz", READY_TIMEOUT, || {
            let client = client.clone();
            async move {
                let request = kube::core::Request::new("")
                    .get("readyz", &Default::default())
                    .context("failed to build the /readyz request")?;
                let text = client.request_text(request).await?;
                Ok((text.trim() == "ok").then_some(()))
            }
        });
        ready.await?;
        Ok(Restarted {
            stopping,
            starting: starting_started.elapsed(),
        })
    }

    /// Waits until process `pid` is gone (or a zombie nobody reaps), reaping it when it is ours.
    async fn wait_gone(&mut self, pid: u32, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut().filter(|c| c.id() == pid) {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    self.child = None;
                    return true;
                }
            } else if !alive(pid) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        // The control plane's `stop` ends the process we started; until this process reaps it,
        // it would linger as a zombie that `stop` waits on as if it still ran.
        if let Some(mut child) = self.child.take() {
            std::thread::spawn(move || child.wait());
        }
    }
}

/// The command name of process `pid`.
fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Whether process `pid` exists and is not a zombie.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name, which may itself hold spaces.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

fn kill(pid: u32, signal: &str) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .context("failed to run kill")?;
    if !status.success() && alive(pid) {
        bail!("kill -{signal} {pid} failed with {status}");
    }
    Ok(())
}
