#!/usr/bin/env python3
"""Batching and length bucketing: what they buy, measured side by side in one invocation.

Cases (each mode is run ROUNDS times, interleaved, and the median reported):
  1. Embeddings under a requests-per-window quota (`weir sim`, Gemini batchEmbedContents):
     records/s with one record per request (--batch-size 1) against the default batching.
  2. The local model (local/all-minilm-l6-v2, in-process, CPU): records/s and padding ratio with
     batches in arrival order, length buckets (auto) and a sorted window.
  3. A Vertex AI endpoint's :predict on `weir sim`, whose latency is set by the longest instance
     of a request (a padded batch): records/s in arrival order against length buckets, at the
     same fixed concurrency.
The datasets mix lengths over two orders of magnitude; every run gets prompts of its own (a
run tag in each), and runs without state, so no cache can answer a call.
Usage: bench/batching.py [CASE...]   (default: all). Builds weir --release --features local.
"""
import json, os, socket, statistics, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
subprocess.run(["cargo", "build", "--release", "-q", "-p", "weir", "--features", "local"], cwd=ROOT, check=True)
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
BIN = os.path.join(TARGET, "release", "weir")
WORK = tempfile.mkdtemp()
ROUNDS = int(os.environ.get("ROUNDS", "3"))
WORDS = ["river", "stone", "light", "green", "house", "music", "paper", "storm", "field", "glass"]


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def start_sim(config):
    path = os.path.join(WORK, f"sim-{time.time_ns()}.toml")
    with open(path, "w") as f:
        f.write(config)
    port = free_port()
    p = subprocess.Popen([BIN, "sim", "--listen", f"127.0.0.1:{port}", "--config", path],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.readline()
    return p, f"http://127.0.0.1:{port}"


def stats(url):
    return json.load(urllib.request.urlopen(url + "/stats"))


def dataset(n, tag, lengths):
    """n records whose prompts have lengths (in words, one token each) drawn in turn from
    `lengths`, mixed so arrival order puts short and long together."""
    path = os.path.join(WORK, f"{tag}.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            k = lengths[(i * 7919) % len(lengths)]
            words = " ".join(WORDS[(i + 3 * w) % len(WORDS)] for w in range(k))
            f.write(json.dumps({"id": i, "prompt": f"{tag} {i} {words}"}) + "\n")
    return path


def run(args, env=None):
    out = os.path.join(WORK, f"out-{time.time_ns()}.jsonl")
    t = time.monotonic()
    p = subprocess.run([BIN, "run", "--no-state", "--progress", "never", "--id-field", "id", "--output", out, *args],
                       capture_output=True, text=True, env={**os.environ, **(env or {})})
    elapsed = time.monotonic() - t
    if p.returncode != 0:
        sys.exit(f"weir run failed ({p.returncode}): {' '.join(args)}\n{p.stderr}")
    with open(out) as f:
        rows = sum(1 for _ in f)
    padding = None
    for line in p.stderr.splitlines():
        if "batches:" in line:
            padding = float(line.split("padding ")[1].split("×")[0])
    return {"records": rows, "secs": elapsed, "rps": rows / elapsed, "padding": padding, "summary": p.stderr}


def compare(key, name, modes, make_args, n, lengths, env=None, note=""):
    """Runs each mode ROUNDS times, interleaved, each run on prompts of its own."""
    results = {m: [] for m in modes}
    for r in range(ROUNDS):
        for m in modes:
            tag = f"{key}-{m.replace(' ', '')}-{r}"
            res = run(["--input", dataset(n, tag, lengths), *make_args(m)], env)
            results[m].append(res)
    print(f"\n## {name}{note}")
    base = statistics.median(x["rps"] for x in results[modes[0]])
    print(f"| mode | records/s (median of {ROUNDS}) | × {modes[0]} | padding (padded ÷ real tokens) |")
    print("|---|---|---|---|")
    for m in modes:
        rps = statistics.median(x["rps"] for x in results[m])
        pads = [x["padding"] for x in results[m] if x["padding"] is not None]
        pad = f"{statistics.median(pads):.2f}×" if pads else "—"
        runs = ", ".join(f"{x['rps']:.1f}" for x in results[m])
        print(f"| {m} | {rps:,.1f} ({runs}) | {rps / base:.2f}× | {pad} |")
    return results


def case1():
    # 60 requests per 5 s window (12 requests/s) and records of 2 to 200 words.
    sim, url = start_sim("[quota]\nrequests_per_window = 60\nwindow_secs = 5.0\n[embedding]\ndimensions = 64\n")
    try:
        lengths = [2, 5, 20, 50, 200]
        # Both modes make 240 requests (one per request: 240 records; batches of 100: 24,000),
        # so both span the same windows, the first one's burst included.
        modes = [("one per request", 240, ["--batch-size", "1"]), ("batches of 100 (default)", 24000, [])]
        res = {m: [] for m, _, _ in modes}
        for r in range(ROUNDS):
            for mode, n, extra in modes:
                tag = f"embed-quota-{len(extra)}-{r}"
                # A key of its own per run: the quota is per key, so no run meets a window
                # another one filled.
                res[mode].append(run(["--task", "embed", "--model", "gemini/gemini-embedding-001", "--base-url", url,
                                      "--input", dataset(n, tag, lengths), *extra], {"GEMINI_API_KEY": f"k-{tag}"}))
        print("\n## 1. Embeddings under a quota of 60 requests per 5 s (weir sim, batchEmbedContents)")
        print(f"| mode | records | records/s (median of {ROUNDS}) | × one per request |")
        print("|---|---|---|---|")
        base = statistics.median(x["rps"] for x in res["one per request"])
        for m, rounds in res.items():
            rps = statistics.median(x["rps"] for x in rounds)
            runs = ", ".join(f"{x['rps']:.1f}" for x in rounds)
            print(f"| {m} | {rounds[0]['records']:,} | {rps:,.1f} ({runs}) | {rps / base:.1f}× |")
        s = stats(url)
        print(f"\nsimulator: {s['embed_batches']:,} embedding requests, {s['embed_inputs']:,} texts, {s['rate_limited']} answered 429")
    finally:
        sim.kill()


def case2():
    env = {}
    if "WEIR_MODELS" not in os.environ:
        env["WEIR_MODELS"] = os.path.expanduser("~/.cache/weir/models")
    lengths = [2, 4, 8, 16, 32, 64, 128, 250]
    modes = ["arrival order", "buckets auto (doubling)", "buckets auto:4 (quantiles)", "sorted window 512"]
    flags = {"arrival order": ["--buckets", "off"], "buckets auto (doubling)": ["--buckets", "auto"],
             "buckets auto:4 (quantiles)": ["--buckets", "auto:4"], "sorted window 512": ["--sort-window", "512"]}
    compare("local", "2. Local model local/all-minilm-l6-v2 (CPU, in-process), batches of 32, 1,000 records",
            modes, lambda m: ["--task", "embed", "--model", "local/all-minilm-l6-v2", "--batch-size", "32", *flags[m]],
            1000, lengths, env)


def case3():
    # Latency of a :predict request: 20 ms + 0.5 ms per prompt token of its longest instance
    # (+ 1 ms per token of the longest answer, all answers 8 tokens).
    config = ("api_keys = [\"ya29.bench\"]\n[latency]\nfixed_ms = 20.0\nper_token_ms = 1.0\n"
              "[output]\nmin_tokens = 8\nmax_tokens = 8\n[predict]\nprompt_token_ms = 0.5\n")
    sim, url = start_sim(config)
    key = os.path.join(WORK, "key.pem")
    subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", key],
                   check=True, capture_output=True)
    sa = os.path.join(WORK, "sa.json")
    with open(sa, "w") as f:
        json.dump({"type": "service_account", "project_id": "p", "private_key_id": "k", "private_key": open(key).read(),
                   "client_email": "bench@p.iam.gserviceaccount.com", "token_uri": url + "/token"}, f)
    env = {"GOOGLE_APPLICATION_CREDENTIALS": sa, "HOME": WORK}
    lengths = [5, 10, 25, 50, 100, 250, 500]
    flags = {"arrival order": ["--buckets", "off"], "buckets auto (doubling)": ["--buckets", "auto"],
             "buckets auto:4 (quantiles)": ["--buckets", "auto:4"]}
    try:
        compare("predict", "3. Vertex :predict on weir sim, latency set by the longest instance; batches of 16, 4 calls in flight, 2,000 records",
                list(flags), lambda m: ["--model", "vertex_endpoint/1", "--project", "p", "--base-url", url,
                                        "--batch-size", "16", "--concurrency", "fixed", "--max-concurrency", "4",
                                        *flags[m]], 2000, lengths, env)
    finally:
        sim.kill()


CASES = {"1": case1, "2": case2, "3": case3}
print(f"machine: {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}; ROUNDS={ROUNDS}")
for c in sys.argv[1:] or list(CASES):
    CASES[c]()
