#!/usr/bin/env bash
# How many requests one `weir run` sends to a quota of zero whose 429s advise a wait: starts
# bench/refserver.py with `--rpm 0 --window-secs 10` (every request refused, 10 s advised), runs
# N records against it, stops the run with Ctrl-C after SECS seconds and prints the server's
# request count and the run's summary lines.
#   WEIR_BIN=/path/to/weir [PORT=18950] [SECS=95] [N=10] bench/zero-quota-requests.sh [weir run args]
# Without args, the model is gemini/gemini-2.5-flash (one record per call); pass for example
# `--task embed --model gemini/gemini-embedding-001` for batched calls.
set -euo pipefail
BIN=${WEIR_BIN:-$(dirname "$0")/../target/release/weir}
PORT=${PORT:-18950}; SECS=${SECS:-95}; N=${N:-10}
[ $# -gt 0 ] || set -- --model gemini/gemini-2.5-flash
W=$(mktemp -d)
python3 "$(dirname "$0")/refserver.py" --listen 127.0.0.1:$PORT --rpm 0 --window-secs 10 --latency-ms 300 > "$W/srv.log" 2>&1 &
SRV=$!
trap 'kill $SRV 2>/dev/null || true; rm -rf "$W"' EXIT
sleep 1
for i in $(seq 1 "$N"); do echo "{\"id\": $i, \"prompt\": \"hello $i\"}"; done > "$W/in.jsonl"
GEMINI_API_KEY=not-a-key WEIR_QUOTA_DIR="$W/quota" "$BIN" run --base-url "http://127.0.0.1:$PORT" \
  --input "$W/in.jsonl" --output "$W/out.jsonl" --id-field id --progress never "$@" > "$W/stdout" 2> "$W/stderr" &
P=$!
sleep "$SECS"
kill -INT $P
status=0; wait $P || status=$?
echo "exit $status after ${SECS} s, $N records"
curl -s "127.0.0.1:$PORT/stats" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("server: requests", d["requests"], "rate_limited", d["rate_limited"])'
grep -E "^  calls|^  limits" "$W/stderr" || true
