#!/usr/bin/env bash
# A run started just after another on the same key (issue #32, an outside tester's finding):
# `weir sim` with 100 requests per sliding 5-s window and whole-second advice, 0.3 s latency;
# run 1 decides alone (--quota-store off, so it writes nothing down), then runs 2-4 start
# 1.5 s after the one before, each with a fresh quota store of its own (nothing handed on), so
# each meets a window still holding the previous run's requests and learns the quota afresh.
# Prints each run's wall time, rate-limited calls and the limit it learned. Ideal: about 30 s
# for 600 records (6 windows of 100 after the first).
#   WEIR_BIN=/path/to/weir bench/back-to-back.sh [records]
set -euo pipefail
N=${1:-600}
BIN=${WEIR_BIN:-$(dirname "$0")/../target/release/weir}
WORK=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 - "$WORK/in.jsonl" "$N" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        f.write(json.dumps({"id": f"r{i}", "prompt": f"{i:08d} river stone water"}) + "\n")
PY
"$BIN" sim --listen "127.0.0.1:$PORT" --rpm 100 --window-secs 5 --round-advice --latency-ms 300 > "$WORK/sim.log" 2>&1 &
SIM=$!
trap 'kill $SIM 2>/dev/null; rm -rf "$WORK"' EXIT
sleep 1
for k in 1 2 3 4; do
  extra=()
  [ "$k" = 1 ] && extra=(--quota-store off)
  mkdir -p "$WORK/rt$k"
  sleep 1.5
  s=$(date +%s.%N)
  XDG_RUNTIME_DIR="$WORK/rt$k" "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" \
    --input "$WORK/in.jsonl" --output "$WORK/out$k.jsonl" --id-field id --no-state --progress never \
    --max-retries 50 "${extra[@]}" 2> "$WORK/err$k.log"
  e=$(date +%s.%N)
  echo "run $k ${extra[*]}: $(python3 -c "print(round($e-$s,1))") s; $(grep -o '[0-9,]* rate.limited' "$WORK/err$k.log" | head -1); $(grep -o '[0-9]* requests per [0-9.]* s' "$WORK/err$k.log")"
done
