//! The control-plane convergence measurement's record: one latency distribution per
//! (event, destination). The `convergence` module measures it.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// What a convergence run measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ConvergenceReport {
    /// "measured", or why not.
    pub status: String,
    /// Repetitions (each one withdraw and one announce).
    pub repetitions: u32,
    /// BIRD watcher's polling interval, ms.
    pub bird_poll_interval_ms: f64,
    /// Median time of one query on BIRD's control socket, ms.
    pub bird_query_p50_ms: f64,
    /// The longest time between two successive BIRD queries seen while waiting (poll
    /// interval + query + scheduling): how late a BIRD figure can be at worst.
    #[serde(default)]
    pub bird_max_gap_ms: f64,
    /// How it was set up.
    pub setup: String,
    /// One series per (event, destination).
    pub series: Vec<Series>,
}

/// A distribution of latencies.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Series {
    /// Short name (e.g. `withdraw: apiserver -> BIRD`).
    pub name: String,
    /// Number of samples.
    pub count: u64,
    /// Minimum, ms.
    pub min_ms: f64,
    /// Median, ms.
    pub p50_ms: f64,
    /// 90th percentile, ms.
    pub p90_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Maximum, ms.
    pub max_ms: f64,
    /// Every sample, ms, in measurement order (for the CDF plot).
    pub samples_ms: Vec<f64>,
}

impl Series {
    /// The distribution of `samples`.
    pub(crate) fn from_samples(name: &str, samples: &[Duration]) -> Series {
        let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("bounds");
        for s in samples {
            let _ = h.record((s.as_micros() as u64).max(1));
        }
        let ms = |us: u64| us as f64 / 1e3;
        Series {
            name: name.into(),
            count: h.len(),
            min_ms: ms(h.min()),
            p50_ms: ms(h.value_at_quantile(0.5)),
            p90_ms: ms(h.value_at_quantile(0.9)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
            samples_ms: samples.iter().map(|d| d.as_secs_f64() * 1e3).collect(),
        }
    }
}
