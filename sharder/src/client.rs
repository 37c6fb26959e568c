//! The sharder's API client: from the configured kubeconfig (or the in-cluster config), with
//! client-side throttling only when `clientConnection.qps` is set (SPEC §11).

mod throttle;

use anyhow::Context as _;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use sharding_crds::config::SharderConfig;

/// Builds the client described by `clientConnection`.
pub(crate) async fn build_client(config: &SharderConfig) -> anyhow::Result<Client> {
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
