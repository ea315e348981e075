"""weir inside Apache Beam: a ``ModelHandler`` for ``RunInference``.

    import apache_beam as beam
    from apache_beam.ml.inference.base import RunInference
    from weir.beam import WeirModelHandler

    handler = WeirModelHandler("gemini/gemini-2.5-flash", rpm=1000, limit_window=60)
    results, dead = (prompts | RunInference(handler).with_exception_handling())
    failed = dead.failed_postprocessing[0]   # (PredictionResult, error) per failed record

weir, not Beam, throttles and retries: the handler subclasses Beam's plain ``ModelHandler``.
``load_model`` makes one :class:`weir.Engine` per worker process (``RunInference`` shares it
between the process's threads through ``shared.Shared``), so every bundle of a process goes
through one throttle per endpoint, and the calls of a batch run concurrently.

Each element is a prompt (``str``) or a dict with ``prompt`` (or ``text`` for embeddings) and
optionally ``id``, ``system``, ``params``, ``model``. Each result is a ``PredictionResult``
whose ``inference`` is a :class:`weir.Result` (text or vector, usage, attempts) and whose
``model_id`` is the ``provider/model`` that answered.

A record that fails after its retries does not fail its batch-mates. It is raised in the
handler's first post-processing step, one element at a time: with
``RunInference(...).with_exception_handling()`` it goes to ``failed_postprocessing[0]`` (the
``PredictionResult`` and the error) and the pipeline goes on; without it the pipeline fails,
as Beam's own handlers do. ``errors="result"`` keeps failed records in the main output
instead (``inference.ok`` is False).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence

from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from . import ConfigError, Engine, Result

__all__ = ["WeirModelHandler", "RecordFailed"]


class RecordFailed(Exception):
    """A record that weir could not answer; ``result`` is its :class:`weir.Result`."""

    def __init__(self, message: str, result: Optional[Result] = None):
        super().__init__(message)
        self.result = result

    def __reduce__(self):
        return (RecordFailed, (self.args[0], self.result))


def _raise_failed(prediction: PredictionResult) -> PredictionResult:
    r = prediction.inference
    if isinstance(r, Result) and not r.ok:
        raise RecordFailed(
            f"record {r.id if r.id is not None else repr(prediction.example)[:80]} failed after {r.attempts} "
            f"attempt(s): {r.error_kind}: {r.error_message}",
            r,
        )
    return prediction


# Counter names: Beam's own where it has one, else weir's.
_COUNTERS = {
    "calls": "weir_calls",
    "retries": "weir_retries",
    "rate_limited": "weir_rate_limited",
    "failed": "weir_failed_records",
    "cache_hits": "weir_cache_hits",
    "prompt_tokens": "weir_prompt_tokens",
    "output_tokens": "weir_output_tokens",
    "throttled_seconds": "cumulativeThrottlingSeconds",
}


class WeirModelHandler(ModelHandler):
    """A ``RunInference`` model handler that calls ``model`` through weir.

    ``model`` and ``base_url`` are as for ``weir run``; ``task`` is ``"generate"`` or
    ``"embed"``; ``system``, ``params`` and ``cache_dir`` as for :class:`weir.Engine`, and so
    are the endpoint settings (``rpm``, ``tpm``, ``limit_window``, ``max_concurrency``,
    ``timeout``, ``max_retries``, ...), checked when the handler is made. Batching is Beam's:
    ``min_batch_size``, ``max_batch_size``, ``max_batch_duration_secs`` and
    ``element_size_fn`` go to ``BatchElements`` (a batch's calls run at once, so large batches
    are cheap: the throttle, not the batch, decides how many calls are in flight).
    ``inference_args`` given to ``RunInference`` may set ``system`` and generation
    parameters for every element.
    """

    def __init__(
        self,
        model: str,
        base_url: Optional[str] = None,
        *,
        task: str = "generate",
        system: Optional[str] = None,
        params: Optional[Mapping[str, Any]] = None,
        cache_dir: Optional[str] = None,
        errors: str = "dead_letter",
        min_batch_size: int = 256,
        max_batch_size: int = 1024,
        max_batch_duration_secs: Optional[float] = None,
        element_size_fn: Optional[Callable[[Any], int]] = None,
        metrics_namespace: Optional[str] = None,
        **settings: Any,
    ):
        super().__init__()
        if task not in ("generate", "embed"):
            raise ConfigError(f"task {task!r}: expected 'generate' or 'embed'")
        if errors not in ("dead_letter", "result"):
            raise ConfigError(f"errors {errors!r}: expected 'dead_letter' or 'result'")
        if not (isinstance(min_batch_size, int) and isinstance(max_batch_size, int) and 1 <= min_batch_size <= max_batch_size):
            raise ConfigError("min_batch_size and max_batch_size: expected whole numbers with 1 <= min <= max")
        # Refused settings fail the pipeline's construction, not a worker hours later.
        Engine(model, base_url, system=system, params=params, **settings)
        self._model = model
        self._base_url = base_url
        self._task = task
        self._system = system
        self._params = dict(params) if params is not None else None
        self._cache_dir = cache_dir
        self._errors = errors
        self._settings = dict(settings)
        self._batching = {"min_batch_size": min_batch_size, "max_batch_size": max_batch_size}
        if max_batch_duration_secs is not None:
            self._batching["max_batch_duration_secs"] = max_batch_duration_secs
        if element_size_fn is not None:
            self._batching["element_size_fn"] = element_size_fn
        self._namespace = metrics_namespace

    def load_model(self) -> Engine:
        engine = Engine(
            self._model,
            self._base_url,
            system=self._system,
            params=self._params,
            cache_dir=self._cache_dir,
            **self._settings,
        )
        # What has been added to Beam's counters, kept with the engine: every thread of the
        # process holds its own copy of this handler but shares the engine and its counts.
        engine._beam_reported = {}
        engine._beam_lock = threading.Lock()
        return engine

    def run_inference(
        self,
        batch: Sequence[Any],
        model: Engine,
        inference_args: Optional[Dict[str, Any]] = None,
    ) -> Iterable[PredictionResult]:
        args = dict(inference_args or {})
        system = args.pop("system", None)
        if self._task == "embed":
            if args or system is not None:
                raise ConfigError("inference_args do not apply to embeddings")
            results = model.embed(batch)
        else:
            results = model.generate(batch, system=system, params=args or None)
        self._report(model)
        return [PredictionResult(example, r, r.model) for example, r in zip(batch, results)]

    def _report(self, model: Engine) -> None:
        """Adds what the engine counted since the last report to Beam's counters."""
        namespace = self.get_metrics_namespace()
        with model._beam_lock:
            now = model.metrics()
            for key, name in _COUNTERS.items():
                new, old = int(now.get(key, 0)), int(model._beam_reported.get(key, 0))
                if new > old:
                    Metrics.counter(namespace, name).inc(new - old)
                    model._beam_reported[key] = new

    def validate_inference_args(self, inference_args: Optional[Dict[str, Any]]) -> None:
        if inference_args and self._task == "embed":
            raise ConfigError("inference_args do not apply to embeddings")
        if inference_args:
            args = dict(inference_args)
            system = args.pop("system", None)
            Engine(self._model, self._base_url, system=system, params=args or None, **self._settings)

    def get_postprocess_fns(self):
        own = [_raise_failed] if self._errors == "dead_letter" else []
        return own + list(super().get_postprocess_fns())

    def batch_elements_kwargs(self) -> Mapping[str, Any]:
        return dict(self._batching)

    def get_num_bytes(self, batch: Sequence[Any]) -> int:
        return sum(len(x) if isinstance(x, str) else len(str(x.get("prompt", x.get("text", "")))) for x in batch)

    def get_metrics_namespace(self) -> str:
        return self._namespace or "RunInference"

    def share_model_across_processes(self) -> bool:
        return False
