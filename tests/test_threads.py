"""OpenMP teams (:func:`mirrorsd.execution.release_thread_team`): a thread whose forwards move to other threads ends
its idle team, because one idle team anywhere makes every other team's workers sleep between parallel regions
(libgomp then manages more threads than there are cores), which cost a batcher's engine ~25% of each forward.

A team's workers are native threads of the process, so ``/proc/self/task`` counts them: after a release, a second
one has nothing left to end."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

import mirrorsd
from mirrorsd import kernels
from mirrorsd.batching import Batcher
from mirrorsd.distill.engine import Settings, Shards, run
from mirrorsd.distill.prompts import Prompt
from mirrorsd.execution import _omp_pause, release_thread_team
from mirrorsd.server.scheduler import Scheduler
from tests.helpers import requires_smollm2, row_exact, tiny_hf

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2
                                or _omp_pause() is None,
                                reason="counts a GNU OpenMP team's native threads in /proc (needs 2 cores)")


@pytest.fixture(autouse=True)
def two_threads():
    """Teams of two, even where the suite runs on one intra-op thread per pytest-xdist worker."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_work() -> None:
    """A reduction well above ATen's grain: it runs on a team of ``torch.get_num_threads()`` threads."""
    torch.rand(1 << 22).sum()


def settled_tasks() -> int:
    """``tasks()`` once no thread has come or gone for 50 ms: threads of other code (a batcher's engine, its team)
    may still be ending, and would pass for this thread's team."""
    count = tasks()
    for _ in range(100):
        time.sleep(0.05)
        count, before = tasks(), count
        if count == before:
            break
    return count


def holds_a_team() -> bool:
    """Whether the calling thread has a team to end (ending it, if so)."""
    before = settled_tasks()
    release_thread_team()
    return tasks() < before


def on_a_thread(body: Callable[[], object]) -> object:
    """``body``'s result on a fresh thread (whose team starts and ends with it); its error is raised here."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            with torch.inference_mode():
                out["value"] = body()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_release_ends_the_callers_idle_team_and_a_new_region_starts_another() -> None:
    def body() -> tuple[int, int, int, bool]:
        before = settled_tasks()
        parallel_work()
        with_team = settled_tasks()
        release_thread_team()
        after = settled_tasks()
        parallel_work()
        return before, with_team, after, holds_a_team()

    before, with_team, after, again = on_a_thread(body)
    assert with_team == before + torch.get_num_threads() - 1
    assert after == before
    assert again


@pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")
def test_a_batcher_member_keeps_no_team_through_its_forwards_nor_after_it_leaves(monkeypatch) -> None:
    """Its forwards run on the engine's team: its own team ends before each forward it hands over (an op of its own
    between forwards, an argmax, may have started one), and when it leaves (a server's worker that ran a request
    alone would otherwise keep one between requests). (A lone member runs its forwards itself: off here.)"""
    monkeypatch.setattr(Batcher, "_claim_solo", lambda self, me: False)
    model = row_exact(tiny_hf(layers=2))
    cache = model.new_cache()
    batcher = Batcher()

    def body() -> tuple[bool, bool, bool]:
        with batcher.member():
            parallel_work()
            model(torch.tensor([[1, 2, 3]]), cache=cache)
            after_forward = holds_a_team()
            parallel_work()
        return after_forward, holds_a_team(), batcher.total_steps > 0

    after_forward, after_leaving, batched = on_a_thread(body)
    assert batched  # the forward did go through the batcher
    assert not after_forward
    assert not after_leaving


@pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")
def test_a_lone_member_runs_its_forwards_on_its_own_team_and_ends_it_when_it_leaves() -> None:
    """Alone in its batcher, a member's forwards run on its own thread (no engine thread, its step still logged),
    and it keeps its team through them, as a request alone does (one handed over ends it first); leaving ends it."""
    model = row_exact(tiny_hf(layers=2))
    cache = model.new_cache()
    batcher = Batcher()

    def body() -> tuple[bool, bool, bool, bool]:
        with batcher.member():
            parallel_work()
            model(torch.tensor([[1, 2, 3]]), cache=cache)
            engine = batcher._engine is not None
            kept = holds_a_team()
            parallel_work()
        return engine, kept, holds_a_team(), batcher.total_steps > 0

    engine, kept, after_leaving, logged = on_a_thread(body)
    assert not engine
    assert kept
    assert not after_leaving
    assert logged


def test_starting_the_servers_workers_ends_the_callers_team() -> None:
    """The thread that loaded the models (``mirrorsd serve``'s main thread) runs no forward once the workers run."""
    scheduler = Scheduler(max_queued=1)

    def body() -> bool:
        parallel_work()
        scheduler.start()
        return holds_a_team()

    try:
        assert not on_a_thread(body)
    finally:
        scheduler.stop(timeout=5.0)


@requires_smollm2
def test_distillation_hands_its_callers_team_over_to_the_engine(tmp_path) -> None:
    target = mirrorsd.load_model("smollm2-135m", weights="q8", progress=False)
    shards = Shards(tmp_path, Settings("smollm2-135m", max_new_tokens=4), [Prompt(0, "qa", ("Name a colour.",)),
                                                                          Prompt(1, "math", ("What is 2 + 3?",))])

    def body() -> tuple[int, bool]:
        parallel_work()
        answered = run(target, shards, batch=2, progress=False)["answered"]
        return answered, holds_a_team()

    assert on_a_thread(body) == (2, False)
