//! The caches' watch tasks: each applies its events to a cache, hands them to an observer and
//! reads in batches (see [`CACHE_READ_PAUSE`]).

use std::fmt::Debug;

use futures::{StreamExt, TryStreamExt};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::records;

/// Starts a task in `tasks` that keeps a cache of the objects `api` and `config` select until
/// shutdown, handing every event to `observe` after the cache applied it (`observe` answers whether
/// the event changed something others act on, see `CACHE_READ_PAUSE`); returns the cache.
pub(super) fn spawn_reflector<K>(
    tasks: &mut JoinSet<()>,
    runner: &Runner,
    api: Api<K>,
    config: watcher::Config,
    observe: impl FnMut(&watcher::Event<K>) -> bool + Send + 'static,
    shutdown: &CancellationToken,
) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    let (store, writer) = reflector::store();
    let watched = Watched {
        api,
        config,
        prepare: Box::new(|event| super::slim::for_each_object(event, super::slim::slim_object)),
    };
    spawn_reflector_into(tasks, runner, writer, watched, observe, shutdown);
    store
}

/// The objects a cache holds, and what it keeps of each.
pub(super) struct Watched<K: Resource> {
    /// Where the objects are.
    pub(super) api: Api<K>,
    /// Which of them: label and field selectors.
    pub(super) config: watcher::Config,
    /// Prepares each event before the cache applies it: strips its object to what the cache
    /// keeps (see `slim`), and for Leases notes when the sharder saw them renewed (see
    /// `renewals`).
    pub(super) prepare: Prepare<K>,
}

/// What prepares a cache's events before it applies them (see [`Watched::prepare`]).
pub(super) type Prepare<K> = Box<dyn FnMut(&mut watcher::Event<K>) + Send>;

/// Like [`spawn_reflector`], filling the cache behind `writer` with the objects `watched` selects.
pub(super) fn spawn_reflector_into<K>(
    tasks: &mut JoinSet<()>,
    runner: &Runner,
    writer: reflector::store::Writer<K>,
    watched: Watched<K>,
    mut observe: impl FnMut(&watcher::Event<K>) -> bool + Send + 'static,
    shutdown: &CancellationToken,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    let shutdown = shutdown.clone();
    let task = async move {
        // Before the cache copies an object: what nothing reads is never held.
        let mut prepare = watched.prepare;
        let events = watcher(watched.api, watched.config).map_ok(move |mut event| {
            prepare(&mut event);
            event
        });
        let stream = reflector::reflector(writer, events).default_backoff();
        futures::pin_mut!(stream);
        // What an item asks for: stop (the stream ended), read on at once (something changed
        // that others act on, or the watch failed), or nothing.
        let mut handle = |item: Option<Result<watcher::Event<K>, watcher::Error>>| match item {
            None => None,
            Some(Ok(event)) => Some(observe(&event)),
            Some(Err(error)) => {
                tracing::warn!(event = records::EVENT_CACHE_WATCH_FAILED, %error, "watch failed, retrying with backoff");
                Some(true)
            }
        };
        loop {
            let item = tokio::select! {
                () = shutdown.cancelled() => return,
                item = stream.next() => item,
            };
            let Some(mut changed) = handle(item) else {
                return;
            };
            // Everything that arrived with it. The connection task hands over one event each time
            // it runs, so a read that is not ready at once is given a moment before the batch
            // counts as done.
            while !shutdown.is_cancelled()
                && let Ok(item) = tokio::time::timeout(CACHE_BATCH_GAP, stream.next()).await
            {
                let Some(item_changed) = handle(item) else {
                    return;
                };
                changed |= item_changed;
            }
            // A batch that changed something may be the start of more (Leases created one after
            // the other, then their ring): read on at once, so that no view is built from half
            // of them. A batch of renewals only is followed by a pause (see `CACHE_READ_PAUSE`).
            if changed {
                continue;
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(CACHE_READ_PAUSE) => {}
            }
        }
    };
    tasks.spawn_on(task, &runner.runtime);
}

/// How long a cache's task waits after applying a batch of events that changed nothing others act
/// on (Lease renewals) before it reads again. With 1,000 shards 500 renewals a second arrive one
/// by one; read as they come, each costs a wake-up, a poll of the socket and a read of it, more
/// than applying the event. Read every 100 ms they come in batches of about 50. The first event
/// after a pause is read at once, and a batch that changed membership, a ring or a namespace is
/// followed by no pause, so a change arriving during a pause is seen at most 100 ms later and
/// changes in a row are seen as they come.
const CACHE_READ_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// How long a batch of cache events waits for its next event before it counts as done.
const CACHE_BATCH_GAP: std::time::Duration = std::time::Duration::from_millis(1);

/// Where the caches' watches run: their own client, on the caches' thread.
pub(super) struct Runner {
    /// The caches' client.
    pub(super) client: kube::Client,
    /// The caches' thread.
    pub(super) runtime: tokio::runtime::Handle,
}
