//! A consistent-hash ring computed from the protocol's description only (docs/protocol.md §5, §17):
//! XXH64 tokens `XXH64(name + i)`, 100 per unit of weight, and a key on the first token at or after
//! its hash. It shares no code with the sharder's ring, so tests that compare the two check both;
//! it is the one placement prediction of the harness, the tests and the tools under `e2e/loadtest`.

use xxhash_rust::xxh64::xxh64;

/// Tokens a shard puts on the ring per unit of weight.
const TOKENS_PER_WEIGHT: u32 = 100;

/// The ring of some shards with weights.
#[derive(Clone, Debug)]
pub struct IndependentRing {
    /// `(token, shard)` sorted by token.
    tokens: Vec<(u64, String)>,
}

impl IndependentRing {
    /// The ring of `shards`, each with its weight.
    pub fn new<S: AsRef<str>>(shards: impl IntoIterator<Item = (S, u32)>) -> Self {
        let mut tokens = Vec::new();
        for (name, weight) in shards {
            let name = name.as_ref();
            for i in 0..TOKENS_PER_WEIGHT * weight {
                tokens.push((xxh64(format!("{name}{i}").as_bytes(), 0), name.to_string()));
            }
        }
        // Ties between tokens of different shards are astronomically unlikely; sorting by name
        // as well only makes the result independent of the input order.
        tokens.sort();
        Self { tokens }
    }

    /// The ring of `shards`, each with weight 1.
    pub fn unweighted<S: AsRef<str>>(shards: impl IntoIterator<Item = S>) -> Self {
        Self::new(shards.into_iter().map(|s| (s, 1)))
    }

    /// The shard `key` belongs to: the first token at or after the key's hash, wrapping; `None`
    /// on a ring without shards.
    pub fn try_shard_for(&self, key: &str) -> Option<&str> {
        let hash = xxh64(key.as_bytes(), 0);
        let index = self.tokens.partition_point(|(token, _)| *token < hash);
        self.tokens
            .get(index)
            .or_else(|| self.tokens.first())
            .map(|(_, shard)| shard.as_str())
    }

    /// The shard `key` belongs to.
    ///
    /// # Panics
    ///
    /// On a ring without shards, where no key belongs anywhere.
    pub fn shard_for(&self, key: &str) -> &str {
        self.try_shard_for(key).expect("a ring with shards")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/protocol.md §5's vectors: the hash itself, and the ring of three shards.
    #[test]
    fn matches_the_protocol_vectors() {
        assert_eq!(format!("{:016x}", xxh64(b"", 0)), "ef46db3751d8e999");
        assert_eq!(
            format!("{:016x}", xxh64(b"shard-a0", 0)),
            "83b529463cc2a1f3"
        );
        assert_eq!(
            format!("{:016x}", xxh64(b"apps/Deployment/bar/foo", 0)),
            "82cb424099458184"
        );
        let ring = IndependentRing::unweighted(["shard-a", "shard-b", "shard-c"]);
        assert_eq!(
            ring.try_shard_for("apps/Deployment/bar/foo"),
            Some("shard-b")
        );
        assert_eq!(
            ring.try_shard_for("/ConfigMap/default/foo"),
            Some("shard-b")
        );
        assert_eq!(ring.try_shard_for("/Secret/default/foo"), Some("shard-a"));
        assert_eq!(
            ring.try_shard_for("webhosting.timebertt.dev/Website/project-foo/homepage"),
            Some("shard-a")
        );
        let mut counts = std::collections::BTreeMap::new();
        for i in 0..1000 {
            let shard = ring.try_shard_for(&format!("/ConfigMap/default/foo-{i}"));
            *counts.entry(shard.map(str::to_string)).or_insert(0) += 1;
        }
        let expected = [("shard-a", 380), ("shard-b", 307), ("shard-c", 313)]
            .map(|(shard, n)| (Some(shard.to_string()), n));
        assert_eq!(counts, std::collections::BTreeMap::from(expected));
    }

    #[test]
    fn empty_ring_assigns_nothing() {
        assert_eq!(
            IndependentRing::unweighted::<&str>([]).try_shard_for("/Secret/a/b"),
            None
        );
    }

    /// The sharder's ring and this one, written apart, agree on weighted and unweighted rings:
    /// the tests predict placement with this one, so a disagreement is a bug in one of them.
    #[test]
    fn agrees_with_the_sharders_ring() {
        use kube_sharder::core::hash_ring::HashRing;
        let weighted = [("light", 1), ("heavy", 3), ("odd", 1)];
        let rings = [
            (
                IndependentRing::unweighted(["shard-a", "shard-b", "shard-c"]),
                HashRing::new(["shard-a", "shard-b", "shard-c"]),
            ),
            (IndependentRing::new(weighted), HashRing::weighted(weighted)),
        ];
        for (independent, sharders) in &rings {
            for i in 0..2000 {
                let key = format!("/Secret/ns-{}/s-{i}", i % 7);
                assert_eq!(
                    independent.try_shard_for(&key),
                    sharders.shard_for(&key),
                    "{key}"
                );
            }
        }
    }
}
