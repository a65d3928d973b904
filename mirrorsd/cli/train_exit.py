"""``mirrorsd train-exit``: a tuned early exit (per-layer translators) for Mirror-SD, fitted in closed form."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import mirrorsd
from mirrorsd.exit_heads import ExitTranslators, resolve_exit_layer
from mirrorsd.train_exit import KLRefine, fit_exit, plot_curve, self_distilled
from mirrorsd.training import corpus_texts

from .args import COMMANDS, add_formats, add_model, count
from .common import HelpFormatter, number, parse_csv, say_loaded, warn_if_busy


def register(sub: argparse._SubParsersAction) -> None:
    te = sub.add_parser(
        "train-exit", formatter_class=HelpFormatter, help=COMMANDS["train-exit"],
        description="Fit an affine translator per exit layer that maps the layer's state towards the final one "
        "before the model's own final norm + LM head (a tuned lens), by ridge regression on the frozen model's "
        "states over offline text (labels: the model's own greedy next tokens), optionally fine-tuned by KL to the "
        "final distribution (--kl-steps). Reports held-out top-κ hit rates of the plain logit lens and the tuned "
        "exit, and saves a learning curve. Minutes on a CPU.")
    add_model(te, required=True)
    te.add_argument("--data", nargs="+", default=["stdlib", "pydoc-topics"],
                    help="text files or folders, or corpus names: stdlib, pydoc-topics, chat-answers, "
                         "distill:FOLDER (as train-streams)")
    where = te.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="folder for exit_head.safetensors + exit_head.json")
    where.add_argument("--into", metavar="FOLDER",
                       help="an existing tuned exit: the fitted layers replace its own, its other layers stay (their "
                            "recipes are kept; the refit's recipe and curve go under refits in its exit_head.json)")
    te.add_argument("--layers", default="0.25,0.5,0.75", help="exit layers: indices or fractions of the depth")
    te.add_argument("--chunks", type=count(1), default=64, help="windows of the corpus text")
    te.add_argument("--self-distill", type=count(0), default=0, metavar="N",
                    help="also fit on N chat transcripts of the model's own greedy answers to prompts about stdlib "
                         "modules (the text Mirror-SD decodes; none is a benchmark question); at most 84")
    te.add_argument("--distill-tokens", type=count(1), default=128, help="tokens per self-distilled answer")
    te.add_argument("--held-out", type=count(2), default=8,
                    help="windows (of all) kept out: the first half picks λ and the KL step, the second half "
                         "measures the reported hit rates")
    te.add_argument("--seq-len", type=count(2), default=256, help="tokens per window")
    te.add_argument("--seed", type=int, default=0, help="data order")
    te.add_argument("--kl-steps", type=count(0), default=0, metavar="N",
                    help="then fine-tune each translator for N steps of 256 tokens by KL to the final distribution "
                         "(the tuned lens's objective; the best step on the validation half is kept). 300 is the "
                         "shipped recipe")
    te.add_argument("--kl-lr", type=float, default=1e-4, help="Adam learning rate of the KL fine-tune")
    te.add_argument("--topk-weight", type=float, default=0.0, metavar="W",
                    help="add to the KL fine-tune a top-8 hinge weighted W: it pushes the final token above the 8th "
                         "likeliest other token of the exit, which is what Mirror-SD's candidates need (0: KL alone)")
    te.add_argument("--corrections", metavar="DRAFT",
                    help="a draft model (zoo name or folder, the model's tokenizer): rows where its greedy next "
                         "token differs from the model's are the corrections Mirror-SD's exit must hold; they weigh "
                         "--correction-weight times in the fit, and pick λ and the KL step by their validation top-8")
    te.add_argument("--correction-weight", type=float, default=4.0, metavar="W",
                    help="how much more a correction row counts (with --corrections; at least 1)")
    add_formats(te, "the format decoding will use (default: as generate)", "(default: as generate)")
    te.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.kl_steps < 0 or args.kl_lr <= 0:
        raise ValueError(f"--kl-steps must be >= 0 and --kl-lr > 0, got {args.kl_steps} and {args.kl_lr}")
    if args.topk_weight < 0 or (args.topk_weight and not args.kl_steps):
        raise ValueError(f"--topk-weight must be >= 0 and needs --kl-steps, got {args.topk_weight}")
    layers_asked = [number(x) for x in parse_csv(args.layers)]
    if not layers_asked:  # (an unset shell variable: an empty exit was written, and "written" said)
        raise ValueError(f"--layers names no exit layer (got {args.layers!r}): give indices or fractions of the depth")
    if args.correction_weight < 1:  # (checked by the fit too, after the model loaded and self-distilled)
        raise ValueError(f"--correction-weight must be at least 1, got {args.correction_weight}")
    # the exit a refit joins, and the folder a new one goes to, are checked before minutes of fitting
    base = ExitTranslators.load(Path(args.into)) if args.into else None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    warn_if_busy("train-exit")
    loaded = mirrorsd.load_model(args.model, weights=args.weights, activations=args.activations)
    say_loaded("model", loaded, args)
    layers = sorted({resolve_exit_layer(x, loaded.config.n_layers) for x in layers_asked})
    width = next(iter(base.layers.values())).shape[-1] if base is not None and base.layers else None
    if width is not None and width != loaded.config.hidden_size:
        raise ValueError(f"--into {args.into}: its translators are {width} wide, {args.model}'s states "
                         f"{loaded.config.hidden_size}: it belongs to another model")
    corrections = None
    if args.corrections:
        corrections = mirrorsd.load_model(args.corrections, weights=args.weights, activations=args.activations)
        say_loaded("corrections' draft", corrections, args)
    transcripts = self_distilled(loaded, args.self_distill, args.distill_tokens) if args.self_distill else []
    texts = corpus_texts(args.data, args.model, loaded.tokenizer)
    translators = fit_exit(loaded.model, loaded.tokenizer, texts, layers, chunks=args.chunks,
                           held_out=args.held_out, seq_len=args.seq_len, seed=args.seed, transcripts=transcripts,
                           refine=KLRefine(args.kl_steps, args.kl_lr, topk_weight=args.topk_weight) if args.kl_steps
                           else None,
                           corrections=corrections.model if corrections else None,
                           correction_weight=args.correction_weight)
    translators.meta["recipe"].update(
        command="mirrorsd train-exit " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else []), model=args.model,
        data=args.data, weights=loaded.weights, activations=loaded.activations,
        **({"corrections_draft": args.corrections} if args.corrections else {}))
    if args.into:
        out, refit = Path(args.into), translators
        translators = refit.merged_into(base)
        translators.save(out)
        plot_curve(refit.meta, out / f"learning_curve_refit_{'_'.join(map(str, layers))}.png")
    else:
        out = Path(args.out)
        translators.save(out)
        plot_curve(translators.meta, out / "learning_curve.png")
    print(json.dumps(translators.meta["held_out"], indent=2))
    print(f"written: {out}/exit_head.safetensors, exit_head.json and the learning curve", file=sys.stderr)
    return 0
