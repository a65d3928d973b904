"""``mirrorsd serve``: an OpenAI-compatible HTTP server over :func:`mirrorsd.stream`.

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (SSE streaming with ``stream: true``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``POST /tokenize`` and ``/detokenize``, and a chat page
at ``/`` that colours each token by how it was produced. Requests are checked here (types, sizes, the method
and its options through the registry) before they queue; the :class:`~mirrorsd.server.scheduler.Scheduler`
runs them on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import api
from ..batching import Batcher
from ..decoding import REFERENCE, ModelShape, get_method
from ..errors import OptionError
from ..execution import batches
from ..prefix_cache import PrefixCache
from ..sampling import SamplingParams
from .metrics import Metrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    new_id,
    now,
)
from .scheduler import Event, Job, Scheduler

log = logging.getLogger("mirrorsd.server")
STATIC = Path(__file__).parent / "static"
# Paths (a client must not name the server's files, nor make it write them) and hardware: the command line's to set
SERVER_ONLY_OPTIONS = frozenset({"streams", "draft_streams", "head", "datastore", "shared", "backend", "threads"})
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's


@dataclass
class ServerConfig:
    """What ``mirrorsd serve``'s flags set; request fields override the sampling defaults and the options."""

    model_name: str
    method: str = REFERENCE
    options: dict[str, Any] = field(default_factory=dict)
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int = 0
    api_key: str | None = None
    max_queued: int = 64
    # Requests decoded at once, one forward per step (vLLM's max_num_seqs, llama.cpp's -np); `mirrorsd serve`'s
    # --max-num-seqs defaults to 16, an app built in Python decodes one at a time unless it asks.
    max_running: int = 1
    prefill_rows: int | None = None  # rows of waiting prompts a step takes beside the running windows (None: paced)
    speculation: str = "goodput"  # how a batch spends draft rows (runtime.batching.SPECULATION)
    max_prompt_tokens: int = 4096
    max_tokens: int = 2048
    max_request_bytes: int = 1 << 20
    shutdown_timeout: float = 30.0
    prefix_cache_bytes: int = 1 << 30  # finished requests' keys and values kept for prompts that start alike (0: off)
    # usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details): off, since the prefix cache
    # is every client's, and a client guessing another's prompt token by token would read it back from the count
    prompt_tokens_details: bool = False
    # The address uvicorn binds (`mirrorsd serve --host`; None: each connection's own): on loopback, only requests
    # whose Host names this machine are answered, so a web page cannot reach the server through DNS rebinding
    host: str | None = None
    warm_up: bool = True  # one short untimed generation with the default method before serving (api.warm_up)


@dataclass
class Prepared:
    """A checked request, ready to queue."""

    prompt_ids: list[int]
    method: str
    options: dict[str, Any]
    params: SamplingParams
    max_new_tokens: int
    stops: list[str]
    alone: str | None = None  # why it cannot share a batch (MethodOptions.unbatchable)
    ignore_eos: bool = False


class Server:
    """The models, the scheduler and the metrics behind the routes."""

    def __init__(self, target: api.LoadedModel, draft: api.LoadedModel | None, config: ServerConfig) -> None:
        self.target, self.draft, self.config = target, draft, config
        running = config.max_running
        if running > 1 and not batches(target.model) and target.model.make_row_exact():
            if draft is not None:
                draft.model.make_row_exact()
            log.info("fp32 weights: decoding on the row-exact C++ path, so requests can share forwards with the bits "
                     "each gets alone")
        if running > 1 and not batches(target.model):
            log.warning("decoding one request at a time: %s has no batch-invariant batched forward (continuous "
                        "batching needs the C++ path on the CPU: quantized weights, or fp32 ones where the kernels "
                        "apply; or the fused layers on a GPU: Triton and a power-of-two head size)", config.model_name)
            running = 1
        self.metrics = Metrics(config.model_name, lambda: self.scheduler.waiting,
                               lambda: len(self.scheduler.running))
        batcher = Batcher(config.prefill_rows, on_step=self.metrics.batch_step, speculation=config.speculation)
        self.scheduler = Scheduler(config.max_queued, running, batcher)
        self.prefix_cache = PrefixCache(target.model, config.prefix_cache_bytes)
        if config.prefix_cache_bytes and not self.prefix_cache.enabled:
            log.info("no prefix cache: %s is not on the batch-invariant C++ path, where restored keys and values are "
                     "the bits a prefill writes", config.model_name)
        context = target.config.context_length
        if draft is not None and get_method(config.method).needs_draft:  # what /v1/models reports
            context = min(context, draft.config.context_length)
        self.context = context

    # -- checks -------------------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.config.model_name}`",
                           param="model", code="model_not_found")

    def prepare(self, req: SamplingFields, prompt_ids: list[int]) -> Prepared:
        """Everything but the model name, which the routes check before tokenizing."""
        req.unsupported()
        cfg = self.config
        ext = req.mirrorsd
        method = (ext.method if ext is not None and ext.method else None) or cfg.method
        try:
            spec = get_method(method)
        except OptionError as e:
            raise APIError(400, f"mirrorsd.method {e.message}", param="mirrorsd.method") from None
        if spec.needs_draft and self.draft is None:
            raise APIError(400, f"method {method!r} needs a draft model; this server has none (start it with "
                           "--draft)", param="mirrorsd.method")
        asked = ext.options() if ext is not None else {}
        fixed = sorted(SERVER_ONLY_OPTIONS & set(asked))
        if fixed:
            raise APIError(400, f"mirrorsd.{fixed[0]} is set by the server's command line, not per request",
                           param=f"mirrorsd.{fixed[0]}")
        if asked.get("exit_head", "auto") not in ("lens", "tuned", "auto"):  # a folder is the command line's to name
            raise APIError(400, "mirrorsd.exit_head must be lens, tuned or auto per request",
                           param="mirrorsd.exit_head")
        if asked.get("prune_exit", "adapter") not in ("adapter", "tuned"):
            raise APIError(400, "mirrorsd.prune_exit must be adapter or tuned per request",
                           param="mirrorsd.prune_exit")
        options = {**(cfg.options if method == cfg.method else {}), **asked}
        shape = ModelShape(self.target.config.n_layers, self.target.config.vocab_size)
        try:
            parsed = spec.options.parse(options, method, shape)
            alone = parsed.unbatchable()
        except OptionError as e:  # (a key of the mirrorsd object, even one named like a sampling field)
            raise APIError(400, f"mirrorsd.{e.option} {e.message}", param=f"mirrorsd.{e.option}") from None
        try:
            params = SamplingParams(
                temperature=cfg.temperature if req.temperature is None else req.temperature,
                top_p=cfg.top_p if req.top_p is None else req.top_p,
                top_k=cfg.top_k if req.top_k is None else max(req.top_k, 0),
                seed=0 if req.seed is None else req.seed)
        except OptionError as e:
            raise APIError(400, f"{e.option} {e.message}", param=e.option) from None
        if len(prompt_ids) > cfg.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this server takes at most "
                           f"{cfg.max_prompt_tokens} (--max-prompt-tokens)",
                           param="prompt" if isinstance(req, CompletionRequest) else "messages",
                           code="context_length_exceeded")
        context, whose = self.target.config.context_length, "model"
        room = context - len(prompt_ids)
        if spec.needs_draft:  # (a request's method may use the draft, which may read less of the prompt)
            drafts = self.draft.config.context_length - parsed.draft_positions(len(prompt_ids), 0)
            if drafts < room:
                context, whose, room = self.draft.config.context_length, "draft", drafts
        limit = req.token_limit
        if limit is not None and limit > cfg.max_tokens:
            raise APIError(400, f"max_tokens is {limit}; this server allows at most {cfg.max_tokens} "
                           "(--max-tokens)", param="max_tokens")
        if room < 1 or (limit is not None and limit > room):
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens and max_tokens is {limit}, but the "
                           f"{whose}'s context is {context} tokens", param="max_tokens",
                           code="context_length_exceeded")
        return Prepared(prompt_ids, method, options, params, min(limit or cfg.max_tokens, room), req.stops, alone,
                        bool(req.ignore_eos))

    def encode(self, prompt: str | list[int], *, raw: bool) -> list[int]:
        try:
            return api.encode_prompt(self.target, prompt, raw=raw)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None

    def encode_chat(self, req: ChatCompletionRequest) -> list[int]:
        try:
            return api.encode_chat(self.target, req.conversation())
        except APIError:
            raise
        except Exception as e:  # a chat template refusing the conversation (jinja2 errors)
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None

    # -- running ------------------------------------------------------------------------------------------

    def job(self, p: Prepared, seed_given: bool) -> Job:
        def make_stream() -> api.GenerationStream:
            return api.stream(self.target, p.prompt_ids, draft=self.draft if get_method(p.method).needs_draft
                              else None, method=p.method, temperature=p.params.temperature, top_k=p.params.top_k,
                              top_p=p.params.top_p, seed=p.params.seed if seed_given else None,
                              max_new_tokens=p.max_new_tokens, stop=p.stops, ignore_eos=p.ignore_eos,
                              prefix_cache=self.prefix_cache, **p.options)

        return Job(make_stream, asyncio.get_running_loop(), on_step=self.metrics.step, alone=p.alone)

    def finish(self, job: Job, reason: str, first_token_at: float | None, completion_tokens: int) -> None:
        """Metrics and the log line of a request that ended (``abort``: its client went away)."""
        end = time.perf_counter()
        ttft = first_token_at - job.arrival if first_token_at is not None else None
        stats = job.stream.request.stats if job.stream is not None else None
        prompt_tokens = len(job.stream.prompt_ids) if job.stream is not None else 0
        cached = stats.cached_tokens if stats is not None else 0
        self.metrics.finished(reason, prompt_tokens, cached, completion_tokens, ttft, end - job.arrival)
        if stats is not None:
            decode_s = end - (first_token_at or end)
            log.info("request %s: method=%s prompt=%d cached=%d tokens=%d mean_accepted_length=%.2f tok/s=%.1f "
                     "ttft=%.2fs e2e=%.2fs finish=%s", job.id, stats.method, prompt_tokens, cached, completion_tokens,
                     stats.mean_accepted_length, (completion_tokens - 1) / decode_s if decode_s > 0 else 0.0,
                     ttft or 0.0, end - job.arrival, reason)


def usage(result: api.Generation, prompt_tokens_details: bool = False) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details`` (the prefix cache's hits) only where the server is told to report
    them (:attr:`ServerConfig.prompt_tokens_details`)."""
    st = result.stats
    # OpenAI's prediction tokens split the drafted ones by whether they reached the output (an EOS or stop cut
    # leaves accepted tokens out of it), so the two add up to drafted_tokens; ours, drafted/accepted_tokens, are
    # the verifier's, as the spec_decode metrics are (vLLM's convention)
    drafted, accepted, output = sum(st.drafted), sum(st.accepted), st.accepted_output
    body = {"prompt_tokens": len(result.prompt_ids), "completion_tokens": len(result.token_ids),
            "total_tokens": len(result.prompt_ids) + len(result.token_ids),
            "completion_tokens_details": {"accepted_prediction_tokens": output,
                                          "rejected_prediction_tokens": drafted - output},
            "drafted_tokens": drafted, "accepted_tokens": accepted}
    if prompt_tokens_details:
        body["prompt_tokens_details"] = {"cached_tokens": st.cached_tokens}
    return body


def summary(result: api.Generation) -> dict[str, Any]:
    """The ``mirrorsd`` field of a finished response: how it was decoded."""
    st = result.stats
    return {"method": st.method, "seed": st.seed, "steps": st.steps,
            "mean_accepted_length": round(st.mean_accepted_length, 4), "target_forwards": st.target_forwards,
            "draft_forwards": st.draft_forwards, "tokens_per_s": round(st.tokens_per_s, 2)}


async def read_json(request: Request, model: type[BaseModel], limit: int) -> Any:
    """The body as ``model``: 413 past ``limit`` bytes, 400 for malformed JSON or a wrong field, and 400 for a body
    declared as something other than JSON: a web page may send any site a ``text/plain`` POST without asking it
    first (a CORS "simple request"), but not a JSON one (FastAPI refuses it too). No Content-Type is accepted."""
    content_type = request.headers.get("content-type")
    if content_type:
        kind = content_type.split(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):
            raise APIError(400, f"the Content-Type header is {content_type!r}; send the body as application/json",
                           code="invalid_content_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; this server takes at most {limit} "
                       "(--max-request-bytes)", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is over {limit} bytes (--max-request-bytes)",
                           code="request_too_large")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the body's JSON nests too deeply", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{where or 'body'}: {err['msg']}", param=where) from None


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


def create_app(target: api.LoadedModel, draft: api.LoadedModel | None, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``target`` (and ``draft`` for methods that need one)."""
    server = Server(target, draft, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if config.warm_up:  # before uvicorn listens, so no request waits on the method's one-time work
            seconds = await asyncio.to_thread(api.warm_up, target, method=config.method, draft=draft,
                                              **config.options)
            log.info("warmed up %s in %.1f s", config.method, seconds)
        server.scheduler.start()
        yield
        await asyncio.to_thread(server.scheduler.stop, config.shutdown_timeout)

    app = FastAPI(title="mirrorsd", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    if config.api_key:
        app.add_middleware(KeyGate, key=config.api_key)
    app.add_middleware(HostGate, host=config.host)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return error(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(APIError(405, f"{request.method} is not allowed on {request.url.path}").body(), 405)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": now(),
                                            "owned_by": "mirrorsd", "max_model_len": server.context}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await read_json(request, TokenizeRequest, config.max_request_bytes)
        server.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = await asyncio.to_thread(server.encode_chat, ChatCompletionRequest(model=config.model_name,
                                                                                    messages=req.messages))
        else:  # (off the event loop, as the generation routes: a 1 MB body takes a second, every stream waiting)
            ids = (await asyncio.to_thread(server.target.tokenizer, req.prompt,
                                           add_special_tokens=req.add_special_tokens))["input_ids"]
        return {"tokens": ids, "count": len(ids), "max_model_len": server.context}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await read_json(request, DetokenizeRequest, config.max_request_bytes)
        server.check_model(req.model)
        vocab = server.target.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        return {"prompt": await asyncio.to_thread(server.target.tokenizer.decode, req.tokens)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = await read_json(request, ChatCompletionRequest, config.max_request_bytes)
        server.check_model(req.model)
        prompt_ids = await asyncio.to_thread(server.encode_chat, req)
        return await respond(server, request, req, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await read_json(request, CompletionRequest, config.max_request_bytes)
        server.check_model(req.model)
        prompt = req.one_prompt()
        prompt_ids = await asyncio.to_thread(server.encode, prompt, raw=True)
        return await respond(server, request, req, prompt_ids, chat=False)

    @app.get("/")
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


class KeyGate:
    """Every path but the page, its files and ``/health`` asks for ``Authorization: Bearer KEY``. A plain ASGI
    middleware: Starlette's ``@app.middleware("http")`` (``BaseHTTPMiddleware``) wraps ``receive`` so that
    ``Request.is_disconnected()`` never sees a client leave (Starlette discussion 2094; vLLM and SGLang hit the same),
    and a non-streaming answer would then decode to ``max_tokens`` for nobody."""

    OPEN = frozenset({"/health", "/", "/favicon.ico"})

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in self.OPEN and not path.startswith("/static/"):
            scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.expected):
                denied = error(APIError(401, "missing or wrong API key: send Authorization: Bearer KEY",
                                        code="invalid_api_key"))
                await denied(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HostGate:
    """On a server bound to loopback, a request whose ``Host`` names anything but this machine (``localhost`` or a
    loopback address) is refused: a web page whose maker points its name at 127.0.0.1 (DNS rebinding) would otherwise
    be the server's own origin to the browser, and read its answers. A plain ASGI middleware, as :class:`KeyGate`."""

    def __init__(self, app: ASGIApp, host: str | None) -> None:
        self.app, self.host = app, host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        bound = self.host or (scope.get("server") or (None,))[0]
        if scope["type"] == "http" and loopback(bound):
            named = Headers(scope=scope).get("host")  # (none: an HTTP/1.0 client, never a browser)
            if named is not None:
                try:
                    name = urlsplit(f"//{named}").hostname
                except ValueError:  # (an unclosed "[")
                    name = None
                if not loopback(name):
                    refused = error(APIError(400, f"the Host header names {named!r}; this server listens on {bound} "
                                             "and answers only requests for localhost, 127.0.0.1 or [::1] (a web "
                                             "page could otherwise reach it through DNS rebinding)",
                                             code="invalid_host"))
                    await refused(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def loopback(host: str | None) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def respond(server: Server, request: Request, req: SamplingFields, prompt_ids: list[int],
                  chat: bool) -> Response:
    """Queue the request, wait until the engine starts it (so its errors are HTTP statuses), then answer."""
    prepared = server.prepare(req, prompt_ids)
    job = server.job(prepared, seed_given=req.seed is not None)
    job.id = new_id("chatcmpl" if chat else "cmpl")
    server.scheduler.submit(job)
    client = Departure(request, job)
    try:
        first = await client.next()
    except BaseException:
        job.cancel()
        raise
    if first.kind == "error":
        raise first.value
    if first.kind != "started":  # the client left while queued
        server.finish(job, "abort", None, 0)
        return Response(status_code=499)
    if req.stream:
        return StreamingResponse(stream_events(server, job, req, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await whole_response(server, client, job, chat)


class Departure:
    """A request's job events, watching its client: once the client disconnects, the job is cancelled and
    :meth:`next` returns :data:`LEFT` (non-streaming answers have no other way to notice a client that went away).
    The client is looked at every :attr:`EVERY` seconds however fast the events come: a decoding step's tokens arrive
    every few ms, and a check made only in the gaps between events would never run."""

    EVERY = 0.25

    def __init__(self, request: Request, job: Job) -> None:
        self.request, self.job = request, job
        self.looked = time.monotonic()

    async def next(self) -> Any:
        getter = asyncio.ensure_future(self.job.next())
        try:
            while True:
                due = self.looked + self.EVERY - time.monotonic()
                if due <= 0:
                    self.looked = time.monotonic()
                    if await self.request.is_disconnected():
                        self.job.cancel()
                        return LEFT
                    due = self.EVERY
                done, _ = await asyncio.wait({getter}, timeout=due)
                if done:
                    return getter.result()
        finally:
            getter.cancel()


LEFT = Event("left")


async def whole_response(server: Server, client: Departure, job: Job, chat: bool) -> Response:
    first_token_at: float | None = None
    tokens = 0
    try:
        while True:
            event = await client.next()
            if event.kind == "delta":
                if event.value.token_ids and first_token_at is None:
                    first_token_at = event.at
                tokens += len(event.value.token_ids)
            elif event.kind == "done":
                result = event.value
                server.finish(job, FINISH_REASONS[result.finish_reason], first_token_at, len(result.token_ids))
                return JSONResponse(completion_body(job.id, server.config, result, chat))
            elif event.kind == "error":  # counted as the streaming answer counts it
                server.finish(job, "error", first_token_at, tokens)
                raise event.value
            else:  # cancelled, or the client left
                server.finish(job, "abort", first_token_at, tokens)
                return Response(status_code=499)
    except asyncio.CancelledError:  # the server's graceful shutdown ran out: stop decoding for nobody
        job.cancel()
        server.finish(job, "abort", first_token_at, tokens)
        raise


def completion_body(id_: str, config: ServerConfig, result: api.Generation, chat: bool) -> dict[str, Any]:
    finish = FINISH_REASONS[result.finish_reason]
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish}
    return {"id": id_, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": config.model_name, "choices": [choice], "usage": usage(result, config.prompt_tokens_details),
            "mirrorsd": summary(result)}


async def stream_events(server: Server, job: Job, req: SamplingFields, chat: bool) -> AsyncIterator[bytes]:
    """SSE chunks: one per decoding step that produced text, then the finish chunk, the usage chunk when asked
    for, and ``data: [DONE]``. Each chunk's ``mirrorsd`` field carries the step's text split by how it was
    produced (``segments``: ``[{"text", "source": "draft" | "target"}]``) and the running counts."""
    model, created = server.config.model_name, now()
    kind = "chat.completion.chunk" if chat else "text_completion"
    include_usage = req.include_usage

    def chunk(text: str | None, finish: str | None, extra: dict[str, Any]) -> dict[str, Any]:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body = {"id": job.id, "object": kind, "created": created, "model": model, "choices": [choice],
                "mirrorsd": extra}
        if include_usage:
            body["usage"] = None
        return body

    first_token_at: float | None = None
    tokens = steps = 0
    finished = False
    try:
        if chat:
            first = chunk(None, None, {"segments": [], "completion_tokens": 0, "steps": 0})
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield sse(first)
        while True:
            event = await job.next()
            if event.kind == "delta":
                d = event.value
                if d.token_ids:
                    first_token_at = first_token_at or event.at
                    tokens += len(d.token_ids)
                    steps += 1
                if d.text:
                    yield sse(chunk(d.text, None, {"segments": [{"text": t, "source": s} for t, s in d.segments],
                                                   "completion_tokens": tokens, "steps": steps}))
            elif event.kind == "done":
                result = event.value
                finished = True
                server.finish(job, FINISH_REASONS[result.finish_reason], first_token_at, len(result.token_ids))
                yield sse(chunk(None if chat else "", FINISH_REASONS[result.finish_reason],
                                {"segments": [], "completion_tokens": len(result.token_ids), "steps": steps,
                                 **summary(result)}))
                if include_usage:
                    yield sse({"id": job.id, "object": kind, "created": created, "model": model, "choices": [],
                               "usage": usage(result, server.config.prompt_tokens_details)})
                yield sse("[DONE]")
                return
            elif event.kind == "error":  # after the stream started: say so in the stream, OpenAI-style
                finished = True
                server.finish(job, "error", first_token_at, tokens)
                yield sse(event.value.body())
                return
            else:
                return
    finally:
        if not finished:  # the client went away (Starlette cancels this generator): stop decoding for it
            job.cancel()
            server.finish(job, "abort", first_token_at, tokens)
