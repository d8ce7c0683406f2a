#!/usr/bin/env bash
# The NVMe tier's I/O engines against fio, side by side in one run: random
# direct reads of the same file, same block size, same queue depth.
# Usage: tools/bench/io.sh [FILE] [SIZE] [DEPTH] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
FILE="${1:-/var/tmp/mooncake-io.bin}"
SIZE="${2:-2GiB}"
DEPTH="${3:-32}"
SECS="${4:-5}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"
command -v fio >/dev/null || { export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq fio >/dev/null; }
cargo build --release -q --bin mooncake-store
BIN="$CARGO_TARGET_DIR/release/mooncake-store"
fio_size=$(python3 -c "import re; m=re.fullmatch(r'(\d+)(KiB|MiB|GiB)','$SIZE'); print(int(m[1])*{'KiB':1<<10,'MiB':1<<20,'GiB':1<<30}[m[2]])")

for bs in 256KiB 4MiB; do
    # The engines first: bench-io creates and fills the file if needed.
    rows=$("$BIN" bench-io --file "$FILE" --size "$SIZE" --block "$bs" --depth "$DEPTH" --seconds "${SECS}s" --json)
    fbs=$(python3 -c "print({'256KiB':'256k','4MiB':'4m'}['$bs'])")
    fio_bw=$(fio --name=r --filename="$FILE" --size="$fio_size" --bs="$fbs" --iodepth="$DEPTH" --rw=randread \
        --direct=1 --ioengine=io_uring --runtime="$SECS" --time_based --output-format=json 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["read"]["bw_bytes"])')
    python3 - "$bs" "$fio_bw" "$rows" <<'PY'
import json, sys
bs, fio = sys.argv[1], int(sys.argv[2]) / 1e9
print(f"{bs:>7}  fio io_uring {fio:5.2f} GB/s")
for line in sys.argv[3].splitlines():
    r = json.loads(line)
    print(f"{bs:>7}  {r['engine']:<12} {r['gb_per_sec']:5.2f} GB/s  {100*r['gb_per_sec']/fio:5.0f}% of fio  p99 {r['p99_us']} us")
PY
done
