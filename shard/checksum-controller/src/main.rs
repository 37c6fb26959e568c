//! `checksum-controller`: the example shard (docs/protocol.md §13), a package of its own so that
//! the `shard` library does not carry the dependencies of a binary (flags, log output, hashing).
//!
//! Joins a ring whose main resource is `secrets` and controlled resource is `configmaps`. For each
//! Secret it owns it applies a ConfigMap `checksums-<secret>`, controlled by the Secret, mapping
//! every Secret key to the lowercase hex SHA-256 of its value. By default every write labels the
//! ConfigMap with this shard, so a ConfigMap follows its Secret with the new shard's first write;
//! with `--leave-children-to-sharder` only the create does, and ConfigMaps follow their Secret by
//! the sharder's moves alone: a create that finds the ConfigMap already there (a Secret that
//! moved here) writes nothing more and waits for the sharder to bring it.
//!
//! Order of life ([`kube_sharding::Shard::run`]): acquire the shard Lease, then run the controller and the
//! departures watch; exit non-zero the moment the Lease is lost; on SIGTERM/SIGINT stop the
//! controller, release the Lease (or, with `--on-shutdown=keep-if-returning`, keep it when the
//! shard's StatefulSet recreates its pod), exit 0; when the sharder excludes the shard, stop at once,
//! release the Lease and rejoin after `--rejoin-pause`.
//!
//! Every record that tells what the shard did carries an `event` field; `--log-format=json` prints
//! one JSON object per line with the fields at the top level:
//!
//! | `event` | fields |
//! |---|---|
//! | `reconcile` (a reconcile starts) | `namespace`, `name`, `shard` |
//! | `applied` (the ConfigMap write of a reconcile succeeded) | `namespace`, `name`, `shard`, `configmap` |
//! | `up_to_date` (a reconcile found its ConfigMap in the shard's cache as it would write it, and wrote nothing, not even the ownership read) | `namespace`, `name`, `shard`, `configmap` |
//! | `awaiting_move` (with `--leave-children-to-sharder`: the create found the ConfigMap on another shard; the Secret is reconciled again when it arrives; after 10 s without, the ConfigMap is read, and waited for again if it is the Secret's, else written) | `namespace`, `name`, `shard`, `configmap` |
//! | `write_refused` (a reconcile stopped before its write: [`kube_sharding::Ownership::confirm`] said no) | `namespace`, `name`, `shard`, `error` |
//! | `drain` (a drain was acknowledged) | `namespace`, `name`, `shard`, `resource_version` (of the Secret, the version the patch was conditioned on), `took_ms` (the acknowledging write's round trip, milliseconds) |
//! | `released` (a Secret left this shard, [`kube_sharding::Departure::Released`]) | `namespace`, `name`, `shard`, `how` (`drained`, `reassigned`, `found_moved`), `had_state`, `checksums` (of the dropped record), `released_total` |
//! | `deleted` (a Secret of this shard was deleted, [`kube_sharding::Departure::Deleted`]) | `namespace`, `name`, `shard`, `had_state`, `checksums`, `deleted_total` |
//! | `lease_acquired`, `lease_lost`, `lease_released`, `lease_excluded` (the shard library's) | `lease`, `namespace`, `resource_version` (of the Lease as written), see [`kube_sharding::records`] |
//! | `shard_excluded` (the shard library's: stepped out of the ring, rejoining after a pause) | `shard`, `reason`, `released` |
//! | `lease_kept` (the shard library's: on SIGTERM with `--on-shutdown=keep-if-returning`, the StatefulSet recreates this pod, the Lease stays held for it) | `shard`, `statefulset`, `ordinal`, `replicas` |
//! | `shard_stopped` | `shard`, `reason` (`lease_lost` or `shutdown`), `lease_kept` (with `shutdown`) |
//!
//! Its Lease reports the shard's load (docs/protocol.md §23, [`kube_sharding::LoadMeter`]): the
//! Secrets it holds, those changed since their last successful reconcile, and the reconciles'
//! p50/p99 and errors over the last 60 s.
//!
//! Its local state is an in-memory record of what it served per Secret (the Secret's UID and
//! the number of checksums); a record is dropped when the Secret leaves the shard (`released`)
//! or is deleted (`deleted`), and counted by which, and survives a rejoin after an exclusion
//! (the next term reports Secrets that left meanwhile).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use kube_sharding::{
    Departure, LeaseLock, LoadMeter, ObjectKey, OnShutdown, Ownership, OwnershipError,
    ReconcileError, RestartBackoff, Shard, ShardField, ShardRunEnd, StatefulSetPod, Term,
};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use tracing_subscriber::EnvFilter;

/// Field manager of the ConfigMaps this controller applies.
const FIELD_MANAGER: &str = "checksum-controller";

/// Field manager of the ConfigMaps' creates with `--leave-children-to-sharder`.
const CREATE_FIELD_MANAGER: &str = "checksum-controller-create";

/// Prefix of the ConfigMap names.
const CONFIG_MAP_PREFIX: &str = "checksums-";

/// How long to wait before retrying a failed reconcile.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// With `--leave-children-to-sharder`, how long a reconcile that found its ConfigMap on another
/// shard waits for the sharder's move (which reconciles the Secret again the moment it arrives)
/// before it reads the ConfigMap: one controlled by the Secret is waited for again, any other one
/// (which the sharder never moves here) gets its checksums.
const AWAIT_MOVE: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// What the shard does with its Lease on SIGTERM ([`kube_sharding::OnShutdown`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ShutdownMode {
    /// Release it: the sharder moves the Secrets to the other shards at once (a Deployment's
    /// pods, whose names never come back).
    Release,
    /// Keep it when the shard's StatefulSet recreates its pod under the same name (a rollout):
    /// the returning pod renews it and carries on with the same Secrets, nothing moves. Releases
    /// on scale-in and when the StatefulSet cannot be read.
    KeepIfReturning,
}

/// The field a zero-write ring hashes (`spec.hashKey` of the ring).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ServerSideHashKey {
    /// `hashKey: Object`: the Secret's uid.
    Object,
    /// `hashKey: Namespace`: the Secret's namespace.
    Namespace,
}

/// Example shard of controller-sharding: writes SHA-256 checksums of Secrets into ConfigMaps.
#[derive(Debug, clap::Parser)]
#[command(version)]
struct Args {
    /// Name of the ring to join (a ClusterRing unless `--ring-kind` says otherwise).
    #[arg(long, visible_alias = "ring", default_value = "checksum-controller")]
    clusterring: String,
    /// Kind of the ring to join: `ClusterRing` or `ControllerRing`.
    #[arg(long, default_value = "ClusterRing")]
    ring_kind: kube_sharding::RingKind,
    /// Weight of this shard (1 to 10): it receives about this many times the share of a shard
    /// of weight 1. Without it, the Lease carries no weight annotation (weight 1).
    #[arg(long)]
    weight: Option<u32>,
    /// Only watch Secrets and ConfigMaps in this namespace (default: all namespaces).
    #[arg(long)]
    namespace: Option<String>,
    /// Namespace of the shard Lease (default: the namespace of the kube config or service
    /// account, else `default`).
    #[arg(long)]
    lease_namespace: Option<String>,
    /// Name of this shard (default: the host name, i.e. the pod name).
    #[arg(long)]
    shard_name: Option<String>,
    /// Lease duration in seconds.
    #[arg(long, default_value = "15", value_parser = parse_seconds)]
    lease_duration: Duration,
    /// Seconds without a successful renewal after which the Lease counts as lost.
    #[arg(long, default_value = "10", value_parser = parse_seconds)]
    renew_deadline: Duration,
    /// Seconds between renewals and between attempts to acquire the Lease.
    #[arg(long, default_value = "2", value_parser = parse_seconds)]
    retry_period: Duration,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Log filter (`tracing` env-filter syntax); `RUST_LOG` takes precedence when set.
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Seconds to wait before rejoining the ring after the sharder excluded this shard.
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    rejoin_pause: Duration,
    /// Seconds after taking its Lease without any sharder labelling it (no sharder serves the
    /// ring) before the shard starts without the sharder's `ready`.
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    judgement_fallback: Duration,
    /// Leave the ConfigMaps' shard label to the sharder: create each ConfigMap once with the
    /// Secret's shard label and never relabel it afterwards, so that ConfigMaps follow their
    /// Secret only by the sharder's moves (as shards written for the protocol alone do). The
    /// shard's Lease says so, and the sharder then moves each ConfigMap as its Secret's drain is
    /// acknowledged. Without it every write labels the ConfigMap with this shard.
    #[arg(long)]
    leave_children_to_sharder: bool,
    /// Join a zero-write ring (`spec.assignment: ServerSide`): list and watch only the Secrets
    /// in the hash ranges the sharder publishes on this shard's Lease, hashing the Secret's uid
    /// (`object`, the default) or its namespace as the ring's `hashKey` says. The ConfigMaps
    /// stay selected by this shard's label, which every write puts on them.
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "object")]
    server_side: Option<ServerSideHashKey>,
    /// What to do with the shard Lease on SIGTERM. `keep-if-returning` is for shards run by a
    /// StatefulSet and named after their pod (`<statefulset>-<ordinal>`): the shard reads its
    /// StatefulSet (in the Lease namespace; needs `get` on it) and keeps its Lease over the
    /// restart when its ordinal is below `spec.replicas`.
    #[arg(long, env = "SHARD_ON_SHUTDOWN", value_enum, default_value_t = ShutdownMode::Release)]
    on_shutdown: ShutdownMode,
    /// With `--on-shutdown=keep-if-returning`: the StatefulSet running this shard (default: the
    /// shard name without its `-<ordinal>` suffix).
    #[arg(long, env = "SHARD_STATEFULSET")]
    statefulset: Option<String>,
    /// Reconciles (and drain acknowledgements) run at once at most; 0: no bound.
    #[arg(long, default_value_t = 0)]
    max_concurrent_reconciles: u16,
    /// For tests only: write the Lease's timestamps this many seconds off the system clock
    /// (negative: behind), as a shard on a machine with a wrong clock would.
    #[arg(long, hide = true, allow_hyphen_values = true)]
    testing_clock_offset: Option<i64>,
    /// For tests only: reconciles of Secrets whose name starts with `slow-` wait this many
    /// seconds before they write, as a reconcile calling a slow system would.
    #[arg(long, hide = true, value_parser = parse_seconds)]
    testing_reconcile_delay: Option<Duration>,
}

fn parse_seconds(value: &str) -> Result<Duration, String> {
    let seconds: f64 = value
        .parse()
        .map_err(|e| format!("not a number of seconds: {e}"))?;
    Duration::try_from_secs_f64(seconds)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| "must be a positive number of seconds".to_string())
}

/// Prefix of the Secrets whose reconciles `--testing-reconcile-delay` slows down.
const SLOW_PREFIX: &str = "slow-";

/// Errors of one reconcile.
#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("failed to read or write ConfigMap {namespace}/{name}")]
    Apply {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("Secret {0} has no namespace")]
    NoNamespace(String),
    #[error(transparent)]
    Ownership(#[from] OwnershipError),
}

/// What this shard served for one Secret.
#[derive(Debug, Clone)]
struct Served {
    /// The Secret's UID when it was served.
    uid: Option<String>,
    /// How many checksums its ConfigMap holds.
    checksums: usize,
}

/// The controller's local state: what it served per Secret (by namespace and name), kept across
/// membership terms, and how many records left by release and by deletion.
#[derive(Debug, Default)]
struct LocalState {
    served: BTreeMap<(String, String), Served>,
    /// With `--leave-children-to-sharder`: Secrets whose ConfigMap create found it on another
    /// shard. The next reconcile that still does not find it in the cache reads it
    /// ([`Write::after_waiting`]).
    awaiting_move: BTreeSet<(String, String)>,
    released_total: u64,
    deleted_total: u64,
}

/// What every reconcile needs.
struct Context {
    /// Client for writing ConfigMaps.
    client: Client,
    /// This shard (for its name and label key).
    shard: Shard,
    /// The local state, shared with the departure handler.
    state: Arc<Mutex<LocalState>>,
    /// `--testing-reconcile-delay`.
    slow_down: Option<Duration>,
    /// `--leave-children-to-sharder`.
    leave_children: bool,
    /// This shard's ConfigMaps as its watch last saw them: a reconcile whose ConfigMap is there
    /// as it would write it sends nothing.
    config_maps: Store<ConfigMap>,
}

/// The local state, also after a panic elsewhere (it holds no invariant a panic could break).
fn locked(state: &Mutex<LocalState>) -> std::sync::MutexGuard<'_, LocalState> {
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Drops the record of a Secret that left this shard or was deleted, and logs which.
fn forget(state: &Mutex<LocalState>, shard: &Shard, departure: &Departure) {
    let object = departure.object();
    let namespace = object.namespace.clone().unwrap_or_default();
    let slot = (namespace.clone(), object.name.clone());
    let mut state = locked(state);
    state.awaiting_move.remove(&slot);
    // A record of another object under the same name (recreated meanwhile) is not this one's.
    let dropped = match state.served.get(&slot) {
        Some(served) if object.uid.is_none() || served.uid == object.uid => {
            state.served.remove(&slot)
        }
        _ => None,
    };
    let had_state = dropped.is_some();
    let checksums = dropped.map_or(0, |served| served.checksums);
    match departure {
        Departure::Released { how, .. } => {
            state.released_total += 1;
            info!(
                event = "released",
                %namespace,
                name = %object.name,
                shard = %shard.name(),
                how = how.as_str(),
                had_state,
                checksums,
                released_total = state.released_total,
                "Secret left this shard, dropped its record"
            );
        }
        Departure::Deleted { .. } => {
            state.deleted_total += 1;
            info!(
                event = "deleted",
                %namespace,
                name = %object.name,
                shard = %shard.name(),
                had_state,
                checksums,
                deleted_total = state.deleted_total,
                "Secret was deleted, dropped its record"
            );
        }
    }
}

/// Hex SHA-256 of every value of the Secret, keyed like the Secret.
fn checksums(secret: &Secret) -> BTreeMap<String, String> {
    secret
        .data
        .iter()
        .flatten()
        .map(|(key, value)| (key.clone(), hex::encode(Sha256::digest(&value.0))))
        .collect()
}

/// The ConfigMap to apply for `secret`: checksums as data, controlled by the Secret, labelled
/// with the owning shard like the sharder's webhook would (controlled objects follow their
/// controller's shard), so the shard's label-selected watch sees it.
fn desired_config_map(secret: &Secret, shard: &Shard) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(format!("{CONFIG_MAP_PREFIX}{}", secret.name_any())),
            namespace: secret.namespace(),
            labels: Some(BTreeMap::from([(
                shard.shard_label_key().to_string(),
                shard.name().to_string(),
            )])),
            owner_references: secret.controller_owner_ref(&()).map(|owner| vec![owner]),
            ..ObjectMeta::default()
        },
        data: Some(checksums(secret)),
        ..ConfigMap::default()
    }
}

async fn reconcile(
    secret: Arc<Secret>,
    context: Arc<Context>,
    ownership: Ownership,
) -> Result<Action, Error> {
    let name = secret.name_any();
    let namespace = secret
        .namespace()
        .ok_or_else(|| Error::NoNamespace(name.clone()))?;
    info!(
        event = "reconcile",
        %namespace,
        %name,
        shard = %context.shard.name(),
        "reconciling Secret"
    );
    let config_map = desired_config_map(&secret, &context.shard);
    let config_map_name = config_map.name_any();
    let served = Served {
        uid: secret.uid(),
        checksums: config_map.data.as_ref().map_or(0, BTreeMap::len),
    };
    if let Some(delay) = context.slow_down.filter(|_| name.starts_with(SLOW_PREFIX)) {
        tokio::time::sleep(delay).await;
    }
    let slot = (namespace.clone(), name.clone());
    // Taken whatever comes next: a ConfigMap in the cache has arrived, one that is not is written.
    let awaited = locked(&context.state).awaiting_move.remove(&slot);
    let cached = context
        .config_maps
        .get(&ObjectRef::new(&config_map_name).within(&namespace));
    let mut action = Action::await_change();
    // What the reconcile did, as its log record's `event` and message.
    let (event, message) = if cached
        .as_deref()
        .is_some_and(|cached| up_to_date(cached, &config_map, context.leave_children))
    {
        // Nothing to write, so nothing to confirm ownership for: the read would be the only
        // request of this reconcile, and a moved object's ConfigMap arriving is such a one.
        ("up_to_date", "ConfigMap already as desired")
    } else {
        // One GET: the Secret may have been drained, or the Lease lost, while this reconcile ran.
        ownership.confirm().await?;
        let api: Api<ConfigMap> = Api::namespaced(context.client.clone(), &namespace);
        let failed = |source| Error::Apply {
            namespace: namespace.clone(),
            name: config_map_name.clone(),
            source,
        };
        let write = match Write::choose(context.leave_children, cached.is_some(), awaited) {
            Some(write) => write,
            None => {
                let existing = api.get_opt(&config_map_name).await.map_err(&failed)?;
                Write::after_waiting(existing.as_ref(), secret.uid().as_deref())
            }
        };
        let written = write_config_map(&api, config_map, write)
            .await
            .map_err(&failed)?;
        if written {
            ("applied", "applied ConfigMap")
        } else {
            locked(&context.state).awaiting_move.insert(slot.clone());
            action = Action::requeue(AWAIT_MOVE);
            (
                "awaiting_move",
                "ConfigMap exists on another shard, waiting for the sharder to move it",
            )
        }
    };
    info!(
        event,
        %namespace,
        %name,
        shard = %context.shard.name(),
        configmap = %config_map_name,
        "{message}"
    );
    locked(&context.state).served.insert(slot, served);
    Ok(action)
}

/// Whether the ConfigMap as cached already is what a write of `desired` would make it: the same
/// data and controller, and (unless the shard leaves the label to the sharder) this shard's label.
/// Only this shard's ConfigMaps are cached, so with `leave_children` a cached one carries the
/// label already.
fn up_to_date(cached: &ConfigMap, desired: &ConfigMap, leave_children: bool) -> bool {
    // Compared in place: this runs on every reconcile, and a copy of the data would cost more
    // than the comparison.
    fn data(config_map: &ConfigMap) -> Option<&BTreeMap<String, String>> {
        config_map.data.as_ref().filter(|data| !data.is_empty())
    }
    let labelled = leave_children
        || desired
            .labels()
            .iter()
            .all(|(key, value)| cached.labels().get(key) == Some(value));
    data(cached) == data(desired)
        && controller(&cached.metadata) == controller(&desired.metadata)
        && labelled
}

/// The UID of the controller `meta` names, if any.
fn controller(meta: &ObjectMeta) -> Option<&str> {
    meta.owner_references
        .iter()
        .flatten()
        .find(|owner| owner.controller == Some(true))
        .map(|owner| owner.uid.as_str())
}

/// What a reconcile sends for its ConfigMap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Write {
    /// Apply it labelled with this shard: every write relabels.
    Apply,
    /// `--leave-children-to-sharder`, no such ConfigMap known: create it with this shard's label;
    /// one that exists already is left to the sharder, whose move brings it here.
    Create,
    /// `--leave-children-to-sharder`, the ConfigMap exists: apply its data and owner without any
    /// label, so its shard label stays whatever the sharder made it.
    ApplyUnlabelled,
    /// `--leave-children-to-sharder`, the ConfigMap is this Secret's and on another shard: send
    /// nothing, the sharder moves it here once the Secret's move is complete.
    Wait,
}

impl Write {
    /// The write for a ConfigMap that is not as desired, `cached` in this shard's cache or not.
    /// `None` when it is `awaited` (a create found it on another shard, and it has not arrived
    /// since): [`Write::after_waiting`] decides from the ConfigMap as it is now.
    fn choose(leave_children: bool, cached: bool, awaited: bool) -> Option<Self> {
        if !leave_children {
            Some(Self::Apply)
        } else if cached {
            Some(Self::ApplyUnlabelled)
        } else if awaited {
            None
        } else {
            Some(Self::Create)
        }
    }

    /// The write for an awaited ConfigMap, as it exists now (`None`: not at all) for the Secret
    /// of UID `secret`. The Secret's own ConfigMap is moved by the sharder only when the Secret's
    /// move is complete, which takes as long as the sync that drains it (many seconds with many
    /// objects), so it is waited for as long as it exists; any other one is taken over.
    fn after_waiting(existing: Option<&ConfigMap>, secret: Option<&str>) -> Self {
        match existing {
            None => Self::Create,
            Some(found) if secret.is_some() && controller(&found.metadata) == secret => Self::Wait,
            Some(_) => Self::ApplyUnlabelled,
        }
    }
}

/// Writes `config_map` (labelled with this shard) as `write` says. `Ok(false)`: nothing was
/// written (waiting, or a create found the ConfigMap existing already).
async fn write_config_map(
    api: &Api<ConfigMap>,
    mut config_map: ConfigMap,
    write: Write,
) -> Result<bool, kube::Error> {
    let name = config_map.name_any();
    match write {
        Write::Apply => {}
        Write::Create => {
            // A field manager of its own: a later apply must not own (and so drop) the label.
            let create = PostParams {
                field_manager: Some(CREATE_FIELD_MANAGER.into()),
                ..PostParams::default()
            };
            return match api.create(&create, &config_map).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(error) => Err(error),
            };
        }
        Write::ApplyUnlabelled => config_map.metadata.labels = None,
        Write::Wait => return Ok(false),
    }
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&config_map),
    )
    .await
    .map(|_| true)
}

fn error_policy(
    secret: Arc<Secret>,
    error: &ReconcileError<Error>,
    context: Arc<Context>,
) -> Action {
    if error.is_lease_lost() {
        // Nothing to retry: the controller is being dropped, the Lease loss is logged already.
        debug!(
            namespace = secret.namespace().unwrap_or_default(),
            name = %secret.name_any(),
            shard = %context.shard.name(),
            "not reconciling, the shard Lease is lost"
        );
        return Action::await_change();
    }
    if let ReconcileError::Revoked { object } = error {
        // Zero-write ring: the Secret's range went to another shard while this ran.
        info!(
            event = "reconcile_revoked",
            %object,
            shard = %context.shard.name(),
            "reconcile cancelled, the Secret's range was revoked"
        );
        return Action::await_change();
    }
    if let Some(Error::Ownership(refused)) = error.inner()
        && refused.is_final()
    {
        // Drained, moved or deleted meanwhile: the event that says so is on its way.
        info!(
            event = "write_refused",
            namespace = secret.namespace().unwrap_or_default(),
            name = %secret.name_any(),
            shard = %context.shard.name(),
            error = %error_chain(error),
            "reconcile stopped before writing"
        );
        return Action::await_change();
    }
    warn!(
        error = %error_chain(error),
        namespace = secret.namespace().unwrap_or_default(),
        name = %secret.name_any(),
        shard = %context.shard.name(),
        "reconcile failed, retrying"
    );
    Action::requeue(RETRY_AFTER)
}

/// The host name: `HOSTNAME` (set to the pod name by Kubernetes), else the kernel's.
/// The error with its sources joined by `: `, for the one-line `error` field of the records.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn hostname() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
}

fn init_tracing(args: &Args) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.is_empty() => EnvFilter::new(directives),
        _ => EnvFilter::try_new(&args.log_level).context("invalid --log-level")?,
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let result = match args.log_format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .try_init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .try_init(),
    };
    result.map_err(|e| anyhow::anyhow!("failed to install the log subscriber: {e}"))
}

/// Cancels `shutdown` on the first SIGTERM or SIGINT.
fn spawn_signal_handler(shutdown: CancellationToken) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).context("failed to listen for SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("failed to listen for SIGINT")?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        };
        info!(signal = name, "shutting down");
        shutdown.cancel();
    });
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = <Args as clap::Parser>::parse();
    init_tracing(&args)?;
    // rustls picks a provider by itself only when exactly one is compiled in; feature
    // unification across a workspace can break that, so choose ring explicitly. An error only
    // means a provider is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();

    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone())?;

    let client = Client::try_default()
        .await
        .context("failed to create a Kubernetes client")?;
    let shard_name = match args.shard_name.clone() {
        Some(name) => name,
        None => hostname().context("no --shard-name given and no host name found")?,
    };
    let lease_namespace = args
        .lease_namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());
    let mut shard = Shard::of_kind(
        args.ring_kind,
        &args.clusterring,
        shard_name,
        lease_namespace,
    );
    if let Some(weight) = args.weight {
        shard = shard.with_weight(weight);
    }
    if args.leave_children_to_sharder {
        // Its Lease says so, and the sharder moves the ConfigMaps as their Secrets' drains are
        // acknowledged.
        shard = shard.leaving_controlled_objects_to_sharder();
    }
    if let Some(hash_key) = args.server_side {
        shard = shard.server_side::<Secret>(match hash_key {
            ServerSideHashKey::Object => ShardField::Uid,
            ServerSideHashKey::Namespace => ShardField::Namespace,
        });
    }
    let on_shutdown = match args.on_shutdown {
        ShutdownMode::Release => OnShutdown::Release,
        ShutdownMode::KeepIfReturning => {
            let pod = StatefulSetPod::new(shard.lease_namespace());
            OnShutdown::KeepIfReturning(match &args.statefulset {
                Some(name) => pod.named(name),
                None => pod,
            })
        }
    };
    // The load the Lease reports (docs/protocol.md §23): the Secrets held and waiting, from the
    // Secret watch; reconcile latency and errors, from the reconciler wrapper.
    let meter = LoadMeter::new();
    let shard = shard
        .with_load_meter(meter.clone())
        .with_rejoin_pause(args.rejoin_pause)
        .with_judgement_fallback(args.judgement_fallback)
        .with_on_shutdown(on_shutdown);
    let config = shard
        .lease_config()
        .with_lease_duration(args.lease_duration)
        .with_renew_deadline(args.renew_deadline)
        .with_retry_period(args.retry_period);
    let lock = match args.testing_clock_offset {
        Some(seconds) => {
            warn!(
                seconds,
                "writing Lease timestamps off the system clock, for testing"
            );
            LeaseLock::new_with_clock_offset(
                client.clone(),
                config,
                k8s_openapi::jiff::SignedDuration::from_secs(seconds),
            )?
        }
        None => LeaseLock::new(client.clone(), config)?,
    };

    // On a zero-write ring the Secrets' lists and watches carry the shard's selector.
    let secrets_client = shard.client(client.clone());
    let (secrets, config_maps): (Api<Secret>, Api<ConfigMap>) = match &args.namespace {
        Some(namespace) => (
            Api::namespaced(secrets_client, namespace),
            Api::namespaced(client.clone(), namespace),
        ),
        None => (Api::all(secrets_client), Api::all(client.clone())),
    };
    // Outlives the terms: a rejoin after an exclusion reports what left meanwhile.
    let state = Arc::new(Mutex::new(LocalState::default()));
    let term = |term: Term| {
        // The ConfigMaps trigger their Secret's reconcile, as `owns` would, and fill the cache
        // that spares writes which would change nothing.
        let (config_map_cache, writer) = reflector::store();
        // Selected by the shard label on any ring: this shard labels every ConfigMap it writes.
        let config_map_events = watcher(
            config_maps.clone(),
            watcher::Config::default().labels(&shard.label_selector()),
        )
        .default_backoff()
        .reflect(writer)
        .touched_objects();
        let context = Arc::new(Context {
            client: client.clone(),
            shard: shard.clone(),
            state: Arc::clone(&state),
            slow_down: args.testing_reconcile_delay,
            leave_children: args.leave_children_to_sharder,
            config_maps: config_map_cache,
        });
        let known: Vec<ObjectKey> = locked(&state)
            .served
            .iter()
            .map(|((namespace, name), served)| ObjectKey {
                namespace: Some(namespace.clone()),
                name: name.clone(),
                uid: served.uid.clone(),
            })
            .collect();
        let departures = shard
            .departures(secrets.clone())
            .with_known(known)
            .stream()
            .for_each(|departure| {
                forget(&state, &shard, &departure);
                futures::future::ready(())
            });
        // The wrapper starts no reconcile and no drain acknowledgement once the term's guard
        // ended, and cancels those in flight.
        // The meter sees each Secret event before the controller's cache does, so a reconcile
        // never runs ahead of what the queue depth counts.
        let (secret_cache, secret_writer) = reflector::store();
        let secret_events = meter
            .track(watcher(secrets.clone(), shard.watcher_config()).default_backoff())
            .reflect(secret_writer)
            .applied_objects();
        let controller = Controller::for_stream(secret_events, secret_cache)
            .with_config(controller::Config::default().concurrency(args.max_concurrent_reconciles))
            .owns_stream(config_map_events)
            // A zero-write ring's new ranges restart the watch through an error: list again
            // at once rather than after kube's 0.8 s (same as the default otherwise).
            .trigger_backoff(RestartBackoff::default())
            .graceful_shutdown_on(term.stop.cancelled_owned())
            .run(
                shard.reconciler(client.clone(), term.guard, reconcile),
                error_policy,
                context,
            )
            .for_each(|result| async move {
                match result {
                    // Reconcile errors are logged by the error policy.
                    Ok(_) | Err(controller::Error::ReconcilerFailed(..)) => {}
                    Err(controller::Error::ObjectNotFound(_)) => {}
                    // On a zero-write ring every new generation of ranges ends the watch this
                    // way, so that it lists again with the new selector: not worth a warning.
                    Err(controller::Error::QueueError(watcher::Error::WatchError(status)))
                        if status.code == 410 =>
                    {
                        debug!(reason = %status.message, "watch restarted, listing again");
                    }
                    Err(error) => warn!(error = %error_chain(&error), "controller error"),
                }
            });
        // The departures watch ends with the controller (it never ends by itself).
        async move {
            tokio::select! {
                () = controller => {}
                () = departures => {}
            }
        }
    };

    // Membership first: nothing is reconciled before the Lease is ours. Stops at once when the
    // Lease is lost; on shutdown the controller stops first, then the Lease is released so our
    // objects are handed over right away (or, with `--on-shutdown=keep-if-returning`, kept for
    // the pod that comes back under this name); when the sharder excludes the shard, it steps
    // out and rejoins after `--rejoin-pause`.
    info!(shard = %shard.name(), ring = %shard.ring(), kind = %shard.kind(), namespace = %shard.lease_namespace(), "acquiring shard Lease");
    let ended = shard
        .run(&lock, &shutdown, term)
        .await
        .context("failed to release the shard Lease")?;
    if ended == ShardRunEnd::LeaseLost {
        error!(
            event = "shard_stopped",
            reason = "lease_lost",
            shard = %shard.name(),
            "lost the shard Lease, stopped at once"
        );
        bail!("lost the shard Lease");
    }
    info!(
        event = "shard_stopped",
        reason = "shutdown",
        shard = %shard.name(),
        lease_kept = ended == ShardRunEnd::Kept,
        "stopped"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    /// Secret `team/creds` (UID 1234) with the values `data`.
    fn secret(data: &[(&str, &[u8])]) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some("creds".into()),
                namespace: Some("team".into()),
                uid: Some("1234".into()),
                ..ObjectMeta::default()
            },
            data: Some(
                data.iter()
                    .map(|(key, value)| ((*key).to_string(), ByteString(value.to_vec())))
                    .collect(),
            ),
            ..Secret::default()
        }
    }

    #[test]
    fn config_map_holds_checksums_and_controller_reference() {
        let secret = secret(&[("empty", b""), ("hello", b"hello")]);
        let shard = Shard::new("checksum-controller", "shard-0", "default");
        let config_map = desired_config_map(&secret, &shard);
        assert_eq!(config_map.metadata.name.as_deref(), Some("checksums-creds"));
        assert_eq!(config_map.metadata.namespace.as_deref(), Some("team"));
        let data = config_map.data.expect("data");
        assert_eq!(
            data["empty"],
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            data["hello"],
            "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        let owner = &config_map.metadata.owner_references.expect("owner")[0];
        assert_eq!(owner.kind, "Secret");
        assert_eq!(owner.name, "creds");
        assert_eq!(owner.uid, "1234");
        assert_eq!(owner.controller, Some(true));
        assert_eq!(
            config_map.metadata.labels.expect("labels")[shard.shard_label_key()],
            "shard-0"
        );
    }

    #[test]
    fn a_config_map_as_desired_is_not_written_again() {
        let secret = secret(&[("hello", b"hello")]);
        let shard = Shard::new("checksum-controller", "shard-0", "default");
        let desired = desired_config_map(&secret, &shard);
        let mut cached = desired.clone();
        cached.metadata.resource_version = Some("7".into());
        cached
            .labels_mut()
            .insert("unrelated".into(), "kept".into());
        assert!(up_to_date(&cached, &desired, false));
        assert!(up_to_date(&cached, &desired, true));

        // The API server leaves an empty map out: a Secret without data is up to date too.
        let empty = desired_config_map(&Secret::default(), &shard);
        let mut cached_empty = empty.clone();
        cached_empty.data = None;
        assert!(up_to_date(&cached_empty, &empty, true), "no data");

        let mut changed = cached.clone();
        changed
            .data
            .as_mut()
            .unwrap()
            .insert("hello".into(), "edited".into());
        assert!(!up_to_date(&changed, &desired, true), "data edited");

        let mut orphaned = cached.clone();
        orphaned.metadata.owner_references = None;
        assert!(!up_to_date(&orphaned, &desired, true), "controller removed");

        let mut elsewhere = cached.clone();
        elsewhere
            .labels_mut()
            .insert(shard.shard_label_key().to_string(), "shard-1".into());
        assert!(
            !up_to_date(&elsewhere, &desired, false),
            "labelled for another shard: this shard's write moves it"
        );
        assert!(
            up_to_date(&elsewhere, &desired, true),
            "the label is the sharder's to write"
        );
    }

    #[test]
    fn left_children_are_created_once_and_then_wait_for_the_sharder() {
        // Relabelling shards apply every time.
        for (cached, awaited) in [(false, false), (true, false), (false, true)] {
            assert_eq!(Write::choose(false, cached, awaited), Some(Write::Apply));
        }
        // Unknown: create (labelled). A 409 makes it awaited; arriving makes it cached.
        assert_eq!(Write::choose(true, false, false), Some(Write::Create));
        assert_eq!(
            Write::choose(true, true, false),
            Some(Write::ApplyUnlabelled)
        );
        // Not arrived within the wait: decided from the ConfigMap as it is.
        assert_eq!(Write::choose(true, false, true), None);

        let secret = secret(&[("key", b"v1")]);
        let uid = secret.uid();
        let own = ConfigMap {
            metadata: ObjectMeta {
                owner_references: secret.controller_owner_ref(&()).map(|owner| vec![owner]),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        };
        // The Secret's own ConfigMap is waited for, however long the sharder takes.
        assert_eq!(
            Write::after_waiting(Some(&own), uid.as_deref()),
            Write::Wait
        );
        // Gone meanwhile: created again; someone else's: taken over without the label.
        assert_eq!(Write::after_waiting(None, uid.as_deref()), Write::Create);
        let foreign = ConfigMap::default();
        assert_eq!(
            Write::after_waiting(Some(&foreign), uid.as_deref()),
            Write::ApplyUnlabelled
        );
        // A Secret without a UID (never from the API server) claims no ConfigMap.
        assert_eq!(
            Write::after_waiting(Some(&own), None),
            Write::ApplyUnlabelled
        );
    }

    #[test]
    fn seconds_flags() {
        assert_eq!(parse_seconds("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_seconds("0.5"), Ok(Duration::from_millis(500)));
        assert!(parse_seconds("0").is_err());
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("soon").is_err());
    }
}
