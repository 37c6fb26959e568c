//! What a shard reports about its load on its Lease: [`LoadMeter`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::runtime::watcher;
use kube_sharding_api::load::{LoadKey, ShardLoad};
use tokio::time::Instant;

/// The window [`LoadMeter::new`] reports latencies and errors over: 60 s.
pub const DEFAULT_LOAD_WINDOW: Duration = Duration::from_secs(60);

/// Slots of a window: each holds the reconciles of a twelfth of it.
const SLOTS: usize = 12;

/// Latency buckets per slot: bucket `b > 0` holds durations up to 2^(b/4) µs (four per
/// doubling), the last one everything above 2^39.75 µs (about eleven days).
const BUCKETS: usize = 160;

/// Collects a shard's load for the reports on its Lease (docs/protocol.md §23).
///
/// A [`LoadMeter`] collects the controller's signals; the Lease lock writes its
/// [report](LoadMeter::report) into the annotation
/// [`ANNOTATION_LOAD`](kube_sharding_api::load::ANNOTATION_LOAD) with the renewals it sends
/// anyway, so reporting costs no request. Give the meter to the shard with
/// [`Shard::with_load_meter`](crate::Shard::with_load_meter), and:
///
/// - [`Shard::reconciler`](crate::Shard::reconciler) measures every reconcile of your reconciler
///   (duration, and an error when it returns one);
/// - [`LoadMeter::track`] on the watch stream of the main resource counts the shard's objects and
///   which of them changed since their last successful reconcile (the queue depth).
///
/// ```no_run
/// # use std::sync::Arc;
/// # use futures::StreamExt;
/// # use k8s_openapi::api::core::v1::Secret;
/// # use kube::{Api, Client, runtime::{WatchStreamExt, reflector, watcher, controller::{Action, Controller}}};
/// # use kube_sharding::{LeaseLock, LoadMeter, Ownership, OwnershipError, Shard, Term};
/// # async fn reconcile(_: Arc<Secret>, _: Arc<()>, _: Ownership) -> Result<Action, OwnershipError> { Ok(Action::await_change()) }
/// # async fn run(client: Client) -> anyhow::Result<()> {
/// let meter = LoadMeter::new();
/// let shard = Shard::new("my-ring", "my-controller-0", "default").with_load_meter(meter.clone());
/// let lock = LeaseLock::new(client.clone(), shard.lease_config())?; // reports what `meter` holds
/// # let shutdown = tokio_util::sync::CancellationToken::new();
/// shard.run(&lock, &shutdown, |term: Term| {
///     let (reader, writer) = reflector::store();
///     // Tracked before the cache sees it: a reconcile never runs ahead of its object's event.
///     let secrets = meter
///         .track(watcher(Api::<Secret>::all(client.clone()), shard.watcher_config()).default_backoff())
///         .reflect(writer)
///         .applied_objects();
///     Controller::for_stream(secrets, reader)
///         .graceful_shutdown_on(term.stop.cancelled_owned())
///         .run(shard.reconciler(client.clone(), term.guard, reconcile),
///              |_, _, _| Action::await_change(), Arc::new(()))
///         .for_each(|_| async {})
/// }).await?;
/// # Ok(()) }
/// ```
///
/// (`Controller::for_stream` needs kube's `unstable-runtime` feature.) A controller that counts
/// by itself sets [`LoadMeter::set_objects`] and [`LoadMeter::set_queue_depth`] instead, and
/// times reconciles with [`LoadMeter::measure`] or [`LoadMeter::record`].
///
/// Memory is bounded whatever the reconcile rate: latencies go into a fixed number of
/// log-scaled buckets per twelfth of the window (about 7.5 KiB per meter, percentiles to within
/// 19 %), and the queue keeps one entry per object the tracked watch holds, dropped when the
/// object is deleted or leaves the shard.
///
/// Cheap to clone: clones share one meter. Thread-safe; every call takes a short lock.
#[derive(Clone)]
pub struct LoadMeter {
    state: Arc<Mutex<State>>,
}

#[derive(Debug)]
struct Slot {
    /// Which slot of time this is (`elapsed / slot length`); reset when a later one reuses it.
    number: u64,
    counts: [u32; BUCKETS],
    errors: u64,
}

/// One object of the tracked watch.
#[derive(Debug)]
struct Tracked {
    /// `resourceVersion` of the latest event.
    seen: String,
    /// `resourceVersion` of the object as last reconciled successfully.
    reconciled: Option<String>,
    /// Listing the object was last seen in, to drop what a relist no longer shows.
    listing: u64,
}

#[derive(Debug)]
struct State {
    origin: Instant,
    window: Duration,
    slot_length: Duration,
    slots: Box<[Slot]>,
    /// Whether any reconcile was measured: only then latencies and errors are reported.
    measured: bool,
    objects: Option<u64>,
    queue_depth: Option<u64>,
    /// Whether a watch is tracked: only then objects and queue come from it.
    tracking: bool,
    tracked: HashMap<String, Tracked>,
    listing: u64,
}

impl Default for LoadMeter {
    fn default() -> Self {
        Self::new()
    }
}

impl PartialEq for LoadMeter {
    /// Clones of one meter are equal; separate meters are not.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }
}

impl Eq for LoadMeter {}

impl std::fmt::Debug for LoadMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LoadMeter")
            .field(&self.report().to_string())
            .finish()
    }
}

impl LoadMeter {
    /// A meter reporting latencies and errors over [`DEFAULT_LOAD_WINDOW`].
    pub fn new() -> Self {
        Self::with_window(DEFAULT_LOAD_WINDOW)
    }

    /// A meter reporting latencies and errors over `window`, in whole seconds from 12 s to one
    /// hour (clamped).
    pub fn with_window(window: Duration) -> Self {
        let seconds = window.as_secs().clamp(SLOTS as u64, 3600);
        let window = Duration::from_secs(seconds);
        let slots = (0..SLOTS)
            .map(|_| Slot {
                number: u64::MAX,
                counts: [0; BUCKETS],
                errors: 0,
            })
            .collect();
        Self {
            state: Arc::new(Mutex::new(State {
                origin: Instant::now(),
                window,
                slot_length: window / SLOTS as u32,
                slots,
                measured: false,
                objects: None,
                queue_depth: None,
                tracking: false,
                tracked: HashMap::new(),
                listing: 0,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing a panic elsewhere could leave half-done matters for a report.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The window latencies and errors cover.
    pub fn window(&self) -> Duration {
        self.lock().window
    }

    /// Sets the number of objects the shard holds; reported instead of what a tracked watch
    /// counts.
    pub fn set_objects(&self, objects: u64) {
        self.lock().objects = Some(objects);
    }

    /// Sets the number of objects waiting for a reconcile; reported instead of what a tracked
    /// watch counts.
    pub fn set_queue_depth(&self, depth: u64) {
        self.lock().queue_depth = Some(depth);
    }

    /// Records one reconcile that took `duration` and failed unless `succeeded`.
    pub fn record(&self, duration: Duration, succeeded: bool) {
        let mut state = self.lock();
        let slot = state.current_slot(Instant::now());
        slot.counts[bucket(duration)] += 1;
        if !succeeded {
            slot.errors += 1;
        }
        state.measured = true;
    }

    /// Runs the reconcile `reconcile` of the object with metadata `meta`, recording its duration
    /// and whether it returned an error. A success marks the object, at the `resourceVersion`
    /// in `meta`, as reconciled for the queue depth of a tracked watch. A reconcile dropped
    /// before it ends (the Lease lost, say) records nothing.
    pub fn measure<T, E, F>(
        &self,
        meta: &ObjectMeta,
        reconcile: F,
    ) -> impl Future<Output = Result<T, E>> + use<T, E, F>
    where
        F: Future<Output = Result<T, E>>,
    {
        let meter = self.clone();
        let key = object_key(meta);
        let version = meta.resource_version.clone();
        async move {
            let started = Instant::now();
            let result = reconcile.await;
            meter.record(started.elapsed(), result.is_ok());
            if result.is_ok()
                && let (Some(key), Some(version)) = (key, version)
            {
                meter.reconciled(&key, version);
            }
            result
        }
    }

    fn reconciled(&self, key: &str, version: String) {
        // Only objects the tracked watch holds: the map never outgrows it.
        if let Some(tracked) = self.lock().tracked.get_mut(key) {
            tracked.reconciled = Some(version);
        }
    }

    /// Counts the objects of a watch event of the shard's main resource: the objects it holds,
    /// and those whose latest version has not been reconciled successfully yet (the queue).
    /// Deleted objects, and objects a relist no longer shows (they left the shard), are
    /// forgotten. Call it with every event, before the controller's cache sees it; [`track`]
    /// does that for a stream.
    ///
    /// [`track`]: LoadMeter::track
    pub fn observe<K: Resource>(&self, event: &watcher::Event<K>) {
        let mut state = self.lock();
        state.tracking = true;
        match event {
            watcher::Event::Init => state.listing += 1,
            watcher::Event::InitApply(object) | watcher::Event::Apply(object) => {
                state.seen(object.meta());
            }
            watcher::Event::InitDone => {
                let listing = state.listing;
                state.tracked.retain(|_, t| t.listing == listing);
            }
            watcher::Event::Delete(object) => {
                if let Some(key) = object_key(object.meta()) {
                    state.tracked.remove(&key);
                }
            }
        }
    }

    /// The watch stream `events` of the shard's main resource, unchanged, with every event
    /// passed to [`LoadMeter::observe`] on its way. Put it before `reflect`, so the controller's
    /// cache never holds a version the meter has not seen.
    pub fn track<K, E, S>(&self, events: S) -> impl Stream<Item = S::Item> + use<K, E, S>
    where
        K: Resource,
        S: Stream<Item = Result<watcher::Event<K>, E>>,
    {
        let meter = self.clone();
        events.inspect(move |event| {
            if let Ok(event) = event {
                meter.observe(event);
            }
        })
    }

    /// What the Lease would report now: objects and queue when set or tracked, latencies while
    /// the window holds a reconcile, errors and the window once any reconcile was measured.
    pub fn report(&self) -> ShardLoad {
        self.lock().report(Instant::now())
    }
}

impl State {
    fn slot_number(&self, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.origin);
        u64::try_from(elapsed.as_nanos() / self.slot_length.as_nanos()).unwrap_or(u64::MAX - 1)
    }

    fn current_slot(&mut self, now: Instant) -> &mut Slot {
        let number = self.slot_number(now);
        let slot = &mut self.slots[(number % SLOTS as u64) as usize];
        if slot.number != number {
            slot.number = number;
            slot.counts = [0; BUCKETS];
            slot.errors = 0;
        }
        slot
    }

    fn seen(&mut self, meta: &ObjectMeta) {
        let Some(key) = object_key(meta) else {
            return;
        };
        let version = meta.resource_version.clone().unwrap_or_default();
        let listing = self.listing;
        self.tracked
            .entry(key)
            .and_modify(|t| {
                t.seen.clone_from(&version);
                t.listing = listing;
            })
            .or_insert(Tracked {
                seen: version,
                reconciled: None,
                listing,
            });
    }

    fn report(&self, now: Instant) -> ShardLoad {
        let mut load = ShardLoad::default();
        let tracked = self.tracking.then_some(&self.tracked);
        load.set(
            LoadKey::Objects,
            self.objects.or_else(|| tracked.map(|t| t.len() as u64)),
        );
        load.set(
            LoadKey::Queue,
            self.queue_depth.or_else(|| {
                tracked.map(|t| {
                    t.values()
                        .filter(|t| t.reconciled.as_ref() != Some(&t.seen))
                        .count() as u64
                })
            }),
        );
        if !self.measured {
            return load;
        }
        let current = self.slot_number(now);
        let mut counts = [0u64; BUCKETS];
        let mut errors = 0;
        for slot in self
            .slots
            .iter()
            .filter(|s| s.number <= current && current - s.number < SLOTS as u64)
        {
            for (total, count) in counts.iter_mut().zip(slot.counts) {
                *total += u64::from(count);
            }
            errors += slot.errors;
        }
        load.set(LoadKey::P50Millis, percentile_millis(&counts, 50));
        load.set(LoadKey::P99Millis, percentile_millis(&counts, 99));
        load.set(LoadKey::Errors, Some(errors));
        load.set(LoadKey::WindowSeconds, Some(self.window.as_secs()));
        load
    }
}

/// The key an object is tracked by: its UID, else (never from an API server) namespace/name.
fn object_key(meta: &ObjectMeta) -> Option<String> {
    meta.uid.clone().or_else(|| {
        let name = meta.name.as_deref()?;
        Some(format!(
            "{}/{name}",
            meta.namespace.as_deref().unwrap_or_default()
        ))
    })
}

/// The bucket of `duration`: 0 for less than a microsecond, else `floor(4 log2 µs) + 1`.
fn bucket(duration: Duration) -> usize {
    let micros = duration.as_micros();
    if micros == 0 {
        return 0;
    }
    let index = ((micros as f64).log2() * 4.0).floor() as usize + 1;
    index.min(BUCKETS - 1)
}

/// The `percent`th percentile of `counts`, in milliseconds (the upper bound of its bucket,
/// rounded); `None` without any count.
fn percentile_millis(counts: &[u64; BUCKETS], percent: u64) -> Option<u64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    // The smallest value at least `percent` % of the reconciles did not exceed.
    let rank = (total * percent).div_ceil(100).max(1);
    let mut seen = 0;
    let index = counts
        .iter()
        .position(|count| {
            seen += count;
            seen >= rank
        })
        .unwrap_or(BUCKETS - 1);
    if index == 0 {
        return Some(0);
    }
    let upper_micros = 2f64.powf(index as f64 / 4.0);
    Some((upper_micros / 1000.0).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Secret;

    fn secret(uid: &str, version: &str) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some(format!("s-{uid}")),
                namespace: Some("default".into()),
                uid: Some(uid.into()),
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            ..Secret::default()
        }
    }

    async fn reconcile(meter: &LoadMeter, object: &Secret, took: Duration, ok: bool) {
        let _ = meter
            .measure(&object.metadata, async move {
                tokio::time::sleep(took).await;
                if ok { Ok(()) } else { Err(()) }
            })
            .await;
    }

    #[test]
    fn a_new_meter_reports_nothing() {
        assert!(LoadMeter::new().report().is_empty());
    }

    #[test]
    fn buckets_hold_durations_to_within_a_fifth() {
        for millis in [1u64, 3, 12, 80, 250, 1_000, 4_321, 60_000] {
            let mut counts = [0; BUCKETS];
            counts[bucket(Duration::from_millis(millis))] = 1;
            let reported = percentile_millis(&counts, 50).unwrap();
            assert!(
                reported >= millis && reported * 100 <= millis * 120,
                "{millis} ms reported as {reported}"
            );
        }
        assert_eq!(bucket(Duration::ZERO), 0);
        assert_eq!(bucket(Duration::from_secs(u64::MAX)), BUCKETS - 1);
    }

    #[tokio::test(start_paused = true)]
    async fn latencies_and_errors_cover_the_window_only() {
        let meter = LoadMeter::new();
        let object = secret("a", "1");
        // 98 fast, 2 slow of which one failed.
        for _ in 0..98 {
            reconcile(&meter, &object, Duration::from_millis(10), true).await;
        }
        reconcile(&meter, &object, Duration::from_millis(500), true).await;
        reconcile(&meter, &object, Duration::from_millis(500), false).await;
        let load = meter.report();
        // The upper bounds of the buckets of 10 ms (2^13.5 µs) and 500 ms (2^19 µs).
        assert_eq!(load.get(LoadKey::P50Millis), Some(12));
        assert_eq!(load.get(LoadKey::P99Millis), Some(524));
        assert_eq!(load.get(LoadKey::Errors), Some(1));
        assert_eq!(load.get(LoadKey::WindowSeconds), Some(60));
        // Not tracking a watch: no objects, no queue.
        assert_eq!(load.get(LoadKey::Objects), None);

        // A window later the reconciles are out of it: no latency, no error.
        tokio::time::advance(Duration::from_secs(61)).await;
        let load = meter.report();
        assert_eq!(load.get(LoadKey::P99Millis), None);
        assert_eq!(load.get(LoadKey::Errors), Some(0));
        assert_eq!(load.get(LoadKey::WindowSeconds), Some(60));
    }

    #[tokio::test(start_paused = true)]
    async fn memory_stays_bounded_whatever_the_rate() {
        let meter = LoadMeter::with_window(Duration::from_secs(12));
        for i in 0..200_000u64 {
            meter.record(Duration::from_micros(i % 5_000), i % 1000 != 0);
            if i % 10_000 == 0 {
                tokio::time::advance(Duration::from_millis(700)).await;
            }
        }
        let state = meter.lock();
        assert_eq!(state.slots.len(), SLOTS);
        assert!(state.tracked.is_empty());
        drop(state);
        let load = meter.report();
        assert_eq!(load.get(LoadKey::WindowSeconds), Some(12));
        // 5 ms at most, bucketed.
        assert!(load.get(LoadKey::P99Millis).unwrap() <= 6);
    }

    #[tokio::test(start_paused = true)]
    async fn the_queue_holds_objects_changed_since_their_last_successful_reconcile() {
        let meter = LoadMeter::new();
        let d = Duration::from_millis(1);
        meter.observe(&watcher::Event::<Secret>::Init);
        meter.observe(&watcher::Event::InitApply(secret("a", "1")));
        meter.observe(&watcher::Event::InitApply(secret("b", "2")));
        meter.observe(&watcher::Event::<Secret>::InitDone);
        let queue = |m: &LoadMeter| {
            (
                m.report().get(LoadKey::Objects),
                m.report().get(LoadKey::Queue),
            )
        };
        assert_eq!(queue(&meter), (Some(2), Some(2)));

        reconcile(&meter, &secret("a", "1"), d, true).await;
        assert_eq!(queue(&meter), (Some(2), Some(1)));
        // A failed reconcile leaves it waiting.
        reconcile(&meter, &secret("b", "2"), d, false).await;
        assert_eq!(queue(&meter), (Some(2), Some(1)));
        reconcile(&meter, &secret("b", "2"), d, true).await;
        assert_eq!(queue(&meter), (Some(2), Some(0)));

        // A change waits again; a reconcile of the older version does not clear it.
        meter.observe(&watcher::Event::Apply(secret("a", "3")));
        assert_eq!(queue(&meter), (Some(2), Some(1)));
        reconcile(&meter, &secret("a", "1"), d, true).await;
        assert_eq!(queue(&meter), (Some(2), Some(1)));
        reconcile(&meter, &secret("a", "3"), d, true).await;
        assert_eq!(queue(&meter), (Some(2), Some(0)));

        // Deleted (or moved away: the label selector's watch says deleted): forgotten.
        meter.observe(&watcher::Event::Apply(secret("c", "4")));
        meter.observe(&watcher::Event::Delete(secret("a", "5")));
        assert_eq!(queue(&meter), (Some(2), Some(1)));
        // A reconcile of an object the watch does not hold adds nothing.
        reconcile(&meter, &secret("z", "9"), d, true).await;
        assert_eq!(meter.lock().tracked.len(), 2);

        // A relist drops what it no longer shows.
        meter.observe(&watcher::Event::<Secret>::Init);
        meter.observe(&watcher::Event::InitApply(secret("c", "4")));
        meter.observe(&watcher::Event::<Secret>::InitDone);
        assert_eq!(queue(&meter), (Some(1), Some(1)));

        // Set values win over tracked ones.
        meter.set_objects(40);
        meter.set_queue_depth(7);
        assert_eq!(queue(&meter), (Some(40), Some(7)));
    }

    #[tokio::test]
    async fn track_passes_events_through_and_observes_them() {
        let meter = LoadMeter::new();
        let events = futures::stream::iter([
            Ok(watcher::Event::Apply(secret("a", "1"))),
            Err(()),
            Ok(watcher::Event::Apply(secret("b", "1"))),
        ]);
        let passed: Vec<_> = meter.track(events).collect().await;
        assert_eq!(passed.len(), 3);
        assert_eq!(meter.report().get(LoadKey::Objects), Some(2));
    }

    #[test]
    fn clones_share_a_meter() {
        let meter = LoadMeter::new();
        let clone = meter.clone();
        clone.set_objects(3);
        assert_eq!(meter.report().get(LoadKey::Objects), Some(3));
        assert_eq!(meter, clone);
        assert_ne!(meter, LoadMeter::new());
    }
}
