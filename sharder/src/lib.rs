//! The sharder: assigns the objects of every `ClusterRing` and `ControllerRing` to the ring's
//! available shards and moves them when shards come and go. Both kinds run through one engine;
//! what differs between them is in [`sharding_crds::RingKind`].
//!
//! | module | what |
//! |---|---|
//! | [`core`] | the pure core: hash ring, hash keys, rebalance decision, sync schedule, ring validation, desired webhook configuration |
//! | `controller` | the leader's controllers, one module each: rings, shard Leases, the sharder's sync and its missed-assignment path |
//! | [`ring_views`] | the ring-view registry the webhook and the sync read, and the task that keeps it current |
//! | [`webhook`] | the admission webhook that assigns objects |
//! | [`server`] | the HTTPS webhook server with certificate reload, the health and metrics servers |
//! | [`metrics`] | counters and the state metrics read from the caches |
//! | `leader_election` | runs the controllers on the elected leader only |
//! | `client`, `context` | the API clients (controllers, leader election, caches); what the tasks share |
//! | `cache_thread` | the single-threaded runtime the caches' watches run on |
//! | `events`, `observed` | rate-limited Events; what the leader learned about each ring's objects |
//! | [`reachability`] | whether the API server reaches each ring's webhook; moves stop while it does not |
//!
//! [`run`] lists the tasks of the process and stops them all on one shutdown signal. The Lease
//! rules (shard states, expiry, takeover, timing) are shared with the shard library in
//! [`sharding_crds::lease`].

mod cache_thread;
pub mod cli;
pub mod client;
mod context;
pub mod controller;
pub mod core;
mod events;
mod leader_election;
mod lease_index;
pub mod metrics;
mod observed;
pub mod reachability;
pub mod ring_views;
pub mod server;
pub mod webhook;

use std::fmt::Debug;
use std::sync::Arc;

use anyhow::Context as _;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use prometheus_client::registry::Registry;
use serde::de::DeserializeOwned;
use sharding_crds::config::SharderConfig;
use sharding_crds::{ClusterRing, ControllerRing, RingKind};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::cache_thread::CacheThread;
use crate::context::Context;
use crate::events::Events;
use crate::lease_index::LeaseIndex;
use crate::metrics::{CacheState, Metrics, StateCollector};
use crate::ring_views::{Discovery, RingViews};
use crate::server::Readiness;
use crate::server::tls::CertReloader;

/// Runs the sharder until `signal` fires, then stops everything within the configured
/// `gracefulShutdown`: first it reports not ready while still serving the webhook for
/// `shutdownDelay` (so endpoints stop sending it admission calls before its listener closes),
/// then every task stops on one shutdown token and the leader releases its Lease.
pub async fn run(
    config: SharderConfig,
    identity: String,
    signal: CancellationToken,
) -> anyhow::Result<()> {
    let config = Arc::new(config);
    // Every task stops on this token, which fires `shutdownDelay` after `signal`.
    let shutdown = CancellationToken::new();
    let _stop_on_return = shutdown.clone().drop_guard();
    let metrics = Metrics::default();
    let clients = client::build_clients(&config, &metrics.api_requests).await?;
    let client = clients.main;
    // The caches' watches run on a thread of their own (see `cache_thread`); it stops when `run`
    // returns, after the tasks below were joined.
    let cache_thread = CacheThread::start().context("failed to start the caches' thread")?;
    let caches = Caches {
        client: clients.caches,
        runtime: cache_thread.handle().clone(),
    };
    let readiness = Arc::new(Readiness::default());
    let changed = Arc::new(Notify::new());
    let mut tasks = JoinSet::new();

    // Caches on every replica: the webhook and the metrics need them, not only the leader.
    // Changes of rings rebuild every ring view; membership changes of Leases rebuild the views of
    // their rings (`ring_views::maintain` follows the Lease indexes).
    let ring_changes = tokio::sync::watch::Sender::new(0u64);
    let on_ring_change = {
        let (changed, ring_changes) = (changed.clone(), ring_changes.clone());
        move || {
            changed.notify_one();
            ring_changes.send_modify(|c| *c = c.wrapping_add(1));
        }
    };
    let cluster_rings = spawn_reflector(
        &mut tasks,
        &caches,
        Api::<ClusterRing>::all(caches.client.clone()),
        watcher::Config::default(),
        {
            let on_ring_change = on_ring_change.clone();
            move |_: &watcher::Event<ClusterRing>| {
                on_ring_change();
                true
            }
        },
        &shutdown,
    );
    let controller_rings = spawn_reflector(
        &mut tasks,
        &caches,
        Api::<ControllerRing>::all(caches.client.clone()),
        watcher::Config::default(),
        move |_: &watcher::Event<ControllerRing>| {
            on_ring_change();
            true
        },
        &shutdown,
    );
    // Lease changes that matter for membership (not renewals) update the ring statuses.
    let lease_changes = tokio::sync::watch::Sender::new(0u64);
    // A label selector cannot say "either label", so each kind's Leases have a cache of their own.
    let [cluster_ring_leases, controller_ring_leases] = RingKind::ALL.map(|kind| {
        let (store, writer) = reflector::store();
        let index = Arc::new(LeaseIndex::new(kind, store));
        let observer = index.clone();
        let lease_changes = lease_changes.clone();
        spawn_reflector_into(
            &mut tasks,
            &caches,
            writer,
            Api::<Lease>::all(caches.client.clone()),
            watcher::Config::default().labels(kind.lease_label()),
            move |event: &watcher::Event<Lease>| {
                let changed = observer.observe(event, Timestamp::now());
                if changed {
                    lease_changes.send_modify(|c| *c = c.wrapping_add(1));
                }
                changed
            },
            &shutdown,
        );
        index
    });
    let namespaces = spawn_reflector(
        &mut tasks,
        &caches,
        Api::<Namespace>::all(caches.client.clone()),
        watcher::Config::default(),
        |_: &watcher::Event<Namespace>| true,
        &shutdown,
    );
    let ctx = Context {
        client: client.clone(),
        config: config.clone(),
        cluster_rings,
        controller_rings,
        cluster_ring_leases,
        controller_ring_leases,
        namespaces,
        ring_views: Arc::new(RingViews::default()),
        discovery: Arc::new(Discovery::new(client.clone())),
        events: Arc::new(Events::new(
            client.clone(),
            identity.clone(),
            metrics.events_suppressed.clone(),
        )),
        observed: Arc::default(),
        reachability: Arc::default(),
        lease_changes,
        ring_changes,
        patch_limit: Arc::new(controller::patch_limit::PatchLimit::new(
            config.controller.sharder.max_patches_in_flight,
            metrics.patches_in_flight.clone(),
        )),
        metrics,
    };
    // Refused leader-election settings stop the process here, before it serves anything.
    let election = leader_election::Election::new(&ctx, clients.leader_election, identity.clone())?;
    // Fires once the caches have their first listing and the ring views are built.
    let synced = CancellationToken::new();
    tasks.spawn(report_caches_synced(
        ctx.clone(),
        readiness.clone(),
        synced.clone(),
        shutdown.clone(),
    ));
    tasks.spawn(ring_views::maintain(
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
    tasks.spawn(server::tls::watch_certificate(
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
        rings: ctx.ring_views.clone(),
        metrics: ctx.metrics.clone(),
    });
    tasks.spawn(server::serve_tls(
        listener,
        tls,
        app,
        server::ConnectionLimits::default(),
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

    // The controllers, on the leader only.
    tasks.spawn(election.run(ctx.clone(), synced, shutdown.clone()));

    signal.cancelled().await;
    readiness.set_shutting_down();
    tracing::info!(delay = ?config.shutdown_delay.0, "shutting down: not ready, serving the webhook a little longer");
    tokio::time::sleep(config.shutdown_delay.0).await;
    tracing::info!("stopping every task");
    shutdown.cancel();
    let remaining = config
        .graceful_shutdown
        .0
        .saturating_sub(config.shutdown_delay.0);
    let drained = tokio::time::timeout(remaining, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!("graceful shutdown timed out; stopping the remaining tasks");
        tasks.shutdown().await;
    }
    Ok(())
}

/// Starts a task in `tasks` that keeps a cache of the objects `api` and `config` select until
/// shutdown, handing every event to `observe` after the cache applied it (`observe` answers whether
/// the event changed something others act on, see `CACHE_READ_PAUSE`); returns the cache.
fn spawn_reflector<K>(
    tasks: &mut JoinSet<()>,
    caches: &Caches,
    api: Api<K>,
    config: watcher::Config,
    observe: impl FnMut(&watcher::Event<K>) -> bool + Send + 'static,
    shutdown: &CancellationToken,
) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    let (store, writer) = reflector::store();
    spawn_reflector_into(tasks, caches, writer, api, config, observe, shutdown);
    store
}

/// Like [`spawn_reflector`], filling the cache behind `writer`.
fn spawn_reflector_into<K>(
    tasks: &mut JoinSet<()>,
    caches: &Caches,
    writer: reflector::store::Writer<K>,
    api: Api<K>,
    config: watcher::Config,
    mut observe: impl FnMut(&watcher::Event<K>) -> bool + Send + 'static,
    shutdown: &CancellationToken,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    let shutdown = shutdown.clone();
    let task = async move {
        // Nothing reads the managed fields of a cached object: dropping them before the cache
        // copies an object saves the copy its largest part.
        let events =
            watcher(api, config).modify(|obj| kube::ResourceExt::managed_fields_mut(obj).clear());
        let stream = reflector::reflector(writer, events).default_backoff();
        futures::pin_mut!(stream);
        // What an item asks for: stop (the stream ended), read on at once (something changed
        // that others act on, or the watch failed), or nothing.
        let mut handle = |item: Option<Result<watcher::Event<K>, watcher::Error>>| match item {
            None => None,
            Some(Ok(event)) => Some(observe(&event)),
            Some(Err(error)) => {
                tracing::warn!(%error, "watch failed, retrying with backoff");
                Some(true)
            }
        };
        loop {
            let item = tokio::select! {
                () = shutdown.cancelled() => return,
                item = stream.next() => item,
            };
            let Some(mut changed) = handle(item) else {
                return;
            };
            // Everything that arrived with it. The connection task hands over one event each time
            // it runs, so a read that is not ready at once is given a moment before the batch
            // counts as done.
            while !shutdown.is_cancelled()
                && let Ok(item) = tokio::time::timeout(CACHE_BATCH_GAP, stream.next()).await
            {
                let Some(item_changed) = handle(item) else {
                    return;
                };
                changed |= item_changed;
            }
            // A batch that changed something may be the start of more (Leases created one after
            // the other, then their ring): read on at once, so that no view is built from half
            // of them. A batch of renewals only is followed by a pause (see `CACHE_READ_PAUSE`).
            if changed {
                continue;
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(CACHE_READ_PAUSE) => {}
            }
        }
    };
    tasks.spawn_on(task, &caches.runtime);
}

/// How long a cache's task waits after applying a batch of events that changed nothing others act
/// on (Lease renewals) before it reads again. With 1,000 shards 500 renewals a second arrive one
/// by one; read as they come, each costs a wake-up, a poll of the socket and a read of it, more
/// than applying the event. Read every 100 ms they come in batches of about 50. The first event
/// after a pause is read at once, and a batch that changed membership, a ring or a namespace is
/// followed by no pause, so a change arriving during a pause is seen at most 100 ms later and
/// changes in a row are seen as they come.
const CACHE_READ_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// How long a batch of cache events waits for its next event before it counts as done.
const CACHE_BATCH_GAP: std::time::Duration = std::time::Duration::from_millis(1);

/// Where the caches' watches run: their own client, on the caches' thread.
struct Caches {
    client: kube::Client,
    runtime: tokio::runtime::Handle,
}

/// Marks the process ready for probes once every cache has synced.
async fn report_caches_synced(
    ctx: Context,
    readiness: Arc<Readiness>,
    synced: CancellationToken,
    shutdown: CancellationToken,
) {
    tokio::select! {
        () = shutdown.cancelled() => {}
        result = async {
            ctx.cluster_rings.wait_until_ready().await?;
            ctx.controller_rings.wait_until_ready().await?;
            ctx.cluster_ring_leases.store().wait_until_ready().await?;
            ctx.controller_ring_leases.store().wait_until_ready().await?;
            ctx.namespaces.wait_until_ready().await
        } => match result {
            Ok(()) => {
                // Ready only once the webhook can answer from complete caches: build the views of
                // every ring now rather than waiting for the next change to trigger it.
                ring_views::refresh(
                    &ctx,
                    ring_views::Scope::All {
                        retry_unresolved: false,
                    },
                )
                .await;
                readiness.set_caches_synced();
                synced.cancel();
                tracing::info!("caches synced, ring views built");
            }
            Err(error) => tracing::error!(%error, "caches failed to sync"),
        },
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
