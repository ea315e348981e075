#!/usr/bin/env python3
"""Streaming latency: what weir adds between the endpoint and a consumer of its output.

Cases:
  1. time to first token added by weir: `weir run --stream --output -` against `weir sim`
     (first token after 200 ms, a token every 20 ms, 20-40 tokens), 64 streams at once
     (--concurrency fixed --max-concurrency 64), every prompt distinct (no cache answers).
     The simulator logs when it handed each answer's first text to its connection
     (GET /streams); this script reads weir's stdout as a consumer would and notes when each
     record's first event arrived. Added = consumer's time − simulator's time (one clock).
  2. end-to-end latency of records appended to a followed file (`--follow`, rows to stdout):
     a writer appends one record every ~20 ms; latency = row read − line appended, minus
     nothing (the simulator answers at once). For text generation (a call per record) and
     for embeddings (records batched, with the default 20 ms linger).
Usage: bench/stream.py [CASE...] (default: all). Set ROUNDS (default 3) to repeat each case;
medians of the rounds are printed. Needs a release build (it makes one, unless WEIR_BIN
names the binary to measure).
"""
import json, os, random, socket, statistics, subprocess, sys, tempfile, threading, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("WEIR_BIN")
if not BIN:
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "weir"], cwd=ROOT, check=True)
    TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    BIN = os.path.join(TARGET, "release", "weir")
WORK = tempfile.mkdtemp()
ROUNDS = int(os.environ.get("ROUNDS", "3"))


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def start_sim(config):
    port = free_port()
    path = os.path.join(WORK, f"sim-{port}.toml")
    with open(path, "w") as f:
        f.write(config)
    p = subprocess.Popen([BIN, "sim", "--listen", f"127.0.0.1:{port}", "--config", path],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.readline()
    return p, f"http://127.0.0.1:{port}"


def get(url):
    return json.load(urllib.request.urlopen(url))


def pct(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def read_lines(stream, sink):
    """Reads a pipe in raw chunks, stamping each complete line with the time its chunk came."""
    buf = b""
    fd = stream.fileno()
    while True:
        chunk = os.read(fd, 1 << 16)
        now = time.time_ns() // 1000
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            sink.append((now, line))


def ttft_round(n, concurrency, rnd):
    sim, url = start_sim(
        "seed = %d\ncapture_requests = %d\n[latency]\nfixed_ms = 200\nper_token_ms = 20\n"
        "[output]\nmin_tokens = 20\nmax_tokens = 40\n" % (rnd + 1, n)
    )
    data = os.path.join(WORK, f"ttft-{rnd}.jsonl")
    with open(data, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"s{i}", "prompt": f"round {rnd} prompt {i:06d}: tell me about rivers"}) + "\n")
    try:
        p = subprocess.Popen([BIN, "run", "--model", "openai/sim-1", "--base-url", url + "/v1", "--input", data,
                              "--output", "-", "--errors", os.path.join(WORK, f"e-{rnd}.jsonl"), "--stream",
                              "--id-field", "id", "--concurrency", "fixed", "--max-concurrency", str(concurrency),
                              "--progress", "never"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lines = []
        read_lines(p.stdout, lines)
        err = p.stderr.read().decode()
        if p.wait() != 0:
            sys.exit(f"weir run failed: {err}")
        streams = get(url + "/streams")
        peak = get(url + "/stats")["peak_in_flight"]
    finally:
        sim.terminate()
    first = {}
    rows = 0
    for ts, line in lines:
        v = json.loads(line)
        if "delta" in v:
            first.setdefault(v["id"], ts)
        elif "response" in v:
            rows += 1
    sent = {}
    for s in streams:
        i = int(s["prompt"].split("prompt ")[1].split(":")[0])
        if s["first_text_us"] is not None:
            sent[f"s{i}"] = s["first_text_us"]
    added = [(first[k] - sent[k]) / 1000.0 for k in sent if k in first]
    assert rows == n and len(added) == n, (rows, len(added), n)
    summary = [l.strip() for l in err.splitlines() if "time to first token" in l]
    return added, peak, summary


def ttft_case():
    n, c = 1280, 64
    print(f"== 1. time to first token added by weir: {n} streamed calls, {c} at once, {ROUNDS} rounds")
    p50s, p99s = [], []
    for rnd in range(ROUNDS):
        added, peak, summary = ttft_round(n, c, rnd)
        p50, p95, p99, mx = (pct(added, q) for q in (0.5, 0.95, 0.99, 1.0))
        p50s.append(p50); p99s.append(p99)
        print(f"   round {rnd + 1}: added p50 {p50:.3f} ms, p95 {p95:.3f} ms, p99 {p99:.3f} ms, max {mx:.3f} ms "
              f"(server peak in flight {peak})")
        for s in summary:
            print(f"      weir: {s}")
    print(f"   median of rounds: added p50 {statistics.median(p50s):.3f} ms, p99 {statistics.median(p99s):.3f} ms")


def follow_round(task, n, gap_ms, rnd):
    sim, url = start_sim("seed = %d\n" % (rnd + 1))
    data = os.path.join(WORK, f"follow-{task}-{rnd}.jsonl")
    open(data, "w").close()
    model = "openai/text-embedding-3-small" if task == "embed" else "openai/sim-1"
    try:
        p = subprocess.Popen([BIN, "run", "--model", model, "--task", task, "--base-url", url + "/v1",
                              "--follow", data, "--output", "-", "--errors", os.path.join(WORK, f"fe-{task}-{rnd}.jsonl"),
                              "--id-field", "id", "--progress", "never"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lines = []
        reader = threading.Thread(target=read_lines, args=(p.stdout, lines))
        reader.start()
        time.sleep(0.5)
        appended = {}
        rng = random.Random(rnd)
        with open(data, "a") as f:
            for i in range(n):
                f.write(json.dumps({"id": f"f{i}", "prompt": f"round {rnd} record {i}: tell me about lakes"}) + "\n")
                f.flush()
                appended[f"f{i}"] = time.time_ns() // 1000
                time.sleep(rng.uniform(0.5, 1.5) * gap_ms / 1000.0)
        deadline = time.time() + 10
        while len(lines) < n and time.time() < deadline:
            time.sleep(0.05)
        p.send_signal(2)
        reader.join(timeout=30)
        err = p.stderr.read().decode()
        p.wait()
    finally:
        sim.terminate()
    got = {}
    for ts, line in lines:
        v = json.loads(line)
        got[v["id"]] = ts
    assert len(got) == n, (len(got), n, err)
    return [(got[k] - appended[k]) / 1000.0 for k in appended]


def follow_case():
    n, gap = 500, 20
    print(f"== 2. --follow: {n} records appended one every ~{gap} ms, row latency from append to stdout, {ROUNDS} rounds")
    for task, what in [("generate", "text (a call per record)"), ("embed", "embeddings (batched, default 20 ms linger)")]:
        p50s, p99s = [], []
        for rnd in range(ROUNDS):
            lat = follow_round(task, n, gap, rnd)
            p50, p95, p99, mx = (pct(lat, q) for q in (0.5, 0.95, 0.99, 1.0))
            p50s.append(p50); p99s.append(p99)
            print(f"   {what}, round {rnd + 1}: p50 {p50:.1f} ms, p95 {p95:.1f} ms, p99 {p99:.1f} ms, max {mx:.1f} ms")
        print(f"   {what}: median of rounds p50 {statistics.median(p50s):.1f} ms, p99 {statistics.median(p99s):.1f} ms")


CASES = {"1": ttft_case, "2": follow_case}
if __name__ == "__main__":
    for c in sys.argv[1:] or sorted(CASES):
        CASES[c]()
