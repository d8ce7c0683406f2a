#!/usr/bin/env bash
# Side by side, in one run on this machine: redis-server (redis-benchmark)
# and Mooncake Store (`mooncake-store bench`), same block sizes, same
# concurrency, same number of gets. Prints GB/s and p99 for each, and the
# ratio. Usage: tools/bench/compare.sh [SIZES] [CONCURRENCY] [OPS]
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZES="${1:-16KiB,256KiB,4MiB}"
CONC="${2:-8}"
OPS="${3:-4000}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"

if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
    echo "installing redis-server and redis-tools"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq redis-server redis-tools >/dev/null
fi
cargo build --release -q --bin mooncake-store
BIN="$CARGO_TARGET_DIR/release/mooncake-store"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
RPORT=$(free_port); MPORT=$(free_port); DPORT=$(free_port)
tmp=$(mktemp -d)
cleanup() {
    [[ -n "${RPID:-}" ]] && kill "$RPID" 2>/dev/null || true
    [[ -n "${MPID:-}" ]] && kill "$MPID" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT

bytes_of() { # 16KiB -> 16384
    python3 -c "import re,sys; m=re.fullmatch(r'(\d+)(KiB|MiB|GiB|B)?','$1'); print(int(m[1])*{None:1,'B':1,'KiB':1024,'MiB':1<<20,'GiB':1<<30}[m[2]])"
}

redis-server --port "$RPORT" --bind 127.0.0.1 --save '' --appendonly no \
    --proto-max-bulk-len 1gb --daemonize no >"$tmp/redis.log" 2>&1 &
RPID=$!
"$BIN" up --meta-listen "127.0.0.1:$MPORT" --listen "127.0.0.1:$DPORT" --admin "" --dram 4GiB >"$tmp/up.log" 2>&1 &
MPID=$!
for _ in $(seq 100); do
    redis-cli -p "$RPORT" ping >/dev/null 2>&1 && "$BIN" stat --meta "127.0.0.1:$MPORT" --json 2>/dev/null | grep -q '"alive":true' && break
    sleep 0.1
done

echo "machine: $(nproc) cores, $(uname -r); concurrency $CONC; $OPS gets per size"
"$BIN" bench --meta "127.0.0.1:$MPORT" --sizes "$SIZES" --concurrency "$CONC" --ops "$OPS" --json >"$tmp/mooncake.json"

printf '%-8s %-6s %12s %8s %12s %8s %8s\n' size op "redis GB/s" "p99 ms" "mooncake GB/s" "p99 ms" "ratio" >"$tmp/table"
for size in ${SIZES//,/ }; do
    n=$(bytes_of "$size")
    redis-benchmark -p "$RPORT" -t set,get -d "$n" -c "$CONC" -n "$OPS" --csv >"$tmp/redis.csv" 2>/dev/null
    for op in set get; do
        OP=$(echo "$op" | tr a-z A-Z)
        line=$(grep "^\"$OP\"" "$tmp/redis.csv")
        rps=$(echo "$line" | cut -d, -f2 | tr -d '"')
        p99=$(echo "$line" | cut -d, -f7 | tr -d '"')
        mop=$([[ $op == set ]] && echo put || echo get)
        read -r mgb mp99 < <(python3 -c "
import json
for l in open('$tmp/mooncake.json'):
    r = json.loads(l)
    if r['op'] == '$mop' and r['size'] == $n:
        print(f\"{r['gb_per_sec']:.2f} {r['p99_us']/1000:.2f}\")")
        python3 -c "
rgb = $rps * $n / 1e9
print(f\"{'$size':<8} {'$mop':<6} {rgb:>12.2f} {float('$p99'):>8.2f} {$mgb:>12.2f} {$mp99:>8.2f} {($mgb/rgb if rgb else 0):>7.2f}x\")" >>"$tmp/table"
    done
done
cat "$tmp/table"
