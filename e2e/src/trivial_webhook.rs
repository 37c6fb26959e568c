//! A trivial mutating webhook to compare the sharder's against: it allows every review with the
//! same one-operation JSON patch, adding [`FIXED_LABEL`], and decodes nothing but the request's
//! `uid`. Served like the sharder's ([`kube_sharder::server::serve_tls`] with [`loopback_tls`]), so a
//! comparison measures the handlers, not transports.

use std::path::Path;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use k8s_openapi::ByteString;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_rustls::TlsAcceptor;

use crate::certs::generate_certificates;

/// Label the trivial webhook adds to every object, with the value `yes`.
pub const FIXED_LABEL: &str = "latency.sharding.timebertt.dev/fixed";

/// Path of the trivial webhook.
pub const PATH: &str = "/mutate";

/// The part of a review the trivial webhook reads.
#[derive(Deserialize)]
struct Review {
    request: ReviewRequest,
}

#[derive(Deserialize)]
struct ReviewRequest {
    uid: String,
}

/// The trivial webhook's router: every review to [`PATH`] is allowed with the same patch adding
/// [`FIXED_LABEL`].
pub fn router() -> anyhow::Result<Router> {
    let pointer = format!("/metadata/labels/{}", FIXED_LABEL.replace('/', "~1"));
    let patch = serde_json::to_vec(&json!([{"op": "add", "path": pointer, "value": "yes"}]))?;
    let patch = Arc::new(serde_json::to_value(ByteString(patch))?);
    Ok(Router::new()
        .route(
            PATH,
            post(
                |State(patch): State<Arc<Value>>, body: axum::body::Bytes| async move {
                    let uid = serde_json::from_slice::<Review>(&body)
                        .map(|r| r.request.uid)
                        .unwrap_or_default();
                    axum::Json(json!({
                        "apiVersion": "admission.k8s.io/v1",
                        "kind": "AdmissionReview",
                        "response": {
                            "uid": uid,
                            "allowed": true,
                            "patchType": "JSONPatch",
                            "patch": patch.as_ref(),
                        },
                    }))
                },
            ),
        )
        .with_state(patch))
}

/// Generates a CA and a serving certificate for 127.0.0.1 into `dir` (the CA as `ca.crt`) and
/// returns a TLS acceptor that serves them as the sharder does: through
/// [`kube_sharder::server::tls::CertReloader`], offering HTTP/2 and HTTP/1.1.
pub fn loopback_tls(dir: &Path) -> anyhow::Result<TlsAcceptor> {
    std::fs::create_dir_all(dir)?;
    generate_certificates(dir)?;
    let reloader = Arc::new(kube_sharder::server::tls::CertReloader::new(
        dir.join("tls.crt"),
        dir.join("tls.key"),
    ));
    reloader.reload_if_changed()?;
    Ok(TlsAcceptor::from(Arc::new(reloader.server_config()?)))
}
