"""The server's scheduler on its own, with streams that need no model: shutdown, cancellation while waiting for a
place, and which errors are the request's fault."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from mirrorsd.server.protocol import APIError
from mirrorsd.server.scheduler import Job, Scheduler


class EndlessStream:
    """A stream whose steps never end until it is closed (a long answer); ``fail_at``: raise ValueError there."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.request = SimpleNamespace(stats=SimpleNamespace(drafted=[], accepted=[]))
        self.result = None
        self.fail_at = fail_at
        self.closed = False

    def deltas(self):
        step = 0
        while not self.closed:
            if step == self.fail_at:
                raise ValueError("a bug deep in decoding")
            step += 1
            time.sleep(0.005)
            yield SimpleNamespace(token_ids=[1], text="x")

    def close(self) -> None:
        self.closed = True


def run_jobs(body) -> None:
    """Run ``body(loop)`` in a fresh event loop (the jobs send their events to it)."""
    async def main() -> None:
        await body(asyncio.get_running_loop())
    asyncio.run(main())


async def first_event(job: Job, kind: str, timeout: float = 10.0):
    """The job's first event of ``kind`` (others skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        event = await asyncio.wait_for(job.next(), max(0.01, deadline - time.monotonic()))
        if event.kind == kind:
            return event


def test_stop_never_blocks_on_the_queue_when_every_worker_is_busy():
    """With fewer queue places than workers, waking every worker used to block on the full queue while they all
    decoded: the shutdown timeout never started and the running jobs were never cancelled."""
    async def body(loop) -> None:
        scheduler = Scheduler(max_queued=1, max_running=3)
        scheduler.start()
        jobs = [Job(EndlessStream, loop) for _ in range(3)]
        for job in jobs:
            scheduler.submit(job)
            await first_event(job, "started")  # taken off the queue before the next one goes in
        stopper = threading.Thread(target=scheduler.stop, args=(0.3,), daemon=True)
        began = time.monotonic()
        stopper.start()
        for job in jobs:
            await first_event(job, "cancelled")
        await asyncio.to_thread(stopper.join, 20)
        assert not stopper.is_alive() and time.monotonic() - began < 10
        assert all(not thread.is_alive() for thread in scheduler._threads)
    run_jobs(body)


def test_a_job_whose_client_leaves_while_it_waits_to_run_alone_never_starts():
    """A job that must run alone waits for the running ones and holds every other admission meanwhile; once its
    client has left it gives its place up instead of building its stream for nobody."""
    async def body(loop) -> None:
        scheduler = Scheduler(max_queued=4, max_running=2)
        scheduler.start()
        built: list[str] = []
        running = Job(EndlessStream, loop)
        scheduler.submit(running)
        await first_event(running, "started")

        def solo_stream() -> EndlessStream:
            built.append("solo")
            return EndlessStream()

        solo = Job(solo_stream, loop, alone="its draft runs outside the batch")
        scheduler.submit(solo)
        deadline = time.monotonic() + 10
        while not scheduler._solo:  # it waits for `running` to finish
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        solo.cancel()
        await first_event(solo, "cancelled")
        assert not scheduler._solo and built == []
        other = Job(EndlessStream, loop)  # the place it held is free again
        scheduler.submit(other)
        await first_event(other, "started")
        running.cancel()
        other.cancel()
        await asyncio.to_thread(scheduler.stop, 5.0)
    run_jobs(body)


def test_a_bad_request_is_a_400_but_an_error_while_decoding_is_a_500():
    """``mirrorsd.stream`` checks every argument before the first token, so a ValueError there is the request's
    fault; one raised while decoding is a bug, which the client must not be told was its own."""
    async def body(loop) -> None:
        scheduler = Scheduler(max_queued=4, max_running=1)
        scheduler.start()

        def bad_request() -> EndlessStream:
            raise ValueError("the prompt is empty")

        rejected = Job(bad_request, loop)
        scheduler.submit(rejected)
        error = (await first_event(rejected, "error")).value
        assert error.status == 400 and "the prompt is empty" in str(error.body())
        broken = Job(lambda: EndlessStream(fail_at=3), loop)
        scheduler.submit(broken)
        await first_event(broken, "started")
        error = (await first_event(broken, "error")).value
        assert error.status == 500 and "a bug" not in str(error.body())
        await asyncio.to_thread(scheduler.stop, 5.0)
    run_jobs(body)


def test_a_queued_job_whose_client_left_frees_its_place():
    """The queue holds one; a waiting job whose client left is skipped when its turn comes, and meanwhile a live
    client gets its place instead of a 429."""
    async def body(loop) -> None:
        scheduler = Scheduler(max_queued=1, max_running=1)
        scheduler.start()
        running = Job(EndlessStream, loop)
        scheduler.submit(running)
        await first_event(running, "started")
        left = Job(EndlessStream, loop)
        scheduler.submit(left)
        assert scheduler.waiting == 1
        left.cancel()
        assert scheduler.waiting == 0
        live = Job(EndlessStream, loop)
        scheduler.submit(live)  # no 429
        running.cancel()
        await first_event(left, "cancelled")
        await first_event(live, "started")
        live.cancel()
        await asyncio.to_thread(scheduler.stop, 5.0)
    run_jobs(body)


def test_jobs_whose_clients_left_do_not_pile_up_in_the_queue():
    """Behind a long answer, every client that gave up while queued stayed in the queue (its prompt and closure, ~130
    KB each) until a worker reached it, and the queue grew without bound while no 429 was sent."""
    async def body(loop) -> None:
        scheduler = Scheduler(max_queued=2, max_running=1)
        scheduler.start()
        running = Job(EndlessStream, loop)
        scheduler.submit(running)
        await first_event(running, "started")
        gone = []
        for _ in range(50):
            job = Job(EndlessStream, loop)
            scheduler.submit(job)
            job.cancel()
            gone.append(job)
        assert len(scheduler._queue) <= 1  # (the last one, pruned at the next submit)
        for job in gone[:-1]:
            assert (await first_event(job, "cancelled")).kind == "cancelled"
        running.cancel()
        await asyncio.to_thread(scheduler.stop, 5.0)
    run_jobs(body)


def test_a_burst_fills_every_free_place_before_any_429():
    """Jobs submitted before the idle workers woke counted as waiting: a burst of no more than the free places got
    429s (a load generator's first wave did)."""
    async def body(loop) -> None:
        scheduler = Scheduler(max_queued=2, max_running=4)
        scheduler.start()
        jobs = [Job(EndlessStream, loop) for _ in range(6)]
        for job in jobs:  # at once: 4 places running and 2 waiting, however far the workers got
            scheduler.submit(job)
        try:
            scheduler.submit(Job(EndlessStream, loop))
            raise AssertionError("the seventh job found a place")
        except APIError as e:
            assert e.status == 429
        for job in jobs[:4]:
            await first_event(job, "started")
        assert scheduler.waiting == 2
        for job in jobs:
            job.cancel()
        await asyncio.to_thread(scheduler.stop, 5.0)
    run_jobs(body)


def test_a_job_whose_client_left_during_its_prompt_ends_cancelled_not_failed():
    """The batcher stops a cancelled job's prompt between chunks by raising Cancelled in its forward
    (tests/test_batching.py): the job ends as cancelled, not as a 500, and its worker takes the next job."""
    from mirrorsd.errors import Cancelled

    class CancelledPrompt(EndlessStream):
        def deltas(self):
            raise Cancelled()
            yield

    async def body(loop) -> None:
        scheduler = Scheduler(max_queued=4, max_running=1)
        scheduler.start()
        left = Job(CancelledPrompt, loop)
        scheduler.submit(left)
        events = [(await left.next()).kind, (await left.next()).kind]
        assert events == ["started", "cancelled"]
        after = Job(lambda: EndlessStream(fail_at=2), loop)
        scheduler.submit(after)
        assert (await first_event(after, "error")).value.status == 500
        await asyncio.to_thread(scheduler.stop, 5.0)
    run_jobs(body)
