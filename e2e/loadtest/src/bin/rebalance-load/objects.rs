//! The load: creating the Secrets of the ring, and the floor measurement of plain patches.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use e2e::fixtures::secret;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, Patch, PostParams};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::Notify;

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

/// One floor run's results.
pub(crate) struct FloorRun {
    /// From the first patch sent to the last answered.
    pub(crate) took: Duration,
    /// Patches that failed.
    pub(crate) failed: usize,
    /// For each patched Secret, from its patch's answer to this tool's own watch delivering the
    /// change, in milliseconds.
    pub(crate) delivery_ms: Vec<f64>,
    /// Each Secret patched: its name, and when its patch was sent and answered, on the clock of
    /// the shards' log records.
    pub(crate) secret_writes: Vec<(String, SystemTime, SystemTime)>,
}

/// Patches `value` into [`FLOOR_LABEL`] on every object of `objects`, `concurrency` in flight.
///
/// A metadata watch of the namespace's Secrets, opened (and listed) before the first patch, times
/// each Secret's patch from its answer to the watch delivering it: the API server's watch
/// delivery under this write load, with nothing of the sharder's protocol in the way (the handover
/// gap is the same span for an acknowledgement).
pub(crate) async fn floor_run(
    client: &Client,
    namespace: &str,
    objects: &[(Kind, String)],
    concurrency: usize,
    value: &str,
) -> FloorRun {
    let secrets = Api::<Secret>::namespaced(client.clone(), namespace);
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    let floor_value = value.to_string();
    let watch = FirstSeen::start(
        Api::namespaced(client.clone(), namespace),
        move |meta: &PartialObjectMeta<Secret>| {
            (meta.labels().get(FLOOR_LABEL) == Some(&floor_value)).then(|| meta.name_any())
        },
    )
    .await;
    let watch = match watch {
        Ok(watch) => Some(watch),
        Err(error) => {
            eprintln!("{error:#}: no delivery times");
            None
        }
    };
    let body = json!({"metadata": {"labels": {FLOOR_LABEL: value}}});
    let started = Instant::now();
    type Answered = (String, SystemTime, (Instant, SystemTime));
    let results: Vec<(Option<Answered>, bool)> = futures::stream::iter(objects)
        .map(|(kind, secret)| {
            let (secrets, configmaps, body) = (&secrets, &configmaps, &body);
            async move {
                let params = e2e::patch_params();
                match kind {
                    Kind::Secret => {
                        let sent = SystemTime::now();
                        let result = secrets
                            .patch_metadata(secret, &params, &Patch::Merge(body))
                            .await;
                        let answered = (Instant::now(), SystemTime::now());
                        (Some((secret.clone(), sent, answered)), result.is_err())
                    }
                    Kind::ConfigMap => {
                        let result = configmaps
                            .patch_metadata(
                                &format!("{CONFIG_MAP_PREFIX}{secret}"),
                                &params,
                                &Patch::Merge(body),
                            )
                            .await;
                        (None, result.is_err())
                    }
                }
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let took = started.elapsed();
    let failed = results.iter().filter(|(_, failed)| *failed).count();
    let answered: Vec<Answered> = results
        .into_iter()
        .filter_map(|(secret, failed)| secret.filter(|_| !failed))
        .collect();
    // Every delivery, or 10 s at most.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut delivery_ms = Vec::new();
    if let Some(watch) = &watch {
        for (name, _, (at, _)) in &answered {
            // Seen before the answer was read: 0 (the watch was quicker than the answer).
            if let Some(seen) = watch.wait(name, deadline).await {
                delivery_ms.push(seen.saturating_duration_since(*at).as_secs_f64() * 1e3);
            }
        }
    }
    FloorRun {
        took,
        failed,
        delivery_ms,
        secret_writes: answered
            .into_iter()
            .map(|(name, sent, (_, answered))| (name, sent, answered))
            .collect(),
    }
}

/// A metadata watch of Secrets that records when it first delivered each key (`key` of an
/// object's version; versions without one are skipped). Ends when dropped.
pub(crate) struct FirstSeen {
    seen: Arc<Mutex<HashMap<String, Instant>>>,
    /// Woken whenever a key is first seen.
    arrived: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl FirstSeen {
    /// Opens the watch and waits (up to 30 s) until it listed, so that the writes that follow
    /// come as events, not with its list.
    pub(crate) async fn start(
        api: Api<PartialObjectMeta<Secret>>,
        key: impl Fn(&PartialObjectMeta<Secret>) -> Option<String> + Send + 'static,
    ) -> anyhow::Result<Self> {
        let seen: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let arrived = Arc::new(Notify::new());
        let (listed_tx, listed) = tokio::sync::oneshot::channel();
        let task = tokio::spawn({
            let (seen, arrived) = (Arc::clone(&seen), Arc::clone(&arrived));
            async move {
                let mut listed_tx = Some(listed_tx);
                let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
                while let Some(event) = events.next().await {
                    match event {
                        Ok(watcher::Event::InitDone) => {
                            if let Some(tx) = listed_tx.take() {
                                let _ = tx.send(());
                            }
                        }
                        Ok(watcher::Event::Apply(meta)) => {
                            let at = Instant::now();
                            if let (Some(key), Ok(mut seen)) = (key(&meta), seen.lock()) {
                                seen.entry(key).or_insert(at);
                            }
                            arrived.notify_waiters();
                        }
                        _ => {}
                    }
                }
            }
        });
        let watch = Self {
            seen,
            arrived,
            task,
        };
        match tokio::time::timeout(Duration::from_secs(30), listed).await {
            Ok(Ok(())) => Ok(watch),
            _ => anyhow::bail!("a watch of Secrets did not list within 30 s"),
        }
    }

    /// When the watch first delivered `key`.
    fn get(&self, key: &str) -> Option<Instant> {
        self.seen
            .lock()
            .ok()
            .and_then(|seen| seen.get(key).copied())
    }

    /// When the watch first delivered `key`, waiting for it until `deadline`.
    pub(crate) async fn wait(&self, key: &str, deadline: Instant) -> Option<Instant> {
        loop {
            // Registered before looking, so that a delivery in between still wakes it.
            let arrived = self.arrived.notified();
            let mut arrived = std::pin::pin!(arrived);
            arrived.as_mut().enable();
            if let Some(at) = self.get(key) {
                return Some(at);
            }
            if tokio::time::timeout_at(deadline.into(), arrived)
                .await
                .is_err()
            {
                return self.get(key);
            }
        }
    }
}

impl Drop for FirstSeen {
    fn drop(&mut self) {
        self.task.abort();
    }
}
