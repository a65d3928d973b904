"""The planner: measure what each piece of a decoding step costs on this machine, predict every method's speed
with the Mirror-SD latency law (the paper's Eq. 10) and measured acceptance, and recommend a configuration.

Costs (median ms, interleaved rounds, after ``context`` cached tokens): the target's k-token forward ``T(k)``
(LM head on every row, as verification needs), its prefix ``P_ℓ(k)`` (layers below each candidate exit layer),
the early-exit head with top-κ ``EE(k)``, and the draft's k-row forward ``D(k)`` (a chain, or k tree roots in
one forward). Per decoding step (``w`` = window + 1 tokens verified, γ draft steps, ``R`` rollout roots):

* ``ar``: ``T(1)`` per token.
* ``sd``: ``γ·D(1) + T(γ+1)`` (draft, then verify: the two are serial). ``D`` is timed with the draft's full LM
  head and with the reduced one ``sd`` drafts with by default (``draft_vocab``); each method reads the one its
  options ask for.
* ``mirror``: ``P_ℓ(w) + EE(w) + max(Δ, γ·D(R)) + f·γ·D(1)`` with ``Δ = T(w) − P_ℓ(w)`` — Eq. 10 with the
  rendezvous folded into EE — plus the exposed fresh rollout after a miss (fallback frequency ``f``), which
  Eq. 10 leaves out. The ``serial`` backend adds Δ and the rollout instead of overlapping them; ``threads``
  uses costs measured with the cores split between target and draft (each alone: contention for memory
  bandwidth while both run is not in the model, so this is an upper bound).
* ``suffix``, the ``sd`` hybrid (``suffix_match``) and ``sd`` as it ships (hybrid, model gate, reduced head):
  acceptance depends on how much the text repeats, and the gate on measured speed, so these are priced by running
  them briefly on the calibration prompts and adding up their recorded steps with
  the method's cost model (a suffix window costs its verification ``T(w)`` only).
* ``ss``: a pass runs the whole tree (``n`` nodes) through the bottom layers, and the ``m`` nodes kept by pruning
  with their ``m·γ_s`` stream rows through the top ``N_s``: ``(1 − N_s/N)·T(n) + (N_s/N)·T(m·(1 + γ_s))``.

Tokens per step come from measured acceptance: E[A](γ) = Σ_i Π_{j≤i} p_j from the probe's per-position
acceptance, and fallback frequencies per κ × ℓe from the probe's exit ranks (see :mod:`.probe`).

The recommendation is ``ar`` unless a candidate is predicted at least ``MARGIN`` faster: ``auto`` must never
lose to plain decoding because of a prediction error.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..api import ZooFiles, generate
from ..decoding import REFERENCE, Priced, get_method, methods
from ..decoding.drafting import draft_vocab_size
from ..decoding.suffix_index import isolated_shared_indexes
from ..draft_vocab import draft_table_kind, subset_head
from ..model import Transformer
from ..plans import machine_label, plan_path, setup_of
from ..runtime.executors import split_threads
from ..runtime.trace import synchronize
from .metrics import expected_accepted

TARGET_KS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DRAFT_KS = (1, 2, 4, 8, 16, 32, 64, 128)
MARGIN = 1.1  # predicted speed over ar's that a recommendation needs


@dataclass
class Costs:
    """Milliseconds per forward piece, keyed by row count (and exit layer for the prefix)."""

    context: int
    threads: int
    target_ms: dict[int, float]
    prefix_ms: dict[int, dict[int, float]]  # exit layer -> k -> ms of layers [0, ℓe)
    exit_head_ms: dict[int, float]
    draft_ms: dict[int, float]
    split: dict[str, Any] | None = None  # the same tables measured with (target, draft) threads split
    # The draft's forwards with the reduced LM head a ``draft_vocab`` option of None picks (sd's default): a
    # 32k head makes the 0.5B's forward ~25% cheaper, which the full-head table would hide from the ranking.
    default_draft_vocab: int = 0
    draft_vocab_ms: dict[int, dict[int, float]] = field(default_factory=dict)  # vocabulary size -> k -> ms
    # The draft's forward over k rows that reads the logits of the last only, as its first forward of a window
    # reads what its cache lacked (the prompt, on the first step): with the head on every row (draft_ms) a 128-token
    # read was priced 1.5x on SmolLM2's 49k-token head.
    draft_read_ms: dict[int, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Costs:
        ints = lambda t: {int(k): v for k, v in t.items()}  # noqa: E731 (JSON keys are strings)
        split = d.get("split")
        if split:
            split = {**split, "target_ms": ints(split["target_ms"]), "draft_ms": ints(split["draft_ms"]),
                     "prefix_ms": {int(e): ints(t) for e, t in split["prefix_ms"].items()}}
        return cls(d["context"], d["threads"], ints(d["target_ms"]),
                   {int(e): ints(t) for e, t in d["prefix_ms"].items()}, ints(d["exit_head_ms"]),
                   ints(d["draft_ms"]), split, d.get("default_draft_vocab", 0),  # plans saved before: full head
                   {int(v): ints(t) for v, t in d.get("draft_vocab_ms", {}).items()},
                   ints(d.get("draft_read_ms", {})))

    # What a method's cost model reads (mirrorsd.decoding.registry.CostTable), in ms.
    def target(self, rows: float) -> float:
        return interpolate(self.target_ms, rows)

    def draft(self, rows: float, vocab: int | None = 0) -> float:
        """The draft's forward over ``rows`` with the head a ``draft_vocab`` option asks for (None: the default);
        a vocabulary without a measured table is priced with the full head (an upper bound)."""
        size = self.default_draft_vocab if vocab is None else vocab
        return interpolate(self.draft_vocab_ms.get(size, self.draft_ms), rows)

    def draft_read(self, rows: float, vocab: int | None = 0) -> float:
        """The draft's forward over ``rows`` that reads the last row's logits only (the first forward of a window,
        a prompt prefill), with the head ``vocab`` asks for on that row; without a reading table, :meth:`draft`."""
        if not self.draft_read_ms or rows <= 1:
            return self.draft(max(rows, 1), vocab)
        return interpolate(self.draft_read_ms, rows) - interpolate(self.draft_ms, 1) + self.draft(1, vocab)

    def prefix(self, exit_layer: int, rows: float) -> float:
        return interpolate(self.prefix_ms[exit_layer], rows)

    def exit_head(self, rows: float) -> float:
        return interpolate(self.exit_head_ms, rows)

    def for_backend(self, backend: str) -> Costs:
        """Costs for a backend: split-thread tables for ``threads`` and ``processes`` (the same core split) when
        measured, else these."""
        if backend not in ("threads", "processes") or not self.split:
            return self
        s = self.split
        # The reduced heads' tables are not measured split: each scaled by the whole draft's split slowdown at that
        # row count (without them the split draft was priced with the full head, biasing threads against serial).
        slowdown = {k: s["draft_ms"][k] / ms for k, ms in self.draft_ms.items() if k in s["draft_ms"] and ms > 0}
        vocab_ms = {v: {k: ms * slowdown[k] for k, ms in table.items() if k in slowdown}
                    for v, table in self.draft_vocab_ms.items()}
        return Costs(self.context, self.threads, s["target_ms"], s["prefix_ms"], self.exit_head_ms, s["draft_ms"],
                     default_draft_vocab=self.default_draft_vocab,
                     draft_vocab_ms={v: t for v, t in vocab_ms.items() if t},
                     draft_read_ms={k: ms * slowdown[k] for k, ms in self.draft_read_ms.items() if k in slowdown})


def interpolate(table: dict[int, float], k: float) -> float:
    """Piecewise-linear in k through the measured points, extended linearly past the ends."""
    ks = sorted(table)
    if k in table:
        return table[int(k)]
    if len(ks) == 1:
        return table[ks[0]] * k / ks[0]
    lo, hi = (ks[0], ks[1]) if k < ks[0] else (ks[-2], ks[-1]) if k > ks[-1] else next(
        (a, b) for a, b in zip(ks, ks[1:], strict=False) if a <= k <= b)
    return table[lo] + (table[hi] - table[lo]) * (k - lo) / (hi - lo)


# -- measuring ------------------------------------------------------------------------------------------------


def _median_ms(fn, rounds: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)  # CUDA runs asynchronously: time the work, not its launch
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def _tables(model: Transformer, ks: Sequence[int], exit_layers: Sequence[int], context: int, rounds: int,
            heads: bool, lm_head: nn.Module | None = None, last: int | None = None) -> tuple[dict, dict, dict]:
    g = torch.Generator().manual_seed(0)
    vocab, device = model.config.vocab_size, model.device
    cache = model.new_cache(capacity=context + max(ks) + 1)
    model.prefill(torch.randint(0, vocab, (1, context), generator=g).to(device), cache)
    full, prefix, head = {}, {e: {} for e in exit_layers}, {}
    probes = [m.exit_probe(model) for m in methods() if m.exit_probe is not None] if heads else []
    for k in ks:
        x = torch.randint(0, vocab, (1, k), generator=g).to(device)
        positions = torch.arange(context, context + k, device=device)[None]

        def forward(x=x):
            model(x, cache=cache, head=lm_head, last=last)
            cache.truncate(context)

        full[k] = _median_ms(forward, rounds, device)
        for e in exit_layers:
            def pre(x=x, positions=positions, e=e):
                model.run_layers(model.embed(x), positions, cache, end=e)
                cache.truncate(context)

            prefix[e][k] = _median_ms(pre, rounds, device)
        if probes:  # (one method reads an early exit: its cost row)
            head[k] = _median_ms(partial(probes[0], model.embed(x)), rounds, device)
    return full, prefix, head


def measure_costs(target: Transformer, draft: Transformer | None, exit_layers: Sequence[int], context: int = 256,
                  rounds: int = 5, target_ks: Sequence[int] = TARGET_KS, draft_ks: Sequence[int] = DRAFT_KS,
                  split: tuple[int, int] | None = None) -> Costs:
    """Time the pieces (see the module docstring); ``split=(T, D)`` also times them with T target and D draft
    threads, the way the ``threads`` backend runs them."""
    threads = torch.get_num_threads()
    full, prefix, head = _tables(target, target_ks, exit_layers, context, rounds, heads=True)
    draft_ms = _tables(draft, draft_ks, (), context, rounds, heads=False)[0] if draft is not None else {}
    read_ms = _tables(draft, [k for k in draft_ks if k > 1], (), context, rounds, heads=False, last=1)[0] \
        if draft is not None else {}
    vocab = draft_vocab_size(None, draft) if draft is not None else 0
    draft_vocab_ms = {vocab: _tables(draft, draft_ks, (), context, rounds, heads=False,
                                     lm_head=subset_head(draft, vocab, draft_table_kind(draft.config.vocab_size)))[0]
                      } if vocab else {}
    split_tables = None
    if split and draft is not None:
        try:
            torch.set_num_threads(split[0])
            s_full, s_prefix, _ = _tables(target, target_ks, exit_layers, context, rounds, heads=False)
            torch.set_num_threads(split[1])
            s_draft = _tables(draft, draft_ks, (), context, rounds, heads=False)[0]
        finally:
            torch.set_num_threads(threads)
        split_tables = {"threads": list(split), "target_ms": s_full, "prefix_ms": s_prefix, "draft_ms": s_draft}
    return Costs(context, threads, full, prefix, head, draft_ms, split_tables, vocab, draft_vocab_ms, read_ms)


# -- the latency law ------------------------------------------------------------------------------------------


def turn_time(costs: Costs, kind: str, steps: Sequence[dict[str, Any]], prefill_s: float,
              options: dict[str, Any]) -> float | None:
    """Predicted seconds for a measured turn: its measured prefill plus the method's cost model (registered
    with the method) over its recorded steps; None for methods without one."""
    if kind not in {m.name for m in methods()}:
        return None  # a peer
    method = get_method(kind)
    if method.step_cost is None:
        return None
    opts = method.options.parse(options, kind)
    return prefill_s + sum(method.step_cost(costs, step, opts) for step in steps) / 1e3


# -- recommending ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate(Priced):
    """A method's priced configuration (:class:`~mirrorsd.decoding.registry.Priced`), named."""

    method: str = field(default="", kw_only=True)

    def label(self) -> str:
        return ":".join([self.method, *(f"{k}={v}" for k, v in self.options.items())])


@dataclass
class Measured:
    """What the planner measured, as each method's ``plan`` reads it
    (:class:`~mirrorsd.decoding.registry.PlanInputs`). With ``target`` and ``prompts``, methods whose acceptance
    depends on the text are priced by short runs; without, only the analytic cases are."""

    costs: Costs
    per_position: Sequence[float]
    fallback: Mapping[int, Mapping[int, Mapping[int, float]]]  # by γ, exit layer, κ
    gammas: Sequence[int] = range(1, 9)
    kappas: Sequence[int] = (1, 2, 4, 8)
    backends: Sequence[str] = ("serial", "threads")
    quick: bool = False
    target: Any = None
    draft: Any = None
    prompts: Sequence[list[int]] = ()
    max_new: int = 0

    @property
    def has_draft(self) -> bool:
        return bool(self.costs.draft_ms)

    @property
    def files(self) -> ZooFiles | None:
        return ZooFiles(self.target, self.draft) if self.target is not None else None

    def expected_tokens(self, gamma: int) -> float:
        return expected_accepted(self.per_position, gamma) + 1

    def draft_prefill(self, read: int | None) -> float:
        if self.draft is None or not self.prompts:
            return 0.0
        return statistics.fmean(self.costs.draft_read(min(len(ids), read or len(ids)), None)
                                for ids in self.prompts) / self.max_new

    def calibrated(self, method: str, options: dict[str, Any]) -> Priced | None:
        if self.target is None or not self.prompts or (get_method(method).needs_draft and self.draft is None):
            return None
        c = calibrated(self.target, self.draft, self.prompts, self.max_new, self.costs, method, options)
        return Priced(c.options, c.tokens_per_step, c.step_ms)

    def runs(self, method: str, options: dict[str, Any], prompts: int, max_new: int) -> list[Any]:
        if self.target is None:
            return []
        return [generate(self.target, ids, method=method, max_new_tokens=min(max_new, self.max_new), **options).stats
                for ids in self.prompts[:prompts]]


def candidates(measured: Measured) -> list[Candidate]:
    """Every configuration the methods offer the planner, priced from what was measured."""
    return [Candidate(p.options, p.tokens_per_step, p.step_ms, method=m.name)
            for m in methods() if m.plan is not None for p in m.plan(measured, m)]


def calibrated(target, draft, prompts: Sequence[list[int]], max_new: int, costs: Costs, kind: str,
               options: dict[str, Any]) -> Candidate:
    """A candidate priced from its own short runs: tokens per step as measured, step time from its cost model
    over the recorded steps. Each prompt runs alone, with empty indexes of earlier outputs: a method with a suffix
    lookup would otherwise copy its answer from an earlier calibration run of the same prompt (and a first-use
    ``auto`` plan would leave its answers in, or wipe, the index the process's requests built)."""
    method = get_method(kind)
    opts = method.options.parse(options, kind)
    steps: list[dict[str, Any]] = []
    tokens = 0
    for ids in prompts:
        with isolated_shared_indexes():
            g = generate(target, ids, method=kind, draft=draft if method.needs_draft else None,
                         max_new_tokens=max_new, **options)
        steps += g.stats.step_log
        tokens += g.stats.new_tokens
    ms = sum(method.step_cost(costs, step, opts) for step in steps)
    return Candidate(options, tokens / len(steps), ms / len(steps), method=kind)


def recommend(ranked: Sequence[Candidate], margin: float = MARGIN) -> Candidate:
    """The fastest candidate, unless it is not ``margin`` faster than ``ar``."""
    ar = next(c for c in ranked if c.method == REFERENCE)
    best = max(ranked, key=lambda c: c.tokens_per_s)
    return best if best.tokens_per_s >= margin * ar.tokens_per_s else ar


@dataclass
class Plan:
    target: str
    draft: str | None
    machine: str
    costs: Costs
    probe: dict[str, Any]
    ranked: list[dict[str, Any]] = field(default_factory=list)

    recommended: dict[str, Any] = field(default_factory=dict)
    setup: dict[str, str] = field(default_factory=dict)  # the formats and device it measured (plans.setup_of)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "draft": self.draft, "machine": self.machine, "setup": self.setup,
                "costs": self.costs.to_dict(),
                "probe": self.probe, "recommended": self.recommended, "ranked": self.ranked}

    def save(self, path: Path | None = None) -> Path:
        path = path or plan_path(self.target, self.draft)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path


# -- the plan command -----------------------------------------------------------------------------------------


def make_plan(target, draft, prompts: Sequence[tuple[str, list[int]]], max_new: int = 48,
              progress: bool = True, quick: bool = False) -> Plan:
    """Measure costs, probe acceptance on ``prompts`` ((group, ids) pairs), rank every candidate. ``quick``:
    fewer window sizes and rounds, no split-thread tables and no hybrid runs (``method="auto"``'s first use)."""
    from ..api import shares_tokenizer
    from ..exit_heads import ExitTranslators, shipped_exit
    from .probe import EXITS, run_probe

    if draft is not None and not shares_tokenizer(target, draft):
        raise ValueError(f"draft {draft.name} has a tokenizer of its own: a plan probes the draft's acceptance in the "
                         f"target's token ids, so plan {target.name} with a draft of its tokenizer")
    n = target.config.n_layers
    exits = {name: min(n - 1, max(1, round(f * n))) for name, f in EXITS.items()}
    if progress:
        print("measuring forward costs…", flush=True)
    sizes = dict(rounds=3, target_ks=(1, 2, 4, 8, 16), draft_ks=(1, 2, 4, 8, 16, 32, 64)) if quick else {}
    costs = measure_costs(target.model, draft.model if draft else None, sorted(set(exits.values())),
                          split=None if quick else split_threads(), **sizes)
    # The exit Mirror-SD's priced options run (exit_head "auto"): the target's shipped tuned exit at the layers it
    # has a translator for, the lens elsewhere. The lens's fallback priced a tuned run (0.89 against 0.75 on the
    # Qwen pair at κ = 8, N/2). γ up to the largest priced (a window of 8 was priced with 7's acceptance).
    shipped = shipped_exit(target.name or "")
    tuned = ExitTranslators.load(shipped) if shipped is not None else None
    probe = run_probe(target, draft, prompts, max_new, gamma=max(Measured.gammas), exits=EXITS, progress=progress,
                      tuned=tuned) if draft else None
    per_position = probe.per_position() if probe else []
    fallback = {g: exit_fallback(probe.fallback(gamma=g), exits) for g in Measured.gammas} if probe else {}
    if progress:
        print("pricing the methods (short runs where acceptance depends on the text)…", flush=True)
    # (the threads backend splits a CPU's cores: a GPU's plan would rank a backend it refuses)
    backends = ("serial", "threads") if target.model.device.type == "cpu" else ("serial",)
    found = candidates(Measured(costs, per_position, fallback, quick=quick, target=target, draft=draft,
                                backends=backends, prompts=[ids for _, ids in prompts], max_new=max_new))
    ranked = sorted(found, key=lambda c: -c.tokens_per_s)
    row = lambda c: {"method": c.method, "options": c.options, "label": c.label(),  # noqa: E731
                     "predicted_tokens_per_s": round(c.tokens_per_s, 3),
                     "tokens_per_step": round(c.tokens_per_step, 3), "step_ms": round(c.step_ms, 3)}
    return Plan(target.name, draft.name if draft else None, machine_label(),
                costs, probe.to_dict() if probe else {}, [row(c) for c in ranked],
                row(recommend(ranked)), setup_of(target, draft))


def exit_fallback(rows: Mapping[str, Mapping[int, float]], exits: Mapping[str, int]) -> dict[int, Mapping[int, float]]:
    """Per exit layer, the probe's fallback per κ of the exit a priced Mirror-SD runs there: the tuned one where the
    probe read one (``exit_head="auto"`` takes the shipped tuned exit wherever it has that layer), else the lens."""
    from .probe import TUNED

    return {layer: rows.get(name + TUNED, rows[name]) for name, layer in exits.items() if name in rows}


def quick_plan(target, draft) -> dict[str, Any]:
    """``method="auto"``'s first use: a brief plan on three Spec-Bench prompts, saved where auto looks."""
    from ..api import encode_chat
    from ..specbench import load_suite

    prompts = [(q.group, encode_chat(target, [{"role": "user", "content": q.turns[0]}]))
               for q in load_suite("specbench:1")[:3]]
    plan = make_plan(target, draft, prompts, max_new=24, progress=False, quick=True)
    plan.save()
    return plan.to_dict()
