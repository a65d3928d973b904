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


def run(args: argparse.Namespace) -> int:
    """The subcommand named: list or prepare."""
    return {"list": _list, "prepare": _prepare}[args.models_command](args)
