//! The userspace-cost measurement on its own: `juneau_perf::cost::measure` runs the
//! `juneau-perf-cost` bench under callgrind in every mode and reports engine-only
//! figures (harness loop subtracted) plus that baseline. Behaviour only, no figure is
//! held to a bound (a debug build under `cargo test` is far slower than release). Needs
//! valgrind (tests/setup/apt-packages.txt); without it the test fails naming it.

use std::path::Path;

#[test]
fn cost_is_net_of_the_harness_loop_and_reports_the_baseline() {
    let bench = Path::new(env!("CARGO_BIN_EXE_juneau-perf-cost"));
    let out = std::env::temp_dir().join(format!("juneau-perf-cost-test-{}", std::process::id()));
    std::fs::create_dir_all(&out).expect("temp dir");
    let cost = juneau_perf::cost::measure(bench, &out, true);
    let _ = std::fs::remove_dir_all(&out);
    let get = |v: Option<f64>, what: &str| {
        v.unwrap_or_else(|| {
            panic!(
                "{what} not measured: {} (install valgrind: tests/setup.sh)",
                cost.status
            )
        })
    };
    let est = get(cost.established_instructions_per_packet, "established");
    let new = get(cost.new_flow_instructions_per_packet, "new flow");
    let reply = get(cost.reply_instructions_per_packet, "reply");
    let base = get(cost.baseline_instructions_per_packet, "baseline");
    let base_new = get(
        cost.new_flow_baseline_instructions_per_packet,
        "new-flow baseline",
    );
    assert!(base > 0.0 && base_new > 0.0, "{cost:?}");
    // Net of the loop, the engine still costs something, and a new flow (hash, Maglev
    // pick, insert) costs more than an established one.
    assert!(est > 0.0 && reply > 0.0 && new > est, "{cost:?}");
    assert!(cost.status.contains("baseline"), "{}", cost.status);
    // report.md shows the net figures and the baseline, and no per-function table.
    let report = juneau_perf::report::Report {
        cost: cost.clone(),
        ..Default::default()
    };
    let md = report.markdown();
    let section = md
        .split("## Userspace cost")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("cost section in report.md");
    eprintln!("## Userspace cost{section}");
    assert!(
        section.contains(&format!("| established flow | {est:.0} |")),
        "{section}"
    );
    assert!(
        section.contains(&format!(
            "| harness loop alone (baseline, subtracted above) | {base:.0}"
        )),
        "{section}"
    );
}
