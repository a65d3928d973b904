"""Shared proposers: a draft model drafting one token per forward (:class:`ModelProposer`, vanilla SD's
drafting and Mirror-SD's fresh rollouts), and the same draft with Speculative Streaming passes
(:class:`StreamProposer`: the same tokens, several per forward).

Both keep the draft's cache in :class:`~mirrorsd.decoding.engine.RequestState` (``draft_cache`` holds a prefix
of the committed tokens, ``pending`` is the rest) and roll it back on the verdict.

Two policies change only *how many* tokens are proposed, never what is committed: ``confidence`` (the draft
core's rule, :mod:`.drafting`) and ``schedule="heuristic"``: the window limit grows by 2 after a fully accepted
step and shrinks by 1 otherwise (HF's ``num_assistant_tokens_schedule``); ``"constant"`` keeps γ.
"""

from __future__ import annotations

import torch

from ..model import Transformer
from ..sampling import SamplingParams
from ..verify import Verdict
from .draft_graph import graphed_draft
from .drafting import DraftSampler, prompt_window, window_end
from .engine import DrawnChain, Proposal, RequestState, Scores, draft_tokens
from .streams.adapters import StreamAdapters
from .streams.passes import DEFAULT_TREE_BUDGET, DEFAULT_TREE_K, StreamGuesses, ss_pass

SCHEDULES = ("constant", "heuristic")


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


class ModelProposer:
    """A draft model, one token per forward, each step through the draft core (:class:`DraftSampler`: noise,
    distributions, the confidence rule, a reduced vocabulary)."""

    def __init__(self, draft: Transformer, target_vocab: int, params: SamplingParams, gamma: int, *,
                 confidence: float = 0.0, rejection: bool = False, schedule: str = "constant",
                 vocab: int = 0, context: int = 0, cut_on_device: bool = False) -> None:
        self.model, self.params, self.gamma, self.confidence, self.schedule = draft, params, gamma, confidence, schedule
        # the confidence rule decided where the draft runs, where a graph applies (:meth:`_graphed`): a window then
        # reads the host once, with the verdict, and the target scores its steps past the cut too; ``through_end``: its
        # last proposed token fed too (Mirror-SD sets it where its tree rollouts start from the window unread)
        self.cut_on_device, self.through_end = cut_on_device, False
        self.cut_from = 0  # a cut chain's first step's cache slot
        self.sampler = DraftSampler(draft, target_vocab, params, confidence=confidence, rejection=rejection,
                                    vocab=vocab)
        self.rejection = self.sampler.rejection
        self.context = context  # > 0: the draft reads SINK_TOKENS + the last ``context`` prompt tokens
        self.skipped = 0  # prompt tokens the draft's cache leaves out (the cache's positions close the gap)
        self.last: Proposal | None = None  # the last draft proposed

    @property
    def subset(self) -> object | None:
        return self.sampler.subset

    def start(self, state: RequestState) -> None:
        pass

    def propose(self, state: RequestState, window: int | None = None) -> Proposal:
        """Feed ``state.pending``, then draft up to ``window`` tokens (default: γ within the room left). The
        cache ends holding the committed text and every proposed token but the last (a window cut on the device:
        once :meth:`settled`)."""
        window = min(self.gamma, state.room) if window is None else window
        model, sampler, cache = self.model, self.sampler, state.draft_cache
        position = len(state.tokens)  # of the first drafted token
        sampler.begin(position)
        if not (sampler.need_probs or sampler.runner_ups):
            return self._chain(state, window)
        if self.cut_on_device and not (sampler.rejection or sampler.runner_ups):
            cut = self._graphed(state, window, cut=True)
            if cut is not None:
                return cut
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        alternatives: list[list[int]] = []
        forwards = fed = 0
        for i in range(window):
            feed = self.first_feed(state) if i == 0 else tokens[-1:]
            fed = fed or len(feed)
            logits = model(draft_tokens(model, feed), cache=cache, last=1, head=sampler.head)[0]
            forwards += 1
            q, top = sampler.judge(logits)
            doubtful = top is not None and sampler.doubtful(top[0])
            if doubtful and i == 0:
                break
            if q is not None:
                q_rows.append(q[0])
            tokens += sampler.draw(logits, [position + i])
            if sampler.runner_ups:
                alternatives += sampler.likeliest(logits)
            if doubtful:
                break
        self.last = Proposal(tokens, probs=torch.stack(q_rows) if q_rows else None, forwards=forwards, fed=fed,
                          alternatives=alternatives if sampler.runner_ups else None)
        return self.last

    def _chain(self, state: RequestState, window: int) -> Proposal:
        """:meth:`propose` where no step reads its logits on the host (no confidence rule, no distributions, no
        runner-ups): each drawn token feeds the next forward where it was drawn, and the window stays there until the
        verdict reads it with the target's own tokens (:class:`DrawnChain`). On a GPU the draft's forwards then queue
        back to back, and the target's forward behind them, with one host read per step; where a graph applies, the
        whole window is one replay (:meth:`_graphed`)."""
        graphed = self._graphed(state, window)
        if graphed is not None:
            return graphed
        model, position, cache = self.model, len(state.tokens), state.draft_cache
        feed = self.first_feed(state) if window else []
        ids = draft_tokens(model, feed)
        drawn: list[torch.Tensor] = []
        for i in range(window):
            logits = model(ids, cache=cache, last=1, head=self.sampler.head)[0]
            drawn.append(self.sampler.choose(logits, [position + i]))
            ids = drawn[-1].view(1, 1)
        self.last = DrawnChain(torch.cat(drawn), forwards=window, fed=len(feed)) if drawn else Proposal()
        return self.last

    def _graphed(self, state: RequestState, window: int, cut: bool = False) -> DrawnChain | None:
        """The window as one replay (:func:`.draft_graph.graphed_draft`, with the last fed token as its one root),
        where one applies: a CPU and a shape's first sight give None. ``cut``: under the confidence rule, the steps
        after the first doubtful token skipped on the device, and the window cut there when it is read (with the
        verdict; :meth:`settled`): the host loop's tokens, with one host read."""
        cache = state.draft_cache
        feed = self.first_feed(state) if window else []
        if not feed:
            return None
        root = len(cache) + len(feed) - 1  # the cache slot of the last fed token, where the steps start
        graphed = graphed_draft(self.model, cache, self.sampler, feed[:-1], [root], feed[-1:], window, self.skipped,
                                cut, self.through_end)
        if graphed is None:
            return None
        out, _ = graphed
        tokens, end = out if cut else (out, None)
        self.cut_from = root
        self.last = DrawnChain(tokens[0], forwards=window, fed=len(feed), end=end, through_end=self.through_end)
        return self.last

    def settled(self, state: RequestState, window: Proposal) -> Proposal:
        """``window`` as the host loop leaves it: a cut chain (:meth:`_graphed`) read (with the verdict, where that
        came first) and the draft cache truncated to the committed text and every proposed token but the last (the
        steps the host loop runs; ``through_end`` ran one more). Mirror-SD reads a fresh window at once where its tree
        rollouts' roots are read on the host anyway."""
        if isinstance(window, DrawnChain) and window.end is not None:
            proposed = len(window.tokens)  # (one read, or none after the verdict's)
            state.draft_cache.truncate(self.cut_from + max(proposed, 1))
        return window

    def first_feed(self, state: RequestState) -> list[int]:
        """``state.pending``, or, for the prompt prefill, the draft core's prompt window of it."""
        if len(state.draft_cache):
            return state.pending
        feed, skipped = prompt_window(state.pending, self.context)
        self.skipped = skipped or self.skipped
        return feed

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        own = scores.scored(self.last)  # a hybrid may have scored another proposer's draft
        if own:
            self.settled(state, scores.draft)
        self.rollback(state, verdict.accepted, self.skipped)
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
    stream, so the window equals the draft's plain autoregressive continuation, in fewer forwards. ``vocab`` restricts
    the main rows' head as it does the AR draft's (the streams read the vocabulary they were trained on)."""

    def __init__(self, draft: Transformer, adapters: StreamAdapters, target_vocab: int, params: SamplingParams,
                 gamma: int, *, confidence: float = 0.0, rejection: bool = False, schedule: str = "constant",
                 tree_k: int = DEFAULT_TREE_K, tree_budget: int = DEFAULT_TREE_BUDGET, defer: str = "auto",
                 vocab: int = 0) -> None:
        super().__init__(draft, target_vocab, params, gamma, confidence=confidence, rejection=rejection,
                         schedule=schedule, vocab=vocab)
        self.adapters, self.tree_k, self.tree_budget, self.defer = adapters, tree_k, tree_budget, defer
        self.stream_head = adapters.head(draft)  # the vocabulary the streams were trained on

    def propose(self, state: RequestState, window: int | None = None, streams: int | None = None) -> Proposal:
        """``streams``: pass with only the first of the adapters' streams (fewer rows for a busy batch)."""
        window = min(self.gamma, state.room) if window is None else window
        streams = self.adapters.stream_count(streams)
        cache, position, sampler = state.draft_cache, len(state.tokens), self.sampler
        sampler.begin(position)
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        tops: list[float] = []
        trunk, guesses, forwards, end = list(state.pending), StreamGuesses(), 0, window
        while len(tokens) < window:
            depth = min(streams, window - len(tokens) - 1)
            tree = guesses.tree(depth, self.tree_budget)
            # the next pass, after at least one more token, reads streams 1..window - len(tokens) - 2 at most
            rows = max(1, min(streams, window - len(tokens) - 2))
            result = ss_pass(self.model, self.adapters, cache, trunk, tree, sampler.params, noise=sampler.noise,
                             tree_k=self.tree_k, head=self.stream_head, streams=rows, defer=self.defer,
                             main_head=sampler.id_head)
            forwards += 1
            new = [*result.accepted, result.next_token]
            tokens += new
            trunk, guesses = [new[-1]], result.candidates
            if not sampler.need_probs:
                continue
            q, top = sampler.judge(result.path_logits)
            q_rows += list(q) if q is not None else []
            tops += top
            if self.confidence > 0 and min(tops[:window]) < self.confidence:  # propose() stops at the first doubt
                end = window_end(tops[:window], self.confidence)
                break
        tokens, q_rows = tokens[:end], q_rows[:end]
        cache.truncate(position + max(end, 1) - 1)
        self.last = Proposal(tokens, probs=torch.stack(q_rows) if q_rows else None, forwards=forwards)
        return self.last
