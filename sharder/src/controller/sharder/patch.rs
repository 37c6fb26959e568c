//! One drain or move patch of the sharder controller, from the sync or the missed-assignment
//! path, and what a move's answer says about the ring's webhook.

use std::sync::Arc;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::ApiResource;
use serde_json::json;
use sharding_crds::{GroupResource, RingRef};

use super::patch_limit::PatchLimit;
use crate::context::Context;
use crate::core::rebalance::RebalanceDecision;
use crate::events::{REASON_WEBHOOK_REACHABLE, REASON_WEBHOOK_UNREACHABLE};
use crate::metrics::Metrics;
use crate::reachability::MoveGate;
use crate::views::{ResourceInfo, RingView};

/// Sends the sharder controller's patches, at most `controller.sharder.maxPatchesInFlight` at
/// once across every ring and both paths.
#[derive(Clone, Debug)]
pub(super) struct Patcher {
    /// What the sharder's tasks share.
    pub(super) ctx: Context,
    /// The bound on patches in flight.
    limit: Arc<PatchLimit>,
}

impl Patcher {
    /// A patcher with the configured bound.
    pub(super) fn new(ctx: Context) -> Self {
        let limit = Arc::new(PatchLimit::new(
            ctx.config.controller.sharder.max_patches_in_flight,
            ctx.metrics.patches_in_flight.clone(),
        ));
        Self { ctx, limit }
    }

    /// Sends the patch for `decision` about an object of resource `gr`, guarded by the object's
    /// resourceVersion. A move counts as done only when the object landed where the ring's view
    /// wants it now, which may be newer than `view`.
    pub(super) async fn patch(
        &self,
        view: &RingView,
        gr: &GroupResource,
        ar: &ApiResource,
        meta: &kube::api::ObjectMeta,
        decision: RebalanceDecision,
    ) -> Result<(), PatchError> {
        let labels = match decision {
            RebalanceDecision::Keep => return Ok(()),
            RebalanceDecision::Drain => json!({ &view.drain_label: "true" }),
            RebalanceDecision::Move => json!({ &view.shard_label: null, &view.drain_label: null }),
        };
        // Every ring's sync and the missed-assignment path share one bound; held for the probe and
        // the patch alike.
        let _permit = self.limit.acquire().await;
        let body =
            json!({"metadata": {"resourceVersion": meta.resource_version, "labels": labels}});
        let api: Api<DynamicObject> = match &meta.namespace {
            Some(ns) => Api::namespaced_with(self.ctx.client.clone(), ns, ar),
            None => Api::all_with(self.ctx.client.clone(), ar),
        };
        let name = meta.name.as_deref().unwrap_or_default();
        let ring = view.ring_ref();
        if decision == RebalanceDecision::Move {
            match self.ctx.reachability.gate(&ring, std::time::Instant::now()) {
                MoveGate::Open => {}
                MoveGate::Closed => return Err(PatchError::Held),
                MoveGate::Probe => {
                    // A dry run goes through admission like the real write, without changing the
                    // object: if the webhook assigns it, moves may go again.
                    let params = PatchParams {
                        dry_run: true,
                        ..crate::controller::patch_params()
                    };
                    match api
                        .patch_metadata(name, &params, &Patch::Merge(&body))
                        .await
                    {
                        Ok(probed) if !self.webhook_ran(view, &probed.metadata) => {
                            self.webhook_missed(&ring).await;
                            return Err(PatchError::NotAssigned);
                        }
                        Ok(_) => self.webhook_answered(&ring).await,
                        Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        match api
            .patch_metadata(
                name,
                &crate::controller::patch_params(),
                &Patch::Merge(&body),
            )
            .await
        {
            Ok(updated) => {
                if decision == RebalanceDecision::Move {
                    if !self.webhook_ran(view, &updated.metadata) {
                        self.webhook_missed(&ring).await;
                        return Err(PatchError::NotAssigned);
                    }
                    self.webhook_answered(&ring).await;
                    // The webhook assigned the object in the same request, as the current view wants.
                    let current = self.ctx.views.get(&ring);
                    let current = current.as_deref().unwrap_or(view);
                    let landed = current.resources.get(gr).is_none_or(|resource| {
                        current
                            .placement(&gr.group, resource, &updated.metadata)
                            .decision
                            == RebalanceDecision::Keep
                    });
                    if !landed {
                        return Err(PatchError::NotAssigned);
                    }
                }
                Ok(())
            }
            // Deleted meanwhile: nothing left to move.
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Counts a drain or move that went through.
    pub(super) fn count(&self, view: &RingView, gr: &GroupResource, decision: RebalanceDecision) {
        let labels = Metrics::resource_labels(&view.ring_ref(), &gr.group, &gr.resource);
        match decision {
            RebalanceDecision::Drain => self.ctx.metrics.drains.get_or_create(&labels).inc(),
            RebalanceDecision::Move => self.ctx.metrics.movements.get_or_create(&labels).inc(),
            RebalanceDecision::Keep => 0,
        };
    }

    /// Whether the ring's webhook ran on a moved object: it carries a shard label again. Without
    /// available shards the webhook assigns nothing, which says nothing about reaching it.
    fn webhook_ran(&self, view: &RingView, meta: &kube::api::ObjectMeta) -> bool {
        let current = self.ctx.views.get(&view.ring_ref());
        let shards = current.as_deref().unwrap_or(view).hash_ring.len();
        shards == 0
            || meta
                .labels
                .as_ref()
                .is_some_and(|l| l.get(&view.shard_label).is_some_and(|s| !s.is_empty()))
    }

    /// Records a move that came back unassigned; the first one after a good run stops the ring's
    /// moves and is reported.
    async fn webhook_missed(&self, ring: &RingRef) {
        if self
            .ctx
            .reachability
            .failed(ring, std::time::Instant::now())
        {
            tracing::warn!(%ring, reason = REASON_WEBHOOK_UNREACHABLE, "a moved object came back unassigned: the API server does not reach the ring's webhook; moves stop until a probe lands");
            if let Some(object) = self.ctx.caches.ring(ring) {
                let note = "A moved object came back unassigned: the API server does not reach this ring's webhook. Moves stop until a dry-run probe lands (every few seconds)".to_string();
                self.ctx
                    .events
                    .warning(&object.object_ref(), REASON_WEBHOOK_UNREACHABLE, "", note)
                    .await;
            }
        }
    }

    /// Records a move (or probe) the webhook assigned; reports a webhook that answers again.
    async fn webhook_answered(&self, ring: &RingRef) {
        if self.ctx.reachability.landed(ring) {
            tracing::info!(%ring, "the ring's webhook answers again; moves resume");
            if let Some(object) = self.ctx.caches.ring(ring) {
                let note =
                    "The API server reaches this ring's webhook again; moves resume".to_string();
                self.ctx
                    .events
                    .normal(&object.object_ref(), REASON_WEBHOOK_REACHABLE, "", note)
                    .await;
            }
        }
    }
}

/// A patch that did not have the intended effect.
#[derive(Debug, thiserror::Error)]
pub(super) enum PatchError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// The move went through but the object did not land on the shard the ring's current view
    /// wants: no webhook assigned it (its configuration not yet seen by the API server, or no
    /// sharder replica reachable), or the replica that answered had another view: retry later.
    #[error("object was moved but not assigned to the shard the ring wants now")]
    NotAssigned,
    /// The ring's webhook is unreachable and no probe is due: the move was not sent.
    #[error("the ring's webhook is unreachable; move held back")]
    Held,
}

/// The API resource of `gr`, at the version discovery found.
pub(super) fn api_resource(gr: &GroupResource, info: &ResourceInfo) -> ApiResource {
    ApiResource {
        group: gr.group.clone(),
        version: info.version.clone(),
        api_version: if gr.group.is_empty() {
            info.version.clone()
        } else {
            format!("{}/{}", gr.group, info.version)
        },
        kind: info.kind.clone(),
        plural: gr.resource.clone(),
    }
}
