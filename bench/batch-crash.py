#!/usr/bin/env python3
"""Batch jobs killed at random moments (issue #34's crash test): one `weir run --mode batch`
over N records (default 200,000) against `weir sim`, SIGKILLed at a random moment of each
attempt — while reading, cutting and submitting jobs, polling, or writing answers — and run
again with the same command until it finishes by itself. Then: every record exactly once in
the output and errors files, and no request key in two jobs (the simulator counts the jobs
each key was submitted in; with no faults injected, a key in two jobs was paid twice).

Usage: bench/batch-crash.py   Environment: N (records), KILLS (attempts with a kill, default
12; after them one is left to finish; an attempt that finishes before its kill ends the test),
MAX_KILL_S (latest kill, default 20 s: a whole run takes 15-25 s here), MODEL (default
gemini/gemini-2.5-flash; openai/gpt-4o-mini for the OpenAI Batch API), JOB (requests per job,
default 5000), RUN_S (seconds a simulated job takes, default 3), SEED, WEIR_BIN (else a
release build is made).
"""
import json, os, random, signal, socket, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("WEIR_BIN")
if not BIN:
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "weir"], cwd=ROOT, check=True)
    BIN = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "weir")
N = int(os.environ.get("N", "200000"))
KILLS = int(os.environ.get("KILLS", "12"))
MAX_KILL_S = float(os.environ.get("MAX_KILL_S", "20"))
MODEL = os.environ.get("MODEL", "gemini/gemini-2.5-flash")
JOB = os.environ.get("JOB", "5000")
RUN_S = float(os.environ.get("RUN_S", "3"))
rng = random.Random(int(os.environ.get("SEED", "7")))
WORK = tempfile.mkdtemp(prefix="weir-batch-crash-")


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def main():
    cfg = os.path.join(WORK, "sim.toml")
    with open(cfg, "w") as f:
        f.write(f"[batch]\nrun_secs = {RUN_S}\n")
    port = free_port()
    sim = subprocess.Popen([BIN, "sim", "--listen", f"127.0.0.1:{port}", "--config", cfg],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    sim.stdout.readline()
    url = f"http://127.0.0.1:{port}"
    base = url + "/v1" if MODEL.startswith("openai/") else url
    data = os.path.join(WORK, "in.jsonl")
    with open(data, "w") as f:
        for i in range(N):
            f.write(json.dumps({"id": f"r{i}", "prompt": f"{i} river stone water"}) + "\n")
    out = os.path.join(WORK, "out.jsonl")
    args = [BIN, "run", "--model", MODEL, "--base-url", base, "--input", data, "--output", out, "--id-field", "id",
            "--mode", "batch", "--job-max-requests", JOB, "--poll-secs", "0.2", "--progress", "never"]
    print(f"weir batch crash test: {BIN}; {N} records, {MODEL}, jobs of {JOB}, a job takes {RUN_S:g} s; "
          f"{KILLS} attempts killed at random moments up to {MAX_KILL_S:g} s, then one left to finish")
    try:
        attempt, t0 = 0, time.monotonic()
        while True:
            attempt += 1
            killed_at = rng.uniform(0.05, MAX_KILL_S) if attempt <= KILLS else None
            start = time.monotonic()
            p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                _, err = p.communicate(timeout=killed_at if killed_at else 600)
                secs = time.monotonic() - start
                tail = [l for l in err.splitlines() if l.strip()][-1:] or [""]
                print(f"   attempt {attempt}: ended by itself in {secs:.1f} s, exit {p.returncode}: {tail[0][:120]}")
                if p.returncode in (0, 1):
                    break
                if p.returncode not in (0, 1):
                    print(err[-2000:])
                    sys.exit(f"attempt {attempt} failed with exit {p.returncode}")
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait()
                s = json.load(urllib.request.urlopen(url + "/stats"))
                rows = sum(1 for _ in open(out, "rb")) if os.path.exists(out) else 0
                print(f"   attempt {attempt}: killed at {killed_at:.2f} s; jobs so far {s['batch_jobs']}, "
                      f"result rows so far {rows}")
        total = time.monotonic() - t0
        ids = []
        for path in (out, os.path.join(WORK, "out.errors.jsonl")):
            if os.path.exists(path):
                ids += [json.loads(l)["id"] for l in open(path) if l.strip()]
        s = json.load(urllib.request.urlopen(url + "/stats"))
        once = len(ids) == N and len(set(ids)) == N
        online = s["requests"]
        print(f"== {attempt} attempts in {total:.0f} s: {len(ids)} rows for {N} records, every record exactly once: "
              f"{once}")
        print(f"   jobs {s['batch_jobs']}; keys submitted in jobs {s['batch_keys']}, in two jobs "
              f"{s['batch_keys_in_two_jobs']}; online calls {online} (each fresh start sends its first record "
              f"online); jobs + online = {s['batch_keys'] + online} for {N} records")
        ok = once and s["batch_keys_in_two_jobs"] == 0 and s["batch_keys"] + online == N
        print("   PASS" if ok else "   FAIL")
        sys.exit(0 if ok else 1)
    finally:
        sim.kill()


if __name__ == "__main__":
    main()
