"""``mirrorsd plan``: measure this machine, rank every method by the latency law and save the best for auto."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

import mirrorsd
from mirrorsd import zoo
from mirrorsd.api import encode_chat, windows_exact
from mirrorsd.bench.plan import make_plan
from mirrorsd.decoding import REFERENCE
from mirrorsd.specbench import load_suite

from .args import COMMANDS, add_dtype, add_formats, add_pair, add_sampling
from .common import HelpFormatter, warn_if_busy


def register(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser(
        "plan", formatter_class=HelpFormatter, help=COMMANDS["plan"],
        description="Measures the target's k-token forward, prefix and early-exit costs and the draft's k-row "
        "costs here, probes acceptance and early-exit fallback on a few Spec-Bench prompts, predicts every "
        "method's speed with the Mirror-SD latency law (Eq. 10) and saves the best for `generate --method auto`.")
    # (a plan is kept under its draft's name; a self-draft has none)
    add_pair(pl, self_drafts=False, also=", or none: plan only the methods without a draft model (also where the "
             "draft does not share the target's tokenizer)")
    add_formats(pl)  # (generate's warning about a plan of other formats says to plan with its flags)
    pl.add_argument("--device", default="cpu", help="torch device the plan measures on (as generate's --device)")
    add_dtype(pl, help="float type of the models (as generate's --dtype)")
    pl.add_argument("--suite", default="specbench:1", help="calibration prompts: specbench[:N], assist or FILE.jsonl")
    add_sampling(pl, max_new_tokens=(48, "tokens per calibration prompt"))
    pl.add_argument("--top", type=int, default=10, help="rows of the ranking to print")
    pl.add_argument("--out", help="plan file (default: the cache's plans/ folder, where --method auto looks)")
    pl.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    pl.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.out and Path(args.out).is_dir():  # (found out only when saving, after minutes of measuring)
        raise ValueError(f"--out names the plan's file, and {args.out} is a folder")
    warn_if_busy("the plan")
    if args.draft == "none" or zoo.same_tokenizer(args.target, args.draft) is False:
        if args.draft != "none":  # (SmolLM2 had no zoo draft of its tokenizer, so it could not be planned at all)
            print(f"mirrorsd: {args.draft} does not share {args.target}'s tokenizer: planning the methods without a "
                  "draft model (what --method auto then chooses among)", file=sys.stderr, flush=True)
        args.draft = None
    load = dict(weights=args.weights, activations=args.activations, device=args.device, dtype=args.dtype)
    target = mirrorsd.load_model(args.target, **load)
    if not windows_exact(target.model):
        raise ValueError(f"nothing to plan: in {args.dtype} on a CPU only ar runs exactly (every other method is "
                         "refused there), and --method auto runs it without a plan")
    draft = mirrorsd.load_model(args.draft, **load) if args.draft else None
    prompts = [(q.group, encode_chat(target, [{"role": "user", "content": q.turns[0]}]))
               for q in load_suite(args.suite)]
    plan = make_plan(target, draft, prompts, args.max_new_tokens)
    path = plan.save(Path(args.out) if args.out else None)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    table = Table(title=f"predicted speed on {plan.machine} (Mirror-SD latency law, measured costs and acceptance)")
    for col in ("rank", "configuration", "tokens/step", "step ms", "predicted tok/s"):
        table.add_column(col)
    shown = plan.ranked[: args.top]
    ar = next((r for r in plan.ranked if r["method"] == REFERENCE), None)
    if ar is not None and ar not in shown:
        shown.append(ar)
    for row in shown:
        table.add_row(str(plan.ranked.index(row) + 1), row["label"], f"{row['tokens_per_step']:.2f}",
                      f"{row['step_ms']:.1f}", f"{row['predicted_tokens_per_s']:.2f}")
    Console().print(table)
    print(f"recommended: {plan.recommended['label']} — saved to {path}; `mirrorsd generate --method auto` uses it")
    return 0
