#!/usr/bin/env bash
# Where the CPU of a media run goes (issue #35): weir's user+system time and the simulator's,
# for the same records as text and with a 20 KB image each, at zero latency, 64 calls in
# flight, `--no-state --no-cache`. On a 2-core machine the two processes share the cores, so
# records/s follows their sum; this shows how much of it is weir's.
# Usage: bench/media-cpu.sh [RECORDS] (default 10000); REPEAT rounds (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-10000}
REPEAT=${REPEAT:-3}
source bench/common.sh
command -v /usr/bin/time >/dev/null || { echo "needs GNU time (apt-get install time)" >&2; exit 1; }
python3 bench/media-input.py "$N" "$WORK"
# The simulator's CPU seconds so far (user + system, from /proc).
sim_cpu() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$SIM/stat"; }
printf "%-6s %7s %10s %10s %9s %13s\n" mode "wall s" "weir cpu" "(sys)" "sim cpu" "peak RSS MiB"
for _ in $(seq "$REPEAT"); do
  for mode in text media; do
    extra=(); [ "$mode" = media ] && extra=(--media-field image)
    before=$(sim_cpu)
    /usr/bin/time -f "%e %U %S %M" -o "$WORK/time" "$BIN" run --model gemini/gemini-2.5-flash \
      --base-url "http://127.0.0.1:$PORT" --id-field id --input "$WORK/in-$N.jsonl" --output "$WORK/out.jsonl" \
      --max-concurrency 64 --concurrency fixed --no-state --no-cache --overwrite --progress never "${extra[@]}" 2>/dev/null
    after=$(sim_cpu)
    read -r wall user sys kb < "$WORK/time"
    printf "%-6s %7.2f %10.2f %10.2f %9.2f %13.1f\n" "$mode" "$wall" "$(echo "$user + $sys" | bc -l)" "$sys" \
      "$(echo "$after - $before" | bc -l)" "$(echo "$kb / 1024" | bc -l)"
  done
done
