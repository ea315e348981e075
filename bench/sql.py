#!/usr/bin/env python3
"""`weir sql` benchmarks, against `weir sim` on loopback (truth read from its /stats).

Cases:
  1. cluster: a Ballista scheduler and EXECUTORS (default 2) weir executors answer one query
     against one simulated quota (R requests per W-second window, advice rounded to whole
     seconds, latency LATENCY_MS, default 50, ±10 ms; SIM_ARGS adds simulator flags, e.g.
     `--window fixed`; SERVER=ref uses bench/refserver.py instead of the simulator; WEIR_ARGS
     adds executor flags, e.g. `--quota-store off`), nothing told:
     completion time against the ideal (every window full from the start), the share of 429s,
     the rows each executor answered and how many shared the quota (issue #32);
  2. overhead: the same N rows (zero latency) through `weir sql` (COPY … TO a JSONL file) and
     `weir run --no-state`, side by side, ROUNDS rounds alternating; medians.
  3. credentials: case 1 without credentials, with mutual TLS, and with mutual TLS and a shared
     token (every process on 127.0.0.2 behind weir's guards; certificates from `weir cluster
     certs`, token from `weir cluster token`), ROUNDS rounds (default 2) alternating: medians, and
     the ratio of the plain time to each.
Usage: bench/sql.py [CASE...]   (default: 1 and 2). Builds weir with --features cluster (release;
WEIR_BENCH_PROFILE=debug uses the debug build instead, for quota-bound cases whose time the quota
sets; WEIR_BENCH_FEATURES=local,cluster reuses a build made with those features; WEIR_BIN=PATH measures
that binary, built with --features cluster, without building).
"""
import json, os, socket, statistics, subprocess, sys, tempfile, time, urllib.request

from servers import start_quota

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.environ.get("WEIR_BENCH_PROFILE", "release")
FEATURES = os.environ.get("WEIR_BENCH_FEATURES", "cluster")
WORK = tempfile.mkdtemp()
# A copy: another build into the same target directory (other features) must not swap it mid-run.
BIN = os.path.join(WORK, "weir")
if os.environ.get("WEIR_BIN"):
    # WEIR_BIN=path measures that build (made with --features cluster) as it is.
    subprocess.run(["cp", os.environ["WEIR_BIN"], BIN], check=True)
    print(f"weir from {os.environ['WEIR_BIN']}")
else:
    subprocess.run(["cargo", "build", "-q", "-p", "weir", "--features", FEATURES] + (["--release"] if PROFILE == "release" else []),
                   cwd=ROOT, check=True)
    TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    subprocess.run(["cp", os.path.join(TARGET, PROFILE, "weir"), BIN], check=True)
    print(f"weir built with the {PROFILE} profile")
MODEL = "gemini/gemini-2.5-flash"


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def scheduler_port(host):
    """A free port for a scheduler whose quota service (the port below) is free too."""
    while True:
        p = free_port()
        try:
            s = socket.socket(); s.bind((host, p - 1)); s.close()
            return p
        except OSError:
            pass


def wait_port(port):
    for _ in range(400):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


def start_sim(*args):
    port = free_port()
    p = subprocess.Popen([BIN, "sim", "--listen", f"127.0.0.1:{port}", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.readline()
    return p, f"http://127.0.0.1:{port}"


def get(url):
    return urllib.request.urlopen(url).read().decode()


def sql(*args, cwd=WORK):
    r = subprocess.run([BIN, "sql", *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"weir sql {args}: {r.stderr}")
    return r


def dataset(name, n, parts=1):
    """n rows of unique prompts (tagged with the time, so no two runs share one) in `parts` Parquet
    files under WORK/name/, and the same rows as WORK/name.jsonl."""
    tag = time.time_ns()
    path = os.path.join(WORK, name + ".jsonl")
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "prompt": f"{tag} {i}: write one sentence about a river."}) + "\n")
    os.makedirs(os.path.join(WORK, name), exist_ok=True)
    for p in range(parts):
        sql(f"COPY (SELECT * FROM '{path}' WHERE id % {parts} = {p}) TO '{name}/p{p}.parquet'")
    return path


def cluster_case(tls=False, token=False):
    """Case 1; with `tls`, over mutual TLS, with `token`, with a shared token too. Returns the
    completion time."""
    R, W, N = 100, 5, 2000
    host = "127.0.0.2" if tls or token else "127.0.0.1"
    certs, token_file = os.path.join(WORK, "certs"), os.path.join(WORK, "token")
    if tls and not os.path.exists(certs):
        subprocess.run([BIN, "cluster", "certs", "--out", certs, "--name", "s", "--name", "e0", "--name", "e1",
                        "--name", "c"], check=True, capture_output=True)
    if token and not os.path.exists(token_file):
        subprocess.run([BIN, "cluster", "token", "--out", token_file], check=True, capture_output=True)
    def flags(name):
        f = []
        if tls:
            f += ["--tls-ca", f"{certs}/ca.pem", "--tls-cert", f"{certs}/{name}.pem", "--tls-key", f"{certs}/{name}.key"]
        if token:
            f += ["--token-file", token_file]
        return f
    lat = int(os.environ.get("LATENCY_MS", "50"))
    n_exec = int(os.environ.get("EXECUTORS", "2"))
    sim_args = os.environ.get("SIM_ARGS", "").split()
    weir_args = os.environ.get("WEIR_ARGS", "").split()
    # SERVER=ref measures against bench/refserver.py instead of weir sim (SIM_ARGS then ignored).
    sim, url, sim_args = start_quota(start_sim, R, W, lat, sim_args)
    procs = [sim]
    try:
        sched = scheduler_port(host)
        procs.append(subprocess.Popen([BIN, "cluster", "scheduler", "--bind", f"{host}:{sched}", *flags("s")],
                                      stderr=subprocess.DEVNULL, cwd=WORK))
        wait_port(sched)
        metrics = []
        for e in range(n_exec):
            port, grpc, mport = free_port(), free_port(), free_port()
            procs.append(subprocess.Popen(
                [BIN, "cluster", "executor", "--scheduler", f"{host}:{sched}", "--host", host, "--port", str(port),
                 "--grpc-port", str(grpc), "--slots", "2", "--metrics-listen", f"127.0.0.1:{mport}", "--base-url", url,
                 "--max-retries", "50", *flags(f"e{e % 2}"), *weir_args],
                stderr=subprocess.DEVNULL, cwd=WORK))
            wait_port(port); wait_port(mport)
            metrics.append(mport)
        parts = max(4, n_exec)
        dataset("cluster", N, parts=parts)
        ideal = ((N - 1) // R) * W + lat / 1000
        time.sleep(W + 1)  # the ideal starts from an empty window
        urllib.request.urlopen(urllib.request.Request(url + "/stats/reset", method="POST"))
        t0 = time.monotonic()
        sql("--cluster", f"{'dfs' if tls else 'df'}://{host}:{sched}", *flags("c"), "--partitions", str(parts), "--table", "t=cluster",
            f"COPY (SELECT id, llm_generate('{MODEL}', prompt) AS answer FROM t) TO 'cluster-out.parquet'")
        secs = time.monotonic() - t0
        s = json.loads(get(url + "/stats"))
        time.sleep(1.2)  # the executors' gauges are updated every second
        rows, shared = [], []
        for m in metrics:
            page = get(f"http://127.0.0.1:{m}/metrics").splitlines()
            rows.append(sum(int(float(l.split()[-1])) for l in page
                            if l.startswith("weir_records_total{") and 'outcome="success"' in l))
            shared.append(max([int(float(l.split()[-1])) for l in page if l.startswith("weir_quota_processes{")] or [0]))
        answered = int(sql("--format", "jsonl", "SELECT count(answer) AS n FROM 'cluster-out.parquet'").stdout.split(":")[1].strip(" }\n"))
        how = " over mutual TLS" if tls else ""
        how += (" and" if tls else " with") + " a shared token" if token else ""
        told = f", executors given {' '.join(weir_args)}" if weir_args else ""
        print(f"== 1. {n_exec} executors{how}, one quota of {R} requests per {W} s (advice in "
              f"whole seconds{', ' + ' '.join(sim_args) if sim_args else ''}), latency {lat}±10 ms, {N} rows{told}")
        print(f"   {secs:5.1f} s against {ideal:.1f} s ideal ({ideal / secs:.1%} of the quota); 429s {s['rate_limited']} of "
              f"{s['requests']} ({s['rate_limited'] / s['requests']:.2%}); rows answered per executor {rows}; "
              f"processes sharing the quota, as each executor saw it {shared}; non-null answers {answered} of {N}")
        return secs
    finally:
        for p in procs:
            p.terminate()


def tls_case():
    rounds = int(os.environ.get("ROUNDS", "2"))
    modes = {"no credentials": {}, "mutual TLS": {"tls": True}, "mutual TLS and a token": {"tls": True, "token": True}}
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for m, kw in modes.items():
            times[m].append(cluster_case(**kw))
    plain = statistics.median(times["no credentials"])
    for m, t in times.items():
        med = statistics.median(t)
        print(f"== 3. {m}: {', '.join(f'{x:.1f}' for x in t)} s, median {med:.1f} s; plain ÷ this {plain / med:.3f}")


def overhead_case():
    N, rounds = int(os.environ.get("N", "20000")), int(os.environ.get("ROUNDS", "3"))
    sim, url = start_sim()
    times = {"run": [], "sql": []}
    try:
        for r in range(rounds):
            for mode in ["run", "sql"]:
                path = dataset(f"o{r}{mode}", N)
                out = os.path.join(WORK, f"o{r}{mode}.out.jsonl")
                t0 = time.monotonic()
                if mode == "run":
                    subprocess.run([BIN, "run", "--model", MODEL, "--base-url", url, "--input", path, "--output", out,
                                    "--id-field", "id", "--no-state", "--progress", "never"], check=True,
                                   capture_output=True)
                else:
                    sql("--base-url", url, f"COPY (SELECT id, llm_generate('{MODEL}', prompt) AS answer FROM '{path}') TO '{out}'")
                times[mode].append(time.monotonic() - t0)
                with open(out) as f:
                    assert sum(1 for _ in f) == N, f"{mode}: wrong row count"
        s = json.loads(get(url + "/stats"))
        assert s["requests"] == 2 * rounds * N, f"{s['requests']} calls for {2 * rounds * N} rows"
    finally:
        sim.terminate()
    run, q = statistics.median(times["run"]), statistics.median(times["sql"])
    print(f"== 2. {N} rows, zero latency: weir run --no-state {run:.2f} s ({N / run:,.0f} rows/s), "
          f"weir sql {q:.2f} s ({N / q:,.0f} rows/s); sql ÷ run time {q / run:.2f} (medians of {rounds}; "
          f"runs {' '.join(f'{t:.2f}' for t in times['run'])} / {' '.join(f'{t:.2f}' for t in times['sql'])}); "
          f"the simulator saw {s['requests']} calls")


for c in sys.argv[1:] or ["1", "2"]:
    {"1": cluster_case, "2": overhead_case, "3": tls_case}[c]()
