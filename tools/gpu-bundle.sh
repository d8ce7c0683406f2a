#!/usr/bin/env bash
# What tools/gpu-check.sh needs on a GPU host that has no Rust toolchain
# and no RocksDB, built here: the release binary (stripped), the shared
# libraries it links that such a host may lack (RocksDB and its
# compression libraries; glibc, libstdc++ and libgcc are the host's), a
# wrapper that finds them, the Python client as an abi3 wheel
# (tools/release-wheel.sh), and run.sh, which installs the wheel into a
# scratch folder and runs the checks with all of it.
#
#   tools/gpu-bundle.sh [DIR]     the bundle in DIR (default .gpu)
#
# Then copy the repository with DIR in it to the GPU host and run
# DIR/run.sh there (ROUNDS, SIZES, TOTALS, COPY_THREADS, STEP_LIMIT as for
# gpu-check.sh; MOONCAKE_REPO names the repository if DIR lies outside
# it). The host needs python3 with pip for the Python test, nothing else
# of this project's build.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"
cargo build --release -q --bin mooncake-store
rm -rf "$DIR" && mkdir -p "$DIR/lib"
strip -o "$DIR/mooncake-store.bin" "$CARGO_TARGET_DIR/release/mooncake-store"
# Every library the binary links but glibc's own, libstdc++ and libgcc.
ldd "$CARGO_TARGET_DIR/release/mooncake-store" | awk '$3 ~ /^\// {print $3}' |
    grep -vE '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s)\.so' |
    while read -r lib; do cp -L "$lib" "$DIR/lib/"; done
cat >"$DIR/mooncake-store" <<'SH'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/mooncake-store.bin" "$@"
SH
chmod +x "$DIR/mooncake-store"
tools/release-wheel.sh >/dev/null
wheel=$(ls -t dist/mooncake_store_client-*-abi3-*.whl | head -n 1)
cp "$wheel" "$DIR/"
cat >"$DIR/run.sh" <<'SH'
#!/bin/sh
# tools/gpu-check.sh with this bundle's binary and wheel (the wheel
# installed into a scratch folder, nothing else touched).
set -e
here=$(dirname "$(readlink -f "$0")")
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$here"/*.whl
repo=${MOONCAKE_REPO:-$here/..}
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" MOONCAKE_BIN="$here/mooncake-store" \
    "$repo/tools/gpu-check.sh" "$@"
SH
chmod +x "$DIR/run.sh"
"$DIR/mooncake-store" --version >/dev/null
echo "$DIR: $(du -sh "$DIR" | cut -f1), $(ls "$DIR/lib" | wc -l) libraries, $(basename "$wheel")"
