//! The sharder's configuration file, `SharderConfig` (docs/protocol.md §11).
//!
//! Every field has a default, so an empty document with only `apiVersion` and `kind` is a valid
//! configuration. Unknown fields and invalid values are rejected with the path of the field.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use k8s_openapi::ByteString;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use serde::{Deserialize, Serialize};

use crate::duration::Duration;
use crate::labels::{self, NAMESPACE_SYSTEM};
use crate::lease::LeaseTiming;
use crate::selector::validate_label_selector;
use crate::{GroupResource, RingKind};

/// `apiVersion` of the configuration file.
pub const CONFIG_API_VERSION: &str = "config.sharding.timebertt.dev/v1alpha1";
/// `kind` of the configuration file.
pub const CONFIG_KIND: &str = "SharderConfig";

/// A configuration file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The document is not valid YAML or does not fit the schema (unknown field, wrong type).
    #[error("failed to parse sharder config at {path}: {message}")]
    Parse {
        /// Path of the offending field, e.g. `leaderElection.leaseDuration`.
        path: String,
        /// What is wrong there.
        message: String,
    },
    /// A field holds a value the sharder cannot use.
    #[error("invalid sharder config: {field}: {message}")]
    Invalid {
        /// Path of the offending field.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
}

fn invalid(field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        message: message.into(),
    }
}

/// Configuration of the sharder process.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SharderConfig {
    /// Must be [`CONFIG_API_VERSION`].
    pub api_version: String,
    /// Must be [`CONFIG_KIND`].
    pub kind: String,
    /// How to reach the API server.
    #[serde(default)]
    pub client_connection: ClientConnection,
    /// Leader election among sharder replicas.
    #[serde(default)]
    pub leader_election: LeaderElection,
    /// Health probe endpoint.
    #[serde(default = "Endpoint::health")]
    pub health: Endpoint,
    /// Metrics endpoint.
    #[serde(default)]
    pub metrics: MetricsEndpoint,
    /// Controller settings.
    #[serde(default)]
    pub controller: Controllers,
    /// Webhook server and the webhook configurations written for rings.
    #[serde(default)]
    pub webhook: Webhook,
    /// How long a shutdown may take before the process exits anyway.
    #[serde(default = "default_graceful_shutdown")]
    pub graceful_shutdown: Duration,
    /// How long a replica keeps serving the webhook after a shutdown signal, already reporting
    /// not ready, before it closes its listener and stops the controllers: long enough for the
    /// Service's endpoints to drop it, so a rolling update refuses no admission call. Counts
    /// towards `gracefulShutdown`.
    #[serde(default = "default_shutdown_delay")]
    pub shutdown_delay: Duration,
}

fn default_graceful_shutdown() -> Duration {
    Duration::from_secs(15)
}

fn default_shutdown_delay() -> Duration {
    Duration::from_secs(5)
}

impl Default for SharderConfig {
    fn default() -> Self {
        Self {
            api_version: CONFIG_API_VERSION.into(),
            kind: CONFIG_KIND.into(),
            client_connection: ClientConnection::default(),
            leader_election: LeaderElection::default(),
            health: Endpoint::health(),
            metrics: MetricsEndpoint::default(),
            controller: Controllers::default(),
            webhook: Webhook::default(),
            graceful_shutdown: default_graceful_shutdown(),
            shutdown_delay: default_shutdown_delay(),
        }
    }
}

/// How the sharder talks to the API server.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ClientConnection {
    /// Path of a kubeconfig file; empty means in-cluster config or `$KUBECONFIG`.
    pub kubeconfig: String,
    /// Sustained requests per second; unset or 0 means no client-side throttling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qps: Option<f32>,
    /// Burst of requests above `qps`; unset means equal to `qps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
}

/// Leader election among sharder replicas, through a Lease.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct LeaderElection {
    /// Whether to elect a leader; without it this replica runs the controllers unconditionally.
    pub leader_elect: bool,
    /// How long a leader's Lease is valid without renewal.
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up leadership.
    pub renew_deadline: Duration,
    /// Interval between attempts to acquire or renew.
    pub retry_period: Duration,
    /// Name of the Lease.
    pub resource_name: String,
    /// Namespace of the Lease.
    pub resource_namespace: String,
}

impl LeaderElection {
    /// The timing of the leader-election Lease, checked by [`LeaseTiming::validate`] like every
    /// Lease holder's.
    #[must_use]
    pub fn timing(&self) -> LeaseTiming {
        LeaseTiming {
            lease_duration: self.lease_duration.0,
            renew_deadline: self.renew_deadline.0,
            retry_period: self.retry_period.0,
        }
    }
}

impl Default for LeaderElection {
    fn default() -> Self {
        let timing = LeaseTiming::default();
        Self {
            leader_elect: true,
            lease_duration: Duration(timing.lease_duration),
            renew_deadline: Duration(timing.renew_deadline),
            retry_period: Duration(timing.retry_period),
            resource_name: "sharder".into(),
            resource_namespace: NAMESPACE_SYSTEM.into(),
        }
    }
}

/// An HTTP endpoint's bind address, as `host:port` (host may be empty for all interfaces), or `0`
/// to disable it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Endpoint {
    /// Address to listen on.
    pub bind_address: String,
}

impl Endpoint {
    fn health() -> Self {
        Self {
            bind_address: ":8081".into(),
        }
    }

    /// The socket address to listen on, or `None` when the endpoint is disabled.
    pub fn socket_addr(&self) -> Result<Option<SocketAddr>, InvalidBindAddress> {
        parse_bind_address(&self.bind_address)
    }
}

/// The metrics endpoint: its bind address, and whether it is served securely.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct MetricsEndpoint {
    /// Address to listen on, as `host:port` (host may be empty for all interfaces), or `0` to
    /// disable the endpoint.
    pub bind_address: String,
    /// Serve HTTPS with the webhook's serving certificate, and answer only requests whose bearer
    /// token the API server authenticates (TokenReview) and authorizes for `get` on the
    /// non-resource URL `/metrics` (SubjectAccessReview). `false` serves plain HTTP to anyone
    /// who reaches the port: for local use only.
    pub secure: bool,
    /// Audiences a scraper's token must be issued for (e.g. a projected ServiceAccount token with
    /// `audience: controller-sharding-metrics`). Empty: the API server's own audiences, so a
    /// scraper's ordinary token works, and the sharder sees tokens it could replay to the API
    /// server. When set, the TokenReview asks for these audiences and any other token is refused.
    pub token_audiences: Vec<String>,
}

impl Default for MetricsEndpoint {
    fn default() -> Self {
        Self {
            bind_address: ":8080".into(),
            secure: true,
            token_audiences: Vec::new(),
        }
    }
}

impl MetricsEndpoint {
    /// The socket address to listen on, or `None` when the endpoint is disabled.
    pub fn socket_addr(&self) -> Result<Option<SocketAddr>, InvalidBindAddress> {
        parse_bind_address(&self.bind_address)
    }
}

/// A bind address that [`parse_bind_address`] cannot read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a bind address like \":8080\" or \"127.0.0.1:8080\"")]
pub struct InvalidBindAddress {
    /// The text as given.
    pub text: String,
}

/// Parses `host:port`, `:port` (all interfaces) or `[v6]:port`; `0` disables.
pub fn parse_bind_address(text: &str) -> Result<Option<SocketAddr>, InvalidBindAddress> {
    if text == "0" {
        return Ok(None);
    }
    let full = if text.starts_with(':') {
        format!("0.0.0.0{text}")
    } else if text == "localhost" || text.starts_with("localhost:") {
        text.replacen("localhost", "127.0.0.1", 1)
    } else {
        text.to_string()
    };
    full.parse::<SocketAddr>()
        .map(Some)
        .map_err(|_| InvalidBindAddress {
            text: text.to_string(),
        })
}

/// Controller settings.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Controllers {
    /// The sharder controller that assigns and moves objects.
    pub sharder: SharderController,
}

/// Settings of the sharder controller.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct SharderController {
    /// Interval of the periodic full sync of every ring.
    pub sync_period: Duration,
    /// Most move or drain patches in flight per ring.
    ///
    /// The default of 10 is where the API server of a small control plane (2 cores) answers about
    /// as many patches a second as with 100 in flight, without the queue: at 100 every other
    /// write waited behind the sharder's patches (the shards' drain acknowledgements 3 to 5 times
    /// longer, the handover of a moved object 7 to 29 times longer at the median;
    /// docs/performance.md §4). At 5 the handover is shorter still, but rebalances took up to 80 % longer. Raise it
    /// where a patch waits on something other than the API server's CPU, such as other tools'
    /// slow admission webhooks.
    pub concurrent_moves: u32,
    /// Most move or drain patches in flight across every ring of the process, at least 1.
    ///
    /// `concurrentMoves` bounds one ring; after a leader change every ring syncs at once, and
    /// 100 rings would send 100 times as many patches. Each patch is a mutating request that
    /// also holds a webhook call (a move is assigned in admission) for as long as it runs. The
    /// API server admits 200 mutating requests at once by default
    /// (`--max-mutating-requests-inflight`; with API priority and fairness, the total of 600 seats
    /// is shared the same way, and a service account's writes share the `workload-low` level with
    /// every other controller). The default of 100 keeps the sharder to half of that, leaving the
    /// rest to users, to the shards (their own writes and drain acknowledgements) and to other
    /// controllers, and lets 10 rings sync at once at the default `concurrentMoves` of 10.
    pub max_patches_in_flight: u32,
    /// How long an object may carry the drain label before the sharder warns that its shard may
    /// be stuck (a Warning Event on the ring, and the drain age metric).
    pub drain_timeout: Duration,
    /// Whether the shards leave the shard label of the objects they control to the sharder (they
    /// never relabel a controlled object themselves, as shards written against the protocol
    /// alone do). Then a sync of a ring hashed by object moves each controlled object as soon as
    /// its controller's drain is acknowledged, while it still drains others: children follow
    /// within about 0.1 s instead of after the whole drain pass. Off by default: with shards
    /// that relabel their controlled objects themselves, the sharder's moves would race theirs
    /// and double the writes of a rebalance (docs/performance.md §1).
    pub shards_leave_controlled_objects: bool,
}

impl Default for SharderController {
    fn default() -> Self {
        Self {
            sync_period: Duration::from_secs(300),
            concurrent_moves: 10,
            max_patches_in_flight: 100,
            drain_timeout: Duration::from_secs(300),
            shards_leave_controlled_objects: false,
        }
    }
}

/// Webhook server and per-ring webhook configurations.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Webhook {
    /// The HTTPS server every replica runs.
    pub server: WebhookServer,
    /// What goes into each ring's MutatingWebhookConfiguration.
    pub config: WebhookConfig,
}

/// The HTTPS webhook server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct WebhookServer {
    /// Address to listen on.
    pub bind_address: String,
    /// Directory holding the serving certificate and key; they are reloaded when the files change.
    pub cert_dir: PathBuf,
    /// File name of the certificate chain (PEM) in `certDir`.
    pub cert_name: String,
    /// File name of the private key (PEM) in `certDir`.
    pub key_name: String,
}

impl Default for WebhookServer {
    fn default() -> Self {
        Self {
            bind_address: ":9443".into(),
            cert_dir: PathBuf::from("/tmp/k8s-webhook-server/serving-certs"),
            cert_name: "tls.crt".into(),
            key_name: "tls.key".into(),
        }
    }
}

/// The parts of each ring's webhook configuration that come from the sharder's configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct WebhookConfig {
    /// Annotations put on every webhook configuration, e.g. `cert-manager.io/inject-ca-from`.
    pub annotations: BTreeMap<String, String>,
    /// How the API server reaches the webhook.
    pub client_config: WebhookClientConfig,
    /// Namespaces covered by rings that have no selector of their own.
    pub namespace_selector: LabelSelector,
    /// Protected resources rings may cover nevertheless. Without an entry here, a ring over pods,
    /// Events, Leases or any resource of the admission registration, authentication,
    /// authorization, RBAC or sharding API groups is refused (its `Ready` condition says why):
    /// the sharder would stand in front of every write to them.
    pub allowed_protected_resources: Vec<GroupResource>,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        Self {
            annotations: BTreeMap::new(),
            client_config: WebhookClientConfig::default(),
            namespace_selector: default_namespace_selector(),
            allowed_protected_resources: Vec::new(),
        }
    }
}

/// Every namespace except `kube-system` and `sharding-system`.
pub fn default_namespace_selector() -> LabelSelector {
    LabelSelector {
        match_expressions: Some(vec![LabelSelectorRequirement {
            key: "kubernetes.io/metadata.name".into(),
            operator: "NotIn".into(),
            values: Some(vec!["kube-system".into(), NAMESPACE_SYSTEM.into()]),
        }]),
        match_labels: None,
    }
}

/// How the API server reaches the webhook: exactly one of `url` and `service`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookClientConfig {
    /// Base URL (https) of the webhook; the ring path is appended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Service in front of the sharder; the ring path is joined to its `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceReference>,
    /// PEM CA bundle (base64 in YAML, as in the Kubernetes API) that signs the serving certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle: Option<ByteString>,
    /// File holding the PEM CA bundle, read whenever a webhook configuration is written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle_file: Option<PathBuf>,
}

impl Default for WebhookClientConfig {
    fn default() -> Self {
        Self {
            url: None,
            service: Some(ServiceReference::default()),
            ca_bundle: None,
            ca_bundle_file: None,
        }
    }
}

/// A Service in front of the sharder's webhook server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceReference {
    /// Namespace of the Service.
    pub namespace: String,
    /// Name of the Service.
    pub name: String,
    /// Path prefix; the ring path is joined to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Port of the Service (default 443).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
}

impl Default for ServiceReference {
    fn default() -> Self {
        Self {
            namespace: NAMESPACE_SYSTEM.into(),
            name: "sharder".into(),
            path: None,
            port: None,
        }
    }
}

impl SharderConfig {
    /// Parses and validates a YAML (or JSON) configuration document.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let deserializer = serde_yaml::Deserializer::from_str(text);
        let config: Self = serde_path_to_error::deserialize(deserializer).map_err(|err| {
            let path = err.path().to_string();
            ConfigError::Parse {
                path: if path == "." { "<root>".into() } else { path },
                message: err.into_inner().to_string(),
            }
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every value; the error names the first offending field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.api_version != CONFIG_API_VERSION {
            return Err(invalid(
                "apiVersion",
                format!("must be {CONFIG_API_VERSION:?}, got {:?}", self.api_version),
            ));
        }
        if self.kind != CONFIG_KIND {
            return Err(invalid(
                "kind",
                format!("must be {CONFIG_KIND:?}, got {:?}", self.kind),
            ));
        }

        let cc = &self.client_connection;
        if let Some(qps) = cc.qps
            && !(qps.is_finite() && qps >= 0.0)
        {
            return Err(invalid(
                "clientConnection.qps",
                "must be a non-negative number",
            ));
        }

        let le = &self.leader_election;
        if le.leader_elect {
            le.timing().validate().map_err(|error| {
                let field = match error.field() {
                    "leaseDuration" => "leaderElection.leaseDuration",
                    "renewDeadline" => "leaderElection.renewDeadline",
                    _ => "leaderElection.retryPeriod",
                };
                invalid(field, error.to_string())
            })?;
            if !labels::is_dns_subdomain(&le.resource_name) {
                return Err(invalid(
                    "leaderElection.resourceName",
                    format!("{:?} is not a valid object name", le.resource_name),
                ));
            }
            if !labels::is_dns_subdomain(&le.resource_namespace) {
                return Err(invalid(
                    "leaderElection.resourceNamespace",
                    format!("{:?} is not a valid namespace", le.resource_namespace),
                ));
            }
        }

        self.health
            .socket_addr()
            .map_err(|m| invalid("health.bindAddress", m.to_string()))?;
        self.metrics
            .socket_addr()
            .map_err(|m| invalid("metrics.bindAddress", m.to_string()))?;
        if self.metrics.token_audiences.iter().any(String::is_empty) {
            return Err(invalid(
                "metrics.tokenAudiences",
                "audiences must not be empty strings",
            ));
        }

        let sharder = &self.controller.sharder;
        if sharder.sync_period.0.is_zero() {
            return Err(invalid("controller.sharder.syncPeriod", "must be positive"));
        }
        if sharder.concurrent_moves == 0 {
            return Err(invalid(
                "controller.sharder.concurrentMoves",
                "must be at least 1",
            ));
        }
        if sharder.max_patches_in_flight == 0 {
            return Err(invalid(
                "controller.sharder.maxPatchesInFlight",
                "must be at least 1",
            ));
        }
        if sharder.drain_timeout.0.is_zero() {
            return Err(invalid(
                "controller.sharder.drainTimeout",
                "must be positive",
            ));
        }

        let server = &self.webhook.server;
        match parse_bind_address(&server.bind_address) {
            Ok(Some(_)) => {}
            Ok(None) => {
                return Err(invalid(
                    "webhook.server.bindAddress",
                    "the webhook server cannot be disabled",
                ));
            }
            Err(m) => return Err(invalid("webhook.server.bindAddress", m.to_string())),
        }
        if server.cert_dir.as_os_str().is_empty() {
            return Err(invalid("webhook.server.certDir", "must not be empty"));
        }
        if server.cert_name.is_empty() {
            return Err(invalid("webhook.server.certName", "must not be empty"));
        }
        if server.key_name.is_empty() {
            return Err(invalid("webhook.server.keyName", "must not be empty"));
        }

        let wc = &self.webhook.config;
        for key in wc.annotations.keys() {
            if !labels::is_valid_label_key(key) {
                return Err(invalid(
                    "webhook.config.annotations",
                    format!("{key:?} is not a valid annotation key"),
                ));
            }
        }
        let client = &wc.client_config;
        match (&client.url, &client.service) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(invalid(
                    "webhook.config.clientConfig",
                    "exactly one of url and service must be set",
                ));
            }
            (Some(url), None) => {
                let rest = url.strip_prefix("https://").ok_or_else(|| {
                    invalid(
                        "webhook.config.clientConfig.url",
                        format!("{url:?} must start with https://"),
                    )
                })?;
                if rest.is_empty() || rest.starts_with('/') || url.contains(['?', '#']) {
                    return Err(invalid(
                        "webhook.config.clientConfig.url",
                        format!(
                            "{url:?} must be https://host[:port][/path] without query or fragment"
                        ),
                    ));
                }
            }
            (None, Some(service)) => {
                if !labels::is_dns_subdomain(&service.namespace) {
                    return Err(invalid(
                        "webhook.config.clientConfig.service.namespace",
                        format!("{:?} is not a valid namespace", service.namespace),
                    ));
                }
                if !labels::is_dns_subdomain(&service.name) {
                    return Err(invalid(
                        "webhook.config.clientConfig.service.name",
                        format!("{:?} is not a valid service name", service.name),
                    ));
                }
                if let Some(path) = &service.path
                    && !path.starts_with('/')
                {
                    return Err(invalid(
                        "webhook.config.clientConfig.service.path",
                        format!("{path:?} must start with /"),
                    ));
                }
                if let Some(port) = service.port
                    && !(1..=65535).contains(&port)
                {
                    return Err(invalid(
                        "webhook.config.clientConfig.service.port",
                        format!("{port} is not a port number"),
                    ));
                }
            }
        }
        if client.ca_bundle.is_some() && client.ca_bundle_file.is_some() {
            return Err(invalid(
                "webhook.config.clientConfig",
                "caBundle and caBundleFile are mutually exclusive",
            ));
        }
        validate_label_selector(&wc.namespace_selector)
            .map_err(|m| invalid("webhook.config.namespaceSelector", m))?;

        if self.graceful_shutdown.0.is_zero() {
            return Err(invalid("gracefulShutdown", "must be positive"));
        }
        if self.shutdown_delay.0 >= self.graceful_shutdown.0 {
            return Err(invalid(
                "shutdownDelay",
                "must be shorter than gracefulShutdown, which it counts towards",
            ));
        }
        Ok(())
    }

    /// The webhook URL or Service path for ring `ring_name` of `kind`: the configured base with
    /// the ring path joined.
    pub fn webhook_path_for(base: Option<&str>, kind: RingKind, ring_name: &str) -> String {
        let ring_path = kind.webhook_path(ring_name);
        match base {
            Some(base) => format!("{}{ring_path}", base.trim_end_matches('/')),
            None => ring_path,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str =
        "apiVersion: config.sharding.timebertt.dev/v1alpha1\nkind: SharderConfig\n";

    fn parse(body: &str) -> Result<SharderConfig, ConfigError> {
        SharderConfig::from_yaml(&format!("{HEADER}{body}"))
    }

    fn error_of(body: &str) -> String {
        parse(body)
            .expect_err("config must be rejected")
            .to_string()
    }

    #[test]
    fn minimal_document_gets_spec_defaults() {
        let config = parse("").expect("valid");
        assert_eq!(config, SharderConfig::default());
        assert!(config.leader_election.leader_elect);
        assert_eq!(
            config.leader_election.lease_duration,
            Duration::from_secs(15)
        );
        assert_eq!(
            config.leader_election.renew_deadline,
            Duration::from_secs(10)
        );
        assert_eq!(config.leader_election.retry_period, Duration::from_secs(2));
        assert_eq!(config.leader_election.resource_name, "sharder");
        assert_eq!(config.leader_election.resource_namespace, "sharding-system");
        assert_eq!(config.health.bind_address, ":8081");
        assert_eq!(config.metrics.bind_address, ":8080");
        assert!(
            config.metrics.secure,
            "metrics are served securely unless switched off"
        );
        assert_eq!(
            config.controller.sharder.sync_period,
            Duration::from_secs(300)
        );
        assert_eq!(config.controller.sharder.concurrent_moves, 10);
        assert_eq!(config.controller.sharder.max_patches_in_flight, 100);
        assert_eq!(
            config.controller.sharder.drain_timeout,
            Duration::from_secs(300)
        );
        assert_eq!(config.webhook.server.bind_address, ":9443");
        assert_eq!(config.webhook.server.cert_name, "tls.crt");
        assert_eq!(config.webhook.server.key_name, "tls.key");
        assert_eq!(config.graceful_shutdown, Duration::from_secs(15));
        assert_eq!(config.shutdown_delay, Duration::from_secs(5));
        let service = config
            .webhook
            .config
            .client_config
            .service
            .expect("service");
        assert_eq!(
            (service.namespace.as_str(), service.name.as_str()),
            ("sharding-system", "sharder")
        );
        assert_eq!(config.client_connection.qps, None);
    }

    #[test]
    fn full_document() {
        let config = parse(
            r#"
clientConnection: {kubeconfig: /etc/kubeconfig, qps: 50, burst: 100}
leaderElection: {leaderElect: false}
health: {bindAddress: "127.0.0.1:9081"}
metrics: {bindAddress: "0"}
controller: {sharder: {syncPeriod: 1m30s, concurrentMoves: 5, maxPatchesInFlight: 40}}
webhook:
  server: {bindAddress: "127.0.0.1:9443", certDir: /certs}
  config:
    annotations: {cert-manager.io/inject-ca-from: sharding-system/webhook-ca}
    clientConfig: {url: "https://127.0.0.1:9443/base", caBundle: "Zm9v"}
    namespaceSelector: {matchLabels: {team: a}}
gracefulShutdown: 5s
shutdownDelay: 2s
"#,
        )
        .expect("valid");
        assert_eq!(config.client_connection.qps, Some(50.0));
        assert_eq!(
            config.controller.sharder.sync_period,
            Duration::from_secs(90)
        );
        assert_eq!(config.controller.sharder.concurrent_moves, 5);
        assert_eq!(config.controller.sharder.max_patches_in_flight, 40);
        assert_eq!(config.metrics.socket_addr(), Ok(None));
        assert!(config.metrics.secure);
        assert_eq!(
            config.webhook.config.client_config.ca_bundle,
            Some(ByteString(b"foo".to_vec()))
        );
        assert_eq!(config.webhook.config.client_config.service, None);
    }

    #[test]
    fn metrics_switch_to_plain_http_keeps_the_address() {
        let config = parse("metrics: {secure: false}\n").expect("valid");
        assert!(!config.metrics.secure);
        assert_eq!(config.metrics.bind_address, ":8080");
        let config = parse("metrics: {bindAddress: \"127.0.0.1:9090\"}\n").expect("valid");
        assert!(config.metrics.secure);
        let config =
            parse("metrics: {tokenAudiences: [controller-sharding-metrics]}\n").expect("valid");
        assert_eq!(
            config.metrics.token_audiences,
            ["controller-sharding-metrics"]
        );
        let err = error_of("metrics: {tokenAudiences: [\"\"]}\n");
        assert!(err.contains("metrics.tokenAudiences"), "{err}");
        let err = error_of("metrics: {secure: maybe}\n");
        assert!(err.contains("metrics.secure"), "{err}");
    }

    #[test]
    fn allowed_protected_resources_parse() {
        let config = parse(
            "webhook:\n  config:\n    allowedProtectedResources:\n    - {group: \"\", resource: pods}\n",
        )
        .expect("valid");
        assert_eq!(
            config.webhook.config.allowed_protected_resources,
            vec![GroupResource::new("", "pods")]
        );
        assert!(
            SharderConfig::default()
                .webhook
                .config
                .allowed_protected_resources
                .is_empty()
        );
    }

    #[test]
    fn unknown_fields_name_their_path() {
        let err = error_of("leaderElection:\n  leaseDurationSeconds: 3\n");
        assert!(err.contains("leaderElection"), "{err}");
        assert!(err.contains("leaseDurationSeconds"), "{err}");
        let err = error_of("foo: 1\n");
        assert!(err.contains("unknown field `foo`"), "{err}");
    }

    #[test]
    fn wrong_types_name_their_path() {
        let err = error_of("controller:\n  sharder:\n    concurrentMoves: many\n");
        assert!(err.contains("controller.sharder.concurrentMoves"), "{err}");
        let err = error_of("controller: {sharder: {maxPatchesInFlight: -1}}\n");
        assert!(
            err.contains("controller.sharder.maxPatchesInFlight"),
            "{err}"
        );
        let err = error_of("gracefulShutdown: soon\n");
        assert!(err.contains("gracefulShutdown"), "{err}");
    }

    #[test]
    fn invalid_values_name_their_field() {
        let cases = [
            (
                "leaderElection: {renewDeadline: 20s}",
                "leaderElection.renewDeadline",
            ),
            (
                "leaderElection: {retryPeriod: 10s}",
                "leaderElection.retryPeriod",
            ),
            (
                "leaderElection: {leaseDuration: 0s}",
                "leaderElection.leaseDuration",
            ),
            (
                "leaderElection: {leaseDuration: 500ms, renewDeadline: 400ms, retryPeriod: 100ms}",
                "leaderElection.leaseDuration",
            ),
            (
                "leaderElection: {renewDeadline: 0s}",
                "leaderElection.renewDeadline",
            ),
            (
                "leaderElection: {resourceName: Bad_Name}",
                "leaderElection.resourceName",
            ),
            ("health: {bindAddress: nonsense}", "health.bindAddress"),
            (
                "controller: {sharder: {concurrentMoves: 0}}",
                "controller.sharder.concurrentMoves",
            ),
            (
                "controller: {sharder: {maxPatchesInFlight: 0}}",
                "controller.sharder.maxPatchesInFlight",
            ),
            (
                "controller: {sharder: {syncPeriod: 0s}}",
                "controller.sharder.syncPeriod",
            ),
            (
                "controller: {sharder: {drainTimeout: 0s}}",
                "controller.sharder.drainTimeout",
            ),
            (
                "webhook: {server: {bindAddress: \"0\"}}",
                "webhook.server.bindAddress",
            ),
            (
                "webhook: {config: {clientConfig: {}}}",
                "webhook.config.clientConfig",
            ),
            (
                "webhook: {config: {clientConfig: {url: \"http://x\"}}}",
                "webhook.config.clientConfig.url",
            ),
            (
                "webhook: {config: {clientConfig: {service: {namespace: a, name: b, path: x}}}}",
                "webhook.config.clientConfig.service.path",
            ),
            (
                "webhook: {config: {namespaceSelector: {matchExpressions: [{key: a, operator: Is}]}}}",
                "webhook.config.namespaceSelector",
            ),
            ("gracefulShutdown: 0s", "gracefulShutdown"),
            ("gracefulShutdown: 5s\nshutdownDelay: 5s", "shutdownDelay"),
            ("clientConnection: {qps: -1}", "clientConnection.qps"),
        ];
        for (body, field) in cases {
            let err = error_of(body);
            assert!(err.contains(field), "{body}: {err}");
        }
        let err = SharderConfig::from_yaml("apiVersion: v1\nkind: SharderConfig\n")
            .expect_err("wrong apiVersion")
            .to_string();
        assert!(err.contains("apiVersion"), "{err}");
    }

    #[test]
    fn webhook_paths() {
        assert_eq!(
            SharderConfig::webhook_path_for(Some("https://h:1/base/"), RingKind::ClusterRing, "r"),
            "https://h:1/base/webhooks/sharder/clusterring/r"
        );
        assert_eq!(
            SharderConfig::webhook_path_for(None, RingKind::ClusterRing, "r"),
            "/webhooks/sharder/clusterring/r"
        );
        assert_eq!(
            SharderConfig::webhook_path_for(None, RingKind::ControllerRing, "r"),
            "/webhooks/sharder/controllerring/r"
        );
    }
}
