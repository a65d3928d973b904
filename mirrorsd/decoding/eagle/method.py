"""``eagle``: drafting with an EAGLE-3-style head over the target's own features (Li et al., arXiv 2503.01840).

One step: the target scores ``[last committed, d_1..d_k]`` and keeps, for every row, the states entering its
blocks 2, N/2 and N - 3 (:class:`FeatureScorer`); the verifier accepts ``A`` tokens and gives the target's own next
one; the head then reads the accepted rows' features with the tokens after them (its cache now holds exact rows up
to the last accepted position, and its last row drafts the next window's first token) and drafts the rest one
token per step from its own output states (:class:`HeadProposer`). The head's tokens are its argmax; the target's
``match`` verifier keeps the output the target's, greedy or sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...draft_vocab import draft_table_kind
from ...kept import Kept
from ...model import PREFILL_CHUNK, Transformer
from ...verify import Verdict
from ..drafting import draft_vocab_option, draft_vocab_size
from ..engine import ChainScorer, DecodeRequest, Proposal, RequestState, Roles, Scores, match
from ..registry import MethodOptions, at_least, option, register
from .head import EagleHead, feature_layers, load_head
from .runtime import HeadRunner


@dataclass(frozen=True)
class EagleOptions(MethodOptions):
    head: Any = option(None, "the trained head: a `mirrorsd train-eagle` folder (or an EagleHead)", parse=str,
                       metavar="FOLDER", required="a folder from `mirrorsd train-eagle` (--head FOLDER)")
    gamma: int = option(5, "draft tokens per verification window (a chain)", check=at_least(1))
    draft_vocab: int | None = draft_vocab_option(None)


class FeatureScorer(ChainScorer):
    """:class:`ChainScorer` that keeps the head's inputs of every row it runs: the target's forward in segments
    split at the feature layers, the same layers and the same bits as one call."""

    def __init__(self, model: Transformer) -> None:
        super().__init__(model)
        self.layers = feature_layers(model.config.n_layers)
        self.features: torch.Tensor | None = None  # [rows, 3h] of the last forward (the prompt after prefill)

    def _run(self, tokens: list[int], cache: Any, logits: bool) -> torch.Tensor | None:
        model = self.model
        ids = torch.tensor([tokens], device=model.device)
        past = cache.lengths[0]
        features, finals = [], []
        for begin in range(0, len(tokens), PREFILL_CHUNK):  # (a long prompt in pieces, as the model's own prefill)
            piece = ids[:, begin:begin + PREFILL_CHUNK]
            positions = torch.arange(past + begin, past + begin + piece.shape[1], device=model.device)[None]
            hidden, start, taken = model.embed(piece), 0, []
            for layer in self.layers:
                hidden = model.run_layers(hidden, positions, cache, None, start, layer)
                taken.append(hidden[0])
                start = layer
            finals.append(model.run_layers(hidden, positions, cache, None, start, None))
            features.append(torch.cat(taken, -1))
        self.features = torch.cat(features)
        return model.logits(torch.cat(finals, 1))[0] if logits else None

    def prefill(self, state: RequestState) -> int:
        self.features = None
        if len(state.tokens) < 2:
            return 0
        self._run(state.tokens[:-1], state.target_cache, logits=False)
        return 1

    def score(self, state: RequestState, draft: Proposal) -> Scores:
        return Scores(self._run([state.tokens[-1], *draft.tokens], state.target_cache, logits=True), draft)


class HeadProposer:
    """The head's chain after the last committed token; its cache (``state.draft_cache``) holds exact rows --
    target features -- up to the position before the last committed token, and the chain's rows past them."""

    def __init__(self, runner: HeadRunner, scorer: FeatureScorer, gamma: int) -> None:
        self.runner, self.scorer, self.gamma = runner, scorer, gamma
        self.head_state: torch.Tensor | None = None  # the last exact row's output state
        self.first: int | None = None  # the token it drafts: the next window's first
        self.fed = 0  # rows the last catch-up read (the one that drafted ``first``)

    def start(self, state: RequestState) -> None:
        request = state.request
        # a chain's rows past the committed text: a window never holds more than the tokens left (γ may be 10**12)
        window = min(self.gamma, request.max_new_tokens)
        state.draft_cache = self.runner.new_cache(len(request.prompt_ids) + request.max_new_tokens + window + 2)
        if self.scorer.features is not None:  # the prompt's rows 0..L-2 read tokens 1..L-1
            self._catch_up(state, state.tokens[1:], self.scorer.features, 0)

    def _catch_up(self, state: RequestState, tokens: list[int], features: torch.Tensor, position: int) -> None:
        self.head_state, self.first = self.runner.rows(tokens, features, position, state.draft_cache, fed_back=False)
        self.fed = len(tokens)

    def propose(self, state: RequestState) -> Proposal:
        window = min(self.gamma, state.room)
        if window <= 0 or self.first is None:
            return Proposal()
        tokens, feature = [self.first], self.head_state
        position = len(state.tokens) - 1  # of the second drafted token's row (the last committed token's)
        for i in range(1, window):
            feature, token = self.runner.rows([tokens[-1]], feature, position + i - 1, state.draft_cache, fed_back=True)
            tokens.append(token)
        # The head's forwards are draft forwards (a step the batch waits for, which the goodput rule prices): the
        # catch-up that drafted the first token, then one per further token.
        return Proposal(tokens, forwards=window, fed=self.fed)

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        before = len(state.tokens) - verdict.accepted - 1  # committed tokens before the step
        state.draft_cache.truncate(before - 1)  # exact rows: positions up to the one before the window's first
        rows = verdict.accepted + 1
        self._catch_up(state, state.tokens[before:before + rows], self.scorer.features[:rows], before - 1)


KEPT_RUNNERS = 2  # runners kept per target (a server's clients may ask for any draft_vocab: ~125 MB each on SmolLM2)
_RUNNERS = Kept(KEPT_RUNNERS)  # target -> {(head, vocab): HeadRunner}


def runner_for(target: Transformer, source: str | Path | EagleHead, vocab: int) -> HeadRunner:
    """One runner per target, head and vocabulary, shared by every request (its int8 weights are built once)."""
    key = (source, vocab) if isinstance(source, EagleHead) else (*_saved(Path(source)), vocab)
    return _RUNNERS.get(target, key, lambda: HeadRunner(target, load_head(target, source), vocab,
                                                        draft_table_kind(target.config.vocab_size)))


def _saved(folder: Path) -> tuple[str, float]:
    """A head folder as a cache key: its path and its files' latest change (a head saved again into the same
    folder, as successive checkpoints are, is read again rather than served stale)."""
    folder = folder.resolve()
    files = [f for f in folder.iterdir() if f.is_file()] if folder.is_dir() else []  # (none: load_head says so)
    return str(folder), max((f.stat().st_mtime_ns for f in files), default=0)


def build(req: DecodeRequest, opts: EagleOptions) -> Roles:
    runner = runner_for(req.target, opts.head, draft_vocab_size(opts.draft_vocab, req.target))
    scorer = FeatureScorer(req.target)
    return Roles(HeadProposer(runner, scorer, opts.gamma), scorer, match, gamma=opts.gamma)


register("eagle", "an EAGLE-3-style head drafts a chain from the target's own hidden states (`mirrorsd "
         "train-eagle`)", needs_draft=False, options=EagleOptions, build=build)
