//! `kubectl sharding explain RESOURCE NAME`: one object in every ring covering its resource: its
//! hash key, the shard the ring wants now, the pin that applies to it and whether the pin decided
//! (docs/protocol.md §21), the labels it carries, and in plain words why it is (not) where the ring
//! wants it.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::ObjectMeta;
use kube_sharding_api::lease::{ShardLease, ShardState};
use kube_sharding_api::{GroupResource, HashKey, RingKind, RingRef};
use serde::Serialize;

use super::Error;
use super::cluster::{self, Connection, LoadedRing, covers};
use super::output::{Table, or_dash};
use super::ranges::{RingRanges, hash_text, object_hash};
use super::resources::Catalog;
use super::status::{assignment_name, hash_key_name};
use crate::core::key::{
    ControllerKind, KeyError, KeyOutcome, ResourceRole, Unassigned, parse_group,
};
use crate::core::membership::ring_members;
use crate::core::pin::{PinOutcome, PinSource};
use crate::views::{Placement, ResolvedResource, ResourceInfo, RingView};

/// What `explain` prints.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ExplainReport {
    /// The object's resource, e.g. `secrets` or `deployments.apps`.
    pub(crate) resource: String,
    /// The object's kind.
    pub(crate) kind: String,
    /// The object's name.
    pub(crate) name: String,
    /// The object's namespace; `None` for cluster-scoped objects.
    pub(crate) namespace: Option<String>,
    /// Every ring covering the resource, by kind and name.
    pub(crate) rings: Vec<RingExplanation>,
}

/// The object in one ring.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RingExplanation {
    /// `ClusterRing` or `ControllerRing`.
    pub(crate) ring_kind: &'static str,
    /// The ring's name.
    pub(crate) ring: String,
    /// `main` or `controlled`: the resource's role in the ring.
    pub(crate) role: &'static str,
    /// The ring's `hashKey`.
    pub(crate) hash_key: &'static str,
    /// The ring's `assignment`: who labels the object if it has no shard yet.
    pub(crate) assignment: &'static str,
    /// The object's hash key, when it has one.
    pub(crate) key: Option<String>,
    /// The shard the ring wants the object on now.
    pub(crate) desired_shard: Option<String>,
    /// The pin that applies to the object, if one does, and whether it decided `desired_shard`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) pin: Option<PinExplanation>,
    /// The ring's shard label key and the object's value of it.
    pub(crate) shard_label: Label,
    /// The ring's drain label key and the object's value of it.
    pub(crate) drain_label: Label,
    /// The situation, for scripts.
    pub(crate) verdict: Verdict,
    /// The situation in plain words.
    pub(crate) reason: String,
    /// What else helps to understand it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) notes: Vec<String>,
    /// On a `ServerSide` ring: the object's hash, the shard whose published ranges hold it and
    /// the shard the target gives it (`desiredShard`). Its labels mean nothing there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ranges: Option<RangeExplanation>,
}

/// Where the hash of an object of a `ServerSide` ring lies.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RangeExplanation {
    /// The hashed field: `object.metadata.uid` or `object.metadata.namespace`.
    pub(crate) field: &'static str,
    /// The field's value on the object.
    pub(crate) value: String,
    /// Its 64-bit FNV-1a hash, `0x` and 16 hex digits.
    pub(crate) hash: String,
    /// The shard whose latest published ranges hold the hash (its Lease held by it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) held_by: Option<String>,
    /// The generation of that publication.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) generation: Option<u64>,
    /// Whether that shard acknowledged that generation.
    pub(crate) acknowledged: bool,
}

/// The pin that applies to an object in one ring.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PinExplanation {
    /// Whose pin applies: `object` (its own), `controller` or `namespace`.
    pub(crate) source: &'static str,
    /// The pin annotation's key.
    pub(crate) annotation: String,
    /// The annotation's value: the shard it names.
    pub(crate) value: String,
    /// What it did: `honoured` (it decided the shard the ring wants), `unavailable` (it names no
    /// available shard) or `invalid` (it cannot name a shard); in the last two the hash ring
    /// decided.
    pub(crate) state: &'static str,
    /// The same in plain words, naming the object carrying the pin.
    pub(crate) reason: String,
}

/// A label key and its value on the object.
#[derive(Debug, Serialize)]
pub(crate) struct Label {
    /// The key.
    pub(crate) key: String,
    /// The value; `None` when the object lacks the label.
    pub(crate) value: Option<String>,
}

/// Where an object stands in one ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub(crate) enum Verdict {
    /// On the shard the ring wants.
    InPlace,
    /// The sharder does not act on the ring (it is invalid).
    RingInvalid,
    /// The object's namespace is not selected by the ring.
    NamespaceNotSelected,
    /// A main object without a name cannot be hashed.
    NoName,
    /// A controlled object without a controller reference.
    NoController,
    /// A controlled object whose controller the ring does not list for its resource.
    ForeignController,
    /// The drain label asks the current shard to let go; the shard has to acknowledge.
    Draining,
    /// Not on the shard the ring wants; the sharder (or its webhook) moves it next.
    WaitingForSharder,
    /// The ring has no available shard.
    NoAvailableShard,
}

/// The object `meta` of resource `gr` in `ring` at `now`; `selected` tells whether the ring
/// covers the object's namespace.
pub(crate) fn explain_ring(
    ring: &LoadedRing,
    gr: &GroupResource,
    meta: &ObjectMeta,
    selected: bool,
    now: Timestamp,
) -> Option<RingExplanation> {
    let view = &ring.view;
    let resource = view.resources.get(gr)?;
    if let Some(ranges) = &ring.ranges {
        return Some(explain_ranges(ring, ranges, resource, meta, selected));
    }
    let placement = view.placement(&gr.group, resource, meta);
    let RingRef { kind, name } = ring.ring.ring_ref();
    let states: BTreeMap<String, (ShardState, bool)> = ring_members(
        kind,
        &name,
        &ring.ring.spec().lease_namespaces,
        &ring.leases,
    )
    .iter()
    .map(|m| {
        let state = ShardLease::from_lease(m.lease).state(now);
        (m.lease.name_any(), (state, m.is_available()))
    })
    .collect();
    let (verdict, reason) = if let Some(invalid) = &ring.invalid {
        (
            Verdict::RingInvalid,
            format!("the sharder does not act on this ring: {invalid}"),
        )
    } else if !selected {
        not_selected(ring, meta, &placement)
    } else {
        judge(&placement, resource, &states)
    };
    // A ring the sharder does not act on here wants the object nowhere.
    let acted_on = !matches!(
        verdict,
        Verdict::RingInvalid | Verdict::NamespaceNotSelected
    );
    let labels = meta.labels.clone().unwrap_or_default();
    Some(RingExplanation {
        ring_kind: kind.kind(),
        ring: name,
        role: if resource.is_main() {
            "main"
        } else {
            "controlled"
        },
        hash_key: hash_key_name(view.hash_key),
        assignment: assignment_name(view.assignment),
        key: match &placement.key {
            Ok(KeyOutcome::Key(key)) if acted_on => Some(key.clone()),
            _ => None,
        },
        desired_shard: placement.desired.filter(|_| acted_on).map(str::to_string),
        pin: pin_explanation(view, meta, &placement).filter(|_| acted_on),
        shard_label: Label {
            value: labels.get(&view.shard_label).cloned(),
            key: view.shard_label.clone(),
        },
        drain_label: Label {
            value: labels.get(&view.drain_label).cloned(),
            key: view.drain_label.clone(),
        },
        notes: if acted_on {
            notes(view, resource, meta, &placement)
        } else {
            Vec::new()
        },
        verdict,
        reason,
        ranges: None,
    })
}

/// The object `meta` in the `ServerSide` ring `ring` with `ranges`.
fn explain_ranges(
    ring: &LoadedRing,
    ranges: &RingRanges,
    resource: &ResolvedResource,
    meta: &ObjectMeta,
    selected: bool,
) -> RingExplanation {
    let view = &ring.view;
    let RingRef { kind, name } = ring.ring.ring_ref();
    let labels = meta.labels.clone().unwrap_or_default();
    let mut explanation = RingExplanation {
        ring_kind: kind.kind(),
        ring: name,
        role: if resource.is_main() {
            "main"
        } else {
            "controlled"
        },
        hash_key: hash_key_name(view.hash_key),
        assignment: assignment_name(view.assignment),
        key: None,
        desired_shard: None,
        pin: None,
        shard_label: Label {
            value: labels.get(&view.shard_label).cloned(),
            key: view.shard_label.clone(),
        },
        drain_label: Label {
            value: labels.get(&view.drain_label).cloned(),
            key: view.drain_label.clone(),
        },
        verdict: Verdict::InPlace,
        reason: String::new(),
        notes: Vec::new(),
        ranges: None,
    };
    if let Some(invalid) = &ring.invalid {
        explanation.verdict = Verdict::RingInvalid;
        explanation.reason = format!("the sharder does not act on this ring: {invalid}");
        return explanation;
    }
    if !selected {
        let namespace = meta.namespace.as_deref().unwrap_or_default();
        explanation.verdict = Verdict::NamespaceNotSelected;
        explanation.reason = format!(
            "namespace {namespace} is not selected by {}, so the ring's shards do not handle the object",
            ring.selector_source.describe()
        );
        return explanation;
    }
    let Some((value, hash)) = object_hash(ranges.field, meta) else {
        explanation.verdict = Verdict::NoName;
        explanation.reason = "it has no uid yet, so it has no hash".into();
        return explanation;
    };
    let holder = ranges.holder(hash);
    let wanted = ranges.wanted(hash);
    let hash_words = hash_text(hash);
    explanation.key = Some(value.clone());
    explanation.desired_shard = wanted.map(str::to_string);
    explanation.ranges = Some(RangeExplanation {
        field: ranges.field.path(),
        value,
        hash: hash_words.clone(),
        held_by: holder.map(|(shard, ..)| shard.to_string()),
        generation: holder.map(|(_, generation, _)| generation),
        acknowledged: holder.is_some_and(|(_, generation, acked)| acked == Some(generation)),
    });
    let (verdict, reason) = match (holder, wanted) {
        (_, None) => (
            Verdict::NoAvailableShard,
            "the ring has no available shard, so the sharder gives its ranges to nobody".into(),
        ),
        (Some((held, generation, acked)), Some(wanted)) if held == wanted => (
            Verdict::InPlace,
            if acked == Some(generation) {
                format!(
                    "its hash {hash_words} is in the ranges published to {held} (generation {generation}, acknowledged), the shard the ring wants"
                )
            } else {
                format!(
                    "its hash {hash_words} is in the ranges published to {held} (generation {generation}, not acknowledged yet), the shard the ring wants"
                )
            },
        ),
        (Some((held, generation, _)), Some(wanted)) => (
            Verdict::WaitingForSharder,
            format!(
                "its hash {hash_words} is in the ranges published to {held} (generation {generation}), but the ring's target gives it to {wanted}: the sharder revokes it from {held} first and grants it to {wanted} once {held} acknowledges (or can no longer be running)"
            ),
        ),
        (None, Some(wanted)) => (
            Verdict::WaitingForSharder,
            format!(
                "its hash {hash_words} is in no shard's published ranges: revoked from its previous shard (or never granted) and not yet granted to {wanted}, the shard the ring wants; the grant follows the acknowledgement of every revoke it waits for"
            ),
        ),
    };
    explanation.verdict = verdict;
    explanation.reason = reason;
    let namespace = meta.namespace.as_deref().unwrap_or_default();
    if let Some(pin) = ranges.pins.iter().find(|p| p.namespace == namespace) {
        let reason = match pin.state {
            "honoured" => format!(
                "the pin of namespace {namespace} names {}, an available shard: its hash goes to {} whatever the hash ring says",
                pin.shard, pin.shard
            ),
            "unavailable" => format!(
                "the pin of namespace {namespace} names {}, which is not an available shard, so the hash ring decides until {} becomes available",
                pin.shard, pin.shard
            ),
            _ => format!(
                "the pin of namespace {namespace} is {:?}, which is not a shard name, so the hash ring decides",
                pin.shard
            ),
        };
        explanation.pin = Some(PinExplanation {
            source: PinSource::Namespace.as_str(),
            annotation: view.pin_annotation.clone(),
            value: pin.shard.clone(),
            state: pin.state,
            reason,
        });
    }
    if ranges.ignored_pins.iter().any(|ns| ns == namespace) {
        explanation.notes.push(format!(
            "the pin of namespace {namespace} is ignored: a ring hashing uids spreads a namespace over the whole hash space"
        ));
    }
    if view.own_pin(meta).is_some() {
        explanation.notes.push(
            "its own pin annotation is ignored: on a ServerSide ring the sharder never reads the ring's objects, so object pins cannot work".into(),
        );
    }
    if view.hash_key == HashKey::Namespace && !namespace.is_empty() {
        explanation.notes.push(format!(
            "the ring hashes by namespace: all of its objects in namespace {namespace} are on one shard"
        ));
    }
    explanation
}

fn not_selected(
    ring: &LoadedRing,
    meta: &ObjectMeta,
    placement: &Placement<'_>,
) -> (Verdict, String) {
    let namespace = meta.namespace.as_deref().unwrap_or_default();
    let mut reason = format!(
        "namespace {namespace} is not selected by {}, so neither the sharder nor its webhook touches the object",
        ring.selector_source.describe()
    );
    if let Some(current) = placement.object.current {
        reason.push_str(&format!(
            "; its shard label ({current}) stays as it is (the sharder never removes labels when a selector changes)"
        ));
    }
    (Verdict::NamespaceNotSelected, reason)
}

/// The verdict for an object the ring covers.
fn judge(
    placement: &Placement<'_>,
    resource: &ResolvedResource,
    states: &BTreeMap<String, (ShardState, bool)>,
) -> (Verdict, String) {
    match &placement.key {
        Err(KeyError::GenerateNameNotSupported) => {
            return (
                Verdict::NoName,
                "it has no name yet (only generateName): a main object is hashed by its name, so the webhook lets it be created unassigned and the sharder assigns it right after; to have it assigned in its CREATE, give it a name or hash the ring by namespace (spec.hashKey: Namespace)".into(),
            );
        }
        Ok(KeyOutcome::Unassigned(why)) => return unassigned(why, resource),
        Ok(KeyOutcome::Key(_)) => {}
    }
    let current = placement.object.current;
    let draining = placement.object.draining;
    let Some(desired) = placement.desired else {
        let mut reason = "the ring has no available shard, so nothing is assigned or moved until one becomes available".to_string();
        if let Some(current) = current {
            reason.push_str(&format!("; it stays labelled for {current}"));
        }
        return (Verdict::NoAvailableShard, reason);
    };
    let Some(current) = current else {
        return (
            Verdict::WaitingForSharder,
            format!(
                "it is not assigned yet; the ring wants it on {desired}. The webhook assigns objects when they are created or updated, and the sharder assigns those the webhook missed within seconds and on every sync; if it stays unassigned, check that the sharder runs and its webhook is reachable"
            ),
        );
    };
    let (state, available) = match states.get(current) {
        Some((state, available)) => (Some(*state), *available),
        None => (None, false),
    };
    if current == desired {
        if draining {
            return (
                Verdict::Draining,
                format!(
                    "it is on {desired}, where the ring wants it, but carries the drain label: once {desired} acknowledges by removing both labels, the webhook assigns it to {desired} again"
                ),
            );
        }
        return (
            Verdict::InPlace,
            format!("it is on {desired}, the shard the ring wants"),
        );
    }
    if !available {
        let why = match state {
            Some(state) => format!("is {state} and not available"),
            None => "has no Lease".into(),
        };
        return (
            Verdict::WaitingForSharder,
            format!(
                "its shard {current} {why}; the ring wants it on {desired}: the sharder moves it there on its next sync (it removes the labels and the webhook assigns {desired})"
            ),
        );
    }
    if !resource.is_main() {
        return (
            Verdict::WaitingForSharder,
            format!(
                "it follows its controller, which the ring wants on {desired}, but it is still on {current}: the sharder moves it on its next sync (controlled objects are moved, never drained)"
            ),
        );
    }
    if draining {
        return (
            Verdict::Draining,
            format!(
                "it is being drained: the ring wants it on {desired}, so the sharder asked {current} to let go; once {current} acknowledges by removing both labels, the webhook assigns it to {desired}. If the drain label stays, {current} does not acknowledge drains (stuck, or not running a shard library)"
            ),
        );
    }
    (
        Verdict::WaitingForSharder,
        format!(
            "it is on {current}, but the ring wants it on {desired}: the sharder's next sync adds the drain label, so that {current} lets go before {desired} takes over"
        ),
    )
}

/// The verdict for a controlled object that belongs to no shard.
fn unassigned(why: &Unassigned, resource: &ResolvedResource) -> (Verdict, String) {
    let allowed = match &resource.role {
        ResourceRole::Controlled { controllers } => controllers
            .iter()
            .map(controller_name)
            .collect::<Vec<_>>()
            .join(" or "),
        ResourceRole::Main => String::new(),
    };
    match why {
        Unassigned::NoController => (
            Verdict::NoController,
            format!(
                "it has no owner reference with controller: true, so it belongs to no shard (in this ring it would follow a controlling {allowed}); the sharder leaves it alone"
            ),
        ),
        Unassigned::IneligibleController { group, kind } => (
            Verdict::ForeignController,
            format!(
                "its controller is a {}, which this ring does not list as controlling this resource (only {allowed}), so it belongs to no shard; the sharder leaves it alone",
                controller_name(&ControllerKind::new(group, kind, true))
            ),
        ),
        Unassigned::InvalidApiVersion { api_version } => (
            Verdict::ForeignController,
            format!(
                "its controller reference has apiVersion {api_version:?}, which names no API group and version, so it belongs to no shard; the sharder leaves it alone"
            ),
        ),
    }
}

/// `Kind` for the core group, `Kind.group` otherwise.
fn controller_name(controller: &ControllerKind) -> String {
    if controller.group.is_empty() {
        controller.kind.clone()
    } else {
        format!("{}.{}", controller.kind, controller.group)
    }
}

/// The pin that decided, or failed to decide, the placement of `meta` in the ring of `view`.
fn pin_explanation(
    view: &RingView,
    meta: &ObjectMeta,
    placement: &Placement<'_>,
) -> Option<PinExplanation> {
    let (source, value) = match &placement.pin {
        PinOutcome::Unpinned => return None,
        // An honoured pin names the shard it chose.
        PinOutcome::Honoured { source } => (*source, placement.desired?.to_string()),
        PinOutcome::Unavailable { shard, source } => (*source, shard.clone()),
        PinOutcome::Invalid { value, source } => (*source, value.clone()),
    };
    let holder = match source {
        PinSource::Object => "the object's own pin".to_string(),
        PinSource::Controller => match controller_reference(meta) {
            Some(owner) => format!("the pin of its controller, {} {}", owner.kind, owner.name),
            None => "its controller's pin".to_string(),
        },
        PinSource::Namespace => format!(
            "the pin of namespace {}",
            meta.namespace.as_deref().unwrap_or_default()
        ),
    };
    let reason = match &placement.pin {
        PinOutcome::Honoured { .. } => format!(
            "{holder} names {value}, an available shard, so the pin decides the shard, not the hash ring"
        ),
        PinOutcome::Unavailable { .. } => format!(
            "{holder} names {value}, which is not an available shard, so the hash ring decides until {value} becomes available"
        ),
        _ => format!(
            "{holder} is {value:?}, which is not a shard name (a non-empty label value), so the hash ring decides"
        ),
    };
    Some(PinExplanation {
        source: source.as_str(),
        annotation: view.pin_annotation.clone(),
        value,
        state: placement.pin.state()?,
        reason,
    })
}

/// The owner reference with `controller: true`; the API server allows at most one.
fn controller_reference(meta: &ObjectMeta) -> Option<&OwnerReference> {
    meta.owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
}

/// Where to read a controlled object's controller, and the hash key the two share.
#[derive(Debug)]
struct ControllerAt<'v> {
    /// The controlled object's hash key, which is its controller's.
    key: String,
    /// The controller's resource, a main resource of the ring.
    resource: &'v GroupResource,
    /// Kind and scope of that resource.
    info: &'v ResourceInfo,
    /// The controller's namespace; empty for a cluster-scoped controller.
    namespace: String,
    /// The controller's name.
    name: String,
}

/// Where to read the controller of the controlled object `meta` of `gr` in the ring of `view`;
/// `None` for a main object, or one without an eligible controller.
fn controller_of<'v>(
    view: &'v RingView,
    gr: &GroupResource,
    meta: &ObjectMeta,
) -> Option<ControllerAt<'v>> {
    let resource = view.resources.get(gr).filter(|r| !r.is_main())?;
    let Ok(KeyOutcome::Key(key)) = view.placement(&gr.group, resource, meta).key else {
        return None;
    };
    let owner = controller_reference(meta)?;
    let group = parse_group(&owner.api_version)?;
    let (controller_gr, controller) = view
        .resources
        .iter()
        .find(|(cgr, c)| c.is_main() && cgr.group == group && c.info.kind == owner.kind)?;
    let namespace = meta
        .namespace
        .clone()
        .filter(|_| controller.info.namespaced)
        .unwrap_or_default();
    Some(ControllerAt {
        key,
        resource: controller_gr,
        info: &controller.info,
        namespace,
        name: owner.name.clone(),
    })
}

/// Reads the controller of the controlled object `meta` of `gr` in every ring, and remembers its
/// pin as the sharder's sync does when it walks the controller before its children.
async fn remember_controller_pins(
    client: &kube::Client,
    rings: &[LoadedRing],
    gr: &GroupResource,
    meta: &ObjectMeta,
) -> Result<(), Error> {
    for ring in rings {
        let view = &ring.view;
        let Some(at) = controller_of(view, gr, meta) else {
            continue;
        };
        let found = cluster::object(client, at.resource, at.info, &at.namespace, &at.name).await?;
        if let Some(controller) = found {
            view.pins
                .main_seen(&view.ring_ref(), &at.key, view.own_pin(&controller));
        }
    }
    Ok(())
}

/// Facts that help reading the verdict: how the key came about, generateName, stale labels, an
/// ignored pin.
fn notes(
    view: &RingView,
    resource: &ResolvedResource,
    meta: &ObjectMeta,
    placement: &Placement<'_>,
) -> Vec<String> {
    let hash_key = view.hash_key;
    let mut notes = Vec::new();
    let namespace = meta.namespace.as_deref().filter(|ns| !ns.is_empty());
    let by_namespace = hash_key == HashKey::Namespace && namespace.is_some();
    if by_namespace {
        notes.push(format!(
            "the ring hashes by namespace: all of its objects in namespace {} land on one shard",
            namespace.unwrap_or_default()
        ));
    } else if !resource.is_main() && matches!(placement.key, Ok(KeyOutcome::Key(_))) {
        // A key for a controlled object means it has an eligible controller.
        if let Some(owner) = controller_reference(meta) {
            notes.push(format!(
                "a controlled object is hashed by its controller, {} {}",
                owner.kind, owner.name
            ));
        }
    }
    if let Some(prefix) = meta.generate_name.as_deref().filter(|p| !p.is_empty()) {
        notes.push(if by_namespace {
            format!("created with generateName {prefix:?}, which works here because the ring hashes by namespace")
        } else if !resource.is_main() {
            format!("created with generateName {prefix:?}, which works for controlled objects: they are hashed by their controller")
        } else {
            format!(
                "created with generateName {prefix:?}: the webhook denies such creates for main objects of this ring, so this one got its name while the ring did not cover it (or its webhook was unreachable); it is hashed by that name"
            )
        });
    }
    if placement.object.draining && placement.object.current.is_none() {
        notes.push(
            "it carries a drain label without a shard label; the next assignment removes it".into(),
        );
    }
    if !resource.is_main()
        && let Some(value) = view.own_pin(meta)
    {
        notes.push(format!(
            "its own pin annotation ({value:?}) is ignored: a controlled object follows its controller's pin"
        ));
    }
    notes
}

/// Finds the object and explains it in every ring covering its resource.
pub(crate) async fn run(
    connection: &Connection,
    resource: &str,
    name: &str,
    namespace: &str,
) -> Result<ExplainReport, Error> {
    let client = &connection.client;
    let catalog = Catalog::discover(client).await?;
    let entry = catalog.resolve(resource)?;
    let gr = &entry.resource;
    let meta = cluster::object(client, gr, &entry.info, namespace, name)
        .await?
        .ok_or_else(|| Error::ObjectNotFound {
            resource: gr.to_string(),
            name: name.to_string(),
            namespace: entry.info.namespaced.then(|| namespace.to_string()),
        })?;
    let rings: Vec<_> = cluster::rings(client, &RingKind::ALL, None)
        .await?
        .into_iter()
        .filter(|ring| {
            ring.spec().resources.iter().any(|entry| {
                &entry.group_resource() == gr || entry.controlled_resources.contains(gr)
            })
        })
        .collect();
    let mut loaded = cluster::load_rings(client, rings, &catalog.infos()).await?;
    let namespaces = match meta.namespace.as_deref() {
        Some(ns) if !loaded.is_empty() => cluster::namespaces(client, Some(ns)).await?,
        _ => cluster::Namespaces::from_metadata([]),
    };
    cluster::give_pins(&mut loaded, &namespaces);
    remember_controller_pins(client, &loaded, gr, &meta).await?;
    let now = Timestamp::now();
    let rings = loaded
        .iter()
        .filter_map(|ring| {
            let selected = covers(&ring.view, meta.namespace.as_deref(), &namespaces.labels);
            explain_ring(ring, gr, &meta, selected, now)
        })
        .collect();
    Ok(ExplainReport {
        resource: gr.to_string(),
        kind: entry.info.kind.clone(),
        name: name.to_string(),
        namespace: meta.namespace.clone(),
        rings,
    })
}

/// The report as text: a headline, then one block per ring.
pub(crate) fn table(report: &ExplainReport) -> String {
    let mut text = format!("{} {}", report.kind, report.name);
    if let Some(ns) = &report.namespace {
        text.push_str(&format!(" in namespace {ns}"));
    }
    text.push_str(&format!(" ({})\n", report.resource));
    if report.rings.is_empty() {
        text.push_str(&format!(
            "No ClusterRing or ControllerRing covers {}.\n",
            report.resource
        ));
        return text;
    }
    for ring in &report.rings {
        text.push_str(&format!(
            "\n{} {} ({} resource, hashKey {}, assignment {})\n",
            ring.ring_kind, ring.ring, ring.role, ring.hash_key, ring.assignment
        ));
        if matches!(
            ring.verdict,
            Verdict::NamespaceNotSelected | Verdict::RingInvalid
        ) {
            // Keys and shards mean nothing where the sharder does not act.
            let mut table = Table::new(["verdict:", &format!("{:?}", ring.verdict)]);
            table.row(vec!["why:".into(), ring.reason.clone()]);
            text.push_str(&table.render("  "));
            continue;
        }
        if let Some(ranges) = &ring.ranges {
            text.push_str(&ranges_rows(ring, ranges).render("  "));
            continue;
        }
        let mut table = Table::new(["hash key:", &or_dash(ring.key.as_ref())]);
        table.row(vec![
            "ring wants:".into(),
            or_dash(ring.desired_shard.as_ref()),
        ]);
        if let Some(pin) = &ring.pin {
            table.row(vec![
                "pin:".into(),
                format!("{}: {}", pin.state, pin.reason),
            ]);
        }
        table.row(vec!["shard label:".into(), label(&ring.shard_label)]);
        table.row(vec!["drain label:".into(), label(&ring.drain_label)]);
        table.row(vec!["verdict:".into(), format!("{:?}", ring.verdict)]);
        table.row(vec!["why:".into(), ring.reason.clone()]);
        for note in &ring.notes {
            table.row(vec!["note:".into(), note.clone()]);
        }
        text.push_str(&table.render("  "));
    }
    text
}

/// The rows of an object of a `ServerSide` ring: its hash, who holds it, who should.
fn ranges_rows(ring: &RingExplanation, ranges: &RangeExplanation) -> Table {
    let mut table = Table::new(["hashes:", &format!("{} = {}", ranges.field, ranges.value)]);
    table.row(vec!["hash:".into(), ranges.hash.clone()]);
    let held = match (&ranges.held_by, ranges.generation) {
        (Some(shard), Some(generation)) => format!(
            "{shard} (generation {generation}, {})",
            if ranges.acknowledged {
                "acknowledged"
            } else {
                "not acknowledged yet"
            }
        ),
        _ => "no shard".into(),
    };
    table.row(vec!["held by:".into(), held]);
    table.row(vec![
        "ring wants:".into(),
        or_dash(ring.desired_shard.as_ref()),
    ]);
    if let Some(pin) = &ring.pin {
        table.row(vec![
            "pin:".into(),
            format!("{}: {}", pin.state, pin.reason),
        ]);
    }
    table.row(vec!["verdict:".into(), format!("{:?}", ring.verdict)]);
    table.row(vec!["why:".into(), ring.reason.clone()]);
    for note in &ring.notes {
        table.row(vec!["note:".into(), note.clone()]);
    }
    table
}

fn label(label: &Label) -> String {
    match &label.value {
        Some(value) => format!("{}={value}", label.key),
        None => format!("{} (not set)", label.key),
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{lease, loaded, names_on, now, object, pin_namespace, pinned};
    use super::*;

    fn secrets() -> GroupResource {
        GroupResource::new("", "secrets")
    }

    fn configmaps() -> GroupResource {
        GroupResource::new("", "configmaps")
    }

    fn explain(ring: &LoadedRing, gr: &GroupResource, meta: &ObjectMeta) -> RingExplanation {
        explain_ring(ring, gr, meta, true, now()).expect("a resource of the ring")
    }

    #[test]
    fn in_place_draining_and_waiting_main_objects() {
        let ring = loaded(vec![lease("a", "a", 1, None), lease("b", "b", 1, None)]);
        let (shard, drain) = (ring.view.shard_label.clone(), ring.view.drain_label.clone());
        let on_a = &names_on(&ring.view, "a", 1)[0];

        let placed = explain(&ring, &secrets(), &object(on_a, &[(&shard, "a")], None));
        assert_eq!(placed.verdict, Verdict::InPlace);
        assert_eq!(
            placed.key.as_deref(),
            Some(format!("/Secret/ns/{on_a}").as_str())
        );
        assert_eq!(placed.desired_shard.as_deref(), Some("a"));
        assert_eq!(placed.shard_label.value.as_deref(), Some("a"));
        assert_eq!(placed.drain_label.value, None);
        assert_eq!(placed.reason, "it is on a, the shard the ring wants");

        let drained = explain(
            &ring,
            &secrets(),
            &object(on_a, &[(&shard, "b"), (&drain, "true")], None),
        );
        assert_eq!(drained.verdict, Verdict::Draining);
        assert!(
            drained.reason.contains("asked b to let go"),
            "{}",
            drained.reason
        );

        let not_yet = explain(&ring, &secrets(), &object(on_a, &[(&shard, "b")], None));
        assert_eq!(not_yet.verdict, Verdict::WaitingForSharder);
        assert!(
            not_yet.reason.contains("adds the drain label"),
            "{}",
            not_yet.reason
        );

        let unassigned = explain(&ring, &secrets(), &object(on_a, &[], None));
        assert_eq!(unassigned.verdict, Verdict::WaitingForSharder);
        assert!(unassigned.reason.contains("not assigned yet"));
    }

    #[test]
    fn objects_on_unavailable_shards_are_moved() {
        let ring = loaded(vec![lease("a", "a", 1, None), lease("dead", "", 1, None)]);
        let shard = ring.view.shard_label.clone();
        let on_dead = explain(&ring, &secrets(), &object("s", &[(&shard, "dead")], None));
        assert_eq!(on_dead.verdict, Verdict::WaitingForSharder);
        assert!(
            on_dead
                .reason
                .contains("its shard dead is dead and not available"),
            "{}",
            on_dead.reason
        );
        let on_gone = explain(&ring, &secrets(), &object("s", &[(&shard, "gone")], None));
        assert!(
            on_gone.reason.contains("its shard gone has no Lease"),
            "{}",
            on_gone.reason
        );
    }

    #[test]
    fn controlled_objects_follow_their_controller() {
        let ring = loaded(vec![lease("a", "a", 1, None), lease("b", "b", 1, None)]);
        let shard = ring.view.shard_label.clone();
        let on_a = &names_on(&ring.view, "a", 1)[0];
        let child = explain(
            &ring,
            &configmaps(),
            &object("child", &[(&shard, "b")], Some(on_a)),
        );
        assert_eq!(child.role, "controlled");
        assert_eq!(
            child.key.as_deref(),
            Some(format!("/Secret/ns/{on_a}").as_str())
        );
        assert_eq!(child.verdict, Verdict::WaitingForSharder);
        assert!(child.reason.contains("never drained"), "{}", child.reason);
        assert_eq!(
            child.notes,
            [format!(
                "a controlled object is hashed by its controller, Secret {on_a}"
            )]
        );

        let orphan = explain(&ring, &configmaps(), &object("orphan", &[], None));
        assert_eq!(orphan.verdict, Verdict::NoController);
        assert!(
            orphan.reason.contains("follow a controlling Secret"),
            "{}",
            orphan.reason
        );

        let mut foreign = object("foreign", &[], Some("d"));
        if let Some(owner) = foreign
            .owner_references
            .as_mut()
            .and_then(|o| o.first_mut())
        {
            owner.api_version = "apps/v1".into();
            owner.kind = "Deployment".into();
        }
        let foreign = explain(&ring, &configmaps(), &foreign);
        assert_eq!(foreign.verdict, Verdict::ForeignController);
        assert!(
            foreign.reason.contains("Deployment.apps"),
            "{}",
            foreign.reason
        );
    }

    #[test]
    fn no_name_no_shard_and_unselected_namespaces() {
        let ring = loaded(vec![lease("a", "a", 1, None)]);
        let mut unnamed = object("x", &[], None);
        unnamed.name = None;
        unnamed.generate_name = Some("gen-".into());
        let unnamed = explain(&ring, &secrets(), &unnamed);
        assert_eq!(unnamed.verdict, Verdict::NoName);
        assert!(
            unnamed.notes[0].contains("webhook denies such creates"),
            "{:?}",
            unnamed.notes
        );

        let empty = loaded(vec![lease("dead", "", 1, None)]);
        let none = explain(&empty, &secrets(), &object("s", &[], None));
        assert_eq!(none.verdict, Verdict::NoAvailableShard);

        let outside = explain_ring(&ring, &secrets(), &object("s", &[], None), false, now())
            .expect("a resource of the ring");
        assert_eq!(outside.verdict, Verdict::NamespaceNotSelected);
        assert_eq!((outside.key, outside.desired_shard), (None, None));
        assert!(
            outside.reason.contains("namespace ns is not selected"),
            "{}",
            outside.reason
        );

        let mut invalid = loaded(vec![lease("a", "a", 1, None)]);
        invalid.invalid = Some("resource listed twice".into());
        let invalid = explain(&invalid, &secrets(), &object("s", &[], None));
        assert_eq!(invalid.verdict, Verdict::RingInvalid);

        // A resource outside the ring has no explanation in it.
        assert!(
            explain_ring(
                &ring,
                &GroupResource::new("apps", "deployments"),
                &object("d", &[], None),
                true,
                now()
            )
            .is_none()
        );
    }

    #[test]
    fn an_objects_own_pin_decides_or_says_why_not() {
        let ring = loaded(vec![lease("a", "a", 1, None), lease("b", "b", 1, None)]);
        let view = &ring.view;
        let on_a = &names_on(view, "a", 1)[0];

        let honoured = explain(
            &ring,
            &secrets(),
            &pinned(object(on_a, &[], None), view, "b"),
        );
        assert_eq!(honoured.desired_shard.as_deref(), Some("b"));
        let pin = honoured.pin.expect("a pin applies");
        assert_eq!(
            (pin.source, pin.value.as_str(), pin.state),
            ("object", "b", "honoured")
        );
        assert_eq!(pin.annotation, view.pin_annotation);
        assert_eq!(
            pin.reason,
            "the object's own pin names b, an available shard, so the pin decides the shard, not the hash ring"
        );

        let unavailable = explain(
            &ring,
            &secrets(),
            &pinned(object(on_a, &[], None), view, "z"),
        );
        assert_eq!(unavailable.desired_shard.as_deref(), Some("a"));
        let pin = unavailable.pin.expect("a pin applies");
        assert_eq!((pin.value.as_str(), pin.state), ("z", "unavailable"));
        assert!(
            pin.reason
                .contains("so the hash ring decides until z becomes available"),
            "{}",
            pin.reason
        );

        let invalid = explain(
            &ring,
            &secrets(),
            &pinned(object(on_a, &[], None), view, "-z"),
        );
        assert_eq!(invalid.desired_shard.as_deref(), Some("a"));
        let pin = invalid.pin.expect("a pin applies");
        assert_eq!((pin.value.as_str(), pin.state), ("-z", "invalid"));
        assert!(pin.reason.contains("not a shard name"), "{}", pin.reason);

        let unpinned = explain(&ring, &secrets(), &object(on_a, &[], None));
        assert!(unpinned.pin.is_none());
        // Where the sharder does not act, no pin applies either.
        let outside = explain_ring(
            &ring,
            &secrets(),
            &pinned(object(on_a, &[], None), view, "b"),
            false,
            now(),
        )
        .expect("a resource of the ring");
        assert!(outside.pin.is_none());
    }

    #[test]
    fn namespace_pins_yield_to_the_objects_own() {
        let mut ring = loaded(vec![lease("a", "a", 1, None), lease("b", "b", 1, None)]);
        pin_namespace(&mut ring.view, "b");
        let view = &ring.view;
        let on_a = &names_on(view, "a", 1)[0];
        let shard = view.shard_label.clone();

        let by_namespace = explain(&ring, &secrets(), &object(on_a, &[(&shard, "b")], None));
        assert_eq!(by_namespace.verdict, Verdict::InPlace);
        assert_eq!(by_namespace.desired_shard.as_deref(), Some("b"));
        let pin = by_namespace.pin.expect("the namespace's pin applies");
        assert_eq!((pin.source, pin.state), ("namespace", "honoured"));
        assert!(
            pin.reason.starts_with("the pin of namespace ns names b"),
            "{}",
            pin.reason
        );

        let own = explain(
            &ring,
            &secrets(),
            &pinned(object(on_a, &[], None), view, "a"),
        );
        assert_eq!(own.desired_shard.as_deref(), Some("a"));
        assert_eq!(own.pin.map(|p| p.source), Some("object"));
    }

    #[test]
    fn controlled_objects_follow_their_controllers_pin() {
        let ring = loaded(vec![lease("a", "a", 1, None), lease("b", "b", 1, None)]);
        let view = &ring.view;
        let on_a = &names_on(view, "a", 1)[0];
        // Its own annotation does not count: only the controller's.
        let child = pinned(object("child", &[], Some(on_a)), view, "b");
        let before = explain(&ring, &configmaps(), &child);
        assert_eq!(before.desired_shard.as_deref(), Some("a"));
        assert!(before.pin.is_none());
        assert!(
            before
                .notes
                .iter()
                .any(|n| n.contains("its own pin annotation (\"b\") is ignored")),
            "{:?}",
            before.notes
        );

        // `run` reads the controller from here and remembers its pin.
        let at = controller_of(view, &configmaps(), &child).expect("an eligible controller");
        assert_eq!(at.key, format!("/Secret/ns/{on_a}"));
        assert_eq!(at.resource, &secrets());
        assert_eq!(at.info.kind, "Secret");
        assert_eq!(
            (at.namespace.as_str(), at.name.as_str()),
            ("ns", on_a.as_str())
        );
        let controller_meta = pinned(object(on_a, &[], None), view, "b");
        view.pins
            .main_seen(&view.ring_ref(), &at.key, view.own_pin(&controller_meta));

        let after = explain(&ring, &configmaps(), &child);
        assert_eq!(after.desired_shard.as_deref(), Some("b"));
        let pin = after.pin.expect("the controller's pin applies");
        assert_eq!((pin.source, pin.state), ("controller", "honoured"));
        assert!(
            pin.reason
                .starts_with(&format!("the pin of its controller, Secret {on_a} names b")),
            "{}",
            pin.reason
        );
        // Main objects and orphans have no controller to read.
        assert!(controller_of(view, &secrets(), &controller_meta).is_none());
        assert!(controller_of(view, &configmaps(), &object("orphan", &[], None)).is_none());
    }

    /// The report on Secret `s` in namespace `ns` with one ring's `explanation`.
    fn report_of(explanation: RingExplanation) -> ExplainReport {
        ExplainReport {
            resource: "secrets".into(),
            kind: "Secret".into(),
            name: "s".into(),
            namespace: Some("ns".into()),
            rings: vec![explanation],
        }
    }

    #[test]
    fn table_shows_the_pin() {
        let mut ring = loaded(vec![lease("a", "a", 1, None), lease("b", "b", 1, None)]);
        pin_namespace(&mut ring.view, "z");
        let shard = ring.view.shard_label.clone();
        let meta = pinned(object("s", &[(&shard, "b")], None), &ring.view, "b");
        let report = report_of(explain(&ring, &secrets(), &meta));
        let expected = "\
Secret s in namespace ns (secrets)

ClusterRing r (main resource, hashKey Object, assignment Webhook)
  hash key:      /Secret/ns/s
  ring wants:    b
  pin:           honoured: the object's own pin names b, an available shard, so the pin decides the shard, not the hash ring
  shard label:   shard.alpha.sharding.timebertt.dev/clusterring-454349e4-r=b
  drain label:   drain.alpha.sharding.timebertt.dev/clusterring-454349e4-r (not set)
  verdict:       InPlace
  why:           it is on b, the shard the ring wants
";
        assert_eq!(table(&report), expected);

        let unpinned = explain(&ring, &secrets(), &object("s", &[(&shard, "b")], None));
        let text = table(&report_of(unpinned));
        assert!(
            text.contains("  pin:           unavailable: the pin of namespace ns names z, which is not an available shard, so the hash ring decides until z becomes available\n"),
            "{text}"
        );
    }

    #[test]
    fn table_shows_labels_and_reason() {
        let ring = loaded(vec![lease("a", "a", 1, None)]);
        let shard = ring.view.shard_label.clone();
        let report = report_of(explain(
            &ring,
            &secrets(),
            &object("s", &[(&shard, "a")], None),
        ));
        let expected = "\
Secret s in namespace ns (secrets)

ClusterRing r (main resource, hashKey Object, assignment Webhook)
  hash key:      /Secret/ns/s
  ring wants:    a
  shard label:   shard.alpha.sharding.timebertt.dev/clusterring-454349e4-r=a
  drain label:   drain.alpha.sharding.timebertt.dev/clusterring-454349e4-r (not set)
  verdict:       InPlace
  why:           it is on a, the shard the ring wants
";
        assert_eq!(table(&report), expected);
    }

    #[test]
    fn an_object_of_a_server_side_ring_is_explained_by_its_hash() {
        use super::super::fixtures::{published, server_side, with_ranges};
        use kube_sharding_api::ranges::{RangeRing, fnv1a64};
        let target = RangeRing::new(["a", "b"]).ranges();
        let annotation = |generation: u64, shard: &str| published(generation, &target[shard]);
        // b has not been granted its share yet: a was cut down and acknowledged.
        let ring = server_side(
            vec![
                with_ranges(
                    lease("a", "a", 1, None),
                    Some(&annotation(4, "a")),
                    Some("4"),
                ),
                lease("b", "b", 1, None),
            ],
            HashKey::Object,
        );
        let uid_for = |shard: &str| {
            (0..10_000)
                .map(|i| format!("uid-{i}"))
                .find(|uid| target[shard].contains(fnv1a64(uid)))
                .expect("a uid in the shard's target")
        };
        let with_uid = |uid: &str| ObjectMeta {
            uid: Some(uid.into()),
            ..object("s", &[], None)
        };
        let in_a = explain_ring(&ring, &secrets(), &with_uid(&uid_for("a")), true, now())
            .expect("covered");
        assert_eq!(in_a.verdict, Verdict::InPlace);
        let ranges = in_a.ranges.as_ref().expect("ranges");
        assert_eq!(ranges.field, "object.metadata.uid");
        assert_eq!(ranges.hash, format!("0x{:016x}", fnv1a64(&uid_for("a"))));
        assert_eq!(
            (
                ranges.held_by.as_deref(),
                ranges.generation,
                ranges.acknowledged
            ),
            (Some("a"), Some(4), true)
        );
        assert_eq!(in_a.desired_shard.as_deref(), Some("a"));
        let in_b = explain_ring(&ring, &secrets(), &with_uid(&uid_for("b")), true, now())
            .expect("covered");
        assert_eq!(in_b.verdict, Verdict::WaitingForSharder);
        assert_eq!(in_b.desired_shard.as_deref(), Some("b"));
        assert!(in_b.ranges.as_ref().is_some_and(|r| r.held_by.is_none()));
        assert!(
            in_b.reason.contains("in no shard's published ranges"),
            "{}",
            in_b.reason
        );
        let report = ExplainReport {
            resource: "secrets".into(),
            kind: "Secret".into(),
            name: "s".into(),
            namespace: Some("ns".into()),
            rings: vec![in_a],
        };
        let text = table(&report);
        assert!(
            text.contains("held by:      a (generation 4, acknowledged)"),
            "{text}"
        );
        assert!(!text.contains("shard label:"), "{text}");
        // An object's own pin cannot work on such a ring, and says so.
        let pinned_object = pinned(with_uid(&uid_for("a")), &ring.view, "b");
        let explained =
            explain_ring(&ring, &secrets(), &pinned_object, true, now()).expect("covered");
        assert_eq!(explained.desired_shard.as_deref(), Some("a"));
        assert!(
            explained
                .notes
                .iter()
                .any(|n| n.contains("object pins cannot work")),
            "{:?}",
            explained.notes
        );
    }
}
