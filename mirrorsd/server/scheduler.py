"""Runs generation jobs on the engine behind a bounded queue, many at once (continuous batching).

The HTTP layer only ever calls :meth:`Scheduler.submit` and reads a job's events. Up to ``max_running`` jobs decode
at once, each on a worker thread of its own that is a member of one :class:`~mirrorsd.batching.Batcher`:
every step, one forward carries every running request's rows, and requests join and leave between steps. A job
that cannot batch (``Job.alone``: its draft runs outside the batch) waits for the running ones to finish and runs
by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..api import GenerationStream
from ..batching import Batcher
from ..errors import Cancelled
from ..execution import release_thread_team
from .protocol import APIError

log = logging.getLogger("mirrorsd.server")


@dataclass
class Event:
    """``started`` (the stream was built and checked), ``delta`` (a :class:`mirrorsd.api.StreamDelta`), ``done``
    (the :class:`mirrorsd.api.Generation`), ``error`` (an :class:`APIError`) or ``cancelled``."""

    kind: str
    value: Any = None
    at: float = field(default_factory=time.perf_counter)


class Job:
    """One request: how to build its stream, and the events the worker sends back to the request's loop."""

    def __init__(self, make_stream: Callable[[], GenerationStream], loop: asyncio.AbstractEventLoop,
                 on_step: Callable[[int, int], None] | None = None, alone: str | None = None) -> None:
        self.make_stream, self.loop, self.on_step = make_stream, loop, on_step
        self.alone = alone  # why this job cannot share a batch (None: it can)
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.arrival = time.perf_counter()
        self.stream: GenerationStream | None = None
        self.id = ""  # the response id, for the log

    def cancel(self) -> None:
        """Stop this job at its next step (or skip it if it is still queued): its client went away."""
        self.cancelled.set()

    def send(self, kind: str, value: Any = None) -> None:
        event = Event(kind, value)
        with contextlib.suppress(RuntimeError):  # the request's loop is gone (server stopped): nobody listens
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def next(self) -> Event:
        return await self.events.get()


class Scheduler:
    """``max_running`` worker threads sharing one :class:`Batcher`, and a queue of at most ``max_queued`` waiting
    jobs (429 beyond)."""

    LOOK_S = 0.1  # how often a job waiting for its place looks whether its client left

    def __init__(self, max_queued: int, max_running: int = 1, batcher: Batcher | None = None) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        self.max_running, self.max_queued = max_running, max_queued
        self.batcher = batcher if batcher is not None else Batcher()
        # unbounded, so stop() can always wake every worker; submit(), on the event loop's thread alone, bounds it.
        # (None: a worker's signal to end.) One lock for the queue and the busy count: ``waiting`` reads both.
        self._queue: deque[Job | None] = deque()
        self._ready = threading.Condition()
        self._threads = [threading.Thread(target=self._work, name=f"mirrorsd-engine-{i}", daemon=True)
                         for i in range(max_running)]
        self._stopping = False
        self._admission = threading.Condition()
        self._solo = False  # a job that runs alone is running or waiting for the others to finish
        self.running: set[Job] = set()
        self._busy = 0  # workers holding a job (taken from the queue, not yet finished)

    @property
    def waiting(self) -> int:
        """Jobs in the queue whose client is still there (one that left is skipped when its turn comes, and must not
        cost a live client a 429 meanwhile), less those an idle worker is about to take: a burst submitted before
        the idle workers wake got 429s while places were free."""
        with self._ready:
            queued = sum(job is not None and not job.cancelled.is_set() for job in self._queue)
            return max(0, queued - (self.max_running - self._busy))

    def start(self) -> None:
        """Start the workers. Every forward runs on them or the batcher's engine from now on, so the calling thread
        (the one that loaded the models, under ``mirrorsd serve``) ends its idle OpenMP team, which would otherwise
        cost each of their forwards ~25% on a small machine (:func:`~mirrorsd.execution.release_thread_team`)."""
        release_thread_team()
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> None:
        with self._ready:  # (stop() swaps the queue under this lock: a job appended after its sentinels hung)
            if self._stopping:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            # Jobs whose client left while queued go now, not when a worker reaches them: behind long answers, each
            # held its prompt and closure (~130 KB) and the queue grew without bound while no 429 was sent.
            gone = [queued for queued in self._queue if queued is not None and queued.cancelled.is_set()]
            if gone:
                self._queue = deque(q for q in self._queue if q is None or not q.cancelled.is_set())
                for queued in gone:
                    queued.send("cancelled")  # (what a worker taking it would have said)
            if self.waiting >= self.max_queued:
                raise APIError(429, f"too many requests: {self.max_queued} are waiting already; retry later",
                               code="queue_full")
            self._queue.append(job)
            self._ready.notify()

    def stop(self, timeout: float) -> None:
        """Refuse new jobs, cancel the waiting ones, give the running ones ``timeout`` seconds, then cancel them."""
        with self._ready:
            self._stopping = True
            left, self._queue = self._queue, deque([None] * len(self._threads))
            self._ready.notify_all()
        for job in left:
            if job is not None:
                job.send("error", APIError(503, "the server is shutting down", code="shutting_down"))
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            for job in list(self.running):
                job.cancel()
            for thread in self._threads:
                thread.join(5.0)

    def _admit(self, job: Job) -> bool:
        """Wait for a place: a job that runs alone waits until nothing runs, and nothing starts beside it. False: the
        job's client left while it waited (a job waiting to run alone holds every other admission, so it must not
        wait on for nobody)."""
        with self._admission:
            while self._solo and not job.cancelled.is_set():
                self._admission.wait(self.LOOK_S)
            if job.cancelled.is_set():
                return False
            if job.alone is not None:
                self._solo = True
                if self.running:
                    log.info("request %s runs alone once the %d running finish: %s", job.id, len(self.running),
                             job.alone)
                while self.running and not job.cancelled.is_set():
                    self._admission.wait(self.LOOK_S)
                if job.cancelled.is_set():
                    self._solo = False
                    self._admission.notify_all()
                    return False
            self.running.add(job)
            return True

    def _leave(self, job: Job) -> None:
        with self._admission:
            self.running.discard(job)
            if job.alone is not None:
                self._solo = False
            self._admission.notify_all()

    def _take(self) -> Job | None:
        """The next job, counted busy in the same step as it leaves the queue (``waiting`` reads both at once)."""
        with self._ready:
            while not self._queue:
                self._ready.wait()
            job = self._queue.popleft()
            self._busy += job is not None
            return job

    def _work(self) -> None:
        while True:
            job = self._take()
            if job is None:
                return
            try:
                if job.cancelled.is_set() or not self._admit(job):
                    job.send("cancelled")
                    continue
                try:
                    with self.batcher.member(job.cancelled):
                        self._run(job)
                except Cancelled:  # its client left while its prompt ran
                    job.send("cancelled")
                except APIError as e:
                    job.send("error", e)
                except Exception as e:  # a bug: the client gets a 500 without a traceback, the log keeps it
                    log.exception("generation failed")
                    job.send("error", APIError(500, f"internal error: {type(e).__name__}", code="internal_error"))
                finally:
                    self._leave(job)
            finally:
                with self._ready:
                    self._busy -= 1

    def _run(self, job: Job) -> None:
        try:
            stream = job.stream = job.make_stream()
        except (ValueError, FileNotFoundError) as e:  # mirrorsd.stream checks everything here: the request's fault
            raise APIError(400, str(e)) from None  # (past this point such an error is a bug: a 500, logged)
        job.send("started")
        stats = stream.request.stats
        seen = 0
        for delta in stream.deltas():
            if job.on_step is not None:
                for drafted, accepted in zip(stats.drafted[seen:], stats.accepted[seen:], strict=True):
                    job.on_step(drafted, accepted)
                seen = len(stats.accepted)
            job.send("delta", delta)
            if job.cancelled.is_set():
                stream.close()
                job.send("cancelled")
                return
        assert stream.result is not None
        job.send("done", stream.result)

