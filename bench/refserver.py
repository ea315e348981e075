#!/usr/bin/env python3
"""A stand-in for the Gemini API's quota, written apart from `weir sim` (no code shared with
weir), so that the quota benchmarks are not measured only against weir's own simulator.

It answers `POST /v1beta/models/{model}:generateContent` (and `:batchEmbedContents`, one
vector per request, the call counted as one request) after a latency, and enforces a fixed
window: at most RPM requests are admitted per WINDOW seconds, counted when a request arrives,
the windows starting when the server starts. A request over the quota is refused at once with
HTTP 429 and the Gemini API's error body: `RESOURCE_EXHAUSTED`, a `QuotaFailure` naming a
per-minute quota, and a `RetryInfo` whose `retryDelay` is the time to the window's end rounded
up to whole seconds. No `Retry-After` header, as the Gemini API sends none.

`GET /stats` gives what the benchmarks read from `weir sim`'s: requests, rate_limited, and the
successes and refusals per second since the last `POST /stats/reset`.

Usage: refserver.py --listen 127.0.0.1:PORT --rpm 100 --window-secs 5 --latency-ms 300
                    [--jitter-ms 20] [--no-advice] [--zero-after SECS]
Prints one line once it listens.
"""
import argparse, asyncio, json, math, random, time


class Quota:
    def __init__(self, limit, window):
        self.limit, self.window = limit, window
        self.start = time.monotonic()
        self.index, self.used = 0, 0

    def admit(self, now):
        """Whether a request arriving at `now` is admitted; else the seconds to the window's end."""
        index = int((now - self.start) // self.window)
        if index != self.index:
            self.index, self.used = index, 0
        if self.used < self.limit:
            self.used += 1
            return True, 0.0
        return False, self.start + (index + 1) * self.window - now


class Stats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.origin = time.monotonic()
        self.requests = self.rate_limited = 0
        self.ok_per_s, self.refused_per_s = [], []

    def count(self, per_second, now):
        i = int(now - self.origin)
        while len(per_second) <= i:
            per_second.append(0)
        per_second[i] += 1

    def json(self):
        return {"requests": self.requests, "rate_limited": self.rate_limited,
                "successes_per_second": self.ok_per_s, "rate_limited_per_second": self.refused_per_s}


def refusal(model, wait, advise=True):
    delay = max(1, math.ceil(wait))
    retry = [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": f"{delay}s"}] if advise else []
    return 429, {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED",
                           "message": "You exceeded your current quota, please check your plan and billing details.",
                           "details": [
                               {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [{
                                   "quotaMetric": "generativelanguage.googleapis.com/generate_content_requests",
                                   "quotaId": "GenerateRequestsPerMinutePerProjectPerModel",
                                   "quotaDimensions": {"location": "global", "model": model}}]}] + retry}}


def answer(body):
    try:
        text = body["contents"][-1]["parts"][0]["text"]
    except (KeyError, IndexError, TypeError):
        return 400, {"error": {"code": 400, "status": "INVALID_ARGUMENT", "message": "contents is not specified"}}
    words = len(text.split())
    return 200, {"candidates": [{"content": {"role": "model", "parts": [{"text": f"noted: {text[:40]}"}]},
                                 "finishReason": "STOP", "index": 0}],
                 "usageMetadata": {"promptTokenCount": words, "candidatesTokenCount": 3,
                                   "totalTokenCount": words + 3},
                 "modelVersion": "refserver"}


def embeddings(body):
    """batchEmbedContents: one vector per request, each from its text's length (a batched call,
    which the quota counts as one request)."""
    try:
        texts = [r["content"]["parts"][0]["text"] for r in body["requests"]]
    except (KeyError, IndexError, TypeError):
        return 400, {"error": {"code": 400, "status": "INVALID_ARGUMENT", "message": "requests is not specified"}}
    return 200, {"embeddings": [{"values": [float(len(t)), 1.0, 0.0]} for t in texts]}


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--rpm", type=int, required=True, help="requests admitted per window")
    ap.add_argument("--window-secs", type=float, default=60.0)
    ap.add_argument("--latency-ms", type=float, default=300.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--no-advice", action="store_true", help="refuse with no RetryInfo (the Gemini API sometimes does)")
    ap.add_argument("--zero-after", type=float, default=None,
                    help="from this many seconds after the start, admit nothing (a quota that falls to zero)")
    a = ap.parse_args()
    quota, stats = Quota(a.rpm, a.window_secs), Stats()

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                now = time.monotonic()
                if path == "/stats":
                    status, out = 200, stats.json()
                elif path == "/stats/reset":
                    stats.reset()
                    status, out = 200, {}
                elif method == "POST" and (":generateContent" in path or ":batchEmbedContents" in path):
                    model = path.rsplit("/", 1)[-1].split(":")[0]
                    stats.requests += 1
                    if a.zero_after is not None and now - quota.start >= a.zero_after:
                        quota.limit = 0
                    admitted, wait = quota.admit(now)
                    if admitted:
                        jitter = random.uniform(-a.jitter_ms / 2, a.jitter_ms / 2)
                        await asyncio.sleep(max(0.0, a.latency_ms + jitter) / 1000)
                        reply = embeddings if ":batchEmbedContents" in path else answer
                        status, out = reply(json.loads(body or b"{}"))
                        stats.count(stats.ok_per_s, time.monotonic())
                    else:
                        stats.rate_limited += 1
                        stats.count(stats.refused_per_s, now)
                        status, out = refusal(model, wait, not a.no_advice)
                else:
                    status, out = 404, {"error": {"code": 404, "status": "NOT_FOUND", "message": path}}
                data = json.dumps(out).encode()
                reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests"}[status]
                writer.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    host, port = a.listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port), backlog=1024)
    print(f"refserver listening on {host}:{server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
