"""The one decoding loop every method runs, and the roles it is made of.

One step: the **proposer** drafts (a chain or a tree of tokens, optionally with the distributions they were
drawn from) → the **scorer** runs the target over them → a **verifier** accepts a prefix (a tree path) and
gives the target's own next token → the scorer **commits** (truncates or compacts the target cache) → the
proposer gets the verdict **back** (rolls back its own cache, adapts its window, picks its next draft) → the
committed tokens are yielded. ``ar`` is the proposer that never drafts.

Everything one request owns lives in :class:`RequestState` (committed tokens, caches, tokens the draft cache
lacks, the produced count, statistics), so the roles hold only models and settings.

The caller (:mod:`mirrorsd.api`) owns stopping: EOS, stop strings and ``max_new_tokens`` cut the output and
close the generator; the loop only keeps every window inside ``max_new_tokens`` so no work is wasted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..execution import batcher
from ..kv_cache import KVCache
from ..model import Transformer
from ..prefix_cache import PrefixCache
from ..runtime.trace import Span
from ..sampling import SamplingParams, choose, rows_apart
from ..transfer import read_all, read_soon, send
from ..verify import Verdict, chain_verdict, tree_positions, verify_match, verify_rejection, verify_tree

if TYPE_CHECKING:
    from .bridge import TokenBridge

# -- what crosses between the roles -------------------------------------------------------------------------


@dataclass
class Proposal:
    """What a proposer offers for verification: draft tokens after the last committed token, a chain, or a tree when
    ``parents`` is set (``parents[i]`` is the index of token i's parent, -1 for the last committed token; parents
    come first). (Named apart from the draft model that may have made it.)"""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] | None = None
    probs: torch.Tensor | None = None  # [len(tokens), vocab] distributions the tokens were drawn from (rejection)
    forwards: int = 0  # draft forwards it took
    fed: int = 0  # tokens the draft model read in the first of them (its catch-up; the prompt on the first step)
    alternatives: list[list[int]] | None = None  # [len(tokens)][k]: the draft's k likeliest tokens at each position

    @property
    def length(self) -> int:
        """Draft tokens (without reading a :class:`DrawnChain`'s)."""
        return len(self.tokens)

    def on(self, device: torch.device) -> torch.Tensor:
        """The tokens as ``[length]`` ids on ``device``, sent without a host sync."""
        return send(self.tokens, device)

    @property
    def depth(self) -> int:
        """Window positions drafted (the deepest tree level)."""
        if self.parents is None:
            return self.length
        return max(tree_positions(self.parents, 0))


class DrawnChain(Proposal):
    """A chain still where the draft drew it (``ids``, on the draft's device), so that a step reads the host once:
    the target's forward takes ``ids`` as they are (:meth:`on`), and :func:`match` reads them together with the
    target's own tokens (:meth:`verdict`). Anything else that asks for ``tokens`` reads them then.

    ``end`` (``[1]``, beside ``ids``): the confidence rule's window end, decided on the device
    (:class:`~.draft_graph.DraftGraph`'s ``cut``). The target scores all of ``ids``, and what is read is cut there:
    ``tokens``, and ``forwards``, the draft steps that ran (through the first doubtful token, and one more
    ``through_end``)."""

    def __init__(self, ids: torch.Tensor, forwards: int = 0, fed: int = 0, end: torch.Tensor | None = None,
                 through_end: bool = False) -> None:
        super().__init__(forwards=forwards, fed=fed)
        self.ids, self.end, self.through_end, self._read = ids.reshape(-1), end, through_end, None

    @property  # type: ignore[override]
    def tokens(self) -> list[int]:
        if self._read is None:
            self._take(*read_all(self.ids, *self._ends(self.ids.device)))
        return self._read

    @tokens.setter
    def tokens(self, values: list[int]) -> None:  # (Proposal.__init__ sets an empty list, before ``ids`` exist)
        self._read = list(values)

    def _ends(self, device: torch.device) -> list[torch.Tensor]:
        return [] if self.end is None else [self.end.to(device)]

    def _take(self, ids: list[int], end: list[int] | None = None) -> None:
        if end is not None:
            ids, self.forwards = ids[:end[0]], min(max(end[0], 1) + self.through_end, len(ids))
        self._read = ids

    @property
    def unread(self) -> bool:
        return self._read is None

    @property
    def length(self) -> int:
        """The tokens the target scores until they are read, then the tokens proposed (cut at ``end``)."""
        return self.ids.numel() if self._read is None else len(self._read)

    def on(self, device: torch.device) -> torch.Tensor:
        return self.ids.to(device) if self.unread else super().on(device)

    def verdict(self, own: torch.Tensor, rider: VerdictRider | None = None) -> Verdict:
        """:func:`~mirrorsd.verify.chain_verdict` against the target's own token at every row it scored (``length +
        1``, on the target's device), with the draft's tokens, and what ``rider`` computes from the verdict on the
        device, read in the same host read."""
        ids, ends = self.ids.to(own.device)[: own.numel() - 1], self._ends(own.device)  # (a cut chain read before)
        riding: list[torch.Tensor] = []
        if rider is not None:  # the verdict on the device: the leading matches, and the target's token after them
            accepted = (ids == own[:-1]).long().cumprod(0).sum().view(1)
            if ends:
                accepted = torch.minimum(accepted, ends[0])
            riding = rider.tensors(accepted, own.gather(0, accepted))
        tokens, every, *rest = read_all(ids, own, *ends, *riding)
        self._take(tokens, rest.pop(0) if ends else None)
        if rider is not None:
            rider.read(rest)
        return chain_verdict(self.tokens, every)


class VerdictRider(Protocol):
    """Device work keyed on a chain's verdict, read in the verdict's own host read (:meth:`DrawnChain.verdict`):
    Mirror-SD picks the branch a verdict keeps this way, so its step reads the host once. A rider that was not read
    (the verdict was taken on the host) leaves its owner to decide on the host."""

    def tensors(self, accepted: torch.Tensor, correction: torch.Tensor) -> list[torch.Tensor]:
        """What to read, from the accepted count and the correction (``[1]`` each, on the target's device)."""
        ...

    def read(self, values: list) -> None:
        """Those tensors' values, read."""
        ...


@dataclass
class Scores:
    """The target's verdict material: ``logits`` row 0 follows the last committed token, row i+1 follows
    ``draft.tokens[i]`` (``draft`` is what was scored: a scorer may prune a tree)."""

    logits: torch.Tensor
    draft: Proposal
    forwards: int = 1  # target forwards it took
    own: list[int] | None = None  # the target's own token at every row, where the scorer chose and read them already
    own_ids: torch.Tensor | None = None  # the same, chosen where the logits are (inside their forward) and not read
    rider: VerdictRider | None = None  # device work the verdict's host read carries along, if it reads on the device
    proposed: Proposal | None = None  # the proposal the scorer was given, where ``draft`` is a pruned copy of it

    def scored(self, proposal: Proposal | None) -> bool:
        """Whether these scores verify ``proposal`` (or the tree a scorer pruned from it): a hybrid's proposers
        learn only from their own windows."""
        return proposal is not None and (self.draft is proposal or self.proposed is proposal)


class MethodStats(Protocol):
    """A method's own statistics in ``GenerationStats.extra``: how the CLI, the benchmark and the JSON output read
    them without knowing the method."""

    def to_dict(self) -> dict[str, Any]: ...

    def summary(self) -> str:
        """A clause for the one-line run summary (``", call reduction 1.52 tokens/pass, …"``)."""
        ...

    def counters(self) -> dict[str, float]:
        """Sums the benchmark pools over a method's turns (``bench.metrics.method_extras`` reads them)."""
        ...

    def timeline(self) -> bool | None:
        """Whether this run's spans make the benchmark's timeline: True (overlapped lanes), False (serial, shown
        only when no overlapped run exists), None (not a timeline)."""
        ...


@dataclass
class GenerationStats:
    """Per-generation counters. ``accepted``/``drafted``: draft tokens accepted / proposed at each step."""

    method: str
    seed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values a prefix cache held (not prefilled)
    new_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    gamma: int = 0  # the configured window (γ; a tree's depth); 0 for methods that never draft
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    step_log: list[dict[str, Any]] = field(default_factory=list)  # per step: what the planner's cost model reads
    step_s: list[float] = field(default_factory=list)  # per step: wall seconds, proposal to feedback, batched
    # forwards included (methods with ``Roles.timed_steps``): what the goodput rule prices a drafting step's own work by
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0  # time in the proposer (drafting the loop waited for)
    target_s: float = 0.0  # target forwards after prefill, with verification
    extra: dict[str, MethodStats] = field(default_factory=dict)  # method name -> its own statistics
    spans: list[Span] = field(default_factory=list)  # timeline (methods that trace their lanes)

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def max_drafted(self) -> int:
        """The largest window actually drafted (the confidence rule and the end of the output cut windows)."""
        return max(self.drafted, default=0)

    @property
    def accepted_output(self) -> int:
        """Accepted draft tokens that reached the output: a step cut by EOS or a stop string (its ``output`` in the
        step log) accepted tokens past the cut, which the verifier counts but the answer does not hold."""
        return sum(min(a, step.get("output", a)) for a, step in zip(self.accepted, self.step_log, strict=False))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target decoding step, accepted + 1 averaged over steps (Spec-Bench's convention; a
        step with an empty window counts as 1)."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 1.0

    def record_step(self, drafted: int, accepted: int, **detail: Any) -> None:
        self.drafted.append(drafted)
        self.accepted.append(accepted)
        self.step_log.append({"drafted": drafted, "accepted": accepted, **detail})

    @property
    def per_position_acceptance(self) -> list[float]:
        """Entry i: among steps that drafted a token at window position i+1, the share that accepted it."""
        out = []
        for i in range(self.max_drafted):
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
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "steps": self.steps,
            "gamma": self.gamma,
            "max_drafted": self.max_drafted,
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
    """What a method is asked to do: the models, the prompt, the budget, sampling and its raw options."""

    target: Transformer
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stats: GenerationStats
    draft: Transformer | None = None
    options: Any = None  # the method's options (a MethodOptions)
    bridge: TokenBridge | None = None  # the draft has a tokenizer of its own (methods registered ``bridged``)
    prefix_cache: PrefixCache | None = None  # the target's keys and values of earlier requests, to prefill less


@dataclass
class RequestState:
    """One request in flight: everything that changes as it decodes.

    Invariants between steps: ``target_cache`` holds ``tokens[:-1]``, or all of ``tokens`` while
    ``next_logits`` holds the target's logits after them (a whole-prompt prefill, see :class:`ChainScorer`);
    ``draft_cache`` holds ``tokens[:len(draft_cache)]`` and ``pending`` is the rest of ``tokens``, which the
    proposer feeds first.
    """

    request: DecodeRequest
    tokens: list[int]
    target_cache: KVCache
    draft_cache: KVCache | None = None
    pending: list[int] = field(default_factory=list)
    produced: int = 0
    next_logits: torch.Tensor | None = None
    limit: int | None = None  # draft rows this step may spend (a batch's speculation budget; None: no cap)
    batch: int = 1  # requests sharing this step's forwards (1: alone); methods may draft less for a busy batch

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling

    @property
    def stats(self) -> GenerationStats:
        return self.request.stats

    @property
    def room(self) -> int:
        """Most draft tokens a window may hold: the step's own token must still fit in ``max_new_tokens``, and a
        batch's speculation budget (``limit``) may cap it further (0: a plain step)."""
        room = self.request.max_new_tokens - self.produced - 1
        return room if self.limit is None else min(room, self.limit)

    def commit(self, draft: Proposal, verdict: Verdict) -> list[int]:
        """Append the verdict's tokens (the caches are the roles' to roll back)."""
        new = [*(draft.tokens[i] for i in verdict.nodes), verdict.next_token]
        self.tokens.extend(new)
        self.produced += len(new)
        return new


def point_masses(tokens: list[int], vocab: int) -> torch.Tensor | None:
    """Deterministic guesses (a suffix match's, a draft's through text) as the distributions they were drawn from,
    ``q = δ_x`` per token: what rejection sampling needs to take them like a model's draws (None: no guess)."""
    if not tokens:
        return None
    q = torch.zeros(len(tokens), vocab, dtype=torch.float64)
    q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return q


def draft_tokens(model: Transformer, tokens: list[int] | torch.Tensor) -> torch.Tensor:
    """``[1, T]`` ids for a draft model; ids past a smaller draft vocabulary (the target's padding rows) become 0,
    which can only change what the draft proposes, never what is committed. A tensor (tokens drawn on the device)
    stays there."""
    vocab = model.config.vocab_size
    if isinstance(tokens, torch.Tensor):
        ids = tokens.reshape(1, -1)
        return ids.masked_fill(ids >= vocab, 0)
    return send([t if t < vocab else 0 for t in tokens], model.device).view(1, -1)


# -- the roles ---------------------------------------------------------------------------------------------------


class Proposer(Protocol):
    """Drafts tokens and learns what the target kept (vLLM's proposer, HF's ``CandidateGenerator``)."""

    def start(self, state: RequestState) -> None:
        """Set up per-request state (a draft cache) before the first step."""

    def propose(self, state: RequestState) -> Proposal:
        """A draft of at most ``state.room`` window positions after ``state.tokens``."""

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        """The verdict of the last draft (``state.tokens`` already holds what was committed): roll back,
        adapt the window, prepare the next draft."""


class Scorer(Protocol):
    """Runs the target: the prefill, then one forward over each draft; keeps the target cache consistent."""

    def prefill(self, state: RequestState) -> int:
        """Feed the prompt; returns the forwards it took."""

    def score(self, state: RequestState, draft: Proposal) -> Scores: ...

    def commit(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        """Roll the target cache back to the committed tokens (call before ``state.commit``)."""


Verifier = Callable[[RequestState, Scores], Verdict]


class SpeculationBudget(Protocol):
    """Caps each step's draft rows from outside the method (:mod:`mirrorsd.batching`'s goodput rule: in a
    busy batch a draft row costs every request time, so it is spent only where it pays)."""

    def limit(self, state: RequestState) -> int | None: ...

    def batch(self) -> int:
        """Requests sharing each forward now."""
        ...


_budget = threading.local()


@contextmanager
def budgeted_by(budget: SpeculationBudget | None) -> Iterator[None]:
    """Cap this thread's windows by ``budget`` for the block (None: no cap)."""
    old = getattr(_budget, "hook", None)
    _budget.hook = budget
    try:
        yield
    finally:
        _budget.hook = old


def match(state: RequestState, scores: Scores) -> Verdict:
    """Greedy / sample-and-match on chains and trees: the target's own token at every position."""
    draft, position = scores.draft, len(state.tokens)
    if draft.parents is not None:
        return verify_tree(draft.tokens, draft.parents, scores.logits, position, state.params, own=scores.own)
    if scores.own is not None:
        return chain_verdict(draft.tokens, scores.own)
    positions = list(range(position, position + draft.length + 1))
    if not rows_apart(scores.logits, state.params):
        return verify_match(draft.tokens, scores.logits, positions, state.params)
    own = scores.own_ids if scores.own_ids is not None else \
        choose(scores.logits[:len(positions)], positions, state.params)  # every row's own token in one op
    if isinstance(draft, DrawnChain) and (draft.unread or scores.rider is not None):  # (a rider rides the read)
        return draft.verdict(own, scores.rider)
    return chain_verdict(draft.tokens, own.tolist())


def rejection(state: RequestState, scores: Scores) -> Verdict:
    """Speculative sampling on a chain (the target's distribution); greedy falls back to ``match``."""
    draft = scores.draft
    if state.params.greedy or draft.parents is not None:
        return match(state, scores)
    positions = list(range(len(state.tokens), len(state.tokens) + len(draft.tokens) + 1))
    return verify_rejection(draft.tokens, draft.probs, scores.logits, positions, state.params)


VERIFIERS: dict[str, Verifier] = {"match": match, "rejection": rejection}


class NoDraft:
    """The proposer of ``ar``: never drafts, so each step is one target forward."""

    def start(self, state: RequestState) -> None:
        pass

    def propose(self, state: RequestState) -> Proposal:
        return Proposal()

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        pass


class ChainScorer:
    """The target over ``[last committed, *draft]`` in one causal forward.

    ``whole_prompt``: prefill the whole prompt and keep its last row's logits for the first step, which then
    scores only the draft (no forward at all for an empty one: what ``ar`` does). Otherwise the first step scores
    the last prompt token with the draft (a draft model's proposer lags the target by that token anyway).
    """

    def __init__(self, model: Transformer, whole_prompt: bool = False, chooses: bool = True) -> None:
        self.model, self.whole_prompt = model, whole_prompt
        self.chooses = chooses  # the verifier takes the target's own token at every row (:func:`match`)

    def prefill(self, state: RequestState) -> int:
        prompt = self.unfilled(state)
        if not prompt:
            return 0
        ids = torch.tensor([prompt], device=self.model.device)
        if self.whole_prompt:
            state.next_logits = self.model(ids, cache=state.target_cache, last=1)[0]
        else:
            self.model.prefill(ids, state.target_cache)
        return 1

    def unfilled(self, state: RequestState) -> list[int]:
        """The prompt tokens the prefill runs: those the request's prefix cache, if any, does not restore (a
        whole-prompt prefill keeps at least its last token, to score it)."""
        prompt = state.tokens if self.whole_prompt else state.tokens[:-1]
        store = state.request.prefix_cache
        if store is not None:
            state.stats.cached_tokens = store.restore(prompt[:-1] if self.whole_prompt else prompt,
                                                      state.target_cache)
        return prompt[len(state.target_cache):]

    def score(self, state: RequestState, draft: Proposal) -> Scores:
        device = self.model.device
        if state.next_logits is not None:  # the prefill scored the last committed token already
            first, state.next_logits = state.next_logits, None
            if not draft.length:
                return Scores(first, draft, forwards=0)
            ids = draft.on(device)[None]
            return Scores(torch.cat([first, self.model(ids, cache=state.target_cache)[0]]), draft)
        ids = torch.cat([send([state.tokens[-1]], device), draft.on(device)])[None]
        if self.chooses and rows_apart(device, state.params):  # each row's own token inside the forward's graph
            logits, own = self.model.forward_and_choose(ids, state.params, cache=state.target_cache)
            return Scores(logits[0], draft, own_ids=own[0])
        return Scores(self.model(ids, cache=state.target_cache)[0], draft)

    def commit(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        state.target_cache.truncate(len(state.tokens) + verdict.accepted)


class RunAheadScorer(ChainScorer):
    """``ar``'s scorer where the device runs apart from the host (CUDA): the target's own token is chosen on the
    device and fed straight into the next forward, which is queued before the host reads the token. The host's work
    between steps (the loop's bookkeeping, the caller's detokenizing and stop checks) then overlaps that forward
    instead of adding to it, as gpt-fast keeps its tokens on the device for.

    The tokens are the ones :func:`match` picks (the same :func:`~mirrorsd.sampling.choose` on the same logits).
    A request stopped by EOS or a stop string wastes the forward run ahead of it; between steps the target cache
    then holds every committed token and ``next_logits`` the logits after them, as after a whole-prompt prefill.
    The forward run ahead also chooses the next token inside its graph (:meth:`~mirrorsd.model.Transformer.
    forward_and_choose`), so a step queues one replay and one copy."""

    def __init__(self, model: Transformer) -> None:
        super().__init__(model, whole_prompt=True)
        self.chosen: torch.Tensor | None = None  # the token the forward run ahead chose after ``next_logits``

    def score(self, state: RequestState, draft: Proposal) -> Scores:
        if draft.tokens:
            raise ValueError("RunAheadScorer scores empty drafts")
        if state.next_logits is None:  # not run ahead (a batch's member: its forwards wait for the batch's step)
            return super().score(state, draft)
        logits, state.next_logits = state.next_logits, None
        own, self.chosen = self.chosen if self.chosen is not None else \
            choose(logits, [len(state.tokens)], state.params), None
        read = read_soon(own)
        ahead = state.produced + 1 < state.request.max_new_tokens and batcher() is None
        if ahead:
            ahead_logits, chosen = self.model.forward_and_choose(own.view(1, 1), state.params,
                                                                 cache=state.target_cache)
            state.next_logits, self.chosen = ahead_logits[0], chosen[0]
        return Scores(logits, draft, forwards=int(ahead), own=read())

    def commit(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        """Nothing to roll back: the cache holds the committed tokens and the one run ahead on, if any."""


@dataclass
class Roles:
    """A method, as the loop runs it: its proposer, scorer and verifier, the configured window (for the
    stats) and what to release when the request ends."""

    proposer: Proposer
    scorer: Scorer
    verifier: Verifier
    gamma: int = 0
    close: Callable[[], None] | None = None
    log: Callable[[Scores, Verdict], dict[str, Any]] | None = None  # extra per-step details for step_log
    # A drafting step does work of its own beyond its draft rows (an SS pass: its stream rows, their head, pruning;
    # sd: its draft model's forwards):
    # the loop times its steps (``GenerationStats.step_s``), which a batch's goodput rule prices that work by.
    timed_steps: bool = False


@contextmanager
def timed(stats: GenerationStats, field_name: str) -> Iterator[None]:
    """Adds the block's wall time to a stats field."""
    start = time.perf_counter()
    try:
        yield
    finally:
        setattr(stats, field_name, getattr(stats, field_name) + time.perf_counter() - start)


def new_state(request: DecodeRequest) -> RequestState:
    capacity = len(request.prompt_ids) + request.max_new_tokens + 2
    draft_cache = request.draft.lease_cache(capacity) if request.draft is not None else None
    return RequestState(request, list(request.prompt_ids), request.target.lease_cache(capacity),
                        draft_cache, list(request.prompt_ids))


def run(request: DecodeRequest, roles: Roles) -> Iterator[list[int]]:
    """Decode ``request`` with ``roles``: yields the tokens each step commits, forever (the caller stops; the
    target's keys and values then go to the request's prefix cache, if it has one)."""
    state = new_state(request)
    leased = state.draft_cache
    stats = request.stats
    stats.gamma = roles.gamma
    proposer, scorer, verifier = roles.proposer, roles.scorer, roles.verifier
    try:
        with torch.inference_mode():
            with timed(stats, "prefill_s"):
                stats.target_forwards += scorer.prefill(state)
            proposer.start(state)
        budget = getattr(_budget, "hook", None)
        while True:
            with torch.inference_mode():
                state.limit = budget.limit(state) if budget is not None else None
                state.batch = budget.batch() if budget is not None else 1
                started = time.perf_counter()
                with timed(stats, "draft_s"):
                    draft = proposer.propose(state)
                with timed(stats, "target_s"):
                    scores = scorer.score(state, draft)
                    verdict = verifier(state, scores)
                    scorer.commit(state, scores, verdict)
                stats.target_forwards += scores.forwards
                new = state.commit(scores.draft, verdict)
                with timed(stats, "draft_s"):
                    proposer.feedback(state, scores, verdict)
                stats.draft_forwards += draft.forwards  # (known once the verdict is read: DrawnChain)
                detail = roles.log(scores, verdict) if roles.log is not None else {}
                if scores.draft.forwards:  # what a draft model's forwards read, for the planner's cost model
                    detail.update(draft_forwards=scores.draft.forwards, fed=scores.draft.fed)
                if not scores.forwards:  # (the prefill's logits served it: a cost model charges no forward)
                    detail.update(target_forwards=0)
                if state.limit is not None:
                    detail.update(limit=state.limit)
                if state.batch > 1:
                    detail.update(batch=state.batch)
                stats.record_step(scores.draft.depth, verdict.accepted, **detail)
                if roles.timed_steps:
                    stats.step_s.append(time.perf_counter() - started)
            yield new
    except GeneratorExit:  # the caller stopped it between steps, where the target cache holds committed tokens
        if request.prefix_cache is not None:
            request.prefix_cache.store(state.tokens, state.target_cache)
        raise
    finally:
        if roles.close is not None:
            roles.close()
        request.target.return_cache(state.target_cache)
        if leased is not None:  # (a method may have put a cache of its own in its place)
            request.draft.return_cache(leased)

