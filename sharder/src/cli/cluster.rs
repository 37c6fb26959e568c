//! Reading the cluster: the client from kubectl's flags, and every read the commands make, each
//! with the permission it needs named in its error.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, DynamicObject, ListParams, ObjectMeta};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::watcher;
use kube::{Client, Config};
use kube_sharding_api::labels::{GROUP, PIN_ANNOTATION_PREFIX};
use kube_sharding_api::selector::selector_matches;
use kube_sharding_api::{
    ClusterRing, ControllerRing, GroupResource, RingKind, RingObject, RingRef,
};
use serde::Serialize;

use super::ranges::{RingRanges, is_server_side};
use super::{ConnectionArgs, Error};
use crate::core::any_ring::AnyRing;
use crate::core::list_scope::PAGE_SIZE;
use crate::core::membership::{RingShards, ring_shards};
use crate::views::{Pins, ResourceInfo, RingView, build_view};

/// A client and the namespace of the kubeconfig context.
pub(crate) struct Connection {
    /// The API client.
    pub(crate) client: Client,
    /// The context's namespace, `default` without one.
    pub(crate) default_namespace: String,
}

/// Builds the client as kubectl would: `--kubeconfig`, else `KUBECONFIG` or `~/.kube/config`,
/// else (without `--context`) the in-cluster service account; `--as`/`--as-group` impersonate.
pub(crate) async fn connect(args: &ConnectionArgs) -> Result<Connection, Error> {
    let options = KubeConfigOptions {
        context: args.context.clone(),
        cluster: args.cluster.clone(),
        user: args.user.clone(),
    };
    let chosen = args.context.is_some() || args.cluster.is_some() || args.user.is_some();
    let failed = |e: &dyn std::fmt::Display| Error::Kubeconfig(e.to_string());
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .map_err(|e| Error::Kubeconfig(format!("{}: {e}", path.display())))?;
            Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .map_err(|e| failed(&e))?
        }
        None if chosen => Config::from_kubeconfig(&options)
            .await
            .map_err(|e| failed(&e))?,
        None => Config::infer().await.map_err(|e| failed(&e))?,
    };
    if let Some(user) = &args.impersonate {
        config.auth_info.impersonate = Some(user.clone());
    }
    if !args.impersonate_groups.is_empty() {
        config.auth_info.impersonate_groups = Some(args.impersonate_groups.clone());
    }
    let default_namespace = config.default_namespace.clone();
    let client = Client::try_from(config).map_err(|e| failed(&e))?;
    Ok(Connection {
        client,
        default_namespace,
    })
}

/// Turns an API error of the request doing `action` (`list secrets in all namespaces`) into the
/// CLI's error; a 403 names the missing permission.
pub(crate) fn api_error(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let action = action.into();
    move |source| match source {
        kube::Error::Api(status) if status.code == 403 => Error::Forbidden {
            action,
            message: status.message,
        },
        source => Error::Api { action, source },
    }
}

/// Whether `error` is the API server's 404.
fn is_not_found(error: &Error) -> bool {
    matches!(error, Error::Api { source: kube::Error::Api(status), .. } if status.code == 404)
}

/// `in all namespaces` or `in namespace <ns>`, for error messages.
fn scope_words(namespace: Option<&str>) -> String {
    namespace.map_or_else(
        || "in all namespaces".to_string(),
        |ns| format!("in namespace {ns}"),
    )
}

/// The rings of `kinds`, only those named `name` if given, sorted by kind and name. A kind
/// whose CRD is not installed has no rings.
pub(crate) async fn rings(
    client: &Client,
    kinds: &[RingKind],
    name: Option<&str>,
) -> Result<Vec<AnyRing>, Error> {
    let mut rings = Vec::new();
    for kind in kinds {
        match kind {
            RingKind::ClusterRing => rings.extend(
                rings_of::<ClusterRing>(client, name)
                    .await?
                    .into_iter()
                    .map(|r| AnyRing::Cluster(Arc::new(r))),
            ),
            RingKind::ControllerRing => rings.extend(
                rings_of::<ControllerRing>(client, name)
                    .await?
                    .into_iter()
                    .map(|r| AnyRing::Controller(Arc::new(r))),
            ),
        }
    }
    rings.sort_by_key(AnyRing::ring_ref);
    Ok(rings)
}

async fn rings_of<R: RingObject>(client: &Client, name: Option<&str>) -> Result<Vec<R>, Error> {
    let api = Api::<R>::all(client.clone());
    let plural = format!("{}.{GROUP}", R::KIND.plural());
    let found = match name {
        Some(name) => api
            .get_opt(name)
            .await
            .map(|ring| ring.into_iter().collect())
            .map_err(api_error(format!("get {plural}"))),
        None => api
            .list(&ListParams::default())
            .await
            .map(|list| list.items)
            .map_err(api_error(format!("list {plural}"))),
    };
    match found {
        Err(error) if is_not_found(&error) => Ok(Vec::new()),
        found => found,
    }
}

/// The Leases carrying the ring label of `kind` (for ring `ring` only, if given), in every
/// namespace.
pub(crate) async fn leases(
    client: &Client,
    kind: RingKind,
    ring: Option<&str>,
) -> Result<Vec<Lease>, Error> {
    let selector = match ring {
        Some(ring) => format!("{}={ring}", kind.lease_label()),
        None => kind.lease_label().to_string(),
    };
    Api::<Lease>::all(client.clone())
        .list(&ListParams::default().labels(&selector))
        .await
        .map(|list| list.items)
        .map_err(api_error(
            "list leases.coordination.k8s.io in all namespaces",
        ))
}

/// Labels of namespaces by name: of every namespace, or of `only`.
pub(crate) type NamespaceLabels = BTreeMap<String, BTreeMap<String, String>>;

/// The namespaces a command read: their labels, which ring selectors match, and their pins, which
/// placements read (docs/protocol.md §21).
pub(crate) struct Namespaces {
    /// Labels by namespace name.
    pub(crate) labels: NamespaceLabels,
    /// Pins for the views: the namespaces' pin annotations, and no controller pins yet.
    pub(crate) pins: Pins,
    /// The same pin annotations by namespace, for the target ranges of ServerSide rings.
    pub(crate) pin_annotations: BTreeMap<String, BTreeMap<String, String>>,
}

impl Namespaces {
    /// The labels and pin annotations of the namespaces `items`; other annotations are dropped,
    /// as nothing reads them.
    pub(crate) fn from_metadata(items: impl IntoIterator<Item = ObjectMeta>) -> Self {
        let (store, mut writer) = kube::runtime::reflector::store::<Namespace>();
        let mut labels = NamespaceLabels::new();
        let mut pin_annotations = BTreeMap::new();
        for meta in items {
            let Some(name) = meta.name else {
                continue;
            };
            let pins: BTreeMap<String, String> = meta
                .annotations
                .unwrap_or_default()
                .into_iter()
                .filter(|(key, _)| key.starts_with(PIN_ANNOTATION_PREFIX))
                .collect();
            if !pins.is_empty() {
                pin_annotations.insert(name.clone(), pins.clone());
                let namespace = Namespace {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        annotations: Some(pins),
                        ..ObjectMeta::default()
                    },
                    ..Namespace::default()
                };
                writer.apply_watcher_event(&watcher::Event::Apply(namespace));
            }
            labels.insert(name, meta.labels.unwrap_or_default());
        }
        Self {
            labels,
            pins: Pins::new(store),
            pin_annotations,
        }
    }
}

/// The labels and pins of every namespace, or only of namespace `only` (absent when it does not
/// exist).
pub(crate) async fn namespaces(client: &Client, only: Option<&str>) -> Result<Namespaces, Error> {
    let api = Api::<Namespace>::all(client.clone());
    let items = match only {
        Some(name) => api
            .get_metadata_opt(name)
            .await
            .map_err(api_error("get namespaces"))?
            .into_iter()
            .collect(),
        None => {
            api.list_metadata(&ListParams::default())
                .await
                .map_err(api_error("list namespaces"))?
                .items
        }
    };
    Ok(Namespaces::from_metadata(
        items.into_iter().map(|ns| ns.metadata),
    ))
}

/// Where the namespace selector a ring's objects are filtered by comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) enum SelectorSource {
    /// The ring's own `spec.namespaceSelector`.
    Ring,
    /// The sharder's configured default, as it wrote it into the ring's webhook configuration.
    WebhookConfiguration,
    /// The sharder's built-in default: the ring's webhook configuration could not be read.
    SharderDefault,
}

impl SelectorSource {
    /// Words for tables.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::Ring => "the ring's namespaceSelector",
            Self::WebhookConfiguration => "the sharder's default namespace selector",
            Self::SharderDefault => {
                "the sharder's built-in default namespace selector (the ring's webhook configuration could not be read)"
            }
        }
    }
}

/// The namespace selector the sharder applies to `ring`: the ring's own; else the configured
/// default, which the sharder wrote into the ring's webhook configuration; else, when that cannot
/// be read, the sharder's built-in default.
pub(crate) async fn namespace_selector(
    client: &Client,
    ring: &AnyRing,
) -> (LabelSelector, SelectorSource) {
    if let Some(selector) = &ring.spec().namespace_selector {
        return (selector.clone(), SelectorSource::Ring);
    }
    let RingRef { kind, name } = ring.ring_ref();
    let written = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get_opt(&kind.webhook_configuration_name(&name))
        .await
        .ok()
        .flatten()
        .and_then(|config| config.webhooks?.into_iter().next()?.namespace_selector);
    match written {
        Some(selector) => (selector, SelectorSource::WebhookConfiguration),
        None => (
            kube_sharding_api::config::default_namespace_selector(),
            SelectorSource::SharderDefault,
        ),
    }
}

/// The dynamic API resource of `gr`, resolved to `info`.
pub(crate) fn api_resource(gr: &GroupResource, info: &ResourceInfo) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(&gr.group, &info.version, &info.kind),
        &gr.resource,
    )
}

/// Lists the objects of `gr` metadata-only, in pages of the sharder's size, and hands each to
/// `observe`. With `namespace`, only that namespace's objects (a cluster-scoped resource has
/// none there).
pub(crate) async fn for_each_object(
    client: &Client,
    gr: &GroupResource,
    info: &ResourceInfo,
    namespace: Option<&str>,
    mut observe: impl FnMut(&ObjectMeta),
) -> Result<(), Error> {
    let ar = api_resource(gr, info);
    let api: Api<DynamicObject> = match namespace {
        Some(_) if !info.namespaced => return Ok(()),
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let mut params = ListParams::default().limit(PAGE_SIZE);
    loop {
        let page = api
            .list_metadata(&params)
            .await
            .map_err(api_error(format!("list {gr} {}", scope_words(namespace))))?;
        for object in &page.items {
            observe(&object.metadata);
        }
        match page.metadata.continue_.filter(|token| !token.is_empty()) {
            Some(token) => params.continue_token = Some(token),
            None => return Ok(()),
        }
    }
}

/// The metadata of object `name` of `gr` (in `namespace` when namespaced), `None` when absent.
pub(crate) async fn object(
    client: &Client,
    gr: &GroupResource,
    info: &ResourceInfo,
    namespace: &str,
    name: &str,
) -> Result<Option<ObjectMeta>, Error> {
    let ar = api_resource(gr, info);
    let (api, scope): (Api<DynamicObject>, _) = if info.namespaced {
        (
            Api::namespaced_with(client.clone(), namespace, &ar),
            format!(" in namespace {namespace}"),
        )
    } else {
        (Api::all_with(client.clone(), &ar), String::new())
    };
    Ok(api
        .get_metadata_opt(name)
        .await
        .map_err(api_error(format!("get {gr}{scope}")))?
        .map(|object| object.metadata))
}

/// A ring with what the commands need beside it: its Leases, its view as the sharder builds it,
/// and where its namespace selector comes from.
pub(crate) struct LoadedRing {
    /// The ring.
    pub(crate) ring: AnyRing,
    /// The Leases carrying its ring label.
    pub(crate) leases: Vec<Lease>,
    /// Its view: resources, hash ring of the available shards, label keys, namespace selector.
    pub(crate) view: RingView,
    /// Where the view's namespace selector comes from.
    pub(crate) selector_source: SelectorSource,
    /// Why the sharder does not act on the ring, if it does not.
    pub(crate) invalid: Option<String>,
    /// For a ServerSide ring: its published and target ranges, set by [`give_pins`].
    pub(crate) ranges: Option<RingRanges>,
}

/// Loads the Leases of every ring and builds its view from them and the served resources
/// `infos`, exactly as the sharder does; [`give_pins`] adds the namespaces' pins.
pub(crate) async fn load_rings(
    client: &Client,
    rings: Vec<AnyRing>,
    infos: &HashMap<GroupResource, ResourceInfo>,
) -> Result<Vec<LoadedRing>, Error> {
    let mut loaded = Vec::with_capacity(rings.len());
    for ring in rings {
        let RingRef { kind, name } = ring.ring_ref();
        let leases = leases(client, kind, Some(&name)).await?;
        let RingShards {
            available: shards,
            excluded_held,
            leave_controlled_objects,
        } = ring_shards(kind, &name, &ring.spec().lease_namespaces, &leases);
        let (selector, selector_source) = namespace_selector(client, &ring).await;
        let mut view = match &ring {
            AnyRing::Cluster(r) => build_view(r.as_ref(), &shards, infos, &selector),
            AnyRing::Controller(r) => build_view(r.as_ref(), &shards, infos, &selector),
        };
        view.excluded_held = excluded_held;
        view.shards_leave_controlled_objects = leave_controlled_objects;
        loaded.push(LoadedRing {
            // The plugin cannot read the sharder's configuration: a ring over a protected
            // resource shows as refused, as the default configuration refuses it.
            invalid: ring.validate(&[]).err().map(|invalid| invalid.to_string()),
            ring,
            leases,
            view,
            selector_source,
            ranges: None,
        });
    }
    Ok(loaded)
}

/// Lets the views of `loaded` read the namespace pins of `namespaces`, and computes the ranges of
/// ServerSide rings with them. Namespaces are read after the rings' Leases, so a user without
/// either permission is told about the Leases first.
pub(crate) fn give_pins(loaded: &mut [LoadedRing], namespaces: &Namespaces) {
    for ring in loaded {
        ring.view.pins = namespaces.pins.clone();
        if is_server_side(ring) {
            ring.ranges = Some(RingRanges::new(ring, &namespaces.pin_annotations));
        }
    }
}

/// Whether an object in `namespace` (`None` for cluster-scoped objects) belongs to the ring of
/// `view`, by the sharder's rule: cluster-scoped objects always, namespaced ones when their
/// namespace exists and the ring's selector matches its labels.
pub(crate) fn covers(
    view: &RingView,
    namespace: Option<&str>,
    namespaces: &NamespaceLabels,
) -> bool {
    match namespace.filter(|ns| !ns.is_empty()) {
        None => true,
        Some(ns) => namespaces
            .get(ns)
            .is_some_and(|labels| selector_matches(&view.namespace_selector, labels)),
    }
}

/// Lists the objects of every resource of the rings once (only in `namespace`, if given) and hands
/// each object to `observe` for every ring covering it, with the ring's index and the resource.
/// Resources come in [`walk_order`], so that placements see controllers' pins before their
/// controlled objects, as the sharder's sync does.
pub(crate) async fn walk_objects(
    client: &Client,
    rings: &[LoadedRing],
    namespace: Option<&str>,
    namespaces: &NamespaceLabels,
    mut observe: impl FnMut(usize, &GroupResource, &ObjectMeta),
) -> Result<(), Error> {
    for (gr, info) in walk_order(rings) {
        for_each_object(client, &gr, &info, namespace, |meta| {
            for (index, ring) in rings.iter().enumerate() {
                if ring.view.resources.contains_key(&gr)
                    && covers(&ring.view, meta.namespace.as_deref(), namespaces)
                {
                    observe(index, &gr, meta);
                }
            }
        })
        .await?;
    }
    Ok(())
}

/// Every resource of the rings once: those that are main in some ring and controlled in none
/// first, then those main in one ring and controlled in another, then the rest, each by group
/// and name. A placement remembers a main object's pin for its controlled objects
/// ([`RingView::placement`]), so each ring's main resources must come before its controlled ones;
/// only a ring whose main and controlled resources are both of the middle kind can see a
/// controlled object first, and then places it as a sharder replica that has not seen its
/// controller would.
pub(crate) fn walk_order(rings: &[LoadedRing]) -> Vec<(GroupResource, ResourceInfo)> {
    // Per resource: (controlled in some ring, main in none), its info.
    let mut resources: BTreeMap<&GroupResource, (bool, bool, &ResourceInfo)> = BTreeMap::new();
    for ring in rings {
        for (gr, resource) in &ring.view.resources {
            let entry = resources.entry(gr).or_insert((false, true, &resource.info));
            entry.0 |= !resource.is_main();
            entry.1 &= !resource.is_main();
        }
    }
    let mut order: Vec<_> = resources.into_iter().collect();
    order.sort_by_key(|(gr, (controlled, not_main, _))| {
        (
            *controlled,
            *not_main,
            gr.group.as_str(),
            gr.resource.as_str(),
        )
    });
    order
        .into_iter()
        .map(|(gr, (_, _, info))| (gr.clone(), info.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{lease, loaded};
    use super::*;
    use kube_sharding_api::{ClusterRingSpec, RingResource};

    #[test]
    fn namespaces_keep_labels_and_pins_only() {
        let meta = ObjectMeta {
            name: Some("team-a".into()),
            labels: Some([("team".to_string(), "a".to_string())].into()),
            annotations: Some(
                [
                    (format!("{PIN_ANNOTATION_PREFIX}r"), "shard-a".to_string()),
                    ("other.example/note".to_string(), "x".to_string()),
                ]
                .into(),
            ),
            ..ObjectMeta::default()
        };
        let plain = ObjectMeta {
            name: Some("team-b".into()),
            ..ObjectMeta::default()
        };
        let namespaces = Namespaces::from_metadata([meta, plain]);
        assert_eq!(
            namespaces.labels,
            NamespaceLabels::from([
                (
                    "team-a".to_string(),
                    [("team".to_string(), "a".to_string())].into()
                ),
                ("team-b".to_string(), BTreeMap::new()),
            ])
        );
        let pin = |ns: &str, key: &str| namespaces.pins.namespace(ns, key);
        assert_eq!(
            pin("team-a", &format!("{PIN_ANNOTATION_PREFIX}r")).as_deref(),
            Some("shard-a")
        );
        assert_eq!(pin("team-a", "other.example/note"), None);
        assert_eq!(pin("team-b", &format!("{PIN_ANNOTATION_PREFIX}r")), None);
    }

    /// Each ring's main resources come before its controlled ones, so that a placement has seen a
    /// controller's pin when it places the objects it controls.
    #[test]
    fn main_resources_are_walked_before_controlled_ones() {
        let secrets_ring = loaded(vec![lease("a", "a", 1, None)]);
        // A second ring where ConfigMaps are main and control Pods.
        let ring = ClusterRing::new(
            "other",
            ClusterRingSpec {
                resources: vec![RingResource::controlling(
                    "",
                    "configmaps",
                    vec![GroupResource::new("", "pods")],
                )],
                ..ClusterRingSpec::default()
            },
        );
        let info = |kind: &str| ResourceInfo {
            kind: kind.into(),
            version: "v1".into(),
            namespaced: true,
        };
        let infos = HashMap::from([
            (GroupResource::new("", "configmaps"), info("ConfigMap")),
            (GroupResource::new("", "pods"), info("Pod")),
        ]);
        let mut configmaps_ring = loaded(Vec::new());
        configmaps_ring.view =
            build_view(&ring, &BTreeMap::new(), &infos, &LabelSelector::default());
        let order = |rings: &[LoadedRing]| -> Vec<String> {
            walk_order(rings)
                .into_iter()
                .map(|(gr, _)| gr.resource)
                .collect()
        };
        assert_eq!(order(&[secrets_ring]), ["secrets", "configmaps"]);
        let both = [loaded(vec![lease("a", "a", 1, None)]), configmaps_ring];
        assert_eq!(order(&both), ["secrets", "configmaps", "pods"]);
    }
}
