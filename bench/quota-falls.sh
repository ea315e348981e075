#!/usr/bin/env bash
# A quota that falls to zero under a run that has learned it: bench/refserver.py with 100 requests
# per 60-s window, 429s that advise no wait (as Vertex AI's), admitting nothing from 5 s after
# its start. A run of 300 records (--quota-store off) is stopped with SIGINT after STOP seconds
# (150). Prints weir's summary and the server's requests and 429s, those after 60 s per second.
#   WEIR_BIN=/path/to/weir [STOP=150] bench/quota-falls.sh
set -u
BIN=${WEIR_BIN:-$(dirname "$0")/../target/release/weir}
W=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 -c "
import json
with open('$W/z.jsonl', 'w') as f:
    for i in range(300):
        f.write(json.dumps({'id': f'z{i}', 'prompt': f'z {i} stone'}) + '\n')"
python3 "$(dirname "$0")/refserver.py" --listen "127.0.0.1:$PORT" --rpm 100 --window-secs 60 --latency-ms 300 \
  --no-advice --zero-after 5 > "$W/sim.log" 2>&1 &
SIM=$!
trap 'kill $SIM 2>/dev/null; rm -rf "$W"' EXIT
sleep 1
(cd "$W" && timeout -s INT "${STOP:-150}" "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" \
  --input z.jsonl --output z.out --id-field id --progress never --quota-store off 2> run.err)
grep -E "^weir: [0-9]|calls " "$W/run.err"
curl -s "http://127.0.0.1:$PORT/stats" | python3 -c "
import json, sys
s = json.load(sys.stdin); r = s['rate_limited_per_second']
print(f\"{s['requests']} requests, {s['rate_limited']} rate-limited; {sum(r[60:])} after 60 s: {r[60:75]} a second\")"
