//! The sharder controller (docs/protocol.md §9): on the leader, keeps every object of every ring on
//! the shard the ring assigns it to.
//!
//! | module | what |
//! |---|---|
//! | `run` | the controller's loop: starts, supersedes and retries each ring's sync on the pure `SyncSchedule` (in `core`) |
//! | `sync` | one sync of one ring: lists its objects metadata-only in pages, decides and patches each page's objects |
//! | `pager` | the sync's paged lists, with continue tokens that expire |
//! | `patch` | one drain or move patch, guarded by the object's `resourceVersion`, and whether the webhook assigned the moved object |
//! | `patch_limit` | the bound on patches in flight across every ring |
//! | `owner_moves` | controlled objects a sync held back, moved the moment their controller's drain is acknowledged |
//! | `missed_assignments` | the fast path for objects the webhook missed: assigned within seconds |
//! | `announce` | Events about membership changes and stuck drains |

mod announce;
mod missed_assignments;
mod owner_moves;
mod pager;
mod patch;
mod patch_limit;
mod run;
mod sync;

pub(crate) use self::run::run;
