#!/usr/bin/env bash
# Two builds of the store side by side, in one run on this machine: an
# older binary (OLD_BIN, e.g. main's, built beforehand) and this checkout's
# release build, alternating round by round, each as a whole (its own `up`,
# its own `bench` client), over TCP and through the same-host shared pool.
# Each client runs with each number of threads in THREADS (e.g. 1,2,4), and
# each round also measures one core's memcpy of the same sizes (the new
# binary's bench-memcpy), the ceiling of a same-host get.
# Prints get and put GB/s and p99 per size for every round, so that noise
# on a shared machine shows as the spread between rounds.
# Usage: tools/bench/before-after.sh OLD_BIN [SIZES] [CONCURRENCY] [OPS] [ROUNDS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/../.."
OLD="${1:?usage: tools/bench/before-after.sh OLD_BIN [SIZES] [CONCURRENCY] [OPS] [ROUNDS] [THREADS]}"
SIZES="${2:-16KiB,256KiB,4MiB}"
CONC="${3:-8}"
OPS="${4:-3000}"
ROUNDS="${5:-3}"
THREADS="${6:-1}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"
cargo build --release -q --bin mooncake-store
NEW="$CARGO_TARGET_DIR/release/mooncake-store"
[[ -x $OLD ]] || { echo "no executable at $OLD" >&2; exit 2; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
tmp=$(mktemp -d)
up=
cleanup() { [[ -n $up ]] && kill "$up" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

echo "machine: $(nproc) cores, $(uname -r); concurrency $CONC; $OPS ops per size; $ROUNDS rounds; client threads $THREADS"
echo "old: $OLD"
echo "new: $NEW"
for round in $(seq "$ROUNDS"); do
    for which in old new; do
        bin=$OLD
        [[ $which == new ]] && bin=$NEW
        meta="127.0.0.1:$(free_port)"
        "$bin" up --meta-listen "$meta" --listen "127.0.0.1:$(free_port)" --admin "" --dram 4GiB \
            --shm-socket "$tmp/$which.sock" >"$tmp/up-$which.log" 2>&1 &
        up=$!
        for _ in $(seq 100); do
            "$bin" stat --meta "$meta" --json 2>/dev/null | grep -q '"alive":true' && break
            sleep 0.1
        done
        for threads in ${THREADS//,/ }; do
            common=(--meta "$meta" --threads "$threads" --sizes "$SIZES" --concurrency "$CONC" --ops "$OPS" --json)
            "$bin" bench "${common[@]}" | sed "s/^/$round $which tcp:$threads /" >>"$tmp/rows"
            "$bin" bench "${common[@]}" --shm-socket "$tmp/$which.sock" |
                sed "s/^/$round $which shm:$threads /" >>"$tmp/rows"
        done
        kill "$up"
        wait "$up" 2>/dev/null || true
        up=
    done
    "$NEW" bench-memcpy --sizes "$SIZES" --ops "$OPS" --json | sed "s/^/$round ceiling memcpy:1 /" >>"$tmp/rows"
done

python3 - "$tmp/rows" <<'PY'
import json, sys
rows = {}
pages = None
for line in open(sys.argv[1]):
    parts = line.split(" ", 3)
    if len(parts) < 4 or not parts[3].strip().startswith("{"):
        continue
    r = json.loads(parts[3])
    if "op" not in r:
        continue
    path, threads = parts[2].split(":")
    rows.setdefault((path, int(threads), r["size"], r["op"]), {}).setdefault(parts[1], []).append(r)
    if r.get("pool_pages"):
        pages = r["pool_pages"]
def size(n):
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"
if pages:
    print(f"same-host pool pages: {pages}")
print(f"{'path':<6} {'threads':>7} {'size':<7} {'op':<6} {'old GB/s (rounds)':>24} {'new GB/s (rounds)':>24} {'old p99 ms':>18} {'new p99 ms':>18}")
gbs = lambda rs: " / ".join(f"{r['gb_per_sec']:.2f}" for r in rs)
p99 = lambda rs: " / ".join(f"{r['p99_us']/1000:.2f}" for r in rs)
for (path, threads, n, op), by in sorted(rows.items()):
    if path == "memcpy":
        print(f"{path:<6} {threads:>7} {size(n):<7} {op:<6} {'':>24} {gbs(by['ceiling']):>24} {'':>18} {p99(by['ceiling']):>18}")
        continue
    old, new = by.get("old", []), by.get("new", [])
    print(f"{path:<6} {threads:>7} {size(n):<7} {op:<6} {gbs(old):>24} {gbs(new):>24} {p99(old):>18} {p99(new):>18}")
PY
