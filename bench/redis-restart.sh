#!/usr/bin/env bash
# Redis down and back mid-run (issue #32): three runs on one machine told `--rpm 60
# --limit-window 5`, sharing through a Redis server of their own; Redis is killed DOWN seconds in
# (default 5) and started again on the same port UP seconds later (default 5). `weir sim` allows
# 100 per 5-s window, so only the runs' sharing keeps them to 60. Prints each run's summary line,
# the simulator's successes and 429s per second, and the most successes in any 5 s (told: 60;
# a fixed window's 60 can sit either side of a boundary, so up to 120 would be a 5-s span of
# two full windows — compare the per-second rows with the windows). HANG=1 stops Redis with
# SIGSTOP instead and resumes it with SIGCONT UP seconds later: a server that hangs (or a network
# that drops its packets) rather than one that refuses connections. KILL_FIRST=S kills the
# first run (the one that usually holds the quota) with SIGKILL S seconds after Redis goes.
# APART=1 gives each run a meeting directory of its own, as on three machines.
#   WEIR_BIN=/path/to/weir [DOWN=5] [UP=5] [N=150] [HANG=1] [KILL_FIRST=S] [APART=1] bench/redis-restart.sh   (needs redis-server)
set -euo pipefail
BIN=${WEIR_BIN:-$(dirname "$0")/../target/release/weir}
REDIS=${WEIR_REDIS_SERVER:-redis-server}
WORK=$(mktemp -d)
free() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free); RP=$(free)
"$BIN" sim --listen "127.0.0.1:$PORT" --rpm 100 --window-secs 5 --round-advice --latency-ms 300 > "$WORK/sim.log" 2>&1 &
SIM=$!
"$REDIS" --port "$RP" --bind 127.0.0.1 --save "" --appendonly no > "$WORK/redis.log" 2>&1 &
RS=$!
trap 'kill $SIM $RS 2>/dev/null; rm -rf "$WORK"' EXIT
sleep 1
mkdir -m 700 "$WORK/meet" "$WORK/meet1" "$WORK/meet2" "$WORK/meet3"
pids=()
for p in 1 2 3; do
  python3 -c "
import json
for i in range(${N:-150}): print(json.dumps({'id': 'p$p-%d' % i, 'prompt': 'p$p %06d river stone' % i}))" > "$WORK/in$p.jsonl"
  WEIR_QUOTA_DIR="$WORK/meet${APART:+$p}" "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" \
    --input "$WORK/in$p.jsonl" --output "$WORK/out$p.jsonl" --id-field id --no-state --progress never --max-retries 50 \
    --rpm 60 --limit-window 5 --quota-store "redis://127.0.0.1:$RP" 2> "$WORK/err$p" &
  pids+=($!)
done
sleep "${DOWN:-5}"
# Sleeps UP seconds, killing the first run KILL_FIRST seconds in.
pause() {
  if [ -n "${KILL_FIRST:-}" ]; then
    sleep "$KILL_FIRST"; kill -9 "${pids[0]}"; sleep "$(python3 -c "print(max(0, ${UP:-5} - $KILL_FIRST))")"
  else
    sleep "${UP:-5}"
  fi
}
if [ -n "${HANG:-}" ]; then
  kill -STOP "$RS"; pause; kill -CONT "$RS"
else
  kill "$RS"; wait "$RS" 2>/dev/null || true
  pause
  "$REDIS" --port "$RP" --bind 127.0.0.1 --save "" --appendonly no > "$WORK/redis2.log" 2>&1 &
  RS=$!
fi
wait "${pids[@]}" || true
for p in 1 2 3; do grep -h "records in" "$WORK/err$p" || echo "run $p: killed"; done
curl -s "http://127.0.0.1:$PORT/stats" | python3 -c "
import json, sys
d = json.load(sys.stdin); ok = d['successes_per_second']
print('successes per second', ok); print('429s per second', d['rate_limited_per_second'])
print('most successes in any 5 s:', max(sum(ok[i:i + 5]) for i in range(len(ok))))"
