//! Where a new controlled object's controller sits while its ring changes: the webhook and the
//! sharder's own assignment (a ring with `assignment: Watch`) both label such a child with its
//! controller's current shard rather than the one the ring wants now (docs/protocol.md §9).

use kube::api::{Api, ApiResource, DynamicObject};
use sharding_crds::RingRef;

use super::registry::Views;
use super::view::RingView;
use crate::core::key::{ObjectInfo, ResourceRole};

/// How long a reader waits for a controller's labels before it follows the ring: well within
/// the 5 s the API server gives the webhook.
const CONTROLLER_LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// A controller to read before labelling a child: its ring changed within the views' transition
/// window (5 minutes) and an earlier ring placed it elsewhere, so it may still sit on that shard,
/// its drain pending. The child then goes where the controller is, and follows it when it moves:
/// a shard never writes a child that another shard reconciles while it still holds the
/// controller.
pub(crate) struct ControllerLookup {
    /// The controller's resource, at the version its owner reference names.
    pub(crate) resource: ApiResource,
    /// Its namespace, for a namespaced controller.
    pub(crate) namespace: Option<String>,
    /// Its name.
    pub(crate) name: String,
}

impl RingView {
    /// Where to read the controller of `child` (its owner reference with `controller: true`), if
    /// its kind is a main resource of this ring.
    pub(crate) fn controller_lookup(&self, child: &ObjectInfo<'_>) -> Option<ControllerLookup> {
        let owner = child
            .owner_references
            .iter()
            .find(|o| o.controller == Some(true))?;
        let (group, version) = owner
            .api_version
            .rsplit_once('/')
            .unwrap_or(("", owner.api_version.as_str()));
        let (main, resolved) = self.resources.iter().find(|(gr, resolved)| {
            gr.group == group
                && resolved.info.kind == owner.kind
                && matches!(resolved.role, ResourceRole::Main)
        })?;
        let resource = ApiResource {
            group: group.to_string(),
            version: version.to_string(),
            api_version: owner.api_version.clone(),
            kind: owner.kind.clone(),
            plural: main.resource.clone(),
        };
        Some(ControllerLookup {
            resource,
            namespace: resolved
                .info
                .namespaced
                .then(|| child.namespace.map(str::to_string))
                .flatten(),
            name: owner.name.clone(),
        })
    }
}

/// The shard the controller `lookup` names carries the label of, if that shard may still be
/// running; `None` when it has none, cannot be read in time, or its shard is gone (then the ring
/// decides).
pub(crate) async fn controller_shard(
    client: kube::Client,
    views: &Views,
    ring: &RingRef,
    lookup: &ControllerLookup,
) -> Option<String> {
    let api: Api<DynamicObject> = match &lookup.namespace {
        Some(namespace) => Api::namespaced_with(client, namespace, &lookup.resource),
        None => Api::all_with(client, &lookup.resource),
    };
    let read = tokio::time::timeout(
        CONTROLLER_LOOKUP_TIMEOUT,
        api.get_metadata_opt(&lookup.name),
    )
    .await;
    let meta = match read {
        Ok(Ok(Some(meta))) => meta,
        Ok(Ok(None)) => return None,
        Ok(Err(error)) => {
            tracing::debug!(%ring, %error, "failed to read a child's controller; the ring decides");
            return None;
        }
        Err(_) => {
            tracing::debug!(%ring, "reading a child's controller timed out; the ring decides");
            return None;
        }
    };
    let view = views.get(ring)?;
    let shard = meta.metadata.labels?.remove(&view.shard_label)?;
    view.may_be_running(&shard).then_some(shard)
}
