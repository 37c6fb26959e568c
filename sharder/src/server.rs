//! HTTP servers of the sharder process: the TLS server of the webhook and of the metrics (with
//! their certificate reloaded by [`tls`]), the metrics' authentication and authorization
//! (`metrics_auth`), and the plain health server.

mod metrics_auth;

pub(crate) use self::metrics_auth::ReviewClients;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus_client::registry::Registry;
use sharding_crds::config::SharderConfig;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// How long a client may take for the TLS handshake before its connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the accept loop pauses after a failed `accept` (out of file descriptors, say), so a
/// persistent error does not spin a core.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Bounds on the webhook server's connections, so that slow, idle or numerous clients cannot
/// hold the server's memory or file descriptors. The API server opens a few long-lived HTTP/2
/// connections per replica and sends each review at once, so none of these touch it.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Connections open at once; a connection beyond this is closed as soon as it is accepted.
    pub max_connections: usize,
    /// How long an HTTP/1 client may take to send a request's headers, counted from the
    /// connection's start or the previous answer: an idle keep-alive connection is closed after
    /// this long too.
    pub header_timeout: Duration,
    /// Interval of HTTP/2 keep-alive pings; a client that leaves one unanswered for
    /// `header_timeout` is disconnected.
    pub keep_alive_interval: Duration,
    /// Concurrent HTTP/2 streams (requests) per connection.
    pub max_concurrent_streams: u32,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 1000,
            header_timeout: Duration::from_secs(10),
            keep_alive_interval: Duration::from_secs(30),
            max_concurrent_streams: 250,
        }
    }
}

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

/// Bounds on the metrics server's connections: a few scrapers, each with a connection or two.
const METRICS_LIMITS: ConnectionLimits = ConnectionLimits {
    max_connections: 100,
    header_timeout: Duration::from_secs(10),
    keep_alive_interval: Duration::from_secs(30),
    max_concurrent_streams: 10,
};

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
            tracing::info!(address = %listener.local_addr()?, "serving metrics over HTTPS to authorized clients");
            tasks.spawn(serve_tls(
                listener,
                acceptor,
                secure_metrics_router(registry, clients, config.metrics.token_audiences.clone()),
                METRICS_LIMITS,
                shutdown.clone(),
                config.graceful_shutdown.0,
            ));
        } else {
            tracing::warn!(address = %listener.local_addr()?, "serving metrics over plain HTTP without authentication (metrics.secure is false)");
            tasks.spawn(serve_plain(
                listener,
                metrics_router(registry),
                shutdown.clone(),
            ));
        }
    }
    if let Some(addr) = config.health.socket_addr()? {
        let listener = bind(addr).await?;
        tracing::info!(address = %listener.local_addr()?, "serving health probes");
        tasks.spawn(serve_plain(
            listener,
            health_router(readiness),
            shutdown.clone(),
        ));
    }
    Ok(())
}

/// Serves `app` over plain HTTP on `listener` until `shutdown` fires.
pub(crate) async fn serve_plain(listener: TcpListener, app: Router, shutdown: CancellationToken) {
    let addr = listener.local_addr().ok();
    if let Err(error) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
    {
        tracing::error!(%error, ?addr, "HTTP server failed");
    }
}

/// Serves `app` over TLS on `listener` within `limits` until `shutdown` fires, then lets open
/// requests finish for at most `drain`. The webhook and the secure metrics run on it.
pub async fn serve_tls(
    listener: TcpListener,
    tls: TlsAcceptor,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
    drain: Duration,
) {
    let local = listener.local_addr().ok();
    let graceful = GracefulShutdown::new();
    let open = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(error) => {
                    tracing::warn!(%error, ?local, "failed to accept a TLS connection");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            },
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            tracing::debug!(%peer, ?local, max = limits.max_connections, "too many connections; closing the new one");
            continue;
        };
        // An answer leaves in several small writes (TLS records, HTTP/2 frames); with Nagle's
        // algorithm a later one waits for the client's ACK of the first, which a client may delay
        // by 40 ms. Go's clients, the API server's included, set this on their side already.
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, %peer, "failed to set TCP_NODELAY");
        }
        let tls = tls.clone();
        let service = TowerToHyperService::new(app.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _permit = permit;
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
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
            // The protocol the handshake agreed on. Left to itself, the builder would wait for a
            // client's first bytes to tell the protocols apart, and a client that sends nothing
            // would never meet a timeout.
            let http2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
            let mut builder = auto::Builder::new(TokioExecutor::new());
            // hyper applies its timeouts only with a timer.
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            builder
                .http2()
                .timer(TokioTimer::new())
                .keep_alive_interval(limits.keep_alive_interval)
                .keep_alive_timeout(limits.header_timeout)
                .max_concurrent_streams(limits.max_concurrent_streams);
            let builder = if http2 {
                builder.http2_only()
            } else {
                builder.http1_only()
            };
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
            ?local,
            "connections still open after the shutdown grace period"
        );
    }
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
    use axum::body::Body;
    use axum::http::Request;
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
}
