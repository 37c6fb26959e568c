//! The ring-view registry: what the sharder knows about each ring, its resources resolved to
//! kinds and scopes, and the hash ring of its available shards.
//!
//! Views are rebuilt from the watch caches when a ring's spec or its set of available shards
//! changes (`maintain`, on every replica), never per request: the webhook and the sync read an
//! `Arc<RingView>` without locking anything for longer than a map lookup.

mod discovery;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use sharding_crds::{GroupResource, HashKey, RingKind, RingObject, RingRef};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub(crate) use self::discovery::Discovery;
use crate::context::{AnyRing, Context};
use crate::core::key::{self, ControllerKind, KeyError, KeyOutcome, ObjectInfo, ResourceRole};
use crate::core::membership::available_shards;
use crate::core::rebalance::{ObjectState, RebalanceDecision, decide};
use crate::core::ring::Ring;
use crate::lease_index::LeaseChange;
use crate::metrics::RingLabel;

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

impl ResourceInfo {
    /// A namespaced resource of the core group's `v1`, as discovery reports Secrets or
    /// ConfigMaps: for building views without an API server (tests, benches, load tools).
    pub fn core_namespaced(kind: &str) -> Self {
        Self {
            kind: kind.into(),
            version: "v1".into(),
            namespaced: true,
        }
    }
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
    /// Ring kind.
    pub(crate) kind: RingKind,
    /// Ring name.
    pub(crate) name: String,
    /// The ring's shard label key.
    pub(crate) shard_label: String,
    /// The ring's drain label key.
    pub(crate) drain_label: String,
    /// Hash ring over the available shards.
    pub(crate) ring: Ring,
    /// What objects are hashed by.
    pub(crate) hash_key: HashKey,
    /// Namespaces whose objects belong to the ring: its selector, else the configured default.
    pub(crate) namespace_selector: LabelSelector,
    /// Every resolved resource of the ring with its role. A resource that is main in one entry
    /// and controlled in another counts as main.
    pub(crate) resources: HashMap<GroupResource, ResolvedResource>,
    /// Resources of the spec that discovery could not resolve (yet).
    pub(crate) unresolved: Vec<GroupResource>,
    /// `metadata.generation` of the ring this view was built from.
    pub(crate) generation: Option<i64>,
    /// [`Discovery::generation`] when this view was built: a newer one means a resource's
    /// version may have changed, and the view is rebuilt.
    pub(crate) discovery_generation: u64,
    /// Increases with every rebuild of any view; set by [`RingViews::insert`]. The sharder
    /// controller syncs a ring again when its view's revision changed.
    pub(crate) revision: u64,
}

impl RingView {
    /// Kind and name of the ring.
    pub(crate) fn ring_ref(&self) -> RingRef {
        RingRef::new(self.kind, &self.name)
    }

    /// The hash key of `object`, whose resource plays `role` in the ring (SPEC §6, §16).
    ///
    /// With `hashKey: Namespace` a namespaced object, main or controlled, is keyed by its
    /// namespace as the Namespace object would be as a main object; so it needs neither a name
    /// nor a controller.
    pub(crate) fn key(
        &self,
        object: &ObjectInfo<'_>,
        role: &ResourceRole,
    ) -> Result<KeyOutcome, KeyError> {
        match (self.hash_key, object.namespace.filter(|ns| !ns.is_empty())) {
            (HashKey::Namespace, Some(namespace)) => Ok(KeyOutcome::Key(key::format_key(
                "",
                "Namespace",
                "",
                namespace,
            ))),
            _ => key::hash_key(object, role),
        }
    }

    /// Where an object of `resource` (group `group`) with metadata `meta` stands in this ring:
    /// its key, the shard the ring wants, the labels it carries and what the sharder does next
    /// (SPEC §6, §9). Namespace selection is the caller's business.
    pub(crate) fn placement<'a>(
        &'a self,
        group: &str,
        resource: &ResolvedResource,
        meta: &'a kube::api::ObjectMeta,
    ) -> Placement<'a> {
        let key = self.key(
            &ObjectInfo::from_meta(group, &resource.info.kind, meta),
            &resource.role,
        );
        let desired = match &key {
            Ok(KeyOutcome::Key(key)) => self.ring.shard_for(key),
            _ => None,
        };
        let labels = meta.labels.as_ref();
        let object = ObjectState {
            current: labels
                .and_then(|labels| labels.get(&self.shard_label))
                .map(String::as_str)
                .filter(|shard| !shard.is_empty()),
            draining: labels.is_some_and(|labels| labels.contains_key(&self.drain_label)),
            main: resource.is_main(),
        };
        Placement {
            decision: decide(object, desired, |shard| self.ring.contains(shard)),
            key,
            desired,
            object,
        }
    }
}

/// One object's standing in a ring, from [`RingView::placement`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Placement<'a> {
    /// Its hash key, or why it has none.
    pub(crate) key: Result<KeyOutcome, KeyError>,
    /// The shard the ring wants it on now: `None` without a key or without available shards.
    pub(crate) desired: Option<&'a str>,
    /// Its shard label (non-empty values only), drain label and role.
    pub(crate) object: ObjectState<'a>,
    /// What the sharder's sync does with it.
    pub(crate) decision: RebalanceDecision,
}

/// Builds a view from a ring, its available shards with their weights, discovery results and the
/// configured default namespace selector.
pub fn build_view<R: RingObject>(
    ring: &R,
    shards: &BTreeMap<String, u32>,
    discovered: &HashMap<GroupResource, ResourceInfo>,
    default_selector: &LabelSelector,
) -> RingView {
    let RingRef { kind, name } = ring.ring_ref();
    let spec = ring.ring_spec();
    let mut resources = HashMap::new();
    let mut unresolved = Vec::new();
    let mut controlled: HashMap<GroupResource, Vec<ControllerKind>> = HashMap::new();
    for entry in &spec.resources {
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
        kind,
        shard_label: kind.shard_label(&name),
        drain_label: kind.drain_label(&name),
        name,
        ring: Ring::weighted(shards.iter().map(|(name, weight)| (name, *weight))),
        hash_key: spec.hash_key(),
        namespace_selector: spec
            .namespace_selector
            .clone()
            .unwrap_or_else(|| default_selector.clone()),
        resources,
        unresolved,
        generation: ring.meta().generation,
        discovery_generation: 0,
        revision: 0,
    }
}

/// The current view of every ring, shared between the webhook and the controllers.
#[derive(Debug)]
pub struct RingViews {
    views: RwLock<HashMap<RingRef, Arc<RingView>>>,
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
    pub(crate) fn get(&self, ring: &RingRef) -> Option<Arc<RingView>> {
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
            views.insert(view.ring_ref(), Arc::new(view));
        }
        self.changed.send_replace(revision);
    }

    /// Forgets every ring not in `keep`.
    pub(crate) fn retain(&self, keep: &BTreeSet<RingRef>) {
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

/// Which rings a [`refresh`] looks at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Every ring; with `retry_unresolved`, rings with resources not served before are resolved
    /// again. Views of rings that are gone or invalid are forgotten.
    All {
        /// Resolve rings with unresolved resources again.
        retry_unresolved: bool,
    },
    /// These rings only (their Leases changed).
    Rings(BTreeSet<RingRef>),
}

impl Scope {
    /// The scope covering both.
    fn merge(self, other: Self) -> Self {
        match (self, other) {
            (Self::Rings(mut a), Self::Rings(b)) => {
                a.extend(b);
                Self::Rings(a)
            }
            (
                Self::All {
                    retry_unresolved: a,
                },
                Self::All {
                    retry_unresolved: b,
                },
            ) => Self::All {
                retry_unresolved: a || b,
            },
            (all @ Self::All { .. }, Self::Rings(_)) | (Self::Rings(_), all @ Self::All { .. }) => {
                all
            }
        }
    }

    /// The rings a change among the Leases of `kind` concerns.
    fn of_lease_change(
        kind: RingKind,
        change: Result<LeaseChange, tokio::sync::broadcast::error::RecvError>,
    ) -> Self {
        match change {
            Ok(LeaseChange::Membership { rings, .. }) => Self::Rings(
                rings
                    .into_iter()
                    .map(|name| RingRef::new(kind, name))
                    .collect(),
            ),
            // The state label is not part of membership.
            Ok(LeaseChange::State(_)) => Self::Rings(BTreeSet::new()),
            // Relisted, or fell behind: anything may have changed.
            Ok(LeaseChange::All) | Err(_) => Self::All {
                retry_unresolved: false,
            },
        }
    }
}

/// Rebuilds ring views until `shutdown` fires: every view when a ring changes (`changed` is
/// notified by the ring watches), the views of the rings a Lease membership change concerns
/// (renewals concern none), and rings with unresolved resources every few seconds.
pub(crate) async fn maintain(ctx: Context, changed: Arc<Notify>, shutdown: CancellationToken) {
    let mut retry = tokio::time::interval(UNRESOLVED_RETRY);
    let [mut cluster_leases, mut controller_leases] =
        RingKind::ALL.map(|kind| ctx.lease_index(kind).subscribe());
    loop {
        let mut scope = tokio::select! {
            () = shutdown.cancelled() => return,
            () = changed.notified() => Scope::All { retry_unresolved: false },
            _ = retry.tick() => Scope::All { retry_unresolved: true },
            change = cluster_leases.recv() => Scope::of_lease_change(RingKind::ClusterRing, change),
            change = controller_leases.recv() => Scope::of_lease_change(RingKind::ControllerRing, change),
        };
        // Take in what else arrived meanwhile: a burst of joins rebuilds each ring once.
        for (kind, receiver) in [
            (RingKind::ClusterRing, &mut cluster_leases),
            (RingKind::ControllerRing, &mut controller_leases),
        ] {
            loop {
                match receiver.try_recv() {
                    Ok(change) => scope = scope.merge(Scope::of_lease_change(kind, Ok(change))),
                    Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => {
                        scope = scope.merge(Scope::All {
                            retry_unresolved: false,
                        });
                    }
                    Err(_) => break,
                }
            }
        }
        if scope != Scope::Rings(BTreeSet::new()) {
            refresh(&ctx, scope).await;
        }
    }
}

/// Rebuilds the views in `scope` whose ring's spec or set of available shards changed (and, when
/// asked, those with resources not served before); a refresh of every ring also forgets deleted
/// and invalid rings.
pub(crate) async fn refresh(ctx: &Context, scope: Scope) {
    let (rings, retry_unresolved) = match &scope {
        Scope::All { retry_unresolved } => (ctx.rings(), *retry_unresolved),
        Scope::Rings(rings) => (rings.iter().filter_map(|r| ctx.ring(r)).collect(), false),
    };
    let mut keep = BTreeSet::new();
    for ring in rings {
        let ring_ref = ring.ring_ref();
        if ring
            .validate(&ctx.config.webhook.config.allowed_protected_resources)
            .is_err()
        {
            // A broken ring is not acted on; the ring controller reports why.
            continue;
        }
        keep.insert(ring_ref.clone());
        let leases = ctx.ring_leases(&ring_ref);
        let shards = available_shards(
            ring_ref.kind,
            &ring_ref.name,
            leases.iter().map(AsRef::as_ref),
        );
        let current = ctx.ring_views.get(&ring_ref);
        let shards_changed = current.as_ref().is_none_or(|v| {
            !v.ring
                .members()
                .eq(shards.iter().map(|(n, w)| (n.as_str(), *w)))
        });
        let spec_changed = current
            .as_ref()
            .is_none_or(|v| v.generation != ring.meta().generation);
        let discovery_generation = ctx.discovery.generation();
        let retry = retry_unresolved
            && current.as_ref().is_some_and(|v| {
                !v.unresolved.is_empty() || v.discovery_generation != discovery_generation
            });
        if !(shards_changed || spec_changed || retry) {
            continue;
        }
        let resources: Vec<_> = ring
            .spec()
            .resources
            .iter()
            .flat_map(|r| {
                std::iter::once(r.group_resource()).chain(r.controlled_resources.iter().cloned())
            })
            .collect();
        let discovered = ctx.discovery.resolve(&resources).await;
        let default_selector = &ctx.config.webhook.config.namespace_selector;
        let mut view = match &ring {
            AnyRing::Cluster(r) => build_view(r.as_ref(), &shards, &discovered, default_selector),
            AnyRing::Controller(r) => {
                build_view(r.as_ref(), &shards, &discovered, default_selector)
            }
        };
        view.discovery_generation = discovery_generation;
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
                .get_or_create(&RingLabel(ring_ref.clone()))
                .inc();
            tracing::info!(ring = %ring_ref, shards = ?shards, "rebuilt hash ring");
        }
        if !view.unresolved.is_empty() {
            tracing::warn!(ring = %ring_ref, unresolved = ?view.unresolved, "some ring resources are not served by the API server (yet)");
        }
        ctx.ring_views.insert(view);
    }
    if matches!(scope, Scope::All { .. }) {
        ctx.ring_views.retain(&keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sharding_crds::{ClusterRing, ClusterRingSpec, ControllerRing, RingResource};

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
        let shards = BTreeMap::from([("s1".to_string(), 1)]);
        let view = build_view(&ring, &shards, &discovered, &LabelSelector::default());
        assert_eq!(view.shard_label, sharding_crds::labels::shard_label("r"));
        assert_eq!(view.kind, RingKind::ClusterRing);
        assert_eq!(view.ring.members().collect::<Vec<_>>(), [("s1", 1)]);
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

    #[test]
    fn controller_ring_view_with_namespace_keys() {
        let spec = ClusterRingSpec {
            resources: vec![RingResource {
                group: String::new(),
                resource: "secrets".into(),
                controlled_resources: vec![GroupResource::new("", "configmaps")],
            }],
            namespace_selector: None,
            hash_key: Some(HashKey::Namespace),
        };
        let ring = ControllerRing::new("r", spec.into());
        let discovered = HashMap::from([
            (GroupResource::new("", "secrets"), info("Secret", true)),
            (
                GroupResource::new("", "configmaps"),
                info("ConfigMap", true),
            ),
        ]);
        let shards = BTreeMap::from([("a".to_string(), 1), ("b".to_string(), 2)]);
        let selector = LabelSelector {
            match_labels: Some([("x".to_string(), "y".to_string())].into()),
            ..Default::default()
        };
        let view = build_view(&ring, &shards, &discovered, &selector);
        assert_eq!(view.ring_ref(), RingRef::new(RingKind::ControllerRing, "r"));
        assert_eq!(view.shard_label, "shard.alpha.sharding.timebertt.dev/r");
        assert_eq!(view.drain_label, "drain.alpha.sharding.timebertt.dev/r");
        assert_eq!(view.namespace_selector, selector, "the default applies");
        assert_eq!(
            view.ring.members().collect::<Vec<_>>(),
            [("a", 1), ("b", 2)]
        );

        let main = &view.resources[&GroupResource::new("", "secrets")].role;
        let controlled = &view.resources[&GroupResource::new("", "configmaps")].role;
        let namespace_key = Ok(KeyOutcome::Key("/Namespace//team-a".to_string()));
        // A main object without a name (generateName) and a controlled object without a
        // controller both get their namespace's key.
        let unnamed = ObjectInfo {
            group: "",
            kind: "Secret",
            namespace: Some("team-a"),
            name: None,
            owner_references: &[],
        };
        assert_eq!(view.key(&unnamed, main), namespace_key);
        let orphan = ObjectInfo {
            kind: "ConfigMap",
            name: Some("cm"),
            ..unnamed
        };
        assert_eq!(view.key(&orphan, controlled), namespace_key);
        // Cluster-scoped objects keep their own key.
        let cluster_scoped = ObjectInfo {
            namespace: None,
            name: Some("s"),
            ..unnamed
        };
        assert_eq!(
            view.key(&cluster_scoped, main),
            Ok(KeyOutcome::Key("/Secret//s".to_string()))
        );
    }
}
