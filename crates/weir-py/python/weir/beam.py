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
optionally ``id``, ``system``, ``params``, ``model``, and the keys named by ``media_fields``
(paths, URLs or bytes of images, audio, video or documents sent after the prompt). Each result is a ``PredictionResult``
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

import os
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Union

from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from . import ConfigError, Engine, Result, _item

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
    # Wall time with calls held by the throttle, as Beam means it (not summed over calls).
    "throttled_seconds": "cumulativeThrottlingSeconds",
}


class WeirModelHandler(ModelHandler):
    """A ``RunInference`` model handler that calls ``model`` through weir.

    ``model`` and ``base_url`` are as for ``weir run`` (a list of base URLs is a pool of
    replicas, and ``endpoints=[...]`` a pool as for :class:`weir.Engine`); ``task`` is ``"generate"`` or
    ``"embed"``; ``system`` and ``params`` as for :class:`weir.Engine`. Answers are cached
    as by :class:`weir.Engine`, each worker process in a slot of its own (``worker-0``,
    ``worker-1``, ...) under ``cache_dir``, by default ``.weir/beam`` of the working directory;
    ``cache=False`` keeps none. The endpoint settings are as for :class:`weir.Engine` too
    (``rpm``, ``tpm``, ``limit_window``, ``max_concurrency``,
    ``timeout``, ``max_retries``, ...), checked when the handler is made. Batching is Beam's:
    ``min_batch_size`` (256, or ``max_batch_size`` when that is smaller), ``max_batch_size``,
    ``max_batch_duration_secs`` and ``element_size_fn`` go to ``BatchElements`` (a batch's calls run at once, so large batches
    are cheap: the throttle, not the batch, decides how many calls are in flight).
    ``inference_args`` given to ``RunInference`` may set ``system`` and generation
    parameters for every element.
    """

    def __init__(
        self,
        model: str,
        base_url: Union[str, Sequence[str], None] = None,
        *,
        task: str = "generate",
        system: Optional[str] = None,
        params: Optional[Mapping[str, Any]] = None,
        cache_dir: Optional[str] = None,
        cache: bool = True,
        errors: str = "dead_letter",
        min_batch_size: Optional[int] = None,
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
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise ConfigError(f"cache_dir: expected a path, not {type(cache_dir).__name__}")
        if not isinstance(cache, bool):
            raise ConfigError(f"cache: expected True or False, not {type(cache).__name__}")
        if cache_dir is not None and not cache:
            raise ConfigError("cache=False with a cache_dir: drop one of them")
        if min_batch_size is None and isinstance(max_batch_size, int) and not isinstance(max_batch_size, bool):
            # 256 unless max_batch_size is smaller: a max alone is taken, as Beam's handlers take it.
            min_batch_size = min(256, max_batch_size)
        if not (
            isinstance(min_batch_size, int)
            and isinstance(max_batch_size, int)
            and not isinstance(min_batch_size, bool)
            and not isinstance(max_batch_size, bool)
            and 1 <= min_batch_size <= max_batch_size
        ):
            raise ConfigError(
                f"min_batch_size {min_batch_size!r} and max_batch_size {max_batch_size!r}: expected whole numbers "
                "with 1 <= min <= max (min defaults to 256, or to max when max is smaller)"
            )
        if metrics_namespace is not None and not isinstance(metrics_namespace, str):
            raise ConfigError(f"metrics_namespace: expected a str, not {type(metrics_namespace).__name__}")
        # Refused settings fail the pipeline's construction, not a worker hours later.
        Engine(model, base_url, system=system, params=params, cache=False, **settings)
        self._model = model
        self._base_url = base_url
        self._task = task
        self._system = system
        self._params = dict(params) if params is not None else None
        # By default each worker process keeps its answers under `.weir/beam` of its working
        # directory (one slot each, as with a cache_dir); cache=False keeps none.
        if not cache:
            self._cache_dir = None
        elif cache_dir is None:
            self._cache_dir = os.path.join(".weir", "beam")
        else:
            self._cache_dir = os.fspath(cache_dir)
        self._errors = errors
        self._settings = dict(settings)
        self._batching = {"min_batch_size": min_batch_size, "max_batch_size": max_batch_size}
        if max_batch_duration_secs is not None:
            self._batching["max_batch_duration_secs"] = max_batch_duration_secs
        if element_size_fn is not None:
            self._batching["element_size_fn"] = element_size_fn
        self._namespace = metrics_namespace

    def load_model(self) -> Engine:
        kwargs = dict(system=self._system, params=self._params, **self._settings)
        if self._cache_dir is None:
            return Engine(self._model, self._base_url, cache=False, **kwargs)
        # A cache directory is one process's at a time: each worker process of the pipeline
        # takes the first free slot under it (worker-0, worker-1, ...), the same ones run after run.
        for slot in range(1024):
            try:
                return Engine(self._model, self._base_url, cache_dir=os.path.join(self._cache_dir, f"worker-{slot}"), **kwargs)
            except ConfigError as e:
                if "in use by another process" not in str(e):
                    raise
        raise ConfigError(f"cache_dir {self._cache_dir}: every worker slot is in use")

    def run_inference(
        self,
        batch: Sequence[Any],
        model: Engine,
        inference_args: Optional[Dict[str, Any]] = None,
    ) -> Iterable[PredictionResult]:
        args = dict(inference_args or {})
        system = args.pop("system", None)
        embed = self._task == "embed"
        if embed and (args or system is not None):
            raise ConfigError("inference_args do not apply to embeddings")
        # An element weir cannot read fails alone, as an invalid-input result.
        good, native, ids, results = [], [], [], [None] * len(batch)
        for i, element in enumerate(batch):
            try:
                n, rid = _item("element", element, embed, model._media_fields)
            except TypeError as e:
                rid = element.get("id") if isinstance(element, Mapping) else None
                results[i] = Result(rid, False, None, None, None, "invalid_input", str(e), False, 0, 0, 0, model.model)
                continue
            good.append(i)
            native.append(n)
            ids.append(rid)
        for i, r in zip(good, model._answer(native, ids, embed, system, args or None)):
            results[i] = r
        self._report(model)
        if len(good) < len(batch):
            # Failed before the engine saw them, so not in its counts.
            Metrics.counter(self.get_metrics_namespace(), _COUNTERS["failed"]).inc(len(batch) - len(good))
        return [PredictionResult(example, r, r.model) for example, r in zip(batch, results)]

    def _report(self, model: Engine) -> None:
        """Adds what the engine counted since it was last reported to Beam's counters (each
        gain once, whichever thread or handler of the process reports it)."""
        namespace = self.get_metrics_namespace()
        for key, delta in model._native.take_deltas().items():
            name = _COUNTERS.get(key)
            if name and delta >= 1:
                Metrics.counter(namespace, name).inc(int(delta))

    def validate_inference_args(self, inference_args: Optional[Dict[str, Any]]) -> None:
        if inference_args and self._task == "embed":
            raise ConfigError("inference_args do not apply to embeddings")
        if inference_args:
            args = dict(inference_args)
            system = args.pop("system", None)
            Engine(self._model, self._base_url, system=system, params=args or None, cache=False, **self._settings)

    def get_postprocess_fns(self):
        own = [_raise_failed] if self._errors == "dead_letter" else []
        return own + list(super().get_postprocess_fns())

    def batch_elements_kwargs(self) -> Mapping[str, Any]:
        return dict(self._batching)

    def get_num_bytes(self, batch: Sequence[Any]) -> int:
        def size(x: Any) -> int:
            if isinstance(x, str):
                return len(x)
            if isinstance(x, Mapping):
                return len(str(x.get("prompt", x.get("text", ""))))
            return 0

        return sum(size(x) for x in batch)

    def get_metrics_namespace(self) -> str:
        return self._namespace or "RunInference"

    def share_model_across_processes(self) -> bool:
        return False
