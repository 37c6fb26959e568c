//! What a departure is: the object that left the shard ([`ObjectKey`]) and whether it was
//! released to another shard or deleted ([`Departure`], [`Release`]). The watch that finds
//! departures is in `departures.rs`; zero-write rings announce them from their selector layer.
//! These types sit apart so that both reach them without the shard's other parts.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// Identity of an object of one resource: namespace (none when cluster-scoped), name and UID.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    /// Namespace, `None` for cluster-scoped objects.
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
    /// UID, when known: an object recreated under the same name has another one.
    pub uid: Option<String>,
}

impl ObjectKey {
    /// The key of an object from its metadata.
    pub fn of(meta: &ObjectMeta) -> Self {
        Self {
            namespace: meta.namespace.clone(),
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone(),
        }
    }

    /// `(namespace, name)`: what identifies the object in the API, whatever its UID.
    pub(crate) fn slot(&self) -> (Option<String>, String) {
        (self.namespace.clone(), self.name.clone())
    }
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(namespace) => write!(f, "{namespace}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// How an object left this shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// It carried the drain label when it left: the drain this shard acknowledged (the
    /// protocol's way for an object to leave a live shard).
    Drained,
    /// Its shard label changed or went away without a drain, while the shard watched.
    Reassigned,
    /// It was missing when the shard listed its objects: it left while the shard was not
    /// watching (not a member, or its watch restarting).
    FoundMoved,
    /// Zero-write rings: its hash range was revoked from this shard (a new generation of
    /// ranges without it, or a new membership term, which starts with no ranges).
    RangeRevoked,
}

impl Release {
    /// A fixed name for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Drained => "drained",
            Self::Reassigned => "reassigned",
            Self::FoundMoved => "found_moved",
            Self::RangeRevoked => "range_revoked",
        }
    }
}

/// An object that left this shard's watch, classified by a read of the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Departure {
    /// The object still exists but belongs to this shard no more. Drop local state for it,
    /// leave its external resources to its new shard.
    Released {
        /// The object.
        object: ObjectKey,
        /// How it left.
        how: Release,
    },
    /// The object is gone from the API server (or was replaced by a new object of the same
    /// name). Clean up after it.
    Deleted {
        /// The object.
        object: ObjectKey,
    },
}

impl Departure {
    /// The object that departed.
    pub fn object(&self) -> &ObjectKey {
        match self {
            Self::Released { object, .. } | Self::Deleted { object } => object,
        }
    }
}
