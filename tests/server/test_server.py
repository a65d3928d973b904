"""``mirrorsd serve`` end to end: a real uvicorn server on loopback, the official ``openai`` client and raw
HTTP (httpx), on SmolLM2-135M real weights in its default (batch-invariant q4) format."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import mirrorsd
from mirrorsd.api import LoadedModel
from mirrorsd.server import ServerConfig, create_app
from tests.helpers import LiveServer, requires_smollm2

pytestmark = [requires_smollm2, pytest.mark.real]
MODEL = "smollm2-135m"
PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers.",
           "List three colours.", "Explain recursion in one sentence."]
LONG_PROMPT = ("Write a very long story about a dragon who learns to code, chapter by chapter, with at least ten "
               "chapters.")


@pytest.fixture(scope="module")
def models():
    target = mirrorsd.load_model(MODEL, progress=False)
    layers = target.config.n_layers // 2  # the target's first layers as the draft (`--draft self:0.5`)
    draft = LoadedModel(target.model.prefix_model(layers), target.tokenizer, f"{MODEL}[:{layers}]", target.path,
                        target.eos_token_ids, target.weights, target.activations)
    return target, draft


@pytest.fixture(scope="module")
def live(models):
    target, draft = models
    server = LiveServer(create_app(target, draft, ServerConfig(MODEL, method="sd", options={"gamma": 4},
                                                               max_prompt_tokens=512, max_tokens=256,
                                                               max_request_bytes=64 * 1024,
                                                               prompt_tokens_details=True)))
    yield server
    server.stop()


def reference(models, prompt: str, method: str = "ar", raw: bool = False, **kwargs) -> mirrorsd.Generation:
    target, draft = models
    return mirrorsd.generate(target, prompt, draft=draft if method in ("sd", "mirror") else None, method=method,
                             raw=raw, **kwargs)


# -- answers equal mirrorsd generate ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ar", "sd", "suffix"])
def test_chat_greedy_equals_generate(live, models, method):
    want = reference(models, PROMPTS[1], max_new_tokens=40, temperature=0)
    got = live.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=40, temperature=0,
        extra_body={"mirrorsd": {"method": method}})
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(want.prompt_ids)
    extra = got.usage.model_extra
    if method == "ar":
        assert extra["drafted_tokens"] == 0 and extra["accepted_tokens"] == 0
    else:
        assert extra["drafted_tokens"] >= extra["accepted_tokens"] >= 0 and extra["drafted_tokens"] > 0
    assert got.model_extra["mirrorsd"]["method"] == method


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_next_turn_prefills_only_what_is_new(live, models, method):
    """A conversation's second turn restores the first turn's keys and values from the prefix cache (OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` says how many, on a server told to report it) and still gets
    ``generate``'s answer."""
    client = live.client()
    turns = [{"role": "user", "content": PROMPTS[2] + f" ({method})"}]  # a prompt no other test sends
    first = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=12, temperature=0,
                                           extra_body={"mirrorsd": {"method": method}})
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    turns += [{"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "And one more?"}]
    second = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=12, temperature=0,
                                            extra_body={"mirrorsd": {"method": method}})
    assert second.choices[0].message.content == reference(models, turns, max_new_tokens=12, temperature=0).text
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_cached_tokens_are_reported_only_when_the_server_is_told_to(models):
    """The prefix cache is every client's: a client that reads ``cached_tokens`` can guess another client's prompt a
    token at a time and see which guess was cached. A server reports it only when started with
    ``--enable-prompt-tokens-details`` (vLLM's flag); /metrics still counts the hits, in aggregate."""
    target, _ = models
    server = LiveServer(create_app(target, None, ServerConfig(MODEL, warm_up=False)))
    body = {"model": MODEL, "prompt": "A secret note: the vault code is 7291.", "max_tokens": 2, "temperature": 0}
    try:
        before = counters(server.metrics(), "mirrorsd:prefix_cache_hits_total")
        whole = [post(server, "/v1/completions", json=body).json()["usage"] for _ in range(2)]
        with httpx.Client(timeout=60) as h, h.stream("POST", server.url + "/v1/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            streamed = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")][-1]["usage"]
        assert all("prompt_tokens_details" not in u and u["prompt_tokens"] > 0 for u in [*whole, streamed])
        assert counters(server.metrics(), "mirrorsd:prefix_cache_hits_total") > before  # (the later two hit)
    finally:
        server.stop()


def test_chat_stream_equals_generate_and_carries_segments(live, models):
    want = reference(models, PROMPTS[0], max_new_tokens=48, temperature=0.8, seed=11)
    chunks = list(live.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=48, temperature=0.8, seed=11,
        stream=True, stream_options={"include_usage": True}, extra_body={"mirrorsd": {"method": "sd"}}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    for c in chunks[1:]:
        if c.choices and c.choices[0].delta.content:  # the colouring covers exactly the chunk's text
            segments = c.model_extra["mirrorsd"]["segments"]
            assert "".join(s["text"] for s in segments) == c.choices[0].delta.content
            assert {s["source"] for s in segments} <= {"draft", "target"}
    sources = {s["source"] for c in chunks if c.choices for s in c.model_extra["mirrorsd"]["segments"]}
    assert "target" in sources
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].model_extra["mirrorsd"]["seed"] == 11
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_raw_text_equals_generate(live, models):
    prompt = "def fibonacci(n):"
    want = reference(models, prompt, method="suffix", raw=True, max_new_tokens=32, temperature=0)
    client = live.client()
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                    extra_body={"mirrorsd": {"method": "suffix"}})
    assert got.choices[0].text == want.text and got.object == "text_completion"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True) if c.choices)
    assert streamed == want.text  # the server's default method (sd) gives the same text


def test_text_equals_the_cli(live, tmp_path):
    """The same request through `mirrorsd generate` in a fresh process and through the server."""
    out = subprocess.run([sys.executable, "-m", "mirrorsd.cli", "generate", "--target", MODEL, "--method", "ar",
                          "--prompt", PROMPTS[2], "--max-new-tokens", "24", "--seed", "5", "--temperature", "0.7",
                          "--json"], capture_output=True, text=True, timeout=300, check=True)
    want = json.loads(out.stdout.splitlines()[-1])["text"]
    got = live.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=24, seed=5, temperature=0.7)
    assert got.choices[0].message.content == want


def test_stop_strings(live, models):
    want = reference(models, PROMPTS[1], max_new_tokens=64, temperature=0, stop=["\n"])
    got = live.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                                max_tokens=64, temperature=0, stop="\n")
    assert got.choices[0].message.content == want.text and "\n" not in want.text


# -- the other routes ---------------------------------------------------------------------------------------


def test_models_health_tokenize_page(live, models):
    target, _ = models
    assert [m.id for m in live.client().models.list()] == [MODEL]
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    ids = httpx.post(live.url + "/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    assert ids["tokens"] == target.tokenizer("hello world")["input_ids"] and ids["count"] == len(ids["tokens"])
    assert httpx.post(live.url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "hello world"
    chat = httpx.post(live.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == mirrorsd.api.encode_chat(target, [{"role": "user", "content": "hi"}])
    page = httpx.get(live.url + "/")
    assert page.status_code == 200 and "/static/chat.js" in page.text
    assert "segments" in httpx.get(live.url + "/static/chat.js").text


def test_the_server_warms_its_method_up_before_it_listens(models, monkeypatch):
    """An app built in Python warms its default method up (here `ss` loading its stream adapter and head) before
    its scheduler starts, with the server's options, and counts it nowhere."""
    from mirrorsd.server.scheduler import Scheduler

    target, _ = models
    events = []
    real_warm, real_start = mirrorsd.api.warm_up, Scheduler.start

    def warm(*args, **kwargs):
        seconds = real_warm(*args, **kwargs)
        events.append(("warm", kwargs))
        return seconds

    def start(self):
        events.append(("start",))
        real_start(self)

    monkeypatch.setattr(mirrorsd.api, "warm_up", warm)
    monkeypatch.setattr(Scheduler, "start", start)
    server = LiveServer(create_app(target, None, ServerConfig(MODEL, method="ss", options={"tree_budget": 2},
                                                              temperature=0)))
    try:
        assert [e[0] for e in events] == ["warm", "start"]
        kwargs = events[0][1]
        assert kwargs["method"] == "ss" and kwargs["tree_budget"] == 2 and kwargs["draft"] is None
        got = server.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12)
        want = reference(models, PROMPTS[0], method="ss", raw=True, max_new_tokens=12, temperature=0, tree_budget=2)
        assert got.choices[0].text == want.text
        finished = server.metrics()
        assert sum(v for (name, _), v in finished.items() if name == "mirrorsd:request_success_total") == 1
    finally:
        server.stop()
    monkeypatch.setattr(mirrorsd.api, "warm_up", lambda *a, **k: pytest.fail("warmed up with warm_up=False"))
    LiveServer(create_app(target, None, ServerConfig(MODEL, warm_up=False))).stop()


# -- bad input: OpenAI-shaped 4xx, never a 500 ---------------------------------------------------------------


def post(live, path: str, **kwargs) -> httpx.Response:
    return httpx.post(live.url + path, timeout=60, **kwargs)


def assert_error(r: httpx.Response, status: int, param: str | None = None, words: str = "") -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in err["message"] and words in err["message"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("body,status,param,words", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, 400, "max_tokens",
     "integer"),
    ({"model": MODEL, "messages": []}, 400, "messages", ""),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", ""),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "does not exist"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature", ""),
    # a bool is no number and a float no integer, as for the Python API (lax parsing took true for 1, 4.0 for 4)
    *[({"model": MODEL, "messages": [{"role": "user", "content": "x"}], name: value}, 400, name, "valid")
      for name, value in (("seed", True), ("temperature", True), ("top_p", True), ("top_k", 4.0), ("top_k", True),
                          ("max_tokens", True), ("max_completion_tokens", 8.0))],
    # a key of the mirrorsd object named like a sampling field is the object's (it was blamed on the field)
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "mirrorsd": {"temperature": 0.5}}, 400,
     "mirrorsd.temperature", "mirrorsd.temperature is not an option of method 'sd'"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n", "n must be 1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs", ""),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400, "max_tokens",
     "--max-tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "mirrorsd": {"method": "warp"}}, 400,
     "mirrorsd.method", "must be one of"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "mirrorsd": {"gamma": 0}}, 400,
     "mirrorsd.gamma", ">= 1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "mirrorsd": {"method": "ar", "gamma": 4}},
     400, "mirrorsd.gamma", "not an option of method 'ar'"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "mirrorsd": {"backend": "threads"}}, 400,
     "mirrorsd.backend", "command line"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "mirrorsd": {"method": "mirror",
                                                                                  "exit_head": "/tmp"}}, 400,
     "mirrorsd.exit_head", "lens, tuned or auto"),
    # a client named the server's files (a gzip error's 500 against a 400 told it whether a path exists) or made
    # it write one; a float or a list where an integer belongs was a 500 from deep inside decoding
    *[({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "mirrorsd": {"method": method, name: v}},
       400, f"mirrorsd.{name}", "command line")
      for method, name, v in (("suffix", "datastore", "/etc/passwd"), ("suffix", "shared", "persist"),
                              ("eagle", "head", "/etc"))],
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "mirrorsd": {"method": "ss",
                                                                                  "prune_exit": "/tmp"}}, 400,
     "mirrorsd.prune_exit", "adapter or tuned"),
    *[({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "mirrorsd": {"method": method, name: v}},
       400, f"mirrorsd.{name}", "must be an integer")
      for method, name, v in (("suffix", "gamma", 4.5), ("sd", "gamma", [3]), ("mirror", "kappa", 2.5),
                              ("sd", "gamma", True))],
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "mirrorsd": {"method": "sd",
                                                                                  "confidence": "high"}}, 400,
     "mirrorsd.confidence", "must be a number"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages", "at most 512"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 404, None, ""),  # a completions body sent to the chat route
    # what clients send expecting it honoured was ignored: refused instead
    *[({"model": MODEL, "messages": [{"role": "user", "content": "x"}], name: value}, 400, name, "not supported")
      for name, value in (("tool_choice", "required"), ("functions", [{"name": "f"}]), ("function_call", "auto2"),
                          ("prediction", {"type": "content", "content": "x"}), ("min_tokens", 4),
                          ("repetition_penalty", 1.2), ("min_p", 0.1), ("stop_token_ids", [7]),
                          ("guided_json", {"type": "object"}), ("guided_choice", ["a", "b"]))],
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages",
     "tool_calls are not supported"),
])
def test_bad_requests(live, body, status, param, words):
    if "prompt" in body:  # the chat route needs messages: 400, not 404
        assert_error(post(live, "/v1/chat/completions", json=body), 400, "messages")
        assert_error(post(live, "/v1/completions", json=body), 400, "prompt", "one prompt per request")
        return
    assert_error(post(live, "/v1/chat/completions", json=body), status, param, words)


def test_nulls_openai_accepts_are_defaults(live):
    """OpenAI takes null for n and stream (vLLM for ignore_eos): they were 400s here."""
    r = post(live, "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 2, "n": None, "stream": None, "ignore_eos": None,
                                                 "tool_choice": "none", "min_tokens": 0})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion" and r.json()["usage"]["completion_tokens"] <= 2


def test_bodies_a_web_page_could_send_unasked_are_refused(live):
    """A page on any site may POST ``text/plain`` (or a form) to a server on this machine without the browser
    asking the server first (a CORS "simple request"): only a body declared as JSON, or not declared, is read. And a
    page whose name its maker's DNS points at 127.0.0.1 (DNS rebinding) is refused by its Host header."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = post(live, "/v1/chat/completions", content=json.dumps(chat), headers={"content-type": kind})
        assert_error(r, 400, None, "the Content-Type header is")
        assert r.json()["error"]["code"] == "invalid_content_type"
    for kind in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json", None):
        r = post(live, "/tokenize", content=b'{"prompt": "hi"}', headers={"content-type": kind} if kind else {})
        assert r.status_code == 200 and r.json()["count"] > 0, (kind, r.text)
    port = live.url.rsplit(":", 1)[1]
    for host in ("attacker.example", f"attacker.example:{port}", "localhost.attacker.example", "[::1"):
        r = httpx.get(live.url + "/v1/models", headers={"host": host})
        assert_error(r, 400, None, "answers only requests for localhost")
        assert r.json()["error"]["code"] == "invalid_host"
    for host in (f"localhost:{port}", "LOCALHOST", f"127.0.0.1:{port}", "[::1]:80", "127.0.0.2"):
        assert httpx.get(live.url + "/v1/models", headers={"host": host}).status_code == 200, host


def test_the_host_header_is_not_checked_off_loopback(models):
    """A server bound to every address (`--host 0.0.0.0`) is meant to be reached by other names: its Host is free,
    even on a connection that came over loopback."""
    target, _ = models
    server = LiveServer(create_app(target, None, ServerConfig(MODEL, host="0.0.0.0", warm_up=False)))
    try:
        assert httpx.get(server.url + "/health", headers={"host": "gpu-box.lan:8000"}).json() == {"status": "ok"}
    finally:
        server.stop()


def test_malformed_and_oversize_bodies(live):
    assert_error(post(live, "/v1/chat/completions", content=b"{not json", headers={"content-type":
                                                                                   "application/json"}), 400)
    assert_error(post(live, "/v1/chat/completions", content=b"[1, 2]"), 400)
    nested = post(live, "/v1/chat/completions", content=b"[" * 30000 + b"]" * 30000)  # (a RecursionError's 500)
    assert_error(nested, 400, None, "nests too deeply")
    body = {"model": MODEL, "messages": []}  # /tokenize's was a 500
    tokenized, chat = post(live, "/tokenize", json=body), post(live, "/v1/chat/completions", json=body)
    assert_error(tokenized, 400, "messages")
    assert tokenized.json() == chat.json()
    assert_error(post(live, "/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "y" * (70 * 1024)}]}), 413, None, "--max-request-bytes")
    assert_error(post(live, "/v1/completions", json={"model": MODEL, "prompt": [10 ** 9]}), 400, "prompt", "range")
    assert_error(httpx.get(live.url + "/v1/nothing"), 404)
    wrong_verb = httpx.get(live.url + "/v1/chat/completions")  # (typed "server_error")
    assert_error(wrong_verb, 405)
    assert wrong_verb.json()["error"]["type"] == "invalid_request_error"
    for seed in (2**64, -(2**63) - 1):  # (wrapped round to another seed's answer)
        assert_error(post(live, "/v1/chat/completions", json={"model": MODEL, "seed": seed, "messages": [
            {"role": "user", "content": "x"}]}), 400, "seed")
    assert_error(post(live, "/v1/chat/completions", content=b'{"model": "%s", "temperature": NaN, "messages": '
                      b'[{"role": "user", "content": "x"}]}' % MODEL.encode(),
                      headers={"content-type": "application/json"}), 400, "temperature", "finite")
    assert_error(post(live, "/v1/completions", json={"model": MODEL, "prompt": "x " * 600}), 400, "prompt",
                 "at most 512")  # (blamed on "messages", a field completions do not have)
    with pytest.raises(openai.NotFoundError):
        live.client().chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="gamma"):
        live.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                              extra_body={"mirrorsd": {"gamma": -1}})


def test_api_key(models):
    target, _ = models
    server = LiveServer(create_app(target, None, ServerConfig(MODEL, api_key="s3cret", max_tokens=8)))
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/").status_code == 200  # the page holds no data; its calls need the key
        for path in ("/v1/models", "/metrics"):
            assert_error(httpx.get(server.url + path), 401, None, "API key")
            assert_error(httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}), 401)
            assert_error(httpx.get(server.url + path, headers={"Authorization": "Basic s3cret"}), 401)
            for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110); the key is not
                assert httpx.get(server.url + path, headers={"Authorization": f"{scheme} s3cret"}).status_code == 200
            assert_error(httpx.get(server.url + path, headers={"Authorization": "Bearer S3CRET"}), 401)
        assert_error(httpx.post(server.url + "/tokenize", json={"prompt": "x"}), 401)
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").models.list()
        got = server.client("s3cret").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
        assert got.usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError, match="needs a draft"):  # no --draft: sd is refused
            server.client("s3cret").chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"mirrorsd": {"method": "sd"}})
    finally:
        server.stop()


# -- concurrency: disconnects, a full queue, load -----------------------------------------------------------


def counters(snapshot: dict, name: str) -> float:
    return sum(v for (n, _), v in snapshot.items() if n == name)


def test_client_disconnect_stops_its_generation(live, models):
    before = live.metrics()
    with httpx.Client(timeout=60) as h, h.stream("POST", live.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 256,
            "temperature": 0.9, "seed": 1, "stream": True, "mirrorsd": {"method": "ar"}}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk: the request is running
        assert next(line for line in lines if line.startswith("data: {"))
    # another client is served at once, with the right answer
    want = reference(models, PROMPTS[0], max_new_tokens=16, temperature=0)
    got = live.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.text
    after = live.metrics()
    abort = ("mirrorsd:request_success_total", (("finished_reason", "abort"),))
    assert after[abort] - before.get(abort, 0) == 1
    aborted_tokens = (counters(after, "mirrorsd:generation_tokens_total")
                      - counters(before, "mirrorsd:generation_tokens_total") - got.usage.completion_tokens)
    assert aborted_tokens < 256  # it stopped early instead of decoding to max_tokens for nobody


def finished_requests(live, key: str | None = None) -> dict[str, float]:
    return {dict(labels)["finished_reason"]: value for (name, labels), value in live.metrics(key).items()
            if name == "mirrorsd:request_success_total"}


@pytest.mark.parametrize("key", [None, "s3cret"])
def test_a_client_that_leaves_a_whole_answer_stops_its_generation(models, key):
    """A non-streaming client that times out mid-answer (the OpenAI client's default reaction is to retry) must not
    leave its request decoding to ``max_tokens`` for nobody, although a step's tokens keep arriving every few ms;
    behind the API key's middleware too (Starlette's own middleware hid every disconnect from the handlers)."""
    target, _ = models
    live = LiveServer(create_app(target, None, ServerConfig(MODEL, api_key=key, max_tokens=256)))
    try:
        before = finished_requests(live, key)
        body = {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 256,
                "temperature": 0.9, "seed": 5, "ignore_eos": True, "mirrorsd": {"method": "ar"}}
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(60, read=0.6)) as h:
            h.post(live.url + "/v1/chat/completions", json=body, headers=headers)
        deadline = time.monotonic() + 60
        while (after := finished_requests(live, key)) == before:
            assert time.monotonic() < deadline, "the request never finished"
            time.sleep(0.05)
        assert after.get("abort", 0) - before.get("abort", 0) == 1
        assert after.get("length", 0) == before.get("length", 0)  # not decoded to max_tokens for nobody
    finally:
        live.stop()


def test_full_queue_answers_429(models):
    """With one request running and room for one waiting, of five more at once one waits its turn and the rest get
    429."""
    target, _ = models
    server = LiveServer(create_app(target, None, ServerConfig(MODEL, max_queued=1, max_tokens=128)))
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 96,
            "temperature": 0.9, "seed": 3}
    try:
        with httpx.Client(timeout=60) as h, h.stream("POST", server.url + "/v1/chat/completions",
                                                     json={**body, "max_tokens": 128, "stream": True}) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk: the first request is running
            with ThreadPoolExecutor(5) as pool:
                statuses = sorted(pool.map(lambda _: post(server, "/v1/chat/completions", json=body).status_code,
                                           range(5)))
            assert running.status_code == 200 and next(line for line in lines if line == "data: [DONE]")
        assert statuses.count(200) >= 1 and 429 in statuses and set(statuses) <= {200, 429}
        r = [post(server, "/v1/chat/completions", json=body) for _ in range(1)][0]
        assert r.status_code == 200  # served again once the queue drained
    finally:
        server.stop()


def test_load_16_clients_correct_answers_and_consistent_metrics(models):
    """16 concurrent clients, 2 requests each, mixed methods, greedy: every answer equals `ar`'s and the
    Prometheus counters add up to the responses' usage. Its own server with fixed windows, so that the draft
    counters have drafts to add up: under the goodput rule 16 clients of this pair draft nothing (its draft, half
    the target's layers, does not pay at that load)."""
    target, draft = models
    live = LiveServer(create_app(target, draft, ServerConfig(MODEL, method="sd", options={"gamma": 4},
                                                             speculation="fixed", max_prompt_tokens=512,
                                                             prompt_tokens_details=True)))
    try:
        _load_16_clients(live, models)
    finally:
        live.stop()


def _load_16_clients(live: LiveServer, models) -> None:
    methods = ["ar", "suffix", "sd"]
    wants = {p: reference(models, p, max_new_tokens=16, temperature=0).text for p in PROMPTS}
    before = live.metrics()

    def client_session(i: int) -> list:
        client = live.client()
        out = []
        for j in range(2):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            start = time.perf_counter()
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=16, temperature=0,
                                               extra_body={"mirrorsd": {"method": methods[(i + j) % 3]}})
            out.append((prompt, r, time.perf_counter() - start))
        return out

    start = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        results = [x for session in pool.map(client_session, range(16)) for x in session]
    wall = time.perf_counter() - start
    assert wall < 240, f"the load test took {wall:.0f} s"
    assert all(r.choices[0].message.content == wants[p] for p, r, _ in results)
    after = live.metrics()

    def grew(name: str) -> float:
        return counters(after, name) - counters(before, name)

    assert grew("mirrorsd:request_success_total") == 32
    assert grew("mirrorsd:generation_tokens_total") == sum(r.usage.completion_tokens for _, r, _ in results)
    assert grew("mirrorsd:prompt_tokens_total") == sum(r.usage.prompt_tokens for _, r, _ in results)
    assert grew("mirrorsd:spec_decode_num_draft_tokens_total") == sum(
        r.usage.model_extra["drafted_tokens"] for _, r, _ in results)
    assert grew("mirrorsd:spec_decode_num_accepted_tokens_total") == sum(
        r.usage.model_extra["accepted_tokens"] for _, r, _ in results)
    assert grew("mirrorsd:spec_decode_num_accepted_tokens_per_pos_total") == grew(
        "mirrorsd:spec_decode_num_accepted_tokens_total")
    assert grew("mirrorsd:e2e_request_latency_seconds_count") == 32
    assert grew("mirrorsd:prefix_cache_queries_total") == grew("mirrorsd:prompt_tokens_total")
    assert grew("mirrorsd:prefix_cache_hits_total") == sum(
        r.usage.prompt_tokens_details.cached_tokens for _, r, _ in results) > 0  # 4 prompts asked 32 times
    assert grew("mirrorsd:num_decode_steps_total") >= grew("mirrorsd:spec_decode_num_drafts_total") > 0
    latencies = sorted(t for _, _, t in results)
    print(f"\nload: 32 requests, 16 clients, {wall:.1f} s, "
          f"{sum(r.usage.completion_tokens for _, r, _ in results) / wall:.1f} tok/s, "
          f"p50 {latencies[15]:.2f} s, p99 {latencies[-1]:.2f} s")


def test_graceful_shutdown_finishes_running_requests(models):
    target, _ = models
    server = LiveServer(create_app(target, None, ServerConfig(MODEL)), shutdown_timeout=30)
    want = reference(models, PROMPTS[1], max_new_tokens=48, temperature=0)
    received: list[str] = []
    with httpx.Client(timeout=60) as h, h.stream("POST", server.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 48,
            "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        received.append(next(lines))
        server.server.should_exit = True  # what SIGTERM / Ctrl-C does
        received.extend(lines)
    server.thread.join(60)
    assert not server.thread.is_alive()
    received = [line for line in received if line]  # SSE events end with an empty line
    assert received[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in received if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want.text


def test_shutdown_cancels_what_outlives_the_timeout(models):
    target, _ = models
    app = create_app(target, None, ServerConfig(MODEL, shutdown_timeout=0.5))
    server = LiveServer(app, shutdown_timeout=0.5)
    received: list[str] = []
    start = time.perf_counter()
    # A reply that outlives the timeout on any machine: this seed's story runs 1,341 tokens (7 s here), where a
    # short answer (54 tokens) finished within 0.5 s on a fast VM and was never cut.
    with httpx.Client(timeout=60) as h, h.stream("POST", server.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 2000,
            "temperature": 0.9, "seed": 2, "stream": True}) as r:
        lines = r.iter_lines()
        received.append(next(lines))
        server.server.should_exit = True
        with pytest.raises(httpx.HTTPError):  # the server cuts the stream instead of decoding 2,000 tokens
            received.extend(lines)
    server.thread.join(60)
    assert not server.thread.is_alive() and time.perf_counter() - start < 30
    assert "data: [DONE]" not in received
    for engine in app.state.server.scheduler._threads:
        engine.join(10)
        assert not engine.is_alive()  # the engine threads stopped too: nothing decodes for nobody


def test_continuous_batching_serves_concurrent_clients_their_own_answers(models):
    """Eight clients at once on a server decoding up to eight requests per forward (`--max-num-seqs 8`): each
    answer is the one `mirrorsd generate` gives alone, and /metrics shows steps that carried several requests."""
    target, draft = models
    server = LiveServer(create_app(target, draft, ServerConfig(MODEL, max_running=8, prefill_rows=8,
                                                               max_tokens=64)))
    cases = [(p, m, t) for p in PROMPTS for m, t in (("ar", 0.0), ("sd", 0.0), ("suffix", 0.0), ("ar", 0.9))][:8]
    want = [reference(models, p, method=m, max_new_tokens=24, temperature=t, seed=5).text for p, m, t in cases]

    def ask(case: tuple[str, str, float]) -> str:
        prompt, method, temperature = case
        reply = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=temperature,
            seed=5, extra_body={"mirrorsd": {"method": method}})
        return reply.choices[0].message.content

    try:
        with ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(ask, cases))
        assert got == want
        metrics = server.metrics()
        steps = metrics[("mirrorsd:batch_size_count", ())]
        assert steps > 0 and metrics[("mirrorsd:batch_size_sum", ())] / steps > 1.5
        assert metrics[("mirrorsd:step_rows_sum", ())] >= metrics[("mirrorsd:batch_size_sum", ())]
        prompt_rows = metrics[("mirrorsd:step_prefill_rows_sum", ())]
        assert 0 < prompt_rows < metrics[("mirrorsd:step_rows_sum", ())]  # the prompts, and each step's window rows
    finally:
        server.stop()


def test_fp32_weights_batch_on_the_row_exact_path():
    """An fp32 model used to be served one request at a time (PyTorch's GEMM gives a row bits that depend on the
    rows beside it); the server now puts it on the row-exact C++ path, so four clients share forwards, and each
    answer is the one the same model gives alone."""
    target = mirrorsd.load_model(MODEL, weights="fp32", progress=False)
    assert not target.model.row_exact
    app = create_app(target, None, ServerConfig(MODEL, max_running=4, max_tokens=16))
    assert target.model.row_exact and app.state.server.scheduler.max_running == 4
    server = LiveServer(app)
    want = [reference((target, None), p, max_new_tokens=12, temperature=0).text for p in PROMPTS]

    def ask(prompt: str) -> str:
        reply = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0)
        return reply.choices[0].message.content

    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(ask, PROMPTS)) == want
        metrics = server.metrics()
        assert metrics[("mirrorsd:batch_size_sum", ())] > metrics[("mirrorsd:batch_size_count", ())]
    finally:
        server.stop()


def test_ignore_eos_decodes_to_max_tokens_as_load_generators_ask(live, models):
    """What aiperf and vLLM's benchmarks send for fixed-length answers: ``ignore_eos`` (decode past EOS to max_tokens),
    ``stream_options.include_usage`` and ``stop: null``. Without it the same request ends at EOS, and its tokens are
    the first ones of the ignore_eos answer."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 48,
            "temperature": 0, "stop": None}
    short = post(live, "/v1/chat/completions", json=body).json()
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 48
    with httpx.Client(timeout=120) as h, h.stream("POST", live.url + "/v1/chat/completions", json={
            **body, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 48
    assert [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")][-1]["choices"][0][
        "finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") or "" for c in chunks if c["choices"])
    assert text.startswith(short["choices"][0]["message"]["content"])


def test_only_requests_that_use_the_draft_are_bounded_by_its_context(models):
    """A draft with a shorter context capped every request, `ar` and `suffix` ones too, and the refusal blamed the
    model's context."""
    from mirrorsd.server.protocol import APIError, CompletionRequest

    target, draft = models
    short = target.model.prefix_model(draft.model.config.n_layers)
    short.config = type(short.config)(**{**short.config.__dict__, "max_position_embeddings": 64})
    draft = LoadedModel(short, target.tokenizer, "short", target.path, target.eos_token_ids, target.weights,
                        target.activations)
    server = create_app(target, draft, ServerConfig(MODEL, method="sd", warm_up=False)).state.server
    ids = list(range(100, 140))
    ask = lambda method: CompletionRequest(model=MODEL, prompt=ids, max_tokens=40,  # noqa: E731
                                           mirrorsd={"method": method})
    assert server.prepare(ask("ar"), ids).max_new_tokens == server.prepare(ask("suffix"), ids).max_new_tokens == 40
    with pytest.raises(APIError, match="the draft's context is 64 tokens") as refused:
        server.prepare(ask("sd"), ids)
    assert refused.value.status == 400
