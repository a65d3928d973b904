"""Acceptance and early-exit statistics from one untimed vanilla-SD pass (greedy, fixed γ windows).

At every step the target's early exit is read at several depths (N/4, N/2, 3N/4) on the verified window, and
the rank of the target's correction (or bonus token) among the exit's top candidates at slot A+1 is recorded.
Whether the correction is among those top-κ candidates depends only on the target and the verified windows,
which Mirror-SD shares with vanilla SD (its parity property), so this one pass gives Mirror-SD's fallback
frequency of the ``paper`` reuse rule for every κ × ℓe without rolling anything out (the paper's Fig. 7). Since
acceptance of the first γ' tokens of a window does not depend on the tokens after them, the same steps give
E[A_t] for every γ' ≤ γ as the mean of min(A, γ') (Fig. 3b), and the per-position acceptance the planner uses.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..decoding.sd import propose
from ..sampling import TARGET_STREAM, SamplingParams
from ..verify import verify_match

EXITS = {"1/4": 0.25, "1/2": 0.5, "3/4": 0.75}
KAPPAS = (1, 2, 4, 8, 16)


@dataclass
class Probe:
    gamma: int
    exit_layers: dict[str, int]
    kappas: tuple[int, ...]
    accepted: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # per group, full windows
    ranks: dict[str, dict[str, list[int]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))

    def groups(self) -> list[str]:
        return [*self.accepted, "all"]

    def _accepted(self, group: str) -> list[int]:
        return [a for acc in self.accepted.values() for a in acc] if group == "all" else self.accepted[group]

    def _ranks(self, group: str, exit_name: str) -> list[int]:
        if group == "all":
            return [r for by_exit in self.ranks.values() for r in by_exit[exit_name]]
        return self.ranks[group][exit_name]

    def expected_accepted(self, group: str = "all") -> dict[int, float]:
        """E[A_t] (accepted draft tokens per step, the paper's convention) for γ' = 1..γ."""
        acc = self._accepted(group)
        return {g: statistics.fmean(min(a, g) for a in acc) for g in range(1, self.gamma + 1)} if acc else {}

    def per_position(self) -> list[float]:
        """Entry i: P(position i+1 accepted | positions 1..i accepted), the conditional form E[A] needs
        (:func:`mirrorsd.bench.metrics.expected_accepted`); the report's per-position table is unconditional."""
        acc = self._accepted("all")
        out = []
        for i in range(self.gamma):
            reached = [a for a in acc if a >= i]
            out.append(sum(a > i for a in reached) / len(reached) if reached else 0.0)
        return out

    def fallback(self, group: str = "all") -> dict[str, dict[int, float]]:
        """Per exit depth and κ: the share of steps whose correction is not among the exit's top-κ."""
        out = {}
        for name in self.exit_layers:
            ranks = self._ranks(group, name)
            if ranks:
                out[name] = {k: sum(r >= k for r in ranks) / len(ranks) for k in self.kappas}
        return out

    def to_dict(self) -> dict:
        return {"gamma": self.gamma, "exit_layers": self.exit_layers, "steps": len(self._accepted("all")),
                "expected_accepted": {g: self.expected_accepted(g) for g in self.groups()},
                "per_position_acceptance": self.per_position(),
                "fallback": {g: self.fallback(g) for g in self.groups()}}


@torch.inference_mode()
def run_probe(target, draft, prompts: Sequence[tuple[str, list[int]]], max_new: int, gamma: int = 7,
              kappas: tuple[int, ...] = KAPPAS, exits: dict[str, float] = EXITS, progress: bool = True) -> Probe:
    """``prompts`` are (group, token ids) pairs; ``target``/``draft`` are loaded models."""
    model, dmodel = target.model, draft.model
    n = model.config.n_layers
    exit_layers = {name: min(n - 1, max(1, round(f * n))) for name, f in exits.items()}
    probe = Probe(gamma, exit_layers, tuple(kappas))
    bounds = sorted(set(exit_layers.values()))
    params = SamplingParams()
    for group, ids in tqdm(prompts, desc="acceptance probe", unit="prompt", disable=not progress):
        seq = list(ids)
        capacity = len(seq) + max_new + gamma + 2
        t_cache, d_cache = model.new_cache(capacity=capacity), dmodel.new_cache(capacity=capacity)
        model.prefill(torch.tensor([seq[:-1]], device=model.device), t_cache)
        pending, produced = list(seq), 0
        while produced < max_new:
            drafted = propose(dmodel, d_cache, pending, len(seq), gamma, params, TARGET_STREAM, False, 0.0, 0)
            tokens = [seq[-1], *drafted.tokens]
            x = torch.tensor([tokens], device=model.device)
            positions = torch.arange(len(seq) - 1, len(seq) - 1 + len(tokens), device=model.device)[None]
            hidden, start, exit_ids = model.embed(x), 0, {}
            for end in [*bounds, n]:
                hidden = model.run_layers(hidden, positions, t_cache, start=start, end=end)
                for name, layer in exit_layers.items():
                    if layer == end:
                        exit_ids[name] = model.logits(hidden)[0].topk(max(kappas), -1).indices.tolist()
                start = end
            verdict = verify_match(drafted.tokens, model.logits(hidden)[0],
                                   list(range(len(seq), len(seq) + len(tokens))), params)
            a, c = verdict.accepted, verdict.next_token
            if len(drafted.tokens) == gamma:
                probe.accepted[group].append(a)
            for name, rows in exit_ids.items():
                probe.ranks[group][name].append(rows[a].index(c) if c in rows[a] else max(kappas))
            t_cache.truncate(len(seq) + a)
            keep = min(len(d_cache), len(seq) + a)
            d_cache.truncate(keep)
            seq.extend(verdict.committed(drafted.tokens))
            pending = seq[keep:]
            produced += a + 1
            if c in target.eos_token_ids:
                break
    return probe
