#!/usr/bin/env python3
"""One weir process entering a fixed quota window late (issue #32's open row).

A server that counts requests in fixed 5-second windows (100 per window, advice rounded up to
whole seconds, 0.3 s latency) is started, its window is begun with one request, and `weir run`
starts LATE seconds into it, told nothing. The first 429 then measures the window from a send
made after it started. For each offset: completion time against the ideal, and the 429s.

Usage: bench/fixed-late.py [LATE...]   (default 0.5 1.3 2.2 3.0 3.7 4.4)
Env: WEIR_BIN (default: the release build in CARGO_TARGET_DIR), N (records, default 2000),
K (processes sharing one key, default 1), KILL_AT (seconds after the processes start when the
first, which holds the shared quota, is killed with SIGKILL; default never), WEIR_ARGS (more
flags for every `weir run`, e.g. "--quota-store off"), STOP_AT and STOP_FOR (the first process
is stopped with SIGSTOP STOP_AT seconds in and resumed STOP_FOR seconds later, default 20: a
holder stopped with Ctrl-Z), TRACE=1 (debug logs of the rate budget in
/tmp/weir-fixed-late-*.log).
"""
import json, os, signal, socket, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
BIN = os.environ.get("WEIR_BIN") or os.path.join(TARGET, "release", "weir")
N = int(os.environ.get("N", "2000"))
K = int(os.environ.get("K", "1"))
KILL_AT = float(os.environ.get("KILL_AT", "0"))
EXTRA = os.environ.get("WEIR_ARGS", "").split()
STOP_AT = float(os.environ.get("STOP_AT", "0"))
STOP_FOR = float(os.environ.get("STOP_FOR", "20"))
WORK = tempfile.mkdtemp()


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def one(late):
    port = free_port()
    sim = subprocess.Popen([BIN, "sim", "--listen", f"127.0.0.1:{port}", "--rpm", "100", "--window-secs", "5",
                            "--latency-ms", "300", "--jitter-ms", "20", "--round-advice", "--window", "fixed"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    sim.stdout.readline()
    url = f"http://127.0.0.1:{port}"
    try:
        # The server's window starts with this request; weir enters `late` seconds into it.
        body = json.dumps({"contents": [{"parts": [{"text": "x"}]}]}).encode()
        urllib.request.urlopen(urllib.request.Request(url + "/v1beta/models/m:generateContent", data=body,
                                                      headers={"content-type": "application/json"})).read()
        urllib.request.urlopen(urllib.request.Request(url + "/stats/reset", method="POST")).read()
        time.sleep(late)
        # A meeting directory of this run's own: with a kill or a stop, the first process is
        # let start holding the quota (its socket is there) before the others start.
        meet = tempfile.mkdtemp(prefix="q", dir="/tmp")
        env = dict(os.environ, GEMINI_API_KEY="bench", WEIR_QUOTA_DIR=meet)
        ps = []
        for i in range(K):
            if i == 1 and (KILL_AT or STOP_AT):
                until = time.monotonic() + 5
                while time.monotonic() < until and not any(n.endswith(".sock") for n in os.listdir(meet)):
                    time.sleep(0.01)
            path = os.path.join(WORK, f"in{i}.jsonl")
            with open(path, "w") as f:
                for j in range(N // K):
                    f.write(json.dumps({"id": f"{i}-{j}", "prompt": f"p {i} {j}"}) + "\n")
            log = subprocess.DEVNULL
            if os.environ.get("TRACE") == "1":
                env["WEIR_LOG"] = "weir_core::rate=debug,weir_runtime=debug"
                log = open(f"/tmp/weir-fixed-late-{late}-{i}.log", "w")
            ps.append(subprocess.Popen([BIN, "run", "--model", "gemini/gemini-2.5-flash", "--base-url", url,
                                        "--input", path, "--output", path + ".out", "--id-field", "id", "--no-state",
                                        "--progress", "never", "--max-retries", "50", "--overwrite"] + EXTRA,
                                       stdout=subprocess.DEVNULL, stderr=log, env=env))
        t0 = time.monotonic()
        if KILL_AT:
            time.sleep(KILL_AT)
            ps[0].kill()
            ps[0].wait()
        elif STOP_AT:
            time.sleep(STOP_AT)
            ps[0].send_signal(signal.SIGSTOP)
            time.sleep(STOP_FOR)
            ps[0].send_signal(signal.SIGCONT)
        for i, p in enumerate(ps):
            if p.wait() != 0 and not (KILL_AT and i == 0):
                sys.exit("weir run failed")
        took = time.monotonic() - t0
        s = json.load(urllib.request.urlopen(url + "/stats"))
    finally:
        sim.terminate()
    # Ideal: the rest of the entered window, then every window full, for the records answered
    # (with a kill, the killed process's unanswered records are not counted).
    done = s["successes"] if KILL_AT else N
    ideal = (5 - late) + ((done - 101) // 100) * 5 + 0.3 if done > 100 else 0.3
    return took, ideal, s


print(f"== fixed 5-s window of 100 requests, whole-second advice, latency 300±10 ms, {N} records, "
      f"{K} process{'es' if K > 1 else ''}, nothing told; weir starts LATE s into the server's window")
for late in [float(x) for x in (sys.argv[1:] or "0.5 1.3 2.2 3.0 3.7 4.4".split())]:
    took, ideal, s = one(late)
    print(f"   late {late:3.1f} s: {took:5.1f} s against {ideal:.1f} s ideal ({ideal / took:.1%}); "
          f"429s {s['rate_limited']} of {s['requests']} ({s['rate_limited'] / s['requests']:.2%})", flush=True)
    if KILL_AT or STOP_AT:
        per = s.get("rate_limited_per_second", [])
        what = f"killed at {KILL_AT:g} s" if KILL_AT else f"stopped at {STOP_AT:g} s for {STOP_FOR:g} s"
        print(f"     first process {what}; 429s per second: {per}", flush=True)
