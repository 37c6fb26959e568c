//! The ring-view registry: what the sharder knows about each ring, its resources resolved to
//! kinds and scopes, and the hash ring of its available shards.
//!
//! Views are rebuilt from the watch caches when a ring's spec or its set of available shards
//! changes (`maintain`, on every replica), never per request: the webhook and the sync read an
//! `Arc<RingView>` without locking anything for longer than a map lookup.

mod discovery;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kube::ResourceExt;
use sharding_crds::labels;
use sharding_crds::{ClusterRing, GroupResource};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub(crate) use self::discovery::Discovery;
use crate::context::Context;
use crate::core::key::{ControllerKind, ResourceRole};
use crate::core::membership::available_shards;
use crate::core::ring::Ring;
use crate::core::validation;
use crate::metrics::RingLabels;

/// How often rings with unresolved resources (e.g. a CRD installed later) are resolved again.
const UNRESOLVED_RETRY: Duration = Duration::from_secs(10);

/// Kind and scope of a resource, from API discovery.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ResourceInfo {
    /// Kind, e.g. `Secret`.
    pub kind: String,
    /// Preferred version, e.g. `v1`.
    pub version: String,
    /// Whether objects of the resource live in namespaces.
    pub namespaced: bool,
}

/// A resource of a ring, resolved: its kind and scope, and its role in the ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ResolvedResource {
    /// Kind and scope of the resource itself.
    pub(crate) info: ResourceInfo,
    /// How keys of its objects are computed.
    pub(crate) role: ResourceRole,
}

impl ResolvedResource {
    /// Whether the resource is a main resource of the ring.
    pub(crate) fn is_main(&self) -> bool {
        self.role == ResourceRole::Main
    }
}

/// A consistent snapshot of one ring, as the webhook and the sync use it.
#[derive(Debug)]
pub struct RingView {
    /// Ring name.
    pub(crate) name: String,
    /// The ring's shard label key.
    pub(crate) shard_label: String,
    /// The ring's drain label key.
    pub(crate) drain_label: String,
    /// Hash ring over the available shards.
    pub(crate) ring: Ring,
    /// Every resolved resource of the ring with its role. A resource that is main in one entry
    /// and controlled in another counts as main.
    pub(crate) resources: HashMap<GroupResource, ResolvedResource>,
    /// Resources of the spec that discovery could not resolve (yet).
    pub(crate) unresolved: Vec<GroupResource>,
    /// `metadata.generation` of the ring this view was built from.
    pub(crate) generation: Option<i64>,
    /// Increases with every rebuild of any view; set by [`RingViews::insert`]. The sharder
    /// controller syncs a ring again when its view's revision changed.
    pub(crate) revision: u64,
}

/// Builds a view from a ring, its available shards and discovery results.
pub fn build_view(
    ring: &ClusterRing,
    shards: &BTreeSet<String>,
    discovered: &HashMap<GroupResource, ResourceInfo>,
) -> RingView {
    let name = ring.name_any();
    let mut resources = HashMap::new();
    let mut unresolved = Vec::new();
    let mut controlled: HashMap<GroupResource, Vec<ControllerKind>> = HashMap::new();
    for entry in &ring.spec.resources {
        let main = entry.group_resource();
        let Some(info) = discovered.get(&main) else {
            unresolved.push(main);
            continue;
        };
        resources.insert(
            main.clone(),
            ResolvedResource {
                info: info.clone(),
                role: ResourceRole::Main,
            },
        );
        for c in &entry.controlled_resources {
            controlled
                .entry(c.clone())
                .or_default()
                .push(ControllerKind::new(
                    &entry.group,
                    &info.kind,
                    info.namespaced,
                ));
        }
    }
    for (gr, controllers) in controlled {
        if resources.contains_key(&gr) {
            continue;
        }
        match discovered.get(&gr) {
            Some(info) => {
                resources.insert(
                    gr,
                    ResolvedResource {
                        info: info.clone(),
                        role: ResourceRole::Controlled { controllers },
                    },
                );
            }
            None => unresolved.push(gr),
        }
    }
    RingView {
        shard_label: labels::shard_label(&name),
        drain_label: labels::drain_label(&name),
        name,
        ring: Ring::new(shards),
        resources,
        unresolved,
        generation: ring.metadata.generation,
        revision: 0,
    }
}

/// The current view of every ring, shared between the webhook and the controllers.
#[derive(Debug)]
pub struct RingViews {
    views: RwLock<HashMap<String, Arc<RingView>>>,
    revision: AtomicU64,
    changed: tokio::sync::watch::Sender<u64>,
}

impl Default for RingViews {
    fn default() -> Self {
        Self {
            views: RwLock::default(),
            revision: AtomicU64::new(0),
            changed: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl RingViews {
    /// The current view of `ring`, if the ring is known.
    pub(crate) fn get(&self, ring: &str) -> Option<Arc<RingView>> {
        self.views.read().ok()?.get(ring).cloned()
    }

    /// Every current view.
    pub(crate) fn all(&self) -> Vec<Arc<RingView>> {
        self.views
            .read()
            .map(|v| v.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Replaces the view of a ring, giving it a new revision.
    pub fn insert(&self, mut view: RingView) {
        let revision = self.revision.fetch_add(1, Ordering::SeqCst) + 1;
        view.revision = revision;
        if let Ok(mut views) = self.views.write() {
            views.insert(view.name.clone(), Arc::new(view));
        }
        self.changed.send_replace(revision);
    }

    /// Forgets every ring not in `keep`.
    pub(crate) fn retain(&self, keep: &BTreeSet<String>) {
        let removed = self.views.write().is_ok_and(|mut views| {
            let before = views.len();
            views.retain(|name, _| keep.contains(name));
            views.len() != before
        });
        if removed {
            let revision = self.revision.fetch_add(1, Ordering::SeqCst) + 1;
            self.changed.send_replace(revision);
        }
    }

    /// A receiver that is notified whenever a view is inserted or removed.
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

/// Rebuilds ring views when a ring's spec or its set of available shards changes (`changed` is
/// notified by the ClusterRing and Lease watches), and retries rings with unresolved resources
/// every few seconds, until `shutdown` fires.
pub(crate) async fn maintain(ctx: Context, changed: Arc<Notify>, shutdown: CancellationToken) {
    let mut retry = tokio::time::interval(UNRESOLVED_RETRY);
    loop {
        let retry_unresolved = tokio::select! {
            () = shutdown.cancelled() => return,
            () = changed.notified() => false,
            _ = retry.tick() => true,
        };
        refresh(&ctx, retry_unresolved).await;
    }
}

/// Rebuilds the views whose ring's spec or set of available shards changed (and, with
/// `retry_unresolved`, those with resources not served before), and forgets deleted rings.
pub(crate) async fn refresh(ctx: &Context, retry_unresolved: bool) {
    let leases = ctx.leases.state();
    let mut keep = BTreeSet::new();
    for ring in ctx.rings.state() {
        let name = ring.name_any();
        if validation::validate_ring(&ring).is_err() {
            // A broken ring is not acted on; the ring controller reports why.
            continue;
        }
        keep.insert(name.clone());
        let shards = available_shards(&name, leases.iter().map(AsRef::as_ref));
        let current = ctx.ring_views.get(&name);
        let shards_changed = current.as_ref().is_none_or(|v| {
            v.ring.shards().len() != shards.len()
                || !v.ring.shards().iter().zip(&shards).all(|(a, b)| a == b)
        });
        let spec_changed = current
            .as_ref()
            .is_none_or(|v| v.generation != ring.metadata.generation);
        let retry = retry_unresolved && current.as_ref().is_some_and(|v| !v.unresolved.is_empty());
        if !(shards_changed || spec_changed || retry) {
            continue;
        }
        let resources: Vec<_> = ring
            .spec
            .resources
            .iter()
            .flat_map(|r| {
                std::iter::once(r.group_resource()).chain(r.controlled_resources.iter().cloned())
            })
            .collect();
        let discovered = ctx.discovery.resolve(&resources).await;
        let view = build_view(&ring, &shards, &discovered);
        if !(shards_changed || spec_changed)
            && current
                .as_ref()
                .is_some_and(|v| v.unresolved == view.unresolved && v.resources == view.resources)
        {
            // A retry that resolved nothing new: keep the view and its revision, so the ring is
            // not synced again for nothing.
            continue;
        }
        if shards_changed {
            ctx.metrics
                .ring_calculations
                .get_or_create(&RingLabels {
                    clusterring: name.clone(),
                })
                .inc();
            tracing::info!(ring = %name, shards = ?shards, "rebuilt hash ring");
        }
        if !view.unresolved.is_empty() {
            tracing::warn!(ring = %name, unresolved = ?view.unresolved, "some ring resources are not served by the API server (yet)");
        }
        ctx.ring_views.insert(view);
    }
    ctx.ring_views.retain(&keep);
}

#[cfg(test)]
mod tests {
    use super::*;
    use sharding_crds::{ClusterRingSpec, RingResource};

    fn info(kind: &str, namespaced: bool) -> ResourceInfo {
        ResourceInfo {
            kind: kind.into(),
            version: "v1".into(),
            namespaced,
        }
    }

    #[test]
    fn view_resolves_roles() {
        let ring = ClusterRing::new(
            "r",
            ClusterRingSpec {
                resources: vec![
                    RingResource {
                        group: String::new(),
                        resource: "secrets".into(),
                        controlled_resources: vec![
                            GroupResource::new("", "configmaps"),
                            GroupResource::new("example.com", "unknowns"),
                        ],
                    },
                    RingResource {
                        group: String::new(),
                        resource: "namespaces".into(),
                        controlled_resources: vec![GroupResource::new("", "configmaps")],
                    },
                ],
                namespace_selector: None,
                hash_key: None,
            },
        );
        let discovered = HashMap::from([
            (GroupResource::new("", "secrets"), info("Secret", true)),
            (
                GroupResource::new("", "configmaps"),
                info("ConfigMap", true),
            ),
            (
                GroupResource::new("", "namespaces"),
                info("Namespace", false),
            ),
        ]);
        let shards = BTreeSet::from(["s1".to_string()]);
        let view = build_view(&ring, &shards, &discovered);
        assert_eq!(view.shard_label, labels::shard_label("r"));
        assert_eq!(view.ring.shards(), ["s1"]);
        assert_eq!(
            view.unresolved,
            [GroupResource::new("example.com", "unknowns")]
        );
        match &view.resources[&GroupResource::new("", "configmaps")].role {
            ResourceRole::Controlled { controllers } => assert_eq!(
                controllers,
                &[
                    ControllerKind::new("", "Secret", true),
                    ControllerKind::new("", "Namespace", false)
                ]
            ),
            other => panic!("unexpected role {other:?}"),
        }
        assert!(view.resources[&GroupResource::new("", "secrets")].is_main());
    }
}
