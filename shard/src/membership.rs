//! [`Shard::run`]: a shard's life in its ring, term after term: acquire the Lease, run the work
//! while it is held, stop at once on loss, and step out and rejoin later when the sharder
//! excludes the Lease from the ring.

use std::future::Future;
use std::time::Duration;

use futures::StreamExt;
use kube_sharding_api::labels::LABEL_STATE;
use kube_sharding_api::lease::ShardState;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::Shard;
use crate::lease::{Error, LeaseGuard, LeaseLock, RunEnd};
use crate::records::{EVENT_SHARD_EXCLUDED, EVENT_TERM_STARTED};
use crate::shutdown::{self, OnShutdown, ShutdownDecision};

/// How the wait for the sharder's judgement of a new holding ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Judgement {
    /// The sharder admitted this holding.
    Admitted,
    /// No sharder labelled the Lease within the fallback: none serves the ring.
    NoSharder,
}

/// Resolves once a version of the Lease `lock` just created or took over shows that the sharder
/// admitted this holding: held by us, with the sharder's state label ([`LABEL_STATE`]) `ready`,
/// which the acquiring write removed, so the sharder wrote it after seeing us, and without the
/// exclusion annotation, which the sharder writes in the same patch as the state label. Never
/// resolves otherwise (an exclusion reaches the renewer, which ends the term).
///
/// The sharder holds `ready` back while it still moves objects off this shard from when it was
/// unavailable (docs/protocol.md §22), so the work's first listing no longer sees them. Only
/// when `fallback` has passed since the acquiring write, the holding was renewed (an exclusion
/// arrives with a renewal's answer at the latest), and no version of the Lease since that write
/// carried a state label at all, does it conclude that no sharder serves the ring
/// ([`Judgement::NoSharder`]): a sharder that labelled the Lease is waited for, however long.
fn judgement(
    lock: &LeaseLock,
    renewed: LeaseGuard,
    fallback: Duration,
) -> impl Future<Output = Judgement> + Send + 'static {
    let mut versions = lock.changes();
    let config = lock.config();
    let identity = config.identity().to_string();
    let exclusion = config.exclusion_annotation().map(str::to_string);
    let deadline = tokio::time::Instant::now() + fallback;
    async move {
        let no_sharder_yet = async {
            if renewed.renewed().await.is_err() {
                // Ended meanwhile: `run` reports how.
                std::future::pending::<()>().await;
            }
            tokio::time::sleep_until(deadline).await;
        };
        tokio::pin!(no_sharder_yet);
        let (mut labelled_since, mut waited) = (false, false);
        loop {
            tokio::select! {
                version = versions.next() => {
                    let Some(lease) = version else {
                        return std::future::pending().await;
                    };
                    let meta = &lease.metadata;
                    let ours = lease
                        .spec
                        .as_ref()
                        .and_then(|s| s.holder_identity.as_deref())
                        == Some(identity.as_str());
                    let state = meta.labels.as_ref().and_then(|l| l.get(LABEL_STATE));
                    let excluded = exclusion.as_ref().is_some_and(|key| {
                        meta.annotations
                            .as_ref()
                            .is_some_and(|a| a.contains_key(key))
                    });
                    if ours && state.is_some() {
                        labelled_since = true;
                        if state.map(String::as_str) == Some(ShardState::Ready.as_str()) && !excluded {
                            return Judgement::Admitted;
                        }
                    }
                }
                () = &mut no_sharder_yet, if !waited => {
                    waited = true;
                    if !labelled_since {
                        return Judgement::NoSharder;
                    }
                }
            }
        }
    }
}

/// One membership term: what the work run by [`Shard::run`] gets.
#[derive(Debug, Clone)]
pub struct Term {
    /// The Lease's guard for this term: pass it to [`Shard::reconciler`].
    pub guard: LeaseGuard,
    /// Cancelled on shutdown: stop gracefully on it
    /// (`Controller::graceful_shutdown_on(stop.cancelled_owned())`).
    pub stop: CancellationToken,
    /// 1 for the first term, counting up with every rejoin.
    pub number: u32,
}

/// How [`Shard::run`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum ShardRunEnd {
    /// The Lease was lost: the work was dropped at once and nothing was released (someone
    /// else may hold the Lease now). Exiting the process is the safest reaction.
    LeaseLost,
    /// Shutdown (or the work ended on its own): the work stopped, then the Lease was released
    /// if it was held (`released`).
    Stopped {
        /// Whether the release wrote the Lease.
        released: bool,
    },
    /// Shutdown of a shard whose pod comes back ([`OnShutdown::KeepIfReturning`]): the work
    /// stopped, then the renewals, and the Lease was left held for the returning pod.
    Kept,
}

impl Shard {
    /// Runs `work` as this shard, term after term, until the Lease is lost or `shutdown` fires
    /// (docs/protocol.md §3):
    ///
    /// 1. acquires the Lease with `lock` (built from [`Shard::lease_config`]);
    /// 2. runs `work(term)` while it is held ([`HeldLease::run_while_held`]): dropped at once
    ///    when the Lease is lost, stopped and then the Lease released on shutdown;
    /// 3. when the sharder excludes the Lease from its ring (the annotation
    ///    [`ANNOTATION_EXCLUDED`], seen in the answer to a renewal or in a read, e.g. because
    ///    an older Lease of the same shard name exists in another namespace, docs/protocol.md
    ///    §18): the term's guard ends at once, so no reconcile continues or starts and no drain
    ///    is acknowledged (the objects labelled with this name belong to the other copy); the
    ///    work is dropped, the Lease released, the reason logged at error level
    ///    (`event = "shard_excluded"`, `reason`), and after [`Shard::with_rejoin_pause`]
    ///    (30 s by default) the shard tries to join again: [`LeaseLock::acquire`] waits while
    ///    the Lease still carries the annotation, polling every retry period.
    ///
    /// Each term gets a fresh guard; local state that should survive a rejoin lives outside
    /// `work`.
    ///
    /// **Cost:** when acquiring created the Lease (the first start of a shard, or after the
    /// sharder deleted a Lease released long ago) or took it over (a restart after a release,
    /// or after the Lease expired), the work starts only once the sharder has judged this
    /// holding: the acquiring write removes the sharder's state label, and a watch of the Lease
    /// sees the sharder write `ready` again (together with the exclusion annotation when it
    /// excludes the Lease) without an exclusion, usually within milliseconds. Until then the objects
    /// labelled with this name may be another copy's, and objects the sharder was moving off
    /// this shard while it was unavailable may still be on their way: the sharder writes `ready`
    /// only when those moves have landed (docs/protocol.md §22), however long they take. Only
    /// when no sharder has labelled the Lease at all since it was taken, for
    /// [`Shard::with_judgement_fallback`] (60 s by default) and at least one renewal, does the
    /// work start without a judgement (a warning says so). Renewing a Lease this shard still
    /// held (a restart within the Lease duration) needs no judgement: to the sharder the shard
    /// never left.
    ///
    /// **On shutdown** the work is stopped first, then the Lease is released
    /// ([`OnShutdown::Release`], the default), or, with [`OnShutdown::KeepIfReturning`] and a
    /// StatefulSet that recreates this shard's pod, left held for the returning pod, which
    /// renews it and starts at once ([`ShardRunEnd::Kept`]; see [`Shard::with_on_shutdown`]).
    ///
    /// [`HeldLease::run_while_held`]: crate::HeldLease::run_while_held
    /// [`ANNOTATION_EXCLUDED`]: kube_sharding_api::labels::ANNOTATION_EXCLUDED
    pub async fn run<W, F>(
        &self,
        lock: &LeaseLock,
        shutdown: &CancellationToken,
        mut work: W,
    ) -> Result<ShardRunEnd, Error>
    where
        W: FnMut(Term) -> F,
        F: Future<Output = ()>,
    {
        let mut number = 0;
        loop {
            let held = tokio::select! {
                biased;
                () = shutdown.cancelled() => return Ok(ShardRunEnd::Stopped { released: false }),
                held = lock.acquire() => held,
            };
            number += 1;
            let guard = held.guard();
            // A Lease this process just created or took over has not been judged by the
            // sharder yet: if it is a duplicate, the exclusion arrives with the sharder's state
            // label, or at the latest with the first renewal. Until then the objects labelled
            // with this name may be another copy's, or still on their way to other shards.
            let probation = held.created() || held.unjudged();
            let fallback = self.judgement_fallback();
            // Zero-write rings: a term starts with no ranges, and follows the Lease's from the
            // sharder's judgement on.
            let follow = self.server_side_part().map(|server_side| {
                server_side.reset();
                server_side.follow(lock, guard.clone(), self.name().to_string())
            });
            let keep = || async {
                match self.on_shutdown() {
                    OnShutdown::Release => false,
                    OnShutdown::KeepIfReturning(pod) => {
                        let decision =
                            shutdown::check(lock.statefulset_reader(), self.name(), pod).await;
                        matches!(decision, ShutdownDecision::Keep { .. })
                    }
                }
            };
            let end = held
                .run(shutdown, |stop| {
                    let judged = probation.then(|| judgement(lock, guard.clone(), fallback));
                    let work = work(Term {
                        guard,
                        stop,
                        number,
                    });
                    let shard = self.name().to_string();
                    async move {
                        let acquired = std::time::Instant::now();
                        // An exclusion ends the term through the renewer while this waits.
                        let judgement = match judged {
                            Some(judged) => judged.await,
                            None => Judgement::Admitted,
                        };
                        if judgement == Judgement::NoSharder {
                            warn!(
                                %shard,
                                term = number,
                                ?fallback,
                                "no sharder labelled this shard's Lease since it was taken: starting work without the sharder's judgement"
                            );
                        }
                        info!(
                            event = EVENT_TERM_STARTED,
                            %shard,
                            term = number,
                            waited_ms = acquired.elapsed().as_secs_f64() * 1e3,
                            judged = judgement == Judgement::Admitted,
                            "starting work"
                        );
                        match follow {
                            Some(follow) => {
                                tokio::select! {
                                    () = work => {}
                                    () = follow => {}
                                }
                            }
                            None => work.await,
                        }
                    }
                }, keep)
                .await?;
            match end {
                RunEnd::Lost => return Ok(ShardRunEnd::LeaseLost),
                RunEnd::Kept => return Ok(ShardRunEnd::Kept),
                RunEnd::Ended { released } => return Ok(ShardRunEnd::Stopped { released }),
                RunEnd::Excluded { reason, released } => {
                    error!(
                        event = EVENT_SHARD_EXCLUDED,
                        shard = %self.name(),
                        %reason,
                        released,
                        rejoin_pause = ?self.rejoin_pause(),
                        "the sharder excluded this shard from its ring: stopped work, released the Lease, rejoining after a pause"
                    );
                    tokio::select! {
                        biased;
                        () = shutdown.cancelled() => return Ok(ShardRunEnd::Stopped { released }),
                        () = tokio::time::sleep(self.rejoin_pause()) => {}
                    }
                    info!(shard = %self.name(), "trying to rejoin the ring");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ranges;
