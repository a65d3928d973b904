"""A whole decoding method in one file: prompt-lookup (n-gram) drafting, registered as ``ngram-example``.

The proposer looks up the last ``ngram`` committed tokens (then fewer, down to one) in the committed text and
proposes what followed their latest earlier occurrence, up to γ tokens -- no draft model, no forward of its own.
The target scores the window with the stock :class:`ChainScorer` and the stock ``match`` verifier keeps the
target's own tokens, so the output equals ``ar``. Importing this module is all it takes: the API, ``mirrorsd
generate`` (``--method ngram-example --ngram 2``), ``mirrorsd methods``, ``mirrorsd bench --methods
ngram-example:gamma=4`` and the planner (through ``step_cost``) pick it up from the registry, and
``tests/decoding/test_conformance.py`` tests it like every other method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mirrorsd.decoding import MethodOptions, Proposal, RequestState, Roles, Scores, option, register
from mirrorsd.decoding.engine import ChainScorer, DecodeRequest, match
from mirrorsd.decoding.registry import at_least
from mirrorsd.verify import Verdict

NAME = "ngram-example"


@dataclass(frozen=True)
class NgramOptions(MethodOptions):
    gamma: int = option(4, "most draft tokens per verification window", check=at_least(1))
    ngram: int = option(2, "longest suffix of the committed text to look up (shorter ones are tried next)",
                        check=at_least(1))


def lookup(tokens: list[int], ngram: int, window: int) -> list[int]:
    """What followed the latest earlier occurrence of the last ``n`` tokens (``n = ngram .. 1``), at most
    ``window`` tokens; ``[]`` when none of those suffixes occurred before."""
    for n in range(min(ngram, len(tokens) - 1), 0, -1):
        key = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the occurrence must end before the last token
            if tokens[start:start + n] == key:
                return tokens[start + n:start + n + window]
    return []


class NgramProposer:
    def __init__(self, gamma: int, ngram: int) -> None:
        self.gamma, self.ngram = gamma, ngram

    def start(self, state: RequestState) -> None:
        pass

    def propose(self, state: RequestState) -> Proposal:
        window = min(self.gamma, state.room)
        return Proposal(lookup(state.tokens, self.ngram, window) if window > 0 else [])

    def feedback(self, state: RequestState, scores: Scores, verdict: Verdict) -> None:
        pass  # no cache of its own to roll back: the next lookup reads the committed tokens


def build(req: DecodeRequest, opts: NgramOptions) -> Roles:
    return Roles(NgramProposer(opts.gamma, opts.ngram), ChainScorer(req.target), match, gamma=opts.gamma)


def step_cost(costs: Any, step: dict[str, Any], opts: NgramOptions) -> float:
    """The lookup is free; a step is one target forward over the window and the last committed token."""
    return costs.target(step["drafted"] + 1)


METHOD = register(NAME, "prompt lookup: propose what followed the last n-gram's latest earlier occurrence",
                  needs_draft=False, options=NgramOptions, build=build, step_cost=step_cost)
