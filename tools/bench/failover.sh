#!/usr/bin/env bash
# Failover with a full index: a real etcd, two meta replicas and one daemon
# holding BLOCKS blocks; kill -9 the leader and time until the standby leads
# and every block is visible again (rebuilt from the daemon's inventory).
# Usage: tools/bench/failover.sh [BLOCKS] [LEASE_TTL]
set -euo pipefail
cd "$(dirname "$0")/../.."
BLOCKS="${1:-1000000}"
TTL="${2:-3s}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"
tools/setup.sh
cargo build --release -q --bin mooncake-store
BIN="$CARGO_TARGET_DIR/release/mooncake-store"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
now() { date +%s.%N; }

EP=$(free_port); PP=$(free_port)
ETCD="http://127.0.0.1:$EP"
etcd --name f --data-dir "$tmp/etcd" --listen-client-urls "$ETCD" --advertise-client-urls "$ETCD" \
    --listen-peer-urls "http://127.0.0.1:$PP" --initial-advertise-peer-urls "http://127.0.0.1:$PP" \
    --initial-cluster "f=http://127.0.0.1:$PP" >"$tmp/etcd.log" 2>&1 &
pids+=($!)
M1="127.0.0.1:$(free_port)"; M2="127.0.0.1:$(free_port)"; D="127.0.0.1:$(free_port)"
sleep 1
"$BIN" meta --etcd "$ETCD" --listen "$M1" --lease-ttl "$TTL" --admin "" >"$tmp/m1.log" 2>&1 & pids+=($!); P1=$!
sleep 0.5
"$BIN" meta --etcd "$ETCD" --listen "$M2" --lease-ttl "$TTL" --admin "" >"$tmp/m2.log" 2>&1 & pids+=($!); P2=$!
"$BIN" daemon --etcd "$ETCD" --listen "$D" --dram 2GiB --lease-ttl "$TTL" --admin "" >"$tmp/d.log" 2>&1 & pids+=($!)
until "$BIN" stat --etcd "$ETCD" --json 2>/dev/null | grep -q '"alive":true'; do sleep 0.2; done

echo "filling the index with $BLOCKS blocks of 64 bytes"
"$BIN" bench --etcd "$ETCD" --sizes 64B --ops "$BLOCKS" --batch 1024 --concurrency 4 --keep --timeout 30s | tail -3
blocks() { "$BIN" stat --etcd "$ETCD" --json --timeout 2s 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["leader"], d["blocks"])' 2>/dev/null || echo "none 0"; }
read -r leader stored < <(blocks)
echo "leader $leader holds $stored blocks"
victim=$([[ $leader == "$M1" ]] && echo "$P1" || echo "$P2")

t0=$(now)
kill -9 "$victim"
wait "$victim" 2>/dev/null || true
t_lead=""
while true; do
    read -r l n < <(blocks)
    if [[ $l != "$leader" && $l != none && -z $t_lead ]]; then t_lead=$(now); fi
    if [[ $l != "$leader" && $l != none && $n -ge $stored ]]; then t_all=$(now); break; fi
    if (( $(python3 -c "print(int($(now) - $t0 > 60))") )); then echo "no recovery within 60s"; exit 1; fi
    sleep 0.05
done
python3 -c "print(f'lease TTL $TTL: new leader after {$t_lead-$t0:.2f} s; all $stored blocks visible after {$t_all-$t0:.2f} s (index rebuilt in {$t_all-$t_lead:.2f} s)')"
