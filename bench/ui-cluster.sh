#!/usr/bin/env bash
# Issue #36 on a cluster: what the executors' always-on watch costs, and the scheduler's page.
# Every executor samples its calls once a second and reports to the scheduler every 2 s, page or
# no page, so its cost is paid by every cluster. It does not depend on the records going
# through (a sample reads counters the calls keep anyway), so it is measured where it is all
# there is: the CPU time an idle executor and scheduler take over IDLE seconds (default 60),
# read from /proc. That is an upper bound of the watch's cost (Ballista's own polling and
# heartbeats are in it too).
# Then, with a `weir sim` quota of 100 requests per 5 s, three executors answer 3,000 rows while
# the scheduler's page is open; SHOT=FILE.png saves what headless Chromium shows a minute in.
# Usage: bench/ui-cluster.sh   (WEIR_BENCH_BIN=PATH: a weir built with --features cluster)
set -euo pipefail
cd "$(dirname "$0")/.."
IDLE=${IDLE:-60}
if [ -n "${WEIR_BENCH_BIN:-}" ]; then
  BIN=$(realpath "$WEIR_BENCH_BIN")
else
  cargo build --release -q -p weir --features cluster
  BIN=$(realpath "${CARGO_TARGET_DIR:-target}/release/weir")
fi
WORK=$(mktemp -d)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; rm -rf "$WORK"' EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 200); do (echo > "/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.05; done; echo "nothing on $1" >&2; exit 1; }
# A scheduler port whose quota service (the port below) is free too.
sched_port() { while :; do p=$(port); python3 -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1',$p-1))" 2>/dev/null && { echo "$p"; return; }; done; }
# CPU seconds (user + system) a process has taken.
cpu() { awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$1/stat"; }
# The same, of its threads named tokio-rt-worker (where the page, the reports and their gathering
# run): Ballista's scheduler also keeps a thread that wakes every millisecond (ferroid's clock,
# for its job ids), which is Ballista's cost whatever weir does.
tokio_cpu() {
  local total=0 t
  for t in /proc/"$1"/task/*; do
    [ "$(cat "$t/comm")" = tokio-rt-worker ] && total=$(awk -v hz="$(getconf CLK_TCK)" -v s="$total" '{ print s + ($14 + $15) / hz }' "$t/stat")
  done
  echo "$total"
}

cd "$WORK"  # the cluster reads and writes under the directory its scheduler started in
SIM_PORT=$(port)
"$BIN" sim --listen "127.0.0.1:$SIM_PORT" --rpm 100 --window-secs 5 --round-advice --window fixed \
  --latency-ms 300 --jitter-ms 200 > /dev/null 2>&1 &
PIDS+=($!)
SCHED=$(sched_port); UI=$(port)
"$BIN" cluster scheduler --bind "127.0.0.1:$SCHED" --ui "127.0.0.1:$UI" 2> "$WORK/sched.log" &
SCHED_PID=$!; PIDS+=($SCHED_PID)
wait_port "$SCHED"; wait_port "$UI"
EXEC_PIDS=()
for e in 0 1 2; do
  p=$(port); g=$(port)
  "$BIN" cluster executor --scheduler "127.0.0.1:$SCHED" --work-dir "$WORK/work" --port "$p" --grpc-port "$g" \
    --slots 2 --base-url "http://127.0.0.1:$SIM_PORT" 2> "$WORK/ex$e.log" &
  EXEC_PIDS+=($!); PIDS+=($!)
  wait_port "$p"
done
sleep 5
e0=$(cpu "${EXEC_PIDS[0]}"); s0=$(cpu "$SCHED_PID"); r0=$(tokio_cpu "$SCHED_PID")
sleep "$IDLE"
e1=$(cpu "${EXEC_PIDS[0]}"); s1=$(cpu "$SCHED_PID"); r1=$(tokio_cpu "$SCHED_PID")
heard=$(curl -s "http://127.0.0.1:$UI/api/update" | python3 -c 'import json,sys; print(json.load(sys.stdin)["summary"]["state"])')
printf "idle for %s s (%s): an executor took %.2f s of CPU (%.2f %% of a core); the scheduler %.2f s (%.2f %%), of which its tokio threads %.2f s (%.2f %%)\n" \
  "$IDLE" "$heard" "$(echo "$e1 - $e0" | bc -l)" "$(echo "100 * ($e1 - $e0) / $IDLE" | bc -l)" \
  "$(echo "$s1 - $s0" | bc -l)" "$(echo "100 * ($s1 - $s0) / $IDLE" | bc -l)" \
  "$(echo "$r1 - $r0" | bc -l)" "$(echo "100 * ($r1 - $r0) / $IDLE" | bc -l)"

# A query, with the page open.
python3 - <<'PY'
import json
with open("in.jsonl", "w") as f:
    for i in range(3000):
        f.write(json.dumps({"key": f"r{i}", "n": i, "prompt": f"Describe product number {i} in one sentence."}) + "\n")
PY
mkdir -p parts
for i in 0 1 2 3; do "$BIN" sql "COPY (SELECT * FROM 'in.jsonl' WHERE n % 4 = $i) TO 'parts/p$i.parquet'" > /dev/null; done
start=$(date +%s.%N)
"$BIN" sql --cluster "df://127.0.0.1:$SCHED" --partitions 4 --table reviews=parts \
  "COPY (SELECT key, llm_generate('gemini/gemini-2.5-flash', prompt) AS answer FROM reviews) TO 'answers.jsonl'" \
  > sql.log 2>&1 &
QUERY=$!; PIDS+=($QUERY)
if [ -n "${SHOT:-}" ] && command -v chromium > /dev/null; then
  sleep 60
  chromium --headless --no-sandbox --disable-gpu --no-first-run --disable-dev-shm-usage --user-data-dir="$WORK/chromium" \
    --hide-scrollbars --window-size=1300,1700 --virtual-time-budget=3000 --screenshot="$SHOT" \
    "http://127.0.0.1:$UI/" 2> /dev/null
  echo "the page a minute in: $SHOT"
fi
wait "$QUERY" || { echo "the query failed:" >&2; cat sql.log >&2; exit 1; }
secs=$(echo "$(date +%s.%N) - $start" | bc -l)
sleep 6  # the last reports: an executor samples every second and reports every 2 s, the page sums every 2 s
sim_calls=$(curl -s "http://127.0.0.1:$SIM_PORT/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["requests"])')
echo "the simulator saw $sim_calls calls"
curl -s "http://127.0.0.1:$UI/api/update" | python3 -c '
import json, sys
s = json.load(sys.stdin)["summary"]
done, calls, refused, state = s["done"], s["calls"], s["rate_limited"], s["state"]
print(f"3,000 rows in {float(sys.argv[1]):.1f} s (ideal 150 s): the page shows {done} done, {calls} calls, {refused} 429s, {state}")' "$secs"
echo "rows written: $(wc -l < answers.jsonl)"
