#!/usr/bin/env bash
# Coverage-guided fuzzing of the dataplane's packet parser and engine and of the BGP
# decoder and FSM, for a bounded time, on the STABLE toolchain: libFuzzer (libfuzzer-sys)
# with rustc's stable sanitizer-coverage flags — no nightly, no cargo-fuzz
# (docs/decisions.md, "Fuzzing on the stable toolchain"). ./tests/run-all runs it before
# cargo test.
#
#   tests/fuzz.sh [TARGET...]        every target when none is named:
#                                    dataplane-packet dataplane-engine bgp-decode bgp-fsm
#   JUNEAU_FUZZ_SECONDS=60           fuzzing time per target
#   JUNEAU_FUZZ_JOBS=2               targets fuzzed at the same time
#   JUNEAU_FUZZ_DIR=$CARGO_TARGET_DIR/fuzz   build output, growing corpora, crashes, logs
#
# Each target starts from its committed seeds (<crate>/fuzz/seeds/<target>) plus the
# corpus earlier runs on this machine grew (JUNEAU_FUZZ_DIR/corpus/<target>). Crashing
# inputs of earlier runs are replayed first and fail the run until fixed. Exit status 1
# when any target crashed, timed out or ran out of memory; every such input's path is
# printed with its replay command. The executions per target are printed last.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

seconds="${JUNEAU_FUZZ_SECONDS:-60}"
jobs="${JUNEAU_FUZZ_JOBS:-2}"
dir="${JUNEAU_FUZZ_DIR:-${CARGO_TARGET_DIR:-$root/target}/fuzz}"
all=(dataplane-packet dataplane-engine bgp-decode bgp-fsm)
targets=("$@")
((${#targets[@]})) || targets=("${all[@]}")

crate_of() {
    case "$1" in
        dataplane-*) echo dataplane/fuzz ;;
        bgp-*) echo bgp/fuzz ;;
        *) echo "tests/fuzz.sh: unknown target $1 (known: ${all[*]})" >&2; exit 2 ;;
    esac
}

host="$(rustc -vV | sed -n 's/^host: //p')"
# Edge coverage with 8-bit counters, the PC table libFuzzer needs, comparison tracing
# (feeds libFuzzer's value profile and CMP dictionary), debug assertions and overflow
# checks. Only for `--target $host` builds: build scripts and proc macros stay plain.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions \
-Coverflow-checks"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
start=$(date +%s)

crates=()
for t in "${targets[@]}"; do
    c="$(crate_of "$t")"
    [[ " ${crates[*]-} " == *" $c "* ]] || crates+=("$c")
done
for c in "${crates[@]}"; do
    printf '==> building the fuzz targets of %s (stable rustc, sanitizer coverage)\n' "$c"
    # --locked: a lock file out of step with the crates fails here, loudly, instead of
    # being rewritten (the test command must not dirty the tree).
    cargo build --release --locked --manifest-path "$c/Cargo.toml" --target "$host" \
        --target-dir "$dir/build" --bins
done
bin_of() { echo "$dir/build/$host/release/$1"; }

# Inputs that crashed an earlier run must not pass silently because this run's random
# walk did not find them again: replay them first; once they pass they move to fixed/.
replay_failed=()
for t in "${targets[@]}"; do
    shopt -s nullglob
    old=("$dir/crashes/$t"/{crash,timeout,oom,leak}-*)
    shopt -u nullglob
    for f in ${old[@]+"${old[@]}"}; do
        mkdir -p "$dir/logs"
        if "$(bin_of "$t")" -timeout=30 -rss_limit_mb=2048 "$f" \
            >"$dir/logs/replay-$t-${f##*/}.log" 2>&1; then
            mkdir -p "$dir/crashes/$t/fixed"
            mv "$f" "$dir/crashes/$t/fixed/"
        else
            replay_failed+=("$t $f")
        fi
    done
done

fuzz_one() {
    local t="$1" crate corpus seeds log
    crate="$(crate_of "$t")"
    corpus="$dir/corpus/$t"
    seeds="$crate/seeds/$t"
    log="$dir/logs/$t.log"
    mkdir -p "$corpus" "$dir/crashes/$t" "$dir/logs"
    rm -f "$dir/logs/$t.rc"
    # libFuzzer stops itself after -max_total_time and writes hangs (-timeout, per
    # input) as timeout-* artifacts; the outer timeout only catches a fuzzer that never
    # gets going (exit 124).
    local rc=0
    timeout --kill-after=10 $((seconds + 120)) "$(bin_of "$t")" "$corpus" "$seeds" \
        -max_total_time="$seconds" -timeout=30 -rss_limit_mb=2048 -max_len=4096 \
        -use_value_profile=1 -print_final_stats=1 -artifact_prefix="$dir/crashes/$t/" \
        >"$log" 2>&1 || rc=$?
    echo "$rc" >"$dir/logs/$t.rc"
}

printf '==> fuzzing %s for %ss each, %s at a time\n' "${targets[*]}" "$seconds" "$jobs"
running=0
for t in "${targets[@]}"; do
    fuzz_one "$t" &
    running=$((running + 1))
    if ((running >= jobs)); then
        wait -n || true
        running=$((running - 1))
    fi
done
wait || true

failed=0
summary=()
for t in "${targets[@]}"; do
    log="$dir/logs/$t.log"
    rc="$(cat "$dir/logs/$t.rc" 2>/dev/null || echo 255)"
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
    [[ -n "$execs" ]] || execs="$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -1)"
    rate="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)"
    cov="$(grep -o 'cov: [0-9]* ft: [0-9]* corp: [0-9]*' "$log" | tail -1 || true)"
    result=ok
    if [[ "$rc" == 0 && -z "$execs" ]]; then
        result="FAILED (no executions reported, see $log)"
        failed=1
    elif [[ "$rc" != 0 ]]; then
        result="FAILED (exit $rc)"
        failed=1
        printf '\n==> %s FAILED (exit %s); from its log (%s):\n' "$t" "$rc" "$log"
        grep -m1 -A4 'panicked at' "$log" || true
        printf '    ...\n'
        tail -n 14 "$log"
        { grep -o 'Test unit written to .*' "$log" || true; } | sed 's/^Test unit written to //' |
            while read -r input; do
                printf '\n    crashing input: %s\n    replay: %s %s\n' "$input" "$(bin_of "$t")" "$input"
                od -An -tx1 -v "$input" | head -n 16 | sed "s/^/    /" || true
            done
    fi
    summary+=("$(printf '%-18s %12s execs %8s/s   %-34s %s' "$t" "${execs:-?}" "${rate:-?}" "$cov" "$result")")
done
for r in ${replay_failed[@]+"${replay_failed[@]}"}; do
    failed=1
    printf '\n==> %s still fails on an input an earlier run found: %s (log: %s)\n    replay: %s %s\n' \
        "${r%% *}" "${r#* }" "$dir/logs/replay-${r%% *}-${r##*/}.log" "$(bin_of "${r%% *}")" "${r#* }"
    summary+=("$(printf '%-18s still crashes on %s' "${r%% *}" "${r#* }")")
done

printf '\n==> fuzzing summary (%ss per target, %ss in all; logs in %s/logs)\n' \
    "$seconds" "$(($(date +%s) - start))" "$dir"
printf '%s\n' "${summary[@]}" | tee "$dir/summary.txt"
exit "$failed"
