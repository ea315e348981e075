#!/usr/bin/env bash
# Two builds of weir side by side: `--no-state` and the default mode (journal and response
# cache, --id-field) for each, interleaved over ROUNDS rounds at zero latency, with medians of
# wall time and CPU (user + system, GNU time) and each build's default-to---no-state ratio.
# For measuring a change to what state costs against the commit before it.
# Usage: N=1000000 ROUNDS=3 bench/state-ab.sh OLD_BINARY NEW_BINARY
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: bench/state-ab.sh OLD_BINARY NEW_BINARY" >&2; exit 2; }
OLD=$(realpath "$1"); NEW=$(realpath "$2")
N=${N:-1000000}; ROUNDS=${ROUNDS:-3}
command -v /usr/bin/time >/dev/null || { echo "needs GNU time (apt-get install time)" >&2; exit 1; }
WORK=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$NEW" sim --listen "127.0.0.1:$PORT" >/dev/null &
SIM=$!
trap 'kill $SIM 2>/dev/null; rm -rf "$WORK"' EXIT
sleep 0.5
python3 - "$N" "$WORK/in.jsonl" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"r{i}", "prompt": f"Write one sentence about river number {i}."}) + "\n")
PY
for round in $(seq "$ROUNDS"); do
  for build in old new; do
    bin=$OLD; [ "$build" = new ] && bin=$NEW
    for mode in no-state default; do
      dir="$WORK/$build-$mode"
      rm -rf "$dir" && mkdir -p "$dir"
      extra=(--id-field id)
      [ "$mode" = no-state ] && extra+=(--no-state)
      start=$(date +%s.%N)
      /usr/bin/time -f "%U %S" -o "$dir/cpu" "$bin" run --model gemini/gemini-2.5-flash --base-url "http://127.0.0.1:$PORT" \
        --input "$WORK/in.jsonl" --output "$dir/out.jsonl" --progress never "${extra[@]}" 2>/dev/null
      end=$(date +%s.%N)
      [ "$(wc -l < "$dir/out.jsonl")" -eq "$N" ] || { echo "$build $mode: wrong row count" >&2; exit 1; }
      echo "$build $mode $(echo "$end - $start" | bc -l) $(cat "$dir/cpu")" >> "$WORK/times"
    done
  done
done
python3 - "$WORK/times" <<'PY'
import statistics as st, sys
rows = [l.split() for l in open(sys.argv[1])]
med = {}
print(f"{'mode':<16}{'median s':>9}{'CPU s':>8}   runs")
for b in ("old", "new"):
    for m in ("no-state", "default"):
        sel = [r for r in rows if r[0] == b and r[1] == m]
        secs = [float(r[2]) for r in sel]
        med[b, m] = st.median(secs)
        cpu = st.median(float(r[3]) + float(r[4]) for r in sel)
        print(f"{b + ' ' + m:<16}{med[b, m]:9.2f}{cpu:8.2f}   {' '.join(f'{s:.1f}' for s in secs)}")
print(f"default vs --no-state: old {med['old', 'no-state'] / med['old', 'default']:.2f}, "
      f"new {med['new', 'no-state'] / med['new', 'default']:.2f}")
PY
