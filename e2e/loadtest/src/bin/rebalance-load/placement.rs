//! Following where every Secret and ConfigMap is placed, through metadata-only watches, until
//! they converge to a target ring.

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use anyhow::bail;
use e2e::IndependentRing;
use e2e::fixtures::expected_shard;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use kube_sharding_api::labels;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;

use crate::timeline::Sample;
use crate::timeline::secs;
use crate::{CONFIG_MAP_PREFIX, PROGRESS_EVERY, SECRET_PREFIX, progress};

/// Which kind of object a watch follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
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
    pub(crate) ring: IndependentRing,
    pub(crate) count: usize,
    pub(crate) set_at: Instant,
    /// Objects (by kind and Secret name) that are misplaced or draining.
    pub(crate) bad: HashSet<(Kind, String)>,
    /// Since when every object has been in place, if it is.
    pub(crate) good_since: Option<Instant>,
    /// Secrets in `bad`.
    pub(crate) bad_secrets: usize,
    /// Since when every Secret has been in place, if they are (ConfigMaps aside).
    pub(crate) secrets_good_since: Option<Instant>,
    pub(crate) transitions: Transitions,
    /// Label changes seen per object since the target was set.
    pub(crate) changes: HashMap<(Kind, String), Changes>,
}

/// Label changes of one object, as the watch saw them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Changes {
    /// Times the drain label appeared (Secrets).
    pub(crate) drains: u32,
    /// Times the shard label changed to another shard.
    pub(crate) relabels: u32,
    /// Wall-clock time the watch last saw the shard label change, comparable with the shards'
    /// log timestamps (same machine).
    pub(crate) relabelled_at: Option<SystemTime>,
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
    /// Times a watch listed again after its first list (events in between are not seen, so the
    /// per-object changes are complete only while this is 0).
    pub(crate) relists: u64,
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
        ring: &IndependentRing,
        namespace: &str,
        secret: &str,
        placement: &Placement,
    ) -> bool {
        placement.draining || placement.shard.as_deref() != expected_shard(ring, namespace, secret)
    }

    /// Sets the ring to converge to and rebuilds the set of misplaced objects.
    pub(crate) fn set_target(&mut self, ring: IndependentRing, count: usize) {
        let mut bad = HashSet::new();
        for kind in [Kind::Secret, Kind::ConfigMap] {
            for (name, placement) in self.objects(kind) {
                if Self::misplaced(&ring, &self.namespace, name, placement) {
                    bad.insert((kind, name.clone()));
                }
            }
        }
        let bad_secrets = bad.iter().filter(|(kind, _)| *kind == Kind::Secret).count();
        self.target = Some(Target {
            ring,
            count,
            set_at: Instant::now(),
            bad,
            good_since: None,
            bad_secrets,
            secrets_good_since: None,
            transitions: Transitions::default(),
            changes: HashMap::new(),
        });
        self.update_good();
    }

    pub(crate) fn replace_all(&mut self, kind: Kind, objects: HashMap<String, Placement>) {
        *self.objects_mut(kind) = objects;
        self.synced.insert(kind);
        if let Some(target) = self.target.take() {
            let (transitions, set_at, changes) =
                (target.transitions, target.set_at, target.changes);
            self.set_target(target.ring, target.count);
            if let Some(t) = self.target.as_mut() {
                t.transitions = transitions;
                t.set_at = set_at;
                t.changes = changes;
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
                let key = (kind, name.clone());
                if !old.draining && new.draining {
                    target.changes.entry(key.clone()).or_default().drains += 1;
                    t.drains_seen += 1;
                    t.first_drain_seconds.get_or_insert(since);
                    t.last_drain_seconds = Some(since);
                }
                if old.shard != new.shard && new.shard.is_some() {
                    let changes = target.changes.entry(key).or_default();
                    changes.relabels += 1;
                    changes.relabelled_at = Some(SystemTime::now());
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
            let is_secret = kind == Kind::Secret;
            match &placement {
                Some(p) if Self::misplaced(&target.ring, &self.namespace, &name, p) => {
                    if target.bad.insert((kind, name)) && is_secret {
                        target.bad_secrets += 1;
                    }
                }
                _ => {
                    if target.bad.remove(&(kind, name)) && is_secret {
                        target.bad_secrets -= 1;
                    }
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
        let secrets_good = self.target.as_ref().is_some_and(|t| {
            t.bad_secrets == 0
                && self.synced.contains(&Kind::Secret)
                && self.secrets.len() == t.count
        });
        if let Some(target) = self.target.as_mut() {
            if !secrets_good {
                target.secrets_good_since = None;
            } else if target.secrets_good_since.is_none() {
                target.secrets_good_since = Some(Instant::now());
            }
            if !good {
                target.good_since = None;
            } else if target.good_since.is_none() {
                target.good_since = Some(Instant::now());
            }
        }
    }

    /// Secrets and ConfigMaps per shard of `shards` (in that order), and the draining Secrets.
    pub(crate) fn counts(&self, shards: &[&str]) -> (Vec<usize>, Vec<usize>, usize) {
        let per_shard = |kind: Kind| {
            let mut counts = vec![0; shards.len()];
            for placement in self.objects(kind).values() {
                if let Some(i) = placement
                    .shard
                    .as_deref()
                    .and_then(|s| shards.iter().position(|x| *x == s))
                {
                    counts[i] += 1;
                }
            }
            counts
        };
        let draining = self.secrets.values().filter(|p| p.draining).count();
        (
            per_shard(Kind::Secret),
            per_shard(Kind::ConfigMap),
            draining,
        )
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
            relists: 0,
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
        self.lock()
            .set_target(IndependentRing::unweighted(shards), count);
    }

    /// Label changes per object since the target was set, and the watches' relists.
    pub(crate) fn changes(&self) -> (HashMap<(Kind, String), Changes>, u64) {
        let state = self.lock();
        let changes = state
            .target
            .as_ref()
            .map(|t| t.changes.clone())
            .unwrap_or_default();
        (changes, state.relists)
    }

    /// Samples the objects per shard of `shards` every `every`, measuring time from `start`,
    /// until the returned sampler is finished.
    pub(crate) fn sample(&self, shards: &[&str], start: Instant, every: Duration) -> Sampler {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (state, shards_owned) = (
            self.state.clone(),
            shards.iter().map(|s| (*s).to_string()).collect::<Vec<_>>(),
        );
        let out = samples.clone();
        let task = tokio::spawn(async move {
            let shards: Vec<&str> = shards_owned.iter().map(String::as_str).collect();
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let (secrets, configmaps, draining) = state
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .counts(&shards);
                out.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(Sample {
                        secs: secs(start.elapsed()),
                        secrets,
                        configmaps,
                        draining,
                    });
            }
        });
        Sampler { samples, task }
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

/// Counts of objects per shard taken at an interval, until [`Sampler::finish`] (or drop).
pub(crate) struct Sampler {
    samples: Arc<Mutex<Vec<Sample>>>,
    task: JoinHandle<()>,
}

impl Sampler {
    /// Stops sampling and returns the samples.
    pub(crate) fn finish(self) -> Vec<Sample> {
        self.task.abort();
        std::mem::take(&mut *self.samples.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.task.abort();
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
            watcher::Event::Init => {
                buffer.clear();
                if state.synced.contains(&kind) {
                    state.relists += 1;
                }
            }
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

/// Label changes the watches saw after the 4th shard started.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub(crate) struct Transitions {
    /// Secrets that gained the drain label.
    pub(crate) drains_seen: u64,
    /// Shard-label changes of Secrets.
    pub(crate) secret_relabels: u64,
    /// Shard-label changes of ConfigMaps.
    pub(crate) configmap_relabels: u64,
    /// Shard-label changes to a shard other than the 4-shard ring's (e.g. a shard re-applying a
    /// ConfigMap the sharder had just moved away from it).
    pub(crate) wrong_relabels: u64,
    /// Seconds after the target was set until the first drain label was seen.
    pub(crate) first_drain_seconds: Option<f64>,
    /// Seconds after the target was set until the first ConfigMap changed its shard label.
    pub(crate) first_configmap_relabel_seconds: Option<f64>,
    /// Seconds after the target was set until the last drain label was seen (about when the
    /// sharder's drain pass ended).
    pub(crate) last_drain_seconds: Option<f64>,
    /// Seconds after the target was set until the last ConfigMap changed its shard label.
    pub(crate) last_configmap_relabel_seconds: Option<f64>,
}
