//! Logs printed when a test fails.
//!
//! A [`DumpOnFailure`] guards one log file and prints it to stderr when it is dropped before
//! [`DumpOnFailure::passed`] was called: by an early `?` return or a panic. A test body therefore
//! uses `?` freely and calls `passed()` as its last step. Every [`crate::process::Process`] carries
//! one for its own log; [`crate::sharder::SharedSharder::dump_on_failure`] hands one out for the
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

impl Drop for DumpOnFailure {
    fn drop(&mut self) {
        if !self.passed || std::thread::panicking() {
            eprintln!(
                "----- log of {} ({}) -----\n{}----- end of log of {} -----",
                self.title,
                self.path.display(),
                self.read(),
                self.title
            );
        }
    }
}
