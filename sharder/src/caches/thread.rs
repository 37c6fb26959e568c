//! The thread the caches' watches run on.
//!
//! Every renewal of every shard Lease reaches every replica as a watch event: 500 a second with
//! 1,000 shards. On the process's multi-threaded runtime the connection task that reads an event
//! and the task that applies it to the cache often ran on different worker threads, so each event
//! also cost waking a parked thread. On a single-threaded runtime of their own, with a client of
//! their own (so that their connections are spawned there too), reading and applying an event is
//! one thread's work with no hand-off; the webhook and the controllers keep every core.

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// A single-threaded runtime on a thread of its own; it stops when this is dropped.
pub(crate) struct CacheThread {
    handle: Handle,
    stop: CancellationToken,
}

impl CacheThread {
    /// Starts the thread and its runtime.
    pub(crate) fn start() -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let stop = CancellationToken::new();
        let until = stop.clone();
        std::thread::Builder::new()
            .name("sharder-caches".into())
            .spawn(move || runtime.block_on(until.cancelled()))?;
        Ok(Self { handle, stop })
    }

    /// Where to spawn the caches' tasks.
    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }
}

impl Drop for CacheThread {
    fn drop(&mut self) {
        // Tasks still running on it are dropped with the runtime.
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tasks_run_on_the_cache_thread_until_it_is_dropped() {
        let caches = CacheThread::start().expect("a runtime");
        let name = caches
            .handle()
            .spawn(async { std::thread::current().name().map(str::to_string) })
            .await
            .expect("the task ran");
        assert_eq!(name.as_deref(), Some("sharder-caches"));
        let pending = caches.handle().spawn(std::future::pending::<()>());
        drop(caches);
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), pending)
            .await
            .expect("the runtime stopped with the thread");
        assert!(ended.is_err_and(|e| e.is_cancelled()));
    }
}
