//! Where a new controlled object's controller sits while its ring changes: the webhook and the
//! sharder's own assignment (a ring with `assignment: Watch`) both label such a child with its
//! controller's current shard rather than the one the ring wants now (docs/protocol.md §9).
//!
//! The owner reference comes from the admission request, which whoever reaches the webhook port
//! can write: its name, version and namespace go into a URL the sharder GETs with its own
//! identity. So each must be what the API server would accept in an object, or there is no
//! lookup, and at most [`MAX_LOOKUPS_IN_FLIGHT`] lookups run at once.

use kube::api::{Api, ApiResource, DynamicObject};
use kube_sharding_api::RingRef;
use kube_sharding_api::labels::is_dns_subdomain;

use super::registry::Views;
use super::view::RingView;
use crate::core::key::{ObjectInfo, ResourceRole};

/// How long a reader waits for a controller's labels before it follows the ring: well within
/// the 5 s the API server gives the webhook.
const CONTROLLER_LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Most controller lookups in flight per process; a lookup that finds none free within its
/// timeout follows the ring. Unauthenticated callers cannot make the sharder issue more GETs.
pub(crate) const MAX_LOOKUPS_IN_FLIGHT: usize = 8;

/// Whether `value` is a DNS label (RFC 1123): what namespace names are.
fn is_dns_label(value: &str) -> bool {
    value.len() <= 63 && !value.contains('.') && is_dns_subdomain(value)
}

/// Whether `version` can be an API version: a DNS label starting with a letter (RFC 1035), as
/// Kubernetes requires of the versions of a CRD.
fn is_api_version(version: &str) -> bool {
    version.starts_with(|c: char| c.is_ascii_lowercase()) && is_dns_label(version)
}

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
    /// its kind is a main resource of this ring and its name, version and namespace are valid
    /// (anything else names no object the API server could store, so there is nothing to read).
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
        if !is_api_version(version) || !is_dns_subdomain(&owner.name) {
            return None;
        }
        let namespace = if resolved.info.namespaced {
            Some(child.namespace.filter(|ns| is_dns_label(ns))?.to_string())
        } else {
            None
        };
        let resource = ApiResource {
            group: group.to_string(),
            version: version.to_string(),
            api_version: owner.api_version.clone(),
            kind: owner.kind.clone(),
            plural: main.resource.clone(),
        };
        Some(ControllerLookup {
            resource,
            namespace,
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
    // Waiting for a free slot counts against the same timeout.
    let read = tokio::time::timeout(CONTROLLER_LOOKUP_TIMEOUT, async {
        let _permit = views.lookups.acquire().await;
        api.get_metadata_opt(&lookup.name).await
    })
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

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use axum::http::{Request, Response};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use kube::client::Body;
    use kube_sharding_api::GroupResource;

    use super::*;
    use crate::views::{ResourceInfo, build_view};

    /// A ring of Secrets controlling ConfigMaps, on shards a and b.
    fn view() -> RingView {
        let ring = crate::test_rings::secrets_ring("example");
        let info = ResourceInfo::core_namespaced;
        let discovered = HashMap::from([
            (GroupResource::new("", "secrets"), info("Secret")),
            (GroupResource::new("", "configmaps"), info("ConfigMap")),
        ]);
        let shards = BTreeMap::from([("shard-a".to_string(), 1), ("shard-b".to_string(), 1)]);
        build_view(&ring, &shards, &discovered, &Default::default())
    }

    fn lookup(
        view: &RingView,
        api_version: &str,
        name: &str,
        ns: &str,
    ) -> Option<ControllerLookup> {
        let owner = OwnerReference {
            api_version: api_version.into(),
            kind: "Secret".into(),
            name: name.into(),
            uid: "u".into(),
            controller: Some(true),
            ..Default::default()
        };
        view.controller_lookup(&ObjectInfo {
            group: "",
            kind: "ConfigMap",
            namespace: Some(ns),
            name: Some("child"),
            owner_references: std::slice::from_ref(&owner),
        })
    }

    #[test]
    fn only_names_versions_and_namespaces_an_object_can_have_are_looked_up() {
        let view = view();
        let found = lookup(&view, "v1", "parent.example-1", "team-a").expect("a lookup");
        assert_eq!(found.name, "parent.example-1");
        assert_eq!(found.namespace.as_deref(), Some("team-a"));
        assert_eq!(found.resource.version, "v1");
        for (version, name, ns) in [
            ("v1", "../../secrets", "team-a"),
            ("v1", "a?watch=true", "team-a"),
            ("v1", "a/b", "team-a"),
            ("v1", "Parent", "team-a"),
            ("v1", "", "team-a"),
            ("v1", &"a".repeat(254), "team-a"),
            ("v1/..", "parent", "team-a"),
            ("..", "parent", "team-a"),
            ("1v", "parent", "team-a"),
            ("v1?x=y", "parent", "team-a"),
            ("v1", "parent", "../kube-system"),
            ("v1", "parent", "a.b"),
            ("v1", "parent", ""),
        ] {
            assert!(
                lookup(&view, version, name, ns).is_none(),
                "{version:?} {name:?} {ns:?}"
            );
        }
    }

    /// A client whose API server answers every GET with a Secret labelled for shard-a, after
    /// `delay`; it counts the requests and the most in flight at once.
    fn client(
        delay: std::time::Duration,
    ) -> (kube::Client, Arc<Mutex<Vec<String>>>, Arc<AtomicUsize>) {
        let paths = Arc::new(Mutex::new(Vec::new()));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let seen = paths.clone();
        let peak = most.clone();
        let service = tower::service_fn(move |request: Request<Body>| {
            seen.lock()
                .expect("paths")
                .push(request.uri().path().to_string());
            let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            let in_flight = in_flight.clone();
            async move {
                tokio::time::sleep(delay).await;
                in_flight.fetch_sub(1, Ordering::SeqCst);
                let body = serde_json::json!({
                    "apiVersion": "meta.k8s.io/v1",
                    "kind": "PartialObjectMetadata",
                    "metadata": {"name": "parent", "namespace": "team-a", "labels": {
                        kube_sharding_api::labels::shard_label("example"): "shard-a",
                    }},
                });
                Response::builder()
                    .status(200)
                    .body(Body::from(serde_json::to_vec(&body).expect("json")))
            }
        });
        (kube::Client::new(service, "default"), paths, most)
    }

    #[tokio::test]
    async fn lookups_read_the_controller_and_run_at_most_eight_at_once() {
        let views = Arc::new(Views::default());
        views.insert(view());
        let ring = RingRef::new(kube_sharding_api::RingKind::ClusterRing, "example");
        let view = views.get(&ring).expect("the view");
        let found = lookup(&view, "v1", "parent", "team-a").expect("a lookup");
        let (client, paths, most) = client(std::time::Duration::from_millis(50));
        let shard = controller_shard(client.clone(), &views, &ring, &found).await;
        assert_eq!(shard.as_deref(), Some("shard-a"));
        assert_eq!(
            *paths.lock().expect("paths"),
            ["/api/v1/namespaces/team-a/secrets/parent"]
        );
        let lookups = (0..40).map(|_| controller_shard(client.clone(), &views, &ring, &found));
        let shards = futures::future::join_all(lookups).await;
        assert!(shards.iter().all(|s| s.as_deref() == Some("shard-a")));
        assert_eq!(most.load(Ordering::SeqCst), MAX_LOOKUPS_IN_FLIGHT);
    }
}
