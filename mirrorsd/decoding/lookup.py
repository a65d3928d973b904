"""The suffix lookup: draft-free proposals from suffix matches (SuffixDecoding, arXiv 2411.04975; SAM-Decoding,
arXiv 2411.10666), shared by method ``suffix`` and by every method that puts it in front of a draft model.

:class:`SuffixProposer` finds the longest suffix of the committed text that occurred before -- in the request's own
prompt and output, in earlier outputs of this process (:func:`~.suffix_index.shared_index`), or in the fixed
datastore of the model family's own chat answers (:func:`~.suffix_index.datastore`) -- and proposes the most
frequent continuation of its occurrences, as long as each token raises the expected tokens per second
(:class:`AcceptanceModel`, :class:`VerifyCost`). :class:`SuffixFirst` is SAM-Decoding's hybrid: the match's draft
when it is long enough, else the draft model's (``sd``, ``ss`` and ``mirror``'s ``suffix_match``), with
:class:`ModelGate` deciding by measurement whether the model drafts at all.

It lives outside the methods' packages so that no method imports another's (tests/test_layers.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache import cache_dir
from ..verify import Verdict
from .engine import DecodeRequest, Proposal, Proposer, RequestState, Scores, point_masses
from .registry import at_least, option
from .suffix_index import SuffixIndex, datastore, persisting_allowed, shared_index


class AcceptanceModel:
    """What the verifier has done with this request's suffix drafts, as probabilities for the next one.

    A draft's first token is accepted with a probability that grows with the match length (bucketed: 1, 2, 3,
    4-7, 8+); each later token given the previous one was, with a rate of its own. Both are Beta posteriors
    whose priors (``FIRST_PRIOR``, ``NEXT_PRIOR``, weight ``PRIOR_WEIGHT`` observations) were measured on the
    default pair. A token's estimate is this times its frequency among the match's continuations.
    """

    FIRST_PRIOR = {1: 0.15, 2: 0.3, 3: 0.45, 4: 0.6, 8: 0.75}  # bucket lower bound -> first-token acceptance
    NEXT_PRIOR = 0.8
    PRIOR_WEIGHT = 4.0

    def __init__(self) -> None:
        self.first = {b: [p * self.PRIOR_WEIGHT, self.PRIOR_WEIGHT] for b, p in self.FIRST_PRIOR.items()}
        self.next = [self.NEXT_PRIOR * self.PRIOR_WEIGHT, self.PRIOR_WEIGHT]

    def _bucket(self, match: int) -> list[float]:
        return self.first[max(b for b in self.first if b <= match)]

    def first_token(self, match: int) -> float:
        hits, tries = self._bucket(match)
        return hits / tries

    def next_token(self) -> float:
        return self.next[0] / self.next[1]

    def observe(self, match: int, drafted: int, accepted: int) -> None:
        bucket = self._bucket(match)
        bucket[0] += accepted > 0
        bucket[1] += 1
        reached = min(accepted, drafted - 1)  # later tokens whose predecessor was accepted
        self.next[0] += min(accepted, drafted) - (accepted > 0)
        self.next[1] += reached


class VerifyCost:
    """The target's step time as ``a + b·k`` for a k-token window, learned from this request's own steps (timed
    from the proposal to its verdict): ``ratio`` = b / a is what one more window token costs, in 1-token
    forwards. It grows with the context (attention) and differs per machine and weight format, so it is
    measured, not configured; ``PRIOR_RATIO`` holds until both an empty and a non-empty window were timed."""

    PRIOR_RATIO = 0.1
    DECAY = 0.8  # weight of the old estimate in each update

    def __init__(self) -> None:
        self.base: float | None = None  # seconds of a step with an empty window
        self.per_token: float | None = None  # extra seconds per window token

    def observe(self, window: int, seconds: float) -> None:
        ema = lambda old, new: new if old is None else self.DECAY * old + (1 - self.DECAY) * new  # noqa: E731
        if window == 0:
            self.base = ema(self.base, seconds)
        elif self.base is not None:
            self.per_token = ema(self.per_token, max(0.0, seconds - self.base) / window)

    @property
    def ratio(self) -> float:
        if self.base is None or self.per_token is None or self.base <= 0:
            return self.PRIOR_RATIO
        return min(1.0, self.per_token / self.base)


@dataclass(frozen=True)
class LookupSettings:
    """What a :class:`SuffixProposer` looks up and how long its windows grow: the defaults of method ``suffix``'s
    options (which document each field) and of the lookup in front of a draft model."""

    gamma: int = 16
    factor: float = 1.0
    min_prob: float = 0.1
    min_match: int = 1
    shared: str = "process"
    datastore: str = "auto"


#: The lookup in front of a draft model (the hybrids): ``suffix``'s defaults, less the datastore, whose matches were
#: measured against no draft at all, not against a draft model's own guesses.
HYBRID_LOOKUP = LookupSettings(datastore="none")


def suffix_match_option(default: int = 0) -> Any:
    """The hybrid's option, shared by the model-drafting methods (on by default where it measured faster)."""
    return option(default, "hybrid: draft from a suffix match (as method suffix) when it matched at least this "
                  "many tokens, else from the draft model; 0 turns the suffix proposer off", check=at_least(0))


class SuffixProposer:
    """Drafts the most frequent continuation of the longest earlier occurrence of the text's suffix.

    ``fixed``: the datastore, consulted only when it matches strictly longer than the request's own text and
    the shared index, since a continuation seen in this very request is the better guess at equal length
    (replaying the proposer over ``assist``'s answers, merging equal-length matches lost 0.6% where this rule
    gained 1.4%; docs/drafting.md). Its drafts keep acceptance statistics of their own: a match in other answers
    is weaker evidence than one here.

    ``target_vocab`` with ``rejection``: drafts carry one-hot distributions (a deterministic guess is a draw
    from a point mass), so a rejection-sampling verifier can take them next to a model's draws.
    """

    def __init__(self, gamma: int, *, factor: float = 1.0, min_prob: float = 0.1, min_match: int = 1,
                 shared: SuffixIndex | None = None, persist: Path | None = None, fixed: SuffixIndex | None = None,
                 target_vocab: int = 0, rejection: bool = False) -> None:
        self.gamma, self.factor, self.min_prob, self.min_match = gamma, factor, min_prob, min_match
        self.shared, self.persist, self.fixed = shared, persist, fixed
        self.target_vocab, self.rejection = target_vocab, rejection
        self.index = SuffixIndex()
        self.doc = -1
        self.prompt_len = 0
        self.last_match = 0  # match length behind the last draft (0: none)
        self.after_prefill = False
        self.last: Proposal | None = None
        self.proposed_at = 0.0
        self.acceptance = AcceptanceModel()  # of drafts from the request's text and the shared index
        self.fixed_acceptance = AcceptanceModel()  # of drafts from the datastore
        self.last_fixed = False  # the last draft came from the datastore
        self.cost = VerifyCost()

    def start(self, state: RequestState) -> None:
        self.doc = self.index.add(state.tokens)
        self.prompt_len = len(state.tokens)
        self.after_prefill = True  # the first step reuses the prefill's last row: its time is no step's cost

    def propose(self, state: RequestState, min_match: int | None = None) -> Proposal:
        """A draft, or an empty one when no suffix of at least ``min_match`` tokens occurred before."""
        window = min(self.gamma, state.room)
        self.last_match = 0
        self.last_fixed = False
        self.last = Proposal()
        self.proposed_at = time.perf_counter()
        if window <= 0:
            return self.last
        text = self.index.docs[self.doc]
        found = self.index.continuations(text, window)
        if self.shared is not None:
            with self.shared.lock:
                found = self.shared.continuations(text, window, into=found)
        if self.fixed is not None:
            stored = self.fixed.continuations(text, window)
            if stored is not None and (found is None or stored.length > found.length):
                found, self.last_fixed = stored, True
        if found is None or found.length < (min_match or self.min_match):
            self.last_fixed = False
            return self.last
        acceptance = self.fixed_acceptance if self.last_fixed else self.acceptance
        tokens = self.chain(found.root, min(window, math.ceil(self.factor * found.length)),
                            acceptance.first_token(found.length), acceptance)
        self.last_match = found.length if tokens else 0
        self.last = Proposal(tokens, probs=point_masses(tokens, self.target_vocab) if self.rejection else None)
        return self.last

    def chain(self, node: Any, limit: int, first: float, acceptance: AcceptanceModel) -> list[int]:
        """Follow the most frequent child while the next token pays for itself.

        ``p``, the estimated probability that the verifier accepts the path through the next token, is
        ``first`` for the first token, then the observed rate, times each token's frequency among the
        occurrences. With a step costing ``a + b·k`` and ``S`` tokens expected so far, one more token raises the
        expected tokens per second iff ``p > (b/a)·(1 + S) / (1 + (b/a)·k)``; ``min_prob`` is a floor."""
        out: list[int] = []
        p, expected, ratio = first, 0.0, self.cost.ratio
        while node.children and len(out) < limit:
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            p *= child.count / node.count * (acceptance.next_token() if out else 1.0)
            if p < max(self.min_prob, ratio * (1 + expected) / (1 + ratio * len(out))):
                break
            out.append(token)
            expected += p
            node = child
        return out

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        self.index.extend(self.doc, state.tokens[len(self.index.docs[self.doc]):])
        if not scores.scored(self.last):
            return  # a hybrid's model drafted this window
        if self.after_prefill:  # (an empty window there costs nothing; timing it would zero the base cost)
            self.after_prefill = False
        else:
            self.cost.observe(len(self.last.tokens), time.perf_counter() - self.proposed_at)
        if self.last.tokens:
            acceptance = self.fixed_acceptance if self.last_fixed else self.acceptance
            acceptance.observe(self.last_match, len(self.last.tokens), verdict.accepted)

    def close(self) -> None:
        """Give the request's output to the shared index (and save it when persisting)."""
        if self.shared is None or self.doc < 0:
            return
        output = self.index.docs[self.doc][self.prompt_len:]
        if not output:
            return
        with self.shared.lock:
            self.shared.add(output)
        if self.persist is not None:
            self.shared.save(self.persist)


GATES = ("always", "measured")  # sd's model_gate: see ModelGate


class StepRate:
    """Tokens committed per second by one kind of step, from exponential averages of both."""

    DECAY = 0.7  # weight of the old averages in each update

    def __init__(self) -> None:
        self.tokens = self.seconds = 0.0
        self.steps = 0

    def add(self, tokens: int, seconds: float) -> None:
        keep = self.DECAY if self.steps else 0.0
        self.tokens = keep * self.tokens + (1 - keep) * tokens
        self.seconds = keep * self.seconds + (1 - keep) * seconds
        self.steps += 1

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class ModelGate:
    """Whether the draft model drafts when the suffix match is short, decided by measurement (``measured``).

    A draft model pays only where it is accepted often enough to cover its own forwards: on this CPU the 0.5B
    draft costs ~0.5x the 1.5B target per token, so on code it doubles the speed and on translation it loses a
    quarter. The gate times both kinds of step on this request, proposal to verdict -- model-drafted steps and
    suffix-only ones (the suffix proposer's own window rule, an empty window when nothing matches) -- and keeps
    the faster, re-trying the other for ``PROBE_STEPS`` steps after ``backoff`` steps (doubled after each probe
    that loses, up to ``MAX_BACKOFF``), like ArcticInference picking whichever promises more per step. It only
    changes which proposer drafts, never what the verifier commits. ``always`` keeps the model on."""

    PROBE_STEPS = 3
    FIRST_BACKOFF = 4
    MAX_BACKOFF = 64

    def __init__(self, measured: bool) -> None:
        self.measured = measured
        self.current = "suffix" if measured else "model"  # a short answer then never pays the draft's prefill
        self.rates = {"model": StepRate(), "suffix": StepRate()}
        self.backoff = self.countdown = self.FIRST_BACKOFF
        self.probe_left = 0  # > 0: trying the other kind of step
        self.switches = 0

    @property
    def kind(self) -> str:
        """The kind of step to take now when the suffix match is short."""
        if not self.measured:
            return "model"
        other = "suffix" if self.current == "model" else "model"
        return other if self.probe_left else self.current

    def observe(self, kind: str, tokens: int, seconds: float) -> None:
        if not self.measured:
            return
        self.rates[kind].add(tokens, seconds)
        if self.probe_left:
            self.probe_left -= 1
            if not self.probe_left:
                won = self.rates[kind].per_s > self.rates[self.current].per_s
                if won:
                    self.current, self.switches = kind, self.switches + 1
                self.backoff = self.FIRST_BACKOFF if won else min(2 * self.backoff, self.MAX_BACKOFF)
                self.countdown = self.backoff
            return
        self.countdown -= 1
        if not self.countdown:
            self.probe_left = self.PROBE_STEPS


class SuffixFirst:
    """SAM-Decoding's hybrid: the suffix match's draft when the match is at least ``min_match`` tokens long,
    else the wrapped proposer's -- or, when ``gate`` measures that suffix-only steps commit more tokens per
    second, the suffix proposer's own shorter draft (:class:`ModelGate`). The wrapped proposer always gets the
    verdict (a draft model's cache simply lags behind after a suffix step: its ``pending`` grows). ``tree``: the
    wrapped proposer drafts trees, so a suffix chain is given as a one-branch tree."""

    def __init__(self, lookup: SuffixProposer, model: Proposer, min_match: int, tree: bool = False,
                 gate: ModelGate | None = None) -> None:
        self.lookup, self.model, self.min_match, self.tree = lookup, model, min_match, tree
        self.gate = gate or ModelGate(measured=False)
        self.source = "model"  # which proposer drafted the last window
        self.timed: str | None = None  # the gate's kind of step, when the last one was the gate's choice
        self.proposed_at = 0.0

    def start(self, state: RequestState) -> None:
        self.lookup.start(state)
        self.model.start(state)

    def propose(self, state: RequestState) -> Proposal:
        self.proposed_at = time.perf_counter()
        self.timed = None
        if getattr(self.model, "ready", None) is not None:  # a window the model holds already (Mirror-SD's kept
            return self._from_model(state)  # branch): drafted and free, where a lookup could only replace it
        draft = self.lookup.propose(state)  # one lookup: the match length decides, the suffix-only step reuses it
        if self.lookup.last_match < self.min_match:  # no draft, or one from too short a match
            self.timed = self.gate.kind
            if self.timed == "model":
                if state.draft_cache is not None and not len(state.draft_cache):
                    self.timed = None  # the draft's prompt prefill: paid once, whichever kind of step wins
                return self._from_model(state)
        self.source = "suffix"
        if self.tree:
            draft.parents = list(range(-1, len(draft.tokens) - 1))
        return draft

    def _from_model(self, state: RequestState) -> Proposal:
        draft = self.model.propose(state)
        self.source = getattr(self.model, "source", "model")  # Mirror-SD's says "branch" or "model"
        return draft

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        if self.timed is not None:
            self.gate.observe(self.timed, verdict.accepted + 1, time.perf_counter() - self.proposed_at)
        self.lookup.feedback(state, scores, verdict)
        self.model.feedback(state, scores, verdict)

    def log(self, scores: Scores, verdict: Verdict) -> dict[str, Any]:
        return {"source": self.source, **({"gate": self.timed} if self.gate.measured else {})}


def suffix_proposer(req: DecodeRequest, opts: Any, *, gamma: int, rejection: bool = False) -> SuffixProposer:
    """The proposer with ``opts``' lookup settings (a :class:`LookupSettings` or method ``suffix``'s options: the
    same fields), wired to this process's shared index and the datastore for
    the target's tokenizer (keyed by vocabulary size: ids mean nothing across tokenizers)."""
    shared = persist = None
    vocab = req.target.config.vocab_size
    key = f"vocab{vocab}"
    if opts.shared != "none":
        shared = shared_index(key)
        if opts.shared == "persist" and persisting_allowed():
            persist = cache_dir() / "suffix" / f"{key}.json"
            with shared.lock:
                if not shared.docs and persist.exists():
                    shared.load(persist)
    return SuffixProposer(gamma, factor=opts.factor, min_prob=opts.min_prob, min_match=opts.min_match,
                          shared=shared, persist=persist, fixed=datastore(opts.datastore, key, vocab),
                          target_vocab=vocab,
                          rejection=rejection and not req.sampling.greedy)
