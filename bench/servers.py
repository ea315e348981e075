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


def start_quota(start_sim, rpm, window, lat, sim_args):
    """The quota server of the whole-second cases: `weir sim` (through the caller's `start_sim`,
    with `sim_args` added), or with SERVER=ref `bench/refserver.py` (`sim_args` then ignored).
    Returns the process, its URL and the words that describe it in a case's title."""
    if os.environ.get("SERVER") == "ref":
        p, url = start_ref(rpm, window, lat, 20)
        return p, url, ["bench/refserver.py: fixed window counted at arrival, retryDelay in the body only"]
    p, url = start_sim("--rpm", str(rpm), "--window-secs", str(window), "--latency-ms", str(lat), "--jitter-ms", "20",
                       "--round-advice", *sim_args)
    return p, url, sim_args
