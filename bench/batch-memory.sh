#!/usr/bin/env bash
# Peak memory of a batch-job run (`--mode batch`, openai/ against `weir sim`'s Batch API) next
# to the same records run online, as the input grows: a batch run holds each record it has not
# settled until its job's answers are in, an online run only those in flight.
# Usage: bench/batch-memory.sh [SIZES...]   (default: 100000 1000000)
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${*:-100000 1000000}
source bench/common.sh
command -v /usr/bin/time >/dev/null || { echo "needs GNU time (apt-get install time)" >&2; exit 1; }
printf "%-9s %-8s %9s %12s %6s\n" records mode seconds "peak RSS MiB" jobs
for n in $SIZES; do
  python3 - "$n" "$WORK/in-$n.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"r{i}", "prompt": f"Write one sentence about river number {i}."}) + "\n")
PY
  for mode in online batch; do
    dir="$WORK/$mode-$n"
    rm -rf "$dir" && mkdir -p "$dir"
    extra=()
    [ "$mode" = batch ] && extra=(--mode batch --poll-secs 0.5)
    before=$(curl -s "http://127.0.0.1:$PORT/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["batch_jobs"])')
    start=$(date +%s.%N)
    OPENAI_API_KEY=sk-bench /usr/bin/time -f "%M" -o "$dir/rss" "$BIN" run --model openai/gpt-4o-mini \
      --base-url "http://127.0.0.1:$PORT/v1" --input "$WORK/in-$n.jsonl" --output "$dir/out.jsonl" \
      --id-field id --progress never "${extra[@]}" 2>/dev/null
    end=$(date +%s.%N)
    after=$(curl -s "http://127.0.0.1:$PORT/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["batch_jobs"])')
    [ "$(wc -l < "$dir/out.jsonl")" -eq "$n" ] || { echo "$mode $n: wrong row count" >&2; exit 1; }
    printf "%-9s %-8s %9.1f %12.1f %6s\n" "$n" "$mode" "$(echo "$end - $start" | bc -l)" \
      "$(echo "$(cat "$dir/rss") / 1024" | bc -l)" "$((after - before))"
    rm -rf "$dir"
  done
  rm -f "$WORK/in-$n.jsonl"
done
