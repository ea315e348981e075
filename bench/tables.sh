#!/usr/bin/env bash
# Tables (issue #12), two measurements against `weir sim` at zero latency in its own process:
#  1. records/s of one input written as a JSONL file, a Parquet table and a CSV table (default
#     settings: journal and response cache on), the modes interleaved in each round, medians;
#  2. peak RSS (GNU time) reading a Parquet input of 10^5 and of 10^6 rows (row groups of 65,536
#     rows, as Spark and DuckDB write them), JSONL output, no --id-field: is memory flat in the
#     input's size?
# Needs pyarrow to write the Parquet inputs: run scripts/setup-peers first (it installs it).
# Usage: bench/tables.sh [RECORDS_FOR_1] (default 100000; ROUNDS=3).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-100000}
ROUNDS=${ROUNDS:-3}
source bench/common.sh
command -v /usr/bin/time >/dev/null || { echo "needs GNU time (apt-get install time)" >&2; exit 1; }
# shellcheck disable=SC1090
source "${WEIR_CACHE:-$HOME/.cache/weir}/peers.env"
MODEL=(--model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" --progress never)

python3 - "$N" "$WORK/in.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"r{i}", "topic": f"t{i % 97}", "prompt": f"Write one sentence about river number {i}."}) + "\n")
PY

echo "1. Output formats: $N records, $ROUNDS rounds"
printf "%-8s %9s %11s %9s %12s\n" output "median s" "records/s" "vs jsonl" "peak RSS MiB"
: > "$WORK/times"
for round in $(seq "$ROUNDS"); do
  for fmt in jsonl parquet csv; do
    dir="$WORK/out-$fmt"
    rm -rf "$dir" && mkdir -p "$dir"
    start=$(date +%s.%N)
    /usr/bin/time -f "%M" -o "$dir.rss" "$BIN" run "${MODEL[@]}" --input "$WORK/in.jsonl" \
      --output "$dir/out.$fmt" --id-field id 2>/dev/null
    end=$(date +%s.%N)
    echo "$fmt $(echo "$end - $start" | bc -l) $(cat "$dir.rss")" >> "$WORK/times"
  done
done
"$WEIR_PYTHON" - "$N" "$WORK" <<'PY'
import glob, statistics as st, sys, pyarrow.parquet as pq, pyarrow.csv as pc
n, work = int(sys.argv[1]), sys.argv[2]
# Every run wrote every record.
assert pq.read_table(f"{work}/out-parquet/out.parquet").num_rows == n
assert sum(pc.read_csv(p).num_rows for p in glob.glob(f"{work}/out-csv/out.csv/part-*.csv")) == n
assert sum(1 for _ in open(f"{work}/out-jsonl/out.jsonl")) == n
rows = [l.split() for l in open(f"{work}/times")]
base = None
for m in ("jsonl", "parquet", "csv"):
    secs = [float(r[1]) for r in rows if r[0] == m]
    rss = [int(r[2]) / 1024 for r in rows if r[0] == m]
    med = st.median(secs)
    base = base or med
    print(f"{m:<8} {med:9.2f} {n / med:11.0f} {base / med:9.2f} {st.median(rss):12.1f}"
          f"   (runs: {' '.join(f'{s:.1f}' for s in secs)})")
PY

echo "2. Parquet input, peak memory"
printf "%-9s %9s %11s %12s\n" rows "seconds" "records/s" "peak RSS MiB"
for rows in 100000 1000000; do
  "$WEIR_PYTHON" - "$rows" "$WORK/in-$rows.parquet" <<'PY'
import sys, pyarrow as pa, pyarrow.parquet as pq
n, path = int(sys.argv[1]), sys.argv[2]
t = pa.table({
    "id": [f"r{i}" for i in range(n)],
    "topic": [f"t{i % 97}" for i in range(n)],
    "prompt": [f"Write one sentence about river number {i}." for i in range(n)],
})
pq.write_table(t, path, row_group_size=65536)
PY
  dir="$WORK/pq-$rows"
  rm -rf "$dir" && mkdir -p "$dir"
  start=$(date +%s.%N)
  /usr/bin/time -f "%M" -o "$dir.rss" "$BIN" run "${MODEL[@]}" --input "$WORK/in-$rows.parquet" \
    --output "$dir/out.jsonl" 2>/dev/null
  end=$(date +%s.%N)
  [ "$(wc -l < "$dir/out.jsonl")" -eq "$rows" ] || { echo "wrong row count" >&2; exit 1; }
  secs=$(echo "$end - $start" | bc -l)
  printf "%-9s %9.2f %11.0f %12.1f\n" "$rows" "$secs" "$(echo "$rows / $secs" | bc -l)" "$(echo "$(cat "$dir.rss") / 1024" | bc -l)"
  rm -f "$WORK/in-$rows.parquet"
done
