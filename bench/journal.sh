#!/usr/bin/env bash
# Records per second through `weir run` at zero latency with the journal (state directory) and
# the response cache on and off, measured side by side: the modes are interleaved in each round
# and the median of the rounds is reported, with its ratio to the no-state baseline.
# Usage: bench/journal.sh [RECORDS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-100000}
ROUNDS=${2:-5}
source bench/common.sh
python3 - "$N" "$WORK/in.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"r{i}", "prompt": f"Write one sentence about river number {i}."}) + "\n")
PY
MODES="no-state journal journal+cache(cold) journal+cache(warm)"
declare -A T
for r in $(seq "$ROUNDS"); do
  for mode in $MODES; do
    out="$WORK/$mode/out.jsonl"
    mkdir -p "$WORK/$mode"
    extra=()
    case $mode in
      no-state) extra=(--no-state --overwrite) ;;
      journal) rm -rf "$WORK/$mode/.weir"; extra=(--no-cache --overwrite) ;;
      "journal+cache(cold)") rm -rf "$WORK/$mode/.weir"; extra=(--overwrite) ;;
      "journal+cache(warm)") [ -d "$WORK/$mode/.weir" ] || "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" \
          --input "$WORK/in.jsonl" --output "$out" --id-field id --progress never 2>/dev/null
        extra=(--fresh) ;;
    esac
    start=$(date +%s.%N)
    "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" --input "$WORK/in.jsonl" \
      --output "$out" --id-field id --max-concurrency 64 --progress never "${extra[@]}" 2>/dev/null
    end=$(date +%s.%N)
    [ "$(wc -l < "$out")" -eq "$N" ] || { echo "$mode: wrong row count" >&2; exit 1; }
    T[$mode]="${T[$mode]:-} $(echo "$end - $start" | bc -l)"
  done
done
median() { printf "%s\n" $1 | sort -n | sed -n "$(( (ROUNDS + 1) / 2 ))p"; }
base=$(median "${T[no-state]}")
printf "%-22s %10s %11s %9s\n" mode "median s" "records/s" "vs no-state"
for mode in $MODES; do
  m=$(median "${T[$mode]}")
  printf "%-22s %10.2f %11.0f %9.2f\n" "$mode" "$m" "$(echo "$N / $m" | bc -l)" "$(echo "$base / $m" | bc -l)"
done
