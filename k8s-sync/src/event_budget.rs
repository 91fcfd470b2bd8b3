//! Which Events the controller may write: a pure decision over instants the caller
//! passes in (tests run it in virtual time).
//!
//! A Warning is always written: it names a problem an operator must see. A Normal
//! Event (a VIP allocated and advertised, released) is news worth an Event while
//! Services come a few at a time, but not one apiserver write (and one etcd object for
//! an hour) per Service when thousands are created at once: the ServiceLoadBalancer's
//! conditions already carry the same words, with their transition time. So Normal
//! Events share a token bucket — a burst of [`NORMAL_BURST`], then [`NORMAL_PER_S`]
//! per second — and those beyond it are counted, not written (issue #26: ≤ 3 API
//! writes per Service at 10 000 Services).

use std::time::{Duration, Instant};

/// Normal Events written at once before the budget applies (a Helm release or a GitOps
/// sync of this many Services gets every Event).
pub const NORMAL_BURST: u32 = 50;

/// Normal Events per second beyond the burst.
pub const NORMAL_PER_S: u32 = 1;

/// What to do with one Event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Write it.
    Write,
    /// Count it, do not write it.
    Suppress {
        /// The first one refused since the last one written (worth one log line).
        first: bool,
    },
}

/// The Normal Events' token bucket.
#[derive(Debug, Clone)]
pub struct EventBudget {
    burst: u32,
    per_s: u32,
    /// Tokens in thousandths (whole Events × 1000).
    milli_tokens: u64,
    last: Option<Instant>,
    suppressing: bool,
}

impl Default for EventBudget {
    fn default() -> Self {
        EventBudget::new(NORMAL_BURST, NORMAL_PER_S)
    }
}

impl EventBudget {
    /// A full bucket of `burst` Events, refilled at `per_s` per second.
    pub fn new(burst: u32, per_s: u32) -> EventBudget {
        EventBudget {
            burst,
            per_s,
            milli_tokens: u64::from(burst) * 1000,
            last: None,
            suppressing: false,
        }
    }

    /// Whether an Event (`warning` or Normal) at `now` is written.
    pub fn admit(&mut self, now: Instant, warning: bool) -> Verdict {
        if warning {
            return Verdict::Write;
        }
        let elapsed = self
            .last
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        self.last = Some(now);
        let refill =
            elapsed.as_millis().min(u128::from(u64::MAX / 2)) as u64 * u64::from(self.per_s);
        self.milli_tokens =
            (self.milli_tokens.saturating_add(refill)).min(u64::from(self.burst) * 1000);
        if self.milli_tokens >= 1000 {
            self.milli_tokens -= 1000;
            self.suppressing = false;
            Verdict::Write
        } else {
            let first = !self.suppressing;
            self.suppressing = true;
            Verdict::Suppress { first }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warnings_are_always_written_and_take_nothing_from_the_normal_budget() {
        let t = Instant::now();
        let mut b = EventBudget::new(2, 1);
        for _ in 0..100 {
            assert_eq!(b.admit(t, true), Verdict::Write);
        }
        assert_eq!(b.admit(t, false), Verdict::Write);
        assert_eq!(b.admit(t, false), Verdict::Write);
        assert_eq!(b.admit(t, false), Verdict::Suppress { first: true });
        assert_eq!(b.admit(t, true), Verdict::Write);
    }

    #[test]
    fn a_burst_is_written_then_the_rate_and_one_first_suppression_per_run() {
        let t = Instant::now();
        let mut b = EventBudget::new(50, 1);
        let written = (0..10_000)
            .filter(|_| b.admit(t, false) == Verdict::Write)
            .count();
        assert_eq!(written, 50);
        // 10 000 Normal Events over 100 s: the burst, then one a second.
        let mut b = EventBudget::new(50, 1);
        let mut firsts = 0;
        let mut written = 0;
        for i in 0..10_000u64 {
            match b.admit(t + Duration::from_millis(i * 10), false) {
                Verdict::Write => written += 1,
                Verdict::Suppress { first } => firsts += u32::from(first),
            }
        }
        assert!((148..=151).contains(&written), "{written}");
        // Every written Event after the burst ends a run of suppressed ones.
        assert!(firsts >= 98, "{firsts}");
    }

    #[test]
    fn a_quiet_minute_refills_the_whole_burst_and_no_more() {
        let t = Instant::now();
        let mut b = EventBudget::new(5, 1);
        for _ in 0..5 {
            assert_eq!(b.admit(t, false), Verdict::Write);
        }
        assert!(matches!(b.admit(t, false), Verdict::Suppress { .. }));
        let later = t + Duration::from_secs(60);
        let written = (0..20)
            .filter(|_| b.admit(later, false) == Verdict::Write)
            .count();
        assert_eq!(written, 5);
    }

    #[test]
    fn a_clock_that_goes_back_refills_nothing() {
        let t = Instant::now() + Duration::from_secs(10);
        let mut b = EventBudget::new(1, 1);
        assert_eq!(b.admit(t, false), Verdict::Write);
        assert!(matches!(
            b.admit(t - Duration::from_secs(5), false),
            Verdict::Suppress { first: true }
        ));
    }
}
