//! The controllers, which run on the elected leader only (docs/protocol.md §4, §9, §10), one module
//! each.
//!
//! | module | controller |
//! |---|---|
//! | `ring` | the ring controller (one per ring kind): validates each ring, applies its webhook configuration, writes its status |
//! | `ranges` | the ring controller's step for `assignment: ServerSide` rings: publishes hash ranges on the shards' Leases, revoke before grant |
//! | `shard_lease` | the shard-lease controller (one per ring kind): keeps shard states current, takes over and deletes Leases |
//! | `sharder` | the sharder controller: syncs every ring, draining and moving objects; assigns objects the webhook missed; announces membership changes and stuck drains |

mod ranges;
pub(crate) mod ring;
pub(crate) mod shard_lease;
pub(crate) mod sharder;

use kube::api::PatchParams;
use kube_sharding_api::{ClusterRing, ControllerRing};
use tokio_util::sync::CancellationToken;

use crate::context::Context;
use crate::core::webhook_config::FIELD_MANAGER;

/// Parameters of the controllers' merge patches: the sharder's field manager.
pub(crate) fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}

/// Runs every controller until `shutdown` fires (or until dropped, on lost leadership).
pub(crate) async fn run_all(ctx: Context, shutdown: CancellationToken) {
    tokio::join!(
        ring::run::<ClusterRing>(ctx.clone(), shutdown.clone()),
        ring::run::<ControllerRing>(ctx.clone(), shutdown.clone()),
        shard_lease::run::<ClusterRing>(ctx.clone(), shutdown.clone()),
        shard_lease::run::<ControllerRing>(ctx.clone(), shutdown.clone()),
        sharder::run(ctx, shutdown),
    );
}
