//! The shard's side of server-side sharded list and watch (zero-write rings, docs/zero-write-rings.md): a
//! `shardSelector` on the list and watch requests of one resource, whether the server applied
//! it, and the same selection on the client for a server that did not.
//!
//! kube-rs has no `shardSelector` in its list and watch parameters, so a tower layer adds it
//! below the typed API: [`ShardedWatch::client`] (or [`ShardedWatch::wrap`], or
//! [`ShardedWatch::layer`] in a client stack of your own) gives a [`Client`] whose `GET`s of the
//! resource's collection (`.../secrets` or `.../namespaces/NS/secrets`: lists and watches, never
//! a get of one object, nor any other resource or verb) carry
//! `shardSelector=<the URL-encoded selector>`. Everything else, and every request while no
//! selector is set, passes unchanged. The selector is read per request from the shared
//! [`ShardedWatch`] handle, so a new one ([`ShardedWatch::set_selector`]) takes effect with the
//! next list or watch (a watch open at that moment keeps the selector it started with; the
//! handle the shard library uses on a zero-write ring, [`ShardedWatch::enforcing`], ends such
//! watches so that they list again with the new selector, and filters on the client).
//!
//! A server that applied the selector says so in every list response
//! (`metadata.shardInfo.selector`); one that ignores it (the `ShardedListAndWatch` gate off,
//! or a release before 1.36) answers with every object and no `shardInfo`. Watch events carry
//! no such field, so the answer comes from lists only: the layer reads the metadata of each
//! successful list response of the resource and publishes [`ServerFiltering`]
//! ([`ShardedWatch::server_filtering`], [`ShardedWatch::subscribe`]). When it is
//! [`ServerFiltering::Ignored`], the caller filters with [`ShardedWatch::accepts`], which
//! hashes the object's uid or namespace exactly as the server would. A watcher that takes its
//! initial state from a streaming list (`watcher::Config::streaming_lists`) sends no list, so the
//! answer stays [`ServerFiltering::Unknown`] there. A list answered after the selector changed
//! says nothing about the new one.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Either, Full};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::core::{ApiResource, Resource};
use kube_sharding_api::ranges::{QUERY_PARAMETER, ShardSelector};
use tokio::sync::watch;
use tower::{BoxError, Layer, Service};

/// Whether the server applied the shard selector, as the last list response said.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ServerFiltering {
    /// No list response since the selector was set (or none is set).
    #[default]
    Unknown,
    /// The last list response carried `metadata.shardInfo`: the server sends only the selected
    /// objects, in lists and in watches.
    Applied,
    /// The last list response had no `metadata.shardInfo`: the server ignored the selector and
    /// sends every object; filter them with [`ShardedWatch::accepts`].
    Ignored,
}

/// The shared handle: which resource's lists and watches carry which selector, and what the
/// server made of it. Clones share the same state.
#[derive(Clone, Debug)]
pub struct ShardedWatch {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// `/api/v1` or `/apis/GROUP/VERSION`.
    prefix: String,
    /// The resource's plural name, the collection's last path segment.
    plural: String,
    selector: RwLock<Selected>,
    filtering: watch::Sender<ServerFiltering>,
    /// The shard library's mode ([`ShardedWatch::enforcing`]); `None` for the plain layer.
    enforce: Option<enforce::Enforce>,
}

/// The selector set now.
#[derive(Debug, Default)]
struct Selected {
    /// The selector and its URL-encoded form, encoded once per change rather than per request.
    current: Option<(ShardSelector, String)>,
    /// No object at all ([`ShardedWatch::select_nothing`]): answered by the layer itself.
    nothing: bool,
    /// Counts the changes, so that a list sent with an earlier selector says nothing about this
    /// one.
    generation: u64,
}

/// Whether a request is a list or a watch of the resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verb {
    List,
    Watch,
}

impl ShardedWatch {
    /// The handle for the resource `resource` (its group, version and plural name), with no
    /// selector yet.
    #[must_use]
    pub fn new(resource: &ApiResource) -> Self {
        Self::build(resource, None)
    }

    fn build(resource: &ApiResource, enforce: Option<enforce::Enforce>) -> Self {
        let prefix = if resource.group.is_empty() {
            format!("/api/{}", resource.version)
        } else {
            format!("/apis/{}/{}", resource.group, resource.version)
        };
        Self {
            inner: Arc::new(Inner {
                prefix,
                plural: resource.plural.clone(),
                selector: RwLock::new(Selected::default()),
                filtering: watch::Sender::new(ServerFiltering::Unknown),
                enforce,
            }),
        }
    }

    /// The handle for the statically typed resource `K`.
    #[must_use]
    pub fn for_resource<K: Resource<DynamicType = ()>>() -> Self {
        Self::new(&ApiResource::erase::<K>(&()))
    }

    /// Sets the selector the next lists and watches carry (`None`: none, every object), and
    /// forgets what the server said about the previous one ([`ServerFiltering::Unknown`]).
    pub fn set_selector(&self, selector: Option<ShardSelector>) {
        let encoded = selector.map(|s| {
            let text = encode_query_value(&s.to_string());
            (s, text)
        });
        let mut selected = self
            .inner
            .selector
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        selected.current = encoded;
        selected.nothing = false;
        selected.generation += 1;
        self.changed(selected.generation);
        // Under the lock: a list answered for the previous selector cannot overwrite this.
        self.inner.filtering.send_replace(ServerFiltering::Unknown);
    }

    /// The selector set now.
    #[must_use]
    pub fn selector(&self) -> Option<ShardSelector> {
        self.read_selector().map(|(s, _)| s)
    }

    /// What the last list response said about the selector.
    #[must_use]
    pub fn server_filtering(&self) -> ServerFiltering {
        *self.inner.filtering.borrow()
    }

    /// A receiver that sees every change of [`ShardedWatch::server_filtering`].
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<ServerFiltering> {
        self.inner.filtering.subscribe()
    }

    /// The client-side filter: whether the object with metadata `meta` is selected (by its uid
    /// or its namespace, hashed as the server does). Every object is, while no selector is set.
    #[must_use]
    pub fn accepts(&self, meta: &ObjectMeta) -> bool {
        self.read_selector().is_none_or(|(s, _)| s.matches(meta))
    }

    /// [`ShardedWatch::accepts`] for the selector's field value alone: an object's uid, or its
    /// namespace (empty for a cluster-scoped object), by the selector's field.
    #[must_use]
    pub fn accepts_value(&self, value: &str) -> bool {
        self.read_selector()
            .is_none_or(|(s, _)| s.matches_value(value))
    }

    /// The tower layer that adds the selector to the resource's lists and watches and reads
    /// the list responses, for a client stack of your own
    /// (`kube::client::ClientBuilder::with_layer`). It matches request paths as kube's typed
    /// API writes them (`/api/v1/...`), so it belongs outside the layer that prepends the
    /// cluster's URL, as `with_layer` puts it.
    #[must_use]
    pub fn layer(&self) -> ShardSelectorLayer {
        ShardSelectorLayer {
            handle: self.clone(),
        }
    }

    /// A client for `config`, with kube's usual stack below the layer.
    ///
    /// # Errors
    ///
    /// When kube cannot build a client for `config` (TLS or authentication settings).
    pub fn client(&self, config: kube::Config) -> Result<Client, kube::Error> {
        Ok(kube::client::ClientBuilder::try_from(config)?
            .with_layer(&self.layer())
            .build())
    }

    /// `client` with the layer in front: the same connection and credentials, and the
    /// selector on the resource's lists and watches.
    #[must_use]
    pub fn wrap(&self, client: Client) -> Client {
        let namespace = client.default_namespace().to_string();
        Client::new(self.layer().layer(ClientService(client)), namespace)
    }

    fn read_selector(&self) -> Option<(ShardSelector, String)> {
        self.selected().current.clone()
    }

    fn selected(&self) -> std::sync::RwLockReadGuard<'_, Selected> {
        self.inner
            .selector
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds the selector to `request` when it lists or watches the resource; says which, and
    /// the selection it was sent with (in "nothing" mode the request is left as it is: the
    /// layer answers it).
    fn rewrite<B>(&self, request: &mut Request<B>) -> Option<(Verb, Snapshot)> {
        if request.method() != http::Method::GET {
            return None;
        }
        let uri = request.uri();
        let rest = uri.path().strip_prefix(self.inner.prefix.as_str())?;
        let segments: Vec<&str> = rest.strip_prefix('/')?.split('/').collect();
        let collection = match segments.as_slice() {
            [plural] | ["namespaces", _, plural] => *plural == self.inner.plural,
            _ => false,
        };
        if !collection {
            return None;
        }
        let query = uri.query().unwrap_or("");
        let mut verb = Verb::List;
        for pair in query.split('&') {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if key == "watch" && (value == "true" || value == "1") {
                verb = Verb::Watch;
            }
            if key == QUERY_PARAMETER {
                // The caller chose a selector of its own.
                return None;
            }
        }
        let selected = self.selected();
        if selected.nothing {
            return Some((verb, Snapshot::of(&selected)));
        }
        let (_, encoded) = selected.current.as_ref()?;
        let query = if query.is_empty() {
            format!("{QUERY_PARAMETER}={encoded}")
        } else {
            format!("{query}&{QUERY_PARAMETER}={encoded}")
        };
        let path_and_query = format!("{}?{query}", uri.path());
        let mut parts = uri.clone().into_parts();
        parts.path_and_query = Some(path_and_query.parse().ok()?);
        *request.uri_mut() = http::Uri::from_parts(parts).ok()?;
        Some((verb, Snapshot::of(&selected)))
    }

    /// Records what a successful list response's body, sent with the selector of `generation`,
    /// says about the selector (nothing, once another selector was set).
    fn observe_list(&self, generation: u64, body: &[u8]) {
        #[derive(serde::Deserialize)]
        struct List {
            metadata: ListMeta,
        }
        #[derive(serde::Deserialize)]
        struct ListMeta {
            #[serde(rename = "shardInfo")]
            shard_info: Option<serde::de::IgnoredAny>,
        }
        // Not JSON (a Table, protobuf) or not a list: it says nothing about the selector.
        if let Ok(list) = serde_json::from_slice::<List>(body) {
            let now = if list.metadata.shard_info.is_some() {
                ServerFiltering::Applied
            } else {
                ServerFiltering::Ignored
            };
            let selected = self.selected();
            if selected.generation != generation {
                return;
            }
            self.inner.filtering.send_if_modified(|state| {
                let changed = *state != now;
                *state = now;
                changed
            });
        }
    }
}

/// `value` percent-encoded for a query string: every byte but the unreserved characters
/// (`A-Z a-z 0-9 - . _ ~`, RFC 3986) as `%XX`, as kube-apiserver decodes it.
fn encode_query_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len() * 3 / 2);
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The tower layer of a [`ShardedWatch`] ([`ShardedWatch::layer`]).
#[derive(Clone, Debug)]
pub struct ShardSelectorLayer {
    handle: ShardedWatch,
}

impl<S> Layer<S> for ShardSelectorLayer {
    type Service = ShardSelectorService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ShardSelectorService {
            inner,
            handle: self.handle.clone(),
        }
    }
}

/// The service [`ShardSelectorLayer`] puts in front of another.
#[derive(Clone, Debug)]
pub struct ShardSelectorService<S> {
    inner: S,
    handle: ShardedWatch,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqB, B> Service<Request<ReqB>> for ShardSelectorService<S>
where
    S: Service<Request<ReqB>, Response = Response<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Either<B, Either<Full<Bytes>, enforce::WatchBody<B>>>>;
    type Error = BoxError;
    type Future = BoxFuture<Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: Request<ReqB>) -> Self::Future {
        if self.handle.inner.enforce.is_some() {
            return self.call_enforcing(request);
        }
        let rewritten = self.handle.rewrite(&mut request);
        let response = self.inner.call(request);
        let handle = self.handle.clone();
        Box::pin(async move {
            let response = response.await.map_err(Into::into)?;
            let generation = match rewritten {
                Some((Verb::List, snapshot)) if response.status().is_success() => {
                    snapshot.generation
                }
                _ => return Ok(response.map(Either::Left)),
            };
            // kube reads a list response whole anyway; reading it here first costs a second
            // pass over the bytes, not a second copy.
            let (parts, body) = response.into_parts();
            let bytes = body.collect().await.map_err(Into::into)?.to_bytes();
            handle.observe_list(generation, &bytes);
            Ok(Response::from_parts(
                parts,
                Either::Right(Either::Left(Full::new(bytes))),
            ))
        })
    }
}

/// An existing [`Client`] as a tower service, so the layer can sit in front of it.
#[derive(Clone)]
struct ClientService(Client);

impl Service<Request<kube::client::Body>> for ClientService {
    type Response = Response<kube::client::Body>;
    type Error = kube::Error;
    type Future = BoxFuture<Result<Self::Response, kube::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), kube::Error>> {
        // `Client::send` waits for its own buffer.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<kube::client::Body>) -> Self::Future {
        let client = self.0.clone();
        Box::pin(async move { client.send(request).await })
    }
}

mod enforce;
use enforce::Snapshot;
pub use enforce::WatchBody;

/// The selection of `selector` (`None`: nothing), for tests of the pure parts.
#[cfg(test)]
pub(crate) fn enforce_snapshot(selector: Option<ShardSelector>) -> Snapshot {
    let mut selected = Selected::default();
    match selector {
        Some(selector) => {
            let encoded = encode_query_value(&selector.to_string());
            selected.current = Some((selector, encoded));
        }
        None => selected.nothing = true,
    }
    Snapshot::of(&selected)
}

/// Which of `held` `selection` no longer selects (see [`ShardedWatch::revoke_to`]).
#[cfg(test)]
pub(crate) fn revoked_of(
    held: &[crate::departure::ObjectKey],
    selection: &Snapshot,
) -> Vec<crate::departure::ObjectKey> {
    enforce::revoked(held, selection)
}

#[cfg(test)]
mod tests;
