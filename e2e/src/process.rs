//! The project's binaries as child processes of end-to-end tests.
//!
//! Binaries of other packages have no `CARGO_BIN_EXE_*` variable here, so [`binary`] finds them
//! beside the test executable (`cargo build --workspace --bins` puts them there; `e2e/test.sh`
//! does that). A [`Process`] talks to the test cluster, writes its output to a log file, is killed
//! when dropped, and prints its log when the test did not pass (through a [`DumpOnFailure`]).

use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Once;
use std::time::Duration;

use anyhow::{Context, bail};

use crate::logs::DumpOnFailure;
use crate::{cluster, unique_name};

/// Interval at which [`poll_until`] and [`Process::wait_for_record`] look again.
pub const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Path of the workspace binary `name`, next to the running test executable
/// (`target/<profile>/deps/e2e-…` → `target/<profile>/<name>`).
///
/// Fails with a message naming the build command when the binary is missing.
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let test_exe = std::env::current_exe().context("failed to locate the test executable")?;
    let mut dir = test_exe
        .parent()
        .context("the test executable has no parent directory")?;
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir = dir.parent().context("deps/ has no parent directory")?;
    }
    let path = dir.join(name);
    if !path.is_file() {
        bail!(
            "binary {name} not found at {}: run `cargo build --workspace --bins` first \
             (e2e/test.sh does that), with the same profile and CARGO_TARGET_DIR as the tests",
            path.display()
        );
    }
    Ok(path)
}

/// `VmRSS` (resident set size) of process `pid`, in KiB, from `/proc/<pid>/status`.
pub fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let [rss] = status_fields(pid, ["VmRSS"])?;
    Ok(rss)
}

/// Numeric fields of `/proc/<pid>/status` by name (`VmRSS`, `VmHWM`, `Threads`, ...), in the
/// order asked, read from one snapshot; sizes are in KiB as the kernel writes them.
pub fn status_fields<const N: usize>(pid: u32, names: [&str; N]) -> anyhow::Result<[u64; N]> {
    let path = format!("/proc/{pid}/status");
    let status =
        std::fs::read_to_string(&path).with_context(|| format!("failed to read {path}"))?;
    let mut values = [0; N];
    for (value, name) in values.iter_mut().zip(names) {
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .with_context(|| format!("no {name} in {path}"))?;
        *value = line
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .with_context(|| format!("unexpected {name} value {line:?}"))?;
    }
    Ok(values)
}

/// Polls `check` every [`POLL_INTERVAL`] until it returns `Some`, failing after `timeout` with
/// `what` and the last error `check` returned (errors count as "not yet").
pub async fn poll_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error = None;
    loop {
        match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(error) => last_error = Some(error),
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(match last_error {
                Some(error) => {
                    error.context(format!("timed out after {timeout:?} waiting for {what}"))
                }
                None => anyhow::anyhow!("timed out after {timeout:?} waiting for {what}"),
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// A running binary of the workspace.
///
/// **Dump on failure:** a test that passes calls [`Process::passed`]; any other drop (an early
/// `?` return or a panic) prints the process's log to stderr, so failures show what the process
/// did. Dropping always kills the process.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: tokio::process::Child,
    /// Prints the log when a failed test drops the process (after `drop` killed the child).
    log: DumpOnFailure,
}

impl Process {
    /// Starts binary `name` with `args`, with `KUBECONFIG` pointing at the test cluster and
    /// stdout and stderr going to a log file.
    ///
    /// Must be called within a tokio runtime.
    pub fn start<I, S>(name: &str, args: I) -> anyhow::Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        Self::start_with_env(name, args, std::iter::empty::<(&str, &str)>())
    }

    /// Like [`Process::start`], with extra environment variables for the process (set after
    /// `KUBECONFIG`, so they may override it), e.g. to tune the allocator of a measured process.
    ///
    /// Must be called within a tokio runtime.
    pub fn start_with_env<I, S, E, K, V>(name: &str, args: I, envs: E) -> anyhow::Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
        E: IntoIterator<Item = (K, V)>,
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        Self::start_binary(&binary(name)?, name, args, envs)
    }

    /// Like [`Process::start_with_env`], running the executable at `path` instead of the
    /// workspace's `name` (which still names the log): a load tool measuring another build of a
    /// binary beside this one.
    ///
    /// Must be called within a tokio runtime.
    pub fn start_binary<I, S, E, K, V>(
        path: &Path,
        name: &str,
        args: I,
        envs: E,
    ) -> anyhow::Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
        E: IntoIterator<Item = (K, V)>,
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        let log_dir = log_dir()?;
        let log_path = log_dir.join(format!("{}.log", unique_name(name)));
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("failed to create {}", log_path.display()))?;
        let stderr = log
            .try_clone()
            .context("failed to duplicate the log file")?;
        let child = tokio::process::Command::new(path)
            .args(args)
            .env("KUBECONFIG", cluster().kubeconfig())
            .envs(envs)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("failed to start {}", path.display()))?;
        Ok(Self {
            name: name.to_string(),
            child,
            log: DumpOnFailure::new(name, log_path),
        })
    }

    /// The process id, while it runs.
    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }

    /// Path of the log file.
    pub fn log_path(&self) -> &Path {
        self.log.path()
    }

    /// Sends a signal by name (`TERM`, `INT`, `KILL`, …) with `kill(1)`.
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self
            .id()
            .with_context(|| format!("{} has already exited", self.name))?;
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .context("failed to run kill")?;
        if !status.success() {
            bail!("kill -{signal} {pid} failed with {status}");
        }
        Ok(())
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) -> anyhow::Result<()> {
        self.signal("TERM")
    }

    /// Waits for the process to exit, at most `timeout`.
    pub async fn wait(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .with_context(|| format!("{} did not exit within {timeout:?}", self.name))?
            .with_context(|| format!("failed to wait for {}", self.name))
    }

    /// The exit status if the process has exited, without waiting.
    pub fn try_status(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        self.child
            .try_wait()
            .with_context(|| format!("failed to check on {}", self.name))
    }

    /// Everything the process wrote so far.
    pub fn logs(&self) -> String {
        self.log.read()
    }

    /// The lines written so far that are JSON objects (with `--log-format=json`), in order.
    pub fn records(&self) -> Vec<serde_json::Value> {
        self.logs()
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(serde_json::Value::is_object)
            .collect()
    }

    /// Waits until a JSON log record matching `predicate` appears; returns it.
    pub async fn wait_for_record(
        &self,
        what: &str,
        timeout: Duration,
        predicate: impl Fn(&serde_json::Value) -> bool,
    ) -> anyhow::Result<serde_json::Value> {
        poll_until(what, timeout, || {
            let found = self.records().into_iter().find(|r| predicate(r));
            async move { Ok(found) }
        })
        .await
    }

    /// Marks the test as passed: dropping will not print the log.
    pub fn passed(&mut self) {
        self.log.passed();
    }
}

/// The directory of this test process's logs, created on first use. It outlives the run, so a
/// failed test's whole log can be read afterwards. When `CONTROLLER_SHARDING_LOG_DIRS` names a
/// file, the directory is recorded there once: `e2e/test.sh` removes the logs of a run that
/// passed and names those of one that failed.
pub fn log_dir() -> anyhow::Result<PathBuf> {
    static RECORDED: Once = Once::new();
    let dir = std::env::temp_dir().join(format!(
        "controller-sharding-e2e-logs-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).with_context(|| format!("failed to create {}", dir.display()))?;
    RECORDED.call_once(|| {
        let Some(list) = std::env::var_os(LOG_DIRS_ENV).filter(|list| !list.is_empty()) else {
            return;
        };
        if let Err(e) = record_log_dir(Path::new(&list), &dir) {
            // Only the clean-up of a passing run depends on it.
            eprintln!("could not record {} in {list:?}: {e}", dir.display());
        }
    });
    Ok(dir)
}

/// The variable naming the file that [`log_dir`] records its directory in.
const LOG_DIRS_ENV: &str = "CONTROLLER_SHARDING_LOG_DIRS";

/// Appends `dir` as a line to `list`. Test processes run side by side; one short append each
/// keeps their lines whole.
fn record_log_dir(list: &Path, dir: &Path) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(list)?;
    file.write_all(format!("{}\n", dir.display()).as_bytes())
}

impl Drop for Process {
    fn drop(&mut self) {
        // kill_on_drop reaps it; killing here as well makes the intent explicit. The log guard
        // prints the log afterwards, when the fields are dropped.
        let _ = self.child.start_kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_dirs_are_recorded_one_per_line() {
        let scratch = std::env::temp_dir().join(unique_name("log-dirs"));
        std::fs::create_dir_all(&scratch).expect("scratch dir");
        let list = scratch.join("list");
        record_log_dir(&list, Path::new("/tmp/a")).expect("first");
        record_log_dir(&list, Path::new("/tmp/b c")).expect("second");
        let recorded = std::fs::read_to_string(&list).expect("list");
        std::fs::remove_dir_all(&scratch).expect("clean up");
        assert_eq!(recorded, "/tmp/a\n/tmp/b c\n");
    }

    #[test]
    fn status_fields_are_read_by_name_in_the_order_asked() {
        let pid = std::process::id();
        let [threads, rss] = status_fields(pid, ["Threads", "VmRSS"]).expect("own status");
        assert!(threads >= 1, "{threads}");
        assert!(rss > 0, "{rss}");
        // A name is a whole field name: `VmRS` is not `VmRSS`.
        assert!(status_fields(pid, ["VmRS"]).is_err());
        assert!(status_fields(pid, ["NoSuchField"]).is_err());
    }
}
