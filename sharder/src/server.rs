//! HTTP servers of the sharder process: the TLS server of the webhook and of the metrics, the
//! external metrics API beside the webhook, and the plain health server.
//!
//! | module | what |
//! |---|---|
//! | [`tls`] | the TLS configuration, its certificate reloaded from disk |
//! | `metrics_auth` | who may read the metrics: TokenReview and SubjectAccessReview, cached in lanes |
//! | `external_metrics` | the external metrics API (`external.metrics.k8s.io`) the HorizontalPodAutoscaler reads ring load from, behind the aggregator's front-proxy certificate |

mod external_metrics;
mod metrics_auth;

pub(crate) use self::external_metrics::{ExternalMetrics, external_metrics_router};

pub(crate) use self::metrics_auth::ReviewClients;
pub mod tls;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::body::{Body, HttpBody as _};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http_body_util::BodyExt as _;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use kube_sharding_api::config::SharderConfig;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::records;

/// How long the accept loop pauses after a failed `accept` (out of file descriptors, say), so a
/// persistent error does not spin a core.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Most bytes of a request's head (request line and headers) a server buffers.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// How long a client may take to send a request body, counted from when the handler starts
/// reading it: the API server's own webhook timeout, so no honest caller is still waiting then.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(5);

/// Request body bytes a server holds at once, over all its connections.
pub const BODY_BUDGET_BYTES: usize = 32 * 1024 * 1024;

/// Seconds a client is told to wait (`Retry-After`) when the body budget is used up.
const RETRY_AFTER_SECONDS: &str = "1";

/// Bounds on one server's connections and requests, so that slow, idle, numerous or large
/// clients cannot hold the process's memory or file descriptors. The defaults are the webhook's:
/// the API server opens a few long-lived HTTP/2 connections per replica and sends each review at
/// once, well within all of them.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Connections served at once. A TLS connection takes its place only once its handshake
    /// completed; one beyond this is closed then (a plain one, as soon as it is accepted).
    pub max_connections: usize,
    /// Connections served at once from one client address (within `max_connections`).
    pub max_connections_per_address: usize,
    /// TLS handshakes in progress at once, apart from the served connections; a connection
    /// accepted beyond this is closed at once.
    pub max_handshakes: usize,
    /// How long a client may take for the TLS handshake before its connection is dropped.
    pub handshake_timeout: Duration,
    /// How long an HTTP/1 client may take to send a request's headers, counted from the
    /// connection's start or the previous answer: an idle keep-alive connection is closed after
    /// this long too.
    pub header_timeout: Duration,
    /// Most bytes of a request's head: HTTP/1's read buffer and HTTP/2's header list.
    pub max_header_bytes: usize,
    /// Interval of HTTP/2 keep-alive pings; a client that leaves one unanswered for
    /// `header_timeout` is disconnected.
    pub keep_alive_interval: Duration,
    /// Concurrent HTTP/2 streams (requests) per connection.
    pub max_concurrent_streams: u32,
    /// How long [`read_body`] waits for a whole request body (408 after).
    pub body_timeout: Duration,
    /// Request body bytes [`read_body`] holds at once over the whole server (503 beyond).
    pub body_budget_bytes: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 1000,
            max_connections_per_address: 250,
            max_handshakes: 1000,
            handshake_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(10),
            max_header_bytes: MAX_HEADER_BYTES,
            keep_alive_interval: Duration::from_secs(30),
            max_concurrent_streams: 250,
            body_timeout: BODY_TIMEOUT,
            body_budget_bytes: BODY_BUDGET_BYTES,
        }
    }
}

/// Bounds on the health server's connections: the kubelet's probes, one connection each.
pub const HEALTH_LIMITS: ConnectionLimits = ConnectionLimits {
    max_connections: 64,
    max_connections_per_address: 16,
    max_handshakes: 0,
    handshake_timeout: Duration::from_secs(10),
    header_timeout: Duration::from_secs(10),
    max_header_bytes: MAX_HEADER_BYTES,
    keep_alive_interval: Duration::from_secs(30),
    max_concurrent_streams: 10,
    body_timeout: BODY_TIMEOUT,
    body_budget_bytes: BODY_BUDGET_BYTES,
};

/// Bounds on the metrics server's connections: a few scrapers, each with a connection or two.
pub const METRICS_LIMITS: ConnectionLimits = ConnectionLimits {
    max_connections: 100,
    max_connections_per_address: 16,
    max_handshakes: 100,
    ..HEALTH_LIMITS
};

/// The certificates a TLS client sent (end entity first; empty when it sent none), in each
/// request's extensions. The TLS layer checked only that the client holds the first one's key
/// ([`tls::CertReloader::server_config_asking_client_certs`]); a handler verifies the chain.
#[derive(Clone, Debug, Default)]
pub struct PeerCertificates(pub Arc<[rustls::pki_types::CertificateDer<'static>]>);

/// Readiness of the process: ready once caches synced and the certificate is loaded, and never
/// again once shutdown began.
#[derive(Debug, Default)]
pub(crate) struct Readiness {
    caches_synced: AtomicBool,
    certificate_loaded: AtomicBool,
    shutting_down: AtomicBool,
}

impl Readiness {
    /// Marks the caches as synced.
    pub(crate) fn set_caches_synced(&self) {
        self.caches_synced.store(true, Ordering::SeqCst);
    }

    /// Marks the webhook certificate as loaded.
    pub(crate) fn set_certificate_loaded(&self) {
        self.certificate_loaded.store(true, Ordering::SeqCst);
    }

    /// Marks the start of shutdown.
    pub(crate) fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Whether the process should receive traffic.
    pub(crate) fn is_ready(&self) -> bool {
        self.caches_synced.load(Ordering::SeqCst)
            && self.certificate_loaded.load(Ordering::SeqCst)
            && !self.shutting_down.load(Ordering::SeqCst)
    }
}

/// Router of the health endpoint: `/healthz` (alive) and `/readyz` (see [`Readiness`]).
pub(crate) fn health_router(readiness: Arc<Readiness>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(r): State<Arc<Readiness>>| async move {
                if r.is_ready() {
                    (StatusCode::OK, "ok\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
                }
            }),
        )
        .with_state(readiness)
}

/// Router of the metrics endpoint: `/metrics` in the OpenMetrics text format.
pub(crate) fn metrics_router(registry: Arc<Registry>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(registry): State<Arc<Registry>>| async move {
                match crate::metrics::render(&registry) {
                    Ok(text) => (
                        StatusCode::OK,
                        [(
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        text,
                    )
                        .into_response(),
                    Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                }
            }),
        )
        .with_state(registry)
}

/// [`metrics_router`] behind authentication and authorization through the API server (see
/// `metrics_auth`): only `/metrics` asks the API server anything; other paths are 404 at no cost.
pub(crate) fn secure_metrics_router(
    registry: Arc<Registry>,
    clients: ReviewClients,
    audiences: Vec<String>,
) -> Router {
    let auth = Arc::new(metrics_auth::MetricsAuth::new(clients, audiences));
    metrics_router(registry).route_layer(axum::middleware::from_fn_with_state(
        auth,
        metrics_auth::require_access,
    ))
}

/// Starts the admin servers the configuration enables: metrics from `registry`, and the health
/// probes answering from `readiness`. A bind address of `0` disables a server. With
/// `metrics.secure`, metrics are served over TLS with the webhook's serving certificate (from
/// `certificate`, the webhook's reloader) and every scrape is reviewed through `clients`.
pub(crate) async fn serve_admin(
    config: &SharderConfig,
    registry: Registry,
    readiness: Arc<Readiness>,
    certificate: &Arc<tls::CertReloader>,
    clients: ReviewClients,
    tasks: &mut JoinSet<()>,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    if let Some(addr) = config.metrics.socket_addr()? {
        let listener = bind(addr).await?;
        let registry = Arc::new(registry);
        if config.metrics.secure {
            let acceptor = TlsAcceptor::from(Arc::new(
                certificate
                    .server_config()
                    .context("failed to build the metrics TLS config")?,
            ));
            tracing::info!(event = records::EVENT_SERVING, address = %listener.local_addr()?, "serving metrics over HTTPS to authorized clients");
            tasks.spawn(serve_tls(
                listener,
                acceptor,
                secure_metrics_router(registry, clients, config.metrics.token_audiences.clone()),
                METRICS_LIMITS,
                shutdown.clone(),
                config.graceful_shutdown.0,
            ));
        } else {
            tracing::warn!(event = records::EVENT_METRICS_UNAUTHENTICATED, address = %listener.local_addr()?, "serving metrics over plain HTTP without authentication (metrics.secure is false)");
            tasks.spawn(serve(
                listener,
                None,
                metrics_router(registry),
                METRICS_LIMITS,
                shutdown.clone(),
                config.graceful_shutdown.0,
            ));
        }
    }
    if let Some(addr) = config.health.socket_addr()? {
        let listener = bind(addr).await?;
        tracing::info!(event = records::EVENT_SERVING, address = %listener.local_addr()?, "serving health probes");
        tasks.spawn(serve(
            listener,
            None,
            health_router(readiness),
            HEALTH_LIMITS,
            shutdown.clone(),
            config.graceful_shutdown.0,
        ));
    }
    Ok(())
}

/// Serves `app` over TLS on `listener` within `limits` until `shutdown` fires, then lets open
/// requests finish for at most `drain`: [`serve`] with `tls`.
pub async fn serve_tls(
    listener: TcpListener,
    tls: TlsAcceptor,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
    drain: Duration,
) {
    serve(listener, Some(tls), app, limits, shutdown, drain).await;
}

/// Serves `app` on `listener`, over TLS with `tls` or plain HTTP/1.1 without, within `limits`
/// until `shutdown` fires, then lets open requests finish for at most `drain`. The webhook, the
/// metrics and the health probes all run on it. Handlers read request bodies through
/// [`read_body`], which keeps to this server's body budget and timeout.
pub async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
    drain: Duration,
) {
    let local = listener.local_addr().ok();
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Slots::new(
        limits.max_connections,
        limits.max_connections_per_address,
    ));
    let handshakes = Arc::new(Semaphore::new(limits.max_handshakes));
    let app = app.layer(axum::Extension(BodyLimits::new(
        limits.body_budget_bytes,
        limits.body_timeout,
    )));
    loop {
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(error) => {
                    tracing::warn!(event = records::EVENT_ACCEPT_FAILED, %error, ?local, "failed to accept a connection");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            },
        };
        // An answer leaves in several small writes (TLS records, HTTP/2 frames); with Nagle's
        // algorithm a later one waits for the client's ACK of the first, which a client may delay
        // by 40 ms. Go's clients, the API server's included, set this on their side already.
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, %peer, "failed to set TCP_NODELAY");
        }
        let watcher = graceful.watcher();
        let Some(tls) = tls.clone() else {
            let service = TowerToHyperService::new(app.clone());
            let Some(slot) = Slots::take(&slots, peer.ip()) else {
                tracing::debug!(%peer, ?local, "too many connections; closing the new one");
                continue;
            };
            tokio::spawn(async move {
                let _slot = slot;
                let builder = builder(&limits, false);
                let conn = builder.serve_connection(TokioIo::new(stream), service);
                if let Err(error) = watcher.watch(conn.into_owned()).await {
                    tracing::debug!(%error, %peer, ?local, "connection ended with an error");
                }
            });
            continue;
        };
        // Handshakes have a pool of their own, and a connection is counted against the
        // connection limits only once its handshake completed: clients that never finish one
        // cannot keep others' connections out, only other handshakes, each for at most the
        // handshake timeout.
        let Ok(handshake) = handshakes.clone().try_acquire_owned() else {
            tracing::debug!(%peer, ?local, "too many TLS handshakes in progress; closing the new one");
            continue;
        };
        let slots = slots.clone();
        let app = app.clone();
        tokio::spawn(async move {
            let stream =
                match tokio::time::timeout(limits.handshake_timeout, tls.accept(stream)).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(error)) => {
                        tracing::debug!(%error, %peer, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                };
            drop(handshake);
            let Some(_slot) = Slots::take(&slots, peer.ip()) else {
                tracing::debug!(%peer, ?local, "too many connections; closing the new one");
                return;
            };
            // The protocol the handshake agreed on. Left to itself, the builder would wait for a
            // client's first bytes to tell the protocols apart, and a client that sends nothing
            // would never meet a timeout.
            let http2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
            let peer_certificates = PeerCertificates(
                stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .unwrap_or_default()
                    .iter()
                    .map(|c| c.clone().into_owned())
                    .collect(),
            );
            let service = TowerToHyperService::new(tower::Layer::layer(
                &axum::Extension(peer_certificates),
                app,
            ));
            let builder = builder(&limits, http2);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            if let Err(error) = watcher.watch(conn.into_owned()).await {
                tracing::debug!(%error, %peer, ?local, "connection ended with an error");
            }
        });
    }
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            event = records::EVENT_CONNECTIONS_LEFT_OPEN,
            ?local,
            "connections still open after the shutdown grace period"
        );
    }
}

/// A connection builder for one protocol with the timeouts and sizes of `limits`. Plain
/// connections are HTTP/1.1 only: without ALPN the protocol would be told from the client's first
/// bytes, and a client that sends none would never meet the header timeout.
fn builder(limits: &ConnectionLimits, http2: bool) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // hyper applies its timeouts only with a timer.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_header_bytes);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.keep_alive_interval)
        .keep_alive_timeout(limits.header_timeout)
        .max_concurrent_streams(limits.max_concurrent_streams)
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
    if http2 {
        builder.http2_only()
    } else {
        builder.http1_only()
    }
}

/// The connections a server is serving, in all and per client address.
#[derive(Debug)]
struct Slots {
    max_total: usize,
    max_per_address: usize,
    /// Connections in all, and per address with at least one (so at most `max_total` entries).
    open: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

impl Slots {
    fn new(max_total: usize, max_per_address: usize) -> Self {
        Self {
            max_total,
            max_per_address,
            open: Mutex::default(),
        }
    }

    /// A place for a connection from `address`, or `None` when the server or the address is at
    /// its limit; the place is given back when the slot is dropped.
    fn take(slots: &Arc<Self>, address: IpAddr) -> Option<Slot> {
        let mut open = slots.open.lock().unwrap_or_else(PoisonError::into_inner);
        let (total, per_address) = &mut *open;
        if *total >= slots.max_total {
            return None;
        }
        let count = per_address.entry(address).or_default();
        if *count >= slots.max_per_address {
            if *count == 0 {
                per_address.remove(&address);
            }
            return None;
        }
        *count += 1;
        *total += 1;
        Some(Slot {
            slots: slots.clone(),
            address,
        })
    }
}

/// One connection's place in [`Slots`].
#[derive(Debug)]
struct Slot {
    slots: Arc<Slots>,
    address: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self
            .slots
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (total, per_address) = &mut *open;
        *total -= 1;
        if let Some(count) = per_address.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                per_address.remove(&self.address);
            }
        }
    }
}

/// The request body limits of one server: a deadline per body and a budget of bytes held at once
/// over all requests. [`serve`] gives them to every request as an extension.
#[derive(Clone, Debug)]
pub struct BodyLimits {
    budget: Arc<Semaphore>,
    timeout: Duration,
}

impl BodyLimits {
    /// Limits of `budget` bytes in all and `timeout` per body.
    pub fn new(budget: usize, timeout: Duration) -> Self {
        Self {
            budget: Arc::new(Semaphore::new(budget.min(Semaphore::MAX_PERMITS))),
            timeout,
        }
    }

    /// Bytes of the budget not held by any request.
    pub fn available(&self) -> usize {
        self.budget.available_permits()
    }

    /// Reads `body` whole within these limits and `max` bytes: see [`read_body`].
    pub async fn read(&self, mut body: Body, max: usize) -> Result<RequestBody, Response> {
        let hint = body.size_hint();
        if usize::try_from(hint.lower()).unwrap_or(usize::MAX) > max {
            return Err(too_large());
        }
        // A declared length is held at once, so the buffer is allocated once; otherwise the
        // reservation grows with the buffer, ahead of each allocation.
        let declared = hint
            .exact()
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
        let mut reservation = self.reserve(declared.unwrap_or(0)).ok_or_else(busy)?;
        let mut bytes = Vec::with_capacity(declared.unwrap_or(0));
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => return Err(timed_out()),
                Ok(None) => break,
                Ok(Some(Err(error))) => {
                    tracing::debug!(%error, "failed to read a request body");
                    return Err(
                        (StatusCode::BAD_REQUEST, "failed to read the request body\n")
                            .into_response(),
                    );
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            let len = bytes.len() + data.len();
            if len > max {
                return Err(too_large());
            }
            if len > bytes.capacity() {
                let capacity = len.max(bytes.capacity() * 2).min(max);
                if capacity > reservation.num_permits() {
                    reservation.merge(
                        self.reserve(capacity - reservation.num_permits())
                            .ok_or_else(busy)?,
                    );
                }
                bytes.reserve_exact(capacity - bytes.len());
            }
            bytes.extend_from_slice(&data);
        }
        Ok(RequestBody {
            bytes,
            _reservation: reservation,
        })
    }

    /// `bytes` of the budget, if they are free.
    fn reserve(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        let reserved = u32::try_from(bytes)
            .ok()
            .and_then(|n| self.budget.clone().try_acquire_many_owned(n).ok());
        if reserved.is_none() {
            tracing::debug!(bytes, "request body budget used up");
        }
        reserved
    }
}

/// Body of the 413 answer.
const TOO_LARGE: &str = "request body too large\n";

/// The answer when the body budget cannot hold a body: the client may try again shortly.
fn busy() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, RETRY_AFTER_SECONDS)],
        "too many request bytes in flight, retry later\n",
    )
        .into_response()
}

fn too_large() -> Response {
    (StatusCode::PAYLOAD_TOO_LARGE, TOO_LARGE).into_response()
}

fn timed_out() -> Response {
    (
        StatusCode::REQUEST_TIMEOUT,
        "request body not received in time\n",
    )
        .into_response()
}

/// A request body read whole by [`read_body`], holding its part of the server's body budget
/// until dropped (at the end of the request).
#[derive(Debug)]
pub struct RequestBody {
    bytes: Vec<u8>,
    _reservation: OwnedSemaphorePermit,
}

impl std::ops::Deref for RequestBody {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

/// Reads `request`'s body whole, at most `max` bytes, within the limits [`serve`] set for the
/// request's server: 413 when it is larger, 408 when it is not all there within the body timeout,
/// 503 with `Retry-After` when the server's body budget cannot hold it, 400 when the client
/// breaks off. Outside [`serve`] (a router called directly) the body has a budget of its own.
pub async fn read_body(request: Request, max: usize) -> Result<RequestBody, Response> {
    let limits = request
        .extensions()
        .get::<BodyLimits>()
        .cloned()
        .unwrap_or_else(|| BodyLimits::new(max, BODY_TIMEOUT));
    let http1 = request.version() < axum::http::Version::HTTP_2;
    let mut read = limits.read(request.into_body(), max).await;
    if let Err(answer) = &mut read
        && http1
        && answer.status() == StatusCode::REQUEST_TIMEOUT
    {
        // The rest of the body may still be on its way: the connection cannot carry another
        // request. (HTTP/2 ends just the stream; the header is not allowed there.)
        answer.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
    }
    read
}

/// Binds a TCP listener, naming the address in the error.
pub(crate) async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("failed to listen on {addr}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt as _;
    use tower::ServiceExt;

    /// The secure metrics router with a client of an address where nothing listens: whatever
    /// reaches the API server fails at once (the reviews themselves are tested end to end).
    fn secure_router_without_api_server() -> Router {
        let config = kube::Config::new("http://127.0.0.1:1".parse().expect("url"));
        let client = kube::Client::try_from(config).expect("client");
        let clients = ReviewClients {
            new_tokens: client.clone(),
            known: client,
        };
        secure_metrics_router(Arc::new(Registry::default()), clients, Vec::new())
    }

    async fn answer(app: Router, request: Request<Body>) -> (StatusCode, String) {
        let response = app.oneshot(request).await.expect("infallible");
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .expect("body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn secure_metrics_refuse_without_a_token_and_repeat_nothing() {
        let (status, body) = answer(
            secure_router_without_api_server(),
            Request::get("/metrics")
                .body(Body::empty())
                .expect("request"),
        )
        .await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::UNAUTHORIZED, "unauthorized\n")
        );
        let (status, body) = answer(
            secure_router_without_api_server(),
            Request::get("/metrics")
                .header(header::AUTHORIZATION, "Basic c2VjcmV0")
                .body(Body::empty())
                .expect("request"),
        )
        .await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::UNAUTHORIZED, "unauthorized\n")
        );
        // Other paths cost no review.
        let (status, _) = answer(
            secure_router_without_api_server(),
            Request::get("/other").body(Body::empty()).expect("request"),
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        // A token that cannot be reviewed is refused without naming it or the failure.
        let (status, body) = answer(
            secure_router_without_api_server(),
            Request::get("/metrics")
                .header(header::AUTHORIZATION, "Bearer secret-token")
                .body(Body::empty())
                .expect("request"),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            !body.contains("secret-token") && !body.contains("127.0.0.1"),
            "{body}"
        );
    }

    #[tokio::test]
    async fn readiness_follows_caches_certificate_and_shutdown() {
        let readiness = Arc::new(Readiness::default());
        let status = |r: &Arc<Readiness>| {
            let app = health_router(r.clone());
            async move {
                app.oneshot(
                    Request::get("/readyz")
                        .body(Body::empty())
                        .expect("request"),
                )
                .await
                .expect("infallible")
                .status()
            }
        };
        assert_eq!(status(&readiness).await, StatusCode::SERVICE_UNAVAILABLE);
        readiness.set_caches_synced();
        assert_eq!(status(&readiness).await, StatusCode::SERVICE_UNAVAILABLE);
        readiness.set_certificate_loaded();
        assert_eq!(status(&readiness).await, StatusCode::OK);
        readiness.set_shutting_down();
        assert_eq!(status(&readiness).await, StatusCode::SERVICE_UNAVAILABLE);
        let healthz = health_router(readiness)
            .oneshot(
                Request::get("/healthz")
                    .body(Body::empty())
                    .expect("request"),
            )
            .await
            .expect("infallible");
        assert_eq!(healthz.status(), StatusCode::OK);
    }

    #[test]
    fn slots_keep_to_the_total_and_per_address_limits() {
        let slots = Arc::new(Slots::new(3, 2));
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        let c: IpAddr = "10.0.0.3".parse().expect("ip");
        let a1 = Slots::take(&slots, a).expect("first of a");
        let _a2 = Slots::take(&slots, a).expect("second of a");
        assert!(Slots::take(&slots, a).is_none(), "a third from one address");
        let _b1 = Slots::take(&slots, b).expect("first of b");
        assert!(Slots::take(&slots, c).is_none(), "a fourth in all");
        drop(a1);
        let _c1 = Slots::take(&slots, c).expect("a place freed");
        // Addresses without connections are forgotten, so the map stays within the total.
        drop(_b1);
        let open = slots.open.lock().expect("lock");
        assert_eq!(open.0, 2);
        assert_eq!(open.1.len(), 2, "{:?}", open.1);
        assert!(!open.1.contains_key(&b));
    }

    fn request_with(limits: &BodyLimits, body: Body) -> Request {
        let mut request = Request::post("/").body(body).expect("request");
        request.extensions_mut().insert(limits.clone());
        request
    }

    /// A body without a declared length, arriving as `chunks`.
    fn streamed(chunks: Vec<Vec<u8>>) -> Body {
        Body::from_stream(futures::stream::iter(
            chunks.into_iter().map(Ok::<_, std::io::Error>),
        ))
    }

    #[tokio::test]
    async fn bodies_share_one_budget_released_at_the_end_of_the_request() {
        let limits = BodyLimits::new(100, BODY_TIMEOUT);
        let first = read_body(request_with(&limits, Body::from(vec![1u8; 60])), 80)
            .await
            .expect("within the budget");
        assert_eq!(first.len(), 60);
        assert_eq!(limits.available(), 40);
        // Declared and streamed bodies alike are refused while the budget cannot hold them.
        for body in [Body::from(vec![2u8; 50]), streamed(vec![vec![2u8; 30]; 2])] {
            let refused = read_body(request_with(&limits, body), 80)
                .await
                .expect_err("over the budget");
            assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(refused.headers()[header::RETRY_AFTER], RETRY_AFTER_SECONDS);
            assert_eq!(limits.available(), 40, "a refused body holds nothing");
        }
        drop(first);
        assert_eq!(limits.available(), 100);
        let second = read_body(request_with(&limits, streamed(vec![vec![3u8; 30]; 2])), 80)
            .await
            .expect("room again");
        assert_eq!(&*second, &[[3u8; 30], [3u8; 30]].concat()[..]);
        assert!(limits.available() <= 40, "the buffer is accounted for");
        drop(second);
        assert_eq!(limits.available(), 100);
    }

    #[tokio::test]
    async fn bodies_over_the_size_limit_are_refused() {
        let limits = BodyLimits::new(1000, BODY_TIMEOUT);
        for body in [Body::from(vec![0u8; 81]), streamed(vec![vec![0u8; 50]; 2])] {
            let refused = read_body(request_with(&limits, body), 80)
                .await
                .expect_err("too large");
            assert_eq!(refused.status(), StatusCode::PAYLOAD_TOO_LARGE);
        }
        assert_eq!(limits.available(), 1000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_not_sent_in_time_is_408() {
        let limits = BodyLimits::new(1000, Duration::from_secs(5));
        // Some bytes, then nothing more: a client trickling its body or stalling.
        let stalled = Body::from_stream(
            futures::stream::iter([Ok::<_, std::io::Error>(vec![b'{'; 10])])
                .chain(futures::stream::pending()),
        );
        let started = tokio::time::Instant::now();
        let refused = read_body(request_with(&limits, stalled), 100)
            .await
            .expect_err("timed out");
        assert_eq!(refused.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(refused.headers()[header::CONNECTION], "close");
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert_eq!(limits.available(), 1000);
    }

    /// Whether the server at `addr` keeps a connection from `source` open: it answers a request
    /// on it (a connection over a limit is closed before the request is read).
    async fn served_from(source: &str, addr: SocketAddr) -> Option<tokio::net::TcpStream> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::new(source.parse().expect("ip"), 0))
            .expect("bind");
        let mut stream = socket.connect(addr).await.expect("connect");
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .ok()?;
        let mut buf = [0u8; 256];
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("an answer or a close")
            .ok()?;
        std::str::from_utf8(&buf[..n])
            .ok()?
            .starts_with("HTTP/1.1 200")
            .then_some(stream)
    }

    #[tokio::test]
    async fn plain_connections_keep_to_the_address_and_total_limits() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let shutdown = CancellationToken::new();
        let limits = ConnectionLimits {
            max_connections: 3,
            max_connections_per_address: 2,
            ..HEALTH_LIMITS
        };
        tokio::spawn(serve(
            listener,
            None,
            health_router(Arc::new(Readiness::default())),
            limits,
            shutdown.clone(),
            Duration::from_secs(1),
        ));
        let first = served_from("127.0.0.1", addr).await.expect("first");
        let _second = served_from("127.0.0.1", addr).await.expect("second");
        assert!(
            served_from("127.0.0.1", addr).await.is_none(),
            "a third from one address"
        );
        let _other = served_from("127.0.0.2", addr)
            .await
            .expect("another address");
        assert!(
            served_from("127.0.0.3", addr).await.is_none(),
            "a fourth in all"
        );
        drop(first);
        let mut again = None;
        for _ in 0..50 {
            again = served_from("127.0.0.3", addr).await;
            if again.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(again.is_some(), "no place freed after a connection closed");
        shutdown.cancel();
    }

    #[tokio::test]
    async fn request_heads_over_16_kib_are_refused() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let shutdown = CancellationToken::new();
        tokio::spawn(serve(
            listener,
            None,
            health_router(Arc::new(Readiness::default())),
            HEALTH_LIMITS,
            shutdown.clone(),
            Duration::from_secs(1),
        ));
        let head = |filler: usize| {
            format!(
                "GET /healthz HTTP/1.1\r\nhost: x\r\nx-filler: {}\r\nconnection: close\r\n\r\n",
                "a".repeat(filler)
            )
        };
        for (filler, ok) in [(8 * 1024, true), (20 * 1024, false)] {
            let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            // The server may close while the head is still being written.
            let _ = stream.write_all(head(filler).as_bytes()).await;
            let mut answer = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer))
                .await
                .expect("an answer or a close");
            assert_eq!(
                answer.starts_with(b"HTTP/1.1 200"),
                ok,
                "{filler} bytes of header: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        shutdown.cancel();
    }
}
