//! What the tool reads from processes and threads.

use anyhow::Context as _;

/// CPU time (user + system) a process used so far, in seconds.
pub(crate) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    stat_cpu_seconds(&format!("/proc/{pid}/stat"))
}

/// CPU time (user + system) one thread of this process used so far, in seconds.
pub(crate) fn thread_cpu_seconds(tid: u32) -> anyhow::Result<f64> {
    stat_cpu_seconds(&format!("/proc/self/task/{tid}/stat"))
}

/// utime + stime of a `stat` file of `/proc`, in seconds.
fn stat_cpu_seconds(path: &str) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(path).with_context(|| format!("failed to read {path}"))?;
    // The command name (field 2) may hold spaces; the fields after its closing parenthesis are
    // `state` (3) onwards, so utime (14) and stime (15) are the 12th and 13th after it.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("unexpected /proc/pid/stat")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<f64> {
        Ok(fields
            .get(i)
            .context("short /proc/pid/stat")?
            .parse::<f64>()?)
    };
    // The kernel's USER_HZ, 100 on every Linux architecture we run on.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}
