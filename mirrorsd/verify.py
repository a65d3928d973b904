"""Acceptance rules shared by every speculative method.

A verifier takes the draft tokens of one window (a chain, or a tree) and the target's logits after the last
committed token and after each draft token, and returns which draft tokens to accept and the target's own
token for the next slot (the correction after a rejection, or the bonus token after full acceptance). Every
rule is lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling import (
    Noise,
    SamplingParams,
    choose,
    keyed_uniforms,
    probabilities,
    rows_apart,
    sample,
    sample_from_probs,
)

ACCEPTANCE_RULES = ("match", "rejection")


@dataclass(frozen=True)
class Verdict:
    accepted: int  # number of draft tokens accepted
    next_token: int  # the target's token at slot ``accepted + 1``
    path: tuple[int, ...] | None = None  # tree drafts: the accepted nodes, root first (chains: the first ones)

    @property
    def nodes(self) -> Sequence[int]:
        """Indices of the accepted draft tokens."""
        return self.path if self.path is not None else range(self.accepted)


def verify_match(draft: Sequence[int], target_logits: torch.Tensor, positions: Sequence[int],
                 params: SamplingParams) -> Verdict:
    """Greedy exact match, and sample-and-match (Mirror-SD's rule) when ``temperature > 0``.

    The target picks its own token at every position (argmax, or Gumbel-max with position-keyed noise) and
    the window is accepted while the draft agrees. The committed tokens are therefore exactly what the
    target alone would produce with the same seed. ``positions[i]`` is the absolute position of the token
    predicted by row ``i`` of ``target_logits``.
    """
    n = len(draft)
    if rows_apart(target_logits, params):  # every row's own token in one op and one host read
        return chain_verdict(draft, choose(target_logits[:n + 1], positions[:n + 1], params).tolist())
    for i, proposed in enumerate(draft):  # row by row: no noise is drawn past the first disagreement
        own = sample(target_logits[i:i + 1], positions[i:i + 1], params)[0]
        if own != proposed:
            return Verdict(i, own)
    return Verdict(n, sample(target_logits[n:n + 1], positions[n:n + 1], params)[0])


def chain_verdict(draft: Sequence[int], own: Sequence[int]) -> Verdict:
    """:func:`verify_match`'s verdict from the target's own token at every row (``len(draft) + 1`` of them)."""
    accepted = next((i for i, proposed in enumerate(draft) if own[i] != proposed), len(draft))
    return Verdict(accepted, own[accepted])


def verify_rejection(draft: Sequence[int], draft_probs: torch.Tensor, target_logits: torch.Tensor,
                     positions: Sequence[int], params: SamplingParams) -> Verdict:
    """Leviathan et al. / Chen et al. speculative sampling: accept x with probability min(1, p(x)/q(x)),
    else draw from the residual ``norm(max(p - q, 0))``. Preserves the target's distribution exactly;
    ``draft_probs`` (``[gamma, vocab]``) must be the distributions the draft tokens were drawn from.
    """
    p = probabilities(target_logits, params)
    for i, token in enumerate(draft):
        u = keyed_uniforms(params.seed, [positions[i]], 1, Noise.ACCEPT).item()
        q_x = draft_probs[i, token].item()
        if q_x > 0 and u * q_x < p[i, token].item():
            continue
        residual = (p[i] - draft_probs[i].to(p.device)).clamp_min(0)  # (a guess's point mass is made on the host)
        total = residual.sum()
        if total <= 0:  # p == q: any rejection is measure-zero; fall back to p itself
            residual, total = p[i], p[i].sum()
        token = sample_from_probs((residual / total)[None], [positions[i]], params.seed, Noise.RESIDUAL)[0]
        return Verdict(i, token)
    bonus = len(draft)
    return Verdict(bonus, sample(target_logits[bonus:bonus + 1], [positions[bonus]], params)[0])


def tree_positions(parents: Sequence[int], position: int) -> list[int]:
    """The absolute position each row of a tree's logits predicts: the root's row ``position``, node i's row
    ``position + depth(i)`` (``parents[i]``: token i's parent, -1 for the root; parents come first)."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return [position, *(position + d for d in depth)]


def verify_tree(tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor, position: int,
                params: SamplingParams, noise: int = Noise.TARGET, own: Sequence[int] | None = None) -> Verdict:
    """Match down a draft tree: from the root (the last committed token), the child whose token is the target's
    own choice at its parent is accepted, and so on down.

    ``parents[i]`` is token i's parent (-1: the root; parents come first); ``logits`` row 0 follows the root,
    row i+1 follows token i; ``position`` is the absolute position the root's row predicts. A chain
    (``parents = [-1, 0, 1, ...]``) gives :func:`verify_match`'s verdict. ``own``: every row's own token, where the
    caller drew them for several trees in one op and one host read (:func:`~mirrorsd.sampling.rows_apart`).
    """
    children: dict[int, dict[int, int]] = {}
    for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        children.setdefault(parent, {}).setdefault(token, node)
    rows = len(tokens) + 1
    every = own if own is not None else \
        choose(logits[:rows], tree_positions(parents, position), params, noise).tolist() \
        if rows_apart(logits, params) else None  # every row's own token in one op and one host read
    node, path = -1, []
    while True:
        own = every[node + 1] if every is not None else \
            sample(logits[node + 1:node + 2], [position + len(path)], params, noise)[0]
        child = children.get(node, {}).get(own)
        if child is None:
            return Verdict(len(path), own, tuple(path))
        path.append(child)
        node = child
