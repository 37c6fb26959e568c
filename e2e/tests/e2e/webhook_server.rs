//! The webhook server's connection limits, over real sockets on loopback: the server the sharder
//! runs ([`kube_sharder::server::serve_tls`], its certificate served as the sharder serves it), with
//! limits small enough to observe; and hostile clients against a `sharder` process of the test's
//! own (slow bodies, many large bodies, a flood of its health port), with its memory measured.
//! Loopback has a whole /8: binding a client socket to 127.0.0.2, 127.0.0.3, ... makes it another
//! client address.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use e2e::fixtures::{ring_with_shards, secret_review};
use e2e::process::{Process, poll_until, status_fields};
use e2e::scenario::DedicatedScenario;
use e2e::sharder_process::{SharderFiles, SharderSettings};
use e2e::trivial_webhook;
use kube_sharder::server::ConnectionLimits;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_util::sync::CancellationToken;

/// A webhook server on a free loopback port with `limits`; its address and the stop token.
async fn server(
    dir: &Path,
    limits: ConnectionLimits,
) -> anyhow::Result<(SocketAddr, CancellationToken)> {
    let tls = trivial_webhook::loopback_tls(dir)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    tokio::spawn(kube_sharder::server::serve_tls(
        listener,
        tls,
        trivial_webhook::router()?,
        limits,
        stop.clone(),
        Duration::from_secs(1),
    ));
    Ok((addr, stop))
}

fn connector(ca: &Path) -> anyhow::Result<TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca)? {
        roots.add(cert?)?;
    }
    let mut config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}

async fn connect(
    addr: SocketAddr,
    connector: &TlsConnector,
) -> anyhow::Result<TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let tls = tokio::time::timeout(
        Duration::from_secs(5),
        connector.connect(ServerName::from(addr.ip()), tcp),
    )
    .await
    .context("TLS handshake timed out")??;
    Ok(tls)
}

/// Whether the server closes `stream` within `within`: a read ends (EOF or reset) instead of
/// timing out.
async fn closed_within(stream: &mut TlsStream<tokio::net::TcpStream>, within: Duration) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(within, stream.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// A new directory under the temporary one for a test server's CA and serving keys, removed with
/// them when the test ends.
fn dir(name: &str) -> ScratchDir {
    ScratchDir(std::env::temp_dir().join(e2e::unique_name(name)))
}

/// A directory removed when dropped.
struct ScratchDir(std::path::PathBuf);

impl std::ops::Deref for ScratchDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test]
async fn an_idle_connection_is_closed_after_the_header_timeout() -> anyhow::Result<()> {
    let dir = dir("webhook-idle");
    let limits = ConnectionLimits {
        header_timeout: Duration::from_secs(1),
        ..ConnectionLimits::default()
    };
    let (addr, stop) = server(&dir, limits).await?;
    let connector = connector(&dir.join("ca.crt"))?;
    // A client that completes the handshake and then sends nothing (a slow-loris).
    let mut stream = connect(addr, &connector).await?;
    let started = Instant::now();
    ensure!(
        closed_within(&mut stream, Duration::from_secs(5)).await,
        "an idle connection was still open after 5 s (header timeout 1 s)"
    );
    let took = started.elapsed();
    ensure!(
        took >= Duration::from_millis(900),
        "closed after {took:?}, before the timeout"
    );
    stop.cancel();
    Ok(())
}

#[tokio::test]
async fn connections_beyond_the_cap_are_closed() -> anyhow::Result<()> {
    let dir = dir("webhook-cap");
    let limits = ConnectionLimits {
        max_connections: 2,
        ..ConnectionLimits::default()
    };
    let (addr, stop) = server(&dir, limits).await?;
    let connector = connector(&dir.join("ca.crt"))?;
    let first = connect(addr, &connector).await?;
    let mut second = connect(addr, &connector).await?;
    // The third is accepted by the kernel and closed by the server at once.
    match connect(addr, &connector).await {
        Err(_) => {}
        Ok(mut third) => ensure!(
            closed_within(&mut third, Duration::from_secs(2)).await,
            "a third connection stayed open with a cap of 2"
        ),
    }
    ensure!(
        !closed_within(&mut second, Duration::from_millis(200)).await,
        "the server closed a connection within the cap"
    );
    // A place frees up when a connection ends.
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(mut again) = connect(addr, &connector).await
            && !closed_within(&mut again, Duration::from_millis(200)).await
        {
            break;
        }
        if Instant::now() > deadline {
            bail!("no connection accepted again after one of two closed");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    Ok(())
}

/// TLS 1.2 and 1.3 only: openssl's client completes a TLS 1.2 handshake and fails a TLS 1.1 one
/// (allowed on its side with security level 0, so the refusal is the server's).
#[tokio::test]
async fn tls_below_1_2_is_refused() -> anyhow::Result<()> {
    let dir = dir("webhook-tls");
    let (addr, stop) = server(&dir, ConnectionLimits::default()).await?;
    let handshake = |version: &'static str| {
        let connect = addr.to_string();
        let ca = dir.join("ca.crt");
        tokio::task::spawn_blocking(move || {
            Command::new("openssl")
                .args([
                    "s_client",
                    "-connect",
                    &connect,
                    version,
                    "-cipher",
                    "DEFAULT@SECLEVEL=0",
                    "-CAfile",
                ])
                .arg(ca)
                .stdin(Stdio::null())
                .output()
        })
    };
    // openssl's client exits 0 either way; its summary line names the agreed protocol, or
    // "(NONE)" when the handshake failed.
    let tls12 = handshake("-tls1_2").await??;
    let text = String::from_utf8_lossy(&tls12.stdout);
    ensure!(
        text.contains("New, TLSv1.2, Cipher is"),
        "TLS 1.2 handshake failed: {text}"
    );
    let tls11 = handshake("-tls1_1").await??;
    let text = String::from_utf8_lossy(&tls11.stdout);
    ensure!(
        text.contains("New, (NONE), Cipher is (NONE)") && !text.contains("TLSv1.1, Cipher"),
        "a TLS 1.1 handshake did not fail: {text}"
    );
    stop.cancel();
    Ok(())
}

/// A TCP connection to `addr` from the loopback address `source`.
async fn tcp_from(source: &str, addr: SocketAddr) -> anyhow::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(source.parse::<IpAddr>()?, 0))?;
    Ok(socket.connect(addr).await?)
}

/// A TLS connection (HTTP/1.1) to `addr` from the loopback address `source`.
async fn tls_from(
    source: &str,
    addr: SocketAddr,
    connector: &TlsConnector,
) -> anyhow::Result<TlsStream<TcpStream>> {
    let tcp = tcp_from(source, addr).await?;
    tokio::time::timeout(
        Duration::from_secs(5),
        connector.connect(ServerName::from(addr.ip()), tcp),
    )
    .await
    .context("TLS handshake timed out")?
    .context("TLS handshake failed")
}

/// What a server answered to [`post`].
#[derive(Debug)]
struct Answer {
    /// The status code, `None` when the connection ended (or the wait did) without one.
    status: Option<u16>,
    /// Whether the answer has a `Retry-After` header.
    retry_after: bool,
    /// From the first byte sent to the answer.
    took: Duration,
}

/// The same zeros for every large body, so the clients hold no memory of their own for them.
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

/// How a request body is sent by [`post`].
#[derive(Clone, Copy)]
enum Sending<'a> {
    /// These bytes at once.
    Whole(&'a [u8]),
    /// `len` zeros at once (not a valid review: only its size matters).
    Zeros(usize),
    /// These bytes, `chunk` bytes every `pause`.
    Trickle(&'a [u8], usize, Duration),
}

/// Sends an HTTP/1.1 POST of `path` over `stream`, declaring `declared` bytes of body and sending
/// `send`, then keeps the connection open without sending more; waits at most `within` for the
/// answer's head.
async fn post<S>(
    stream: S,
    path: &str,
    declared: usize,
    send: Sending<'_>,
    within: Duration,
) -> Answer
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut reader, mut writer) = tokio::io::split(stream);
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
    );
    let started = Instant::now();
    let pieces: Vec<(Vec<u8>, Duration)> = match send {
        Sending::Whole(bytes) => vec![(bytes.to_vec(), Duration::ZERO)],
        Sending::Zeros(_) => Vec::new(),
        Sending::Trickle(bytes, chunk, pause) => {
            bytes.chunks(chunk).map(|c| (c.to_vec(), pause)).collect()
        }
    };
    let zeros = match send {
        Sending::Zeros(len) => len,
        _ => 0,
    };
    let writing = tokio::spawn(async move {
        writer.write_all(head.as_bytes()).await?;
        writer.flush().await?;
        let mut left = zeros;
        while left > 0 {
            let n = left.min(ZEROS.len());
            writer.write_all(&ZEROS[..n]).await?;
            left -= n;
        }
        for (piece, pause) in pieces {
            writer.write_all(&piece).await?;
            writer.flush().await?;
            tokio::time::sleep(pause).await;
        }
        writer.flush().await?;
        // Hold the connection: the rest of a declared body never comes.
        std::future::pending::<()>().await;
        Ok::<_, std::io::Error>(writer)
    });
    let mut head = Vec::new();
    let read = tokio::time::timeout(within, async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let took = started.elapsed();
    writing.abort();
    let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let status = read
        .ok()
        .and_then(|()| text.strip_prefix("http/1.1 "))
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok());
    Answer {
        status,
        retry_after: text.contains("\r\nretry-after:"),
        took,
    }
}

/// Handshakes that never finish wait in a pool of their own: they do not take the places of
/// connections, so a client that completes its handshake is served while they last. (Before,
/// a connection took its place on accept, and these 12 kept every later client out for the
/// handshake timeout.)
#[tokio::test]
async fn idle_tls_handshakes_do_not_keep_clients_out() -> anyhow::Result<()> {
    let dir = dir("webhook-handshakes");
    let limits = ConnectionLimits {
        max_connections: 4,
        max_handshakes: 16,
        handshake_timeout: Duration::from_secs(30),
        ..ConnectionLimits::default()
    };
    let (addr, stop) = server(&dir, limits).await?;
    let connector = connector(&dir.join("ca.crt"))?;
    // Accepted by the kernel, and then not a byte: a handshake that never starts.
    let mut idle = Vec::new();
    for _ in 0..12 {
        idle.push(tcp_from("127.0.0.2", addr).await?);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let review = serde_json::to_vec(&secret_review("uid-1", "default", "s", &[]))?;
    for _ in 0..3 {
        let stream = tls_from("127.0.0.1", addr, &connector).await?;
        let answer = post(
            stream,
            trivial_webhook::PATH,
            review.len(),
            Sending::Whole(&review),
            Duration::from_secs(5),
        )
        .await;
        ensure!(
            answer.status == Some(200),
            "a client was not served beside 12 idle handshakes: {answer:?}"
        );
    }
    // The idle ones are still waiting (not closed to make room).
    ensure!(
        !closed_within_tcp(&mut idle[0], Duration::from_millis(200)).await,
        "an idle handshake was closed before its timeout"
    );
    stop.cancel();
    Ok(())
}

/// Whether the server closes a plain `stream` within `within`.
async fn closed_within_tcp(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(within, stream.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// A `sharder` process on a control plane of its own with a ring of one shard (restricted to a
/// namespace of its own), ready and answering its webhook.
struct HostileTarget {
    /// Keeps the control plane up.
    _scenario: DedicatedScenario,
    files: SharderFiles,
    sharder: Process,
    webhook: SocketAddr,
    /// The ring's webhook path.
    path: String,
    /// A valid review for the ring (a Secret created in its namespace).
    review: Vec<u8>,
    connector: TlsConnector,
}

impl HostileTarget {
    async fn start(prefix: &str) -> anyhow::Result<Self> {
        let scenario = DedicatedScenario::in_namespace(prefix).await?;
        let cluster = scenario.dedicated.cluster();
        let (ns, ring) = ring_with_shards(cluster, &scenario.client, prefix, &["shard-a"]).await?;
        let files = SharderFiles::create(cluster.kubeconfig(), &SharderSettings::default())?;
        let sharder = files.start_process()?;
        files.wait_ready(Duration::from_secs(60)).await?;
        let webhook = SocketAddr::from(([127, 0, 0, 1], files.webhook_port));
        let connector = connector(&files.ca)?;
        let target = Self {
            path: format!("/webhooks/sharder/clusterring/{ring}"),
            review: serde_json::to_vec(&secret_review("uid-1", &ns, "probe", &[]))?,
            _scenario: scenario,
            files,
            sharder,
            webhook,
            connector,
        };
        // 404 until the sharder's cache has the ring.
        poll_until(
            "the webhook to answer for the ring",
            Duration::from_secs(60),
            || async { Ok((target.review().await.status == Some(200)).then_some(())) },
        )
        .await?;
        Ok(target)
    }

    /// One real review, on a new connection from 127.0.0.1.
    async fn review(&self) -> Answer {
        match tls_from("127.0.0.1", self.webhook, &self.connector).await {
            Ok(stream) => {
                post(
                    stream,
                    &self.path,
                    self.review.len(),
                    Sending::Whole(&self.review),
                    Duration::from_secs(5),
                )
                .await
            }
            Err(error) => {
                println!("real client failed to connect: {error:#}");
                Answer {
                    status: None,
                    retry_after: false,
                    took: Duration::ZERO,
                }
            }
        }
    }

    fn pid(&self) -> anyhow::Result<u32> {
        self.sharder.id().context("the sharder has a process id")
    }
}

/// Real reviews sent one after another, every 200 ms, until `stop`: their answers.
fn keep_reviewing(
    target: Arc<HostileTarget>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<Vec<Answer>> {
    tokio::spawn(async move {
        let mut answers = Vec::new();
        while !stop.is_cancelled() {
            answers.push(target.review().await);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        answers
    })
}

/// Clients that send their headers and then trickle the body (10 bytes every 500 ms) are answered
/// 408 once the 5 s body timeout has passed, and real reviews keep being answered meanwhile.
#[tokio::test]
async fn slow_bodies_get_408_and_reviews_keep_being_answered() -> anyhow::Result<()> {
    const SLOW_CLIENTS: usize = 40;
    let target = Arc::new(HostileTarget::start("slow-body").await?);
    let stop = CancellationToken::new();
    let reviews = keep_reviewing(target.clone(), stop.clone());
    let mut slow = tokio::task::JoinSet::new();
    for _ in 0..SLOW_CLIENTS {
        let target = target.clone();
        slow.spawn(async move {
            let stream = tls_from("127.0.0.2", target.webhook, &target.connector).await?;
            let body = target.review.clone();
            Ok::<_, anyhow::Error>(
                post(
                    stream,
                    &target.path,
                    body.len(),
                    Sending::Trickle(&body, 10, Duration::from_millis(500)),
                    Duration::from_secs(20),
                )
                .await,
            )
        });
    }
    let answers = slow.join_all().await;
    stop.cancel();
    let reviews = reviews.await?;
    for answer in answers {
        let answer = answer?;
        ensure!(
            answer.status == Some(408),
            "a slow body was not answered 408: {answer:?}"
        );
        ensure!(
            answer.took >= Duration::from_millis(4500) && answer.took < Duration::from_secs(10),
            "a slow body was answered after {:?}, not about 5 s",
            answer.took
        );
    }
    println!(
        "{} real reviews during the slow bodies: {:?}",
        reviews.len(),
        reviews
            .iter()
            .map(|a| (a.status, a.took))
            .collect::<Vec<_>>()
    );
    ensure!(
        reviews.len() >= 10,
        "only {} real reviews in 5 s",
        reviews.len()
    );
    ensure!(
        reviews.iter().all(|a| a.status == Some(200)),
        "a real review was not answered during the slow bodies"
    );
    let mut target = Arc::into_inner(target).context("every client is done")?;
    target.sharder.passed();
    Ok(())
}

/// 100 clients each declare a 3 MiB body (the largest a review may be), send all of it but the last
/// few KiB and wait: the audit's way to fill a replica's memory. The sharder holds at most its
/// 32 MiB body budget of them at once; its resident memory peaks at most `RSS_BOUND_KIB` above
/// where it was before, the held bodies get 408 after 5 s and the others 503 with `Retry-After`,
/// and real reviews are answered throughout (200, or 503 with `Retry-After` while the budget is
/// full). Before the budget, the memory grew by about 3 MiB per client.
#[tokio::test]
async fn large_bodies_stay_within_the_body_budget() -> anyhow::Result<()> {
    const CLIENTS: usize = 100;
    const DECLARED: usize = 3 * 1024 * 1024;
    const SENT: usize = DECLARED - 5 * 1024;
    /// The 32 MiB budget and room for buffers, allocator and TLS state of 100 connections; a
    /// tenth of what the bodies would take held whole.
    const RSS_BOUND_KIB: u64 = 96 * 1024;
    let target = Arc::new(HostileTarget::start("large-body").await?);
    let pid = target.pid()?;
    // Past its start-up allocations.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let [before] = status_fields(pid, ["VmRSS"])?;
    let stop = CancellationToken::new();
    let reviews = keep_reviewing(target.clone(), stop.clone());
    let mut large = tokio::task::JoinSet::new();
    for i in 0..CLIENTS {
        let target = target.clone();
        // Two addresses, as the per-address cap (250) is not what this is about.
        let source = if i % 2 == 0 { "127.0.0.3" } else { "127.0.0.4" };
        large.spawn(async move {
            let stream = tls_from(source, target.webhook, &target.connector).await?;
            Ok::<_, anyhow::Error>(
                post(
                    stream,
                    &target.path,
                    DECLARED,
                    Sending::Zeros(SENT),
                    Duration::from_secs(30),
                )
                .await,
            )
        });
    }
    let answers = large.join_all().await;
    stop.cancel();
    let reviews = reviews.await?;
    let [rss, peak] = status_fields(pid, ["VmRSS", "VmHWM"])?;
    let answers = answers.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let mut counts = std::collections::BTreeMap::<Option<u16>, usize>::new();
    for answer in &answers {
        *counts.entry(answer.status).or_default() += 1;
    }
    let review_counts = reviews.iter().fold(
        std::collections::BTreeMap::<Option<u16>, usize>::new(),
        |mut m, a| {
            *m.entry(a.status).or_default() += 1;
            m
        },
    );
    println!(
        "sharder VmRSS {before} KiB before, peak {peak} KiB ({} KiB more, bound {RSS_BOUND_KIB}), {rss} KiB after; \
         large bodies answered {counts:?}; real reviews meanwhile {review_counts:?}",
        peak.saturating_sub(before)
    );
    ensure!(
        peak.saturating_sub(before) <= RSS_BOUND_KIB,
        "the sharder's memory peaked {} KiB above where it was, over the bound of {RSS_BOUND_KIB} KiB",
        peak.saturating_sub(before)
    );
    for answer in &answers {
        ensure!(
            answer.status == Some(408) || (answer.status == Some(503) && answer.retry_after),
            "a large body was answered {answer:?}, not 408 or 503 with Retry-After"
        );
    }
    ensure!(
        reviews
            .iter()
            .all(|a| a.status == Some(200) || (a.status == Some(503) && a.retry_after)),
        "a real review was answered neither 200 nor 503 with Retry-After: {review_counts:?}"
    );
    ensure!(
        review_counts.get(&Some(200)).copied().unwrap_or(0) > 0,
        "no real review was answered 200 during the large bodies: {review_counts:?}"
    );
    // And after them, as before.
    let after = target.review().await;
    ensure!(
        after.status == Some(200),
        "a review after the flood: {after:?}"
    );
    let mut target = Arc::into_inner(target).context("every client is done")?;
    ensure!(
        target.sharder.try_status()?.is_none(),
        "the sharder exited during the large bodies"
    );
    target.sharder.passed();
    Ok(())
}

/// Hundreds of idle connections to the health port from one address hold at most 16 of its 64
/// places (the rest are closed at once), and `/healthz` keeps answering a client from another
/// address. Before, every one of them stayed open.
#[tokio::test]
async fn a_health_port_flood_holds_few_connections_and_healthz_answers() -> anyhow::Result<()> {
    const FLOOD: usize = 300;
    let target = HostileTarget::start("health-flood").await?;
    let health = SocketAddr::from(([127, 0, 0, 1], target.files.health_port));
    let mut flood = Vec::new();
    for _ in 0..FLOOD {
        // The kernel accepts them all; the server closes those over its limits.
        if let Ok(stream) = tcp_from("127.0.0.2", health).await {
            flood.push(stream);
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut open = 0;
    for stream in &mut flood {
        if !closed_within_tcp(stream, Duration::from_millis(10)).await {
            open += 1;
        }
    }
    println!(
        "{open} of {} idle connections to the health port still open",
        flood.len()
    );
    ensure!(
        open <= 16,
        "{open} idle connections from one address held open, over the 16 per address"
    );
    for _ in 0..5 {
        let mut stream = tcp_from("127.0.0.1", health).await?;
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
            .await?;
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer))
            .await
            .context("/healthz did not answer within 5 s during the flood")??;
        ensure!(
            answer.starts_with(b"HTTP/1.1 200"),
            "/healthz answered {}",
            String::from_utf8_lossy(&answer)
        );
    }
    let mut target = target;
    target.sharder.passed();
    Ok(())
}
