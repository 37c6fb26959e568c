//! Hash keys: the string an object is placed on the ring by (docs/protocol.md §6).
//!
//! A main object is hashed by its own identity, `<group>/<Kind>/<namespace>/<name>`. A controlled
//! object is hashed by the identity of its controller, so that an owner and everything it controls
//! land on the same shard.
//!
//! Everything here works on kinds, not on plural resource names: callers map a ring's resources
//! (`secrets`) to kinds (`Secret`) through API discovery before asking for a key.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube_sharding_api::HashKey;

/// Why a main object created with `generateName` cannot be hashed in its CREATE. The webhook
/// allows it unchanged (a denial would refuse users' writes for as long as the ring exists), and
/// the sharder's missed-assignment path assigns it as soon as it exists with its name.
pub const GENERATE_NAME_NOT_SUPPORTED: &str = "a main object created with generateName has no name to hash until it exists; it is assigned right after its creation";

/// Formats a hash key from its four parts: `<group>/<kind>/<namespace>/<name>`.
///
/// The core group and cluster-scoped objects use empty strings for their parts, which gives keys
/// like `/ConfigMap/default/foo` or `/Namespace//kube-system`.
#[must_use]
pub fn format_key(group: &str, kind: &str, namespace: &str, name: &str) -> String {
    let mut key =
        String::with_capacity(group.len() + kind.len() + namespace.len() + name.len() + 3);
    for (i, part) in [group, kind, namespace, name].into_iter().enumerate() {
        if i > 0 {
            key.push('/');
        }
        key.push_str(part);
    }
    key
}

/// Returns the API group of an `apiVersion`: `""` for `v1`, `apps` for `apps/v1`.
///
/// Returns `None` when the value is not of the form `<version>` or `<group>/<version>` with
/// non-empty parts. This is stricter than the API machinery, which also accepts an empty string
/// or empty parts; an owner reference carrying such a value cannot name a real controller.
#[must_use]
pub fn parse_group(api_version: &str) -> Option<&str> {
    match api_version.split_once('/') {
        None if !api_version.is_empty() => Some(""),
        Some((group, version))
            if !group.is_empty() && !version.is_empty() && !version.contains('/') =>
        {
            Some(group)
        }
        _ => None,
    }
}

/// A kind that may control objects of a controlled resource: the kind of a main resource of a ring
/// entry that lists that controlled resource.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ControllerKind {
    /// API group of the controller, `""` for the core group.
    pub group: String,
    /// Kind of the controller, e.g. `Deployment` (not the plural resource name).
    pub kind: String,
    /// Whether the controller kind is namespaced. For cluster-scoped controllers the namespace
    /// part of a controlled object's key is empty, so it equals the controller's own key.
    pub namespaced: bool,
}

impl ControllerKind {
    /// Creates a controller kind.
    #[must_use]
    pub fn new(group: impl Into<String>, kind: impl Into<String>, namespaced: bool) -> Self {
        Self {
            group: group.into(),
            kind: kind.into(),
            namespaced,
        }
    }
}

/// The role a resource plays in a ring, which decides how the keys of its objects are computed.
///
/// A resource that is main in one ring entry and controlled in another counts as main.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ResourceRole {
    /// A main resource: an object is hashed by its own identity.
    Main,
    /// A controlled resource: an object is hashed by its controller's identity, and only
    /// controllers of one of these kinds count.
    Controlled {
        /// The kinds allowed to control objects of this resource in the ring.
        controllers: Vec<ControllerKind>,
    },
}

/// The parts of an object that its hash key depends on.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ObjectInfo<'a> {
    /// API group of the object's kind, `""` for the core group; the key of a main object.
    pub group: &'a str,
    /// The object's kind, e.g. `ConfigMap`; the key of a main object.
    pub kind: &'a str,
    /// The object's namespace; `None` or `""` for cluster-scoped objects.
    pub namespace: Option<&'a str>,
    /// The object's name; `None` or `""` while only `generateName` is set.
    pub name: Option<&'a str>,
    /// The object's owner references.
    pub owner_references: &'a [OwnerReference],
}

impl<'a> ObjectInfo<'a> {
    /// Borrows the relevant fields of an object of kind `group`/`kind` from its metadata.
    #[must_use]
    pub fn from_meta(group: &'a str, kind: &'a str, meta: &'a ObjectMeta) -> Self {
        Self {
            group,
            kind,
            namespace: meta.namespace.as_deref(),
            name: meta.name.as_deref(),
            owner_references: meta.owner_references.as_deref().unwrap_or_default(),
        }
    }
}

/// Why an object of a ring resource is not assigned to any shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unassigned {
    /// A controlled object without an owner reference that has `controller: true`.
    NoController,
    /// A controlled object whose controller is not of a kind the ring lists as a controller of
    /// this resource.
    IneligibleController {
        /// API group of the controller.
        group: String,
        /// Kind of the controller.
        kind: String,
    },
    /// A controlled object whose controller reference has an `apiVersion` that cannot be parsed.
    InvalidApiVersion {
        /// The offending `apiVersion`.
        api_version: String,
    },
}

/// The result of computing an object's hash key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyOutcome {
    /// The object is placed on the ring by this key.
    Key(String),
    /// The object belongs to no shard; it must not carry a shard label.
    Unassigned(Unassigned),
}

/// An object that cannot be admitted to a ring resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// A main object has no name yet (only `generateName`), so it cannot be hashed. Its Display
    /// output is exactly [`GENERATE_NAME_NOT_SUPPORTED`].
    #[error("{}", GENERATE_NAME_NOT_SUPPORTED)]
    GenerateNameNotSupported,
}

/// Computes the hash key of `object`, whose resource plays `role` in a ring that hashes by
/// `by` (docs/protocol.md §6, §16).
///
/// With `hashKey: Namespace` a namespaced object, main or controlled, is keyed by its namespace
/// as the Namespace object would be as a main object; so it needs neither a name nor a
/// controller. Cluster-scoped objects keep their own key.
///
/// # Errors
///
/// As [`hash_key`].
pub(crate) fn ring_key(
    by: HashKey,
    object: &ObjectInfo<'_>,
    role: &ResourceRole,
) -> Result<KeyOutcome, KeyError> {
    match (by, object.namespace.filter(|ns| !ns.is_empty())) {
        (HashKey::Namespace, Some(namespace)) => {
            Ok(KeyOutcome::Key(format_key("", "Namespace", "", namespace)))
        }
        _ => hash_key(object, role),
    }
}

/// Computes the hash key of `object`, whose resource plays `role` in the ring, from the object's
/// own identity or its controller's.
///
/// # Errors
///
/// [`KeyError::GenerateNameNotSupported`] for a main object without a name. A controlled object
/// without a name is fine: its key comes from its controller.
pub(crate) fn hash_key(
    object: &ObjectInfo<'_>,
    role: &ResourceRole,
) -> Result<KeyOutcome, KeyError> {
    match role {
        ResourceRole::Main => {
            let name = object
                .name
                .filter(|name| !name.is_empty())
                .ok_or(KeyError::GenerateNameNotSupported)?;
            let namespace = object.namespace.unwrap_or_default();
            Ok(KeyOutcome::Key(format_key(
                object.group,
                object.kind,
                namespace,
                name,
            )))
        }
        ResourceRole::Controlled { controllers } => Ok(controlled_key(object, controllers)),
    }
}

/// The key of a controlled object, taken from its controller reference.
fn controlled_key(object: &ObjectInfo<'_>, controllers: &[ControllerKind]) -> KeyOutcome {
    // The API server allows at most one controller reference per object.
    let Some(owner) = object
        .owner_references
        .iter()
        .find(|owner| owner.controller == Some(true))
    else {
        return KeyOutcome::Unassigned(Unassigned::NoController);
    };
    let Some(group) = parse_group(&owner.api_version) else {
        return KeyOutcome::Unassigned(Unassigned::InvalidApiVersion {
            api_version: owner.api_version.clone(),
        });
    };
    let Some(controller) = controllers
        .iter()
        .find(|c| c.group == group && c.kind == owner.kind)
    else {
        return KeyOutcome::Unassigned(Unassigned::IneligibleController {
            group: group.to_owned(),
            kind: owner.kind.clone(),
        });
    };
    // Owner references cannot cross namespaces, so a namespaced controller lives in the object's
    // own namespace; a cluster-scoped one has none, which makes the key equal its own key.
    let namespace = if controller.namespaced {
        object.namespace.unwrap_or_default()
    } else {
        ""
    };
    KeyOutcome::Key(format_key(group, &owner.kind, namespace, &owner.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_keys_cover_namespaced_objects_only() {
        let unnamed = ObjectInfo {
            group: "",
            kind: "Secret",
            namespace: Some("team-a"),
            name: None,
            owner_references: &[],
        };
        let namespace_key = Ok(KeyOutcome::Key("/Namespace//team-a".to_string()));
        assert_eq!(
            ring_key(HashKey::Namespace, &unnamed, &ResourceRole::Main),
            namespace_key
        );
        let orphan = ObjectInfo {
            kind: "ConfigMap",
            name: Some("cm"),
            ..unnamed
        };
        let controlled = ResourceRole::Controlled {
            controllers: vec![ControllerKind::new("", "Secret", true)],
        };
        assert_eq!(
            ring_key(HashKey::Namespace, &orphan, &controlled),
            namespace_key
        );
        let cluster_scoped = ObjectInfo {
            namespace: None,
            name: Some("s"),
            ..unnamed
        };
        assert_eq!(
            ring_key(HashKey::Namespace, &cluster_scoped, &ResourceRole::Main),
            Ok(KeyOutcome::Key("/Secret//s".to_string()))
        );
        // With object keys the same unnamed main object has no key.
        assert_eq!(
            ring_key(HashKey::Object, &unnamed, &ResourceRole::Main),
            Err(KeyError::GenerateNameNotSupported)
        );
    }

    fn owner(
        api_version: &str,
        kind: &str,
        name: &str,
        controller: Option<bool>,
    ) -> OwnerReference {
        OwnerReference {
            api_version: api_version.to_owned(),
            kind: kind.to_owned(),
            name: name.to_owned(),
            uid: format!("uid-{name}"),
            controller,
            block_owner_deletion: None,
        }
    }

    fn object<'a>(
        namespace: Option<&'a str>,
        name: Option<&'a str>,
        owner_references: &'a [OwnerReference],
    ) -> ObjectInfo<'a> {
        ObjectInfo {
            group: "",
            kind: "",
            namespace,
            name,
            owner_references,
        }
    }

    /// `object` as an object of the main resource of kind `group`/`kind`.
    fn as_main<'a>(object: &ObjectInfo<'a>, group: &'a str, kind: &'a str) -> ObjectInfo<'a> {
        ObjectInfo {
            group,
            kind,
            ..*object
        }
    }

    fn controllers() -> Vec<ControllerKind> {
        vec![
            ControllerKind::new("apps", "Deployment", true),
            ControllerKind::new("", "ConfigMap", true),
            ControllerKind::new("example.com", "Cluster", false),
        ]
    }

    fn key(outcome: Result<KeyOutcome, KeyError>) -> String {
        match outcome {
            Ok(KeyOutcome::Key(key)) => key,
            other => panic!("expected a key, got {other:?}"),
        }
    }

    #[test]
    fn main_object_in_core_group() {
        let obj = object(Some("default"), Some("foo"), &[]);
        assert_eq!(
            key(hash_key(
                &as_main(&obj, "", "ConfigMap"),
                &ResourceRole::Main
            )),
            "/ConfigMap/default/foo"
        );
    }

    #[test]
    fn main_object_in_named_group() {
        let obj = object(Some("bar"), Some("foo"), &[]);
        assert_eq!(
            key(hash_key(
                &as_main(&obj, "apps", "Deployment"),
                &ResourceRole::Main
            )),
            "apps/Deployment/bar/foo"
        );
    }

    #[test]
    fn cluster_scoped_main_object_has_empty_namespace() {
        for namespace in [None, Some("")] {
            let obj = object(namespace, Some("kube-system"), &[]);
            assert_eq!(
                key(hash_key(
                    &as_main(&obj, "", "Namespace"),
                    &ResourceRole::Main
                )),
                "/Namespace//kube-system"
            );
        }
    }

    #[test]
    fn main_object_ignores_owner_references() {
        let owners = [owner("apps/v1", "Deployment", "web", Some(true))];
        let obj = object(Some("default"), Some("foo"), &owners);
        assert_eq!(
            key(hash_key(
                &as_main(&obj, "", "ConfigMap"),
                &ResourceRole::Main
            )),
            "/ConfigMap/default/foo"
        );
    }

    #[test]
    fn main_object_with_generate_name_has_no_key_yet() {
        let controllers = controllers();
        let owners = [owner("apps/v1", "Deployment", "web", Some(true))];
        for name in [None, Some("")] {
            // Even with a controller reference: main objects are hashed by their own name.
            let obj = object(Some("default"), name, &owners);
            let err = hash_key(&as_main(&obj, "", "ConfigMap"), &ResourceRole::Main)
                .expect_err("main object without name");
            assert_eq!(err, KeyError::GenerateNameNotSupported);
            assert_eq!(err.to_string(), GENERATE_NAME_NOT_SUPPORTED);
            // The same object as a controlled resource is fine.
            let role = ResourceRole::Controlled {
                controllers: controllers.clone(),
            };
            assert_eq!(key(hash_key(&obj, &role)), "apps/Deployment/default/web");
        }
    }

    #[test]
    fn controlled_object_with_namespaced_owner() {
        let controllers = controllers();
        let role = ResourceRole::Controlled {
            controllers: controllers.clone(),
        };
        let owners = [owner("apps/v1", "Deployment", "web", Some(true))];
        let obj = object(Some("bar"), Some("web-abc12"), &owners);
        assert_eq!(key(hash_key(&obj, &role)), "apps/Deployment/bar/web");

        let owners = [owner("v1", "ConfigMap", "cm", Some(true))];
        let obj = object(Some("bar"), Some("secret"), &owners);
        assert_eq!(key(hash_key(&obj, &role)), "/ConfigMap/bar/cm");
    }

    #[test]
    fn controlled_key_equals_owner_key() {
        let controllers = controllers();
        let owners = [owner("apps/v1", "Deployment", "foo", Some(true))];
        let child = object(Some("bar"), Some("foo-1"), &owners);
        let parent = object(Some("bar"), Some("foo"), &[]);
        assert_eq!(
            hash_key(
                &child,
                &ResourceRole::Controlled {
                    controllers: controllers.clone()
                }
            ),
            hash_key(&as_main(&parent, "apps", "Deployment"), &ResourceRole::Main)
        );
    }

    #[test]
    fn controlled_object_with_cluster_scoped_owner_has_empty_namespace() {
        let controllers = controllers();
        let role = ResourceRole::Controlled {
            controllers: controllers.clone(),
        };
        let owners = [owner("example.com/v1beta1", "Cluster", "prod", Some(true))];
        let child = object(Some("team-a"), Some("config"), &owners);
        let owner_obj = object(None, Some("prod"), &[]);
        let child_key = key(hash_key(&child, &role));
        assert_eq!(child_key, "example.com/Cluster//prod");
        assert_eq!(
            child_key,
            key(hash_key(
                &as_main(&owner_obj, "example.com", "Cluster"),
                &ResourceRole::Main
            ))
        );
    }

    #[test]
    fn only_the_controller_reference_counts() {
        let controllers = controllers();
        let role = ResourceRole::Controlled {
            controllers: controllers.clone(),
        };
        let owners = [
            owner("v1", "ConfigMap", "not-controller", Some(false)),
            owner("v1", "ConfigMap", "unset", None),
            owner("apps/v1", "Deployment", "web", Some(true)),
        ];
        let obj = object(Some("default"), Some("x"), &owners);
        assert_eq!(key(hash_key(&obj, &role)), "apps/Deployment/default/web");
    }

    #[test]
    fn controlled_object_without_controller_is_unassigned() {
        let controllers = controllers();
        let role = ResourceRole::Controlled {
            controllers: controllers.clone(),
        };
        let non_controllers = [
            owner("apps/v1", "Deployment", "web", Some(false)),
            owner("apps/v1", "Deployment", "web2", None),
        ];
        for owners in [&non_controllers[..], &[]] {
            let obj = object(Some("default"), Some("x"), owners);
            let outcome = hash_key(&obj, &role).expect("controlled objects never fail");
            assert_eq!(outcome, KeyOutcome::Unassigned(Unassigned::NoController));
        }
    }

    #[test]
    fn ineligible_controller_is_unassigned() {
        let controllers = controllers();
        let role = ResourceRole::Controlled {
            controllers: controllers.clone(),
        };
        for (api_version, kind, group) in [
            ("apps/v1", "StatefulSet", "apps"),
            // Same kind in another group does not count.
            ("extensions/v1beta1", "Deployment", "extensions"),
            ("v1", "Deployment", ""),
            // Kinds are case-sensitive.
            ("apps/v1", "deployment", "apps"),
        ] {
            let owners = [owner(api_version, kind, "web", Some(true))];
            let obj = object(Some("default"), Some("x"), &owners);
            let outcome = hash_key(&obj, &role).expect("controlled objects never fail");
            assert_eq!(
                outcome,
                KeyOutcome::Unassigned(Unassigned::IneligibleController {
                    group: group.to_owned(),
                    kind: kind.to_owned(),
                })
            );
        }

        // No eligible controllers at all.
        let owners = [owner("apps/v1", "Deployment", "web", Some(true))];
        let obj = object(Some("default"), Some("x"), &owners);
        let outcome = hash_key(
            &obj,
            &ResourceRole::Controlled {
                controllers: Vec::new(),
            },
        );
        assert!(
            matches!(outcome, Ok(KeyOutcome::Unassigned(_))),
            "no controller kinds means nothing is assigned"
        );
    }

    #[test]
    fn invalid_owner_api_version_is_unassigned() {
        let controllers = controllers();
        let role = ResourceRole::Controlled {
            controllers: controllers.clone(),
        };
        for api_version in ["", "/v1", "apps/", "apps/v1/extra", "/"] {
            let owners = [owner(api_version, "Deployment", "web", Some(true))];
            let obj = object(Some("default"), Some("x"), &owners);
            let outcome = hash_key(&obj, &role).expect("controlled objects never fail");
            assert_eq!(
                outcome,
                KeyOutcome::Unassigned(Unassigned::InvalidApiVersion {
                    api_version: api_version.to_owned()
                }),
                "apiVersion {api_version:?}"
            );
        }
    }

    #[test]
    fn parses_groups() {
        assert_eq!(parse_group("v1"), Some(""));
        assert_eq!(parse_group("apps/v1"), Some("apps"));
        assert_eq!(
            parse_group("webhosting.timebertt.dev/v1alpha1"),
            Some("webhosting.timebertt.dev")
        );
        for invalid in ["", "/", "/v1", "apps/", "a/b/c"] {
            assert_eq!(parse_group(invalid), None, "{invalid:?}");
        }
    }

    #[test]
    fn formats_keys() {
        assert_eq!(
            format_key("apps", "Deployment", "bar", "foo"),
            "apps/Deployment/bar/foo"
        );
        assert_eq!(format_key("", "Namespace", "", "x"), "/Namespace//x");
        assert_eq!(format_key("", "", "", ""), "///");
    }

    #[test]
    fn reads_object_meta() {
        let meta = ObjectMeta {
            namespace: Some("ns".into()),
            name: Some("n".into()),
            owner_references: Some(vec![owner("v1", "ConfigMap", "cm", Some(true))]),
            ..ObjectMeta::default()
        };
        let info = ObjectInfo::from_meta("apps", "Deployment", &meta);
        assert_eq!((info.group, info.kind), ("apps", "Deployment"));
        assert_eq!(info.namespace, Some("ns"));
        assert_eq!(info.name, Some("n"));
        assert_eq!(info.owner_references.len(), 1);

        let empty = ObjectMeta::default();
        assert_eq!(ObjectInfo::from_meta("", "", &empty), ObjectInfo::default());
    }
}
