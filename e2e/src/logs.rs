//! Logs printed when a test fails.
//!
//! A [`DumpOnFailure`] guards one log file and prints it to stderr when it is dropped before
//! [`DumpOnFailure::passed`] was called: by an early `?` return or a panic. A test body therefore
//! uses `?` freely and calls `passed()` as its last step. Every [`crate::process::Process`] carries
//! one for its own log; [`crate::shared_sharder::SharedSharder::dump_on_failure`] hands one out for the
//! shared sharder's log.

use std::path::{Path, PathBuf};

/// Prints a log file to stderr when dropped, unless the test passed.
#[derive(Debug)]
#[must_use = "dropping the guard at once prints the log; keep it until the test's end"]
pub struct DumpOnFailure {
    title: String,
    path: PathBuf,
    passed: bool,
}

impl DumpOnFailure {
    /// A guard for the log at `path`, printed under `title` (what wrote the log).
    pub fn new(title: impl Into<String>, path: impl Into<PathBuf>) -> Self {
        Self {
            title: title.into(),
            path: path.into(),
            passed: false,
        }
    }

    /// Path of the log file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Everything written to the log so far (empty when it cannot be read).
    pub fn read(&self) -> String {
        std::fs::read_to_string(&self.path).unwrap_or_default()
    }

    /// Marks the test as passed: dropping will not print the log (unless the thread panics).
    pub fn passed(&mut self) {
        self.passed = true;
    }
}

/// Lines printed of a failed test's log: its end, where the failure is. CI keeps only a part of a
/// failed run's output, and a whole log (the shared sharder's holds every test's lines) would push
/// the test's own error message out of it; the file keeps the rest.
const PRINTED_LINES: usize = 150;

/// The last `lines` lines of `log`, behind a note of how many were left out.
fn tail(log: &str, lines: usize) -> String {
    let total = log.lines().count();
    if total <= lines {
        return log.to_string();
    }
    let kept: Vec<&str> = log.lines().skip(total - lines).collect();
    format!(
        "[{} earlier lines left out]\n{}\n",
        total - lines,
        kept.join("\n")
    )
}

impl Drop for DumpOnFailure {
    fn drop(&mut self) {
        if !self.passed || std::thread::panicking() {
            eprintln!(
                "----- log of {} ({}) -----\n{}----- end of log of {} -----",
                self.title,
                self.path.display(),
                tail(&self.read(), PRINTED_LINES),
                self.title
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tail;

    #[test]
    fn a_long_log_keeps_its_end() {
        let log: String = (1..=10).map(|i| format!("line {i}\n")).collect();
        assert_eq!(
            tail(&log, 3),
            "[7 earlier lines left out]\nline 8\nline 9\nline 10\n"
        );
        assert_eq!(tail(&log, 10), log);
        assert_eq!(tail("", 3), "");
    }
}
