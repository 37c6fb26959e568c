//! API discovery for the CLI: every resource the server serves at its preferred version, and
//! resource names resolved the way kubectl resolves them.
//!
//! The sharder resolves a ring's resources to the same kind, version and scope (preferred
//! version, top-level resources only), so views built from this catalog equal the sharder's.

use std::collections::HashMap;

use kube::Client;
use kube_sharding_api::GroupResource;

use super::Error;
use super::cluster::api_error;
use crate::views::ResourceInfo;

/// One resource served by the API server, at its preferred version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ApiEntry {
    /// Group and plural name.
    pub(crate) resource: GroupResource,
    /// Kind, preferred version and scope.
    pub(crate) info: ResourceInfo,
    /// Singular name, lowercase; empty when the server does not say.
    pub(crate) singular: String,
    /// Short names, e.g. `cm`.
    pub(crate) short_names: Vec<String>,
}

impl ApiEntry {
    /// Whether kubectl would take `name` (lowercase, without a group) for this resource: its
    /// plural, singular, kind or a short name.
    fn is_named(&self, name: &str) -> bool {
        self.resource.resource == name
            || self.singular == name
            || self.info.kind.eq_ignore_ascii_case(name)
            || self.short_names.iter().any(|short| short == name)
    }
}

/// Every resource the API server serves: core resources first, then the groups in the server's
/// order of preference.
#[derive(Debug, Default)]
pub(crate) struct Catalog {
    entries: Vec<ApiEntry>,
}

impl Catalog {
    /// Discovers every served resource with aggregated discovery (two requests; Kubernetes 1.27
    /// and newer serve it by default).
    pub(crate) async fn discover(client: &Client) -> Result<Self, Error> {
        let core = client
            .list_core_api_versions_aggregated()
            .await
            .map_err(api_error("get the API discovery document /api"))?;
        let groups = client
            .list_api_groups_aggregated()
            .await
            .map_err(api_error("get the API discovery document /apis"))?;
        if core.items.is_empty() {
            return Err(Error::Usage(
                "the API server does not serve aggregated discovery (Kubernetes 1.27 or newer does)"
                    .into(),
            ));
        }
        let mut entries = Vec::new();
        for group in core.items.into_iter().chain(groups.items) {
            let name = group.metadata.and_then(|m| m.name).unwrap_or_default();
            // Versions are listed in order of preference; the sharder uses the preferred one.
            let Some(preferred) = group.versions.into_iter().next() else {
                continue;
            };
            let version = preferred.version.unwrap_or_default();
            for resource in preferred.resources {
                let (Some(plural), Some(kind)) = (
                    resource.resource,
                    resource.response_kind.and_then(|gvk| gvk.kind),
                ) else {
                    continue;
                };
                entries.push(ApiEntry {
                    resource: GroupResource::new(&name, plural),
                    info: ResourceInfo {
                        kind,
                        version: version.clone(),
                        namespaced: resource.scope.as_deref() == Some("Namespaced"),
                    },
                    singular: resource.singular_resource.unwrap_or_default(),
                    short_names: resource.short_names,
                });
            }
        }
        Ok(Self { entries })
    }

    /// Kind, version and scope of every served resource, as `build_view` takes them.
    pub(crate) fn infos(&self) -> HashMap<GroupResource, ResourceInfo> {
        self.entries
            .iter()
            .map(|e| (e.resource.clone(), e.info.clone()))
            .collect()
    }

    /// The resource `name` stands for, as kubectl resolves it: plural, singular, kind or short
    /// name, case-insensitive, optionally qualified as `resource.group` or
    /// `resource.version.group` (the version only selects the group; answers use the preferred
    /// version). Where several groups match, the core group wins, then the server's order.
    pub(crate) fn resolve(&self, name: &str) -> Result<&ApiEntry, Error> {
        let wanted = name.to_ascii_lowercase();
        let unknown = || Error::UnknownResource(name.to_string());
        let find = |resource: &str, group: Option<&str>| {
            let in_group = |e: &&ApiEntry| group.is_none_or(|g| e.resource.group == g);
            // Names proper beat short names, as in kubectl.
            self.entries
                .iter()
                .filter(in_group)
                .find(|e| e.is_named(resource) && !e.short_names.iter().any(|s| s == resource))
                .or_else(|| {
                    self.entries
                        .iter()
                        .filter(in_group)
                        .find(|e| e.is_named(resource))
                })
        };
        let Some((resource, qualifier)) = wanted.split_once('.') else {
            return find(&wanted, None).ok_or_else(unknown);
        };
        find(resource, Some(qualifier))
            .or_else(|| {
                let (_version, group) = qualifier.split_once('.')?;
                find(resource, Some(group))
            })
            .ok_or_else(unknown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(group: &str, plural: &str, kind: &str, short: &[&str]) -> ApiEntry {
        ApiEntry {
            resource: GroupResource::new(group, plural),
            info: ResourceInfo {
                kind: kind.into(),
                version: "v1".into(),
                namespaced: true,
            },
            singular: kind.to_ascii_lowercase(),
            short_names: short.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn catalog() -> Catalog {
        Catalog {
            entries: vec![
                entry("", "secrets", "Secret", &[]),
                entry("", "configmaps", "ConfigMap", &["cm"]),
                entry("", "events", "Event", &["ev"]),
                entry("apps", "deployments", "Deployment", &["deploy"]),
                entry("events.k8s.io", "events", "Event", &["ev"]),
                entry("example.com", "widgets", "Widget", &["secret"]),
            ],
        }
    }

    fn resolved(name: &str) -> String {
        match catalog().resolve(name) {
            Ok(e) => e.resource.to_string(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn resolves_like_kubectl() {
        // Plural, singular, kind in any case, short name.
        assert_eq!(resolved("secrets"), "secrets");
        assert_eq!(resolved("secret"), "secrets");
        assert_eq!(resolved("Secret"), "secrets");
        assert_eq!(resolved("cm"), "configmaps");
        assert_eq!(resolved("deploy"), "deployments.apps");
        assert_eq!(resolved("ConfigMap"), "configmaps");
        // Qualified by group, or by version and group.
        assert_eq!(resolved("deployments.apps"), "deployments.apps");
        assert_eq!(resolved("deployment.v1.apps"), "deployments.apps");
        assert_eq!(resolved("events.events.k8s.io"), "events.events.k8s.io");
        // The core group wins over later groups with the same name.
        assert_eq!(resolved("events"), "events");
        assert_eq!(resolved("ev"), "events");
        // A resource's name beats another resource's short name.
        assert_eq!(resolved("secret"), "secrets");
        assert_eq!(resolved("widgets.example.com"), "widgets.example.com");
    }

    #[test]
    fn unknown_names_say_so_as_kubectl_does() {
        assert_eq!(
            resolved("gadgets"),
            "the server doesn't have a resource type \"gadgets\""
        );
        assert_eq!(
            resolved("deployments.batch"),
            "the server doesn't have a resource type \"deployments.batch\""
        );
    }

    #[test]
    fn infos_feed_ring_views() {
        let infos = catalog().infos();
        assert_eq!(
            infos[&GroupResource::new("apps", "deployments")].kind,
            "Deployment"
        );
        assert_eq!(infos.len(), 6);
    }
}
