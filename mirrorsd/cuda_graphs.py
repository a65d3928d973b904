"""The decoder's layers replayed as CUDA graphs: what makes a GPU step cost the GPU's time, not the host's.

Why: on an H200 an eager one-token forward of the 1.5B shape issues ~1,200 kernels and takes ~25-39 ms of host
time for ~3 ms of GPU work (``docs/gpu.md``), so ``ar``, every verification window, every draft rollout and both
halves of Mirror-SD's target pass run at the host's pace. A graph captured per cache, layer range and window shape
replays a whole layer range with one call (gpt-fast's ``reduce-overhead`` idea, without ``torch.compile``).

Bit for bit the eager layers: the same kernels on the same shapes (:func:`~mirrorsd.execution.fused_layers`: GEMMs
on 64-row slabs, Triton kernels that compute each row alone, attention that takes each query's visible keys as a
gather list and a count). What moves from call to call moves to device tensors that the graph reads at replay: the
hidden states (or a whole forward's token ids), the rotary positions, the cache slots where keys and values are
written, and the gather lists and counts (a causal window's from its slots; a tree's from its mask, gathered
eagerly). A cache that grows gets new buffers, and so new graphs.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache

import torch

_ENABLED = ContextVar("mirrorsd_cuda_graphs", default=os.environ.get("MIRRORSD_CUDA_GRAPHS", "1") != "0")


@dataclass(frozen=True)
class StaticStep:
    """The device-side inputs of a captured window (a graph cannot read Python ints)."""

    positions: torch.Tensor  # int64 [rows, t]: rotary positions
    slots: torch.Tensor  # int64 [t]: the cache slots the window's keys and values go to
    index: torch.Tensor  # int32 [rows or 1, t, capacity]: each query's visible keys in order (a gather list)
    count: torch.Tensor  # int32 [rows or 1, t]: how many of them each query sees


_CAPTURING = threading.Lock()

Output = torch.Tensor | tuple[torch.Tensor, ...]  # what a captured body returns


def enabled() -> bool:
    return _ENABLED.get()


@contextmanager
def cuda_graphs(on: bool) -> Iterator[None]:
    """``cuda_graphs(False)``: eager layers (``MIRRORSD_CUDA_GRAPHS=0`` sets the default), e.g. to time the
    host-bound path next to the replayed one."""
    token = _ENABLED.set(on)
    try:
        yield
    finally:
        _ENABLED.reset(token)


class Captured:
    """A body of work on static device tensors, replayed as one CUDA graph: run as it is on its first call (the
    warm-up a capture needs) and wherever it is not on CUDA (Triton's interpreter runs the tests there), captured on
    the second and replayed after. A capture that raises leaves the body eager. The body's output is copied out
    at every replay, since the next replay overwrites it (a tuple's tensors each)."""

    def __init__(self, device: torch.device, pool: tuple | None) -> None:
        self.device = device
        self.pool = pool if pool is not None or device.type != "cuda" else torch.cuda.graph_pool_handle()
        self.uses = 0
        self.failed = False  # a capture that raised: the body stays eager
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Output | None = None

    def run(self, body: Callable[[], Output]) -> Output:
        self.uses += 1
        if self.graph is None and not self.failed and self.uses > 1 and self.device.type == "cuda":
            self._capture(body)
        if self.graph is None:
            return body()
        self.graph.replay()
        out = self.out
        return out.clone() if isinstance(out, torch.Tensor) else tuple(t.clone() for t in out)

    def _capture(self, body: Callable[[], Output]) -> None:
        device = self.device
        try:
            graph = torch.cuda.CUDAGraph()
            # On the model's own device and a capture stream of that device (PyTorch's default capture stream
            # lives on whichever device captured first: a draft on a second GPU would not be captured at all).
            # One capture at a time in the process (entering one synchronizes the device, which would invalidate
            # another thread's), and thread_local: other threads' work may go on meanwhile.
            with _CAPTURING, torch.cuda.device(device), torch.cuda.graph(
                    graph, pool=self.pool, stream=_capture_stream(device), capture_error_mode="thread_local"):
                self.out = body()
            self.graph = graph
        except Exception as error:  # noqa: BLE001 - a capture is an optimisation: run the body eagerly instead
            self.failed = True
            warnings.warn(f"CUDA graph capture failed ({type(error).__name__}: {error}); this {type(self).__name__}'s "
                          "shape runs eagerly", RuntimeWarning, stacklevel=5)


def run_if(flag: torch.Tensor, work: Callable[[], None], warm: bool = False) -> None:
    """``work`` where ``flag`` (a bool scalar on the device) holds when it runs. Inside a capture it becomes a CUDA
    graph conditional node (CUDA 12.4+: PyTorch's ``begin_capture_to_if_node``), so a replay decides on the device,
    without a host read, and skipping costs one tiny kernel; eagerly the host reads the flag, or with ``warm`` (a
    capture's warm-up, which should run every kernel the capture records) runs ``work`` anyway. So ``work`` writes
    its results into tensors made before it (what it allocates lives only in its own branch), and must change none
    of them where the flag is false. A PyTorch without conditional nodes captures ``work`` unconditioned (still one
    replay); a CUDA or driver without them fails the capture, and the body stays eager."""
    if flag.is_cuda and torch.cuda.is_current_stream_capturing():
        current = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
        graph = current() if current is not None else None
        if not hasattr(graph, "begin_capture_to_if_node"):
            work()
            return
        graph.begin_capture_to_if_node(flag)
        try:
            work()
        finally:
            graph.end_capture_to_conditional_node()
    elif warm or bool(flag):
        work()


class LayerGraph(Captured):
    """A layer range over one cache's buffers for windows of one shape. Made on the shape's second sight (a shape
    seen once, such as a prompt or a draft's catch-up, costs nothing), then run as :class:`Captured` runs it. The
    graphs of one cache share a memory pool: they run one after another and each output is copied out at once."""

    def __init__(self, inputs: torch.Tensor, capacity: int, mask_rows: int | None, pool: tuple | None) -> None:
        super().__init__(inputs.device, pool)
        rows, t = inputs.shape[:2]
        device = inputs.device
        with torch.inference_mode(False):  # written in place from no_grad code too, not only inference mode
            self.inputs = torch.zeros_like(inputs)  # hidden states [rows, t, width], or a whole forward's token ids
            keys = torch.arange(capacity, dtype=torch.int32, device=device)
            self.offsets = torch.arange(t, device=device)
            self.static = StaticStep(
                positions=torch.zeros(rows, t, dtype=torch.long, device=device),
                slots=torch.zeros(t, dtype=torch.long, device=device),
                # a causal window's queries share one gather list, as the eager path's zero-stride one
                index=keys.view(1, 1, -1) if mask_rows is None else keys.repeat(mask_rows, t, 1),
                count=torch.ones(1 if mask_rows is None else mask_rows, t, dtype=torch.int32, device=device))
            # a whole forward that chooses its tokens inside: the noise's stream key (sampling.keyed_uniforms)
            self.stream_key = torch.zeros((), dtype=torch.long, device=device)

    def __call__(self, inputs: torch.Tensor, positions: torch.Tensor, length: int,
                 visible: tuple[torch.Tensor, torch.Tensor] | None,
                 layers: Callable[[StaticStep], Output], stream_key: int | None = None) -> Output:
        """The layers' output for ``inputs`` at ``positions``, written to the cache slots after ``length``;
        ``visible``: a masked window's (index, count), else the window is causal. ``layers`` runs the layers on
        :attr:`inputs` and the static inputs it is given; ``stream_key`` goes to :attr:`stream_key`."""
        static = self.static
        self.inputs.copy_(inputs)
        if stream_key is not None:
            self.stream_key.fill_(stream_key)
        static.positions.copy_(positions)
        torch.add(self.offsets, length, out=static.slots)
        if visible is None:
            static.count.copy_(static.slots + 1)
        else:
            index, count = visible
            static.index[..., : index.shape[-1]].copy_(index)
            static.count.copy_(count)
        return self.run(lambda: layers(static))


@cache
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)
