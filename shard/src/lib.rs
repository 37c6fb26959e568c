//! Turn a kube-rs controller into a *shard* of a controller-sharding ring.
//!
//! A ring (a `ClusterRing` or a `ControllerRing`, [`RingKind`]) lets N replicas of a controller split the objects of some resources
//! between them. A central sharder assigns every object to one shard by writing a ring-specific
//! shard label, and moves objects when shards come and go. This crate implements the shard's
//! side of that contract:
//!
//! - [`LeaseLock`]: a Lease lock (acquire, renew, notice loss, release) used for the shard's
//!   membership Lease, and reusable for leader election;
//! - [`HeldLease::run_while_held`]: the lifecycle of work guarded by a Lease: dropped at once on
//!   loss, stopped and then the Lease released on shutdown; [`LeaseGuard`]: what work checks
//!   right before it acts (the lost token and the monotonic renew deadline, shared with the
//!   renewer);
//! - [`Shard::run`]: a shard's membership, term after term: acquire, run while held, and step
//!   out (release, pause, rejoin) when the sharder excludes the shard's Lease from its ring;
//! - [`Shard`]: the shard's identity, its label keys, the label-selected
//!   [watcher configuration](Shard::watcher_config) and its [Lease configuration](Shard::lease_config);
//! - [`Shard::reconciler`]: a wrapper around your reconciler that acknowledges drains, never
//!   lets your code see an object that is being moved away, starts nothing once the Lease's
//!   [guard](HeldLease::guard) ended and cancels reconciles in flight when it ends; it hands
//!   your reconciler an [`Ownership`] to confirm before the first write; [`Shard::predicate`]
//!   for event filters;
//! - [`Shard::departures`]: a stream of objects that left the shard ([`Departure::Released`]),
//!   told apart from deleted ones ([`Departure::Deleted`]), for local state.
//!
//! The crate logs through `tracing` and never installs a subscriber. The example shard,
//! `checksum-controller`, is a package of its own (`shard/checksum-controller/`), so the library
//! carries only library dependencies.
//!
//! | module | what |
//! |---|---|
//! | [`lease`] | the Lease lock, [`LeaseGuard`], [`HeldLease::run_while_held`], and the pure acquire decision it uses |
//! | [`drain`] | the reconciler wrapper that acknowledges drains and cancels reconciles when the Lease ends |
//! | `ownership` | [`Ownership`]: the check before a reconcile's first write |
//! | [`departures`] | released versus deleted objects |
//! | `membership` | [`Shard::run`]: terms, exclusion and rejoining |
//! | `shard` | [`Shard`]: identity, label keys, watcher and Lease configuration |
//!
//! When a Lease expires, valid timing and valid shard names are the protocol's rules in
//! [`kube_sharding_api::lease`], shared with the sharder.
//!
//! # Example: a sharded controller
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use futures::StreamExt;
//! use k8s_openapi::api::core::v1::{ConfigMap, Secret};
//! use kube::runtime::controller::{Action, Controller};
//! use kube::{Api, Client};
//! use kube_sharding::{Departure, LeaseLock, Ownership, OwnershipError, Shard, ShardRunEnd, Term};
//! use tokio_util::sync::CancellationToken;
//!
//! #[derive(Debug, thiserror::Error)]
//! enum Error {
//!     #[error(transparent)]
//!     Ownership(#[from] OwnershipError),
//! }
//!
//! /// Your reconciler: it only ever sees objects assigned to this shard that are not being
//! /// drained, and confirms they still are right before its first write.
//! async fn reconcile(
//!     secret: Arc<Secret>,
//!     _context: Arc<()>,
//!     ownership: Ownership,
//! ) -> Result<Action, Error> {
//!     // ... read and compute (no writes) ...
//!     ownership.confirm().await?; // one GET: still ours, not draining, Lease held
//!     // ... write ...
//!     Ok(Action::await_change())
//! }
//!
//! #[tokio::main]
//! async fn main() -> anyhow::Result<()> {
//!     let client = Client::try_default().await?;
//!     // The shard name must be unique in the ring and stable: use the pod name.
//!     let shard = Shard::new("my-ring", "my-controller-0", "default");
//!     let lock = LeaseLock::new(client.clone(), shard.lease_config())?;
//!     let shutdown = CancellationToken::new();
//!     let on_signal = shutdown.clone();
//!     tokio::spawn(async move {
//!         let _ = tokio::signal::ctrl_c().await;
//!         on_signal.cancel();
//!     });
//!
//!     // Each membership term: the controller, watching only this shard's objects (main and
//!     // controlled), and the departures of its main objects, next to each other.
//!     let term = |term: Term| {
//!         let controller = Controller::new(Api::<Secret>::all(client.clone()), shard.watcher_config())
//!             .owns(Api::<ConfigMap>::all(client.clone()), shard.watcher_config())
//!             .graceful_shutdown_on(term.stop.cancelled_owned())
//!             .run(
//!                 // Acknowledges drains; starts nothing once the term's guard ended and
//!                 // cancels reconciles in flight when it ends.
//!                 shard.reconciler(client.clone(), term.guard, reconcile),
//!                 |_, _, _| Action::requeue(Duration::from_secs(5)),
//!                 Arc::new(()),
//!             )
//!             .for_each(|_| async {});
//!         let departures = shard
//!             .departures(Api::<Secret>::all(client.clone()))
//!             .stream()
//!             .for_each(|departure| async move {
//!                 match departure {
//!                     // Moved to another shard: drop local state, leave external resources.
//!                     Departure::Released { .. } => {}
//!                     // Gone from the API server: clean up.
//!                     Departure::Deleted { .. } => {}
//!                 }
//!             });
//!         async move {
//!             tokio::select! {
//!                 () = controller => {}
//!                 () = departures => {}
//!             }
//!         }
//!     };
//!     // Acquires the Lease before any work; drops the work at once when the Lease is lost;
//!     // on shutdown stops it, then releases the Lease so the sharder hands our objects over at
//!     // once; steps out and rejoins later when the sharder excludes this shard.
//!     match shard.run(&lock, &shutdown, term).await? {
//!         ShardRunEnd::LeaseLost => anyhow::bail!("lost the shard Lease"),
//!         ShardRunEnd::Stopped { .. } => Ok(()),
//!     }
//! }
//! ```
//!
//! # The protocol, for shards written in other languages
//!
//! Nothing here is specific to Rust; a shard in any language joins a ring by following these
//! rules (label keys derive from the ring name, see [`kube_sharding_api::labels`]):
//!
//! 1. **Membership.** Keep a `coordination.k8s.io/v1` Lease, in any namespace, whose name and
//!    `spec.holderIdentity` are both the shard name, labelled
//!    `alpha.sharding.timebertt.dev/clusterring: <ring>`. Set `leaseDurationSeconds` (15 by
//!    default), `acquireTime`, and renew `renewTime` often enough (every 2 s, giving up after 10 s
//!    without success, by default). Write only with compare-and-swap on `resourceVersion`. If
//!    the holder is someone else (the sharder writes `shardlease-controller` when it declares a
//!    silent shard dead, doubling the duration), wait until that Lease has expired
//!    (`renewTime + leaseDurationSeconds` in the past) before taking it back, counting up
//!    `leaseTransitions`.
//! 2. **Work only while holding the Lease.** Start controllers after acquiring it; when a renewal
//!    fails past the deadline or someone else holds it, stop reconciling immediately (exiting is
//!    simplest). On graceful shutdown stop the controllers first, then set `holderIdentity` to
//!    the empty string, which makes the sharder move the objects right away.
//! 3. **Watch only your objects.** Every watch on a main or controlled resource of the ring
//!    selects `shard.alpha.sharding.timebertt.dev/<ring suffix>=<shard name>`.
//! 4. **Acknowledge drains.** When one of your main objects carries
//!    `drain.alpha.sharding.timebertt.dev/<ring suffix>` (any value), do not reconcile it.
//!    Remove both labels with one JSON merge patch that also carries the object's
//!    `resourceVersion`, `{"metadata":{"resourceVersion":"<rv>","labels":{"<shard key>":null,
//!    "<drain key>":null}}}`, and retry from a fresh read if it conflicts. Event filters must
//!    always let objects with the drain label through.
//! 5. **Step out when excluded** (this project's extension). While the Lease carries the
//!    annotation `alpha.sharding.timebertt.dev/excluded` (value: the reason), the sharder keeps
//!    it out of the ring: stop reconciling at once, acknowledge no drain, release the Lease, and
//!    try again after a pause without taking a Lease that still carries the annotation.

pub mod departures;
pub mod drain;
pub mod lease;
mod membership;
mod ownership;
mod shard;

pub use crate::departures::{Departure, Departures, ObjectKey, Release};
pub use crate::drain::{Disposition, DrainPassthrough, ReconcileError};
pub use crate::lease::{GuardEnd, HeldLease, HeldRunEnd, LeaseGuard, LeaseLock, LeaseLockConfig};
pub use crate::membership::{EVENT_SHARD_EXCLUDED, EVENT_TERM_STARTED, ShardRunEnd, Term};
pub use crate::ownership::{Ownership, OwnershipError};
pub use crate::shard::{DEFAULT_JUDGEMENT_FALLBACK, DEFAULT_REJOIN_PAUSE, Shard};
/// The kind of ring a [`Shard`] joins.
pub use kube_sharding_api::RingKind;
