//! The `event` of the sharder's log records: the names operators alert on and tests and tools
//! look for, in one place.
//!
//! Every record the sharder logs at info level or above carries an `event` field with one of these
//! values, beside its other fields (`ring`, `shard`, `error`, …). The message is for people and may
//! be reworded at any time; the `event` and the fields named here are the contract. With
//! `--log-format=json` every field, `event` included, is a top-level key of the line's object, as
//! in the shard library's records (whose events, `lease_acquired` and the like, the sharder's own
//! leader election writes too). Debug records carry no `event`: they are for reading, not matching.
//!
//! docs/metrics.md lists the events worth alerting on.

// Process and leadership.

/// Every cache listed once and the ring views are built: the process reports ready.
pub const EVENT_CACHES_SYNCED: &str = "caches_synced";
/// The caches failed to sync (`error`): the process never reports ready.
pub const EVENT_CACHES_SYNC_FAILED: &str = "caches_sync_failed";
/// A server listens (`address`): the webhook, the metrics server over HTTPS, the health probes.
pub const EVENT_SERVING: &str = "serving";
/// The metrics are served over plain HTTP without authentication (`metrics.secure: false`).
pub const EVENT_METRICS_UNAUTHENTICATED: &str = "metrics_unauthenticated";
/// A server failed to accept a connection (`error`); it pauses, then accepts again.
pub const EVENT_ACCEPT_FAILED: &str = "accept_failed";
/// A server still had connections open when its shutdown grace period ended.
pub const EVENT_CONNECTIONS_LEFT_OPEN: &str = "connections_left_open";
/// The serving certificate was loaded (at start, and after every change of its files).
pub const EVENT_CERTIFICATE_LOADED: &str = "certificate_loaded";
/// A changed serving certificate could not be loaded (`error`); the previous one is kept.
pub const EVENT_CERTIFICATE_RELOAD_FAILED: &str = "certificate_reload_failed";
/// No serving certificate could be loaded yet (`error`): the TLS servers cannot answer.
pub const EVENT_CERTIFICATE_MISSING: &str = "certificate_missing";
/// The process could not install its SIGTERM and SIGINT handlers.
pub const EVENT_SIGNAL_HANDLERS_FAILED: &str = "signal_handlers_failed";
/// SIGTERM or SIGINT arrived: the graceful shutdown begins.
pub const EVENT_SHUTDOWN_SIGNALLED: &str = "shutdown_signalled";
/// Shutting down: not ready any more, the webhook served for `delay` still.
pub const EVENT_SHUTDOWN_STARTED: &str = "shutdown_started";
/// Every task is told to stop.
pub const EVENT_TASKS_STOPPING: &str = "tasks_stopping";
/// Tasks were still running when `gracefulShutdown` ended; they are stopped at once.
pub const EVENT_SHUTDOWN_TIMED_OUT: &str = "shutdown_timed_out";
/// This replica became the leader (`identity`) and starts the controllers.
pub const EVENT_LEADERSHIP_ACQUIRED: &str = "leadership_acquired";
/// This replica lost its leader election Lease; its controllers stopped at once.
pub const EVENT_LEADERSHIP_LOST: &str = "leadership_lost";
/// The controllers ended on their own while leading; leadership was released.
pub const EVENT_CONTROLLERS_ENDED: &str = "controllers_ended";
/// Releasing the leader election Lease failed (`error`); it expires instead.
pub const EVENT_LEADERSHIP_RELEASE_FAILED: &str = "leadership_release_failed";

// Caches and views.

/// A watch of the caches failed (`error`) and is retried with backoff.
pub const EVENT_CACHE_WATCH_FAILED: &str = "cache_watch_failed";
/// A held shard Lease left its ring, or changed holder without the shard's release mark
/// (`kind`, `ring`, `shard`, `until`): the shard may still run, so its objects leave it only
/// through drains until then.
pub const EVENT_SHARD_DEPARTURE_HELD: &str = "shard_departure_held";
/// A ring's hash ring was built anew (`ring`, `shards`).
pub const EVENT_HASH_RING_REBUILT: &str = "hash_ring_rebuilt";
/// Resources of a ring the API server does not serve (yet) (`ring`, `unresolved`).
pub const EVENT_RESOURCES_UNRESOLVED: &str = "resources_unresolved";
/// Discovering the resources of an API group failed (`group`, `error`).
pub const EVENT_DISCOVERY_FAILED: &str = "discovery_failed";
/// A resource's discovered version was forgotten (`resource`) and is looked up again.
pub const EVENT_DISCOVERY_FORGOTTEN: &str = "discovery_forgotten";
/// A ring has more pinned main objects than the sharder remembers (`ring`, `max`).
pub const EVENT_PINS_LIMIT_REACHED: &str = "pins_limit_reached";

// Rings.

/// Reconciling a ring failed (`ring`, `category`, `error`); it is retried.
pub const EVENT_RING_RECONCILE_FAILED: &str = "ring_reconcile_failed";
/// A ring's webhook configuration was applied (`webhook_configuration`).
pub const EVENT_WEBHOOK_CONFIGURATION_APPLIED: &str = "webhook_configuration_applied";
/// A ring's webhook configuration was deleted, its objects being assigned by the sharder's watch
/// (`webhook_configuration`).
pub const EVENT_WEBHOOK_CONFIGURATION_DELETED: &str = "webhook_configuration_deleted";
/// Ranges were published on a shard's Lease (`ring`, `shard`, `generation`, `ranges`).
pub const EVENT_RANGES_PUBLISHED: &str = "ranges_published";
/// A shard Lease's ranges annotation could not be read (`lease`, `error`); the shard counts as
/// holding every range.
pub const EVENT_RANGES_UNREADABLE: &str = "ranges_unreadable";

// Shard Leases.

/// Reconciling a shard Lease failed (`error`; the span names the Lease); it is retried.
pub const EVENT_SHARD_LEASE_RECONCILE_FAILED: &str = "shard_lease_reconcile_failed";
/// The sharder took over the Lease of a shard that stopped renewing it (`ring`, `shard`): the
/// shard is dead and its objects move.
pub const EVENT_SHARD_LEASE_TAKEN_OVER: &str = "shard_lease_taken_over";
/// An orphaned shard Lease was deleted (`ring`, `shard`).
pub const EVENT_SHARD_LEASE_DELETED: &str = "shard_lease_deleted";
/// A shard Lease was excluded from its ring (`ring`, `shard`, `namespace`, `reason`).
pub const EVENT_SHARD_LEASE_EXCLUDED: &str = "shard_lease_excluded";
/// A shard Lease carries an annotation the sharder cannot read (`ring`, `shard`, `namespace`,
/// `reason`).
pub const EVENT_SHARD_LEASE_INVALID: &str = "shard_lease_invalid";
/// A shard's clock differs from the sharder's (`ring`, `shard`, `namespace`, `reason`).
pub const EVENT_SHARD_CLOCK_SKEWED: &str = "shard_clock_skewed";

// Syncs.

/// A sync of a ring starts (`ring`, `shards`, `children_first`).
pub const EVENT_SYNC_STARTED: &str = "sync_started";
/// A sync of a ring finished (`ring`, `duration`, `listed`, `drained`, `moved`, `failed`,
/// `held`).
pub const EVENT_SYNC_FINISHED: &str = "sync_finished";
/// A sync failed (`ring`, `error`, `retry_in`); it runs again after the backoff.
pub const EVENT_SYNC_FAILED: &str = "sync_failed";
/// A sync ended waiting for controllers to move (`ring`, `error`, `retry_in`); it runs again soon.
pub const EVENT_SYNC_WAITING: &str = "sync_waiting";
/// A running sync stopped because its ring's view changed (`ring`); one with the current view
/// starts right after.
pub const EVENT_SYNC_SUPERSEDED: &str = "sync_superseded";
/// Moves of a superseded sync landed where the current view does not want them (`ring`,
/// `unsettled`); the ring is synced again.
pub const EVENT_SUPERSEDED_MOVES_UNSETTLED: &str = "superseded_moves_unsettled";
/// A sync list's continue token expired and the list went on at the current revision (`ring`,
/// `resource`).
pub const EVENT_LIST_CONTINUED_INCONSISTENTLY: &str = "list_continued_inconsistently";
/// A sync list's continue token expired with no token to go on with; the list starts over
/// (`ring`, `resource`).
pub const EVENT_LIST_RESTARTED: &str = "list_restarted";
/// A controlled resource was not synced because a main resource could not be listed (`ring`,
/// `resource`).
pub const EVENT_RESOURCE_NOT_SYNCED: &str = "resource_not_synced";
/// The watch of drained controllers did not list in time (`ring`); the held objects wait for a
/// sync.
pub const EVENT_CONTROLLER_WATCH_LATE: &str = "controller_watch_late";
/// A ring's held-back controlled objects have all moved after their controllers (`ring`,
/// `held`, `moved`, `failed`).
pub const EVENT_CONTROLLED_OBJECTS_FOLLOWED: &str = "controlled_objects_followed";

// Moves and assignment.

/// Drains off a shard are not acknowledged (`ring`, `shard`, `objects`, `oldest`).
pub const EVENT_DRAINS_NOT_ACKNOWLEDGED: &str = "drains_not_acknowledged";
/// A moved object came back unassigned: the API server does not reach the ring's webhook
/// (`ring`); moves stop until a probe lands.
pub const EVENT_WEBHOOK_UNREACHABLE: &str = "webhook_unreachable";
/// The API server reaches the ring's webhook again (`ring`); moves resume.
pub const EVENT_WEBHOOK_REACHABLE: &str = "webhook_reachable";
/// A missed-assignment watch failed (`ring`, `resource`, `watching`, `error`) and is retried.
pub const EVENT_MISSED_ASSIGNMENT_WATCH_FAILED: &str = "missed_assignment_watch_failed";
/// The sharder may not get objects of a resource (`ring`, `resource`): an unassigned object is
/// left to the periodic sync.
pub const EVENT_MISSED_ASSIGNMENT_FORBIDDEN: &str = "missed_assignment_forbidden";
/// The webhook was called for a resource that is not part of the ring (`ring`, `resource`); the
/// object is allowed unchanged.
pub const EVENT_RESOURCE_NOT_IN_RING: &str = "resource_not_in_ring";

// Events and metrics access.

/// Publishing a Kubernetes Event failed (`reason`, `error`).
pub const EVENT_KUBE_EVENT_FAILED: &str = "kube_event_failed";
/// Reviewing a metrics request with the API server failed (`error`); it was answered 503.
pub const EVENT_METRICS_REVIEW_FAILED: &str = "metrics_review_failed";
/// Authorizing an external metrics request failed (`error`); it was answered 503.
pub const EVENT_EXTERNAL_METRICS_AUTHORIZATION_FAILED: &str =
    "external_metrics_authorization_failed";
/// The request-header (front proxy) settings could not be read (`error`).
pub const EVENT_REQUEST_HEADER_SETTINGS_FAILED: &str = "request_header_settings_failed";
