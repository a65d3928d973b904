"""``mirrorsd models list|prepare``: the offline model zoo."""

from __future__ import annotations

import argparse
import io
import json

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from mirrorsd import zoo

from .args import COMMANDS


def register(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help=COMMANDS["models"], description="List and prepare zoo models.")
    m.set_defaults(func=run)
    msub = m.add_subparsers(dest="models_command", required=True)
    ml = msub.add_parser("list", help="zoo models, whether installed and prepared")
    ml.add_argument("--json", action="store_true")
    mp = msub.add_parser("prepare", help="assemble, verify and convert a zoo model into the cache (once)")
    mp.add_argument("names", nargs="+", metavar="NAME")
    pp = msub.add_parser("params", help="extra parameters of each shipped stream adapter against Medusa heads (the "
                         "Speculative Streaming paper's Table 1 column)",
                         description="Extra parameters of each zoo model's shipped Speculative Streaming adapter, "
                         "read from the file, against Medusa heads for the same model (one residual block and an LM "
                         "head per head, as the paper's baseline). 'paper counting' is what the paper's column "
                         "counts: stream embeddings and the pruning adapter, not the LoRA its baseline has too.")
    pp.add_argument("--heads", type=int, default=4, help="Medusa heads (the paper: 4) (default: %(default)s)")
    pp.add_argument("--json", action="store_true")


def _list(args: argparse.Namespace) -> int:
    rows = zoo.list_models()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
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


def _prepare(args: argparse.Namespace) -> int:
    for name in args.names:
        print(zoo.prepare(name))
    return 0


def _params(args: argparse.Namespace) -> int:
    from mirrorsd.decoding.streams.adapters import extra_parameters, medusa_parameters, shipped_adapter

    rows = []
    for name in zoo.ZOO:
        folder = shipped_adapter(name)
        if folder is None:
            continue
        config = json.loads((folder / "stream_config.json").read_text())
        h, v = config["hidden_size"], config["vocab_size"]
        parts = extra_parameters(folder)
        paper, medusa = parts["stream_embed"] + parts["prune"], medusa_parameters(h, v, args.heads)
        rows.append({"model": name, "hidden": h, "vocab": v, "streams": config["streams"], **parts,
                     "ss_paper_counting": paper, "ss_with_lora": paper + parts["lora"], "medusa_heads": args.heads,
                     "medusa": medusa, "medusa_over_ss": round(medusa / paper),
                     "medusa_over_ss_with_lora": round(medusa / (paper + parts["lora"]), 1)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"| model | h | v | streams | SS, paper counting | SS with its LoRA | Medusa, {args.heads} heads "
          "| Medusa ÷ SS | Medusa ÷ SS with LoRA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['hidden']} | {r['vocab']} | {r['streams']} | {r['ss_paper_counting']:,} "
              f"| {r['ss_with_lora']:,} | {r['medusa']:,} | {r['medusa_over_ss']:,}× "
              f"| {r['medusa_over_ss_with_lora']}× |")
    return 0


def run(args: argparse.Namespace) -> int:
    """The subcommand named: list, prepare or params."""
    return {"list": _list, "prepare": _prepare, "params": _params}[args.models_command](args)
