#!/usr/bin/env bash
# Side by side, in one run on this machine: redis-server, memcached and
# Mooncake Store, driven by the same async Rust client loop (bench-peer for
# the first two, bench for the store): same block sizes, same concurrency,
# same number of operations. Then prefix matching of 128-key chains: the
# store's match_prefix against pipelined EXISTS on redis.
# The store is measured twice: over TCP like the others, and through the
# same-host shared pool (--shm-socket), the path a worker on the daemon's
# host takes. And the most any TCP server could move here: CONCURRENCY
# iperf3 streams at once, one process each (iperf3 3.12 runs all of a
# process's streams on one thread), so that a ratio can be read against
# what loopback TCP allows on this machine.
# Both servers that can use several threads run with the same number,
# SERVER_THREADS (default: this machine's cores): memcached's -t, the
# store's --threads (one runtime for its meta service and daemon). With its
# own default (half the cores), a store daemon sharing a 2-core machine
# with a 2-thread client gets one thread, and the CPU scheduler then gives
# that thread a third of the machine.
# Usage: tools/bench/compare.sh [SIZES] [CONCURRENCY] [OPS] [CLIENT_THREADS] [SERVER_THREADS]
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZES="${1:-16KiB,256KiB,4MiB}"
CONC="${2:-8}"
OPS="${3:-4000}"
THREADS="${4:-1}"
SERVER_THREADS="${5:-$(nproc)}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v memcached >/dev/null || need+=(memcached)
command -v iperf3 >/dev/null || need+=(iperf3)
if ((${#need[@]})); then
    echo "installing: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null
fi
cargo build --release -q --bin mooncake-store
BIN="$CARGO_TARGET_DIR/release/mooncake-store"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
RPORT=$(free_port); CPORT=$(free_port); MPORT=$(free_port); DPORT=$(free_port)
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

# Loopback TCP ceiling: one iperf3 server and client per stream, 3 s.
clients=()
for i in $(seq "$CONC"); do
    p=$(free_port)
    iperf3 -s -1 -p "$p" >/dev/null 2>&1 &
    pids+=($!)
    (sleep 0.3; iperf3 -c 127.0.0.1 -p "$p" -t 3 -J >"$tmp/iperf-$i.json" 2>/dev/null) &
    clients+=($!)
done
wait "${clients[@]}" || true

redis-server --port "$RPORT" --bind 127.0.0.1 --save '' --appendonly no \
    --proto-max-bulk-len 1gb --daemonize no >"$tmp/redis.log" 2>&1 &
pids+=($!)
# memcached: SERVER_THREADS threads, values up to 8 MiB, 4 GiB of memory.
memcached -t "$SERVER_THREADS" -p "$CPORT" -l 127.0.0.1 -U 0 -I 8m -m 4096 -u "$(id -un)" >"$tmp/memcached.log" 2>&1 &
pids+=($!)
"$BIN" up --threads "$SERVER_THREADS" --meta-listen "127.0.0.1:$MPORT" --listen "127.0.0.1:$DPORT" --admin "" --dram 4GiB \
    --shm-socket "$tmp/daemon.sock" >"$tmp/up.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
    "$BIN" stat --meta "127.0.0.1:$MPORT" --json 2>/dev/null | grep -q '"alive":true' && break
    sleep 0.1
done

echo "machine: $(nproc) cores, $(uname -r); concurrency $CONC; $OPS gets per size; client threads $THREADS; server threads $SERVER_THREADS (memcached, store); redis $(redis-server --version | grep -o 'v=[0-9.]*'), memcached $(memcached -V | cut -d' ' -f2)"
common=(--threads "$THREADS" --sizes "$SIZES" --concurrency "$CONC" --ops "$OPS")
# A reference that fails loses its own columns, not the table.
"$BIN" bench-peer --peer redis --addr "127.0.0.1:$RPORT" "${common[@]}" --chain 128 >"$tmp/redis.json" ||
    echo "redis: bench-peer failed (exit $?); its columns are left empty" >&2
"$BIN" bench-peer --peer memcached --addr "127.0.0.1:$CPORT" "${common[@]}" >"$tmp/memcached.json" ||
    echo "memcached: bench-peer failed (exit $?); its columns are left empty" >&2
"$BIN" bench --meta "127.0.0.1:$MPORT" "${common[@]}" --json >"$tmp/mooncake.json"
"$BIN" bench --meta "127.0.0.1:$MPORT" "${common[@]}" --shm-socket "$tmp/daemon.sock" --json >"$tmp/shm.json"
"$BIN" bench-meta --meta "127.0.0.1:$MPORT" --concurrency "$CONC" --chain-len 128 --requests $((OPS * 10)) --json >"$tmp/meta.json"

python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
def rows(name):
    try:
        return [json.loads(l) for l in open(f"{d}/{name}.json") if l.strip().startswith("{")]
    except OSError:
        return []
redis, mc, moon, shm = rows("redis"), rows("memcached"), rows("mooncake"), rows("shm")
import glob
def load(path):
    try:
        return json.load(open(path))
    except ValueError:
        return {"error": "output not JSON"}
streams = [load(f) for f in glob.glob(f"{d}/iperf-*.json") if open(f).read().strip()]
# A stream that failed (its JSON has an "error" and no sum) counts nothing.
ceiling = sum(s.get("end", {}).get("sum_received", {}).get("bits_per_second", 0) for s in streams) / 8e9
failed = [s.get("error", "no result") for s in streams if not s.get("end", {}).get("sum_received")]
if failed:
    print(f"iperf3: {len(failed)} of {len(streams)} streams failed ({failed[0]}); the TCP ceiling counts the rest")
def find(rs, op, size):
    return next((r for r in rs if r.get("op") == op and r.get("size") == size), None)
def fmt_size(n):
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"
print(f"{'size':<7} {'op':<4} {'redis GB/s':>10} {'p99 ms':>7} {'memcached GB/s':>14} {'p99 ms':>7} {'mooncake GB/s':>13} {'p99 ms':>7} {'vs redis':>8} {'vs memcached':>12} {'shm GB/s':>9} {'p99 ms':>7} {'shm vs redis':>12} {'shm vs mc':>9}")
def gbs(row, width):
    return f"{row['gb_per_sec']:>{width}.2f}" if row else f"{'-':>{width}}"
def p99(row):
    return f"{row['p99_us']/1000:>7.2f}" if row else f"{'-':>7}"
def ratio(a, b, width):
    return f"{a['gb_per_sec']/b['gb_per_sec']:>{width}.2f}x" if a and b and b["gb_per_sec"] else f"{'-':>{width + 1}}"
for m in moon:
    r, c, s = find(redis, m["op"], m["size"]), find(mc, m["op"], m["size"]), find(shm, m["op"], m["size"])
    line = (f"{fmt_size(m['size']):<7} {m['op']:<4} {gbs(r, 10)} {p99(r)} "
            f"{gbs(c, 14)} {p99(c)} {gbs(m, 13)} {p99(m)} "
            f"{ratio(m, r, 7)} {ratio(m, c, 11)}")
    if s and m["op"] == "get":
        line += f" {gbs(s, 9)} {p99(s)} {ratio(s, r, 11)} {ratio(s, c, 8)}"
    print(line)
    bad = {name: row for name, row in (("redis", r), ("memcached", c), ("mooncake", m)) if row and (row["misses"] or row["errors"])}
    if bad:
        print("        misses/errors: " + ", ".join(f"{n} {row['misses']}/{row['errors']}" for n, row in bad.items())
              + " (GB/s counts values that arrived)")
if ceiling:
    print()
    print(f"loopback TCP ceiling, {len(streams)} iperf3 streams at once: {ceiling:.2f} GB/s")
    for m in moon:
        c = find(mc, m["op"], m["size"])
        if m["op"] == "get" and c and m["size"] >= 256 << 10:
            print(f"  {fmt_size(m['size'])} gets: memcached {c['gb_per_sec']/ceiling:.0%} of it, mooncake TCP {m['gb_per_sec']/ceiling:.0%}; "
                  f"1.5x memcached over TCP would need {1.5*c['gb_per_sec']/ceiling:.0%}")
ex = next((r for r in redis if r.get("op") == "match_prefix"), None)
meta = (rows("meta") or [None])[0]
print()
if ex and meta:
    print(f"prefix match, 128-key chains, {ex['concurrency']} in flight each: redis pipelined EXISTS {ex['keys_per_sec']/1e6:.2f} M keys/s (p99 {ex['p99_us']} us); "
          f"mooncake match_prefix {meta['wire_match_keys_per_sec']/1e6:.2f} M keys/s (p99 {meta['wire_match_p99_us']} us): "
          f"{meta['wire_match_keys_per_sec']/ex['keys_per_sec']:.1f}x")
elif meta:
    print(f"prefix match, 128-key chains: mooncake match_prefix {meta['wire_match_keys_per_sec']/1e6:.2f} M keys/s "
          f"(p99 {meta['wire_match_p99_us']} us); redis not measured")
PY
