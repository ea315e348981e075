#!/usr/bin/env bash
# Requests per second that `weir sim` serves on 127.0.0.1 at zero latency, non-streaming,
# measured with wrk (Debian package `wrk`) over keep-alive connections.
# Usage: bench/sim-rps.sh [DURATION_SECS] [CONNECTIONS]
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-10}
CONNS=${2:-64}
command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk" >&2; exit 2; }
source bench/common.sh
LUA="$WORK/post.lua"
for route in openai gemini; do
  if [ $route = openai ]; then
    path=/v1/chat/completions
    body='{"model":"sim-1","messages":[{"role":"user","content":"Write one sentence about rivers."}]}'
  else
    path=/v1beta/models/gemini-2.5-flash:generateContent
    body='{"contents":[{"role":"user","parts":[{"text":"Write one sentence about rivers."}]}]}'
  fi
  cat > "$LUA" <<LUA
wrk.method = "POST"
wrk.body   = '$body'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer bench"
wrk.headers["x-goog-api-key"] = "bench"
LUA
  echo "== $route: POST $path, $CONNS connections, 2 wrk threads, ${DURATION}s"
  wrk -t2 -c"$CONNS" -d"${DURATION}s" -s "$LUA" "http://127.0.0.1:$PORT$path" | grep -E "Requests/sec|Latency|Non-2xx|requests in"
done
echo "== server-side count"
curl -s "http://127.0.0.1:$PORT/stats" | python3 -c 'import json,sys; s=json.load(sys.stdin); print("requests", s["requests"], "successes", s["successes"])'
