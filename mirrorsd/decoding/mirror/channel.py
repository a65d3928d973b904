"""The token channel: what crosses from the target's early exit to the draft (ids and bf16 log-probs only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ...draft_vocab import SubsetHead, head_logits, top_tokens
from ...model import Transformer
from ...sampling import SamplingParams
from ..engine import Proposal


@dataclass(frozen=True)
class ChannelMessage:
    """What crosses the token channel at the early exit: ids and bf16 log-probs, nothing else."""

    ids: list[list[int]]  # [w+1][κ]: row j holds the candidates for slot j+1 (after a, d_1..d_j), best first
    logprobs: list[list[float]]  # [w+1][κ]
    runner_ups: list[list[int]] | None = None  # candidates=draft: [w][≤κ] the draft's own, its token left out

    def row(self, j: int) -> list[int]:
        """Position j's κ candidates: the draft's runner-ups where it has them, else the early exit's."""
        return self.runner_ups[j] if self.runner_ups is not None and j < len(self.runner_ups) else self.ids[j]

    def candidates(self, window: list[int], j: int) -> list[int]:
        """Position j's candidates that can be a correction: a correction never equals the draft token it
        replaces (at j = w, the bonus slot, all of them can)."""
        return [v for v in self.row(j) if j >= len(window) or v != window[j]]

    def with_draft(self, draft: Proposal, kappa: int) -> ChannelMessage:
        """The same message, with candidates from the draft's own distributions at the positions it drafted.

        On the Qwen pair, teacher-forced over the 1.5B's chat answers, the 0.5B's next 8 likeliest tokens hold the
        target's correction at 87% of its wrong guesses; the tuned exit's top-8 at N/2 at 33% (docs/mirror_sd.md).
        """
        if draft.alternatives is None:
            return self
        runner_ups = [[v for v in alt if v != token][:kappa] for alt, token in zip(draft.alternatives, draft.tokens,
                                                                                    strict=True)]
        return replace(self, runner_ups=runner_ups)


class ExitTopK:
    """The early exit's top-κ where the target computed it (the token channel in device memory): ``ids`` and bf16
    ``logprobs``, ``[w+1, κ]``, read into a :class:`ChannelMessage` on first use. When every candidate is a root
    (``roots="paper"``), the rollouts start from ``ids`` as they are (:class:`~.roots.DeviceRoots`), so the host
    does not wait for the lower layers before it queues the upper ones and the rollouts."""

    def __init__(self, ids: torch.Tensor, logprobs: torch.Tensor) -> None:
        self.ids, self.logprobs = ids, logprobs
        self._message: ChannelMessage | None = None

    def message(self) -> ChannelMessage:
        if self._message is None:
            self._message = ChannelMessage(self.ids.tolist(), self.logprobs.float().tolist())
        return self._message


def exit_top_k(target: Transformer, hidden: torch.Tensor, kappa: int, params: SamplingParams,
               translate: Callable[[torch.Tensor], torch.Tensor] | None = None,
               head: SubsetHead | None = None) -> ExitTopK:
    """Top-κ of the target's own head on layer-ℓe hidden states (at the sampling temperature, raw if greedy);
    ``translate`` maps them towards the final layer's first (the tuned exit, :mod:`mirrorsd.exit_heads`);
    ``head`` restricts the exit to a frequent-token subset (log-probs then normalise over it)."""
    logits, ids = head_logits(target, hidden if translate is None else translate(hidden), head)
    if not params.greedy:
        logits = logits / params.temperature
    logprobs, top = top_tokens(logits[0], ids, kappa)
    return ExitTopK(top, logprobs.to(torch.bfloat16))  # the paper's bf16


def early_exit(target: Transformer, hidden: torch.Tensor, kappa: int, params: SamplingParams,
               translate: Callable[[torch.Tensor], torch.Tensor] | None = None,
               head: SubsetHead | None = None) -> ChannelMessage:
    """:func:`exit_top_k`, read on the host."""
    return exit_top_k(target, hidden, kappa, params, translate, head).message()
