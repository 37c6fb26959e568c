//! What the tool reads from processes.

use anyhow::Context as _;

/// CPU time (user + system) a process used so far, in seconds.
pub(crate) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("failed to read /proc/{pid}/stat"))?;
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

/// Resident set size of a process, in KiB.
pub(crate) fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("failed to read /proc/{pid}/status"))?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("no VmRSS")?;
    Ok(line.trim().trim_end_matches("kB").trim().parse()?)
}
