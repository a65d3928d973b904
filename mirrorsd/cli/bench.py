"""``mirrorsd bench``: Spec-Bench against the peers, and its subcommands sweep, forward, gpu, perplexity and
quality."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from mirrorsd import perplexity, quality
from mirrorsd.bench import forward, gpu, serve
from mirrorsd.bench.peers import find_llama_server
from mirrorsd.bench.report import clear_report, diverged, write_report
from mirrorsd.bench.runner import Bench, BenchConfig, MethodSpec, parse_methods, write_answers
from mirrorsd.decoding import get_method
from mirrorsd.decoding import methods as registered_methods
from mirrorsd.errors import OptionError
from mirrorsd.files import write_text
from mirrorsd.linear import LINEAR_IMPLS
from mirrorsd.loading import WEIGHT_FORMATS
from mirrorsd.model import ACTIVATION_FORMATS
from mirrorsd.specbench import load_suite
from mirrorsd.zoo import ZOO

from .args import COMMANDS, add_dtype, add_formats, add_model, add_pair, add_sampling, add_weights
from .common import HelpFormatter, number, parse_csv, warn_if_busy


def _bench_arguments(p: argparse.ArgumentParser, methods: bool) -> None:
    add_pair(p)
    if methods:
        p.add_argument("--methods", default="ar,suffix,sd,mirror,ss,hf-assisted,hf-pld,llama-server",
                       help=f"comma-separated: {', '.join(m.name for m in registered_methods())}, hf-ar, "
                            "hf-assisted, hf-pld, llama-server, llama-server-ar, llama-server-ngram (llama.cpp's "
                            "draft-free n-gram speculation; its options are llama-server flags, default "
                            "spec-type=ngram-simple); options as KIND:key=value:key=value (`mirrorsd methods` lists "
                            "the keys), a label as LABEL=KIND:... (e.g. mirror:backend=threads:threads=2,1); auto runs "
                            "what `mirrorsd plan` recommends "
                            "for the pair (planned first if needed). References (ar, hf-ar, llama-server-ar) "
                            "are added as needed")
        p.add_argument("--llama-server", metavar="PATH",
                       help="llama.cpp's llama-server binary (default: $MIRRORSD_LLAMA_SERVER or PATH; skipped "
                            "with a note when absent)")
    p.add_argument("--suite", default="specbench:1",
                   help="specbench (all 480), specbench:N (N questions per task group, spread evenly), assist "
                        "(12 editing / refactoring / answer-from-context prompts) or a JSONL "
                        'file of {"turns": [...]} / {"prompt": ...}')
    add_sampling(p, max_new_tokens=(128, "most new tokens per turn"),
                 temperature=(0.0, "0 is greedy (Spec-Bench's setting)"),
                 top_k=(0, "keep the k likeliest tokens when sampling (0: off; the SS paper's ablation samples at "
                           "T = 1 with k = 10-50)"),
                 top_p=(1.0, "nucleus filter when sampling (1: off)"),
                 seed=(0, "sampling seed (per question: seed and question id)"))
    p.add_argument("--runs", type=int, default=3, help="timed runs (median and range reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up passes of every method")
    add_formats(p, "our weight format (default: as generate)",
                "our activation precision of quantized weights (default: as generate)")
    p.add_argument("--device", default="cpu", help="torch device for our models and the HF peers")
    add_dtype(p)
    p.add_argument("--threads-split", metavar="T,D", help="target,draft threads the planner times for the threads "
                                                         "backend (default: half each)")
    p.add_argument("--no-probe", action="store_true", help="skip the untimed acceptance / early-exit probe (it decodes "
                   "at --temperature, verified as --probe-acceptance says when > 0)")
    p.add_argument("--probe-acceptance", choices=["match", "rejection"], default="match",
                   help="how the probe verifies its windows when --temperature > 0: match (sample-and-match, the "
                        "methods' default acceptance) or rejection (speculative sampling, the papers' setting; only "
                        "then does the report give 1 - Ω under the distribution each correction was drawn from)")
    p.add_argument("--probe-exit-head", metavar="FOLDER", help="the tuned exit the probe reads next to the lens "
                   "(a `mirrorsd train-exit` folder), to compare exits on the same rollouts (default: the target's "
                   "shipped one)")
    p.add_argument("--no-predict", action="store_true", help="skip the forward-cost measurement and predictions")
    p.add_argument("--out", default="bench_out/run", help="output folder")


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench", formatter_class=HelpFormatter, help=COMMANDS["bench"],
        description="Run Spec-Bench questions (or your own JSONL) through our methods and the peers (HF "
        "transformers generate / assisted / prompt lookup, llama.cpp's llama-server when found) in one run, "
        "interleaved per question; check every output against its AR reference; write results.json, Spec-Bench "
        "answer files, report.md and plots to --out. Subcommands: sweep, forward, gpu, serve, perplexity, quality, "
        "tradeoff.")
    _bench_arguments(b, methods=True)
    b.set_defaults(func=run)
    bsub = b.add_subparsers(dest="bench_command", required=False,
                            metavar="{sweep,forward,gpu,serve,perplexity,quality,tradeoff}")
    bw = bsub.add_parser(
        "sweep", formatter_class=HelpFormatter,
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
    bw.add_argument("--thread-splits", nargs="+", default=[None], metavar="T,D",
                    help="target,draft thread splits tried with the threads backend (default: the machine's cores "
                         "halved, as the backend's own default and the latency law's split tables)")
    bf = bsub.add_parser(
        "forward", formatter_class=HelpFormatter,
        help="k-token forward cost and AR tok/s of one model",
        description="Times k-token forwards (k = verification window) after a cached context, interleaved "
        "over rounds (median), and greedy AR decoding speed. Speculative decoding pays when forward_ms[k] "
        "stays close to forward_ms[1].")
    add_model(bf)
    add_formats(bf, "weight format", "activation precision of quantized weights", defaults=("q4", "int8"))
    bf.add_argument("--linear", default="auto", choices=LINEAR_IMPLS,
                    help="linear-layer implementation. auto: our packed/quantized kernels; dense: PyTorch's stock "
                         "GEMMs (the baseline)")
    bf.add_argument("--ks", default="1,2,4,8,16", help="comma-separated window sizes")
    bf.add_argument("--context", type=int, default=128, help="cached tokens before each timed forward")
    bf.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    bf.add_argument("--ar-tokens", type=int, default=32, help="tokens decoded for the AR tok/s figure")
    bf.add_argument("--prompt", type=int, default=512, metavar="N",
                    help="also time an N-token prompt into an empty cache (prefill; llama-bench's ppN); 0: skip")
    bf.add_argument("--llama-bench", metavar="PATH",
                    help="llama.cpp's llama-bench binary: also time llama.cpp on the same GGUF file")
    bf.add_argument("--json", action="store_true", help="print the report as JSON")
    bg = bsub.add_parser(
        "gpu", formatter_class=HelpFormatter,
        help="validate a CUDA machine: CUDA tests, every method on random weights of real shapes, Mirror-SD vs Eq. 10",
        description="One command for a lent GPU machine. Makes random-weight models of real shapes on the device "
        "(Qwen2.5-1.5B- and 7B-shaped targets, a 0.5B-shaped draft: nothing large has to travel), runs "
        "tests/test_cuda.py, times the k-token forward curve and a forward against the bandwidth floor (the draft's "
        "too, at a long context, kernels per layer, host syncs per token), times HF transformers' generate on the "
        "first target's weights next to our ar, runs every method and checks its tokens against ar, "
        "then forces acceptance lengths with an oracle draft (the real draft network runs; its tokens follow the "
        "target's answer for A tokens, then miss) to compare Mirror-SD's step time with its Eq. 10 terms and with "
        "vanilla SD at the same acceptance. Writes report.md, report.json and Chrome traces into --out. Without "
        "CUDA it is a dry run on tiny shapes, to check the command itself.")
    bg.add_argument("--out", required=True, help="folder for report.md, report.json and the traces")
    bg.add_argument("--device", help="torch device (default: cuda if available, else a CPU dry run)")
    bg.add_argument("--targets", default="qwen2.5-1.5b,qwen2.5-7b",
                    help="target shapes to run; also qwen2.5-14b (~30 GB in bf16, an H100) and qwen2.5-32b (~66 GB, "
                    "an H200), the Mirror-SD paper's sizes, not in the default run")
    bg.add_argument("--accept", default="1,3,5",
                    help="forced accepted tokens per step (each also runs with every draft token accepted)")
    bg.add_argument("--gamma", type=int, default=7, help="draft window γ of SD and Mirror-SD in the forced runs")
    add_sampling(bg, max_new_tokens=(None, "tokens per generation (default: 48; 16 in a dry run)"))
    bg.add_argument("--prompt-tokens", type=int, default=128, help="random prompt length (and forward context)")
    bg.add_argument("--ks", default="1,2,4,8,16,32", help="window sizes of the forward curve")
    bg.add_argument("--dtype", choices=("bfloat16", "float32"),
                    help="model dtype (default: bfloat16 on CUDA, float32 in a dry run); float32 GEMMs are nearly "
                         "batch-invariant, so every answer must equal ar's exactly")
    bg.add_argument("--no-tests", action="store_true", help="skip tests/test_cuda.py")
    bg.add_argument("--no-peer", action="store_true",
                    help="skip HF transformers' generate (eager, and static cache + torch.compile: ~40 s to compile)")
    bg.add_argument("--peer-tokens", type=int, default=128,
                    help="tokens per answer of the HF peer and of the ar run beside it")
    bs = bsub.add_parser(
        "serve", formatter_class=HelpFormatter,
        help="load sweep against live servers (ours and llama.cpp's llama-server), driven by NVIDIA's aiperf",
        description="Starts each server of --servers once (`mirrorsd serve` in its own process with "
        "--max-num-seqs set to the top concurrency; llama.cpp's llama-server with -np as many slots), then runs "
        "NVIDIA's aiperf against them at every concurrency level, in interleaved rounds: streaming chat requests, "
        "Spec-Bench first turns (each level and round its own, the same for every server; --turns 2: two-turn "
        "conversations), fixed-length greedy "
        "answers. Reports the median aggregate tok/s, time to first token and time per output token (p50/p99) per "
        "level and server, and plots throughput against latency. aiperf runs from its own virtual environment "
        "(installed into the cache on first use unless --aiperf or $MIRRORSD_AIPERF names one). Writes "
        "results.json, report.md, throughput_latency.png and aiperf's own files into --out.")
    bs.add_argument("--target", default="qwen2.5-coder-1.5b", help="zoo model name or local HF folder")
    bs.add_argument("--servers", default=serve.DEFAULT_SERVERS,
                    help="comma-separated LABEL=KIND[:flag=value...], KIND mirrorsd (flags of `mirrorsd serve`, "
                         "e.g. ar1=mirrorsd:method=ar:max-num-seqs=1 for the one-at-a-time server) or llama-server "
                         "(its own flags; skipped with a note when no binary is found); max-concurrency=N on any "
                         "entry skips that server's levels above N")
    bs.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated concurrency levels")
    bs.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    bs.add_argument("--max-tokens", type=int, default=128, help="tokens of every answer (ignore_eos)")
    bs.add_argument("--requests-per-client", type=int, default=2,
                    help="requests per level: this many times the concurrency (conversations, with --turns 2)")
    bs.add_argument("--turns", type=int, choices=(1, 2), default=1,
                    help="turns per conversation. 2: Spec-Bench's two-turn (MT-bench) questions as aiperf "
                         "multi-turn sessions, the second turn sent with the first and the server's answer to it, "
                         "as a chat client sends it; the report adds the share of prompt tokens a mirrorsd server's "
                         "prefix cache restored")
    bs.add_argument("--aiperf", metavar="PATH", help="aiperf binary (default: $MIRRORSD_AIPERF, PATH, or the "
                    "cache's aiperf-venv, made on first use)")
    bs.add_argument("--llama-server", metavar="PATH",
                    help="llama.cpp's llama-server binary (default: $MIRRORSD_LLAMA_SERVER or PATH)")
    bs.add_argument("--slot-context", type=int, default=2048,
                    help="llama-server context per slot (-c is this times -np; Spec-Bench's longest first turn "
                         "is ~1,500 tokens)")
    bs.add_argument("--out", default="bench_out/serve", help="output folder")
    bp = bsub.add_parser(
        "perplexity", formatter_class=HelpFormatter,
        help="perplexity of a model in one or more weight formats on an offline corpus",
        description="Scores Python standard-library source (fixed module list, teacher forcing, "
        "non-overlapping windows) so the quality cost of q8/q4 against fp32 can be read off side by side.")
    add_model(bp)
    add_weights(bp, "comma-separated weight formats", default="fp32,q8,q4", choices=None)
    bp.add_argument("--activations", choices=ACTIVATION_FORMATS, default="int8",
                    help="activation precision of the quantized formats (`mirrorsd models list` shows each zoo model's "
                         "default format)")
    bp.add_argument("--tokens", type=int, default=4096, help="corpus tokens scored")
    bp.add_argument("--window", type=int, default=512, help="tokens per scored window")
    bp.add_argument("--json", action="store_true", help="print one JSON object per format")
    bq = bsub.add_parser(
        "quality", formatter_class=HelpFormatter,
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
    bt = bsub.add_parser(
        "tradeoff", formatter_class=HelpFormatter,
        help="latency and acceptance vs γ across runs with different drafts (the Mirror-SD paper's Fig. 3a)",
        description="Reads the results.json of one or more `mirrorsd bench` runs (one per draft, each with methods "
        "that differ only in gamma, e.g. sd-g1=sd:gamma=1:confidence=0:suffix_match=0 ... sd-g7=...) and draws "
        "every curve in one figure: latency per token and accepted draft tokens per step against γ, with each "
        "run's ar dotted. Writes tradeoff_vs_gamma.png and tradeoff.md to --out.")
    bt.add_argument("runs", nargs="+", metavar="RUN", help="bench output folders (or their results.json)")
    bt.add_argument("--out", default="bench_out/tradeoff", help="output folder")


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must list positive integers, got {text!r}")
    return values


def _gpu(args: argparse.Namespace) -> int:
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    known = (*gpu.TARGETS, *gpu.LARGE_TARGETS)
    unknown = [t for t in targets if t not in known]
    if not targets or unknown:
        raise ValueError(f"--targets must name some of {', '.join(known)}, got {args.targets!r}")
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available here")
    accepts = _positive_ints(args.accept, "--accept")
    if max(accepts) >= args.gamma:
        raise ValueError(f"--accept values must be below --gamma ({args.gamma}): a window of γ accepts at most γ")
    report = gpu.run(Path(args.out), device=args.device, max_new=args.max_new_tokens, prompt_len=args.prompt_tokens,
                     accepts=accepts, gamma=args.gamma, targets=targets, ks=_positive_ints(args.ks, "--ks"),
                     tests=not args.no_tests, dtype=getattr(torch, args.dtype) if args.dtype else None,
                     peer=not args.no_peer, peer_tokens=args.peer_tokens)
    print(gpu.summary(report))
    print(f"report: {Path(args.out) / 'report.md'}")
    return 1 if gpu.not_lossless(report) or gpu.failed_checks(report) else 0


def _forward(args: argparse.Namespace) -> int:
    try:
        ks = tuple(sorted({int(k) for k in args.ks.split(",")}))
    except ValueError:
        raise ValueError(f"--ks must be comma-separated integers, got {args.ks!r}") from None
    if not ks or ks[0] < 1:
        raise ValueError("--ks must be positive")
    if args.rounds < 1 or args.ar_tokens < 1 or args.context < 1:
        raise ValueError("--rounds, --ar-tokens and --context must be positive")
    if args.prompt < 0:
        raise ValueError("--prompt must be 0 (skip) or a positive token count")
    warn_if_busy("bench forward")
    report = forward.run(args.model, args.weights, ks, args.context, args.rounds, args.ar_tokens, args.llama_bench,
                         args.linear, args.activations, args.prompt)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    print(f"{report.model} ({report.weights}/{report.activations}, {report.linear}) on {report.machine}, "
          f"{report.threads} threads, "
          f"fast kernels: {report.fast_kernels}, context {report.context}")
    for k, ms in report.forward_ms.items():
        print(f"  k={k:>3}: {ms:9.1f} ms  ({report.relative[k]:.2f}x k={ks[0]})")
    print(f"  AR: {report.ar_tok_s:.2f} tok/s")
    if report.prompt_tok_s:
        print(f"  prompt of {report.prompt_tokens} tokens: {report.prompt_tok_s:.1f} tok/s")
    if report.llama_cpp:
        lc = report.llama_cpp
        print(f"  llama.cpp ({lc.get('build')}): AR {lc.get('ar_tok_s', float('nan')):.2f} tok/s; " + ", ".join(
            f"k={k}: {ms:.1f} ms" for k, ms in lc["forward_ms"].items()))
        print(f"  ours / llama.cpp AR: {lc['ar_ratio_median']:.2f}x (median of {len(lc['ar_tok_s_rounds'])} "
              "alternating rounds)")
        if "prompt_ratio_median" in lc:
            print(f"  ours / llama.cpp prompt ({report.prompt_tokens} tokens, llama.cpp {lc['prompt_tok_s']:.1f} "
                  f"tok/s): {lc['prompt_ratio_median']:.2f}x")
    return 0


def _bench_config(args: argparse.Namespace, methods) -> object:
    split = None
    if getattr(args, "threads_split", None):
        split = _positive_ints(args.threads_split, "--threads-split")
        if len(split) != 2:
            raise ValueError(f"--threads-split takes two thread counts, TARGET,DRAFT, got {args.threads_split!r}")
    try:
        return BenchConfig(target=args.target, draft=args.draft, methods=methods, suite=args.suite,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=getattr(args, "top_k", 0), top_p=getattr(args, "top_p", 1.0), seed=args.seed,
                           runs=args.runs, warmup=args.warmup, weights=args.weights,
                           activations=args.activations, device=args.device,
                           dtype=args.dtype, llama_server=getattr(args, "llama_server", None), probe=not args.no_probe,
                           probe_exit_head=getattr(args, "probe_exit_head", None),
                           probe_acceptance=getattr(args, "probe_acceptance", "match"), predict=not args.no_predict,
                           threads_split=split)
    except OptionError as e:
        raise ValueError(f"--{e.option.replace('_', '-')} {e.message}") from None


def _write_results(results: dict, out: Path) -> None:
    write_text(out / "results.json", json.dumps(results, indent=1, ensure_ascii=False))
    write_answers(results, out)


def _run_bench(config, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(config)

    written = [0.0]

    def so_far() -> None:  # after a question, every 30 s at most: a kill (SIGKILL, out of memory) loses little
        if not bench.answers or time.monotonic() - written[0] < 30:
            return
        written[0] = time.monotonic()
        bench.notes.append(f"partial: the {len(bench.answers)} answers so far (the run had not finished)")
        try:
            _write_results(bench.results(bench.costs, None), out)
        finally:
            bench.notes.pop()

    clear_report(out)  # (an earlier run's report and plots would sit beside this run's results)
    bench.on_question = so_far
    try:
        results = bench.run()
    except BaseException as e:  # Ctrl-C or a failure hours in: keep every question all methods answered
        if bench.answers:
            bench.notes.append(f"interrupted ({type(e).__name__}) after {len(bench.answers)} answers: partial")
            _write_results(bench.results(bench.costs, None), out)
            print(f"mirrorsd: interrupted; the {len(bench.answers)} answers finished so far are in "
                  f"{out / 'results.json'} and {out / 'answers'}/", file=sys.stderr, flush=True)
        raise
    finally:
        bench.close()
    _write_results(results, out)
    report = write_report(results, out)
    print(report.read_text(encoding="utf-8"))
    print(f"written: {out / 'results.json'}, {report}, {out / 'answers'}/*.jsonl and plots in {out}")
    if bad := [m for m, s in results["summary"].items() if diverged(s)]:  # a script must not read this as a pass
        print(f"mirrorsd: error: not lossless: {', '.join(bad)} gave answers that differ from their reference "
              "(the report's Lossless check lists where)", file=sys.stderr)
        return 1
    return 0


def _sweep(args: argparse.Namespace) -> int:
    specs = [MethodSpec("ar", "ar")]
    for gamma in parse_csv(args.gammas, int):
        # vanilla SD: fixed windows from the draft alone (sd's default suffix lookup in front would measure its gate)
        specs.append(MethodSpec(f"sd γ={gamma}", "sd", {"gamma": gamma, "confidence": 0.0, "suffix_match": 0}))
        grid = itertools.product(parse_csv(args.exit_layers, number), parse_csv(args.kappas, int),
                                 parse_csv(args.roots), parse_csv(args.candidates), parse_csv(args.backends))
        for exit_layer, kappa, roots, candidates, backend in grid:
            for split in args.thread_splits if backend == "threads" else [None]:
                options = {"gamma": gamma, "kappa": kappa, "exit_layer": exit_layer, "roots": roots,
                           "candidates": candidates, "backend": backend, "confidence": 0.0}
                label = f"mirror γ={gamma} κ={kappa} ℓe={exit_layer} {roots} {candidates} {backend}"
                if split:
                    options["threads"] = split
                    label += f" {split}"
                specs.append(MethodSpec(label, "mirror", options))
    for spec in specs:  # every configuration is checked before the models load
        get_method(spec.kind).options.parse(spec.options, spec.kind)
    print(f"sweep: {len(specs)} configurations", flush=True)
    return _run_bench(_bench_config(args, specs), Path(args.out))


def _serve(args: argparse.Namespace) -> int:
    levels = sorted(set(_positive_ints(args.concurrency, "--concurrency")))
    if min(args.rounds, args.max_tokens, args.requests_per_client, args.slot_context) < 1:
        raise ValueError("--rounds, --max-tokens, --requests-per-client and --slot-context must be positive")
    specs, notes = serve.parse_servers(args.servers), []
    if any(s.kind == "llama-server" for s in specs) and find_llama_server(args.llama_server) is None:
        notes.append("no llama-server binary (--llama-server PATH or $MIRRORSD_LLAMA_SERVER): llama.cpp is left out")
        print("note: " + notes[-1])
        specs = [s for s in specs if s.kind != "llama-server"]
    if not specs:
        raise ValueError("--servers: nothing left to run")
    warn_if_busy("bench serve")
    out = Path(args.out)
    results = serve.run(serve.ServeConfig(args.target, specs, levels, args.rounds, args.max_tokens,
                                          args.requests_per_client, args.aiperf, args.llama_server,
                                          args.slot_context, out, notes, args.turns))
    report = serve.markdown(results)
    (out / "report.md").write_text(report, encoding="utf-8")
    serve.plot(results, out / "throughput_latency.png")
    print(report)
    print(f"written: {out / 'results.json'}, {out / 'report.md'}, {out / 'throughput_latency.png'}")
    if bad := [label for label in results["runs"] if serve.failures(results, label)]:
        print(f"mirrorsd: error: requests failed on {', '.join(bad)}: their figures cover the rest only (the "
              "report marks the levels)", file=sys.stderr)
        return 1
    return 0


def _perplexity(args: argparse.Namespace) -> int:
    formats = [w.strip() for w in args.weights.split(",") if w.strip()]
    unknown = sorted(set(formats) - set(WEIGHT_FORMATS))
    if not formats or unknown:
        raise ValueError(f"--weights takes formats from {', '.join(WEIGHT_FORMATS)}; got {args.weights!r}")
    if args.tokens < 2 or args.window < 2:
        raise ValueError("--tokens and --window must be at least 2")
    first = None
    for fmt in formats:
        report = perplexity.run(args.model, fmt, args.tokens, args.window, progress=not args.json,
                                activations=args.activations)
        first = first or report
        if args.json:
            print(json.dumps(report.to_dict()), flush=True)
        else:
            delta = 100 * (report.perplexity / first.perplexity - 1)
            shown = fmt if fmt == "fp32" else f"{fmt} weights, {report.activations} activations"
            print(f"{report.model} {shown}: perplexity {report.perplexity:.4f} over {report.tokens} tokens "
                  f"({delta:+.2f}% vs {first.weights})", flush=True)
    return 0


def _quality(args: argparse.Namespace) -> int:
    models = list(ZOO) if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    formats = quality.parse_formats(args.formats)
    if args.answer_tokens < 1:
        raise ValueError("--answer-tokens must be positive")
    report = quality.run(models, formats, load_suite(args.suite), args.answer_tokens, Path(args.out))
    print(quality.markdown(report))
    print(f"wrote {Path(args.out) / 'quality.json'} and quality.md")
    return 0


def _tradeoff(args: argparse.Namespace) -> int:
    from mirrorsd.bench.report import TRADEOFF_PLOT, plot_tradeoff, tradeoff_table

    runs = []
    for run_path in map(Path, args.runs):
        path = run_path / "results.json" if run_path.is_dir() else run_path
        if not path.is_file():
            raise ValueError(f"{run_path}: no results.json there (give `mirrorsd bench` output folders)")
        runs.append(json.loads(path.read_text()))
        if any(n.startswith(("interrupted", "partial:")) for n in runs[-1].get("notes", [])):
            print(f"mirrorsd: warning: {path} is a run that did not finish: its figures cover only the questions "
                  "it answered", file=sys.stderr)
    table = tradeoff_table(runs)
    if any("✗" in row for row in table):
        print("mirrorsd: warning: points marked ✗ are not lossless: an answer differed from its reference's",
              file=sys.stderr)
    if not table:
        raise ValueError("no method in these runs comes at two or more values of gamma: nothing to draw")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_tradeoff(runs, out / TRADEOFF_PLOT)
    (out / "tradeoff.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    print(f"wrote {out / TRADEOFF_PLOT} and {out / 'tradeoff.md'}")
    return 0


_SUBCOMMANDS = {"sweep": _sweep, "forward": _forward, "gpu": _gpu, "serve": _serve, "perplexity": _perplexity,
                "quality": _quality, "tradeoff": _tradeoff}


def run(args: argparse.Namespace) -> int:
    """The Spec-Bench run, or the subcommand named."""
    if args.bench_command is not None:
        return _SUBCOMMANDS[args.bench_command](args)
    return _run_bench(_bench_config(args, parse_methods(args.methods)), Path(args.out))
