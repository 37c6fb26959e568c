//! The sharder's admission webhook (docs/protocol.md §7): assigns unassigned objects of a ring's
//! resources to a shard in the admission response itself.
//!
//! Only the few fields the decision needs are decoded from the `AdmissionReview` (`decode`), and
//! the answer is written straight into bytes (`encode`), so a large object costs no more than a
//! small one. The sharder's own lag never blocks users: anything it cannot decide is allowed
//! unchanged (the missed-assignment path and the sync assign it later), a main object created
//! with `generateName` included: nothing the webhook answers refuses a user's write.
//! A request for a ring this sharder does not know is answered 404 (docs/protocol.md §19).
//!
//! | module | what |
//! |---|---|
//! | `decode` | the fields of an `AdmissionReview` the decision reads, borrowed from the body |
//! | `encode` | the answer, the JSON patch and the `AdmissionReview` around it, written as bytes |
//! | `tests` | router tests with `AdmissionReview` JSON as the API server sends it |

mod decode;
mod encode;

use std::sync::Arc;

use anyhow::Context as _;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use kube_sharding_api::config::SharderConfig;
use kube_sharding_api::{GroupResource, RingKind, RingRef};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use self::decode::{Request, Review};
use crate::core::key::{
    GENERATE_NAME_NOT_SUPPORTED, KeyError, KeyOutcome, ObjectInfo, ResourceRole,
};
use crate::metrics::{Metrics, OutcomeLabels};
use crate::server;
use crate::server::tls::CertReloader;
use crate::views::{ControllerLookup, RingView, Views, controller_shard};

/// Starts the webhook's TLS server on the configured address, with the serving certificate of
/// `reloader` (kept loaded by [`server::tls::watch_certificate`]); it stops on `shutdown` and lets
/// open requests finish within `gracefulShutdown`. The server also serves `extra`'s routes (the
/// external metrics API), and asks clients for a certificate, which they may leave out.
pub(crate) async fn serve(
    config: &SharderConfig,
    state: WebhookState,
    extra: Router,
    reloader: &Arc<CertReloader>,
    tasks: &mut JoinSet<()>,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let server_config = &config.webhook.server;
    let tls = tokio_rustls::TlsAcceptor::from(Arc::new(
        reloader
            .server_config_asking_client_certs()
            .context("failed to build TLS config")?,
    ));
    let addr = kube_sharding_api::config::parse_bind_address(&server_config.bind_address)?
        .context("webhook server address")?;
    let listener = server::bind(addr).await?;
    tracing::info!(address = %listener.local_addr()?, "serving webhook");
    tasks.spawn(server::serve_tls(
        listener,
        tls,
        router(state).merge(extra),
        server::ConnectionLimits::default(),
        shutdown.clone(),
        config.graceful_shutdown.0,
    ));
    Ok(())
}

/// Largest request body accepted; the API server caps objects at 3 MiB, so a larger review is not
/// from it.
pub(crate) const MAX_BODY_BYTES: usize = 3 * 1024 * 1024;

/// Route of the per-ring webhook: the lowercase ring kind, then the ring name.
pub(crate) const ROUTE: &str = "/webhooks/sharder/{kind}/{ring}";

/// Body of the 404 answer for any other path.
const NOT_FOUND: &str = "not found: the webhook path is /webhooks/sharder/clusterring/<ring> or /webhooks/sharder/controllerring/<ring>\n";

/// Body of the 404 answer for a ring this sharder does not know.
const UNKNOWN_RING: &str = "not found: no such ring\n";

/// Longest ring name in a path: ring names are object names, at most 253 characters.
const MAX_RING_NAME: usize = 253;

/// What the webhook handler needs.
#[derive(Clone)]
pub struct WebhookState {
    /// Current views of the rings.
    pub views: Arc<Views>,
    /// Counters to increment on assignments.
    pub metrics: Metrics,
    /// Reads a controller whose ring changed lately, to label a child it gets meanwhile with the
    /// controller's own shard (see `ControllerLookup`); without one, children follow the ring.
    pub client: Option<kube::Client>,
}

/// The webhook router: the ring route, 404 elsewhere and for rings the sharder does not know,
/// bodies capped at 3 MiB (`MAX_BODY_BYTES`).
pub fn router(state: WebhookState) -> Router {
    Router::new()
        .route(ROUTE, post(handle))
        .fallback(|| async { (StatusCode::NOT_FOUND, NOT_FOUND) })
        // Behind an `Arc`, each request clones one pointer instead of every metric family's.
        .with_state(Arc::new(state))
}

/// A request the webhook cannot read; answered with HTTP 400.
struct BadRequest(String);

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        (StatusCode::BAD_REQUEST, format!("{}\n", self.0)).into_response()
    }
}

/// Reason of allowing an object that already carries the ring's shard label.
const ALREADY_ASSIGNED: &str = "object is already assigned";

/// The answer to one admission request.
#[derive(Debug, PartialEq)]
enum AdmissionDecision {
    /// Allowed without changes, with the reason for logs.
    Allow(&'static str),
    /// Allowed with the shard label added.
    Assign {
        /// Label key to add.
        label: String,
        /// Shard name.
        shard: String,
        /// Whether the object has no labels map yet.
        create_labels: bool,
        /// A drain label left over from the object's previous shard, removed in the same patch:
        /// the object is not being drained away from the shard it is assigned to now.
        stale_drain_label: Option<String>,
    },
}

impl AdmissionDecision {
    /// The `outcome` label of the webhook duration metric.
    fn outcome(&self) -> &'static str {
        match self {
            Self::Allow(reason) if *reason == ALREADY_ASSIGNED => "already_assigned",
            Self::Allow(reason) if *reason == GENERATE_NAME_NOT_SUPPORTED => "unnamed",
            Self::Allow(_) => "skipped",
            Self::Assign { .. } => "assigned",
        }
    }
}

async fn handle(
    State(state): State<Arc<WebhookState>>,
    Path((kind, ring)): Path<(String, String)>,
    request: axum::extract::Request,
) -> Result<Response, Response> {
    let Some(kind) = RingKind::from_path_segment(&kind) else {
        return Err((StatusCode::NOT_FOUND, NOT_FOUND).into_response());
    };
    // Whoever reaches the port chooses the path: only rings this sharder knows are answered, and
    // only their answers measured, before the body is read. A metric series per path would let
    // any caller grow the sharder's memory without bound.
    if ring.len() > MAX_RING_NAME {
        return Err((StatusCode::NOT_FOUND, UNKNOWN_RING).into_response());
    }
    let ring = RingRef::new(kind, ring);
    if state.views.get(&ring).is_none() {
        tracing::debug!("webhook called for a ring the sharder does not know (yet)");
        return Err((StatusCode::NOT_FOUND, UNKNOWN_RING).into_response());
    }
    let started = std::time::Instant::now();
    let body = server::read_body(request, MAX_BODY_BYTES).await?;
    let (outcome, result) = match decode(&body) {
        Ok(request) => {
            let (mut decision, lookup, warnings) = decide(&state, &ring, &request);
            if let (Some(lookup), AdmissionDecision::Assign { shard, .. }) = (lookup, &mut decision)
                && let Some(client) = state.client.clone()
                && let Some(current) = controller_shard(client, &state.views, &ring, &lookup).await
            {
                *shard = current;
            }
            let response = respond(&state, &ring, &request, &decision, &warnings);
            (decision.outcome(), Ok(response))
        }
        Err(bad) => ("invalid", Err(bad.into_response())),
    };
    state
        .metrics
        .webhook_duration
        .get_or_create(&OutcomeLabels::new(&ring, outcome))
        .observe(started.elapsed().as_secs_f64());
    result
}

/// Decodes one AdmissionReview, borrowing its strings from `body`.
fn decode(body: &[u8]) -> Result<Request<'_>, BadRequest> {
    // Answers name what is wrong, never the request's content (serde's messages quote values).
    let review: Review<'_> = serde_json::from_slice(body).map_err(|e| {
        BadRequest(format!(
            "failed to decode AdmissionReview: invalid JSON or fields at line {} column {}",
            e.line(),
            e.column()
        ))
    })?;
    if review.api_version.as_str() != "admission.k8s.io/v1"
        || review.kind.as_str() != "AdmissionReview"
    {
        return Err(BadRequest(
            "expected an admission.k8s.io/v1 AdmissionReview".into(),
        ));
    }
    review
        .request
        .ok_or_else(|| BadRequest("AdmissionReview has no request".into()))
}

/// The AdmissionReview answering `request` with `decision`.
fn respond(
    state: &WebhookState,
    ring: &RingRef,
    request: &Request<'_>,
    decision: &AdmissionDecision,
    warnings: &[String],
) -> Response {
    let uid = request.uid.as_str();
    let patch = match &decision {
        AdmissionDecision::Allow(reason) => {
            tracing::debug!(ring = %ring, uid, reason, "allowing object unchanged");
            None
        }
        AdmissionDecision::Assign {
            label,
            shard,
            create_labels,
            stale_drain_label,
        } => {
            if request.dry_run != Some(true) {
                state
                    .metrics
                    .assignments
                    .get_or_create(&Metrics::resource_labels(
                        ring,
                        &request.resource.group,
                        &request.resource.resource,
                    ))
                    .inc();
            }
            Some(encode::label_patch(
                label,
                shard,
                *create_labels,
                stale_drain_label.as_deref(),
            ))
        }
    };
    let body = encode::allowed_review(uid, patch.as_deref(), warnings);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

/// What the webhook answers for `request`, the controller to read first, if any, and warnings
/// for whoever wrote the object (pins that did not decide, docs/protocol.md §21).
fn decide(
    state: &WebhookState,
    ring: &RingRef,
    request: &Request<'_>,
) -> (AdmissionDecision, Option<ControllerLookup>, Vec<String>) {
    if request
        .sub_resource
        .as_deref()
        .is_some_and(|s| !s.is_empty())
    {
        return allow("subresource requests are not assigned");
    }
    let Some(object) = request.object.as_ref() else {
        return allow("request carries no object");
    };
    let meta = &object.metadata;
    let Some(view) = state.views.get(ring) else {
        // Gone between the router's check and here.
        return allow("unknown ring");
    };
    if meta
        .labels
        .as_ref()
        .and_then(|l| l.get(&view.shard_label))
        .is_some_and(|v| !v.is_empty())
    {
        return allow(ALREADY_ASSIGNED);
    }
    let group_resource = GroupResource::new(
        request.resource.group.as_str(),
        request.resource.resource.as_str(),
    );
    let Some(resource) = view.resources.get(&group_resource) else {
        tracing::warn!(%ring, resource = %group_resource, "webhook called for a resource that is not part of the ring; allowing unchanged");
        return allow("resource is not part of the ring");
    };
    // The key reads only the controller reference: an owned copy of it, if there is one.
    let controller = meta
        .controller
        .as_ref()
        .and_then(|c| c.0.as_ref())
        .map(decode::OwnerRef::to_owner_reference);
    let namespace = meta.namespace.as_deref().or(request.namespace.as_deref());
    let info = ObjectInfo {
        group: &request.kind.group,
        kind: &request.kind.kind,
        namespace,
        name: meta.name.as_deref(),
        owner_references: controller.as_slice(),
    };
    let outcome = view.key(&info, &resource.role);
    let mut warnings = meta
        .annotations
        .as_ref()
        .map(|pins| pin_warnings(state, &view, resource.is_main(), pins))
        .unwrap_or_default();
    let key = match outcome {
        Ok(KeyOutcome::Key(key)) => key,
        Ok(KeyOutcome::Unassigned(_)) => {
            return with_warnings(allow("object has no eligible controller"), warnings);
        }
        // Hashed by its name, which the API server has not chosen yet: allowed unassigned, and
        // assigned by the missed-assignment path once it exists.
        Err(KeyError::GenerateNameNotSupported) => {
            return with_warnings(allow(GENERATE_NAME_NOT_SUPPORTED), warnings);
        }
    };
    let own = meta
        .annotations
        .as_ref()
        .and_then(|pins| pins.get(&view.pin_annotation));
    // A dry run writes nothing, so its pin is not remembered: it would let anyone who may dry-run
    // a create grow the sharder's memory.
    if resource.is_main() && request.dry_run != Some(true) {
        view.pins.main_seen(ring, &key, own);
    }
    let (shard, pin) = view.place(&key, resource.is_main(), own, namespace);
    warnings.extend(pin.problem());
    let Some(shard) = shard else {
        return with_warnings(allow("there is no available shard"), warnings);
    };
    let lookup = match &resource.role {
        ResourceRole::Controlled { .. }
            if pin.asks_controller(view.recently_moved(&key, std::time::Instant::now())) =>
        {
            view.controller_lookup(&info)
        }
        _ => None,
    };
    let decision = AdmissionDecision::Assign {
        label: view.shard_label.clone(),
        shard: shard.to_string(),
        create_labels: meta.labels.is_none(),
        stale_drain_label: meta
            .labels
            .as_ref()
            .filter(|l| l.contains_key(&view.drain_label))
            .map(|_| view.drain_label.clone()),
    };
    (decision, lookup, warnings)
}

/// Warnings about pin annotations of an object that no pin of `view` reads: a pin on a controlled
/// object (it follows its controller), and a pin whose key names no ring this sharder knows.
fn pin_warnings(
    state: &WebhookState,
    view: &RingView,
    main: bool,
    pins: &decode::PinAnnotations<'_>,
) -> Vec<String> {
    let mut warnings = Vec::new();
    for key in pins.keys() {
        if key == view.pin_annotation {
            if !main {
                warnings.push(format!(
                    "Annotation {key} is ignored: a controlled object follows its controller's pin"
                ));
            }
        } else if !state.views.all().iter().any(|v| v.pin_annotation == key) {
            warnings.push(format!(
                "Annotation {key} names no ring this sharder knows: it pins nothing"
            ));
        }
    }
    warnings
}

/// A decision that allows the object unchanged, for `reason`, with nothing to read.
fn allow(reason: &'static str) -> (AdmissionDecision, Option<ControllerLookup>, Vec<String>) {
    (AdmissionDecision::Allow(reason), None, Vec::new())
}

/// `decided` with `warnings`.
fn with_warnings(
    decided: (AdmissionDecision, Option<ControllerLookup>, Vec<String>),
    warnings: Vec<String>,
) -> (AdmissionDecision, Option<ControllerLookup>, Vec<String>) {
    (decided.0, decided.1, warnings)
}

#[cfg(test)]
mod tests;
