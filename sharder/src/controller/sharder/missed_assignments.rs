//! The missed-assignment path of the sharder controller (docs/protocol.md §9, "fast path").
//!
//! The webhook uses `failurePolicy: Ignore`, so objects created while no sharder is reachable stay
//! unassigned. A metadata-only watch per ring resource on objects *without* the shard label moves
//! them within seconds, so the webhook assigns them; the periodic sync stays the safety net. The
//! watch caches nothing, so memory does not grow with the number of objects. For a ring without
//! a webhook (`assignment: Watch`, docs/protocol.md §20) this is how every new object is
//! labelled: the patch writes the shard itself.
//!
//! The watch of a namespaced resource covers only the namespaces its ring selects: one watch per
//! selected namespace when the ring selects few of them, one across the cluster otherwise (the
//! rule is [`list_scope`]'s, the sync's too). Objects the webhook never assigns, those of every
//! namespace the ring does not select, would otherwise reach the sharder one event each, for
//! nothing. The set of watches follows the namespaces: created, deleted, or relabelled (the
//! caches' change hub says when), and the ring's selector.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use std::time::Duration;

use futures::StreamExt;
use futures::stream::{BoxStream, SelectAll};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, ObjectMeta};
use kube::core::{ApiResource, PartialObjectMeta};
use kube::runtime::utils::Backoff;
use kube::runtime::{WatchStreamExt, watcher};
use kube_sharding_api::{GroupResource, RingRef};
use tokio::sync::{Semaphore, watch};
use tokio::task::{AbortHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use super::patch::{PatchError, Patcher, api_resource};
use crate::core::list_scope::{ListScope, watch_scope};
use crate::core::rebalance::RebalanceDecision;
use crate::records;
use crate::views::RingView;

/// Concurrent patches per watched resource of a ring with a webhook, where this path only
/// catches what the webhook missed. A ring without one (`assignment: Watch`) labels every new
/// object here, and its bound is the process-wide `maxPatchesInFlight` instead: at 16, a
/// patch that takes 100 ms on a busy API server caps assignments at 160 per second and new
/// objects queue behind each other.
const CONCURRENCY: usize = 16;
/// First delay before a failed move, or the watch after an error, is tried again.
const RETRY_INITIAL: Duration = Duration::from_millis(500);
/// Longest delay between two tries: short enough that an object missed during a webhook outage
/// is assigned within a few seconds of its end, and that the watch is back within a few seconds
/// of an API server restart.
const RETRY_MAX: Duration = Duration::from_secs(4);
/// How often an object whose move is held back (the ring's webhook unreachable) asks again; one
/// of them becomes the probe when it is due.
const HELD_WAIT: Duration = Duration::from_millis(500);

/// Which watch task: ring, resource, the version watched and whether the sharder assigns
/// directly (see [`MissedAssignments`]). A ring that switches its assignment mode gets a new
/// watch, whose listing picks up every object left unassigned across the switch.
type WatchKey = (RingRef, GroupResource, String, bool);

/// The running watches, one per ring resource. They are tasks of a `JoinSet` this value owns, so
/// dropping it (the sharder controller stopped, or dropped on lost leadership) stops them all.
#[derive(Debug, Default)]
pub(super) struct MissedAssignments {
    tasks: JoinSet<()>,
    /// By ring, resource and the version watched: a new version means a new watch.
    running: HashMap<WatchKey, Running>,
}

/// One ring resource's watch task, and where it learns that its ring's namespace selector
/// changed.
#[derive(Debug)]
struct Running {
    task: AbortHandle,
    selector: watch::Sender<LabelSelector>,
}

impl MissedAssignments {
    /// Starts a watch for every resource of every ring, stops those no longer needed, and hands
    /// a changed namespace selector to the watches of its ring.
    pub(super) fn reconcile(&mut self, patcher: &Patcher, views: &[Arc<RingView>]) {
        // A watch ends on its own only when its ring or resource went away; reap it.
        while self.tasks.try_join_next().is_some() {}
        let wanted: HashMap<WatchKey, &LabelSelector> = views
            .iter()
            .flat_map(|v| {
                v.resources.iter().map(|(gr, r)| {
                    (
                        (
                            v.ring_ref(),
                            gr.clone(),
                            r.info.version.clone(),
                            v.assigns_directly(),
                        ),
                        &v.namespace_selector,
                    )
                })
            })
            .collect();
        self.running.retain(|key, running| {
            let keep = wanted.contains_key(key) && !running.task.is_finished();
            if !keep {
                running.task.abort();
            }
            keep
        });
        for (key, selector) in wanted {
            if let Some(running) = self.running.get(&key) {
                // Wakes the watch only when the selector differs.
                running.selector.send_if_modified(|current| {
                    let changed = current != selector;
                    if changed {
                        current.clone_from(selector);
                    }
                    changed
                });
                continue;
            }
            let (selector, receiver) = watch::channel(selector.clone());
            let concurrency = if key.3 {
                usize::try_from(patcher.ctx.config.controller.sharder.max_patches_in_flight)
                    .unwrap_or(CONCURRENCY)
                    .max(1)
            } else {
                CONCURRENCY
            };
            let task = self.tasks.spawn(watch_unassigned(
                patcher.clone(),
                key.0.clone(),
                key.1.clone(),
                receiver,
                concurrency,
            ));
            self.running.insert(key, Running { task, selector });
        }
    }

    /// Stops every watch.
    pub(super) fn stop(&mut self) {
        self.running.clear();
        self.tasks.abort_all();
    }
}

/// Where one watch of a ring resource looks: across the cluster, or in one namespace.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
enum Reach {
    Cluster,
    Namespace(String),
}

impl fmt::Display for Reach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cluster => f.write_str("the whole cluster"),
            Self::Namespace(ns) => write!(f, "namespace {ns}"),
        }
    }
}

/// The watches a resource needs: one across the cluster for a cluster-scoped resource, and for
/// a namespaced one whose ring selects the namespaces `selected` of `all` as [`list_scope`]
/// says: one per selected namespace (none when it selects none), or one across the cluster.
fn reaches(
    namespaced: bool,
    current: Option<ListScope>,
    selected: Vec<String>,
    all: usize,
) -> BTreeSet<Reach> {
    if !namespaced {
        return BTreeSet::from([Reach::Cluster]);
    }
    match watch_scope(current, selected.len(), all) {
        ListScope::Cluster => BTreeSet::from([Reach::Cluster]),
        ListScope::Namespaces => selected.into_iter().map(Reach::Namespace).collect(),
    }
}

/// What a watch of unassigned objects yields, told apart by where it looks.
type Item = (
    Reach,
    Result<watcher::Event<PartialObjectMeta<DynamicObject>>, watcher::Error>,
);

/// The watches of unassigned objects of one ring resource, merged into one stream. A watch no
/// longer wanted is stopped by its token: its stream ends, and with it its connection.
struct Watches {
    client: kube::Client,
    resource: ApiResource,
    /// `!<shard label>`: objects without the ring's shard label.
    labels: String,
    running: HashMap<Reach, CancellationToken>,
    events: SelectAll<BoxStream<'static, Item>>,
}

impl Watches {
    fn new(client: kube::Client, resource: ApiResource, labels: String) -> Self {
        Self {
            client,
            resource,
            labels,
            running: HashMap::new(),
            events: SelectAll::new(),
        }
    }

    /// Starts the watches in `wanted` not running yet and stops those not in it. A watch started
    /// lists first, so objects of a namespace that just became selected are seen at once.
    fn set(&mut self, wanted: &BTreeSet<Reach>) {
        self.running.retain(|reach, stop| {
            let keep = wanted.contains(reach);
            if !keep {
                stop.cancel();
            }
            keep
        });
        for reach in wanted {
            if self.running.contains_key(reach) {
                continue;
            }
            // `PartialObjectMeta` makes the watch metadata-only.
            let api: Api<PartialObjectMeta<DynamicObject>> = match reach {
                Reach::Cluster => Api::all_with(self.client.clone(), &self.resource),
                Reach::Namespace(ns) => {
                    Api::namespaced_with(self.client.clone(), ns, &self.resource)
                }
            };
            let config = watcher::Config::default().labels(&self.labels);
            let stop = CancellationToken::new();
            let tag = reach.clone();
            let events = watcher::watcher(api, config)
                .backoff(RetryBackoff::default())
                .take_until(stop.clone().cancelled_owned())
                .map(move |event| (tag.clone(), event));
            self.events.push(events.boxed());
            self.running.insert(reach.clone(), stop);
        }
    }

    /// The scope of the watches running: `None` while none runs.
    fn scope(&self) -> Option<ListScope> {
        if self.running.contains_key(&Reach::Cluster) {
            Some(ListScope::Cluster)
        } else if self.running.is_empty() {
            None
        } else {
            Some(ListScope::Namespaces)
        }
    }

    /// How many watches run.
    fn len(&self) -> usize {
        self.running.len()
    }
}

/// Watches objects of one ring resource that lack the shard label and moves them, so the webhook
/// assigns them.
///
/// The watch survives errors (the watcher re-lists with [`RetryBackoff`], after an API server
/// restart too), and a move that does not end with the object assigned (the webhook unreachable, a
/// conflict) is retried with backoff until the object is assigned or gone: objects missed during a
/// webhook outage are assigned within seconds of its end, not at the next periodic sync. Objects of
/// the initial listing count as well: after a re-list they are exactly those missed meanwhile, and
/// in a namespace the ring just came to select, those created before.
///
/// `selector` is the ring's namespace selector as of its current view; the watches of a
/// namespaced resource follow it and the namespace cache (see [`reaches`]). At most `concurrency`
/// objects are patched at once.
async fn watch_unassigned(
    patcher: Patcher,
    ring: RingRef,
    gr: GroupResource,
    mut selector: watch::Receiver<LabelSelector>,
    concurrency: usize,
) {
    let ctx = &patcher.ctx;
    // What the watch needs of the view; the view itself is not kept (its hash ring may be big,
    // and a newer view replaces it).
    let (ar, namespaced, labels) = {
        let Some(view) = ctx.views.get(&ring) else {
            return;
        };
        let Some(resource) = view.resources.get(&gr) else {
            return;
        };
        (
            api_resource(&gr, &resource.info),
            resource.info.namespaced,
            format!("!{}", view.shard_label),
        )
    };
    // Subscribed before the first scope is computed, so that no change goes unseen.
    let mut namespace_changes = ctx.caches.changes.namespaces();
    let mut watches = Watches::new(ctx.client.clone(), ar.clone(), labels);
    let rescope = |watches: &mut Watches, selector: &LabelSelector| {
        let (selected, all) = if namespaced {
            ctx.caches.selected_namespaces(selector)
        } else {
            (Vec::new(), 0)
        };
        let before = watches.len();
        let current = watches.scope();
        watches.set(&reaches(namespaced, current, selected, all));
        tracing::debug!(%ring, resource = %gr, before, after = watches.len(), namespaces = all, "missed-assignment watches follow the selected namespaces");
    };
    rescope(&mut watches, &selector.borrow_and_update());
    let backlog = ctx
        .metrics
        .missed_assignment_backlog
        .get_or_create(&crate::metrics::Metrics::resource_labels(
            &ring,
            &gr.group,
            &gr.resource,
        ))
        .clone();
    let limit = Arc::new(Semaphore::new(concurrency));
    // One task per object being assigned, owned here: they stop with the watch.
    let mut assigning: JoinSet<ObjectKey> = JoinSet::new();
    let mut pending: HashSet<ObjectKey> = HashSet::new();
    loop {
        let (reach, event) = tokio::select! {
            Some(done) = assigning.join_next(), if !assigning.is_empty() => {
                if let Ok(key) = done {
                    pending.remove(&key);
                }
                backlog.set(i64::try_from(pending.len()).unwrap_or(i64::MAX));
                continue;
            }
            Ok(()) = namespace_changes.changed(), if namespaced => {
                rescope(&mut watches, &selector.borrow());
                continue;
            }
            Ok(()) = selector.changed(), if namespaced => {
                rescope(&mut watches, &selector.borrow_and_update());
                continue;
            }
            Some(item) = watches.events.next(), if !watches.events.is_empty() => item,
            // Nothing left to wait for: the controller let go of this watch, or the caches
            // stopped; either way the sharder controller is stopping it.
            else => return,
        };
        let obj = match event {
            Ok(watcher::Event::Apply(obj) | watcher::Event::InitApply(obj)) => obj,
            Ok(_) => continue,
            Err(error) => {
                tracing::warn!(event = records::EVENT_MISSED_ASSIGNMENT_WATCH_FAILED, %error, %ring, resource = %gr, watching = %reach, "missed-assignment watch failed, retrying with backoff");
                if let watcher::Error::InitialListFailed(kube::Error::Api(status))
                | watcher::Error::WatchStartFailed(kube::Error::Api(status)) = &error
                    && status.code == 404
                {
                    // The version is not served any more: the view is rebuilt with the one
                    // discovered now, and a watch of that version replaces this one.
                    ctx.discovery.forget(&gr);
                }
                continue;
            }
        };
        // Without a shard label, a drain it may have had was acknowledged.
        ctx.observed
            .unassigned_seen(&ring, obj.metadata.uid.as_deref().unwrap_or_default());
        // A watch across the cluster sees the objects of namespaces the ring does not select
        // too; the webhook leaves them alone, and so does this path.
        if namespaced
            && !obj
                .metadata
                .namespace
                .as_deref()
                .is_some_and(|ns| ctx.caches.namespace_selected(&selector.borrow(), ns))
        {
            continue;
        }
        let key = ObjectKey {
            namespace: obj.metadata.namespace.clone(),
            name: obj.name_any(),
        };
        if !pending.insert(key.clone()) {
            // Already being assigned; that task reads the object afresh on each attempt.
            continue;
        }
        backlog.set(i64::try_from(pending.len()).unwrap_or(i64::MAX));
        let (patcher, ring, gr, ar, limit) = (
            patcher.clone(),
            ring.clone(),
            gr.clone(),
            ar.clone(),
            limit.clone(),
        );
        assigning.spawn(async move {
            assign(&patcher, &ring, &gr, &ar, &limit, obj.metadata).await;
            key
        });
    }
}

/// Delays between tries, from [`RETRY_INITIAL`] doubling up to [`RETRY_MAX`]: of a move that did
/// not end with the object assigned, and of the watch after an error (reset by every event).
///
/// Not kube's default watch backoff (client-go's: 800 ms doubling, with jitter, up to 30 s):
/// errors pile up while an API server restarts (refused connections, then an expired resource
/// version once it is back), and after three or four of them that backoff waits 3 to 13 s more
/// before watching again, so objects missed just after the restart could wait longer than the
/// 10 s the fast path promises. One watch per ring resource, on the leader only, asks little of a
/// struggling API server even every 4 s.
#[derive(Debug)]
struct RetryBackoff {
    next: Duration,
}

impl Default for RetryBackoff {
    fn default() -> Self {
        Self {
            next: RETRY_INITIAL,
        }
    }
}

impl RetryBackoff {
    /// The delay before the next try.
    fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (delay * 2).min(RETRY_MAX);
        delay
    }
}

impl Iterator for RetryBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.next_delay())
    }
}

impl Backoff for RetryBackoff {
    fn reset(&mut self) {
        self.next = RETRY_INITIAL;
    }
}

/// Namespace and name of an object being assigned.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct ObjectKey {
    namespace: Option<String>,
    name: String,
}

/// Moves one unassigned object until the webhook has assigned it, it is gone, or it needs no
/// move any more, retrying with [`RetryBackoff`].
async fn assign(
    patcher: &Patcher,
    ring: &RingRef,
    gr: &GroupResource,
    ar: &ApiResource,
    limit: &Semaphore,
    mut meta: ObjectMeta,
) {
    let ctx = &patcher.ctx;
    let mut backoff = RetryBackoff::default();
    loop {
        // Always decide with the current view: shards may have changed meanwhile.
        let Some(view) = ctx.views.get(ring) else {
            return;
        };
        let Some(resource) = view.resources.get(gr) else {
            return;
        };
        if resource.info.namespaced
            && !meta
                .namespace
                .as_deref()
                .is_some_and(|ns| ctx.caches.namespace_selected(&view.namespace_selector, ns))
        {
            return;
        }
        let decision = view.placement(&gr.group, resource, &meta).decision;
        if decision == RebalanceDecision::Keep {
            return;
        }
        let result = {
            let Ok(_permit) = limit.acquire().await else {
                return;
            };
            patcher.patch(&view, gr, ar, &meta, decision).await
        };
        let delay = match result {
            Ok(()) => {
                patcher.count(&view, gr, decision);
                return;
            }
            Err(PatchError::Held) => {
                // Nothing was sent and the object is as read: wait for the webhook, without
                // reading it again (thousands of objects may be waiting).
                tokio::time::sleep(HELD_WAIT).await;
                continue;
            }
            Err(error) => {
                let delay = backoff.next_delay();
                tracing::debug!(%error, object = %meta.name.as_deref().unwrap_or_default(), retry_in = ?delay, "missed-assignment move failed, retrying");
                delay
            }
        };
        tokio::time::sleep(delay).await;
        // Read the object afresh: a new resourceVersion, or assigned or deleted meanwhile.
        let api: Api<DynamicObject> = match &meta.namespace {
            Some(ns) => Api::namespaced_with(ctx.client.clone(), ns, ar),
            None => Api::all_with(ctx.client.clone(), ar),
        };
        match api
            .get_metadata_opt(meta.name.as_deref().unwrap_or_default())
            .await
        {
            Ok(Some(current)) => meta = current.metadata,
            Ok(None) => return,
            Err(kube::Error::Api(status)) if status.code == 403 => {
                // Retrying with what we read before would conflict forever: leave the object
                // to the periodic sync, which lists instead.
                tracing::warn!(
                    event = records::EVENT_MISSED_ASSIGNMENT_FORBIDDEN,
                    %ring,
                    resource = %gr,
                    "the sharder may not get objects of this resource (grant get in the ring's \
                     ClusterRole); leaving an unassigned object to the periodic sync"
                );
                return;
            }
            Err(error) => {
                tracing::debug!(%error, "failed to read an unassigned object, retrying");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use axum::http::{Request, Response};
    use kube::client::Body;
    use serde_json::json;

    use super::*;

    fn namespaces(names: &[&str]) -> BTreeSet<Reach> {
        names
            .iter()
            .map(|n| Reach::Namespace((*n).to_string()))
            .collect()
    }

    #[test]
    fn a_ring_over_few_namespaces_watches_each_of_them() {
        let selected = vec!["a".to_string(), "b".to_string()];
        assert_eq!(reaches(true, None, selected, 7), namespaces(&["a", "b"]));
        // Nothing selected: nothing to watch.
        assert_eq!(reaches(true, None, Vec::new(), 7), BTreeSet::new());
    }

    #[test]
    fn a_ring_over_many_or_most_namespaces_watches_across_the_cluster() {
        let cluster = BTreeSet::from([Reach::Cluster]);
        let most: Vec<String> = (0..5).map(|i| format!("ns-{i}")).collect();
        assert_eq!(reaches(true, None, most, 7), cluster);
        let many: Vec<String> = (0..51).map(|i| format!("ns-{i}")).collect();
        assert_eq!(reaches(true, None, many, 10_000), cluster);
    }

    #[test]
    fn a_watch_across_the_cluster_stays_until_well_below_the_cut_off() {
        let cluster = BTreeSet::from([Reach::Cluster]);
        let hovering: Vec<String> = (0..45).map(|i| format!("ns-{i}")).collect();
        let running = Some(ListScope::Cluster);
        assert_eq!(reaches(true, running, hovering.clone(), 10_000).len(), 1);
        assert_eq!(reaches(true, running, hovering, 10_000), cluster);
        let few: Vec<String> = (0..40).map(|i| format!("ns-{i}")).collect();
        assert_eq!(reaches(true, running, few, 10_000).len(), 40);
    }

    #[test]
    fn a_cluster_scoped_resource_is_watched_across_the_cluster() {
        let cluster = BTreeSet::from([Reach::Cluster]);
        assert_eq!(reaches(false, None, Vec::new(), 7), cluster);
        assert_eq!(reaches(false, None, vec!["a".into()], 7), cluster);
    }

    /// A client whose API server answers every list with one Secret, named after where it was
    /// listed, and never answers a watch; it records the path and query of every request.
    fn client() -> (kube::Client, Arc<Mutex<Vec<String>>>) {
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = requests.clone();
        let service = tower::service_fn(move |request: Request<Body>| {
            let uri = request.uri().clone();
            seen.lock().expect("requests").push(uri.to_string());
            async move {
                if uri.query().is_some_and(|q| q.contains("watch=true")) {
                    std::future::pending::<()>().await;
                }
                let namespace = uri
                    .path()
                    .strip_prefix("/api/v1/namespaces/")
                    .and_then(|rest| rest.split('/').next())
                    .unwrap_or("elsewhere");
                let list = json!({
                    "apiVersion": "meta.k8s.io/v1",
                    "kind": "PartialObjectMetadataList",
                    "metadata": {"resourceVersion": "10"},
                    "items": [{
                        "apiVersion": "meta.k8s.io/v1",
                        "kind": "PartialObjectMetadata",
                        "metadata": {"name": "unassigned", "namespace": namespace},
                    }],
                });
                Response::builder()
                    .status(200)
                    .body(Body::from(serde_json::to_vec(&list).expect("json")))
            }
        });
        (kube::Client::new(service, "default"), requests)
    }

    /// Reads `watches` until each of `reaches` has listed, returning the namespaces of the
    /// objects listed.
    async fn listed(watches: &mut Watches, reaches: &BTreeSet<Reach>) -> BTreeSet<String> {
        let mut done = BTreeSet::new();
        let mut objects = BTreeSet::new();
        while done != *reaches {
            let next = tokio::time::timeout(Duration::from_secs(5), watches.events.next()).await;
            let Ok(Some((reach, event))) = next else {
                panic!("the watches stopped before listing: {done:?}");
            };
            match event.expect("event") {
                watcher::Event::InitApply(obj) => {
                    objects.insert(obj.metadata.namespace.unwrap_or_default());
                }
                watcher::Event::InitDone => {
                    done.insert(reach);
                }
                _ => {}
            }
        }
        objects
    }

    #[tokio::test]
    async fn watches_follow_the_selected_namespaces() {
        let (client, requests) = client();
        let resource = api_resource(
            &GroupResource::new("", "secrets"),
            &crate::views::ResourceInfo::core_namespaced("Secret"),
        );
        let mut watches = Watches::new(client, resource, "!shard/r".into());

        let two = namespaces(&["a", "b"]);
        watches.set(&two);
        assert_eq!(
            listed(&mut watches, &two).await,
            ["a", "b"].map(String::from).into()
        );
        let paths: BTreeSet<String> = requests
            .lock()
            .expect("requests")
            .iter()
            .map(|r| r.split('?').next().unwrap_or_default().to_string())
            .collect();
        assert_eq!(
            paths,
            [
                "/api/v1/namespaces/a/secrets",
                "/api/v1/namespaces/b/secrets"
            ]
            .map(String::from)
            .into()
        );
        assert!(
            requests
                .lock()
                .expect("requests")
                .iter()
                .all(|r| r.contains("labelSelector=%21shard%2Fr")),
            "{requests:?}"
        );

        // A namespace joins: only it is listed anew (the others' watches go on).
        requests.lock().expect("requests").clear();
        let three = namespaces(&["a", "b", "c"]);
        watches.set(&three);
        assert_eq!(
            listed(&mut watches, &namespaces(&["c"])).await,
            ["c"].map(String::from).into()
        );
        assert_eq!(watches.len(), 3);
        assert!(
            requests
                .lock()
                .expect("requests")
                .iter()
                .filter(|r| !r.contains("watch=true"))
                .all(|r| r.starts_with("/api/v1/namespaces/c/secrets")),
            "{requests:?}"
        );

        // Too many to watch one by one: one watch across the cluster replaces them, and theirs
        // end.
        let cluster = BTreeSet::from([Reach::Cluster]);
        watches.set(&cluster);
        assert_eq!(
            listed(&mut watches, &cluster).await,
            ["elsewhere"].map(String::from).into()
        );
        assert_eq!(watches.len(), 1);
        assert_eq!(watches.events.len(), 1, "the namespaces' watches still run");

        // Nothing selected: nothing watched.
        watches.set(&BTreeSet::new());
        assert_eq!(watches.len(), 0);
        assert!(
            tokio::time::timeout(Duration::from_secs(5), watches.events.next())
                .await
                .expect("the cluster's watch to end")
                .is_none()
        );
    }

    #[test]
    fn retries_double_up_to_the_cap_and_start_over_on_reset() {
        let mut backoff = RetryBackoff::default();
        let delays: Vec<Duration> = backoff.by_ref().take(6).collect();
        let ms = Duration::from_millis;
        assert_eq!(
            delays,
            [ms(500), ms(1000), ms(2000), ms(4000), ms(4000), ms(4000)]
        );
        backoff.reset();
        assert_eq!(backoff.next(), Some(RETRY_INITIAL));
    }
}
