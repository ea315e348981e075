# Sourced by the bench scripts (from the repository root): builds weir in release mode, makes a
# scratch directory, and starts `weir sim` on a free loopback port; both go away on exit.
# Sets BIN (the weir binary), WORK (the scratch directory) and PORT (the simulator's port).
# WEIR_BENCH_BIN=PATH measures that binary instead (another commit's build, side by side).
if [ -n "${WEIR_BENCH_BIN:-}" ]; then
  BIN=$(realpath "$WEIR_BENCH_BIN")
else
  cargo build --release -q -p weir
  BIN=$(realpath "${CARGO_TARGET_DIR:-target}/release/weir")
fi
WORK=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN" sim --listen "127.0.0.1:$PORT" >/dev/null &
SIM=$!
trap 'kill $SIM 2>/dev/null; rm -rf "$WORK"' EXIT
sleep 0.5
