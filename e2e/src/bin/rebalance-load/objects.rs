//! The load: creating the Secrets of the ring, and the floor measurement of plain patches.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use e2e::fixtures::secret;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, Patch, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::placement::Kind;
use crate::{CONFIG_MAP_PREFIX, FLOOR_LABEL, SECRET_PREFIX, progress};

/// Creates Secrets `range` with one data key each, `concurrency` at a time.
pub(crate) async fn create_secrets(
    client: &Client,
    namespace: &str,
    range: std::ops::Range<usize>,
    concurrency: usize,
    started: Instant,
) -> anyhow::Result<()> {
    let api = Api::<Secret>::namespaced(client.clone(), namespace);
    let total = range.len();
    let done = AtomicUsize::new(0);
    futures::stream::iter(range)
        .map(|i| {
            let (api, done) = (&api, &done);
            async move {
                let mut s = secret(&format!("{SECRET_PREFIX}{i}"));
                s.data = Some(BTreeMap::from([(
                    "value".to_string(),
                    ByteString(format!("v{i}").into_bytes()),
                )]));
                let mut attempt = 0;
                loop {
                    attempt += 1;
                    match api.create(&PostParams::default(), &s).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(status)) if status.code == 409 => break,
                        Err(error) if attempt < 5 => {
                            eprintln!("creating {} failed, retrying: {error}", s.name_any());
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(error) => {
                            return Err(anyhow::Error::new(error)
                                .context(format!("failed to create {}", s.name_any())));
                        }
                    }
                }
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                if n % 1000 == 0 || n == total {
                    progress(started, &format!("created {n}/{total} Secrets"));
                }
                Ok(())
            }
        })
        .buffer_unordered(concurrency.max(1))
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Patches `value` into [`FLOOR_LABEL`] on every object of `objects`, `concurrency` in flight;
/// returns the time taken and the number of failed patches.
pub(crate) async fn floor_run(
    client: &Client,
    namespace: &str,
    objects: &[(Kind, String)],
    concurrency: usize,
    value: &str,
) -> (Duration, usize) {
    let secrets = Api::<Secret>::namespaced(client.clone(), namespace);
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    let body = json!({"metadata": {"labels": {FLOOR_LABEL: value}}});
    let started = Instant::now();
    let failed = futures::stream::iter(objects)
        .map(|(kind, secret)| {
            let (secrets, configmaps, body) = (&secrets, &configmaps, &body);
            async move {
                let params = e2e::patch_params();
                let result = match kind {
                    Kind::Secret => secrets
                        .patch_metadata(secret, &params, &Patch::Merge(body))
                        .await
                        .map(drop),
                    Kind::ConfigMap => configmaps
                        .patch_metadata(
                            &format!("{CONFIG_MAP_PREFIX}{secret}"),
                            &params,
                            &Patch::Merge(body),
                        )
                        .await
                        .map(drop),
                };
                result.is_err()
            }
        })
        .buffer_unordered(concurrency.max(1))
        .filter(|failed| std::future::ready(*failed))
        .count()
        .await;
    (started.elapsed(), failed)
}
