//! A client that sends many admission reviews to a sharder's webhook quickly: one TLS connection
//! speaking HTTP/2, as the API server calls webhooks, with requests in flight concurrently. For
//! tests that send the webhook hostile input by the thousand, where a `curl` per request would
//! take minutes.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, ensure};
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::TlsConnector;

/// One HTTP/2 connection to a webhook server.
#[derive(Clone)]
pub struct WebhookClient {
    sender: SendRequest<Full<Bytes>>,
    authority: String,
}

impl WebhookClient {
    /// Connects to `addr`, trusting only the CA bundle at `ca`.
    pub async fn connect(addr: SocketAddr, ca: &Path) -> anyhow::Result<Self> {
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
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .with_context(|| format!("failed to connect to {addr}"))?;
        let tls = TlsConnector::from(Arc::new(config))
            .connect(ServerName::from(addr.ip()), tcp)
            .await
            .context("TLS handshake failed")?;
        let (sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .context("HTTP/2 handshake failed")?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Self {
            sender,
            authority: addr.to_string(),
        })
    }

    /// POSTs `body` as JSON to `path`; the HTTP status and body.
    pub async fn post(&self, path: &str, body: Vec<u8>) -> anyhow::Result<(u16, Bytes)> {
        let request = http::Request::post(format!("https://{}{path}", self.authority))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let mut sender = self.sender.clone();
        sender.ready().await.context("connection closed")?;
        let response = sender
            .send_request(request)
            .await
            .context("request failed")?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }

    /// POSTs each body `make(i)` for `i` in `0..count` to `path`, `concurrency` at a time; fails
    /// unless every answer is 200.
    pub async fn post_all(
        &self,
        path: &str,
        count: usize,
        concurrency: usize,
        make: impl Fn(usize) -> Vec<u8>,
    ) -> anyhow::Result<()> {
        let mut answers = futures::stream::iter(0..count)
            .map(|i| {
                let body = make(i);
                async move { self.post(path, body).await }
            })
            .buffer_unordered(concurrency);
        while let Some(answer) = answers.next().await {
            let (status, body) = answer?;
            ensure!(
                status == 200,
                "the webhook answered {status}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        Ok(())
    }
}
