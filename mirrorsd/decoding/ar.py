"""``ar``: the target alone with a KV cache -- the reference every speculative method must equal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .engine import ChainScorer, DecodeRequest, NoDraft, Roles, RunAheadScorer, match
from .registry import Method, MethodOptions, PlanInputs, Priced, register


@dataclass(frozen=True)
class AROptions(MethodOptions):
    """``ar`` takes no options."""


def build(req: DecodeRequest, opts: AROptions) -> Roles:
    """On CUDA the next forward is queued before the host reads a token (:class:`RunAheadScorer`); a CPU computes
    as it is asked, so there it would only waste a forward when EOS ends a request."""
    ahead = req.target.device.type == "cuda"
    return Roles(NoDraft(), RunAheadScorer(req.target) if ahead else ChainScorer(req.target, whole_prompt=True), match)


def step_cost(costs: Any, step: dict[str, Any], opts: AROptions) -> float:
    """One forward, none where the prefill's logits gave the step its token (the first, on a CPU)."""
    return costs.target(1) if step.get("target_forwards", 1) else 0.0


def plan(inputs: PlanInputs, method: Method) -> list[Priced]:
    return [Priced({}, 1.0, method.price(inputs.costs, {"drafted": 0}))]


register("ar", "the target alone, one token per forward (the reference every method equals)", needs_draft=False,
         options=AROptions, build=build, step_cost=step_cost, tensor_parallel=True, plan=plan)
