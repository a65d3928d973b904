"""Every ``mirrorsd`` command in the README and ``docs/`` parses: its flags exist and its method specs name methods
and options the registry takes, so a page's "reproduce" commands do not drift from the CLI they document."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from mirrorsd.bench.runner import parse_methods
from mirrorsd.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A synopsis ("[--gamma G]", "..."), a shell variable or a placeholder is not a command one can run as written.
NOT_RUNNABLE = ("[--", "...", "$", "LINKS_TO")


def _shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks tagged bash/sh/shell/console or untagged (fences pair up in order)."""
    blocks, body, tag = [], None, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if body is None:
                body, tag = [], line.strip()[3:].strip()
            else:
                if tag in ("", "bash", "sh", "shell", "console"):
                    blocks.append("\n".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def commands(page: Path) -> list[str]:
    """The arguments after ``mirrorsd`` (or ``python -m mirrorsd``) in the page's shell code blocks, with line
    continuations joined and anything after a pipe, redirection, ``&&``, ``;``, ``&`` or comment cut off."""
    found = []
    for block in _shell_blocks(page.read_text(encoding="utf-8")):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            line = line.strip()
            match = re.search(r"(?:^|[;&|(]\s*|\s)(?:python3? -m |-m )?mirrorsd(?:\.cli)?\s+(\S.*)", line)
            if line.startswith("#") or not match:
                continue
            command = re.split(r"\s(?:&&|\|\||\||;|>|2>|#|&$)", match.group(1))[0]
            if not any(t in command for t in NOT_RUNNABLE) and command.split()[0] in COMMANDS:
                found.append(command)
    return found


CASES = [(page.name, command) for page in PAGES for command in commands(page)]


def test_the_pages_hold_commands():
    assert len(CASES) > 90 and {"README.md", "server.md", "mirror_sd.md"} <= {page for page, _ in CASES}


@pytest.mark.parametrize("page, command", CASES, ids=[f"{p}:{i}" for i, (p, _) in enumerate(CASES)])
def test_a_documented_command_parses(page, command):
    argv = shlex.split(command)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser([argv[0]]).parse_args(argv)
    except SystemExit as e:
        assert not e.code, f"{page}: `mirrorsd {command}`: {err.getvalue().strip()}"
        return  # --help
    if isinstance(getattr(args, "methods", None), str):
        parse_methods(args.methods)
