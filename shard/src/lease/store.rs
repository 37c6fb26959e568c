//! Where the Lease lives: the API server, or (in unit tests) an in-memory fake with the same
//! optimistic-concurrency rules.

use futures::stream::BoxStream;
use futures::{StreamExt, future};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, watcher};

/// Access to the single Lease a lock manages.
#[derive(Clone)]
#[cfg_attr(
    test,
    expect(
        clippy::large_enum_variant,
        reason = "the small fake variant exists only in tests"
    )
)]
pub(crate) enum Store {
    /// The real API server.
    Api {
        /// Namespaced Lease API.
        api: Api<Lease>,
        /// Name of the Lease.
        name: String,
    },
    /// In-memory stand-in for unit tests.
    #[cfg(test)]
    Fake(fake::FakeStore),
}

impl Store {
    /// The Lease, or `None` when it does not exist.
    pub(crate) async fn get(&self) -> Result<Option<Lease>, kube::Error> {
        match self {
            Self::Api { api, name } => api.get_opt(name).await,
            #[cfg(test)]
            Self::Fake(fake) => fake.get().await,
        }
    }

    /// Creates the Lease; fails with 409 when it exists already.
    pub(crate) async fn create(&self, lease: &Lease) -> Result<Lease, kube::Error> {
        match self {
            Self::Api { api, .. } => api.create(&PostParams::default(), lease).await,
            #[cfg(test)]
            Self::Fake(fake) => fake.create(lease).await,
        }
    }

    /// Replaces the Lease. Callers always pass the `resourceVersion` they read, which turns the
    /// write into a compare-and-swap: 409 when someone else wrote in between.
    pub(crate) async fn replace(&self, lease: &Lease) -> Result<Lease, kube::Error> {
        match self {
            Self::Api { api, name } => api.replace(name, &PostParams::default(), lease).await,
            #[cfg(test)]
            Self::Fake(fake) => fake.replace(lease).await,
        }
    }

    /// Every version of the Lease written from now on (and the current one), as a watch sees
    /// them; errors are retried with backoff and never end the stream.
    pub(crate) fn changes(&self) -> BoxStream<'static, Lease> {
        match self {
            Self::Api { api, name } => {
                let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
                watcher(api.clone(), config)
                    .default_backoff()
                    .applied_objects()
                    .filter_map(|lease| future::ready(lease.ok()))
                    .boxed()
            }
            #[cfg(test)]
            Self::Fake(fake) => fake.changes(),
        }
    }
}

/// Whether the API refused a write because someone else changed or created the object first.
pub(crate) fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

/// Whether the API server refused the write for its content (invalid, or forbidden by an
/// admission policy), as opposed to a race or an outage.
pub(crate) fn is_refusal(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if matches!(status.code, 400 | 403 | 422))
}

/// Whether the object does not exist.
pub(crate) fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 404)
}

#[cfg(test)]
pub(crate) mod fake {
    use std::sync::{Arc, Mutex, MutexGuard};

    use futures::StreamExt;
    use futures::stream::BoxStream;
    use k8s_openapi::api::coordination::v1::Lease;
    use kube::core::Status;

    /// How the fake answers the next calls.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Mode {
        /// Behave like an API server.
        Normal,
        /// Fail every call with 500.
        Fail,
        /// Never answer (a hung connection).
        Hang,
    }

    #[derive(Debug)]
    struct State {
        lease: Option<Lease>,
        resource_version: u64,
        mode: Mode,
        writes: usize,
        /// Tells watchers (`FakeStore::changes`) about every new version.
        versions: tokio::sync::watch::Sender<Option<Lease>>,
        /// What a shard's shutdown check reads as its StatefulSet (`None`: not found).
        statefulset: Option<k8s_openapi::api::apps::v1::StatefulSet>,
        /// An annotation whose new value the fake refuses with 422, as an admission policy
        /// would.
        refused_annotation: Option<String>,
    }

    impl State {
        /// Stores `lease` as the next version, like a successful write on the server.
        fn store(&mut self, lease: &Lease) -> Lease {
            self.resource_version += 1;
            self.writes += 1;
            let mut stored = lease.clone();
            stored.metadata.resource_version = Some(self.resource_version.to_string());
            self.lease = Some(stored.clone());
            self.versions.send_replace(self.lease.clone());
            stored
        }
    }

    /// An in-memory Lease with resourceVersion checks.
    #[derive(Clone, Debug)]
    pub(crate) struct FakeStore(Arc<Mutex<State>>);

    fn status(code: u16, reason: &str) -> kube::Error {
        kube::Error::Api(Status::failure(reason, reason).with_code(code).boxed())
    }

    impl FakeStore {
        pub(crate) fn new() -> Self {
            Self(Arc::new(Mutex::new(State {
                lease: None,
                resource_version: 0,
                mode: Mode::Normal,
                writes: 0,
                versions: tokio::sync::watch::Sender::new(None),
                statefulset: None,
                refused_annotation: None,
            })))
        }

        /// Sets what a shard's shutdown check reads as its StatefulSet.
        pub(crate) fn set_statefulset(
            &self,
            statefulset: Option<k8s_openapi::api::apps::v1::StatefulSet>,
        ) {
            self.state().statefulset = statefulset;
        }

        /// What a shard's shutdown check reads as its StatefulSet.
        pub(crate) fn statefulset(&self) -> Option<k8s_openapi::api::apps::v1::StatefulSet> {
            self.state().statefulset.clone()
        }

        fn state(&self) -> MutexGuard<'_, State> {
            self.0.lock().expect("fake store lock")
        }

        /// Refuses every write that changes the annotation `key` (`None`: none).
        pub(crate) fn refuse_annotation(&self, key: Option<&str>) {
            self.state().refused_annotation = key.map(str::to_string);
        }

        /// The refusal of a write of `lease` over `current`, if its annotations are refused.
        fn refusal(state: &State, lease: &Lease) -> Result<(), kube::Error> {
            let Some(key) = state.refused_annotation.as_ref() else {
                return Ok(());
            };
            let value = |l: Option<&Lease>| {
                l.and_then(|l| l.metadata.annotations.as_ref()?.get(key).cloned())
            };
            if value(Some(lease)) == value(state.lease.as_ref()) {
                Ok(())
            } else {
                Err(status(422, "Invalid"))
            }
        }

        pub(crate) fn set_mode(&self, mode: Mode) {
            self.state().mode = mode;
        }

        /// The stored Lease, as a test observer sees it.
        pub(crate) fn lease(&self) -> Option<Lease> {
            self.state().lease.clone()
        }

        /// Number of successful writes so far.
        pub(crate) fn writes(&self) -> usize {
            self.state().writes
        }

        /// Changes the stored Lease as another writer would (bumping the resourceVersion).
        pub(crate) fn modify(&self, f: impl FnOnce(&mut Lease)) {
            let mut state = self.state();
            state.resource_version += 1;
            let rv = state.resource_version.to_string();
            if let Some(lease) = state.lease.as_mut() {
                f(lease);
                lease.metadata.resource_version = Some(rv);
            }
            let current = state.lease.clone();
            state.versions.send_replace(current);
        }

        /// Deletes the stored Lease as another writer would.
        pub(crate) fn delete(&self) {
            let mut state = self.state();
            state.lease = None;
            state.versions.send_replace(None);
        }

        /// The current version and every later one, like a watch by name.
        pub(crate) fn changes(&self) -> BoxStream<'static, Lease> {
            let versions = self.state().versions.subscribe();
            futures::stream::unfold((versions, true), |(mut versions, first)| async move {
                if !first {
                    versions.changed().await.ok()?;
                }
                loop {
                    let current = versions.borrow_and_update().clone();
                    if let Some(lease) = current {
                        return Some((lease, (versions, false)));
                    }
                    versions.changed().await.ok()?;
                }
            })
            .boxed()
        }

        async fn gate(&self) -> Result<(), kube::Error> {
            let mode = self.state().mode;
            match mode {
                Mode::Normal => Ok(()),
                Mode::Fail => Err(status(500, "InternalError")),
                Mode::Hang => futures::future::pending().await,
            }
        }

        pub(crate) async fn get(&self) -> Result<Option<Lease>, kube::Error> {
            self.gate().await?;
            Ok(self.state().lease.clone())
        }

        pub(crate) async fn create(&self, lease: &Lease) -> Result<Lease, kube::Error> {
            self.gate().await?;
            let mut state = self.state();
            if state.lease.is_some() {
                return Err(status(409, "AlreadyExists"));
            }
            Self::refusal(&state, lease)?;
            Ok(state.store(lease))
        }

        pub(crate) async fn replace(&self, lease: &Lease) -> Result<Lease, kube::Error> {
            self.gate().await?;
            let mut state = self.state();
            let Some(current) = state.lease.as_ref() else {
                return Err(status(404, "NotFound"));
            };
            if lease.metadata.resource_version.is_none() {
                panic!("the lock wrote a Lease without resourceVersion (a blind write)");
            }
            if current.metadata.resource_version != lease.metadata.resource_version {
                return Err(status(409, "Conflict"));
            }
            Self::refusal(&state, lease)?;
            Ok(state.store(lease))
        }
    }
}
