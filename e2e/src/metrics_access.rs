//! Scrapers of the secure metrics as a cluster has them: ServiceAccounts whose tokens come from
//! the TokenRequest API, bound to the shipped ClusterRole `sharding:metrics-reader` as read from
//! `config/` (never typed again here).

use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::Client;
use kube::api::{Api, Patch, PostParams};
use serde_json::json;

use crate::in_cluster::workspace_root;
use crate::process::poll_until;
use crate::{FIELD_MANAGER, patch_params};

/// Name of the shipped ClusterRole that allows `get` on `/metrics`.
pub const METRICS_READER: &str = "sharding:metrics-reader";

/// The file that ships it, relative to the workspace root.
pub const METRICS_READER_FILE: &str = "config/rbac/metrics_reader_cluster_role.yaml";

/// The shipped metrics-reader ClusterRole, parsed from [`METRICS_READER_FILE`].
pub fn shipped_metrics_reader() -> anyhow::Result<ClusterRole> {
    let path = workspace_root().join(METRICS_READER_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("failed to read {}", path.display()))?;
    let role: ClusterRole = serde_yaml::from_str(&text)
        .with_context(|| format!("{METRICS_READER_FILE} holds no ClusterRole"))?;
    anyhow::ensure!(
        role.metadata.name.as_deref() == Some(METRICS_READER),
        "{METRICS_READER_FILE} does not name {METRICS_READER}"
    );
    Ok(role)
}

/// Applies the shipped metrics-reader ClusterRole (server-side apply: any test may call it).
pub async fn install_metrics_reader(client: &Client) -> anyhow::Result<()> {
    let role = shipped_metrics_reader()?;
    Api::<ClusterRole>::all(client.clone())
        .patch(
            METRICS_READER,
            &kube::api::PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&role),
        )
        .await
        .context("failed to apply the metrics-reader ClusterRole")?;
    Ok(())
}

/// Creates the ServiceAccount `ns`/`name` and returns a token for it from the TokenRequest API,
/// valid for an hour, for the API server's own audience.
pub async fn service_account_token(
    client: &Client,
    ns: &str,
    name: &str,
) -> anyhow::Result<String> {
    let accounts = Api::<ServiceAccount>::namespaced(client.clone(), ns);
    let account: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    accounts
        .create(&PostParams::default(), &account)
        .await
        .with_context(|| format!("failed to create ServiceAccount {ns}/{name}"))?;
    token_for(client, ns, name, Vec::new()).await
}

/// A token for the existing ServiceAccount `ns`/`name` from the TokenRequest API, valid for an
/// hour, for `audiences` (empty: the API server's own).
pub async fn token_for(
    client: &Client,
    ns: &str,
    name: &str,
    audiences: Vec<String>,
) -> anyhow::Result<String> {
    let accounts = Api::<ServiceAccount>::namespaced(client.clone(), ns);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences,
            expiration_seconds: Some(3600),
            bound_object_ref: None,
        },
        ..TokenRequest::default()
    };
    let answer = accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .with_context(|| format!("failed to request a token for {ns}/{name}"))?;
    answer
        .status
        .map(|s| s.token)
        .filter(|t| !t.is_empty())
        .with_context(|| format!("the TokenRequest for {ns}/{name} returned no token"))
}

/// Binds the ServiceAccount `ns`/`name` to the metrics-reader ClusterRole, as the README tells a
/// user to do for their Prometheus, and waits until the API server's authorizer allows it `get`
/// on `/metrics` (so no scrape meets, and caches, a refusal from before the binding arrived).
pub async fn bind_metrics_reader(client: &Client, ns: &str, name: &str) -> anyhow::Result<()> {
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": format!("{METRICS_READER}:{ns}:{name}")},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": METRICS_READER,
        },
        "subjects": [{"kind": "ServiceAccount", "namespace": ns, "name": name}],
    }))?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(
            &PostParams {
                field_manager: patch_params().field_manager,
                ..PostParams::default()
            },
            &binding,
        )
        .await
        .with_context(|| format!("failed to bind {ns}/{name} to {METRICS_READER}"))?;
    let user = format!("system:serviceaccount:{ns}:{name}");
    poll_until(
        "the metrics-reader binding to take effect",
        Duration::from_secs(30),
        || async { Ok(may_get_metrics(client, &user).await?.then_some(())) },
    )
    .await
}

/// Whether the authorizer allows `user` (in the ServiceAccounts' groups) `get` on `/metrics`.
pub async fn may_get_metrics(client: &Client, user: &str) -> anyhow::Result<bool> {
    let review: SubjectAccessReview = serde_json::from_value(json!({
        "spec": {
            "user": user,
            "groups": ["system:serviceaccounts", "system:authenticated"],
            "nonResourceAttributes": {"path": "/metrics", "verb": "get"},
        },
    }))?;
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .context("failed to create a SubjectAccessReview")?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}
