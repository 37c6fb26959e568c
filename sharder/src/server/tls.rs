//! The serving certificate of the webhook and of the secure metrics, reloaded from disk when the
//! files change.
//!
//! cert-manager and kubelet rotate mounted certificates in place; polling the files' modification
//! times picks rotations up within seconds without restarting the process.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_util::sync::CancellationToken;

use super::Readiness;

use crate::records;

/// How often the certificate files are checked for changes.
pub(crate) const RELOAD_INTERVAL: Duration = Duration::from_secs(2);

/// A certificate or key file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or parsed.
    #[error("failed to load {path}: {message}")]
    Load {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The key does not fit any supported signature scheme, or does not match the certificate.
    #[error("failed to use the private key {path}: {source}")]
    Key {
        /// The key file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: rustls::Error,
    },
}

/// Serves the most recently loaded certificate to every TLS handshake.
#[derive(Debug)]
pub struct CertReloader {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: RwLock<Option<Arc<CertifiedKey>>>,
    stamp: RwLock<Option<(SystemTime, SystemTime)>>,
}

impl CertReloader {
    /// A reloader for the certificate chain and key at the given paths; nothing is loaded yet.
    pub fn new(cert_path: impl Into<PathBuf>, key_path: impl Into<PathBuf>) -> Self {
        Self {
            cert_path: cert_path.into(),
            key_path: key_path.into(),
            current: RwLock::new(None),
            stamp: RwLock::new(None),
        }
    }

    /// Whether a certificate is loaded and can be served.
    pub(crate) fn is_loaded(&self) -> bool {
        self.current.read().is_ok_and(|c| c.is_some())
    }

    /// Loads the files if they changed since the last successful load. On failure, the previous
    /// certificate (if any) stays in use.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let stamp = (mtime(&self.cert_path)?, mtime(&self.key_path)?);
        if self.stamp.read().is_ok_and(|s| *s == Some(stamp)) && self.is_loaded() {
            return Ok(false);
        }
        let key = load_certified_key(&self.cert_path, &self.key_path)?;
        if let Ok(mut current) = self.current.write() {
            *current = Some(Arc::new(key));
        }
        if let Ok(mut s) = self.stamp.write() {
            *s = Some(stamp);
        }
        Ok(true)
    }

    /// A rustls server configuration that serves this reloader's certificate over HTTP/1.1 and 2.
    pub fn server_config(self: &Arc<Self>) -> Result<rustls::ServerConfig, rustls::Error> {
        let provider = CryptoProvider::get_default()
            .cloned()
            .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }

    /// Like [`CertReloader::server_config`], also asking clients for a certificate, which they
    /// may leave out. A certificate sent is accepted when the client proves it holds its key; its
    /// chain is verified later, by the handler that relies on it (the external metrics API,
    /// against the front-proxy CA, read at run time): the webhook's callers send none and lose
    /// nothing.
    pub fn server_config_asking_client_certs(
        self: &Arc<Self>,
    ) -> Result<rustls::ServerConfig, rustls::Error> {
        let provider = CryptoProvider::get_default()
            .cloned()
            .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
        let mut config = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(Arc::new(OptionalClientCert(provider)))
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// Asks for a client certificate without requiring one, and checks only that the client holds
/// the key of the certificate it sent (the handshake signature); whom the certificate's chain
/// leads to is for the handler to decide ([`PeerCertificates`](super::PeerCertificates)).
#[derive(Debug)]
struct OptionalClientCert(Arc<CryptoProvider>);

impl rustls::server::danger::ClientCertVerifier for OptionalClientCert {
    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        // No hints: Go's clients (the aggregator's proxy) then send the certificate they have.
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        Ok(rustls::server::danger::ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

impl ResolvesServerCert for CertReloader {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok()?.clone()
    }
}

fn mtime(path: &Path) -> Result<SystemTime, TlsError> {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .map_err(|e| TlsError::Load {
            path: path.to_owned(),
            message: e.to_string(),
        })
}

fn load_certified_key(cert_path: &Path, key_path: &Path) -> Result<CertifiedKey, TlsError> {
    let load_err = |path: &Path, message: String| TlsError::Load {
        path: path.to_owned(),
        message,
    };
    let certs = CertificateDer::pem_file_iter(cert_path)
        .map_err(|e| load_err(cert_path, e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| load_err(cert_path, e.to_string()))?;
    if certs.is_empty() {
        return Err(load_err(cert_path, "no certificate found".into()));
    }
    let key =
        PrivateKeyDer::from_pem_file(key_path).map_err(|e| load_err(key_path, e.to_string()))?;
    let provider = CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
    CertifiedKey::from_der(certs, key, &provider).map_err(|source| TlsError::Key {
        path: key_path.to_owned(),
        source,
    })
}

/// Loads the serving certificate now and reloads it every [`RELOAD_INTERVAL`] when its files
/// change, until `shutdown` fires. The process is ready only once a certificate has been loaded.
/// One reloader serves the webhook and the secure metrics alike, which use the same files.
pub(crate) async fn watch_certificate(
    reloader: Arc<CertReloader>,
    readiness: Arc<Readiness>,
    shutdown: CancellationToken,
) {
    loop {
        match reloader.reload_if_changed() {
            Ok(true) => {
                readiness.set_certificate_loaded();
                tracing::info!(
                    event = records::EVENT_CERTIFICATE_LOADED,
                    "loaded serving certificate"
                );
            }
            Ok(false) => {}
            Err(error) => {
                if reloader.is_loaded() {
                    tracing::warn!(event = records::EVENT_CERTIFICATE_RELOAD_FAILED, %error, "failed to reload serving certificate, keeping the previous one");
                } else {
                    tracing::warn!(event = records::EVENT_CERTIFICATE_MISSING, %error, "serving certificate not available yet");
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(RELOAD_INTERVAL) => {}
        }
    }
}
