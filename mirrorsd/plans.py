"""Saved plans: where `mirrorsd plan` writes its recommendation and ``method="auto"`` reads it (below the API,
so the API never imports the benchmark layer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .cache import cache_dir


def plan_path(target: str, draft: str | None) -> Path:
    safe = lambda s: "".join(c if c.isalnum() or c in "._-" else "_" for c in s)  # noqa: E731
    return cache_dir() / "plans" / f"{safe(target)}__{safe(draft or 'none')}.json"


def load_plan(target: str, draft: str | None) -> dict[str, Any]:
    path = plan_path(target, draft)
    if not path.is_file():
        raise FileNotFoundError(f"no saved plan for target {target} and draft {draft} on this machine ({path}); "
                                f"run `mirrorsd plan --target {target} --draft {draft}` first")
    return json.loads(path.read_text())
