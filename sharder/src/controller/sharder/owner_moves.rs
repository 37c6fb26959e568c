//! Controlled objects that a sync held back move the moment their controller's drain is
//! acknowledged (docs/protocol.md §9), not at the next sync.
//!
//! The sync's side of it is one [`Handover`]: it starts the following, tells the sync when its
//! drains may go, hands over the children the sync held (counted by `core::sync_rules`, held by
//! `core::owner_wait`) and gives them up to the next sync when patches failed.
//! When a sync holds its first child back it starts one task for the ring ([`Following`]) that
//! watches the ring's main objects that carry its drain label, metadata-only (a handful of
//! objects: those being drained), and hands it each page's held children as it goes. An object
//! leaving that set, by its shard's acknowledgement or by its deletion, frees the children that
//! waited on it, and they are moved at once, each straight to the shard the sync wanted it on.
//! In a ring hashed by namespace the sync looks at controlled objects only after every patch of
//! its main resources was answered, so the watch lists after every drain of the sync: a drained
//! object that has not acknowledged yet is in its list or arrives as an event. Where the shards
//! leave their controlled objects to the sharder (`shardsLeaveControlledObjects`), in a ring
//! hashed by object the sync starts the task first, walks the controlled objects before the main ones
//! and drains only once the watch has listed, so that children move while it still drains
//! others; the task then trusts only what it saw leave ([`Waiting::evidence_only`]) and what the
//! sync found once it listed the main objects. When the sync ends, the task is handed
//! to the controller's loop ([`OwnerMoves`]), and when it ends the ring is synced again: at once
//! when all moved, 5 s later when a move failed or the watch could not list within
//! [`LIST_DEADLINE`].

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use kube::api::{Api, DynamicObject};
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube_sharding_api::GroupResource;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::{AbortHandle, JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use super::patch::{Patcher, api_resource};
use crate::core::key::KeyOutcome;
use crate::core::owner_wait::{HeldChild, OwnerWait, Waiting};
use crate::core::rebalance::RebalanceDecision;
use crate::records;
use crate::views::{ResolvedResource, RingView};

/// How long the watches of drained controllers may take to list before the following gives up
/// and leaves the held objects to a sync (a watch that cannot list, for want of rights say,
/// retries forever).
const LIST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// How the children a sync held back fared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Followed {
    /// Children moved (or found moved or deleted already).
    pub(super) moved: usize,
    /// Moves that failed; the next sync takes them up.
    pub(super) failed: usize,
}

/// What a sync tells its following.
#[derive(Debug)]
enum Handed {
    /// Children it just held back.
    Children(Vec<HeldChild>),
    /// It has listed every main object (as recorded here), after holding children back before
    /// it did.
    MainListed(OwnerWait),
}

/// The following of one sync's held-back children, started by its [`Handover`]; dropping it
/// stops the task.
#[derive(Debug)]
struct Following {
    handed: mpsc::UnboundedSender<Handed>,
    listed: watch::Receiver<bool>,
    task: FollowTask,
}

impl Following {
    /// Starts following for the sync of `view` that `stop` stops: the task stops with it.
    /// `before_drains`: the sync starts it before its first drain and holds children back before
    /// it has listed the main objects (see [`Waiting::evidence_only`]).
    fn start(
        patcher: &Patcher,
        view: Arc<RingView>,
        stop: CancellationToken,
        before_drains: bool,
    ) -> Self {
        let (handed, received) = mpsc::unbounded_channel();
        let (listed_tx, listed) = watch::channel(false);
        let patcher = patcher.clone();
        let waiting = if before_drains {
            Waiting::evidence_only()
        } else {
            Waiting::default()
        };
        let task = tokio::spawn(async move {
            follow(&patcher, view, (received, listed_tx), waiting, stop).await
        });
        Self {
            handed,
            listed,
            task: FollowTask(task),
        }
    }

    /// Hands over children the sync just held back.
    fn hand_over(&self, children: Vec<HeldChild>) {
        if !children.is_empty() {
            // The task only ends before the sync does when it gave up, and then counts nothing
            // more: these wait for the next sync.
            let _ = self.handed.send(Handed::Children(children));
        }
    }

    /// Tells the task where the sync found the main objects, once it listed all of them.
    fn main_listed(&self, owners: OwnerWait) {
        let _ = self.handed.send(Handed::MainListed(owners));
    }

    /// Waits until every watch of drained main objects has listed, or the task gave up and moves
    /// nothing more: from then on the sync may drain. `false` when the task ended before.
    async fn listed(&mut self) -> bool {
        self.listed.wait_for(|listed| *listed).await.is_ok()
    }

    /// Tells the task that the sync held nothing more; it ends once every child moved.
    fn finish(self) -> FollowTask {
        self.task
    }
}

/// Longest a sync's first drain waits for the watch of drained controllers to list; after that
/// the sync drains without it and leaves the held objects to the next sync, so that a watch that
/// cannot list does not hold up the drains.
const DRAINS_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// One sync's handover of the controlled objects it holds back to its [`Following`]: when the
/// following starts, when the sync's drains may go, what it is handed, and when the held objects
/// are left to the next sync instead. The sync only counts and holds (in its
/// [`OwnerWait`]); every decision about following is made here.
#[derive(Debug)]
pub(super) struct Handover {
    patcher: Patcher,
    view: Arc<RingView>,
    /// Fires when a newer view supersedes the sync; stops the following too.
    stop: CancellationToken,
    /// The following, from the first child held on (from the start when `children_first`).
    following: Option<Following>,
    /// Whether the sync walks the controlled objects before the main ones
    /// (`core::sync_rules::children_first`).
    children_first: bool,
    /// Whether the held objects are left to the next sync instead: some of the sync's patches
    /// failed (a controller whose drain failed must not be taken for one that left), it held
    /// more than it remembers, or the watch did not list in time.
    given_up: bool,
}

impl Handover {
    /// The handover of a sync of `view` that `stop` stops; with `children_first` the following
    /// starts at once, to have listed before the sync's first drain.
    pub(super) fn start(
        patcher: &Patcher,
        view: &Arc<RingView>,
        stop: CancellationToken,
        children_first: bool,
    ) -> Self {
        Self {
            following: children_first
                .then(|| Following::start(patcher, Arc::clone(view), stop.clone(), true)),
            patcher: patcher.clone(),
            view: Arc::clone(view),
            stop,
            children_first,
            given_up: false,
        }
    }

    /// Before the sync's first drain: waits until the watch of drained controllers has listed,
    /// when the sync walked the controlled objects first, so that every drain reaches the watch
    /// as an event. A watch that ended or did not list within [`DRAINS_WAIT`] leaves the held
    /// objects to the next sync. Returns early when the sync is superseded (its caller checks).
    pub(super) async fn drains_may_go(&mut self) {
        let Some(following) = &mut self.following else {
            return;
        };
        let listed = tokio::select! {
            () = self.stop.cancelled() => return,
            listed = tokio::time::timeout(DRAINS_WAIT, following.listed()) => listed.unwrap_or(false),
        };
        if !listed {
            let ring = self.view.ring_ref();
            tracing::warn!(event = records::EVENT_CONTROLLER_WATCH_LATE, %ring, "the watch of drained controllers did not list in time; the held objects wait for the next sync");
            self.give_up();
        }
    }

    /// Hands the controlled objects held back in `owner_wait` since the last call to the
    /// following, starting it with the first of them; `failed`: some of the sync's patches
    /// failed or were held, which leaves the held objects to the next sync.
    ///
    /// With the controlled objects walked first the following runs from the start of the sync;
    /// otherwise it starts here, once every patch of the ring's main resources was answered
    /// (controlled objects are looked at after them), so its watch lists after all of the
    /// sync's drains.
    pub(super) fn hand_over(&mut self, owner_wait: &mut OwnerWait, failed: bool) {
        if self.given_up {
            return;
        }
        if failed {
            self.give_up();
            return;
        }
        let Some(children) = owner_wait.take_held() else {
            // Held more than it remembers: the next sync moves them.
            self.give_up();
            return;
        };
        if children.is_empty() {
            return;
        }
        if self.following.is_none() && !self.children_first {
            self.following = Some(Following::start(
                &self.patcher,
                Arc::clone(&self.view),
                self.stop.clone(),
                false,
            ));
        }
        if let Some(following) = &self.following {
            following.hand_over(children);
        }
    }

    /// Tells the following where the sync found the main objects, once it listed all of them:
    /// only a complete listing may free a child whose controller it did not show on the
    /// child's shard. Needed only when the controlled objects were walked first.
    pub(super) fn main_listed(&self, owner_wait: &mut OwnerWait) {
        if self.children_first
            && let Some(following) = &self.following
        {
            following.main_listed(std::mem::take(owner_wait));
        }
    }

    /// The following, to go on after the sync ended (`None` when there is none or it was given
    /// up).
    pub(super) fn finish(&mut self) -> Option<FollowTask> {
        self.following.take().map(Following::finish)
    }

    /// Leaves the held objects to the next sync and stops the following.
    fn give_up(&mut self) {
        self.given_up = true;
        self.following = None;
    }
}

/// A running following; dropping it stops the task.
#[derive(Debug)]
pub(super) struct FollowTask(JoinHandle<Followed>);

impl FollowTask {
    async fn join(mut self) -> Followed {
        (&mut self.0).await.unwrap_or(Followed {
            moved: 0,
            failed: 1,
        })
    }
}

impl Drop for FollowTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The running tasks, at most one per ring, keyed like the sync schedule (`Kind/name`). Dropping
/// it stops them all.
#[derive(Debug, Default)]
pub(super) struct OwnerMoves {
    tasks: JoinSet<(String, u64, Followed)>,
    running: HashMap<String, (u64, AbortHandle)>,
    started: u64,
}

impl OwnerMoves {
    /// Takes over the following `task` of a sync of ring `key` that ended, replacing what
    /// followed that ring before.
    pub(super) fn adopt(&mut self, key: String, task: FollowTask) {
        self.stop(&key);
        self.started += 1;
        let id = self.started;
        let task_key = key.clone();
        let handle = self
            .tasks
            .spawn(async move { (task_key, id, task.join().await) });
        self.running.insert(key, (id, handle));
    }

    /// Stops following the children of ring `key`: a sync starts that looks at them itself.
    pub(super) fn stop(&mut self, key: &str) {
        if let Some((_, handle)) = self.running.remove(key) {
            handle.abort();
        }
    }

    /// Stops following rings that are gone.
    pub(super) fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.running.retain(|key, (_, handle)| {
            let kept = keep(key);
            if !kept {
                handle.abort();
            }
            kept
        });
    }

    /// The next ring whose held-back children have all moved (or failed to), with how they fared;
    /// pending forever while none is followed.
    pub(super) async fn next_done(&mut self) -> (String, Followed) {
        loop {
            match self.tasks.join_next().await {
                Some(Ok((key, id, followed))) => {
                    if self
                        .running
                        .get(&key)
                        .is_some_and(|(current, _)| *current == id)
                    {
                        self.running.remove(&key);
                        return (key, followed);
                    }
                }
                // Aborted: replaced or stopped.
                Some(Err(_)) => {}
                None => futures::future::pending::<()>().await,
            }
        }
    }
}

/// Watches the drain-labelled main objects of `view`'s ring and moves each child `handed` over
/// as soon as nothing it waits on is left; returns once the sync handed over its last children
/// and every child moved or failed to, or when `stop` fires (the sync was superseded).
async fn follow(
    patcher: &Patcher,
    view: Arc<RingView>,
    (mut handed, listed_tx): (mpsc::UnboundedReceiver<Handed>, watch::Sender<bool>),
    mut waiting: Waiting,
    stop: CancellationToken,
) -> Followed {
    let ring = view.ring_ref();
    let mains: Vec<(&GroupResource, _)> = view
        .resources
        .iter()
        .filter(|(_, resource)| resource.is_main())
        .collect();
    let watches = mains.iter().enumerate().map(|(source, (gr, resource))| {
        // `PartialObjectMeta` makes the watch metadata-only.
        let api: Api<PartialObjectMeta<DynamicObject>> = Api::all_with(
            patcher.ctx.client.clone(),
            &api_resource(gr, &resource.info),
        );
        let config = watcher::Config::default().labels(&view.drain_label);
        watcher::watcher(api, config)
            .default_backoff()
            .map(move |event| (source, event))
            .boxed()
    });
    let mut events = futures::stream::select_all(watches);
    let concurrency = usize::try_from(patcher.ctx.config.controller.sharder.concurrent_moves)
        .unwrap_or(1)
        .max(1);
    // Each move is one write that passes no webhook, so `concurrentMoves` of them may run, as in
    // a sync.
    let limit = Arc::new(Semaphore::new(concurrency));
    let mut moves: JoinSet<bool> = JoinSet::new();
    let mut listed: HashSet<usize> = HashSet::new();
    let mut listed_once: HashSet<usize> = HashSet::new();
    let mut followed = Followed::default();
    let mut total = 0;
    // Whether the sync may still hand over children.
    let mut open = true;
    // Whether the watch failed to list in time: what is handed over then waits for a sync.
    let mut gave_up = false;
    let list_deadline = tokio::time::sleep(LIST_DEADLINE);
    tokio::pin!(list_deadline);
    loop {
        if !open && (gave_up || waiting.is_empty()) && moves.is_empty() {
            break;
        }
        let mut freed = Vec::new();
        tokio::select! {
            () = stop.cancelled() => return followed,
            message = handed.recv(), if open => match message {
                None => open = false,
                Some(Handed::Children(children)) => {
                    total += children.len();
                    if gave_up {
                        followed.failed += children.len();
                    } else {
                        freed = waiting.add(children, listed.len() == mains.len());
                    }
                }
                Some(Handed::MainListed(owners)) => {
                    let (free, given_up) = waiting.settle(|child| owners.verdict(child));
                    followed.failed += given_up;
                    freed = free;
                }
            },
            () = &mut list_deadline, if listed_once.len() < mains.len() && !gave_up => {
                tracing::warn!(event = records::EVENT_CONTROLLER_WATCH_LATE, %ring, "the watch of drained controllers did not list in time; a sync moves the held objects");
                followed.failed += waiting.len().max(1);
                waiting = Waiting::default();
                gave_up = true;
                // It moves nothing any more, so the sync's drains need not wait for it.
                listed_tx.send_replace(true);
            }
            Some(done) = moves.join_next(), if !moves.is_empty() => {
                match done {
                    Ok(true) => followed.moved += 1,
                    _ => followed.failed += 1,
                }
                continue;
            }
            event = events.next(), if !gave_up => {
                let Some((source, event)) = event else { break };
                match event {
                    Ok(watcher::Event::Init) => {
                        listed.remove(&source);
                        waiting.listing_again(source, listed_once.contains(&source));
                    }
                    Ok(watcher::Event::InitApply(object) | watcher::Event::Apply(object)) => {
                        let (gr, resource) = mains[source];
                        let released = draining(&view, resource, gr, source, &object, &mut waiting);
                        if listed.len() == mains.len() {
                            freed = released;
                        }
                    }
                    Ok(watcher::Event::InitDone) => {
                        listed.insert(source);
                        listed_once.insert(source);
                        if listed.len() == mains.len() {
                            listed_tx.send_replace(true);
                            freed = waiting.released();
                        }
                    }
                    Ok(watcher::Event::Delete(object)) => {
                        let uid = object.metadata.uid.as_deref().unwrap_or_default();
                        let released = waiting.gone(uid);
                        if listed.len() == mains.len() {
                            freed = released;
                        }
                    }
                    Err(error) => {
                        tracing::debug!(%error, %ring, "watch of drained controllers failed, retrying");
                    }
                }
            }
        }
        for child in freed {
            let (patcher, limit) = (patcher.clone(), Arc::clone(&limit));
            let Some(resource) = view.resources.get(&child.resource) else {
                followed.failed += 1;
                continue;
            };
            let ar = api_resource(&child.resource, &resource.info);
            let view = Arc::clone(&view);
            moves.spawn(async move {
                let _slot = limit.acquire_owned().await;
                move_one(&patcher, &view, &ar, &child).await
            });
        }
    }
    tracing::info!(event = records::EVENT_CONTROLLED_OBJECTS_FOLLOWED, %ring, held = total, moved = followed.moved, failed = followed.failed, "controlled objects followed their controllers' acknowledged drains");
    followed
}

/// Takes in a drain-labelled main object the watch `source` of resource `gr` listed or saw;
/// returns the children that may move now (see [`Waiting::gone`]).
fn draining(
    view: &RingView,
    resource: &ResolvedResource,
    gr: &GroupResource,
    source: usize,
    object: &PartialObjectMeta<DynamicObject>,
    waiting: &mut Waiting,
) -> Vec<HeldChild> {
    let placement = view.placement(&gr.group, resource, &object.metadata);
    let uid = object.metadata.uid.as_deref().unwrap_or_default();
    match (&placement.key, placement.object.current) {
        (Ok(KeyOutcome::Key(key)), Some(shard)) if placement.object.draining => {
            waiting.draining(source, uid, key, shard);
            Vec::new()
        }
        // Not in the way of any child (no key or no shard any more).
        _ => waiting.gone(uid),
    }
}

/// Moves one freed child; whether it went through.
async fn move_one(
    patcher: &Patcher,
    view: &RingView,
    ar: &kube::core::ApiResource,
    child: &HeldChild,
) -> bool {
    match patcher.move_child(view, ar, child).await {
        Ok(moved) => {
            if moved {
                patcher.count(view, &child.resource, RebalanceDecision::Move);
            }
            true
        }
        Err(error) => {
            tracing::debug!(%error, object = %child.name, "moving a controlled object after its controller failed");
            false
        }
    }
}
