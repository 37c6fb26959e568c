//! Resolves ring resources (plural names) to kinds and scopes through API discovery, with a cache.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use kube::Client;
use kube_sharding_api::GroupResource;

use crate::records;
use crate::views::ResourceInfo;

/// Discovery of resources, cached (a resource that is not served yet is looked up again next
/// time). An entry is forgotten when a request with its version answers 404: a CRD that stopped
/// serving that version, say. The generation counts those, so ring views built with a forgotten
/// entry are rebuilt.
pub(crate) struct Discovery {
    client: Client,
    cache: Mutex<HashMap<GroupResource, ResourceInfo>>,
    generation: AtomicU64,
}

impl std::fmt::Debug for Discovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Discovery").finish_non_exhaustive()
    }
}

impl Discovery {
    /// A discovery cache over `client`.
    pub(crate) fn new(client: Client) -> Self {
        Self {
            client,
            cache: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
        }
    }

    /// Forgets what is known about `gr` (its version is no longer served); the next resolution
    /// asks the API server again.
    pub(crate) fn forget(&self, gr: &GroupResource) {
        let removed = self
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(gr)
            .is_some();
        if removed {
            self.generation.fetch_add(1, Ordering::SeqCst);
            tracing::info!(event = records::EVENT_DISCOVERY_FORGOTTEN, resource = %gr, "forgot a resource's discovered version; it is looked up again");
        }
    }

    /// Increases whenever an entry is forgotten.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Resolves every given resource it can. Resources the server does not serve (yet) are left
    /// out of the result; the error of a failed lookup is logged, not returned, so one missing
    /// CRD never blocks the other resources of a ring.
    pub(crate) async fn resolve<'a>(
        &self,
        resources: impl IntoIterator<Item = &'a GroupResource>,
    ) -> HashMap<GroupResource, ResourceInfo> {
        let mut result = HashMap::new();
        let mut missing: Vec<GroupResource> = Vec::new();
        {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            for gr in resources {
                match cache.get(gr) {
                    Some(info) => {
                        result.insert(gr.clone(), info.clone());
                    }
                    None => missing.push(gr.clone()),
                }
            }
        }
        if missing.is_empty() {
            return result;
        }
        let mut groups: Vec<String> = missing.iter().map(|gr| gr.group.clone()).collect();
        groups.sort_unstable();
        groups.dedup();
        let mut found = HashMap::new();
        for group in groups {
            match self.group_resources(&group).await {
                Ok(list) => found.extend(list),
                Err(error) => {
                    tracing::warn!(event = records::EVENT_DISCOVERY_FAILED, %error, group = %group, "failed to discover resources of API group");
                }
            }
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        for gr in missing {
            if let Some(info) = found.get(&gr) {
                cache.insert(gr.clone(), info.clone());
                result.insert(gr, info.clone());
            }
        }
        result
    }

    /// Every top-level resource of a group at its preferred version.
    async fn group_resources(
        &self,
        group: &str,
    ) -> Result<Vec<(GroupResource, ResourceInfo)>, kube::Error> {
        let (version, list) = if group.is_empty() {
            (
                "v1".to_string(),
                self.client.list_core_api_resources("v1").await?,
            )
        } else {
            let groups = self.client.list_api_groups().await?;
            let Some(preferred) = groups
                .groups
                .iter()
                .find(|g| g.name == group)
                .and_then(|g| g.preferred_version.as_ref().or(g.versions.first()))
            else {
                return Ok(Vec::new());
            };
            let list = self
                .client
                .list_api_group_resources(&preferred.group_version)
                .await?;
            (preferred.version.clone(), list)
        };
        Ok(list
            .resources
            .into_iter()
            .filter(|r| !r.name.contains('/'))
            .map(|r| {
                (
                    GroupResource::new(group, &r.name),
                    ResourceInfo {
                        kind: r.kind,
                        version: version.clone(),
                        namespaced: r.namespaced,
                    },
                )
            })
            .collect())
    }
}
