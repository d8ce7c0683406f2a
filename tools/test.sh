#!/usr/bin/env bash
# The project's test command: what the README tells a newcomer to run, and
# what CI runs. It installs what the tests need, runs every test of the
# workspace (unit, integration, and the CLI through the built binary), and
# leaves nothing running behind.
set -euo pipefail
cd "$(dirname "$0")/.."

# A build cache outside the clone survives fresh clones on the same machine.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"

need_tools=()
command -v cc >/dev/null || need_tools+=(build-essential)
command -v python3 >/dev/null || need_tools+=(python3)   # runs the spec's snippet
if ((${#need_tools[@]})); then
    echo "installing: ${need_tools[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq "${need_tools[@]}"
fi

if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast --failure-output final
else
    cargo test --workspace --no-fail-fast
fi
