"""weir.beam.WeirModelHandler in Beam pipelines on the DirectRunner, against `weir sim`."""
import glob
import json
import os

import pytest

beam = pytest.importorskip("apache_beam")
from apache_beam.metrics.metric import MetricsFilter  # noqa: E402
from apache_beam.ml.inference.base import RunInference  # noqa: E402
from apache_beam.options.pipeline_options import PipelineOptions  # noqa: E402

from weir.beam import WeirModelHandler  # noqa: E402

MODEL = "gemini/gemini-2.5-flash"


def elements(n):
    out = []
    for i in range(n):
        # Every tenth record is refused for good by the simulator; the rest succeed.
        bad = " [sim:block_prompt]" if i % 10 == 3 else ""
        out.append({"id": f"e{i}", "prompt": f"element {i:05d} about lakes{bad}"})
    return out


def run_pipeline(tmp_path, url, n, options, **handler_kwargs):
    handler = WeirModelHandler(MODEL, url, max_retries=20, limit_window=1, **handler_kwargs)
    ok_prefix, dead_prefix = str(tmp_path / "ok"), str(tmp_path / "dead")
    p = beam.Pipeline(options=PipelineOptions(options))
    results, dlq = p | beam.Create(elements(n)) | RunInference(handler).with_exception_handling()
    _ = (
        results
        | "ok ids" >> beam.Map(lambda r: json.dumps([r.example["id"], r.inference.ok, r.model_id, r.inference.output_tokens]))
        | "write ok" >> beam.io.WriteToText(ok_prefix)
    )
    _ = (
        dlq.failed_postprocessing[0]
        | "dead ids" >> beam.Map(lambda d: json.dumps([d[0].example["id"], d[0].inference.error_kind]))
        | "write dead" >> beam.io.WriteToText(dead_prefix)
    )
    outcome = p.run()
    outcome.wait_until_finish()

    def read(prefix):
        rows = []
        for path in glob.glob(prefix + "*"):
            with open(path) as f:
                rows += [json.loads(line) for line in f if line.strip()]
        return rows

    return read(ok_prefix), read(dead_prefix), outcome


def check_exactly_once(ok, dead, n):
    ok_ids = [r[0] for r in ok]
    dead_ids = [r[0] for r in dead]
    assert len(ok_ids) == len(set(ok_ids)) and len(dead_ids) == len(set(dead_ids))
    assert sorted(ok_ids + dead_ids) == sorted(f"e{i}" for i in range(n))
    assert set(dead_ids) == {f"e{i}" for i in range(n) if i % 10 == 3}
    assert all(r[1] and r[2] == MODEL and r[3] > 0 for r in ok)


def test_direct_runner_in_process(sim_factory, tmp_path):
    sim = sim_factory("--rpm", "100", "--window-secs", "1", "--latency-ms", "20")
    ok, dead, outcome = run_pipeline(tmp_path, sim.url, 300, [])
    check_exactly_once(ok, dead, 300)
    s = sim.stats()
    # Each record answered once (a blocked prompt is an answer too: HTTP 200, no text).
    assert s["successes"] == 300
    counters = {
        r.key.metric.name: r.committed
        for r in outcome.metrics().query(MetricsFilter().with_namespace("RunInference"))["counters"]
    }
    assert counters["weir_calls"] == s["requests"], counters
    assert counters["weir_failed_records"] == 30
    assert counters.get("weir_rate_limited", 0) == s["rate_limited"]
    assert counters["num_inferences"] == 300


def test_direct_runner_two_worker_processes(sim_factory, tmp_path):
    sim = sim_factory("--rpm", "100", "--window-secs", "1", "--latency-ms", "20")
    options = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    ok, dead, _ = run_pipeline(tmp_path, sim.url, 300, options)
    check_exactly_once(ok, dead, 300)
    assert sim.stats()["successes"] == 300


def test_a_pool_of_two_replicas_in_two_worker_processes(sim_factory, tmp_path):
    # base_url as a list: the handler's workers spread their calls over both replicas, each
    # record answered exactly once.
    a = sim_factory("--rpm", "100", "--window-secs", "1", "--latency-ms", "20")
    b = sim_factory("--rpm", "100", "--window-secs", "1", "--latency-ms", "20")
    options = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    ok, dead, _ = run_pipeline(tmp_path, [a.url, b.url], 300, options)
    check_exactly_once(ok, dead, 300)
    sa, sb = a.stats(), b.stats()
    assert sa["successes"] + sb["successes"] == 300, (sa, sb)
    assert sa["successes"] > 0 and sb["successes"] > 0, (sa, sb)


def test_failed_records_fail_the_pipeline_without_exception_handling(sim, tmp_path):
    handler = WeirModelHandler(MODEL, sim.url, max_retries=0)
    with pytest.raises(Exception, match="block"):
        with beam.Pipeline() as p:
            _ = p | beam.Create(["fine", "no [sim:block_prompt]"]) | RunInference(handler)


def test_errors_as_results(sim, tmp_path):
    handler = WeirModelHandler(MODEL, sim.url, errors="result")
    out = str(tmp_path / "out")
    p = beam.Pipeline()
    _ = (
        p
        | beam.Create(["fine", "no [sim:block_prompt]", 42, BAD_PARAMS, NOT_PARAMS])
        | RunInference(handler)
        | beam.Map(lambda r: json.dumps([r.example, r.inference.ok]))
        | beam.io.WriteToText(out)
    )
    outcome = p.run()
    outcome.wait_until_finish()
    rows = sorted((json.loads(l) for path in glob.glob(out + "*") for l in open(path)), key=json.dumps)
    # The elements weir cannot read (42, a misspelt parameter, params that are no dict) fail
    # alone; their batch-mates are answered. (A misspelt parameter used to raise for the whole
    # batch, after other batches were paid for, and fail the pipeline.)
    expected = [[42, False], ["fine", True], ["no [sim:block_prompt]", False], [BAD_PARAMS, False], [NOT_PARAMS, False]]
    assert rows == sorted(expected, key=json.dumps)
    # Every failure is counted: the blocked prompt and the elements weir could not read.
    counters = {
        r.key.metric.name: r.committed
        for r in outcome.metrics().query(MetricsFilter().with_namespace("RunInference"))["counters"]
    }
    assert counters["weir_failed_records"] == 4, counters


BAD_PARAMS = {"prompt": "misspelt", "params": {"tempertaure": 0}}
NOT_PARAMS = {"prompt": "not a dict", "params": "hot"}


def test_bad_settings_fail_when_the_handler_is_made():
    from weir import ConfigError

    with pytest.raises(ConfigError, match="unknown setting 'rmp'"):
        WeirModelHandler(MODEL, "http://127.0.0.1:9", rmp=5)
    with pytest.raises(ConfigError, match="task"):
        WeirModelHandler(MODEL, "http://127.0.0.1:9", task="chat")
    # A max alone is taken (the min follows it down); a min over the max is refused.
    h = WeirModelHandler(MODEL, "http://127.0.0.1:9", max_batch_size=10)
    assert h.batch_elements_kwargs()["min_batch_size"] == 10
    with pytest.raises(ConfigError, match="min_batch_size 20 and max_batch_size 10"):
        WeirModelHandler(MODEL, "http://127.0.0.1:9", min_batch_size=20, max_batch_size=10)
    with pytest.raises(ConfigError, match="metrics_namespace"):
        WeirModelHandler(MODEL, "http://127.0.0.1:9", metrics_namespace=5)
