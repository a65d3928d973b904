"""``ar``: the target alone with a KV cache -- the reference every speculative method must equal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .engine import ChainScorer, DecodeRequest, NoDraft, Roles, match
from .registry import MethodOptions, register


@dataclass(frozen=True)
class AROptions(MethodOptions):
    """``ar`` takes no options."""


def build(req: DecodeRequest, opts: AROptions) -> Roles:
    return Roles(NoDraft(), ChainScorer(req.target, whole_prompt=True), match)


def step_cost(costs: Any, step: dict[str, Any], opts: AROptions) -> float:
    return costs.target(1)


register("ar", "the target alone, one token per forward (the reference every method equals)", needs_draft=False,
         options=AROptions, build=build, step_cost=step_cost)
