#!/usr/bin/env python3
"""Adaptive concurrency against a small healthy server (an outside tester's finding, 2026-12-03).

A Python `ThreadingHTTPServer` that answers every OpenAI chat completion at once, over HTTP/1.1
keep-alive: its answers take ~40 ms at any load (its writes wait on delayed acknowledgements),
after a few fast first ones. weir's adaptive limit took that for load and fell to 1 call out.
This runs `weir run` with the default (adaptive) limit and with `--concurrency fixed`,
alternating, ROUNDS times each, every run into a fresh output (no cache hits: every record is a
call), and prints each run's records per second and final limit, then the medians.

    WEIR_BIN=target/release/weir python3 bench/small-server.py [RECORDS] [ROUNDS]
"""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RECORDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
WEIR = os.environ.get("WEIR_BIN", "target/release/weir")


class Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        self.rfile.read(length)
        body = json.dumps({
            "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}/v1"
    work = tempfile.mkdtemp(prefix="weir-small-server-")
    data = os.path.join(work, "in.jsonl")
    with open(data, "w") as f:
        for i in range(RECORDS):
            f.write(json.dumps({"id": i, "prompt": f"say {i}"}) + "\n")
    got = {"adaptive": [], "fixed": []}
    for r in range(ROUNDS):
        for mode in ("adaptive", "fixed"):
            out = os.path.join(work, f"{mode}-{r}.jsonl")
            cmd = [WEIR, "run", "--model", "openai/m", "--base-url", base, "--input", data, "--output", out,
                   "--id-field", "id", "--progress", "never", "--no-report", "--no-state", "--quota-store", "off"]
            if mode == "fixed":
                cmd += ["--concurrency", "fixed"]
            p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OPENAI_API_KEY": "k"})
            rate = re.search(r"records in ([\d.]+) s \(([\d,.]+)/s\)", p.stderr)
            limit = re.search(r"concurrency (\d+)", p.stderr)
            if p.returncode != 0 or not rate:
                sys.exit(f"{mode}: exit {p.returncode}\n{p.stderr}")
            per_s = RECORDS / float(rate.group(1))
            got[mode].append(per_s)
            print(f"round {r + 1} {mode:8} {per_s:7.0f} records/s  final limit {limit.group(1) if limit else '?'}",
                  flush=True)
    a, f = statistics.median(got["adaptive"]), statistics.median(got["fixed"])
    print(f"median: adaptive {a:.0f}/s, fixed {f:.0f}/s, adaptive/fixed {a / f:.2f}")
    server.shutdown()


if __name__ == "__main__":
    main()
