"""Spec-Bench's metrics, reimplemented over our answer records (pure functions, unit-tested).

* **Speedup** (Spec-Bench's ``speed.py``): per run, the mean over questions of a method's per-question speed
  (Σ new tokens ÷ Σ wall time over the question's turns) divided by the same mean for the baseline; per task
  group and over all questions. Across runs we report the median and the spread (min, max).
* **MAT**, mean accepted tokens: the mean over all decoding steps of the tokens one target step commits,
  accepted draft tokens plus the bonus/correction token (1.00 for AR).
* **Per-position acceptance**: among steps that drafted window position i, the share that accepted it.
* Mirror-SD: fallback frequency (misses over steps that rolled out a tree) and hidden-draft fraction (rollout
  time overlapped by the target's suffix over all draft time). SS: call-reduction ratio (tokens per pass).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..decoding.engine import GenerationStats

OVERALL = "overall"


@dataclass
class Turn:
    """One generated turn. ``accept_lengths[s]`` is what target step ``s`` committed (accepted + 1)."""

    new_tokens: int
    wall_s: float
    accept_lengths: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)  # draft tokens proposed per step, where known
    token_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)  # kept for the lossless check, not written out
    text: str = ""
    prefill_s: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)  # method-specific sums (see pooled_counters)
    steps: list[dict[str, Any]] = field(default_factory=list)  # per-step detail for the latency law

    def to_dict(self, with_ids: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d.pop("prompt_ids")
        if not with_ids:
            d.pop("token_ids")
        return d


@dataclass
class Answer:
    """A method's answer to one question in one run."""

    run: int
    method: str
    question_id: int
    category: str
    group: str
    turns: list[Turn]
    equal_to_reference: bool | None = None  # None: not comparable token-wise (e.g. sampling in another RNG)
    divergence: dict[str, Any] | None = None

    @property
    def new_tokens(self) -> int:
        return sum(t.new_tokens for t in self.turns)

    @property
    def wall_s(self) -> float:
        return sum(t.wall_s for t in self.turns)

    @property
    def speed(self) -> float:
        """Tokens per second over the question's turns (Spec-Bench's per-question speed)."""
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and range of per-run figures."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def _by(answers: Iterable[Answer], method: str) -> dict[int, list[Answer]]:
    runs: dict[int, list[Answer]] = defaultdict(list)
    for a in answers:
        if a.method == method:
            runs[a.run].append(a)
    return runs


def mean_speed(answers: Sequence[Answer], group: str = OVERALL) -> float:
    chosen = [a.speed for a in answers if group in (OVERALL, a.group)]
    return statistics.fmean(chosen) if chosen else 0.0


def speedups(answers: Sequence[Answer], method: str, baseline: str) -> dict[str, dict[str, float]]:
    """Per group and overall: median and range over runs of mean speed(method) ÷ mean speed(baseline)."""
    mine, base = _by(answers, method), _by(answers, baseline)
    runs = sorted(set(mine) & set(base))
    groups = list(dict.fromkeys(a.group for rs in mine.values() for a in rs)) + [OVERALL]
    out = {}
    for group in groups:
        ratios = []
        for r in runs:
            b = mean_speed(base[r], group)
            if b > 0:
                ratios.append(mean_speed(mine[r], group) / b)
        if ratios:
            out[group] = spread(ratios)
    return out


def tokens_per_second(answers: Sequence[Answer], method: str) -> dict[str, float]:
    """Median and range over runs of the mean per-question speed."""
    return spread([mean_speed(rs) for _, rs in sorted(_by(answers, method).items())])


def _turns(answers: Iterable[Answer], method: str, group: str = OVERALL) -> list[Turn]:
    return [t for a in answers if a.method == method and group in (OVERALL, a.group) for t in a.turns]


def mean_accepted_tokens(answers: Sequence[Answer], method: str, group: str = OVERALL) -> float | None:
    """Mean over all steps of tokens committed per target step, bonus included; None when not recorded."""
    lengths = [n for t in _turns(answers, method, group) for n in t.accept_lengths]
    return statistics.fmean(lengths) if lengths else None


def per_position_acceptance(answers: Sequence[Answer], method: str) -> list[float]:
    """Entry i: among steps that drafted window position i+1, the share that accepted it."""
    pairs = [(n - 1, d) for t in _turns(answers, method) for n, d in zip(t.accept_lengths, t.drafted, strict=True)]
    depth = max((d for _, d in pairs), default=0)
    out = []
    for i in range(depth):
        reached = [a for a, d in pairs if d > i]
        out.append(sum(a > i for a in reached) / len(reached))
    return out


def pooled_counters(answers: Sequence[Answer], method: str) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for t in _turns(answers, method):
        for key, value in t.counters.items():
            totals[key] += value
    return dict(totals)


def draft_counters(stats: GenerationStats) -> dict[str, float]:
    """A turn's drafting sums: ``model_drafted`` counts what the draft model drafted, for η̄ (a suffix lookup's
    windows cost no draft forward, and counted they made a one-token-a-forward draft look like a streaming one)."""
    return {"drafted": sum(stats.drafted), "accepted": sum(stats.accepted), "draft_forwards": stats.draft_forwards,
            "model_drafted": sum(s["drafted"] for s in stats.step_log if s.get("draft_forwards"))}


def method_extras(answers: Sequence[Answer], method: str) -> dict[str, float]:
    """Mirror-SD's fallback frequency and hidden-draft fraction, SS's call reduction, the acceptance rate and the
    draft's η̄, from pooled counters."""
    c = pooled_counters(answers, method)
    out = {}
    if c.get("tree_steps"):
        out["fallback_frequency"] = c["misses"] / c["tree_steps"]
    if c.get("draft_s"):
        out["hidden_draft_fraction"] = c["hidden_s"] / c["draft_s"]
    if c.get("passes"):
        out["call_reduction"] = c["committed"] / c["passes"]
    if c.get("drafted"):
        out["acceptance_rate"] = c["accepted"] / c["drafted"]
    # η̄, draft tokens per draft forward: Mirror-SD's fresh and branch rollouts, or every window's drafting
    forwards = c.get("fresh_forwards", 0) + c.get("rollout_forwards", 0)
    if forwards:
        out["draft_tokens_per_forward"] = (c.get("fresh_tokens", 0) + c.get("rollout_depth", 0)) / forwards
    elif c.get("draft_forwards"):  # (the model's windows only: a suffix lookup's cost no draft forward)
        out["draft_tokens_per_forward"] = c.get("model_drafted", c["drafted"]) / c["draft_forwards"]
    return out


def lossless_summary(answers: Sequence[Answer], method: str) -> dict[str, Any]:
    mine = [a for a in answers if a.method == method]
    checked = [a for a in mine if a.equal_to_reference is not None]
    return {"checked": len(checked), "equal": sum(a.equal_to_reference for a in checked),
            "divergences": [a.divergence | {"question_id": a.question_id, "run": a.run}
                            for a in checked if a.divergence]}


def first_divergence(reference: Sequence[int], output: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end); None if equal."""
    for i, (x, y) in enumerate(zip(reference, output, strict=False)):
        if x != y:
            return i
    return None if len(reference) == len(output) else min(len(reference), len(output))


def expected_accepted(per_position: Sequence[float], gamma: int) -> float:
    """E[A] for a γ-token window from conditional per-position acceptance: Σ_i Π_{j≤i} p_j."""
    total, reach = 0.0, 1.0
    for p in list(per_position)[:gamma]:
        reach *= p
        total += reach
    return total
