"""Execution backends: where the draft's work runs while the target continues.

A method hands the draft's job to :meth:`Executor.submit` and keeps computing on the calling thread; the
result is read with ``future.result()``. One small interface, four placements:

* ``serial``: the job runs when its result is asked for -- the same math with no overlap (the reference,
  and the baseline the overlap gain is measured against).
* ``threads``: a draft worker thread with its own intra-op thread count (PyTorch's count is per thread), so
  the cores are split between the target (``target_threads`` while the two overlap) and the draft.
* ``cuda-streams``: one GPU; the worker issues the draft's kernels on its own CUDA stream, or (``inline``) the
  caller does, right after it has issued the target's upper layers (:class:`InlineStreamExecutor`).
* ``devices``: target and draft on two devices (``cuda:0``/``cuda:1``, ``cuda``/``cpu``); the worker runs the
  draft on its own device. Only token ids cross between them.
* ``processes``: the draft in its own OS process, a torch.distributed token channel between them
  (:mod:`mirrorsd.runtime.processes`); the method talks to it through that channel instead of :meth:`submit`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TypeVar

import torch

from ..cuda_graphs import cuda_graphs

T = TypeVar("T")

BACKENDS = ("serial", "threads", "cuda-streams", "devices", "processes")


class Executor:
    """``serial``: deferred execution on the caller's thread."""

    name = "serial"
    #: Whether a job is issued after the caller's overlapping work instead of before it (:class:`InlineStreamExecutor`)
    issues_after_target = False

    def submit(self, job: Callable[[], T]) -> Future[T]:
        return _Deferred(job)

    def overlapping(self) -> AbstractContextManager[None]:
        """Wrap the caller's work that runs while a submitted job may be running (sets its thread count)."""
        return nullcontext()

    def close(self) -> None:
        pass

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Deferred(Future):
    """A future whose job runs, on the caller's thread, when the result is first asked for."""

    def __init__(self, job: Callable[[], T]) -> None:
        super().__init__()
        self._job = job

    def result(self, timeout: float | None = None) -> T:
        if self._job is not None:
            job, self._job = self._job, None
            try:
                self.set_result(job())
            except BaseException as e:  # noqa: BLE001 - re-raised by Future.result, like a worker's error
                self.set_exception(e)
        return super().result(timeout)


class WorkerExecutor(Executor):
    """One draft worker thread (``threads``, ``cuda-streams``, ``devices``)."""

    def __init__(self, name: str, draft_device: torch.device, draft_threads: int | None,
                 target_threads: int | None, graphs: bool = False) -> None:
        self.name = name
        self.graphs = graphs  # CUDA graphs stay on while the two sides overlap (Mirror-SD's overlap_graphs)
        self.total_threads = torch.get_num_threads()
        self.target_threads = target_threads
        self.stream = torch.cuda.Stream(draft_device) if name == "cuda-streams" else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="mirrorsd-draft",
                                       initializer=self._init_worker, initargs=(draft_threads,))

    @staticmethod
    def _init_worker(draft_threads: int | None) -> None:
        if draft_threads:
            torch.set_num_threads(draft_threads)

    def submit(self, job: Callable[[], T]) -> Future[T]:
        # The job reads what the caller queued on its stream before submitting (the draft's cache, a window and the
        # exit's candidates still on the device): the worker's stream waits for that point.
        issued = None
        if self.stream is not None:
            issued = torch.cuda.Event()
            issued.record(torch.cuda.current_stream(self.stream.device))

        def run() -> T:
            # Grad and inference modes are thread-local: the worker must enter them itself.
            # Unless ``graphs``, the worker's layers run eagerly, as the target's do while they overlap
            # (overlapping()): on an H200 a CUDA-graph capture on one thread was invalidated by the other's work
            # (cuda-streams), and neither the per-device capture streams nor the capture lock made since has run on
            # a GPU yet.
            with torch.inference_mode(), self._eager(), \
                    (torch.cuda.stream(self.stream) if self.stream else nullcontext()):
                if issued is not None:
                    self.stream.wait_event(issued)
                try:
                    return job()
                finally:  # a failed job too: its queued kernels may still write the cache the caller takes back
                    if self.stream is not None:
                        self.stream.synchronize()

        # The caller's settings (cuda_graphs, batch_invariance) are context variables, which a pool's thread does not
        # inherit: the job runs in a copy of the caller's context, so ``graphs`` means "as the caller has them".
        return self.pool.submit(contextvars.copy_context().run, run)

    @contextmanager
    def overlapping(self) -> Iterator[None]:
        with self._eager(), ThreadCount(self.target_threads, self.total_threads) if self.target_threads \
                else nullcontext():
            yield

    def _eager(self) -> AbstractContextManager:
        """Graphs off while the sides overlap, unless ``graphs`` (then as the caller has them)."""
        return nullcontext() if self.graphs else cuda_graphs(False)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class InlineStreamExecutor(Executor):
    """``cuda-streams`` without a thread: the caller issues the draft's job itself, onto a second CUDA stream, after
    it has issued the work the job overlaps (:attr:`issues_after_target`). Kernel launches return at once, so the two
    streams run side by side on the device while one host thread issues both: no worker competing for the GIL, and
    CUDA graphs as the caller has them (no capture on one thread while another issues). The job may end by reading
    its results on the host; that waits for its own stream only, after the target's kernels are queued. Off CUDA
    (tests) the job simply runs on the caller's thread."""

    name = "cuda-streams"
    issues_after_target = True

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: torch.cuda.Event | None = None  # the caller's stream before the work the job overlaps

    @contextmanager
    def overlapping(self) -> Iterator[None]:
        """Mark the caller's stream before the work the next job overlaps: the job waits for that point (the
        draft's cache was last written there), not for the work after it, which would serialise the two."""
        if self.stream is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(self.stream.device))
        yield

    def submit(self, job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        try:
            if self.stream is None:
                future.set_result(job())
            else:
                ready, self.ready = self.ready, None
                if ready is None:  # nothing overlaps: wait for all the caller has issued
                    self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
                else:
                    self.stream.wait_event(ready)
                try:
                    with torch.cuda.stream(self.stream):
                        out = job()
                finally:  # the caller's later work on that cache must follow the job's, even one that failed
                    torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
                future.set_result(out)
        except BaseException as error:  # noqa: BLE001 - re-raised by Future.result, like a worker's error
            future.set_exception(error)
        return future


class ThreadCount(AbstractContextManager):
    def __init__(self, inside: int, outside: int) -> None:
        self.inside, self.outside = inside, outside

    def __enter__(self) -> None:
        torch.set_num_threads(self.inside)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.outside)


def split_threads(total: int | None = None) -> tuple[int, int] | None:
    """(target, draft) intra-op threads while they overlap: the target, the slower half, gets the larger half
    of ``total`` (default: PyTorch's thread count). None when there is nothing to split (one thread). The
    executors and the planner both use it, so what the planner times is what runs."""
    total = torch.get_num_threads() if total is None else total
    if total < 2:
        return None
    draft = total // 2
    return total - draft, draft
