//! One ring's view: its resources resolved, the hash ring of its available shards, and where
//! one object stands in it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube_sharding_api::{Assignment, GroupResource, HashKey, RingKind, RingObject, RingRef};

use super::pins::Pins;
use crate::core::hash_ring::HashRing;
use crate::core::key::{self, ControllerKind, KeyError, KeyOutcome, ObjectInfo, ResourceRole};
use crate::core::pin::{self, PinInputs, PinOutcome};
use crate::core::rebalance::{ObjectState, RebalanceDecision, decide};

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
    /// The ring's pin annotation key (docs/protocol.md §21).
    pub(crate) pin_annotation: String,
    /// Namespace and controller pins, shared by every view of the process.
    pub(crate) pins: Pins,
    /// Hash ring over the available shards.
    pub(crate) hash_ring: HashRing,
    /// Shards kept out of the ring whose Leases their shards still hold (see
    /// [`crate::core::membership::excluded_held_shards`]).
    pub(crate) excluded_held: BTreeSet<String>,
    /// Whether every available shard's Lease says it leaves its controlled objects to the sharder
    /// (see [`crate::core::membership::RingShards::leave_controlled_objects`]).
    pub(crate) shards_leave_controlled_objects: bool,
    /// What objects are hashed by.
    pub(crate) hash_key: HashKey,
    /// Who writes the shard label of new objects: the webhook, or the sharder controller itself.
    pub(crate) assignment: Assignment,
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
    /// Increases with every rebuild of any view; set by [`Views::insert`]. The sharder
    /// controller syncs a ring again when its view's revision changed.
    pub(crate) revision: u64,
    /// The hash rings this ring had before [`RingView::hash_ring`], newest first, each with when
    /// it was replaced; kept for [`TRANSITION_WINDOW`]. While one of them places a controller
    /// elsewhere, the controller may still sit on that shard, waiting for its drain, and the
    /// webhook asks the controller where it is before labelling a child created meanwhile.
    pub(crate) earlier: Vec<(HashRing, std::time::Instant)>,
}

/// How long a replaced hash ring is kept in [`RingView::earlier`]: drains are acknowledged within
/// seconds by a healthy shard; a child created while its controller's drain is pending for
/// longer follows the current ring, and the sync's owner wait keeps the two apart as before.
pub(crate) const TRANSITION_WINDOW: std::time::Duration = std::time::Duration::from_secs(300);

/// At most this many replaced hash rings are kept (a burst of membership changes).
pub(crate) const MAX_EARLIER_RINGS: usize = 4;

impl RingView {
    /// Kind and name of the ring.
    pub(crate) fn ring_ref(&self) -> RingRef {
        RingRef::new(self.kind, &self.name)
    }

    /// The hash key of `object`, whose resource plays `role` in the ring (see
    /// [`key::ring_key`]).
    pub(crate) fn key(
        &self,
        object: &ObjectInfo<'_>,
        role: &ResourceRole,
    ) -> Result<KeyOutcome, KeyError> {
        key::ring_key(self.hash_key, object, role)
    }

    /// Whether a replaced hash ring of the last [`TRANSITION_WINDOW`] places `key` elsewhere than
    /// the current one: an object of that key may still sit on the other shard.
    pub(crate) fn recently_moved(&self, key: &str, now: std::time::Instant) -> bool {
        let current = self.hash_ring.shard_for(key);
        self.earlier.iter().any(|(ring, replaced)| {
            now.duration_since(*replaced) < TRANSITION_WINDOW && ring.shard_for(key) != current
        })
    }

    /// Whether the sharder controller writes the shard label itself ([`Assignment::Watch`]): no
    /// webhook is installed, so a move or an assignment is one patch that sets the desired shard
    /// instead of a patch that removes the label for the webhook to fill in.
    pub(crate) fn assigns_directly(&self) -> bool {
        self.assignment == Assignment::Watch
    }

    /// Whether shard `shard` may still be running and reconciling objects: it is available, or kept
    /// out of the ring while its Lease is still held by itself. Objects leave such a shard only
    /// through a drain, so no object is reconciled by two shards at once.
    pub(crate) fn may_be_running(&self, shard: &str) -> bool {
        self.hash_ring.contains(shard) || self.excluded_held.contains(shard)
    }

    /// Where an object of `resource` (group `group`) with metadata `meta` stands in this ring:
    /// its key, the shard the ring wants (a pin's, if one applies and its shard is available, else
    /// the hash ring's), the labels it carries and what the sharder does next (docs/protocol.md §6,
    /// §9, §21). A main object's own pin is remembered for its children ([`Pins::main_seen`]).
    /// Namespace selection is the caller's business.
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
        let (desired, pin) = match &key {
            Ok(KeyOutcome::Key(key)) => {
                let own = self.own_pin(meta);
                if resource.is_main() {
                    self.pins.main_seen(&self.ring_ref(), key, own);
                }
                self.place(key, resource.is_main(), own, meta.namespace.as_deref())
            }
            _ => (None, PinOutcome::Unpinned),
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
            decision: decide(object, desired, |shard| self.may_be_running(shard)),
            key,
            desired,
            object,
            pin,
        }
    }

    /// The value of the ring's pin annotation on the object `meta`, if it carries one (read only
    /// for main objects: a controlled object follows its controller).
    pub(crate) fn own_pin<'m>(&self, meta: &'m kube::api::ObjectMeta) -> Option<&'m str> {
        meta.annotations
            .as_ref()?
            .get(&self.pin_annotation)
            .map(String::as_str)
    }

    /// The shard the ring wants an object with hash key `key` on, and what a pin did: a main
    /// object's own pin `own`, else (for a controlled object) its controller's remembered pin,
    /// else the pin of its namespace `namespace` when its key lies in that namespace; the hash
    /// ring when none applies or the pinned shard is not available.
    pub(crate) fn place(
        &self,
        key: &str,
        main: bool,
        own: Option<&str>,
        namespace: Option<&str>,
    ) -> (Option<&str>, PinOutcome) {
        self.place_in(&self.hash_ring, key, main, own, namespace)
    }

    /// [`RingView::place`] among the shards of `ring` instead of the view's: where the object
    /// would go, pins included, if the ring's shards were those of `ring` (`kubectl sharding
    /// simulate`).
    pub(crate) fn place_in<'r>(
        &self,
        ring: &'r HashRing,
        key: &str,
        main: bool,
        own: Option<&str>,
        namespace: Option<&str>,
    ) -> (Option<&'r str>, PinOutcome) {
        // With namespace keys every object of a namespace shares one key, which names no
        // controller: children follow their namespace (docs/protocol.md §21).
        let controller = if main || self.hash_key == HashKey::Namespace {
            None
        } else {
            self.pins.controller(&self.ring_ref(), key)
        };
        // A controlled object whose controller is cluster-scoped has a key outside every
        // namespace: its namespace's pin would part it from its controller.
        let namespace = namespace
            .filter(|ns| !ns.is_empty())
            .filter(|_| main || self.hash_key == HashKey::Namespace || key_in_namespace(key))
            .and_then(|ns| self.pins.namespace(ns, &self.pin_annotation));
        let inputs = PinInputs {
            object: own.filter(|_| main),
            controller: controller.as_deref(),
            namespace: namespace.as_deref(),
        };
        match pin::resolve(ring, &inputs) {
            (Some(shard), outcome) => (Some(shard), outcome),
            (None, outcome) => (ring.shard_for(key), outcome),
        }
    }
}

/// Whether hash key `key` (`group/kind/namespace/name`) names a namespaced object.
fn key_in_namespace(key: &str) -> bool {
    key.split('/').nth(2).is_some_and(|ns| !ns.is_empty())
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
    /// Whether a pin decided `desired`, or why not.
    pub(crate) pin: PinOutcome,
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
        pin_annotation: kind.pin_annotation(&name),
        pins: Pins::default(),
        name,
        hash_ring: HashRing::weighted(shards.iter().map(|(name, weight)| (name, *weight))),
        excluded_held: BTreeSet::new(),
        shards_leave_controlled_objects: false,
        hash_key: spec.hash_key(),
        assignment: spec.assignment(),
        namespace_selector: spec
            .namespace_selector
            .clone()
            .unwrap_or_else(|| default_selector.clone()),
        resources,
        unresolved,
        generation: ring.meta().generation,
        discovery_generation: 0,
        revision: 0,
        earlier: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_sharding_api::{ClusterRing, ClusterRingSpec, ControllerRing, RingResource};

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
                    RingResource::controlling(
                        "",
                        "secrets",
                        vec![
                            GroupResource::new("", "configmaps"),
                            GroupResource::new("example.com", "unknowns"),
                        ],
                    ),
                    RingResource::controlling(
                        "",
                        "namespaces",
                        vec![GroupResource::new("", "configmaps")],
                    ),
                ],
                ..Default::default()
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
        assert_eq!(
            view.shard_label,
            kube_sharding_api::labels::shard_label("r")
        );
        assert_eq!(view.kind, RingKind::ClusterRing);
        assert_eq!(view.hash_ring.members().collect::<Vec<_>>(), [("s1", 1)]);
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
    fn objects_leave_an_excluded_shard_that_may_still_run_only_through_a_drain() {
        let ring = ClusterRing::new(
            "r",
            ClusterRingSpec {
                resources: vec![RingResource::new("", "secrets")],
                ..Default::default()
            },
        );
        let discovered = HashMap::from([(GroupResource::new("", "secrets"), info("Secret", true))]);
        let shards = BTreeMap::from([("s1".to_string(), 1)]);
        let mut view = build_view(&ring, &shards, &discovered, &LabelSelector::default());
        let resource = &view.resources[&GroupResource::new("", "secrets")].clone();
        let meta = |shard: &str| kube::api::ObjectMeta {
            name: Some("o".into()),
            namespace: Some("ns".into()),
            labels: Some(BTreeMap::from([(
                view.shard_label.clone(),
                shard.to_string(),
            )])),
            ..Default::default()
        };
        // Unknown or dead: nobody reconciles it there, so it moves at once.
        assert_eq!(
            view.placement("", resource, &meta("s2")).decision,
            RebalanceDecision::Move
        );
        // Kept out of the ring while its shard still holds its Lease: drained.
        view.excluded_held.insert("s2".into());
        assert!(view.may_be_running("s2") && view.may_be_running("s1"));
        assert_eq!(
            view.placement("", resource, &meta("s2")).decision,
            RebalanceDecision::Drain
        );
    }

    #[test]
    fn controller_ring_view_with_namespace_keys() {
        let spec = ClusterRingSpec {
            hash_key: Some(HashKey::Namespace),
            ..ClusterRingSpec::new([crate::test_rings::secrets_controlling_config_maps()])
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
            view.hash_ring.members().collect::<Vec<_>>(),
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

    #[test]
    fn namespace_pins_reach_only_keys_inside_the_namespace() {
        assert!(key_in_namespace("/Secret/ns/a"));
        assert!(key_in_namespace("apps/Deployment/ns/a"));
        assert!(!key_in_namespace("/Namespace//ns"));
        assert!(!key_in_namespace("example.com/Cluster//a"));
    }

    #[test]
    fn children_follow_controller_pins_only_with_object_keys() {
        let discovered = HashMap::from([
            (GroupResource::new("", "secrets"), info("Secret", true)),
            (
                GroupResource::new("", "configmaps"),
                info("ConfigMap", true),
            ),
        ]);
        let shards = BTreeMap::from([("a".to_string(), 1), ("b".to_string(), 1)]);
        for (hash_key, key) in [
            (HashKey::Object, "/Secret/ns/s"),
            (HashKey::Namespace, "/Namespace//ns"),
        ] {
            let ring = ClusterRing::new(
                "r",
                ClusterRingSpec {
                    hash_key: Some(hash_key),
                    ..ClusterRingSpec::new([crate::test_rings::secrets_controlling_config_maps()])
                },
            );
            let view = build_view(&ring, &shards, &discovered, &Default::default());
            let pinned = ["a", "b"]
                .into_iter()
                .find(|s| view.hash_ring.shard_for(key) != Some(*s))
                .expect("another shard");
            view.pins.main_seen(&view.ring_ref(), key, Some(pinned));
            let (child, _) = view.place(key, false, None, Some("ns"));
            let expected = match hash_key {
                HashKey::Object => Some(pinned),
                HashKey::Namespace => view.hash_ring.shard_for(key),
            };
            assert_eq!(child, expected, "{hash_key:?}");
        }
    }
}
