//! The shard Leases of one ring kind, grouped by ring, and the changes that matter.
//!
//! Shards renew their Leases every few seconds, so at 1,000 shards the Lease watch delivers
//! hundreds of events per second. A renewal moves `renewTime` only: it changes no ring's
//! membership, and the sharder must not pay for it with API requests or with work proportional
//! to the number of shards or rings. The index therefore sits behind the Lease cache and passes
//! on only what changes something:
//! - a **membership change** (a Lease appears or goes, or its holder, labels or annotations
//!   change) names the rings it concerns, so ring views are rebuilt for those rings alone;
//! - a **state change** (a renewal that makes the Lease's state label wrong, e.g. an `expired`
//!   Lease renewed again) names the Lease, so the shard-lease controller relabels it.
//!
//! Every other event costs one hash of the Lease's metadata and one state evaluation.
//!
//! The index also remembers shards whose Lease left a ring while they held it (deleted,
//! relabelled, or its holder emptied or changed by someone other than the shard): they may still
//! be running until the Lease would have become `uncertain`, and it announces a membership change
//! of the ring once that time is over. Only a release the shard marks itself
//! ([`ANNOTATION_RELEASED_BY`] with its identity, written with the emptied holder) says that it
//! has stopped; the sharder cannot tell any other write to the holder from one by a third party.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube_sharding_api::RingKind;
use kube_sharding_api::labels::{ANNOTATION_RELEASED_BY, LABEL_STATE};
use kube_sharding_api::lease::{ShardLease, ShardState};
use kube_sharding_api::load::ANNOTATION_LOAD;

use super::Renewals;
use crate::changes::{Changes, LeaseChange};

/// The shard Leases of one ring kind grouped by ring, over the kind's Lease cache.
#[derive(Debug)]
pub(crate) struct LeaseIndex {
    kind: RingKind,
    store: Store<Lease>,
    renewals: Arc<Renewals>,
    /// This index, for the timers that end departures.
    this: std::sync::Weak<LeaseIndex>,
    inner: RwLock<Inner>,
    changes: Arc<Changes>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Ring name → its Leases.
    by_ring: HashMap<String, HashSet<ObjectRef<Lease>>>,
    /// Lease → what the index last saw of it.
    leases: HashMap<ObjectRef<Lease>, Entry>,
    /// Ring name → how many membership changes it has seen, for caches of per-ring results.
    versions: HashMap<String, u64>,
    /// Bumped on every rebuild, which may change any ring.
    epoch: u64,
    /// Ring name → shards whose Lease left the ring (deleted, relabelled) while held by the shard
    /// and not yet `uncertain`, with when it would have been: until then the shard may still run.
    departed: HashMap<String, BTreeMap<String, Departure>>,
}

/// What the index keeps of one Lease.
#[derive(Debug)]
struct Entry {
    /// Its ring (by its ring label).
    ring: String,
    /// The fingerprint of what membership depends on.
    fingerprint: u64,
    /// While the shard itself holds the Lease and it is not yet `uncertain`: until when the
    /// shard may be running, and whether the Lease already carried the shard's release mark.
    held: Option<Held>,
}

/// A Lease held by its shard, as last seen.
#[derive(Clone, Copy, Debug)]
struct Held {
    /// When the Lease would become `uncertain`: two lease durations after the last renewal seen.
    until: Timestamp,
    /// Whether [`ANNOTATION_RELEASED_BY`] named the holder already: a mark left over from an
    /// earlier release says nothing about the next write.
    marked: bool,
}

impl Held {
    /// What `lease` says at `now`, if its shard holds it and may be running.
    fn of(lease: &Lease, now: Timestamp) -> Option<Self> {
        let shard_lease = ShardLease::from_lease(lease);
        if !shard_lease.is_held_by_shard() {
            return None;
        }
        let until = running_until(&shard_lease, now)?;
        Some(Self {
            until,
            marked: released_by(lease) == Some(shard_lease.name),
        })
    }
}

/// The holder a shard named when it released `lease` itself ([`ANNOTATION_RELEASED_BY`]).
fn released_by(lease: &Lease) -> Option<&str> {
    lease
        .annotations()
        .get(ANNOTATION_RELEASED_BY)
        .map(String::as_str)
}

/// Until when the holder of `lease` may be running: two lease durations after its last renewal
/// the sharder saw, unless the Lease is `uncertain` already (`None`).
fn running_until(lease: &ShardLease<'_>, now: Timestamp) -> Option<Timestamp> {
    let (state, _) = lease.evaluate(now);
    let expiry = lease.expiry().filter(|_| state != ShardState::Uncertain)?;
    let duration =
        SignedDuration::from_secs(i64::from(lease.lease_duration_seconds.unwrap_or_default()));
    Some(expiry.checked_add(duration).unwrap_or(Timestamp::MAX))
}

/// A shard whose held Lease left its ring; see [`LeaseIndex::departed_shards`].
#[derive(Clone, Debug, PartialEq, Eq)]
struct Departure {
    /// The Lease that left.
    lease: ObjectRef<Lease>,
    /// When the Lease would have become `uncertain`: two lease durations after the last renewal
    /// the sharder saw.
    until: Timestamp,
}

impl Inner {
    fn bump(&mut self, ring: &str) {
        *self.versions.entry(ring.to_string()).or_default() += 1;
    }
}

impl LeaseIndex {
    /// An empty index of the Leases of `kind`, whose cache is `store`, which `renewals` prepares;
    /// it announces its changes on `changes`.
    pub(crate) fn new(
        kind: RingKind,
        store: Store<Lease>,
        renewals: Arc<Renewals>,
        changes: Arc<Changes>,
    ) -> Arc<Self> {
        Arc::new_cyclic(|this| Self {
            kind,
            store,
            renewals,
            this: this.clone(),
            inner: RwLock::default(),
            changes,
        })
    }

    /// The ring kind whose Leases this indexes.
    pub(crate) fn kind(&self) -> RingKind {
        self.kind
    }

    /// When the sharder saw each Lease renewed, and its holder's clock skew.
    pub(crate) fn renewals(&self) -> &Renewals {
        &self.renewals
    }

    /// The cache of the kind's Leases.
    pub(crate) fn store(&self) -> &Store<Lease> {
        &self.store
    }

    /// Every cached Lease of ring `ring` (by its ring label).
    pub(crate) fn ring_leases(&self, ring: &str) -> Vec<Arc<Lease>> {
        self.map_ring_leases(ring, |lease| self.store.get(lease))
    }

    /// The cached Leases of ring `ring` named `name` (at most one per namespace): a lookup by
    /// name that reads only the matching Leases from the cache.
    pub(crate) fn ring_leases_named(&self, ring: &str, name: &str) -> Vec<Arc<Lease>> {
        self.map_ring_leases(ring, |lease| {
            (lease.name == name)
                .then(|| self.store.get(lease))
                .flatten()
        })
    }

    /// What `f` makes of each Lease reference of ring `ring`, where it makes something.
    fn map_ring_leases<T>(
        &self,
        ring: &str,
        f: impl FnMut(&ObjectRef<Lease>) -> Option<T>,
    ) -> Vec<T> {
        let Ok(inner) = self.inner.read() else {
            return Vec::new();
        };
        inner
            .by_ring
            .get(ring)
            .into_iter()
            .flatten()
            .filter_map(f)
            .collect()
    }

    /// A number that changes whenever the membership of ring `ring` may have changed: results
    /// computed from the ring's Leases stay valid while it stays the same.
    pub(crate) fn ring_version(&self, ring: &str) -> (u64, u64) {
        self.inner
            .read()
            .map(|inner| {
                (
                    inner.epoch,
                    inner.versions.get(ring).copied().unwrap_or_default(),
                )
            })
            .unwrap_or_default()
    }

    /// The names of the rings that have Leases (whether or not the rings exist).
    pub(crate) fn rings(&self) -> Vec<String> {
        self.inner
            .read()
            .map(|inner| inner.by_ring.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// References to the Leases of ring `ring`.
    pub(crate) fn ring_lease_refs(&self, ring: &str) -> Vec<ObjectRef<Lease>> {
        self.map_ring_leases(ring, |lease| Some(lease.clone()))
    }

    /// References to the Leases of ring `ring` named `name` (at most one per namespace).
    pub(crate) fn ring_lease_refs_named(&self, ring: &str, name: &str) -> Vec<ObjectRef<Lease>> {
        self.map_ring_leases(ring, |lease| (lease.name == name).then(|| lease.clone()))
    }

    /// The shards of ring `ring` whose Lease left the ring at most two lease durations after its
    /// last renewal the sharder saw, while held by the shard: deleted, relabelled away, or its
    /// holder emptied or changed without the shard's own release mark (by anyone allowed to),
    /// it may still be running and reconciling its objects. Until then those leave it only
    /// through drains, as from a shard kept out of the ring.
    pub(crate) fn departed_shards(&self, ring: &str, now: Timestamp) -> BTreeSet<String> {
        self.inner
            .read()
            .map(|inner| {
                inner
                    .departed
                    .get(ring)
                    .into_iter()
                    .flatten()
                    .filter(|(_, d)| d.until > now)
                    .map(|(shard, _)| shard.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The departures of ring `ring` that are not over at `now`: each shard with the time until
    /// which it may still run (see [`LeaseIndex::departed_shards`]).
    pub(crate) fn departures(&self, ring: &str, now: Timestamp) -> BTreeMap<String, Timestamp> {
        self.inner
            .read()
            .map(|inner| {
                inner
                    .departed
                    .get(ring)
                    .into_iter()
                    .flatten()
                    .filter(|(_, d)| d.until > now)
                    .map(|(shard, d)| (shard.clone(), d.until))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Takes in a departure that another sharder process recorded (in the ring's status) before
    /// this one saw the Lease leave: shard `shard` of ring `ring` may run until `until`. Returns
    /// whether it was new to this index (or later than what it knew).
    pub(crate) fn adopt_departure(
        &self,
        ring: &str,
        shard: &str,
        until: Timestamp,
        now: Timestamp,
    ) -> bool {
        if until <= now {
            return false;
        }
        let Ok(mut inner) = self.inner.write() else {
            return false;
        };
        let known = inner
            .departed
            .get(ring)
            .and_then(|shards| shards.get(shard))
            .is_some_and(|d| d.until >= until);
        if known {
            return false;
        }
        // The Lease may be gone: the name is all the change notice needs.
        let departure = Departure {
            lease: ObjectRef::new(shard),
            until,
        };
        self.keep_departure(&mut inner, ring, shard, departure, now);
        true
    }

    /// Takes in one event of the kind's Lease watch, after the cache applied it. Returns whether
    /// membership may have changed.
    pub(crate) fn observe(&self, event: &watcher::Event<Lease>, now: Timestamp) -> bool {
        let change = match event {
            watcher::Event::Apply(lease) | watcher::Event::InitApply(lease) => {
                self.apply(lease, now)
            }
            watcher::Event::Delete(lease) => self.delete(lease, now),
            watcher::Event::Init => None,
            watcher::Event::InitDone => {
                self.rebuild(now);
                Some(LeaseChange::All)
            }
        };
        let Some(change) = change else {
            return false;
        };
        let membership = !matches!(change, LeaseChange::State(_));
        self.changes.lease_change(self.kind, change);
        membership
    }

    fn apply(&self, lease: &Lease, now: Timestamp) -> Option<LeaseChange> {
        let reference = ObjectRef::from_obj(lease);
        let ring = lease
            .labels()
            .get(self.kind.lease_label())
            .cloned()
            .unwrap_or_default();
        let fingerprint = fingerprint(lease);
        let entry = Entry {
            ring: ring.clone(),
            fingerprint,
            held: Held::of(lease, now),
        };
        let mut inner = self.inner.write().ok()?;
        let previous = inner.leases.insert(reference.clone(), entry);
        match previous {
            Some(Entry {
                ring: old_ring,
                fingerprint: old_fingerprint,
                ..
            }) if old_fingerprint == fingerprint && old_ring == ring => {
                // A renewal: membership is unchanged, but the state label may be out of date, or
                // the holder's clock skew may have crossed the warning threshold.
                drop(inner);
                let skew_changed = self
                    .renewals
                    .take_skew_change(lease.uid().as_deref().unwrap_or_default());
                (state_label_is_stale(lease, now) || skew_changed)
                    .then_some(LeaseChange::State(reference))
            }
            Some(Entry {
                ring: old_ring,
                held: old_held,
                ..
            }) => {
                let mut rings = vec![ring.clone()];
                inner.bump(&ring);
                if old_ring != ring {
                    remove_from(&mut inner.by_ring, &old_ring, &reference);
                    inner.bump(&old_ring);
                    self.note_departure(&mut inner, &old_ring, lease, now);
                    rings.push(old_ring);
                } else if let Some(held) = old_held.filter(|held| held.until > now) {
                    let shard_lease = ShardLease::from_lease(lease);
                    // Emptied or handed to someone else: only the shard's own mark, written
                    // with the emptied holder, says it stopped.
                    let released_itself =
                        shard_lease.holder_identity.unwrap_or_default().is_empty()
                            && !held.marked
                            && released_by(lease) == Some(shard_lease.name);
                    if !shard_lease.is_held_by_shard() && !released_itself {
                        self.record_departure(&mut inner, &ring, lease, held.until, now);
                    }
                }
                inner
                    .by_ring
                    .entry(ring)
                    .or_default()
                    .insert(reference.clone());
                Some(LeaseChange::Membership {
                    lease: reference,
                    rings,
                })
            }
            None => {
                inner.bump(&ring);
                inner
                    .by_ring
                    .entry(ring.clone())
                    .or_default()
                    .insert(reference.clone());
                Some(LeaseChange::Membership {
                    lease: reference,
                    rings: vec![ring],
                })
            }
        }
    }

    fn delete(&self, lease: &Lease, now: Timestamp) -> Option<LeaseChange> {
        let reference = ObjectRef::from_obj(lease);
        let mut inner = self.inner.write().ok()?;
        let Entry { ring, .. } = inner.leases.remove(&reference)?;
        remove_from(&mut inner.by_ring, &ring, &reference);
        inner.bump(&ring);
        self.note_departure(&mut inner, &ring, lease, now);
        Some(LeaseChange::Membership {
            lease: reference,
            rings: vec![ring],
        })
    }

    /// Notes that `lease` left ring `ring` at `now`, if its shard may still be running (held by
    /// itself, not yet `uncertain`), and has the ring's views rebuilt once that is over.
    fn note_departure(&self, inner: &mut Inner, ring: &str, lease: &Lease, now: Timestamp) {
        if let Some(held) = Held::of(lease, now) {
            self.record_departure(inner, ring, lease, held.until, now);
        }
    }

    /// Notes that the shard of `lease` may still run for ring `ring` until `until`, and has the
    /// ring's views rebuilt once that is over.
    fn record_departure(
        &self,
        inner: &mut Inner,
        ring: &str,
        lease: &Lease,
        until: Timestamp,
        now: Timestamp,
    ) {
        let shard = ShardLease::from_lease(lease).name;
        let departure = Departure {
            lease: ObjectRef::from_obj(lease),
            until,
        };
        tracing::info!(
            kind = %self.kind,
            ring,
            shard,
            %until,
            "a held shard Lease left its ring, or its holder changed without the shard's release mark: the shard may still run, so its objects leave it only through drains until then"
        );
        self.keep_departure(inner, ring, shard, departure, now);
    }

    /// Keeps `departure` of `shard` from ring `ring` and ends it when its time is over.
    fn keep_departure(
        &self,
        inner: &mut Inner,
        ring: &str,
        shard: &str,
        departure: Departure,
        now: Timestamp,
    ) {
        let until = departure.until;
        inner.bump(ring);
        inner
            .departed
            .entry(ring.to_string())
            .or_default()
            .insert(shard.to_string(), departure.clone());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // Weak, so a pending timer does not keep the index (and its cache) alive after the
        // process began to shut down; the runtime drops the timer with it.
        let index = self.this.clone();
        let (ring, shard) = (ring.to_string(), shard.to_string());
        let wait = until
            .duration_since(now)
            .try_into()
            .unwrap_or(std::time::Duration::ZERO);
        runtime.spawn(async move {
            tokio::time::sleep(wait).await;
            if let Some(index) = index.upgrade() {
                index.end_departure(&ring, &shard, &departure);
            }
        });
    }

    /// Forgets `departure` of `shard` from ring `ring` once its time is over, and announces the
    /// ring's membership change: the shard's objects may now move directly.
    fn end_departure(&self, ring: &str, shard: &str, departure: &Departure) {
        let Ok(mut inner) = self.inner.write() else {
            return;
        };
        let Some(shards) = inner.departed.get_mut(ring) else {
            return;
        };
        if shards.get(shard) != Some(departure) {
            return;
        }
        shards.remove(shard);
        if shards.is_empty() {
            inner.departed.remove(ring);
        }
        inner.bump(ring);
        drop(inner);
        self.changes.lease_change(
            self.kind,
            LeaseChange::Membership {
                lease: departure.lease.clone(),
                rings: vec![ring.to_string()],
            },
        );
    }

    /// Rebuilds the index from the cache, which a new listing just replaced (objects deleted
    /// while the watch was down produce no delete events).
    fn rebuild(&self, now: Timestamp) {
        let mut fresh = Inner::default();
        for lease in self.store.state() {
            let reference = ObjectRef::from_obj(lease.as_ref());
            let ring = lease
                .labels()
                .get(self.kind.lease_label())
                .cloned()
                .unwrap_or_default();
            fresh
                .by_ring
                .entry(ring.clone())
                .or_default()
                .insert(reference.clone());
            let entry = Entry {
                fingerprint: fingerprint(lease.as_ref()),
                held: Held::of(lease.as_ref(), now),
                ring,
            };
            fresh.leases.insert(reference, entry);
        }
        if let Ok(mut inner) = self.inner.write() {
            fresh.epoch = inner.epoch + 1;
            fresh.versions = std::mem::take(&mut inner.versions);
            fresh.departed = std::mem::take(&mut inner.departed);
            *inner = fresh;
        }
    }
}

fn remove_from(
    by_ring: &mut HashMap<String, HashSet<ObjectRef<Lease>>>,
    ring: &str,
    reference: &ObjectRef<Lease>,
) {
    if let Some(set) = by_ring.get_mut(ring) {
        set.remove(reference);
        if set.is_empty() {
            by_ring.remove(ring);
        }
    }
}

/// What a shard Lease's membership depends on: its holder, labels (ring, state) and annotations
/// (weight); not `renewTime` nor the load report, so renewals change nothing even when they
/// carry a new report.
fn fingerprint(lease: &Lease) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    lease.metadata.labels.hash(&mut hasher);
    if let Some(annotations) = &lease.metadata.annotations {
        annotations
            .iter()
            .filter(|(key, _)| *key != ANNOTATION_LOAD)
            .for_each(|entry| entry.hash(&mut hasher));
    }
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_ref())
        .hash(&mut hasher);
    hasher.finish()
}

/// Whether the Lease's state label differs from the state its timing gives at `now`.
pub(crate) fn state_label_is_stale(lease: &Lease, now: Timestamp) -> bool {
    let (state, _) = ShardLease::from_lease(lease).evaluate(now);
    lease.labels().get(LABEL_STATE).map(String::as_str) != Some(state.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use kube::api::ObjectMeta;
    use kube::runtime::reflector;

    const KIND: RingKind = RingKind::ClusterRing;

    fn lease(name: &str, ring: &str, state: &str, renewed: Timestamp) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                labels: Some(
                    [
                        (KIND.lease_label().to_string(), ring.to_string()),
                        (LABEL_STATE.to_string(), state.to_string()),
                    ]
                    .into(),
                ),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(name.into()),
                lease_duration_seconds: Some(10),
                renew_time: Some(MicroTime(renewed)),
                acquire_time: Some(MicroTime(renewed)),
                ..Default::default()
            }),
        }
    }

    /// An index with a cache that follows the same events, as the sharder wires them.
    struct Fixture {
        writer: reflector::store::Writer<Lease>,
        index: Arc<LeaseIndex>,
        changes: tokio::sync::broadcast::Receiver<LeaseChange>,
    }

    impl Fixture {
        fn new() -> Self {
            let (store, writer) = reflector::store();
            let hub = Arc::new(Changes::default());
            let changes = hub.lease_changes(KIND);
            let index = LeaseIndex::new(KIND, store, Arc::default(), hub);
            Self {
                writer,
                index,
                changes,
            }
        }

        fn event(&mut self, event: watcher::Event<Lease>, now: Timestamp) -> bool {
            self.writer.apply_watcher_event(&event);
            self.index.observe(&event, now)
        }

        fn drain(&mut self) -> Vec<LeaseChange> {
            std::iter::from_fn(|| self.changes.try_recv().ok()).collect()
        }
    }

    fn names(leases: Vec<Arc<Lease>>) -> Vec<String> {
        let mut names: Vec<_> = leases.iter().map(|l| l.name_any()).collect();
        names.sort();
        names
    }

    #[test]
    fn renewals_change_nothing_and_membership_changes_name_their_rings() {
        let t0 = Timestamp::from_second(1_000_000).unwrap();
        let mut f = Fixture::new();
        for (name, ring) in [("a", "r1"), ("b", "r1"), ("c", "r2")] {
            assert!(f.event(watcher::Event::Apply(lease(name, ring, "ready", t0)), t0));
        }
        assert_eq!(names(f.index.ring_leases("r1")), ["a", "b"]);
        assert_eq!(names(f.index.ring_leases("r2")), ["c"]);
        assert_eq!(f.drain().len(), 3);

        // 100 renewals of a ready Lease, each with a new load report: no change at all.
        let version = f.index.ring_version("r1");
        for i in 1..=100 {
            let at = Timestamp::from_second(1_000_000 + i).unwrap();
            let mut renewed = lease("a", "r1", "ready", at);
            renewed.annotations_mut().insert(
                ANNOTATION_LOAD.into(),
                format!("objects={i},queue={}", i % 7),
            );
            assert!(!f.event(watcher::Event::Apply(renewed), at));
        }
        assert_eq!(f.drain(), []);
        assert_eq!(f.index.ring_version("r1"), version);

        // Moving to another ring names both rings.
        let t1 = Timestamp::from_second(1_000_200).unwrap();
        assert!(f.event(watcher::Event::Apply(lease("a", "r2", "ready", t1)), t1));
        assert_eq!(
            f.drain(),
            [LeaseChange::Membership {
                lease: ObjectRef::new("a").within("ns"),
                rings: vec!["r2".into(), "r1".into()],
            }]
        );
        assert_eq!(names(f.index.ring_leases("r1")), ["b"]);
        assert_eq!(names(f.index.ring_leases("r2")), ["a", "c"]);
        assert_eq!(names(f.index.ring_leases_named("r2", "a")), ["a"]);
        assert!(f.index.ring_leases_named("r1", "a").is_empty(), "left r1");
        assert!(f.index.ring_leases_named("r2", "b").is_empty(), "not in r2");
        let ref_names = |refs: Vec<ObjectRef<Lease>>| -> Vec<String> {
            refs.into_iter().map(|lease| lease.name).collect()
        };
        assert_eq!(ref_names(f.index.ring_lease_refs_named("r2", "a")), ["a"]);
        assert!(
            f.index.ring_lease_refs_named("r1", "a").is_empty(),
            "left r1"
        );
        assert!(
            f.index.ring_lease_refs_named("r2", "b").is_empty(),
            "not in r2"
        );
        assert_ne!(f.index.ring_version("r1"), version);

        // Deleting names the ring it left.
        assert!(f.event(watcher::Event::Delete(lease("b", "r1", "ready", t1)), t1));
        assert_eq!(
            f.drain(),
            [LeaseChange::Membership {
                lease: ObjectRef::new("b").within("ns"),
                rings: vec!["r1".into()],
            }]
        );
        assert!(f.index.ring_leases("r1").is_empty());
    }

    #[test]
    fn a_zero_write_handover_annotation_is_a_change_of_its_ring() {
        use kube_sharding_api::range_lease::{ANNOTATION_ACKNOWLEDGED, ANNOTATION_RANGES};
        let t0 = Timestamp::from_second(1_500_000).unwrap();
        let mut f = Fixture::new();
        let mut current = lease("a", "r1", "ready", t0);
        assert!(f.event(watcher::Event::Apply(current.clone()), t0));
        f.drain();
        // The sharder publishes, the shard acknowledges: each reconciles the ring at once.
        for (key, value) in [(ANNOTATION_RANGES, "1"), (ANNOTATION_ACKNOWLEDGED, "1")] {
            current.annotations_mut().insert(key.into(), value.into());
            assert!(f.event(watcher::Event::Apply(current.clone()), t0), "{key}");
            assert_eq!(
                f.drain(),
                [LeaseChange::Membership {
                    lease: ObjectRef::new("a").within("ns"),
                    rings: vec!["r1".into()],
                }],
                "{key}"
            );
        }
    }

    #[test]
    fn a_held_lease_that_leaves_its_ring_leaves_a_shard_that_may_still_run() {
        let t0 = Timestamp::from_second(3_000_000).unwrap();
        let at = |s: i64| t0.checked_add(SignedDuration::from_secs(s)).unwrap();
        let mut f = Fixture::new();
        for name in ["a", "b", "c"] {
            f.event(watcher::Event::Apply(lease(name, "r1", "ready", t0)), t0);
        }
        // Deleted 5 s after its last renewal (duration 10 s): it may run until 20 s.
        f.event(watcher::Event::Delete(lease("a", "r1", "ready", t0)), at(5));
        // Relabelled to another ring: it may still run for the ring it left.
        f.event(watcher::Event::Apply(lease("b", "r2", "ready", t0)), at(5));
        // Released by the shard itself (marked), then deleted: nothing runs under it.
        let mut released = lease("c", "r1", "dead", t0);
        if let Some(spec) = released.spec.as_mut() {
            spec.holder_identity = Some(String::new());
        }
        released.metadata.annotations =
            Some([(ANNOTATION_RELEASED_BY.to_string(), "c".to_string())].into());
        f.event(watcher::Event::Apply(released.clone()), at(5));
        f.event(watcher::Event::Delete(released), at(5));
        let index = f.index.clone();
        let departed = |ring, s| index.departed_shards(ring, at(s));
        assert_eq!(departed("r1", 6), BTreeSet::from(["a".into(), "b".into()]));
        assert_eq!(departed("r1", 19), BTreeSet::from(["a".into(), "b".into()]));
        assert!(departed("r1", 20).is_empty());
        assert!(departed("r2", 6).is_empty());

        // Deleted after it became uncertain: the sharder would take it over, nothing to wait for.
        f.event(watcher::Event::Apply(lease("d", "r1", "ready", t0)), t0);
        f.event(
            watcher::Event::Delete(lease("d", "r1", "ready", t0)),
            at(25),
        );
        assert!(!departed("r1", 25).contains("d"));
    }

    #[test]
    fn a_holder_emptied_or_changed_without_the_shards_mark_is_a_departure() {
        let t0 = Timestamp::from_second(4_000_000).unwrap();
        let at = |s: i64| t0.checked_add(SignedDuration::from_secs(s)).unwrap();
        let with_holder = |name: &str, holder: &str, mark: Option<&str>| {
            let mut lease = lease(name, "r1", "ready", t0);
            if let Some(spec) = lease.spec.as_mut() {
                spec.holder_identity = Some(holder.into());
            }
            if let Some(mark) = mark {
                lease.metadata.annotations =
                    Some([(ANNOTATION_RELEASED_BY.to_string(), mark.to_string())].into());
            }
            lease
        };
        let mut f = Fixture::new();
        for name in ["a", "b", "c", "d", "e"] {
            f.event(watcher::Event::Apply(lease(name, "r1", "ready", t0)), t0);
        }
        // A third party empties a's holder, hands b's to someone else, and empties c's with a
        // mark that names someone other than the holder.
        f.event(watcher::Event::Apply(with_holder("a", "", None)), at(1));
        f.event(watcher::Event::Apply(with_holder("b", "x", None)), at(1));
        f.event(
            watcher::Event::Apply(with_holder("c", "", Some("x"))),
            at(1),
        );
        // d releases itself, with its mark in the same write.
        f.event(
            watcher::Event::Apply(with_holder("d", "", Some("d"))),
            at(1),
        );
        // e carried its mark while still held (a leftover, or written by someone else first):
        // a later emptying is no release by e.
        f.event(
            watcher::Event::Apply(with_holder("e", "e", Some("e"))),
            at(1),
        );
        f.event(
            watcher::Event::Apply(with_holder("e", "", Some("e"))),
            at(2),
        );
        let departed = |s| f.index.departed_shards("r1", at(s));
        let expected = BTreeSet::from(["a".into(), "b".into(), "c".into(), "e".into()]);
        assert_eq!(departed(2), expected);
        // Until two durations after the last renewal seen (10 s each).
        assert_eq!(departed(19), expected);
        assert!(departed(20).is_empty());

        // After it became uncertain, emptying the holder leaves nothing to wait for.
        let mut late = Fixture::new();
        late.event(watcher::Event::Apply(lease("a", "r1", "ready", t0)), t0);
        late.event(watcher::Event::Apply(with_holder("a", "", None)), at(20));
        assert!(late.index.departed_shards("r1", at(20)).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_end_of_a_departure_is_announced_as_a_membership_change() {
        let now = Timestamp::now();
        let mut f = Fixture::new();
        f.event(watcher::Event::Apply(lease("a", "r1", "ready", now)), now);
        f.drain();
        f.event(watcher::Event::Delete(lease("a", "r1", "ready", now)), now);
        let version = f.index.ring_version("r1");
        assert_eq!(f.drain().len(), 1, "the deletion itself");
        tokio::time::sleep(std::time::Duration::from_secs(21)).await;
        assert_eq!(
            f.drain(),
            [LeaseChange::Membership {
                lease: ObjectRef::new("a").within("ns"),
                rings: vec!["r1".into()],
            }]
        );
        assert_ne!(f.index.ring_version("r1"), version);
        assert!(f.index.departed_shards("r1", Timestamp::now()).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_pending_departure_timer_does_not_keep_the_index_alive() {
        let now = Timestamp::now();
        let mut f = Fixture::new();
        f.event(watcher::Event::Apply(lease("a", "r1", "ready", now)), now);
        f.event(watcher::Event::Delete(lease("a", "r1", "ready", now)), now);
        assert!(
            f.index.departed_shards("r1", now).contains("a"),
            "departing"
        );
        let index = Arc::downgrade(&f.index);
        drop(f);
        assert!(index.upgrade().is_none(), "dropped with its timer pending");
        // The timer fires into nothing.
        tokio::time::sleep(std::time::Duration::from_secs(21)).await;
    }

    #[test]
    fn a_renewal_that_makes_the_state_label_wrong_is_a_state_change() {
        let t0 = Timestamp::from_second(2_000_000).unwrap();
        let mut f = Fixture::new();
        f.event(watcher::Event::Apply(lease("a", "r", "expired", t0)), t0);
        f.drain();
        // Renewed while labelled expired: the label must become ready.
        let t1 = Timestamp::from_second(2_000_001).unwrap();
        assert!(!f.event(watcher::Event::Apply(lease("a", "r", "expired", t1)), t1));
        assert_eq!(
            f.drain(),
            [LeaseChange::State(ObjectRef::new("a").within("ns"))]
        );
    }

    #[test]
    fn a_new_listing_forgets_leases_deleted_while_the_watch_was_down() {
        let t0 = Timestamp::from_second(3_000_000).unwrap();
        let mut f = Fixture::new();
        f.event(watcher::Event::Apply(lease("a", "r", "ready", t0)), t0);
        f.event(watcher::Event::Apply(lease("b", "r", "ready", t0)), t0);
        f.drain();
        // The watch restarts and lists only "b".
        f.event(watcher::Event::Init, t0);
        f.event(watcher::Event::InitApply(lease("b", "r", "ready", t0)), t0);
        assert!(f.event(watcher::Event::InitDone, t0));
        assert_eq!(names(f.index.ring_leases("r")), ["b"]);
        assert_eq!(f.drain().last(), Some(&LeaseChange::All));
    }
}
