"""Runs generation jobs on the engine behind a bounded queue.

The HTTP layer only ever calls :meth:`Scheduler.submit` and reads a job's events, so a scheduler that batches
requests (continuous batching) can replace this one without touching the routes. This one runs one job at a
time on a worker thread: the models' forwards already use every core, and one request's KV caches are its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..api import GenerationStream
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
                 on_step: Callable[[int, int], None] | None = None) -> None:
        self.make_stream, self.loop, self.on_step = make_stream, loop, on_step
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
    """One worker thread, a queue of at most ``max_queued`` waiting jobs (429 beyond), one running job."""

    max_running = 1

    def __init__(self, max_queued: int) -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queued)
        self._thread = threading.Thread(target=self._work, name="mirrorsd-engine", daemon=True)
        self._stopping = False
        self.running: Job | None = None

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(429, f"too many requests: {self._queue.maxsize} are waiting already; retry later",
                           code="queue_full") from None

    def stop(self, timeout: float) -> None:
        """Refuse new jobs, cancel the waiting ones, give the running one ``timeout`` seconds, then cancel it."""
        self._stopping = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.send("error", APIError(503, "the server is shutting down", code="shutting_down"))
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive() and self.running is not None:
            self.running.cancel()
            self._thread.join(5.0)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                job.send("cancelled")
                continue
            self.running = job
            try:
                self._run(job)
            except APIError as e:
                job.send("error", e)
            except (ValueError, FileNotFoundError) as e:  # checks in mirrorsd.stream: the request's fault
                job.send("error", APIError(400, str(e)))
            except Exception as e:  # a bug: the client gets a 500 without a traceback, the log keeps it
                log.exception("generation failed")
                job.send("error", APIError(500, f"internal error: {type(e).__name__}", code="internal_error"))
            finally:
                self.running = None

    def _run(self, job: Job) -> None:
        stream = job.stream = job.make_stream()
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

