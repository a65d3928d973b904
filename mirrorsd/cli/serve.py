"""``mirrorsd serve``: the OpenAI-compatible HTTP server on a target (and a draft)."""

from __future__ import annotations

import argparse
import logging
import os
import socket

import uvicorn
from rich.console import Console

import mirrorsd
from mirrorsd.api import default_method, planned, warm_up
from mirrorsd.batching import PREFILL_PACE, SPECULATION
from mirrorsd.decoding import get_method
from mirrorsd.server import ServerConfig, create_app

from .args import COMMANDS, add_dtype, add_formats, add_method, add_method_flags, add_pair, add_sampling
from .common import HelpFormatter, checked_options, load_draft, say_loaded


def register(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser(
        "serve", formatter_class=HelpFormatter, help=COMMANDS["serve"],
        description="Serve a target (and a draft) over OpenAI's HTTP API with speculative decoding: POST "
        "/v1/chat/completions and /v1/completions (stream: true for SSE), GET /v1/models, /health, /metrics "
        "(Prometheus), POST /tokenize and /detokenize, and a chat page at / that colours each token by how it was "
        "produced. Requests may pick the method and its options in a `mirrorsd` object ({\"mirrorsd\": "
        "{\"method\": \"suffix\", \"gamma\": 8}}); this command's flags are the defaults. Every answer is "
        "the target's own output, as with `mirrorsd generate`.")
    add_pair(sv, draft_help="draft model for sd / mirror: zoo name or folder, or self:N / self:F; kept for the "
                            "requests that ask for those whatever the default --method (default: none; requests may "
                            "then use only draft-free methods: ar, suffix, ss)")
    add_method(sv, "the default decoding method of requests (default: sd with --draft, else ar; "
                   "`suffix` needs no draft and measured fastest here, see docs/drafting.md)")
    sv.add_argument("--served-model-name", help="the model name clients send (default: --target)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (loopback: only this machine)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port")
    sv.add_argument("--api-key", help="require Authorization: Bearer KEY on every route but /health and the "
                                      "page (default: $MIRRORSD_API_KEY, else none)")
    add_sampling(sv, temperature=(1.0, "temperature of requests that send none (OpenAI's default; 0 is greedy)"),
                 top_p=(1.0, "top_p of requests that send none"),
                 top_k=(0, "top_k of requests that send none (0: off)"))
    sv.add_argument("--max-queued", type=int, default=64,
                    help="requests that may wait for the engine; more are answered 429")
    sv.add_argument("--max-num-seqs", type=int, default=16,
                    help="requests decoded at once (continuous batching: one forward per step carries every running "
                         "request's rows, and requests join and leave between steps; vLLM's --max-num-seqs, "
                         "llama.cpp's -np); 1 decodes one at a time")
    sv.add_argument("--prefill-rows", type=prefill_rows, default=None, metavar="auto|N",
                    help="prompt rows a batched step takes beside the running requests' windows. auto (default): as "
                         f"many as keep a step within {PREFILL_PACE:g}x the running windows' own step on the batch's "
                         "measured cost, so running streams keep about half their pace while a long prompt arrives and "
                         "the prompt gets the other half of the machine; N: a fixed number (smaller keeps streams "
                         "faster, larger gives the prompt its first token sooner)")
    sv.add_argument("--speculation", default="goodput", choices=SPECULATION,
                    help="how a busy batch spends draft rows: goodput drafts only where a row pays for what it costs "
                         "every running request (the method's own window at concurrency 1, none under heavy load); "
                         "fixed keeps each method's window whatever the load")
    sv.add_argument("--prefix-cache-mib", type=int, default=1024,
                    help="memory for finished requests' keys and values, so a prompt that starts like an earlier "
                         "sequence (a conversation's next turn, a shared system prompt) prefills only the rest "
                         "(vLLM's prefix caching, llama.cpp's cache_prompt); used where it cannot change a token: "
                         "on the batch-invariant C++ path; 0: off")
    sv.add_argument("--enable-prompt-tokens-details", action="store_true",
                    help="report usage.prompt_tokens_details.cached_tokens (the prompt tokens the prefix cache "
                         "restored; vLLM's flag). Off by default: the cache is shared by every client, so a client "
                         "could read another's prompt back by guessing it a token at a time and watching the count")
    sv.add_argument("--max-prompt-tokens", type=int, default=4096, help="longest prompt accepted (400 beyond)")
    sv.add_argument("--max-tokens", type=int, default=2048,
                    help="largest max_tokens a request may ask for, and the limit of requests that set none")
    sv.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body (413 beyond)")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds running requests get to finish on shutdown before they are cancelled")
    sv.add_argument("--no-warmup", action="store_true",
                    help="skip the warm-up: by default one short untimed generation with the default method runs "
                         "before the server listens, so its one-time work (loading a stream adapter, say) is not "
                         "paid by the first request (llama.cpp's --no-warmup)")
    sv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sv.add_argument("--device", default="cpu", help="torch device for both models")
    sv.add_argument("--draft-device", help="device for the draft model (default: --device)")
    add_dtype(sv)
    add_formats(sv)
    add_method_flags(sv)
    sv.set_defaults(func=run)


def prefill_rows(text: str) -> int | None:
    """``--prefill-rows``: ``auto`` (None: paced by the batch's cost) or a number of rows."""
    if text == "auto":
        return None
    try:
        rows = int(text)
    except ValueError:
        rows = 0
    if rows < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a number of rows >= 1, got {text!r}")
    return rows


def check_bindable(host: str, port: int) -> None:
    """Fail before minutes of loading, not after, when the address is taken or not this machine's (uvicorn would
    say so only once the models are up). The probe socket is closed again: uvicorn binds it for real."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} is not an address of this machine: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True, markup=False, soft_wrap=True)
    method = args.method or default_method(args.draft)
    options = checked_options(args, method, serving=True)
    for name, value in (("--max-queued", args.max_queued), ("--max-num-seqs", args.max_num_seqs),
                        ("--max-prompt-tokens", args.max_prompt_tokens),
                        ("--max-tokens", args.max_tokens), ("--max-request-bytes", args.max_request_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if args.prefix_cache_mib < 0:
        raise ValueError(f"--prefix-cache-mib must be >= 0, got {args.prefix_cache_mib}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    needs_draft = args.draft is not None or method == "auto" or get_method(method).needs_draft
    if needs_draft and args.draft is None and method != "auto":
        raise ValueError(f"--method {method} needs --draft (a zoo name or folder, or self:N)")
    check_bindable(args.host, args.port)
    api_key = args.api_key or os.environ.get("MIRRORSD_API_KEY") or None
    with err.status(f"loading target {args.target}…"):
        target = mirrorsd.load_model(args.target, device=args.device, dtype=args.dtype, weights=args.weights,
                                     activations=args.activations)
    say_loaded("target", target, args)
    draft = load_draft(args, target, err) if needs_draft and (args.draft or method != "auto") else None
    if method == "auto":  # (a draft the plan does not use stays, for the requests that ask for sd or mirror)
        method, options, _ = planned(target, draft, options)
        err.print(f"mirrorsd: auto chose {method} {options}", style="dim", highlight=False)
    config = ServerConfig(model_name=args.served_model_name or target.name, method=method, options=options,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, api_key=api_key,
                          max_queued=args.max_queued, max_running=args.max_num_seqs,
                          prefill_rows=args.prefill_rows, speculation=args.speculation,
                          max_prompt_tokens=args.max_prompt_tokens,
                          max_tokens=args.max_tokens, max_request_bytes=args.max_request_bytes,
                          shutdown_timeout=args.shutdown_timeout, prefix_cache_bytes=args.prefix_cache_mib << 20,
                          prompt_tokens_details=args.enable_prompt_tokens_details, host=args.host,
                          warm_up=False)  # (warmed below, where a method that fails to build is a clear error)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        err.print(f"mirrorsd: warning: serving on {args.host} without --api-key: anyone who can reach this "
                  "port can use the model", style="yellow", highlight=False)
    app = create_app(target, draft, config)
    if not args.no_warmup:
        with err.status(f"warming up {method}…"):
            seconds = warm_up(target, method=method, draft=draft, **options)
        err.print(f"mirrorsd: warmed up {method} in {seconds:.1f} s", style="dim", highlight=False)
    err.print(f"mirrorsd: serving {config.model_name} with method {method} at http://{args.host}:{args.port} "
              f"(chat page at /, OpenAI API at /v1, metrics at /metrics)", highlight=False)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0
