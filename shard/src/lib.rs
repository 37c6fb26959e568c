//! Run a kube-rs controller as one *shard* of a controller-sharding ring.
//!
//! A ring (a `ClusterRing` or a `ControllerRing`, [`RingKind`]) lets N replicas of a controller
//! split the objects of some resources between them. A central sharder (the `kube-sharder`
//! crate, deployed once per cluster) assigns every object to one shard by writing a
//! ring-specific shard label, and moves objects when shards come and go. This crate is the
//! shard's side of that contract. With it, each replica
//!
//! - announces itself with a membership Lease and works only while it holds it;
//! - watches only the objects labelled with its name;
//! - hands objects over when the sharder drains them, and never reconciles one that is leaving;
//! - learns which objects left it (moved to another shard) as opposed to deleted ones.
//!
//! # The 10-line version
//!
//! ```no_run
//! # use std::{sync::Arc, time::Duration};
//! # use futures::StreamExt;
//! # use k8s_openapi::api::core::v1::Secret;
//! # use kube::{Api, Client, runtime::controller::{Action, Controller}};
//! # use kube_sharding::{LeaseLock, Ownership, OwnershipError, Shard, Term};
//! # use tokio_util::sync::CancellationToken;
//! async fn reconcile(_: Arc<Secret>, _: Arc<()>, ownership: Ownership) -> Result<Action, OwnershipError> {
//!     ownership.confirm().await?; // right before the first write: still ours, Lease still held
//!     Ok(Action::await_change())
//! }
//! # async fn run() -> anyhow::Result<()> {
//! let client = Client::try_default().await?;
//! let shard = Shard::new("my-ring", "my-controller-0", "default"); // ring, pod name, Lease namespace
//! let lock = LeaseLock::new(client.clone(), shard.lease_config())?;
//! let shutdown = CancellationToken::new(); // cancel it on SIGTERM
//! let end = shard.run(&lock, &shutdown, |term: Term| {
//!     Controller::new(Api::<Secret>::all(client.clone()), shard.watcher_config())
//!         .graceful_shutdown_on(term.stop.cancelled_owned())
//!         .run(shard.reconciler(client.clone(), term.guard, reconcile),
//!              |_, _, _| Action::requeue(Duration::from_secs(5)), Arc::new(()))
//!         .for_each(|_| async {})
//! }).await?;
//! # let _ = end; Ok(()) }
//! ```
//!
//! `end` says whether the shard stopped on `shutdown` (the Lease was released, so the sharder
//! hands the objects to the other shards at once; or, for a StatefulSet pod that comes back,
//! kept for it, see [`Shard::with_on_shutdown`]) or lost its Lease (exit: another shard may own
//! the objects already). Complete programs are in the crate's `examples/`: `minimal.rs` (the
//! above with signal handling and a ring from the environment) and `departures.rs` (controlled
//! objects, event filters and per-object local state that must follow objects as they move).
//!
//! # The contract with the sharder
//!
//! The sharder and the shards never talk to each other; they read and write the objects and the
//! shards' Leases, and this crate does the shard's part:
//!
//! - **Membership is a Lease.** A `coordination.k8s.io/v1` Lease whose name and holder are the
//!   shard name, labelled with the ring ([`Shard::lease_config`]). The sharder counts the shard
//!   while the Lease is renewed, and moves its objects away when it is released or expires.
//!   [`Shard::run`] acquires it before any work, renews it, drops the work at once when it is
//!   lost, and on shutdown stops the work first and then releases the Lease, or, for a pod its
//!   StatefulSet recreates under the same name, leaves it held for the returning pod
//!   ([`OnShutdown::KeepIfReturning`]): a rollout then moves no object.
//! - **The sharder judges a returning shard.** After creating or taking over its Lease a shard
//!   waits until the sharder has labelled the Lease `ready` (it holds that back while objects it
//!   was moving off the shard are still on their way). While the sharder marks the Lease as
//!   excluded from the ring (two processes claiming one name, say), [`Shard::run`] steps out,
//!   releases and tries again later.
//! - **A shard sees only its objects.** Every watch on a main or controlled resource of the ring
//!   must select the shard's label: [`Shard::watcher_config`] (or [`Shard::label_selector`]).
//! - **Drains are acknowledged, not reconciled.** Before moving an object the sharder adds a
//!   drain label; the shard stops reconciling it and removes both labels, which hands the object
//!   over. [`Shard::reconciler`] does that around your reconciler, and event filters must let
//!   drained objects through ([`Shard::predicate`]).
//! - **Writes are confirmed.** A reconcile may have read an object just before a drain or the
//!   loss of the Lease; [`Ownership::confirm`] checks both with one read, right before the first
//!   write.
//!
//! The full rules, for shards in any language, are in `docs/protocol.md` of the
//! controller-sharding repository: sections "2. Labels and names (the wire protocol)",
//! "3. The shard contract (what a shard must do)", "4. Shard states", "18. Shard names and
//! misbehaving shards" and "22. A returning shard and the moves off it". The label keys and the
//! Lease rules this crate and the sharder share are in [`kube_sharding_api::labels`] and
//! [`kube_sharding_api::lease`].
//!
//! # What is where
//!
//! - [`Shard`]: the shard's identity, its label keys, the label-selected
//!   [watcher configuration](Shard::watcher_config) and its [Lease configuration](Shard::lease_config);
//!   [`Shard::run`]: membership, term after term: acquire, run while held, and step out
//!   (release, pause, rejoin) when the sharder excludes the shard's Lease from its ring;
//! - [`LeaseLock`]: a Lease lock (acquire, renew, notice loss, release) used for the shard's
//!   membership Lease, and reusable for leader election; [`HeldLease::run_while_held`]: work
//!   guarded by a Lease; [`LeaseGuard`]: what work checks right before it acts (the lost token
//!   and the monotonic renew deadline, shared with the renewer);
//! - [`Shard::reconciler`]: the wrapper around your reconciler that acknowledges drains, never
//!   lets your code see an object that is being moved away, starts nothing once the Lease's
//!   [guard](HeldLease::guard) ended and cancels reconciles in flight when it ends; it hands
//!   your reconciler an [`Ownership`] to confirm before the first write;
//! - [`Shard::departures`]: a stream of objects that left the shard ([`Departure::Released`]),
//!   told apart from deleted ones ([`Departure::Deleted`]), for local state.
//!
//! Every item a shard uses is at the crate root. Two modules stand apart:
//!
//! | module | what |
//! |---|---|
//! | [`records`] | the log records the crate writes for machines: their `event` values and fields |
//! | [`sharded_watch`] | zero-write rings: a `shardSelector` on one resource's lists and watches, whether the server applied it, the client-side filter, and the restarts on new ranges; a tower layer usable in a client stack of your own |
//!
//! # Zero-write rings
//!
//! A ring with `spec.assignment: ServerSide` writes nothing to its objects: the sharder
//! publishes hash ranges on each shard's Lease, and the API server's sharded list and watch
//! (`shardSelector`) sends each shard only its ranges. [`Shard::server_side`] makes such a
//! shard; the controller's client comes from [`Shard::client`], everything else is as above:
//!
//! ```no_run
//! # use std::{sync::Arc, time::Duration};
//! # use futures::StreamExt;
//! # use k8s_openapi::api::core::v1::Secret;
//! # use kube::{Api, Client, runtime::controller::{Action, Controller}};
//! # use kube_sharding::{LeaseLock, Ownership, OwnershipError, RestartBackoff, Shard, ShardField, Term};
//! # use tokio_util::sync::CancellationToken;
//! # async fn reconcile(_: Arc<Secret>, _: Arc<()>, _: Ownership) -> Result<Action, OwnershipError> {
//! #     Ok(Action::await_change())
//! # }
//! # async fn run() -> anyhow::Result<()> {
//! let client = Client::try_default().await?;
//! let shard = Shard::new("my-ring", "my-controller-0", "default")
//!     .server_side::<Secret>(ShardField::Uid); // the ring's hashKey: Object
//! let lock = LeaseLock::new(client.clone(), shard.lease_config())?;
//! let shutdown = CancellationToken::new();
//! shard.run(&lock, &shutdown, |term: Term| {
//!     // Lists and watches of Secrets through this client carry the shard's ranges.
//!     Controller::new(Api::<Secret>::all(shard.client(client.clone())), shard.watcher_config())
//!         // New ranges restart the watch through an error: list again at once.
//!         .trigger_backoff(RestartBackoff::default())
//!         .graceful_shutdown_on(term.stop.cancelled_owned())
//!         .run(shard.reconciler(client.clone(), term.guard, reconcile),
//!              |_, _, _| Action::requeue(Duration::from_secs(5)), Arc::new(()))
//!         .for_each(|_| async {})
//! }).await?;
//! # Ok(()) }
//! ```
//!
//! Each term starts with no ranges; on every newer generation the library restarts the watches
//! with the new selector, reports the objects of revoked ranges as [`Departure::Released`]
//! ([`Release::RangeRevoked`]), cancels their reconciles in flight and waits for them, and then
//! acknowledges the generation on the Lease. Where the API server ignores the selector, the
//! client filters with the same hash and says so once in its log. See
//! `docs/zero-write-rings.md`.
//!
//! The crate logs through `tracing` and never installs a subscriber; the records meant for
//! machines carry an `event` field whose values are in [`records`]. The example shard of the
//! repository, `checksum-controller`, is a package of its own, so this crate carries only
//! library dependencies.

#![deny(missing_docs)]

mod departure;
mod departures;
mod drain;
mod lease;
mod load;
mod membership;
mod ownership;
pub mod records;
mod server_side;
mod shard;
pub mod sharded_watch;
mod shutdown;

pub use crate::departure::{Departure, ObjectKey, Release};
pub use crate::departures::Departures;
pub use crate::drain::{DrainPassthrough, ReconcileError};
pub use crate::lease::{
    Error as LeaseError, GuardEnd, HeldLease, HeldRunEnd, LeaseGuard, LeaseLock, LeaseLockConfig,
};
pub use crate::load::{DEFAULT_LOAD_WINDOW, LoadMeter};
pub use crate::membership::{ShardRunEnd, Term};
pub use crate::ownership::{Ownership, OwnershipError};
pub use crate::server_side::RestartBackoff;
pub use crate::shard::{DEFAULT_JUDGEMENT_FALLBACK, DEFAULT_REJOIN_PAUSE, Disposition, Shard};
pub use crate::shutdown::{OnShutdown, STATEFULSET_READ_TIMEOUT, StatefulSetPod};
/// The kind of ring a [`Shard`] joins.
pub use kube_sharding_api::RingKind;
/// The timing of a Lease lock ([`LeaseLockConfig::with_timing`]).
pub use kube_sharding_api::lease::LeaseTiming;
/// The field a zero-write ring's selectors hash ([`Shard::server_side`]).
pub use kube_sharding_api::ranges::ShardField;
