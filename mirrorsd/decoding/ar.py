"""``ar``: the target alone with a KV cache -- the reference every speculative method must equal."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..sampling import sample
from .base import DecodeRequest, Timer


def decode(req: DecodeRequest) -> Iterator[list[int]]:
    if req.options:
        raise ValueError(f"method 'ar' takes no options, got {sorted(req.options)}")
    return _run(req)


@torch.inference_mode()
def _run(req: DecodeRequest) -> Iterator[list[int]]:
    target, stats, timer = req.target, req.stats, Timer(req.stats)
    cache = target.new_cache(capacity=len(req.prompt_ids) + req.max_new_tokens + 1)
    position = len(req.prompt_ids)  # absolute position of the next token
    with timer("prefill_s"):
        logits = target(torch.tensor([req.prompt_ids], device=target.device), cache=cache, last=1)[0]
    stats.target_forwards += 1
    while True:
        token = sample(logits, [position], req.sampling)[0]
        yield [token]
        position += 1
        with timer("target_s"):
            logits = target(torch.tensor([[token]], device=target.device), cache=cache)[0, -1:]
        stats.target_forwards += 1
