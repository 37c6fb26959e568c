//! `kubectl sharding simulate RING`: what adding or removing shards (or changing a weight) would
//! move. Every object of the ring is placed with the ring's current shards and with the shards
//! after the change, pins included (docs/protocol.md §21): a pinned object stays on its shard
//! while that shard is available, goes to the ring's choice when it is removed, and to it when it
//! is added. Nothing is written.
//!
//! "Before" is where the ring wants each object now, not the label it carries: the difference
//! between the two is what the sharder is still doing, reported as `unsettled`.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use kube::api::ObjectMeta;
use kube_sharding_api::labels::parse_weight;
use kube_sharding_api::lease::is_valid_shard_name;
use kube_sharding_api::{GroupResource, RingKind, RingRef};
use serde::Serialize;

use super::cluster::{self, Connection};
use super::output::{Table, imbalance, or_dash, ratio};
use super::ranges::{RingRanges, is_server_side, percent, target_ranges};
use super::resources::Catalog;
use super::{Error, ring_not_found};
use crate::core::hash_ring::HashRing;
use crate::core::key::KeyOutcome;
use crate::core::pin::PinOutcome;
use crate::core::range_handover::{intersection, union};
use crate::views::RingView;
use kube_sharding_api::ranges::RangeSet;

/// A shard that joins a simulated ring, or an available shard that gets another weight:
/// `NAME` (weight 1) or `NAME:WEIGHT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardChange {
    /// The shard name; it must be a valid label value.
    pub name: String,
    /// Its weight, 1 to 10.
    pub weight: u32,
}

impl FromStr for ShardChange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, weight) = match s.split_once(':') {
            Some((name, weight)) => (name, parse_weight(Some(weight)).map_err(|e| e.to_string())?),
            None => (s, 1),
        };
        if !is_valid_shard_name(name) {
            return Err(format!(
                "{name:?} cannot be a shard name: it must be a label value (at most 63 characters: alphanumerics, '-', '_' or '.', starting and ending alphanumeric)"
            ));
        }
        Ok(Self {
            name: name.to_string(),
            weight,
        })
    }
}

impl fmt::Display for ShardChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.weight)
    }
}

/// The available shards with their weights after adding `add` and removing `remove` from
/// `before`, the available shards of `ring`.
pub(crate) fn shards_after(
    ring: &RingRef,
    before: &BTreeMap<String, u32>,
    add: &[ShardChange],
    remove: &[String],
) -> Result<BTreeMap<String, u32>, Error> {
    let mut after = before.clone();
    for name in remove {
        if add.iter().any(|a| &a.name == name) {
            return Err(Error::Usage(format!(
                "shard {name} is both added and removed"
            )));
        }
        if after.remove(name).is_none() {
            let available: Vec<&str> = before.keys().map(String::as_str).collect();
            return Err(Error::Usage(format!(
                "shard {name} is not an available shard of {ring} (available: {})",
                if available.is_empty() {
                    "none".to_string()
                } else {
                    available.join(", ")
                }
            )));
        }
    }
    for change in add {
        after.insert(change.name.clone(), change.weight);
    }
    Ok(after)
}

/// What `simulate` prints.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SimulationReport {
    /// `ClusterRing` or `ControllerRing`.
    pub(crate) kind: &'static str,
    /// The ring's name.
    pub(crate) name: String,
    /// The namespace objects were counted in, when restricted with `-n`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) namespace: Option<String>,
    /// Shards added or given another weight, as `NAME:WEIGHT`.
    pub(crate) added: Vec<String>,
    /// Shards removed.
    pub(crate) removed: Vec<String>,
    /// Objects of the ring that have a hash key.
    pub(crate) objects: usize,
    /// Objects of the ring that belong to no shard whatever the shards (no eligible controller).
    pub(crate) not_sharded: usize,
    /// Objects not (yet) on the shard the ring wants now.
    pub(crate) unsettled: usize,
    /// Objects a pin applies to (their own, their controller's or their namespace's).
    pub(crate) pinned: usize,
    /// Of those, objects whose pin does not decide their shard now (its shard is not available,
    /// or its value names no shard): the ring places them.
    pub(crate) pins_unsatisfied_before: usize,
    /// Of those, objects whose pin would not decide their shard after the change.
    pub(crate) pins_unsatisfied_after: usize,
    /// Per shard before and after, every shard of either side.
    pub(crate) shards: Vec<ShardMoves>,
    /// Objects per pair of shards they would move between.
    pub(crate) moves: Vec<Move>,
    /// All objects that would move.
    pub(crate) total_moves: usize,
    /// Of those, main objects whose shard stays: the sharder drains them (the shard lets go
    /// first).
    pub(crate) drains: usize,
    /// `max / mean` objects per shard, before.
    pub(crate) imbalance_before: Option<f64>,
    /// `max / mean` objects per shard, after.
    pub(crate) imbalance_after: Option<f64>,
}

/// One shard before and after the change.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ShardMoves {
    /// Shard name.
    pub(crate) name: String,
    /// Its weight before; `None` when it was not available.
    pub(crate) weight_before: Option<u32>,
    /// Its weight after; `None` when it is removed.
    pub(crate) weight_after: Option<u32>,
    /// Objects the ring wants on it now.
    pub(crate) objects_before: usize,
    /// Objects that would leave it.
    pub(crate) moves_out: usize,
    /// Objects that would come to it.
    pub(crate) moves_in: usize,
    /// Objects the ring would want on it after the change.
    pub(crate) objects_after: usize,
}

/// Objects that would move from one shard to another.
#[derive(Debug, Serialize)]
pub(crate) struct Move {
    /// The shard they leave; `None` when the ring has no available shard now.
    pub(crate) from: Option<String>,
    /// The shard they go to; `None` when no shard is left.
    pub(crate) to: Option<String>,
    /// How many.
    pub(crate) objects: usize,
}

/// Counts of a simulation, fed one object at a time.
#[derive(Debug)]
pub(crate) struct Simulation {
    after: HashRing,
    before_counts: BTreeMap<String, usize>,
    after_counts: BTreeMap<String, usize>,
    moves: BTreeMap<(Option<String>, Option<String>), usize>,
    drains: usize,
    objects: usize,
    not_sharded: usize,
    unsettled: usize,
    pinned: usize,
    pins_unsatisfied_before: usize,
    pins_unsatisfied_after: usize,
}

impl Simulation {
    /// A simulation of the ring over the shards `after`.
    pub(crate) fn new(after: &BTreeMap<String, u32>) -> Self {
        Self {
            after: HashRing::weighted(after.iter().map(|(name, weight)| (name, *weight))),
            before_counts: BTreeMap::new(),
            after_counts: BTreeMap::new(),
            moves: BTreeMap::new(),
            drains: 0,
            objects: 0,
            not_sharded: 0,
            unsettled: 0,
            pinned: 0,
            pins_unsatisfied_before: 0,
            pins_unsatisfied_after: 0,
        }
    }

    /// Counts one object of resource `gr` of the ring of `view`; the caller has checked that the
    /// ring covers the object's namespace. Controllers must come before the objects they control:
    /// placing a main object remembers its pin for them.
    pub(crate) fn observe(&mut self, view: &RingView, gr: &GroupResource, meta: &ObjectMeta) {
        let Some(resource) = view.resources.get(gr) else {
            return;
        };
        let placement = view.placement(&gr.group, resource, meta);
        let Ok(KeyOutcome::Key(key)) = &placement.key else {
            self.not_sharded += 1;
            return;
        };
        self.objects += 1;
        let before = placement.desired;
        // The same pins as `placement` read, against the shards after the change.
        let (after, pin_after) = view.place_in(
            &self.after,
            key,
            resource.is_main(),
            view.own_pin(meta),
            meta.namespace.as_deref(),
        );
        if placement.pin != PinOutcome::Unpinned {
            self.pinned += 1;
        }
        self.pins_unsatisfied_before += usize::from(placement.pin.problem().is_some());
        self.pins_unsatisfied_after += usize::from(pin_after.problem().is_some());
        if placement.object.current != before {
            self.unsettled += 1;
        }
        if let Some(before) = before {
            *self.before_counts.entry(before.to_string()).or_default() += 1;
        }
        if let Some(after) = after {
            *self.after_counts.entry(after.to_string()).or_default() += 1;
        }
        if before == after {
            return;
        }
        *self
            .moves
            .entry((before.map(str::to_string), after.map(str::to_string)))
            .or_default() += 1;
        // The sharder drains a main object whose shard stays available and moves the rest.
        if resource.is_main() && before.is_some_and(|shard| self.after.contains(shard)) {
            self.drains += 1;
        }
    }

    /// The report, with the ring's shards before the change `before`.
    pub(crate) fn report(
        self,
        ring: &RingRef,
        before: &BTreeMap<String, u32>,
        add: &[ShardChange],
        remove: &[String],
        namespace: Option<&str>,
    ) -> SimulationReport {
        let after: BTreeMap<&str, u32> = self.after.members().collect();
        let mut names: Vec<&str> = before.keys().map(String::as_str).collect();
        names.extend(after.keys().copied());
        names.sort_unstable();
        names.dedup();
        let count =
            |counts: &BTreeMap<String, usize>, name: &str| counts.get(name).copied().unwrap_or(0);
        let (mut moves_out, mut moves_in) = (BTreeMap::new(), BTreeMap::new());
        for ((from, to), n) in &self.moves {
            for (side, shard) in [(&mut moves_out, from), (&mut moves_in, to)] {
                if let Some(shard) = shard {
                    *side.entry(shard.clone()).or_default() += n;
                }
            }
        }
        let shards = names
            .iter()
            .map(|&name| ShardMoves {
                name: name.to_string(),
                weight_before: before.get(name).copied(),
                weight_after: after.get(name).copied(),
                objects_before: count(&self.before_counts, name),
                moves_out: count(&moves_out, name),
                moves_in: count(&moves_in, name),
                objects_after: count(&self.after_counts, name),
            })
            .collect();
        SimulationReport {
            kind: ring.kind.kind(),
            name: ring.name.clone(),
            namespace: namespace.map(str::to_string),
            added: add.iter().map(ToString::to_string).collect(),
            removed: remove.to_vec(),
            objects: self.objects,
            not_sharded: self.not_sharded,
            unsettled: self.unsettled,
            pinned: self.pinned,
            pins_unsatisfied_before: self.pins_unsatisfied_before,
            pins_unsatisfied_after: self.pins_unsatisfied_after,
            shards,
            total_moves: self.moves.values().sum(),
            moves: self
                .moves
                .iter()
                .map(|((from, to), objects)| Move {
                    from: from.clone(),
                    to: to.clone(),
                    objects: *objects,
                })
                .collect(),
            drains: self.drains,
            imbalance_before: imbalance(before.keys().map(|n| count(&self.before_counts, n))),
            imbalance_after: imbalance(after.keys().map(|n| count(&self.after_counts, n))),
        }
    }
}

/// What `simulate` prints: objects for a label ring, shares of the hash space for a
/// `ServerSide` ring (whose placement does not depend on objects).
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum Report {
    /// A label ring: objects counted.
    Objects(SimulationReport),
    /// A `ServerSide` ring: ranges compared.
    Ranges(RangeSimulation),
}

/// A simulated change of a `ServerSide` ring: the target ranges before and after, as shares of
/// the 64-bit hash space (in percent).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RangeSimulation {
    /// `ClusterRing` or `ControllerRing`.
    pub(crate) kind: &'static str,
    /// The ring's name.
    pub(crate) name: String,
    /// Always `ServerSide`.
    pub(crate) assignment: &'static str,
    /// The hashed field.
    pub(crate) field: &'static str,
    /// Shards added or given another weight, as `NAME:WEIGHT`.
    pub(crate) added: Vec<String>,
    /// Shards removed.
    pub(crate) removed: Vec<String>,
    /// Per shard before and after, every shard of either side.
    pub(crate) shards: Vec<RangeShardMoves>,
    /// The share moving between each pair of shards.
    pub(crate) moves: Vec<RangeMove>,
    /// The share of the hash space that would move.
    pub(crate) moved_share_percent: f64,
    /// Namespace pins honoured before and after (a ring hashing namespaces).
    pub(crate) pinned_namespaces: usize,
    /// `max / mean` share per shard, before.
    pub(crate) imbalance_before: Option<f64>,
    /// `max / mean` share per shard, after.
    pub(crate) imbalance_after: Option<f64>,
}

/// One shard of a `ServerSide` ring before and after the change.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RangeShardMoves {
    /// Shard name.
    pub(crate) name: String,
    /// Its weight before; `None` when it was not available.
    pub(crate) weight_before: Option<u32>,
    /// Its weight after; `None` when it is removed.
    pub(crate) weight_after: Option<u32>,
    /// Its target's ranges before.
    pub(crate) ranges_before: usize,
    /// Its target's share before, in percent.
    pub(crate) share_before_percent: f64,
    /// The share it would lose.
    pub(crate) out_percent: f64,
    /// The share it would gain.
    pub(crate) in_percent: f64,
    /// Its target's ranges after.
    pub(crate) ranges_after: usize,
    /// Its target's share after, in percent.
    pub(crate) share_after_percent: f64,
}

/// The share of the hash space moving from one shard to another.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RangeMove {
    /// The shard losing it; `None` when the ring has no available shard now.
    pub(crate) from: Option<String>,
    /// The shard gaining it; `None` when no shard is left.
    pub(crate) to: Option<String>,
    /// The share, in percent.
    pub(crate) share_percent: f64,
}

/// Compares the targets of the ring before (`before`, its available shards) and after the change
/// (`after`), both with the ring's namespace pins.
pub(crate) fn simulate_ranges(
    ring: &RingRef,
    ranges: &RingRanges,
    before: &BTreeMap<String, u32>,
    after: &BTreeMap<String, u32>,
    add: &[ShardChange],
    remove: &[String],
) -> RangeSimulation {
    let target = |shards: &BTreeMap<String, u32>| {
        target_ranges(shards.iter().map(|(n, w)| (n.as_str(), *w)), &ranges.pins)
    };
    let (old, new) = (target(before), target(after));
    let empty = RangeSet::empty();
    let mut names: Vec<&String> = old.keys().chain(new.keys()).collect();
    names.sort_unstable();
    names.dedup();
    let mut moves = Vec::new();
    let (mut out, mut gained) = (BTreeMap::new(), BTreeMap::new());
    // Whatever no shard holds on one side (an empty ring) moves from or to nobody.
    let side = |map: &BTreeMap<String, RangeSet>| -> Vec<(Option<String>, RangeSet)> {
        if map.is_empty() {
            vec![(None, RangeSet::full())]
        } else {
            map.iter()
                .map(|(n, s)| (Some(n.clone()), s.clone()))
                .collect()
        }
    };
    let mut moved = RangeSet::empty();
    for (from, old_set) in side(&old) {
        for (to, new_set) in side(&new) {
            if from == to {
                continue;
            }
            let shared = intersection(&old_set, &new_set);
            if shared.is_empty() {
                continue;
            }
            moved = union(&moved, &shared);
            if let Some(from) = &from {
                let entry: &mut RangeSet = out.entry(from.clone()).or_default();
                *entry = union(entry, &shared);
            }
            if let Some(to) = &to {
                let entry: &mut RangeSet = gained.entry(to.clone()).or_default();
                *entry = union(entry, &shared);
            }
            moves.push(RangeMove {
                from: from.clone(),
                to,
                share_percent: percent(&shared),
            });
        }
    }
    let shards = names
        .iter()
        .map(|name| {
            let (old_set, new_set) = (
                old.get(*name).unwrap_or(&empty),
                new.get(*name).unwrap_or(&empty),
            );
            RangeShardMoves {
                name: (*name).clone(),
                weight_before: before.get(*name).copied(),
                weight_after: after.get(*name).copied(),
                ranges_before: old_set.ranges().len(),
                share_before_percent: percent(old_set),
                out_percent: percent(out.get(*name).unwrap_or(&empty)),
                in_percent: percent(gained.get(*name).unwrap_or(&empty)),
                ranges_after: new_set.ranges().len(),
                share_after_percent: percent(new_set),
            }
        })
        .collect();
    // Widths are below 2^64 + 1; the imbalance of shares needs no more precision than f64's.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let widths = |map: &BTreeMap<String, RangeSet>| -> Vec<usize> {
        map.values().map(|s| (s.share() * 1e12) as usize).collect()
    };
    RangeSimulation {
        kind: ring.kind.kind(),
        name: ring.name.clone(),
        assignment: "ServerSide",
        field: ranges.field.path(),
        added: add.iter().map(ToString::to_string).collect(),
        removed: remove.to_vec(),
        shards,
        moves,
        moved_share_percent: percent(&moved),
        pinned_namespaces: ranges.pins.iter().filter(|p| p.state == "honoured").count(),
        imbalance_before: imbalance(widths(&old)),
        imbalance_after: imbalance(widths(&new)),
    }
}

/// Reads the ring and its objects and simulates the change.
pub(crate) async fn run(
    connection: &Connection,
    name: &str,
    kind: Option<RingKind>,
    add: &[ShardChange],
    remove: &[String],
    namespace: Option<&str>,
) -> Result<Report, Error> {
    let client = &connection.client;
    let kinds = kind.map_or_else(|| RingKind::ALL.to_vec(), |k| vec![k]);
    let rings = cluster::rings(client, &kinds, Some(name)).await?;
    if rings.len() > 1 {
        return Err(Error::Usage(format!(
            "both a ClusterRing and a ControllerRing are named {name:?}: choose one with --kind"
        )));
    }
    if rings.is_empty() {
        return Err(ring_not_found(name, kind));
    }
    let catalog = Catalog::discover(client).await?;
    let mut loaded = cluster::load_rings(client, rings, &catalog.infos()).await?;
    // A ServerSide ring's target depends on the pins of every namespace, and not on objects.
    let server_side = loaded.iter().any(is_server_side);
    let namespaces = cluster::namespaces(client, namespace.filter(|_| !server_side)).await?;
    cluster::give_pins(&mut loaded, &namespaces);
    let Some(ring) = loaded.first() else {
        return Err(ring_not_found(name, kind));
    };
    let ring_ref = ring.ring.ring_ref();
    let before: BTreeMap<String, u32> = ring
        .view
        .hash_ring
        .members()
        .map(|(shard, weight)| (shard.to_string(), weight))
        .collect();
    let after = shards_after(&ring_ref, &before, add, remove)?;
    if let Some(ranges) = &ring.ranges {
        return Ok(Report::Ranges(simulate_ranges(
            &ring_ref, ranges, &before, &after, add, remove,
        )));
    }
    let mut simulation = Simulation::new(&after);
    cluster::walk_objects(
        client,
        &loaded,
        namespace,
        &namespaces.labels,
        |_, gr, meta| {
            simulation.observe(&ring.view, gr, meta);
        },
    )
    .await?;
    Ok(Report::Objects(
        simulation.report(&ring_ref, &before, add, remove, namespace),
    ))
}

/// The report as text.
pub(crate) fn report_table(report: &Report) -> String {
    match report {
        Report::Objects(report) => table(report),
        Report::Ranges(report) => ranges_table(report),
    }
}

/// A `ServerSide` ring's simulation as text: shares per shard, the moves, the balance.
pub(crate) fn ranges_table(report: &RangeSimulation) -> String {
    let mut changes: Vec<String> = report.added.iter().map(|a| format!("+{a}")).collect();
    changes.extend(report.removed.iter().map(|r| format!("-{r}")));
    let mut text = format!(
        "{} {}: simulating {} on the hash ranges of {} (assignment ServerSide: no object moves, only ranges)\n",
        report.kind,
        report.name,
        if changes.is_empty() {
            "no change".to_string()
        } else {
            changes.join(", ")
        },
        report.field,
    );
    let share = |percent: f64| format!("{percent:.2}%");
    let mut shards = Table::new([
        "SHARD",
        "WEIGHT",
        "RANGES",
        "SHARE",
        "OUT",
        "IN",
        "AFTER",
        "RANGES AFTER",
    ]);
    for shard in &report.shards {
        let weight = if shard.weight_before == shard.weight_after {
            or_dash(shard.weight_before)
        } else {
            format!(
                "{} -> {}",
                or_dash(shard.weight_before),
                or_dash(shard.weight_after)
            )
        };
        shards.row(vec![
            shard.name.clone(),
            weight,
            shard.ranges_before.to_string(),
            share(shard.share_before_percent),
            share(shard.out_percent),
            share(shard.in_percent),
            share(shard.share_after_percent),
            shard.ranges_after.to_string(),
        ]);
    }
    text.push_str(&shards.render("  "));
    text.push_str(&format!(
        "  {} of the hash space would move: each moving range is revoked from its shard and granted once that shard acknowledges\n",
        share(report.moved_share_percent)
    ));
    if !report.moves.is_empty() {
        let mut moves = Table::new(["FROM", "TO", "SHARE"]);
        for m in &report.moves {
            moves.row(vec![
                m.from.clone().unwrap_or_else(|| "(no shard)".into()),
                m.to.clone().unwrap_or_else(|| "(no shard)".into()),
                share(m.share_percent),
            ]);
        }
        text.push_str(&moves.render("  "));
    }
    text.push_str(&format!(
        "  imbalance (max/mean share per shard): {} before, {} after\n",
        ratio(report.imbalance_before),
        ratio(report.imbalance_after)
    ));
    if report.pinned_namespaces > 0 {
        text.push_str(&format!(
            "  {} namespace pins honoured now; a pin to a removed shard goes back to the hash ring\n",
            report.pinned_namespaces
        ));
    }
    text
}

/// The report as text: per shard before and after, the moves between shards, the balance.
pub(crate) fn table(report: &SimulationReport) -> String {
    let mut changes: Vec<String> = report.added.iter().map(|a| format!("+{a}")).collect();
    changes.extend(report.removed.iter().map(|r| format!("-{r}")));
    let mut text = format!(
        "{} {}: simulating {} over {} objects{}\n",
        report.kind,
        report.name,
        if changes.is_empty() {
            "no change".to_string()
        } else {
            changes.join(", ")
        },
        report.objects,
        report
            .namespace
            .as_ref()
            .map_or_else(String::new, |ns| format!(" in namespace {ns}")),
    );
    let mut shards = Table::new(["SHARD", "WEIGHT", "OBJECTS", "OUT", "IN", "AFTER"]);
    for shard in &report.shards {
        let weight = if shard.weight_before == shard.weight_after {
            or_dash(shard.weight_before)
        } else {
            format!(
                "{} -> {}",
                or_dash(shard.weight_before),
                or_dash(shard.weight_after)
            )
        };
        shards.row(vec![
            shard.name.clone(),
            weight,
            shard.objects_before.to_string(),
            shard.moves_out.to_string(),
            shard.moves_in.to_string(),
            shard.objects_after.to_string(),
        ]);
    }
    text.push_str(&shards.render("  "));
    #[allow(clippy::cast_precision_loss)]
    let share = if report.objects == 0 {
        0.0
    } else {
        100.0 * report.total_moves as f64 / report.objects as f64
    };
    text.push_str(&format!(
        "  {} of {} objects would move ({share:.1}%): {} drained from shards that stay, {} moved directly\n",
        report.total_moves,
        report.objects,
        report.drains,
        report.total_moves - report.drains,
    ));
    if !report.moves.is_empty() {
        let mut moves = Table::new(["FROM", "TO", "OBJECTS"]);
        for m in &report.moves {
            moves.row(vec![
                m.from.clone().unwrap_or_else(|| "(no shard)".into()),
                m.to.clone().unwrap_or_else(|| "(no shard)".into()),
                m.objects.to_string(),
            ]);
        }
        text.push_str(&moves.render("  "));
    }
    text.push_str(&format!(
        "  imbalance (max/mean objects per shard): {} before, {} after\n",
        ratio(report.imbalance_before),
        ratio(report.imbalance_after)
    ));
    if report.not_sharded > 0 {
        text.push_str(&format!(
            "  {} objects belong to no shard (no eligible controller) and are not counted\n",
            report.not_sharded
        ));
    }
    if report.pinned > 0 {
        text.push_str(&format!(
            "  {} objects are pinned; pins not deciding the shard (shard not available, or not a shard name): {} before, {} after\n",
            report.pinned, report.pins_unsatisfied_before, report.pins_unsatisfied_after
        ));
    }
    if report.unsettled > 0 {
        text.push_str(&format!(
            "  {} objects are not yet on the shard the ring wants now; \"before\" counts where the ring wants them\n",
            report.unsettled
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{lease, loaded, object, pin_namespace, pinned};
    use super::*;

    fn ring_ref() -> RingRef {
        RingRef::new(RingKind::ClusterRing, "r")
    }

    fn weights(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
        pairs.iter().map(|(n, w)| (n.to_string(), *w)).collect()
    }

    #[test]
    fn shard_changes_parse_with_optional_weights() {
        assert_eq!(
            "s-3".parse::<ShardChange>(),
            Ok(ShardChange {
                name: "s-3".into(),
                weight: 1
            })
        );
        assert_eq!("s-3:4".parse::<ShardChange>().map(|c| c.weight), Ok(4));
        assert!("s-3:11".parse::<ShardChange>().is_err());
        assert!("s-3:x".parse::<ShardChange>().is_err());
        assert!("-bad".parse::<ShardChange>().is_err());
        assert!("".parse::<ShardChange>().is_err());
    }

    #[test]
    fn shards_after_adds_removes_and_reweighs() {
        let before = weights(&[("a", 1), ("b", 1)]);
        let add = ["c".parse().expect("valid"), "a:3".parse().expect("valid")];
        let after = shards_after(&ring_ref(), &before, &add, &["b".into()]).expect("valid");
        assert_eq!(after, weights(&[("a", 3), ("c", 1)]));
        let unknown = shards_after(&ring_ref(), &before, &[], &["x".into()]);
        assert_eq!(
            unknown.map_err(|e| e.to_string()),
            Err("shard x is not an available shard of ClusterRing/r (available: a, b)".into())
        );
        let both = shards_after(&ring_ref(), &before, &add, &["c".into()]);
        assert!(both.is_err());
    }

    /// Moves per shard pair equal the difference of the two rings' assignments, counted here
    /// independently with plain rings over the same keys.
    #[test]
    fn moves_are_the_difference_of_the_two_rings() {
        let ring = loaded(vec![lease("a", "a", 1, None), lease("b", "b", 1, None)]);
        let view = &ring.view;
        let before = weights(&[("a", 1), ("b", 1)]);
        let add: [ShardChange; 1] = ["c:2".parse().expect("valid")];
        let after = shards_after(&ring_ref(), &before, &add, &["a".into()]).expect("valid");
        let mut simulation = Simulation::new(&after);
        let secrets = GroupResource::new("", "secrets");
        let configmaps = GroupResource::new("", "configmaps");
        let names: Vec<String> = (0..300).map(|i| format!("s-{i}")).collect();
        for name in &names {
            simulation.observe(view, &secrets, &object(name, &[], None));
        }
        simulation.observe(view, &configmaps, &object("orphan", &[], None));
        let report = simulation.report(&ring_ref(), &before, &add, &["a".into()], None);

        let old = HashRing::new(["a", "b"]);
        let new = HashRing::weighted([("b", 1), ("c", 2)]);
        let mut expected: BTreeMap<(String, String), usize> = BTreeMap::new();
        for name in &names {
            let key = format!("/Secret/ns/{name}");
            let (from, to) = (old.shard_for(&key), new.shard_for(&key));
            if from != to {
                *expected
                    .entry((from.unwrap_or("").into(), to.unwrap_or("").into()))
                    .or_default() += 1;
            }
        }
        let got: BTreeMap<(String, String), usize> = report
            .moves
            .iter()
            .map(|m| {
                (
                    (
                        m.from.clone().unwrap_or_default(),
                        m.to.clone().unwrap_or_default(),
                    ),
                    m.objects,
                )
            })
            .collect();
        assert_eq!(got, expected);
        assert_eq!(report.objects, 300);
        assert_eq!(report.not_sharded, 1);
        // Nothing carries a label yet: every object is unsettled.
        assert_eq!(report.unsettled, 300);
        // Everything leaves the removed shard a; b keeps all it had but loses some to c.
        let a = &report.shards[0];
        assert_eq!(
            (a.name.as_str(), a.moves_out, a.objects_after),
            ("a", a.objects_before, 0)
        );
        assert_eq!(a.weight_after, None);
        let c = &report.shards[2];
        assert_eq!(
            (c.weight_before, c.weight_after, c.moves_out),
            (None, Some(2), 0)
        );
        assert_eq!(c.moves_in, c.objects_after);
        // Drains: objects leaving b, which stays; a's objects are moved directly.
        let from_b: usize = report
            .moves
            .iter()
            .filter(|m| m.from.as_deref() == Some("b"))
            .map(|m| m.objects)
            .sum();
        assert_eq!(report.drains, from_b);
        let text = table(&report);
        assert!(
            text.starts_with("ClusterRing r: simulating +c:2, -a over 300 objects\n"),
            "{text}"
        );
        assert!(text.contains("1 objects belong to no shard"), "{text}");
    }

    /// Moves of `report` by (from, to), `""` for no shard.
    fn moves(report: &SimulationReport) -> BTreeMap<(String, String), usize> {
        report
            .moves
            .iter()
            .map(|m| {
                let side = |s: &Option<String>| s.clone().unwrap_or_default();
                ((side(&m.from), side(&m.to)), m.objects)
            })
            .collect()
    }

    /// A pinned object stays on its shard while that shard stays, goes to the ring's choice when
    /// it leaves, and to it when it joins; a controlled object follows its controller's pin.
    /// Placements are predicted with plain rings.
    #[test]
    fn pins_hold_while_their_shard_stays() {
        let ring = loaded(vec![lease("a", "a", 1, None), lease("b", "b", 1, None)]);
        let view = &ring.view;
        let before = weights(&[("a", 1), ("b", 1)]);
        let add: [ShardChange; 1] = ["c".parse().expect("valid")];
        let after = shards_after(&ring_ref(), &before, &add, &["a".into()]).expect("valid");
        let (old, new) = (HashRing::new(["a", "b"]), HashRing::new(["b", "c"]));
        let key = |name: &str| format!("/Secret/ns/{name}");
        // Names the rings would move without pins: from a or b to c.
        let to_c: Vec<String> = (0..1000)
            .map(|i| format!("s-{i}"))
            .filter(|n| new.shard_for(&key(n)) == Some("c") && old.shard_for(&key(n)) == Some("b"))
            .take(2)
            .collect();
        let (stays, child_of) = (&to_c[0], &to_c[1]);
        let on_b_after = (0..1000)
            .map(|i| format!("s-{i}"))
            .find(|n| new.shard_for(&key(n)) == Some("b"))
            .expect("a name");

        let secrets = GroupResource::new("", "secrets");
        let configmaps = GroupResource::new("", "configmaps");
        let mut simulation = Simulation::new(&after);
        // Main objects first, as `cluster::walk_objects` hands them over.
        simulation.observe(view, &secrets, &pinned(object(stays, &[], None), view, "b"));
        simulation.observe(
            view,
            &secrets,
            &pinned(object("gone", &[], None), view, "a"),
        );
        simulation.observe(
            view,
            &secrets,
            &pinned(object(&on_b_after, &[], None), view, "c"),
        );
        simulation.observe(
            view,
            &secrets,
            &pinned(object(child_of, &[], None), view, "b"),
        );
        simulation.observe(view, &configmaps, &object("child", &[], Some(child_of)));
        let report = simulation.report(&ring_ref(), &before, &add, &["a".into()], None);

        let gone_to = new.shard_for(&key("gone")).unwrap_or_default();
        let added_from = old.shard_for(&key(&on_b_after)).unwrap_or_default();
        let mut expected = BTreeMap::new();
        // Pinned to the removed a: the ring decides after.
        expected.insert(("a".to_string(), gone_to.to_string()), 1);
        // Pinned to the added c: the ring decided before.
        *expected
            .entry((added_from.to_string(), "c".to_string()))
            .or_default() += 1;
        assert_eq!(moves(&report), expected);
        assert_eq!(report.objects, 5);
        assert_eq!(report.pinned, 5);
        assert_eq!(
            (
                report.pins_unsatisfied_before,
                report.pins_unsatisfied_after
            ),
            (1, 1)
        );
        let text = table(&report);
        assert!(
            text.contains("  5 objects are pinned; pins not deciding the shard (shard not available, or not a shard name): 1 before, 1 after\n"),
            "{text}"
        );
    }

    #[test]
    fn namespace_pins_keep_objects_until_their_shard_leaves() {
        let mut ring = loaded(vec![lease("a", "a", 1, None), lease("b", "b", 1, None)]);
        pin_namespace(&mut ring.view, "b");
        let view = &ring.view;
        let before = weights(&[("a", 1), ("b", 1)]);
        let secrets = GroupResource::new("", "secrets");
        let simulate = |add: &[ShardChange], remove: &[String]| {
            let after = shards_after(&ring_ref(), &before, add, remove).expect("valid");
            let mut simulation = Simulation::new(&after);
            for i in 0..50 {
                simulation.observe(view, &secrets, &object(&format!("s-{i}"), &[], None));
            }
            simulation.report(&ring_ref(), &before, add, remove, None)
        };
        let added = simulate(&["c".parse().expect("valid")], &[]);
        assert_eq!(added.total_moves, 0);
        assert_eq!(
            (
                added.pinned,
                added.pins_unsatisfied_before,
                added.pins_unsatisfied_after
            ),
            (50, 0, 0)
        );
        let removed = simulate(&[], &["b".into()]);
        assert_eq!(
            moves(&removed),
            BTreeMap::from([(("b".to_string(), "a".to_string()), 50)])
        );
        assert_eq!(
            (
                removed.pins_unsatisfied_before,
                removed.pins_unsatisfied_after
            ),
            (0, 50)
        );
    }

    #[test]
    fn a_server_side_ring_simulates_shares_of_the_hash_space() {
        use super::super::fixtures::{lease, server_side};
        use kube_sharding_api::HashKey;
        use kube_sharding_api::ranges::RangeRing;
        let ring = server_side(
            vec![lease("a", "a", 1, None), lease("b", "b", 1, None)],
            HashKey::Object,
        );
        let ranges = ring.ranges.as_ref().expect("ranges");
        let before = weights(&[("a", 1), ("b", 1)]);
        let add = vec![ShardChange {
            name: "c".into(),
            weight: 1,
        }];
        let after = shards_after(&ring_ref(), &before, &add, &[]).expect("valid");
        let report = simulate_ranges(&ring_ref(), ranges, &before, &after, &add, &[]);
        // Consistent hashing: exactly the newcomer's target moves, all of it to the newcomer.
        let newcomer = RangeRing::new(["a", "b", "c"]).ranges_of("c");
        assert!((report.moved_share_percent - percent(&newcomer)).abs() < 0.011);
        assert!(report.moves.iter().all(|m| m.to.as_deref() == Some("c")));
        let c = report.shards.iter().find(|s| s.name == "c").expect("c");
        assert_eq!((c.weight_before, c.weight_after), (None, Some(1)));
        assert_eq!((c.share_before_percent, c.out_percent), (0.0, 0.0));
        assert!((c.in_percent - report.moved_share_percent).abs() < 0.011);
        let out: f64 = report.shards.iter().map(|s| s.out_percent).sum();
        assert!(
            (out - report.moved_share_percent).abs() < 0.03,
            "{report:?}"
        );
        let text = ranges_table(&report);
        assert!(
            text.starts_with(
                "ClusterRing r: simulating +c:1 on the hash ranges of object.metadata.uid"
            ),
            "{text}"
        );
        assert!(text.contains("of the hash space would move"), "{text}");

        // Removing b moves exactly b's share, to a.
        let after = shards_after(&ring_ref(), &before, &[], &["b".into()]).expect("valid");
        let report = simulate_ranges(&ring_ref(), ranges, &before, &after, &[], &["b".into()]);
        let b = RangeRing::new(["a", "b"]).ranges_of("b");
        assert!((report.moved_share_percent - percent(&b)).abs() < 0.011);
        assert_eq!(report.moves.len(), 1);
        assert_eq!(report.moves[0].from.as_deref(), Some("b"));
        assert_eq!(report.moves[0].to.as_deref(), Some("a"));
        let a = report.shards.iter().find(|s| s.name == "a").expect("a");
        assert!((a.share_after_percent - 100.0).abs() < 1e-9);
    }
}
