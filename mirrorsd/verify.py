"""Acceptance rules shared by every speculative method.

A verifier takes the draft tokens of one window and the target's logits for the window's ``gamma + 1``
positions and returns how many draft tokens to accept and the target's own token for the next slot
(the correction after a rejection, or the bonus token after full acceptance). Every rule is lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling import (
    ACCEPT_STREAM,
    RESIDUAL_STREAM,
    SamplingParams,
    keyed_uniforms,
    probabilities,
    sample,
    sample_from_probs,
)

ACCEPTANCE_RULES = ("match", "rejection")


@dataclass(frozen=True)
class Verdict:
    accepted: int  # number of draft tokens accepted
    next_token: int  # the target's token at slot ``accepted + 1``

    def committed(self, draft: Sequence[int]) -> list[int]:
        return [*draft[: self.accepted], self.next_token]


def verify_match(draft: Sequence[int], target_logits: torch.Tensor, positions: Sequence[int],
                 params: SamplingParams) -> Verdict:
    """Greedy exact match, and sample-and-match (Mirror-SD's rule) when ``temperature > 0``.

    The target picks its own token at every position (argmax, or Gumbel-max with position-keyed noise) and
    the window is accepted while the draft agrees. The committed tokens are therefore exactly what the
    target alone would produce with the same seed. ``positions[i]`` is the absolute position of the token
    predicted by row ``i`` of ``target_logits``.
    """
    for i, proposed in enumerate(draft):  # row by row: no noise is drawn past the first disagreement
        own = sample(target_logits[i:i + 1], positions[i:i + 1], params)[0]
        if own != proposed:
            return Verdict(i, own)
    n = len(draft)
    return Verdict(n, sample(target_logits[n:n + 1], positions[n:n + 1], params)[0])


def verify_rejection(draft: Sequence[int], draft_probs: torch.Tensor, target_logits: torch.Tensor,
                     positions: Sequence[int], params: SamplingParams) -> Verdict:
    """Leviathan et al. / Chen et al. speculative sampling: accept x with probability min(1, p(x)/q(x)),
    else draw from the residual ``norm(max(p - q, 0))``. Preserves the target's distribution exactly;
    ``draft_probs`` (``[gamma, vocab]``) must be the distributions the draft tokens were drawn from.
    """
    p = probabilities(target_logits, params)
    for i, token in enumerate(draft):
        u = keyed_uniforms(params.seed, [positions[i]], 1, ACCEPT_STREAM).item()
        q_x = draft_probs[i, token].item()
        if q_x > 0 and u * q_x < p[i, token].item():
            continue
        residual = (p[i] - draft_probs[i]).clamp_min(0)
        total = residual.sum()
        if total <= 0:  # p == q: any rejection is measure-zero; fall back to p itself
            residual, total = p[i], p[i].sum()
        token = sample_from_probs((residual / total)[None], [positions[i]], params.seed, RESIDUAL_STREAM)[0]
        return Verdict(i, token)
    bonus = len(draft)
    return Verdict(bonus, sample(target_logits[bonus:bonus + 1], [positions[bonus]], params)[0])
