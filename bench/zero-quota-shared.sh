#!/usr/bin/env bash
# K processes (3) of N records (20) each share one key's quota of zero on this machine (the
# default local quota store): bench/refserver.py with 100 per 60 s that falls to zero at once,
# plus ARGS for the server (e.g. --no-advice). Prints when each process ended and with which exit
# status (3: the run stopped, resumable, after 10 minutes with nothing admitted), then the
# server's counts, and each process's results and error rows by kind. Takes about 10-11 minutes.
#   WEIR_BIN=/path/to/weir [K=3] [N=20] bench/zero-quota-shared.sh [--no-advice]
set -u
BIN=${WEIR_BIN:-$(dirname "$0")/../target/release/weir}
K=${K:-3}; N=${N:-20}
W=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 "$(dirname "$0")/refserver.py" --listen "127.0.0.1:$PORT" --rpm 100 --window-secs 60 --zero-after 0 "$@" \
  > "$W/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; rm -rf "$W"' EXIT
sleep 1
export GEMINI_API_KEY=not-a-key WEIR_QUOTA_DIR="$W/quota"
start=$(date +%s.%N)
pids=()
for i in $(seq 1 "$K"); do
  python3 -c "
import json
for j in range($N): print(json.dumps({'id': f'$i-{j}', 'prompt': f'hello {j}'}))" > "$W/in$i.jsonl"
  ( "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" --input "$W/in$i.jsonl" \
      --output "$W/out$i.jsonl" --id-field id --no-cache > /dev/null 2> "$W/p$i.err"
    rc=$?
    kinds=$(python3 -c "
import collections, json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except FileNotFoundError:
    rows = []
print(', '.join(f'{k} {n}' for k, n in sorted(collections.Counter(r['kind'] for r in rows).items())) or 'none')" "$W/out$i.errors.jsonl")
    echo "process $i: exit $rc at $(python3 -c "print(round($(date +%s.%N)-$start,1))") s; $(cat "$W/out$i.jsonl" 2>/dev/null | wc -l) results; error rows: $kinds" ) &
  pids+=($!)
done
wait "${pids[@]}"
curl -s "http://127.0.0.1:$PORT/stats" | python3 -c "import json,sys; s=json.load(sys.stdin); print(f\"server: {s['requests']} requests, {s['rate_limited']} rate-limited\")"
