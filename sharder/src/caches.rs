//! The caches every replica keeps (rings of both kinds, shard Leases grouped by ring, Namespaces),
//! the tasks that fill them; they announce their changes on the change hub (`crate::changes`).
//!
//! | module | what |
//! |---|---|
//! | `reflector` | one watch task per cache, reading in batches |
//! | `lease_index` | the shard Leases of one ring kind grouped by ring, and which changes matter |
//! | `thread` | the single-threaded runtime the watches run on |
//! | `slim` | what the caches keep of each object: only the fields the sharder reads |
//! | `renewals` | shard liveness by the sharder's clock: when each Lease was seen renewed |

mod lease_index;
mod reflector;
mod renewals;
mod slim;
mod thread;

use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use kube_sharding_api::selector::selector_matches;
use kube_sharding_api::{ClusterRing, ControllerRing, RingKind, RingRef};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub(crate) use self::lease_index::{LeaseIndex, state_label_is_stale};
use self::reflector::{Runner, Watched, spawn_reflector, spawn_reflector_into};
pub(crate) use self::renewals::{Renewals, SKEW_WARNING};
pub(crate) use self::thread::CacheThread;
use crate::changes::Changes;
use crate::core::any_ring::AnyRing;

/// The caches of one sharder process, filled by watches on the caches' thread.
#[derive(Clone)]
pub(crate) struct Caches {
    /// Every ClusterRing.
    pub(crate) cluster_rings: Store<ClusterRing>,
    /// Every ControllerRing.
    pub(crate) controller_rings: Store<ControllerRing>,
    /// Every Lease carrying the ClusterRing label, grouped by ring.
    pub(crate) cluster_ring_leases: Arc<LeaseIndex>,
    /// Every Lease carrying the ControllerRing label, grouped by ring.
    pub(crate) controller_ring_leases: Arc<LeaseIndex>,
    /// Every Namespace (for namespace selectors).
    pub(crate) namespaces: Store<Namespace>,
    /// Where their changes are announced.
    pub(crate) changes: Arc<Changes>,
}

impl Caches {
    /// Starts one watch task per cache in `tasks`, on `thread` with `client`, until `shutdown`;
    /// their changes are announced on `changes`.
    pub(crate) fn start(
        client: kube::Client,
        thread: &CacheThread,
        changes: Arc<Changes>,
        tasks: &mut JoinSet<()>,
        shutdown: &CancellationToken,
    ) -> Self {
        let runner = Runner {
            client,
            runtime: thread.handle().clone(),
        };
        let ring_changed = {
            let changes = changes.clone();
            move || changes.ring_changed()
        };
        let cluster_rings = spawn_reflector(
            tasks,
            &runner,
            Api::<ClusterRing>::all(runner.client.clone()),
            watcher::Config::default(),
            {
                let ring_changed = ring_changed.clone();
                move |_: &watcher::Event<ClusterRing>| {
                    ring_changed();
                    true
                }
            },
            shutdown,
        );
        let controller_rings = spawn_reflector(
            tasks,
            &runner,
            Api::<ControllerRing>::all(runner.client.clone()),
            watcher::Config::default(),
            move |_: &watcher::Event<ControllerRing>| {
                ring_changed();
                true
            },
            shutdown,
        );
        // A label selector cannot say "either label", so each kind's Leases have a cache of their
        // own.
        let [cluster_ring_leases, controller_ring_leases] = RingKind::ALL.map(|kind| {
            let (store, writer) = kube::runtime::reflector::store();
            let renewals = Arc::new(Renewals::default());
            let index = LeaseIndex::new(kind, store, renewals.clone(), changes.clone());
            let observer = index.clone();
            let changes = changes.clone();
            spawn_reflector_into(
                tasks,
                &runner,
                writer,
                Watched {
                    api: Api::<Lease>::all(runner.client.clone()),
                    config: watcher::Config::default().labels(&slim::lease_selector(kind)),
                    prepare: Box::new(move |event| {
                        // First: what the renewal tracking copies must be bounded already.
                        slim::prepare_lease(kind, event);
                        renewals.prepare(event, Timestamp::now());
                        slim::for_each_object(event, slim::slim_lease);
                    }),
                },
                move |event: &watcher::Event<Lease>| {
                    let changed = observer.observe(event, Timestamp::now());
                    if changed {
                        changes.lease_changed();
                    }
                    changed
                },
                shutdown,
            );
            index
        });
        let namespaces = spawn_reflector(
            tasks,
            &runner,
            Api::<Namespace>::all(runner.client.clone()),
            watcher::Config::default(),
            {
                let changes = changes.clone();
                // Any change may change which namespaces a ring selects: the missed-assignment
                // watches then cover another set of namespaces. Namespaces change seldom, so
                // telling apart the events that changed labels is not worth a copy of them.
                move |event: &watcher::Event<Namespace>| {
                    if !matches!(event, watcher::Event::Init | watcher::Event::InitApply(_)) {
                        changes.namespace_changed();
                    }
                    true
                }
            },
            shutdown,
        );
        Self {
            cluster_rings,
            controller_rings,
            cluster_ring_leases,
            controller_ring_leases,
            namespaces,
            changes,
        }
    }

    /// Waits until every cache has its first listing.
    pub(crate) async fn wait_until_ready(
        &self,
    ) -> Result<(), kube::runtime::reflector::store::WriterDropped> {
        self.cluster_rings.wait_until_ready().await?;
        self.controller_rings.wait_until_ready().await?;
        self.cluster_ring_leases.store().wait_until_ready().await?;
        self.controller_ring_leases
            .store()
            .wait_until_ready()
            .await?;
        self.namespaces.wait_until_ready().await
    }

    /// Every cached ring of both kinds.
    pub(crate) fn rings(&self) -> Vec<AnyRing> {
        let cluster = self.cluster_rings.state().into_iter().map(AnyRing::Cluster);
        let controller = self
            .controller_rings
            .state()
            .into_iter()
            .map(AnyRing::Controller);
        cluster.chain(controller).collect()
    }

    /// The cached ring `ring`, if it exists.
    pub(crate) fn ring(&self, ring: &RingRef) -> Option<AnyRing> {
        match ring.kind {
            RingKind::ClusterRing => self
                .cluster_rings
                .get(&ObjectRef::new(&ring.name))
                .map(AnyRing::Cluster),
            RingKind::ControllerRing => self
                .controller_rings
                .get(&ObjectRef::new(&ring.name))
                .map(AnyRing::Controller),
        }
    }

    /// The Leases carrying the ring label of `kind`, grouped by ring.
    pub(crate) fn lease_index(&self, kind: RingKind) -> &Arc<LeaseIndex> {
        match kind {
            RingKind::ClusterRing => &self.cluster_ring_leases,
            RingKind::ControllerRing => &self.controller_ring_leases,
        }
    }

    /// Whether the cached Namespace `namespace` matches `selector` (a missing one does not).
    pub(crate) fn namespace_selected(&self, selector: &LabelSelector, namespace: &str) -> bool {
        self.namespaces
            .get(&ObjectRef::new(namespace))
            .is_some_and(|ns| selector_matches(selector, ns.labels()))
    }

    /// The names of the cached Namespaces `selector` matches, sorted, and how many Namespaces are
    /// cached in all.
    pub(crate) fn selected_namespaces(&self, selector: &LabelSelector) -> (Vec<String>, usize) {
        let namespaces = self.namespaces.state();
        let mut selected: Vec<String> = namespaces
            .iter()
            .filter(|ns| selector_matches(selector, ns.labels()))
            .map(|ns| ns.name_any())
            .collect();
        selected.sort();
        (selected, namespaces.len())
    }

    /// Every cached Lease of ring `ring` (by its ring label), whatever its state.
    pub(crate) fn ring_leases(&self, ring: &RingRef) -> Vec<Arc<Lease>> {
        self.lease_index(ring.kind).ring_leases(&ring.name)
    }
}

impl std::fmt::Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches").finish_non_exhaustive()
    }
}
