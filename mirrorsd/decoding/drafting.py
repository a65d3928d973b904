"""The draft core: one home for what every proposer that drafts with a model does with the draft's logits.

A draft step turns a draft model's logits (one row, or one per rollout branch) into proposals: tokens sampled
with the position-keyed noise (the target's noise for sample-and-match, the draft's own for rejection sampling),
the draft's distribution padded to the target's vocabulary (rejection sampling needs it), its top probability
(the confidence rule reads only that) and, for Mirror-SD's ``candidates="draft"``, its likeliest tokens. With a
reduced draft vocabulary (FR-Spec) greedy drafts read the subset's logits as they come (an argmax and a top
probability need no full row), sampled ones scatter them into the full vocabulary, where the noise is keyed by
token id. :class:`~.proposers.ModelProposer`, :class:`~.proposers.StreamProposer`, Mirror-SD's rollouts and
:class:`~.bridge.BridgedProposer` all take their steps here, with one confidence rule, one prompt window and one
vocabulary default.

The confidence rule: a window ends at the first position where the draft's most likely token has less than
``confidence`` probability. That token is still proposed (it is drafted already, and once a window is non-empty
one more token barely changes the cost of verifying it) -- unless it would be the first: on a CPU verifying one
draft token costs about a whole extra target forward, so then the window stays empty and the step is a plain
1-token target forward (decided on a GPU's device, :class:`~.draft_graph.DraftGraph`'s ``cut``, the target scores
the whole window there, where its rows cost about the same). (HF's ``assistant_confidence_threshold`` always
proposes it.) The decision reads the
draft's distribution only, never its draw, so rejection sampling still sees proposals drawn exactly from q.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..draft_vocab import default_size, draft_table_kind, subset_head
from ..model import Transformer
from ..sampling import (
    Noise,
    SamplingParams,
    choose,
    graph_choice,
    probabilities,
    sample,
    stream_key,
    window_keys,
    window_seed,
)
from ..verify import ACCEPTANCE_RULES
from .registry import at_least, option
from .streams.passes import DEFER_STREAMS

SINK_TOKENS = 4  # first prompt tokens a ``context``-limited draft always keeps (StreamingLLM's attention sinks)


def draft_vocab_option(default: int | None = 0) -> Any:
    """The reduced-vocabulary option, shared by the methods that draft with a model (``None``: the measured
    default, :func:`draft_vocab_size`)."""
    return option(default, "restrict the draft model's LM head to the N most frequent token ids of the table "
                  "shipped for its tokenizer (the draft table, else the corpus table; FR-Spec; lossless: the target "
                  "verifies with its full vocabulary); 0: the full vocabulary", parse=int, check=at_least(0),
                  default_text="32768 where a draft table ships" if default is None else None)


def draft_streams_option() -> Any:
    """The option that drafts with the draft model's Speculative Streaming adapter, shared by the methods that draft
    with a model (``sd``; Mirror-SD's fresh rollouts)."""
    return option(None, "draft with Speculative Streaming: the draft verifies its last guesses and drafts the next "
                  "in one forward, so a window takes fewer draft forwards (the same tokens: its main stream "
                  "verifies). ADAPTER is a folder; alone, the draft's shipped adapter", parse=str, metavar="ADAPTER",
                  const="auto", default_text="an AR draft")


def acceptance_option() -> Any:
    """How a drafted window is verified, shared by the methods that draft with a model (``sd``, Mirror-SD)."""
    return option("match", "match: greedy / sample-and-match (the target's own tokens, as ar, and the same tokens "
                  "for a seed); rejection: speculative sampling (the target's distribution; a seed fixes that "
                  "distribution, not the tokens: where windows end, which timing and batch mates move, changes "
                  "the draws)", choices=ACCEPTANCE_RULES)


def defer_streams_option() -> Any:
    """When a Speculative Streaming pass runs its streams, shared by ``ss`` and ``sd``'s ``draft_streams``."""
    return option("auto", "run the streams after verification, for the last accepted node only, instead of beside "
                  "every tree node in the pass: never, always, or auto (on a CPU from 3 kept nodes up); the same "
                  "bits either way", choices=DEFER_STREAMS)


def streams_flag(value: Any) -> Any:
    """``draft_streams`` as a flag or a method spec writes it: true/auto ask for the draft's shipped adapter (the API
    fills it in), false/none for an AR draft, anything else is an adapter folder."""
    flag = str(value).lower()
    if flag in ("true", "auto", "false", "none"):
        return "auto" if flag in ("true", "auto") else None
    return value


def draft_vocab_size(option: int | None, draft: Transformer) -> int:
    """The draft vocabulary an option asks for: ``None`` is the default for the draft's tokenizer
    (:func:`~mirrorsd.draft_vocab.default_size` of its ``draft`` table)."""
    return option if option is not None else default_size(draft.config.vocab_size, "draft")


def prompt_window(prompt: list[int], context: int) -> tuple[list[int], int]:
    """What a draft reads of a prompt and how many tokens it skips: all of it, or with ``context`` > 0 its first
    SINK_TOKENS and last ``context`` tokens (StreamingLLM's sink and window): a draft's prompt prefill is what
    makes it lose on long prompts, and its next tokens depend mostly on the recent text."""
    if not context or len(prompt) <= SINK_TOKENS + context:
        return prompt, 0
    return prompt[:SINK_TOKENS] + prompt[-context:], len(prompt) - SINK_TOKENS - context


def window_end(top_probs: list[float], confidence: float) -> int:
    """How many of a rollout's tokens to propose under the confidence rule (all when ``confidence`` is 0):
    through the first doubtful token, or none when the first one is doubtful."""
    for i, p in enumerate(top_probs):
        if p < confidence:
            return 0 if i == 0 else i + 1
    return len(top_probs)


def window_ends(top_probs: torch.Tensor, confidence: float) -> torch.Tensor:
    """:func:`window_end` of each row of ``[R, γ]`` top probabilities, where they are (no host read); compared in
    float64, as the host compares the floats it reads."""
    steps = top_probs.shape[-1]
    doubt = top_probs.double() < confidence
    first = torch.where(doubt.any(-1), doubt.long().argmax(-1), steps)  # (argmax: the first of equal maxima)
    return torch.where(first == 0, 0, (first + 1).clamp(max=steps))


class DraftSampler:
    """One draft step over any number of rows (see the module docstring).

    ``rejection``: the draft's draws use their own noise key and keep their distributions (speculative sampling
    needs them independent of the acceptance noise), each window with a seed of its own
    (:func:`~mirrorsd.sampling.window_seed`: :meth:`begin`, :meth:`keys`); otherwise the draft is coupled to the
    target's noise, which maximises sample-and-match acceptance. ``runner_ups`` > 0: steps also give that many
    likeliest tokens per row.
    """

    def __init__(self, draft: Transformer, target_vocab: int, params: SamplingParams, *, confidence: float = 0.0,
                 rejection: bool = False, vocab: int = 0) -> None:
        self.params, self.confidence = params, confidence
        self.request_params = params  # (:attr:`params` draws the window begun last)
        self.subset = subset_head(draft, vocab, draft_table_kind(draft.config.vocab_size)) if vocab else None
        self.subset_columns = self.subset is not None and params.greedy  # logits' column c is token subset.ids[c]
        self.head = self.subset.full if self.subset is not None and not params.greedy else self.subset
        # column c scores token c (-inf outside a reduced vocabulary): what a tree verification compares ids with
        self.id_head = self.subset.full if self.subset is not None else None
        self.rejection = rejection and not params.greedy
        self.noise = Noise.DRAFT if self.rejection else Noise.TARGET
        self.need_probs = self.rejection or confidence > 0
        self.pad = target_vocab - draft.config.vocab_size
        self.runner_ups = 0

    def params_at(self, start: int) -> SamplingParams:
        """The sampling parameters of a window that starts at text position ``start``: under rejection sampling with
        its own seed, else the request's (coupled draws are the target's noise)."""
        if not self.rejection:
            return self.request_params
        return replace(self.request_params, seed=window_seed(self.request_params.seed, start))

    def begin(self, start: int) -> None:
        """A window starts at text position ``start``: :meth:`draw` and :meth:`choose` draw with its parameters."""
        self.params = self.params_at(start)

    def keys(self, starts: Sequence[int], device: torch.device | str) -> torch.Tensor:
        """One noise stream key per row, for rows that each start a window at ``starts`` (a tree rollout's
        branches): :meth:`choose`'s ``key`` and what a graph's rows read."""
        if self.rejection:
            return window_keys(self.request_params.seed, starts, self.noise).to(device)
        return torch.full((len(starts),), stream_key(self.request_params.seed, self.noise), device=device)

    @property
    def choice(self) -> tuple:
        """What :meth:`choose` bakes into a captured draft (:mod:`.draft_graph`) besides the logits and positions:
        the head and :func:`~mirrorsd.sampling.graph_choice` (the warp and the noise, not the seed, which such a draft
        reads as a device tensor). Every request draws a seed, so requests that differ only by it share a graph."""
        return (self.head, *graph_choice(self.params, self.noise))

    def judge(self, logits: torch.Tensor) -> tuple[torch.Tensor | None, list[float] | None]:
        """Per row: the draft's distribution over the target's vocabulary (rejection sampling) and its top
        probability (the confidence rule), each None where nothing reads it."""
        q, top = self.judged(logits)
        return q, top.tolist() if top is not None else None

    def judged(self, logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """:meth:`judge` with the top probabilities left where the logits are: a rollout reads them all at its end."""
        if self.rejection:
            q = self.distribution(logits)
            return q, q.max(-1).values
        if not self.need_probs:
            return None, None
        if not self.params.greedy:
            return None, self.distribution(logits).max(-1).values
        # greedy needs no distribution: a softmax in double over 152k ids per draft token was a third of sd's time
        # outside the forwards. Full rows of a reduced head (an SS draft's, :attr:`id_head`) are read at the subset's
        # columns, so its rule sees the AR draft's very bits (a sum over the -inf row may round differently).
        if self.subset is not None and logits.shape[-1] != len(self.subset.ids):
            logits = logits[..., self.subset.ids]
        return None, (logits.max(-1).values - logits.logsumexp(-1)).exp()

    def draw(self, logits: torch.Tensor, positions: list[int]) -> list[int]:
        """Token ids drawn from each row (row i at ``positions[i]``: the noise is keyed by position)."""
        return self.tokens_of(sample(logits, positions, self.params, self.noise))

    def choose(self, logits: torch.Tensor, positions: list[int] | torch.Tensor,
               key: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`draw`'s token ids as a tensor where the logits are (nothing read on the host yet); ``key``: the
        noise's stream key as a device tensor, or one per row (:meth:`keys`; see
        :func:`~mirrorsd.sampling.keyed_uniforms`)."""
        drawn = choose(logits, positions, self.params, self.noise, key)
        return self.subset.ids[drawn] if self.subset_columns else drawn

    def doubtful(self, top: float) -> bool:
        return top < self.confidence

    def tokens_of(self, drawn: list[int]) -> list[int]:
        """Token ids of what :func:`sample` drew from this sampler's logits (subset columns map back)."""
        return self.subset.ids[drawn].tolist() if self.subset_columns else drawn

    def likeliest(self, logits: torch.Tensor) -> list[list[int]]:
        """Per row of ``logits``, the ``runner_ups`` likeliest token ids, best first."""
        return self.likeliest_ids(logits).tolist()

    def likeliest_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`likeliest` as a ``[rows, runner_ups]`` tensor where the logits are."""
        top = logits.topk(min(self.runner_ups, logits.shape[-1]), dim=-1).indices
        return self.subset.ids[top] if self.subset_columns else top

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's distribution over the target's vocabulary."""
        q = probabilities(logits, self.params) if not self.params.greedy else logits.double().softmax(-1)
        return torch.nn.functional.pad(q, (0, self.pad)) if self.pad else q
