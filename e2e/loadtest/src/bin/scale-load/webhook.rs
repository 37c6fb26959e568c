//! `scale-load webhook`: how many admission reviews the sharder's webhook answers on one core, and
//! its latency under concurrent clients, next to a trivial webhook on the same transport (issue 13,
//! goal 5).
//!
//! Everything runs in this process, without a control plane:
//!
//! - **Servers.** Two webhooks, each served on **one core**: a tokio `current_thread` runtime on an
//!   OS thread of its own, running `kube_sharder::server::serve_tls` (the sharder's own TLS server, with
//!   its `CertReloader` and an RSA-2048 certificate for 127.0.0.1 from the harness's generator). On
//!   that thread run the TLS records, HTTP/2 and the handler, and nothing else, so the thread's
//!   CPU time (`/proc/self/task/<tid>/stat`) is the server's whole cost. One serves the trivial
//!   webhook of `e2e::trivial_webhook` (one constant patch); the other serves the sharder's
//!   `webhook::router` with rings of 3 and 100 available shards, their views built with
//!   `views::build_view` and inserted directly, as the sharder's benches do.
//! - **Clients.** A multi-threaded runtime of its own (`--client-threads`, by default one fewer
//!   than the machine's cores, so the server keeps a core), opening `--connections` persistent TLS
//!   connections that speak **HTTP/2** (ALPN `h2`), as kube-apiserver calls webhooks. Each
//!   connection carries `--streams` requests in flight (1: each connection sends reviews back to
//!   back). A review is a Secret CREATE as the API server sends it (user info, options, a data
//!   field, managed fields), with a new uid and object name each time.
//! - **Measurement.** After `--warmup` seconds of load, `--seconds` are measured: the reviews
//!   answered in that window per second, their client-observed latency (p50, p99, max), and the
//!   server thread's CPU time over the window. Reviews per second of server CPU time is the
//!   throughput of one fully used core, whether or not the clients kept the server busy.
//! - **Correctness.** Every response must answer its review's uid and allow the object with a JSON
//!   patch that sets the webhook's label: `yes` for the trivial one, and for the sharder the shard
//!   the ring's hash assigns the Secret to (`e2e::fixtures::expected_shard`). Anything else counts
//!   as an error, and the tool fails after its report if there was any.
//!
//! ```sh
//! cargo build --release -p sharding-e2e --bin scale-load
//! target/release/scale-load webhook [--connections 64,1] [--shards 3,100] [--json]
//! ```

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use axum::Router;
use axum::body::Bytes;
use axum::http::{Request, StatusCode, Uri, header};
use e2e::IndependentRing;
use e2e::fixtures::{expected_shard, ring_spec, secret_review};
use e2e::latency::Latencies;
use e2e::trivial_webhook::{self, FIXED_LABEL};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::ByteString;
use kube_sharder::metrics::Metrics;
use kube_sharder::views::{ResourceInfo, Views, build_view};
use kube_sharder::webhook::WebhookState;
use kube_sharding_api::{ClusterRing, GroupResource, labels};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;

use crate::samples;

/// Namespace of the reviewed Secrets.
const NAMESPACE: &str = "webhook-load";

/// Measures the webhook's throughput on one core against a trivial webhook's.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Concurrent client connections; one measurement per value.
    #[arg(long, value_delimiter = ',', default_value = "64,1")]
    connections: Vec<usize>,
    /// Requests in flight on each connection (HTTP/2 streams).
    #[arg(long, default_value_t = 1)]
    streams: usize,
    /// Available shards of the sharder's ring; one measurement per value.
    #[arg(long, value_delimiter = ',', default_value = "3,100")]
    shards: Vec<usize>,
    /// Seconds measured per webhook and connection count.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Seconds of load before each measurement, not counted.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Worker threads of the clients' runtime [default: the machine's cores less one, at least 1].
    #[arg(long)]
    client_threads: Option<usize>,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs the measurements and prints the report; fails if any review was answered wrongly.
pub(crate) fn run(args: &Args) -> anyhow::Result<()> {
    ensure!(
        !args.connections.is_empty() && args.connections.iter().all(|&c| c > 0),
        "--connections must be positive"
    );
    ensure!(args.streams > 0, "--streams must be positive");
    ensure!(args.seconds > 0, "--seconds must be positive");
    ensure!(
        args.shards.iter().all(|&s| s > 0),
        "--shards must be positive"
    );
    let client_threads = args.client_threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1))
    });

    let cert_dir = std::env::temp_dir().join(e2e::unique_name("scale-load-webhook-certs"));
    let tls = trivial_webhook::loopback_tls(&cert_dir)?;
    let connector = tls_connector(&cert_dir.join("ca.crt"))?;
    let (state, rings) = sharder_state(&args.shards);
    let trivial = OneCoreServer::start("trivial-webhook", trivial_webhook::router()?, tls.clone())?;
    let sharder =
        OneCoreServer::start("sharder-webhook", kube_sharder::webhook::router(state), tls)?;

    let mut targets = vec![Arc::new(Target::trivial(trivial.addr)?)];
    for (shards, ring) in rings {
        targets.push(Arc::new(Target::sharder(sharder.addr, shards, ring)?));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(client_threads)
        .enable_all()
        .build()
        .context("failed to start the clients' runtime")?;
    let mut measurements = Vec::new();
    for &connections in &args.connections {
        for target in &targets {
            let server = match target.webhook {
                Webhook::Trivial => &trivial,
                Webhook::Sharder { .. } => &sharder,
            };
            let load = Load {
                connections,
                streams: args.streams,
                warmup: Duration::from_secs(args.warmup),
                seconds: Duration::from_secs(args.seconds),
            };
            let measurement = runtime.block_on(measure(target, &connector, server, &load))?;
            eprintln!("{}", measurement.row());
            measurements.push(measurement);
        }
    }
    drop(runtime);
    drop((trivial, sharder));
    let _ = std::fs::remove_dir_all(&cert_dir);

    let report = Report {
        seconds: args.seconds,
        warmup: args.warmup,
        streams: args.streams,
        client_threads,
        measurements,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.json())?);
    } else {
        print!("{}", report.text());
    }
    let errors: usize = report.measurements.iter().map(|m| m.errors).sum();
    if errors > 0 {
        let first = report
            .measurements
            .iter()
            .find_map(|m| m.first_error.as_deref())
            .unwrap_or_default();
        bail!("{errors} reviews were not answered as expected; the first: {first}");
    }
    Ok(())
}

/// The sharder's webhook state with one ring over Secrets per entry of `shard_counts`, each with
/// that many available shards of weight 1, and those rings as the tool predicts assignments.
fn sharder_state(shard_counts: &[usize]) -> (WebhookState, Vec<(usize, ExpectedRing)>) {
    let info = ResourceInfo::core_namespaced;
    // What discovery would report for the resources of `ring_spec`.
    let discovered = HashMap::from([
        (GroupResource::new("", "secrets"), info("Secret")),
        (GroupResource::new("", "configmaps"), info("ConfigMap")),
    ]);
    let views = Arc::new(Views::default());
    let mut rings = Vec::new();
    for &count in shard_counts {
        let name = format!("load-{count}");
        let shards: BTreeMap<String, u32> = (0..count).map(|i| (format!("shard-{i}"), 1)).collect();
        let ring = ClusterRing::new(&name, ring_spec(NAMESPACE));
        views.insert(build_view(&ring, &shards, &discovered, &Default::default()));
        let expected = ExpectedRing {
            ring: IndependentRing::unweighted(shards.keys()),
            label: labels::shard_label(&name),
            name,
        };
        rings.push((count, expected));
    }
    let state = WebhookState {
        views,
        metrics: Metrics::default(),
        client: None,
    };
    (state, rings)
}

/// A ring as the tool checks the sharder's answers against it.
struct ExpectedRing {
    name: String,
    label: String,
    ring: IndependentRing,
}

/// A webhook served on one core: a tokio `current_thread` runtime on a dedicated OS thread, so
/// that the server's whole work (accepting, TLS, HTTP/2, the handler) runs on that one thread.
struct OneCoreServer {
    addr: SocketAddr,
    /// The thread's id, for its CPU time in `/proc/self/task/<tid>/stat`.
    tid: u32,
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OneCoreServer {
    fn start(name: &str, app: Router, tls: TlsAcceptor) -> anyhow::Result<Self> {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .context("failed to listen on loopback")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let token = stop.clone();
        let (started, ready) = std::sync::mpsc::channel::<anyhow::Result<u32>>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let set_up = || -> anyhow::Result<_> {
                    let tid = thread_id()?;
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?;
                    // The listener joins the reactor of the runtime that serves it.
                    let listener = {
                        let _entered = runtime.enter();
                        tokio::net::TcpListener::from_std(listener)?
                    };
                    Ok((tid, runtime, listener))
                };
                match set_up() {
                    Ok((tid, runtime, listener)) => {
                        let _ = started.send(Ok(tid));
                        runtime.block_on(kube_sharder::server::serve_tls(
                            listener,
                            tls,
                            app,
                            kube_sharder::server::ConnectionLimits::default(),
                            token,
                            Duration::from_secs(1),
                        ));
                    }
                    Err(error) => {
                        let _ = started.send(Err(error));
                    }
                }
            })
            .context("failed to start a server thread")?;
        let tid = ready
            .recv()
            .context("the server thread ended before serving")?
            .with_context(|| format!("failed to start {name}"))?;
        Ok(Self {
            addr,
            tid,
            stop,
            thread: Some(thread),
        })
    }

    /// CPU time (user + system) the server thread used so far, in seconds.
    fn cpu_seconds(&self) -> anyhow::Result<f64> {
        samples::thread_cpu_seconds(self.tid)
    }
}

impl Drop for OneCoreServer {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The calling thread's id, from the `/proc/thread-self` link (`<pid>/task/<tid>`).
fn thread_id() -> anyhow::Result<u32> {
    let link =
        std::fs::read_link("/proc/thread-self").context("failed to read /proc/thread-self")?;
    tid_of(&link).with_context(|| format!("unexpected /proc/thread-self: {}", link.display()))
}

fn tid_of(link: &Path) -> Option<u32> {
    link.file_name()?.to_str()?.parse().ok()
}

/// Which webhook a measurement calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Webhook {
    Trivial,
    Sharder { shards: usize },
}

impl Webhook {
    fn title(self) -> String {
        match self {
            Webhook::Trivial => "trivial".into(),
            Webhook::Sharder { shards } => format!("sharder ({shards} shards)"),
        }
    }
}

/// A webhook as the clients call and check it.
struct Target {
    webhook: Webhook,
    uri: Uri,
    /// The label the webhook's patch must set.
    label: String,
    /// The ring whose assignment the label's value must be; `None`: the value is `yes`.
    ring: Option<IndependentRing>,
    review: ReviewTemplate,
}

impl Target {
    fn trivial(addr: SocketAddr) -> anyhow::Result<Self> {
        Ok(Self {
            webhook: Webhook::Trivial,
            uri: format!("https://{addr}{}", trivial_webhook::PATH).parse()?,
            label: FIXED_LABEL.into(),
            ring: None,
            review: ReviewTemplate::new()?,
        })
    }

    fn sharder(addr: SocketAddr, shards: usize, expected: ExpectedRing) -> anyhow::Result<Self> {
        Ok(Self {
            webhook: Webhook::Sharder { shards },
            uri: format!(
                "https://{addr}/webhooks/sharder/clusterring/{}",
                expected.name
            )
            .parse()?,
            label: expected.label,
            ring: Some(expected.ring),
            review: ReviewTemplate::new()?,
        })
    }

    /// The value the webhook must give its label on Secret `name`.
    fn expected_value(&self, name: &str) -> anyhow::Result<&str> {
        match &self.ring {
            None => Ok("yes"),
            Some(ring) => expected_shard(ring, NAMESPACE, name).context("the ring has no shards"),
        }
    }
}

/// The body of a Secret CREATE review as kube-apiserver sends it, with placeholders for the
/// request's uid and the Secret's name.
struct ReviewTemplate(String);

impl ReviewTemplate {
    const UID: &str = "@UID@";
    const NAME: &str = "@NAME@";

    fn new() -> anyhow::Result<Self> {
        let mut review =
            secret_review(Self::UID, NAMESPACE, Self::NAME, &[("app", "webhook-load")]);
        let secret = json!({"group": "", "version": "v1", "kind": "Secret"});
        let secrets = json!({"group": "", "version": "v1", "resource": "secrets"});
        let request = &mut review["request"];
        request["name"] = Self::NAME.into();
        request["requestKind"] = secret;
        request["requestResource"] = secrets;
        request["userInfo"] = json!({
            "username": "system:serviceaccount:webhook-load:writer",
            "uid": "3b6d5c1e-2f7a-4f55-9d0c-8e1a2b3c4d5e",
            "groups": ["system:serviceaccounts", "system:serviceaccounts:webhook-load", "system:authenticated"],
        });
        request["oldObject"] = Value::Null;
        request["dryRun"] = false.into();
        request["options"] = json!({
            "apiVersion": "meta.k8s.io/v1",
            "kind": "CreateOptions",
            "fieldManager": "writer",
        });
        let object = &mut request["object"];
        object["apiVersion"] = "v1".into();
        object["kind"] = "Secret".into();
        object["type"] = "Opaque".into();
        object["data"] = json!({"payload": serde_json::to_value(ByteString(vec![b'x'; 256]))?});
        object["metadata"]["creationTimestamp"] = Value::Null;
        object["metadata"]["managedFields"] = json!([{
            "manager": "writer",
            "operation": "Update",
            "apiVersion": "v1",
            "time": "2026-11-23T06:00:00Z",
            "fieldsType": "FieldsV1",
            "fieldsV1": {
                "f:data": {".": {}, "f:payload": {}},
                "f:metadata": {"f:labels": {".": {}, "f:app": {}}},
                "f:type": {},
            },
        }]);
        Ok(Self(serde_json::to_string(&review)?))
    }

    fn render(&self, uid: &str, name: &str) -> String {
        self.0.replace(Self::UID, uid).replace(Self::NAME, name)
    }
}

/// Checks that `body` is an AdmissionReview response to `uid` that allows the object with a JSON
/// patch setting label `key` to `value` (as one `add` of the label, or of all labels).
fn verify(body: &[u8], uid: &str, key: &str, value: &str) -> anyhow::Result<()> {
    let review: Value = serde_json::from_slice(body).context("response is not JSON")?;
    let response = &review["response"];
    ensure!(response["uid"] == uid, "response to another uid: {review}");
    ensure!(response["allowed"] == true, "not allowed: {review}");
    ensure!(
        response["patchType"] == "JSONPatch",
        "no JSON patch: {review}"
    );
    let patch: ByteString =
        serde_json::from_value(response["patch"].clone()).context("patch is not base64")?;
    let operations: Vec<Value> =
        serde_json::from_slice(&patch.0).context("patch is not a list of operations")?;
    let pointer = format!(
        "/metadata/labels/{}",
        key.replace('~', "~0").replace('/', "~1")
    );
    let sets_label = operations.iter().any(|op| {
        op["op"] == "add"
            && ((op["path"] == pointer.as_str() && op["value"] == value)
                || (op["path"] == "/metadata/labels" && op["value"][key] == value))
    });
    ensure!(
        sets_label,
        "patch does not set {key}={value}: {}",
        Value::from(operations)
    );
    Ok(())
}

/// How hard and how long one measurement loads a webhook.
#[derive(Clone, Copy, Debug)]
struct Load {
    connections: usize,
    streams: usize,
    warmup: Duration,
    seconds: Duration,
}

/// What one measurement saw.
#[derive(Debug)]
struct Measurement {
    webhook: Webhook,
    connections: usize,
    streams: usize,
    /// Length of the measured window.
    seconds: f64,
    /// Reviews answered within the window.
    reviews: usize,
    latencies: Latencies,
    /// CPU time of the server thread over the window.
    server_cpu_seconds: f64,
    /// Reviews answered wrongly or not at all, warm-up included.
    errors: usize,
    first_error: Option<String>,
}

impl Measurement {
    fn per_second(&self) -> f64 {
        self.reviews as f64 / self.seconds
    }

    /// The share of one core the server used.
    fn server_cpu_share(&self) -> f64 {
        self.server_cpu_seconds / self.seconds
    }

    /// Reviews per second of server CPU time: the throughput of one fully used core.
    fn per_cpu_second(&self) -> f64 {
        self.reviews as f64 / self.server_cpu_seconds
    }

    fn row(&self) -> String {
        let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
        format!(
            "{:<20} {:>5} {:>11.0} {:>9.1} % {:>13.0} {:>10} {:>10} {:>10} {:>6}",
            self.webhook.title(),
            self.connections,
            self.per_second(),
            self.server_cpu_share() * 100.0,
            self.per_cpu_second(),
            ms(self.latencies.median),
            ms(self.latencies.p99),
            ms(self.latencies.max),
            self.errors,
        )
    }

    fn json(&self) -> Value {
        let shards = match self.webhook {
            Webhook::Trivial => Value::Null,
            Webhook::Sharder { shards } => shards.into(),
        };
        json!({
            "webhook": match self.webhook {
                Webhook::Trivial => "trivial",
                Webhook::Sharder { .. } => "sharder",
            },
            "shards": shards,
            "connections": self.connections,
            "streams_per_connection": self.streams,
            "seconds": self.seconds,
            "reviews": self.reviews,
            "reviews_per_second": round(self.per_second()),
            "server_cpu_seconds": self.server_cpu_seconds,
            "server_cpu_share": round(self.server_cpu_share()),
            "reviews_per_server_cpu_second": round(self.per_cpu_second()),
            "latency": self.latencies.json(),
            "errors": self.errors,
        })
    }
}

/// Rounds to three decimals, for JSON.
fn round(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// Loads `target` on `server` as `load` says and measures it.
async fn measure(
    target: &Arc<Target>,
    connector: &TlsConnector,
    server: &OneCoreServer,
    load: &Load,
) -> anyhow::Result<Measurement> {
    // Connection drivers and workers belong to this measurement: they end with it.
    let mut drivers = JoinSet::new();
    let mut senders = Vec::with_capacity(load.connections);
    for _ in 0..load.connections {
        senders.push(connect(server.addr, connector, &mut drivers).await?);
    }
    let start = Instant::now() + load.warmup;
    let end = start + load.seconds;
    let mut workers = JoinSet::new();
    for (c, sender) in senders.iter().enumerate() {
        for s in 0..load.streams {
            let worker = Worker {
                id: c * load.streams + s,
                sender: sender.clone(),
                target: target.clone(),
                window: (start, end),
            };
            workers.spawn(worker.run());
        }
    }
    drop(senders);
    tokio::time::sleep_until(start).await;
    let cpu_start = server.cpu_seconds()?;
    tokio::time::sleep_until(end).await;
    let cpu_end = server.cpu_seconds()?;

    let mut samples = Vec::new();
    let (mut errors, mut first_error) = (0, None);
    while let Some(tally) = workers.join_next().await {
        let tally = tally.context("a client worker panicked")?;
        samples.extend(tally.latencies);
        errors += tally.errors;
        first_error = first_error.or(tally.first_error);
    }
    // The connections close once the workers dropped their senders; don't wait on a slow one.
    let closed = async { while drivers.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(1), closed)
        .await
        .is_err()
    {
        drivers.abort_all();
    }
    let reviews = samples.len();
    ensure!(
        reviews > 0,
        "{}: no review answered in the window; the first error: {}",
        target.webhook.title(),
        first_error.unwrap_or_default()
    );
    Ok(Measurement {
        webhook: target.webhook,
        connections: load.connections,
        streams: load.streams,
        seconds: load.seconds.as_secs_f64(),
        reviews,
        latencies: Latencies::of(&mut samples)?,
        server_cpu_seconds: cpu_end - cpu_start,
        errors,
        first_error,
    })
}

/// Opens one TLS connection to `addr` that speaks HTTP/2, its driver spawned into `drivers`.
async fn connect(
    addr: SocketAddr,
    connector: &TlsConnector,
    drivers: &mut JoinSet<()>,
) -> anyhow::Result<SendRequest<Full<Bytes>>> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("failed to connect to {addr}"))?;
    // As Go's net/http, which kube-apiserver calls webhooks with, sets it.
    tcp.set_nodelay(true)?;
    let tls = connector
        .connect(ServerName::from(addr.ip()), tcp)
        .await
        .context("TLS handshake failed")?;
    ensure!(
        tls.get_ref().1.alpn_protocol() == Some(b"h2"),
        "the server did not agree to HTTP/2"
    );
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .context("HTTP/2 handshake failed")?;
    drivers.spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// A rustls client trusting only the CA at `ca`, offering only HTTP/2.
fn tls_connector(ca: &Path) -> anyhow::Result<TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca)
        .with_context(|| format!("failed to read {}", ca.display()))?
    {
        roots.add(cert?)?;
    }
    let mut config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}

/// One stream of requests: reviews sent back to back until the window ends.
struct Worker {
    id: usize,
    sender: SendRequest<Full<Bytes>>,
    target: Arc<Target>,
    window: (Instant, Instant),
}

/// What a worker saw.
#[derive(Default)]
struct Tally {
    /// Latencies of the reviews answered within the window.
    latencies: Vec<Duration>,
    errors: usize,
    first_error: Option<String>,
}

impl Worker {
    async fn run(mut self) -> Tally {
        let (start, end) = self.window;
        let mut tally = Tally::default();
        for seq in 0u64.. {
            if Instant::now() >= end || self.sender.is_closed() {
                break;
            }
            // Names and uids unique per request, so the sharder hashes a new key each time.
            let uid = format!("00000000-0000-4000-8000-{:04x}{seq:08x}", self.id);
            let name = format!("secret-{}-{seq}", self.id);
            match self.review(&uid, &name).await {
                Ok((sent, answered)) if answered >= start && answered <= end => {
                    tally.latencies.push(answered - sent);
                }
                Ok(_) => {}
                Err(error) => {
                    tally.errors += 1;
                    tally
                        .first_error
                        .get_or_insert_with(|| format!("{error:#}"));
                }
            }
        }
        tally
    }

    /// Sends one review and checks the answer; when it was sent and when its answer was read
    /// (building the request and checking the answer are not part of its latency).
    async fn review(&mut self, uid: &str, name: &str) -> anyhow::Result<(Instant, Instant)> {
        let target = &self.target;
        let body = target.review.render(uid, name);
        let request = Request::post(target.uri.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let sent = Instant::now();
        self.sender.ready().await.context("connection closed")?;
        let response = self
            .sender
            .send_request(request)
            .await
            .context("request failed")?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        let answered = Instant::now();
        ensure!(status == StatusCode::OK, "status {status}");
        verify(&body, uid, &target.label, target.expected_value(name)?)?;
        Ok((sent, answered))
    }
}

/// All measurements of a run.
struct Report {
    seconds: u64,
    warmup: u64,
    streams: usize,
    client_threads: usize,
    measurements: Vec<Measurement>,
}

/// The sharder's figures over the trivial webhook's at one connection count.
#[derive(Debug, PartialEq)]
struct Ratio {
    connections: usize,
    shards: usize,
    per_second: f64,
    per_cpu_second: f64,
    p99: f64,
}

impl Report {
    fn ratios(&self) -> Vec<Ratio> {
        let trivial = |connections| {
            self.measurements
                .iter()
                .find(|m| m.webhook == Webhook::Trivial && m.connections == connections)
        };
        self.measurements
            .iter()
            .filter_map(|m| {
                let Webhook::Sharder { shards } = m.webhook else {
                    return None;
                };
                let t = trivial(m.connections)?;
                Some(Ratio {
                    connections: m.connections,
                    shards,
                    per_second: m.per_second() / t.per_second(),
                    per_cpu_second: m.per_cpu_second() / t.per_cpu_second(),
                    p99: m.latencies.p99.as_secs_f64() / t.latencies.p99.as_secs_f64(),
                })
            })
            .collect()
    }

    fn text(&self) -> String {
        let mut out = format!(
            "scale-load webhook: {} s measured after {} s of warm-up; HTTP/2 over TLS on loopback, \
             {} stream(s) per connection, {} client thread(s); each server on one core\n\n",
            self.seconds, self.warmup, self.streams, self.client_threads
        );
        out.push_str(&header());
        out.push('\n');
        for m in &self.measurements {
            out.push_str(&m.row());
            out.push('\n');
        }
        out.push_str("\nsharder / trivial:\n");
        for r in self.ratios() {
            out.push_str(&format!(
                "  {:>3} connections, {:>3} shards: reviews/s {:.3}, reviews per server CPU-second {:.3}, p99 {:.3}\n",
                r.connections, r.shards, r.per_second, r.per_cpu_second, r.p99
            ));
        }
        out
    }

    fn json(&self) -> Value {
        let ratios: Vec<Value> = self
            .ratios()
            .iter()
            .map(|r| {
                json!({
                    "connections": r.connections,
                    "shards": r.shards,
                    "reviews_per_second": round(r.per_second),
                    "reviews_per_server_cpu_second": round(r.per_cpu_second),
                    "p99": round(r.p99),
                })
            })
            .collect();
        json!({
            "transport": "HTTP/2 over TLS on loopback",
            "seconds": self.seconds,
            "warmup_seconds": self.warmup,
            "streams_per_connection": self.streams,
            "client_threads": self.client_threads,
            "measurements": self.measurements.iter().map(Measurement::json).collect::<Vec<_>>(),
            "sharder_over_trivial": ratios,
        })
    }
}

/// The column titles of [`Measurement::row`].
fn header() -> String {
    format!(
        "{:<20} {:>5} {:>11} {:>11} {:>13} {:>10} {:>10} {:>10} {:>6}",
        "webhook",
        "conns",
        "reviews/s",
        "server CPU",
        "reviews/CPU-s",
        "p50",
        "p99",
        "max",
        "errors"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measurement(
        webhook: Webhook,
        connections: usize,
        reviews: usize,
        cpu: f64,
        p99_ms: u64,
    ) -> Measurement {
        let ms = Duration::from_millis;
        Measurement {
            webhook,
            connections,
            streams: 1,
            seconds: 10.0,
            reviews,
            latencies: Latencies {
                median: ms(1),
                p99: ms(p99_ms),
                mean: ms(1),
                min: ms(1),
                max: ms(p99_ms + 1),
            },
            server_cpu_seconds: cpu,
            errors: 0,
            first_error: None,
        }
    }

    fn report() -> Report {
        let sharder = Webhook::Sharder { shards: 3 };
        Report {
            seconds: 10,
            warmup: 2,
            streams: 1,
            client_threads: 1,
            measurements: vec![
                measurement(Webhook::Trivial, 64, 100_000, 10.0, 4),
                measurement(sharder, 64, 80_000, 10.0, 5),
                measurement(Webhook::Trivial, 1, 20_000, 5.0, 2),
                measurement(sharder, 1, 20_000, 8.0, 2),
            ],
        }
    }

    #[test]
    fn ratios_pair_each_sharder_measurement_with_the_trivial_one() {
        assert_eq!(
            report().ratios(),
            vec![
                Ratio {
                    connections: 64,
                    shards: 3,
                    per_second: 0.8,
                    per_cpu_second: 0.8,
                    p99: 1.25,
                },
                Ratio {
                    connections: 1,
                    shards: 3,
                    per_second: 1.0,
                    per_cpu_second: 0.625,
                    p99: 1.0,
                },
            ]
        );
    }

    #[test]
    fn text_report() {
        let text = report().text();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("scale-load webhook: 10 s measured after 2 s of warm-up"));
        assert_eq!(
            lines[3],
            "trivial                 64       10000     100.0 %         10000    1.00 ms    4.00 ms    5.00 ms      0"
        );
        assert_eq!(
            lines[6],
            "sharder (3 shards)       1        2000      80.0 %          2500    1.00 ms    2.00 ms    3.00 ms      0"
        );
        assert_eq!(lines[2].split_whitespace().next(), Some("webhook"));
        assert_eq!(
            lines[10],
            "    1 connections,   3 shards: reviews/s 1.000, reviews per server CPU-second 0.625, p99 1.000"
        );
    }

    #[test]
    fn json_report() {
        let json = report().json();
        assert_eq!(json["measurements"][1]["webhook"], "sharder");
        assert_eq!(json["measurements"][1]["shards"], 3);
        assert_eq!(json["measurements"][0]["shards"], Value::Null);
        assert_eq!(json["measurements"][1]["reviews_per_second"], 8000.0);
        assert_eq!(json["measurements"][1]["latency"]["p99_ms"], 5.0);
        assert_eq!(json["sharder_over_trivial"][0]["p99"], 1.25);
    }

    fn response(uid: &str, allowed: bool, patch: &Value) -> Vec<u8> {
        let patch =
            serde_json::to_value(ByteString(patch.to_string().into_bytes())).expect("base64");
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": uid, "allowed": allowed, "patchType": "JSONPatch", "patch": patch},
        })
        .to_string()
        .into_bytes()
    }

    #[test]
    fn verify_accepts_only_the_expected_label() {
        let key = "shard.alpha.sharding.timebertt.dev/clusterring-load-3";
        let one = json!([{"op": "add", "path": "/metadata/labels/shard.alpha.sharding.timebertt.dev~1clusterring-load-3", "value": "shard-1"}]);
        let all = json!([{"op": "add", "path": "/metadata/labels", "value": {}},
                         {"op": "add", "path": "/metadata/labels", "value": {key: "shard-1"}}]);
        assert!(verify(&response("u1", true, &one), "u1", key, "shard-1").is_ok());
        assert!(verify(&response("u1", true, &all), "u1", key, "shard-1").is_ok());
        assert!(verify(&response("u1", true, &one), "u1", key, "shard-2").is_err());
        assert!(verify(&response("u1", true, &one), "u2", key, "shard-1").is_err());
        assert!(verify(&response("u1", false, &one), "u1", key, "shard-1").is_err());
        assert!(verify(&response("u1", true, &json!([])), "u1", key, "shard-1").is_err());
        assert!(verify(b"{}", "u1", key, "shard-1").is_err());
    }

    #[test]
    fn review_template_fills_uid_and_name() {
        let template = ReviewTemplate::new().expect("template");
        let review: Value =
            serde_json::from_str(&template.render("uid-1", "secret-1")).expect("JSON");
        let request = &review["request"];
        assert_eq!(request["uid"], "uid-1");
        assert_eq!(request["name"], "secret-1");
        assert_eq!(request["object"]["metadata"]["name"], "secret-1");
        assert_eq!(request["object"]["metadata"]["namespace"], NAMESPACE);
        assert_eq!(request["operation"], "CREATE");
    }

    #[test]
    fn thread_ids_from_proc_links() {
        assert_eq!(tid_of(Path::new("1234/task/5678")), Some(5678));
        assert_eq!(tid_of(Path::new("1234/task/x")), None);
    }
}
