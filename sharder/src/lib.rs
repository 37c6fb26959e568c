//! The sharder: assigns the objects of every `ClusterRing` and `ControllerRing` to the ring's
//! available shards and moves them when shards come and go. Both kinds run through one engine;
//! what differs between them is in [`kube_sharding_api::RingKind`].
//!
//! | module | what |
//! |---|---|
//! | [`core`] | the pure core: hash ring, hash keys, rebalance decision, owner wait, sync schedule, ring validation, desired webhook configuration |
//! | `caches` | the caches of rings and shard Leases: reflectors, batching, the Lease index, the thread their watches run on |
//! | `changes` | the change hub: every change a controller or the ring views can wake on, announced in one place |
//! | [`views`] | the ring views the webhook and the sync read, and the task that keeps them current |
//! | [`controller`] | the leader's controllers, one module each: rings, shard Leases, the sharder's sync |
//! | `leader_election` | runs the controllers on the elected leader only; the process's identity |
//! | [`webhook`] | the admission webhook that assigns objects, and its TLS server |
//! | [`server`] | the HTTPS server with certificate reload, the metrics server (HTTPS behind TokenReview and SubjectAccessReview, or plain), the health server |
//! | [`metrics`] | counters, and the state metrics rendered from a `StateSource` |
//! | `leader` | what the leader keeps: each ring's observed objects, webhook reachability, direct moves in flight, Events |
//! | `state_source` | the state metrics' source: the caches, what was observed, reachability |
//! | `client` | the API clients (controllers, leader election, caches) |
//! | `context` | what the leader's controllers share |
//! | [`cli`] | the kubectl plugin (`kubectl sharding`): status, explain, simulate |
//! | `test_rings` | ring fixtures of the unit tests |
//!
//! [`run`] lists the tasks of the process and stops them all on one shutdown signal. The Lease
//! rules (shard states, expiry, takeover, timing) are shared with the shard library in
//! [`kube_sharding_api::lease`].

mod caches;
mod changes;
pub mod cli;
mod client;
mod context;
pub mod controller;
pub mod core;
mod leader;
mod leader_election;
pub mod metrics;
pub mod server;
mod state_source;
#[cfg(test)]
mod test_rings;
pub mod views;
pub mod webhook;

pub use crate::leader_election::default_identity;

use std::sync::Arc;

use anyhow::Context as _;
use kube_sharding_api::config::SharderConfig;
use prometheus_client::registry::Registry;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::caches::{CacheThread, Caches};
use crate::changes::Changes;
use crate::context::Context;
use crate::leader::direct_moves::DirectMoves;
use crate::leader::events::Events;
use crate::leader::reachability::Reachability;
use crate::metrics::{Metrics, StateCollector};
use crate::server::Readiness;
use crate::state_source::CacheState;
use crate::views::{Discovery, Views};

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
    let readiness = Arc::new(Readiness::default());
    let mut tasks = JoinSet::new();

    // Caches on every replica: the webhook and the metrics need them, not only the leader. Their
    // watches run on a thread of their own (see `caches::CacheThread`), which stops when `run`
    // returns, after the tasks below were joined.
    let cache_thread = CacheThread::start().context("failed to start the caches' thread")?;
    let changes = Arc::new(Changes::default());
    // Subscribed before the watches start, so that no ring change goes unseen.
    let ring_changes = changes.rings();
    let caches = Caches::start(
        clients.caches,
        &cache_thread,
        changes.clone(),
        &mut tasks,
        &shutdown,
    );
    let ctx = Context {
        client: client.clone(),
        config: config.clone(),
        caches,
        views: Arc::new(Views::default()),
        discovery: Arc::new(Discovery::new(client.clone())),
        events: Arc::new(Events::new(
            client.clone(),
            identity.clone(),
            metrics.events_suppressed.clone(),
        )),
        observed: Arc::default(),
        reachability: Arc::new(Reachability::new(changes.clone())),
        direct_moves: Arc::new(DirectMoves::new(changes)),
        metrics,
    };
    // Refused leader-election settings stop the process here, before it serves anything.
    let election = leader_election::Election::new(&ctx, clients.leader_election, identity.clone())?;
    // Ring views on every replica, rebuilt when rings or their shards change.
    let view_sources = views::ViewSources {
        caches: ctx.caches.clone(),
        discovery: ctx.discovery.clone(),
        views: ctx.views.clone(),
        allowed_protected: config.webhook.config.allowed_protected_resources.clone(),
        default_selector: config.webhook.config.namespace_selector.clone(),
        ring_calculations: ctx.metrics.ring_calculations.clone(),
        // The leader's sync sees every pinned main object once per sync period: a pin unseen for
        // several periods belongs to an object that is gone.
        pins: views::Pins::new(ctx.caches.namespaces.clone())
            .with_max_age(
                (config.controller.sharder.sync_period.0 * 4)
                    .max(std::time::Duration::from_secs(3600)),
            )
            .with_not_remembered(ctx.metrics.pins_not_remembered.clone()),
    };
    tasks.spawn(views::maintain(
        view_sources.clone(),
        ring_changes,
        shutdown.clone(),
    ));
    // Fires once the caches have their first listing and the ring views are built.
    let synced = CancellationToken::new();
    tasks.spawn(report_caches_synced(
        view_sources.clone(),
        readiness.clone(),
        synced.clone(),
        shutdown.clone(),
    ));

    // Webhook server on every replica, with its certificate reloaded from disk; the secure
    // metrics server serves the same one.
    let server = &config.webhook.server;
    let certificate = Arc::new(server::tls::CertReloader::new(
        server.cert_dir.join(&server.cert_name),
        server.cert_dir.join(&server.key_name),
    ));
    tasks.spawn(server::tls::watch_certificate(
        certificate.clone(),
        readiness.clone(),
        shutdown.clone(),
    ));
    // What the state metrics and the external metrics API read, on every replica.
    let state = Arc::new(CacheState {
        caches: ctx.caches.clone(),
        observed: ctx.observed.clone(),
        reachability: ctx.reachability.clone(),
    });
    webhook::serve(
        &config,
        webhook::WebhookState {
            views: ctx.views.clone(),
            metrics: ctx.metrics.clone(),
            client: Some(client.clone()),
        },
        server::external_metrics_router(Arc::new(server::ExternalMetrics::new(
            state.clone(),
            clients.external_metrics,
        ))),
        &certificate,
        &mut tasks,
        &shutdown,
    )
    .await?;

    // Admin servers: metrics (counters and the state read from the caches; scrapers reviewed
    // through the main client unless `metrics.secure` is off) and health probes.
    let mut registry = Registry::default();
    ctx.metrics.register(&mut registry);
    registry.register_collector(Box::new(StateCollector(state.clone())));
    server::serve_admin(
        &config,
        registry,
        readiness.clone(),
        &certificate,
        server::ReviewClients {
            new_tokens: clients.metrics_auth_new,
            known: clients.metrics_auth_known,
        },
        &mut tasks,
        &shutdown,
    )
    .await?;

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

/// Marks the process ready for probes once every cache has synced.
async fn report_caches_synced(
    sources: views::ViewSources,
    readiness: Arc<Readiness>,
    synced: CancellationToken,
    shutdown: CancellationToken,
) {
    tokio::select! {
        () = shutdown.cancelled() => {}
        result = sources.caches.wait_until_ready() => match result {
            Ok(()) => {
                // Ready only once the webhook can answer from complete caches: build the views of
                // every ring now rather than waiting for the next change to trigger it.
                views::refresh(
                    &sources,
                    views::Scope::All {
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
