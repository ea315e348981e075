#!/usr/bin/env bash
# Peak memory of a batch-job run (`--mode batch`, openai/ against `weir sim`'s Batch API) as
# the input grows, next to the same records online: a batch run spools the records waiting for
# a job to its state directory and holds only the chunk being cut and the job being collected.
# Also the state directory's size: its peak during the run (spools, ledger, cache, journal)
# and what is left at the end (the spools are removed once every row is written).
# Usage: bench/batch-memory.sh [SIZES...]   (default: 100000 1000000)
#        MODES="batch" bench/batch-memory.sh 10000000   (skip the online runs)
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${*:-100000 1000000}
MODES=${MODES:-online batch}
source bench/common.sh
command -v /usr/bin/time >/dev/null || { echo "needs GNU time (apt-get install time)" >&2; exit 1; }
printf "%-9s %-7s %8s %12s %5s %15s %14s\n" records mode seconds "peak RSS MiB" jobs "state peak MiB" "state end MiB"
for n in $SIZES; do
  python3 - "$n" "$WORK/in-$n.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"r{i}", "prompt": f"Write one sentence about river number {i}."}) + "\n")
PY
  for mode in $MODES; do
    dir="$WORK/$mode-$n"
    rm -rf "$dir" && mkdir -p "$dir"
    extra=()
    [ "$mode" = batch ] && extra=(--mode batch --poll-secs 0.5)
    before=$(curl -s "http://127.0.0.1:$PORT/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["batch_jobs"])')
    # The state directory's size, sampled every second while the run goes.
    ( peak=0; while true; do s=$(du -sb "$dir/.weir" 2>/dev/null | cut -f1) || true; s=${s:-0};
        if [ "$s" -gt "$peak" ]; then peak=$s; echo "$peak" > "$dir/state-peak"; fi; sleep 1; done ) &
    sampler=$!
    start=$(date +%s.%N)
    OPENAI_API_KEY=sk-bench /usr/bin/time -f "%M" -o "$dir/rss" "$BIN" run --model openai/gpt-4o-mini \
      --base-url "http://127.0.0.1:$PORT/v1" --input "$WORK/in-$n.jsonl" --output "$dir/out.jsonl" \
      --id-field id --progress never "${extra[@]}" 2>/dev/null
    end=$(date +%s.%N)
    kill $sampler 2>/dev/null; wait $sampler 2>/dev/null || true
    after=$(curl -s "http://127.0.0.1:$PORT/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["batch_jobs"])')
    [ "$(wc -l < "$dir/out.jsonl")" -eq "$n" ] || { echo "$mode $n: wrong row count" >&2; exit 1; }
    state_end=$(du -sb "$dir/.weir" | cut -f1)
    state_peak=$(cat "$dir/state-peak" 2>/dev/null || echo 0)
    if [ "$state_end" -gt "$state_peak" ]; then state_peak=$state_end; fi
    printf "%-9s %-7s %8.1f %12.1f %5s %15.1f %14.1f\n" "$n" "$mode" "$(echo "$end - $start" | bc -l)" \
      "$(echo "$(cat "$dir/rss") / 1024" | bc -l)" "$((after - before))" \
      "$(echo "$state_peak / 1048576" | bc -l)" "$(echo "$state_end / 1048576" | bc -l)"
    rm -rf "$dir"
  done
  rm -f "$WORK/in-$n.jsonl"
done
