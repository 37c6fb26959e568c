//! The API server's sharded list and watch (feature gate `ShardedListAndWatch`, zero-write
//! rings): whether a server has it on, and a control plane of its own with it off.
//!
//! `control-plane.sh` turns the gate on whenever its kube-apiserver knows it (1.36 on), so the
//! shared control plane has it on from 1.36; older releases have no such gate and ignore a
//! `shardSelector` as a server with the gate off does.

use kube::Client;

use crate::dedicated::DedicatedCluster;
use crate::prometheus;

/// The feature gate's name.
pub const GATE: &str = "ShardedListAndWatch";

/// The kube-apiserver flag that turns the gate off (after `control-plane.sh` turned it on).
pub const GATE_OFF: &str = "--feature-gates=ShardedListAndWatch=false";

/// Whether the server of `client` knows the gate (`None`: it does not) and has it on, from its
/// own `kubernetes_feature_enabled` metric.
pub async fn gate(client: &Client) -> anyhow::Result<Option<bool>> {
    let text = prometheus::apiserver_metrics(client).await?;
    Ok(prometheus::samples(&text, "kubernetes_feature_enabled")
        .into_iter()
        .find(|(labels, _)| prometheus::label(labels, "name") == GATE)
        .map(|(_, value)| value > 0.0))
}

/// A control plane of its own whose API server ignores `shardSelector`: the gate off where the
/// release knows it, else the release as it is (it cannot filter). Either way, a list answers
/// with every object and without `metadata.shardInfo`, which the caller should check.
pub async fn start_with_gate_off(shared: &Client) -> anyhow::Result<DedicatedCluster> {
    // A dedicated control plane runs the shared one's binaries.
    let args: &[&str] = if gate(shared).await?.is_some() {
        &[GATE_OFF]
    } else {
        &[]
    };
    DedicatedCluster::start_with_apiserver_args(args).await
}
