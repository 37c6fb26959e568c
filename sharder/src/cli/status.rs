//! `kubectl sharding status [RING]`: every ring (or one) with its readiness, its shards with their
//! Lease states and weights, where its objects are per shard and resource, which are being
//! drained or wait for an assignment, and how evenly the available shards are loaded.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::ObjectMeta;
use kube_sharding_api::lease::ShardLease;
use kube_sharding_api::{Assignment, GroupResource, HashKey, RingKind, RingRef};
use serde::Serialize;

use super::cluster::{self, Connection, LoadedRing, SelectorSource};
use super::output::{Table, age, imbalance, or_dash, ratio};
#[cfg(test)]
use super::ranges::percent;
use super::ranges::{
    MemberRanges, NamespacePin, RingRanges, is_server_side, member_ranges, object_hash,
};
use super::resources::Catalog;
use super::{Error, ring_not_found};
use crate::core::key::KeyOutcome;
use crate::core::membership::{ring_members, shards_of};
use crate::metrics::load::{RingLoad, sum_loads};
use crate::views::RingView;
use kube_sharding_api::load::{LoadKey, ShardLoad};

/// What `status` prints.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct StatusReport {
    /// The namespace objects were counted in, when restricted with `-n`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) namespace: Option<String>,
    /// Every ring asked for, by kind and name.
    pub(crate) rings: Vec<RingStatus>,
}

/// One ring.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RingStatus {
    /// `ClusterRing` or `ControllerRing`.
    pub(crate) kind: &'static str,
    /// The ring's name.
    pub(crate) name: String,
    /// Status of its `Ready` condition: `True`, `False` or `Unknown`.
    pub(crate) ready: String,
    /// Message of a `Ready` condition that is not `True`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ready_message: Option<String>,
    /// `status.shards`: Leases of the ring in any state.
    pub(crate) shards: i32,
    /// `status.availableShards`.
    pub(crate) available_shards: i32,
    /// What objects are hashed by.
    pub(crate) hash_key: &'static str,
    /// Who labels new objects: `Webhook` or `Watch` (`spec.assignment`).
    pub(crate) assignment: &'static str,
    /// The namespaces the ring covers.
    pub(crate) namespace_selector: LabelSelector,
    /// Where that selector comes from.
    pub(crate) namespace_selector_source: SelectorSource,
    /// The ring's resources the API server serves, e.g. `secrets`, `deployments.apps`.
    pub(crate) resources: Vec<String>,
    /// The ring's resources the API server does not serve (yet).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) unresolved_resources: Vec<String>,
    /// Why the sharder does not act on the ring, if it does not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) invalid: Option<String>,
    /// For a ring with controlled resources: whether it has available shards and every one of
    /// them says on its Lease that it leaves its controlled objects to the sharder
    /// (docs/protocol.md §17), so that the sharder moves them itself, right after their
    /// controllers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) shards_leave_controlled_objects: Option<bool>,
    /// Every shard: each Lease of the ring, then shard names objects carry without a Lease.
    pub(crate) members: Vec<ShardStatus>,
    /// The ring's objects without a shard label.
    pub(crate) unassigned: Unassigned,
    /// Sums over the ring's objects.
    pub(crate) totals: Totals,
    /// `max / mean` of the objects per available shard.
    pub(crate) imbalance: Option<f64>,
    /// The load its available shards report on their Leases, summed (docs/protocol.md §23).
    pub(crate) load: RingLoad,
    /// For a `ServerSide` ring: its range generation, the hashed field, whether a handover is
    /// pending and its namespace pins. Its objects are then counted by the published ranges
    /// holding their hash: `members[].objects` are in the shard's ranges, `unassigned` in no
    /// shard's, and `members[].wanted` in its target.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ranges: Option<RingRangesStatus>,
}

/// The ranges of a `ServerSide` ring.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RingRangesStatus {
    /// The field hashed with 64-bit FNV-1a: `object.metadata.uid` or `object.metadata.namespace`.
    pub(crate) field: &'static str,
    /// `status.rangeGeneration`: the ring's latest published generation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) range_generation: Option<u64>,
    /// Whether some shard has not acknowledged its publication or holds other ranges than its
    /// target.
    pub(crate) handover_pending: bool,
    /// Namespace pins of a ring hashing namespaces.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) pinned_namespaces: Vec<NamespacePin>,
    /// Namespaces carrying the ring's pin on a ring hashing uids, where pins cannot work.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) ignored_namespace_pins: Vec<String>,
}

/// One shard of a ring.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ShardStatus {
    /// Shard name.
    pub(crate) name: String,
    /// Namespace of its Lease; `None` when objects name a shard that has no Lease.
    pub(crate) namespace: Option<String>,
    /// Its state (docs/protocol.md §4) now; `None` without a Lease.
    pub(crate) state: Option<&'static str>,
    /// The Lease's holder.
    pub(crate) holder: Option<String>,
    /// The Lease's last renewal.
    pub(crate) renew_time: Option<Timestamp>,
    /// The weight it takes part with.
    pub(crate) weight: u32,
    /// What is wrong with its weight annotation, if anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) weight_error: Option<String>,
    /// Whether its Lease says it leaves its controlled objects to the sharder.
    pub(crate) leaves_controlled_objects: bool,
    /// What is wrong with that annotation, if anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) leaves_error: Option<String>,
    /// Whether it receives objects.
    pub(crate) available: bool,
    /// Why its Lease is kept out of the ring whatever its holder, if it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) excluded: Option<&'static str>,
    /// Objects carrying its name in the shard label, per resource.
    pub(crate) objects: BTreeMap<String, usize>,
    /// Sum of `objects`.
    pub(crate) total: usize,
    /// Of those, objects carrying the drain label.
    pub(crate) draining: usize,
    /// Objects the ring wants on this shard now.
    pub(crate) wanted: usize,
    /// The load its Lease reports, when valid (docs/protocol.md §23).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) load: Option<LoadReport>,
    /// What is wrong with its load report, if anything (it counts as none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) load_error: Option<String>,
    /// On a `ServerSide` ring: its published ranges, acknowledgement and target.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ranges: Option<MemberRanges>,
}

/// A shard's load report, each signal only when the shard reports it.
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct LoadReport {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) objects: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) queue: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) p50_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) p99_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) errors: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) window_seconds: Option<u64>,
}

impl From<&ShardLoad> for LoadReport {
    fn from(load: &ShardLoad) -> Self {
        Self {
            objects: load.get(LoadKey::Objects),
            queue: load.get(LoadKey::Queue),
            p50_ms: load.get(LoadKey::P50Millis),
            p99_ms: load.get(LoadKey::P99Millis),
            errors: load.get(LoadKey::Errors),
            window_seconds: load.get(LoadKey::WindowSeconds),
        }
    }
}

/// The ring's objects without a shard label.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Unassigned {
    /// Per resource.
    pub(crate) objects: BTreeMap<String, usize>,
    /// All of them.
    pub(crate) total: usize,
    /// Those the ring would assign: the webhook or the sharder has yet to.
    pub(crate) waiting_for_sharder: usize,
    /// Those the ring never assigns: controlled objects without an eligible controller.
    pub(crate) not_sharded: usize,
    /// Those with a key while the ring has no available shard.
    pub(crate) no_available_shard: usize,
}

/// Sums over a ring's objects.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Totals {
    /// Objects of the ring's resources in the namespaces it covers.
    pub(crate) objects: usize,
    /// Objects with a shard label.
    pub(crate) assigned: usize,
    /// Objects with the drain label.
    pub(crate) draining: usize,
    /// Objects without a shard label.
    pub(crate) unassigned: usize,
    /// Assigned objects not on the shard the ring wants now (drains and moves to come).
    pub(crate) misplaced: usize,
}

/// Counts of one ring's objects, fed one object at a time.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// Per shard label value, objects per resource.
    assigned: BTreeMap<String, BTreeMap<String, usize>>,
    /// Per shard label value, objects with the drain label.
    draining: BTreeMap<String, usize>,
    /// Per shard, objects the ring wants there.
    wanted: BTreeMap<String, usize>,
    unassigned: Unassigned,
    misplaced: usize,
    objects: usize,
}

impl Tally {
    /// Counts one object of resource `gr` of the ring of `view`; the caller has checked that the
    /// ring covers the object's namespace.
    pub(crate) fn observe(&mut self, view: &RingView, gr: &GroupResource, meta: &ObjectMeta) {
        let Some(resource) = view.resources.get(gr) else {
            return;
        };
        let placement = view.placement(&gr.group, resource, meta);
        self.objects += 1;
        if let Some(desired) = placement.desired {
            *self.wanted.entry(desired.to_string()).or_default() += 1;
        }
        let Some(current) = placement.object.current else {
            let unassigned = &mut self.unassigned;
            *unassigned.objects.entry(gr.to_string()).or_default() += 1;
            unassigned.total += 1;
            match (&placement.key, placement.desired) {
                (Ok(KeyOutcome::Key(_)), Some(_)) => unassigned.waiting_for_sharder += 1,
                (Ok(KeyOutcome::Key(_)), None) => unassigned.no_available_shard += 1,
                _ => unassigned.not_sharded += 1,
            }
            return;
        };
        *self
            .assigned
            .entry(current.to_string())
            .or_default()
            .entry(gr.to_string())
            .or_default() += 1;
        if placement.object.draining {
            *self.draining.entry(current.to_string()).or_default() += 1;
        }
        if placement.desired.is_some_and(|desired| desired != current) {
            self.misplaced += 1;
        }
    }

    /// Counts one object of resource `gr` of a `ServerSide` ring, held by the published ranges of
    /// `held_by` and given by the target to `wanted`.
    pub(crate) fn observe_ranges(
        &mut self,
        gr: &GroupResource,
        held_by: Option<&str>,
        wanted: Option<&str>,
    ) {
        self.objects += 1;
        if let Some(wanted) = wanted {
            *self.wanted.entry(wanted.to_string()).or_default() += 1;
        }
        let Some(held_by) = held_by else {
            let unassigned = &mut self.unassigned;
            *unassigned.objects.entry(gr.to_string()).or_default() += 1;
            unassigned.total += 1;
            if wanted.is_some() {
                unassigned.waiting_for_sharder += 1;
            } else {
                unassigned.no_available_shard += 1;
            }
            return;
        };
        *self
            .assigned
            .entry(held_by.to_string())
            .or_default()
            .entry(gr.to_string())
            .or_default() += 1;
        if wanted != Some(held_by) {
            self.misplaced += 1;
        }
    }

    /// The counts of objects labelled for `shard`: per resource, total, draining, wanted.
    fn shard(&self, shard: &str) -> (BTreeMap<String, usize>, usize, usize, usize) {
        let objects = self.assigned.get(shard).cloned().unwrap_or_default();
        let total = objects.values().sum();
        let draining = self.draining.get(shard).copied().unwrap_or(0);
        let wanted = self.wanted.get(shard).copied().unwrap_or(0);
        (objects, total, draining, wanted)
    }
}

/// The status of `ring` at `now` from its Leases and the tally of its objects.
pub(crate) fn ring_status(ring: &LoadedRing, tally: Tally, now: Timestamp) -> RingStatus {
    let RingRef { kind, name } = ring.ring.ring_ref();
    let view = &ring.view;
    let ring_members = ring_members(
        kind,
        &name,
        &ring.ring.spec().lease_namespaces,
        &ring.leases,
    );
    let shards_leave_controlled_objects = view
        .resources
        .values()
        .any(|r| !r.is_main())
        .then(|| shards_of(&ring_members).leave_controlled_objects);
    let mut loads = Vec::new();
    let mut members: Vec<ShardStatus> = ring_members
        .into_iter()
        .map(|member| {
            let lease = ShardLease::from_lease(member.lease);
            let shard = member.lease.name_any();
            let load = ShardLoad::from_annotations(member.lease.annotations());
            let valid_load = load.as_ref().and_then(|l| l.as_ref().ok());
            loads.push((member.is_available(), valid_load.copied()));
            let (objects, total, draining, wanted) = tally.shard(&shard);
            let ranges = ring.ranges.as_ref().map(|ranges| {
                let target = ranges.target.get(&shard).filter(|_| member.is_available());
                member_ranges(member.lease, target)
            });
            ShardStatus {
                ranges,
                namespace: member.lease.namespace(),
                state: Some(lease.state(now).as_str()),
                holder: lease.holder_identity.map(str::to_string),
                renew_time: lease.renew_time,
                weight: member.weight,
                weight_error: member.weight_error.clone(),
                leaves_controlled_objects: member.leaves_controlled_objects,
                leaves_error: member.leaves_error.clone(),
                available: member.is_available(),
                excluded: member.exclusion.as_ref().map(|e| e.reason()),
                objects,
                total,
                draining,
                wanted,
                load: valid_load.map(LoadReport::from),
                load_error: load.and_then(Result::err).map(|e| e.to_string()),
                name: shard,
            }
        })
        .collect();
    // Objects may name shards whose Lease is gone; they are moved on the next sync.
    for shard in tally.assigned.keys() {
        if members.iter().any(|m| &m.name == shard) {
            continue;
        }
        let (objects, total, draining, wanted) = tally.shard(shard);
        members.push(ShardStatus {
            name: shard.clone(),
            namespace: None,
            state: None,
            holder: None,
            renew_time: None,
            weight: 0,
            weight_error: None,
            leaves_controlled_objects: false,
            leaves_error: None,
            available: false,
            excluded: None,
            objects,
            total,
            draining,
            wanted,
            load: None,
            load_error: None,
            ranges: None,
        });
    }
    let load = sum_loads(loads.iter().map(|(available, l)| (*available, l.as_ref())));
    members.sort_by(|a, b| (&a.name, &a.namespace).cmp(&(&b.name, &b.namespace)));

    let available: Vec<usize> = view
        .hash_ring
        .members()
        .map(|(shard, _)| tally.shard(shard).1)
        .collect();
    let status = ring.ring.status();
    let condition = status.and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == kube_sharding_api::cluster_ring::CONDITION_READY)
    });
    let ready = condition.map_or_else(|| "Unknown".to_string(), |c| c.status.clone());
    let mut resources: Vec<(bool, String)> = view
        .resources
        .iter()
        .map(|(gr, r)| (!r.is_main(), gr.to_string()))
        .collect();
    resources.sort();
    let ranges = ring.ranges.as_ref().map(|ranges| RingRangesStatus {
        field: ranges.field.path(),
        range_generation: status.and_then(|s| s.range_generation),
        handover_pending: members
            .iter()
            .any(|m| m.ranges.as_ref().is_some_and(|r| r.pending.is_some())),
        pinned_namespaces: ranges.pins.clone(),
        ignored_namespace_pins: ranges.ignored_pins.clone(),
    });
    RingStatus {
        ranges,
        kind: kind.kind(),
        name,
        ready_message: condition
            .filter(|c| c.status != "True")
            .map(|c| c.message.clone()),
        ready,
        shards: status.map_or(0, |s| s.shards),
        available_shards: status.map_or(0, |s| s.available_shards),
        hash_key: hash_key_name(view.hash_key),
        assignment: assignment_name(view.assignment),
        namespace_selector: view.namespace_selector.clone(),
        namespace_selector_source: ring.selector_source,
        resources: resources.into_iter().map(|(_, gr)| gr).collect(),
        unresolved_resources: view.unresolved.iter().map(ToString::to_string).collect(),
        invalid: ring.invalid.clone(),
        shards_leave_controlled_objects,
        members,
        imbalance: imbalance(available),
        totals: Totals {
            objects: tally.objects,
            assigned: tally.objects - tally.unassigned.total,
            draining: tally.draining.values().sum(),
            unassigned: tally.unassigned.total,
            misplaced: tally.misplaced,
        },
        unassigned: tally.unassigned,
        load,
    }
}

/// The name of a hash key setting, as written in the spec.
pub(crate) fn hash_key_name(hash_key: HashKey) -> &'static str {
    match hash_key {
        HashKey::Object => "Object",
        HashKey::Namespace => "Namespace",
    }
}

/// The name of an assignment mode, as written in the spec.
pub(crate) fn assignment_name(assignment: Assignment) -> &'static str {
    match assignment {
        Assignment::Webhook => "Webhook",
        Assignment::Watch => "Watch",
        Assignment::ServerSide => "ServerSide",
    }
}

/// Reads the rings and their objects and reports them.
pub(crate) async fn run(
    connection: &Connection,
    name: Option<&str>,
    kind: Option<RingKind>,
    namespace: Option<&str>,
) -> Result<StatusReport, Error> {
    let client = &connection.client;
    let kinds = kind.map_or_else(|| RingKind::ALL.to_vec(), |k| vec![k]);
    let rings = cluster::rings(client, &kinds, name).await?;
    if let (Some(name), true) = (name, rings.is_empty()) {
        return Err(ring_not_found(name, kind));
    }
    let mut report = StatusReport {
        namespace: namespace.map(str::to_string),
        rings: Vec::new(),
    };
    if rings.is_empty() {
        return Ok(report);
    }
    let catalog = Catalog::discover(client).await?;
    let mut loaded = cluster::load_rings(client, rings, &catalog.infos()).await?;
    let namespaces = cluster::namespaces(client, namespace).await?;
    // The target of a ServerSide ring hashing namespaces depends on the pins of every namespace.
    cluster::give_pins(&mut loaded, &namespaces);
    if namespace.is_some() && loaded.iter().any(is_server_side) {
        let all = cluster::namespaces(client, None).await?;
        for ring in loaded.iter_mut().filter(|ring| is_server_side(ring)) {
            ring.ranges = Some(RingRanges::new(ring, &all.pin_annotations));
        }
    }
    let mut tallies: Vec<Tally> = loaded.iter().map(|_| Tally::default()).collect();
    cluster::walk_objects(
        client,
        &loaded,
        namespace,
        &namespaces.labels,
        |index, gr, meta| {
            let ring = &loaded[index];
            match &ring.ranges {
                Some(ranges) => {
                    let hash = object_hash(ranges.field, meta).map(|(_, hash)| hash);
                    tallies[index].observe_ranges(
                        gr,
                        hash.and_then(|h| ranges.holder(h)).map(|(shard, ..)| shard),
                        hash.and_then(|h| ranges.wanted(h)),
                    );
                }
                None => tallies[index].observe(&ring.view, gr, meta),
            }
        },
    )
    .await?;
    let now = Timestamp::now();
    report.rings = loaded
        .iter()
        .zip(tallies)
        .map(|(ring, tally)| ring_status(ring, tally, now))
        .collect();
    Ok(report)
}

/// The report as text: per ring a headline, a table of shards and a summary.
pub(crate) fn table(report: &StatusReport) -> String {
    table_at(report, Timestamp::now())
}

fn table_at(report: &StatusReport, now: Timestamp) -> String {
    if report.rings.is_empty() {
        return "No ClusterRings or ControllerRings found.\n".into();
    }
    let mut text = String::new();
    if let Some(ns) = &report.namespace {
        text.push_str(&format!("Counting objects in namespace {ns} only.\n\n"));
    }
    for (i, ring) in report.rings.iter().enumerate() {
        if i > 0 {
            text.push('\n');
        }
        text.push_str(&ring_table(ring, now));
    }
    text
}

fn ring_table(ring: &RingStatus, now: Timestamp) -> String {
    let mut text = format!(
        "{} {}: Ready={}, {} shards, {} available, hashKey {}, assignment {}\n",
        ring.kind,
        ring.name,
        ring.ready,
        ring.shards,
        ring.available_shards,
        ring.hash_key,
        ring.assignment
    );
    if let Some(ranges) = &ring.ranges {
        text.insert_str(
            text.len() - 1,
            &format!(", rangeGeneration {}", or_dash(ranges.range_generation)),
        );
    }
    if let Some(message) = &ring.ready_message {
        text.push_str(&format!("  not ready: {message}\n"));
    }
    if let Some(invalid) = &ring.invalid {
        text.push_str(&format!(
            "  the sharder does not act on this ring: {invalid}\n"
        ));
    }
    if !ring.unresolved_resources.is_empty() {
        text.push_str(&format!(
            "  not served by the API server: {}\n",
            ring.unresolved_resources.join(", ")
        ));
    }
    if let Some(line) = controlled_objects_line(ring) {
        text.push_str(&line);
    }
    if let Some(ranges) = &ring.ranges {
        text.push_str(&ranges_table(ring, ranges, now));
        text.push_str(&load_table(ring));
        return text;
    }
    let mut header: Vec<String> = ["SHARD", "NAMESPACE", "STATE", "HOLDER", "RENEWED", "WEIGHT"]
        .map(String::from)
        .into();
    header.extend(ring.resources.iter().map(|r| r.to_uppercase()));
    header.extend(["TOTAL", "DRAINING", "WANTED", "NOTE"].map(String::from));
    let mut table = Table::new(header);
    for shard in &ring.members {
        let mut row = vec![
            shard.name.clone(),
            or_dash(shard.namespace.as_ref()),
            shard.state.unwrap_or("no Lease").to_string(),
            or_dash(shard.holder.as_ref().filter(|h| !h.is_empty())),
            or_dash(shard.renew_time.map(|t| age(t, now))),
            if shard.namespace.is_some() {
                shard.weight.to_string()
            } else {
                "-".into()
            },
        ];
        row.extend(
            ring.resources
                .iter()
                .map(|r| shard.objects.get(r).copied().unwrap_or(0).to_string()),
        );
        row.extend([
            shard.total.to_string(),
            shard.draining.to_string(),
            shard.wanted.to_string(),
            shard_note(shard),
        ]);
        table.row(row);
    }
    let mut unassigned = vec![
        "(unassigned)".to_string(),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
    ];
    unassigned.extend(ring.resources.iter().map(|r| {
        ring.unassigned
            .objects
            .get(r)
            .copied()
            .unwrap_or(0)
            .to_string()
    }));
    unassigned.push(ring.unassigned.total.to_string());
    table.row(unassigned);
    text.push_str(&table.render("  "));
    let t = &ring.totals;
    let u = &ring.unassigned;
    text.push_str(&format!(
        "  {} objects: {} assigned ({} not where the ring wants them, {} draining), {} unassigned ({} waiting for the sharder, {} not sharded, {} for lack of an available shard)\n",
        t.objects,
        t.assigned,
        t.misplaced,
        t.draining,
        t.unassigned,
        u.waiting_for_sharder,
        u.not_sharded,
        u.no_available_shard,
    ));
    text.push_str(&format!(
        "  imbalance (max/mean objects per available shard): {}\n",
        ratio(ring.imbalance)
    ));
    text.push_str(&load_table(ring));
    text
}

/// The shards of a `ServerSide` ring with their published ranges, acknowledgements and targets,
/// the objects in each shard's ranges, and the handover's state.
fn ranges_table(ring: &RingStatus, ranges: &RingRangesStatus, now: Timestamp) -> String {
    let mut header: Vec<String> = [
        "SHARD",
        "NAMESPACE",
        "STATE",
        "HOLDER",
        "RENEWED",
        "WEIGHT",
        "GENERATION",
        "ACKNOWLEDGED",
        "RANGES",
        "SHARE",
        "TARGET",
    ]
    .map(String::from)
    .into();
    header.extend(ring.resources.iter().map(|r| r.to_uppercase()));
    header.extend(["TOTAL", "WANTED", "NOTE"].map(String::from));
    let mut table = Table::new(header);
    let share = |percent: f64| format!("{percent:.2}%");
    for shard in &ring.members {
        let r = shard.ranges.as_ref();
        let mut row = vec![
            shard.name.clone(),
            or_dash(shard.namespace.as_ref()),
            shard.state.unwrap_or("no Lease").to_string(),
            or_dash(shard.holder.as_ref().filter(|h| !h.is_empty())),
            or_dash(shard.renew_time.map(|t| age(t, now))),
            shard.weight.to_string(),
            or_dash(r.and_then(|r| r.generation)),
            or_dash(r.and_then(|r| r.acknowledged)),
            or_dash(r.map(|r| r.ranges)),
            or_dash(r.map(|r| share(r.share_percent))),
            or_dash(r.map(|r| share(r.target_share_percent))),
        ];
        row.extend(
            ring.resources
                .iter()
                .map(|r| shard.objects.get(r).copied().unwrap_or(0).to_string()),
        );
        row.push(shard.total.to_string());
        row.push(shard.wanted.to_string());
        let mut notes = vec![shard_note(shard)];
        if let Some(error) = r.and_then(|r| r.error.as_ref()) {
            notes.push(error.clone());
        }
        if let Some(pending) = r.and_then(|r| r.pending.as_ref()) {
            notes.push(format!("pending: {pending}"));
        }
        notes.retain(|n| !n.is_empty());
        row.push(notes.join("; "));
        table.row(row);
    }
    let mut outside = vec!["(no shard's ranges)".to_string()];
    outside.extend(std::iter::repeat_n(String::new(), 10));
    outside.extend(ring.resources.iter().map(|r| {
        ring.unassigned
            .objects
            .get(r)
            .copied()
            .unwrap_or(0)
            .to_string()
    }));
    outside.push(ring.unassigned.total.to_string());
    table.row(outside);
    let mut text = table.render("  ");
    let t = &ring.totals;
    let u = &ring.unassigned;
    text.push_str(&format!(
        "  {} objects: {} in a shard's published ranges ({} not in the shard the target gives them), {} in no shard's ranges ({} waiting for a grant, {} for lack of an available shard)\n",
        t.objects, t.assigned, t.misplaced, t.unassigned, u.waiting_for_sharder, u.no_available_shard,
    ));
    text.push_str(&format!(
        "  ranges of 64-bit FNV-1a of {}: {}\n",
        ranges.field,
        if ranges.handover_pending {
            "handover pending (see the shards' notes)"
        } else {
            "settled: every shard holds its target and acknowledged it"
        }
    ));
    for pin in &ranges.pinned_namespaces {
        text.push_str(&format!(
            "  namespace {} pinned to {} (hash {}): {}\n",
            pin.namespace, pin.shard, pin.hash, pin.state
        ));
    }
    if !ranges.ignored_namespace_pins.is_empty() {
        text.push_str(&format!(
            "  pins of namespaces {} are ignored: a ring hashing uids spreads a namespace over the whole hash space\n",
            ranges.ignored_namespace_pins.join(", ")
        ));
    }
    text.push_str(&format!(
        "  imbalance (max/mean objects per available shard): {}\n",
        ratio(ring.imbalance)
    ));
    text
}

/// What the shards report about their load (docs/protocol.md §23): the ring's sums and a row
/// per shard with a report; nothing when no shard reports.
fn load_table(ring: &RingStatus) -> String {
    let reporting: Vec<&ShardStatus> = ring
        .members
        .iter()
        .filter(|m| m.load.is_some() || m.load_error.is_some())
        .collect();
    if reporting.is_empty() {
        return String::new();
    }
    let l = &ring.load;
    let millis = |ms: Option<u64>| or_dash(ms.map(|ms| format!("{ms}ms")));
    let mut text = format!(
        "  load reported by {} of {} available shards: {} objects, {} queued, max p99 {}, {} errors\n",
        l.reporting_shards,
        l.available_shards,
        l.objects,
        l.queue_depth,
        millis(l.max_p99_ms),
        l.errors,
    );
    let mut table = Table::new(vec![
        "SHARD", "OBJECTS", "QUEUE", "P50", "P99", "ERRORS", "WINDOW", "NOTE",
    ]);
    for shard in reporting {
        let report = shard.load.as_ref();
        let value = |f: fn(&LoadReport) -> Option<u64>| or_dash(report.and_then(f));
        let mut notes = Vec::new();
        if let Some(error) = &shard.load_error {
            notes.push(format!("invalid report, counts as none: {error}"));
        }
        if !shard.available {
            notes.push("not available, not counted".to_string());
        }
        table.row(vec![
            shard.name.clone(),
            value(|r| r.objects),
            value(|r| r.queue),
            millis(report.and_then(|r| r.p50_ms)),
            millis(report.and_then(|r| r.p99_ms)),
            value(|r| r.errors),
            or_dash(
                report
                    .and_then(|r| r.window_seconds)
                    .map(|s| format!("{s}s")),
            ),
            notes.join("; "),
        ]);
    }
    text.push_str(&table.render("  "));
    text
}

/// Who moves a ring's controlled objects, when any of its available shards leaves them to the
/// sharder; nothing when none does (their shards relabel them, the common case).
fn controlled_objects_line(ring: &RingStatus) -> Option<String> {
    let leave = ring.shards_leave_controlled_objects?;
    let available = ring.members.iter().filter(|m| m.available);
    let saying = available
        .clone()
        .filter(|m| m.leaves_controlled_objects)
        .count();
    if leave {
        Some(
            "  controlled objects: every available shard leaves them to the sharder, which moves each right after its controller\n"
                .to_string(),
        )
    } else if saying > 0 {
        Some(format!(
            "  controlled objects: {saying} of {} available shards leave them to the sharder; the ring is synced as leaving them only when all do\n",
            available.count()
        ))
    } else {
        None
    }
}

/// Why a shard row needs a second look: exclusion, a bad annotation, unavailability.
fn shard_note(shard: &ShardStatus) -> String {
    let mut notes = Vec::new();
    if let Some(reason) = shard.excluded {
        notes.push(format!("excluded: {reason}"));
    }
    if shard.weight_error.is_some() {
        notes.push("invalid weight, counts as 1".to_string());
    }
    if shard.leaves_error.is_some() {
        notes.push("invalid leaves-controlled-objects, counts as false".to_string());
    }
    if shard.namespace.is_none() {
        notes.push("objects name a shard without a Lease".to_string());
    } else if !shard.available && shard.excluded.is_none() {
        notes.push("not available".to_string());
    }
    notes.join("; ")
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{lease, loaded, names_on, now, object};
    use super::*;

    #[test]
    fn counts_objects_per_shard_resource_and_situation() {
        let ring = loaded(vec![
            lease("a", "a", 1, None),
            lease("b", "b", 20, Some("3")),
            lease("dead", "", 5, None),
        ]);
        let view = &ring.view;
        let (shard, drain) = (view.shard_label.clone(), view.drain_label.clone());
        let secrets = GroupResource::new("", "secrets");
        let configmaps = GroupResource::new("", "configmaps");
        let (for_a, for_b) = (names_on(view, "a", 1), names_on(view, "b", 2));
        let mut tally = Tally::default();
        let observe = |tally: &mut Tally, gr: &GroupResource, meta: ObjectMeta| {
            tally.observe(view, gr, &meta);
        };
        // In place on a; in place on b but asked to drain (a stale drain label);
        // on a but wanted on b and draining; on the dead shard; on a shard without a Lease.
        observe(
            &mut tally,
            &secrets,
            object(&for_a[0], &[(&shard, "a")], None),
        );
        observe(
            &mut tally,
            &secrets,
            object(&for_b[0], &[(&shard, "b"), (&drain, "true")], None),
        );
        observe(
            &mut tally,
            &secrets,
            object(&for_b[1], &[(&shard, "a"), (&drain, "true")], None),
        );
        observe(&mut tally, &secrets, object("x", &[(&shard, "dead")], None));
        observe(&mut tally, &secrets, object("y", &[(&shard, "gone")], None));
        // Unassigned: a Secret (waiting), a ConfigMap without a controller (not sharded), and a
        // ConfigMap of a Secret (waiting).
        observe(&mut tally, &secrets, object("z", &[], None));
        observe(&mut tally, &configmaps, object("orphan", &[], None));
        observe(
            &mut tally,
            &configmaps,
            object("child", &[], Some(&for_a[0])),
        );

        let status = ring_status(&ring, tally, now());
        let names: Vec<(&str, Option<&str>)> = status
            .members
            .iter()
            .map(|m| (m.name.as_str(), m.state))
            .collect();
        assert_eq!(
            names,
            [
                ("a", Some("ready")),
                ("b", Some("expired")),
                ("dead", Some("dead")),
                ("gone", None)
            ]
        );
        let a = &status.members[0];
        assert_eq!(a.objects.get("secrets"), Some(&2));
        assert_eq!((a.total, a.draining), (2, 1));
        assert!(a.available);
        let b = &status.members[1];
        assert_eq!((b.weight, b.total, b.draining), (3, 1, 1));
        assert!(!status.members[2].available);
        assert_eq!(status.totals.objects, 8);
        assert_eq!(status.totals.assigned, 5);
        assert_eq!(status.totals.draining, 2);
        // Wanted elsewhere: the draining Secret on a, the ones on "dead" and "gone".
        assert_eq!(status.totals.misplaced, 3);
        assert_eq!(status.unassigned.total, 3);
        assert_eq!(status.unassigned.waiting_for_sharder, 2);
        assert_eq!(status.unassigned.not_sharded, 1);
        assert_eq!(status.unassigned.objects.get("configmaps"), Some(&2));
        // Available shards a (2 objects) and b (1): max 2 over mean 1.5.
        let imbalance = status.imbalance.expect("imbalance");
        assert!((imbalance - 4.0 / 3.0).abs() < 1e-9, "{imbalance}");
        assert_eq!(status.resources, ["secrets", "configmaps"]);
    }

    #[test]
    fn without_available_shards_keyed_objects_wait_for_one() {
        let ring = loaded(vec![lease("dead", "", 5, None)]);
        let mut tally = Tally::default();
        tally.observe(
            &ring.view,
            &GroupResource::new("", "secrets"),
            &object("s", &[], None),
        );
        let status = ring_status(&ring, tally, now());
        assert_eq!(status.unassigned.no_available_shard, 1);
        assert_eq!(status.imbalance, None);
    }

    /// `lease` with the annotation saying whether its shard leaves its controlled objects.
    fn leaving(
        mut lease: k8s_openapi::api::coordination::v1::Lease,
        value: &str,
    ) -> k8s_openapi::api::coordination::v1::Lease {
        lease.metadata.annotations.get_or_insert_default().insert(
            kube_sharding_api::labels::ANNOTATION_LEAVES_CONTROLLED_OBJECTS.to_string(),
            value.to_string(),
        );
        lease
    }

    #[test]
    fn says_who_moves_controlled_objects_when_shards_leave_them_to_the_sharder() {
        let status = |leases| {
            let report = StatusReport {
                namespace: None,
                rings: vec![ring_status(&loaded(leases), Tally::default(), now())],
            };
            (
                report.rings[0].shards_leave_controlled_objects,
                table_at(&report, now()),
            )
        };
        let line = "  controlled objects: ";

        let (leave, text) = status(vec![
            leaving(lease("a", "a", 3, None), "true"),
            leaving(lease("b", "b", 3, None), "true"),
        ]);
        assert_eq!(leave, Some(true));
        assert!(
            text.contains(&format!("{line}every available shard leaves them to the sharder, which moves each right after its controller\n")),
            "{text}"
        );

        // One of two; the other says something the protocol does not know.
        let (leave, text) = status(vec![
            leaving(lease("a", "a", 3, None), "true"),
            leaving(lease("b", "b", 3, None), "yes"),
        ]);
        assert_eq!(leave, Some(false));
        assert!(
            text.contains(&format!("{line}1 of 2 available shards leave them to the sharder; the ring is synced as leaving them only when all do\n")),
            "{text}"
        );
        let b = text
            .lines()
            .find(|l| l.trim_start().starts_with("b "))
            .unwrap_or_default();
        assert!(
            b.ends_with("invalid leaves-controlled-objects, counts as false"),
            "{b}"
        );

        // None says so: nothing to say, as for shards written before the annotation.
        let (leave, text) = status(vec![lease("a", "a", 3, None)]);
        assert_eq!(leave, Some(false));
        assert!(!text.contains(line), "{text}");
        // A shard that is not available (its Lease released) does not count.
        let (leave, _) = status(vec![
            leaving(lease("a", "a", 3, None), "true"),
            leaving(lease("b", "", 3, None), "false"),
        ]);
        assert_eq!(leave, Some(true));
    }

    #[test]
    fn table_lists_shards_and_sums() {
        let ring = loaded(vec![
            lease("a", "a", 3, None),
            lease("b", "b", 3, Some("eleven")),
        ]);
        let shard = ring.view.shard_label.clone();
        let name = &names_on(&ring.view, "a", 1)[0];
        let mut tally = Tally::default();
        tally.observe(
            &ring.view,
            &GroupResource::new("", "secrets"),
            &object(name, &[(&shard, "a")], None),
        );
        let report = StatusReport {
            namespace: None,
            rings: vec![ring_status(&ring, tally, now())],
        };
        let text = table_at(&report, now());
        let expected = "\
ClusterRing r: Ready=Unknown, 0 shards, 0 available, hashKey Object, assignment Webhook
  SHARD          NAMESPACE   STATE   HOLDER   RENEWED   WEIGHT   SECRETS   CONFIGMAPS   TOTAL   DRAINING   WANTED   NOTE
  a              shards      ready   a        3s        1        1         0            1       0          1
  b              shards      ready   b        3s        1        0         0            0       0          0        invalid weight, counts as 1
  (unassigned)                                                   0         0            0
  1 objects: 1 assigned (0 not where the ring wants them, 0 draining), 0 unassigned (0 waiting for the sharder, 0 not sharded, 0 for lack of an available shard)
  imbalance (max/mean objects per available shard): 2.00
";
        assert_eq!(text, expected);
    }

    /// `lease` with the load annotation `value`.
    fn reporting(
        mut lease: k8s_openapi::api::coordination::v1::Lease,
        value: &str,
    ) -> k8s_openapi::api::coordination::v1::Lease {
        lease.metadata.annotations.get_or_insert_default().insert(
            kube_sharding_api::load::ANNOTATION_LOAD.to_string(),
            value.to_string(),
        );
        lease
    }

    #[test]
    fn shows_the_load_shards_report_and_the_ring_sums_of_available_ones() {
        let ring = loaded(vec![
            reporting(
                lease("a", "a", 3, None),
                "objects=30,queue=2,p50ms=4,p99ms=25,errors=1,window=60",
            ),
            reporting(lease("b", "b", 3, None), "objects=12,p99ms=80"),
            // Released: its report does not count.
            reporting(lease("c", "", 3, None), "objects=500,queue=500"),
            reporting(lease("d", "d", 3, None), "objects=01"),
            lease("e", "e", 3, None),
        ]);
        let status = ring_status(&ring, Tally::default(), now());
        assert_eq!(
            status.load,
            RingLoad {
                reporting_shards: 2,
                available_shards: 4,
                objects: 42,
                queue_depth: 2,
                max_p99_ms: Some(80),
                errors: 1,
            }
        );
        let json = serde_json::to_value(&status).expect("serializes");
        assert_eq!(
            json["load"],
            serde_json::json!({"reportingShards": 2, "availableShards": 4, "objects": 42,
                "queueDepth": 2, "maxP99Ms": 80, "errors": 1})
        );
        assert_eq!(
            json["members"][1]["load"],
            serde_json::json!({"objects": 12, "p99Ms": 80})
        );
        assert!(json["members"][3]["loadError"].is_string(), "{json}");
        assert!(json["members"][4].get("load").is_none(), "{json}");

        let report = StatusReport {
            namespace: None,
            rings: vec![status],
        };
        let text = table_at(&report, now());
        let load = &text[text.find("  load reported").expect("load section")..];
        let expected = "  load reported by 2 of 4 available shards: 42 objects, 2 queued, max p99 80ms, 1 errors
  SHARD   OBJECTS   QUEUE   P50   P99    ERRORS   WINDOW   NOTE
  a       30        2       4ms   25ms   1        60s
  b       12        -       -     80ms   -        -
  c       500       500     -     -      -        -        not available, not counted
  d       -         -       -     -      -        -        invalid report, counts as none: load report value \"01\" of objects is not an integer from 0 to 999999999999
";
        assert_eq!(load, expected);

        // No shard reports: no load section.
        let quiet = StatusReport {
            namespace: None,
            rings: vec![ring_status(
                &loaded(vec![lease("a", "a", 3, None)]),
                Tally::default(),
                now(),
            )],
        };
        assert!(!table_at(&quiet, now()).contains("load reported"));
    }

    #[test]
    fn a_server_side_ring_shows_ranges_acknowledgements_and_the_objects_in_them() {
        use super::super::fixtures::{published, server_side, with_ranges};
        use kube_sharding_api::ranges::RangeRing;
        let target = RangeRing::new(["a", "b"]).ranges();
        let annotation = |generation: u64, shard: &str| published(generation, &target[shard]);
        let ring = server_side(
            vec![
                with_ranges(
                    lease("a", "a", 1, None),
                    Some(&annotation(4, "a")),
                    Some("4"),
                ),
                // b was granted its share and has not acknowledged it yet.
                with_ranges(
                    lease("b", "b", 1, None),
                    Some(&annotation(5, "b")),
                    Some("3"),
                ),
            ],
            HashKey::Object,
        );
        let ranges = ring.ranges.as_ref().expect("a ServerSide ring has ranges");
        let secrets = GroupResource::new("", "secrets");
        let mut tally = Tally::default();
        let (in_a, in_b) = (
            target["a"].ranges()[0].start(),
            target["b"].ranges()[0].start(),
        );
        for hash in [in_a, in_b, in_b] {
            tally.observe_ranges(
                &secrets,
                ranges.holder(hash).map(|(s, ..)| s),
                ranges.wanted(hash),
            );
        }
        let status = ring_status(&ring, tally, now());
        let range_status = status.ranges.as_ref().expect("ranges");
        assert!(range_status.handover_pending);
        assert_eq!(range_status.field, "object.metadata.uid");
        let a = status.members[0].ranges.as_ref().expect("a's ranges");
        assert_eq!(
            (a.generation, a.acknowledged, a.ranges, a.pending.as_ref()),
            (Some(4), Some(4), target["a"].ranges().len(), None)
        );
        assert!((a.share_percent - percent(&target["a"])).abs() < 1e-9);
        let b = status.members[1].ranges.as_ref().expect("b's ranges");
        assert_eq!(
            b.pending.as_deref(),
            Some("waiting for its acknowledgement of generation 5")
        );
        assert_eq!((status.members[0].total, status.members[1].total), (1, 2));
        assert_eq!(status.totals.unassigned, 0);
        let json = serde_json::to_value(&status).expect("serializes");
        assert_eq!(json["members"][1]["ranges"]["generation"], 5);
        assert_eq!(json["members"][1]["ranges"]["acknowledged"], 3);
        assert_eq!(json["ranges"]["handoverPending"], true);
        let text = table_at(
            &StatusReport {
                namespace: None,
                rings: vec![status],
            },
            now(),
        );
        assert!(
            text.starts_with("ClusterRing r: Ready=Unknown, 0 shards, 0 available, hashKey Object, assignment ServerSide, rangeGeneration -\n"),
            "{text}"
        );
        assert!(
            text.contains("GENERATION   ACKNOWLEDGED   RANGES   SHARE"),
            "{text}"
        );
        assert!(
            text.contains("pending: waiting for its acknowledgement of generation 5"),
            "{text}"
        );
        assert!(
            text.contains("  3 objects: 3 in a shard's published ranges (0 not in the shard the target gives them), 0 in no shard's ranges"),
            "{text}"
        );
        assert!(
            text.contains("ranges of 64-bit FNV-1a of object.metadata.uid: handover pending"),
            "{text}"
        );
        println!("{text}");
    }
}
