#!/usr/bin/env bash
# The cost of store events on puts, and their delay: `mooncake-store up`
# publishing events, with 0, 1 and 8 subscribers (tools/bench/
# events_subscriber.py, ZeroMQ SUB in Python as a router runs one), the
# same put load each time (`mooncake-store bench`: 4 KiB blocks, one per
# request, 16 in flight), interleaved over ROUNDS rounds; the median of
# each is reported, side by side with no events port at all. Subscribers
# report the delay from a batch's oldest change to its arrival. The store's
# own CPU time per put is measured too (from /proc): on a small machine the
# subscribers' CPU competes with the store's and the load's, and the
# throughput then shows the machine's share more than the store's cost.
# The row "8 subs, SCHED_IDLE" runs the same eight subscribers at the
# lowest CPU priority there is (`chrt --idle 0`: they run only on a core
# nothing else wants), to tell the machine's share from the scheduler's:
# the blocks column says whether they still saw every event.
# Usage: tools/bench/events.sh [ROUNDS] [OPS]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS="${1:-3}"
OPS="${2:-100000}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"
VENV="${MOONCAKE_VENV:-$HOME/.cache/mooncake-venv}"
tools/setup.sh
. tools/store-for-script.sh
release_and_python
tmp=$SCRATCH

# One run: a fresh store, $1 subscribers ("off": no events port; "8n":
# eight under SCHED_IDLE); prints
# "ops_per_sec p99_us batches blocks gaps delay_p50 delay_p99 store_us_per_put
# subscribers_cpu_s".
run() {
    local subs=$1 meta events extra=()
    meta="127.0.0.1:$(free_port)"; events="127.0.0.1:$(free_port)"
    [[ $subs != off ]] && extra=(--events "$events")
    "$BIN" up --meta-listen "$meta" --listen "127.0.0.1:$(free_port)" --admin "" \
        --dram 2GiB "${extra[@]}" >"$tmp/up.log" 2>&1 &
    local up=$!
    until "$BIN" stat --meta "$meta" --json 2>/dev/null | grep -q '"alive":true'; do sleep 0.1; done
    local sp=() n=0 prio=() settle=0.5
    case $subs in
        off) ;;
        8n) n=8 prio=(chrt --idle 0) settle=5 ;;
        *) n=$subs ;;
    esac
    for ((i = 0; i < n; i++)); do
        "${prio[@]}" "$VENV/bin/python" tools/bench/events_subscriber.py "$events" >"$tmp/sub-$i.json" &
        sp+=($!)
    done
    sleep 1 # the subscribers' connections are up
    local cpu0; cpu0=$(cpu_ticks "$up")
    "$BIN" bench --meta "$meta" --sizes 4KiB --ops "$OPS" --batch 1 --concurrency 16 \
        --working-set $((OPS * 4))KiB --json >"$tmp/bench.json"
    sleep "$settle" # the last batches arrive
    local store_ticks=$(( $(cpu_ticks "$up") - cpu0 )) sub_ticks=0
    for p in "${sp[@]}"; do sub_ticks=$((sub_ticks + $(cpu_ticks "$p"))); done
    for p in "${sp[@]}"; do kill -TERM "$p"; done
    for p in "${sp[@]}"; do wait "$p" || true; done
    kill -TERM "$up"; wait "$up" 2>/dev/null || true
    python3 - "$tmp" "$n" "$store_ticks" "$sub_ticks" "$(getconf CLK_TCK)" <<'PY'
import json, sys
tmp, n = sys.argv[1], int(sys.argv[2])
store_s, sub_s = int(sys.argv[3]) / int(sys.argv[5]), int(sys.argv[4]) / int(sys.argv[5])
rows = [json.loads(l) for l in open(f"{tmp}/bench.json") if l.strip().startswith("{")]
rows = [r for row in rows for r in (row if isinstance(row, list) else row.get("rows", [row]))]
put = next(r for r in rows if r.get("op") == "put")
subs = [json.loads(open(f"{tmp}/sub-{i}.json").read()) for i in range(n)]
agg = lambda k, f: f(s[k] for s in subs if s[k] is not None) if subs else 0
# The store's CPU covers the run's puts, gets and removals (one each per block).
print(round(put["ops_per_sec"]), put["p99_us"], agg("batches", min), agg("blocks", min),
      agg("gaps", max), agg("delay_ms_p50", max), agg("delay_ms_p99", max),
      round(store_s * 1e6 / put["ops"], 1), round(sub_s, 2))
PY
}

# utime + stime of a process, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

declare -A results
for ((r = 1; r <= ROUNDS; r++)); do
    for subs in off 0 1 8 8n; do
        line=$(run "$subs")
        echo "round $r, subscribers $subs: $line" >&2
        results[$subs]+="$line"$'\n'
    done
done

echo
echo "puts of 4 KiB blocks, one per request, 16 in flight, $OPS per run; median of $ROUNDS runs (by puts/s)"
echo "blocks: stored and removed events seen by the slowest subscriber; store us/block: the store's CPU per block put, read back and removed"
printf "%-18s %9s %8s %9s %9s %5s %10s %10s %14s %12s\n" "events" "puts/s" "p99 us" "batches" "blocks" "gaps" "delay p50" "delay p99" "store us/block" "subs CPU s"
for subs in off 0 1 8 8n; do
    case $subs in
        off) label="no events port" ;;
        8n) label="8 subs, SCHED_IDLE" ;;
        *) label="$subs subscribers" ;;
    esac
    printf '%s' "${results[$subs]}" | python3 -c '
import sys, statistics
rows = [list(map(float, l.split())) for l in sys.stdin if l.strip()]
rows.sort(key=lambda r: r[0])
m = rows[len(rows) // 2]
label = sys.argv[1]
print(f"{label:<18} {m[0]:>9,.0f} {m[1]:>8,.0f} {m[2]:>9,.0f} {m[3]:>9,.0f} {m[4]:>5,.0f} {m[5]:>8.2f}ms {m[6]:>8.2f}ms {m[7]:>14.1f} {m[8]:>12.2f}")
' "$label"
done
