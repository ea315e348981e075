#!/usr/bin/env bash
# Peak memory and records/s of `weir run` with its defaults (journal and response cache on)
# against --no-state, side by side, as the input grows: issue #9 asks for peak RSS at the
# largest size within 1.5× of the smallest, and the default mode at ≥ 0.8× of --no-state.
# Zero latency, `weir sim` in its own process (so the RSS is weir's alone), GNU time's maximum
# resident set size. Usage: bench/state-memory.sh [SIZES...]   (default: 100000 1000000)
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${*:-100000 1000000}
source bench/common.sh
command -v /usr/bin/time >/dev/null || { echo "needs GNU time (apt-get install time)" >&2; exit 1; }
printf "%-9s %-15s %9s %11s %12s %12s\n" records mode "seconds" "records/s" "peak RSS MiB" "state MiB"
for n in $SIZES; do
  python3 - "$n" "$WORK/in-$n.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"r{i}", "prompt": f"Write one sentence about river number {i}."}) + "\n")
PY
  for mode in no-state default default-lineids; do
    dir="$WORK/$mode-$n"
    mkdir -p "$dir"
    extra=(--id-field id)
    [ "$mode" = no-state ] && extra=(--id-field id --no-state)
    # Line numbers as ids: nothing is kept per record to reject duplicate ids.
    [ "$mode" = default-lineids ] && extra=()
    start=$(date +%s.%N)
    /usr/bin/time -f "%M" -o "$dir/rss" "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" \
      --input "$WORK/in-$n.jsonl" --output "$dir/out.jsonl" --progress never "${extra[@]}" 2>/dev/null
    end=$(date +%s.%N)
    [ "$(wc -l < "$dir/out.jsonl")" -eq "$n" ] || { echo "$mode $n: wrong row count" >&2; exit 1; }
    secs=$(echo "$end - $start" | bc -l)
    state=$( [ -d "$dir/.weir" ] && du -sm "$dir/.weir" | cut -f1 || echo 0)
    printf "%-9s %-15s %9.2f %11.0f %12.1f %12s\n" "$n" "$mode" "$secs" "$(echo "$n / $secs" | bc -l)" \
      "$(echo "$(cat "$dir/rss") / 1024" | bc -l)" "$state"
  done
  rm -f "$WORK/in-$n.jsonl"
done
