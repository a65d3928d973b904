"""``mirrorsd methods``: the registered decoding methods and their options, as text or JSON."""

from __future__ import annotations

import argparse
import json

from mirrorsd.decoding import methods

from .args import COMMANDS
from .common import HelpFormatter


def register(sub: argparse._SubParsersAction) -> None:
    me = sub.add_parser("methods", formatter_class=HelpFormatter, help=COMMANDS["methods"],
                        description="Every registered decoding method: whether it needs a draft model, and its "
                        "options with defaults and help (the flags `mirrorsd generate` takes for it and the keys "
                        "`mirrorsd bench --methods KIND:key=value` takes).")
    me.add_argument("--json", action="store_true",
                    help="a JSON list of {name, summary, needs_draft, rejection_sampling, any_draft_tokenizer, "
                    "options}")
    me.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
