"""What several commands share: the help formatter, number and list parsing, checking method options before any
model loads, loading the draft, and the notes on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mirrorsd
from mirrorsd import zoo
from mirrorsd.api import SELF_DRAFT, self_draft
from mirrorsd.decoding import ModelShape, get_method
from mirrorsd.errors import OptionError
from mirrorsd.runtime import load
from mirrorsd.sampling import SamplingParams

from .args import DEFAULT_DRAFT, flag_dest, method_flags


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where there is a default and the help does not state it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "(default" in text:  # (0 == False: 0 is shown)
            return text
        return super()._get_help_string(action)


def number(text: str) -> int | float:
    """An int when it is one (a layer index), else a float (a fraction of the depth)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse_csv(text: str, cast=str) -> list:
    """The comma-separated values of a flag, each cast; empty items dropped."""
    try:
        return [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected a comma-separated list, got {text!r}") from None


def training_dtype(choice: str, device: str) -> str:
    """``--dtype auto`` of the trainers: bf16 only where the hardware multiplies it (else it is 3x slower)."""
    if choice != "auto":
        return choice
    import torch

    from mirrorsd import kernels

    return "bfloat16" if torch.device(device).type == "cuda" or kernels.has_bf16_arithmetic() else "float32"


def warn_if_busy(what: str) -> None:
    """Say so on stderr when other processes keep the cores busy: training slows and timings mislead."""
    if (warning := load.busy_warning(load.others_cpu_share(), what)) is not None:
        print(f"mirrorsd: warning: {warning}", file=sys.stderr, flush=True)


def say_loaded(role: str, model, args: argparse.Namespace) -> None:
    """Which format a model loaded with, and whether that was the default (the zoo's gate-picked one)."""
    chosen = "as asked" if args.weights or args.activations else "default"
    if args.activations and model.weights == "fp32":  # (fp32 weights have no quantized layer to take them)
        chosen += f"; --activations {args.activations} does not apply to fp32 weights"
    print(f"mirrorsd: {role} {model.name}: {model.format} ({chosen})", file=sys.stderr, flush=True)


def load_draft(args: argparse.Namespace, target, console):
    """``--draft`` is a zoo name or folder, or ``self:N`` / ``self:F``: the target's first N layers (or that
    fraction of them), sharing its weights."""
    name = args.draft or DEFAULT_DRAFT
    if name.startswith(SELF_DRAFT):
        return self_draft(target, name)
    with console.status(f"loading draft {name}…"):
        draft = mirrorsd.load_model(name, device=args.draft_device or args.device, dtype=args.dtype,
                                    weights=args.weights, activations=args.activations)
    say_loaded("draft", draft, args)
    return draft


def _target_shape(name: str):
    """The target's layer count and vocabulary from its config.json when that is on disk (no loading)."""
    folder = Path(name)
    if not (folder / "config.json").is_file():
        if name not in zoo.ZOO or not zoo.prepared(name):
            return None
        folder = zoo.model_dir(name)
    try:
        cfg = json.loads((folder / "config.json").read_text())
        return ModelShape(int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]))
    except (OSError, KeyError, ValueError):
        return None


def checked_options(args: argparse.Namespace, method: str, by_auto: bool = False, serving: bool = False) -> dict:
    """The method's options from the flags, validated before any model loads; errors name the flag. ``by_auto``:
    ``method`` is what ``--method auto`` chose, so a flag it does not take says so, and ``--draft`` (with
    ``--draft-device``) only keys the plan. ``serving``: ``method`` is a server's default, and its ``--draft`` (with
    ``--draft-device``) also serves the methods requests pick."""
    flags = {f: uses for f, uses in method_flags().items() if getattr(args, flag_dest(f)) is not None}
    values: dict[str, str] = {}
    for flag, uses in flags.items():
        mine = [o for m, o in uses if m.name == method]
        if method != "auto" and not mine:
            users = ", ".join(m.name for m, _ in uses)
            chosen = (f", which --method auto chose from this machine's plan for the pair; name a method with "
                      f"--method to use {flag}") if by_auto else ""
            raise ValueError(f"{flag} does not apply to --method {method} (it is an option of: {users}){chosen}")
        name = mine[0].name if mine else uses[0][1].name
        values[name] = getattr(args, flag_dest(flag))
    # (every flag of the method, not only those given: a required one missing is named as its flag too)
    to_flag = {o.name: f for f, uses in method_flags().items() for m, o in uses if m.name == method}
    to_flag.update({o.name: f for f, uses in flags.items() for m, o in uses if method == "auto"})
    to_flag.update(temperature="--temperature", top_k="--top-k", top_p="--top-p", max_new_tokens="--max-new-tokens")
    if args.draft_device and (args.draft or "").startswith(SELF_DRAFT):  # (the flag did nothing: it stays there)
        raise ValueError(f"--draft-device does not apply to --draft {args.draft}: a self draft is the target's own "
                         "first layers, on the target's device")
    try:
        SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        if getattr(args, "max_new_tokens", 1) < 1:
            raise OptionError("max_new_tokens", f"must be >= 1, got {args.max_new_tokens}")
        if method == "auto":  # no plan yet: each value checked by a method that takes it; the plan picks after
            for uses in flags.values():
                owner, opt = uses[0]
                owner.options.parse({opt.name: values[opt.name]}, owner.name, _target_shape(args.target))
            return values
        spec = get_method(method)
        options = spec.options.parse(values, method, _target_shape(args.target))
    except OptionError as e:
        raise ValueError(f"{to_flag.get(e.option, e.option)} {e.message}") from None
    if not spec.needs_draft and not by_auto:
        if args.draft and not serving:
            raise ValueError(f"--draft does not apply to --method {method} (it drafts without a draft model)")
        if args.draft_device and not (serving and args.draft):
            raise ValueError(f"--draft-device does not apply to --method {method} (it uses no draft model)")
    return {k: getattr(options, k) for k in values}
