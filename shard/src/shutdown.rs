//! What [`Shard::run`](crate::Shard::run) does with the shard's Lease when it stops on shutdown:
//! release it (the sharder moves the objects away at once), or, for a StatefulSet pod whose
//! identity comes back, leave it held so that the returning pod renews it and carries on with the
//! same objects.
//!
//! The decision is not a guess: at shutdown the shard reads its StatefulSet and keeps the Lease
//! only when the StatefulSet will recreate a pod of the shard's name (its ordinal lies within
//! `spec.replicas`, and the StatefulSet is not being deleted). A scale-in (the highest ordinals
//! go), a deleted StatefulSet, a pod name that is not `<statefulset>-<ordinal>` and any failed
//! read release the Lease as before.

use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use kube::{Api, Client};
use tracing::info;

use crate::records::EVENT_LEASE_KEPT;

/// How long the shutdown waits for its StatefulSet read before it gives up and releases: a stop
/// must not hang on an API server that does not answer.
pub const STATEFULSET_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// What [`Shard::run`](crate::Shard::run) does with the shard's Lease when it stops on
/// shutdown ([`Shard::with_on_shutdown`](crate::Shard::with_on_shutdown)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum OnShutdown {
    /// Release the Lease, marked as the shard's own: the sharder moves the shard's objects to
    /// the other shards at once (docs/protocol.md §3). Right for shards whose name never comes
    /// back, such as the pods of a Deployment.
    #[default]
    Release,
    /// Leave the Lease held when the shard's pod, a pod of the StatefulSet described here, is
    /// going to be recreated under the same name (a rollout, an evicted or deleted pod): the
    /// work stops, the renewals stop, and nothing is written. The returning pod takes its own
    /// still-held Lease back at once (a renewal, not a new holding: it does not wait for the
    /// sharder's `ready`) and carries on with the same objects; to the sharder the shard never
    /// left, so nothing moves. Releases as [`OnShutdown::Release`] does on a scale-in (the
    /// pod's ordinal is not below `spec.replicas`), when the StatefulSet is being deleted, and
    /// when it cannot be read.
    ///
    /// **Sharp edge:** the shard name must be the pod name (`<statefulset>-<ordinal>`), and the
    /// pod must come back before the Lease runs out. A Lease nobody renews counts as `expired`
    /// from one lease duration after its last renewal and the sharder takes it over one more
    /// duration later (docs/protocol.md §4): from then on the shard is dead and its objects move
    /// to the other shards directly, as for any crashed shard; the pod, when it returns, waits
    /// for the sharder's takeover to expire and rejoins as a new holding.
    KeepIfReturning(StatefulSetPod),
}

/// The StatefulSet whose pod runs the shard, for [`OnShutdown::KeepIfReturning`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatefulSetPod {
    namespace: String,
    statefulset: Option<String>,
}

impl StatefulSetPod {
    /// The shard runs in a pod of a StatefulSet in `namespace` (the pod's namespace). The
    /// StatefulSet's name is the shard name without its `-<ordinal>` suffix unless
    /// [`StatefulSetPod::named`] gives it.
    ///
    /// ```
    /// use kube_sharding::{OnShutdown, Shard, StatefulSetPod};
    /// let shard = Shard::new("my-ring", "my-controller-0", "my-namespace")
    ///     .with_on_shutdown(OnShutdown::KeepIfReturning(StatefulSetPod::new("my-namespace")));
    /// ```
    pub fn new(namespace: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            statefulset: None,
        }
    }

    /// The StatefulSet's name, when the shard's pod is `<name>-<ordinal>`.
    #[must_use]
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.statefulset = Some(name.into());
        self
    }

    /// Namespace of the StatefulSet.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The StatefulSet's name, if given (otherwise it comes from the shard name).
    pub fn statefulset(&self) -> Option<&str> {
        self.statefulset.as_deref()
    }
}

/// The outcome of the shutdown check of [`OnShutdown::KeepIfReturning`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ShutdownDecision {
    /// The StatefulSet recreates the pod: leave the Lease held.
    Keep {
        statefulset: String,
        ordinal: u32,
        replicas: i32,
    },
    /// Release, for this reason.
    Release(String),
}

/// The StatefulSet name and the ordinal of pod `pod`: `<statefulset>-<ordinal>`, with
/// `statefulset` as given or everything before the last `-`. The ordinal is written in decimal
/// without leading zeros, as the StatefulSet controller names its pods.
pub(crate) fn pod_ordinal(pod: &str, statefulset: Option<&str>) -> Result<(String, u32), String> {
    let (name, ordinal) = match statefulset {
        Some(name) => {
            let ordinal = pod
                .strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('-'))
                .ok_or_else(|| format!("pod {pod:?} is not named <{name}>-<ordinal>"))?;
            (name, ordinal)
        }
        None => pod
            .rsplit_once('-')
            .filter(|(name, _)| !name.is_empty())
            .ok_or_else(|| format!("pod {pod:?} is not named <statefulset>-<ordinal>"))?,
    };
    let canonical = !ordinal.is_empty()
        && ordinal.bytes().all(|b| b.is_ascii_digit())
        && (ordinal == "0" || !ordinal.starts_with('0'));
    let parsed = ordinal
        .parse::<u32>()
        .ok()
        .filter(|n| canonical && i32::try_from(*n).is_ok());
    match parsed {
        Some(n) => Ok((name.to_string(), n)),
        None => Err(format!("pod {pod:?} has no ordinal after {name:?}")),
    }
}

/// Whether `statefulset` recreates its pod of ordinal `ordinal`: `Ok(replicas)` when the ordinal
/// lies in `[start, start + replicas)` (`spec.ordinals.start`, 0 by default) and the StatefulSet
/// is not being deleted; the reason to release otherwise.
pub(crate) fn returns(ordinal: u32, statefulset: &StatefulSet) -> Result<i32, String> {
    if statefulset.metadata.deletion_timestamp.is_some() {
        return Err("the StatefulSet is being deleted".into());
    }
    let spec = statefulset.spec.as_ref();
    // The API server defaults both; a missing value means the defaults.
    let replicas = spec.and_then(|s| s.replicas).unwrap_or(1);
    let start = spec
        .and_then(|s| s.ordinals.as_ref())
        .and_then(|o| o.start)
        .unwrap_or(0);
    let ordinal = i64::from(ordinal);
    let (start, end) = (i64::from(start), i64::from(start) + i64::from(replicas));
    if (start..end).contains(&ordinal) {
        Ok(replicas)
    } else {
        Err(format!(
            "ordinal {ordinal} is outside the StatefulSet's ordinals {start}..{end} (scale-in)"
        ))
    }
}

/// The decision for pod `pod` given the StatefulSet `read` (`Ok(None)`: it does not exist).
pub(crate) fn decide(
    pod: &str,
    statefulset: &str,
    ordinal: u32,
    read: Result<Option<StatefulSet>, String>,
) -> ShutdownDecision {
    match read {
        Err(error) => {
            ShutdownDecision::Release(format!("failed to read StatefulSet {statefulset}: {error}"))
        }
        Ok(None) => ShutdownDecision::Release(format!("StatefulSet {statefulset} does not exist")),
        Ok(Some(found)) => match returns(ordinal, &found) {
            Ok(replicas) => ShutdownDecision::Keep {
                statefulset: statefulset.to_string(),
                ordinal,
                replicas,
            },
            Err(reason) => ShutdownDecision::Release(format!("pod {pod}: {reason}")),
        },
    }
}

/// Where the shutdown check reads the StatefulSet from.
pub(crate) enum Reader {
    /// The API server.
    Api(Client),
    /// A fixed answer, for unit tests on the fake Lease store.
    #[cfg(test)]
    Fixed(Option<Box<StatefulSet>>),
}

impl Reader {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<StatefulSet>, String> {
        match self {
            Self::Api(client) => {
                let api: Api<StatefulSet> = Api::namespaced(client.clone(), namespace);
                match tokio::time::timeout(STATEFULSET_READ_TIMEOUT, api.get_opt(name)).await {
                    Ok(Ok(found)) => Ok(found),
                    Ok(Err(error)) => Err(crate::records::error_chain(&error)),
                    Err(_) => Err(format!("no answer within {STATEFULSET_READ_TIMEOUT:?}")),
                }
            }
            #[cfg(test)]
            Self::Fixed(found) => Ok(found.as_deref().cloned()),
        }
    }
}

/// The shutdown check of shard `pod` under `setting`: reads the StatefulSet once and decides;
/// logs the decision.
pub(crate) async fn check(
    reader: Option<Reader>,
    pod: &str,
    setting: &StatefulSetPod,
) -> ShutdownDecision {
    let decision = match pod_ordinal(pod, setting.statefulset()) {
        Err(reason) => ShutdownDecision::Release(reason),
        Ok((statefulset, ordinal)) => {
            let read = match &reader {
                Some(reader) => reader.get(setting.namespace(), &statefulset).await,
                None => Err("the Lease lock has no API client to read it with".into()),
            };
            decide(pod, &statefulset, ordinal, read)
        }
    };
    match &decision {
        ShutdownDecision::Keep {
            statefulset,
            ordinal,
            replicas,
        } => info!(
            event = EVENT_LEASE_KEPT,
            shard = %pod,
            %statefulset,
            ordinal,
            replicas,
            "the StatefulSet recreates this pod: stopped renewing and left the Lease held for it"
        ),
        ShutdownDecision::Release(reason) => info!(
            shard = %pod,
            %reason,
            "this shard's pod does not come back: releasing the Lease"
        ),
    }
    decision
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::apps::v1::{StatefulSetOrdinals, StatefulSetSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    use super::*;

    fn statefulset(replicas: Option<i32>, start: Option<i32>) -> StatefulSet {
        StatefulSet {
            spec: Some(StatefulSetSpec {
                replicas,
                ordinals: start.map(|start| StatefulSetOrdinals { start: Some(start) }),
                ..StatefulSetSpec::default()
            }),
            ..StatefulSet::default()
        }
    }

    #[test]
    fn ordinals_are_parsed_as_the_statefulset_controller_names_pods() {
        let ok = |pod, name: Option<&str>| pod_ordinal(pod, name).map_err(|_| ());
        assert_eq!(ok("web-0", None), Ok(("web".into(), 0)));
        assert_eq!(ok("web-12", None), Ok(("web".into(), 12)));
        assert_eq!(
            ok("checksum-controller-2", None),
            Ok(("checksum-controller".into(), 2))
        );
        // A StatefulSet whose name ends in digits: the last segment is the ordinal.
        assert_eq!(ok("shard-7-3", None), Ok(("shard-7".into(), 3)));
        assert_eq!(ok("shard-7-3", Some("shard-7")), Ok(("shard-7".into(), 3)));
        // Not a StatefulSet pod name.
        for pod in [
            "web", "web-", "-3", "web-x", "web-01", "web-+1", "web- 1", "web-1a",
        ] {
            assert_eq!(ok(pod, None), Err(()), "{pod:?}");
        }
        // A Deployment's pod: the suffix is not an ordinal.
        assert_eq!(ok("checksum-controller-5d8f7c9b4-x2kqp", None), Err(()));
        // Beyond what an ordinal (an int32) can be.
        assert_eq!(ok("web-2147483648", None), Err(()));
        assert_eq!(
            ok("web-2147483647", None),
            Ok(("web".into(), 2_147_483_647))
        );
        // A given name must prefix the pod name.
        assert_eq!(ok("web-1", Some("api")), Err(()));
        assert_eq!(ok("web-1", Some("we")), Err(()));
        assert_eq!(ok("web-1", Some("web-1")), Err(()));
    }

    #[test]
    fn the_pod_returns_while_its_ordinal_is_below_the_replicas() {
        let three = statefulset(Some(3), None);
        assert_eq!(returns(0, &three), Ok(3));
        assert_eq!(returns(2, &three), Ok(3));
        // Scale-in: the highest ordinals go.
        assert!(returns(3, &three).is_err());
        assert!(returns(2, &statefulset(Some(2), None)).is_err());
        assert!(
            returns(0, &statefulset(Some(0), None)).is_err(),
            "scaled to 0"
        );
        // Unset replicas default to 1.
        assert_eq!(returns(0, &statefulset(None, None)), Ok(1));
        assert!(returns(1, &statefulset(None, None)).is_err());
        // `spec.ordinals.start`: the pods are start..start+replicas.
        let from_five = statefulset(Some(2), Some(5));
        assert!(returns(4, &from_five).is_err());
        assert_eq!(returns(5, &from_five), Ok(2));
        assert_eq!(returns(6, &from_five), Ok(2));
        assert!(returns(7, &from_five).is_err());
        // Being deleted: its pods go with it.
        let mut deleted = three.clone();
        deleted.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        assert!(returns(0, &deleted).is_err());
    }

    #[test]
    fn only_a_statefulset_that_recreates_the_pod_keeps_the_lease() {
        let keep = decide("web-1", "web", 1, Ok(Some(statefulset(Some(3), None))));
        assert_eq!(
            keep,
            ShutdownDecision::Keep {
                statefulset: "web".into(),
                ordinal: 1,
                replicas: 3
            }
        );
        let scaled_in = decide("web-1", "web", 1, Ok(Some(statefulset(Some(1), None))));
        assert!(matches!(scaled_in, ShutdownDecision::Release(_)));
        let missing = decide("web-1", "web", 1, Ok(None));
        assert!(matches!(missing, ShutdownDecision::Release(_)));
        let failed = decide("web-1", "web", 1, Err("forbidden".into()));
        assert!(
            matches!(&failed, ShutdownDecision::Release(reason) if reason.contains("forbidden")),
            "{failed:?}"
        );
    }

    #[tokio::test]
    async fn the_check_releases_without_a_reader_or_an_ordinal() {
        let setting = StatefulSetPod::new("ns");
        let found = Some(Box::new(statefulset(Some(3), None)));
        assert!(matches!(
            check(Some(Reader::Fixed(found.clone())), "web-1", &setting).await,
            ShutdownDecision::Keep { .. }
        ));
        assert!(matches!(
            check(None, "web-1", &setting).await,
            ShutdownDecision::Release(_)
        ));
        assert!(matches!(
            check(Some(Reader::Fixed(found.clone())), "web-abc", &setting).await,
            ShutdownDecision::Release(_)
        ));
        assert!(matches!(
            check(Some(Reader::Fixed(found)), "web-1", &setting.named("api")).await,
            ShutdownDecision::Release(_)
        ));
    }
}
