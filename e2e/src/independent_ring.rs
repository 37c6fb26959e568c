//! A consistent-hash ring computed from the protocol's description only (docs/protocol.md §5, §17):
//! XXH64 tokens `XXH64(name + i)`, 100 per unit of weight, and a key on the first token at or after
//! its hash. It shares no code with the sharder's ring, so tests that compare the two check both.

use xxhash_rust::xxh64::xxh64;

/// The ring of some shards with weights.
#[derive(Clone, Debug)]
pub struct IndependentRing {
    tokens: Vec<(u64, String)>,
}

impl IndependentRing {
    /// The ring of `shards`, each with its weight.
    pub fn new<'a>(shards: impl IntoIterator<Item = (&'a str, u32)>) -> Self {
        let mut tokens = Vec::new();
        for (name, weight) in shards {
            for i in 0..100 * weight {
                tokens.push((xxh64(format!("{name}{i}").as_bytes(), 0), name.to_string()));
            }
        }
        tokens.sort();
        Self { tokens }
    }

    /// The ring of `shards`, each with weight 1.
    pub fn unweighted<'a>(shards: impl IntoIterator<Item = &'a str>) -> Self {
        Self::new(shards.into_iter().map(|s| (s, 1)))
    }

    /// The shard `key` belongs to.
    ///
    /// # Panics
    ///
    /// On a ring without shards, where no key belongs anywhere.
    pub fn shard_for(&self, key: &str) -> &str {
        let hash = xxh64(key.as_bytes(), 0);
        let token = self
            .tokens
            .iter()
            .find(|(t, _)| *t >= hash)
            .or(self.tokens.first())
            .expect("a ring with shards");
        &token.1
    }
}
