#!/usr/bin/env bash
# A Gemini API batch run (`gemini/` against `weir sim`) of N short records (default 10^6): how
# many jobs it made, how many of them from uploaded files (the Files API's resumable protocol,
# which the simulator checks: a malformed upload is refused), and every record once.
# Usage: bench/batch-gemini-files.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000000}
source bench/common.sh
python3 - "$N" "$WORK/in.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"r{i}", "prompt": f"Write one sentence about river number {i}."}) + "\n")
PY
start=$(date +%s.%N)
GEMINI_API_KEY=bench /usr/bin/time -f "%M" -o "$WORK/rss" "$BIN" run --model gemini/gemini-2.5-flash \
  --base-url "http://127.0.0.1:$PORT" --input "$WORK/in.jsonl" --output "$WORK/out.jsonl" --id-field id \
  --progress never --mode batch --poll-secs 0.5 2>"$WORK/err"
end=$(date +%s.%N)
rows=$(wc -l < "$WORK/out.jsonl")
ids=$(python3 -c "import json,sys; print(len({json.loads(l)['id'] for l in open(sys.argv[1])}))" "$WORK/out.jsonl")
curl -s "http://127.0.0.1:$PORT/stats" | python3 -c '
import json, sys
s = json.load(sys.stdin)
keys = ["batch_jobs", "gemini_files_uploaded", "gemini_upload_refusals", "batch_keys", "batch_keys_in_two_jobs", "successes"]
print("jobs {}, from uploaded files {} (uploads refused {}), keys in jobs {}, keys in two jobs {}, online calls {}".format(*[s[k] for k in keys]))'
printf "records %s: %s rows, %s distinct ids; %.1f s; peak RSS %.1f MiB\n" "$N" "$rows" "$ids" \
  "$(echo "$end - $start" | bc -l)" "$(echo "$(cat "$WORK/rss") / 1024" | bc -l)"
grep -E "batch jobs:" "$WORK/err" || true
