"""``mirrorsd train-eagle``: an EAGLE-3-style draft head on the target's own features, trained offline."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

import mirrorsd
from mirrorsd.train_eagle import train

from .args import COMMANDS, DEFAULT_TARGET, MODEL_HELP, add_training
from .common import HelpFormatter, training_dtype, warn_if_busy


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train-eagle", formatter_class=HelpFormatter, help=COMMANDS["train-eagle"],
        description="Train an EAGLE-3-style draft head: one decoder layer that drafts from the target's own hidden "
        "states (the inputs of its blocks 2, N/2 and N-3, fused), fed back its own output state for further tokens "
        "(training-time test: --depth steps unrolled, each seeing what drafting's cache holds then). The target "
        "decoding runs fills a feature cache once (~9 KB/token on the 1.5B) with its teacher-forced greedy tokens; "
        "steps then run the head only. Reports held-out chain acceptance (the share of positions whose first j "
        "drafted tokens all equal the target's) and tokens per pass. Resumes from OUT/checkpoint.pt and the "
        "cache's finished shards; saves OUT/eagle_head.json + eagle_head.safetensors and a learning curve.")
    t.add_argument("--model", default=DEFAULT_TARGET, help="the target whose features the head reads: " + MODEL_HELP)
    t.add_argument("--data", nargs="+", required=True,
                   help="as train-streams: distill:FOLDER (the target's answers of `mirrorsd distill`), corpus "
                        "names or text files/folders")
    t.add_argument("--out", required=True, help="folder for the head")
    t.add_argument("--cache", help="feature cache folder (default: OUT/cache); reused by later runs with the same "
                                   "model, data, --seq-len, --chunks, --held-out, --seed")
    t.add_argument("--depth", type=int, default=3, help="drafting steps unrolled in training (EAGLE-3's TTT)")
    add_training(t, seq_len=256, lr=2e-4, held_out=16, measured="chain acceptance", trained="head's weights")
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.depth < 1:
        raise ValueError(f"--depth must be >= 1, got {args.depth}")
    warn_if_busy("train-eagle")
    target = mirrorsd.load_model(args.model, device=args.device)  # the weights decoding runs (q4 on CPU)
    recipe = {"command": "mirrorsd train-eagle " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else []),
              "model": args.model, "data": args.data}
    summary = train(target.model, target.tokenizer, args.data, Path(args.out), model_name=args.model,
                    decode_format=target.format, cache=Path(args.cache) if args.cache else None, steps=args.steps,
                    chunks=args.chunks, seq_len=args.seq_len, lr=args.lr, held_out=args.held_out, vocab=args.vocab,
                    depth=args.depth, eval_every=args.eval_every, seed=args.seed,
                    dtype=getattr(torch, training_dtype(args.dtype, args.device)), recipe=recipe)
    print(json.dumps({k: v for k, v in summary.items() if k != "curve"}, indent=2))
    return 0
