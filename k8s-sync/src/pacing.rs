//! When the node agent may publish again: a pure decision over instants the caller
//! passes in (tests run it in virtual time).
//!
//! A publish (rebuilding the node state and writing it to shared memory) that took `T`
//! is followed by at least [`PAUSE_FACTOR`] x `T` without one; changes arriving meanwhile
//! are coalesced into the next. So under a burst of changes publishing takes at most
//! about a quarter of a core however fast changes come, and however cheap a publish is
//! (a cheaper publish only publishes more often): at 10 000 Services a cold start kept
//! the agent publishing back to back, and live creation with a pause of `T` kept it at
//! half a core, both taking CPU from the apiserver on a 2-core node (docs/k8s-sync.md).
//! A cheap publish — one endpoint change in steady state, a few ms — still goes out at
//! once, and one after it waits a few ms more.

use std::time::{Duration, Instant};

/// The pause after a publish is never longer than this, whatever the publish cost (a
/// guard: routes must still follow their backends after a pathological publish).
pub const MAX_PAUSE: Duration = Duration::from_secs(5);

/// The pause after a publish, in multiples of what the publish took.
pub const PAUSE_FACTOR: u32 = 3;

/// The agent's publish pacing.
#[derive(Debug, Clone, Default)]
pub struct Pacing {
    not_before: Option<Instant>,
}

impl Pacing {
    /// When a change pending at `now` may be published: `now`, or the end of the pause
    /// after the last publish.
    pub fn publish_at(&self, now: Instant) -> Instant {
        self.not_before.map_or(now, |t| t.max(now))
    }

    /// Records a publish (build and write) that ran from `started` to `ended`.
    pub fn published(&mut self, started: Instant, ended: Instant) {
        let took = ended.saturating_duration_since(started);
        self.not_before = Some(ended + (took * PAUSE_FACTOR).min(MAX_PAUSE));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_first_change_is_published_at_once() {
        let t0 = Instant::now();
        assert_eq!(Pacing::default().publish_at(t0), t0);
    }

    #[test]
    fn a_cheap_publish_leaves_the_next_change_almost_immediate() {
        let t0 = Instant::now();
        let mut p = Pacing::default();
        p.published(t0, t0 + ms(2));
        // A change 10 ms later goes out at once; one right after waits the 6 ms.
        assert_eq!(p.publish_at(t0 + ms(12)), t0 + ms(12));
        assert_eq!(p.publish_at(t0 + ms(3)), t0 + ms(8));
    }

    #[test]
    fn an_expensive_publish_is_followed_by_a_pause_three_times_as_long() {
        let t0 = Instant::now();
        let mut p = Pacing::default();
        p.published(t0, t0 + ms(500));
        assert_eq!(p.publish_at(t0 + ms(600)), t0 + ms(2000));
        assert_eq!(p.publish_at(t0 + ms(2200)), t0 + ms(2200));
        // Capped, so one pathological publish does not stall routes for long.
        p.published(t0, t0 + Duration::from_secs(60));
        assert_eq!(
            p.publish_at(t0 + Duration::from_secs(60)),
            t0 + Duration::from_secs(60) + MAX_PAUSE
        );
    }

    /// A burst: a change every millisecond for 20 s, each publish costing 50 ms plus
    /// 0.1 ms per change it coalesces. The agent publishes at most a quarter of the time,
    /// and no change waits longer than a pause plus a publish.
    #[test]
    fn under_a_burst_publishing_takes_at_most_a_quarter_of_the_time() {
        let t0 = Instant::now();
        let mut p = Pacing::default();
        let (mut now, mut busy, mut publishes) = (t0, Duration::ZERO, 0u32);
        let mut oldest_pending = t0; // a change arrives every ms from t0 on
        let end = t0 + Duration::from_secs(20);
        let mut worst_wait = Duration::ZERO;
        while now < end {
            let start = p.publish_at(now.max(oldest_pending));
            let coalesced = (start - oldest_pending).as_millis() as u32 + 1;
            let cost = ms(50) + Duration::from_micros(100) * coalesced;
            p.published(start, start + cost);
            worst_wait = worst_wait.max(start + cost - oldest_pending);
            busy += cost;
            publishes += 1;
            now = start + cost;
            oldest_pending = now + ms(1);
        }
        let share = busy.as_secs_f64() / (now - t0).as_secs_f64();
        assert!(share <= 0.26, "publishing took {share:.2} of the time");
        assert!(publishes > 50, "{publishes} publishes");
        assert!(worst_wait < Duration::from_secs(1), "{worst_wait:?}");
    }
}
