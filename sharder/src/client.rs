//! The sharder's API client: from the configured kubeconfig (or the in-cluster config), with
//! client-side throttling only when `clientConnection.qps` is set (docs/protocol.md §11).

pub mod requests;
mod throttle;

use anyhow::Context as _;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use kube_sharding_api::config::SharderConfig;

use self::requests::{ApiRequests, CountLayer};

/// The sharder's clients: one for the controllers, throttled as configured; one for leader
/// election only, never throttled, so that a burst of sync patches waiting for their turn can
/// never delay a renewal of the leader Lease past its deadline; and one for the caches' lists and
/// watches (a few requests an hour), whose connections live on the caches' own thread.
pub(crate) struct Clients {
    /// Controllers, webhook configuration, events.
    pub(crate) main: Client,
    /// Renewals of the leader-election Lease.
    pub(crate) leader_election: Client,
    /// Lists and watches of the caches.
    pub(crate) caches: Client,
    /// Reviews of metrics scrapers' tokens never accepted before: what a client sending random
    /// tokens reaches. Throttled on its own, so it takes nothing from the controllers' budget.
    pub(crate) metrics_auth_new: Client,
    /// Reviews of tokens accepted before, and of what their users may do; throttled on its own,
    /// so random tokens cannot delay a known scraper's review.
    pub(crate) metrics_auth_known: Client,
    /// The external metrics API's reads of the request-header settings and its
    /// SubjectAccessReviews; throttled on its own like the metrics reviews.
    pub(crate) external_metrics: Client,
}

/// Requests per second (and burst) of each metrics-authentication client: a few scrapers need a
/// couple of reviews every two minutes.
const METRICS_AUTH_QPS: f32 = 20.0;

/// Builds the clients described by `clientConnection`, counting their requests into `requests`.
pub(crate) async fn build_clients(
    config: &SharderConfig,
    requests: &ApiRequests,
) -> anyhow::Result<Clients> {
    let kube_config = load(config).await?;
    let leader_election = kube::client::ClientBuilder::try_from(kube_config.clone())
        .context("failed to build API client")?
        .with_layer(&CountLayer::new(requests.clone(), "leader_election"))
        .build();
    let caches = kube::client::ClientBuilder::try_from(kube_config.clone())
        .context("failed to build API client")?
        .with_layer(&CountLayer::new(requests.clone(), "caches"))
        .build();
    let metrics_auth = |name: &'static str| -> anyhow::Result<Client> {
        Ok(kube::client::ClientBuilder::try_from(kube_config.clone())
            .context("failed to build API client")?
            .with_layer(&CountLayer::new(requests.clone(), name))
            .with_layer(&throttle::ThrottleLayer::new(
                METRICS_AUTH_QPS,
                METRICS_AUTH_QPS as u32,
            ))
            .build())
    };
    let metrics_auth_new = metrics_auth("metrics_auth")?;
    let metrics_auth_known = metrics_auth("metrics_auth")?;
    let external_metrics = metrics_auth("external_metrics")?;
    let builder = kube::client::ClientBuilder::try_from(kube_config)
        .context("failed to build API client")?
        .with_layer(&CountLayer::new(requests.clone(), "main"));
    // No client-side throttling unless configured (docs/protocol.md §11).
    let main = match config.client_connection.qps.filter(|qps| *qps > 0.0) {
        Some(qps) => {
            // Burst defaults to the rate itself, at least one request.
            let burst = config
                .client_connection
                .burst
                .unwrap_or_else(|| qps.ceil() as u32);
            let layer = throttle::ThrottleLayer::new(qps, burst);
            builder.with_layer(&layer).build()
        }
        None => builder.build(),
    };
    Ok(Clients {
        main,
        leader_election,
        caches,
        metrics_auth_new,
        metrics_auth_known,
        external_metrics,
    })
}

async fn load(config: &SharderConfig) -> anyhow::Result<Config> {
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
    Ok(kube_config)
}
