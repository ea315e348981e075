#!/usr/bin/env python3
"""Quota-level throughput: `weir run` against `weir sim` with a quota, truth read from /stats.

Cases (simulated quota windows of a few seconds, so each case runs in about a minute):
  1. R requests per window, nothing told to weir;
  2. the same with --rpm R --limit-window W;
  3. a token-bound workload (long prompts), nothing told;
  4. a hidden concurrency cap (503 above it), nothing told, against a sweep of fixed
     --max-concurrency values run in the same invocation;
  5. random 503s that do not track load (5 % of calls) under a request quota, side by side
     with the same quota and no faults: the faults must cost about 5 %, not half the quota;
  6. advice rounded to whole seconds (as real servers give it), 5-second windows: one weir
     process, then two weir processes sharing one key; completion time against the ideal
     (every window full from the start) and the share of 429s;
  7. a hidden concurrency cap shared by four processes on one key (issue #32), against a sweep
     of fixed totals run in the same invocation.
Usage: bench/quota.py [CASE...]   (default: all); SERVER=ref runs case 6 against
bench/refserver.py (a quota server apart from weir sim); MODEL=provider/model (default
gemini/gemini-2.5-flash; anthropic/claude-haiku-4-5 for the Anthropic client). Needs a release build (it makes one, unless
WEIR_BIN names the binary to measure).
"""
import json, os, subprocess, sys, tempfile, time, urllib.request

from servers import free_port, start_quota

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# WEIR_BIN=path measures another build (an older commit's, side by side) instead of this one.
BIN = os.environ.get("WEIR_BIN")
if not BIN:
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "weir"], cwd=ROOT, check=True)
    TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    BIN = os.path.join(TARGET, "release", "weir")
WORK = tempfile.mkdtemp()
# MODEL=anthropic/claude-haiku-4-5 measures the Anthropic client (its 429s and rate-limit
# headers, as the simulator gives them) instead of the Gemini API's.
MODEL = os.environ.get("MODEL", "gemini/gemini-2.5-flash")


def start_sim(*args):
    port = free_port()
    p = subprocess.Popen([BIN, "sim", "--listen", f"127.0.0.1:{port}", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.readline()
    return p, f"http://127.0.0.1:{port}"


def stats(url):
    return json.load(urllib.request.urlopen(url + "/stats"))


def reset(url):
    urllib.request.urlopen(urllib.request.Request(url + "/stats/reset", method="POST")).read()


def dataset(name, n, prompt_len=40):
    path = os.path.join(WORK, name)
    with open(path, "w") as f:
        for i in range(n):
            filler = ("river stone water " * (prompt_len // 18 + 1))[: max(0, prompt_len - 20)]
            f.write(json.dumps({"id": f"r{i}", "prompt": f"{i:08d} {filler}"}) + "\n")
    return path


def run(url, data, *extra):
    out = os.path.join(WORK, f"out-{time.monotonic_ns()}.jsonl")
    t0 = time.monotonic()
    p = subprocess.run([BIN, "run", "--model", MODEL, "--base-url", url, "--input", data,
                        "--output", out, "--id-field", "id", "--no-state", "--progress", "never", "--max-retries", "50", *extra],
                       capture_output=True, text=True)
    secs = time.monotonic() - t0
    if p.returncode != 0:
        sys.exit(f"weir run failed ({p.returncode}): {p.stderr}")
    return secs, p.stderr


def windows(per_second, window, skip_first=True):
    """Sums per window, dropping the first window and the last partial one."""
    n = len(per_second) // window
    sums = [sum(per_second[i * window:(i + 1) * window]) for i in range(n)]
    return sums[1:] if skip_first else sums


def quota_case(title, told):
    R, W = 200, 5
    sim, url = start_sim("--rpm", str(R), "--window-secs", str(W), "--latency-ms", "50", "--jitter-ms", "30")
    try:
        data = dataset("q.jsonl", R * 12)
        extra = ["--rpm", str(R), "--limit-window", str(W)] if told else []
        secs, err = run(url, data, *extra)
        s = stats(url)
    finally:
        sim.terminate()
    per_window = windows(s["successes_per_second"], W)
    full = per_window[:-1] if len(per_window) > 1 else per_window
    achieved = sum(full) / len(full) / R
    rejected = s["rate_limited"] / s["requests"]
    print(f"== {title}: quota {R} requests per {W} s window, latency 50±15 ms")
    print(f"   successes per window after the first: {full}")
    print(f"   achieved {achieved:.1%} of R; 429s {s['rate_limited']} of {s['requests']} requests sent ({rejected:.2%}); run {secs:.1f} s")
    print("   " + [l for l in err.splitlines() if "limits:" in l][0].strip())


def token_case():
    T, W = 40000, 5
    sim, url = start_sim("--tpm", str(T), "--window-secs", str(W), "--latency-ms", "50", "--jitter-ms", "30")
    try:
        data = dataset("t.jsonl", 1000, prompt_len=2400)
        secs, err = run(url, data)
        s = stats(url)
    finally:
        sim.terminate()
    per_window = windows(s["tokens_per_second"], W)
    full = per_window[:-1] if len(per_window) > 1 else per_window
    achieved = sum(full) / len(full) / T
    rejected = s["rate_limited"] / s["requests"]
    print(f"== 3. token-bound: quota {T} tokens per {W} s window, prompts of ~600 tokens, nothing told")
    print(f"   tokens per window after the first: {full}")
    print(f"   achieved {achieved:.1%} of the token quota; 429s {s['rate_limited']} of {s['requests']} ({rejected:.2%}); run {secs:.1f} s")
    print("   " + [l for l in err.splitlines() if "limits:" in l][0].strip())


def cap_case():
    C, N = 12, 2500
    sim, url = start_sim("--max-in-flight", str(C), "--overload", "503", "--latency-ms", "100", "--jitter-ms", "20")
    data = dataset("c.jsonl", N)
    results = {}
    try:
        sweep = [(f"fixed {n}", ["--concurrency", "fixed", "--max-concurrency", str(n)]) for n in (6, 10, 12, 14, 20)]
        for mode, extra in sweep + [("adaptive", [])]:
            reset(url)
            secs, err = run(url, data, *extra)
            s = stats(url)
            results[mode] = (N / secs, s["unavailable"] / s["requests"], s["requests"], err,
                             s.get("unavailable_per_second", []))
    finally:
        sim.terminate()
    best = max(v[0] for k, v in results.items() if k != "adaptive")
    print(f"== 4. hidden concurrency cap: {C} in flight (503 above), latency 110±10 ms, {N} records each, nothing told")
    for k, (rate, rej, req, _, _) in results.items():
        print(f"   {k:9s} {rate:7.1f} records/s  rejected {rej:6.2%} of {req} requests")
    a = results["adaptive"]
    print(f"   adaptive: {a[0] / best:.1%} of the best fixed setting; rejected {a[1]:.2%}")
    print(f"   adaptive: 503s per second {a[4]}")
    print("   " + [l for l in a[3].splitlines() if "limits:" in l][0].strip())


def random_faults_case():
    R, W, N = 600, 10, 3000
    rows = {}
    for label, fault in (("no faults", []), ("5 % random 503", ["--fault", "error_503=0.05"])):
        sim, url = start_sim("--rpm", str(R), "--window-secs", str(W), "--latency-ms", "300", *fault)
        try:
            data = dataset("f.jsonl", N)
            secs, err = run(url, data)
            s = stats(url)
        finally:
            sim.terminate()
        per_s = s["successes_per_second"]
        first15 = sum(per_s[:15]) / 15
        # Every full window, the first included (the slow start is what went wrong before).
        full = windows(per_s, W, skip_first=False)
        full = full[:-1] if len(full) > 1 else full
        limits = [l for l in err.splitlines() if "limits:" in l][0].strip()
        rows[label] = (secs, first15, full, s["requests"], s.get("faults", {}).get("error_503", 0), limits)
    print(f"== 5. random 503s: quota {R} requests per {W} s, latency 300 ms, {N} records, nothing told")
    for label, (secs, first15, full, req, f503, limits) in rows.items():
        print(f"   {label:15s} run {secs:5.1f} s; first 15 s {first15:5.1f} successes/s; successes per full window {full}; "
              f"{req} requests, {f503} random 503s; {limits}")
    mean = lambda l: sum(l) / len(l)
    base, faulty = mean(rows["no faults"][2]), mean(rows["5 % random 503"][2])
    print(f"   successes per window with faults / without: {faulty / base:.1%} "
          f"(the simulator counts a faulted call against the quota, so 95 % is the physical limit)")


def run_many(url, paths, weir_args, kill_at=0.0):
    """Runs one `weir run` per input in `paths` at once; when each ended (seconds from the start),
    their stderr, and whether the first was killed with SIGKILL at `kill_at` seconds."""
    t0 = time.monotonic()
    ps = [subprocess.Popen([BIN, "run", "--model", MODEL, "--base-url", url, "--input", p,
                            "--output", p + f".{time.monotonic_ns()}.out", "--id-field", "id", "--no-state",
                            "--progress", "never", "--max-retries", "50", *weir_args],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
          for p in paths]
    done = [None] * len(ps)
    killed = False
    while None in done:
        if kill_at and not killed and time.monotonic() - t0 >= kill_at:
            ps[0].kill()
            killed = True
        for i, p in enumerate(ps):
            if done[i] is None and p.poll() is not None:
                done[i] = time.monotonic() - t0
        time.sleep(0.05)
    errs = [p.communicate()[1] for p in ps]
    if os.environ.get("TRACE") == "1":
        # TRACE=1 with WEIR_LOG=weir_core::rate=debug: each process's log, to read afterwards.
        for i, e in enumerate(errs):
            with open(f"/tmp/weir-quota-{int(t0)}-{len(ps)}-{i}.log", "w") as f:
                f.write(e)
    if any(p.returncode != 0 for i, p in enumerate(ps) if not (killed and i == 0)):
        sys.exit(f"weir run failed: {errs}")
    return done, errs, killed


def shared_cap_case():
    C, K, N = 16, 4, 4000
    sim, url = start_sim("--max-in-flight", str(C), "--overload", "503", "--latency-ms", "100", "--jitter-ms", "20")
    results = {}
    try:
        sweep = [(f"fixed {n}", ["--concurrency", "fixed", "--max-concurrency", str(n)]) for n in (12, 16, 20)]
        for mode, extra in sweep + [("adaptive", [])]:
            reset(url)
            paths = [dataset(f"k{i}-{mode.replace(' ', '')}.jsonl", N // K) for i in range(K)]
            done, errs, _ = run_many(url, paths, extra)
            s = stats(url)
            results[mode] = (N / max(done), s["unavailable"] / s["requests"], s["requests"], done, errs,
                             s.get("unavailable_per_second", []))
    finally:
        sim.terminate()
    best = max(v[0] for k, v in results.items() if k != "adaptive")
    print(f"== 7. hidden concurrency cap shared by {K} processes: {C} in flight (503 above), latency 110±10 ms, "
          f"{N} records split evenly, nothing told (fixed N: each process given --max-concurrency N, which the "
          f"shared throttle applies to all)")
    for k, (rate, rej, req, done, _, _) in results.items():
        print(f"   {k:9s} {rate:7.1f} records/s  rejected {rej:6.2%} of {req} requests; each ended at "
              f"{', '.join(f'{d:.1f}' for d in done)} s")
    a = results["adaptive"]
    print(f"   adaptive: {a[0] / best:.1%} of the best fixed setting; rejected {a[1]:.2%}")
    print(f"   adaptive: 503s per second {a[5]}")
    print("   last process: " + ([l for l in a[4][-1].splitlines() if "limits:" in l] or ["?"])[0].strip())


def coarse_case():
    R, W, N = 100, 5, 2000
    # LATENCY_MS=300 is issue #32's case (0.3 s calls); SIM_ARGS adds simulator flags; WEIR_ARGS
    # adds flags to every weir process (--quota-store off; --rpm 100 --limit-window 5);
    # KILL_AT=S kills the first process with SIGKILL S seconds in (the others must take its share).
    lat = int(os.environ.get("LATENCY_MS", "50"))
    extra = os.environ.get("SIM_ARGS", "").split()
    weir_args = os.environ.get("WEIR_ARGS", "").split()
    kill_at = float(os.environ.get("KILL_AT", "0"))
    # SERVER=ref measures against bench/refserver.py instead of weir sim (SIM_ARGS then ignored).
    sim, url, extra = start_quota(start_sim, R, W, lat, extra)
    ideal = ((N - 1) // R) * W + lat / 1000
    told = " ".join(weir_args) if weir_args else "nothing told"
    print(f"== 6. advice in whole seconds: quota {R} requests per {W} s, latency {lat}±10 ms, {N} records, "
          f"{told}{' (' + ' '.join(extra) + ')' if extra else ''}{f'; first process killed at {kill_at:g} s' if kill_at else ''}")
    try:
        for procs in [int(p) for p in os.environ.get("PROCS", "1 2").split()]:
            # The ideal starts from an empty window: let the last run's sends leave it.
            time.sleep(W + 1)
            reset(url)
            share = N // procs
            paths = [dataset(f"c{procs}-{i}.jsonl", share) for i in range(procs)]
            done, errs, killed = run_many(url, paths, weir_args, kill_at)
            secs = max(done)
            s = stats(url)
            line = (f"   {procs} process{'es' if procs > 1 else ''}: {secs:5.1f} s against {ideal:.1f} s ideal "
                    f"({ideal / secs:.1%}); 429s {s['rate_limited']} of {s['requests']} ({s['rate_limited'] / s['requests']:.2%})"
                    + (f"; each ended at {', '.join(f'{d:.1f}' for d in done)} s" if procs > 1 else ""))
            print(line)
            per_window = windows(s["successes_per_second"], W, skip_first=False)
            print(f"   successes per {W} s window: {per_window}" + (f" (killed at {kill_at:g} s)" if kill_at else ""))
            refused = windows(s.get("rate_limited_per_second", []), W, skip_first=False)
            print(f"   429s per {W} s window: {refused}")
            if os.environ.get("PER_SECOND") == "1":
                # Where in the server's windows the successes fell (bins of 5 s may straddle them).
                print(f"   successes per second: {s['successes_per_second']}")
            shared = [l.strip() for l in errs[-1].splitlines() if "quota shared" in l]
            if shared:
                print(f"   last process: {shared[0]}")
    finally:
        sim.terminate()


cases = sys.argv[1:] or ["1", "2", "3", "4", "5", "6", "7"]
for c in cases:
    {"1": lambda: quota_case("1. request quota, nothing told", False),
     "2": lambda: quota_case("2. request quota, --rpm given", True),
     "3": token_case, "4": cap_case, "5": random_faults_case, "6": coarse_case, "7": shared_cap_case}[c]()
