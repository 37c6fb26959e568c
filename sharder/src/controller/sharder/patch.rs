//! One drain or move patch of the sharder controller, from the sync or the missed-assignment
//! path, and what a move's answer says about the ring's webhook; for a ring without a webhook
//! (`assignment: Watch`), the patch that writes the shard label itself.

use std::sync::Arc;

use kube::Resource;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, PartialObjectMeta};
use kube_sharding_api::lease::ShardLease;
use kube_sharding_api::{GroupResource, RingRef};
use serde_json::json;

use super::patch_limit::PatchLimit;
use crate::context::Context;
use crate::core::key::{KeyOutcome, ObjectInfo};
use crate::core::owner_wait::HeldChild;
use crate::core::rebalance::RebalanceDecision;
use crate::leader::direct_moves::DirectMove;
use crate::leader::events::{REASON_WEBHOOK_REACHABLE, REASON_WEBHOOK_UNREACHABLE};
use crate::leader::reachability::MoveGate;
use crate::metrics::Metrics;
use crate::views::{ResourceInfo, RingView, controller_shard};

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
    /// resourceVersion if `meta` has one. A move counts as done only when the object landed where the ring's view
    /// wants it now, which may be newer than `view`.
    pub(super) async fn patch(
        &self,
        view: &RingView,
        gr: &GroupResource,
        ar: &ApiResource,
        meta: &kube::api::ObjectMeta,
        decision: RebalanceDecision,
    ) -> Result<(), PatchError> {
        if decision == RebalanceDecision::Move && view.assigns_directly() {
            return self.assign(view, gr, ar, meta).await;
        }
        let labels = match decision {
            RebalanceDecision::Keep => return Ok(()),
            RebalanceDecision::Drain => json!({ &view.drain_label: "true" }),
            RebalanceDecision::Move => json!({ &view.shard_label: null, &view.drain_label: null }),
        };
        // Every ring's sync and the missed-assignment path share one bound; held for the probe and
        // the patch alike.
        let _permit = self.limit.acquire().await;
        // Checked with the permit in hand, right before the write, and held until its answer: the
        // shard it leaves is labelled `ready` again only after.
        let _direct = match decision {
            RebalanceDecision::Move => self.direct_move(view, meta.labels.as_ref())?,
            _ => None,
        };
        // Without a resourceVersion (a held-back child whose controller left its shard) the
        // move is unconditional: whatever happened to the object since, the webhook places it.
        let body = match &meta.resource_version {
            Some(version) => json!({"metadata": {"resourceVersion": version, "labels": labels}}),
            None => json!({"metadata": {"labels": labels}}),
        };
        let api: Api<DynamicObject> = match &meta.namespace {
            Some(ns) => Api::namespaced_with(self.ctx.client.clone(), ns, ar),
            None => Api::all_with(self.ctx.client.clone(), ar),
        };
        let name = meta.name.as_deref().unwrap_or_default();
        if decision == RebalanceDecision::Move
            && self.gate(view, &api, name, &body).await? == Gate::Gone
        {
            return Ok(());
        }
        match api
            .patch_metadata(
                name,
                &crate::controller::patch_params(),
                &Patch::Merge(&body),
            )
            .await
        {
            Ok(updated) if decision == RebalanceDecision::Move => {
                self.landed(view, gr, &updated.metadata).await
            }
            Ok(_) => Ok(()),
            // Deleted meanwhile: nothing left to move.
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes the shard the ring wants for an object straight into its shard label, for a ring
    /// without a webhook ([`RingView::assigns_directly`]): the move of such a ring.
    ///
    /// The JSON patch tests that the label still has the value `meta` shows (absent included:
    /// the API server's `test` of `null` passes for a missing member), so an assignment or move
    /// written meanwhile by another replica, a sync or a shard is never overwritten; the test
    /// fails with 422 and the caller reads the object again. No resourceVersion is sent, so
    /// writes to other fields do not make it fail. A drain label left from an earlier shard goes
    /// in the same patch, as the webhook removes it. A controlled object whose controller may
    /// still sit on the shard an earlier hash ring gave it, or whose controller's pin decides,
    /// follows the controller where it sits, as the webhook decides (`controller_shard`).
    async fn assign(
        &self,
        view: &RingView,
        gr: &GroupResource,
        ar: &ApiResource,
        meta: &kube::api::ObjectMeta,
    ) -> Result<(), PatchError> {
        let Some(resource) = view.resources.get(gr) else {
            return Ok(());
        };
        let placement = view.placement(&gr.group, resource, meta);
        let Some(desired) = placement.desired else {
            // No key, or no available shard: nothing to write; the sync tries again when shards
            // come.
            return Ok(());
        };
        let mut shard = desired.to_string();
        if let (false, Ok(KeyOutcome::Key(key))) = (resource.is_main(), &placement.key)
            && placement
                .pin
                .asks_controller(view.recently_moved(key, std::time::Instant::now()))
            && let Some(lookup) =
                view.controller_lookup(&ObjectInfo::from_meta(&gr.group, &resource.info.kind, meta))
            && let Some(current) = controller_shard(
                self.ctx.client.clone(),
                &self.ctx.views,
                &view.ring_ref(),
                &lookup,
            )
            .await
        {
            shard = current;
        }
        let ops = assign_ops(
            meta.labels.as_ref(),
            &view.shard_label,
            &view.drain_label,
            &shard,
        );
        let _permit = self.limit.acquire().await;
        let _direct = self.direct_move(view, meta.labels.as_ref())?;
        match self
            .json_patch(
                ar,
                meta.namespace.as_deref(),
                meta.name.as_deref().unwrap_or_default(),
                &ops,
            )
            .await
        {
            Ok(_) => {
                // Counted here, where it is known whether the object had a shard: a first
                // assignment counts as the webhook's would, a move as a move.
                let labels = Metrics::resource_labels(&view.ring_ref(), &gr.group, &gr.resource);
                let counter = if placement.object.current.is_none() {
                    &self.ctx.metrics.assignments
                } else {
                    &self.ctx.metrics.movements
                };
                counter.get_or_create(&labels).inc();
                Ok(())
            }
            // Deleted meanwhile: nothing left to assign.
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            // The label changed since `meta` was read: the caller reads again and decides anew.
            Err(kube::Error::Api(status)) if status.code == 422 => Err(PatchError::NotAssigned),
            Err(e) => Err(e.into()),
        }
    }

    /// Sends the JSON patch `ops` to an object and returns its metadata as the API server
    /// answered.
    async fn json_patch(
        &self,
        ar: &ApiResource,
        namespace: Option<&str>,
        name: &str,
        ops: &serde_json::Value,
    ) -> Result<PartialObjectMeta<DynamicObject>, kube::Error> {
        let url = format!(
            "{}/{}?fieldManager={}",
            DynamicObject::url_path(ar, namespace),
            name,
            crate::core::webhook_config::FIELD_MANAGER
        );
        let request = axum::http::Request::patch(url)
            .header(axum::http::header::CONTENT_TYPE, JSON_PATCH)
            .header(axum::http::header::ACCEPT, METADATA_ONLY)
            .body(serde_json::to_vec(ops).unwrap_or_default())
            .map_err(kube::Error::HttpError)?;
        self.ctx
            .client
            .request::<PartialObjectMeta<DynamicObject>>(request)
            .await
    }

    /// Moves a controlled object a sync held back from `child.shard` to `child.desired`, if it
    /// still sits on `child.shard`: one JSON patch tests the shard label and replaces it, so a
    /// child moved meanwhile (by its shard, or by a sync) is left alone without a write, and no
    /// resourceVersion can conflict with its new shard's writes. Returns whether it moved.
    ///
    /// The label is written here rather than removed for the webhook, in rings with a webhook
    /// too: the sharder held the child for exactly this moment, its controller has left the old
    /// shard for `child.desired`, and the webhook would only read the controller back (its lookup
    /// while the ring changes) to find the same shard, one API read per child on an API server
    /// busy with the rebalance. A labelled object does not pass the ring's webhook at all (its
    /// object selector), so the move is one write.
    pub(super) async fn move_child(
        &self,
        view: &RingView,
        ar: &ApiResource,
        child: &HeldChild,
    ) -> Result<bool, PatchError> {
        let _permit = self.limit.acquire().await;
        let _direct = match self.direct_move_off(view, &child.shard) {
            Ok(direct) => direct,
            // Its shard is back and keeps it until a newer sync decides.
            Err(_) => return Ok(false),
        };
        let pointer = label_pointer(&view.shard_label);
        let ops = json!([
            {"op": "test", "path": pointer, "value": child.shard},
            {"op": "replace", "path": pointer, "value": child.desired},
        ]);
        match self
            .json_patch(ar, child.namespace.as_deref(), &child.name, &ops)
            .await
        {
            Ok(_) => Ok(true),
            // Deleted meanwhile, or no longer on that shard (the test failed): nothing to move.
            Err(kube::Error::Api(status)) if matches!(status.code, 404 | 422) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Starts a direct move of an object with `labels` if it is one: it sits on a shard that
    /// `view` does not count as possibly running (docs/protocol.md §22). Not one: `Ok(None)`.
    fn direct_move(
        &self,
        view: &RingView,
        labels: Option<&std::collections::BTreeMap<String, String>>,
    ) -> Result<Option<DirectMove>, PatchError> {
        match labels.and_then(|l| l.get(&view.shard_label)) {
            Some(shard) if !shard.is_empty() => self.direct_move_off(view, shard),
            _ => Ok(None),
        }
    }

    /// Starts a move of an object off `shard` if that is a direct move (`shard` is not possibly
    /// running in `view`); [`PatchError::ShardBack`] when the shard holds its Lease again by now,
    /// as the Lease cache shows: the move must not go out.
    fn direct_move_off(
        &self,
        view: &RingView,
        shard: &str,
    ) -> Result<Option<DirectMove>, PatchError> {
        if view.may_be_running(shard) {
            return Ok(None);
        }
        let ring = view.ring_ref();
        let index = self.ctx.caches.lease_index(ring.kind);
        // Any Lease of the ring with the shard's name held by the shard makes the views count it
        // as possibly running (available, or kept out while held).
        let back = || {
            index
                .ring_leases_named(&ring.name, shard)
                .iter()
                .any(|lease| ShardLease::from_lease(lease).is_held_by_shard())
        };
        self.ctx
            .direct_moves
            .begin(&ring, shard, back)
            .map(Some)
            .ok_or(PatchError::ShardBack)
    }

    /// Whether a move may be sent now: the ring's webhook answers, or a dry run of `body` (a
    /// merge patch) is the probe that finds it answering again.
    async fn gate(
        &self,
        view: &RingView,
        api: &Api<DynamicObject>,
        name: &str,
        body: &serde_json::Value,
    ) -> Result<Gate, PatchError> {
        let ring = view.ring_ref();
        match self.ctx.reachability.gate(&ring, std::time::Instant::now()) {
            MoveGate::Open => Ok(Gate::Go),
            MoveGate::Closed => Err(PatchError::Held),
            MoveGate::Probe => {
                // A dry run goes through admission like the real write, without changing the
                // object: if the webhook assigns it, moves may go again.
                let params = PatchParams {
                    dry_run: true,
                    ..crate::controller::patch_params()
                };
                match api.patch_metadata(name, &params, &Patch::Merge(body)).await {
                    Ok(probed) if !self.webhook_ran(view, &probed.metadata) => {
                        self.webhook_missed(&ring).await;
                        Err(PatchError::NotAssigned)
                    }
                    Ok(_) => {
                        self.webhook_answered(&ring).await;
                        Ok(Gate::Go)
                    }
                    Err(kube::Error::Api(status)) if status.code == 404 => Ok(Gate::Gone),
                    Err(e) => Err(e.into()),
                }
            }
        }
    }

    /// Whether a moved object, as the API server answered the move, landed where the ring's view
    /// wants it now (which may be newer than `view`): the webhook assigned it in the same request.
    async fn landed(
        &self,
        view: &RingView,
        gr: &GroupResource,
        meta: &kube::api::ObjectMeta,
    ) -> Result<(), PatchError> {
        let ring = view.ring_ref();
        if !self.webhook_ran(view, meta) {
            self.webhook_missed(&ring).await;
            return Err(PatchError::NotAssigned);
        }
        self.webhook_answered(&ring).await;
        let current = self.ctx.views.get(&ring);
        let current = current.as_deref().unwrap_or(view);
        let landed = current.resources.get(gr).is_none_or(|resource| {
            current.placement(&gr.group, resource, meta).decision == RebalanceDecision::Keep
        });
        if landed {
            Ok(())
        } else {
            Err(PatchError::NotAssigned)
        }
    }

    /// Counts a drain or move that went through.
    pub(super) fn count(&self, view: &RingView, gr: &GroupResource, decision: RebalanceDecision) {
        let labels = Metrics::resource_labels(&view.ring_ref(), &gr.group, &gr.resource);
        match decision {
            RebalanceDecision::Drain => self.ctx.metrics.drains.get_or_create(&labels).inc(),
            // Counted by `assign`, which knows whether it assigned or moved.
            RebalanceDecision::Move if view.assigns_directly() => 0,
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

/// The JSON patch that writes `shard` as label `shard_label` of an object whose labels were
/// `labels`, only if that label still has the value read (`test` of `null` passes for an absent
/// member, and for an absent labels map), and drops a leftover `drain_label`.
fn assign_ops(
    labels: Option<&std::collections::BTreeMap<String, String>>,
    shard_label: &str,
    drain_label: &str,
    shard: &str,
) -> serde_json::Value {
    let Some(labels) = labels else {
        return json!([
            {"op": "test", "path": "/metadata/labels", "value": null},
            {"op": "add", "path": "/metadata/labels", "value": { shard_label: shard }},
        ]);
    };
    let pointer = label_pointer(shard_label);
    let mut ops = vec![
        json!({"op": "test", "path": pointer, "value": labels.get(shard_label)}),
        json!({"op": "add", "path": pointer, "value": shard}),
    ];
    if labels.contains_key(drain_label) {
        ops.push(json!({"op": "remove", "path": label_pointer(drain_label)}));
    }
    serde_json::Value::Array(ops)
}

/// The JSON pointer of label `key` of an object.
fn label_pointer(key: &str) -> String {
    format!("/metadata/labels/{}", escape_pointer(key))
}

/// Escapes a JSON pointer segment (RFC 6901): `~` → `~0`, `/` → `~1`.
fn escape_pointer(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

/// Content type of a JSON patch (RFC 6902).
const JSON_PATCH: &str = "application/json-patch+json";

/// Accept header asking for the object's metadata only.
const METADATA_ONLY: &str = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1";

/// Whether a move may go on after its gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    /// Send it.
    Go,
    /// The probe found the object deleted: nothing left to move.
    Gone,
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
    /// The move would take the object off an unavailable shard, which holds its Lease again: not
    /// sent; the sync of the newer view decides (docs/protocol.md §22).
    #[error("the shard the object was to leave holds its Lease again; move not sent")]
    ShardBack,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_assignment_tests_the_label_it_replaces() {
        use std::collections::BTreeMap;
        let (shard, drain) = ("shard.x/r", "drain.x/r");
        // No labels at all: the map is created, only if it is still absent.
        assert_eq!(
            assign_ops(None, shard, drain, "a"),
            json!([
                {"op": "test", "path": "/metadata/labels", "value": null},
                {"op": "add", "path": "/metadata/labels", "value": {"shard.x/r": "a"}},
            ])
        );
        // Other labels: the shard label is tested absent, then added.
        let other = BTreeMap::from([("app".to_string(), "web".to_string())]);
        assert_eq!(
            assign_ops(Some(&other), shard, drain, "a"),
            json!([
                {"op": "test", "path": "/metadata/labels/shard.x~1r", "value": null},
                {"op": "add", "path": "/metadata/labels/shard.x~1r", "value": "a"},
            ])
        );
        // A move off a dead shard tests the old value; a leftover drain label goes.
        let moved = BTreeMap::from([
            (shard.to_string(), "gone".to_string()),
            (drain.to_string(), "true".to_string()),
        ]);
        assert_eq!(
            assign_ops(Some(&moved), shard, drain, "b"),
            json!([
                {"op": "test", "path": "/metadata/labels/shard.x~1r", "value": "gone"},
                {"op": "add", "path": "/metadata/labels/shard.x~1r", "value": "b"},
                {"op": "remove", "path": "/metadata/labels/drain.x~1r"},
            ])
        );
    }

    #[test]
    fn label_keys_are_escaped_as_pointer_segments() {
        assert_eq!(
            escape_pointer("shard.alpha.sharding.timebertt.dev/a~b"),
            "shard.alpha.sharding.timebertt.dev~1a~0b"
        );
    }
}
