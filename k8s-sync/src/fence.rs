//! When a replica that was elected on the Lease may still write: pure, in virtual time.
//!
//! The other replicas take the Lease over once *their* wall clock passes the Lease's
//! `renewTime + leaseDurationSeconds`. A leader that checked "the Lease is mine and not
//! expired" with no margin could still write after that moment: its clock may lag
//! theirs, and it may be paused (GC, a stalled VM, SIGSTOP) between the check and the
//! write. A deposed leader's late write can then hand one address to two Services.
//!
//! So a leader stops writing at its **renew deadline**, [`RENEW_DEADLINE`] (2/3) of the
//! lease duration after its last renewal, a third of the duration before anyone may take
//! over; the Lease is renewed every half duration, well before. Every read of the Lease
//! ([`LeaderFence::observe`]) turns the renewal it shows into a deadline on the
//! **monotonic** clock, counted from when the read was *sent* (the renewal is at least
//! that old), and [`LeaderFence::may_write`] is asked again before each write batch, with
//! no request: a leader paused past its deadline refuses to write when it wakes, whatever
//! its last read said. A read that allowed writes serves the batches of the next
//! [`READ_REUSE`] without a new one ([`LeaderFence::serves_without_read`]): the deadline
//! already counts from its sending, so a newer read could only move it later. What is left: clock skew between replicas beyond a third of the
//! lease duration, or a pause of that length between `may_write` and the request reaching
//! the apiserver (writes also carry the `resourceVersion` they were decided from, which
//! fences writes to the same object); see docs/security.md.

use std::time::{Duration, Instant};

/// The renew deadline as a fraction (numerator, denominator) of the lease duration.
pub const RENEW_DEADLINE: (u32, u32) = (2, 3);

/// How long after it was sent a read that allowed writes answers the checks of further
/// write batches: at most one Lease read a second however many reconciles write.
pub const READ_REUSE: Duration = Duration::from_secs(1);

/// The seconds between renewals for a lease duration (at least 2 s): half of it, rounded
/// down, at least 1 s, so a renewal lands before the [`renew_deadline`] even when it is a
/// little late.
pub fn renew_every(lease_duration_secs: u64) -> u64 {
    (lease_duration_secs / 2).max(1)
}

/// How long after a renewal the leader may write.
pub fn renew_deadline(lease_duration: Duration) -> Duration {
    lease_duration * RENEW_DEADLINE.0 / RENEW_DEADLINE.1
}

/// What one read of the Lease said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRead<'a> {
    /// `spec.holderIdentity`.
    pub holder: Option<&'a str>,
    /// `spec.renewTime`, microseconds since the Unix epoch (on the renewing replica's
    /// clock: this one's, when it is the holder).
    pub renew_time_us: Option<i64>,
    /// `spec.leaseDurationSeconds`.
    pub duration: Duration,
}

/// One replica's right to write, as far as its reads of the Lease and its monotonic clock
/// say.
#[derive(Debug, Clone)]
pub struct LeaderFence {
    identity: String,
    /// Writes are allowed strictly before this instant; `None`: not at all.
    deadline: Option<Instant>,
    /// When the last read that allowed writes was sent.
    allowed_by_read_sent: Option<Instant>,
    /// Why not, when no read allowed writes (or the last one refused them).
    refused: String,
}

impl LeaderFence {
    /// A fence for the replica named `identity` in the Lease; it allows nothing until a
    /// read of the Lease is [`observe`](Self::observe)d.
    pub fn new(identity: impl Into<String>) -> Self {
        LeaderFence {
            identity: identity.into(),
            deadline: None,
            allowed_by_read_sent: None,
            refused: "the Lease has not been read yet".into(),
        }
    }

    /// Takes in a read of the Lease that was sent at `sent` (monotonic) while the wall
    /// clock said `sent_wall_us` (microseconds since the epoch), and says whether it lets
    /// this replica write now (`now`: when the answer came).
    pub fn observe(
        &mut self,
        sent: Instant,
        sent_wall_us: i64,
        lease: LeaseRead<'_>,
        now: Instant,
    ) -> Result<(), String> {
        self.deadline = None;
        self.allowed_by_read_sent = None;
        let holder = lease.holder.unwrap_or("");
        if holder != self.identity {
            self.refused = format!(
                "the Lease is held by {holder:?}, not by this replica ({})",
                self.identity
            );
            return Err(self.refused.clone());
        }
        let Some(renewed) = lease.renew_time_us else {
            self.refused = "the Lease has no renewTime".into();
            return Err(self.refused.clone());
        };
        // The renewal's age when the read was sent; a renewal "in the future" (the wall
        // clock stepped back) counts as just made: never more than a full deadline.
        let age = Duration::from_micros(u64::try_from(sent_wall_us - renewed).unwrap_or(0));
        let limit = renew_deadline(lease.duration);
        match limit.checked_sub(age).filter(|d| !d.is_zero()) {
            Some(left) => {
                self.deadline = Some(sent + left);
                self.allowed_by_read_sent = Some(sent);
                self.may_write(now)
            }
            None => {
                self.refused = format!(
                    "this replica last renewed the Lease {:.1}s ago, past its renew deadline \
                     ({:.1}s of a {}s lease)",
                    age.as_secs_f64(),
                    limit.as_secs_f64(),
                    lease.duration.as_secs()
                );
                Err(self.refused.clone())
            }
        }
    }

    /// Whether the last read still answers a check at `now` without a new one: it allowed
    /// writes, was sent less than [`READ_REUSE`] ago, and its deadline has not passed
    /// (the caller still asks [`may_write`](Self::may_write)). A refusal is never reused:
    /// a replica that has just been elected reads again at once.
    pub fn serves_without_read(&self, now: Instant) -> bool {
        self.allowed_by_read_sent
            .is_some_and(|sent| now.saturating_duration_since(sent) < READ_REUSE)
            && self.deadline.is_some_and(|d| now < d)
    }

    /// Whether this replica may write at `now`, from what the last read said: asked
    /// before every write batch, without a request.
    pub fn may_write(&mut self, now: Instant) -> Result<(), String> {
        match self.deadline {
            Some(d) if now < d => Ok(()),
            Some(d) => {
                self.refused = format!(
                    "the renew deadline passed {:.1}s ago without a newer renewal seen",
                    now.duration_since(d).as_secs_f64()
                );
                self.deadline = None;
                self.allowed_by_read_sent = None;
                Err(self.refused.clone())
            }
            None => Err(self.refused.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(6);
    const S: i64 = 1_000_000;

    fn read(holder: &str, renew_time_us: i64) -> LeaseRead<'_> {
        LeaseRead {
            holder: Some(holder),
            renew_time_us: Some(renew_time_us),
            duration: D,
        }
    }

    /// Wall clock 1000 s at monotonic t0.
    const WALL: i64 = 1_000 * S;

    #[test]
    fn a_leader_writes_until_its_renew_deadline_not_until_the_lease_expires() {
        let t0 = Instant::now();
        let mut f = LeaderFence::new("r1");
        // Renewed at WALL, read 1 s later: 3 s left of the 4 s deadline.
        let sent = t0 + Duration::from_secs(1);
        f.observe(sent, WALL + S, read("r1", WALL), sent).unwrap();
        assert!(f.may_write(t0 + Duration::from_millis(3_999)).is_ok());
        let e = f.may_write(t0 + Duration::from_secs(4)).unwrap_err();
        assert!(e.contains("renew deadline passed"), "{e}");
        // Stays refused (the deadline is gone) until a new read allows it again.
        assert!(f.may_write(t0 + Duration::from_secs(1)).is_err());
        // Expiry (6 s) would still have allowed a write at 5 s: the fence does not.
        assert!(f.may_write(t0 + Duration::from_secs(5)).is_err());
    }

    #[test]
    fn a_read_showing_an_old_renewal_refuses_writes() {
        let t0 = Instant::now();
        let mut f = LeaderFence::new("r1");
        // Renewed 4.5 s before the read: not expired (6 s), but past the deadline.
        let e = f
            .observe(t0, WALL + 45 * S / 10, read("r1", WALL), t0)
            .unwrap_err();
        assert!(e.contains("past its renew deadline"), "{e}");
        assert!(f.may_write(t0).is_err());
        // A newer renewal lets it write again.
        f.observe(t0, WALL + 45 * S / 10, read("r1", WALL + 4 * S), t0)
            .unwrap();
        assert!(f.may_write(t0 + Duration::from_millis(3_400)).is_ok());
        assert!(f.may_write(t0 + Duration::from_millis(3_500)).is_err());
    }

    #[test]
    fn a_leader_paused_after_its_check_refuses_to_write_when_it_wakes() {
        let t0 = Instant::now();
        let mut f = LeaderFence::new("r1");
        f.observe(t0, WALL, read("r1", WALL), t0).unwrap();
        // SIGSTOP for 10 s between the check and the next batch: no read since.
        assert!(f.may_write(t0 + Duration::from_secs(10)).is_err());
        // Paused during the read itself: its answer comes too late to write.
        let mut g = LeaderFence::new("r1");
        assert!(g
            .observe(t0, WALL, read("r1", WALL), t0 + Duration::from_secs(5))
            .is_err());
    }

    #[test]
    fn another_holder_or_no_renewal_refuses_writes() {
        let t0 = Instant::now();
        let mut f = LeaderFence::new("r1");
        assert!(f.may_write(t0).is_err(), "nothing read yet");
        let e = f.observe(t0, WALL, read("r2", WALL), t0).unwrap_err();
        assert!(e.contains("\"r2\""), "{e}");
        let none = LeaseRead {
            holder: Some("r1"),
            renew_time_us: None,
            duration: D,
        };
        assert!(f.observe(t0, WALL, none, t0).is_err());
    }

    #[test]
    fn a_wall_clock_stepped_back_never_gives_more_than_one_deadline() {
        let t0 = Instant::now();
        let mut f = LeaderFence::new("r1");
        // The renewal looks 30 s in the future.
        f.observe(t0, WALL, read("r1", WALL + 30 * S), t0).unwrap();
        assert!(f.may_write(t0 + Duration::from_millis(3_999)).is_ok());
        assert!(f.may_write(t0 + Duration::from_secs(4)).is_err());
    }

    /// The safety argument, checked over read delays and clock skews: every write the
    /// fence allows happens (on the other replica's clock, `skew` ahead of ours) before
    /// the other replica may take the Lease over (renewTime + duration on its clock), as
    /// long as the skew is under a third of the duration.
    #[test]
    fn no_write_is_allowed_once_another_replica_may_take_over() {
        let t0 = Instant::now();
        for age_ms in (0..6_000).step_by(250) {
            for skew_ms in (0..2_000).step_by(100) {
                let mut f = LeaderFence::new("r1");
                let sent_wall = WALL + age_ms * 1_000;
                let ok = f.observe(t0, sent_wall, read("r1", WALL), t0).is_ok();
                // Our wall clock at t0 + x is sent_wall + x; theirs is skew_ms ahead.
                let takeover_ms = (WALL + D.as_micros() as i64 - sent_wall) / 1_000 - skew_ms;
                for x_ms in (0..7_000).step_by(50) {
                    let now = t0 + Duration::from_millis(x_ms as u64);
                    if ok && f.clone().may_write(now).is_ok() {
                        assert!(
                            x_ms < takeover_ms,
                            "age {age_ms} ms, skew {skew_ms} ms: write at {x_ms} ms, \
                             takeover at {takeover_ms} ms"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_read_that_allowed_writes_serves_for_a_second_and_a_refusal_never() {
        let t0 = Instant::now();
        let mut f = LeaderFence::new("r1");
        assert!(!f.serves_without_read(t0), "nothing read yet");
        f.observe(t0, WALL, read("r1", WALL), t0).unwrap();
        assert!(f.serves_without_read(t0 + Duration::from_millis(999)));
        assert!(!f.serves_without_read(t0 + READ_REUSE));
        // A renewal 3.5 s old: 0.5 s of deadline left, less than the reuse window.
        f.observe(t0, WALL + 35 * S / 10, read("r1", WALL), t0)
            .unwrap();
        assert!(f.serves_without_read(t0 + Duration::from_millis(499)));
        assert!(!f.serves_without_read(t0 + Duration::from_millis(500)));
        // Another holder: the next check reads again, however recent this read.
        f.observe(t0, WALL, read("r2", WALL), t0).unwrap_err();
        assert!(!f.serves_without_read(t0));
        // A passed deadline forgets the read.
        f.observe(t0, WALL, read("r1", WALL), t0).unwrap();
        assert!(f.may_write(t0 + Duration::from_secs(4)).is_err());
        assert!(!f.serves_without_read(t0 + Duration::from_millis(10)));
    }

    #[test]
    fn renewals_come_before_the_deadline() {
        for d in [2u64, 3, 6, 15, 60] {
            assert!(
                Duration::from_secs(renew_every(d)) < renew_deadline(Duration::from_secs(d)),
                "lease {d}s"
            );
        }
    }
}
