"""``mirrorsd generate``: a completion per prompt with any method, streamed or as JSON, also under torchrun."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console

import mirrorsd
from mirrorsd import tuned_drafts, zoo
from mirrorsd.api import SELF_DRAFT, encode_prompt, self_draft_depth
from mirrorsd.decoding import MethodOptions, get_method, leave_launched_world, methods, serve_launched
from mirrorsd.plans import describe_setup, measured_otherwise, saved_recommendation, setup_of
from mirrorsd.runtime import write_chrome_trace
from mirrorsd.runtime.processes import launched_rank
from mirrorsd.runtime.tensor_parallel import DRAFT_SYNCS, gather_spans, launched_world, shard_draft, shard_target

from .args import COMMANDS, DEFAULT_DRAFT, add_dtype, add_formats, add_method, add_method_flags, add_pair, add_sampling
from .common import HelpFormatter, checked_options, load_draft, say_loaded


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate",
        help=COMMANDS["generate"],
        description="Generate a completion. Speculative methods give the target's own tokens: greedy output "
        "equals --method ar, and seeded sampling equals ar for the same --seed (up to float near-ties).",
        formatter_class=HelpFormatter,
    )
    add_pair(g, draft_help="draft for speculative methods: zoo name or folder, or self:N / self:F for the target's "
                           f"first N layers (or fraction F of them) (default: {DEFAULT_DRAFT})")
    add_method(g, "; ".join(f"{m.name}: {m.summary}" for m in methods()) + "; auto: the configuration "
               "`mirrorsd plan` saved for this target and draft on this machine, planned briefly (1-2 minutes) on "
               "first use; it falls back to ar when nothing pays (default: auto; the API's default is sd when a "
               "draft is given, else ar)")
    g.add_argument("--draft-device", help="device for the draft model (--backend devices), e.g. cuda:1 or cpu "
                                          "(default: --device)")
    g.add_argument("--trace", metavar="FILE",
                   help="write a Chrome/Perfetto trace of the target and draft lanes to FILE (methods that trace "
                        "their lanes: mirror) (default: none)")
    add_method_flags(g)
    add_sampling(g, temperature=(0.0, "0 means greedy"), top_k=(0, "0 disables top-k filtering"),
                 top_p=(1.0, "1 disables nucleus filtering"),
                 seed=(None, "sampling seed; noise is keyed by seed and position, so ar and sd agree for a seed "
                             "(default: random, reported in --json stats)"),
                 max_new_tokens=(128, "most tokens to generate"))
    g.add_argument("--stop", action="append",
                   help="stop string (repeatable); excluded from the output (default: none; EOS always stops)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts", help='JSONL file with one {"prompt": ...} per line')
    g.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming")
    g.add_argument("--device", default="cpu", help="torch device for both models (cpu, cuda, cuda:1, ...)")
    add_dtype(g, "weights and activations; the zoo converts to float32")
    add_formats(g, "weight format for both models: fp32; q8 (int8 per 32 weights); q4 (the codes of the GGUF file a "
                "zoo folder keeps — Q4_K_M for the Qwen pair, Q4_1/Q8_0 for SmolLM2 — computed without "
                "dequantizing) (default: per zoo model, the fastest format that passed the chat quality gate "
                "(`mirrorsd bench quality`); q4 for other folders holding a model.gguf; else fp32)",
                "activation precision of quantized weights: int8 (per 32 features, fastest) or int8x2 (a second "
                "int8 plane for the remainder, ~15 bits: what small models need on chat prompts) (default: the zoo "
                "model's gate-picked one; int8x2 for other folders holding a model.gguf; else int8)")
    g.add_argument("--target-tp", type=int, default=1, metavar="N",
                   help="shard the target's projections over N ranks (Megatron tensor parallelism) under torchrun: "
                        "--nproc-per-node N, or N + 1 with --backend processes (the last rank serves the draft); "
                        "dense weights (--weights fp32), methods ar, sd and mirror without timing-driven choices")
    g.add_argument("--draft-tp", type=int, default=1, metavar="G",
                   help="with --backend processes under torchrun: shard the draft over G ranks (the world's last G; "
                        "--nproc-per-node = target ranks + G), dense weights (--weights fp32)")
    g.add_argument("--draft-syncs", choices=DRAFT_SYNCS, default="spd",
                   help="with --draft-tp: spd, the Mirror-SD paper's draft sharding (two segments of tracks, two "
                        "all-reduces per draft forward: the draft computes something else and proposes other "
                        "tokens, the output stays the target's); layer, Megatron tensor parallelism (two per layer, "
                        "the draft's own tokens)")
    g.set_defaults(func=run)


def _read_prompts(path: str) -> dict[str, str | list]:
    """One JSON object a line, ``{"prompt": TEXT}``, ``{"prompt": [token ids]}`` or ``{"prompt": [chat messages]}``:
    every line is checked before any model loads (a number or null failed as a traceback after loading). Each prompt
    by where it is (``FILE:LINE``), so an error found later can name it."""
    prompts = {}
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # (a BOM, as editors on Windows write it)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f'{path}:{n}: expected a JSON object with a "prompt" field ({e})') from None
        chat = isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt)
        ids = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
        if not (isinstance(prompt, str) or chat or ids):
            raise ValueError(f'{path}:{n}: "prompt" must be text, token ids or chat messages ([{{"role": ..., '
                             f'"content": ...}}]), got {json.dumps(prompt)[:60]}')
        prompts[f"{path}:{n}"] = prompt
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _auto_choice(args: argparse.Namespace) -> tuple[str, dict]:
    """``--method auto``: the plan saved for this target and draft on this machine, resolved before any model loads
    so that the flags are checked against the method it picked; ``("auto", {})`` when there is no plan yet (the
    API then plans briefly after loading)."""
    draft = _plan_draft(args)
    pick = None if draft is not None and draft.startswith(SELF_DRAFT) else saved_recommendation(args.target, draft)
    return ("auto", {}) if pick is None else (pick["method"], pick["options"])


def _plan_draft(args: argparse.Namespace) -> str | None:
    """The draft a plan for ``--method auto`` is keyed by: ``--draft``, else the default draft where it shares the
    target's tokenizer, else none (auto then chooses among the methods without a draft model, and no draft loads:
    SmolLM2 as the target loaded the Qwen draft for nothing, and the plan was never found before loading)."""
    if args.draft:
        return args.draft
    return None if zoo.same_tokenizer(args.target, DEFAULT_DRAFT) is False else DEFAULT_DRAFT


def _checked_target_tp(args: argparse.Namespace) -> int:
    """``--target-tp``: the target's ranks under torchrun; sharding splits dense weights only."""
    tp = args.target_tp
    if tp < 1:
        raise ValueError(f"--target-tp must be >= 1, got {tp}")
    if tp > 1 and launched_rank() is None:
        raise ValueError(f"--target-tp {tp} runs under torchrun: torchrun --nproc-per-node {tp} -m mirrorsd.cli "
                         f"generate ... (or {tp + 1} with --backend processes)")
    if tp > 1 and args.weights not in (None, "fp32"):
        raise ValueError(f"--target-tp shards dense weights; --weights {args.weights} cannot be split (use fp32)")
    if tp > 1:
        args.weights = "fp32"
    return tp


def _draft_ranks(args: argparse.Namespace, method: str, options: dict) -> MethodOptions | None:
    """The method's options where its draft runs in ranks of its own (:meth:`MethodOptions.draft_ranks`), else None;
    parsed only where ranks matter (under torchrun, or ``--draft-tp`` given)."""
    if method == "auto" or (launched_rank() is None and args.draft_tp == 1):
        return None
    return get_method(method).options.parse(options, method)


def _checked_draft_tp(args: argparse.Namespace, tp: int, opts: MethodOptions | None) -> int:
    """``--draft-tp``: the draft's ranks under torchrun, for a method whose draft has ranks, and dense weights."""
    draft_tp = args.draft_tp
    if draft_tp < 1:
        raise ValueError(f"--draft-tp must be >= 1, got {draft_tp}")
    if draft_tp > 1:
        (opts or MethodOptions()).check_draft_sharded()
    if draft_tp > 1 and launched_rank() is None:
        raise ValueError(f"--draft-tp {draft_tp} runs under torchrun: torchrun --nproc-per-node {tp + draft_tp} -m "
                         "mirrorsd.cli generate ... (the target's ranks, then the draft's)")
    if draft_tp > 1 and args.weights not in (None, "fp32"):
        raise ValueError(f"--draft-tp shards dense weights; --weights {args.weights} cannot be split (use fp32)")
    if draft_tp > 1:
        args.weights = "fp32"
    return draft_tp


def _warn_draft_form(args: argparse.Namespace, draft_tp: int, err: Console) -> None:
    """A tuned draft proposes well only in the form it was trained in: whole, or the spd form over G tracks."""
    folder = tuned_drafts.resolve(args.draft) if args.draft else None
    if folder is None:
        return
    trained = tuned_drafts.load_config(folder).spd_tracks
    runs = draft_tp if draft_tp > 1 and args.draft_syncs == "spd" else 1
    if trained != runs:
        def form(tracks: int) -> str:
            return f"in the spd form over {tracks} tracks" if tracks > 1 else "whole"
        err.print(f"mirrorsd: warning: the draft {args.draft} was trained {form(trained)} and runs {form(runs)} "
                  "here: it will propose worse tokens (the output stays the target's)", style="yellow",
                  highlight=False)


def _serve_draft_rank(args: argparse.Namespace, err, tp: int, draft_tp: int) -> int:
    """A draft rank of ``torchrun ... mirrorsd generate --backend processes``: load the draft (sharded over the
    draft's ranks with --draft-tp), serve the target's rank 0."""
    target = None
    dense = {"linear": "dense"} if draft_tp > 1 else {}
    if (args.draft or "").startswith(SELF_DRAFT):  # the self-draft is the target's first layers
        target = mirrorsd.load_model(args.target, device=args.device, dtype=args.dtype, weights=args.weights,
                                     activations=args.activations, **dense)
        draft = load_draft(args, target, err)
    elif draft_tp > 1:
        draft = mirrorsd.load_model(args.draft or DEFAULT_DRAFT, device=args.device, dtype=args.dtype,
                                    weights="fp32", **dense)
    else:
        draft = load_draft(args, target, err)
    syncs = None
    if draft_tp > 1:
        syncs = shard_draft(draft.model, launched_world(tp, draft_tp).draft_group, args.draft_syncs)
    serve_launched(draft.model, tp, draft_tp, syncs)
    return 0


def _checked_trace(path: str | None) -> None:
    """``--trace``: a file that can be written, checked before loading (the spans were lost after generating)."""
    if path is None:
        return
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(f"--trace {path}: cannot write there ({folder} is not a writable folder)")


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True, markup=False, soft_wrap=True)  # ("[sd, q4 ...]" is text, not markup)
    _checked_trace(args.trace)
    if args.draft and args.draft.startswith(SELF_DRAFT):
        self_draft_depth(args.draft)
    method, options = args.method or "auto", {}
    by_auto = method == "auto"
    if by_auto:
        method, options = _auto_choice(args)
    options = {**options, **checked_options(args, method, by_auto)}
    idle = [flag for flag, on in (("--top-k", args.top_k), ("--top-p", args.top_p != 1.0),
                                  ("--seed", args.seed is not None)) if on]
    if args.temperature == 0 and idle:  # (as HF's generate warns when do_sample is off)
        err.print(f"mirrorsd: warning: {', '.join(idle)} {'changes' if len(idle) == 1 else 'change'} nothing at "
                  "--temperature 0 (greedy); give --temperature > 0 to sample", style="yellow", highlight=False)
    if by_auto and method != "auto":
        shown = " ".join(f"{k}={v}" for k, v in options.items())
        err.print(f"mirrorsd: auto chose {method} {shown} (this machine's plan for the pair; `mirrorsd plan` "
                  "re-plans)".replace("  ", " "), style="dim", highlight=False)
    # auto: the plan is keyed by the draft too
    needs_draft = _plan_draft(args) is not None if method == "auto" else get_method(method).needs_draft
    tp = _checked_target_tp(args)
    ranked = _draft_ranks(args, method, options)
    draft_tp = _checked_draft_tp(args, tp, ranked)
    rank = launched_rank()
    if ranked is not None and ranked.draft_ranks() and rank is not None and rank >= tp:
        return _serve_draft_rank(args, err, tp, draft_tp)
    if rank not in (None, 0):  # another rank of a sharded target: the same loop, silently
        args.json, err = True, Console(stderr=True, quiet=True, markup=False)
    if rank is not None and (tp > 1 or (ranked is not None and ranked.draft_ranks())):
        launched_world(tp)  # the launcher's world is mirrorsd's: its draft rank serves this target's rank 0
    if needs_draft:
        _warn_draft_form(args, draft_tp, err)
    prompts = {"--prompt": args.prompt} if args.prompt is not None else _read_prompts(args.prompts)
    with err.status(f"loading target {args.target}…"):
        target = mirrorsd.load_model(args.target, device=args.device, dtype=args.dtype, weights=args.weights,
                                     activations=args.activations, **({"linear": "dense"} if tp > 1 else {}))
    if tp > 1:
        shard_target(target.model, launched_world(tp).tp_group)
    say_loaded("target", target, args)
    if by_auto and method != "auto" and (other := measured_otherwise(args.target, _plan_draft(args), target)):
        here = describe_setup(setup_of(target, None), draft=False)  # (its float type too, as the plan records it)
        err.print(f"mirrorsd: warning: the plan auto followed was measured with {other}; this run has {here}: "
                  "`mirrorsd plan` with these flags measures it",
                  style="yellow", highlight=False)
    draft = load_draft(args, target, err) if needs_draft else None
    context = target.config.context_length
    for where, prompt in prompts.items():  # every prompt fits before the first answer (one far down ended a run)
        if (n := len(encode_prompt(target, prompt, raw=args.raw))) >= context:
            raise ValueError(f"{where}: the prompt has {n} tokens but the model's context is {context}")
    spans = []
    for prompt in prompts.values():
        s = mirrorsd.stream(target, prompt, draft=draft, method=method, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, stop=args.stop or (), raw=args.raw, **options)
        for delta in s:
            if not args.json:
                sys.stdout.write(delta)
                sys.stdout.flush()
        result = s.result
        spans.extend(result.stats.spans)
        if rank not in (None, 0):
            continue
        if args.json:
            print(json.dumps({"prompt": prompt, **result.to_dict()}, ensure_ascii=False), flush=True)
        else:
            st = result.stats
            sys.stdout.write("\n")
            line = (f"[{st.method}, {target.format}] {st.new_tokens} tokens in {st.wall_s:.2f} s "
                    f"({st.tokens_per_s:.2f} tok/s), {st.target_forwards} target forwards, "
                    f"finish={result.finish_reason}")
            if st.steps and st.gamma:
                line += (f", mean accepted length {st.mean_accepted_length:.2f} (γ={st.gamma}, largest window "
                         f"{st.max_drafted}), draft {st.draft_s:.2f} s / target {st.target_s:.2f} s")
            line += "".join(extra.summary() for extra in st.extra.values())  # the method's own clause
            err.print(line, style="dim", highlight=False)
    if args.trace and tp > 1:
        spans = gather_spans(spans, launched_world(tp))  # one lane per rank
    if args.trace and rank in (None, 0):
        write_chrome_trace(spans, args.trace, metadata={"target": args.target, "draft": args.draft, "method": method,
                                                        "options": {k: str(v) for k, v in options.items()}})
        err.print(f"trace written to {args.trace} (open in ui.perfetto.dev)" if spans else
                  f"--trace: method {method} recorded no spans ({args.trace} holds none: only a draft that runs "
                  "beside the target traces its lanes)", style="dim", highlight=False)
    if rank is not None:
        leave_launched_world()
    return 0
