//! The offered-rate search of a throughput run: from a flood's estimate, paced rates
//! double while the path carries everything offered, then bisect between the highest
//! carried and the lowest not-carried rate; the measured window runs at the latter. Pure
//! (no traffic), so the search is tested apart from the measuring (`suite::measure`).

/// Offered-rate calibration: after a short flood (generator unpaced) the first paced
/// step offers this much above what the path delivered under the flood...
pub const OFFER_ABOVE: f64 = 1.15;
/// ...then the rate doubles ([`STEP_UP`]) while the path carries everything offered; once a rate was
/// not carried, the search bisects (geometric mean) between the highest carried and the
/// lowest not-carried rate until they are this close...
pub const SEARCH_CLOSE: f64 = 1.15;
/// The rate doubles (this factor) while the path carries everything offered.
pub const STEP_UP: f64 = 2.0;
/// The measured window offers this much above the lowest rate found not carried, so
/// that a step that missed by noise (98 % delivered) does not leave the window just
/// below saturation: at most [`SEARCH_CLOSE`] x this above a carried rate (2x this if
/// the steps ran out).
pub const WINDOW_ABOVE: f64 = 1.1;

/// A measured window the path carried entirely (the search's steps were noisy: a rate
/// missed by chance, or the path was briefly slower) runs again, at most this many times:
/// [`WINDOW_RETRY_UP`] x what was offered, the last time unpaced.
pub const WINDOW_RETRIES: usize = 2;
/// See [`WINDOW_RETRIES`].
pub const WINDOW_RETRY_UP: f64 = 1.5;

/// The rate of retry `attempt` (0-based) of a measured window that offered `offered`
/// and was not saturated (0: unpaced).
pub fn window_retry_rate(offered: f64, attempt: usize) -> f64 {
    if attempt + 1 >= WINDOW_RETRIES {
        0.0
    } else {
        offered * WINDOW_RETRY_UP
    }
}

/// A paced step that delivers less than this share of what the flood delivered falls
/// back to the flood for the measured window.
pub const PACED_BELOW_FLOOD: f64 = 0.9;

/// The offered-rate search of `suite::measure`, apart from the measuring (so it can be tested):
/// rates asked, what the generator offered and whether the path carried it.
#[derive(Debug, Clone)]
pub struct RateSearch {
    /// The next rate while no rate was found not carried.
    next: f64,
    /// The highest offered rate the path carried.
    carried: f64,
    /// The lowest asked rate the path did not carry.
    not_carried: Option<f64>,
    /// Pacing gave up: the window runs flooded.
    flood: bool,
}

impl RateSearch {
    /// A search whose first paced step offers [`OFFER_ABOVE`] what the flood delivered.
    pub fn new(flood_delivered_pps: f64) -> RateSearch {
        RateSearch {
            next: (flood_delivered_pps * OFFER_ABOVE).max(1000.0),
            carried: 0.0,
            not_carried: None,
            flood: false,
        }
    }

    /// The rate to try next, or `None` when the bracket is close enough.
    pub fn next_rate(&self) -> Option<f64> {
        if self.flood {
            return None;
        }
        match self.not_carried {
            None => Some(self.next),
            Some(hi) if self.carried > 0.0 && hi / self.carried > SEARCH_CLOSE => {
                Some((hi * self.carried).sqrt())
            }
            Some(_) => None,
        }
    }

    /// Records a step: `rate` asked, `offered` what the generator really sent.
    pub fn record(&mut self, rate: f64, offered: f64, carried: bool) {
        if carried {
            self.carried = self.carried.max(offered);
            // A generator that fell short of the asked rate is made up for (at most 10x).
            self.next = self.next.max(rate) * STEP_UP * (rate / offered.max(1.0)).clamp(1.0, 10.0);
        } else {
            self.not_carried = Some(self.not_carried.map_or(rate, |h: f64| h.min(rate)));
        }
    }

    /// Pacing hurts the path: the window runs unpaced.
    pub fn give_up(&mut self) {
        self.flood = true;
    }

    /// The rate of the measured window (0: unpaced).
    pub fn window_rate(&self) -> f64 {
        if self.flood {
            0.0
        } else {
            WINDOW_ABOVE * self.not_carried.unwrap_or(self.next)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the search against a path that carries up to `capacity` (and a generator that
    /// sends what it is asked), for at most `steps` steps; returns the window's rate.
    fn search(flood: f64, capacity: f64, steps: u32) -> f64 {
        let mut s = RateSearch::new(flood);
        for _ in 0..steps {
            let Some(r) = s.next_rate() else { break };
            s.record(r, r, r <= capacity);
        }
        s.window_rate()
    }

    #[test]
    fn the_window_runs_just_above_capacity() {
        // The flood delivered a tenth of what the path carries paced.
        let w = search(100_000.0, 1_000_000.0, 8);
        assert!(w > 1_000_000.0, "{w}");
        assert!(w <= 1_000_000.0 * SEARCH_CLOSE * WINDOW_ABOVE * 1.01, "{w}");
    }

    #[test]
    fn a_first_step_not_carried_measures_there() {
        // Capacity below the first step: nothing carried, the window runs at that step.
        let w = search(100_000.0, 50_000.0, 8);
        assert_eq!(w, 100_000.0 * OFFER_ABOVE * WINDOW_ABOVE);
    }

    #[test]
    fn out_of_steps_the_window_is_above_every_carried_rate() {
        let w = search(10_000.0, 1e9, 3);
        assert!(w > 10_000.0 * OFFER_ABOVE * 4.0, "{w}");
    }

    #[test]
    fn a_short_generator_is_made_up_for() {
        let mut s = RateSearch::new(100_000.0);
        let r = s.next_rate().unwrap();
        s.record(r, r / 2.0, true);
        assert_eq!(s.next_rate().unwrap(), r * STEP_UP * 2.0);
    }

    #[test]
    fn an_unsaturated_window_retries_higher_then_unpaced() {
        assert_eq!(
            window_retry_rate(1_000_000.0, 0),
            1_000_000.0 * WINDOW_RETRY_UP
        );
        assert_eq!(window_retry_rate(1_000_000.0, WINDOW_RETRIES - 1), 0.0);
    }

    #[test]
    fn giving_up_measures_flooded() {
        let mut s = RateSearch::new(100_000.0);
        s.give_up();
        assert_eq!(s.next_rate(), None);
        assert_eq!(s.window_rate(), 0.0);
    }
}
