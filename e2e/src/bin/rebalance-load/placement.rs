//! Following where every Secret and ConfigMap is placed, through metadata-only watches, until
//! they converge to a target ring.

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::bail;
use e2e::fixtures::expected_shard;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use sharder::core::ring::Ring;
use sharding_crds::labels;
use tokio::task::JoinHandle;

use crate::report::{Transitions, secs};
use crate::{CONFIG_MAP_PREFIX, PROGRESS_EVERY, SECRET_PREFIX, progress};

/// Which kind of object a watch follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Secret,
    ConfigMap,
}

/// The labels of one object that matter here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Placement {
    pub(crate) shard: Option<String>,
    pub(crate) draining: bool,
}

/// The ring the objects should converge to, and what was seen since it was set.
#[derive(Debug)]
pub(crate) struct Target {
    pub(crate) ring: Ring,
    pub(crate) count: usize,
    pub(crate) set_at: Instant,
    /// Objects (by kind and Secret name) that are misplaced or draining.
    pub(crate) bad: HashSet<(Kind, String)>,
    /// Since when every object has been in place, if it is.
    pub(crate) good_since: Option<Instant>,
    pub(crate) transitions: Transitions,
}

/// Placements of every Secret and ConfigMap, keyed by the Secret's name.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) namespace: String,
    pub(crate) shard_key: String,
    pub(crate) drain_key: String,
    pub(crate) secrets: HashMap<String, Placement>,
    pub(crate) configmaps: HashMap<String, Placement>,
    pub(crate) synced: HashSet<Kind>,
    pub(crate) target: Option<Target>,
}

impl State {
    pub(crate) fn objects(&self, kind: Kind) -> &HashMap<String, Placement> {
        match kind {
            Kind::Secret => &self.secrets,
            Kind::ConfigMap => &self.configmaps,
        }
    }

    pub(crate) fn objects_mut(&mut self, kind: Kind) -> &mut HashMap<String, Placement> {
        match kind {
            Kind::Secret => &mut self.secrets,
            Kind::ConfigMap => &mut self.configmaps,
        }
    }

    pub(crate) fn misplaced(
        ring: &Ring,
        namespace: &str,
        secret: &str,
        placement: &Placement,
    ) -> bool {
        placement.draining || placement.shard.as_deref() != expected_shard(ring, namespace, secret)
    }

    /// Sets the ring to converge to and rebuilds the set of misplaced objects.
    pub(crate) fn set_target(&mut self, ring: Ring, count: usize) {
        let mut bad = HashSet::new();
        for kind in [Kind::Secret, Kind::ConfigMap] {
            for (name, placement) in self.objects(kind) {
                if Self::misplaced(&ring, &self.namespace, name, placement) {
                    bad.insert((kind, name.clone()));
                }
            }
        }
        self.target = Some(Target {
            ring,
            count,
            set_at: Instant::now(),
            bad,
            good_since: None,
            transitions: Transitions::default(),
        });
        self.update_good();
    }

    pub(crate) fn replace_all(&mut self, kind: Kind, objects: HashMap<String, Placement>) {
        *self.objects_mut(kind) = objects;
        self.synced.insert(kind);
        if let Some(target) = self.target.take() {
            let (transitions, set_at) = (target.transitions, target.set_at);
            self.set_target(target.ring, target.count);
            if let Some(t) = self.target.as_mut() {
                t.transitions = transitions;
                t.set_at = set_at;
            }
        }
    }

    pub(crate) fn update(&mut self, kind: Kind, name: String, placement: Option<Placement>) {
        let previous = match &placement {
            Some(p) => self.objects_mut(kind).insert(name.clone(), p.clone()),
            None => self.objects_mut(kind).remove(&name),
        };
        if let Some(target) = self.target.as_mut() {
            if let (Some(old), Some(new)) = (&previous, &placement) {
                let since = secs(target.set_at.elapsed());
                let t = &mut target.transitions;
                if !old.draining && new.draining {
                    t.drains_seen += 1;
                    t.first_drain_seconds.get_or_insert(since);
                    t.last_drain_seconds = Some(since);
                }
                if old.shard != new.shard && new.shard.is_some() {
                    match kind {
                        Kind::Secret => t.secret_relabels += 1,
                        Kind::ConfigMap => {
                            t.configmap_relabels += 1;
                            t.first_configmap_relabel_seconds.get_or_insert(since);
                            t.last_configmap_relabel_seconds = Some(since);
                        }
                    }
                    if new.shard.as_deref() != expected_shard(&target.ring, &self.namespace, &name)
                    {
                        target.transitions.wrong_relabels += 1;
                    }
                }
            }
            match &placement {
                Some(p) if Self::misplaced(&target.ring, &self.namespace, &name, p) => {
                    target.bad.insert((kind, name));
                }
                _ => {
                    target.bad.remove(&(kind, name));
                }
            }
        }
        self.update_good();
    }

    pub(crate) fn is_good(&self) -> bool {
        self.target.as_ref().is_some_and(|t| {
            t.bad.is_empty()
                && self.synced.len() == 2
                && self.secrets.len() == t.count
                && self.configmaps.len() == t.count
        })
    }

    pub(crate) fn update_good(&mut self) {
        let good = self.is_good();
        if let Some(target) = self.target.as_mut() {
            if !good {
                target.good_since = None;
            } else if target.good_since.is_none() {
                target.good_since = Some(Instant::now());
            }
        }
    }

    pub(crate) fn summary(&self) -> String {
        let (bad, count) = self
            .target
            .as_ref()
            .map_or((0, 0), |t| (t.bad.len(), t.count));
        format!(
            "Secrets {}/{count}, ConfigMaps {}/{count}, {bad} misplaced or draining",
            self.secrets.len(),
            self.configmaps.len()
        )
    }
}

/// Follows the placement of every Secret and ConfigMap of a namespace through metadata-only
/// watches.
pub(crate) struct Tracker {
    pub(crate) state: Arc<Mutex<State>>,
    pub(crate) tasks: Vec<JoinHandle<()>>,
}

impl Drop for Tracker {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Tracker {
    pub(crate) fn start(client: &Client, namespace: &str, ring: &str) -> Self {
        let state = Arc::new(Mutex::new(State {
            namespace: namespace.to_string(),
            shard_key: labels::shard_label(ring),
            drain_key: labels::drain_label(ring),
            secrets: HashMap::new(),
            configmaps: HashMap::new(),
            synced: HashSet::new(),
            target: None,
        }));
        let tasks = vec![
            tokio::spawn(follow(
                Api::<PartialObjectMeta<Secret>>::namespaced(client.clone(), namespace),
                Kind::Secret,
                state.clone(),
            )),
            tokio::spawn(follow(
                Api::<PartialObjectMeta<ConfigMap>>::namespaced(client.clone(), namespace),
                Kind::ConfigMap,
                state.clone(),
            )),
        ];
        Self { state, tasks }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Shard labels of every Secret and ConfigMap, keyed by kind and Secret name.
    pub(crate) fn snapshot(&self) -> HashMap<(Kind, String), Option<String>> {
        let state = self.lock();
        [Kind::Secret, Kind::ConfigMap]
            .into_iter()
            .flat_map(|kind| {
                state
                    .objects(kind)
                    .iter()
                    .map(move |(name, p)| ((kind, name.clone()), p.shard.clone()))
            })
            .collect()
    }

    pub(crate) fn set_target(&self, shards: &[&str], count: usize) {
        self.lock().set_target(Ring::new(shards), count);
    }

    pub(crate) fn transitions(&self) -> Transitions {
        self.lock()
            .target
            .as_ref()
            .map(|t| t.transitions)
            .unwrap_or_default()
    }

    /// Waits until the target has held for `settle`; returns when it started to hold.
    pub(crate) async fn wait_settled(
        &self,
        what: &str,
        settle: Duration,
        timeout: Duration,
        started: Instant,
    ) -> anyhow::Result<Instant> {
        let deadline = Instant::now() + timeout;
        let mut next_progress = Instant::now() + PROGRESS_EVERY;
        loop {
            {
                let state = self.lock();
                let since = state.target.as_ref().and_then(|t| t.good_since);
                if let Some(since) = since.filter(|s| s.elapsed() >= settle) {
                    return Ok(since);
                }
                if Instant::now() >= deadline {
                    bail!(
                        "timed out after {timeout:?} waiting for {what}: {}",
                        state.summary()
                    );
                }
                if Instant::now() >= next_progress {
                    progress(started, &format!("waiting for {what}: {}", state.summary()));
                    next_progress += PROGRESS_EVERY;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Runs a metadata-only watch of one kind and feeds its events into `state`.
pub(crate) async fn follow<K>(api: Api<PartialObjectMeta<K>>, kind: Kind, state: Arc<Mutex<State>>)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let (shard_key, drain_key) = {
        let s = state.lock().unwrap_or_else(PoisonError::into_inner);
        (s.shard_key.clone(), s.drain_key.clone())
    };
    let entry = |obj: &PartialObjectMeta<K>| -> Option<(String, Placement)> {
        let name = obj.name_any();
        let secret = match kind {
            Kind::Secret => name.starts_with(SECRET_PREFIX).then_some(name)?,
            Kind::ConfigMap => name.strip_prefix(CONFIG_MAP_PREFIX)?.to_string(),
        };
        let labels = obj.labels();
        Some((
            secret,
            Placement {
                shard: labels.get(&shard_key).cloned(),
                draining: labels.contains_key(&drain_key),
            },
        ))
    };
    let mut buffer: HashMap<String, Placement> = HashMap::new();
    let mut events =
        std::pin::pin!(watcher::watcher(api, watcher::Config::default()).default_backoff());
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                eprintln!("watch of {kind:?} failed, retrying: {error}");
                continue;
            }
        };
        let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
        match event {
            watcher::Event::Init => buffer.clear(),
            watcher::Event::InitApply(obj) => {
                if let Some((name, placement)) = entry(&obj) {
                    buffer.insert(name, placement);
                }
            }
            watcher::Event::InitDone => state.replace_all(kind, std::mem::take(&mut buffer)),
            watcher::Event::Apply(obj) => {
                if let Some((name, placement)) = entry(&obj) {
                    state.update(kind, name, Some(placement));
                }
            }
            watcher::Event::Delete(obj) => {
                if let Some((name, _)) = entry(&obj) {
                    state.update(kind, name, None);
                }
            }
        }
    }
}
