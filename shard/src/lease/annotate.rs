//! One annotation written on a held Lease outside the renewals: a zero-write ring's
//! acknowledgement, which cannot wait for the next renewal (docs/zero-write-rings.md).

use std::collections::BTreeMap;

use super::decision::is_held_by;
use super::lock::LeaseLock;
use super::store::{is_conflict, is_not_found};
use super::{Error, resource_version};

impl LeaseLock {
    /// Sets the annotation `key` to `value` on the Lease while this lock's identity holds it:
    /// a compare-and-swap on the `resourceVersion` like every write of the lock; on a conflict
    /// (a renewal or the sharder wrote in between) it reads again and retries. Returns `false`
    /// without writing when the Lease is gone or held by someone else, or when
    /// `still_wanted` says no for the fresh version (say, a newer generation arrived
    /// meanwhile). The renewer's next write then conflicts once and retries from a fresh read,
    /// as after any other writer.
    pub(crate) async fn annotate_held(
        &self,
        key: &str,
        value: &str,
        still_wanted: impl Fn(&BTreeMap<String, String>) -> bool,
    ) -> Result<bool, Error> {
        let inner = &self.inner;
        for _ in 0..5 {
            let Some(mut lease) = inner.store.get().await.map_err(|e| inner.get_error(e))? else {
                return Ok(false);
            };
            if !is_held_by(lease.spec.as_ref(), &inner.config.identity) {
                return Ok(false);
            }
            let annotations = lease.metadata.annotations.get_or_insert_default();
            if annotations.get(key).map(String::as_str) == Some(value) {
                return Ok(true);
            }
            if !still_wanted(annotations) {
                return Ok(false);
            }
            annotations.insert(key.to_string(), value.to_string());
            lease.metadata.managed_fields = None;
            match inner.store.replace(&lease).await {
                Ok(written) => {
                    tracing::debug!(
                        lease = %inner.config.name,
                        %key,
                        %value,
                        resource_version = resource_version(&written),
                        "annotated Lease"
                    );
                    return Ok(true);
                }
                Err(e) if is_conflict(&e) || is_not_found(&e) => {}
                Err(e) => return Err(inner.write_error(e)),
            }
        }
        Err(inner.contended("annotate"))
    }
}
