//! Userspace cost of the dataplane's packet path: instructions per packet, counted by
//! `valgrind --tool=callgrind` on a small bench binary that feeds recorded frames to the
//! dataplane's pure packet-processing function (stable on noisy shared machines).

use std::path::Path;
use std::time::Duration;

use crate::report::Cost;

/// Time the cost measurement adds to a run (estimate).
pub const EXPECTED: Duration = Duration::from_secs(20);

/// Measures the cost, or says why it could not.
pub fn measure(_out_dir: &Path, _smoke: bool) -> Cost {
    Cost {
        status:
            "Not measured: juneau-dataplane does not expose a pure packet-processing function yet."
                .into(),
        ..Default::default()
    }
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}
