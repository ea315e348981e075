"""weir for Python: LLM calls over many prompts at the endpoint's quota, with one result per item.

    import weir
    engine = weir.Engine("gemini/gemini-2.5-flash", rpm=1000, limit_window=60)
    for r in engine.generate(["Summarise: ...", {"id": "r2", "prompt": "..."}]):
        print(r.id, r.text if r.ok else r.error_kind)

An engine is configured like ``weir run``: the model, ``base_url``, and the other endpoint
settings under ``weir run``'s flag names with ``_`` for ``-`` (``max_concurrency``, ``rpm``,
``tpm``, ``limit_window``, ``timeout``, ``max_retries``, ...; ``weir.setting_names()`` lists
them). Every engine of a process with the same settings shares one throttle per endpoint, so
threads that each make their own engine still reach the quota together and never past it. An
engine reads its credentials (``GEMINI_API_KEY``, ``OPENAI_API_KEY``, ...) from the environment
when it is made: after changing one, make a new engine (the old one keeps the old key).

Calls never raise for one item's failure: each item gets a :class:`Result`, ``ok`` or with an
error kind and message. They raise :class:`ConfigError` for what no item could survive (an
unknown model, a missing API key, settings weir does not take).
"""

from __future__ import annotations

import asyncio
import dataclasses
import atexit
import difflib
import json
import numbers
import os
from dataclasses import dataclass
from typing import Any, Iterable, List, Mapping, Optional, Union

from . import _weir
from ._weir import ConfigError

__all__ = ["Engine", "Result", "ConfigError", "setting_names"]

# At exit, the quotas this process shares with others are left at once (a Redis lease given
# up), not when their leases run out.
atexit.register(_weir.leave_quotas)

Item = Union[str, Mapping[str, Any]]


def setting_names() -> List[str]:
    """The endpoint settings an :class:`Engine` takes as keyword arguments."""
    return list(_weir.setting_names())


@dataclass(frozen=True)
class Result:
    """What became of one item: its answer, or why it has none.

    ``text`` is the generated text (``None`` for an embedding or a failure); ``embedding`` the
    vector of an embedding call. A failure has ``error_kind`` (``rate_limited``, ``timeout``,
    ``server``, ``invalid_request``, ...), ``error_message`` and ``retryable`` (whether trying the
    item again later may succeed). ``attempts`` is the number of calls made for it (0: answered
    from the cache).
    """

    id: Any
    ok: bool
    text: Optional[str]
    embedding: Optional[List[float]]
    finish_reason: Optional[str]
    error_kind: Optional[str]
    error_message: Optional[str]
    retryable: bool
    attempts: int
    prompt_tokens: int
    output_tokens: int
    model: str
    value: Any = None
    """With a ``response_schema``: the answer parsed (a dict, list, ...), which weir checked
    against the schema before it counted the item as answered; ``None`` otherwise."""

    @property
    def cached(self) -> bool:
        """True when the answer came from the cache (no call was made)."""
        return self.ok and self.attempts == 0


def _settings_argv(settings: Mapping[str, Any]) -> List[str]:
    argv = []
    known = set(_weir.setting_names())
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            if name not in known:
                argv.append(flag)  # let the parser name the unknown setting
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
            # A pool of endpoints (endpoints=[{"base_url": ...}, ...]): passed as JSON.
            argv.append(f"{flag}={json.dumps([dict(v) for v in value])}")
        elif isinstance(value, (list, tuple)):
            # A repeated setting (base_url=[...] for replicas).
            argv.extend(f"{flag}={v}" for v in value)
        else:
            argv.append(f"{flag}={value}")
    return argv


def _json_or_none(params: Optional[Mapping[str, Any]], whose: str) -> Optional[str]:
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise ConfigError(f"{whose} params: expected a dict, e.g. {{'temperature': 0.2}}, not {type(params).__name__}")
    return json.dumps(dict(params))


# Generation parameters written beside the prompt instead of under "params": refused, since
# ignoring them would run the item with other parameters than the user asked for.
_MISPLACED = {
    "temperature", "top_p", "top_k", "max_output_tokens", "max_tokens", "seed", "stop",
    "stop_sequences", "candidate_count", "param", "parameters", "options",
}


def _media(label: str, item: Mapping[str, Any], fields: Iterable[Any]):
    """The media an item's ``media_fields`` hold, in order, as the native engine takes them: a
    path or URL (str or path-like) or the bytes, with the MIME type given for the field. A
    ``None`` or empty field adds nothing; a field the item lacks is an error (a misspelt name
    would otherwise send every item without its media)."""
    out = []
    for f, mime in fields:
        if f not in item:
            raise TypeError(f"{label}: has no media field {f!r} (give it None for an item without this part)")
        v = item[f]
        if v is None or (isinstance(v, (str, bytes)) and not (v.strip() if isinstance(v, str) else v)):
            continue
        if isinstance(v, os.PathLike):
            v = os.fspath(v)
        if isinstance(v, (bytearray, memoryview)):
            v = bytes(v)
        if not isinstance(v, (str, bytes)):
            raise TypeError(f"{label}: media field {f!r} must be a path or URL (str) or bytes, not {type(v).__name__}")
        out.append((f, mime, v))
    return out


def _item_params(label: str, params: Any) -> Optional[str]:
    """An item's own ``params`` as JSON, checked as the engine reads them: ``TypeError`` naming
    the item when weir cannot send them (not a dict, an unknown or misspelt parameter, a value
    of the wrong type), so that the item fails alone, before any call."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise TypeError(f"{label}: 'params' must be a dict, e.g. {{'temperature': 0.2}}, not {type(params).__name__}")
    try:
        text = json.dumps(dict(params), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{label} params: {e}") from None
    _utf8(label, "params", text)
    try:
        _weir.check_params(text, label)
    except ConfigError as e:
        raise TypeError(str(e)) from None
    return text


def _utf8(label: str, key: str, text: str) -> str:
    """``text`` if it can be sent (UTF-8 has no lone surrogates, which ``surrogateescape``
    decoding leaves in file names and text); else ``TypeError`` naming the item, instead of a
    bare ``UnicodeEncodeError`` from deep in the call that named none."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TypeError(f"{label}: {key!r} holds {text[e.start]!r} at {e.start}, which is not text UTF-8 can carry (a lone surrogate)") from None
    return text


def _item(label: str, item: Any, embed: bool, media_fields: Iterable[str] = ()):
    """An item as the native engine takes it, and its id; ``TypeError`` naming what is wrong."""
    text_key = "text" if embed else "prompt"
    if isinstance(item, str):
        _utf8(label, text_key, item)
        return (None, False, item if item.strip() else None, None, None, None, []), None
    if not isinstance(item, Mapping):
        raise TypeError(f"{label}: expected a str or a dict with {text_key!r}, not {type(item).__name__}")
    misplaced = sorted(_MISPLACED.intersection(item))
    if misplaced:
        raise TypeError(f"{label}: {misplaced[0]!r} is not an item key; put generation parameters under 'params', e.g. {{'params': {{'temperature': 0.2}}}}")
    # Other keys are the record's own data and are left alone, but one that is a near miss of
    # an item key ('sytem', 'promt') or of a generation parameter ('temprature') would
    # silently run the item without what it meant.
    known = (text_key, "prompt" if embed else "text", "id", "model", "system", "params")
    for key in item:
        if isinstance(key, str) and key not in known:
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.9) or difflib.get_close_matches(
                key, ("prompt", "system", "params"), n=1, cutoff=0.8)
            if near:
                raise TypeError(f"{label}: {key!r} is not an item key; did you mean {near[0]!r}?")
            near = difflib.get_close_matches(key, sorted(_MISPLACED), n=1, cutoff=0.85)
            if near:
                raise TypeError(f"{label}: {key!r} is not an item key; did you mean {near[0]!r}, under 'params'?")
    prompt = item.get(text_key, item.get("prompt" if embed else "text"))
    if not isinstance(prompt, str):
        raise TypeError(f"{label}: {text_key!r} must be a str, not {type(prompt).__name__}")
    rid = item.get("id")
    if rid is not None and not isinstance(rid, str):
        # numpy's and pandas' integers are integers too (a DataFrame's id column is int64).
        if isinstance(rid, bool) or not isinstance(rid, numbers.Integral):
            raise TypeError(f"{label}: 'id' must be a str or an int, not {type(rid).__name__}")
        rid = int(rid)
    model = item.get("model")
    system = item.get("system")
    if model is not None and not isinstance(model, str):
        raise TypeError(f"{label}: 'model' must be a str")
    if system is not None and not isinstance(system, str):
        raise TypeError(f"{label}: 'system' must be a str")
    _utf8(label, text_key, prompt)
    if system is not None:
        _utf8(label, "system", system)
    if isinstance(rid, str):
        _utf8(label, "id", rid)
    params = _item_params(label, item.get("params"))
    media = _media(label, item, media_fields)
    native_id = None if rid is None or rid == "" else str(rid)
    return (native_id, isinstance(rid, int), prompt if prompt.strip() else None, model, system, params, media), rid


def _media_fields(fields: Any) -> List[Any]:
    """``media_fields`` checked: a list of field names, each ``FIELD`` or ``FIELD:TYPE`` as the
    CLI's ``--media-field`` (one name alone is taken as a list), as (field, MIME type or None)."""
    if fields is None:
        return []
    if isinstance(fields, str):
        fields = [fields]
    fields = list(fields)
    if not all(isinstance(f, str) and f for f in fields):
        raise ConfigError("media_fields: expected a list of field names, e.g. ['image'] or ['scan:application/pdf']")
    return [_weir.media_field(f) for f in fields]


def _items(items: Iterable[Item], embed: bool, media_fields: Iterable[str] = ()):
    """Items as the native engine takes them, and their ids."""
    if isinstance(items, (str, bytes, Mapping)):
        raise TypeError("expected a list of prompts or records, not a single one (wrap it in a list)")
    pairs = [_item(f"item {i}", item, embed, media_fields) for i, item in enumerate(items)]
    return [n for n, _ in pairs], [rid for _, rid in pairs]


def _has_schema(params: Optional[Mapping[str, Any]]) -> bool:
    return isinstance(params, Mapping) and params.get("response_schema") is not None


def _parsed(text: Optional[str]) -> Any:
    """An answer to a response schema as a value (weir checked it; a fence is dropped)."""
    if text is None:
        return None
    t = text.strip()
    if t.startswith("```"):
        t = t[3:]
        t = t[4:] if t.startswith("json") else t
        t = t[:-3] if t.endswith("```") else t
    try:
        return json.loads(t)
    except ValueError:
        return None


async def _wait(pending):
    """Waits for a started request in an executor thread; cancelling the wait drops its calls."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, pending.wait)
    except asyncio.CancelledError:
        pending.cancel()
        raise


def _results(raw, ids, shaped=None) -> List[Result]:
    """Results of native answers; ``shaped[k]`` says item k had a response schema, whose answer
    is then also parsed into ``Result.value``."""
    out = []
    for k, (i, r) in enumerate(zip(ids, raw)):
        res = Result(i, *r)
        if shaped is not None and shaped[k] and res.ok:
            res = dataclasses.replace(res, value=_parsed(res.text))
        out.append(res)
    return out


class Engine:
    """Calls a model for many items at once, through weir's throttle, retries and cache.

    ``model`` is ``provider/model`` as for ``weir run`` (``gemini/...``, ``vertex_ai/...``,
    ``openai/...``, ``sim/...``); ``base_url`` replaces the provider's (a list of them: replicas
    called as one pool). ``endpoints=[{"base_url": ..., "key_env": ..., "weight": ...}, ...]``
    declares a pool with a key variable, project, location, weight and limits per endpoint, as
    ``weir run --endpoints`` does. ``system`` and
    ``params`` (``{"temperature": 0.2, "max_output_tokens": 256, ...}``, the keys of
    ``weir run --param``) apply to every item unless an item or a call sets its own.
    Answers are kept on disk and reused, as ``weir sql`` keeps them: an item with an ``id``
    gets its own answer back; one without only a deterministic request's (temperature 0 or a
    seed; an embedding always). By default in ``.weir/cache`` of the working directory (a
    process that finds it held by another process goes on without it, with a warning);
    ``cache_dir`` names another directory (its files go in ``cache_dir/cache``; it must be
    free), ``cache=False`` keeps nothing. A cache directory belongs to
    one process at a time. Other keyword arguments are endpoint settings (see
    :func:`setting_names`); an unknown one raises :class:`ConfigError`.
    """

    def __init__(
        self,
        model: str,
        base_url: Optional[str] = None,
        *,
        system: Optional[str] = None,
        params: Optional[Mapping[str, Any]] = None,
        cache_dir: Optional[str] = None,
        cache: bool = True,
        media_fields: Optional[Iterable[str]] = None,
        **settings: Any,
    ):
        self._media_fields = _media_fields(media_fields)
        self._schema = _has_schema(params)
        argv = _settings_argv(settings)
        if isinstance(base_url, (list, tuple)):
            # Replicas of one model that share its key: called as one pool.
            argv.extend(f"--base-url={u}" for u in base_url)
        elif base_url is not None:
            argv.append(f"--base-url={base_url}")
        if not isinstance(cache, bool):
            raise ConfigError(f"cache: expected True or False, not {type(cache).__name__}")
        if cache_dir is not None and not cache:
            raise ConfigError("cache=False with a cache_dir: drop one of them")
        if cache_dir is not None:
            if not isinstance(cache_dir, (str, os.PathLike)):
                raise ConfigError(f"cache_dir: expected a path, not {type(cache_dir).__name__}")
            cache_dir = os.path.expanduser(os.fspath(cache_dir))
            if not cache_dir:
                raise ConfigError("cache_dir: empty; name a directory, or drop it for the default (.weir)")
        default = cache and cache_dir is None
        # The cache's files go in a `cache` directory inside the one named (or .weir).
        where = ".weir" if default else cache_dir
        self._native = _weir.Engine(model, argv, system, _json_or_none(params, "engine"), where, default)

    @property
    def model(self) -> str:
        """``provider/model``."""
        return self._native.model

    def generate(
        self,
        items: Iterable[Item],
        *,
        system: Optional[str] = None,
        params: Optional[Mapping[str, Any]] = None,
        media_fields: Optional[Iterable[str]] = None,
    ) -> List[Result]:
        """Generates text for each item (a prompt, or a dict with ``prompt`` and optionally
        ``id``, ``system``, ``params``, ``model``); one :class:`Result` per item, in order. The
        calls run concurrently, as many as the throttle admits; the GIL is released.

        ``media_fields`` (else the engine's) names the keys of an item that hold media sent
        after its prompt, in order: a file path, an ``https://`` URL, a ``gs://`` or ``s3://``
        URI, or the bytes. Media that cannot be read or sent is that item's
        ``invalid_input`` result, with no call. With a ``response_schema`` in ``params``, each
        answer is checked against it and parsed into ``Result.value``."""
        native, ids = self._native_items(items, media_fields)
        return self._answer(native, ids, False, system, params)

    def _native_items(self, items: Iterable[Item], media_fields: Optional[Iterable[str]]):
        fields = self._media_fields if media_fields is None else _media_fields(media_fields)
        return _items(items, False, fields)

    def _shaped(self, items_params: List[Optional[str]], params: Optional[Mapping[str, Any]]) -> List[bool]:
        """Per item, whether a response schema applies (the engine's, the call's or its own)."""
        base = self._schema or _has_schema(params)
        return [base or (p is not None and "response_schema" in json.loads(p)) for p in items_params]

    def embed(self, items: Iterable[Item]) -> List[Result]:
        """Embeds each item (a text, or a dict with ``text`` and optionally ``id`` and
        ``model``); the vectors are in ``Result.embedding``."""
        return self._answer(*_items(items, embed=True), True)

    def _answer(self, native, ids, embed: bool, system=None, params=None) -> List[Result]:
        """Answers items already made native (by :func:`_items`), blocking."""
        raw = self._native.start(native, embed, system, _json_or_none(params, "call")).wait()
        return _results(raw, ids, None if embed else self._shaped([n[5] for n in native], params))

    async def agenerate(
        self,
        items: Iterable[Item],
        *,
        system: Optional[str] = None,
        params: Optional[Mapping[str, Any]] = None,
        media_fields: Optional[Iterable[str]] = None,
    ) -> List[Result]:
        """:meth:`generate` for asyncio: the calls run on weir's own threads."""
        native, ids = self._native_items(items, media_fields)
        raw = await _wait(self._native.start(native, False, system, _json_or_none(params, "call")))
        return _results(raw, ids, self._shaped([n[5] for n in native], params))

    async def aembed(self, items: Iterable[Item]) -> List[Result]:
        """:meth:`embed` for asyncio."""
        native, ids = _items(items, embed=True)
        return _results(await _wait(self._native.start(native, True, None, None)), ids)

    def metrics(self) -> dict:
        """Counters so far: ``calls``, ``retries``, ``succeeded``, ``failed``, ``rate_limited``
        (429s), ``cache_hits``, ``prompt_tokens`` and ``output_tokens`` (paid for: answers from
        the cache not included), ``cached_prompt_tokens`` and ``cached_output_tokens`` (those of
        the answers from the cache), ``throttled_seconds`` (wall
        time during which calls were held by the throttle) and ``throttled_call_seconds`` (the
        same summed over calls); summed over the endpoints, and shared with every engine of this
        process with the same settings. ``quota_processes`` is the most processes seen sharing an
        endpoint's quota at once (1: this one alone; processes of this user on this machine that
        call one endpoint with one key share it, see ``quota_store``)."""
        return {k: (v if k.endswith("seconds") else int(v)) for k, v in self._native.metrics().items()}

    def flush(self) -> None:
        """Makes every cached answer durable now."""
        self._native.flush()

    def __repr__(self) -> str:
        return f"weir.Engine({self.model!r})"

