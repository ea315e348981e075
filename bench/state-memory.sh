#!/usr/bin/env bash
# Peak memory and records/s of `weir run` with its defaults (journal and response cache on)
# against --no-state, side by side, as the input grows: issue #9 asks for peak RSS at the
# largest size within 1.5× of the smallest, and the default mode at ≥ 0.8× of --no-state.
# Zero latency, `weir sim` in its own process (so the RSS is weir's alone), GNU time's maximum
# resident set size. The modes are interleaved in each round and the medians reported (the
# machine is shared and noisy). Usage: bench/state-memory.sh [SIZES...]
# (default: 100000 1000000; ROUNDS=3 rounds).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${*:-100000 1000000}
ROUNDS=${ROUNDS:-3}
source bench/common.sh
command -v /usr/bin/time >/dev/null || { echo "needs GNU time (apt-get install time)" >&2; exit 1; }
MODES="no-state default default-lineids"
printf "%-9s %-15s %9s %11s %9s %12s %10s\n" records mode "median s" "records/s" "vs none" "peak RSS MiB" "state MiB"
for n in $SIZES; do
  python3 - "$n" "$WORK/in-$n.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"r{i}", "prompt": f"Write one sentence about river number {i}."}) + "\n")
PY
  : > "$WORK/times"
  for round in $(seq "$ROUNDS"); do
    for mode in $MODES; do
      dir="$WORK/$mode-$n"
      rm -rf "$dir" && mkdir -p "$dir"
      extra=(--id-field id)
      [ "$mode" = no-state ] && extra=(--id-field id --no-state)
      # Line numbers as ids: nothing is kept per record to reject duplicate ids.
      [ "$mode" = default-lineids ] && extra=()
      start=$(date +%s.%N)
      /usr/bin/time -f "%M" -o "$dir/rss" "$BIN" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" \
        --input "$WORK/in-$n.jsonl" --output "$dir/out.jsonl" --progress never "${extra[@]}" 2>/dev/null
      end=$(date +%s.%N)
      [ "$(wc -l < "$dir/out.jsonl")" -eq "$n" ] || { echo "$mode $n: wrong row count" >&2; exit 1; }
      state=$( [ -d "$dir/.weir" ] && du -sm "$dir/.weir" | cut -f1 || echo 0)
      echo "$mode $(echo "$end - $start" | bc -l) $(cat "$dir/rss") $state" >> "$WORK/times"
    done
  done
  python3 - "$n" "$WORK/times" $MODES <<'PY'
import statistics as st, sys
n, path, modes = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = [l.split() for l in open(path)]
base = None
for m in modes:
    secs = [float(r[1]) for r in rows if r[0] == m]
    rss = [int(r[2]) / 1024 for r in rows if r[0] == m]
    state = [r[3] for r in rows if r[0] == m][-1]
    med = st.median(secs)
    base = base or med
    print(f"{n:<9} {m:<15} {med:9.2f} {int(n) / med:11.0f} {base / med:9.2f} {st.median(rss):12.1f} {state:>10}"
          f"   (runs: {' '.join(f'{s:.1f}' for s in secs)})")
PY
  rm -f "$WORK/in-$n.jsonl"
done
