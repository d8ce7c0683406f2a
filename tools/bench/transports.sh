#!/usr/bin/env bash
# Every data path side by side, in one run on this machine: gets (and
# puts) of the same blocks over TCP, TLS over TCP (a second store with
# --tls, mutual TLS), QUIC and same-host shared memory, at
# 8 and 64 requests in flight, beside the two ceilings: iperf3's single
# TCP stream on loopback (what TCP can carry) and one core's memcpy of the
# same block sizes (what a same-host copy can reach). With
# MOONCAKE_FEATURES=mooncake-tools/rdma on a host with an RDMA NIC, RDMA too
# (through the NIC's loopback; its rows have no ceiling here).
# Usage: tools/bench/transports.sh [SIZES] [OPS] [CLIENT_THREADS]
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZES="${1:-256KiB,4MiB}"
OPS="${2:-2000}"
THREADS="${3:-1}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"

if ! command -v iperf3 >/dev/null; then
    echo "installing: iperf3"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq iperf3 >/dev/null
fi
FEATURES="${MOONCAKE_FEATURES:-}"
cargo build --release -q --bin mooncake-store ${FEATURES:+--features "$FEATURES"}
BIN="$CARGO_TARGET_DIR/release/mooncake-store"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
MPORT=$(free_port); DPORT=$(free_port); QPORT=$(free_port); IPORT=$(free_port); RPORT=$(free_port)
TMPORT=$(free_port); TDPORT=$(free_port)
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

"$BIN" certs --out "$tmp/certs" >/dev/null
# RDMA where this build and host have it; else one line saying why not.
rdma=()
rdma_why=$("$BIN" transports --json | python3 -c 'import json,sys; r=json.load(sys.stdin)["rdma"]; print("" if r["available"] else r["detail"])')
[ -z "$rdma_why" ] && rdma=(--rdma-listen "127.0.0.1:$RPORT")
"$BIN" up --meta-listen "127.0.0.1:$MPORT" --listen "127.0.0.1:$DPORT" --admin "" --dram 4GiB \
    --shm-socket "$tmp/daemon.sock" --quic-listen "127.0.0.1:$QPORT" \
    --tls-cert "$tmp/certs/daemon.pem" --tls-key "$tmp/certs/daemon.key" \
    --tls-client-ca "$tmp/certs/ca.pem" "${rdma[@]}" >"$tmp/up.log" 2>&1 &
pids+=($!)
# The same store with TLS on its TCP ports (and between its servers).
"$BIN" up --meta-listen "127.0.0.1:$TMPORT" --listen "127.0.0.1:$TDPORT" --admin "" --dram 4GiB \
    --tls --tls-cert "$tmp/certs/daemon.pem" --tls-key "$tmp/certs/daemon.key" \
    --tls-client-ca "$tmp/certs/ca.pem" --peer-ca "$tmp/certs/ca.pem" >"$tmp/up-tls.log" 2>&1 &
pids+=($!)
iperf3 -s -p "$IPORT" -B 127.0.0.1 >"$tmp/iperf3-server.log" 2>&1 &
pids+=($!)
tls=(--tls-ca "$tmp/certs/ca.pem" --tls-client-cert "$tmp/certs/client.pem" --tls-client-key "$tmp/certs/client.key")
for _ in $(seq 100); do
    "$BIN" stat --meta "127.0.0.1:$MPORT" --json 2>/dev/null | grep -q '"alive":true' &&
        "$BIN" stat --meta "127.0.0.1:$TMPORT" "${tls[@]}" --json 2>/dev/null | grep -q '"alive":true' && break
    sleep 0.1
done
sleep 0.3

echo "machine: $(nproc) cores, $(uname -r); $OPS ops per size; client threads $THREADS; $(iperf3 --version | head -1 | cut -d' ' -f1-2)"
# A failed iperf3 loses only its own ceiling, not the table.
iperf3 -c 127.0.0.1 -p "$IPORT" -t 5 -J >"$tmp/iperf3.json" || true
"$BIN" bench-memcpy --sizes "$SIZES" --ops "$OPS" --json >"$tmp/memcpy.json"
quic=(--quic-ca "$tmp/certs/ca.pem" --quic-cert "$tmp/certs/client.pem" --quic-key "$tmp/certs/client.key")
for conc in 8 64; do
    common=(--threads "$THREADS" --sizes "$SIZES" --concurrency "$conc" --ops "$OPS" --json)
    plain=(--meta "127.0.0.1:$MPORT" "${common[@]}")
    "$BIN" bench "${plain[@]}" >"$tmp/tcp-$conc.json"
    "$BIN" bench --meta "127.0.0.1:$TMPORT" "${common[@]}" "${tls[@]}" >"$tmp/tls-$conc.json"
    "$BIN" bench "${plain[@]}" "${quic[@]}" >"$tmp/quic-$conc.json"
    "$BIN" bench "${plain[@]}" --shm-socket "$tmp/daemon.sock" >"$tmp/shm-$conc.json"
    if [ ${#rdma[@]} -gt 0 ]; then
        "$BIN" bench "${plain[@]}" --rdma >"$tmp/rdma-$conc.json"
    fi
done
[ -n "$rdma_why" ] && echo "rdma: not measured ($rdma_why)"

python3 - "$tmp" <<'PY'
import json, os, sys
d = sys.argv[1]
def rows(name):
    return [json.loads(l) for l in open(f"{d}/{name}.json") if l.strip()]
def fmt_size(n):
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"
def iperf3_rate(path):
    """GB/s iperf3 received, or None and why not (it failed, or wrote nothing)."""
    try:
        run = json.load(open(path))
    except (OSError, ValueError) as e:
        return None, f"no result ({e.__class__.__name__})"
    got = run.get("end", {}).get("sum_received", {}).get("bits_per_second")
    return (got / 8e9, "") if got else (None, run.get("error", "no sum_received"))
iperf, why = iperf3_rate(f"{d}/iperf3.json")
memcpy = {r["size"]: r for r in rows("memcpy") if r["op"] == "memcpy"}
iperf_text = f"{iperf:.2f} GB/s" if iperf else f"not measured ({why})"
print(f"ceilings: iperf3 one TCP stream {iperf_text}; memcpy (one core) " +
      ", ".join(f"{fmt_size(s)} {r['gb_per_sec']:.2f} GB/s" for s, r in sorted(memcpy.items())))
print()
print(f"{'transport':<9} {'size':<7} {'in flight':>9} {'op':<4} {'GB/s':>6} {'p99 ms':>7} {'errors':>6}  {'of ceiling':>10}  {'vs TCP':>6}")
for conc in (8, 64):
    tcp = {(r["op"], r["size"]): r for r in rows(f"tcp-{conc}")}
    for name in ("tcp", "tls", "quic", "shm", "rdma"):
        if name == "rdma" and not os.path.exists(f"{d}/rdma-{conc}.json"):
            continue
        for r in rows(f"{name}-{conc}"):
            ceiling = memcpy[r["size"]]["gb_per_sec"] if name == "shm" else iperf
            ceiling_name = "memcpy" if name == "shm" else "iperf3"
            of = f"{r['gb_per_sec'] / ceiling * 100:5.0f}% {ceiling_name}" if r["op"] == "get" and name != "rdma" and ceiling else ""
            base = tcp.get((r["op"], r["size"]))
            vs = f"{r['gb_per_sec'] / base['gb_per_sec']:.2f}x" if base else ""
            print(f"{name:<9} {fmt_size(r['size']):<7} {conc:>9} {r['op']:<4} {r['gb_per_sec']:>6.2f} "
                  f"{r['p99_us'] / 1000:>7.2f} {r['errors']:>6}  {of:>10}  {vs:>6}")
PY
