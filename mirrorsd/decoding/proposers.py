"""Shared proposers: a draft model drafting one token per forward (:class:`ModelProposer`, vanilla SD's
drafting and Mirror-SD's fresh rollouts), and the same draft with Speculative Streaming passes
(:class:`StreamProposer`: the same tokens, several per forward).

Both keep the draft's cache in :class:`~mirrorsd.decoding.engine.RequestState` (``draft_cache`` holds a prefix
of the committed tokens, ``pending`` is the rest) and roll it back on the verdict.

Two policies change only *how many* tokens are proposed, never what is committed:

* ``confidence``: the window ends at the first position where the draft's most likely token has less than
  this probability. That token is still proposed (it is drafted already, and once a window is non-empty one
  more token barely changes the cost of verifying it) -- unless it would be the first: on a CPU verifying one
  draft token costs about a whole extra target forward, so then the window stays empty and the step is a
  plain 1-token target forward. (HF's ``assistant_confidence_threshold`` always proposes it.) The decision
  reads the draft's distribution only, never its draw, so rejection sampling still sees proposals drawn
  exactly from q.
* ``schedule="heuristic"``: the window limit grows by 2 after a fully accepted step and shrinks by 1
  otherwise (HF's ``num_assistant_tokens_schedule``); ``"constant"`` keeps γ.
"""

from __future__ import annotations

from typing import Any

import torch

from ..draft_vocab import DEFAULT_SIZE, draft_table_kind, subset_head
from ..model import Transformer
from ..sampling import Noise, SamplingParams, probabilities, sample
from ..streams import StreamAdapters
from ..verify import Verdict
from .engine import Draft, RequestState, Scores, draft_tokens
from .registry import at_least, option
from .streaming import DEFAULT_TREE_BUDGET, DEFAULT_TREE_K, Candidates, ss_pass

SCHEDULES = ("constant", "heuristic")
SINK_TOKENS = 4  # first prompt tokens a ``context``-limited draft always keeps (StreamingLLM's attention sinks)


def draft_vocab_option(default: int | None = 0) -> Any:
    """The reduced-vocabulary option, shared by the methods that draft with a model (``None``: the measured
    default, :func:`draft_vocab_size`)."""
    return option(default, "restrict the draft model's LM head to the N most frequent token ids of the table "
                  "shipped for its tokenizer (the draft table, else the corpus table; FR-Spec; lossless: the target "
                  "verifies with its full vocabulary); 0: the full vocabulary", parse=int, check=at_least(0),
                  default_text="32768 where a draft table ships" if default is None else None)


def draft_vocab_size(option: int | None, draft: Transformer) -> int:
    """The draft vocabulary an option asks for: ``None`` is :data:`~mirrorsd.draft_vocab.DEFAULT_SIZE` where a
    draft table (ranked by the target's answers) ships for the draft's vocabulary and it is larger, else the full
    one (measured on Spec-Bench: docs/drafting.md)."""
    if option is not None:
        return option
    vocab = draft.config.vocab_size
    return DEFAULT_SIZE if vocab > DEFAULT_SIZE and draft_table_kind(vocab) == "draft" else 0


def check_draft(target: Transformer, draft: Transformer | None) -> None:
    """The draft must share the target's token ids; its embedding may be smaller (Qwen2.5-7B pads its
    vocabulary to 152,064 rows while 0.5B-3B have 151,936 with the same tokenizer)."""
    if draft is None:
        raise ValueError("speculative decoding needs a draft model (draft=... / --draft)")
    if draft.config.vocab_size > target.config.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.config.vocab_size}) is larger than the target's "
            f"({target.config.vocab_size}); the draft must share the target's tokenizer"
        )


def window_end(top_probs: list[float], confidence: float) -> int:
    """How many of a rollout's tokens to propose under the confidence rule (all when ``confidence`` is 0):
    through the first doubtful token, or none when the first one is doubtful."""
    for i, p in enumerate(top_probs):
        if p < confidence:
            return 0 if i == 0 else i + 1
    return len(top_probs)


class ModelProposer:
    """A draft model, one token per forward.

    ``rejection``: the draft's draws use their own noise key and keep their distributions (speculative
    sampling needs them independent of the acceptance noise); otherwise the draft is coupled to the target's
    noise, which maximises sample-and-match acceptance.
    """

    def __init__(self, draft: Transformer, target_vocab: int, params: SamplingParams, gamma: int, *,
                 confidence: float = 0.0, rejection: bool = False, schedule: str = "constant",
                 vocab: int = 0, context: int = 0) -> None:
        self.model, self.params, self.gamma, self.confidence, self.schedule = draft, params, gamma, confidence, schedule
        self.context = context  # > 0: the draft reads SINK_TOKENS + the last ``context`` prompt tokens
        self.skipped = 0  # prompt tokens the draft's cache leaves out (the cache's positions close the gap)
        # A reduced draft vocabulary (FR-Spec). Greedy drafts read its logits as they come (an argmax and a
        # top probability need no full row); sampled ones scatter them into the full vocabulary, where the
        # noise is keyed by token id.
        self.subset = subset_head(draft, vocab, draft_table_kind(draft.config.vocab_size)) if vocab else None
        self.subset_columns = self.subset is not None and params.greedy  # logits' column c is token subset.ids[c]
        self.head = self.subset.full if self.subset is not None and not params.greedy else self.subset
        self.rejection = rejection and not params.greedy
        self.noise = Noise.DRAFT if self.rejection else Noise.TARGET
        self.need_probs = self.rejection or confidence > 0
        self.pad = target_vocab - draft.config.vocab_size
        self.last: Draft | None = None  # the last draft proposed
        self.runner_ups = 0  # > 0: drafts also carry this many likeliest tokens per position (Mirror-SD's roots)

    def start(self, state: RequestState) -> None:
        pass

    def propose(self, state: RequestState, window: int | None = None) -> Draft:
        """Feed ``state.pending``, then draft up to ``window`` tokens (default: γ within the room left). The
        cache ends holding the committed text and every proposed token but the last."""
        window = min(self.gamma, state.room) if window is None else window
        model, params, cache = self.model, self.params, state.draft_cache
        position = len(state.tokens)  # of the first drafted token
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        alternatives: list[list[int]] = []
        forwards = fed = 0
        for i in range(window):
            feed = self.first_feed(state) if i == 0 else tokens[-1:]
            fed = fed or len(feed)
            logits = model(draft_tokens(model, feed), cache=cache, last=1, head=self.head)[0]
            forwards += 1
            doubtful = False
            if self.rejection:
                q = self.distribution(logits)[0]
                doubtful = q.max().item() < self.confidence
                if doubtful and i == 0:
                    break
                q_rows.append(q)
            elif self.need_probs:
                doubtful = self.top_probability(logits) < self.confidence
                if doubtful and i == 0:
                    break
            tokens += self.tokens_of(sample(logits, [position + i], params, self.noise))
            if self.runner_ups:
                alternatives += self.likeliest(logits)
            if doubtful:
                break
        self.last = Draft(tokens, probs=torch.stack(q_rows) if self.rejection and q_rows else None, forwards=forwards,
                          fed=fed, alternatives=alternatives if self.runner_ups else None)
        return self.last

    def tokens_of(self, drawn: list[int]) -> list[int]:
        """Token ids of what :func:`sample` drew from this proposer's logits (subset columns map back)."""
        return self.subset.ids[drawn].tolist() if self.subset_columns else drawn

    def likeliest(self, logits: torch.Tensor) -> list[list[int]]:
        """Per row of ``logits``, the ``runner_ups`` likeliest token ids, best first."""
        top = logits.topk(min(self.runner_ups, logits.shape[-1]), dim=-1).indices
        return [self.tokens_of(row) for row in top.tolist()]

    def first_feed(self, state: RequestState) -> list[int]:
        """``state.pending``, or, for the prompt prefill with ``context``, its first SINK_TOKENS and last ``context``
        tokens (StreamingLLM's sink and window): a draft's prompt prefill is what makes it lose on long prompts,
        and its next tokens depend mostly on the recent text."""
        pending = state.pending
        if not self.context or len(state.draft_cache) or len(pending) <= SINK_TOKENS + self.context:
            return pending
        self.skipped = len(pending) - SINK_TOKENS - self.context
        return pending[:SINK_TOKENS] + pending[-self.context:]

    def top_probability(self, logits: torch.Tensor) -> float:
        """The draft's top-token probability, all the confidence rule reads: greedy needs no distribution (a
        softmax in double over 152k ids per draft token was a third of sd's time outside the forwards)."""
        if not self.params.greedy:
            return self.distribution(logits)[0].max().item()
        row = logits[0]
        return (row.max() - row.logsumexp(-1)).exp().item()

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's distribution over the target's vocabulary (softmax when greedy: the confidence rule)."""
        q = probabilities(logits, self.params) if not self.params.greedy else logits.double().softmax(-1)
        return torch.nn.functional.pad(q, (0, self.pad)) if self.pad else q

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        self.rollback(state, verdict.accepted, self.skipped)
        own = scores.draft is self.last  # a hybrid may have scored another proposer's draft
        if own and scores.draft.tokens and self.schedule == "heuristic":
            full = verdict.accepted == len(scores.draft.tokens)
            self.gamma = self.gamma + 2 if full else max(1, self.gamma - 1)

    @staticmethod
    def rollback(state: RequestState, accepted: int, skipped: int = 0) -> None:
        """Keep what the draft cache saw of the committed text; the rest becomes ``pending``. ``skipped``: prompt
        tokens the cache leaves out (``context``), so it holds ``len(cache) + skipped`` tokens' worth of text."""
        before = len(state.tokens) - accepted - 1  # committed length before the step
        keep = min(len(state.draft_cache) + skipped, before + accepted)
        state.draft_cache.truncate(keep - skipped)
        state.pending = state.tokens[keep:]


class StreamProposer(ModelProposer):
    """:class:`ModelProposer` with Speculative Streaming passes: each pass is verified by the draft's own main
    stream, so the window equals the draft's plain autoregressive continuation, in fewer forwards."""

    def __init__(self, draft: Transformer, adapters: StreamAdapters, target_vocab: int, params: SamplingParams,
                 gamma: int, *, confidence: float = 0.0, rejection: bool = False,
                 tree_k: int = DEFAULT_TREE_K, tree_budget: int = DEFAULT_TREE_BUDGET) -> None:
        super().__init__(draft, target_vocab, params, gamma, confidence=confidence, rejection=rejection)
        self.adapters, self.tree_k, self.tree_budget = adapters, tree_k, tree_budget
        self.stream_head = adapters.head(draft)  # the vocabulary the streams were trained on

    def propose(self, state: RequestState, window: int | None = None) -> Draft:
        window = min(self.gamma, state.room) if window is None else window
        cache, position = state.draft_cache, len(state.tokens)
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        trunk, candidates, forwards, end = list(state.pending), Candidates(), 0, window
        while len(tokens) < window:
            depth = min(self.adapters.config.streams, window - len(tokens) - 1)
            tree = candidates.tree(depth, self.tree_budget)
            result = ss_pass(self.model, self.adapters, cache, trunk, tree, self.params, noise=self.noise,
                             tree_k=self.tree_k, head=self.stream_head)
            forwards += 1
            new = [*result.accepted, result.next_token]
            tokens += new
            trunk, candidates = [new[-1]], result.candidates
            if not self.need_probs:
                continue
            q_rows.extend(self.distribution(logits[None])[0] for logits in result.path_logits)
            tops = [q.max().item() for q in q_rows[:window]]
            if self.confidence > 0 and min(tops) < self.confidence:  # propose() stops at the first doubtful one
                end = window_end(tops, self.confidence)
                break
        tokens, q_rows = tokens[:end], q_rows[:end]
        cache.truncate(position + max(end, 1) - 1)
        self.last = Draft(tokens, probs=torch.stack(q_rows) if self.rejection and q_rows else None, forwards=forwards)
        return self.last
