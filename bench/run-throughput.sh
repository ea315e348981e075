#!/usr/bin/env bash
# Records per second through `weir run` against `weir sim` at zero latency, and weir's peak
# memory (max RSS from GNU time) as the input grows. The simulator runs as its own process
# (gemini/ via --base-url), so the RSS is weir's alone; the inproc row runs it in-process (sim/).
# With --id-field, weir keeps an 8-byte fingerprint per id to reject duplicates; with line-number
# ids it keeps nothing per record. Runs with --no-state (the journal's cost is bench/journal.sh's
# subject) and --concurrency fixed (64 calls in flight).
# Usage: bench/run-throughput.sh [SIZES...]   (default: 100000 1000000)
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${*:-100000 1000000}
REPEAT=${REPEAT:-3}
source bench/common.sh
printf "%-10s %-15s %9s %10s %13s\n" records mode "median s" "records/s" "peak RSS MiB"
for n in $SIZES; do
  python3 - "$n" "$WORK/in-$n.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
topics = ["rivers", "bread", "the moon", "glaciers", "bees", "lighthouses", "tea", "volcanoes"]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"r{i}", "prompt": f"Write one sentence about {topics[i % 8]} number {i}."}) + "\n")
PY
  for mode in ext+idfield ext+lineids inproc+idfield; do
    case $mode in
      ext+idfield) args=(--model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" --id-field id) ;;
      ext+lineids) args=(--model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT") ;;
      inproc+idfield) args=(--model sim/bench --id-field id) ;;
    esac
    times=(); rss=()
    for _ in $(seq "$REPEAT"); do
      /usr/bin/time -f "%e %M" -o "$WORK/time" "$BIN" run "${args[@]}" --input "$WORK/in-$n.jsonl" \
        --output "$WORK/out.jsonl" --max-concurrency 64 --concurrency fixed --no-state --overwrite --progress never 2>/dev/null
      read -r secs kb < "$WORK/time"
      lines=$(wc -l < "$WORK/out.jsonl")
      [ "$lines" -eq "$n" ] || { echo "expected $n result rows, got $lines" >&2; exit 1; }
      times+=("$secs"); rss+=("$kb")
    done
    med_t=$(printf "%s\n" "${times[@]}" | sort -n | sed -n "$(( (REPEAT + 1) / 2 ))p")
    med_m=$(printf "%s\n" "${rss[@]}" | sort -n | sed -n "$(( (REPEAT + 1) / 2 ))p")
    printf "%-10s %-15s %9s %10.0f %13.1f\n" "$n" "$mode" "$med_t" "$(echo "$n / $med_t" | bc -l)" "$(echo "$med_m / 1024" | bc -l)"
  done
done
