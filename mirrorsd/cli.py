"""``mirrorsd`` command line: generate text and manage the offline model zoo."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def _read_prompts(path: str) -> list[str]:
    prompts = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(json.loads(line)["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f'{path}:{n}: expected a JSON object with a "prompt" field ({e})') from None
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _number(text: str) -> int | float:
    """An int when it is one (a layer index), else a float (a fraction of the depth)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _load_draft(args: argparse.Namespace, target, console):
    """``--draft`` is a zoo name or folder, or ``self:N`` / ``self:F``: the target's first N layers (or that
    fraction of them), sharing its weights."""
    import mirrorsd
    from mirrorsd.api import LoadedModel

    name = args.draft or DEFAULT_DRAFT
    if name.startswith("self:"):
        depth = _number(name.removeprefix("self:"))
        n_layers = target.config.n_layers
        layers = round(depth * n_layers) if isinstance(depth, float) else depth
        if not 0 < layers < n_layers:
            raise ValueError(f"--draft {name}: the self-draft needs 1..{n_layers - 1} of the target's layers")
        return LoadedModel(target.model.prefix_model(layers), target.tokenizer, f"{target.name}[:{layers}]",
                           target.path, target.eos_token_ids, target.weights, target.activations)
    with console.status(f"loading draft {name}…"):
        draft = mirrorsd.load_model(name, device=args.draft_device or args.device, dtype=args.dtype,
                                    weights=args.weights, activations=args.activations)
    _say_loaded("draft", draft, args)
    return draft


def _warn_if_busy(what: str) -> None:
    """Say so on stderr when other processes keep the cores busy: training slows and timings mislead."""
    from mirrorsd.runtime.load import busy_warning, others_cpu_share

    if (warning := busy_warning(others_cpu_share(), what)) is not None:
        print(f"mirrorsd: warning: {warning}", file=sys.stderr, flush=True)


def _say_loaded(role: str, model, args: argparse.Namespace) -> None:
    """Which format a model loaded with, and whether that was the default (the zoo's gate-picked one)."""
    chosen = "as asked" if args.weights or args.activations else "default"
    print(f"mirrorsd: {role} {model.name}: {model.format} ({chosen})", file=sys.stderr, flush=True)


# -- generate: method flags come from the registry ------------------------------------------------------------


def _flag_dest(flag: str) -> str:
    return "opt_" + flag.lstrip("-").replace("-", "_")


def _method_flags() -> dict[str, list[tuple[object, object]]]:
    """CLI flag -> [(method, option)] over every registered method (methods may share a flag: ``--gamma``)."""
    from mirrorsd.decoding import methods

    flags: dict[str, list[tuple[object, object]]] = {}
    for method in methods():
        for opt in method.options.fields():
            flags.setdefault(opt.flag, []).append((method, opt))
    return flags


def _add_method_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option name; the help says which methods use it and each one's default."""
    group = parser.add_argument_group("method options (`mirrorsd methods` lists them; a flag another method uses "
                                      "is refused)")
    for flag, uses in _method_flags().items():
        first = uses[0][1]
        defaults = ", ".join(f"{m.name}: {o.shown_default}" for m, o in uses)
        choices = first.choices if all(o.choices == first.choices for _, o in uses) else None
        kwargs = {"dest": _flag_dest(flag), "metavar": first.metavar or (None if choices else "VALUE"),
                  "help": f"{first.help} [{'/'.join(m.name for m, _ in uses)}] (default: {defaults})"}
        if choices:
            kwargs["choices"] = [str(c) for c in choices]
        if first.const is not None:
            kwargs.update(nargs="?", const=first.const)
        group.add_argument(flag, **kwargs)


def _target_shape(name: str):
    """The target's layer count and vocabulary from its config.json when that is on disk (no loading)."""
    from mirrorsd import zoo
    from mirrorsd.decoding import ModelShape

    folder = Path(name)
    if not (folder / "config.json").is_file():
        if name not in zoo.ZOO or not zoo.prepared(name):
            return None
        folder = zoo.model_dir(name)
    try:
        cfg = json.loads((folder / "config.json").read_text())
        return ModelShape(int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]))
    except (OSError, KeyError, ValueError):
        return None


def _auto_choice(args: argparse.Namespace) -> tuple[str, dict]:
    """``--method auto``: the plan saved for this target and draft on this machine, resolved before any model loads
    so that the flags are checked against the method it picked; ``("auto", {})`` when there is no plan yet (the
    API then plans briefly after loading)."""
    from mirrorsd.plans import saved_recommendation

    draft = args.draft or DEFAULT_DRAFT
    pick = None if draft.startswith("self:") else saved_recommendation(args.target, draft)
    return ("auto", {}) if pick is None else (pick["method"], pick["options"])


def _checked_options(args: argparse.Namespace, method: str, by_auto: bool = False) -> dict:
    """The method's options from the flags, validated before any model loads; errors name the flag. ``by_auto``:
    ``method`` is what ``--method auto`` chose, so a flag it does not take says so, and ``--draft`` only keys the
    plan."""
    from mirrorsd.decoding import get_method
    from mirrorsd.errors import OptionError
    from mirrorsd.sampling import SamplingParams

    flags = {f: uses for f, uses in _method_flags().items() if getattr(args, _flag_dest(f)) is not None}
    values: dict[str, str] = {}
    for flag, uses in flags.items():
        mine = [o for m, o in uses if m.name == method]
        if method != "auto" and not mine:
            users = ", ".join(m.name for m, _ in uses)
            chosen = (f", which --method auto chose from this machine's plan for the pair; name a method with "
                      f"--method to use {flag}") if by_auto else ""
            raise ValueError(f"{flag} does not apply to --method {method} (it is an option of: {users}){chosen}")
        name = mine[0].name if mine else uses[0][1].name
        values[name] = getattr(args, _flag_dest(flag))
    to_flag = {o.name: f for f, uses in flags.items() for m, o in uses if m.name == method or method == "auto"}
    to_flag.update(temperature="--temperature", top_k="--top-k", top_p="--top-p", max_new_tokens="--max-new-tokens")
    try:
        SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        if getattr(args, "max_new_tokens", 1) < 1:
            raise OptionError("max_new_tokens", f"must be >= 1, got {args.max_new_tokens}")
        if method == "auto":  # no plan yet: each value checked by a method that takes it; the plan picks after
            for uses in flags.values():
                owner, opt = uses[0]
                owner.options.parse({opt.name: values[opt.name]}, owner.name, _target_shape(args.target))
            return values
        spec = get_method(method)
        options = spec.options.parse(values, method, _target_shape(args.target))
    except OptionError as e:
        raise ValueError(f"{to_flag.get(e.option, e.option)} {e.message}") from None
    if args.draft and not spec.needs_draft and not by_auto:
        raise ValueError(f"--draft does not apply to --method {method} (it drafts without a draft model)")
    if args.draft_device and not spec.needs_draft:
        raise ValueError(f"--draft-device does not apply to --method {method} (it uses no draft model)")
    return {k: getattr(options, k) for k in values}


def _cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    import mirrorsd
    from mirrorsd.decoding import get_method
    from mirrorsd.runtime.processes import launched_rank

    err = Console(stderr=True)
    method, options = args.method or "auto", {}
    by_auto = method == "auto"
    if by_auto:
        method, options = _auto_choice(args)
    options = {**options, **_checked_options(args, method, by_auto)}
    if by_auto and method != "auto":
        shown = " ".join(f"{k}={v}" for k, v in options.items())
        err.print(f"mirrorsd: auto chose {method} {shown} (this machine's plan for the pair; `mirrorsd plan` "
                  "re-plans)".replace("  ", " "), style="dim", highlight=False)
    needs_draft = method == "auto" or get_method(method).needs_draft  # auto: the plan is keyed by the draft too
    tp = _checked_target_tp(args)
    rank = launched_rank()
    if options.get("backend") == "processes" and rank == tp:
        return _serve_draft_rank(args, err)
    if rank not in (None, 0):  # another rank of a sharded target: the same loop, silently
        args.json, err = True, Console(stderr=True, quiet=True)
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts)
    with err.status(f"loading target {args.target}…"):
        target = mirrorsd.load_model(args.target, device=args.device, dtype=args.dtype, weights=args.weights,
                                     activations=args.activations, **({"linear": "dense"} if tp > 1 else {}))
    if tp > 1:
        from mirrorsd.runtime.tensor_parallel import launched_world, shard_target

        shard_target(target.model, launched_world(tp).tp_group)
    _say_loaded("target", target, args)
    draft = _load_draft(args, target, err) if needs_draft else None
    spans = []
    for prompt in prompts:
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
            if "ss" in st.extra:
                x = st.extra["ss"].to_dict()
                line += (f", call reduction {x['call_reduction']:.2f} tokens/pass, tree "
                         f"{x['mean_tree_before_pruning']:.1f} → {x['mean_tree_after_pruning']:.1f} after pruning")
            if "mirror" in st.extra:
                m = st.extra["mirror"].to_dict()
                serial_budget = m["backend"] == "serial" and m["roots"] == "budget"
                rollouts = (f"fallback {m['fallback_frequency']}, hidden draft {m['hidden_draft_fraction']}"
                            if m["fallback_frequency"] is not None else "no branch rolled out"
                            + (" (the serial backend's budget: nothing overlaps)" if serial_budget else ""))
                line += (f", {rollouts}, step {m['mean_ms']['step_s']:.1f} ms vs Eq. 10 "
                         f"{m['mean_ms']['eq10_s']:.1f} ms")
            err.print(line, style="dim", highlight=False)
    if args.trace and tp > 1:
        from mirrorsd.runtime.tensor_parallel import gather_spans, launched_world

        spans = gather_spans(spans, launched_world(tp))  # one lane per rank
    if args.trace and rank in (None, 0):
        from mirrorsd.runtime import write_chrome_trace

        write_chrome_trace(spans, args.trace, metadata={"target": args.target, "draft": args.draft, "method": method,
                                                        "options": {k: str(v) for k, v in options.items()}})
        err.print(f"trace written to {args.trace} (open in ui.perfetto.dev)", style="dim", highlight=False)
    if rank is not None:
        from mirrorsd.decoding.mirror_remote import leave_launched_world

        leave_launched_world()
    return 0


def _checked_target_tp(args: argparse.Namespace) -> int:
    """``--target-tp``: the target's ranks under torchrun; sharding splits dense weights only."""
    from mirrorsd.runtime.processes import launched_rank

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


def _serve_draft_rank(args: argparse.Namespace, err) -> int:
    """The last rank of ``torchrun ... mirrorsd generate --backend processes``: load the draft, serve rank 0."""
    import mirrorsd
    from mirrorsd.decoding.mirror_remote import serve_launched

    target = None
    if (args.draft or "").startswith("self:"):  # the self-draft is the target's first layers
        target = mirrorsd.load_model(args.target, device=args.device, dtype=args.dtype, weights=args.weights,
                                     activations=args.activations)
    draft = _load_draft(args, target, err)
    serve_launched(draft.model, args.target_tp)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os

    import uvicorn
    from rich.console import Console

    import mirrorsd
    from mirrorsd.api import default_method, planned
    from mirrorsd.decoding import get_method
    from mirrorsd.server import ServerConfig, create_app

    err = Console(stderr=True)
    method = args.method or default_method(args.draft)
    options = _checked_options(args, method)
    for name, value in (("--max-queued", args.max_queued), ("--max-prompt-tokens", args.max_prompt_tokens),
                        ("--max-tokens", args.max_tokens), ("--max-request-bytes", args.max_request_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    api_key = args.api_key or os.environ.get("MIRRORSD_API_KEY") or None
    with err.status(f"loading target {args.target}…"):
        target = mirrorsd.load_model(args.target, device=args.device, dtype=args.dtype, weights=args.weights,
                                     activations=args.activations)
    _say_loaded("target", target, args)
    needs_draft = args.draft is not None or method == "auto" or get_method(method).needs_draft
    if needs_draft and args.draft is None and method != "auto":
        raise ValueError(f"--method {method} needs --draft (a zoo name or folder, or self:N)")
    draft = _load_draft(args, target, err) if needs_draft and (args.draft or method != "auto") else None
    if method == "auto":
        method, options, chosen = planned(target, draft, options)
        draft = draft if chosen is not None else None
        err.print(f"mirrorsd: auto chose {method} {options}", style="dim", highlight=False)
    config = ServerConfig(model_name=args.served_model_name or target.name, method=method, options=options,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, api_key=api_key,
                          max_queued=args.max_queued, max_prompt_tokens=args.max_prompt_tokens,
                          max_tokens=args.max_tokens, max_request_bytes=args.max_request_bytes,
                          shutdown_timeout=args.shutdown_timeout)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        err.print(f"mirrorsd: warning: serving on {args.host} without --api-key: anyone who can reach this "
                  "port can use the model", style="yellow", highlight=False)
    err.print(f"mirrorsd: serving {config.model_name} with method {method} at http://{args.host}:{args.port} "
              f"(chat page at /, OpenAI API at /v1, metrics at /metrics)", highlight=False)
    app = create_app(target, draft, config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


def _cmd_methods(args: argparse.Namespace) -> int:
    from mirrorsd.decoding import methods

    described = [m.describe() for m in methods()]
    if args.json:
        print(json.dumps(described, indent=1, ensure_ascii=False))
        return 0
    for m in described:
        draft = "needs a draft model" if m["needs_draft"] else "no draft model"
        print(f"{m['name']}: {m['summary']} ({draft})")
        for o in m["options"]:
            choices = f" {{{','.join(map(str, o['choices']))}}}" if o["choices"] else ""
            print(f"  {o['flag']}{choices} (default: {o['default_text']}): {o['help']}")
    return 0


def _cmd_train_streams(args: argparse.Namespace) -> int:
    import shlex

    import mirrorsd
    from mirrorsd.train_streams import train

    _warn_if_busy("train-streams")
    decode = mirrorsd.load_model(args.model, device=args.device)  # the model decoding will run (q4 on CPU)
    print(f"mirrorsd: the state cache comes from {decode.name} {decode.format}", file=sys.stderr, flush=True)
    # The stream rows are trained through dense, autograd-capable copies of the frozen weights.
    tower = mirrorsd.load_model(args.model, device=args.device, dtype=args.dtype, weights="fp32", linear="dense",
                                progress=False)
    recipe = {"command": "mirrorsd train-streams " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else []),
              "model": args.model, "data": args.data}
    summary = train(tower.model, decode.model, decode.tokenizer, args.data, Path(args.out), model_name=args.model,
                    decode_format=decode.format, cache=Path(args.cache) if args.cache else None,
                    streams=args.streams, layers=args.layers, rank=args.rank, steps=args.steps, chunks=args.chunks,
                    seq_len=args.seq_len, lr=args.lr,
                    held_out=args.held_out, distill=args.self_distill, vocab=args.vocab,
                    eval_every=args.eval_every, seed=args.seed, init=Path(args.init) if args.init else None,
                    recipe=recipe)
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_train_exit(args: argparse.Namespace) -> int:
    import shlex

    import mirrorsd
    from mirrorsd.decoding.mirror import resolve_exit_layer
    from mirrorsd.train_exit import KLRefine, fit_exit, plot_curve, self_distilled
    from mirrorsd.train_streams import corpus_texts

    if args.kl_steps < 0 or args.kl_lr <= 0:
        raise ValueError(f"--kl-steps must be >= 0 and --kl-lr > 0, got {args.kl_steps} and {args.kl_lr}")
    layers_asked = [_number(x) for x in _csv(args.layers)]
    _warn_if_busy("train-exit")
    loaded = mirrorsd.load_model(args.model, weights=args.weights, activations=args.activations)
    _say_loaded("model", loaded, args)
    layers = sorted({resolve_exit_layer(x, loaded.config.n_layers) for x in layers_asked})
    transcripts = self_distilled(loaded, args.self_distill, args.distill_tokens) if args.self_distill else []
    texts = corpus_texts(args.data, args.model, loaded.tokenizer)
    translators = fit_exit(loaded.model, loaded.tokenizer, texts, layers, chunks=args.chunks,
                           held_out=args.held_out, seq_len=args.seq_len, seed=args.seed, transcripts=transcripts,
                           refine=KLRefine(args.kl_steps, args.kl_lr) if args.kl_steps else None)
    translators.meta["recipe"].update(
        command="mirrorsd train-exit " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else []), model=args.model,
        data=args.data, weights=loaded.weights, activations=loaded.activations)
    out = Path(args.out)
    translators.save(out)
    plot_curve(translators.meta, out / "learning_curve.png")
    print(json.dumps(translators.meta["held_out"], indent=2))
    print(f"written: {out}/exit_head.safetensors, exit_head.json, learning_curve.png", file=sys.stderr)
    return 0


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must list positive integers, got {text!r}")
    return values


def _cmd_bench_gpu(args: argparse.Namespace) -> int:
    import torch

    from mirrorsd.bench import gpu

    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in gpu.TARGETS]
    if not targets or unknown:
        raise ValueError(f"--targets must name some of {', '.join(gpu.TARGETS)}, got {args.targets!r}")
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available here")
    accepts = _positive_ints(args.accept, "--accept")
    if max(accepts) >= args.gamma:
        raise ValueError(f"--accept values must be below --gamma ({args.gamma}): a window of γ accepts at most γ")
    report = gpu.run(Path(args.out), device=args.device, max_new=args.max_new_tokens, prompt_len=args.prompt_tokens,
                     accepts=accepts, gamma=args.gamma, targets=targets, ks=_positive_ints(args.ks, "--ks"),
                     tests=not args.no_tests, dtype=getattr(torch, args.dtype) if args.dtype else None)
    print(gpu.summary(report))
    print(f"report: {Path(args.out) / 'report.md'}")
    return 0


def _cmd_bench_forward(args: argparse.Namespace) -> int:
    from mirrorsd.bench import forward as bench

    try:
        ks = tuple(sorted({int(k) for k in args.ks.split(",")}))
    except ValueError:
        raise ValueError(f"--ks must be comma-separated integers, got {args.ks!r}") from None
    if not ks or ks[0] < 1:
        raise ValueError("--ks must be positive")
    if args.rounds < 1 or args.ar_tokens < 1 or args.context < 1:
        raise ValueError("--rounds, --ar-tokens and --context must be positive")
    _warn_if_busy("bench forward")
    report = bench.run(args.model, args.weights, ks, args.context, args.rounds, args.ar_tokens, args.llama_bench,
                       args.linear, args.activations)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    print(f"{report.model} ({report.weights}/{report.activations}, {report.linear}) on {report.machine}, "
          f"{report.threads} threads, "
          f"fast kernels: {report.fast_kernels}, context {report.context}")
    for k, ms in report.forward_ms.items():
        print(f"  k={k:>3}: {ms:9.1f} ms  ({report.relative[k]:.2f}x k={ks[0]})")
    print(f"  AR: {report.ar_tok_s:.2f} tok/s")
    if report.llama_cpp:
        lc = report.llama_cpp
        print(f"  llama.cpp ({lc.get('build')}): AR {lc.get('ar_tok_s', float('nan')):.2f} tok/s; " + ", ".join(
            f"k={k}: {ms:.1f} ms" for k, ms in lc["forward_ms"].items()))
        print(f"  ours / llama.cpp AR: {lc['ar_ratio_median']:.2f}x (median of {len(lc['ar_tok_s_rounds'])} "
              "alternating rounds)")
    return 0


def _bench_config(args: argparse.Namespace, methods) -> object:
    from mirrorsd.bench.runner import BenchConfig

    split = None
    if getattr(args, "threads_split", None):
        split = tuple(int(x) for x in args.threads_split.split(","))
    return BenchConfig(target=args.target, draft=args.draft, methods=methods, suite=args.suite,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                       runs=args.runs, warmup=args.warmup, weights=args.weights, device=args.device, dtype=args.dtype,
                       llama_server=getattr(args, "llama_server", None), probe=not args.no_probe,
                       probe_exit_head=getattr(args, "probe_exit_head", None), predict=not args.no_predict,
                       threads_split=split)


def _run_bench(config, out: Path) -> int:
    from mirrorsd.bench.report import write_report
    from mirrorsd.bench.runner import Bench, write_answers

    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(config)
    try:
        results = bench.run()
    finally:
        bench.close()
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False), encoding="utf-8")
    write_answers(results, out)
    report = write_report(results, out)
    print(report.read_text(encoding="utf-8"))
    print(f"written: {out / 'results.json'}, {report}, {out / 'answers'}/*.jsonl and plots in {out}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from mirrorsd.bench.runner import parse_methods

    return _run_bench(_bench_config(args, parse_methods(args.methods)), Path(args.out))


def _csv(text: str, cast=str) -> list:
    try:
        return [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected a comma-separated list, got {text!r}") from None


def _cmd_bench_sweep(args: argparse.Namespace) -> int:
    from mirrorsd.bench.runner import MethodSpec

    specs = [MethodSpec("ar", "ar")]
    for gamma in _csv(args.gammas, int):
        specs.append(MethodSpec(f"sd γ={gamma}", "sd", {"gamma": gamma, "confidence": 0.0}))
        grid = itertools.product(_csv(args.exit_layers, _number), _csv(args.kappas, int), _csv(args.roots),
                                 _csv(args.candidates), _csv(args.backends))
        for exit_layer, kappa, roots, candidates, backend in grid:
            for split in args.thread_splits if backend == "threads" else [None]:
                options = {"gamma": gamma, "kappa": kappa, "exit_layer": exit_layer, "roots": roots,
                           "candidates": candidates, "backend": backend, "confidence": 0.0}
                label = f"mirror γ={gamma} κ={kappa} ℓe={exit_layer} {roots} {candidates} {backend}"
                if split:
                    options["threads"] = split
                    label += f" {split}"
                specs.append(MethodSpec(label, "mirror", options))
    from mirrorsd.decoding import get_method

    for spec in specs:  # every configuration is checked before the models load
        get_method(spec.kind).options.parse(spec.options, spec.kind)
    print(f"sweep: {len(specs)} configurations", flush=True)
    return _run_bench(_bench_config(args, specs), Path(args.out))


def _cmd_plan(args: argparse.Namespace) -> int:
    import mirrorsd
    from mirrorsd.api import encode_chat
    from mirrorsd.bench.plan import make_plan
    from mirrorsd.specbench import load_suite

    _warn_if_busy("the plan")
    target = mirrorsd.load_model(args.target, weights=args.weights)
    draft = mirrorsd.load_model(args.draft, weights=args.weights)
    prompts = [(q.group, encode_chat(target, [{"role": "user", "content": q.turns[0]}]))
               for q in load_suite(args.suite)]
    plan = make_plan(target, draft, prompts, args.max_new_tokens)
    path = plan.save(Path(args.out) if args.out else None)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"predicted speed on {plan.machine} (Mirror-SD latency law, measured costs and acceptance)")
    for col in ("rank", "configuration", "tokens/step", "step ms", "predicted tok/s"):
        table.add_column(col)
    shown = plan.ranked[: args.top]
    ar = next((r for r in plan.ranked if r["method"] == "ar"), None)
    if ar is not None and ar not in shown:
        shown.append(ar)
    for row in shown:
        table.add_row(str(plan.ranked.index(row) + 1), row["label"], f"{row['tokens_per_step']:.2f}",
                      f"{row['step_ms']:.1f}", f"{row['predicted_tokens_per_s']:.2f}")
    Console().print(table)
    print(f"recommended: {plan.recommended['label']} — saved to {path}; `mirrorsd generate --method auto` uses it")
    return 0


def _cmd_bench_perplexity(args: argparse.Namespace) -> int:
    from mirrorsd import perplexity
    from mirrorsd.model import WEIGHT_FORMATS

    formats = [w.strip() for w in args.weights.split(",") if w.strip()]
    unknown = sorted(set(formats) - set(WEIGHT_FORMATS))
    if not formats or unknown:
        raise ValueError(f"--weights takes formats from {', '.join(WEIGHT_FORMATS)}; got {args.weights!r}")
    if args.tokens < 2 or args.window < 2:
        raise ValueError("--tokens and --window must be at least 2")
    first = None
    for fmt in formats:
        report = perplexity.run(args.model, fmt, args.tokens, args.window, progress=not args.json)
        first = first or report
        if args.json:
            print(json.dumps(report.to_dict()), flush=True)
        else:
            delta = 100 * (report.perplexity / first.perplexity - 1)
            print(f"{report.model} {fmt:>5}: perplexity {report.perplexity:.4f} over {report.tokens} tokens "
                  f"({delta:+.2f}% vs {first.weights})", flush=True)
    return 0


def _cmd_bench_quality(args: argparse.Namespace) -> int:
    from mirrorsd import quality
    from mirrorsd.specbench import load_suite
    from mirrorsd.zoo import ZOO

    models = list(ZOO) if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    formats = quality.parse_formats(args.formats)
    if args.answer_tokens < 1:
        raise ValueError("--answer-tokens must be positive")
    report = quality.run(models, formats, load_suite(args.suite), args.answer_tokens, Path(args.out))
    print(quality.markdown(report))
    print(f"wrote {Path(args.out) / 'quality.json'} and quality.md")
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from mirrorsd import zoo

    rows = zoo.list_models()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # Names and pip commands are typed or pasted by users: never truncated, folded or wrapped inside a cell.
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    console = Console()
    if console.is_terminal:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
        table.add_column("name", no_wrap=True)
        for col in ("format", "installed", "prepared", "ss adapter"):
            table.add_column(col, no_wrap=True)
        table.add_column("model", width=1, overflow="fold")  # the only column that wraps
        for r in rows:
            table.add_row(Text(r["name"]), r["default_format"], yes(r["installed"]), yes(r["prepared"]),
                          "shipped" if r["streams_adapter"] else "-", Text(r["description"]))
        # Give the description exactly the width left over: squeezed by rich, a table near its minimum width
        # truncates no_wrap columns and drops characters at the edge.
        probe = Console(width=10**4, file=io.StringIO(), color_system=None)
        probe.print(table)
        others = max(map(len, probe.file.getvalue().splitlines())) - 1
        left = console.width - others
        if left >= 12:
            table.columns[-1].width = min(left, max(len(r["description"]) for r in rows))
            table.title = Text(f"mirrorsd model zoo (cache: {zoo.cache_dir()})")
            console.print(table)
            print("\ninstall with:")
            for r in rows:
                print(f"  {r['name']}: {r['pip_command']}")
            return 0
    # Not a terminal (or one too narrow for the table): plain rows, two spaces apart, nothing cut.
    table_rows = [("name", "default format", "installed", "prepared", "install with")] + [
        (r["name"], r["default_format"], yes(r["installed"]), yes(r["prepared"]), r["pip_command"]) for r in rows]
    widths = [max(len(row[i]) for row in table_rows) for i in range(4)]
    for row in table_rows:
        print("  ".join([cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)] + [row[4]]))
    return 0


def _cmd_models_prepare(args: argparse.Namespace) -> int:
    from mirrorsd import zoo

    for name in args.names:
        print(zoo.prepare(name))
    return 0


def _bench_arguments(p: argparse.ArgumentParser, methods: bool) -> None:
    from mirrorsd.model import WEIGHT_FORMATS

    p.add_argument("--target", default=DEFAULT_TARGET, help="zoo model name or local HF folder")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="zoo model name or local HF folder")
    if methods:
        p.add_argument("--methods", default="ar,suffix,sd,mirror,ss,hf-assisted,hf-pld,llama-server",
                       help="comma-separated: ar, suffix, sd, mirror, ss, hf-ar, hf-assisted, hf-pld, llama-server, "
                            "llama-server-ar, llama-server-ngram (llama.cpp's draft-free n-gram speculation; its "
                            "options are llama-server flags, default spec-type=ngram-simple); options as "
                            "KIND:key=value:key=value, a label as LABEL=KIND:... "
                            "(e.g. mirror:roots=budget:backend=threads); auto runs what `mirrorsd plan` recommends "
                            "for the pair (planned first if needed). References (ar, hf-ar, llama-server-ar) "
                            "are added as needed")
        p.add_argument("--llama-server", metavar="PATH",
                       help="llama.cpp's llama-server binary (default: $MIRRORSD_LLAMA_SERVER or PATH; skipped "
                            "with a note when absent)")
    p.add_argument("--suite", default="specbench:1",
                   help="specbench (all 480), specbench:N (N questions per task group, spread evenly), assist "
                        "(12 editing / refactoring / answer-from-context prompts) or a JSONL "
                        'file of {"turns": [...]} / {"prompt": ...}')
    p.add_argument("--max-new-tokens", type=int, default=128, help="most new tokens per turn")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (Spec-Bench's setting)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per question: seed and question id)")
    p.add_argument("--runs", type=int, default=3, help="timed runs (median and range reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up passes of every method")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, help="our weight format (default: as generate)")
    p.add_argument("--device", default="cpu", help="torch device for our models and the HF peers")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads-split", metavar="T,D", help="target,draft threads the planner times for the threads "
                                                         "backend (default: half each)")
    p.add_argument("--no-probe", action="store_true", help="skip the untimed acceptance / early-exit probe")
    p.add_argument("--probe-exit-head", metavar="FOLDER", help="the tuned exit the probe reads next to the lens "
                   "(a `mirrorsd train-exit` folder), to compare exits on the same rollouts (default: the target's "
                   "shipped one)")
    p.add_argument("--no-predict", action="store_true", help="skip the forward-cost measurement and predictions")
    p.add_argument("--out", default="bench_out/run", help="output folder")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where there is a default and the help does not state it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False) or "(default" in text:
            return text
        return super()._get_help_string(action)


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("mirrorsd")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        import mirrorsd

        return getattr(mirrorsd, "__version__", "unknown")


def build_parser() -> argparse.ArgumentParser:
    from mirrorsd.decoding import methods
    from mirrorsd.linear import LINEAR_IMPLS
    from mirrorsd.model import ACTIVATION_FORMATS, WEIGHT_FORMATS

    p = argparse.ArgumentParser(
        prog="mirrorsd",
        description="Lossless speculative decoding on real pretrained models, offline.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate",
        help="generate text (AR or speculative)",
        description="Generate a completion. Speculative methods give the target's own tokens: greedy output "
        "equals --method ar, and seeded sampling equals ar for the same --seed (up to float near-ties).",
        formatter_class=_HelpFormatter,
    )
    g.add_argument("--target", default=DEFAULT_TARGET, help="zoo model name or local HF folder")
    g.add_argument("--draft", default=None,
                   help="draft for speculative methods: zoo name or folder, or self:N / self:F for the target's "
                        f"first N layers (or fraction F of them) (default: {DEFAULT_DRAFT})")
    g.add_argument("--method", choices=[*(m.name for m in methods()), "auto"],
                   help="; ".join(f"{m.name}: {m.summary}" for m in methods()) + "; auto: the configuration "
                   "`mirrorsd plan` saved for this target and draft on this machine, planned briefly (1-2 minutes) on "
                   "first use; it falls back to ar when nothing pays (default: auto; the API's default is sd when a "
                   "draft is given, else ar)")
    g.add_argument("--draft-device", help="device for the draft model (--backend devices), e.g. cuda:1 or cpu "
                                          "(default: --device)")
    g.add_argument("--trace", metavar="FILE",
                   help="write a Chrome/Perfetto trace of the target and draft lanes to FILE (methods that trace "
                        "their lanes: mirror) (default: none)")
    _add_method_flags(g)
    g.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 disables top-k filtering")
    g.add_argument("--top-p", type=float, default=1.0, help="1 disables nucleus filtering")
    g.add_argument("--seed", type=int,
                   help="sampling seed; noise is keyed by seed and position, so ar and sd agree for a seed "
                        "(default: random, reported in --json stats)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--stop", action="append",
                   help="stop string (repeatable); excluded from the output (default: none; EOS always stops)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts", help='JSONL file with one {"prompt": ...} per line')
    g.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming")
    g.add_argument("--device", default="cpu", help="torch device for both models (cpu, cuda, cuda:1, ...)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations; the zoo converts to float32")
    g.add_argument("--weights", choices=WEIGHT_FORMATS,
                   help="weight format for both models: fp32; q8 (int8 per 32 weights); q4 (the codes of the GGUF "
                        "file a zoo folder keeps — Q4_K_M for the Qwen pair, Q4_1/Q8_0 for SmolLM2 — computed "
                        "without dequantizing) (default: per zoo model, the fastest format that passed the chat "
                        "quality gate (`mirrorsd bench quality`); q4 for other folders holding a model.gguf; else "
                        "fp32)")
    g.add_argument("--activations", choices=ACTIVATION_FORMATS,
                   help="activation precision of quantized weights: int8 (per 32 features, fastest) or int8x2 (a "
                        "second int8 plane for the remainder, ~15 bits: what small models need on chat prompts) "
                        "(default: the zoo model's gate-picked one; int8x2 otherwise)")
    g.add_argument("--target-tp", type=int, default=1, metavar="N",
                   help="shard the target's projections over N ranks (tensor parallelism, DTensor) under torchrun: "
                        "--nproc-per-node N, or N + 1 with --backend processes (the last rank serves the draft); "
                        "dense weights (--weights fp32), methods ar, sd and mirror without timing-driven choices")
    g.set_defaults(func=_cmd_generate)

    sv = sub.add_parser(
        "serve", formatter_class=_HelpFormatter,
        help="an OpenAI-compatible HTTP server (chat, completions, SSE streaming, metrics, a chat page)",
        description="Serve a target (and a draft) over OpenAI's HTTP API with speculative decoding: POST "
        "/v1/chat/completions and /v1/completions (stream: true for SSE), GET /v1/models, /health, /metrics "
        "(Prometheus), POST /tokenize and /detokenize, and a chat page at / that colours each token by how it was "
        "produced. Requests may pick the method and its options in a `mirrorsd` object ({\"mirrorsd\": "
        "{\"method\": \"suffix\", \"gamma\": 8}}); this command's flags are the defaults. Every answer is "
        "the target's own output, as with `mirrorsd generate`.")
    sv.add_argument("--target", default=DEFAULT_TARGET, help="zoo model name or local HF folder")
    sv.add_argument("--draft", default=None,
                    help="draft model for sd / mirror: zoo name or folder, or self:N / self:F (default: none; "
                         "requests may then use only draft-free methods: ar, suffix, ss)")
    sv.add_argument("--method", choices=[*(m.name for m in methods()), "auto"],
                    help="the default decoding method of requests (default: sd with --draft, else ar; "
                         "`suffix` needs no draft and measured fastest here, see docs/drafting.md)")
    sv.add_argument("--served-model-name", help="the model name clients send (default: --target)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (loopback: only this machine)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port")
    sv.add_argument("--api-key", help="require Authorization: Bearer KEY on every route but /health and the "
                                      "page (default: $MIRRORSD_API_KEY, else none)")
    sv.add_argument("--temperature", type=float, default=1.0,
                    help="temperature of requests that send none (OpenAI's default; 0 is greedy)")
    sv.add_argument("--top-p", type=float, default=1.0, help="top_p of requests that send none")
    sv.add_argument("--top-k", type=int, default=0, help="top_k of requests that send none (0: off)")
    sv.add_argument("--max-queued", type=int, default=64,
                    help="requests that may wait for the engine; more are answered 429")
    sv.add_argument("--max-prompt-tokens", type=int, default=4096, help="longest prompt accepted (400 beyond)")
    sv.add_argument("--max-tokens", type=int, default=2048,
                    help="largest max_tokens a request may ask for, and the limit of requests that set none")
    sv.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body (413 beyond)")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds running requests get to finish on shutdown before they are cancelled")
    sv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sv.add_argument("--device", default="cpu", help="torch device for both models")
    sv.add_argument("--draft-device", help="device for the draft model (default: --device)")
    sv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    sv.add_argument("--weights", choices=WEIGHT_FORMATS, help="weight format (default: as generate)")
    sv.add_argument("--activations", choices=ACTIVATION_FORMATS, help="activation precision (default: as generate)")
    _add_method_flags(sv)
    sv.set_defaults(func=_cmd_serve)

    t = sub.add_parser(
        "train-streams", formatter_class=_HelpFormatter,
        help="train Speculative Streaming adapters (lossless mode) on offline text",
        description="Train stream embeddings, stream-row LoRA adapters (peft) on the top N_s layers and the "
        "pruning adapter for a model whose base weights stay frozen (so its own tokens cannot change). The model "
        "decoding runs fills a state cache once (layer N - N_s states, the top layers' keys/values and its own "
        "greedy tokens as labels, ~7 KB/token on the 1.5B); training then runs epochs over the cache, pushing only "
        "the stream rows through bf16 copies of the top layers and a restricted-vocabulary head. Resumes from "
        "OUT/checkpoint.pt and the cache's finished shards; saves a learning curve (OUT/learning_curve.png).")
    t.add_argument("--model", required=True, help="zoo model name or local HF folder")
    t.add_argument("--data", nargs="+", required=True,
                   help="text files or folders (*.py/*.txt/*.md/*.rst), or corpus names: stdlib (this Python's "
                        "standard library source), pydoc-topics (the language reference), chat-answers (the model's "
                        "own greedy answers to mirrorsd's shipped chat prompts, through its chat template)")
    t.add_argument("--out", required=True, help="folder for stream_config.json + adapter.safetensors")
    t.add_argument("--cache", help="state cache folder (default: OUT/cache); reused by later runs with the same "
                                   "model, data, --seq-len, --chunks, --held-out, --self-distill, --layers, --seed")
    t.add_argument("--streams", type=int, default=3, help="γ speculative streams")
    t.add_argument("--layers", type=int, default=4, help="N_s: top layers with multi-stream attention")
    t.add_argument("--rank", type=int, default=8, help="LoRA rank of the stream-row adapters")
    t.add_argument("--steps", type=int, default=200, help="optimizer steps (one chunk each)")
    t.add_argument("--chunks", type=int, help="training chunks to cache (default: --steps, at most 10000); "
                                              "steps beyond it start further epochs")
    t.add_argument("--seq-len", type=int, default=128, help="tokens per training chunk")
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (linear warmup and decay)")
    t.add_argument("--held-out", type=int, default=8, help="chunks kept out of training to measure stream accuracy")
    t.add_argument("--self-distill", type=int, default=0, metavar="N",
                   help="replace N training chunks by the model's own greedy continuations of their first tokens "
                        "(the text decoding will actually ask the streams to predict)")
    t.add_argument("--vocab", type=int, default=32768,
                   help="train on the N most frequent token ids of the tokenizer's shipped table (0: all; "
                        "held-out accuracy always uses the full vocabulary)")
    t.add_argument("--eval-every", type=int, default=50, help="steps between held-out points of the learning curve")
    t.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="precision of the frozen weights the streams are trained through (the adapters stay fp32)")
    t.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    t.add_argument("--init", metavar="ADAPTER", help="start from this adapter folder (same --streams, --layers, "
                                                     "--rank) to train it further, e.g. on more --chunks")
    t.add_argument("--seed", type=int, default=0, help="data order and initialisation")
    t.set_defaults(func=_cmd_train_streams)

    te = sub.add_parser(
        "train-exit", formatter_class=_HelpFormatter,
        help="fit a tuned early exit (Mirror-SD's --exit-head tuned) on offline text, in closed form",
        description="Fit an affine translator per exit layer that maps the layer's state towards the final one "
        "before the model's own final norm + LM head (a tuned lens), by ridge regression on the frozen model's "
        "states over offline text (labels: the model's own greedy next tokens), optionally fine-tuned by KL to the "
        "final distribution (--kl-steps). Reports held-out top-κ hit rates of the plain logit lens and the tuned "
        "exit, and saves a learning curve. Minutes on a CPU.")
    te.add_argument("--model", required=True, help="zoo model name or local HF folder")
    te.add_argument("--data", nargs="+", default=["stdlib", "pydoc-topics"],
                    help="text files or folders, or corpus names: stdlib, pydoc-topics, chat-answers (as "
                         "train-streams)")
    te.add_argument("--out", required=True, help="folder for exit_head.safetensors + exit_head.json")
    te.add_argument("--layers", default="0.25,0.5,0.75", help="exit layers: indices or fractions of the depth")
    te.add_argument("--chunks", type=int, default=64, help="windows of the corpus text")
    te.add_argument("--self-distill", type=int, default=0, metavar="N",
                    help="also fit on N chat transcripts of the model's own greedy answers to prompts about stdlib "
                         "modules (the text Mirror-SD decodes; none is a benchmark question); at most 84")
    te.add_argument("--distill-tokens", type=int, default=128, help="tokens per self-distilled answer")
    te.add_argument("--held-out", type=int, default=8, help="windows (of all) kept out to measure the hit rates")
    te.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    te.add_argument("--seed", type=int, default=0, help="data order")
    te.add_argument("--kl-steps", type=int, default=0, metavar="N",
                    help="then fine-tune each translator for N steps of 256 tokens by KL to the final distribution "
                         "(the tuned lens's objective; the best held-out step is kept). 300 is the shipped recipe")
    te.add_argument("--kl-lr", type=float, default=1e-4, help="Adam learning rate of the KL fine-tune")
    te.add_argument("--weights", choices=WEIGHT_FORMATS, help="the format decoding will use (default: as generate)")
    te.add_argument("--activations", choices=ACTIVATION_FORMATS, help="(default: as generate)")
    te.set_defaults(func=_cmd_train_exit)

    b = sub.add_parser(
        "bench", formatter_class=_HelpFormatter, help="Spec-Bench runner with peers in the same run; sweeps; costs",
        description="Run Spec-Bench questions (or your own JSONL) through our methods and the peers (HF "
        "transformers generate / assisted / prompt lookup, llama.cpp's llama-server when found) in one run, "
        "interleaved per question; check every output against its AR reference; write results.json, Spec-Bench "
        "answer files, report.md and plots to --out. Subcommands: sweep, forward, perplexity, quality.")
    _bench_arguments(b, methods=True)
    b.set_defaults(func=_cmd_bench)
    bsub = b.add_subparsers(dest="bench_command", required=False, metavar="{sweep,forward,gpu,perplexity,quality}")
    bw = bsub.add_parser(
        "sweep", formatter_class=_HelpFormatter,
        help="Mirror-SD over γ × κ × ℓe × roots × candidates × backend × threads",
        description="Times ar, vanilla SD at every γ and Mirror-SD at every combination, interleaved as in "
        "`mirrorsd bench`, with predicted (latency law) next to measured speed, fallback and hidden-draft "
        "fraction per configuration.")
    _bench_arguments(bw, methods=False)
    bw.add_argument("--gammas", default="7", help="comma-separated γ values")
    bw.add_argument("--kappas", default="1,2,4,8", help="comma-separated κ values")
    bw.add_argument("--exit-layers", default="0.25,0.5,0.75", help="comma-separated ℓe (indices or fractions)")
    bw.add_argument("--roots", default="paper", help="comma-separated root modes (paper, budget)")
    bw.add_argument("--candidates", default="exit", help="comma-separated candidate sources (exit: the paper's "
                    "early exit; draft: the draft's runner-ups)")
    bw.add_argument("--backends", default="serial", help="comma-separated backends (serial, threads, ...)")
    bw.add_argument("--thread-splits", nargs="+", default=["1,1"], metavar="T,D",
                    help="target,draft thread splits tried with the threads backend")
    bw.set_defaults(func=_cmd_bench_sweep)
    bf = bsub.add_parser(
        "forward", formatter_class=_HelpFormatter,
        help="k-token forward cost and AR tok/s of one model",
        description="Times k-token forwards (k = verification window) after a cached context, interleaved "
        "over rounds (median), and greedy AR decoding speed. Speculative decoding pays when forward_ms[k] "
        "stays close to forward_ms[1].")
    bf.add_argument("--model", default=DEFAULT_TARGET, help="zoo model name or local HF folder")
    bf.add_argument("--weights", default="q4", choices=WEIGHT_FORMATS, help="weight format")
    bf.add_argument("--activations", default="int8", choices=ACTIVATION_FORMATS,
                    help="activation precision of quantized weights")
    bf.add_argument("--linear", default="auto", choices=LINEAR_IMPLS,
                    help="linear-layer implementation. auto: our packed/quantized kernels; dense: PyTorch's stock "
                         "GEMMs (the baseline)")
    bf.add_argument("--ks", default="1,2,4,8,16", help="comma-separated window sizes")
    bf.add_argument("--context", type=int, default=128, help="cached tokens before each timed forward")
    bf.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    bf.add_argument("--ar-tokens", type=int, default=32, help="tokens decoded for the AR tok/s figure")
    bf.add_argument("--llama-bench", metavar="PATH",
                    help="llama.cpp's llama-bench binary: also time llama.cpp on the same GGUF file")
    bf.add_argument("--json", action="store_true", help="print the report as JSON")
    bf.set_defaults(func=_cmd_bench_forward)
    bg = bsub.add_parser(
        "gpu", formatter_class=_HelpFormatter,
        help="validate a CUDA machine: CUDA tests, every method on random weights of real shapes, Mirror-SD vs Eq. 10",
        description="One command for a lent GPU machine. Makes random-weight models of real shapes on the device "
        "(Qwen2.5-1.5B- and 7B-shaped targets, a 0.5B-shaped draft: nothing large has to travel), runs "
        "tests/test_cuda.py, times the k-token forward curve, runs every method and checks its tokens against ar, "
        "then forces acceptance lengths with an oracle draft (the real draft network runs; its tokens follow the "
        "target's answer for A tokens, then miss) to compare Mirror-SD's step time with its Eq. 10 terms and with "
        "vanilla SD at the same acceptance. Writes report.md, report.json and Chrome traces into --out. Without "
        "CUDA it is a dry run on tiny shapes, to check the command itself.")
    bg.add_argument("--out", required=True, help="folder for report.md, report.json and the traces")
    bg.add_argument("--device", help="torch device (default: cuda if available, else a CPU dry run)")
    bg.add_argument("--targets", default="qwen2.5-1.5b,qwen2.5-7b", help="target shapes to run")
    bg.add_argument("--accept", default="1,3,5",
                    help="forced accepted tokens per step (each also runs with every draft token accepted)")
    bg.add_argument("--gamma", type=int, default=7, help="draft window γ of SD and Mirror-SD in the forced runs")
    bg.add_argument("--max-new-tokens", type=int, help="tokens per generation (default: 48; 16 in a dry run)")
    bg.add_argument("--prompt-tokens", type=int, default=128, help="random prompt length (and forward context)")
    bg.add_argument("--ks", default="1,2,4,8,16,32", help="window sizes of the forward curve")
    bg.add_argument("--dtype", choices=("bfloat16", "float32"),
                    help="model dtype (default: bfloat16 on CUDA, float32 in a dry run); float32 GEMMs are nearly "
                         "batch-invariant, so every answer must equal ar's exactly")
    bg.add_argument("--no-tests", action="store_true", help="skip tests/test_cuda.py")
    bg.set_defaults(func=_cmd_bench_gpu)
    bp = bsub.add_parser(
        "perplexity", formatter_class=_HelpFormatter,
        help="perplexity of a model in one or more weight formats on an offline corpus",
        description="Scores Python standard-library source (fixed module list, teacher forcing, "
        "non-overlapping windows) so the quality cost of q8/q4 against fp32 can be read off side by side.")
    bp.add_argument("--model", default=DEFAULT_TARGET, help="zoo model name or local HF folder")
    bp.add_argument("--weights", default="fp32,q8,q4", help="comma-separated weight formats")
    bp.add_argument("--tokens", type=int, default=4096, help="corpus tokens scored")
    bp.add_argument("--window", type=int, default=512, help="tokens per scored window")
    bp.add_argument("--json", action="store_true", help="print one JSON object per format")
    bp.set_defaults(func=_cmd_bench_perplexity)
    bq = bsub.add_parser(
        "quality", formatter_class=_HelpFormatter,
        help="chat quality gate: quantized formats against fp32 on chat-templated Spec-Bench conversations",
        description="For every model: Spec-Bench questions through its chat template, each with the fp32 model's "
        "greedy answer; each format (weights × activations) is scored by teacher forcing against fp32: next-token "
        "agreement over the answers, answers it would reproduce token for token, and perplexity of the answers. "
        "A format passes at agreement >= 0.99 and perplexity within +2%; the fastest passing format is the "
        "model's recommended default. Writes quality.json and quality.md to --out.")
    bq.add_argument("--models", default="all", help="comma-separated zoo names or folders, or 'all' (the zoo)")
    bq.add_argument("--formats", default="q4/int8,q4/int8x2,q8/int8,q8/int8x2",
                    help="comma-separated WEIGHTS/ACTIVATIONS formats scored against fp32")
    bq.add_argument("--suite", default="specbench:4", help="questions: specbench[:N], assist or FILE.jsonl")
    bq.add_argument("--answer-tokens", type=int, default=64, help="most tokens of each fp32 answer")
    bq.add_argument("--out", required=True, help="output folder")
    bq.set_defaults(func=_cmd_bench_quality)

    pl = sub.add_parser(
        "plan", formatter_class=_HelpFormatter, help="measure this machine and recommend a configuration",
        description="Measures the target's k-token forward, prefix and early-exit costs and the draft's k-row "
        "costs here, probes acceptance and early-exit fallback on a few Spec-Bench prompts, predicts every "
        "method's speed with the Mirror-SD latency law (Eq. 10) and saves the best for `generate --method auto`.")
    pl.add_argument("--target", default=DEFAULT_TARGET, help="zoo model name or local HF folder")
    pl.add_argument("--draft", default=DEFAULT_DRAFT, help="zoo model name or local HF folder")
    pl.add_argument("--weights", choices=WEIGHT_FORMATS, help="weight format (default: as generate)")
    pl.add_argument("--suite", default="specbench:1", help="calibration prompts: specbench[:N], assist or FILE.jsonl")
    pl.add_argument("--max-new-tokens", type=int, default=48, help="tokens per calibration prompt")
    pl.add_argument("--top", type=int, default=10, help="rows of the ranking to print")
    pl.add_argument("--out", help="plan file (default: the cache's plans/ folder, where --method auto looks)")
    pl.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    pl.set_defaults(func=_cmd_plan)

    me = sub.add_parser("methods", formatter_class=_HelpFormatter, help="the decoding methods and their options",
                        description="Every registered decoding method: whether it needs a draft model, and its "
                        "options with defaults and help (the flags `mirrorsd generate` takes for it and the keys "
                        "`mirrorsd bench --methods KIND:key=value` takes).")
    me.add_argument("--json", action="store_true",
                    help="a JSON list of {name, summary, needs_draft, rejection_sampling, any_draft_tokenizer, "
                    "options}")
    me.set_defaults(func=_cmd_methods)

    m = sub.add_parser("models", help="the offline model zoo", description="List and prepare zoo models.")
    msub = m.add_subparsers(dest="models_command", required=True)
    ml = msub.add_parser("list", help="zoo models, whether installed and prepared")
    ml.add_argument("--json", action="store_true")
    ml.set_defaults(func=_cmd_models_list)
    mp = msub.add_parser("prepare", help="assemble, verify and convert a zoo model into the cache (once)")
    mp.add_argument("names", nargs="+", metavar="NAME")
    mp.set_defaults(func=_cmd_models_prepare)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mirrorsd.zoo import ZooError

    try:
        return args.func(args)
    except (ValueError, ZooError, FileNotFoundError) as e:
        print(f"mirrorsd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
