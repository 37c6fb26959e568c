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
//!   loss, stopped and then the Lease released on shutdown;
//! - [`Shard`]: the shard's identity, its label keys, the label-selected
//!   [watcher configuration](Shard::watcher_config) and its [Lease configuration](Shard::lease_config);
//! - [`Shard::reconciler`]: a wrapper around your reconciler that acknowledges drains, never
//!   lets your code see an object that is being moved away, and starts nothing once the Lease's
//!   [lost token](HeldLease::lost_token) fired; [`Shard::predicate`] for event filters.
//!
//! The crate logs through `tracing` and never installs a subscriber. The example shard,
//! `checksum-controller`, is a package of its own (`shard/checksum-controller/`), so the library
//! carries only library dependencies.
//!
//! | module | what |
//! |---|---|
//! | [`lease`] | the Lease lock, [`HeldLease::run_while_held`], and the pure acquire decision it uses |
//! | [`drain`] | the reconciler wrapper that acknowledges drains |
//! | `shard` | [`Shard`]: identity, label keys, watcher and Lease configuration |
//!
//! When a Lease expires, valid timing and valid shard names are the protocol's rules in
//! [`sharding_crds::lease`], shared with the sharder.
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
//! use shard::{HeldRunEnd, LeaseLock, Shard};
//! use tokio_util::sync::CancellationToken;
//!
//! #[derive(Debug, thiserror::Error)]
//! #[error("failed to reconcile")]
//! struct Error;
//!
//! /// Your reconciler, unchanged: it only ever sees objects assigned to this shard that are not
//! /// being drained.
//! async fn reconcile(secret: Arc<Secret>, _context: Arc<()>) -> Result<Action, Error> {
//!     Ok(Action::await_change())
//! }
//!
//! #[tokio::main]
//! async fn main() -> anyhow::Result<()> {
//!     let client = Client::try_default().await?;
//!     // The shard name must be unique in the ring and stable: use the pod name.
//!     let shard = Shard::new("my-ring", "my-controller-0", "default");
//!
//!     // 1. Announce membership before doing any work.
//!     let lock = LeaseLock::new(client.clone(), shard.lease_config())?;
//!     let held = lock.acquire().await;
//!
//!     // 2. Run the controller, watching only this shard's objects (main and controlled), while
//!     //    the Lease is held: it is dropped at once when the Lease is lost (another shard may
//!     //    own our objects now); on shutdown it stops, then the Lease is released so the sharder
//!     //    hands our objects over at once.
//!     let shutdown = CancellationToken::new();
//!     let on_signal = shutdown.clone();
//!     tokio::spawn(async move {
//!         let _ = tokio::signal::ctrl_c().await;
//!         on_signal.cancel();
//!     });
//!     // The wrapper checks the lost token right before every reconcile and drain
//!     // acknowledgement, so nothing starts once the Lease is lost, even on another thread.
//!     let lost = held.lost_token();
//!     let controller = |stop: CancellationToken| {
//!         Controller::new(Api::<Secret>::all(client.clone()), shard.watcher_config())
//!             .owns(Api::<ConfigMap>::all(client.clone()), shard.watcher_config())
//!             .graceful_shutdown_on(stop.cancelled_owned())
//!             .run(
//!                 shard.reconciler(client.clone(), lost, reconcile),
//!                 |_, _, _| Action::requeue(Duration::from_secs(5)),
//!                 Arc::new(()),
//!             )
//!             .for_each(|_| async {})
//!     };
//!     match held.run_while_held(&shutdown, controller).await? {
//!         HeldRunEnd::LeaseLost => anyhow::bail!("lost the shard Lease"),
//!         HeldRunEnd::WorkEnded { .. } => Ok(()),
//!     }
//! }
//! ```
//!
//! # The protocol, for shards written in other languages
//!
//! Nothing here is specific to Rust; a shard in any language joins a ring by following these
//! rules (label keys derive from the ring name, see [`sharding_crds::labels`]):
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

pub mod drain;
pub mod lease;
mod shard;

pub use crate::drain::{Disposition, DrainPassthrough, ReconcileError};
pub use crate::lease::{HeldLease, HeldRunEnd, LeaseLock, LeaseLockConfig};
pub use crate::shard::Shard;
/// The kind of ring a [`Shard`] joins.
pub use sharding_crds::RingKind;
