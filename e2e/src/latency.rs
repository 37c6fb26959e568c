//! Summaries of latency samples, as the load tools report them.

use std::time::Duration;

use anyhow::ensure;
use serde_json::{Value, json};

/// Nearest-rank percentiles and the extremes of a set of latencies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Latencies {
    /// 50th percentile.
    pub median: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Arithmetic mean.
    pub mean: Duration,
    /// Smallest sample.
    pub min: Duration,
    /// Largest sample.
    pub max: Duration,
}

impl Latencies {
    /// Summarises `samples` (sorting them in place); an error when there are none.
    pub fn of(samples: &mut [Duration]) -> anyhow::Result<Self> {
        ensure!(!samples.is_empty(), "no samples");
        samples.sort_unstable();
        let n = samples.len();
        let total: Duration = samples.iter().sum();
        Ok(Self {
            median: percentile(samples, 50),
            p99: percentile(samples, 99),
            mean: total / u32::try_from(n)?,
            min: samples[0],
            max: samples[n - 1],
        })
    }

    /// The summary in milliseconds, rounded to microseconds.
    pub fn json(&self) -> Value {
        json!({
            "median_ms": millis(self.median),
            "p99_ms": millis(self.p99),
            "mean_ms": millis(self.mean),
            "min_ms": millis(self.min),
            "max_ms": millis(self.max),
        })
    }
}

/// Nearest rank: the smallest of the `sorted` samples with at least `p` percent of them at or
/// below it. `sorted` must be sorted ascending and not empty.
pub fn percentile(sorted: &[Duration], p: usize) -> Duration {
    let n = sorted.len();
    sorted[(n * p).div_ceil(100).clamp(1, n) - 1]
}

/// `d` in milliseconds, rounded to microseconds, for JSON reports.
pub fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(values: impl IntoIterator<Item = u64>) -> Vec<Duration> {
        values.into_iter().map(Duration::from_millis).collect()
    }

    #[test]
    fn nearest_rank_percentiles() {
        let hundred = ms(1..=100);
        assert_eq!(percentile(&hundred, 50), Duration::from_millis(50));
        assert_eq!(percentile(&hundred, 99), Duration::from_millis(99));
        assert_eq!(percentile(&hundred, 100), Duration::from_millis(100));
        // 1 % of 10 samples rounds up to the first; 99 % of them is the last.
        let ten = ms(1..=10);
        assert_eq!(percentile(&ten, 1), Duration::from_millis(1));
        assert_eq!(percentile(&ten, 99), Duration::from_millis(10));
        assert_eq!(percentile(&ten, 0), Duration::from_millis(1));
        let one = ms([7]);
        assert_eq!(percentile(&one, 50), Duration::from_millis(7));
        assert_eq!(percentile(&one, 99), Duration::from_millis(7));
    }

    #[test]
    fn summary_sorts_and_rejects_nothing() {
        let mut samples = ms([30, 10, 20, 40]);
        let l = Latencies::of(&mut samples).expect("samples");
        assert_eq!(l.median, Duration::from_millis(20));
        assert_eq!(l.p99, Duration::from_millis(40));
        assert_eq!(l.mean, Duration::from_millis(25));
        assert_eq!((l.min, l.max), (ms([10])[0], ms([40])[0]));
        assert_eq!(l.json()["median_ms"], 20.0);
        assert!(Latencies::of(&mut []).is_err());
    }
}
