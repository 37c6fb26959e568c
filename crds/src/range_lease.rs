//! The two Lease annotations of a zero-write ring's range handover (docs/zero-write-rings.md,
//! "Where the sharder publishes ranges" and "Revoke before grant").
//!
//! - The sharder writes [`ANNOTATION_RANGES`] on a shard's Lease: a generation and the shard's
//!   ranges of the 64-bit FNV-1a space ([`PublishedRanges`]), for example
//!   `"7 0000000000000000-1f00000000000000,c000000000000000-10000000000000000"`. A generation
//!   alone (`"8"`) publishes no ranges: the shard watches nothing.
//! - The shard writes [`ANNOTATION_ACKNOWLEDGED`] on its own Lease once it runs with a published
//!   generation and has stopped all work outside its ranges: the generation alone
//!   ([`Acknowledgement`]), for example `"7"`.
//!
//! Both are read strictly: a value is either exactly what [`fmt::Display`] writes or an error
//! naming what is wrong, so a value written by anything else never counts as a publication or an
//! acknowledgement it does not spell out. The rules:
//!
//! - the generation is a `u64` in decimal: digits only, no sign, no leading zero (`0` itself is
//!   fine);
//! - ranges follow the generation after one space, joined by `,` without spaces; each is
//!   `START-END`, half-open, both bounds exactly 16 lowercase hex digits without `0x`, except that
//!   an end of 2^64 is written `10000000000000000`; the start is below the end;
//! - ranges come sorted and neither overlap nor touch (each start is above the previous end), as a
//!   [`RangeSet`] keeps them, so one set has exactly one spelling;
//! - at most [`MAX_PUBLISHED_RANGES`] ranges and [`MAX_RANGES_ANNOTATION_BYTES`] bytes.
//!
//! A range costs 34 bytes (33 and a comma): 32 ranges, a weight-1 shard's share of a
//! [`RangeRing`](crate::ranges::RangeRing), take about 1.1 KB.

use std::fmt;
use std::str::FromStr;

use crate::ranges::{HashRange, RangeSet, SPACE_END};

/// Annotation the sharder writes on a shard's Lease with the shard's ranges and their
/// generation ([`PublishedRanges`]).
pub const ANNOTATION_RANGES: &str = "alpha.sharding.timebertt.dev/ranges";

/// Annotation a shard writes on its own Lease with the generation of ranges it now runs with
/// ([`Acknowledgement`]).
pub const ANNOTATION_ACKNOWLEDGED: &str = "alpha.sharding.timebertt.dev/acknowledged";

/// The most ranges one [`PublishedRanges`] may hold.
///
/// A shard of the largest weight (10) gets at most 321 ranges from a
/// [`RangeRing`](crate::ranges::RangeRing) (320 tokens, one more where an arc wraps past the top),
/// and a revoke publishes the intersection of two such sets, at most 641 ranges. 1024 leaves room
/// and keeps the annotation near 34 KB, well inside the 256 KiB that Kubernetes allows for all
/// annotations of an object together.
pub const MAX_PUBLISHED_RANGES: usize = 1024;

/// The longest [`ANNOTATION_RANGES`] value: a 20-digit generation, a space and
/// [`MAX_PUBLISHED_RANGES`] ranges of 33 bytes with a comma between each two, one more byte for
/// an end of 2^64. Longer values are refused before anything else is read.
pub const MAX_RANGES_ANNOTATION_BYTES: usize = 20 + 1 + MAX_PUBLISHED_RANGES * 34 - 1 + 1;

/// The longest [`ANNOTATION_ACKNOWLEDGED`] value: the 20 digits of `u64::MAX`.
pub const MAX_ACKNOWLEDGED_BYTES: usize = 20;

/// Why an annotation value is not a [`PublishedRanges`] or an [`Acknowledgement`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RangeAnnotationError {
    /// The value is longer than the annotation allows.
    #[error("the value has {len} bytes, more than the {max} allowed")]
    TooLong {
        /// The value's length in bytes.
        len: usize,
        /// The most allowed.
        max: usize,
    },
    /// More ranges than [`MAX_PUBLISHED_RANGES`].
    #[error("{0} ranges, more than the {MAX_PUBLISHED_RANGES} allowed")]
    TooManyRanges(usize),
    /// The generation is not a `u64` in plain decimal.
    #[error(
        "generation {0:?} is not a decimal integer from 0 to 18446744073709551615 without sign or leading zeros"
    )]
    Generation(String),
    /// A space follows the generation, but no range does.
    #[error("no ranges after the generation's space (a generation alone publishes no ranges)")]
    NoRanges,
    /// A range is not `START-END`.
    #[error("range {0:?} is not START-END")]
    Range(String),
    /// A bound is not 16 lowercase hex digits (or `10000000000000000` as an end).
    #[error("bound {0:?} is not 16 lowercase hex digits (an end may also be 10000000000000000)")]
    Bound(String),
    /// A range's start is not below its end.
    #[error("range {0:?} does not start below its end")]
    Empty(String),
    /// A range does not start above the previous range's end.
    #[error(
        "range {0:?} does not start above the end of the range before it (ranges must be sorted, apart and not touching)"
    )]
    Unsorted(String),
}

/// The value of [`ANNOTATION_RANGES`]: the ranges the sharder gives a shard, under a generation
/// that grows with every write of the ring's ranges.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PublishedRanges {
    generation: u64,
    ranges: RangeSet,
}

impl PublishedRanges {
    /// `ranges` under `generation`, or [`RangeAnnotationError::TooManyRanges`] when the set has
    /// more than [`MAX_PUBLISHED_RANGES`] ranges.
    pub fn new(generation: u64, ranges: RangeSet) -> Result<Self, RangeAnnotationError> {
        let count = ranges.ranges().len();
        if count > MAX_PUBLISHED_RANGES {
            return Err(RangeAnnotationError::TooManyRanges(count));
        }
        Ok(Self { generation, ranges })
    }

    /// The generation.
    #[must_use]
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The ranges (possibly none).
    #[must_use]
    pub fn ranges(&self) -> &RangeSet {
        &self.ranges
    }
}

impl fmt::Display for PublishedRanges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.generation)?;
        for (i, range) in self.ranges.ranges().iter().enumerate() {
            f.write_str(if i == 0 { " " } else { "," })?;
            // 2^64 needs 17 digits, every other bound exactly 16.
            write!(f, "{:016x}-{:016x}", range.start(), range.end())?;
        }
        Ok(())
    }
}

impl FromStr for PublishedRanges {
    type Err = RangeAnnotationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() > MAX_RANGES_ANNOTATION_BYTES {
            return Err(RangeAnnotationError::TooLong {
                len: s.len(),
                max: MAX_RANGES_ANNOTATION_BYTES,
            });
        }
        let (generation, list) = match s.split_once(' ') {
            Some((generation, list)) => (generation, Some(list)),
            None => (s, None),
        };
        let generation = parse_generation(generation)?;
        let Some(list) = list else {
            return Ok(Self {
                generation,
                ranges: RangeSet::empty(),
            });
        };
        if list.is_empty() {
            return Err(RangeAnnotationError::NoRanges);
        }
        let mut ranges: Vec<HashRange> = Vec::new();
        // Every range takes at least 33 bytes and a comma, so the byte limit already keeps the
        // count within MAX_PUBLISHED_RANGES.
        for text in list.split(',') {
            let (start, end) = text
                .split_once('-')
                .ok_or_else(|| RangeAnnotationError::Range(text.to_string()))?;
            let start = parse_bound(start, false)?;
            let end = parse_bound(end, true)?;
            let start =
                u64::try_from(start).map_err(|_| RangeAnnotationError::Bound(text.to_string()))?;
            let range = HashRange::new(start, end)
                .ok_or_else(|| RangeAnnotationError::Empty(text.to_string()))?;
            if ranges
                .last()
                .is_some_and(|last| u128::from(range.start()) <= last.end())
            {
                return Err(RangeAnnotationError::Unsorted(text.to_string()));
            }
            ranges.push(range);
        }
        // Sorted, apart and not touching: `RangeSet::new` keeps them exactly as they are.
        Ok(Self {
            generation,
            ranges: RangeSet::new(ranges),
        })
    }
}

/// The value of [`ANNOTATION_ACKNOWLEDGED`]: the generation of [`PublishedRanges`] a shard runs
/// with, having stopped every watch and reconcile outside its ranges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Acknowledgement {
    /// The acknowledged generation.
    pub generation: u64,
}

impl fmt::Display for Acknowledgement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.generation)
    }
}

impl FromStr for Acknowledgement {
    type Err = RangeAnnotationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() > MAX_ACKNOWLEDGED_BYTES {
            return Err(RangeAnnotationError::TooLong {
                len: s.len(),
                max: MAX_ACKNOWLEDGED_BYTES,
            });
        }
        parse_generation(s).map(|generation| Self { generation })
    }
}

/// A generation in plain decimal: digits only, no leading zero, at most `u64::MAX`.
fn parse_generation(text: &str) -> Result<u64, RangeAnnotationError> {
    let bad = || RangeAnnotationError::Generation(text.to_string());
    let digits = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    if !digits || (text.len() > 1 && text.starts_with('0')) {
        return Err(bad());
    }
    text.parse().map_err(|_| bad())
}

/// A bound of 16 lowercase hex digits, or 2^64 when `is_end`.
fn parse_bound(text: &str, is_end: bool) -> Result<u128, RangeAnnotationError> {
    if is_end && text == format!("{SPACE_END:x}") {
        return Ok(SPACE_END);
    }
    let hex = text.len() == 16
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !hex {
        return Err(RangeAnnotationError::Bound(text.to_string()));
    }
    u64::from_str_radix(text, 16)
        .map(u128::from)
        .map_err(|_| RangeAnnotationError::Bound(text.to_string()))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::labels::is_valid_label_key;

    fn set(ranges: &[(u64, u128)]) -> RangeSet {
        RangeSet::new(
            ranges
                .iter()
                .map(|&(s, e)| HashRange::new(s, e).expect("a valid range")),
        )
    }

    fn published(generation: u64, ranges: &[(u64, u128)]) -> PublishedRanges {
        PublishedRanges::new(generation, set(ranges)).expect("few ranges")
    }

    #[test]
    fn keys_are_valid_annotation_keys() {
        // Annotation keys follow the label key syntax.
        assert!(is_valid_label_key(ANNOTATION_RANGES));
        assert!(is_valid_label_key(ANNOTATION_ACKNOWLEDGED));
    }

    #[test]
    fn writes_the_documented_form() {
        assert_eq!(
            published(7, &[(0xc000_0000_0000_0000, SPACE_END), (0, 0x1f << 56)]).to_string(),
            "7 0000000000000000-1f00000000000000,c000000000000000-10000000000000000"
        );
        assert_eq!(published(8, &[]).to_string(), "8");
        assert_eq!(
            published(u64::MAX, &[(0, SPACE_END)]).to_string(),
            "18446744073709551615 0000000000000000-10000000000000000"
        );
        assert_eq!(Acknowledgement { generation: 7 }.to_string(), "7");
    }

    #[test]
    fn reads_what_it_writes() {
        assert_eq!(
            "7 0000000000000000-1f00000000000000,c000000000000000-10000000000000000".parse(),
            Ok(published(
                7,
                &[(0, 0x1f << 56), (0xc000_0000_0000_0000, SPACE_END)]
            ))
        );
        assert_eq!("0".parse(), Ok(published(0, &[])));
        assert_eq!(
            "00000000000000ff-0000000000000100".parse::<PublishedRanges>(),
            Err(RangeAnnotationError::Generation(
                "00000000000000ff-0000000000000100".into()
            )),
            "a range list needs its generation"
        );
        assert_eq!("42".parse(), Ok(Acknowledgement { generation: 42 }));
        assert_eq!(
            "18446744073709551615".parse(),
            Ok(Acknowledgement {
                generation: u64::MAX
            })
        );
    }

    #[test]
    fn refuses_malformed_ranges() {
        use RangeAnnotationError as E;
        let a = "0000000000000000";
        let b = "8000000000000000";
        let cases: Vec<(String, RangeAnnotationError)> = vec![
            (String::new(), E::Generation(String::new())),
            (" ".into(), E::Generation(String::new())),
            ("7 ".into(), E::NoRanges),
            ("+7".into(), E::Generation("+7".into())),
            ("-1".into(), E::Generation("-1".into())),
            ("07".into(), E::Generation("07".into())),
            ("0x7".into(), E::Generation("0x7".into())),
            ("7.0".into(), E::Generation("7.0".into())),
            (
                "18446744073709551616".into(),
                E::Generation("18446744073709551616".into()),
            ),
            // One space only, nowhere else.
            (format!("7  {a}-{b}"), E::Bound(format!(" {a}"))),
            (format!("7 {a}-{b} "), E::Bound(format!("{b} "))),
            (
                format!("7 {a}-{b}, {b}-c000000000000000"),
                E::Bound(format!(" {b}")),
            ),
            (format!("7 {a}-{b},"), E::Range(String::new())),
            (format!("7 {a}"), E::Range(a.into())),
            (format!("7 {a}:{b}"), E::Range(format!("{a}:{b}"))),
            // Bounds: 16 lowercase hex digits, no prefix; only an end may be 2^64.
            (format!("7 0x{a}-{b}"), E::Bound(format!("0x{a}"))),
            (format!("7 {a}-0x{b}"), E::Bound(format!("0x{b}"))),
            (
                format!("7 {a}-8000000000000000a"),
                E::Bound("8000000000000000a".into()),
            ),
            (
                format!("7 {a}-800000000000000"),
                E::Bound("800000000000000".into()),
            ),
            (
                format!("7 {a}-8000000000000ABC"),
                E::Bound("8000000000000ABC".into()),
            ),
            (
                format!("7 {a}-800000000000000g"),
                E::Bound("800000000000000g".into()),
            ),
            (
                format!("7 {a}-+800000000000000"),
                E::Bound("+800000000000000".into()),
            ),
            (
                "7 10000000000000000-10000000000000000".into(),
                E::Bound("10000000000000000".into()),
            ),
            (
                format!("7 {a}-20000000000000000"),
                E::Bound("20000000000000000".into()),
            ),
            (format!("7 {a}-{b}-{b}"), E::Bound(format!("{b}-{b}"))),
            // Non-empty, sorted, apart, not touching.
            (format!("7 {b}-{b}"), E::Empty(format!("{b}-{b}"))),
            (format!("7 {b}-{a}"), E::Empty(format!("{b}-{a}"))),
            (
                format!("7 {b}-c000000000000000,{a}-1000000000000000"),
                E::Unsorted(format!("{a}-1000000000000000")),
            ),
            (
                format!("7 {a}-{b},{b}-c000000000000000"),
                E::Unsorted(format!("{b}-c000000000000000")),
            ),
            (
                format!("7 {a}-c000000000000000,{b}-d000000000000000"),
                E::Unsorted(format!("{b}-d000000000000000")),
            ),
            (
                format!("7 {a}-{b},{a}-{b}"),
                E::Unsorted(format!("{a}-{b}")),
            ),
            ("7 ü".into(), E::Range("ü".into())),
        ];
        for (value, expected) in cases {
            assert_eq!(value.parse::<PublishedRanges>(), Err(expected), "{value:?}");
        }
    }

    #[test]
    fn refuses_malformed_acknowledgements() {
        for value in ["", " 7", "7 ", "07", "-7", "+7", "7.0", "x"] {
            assert_eq!(
                value.parse::<Acknowledgement>(),
                Err(RangeAnnotationError::Generation(value.into())),
                "{value:?}"
            );
        }
        let long = "1".repeat(21);
        assert_eq!(
            long.parse::<Acknowledgement>(),
            Err(RangeAnnotationError::TooLong { len: 21, max: 20 })
        );
    }

    /// `count` ranges of one hash each, two apart, the last reaching 2^64.
    fn many(count: usize) -> RangeSet {
        let count = u64::try_from(count).expect("small");
        RangeSet::new((0..count).map(|i| {
            let start = u64::MAX - 2 * (count - 1 - i);
            HashRange::new(start, u128::from(start) + 1).expect("a valid range")
        }))
    }

    #[test]
    fn bounds_the_number_of_ranges_and_bytes() {
        // The largest value allowed is exactly as long as the byte limit says, and reads back.
        let largest = PublishedRanges::new(u64::MAX, many(MAX_PUBLISHED_RANGES))
            .expect("the most ranges allowed");
        let text = largest.to_string();
        assert_eq!(text.len(), MAX_RANGES_ANNOTATION_BYTES);
        assert_eq!(text.parse(), Ok(largest));

        assert_eq!(
            PublishedRanges::new(1, many(MAX_PUBLISHED_RANGES + 1)),
            Err(RangeAnnotationError::TooManyRanges(
                MAX_PUBLISHED_RANGES + 1
            ))
        );
        // One range more does not fit the byte limit, even under the shortest generation: the
        // byte limit is what keeps the count in bounds when reading.
        let over = format!(
            "{},0000000000000000-0000000000000001",
            PublishedRanges::new(1, many(MAX_PUBLISHED_RANGES)).expect("the most ranges allowed")
        );
        assert!(matches!(
            over.parse::<PublishedRanges>(),
            Err(RangeAnnotationError::TooLong { .. })
        ));
        // Anything longer is refused before it is read.
        let long = format!("{text},");
        assert_eq!(
            long.parse::<PublishedRanges>(),
            Err(RangeAnnotationError::TooLong {
                len: MAX_RANGES_ANNOTATION_BYTES + 1,
                max: MAX_RANGES_ANNOTATION_BYTES
            })
        );
    }

    /// Up to 40 arbitrary ranges, merged into a set.
    fn range_sets() -> impl Strategy<Value = RangeSet> {
        proptest::collection::vec((any::<u64>(), any::<u64>(), any::<bool>()), 0..40).prop_map(
            |bounds| {
                RangeSet::new(bounds.into_iter().filter_map(|(a, b, top)| {
                    let (start, end) =
                        (a.min(b), if top { SPACE_END } else { u128::from(a.max(b)) });
                    HashRange::new(start, end)
                }))
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn published_ranges_read_back_what_they_write(generation in any::<u64>(), ranges in range_sets()) {
            let value = PublishedRanges::new(generation, ranges).expect("few ranges");
            let text = value.to_string();
            prop_assert!(text.len() <= MAX_RANGES_ANNOTATION_BYTES);
            prop_assert_eq!(text.parse::<PublishedRanges>(), Ok(value));
        }

        #[test]
        fn acknowledgements_read_back_what_they_write(generation in any::<u64>()) {
            let value = Acknowledgement { generation };
            prop_assert_eq!(value.to_string().parse::<Acknowledgement>(), Ok(value));
        }

        /// Whatever the input, parsing answers without panicking, and what it accepts is written
        /// back exactly as it was read: one spelling per value.
        #[test]
        fn accepts_only_the_written_spelling(text in "[0-9a-f ,x+-]{0,80}") {
            if let Ok(value) = text.parse::<PublishedRanges>() {
                prop_assert_eq!(value.to_string(), text.clone());
            }
            if let Ok(value) = text.parse::<Acknowledgement>() {
                prop_assert_eq!(value.to_string(), text);
            }
        }

        /// Changing one byte of a valid value gives either an error or another value that
        /// writes back as the changed text.
        #[test]
        fn mutated_values_are_refused_or_canonical(
            generation in any::<u64>(),
            ranges in range_sets(),
            at in any::<prop::sample::Index>(),
            byte in prop::sample::select(b"0123456789abcdefABx-, ".to_vec()),
        ) {
            let mut text = PublishedRanges::new(generation, ranges).expect("few ranges").to_string().into_bytes();
            let at = at.index(text.len());
            text[at] = byte;
            let text = String::from_utf8(text).expect("ASCII");
            if let Ok(value) = text.parse::<PublishedRanges>() {
                prop_assert_eq!(value.to_string(), text);
            }
        }
    }
}
