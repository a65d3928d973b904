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


def setup_of(target: Any, draft: Any) -> dict[str, str]:
    """What else a plan's costs and acceptance were measured with: the loaded formats, their float type where not
    fp32, and the device (an fp32 plan prices q4's default badly, a float32 one bfloat16's k-curve, a CPU plan a
    GPU's)."""
    device = getattr(getattr(target, "model", target), "device", "cpu")

    def loaded(model: Any) -> str:
        dtype = getattr(getattr(model, "model", model), "dtype", torch.float32)
        return str(getattr(model, "format", "?")) + ("" if dtype == torch.float32 else
                                                      f", {str(dtype).removeprefix('torch.')}")

    return {"target": loaded(target), "device": str(device), "draft": "none" if draft is None else loaded(draft)}


def describe_setup(setup: dict[str, str], draft: bool = True) -> str:
    """``setup_of``'s record as the messages say it: "target q4 on cpu, draft q8" (``draft`` False: the target's
    part alone)."""
    text = f"target {setup.get('target', '?')} on {setup.get('device', '?')}"
    return f"{text}, draft {setup.get('draft', '?')}" if draft else text


def _readable(path: Path) -> dict[str, Any] | None:
    """The plan at ``path`` if it still names a method and options this code takes, else None (cut short, hand
    edited, or older than a method or option it names): `auto` then plans again instead of failing on it."""
    from .decoding import get_method

    try:
        plan = json.loads(path.read_text())
        if not isinstance(plan.get("setup", {}), dict):  # an older plan's setup, one string: measure it again
            return None
        pick = plan["recommended"]
        get_method(pick["method"]).options.parse(pick["options"], pick["method"])
    except (OSError, ValueError, KeyError, TypeError):  # (OptionError is a ValueError)
        return None
    return plan


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
    plan = _readable(path) if path.is_file() else None
    return plan["recommended"] if plan is not None and _made_here(plan) else None


def measured_otherwise(target_name: str, draft_name: str | None, target: Any) -> str | None:
    """What the saved plan measured, where its target's format or device is not the loaded ``target``'s (the CLI
    resolves `auto` from the plan before loading, when the loaded format is not known yet), else None."""
    path = plan_path(target_name, draft_name)
    plan = _readable(path) if path.is_file() else None
    if plan is None or not plan.get("setup"):
        return None
    mine, saved = setup_of(target, None), plan["setup"]
    if (saved.get("target"), saved.get("device")) == (mine["target"], mine["device"]):
        return None
    return describe_setup(saved)


def plan_for(target: Any, draft: Any) -> dict[str, Any]:
    """The saved plan for this pair, or, on first use on this machine, a quick one made now and saved (said on
    stderr)."""
    draft_name = draft.name if draft is not None else None
    path = plan_path(target.name, draft_name)
    if _planner is None:
        return load_plan(target.name, draft_name)
    if path.is_file():
        plan = _readable(path)
        setup = setup_of(target, draft)
        if plan is None:
            why = "the saved plan is unreadable, older than this version's plans, or names a method or option it lacks"
        elif not _made_here(plan):
            why = f"the saved plan was made on {plan.get('machine', 'an unnamed machine')}, this is {machine_label()}"
        elif plan.get("setup", setup) != setup:
            why = f"the saved plan was made for {describe_setup(plan['setup'])}, this is {describe_setup(setup)}"
        else:
            return plan
    else:
        why = "no plan on this machine yet"
    print(f"mirrorsd: {target.name} + {draft_name or 'no draft'}: {why}: planning briefly (1-2 minutes) and saving "
          f"it to {path}; `mirrorsd plan` plans more thoroughly", file=sys.stderr, flush=True)
    return _planner(target, draft)
