//! How answers are printed: aligned tables for people, JSON and YAML for scripts.

use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

use super::{Error, Output};

/// `report` in `format`; tables come from `table`.
pub(crate) fn render<T: Serialize>(
    format: Output,
    report: &T,
    table: fn(&T) -> String,
) -> Result<String, Error> {
    match format {
        Output::Table => Ok(table(report)),
        Output::Json => serde_json::to_string_pretty(report)
            .map(|json| json + "\n")
            .map_err(|e| Error::Output(e.to_string())),
        Output::Yaml => serde_yaml::to_string(report).map_err(|e| Error::Output(e.to_string())),
    }
}

/// Columns separated like kubectl's: every column as wide as its widest cell, three spaces apart.
#[derive(Debug)]
pub(crate) struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub(crate) fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        Self {
            rows: vec![header.into_iter().map(Into::into).collect()],
        }
    }

    /// Appends a row; missing cells stay empty.
    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The lines of the table, each starting with `indent`, trailing blanks trimmed.
    pub(crate) fn render(&self, indent: &str) -> String {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|row| row.get(c))
                    .map(|cell| cell.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut text = String::new();
        for row in &self.rows {
            let mut line = indent.to_string();
            for (c, width) in widths.iter().enumerate() {
                let cell = row.get(c).map_or("", String::as_str);
                line.push_str(cell);
                let pad = width - cell.chars().count() + 3;
                line.extend(std::iter::repeat_n(' ', pad));
            }
            text.push_str(line.trim_end());
            text.push('\n');
        }
        text
    }
}

/// How long ago `then` was, the way kubectl prints ages: `45s`, `3m20s`, `95m`, `5h10m`, `3d`.
pub(crate) fn age(then: Timestamp, now: Timestamp) -> String {
    let seconds = now.as_second() - then.as_second();
    if seconds < 0 {
        // A clock ahead of ours; the difference is not an age.
        return "0s".into();
    }
    let (minutes, hours, days) = (seconds / 60, seconds / 3600, seconds / 86_400);
    let with_remainder = |big: i64, unit: &str, small: i64, small_unit: &str| {
        if small == 0 {
            format!("{big}{unit}")
        } else {
            format!("{big}{unit}{small}{small_unit}")
        }
    };
    match () {
        () if seconds < 120 => format!("{seconds}s"),
        () if minutes < 10 => with_remainder(minutes, "m", seconds % 60, "s"),
        () if minutes < 180 => format!("{minutes}m"),
        () if hours < 8 => with_remainder(hours, "h", minutes % 60, "m"),
        () if hours < 48 => format!("{hours}h"),
        () if days < 8 => with_remainder(days, "d", hours % 24, "h"),
        () => format!("{days}d"),
    }
}

/// A ratio with two decimals, `-` when there is none.
pub(crate) fn ratio(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.2}"))
}

/// `max / mean` of `counts`, `None` for no counts or a mean of zero: how much the fullest shard
/// carries beyond an even share.
pub(crate) fn imbalance(counts: impl IntoIterator<Item = usize>) -> Option<f64> {
    let counts: Vec<usize> = counts.into_iter().collect();
    let max = *counts.iter().max()?;
    let total: usize = counts.iter().sum();
    if total == 0 {
        return None;
    }
    // Counts of objects stay far below 2^52, where f64 is exact.
    #[allow(clippy::cast_precision_loss)]
    let mean = total as f64 / counts.len() as f64;
    #[allow(clippy::cast_precision_loss)]
    Some(max as f64 / mean)
}

/// `value` or `-`.
pub(crate) fn or_dash(value: Option<impl ToString>) -> String {
    value.map_or_else(|| "-".into(), |v| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_columns_three_spaces_apart() {
        let mut table = Table::new(["SHARD", "OBJECTS"]);
        table.row(vec!["shard-0".into(), "12".into()]);
        table.row(vec!["s".into()]);
        assert_eq!(
            table.render("  "),
            "  SHARD     OBJECTS\n  shard-0   12\n  s\n"
        );
    }

    #[test]
    fn ages_read_like_kubectl() {
        let now: Timestamp = "2025-01-10T12:00:00Z".parse().expect("timestamp");
        let ago = |seconds: i64| {
            age(
                now - k8s_openapi::jiff::SignedDuration::from_secs(seconds),
                now,
            )
        };
        assert_eq!(ago(0), "0s");
        assert_eq!(ago(-5), "0s");
        assert_eq!(ago(119), "119s");
        assert_eq!(ago(200), "3m20s");
        assert_eq!(ago(300), "5m");
        assert_eq!(ago(95 * 60), "95m");
        assert_eq!(ago(5 * 3600 + 600), "5h10m");
        assert_eq!(ago(30 * 3600), "30h");
        assert_eq!(ago(3 * 86_400), "3d");
        assert_eq!(ago(3 * 86_400 + 7200), "3d2h");
        assert_eq!(ago(40 * 86_400), "40d");
    }

    #[test]
    fn imbalance_is_max_over_mean() {
        assert_eq!(imbalance([10, 10, 10]), Some(1.0));
        assert_eq!(imbalance([30, 10, 20]), Some(1.5));
        assert_eq!(imbalance([0, 0]), None);
        assert_eq!(imbalance(std::iter::empty()), None);
        assert_eq!(ratio(Some(1.5)), "1.50");
        assert_eq!(ratio(None), "-");
    }
}
