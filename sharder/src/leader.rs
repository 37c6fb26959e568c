//! What the leader learns and keeps while its controllers run; every replica's metrics read
//! parts of it.
//!
//! | module | what |
//! |---|---|
//! | `observed` | what the leader learned about each ring's objects in its latest sync |
//! | `reachability` | whether the API server reaches each ring's webhook; moves stop while it does not |
//! | `direct_moves` | the direct moves in flight off each shard, which hold back a returning shard's `ready` label |
//! | `events` | rate-limited Events and every Event reason |

pub(crate) mod direct_moves;
pub(crate) mod events;
pub(crate) mod observed;
pub(crate) mod reachability;
