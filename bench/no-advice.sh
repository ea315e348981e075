#!/usr/bin/env bash
# One run against a fixed window whose 429s advise no wait (bench/refserver.py --no-advice, as
# Vertex AI's): RPM requests per WINDOW seconds, LATENCY ms, N records, the default settings
# (state, the local quota store in a fresh directory) plus ARGS. Stops the run after STOP seconds
# (SIGTERM; the run drains and says how far it got) and prints its wall time, the records it
# finished, the server's requests and 429s, the limit it learned, and how many calls its progress
# line last said were held. With PRE=SECS, a run of the same records is started first and
# killed with SIGKILL after PRE seconds (its learned state stays in the quota directory), with
# PRE_ARGS instead of ARGS, then the measured run starts.
#   WEIR_BIN=/path/to/weir [RPM=10] [WINDOW=5] [LATENCY=100] [N=50] [STOP=90] [PRE=] [PRE_ARGS=] [ARGS="--limit-window 5"] bench/no-advice.sh
set -u
BIN=${WEIR_BIN:-$(dirname "$0")/../target/release/weir}
RPM=${RPM:-10}; WINDOW=${WINDOW:-5}; LATENCY=${LATENCY:-100}; N=${N:-50}; STOP=${STOP:-90}
W=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 -c "
import json
for i in range($N): print(json.dumps({'id': i, 'prompt': f'hello {i}'}))" > "$W/in.jsonl"
python3 "$(dirname "$0")/refserver.py" --listen "127.0.0.1:$PORT" --rpm "$RPM" --window-secs "$WINDOW" \
  --latency-ms "$LATENCY" --no-advice > "$W/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; rm -rf "$W"' EXIT
sleep 1
export GEMINI_API_KEY=not-a-key WEIR_QUOTA_DIR="$W/quota"
run() { "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" --input "$W/in.jsonl" \
  --output "$W/$1.jsonl" --id-field id --no-cache --progress always $2 2> "$W/$1.err" & }
if [ -n "${PRE:-}" ]; then
  run pre "${PRE_ARGS:-}"; PID=$!; sleep "$PRE"; kill -9 $PID; wait $PID 2>/dev/null
fi
s=$(date +%s.%N)
run out "${ARGS:-}"; PID=$!
( sleep "$STOP"; kill -TERM $PID 2>/dev/null ) & TIMER=$!
wait $PID
e=$(date +%s.%N)
kill $TIMER 2>/dev/null
st=$(curl -s "http://127.0.0.1:$PORT/stats" | python3 -c "import json,sys; s=json.load(sys.stdin); print(f\"{s['requests']} requests, {s['rate_limited']} rate-limited\")")
done=$(grep -c . "$W/out.jsonl" 2>/dev/null || echo 0)
held=$(grep -o '[0-9,]* calls\? held for the quota' "$W/out.err" | tail -1)
echo "$RPM per $WINDOW s, $N records${PRE:+, after a run killed at $PRE s}: $(python3 -c "print(round($e-$s,1))") s; $done done; server: $st; learned $(grep -o '[0-9,]* requests per [0-9.]* s' "$W/out.err"); last progress: ${held:-nothing held}"
