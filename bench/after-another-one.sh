#!/usr/bin/env bash
# One run that decides alone (--quota-store off) started GAP seconds after another on the same
# key (issue #32): `weir sim` with 100 requests per 5-s window (WIN=sliding or fixed),
# whole-second advice, 0.3 s latency; a run of 300 records, then the measured run of 200.
# MODE=fresh leaves the first run out; MODE=overfill instead sends a first wave bigger than the
# quota (20 per 5 s, --max-concurrency 64 --concurrency fixed). Prints the measured run's wall
# time, the simulator's requests and 429s for it, and the limit it learned. ROUND=0: the server
# advises exact waits instead of whole seconds. SERVER=ref-noadvice: bench/refserver.py
# --no-advice instead (a fixed window whose 429s advise no wait, as Vertex AI's and sometimes the
# Gemini API's do). WINDOW=60 A=100 B=50 RETRIES=8: a per-minute window the first run fills, then
# a run with the default retries (by default WINDOW=5, A=300, B=200 and 50 retries).
#   WEIR_BIN=/path/to/weir [GAP=1.5] [MODE=after|fresh|overfill] [WIN=sliding|fixed] [SERVER=sim|ref-noadvice] bench/after-another-one.sh
set -u
BIN=${WEIR_BIN:-$(dirname "$0")/../target/release/weir}
GAP=${GAP:-1.5}; MODE=${MODE:-after}; WIN=${WIN:-sliding}; WINDOW=${WINDOW:-5}
W=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 - "$W" "${A:-300}" "${B:-200}" <<'PY'
import json, sys
for n, c in [("a", int(sys.argv[2])), ("b", int(sys.argv[3]))]:
    with open(f"{sys.argv[1]}/{n}.jsonl", "w") as f:
        for i in range(c):
            f.write(json.dumps({"id": f"{n}{i}", "prompt": f"{n} {i:06d} river stone"}) + "\n")
PY
RPM=100
[ "$MODE" = overfill ] && RPM=20
if [ "${SERVER:-sim}" = ref-noadvice ]; then
  WIN=fixed
  python3 "$(dirname "$0")/refserver.py" --listen "127.0.0.1:$PORT" --rpm $RPM --window-secs $WINDOW --latency-ms 300 --no-advice > "$W/sim.log" 2>&1 &
else
  "$BIN" sim --listen "127.0.0.1:$PORT" --rpm $RPM --window-secs $WINDOW $([ "${ROUND:-1}" = 1 ] && echo --round-advice) --latency-ms 300 --window "$WIN" > "$W/sim.log" 2>&1 &
fi
SIM=$!
trap 'kill $SIM 2>/dev/null; rm -rf "$W"' EXIT
sleep 1
run() { "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" --input "$W/$1.jsonl" \
  --output "$W/$1.out" --id-field id --no-state --progress never --quota-store off --max-retries ${RETRIES:-50} "${@:2}" 2> "$W/$1.err"; }
if [ "$MODE" = after ]; then run a; sleep "$GAP"; fi
curl -s -X POST "http://127.0.0.1:$PORT/stats/reset" > /dev/null
s=$(date +%s.%N)
if [ "$MODE" = overfill ]; then run b --max-concurrency 64 --concurrency fixed; else run b; fi
e=$(date +%s.%N)
st=$(curl -s "http://127.0.0.1:$PORT/stats" | python3 -c "import json,sys; s=json.load(sys.stdin); print(f\"{s['requests']} requests, {s['rate_limited']} rate-limited\")")
echo "$MODE, gap $GAP s, $WIN window of $WINDOW s: $(python3 -c "print(round($e-$s,1))") s; $st; $(grep -o '[0-9,]* failed' "$W/b.err" | head -1); learned $(grep -o '[0-9,]* requests per [0-9.]* s' "$W/b.err")"
