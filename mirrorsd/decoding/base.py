"""What every decoding method receives and reports.

A method is a generator: given a :class:`DecodeRequest` it yields lists of newly committed token ids, and
fills ``request.stats`` as it goes. The caller (:mod:`mirrorsd.api`) owns stopping: EOS, stop strings
and ``max_new_tokens`` cut the output and close the generator, so a method never needs to know them --
it only keeps its windows inside ``max_new_tokens`` so that no work is wasted past the end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..model import Transformer
from ..runtime.trace import Span
from ..sampling import SamplingParams


@dataclass
class GenerationStats:
    """Per-generation counters. ``accepted`` holds the draft tokens accepted at each speculative step."""

    method: str
    seed: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    gamma: int = 0  # the largest window drafted
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted, per speculative step
    drafted: list[int] = field(default_factory=list)  # draft tokens proposed, per speculative step
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0  # target forwards after prefill (verification, for speculative methods)
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific statistics with a to_dict()
    spans: list[Span] = field(default_factory=list)  # timeline (methods that trace their lanes)

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target decoding step, accepted + 1 averaged over steps (Spec-Bench's convention; a
        step with an empty window counts as 1)."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 1.0

    def record_step(self, drafted: int, accepted: int) -> None:
        self.drafted.append(drafted)
        self.accepted.append(accepted)
        self.gamma = max(self.gamma, drafted)

    @property
    def per_position_acceptance(self) -> list[float]:
        """Entry i: among steps that drafted a token at window position i+1, the share that accepted it."""
        out = []
        for i in range(self.gamma):
            reached = [a for a, d in zip(self.accepted, self.drafted, strict=True) if d > i]
            out.append(sum(a > i for a in reached) / len(reached) if reached else 0.0)
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "seed": self.seed,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "steps": self.steps,
            "gamma": self.gamma,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "accepted_per_step": list(self.accepted),
            "drafted_per_step": list(self.drafted),
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "target_s": round(self.target_s, 4),
            **{name: value.to_dict() for name, value in self.extra.items()},
        }


@dataclass
class DecodeRequest:
    target: Transformer
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stats: GenerationStats
    draft: Transformer | None = None
    options: dict[str, Any] = field(default_factory=dict)


class Timer:
    """Adds elapsed wall time to a stats field: ``with timer("draft_s"): ...``."""

    def __init__(self, stats: GenerationStats) -> None:
        self.stats = stats

    @contextmanager
    def __call__(self, field_name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self.stats, field_name, getattr(self.stats, field_name) + time.perf_counter() - start)
