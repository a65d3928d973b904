"""Acceptance and early-exit statistics from one untimed vanilla-SD pass (fixed γ windows; greedy, or sampling at a
temperature, verified by sample-and-match as the methods do by default, or by speculative sampling).

At every step the target's early exit is read at several depths (N/4, N/2, 3N/4) on the verified window, and
the rank of the target's correction (or bonus token) among the exit's top candidates at slot A+1 is recorded.
Whether the correction is among those top-κ candidates depends only on the target and the verified windows,
which Mirror-SD shares with vanilla SD (its parity property), so this one pass gives Mirror-SD's fallback
frequency of the ``paper`` reuse rule for every κ × ℓe without rolling anything out (the paper's Fig. 7). Since
acceptance of the first γ' tokens of a window does not depend on the tokens after them, the same steps give
E[A_t] for every γ' ≤ γ as the mean of min(A, γ') (Fig. 3b), and the per-position acceptance the planner uses.
The same steps give the fallback of ``mirror``'s ``candidates=draft``: the draft's own runner-ups at the slots it
drafted, the N/2 exit's top-κ (tuned where given) at the bonus slot.

Proposition 1 bounds the fallback by 1 − Ω_κ, Ω_κ being the target's probability q on the exit's top-κ: a bound on
a correction *drawn from* q. The correction is drawn from q only at a bonus slot. After a rejection it comes from
the residual norm(max(q − p, 0)) under speculative sampling, and under greedy decoding it is the argmax, a point
mass. So the probe records Ω twice: with the paper's q (at temperature 1 when greedy), and with the distribution
the correction was actually drawn from, whose complement is exactly the fallback's expectation (greedy and under
speculative sampling; under sample-and-match a mismatch conditions the target's own draw, with no closed form).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..decoding import engine
from ..decoding.engine import (
    ChainScorer,
    DecodeRequest,
    GenerationStats,
    Proposal,
    RequestState,
    Roles,
    Scores,
    match,
    rejection,
)
from ..decoding.proposers import ModelProposer
from ..draft_vocab import head_logits, optional_head
from ..exit_heads import ExitTranslators
from ..sampling import SamplingParams, probabilities

EXITS = {"1/4": 0.25, "1/2": 0.5, "3/4": 0.75}
TUNED = " tuned"  # suffix of the probe's names for tuned exits
KAPPAS = (1, 2, 4, 8, 16)


@dataclass
class Probe:
    gamma: int
    exit_layers: dict[str, int]
    kappas: tuple[int, ...]
    accepted: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # per group, full windows
    # per group and exit, per step: the rank among the exit's top candidates of the target's token at every slot up
    # to the correction's (the accepted draft tokens, then the correction); max(kappas) where not among them
    ranks: dict[str, dict[str, list[list[int]]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    draft_ranks: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # candidates=draft
    # Eq. 9's Ω_κ(ℓe) per step: the target's probability mass on the exit's top-κ at slot A+1, one entry per κ
    omegas: dict[str, dict[str, list[list[float]]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    # the same mass under the distribution the correction was drawn from (residual, point mass or q)
    drawn: dict[str, dict[str, list[list[float]]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    temperature: float = 0.0
    acceptance: str = "greedy"  # how windows were verified: greedy, match or rejection (:func:`run_probe`)

    def groups(self) -> list[str]:
        return [*self.accepted, "all"]

    def _accepted(self, group: str) -> list[int]:
        return [a for acc in self.accepted.values() for a in acc] if group == "all" else self.accepted[group]

    def _ranks(self, group: str, exit_name: str, gamma: int | None = None) -> list[int]:
        """Per step, the rank of the token that fills the correction's slot: with ``gamma`` < the probe's γ, that of
        a γ-token window over the same steps, slot min(A, γ)."""
        rows = ([r for by_exit in self.ranks.values() for r in by_exit[exit_name]] if group == "all"
                else self.ranks[group][exit_name])
        return [row[-1] if gamma is None else row[min(len(row) - 1, gamma)] for row in rows]

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

    def fallback(self, group: str = "all", gamma: int | None = None) -> dict[str, dict[int, float]]:
        """Per exit depth and κ: the share of steps whose correction is not among the exit's top-κ. ``gamma``: of a
        window of that many tokens instead, as E[A] for γ' ≤ γ is read from the same steps. A shorter window's
        correction slot holds a token the longer one accepted, which is the target's own token there (greedy, and
        under sample-and-match with the same noise); under speculative sampling a bonus draw stands in for it."""
        out = {}
        for name in self.exit_layers:
            ranks = self._ranks(group, name, gamma)
            if ranks:
                out[name] = {k: sum(r >= k for r in ranks) / len(ranks) for k in self.kappas}
        return out

    def overlap(self, group: str = "all", drawn: bool = False) -> dict[str, dict[int, float]]:
        """Per exit depth and κ: mean Ω_κ(ℓe) = Σ_{y ∈ Top-κ(p̃)} q(y) (Eq. 9), q the target's distribution at the
        slot the correction fills. Proposition 1 bounds the fallback of a correction drawn from q by 1 − Ω_κ.
        ``drawn``: q is the distribution the correction was drawn from instead (the module docstring)."""
        masses = self.drawn if drawn else self.omegas
        out = {}
        for name in self.exit_layers:
            rows = ([r for by_exit in masses.values() for r in by_exit[name]] if group == "all"
                    else masses[group][name])
            if rows:
                out[name] = {k: statistics.fmean(r[i] for r in rows) for i, k in enumerate(self.kappas)}
        return out

    def draft_fallback(self, group: str = "all") -> dict[int, float]:
        """Per κ: the share of steps whose correction is not among ``candidates=draft``'s κ candidates."""
        ranks = [r for rs in self.draft_ranks.values() for r in rs] if group == "all" else self.draft_ranks[group]
        return {k: sum(r >= k for r in ranks) / len(ranks) for k in self.kappas} if ranks else {}

    def to_dict(self) -> dict:
        return {"gamma": self.gamma, "exit_layers": self.exit_layers, "steps": len(self._accepted("all")),
                "temperature": self.temperature, "acceptance": self.acceptance,
                "overlap_drawn": {g: self.overlap(g, True) for g in self.groups()},
                "expected_accepted": {g: self.expected_accepted(g) for g in self.groups()},
                "per_position_acceptance": self.per_position(),
                "fallback": {g: self.fallback(g) for g in self.groups()},
                "overlap": {g: self.overlap(g) for g in self.groups()},
                "draft_fallback": {g: self.draft_fallback(g) for g in self.groups()}}


class ExitReader(ChainScorer):
    """The target's chain scorer that also reads the early exit (top-κ ids) at several depths on the way up;
    exits named ``"<depth> tuned"`` go through the tuned exit's translator first."""

    def __init__(self, model, exit_layers: dict[str, int], kappa: int, tuned: ExitTranslators | None = None) -> None:
        super().__init__(model)
        self.exit_layers, self.kappa, self.tuned = exit_layers, kappa, tuned
        self.head = optional_head(model, None)  # the exit head decoding reads by default (exit_vocab's default)
        self.bounds = sorted(set(exit_layers.values()))
        self.exit_ids: dict[str, list[list[int]]] = {}
        self.final: torch.Tensor | None = None  # the target's logits over the window, for Ω_κ

    def score(self, state: RequestState, draft: Proposal) -> Scores:
        model = self.model
        tokens = [state.tokens[-1], *draft.tokens]
        positions = torch.arange(len(state.tokens) - 1, len(state.tokens) - 1 + len(tokens), device=model.device)
        hidden, start = model.embed(torch.tensor([tokens], device=model.device)), 0
        for end in [*self.bounds, model.config.n_layers]:
            hidden = model.run_layers(hidden, positions[None], state.target_cache, start=start, end=end)
            for name, layer in self.exit_layers.items():
                if layer == end:
                    read = self.tuned(hidden, layer) if name.endswith(TUNED) and self.tuned else hidden
                    logits, ids = head_logits(model, read, self.head)
                    top = logits[0].topk(self.kappa, -1).indices
                    self.exit_ids[name] = (top if ids is None else ids[top]).tolist()
            start = end
        self.final = model.logits(hidden)[0]
        return Scores(self.final, draft)


def run_probe(target, draft, prompts: Sequence[tuple[str, list[int]]], max_new: int, gamma: int = 7,
              kappas: tuple[int, ...] = KAPPAS, exits: dict[str, float] = EXITS, progress: bool = True,
              tuned: ExitTranslators | None = None, temperature: float = 0.0, seed: int = 0, top_k: int = 0,
              top_p: float = 1.0, acceptance: str = "match") -> Probe:
    """``prompts`` are (group, token ids) pairs; ``target``/``draft`` are loaded models. The steps are the decoding
    loop's with the shared draft proposer (fixed γ windows) and a scorer that reads the exits through the exit
    head decoding reads by default (the reduced vocabulary where a table ships); with ``tuned``, every depth it has
    a translator for is also read through it (``"1/2 tuned"``). ``temperature`` > 0: sampling with ``seed`` after
    the ``top_k`` / ``top_p`` filters, verified as ``acceptance`` says: ``match`` (the methods' default: the draft
    coupled to the target's noise, sample-and-match) or ``rejection`` (speculative sampling: the draft's own noise;
    only then is the distribution each correction was drawn from known, the residual, for :meth:`Probe.overlap`'s
    ``drawn`` rows)."""
    if acceptance not in ("match", "rejection"):
        raise ValueError(f"acceptance must be match or rejection, got {acceptance!r}")
    model, dmodel = target.model, draft.model
    n = model.config.n_layers
    exit_layers = {name: min(n - 1, max(1, round(f * n))) for name, f in exits.items()}
    if tuned is not None:
        exit_layers.update({name + TUNED: layer for name, layer in list(exit_layers.items()) if layer in tuned.layers})
    probe = Probe(gamma, exit_layers, tuple(kappas), temperature=temperature,
                  acceptance=acceptance if temperature > 0 else "greedy")
    bonus_exit = "1/2" + TUNED if "1/2" + TUNED in exit_layers else "1/2"
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    sampling = not params.greedy
    speculative = sampling and acceptance == "rejection"
    for group, ids in tqdm(prompts, desc="acceptance probe", unit="prompt", disable=not progress):
        scorer = ExitReader(model, exit_layers, max(kappas), tuned)
        proposer = ModelProposer(dmodel, model.config.vocab_size, params, gamma, rejection=speculative)
        proposer.sampler.runner_ups = max(kappas) + 1
        roles = Roles(proposer, scorer, rejection if speculative else match)
        # Room for full windows up to the last step (the loop keeps windows inside max_new_tokens).
        request = DecodeRequest(model, list(ids), max_new + gamma + 1, params, GenerationStats("probe"), dmodel)
        produced = 0
        for new in engine.run(request, roles):
            a, c = request.stats.accepted[-1], new[-1]
            if request.stats.drafted[-1] == gamma:
                probe.accepted[group].append(a)
            window = proposer.last
            q = (probabilities(scorer.final[a:a + 1], params)[0] if sampling else scorer.final[a].double().softmax(-1))
            # the distribution the correction was drawn from: greedy, the point mass on the argmax; a bonus slot,
            # q; after a rejection, the residual. Under sample-and-match it has no closed form (the draft's noise is
            # the target's, so a mismatch tells on the target's draw): no such row.
            source = probabilities(scorer.final[a:a + 1], params)[0] if not sampling or speculative else None
            if speculative and a < len(window.tokens):
                residual = (source - window.probs[a].to(source)).clamp_min(0)
                source = residual / residual.sum() if residual.sum() > 0 else source
            filled = [*window.tokens[:a], c]  # the target's token at every slot up to the correction's
            for name, rows in scorer.exit_ids.items():
                probe.ranks[group][name].append([row.index(t) if t in row else max(kappas)
                                                 for row, t in zip(rows, filled, strict=False)])
                for masses, dist in ((probe.omegas, q), (probe.drawn, source)):
                    if dist is None:
                        continue
                    mass = dist[rows[a]].cumsum(0).tolist()
                    masses[group][name].append([mass[k - 1] for k in kappas])
            if bonus_exit in scorer.exit_ids:
                row = (window.alternatives[a] if a < len(window.tokens) else scorer.exit_ids[bonus_exit][a])
                row = [v for v in row if a >= len(window.tokens) or v != window.tokens[a]]
                probe.draft_ranks[group].append(row.index(c) if c in row[:max(kappas)] else max(kappas))
            produced += len(new)
            if produced >= max_new or c in target.eos_token_ids:
                break
    return probe
