//! Who the aggregator says is asking: the API server's aggregation layer calls an extension API
//! with its front-proxy client certificate and names the user it authenticated in request headers
//! (`X-Remote-User`, `X-Remote-Group`, `X-Remote-Extra-*` by default). The headers are believed
//! only from a client whose certificate chains to the request-header CA and, when names are
//! configured, carries one of the allowed common names: anyone else could write them too.
//!
//! The CA, the allowed names and the header names come from the `extension-apiserver-authentication`
//! ConfigMap in `kube-system`, which the API server publishes from its `--requestheader-*` flags.
//! It is read when first needed and again after [`CONFIG_TTL`], so a rotated CA is picked up
//! within a minute; one read at a time, so a burst of requests costs one.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use tokio::sync::Mutex;

use crate::records;
use crate::server::metrics_auth::User;

/// Namespace and name of the ConfigMap the API server publishes its request-header settings in.
pub(crate) const AUTHENTICATION_CONFIGMAP: (&str, &str) =
    ("kube-system", "extension-apiserver-authentication");

/// How long the ConfigMap's settings are used before they are read again.
pub(crate) const CONFIG_TTL: Duration = Duration::from_secs(60);

/// How long a failed read is remembered before the next request tries again.
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(5);

/// Longest header value looked at; longer ones are ignored (a user name or group is short).
const MAX_HEADER_VALUE: usize = 4096;

/// The request-header settings of the API server.
pub(crate) struct RequestHeaderConfig {
    /// Verifies a client's chain against the request-header CA.
    verifier: Arc<dyn ClientCertVerifier>,
    /// Common names a front-proxy certificate may have; empty: any.
    allowed_names: Vec<String>,
    /// Headers naming the user, the first non-empty one wins.
    username_headers: Vec<String>,
    /// Headers naming the user's UID.
    uid_headers: Vec<String>,
    /// Headers naming the user's groups, every value of each.
    group_headers: Vec<String>,
    /// Prefixes of headers carrying extra user attributes.
    extra_prefixes: Vec<String>,
}

impl std::fmt::Debug for RequestHeaderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestHeaderConfig")
            .field("allowed_names", &self.allowed_names)
            .field("username_headers", &self.username_headers)
            .field("group_headers", &self.group_headers)
            .field("extra_prefixes", &self.extra_prefixes)
            .finish_non_exhaustive()
    }
}

/// Why the ConfigMap's settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConfigError {
    /// The ConfigMap could not be read.
    #[error("failed to read ConfigMap kube-system/extension-apiserver-authentication")]
    Read(#[source] kube::Error),
    /// The API server runs without the aggregation layer's request-header settings.
    #[error(
        "ConfigMap kube-system/extension-apiserver-authentication has no requestheader-client-ca-file: the API server runs without --requestheader-client-ca-file"
    )]
    NoRequestHeaderCa,
    /// A value is not what the API server writes.
    #[error("ConfigMap kube-system/extension-apiserver-authentication: invalid {key}: {message}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// What is wrong.
        message: String,
    },
}

impl RequestHeaderConfig {
    /// The settings in the ConfigMap's `data`.
    pub(crate) fn from_data(data: &BTreeMap<String, String>) -> Result<Self, ConfigError> {
        let ca = data
            .get("requestheader-client-ca-file")
            .filter(|v| !v.trim().is_empty())
            .ok_or(ConfigError::NoRequestHeaderCa)?;
        let invalid = |key: &'static str, message: String| ConfigError::Invalid { key, message };
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca.as_bytes()) {
            let cert = cert.map_err(|e| invalid("requestheader-client-ca-file", e.to_string()))?;
            roots
                .add(cert)
                .map_err(|e| invalid("requestheader-client-ca-file", e.to_string()))?;
        }
        let provider = CryptoProvider::get_default()
            .cloned()
            .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| invalid("requestheader-client-ca-file", e.to_string()))?;
        // Lists are JSON arrays of strings; a missing key is an empty list.
        let list = |key: &'static str| -> Result<Vec<String>, ConfigError> {
            data.get(key)
                .filter(|v| !v.trim().is_empty())
                .map_or(Ok(Vec::new()), |v| {
                    serde_json::from_str::<Vec<String>>(v).map_err(|e| invalid(key, e.to_string()))
                })
        };
        let lower = |v: Vec<String>| v.into_iter().map(|h| h.to_ascii_lowercase()).collect();
        Ok(Self {
            verifier,
            allowed_names: list("requestheader-allowed-names")?,
            username_headers: lower(list("requestheader-username-headers")?),
            uid_headers: lower(list("requestheader-uid-headers")?),
            group_headers: lower(list("requestheader-group-headers")?),
            extra_prefixes: lower(list("requestheader-extra-headers-prefix")?),
        })
    }

    /// The user the headers name, when `certificates` (end entity first) are a front proxy's: a
    /// chain to the request-header CA, valid now, for client authentication, with an allowed
    /// common name. `None` otherwise, and when no header names a user.
    pub(crate) fn authenticate(
        &self,
        certificates: &[CertificateDer<'static>],
        headers: &HeaderMap,
    ) -> Option<User> {
        let (end_entity, intermediates) = certificates.split_first()?;
        self.verifier
            .verify_client_cert(end_entity, intermediates, UnixTime::now())
            .ok()?;
        if !self.allowed_names.is_empty() {
            let name = common_name(end_entity)?;
            if !self.allowed_names.contains(&name) {
                return None;
            }
        }
        let values = |name: &str| {
            headers
                .get_all(name)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .filter(|v| !v.is_empty() && v.len() <= MAX_HEADER_VALUE)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        let first = |names: &[String]| names.iter().find_map(|h| values(h).into_iter().next());
        let name = first(&self.username_headers)?;
        let uid = first(&self.uid_headers).unwrap_or_default();
        let groups = self.group_headers.iter().flat_map(|h| values(h)).collect();
        let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (header, value) in headers {
            let Some(key) = self
                .extra_prefixes
                .iter()
                .find_map(|p| header.as_str().strip_prefix(p.as_str()))
            else {
                continue;
            };
            let Ok(value) = value.to_str() else { continue };
            if key.is_empty() || value.len() > MAX_HEADER_VALUE {
                continue;
            }
            extra
                .entry(percent_decode(key).to_ascii_lowercase())
                .or_default()
                .push(value.to_owned());
        }
        Some(User {
            name,
            uid,
            groups,
            extra,
        })
    }
}

/// `text` with its percent escapes decoded: extra keys travel so in header names (a key may
/// hold `/`), and query parameters in URLs. Invalid escapes are kept as they are.
pub(super) fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        if bytes[i] == b'%'
            && let (Some(h), Some(l)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            // Two hex digits: at most 255.
            out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The settings of the latest read, or why it failed.
type Settings = Result<Arc<RequestHeaderConfig>, Arc<ConfigError>>;

/// The settings read from the ConfigMap, kept for [`CONFIG_TTL`].
pub(crate) struct FrontProxy {
    client: kube::Client,
    /// The latest read and until when it is used.
    current: Mutex<Option<(Settings, Instant)>>,
}

impl FrontProxy {
    /// Reads the ConfigMap through `client` when first needed.
    pub(crate) fn new(client: kube::Client) -> Self {
        Self {
            client,
            current: Mutex::new(None),
        }
    }

    /// The current settings, read again when they are older than [`CONFIG_TTL`] (a failed read:
    /// a few seconds). While a read fails, the settings read last are kept: a short outage of
    /// the API server does not stop the answers.
    pub(crate) async fn config(&self) -> Settings {
        let mut current = self.current.lock().await;
        let now = Instant::now();
        if let Some((config, until)) = &*current
            && *until > now
        {
            return config.clone();
        }
        let read = Api::<ConfigMap>::namespaced(self.client.clone(), AUTHENTICATION_CONFIGMAP.0)
            .get(AUTHENTICATION_CONFIGMAP.1)
            .await
            .map_err(ConfigError::Read)
            .and_then(|cm| RequestHeaderConfig::from_data(&cm.data.unwrap_or_default()))
            .map(Arc::new)
            .map_err(Arc::new);
        let kept = match (read, current.take()) {
            (Ok(config), _) => (Ok(config), now + CONFIG_TTL),
            (Err(error), Some((Ok(previous), _))) => {
                tracing::warn!(event = records::EVENT_REQUEST_HEADER_SETTINGS_FAILED, error = %format!("{error:#}"), "failed to read the request-header settings again, keeping the previous ones");
                (Ok(previous), now + RETRY_AFTER_FAILURE)
            }
            (Err(error), _) => {
                tracing::warn!(event = records::EVENT_REQUEST_HEADER_SETTINGS_FAILED, error = %format!("{error:#}"), "failed to read the request-header settings");
                (Err(error), now + RETRY_AFTER_FAILURE)
            }
        };
        let answer = kept.0.clone();
        *current = Some(kept);
        answer
    }
}

/// The common name of the certificate's subject (its last, as Go reads it), read from the DER;
/// `None` when there is none or the encoding is not understood. The chain was verified first,
/// so the input is a certificate webpki parsed.
pub(crate) fn common_name(cert: &CertificateDer<'_>) -> Option<String> {
    // Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL, serialNumber,
    // signature, issuer, validity, subject, ... }, ... }
    let (_, certificate, _) = der(cert.as_ref())?;
    let (_, mut tbs, _) = der(certificate)?;
    let (tag, _, rest) = der(tbs)?;
    if tag == 0xa0 {
        tbs = rest;
    }
    // serialNumber, signature, issuer, validity
    for _ in 0..4 {
        tbs = der(tbs)?.2;
    }
    let (_, mut subject, _) = der(tbs)?;
    // Name ::= SEQUENCE OF SET OF SEQUENCE { type OID, value ANY }
    const CN: &[u8] = &[0x55, 0x04, 0x03];
    let mut found = None;
    while !subject.is_empty() {
        let (_, mut set, rest) = der(subject)?;
        subject = rest;
        while !set.is_empty() {
            let (_, attribute, rest) = der(set)?;
            set = rest;
            let (tag, oid, value) = der(attribute)?;
            if tag == 0x06 && oid == CN {
                let (_, text, _) = der(value)?;
                found = Some(String::from_utf8_lossy(text).into_owned());
            }
        }
    }
    found
}

/// One DER element at the start of `input`: its tag, its content and what follows it.
fn der(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 {
            return None;
        }
        let mut len = 0usize;
        for _ in 0..count {
            let (&b, r) = rest.split_first()?;
            len = (len << 8) | usize::from(b);
            rest = r;
        }
        len
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_escapes_of_extra_keys_are_decoded() {
        assert_eq!(percent_decode("scopes"), "scopes");
        assert_eq!(
            percent_decode("example.com%2Fteam"),
            "example.com/team".to_owned()
        );
        assert_eq!(percent_decode("bad%zz%4"), "bad%zz%4");
    }

    #[test]
    fn der_elements_are_split_by_their_length() {
        assert_eq!(
            der(&[0x30, 0x02, 0x01, 0x02, 0xff]),
            Some((0x30, &[0x01, 0x02][..], &[0xff][..]))
        );
        // Long form: 0x81 then one length byte.
        let long = [&[0x04, 0x81, 0x80][..], &[7u8; 0x80]].concat();
        assert_eq!(
            der(&long).map(|(_, c, r)| (c.len(), r.len())),
            Some((128, 0))
        );
        assert_eq!(der(&[0x30, 0x05, 0x01]), None, "shorter than declared");
        assert_eq!(der(&[0x30]), None);
    }

    #[test]
    fn a_configmap_without_the_request_header_ca_is_refused() {
        assert!(matches!(
            RequestHeaderConfig::from_data(&BTreeMap::new()),
            Err(ConfigError::NoRequestHeaderCa)
        ));
        let data = BTreeMap::from([(
            "requestheader-client-ca-file".to_owned(),
            "not a certificate".to_owned(),
        )]);
        assert!(RequestHeaderConfig::from_data(&data).is_err());
    }
}
