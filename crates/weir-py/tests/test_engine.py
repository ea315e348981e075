"""weir's Python engine against `weir sim` on 127.0.0.1."""
import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import weir

MODEL = "gemini/gemini-2.5-flash"


def prompts(n, tag):
    # Every prompt distinct, so no answer can come from another item's.
    return [f"{tag} {i:05d} tell me about rivers" for i in range(n)]


def test_one_result_per_item_in_order_within_a_quota(sim_factory):
    sim = sim_factory("--rpm", "40", "--window-secs", "1", "--latency-ms", "20")
    engine = weir.Engine(MODEL, sim.url, limit_window=1, max_retries=50)
    items = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(prompts(120, "quota"))]
    results = engine.generate(items)
    assert [r.id for r in results] == [f"r{i}" for i in range(120)]
    assert all(r.ok and r.text and r.attempts >= 1 for r in results), [r for r in results if not r.ok][:3]
    s = sim.stats()
    assert s["successes"] == 120  # each item paid for once
    assert s["rate_limited"] <= 0.1 * s["requests"], s
    m = engine.metrics()
    assert m["succeeded"] == 120 and m["calls"] == s["requests"]
    assert m["rate_limited"] == s["rate_limited"]
    assert m["prompt_tokens"] > 0 and m["output_tokens"] > 0


def test_a_failed_item_fails_alone(sim):
    engine = weir.Engine(MODEL, sim.url, max_retries=1)
    items = ["fine one", "bad [sim:error_500] one", {"id": 7, "prompt": "blocked [sim:block_prompt]"}, "fine two"]
    r = engine.generate(items)
    assert [x.ok for x in r] == [True, False, False, True]
    assert r[1].error_kind and r[1].retryable and r[1].attempts == 2, r[1]
    assert r[2].id == 7 and not r[2].retryable and r[2].attempts == 1, r[2]
    assert r[1].text is None and r[1].error_message


def test_records_carry_system_params_and_model(sim_factory, tmp_path):
    config = tmp_path / "sim.toml"
    config.write_text("capture_requests = 10\n")
    sim = sim_factory("--latency-ms", "1", "--config", str(config))
    engine = weir.Engine(MODEL, sim.url, system="engine system", params={"temperature": 0.5})
    r = engine.generate(
        [
            "plain",
            {"prompt": "own", "system": "own system", "params": {"max_output_tokens": 7}},
            {"prompt": "other model", "model": "gemini/gemini-2.0-flash"},
        ],
        params={"top_p": 0.9},
    )
    assert all(x.ok for x in r)
    assert r[2].model == "gemini/gemini-2.0-flash" and r[0].model == MODEL
    import json, urllib.request

    sent = json.load(urllib.request.urlopen(sim.url + "/requests"))
    bodies = {json.dumps(q, sort_keys=True) for q in sent}
    text = " ".join(bodies)
    assert "engine system" in text and "own system" in text
    assert '"maxOutputTokens": 7' in text and '"topP": 0.9' in text and '"temperature": 0.5' in text


def test_settings_and_models_weir_cannot_use_are_config_errors(sim):
    with pytest.raises(weir.ConfigError, match="unknown setting 'rpmm'"):
        weir.Engine(MODEL, sim.url, rpmm=10)
    with pytest.raises(weir.ConfigError, match="rpm"):
        weir.Engine(MODEL, sim.url, rpm=0)
    with pytest.raises(weir.ConfigError, match="max_concurrency"):
        weir.Engine(MODEL, sim.url, max_concurrency="many")
    with pytest.raises(weir.ConfigError, match="nope"):
        weir.Engine("nope/model")
    with pytest.raises(weir.ConfigError, match="temprature"):
        weir.Engine(MODEL, sim.url, params={"temprature": 0.2})
    with pytest.raises(TypeError, match="item 1"):
        weir.Engine(MODEL, sim.url).generate(["ok", 42])
    with pytest.raises(TypeError, match="list"):
        weir.Engine(MODEL, sim.url).generate("one prompt")
    # A key is needed for the real Gemini API: the call says so, naming no secret.
    with pytest.raises(weir.ConfigError, match="GEMINI_API_KEY"):
        weir.Engine(MODEL, "https://gemini.example.invalid").generate(["x"])
    assert "rpm" in weir.setting_names() and "limit_window" in weir.setting_names()


def test_embeddings(sim):
    engine = weir.Engine("openai/text-embedding-3-small", sim.url + "/v1")
    r = engine.embed(["one", {"id": "b", "text": "two"}, "three"])
    assert all(x.ok for x in r) and r[1].id == "b"
    dims = {len(x.embedding) for x in r}
    assert len(dims) == 1 and dims.pop() > 0
    assert r[0].text is None and r[0].embedding != r[1].embedding
    assert sim.stats()["embed_inputs"] == 3


def test_asyncio(sim_factory):
    sim = sim_factory("--latency-ms", "200")
    engine = weir.Engine(MODEL, sim.url)

    async def main():
        t0 = time.monotonic()
        a, b = await asyncio.gather(engine.agenerate(prompts(20, "a")), engine.agenerate(prompts(20, "b")))
        return a, b, time.monotonic() - t0

    a, b, secs = asyncio.run(main())
    assert all(x.ok for x in a + b) and len(a) == len(b) == 20
    assert secs < 3.0, secs  # 40 calls of 0.2 s ran concurrently, not one after another (8 s)


def test_the_gil_is_released_while_calls_run(sim_factory):
    sim = sim_factory("--latency-ms", "500")
    engine = weir.Engine(MODEL, sim.url)
    done = threading.Event()
    ticks = 0

    def call():
        engine.generate(prompts(4, "gil"))
        done.set()

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.05)
    while not done.is_set():
        ticks += 1
    t.join()
    assert ticks > 10_000, ticks  # this thread ran Python the whole time the calls took


def test_engines_with_the_same_settings_share_one_throttle(sim_factory):
    sim = sim_factory("--rpm", "30", "--window-secs", "1", "--latency-ms", "10")
    engines = [weir.Engine(MODEL, sim.url, limit_window=1, max_retries=50) for _ in range(3)]
    out = [None] * 3

    def work(i):
        out[i] = engines[i].generate(prompts(60, f"share{i}"))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(r.ok for rs in out for r in rs)
    s = sim.stats()
    assert s["successes"] == 180
    # One engine behind the three: one set of counters saw every call and every 429 (three
    # engines would each count their own), so one learned budget admitted them.
    m = engines[0].metrics()
    assert m == engines[1].metrics() == engines[2].metrics()
    assert m["calls"] == s["requests"] and m["rate_limited"] == s["rate_limited"] and m["succeeded"] == 180
    # Learning a 1 s window costs some 429s in a run this short (about 11 % seen), not a storm.
    assert s["rate_limited"] <= 0.25 * s["requests"], s


WORKER = """
import json, sys, weir
url, tag = sys.argv[1], sys.argv[2]
engine = weir.Engine("gemini/gemini-2.5-flash", url, max_retries=50, cache=False)
rows = engine.generate([f"{tag} {i:05d} tell me about rivers" for i in range(int(sys.argv[3]))])
print(json.dumps({"ok": sum(r.ok for r in rows), **engine.metrics()}))
"""


def test_python_processes_on_one_key_share_one_quota(sim_factory, tmp_path):
    # Two Python processes (as two Beam workers would be) on one key: they meet through the
    # machine and keep to the quota together, each seeing the other.
    import json, os, subprocess, sys

    sim = sim_factory("--rpm", "40", "--window-secs", "2", "--latency-ms", "20", "--round-advice")
    env = {**os.environ, "WEIR_QUOTA_DIR": str(tmp_path / "quota")}
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, sim.url, f"p{i}", "120"], stdout=subprocess.PIPE, env=env)
        for i in range(2)
    ]
    out = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert [o["ok"] for o in out] == [120, 120], out
    assert [o["quota_processes"] for o in out] == [2, 2], out
    s = sim.stats()
    assert s["successes"] == 240
    # One learned budget for both: 240 calls over 12 windows of 40. Before the first 429 comes
    # back nothing is known, and what is sent blind depends on how fast the answers come (12 to
    # 23 refused on a loaded machine); two processes each learning alone would each send that
    # blind, and refuse half of each other's calls after.
    first, later = s["rate_limited_per_second"][0], sum(s["rate_limited_per_second"][1:])
    assert first <= 32, s
    # After it, about one probe a window, also when the process that held the quota ends and
    # the other takes over (it counts every send of the last window, the last burst included).
    assert later <= 0.06 * s["requests"], s


def test_cache_reuses_an_items_own_answer_and_only_deterministic_ones_without_id(sim, tmp_path):
    cache = str(tmp_path / "cache")
    engine = weir.Engine(MODEL, sim.url, cache_dir=cache)
    keyed = [{"id": f"k{i}", "prompt": p} for i, p in enumerate(prompts(10, "keyed"))]
    first = engine.generate(keyed)
    again = engine.generate(keyed)
    assert [r.text for r in first] == [r.text for r in again]
    assert all(r.cached for r in again) and not any(r.cached for r in first)
    plain = prompts(5, "plain")
    engine.generate(plain)
    assert not any(r.cached for r in engine.generate(plain))  # sampled answers are not shared
    zero = engine.generate(plain, params={"temperature": 0})
    assert all(r.cached for r in engine.generate(plain, params={"temperature": 0}))
    assert not any(r.cached for r in zero)
    engine.flush()
    requests = sim.stats()["requests"]
    del engine, first, again
    import gc

    gc.collect()
    # A new engine (the old one is gone, so the directory is free) finds the answers on disk.
    reopened = weir.Engine(MODEL, sim.url, cache_dir=cache)
    assert all(r.cached for r in reopened.generate(keyed))
    assert sim.stats()["requests"] == requests


def test_answers_are_cached_by_default_in_the_working_directory(sim, tmp_path):
    """As `weir sql` does: `.weir/cache` of the working directory; asked again, no call is
    made. cache=False asks every time; a second process finds the cache held and goes on
    without it, with a warning, instead of failing."""
    keyed = [{"id": f"d{i}", "prompt": p} for i, p in enumerate(prompts(8, "default"))]
    engine = weir.Engine(MODEL, sim.url)
    first = engine.generate(keyed)
    assert not any(r.cached for r in first)
    requests = sim.stats()["requests"]
    again = engine.generate(keyed)
    assert all(r.cached for r in again) and [r.text for r in again] == [r.text for r in first]
    assert sim.stats()["requests"] == requests
    assert (tmp_path / ".weir" / "cache").is_dir()
    # An embedding is the same whenever it is asked: cached without an id too.
    texts = [f"embed {i}" for i in range(4)]
    assert not any(r.cached for r in engine.embed(texts))
    assert all(r.cached for r in engine.embed(texts))
    # A cache_dir keeps its files inside it (a `cache` directory), `~` is the home directory.
    inside = tmp_path / "mine"
    weir.Engine(MODEL, sim.url, cache_dir=inside).generate(["x"])
    assert {p.name for p in inside.iterdir()} <= {"cache", "cache.keys"} and not (tmp_path / "mine.keys").exists()
    with pytest.raises(weir.ConfigError, match="empty"):
        weir.Engine(MODEL, sim.url, cache_dir="")
    # Without the cache, every item is asked again.
    requests = sim.stats()["requests"]
    uncached = weir.Engine(MODEL, sim.url, cache=False)
    assert not any(r.cached for r in uncached.generate(keyed))
    assert sim.stats()["requests"] == requests + len(keyed)
    with pytest.raises(weir.ConfigError, match="drop one of them"):
        weir.Engine(MODEL, sim.url, cache=False, cache_dir=str(tmp_path / "c"))
    # Another process in the same directory while this one holds the cache.
    import subprocess
    import sys

    code = (
        "import warnings, weir\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        f"    e = weir.Engine({MODEL!r}, {sim.url!r})\n"
        "    print(sum('in use by another process' in str(x.message) for x in w))\n"
        "    print(len([r for r in e.generate(['p1', 'p2']) if r.ok]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "2"], (out.stdout, out.stderr)


def test_local_models_embed_in_python_too():
    """`local/` models (candle, in the process) work in Python as in `weir run` and SQL, in a
    wheel built with the `local` feature (scripts/test-python builds it so)."""
    import os

    models = os.environ.get("WEIR_MODELS")
    if not models or not os.path.isdir(os.path.join(models, "all-minilm-l6-v2")):
        if os.environ.get("WEIR_REQUIRE_PEERS"):
            pytest.fail("WEIR_MODELS has no all-minilm-l6-v2: run scripts/setup-peers")
        pytest.skip("no local model (run scripts/setup-peers)")
    engine = weir.Engine("local/all-minilm-l6-v2")
    results = engine.embed(["a river in spring", "bread from the oven", "a river in spring"])
    assert all(r.ok for r in results), [r.error_message for r in results]
    assert [len(r.embedding) for r in results] == [384, 384, 384]
    assert results[0].embedding == results[2].embedding
    assert results[0].embedding != results[1].embedding


def test_an_unusable_model_fails_its_items_alone_and_all_unusable_is_an_error(sim):
    engine = weir.Engine(MODEL, sim.url)
    r = engine.generate([f"p{i}" for i in range(20)] + [{"prompt": "x", "model": "nope/x"}])
    assert all(x.ok for x in r[:20]) and not r[20].ok and r[20].error_kind == "invalid_input"
    assert "nope" in r[20].error_message and r[20].attempts == 0
    assert sim.stats()["requests"] == 20
    with pytest.raises(weir.ConfigError, match="nope"):
        engine.generate([{"prompt": "x", "model": "nope/x"}])


def test_hurried_user_edges(sim):
    import pickle
    import subprocess
    import sys

    e = pickle.loads(pickle.dumps(weir.ConfigError("x")))
    assert isinstance(e, weir.ConfigError)
    # Keyword order, 5 against 5.0, a trailing slash: one engine, one throttle.
    a = weir.Engine(MODEL, sim.url, rpm=100, limit_window=5)
    b = weir.Engine(MODEL, sim.url + "/", limit_window=5.0, rpm=100)
    a.generate(["one"])
    assert a.metrics() == b.metrics() and b.metrics()["calls"] == 1
    with pytest.raises(weir.ConfigError, match="timeout"):
        weir.Engine(MODEL, sim.url, timeout=1e20)
    with pytest.raises(weir.ConfigError, match="plain http"):
        weir.Engine(MODEL, "http://example.com")
    with pytest.raises(weir.ConfigError, match="unknown setting 'rmp'"):
        weir.Engine(MODEL, sim.url, rmp=None)
    with pytest.raises(TypeError, match="under 'params'"):
        a.generate([{"prompt": "x", "temperature": 0.1}])
    # A near miss of an item key is refused; other keys are the record's own data.
    with pytest.raises(TypeError, match="'sytem' is not an item key; did you mean 'system'"):
        a.generate([{"prompt": "x", "sytem": "be brief"}])
    with pytest.raises(TypeError, match="did you mean 'params'"):
        a.generate([{"prompt": "x", "parms": {"temperature": 0}}])
    with pytest.raises(TypeError, match="'temprature' is not an item key; did you mean 'temperature', under 'params'"):
        a.generate([{"prompt": "x", "temprature": 0}])
    with pytest.raises(TypeError, match="'promt' is not an item key; did you mean 'prompt'"):
        a.generate([{"promt": "x"}])
    # An item's own parameters weir cannot send name the item, before any call.
    calls = sim.stats()["requests"]
    with pytest.raises(TypeError, match="item 1 params: .*tempertaure"):
        a.generate(["fine", {"prompt": "x", "params": {"tempertaure": 0}}])
    with pytest.raises(TypeError, match="item 0: 'params' must be a dict"):
        a.generate([{"prompt": "x", "params": "hot"}])
    # A lone surrogate (left by surrogateescape decoding) names its item and field.
    with pytest.raises(TypeError, match="item 1: 'prompt' holds"):
        a.generate(["fine", "bad \udc80 bytes"])
    with pytest.raises(TypeError, match="item 0: 'params' holds"):
        a.generate([{"prompt": "x", "params": {"stop": ["\ud800"]}}])
    assert sim.stats()["requests"] == calls
    assert a.generate([{"prompt": "x", "category": "rivers", "row": 3}])[0].ok
    before = sim.stats()["requests"]
    r = a.generate(["", "   ", "real"])
    assert [x.ok for x in r] == [False, False, True] and r[0].error_kind == "invalid_input"
    assert sim.stats()["requests"] == before + 1
    assert isinstance(a.metrics()["calls"], int)
    # asyncio runs end with status 0 (weir's threads never touch Python objects at exit).
    script = (
        "import asyncio, sys, weir\n"
        f"e = weir.Engine({MODEL!r}, {sim.url!r})\n"
        "print(len(asyncio.run(e.agenerate([f'p{i}' for i in range(300)]))))\n"
    )
    for _ in range(10):
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert p.returncode == 0 and p.stdout.strip() == "300", (p.returncode, p.stderr[-500:])


def test_ctrl_c_stops_a_blocking_call(sim_factory):
    import subprocess
    import sys

    sim = sim_factory("--latency-ms", "5000")
    script = (
        "import os, signal, threading, time, weir\n"
        f"e = weir.Engine({MODEL!r}, {sim.url!r})\n"
        "threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    e.generate(['slow one', 'slow two'])\n"
        "    print('finished')\n"
        "except KeyboardInterrupt:\n"
        "    print(f'interrupted {time.monotonic() - t0:.1f}')\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    out = p.stdout.strip()
    assert out.startswith("interrupted"), (out, p.stderr[-500:])
    assert float(out.split()[1]) < 2.0, out  # not the 5 s the calls take


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _redis(port, *args):
    """One command to the Redis server on `port`, in its wire protocol: the raw reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(("*%d\r\n" % len(args) + "".join("$%d\r\n%s\r\n" % (len(a), a) for a in args)).encode())
        return c.recv(65536).decode()


def test_a_process_that_exits_leaves_the_quota_it_shared_through_redis(sim):
    # A Python process that shared its quota through Redis gives up the lease it held when it
    # exits, so the next process holds the quota at once (before, Python never did: the lease
    # stayed until it ran out, and the next process followed a holder that had gone).
    server = os.environ.get("WEIR_REDIS_SERVER")
    if not server:
        if os.environ.get("WEIR_REQUIRE_PEERS"):
            pytest.fail("WEIR_REDIS_SERVER is not set: run scripts/setup-peers")
        pytest.skip("no redis-server (WEIR_REDIS_SERVER)")
    port = _free_port()
    redis = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                if _redis(port, "PING").startswith("+PONG"):
                    break
            except OSError:
                time.sleep(0.05)
        code = (
            "import weir\n"
            f"e = weir.Engine('gemini/gemini-2.5-flash', base_url={sim.url!r}, quota_store='redis://127.0.0.1:{port}')\n"
            "print(sum(r.ok for r in e.generate(['a', 'b', 'c'])))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, GEMINI_API_KEY="k"),
                             capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "3", out.stderr
        assert _redis(port, "KEYS", "weir:quota:*:holder") == "*0\r\n", "the lease was left behind"
    finally:
        redis.terminate()
        redis.wait(timeout=10)


def test_a_pool_of_replicas_and_one_from_a_list_of_endpoints(sim_factory, monkeypatch):
    # Replicas as a list of base URLs: every item once, both replicas called.
    a = sim_factory("--rpm", "20", "--window-secs", "1", "--latency-ms", "5")
    b = sim_factory("--rpm", "20", "--window-secs", "1", "--latency-ms", "5")
    engine = weir.Engine(MODEL, [a.url, b.url], limit_window=1, max_retries=50, cache=False)
    results = engine.generate(prompts(80, "pool"))
    assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
    sa, sb = a.stats(), b.stats()
    assert sa["successes"] + sb["successes"] == 80, (sa, sb)
    assert sa["successes"] > 0 and sb["successes"] > 0, (sa, sb)
    # The same as endpoints=[...], one of them with a key variable that is not set: a
    # ConfigError naming it, before any call.
    with pytest.raises(weir.ConfigError, match="POOL_KEY_UNSET"):
        weir.Engine(MODEL, endpoints=[{"base_url": a.url}, {"base_url": b.url, "key_env": "POOL_KEY_UNSET"}])
    monkeypatch.setenv("POOL_KEY_SET", "k")
    engine = weir.Engine(
        MODEL, endpoints=[{"base_url": a.url}, {"base_url": b.url, "key_env": "POOL_KEY_SET", "weight": 2}], cache=False
    )
    assert all(r.ok for r in engine.generate(prompts(10, "listed")))


PNG = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"


def test_media_fields_send_paths_and_bytes_and_bad_media_is_the_items_error(sim, tmp_path):
    # Issue #35: media by path and as bytes go inline, once each; a missing file and bytes of
    # no type a provider takes are that item's invalid_input result, with no call.
    paths = []
    for i in range(3):
        p = tmp_path / f"photo{i}.png"
        p.write_bytes(PNG + f"path image {i}".encode())
        paths.append(p)
    items = [{"id": f"p{i}", "prompt": "describe", "image": str(p)} for i, p in enumerate(paths)]
    items += [{"id": f"b{i}", "prompt": "describe", "image": PNG + f"bytes image {i}".encode()} for i in range(3)]
    items += [
        {"id": "path-like", "prompt": "describe", "image": paths[0].with_name("photo0.png")},
        {"id": "gone", "prompt": "describe", "image": str(tmp_path / "none.png")},
        {"id": "junk", "prompt": "describe", "image": b"\x00\xff junk"},
        {"id": "none", "prompt": "describe", "image": None},
    ]
    engine = weir.Engine(MODEL, sim.url, media_fields=["image"], cache=False)
    results = {r.id: r for r in engine.generate(items)}
    for k in ["p0", "p1", "p2", "b0", "b1", "b2", "path-like", "none"]:
        assert results[k].ok, results[k]
    assert results["p0"].text == results["path-like"].text, "the same bytes, the same answer"
    assert results["p0"].text != results["p1"].text, "the answer depends on the image"
    for k, why in [("gone", "no such file"), ("junk", "not a type")]:
        r = results[k]
        assert not r.ok and r.error_kind == "invalid_input" and r.attempts == 0, r
        assert "media field 'image'" in r.error_message and why in r.error_message, r.error_message
    s = sim.stats()
    assert (s["requests"], s["media_parts"]) == (8, 7), s
    with pytest.raises(TypeError, match="media field 'image'"):
        engine.generate([{"prompt": "x", "image": 5}])
    with pytest.raises(weir.ConfigError, match="media_fields"):
        weir.Engine(MODEL, sim.url, media_fields=[3])
    # A misspelt field is no item's field: refused, not sent without its media.
    with pytest.raises(TypeError, match="no media field 'imgae'"):
        engine.generate([{"prompt": "x", "image": str(paths[0])}], media_fields=["imgae"])
    # FIELD:TYPE as on the command line: the given type over the content's, checked up front.
    typed = engine.generate([{"id": "junk", "prompt": "describe", "image": b"\x00\xff junk"}],
                            media_fields=["image:image/png"])
    assert typed[0].ok, typed[0]
    assert sim.stats()["media_parts"] == 8
    with pytest.raises(weir.ConfigError, match="not a type the providers take"):
        weir.Engine(MODEL, sim.url, media_fields=["image:application/zip"])


def test_a_response_schema_gives_parsed_values(sim):
    schema = {
        "type": "object",
        "properties": {"label": {"type": "string"}, "score": {"type": "number"}},
        "required": ["label", "score"],
    }
    engine = weir.Engine(MODEL, sim.url, params={"response_schema": schema}, cache=False)
    results = engine.generate([f"classify item {i}" for i in range(5)])
    for r in results:
        assert r.ok and isinstance(r.value, dict), r
        assert isinstance(r.value["label"], str) and isinstance(r.value["score"], (int, float)), r.value
    plain = weir.Engine(MODEL, sim.url, cache=False).generate(["hello"])[0]
    assert plain.ok and plain.value is None
    # A call's own schema, and one item's.
    per_call = weir.Engine(MODEL, sim.url, cache=False).generate(["a"], params={"response_schema": schema})[0]
    assert isinstance(per_call.value, dict), per_call
    per_item = weir.Engine(MODEL, sim.url, cache=False).generate(
        [{"prompt": "b", "params": {"response_schema": schema}}, "c"]
    )
    assert isinstance(per_item[0].value, dict) and per_item[1].value is None, per_item


def test_an_http_model_from_a_models_file(tmp_path, monkeypatch):
    # Issue #37: any JSON API as http/<name>; templates in Python know {prompt} and {system}.
    import http.server
    import json

    calls = []

    class Api(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ok = self.headers.get("X-Api-Key") == "py-secret-77"
            calls.append(body["q"])
            out = json.dumps({"out": {"text": body["q"][::-1], "lang": body["target"]}} if ok else {"error": "key"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        models = tmp_path / "models.toml"
        models.write_text(
            f'[models.rev]\nurl = "http://127.0.0.1:{server.server_port}/rev"\n'
            'headers = { X-Api-Key = "${PY_REV_KEY}" }\n'
            'body = { q = "{prompt}", target = "{system}" }\nanswer = "/out/text"\n'
        )
        monkeypatch.setenv("PY_REV_KEY", "py-secret-77")
        engine = weir.Engine("http/rev", http_models=str(models), system="de", cache=False)
        r = engine.generate(["abc", {"id": 2, "prompt": "hello"}])
        assert [x.text for x in r] == ["cba", "olleh"], r
        assert sorted(calls) == ["abc", "hello"]
        # A field other than prompt and system is the item's error, with no call.
        other = tmp_path / "models-lang.toml"
        other.write_text(models.read_text().replace('target = "{system}"', 'target = "{lang}"'))
        engine = weir.Engine("http/rev", http_models=str(other), cache=False, max_retries=0)
        r = engine.generate(["x"])
        assert not r[0].ok and r[0].error_kind == "invalid_input" and "'lang'" in r[0].error_message, r[0]
        assert len(calls) == 2
        unset = tmp_path / "models-unset.toml"
        unset.write_text(models.read_text().replace("PY_REV_KEY", "PY_REV_UNSET_KEY"))
        with pytest.raises(weir.ConfigError, match="PY_REV_UNSET_KEY"):
            weir.Engine("http/rev", http_models=str(unset), cache=False).generate(["y"])
    finally:
        server.shutdown()


def test_media_fields_read_s3_objects(sim, monkeypatch):
    # Issue #35: media in an s3:// bucket (moto's S3 on loopback), read with the environment's
    # credentials as `weir run` reads them; a missing object is the item's error, with no call.
    peer = os.environ.get("WEIR_PYTHON")
    if not peer:
        pytest.skip("WEIR_PYTHON (with moto) is not set; scripts/setup-peers provides it")
    moto_bin = os.path.join(os.path.dirname(peer), "moto_server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    moto = subprocess.Popen([moto_bin, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        put = (
            "import sys, boto3\n"
            "c = boto3.client('s3', endpoint_url=sys.argv[1], aws_access_key_id='test', aws_secret_access_key='test', region_name='us-east-1')\n"
            "c.create_bucket(Bucket='bkt')\n"
            "for i in range(3): c.put_object(Bucket='bkt', Key=f'photos/{i}.png', Body=bytes.fromhex(sys.argv[2]) + f'object {i}'.encode())\n"
        )
        subprocess.run([peer, "-c", put, url, PNG.hex()], check=True)
        for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                     "AWS_ENDPOINT_URL": url}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        engine = weir.Engine(MODEL, sim.url, media_fields=["image"], cache=False)
        items = [{"id": f"s{i}", "prompt": "describe", "image": f"s3://bkt/photos/{i}.png"} for i in range(3)]
        items.append({"id": "gone", "prompt": "describe", "image": "s3://bkt/photos/none.png"})
        r = {x.id: x for x in engine.generate(items)}
        assert all(r[f"s{i}"].ok for i in range(3)), r
        assert r["s0"].text != r["s1"].text, "the answer depends on the object's bytes"
        assert not r["gone"].ok and r["gone"].error_kind == "invalid_input" and r["gone"].attempts == 0, r["gone"]
        s = sim.stats()
        assert (s["requests"], s["media_parts"]) == (3, 3), s
    finally:
        moto.terminate()
        moto.wait()


def test_a_new_engine_reads_the_key_in_the_environment_now(sim_factory, monkeypatch):
    # In a notebook: the first key was wrong, the user fixes GEMINI_API_KEY and makes a new
    # engine while the first is still alive. Engines with the same settings used to share one,
    # credentials included: the fixed key was ignored (and a key switched to another account's
    # was never used: the first account was billed).
    s = sim_factory("--latency-ms", "5", "--api-key", "right-key-1")
    monkeypatch.setenv("GEMINI_API_KEY", "wrong-key-0")
    first = weir.Engine("gemini/m", base_url=s.url, cache=False, max_retries=0)
    r = first.generate(["hi"])[0]
    assert not r.ok and r.error_kind == "auth", r
    monkeypatch.setenv("GEMINI_API_KEY", "right-key-1")
    second = weir.Engine("gemini/m", base_url=s.url, cache=False, max_retries=0)
    r = second.generate(["hi"])[0]
    assert r.ok, r
    # The first engine keeps the key it was made with.
    assert not first.generate(["hi again"])[0].ok


def test_tokens_from_the_cache_are_not_counted_as_paid(sim):
    engine = weir.Engine(MODEL, sim.url)
    items = [{"id": f"t{i}", "prompt": f"tokens {i}"} for i in range(5)]
    assert all(r.ok for r in engine.generate(items))
    paid = engine.metrics()
    assert paid["prompt_tokens"] > 0 and paid["output_tokens"] > 0 and paid["cached_output_tokens"] == 0
    again = engine.generate(items)
    assert all(r.ok and r.attempts == 0 for r in again)
    m = engine.metrics()
    assert m["cache_hits"] == 5
    # Nothing more was paid for; the answers from the cache are counted apart.
    assert (m["prompt_tokens"], m["output_tokens"]) == (paid["prompt_tokens"], paid["output_tokens"])
    assert m["cached_output_tokens"] == paid["output_tokens"] and m["cached_prompt_tokens"] == paid["prompt_tokens"]


def test_numpy_integer_ids_are_ids(sim):
    np = pytest.importorskip("numpy")
    engine = weir.Engine(MODEL, sim.url, cache=False)
    r = engine.generate([{"id": np.int64(7), "prompt": "seven"}, {"id": 7.0, "prompt": "float"}][:1])
    assert r[0].ok and r[0].id == 7 and type(r[0].id) is int
    with pytest.raises(TypeError, match="'id' must be a str or an int, not float"):
        engine.generate([{"id": 7.0, "prompt": "float"}])
