#!/usr/bin/env bash
# A run deciding alone (--quota-store off) against a quota whose 429s advise no wait (the Gemini
# API sometimes refuses with no RetryInfo): bench/refserver.py --no-advice, 100 per fixed 5-s
# window, 0.3 s latency; with MODE=after (the default) a run of 300 records first, GAP s before
# the measured run of 200; MODE=fresh leaves it out. Prints the measured run's time, the
# server's requests and 429s, its output rows and the limit it learned.
#   bench/after-another-noadvice.sh /path/to/weir
BIN=$1; GAP=${GAP:-1.5}; MODE=${MODE:-after}
W=$(mktemp -d); PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 - "$W" <<'PY'
import json, sys
for n, c in [("a", 300), ("b", 200)]:
    with open(f"{sys.argv[1]}/{n}.jsonl", "w") as f:
        for i in range(c): f.write(json.dumps({"id": f"{n}{i}", "prompt": f"{n} {i:06d} river stone"}) + "\n")
PY
python3 "$(dirname "$0")/refserver.py" --listen 127.0.0.1:$PORT --rpm 100 --window-secs 5 --latency-ms 300 --no-advice > $W/srv.log 2>&1 &
SRV=$!; trap 'kill $SRV; rm -rf $W' EXIT; sleep 1
run() { timeout 300 "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" --input "$W/$1.jsonl" --output "$W/$1.out" --id-field id --no-state --progress never --quota-store off --max-retries 50 2> "$W/$1.err"; }
[ "$MODE" = after ] && { run a; sleep $GAP; }
curl -s -X POST http://127.0.0.1:$PORT/stats/reset >/dev/null
s=$(date +%s.%N); run b; rc=$?; e=$(date +%s.%N)
st=$(curl -s http://127.0.0.1:$PORT/stats | python3 -c "import json,sys; s=json.load(sys.stdin); print(s['requests'], s['rate_limited'])")
echo "$(basename $BIN) $MODE gap $GAP: $(python3 -c "print(round($e-$s,1))") s rc $rc; req/429 $st; rows $(wc -l < $W/b.out); $(grep -o '[0-9,]* requests per [0-9.]* s' $W/b.err)"
