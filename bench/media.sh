#!/usr/bin/env bash
# Records with an image each (issue #35): `weir run --media-field image` against `weir sim` at
# zero latency, next to the same records as text, as the input grows. Each record names its own
# 20 KB file (a PNG signature, then random bytes), read when the record is sent and let go with
# its answer, so memory should follow the records in flight, not the dataset. The simulator
# (its own process) decodes every part and counts them.
# Usage: bench/media.sh [SIZES...]   (default: 10000 100000)
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${*:-10000 100000}
REPEAT=${REPEAT:-3}
source bench/common.sh
command -v /usr/bin/time >/dev/null || { echo "needs GNU time (apt-get install time)" >&2; exit 1; }
printf "%-8s %-6s %9s %10s %13s %12s\n" records mode "median s" "records/s" "peak RSS MiB" "parts seen"
for n in $SIZES; do
  python3 bench/media-input.py "$n" "$WORK"
  for mode in text media; do
    extra=(); [ "$mode" = media ] && extra=(--media-field image)
    times=(); rss=()
    for _ in $(seq "$REPEAT"); do
      before=$(curl -s "http://127.0.0.1:$PORT/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["media_parts"])')
      /usr/bin/time -f "%e %M" -o "$WORK/time" "$BIN" run --model gemini/gemini-2.5-flash \
        --base-url "http://127.0.0.1:$PORT" --id-field id --input "$WORK/in-$n.jsonl" --output "$WORK/out.jsonl" \
        --max-concurrency 64 --concurrency fixed --no-state --no-cache --overwrite --progress never "${extra[@]}" 2>/dev/null
      after=$(curl -s "http://127.0.0.1:$PORT/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["media_parts"])')
      read -r secs kb < "$WORK/time"
      lines=$(wc -l < "$WORK/out.jsonl")
      [ "$lines" -eq "$n" ] || { echo "expected $n result rows, got $lines" >&2; exit 1; }
      times+=("$secs"); rss+=("$kb")
    done
    med_t=$(printf "%s\n" "${times[@]}" | sort -n | sed -n "$(( (REPEAT + 1) / 2 ))p")
    med_m=$(printf "%s\n" "${rss[@]}" | sort -n | sed -n "$(( (REPEAT + 1) / 2 ))p")
    printf "%-8s %-6s %9.2f %10.0f %13.1f %12s\n" "$n" "$mode" "$med_t" "$(echo "$n / $med_t" | bc -l)" \
      "$(echo "$med_m / 1024" | bc -l)" "$((after - before))"
  done
done
