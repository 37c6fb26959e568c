//! The sharder: assigns the objects of every `ClusterRing` to the ring's available shards and
//! moves them when shards come and go.
//!
//! Pure modules ([`ring`], [`key`], [`validation`], [`webhook_config`]) take
//! plain data and time and make the decisions; the controllers ([`controller_ring`],
//! [`shard_lease`]), the [`webhook`] and the [`server`]s wire them to the Kubernetes API. [`run`]
//! starts everything and stops it on one shutdown signal.

pub mod context;
pub mod controller_ring;
pub mod discovery;
pub mod key;
pub mod metrics;
pub mod rebalance;
pub mod ring;
pub mod rings;
pub mod server;
pub mod shard_lease;
pub mod sync;
pub mod throttle;
pub mod tls;
pub mod validation;
pub mod webhook;
pub mod webhook_config;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Config, ResourceExt};
use prometheus_client::registry::Registry;
use shard::lease::{LeaseLock, LeaseLockConfig};
use sharding_crds::ClusterRing;
use sharding_crds::config::SharderConfig;
use sharding_crds::labels::LABEL_CLUSTER_RING;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::context::Context;
use crate::discovery::Discovery;
use crate::metrics::{
    Metrics, RingLabels, RingSnapshot, ShardSnapshot, StateCollector, StateSource,
};
use crate::rings::{RingRegistry, available_shards, build_view};
use crate::server::Readiness;
use crate::tls::CertReloader;
use sharding_crds::lease::ShardLease;

/// How often rings with unresolved resources (e.g. a CRD installed later) are resolved again.
const UNRESOLVED_RETRY: Duration = Duration::from_secs(10);

/// Runs the sharder until `shutdown` fires, then stops everything within the configured
/// `gracefulShutdown`.
pub async fn run(
    config: SharderConfig,
    identity: String,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let config = Arc::new(config);
    let client = build_client(&config).await?;

    let (rings, rings_writer) = reflector::store::<ClusterRing>();
    let (leases, leases_writer) = reflector::store::<Lease>();
    let (namespaces, namespaces_writer) = reflector::store::<Namespace>();
    let ctx = Context {
        client: client.clone(),
        config: config.clone(),
        rings: rings.clone(),
        leases: leases.clone(),
        namespaces: namespaces.clone(),
        registry: Arc::new(RingRegistry::default()),
        discovery: Arc::new(Discovery::new(client.clone())),
        metrics: Metrics::default(),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "sharder".into(),
                instance: Some(identity.clone()),
            },
        ),
    };

    let readiness = Arc::new(Readiness::default());
    let changed = Arc::new(Notify::new());
    let mut tasks = tokio::task::JoinSet::new();

    // Caches on every replica: the webhook and the metrics need them, not only the leader.
    tasks.spawn(drive(
        reflector::reflector(
            rings_writer,
            watcher(
                Api::<ClusterRing>::all(client.clone()),
                watcher::Config::default(),
            ),
        ),
        Some(changed.clone()),
        shutdown.clone(),
    ));
    tasks.spawn(drive(
        reflector::reflector(
            leases_writer,
            watcher(
                Api::<Lease>::all(client.clone()),
                watcher::Config::default().labels(LABEL_CLUSTER_RING),
            ),
        ),
        Some(changed.clone()),
        shutdown.clone(),
    ));
    tasks.spawn(drive(
        reflector::reflector(
            namespaces_writer,
            watcher(
                Api::<Namespace>::all(client.clone()),
                watcher::Config::default(),
            ),
        ),
        None,
        shutdown.clone(),
    ));
    {
        let (readiness, shutdown) = (readiness.clone(), shutdown.clone());
        let (rings, leases, namespaces) = (rings.clone(), leases.clone(), namespaces.clone());
        tasks.spawn(async move {
            tokio::select! {
                () = shutdown.cancelled() => {}
                result = async {
                    rings.wait_until_ready().await?;
                    leases.wait_until_ready().await?;
                    namespaces.wait_until_ready().await
                } => match result {
                    Ok(()) => {
                        readiness.set_caches_synced();
                        tracing::info!("caches synced");
                    }
                    Err(error) => tracing::error!(%error, "caches failed to sync"),
                },
            }
        });
    }
    tasks.spawn(maintain_registry(
        ctx.clone(),
        changed.clone(),
        shutdown.clone(),
    ));

    // Webhook server on every replica, with its certificate reloaded from disk.
    let server_config = &config.webhook.server;
    let reloader = Arc::new(CertReloader::new(
        server_config.cert_dir.join(&server_config.cert_name),
        server_config.cert_dir.join(&server_config.key_name),
    ));
    tasks.spawn(watch_certificate(
        reloader.clone(),
        readiness.clone(),
        shutdown.clone(),
    ));
    let tls = tokio_rustls::TlsAcceptor::from(Arc::new(
        reloader
            .server_config()
            .context("failed to build TLS config")?,
    ));
    let webhook_addr = sharding_crds::config::parse_bind_address(&server_config.bind_address)
        .map_err(anyhow::Error::msg)?
        .context("webhook server address")?;
    let listener = server::bind(webhook_addr).await?;
    tracing::info!(address = %listener.local_addr()?, "serving webhook");
    let app = webhook::router(webhook::WebhookState {
        rings: ctx.registry.clone(),
        metrics: ctx.metrics.clone(),
    });
    tasks.spawn(server::serve_tls(
        listener,
        tls,
        app,
        shutdown.clone(),
        config.graceful_shutdown.0,
    ));

    // Admin servers.
    let mut registry = Registry::default();
    ctx.metrics.register(&mut registry);
    registry.register_collector(Box::new(StateCollector(Arc::new(CacheState(ctx.clone())))));
    if let Some(addr) = config.metrics.socket_addr().map_err(anyhow::Error::msg)? {
        let listener = server::bind(addr).await?;
        tracing::info!(address = %listener.local_addr()?, "serving metrics");
        tasks.spawn(server::serve_plain(
            listener,
            server::metrics_router(Arc::new(registry)),
            shutdown.clone(),
        ));
    }
    if let Some(addr) = config.health.socket_addr().map_err(anyhow::Error::msg)? {
        let listener = server::bind(addr).await?;
        tracing::info!(address = %listener.local_addr()?, "serving health probes");
        tasks.spawn(server::serve_plain(
            listener,
            server::health_router(readiness.clone()),
            shutdown.clone(),
        ));
    }

    tasks.spawn(lead(ctx.clone(), identity, shutdown.clone()));

    shutdown.cancelled().await;
    readiness.set_shutting_down();
    tracing::info!("shutting down");
    let drained = tokio::time::timeout(config.graceful_shutdown.0, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!("graceful shutdown timed out; stopping the remaining tasks");
        tasks.shutdown().await;
    }
    Ok(())
}

async fn build_client(config: &SharderConfig) -> anyhow::Result<Client> {
    let path = &config.client_connection.kubeconfig;
    let kube_config = if path.is_empty() {
        Config::infer()
            .await
            .context("failed to find a kubeconfig or in-cluster config")?
    } else {
        let kubeconfig =
            Kubeconfig::read_from(path).with_context(|| format!("failed to read {path}"))?;
        Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .with_context(|| format!("failed to load {path}"))?
    };
    let builder =
        kube::client::ClientBuilder::try_from(kube_config).context("failed to build API client")?;
    // No client-side throttling unless configured (SPEC §11).
    match config.client_connection.qps.filter(|qps| *qps > 0.0) {
        Some(qps) => {
            // Burst defaults to the rate itself, at least one request.
            let burst = config
                .client_connection
                .burst
                .unwrap_or_else(|| qps.ceil() as u32);
            let layer = throttle::ThrottleLayer::new(qps, burst);
            Ok(builder.with_layer(&layer).build())
        }
        None => Ok(builder.build()),
    }
}

/// Polls a reflector stream until shutdown, notifying `changed` after every event.
async fn drive<S, K>(stream: S, changed: Option<Arc<Notify>>, shutdown: CancellationToken)
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
{
    let stream = stream.default_backoff();
    futures::pin_mut!(stream);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            item = stream.next() => match item {
                None => return,
                Some(Ok(_)) => {
                    if let Some(changed) = &changed {
                        changed.notify_one();
                    }
                }
                Some(Err(error)) => tracing::warn!(%error, "watch failed, retrying with backoff"),
            },
        }
    }
}

async fn watch_certificate(
    reloader: Arc<CertReloader>,
    readiness: Arc<Readiness>,
    shutdown: CancellationToken,
) {
    loop {
        match reloader.reload_if_changed() {
            Ok(true) => {
                readiness.set_certificate_loaded();
                tracing::info!("loaded webhook serving certificate");
            }
            Ok(false) => {}
            Err(error) => {
                if reloader.is_loaded() {
                    tracing::warn!(%error, "failed to reload webhook serving certificate, keeping the previous one");
                } else {
                    tracing::warn!(%error, "webhook serving certificate not available yet");
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(tls::RELOAD_INTERVAL) => {}
        }
    }
}

/// Rebuilds ring views when a ring's spec or its set of available shards changes.
async fn maintain_registry(ctx: Context, changed: Arc<Notify>, shutdown: CancellationToken) {
    let mut retry = tokio::time::interval(UNRESOLVED_RETRY);
    loop {
        let retry_unresolved = tokio::select! {
            () = shutdown.cancelled() => return,
            () = changed.notified() => false,
            _ = retry.tick() => true,
        };
        refresh_registry(&ctx, retry_unresolved).await;
    }
}

async fn refresh_registry(ctx: &Context, retry_unresolved: bool) {
    let leases = ctx.leases.state();
    let mut keep = BTreeSet::new();
    for ring in ctx.rings.state() {
        let name = ring.name_any();
        if validation::validate_ring(&ring).is_err() {
            // A broken ring is not acted on; the ring controller reports why.
            continue;
        }
        keep.insert(name.clone());
        let shards = available_shards(&name, leases.iter().map(AsRef::as_ref));
        let current = ctx.registry.get(&name);
        let shards_changed = current.as_ref().is_none_or(|v| {
            v.ring.shards().len() != shards.len()
                || !v.ring.shards().iter().zip(&shards).all(|(a, b)| a == b)
        });
        let spec_changed = current
            .as_ref()
            .is_none_or(|v| v.generation != ring.metadata.generation);
        let retry = retry_unresolved && current.as_ref().is_some_and(|v| !v.unresolved.is_empty());
        if !(shards_changed || spec_changed || retry) {
            continue;
        }
        let resources: Vec<_> = ring
            .spec
            .resources
            .iter()
            .flat_map(|r| {
                std::iter::once(r.group_resource()).chain(r.controlled_resources.iter().cloned())
            })
            .collect();
        let discovered = ctx.discovery.resolve(&resources).await;
        let view = build_view(&ring, &shards, &discovered);
        if shards_changed {
            ctx.metrics
                .ring_calculations
                .get_or_create(&RingLabels {
                    clusterring: name.clone(),
                })
                .inc();
            tracing::info!(ring = %name, shards = ?shards, "rebuilt hash ring");
        }
        if !view.unresolved.is_empty() {
            tracing::warn!(ring = %name, unresolved = ?view.unresolved, "some ring resources are not served by the API server (yet)");
        }
        ctx.registry.insert(view);
    }
    ctx.registry.retain(&keep);
}

/// Runs the controllers while this replica is the leader (or always, without leader election).
async fn lead(ctx: Context, identity: String, shutdown: CancellationToken) {
    let le = ctx.config.leader_election.clone();
    if !le.leader_elect {
        run_controllers(ctx, shutdown).await;
        return;
    }
    let lock_config = LeaseLockConfig::new(&le.resource_namespace, &le.resource_name, &identity)
        .with_timing(le.timing());
    let lock = match LeaseLock::new(ctx.client.clone(), lock_config) {
        Ok(lock) => lock,
        Err(error) => {
            tracing::error!(%error, "invalid leader election settings");
            return;
        }
    };
    loop {
        let held = tokio::select! {
            () = shutdown.cancelled() => return,
            held = lock.acquire() => held,
        };
        tracing::info!(%identity, "became leader, starting controllers");
        let controllers = shutdown.child_token();
        let task = tokio::spawn(run_controllers(ctx.clone(), controllers.clone()));
        tokio::select! {
            () = held.lost() => {
                // Another replica may lead already: stop at once rather than finish reconciles.
                task.abort();
                let _ = task.await;
                tracing::error!("lost leadership, stopped controllers");
            }
            () = shutdown.cancelled() => {
                controllers.cancel();
                let _ = task.await;
                match held.release().await {
                    Ok(_) => {}
                    Err(error) => tracing::warn!(%error, "failed to release leader election Lease"),
                }
                return;
            }
        }
    }
}

async fn run_controllers(ctx: Context, shutdown: CancellationToken) {
    tokio::join!(
        controller_ring::run(ctx.clone(), shutdown.clone()),
        shard_lease::run(ctx.clone(), shutdown.clone()),
        sync::run(ctx, shutdown),
    );
}

/// State metrics read from the caches at scrape time.
#[derive(Debug)]
struct CacheState(Context);

impl StateSource for CacheState {
    fn rings(&self) -> Vec<RingSnapshot> {
        self.0
            .rings
            .state()
            .iter()
            .map(|r| {
                let status = r.status.clone().unwrap_or_default();
                RingSnapshot {
                    name: r.name_any(),
                    uid: r.uid().unwrap_or_default(),
                    generation: r.metadata.generation.unwrap_or_default(),
                    observed_generation: status.observed_generation.unwrap_or_default(),
                    shards: status.shards.into(),
                    available_shards: status.available_shards.into(),
                }
            })
            .collect()
    }

    fn shards(&self) -> Vec<ShardSnapshot> {
        let now = Timestamp::now();
        self.0
            .leases
            .state()
            .iter()
            .filter_map(|l| {
                let ring = l.labels().get(LABEL_CLUSTER_RING)?.clone();
                Some(ShardSnapshot {
                    namespace: l.namespace().unwrap_or_default(),
                    shard: l.name_any(),
                    clusterring: ring,
                    uid: l.uid().unwrap_or_default(),
                    state: ShardLease::from_lease(l).state(now).as_str(),
                })
            })
            .collect()
    }
}

/// A leader-election identity unique per process: host name, process id and start time.
pub fn default_identity() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .unwrap_or_else(|| "sharder".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!("{host}_{}_{nanos:08x}", std::process::id())
}

/// Reads and validates a configuration file; without a path, the defaults apply.
pub fn load_config(path: Option<&std::path::Path>) -> anyhow::Result<SharderConfig> {
    match path {
        None => Ok(SharderConfig::default()),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("failed to read config file {}", path.display()))?;
            Ok(SharderConfig::from_yaml(&text)?)
        }
    }
}
