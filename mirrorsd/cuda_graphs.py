"""One-token decoding replayed as a CUDA graph: what makes a GPU step cost the GPU's time, not the host's.

Why: on an H200 an eager one-token forward of the 1.5B shape issues ~1,200 kernels and takes ~39 ms of host time
for ~3 ms of GPU work (``docs/gpu.md``), so ``ar`` and every draft's rollout run at the host's pace. A graph
captured once per cache replays all of them with one call (gpt-fast's ``reduce-overhead`` idea, without
``torch.compile``).

Bit for bit the eager step: the same kernels on the same shapes (the batch-invariant path already pads every
GEMM to 64 rows and attends through one Triton kernel whatever the key count). Only what moves from step to step
moves to device tensors, which the captured graph reads at replay: the token, the cache position where the new key
and value are written (``index_copy_``), and how many keys the query sees. A cache that grows gets new buffers,
and so new graphs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

_ENABLED = ContextVar("mirrorsd_cuda_graphs", default=os.environ.get("MIRRORSD_CUDA_GRAPHS", "1") != "0")


@dataclass(frozen=True)
class StaticStep:
    """The device-side inputs of a captured step (a graph cannot read Python ints)."""

    position: torch.Tensor  # int64 [1]: where this step's key and value go, and its rotary position
    index: torch.Tensor  # int32 [1, 1, capacity]: the keys in position order (the attention kernel's gather list)
    count: torch.Tensor  # int32 [1, 1]: how many of them the query sees (position + 1)


#: Set while a step is captured: attention writes and reads the cache through it instead of Python lengths.
STATIC_STEP: ContextVar[StaticStep | None] = ContextVar("mirrorsd_static_step", default=None)


def enabled() -> bool:
    return _ENABLED.get()


@contextmanager
def cuda_graphs(on: bool) -> Iterator[None]:
    """``cuda_graphs(False)``: eager one-token steps (``MIRRORSD_CUDA_GRAPHS=0`` sets the default), e.g. to time
    the host-bound path next to the replayed one."""
    token = _ENABLED.set(on)
    try:
        yield
    finally:
        _ENABLED.reset(token)


class StepGraph:
    """``step(tokens [rows, 1])`` over one cache at a fixed capacity, captured on first use."""

    def __init__(self, rows: int, capacity: int, device: torch.device) -> None:
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.static = StaticStep(position=torch.zeros(1, dtype=torch.long, device=device),
                                 index=torch.arange(capacity, dtype=torch.int32, device=device).view(1, 1, -1),
                                 count=torch.ones(1, 1, dtype=torch.int32, device=device))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def positions(self) -> torch.Tensor:
        """The step's positions ``[rows, 1]``, read from the static position at replay."""
        return self.static.position.view(1, 1).expand(self.tokens.shape[0], 1)

    def __call__(self, tokens: torch.Tensor, position: int, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Logits of ``tokens`` at ``position``; ``step`` runs the eager forward on :attr:`tokens` and
        :meth:`positions` (it is called only to capture)."""
        self.tokens.copy_(tokens)
        self.static.position.fill_(position)
        self.static.count.fill_(position + 1)
        if not self.tokens.is_cuda:  # nothing to capture (Triton's interpreter on a CPU, in tests): run it as is
            reset = STATIC_STEP.set(self.static)
            try:
                return step()
            finally:
                STATIC_STEP.reset(reset)
        if self.graph is None:
            self._capture(step)
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites the static output

    def _capture(self, step: Callable[[], torch.Tensor]) -> None:
        device = self.tokens.device
        reset = STATIC_STEP.set(self.static)
        try:
            # Warm up on a side stream first (cuBLAS workspaces, the allocator): the documented capture recipe.
            # It writes this step's own key and value, which the replay writes again, identically.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: Mirror-SD's cuda-streams backend runs the target on another thread meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.out = step()
            self.graph = graph
        finally:
            STATIC_STEP.reset(reset)
