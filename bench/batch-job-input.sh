#!/usr/bin/env bash
# Peak memory of a batch run whose one job is large (issue #34): N records of a long prompt,
# all in one job, through the OpenAI Batch API (a multipart file upload) and the Gemini API's
# Files API (a resumable upload) of `weir sim`. A job's input is streamed from its spool on the
# disk as it is uploaded, so memory does not grow with the job's size.
# Usage: bench/batch-job-input.sh [RECORDS] [PROMPT_BYTES]     (default: 45000 4000, a 180 MB job)
#        BINS="old=/tmp/weir-old new=/tmp/weir-new" bench/batch-job-input.sh   (builds side by side)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-45000}
BYTES=${2:-4000}
if [ -z "${BINS:-}" ]; then
  source bench/common.sh
  BINS="this=$BIN"
else
  WEIR_BENCH_BIN=${BINS##*=} source bench/common.sh
fi
command -v /usr/bin/time >/dev/null || { echo "needs GNU time (apt-get install time)" >&2; exit 1; }
python3 - "$N" "$BYTES" "$WORK/in.jsonl" <<'PY'
import json, sys
n, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with open(path, "w") as f:
    for i in range(n):
        head = f"Summarise document {i}: "
        f.write(json.dumps({"id": f"r{i}", "prompt": head + "lorem ipsum " * ((size - len(head)) // 12)}) + "\n")
PY
echo "input: $N records, $(du -m "$WORK/in.jsonl" | cut -f1) MB"
printf "%-8s %-8s %8s %12s %5s\n" binary model seconds "peak RSS MiB" jobs
for model in openai/gpt-4o-mini gemini/gemini-2.5-flash; do
  for pair in $BINS; do
    label=${pair%%=*}; bin=${pair#*=}
    dir="$WORK/run" && rm -rf "$dir" && mkdir -p "$dir"
    base="http://127.0.0.1:$PORT"; [ "${model%%/*}" = openai ] && base="$base/v1"
    before=$(curl -s "http://127.0.0.1:$PORT/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["batch_jobs"])')
    start=$(date +%s.%N)
    OPENAI_API_KEY=sk-bench GEMINI_API_KEY=bench /usr/bin/time -f "%M" -o "$dir/rss" "$bin" run --model "$model" \
      --base-url "$base" --input "$WORK/in.jsonl" --output "$dir/out.jsonl" --id-field id --progress never \
      --mode batch --poll-secs 0.5 --job-max-requests "$N" 2>"$dir/err" || { cat "$dir/err" >&2; exit 1; }
    end=$(date +%s.%N)
    after=$(curl -s "http://127.0.0.1:$PORT/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["batch_jobs"])')
    [ "$(wc -l < "$dir/out.jsonl")" -eq "$N" ] || { echo "$label $model: wrong row count" >&2; exit 1; }
    printf "%-8s %-8s %8.1f %12.1f %5s\n" "$label" "${model%%/*}" "$(echo "$end - $start" | bc -l)" \
      "$(echo "$(cat "$dir/rss") / 1024" | bc -l)" "$((after - before))"
  done
done
