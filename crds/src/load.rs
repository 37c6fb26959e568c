//! The load a shard reports on its own Lease (docs/protocol.md §23).
//!
//! A shard writes [`ANNOTATION_LOAD`] with the Lease renewals it sends anyway, so reporting costs
//! no extra request. The sharder sums the reports of a ring's available shards into per-ring
//! signals (metrics, `kubectl sharding status`, the external metrics API an autoscaler reads).
//!
//! The value is a list of `key=value` pairs joined by `,` without spaces, keys in the order of
//! [`LoadKey::ALL`], each at most once, at least one; values are decimal integers without sign or
//! leading zero (`0` itself is fine) up to [`MAX_LOAD_VALUE`]. For example
//! `"objects=1200,queue=3,p50ms=12,p99ms=80,errors=0,window=60"`. A shard that cannot measure a
//! signal leaves its key out. Values are read strictly and the whole value is refused when any
//! part is wrong, so a report written by anything else never counts as a number it does not spell
//! out; a refused report counts as no report.

use std::fmt;
use std::str::FromStr;

/// Annotation a shard writes on its own Lease with its current load ([`ShardLoad`]).
pub const ANNOTATION_LOAD: &str = "alpha.sharding.timebertt.dev/load";

/// The largest value any signal of a [`ShardLoad`] may have (10^12 - 1: twelve digits).
///
/// Far above anything one shard holds or measures, and small enough that summing a ring of
/// thousands of shards cannot overflow a `u64`.
pub const MAX_LOAD_VALUE: u64 = 999_999_999_999;

/// The longest [`ANNOTATION_LOAD`] value: every key with a twelve-digit value. Longer values are
/// refused before anything else is read.
pub const MAX_LOAD_ANNOTATION_BYTES: usize = {
    let mut bytes = 0;
    let mut i = 0;
    while i < LoadKey::ALL.len() {
        // key, '=', twelve digits, ','
        bytes += LoadKey::ALL[i].as_str().len() + 1 + 12 + 1;
        i += 1;
    }
    bytes - 1
};

/// One signal of a [`ShardLoad`], named by its key in [`ANNOTATION_LOAD`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoadKey {
    /// `objects`: objects the shard holds (of the ring's resources, carrying its shard label or
    /// in its ranges).
    Objects,
    /// `queue`: objects waiting to be reconciled (changed since their last reconcile).
    Queue,
    /// `p50ms`: median reconcile duration over the window, in milliseconds.
    P50Millis,
    /// `p99ms`: 99th percentile reconcile duration over the window, in milliseconds.
    P99Millis,
    /// `errors`: reconciles that failed during the window.
    Errors,
    /// `window`: length of the window the latencies and errors cover, in seconds.
    WindowSeconds,
}

impl LoadKey {
    /// Every key, in the order a value lists them.
    pub const ALL: [Self; 6] = [
        Self::Objects,
        Self::Queue,
        Self::P50Millis,
        Self::P99Millis,
        Self::Errors,
        Self::WindowSeconds,
    ];

    /// The key as written in the annotation.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Objects => "objects",
            Self::Queue => "queue",
            Self::P50Millis => "p50ms",
            Self::P99Millis => "p99ms",
            Self::Errors => "errors",
            Self::WindowSeconds => "window",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// What a shard reports about its load; `None` for a signal it does not report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardLoad {
    values: [Option<u64>; LoadKey::ALL.len()],
}

impl ShardLoad {
    /// The value of `key`, if reported.
    pub fn get(&self, key: LoadKey) -> Option<u64> {
        self.values[key.index()]
    }

    /// Sets `key` to `value`, capped at [`MAX_LOAD_VALUE`]; `None` leaves the signal out.
    pub fn set(&mut self, key: LoadKey, value: Option<u64>) -> &mut Self {
        self.values[key.index()] = value.map(|v| v.min(MAX_LOAD_VALUE));
        self
    }

    /// This load with `key` set to `value` (see [`ShardLoad::set`]).
    #[must_use]
    pub fn with(mut self, key: LoadKey, value: u64) -> Self {
        self.set(key, Some(value));
        self
    }

    /// Whether no signal is reported.
    pub fn is_empty(&self) -> bool {
        self.values.iter().all(Option::is_none)
    }

    /// Reads a Lease's [`ANNOTATION_LOAD`] value from its annotations: `None` when there is none,
    /// the error when it is not a valid report.
    pub fn from_annotations(
        annotations: &std::collections::BTreeMap<String, String>,
    ) -> Option<Result<Self, LoadAnnotationError>> {
        annotations.get(ANNOTATION_LOAD).map(|v| v.parse())
    }
}

impl fmt::Display for ShardLoad {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for key in LoadKey::ALL {
            if let Some(value) = self.get(key) {
                if !first {
                    f.write_str(",")?;
                }
                first = false;
                write!(f, "{}={value}", key.as_str())?;
            }
        }
        Ok(())
    }
}

/// Why an [`ANNOTATION_LOAD`] value is not a [`ShardLoad`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadAnnotationError {
    /// The value is longer than [`MAX_LOAD_ANNOTATION_BYTES`].
    #[error("load report of {0} bytes is longer than {MAX_LOAD_ANNOTATION_BYTES}")]
    TooLong(usize),
    /// The value reports nothing.
    #[error("load report is empty")]
    Empty,
    /// A part is not `key=value`.
    #[error("load report part {0:?} is not key=value")]
    NotAPair(String),
    /// A key is not one of [`LoadKey::ALL`].
    #[error("load report key {0:?} is unknown")]
    UnknownKey(String),
    /// A key comes twice or out of order.
    #[error("load report key {0:?} is repeated or out of order")]
    Order(&'static str),
    /// A value is not a decimal integer up to [`MAX_LOAD_VALUE`] without sign or leading zero.
    #[error("load report value {value:?} of {key} is not an integer from 0 to {MAX_LOAD_VALUE}")]
    Value {
        /// The key.
        key: &'static str,
        /// The refused value.
        value: String,
    },
}

impl FromStr for ShardLoad {
    type Err = LoadAnnotationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() > MAX_LOAD_ANNOTATION_BYTES {
            return Err(LoadAnnotationError::TooLong(s.len()));
        }
        if s.is_empty() {
            return Err(LoadAnnotationError::Empty);
        }
        let mut load = ShardLoad::default();
        let mut next = 0;
        for part in s.split(',') {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| LoadAnnotationError::NotAPair(part.to_owned()))?;
            let key = LoadKey::ALL
                .into_iter()
                .find(|k| k.as_str() == key)
                .ok_or_else(|| LoadAnnotationError::UnknownKey(key.to_owned()))?;
            if key.index() < next {
                return Err(LoadAnnotationError::Order(key.as_str()));
            }
            next = key.index() + 1;
            let canonical = !value.is_empty()
                && value.len() <= 12
                && value.bytes().all(|b| b.is_ascii_digit())
                && (value == "0" || !value.starts_with('0'));
            let parsed = canonical
                .then(|| value.parse::<u64>().ok())
                .flatten()
                .ok_or_else(|| LoadAnnotationError::Value {
                    key: key.as_str(),
                    value: value.to_owned(),
                })?;
            load.values[key.index()] = Some(parsed);
        }
        Ok(load)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_report_reads_back_as_written() {
        let load = ShardLoad::default()
            .with(LoadKey::Objects, 1200)
            .with(LoadKey::Queue, 3)
            .with(LoadKey::P50Millis, 12)
            .with(LoadKey::P99Millis, 80)
            .with(LoadKey::Errors, 0)
            .with(LoadKey::WindowSeconds, 60);
        let text = load.to_string();
        assert_eq!(
            text,
            "objects=1200,queue=3,p50ms=12,p99ms=80,errors=0,window=60"
        );
        assert_eq!(text.parse::<ShardLoad>(), Ok(load));
    }

    #[test]
    fn a_partial_report_keeps_only_what_it_names() {
        let load: ShardLoad = "queue=7,window=30".parse().unwrap();
        assert_eq!(load.get(LoadKey::Objects), None);
        assert_eq!(load.get(LoadKey::Queue), Some(7));
        assert_eq!(load.get(LoadKey::WindowSeconds), Some(30));
        assert_eq!(load.to_string(), "queue=7,window=30");
    }

    #[test]
    fn values_are_capped_when_set() {
        let load = ShardLoad::default().with(LoadKey::Objects, u64::MAX);
        assert_eq!(load.get(LoadKey::Objects), Some(MAX_LOAD_VALUE));
        assert_eq!(load.to_string().parse::<ShardLoad>(), Ok(load));
    }

    #[test]
    fn the_longest_valid_report_fits_the_bound() {
        let mut load = ShardLoad::default();
        for key in LoadKey::ALL {
            load.set(key, Some(MAX_LOAD_VALUE));
        }
        let text = load.to_string();
        assert_eq!(text.len(), MAX_LOAD_ANNOTATION_BYTES);
        assert_eq!(text.parse::<ShardLoad>(), Ok(load));
    }

    #[test]
    fn malformed_reports_are_refused() {
        let refused = [
            ("", LoadAnnotationError::Empty),
            ("objects", LoadAnnotationError::NotAPair("objects".into())),
            ("cpu=1", LoadAnnotationError::UnknownKey("cpu".into())),
            ("queue=1,objects=2", LoadAnnotationError::Order("objects")),
            ("objects=1,objects=2", LoadAnnotationError::Order("objects")),
            (
                "objects=01",
                LoadAnnotationError::Value {
                    key: "objects",
                    value: "01".into(),
                },
            ),
            (
                "objects=-1",
                LoadAnnotationError::Value {
                    key: "objects",
                    value: "-1".into(),
                },
            ),
            (
                "objects=1000000000000",
                LoadAnnotationError::Value {
                    key: "objects",
                    value: "1000000000000".into(),
                },
            ),
            (
                "objects=",
                LoadAnnotationError::Value {
                    key: "objects",
                    value: String::new(),
                },
            ),
            ("objects=1,", LoadAnnotationError::NotAPair(String::new())),
            (
                "objects=1, queue=2",
                LoadAnnotationError::UnknownKey(" queue".into()),
            ),
        ];
        for (text, error) in refused {
            assert_eq!(text.parse::<ShardLoad>(), Err(error), "{text:?}");
        }
        let long = "x".repeat(MAX_LOAD_ANNOTATION_BYTES + 1);
        assert_eq!(
            long.parse::<ShardLoad>(),
            Err(LoadAnnotationError::TooLong(long.len()))
        );
    }
}
