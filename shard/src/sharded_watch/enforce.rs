//! The layer as the shard library runs it on a zero-write ring ([`ShardedWatch::enforcing`]):
//! it filters on the client whatever the server did, ends open watches when the selection
//! changes so that the watcher lists again with the new one, answers "no ranges" itself, and
//! keeps the set of objects it delivered, for departures.
//!
//! The restart works with any kube-rs watcher, `Controller::new` included: an open watch of an
//! older selection ends with an `ERROR` event of code 410 (what the API server sends when a
//! watch's resource version is too old), on which kube's watcher lists again. A watch that
//! resumes from a resource version the layer did not deliver under the current selection gets
//! the same answer, so a list of one selection is never continued by a watch of another.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use http_body::Frame;
use kube_sharding_api::ranges::ShardField;
use tokio::sync::broadcast;
use tracing::warn;

use super::*;
use crate::departure::{Departure, ObjectKey};
use crate::records::{EVENT_SELECTOR_APPLIED, EVENT_SELECTOR_IGNORED};

/// How many delivered resource versions the layer remembers: a resuming watch names the last
/// one its watcher saw, which is among the most recent ones.
const REMEMBERED_VERSIONS: usize = 1024;

/// The watch event that makes kube's watcher list again.
const GONE_EVENT: &[u8] = br#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"the shard's ranges changed: list again","reason":"Expired","code":410}}
"#;

/// The answer to a list continued under another selection than its first page's.
const GONE_STATUS: &[u8] = br#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"the shard's ranges changed during a paged list: list again","reason":"Expired","code":410}"#;

/// The list the layer answers while the shard has no ranges.
const EMPTY_LIST: &[u8] =
    br#"{"kind":"List","apiVersion":"v1","metadata":{"resourceVersion":"0"},"items":[]}"#;

/// The selection one request was sent with.
#[derive(Clone, Debug)]
pub(crate) struct Snapshot {
    pub(crate) generation: u64,
    selector: Option<ShardSelector>,
    nothing: bool,
}

impl Snapshot {
    pub(super) fn of(selected: &Selected) -> Self {
        Self {
            generation: selected.generation,
            selector: selected.current.as_ref().map(|(s, _)| s.clone()),
            nothing: selected.nothing,
        }
    }

    /// Whether the object with key `key` is selected.
    pub(crate) fn accepts(&self, key: &ObjectKey) -> bool {
        if self.nothing {
            return false;
        }
        let Some(selector) = &self.selector else {
            return true;
        };
        match selector.field() {
            ShardField::Uid => key
                .uid
                .as_deref()
                .is_some_and(|u| selector.matches_value(u)),
            ShardField::Namespace => {
                selector.matches_value(key.namespace.as_deref().unwrap_or_default())
            }
        }
    }
}

/// What the enforcing layer keeps besides the plain layer's state.
#[derive(Debug)]
pub(crate) struct Enforce {
    /// The selection's generation, for open watch bodies to notice a change.
    generation: watch::Sender<u64>,
    /// Resource versions delivered, with the generation they were delivered under.
    versions: Mutex<VecDeque<(String, u64)>>,
    held: Mutex<Held>,
    departures: broadcast::Sender<Departure>,
    ignored_lists: AtomicU64,
    warned: AtomicBool,
    applied_logged: AtomicBool,
}

/// The objects the layer delivered under the current selection, by uid (or name without one).
#[derive(Debug, Default)]
struct Held {
    generation: u64,
    objects: BTreeMap<String, ObjectKey>,
    /// Filled page by page while a list runs.
    listing: Option<BTreeMap<String, ObjectKey>>,
}

fn held_id(key: &ObjectKey) -> String {
    key.uid.clone().unwrap_or_else(|| key.to_string())
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The objects of `held` that `selection` no longer selects.
pub(crate) fn revoked<'a>(
    held: impl IntoIterator<Item = &'a ObjectKey>,
    selection: &Snapshot,
) -> Vec<ObjectKey> {
    held.into_iter()
        .filter(|key| !selection.accepts(key))
        .cloned()
        .collect()
}

impl Enforce {
    fn new() -> Self {
        Self {
            generation: watch::Sender::new(0),
            versions: Mutex::new(VecDeque::new()),
            held: Mutex::new(Held::default()),
            departures: broadcast::Sender::new(4096),
            ignored_lists: AtomicU64::new(0),
            warned: AtomicBool::new(false),
            applied_logged: AtomicBool::new(false),
        }
    }

    fn remember(&self, resource_version: Option<&str>, generation: u64) {
        let Some(version) = resource_version.filter(|v| !v.is_empty()) else {
            return;
        };
        let mut versions = lock(&self.versions);
        if versions.len() == REMEMBERED_VERSIONS {
            versions.pop_front();
        }
        versions.push_back((version.to_string(), generation));
    }

    fn delivered(&self, resource_version: &str, generation: u64) -> bool {
        lock(&self.versions)
            .iter()
            .rev()
            .any(|(v, g)| *g == generation && v == resource_version)
    }

    fn deleted(&self, key: ObjectKey) {
        // Nobody listening is fine: departures are for those who asked.
        let _ = self.departures.send(Departure::Deleted { object: key });
    }
}

impl ShardedWatch {
    /// The handle the shard library uses on a zero-write ring (see
    /// [`Shard::server_side`](crate::Shard::server_side)): besides adding the selector, its layer
    ///
    /// - filters every list item and watch event on the client with the same hash, whether the
    ///   server applied the selector or not (BOOKMARK and ERROR events always pass), and counts
    ///   and logs (once, `event = "shard_selector_ignored"`) list responses without
    ///   `shardInfo` ([`ShardedWatch::ignored_lists`]);
    /// - ends every open watch of the resource when the selection changes, with an `ERROR`
    ///   event of code 410, on which kube's watcher lists again with the new selection, and
    ///   answers a watch resuming from a resource version it did not deliver under the current
    ///   selection the same way;
    /// - answers lists and watches itself while no object is selected
    ///   ([`ShardedWatch::select_nothing`], the state it starts in): an empty list, and a watch
    ///   that stays silent until the selection changes;
    /// - keeps the set of objects it delivered, so that a change of the selection can say which
    ///   of them were revoked.
    #[must_use]
    pub fn enforcing(resource: &ApiResource) -> Self {
        let handle = Self::build(resource, Some(Enforce::new()));
        handle.select_nothing();
        handle
    }

    /// [`ShardedWatch::enforcing`] for the statically typed resource `K`.
    #[must_use]
    pub fn enforcing_for_resource<K: Resource<DynamicType = ()>>() -> Self {
        Self::enforcing(&ApiResource::erase::<K>(&()))
    }

    /// Selects no object at all: an enforcing handle's layer answers the resource's lists and
    /// watches itself (the plain layer sends them without selector, as for `None`).
    pub fn select_nothing(&self) {
        let mut selected = self
            .inner
            .selector
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        selected.current = None;
        selected.nothing = true;
        selected.generation += 1;
        self.inner.filtering.send_replace(ServerFiltering::Unknown);
        self.changed(selected.generation);
    }

    /// Whether the object with metadata `meta` is selected now; no object is, after
    /// [`ShardedWatch::select_nothing`].
    #[must_use]
    pub fn selects(&self, meta: &ObjectMeta) -> bool {
        Snapshot::of(&self.selected()).accepts(&ObjectKey::of(meta))
    }

    /// How many list responses of the resource came without `shardInfo` although they were
    /// sent with a selector (an enforcing handle's count; 0 for the plain layer): the server
    /// ignored the selector and the client filtered.
    #[must_use]
    pub fn ignored_lists(&self) -> u64 {
        self.inner
            .enforce
            .as_ref()
            .map_or(0, |e| e.ignored_lists.load(Ordering::Relaxed))
    }

    /// Sets the selection (`None`: nothing) and returns the objects delivered before that the
    /// new selection no longer selects; they are forgotten. Open watches end (see
    /// [`ShardedWatch::enforcing`]).
    pub(crate) fn revoke_to(&self, selector: Option<ShardSelector>) -> Vec<ObjectKey> {
        let Some(enforce) = &self.inner.enforce else {
            self.set_selector(selector);
            return Vec::new();
        };
        // Held first: a delivery checks the generation under this lock, so none of the old
        // selection lands after the pruning.
        let mut held = lock(&enforce.held);
        match selector {
            Some(selector) => self.set_selector(Some(selector)),
            None => self.select_nothing(),
        }
        let snapshot = Snapshot::of(&self.selected());
        held.generation = snapshot.generation;
        held.listing = None;
        let gone = revoked(held.objects.values(), &snapshot);
        for key in &gone {
            held.objects.remove(&held_id(key));
        }
        gone
    }

    /// A receiver of the departures the layer itself sees: objects deleted while delivered
    /// (a watch's DELETED event, or missing from a new list while still selected).
    pub(crate) fn subscribe_departures(&self) -> Option<broadcast::Receiver<Departure>> {
        self.inner
            .enforce
            .as_ref()
            .map(|e| e.departures.subscribe())
    }

    /// Whether the object with key `key` is selected now.
    pub(crate) fn selects_key(&self, key: &ObjectKey) -> bool {
        Snapshot::of(&self.selected()).accepts(key)
    }

    /// Whether `self` and `other` are the same handle.
    pub(crate) fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Sends `departure` to the subscribers of [`ShardedWatch::subscribe_departures`].
    pub(crate) fn announce(&self, departure: Departure) {
        if let Some(enforce) = &self.inner.enforce {
            let _ = enforce.departures.send(departure);
        }
    }

    /// Tells open watch bodies that the selection's generation is now `generation`.
    pub(super) fn changed(&self, generation: u64) {
        if let Some(enforce) = &self.inner.enforce {
            enforce.generation.send_replace(generation);
        }
    }

    fn enforce(&self) -> &Enforce {
        self.inner
            .enforce
            .as_ref()
            .expect("only called for an enforcing handle")
    }

    /// Filters a list response's body sent with `snapshot`, records what it says and returns
    /// the body to hand on.
    fn enforce_list(&self, snapshot: &Snapshot, continued: bool, body: Bytes) -> Bytes {
        #[derive(serde::Deserialize)]
        struct List {
            metadata: ListMeta,
            #[serde(default)]
            items: Vec<Item>,
        }
        #[derive(serde::Deserialize)]
        struct ListMeta {
            #[serde(rename = "resourceVersion")]
            resource_version: Option<String>,
            #[serde(rename = "continue")]
            continue_token: Option<String>,
            #[serde(rename = "shardInfo")]
            shard_info: Option<serde::de::IgnoredAny>,
        }
        #[derive(serde::Deserialize)]
        struct Item {
            metadata: ObjectMeta,
        }
        let enforce = self.enforce();
        let Ok(list) = serde_json::from_slice::<List>(&body) else {
            return body;
        };
        if snapshot.selector.is_some() {
            self.observe_list(snapshot.generation, &body);
            if list.metadata.shard_info.is_some()
                && !enforce.applied_logged.swap(true, Ordering::Relaxed)
            {
                tracing::info!(
                    event = EVENT_SELECTOR_APPLIED,
                    resource = %self.inner.plural,
                    "the API server applies the shard selector"
                );
            }
            if list.metadata.shard_info.is_none() {
                enforce.ignored_lists.fetch_add(1, Ordering::Relaxed);
                if !enforce.warned.swap(true, Ordering::Relaxed) {
                    warn!(
                        event = EVENT_SELECTOR_IGNORED,
                        resource = %self.inner.plural,
                        "the API server ignored the shard selector (feature gate ShardedListAndWatch off, or a release before 1.36): filtering on the client, every object still crosses the network"
                    );
                }
            }
        }
        let keys: Vec<ObjectKey> = list
            .items
            .iter()
            .map(|item| ObjectKey::of(&item.metadata))
            .collect();
        let keep: Vec<bool> = keys.iter().map(|k| snapshot.accepts(k)).collect();
        let body = if keep.iter().all(|k| *k) {
            body
        } else {
            filter_items(body, &keep)
        };
        enforce.remember(
            list.metadata.resource_version.as_deref(),
            snapshot.generation,
        );
        enforce.remember(list.metadata.continue_token.as_deref(), snapshot.generation);
        let mut held = lock(&enforce.held);
        if held.generation != snapshot.generation {
            return body;
        }
        let mut listing = if continued {
            held.listing.take().unwrap_or_default()
        } else {
            BTreeMap::new()
        };
        for (key, keep) in keys.into_iter().zip(keep) {
            if keep {
                listing.insert(held_id(&key), key);
            }
        }
        if list
            .metadata
            .continue_token
            .as_deref()
            .is_some_and(|c| !c.is_empty())
        {
            held.listing = Some(listing);
            return body;
        }
        let before = std::mem::replace(&mut held.objects, listing);
        for (id, key) in before {
            // Selected but not listed: deleted while nobody watched. (Revoked objects were
            // forgotten when their ranges went.)
            if !held.objects.contains_key(&id) && snapshot.accepts(&key) {
                enforce.deleted(key);
            }
        }
        body
    }

    /// Whether one watch event line, delivered under `snapshot`, passes; records it.
    fn enforce_event(&self, snapshot: &Snapshot, line: &[u8]) -> bool {
        #[derive(serde::Deserialize)]
        struct Event {
            #[serde(rename = "type")]
            kind: String,
            object: Option<Object>,
        }
        #[derive(serde::Deserialize)]
        struct Object {
            #[serde(default)]
            metadata: ObjectMeta,
        }
        let Ok(event) = serde_json::from_slice::<Event>(line) else {
            return true;
        };
        let enforce = self.enforce();
        let meta = event.object.map(|o| o.metadata).unwrap_or_default();
        enforce.remember(meta.resource_version.as_deref(), snapshot.generation);
        let deleted = match event.kind.as_str() {
            "ADDED" | "MODIFIED" => false,
            "DELETED" => true,
            // BOOKMARK and ERROR (and anything new) always pass.
            _ => return true,
        };
        let key = ObjectKey::of(&meta);
        if !snapshot.accepts(&key) {
            return false;
        }
        let mut held = lock(&enforce.held);
        if held.generation == snapshot.generation {
            if deleted {
                if held.objects.remove(&held_id(&key)).is_some() {
                    enforce.deleted(key);
                }
            } else {
                held.objects.insert(held_id(&key), key);
            }
        }
        true
    }
}

/// The list body with only the items whose `keep` is true.
fn filter_items(body: Bytes, keep: &[bool]) -> Bytes {
    let Ok(mut list) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return body;
    };
    if let Some(items) = list.get_mut("items").and_then(|i| i.as_array_mut()) {
        let mut index = 0;
        items.retain(|_| {
            let kept = keep.get(index).copied().unwrap_or(true);
            index += 1;
            kept
        });
    }
    serde_json::to_vec(&list).map_or(body, Bytes::from)
}

/// The value of query parameter `name` in `query`, if present.
fn query_value<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (key == name).then_some(value)
    })
}

/// `value` with its `%XX` escapes decoded (a query value as kube's typed API encodes it).
fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The body of a watch response of the enforcing layer: the server's events filtered and
/// recorded, ending with a 410 event once the selection changed; without a server response
/// (no ranges) it stays silent until then.
pub struct WatchBody<B> {
    inner: Option<Pin<Box<B>>>,
    handle: ShardedWatch,
    snapshot: Snapshot,
    changed: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// The start of a line whose end has not arrived yet.
    partial: Vec<u8>,
    done: bool,
}

impl<B> std::fmt::Debug for WatchBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchBody")
            .field("generation", &self.snapshot.generation)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl<B> WatchBody<B> {
    fn new(inner: Option<B>, handle: ShardedWatch, snapshot: Snapshot) -> Self {
        let mut generations = handle.enforce().generation.subscribe();
        let generation = snapshot.generation;
        let changed = Box::pin(async move {
            // The sender lives as long as the handle this body holds.
            let _ = generations.wait_for(|now| *now != generation).await;
        });
        Self {
            inner: inner.map(Box::pin),
            handle,
            snapshot,
            changed,
            partial: Vec::new(),
            done: false,
        }
    }

    /// The complete lines of `data` (with what came before) that pass.
    fn process(&mut self, data: &[u8]) -> Vec<u8> {
        self.partial.extend_from_slice(data);
        let Some(last) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return Vec::new();
        };
        let rest = self.partial.split_off(last + 1);
        let complete = std::mem::replace(&mut self.partial, rest);
        let mut out = Vec::with_capacity(complete.len());
        for line in complete.split_inclusive(|b| *b == b'\n') {
            if self.handle.enforce_event(&self.snapshot, line) {
                out.extend_from_slice(line);
            }
        }
        out
    }
}

impl<B> http_body::Body for WatchBody<B>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            if this.changed.as_mut().poll(cx).is_ready() {
                this.done = true;
                this.inner = None;
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(GONE_EVENT)))));
            }
            let Some(inner) = this.inner.as_mut() else {
                return Poll::Pending;
            };
            match inner.as_mut().poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    this.done = true;
                    if this.partial.is_empty() {
                        return Poll::Ready(None);
                    }
                    let rest = std::mem::take(&mut this.partial);
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(rest)))));
                }
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error.into()))),
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        let out = this.process(&data);
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                        }
                    }
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
            }
        }
    }
}

type Body<B> = Either<B, Either<Full<Bytes>, WatchBody<B>>>;

impl<S> ShardSelectorService<S> {
    /// `call` of an enforcing handle's layer.
    pub(super) fn call_enforcing<ReqB, B>(
        &mut self,
        mut request: Request<ReqB>,
    ) -> BoxFuture<Result<Response<Body<B>>, BoxError>>
    where
        S: Service<Request<ReqB>, Response = Response<B>>,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let handle = self.handle.clone();
        let query = request.uri().query().unwrap_or("").to_string();
        let Some((verb, snapshot)) = handle.rewrite(&mut request) else {
            let response = self.inner.call(request);
            return Box::pin(
                async move { Ok(response.await.map_err(Into::into)?.map(Either::Left)) },
            );
        };
        let synthetic = |body: Body<B>| -> BoxFuture<Result<Response<Body<B>>, BoxError>> {
            let response = Response::builder()
                .status(http::StatusCode::OK)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(body)
                .map_err(BoxError::from);
            Box::pin(std::future::ready(response))
        };
        match verb {
            Verb::Watch => {
                let version = query_value(&query, "resourceVersion").unwrap_or_default();
                // A streaming list (`sendInitialEvents`) starts from the whole current state:
                // nothing of an earlier selection to continue.
                let streaming = query_value(&query, "sendInitialEvents") == Some("true");
                if !streaming && !handle.enforce().delivered(version, snapshot.generation) {
                    return synthetic(Either::Right(Either::Left(Full::new(Bytes::from_static(
                        GONE_EVENT,
                    )))));
                }
                if snapshot.nothing {
                    let body = WatchBody::new(None, handle, snapshot);
                    return synthetic(Either::Right(Either::Right(body)));
                }
                let response = self.inner.call(request);
                Box::pin(async move {
                    let response = response.await.map_err(Into::into)?;
                    if !response.status().is_success() {
                        return Ok(response.map(Either::Left));
                    }
                    Ok(response.map(|body| {
                        Either::Right(Either::Right(WatchBody::new(Some(body), handle, snapshot)))
                    }))
                })
            }
            Verb::List => {
                let token = query_value(&query, "continue").filter(|c| !c.is_empty());
                let continued = token.is_some();
                // A page of a list begun under another selection: the whole list again.
                if let Some(token) = token
                    && !handle
                        .enforce()
                        .delivered(&percent_decode(token), snapshot.generation)
                {
                    let response = Response::builder()
                        .status(http::StatusCode::GONE)
                        .header(http::header::CONTENT_TYPE, "application/json")
                        .body(Either::Right(Either::Left(Full::new(Bytes::from_static(
                            GONE_STATUS,
                        )))))
                        .map_err(BoxError::from);
                    return Box::pin(std::future::ready(response));
                }
                if snapshot.nothing {
                    let body =
                        handle.enforce_list(&snapshot, continued, Bytes::from_static(EMPTY_LIST));
                    return synthetic(Either::Right(Either::Left(Full::new(body))));
                }
                let response = self.inner.call(request);
                Box::pin(async move {
                    let response = response.await.map_err(Into::into)?;
                    if !response.status().is_success() {
                        return Ok(response.map(Either::Left));
                    }
                    let (mut parts, body) = response.into_parts();
                    let bytes = body.collect().await.map_err(Into::into)?.to_bytes();
                    let bytes = handle.enforce_list(&snapshot, continued, bytes);
                    // The filter may have shortened the body.
                    parts.headers.remove(http::header::CONTENT_LENGTH);
                    Ok(Response::from_parts(
                        parts,
                        Either::Right(Either::Left(Full::new(bytes))),
                    ))
                })
            }
        }
    }
}

#[cfg(test)]
mod tests;
