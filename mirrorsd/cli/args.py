"""The flags several commands take, declared once: each command picks the ones it needs, in its own order, with
its own help and default where the meaning differs (`bench perplexity --weights` is a list, `generate --weights`
one format)."""

from __future__ import annotations

import argparse
import math

from mirrorsd.decoding import methods
from mirrorsd.loading import WEIGHT_FORMATS
from mirrorsd.model import ACTIVATION_FORMATS

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"

#: Every command's one-line help, in the order `mirrorsd --help` lists them: the top-level parser is built from
#: this table alone, so that listing the commands imports none of their modules.
COMMANDS = {
    "generate": "generate text (AR or speculative)",
    "serve": "an OpenAI-compatible HTTP server (chat, completions, SSE streaming, metrics, a chat page)",
    "train-streams": "train Speculative Streaming adapters (lossless mode) on offline text",
    "train-draft": "distil a draft toward its target: low-rank deltas on its top layers, on the target's answers",
    "train-eagle": "train an EAGLE-3-style draft head (one layer over the target's own features) on its answers",
    "train-exit": "fit a tuned early exit (Mirror-SD's --exit-head tuned) on offline text, in closed form",
    "distill": "a model's own answers to ~30k prompts of our own making, batched, in resumable token shards",
    "bench": "Spec-Bench runner with peers in the same run; sweeps; costs",
    "plan": "measure this machine and recommend a configuration",
    "methods": "the decoding methods and their options",
    "models": "the offline model zoo",
}

MODEL_HELP = "zoo model name or local HF folder"
_SAMPLING_TYPES = {"temperature": float, "top_k": int, "top_p": float, "seed": int, "max_new_tokens": int}


def add_pair(p: argparse.ArgumentParser, draft_help: str | None = None, self_drafts: bool = True,
             also: str = "") -> None:
    """``--target`` and ``--draft``; with ``draft_help`` the draft has no default: the command picks one;
    ``self_drafts``: the command takes the target's own first layers (``self:N``) as a draft; ``also``: what else
    ``--draft`` takes."""
    p.add_argument("--target", default=DEFAULT_TARGET, help=MODEL_HELP)
    own = ", or self:N / self:F: the target's first N layers (or that fraction of them)" if self_drafts else ""
    p.add_argument("--draft", default=None if draft_help else DEFAULT_DRAFT,
                   help=draft_help or f"{MODEL_HELP}, a tuned draft's folder (`mirrorsd train-draft`){own}{also}")


def add_model(p: argparse.ArgumentParser, required: bool = False) -> None:
    """``--model``: the one model a trainer fits (required) or a measurement runs (default: the target)."""
    p.add_argument("--model", required=required, default=None if required else DEFAULT_TARGET, help=MODEL_HELP)


def add_method(p: argparse.ArgumentParser, help: str) -> None:
    """``--method``: every registered method, or auto."""
    p.add_argument("--method", choices=[*(m.name for m in methods()), "auto"], help=help)


def add_weights(p: argparse.ArgumentParser, help: str = "weight format (default: as generate)", **kwargs) -> None:
    """``--weights``: one of the formats unless ``kwargs`` say otherwise (``choices=None`` for a list)."""
    p.add_argument("--weights", **{"choices": WEIGHT_FORMATS, **kwargs}, help=help)


def add_formats(p: argparse.ArgumentParser, weights: str = "weight format (default: as generate)",
                activations: str = "activation precision (default: as generate)",
                defaults: tuple[str | None, str | None] = (None, None)) -> None:
    """``--weights`` and ``--activations``, for the commands that take both (always side by side)."""
    add_weights(p, weights, default=defaults[0])
    p.add_argument("--activations", choices=ACTIVATION_FORMATS, default=defaults[1], help=activations)


def add_dtype(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--dtype`` of the commands that run our models and the peers in any torch float type."""
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help=help)


def add_sampling(p: argparse.ArgumentParser, **flags: tuple[object, str]) -> None:
    """Sampling and length flags as ``name=(default, help)``, in the order given: each command has its own defaults
    (serve takes OpenAI's temperature 1, bench Spec-Bench's greedy 0) and lists them in its own order."""
    for name, (default, help) in flags.items():
        p.add_argument("--" + name.replace("_", "-"), type=_SAMPLING_TYPES[name], default=default, help=help)


# -- method options: the flags come from the registry ----------------------------------------------------------


def flag_dest(flag: str) -> str:
    return "opt_" + flag.lstrip("-").replace("-", "_")


def method_flags() -> dict[str, list[tuple[object, object]]]:
    """CLI flag -> [(method, option)] over every registered method (methods may share a flag: ``--gamma``)."""
    flags: dict[str, list[tuple[object, object]]] = {}
    for method in methods():
        for opt in method.options.fields():
            flags.setdefault(opt.flag, []).append((method, opt))
    return flags


def add_method_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option name; the help says which methods use it and each one's default."""
    group = parser.add_argument_group("method options (`mirrorsd methods` lists them; a flag another method uses "
                                      "is refused)")
    for flag, uses in method_flags().items():
        first = uses[0][1]
        defaults = ", ".join(f"{m.name}: {o.shown_default}" for m, o in uses)
        choices = first.choices if all(o.choices == first.choices for _, o in uses) else None
        kwargs = {"dest": flag_dest(flag), "metavar": first.metavar or (None if choices else "VALUE"),
                  "help": f"{first.help} [{'/'.join(m.name for m, _ in uses)}] (default: {defaults})"}
        if choices:
            kwargs["choices"] = [str(c) for c in choices]
        if first.const is not None:
            kwargs.update(nargs="?", const=first.const)
        group.add_argument(flag, **kwargs)


def count(least: int):
    """An argparse type: an integer of at least ``least`` (a count of steps, chunks, tokens...), refused at parse
    time, before any model loads, instead of failing as a division by zero after the caches are built."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}")
        return value
    return parse


def positive(text: str) -> float:
    """An argparse type: a finite number > 0 (a learning rate), refused before the caches are built."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def add_training(p: argparse.ArgumentParser, *, seq_len: int, lr: float, held_out: int, measured: str,
                 trained: str) -> None:
    """The state-cache trainers' flags (``train-streams``, ``train-draft``): steps over cached chunks, the
    restricted training head, the precision of the frozen tower; ``measured``: what held-out chunks measure,
    ``trained``: what stays fp32."""
    p.add_argument("--steps", type=count(0), default=200, help="optimizer steps (one chunk each)")
    p.add_argument("--chunks", type=count(1), help="training chunks to cache (default: --steps, at most 10000); "
                                              "steps beyond it start further epochs")
    p.add_argument("--seq-len", type=count(2), default=seq_len, help="tokens per training chunk")
    p.add_argument("--lr", type=positive, default=lr, help="AdamW learning rate (linear warmup and decay)")
    p.add_argument("--held-out", type=count(1), default=held_out,
                   help=f"chunks kept out of training to measure {measured}")
    p.add_argument("--vocab", type=count(0), default=32768,
                   help="train on the N most frequent token ids of the tokenizer's shipped table (0: all; "
                        f"held-out {measured} always uses the full vocabulary)")
    p.add_argument("--eval-every", type=count(1), default=50,
                   help="steps between held-out points of the learning curve")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help=f"precision of the frozen weights the {trained} are trained through ({trained} stay "
                        "fp32); auto: bfloat16 on CUDA and on CPUs with bf16 arithmetic (AVX-512 BF16, AMX), else "
                        "float32")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    p.add_argument("--seed", type=int, default=0, help="data order and initialisation")

