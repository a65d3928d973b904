"""``mirrorsd distill``: the data engine behind the drafts' training (:mod:`mirrorsd.distill`)."""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

import mirrorsd
from mirrorsd.decoding import REFERENCE, methods
from mirrorsd.distill.engine import Settings, Shards
from mirrorsd.distill.engine import run as run_engine
from mirrorsd.distill.prompts import CHAT_WAVES, KINDS

from .args import COMMANDS, add_model
from .common import HelpFormatter, warn_if_busy


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "distill", formatter_class=HelpFormatter, help=COMMANDS["distill"],
        description="Answer ~30,000 prompts of our own making (code, QA, translation, math word problems, answers "
        "from a given context, summaries of passages the model writes, multi-turn, the model's own self-instruct "
        "questions, and the chat kinds: writing, role-play, advice and reasoning requests, questions in a user's "
        "voice, short facts, translation into English; never a Spec-Bench question) with the model itself, many at "
        "once through continuous batching, greedy plus a sampled share. Writes compressed token shards to --out; "
        "run it again to resume where it stopped (Ctrl-C or SIGTERM keeps the answers in flight). "
        "OUT/index.json counts items, tokens and kinds.")
    add_model(d)
    d.add_argument("--out", help="output folder (default: data/distill/MODEL)")
    d.add_argument("--batch", type=int, default=16, help="conversations decoded at once")
    d.add_argument("--items", type=int, help="answer at most this many more items in this run (default: all)")
    d.add_argument("--minutes", type=float, help="stop after this many minutes (the items in flight finish)")
    d.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per answer")
    d.add_argument("--sampled-share", type=float, default=0.2, help="share of items answered by sampling")
    d.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled answers")
    d.add_argument("--method", default=REFERENCE, choices=[m.name for m in methods() if not m.needs_draft
                                                           and not any(o.required for o in m.options.fields())],
                   help="decoding method (all give the model's own tokens; ar is the reference)")
    d.add_argument("--kinds", type=kind_list, metavar="KIND,...",
                   help="answer only these kinds' pending items (default: all, in id order); kinds: "
                        + ", ".join(KINDS))
    d.add_argument("--shard-items", type=int, default=64, help="items per shard (a stop loses at most these)")
    d.add_argument("--prefix-cache-mib", type=int, default=1024,
                   help="memory for finished turns' keys and values, so a conversation's next turn and the chat "
                        "template's shared start are not prefilled again (the answers stay the same bits); 0: off")
    d.set_defaults(func=run)


def kind_list(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown kind(s) {', '.join(unknown) or text!r}; kinds: {', '.join(KINDS)}")
    return kinds


def run(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.shard_items < 1 or args.max_new_tokens < 1 or (args.items is not None and args.items < 1):
        raise ValueError("--batch, --shard-items, --max-new-tokens and --items must be >= 1")
    if args.minutes is not None and not args.minutes > 0:
        raise ValueError(f"--minutes must be > 0, got {args.minutes}")
    if args.prefix_cache_mib < 0:
        raise ValueError(f"--prefix-cache-mib must be >= 0, got {args.prefix_cache_mib}")
    if not 0 <= args.sampled_share <= 1 or args.temperature <= 0:
        raise ValueError("--sampled-share must be in [0, 1] and --temperature > 0")
    warn_if_busy("the generation")
    out = Path(args.out or f"data/distill/{args.model}")
    settings = Settings(args.model, args.method, args.max_new_tokens, args.sampled_share, args.temperature)
    shards = Shards(out, settings)
    for wave in CHAT_WAVES:  # a folder frozen before a wave of chat-kind prompts existed gains it, ids going on
        if added := shards.add_prompts(wave()):
            print(f"{out}: {added} chat-kind prompts appended to its frozen set (ids from "
                  f"{len(shards.prompts) - added})")
    target = mirrorsd.load_model(args.model)
    # Stop as Ctrl-C does on SIGTERM too, and on SIGINT where a shell started the run in the background (which
    # leaves SIGINT ignored): the answers in flight finish and are written.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    summary = run_engine(target, shards, batch=args.batch, shard_items=args.shard_items, items=args.items,
                         seconds=None if args.minutes is None else 60 * args.minutes,
                         prefix_cache_bytes=args.prefix_cache_mib << 20, kinds=args.kinds)
    print(json.dumps(summary))
    print(f"{out}: {summary['done_items']} of {summary['prompts']} items done (OUT/index.json)")
    return 0
