"""``mirrorsd`` command line: generate text and manage the offline model zoo.

One module per command, each with ``register(subparsers)`` and ``run(args)``. The top-level parser lists every
command from :data:`~mirrorsd.cli.args.COMMANDS` and imports only the module of the command being run, so that
``mirrorsd --help`` loads no command and ``mirrorsd generate`` neither the server nor the benchmarks.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import stat
import sys
import warnings
from collections.abc import Collection

import mirrorsd
from mirrorsd.zoo import ZooError

from .args import COMMANDS, DEFAULT_DRAFT, DEFAULT_TARGET
from .common import warn_if_busy as _warn_if_busy  # noqa: F401 (the tests call cli._warn_if_busy)

__all__ = ["DEFAULT_DRAFT", "DEFAULT_TARGET", "build_parser", "main"]


def _version() -> str:
    try:
        return importlib.metadata.version("mirrorsd")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return getattr(mirrorsd, "__version__", "unknown")


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The parser with the full arguments of ``commands`` (default: all); the others have only their name and
    help, enough for `mirrorsd --help` and for argparse to name the choices."""
    p = argparse.ArgumentParser(
        prog="mirrorsd",
        description="Lossless speculative decoding on real pretrained models, offline.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help in COMMANDS.items():
        if commands is None or name in commands:
            importlib.import_module(f"{__name__}.{name.replace('-', '_')}").register(sub)
        else:
            sub.add_parser(name, help=help)
    return p


_warned: set[str] = set()
_PACKAGE = os.path.dirname(mirrorsd.__file__)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """mirrorsd's own warning, said the way the CLI says its errors ("mirrorsd: warning: ..."), not as a source
    location, and once (options are checked before loading and again by the API after it); other libraries' warnings
    keep Python's form, their source included."""
    if not str(filename).startswith(_PACKAGE):
        print(warnings.formatwarning(message, category, filename, lineno, line), end="", file=file or sys.stderr)
    elif str(message) not in _warned:
        _warned.add(str(message))
        print(f"mirrorsd: warning: {message}", file=file or sys.stderr)


def _stdout_is_a_pipe() -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode)
    except (OSError, ValueError):  # (pytest's captured stdout has no descriptor)
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)  # the top level takes no option values
    args = build_parser([command] if command in COMMANDS else []).parse_args(argv)
    shown, warnings.showwarning = warnings.showwarning, _one_line_warning
    _warned.clear()
    try:
        return args.func(args)
    except BrokenPipeError as e:
        if not _stdout_is_a_pipe():  # another pipe broke: an error like any other
            print(f"mirrorsd: error: {e}", file=sys.stderr)
            return 2
        # `mirrorsd generate ... | head -1`: the reader left; exit quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error when Python flushes)
        return 141
    except (ValueError, ZooError, OSError) as e:  # a user's mistake (a bad value, a missing or unwritable path)
        print(f"mirrorsd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        warnings.showwarning = shown  # (main called in-process, as tests do, leaves the caller's as it was)
