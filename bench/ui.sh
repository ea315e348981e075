#!/usr/bin/env bash
# Issue #36: what watching a run costs. Records per second through `weir run` against `weir sim`
# at zero latency, without the watch (`--no-report`, no `--ui`) and with it (`--ui`, the report
# written at the end, and the live page's requests made while the run goes: the page itself
# once, then /api/update every 2 s as an open page asks, and a full reload every 10 s). The
# browser is not run beside it: on 2 cores it would take CPU from weir and the simulator,
# which is the machine's cost, not weir's. Runs alternate (A B A B …) and the medians are
# compared. Then the series a 10^6-record run keeps: its points and the size of its saved file.
# Usage: bench/ui.sh [RECORDS]   (default: 200000; REPEAT=5 runs of each)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-200000}
REPEAT=${REPEAT:-5}
source bench/common.sh
python3 - "$N" "$WORK/in.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"r{i}", "prompt": f"Write one sentence about bees number {i}."}) + "\n")
PY
args=(--model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" --id-field id --input "$WORK/in.jsonl"
      --output "$WORK/out.jsonl" --max-concurrency 64 --concurrency fixed --no-state --overwrite --progress never)
# The open page's requests, until the run's page stops answering.
page() {
  local url=$1 n=0
  curl -sf "$url" -o /dev/null || return 0
  while sleep 2; do
    n=$((n + 1))
    curl -sf "${url}api/update?since=0" -o /dev/null || return 0
    if [ $((n % 5)) -eq 0 ]; then curl -sf "$url" -o /dev/null || return 0; fi
  done
}
off=(); on=()
for _ in $(seq "$REPEAT"); do
  /usr/bin/time -f "%e" -o "$WORK/time" "$BIN" run "${args[@]}" --no-report 2>/dev/null
  off+=("$(cat "$WORK/time")")
  UI=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  ( sleep 0.3; page "http://127.0.0.1:$UI/" ) &
  POLL=$!
  /usr/bin/time -f "%e" -o "$WORK/time" "$BIN" run "${args[@]}" --ui "127.0.0.1:$UI" 2>/dev/null
  on+=("$(cat "$WORK/time")")
  kill $POLL 2>/dev/null || true; wait $POLL 2>/dev/null || true
  [ -s "$WORK/out.jsonl.report.html" ] || { echo "no report written" >&2; exit 1; }
done
med() { printf "%s\n" "$@" | sort -n | sed -n "$(( (${#@} + 1) / 2 ))p"; }
m_off=$(med "${off[@]}"); m_on=$(med "${on[@]}")
echo "runs (s) without: ${off[*]}"
echo "runs (s) with --ui, page open: ${on[*]}"
printf "%-34s %9s %10s\n" mode "median s" "records/s"
printf "%-34s %9s %10.0f\n" "no watch (--no-report)" "$m_off" "$(echo "$N / $m_off" | bc -l)"
printf "%-34s %9s %10.0f\n" "--ui, page open, report written" "$m_on" "$(echo "$N / $m_on" | bc -l)"
printf "ratio with/without (records/s): %.3f\n" "$(echo "$m_off / $m_on" | bc -l)"

# The series of a 10^6-record run, kept in its state directory.
python3 - 1000000 "$WORK/big.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"r{i}", "prompt": f"One line about tea number {i}."}) + "\n")
PY
/usr/bin/time -f "%e %M" -o "$WORK/time" "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" \
  --id-field id --input "$WORK/big.jsonl" --output "$WORK/big-out.jsonl" --max-concurrency 64 --concurrency fixed \
  --progress never 2>/dev/null
read -r secs kb < "$WORK/time"
series="$WORK/.weir/runs/big-out.jsonl.series.json"
points=$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["columns"]["t"]))' "$series")
echo "10^6 records in $secs s (peak RSS $(( kb / 1024 )) MiB): $points points kept, saved series $(stat -c %s "$series") bytes, report $(stat -c %s "$WORK/big-out.jsonl.report.html") bytes"
echo "points are capped at 2048 (19 values each, 16 bytes a value in memory): at most $(( 2048 * 19 * 16 / 1024 )) KiB, whatever the run's length"
