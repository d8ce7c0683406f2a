#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets) for a bounded time, starting
# from and adding to the corpus kept in fuzz/corpus. A crash stops the run
# with the input saved in fuzz/artifacts. CI runs it from tools/test.sh.
# Usage: tools/fuzz.sh [SECONDS_PER_TARGET]
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
SECONDS_PER_TARGET="${1:-20}"
# The fuzz build is instrumented: its own cache, beside the main one.
export CARGO_TARGET_DIR="${MOONCAKE_FUZZ_TARGET_DIR:-$HOME/.cache/mooncake-fuzz-target}"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked --quiet
# cargo-fuzz passes unstable flags to rustc; this toolchain is stable, so
# allow them, and fuzz without a sanitizer (the parsers are safe Rust: a
# panic or a failed assertion is what a crash means here).
export RUSTC_BOOTSTRAP=1
fuzz=(cargo fuzz run --sanitizer none -O)
for target in $(cargo fuzz list); do
    mkdir -p "corpus/$target"
    echo "fuzz: $target for ${SECONDS_PER_TARGET}s"
    "${fuzz[@]}" "$target" "corpus/$target" -- \
        -max_total_time="$SECONDS_PER_TARGET" -max_len=4096 -print_final_stats=1 2>&1 \
        | grep -E "^(Done|stat::number_of_executed_units|==|SUMMARY)|panicked|ERROR" || true
    # libFuzzer exits non-zero on a crash; pipefail keeps grep's status, so
    # look for the artifact instead.
    if compgen -G "artifacts/$target/*" >/dev/null; then
        echo "fuzz: $target crashed; input in fuzz/artifacts/$target" >&2
        exit 1
    fi
done
