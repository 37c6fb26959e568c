//! The faults of a run, drawn up front from the seed, so that `--seed` replays the same plan:
//! the same kinds at the same offsets with the same durations and target picks. (What a pick
//! hits, the second running shard say, depends on the live system and may differ on replay.)

use std::time::Duration;

use serde::Serialize;

/// A small, seedable pseudo-random generator (SplitMix64): good enough to draw a fault plan and
/// churn, and reproducible on every platform without a dependency.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// An independent stream for another purpose, derived from this seed and `stream`.
    pub(crate) fn stream(seed: u64, stream: u64) -> Self {
        let mut base = Self(seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F));
        // Mix once so streams of neighbouring seeds do not start alike.
        base.next_u64();
        base
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`); the modulo bias is irrelevant at these sizes.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A duration uniform in `[low, high]`.
    pub(crate) fn between(&mut self, low: Duration, high: Duration) -> Duration {
        low + (high.saturating_sub(low)).mul_f64(self.unit())
    }
}

/// What a fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum FaultKind {
    /// SIGKILL a shard; it is started again (same name) after `hold`.
    ShardKill,
    /// SIGTERM a shard (it releases its Lease); started again after `hold`.
    ShardTerm,
    /// SIGSTOP a shard for `hold`, long enough for the sharder to take its Lease over, then
    /// SIGCONT; it must notice the loss and exit, and is started again.
    ShardPause,
    /// Start one more shard under a new name.
    ScaleOut,
    /// SIGTERM a shard for good.
    ScaleIn,
    /// SIGKILL the sharder replica holding the leader Lease; restarted after `hold`.
    LeaderKill,
    /// SIGTERM the leading sharder replica; restarted after `hold`.
    LeaderTerm,
    /// SIGKILL the sharder replica not leading; restarted after `hold`.
    FollowerKill,
    /// SIGTERM the sharder replica not leading; restarted after `hold`.
    FollowerTerm,
    /// Stop kube-apiserver, wait `hold`, start it again with the same flags.
    ApiserverRestart,
    /// Cut the API server off the webhook (connections refused) for `hold`.
    WebhookOutage,
    /// Create a Lease named like a running shard in another namespace of the ring (held by that
    /// name, renewed once), as someone allowed to create Leases there would; deleted after `hold`.
    LeaseSquat,
    /// Delete a running shard's Lease; the shard notices at its next renewal and exits.
    LeaseDelete,
    /// Remove the ring label from a running shard's Lease; the shard puts it back when it renews.
    LeaseRelabel,
    /// Create a held Lease of the ring without `acquireTime` and `renewTime` under a new name, in
    /// another namespace; nobody renews or deletes it.
    LeaseMalformed,
    /// Restart a running shard with its clock `2 D` behind (in the timestamps it writes into its
    /// Lease); it stays skewed for the rest of the run.
    ClockSkew,
}

impl FaultKind {
    /// Every kind, in the order a deck of them is shuffled from.
    pub(crate) const ALL: [Self; 16] = [
        Self::ShardKill,
        Self::ShardTerm,
        Self::ShardPause,
        Self::ScaleOut,
        Self::ScaleIn,
        Self::LeaderKill,
        Self::LeaderTerm,
        Self::FollowerKill,
        Self::FollowerTerm,
        Self::ApiserverRestart,
        Self::WebhookOutage,
        Self::LeaseSquat,
        Self::LeaseDelete,
        Self::LeaseRelabel,
        Self::LeaseMalformed,
        Self::ClockSkew,
    ];

    /// The kebab-case name used in reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::ShardKill => "shard-kill",
            Self::ShardTerm => "shard-term",
            Self::ShardPause => "shard-pause",
            Self::ScaleOut => "scale-out",
            Self::ScaleIn => "scale-in",
            Self::LeaderKill => "leader-kill",
            Self::LeaderTerm => "leader-term",
            Self::FollowerKill => "follower-kill",
            Self::FollowerTerm => "follower-term",
            Self::ApiserverRestart => "apiserver-restart",
            Self::WebhookOutage => "webhook-outage",
            Self::LeaseSquat => "lease-squat",
            Self::LeaseDelete => "lease-delete",
            Self::LeaseRelabel => "lease-relabel",
            Self::LeaseMalformed => "lease-malformed",
            Self::ClockSkew => "clock-skew",
        }
    }

    /// Whether the fault strikes one ring's shards or their Leases (then every ring under test
    /// gets one of its own), rather than the whole system (the sharder replicas, the API server,
    /// the webhook).
    pub(crate) fn on_shards(self) -> bool {
        !matches!(
            self,
            Self::LeaderKill
                | Self::LeaderTerm
                | Self::FollowerKill
                | Self::FollowerTerm
                | Self::ApiserverRestart
                | Self::WebhookOutage
        )
    }

    /// How long the fault lasts or until the victim comes back, drawn for one occurrence.
    fn draw_hold(self, rng: &mut Rng, timing: &PlanTiming) -> Duration {
        let s = Duration::from_secs;
        match self {
            Self::ShardKill | Self::ShardTerm => rng.between(s(1), s(6)),
            // The sharder takes a Lease over once `renewTime + 2 × D` has passed; the last
            // renewal is at most a retry period old when the pause starts.
            Self::ShardPause => timing.shard_lease * 2 + rng.between(s(3), s(8)),
            Self::LeaderKill | Self::LeaderTerm | Self::FollowerKill | Self::FollowerTerm => {
                rng.between(s(1), s(6))
            }
            Self::ApiserverRestart => rng.between(Duration::ZERO, s(3)),
            Self::WebhookOutage | Self::LeaseSquat => rng.between(s(2), s(8)),
            Self::ClockSkew => rng.between(Duration::ZERO, s(2)),
            Self::ScaleOut
            | Self::ScaleIn
            | Self::LeaseDelete
            | Self::LeaseRelabel
            | Self::LeaseMalformed => Duration::ZERO,
        }
    }
}

/// One fault of the plan.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct PlannedFault {
    /// Offset from the start of the chaos phase, in seconds.
    pub(crate) at_seconds: f64,
    pub(crate) kind: FaultKind,
    /// Picks the victim among the candidates at that moment (modulo their number).
    pub(crate) pick: u64,
    /// See [`FaultKind`]: pause, outage or downtime length, in seconds.
    pub(crate) hold_seconds: f64,
}

/// What the plan's draws depend on besides the seed.
#[derive(Clone, Debug)]
pub(crate) struct PlanTiming {
    /// How long faults are injected.
    pub(crate) duration: Duration,
    /// Mean gap between faults; each gap is uniform in half to one and a half of it.
    pub(crate) interval: Duration,
    /// The shards' Lease duration.
    pub(crate) shard_lease: Duration,
}

/// Draws the plan: kinds come from a shuffled deck of every kind, redealt when empty, so a run
/// of a dozen faults sees every kind and a long run sees them equally often.
pub(crate) fn draw(seed: u64, timing: &PlanTiming, kinds: &[FaultKind]) -> Vec<PlannedFault> {
    let mut rng = Rng::stream(seed, 1);
    let mut plan = Vec::new();
    let mut deck: Vec<FaultKind> = Vec::new();
    // The first fault comes after one gap: the system starts from a settled state.
    let mut at = rng.between(timing.interval / 2, timing.interval * 3 / 2);
    while at < timing.duration && !kinds.is_empty() {
        if deck.is_empty() {
            deck = kinds.to_vec();
            // Fisher-Yates.
            for i in (1..deck.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                deck.swap(i, j);
            }
        }
        let Some(kind) = deck.pop() else { break };
        let hold = kind.draw_hold(&mut rng, timing);
        plan.push(PlannedFault {
            at_seconds: round_ms(at),
            kind,
            pick: rng.next_u64(),
            hold_seconds: round_ms(hold),
        });
        at += rng.between(timing.interval / 2, timing.interval * 3 / 2);
    }
    plan
}

/// Seconds rounded to milliseconds, for readable plans.
pub(crate) fn round_ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(duration_secs: u64) -> PlanTiming {
        PlanTiming {
            duration: Duration::from_secs(duration_secs),
            interval: Duration::from_secs(5),
            shard_lease: Duration::from_secs(10),
        }
    }

    #[test]
    fn the_same_seed_draws_the_same_plan() {
        let a = draw(42, &timing(300), &FaultKind::ALL);
        let b = draw(42, &timing(300), &FaultKind::ALL);
        let c = draw(43, &timing(300), &FaultKind::ALL);
        let key = |p: &[PlannedFault]| {
            p.iter()
                .map(|f| {
                    (
                        f.at_seconds.to_bits(),
                        f.kind,
                        f.pick,
                        f.hold_seconds.to_bits(),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(key(&a), key(&b));
        assert_ne!(key(&a), key(&c));
    }

    /// Every full deck holds each kind once, so eleven consecutive faults from a deal cover all.
    /// Ten kinds strike a ring's shards or their Leases; the sharder, API server and webhook
    /// faults strike the whole system once.
    #[test]
    fn faults_on_shards_are_the_shard_and_lease_kinds() {
        let on_shards: Vec<&str> = FaultKind::ALL
            .into_iter()
            .filter(|k| k.on_shards())
            .map(FaultKind::name)
            .collect();
        assert_eq!(on_shards.len(), 10, "{on_shards:?}");
        assert!(
            on_shards.iter().all(|k| k.starts_with("shard-")
                || k.starts_with("scale-")
                || k.starts_with("lease-")
                || *k == "clock-skew"),
            "{on_shards:?}"
        );
    }

    #[test]
    fn decks_cover_every_kind() {
        let plan = draw(7, &timing(600), &FaultKind::ALL);
        assert!(
            plan.len() >= 2 * FaultKind::ALL.len(),
            "{} faults",
            plan.len()
        );
        for deal in plan.chunks(FaultKind::ALL.len()).take(2) {
            let mut kinds: Vec<FaultKind> = deal.iter().map(|f| f.kind).collect();
            kinds.sort();
            assert_eq!(kinds, FaultKind::ALL);
        }
    }

    #[test]
    fn faults_stay_within_the_duration_and_pauses_outlast_a_takeover() {
        let plan = draw(3, &timing(120), &FaultKind::ALL);
        assert!(!plan.is_empty());
        let mut last = 0.0;
        for fault in &plan {
            assert!(fault.at_seconds >= last && fault.at_seconds < 120.0);
            last = fault.at_seconds;
            if fault.kind == FaultKind::ShardPause {
                assert!(fault.hold_seconds >= 23.0, "{fault:?}");
            }
        }
    }

    #[test]
    fn draws_stay_in_range() {
        let mut rng = Rng::new(1);
        for _ in 0..1000 {
            assert!(rng.below(3) < 3);
            let u = rng.unit();
            assert!((0.0..1.0).contains(&u));
            let d = rng.between(Duration::from_secs(2), Duration::from_secs(4));
            assert!(d >= Duration::from_secs(2) && d <= Duration::from_secs(4));
        }
    }
}
