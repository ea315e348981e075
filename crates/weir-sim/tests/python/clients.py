"""The official Python clients (openai, google-genai, anthropic), pointed at `weir sim`, must work
unchanged.

Usage: python clients.py BASE_URL. The simulator must run with a quota of 2 requests per window
per key. Each check uses its own key; the rate-limit check makes a third call and must get the
client's own rate-limit error. Prints one line per check; exits non-zero on the first failure.
"""
import sys

import anthropic
import openai
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

base = sys.argv[1].rstrip("/")


def check(name, fn):
    try:
        fn()
    except Exception as e:  # report and fail
        print(f"FAIL {name}: {type(e).__name__}: {e}")
        sys.exit(1)
    print(f"ok   {name}")


def oai(key):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def openai_call():
    r = oai("o-call").chat.completions.create(model="sim-1", messages=[{"role": "user", "content": "hello"}], max_tokens=20)
    assert r.choices[0].message.content, r
    assert r.choices[0].finish_reason in ("stop", "length"), r
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r


def openai_stream():
    stream = oai("o-stream").chat.completions.create(
        model="sim-1", messages=[{"role": "user", "content": "hello"}], stream=True, stream_options={"include_usage": True}
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text and finish == "stop" and usage and usage.completion_tokens > 0, (text, finish, usage)


def openai_429():
    c = oai("o-limit")
    for _ in range(2):
        c.chat.completions.create(model="sim-1", messages=[{"role": "user", "content": "x"}])
    try:
        c.chat.completions.create(model="sim-1", messages=[{"role": "user", "content": "x"}])
    except openai.RateLimitError as e:
        assert e.status_code == 429
        assert e.response.headers.get("retry-after"), e.response.headers
        return
    raise AssertionError("no RateLimitError")


def gem(key, version=None):
    opts = types.HttpOptions(base_url=base, api_version=version) if version else types.HttpOptions(base_url=base)
    return genai.Client(api_key=key, http_options=opts)


def gemini_call(version):
    def f():
        c = gem(f"g-call-{version}", version)  # keep the client alive: it closes when collected
        r = c.models.generate_content(
            model="gemini-2.5-flash", contents="hello", config=types.GenerateContentConfig(max_output_tokens=100, temperature=0.1)
        )
        assert r.text, r
        assert r.usage_metadata.prompt_token_count > 0, r
        assert r.candidates[0].finish_reason == types.FinishReason.STOP, r
    return f


def gemini_stream():
    text = ""
    last = None
    c = gem("g-stream")
    for chunk in c.models.generate_content_stream(model="gemini-2.5-flash", contents="hello"):
        text += chunk.text or ""
        last = chunk
    assert text and last.candidates[0].finish_reason == types.FinishReason.STOP, (text, last)


def gemini_429():
    c = gem("g-limit")
    for _ in range(2):
        c.models.generate_content(model="gemini-2.5-flash", contents="x")
    try:
        c.models.generate_content(model="gemini-2.5-flash", contents="x")
    except genai_errors.ClientError as e:
        assert e.code == 429 and e.status == "RESOURCE_EXHAUSTED", (e.code, e.status)
        details = e.details["error"]["details"]
        assert any(d.get("retryDelay") for d in details), details
        return
    raise AssertionError("no 429 ClientError")


def gemini_blocked():
    c = gem("g-block")
    r = c.models.generate_content(model="gemini-2.5-flash", contents="[sim:block_prompt]")
    assert not r.candidates and r.prompt_feedback.block_reason == types.BlockedReason.SAFETY, r


def vertex_call_and_stream():
    from google.oauth2.credentials import Credentials

    c = genai.Client(
        vertexai=True,
        project="weir-test",
        location="us-central1",
        credentials=Credentials(token="v-token"),
        http_options=types.HttpOptions(base_url=base),
    )
    r = c.models.generate_content(model="gemini-2.5-flash", contents="hello")
    assert r.text, r
    text = "".join(ch.text or "" for ch in c.models.generate_content_stream(model="gemini-2.5-flash", contents="hello"))
    assert text, text


def gemini_batch_from_file():
    # The Files API's resumable upload, a batch made from the file, its results file downloaded.
    import json, tempfile, time

    c = gem("g-batch-file", "v1beta")
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for i in range(20):
            req = {"contents": [{"parts": [{"text": f"hello {i}"}], "role": "user"}]}
            f.write(json.dumps({"key": f"k{i}", "request": req}) + "\n")
    up = c.files.upload(file=f.name, config=types.UploadFileConfig(display_name="in", mime_type="jsonl"))
    job = c.batches.create(model="gemini-2.5-flash", src=up.name, config={"display_name": "from-a-file"})
    for _ in range(100):
        job = c.batches.get(name=job.name)
        if job.state.name in ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"):
            break
        time.sleep(0.2)
    assert job.state.name == "JOB_STATE_SUCCEEDED", job
    lines = [json.loads(l) for l in c.files.download(file=job.dest.file_name).decode().splitlines() if l.strip()]
    assert sorted(l["key"] for l in lines) == sorted(f"k{i}" for i in range(20)), lines[:2]
    assert all(l["response"]["candidates"][0]["content"]["parts"][0]["text"] for l in lines), lines[:2]


PNG = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"


def gemini_image_with_schema():
    # An image as inline bytes (Part.from_bytes) and a response schema in Gemini's form: the
    # answer parses and has the schema's shape; another image, another answer.
    import json

    c = gem("g-media")
    schema = {
        "type": "OBJECT",
        "properties": {"label": {"type": "STRING"}, "score": {"type": "NUMBER"}},
        "required": ["label", "score"],
    }
    config = types.GenerateContentConfig(response_mime_type="application/json", response_schema=schema)
    answers = []
    for i in range(2):
        part = types.Part.from_bytes(data=PNG + f"client image {i}".encode(), mime_type="image/png")
        r = c.models.generate_content(model="gemini-2.5-flash", contents=[part, "classify this photo"], config=config)
        v = json.loads(r.text)
        assert isinstance(v["label"], str) and isinstance(v["score"], (int, float)), v
        answers.append(r.text)
    assert answers[0] != answers[1], answers


def openai_image_url():
    import base64

    url = "data:image/png;base64," + base64.b64encode(PNG + b"openai image").decode()
    r = oai("o-media").chat.completions.create(
        model="sim-1",
        messages=[{"role": "user", "content": [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": url}}]}],
    )
    assert r.choices[0].message.content, r


def claude(key):
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


def anthropic_call():
    r = claude("a-call").messages.create(
        model="claude-sonnet-4-5", max_tokens=50, system="be brief", messages=[{"role": "user", "content": "hello"}]
    )
    assert r.content[0].type == "text" and r.content[0].text, r
    assert r.stop_reason in ("end_turn", "max_tokens"), r
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0, r


def anthropic_stream():
    with claude("a-stream").messages.stream(
        model="claude-sonnet-4-5", max_tokens=50, messages=[{"role": "user", "content": "hello"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text, (text, final)
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0, final


def anthropic_429():
    c = claude("a-limit")
    for _ in range(2):
        c.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    try:
        c.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    except anthropic.RateLimitError as e:
        assert e.status_code == 429
        assert e.response.headers.get("retry-after"), e.response.headers
        return
    raise AssertionError("no RateLimitError")


def anthropic_image_and_tool():
    import base64

    data = base64.b64encode(PNG + b"anthropic image").decode()
    r = claude("a-media").messages.create(
        model="claude-sonnet-4-5",
        max_tokens=100,
        tools=[{"name": "answer", "input_schema": {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}}],
        tool_choice={"type": "tool", "name": "answer"},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
            {"type": "text", "text": "label this"},
        ]}],
    )
    block = r.content[0]
    assert block.type == "tool_use" and block.name == "answer" and isinstance(block.input["label"], str), r
    assert r.stop_reason == "tool_use", r


def anthropic_batch():
    # A message batch: made, polled until it ends, its results read by custom_id; a second one
    # cancelled at once, its requests canceled (none answered).
    import time

    c = claude("a-batch")
    reqs = [{"custom_id": f"req-{i}", "params": {"model": "claude-haiku-4-5", "max_tokens": 30,
             "messages": [{"role": "user", "content": f"hello {i}"}]}} for i in range(12)]
    batch = c.messages.batches.create(requests=reqs)
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 12, batch
    for _ in range(100):
        batch = c.messages.batches.retrieve(batch.id)
        if batch.processing_status == "ended":
            break
        time.sleep(0.2)
    assert batch.processing_status == "ended" and batch.request_counts.succeeded == 12, batch
    results = list(c.messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in results) == sorted(f"req-{i}" for i in range(12)), results[:2]
    assert all(r.result.type == "succeeded" and r.result.message.content[0].text for r in results), results[:2]
    listed = [b.id for b in c.messages.batches.list(limit=10)]
    assert batch.id in listed, listed
    other = c.messages.batches.create(requests=reqs[:3])
    cancelled = c.messages.batches.cancel(other.id)
    assert cancelled.cancel_initiated_at is not None, cancelled
    ended = c.messages.batches.retrieve(other.id)
    assert ended.processing_status == "ended" and ended.request_counts.succeeded + ended.request_counts.canceled == 3, ended


check("openai: chat completion", openai_call)
check("openai: streamed chat completion with usage", openai_stream)
check("openai: 429 raises RateLimitError", openai_429)
check("google-genai: generate_content (default API version)", gemini_call(None))
check("google-genai: generate_content (v1beta)", gemini_call("v1beta"))
check("google-genai: generate_content_stream", gemini_stream)
check("google-genai: 429 raises ClientError RESOURCE_EXHAUSTED with RetryInfo", gemini_429)
check("google-genai: blocked prompt has prompt_feedback.block_reason", gemini_blocked)
check("google-genai (Vertex AI mode): call and stream", vertex_call_and_stream)
check("google-genai: an image by Part.from_bytes with a response schema", gemini_image_with_schema)
check("openai: an image_url data URL", openai_image_url)
check("google-genai: a batch job from an uploaded file, its results file downloaded", gemini_batch_from_file)
check("anthropic: messages.create", anthropic_call)
check("anthropic: messages.stream", anthropic_stream)
check("anthropic: 429 raises RateLimitError with retry-after", anthropic_429)
check("anthropic: an image block and a forced tool", anthropic_image_and_tool)
check("anthropic: a message batch made, polled, read; another cancelled", anthropic_batch)
print("all client checks passed")
