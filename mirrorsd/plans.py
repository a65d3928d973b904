"""Saved plans: where `mirrorsd plan` writes its recommendation and ``method="auto"`` reads it (below the API,
so the API never imports the benchmark layer: the package installs the planner with :func:`set_planner`)."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .cache import cache_dir

Planner = Callable[[Any, Any], dict[str, Any]]  # (target, draft) loaded models -> the saved plan's dict
_planner: Planner | None = None


def plan_path(target: str, draft: str | None) -> Path:
    safe = lambda s: "".join(c if c.isalnum() or c in "._-" else "_" for c in s)  # noqa: E731
    return cache_dir() / "plans" / f"{safe(target)}__{safe(draft or 'none')}.json"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_label() -> str:
    """What a plan's costs were measured on: the CPU, the thread count and the kernel build. A plan made elsewhere (a
    cache folder copied to another machine, a VM moved to another host type) prices the methods for that machine,
    not this one. The build is named because CPUs of one name differ in it (an "AMD EPYC" VM may have AVX-512 or
    only AVX2), and it changes the k-token curve that decides between drafting and `ar`."""
    from .kernels import isa_label

    return f"{cpu_name()}, {torch.get_num_threads()} threads, {isa_label()} kernels"


def _made_here(plan: dict[str, Any]) -> bool:
    return plan.get("machine") == machine_label()


def set_planner(planner: Planner | None) -> None:
    """What :func:`plan_for` runs when no plan is saved yet (``mirrorsd`` installs the quick planner)."""
    global _planner
    _planner = planner


def load_plan(target: str, draft: str | None) -> dict[str, Any]:
    path = plan_path(target, draft)
    if not path.is_file():
        raise FileNotFoundError(f"no saved plan for target {target} and draft {draft} on this machine ({path}); "
                                f"run `mirrorsd plan --target {target} --draft {draft}` first")
    return json.loads(path.read_text())


def saved_recommendation(target: str, draft: str | None) -> dict[str, Any] | None:
    """The saved plan's pick for this pair (method, options, label), or None when there is no plan made on this
    machine yet: lets the CLI resolve ``auto`` and check its flags before any model loads."""
    path = plan_path(target, draft)
    if not path.is_file():
        return None
    plan = json.loads(path.read_text())
    return plan["recommended"] if _made_here(plan) else None


def plan_for(target: Any, draft: Any) -> dict[str, Any]:
    """The saved plan for this pair, or, on first use on this machine, a quick one made now and saved (said on
    stderr)."""
    draft_name = draft.name if draft is not None else None
    path = plan_path(target.name, draft_name)
    if _planner is None:
        return load_plan(target.name, draft_name)
    if path.is_file():
        plan = load_plan(target.name, draft_name)
        if _made_here(plan):
            return plan
        why = f"the saved plan was made on {plan.get('machine', 'an unnamed machine')}, this is {machine_label()}"
    else:
        why = "no plan on this machine yet"
    print(f"mirrorsd: {target.name} + {draft_name or 'no draft'}: {why}: planning briefly (1-2 minutes) and saving "
          f"it to {path}; `mirrorsd plan` plans more thoroughly", file=sys.stderr, flush=True)
    return _planner(target, draft)
