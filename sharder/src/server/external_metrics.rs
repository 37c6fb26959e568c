//! The external metrics API (`external.metrics.k8s.io/v1beta1`, docs/autoscaling.md): the load
//! a ring's shards report on their Leases (docs/protocol.md §23), summed per ring, for a
//! HorizontalPodAutoscaler of type `External` to scale the shards on.
//!
//! Served on the webhook's HTTPS server, which every replica runs, from the Lease cache every
//! replica keeps: any replica behind the Service answers the same. The API server's aggregation
//! layer calls it as an aggregated API (an APIService), so requests are authenticated as any
//! aggregated API's are: the aggregator's front-proxy client certificate, then the user it names
//! in headers (`front_proxy`); each metric read is authorized with a SubjectAccessReview for that
//! user (verb `list`, group `external.metrics.k8s.io`, the metric as resource, the namespace of
//! the path), cached like the metrics endpoint's. Discovery needs authentication only, as the API
//! server's own discovery does for every authenticated user. No bearer tokens: only the
//! aggregator calls.
//!
//! | metric | value |
//! |---|---|
//! | `sharding-ring-objects` | objects held by the ring's available shards, summed (`metrics::load`) |
//! | `sharding-ring-queue-depth` | objects waiting in their work queues, summed |
//! | `sharding-ring-p99-milliseconds` | the highest p99 reconcile duration among them |
//!
//! The ring is chosen by the label selector: `clusterring=<name>` or `controllerring=<name>`
//! (rings are cluster-scoped; the path's namespace only scopes the authorization). Without one:
//! 400; an unknown ring or metric: 404; a ring none of whose available shards reports the signal:
//! 503, so an HPA keeps its scale rather than read 0 and scale in.

mod front_proxy;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Extension, Path, RawQuery, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use k8s_openapi::api::authorization::v1::ResourceAttributes;
use kube_sharding_api::{RingKind, RingRef};

use self::front_proxy::FrontProxy;
use super::PeerCertificates;
use super::metrics_auth::cache::ExpiringCache;
use super::metrics_auth::{Attributes, Lane, MAX_ENTRIES, REVIEW_TIMEOUT, User, access_review};
use crate::metrics::StateSource;
use crate::metrics::load::{RingLoad, ring_load};
use crate::records;

/// The API group.
pub(crate) const GROUP: &str = "external.metrics.k8s.io";

/// The version served.
pub(crate) const VERSION: &str = "v1beta1";

/// Path of the group version.
const GROUP_VERSION_PATH: &str = "/apis/external.metrics.k8s.io/v1beta1";

/// A signal of the ring's load, served as one metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RingMetric {
    /// Objects held, summed over the shards: with `target.type: AverageValue` the HPA divides
    /// it by the current replicas, so its target is objects per shard.
    Objects,
    /// Queue depth, summed over the shards.
    QueueDepth,
    /// The highest p99 reconcile duration of a shard, in milliseconds.
    P99Milliseconds,
}

impl RingMetric {
    /// Every metric, in discovery's order.
    pub(crate) const ALL: [Self; 3] = [Self::Objects, Self::QueueDepth, Self::P99Milliseconds];

    /// The metric's name: the resource in the path.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Self::Objects => "sharding-ring-objects",
            Self::QueueDepth => "sharding-ring-queue-depth",
            Self::P99Milliseconds => "sharding-ring-p99-milliseconds",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// The metric's value for a ring's load, `None` when none of its available shards reports
    /// (the latency: reports it).
    pub(crate) fn value(self, load: &RingLoad) -> Option<u64> {
        if load.reporting_shards == 0 {
            return None;
        }
        match self {
            Self::Objects => Some(load.objects),
            Self::QueueDepth => Some(load.queue_depth),
            Self::P99Milliseconds => load.max_p99_ms,
        }
    }
}

/// The ring a label selector names: exactly one requirement `clusterring=<name>` or
/// `controllerring=<name>` (also as `==` or `in (<name>)`, how an HPA's `matchExpressions`
/// arrive).
pub(crate) fn ring_of_selector(selector: &str) -> Result<RingRef, String> {
    let selector = selector.trim();
    let requirement = |text: &str| -> Option<(String, String)> {
        let text = text.trim();
        if let Some((key, value)) = text.split_once("==").or_else(|| text.split_once('=')) {
            return Some((key.trim().to_owned(), value.trim().to_owned()));
        }
        let (key, values) = text.split_once(" in ")?;
        let value = values.trim().strip_prefix('(')?.strip_suffix(')')?.trim();
        (!value.contains(',')).then(|| (key.trim().to_owned(), value.to_owned()))
    };
    let parts = if selector.contains('(') {
        // `in (a)`: no comma inside, so one requirement only.
        vec![selector]
    } else {
        selector.split(',').collect()
    };
    let [part] = parts[..] else {
        return Err("the label selector must name exactly one ring".into());
    };
    let (key, value) = requirement(part).ok_or_else(|| {
        "the label selector must be clusterring=<name> or controllerring=<name>".to_owned()
    })?;
    let kind = RingKind::ALL
        .into_iter()
        .find(|k| k.metric_label() == key)
        .ok_or_else(|| {
            "the label selector must be clusterring=<name> or controllerring=<name>".to_owned()
        })?;
    if value.is_empty() || value.len() > 253 {
        return Err("the ring name must have 1 to 253 characters".into());
    }
    Ok(RingRef::new(kind, value))
}

/// The first value of parameter `name` in the query string `query`, decoded (`+` is a space).
fn query_parameter(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (key == name).then(|| front_proxy::percent_decode(&value.replace('+', " ")))
    })
}

/// What the API serves from and how it checks its callers (not `Debug`: kube's `Client` is not).
pub(crate) struct ExternalMetrics {
    source: Arc<dyn StateSource>,
    front_proxy: FrontProxy,
    reviews: Lane,
    /// (user, namespace, metric) → whether the user may read it.
    access: Mutex<ExpiringCache<(User, String, &'static str), bool>>,
}

impl ExternalMetrics {
    /// Metrics of `source`; the request-header settings are read and SubjectAccessReviews created
    /// through `client`.
    pub(crate) fn new(source: Arc<dyn StateSource>, client: kube::Client) -> Self {
        Self {
            source,
            front_proxy: FrontProxy::new(client.clone()),
            reviews: Lane::new(client, REVIEW_TIMEOUT),
            access: Mutex::new(ExpiringCache::new(MAX_ENTRIES)),
        }
    }

    /// Whether `user` may `list` `metric` in `namespace` of the external metrics API.
    async fn authorize(
        &self,
        user: &User,
        namespace: &str,
        metric: RingMetric,
    ) -> Result<bool, super::metrics_auth::ReviewError> {
        let key = (user.clone(), namespace.to_owned(), metric.name());
        let attributes = Attributes::Resource(Box::new(ResourceAttributes {
            group: Some(GROUP.into()),
            version: Some(VERSION.into()),
            resource: Some(metric.name().into()),
            namespace: Some(namespace.into()),
            verb: Some("list".into()),
            ..ResourceAttributes::default()
        }));
        access_review(&self.reviews, &self.access, key, user, attributes).await
    }
}

/// The routes of the external metrics API, to merge into the webhook's router.
pub(crate) fn external_metrics_router(metrics: Arc<ExternalMetrics>) -> Router {
    Router::new()
        .route("/apis", get(group_list))
        .route("/apis/external.metrics.k8s.io", get(group))
        .route(GROUP_VERSION_PATH, get(resource_list))
        .route(
            "/apis/external.metrics.k8s.io/v1beta1/namespaces/{namespace}/{metric}",
            get(metric_value),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            metrics.clone(),
            authenticate,
        ))
        // The aggregation layer downloads every aggregated API's OpenAPI document (and logs an
        // error every minute when there is none); ours describes no schema, which is all an
        // HPA needs. Static, so served without authentication.
        .route("/openapi/v2", get(openapi_v2))
        .with_state(metrics)
}

async fn openapi_v2() -> Response {
    json(
        StatusCode::OK,
        &serde_json::json!({
            "swagger": "2.0",
            "info": {"title": "controller-sharding external metrics", "version": VERSION},
            "paths": {},
        }),
    )
}

/// Middleware: passes on requests of an authenticated front-proxy user (in the extensions),
/// and answers 401 to anyone else.
async fn authenticate(
    State(metrics): State<Arc<ExternalMetrics>>,
    certificates: Option<Extension<PeerCertificates>>,
    mut request: Request,
    next: Next,
) -> Response {
    let Some(Extension(PeerCertificates(certificates))) = certificates else {
        return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
    };
    if certificates.is_empty() {
        return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
    }
    let config = match metrics.front_proxy.config().await {
        Ok(config) => config,
        Err(_) => {
            return status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "authentication unavailable",
            );
        }
    };
    match config.authenticate(&certificates, request.headers()) {
        Some(user) => {
            request.extensions_mut().insert(user);
            next.run(request).await
        }
        None => status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized"),
    }
}

/// A `Status` answer, as Kubernetes clients expect from an API.
fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    json(
        code,
        &serde_json::json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code.as_u16(),
        }),
    )
}

fn json(code: StatusCode, value: &serde_json::Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

fn group_document() -> serde_json::Value {
    let version = serde_json::json!({
        "groupVersion": format!("{GROUP}/{VERSION}"),
        "version": VERSION,
    });
    serde_json::json!({
        "name": GROUP,
        "versions": [version.clone()],
        "preferredVersion": version,
    })
}

async fn group_list() -> Response {
    let mut group = group_document();
    group["kind"] = "APIGroup".into();
    json(
        StatusCode::OK,
        &serde_json::json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group]}),
    )
}

async fn group() -> Response {
    let mut group = group_document();
    group["kind"] = "APIGroup".into();
    group["apiVersion"] = "v1".into();
    json(StatusCode::OK, &group)
}

async fn resource_list() -> Response {
    let resources: Vec<_> = RingMetric::ALL
        .iter()
        .map(|m| {
            serde_json::json!({
                "name": m.name(),
                "singularName": "",
                "namespaced": true,
                "kind": "ExternalMetricValueList",
                "verbs": ["get"],
            })
        })
        .collect();
    json(
        StatusCode::OK,
        &serde_json::json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": format!("{GROUP}/{VERSION}"),
            "resources": resources,
        }),
    )
}

/// `GET .../namespaces/{namespace}/{metric}?labelSelector=...`: the metric of the selected ring.
async fn metric_value(
    State(metrics): State<Arc<ExternalMetrics>>,
    Extension(user): Extension<User>,
    Path((namespace, metric)): Path<(String, String)>,
    RawQuery(query): RawQuery,
) -> Response {
    let Some(metric) = RingMetric::from_name(&metric) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "no such metric: the metrics are sharding-ring-objects, sharding-ring-queue-depth and sharding-ring-p99-milliseconds",
        );
    };
    if namespace.is_empty() || namespace.len() > 63 {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid namespace");
    }
    match metrics.authorize(&user, &namespace, metric).await {
        Ok(true) => {}
        Ok(false) => {
            return status(
                StatusCode::FORBIDDEN,
                "Forbidden",
                &format!(
                    "user {:?} cannot list resource {:?} in API group {GROUP:?} in the namespace {namespace:?}",
                    user.name,
                    metric.name()
                ),
            );
        }
        Err(error) => {
            tracing::warn!(event = records::EVENT_EXTERNAL_METRICS_AUTHORIZATION_FAILED, error = %format!("{error:#}"), "failed to authorize an external metrics request");
            return status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "authorization unavailable",
            );
        }
    }
    let selector = query_parameter(query.as_deref().unwrap_or_default(), "labelSelector");
    let ring = match ring_of_selector(selector.as_deref().unwrap_or_default()) {
        Ok(ring) => ring,
        Err(message) => return status(StatusCode::BAD_REQUEST, "BadRequest", &message),
    };
    let source = metrics.source.clone();
    // The snapshot walks every Lease of the cache: off the async workers.
    let (known, load) = tokio::task::spawn_blocking({
        let ring = ring.clone();
        move || {
            let known = source.rings().iter().any(|r| r.ring == ring);
            (known, ring_load(&source.shards(), &ring))
        }
    })
    .await
    .unwrap_or_default();
    if !known {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{} {:?} not found", ring.kind.kind(), ring.name),
        );
    }
    let Some(value) = metric.value(&load) else {
        return status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            &format!(
                "no available shard of {} {:?} reports {}: not answering 0, which would scale in",
                ring.kind.kind(),
                ring.name,
                metric.name()
            ),
        );
    };
    let labels = BTreeMap::from([(ring.kind.metric_label(), ring.name.clone())]);
    json(
        StatusCode::OK,
        &serde_json::json!({
            "kind": "ExternalMetricValueList",
            "apiVersion": format!("{GROUP}/{VERSION}"),
            "metadata": {},
            "items": [{
                "metricName": metric.name(),
                "metricLabels": labels,
                "timestamp": k8s_openapi::jiff::Timestamp::now()
                    .round(k8s_openapi::jiff::Unit::Second)
                    .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now())
                    .to_string(),
                "value": value.to_string(),
            }],
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_name_one_ring() {
        let cluster = |n: &str| RingRef::new(RingKind::ClusterRing, n);
        assert_eq!(
            ring_of_selector("clusterring=example"),
            Ok(cluster("example"))
        );
        assert_eq!(
            ring_of_selector(" clusterring == example "),
            Ok(cluster("example"))
        );
        assert_eq!(
            ring_of_selector("clusterring in (example)"),
            Ok(cluster("example"))
        );
        assert_eq!(
            ring_of_selector("controllerring=web"),
            Ok(RingRef::new(RingKind::ControllerRing, "web"))
        );
        for bad in [
            "",
            "clusterring",
            "clusterring=",
            "clusterring=a,controllerring=b",
            "clusterring in (a,b)",
            "app=example",
            "clusterring!=example",
        ] {
            assert!(ring_of_selector(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_selector_is_read_from_the_query() {
        assert_eq!(
            query_parameter("a=1&labelSelector=clusterring%3Dexample&b", "labelSelector"),
            Some("clusterring=example".into())
        );
        assert_eq!(
            query_parameter("labelSelector=clusterring+in+%28x%29", "labelSelector"),
            Some("clusterring in (x)".into())
        );
        assert_eq!(query_parameter("b=2", "labelSelector"), None);
    }

    #[test]
    fn no_report_is_no_value_not_zero() {
        let load = RingLoad {
            reporting_shards: 2,
            available_shards: 3,
            objects: 25,
            queue_depth: 0,
            max_p99_ms: Some(120),
            errors: 0,
        };
        assert_eq!(RingMetric::Objects.value(&load), Some(25));
        assert_eq!(RingMetric::QueueDepth.value(&load), Some(0));
        assert_eq!(RingMetric::P99Milliseconds.value(&load), Some(120));
        let none_report_latency = RingLoad {
            max_p99_ms: None,
            ..load
        };
        assert_eq!(
            RingMetric::P99Milliseconds.value(&none_report_latency),
            None
        );
        let nobody = RingLoad {
            reporting_shards: 0,
            ..RingLoad::default()
        };
        for metric in RingMetric::ALL {
            assert_eq!(metric.value(&nobody), None, "{metric:?}");
        }
    }
}
