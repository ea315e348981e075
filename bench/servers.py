"""Servers the benchmarks start beside weir, shared by bench/quota.py and bench/sql.py."""
import os, socket, subprocess, sys

BENCH = os.path.dirname(os.path.abspath(__file__))


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def start_ref(rpm, window, lat, jitter):
    """`bench/refserver.py` (SERVER=ref): a quota server written apart from `weir sim`, a fixed
    window counted at arrival, refusals advising whole seconds in the body only."""
    port = free_port()
    p = subprocess.Popen([sys.executable, os.path.join(BENCH, "refserver.py"), "--listen", f"127.0.0.1:{port}",
                          "--rpm", str(rpm), "--window-secs", str(window), "--latency-ms", str(lat),
                          "--jitter-ms", str(jitter)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.readline()
    return p, f"http://127.0.0.1:{port}"
