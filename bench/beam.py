#!/usr/bin/env python3
"""Apache Beam RunInference against one `weir sim` quota: Beam's own GeminiModelHandler vs
weir.beam.WeirModelHandler, side by side in one invocation (truth read from the simulator's
/stats; every prompt distinct and no cache, so every success is a call made).

The workload (issue #15): N = 400 prompts, a quota of R = 100 requests per W = 5 s window
(advice rounded to whole seconds, as real servers give it), 0.3 s latency, DirectRunner.
The ideal completion time has every window full from the start: (ceil(N/R) - 1) * W + latency.
Cases, each ROUNDS times, interleaved (medians reported):
  beam       Beam's GeminiModelHandler on DirectRunner defaults, pointed at the simulator with
             GOOGLE_GEMINI_BASE_URL; max_batch_size=1, because with larger batches it sends a
             whole batch as one request and returns one result per batch (see
             ../shared/reference/beam.md), which would not be the same work;
  beam-8     the same with --direct_num_workers=8 --direct_running_mode=multi_threading;
  weir       weir.beam.WeirModelHandler with its defaults, nothing told about the quota;
  weir-told  the same, told the quota (rpm=100, limit_window=5), as a user who knows it would.
The time is the pipeline's (p.run() to wait_until_finish), runner start-up included.
Usage: WEIR_PY_VENV/bin/python bench/beam.py [ROUNDS]   (needs scripts/test-python's venv
with the weir package installed; builds the release weir binary for the simulator).
"""
import json, math, os, socket, statistics, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
subprocess.run(["cargo", "build", "--release", "-q", "-p", "weir"], cwd=ROOT, check=True)
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
WORK = tempfile.mkdtemp()
BIN = os.path.join(WORK, "weir")
subprocess.run(["cp", os.path.join(TARGET, "release", "weir"), BIN], check=True)

N, R, W, LATENCY = 400, 100, 5, 0.3
IDEAL = (math.ceil(N / R) - 1) * W + LATENCY


def start_sim():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    p = subprocess.Popen([BIN, "sim", "--listen", f"127.0.0.1:{port}", "--rpm", str(R), "--window-secs", str(W),
                          "--latency-ms", str(int(LATENCY * 1000)), "--round-advice"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.readline()
    return p, f"http://127.0.0.1:{port}"


def run_case(name, rnd):
    import logging
    logging.getLogger().setLevel(logging.CRITICAL)  # Beam's handler logs every 429 with a traceback
    import apache_beam as beam
    from apache_beam.ml.inference.base import RunInference
    from apache_beam.options.pipeline_options import PipelineOptions

    sim, url = start_sim()
    try:
        prompts = [f"{name} round {rnd} prompt {i:04d} {time.time_ns()}: name a river" for i in range(N)]
        options = []
        if name.startswith("weir"):
            from weir.beam import WeirModelHandler
            told = {"rpm": R, "limit_window": W} if name == "weir-told" else {}
            handler = WeirModelHandler("gemini/gemini-2.5-flash", url, **told)
        else:
            os.environ["GOOGLE_GEMINI_BASE_URL"] = url
            from apache_beam.ml.inference.gemini_inference import GeminiModelHandler, generate_from_string
            handler = GeminiModelHandler("gemini-2.5-flash", generate_from_string, api_key="sim-key", max_batch_size=1)
            if name == "beam-8":
                options = ["--direct_num_workers=8", "--direct_running_mode=multi_threading"]
        out = os.path.join(WORK, f"{name}-{rnd}")
        p = beam.Pipeline(options=PipelineOptions(options))
        _ = (p | beam.Create(prompts) | RunInference(handler) | beam.Map(lambda r: r.example) | beam.io.WriteToText(out))
        t0 = time.monotonic()
        p.run().wait_until_finish()
        secs = time.monotonic() - t0
        s = json.load(urllib.request.urlopen(url + "/stats"))
        written = sum(1 for f in os.listdir(WORK) if f.startswith(f"{name}-{rnd}") for _ in open(os.path.join(WORK, f)))
    finally:
        sim.terminate(); sim.wait()
    if os.environ.get("BENCH_VERBOSE"):
        print(f"    {name}: successes per second {s['successes_per_second']}", flush=True)
    return secs, s["successes"], s["rate_limited"], s["requests"], written


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    cases = os.environ.get("BENCH_CASES", "beam,beam-8,weir,weir-told").split(",")
    results = {c: [] for c in cases}
    print(f"N={N} prompts, quota {R} requests per {W} s (advice rounded), latency {LATENCY} s; ideal {IDEAL:.1f} s")
    for rnd in range(rounds):
        for c in cases:
            secs, ok, limited, requests, written = run_case(c, rnd)
            results[c].append((secs, limited / max(requests, 1)))
            print(f"  round {rnd + 1} {c:9s} {secs:6.1f} s  share of ideal {IDEAL / secs:.3f}  "
                  f"429s {limited} of {requests} ({limited / max(requests, 1):.2%})  successes {ok}  rows written {written}",
                  flush=True)
            if written != N:
                sys.exit(f"{c}: {written} rows written, expected {N}")
    print("medians:")
    med = {c: statistics.median(s for s, _ in results[c]) for c in cases}
    for c in cases:
        print(f"  {c:9s} {med[c]:6.1f} s  share of ideal {IDEAL / med[c]:.3f}  "
              f"429 share {statistics.median(x for _, x in results[c]):.2%}")
    for w in ("weir", "weir-told"):
        if w in med and "beam" in med and "beam-8" in med:
            print(f"  {w} ÷ beam (defaults) speed: {med['beam'] / med[w]:.1f}×; {w} ÷ beam-8: {med['beam-8'] / med[w]:.1f}×")


if __name__ == "__main__":
    main()
