//! The ring-view registry: what the sharder knows about each ring, its resources resolved to
//! kinds and scopes, and the hash ring of its available shards.
//!
//! Views are rebuilt from the watch caches when a ring's spec or its set of available shards
//! changes (`maintain`, on every replica), never per request: the webhook and the sync read an
//! `Arc<RingView>` without locking anything for longer than a map lookup.
//!
//! | module | what |
//! |---|---|
//! | `view` | one ring's view: its resources, hash ring and the placement of one object |
//! | `registry` | the current view of every ring, shared by the webhook and the controllers |
//! | `maintain` | the task that rebuilds views when rings, Leases or discovery change |
//! | `discovery` | kinds and scopes of resources, from API discovery, cached |
//! | `pins` | the pins of namespaces and of controllers a placement reads |
//! | `controller_lookup` | the shard a new child's controller sits on while its ring changes |

mod controller_lookup;
mod discovery;
mod maintain;
mod pins;
mod registry;
mod view;

pub(crate) use self::controller_lookup::{ControllerLookup, controller_shard};
pub(crate) use self::discovery::Discovery;
pub(crate) use self::maintain::{Scope, ViewSources, maintain, refresh};
pub use self::pins::Pins;
pub use self::registry::Views;
pub(crate) use self::view::ResolvedResource;
pub use self::view::{ResourceInfo, RingView, build_view};
pub(crate) use crate::core::rebalance::Placement;
