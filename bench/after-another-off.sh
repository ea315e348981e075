#!/usr/bin/env bash
# Four processes that cannot reach each other (--quota-store off) started 1.5 s after a run that
# filled the window (issue #32): `weir sim` with 100 requests per sliding 5-s window, whole-second
# advice, 0.3 s latency; 300 records first, then 4 × 500 at once. With FRESH=1 the first run is
# left out (the window is empty when the four start). Prints the simulator's counts for the four,
# how long they took together (ideal: about 100 s) and each one's summary.
#   WEIR_BIN=/path/to/weir [FRESH=1] [GAP=seconds, default 1.5] bench/after-another-off.sh
set -euo pipefail
BIN=${WEIR_BIN:-$(dirname "$0")/../target/release/weir}
WORK=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 - "$WORK" <<'PY'
import json, sys
for n, count in [("a", 300), ("p0", 500), ("p1", 500), ("p2", 500), ("p3", 500)]:
    with open(f"{sys.argv[1]}/{n}.jsonl", "w") as f:
        for i in range(count):
            f.write(json.dumps({"id": f"{n}{i}", "prompt": f"{n} {i:06d} river stone"}) + "\n")
PY
"$BIN" sim --listen "127.0.0.1:$PORT" --rpm 100 --window-secs 5 --round-advice --latency-ms 300 > "$WORK/sim.log" 2>&1 &
SIM=$!
trap 'kill $SIM 2>/dev/null; rm -rf "$WORK"' EXIT
sleep 1
run() { "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" --input "$WORK/$1.jsonl" \
  --output "$WORK/$1.out" --id-field id --no-state --progress never --quota-store off --max-retries 50 2> "$WORK/$1.err"; }
if [ "${FRESH:-0}" = 1 ]; then sleep 6; else run a; sleep "${GAP:-1.5}"; fi
curl -s -X POST "http://127.0.0.1:$PORT/stats/reset" > /dev/null
s=$(date +%s.%N)
pids=()
for i in 0 1 2 3; do run "p$i" & pids+=($!); done
wait "${pids[@]}"
e=$(date +%s.%N)
curl -s "http://127.0.0.1:$PORT/stats" | python3 -c "import json,sys; s=json.load(sys.stdin); print(f\"requests {s['requests']}, rate-limited {s['rate_limited']} ({s['rate_limited']/s['requests']:.1%})\")"
echo "the four took $(python3 -c "print(round($e-$s,1))") s together (ideal about 100 s)"
for i in 0 1 2 3; do echo "p$i: $(grep -o 'records in [0-9.]* s' "$WORK/p$i.err"); $(grep -o '[0-9,]* rate.limited' "$WORK/p$i.err" | head -1); $(grep -o '[0-9,]* requests per [0-9.]* s' "$WORK/p$i.err")"; done
