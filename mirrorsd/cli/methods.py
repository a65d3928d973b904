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
                        "options with defaults and help: the flags `mirrorsd generate` and `mirrorsd serve` take for "
                        "it; without the dashes, or by the option's name where it differs (shown after the flag; the "
                        "name is what the API and a server request's `mirrorsd` object take), the keys of `mirrorsd "
                        "bench --methods KIND:key=value` and `mirrorsd bench serve --servers mirrorsd:key=value`.")
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
            name = f" ({o['name']})" if o["flag"] != "--" + o["name"].replace("_", "-") else ""
            print(f"  {o['flag']}{name}{choices} (default: {o['default_text']}): {o['help']}")
    return 0
