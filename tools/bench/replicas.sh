#!/usr/bin/env bash
# Copies across hosts, measured: three daemon hosts and three client hosts
# as network namespaces on this machine, each host's link capped with tc
# (netem: RATE and a DELAY each way), the meta service on the bridge. For
# one copy of every block (hot copies off, then on: the meta service gives
# the blocks its daemons report hot more copies), then 2 and 3 copies of
# every block asked at put: one client puts the working set (the put rows:
# what more copies cost a writer), then the three clients read it at once
# with a Zipf-skewed choice of blocks (a few hot ones, a long tail); the
# sum of their GB/s and their worst p99 are printed beside iperf3's own
# limit through the same links (each client host pulling from a daemon
# host at once: the sum of the clients' links).
# Needs root (ip netns, tc). Usage:
#   tools/bench/replicas.sh [RATE] [DELAY] [SIZE] [WORKING_SET] [GETS] [ZIPF] [HOT_READS]
# (HOT_READS: the meta service's hot_reads in the "hot copies on" run.)
set -euo pipefail
cd "$(dirname "$0")/../.."
RATE="${1:-1gbit}"
DELAY="${2:-25us}"
SIZE="${3:-256KiB}"
WORKING_SET="${4:-64MiB}"
GETS="${5:-4000}"
ZIPF="${6:-1.1}"
HOT_READS="${7:-100}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"

if ! command -v iperf3 >/dev/null; then
    echo "installing: iperf3"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq iperf3 >/dev/null
fi
cargo build --release -q --bin mooncake-store
BIN="$CARGO_TARGET_DIR/release/mooncake-store"

BR=mcbr0
META_IP=10.77.0.1
DAEMONS=(d1 d2 d3)
CLIENTS=(c1 c2 c3)
ip_of() { case "$1" in d*) echo "10.77.0.1${1#d}" ;; c*) echo "10.77.0.2${1#c}" ;; esac; }

tmp=$(mktemp -d)
pids=()
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
cleanup() {
    stop_all
    for h in "${DAEMONS[@]}" "${CLIENTS[@]}"; do
        ip netns pids "mc-$h" 2>/dev/null | xargs -r kill 2>/dev/null || true
        ip netns del "mc-$h" 2>/dev/null || true
    done
    ip link del "$BR" 2>/dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT
cleanup 2>/dev/null || true
tmp=$(mktemp -d)

# The hosts: a namespace each, a veth into the bridge, the link capped on
# both ends (what leaves the host, and what reaches it): netem (rate and
# delay) where the kernel has it, else tbf (rate only, no delay).
SHAPE=netem
ip link add mc-probe type veth peer name mc-probe-p
tc qdisc add dev mc-probe root netem delay "$DELAY" 2>/dev/null || SHAPE=tbf
ip link del mc-probe
cap() {
    if [ "$SHAPE" = netem ]; then
        tc qdisc add dev "$1" root netem delay "$DELAY" rate "$RATE" limit 10000
    else
        tc qdisc add dev "$1" root tbf rate "$RATE" burst 256kb latency 50ms
    fi
}
ip link add "$BR" type bridge
ip addr add "$META_IP/24" dev "$BR"
ip link set "$BR" up
for h in "${DAEMONS[@]}" "${CLIENTS[@]}"; do
    ip netns add "mc-$h"
    ip link add "mc-$h-b" type veth peer name "mc-$h-n"
    ip link set "mc-$h-n" netns "mc-$h"
    ip link set "mc-$h-b" master "$BR" up
    ip -n "mc-$h" addr add "$(ip_of "$h")/24" dev "mc-$h-n"
    ip -n "mc-$h" link set "mc-$h-n" up
    ip -n "mc-$h" link set lo up
    cap "mc-$h-b"
    ip netns exec "mc-$h" bash -c "$(declare -f cap); SHAPE='$SHAPE' RATE='$RATE' DELAY='$DELAY' cap mc-$h-n"
done
in_ns() { local h="$1"; shift; ip netns exec "mc-$h" "$@"; }

case "$SHAPE" in
    netem) shaped="$RATE, $DELAY each way" ;;
    *) shaped="$RATE (tbf: this kernel has no netem, so no delay is added)" ;;
esac
echo "hosts: ${#DAEMONS[@]} daemon hosts, ${#CLIENTS[@]} client hosts; each link $shaped"

# The links' own limit: every client host pulls from a daemon host at once.
for d in "${DAEMONS[@]}"; do in_ns "$d" iperf3 -s -D -1 -B "$(ip_of "$d")" >/dev/null; done
sleep 0.5
for i in 0 1 2; do
    in_ns "${CLIENTS[$i]}" iperf3 -c "$(ip_of "${DAEMONS[$i]}")" -R -t 5 -J > "$tmp/iperf-$i.json" &
done
wait
IPERF=$(python3 - "$tmp" <<'EOF'
import json, sys, glob
total = sum(json.load(open(f))["end"]["sum_received"]["bits_per_second"] for f in glob.glob(sys.argv[1] + "/iperf-*.json"))
print(f"{total / 8 / 1e9:.3f}")
EOF
)
echo "iperf3, 3 client hosts pulling at once: $IPERF GB/s (the sum of the clients' links)"

port=7300
for mode in "1 off" "1 on" "2 off" "3 off"; do
    read -r copies hot <<<"$mode"
    port=$((port + 10))
    META="$META_IP:$port"
    if [ "$hot" = on ]; then
        printf '[meta]\nhot_copies = 3\nhot_reads = %s\n' "$HOT_READS" > "$tmp/meta.toml"
    else
        printf '[meta]\nhot_copies = 1\n' > "$tmp/meta.toml"
    fi
    "$BIN" meta --listen "$META" --admin "" --config "$tmp/meta.toml" >"$tmp/meta.log" 2>&1 &
    pids+=($!)
    for d in "${DAEMONS[@]}"; do
        in_ns "$d" "$BIN" daemon --meta "$META" --listen "$(ip_of "$d"):$port" --node "$d" \
            --dram 1GiB --admin "" >"$tmp/daemon-$d.log" 2>&1 &
        pids+=($!)
    done
    # Every daemon registered: a probe block gets three copies.
    for _ in $(seq 100); do
        out=$(in_ns c1 "$BIN" put probe --replicas 3 --meta "$META" --json <<<"p" 2>/dev/null || true)
        "$BIN" rm probe --meta "$META" >/dev/null 2>&1 || true
        case "$out" in *'"outcome":"stored"'*) break ;; esac
        sleep 0.2
    done
    run_id=$((RANDOM * 32768 + RANDOM))
    common=(--meta "$META" --sizes "$SIZE" --working-set "$WORKING_SET" --run-id "$run_id" --json)
    in_ns c1 "$BIN" bench "${common[@]}" --replicas "$copies" --ops 1 --keep > "$tmp/put.json"
    readers=()
    for i in 0 1 2; do
        in_ns "${CLIENTS[$i]}" "$BIN" bench "${common[@]}" --ops "$GETS" --zipf "$ZIPF" \
            --concurrency 8 --reads-only > "$tmp/get-$i.json" &
        readers+=($!)
    done
    wait "${readers[@]}"
    "$BIN" stat --meta "$META" --json > "$tmp/stat.json"
    python3 - "$tmp" "$copies" "$IPERF" "$hot" <<'EOF'
import json, sys, glob
tmp, copies, cap, hot = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
put = [json.loads(l) for l in open(tmp + "/put.json") if l.startswith("{")]
put = next(r for r in put if r["op"] == "put")
gets = [json.loads(l) for f in sorted(glob.glob(tmp + "/get-*.json")) for l in open(f) if l.startswith("{")]
total = sum(r["gb_per_sec"] for r in gets)
p99 = max(r["p99_us"] for r in gets)
misses = sum(r["misses"] + r["errors"] for r in gets)
print(f"{copies} cop{'y' if copies == '1' else 'ies'}, hot copies {hot}: put {put['gb_per_sec']:.3f} GB/s (p99 {put['p99_us']} us); "
      f"gets from 3 client hosts {total:.3f} GB/s = {total / cap:.0%} of the links, worst p99 {p99} us, "
      f"misses+errors {misses}")
stat = json.load(open(tmp + "/stat.json"))
hits = {d["node"]: d["hits"] for d in stat["daemons"]}
total_hits = sum(hits.values()) or 1
print("   gets served per daemon host: " + ", ".join(f"{n} {h / total_hits:.0%}" for n, h in sorted(hits.items()))
      + f"; {stat['copies']} copies of {stat['blocks']} blocks after the reads")
EOF
    stop_all
done
