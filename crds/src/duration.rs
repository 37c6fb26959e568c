//! Durations in the Go notation Kubernetes configuration uses (`15s`, `5m`, `1h30m`, `1.5s`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration as StdDuration;

/// A duration written as a Go duration string in configuration files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Duration(pub StdDuration);

/// A string that is not a Go duration.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid duration {input:?}: {reason} (expected e.g. \"15s\", \"5m\", \"1h30m\")")]
pub struct ParseDurationError {
    input: String,
    reason: &'static str,
}

impl Duration {
    /// A duration of whole seconds.
    pub const fn from_secs(secs: u64) -> Self {
        Self(StdDuration::from_secs(secs))
    }
}

impl From<Duration> for StdDuration {
    fn from(d: Duration) -> Self {
        d.0
    }
}

impl FromStr for Duration {
    type Err = ParseDurationError;

    /// Parses a sequence of decimal numbers with units `ns`, `us`/`µs`, `ms`, `s`, `m`, `h`, as Go's
    /// `time.ParseDuration` does; negative durations are rejected because no setting can use them.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseDurationError {
            input: input.to_string(),
            reason,
        };
        let mut rest = input.strip_prefix('+').unwrap_or(input);
        if rest.starts_with('-') {
            return Err(err("negative durations are not allowed"));
        }
        if rest == "0" {
            return Ok(Self(StdDuration::ZERO));
        }
        if rest.is_empty() {
            return Err(err("empty"));
        }
        let mut total_nanos: u128 = 0;
        while !rest.is_empty() {
            let number_len = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .unwrap_or(rest.len());
            let (number, tail) = rest.split_at(number_len);
            if number.is_empty() || number == "." || number.matches('.').count() > 1 {
                return Err(err("expected a number"));
            }
            let unit_len = tail
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(tail.len());
            let (unit, tail) = tail.split_at(unit_len);
            let unit_nanos: u128 = match unit {
                "ns" => 1,
                "us" | "µs" | "μs" => 1_000,
                "ms" => 1_000_000,
                "s" => 1_000_000_000,
                "m" => 60 * 1_000_000_000,
                "h" => 3_600 * 1_000_000_000,
                "" => return Err(err("missing unit")),
                _ => return Err(err("unknown unit")),
            };
            let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
            let whole: u128 = if whole.is_empty() {
                0
            } else {
                whole.parse().map_err(|_| err("number too large"))?
            };
            let mut nanos = whole
                .checked_mul(unit_nanos)
                .ok_or_else(|| err("number too large"))?;
            let mut scale = unit_nanos;
            for digit in frac.bytes().take(30) {
                scale /= 10;
                nanos += u128::from(digit - b'0') * scale;
            }
            total_nanos = total_nanos
                .checked_add(nanos)
                .ok_or_else(|| err("number too large"))?;
            rest = tail;
        }
        let secs =
            u64::try_from(total_nanos / 1_000_000_000).map_err(|_| err("number too large"))?;
        // The remainder is below 10^9 and always fits.
        let subsec = (total_nanos % 1_000_000_000) as u32;
        Ok(Self(StdDuration::new(secs, subsec)))
    }
}

impl fmt::Display for Duration {
    /// Formats like Go's `Duration.String` for whole seconds (`1h30m0s`), with milliseconds as
    /// a fraction of a second when present.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.0.as_secs();
        let millis = self.0.subsec_millis();
        if secs == 0 && millis == 0 {
            return f.write_str("0s");
        }
        if secs == 0 {
            return write!(f, "{millis}ms");
        }
        let (h, m, s) = (secs / 3600, (secs / 60) % 60, secs % 60);
        if h > 0 {
            write!(f, "{h}h")?;
        }
        if h > 0 || m > 0 {
            write!(f, "{m}m")?;
        }
        if millis > 0 {
            write!(f, "{s}.{millis:03}s")
        } else {
            write!(f, "{s}s")
        }
    }
}

impl serde::Serialize for Duration {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Duration {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> StdDuration {
        s.parse::<Duration>().expect(s).0
    }

    #[test]
    fn parses_go_durations() {
        assert_eq!(parse("15s"), StdDuration::from_secs(15));
        assert_eq!(parse("5m"), StdDuration::from_secs(300));
        assert_eq!(parse("1h30m"), StdDuration::from_secs(5400));
        assert_eq!(parse("1.5s"), StdDuration::from_millis(1500));
        assert_eq!(parse("300ms"), StdDuration::from_millis(300));
        assert_eq!(parse("2us"), StdDuration::from_micros(2));
        assert_eq!(parse("0"), StdDuration::ZERO);
        assert_eq!(parse("1m0s"), StdDuration::from_secs(60));
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "5", "s", "5x", "-1s", "1..5s", "1h-3m", "five seconds"] {
            assert!(
                bad.parse::<Duration>().is_err(),
                "{bad:?} should be rejected"
            );
        }
    }

    #[test]
    fn display_round_trips() {
        for text in ["15s", "5m0s", "1h30m0s", "1.500s", "300ms", "0s"] {
            assert_eq!(
                parse(text),
                parse(&Duration(parse(text)).to_string()),
                "{text}"
            );
        }
        assert_eq!(Duration::from_secs(300).to_string(), "5m0s");
    }
}
