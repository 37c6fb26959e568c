//! The `ClusterRing` API (docs/protocol.md §1).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::labels;

/// Condition type reporting whether the ring was reconciled successfully.
pub const CONDITION_READY: &str = "Ready";
/// Reason of a `Ready=True` condition.
pub const REASON_RECONCILIATION_SUCCEEDED: &str = "ReconciliationSucceeded";
/// Reason of a `Ready=False` condition (and of the Warning Event emitted with it).
pub const REASON_RECONCILIATION_FAILED: &str = "ReconciliationFailed";
/// Message of a `Ready=True` condition.
pub const MESSAGE_RECONCILIATION_SUCCEEDED: &str = "ClusterRing was successfully reconciled";
/// Longest ring name: the name ends up in label values and object names.
pub const MAX_NAME_LEN: usize = 63;
/// CEL rule enforcing [`MAX_NAME_LEN`] on API servers that support CEL (1.25+).
pub const NAME_LENGTH_RULE: &str = "size(self.metadata.name) <= 63";
/// Message of [`NAME_LENGTH_RULE`].
pub const NAME_LENGTH_MESSAGE: &str = "ClusterRing name must not be longer than 63 characters";
/// CEL rule refusing controlled resources in a ring with `assignment: ServerSide` that hashes by
/// object: a controlled object's uid hashes independently of its controller's, so the server's
/// shard selector cannot keep the two on one shard (docs/zero-write-rings.md).
pub const SERVER_SIDE_CONTROLLED_RULE: &str = "!has(self.spec.assignment) || self.spec.assignment != 'ServerSide' || (has(self.spec.hashKey) && self.spec.hashKey == 'Namespace') || !has(self.spec.resources) || self.spec.resources.all(r, !has(r.controlledResources) || size(r.controlledResources) == 0)";
/// Message of [`SERVER_SIDE_CONTROLLED_RULE`].
pub const SERVER_SIDE_CONTROLLED_MESSAGE: &str = "assignment ServerSide with hashKey Object cannot have controlledResources: a controlled object's uid hashes independently of its controller's (use hashKey Namespace, or list the controlled objects unsharded)";

/// Desired state of a ClusterRing: which resources it shards, and in which namespaces.
///
/// A ClusterRing is a ring of controller instances (shards) that split the objects of some
/// resources between them. The sharder assigns every object of the listed resources to one
/// available shard of the ring by writing the ring's shard label, and moves objects when shards
/// come and go.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "sharding.timebertt.dev",
    version = "v1alpha1",
    kind = "ClusterRing",
    plural = "clusterrings",
    singular = "clusterring",
    status = "ClusterRingStatus",
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Available","type":"string","jsonPath":".status.availableShards"}"#,
    printcolumn = r#"{"name":"Shards","type":"string","jsonPath":".status.shards"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterRingSpec {
    /// Resources whose objects are distributed across the shards of this ring.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["group", "resource"]))]
    pub resources: Vec<RingResource>,

    /// Selects the namespaces whose objects this ring covers. When unset, the sharder's configured
    /// default applies (by default every namespace except kube-system and sharding-system).
    /// Changing it never removes labels already written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub namespace_selector: Option<LabelSelector>,

    /// What objects are hashed by (docs/protocol.md §16): `Object` (the default) hashes every
    /// object by its own identity, or its controller's; `Namespace` hashes every namespaced object
    /// by its namespace, so all of a namespace's objects of this ring land on one shard.
    /// Cluster-scoped objects keep their own key. Changing it rebalances through drains.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_key: Option<HashKey>,

    /// Namespaces whose Leases may be shards of this ring. When empty (the default), a Lease in
    /// any namespace that carries the ring's label is a shard, as in the original protocol. A
    /// Lease elsewhere is kept out of the ring with a Warning Event (reason
    /// `ShardLeaseNamespaceNotAllowed`) and receives no objects; if it is held by a running shard,
    /// its objects leave it only through a drain (docs/protocol.md §18). Our extension.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub lease_namespaces: Vec<String>,

    /// How new objects get their shard label (docs/protocol.md §20): `Webhook` (the default) has
    /// the API server call the sharder's admission webhook, so an object is stored with its label
    /// already; `Watch` installs no webhook: the sharder watches the ring's unassigned objects
    /// and labels each with a patch right after it is created. `Watch` suits clusters whose API
    /// server cannot reach the sharder; a shard then sees a new object only after that patch,
    /// and new objects stay unassigned while no sharder runs. `ServerSide` writes no object at
    /// all: the sharder publishes each shard's ranges of the hash space on its Lease and shards
    /// list and watch with the API server's shard selector (docs/zero-write-rings.md); it refuses
    /// controlled resources with `hashKey: Object`. Our extension.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignment: Option<Assignment>,
}

/// How a ring's new objects get their shard label (docs/protocol.md §20).
///
/// Named after the mechanism rather than a yes/no switch on the webhook: the choice is between
/// two ways of labelling, each with its own trade-off, and a third (say, a shard labelling its
/// own objects) would fit beside them.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum Assignment {
    /// The sharder's mutating admission webhook labels each object as it is written; the watch
    /// of unassigned objects only catches what the webhook missed.
    #[default]
    Webhook,
    /// No webhook: the sharder labels each new object from its watch of unassigned objects.
    Watch,
    /// No labels at all: the sharder publishes hash ranges on the shards' Leases, and each shard
    /// lists and watches only its ranges through the API server's shard selector
    /// (docs/zero-write-rings.md). The sharder neither lists nor watches the ring's objects.
    ServerSide,
}

/// What a ring hashes objects by (docs/protocol.md §16).
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum HashKey {
    /// Each object by its own identity (a controlled object by its controller's).
    #[default]
    Object,
    /// Each namespaced object by its namespace.
    Namespace,
}

/// A group and resource (plural name), as in `metav1.GroupResource`.
#[derive(
    Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, JsonSchema,
)]
pub struct GroupResource {
    /// API group of the resource; empty for the core group.
    pub group: String,
    /// Plural resource name, e.g. `configmaps`.
    pub resource: String,
}

impl GroupResource {
    /// Creates a group-resource pair.
    pub fn new(group: impl Into<String>, resource: impl Into<String>) -> Self {
        Self {
            group: group.into(),
            resource: resource.into(),
        }
    }
}

impl std::fmt::Display for GroupResource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.group.is_empty() {
            f.write_str(&self.resource)
        } else {
            write!(f, "{}.{}", self.resource, self.group)
        }
    }
}

/// A main resource of the ring, optionally with the resources its objects control.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RingResource {
    /// API group of the main resource; empty for the core group.
    pub group: String,
    /// Plural name of the main resource, e.g. `secrets`.
    pub resource: String,
    /// Resources whose objects are controlled by objects of the main resource (through an owner
    /// reference with `controller: true`); they are assigned to the shard of their controller.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["group", "resource"]))]
    pub controlled_resources: Vec<GroupResource>,
}

impl RingResource {
    /// Main resource `resource` of API group `group` (empty for the core group), controlling
    /// nothing.
    pub fn new(group: impl Into<String>, resource: impl Into<String>) -> Self {
        Self::controlling(group, resource, [])
    }

    /// Main resource `resource` of API group `group` whose objects control objects of the
    /// `controlled` resources, e.g. Secrets controlling ConfigMaps.
    pub fn controlling(
        group: impl Into<String>,
        resource: impl Into<String>,
        controlled: impl IntoIterator<Item = GroupResource>,
    ) -> Self {
        Self {
            group: group.into(),
            resource: resource.into(),
            controlled_resources: controlled.into_iter().collect(),
        }
    }

    /// The main resource as a group-resource pair.
    pub fn group_resource(&self) -> GroupResource {
        GroupResource::new(&self.group, &self.resource)
    }
}

/// Observed state of a ClusterRing.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterRingStatus {
    /// The `metadata.generation` this status was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Number of shard Leases of this ring, in any state.
    #[serde(default)]
    pub shards: i32,
    /// Number of available shards of this ring.
    #[serde(default)]
    pub available_shards: i32,
    /// Conditions of the ring; only `Ready` is used.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Shards that may still be running although their Lease left the ring while they held it
    /// (deleted, relabelled, or its holder changed without the shard's release mark): until the
    /// given time their objects leave them only through drains (docs/protocol.md §18). Kept here
    /// so that a sharder that starts meanwhile still knows them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub departed_shards: Vec<DepartedShard>,
    /// The latest generation of ranges the sharder published on the ring's shard Leases
    /// (`assignment: ServerSide` only, docs/zero-write-rings.md), so that a new sharder leader
    /// continues the count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range_generation: Option<u64>,
}

/// A shard whose Lease left its ring while the shard may still be running.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DepartedShard {
    /// The shard's name.
    pub name: String,
    /// Until when the shard may be running: two lease durations after the last renewal the
    /// sharder saw.
    pub until: Time,
}

impl ClusterRingSpec {
    /// A ring over `resources` with every other field unset, so the defaults apply (the sharder's
    /// namespace selector, hashing by object, Leases from any namespace, webhook assignment).
    pub fn new(resources: impl IntoIterator<Item = RingResource>) -> Self {
        Self {
            resources: resources.into_iter().collect(),
            ..Self::default()
        }
    }

    /// The hash key in effect: [`HashKey::Object`] when unset.
    pub fn hash_key(&self) -> HashKey {
        self.hash_key.unwrap_or_default()
    }

    /// The assignment mode in effect: [`Assignment::Webhook`] when unset.
    pub fn assignment(&self) -> Assignment {
        self.assignment.unwrap_or_default()
    }
}

impl ClusterRing {
    /// The label key carrying the shard assignment of this ring's objects.
    pub fn shard_label(&self) -> String {
        labels::shard_label(&kube::ResourceExt::name_any(self))
    }

    /// The label key asking a shard to give up an object of this ring.
    pub fn drain_label(&self) -> String {
        labels::drain_label(&kube::ResourceExt::name_any(self))
    }

    /// The `Ready` condition, if set.
    pub fn ready_condition(&self) -> Option<&Condition> {
        self.status
            .as_ref()?
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_READY)
    }
}
