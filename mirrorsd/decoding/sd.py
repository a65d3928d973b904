"""``sd``: vanilla speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Invariant at the start of every step, with ``seq`` the committed tokens (prompt + output):
the target cache holds ``seq[:-1]``; the draft cache holds some prefix of ``seq`` and ``pending`` is the
rest. One step: the draft feeds ``pending`` and then proposes ``gamma`` tokens one at a time; the target
scores ``[seq[-1], d_1..d_gamma]`` in one forward; the verifier accepts ``A`` tokens and gives the
target's own next token; both caches roll back to what is committed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..model import Transformer
from ..sampling import DRAFT_STREAM, TARGET_STREAM, probabilities, sample
from ..verify import ACCEPTANCE_RULES, verify_match, verify_rejection
from .base import DecodeRequest, Timer

DEFAULT_GAMMA = 4


def check_draft(target: Transformer, draft: Transformer | None) -> Transformer:
    if draft is None:
        raise ValueError("speculative decoding needs a draft model (draft=... / --draft)")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}); the draft must share the target's tokenizer"
        )
    return draft


@torch.inference_mode()
def decode(req: DecodeRequest) -> Iterator[list[int]]:
    options = dict(req.options)
    gamma = int(options.pop("gamma", DEFAULT_GAMMA))
    rule = options.pop("acceptance", "match")
    if options:
        raise ValueError(f"unknown options for method 'sd': {sorted(options)}")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if rule not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {rule!r}")
    target, draft = req.target, check_draft(req.target, req.draft)
    params, stats, timer = req.sampling, req.stats, Timer(req.stats)
    rejection = rule == "rejection" and not params.greedy
    # Coupled drafting (same noise as the target) maximises sample-and-match acceptance; rejection
    # sampling needs the draft's draws independent of the target's acceptance noise.
    draft_stream = DRAFT_STREAM if rejection else TARGET_STREAM
    stats.gamma = gamma

    seq = list(req.prompt_ids)
    capacity = len(seq) + req.max_new_tokens + gamma + 2
    t_cache, d_cache = target.new_cache(capacity=capacity), draft.new_cache(capacity=capacity)
    pending = list(seq)
    with timer("prefill_s"):
        if len(seq) > 1:
            target(torch.tensor([seq[:-1]], device=target.device), cache=t_cache)
            stats.target_forwards += 1

    produced = 0
    while True:
        window = min(gamma, req.max_new_tokens - produced - 1)
        proposal: list[int] = []
        q_rows: list[torch.Tensor] = []
        with timer("draft_s"):
            for i in range(window):
                feed = pending if i == 0 else proposal[-1:]
                logits = draft(torch.tensor([feed], device=draft.device), cache=d_cache)[0, -1:]
                stats.draft_forwards += 1
                position = len(seq) + i
                proposal.append(sample(logits, [position], params, draft_stream)[0])
                if rejection:
                    q_rows.append(probabilities(logits, params)[0])
        with timer("target_s"):
            window_tokens = torch.tensor([[seq[-1], *proposal]], device=target.device)
            t_logits = target(window_tokens, cache=t_cache)[0]
            stats.target_forwards += 1
            positions = list(range(len(seq), len(seq) + len(proposal) + 1))
            if rejection:
                verdict = verify_rejection(proposal, torch.stack(q_rows) if q_rows else None, t_logits,
                                           positions, params)
            else:
                verdict = verify_match(proposal, t_logits, positions, params)
        if window:
            stats.accepted.append(verdict.accepted)
        new = verdict.committed(proposal)
        # Roll back: the target keeps seq + accepted; the draft keeps what it saw of the committed text.
        t_cache.truncate(len(seq) + verdict.accepted)
        drafted_len = len(seq) + max(len(proposal) - 1, 0) if window else len(d_cache)
        keep = min(drafted_len, len(seq) + verdict.accepted)
        d_cache.truncate(keep)
        seq.extend(new)
        pending = seq[keep:]
        produced += len(new)
        yield new
