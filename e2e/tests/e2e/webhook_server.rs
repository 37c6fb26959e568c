//! The webhook server's connection limits, over real sockets on loopback: the server the sharder
//! runs ([`sharder::server::serve_tls`], its certificate served as the sharder serves it), with
//! limits small enough to observe.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use e2e::trivial_webhook;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use sharder::server::ConnectionLimits;
use tokio::io::AsyncReadExt;
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
    tokio::spawn(sharder::server::serve_tls(
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
