//! Hash ranges for server-side sharded list and watch (zero-write rings, docs/zero-write-rings.md).
//!
//! Since Kubernetes 1.36 kube-apiserver can filter a list or watch by a hash of one field of each
//! object (feature gate `ShardedListAndWatch`, alpha and off by default in 1.36 and 1.37): the
//! client adds the query parameter [`QUERY_PARAMETER`] with a selector such as
//!
//! ```text
//! shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000') || shardRange(object.metadata.uid, '0xc000000000000000', '0x10000000000000000')
//! ```
//!
//! and gets only the objects whose [64-bit FNV-1a](fnv1a64) hash of the field lies in one of the
//! half-open ranges. A server that applied the selector echoes it, normalized to exactly that
//! form, in the list's `metadata.shardInfo.selector`; a server that does not know the gate, or
//! runs with it off, ignores the parameter and sends every object.
//!
//! This module holds the pure part, shared by the sharder, the shard library and
//! `kubectl sharding`:
//!
//! - [`fnv1a64`], the server's hash;
//! - [`HashRange`] and [`RangeSet`], half-open ranges of the 64-bit space and a shard's sorted,
//!   merged union of them;
//! - [`ShardSelector`], a field and a range set, written and parsed in the server's grammar;
//! - [`RangeRing`], which divides the space between shards with consistent hashing, so that a
//!   shard coming or going moves only the ranges it gains or loses.
//!
//! The grammar, as kube-apiserver 1.37 checks it: one or more `shardRange(FIELD, 'START', 'END')`
//! terms joined with `||`, all on the same field (`object.metadata.uid` or
//! `object.metadata.namespace`); bounds are `0x` and exactly 16 lowercase hex digits, the end may
//! also be `0x10000000000000000` (2^64), and the start must be below the end. Whitespace between
//! tokens is free and double quotes work as well as single ones; the server's echo uses single
//! quotes, `, ` between arguments and ` || ` between terms, which is what [`ShardSelector`]
//! writes. Terms may overlap and come in any order; the echo keeps them as sent.

use std::collections::BTreeMap;
use std::fmt;
use std::fmt::Write as _;
use std::str::FromStr;

use xxhash_rust::xxh64::xxh64;

use crate::HashKey;

/// The list and watch query parameter that carries a [`ShardSelector`].
pub const QUERY_PARAMETER: &str = "shardSelector";

/// The size of the hash space, 2^64: the end of the last range.
pub const SPACE_END: u128 = 1 << 64;

/// 64-bit FNV-1a of `value`'s UTF-8 bytes: the hash kube-apiserver filters by.
#[must_use]
pub fn fnv1a64(value: &str) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    value.bytes().fold(OFFSET_BASIS, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(PRIME)
    })
}

/// The object field a selector hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ShardField {
    /// `object.metadata.uid`: every object by its own identity.
    Uid,
    /// `object.metadata.namespace`: all objects of a namespace together (cluster-scoped objects
    /// have the empty namespace, so they all hash alike).
    Namespace,
}

impl ShardField {
    /// The field path in the selector's grammar.
    #[must_use]
    pub fn path(self) -> &'static str {
        match self {
            Self::Uid => "object.metadata.uid",
            Self::Namespace => "object.metadata.namespace",
        }
    }

    /// The field of a field path, if the server supports it.
    #[must_use]
    pub fn from_path(path: &str) -> Option<Self> {
        [Self::Uid, Self::Namespace]
            .into_iter()
            .find(|field| field.path() == path)
    }
}

impl From<HashKey> for ShardField {
    /// The field a ring's hash key hashes: an object-hashed ring hashes the object's uid.
    fn from(key: HashKey) -> Self {
        match key {
            HashKey::Object => Self::Uid,
            HashKey::Namespace => Self::Namespace,
        }
    }
}

/// A non-empty half-open range `[start, end)` of the 64-bit hash space; `end` may be 2^64
/// ([`SPACE_END`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HashRange {
    start: u64,
    /// At most [`SPACE_END`], so it needs more than 64 bits.
    end: u128,
}

impl HashRange {
    /// The whole space, `[0, 2^64)`.
    pub const FULL: Self = Self {
        start: 0,
        end: SPACE_END,
    };

    /// `[start, end)`, or `None` unless `start < end <= 2^64`.
    #[must_use]
    pub fn new(start: u64, end: u128) -> Option<Self> {
        (u128::from(start) < end && end <= SPACE_END).then_some(Self { start, end })
    }

    /// The first hash in the range.
    #[must_use]
    pub fn start(&self) -> u64 {
        self.start
    }

    /// The first hash past the range (2^64 for a range that reaches the top).
    #[must_use]
    pub fn end(&self) -> u128 {
        self.end
    }

    /// How many hashes the range holds.
    #[must_use]
    pub fn width(&self) -> u128 {
        self.end - u128::from(self.start)
    }

    /// Whether `hash` lies in the range.
    #[must_use]
    pub fn contains(&self, hash: u64) -> bool {
        self.start <= hash && u128::from(hash) < self.end
    }
}

/// A union of hash ranges, kept sorted with overlapping and adjacent ranges merged, so that two
/// sets covering the same hashes are equal and write the same selector.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct RangeSet {
    ranges: Vec<HashRange>,
}

impl RangeSet {
    /// The union of `ranges`, in any order, overlapping or not.
    pub fn new(ranges: impl IntoIterator<Item = HashRange>) -> Self {
        let mut sorted: Vec<HashRange> = ranges.into_iter().collect();
        sorted.sort_unstable();
        let mut merged: Vec<HashRange> = Vec::with_capacity(sorted.len());
        for range in sorted {
            match merged.last_mut() {
                Some(last) if u128::from(range.start) <= last.end => {
                    last.end = last.end.max(range.end);
                }
                _ => merged.push(range),
            }
        }
        Self { ranges: merged }
    }

    /// The union of arcs of the hash circle, each from `start` up to but not including `end`,
    /// going up and wrapping past the top when `end <= start` (so `start == end` is the whole
    /// circle). An arc that wraps is split at 0, since the server's ranges cannot wrap.
    pub fn from_arcs(arcs: impl IntoIterator<Item = (u64, u64)>) -> Self {
        let mut ranges = Vec::new();
        for (start, end) in arcs {
            if start < end {
                ranges.extend(HashRange::new(start, u128::from(end)));
            } else {
                ranges.extend(HashRange::new(start, SPACE_END));
                ranges.extend(HashRange::new(0, u128::from(end)));
            }
        }
        Self::new(ranges)
    }

    /// The set holding no hash.
    #[must_use]
    pub fn empty() -> Self {
        Self::default()
    }

    /// The set holding every hash.
    #[must_use]
    pub fn full() -> Self {
        Self {
            ranges: vec![HashRange::FULL],
        }
    }

    /// Whether the set holds no hash.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The ranges, sorted, disjoint and not adjacent.
    #[must_use]
    pub fn ranges(&self) -> &[HashRange] {
        &self.ranges
    }

    /// Whether `hash` lies in one of the ranges.
    #[must_use]
    pub fn contains(&self, hash: u64) -> bool {
        let after = self.ranges.partition_point(|r| r.start <= hash);
        after > 0 && self.ranges[after - 1].contains(hash)
    }

    /// How many hashes the set holds.
    #[must_use]
    pub fn width(&self) -> u128 {
        self.ranges.iter().map(HashRange::width).sum()
    }

    /// This set without the one hash `hash` (a range holding it is split around it).
    #[must_use]
    pub fn without_hash(&self, hash: u64) -> Self {
        let mut ranges = Vec::with_capacity(self.ranges.len() + 1);
        for range in &self.ranges {
            if range.contains(hash) {
                ranges.extend(HashRange::new(range.start, u128::from(hash)));
                // Past the top (hash 2^64 - 1) nothing is left above.
                if let Ok(above) = u64::try_from(u128::from(hash) + 1) {
                    ranges.extend(HashRange::new(above, range.end));
                }
            } else {
                ranges.push(*range);
            }
        }
        Self::new(ranges)
    }

    /// This set with the one hash `hash` added.
    #[must_use]
    pub fn with_hash(&self, hash: u64) -> Self {
        let point = HashRange::new(hash, u128::from(hash) + 1).expect("one hash is a range");
        Self::new(self.ranges.iter().copied().chain([point]))
    }

    /// The fraction of the hash space the set holds, from 0 to 1.
    #[must_use]
    pub fn share(&self) -> f64 {
        // Precision loss is fine: a share is for reading and balancing, not for ownership.
        #[allow(clippy::cast_precision_loss)]
        let share = self.width() as f64 / SPACE_END as f64;
        share
    }
}

/// A shard's selector: which field to hash and the non-empty set of ranges to keep.
///
/// `Display` writes it in the server's normalized form (the one its `metadata.shardInfo.selector`
/// echoes), `FromStr` reads that form and the variations the server accepts (see the module
/// docs). There is no selector for an empty set: an absent or empty `shardSelector` means every
/// object, so a shard without ranges must not list at all.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ShardSelector {
    field: ShardField,
    ranges: RangeSet,
}

impl ShardSelector {
    /// The selector of `ranges` on `field`, or `None` when `ranges` is empty.
    #[must_use]
    pub fn new(field: ShardField, ranges: RangeSet) -> Option<Self> {
        (!ranges.is_empty()).then_some(Self { field, ranges })
    }

    /// The hashed field.
    #[must_use]
    pub fn field(&self) -> ShardField {
        self.field
    }

    /// The ranges kept.
    #[must_use]
    pub fn ranges(&self) -> &RangeSet {
        &self.ranges
    }

    /// Whether an object whose field (its uid, or its namespace) is `value` is selected: the
    /// client-side filter, for a server that ignored the selector.
    #[must_use]
    pub fn matches_value(&self, value: &str) -> bool {
        self.ranges.contains(fnv1a64(value))
    }

    /// Whether the object with metadata `meta` is selected, by its uid or its namespace (the
    /// empty string for a cluster-scoped object, as on the server). An object without a uid
    /// (not yet created) is never selected by a uid selector.
    #[must_use]
    pub fn matches(
        &self,
        meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    ) -> bool {
        match self.field {
            ShardField::Uid => meta
                .uid
                .as_deref()
                .is_some_and(|uid| self.matches_value(uid)),
            ShardField::Namespace => self.matches_value(meta.namespace.as_deref().unwrap_or("")),
        }
    }
}

impl fmt::Display for ShardSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = self.field.path();
        for (i, range) in self.ranges.ranges.iter().enumerate() {
            if i > 0 {
                f.write_str(" || ")?;
            }
            // 2^64 needs 17 digits, every other bound exactly 16.
            write!(
                f,
                "shardRange({path}, '0x{:016x}', '0x{:016x}')",
                range.start, range.end
            )?;
        }
        Ok(())
    }
}

/// Why a string is not a shard selector.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The string holds no range (an empty selector selects everything).
    #[error("the selector is empty")]
    Empty,
    /// A term is not `shardRange(FIELD, 'START', 'END')`.
    #[error("not a shardRange(FIELD, 'START', 'END') term: {0:?}")]
    Term(String),
    /// The field is not one the server hashes.
    #[error("unsupported field {0:?}; supported: object.metadata.uid, object.metadata.namespace")]
    Field(String),
    /// Terms name different fields.
    #[error("all ranges must use the same field, got {0:?} and {1:?}")]
    MixedFields(String, String),
    /// A bound is not `0x` and 16 lowercase hex digits (or 2^64 as an end).
    #[error("not a bound of 0x and 16 lowercase hex digits: {0:?}")]
    Bound(String),
    /// A range's start is not below its end.
    #[error("range start {0} is not below its end {1}")]
    Order(String, String),
}

impl FromStr for ShardSelector {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().is_empty() {
            return Err(ParseError::Empty);
        }
        let mut field: Option<ShardField> = None;
        let mut ranges = Vec::new();
        for term in s.split("||") {
            let (path, start, end) = parse_term(term)?;
            let this =
                ShardField::from_path(path).ok_or_else(|| ParseError::Field(path.to_string()))?;
            if let Some(first) = field.filter(|f| *f != this) {
                return Err(ParseError::MixedFields(
                    first.path().to_string(),
                    path.to_string(),
                ));
            }
            field = Some(this);
            let start_value = parse_bound(start, false)?;
            let end_value = parse_bound(end, true)?;
            let start_value =
                u64::try_from(start_value).map_err(|_| ParseError::Bound(start.to_string()))?;
            ranges.push(
                HashRange::new(start_value, end_value)
                    .ok_or_else(|| ParseError::Order(start.to_string(), end.to_string()))?,
            );
        }
        let field = field.ok_or(ParseError::Empty)?;
        Self::new(field, RangeSet::new(ranges)).ok_or(ParseError::Empty)
    }
}

/// The field path and the two quoted bounds (quotes removed) of one `shardRange(...)` term.
fn parse_term(term: &str) -> Result<(&str, &str, &str), ParseError> {
    let bad = || ParseError::Term(term.trim().to_string());
    let inner = term
        .trim()
        .strip_prefix("shardRange")
        .map(str::trim_start)
        .and_then(|rest| rest.strip_prefix('('))
        .and_then(|rest| rest.strip_suffix(')'))
        .ok_or_else(bad)?;
    let mut args = inner.split(',').map(str::trim);
    let (Some(path), Some(start), Some(end), None) =
        (args.next(), args.next(), args.next(), args.next())
    else {
        return Err(bad());
    };
    match (unquote(start), unquote(end)) {
        (Some(start), Some(end)) => Ok((path, start, end)),
        _ => Err(bad()),
    }
}

/// `arg` without its enclosing single or double quotes, if it has them.
fn unquote(arg: &str) -> Option<&str> {
    ['\'', '"'].into_iter().find_map(|quote| {
        arg.strip_prefix(quote)
            .and_then(|rest| rest.strip_suffix(quote))
    })
}

/// The value of a bound: `0x` and 16 lowercase hex digits, or 2^64 when `is_end`.
fn parse_bound(bound: &str, is_end: bool) -> Result<u128, ParseError> {
    let bad = || ParseError::Bound(bound.to_string());
    if is_end && bound == format!("0x{SPACE_END:x}") {
        return Ok(SPACE_END);
    }
    let digits = bound.strip_prefix("0x").ok_or_else(bad)?;
    if digits.len() != 16
        || !digits
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(bad());
    }
    u64::from_str_radix(digits, 16)
        .map(u128::from)
        .map_err(|_| bad())
}

/// Tokens each shard of weight 1 places on a [`RangeRing`] (a shard of weight `w` places
/// `w ×` as many).
///
/// Each token starts a range of its shard (fewer where neighbouring tokens of one shard merge),
/// and a shard's selector is in the URL of every list and watch it sends: about 80 bytes a range,
/// about 107 once URL-encoded. Measured over rings of shards named `controller-0`,
/// `controller-1`, ... (the test `token_count_keeps_selectors_short_and_shares_near_even` prints
/// the table; "share" is the largest shard's share over the mean):
///
/// | tokens | share at 3 / 10 / 100 shards | longest selector at 100 shards |
/// |---|---|---|
/// | 16 | 1.24 / 1.46 / 2.06 | 1.3 KB (17 ranges) |
/// | 32 | 1.11 / 1.27 / 1.68 | 2.6 KB (33 ranges) |
/// | 64 | 1.08 / 1.17 / 1.37 | 5.1 KB (64 ranges) |
/// | 100 (the label ring's) | 1.08 / 1.09 / 1.34 | 7.9 KB (100 ranges) |
///
/// 32 keeps a weight-1 shard's request line near 3.5 KB at any ring size, well inside the 8 KB
/// that proxies commonly accept (kube-apiserver itself takes 1 MB of headers), with a weight-2
/// shard still inside it; 16 would halve that but let a shard of a large ring carry twice the
/// mean, and 64 leaves no room for weights. Part of the placement: the sharder and everything
/// that predicts placement must use the same value.
pub const RANGE_TOKENS_PER_SHARD: usize = 32;

/// A consistent-hash ring over the 64-bit FNV-1a space that gives each shard a [`RangeSet`].
///
/// As the label ring (docs/protocol.md §5), every shard places tokens at `XXH64(name + i)` (`i`
/// below `weight × RANGE_TOKENS_PER_SHARD`), and a hash belongs to the shard owning the first
/// token at or after it, wrapping past the largest token; on equal tokens the smaller name
/// wins. A shard's ranges are the arcs up to and including its tokens. Adding or removing a
/// shard therefore only moves hashes to or from that shard, and a weight change only to or from
/// the reweighted one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeRing {
    /// Distinct shard names, sorted.
    names: Vec<String>,
    /// Token positions, sorted and distinct.
    tokens: Vec<u64>,
    /// `owners[i]` indexes `names`: the shard owning `tokens[i]`.
    owners: Vec<usize>,
}

impl RangeRing {
    /// The ring of `shards`, each of weight 1; duplicates count once.
    pub fn new<S: AsRef<str>>(shards: impl IntoIterator<Item = S>) -> Self {
        Self::weighted(shards.into_iter().map(|s| (s, 1)))
    }

    /// The ring of `(shard, weight)` pairs; a name given twice counts once with its larger
    /// weight, and a weight below 1 counts as 1.
    pub fn weighted<S: AsRef<str>>(shards: impl IntoIterator<Item = (S, u32)>) -> Self {
        Self::with_tokens(shards, RANGE_TOKENS_PER_SHARD)
    }

    /// [`RangeRing::weighted`] with `tokens` per unit of weight (the tests compare counts).
    fn with_tokens<S: AsRef<str>>(
        shards: impl IntoIterator<Item = (S, u32)>,
        tokens: usize,
    ) -> Self {
        let mut members: Vec<(String, u32)> = shards
            .into_iter()
            .map(|(s, w)| (s.as_ref().to_owned(), w.max(1)))
            .collect();
        members.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        members.dedup_by(|a, b| a.0 == b.0);
        let mut pairs: Vec<(u64, usize)> = Vec::new();
        let mut buf = String::new();
        for (index, (name, weight)) in members.iter().enumerate() {
            for i in 0..tokens * *weight as usize {
                buf.clear();
                // Writing to a `String` cannot fail.
                let _ = write!(buf, "{name}{i}");
                pairs.push((xxh64(buf.as_bytes(), 0), index));
            }
        }
        // Sorted by (token, index), and `names` is sorted: the first of equal tokens belongs to
        // the smaller name, and `dedup_by_key` keeps it.
        pairs.sort_unstable();
        pairs.dedup_by_key(|&mut (token, _)| token);
        let (tokens, owners) = pairs.into_iter().unzip();
        Self {
            names: members.into_iter().map(|(name, _)| name).collect(),
            tokens,
            owners,
        }
    }

    /// The shards, sorted by name.
    pub fn shards(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    /// The shard that owns `hash`, or `None` for an empty ring.
    #[must_use]
    pub fn owner(&self, hash: u64) -> Option<&str> {
        let pos = self.tokens.partition_point(|&token| token < hash);
        let pos = if pos == self.tokens.len() { 0 } else { pos };
        self.owners
            .get(pos)
            .map(|&owner| self.names[owner].as_str())
    }

    /// Every shard's ranges (a shard whose tokens were all taken by smaller names on equal
    /// positions has an empty set).
    #[must_use]
    pub fn ranges(&self) -> BTreeMap<String, RangeSet> {
        let mut arcs: Vec<Vec<(u64, u64)>> = vec![Vec::new(); self.names.len()];
        let count = self.tokens.len();
        for (i, (&token, &owner)) in self.tokens.iter().zip(&self.owners).enumerate() {
            // The arc after the previous token up to and including this one; the first token's
            // arc comes from past the last one, around the top. With one token it is everything.
            let previous = self.tokens[(i + count - 1) % count];
            arcs[owner].push((previous.wrapping_add(1), token.wrapping_add(1)));
        }
        self.names
            .iter()
            .zip(arcs)
            .map(|(name, arcs)| (name.clone(), RangeSet::from_arcs(arcs)))
            .collect()
    }

    /// Every shard's ranges with namespace pins applied, for a ring hashing namespaces: each pair
    /// `(namespace, shard)` whose shard is in the ring takes the namespace's one hash
    /// (`[h, h + 1)`, `h = fnv1a64(namespace)`) from its owner and gives it to the pinned shard.
    /// A pin naming a shard outside the ring is ignored (the ring decides, as for label rings).
    /// Should two pinned namespaces share a hash, the pin of the smaller namespace name decides.
    /// The result is still a partition of the space.
    #[must_use]
    pub fn ranges_with_pins<'a>(
        &self,
        pins: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> BTreeMap<String, RangeSet> {
        let mut ranges = self.ranges();
        let mut pins: Vec<(&str, &str)> = pins.into_iter().collect();
        pins.sort_unstable();
        let mut taken = std::collections::BTreeSet::new();
        for (namespace, shard) in pins {
            let hash = fnv1a64(namespace);
            if !ranges.contains_key(shard) || !taken.insert(hash) {
                continue;
            }
            for (name, set) in &mut ranges {
                *set = if name == shard {
                    set.with_hash(hash)
                } else {
                    set.without_hash(hash)
                };
            }
        }
        ranges
    }

    /// The ranges of `shard` (empty when it is not in the ring).
    #[must_use]
    pub fn ranges_of(&self, shard: &str) -> RangeSet {
        self.ranges().remove(shard).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests;
