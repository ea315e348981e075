#!/usr/bin/env bash
# Two builds side by side: bench/run-throughput.sh and bench/state-memory.sh for one binary,
# then the other (ORDER="head base" reverses them), so a change can be held to "within 5 % of
# the commit before". Build the other commit first, e.g.
#   git worktree add /tmp/base COMMIT && (cd /tmp/base && cargo build --release -p weir)
# Usage: bench/ab.sh BASE_BIN HEAD_BIN   (SIZES, REPEAT, ROUNDS as for the two scripts)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: bench/ab.sh BASE_BIN HEAD_BIN" >&2; exit 2; }
declare -A bin=([base]=$1 [head]=$2)
for script in run-throughput state-memory; do
  for which in ${ORDER:-base head}; do
    echo "=== $script $which"
    # shellcheck disable=SC2086
    WEIR_BENCH_BIN=${bin[$which]} REPEAT=${REPEAT:-3} ROUNDS=${ROUNDS:-3} bash bench/$script.sh ${SIZES:-100000 1000000}
  done
done
