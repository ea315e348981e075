#!/usr/bin/env python3
"""One model, many endpoints (issue #33): one `weir run` over a pool of three `weir sim`s with
quotas of 100, 50 and 20 requests per 5 s (advice in whole seconds, 0.3 s calls, the Gemini
format: nothing but 429s to learn from), nothing told. Truth is read from each simulator's /stats.

Cases:
  1. the pool: completion time against the ideal (every window of every endpoint full from the
     start), successes per 5 s window in the steady state against the sum of the quotas, 429s
     per endpoint, every record exactly once;
  2. failover: the same with the largest endpoint killed (SIGKILL) KILL_AT seconds in: the run
     goes on at the two others, every record exactly once;
  3. a slow replica: self-hosted replicas of an OpenAI-compatible model (no quota; each
     serves SLOTS requests at once and queues the rest, as vLLM does), two answering in
     FAST_MS and one five times slower; run with the slow one and without it: the slow one's
     share of the records, and the ratio of the two times.
Usage: bench/pool.py [CASE...]   (default: all). N records (default 3000); SIM_ARGS adds
simulator flags (default --window fixed). Needs a release build (it makes one, unless WEIR_BIN
names the binary to measure).
"""
import json, os, signal, socket, subprocess, sys, tempfile, threading, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("WEIR_BIN")
if not BIN:
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "weir"], cwd=ROOT, check=True)
    TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    BIN = os.path.join(TARGET, "release", "weir")
WORK = tempfile.mkdtemp()
QUOTAS, W, LAT = [100, 50, 20], 5, 300
N = int(os.environ.get("N", "3000"))
SIM_ARGS = os.environ.get("SIM_ARGS", "--window fixed").split()


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def start_sim(quota):
    port = free_port()
    p = subprocess.Popen([BIN, "sim", "--listen", f"127.0.0.1:{port}", "--rpm", str(quota), "--window-secs", str(W),
                          "--latency-ms", str(LAT), "--jitter-ms", "20", "--round-advice", *SIM_ARGS],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.readline()
    return p, f"http://127.0.0.1:{port}"


def stats(url):
    return json.load(urllib.request.urlopen(url + "/stats"))


def dataset(n):
    path = os.path.join(WORK, f"in-{n}.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "prompt": f"{i:08d} river stone water"}) + "\n")
    return path


def once(out, n):
    ids = [json.loads(l)["id"] for l in open(out)]
    return len(ids) == n and len(set(ids)) == n


def steady(per_second):
    """Successes per window, without the first window and the last partial one."""
    k = len(per_second) // W
    return [sum(per_second[i * W:(i + 1) * W]) for i in range(k)][1:]


def case(kill_at=None):
    sims = [start_sim(q) for q in QUOTAS]
    data, out = dataset(N), os.path.join(WORK, f"out-{time.monotonic_ns()}.jsonl")
    # The windows start when each simulator does: let every one start a fresh window first.
    time.sleep(W + 0.5)
    for _, url in sims:
        urllib.request.urlopen(urllib.request.Request(url + "/stats/reset", method="POST")).read()
    args = [BIN, "run", "--model", "gemini/gemini-2.5-flash", "--input", data, "--output", out, "--id-field", "id",
            "--no-state", "--progress", "never", "--max-retries", "50"]
    for _, url in sims:
        args += ["--base-url", url]
    t0 = time.monotonic()
    if kill_at:
        threading.Timer(kill_at, lambda: sims[0][0].send_signal(signal.SIGKILL)).start()
    p = subprocess.run(args, capture_output=True, text=True)
    secs = time.monotonic() - t0
    try:
        if p.returncode != 0:
            sys.exit(f"weir run failed ({p.returncode}): {p.stderr}")
        per = []
        for (proc, url), q in zip(sims, QUOTAS):
            if kill_at and q == QUOTAS[0]:
                per.append((q, None))
                continue
            per.append((q, stats(url)))
    finally:
        for proc, _ in sims:
            proc.kill()
    total = sum(QUOTAS)
    ideal = ((N - 1) // total) * W + LAT / 1000
    print(f"   {N} records in {secs:.1f} s against {ideal:.1f} s ideal ({ideal / secs:.1%}); every record once: "
          f"{once(out, N)}")
    if kill_at:
        # The two left, from the first whole window after the kill to the last whole one.
        alive = [s for _, s in per if s is not None]
        first = int(kill_at) // W + 1
        sums = [sum(x) for x in zip(*[steady(s['successes_per_second']) for s in alive])][first - 1:-1]
        left = sum(QUOTAS[1:])
        if sums:
            med = sorted(sums)[len(sums) // 2]
            print(f"   after the kill: median {med} successes per {W} s window of the others' {left} "
                  f"({med / left:.1%}); windows {sums}")
    if not kill_at:
        sums = [sum(x) for x in zip(*[steady(s['successes_per_second']) for _, s in per])]
        full = sums[:-1] if len(sums) > 1 else sums
        if full:
            full.sort()
            print(f"   steady state: median {full[len(full) // 2]} successes per {W} s window of {total} "
                  f"({full[len(full) // 2] / total:.1%}); windows {sums}")
    for q, s in per:
        if s is None:
            print(f"   quota {q:3d}: killed at {kill_at:g} s")
            continue
        r = s["requests"]
        refused = s.get("rate_limited_per_second", [])
        by_window = [sum(refused[i:i + W]) for i in range(0, len(refused), W)]
        print(f"   quota {q:3d}: {s['successes']} answered, 429s {s['rate_limited']} of {r} "
              f"({s['rate_limited'] / max(r, 1):.2%}); 429s per {W} s window {by_window}")
    for line in p.stderr.splitlines():
        if line.strip().startswith(("endpoint ", "calls ")):
            print(f"   weir: {line.strip()}")
    if kill_at:
        # Calls that met the dead endpoint: those of its summary line that failed.
        dead = [l for l in p.stderr.splitlines() if l.strip().startswith("endpoint ") and sims[0][1] in l]
        if dead:
            import re
            m = re.search(r"([\d,]+) failed", dead[0])
            print(f"   calls wasted on the killed endpoint: {m.group(1) if m else '?'}")


FAST_MS = int(os.environ.get("FAST_MS", "200"))
SLOTS = int(os.environ.get("SLOTS", "8"))


def start_replica(latency_ms):
    port = free_port()
    p = subprocess.Popen([BIN, "sim", "--listen", f"127.0.0.1:{port}", "--latency-ms", str(latency_ms),
                          "--jitter-ms", str(latency_ms // 10), "--max-in-flight", str(SLOTS), "--overload", "slow"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.readline()
    return p, f"http://127.0.0.1:{port}"


def replicas(latencies):
    """One run over replicas answering in `latencies` ms: its time, and each replica's answers."""
    sims = [start_replica(l) for l in latencies]
    data, out = dataset(N), os.path.join(WORK, f"out-{time.monotonic_ns()}.jsonl")
    args = [BIN, "run", "--model", "openai/replica", "--input", data, "--output", out, "--id-field", "id",
            "--no-state", "--progress", "never", "--max-retries", "50"]
    for _, url in sims:
        args += ["--base-url", url + "/v1"]
    t0 = time.monotonic()
    p = subprocess.run(args, capture_output=True, text=True)
    secs = time.monotonic() - t0
    try:
        if p.returncode != 0:
            sys.exit(f"weir run failed ({p.returncode}): {p.stderr}")
        answered = [stats(url)["successes"] for _, url in sims]
        calls = [stats(url)["requests"] for _, url in sims]
    finally:
        for proc, _ in sims:
            proc.kill()
    print(f"   replicas of {latencies} ms: {N} records in {secs:.1f} s; every record once: {once(out, N)}; "
          f"answered per replica {answered} (calls {calls})")
    return secs, answered


def slow_replica():
    slow = FAST_MS * 5
    with_slow, answered = replicas([FAST_MS, FAST_MS, slow])
    without, _ = replicas([FAST_MS, FAST_MS])
    # Each replica serves SLOTS at once: the slow one's fair share is its rate over the sum.
    fair = (1 / slow) / (2 / FAST_MS + 1 / slow)
    print(f"   the slow replica answered {answered[2] / N:.1%} of the records (its capacity's share: {fair:.1%}); "
          f"time with it / without it: {with_slow / without:.3f}")


def main():
    cases = sys.argv[1:] or ["1", "2", "3"]
    print(f"weir pool bench: {BIN}; quotas {QUOTAS} per {W} s ({' '.join(SIM_ARGS)}), latency {LAT} ms, "
          f"whole-second advice")
    if "1" in cases:
        print(f"== 1. a pool of three endpoints, nothing told")
        case()
    if "2" in cases:
        k = float(os.environ.get("KILL_AT", "15"))
        print(f"== 2. failover: the quota-{QUOTAS[0]} endpoint killed at {k:g} s")
        case(kill_at=k)
    if "3" in cases:
        print(f"== 3. a replica five times slower: {FAST_MS} ms and {FAST_MS * 5} ms, {SLOTS} requests at once each")
        slow_replica()


if __name__ == "__main__":
    main()
