//! Counting the sharder's own API requests, as a tower layer around the kube client's HTTP
//! stack: `controller_sharding_api_requests_total{client, verb, resource}`.
//!
//! What the sharder costs the API server is part of what it promises (Lease renewals cost no
//! request; a sync sends one patch per object that moves), so the requests are counted where
//! they leave the process, whatever code sent them.

use std::task::{Context, Poll};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tower::{Layer, Service};

/// Labels of one counted request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiRequestLabels {
    /// Which of the sharder's clients sent it: `main` or `leader_election`.
    pub client: &'static str,
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete` or `other`.
    pub verb: &'static str,
    /// Plural resource name (`leases`, `secrets`, `clusterrings/status`), or `discovery` for
    /// the API group and version documents.
    pub resource: String,
}

/// The counters of every client, by labels.
pub type ApiRequests = Family<ApiRequestLabels, Counter>;

/// Layer counting each request into a shared family under the client's name.
#[derive(Clone, Debug)]
pub(crate) struct CountLayer {
    requests: ApiRequests,
    client: &'static str,
}

impl CountLayer {
    /// Counts the requests of client `client` into `requests`.
    pub(crate) fn new(requests: ApiRequests, client: &'static str) -> Self {
        Self { requests, client }
    }
}

impl<S> Layer<S> for CountLayer {
    type Service = Count<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Count {
            inner,
            layer: self.clone(),
        }
    }
}

/// A service counting every request it passes on.
#[derive(Clone, Debug)]
pub(crate) struct Count<S> {
    inner: S,
    layer: CountLayer,
}

impl<S, B> Service<axum::http::Request<B>> for Count<S>
where
    S: Service<axum::http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: axum::http::Request<B>) -> Self::Future {
        let (verb, resource) = classify(
            request.method(),
            request.uri().path(),
            request.uri().query().unwrap_or_default(),
        );
        self.layer
            .requests
            .get_or_create(&ApiRequestLabels {
                client: self.layer.client,
                verb,
                resource,
            })
            .inc();
        self.inner.call(request)
    }
}

/// The verb and resource of a request to the Kubernetes API, from its method, path and query.
///
/// Paths are `/api/v1/...` or `/apis/<group>/<version>/...`, then optionally
/// `namespaces/<namespace>/`, then `<resource>[/<name>[/<subresource>]]`. A `namespaces`
/// collection or object is itself the resource when nothing follows it that names another.
fn classify(method: &axum::http::Method, path: &str, query: &str) -> (&'static str, String) {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segments.as_slice() {
        ["api", _version, rest @ ..] => rest,
        ["apis", _group, _version, rest @ ..] => rest,
        _ => &[][..],
    };
    // `namespaces/<ns>/<resource>...` is namespaced; `namespaces` or `namespaces/<ns>` (and its
    // subresources: `namespaces/<ns>/status` is not a resource of its own) is the resource.
    let rest = match rest {
        ["namespaces", _ns, resource, tail @ ..] if !is_namespace_subresource(resource) => {
            let mut r = vec![*resource];
            r.extend_from_slice(tail);
            r
        }
        _ => rest.to_vec(),
    };
    let (resource, named) = match rest.as_slice() {
        [] => return (verb_of(method, true, query), "discovery".to_string()),
        [resource] => ((*resource).to_string(), false),
        [resource, _name] => ((*resource).to_string(), true),
        [resource, _name, subresource, ..] => (format!("{resource}/{subresource}"), true),
    };
    (verb_of(method, named, query), resource)
}

fn is_namespace_subresource(segment: &str) -> bool {
    matches!(segment, "status" | "finalize")
}

fn verb_of(method: &axum::http::Method, named: bool, query: &str) -> &'static str {
    let watch = query
        .split('&')
        .any(|pair| pair == "watch=true" || pair == "watch=1");
    match *method {
        axum::http::Method::GET if watch => "watch",
        axum::http::Method::GET if named => "get",
        axum::http::Method::GET => "list",
        axum::http::Method::POST => "create",
        axum::http::Method::PUT => "update",
        axum::http::Method::PATCH => "patch",
        axum::http::Method::DELETE => "delete",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Method;

    #[test]
    fn requests_are_classified_by_verb_and_resource() {
        let cases = [
            (
                Method::GET,
                "/api/v1/namespaces/ns/secrets",
                "limit=500",
                "list",
                "secrets",
            ),
            (
                Method::GET,
                "/api/v1/secrets",
                "watch=true&resourceVersion=1",
                "watch",
                "secrets",
            ),
            (
                Method::GET,
                "/api/v1/namespaces/ns/secrets/s",
                "",
                "get",
                "secrets",
            ),
            (
                Method::PATCH,
                "/api/v1/namespaces/ns/secrets/s",
                "",
                "patch",
                "secrets",
            ),
            (
                Method::PUT,
                "/apis/coordination.k8s.io/v1/namespaces/n/leases/l",
                "",
                "update",
                "leases",
            ),
            (
                Method::GET,
                "/apis/coordination.k8s.io/v1/leases",
                "watch=1",
                "watch",
                "leases",
            ),
            (
                Method::PATCH,
                "/apis/sharding.timebertt.dev/v1alpha1/clusterrings/r/status",
                "",
                "patch",
                "clusterrings/status",
            ),
            (
                Method::POST,
                "/apis/events.k8s.io/v1/namespaces/ns/events",
                "",
                "create",
                "events",
            ),
            (Method::GET, "/api/v1/namespaces", "", "list", "namespaces"),
            (
                Method::GET,
                "/api/v1/namespaces/ns",
                "",
                "get",
                "namespaces",
            ),
            (
                Method::PUT,
                "/api/v1/namespaces/ns/finalize",
                "",
                "update",
                "namespaces/finalize",
            ),
            (Method::GET, "/apis/apps/v1", "", "get", "discovery"),
            (Method::GET, "/apis", "", "get", "discovery"),
        ];
        for (method, path, query, verb, resource) in cases {
            assert_eq!(
                classify(&method, path, query),
                (verb, resource.to_string()),
                "{method} {path}?{query}"
            );
        }
    }

    #[tokio::test]
    async fn every_request_is_counted_under_its_client() {
        let requests = ApiRequests::default();
        let layer = CountLayer::new(requests.clone(), "main");
        let mut service = layer.layer(tower::service_fn(|_: axum::http::Request<()>| async {
            Ok::<_, ()>(())
        }));
        for _ in 0..3 {
            let request = axum::http::Request::get("/api/v1/namespaces/ns/secrets/s")
                .body(())
                .unwrap();
            service.call(request).await.unwrap();
        }
        let labels = ApiRequestLabels {
            client: "main",
            verb: "get",
            resource: "secrets".into(),
        };
        assert_eq!(requests.get_or_create(&labels).get(), 3);
    }
}
