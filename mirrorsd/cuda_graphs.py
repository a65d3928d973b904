"""Decoding steps replayed as CUDA graphs: what makes a GPU step cost the GPU's time, not the host's.

Why: on an H200 an eager one-token forward of the 1.5B shape issues ~1,200 kernels and takes ~39 ms of host time
for ~3 ms of GPU work (``docs/gpu.md``), so ``ar``, every draft's rollout and every verification window run at the
host's pace. A graph captured per cache and window shape replays all of them with one call (gpt-fast's
``reduce-overhead`` idea, without ``torch.compile``).

Bit for bit the eager step: the same kernels on the same shapes (the batch-invariant path already pads every
GEMM to 64 rows and attends through one Triton kernel whatever the key count). Only what moves from step to step
moves to device tensors, which the captured graph reads at replay: the tokens, the cache positions where their keys
and values are written (``index_copy_``), and how many keys each query sees. A cache that grows gets new buffers,
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
    """The device-side inputs of a captured causal window (a graph cannot read Python ints)."""

    positions: torch.Tensor  # int64 [t]: where the window's keys and values go, and its rotary positions
    index: torch.Tensor  # int32 [1, 1, capacity]: the keys in position order (the attention kernel's gather list)
    count: torch.Tensor  # int32 [1, t]: how many of them each query sees (its position + 1)


#: Set while a window runs through static inputs: attention writes and reads the cache through it instead of the
#: Python lengths.
STATIC_STEP: ContextVar[StaticStep | None] = ContextVar("mirrorsd_static_step", default=None)


def enabled() -> bool:
    return _ENABLED.get()


@contextmanager
def cuda_graphs(on: bool) -> Iterator[None]:
    """``cuda_graphs(False)``: eager steps (``MIRRORSD_CUDA_GRAPHS=0`` sets the default), e.g. to time the
    host-bound path next to the replayed one."""
    token = _ENABLED.set(on)
    try:
        yield
    finally:
        _ENABLED.reset(token)


class StepGraph:
    """A causal window of ``t`` tokens over one cache's buffers, captured on its second use (a shape seen once,
    such as a draft's catch-up, never pays for a capture). The graphs of one cache share a memory pool: they run
    one after another and each output is copied out at once."""

    def __init__(self, rows: int, t: int, capacity: int, device: torch.device, pool: tuple | None) -> None:
        self.tokens = torch.zeros(rows, t, dtype=torch.long, device=device)
        self.offsets = torch.arange(t, device=device)
        self.static = StaticStep(positions=torch.zeros(t, dtype=torch.long, device=device),
                                 index=torch.arange(capacity, dtype=torch.int32, device=device).view(1, 1, -1),
                                 count=torch.ones(1, t, dtype=torch.int32, device=device))
        self.pool = pool if pool is not None or not self.tokens.is_cuda else torch.cuda.graph_pool_handle()
        self.uses = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def positions(self) -> torch.Tensor:
        """The window's positions ``[rows, t]``, read from the static inputs at replay."""
        return self.static.positions.view(1, -1).expand(self.tokens.shape)

    def __call__(self, tokens: torch.Tensor, position: int, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The output of ``tokens`` at ``position`` onwards; ``step`` runs the eager forward on :attr:`tokens` and
        :meth:`positions` (eagerly on first use and off CUDA, where Triton's interpreter runs the tests, and
        once more to capture)."""
        self.tokens.copy_(tokens)
        torch.add(self.offsets, position, out=self.static.positions)
        self.static.count.copy_(self.static.positions + 1)
        self.uses += 1
        if self.uses == 1 or not self.tokens.is_cuda:
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
        reset = STATIC_STEP.set(self.static)
        try:
            graph = torch.cuda.CUDAGraph()
            # thread_local: Mirror-SD's cuda-streams backend runs the target on another thread meanwhile. (The
            # first, eager use warmed up what capturing needs: cuBLAS handles, the Triton binary.)
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.out = step()
            self.graph = graph
        finally:
            STATIC_STEP.reset(reset)
