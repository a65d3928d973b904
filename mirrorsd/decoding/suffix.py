"""``suffix``: draft-free speculative decoding from suffix matches (SuffixDecoding, arXiv 2411.04975;
SAM-Decoding, arXiv 2411.10666; vLLM's ``ngram`` and ``suffix`` methods).

The proposer finds the longest suffix of the committed text that occurred before -- in the request's own
prompt and output, in earlier outputs of this process (:func:`~.suffix_index.shared_index`), or in the fixed
datastore of the model family's own chat answers (:func:`~.suffix_index.datastore`) -- and proposes the most
frequent continuation of its occurrences. The window is set by the evidence, not a fixed
γ: at most ``factor`` × the match length tokens, and each token only when it raises the expected tokens per
second, given its estimated acceptance and the measured cost of a longer window (:mod:`.lookup`, the proposer
this method shares with the hybrids). On a CPU where an 8-token verification costs 1.5-2.3× a 1-token forward,
a long window of guesses loses; a long window of a repeated passage wins.

The target scores the window with the stock chain scorer and the stock ``match`` verifier keeps its own
tokens, so the output equals ``ar`` (greedy and seeded sampling: under sample-and-match a deterministic guess
is accepted exactly when it is the target's own draw). The same proposer sits in front of a draft model in
``sd`` (``suffix_match``): SAM-Decoding's rule, the match's draft when it is at least that long, else the
model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .engine import ChainScorer, DecodeRequest, Roles, match
from .lookup import LookupSettings, suffix_proposer
from .registry import Method, MethodOptions, PlanInputs, Priced, at_least, option, probability, register


@dataclass(frozen=True)
class SuffixOptions(MethodOptions):
    gamma: int = option(LookupSettings.gamma, "most draft tokens per verification window", check=at_least(1))
    factor: float = option(LookupSettings.factor, "a window holds at most factor × the match length tokens "
                           "(SuffixDecoding's max_spec_factor)", check=(lambda v: v > 0, "must be > 0"))
    min_prob: float = option(LookupSettings.min_prob, "floor of the window rule: never draft a token whose "
                             "estimated probability of being accepted is below this (the learned cost of "
                             "verification usually stops the window earlier)", check=probability())
    min_match: int = option(LookupSettings.min_match, "shortest suffix match that drafts anything", check=at_least(1))
    shared: str = option(LookupSettings.shared, "earlier outputs to look up as well: none, process (this process's "
                         "requests), or persist (also saved under the cache folder across runs)",
                         choices=("none", "process", "persist"))
    datastore: str = option(LookupSettings.datastore, "a fixed index of the model family's own chat answers, "
                            "looked up when it matches longer than the request and the process do: auto (the one "
                            "shipped for the target's tokenizer, if any), none, or a path to a .json.gz of "
                            "scripts/make_suffix_datastore.py")


def build(req: DecodeRequest, opts: SuffixOptions) -> Roles:
    proposer = suffix_proposer(req, opts, gamma=opts.gamma)
    # The whole prompt in the prefill: a short answer should not pay a separate forward for its last token.
    return Roles(proposer, ChainScorer(req.target, whole_prompt=True), match, gamma=opts.gamma,
                 close=proposer.close)


def step_cost(costs: Any, step: dict[str, Any], opts: SuffixOptions) -> float:
    """The lookup costs microseconds; a step is one target forward over the window and the last token (none where
    the prefill's logits gave the step its token: the first, with nothing drafted)."""
    return costs.target(step["drafted"] + 1) if step.get("target_forwards", 1) else 0.0


#: The configurations the planner prices by running them: acceptance depends on how much the text repeats.
PLANNED = ({}, {"factor": 2.0})


def plan(inputs: PlanInputs, method: Method) -> list[Priced]:
    return [p for options in PLANNED if (p := inputs.calibrated(method.name, dict(options))) is not None]


register("suffix", "suffix decoding: propose what followed the longest earlier match of the text's suffix "
         "(prompt, output, earlier outputs); no draft model", needs_draft=False, options=SuffixOptions,
         build=build, step_cost=step_cost, plan=plan)
