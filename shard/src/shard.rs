//! One shard of one ring: its name, the label keys of its ring, its membership Lease and the
//! watch configuration that limits it to its own objects.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::{ApiResource, Resource};
use kube::runtime::watcher;
use kube_sharding_api::RingKind;
use kube_sharding_api::labels;
use kube_sharding_api::range_lease::{ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES};
use kube_sharding_api::ranges::ShardField;

use crate::lease::LeaseLockConfig;
use crate::load::LoadMeter;
use crate::server_side::{InFlightGuard, KeptUnchanged, ServerSide};
use crate::sharded_watch::ShardedWatch;
use crate::shutdown::OnShutdown;

/// A shard: a controller instance that joins the ring `ring` under the name `name`, announcing
/// its membership with a Lease in `lease_namespace`.
///
/// [`Shard::new`] joins a `ClusterRing`; [`Shard::of_kind`] joins either kind, e.g. a
/// `ControllerRing` (docs/protocol.md §15), whose label keys and Lease label differ.
///
/// ```
/// let shard = kube_sharding::Shard::new("example", "shard-0", "default");
/// assert_eq!(
///     shard.label_selector(),
///     "shard.alpha.sharding.timebertt.dev/clusterring-50d858e0-example=shard-0"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    kind: RingKind,
    ring: String,
    name: String,
    lease_namespace: String,
    shard_label_key: String,
    drain_label_key: String,
    weight: Option<u32>,
    leaves_controlled_objects: bool,
    rejoin_pause: Duration,
    judgement_fallback: Duration,
    on_shutdown: OnShutdown,
    server_side: Option<ServerSide>,
    load_meter: Option<LoadMeter>,
}

/// What a shard does with an object it was handed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Assigned to this shard and not draining: run the controller's reconciler.
    Reconcile,
    /// Assigned to this shard and draining: acknowledge the drain, never reconcile.
    Drain,
    /// Not assigned to this shard (label missing or naming another shard): do nothing.
    Ignore,
}

/// How long [`Shard::run`] waits by default before rejoining after an exclusion.
pub const DEFAULT_REJOIN_PAUSE: Duration = Duration::from_secs(30);

/// How long [`Shard::run`] waits by default for a sharder's judgement of a Lease it just created
/// or took over before it concludes that no sharder serves the ring: far longer than the sharder
/// takes to land the moves it holds `ready` back for, which take milliseconds to seconds.
pub const DEFAULT_JUDGEMENT_FALLBACK: Duration = Duration::from_secs(60);

impl Shard {
    /// A shard named `name` (also the name and holder identity of its Lease) in ring `ring`.
    ///
    /// **Sharp edge:** the name must be unique within the ring and stable for the lifetime of
    /// the process (the pod name is a good choice). Two processes with one name both believe
    /// they own the same objects.
    pub fn new(
        ring: impl Into<String>,
        name: impl Into<String>,
        lease_namespace: impl Into<String>,
    ) -> Self {
        Self::of_kind(RingKind::ClusterRing, ring, name, lease_namespace)
    }

    /// A shard named `name` in ring `ring` of kind `kind` (see [`Shard::new`] for the name).
    ///
    /// ```
    /// use kube_sharding::RingKind;
    /// let shard = kube_sharding::Shard::of_kind(RingKind::ControllerRing, "example", "shard-0", "default");
    /// assert_eq!(
    ///     shard.label_selector(),
    ///     "shard.alpha.sharding.timebertt.dev/example=shard-0"
    /// );
    /// ```
    pub fn of_kind(
        kind: RingKind,
        ring: impl Into<String>,
        name: impl Into<String>,
        lease_namespace: impl Into<String>,
    ) -> Self {
        let ring = ring.into();
        Self {
            kind,
            shard_label_key: kind.shard_label(&ring),
            drain_label_key: kind.drain_label(&ring),
            ring,
            name: name.into(),
            lease_namespace: lease_namespace.into(),
            weight: None,
            leaves_controlled_objects: false,
            rejoin_pause: DEFAULT_REJOIN_PAUSE,
            judgement_fallback: DEFAULT_JUDGEMENT_FALLBACK,
            on_shutdown: OnShutdown::Release,
            server_side: None,
            load_meter: None,
        }
    }

    /// The shard of a **zero-write ring** (`spec.assignment: ServerSide`,
    /// docs/zero-write-rings.md) whose main resource is `K` and whose selectors hash `field`
    /// (`ShardField::Uid` for `hashKey: Object`, `ShardField::Namespace` for
    /// `hashKey: Namespace`; the shard cannot tell without reading the ring).
    ///
    /// The API stays the one of a label ring, with one addition: the controller's client comes
    /// from [`Shard::client`], whose lists and watches of `K` carry the shard's current
    /// `shardSelector`. Then
    ///
    /// - [`Shard::watcher_config`] selects no label (the selector does the selecting);
    /// - [`Shard::run`] follows the ranges the sharder publishes on the shard's Lease: a term
    ///   starts with none (lists are empty, watches silent), and on every newer generation the
    ///   watches of `K` restart with the new selector (kube's watcher lists again), the objects
    ///   of revoked ranges are reported as [`Departure::Released`] with
    ///   [`Release::RangeRevoked`] ([`Shard::departures`]), their reconciles in flight are
    ///   cancelled ([`ReconcileError::Revoked`]) and waited for, and then the generation is
    ///   acknowledged on the Lease, at once; the new list holds the objects the shard keeps
    ///   as well, which [`Shard::kept_unchanged`] spares a second reconcile when unchanged;
    /// - [`Shard::classify`], and so [`Shard::reconciler`] and [`Ownership::confirm`], judge an
    ///   object by whether its hash is in the current ranges; nothing is ever drained;
    /// - when the API server ignores the selector (feature gate `ShardedListAndWatch` off, or a
    ///   release before 1.36), the client drops every object outside the ranges itself, logs it
    ///   once and counts it ([`ShardedWatch::ignored_lists`]); BOOKMARK and ERROR events always
    ///   pass.
    ///
    /// Watches of other resources (controlled objects of a namespace-hashed ring, say) go
    /// through a client of their own: only `K` is selected.
    ///
    /// [`Departure::Released`]: crate::Departure::Released
    /// [`Release::RangeRevoked`]: crate::Release::RangeRevoked
    /// [`ReconcileError::Revoked`]: crate::ReconcileError::Revoked
    /// [`Ownership::confirm`]: crate::Ownership::confirm
    /// [`ShardedWatch::ignored_lists`]: crate::sharded_watch::ShardedWatch::ignored_lists
    /// [`Shard::departures`]: crate::Shard::departures
    #[must_use]
    pub fn server_side<K: Resource<DynamicType = ()>>(self, field: ShardField) -> Self {
        self.server_side_with(&ApiResource::erase::<K>(&()), field)
    }

    /// [`Shard::server_side`] for a resource known at runtime.
    #[must_use]
    pub fn server_side_with(mut self, resource: &ApiResource, field: ShardField) -> Self {
        self.server_side = Some(ServerSide::new(field, ShardedWatch::enforcing(resource)));
        self
    }

    /// Whether the shard is one of a zero-write ring ([`Shard::server_side`]).
    pub fn is_server_side(&self) -> bool {
        self.server_side.is_some()
    }

    /// The shard selector handle of a zero-write ring's shard: its current selector, what the
    /// server made of it, the count of ignored selectors.
    pub fn sharded_watch(&self) -> Option<&ShardedWatch> {
        self.server_side.as_ref().map(|s| &s.watch)
    }

    /// The client the controller of a zero-write ring's shard lists and watches with: `client`
    /// with the shard selector layer in front (see [`Shard::server_side`]). For a label ring's
    /// shard, `client` itself.
    pub fn client(&self, client: kube::Client) -> kube::Client {
        match &self.server_side {
            Some(server_side) => server_side.watch.wrap(client),
            None => client,
        }
    }

    /// The predicate that spares the controller of a zero-write ring's shard reconciling, after
    /// every new generation of ranges, each object it keeps unchanged (see [`KeptUnchanged`]):
    /// `watcher(..).reflect(..).applied_objects().predicate_filter(shard.kept_unchanged(), ..)`
    /// into `Controller::for_stream`. For a label ring's shard it filters nothing.
    pub fn kept_unchanged(&self) -> KeptUnchanged {
        KeptUnchanged {
            watch: self.server_side.as_ref().map(|s| s.watch.clone()),
        }
    }

    pub(crate) fn server_side_part(&self) -> Option<&ServerSide> {
        self.server_side.as_ref()
    }

    /// Registers a reconcile of `meta` about to start on a zero-write ring.
    pub(crate) fn register_in_flight(&self, meta: &ObjectMeta) -> Option<InFlightGuard> {
        self.server_side.as_ref().map(|s| s.register(meta))
    }

    /// The shard with weight `weight` (docs/protocol.md §17): it receives about `weight` times the
    /// share of a shard of weight 1. The sharder accepts 1 to 10 ([`labels::MAX_SHARD_WEIGHT`]) and
    /// counts any other value as 1, reporting it with an Event on the Lease.
    #[must_use]
    pub fn with_weight(mut self, weight: u32) -> Self {
        self.weight = Some(weight);
        self
    }

    /// The shard saying on its Lease that it leaves the objects its controllers control to the
    /// sharder: it never relabels them itself (docs/protocol.md §17). When every available shard
    /// of a ring says so, the sharder moves each controlled object as soon as its controller's
    /// drain is acknowledged, while it still drains others; a shard that relabels its controlled
    /// objects itself must not say so, or the sharder's moves race its writes.
    #[must_use]
    pub fn leaving_controlled_objects_to_sharder(mut self) -> Self {
        self.leaves_controlled_objects = true;
        self
    }

    /// Whether the shard says it leaves its controlled objects to the sharder (see
    /// [`Shard::leaving_controlled_objects_to_sharder`]).
    pub fn leaves_controlled_objects(&self) -> bool {
        self.leaves_controlled_objects
    }

    /// The shard waiting `pause` (instead of [`DEFAULT_REJOIN_PAUSE`]) before [`Shard::run`]
    /// tries to rejoin the ring after the sharder excluded it.
    #[must_use]
    pub fn with_rejoin_pause(mut self, pause: Duration) -> Self {
        self.rejoin_pause = pause;
        self
    }

    /// How long [`Shard::run`] waits before rejoining after an exclusion.
    pub fn rejoin_pause(&self) -> Duration {
        self.rejoin_pause
    }

    /// The shard starting work on a Lease it just created or took over without the sharder's
    /// `ready` only once `fallback` (instead of [`DEFAULT_JUDGEMENT_FALLBACK`]) has passed and
    /// no sharder has labelled the Lease since this shard took it (see [`Shard::run`]).
    ///
    /// **Sharp edge:** a short fallback lets the work start while the sharder still moves
    /// objects off this shard from its previous term; keep it far above the time those moves
    /// take.
    #[must_use]
    pub fn with_judgement_fallback(mut self, fallback: Duration) -> Self {
        self.judgement_fallback = fallback;
        self
    }

    /// How long [`Shard::run`] waits for a judgement before it concludes that no sharder runs.
    pub fn judgement_fallback(&self) -> Duration {
        self.judgement_fallback
    }

    /// The shard doing `on_shutdown` with its Lease when [`Shard::run`] stops on shutdown,
    /// instead of releasing it ([`OnShutdown::Release`], the default).
    ///
    /// Shards run by a StatefulSet keep their names over a rollout, so with
    /// [`OnShutdown::KeepIfReturning`] a rollout moves no object: each stopping pod reads its
    /// StatefulSet, and when the StatefulSet recreates it (its ordinal is below
    /// `spec.replicas`) leaves its Lease held; the new pod of the same name renews the Lease and
    /// carries on with the same objects at once. Scale-in, a deleted StatefulSet or a failed
    /// read release as before. Needs `get` on the StatefulSet.
    ///
    /// ```
    /// use kube_sharding::{OnShutdown, Shard, StatefulSetPod};
    /// let shard = Shard::new("my-ring", "my-controller-2", "my-namespace")
    ///     .with_on_shutdown(OnShutdown::KeepIfReturning(StatefulSetPod::new("my-namespace")));
    /// assert!(matches!(shard.on_shutdown(), OnShutdown::KeepIfReturning(_)));
    /// ```
    #[must_use]
    pub fn with_on_shutdown(mut self, on_shutdown: OnShutdown) -> Self {
        self.on_shutdown = on_shutdown;
        self
    }

    /// The shard reporting its load (docs/protocol.md §23) from `meter` on its Lease
    /// ([`Shard::lease_config`] writes the report with every renewal), and measuring every
    /// reconcile of [`Shard::reconciler`] with it. See [`LoadMeter`] for counting objects
    /// and the queue.
    #[must_use]
    pub fn with_load_meter(mut self, meter: LoadMeter) -> Self {
        self.load_meter = Some(meter);
        self
    }

    /// The meter the shard reports its load from, if any (see [`Shard::with_load_meter`]).
    pub fn load_meter(&self) -> Option<&LoadMeter> {
        self.load_meter.as_ref()
    }

    /// What [`Shard::run`] does with the Lease on shutdown.
    pub fn on_shutdown(&self) -> &OnShutdown {
        &self.on_shutdown
    }

    /// The kind of the ring.
    pub fn kind(&self) -> RingKind {
        self.kind
    }

    /// Name of the ring.
    pub fn ring(&self) -> &str {
        &self.ring
    }

    /// Name of the shard.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Namespace of the shard's Lease.
    pub fn lease_namespace(&self) -> &str {
        &self.lease_namespace
    }

    /// The ring's shard label key, whose value on an object names the shard owning it.
    pub fn shard_label_key(&self) -> &str {
        &self.shard_label_key
    }

    /// The ring's drain label key, whose presence on an object asks its shard to let go of it.
    pub fn drain_label_key(&self) -> &str {
        &self.drain_label_key
    }

    /// `<shard label key>=<shard name>`: the selector every watch of the shard must use.
    pub fn label_selector(&self) -> String {
        format!("{}={}", self.shard_label_key, self.name)
    }

    /// A watcher configuration selecting only this shard's objects, for the main resources
    /// (`Controller::new`) and for controlled resources (`Controller::owns`) alike.
    ///
    /// kube 5 uses the same [`watcher::Config`] for metadata-only watches
    /// (`Api<PartialObjectMeta<K>>`), so this serves those too. When an object's shard label
    /// changes away, the API server sends the watch a deletion: the object leaves the cache.
    ///
    /// On a zero-write ring ([`Shard::server_side`]) no label is selected: the shard selector on
    /// the shard's [client](Shard::client) does the selecting. Its lists are not paged: every
    /// new generation of ranges makes the watcher list again, and kube's controller drops the
    /// reconcile of an object its store does not hold yet, while its reflector holds a paged
    /// list's objects back until the last page. With pages, the granted objects of every page but
    /// the last would never be reconciled (seen at 10,000 Secrets: of 3,300 per shard, only the
    /// last page's 100 to 450 were).
    pub fn watcher_config(&self) -> watcher::Config {
        if self.server_side.is_some() {
            return watcher::Config {
                page_size: None,
                ..watcher::Config::default()
            };
        }
        watcher::Config::default().labels(&self.label_selector())
    }

    /// Configuration of the shard's membership Lease: name and holder identity are the shard
    /// name, labelled with the ring (the label key depends on the ring kind), annotated with the
    /// weight if one was set and with `"true"` if the shard leaves its controlled objects to the
    /// sharder (removed otherwise, so that a restart without it takes back what the shard said
    /// before), watching the sharder's exclusion annotation
    /// ([`labels::ANNOTATION_EXCLUDED`], see [`LeaseLockConfig::with_exclusion_annotation`]), and
    /// marking its releases ([`labels::ANNOTATION_RELEASED_BY`], see
    /// [`LeaseLockConfig::with_release_mark`]), and with the load report of its
    /// [meter](Shard::with_load_meter), if it has one ([`LeaseLockConfig::with_load_report`]).
    /// Default timing; adjust it with the `with_*` methods.
    pub fn lease_config(&self) -> LeaseLockConfig {
        // Dropping the other kind's ring label lets a shard move between kinds on the same Lease:
        // a Lease carrying both is used by neither ring.
        // The ranges and their acknowledgement are about one holding: a shard that takes its
        // Lease again starts with none (docs/zero-write-rings.md).
        let config = LeaseLockConfig::new(&self.lease_namespace, &self.name, &self.name)
            .with_holding_annotation(ANNOTATION_RANGES)
            .with_holding_annotation(ANNOTATION_ACKNOWLEDGED)
            .with_label(self.kind.lease_label(), &self.ring)
            .without_label(self.kind.other().lease_label())
            .with_exclusion_annotation(labels::ANNOTATION_EXCLUDED)
            .with_verdict_label(labels::LABEL_STATE)
            .with_release_mark(labels::ANNOTATION_RELEASED_BY);
        let config = if self.leaves_controlled_objects {
            config.with_annotation(labels::ANNOTATION_LEAVES_CONTROLLED_OBJECTS, "true")
        } else {
            config.without_annotation(labels::ANNOTATION_LEAVES_CONTROLLED_OBJECTS)
        };
        let config = match &self.load_meter {
            Some(meter) => config.with_load_report(meter.clone()),
            None => config,
        };
        match self.weight {
            Some(weight) => config.with_annotation(labels::ANNOTATION_WEIGHT, weight.to_string()),
            None => config,
        }
    }

    /// What this shard must do with an object, judged by its labels.
    ///
    /// Only objects whose shard label names this shard belong to it; among those, the mere
    /// presence of the drain label (any value) means "drain". A drain label on an object owned by
    /// someone else is none of this shard's business.
    ///
    /// On a zero-write ring ([`Shard::server_side`]) an object belongs to the shard while its
    /// hash is in the shard's current ranges, and is never drained.
    pub fn classify(&self, meta: &ObjectMeta) -> Disposition {
        if let Some(server_side) = &self.server_side {
            return if server_side.watch.selects(meta) {
                Disposition::Reconcile
            } else {
                Disposition::Ignore
            };
        }
        let Some(labels) = meta.labels.as_ref() else {
            return Disposition::Ignore;
        };
        if labels.get(&self.shard_label_key).map(String::as_str) != Some(self.name.as_str()) {
            return Disposition::Ignore;
        }
        if labels.contains_key(&self.drain_label_key) {
            Disposition::Drain
        } else {
            Disposition::Reconcile
        }
    }

    /// Whether the object carries this ring's drain label.
    pub fn is_draining(&self, meta: &ObjectMeta) -> bool {
        meta.labels
            .as_ref()
            .is_some_and(|l| l.contains_key(&self.drain_label_key))
    }

    /// The JSON merge patch that acknowledges a drain of an object at `resource_version`: it
    /// removes the shard and the drain label in one write, which the API server rejects (409)
    /// if the object changed since.
    pub fn drain_patch(&self, resource_version: &str) -> serde_json::Value {
        serde_json::json!({
            "metadata": {
                "resourceVersion": resource_version,
                "labels": {
                    &self.shard_label_key: null,
                    &self.drain_label_key: null,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_selector_and_lease_follow_the_spec() {
        let shard = Shard::new("checksum-controller", "shard-x", "leases");
        assert_eq!(
            shard.shard_label_key(),
            "shard.alpha.sharding.timebertt.dev/clusterring-f4d63fd2-checksum-controller"
        );
        assert_eq!(
            shard.drain_label_key(),
            "drain.alpha.sharding.timebertt.dev/clusterring-f4d63fd2-checksum-controller"
        );
        assert_eq!(
            shard.watcher_config().label_selector.as_deref(),
            Some(
                "shard.alpha.sharding.timebertt.dev/clusterring-f4d63fd2-checksum-controller=shard-x"
            )
        );
        let lease = shard.lease_config();
        assert_eq!(lease.namespace(), "leases");
        assert_eq!(lease.name(), "shard-x");
        assert_eq!(lease.identity(), "shard-x");
        assert_eq!(
            lease
                .labels()
                .get("alpha.sharding.timebertt.dev/clusterring"),
            Some(&"checksum-controller".to_string())
        );
        assert!(lease.annotations().is_empty());
    }

    #[test]
    fn a_zero_write_shard_lists_in_one_page_without_a_label() {
        let shard = Shard::new("ring", "shard-x", "leases")
            .server_side::<k8s_openapi::api::core::v1::Secret>(ShardField::Uid);
        let config = shard.watcher_config();
        assert_eq!(config.label_selector, None);
        // Pages would let kube's controller drop the reconciles of every page but the last.
        assert_eq!(config.page_size, None);
        assert!(
            Shard::new("ring", "shard-x", "leases")
                .watcher_config()
                .page_size
                .is_some()
        );
    }

    #[test]
    fn a_shard_leaving_controlled_objects_to_the_sharder_says_so_on_its_lease() {
        const KEY: &str = "alpha.sharding.timebertt.dev/leaves-controlled-objects";
        let shard = Shard::new("ring", "shard-x", "leases");
        assert!(!shard.leaves_controlled_objects());
        assert!(!shard.lease_config().annotations().contains_key(KEY));
        let leaving = shard.leaving_controlled_objects_to_sharder();
        assert!(leaving.leaves_controlled_objects());
        assert_eq!(
            leaving.lease_config().annotations().get(KEY),
            Some(&"true".to_string())
        );
    }

    #[test]
    fn controller_ring_shards_use_its_keys_and_lease_label() {
        let shard =
            Shard::of_kind(RingKind::ControllerRing, "example", "shard-x", "leases").with_weight(3);
        assert_eq!(shard.kind(), RingKind::ControllerRing);
        assert_eq!(
            shard.shard_label_key(),
            "shard.alpha.sharding.timebertt.dev/example"
        );
        assert_eq!(
            shard.drain_label_key(),
            "drain.alpha.sharding.timebertt.dev/example"
        );
        let lease = shard.lease_config();
        assert_eq!(
            lease
                .labels()
                .get("alpha.sharding.timebertt.dev/controllerring"),
            Some(&"example".to_string())
        );
        assert!(
            !lease
                .labels()
                .contains_key("alpha.sharding.timebertt.dev/clusterring")
        );
        assert_eq!(
            lease
                .annotations()
                .get("alpha.sharding.timebertt.dev/weight"),
            Some(&"3".to_string())
        );
    }
}
