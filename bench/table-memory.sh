#!/usr/bin/env bash
# Memory of table outputs with long rows (issue #29, item 2): peak RSS (GNU time) of one run
# writing a JSONL file, a Parquet table and a CSV table, for inputs of N and 2N records each
# carrying a 4.5 KB column (as long answers would), with the in-process sim/demo model. Is a
# table's memory bounded by a small buffer, not by the part being written (128 MiB)?
# Usage: bench/table-memory.sh [N] (default 30000). WEIR_BIN=path measures another build
# (else the release build is made and used).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-30000}
command -v /usr/bin/time >/dev/null || { echo "needs GNU time (apt-get install time)" >&2; exit 1; }
if [ -z "${WEIR_BIN:-}" ]; then
  cargo build --release -q -p weir
  WEIR_BIN=$(realpath "${CARGO_TARGET_DIR:-target}/release/weir")
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
printf "%-8s %8s %13s %9s\n" output records "peak RSS MiB" seconds
for n in "$N" $((2 * N)); do
  python3 - "$n" "$WORK/in.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
blob = "y" * 4500
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"key": str(i), "prompt": f"p {i}", "blob": blob}) + "\n")
PY
  for out in out.jsonl out.parquet out.csv; do
    rm -rf "$WORK"/out.* "$WORK/.weir"
    (cd "$WORK" && /usr/bin/time -f "%M %e" -o "$WORK/t" "$WEIR_BIN" run --model sim/demo --input in.jsonl \
      --output "$out" --id-field key --progress never 2>/dev/null)
    read -r kb secs < "$WORK/t"
    printf "%-8s %8d %13.1f %9.1f\n" "${out#out.}" "$n" "$(echo "$kb / 1024" | bc -l)" "$secs"
  done
done
