"""``mirrorsd train-draft``: a draft distilled toward its target (deltas on its top layers), trained offline."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import mirrorsd
from mirrorsd.api import shares_tokenizer
from mirrorsd.runtime.tensor_parallel import segment_bounds
from mirrorsd.train_draft import train

from .args import COMMANDS, DEFAULT_DRAFT, DEFAULT_TARGET, MODEL_HELP, add_training, count
from .common import HelpFormatter, training_dtype, warn_if_busy


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train-draft", formatter_class=HelpFormatter, help=COMMANDS["train-draft"],
        description="Fine-tune a draft to agree with its target: peft LoRA on every projection of the draft's top "
        "--layers blocks, trained on the target's teacher-forced greedy tokens (what greedy verification accepts). "
        "Only proposals change: every method stays lossless. The draft decoding runs fills a state cache once "
        "(its layer N - layers states and the target's tokens, ~1.8 KB/token on the 0.5B); steps then run the top "
        "blocks only. Resumes from OUT/checkpoint.pt and the cache's finished shards; saves OUT/draft_tune.json + "
        "lora.safetensors (use it as --draft OUT; the deltas are merged into the weights as it loads) and a "
        "learning curve.")
    t.add_argument("--model", default=DEFAULT_DRAFT, help="the draft: " + MODEL_HELP)
    t.add_argument("--target", default=DEFAULT_TARGET, help="the model whose tokens it learns: " + MODEL_HELP)
    t.add_argument("--data", nargs="+", required=True,
                   help="as train-streams: distill:FOLDER (the target's answers of `mirrorsd distill`), corpus "
                        "names or text files/folders")
    t.add_argument("--out", required=True, help="folder for draft_tune.json + lora.safetensors")
    t.add_argument("--cache", help="state cache folder (default: OUT/cache); reused by later runs with the same "
                                   "models, data, --seq-len, --chunks, --held-out, --layers, --seed")
    t.add_argument("--target-cache", metavar="FOLDER",
                   help="read the target's tokens from its `train-streams` state cache, or from another "
                        "`train-draft` cache (e.g. of other --layers or --spd-tracks), built over the same windows "
                        "(same --data, --seq-len, --chunks, --held-out, --seed; checked) instead of running it")
    t.add_argument("--layers", type=count(1),
                   help="top layers of the draft that get deltas (default: 8; with --spd-tracks, the top segment)")
    t.add_argument("--rank", type=count(1), default=16, help="LoRA rank (alpha = 2 x rank)")
    add_training(t, seq_len=256, lr=3e-4, held_out=16, measured="agreement", trained="deltas")
    t.add_argument("--loss-on", choices=["answers", "all"], default="all",
                   help="all: every position (measured better at 253k tokens: prompts act as more data); answers: "
                        "only positions whose next token the target wrote, where the data marks them (distill: "
                        "folders), the only ones drafting proposes")
    t.add_argument("--soft-top", type=int, default=0, metavar="K",
                   help="K > 0: learn the target's distribution over its K likeliest tokens and one bucket for the "
                        "rest (cached with the labels; from a train-streams --target-cache by running the target's "
                        "layers above it) instead of its argmax alone, so the draft's confidence stays the "
                        "target's. 0: cross-entropy on the argmax")
    t.add_argument("--spd-tracks", type=int, default=1, metavar="G",
                   help="train the draft in the sharded form Mirror-SD runs it in with --draft-tp G --draft-syncs "
                        "spd: G tracks of heads and MLP slices that re-align only at the ends of its two segments "
                        "(the paper trains its drafts so; a draft trained whole proposes far worse tokens there). "
                        "1: the draft whole")
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.spd_tracks < 1:
        raise ValueError(f"--spd-tracks must be >= 1, got {args.spd_tracks}")
    if args.soft_top < 0:
        raise ValueError(f"--soft-top must be >= 0, got {args.soft_top}")
    warn_if_busy("train-draft")
    draft = mirrorsd.load_model(args.model, device=args.device)  # the draft decoding will run (q4 on CPU)
    need_target = not args.target_cache or args.soft_top  # a streams cache holds argmax labels only
    target = mirrorsd.load_model(args.target, device=args.device) if need_target else None
    if target is not None and not shares_tokenizer(target, draft):  # (an IndexError after the whole cache)
        raise ValueError(f"draft {args.model} does not share the tokenizer of target {args.target}: it learns the "
                         "target's token ids, so it needs the same vocabulary")
    target = target.model if target is not None else None
    tower = mirrorsd.load_model(args.model, device=args.device, dtype=training_dtype(args.dtype, args.device),
                                weights="fp32", linear="dense", progress=False)
    layers = args.layers
    if layers is None:
        n = tower.model.config.n_layers
        layers = n - segment_bounds(n)[-2] if args.spd_tracks > 1 else 8
    recipe = {"command": "mirrorsd train-draft " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else []),
              "model": args.model, "target": args.target, "data": args.data}
    summary = train(tower.model, draft.model, target, draft.tokenizer, args.data, Path(args.out),
                    model_name=args.model, target_name=args.target, decode_format=draft.format,
                    cache=Path(args.cache) if args.cache else None,
                    target_cache=Path(args.target_cache) if args.target_cache else None, layers=layers,
                    rank=args.rank, steps=args.steps, chunks=args.chunks, seq_len=args.seq_len, lr=args.lr,
                    held_out=args.held_out, vocab=args.vocab, eval_every=args.eval_every, seed=args.seed,
                    answers_only=args.loss_on == "answers", spd_tracks=args.spd_tracks, soft_top=args.soft_top,
                    recipe=recipe)
    print(json.dumps({k: v for k, v in summary.items() if k != "curve"}, indent=2))
    return 0
